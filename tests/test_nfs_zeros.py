"""Zeros are zeros, in full, at every size, on the NFS-like kinds (nfs3:
no fallocate, so zeroing writes; nfs42: DEALLOCATE and ALLOCATE). nbdkit's
file plugin once zeroed only the first 64 MiB of each range when it fell
back to writing on NFS; here 1 GiB over dirty data is zeroed through
WRITE_ZEROES (with and without NO_HOLE and FAST_ZERO, aligned and not at
both ends), through `copy` onto a dirty destination, and by `create
--preallocation full --force` over a dirty file. Every byte is read back
from the backing directory (what the "server" holds), and the bytes just
outside the range must be unchanged. A fast-only zero that cannot be fast
is refused and changes nothing. Needs root and /dev/fuse."""

import errno
import os
import subprocess

import nbd
import pytest

import servers
import storage
from helpers import MiB, connected

GiB = 1 << 30
SIZE = GiB + 4 * MiB
CHUNK = 8 * MiB
DIRT = 0xA5
PROFILES = ["nfs3_dir", "nfs42_dir"]


def fill(path, off, length, byte=DIRT):
    """Writes `byte` over [off, off+length) of the backing file: dirt put on
    the "server" directly (a GiB through FUSE would cost the suite many
    seconds a time; what is checked is read from the backing file too)."""
    buf = bytes([byte]) * CHUNK
    fd = os.open(path, os.O_WRONLY)
    try:
        end = off + length
        while off < end:
            n = min(CHUNK, end - off)
            os.pwrite(fd, buf[:n], off)
            off += n
        os.fsync(fd)
    finally:
        os.close(fd)


def first_other(path, off, length, byte):
    """The first offset in [off, off+length) of `path` not holding `byte`,
    or None. Reads the backing file: what the server holds."""
    want = bytes([byte]) * CHUNK
    with open(path, "rb", buffering=0) as f:
        f.seek(off)
        pos, end = off, off + length
        while pos < end:
            got = f.read(min(CHUNK, end - pos))
            if not got:
                return pos
            if got != want[:len(got)]:
                return pos + next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            pos += len(got)
    return None


def assert_holds(path, off, length, byte, what):
    bad = first_other(path, off, length, byte)
    assert bad is None, f"{what}: byte at {bad} is not {byte:#x}"


@pytest.fixture
def dirty(request):
    """(mount path, backing path) of a SIZE file full of DIRT on the NFS-like
    kind named by the parameter."""
    where = request.getfixturevalue(request.param)
    with storage.scratch_dir_in(where) as d:
        path = os.path.join(d, "disk.img")
        with open(path, "wb") as f:
            f.truncate(SIZE)
        backing = storage.nfs_backing(path)
        fill(backing, 0, SIZE)
        yield path, backing


# (name, offset, length): aligned, and unaligned at both ends.
RANGES = [("aligned", MiB, GiB), ("unaligned", MiB + 777, GiB + 1234)]
FLAGS = [("plain", 0), ("nohole", nbd.CMD_FLAG_NO_HOLE), ("fast", nbd.CMD_FLAG_FAST_ZERO),
         ("fast-nohole", nbd.CMD_FLAG_FAST_ZERO | nbd.CMD_FLAG_NO_HOLE)]


@pytest.mark.parametrize("dirty", PROFILES, indirect=True)
def test_write_zeroes_of_a_gib_zeroes_every_byte(dirty, serve):
    path, backing = dirty
    nfs3 = "nfs3" in path
    srv = serve(path)
    with connected(srv.uri) as h:
        # FAST_ZERO is advertised before anything is learned; NFS 3 has no
        # way to zero but writing, so a fast zero is refused there; NFS 4.2
        # punches, or punches and allocates.
        assert h.can_fast_zero()
        for (rname, off, length) in RANGES:
            for (fname, flags) in FLAGS:
                what = f"{rname} {fname}"
                fast = flags & nbd.CMD_FLAG_FAST_ZERO
                if fast and nfs3:
                    with pytest.raises(nbd.Error) as e:
                        h.zero(length, off, flags)
                    assert e.value.errnum == errno.ENOTSUP, what
                    assert_holds(backing, 0, SIZE, DIRT, f"{what}: refused, yet changed")
                    continue
                h.zero(length, off, flags)
                h.flush()
                assert_holds(backing, off, length, 0, what)
                assert_holds(backing, off - 4096, 4096, DIRT, f"{what}: before the range")
                assert_holds(backing, off + length, 4096, DIRT, f"{what}: after the range")
                fill(backing, off, length)


@pytest.mark.parametrize("dirty", PROFILES, indirect=True)
def test_copy_onto_a_dirty_destination_zeroes_the_holes(dirty, workdir):
    """A sparse source with a little data: the copy leaves a GiB of zero
    requests on the destination, and every one must land in full."""
    path, backing = dirty
    src = os.path.join(workdir, "src.img")
    islands = [(0, 4096), (300 * MiB + 5, 70000), (SIZE - 4096, 4096)]
    with open(src, "wb") as f:
        f.truncate(SIZE)
        for off, n in islands:
            f.seek(off)
            f.write(b"\x3c" * n)
    res = subprocess.run([servers.RAWDISK_BIN, "copy", src, path], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    pos = 0
    for off, n in islands:
        assert_holds(backing, pos, off - pos, 0, f"zeros before {off}")
        assert_holds(backing, off, n, 0x3C, f"data at {off}")
        pos = off + n
    assert pos == SIZE
    assert os.path.getsize(backing) == SIZE


@pytest.mark.parametrize("dirty", PROFILES, indirect=True)
def test_create_full_over_a_dirty_file_zeroes_every_byte(dirty):
    path, backing = dirty
    res = subprocess.run([servers.RAWDISK_BIN, "create", "--force", "--preallocation", "full",
                          path, str(SIZE - 5)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert os.path.getsize(backing) == SIZE - 5
    assert_holds(backing, 0, SIZE - 5, 0, "create --preallocation full")
