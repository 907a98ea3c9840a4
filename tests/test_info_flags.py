"""`rawdisk info`'s nbdinfo questions: --size, --can FLAG and --is FLAG
(exit 0 true, 2 false, 1 an error) answered as nbdinfo answers them on
the same export, --map[=CONTEXT] printed as nbdinfo --map prints it, and
whether the connection used TLS."""

import json
import os
import subprocess

import pytest

import servers
from helpers import MiB, assert_export_is, connected, make_image, random_bytes
from tlspki import tls_uri

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")

# nbdinfo 1.14's names; rawdisk knows a few more.
NBDINFO_CAN = ["cache", "connect", "df", "fast-zero", "flush", "fua", "multi-conn", "read",
               "structured-reply", "trim", "write", "zero"]
NBDINFO_IS = ["read-only", "rotational", "tls"]


def rawdisk(*args):
    return subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                          timeout=60)


def nbdinfo(*args):
    return subprocess.run(["nbdinfo", *args], capture_output=True, text=True, timeout=60)


def sparse_image(workdir, name="disk.img"):
    """8 MiB of 64 KiB islands in holes, grown at 1 MiB and 5 MiB."""
    path, model = make_image(workdir, name, 8 * MiB, sparse=True)
    for off, n, seed in ((MiB, 3 * 65536, 1), (5 * MiB + 4096, 65536, 2)):
        data = random_bytes(n, seed=seed)
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(data)
        model[off:off + n] = data
    return path, model


@pytest.mark.parametrize("read_only", [False, True])
def test_size_can_and_is_agree_with_nbdinfo(workdir, serve, read_only):
    path, model = sparse_image(workdir)
    srv = serve(path, read_only=read_only)
    uri = srv.printed_uri
    r = rawdisk("info", "--size", uri)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{8 * MiB}\n", "")
    assert nbdinfo("--size", uri).stdout == r.stdout
    answers = {}
    for opt, names in (("--can", NBDINFO_CAN), ("--is", NBDINFO_IS)):
        for name in names:
            mine = rawdisk("info", opt, name, uri)
            theirs = nbdinfo(opt, name, uri)
            assert (mine.stdout, mine.stderr) == ("", ""), (opt, name, mine.stderr)
            assert mine.returncode == theirs.returncode, (opt, name, mine.returncode, theirs)
            answers[opt, name] = mine.returncode
    assert answers["--can", "write"] == (2 if read_only else 0)
    assert answers["--is", "read-only"] == (0 if read_only else 2)
    assert answers["--is", "tls"] == 2
    # rawdisk's extra names.
    assert rawdisk("info", "--can", "block-status", uri).returncode == 0
    assert rawdisk("info", "--can", "extended-headers", uri).returncode == 0
    assert_export_is(uri, model)


def test_questions_about_a_local_file_and_mistakes(workdir):
    path, _ = sparse_image(workdir)
    r = rawdisk("info", "--size", path)
    assert (r.returncode, r.stdout) == (0, f"{8 * MiB}\n")
    assert rawdisk("info", "--can", "write", path).returncode == 0
    assert rawdisk("info", "--is", "tls", path).returncode == 2
    assert rawdisk("info", "--is", "read-only", path).returncode == (2 if os.geteuid() == 0
                                                                     or os.access(path, os.W_OK)
                                                                     else 0)
    # A question only a server answers fails (1); an unknown name is a bad
    # command line (2).
    for args, status in ((("--can", "trim", path), 1), (("--can", "tirm", path), 2),
                         (("--is", "writable", path), 2)):
        r = rawdisk("info", *args)
        assert r.returncode == status and r.stderr.count("\n") == 1 and r.stdout == "", (args, r)
    r = rawdisk("info", "--map", path)
    assert r.returncode == 2 and "rawdisk info --help" in r.stderr, r.stderr
    r = rawdisk("info", "--size", "--list", "nbd://localhost")
    assert r.returncode == 2, r.stderr


def test_map_prints_as_nbdinfo_does(workdir, serve):
    path, model = sparse_image(workdir)
    srv = serve(path)
    for extra in ((), ("--json",)):
        theirs = nbdinfo("--map", *extra, srv.printed_uri)
        assert theirs.returncode == 0, theirs.stderr
        out = ("--output", "json") if extra else ()
        mine = rawdisk("info", "--map", *out, srv.printed_uri)
        assert mine.returncode == 0, mine.stderr
        assert mine.stdout == theirs.stdout
        mine = rawdisk("info", "--map=base:allocation", *out, srv.printed_uri)
        assert mine.stdout == theirs.stdout
    runs = json.loads(rawdisk("info", "--map", "--output", "json", srv.printed_uri).stdout)
    # make_image's 64 KiB islands at each MiB, two of them grown.
    got = [(e["offset"], e["length"], e["type"]) for e in runs]
    assert (MiB, 3 * 65536, 0) in got and (5 * MiB, 4096 + 65536, 0) in got, got
    assert (MiB + 3 * 65536, MiB - 3 * 65536, 3) in got, got
    r = rawdisk("info", "--map=rawdisk:changed:none", srv.printed_uri)
    assert r.returncode == 1 and "rawdisk:changed:none" in r.stderr, r.stderr
    assert_export_is(srv.printed_uri, model)


def test_map_of_a_checkpoint(workdir, serve):
    path, model = sparse_image(workdir)
    r = rawdisk("checkpoint", "create", "--name", "mon", path)
    assert r.returncode == 0, r.stderr
    srv = serve(path, extra=["--track-changes"])
    with connected(srv.printed_uri) as h:
        h.pwrite(b"\x77" * 4096, 3 * MiB)
        h.flush()
    model[3 * MiB:3 * MiB + 4096] = b"\x77" * 4096
    ctx = "--map=rawdisk:changed:mon"
    mine = rawdisk("info", ctx, srv.printed_uri)
    assert mine.returncode == 0, mine.stderr
    grain = 65536
    assert mine.stdout == (f"{0:>10}  {3 * MiB:>10}    0  unchanged\n"
                           f"{3 * MiB:>10}  {grain:>10}    1  changed\n"
                           f"{3 * MiB + grain:>10}  {5 * MiB - grain:>10}    0  unchanged\n")
    theirs = nbdinfo(ctx, srv.printed_uri)
    assert theirs.returncode == 0, theirs.stderr
    # nbdinfo has no words for rawdisk's flags; the columns are the same.
    assert [line.split()[:3] for line in theirs.stdout.splitlines()] == \
        [line.split()[:3] for line in mine.stdout.splitlines()]
    assert_export_is(srv.printed_uri, model)


def test_says_whether_the_connection_used_tls(workdir, serve, pki):
    path, model = sparse_image(workdir)
    srv = serve(path, extra=["--tls", "on", "--tls-certificates", pki["srv"]])
    plain = srv.printed_uri
    tls = tls_uri(srv, f"tls-certificates={pki['cli-nocert']}")
    for uri, used in ((plain, False), (tls, True)):
        r = rawdisk("info", "--output", "json", uri)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["TLS"] is used
        human = rawdisk("info", uri).stdout
        words = "with TLS" if used else "without TLS"
        assert f"protocol:             newstyle-fixed {words}," in human, human
        assert rawdisk("info", "--is", "tls", uri).returncode == (0 if used else 2)
        assert nbdinfo("--is", "tls", uri).returncode == (0 if used else 2)
    assert_export_is(plain, model)
