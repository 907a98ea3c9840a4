"""--cache none (O_DIRECT) on storage that supports it: ext4, XFS and loop
devices with 512 and 4096-byte sectors. The target really is open with
O_DIRECT, unaligned requests down to single bytes are served (through
aligned bounce buffers with read-modify-write) without losing a neighbour,
even when many of them hit the same sector at once. On ramfs, which refuses
O_DIRECT, the server does not start and says why in one line. Small aligned
reads and writes are answered through Linux AIO, as --stats counts; on a
full ext4 or XFS, writes into holes fail inside AIO and the client gets
ENOSPC while overwrites succeed and tracking keeps up. Needs root."""

import ctypes
import errno
import json
import os
import random
import subprocess

import nbd
import pytest

import servers
import storage
import test_cbt_serve as cbt
import wire
from helpers import (KiB, MiB, assert_export_is, assert_target_is, connected, fill_device,
                     make_image, open_flags, random_bytes, write_target)

O_DIRECT = 0o40000  # x86-64 / aarch64 value, as /proc/PID/fdinfo shows it (octal flags)
# The NFS-like kinds take O_DIRECT as the NFS client does (FUSE sends the
# requests uncached; no STATX_DIOALIGN, so the 4096-byte default).
DIRECT_STORAGE = ["ext4_dir", "xfs_dir", "btrfs_dir", "nfs3_dir", "nfs42_dir", "loop512",
                  "loop4096"]
NO_HOLE = 2  # NBD_CMD_FLAG_NO_HOLE
# io_setup and io_destroy by machine; libc wraps neither.
AIO_SYSCALLS = {"x86_64": (206, 207), "aarch64": (0, 1)}


def aio_unavailable():
    """Why Linux AIO cannot be used here (the test is then skipped), or None
    when io_setup works, as it must for the server to use it."""
    machine = os.uname().machine
    if machine not in AIO_SYSCALLS:
        return f"io_setup's syscall number on {machine} is not known to the test"
    setup, destroy = AIO_SYSCALLS[machine]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctx = ctypes.c_ulong(0)
    if libc.syscall(ctypes.c_long(setup), ctypes.c_long(1), ctypes.byref(ctx)) != 0:
        return f"io_setup: {os.strerror(ctypes.get_errno())}"
    libc.syscall(ctypes.c_long(destroy), ctx)
    return None


@pytest.fixture
def target(request):
    name = request.param
    where = request.getfixturevalue(name)
    if name.startswith("loop"):
        yield where, fill_device(where, seed=81)
        return
    with storage.scratch_dir_in(where) as d:
        yield make_image(d, "disk.img", 16 * MiB, seed=81)


@pytest.mark.rawdisk_only("nbdkit's cache=none evicts pages instead of using O_DIRECT")
@pytest.mark.parametrize("target", DIRECT_STORAGE, indirect=True)
def test_target_is_opened_with_o_direct(target, serve):
    path, model = target
    srv = serve(path, cache="none")
    with connected(srv.uri) as h:
        assert h.pread(4096, 0) == model[:4096]
        flags = open_flags(srv.pid, path)
    assert flags, "server has no descriptor on the target"
    assert all(f & O_DIRECT for f in flags), [oct(f) for f in flags]


@pytest.fixture
def raw_client(serve):
    """Raw-socket clients that do not ask for NBD_INFO_BLOCK_SIZE, so they
    never promised alignment and the server must serve unaligned requests."""
    opened = []

    def connect(srv):
        c = wire.RawClient(srv.connect_unix_or_tcp(timeout=30)).start().go(ask_block_size=False)
        opened.append(c.sock)
        return c

    yield connect
    for s in opened:
        s.close()


@pytest.mark.rawdisk_only("nbdkit 1.32 sends no NBD_INFO_BLOCK_SIZE")
@pytest.mark.parametrize("target", DIRECT_STORAGE, indirect=True)
def test_minimum_block_size_is_the_direct_io_alignment(target, serve):
    """Advertised honestly: the alignment O_DIRECT needs here (the logical
    sector of the loop device underneath), not 1."""
    path, _ = target
    srv = serve(path, cache="none")
    with connected(srv.uri) as h:
        minimum = h.get_block_size(nbd.SIZE_MINIMUM)
    assert minimum == storage.direct_io_alignment(path)


@pytest.mark.rawdisk_only("nbdkit 1.32 advertises no minimum, so it accepts anything")
@pytest.mark.parametrize("target", ["loop4096"], indirect=True)
def test_client_that_promised_alignment_gets_einval_for_unaligned(target, serve):
    """libnbd asks for NBD_INFO_BLOCK_SIZE, so it promised to align; the spec
    lets the server answer EINVAL, and nothing may change."""
    path, model = target
    srv = serve(path, cache="none")
    with connected(srv.uri, strict=False) as h:
        with pytest.raises(nbd.Error) as e:
            h.pwrite(b"\xee", 4097)
        assert e.value.errnum == errno.EINVAL
        assert h.pread(4096, 4096) == model[4096:8192]
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


