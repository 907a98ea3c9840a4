"""What the one-shot commands say, as a user of qemu-img, nbdinfo and nbdcopy
meets it: each thing once, in one line, with the exit status a script can
act on (2: the command line; 1: the operation), and nothing at all when the
reader of standard output goes away (`| head`)."""

import json
import os
import subprocess
import time

import pytest

import servers
from helpers import MiB, assert_same_bytes, make_image, read_target, write_target

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")

BIN = servers.RAWDISK_BIN


def rawdisk(*args, stdout=subprocess.PIPE):
    return subprocess.run([BIN, *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=60)


def said_once(r, status, line):
    """Exit `status` and stderr exactly `line`, once."""
    assert (r.returncode, r.stderr) == (status, line + "\n"), (r.returncode, r.stderr)


def test_a_refused_handshake_is_said_once(workdir, serve, pki):
    """A wrong export name and a server that requires TLS: the reason once,
    in the client's words, against rawdisk serve and qemu-nbd; the client
    ends the option phase politely (NBD_OPT_ABORT), so qemu-nbd logs
    nothing about it."""
    from tlspki import psk_file
    img, _ = make_image(workdir, "a.img", MiB)
    srv = serve(img, read_only=True, export_name="vm")
    qsock = os.path.join(workdir, "q.sock")
    qlog = open(os.path.join(workdir, "qemu-nbd.log"), "w+")
    qemu = subprocess.Popen(["qemu-nbd", "-k", qsock, "-x", "vm", "-r", "-f", "raw", "-t", img],
                            stdout=subprocess.DEVNULL, stderr=qlog)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(qsock) and time.monotonic() < deadline:
            time.sleep(0.02)
        for sock in (srv.sock, qsock):
            uri = f"nbd+unix:///?socket={sock}"
            said_once(rawdisk("info", uri), 1, f"rawdisk: cannot connect to '{uri}': NBD "
                      f"handshake: export '': no such export; the server offers 'vm'")
            said_once(rawdisk("checksum", uri), 1, f"rawdisk: checksum: NBD handshake with "
                      f"{uri}: export '': no such export; the server offers 'vm'")
    finally:
        qemu.terminate()
        qemu.wait(timeout=10)
        qlog.seek(0)
        server_said = qlog.read()
        qlog.close()
    assert server_said == "", server_said
    tls = serve(img, read_only=True, extra=["--tls-psk", psk_file(pki)])
    uri = f"nbd+unix:///?socket={tls.sock}"
    need = "the server requires TLS: connect with an nbds:// or nbds+unix:// URI"
    said_once(rawdisk("info", uri), 1, f"rawdisk: cannot connect to '{uri}': NBD handshake: {need}")
    said_once(rawdisk("info", "--list", uri), 1,
              f"rawdisk: cannot list exports of '{uri}': NBD_OPT_LIST refused: {need}")
    said_once(rawdisk("copy", uri, "null:"), 1,
              f"rawdisk: source NBD handshake with {uri}: {need}")


def test_a_bad_uri_is_a_bad_command_line(workdir):
    """A URI the parser refuses is a usage error in every command that takes
    one (exit 2, pointing at that command's help), found before anything is
    opened or created."""
    img, model = make_image(workdir, "a.img", MiB)
    sock = os.path.join(workdir, "none.sock")
    bad = f"nbd+unix:///vm?socket={sock}&foo=1"
    unknown = f"rawdisk: '{bad}': unknown query parameter 'foo'"
    dst = os.path.join(workdir, "copy.img")
    for args in (["info", bad], ["info", "--list", bad], ["map", bad], ["checksum", bad],
                 ["copy", bad, dst], ["copy", img, bad], ["compare", img, bad]):
        said_once(rawdisk(*args), 2, f"{unknown} (see 'rawdisk {args[0]} --help')")
    assert not os.path.exists(dst)
    plain = f"nbd+unix:///?socket={sock}&tls-psk-file=keys.psk"
    said_once(rawdisk("copy", img, plain), 2,
              f"rawdisk: '{plain}': query parameter 'tls-psk-file' needs a TLS URI "
              f"(nbds:// or nbds+unix://) (see 'rawdisk copy --help')")
    typo = f"nbd+unix:///?sokcet={sock}"
    said_once(rawdisk("info", typo), 2,
              f"rawdisk: '{typo}': unknown query parameter 'sokcet' (did you mean \"socket\"?) "
              f"(see 'rawdisk info --help')")
    assert_same_bytes(read_target(img), model, "source")


def test_usage_errors_found_late_point_at_the_help(workdir):
    """Combinations clap cannot see are refused with the same pointer."""
    img, _ = make_image(workdir, "a.img", MiB)
    said_once(rawdisk("copy", "--changed-since", "c0", img, "-", stdout=subprocess.DEVNULL), 2,
              "rawdisk: --changed-since updates a previous backup, not - "
              "(see 'rawdisk copy --help')")


def test_block_device_flags_are_refused_on_files(workdir):
    """`create --zero` and `probe --destructive` act on a block device only:
    on a file they are refused, and nothing is created, changed or left."""
    new = os.path.join(workdir, "new.img")
    said_once(rawdisk("create", "--zero", new, "1M"), 2,
              f"rawdisk: --zero is for a block device, and '{new}' is not one: "
              f"a new image file reads as zeros without it (see 'rawdisk create --help')")
    assert not os.path.exists(new)
    img, model = make_image(workdir, "a.img", MiB)
    said_once(rawdisk("create", "--force", "--zero", img, "2M"), 2,
              f"rawdisk: --zero is for a block device, and '{img}' is not one: "
              f"a new image file reads as zeros without it (see 'rawdisk create --help')")
    before = sorted(os.listdir(workdir))
    said_once(rawdisk("probe", "--destructive", img), 2,
              f"rawdisk: --destructive is for a block device, and '{img}' is not one: "
              f"a file is probed on a scratch file beside it, and never changed "
              f"(see 'rawdisk probe --help')")
    assert sorted(os.listdir(workdir)) == before
    assert_same_bytes(read_target(img), model, "image")
    # A missing target is the probe's own error, not a flag refused.
    r = rawdisk("probe", "--destructive", new)
    said_once(r, 1, f"rawdisk: cannot probe '{new}': No such file or directory (os error 2)")


def test_an_inconsistent_checkpoint_is_said_once(workdir):
    """A change made while nothing tracked the image: the incremental copy
    warns once, as the full copy it becomes; the listing's own warning is
    one line too."""
    src, model = make_image(workdir, "disk.img", 4 * MiB, sparse=True)
    backup = os.path.join(workdir, "backup.img")
    assert rawdisk("checkpoint", "create", "--name", "c0", src).returncode == 0
    assert rawdisk("copy", src, backup).returncode == 0
    write_target(src, b"\x5a" * 4096, MiB)
    model[MiB:MiB + 4096] = b"\x5a" * 4096
    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))
    r = rawdisk("copy", "--changed-since", "c0", src, backup)
    said_once(r, 0, "rawdisk: warning: checkpoint c0 is inconsistent (the target was modified "
                    "while it was not tracked): every byte counts as changed, this is a full copy")
    assert r.stdout.startswith("changed since c0: 4.0 MiB of 4.0 MiB"), r.stdout
    assert_same_bytes(read_target(backup), model, "backup")
    r = rawdisk("checkpoint", "list", "--output", "json", src)
    said_once(r, 0, f"rawdisk: warning: every checkpoint of {src} is inconsistent, reported as "
                    f"all changed: the target was modified while it was not tracked")
    assert [(c["name"], c["consistent"]) for c in json.loads(r.stdout)] == [("c0", False)]


