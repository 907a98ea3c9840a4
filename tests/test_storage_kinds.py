"""The server on every kind of storage docs/capabilities.md covers: tmpfs, ramfs,
ext4, XFS and btrfs (on loop devices), the NFS-like nfs3 and nfs42, and bare
loop devices with 512 and 4096-byte sectors. Ordinary I/O works everywhere; FAST_ZERO is honest everywhere:
it succeeds quickly where the storage can zero without writing (punching on
tmpfs, ext4, XFS, a loop device on ext4), and on ramfs fails at once with
ENOTSUP and changes nothing. Zero with may-trim frees space on file systems
that punch holes. Needs root (mounts, loop devices)."""

import errno
import os
import subprocess
import time

import nbd
import pytest

import storage
from helpers import (MiB, allocated_bytes, assert_export_is, assert_target_is, connected,
                     fill_device, make_image, random_bytes, wait_all)

SIZE = 32 * MiB
FILE_SYSTEMS = storage.FILE_SYSTEMS
DEVICES = ["loop512", "loop4096", "loop_on_ext4"]


@pytest.fixture
def target(request):
    """(path, model) of a dirty 32 MiB file on the storage named by the
    parameter, or a whole dirty loop device."""
    name = request.param
    where = request.getfixturevalue(name)
    if name in DEVICES:
        yield where, fill_device(where, seed=71)
        return
    with storage.scratch_dir_in(where) as d:
        yield make_image(d, "disk.img", SIZE, seed=71)


def check_everything(srv, path, model):
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


