"""SIGINT and SIGTERM for the commands that stop cleanly on them (copy,
create), with the three ways a signal used to be lost or to end them
wrongly: a stderr whose reader is gone (the message panicked: status 101),
a caller that started them with the signals blocked (the mask is inherited:
the copy ran to its end and said it succeeded), and a second signal while
the first one's message waits on a stderr pipe nobody reads (never ended).
An interrupted copy leaves exactly what its message says."""

import os
import re
import signal
import subprocess
import time

import pytest

import servers
from helpers import MiB, finish, make_image, read_target
from test_copy_cli import slow_nbdkit

SIZE = 16 * MiB
REQUEST = 256 * 1024
# The create is stopped long before it has written this (about 5 s on ext4).
CREATE_SIZE = "2G"


def full_pipe():
    """A pipe whose buffer is full and whose reader never reads: any write
    to it blocks, as to a log reader that went away without closing."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    for chunk in (65536, 4096, 1):
        try:
            while True:
                os.write(w, b"x" * chunk)
        except BlockingIOError:
            pass
    os.set_blocking(w, True)
    return r, w


def closed_pipe():
    """The write end of a pipe whose reader is gone: a write fails EPIPE."""
    r, w = os.pipe()
    os.close(r)
    return None, w


def blocked(*sigs):
    return lambda: signal.pthread_sigmask(signal.SIG_BLOCK, set(sigs))


def start(argv, stderr, preexec_fn=None):
    return subprocess.Popen([servers.RAWDISK_BIN, *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=stderr, preexec_fn=preexec_fn)


class Copy:
    """A synchronous copy of SIZE random bytes onto a file through nbdkit
    that takes 100 ms per 256 KiB write: about 6 s, one request in flight,
    so the bytes written are a prefix of the destination."""

    def __init__(self, workdir):
        self.src, self.model = make_image(workdir, "src.img", SIZE, seed=91)
        self.dst, self.before = make_image(workdir, "dst.img", SIZE, seed=92)
        self.srv, self.uri = slow_nbdkit(workdir, self.dst)

    def start(self, stderr, preexec_fn=None):
        self.p = start(["copy", "--synchronous", "--request-size", "256K", self.src,
                        self.uri], stderr, preexec_fn)
        self.wait_writing()
        return self.p

    def wait_writing(self):
        """Until the first request is in the destination."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.p.poll() is None, self.p.communicate()
            if read_target(self.dst)[:REQUEST] == bytes(self.model[:REQUEST]):
                return
            time.sleep(0.01)
        pytest.fail("the copy did not start writing")

    def stop(self):
        self.srv.kill()
        self.srv.wait()

    def check_left(self, done=None):
        """The destination holds the source's first `done` bytes (at least
        one request, not all) and its old bytes after them; `done` unknown
        (no message): some prefix of whole requests."""
        got = read_target(self.dst)
        if done is None:
            done = next((n for n in range(REQUEST, SIZE, REQUEST)
                         if got[n:n + REQUEST] != self.model[n:n + REQUEST]), SIZE)
        assert REQUEST <= done < SIZE and done % REQUEST == 0, done
        assert got[:done] == bytes(self.model[:done]), "a copied byte is not there"
        assert got[done:] == bytes(self.before[done:]), \
            f"bytes past the {done} the copy says it wrote were changed"


def interrupted_at(err, name):
    m = re.search(rf"copy interrupted by {name} after (\d+) of {SIZE} bytes .*; the "
                  r"destination \S+ is incomplete", err)
    assert m, err
    return int(m.group(1))


