"""Checkpoints under qemu's names (docs/cbt.md, NBD): every checkpoint of a
`serve --track-changes` export is also `qemu:dirty-bitmap:NAME`, what
qemu-nbd -B offers and backup tools ask for, and `serve -B/--bitmap NAME`
offers only the named ones; `qemu:allocation-depth` is 1 everywhere, as
qemu-nbd -A answers for a raw file.

Read with the clients that use these names: qemu-img map through
x-dirty-bitmap, nbdinfo --map, python3-libnbd, and an incremental backup
driven by nothing else, which must restore byte-identical."""

import json
import os
import signal
import subprocess

import nbd
import pytest

import servers
from helpers import (KiB, MiB, assert_export_is, assert_same_bytes, assert_target_is,
                     connected, make_image, random_bytes, read_target, write_target)
from test_cbt_serve import (CHANGED, GRAIN, SIZE, checkpoint, chunks,
                            listed_contexts, random_changes, rawdisk, track)

pytestmark = pytest.mark.rawdisk_only("changed-block tracking is rawdisk's")

DIRTY = "qemu:dirty-bitmap:"
DEPTH = "qemu:allocation-depth"


def bitmap(serve, path, *names):
    """A server that offers exactly `names` as qemu:dirty-bitmap: (-B)."""
    extra = []
    for n in names:
        extra += ["-B", n]
    return serve(path, extra=extra)


def as_ranges(chunk_set, grain=GRAIN, size=SIZE):
    """Sorted, merged [(offset, length)] of a set of chunks."""
    out = []
    for c in sorted(chunk_set):
        off, end = c * grain, min((c + 1) * grain, size)
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((off, end - off))
    return out


def merged(runs):
    """[(offset, length)] of the runs whose flag is set, merged, after
    checking that the runs tile [0, end) with nothing missing."""
    out = []
    at = 0
    for off, n, flag in runs:
        assert off == at and n > 0, runs
        at += n
        if not flag:
            continue
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out, at


