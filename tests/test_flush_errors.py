"""A failed FLUSH: answered as the spec says, and failed for good.

The storage is a loop device whose backing file lives on a full tmpfs:
writing back fails (the loop device's write gets ENOSPC, the block layer
says EIO), and the kernel reports it to one fdatasync only; once there is
room again, the next one succeeds although the data is lost. The server must
answer the first FLUSH with EIO as NBD_REPLY_TYPE_ERROR (a FLUSH has no
offset for NBD_REPLY_TYPE_ERROR_OFFSET; libnbd drops the connection for
one), and every later FLUSH and FUA write with EIO too.
"""

import errno
import os
import subprocess

import nbd
import pytest

import servers
import storage
from conftest import require_root
from helpers import connected, make_image, random_bytes

MiB = 1 << 20
SIZE = 32 * MiB


class FailingDisk:
    """A 32 MiB loop device backed by a file on a 2 MiB tmpfs, half of it
    taken by ballast: writing back more than 1 MiB fails."""

    def __init__(self, dev, ballast):
        self.dev = dev
        self.ballast = ballast

    def make_room(self):
        """Room for everything: from now on a write-back succeeds, so a
        flush that reports success hides the data lost before."""
        os.unlink(self.ballast)


@pytest.fixture
def failing_disk():
    require_root()
    with storage.tmpfs(2) as d, \
            storage.sparse_file(d, "back.img", SIZE) as back, \
            storage.loop_device(back, 512, direct_io=False) as dev:
        ballast = os.path.join(d, "ballast")
        with open(ballast, "wb") as f:
            f.write(b"\1" * MiB)
        yield FailingDisk(dev, ballast)


def stop(srv):
    """SIGTERM: the final flush fails too, so the exit status is 1."""
    rc = srv.terminate()
    log = srv.stderr()
    assert rc == 1, log[-3000:]
    assert "final flush" in log, log[-3000:]
    assert "panicked" not in log, log[-3000:]
    return log


def test_libnbd_gets_eio_from_every_flush_after_a_failed_one(serve, failing_disk):
    dev = failing_disk.dev
    srv = serve(dev)
    with connected(srv.uri) as h:
        assert h.can_flush() and h.can_fua()
        h.pwrite(random_bytes(4 * MiB, 1), 0)
        for attempt in range(3):
            if attempt == 1:
                failing_disk.make_room()
            with pytest.raises(nbd.Error) as e:
                h.flush()
            assert e.value.errnum == errno.EIO, (attempt, e.value)
            # The connection goes on: a range never written reads as zeros.
            assert h.pread(4096, 16 * MiB) == bytes(4096)
        with pytest.raises(nbd.Error) as e:
            h.pwrite(b"\x55" * 4096, 8 * MiB, nbd.CMD_FLAG_FUA)
        assert e.value.errnum == errno.EIO
        # Writes without FUA promise nothing durable and are still taken.
        h.pwrite(b"\x66" * 4096, 20 * MiB)
        assert h.pread(4096, 20 * MiB) == b"\x66" * 4096
    # The rule is the target's, not the connection's.
    with connected(srv.uri) as h:
        with pytest.raises(nbd.Error) as e:
            h.flush()
        assert e.value.errnum == errno.EIO
    log = stop(srv)
    # Why is said once, naming the target and the first error.
    why = [x for x in log.splitlines() if "every later flush" in x]
    assert len(why) == 1, log[-3000:]
    assert dev in why[0] and "Input/output error" in why[0], why


def qemu_io(uri, *cmds):
    """qemu-io's output and exit status: 1 when a command failed (its flush
    prints nothing of its own)."""
    argv = ["qemu-io", "-f", "raw", "-t", "writeback", uri]
    for c in cmds:
        argv += ["-c", c]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


