"""`rawdisk copy --changed-since`: incremental backups of a raw disk.

The chain: a full copy after checkpoint c0, then three rounds of random
writes, zeroes and trims through `serve --track-changes` (python3-libnbd),
a new checkpoint, and an incremental copy since the previous one, from the
NBD export (rawdisk:changed:NAME) or from the stopped local target (its
state file). After each round the backup equals the source byte for byte,
the bytes copied are fewer than the disk and at least the changed set at
the bitmap's granularity, and a poisoned region of the backup that the
source did not change survives (nothing outside the changed ranges is
written). The same for a block device (state in --state-dir) onto a backup
served over NBD. Then the failure paths: --verify against a destination that
loses writes, unknown checkpoints, a missing or wrongly sized backup, a
local target that is being served, an export without tracking, and flags
that make no sense with an incremental copy.
"""

import os
import random
import re
import shutil
import subprocess
import tempfile

import pytest

import servers
import storage
from helpers import (KiB, MiB, assert_same_bytes, connected, failed, make_image,
                     random_bytes, read_target, write_target)

pytestmark = pytest.mark.rawdisk_only("changed-block tracking is rawdisk's")

SIZE = 64 * MiB
GRAN = 64 * KiB
ROUNDS = 3


def rawdisk(*args, timeout=120):
    return subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, timeout=timeout)


def ok(res):
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    return res



def checkpoint(target, name, state_dir=None):
    extra = ["--state-dir", state_dir] if state_dir else []
    ok(rawdisk("checkpoint", "create", "--name", name, *extra, target))