def qemu_img_dirty(srv, name):
    """The ranges qemu-img map reports dirty through x-dirty-bitmap: qemu
    reads the bitmap's flag 1 as base:allocation's HOLE, so a dirty range
    is "data": false (and never "zero": the ZERO bit is not set)."""
    opts = (f"driver=nbd,server.type=unix,server.path={srv.sock},"
            f"x-dirty-bitmap={DIRTY}{name}")
    out = subprocess.run(["qemu-img", "map", "--output=json", "--image-opts", opts],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    runs = []
    for e in json.loads(out):
        assert e["zero"] is False, e
        runs.append((e["start"], e["length"], not e["data"]))
    ranges, end = merged(runs)
    assert end == SIZE, out
    return ranges


def nbdinfo_map(uri, context):
    out = subprocess.run(["nbdinfo", "--json", f"--map={context}", uri], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [(e["offset"], e["length"], e["type"]) for e in json.loads(out)]


def nbdinfo_dirty(uri, name):
    runs = nbdinfo_map(uri, DIRTY + name)
    assert all(t in (0, 1) for _, _, t in runs), runs
    ranges, end = merged(runs)
    assert end == SIZE, runs
    return ranges


def extents(h, context, offset, length, flags=0):
    """[(offset, length, flags)] of one BLOCK_STATUS for `context`."""
    got = []

    def cb(ctx, off, entries, err):
        if ctx == context:
            got.append((off, list(entries)))
        return 0

    h.block_status(length, offset, cb, flags)
    assert len(got) == 1, got
    off, entries = got[0]
    assert off == offset
    out = []
    for i in range(0, len(entries), 2):
        out.append((off, entries[i], entries[i + 1]))
        off += entries[i]
    return out


def libnbd_dirty(h, name, step=4 * MiB):
    """Every dirty range of the export, asking again from where each reply
    ends (as a backup tool does)."""
    runs = []
    pos = 0
    size = h.get_size()
    while pos < size:
        got = extents(h, DIRTY + name, pos, min(step, size - pos))
        assert all(flag in (0, 1) for _, _, flag in got), got
        runs += got
        pos = got[-1][0] + got[-1][1]
    ranges, end = merged(runs)
    assert end == size
    return ranges


def write_ranges(uri, model, ranges, seed):
    """pwrite random bytes at each (offset, length) and flush."""
    with connected(uri) as h:
        for i, (off, n) in enumerate(ranges):
            data = random_bytes(n, seed + i)
            h.pwrite(data, off)
            model[off:off + n] = data
        h.flush()


# -- what the clients read ------------------------------------------------------------

def test_qemu_img_and_nbdinfo_read_the_written_ranges(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=31, sparse=True)
    checkpoint(path, "c0")
    srv = track(serve, path)
    # Chunk-aligned writes are exactly the dirty ranges; an unaligned one
    # dirties the chunks it touches.
    aligned = [(0, GRAIN), (3 * GRAIN, 5 * GRAIN), (SIZE - 2 * GRAIN, 2 * GRAIN)]
    write_ranges(srv.uri, model, aligned, seed=310)
    assert qemu_img_dirty(srv, "c0") == aligned
    assert nbdinfo_dirty(srv.uri, "c0") == aligned
    checkpoint(path, "c1")
    odd = [(5 * MiB + 100, 3 * KiB), (7 * MiB - 10, 20)]
    write_ranges(srv.uri, model, odd, seed=320)
    want1 = as_ranges(set().union(*(chunks(o, n) for o, n in odd)))
    assert want1 == [(5 * MiB, GRAIN), (7 * MiB - GRAIN, 2 * GRAIN)]
    want0 = as_ranges(set().union(*(chunks(o, n) for o, n in aligned + odd)))
    for name, want in (("c0", want0), ("c1", want1)):
        assert qemu_img_dirty(srv, name) == want, name
        assert nbdinfo_dirty(srv.uri, name) == want, name
    # Both names answer alike on one connection; REQ_ONE gives the first
    # extent only.
    h = nbd.NBD()
    for ctx in (DIRTY + "c1", CHANGED + "c1"):
        h.add_meta_context(ctx)
    h.connect_uri(srv.uri)
    try:
        assert libnbd_dirty(h, "c1", step=3 * MiB) == want1
        mine = extents(h, CHANGED + "c1", 4 * MiB, 4 * MiB)
        assert extents(h, DIRTY + "c1", 4 * MiB, 4 * MiB) == mine
        assert mine == [(4 * MiB, MiB, 0), (5 * MiB, GRAIN, 1),
                        (5 * MiB + GRAIN, 2 * MiB - 2 * GRAIN, 0),
                        (7 * MiB - GRAIN, 2 * GRAIN, 1), (7 * MiB + GRAIN, MiB - GRAIN, 0)]
        one = extents(h, DIRTY + "c1", 5 * MiB + 7, MiB, nbd.CMD_FLAG_REQ_ONE)
        assert one == [(5 * MiB + 7, GRAIN - 7, 1)], one
    finally:
        h.shutdown()
    assert_export_is(srv.uri, model)
    assert srv.terminate() == 0
    assert_target_is(path, model)


def test_allocation_depth_is_one_everywhere_as_qemu_nbd_says(workdir, serve):
    """A raw file with holes and data: rawdisk and qemu-nbd -A answer the
    same qemu:allocation-depth, 1 ("local") over the whole file, with or
    without tracking; nbdinfo lists it."""
    path, model = make_image(workdir, "disk.img", SIZE, seed=32, sparse=True)
    for extra in ([], ["--track-changes"]):
        srv = serve(path, extra=extra)
        out = subprocess.run(["nbdinfo", "--list", "--content", srv.uri], check=True,
                             capture_output=True, text=True, timeout=60).stdout
        lines = [ln.strip() for ln in out.splitlines()]
        assert "content: data" in lines, out
        assert DEPTH in lines[lines.index("contexts:") + 1:], out
        assert nbdinfo_map(srv.uri, DEPTH) == [(0, SIZE, 1)]
        text = subprocess.run(["nbdinfo", f"--map={DEPTH}", srv.uri], check=True,
                              capture_output=True, text=True, timeout=60).stdout.split()
        assert text == ["0", str(SIZE), "1", "local"], text
        h = nbd.NBD()
        h.add_meta_context(DEPTH)
        h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
        h.connect_uri(srv.uri)
        try:
            assert h.can_meta_context(DEPTH)
            # A hole (the first 1 MiB island ends at 64 KiB) and data: one
            # extent, the request's length, depth 1.
            assert extents(h, DEPTH, 100 * KiB, 3 * MiB) == [(100 * KiB, 3 * MiB, 1)]
            assert extents(h, DEPTH, 0, SIZE, nbd.CMD_FLAG_REQ_ONE) == [(0, SIZE, 1)]
            base = extents(h, nbd.CONTEXT_BASE_ALLOCATION, 0, 2 * MiB)
            assert any(f & 1 for _, _, f in base), base  # there are holes
        finally:
            h.shutdown()
        assert srv.terminate() == 0
    if subprocess.run(["qemu-nbd", "--help"], capture_output=True, text=True).stdout.find(
            "--allocation-depth") < 0:
        pytest.skip("this qemu-nbd has no -A to compare with")
    ref = servers.Server(workdir, path, kind="qemu-nbd", extra=["-A"]).start()
    try:
        assert nbdinfo_map(ref.uri, DEPTH) == [(0, SIZE, 1)]
    finally:
        ref.terminate()
    assert_target_is(path, model)


# -- listing --------------------------------------------------------------------------

def test_list_with_qemu_prefixes_with_and_without_bitmap(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=33)
    for n in ("a", "b", "c"):
        checkpoint(path, n)
    srv = track(serve, path)
    every = [DIRTY + n for n in "abc"]
    assert listed_contexts(srv.uri, ["qemu:"]) == [DEPTH] + every
    assert listed_contexts(srv.uri, ["qemu:dirty-bitmap:"]) == every
    assert listed_contexts(srv.uri, [DIRTY + "b", DIRTY + "zz", "qemu:zz"]) == [DIRTY + "b"]
    assert listed_contexts(srv.uri, [DEPTH]) == [DEPTH]
    assert listed_contexts(srv.uri, ["rawdisk:"]) == [CHANGED + n for n in "abc"]
    assert srv.terminate() == 0

    # -B b: qemu's name for b only (imageio expects exactly one);
    # rawdisk's names and qemu:allocation-depth as before.
    srv = bitmap(serve, path, "b")
    assert listed_contexts(srv.uri, ["qemu:dirty-bitmap:"]) == [DIRTY + "b"]
    assert listed_contexts(srv.uri, ["qemu:"]) == [DEPTH, DIRTY + "b"]
    assert listed_contexts(srv.uri, [DIRTY + "a"]) == []
    assert listed_contexts(srv.uri, []) == (["base:allocation", DEPTH]
                                            + [CHANGED + n for n in "abc"] + [DIRTY + "b"])
    # SET of a name not offered selects nothing; the offered one works.
    h = nbd.NBD()
    h.add_meta_context(DIRTY + "a")
    h.add_meta_context(DIRTY + "b")
    h.connect_uri(srv.uri)
    try:
        assert not h.can_meta_context(DIRTY + "a")
        assert h.can_meta_context(DIRTY + "b")
        assert libnbd_dirty(h, "b") == []
    finally:
        h.shutdown()
    # A checkpoint made while served is rawdisk's only; -B is the list.
    checkpoint(path, "d")
    assert listed_contexts(srv.uri, ["qemu:dirty-bitmap:"]) == [DIRTY + "b"]
    assert CHANGED + "d" in listed_contexts(srv.uri, ["rawdisk:changed:"])
    assert srv.terminate() == 0

    srv = bitmap(serve, path, "c", "a")
    assert listed_contexts(srv.uri, ["qemu:dirty-bitmap:"]) == [DIRTY + "a", DIRTY + "c"]
    assert srv.terminate() == 0

    # Without tracking: qemu:allocation-depth only.
    srv = serve(path)
    assert listed_contexts(srv.uri, ["qemu:"]) == [DEPTH]
    assert listed_contexts(srv.uri, ["qemu:dirty-bitmap:"]) == []
    assert srv.terminate() == 0
    assert_target_is(path, model)


def test_bitmap_that_does_not_exist_is_refused(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=34)
    checkpoint(path, "c0")
    srv = servers.Server(workdir, path, extra=["--bitmap", "c0", "-B", "missing"])
    srv.start(expect_ready=False)
    assert srv.wait_exit() == 1
    err = [ln for ln in srv.stderr().splitlines() if ln.startswith("rawdisk:")]
    assert len(err) == 1, srv.stderr()
    assert "'missing'" in err[0] and "c0" in err[0], err
    assert not os.path.exists(srv.sock)
    # -B is qemu-nbd's and has no meaning with --dir.
    r = rawdisk("serve", "--dir", workdir, "-B", "c0", "-U", os.path.join(workdir, "d.sock"),
                check=False)
    assert r.returncode == 2 and "--dir" in r.stderr, r.stderr
    # The state file still holds c0, consistent: nothing was served.
    srv = bitmap(serve, path, "c0")
    assert qemu_img_dirty(srv, "c0") == []
    assert srv.terminate() == 0
    assert_target_is(path, model)


# -- an inconsistent checkpoint -------------------------------------------------------

def test_inconsistent_checkpoint_is_all_dirty_under_qemus_name(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=35)
    checkpoint(path, "a")
    # Written while nobody tracked it: a is inconsistent.
    write_target(path, b"untracked", 9 * MiB)
    model[9 * MiB:9 * MiB + 9] = b"untracked"
    srv = bitmap(serve, path, "a")
    assert "inconsistent" in srv.stderr()
    assert qemu_img_dirty(srv, "a") == [(0, SIZE)]
    assert nbdinfo_map(srv.uri, DIRTY + "a") == [(0, SIZE, 1)]
    h = nbd.NBD()
    h.add_meta_context(DIRTY + "a")
    h.connect_uri(srv.uri)
    try:
        assert extents(h, DIRTY + "a", 3 * MiB + 5, MiB) == [(3 * MiB + 5, MiB, 1)]
    finally:
        h.shutdown()
    assert srv.terminate() == 0

    # A kill -9 of a tracking server: the same, and a checkpoint made after
    # it is consistent (all-dirty is not a constant answer).
    srv = track(serve, path)
    with connected(srv.uri) as h:
        h.pwrite(b"k" * 10, MiB)
        model[MiB:MiB + 10] = b"k" * 10
        h.flush()
        srv.proc.send_signal(signal.SIGKILL)
        srv.wait_exit()
    srv = track(serve, path)
    assert qemu_img_dirty(srv, "a") == [(0, SIZE)]
    checkpoint(path, "b")
    assert nbdinfo_dirty(srv.uri, "b") == []
    write_ranges(srv.uri, model, [(2 * GRAIN, GRAIN)], seed=350)
    assert qemu_img_dirty(srv, "b") == [(2 * GRAIN, GRAIN)]
    assert qemu_img_dirty(srv, "a") == [(0, SIZE)]
    assert srv.terminate() == 0
    assert_target_is(path, model)


def test_selected_checkpoint_name_reused_is_not_read(workdir, serve):
    """A connection that selected a checkpoint keeps it: deleted and made
    again under the same name, BLOCK_STATUS fails with EINVAL instead of
    answering the new checkpoint's (empty) changes."""
    path, model = make_image(workdir, "disk.img", SIZE, seed=36)
    checkpoint(path, "a")
    srv = track(serve, path)
    write_ranges(srv.uri, model, [(4 * GRAIN, GRAIN)], seed=360)
    h = nbd.NBD()
    h.add_meta_context(DIRTY + "a")
    h.add_meta_context(CHANGED + "a")
    h.connect_uri(srv.uri)
    try:
        assert libnbd_dirty(h, "a") == [(4 * GRAIN, GRAIN)]
        rawdisk("checkpoint", "delete", "--name", "a", path)
        checkpoint(path, "a")
        with pytest.raises(nbd.Error) as e:
            extents(h, DIRTY + "a", 0, MiB)
        assert e.value.errno == "EINVAL", e.value
    finally:
        h.shutdown()
    # A new connection gets the new checkpoint: nothing changed since it.
    assert qemu_img_dirty(srv, "a") == []
    srv.assert_alive()
    assert srv.terminate() == 0
    assert_target_is(path, model)


# -- an incremental backup with nothing but qemu's names ------------------------------

def copy_ranges(uri, ranges, backup):
    """Read each range from the export and write it at the same offset of
    the backup file; the bytes copied."""
    done = 0
    fd = os.open(backup, os.O_WRONLY)
    try:
        with connected(uri, name="backup") as h:
            for off, n in ranges:
                for at in range(off, off + n, 4 * MiB):
                    k = min(4 * MiB, off + n - at)
                    assert os.pwrite(fd, h.pread(k, at), at) == k
                    done += k
        os.fsync(fd)
    finally:
        os.close(fd)
    return done


def test_incremental_backup_driven_by_qemu_names_restores_identical(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=37, sparse=True)
    backup = os.path.join(workdir, "backup.img")
    checkpoint(path, "c0")
    srv = track(serve, path)
    # Full copy at c0 with qemu-img.
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "raw", srv.uri, backup],
                   check=True, capture_output=True, timeout=120)
    assert_target_is(backup, model, "full backup")
    touched = random_changes(srv.uri, model, seed=37, conns=2, ops=12)
    checkpoint(path, "c1")
    # Written after c1 and before the copy: in c0's changes and c1's.
    late = [(SIZE - 3 * GRAIN, GRAIN)]
    write_ranges(srv.uri, model, late, seed=370)
    assert srv.terminate() == 0
    assert read_target(backup) != model

    # Incremental 1: the server offers c0 alone under qemu's name (as a
    # backup job exports its bitmap); python3-libnbd reads the extents and
    # copies the dirty ranges only.
    srv = bitmap(serve, path, "c0")
    assert listed_contexts(srv.uri, ["qemu:dirty-bitmap:"]) == [DIRTY + "c0"]
    h = nbd.NBD()
    h.add_meta_context(DIRTY + "c0")
    h.connect_uri(srv.uri)
    try:
        dirty = libnbd_dirty(h, "c0", step=5 * MiB)
    finally:
        h.shutdown()
    want = touched | chunks(*late[0])
    assert dirty == as_ranges(want)
    copied = copy_ranges(srv.uri, dirty, backup)
    assert copied == sum(n for _, n in as_ranges(want)) < SIZE
    assert_target_is(backup, model, "backup after incremental 1")

    # More writes through this server; c2; incremental 2 from c1 with the
    # ranges qemu-img map reads through x-dirty-bitmap.
    more = [(GRAIN, 3 * GRAIN), (6 * MiB + 1, 2 * KiB)]
    write_ranges(srv.uri, model, more, seed=371)
    checkpoint(path, "c2")
    assert srv.terminate() == 0
    srv = bitmap(serve, path, "c1")
    ranges = qemu_img_dirty(srv, "c1")
    want = chunks(*late[0]).union(*(chunks(o, n) for o, n in more))
    assert ranges == as_ranges(want)
    copy_ranges(srv.uri, ranges, backup)

    # Restore: the backup, copied back by qemu-img, is the disk byte for byte.
    restored = os.path.join(workdir, "restored.img")
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "raw", backup, restored],
                   check=True, capture_output=True, timeout=120)
    assert_export_is(srv.uri, read_target(restored), "served disk vs restored backup")
    assert srv.terminate() == 0
    assert_same_bytes(read_target(restored), read_target(path), "restored vs disk")
    assert_target_is(path, model)