@pytest.mark.parametrize("target", DIRECT_STORAGE, indirect=True)
def test_unaligned_single_byte_writes(target, serve, raw_client):
    path, model = target
    srv = serve(path, cache="none")
    size = len(model)
    c = raw_client(srv)
    for off in (0, 1, 511, 512, 4095, 4097, 65535, size - 1):
        assert c.request(wire.CMD_WRITE, off, 1, payload=bytes([off % 251]))[0] == 0, off
        model[off] = off % 251
    data = random_bytes(3 * 4096 + 3, seed=82)
    assert c.request(wire.CMD_WRITE, 12345, len(data), payload=data)[0] == 0
    model[12345:12345 + len(data)] = data
    assert c.request(wire.CMD_READ, size - 1, 1) == (0, bytes(model[size - 1:]))
    assert c.request(wire.CMD_READ, 4093, 10000) == (0, bytes(model[4093:14093]))
    assert c.request(wire.CMD_FLUSH)[0] == 0
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


@pytest.mark.parametrize("target", DIRECT_STORAGE, indirect=True)
def test_concurrent_single_bytes_in_one_sector(target, serve, raw_client):
    """128 one-byte writes in flight to the same sectors: each is a
    read-modify-write of a whole aligned block, so without a range lock
    they overwrite each other's byte."""
    path, model = target
    srv = serve(path, cache="none")
    c = raw_client(srv)
    requests = []
    for i in range(64):
        off = 8192 + i * 67  # spans a 4096-byte block boundary
        requests.append((wire.CMD_WRITE, off, 1, bytes([i + 1])))
        model[off] = i + 1
    for i in range(64):
        off = 256 * KiB - 32 + i  # 64 adjacent bytes across a boundary
        requests.append((wire.CMD_WRITE, off, 1, bytes([0xA0 ^ i])))
        model[off] = 0xA0 ^ i
    assert c.pipeline(requests) == [0] * len(requests)
    assert c.request(wire.CMD_FLUSH)[0] == 0
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


