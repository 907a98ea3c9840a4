"""`rawdisk copy` as nbdcopy and qemu-img users call it: `null:` and `-`
destinations, the option aliases (`--destination-is-zero`, `--flush`, `-R`),
a server that caps its connections, a larger existing destination refused
without `--force`, a smaller one refused with `-n` (and a smaller NBD export or
block device always), a destination that is the source through a symlink, and
SIGINT / SIGTERM in the middle of a copy; a destination server that stops
answering (SIGSTOP) or dies in the first handshake, and the progress bar and
summary line of a copy that reconnected."""

import fcntl
import os
import pty
import signal
import socket
import struct
import subprocess
import termios
import threading
import time

import pytest

import servers
from helpers import (MiB, assert_export_is, assert_target_is, fill_device, make_image,
                     read_target)

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
    # It says what it read; nothing was written, so it does not say "written".
    assert out.startswith("read 12.0 MiB in "), out
    assert "read 0 bytes" not in out and "written" not in out, out
    assert "null: keeps nothing" in out, out
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


def refused_as_smaller(res, dst, dst_size):
    assert res.returncode == 1, res
    err = res.stderr.decode()
    assert f"is {dst_size} bytes, smaller than the source ({SIZE} bytes)" in err, err
    assert err.count("\n") == 1, err


def test_no_create_onto_a_smaller_destination_is_refused(workdir, serve):
    """-n: the destination exists as it is (qemu-img convert -n refuses an
    output smaller than the input); a smaller file is not grown, nothing is
    written. An NBD export smaller than the source is refused the same way."""
    src, model = make_image(workdir, "src.img", SIZE, seed=72)
    small = SIZE - 4096 - 1
    dst, junk = make_image(workdir, "dst.img", small, seed=73)
    refused_as_smaller(rawdisk_copy("-n", src, dst), dst, small)
    assert "-n" in rawdisk_copy("-n", src, dst).stderr.decode()
    assert_target_is(dst, junk, "refused -n destination")
    srv = serve(dst)
    for n in [["-n"], []]:
        refused_as_smaller(rawdisk_copy(*n, src, srv.uri), srv.uri, small)
    assert_export_is(srv.uri, junk)
    assert srv.terminate() == 0
    assert_target_is(dst, junk, "refused NBD destination")
    # Same size: copied exactly.
    same, _ = make_image(workdir, "same.img", SIZE, seed=74)
    ok(rawdisk_copy("-n", src, same))
    assert_target_is(same, model)


def test_block_device_destination_smaller_refused_larger_kept(workdir, loop512):
    """A block device cannot grow: smaller is refused untouched, with or
    without -n; larger takes the source and keeps its tail."""
    junk = fill_device(loop512, seed=75)
    big = os.path.join(workdir, "big.img")
    with open(big, "wb") as f:
        f.truncate(len(junk) + 512)
    f_src, _ = make_image(workdir, "src.img", SIZE, seed=76)
    for n in [["-n"], []]:
        res = rawdisk_copy(*n, big, loop512)
        assert res.returncode == 1, res
        err = res.stderr.decode()
        assert f"is {len(junk)} bytes, smaller than the source ({len(junk) + 512} bytes)" \
            in err, err
        assert err.count("\n") == 1, err
    assert_target_is(loop512, junk, "refused block device")
    ok(rawdisk_copy("-n", f_src, loop512))
    junk[:SIZE] = read_target(f_src)
    assert_target_is(loop512, junk, "block device larger than the source")


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
    for stale in (sock, pid):  # a previous server's: readiness is the pid file
        if os.path.exists(stale):
            os.unlink(stale)
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


# -- a server that stops answering, or dies in the first handshake -----------

