"""The chain rule of `rawdisk copy --changed-since` (docs/cbt.md).

An incremental copy writes only what changed since a checkpoint, so it is a
right backup only onto a destination that holds the same source at that
checkpoint or a newer one. A copy records what its destination holds (the
backup record, DEST.rawdisk-backup or --backup-record FILE), and
--changed-since refuses, before writing a byte, an empty image, another
disk's backup, a backup older than the checkpoint, a record that is
damaged or says a copy did not finish; --trust-destination overrides.
Checkpoint identities (source id and sequence number, never reused) come
from the state file for a local source and from the list-only
`rawdisk:checkpoint:` metadata contexts of `serve --track-changes`.
--verify after an incremental compares the whole destination.
"""

import json
import os
import re
import signal
import subprocess
import time

import nbd
import pytest

import servers
from helpers import KiB, MiB, assert_same_bytes, connected, failed, make_image, \
    random_bytes, read_target

pytestmark = pytest.mark.rawdisk_only("changed-block tracking is rawdisk's")

SIZE = 8 * MiB
REC = ".rawdisk-backup"


def rawdisk(*args, timeout=120):
    return subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, timeout=timeout)


def ok(res):
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    return res.stdout.decode()



def checkpoint(target, name):
    ok(rawdisk("checkpoint", "create", "--name", name, target))


def ids(target):
    """{name: (source id, seq)} from `checkpoint list --output json`."""
    out = json.loads(ok(rawdisk("checkpoint", "list", "--output", "json", target)))
    return {c["name"]: (c["id"].split(":")[0], int(c["id"].split(":")[1])) for c in out}


def record(path):
    """The backup record as a dict (None when there is none)."""
    if not os.path.exists(path + REC):
        return None
    with open(path + REC) as f:
        return dict(line.split(" = ", 1) for line in f.read().splitlines()
                    if not line.startswith("#"))


class Disk:
    """A tracked image, changed only through a tracking server (so its
    checkpoints stay consistent), read by the copies either as the local
    file (server stopped) or through the export (`kind`)."""

    def __init__(self, workdir, serve, kind, name="disk.img", seed=1):
        self.serve, self.kind = serve, kind
        self.path, _ = make_image(workdir, name, SIZE, seed=seed, sparse=True)
        self.srv = None
        self.seed = seed

    def change(self, offset, length, seed):
        """Writes through a tracking server (started if needed)."""
        if self.srv is None:
            self.srv = self.serve(self.path, extra=["--track-changes"])
        with connected(self.srv.uri, name="change") as h:
            h.pwrite(random_bytes(length, seed), offset)
            h.flush()

    def spec(self):
        """What a copy reads: the export, or the file with no server."""
        if self.kind == "nbd":
            if self.srv is None:
                self.srv = self.serve(self.path, extra=["--track-changes"])
            return self.srv.uri
        if self.srv is not None:
            assert self.srv.terminate() == 0, self.srv.stderr()
            self.srv = None
        return self.path


@pytest.fixture(params=["local", "nbd"])
def kind(request):
    return request.param


def backed_up_at_c0(workdir, serve, kind):
    """A disk with checkpoint c0 and a full backup of it, then changes and
    checkpoint c1. Returns (disk, backup path)."""
    d = Disk(workdir, serve, kind)
    checkpoint(d.path, "c0")
    backup = os.path.join(workdir, "backup.img")
    out = ok(rawdisk("copy", d.spec(), backup))
    assert f"recorded in {backup}{REC}: checkpoint c0" in out, out
    d.change(3 * MiB + 512, 200 * KiB, 11)
    checkpoint(d.path, "c1")
    return d, backup


def new_image(path, seed):
    """A file of SIZE random bytes (no record)."""
    with open(path, "wb") as f:
        f.write(random_bytes(SIZE, seed))
    return path


def refused_untouched(args, dest, *words):
    """copy refuses with exit 1 naming `words`; `dest` and its record are
    byte for byte as before."""
    before = read_target(dest)
    rec = record(dest)
    err = failed(rawdisk("copy", *args), 1, *words)
    assert read_target(dest) == before, "a refused copy wrote to the destination"
    assert record(dest) == rec
    return err


def test_onto_an_empty_image_is_refused(workdir, serve, kind):
    d, _ = backed_up_at_c0(workdir, serve, kind)
    empty = new_image(os.path.join(workdir, "empty.img"), 5)
    refused_untouched(["--changed-since", "c0", d.spec(), empty], empty,
                      f"{empty} has no backup record ({empty}{REC})", "full copy",
                      "--trust-destination")
    assert record(empty) is None