@pytest.mark.rawdisk_only("nbdkit 1.32 fails unaligned zero on block devices with EINVAL")
@pytest.mark.parametrize("target", DIRECT_STORAGE, indirect=True)
def test_zero_and_copy_in_direct_mode(target, serve, raw_client, workdir):
    path, model = target
    src, src_model = make_image(workdir, "src.img", len(model), seed=83, sparse=True)
    srv = serve(path, cache="none")
    c = raw_client(srv)
    assert c.request(wire.CMD_WRITE_ZEROES, 3, 5000, flags=NO_HOLE)[0] == 0
    model[3:5003] = bytes(5000)
    assert c.request(wire.CMD_WRITE_ZEROES, 2 * MiB - 1, MiB + 1)[0] == 0
    model[2 * MiB - 1:3 * MiB] = bytes(MiB + 1)
    assert_export_is(srv.uri, model)
    res = subprocess.run(["nbdcopy", "--connections", "4", src, srv.uri],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert_export_is(srv.uri, src_model)
    assert_target_is(path, src_model)


@pytest.mark.rawdisk_only("the contract: refuse O_DIRECT-less storage at start")
def test_ramfs_refuses_to_start_with_one_clear_line(ramfs_dir, workdir):
    with storage.scratch_dir_in(ramfs_dir) as d:
        path, model = make_image(d, "disk.img", MiB, seed=84)
        sock = os.path.join(workdir, "s.sock")
        argv = servers.server_argv("rawdisk", path, sock=sock, cache="none")
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert res.returncode == 1, (res.returncode, res.stderr)
        lines = [l for l in res.stderr.splitlines() if l.strip()]
        assert len(lines) == 1, res.stderr
        assert lines[0].startswith("rawdisk:"), lines
        assert "direct" in lines[0].lower(), lines
        assert res.stdout == "", "printed a URI although it is not serving"
        assert_target_is(path, model)


@pytest.mark.parametrize("target", DIRECT_STORAGE, indirect=True)
def test_many_small_requests_in_flight(target, serve):
    """Up to 64 requests in flight: 4 KiB reads and writes (which the
    server submits to the kernel together, Linux AIO) and FUA writes (which
    stay on its threads), each in a block of its own; every read sees the
    image as it was, and the image ends as the model says."""
    path, model = target
    srv = serve(path, cache="none")
    rnd = random.Random(85)
    blocks = rnd.sample(range(len(model) // 4096), 768)
    reads, cookies = [], []
    with connected(srv.uri) as h:
        for i, b in enumerate(blocks):
            off = b * 4096
            if i % 3 == 0:
                buf = nbd.Buffer(4096)
                cookies.append(h.aio_pread(buf, off))
                reads.append((buf, off))
            else:
                data = random_bytes(4096, seed=i)
                fua = nbd.CMD_FLAG_FUA if i % 8 == 2 else 0
                cookies.append(h.aio_pwrite(data, off, flags=fua))
                model[off:off + 4096] = data
            while h.aio_in_flight() >= 64:
                h.poll(-1)
        while h.aio_in_flight() > 0:
            h.poll(-1)
        # Raises the error of a command that failed.
        assert all(h.aio_command_completed(c) for c in cookies)
        for buf, off in reads:
            assert buf.to_bytearray() == model[off:off + 4096], f"read at {off}"
        h.flush()
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


@pytest.mark.rawdisk_only("--stats aio-completed is rawdisk's")
@pytest.mark.parametrize("target", DIRECT_STORAGE, indirect=True)
def test_small_requests_are_answered_through_aio(target, serve, workdir):
    """512 4 KiB writes and 512 reads, 32 in flight (each 32 sent at once),
    then every written block read back: most are answered from AIO
    completions. The blocking pool answers the same requests with the same
    bytes, so only the server's count (--stats aio-completed) shows which
    path served them."""
    why = aio_unavailable()
    if why:
        pytest.skip(why)
    path, model = target
    stats = os.path.join(workdir, "stats.json")
    srv = serve(path, cache="none", extra=["--stats", stats])
    c = wire.RawClient(srv.connect_unix_or_tcp(timeout=30)).start().go()
    blocks = random.Random(86).sample(range(len(model) // 4096), 1024)
    written, unwritten = blocks[:512], blocks[512:]

    def at_once(writes, reads):
        """One send, so the server has them all before it answers any (one
        it found alone would run on its reader); every read is checked."""
        sent, want = [], {}
        for i, b in enumerate(writes):
            data = random_bytes(4096, seed=b)
            sent.append(wire.request_bytes(wire.CMD_WRITE, b * 4096, 4096, cookie=i,
                                           payload=data))
            model[b * 4096:(b + 1) * 4096] = data
        for i, b in enumerate(reads, start=len(writes)):
            sent.append(wire.request_bytes(wire.CMD_READ, b * 4096, 4096, cookie=i))
            want[i] = bytes(model[b * 4096:(b + 1) * 4096])
        c.sock.sendall(b"".join(sent))
        for _ in sent:
            cookie, err, _ = c.read_simple_reply()
            assert err == 0, (cookie, err)
            if cookie in want:
                assert wire.recv_exact(c.sock, 4096) == want.pop(cookie), f"read {cookie}"
        assert not want, want

    for i in range(0, 512, 16):
        at_once(written[i:i + 16], unwritten[i:i + 16])
    for i in range(0, 512, 32):
        at_once([], written[i:i + 32])
    c.disconnect()
    assert srv.terminate() == 0
    with open(stats) as f:
        doc = json.load(f)
    assert doc["requests"]["read"]["requests"] == 1024
    assert doc["requests"]["write"]["requests"] == 512
    # Most, not all: the first of a send may find nothing else in flight.
    assert doc["aio-completed"] >= 0.9 * 1536, doc
    assert_target_is(path, model)


# -- a full file system: writes that fail inside Linux AIO --------------------

ENOSPC_FS_MIB = {"ext4": 64, "xfs": 300}  # xfsprogs refuses less than 300 MiB
ENOSPC_EXPORT = 8 * MiB
ENOSPC_ALLOCATED = MiB  # written (not fallocated) before the fill: overwrites need no block


def fill_free_space(directory):
    """Allocate a file until the file system says ENOSPC even for one block,
    then fsync it, so no free block is left for anyone (root included)."""
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        end = 0
        for step in (MiB, 4 * KiB):
            while True:
                try:
                    os.posix_fallocate(fd, end, step)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
                end += step
        os.fsync(fd)
    finally:
        os.close(fd)
    return end


@pytest.fixture(params=["ext4", "xfs"])
def full_fs(request):
    """A small file system of the test's own: it is filled, so it cannot be
    the session's."""
    if not storage.is_root():
        pytest.skip("needs root")
    with storage.filesystem_on_loop(request.param, ENOSPC_FS_MIB[request.param]) as mnt:
        yield mnt


@pytest.mark.rawdisk_only("--stats aio-completed and --track-changes are rawdisk's")
def test_writes_into_holes_of_a_full_file_system_fail_with_enospc(full_fs, serve, workdir):
    """A sparse export on ext4 or XFS with no free block left: 4 KiB writes into
    its holes, sent 8 at once with 8 into its allocated part, are submitted
    to Linux AIO, whose completion is ENOSPC (strace shows io_getevents
    res=-28); the pool runs them again and the client gets NBD_ENOSPC. The
    overwrites succeed through AIO, nothing else changes, the server keeps
    serving new connections, and changed-block tracking reports every range
    that was written (it marks before submitting, so failed ones may show)."""
    why = aio_unavailable()
    if why:
        pytest.skip(why)

    path = os.path.join(full_fs, "disk.img")
    model = bytearray(ENOSPC_EXPORT)
    with open(path, "wb") as f:
        f.truncate(ENOSPC_EXPORT)
    model[:ENOSPC_ALLOCATED] = random_bytes(ENOSPC_ALLOCATED, seed=87)
    write_target(path, model[:ENOSPC_ALLOCATED])
    state = os.path.join(workdir, "state")
    os.mkdir(state)
    cbt.checkpoint(path, "before", "--state-dir", state)
    filled = fill_free_space(full_fs)
    assert filled > os.statvfs(full_fs).f_blocks * os.statvfs(full_fs).f_frsize // 2, filled
    # ext4 still shows its reserve for extent splits in f_bfree, XFS a few
    # blocks in f_bavail that its allocator keeps for btree splits: neither
    # goes to data (fallocate of one block failed).
    vfs = os.statvfs(full_fs)
    assert vfs.f_bavail * vfs.f_frsize <= 16 * KiB, vfs

    stats = os.path.join(workdir, "stats.json")
    srv = serve(path, cache="none",
                extra=["--stats", stats, "--track-changes", "--state-dir", state])
    c = wire.RawClient(srv.connect_unix_or_tcp(timeout=30)).start().go()
    rnd = random.Random(88)
    n_alloc = ENOSPC_ALLOCATED // 4096
    holes = rnd.sample(range(n_alloc, ENOSPC_EXPORT // 4096), 128)
    allocated = rnd.sample(range(n_alloc), 128)
    ok, failed, attempted = [], [], []
    for i in range(0, 128, 8):
        sent, blocks = [], {}
        for cookie, b in enumerate(holes[i:i + 8] + allocated[i:i + 8]):
            data = random_bytes(4096, seed=1000 + b)
            sent.append(wire.request_bytes(wire.CMD_WRITE, b * 4096, 4096, cookie=cookie,
                                           payload=data))
            blocks[cookie] = (b, data)
        c.sock.sendall(b"".join(sent))
        for _ in sent:
            cookie, err, _ = c.read_simple_reply()
            b, data = blocks.pop(cookie)
            attempted.append(b)
            if b < n_alloc:
                assert err == 0, f"overwrite of allocated block {b}: error {err}"
            else:
                assert err in (0, errno.ENOSPC), f"write into hole {b}: error {err}"
            if err == 0:
                model[b * 4096:(b + 1) * 4096] = data
                ok.append(b)
            else:
                failed.append(b)
        assert not blocks, blocks
    # A block or two may still be free (the fill stops when one more
    # fallocate fails); nearly every write into a hole must fail.
    assert len(failed) >= 120, f"only {len(failed)} of 128 writes into holes failed"

    # Every byte: the overwrites and any hole write that got space, nothing else.
    c2 = wire.RawClient(srv.connect_unix_or_tcp(timeout=30)).start().go()
    for off in range(0, ENOSPC_EXPORT, 256 * KiB):
        want = bytes(model[off:off + 256 * KiB])
        assert c2.request(wire.CMD_READ, off, 256 * KiB) == (0, want), f"read at {off}"
    assert c.request(wire.CMD_FLUSH)[0] == 0
    c2.disconnect()
    c.disconnect()
    assert_export_is(srv.uri, model)
    # Tracking: every range that was written is reported changed, and no
    # range no request touched.
    reported = cbt.changed(srv.uri, "before", size=ENOSPC_EXPORT)
    assert set().union(*(cbt.chunks(b * 4096, 4096) for b in ok)) <= reported
    assert reported <= set().union(*(cbt.chunks(b * 4096, 4096) for b in attempted))
    assert srv.terminate() == 0
    assert_target_is(path, model)
    with open(stats) as f:
        doc = json.load(f)
    assert doc["requests"]["write"]["requests"] == 256, doc
    assert doc["errors"]["enospc"] == len(failed), doc
    # The overwrites were answered from AIO completions (the first of a send
    # may run on the reader instead); the failed ones were not counted there.
    assert len(allocated) * 0.8 <= doc["aio-completed"] <= len(ok), (doc, len(ok))