def copy_bg(*args, **kw):
    return subprocess.Popen([servers.RAWDISK_BIN, "copy", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def restart(srv):
    """kill -9, then the same server on the same socket and file."""
    srv.kill()
    if srv.sock and os.path.exists(srv.sock):
        os.unlink(srv.sock)
    srv.start()


def wait_until_copying(dst, model, proc, n=256 * 1024):
    """Until the first `n` bytes of the copy are in the destination: the
    copy is past its handshakes and writing."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        with open(dst, "rb") as f:
            if f.read(n) == bytes(model[:n]):
                return
        time.sleep(0.005)
    pytest.fail("the copy did not start")


SLOW = ["-m", "4", "-C", "2", "--request-size", "64K"]


@pytest.mark.parametrize("then", ["sigcont", "restart"])
def test_stopped_destination_server_is_abandoned_and_the_copy_finishes(workdir, then):
    size = 128 * MiB + 4096
    src, model = make_image(workdir, "src.img", size, seed=74)
    dst, _ = make_image(workdir, "dst.img", size, seed=75)
    srv = servers.Server(workdir, dst, kind="rawdisk").start()
    try:
        p = copy_bg(*SLOW, "--request-timeout", "2s", "--retry-timeout", "30s", src, srv.uri)
        wait_until_copying(dst, model, p)
        os.kill(srv.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        # Past the request timeout: the client has given up on the
        # connections and is trying new ones, which the stopped server
        # accepts in its backlog but does not answer.
        time.sleep(3.5)
        assert p.poll() is None, p.communicate()
        if then == "sigcont":
            os.kill(srv.pid, signal.SIGCONT)
        else:
            os.kill(srv.pid, signal.SIGCONT)
            restart(srv)
        out, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        os.kill(srv.pid, signal.SIGCONT)
        srv.kill()
    out, err = out.decode(), err.decode()
    assert p.returncode == 0, err
    assert "did not answer for 2s" in err and "reconnecting" in err, err
    assert "reconnected 1 time(s)" in out, out
    assert took < 20, took
    assert_target_is(dst, model)


def test_server_that_never_answers_fails_within_the_bound(workdir):
    src, model = make_image(workdir, "src.img", 4 * MiB, seed=76)
    dst, junk = make_image(workdir, "dst.img", 4 * MiB, seed=77)
    for retry, least, most in [("0", 2, 6), ("2s", 4, 10)]:
        # Handshakes and reads answered, writes never. A server per run:
        # nbdkit 1.32 can abort (raw_send_socket: `sock >= 0`) when a
        # connection it still owes replies to is closed.
        srv, uri = slow_nbdkit(workdir, dst, delay="1000")
        try:
            t0 = time.monotonic()
            res = rawdisk_copy("--request-timeout", "2s", "--retry-timeout", retry, src, uri,
                               timeout=60)
            took = time.monotonic() - t0
        finally:
            srv.kill()
            srv.wait()
        err = res.stderr.decode()
        assert res.returncode == 1, err
        assert err.count("\n") == 1 or retry != "0", err
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"rawdisk: destination {uri}: write at offset "), err
        assert "did not answer for 2s" in last, err
        if retry != "0":
            assert "gave up reconnecting after 2s" in last, err
        assert least <= took < most, (retry, took, err)
        assert read_target(dst) == junk, "a write that was never answered landed"


def flaky_listener(path, seconds):
    """A Unix socket that accepts connections and closes them at once for
    `seconds` (a server dying in the handshake), then goes away."""
    lsock = socket.socket(socket.AF_UNIX)
    lsock.bind(path)
    lsock.listen(16)
    lsock.settimeout(0.05)

    def run():
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                c, _ = lsock.accept()
                c.close()
            except socket.timeout:
                pass
        lsock.close()
        os.unlink(path)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_server_dying_in_the_first_handshake_is_retried(workdir):
    src, model = make_image(workdir, "src.img", 8 * MiB, seed=78)
    dst, _ = make_image(workdir, "dst.img", 8 * MiB, seed=79)
    sock = os.path.join(workdir, "flaky.sock")
    t = flaky_listener(sock, 1.0)
    p = copy_bg("--retry-timeout", "20s", src, f"nbd+unix:///?socket={sock}")
    t.join()
    srv = subprocess.Popen([servers.RAWDISK_BIN, "serve", "--socket", sock, dst],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out, err = p.communicate(timeout=30)
    finally:
        srv.terminate()
        srv.wait()
    err = err.decode()
    assert p.returncode == 0, err
    assert "closed the connection; reconnecting" in err and "reconnected" in err, err
    assert_target_is(dst, model)
    # With --retry-timeout 0 the same drop is final.
    t = flaky_listener(sock, 3.0)
    res = rawdisk_copy("--retry-timeout", "0", src, f"nbd+unix:///?socket={sock}")
    t.join()
    assert res.returncode == 1 and b"closed the connection" in res.stderr, res.stderr
    assert b"reconnecting" not in res.stderr, res.stderr


def test_server_that_never_existed_fails_at_once(workdir):
    src, _ = make_image(workdir, "src.img", MiB, seed=80)
    # A stale socket file (nothing listening: ECONNREFUSED), a missing
    # one, a TCP port nobody listens on.
    stale = os.path.join(workdir, "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    port = servers.free_tcp_port()
    for uri, why in [(f"nbd+unix:///?socket={stale}", "Connection refused"),
                     (f"nbd+unix:///?socket={workdir}/missing.sock", "No such file"),
                     (f"nbd://127.0.0.1:{port}/", "Connection refused")]:
        for dst, side in [(uri, "destination"), ("null:", "source")]:
            args = [src, dst] if side == "destination" else [uri, dst]
            t0 = time.monotonic()
            res = rawdisk_copy("--retry-timeout", "60s", *args)
            took = time.monotonic() - t0
            err = res.stderr.decode()
            assert res.returncode == 1, err
            assert err.count("\n") == 1 and why in err and side in err, err
            assert "reconnecting" not in err, err
            assert took < 3, (uri, took)


def test_progress_shows_the_reconnect_and_the_summary_counts_it(workdir):
    size = 128 * MiB
    src, model = make_image(workdir, "src.img", size, seed=81)
    dst, _ = make_image(workdir, "dst.img", size, seed=82)
    srv = servers.Server(workdir, dst, kind="rawdisk").start()
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    chunks = []

    def drain():
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:
                return
            if not b:
                return
            chunks.append(b)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        p = subprocess.Popen([servers.RAWDISK_BIN, "copy", "-p", *SLOW, "--retry-timeout",
                              "30s", src, srv.uri], stdout=subprocess.PIPE, stderr=slave)
        os.close(slave)
        wait_until_copying(dst, model, p)
        srv.kill()
        # Down long enough for several attempts to show.
        time.sleep(1.0)
        restart(srv)
        out, _ = p.communicate(timeout=60)
    finally:
        srv.kill()
    reader.join(10)
    os.close(master)
    tty = b"".join(chunks).decode(errors="replace")
    assert p.returncode == 0, tty
    assert "destination reconnecting (attempt 2)" in tty, tty[-3000:]
    assert "reconnected (attempt" in tty, tty[-3000:]
    line = out.decode().strip()
    assert line.startswith("copied 128.0 MiB in "), line
    assert line.endswith("; reconnected 1 time(s)"), line
    assert_target_is(dst, model)