def test_qemu_io_flush_fails_every_time(serve, failing_disk):
    srv = serve(failing_disk.dev)
    rc, out = qemu_io(srv.uri, f"write -P 0x55 0 {4 * MiB}", "flush", f"read -P 0 {16 * MiB} 4096")
    assert rc == 1, out
    failing_disk.make_room()
    assert f"wrote {4 * MiB}/{4 * MiB} bytes at offset 0" in out, out
    # The connection went on after the failed flush.
    assert f"read 4096/4096 bytes at offset {16 * MiB}" in out, out
    # qemu flushes only after a write; this one lands in the page cache.
    rc, out = qemu_io(srv.uri, f"write -P 0x56 {20 * MiB} 4096", "flush")
    assert rc == 1, out
    assert f"wrote 4096/4096 bytes at offset {20 * MiB}" in out, out
    rc, out = qemu_io(srv.uri, f"write -f -P 0x57 {8 * MiB} 4096")
    assert (rc, out.strip()) == (1, "write failed: Input/output error"), out
    # Exit status 0 when nothing failed: the ones above are the flushes'.
    rc, out = qemu_io(srv.uri, f"read -P 0x56 {20 * MiB} 4096")
    assert rc == 0, out
    stop(srv)


def test_the_rule_ends_with_a_restart(serve, failing_disk):
    dev = failing_disk.dev
    srv = serve(dev)
    with connected(srv.uri) as h:
        h.pwrite(random_bytes(4 * MiB, 2), 0)
        with pytest.raises(nbd.Error):
            h.flush()
    stop(srv)
    # Room under the device, and a new server opens the target afresh.
    failing_disk.make_room()
    srv = serve(dev)
    data = random_bytes(256 << 10, 3)
    with connected(srv.uri) as h:
        h.pwrite(data, 0)
        h.flush()
        assert h.pread(len(data), 0) == data


def test_copy_fails_on_a_failed_final_flush_and_so_does_the_next(serve, failing_disk, workdir):
    srv = serve(failing_disk.dev)
    src, _ = make_image(workdir, "src.img", 4 * MiB, seed=4)
    small, _ = make_image(workdir, "small.img", 64 << 10, seed=5)
    r = subprocess.run([servers.RAWDISK_BIN, "copy", "-n", "--retry-timeout", "5s", src, srv.uri],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "flush" in r.stderr and "EIO" in r.stderr, r.stderr
    # Room now, so a new fdatasync would succeed: the copy must not.
    failing_disk.make_room()
    r = subprocess.run([servers.RAWDISK_BIN, "copy", "-n", "--retry-timeout", "5s", small,
                        srv.uri], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "flush" in r.stderr and "EIO" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    stop(srv)


def test_a_fast_zero_that_meets_the_write_back_error_fails_every_later_flush(serve, failing_disk):
    """A FAST_ZERO on a block device writes its range's cache back first
    (sync_file_range with WAIT), which reports, and consumes, the file's
    write-back error as fdatasync does: the flush-failure rule must hold
    after it, or the next FLUSH succeeds over data that never reached the
    disk."""
    srv = serve(failing_disk.dev)
    with connected(srv.uri) as h:
        assert h.can_fast_zero()
        h.pwrite(random_bytes(4 * MiB, 6), 0)
        # Writing back these 4 MiB fails: the fast zero says so.
        with pytest.raises(nbd.Error) as e:
            h.zero(4 * MiB, 0, nbd.CMD_FLAG_FAST_ZERO)
        assert e.value.errnum == errno.EIO, e.value
        # Room now, so a new fsync would succeed: the FLUSH must not.
        failing_disk.make_room()
        with pytest.raises(nbd.Error) as e:
            h.flush()
        assert e.value.errnum == errno.EIO, e.value
        with pytest.raises(nbd.Error) as e:
            h.pwrite(b"\x55" * 4096, 8 * MiB, nbd.CMD_FLAG_FUA)
        assert e.value.errnum == errno.EIO, e.value
    stop(srv)