@pytest.mark.parametrize("sig,name", [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM")])
def test_copy_stops_on_a_signal_with_stderr_closed(workdir, sig, name):
    """The "interrupted" line to a closed stderr was eprintln!'s panic:
    status 101 instead of 128 + the signal."""
    c = Copy(workdir)
    _, w = closed_pipe()
    try:
        p = c.start(w)
        os.close(w)
        p.send_signal(sig)
        out, _ = finish(p, 15, "the signal")
    finally:
        c.stop()
    assert p.returncode == 128 + sig, p.returncode
    assert out == b"", "a summary for an interrupted copy"
    c.check_left()


def test_copy_started_with_the_signals_blocked_stops_on_sigterm(workdir):
    """Blocked by the caller and inherited across exec, SIGTERM stayed
    pending: the copy went on to its end and said it succeeded. What it
    leaves is what its line says: the first N bytes, nothing after."""
    c = Copy(workdir)
    try:
        p = c.start(subprocess.PIPE, blocked(signal.SIGTERM, signal.SIGINT))
        p.send_signal(signal.SIGTERM)
        out, err = finish(p, 15, "the signal")
    finally:
        c.stop()
    err = err.decode()
    assert p.returncode == 143, (p.returncode, out, err)
    assert out == b"" and "panicked" not in err, (out, err)
    c.check_left(interrupted_at(err, "SIGTERM"))


def test_second_signal_ends_a_copy_whose_stderr_is_full(workdir):
    """The first SIGINT's line waits on a full stderr pipe holding the
    stderr lock; the second one's "exiting now" waited for that lock for
    ever. Now it exits within about a second, with 128 + SIGINT."""
    c = Copy(workdir)
    r, w = full_pipe()
    try:
        p = c.start(w)
        os.close(w)
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert p.poll() is None, "the first line did not wait on the full pipe"
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        finish(p, 10, "the second signal")
        took = time.monotonic() - t0
    finally:
        c.stop()
        os.close(r)
    assert p.returncode == 130, p.returncode
    assert took < 5, f"exited {took:.1f} s after the second signal"
    c.check_left()


def start_create(workdir, stderr, preexec_fn=None):
    """`create --preallocation full` of CREATE_SIZE, once it is writing."""
    img = os.path.join(workdir, "new.img")
    p = start(["create", "--preallocation", "full", img, CREATE_SIZE], stderr, preexec_fn)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert p.poll() is None, p.communicate()
        if os.path.exists(img) and os.stat(img).st_blocks > 0:
            return p, img
        time.sleep(0.005)
    p.kill()
    pytest.fail("the create did not start writing")


def test_create_stops_on_sigint_with_stderr_closed(workdir):
    """The error line to a closed stderr panicked (status 101); the image
    is removed either way."""
    _, w = closed_pipe()
    p, img = start_create(workdir, w)
    os.close(w)
    p.send_signal(signal.SIGINT)
    out, _ = finish(p, 15, "the signal")
    assert p.returncode == 1, p.returncode
    assert out == b"", out
    assert not os.path.exists(img), "a half-created image was left"


def test_create_started_with_the_signals_blocked_stops_on_sigint(workdir):
    """Inherited blocked, SIGINT never reached the create: it wrote all
    2 GiB and said it had created the image."""
    p, img = start_create(workdir, subprocess.PIPE, blocked(signal.SIGTERM, signal.SIGINT))
    p.send_signal(signal.SIGINT)
    out, err = finish(p, 15, "the signal")
    assert p.returncode == 1, (p.returncode, out, err)
    assert out == b"" and b"interrupted by a signal" in err, (out, err)
    assert not os.path.exists(img), "a half-created image was left"


def test_second_signal_ends_a_create_whose_stderr_is_full(workdir):
    """After the first SIGINT the handler was gone with its thread: the
    error line waited on a full stderr pipe and every later SIGINT was
    caught and dropped. Now the second one exits with 128 + SIGINT."""
    r, w = full_pipe()
    try:
        p, img = start_create(workdir, w)
        os.close(w)
        p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while os.path.exists(img) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not os.path.exists(img), "the create did not stop"
        assert p.poll() is None, "the error line did not wait on the full pipe"
        p.send_signal(signal.SIGINT)
        finish(p, 10, "the second signal")
    finally:
        os.close(r)
    assert p.returncode == 130, p.returncode
