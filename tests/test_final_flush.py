"""The final flush at stop (SIGTERM) runs only when something was written
since the client's last FLUSH, as qemu-nbd's: on NFS it is a COMMIT round
trip. Counted as the fsyncs an NFS-like file system receives, and, for the
exports served through a private copy (--snapshot) or a window (--offset),
as the fdatasync calls strace sees after the SIGTERM. Every byte is read
back before the stop."""

import os
import signal
import subprocess
import time

import pytest

import servers
import storage
from helpers import MiB, connected, finish, make_image, random_bytes, read_target

SIZE = 8 * MiB


def serve(argv, sock, strace_log=None):
    """The server (under strace when `strace_log`), once it serves; its own
    pid in p.server_pid (strace's child: the signal goes to it, not to
    strace, which would detach)."""
    pid_file = sock + ".pid"
    cmd = [servers.RAWDISK_BIN, "serve", "--socket", sock, "--pid-file", pid_file, *argv]
    if strace_log:
        cmd = ["strace", "-f", "-qq", "-e", "trace=fdatasync,fsync", "-o", strace_log, *cmd]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while not os.path.exists(pid_file):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            pytest.fail(f"the server did not start: {p.communicate()}")
        time.sleep(0.01)
    with open(pid_file) as f:
        p.server_pid = int(f.read())
    return p


def session(sock, model, at, flush_last):
    """A write of 64 KiB at `at` (in `model` too); a FLUSH after it, or a
    FLUSH before it when not `flush_last`; every byte read back."""
    data = random_bytes(64 * 1024, seed=at)
    with connected(f"nbd+unix:///?socket={sock}") as h:
        if not flush_last:
            h.flush()
        h.pwrite(data, at)
        if flush_last:
            h.flush()
        model[at:at + len(data)] = data
        assert h.pread(len(model), 0) == bytes(model), "read back differs"


def stop(p):
    os.kill(p.server_pid, signal.SIGTERM)
    _, err = finish(p, 30)
    assert p.returncode == 0, err


@pytest.mark.parametrize("flush_last,at_stop", [(True, 0), (False, 1)],
                         ids=["flushed", "written-after-the-flush"])
def test_nfs_sees_a_commit_at_stop_only_for_unflushed_writes(workdir, flush_last, at_stop):
    if not storage.is_root():
        pytest.skip("mounting the NFS-like file system needs root")
    if (why := storage.fuse_unavailable()):
        pytest.skip(why)
    with storage.nfs_like("nfs3", size_mib=64) as mnt:
        img, model = make_image(mnt, "disk.img", SIZE, seed=5)
        sock = os.path.join(workdir, "nbd.sock")
        p = serve([img], sock)
        try:
            session(sock, model, MiB + 4096, flush_last)
            before = storage.nfs_counts(mnt)["fsync"]
            stop(p)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        after = storage.nfs_counts(mnt)["fsync"]
        assert after - before == at_stop, f"{after - before} fsyncs at stop"
        assert read_target(img) == bytes(model)


def syncs_after_sigterm(log):
    """fdatasync/fsync calls strace logged after the SIGTERM arrived."""
    with open(log) as f:
        lines = f.read().splitlines()
    at = next((i for i, x in enumerate(lines) if "--- SIGTERM" in x), None)
    assert at is not None, "\n".join(lines[-20:])
    return sum(1 for x in lines[at:] if "fdatasync(" in x or "fsync(" in x)


@pytest.mark.parametrize("argv", [["--snapshot"], ["--offset", "1M"]], ids=["snapshot", "offset"])
@pytest.mark.parametrize("flush_last,at_stop", [(True, 0), (False, 1)],
                         ids=["flushed", "written-after-the-flush"])
def test_snapshot_and_window_writes_are_flushed_at_stop_only_when_unflushed(
        workdir, argv, flush_last, at_stop):
    img, original = make_image(workdir, "disk.img", SIZE, seed=6)
    window = 1 * MiB if "--offset" in argv else 0
    model = bytearray(original[window:])
    sock = os.path.join(workdir, "nbd.sock")
    log = os.path.join(workdir, "strace.log")
    p = serve([*argv, img], sock, strace_log=log)
    try:
        session(sock, model, 4096, flush_last)
        stop(p)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert syncs_after_sigterm(log) == at_stop
    want = bytes(original) if "--snapshot" in argv else bytes(original[:window]) + bytes(model)
    assert read_target(img) == want, "the image is not what the session left"