def closed_pipe_run(argv):
    """Runs argv with standard output a pipe nobody reads any more."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(argv, stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)


def test_a_closed_stdout_ends_a_command_quietly(workdir, serve):
    """Every command that prints, its reader gone before the first byte:
    no panic, no message, the status it has otherwise (qemu-img's
    behaviour). A copy to `-` stops with 141, the shell's status for a
    process SIGPIPE ended, so `set -o pipefail` still sees a cut copy."""
    img, model = make_image(workdir, "a.img", 8 * MiB)
    other, _ = make_image(workdir, "b.img", 8 * MiB, seed=2)
    small = os.path.join(workdir, "small.img")
    assert rawdisk("checkpoint", "create", "--name", "c0", img).returncode == 0
    srv = serve(other, read_only=True, export_name="vm")
    uri = f"nbd+unix:///vm?socket={srv.sock}"
    cases = [
        (["info", img], 0), (["info", "--output", "json", img], 0),
        (["info", uri], 0), (["info", "--list", uri], 0),
        (["checksum", img], 0), (["checksum", uri], 0),
        (["checkpoint", "list", img], 0), (["checkpoint", "list", "--output", "json", img], 0),
        (["checkpoint", "create", "--name", "c1", img], 0),
        (["probe", img], 0), (["probe", "--output", "json", img], 0),
        (["map", img], 0), (["map", "--output", "json", uri], 0),
        (["compare", img, img], 0), (["compare", img, other], 1),
        (["create", small, "1M"], 0), (["resize", small, "2M"], 0),
        (["copy", img, "null:"], 0),
        (["copy", img, "-"], 141), (["copy", uri, "-"], 141),
    ]
    for args, status in cases:
        r = closed_pipe_run([BIN, *args])
        assert (r.returncode, r.stderr) == (status, ""), (args, r.returncode, r.stderr)
    assert os.path.getsize(small) == 2 * MiB
    names = [c["name"] for c in json.loads(rawdisk("checkpoint", "list", "--output", "json",
                                                   img).stdout)]
    assert names == ["c0", "c1"]
    assert_same_bytes(read_target(img), model, "image")
    # The reference: qemu-img's printing commands with the same closed pipe.
    for args, status in ((["info", img], 0), (["map", "--output=json", img], 0),
                         (["compare", img, other], 1)):
        r = closed_pipe_run(["qemu-img", *args])
        assert (r.returncode, r.stderr) == (status, ""), (args, r.returncode, r.stderr)


def test_a_reader_that_stops_midway_ends_copy_quietly(workdir):
    """`rawdisk copy IMG - | head -c 300`: the first bytes arrive, then the
    copy stops at the closed pipe, quietly, with 141."""
    img, model = make_image(workdir, "a.img", 32 * MiB)
    p = subprocess.Popen([BIN, "copy", img, "-"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    head = p.stdout.read(300)
    p.stdout.close()
    t0 = time.monotonic()
    err = p.stderr.read().decode()
    assert p.wait(timeout=30) == 141, err
    assert time.monotonic() - t0 < 30
    assert err == ""
    assert head == bytes(model[:300])


def test_a_failed_size_change_is_named_as_what_it_was(workdir):
    """preallocation=off only sets the size: a failure says so, and says
    "preallocate" only for the modes that preallocate. RLIMIT_FSIZE makes
    ftruncate fail with EFBIG (SIGXFSZ ignored, as the shell's ulimit -f
    would have the command see it)."""
    import resource
    import signal

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (MiB, MiB))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def run(*args):
        return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=60,
                              preexec_fn=limited)

    img = os.path.join(workdir, "x.img")
    r = run("create", img, "4M")
    assert r.returncode == 1 and "set the size (ftruncate)" in r.stderr, r.stderr
    assert "preallocate" not in r.stderr, r.stderr
    assert not os.path.exists(img)
    r = run("create", "--preallocation", "full", img, "4M")
    assert r.returncode == 1 and "File too large" in r.stderr, r.stderr
    assert not os.path.exists(img)
    make_image(workdir, "x.img", MiB // 2)
    r = run("resize", img, "4M")
    assert r.returncode == 1 and "set the size (ftruncate)" in r.stderr, r.stderr
    assert "preallocate" not in r.stderr and os.path.getsize(img) == MiB // 2, r.stderr
