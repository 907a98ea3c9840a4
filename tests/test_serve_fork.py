"""`rawdisk serve --fork` as nbdkit has it: the command returns (exit 0,
the URI printed, stdout closed) only once the server accepts connections,
the server keeps running detached with its pid in --pid-file, and SIGTERM
stops it, removing the socket and pid file."""

import os
import select
import signal
import subprocess
import time
import urllib.parse

import pytest

import servers
from helpers import (MiB, alive, assert_target_is, connected, make_image, random_bytes,
                     wait_gone)

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")


@pytest.fixture
def forked():
    """Runs `rawdisk serve --fork ...`; whatever it leaves running is
    stopped at teardown."""
    pids = []

    def start(workdir, *args):
        err = open(os.path.join(workdir, "serve.err"), "w+")
        # run() returns only when stdout is closed: a server that kept the
        # parent's stdout would hang `uri=$(rawdisk serve --fork ...)`.
        res = subprocess.run([servers.RAWDISK_BIN, "serve", "--fork", *args],
                             stdout=subprocess.PIPE, stderr=err, text=True, timeout=30)
        err.seek(0)
        res.log = err.read()
        err.close()
        return res

    yield start, pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_fork_serves_right_after_it_returns(workdir, forked):
    start, pids = forked
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=61)
    sock = os.path.join(workdir, "s.sock")
    pid_file = os.path.join(workdir, "serve.pid")
    res = start(workdir, "-U", sock, "-P", pid_file, path)
    assert res.returncode == 0, res.log
    assert res.stdout == f"nbd+unix:///?socket={sock}\n"
    # The pid file is there when the command returns, and names the server.
    with open(pid_file) as f:
        pid = int(f.read().strip())
    pids.append(pid)
    assert alive(pid)
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[1] == b"serve"
    assert os.getsid(pid) == pid, "the server did not leave the caller's session"
    # Connected at once: no retry loop, no sleep.
    data = random_bytes(64 * 1024, seed=62)
    with connected(res.stdout.strip()) as h:
        h.pwrite(data, MiB + 512)
        h.flush()
        assert h.pread(len(data), MiB + 512) == data
    model[MiB + 512:MiB + 512 + len(data)] = data
    os.kill(pid, signal.SIGTERM)
    wait_gone(pid)
    assert not os.path.exists(sock), "socket left behind"
    assert not os.path.exists(pid_file), "pid file left behind"
    assert_target_is(path, model)


def test_fork_over_tcp_prints_the_bound_port(workdir, forked):
    start, pids = forked
    path, model = make_image(workdir, "disk.img", MiB, seed=63)
    pid_file = os.path.join(workdir, "serve.pid")
    res = start(workdir, "-b", "127.0.0.1:0", "-r", "-e", "vm", "-P", pid_file, path)
    assert res.returncode == 0, res.log
    uri = urllib.parse.urlparse(res.stdout.strip())
    assert (uri.scheme, uri.hostname, uri.path) == ("nbd", "127.0.0.1", "/vm")
    with open(pid_file) as f:
        pid = int(f.read())
    pids.append(pid)
    out = subprocess.run(["nbdinfo", "--size", res.stdout.strip()], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == str(MiB), out.stderr
    with connected(res.stdout.strip()) as h:
        assert h.is_read_only()
        assert h.pread(MiB, 0) == model
    os.kill(pid, signal.SIGTERM)
    wait_gone(pid)
    assert not os.path.exists(pid_file)
    assert_target_is(path, model)


def test_fork_failure_is_reported_by_the_parent(workdir, forked):
    """A target that cannot be served fails before the fork: the command
    itself exits 1 with the one-line error and leaves nothing behind."""
    start, _ = forked
    sock = os.path.join(workdir, "s.sock")
    pid_file = os.path.join(workdir, "serve.pid")
    res = start(workdir, "-U", sock, "-P", pid_file, os.path.join(workdir, "missing.img"))
    assert res.returncode == 1 and res.stdout == ""
    assert res.log.count("\n") == 1 and "cannot serve" in res.log, res.log
    assert not os.path.exists(sock) and not os.path.exists(pid_file)


def test_fork_and_run_do_not_mix(workdir, forked):
    start, _ = forked
    path, _ = make_image(workdir, "disk.img", MiB)
    res = start(workdir, "--run", "true", path)
    assert res.returncode == 2, res.log
    assert "--run" in res.log and res.log.count("\n") == 1, res.log


def start_as(workdir, how, path, serve_args=(), **popen):
    """Starts a read-only server on `path` as `how` says: "qemu-nbd --fork"
    (virtnbdbackup's line, through a qemu-nbd symlink), "serve --fork" or a
    foreground "serve". Returns (the Popen, the server's pid, its URI), once
    it serves; its socket is s.sock and its pid file s.sock.pid."""
    sock = os.path.join(workdir, "s.sock")
    pid_file = sock + ".pid"
    if how == "qemu-nbd --fork":
        link = os.path.join(workdir, "qemu-nbd")
        os.symlink(os.path.abspath(servers.RAWDISK_BIN), link)
        argv = [link, "-r", "--format=raw", "-x", "sda", path, "-k", sock, "-t", "-e 2",
                "--fork", "--detect-zeroes=on", f"--pid-file={pid_file}", "--"]
        u = f"nbd+unix:///sda?socket={sock}"
    else:
        argv = [servers.RAWDISK_BIN, "serve", *serve_args, "-r", "-U", sock, "-P", pid_file, path]
        if how == "serve --fork":
            argv.insert(2, "--fork")
        u = f"nbd+unix:///?socket={sock}"
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         **popen)
    try:
        if how == "serve":
            assert p.stdout.readline().strip() == u
            return p, p.pid, u
        assert p.wait(timeout=30) == 0, p.stderr.read()
        with open(pid_file) as f:
            return p, int(f.read()), u
    except BaseException:
        p.kill()
        p.wait()
        raise