def test_onto_another_disks_backup_is_refused(workdir, serve, kind):
    d, _ = backed_up_at_c0(workdir, serve, kind)
    other = Disk(workdir, serve, "local", name="other.img", seed=2)
    checkpoint(other.path, "c0")
    theirs = os.path.join(workdir, "other-backup.img")
    ok(rawdisk("copy", other.path, theirs))
    their_id = ids(other.path)["c0"][0]
    ours = ids(d.path)["c0"][0]
    assert their_id != ours
    refused_untouched(["--changed-since", "c0", d.spec(), theirs], theirs,
                      f"another source (id {their_id}), not of this one (id {ours})")


def test_a_backup_at_c0_takes_no_changes_since_c1(workdir, serve, kind):
    d, backup = backed_up_at_c0(workdir, serve, kind)
    sid = ids(d.path)["c0"][0]
    refused_untouched(["--changed-since", "c1", d.spec(), backup], backup,
                      f"{backup} holds source {sid} at checkpoint c0 (seq 1); --changed-since "
                      f"c1 (seq 2) would skip c0 to c1's changes; make a full copy, or "
                      f"--changed-since c0")


def test_the_right_chain_restores_byte_identical(workdir, serve, kind):
    d, backup = backed_up_at_c0(workdir, serve, kind)
    out = ok(rawdisk("copy", "--verify", "--changed-since", "c0", d.spec(), backup))
    assert f"recorded in {backup}{REC}: checkpoint c1" in out, out
    # The whole disk compared, the holes of both sides skipped: 8 islands of
    # 64 KiB, and the change, are data on both sides.
    m = re.search(r"verified: whole destination equals source \(([\d.]+ \w+) compared, "
                  r"([\d.]+ \w+) skipped as holes on both sides\)", out)
    assert m, out
    d.change(6 * MiB, 70 * KiB, 12)
    d.change(128 * KiB, 4 * KiB, 13)
    checkpoint(d.path, "c2")
    ok(rawdisk("copy", "--changed-since", "c1", d.spec(), backup))
    rec = record(backup)
    sid, seq = ids(d.path)["c2"]
    assert (rec["state"], rec["source-id"], rec["checkpoint"], rec["checkpoint-id"],
            rec["source-size"], rec["destination-size"]) == \
        ("complete", sid, "c2", f"{sid}:{seq}", str(SIZE), str(SIZE)), rec
    d.spec()  # the server (if any) stopped or idle: the file is the source
    assert_same_bytes(read_target(backup), read_target(d.path), "backup after c0, c1, c2")
    assert rawdisk("compare", d.path, backup).returncode == 0
    # A backup at c2 also takes the changes since c1 (more than needed).
    ok(rawdisk("copy", "--changed-since", "c1", d.spec(), backup))


def test_a_name_reused_after_delete_is_another_checkpoint(workdir, serve, kind):
    d, backup = backed_up_at_c0(workdir, serve, kind)
    old = ids(d.path)["c0"]
    ok(rawdisk("checkpoint", "delete", "--name", "c0", d.path))
    d.change(5 * MiB, 8 * KiB, 14)
    checkpoint(d.path, "c0")
    new = ids(d.path)["c0"]
    assert new[0] == old[0] and new[1] == 3, (old, new)
    human = ok(rawdisk("checkpoint", "list", d.path))
    assert f"id={new[0]}:3" in human and f"id={new[0]}:2" in human, human
    refused_untouched(["--changed-since", "c0", d.spec(), backup], backup,
                      "at checkpoint c0 (seq 1); --changed-since c0 (seq 3) would skip")


def test_trust_destination_proceeds_and_verify_tells_the_truth(workdir, serve, kind):
    """The issue's case, overridden: a backup at c0 given the changes since
    c1 misses those from c0 to c1. --trust-destination writes anyway;
    --verify compares the whole destination and finds it wrong."""
    d, backup = backed_up_at_c0(workdir, serve, kind)
    ok(rawdisk("copy", "--changed-since", "c1", "--trust-destination", d.spec(), backup))
    assert record(backup)["checkpoint"] == "c1"
    d.spec()
    assert rawdisk("compare", d.path, backup).returncode == 1
    # The first byte c0..c1 changed (at 3 MiB + 512) is the first wrong one.
    res = rawdisk("copy", "--changed-since", "c1", "--trust-destination", "--verify",
                  d.spec(), backup)
    failed(res, 1, "verify:", f"differ at offset {3 * MiB + 512}")
    assert record(backup)["state"] == "incomplete"
    failed(rawdisk("copy", "--changed-since", "c1", d.spec(), backup), 1, "did not finish")
    # The right base verifies, and says what it compared.
    ok(rawdisk("copy", d.spec(), backup))
    out = ok(rawdisk("copy", "--changed-since", "c1", "--verify", d.spec(), backup))
    assert "verified: whole destination equals source (" in out, out


