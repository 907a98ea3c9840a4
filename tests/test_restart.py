"""A graceful restart of `rawdisk serve` (SIGTERM, what `systemctl restart`
sends, then a new server on the same socket) does not end a copy into it;
a second SIGTERM still removes the socket and pid file, and still ends a
server whose every log write waits on a full pipe; log lines held back
by rate limiting are written at exit, and accept failures are rate limited.
"""

import fcntl
import os
import resource
import signal
import socket
import subprocess
import sys
import termios
import time

import pytest

import servers
from helpers import assert_target_is, make_image, wait_gone

MiB = 1 << 20


def test_graceful_restart_of_the_destination_does_not_end_the_copy(workdir):
    size = 48 * MiB + 4096
    src, model = make_image(workdir, "src.img", size, seed=81)
    dst, _ = make_image(workdir, "dst.img", size, seed=82)
    srv = servers.Server(workdir, dst, kind="rawdisk").start()
    try:
        # About 3 s at 16 MiB/s: the restart lands in the middle.
        p = subprocess.Popen([servers.RAWDISK_BIN, "copy", "-m", "4", "-C", "2",
                              "--rate-limit", "16M", "--retry-timeout", "30s", src, srv.uri],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(1.0)
        assert p.poll() is None, p.communicate()
        assert srv.terminate() == 0, srv.stderr()
        assert p.poll() is None, p.communicate()
        srv.start()
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
        srv.kill()
    out, err = out.decode(), err.decode()
    assert p.returncode == 0, err
    assert "reconnecting" in err and "ESHUTDOWN" in err, err
    assert "reconnected" in out, out
    assert_target_is(dst, model)


def test_second_sigterm_still_removes_the_socket_and_pid_file(workdir):
    img, _ = make_image(workdir, "img", 4 * MiB, seed=83)
    pid = os.path.join(workdir, "srv.pid")
    srv = servers.Server(workdir, img, kind="rawdisk", pid_file=pid).start()
    # A client in the handshake holds the shutdown for up to a second, so
    # the second signal finds the server still draining.
    s = srv.connect_unix_or_tcp()
    try:
        s.recv(18)
        with open(pid) as f:
            assert int(f.read()) == srv.pid
        # GNU timeout: SIGTERM, then (with -k, or the shell's own) another.
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.wait_exit()
    finally:
        s.close()
    log = srv.stderr()
    assert rc == 1, log
    assert "second signal (SIGTERM)" in log, log
    assert not os.path.exists(srv.sock), "the socket outlived the server"
    assert not os.path.exists(pid), "the pid file outlived the server"


def test_second_sigterm_ends_a_server_stuck_writing_its_log(workdir):
    """-vv to a stderr pipe whose reader never reads: once the pipe is full
    every log line waits, the signal task's first. The second SIGTERM still
    ends the server within seconds, status 1, removing the socket and pid
    file (a thread outside the runtime acts on it)."""
    img, _ = make_image(workdir, "img", 4 * MiB, seed=84)
    sock = os.path.join(workdir, "s.sock")
    pid = os.path.join(workdir, "srv.pid")
    p = subprocess.Popen([servers.RAWDISK_BIN, "serve", "-vv", "-U", sock, "-P", pid, img],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    client = None
    try:
        uri = p.stdout.readline().decode().strip()
        # Each request is traced: reads until the pipe holds all it can.
        client = subprocess.Popen([sys.executable, "-c", "import nbd, sys\nh = nbd.NBD()\n"
                                   "h.connect_uri(sys.argv[1])\nwhile True: h.pread(512, 0)", uri],
                                  stderr=subprocess.DEVNULL)
        size = fcntl.fcntl(p.stderr.fileno(), fcntl.F_GETPIPE_SZ)
        deadline = time.monotonic() + 60
        # Full: nothing more arrives for half a second while the client
        # keeps asking. Nearly full is not enough: the shutdown's few lines
        # could fit and the first SIGTERM end the server with status 0.
        held, since = -1, time.monotonic()
        while True:
            n = int.from_bytes(fcntl.ioctl(p.stderr.fileno(), termios.FIONREAD, b"\0" * 4),
                               "little")
            if n != held:
                held, since = n, time.monotonic()
            elif n >= size // 2 and time.monotonic() - since > 0.5:
                break
            assert time.monotonic() < deadline and client.poll() is None, "the pipe never filled"
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        wait_gone(p.pid, timeout=15)
        assert p.wait() == 1 and time.monotonic() - t0 < 5
    finally:
        for proc in (client, p):
            if proc and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not os.path.exists(sock), "the socket outlived the server"
    assert not os.path.exists(pid), "the pid file outlived the server"


def test_held_back_log_lines_are_counted_at_exit_and_accept_failures_limited(workdir):
    img, _ = make_image(workdir, "img", 4 * MiB, seed=84)
    srv = servers.Server(workdir, img, kind="rawdisk")
    # Few descriptors: the server runs out of them at accept.
    srv_argv = srv.argv

    def low_nofile():
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

    with open(srv.stdout_path, "wb") as out, open(srv.stderr_path, "wb") as err:
        srv.proc = subprocess.Popen(srv_argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    preexec_fn=low_nofile)
    srv._watchdog = __import__("threading").Timer(120, srv._fire_watchdog)
    srv._watchdog.start()
    srv._wait_ready()
    clients = []
    try:
        # Connections the server cannot take: each accept fails with EMFILE
        # and is retried every 100 ms, so about 10 failures a second.
        for _ in range(60):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(srv.sock)
            except (BlockingIOError, ConnectionRefusedError, OSError):
                pass
            clients.append(c)
        time.sleep(2.5)
        log = srv.stderr()
        failures = [x for x in log.splitlines() if "accept failed: " in x]
        assert failures, log[-3000:]
        assert "Too many open files" in failures[0], failures[0]
        # One line a second, and the count of the rest when each second ends.
        assert len(failures) <= 4, log[-3000:]
        assert "more time(s) in the last second" in log, log[-3000:]
        # Stop while some are held back: the count comes out at exit.
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)
        for c in clients:
            c.close()
        clients = []
        rc = srv.wait_exit()
    finally:
        for c in clients:
            c.close()
        srv.kill()
    log = srv.stderr()
    assert rc == 0, log[-3000:]
    lines = log.splitlines()
    last_failure = max(i for i, x in enumerate(lines) if "accept failed: " in x)
    assert any("more time(s)" in x for x in lines[last_failure + 1:]), log[-3000:]
