"""`rawdisk copy` as nbdcopy and qemu-img users call it: `null:` and `-`
destinations, the option aliases (`--destination-is-zero`, `--flush`, `-R`),
a server that caps its connections, a larger existing destination refused
without `--force`, a destination that is the source through a symlink, and
SIGINT / SIGTERM in the middle of a copy."""

import os
import signal
import subprocess
import time

import pytest

import servers
from helpers import MiB, assert_export_is, assert_target_is, make_image, read_target

SIZE = 12 * MiB + 4096 + 1237


def rawdisk_copy(*args, timeout=120, **kw):
    return subprocess.run([servers.RAWDISK_BIN, "copy", *args], capture_output=True,
                          timeout=timeout, **kw)


def ok(res):
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    return res


def test_null_destination_reads_everything_and_writes_nothing(workdir, serve):
    src, model = make_image(workdir, "src.img", SIZE, seed=61, sparse=True)
    before = os.listdir(workdir)
    out = ok(rawdisk_copy(src, "null:")).stdout.decode()
    data = sum(1 for i in range(0, SIZE, MiB)) * 64 * 1024
    assert f"copied 12.0 MiB" in out, out
    assert "read " in out and "read 0 bytes" not in out, out
    assert sorted(os.listdir(workdir)) == sorted(before), "null: created a file"
    # From an NBD export too.
    srv = serve(src, read_only=True)
    ok(rawdisk_copy(srv.uri, "null:"))
    assert data > 0


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_dash_is_standard_output(workdir, serve, sparse):
    src, model = make_image(workdir, "src.img", SIZE, seed=62, sparse=sparse)
    res = ok(rawdisk_copy("-m", "8", src, "-"))
    assert res.stdout == bytes(model), "stdout differs from the source"
    # The summary goes to stderr: stdout is the data.
    assert b"copied" in res.stderr, res.stderr
    srv = serve(src, read_only=True)
    res = ok(rawdisk_copy("-q", srv.uri, "-"))
    assert res.stdout == bytes(model)
    assert res.stderr == b""


def test_verify_needs_a_readable_destination(workdir):
    src, _ = make_image(workdir, "src.img", MiB, seed=63)
    for dst in ["null:", "-"]:
        res = rawdisk_copy("--verify", src, dst)
        assert res.returncode == 2 or res.returncode == 1, res
        assert b"--verify" in res.stderr, res.stderr
        assert res.stdout == b""


def test_nbdcopy_and_qemu_img_option_spellings(workdir):
    src, model = make_image(workdir, "src.img", SIZE, seed=64, sparse=True)
    dst, junk = make_image(workdir, "dst.img", SIZE, seed=65)
    # --destination-is-zero: the holes are trusted to read as zeros, so the
    # junk of a dirty destination stays there (the user's promise).
    out = ok(rawdisk_copy("-R", "4", "--flush", "--destination-is-zero", src, dst)).stdout
    got = read_target(dst)
    for off in range(0, SIZE, MiB):
        n = min(64 * 1024, SIZE - off)
        assert got[off:off + n] == model[off:off + n], off
    assert got[64 * 1024:MiB] == junk[64 * 1024:MiB], "holes were written"
    assert b"skipped" in out
    # --target-is-zero is the same option; --flush and --no-flush conflict.
    ok(rawdisk_copy("--target-is-zero", src, dst))
    res = rawdisk_copy("--flush", "--no-flush", src, dst)
    assert res.returncode == 2 and b"--no-flush" in res.stderr, res.stderr
    res = rawdisk_copy("-R", "0", src, dst)
    assert res.returncode == 2, res.stderr
    for bad in ["5x", "-1", "s", ""]:
        res = rawdisk_copy(f"--retry-timeout={bad}", src, dst)
        assert res.returncode == 2 and b"--retry-timeout" in res.stderr, (bad, res.stderr)
    # Without the promise the copy is exact.
    ok(rawdisk_copy("-R", "16", src, dst))
    assert_target_is(dst, model)