def test_a_damaged_record_is_refused(workdir, serve, kind):
    d, backup = backed_up_at_c0(workdir, serve, kind)
    ok(rawdisk("copy", "--changed-since", "c0", d.spec(), backup))
    with open(backup + REC, "r+b") as f:
        data = bytearray(f.read())
        # A digit of the checkpoint's sequence number: still well formed.
        at = data.index(b"checkpoint-id = ") + len("checkpoint-id = ") + 33
        data[at] ^= 0x01
        f.seek(0)
        f.write(data)
    refused_untouched(["--changed-since", "c1", d.spec(), backup], backup,
                      "is damaged (its sha256 does not match its contents)")


def test_an_interrupted_copy_leaves_no_valid_record(workdir, serve, kind):
    d, backup = backed_up_at_c0(workdir, serve, kind)
    d.change(MiB, 4 * MiB, 15)
    checkpoint(d.path, "c2")
    # 4 MiB at 512 KiB/s: killed well before it ends.
    p = subprocess.Popen([servers.RAWDISK_BIN, "copy", "--rate-limit", "512K",
                          "--changed-since", "c0", d.spec(), backup],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while (record(backup) or {}).get("state") != "incomplete":
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()
            time.sleep(0.02)
        time.sleep(0.3)
        p.send_signal(signal.SIGKILL)
        assert p.wait(timeout=10) == -signal.SIGKILL
    finally:
        p.kill()
        p.communicate()
    assert record(backup)["state"] == "incomplete"
    for since in ("c0", "c1", "c2"):
        refused_untouched(["--changed-since", since, d.spec(), backup], backup,
                          "a copy onto it did not finish")
    # A full copy mends it.
    ok(rawdisk("copy", d.spec(), backup))
    assert record(backup)["state"] == "complete"
    ok(rawdisk("copy", "--changed-since", "c2", d.spec(), backup))


def test_a_copy_without_flush_records_nothing_durable(workdir, serve):
    d, backup = backed_up_at_c0(workdir, serve, "local")
    res = rawdisk("copy", "--no-flush", "--changed-since", "c0", d.spec(), backup)
    assert res.returncode == 0 and "no backup record written" in res.stderr.decode(), res
    assert record(backup)["state"] == "incomplete"


def test_an_untracked_full_copy_removes_the_record(workdir, serve):
    d, backup = backed_up_at_c0(workdir, serve, "local")
    plain, _ = make_image(workdir, "plain.img", SIZE, seed=3, sparse=True)
    ok(rawdisk("copy", plain, backup))
    assert record(backup) is None
    refused_untouched(["--changed-since", "c0", d.spec(), backup], backup, "no backup record")


def test_block_and_nbd_destinations_take_a_record_file(workdir, serve, kind):
    d, backup = backed_up_at_c0(workdir, serve, kind)
    dst = serve(backup)
    failed(rawdisk("copy", "--changed-since", "c0", d.spec(), dst.uri), 2, "--backup-record")
    failed(rawdisk("copy", "--backup-record", backup + REC, d.spec(), "null:"), 2,
           "--backup-record")
    elsewhere = os.path.join(workdir, "elsewhere.rec")
    refused_untouched(["--changed-since", "c0", "--backup-record", elsewhere, d.spec(),
                       dst.uri], backup, "no backup record", elsewhere)
    ok(rawdisk("copy", "--changed-since", "c0", "--backup-record", backup + REC, d.spec(),
               dst.uri))
    assert record(backup)["checkpoint"] == "c1"
    dst.terminate()
    d.spec()
    assert_same_bytes(read_target(backup), read_target(d.path), "backup through NBD")


def test_the_export_lists_checkpoint_identities(workdir, serve):
    d = Disk(workdir, serve, "nbd")
    checkpoint(d.path, "c0")
    checkpoint(d.path, "c1")
    want = sorted(f"rawdisk:checkpoint:{n}:{sid}:{seq}" for n, (sid, seq) in ids(d.path).items())
    h = nbd.NBD()
    h.set_opt_mode(True)
    h.connect_uri(d.spec())
    try:
        for query, expect in (("rawdisk:checkpoint:", want), ("rawdisk:checkpoint:c1", want[1:]),
                              ("rawdisk:", [])):
            h.clear_meta_contexts()
            h.add_meta_context(query)
            got = []
            h.opt_list_meta_context(lambda name: got.append(name) or 0)
            got = [g for g in got if g.startswith("rawdisk:checkpoint:")]
            assert sorted(got) == expect, (query, got)
    finally:
        h.opt_abort()