def copied_bytes(out):
    """(changed bytes, size) from the summary of an incremental copy."""
    m = re.search(r"\((\d+) of (\d+) bytes\)", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def mutate(uri, rnd):
    """Random writes, zeroes and trims through the export, then a flush.
    Returns the set of GRAN chunks they touched."""
    touched = set()
    with connected(uri, name="mutate") as h:
        for _ in range(rnd.randrange(6, 14)):
            op = rnd.choice(["write", "write", "zero", "trim"])
            length = rnd.choice([512, 4 * KiB, 37 * KiB, 200 * KiB, MiB + 3 * KiB])
            offset = rnd.randrange(0, SIZE - length) // 512 * 512
            if op == "write":
                h.pwrite(rnd.randbytes(length), offset)
            elif op == "zero" or not h.can_trim():
                # Storage that cannot punch (NFS 3) advertises no trim.
                h.zero(length, offset)
            else:
                h.trim(length, offset)
            touched.update(range(offset // GRAN, (offset + length + GRAN - 1) // GRAN))
        h.flush()
    return touched


def poison_spot(touched, rnd):
    """A GRAN chunk no change touched, with both neighbours untouched."""
    free = [c for c in range(1, SIZE // GRAN - 1)
            if not {c - 1, c, c + 1} & touched]
    return rnd.choice(free) * GRAN


def incremental(src_spec, backup, since, snapshot, touched, rnd, extra=(), dst_spec=None):
    """copy --changed-since onto a backup (the file `backup`, or `dst_spec`
    serving it) with one untouched chunk poisoned; checks the result and
    restores the chunk. Returns the bytes copied and the summary."""
    spot = poison_spot(touched, rnd)
    write_target(backup, b"\xa5" * GRAN, spot)
    out = ok(rawdisk("copy", "--changed-since", since, *extra, src_spec,
                     dst_spec or backup)).stdout.decode()
    changed, size = copied_bytes(out)
    assert size == SIZE, out
    assert len(touched) * GRAN <= changed < SIZE, (len(touched), out)
    assert changed % GRAN == 0, out
    got = read_target(backup)
    assert got[spot:spot + GRAN] == b"\xa5" * GRAN, \
        f"the copy wrote outside the changed ranges, at {spot}"
    got[spot:spot + GRAN] = snapshot[spot:spot + GRAN]
    assert_same_bytes(got, snapshot, f"backup after the incremental since {since}")
    write_target(backup, snapshot[spot:spot + GRAN], spot)
    return changed, out


@pytest.fixture(params=["tmpfs_dir", "ext4_dir", "btrfs_dir", "nfs3_dir", "nfs42_dir"])
def chain_dir(request):
    """A fresh directory on tmpfs, ext4, btrfs or the NFS-like kinds (root only)."""
    d = tempfile.mkdtemp(prefix="cbt-", dir=request.getfixturevalue(request.param))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def full_backup(d, seed):
    src, _ = make_image(d, "disk.img", SIZE, seed=seed, sparse=True)
    backup = os.path.join(d, "backup.img")
    checkpoint(src, "c0")
    ok(rawdisk("copy", src, backup))
    assert_same_bytes(read_target(backup), read_target(src), "full backup")
    return src, backup


def test_chain_from_the_nbd_export(chain_dir, serve):
    rnd = random.Random(2001)
    src, backup = full_backup(chain_dir, 2001)
    srv = serve(src, extra=["--track-changes"])
    for n in range(1, ROUNDS + 1):
        touched = mutate(srv.uri, rnd)
        checkpoint(src, f"c{n}")
        # Nothing writes between the checkpoint and the copy: the file is
        # the source at checkpoint time.
        snapshot = read_target(src)
        incremental(srv.uri, backup, f"c{n - 1}", snapshot, touched, rnd)
    # Since the last checkpoint nothing changed: nothing to copy.
    out = ok(rawdisk("copy", "--changed-since", f"c{ROUNDS}", srv.uri, backup)).stdout.decode()
    assert copied_bytes(out) == (0, SIZE), out
    # Since the first, every round's changes at once, verified.
    out = ok(rawdisk("copy", "--verify", "--changed-since", "c0", srv.uri, backup)).stdout.decode()
    assert "verified" in out, out
    assert_same_bytes(read_target(backup), read_target(src), "backup since c0")
    srv.assert_alive()


@pytest.mark.parametrize("state_dir", [False, True], ids=["sidecar", "state-dir"])
def test_chain_from_the_stopped_local_target(chain_dir, serve, state_dir):
    rnd = random.Random(2002)
    sd = None
    src, _ = make_image(chain_dir, "disk.img", SIZE, seed=2002, sparse=True)
    backup = os.path.join(chain_dir, "backup.img")
    if state_dir:
        sd = os.path.join(chain_dir, "state")
        os.mkdir(sd)
    checkpoint(src, "c0", sd)
    sd_args = ["--state-dir", sd] if sd else []
    # The state dir tells the full copy the identity its backup record holds.
    ok(rawdisk("copy", *sd_args, src, backup))
    for n in range(1, ROUNDS + 1):
        srv = serve(src, extra=["--track-changes", *sd_args])
        touched = mutate(srv.uri, rnd)
        assert srv.terminate() == 0, srv.stderr()
        checkpoint(src, f"c{n}", sd)
        snapshot = read_target(src)
        _, out = incremental(src, backup, f"c{n - 1}", snapshot, touched, rnd, extra=sd_args)
        assert "warning" not in out
    assert os.path.exists(os.path.join(sd, "disk.img.rawdisk-cbt") if sd
                          else src + ".rawdisk-cbt")


def test_verify_catches_a_destination_that_loses_writes(chain_dir, workdir, serve):
    """nbdkit's null plugin takes every write and reads back zeros: the copy
    succeeds, --verify must not."""
    rnd = random.Random(2003)
    src, _ = make_image(chain_dir, "disk.img", SIZE, seed=2003, sparse=True)
    checkpoint(src, "c0")
    srv = serve(src, extra=["--track-changes"])
    with connected(srv.uri, name="w") as h:
        h.pwrite(rnd.randbytes(4096), 5 * MiB + 512)
        h.flush()
    sink = servers.Server(workdir, None, kind="nbdkit")
    sink.argv = ["nbdkit", "-f", "-P", sink.pid_file, "-U", sink.sock, "null", f"size={SIZE}"]
    sink.start()
    # The sink holds no backup of anything: trusted, to reach --verify.
    trust = ["--trust-destination", "--backup-record", os.path.join(workdir, "sink.rec")]
    try:
        ok(rawdisk("copy", *trust, "--changed-since", "c0", srv.uri, sink.uri))
        res = rawdisk("copy", *trust, "--verify", "--changed-since", "c0", srv.uri, sink.uri)
        # The whole destination is compared: the first byte the sink lost
        # is the source's first non-zero one.
        data = read_target(src)
        first = next(i for i in range(SIZE) if data[i])
        failed(res, 1, "verify:", f"differ at offset {first}")
    finally:
        sink.kill()


def test_errors_are_one_line(chain_dir, serve):
    src, backup = full_backup(chain_dir, 2004)
    plain = serve(src)
    # An export without tracking, or a checkpoint it does not have.
    failed(rawdisk("copy", "--changed-since", "c0", plain.uri, backup), 1,
           "rawdisk:changed:c0", "--track-changes")
    assert plain.terminate() == 0
    srv = serve(src, extra=["--track-changes"])
    failed(rawdisk("copy", "--changed-since", "nope", srv.uri, backup), 1,
           "rawdisk:changed:nope", "checkpoint nope exist")
    # A local target while a server tracks it: the server holds changes the
    # state file does not have yet.
    failed(rawdisk("copy", "--changed-since", "c0", src, backup), 1, "NBD")
    assert srv.terminate() == 0
    failed(rawdisk("copy", "--changed-since", "nope", src, backup), 1, "nope", "c0")
    # The previous backup must be there, with the disk's size.
    missing = os.path.join(chain_dir, "missing.img")
    failed(rawdisk("copy", "--changed-since", "c0", src, missing), 1, missing, "full copy first")
    assert not os.path.exists(missing)
    with open(backup, "r+b") as f:
        f.truncate(SIZE - 4096)
    before = read_target(backup)
    failed(rawdisk("copy", "--changed-since", "c0", src, backup), 1,
           str(SIZE - 4096), str(SIZE))
    assert read_target(backup) == before


def test_flags_that_make_no_sense_are_usage_errors(chain_dir):
    src, backup = full_backup(chain_dir, 2005)
    before = read_target(backup)
    for args in (["--target-is-zero"], ["--force"], ["--preallocation", "full"]):
        failed(rawdisk("copy", "--changed-since", "c0", *args, src, backup), 2, args[0])
    failed(rawdisk("copy", "--changed-since", "c0", src, "null:"), 2, "null:")
    failed(rawdisk("copy", "--changed-since", "c0", "--state-dir", chain_dir,
                   "nbd+unix:///?socket=/nonexistent", backup), 2, "--state-dir")
    assert read_target(backup) == before


def test_a_change_made_without_tracking_makes_a_full_copy(chain_dir, serve):
    """Written while nobody tracked it: the checkpoint is inconsistent, the
    copy says so and copies everything (locally and through the export)."""
    src, backup = full_backup(chain_dir, 2006)
    write_target(src, b"\x5a" * 4096, 9 * MiB)
    write_target(backup, b"\xa5" * 4096, 40 * MiB)
    res = ok(rawdisk("copy", "--changed-since", "c0", src, backup))
    err = res.stderr.decode()
    assert any(line.startswith("rawdisk: warning: checkpoint c0 is inconsistent")
               and line.endswith("this is a full copy") for line in err.splitlines()), err
    assert copied_bytes(res.stdout.decode()) == (SIZE, SIZE)
    assert_same_bytes(read_target(backup), read_target(src), "backup after a full copy")
    srv = serve(src, extra=["--track-changes"])
    write_target(backup, b"\xa5" * 4096, 40 * MiB)
    res = ok(rawdisk("copy", "--changed-since", "c0", srv.uri, backup))
    assert "full copy" in res.stderr.decode(), res.stderr
    assert copied_bytes(res.stdout.decode()) == (SIZE, SIZE)
    assert_same_bytes(read_target(backup), read_target(src), "backup after a full copy")


@pytest.fixture
def dev():
    """A loop device of SIZE bytes (root only)."""
    if not storage.is_root():
        pytest.skip("needs root")
    with storage.loop_on_tmpfs(512, SIZE // MiB) as dev:
        yield dev


def test_chain_of_a_block_device_onto_an_nbd_backup(workdir, serve, dev):
    """A block device keeps its state in --state-dir; the backup is another
    server's export, written through NBD."""
    rnd = random.Random(2007)
    write_target(dev, random_bytes(SIZE, 2007))
    sd = os.path.join(workdir, "state")
    os.mkdir(sd)
    # Without a state dir a block device has nowhere to keep its state.
    failed(rawdisk("checkpoint", "create", "--name", "c0", dev), 1, "--state-dir")
    checkpoint(dev, "c0", sd)
    backup = os.path.join(workdir, "backup.img")
    ok(rawdisk("copy", "--state-dir", sd, dev, backup))
    dst = serve(backup)
    # Written through NBD, the backup's record is named.
    rec = ["--backup-record", backup + ".rawdisk-backup"]
    for n in (1, 2):
        srv = serve(dev, extra=["--track-changes", "--state-dir", sd])
        touched = mutate(srv.uri, rnd)
        checkpoint(dev, f"c{n}", sd)
        incremental(srv.uri, backup, f"c{n - 1}", read_target(dev), touched, rnd,
                    extra=rec, dst_spec=dst.uri)
        assert srv.terminate() == 0, srv.stderr()
    # And from the stopped device itself.
    srv = serve(dev, extra=["--track-changes", "--state-dir", sd])
    touched = mutate(srv.uri, rnd)
    assert srv.terminate() == 0, srv.stderr()
    incremental(dev, backup, "c2", read_target(dev), touched, rnd,
                extra=["--state-dir", sd, *rec], dst_spec=dst.uri)
    dst.assert_alive()


def checkpoint_list(target):
    return ok(rawdisk("checkpoint", "list", target)).stdout.decode()


@pytest.mark.parametrize("when", ["served", "stopped", "untouched"])
def test_another_file_at_the_path_makes_a_full_copy(chain_dir, serve, when):
    """Tracking follows the inode it served, not the path: a file moved over
    the target while it is served (then SIGTERM), or while nobody serves it
    (same size, mtime put back), makes c0 inconsistent and the next
    incremental copy a full one; an untouched target stays consistent and
    copies only what was written."""
    src, backup = full_backup(chain_dir, 2010)
    srv = serve(src, extra=["--track-changes"])
    with connected(srv.uri) as h:
        h.pwrite(b"\x11" * 4096, 5 * MiB)
        h.flush()
    new, _ = make_image(chain_dir, "new.img", SIZE, seed=2011, sparse=True)
    if when == "served":
        os.rename(new, src)
    assert srv.terminate() == 0
    if when == "stopped":
        st = os.stat(src)
        os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.rename(new, src)
        assert os.stat(src).st_mtime_ns == st.st_mtime_ns
    listing = checkpoint_list(src)
    res = ok(rawdisk("copy", "--changed-since", "c0", src, backup))
    if when == "untouched":
        assert "inconsistent" not in listing, listing
        assert "full copy" not in res.stderr.decode(), res.stderr
        assert copied_bytes(res.stdout.decode()) == (GRAN, SIZE)
    else:
        assert "inconsistent" in listing and "another file" in listing, listing
        assert "full copy" in res.stderr.decode(), res.stderr
        assert copied_bytes(res.stdout.decode()) == (SIZE, SIZE)
    assert_same_bytes(read_target(backup), read_target(src), "backup after the copy")
    assert rawdisk("compare", src, backup).returncode == 0
