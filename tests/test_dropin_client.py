"""`rawdisk copy` and `rawdisk info` with nbdcopy's, qemu-img's and
nbdinfo's flags (issue 39, 4): info --json, --content, --map --totals and
every --can/--is name nbdinfo 1.14 takes, answered as nbdinfo answers on the
same export (an unknown name: exit 2 with the list); copy -W, --synchronous
and --no-extents, seen from the source server's --stats; sizes in hex as
qemu-img takes them; qemu's legacy nbd:unix:PATH and nbd:HOST:PORT URIs
wherever an NBD URI is taken."""

import json
import os
import subprocess

import pytest

import servers
from helpers import MiB, assert_target_is, make_image, write_target

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")

# Every name nbdinfo 1.14's man page lists after --can or --is; nbdinfo
# takes each after either.
NBDINFO_NAMES = ["cache", "connect", "df", "fast-zero", "flush", "fua", "multi-conn", "read",
                 "structured-reply", "trim", "write", "zero", "read-only", "readonly",
                 "rotational", "tls"]


def rawdisk(*args, **kw):
    return subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                          timeout=60, **kw)


def run(*argv):
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60)


def sparse_image(workdir, name="disk.img"):
    """4 MiB: data in the first MiB and at 3 MiB, holes elsewhere."""
    path, model = make_image(workdir, name, 4 * MiB, seed=51, sparse=True)
    path = os.path.join(workdir, name)
    with open(path, "wb") as f:
        f.truncate(4 * MiB)
    model = bytearray(4 * MiB)
    for off in (0, 3 * MiB):
        data = bytes((i * 7 + off // MiB) % 251 + 1 for i in range(MiB))
        write_target(path, data, off)
        model[off:off + MiB] = data
    return path, model


# -- info --can / --is -----------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--read-only"], ["--discard=ignore"]],
                         ids=["rw", "ro", "no-trim"])
def test_every_can_and_is_name_answers_as_nbdinfo(workdir, serve, extra):
    """Each name under --can and under --is: rawdisk info's exit status is
    nbdinfo's, on a writable, a read-only and a no-trim export (the
    answers differ between them, so both must follow the export)."""
    path, _ = sparse_image(workdir)
    srv = serve(path, extra=extra)
    seen = {}
    for opt in ("--can", "--is"):
        for name in NBDINFO_NAMES:
            want = run("nbdinfo", opt, name, srv.uri).returncode
            got = rawdisk("info", opt, name, srv.uri)
            assert want in (0, 2), (opt, name, want)
            assert got.returncode == want, (opt, name, want, got.returncode, got.stderr)
            assert got.stdout == "", (opt, name, got.stdout)
            seen[opt, name] = want
    assert seen["--can", "write"] == (2 if extra == ["--read-only"] else 0)
    assert seen["--is", "readonly"] == (0 if extra == ["--read-only"] else 2)
    assert seen["--can", "trim"] == (0 if not extra else 2)


def test_extended_headers_is_yes_only_when_negotiated(workdir, serve):
    """rawdisk's server negotiates extended headers with rawdisk's client:
    0; nbdkit 1.32 has none: 2 (nbdinfo 1.14 does not know the name)."""
    path, _ = sparse_image(workdir)
    srv = serve(path)
    assert rawdisk("info", "--can", "extended-headers", srv.uri).returncode == 0
    doc = json.loads(rawdisk("info", "--json", srv.uri).stdout)
    assert doc["extended-headers"] is True, doc
    ref = servers.Server(workdir, path, kind="nbdkit").start()
    try:
        r = rawdisk("info", "--can", "extended-headers", ref.uri)
        assert r.returncode == 2, r.stderr
        assert json.loads(rawdisk("info", "--json", ref.uri).stdout)["extended-headers"] is False
    finally:
        ref.terminate()


def test_unknown_can_name_is_a_usage_error_with_the_list(workdir, serve):
    """nbdinfo exits 1 for an unknown name; rawdisk, like every bad command
    line, exits 2 with one line listing the names, before connecting."""
    path, _ = sparse_image(workdir)
    for opt in ("--can", "--is"):
        r = rawdisk("info", opt, "bogus", "nbd+unix:///?socket=/nonexistent.sock")
        assert r.returncode == 2, (opt, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        for name in NBDINFO_NAMES + ["extended-headers", "block-status"]:
            assert name in lines[0], (name, lines[0])
    # A local target takes the names that need no server.
    assert rawdisk("info", "--is", "readonly", path).returncode == 2
    assert rawdisk("info", "--can", "write", path).returncode == 0


# -- info --json, --content, --map --totals --------------------------------------

def test_json_is_output_json(workdir, serve):
    path, _ = sparse_image(workdir)
    srv = serve(path)
    for target in (path, srv.uri):
        a = json.loads(rawdisk("info", "--json", target).stdout)
        b = json.loads(rawdisk("info", "--output", "json", target).stdout)
        assert a == b
    listed = json.loads(rawdisk("info", "--list", "--json", srv.uri).stdout)
    assert listed["exports"][0]["export-size"] == 4 * MiB


def test_content_says_what_the_bytes_look_like(workdir, serve):
    """--content adds nbdinfo's content line and JSON key: "data" for a
    raw disk, the format for an image of another (read as raw)."""
    path, _ = sparse_image(workdir)
    qcow = os.path.join(workdir, "disk.qcow2")
    assert run("qemu-img", "create", "-f", "qcow2", qcow, "1M").returncode == 0
    srv = serve(path)
    # nbdinfo asks file(1), which names random bytes as it likes: only the
    # place of the key is compared.
    ref = run("nbdinfo", "--json", "--content", srv.uri)
    assert "content" in json.loads(ref.stdout)["exports"][0]
    doc = json.loads(rawdisk("info", "--json", "--content", srv.uri).stdout)
    assert doc["exports"][0]["content"] == "data", doc
    assert "content: data" in rawdisk("info", "--content", path).stdout
    assert "content" not in rawdisk("info", "--no-content", path).stdout
    q = serve(qcow, extra=["-f", "raw"])
    doc = json.loads(rawdisk("info", "--json", "--content", q.uri).stdout)
    assert doc["exports"][0]["content"] == "qcow2 image", doc


def test_map_totals_is_nbdinfos(workdir, serve):
    """--map --totals, text and JSON, byte for byte what nbdinfo prints on
    the same export; --totals alone is a usage error."""
    path, _ = sparse_image(workdir)
    srv = serve(path)
    want = run("nbdinfo", "--map", "--totals", srv.uri)
    got = rawdisk("info", "--map", "--totals", srv.uri)
    assert got.returncode == 0 and got.stdout == want.stdout, (got.stdout, want.stdout)
    assert "2097152  50.0%   3 hole,zero" in got.stdout, got.stdout
    want = run("nbdinfo", "--map", "--totals", "--json", srv.uri)
    got = rawdisk("info", "--map", "--totals", "--json", srv.uri)
    assert json.loads(got.stdout) == json.loads(want.stdout), got.stdout
    assert rawdisk("info", "--totals", srv.uri).returncode == 2


# -- sizes in hex ------------------------------------------------------------------

def test_hex_sizes_as_qemu_img(workdir):
    """0x100000, 0X1000 and 0x1E00 (E a digit): the sizes qemu-img makes of them; 0x1M, which
    qemu-img refuses, is refused; too large says the limit."""
    for spelled in ("0x100000", "0X1000", "0x1E00"):
        ours, theirs = (os.path.join(workdir, f"{who}-{spelled}.img") for who in ("r", "q"))
        assert rawdisk("create", ours, spelled).returncode == 0
        assert run("qemu-img", "create", "-f", "raw", theirs, spelled).returncode == 0
        assert os.path.getsize(ours) == os.path.getsize(theirs), spelled
    assert os.path.getsize(os.path.join(workdir, "r-0x100000.img")) == MiB
    bad = os.path.join(workdir, "bad.img")
    assert run("qemu-img", "create", "-f", "raw", bad, "0x1M").returncode == 1
    r = rawdisk("create", bad, "0x1M")
    assert r.returncode == 2 and "no suffix" in r.stderr, r.stderr
    r = rawdisk("create", os.path.join(workdir, "big.img"), "0x8000000000000000")
    assert r.returncode == 2 and "at most 9223372036854775807 bytes" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(workdir, "big.img"))
    r = rawdisk("create", os.path.join(workdir, "big.img"), "9E")
    assert r.returncode == 2 and "at most" in r.stderr, r.stderr


# -- qemu's legacy NBD URIs --------------------------------------------------------

def test_legacy_uris_where_an_nbd_uri_is_taken(workdir, serve):
    """nbd:unix:PATH:exportname=NAME and nbd:127.0.0.1:PORT:exportname=NAME
    with info, map, copy (either side), checksum and compare; qemu-img reads
    the same strings the same way."""
    path, model = sparse_image(workdir)
    srv = serve(path, export_name="vm")
    tcp = serve(path, export_name="vm", tcp=True)
    for legacy in (f"nbd:unix:{srv.sock}:exportname=vm",
                   f"nbd:127.0.0.1:{tcp.port}:exportname=vm"):
        r = rawdisk("info", "--size", legacy)
        assert r.returncode == 0 and r.stdout.strip() == str(4 * MiB), (legacy, r.stderr)
        q = run("qemu-img", "info", "--output=json", legacy)
        assert json.loads(q.stdout)["virtual-size"] == 4 * MiB
        m = json.loads(rawdisk("map", "--output", "json", legacy).stdout)
        assert [e["data"] for e in m] == [True, False, True], m
        assert rawdisk("compare", legacy, path).returncode == 0
        ours = rawdisk("checksum", legacy).stdout.split()[0]
        assert ours == rawdisk("checksum", path).stdout.split()[0]
        out = os.path.join(workdir, "copy.img")
        r = rawdisk("copy", legacy, out)
        assert r.returncode == 0, r.stderr
        assert_target_is(out, model)
        os.unlink(out)
    # The destination side: into a fresh export through the legacy form.
    dst = os.path.join(workdir, "dst.img")
    with open(dst, "wb") as f:
        f.truncate(4 * MiB)
    d = serve(dst)
    r = rawdisk("copy", path, f"nbd:unix:{d.sock}")
    assert r.returncode == 0, r.stderr
    assert d.terminate() == 0
    assert_target_is(dst, model)
    r = rawdisk("info", "--size", "nbd:unix:")
    assert r.returncode == 2, r.stderr


# -- copy -W, --synchronous, --no-extents -------------------------------------------

def copy_stats(workdir, serve, path, *flags):
    """Copies the export of `path` to a file with `flags`; the source
    server's --stats document and the copy's path."""
    stats = os.path.join(workdir, "stats.json")
    srv = serve(path, read_only=True, extra=["--stats", stats])
    out = os.path.join(workdir, "out.img")
    if os.path.exists(out):
        os.unlink(out)
    r = rawdisk("copy", *flags, srv.uri, out)
    assert r.returncode == 0, r.stderr
    assert srv.terminate() == 0
    with open(stats) as f:
        return json.load(f), out


def test_copy_anchor_flags(workdir, serve):
    """-W is accepted (writes are out of order already); --synchronous has
    one request in flight at a time, on one connection; --no-extents reads
    the whole source (holes included) and asks no block status, where the
    default reads only the data. Every copy is byte-identical."""
    path, model = sparse_image(workdir)
    doc, out = copy_stats(workdir, serve, path, "-W", "-C", "2")
    assert_target_is(out, model)
    # The data, and the few KiB a format probe reads.
    assert 2 * MiB <= doc["requests"]["read"]["bytes"] < 2 * MiB + 64 * 1024, doc["requests"]
    assert doc["requests"]["block-status"]["requests"] > 0
    assert doc["connections"]["negotiated"] > 1, doc["connections"]

    doc, out = copy_stats(workdir, serve, path, "--synchronous", "--request-size", "256K")
    assert_target_is(out, model)
    assert doc["peak-in-flight"] == 1, doc
    assert doc["connections"]["negotiated"] == 1, doc["connections"]

    doc, out = copy_stats(workdir, serve, path, "--no-extents")
    assert_target_is(out, model)
    assert 4 * MiB <= doc["requests"]["read"]["bytes"] < 4 * MiB + 64 * 1024, doc["requests"]
    assert doc["requests"]["block-status"]["requests"] == 0, doc["requests"]
    # The zeros read still become holes in the copy (--sparse-size).
    assert os.stat(out).st_blocks * 512 <= 2 * MiB + 64 * 1024

    r = rawdisk("copy", "--synchronous", "-R", "4", path, os.path.join(workdir, "x.img"))
    assert r.returncode == 2, r.stderr