def stopped_cleanly(workdir, p, pid, how):
    """SIGTERM sent: the server ends (a foreground one with status 0) and
    leaves no socket or pid file."""
    try:
        wait_gone(pid)
        if how == "serve":
            assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    sock = os.path.join(workdir, "s.sock")
    assert not os.path.exists(sock) and not os.path.exists(sock + ".pid"), "left behind"


@pytest.mark.parametrize("how", ["serve --fork", "qemu-nbd --fork", "serve"])
def test_sigterm_stops_a_server_whose_stderr_reader_is_gone(workdir, forked, how):
    """A server logging to its caller's stderr (serve --log=stderr; qemu-nbd
    --fork keeps it) after the caller closed that pipe, as a test's Popen
    does when it is freed: SIGTERM still stops it (the socket and pid file
    removed, a foreground one exits 0). The line that cannot be written
    used to be said with eprintln!, whose panic killed the signal task."""
    path, model = make_image(workdir, "sda.img", 4 * MiB, seed=64, sparse=True)
    p, pid, u = start_as(workdir, how, path, ["--log=stderr"])
    forked[1].append(pid)
    with connected(u) as h:
        assert h.pread(len(model), 0) == model
    p.stderr.close()
    os.kill(pid, signal.SIGTERM)
    stopped_cleanly(workdir, p, pid, how)


@pytest.mark.parametrize("how", ["qemu-nbd --fork", "serve"])
def test_sigterm_stops_a_server_started_with_it_blocked(workdir, forked, how):
    """A caller that blocks SIGTERM and SIGINT (a thread that waits for
    signals with sigwait, a supervisor) passes its mask on through fork and
    exec: the server unblocks the signals it handles, so SIGTERM still
    stops it instead of staying pending, and SIGUSR1 is still heard."""
    path, model = make_image(workdir, "sda.img", 4 * MiB, seed=65)
    blocked = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}
    p, pid, u = start_as(workdir, how, path,
                         preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, blocked))
    forked[1].append(pid)
    with connected(u) as h:
        assert h.pread(len(model), 0) == model
    os.kill(pid, signal.SIGUSR1)
    # Both keep the caller's stderr (qemu-nbd --fork as --log=stderr).
    said, deadline = b"", time.monotonic() + 10
    while b"SIGUSR1: totals" not in said:
        ready, _, _ = select.select([p.stderr], [], [], max(0, deadline - time.monotonic()))
        assert ready, f"SIGUSR1 went unheard: {said!r}"
        chunk = os.read(p.stderr.fileno(), 65536)
        assert chunk, f"stderr closed: {said!r}"
        said += chunk
    os.kill(pid, signal.SIGTERM)
    stopped_cleanly(workdir, p, pid, how)