@pytest.mark.parametrize("target", FILE_SYSTEMS + DEVICES, indirect=True)
def test_writes_zeroes_and_reads(target, serve):
    path, model = target
    srv = serve(path)
    size = len(model)
    with connected(srv.uri) as h:
        cookies = []
        for i in range(32):
            off = i * (size // 32) + 4096 * (i % 3)
            data = random_bytes(256 * 1024, seed=700 + i)
            cookies.append(h.aio_pwrite(nbd.Buffer.from_bytearray(data), off))
            model[off:off + len(data)] = data
        assert set(wait_all(h, cookies).values()) == {0}
        h.zero(MiB, 3 * MiB)
        h.zero(MiB, 5 * MiB, nbd.CMD_FLAG_NO_HOLE)
        model[3 * MiB:4 * MiB] = bytes(MiB)
        model[5 * MiB:6 * MiB] = bytes(MiB)
        h.flush()
    check_everything(srv, path, model)


@pytest.mark.parametrize("target", FILE_SYSTEMS + DEVICES, indirect=True)
def test_qemu_img_convert_sparse_image_onto(target, serve, workdir):
    path, model = target
    src, src_model = make_image(workdir, "src.img", len(model), seed=72, sparse=True)
    srv = serve(path)
    res = subprocess.run(["qemu-img", "convert", "-n", "-W", "-f", "raw", "-O", "raw", src, srv.uri],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    check_everything(srv, path, src_model)


def fast_zero(h, length, offset, no_hole):
    flags = nbd.CMD_FLAG_FAST_ZERO | (nbd.CMD_FLAG_NO_HOLE if no_hole else 0)
    start = time.monotonic()
    try:
        h.zero(length, offset, flags)
        outcome = 0
    except nbd.Error as e:
        outcome = e.errnum
    return outcome, time.monotonic() - start


# Where FAST_ZERO must succeed: (storage, NO_HOLE set?).
MUST_BE_FAST = [("tmpfs_dir", False), ("ext4_dir", False), ("ext4_dir", True),
                ("xfs_dir", False), ("xfs_dir", True), ("btrfs_dir", False), ("btrfs_dir", True),
                # NFS 4.2: DEALLOCATE, and DEALLOCATE + ALLOCATE to keep the space.
                ("nfs42_dir", False), ("nfs42_dir", True),
                ("loop_on_ext4", False), ("loop_on_ext4", True)]


@pytest.mark.rawdisk_only("nbdkit 1.32's file plugin has no fast zero")
@pytest.mark.parametrize("target,no_hole", MUST_BE_FAST, indirect=["target"],
                         ids=[f"{t}-{'nohole' if n else 'trim'}" for t, n in MUST_BE_FAST])
def test_fast_zero_succeeds(target, no_hole, serve):
    path, model = target
    srv = serve(path)
    with connected(srv.uri) as h:
        assert h.can_fast_zero()
        outcome, took = fast_zero(h, 8 * MiB, 4 * MiB + 4096, no_hole)
        assert outcome == 0, f"fast zero failed with {errno.errorcode.get(outcome)}"
        assert took < 2.0
        model[4 * MiB + 4096:12 * MiB + 4096] = bytes(8 * MiB)
        h.flush()
    check_everything(srv, path, model)


@pytest.mark.rawdisk_only("nbdkit 1.32's file plugin has no fast zero")
@pytest.mark.parametrize("target", ["ramfs_dir", "nfs3_dir"], indirect=True)
@pytest.mark.parametrize("no_hole", [False, True], ids=["trim", "nohole"])
def test_fast_zero_without_fallocate_fails_fast_and_changes_nothing(target, no_hole, serve):
    """ramfs and the NFS 3 client cannot punch or zero a range: the only way
    to zero is to write, which is exactly what FAST_ZERO forbids."""
    path, model = target
    srv = serve(path)
    with connected(srv.uri) as h:
        outcome, took = fast_zero(h, 16 * MiB, 2 * MiB, no_hole)
        assert outcome == errno.ENOTSUP
        assert took < 1.0
        # A plain zero still works, by writing.
        h.zero(MiB, 20 * MiB)
        model[20 * MiB:21 * MiB] = bytes(MiB)
        # And the refusal is stable: asking again gives the same answer.
        assert fast_zero(h, 4096, 0, no_hole)[0] == errno.ENOTSUP
    check_everything(srv, path, model)


MAY_REFUSE = [("loop512", False), ("loop512", True), ("loop4096", False), ("loop4096", True),
              ("tmpfs_dir", True)]


@pytest.mark.rawdisk_only("nbdkit 1.32's file plugin has no fast zero")
@pytest.mark.parametrize("target,no_hole", MAY_REFUSE, indirect=["target"],
                         ids=[f"{t}-{'nohole' if n else 'trim'}" for t, n in MAY_REFUSE])
def test_fast_zero_is_honest(target, no_hole, serve):
    """Where the kernel may fall back to writing zero pages (a loop device on
    tmpfs has no write-zeroes that stays fast; tmpfs has no ZERO_RANGE) the
    server may refuse: either the range is zero, or ENOTSUP and nothing
    changed. Never a failure that leaves the range half done."""
    path, model = target
    srv = serve(path)
    with connected(srv.uri) as h:
        outcome, took = fast_zero(h, 8 * MiB, 4 * MiB, no_hole)
        assert outcome in (0, errno.ENOTSUP), errno.errorcode.get(outcome)
        assert took < 2.0
        if outcome == 0:
            model[4 * MiB:12 * MiB] = bytes(8 * MiB)
    check_everything(srv, path, model)


@pytest.mark.parametrize("target", ["tmpfs_dir", "ext4_dir", "xfs_dir", "btrfs_dir", "nfs42_dir"],
                         indirect=True)
def test_zero_may_trim_frees_and_no_hole_keeps(target, serve):
    path, model = target
    srv = serve(path)
    with connected(srv.uri) as h:
        h.flush()
        before = allocated_bytes(path)
        h.zero(8 * MiB, 8 * MiB, nbd.CMD_FLAG_NO_HOLE)
        h.flush()
        kept = allocated_bytes(path)
        h.zero(8 * MiB, 16 * MiB)
        h.flush()
        freed = allocated_bytes(path)
    model[8 * MiB:24 * MiB] = bytes(16 * MiB)
    assert kept >= before - MiB, (before, kept)
    assert freed <= kept - 7 * MiB, (kept, freed)
    check_everything(srv, path, model)


@pytest.mark.parametrize("target", ["loop512", "loop4096"], indirect=True)
def test_rotational_flag_tells_the_truth(target, serve):
    path, _ = target
    name = os.path.basename(os.path.realpath(path))
    with open(f"/sys/block/{name}/queue/rotational") as f:
        rotational = f.read().strip() == "1"
    srv = serve(path, read_only=True)
    with connected(srv.uri) as h:
        assert bool(h.is_rotational()) == rotational
        assert h.is_read_only()