@pytest.mark.rawdisk_only("--max-connections is rawdisk serve's option")
@pytest.mark.parametrize("cap", [1, 2])
def test_server_capping_connections_gets_the_connections_it_allows(workdir, serve, cap):
    src, model = make_image(workdir, "src.img", SIZE, seed=66)
    dst, _ = make_image(workdir, "dst.img", SIZE, seed=67)
    srv = serve(dst, extra=["--max-connections", str(cap)])
    ok(rawdisk_copy("-C", "4", src, srv.uri))
    assert_export_is(srv.uri, model)
    back = os.path.join(workdir, "back.img")
    ok(rawdisk_copy("-C", "8", srv.uri, back))
    assert_target_is(back, model)


def test_larger_existing_destination_needs_force(workdir):
    src, model = make_image(workdir, "src.img", SIZE, seed=68)
    dst, junk = make_image(workdir, "dst.img", SIZE + 3 * MiB, seed=69)
    res = rawdisk_copy(src, dst)
    assert res.returncode == 1, res
    err = res.stderr.decode()
    assert "larger than the source" in err and "--force" in err, err
    assert err.count("\n") == 1, err
    assert_target_is(dst, junk, "refused destination")
    ok(rawdisk_copy("--force", src, dst))
    assert_target_is(dst, model)
    # Same size or smaller: no --force needed.
    small, _ = make_image(workdir, "small.img", MiB, seed=70)
    ok(rawdisk_copy(src, small))
    assert_target_is(small, model)


def test_destination_that_is_the_source_through_a_symlink_is_refused(workdir):
    src, model = make_image(workdir, "src.img", SIZE, seed=71)
    link = os.path.join(workdir, "link.img")
    os.symlink(src, link)
    for force in [[], ["--force"]]:
        res = rawdisk_copy(*force, src, link)
        assert res.returncode == 1 and b"same file" in res.stderr, res.stderr
    assert_target_is(src, model, "source after a refused self-copy")


def slow_nbdkit(workdir, target, delay="100ms"):
    sock = os.path.join(workdir, "slow.sock")
    pid = os.path.join(workdir, "slow.pid")
    proc = subprocess.Popen(["nbdkit", "-f", "-U", sock, "-P", pid, "--filter=delay", "file",
                             f"file={target}", f"delay-write={delay}"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(500):
        if os.path.exists(pid):
            break
        time.sleep(0.01)
    else:
        proc.kill()
        pytest.fail("nbdkit did not start")
    return proc, f"nbd+unix:///?socket={sock}"


@pytest.mark.parametrize("sig,code,name", [(signal.SIGINT, 130, "SIGINT"),
                                           (signal.SIGTERM, 143, "SIGTERM")])
def test_signal_stops_the_copy_cleanly(workdir, sig, code, name):
    src, model = make_image(workdir, "src.img", 16 * MiB, seed=72)
    dst, _ = make_image(workdir, "dst.img", 16 * MiB, seed=73)
    srv, uri = slow_nbdkit(workdir, dst)
    try:
        # 64 writes of 256 KiB, 2 at a time, 100 ms each: about 3 s.
        p = subprocess.Popen([servers.RAWDISK_BIN, "copy", "-m", "2", "-C", "1",
                              "--request-size", "256K", src, uri],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(0.8)
        assert p.poll() is None, p.communicate()
        t0 = time.monotonic()
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        srv.kill()
        srv.wait()
    err = err.decode()
    assert p.returncode == code, err
    assert took < 5, f"stopped {took:.1f} s after {name}"
    assert f"interrupted by {name}" in err and "incomplete" in err, err
    assert "panicked" not in err, err
    assert out == b"", "a summary line for an interrupted copy"
    # How far it got: between one request and less than everything.
    done = int(err.split(" after ")[1].split(" of ")[0].replace(",", ""))
    assert 256 * 1024 <= done < 16 * MiB, err
    got = read_target(dst)
    assert got[:256 * 1024] == model[:256 * 1024], "the first request is not there"
    assert got != bytes(model), "the copy finished anyway"
