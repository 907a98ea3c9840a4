"""Changed-block tracking on the server (`rawdisk serve --track-changes`,
docs/cbt.md): the `rawdisk:changed:NAME` metadata contexts read with
python3-libnbd and nbdinfo agree with a model of what the clients changed,
at the bitmap's granularity; checkpoints made while served nest; a kill -9
or a change made while nobody served the target makes every checkpoint
"all changed" with a loud warning, a clean stop keeps them; a second
tracking server is refused; `--dir` tracks each export in its own state
file; context listing and hostile queries over a raw socket.

Every test that writes also checks every byte of the export and the file."""

import contextlib
import errno
import json
import os
import random
import signal
import socket
import struct
import subprocess
import threading
import time

import nbd
import pytest

import servers
import storage
import wire
from helpers import (KiB, MiB, assert_export_is, assert_target_is, connected, make_image,
                     random_bytes, read_target)

pytestmark = pytest.mark.rawdisk_only("changed-block tracking is rawdisk's")

SIZE = 16 * MiB
GRAIN = 64 * KiB
STATE = ".rawdisk-cbt"
CHANGED = "rawdisk:changed:"
DIRTY = "qemu:dirty-bitmap:"
DEPTH = "qemu:allocation-depth"

OPT_STRUCTURED_REPLY = 8
REP_META_CONTEXT = 4
REP_ERR_INVALID = wire.REP_ERR | 3
CMD_BLOCK_STATUS = 7
STRUCTURED_REPLY_MAGIC = 0x668E33EF
REPLY_TYPE_BLOCK_STATUS = 5
REPLY_TYPE_ERROR = (1 << 15) | 1
REPLY_FLAG_DONE = 1


def rawdisk(*args, check=True):
    r = subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True, timeout=60)
    if check:
        assert r.returncode == 0, f"rawdisk {' '.join(args)}: {r.returncode} {r.stderr}"
    return r


def checkpoint(path, name, *extra):
    rawdisk("checkpoint", "create", "--name", name, *extra, path)


def checkpoints(path, *extra):
    """{name: consistent} from `rawdisk checkpoint list --output=json`."""
    out = json.loads(rawdisk("checkpoint", "list", "--output=json", *extra, path).stdout)
    items = out["checkpoints"] if isinstance(out, dict) else out
    return {c["name"]: c["consistent"] for c in items}


def stop_and_check(srv, path, model):
    """The export and, after a clean stop, the file hold exactly `model`."""
    assert_export_is(srv.uri, model)
    assert srv.terminate() == 0
    assert_target_is(path, model)


def track(serve, path, *extra):
    return serve(path, extra=["--track-changes", *extra])


def chunks(off, n, grain=GRAIN):
    """The bitmap chunks a request touches."""
    return set(range(off // grain, (off + n + grain - 1) // grain)) if n else set()


def all_chunks(size=SIZE, grain=GRAIN):
    return set(range((size + grain - 1) // grain))


def changed_extents(h, name, flags=0, size=SIZE, step=SIZE):
    """(offset, length, status) of `rawdisk:changed:NAME` over the export,
    asking for at most `step` bytes again from where each reply ends."""
    ctx = CHANGED + name
    out = []
    pos = 0
    while pos < size:
        got = []

        def cb(context, off, entries, err):
            if context == ctx:
                got.append((off, list(entries)))
            return 0

        h.block_status(min(size - pos, step), pos, cb, flags)
        assert len(got) == 1, got
        off, entries = got[0]
        assert off == pos and entries, got
        if flags & nbd.CMD_FLAG_REQ_ONE:
            assert len(entries) == 2, entries
        for i in range(0, len(entries), 2):
            n, status = entries[i], entries[i + 1]
            assert n > 0 and status in (0, 1), entries
            out.append((pos, n, status))
            pos += n
    assert pos == size, out
    return out


def changed_set(extents, grain=GRAIN, size=SIZE):
    """The chunks reported changed; every boundary must be chunk aligned."""
    out = set()
    for off, n, status in extents:
        assert off % grain == 0 and ((off + n) % grain == 0 or off + n == size), extents
        if status:
            out |= chunks(off, n, grain)
    return out


def changed(uri, name, grain=GRAIN, size=SIZE, step=SIZE):
    h = nbd.NBD()
    h.add_meta_context(CHANGED + name)
    h.connect_uri(uri)
    try:
        assert h.can_meta_context(CHANGED + name), f"{CHANGED}{name} not offered"
        full = changed_set(changed_extents(h, name, size=size, step=step), grain, size)
        one = changed_set(changed_extents(h, name, nbd.CMD_FLAG_REQ_ONE, size, step), grain,
                          size)
        assert one == full, "REQ_ONE answers differ from full answers"
        return full
    finally:
        h.shutdown()


def nbdinfo_changed(uri, name, grain=GRAIN, size=SIZE):
    out = subprocess.run(["nbdinfo", "--json", f"--map={CHANGED}{name}", uri],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    ext = [(e["offset"], e["length"], e["type"]) for e in json.loads(out)]
    return changed_set(ext, grain, size)


def random_changes(uri, model, seed, conns=4, ops=40, grain=GRAIN,
                   kinds=("write", "write", "zero", "trim")):
    """Writes, zeroes and trims from `conns` connections at once, each in its
    own part of the export (so the byte model is exact); every connection
    flushes at the end. Returns the chunks touched."""
    touched = set()
    lock = threading.Lock()
    errors = []
    part = len(model) // conns

    def worker(i):
        rng = random.Random(seed * 100 + i)
        try:
            with connected(uri, name=f"w{i}") as h:
                for _ in range(ops):
                    n = rng.choice([1, 511, 4 * KiB, grain - 1, grain + 3, 3 * grain, 300 * KiB])
                    off = part * i + rng.randrange(0, part - n)
                    kind = rng.choice(kinds)
                    if kind == "write":
                        data = random_bytes(n, rng.randrange(1 << 30))
                        h.pwrite(data, off)
                    elif kind == "zero":
                        h.zero(n, off)
                        data = bytes(n)
                    else:
                        h.trim(n, off)
                        # Trim punches on this file system: it reads as zeros.
                        data = bytes(n)
                    with lock:
                        model[off:off + n] = data
                        touched.update(chunks(off, n, grain))
                h.flush()
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return touched


def assert_all_changed(uri, names, size=SIZE):
    for name in names:
        assert changed(uri, name, size=size) == all_chunks(size), f"{name}: not all changed"


# -- the contexts follow the clients' changes ---------------------------------------

def test_changes_through_several_connections_match_the_model(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=1)
    checkpoint(path, "a")
    srv = track(serve, path)
    first = random_changes(srv.uri, model, seed=1)
    assert first, "the test changed nothing"
    assert changed(srv.uri, "a") == first
    assert nbdinfo_changed(srv.uri, "a") == first

    # A checkpoint made while served starts a new generation: "a" keeps
    # everything, "b" only what came after it.
    checkpoint(path, "b")
    assert changed(srv.uri, "b") == set()
    second = random_changes(srv.uri, model, seed=2)
    assert changed(srv.uri, "a") == first | second
    assert changed(srv.uri, "b") == second
    assert nbdinfo_changed(srv.uri, "b") == second
    assert second - first, "the second round must change chunks the first did not"

    # Deleting the newer one folds it into the older: nothing is lost.
    rawdisk("checkpoint", "delete", "--name", "b", path)
    assert changed(srv.uri, "a") == first | second
    stop_and_check(srv, path, model)
    assert checkpoints(path) == {"a": True}


def test_granularity_and_read_only(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=3)
    srv = track(serve, path, "--bitmap-granularity", "4K")
    checkpoint(path, "c")
    touched = random_changes(srv.uri, model, seed=3, conns=2, ops=20, grain=4 * KiB)
    assert changed(srv.uri, "c", grain=4 * KiB) == touched
    assert srv.terminate() == 0
    assert_target_is(path, model)

    # A different granularity for an existing state file is an error that
    # names both; read-only serving with tracking changes nothing.
    bad = servers.Server(workdir, path, extra=["--track-changes", "--bitmap-granularity", "64K"])
    with pytest.raises(servers.ServerFailedToStart) as e:
        bad.start()
    assert "granularity" in str(e.value)
    srv = track(serve, path, "--read-only")
    assert changed(srv.uri, "c", grain=4 * KiB) == touched
    assert srv.terminate() == 0
    assert checkpoints(path) == {"c": True}


def test_fua_writes_and_flags(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=4)
    checkpoint(path, "a")
    srv = track(serve, path)
    with connected(srv.uri) as h:
        data = random_bytes(100 * KiB, seed=4)
        h.pwrite(data, 3 * MiB + 5, nbd.CMD_FLAG_FUA)
        model[3 * MiB + 5:3 * MiB + 5 + len(data)] = data
        h.zero(GRAIN, 8 * MiB, nbd.CMD_FLAG_FUA)
        model[8 * MiB:8 * MiB + GRAIN] = bytes(GRAIN)
        h.trim(1, SIZE - 1, nbd.CMD_FLAG_FUA)
        model[SIZE - 1] = 0
    want = chunks(3 * MiB + 5, 100 * KiB) | chunks(8 * MiB, GRAIN) | chunks(SIZE - 1, 1)
    assert changed(srv.uri, "a") == want
    stop_and_check(srv, path, model)


def persisted_chunks(path, name):
    """The chunks set in checkpoint `name`'s bitmap as the state file holds
    it (the layout of docs/cbt.md: header page, then one slot per bitmap)."""
    with open(path + STATE, "rb") as f:
        state = f.read()
    slot_bytes, = struct.unpack_from("<Q", state, 32)
    count, = struct.unpack_from("<I", state, 52)
    for i in range(count):
        entry = state[128 + 96 * i:128 + 96 * (i + 1)]
        if entry[:64].rstrip(b"\0").decode() == name:
            slot, = struct.unpack_from("<I", entry, 76)
            bits = state[4096 + slot * slot_bytes:4096 + (slot + 1) * slot_bytes]
            return {i * 8 + b for i, byte in enumerate(bits) for b in range(8) if byte >> b & 1}
    raise AssertionError(f"no checkpoint {name} in the state file")


def test_fua_and_flush_persist_before_the_reply(workdir, serve):
    """The issue's promise, read from the state file while the server runs:
    a range is in the persisted bitmap once a FLUSH or FUA write covering it
    is acknowledged, and not before (the marks wait in memory)."""
    path, model = make_image(workdir, "disk.img", SIZE, seed=14)
    checkpoint(path, "a")
    srv = track(serve, path)
    with connected(srv.uri) as h:
        h.pwrite(b"1" * 100, MiB)
        model[MiB:MiB + 100] = b"1" * 100
        assert persisted_chunks(path, "a") == set()
        h.pwrite(b"2" * 100, 5 * MiB, nbd.CMD_FLAG_FUA)
        model[5 * MiB:5 * MiB + 100] = b"2" * 100
        assert persisted_chunks(path, "a") == chunks(MiB, 100) | chunks(5 * MiB, 100)
        h.zero(3 * GRAIN, 9 * MiB)
        h.trim(GRAIN, 12 * MiB)
        model[9 * MiB:9 * MiB + 3 * GRAIN] = bytes(3 * GRAIN)
        model[12 * MiB:12 * MiB + GRAIN] = bytes(GRAIN)
        h.flush()
        want = (chunks(MiB, 100) | chunks(5 * MiB, 100) | chunks(9 * MiB, 3 * GRAIN)
                | chunks(12 * MiB, GRAIN))
        assert persisted_chunks(path, "a") == want
        h.zero(GRAIN, 14 * MiB, nbd.CMD_FLAG_FUA)
        model[14 * MiB:14 * MiB + GRAIN] = bytes(GRAIN)
        assert persisted_chunks(path, "a") == want | chunks(14 * MiB, GRAIN)
    stop_and_check(srv, path, model)


# -- restarts, crashes, outside changes ------------------------------------------------

def test_clean_stop_keeps_the_sets(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=5)
    checkpoint(path, "a")
    srv = track(serve, path)
    first = random_changes(srv.uri, model, seed=5, conns=2)
    checkpoint(path, "b")
    second = random_changes(srv.uri, model, seed=6, conns=2)
    assert srv.terminate() == 0
    assert checkpoints(path) == {"a": True, "b": True}
    srv = track(serve, path)
    assert changed(srv.uri, "a") == first | second
    assert changed(srv.uri, "b") == second
    assert "inconsistent" not in srv.stderr()
    stop_and_check(srv, path, model)


def test_run_exit_closes_cleanly(workdir, serve):
    """--run: the command's end stops the server the clean way, like SIGTERM."""
    path, model = make_image(workdir, "disk.img", SIZE, seed=15)
    checkpoint(path, "a")
    script = 'h.pwrite(b"r" * 10, 5 * 65536 + 3); h.flush()'
    r = rawdisk("serve", "--track-changes", "-U", os.path.join(workdir, "run.sock"),
                "--run", f"nbdsh -u \"$uri\" -c '{script}'", path)
    model[5 * GRAIN + 3:5 * GRAIN + 13] = b"r" * 10
    assert "inconsistent" not in r.stderr
    assert checkpoints(path) == {"a": True}
    srv = track(serve, path)
    assert "inconsistent" not in srv.stderr()
    assert changed(srv.uri, "a") == {5}
    stop_and_check(srv, path, model)


@pytest.mark.parametrize("when", ["before-flush", "after-flush"])
def test_kill_9_makes_every_checkpoint_all_changed(workdir, serve, when):
    path, model = make_image(workdir, "disk.img", SIZE, seed=7)
    checkpoint(path, "a")
    checkpoint(path, "b")
    srv = track(serve, path)
    with connected(srv.uri) as h:
        data = random_bytes(4 * KiB, seed=7)
        h.pwrite(data, MiB)
        model[MiB:MiB + len(data)] = data
        if when == "after-flush":
            h.flush()
        srv.proc.send_signal(signal.SIGKILL)
        srv.wait_exit()
    srv = track(serve, path)
    assert "inconsistent" in srv.stderr().lower(), srv.stderr()
    assert "WARN" in srv.stderr()
    assert_all_changed(srv.uri, ["a", "b"])
    # A checkpoint taken after the crash is consistent again.
    checkpoint(path, "c")
    with connected(srv.uri) as h:
        h.pwrite(b"x" * 10, 2 * MiB)
        model[2 * MiB:2 * MiB + 10] = b"x" * 10
        h.flush()
    assert changed(srv.uri, "c") == chunks(2 * MiB, 10)
    if when == "after-flush":
        assert_export_is(srv.uri, model)
    assert srv.terminate() == 0
    assert checkpoints(path) == {"a": False, "b": False, "c": True}


@pytest.mark.parametrize("how", ["dd", "truncate"])
def test_outside_change_while_stopped(workdir, serve, how):
    path, model = make_image(workdir, "disk.img", SIZE, seed=8)
    checkpoint(path, "a")
    srv = track(serve, path)
    assert srv.terminate() == 0
    size = SIZE
    if how == "dd":
        subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=4096", "count=1",
                        "seek=100", "conv=notrunc,fsync", "status=none"], check=True)
    else:
        size = SIZE + MiB
        os.truncate(path, size)
    srv = track(serve, path)
    assert "inconsistent" in srv.stderr().lower(), srv.stderr()
    assert_all_changed(srv.uri, ["a"], size=size)
    assert srv.terminate() == 0
    assert checkpoints(path) == {"a": False}


def fill(directory):
    """Fill the file system of `directory` to the last block; returns the filler."""
    filler = os.path.join(directory, "filler")
    block = b"\xee" * (4 * KiB)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return filler


def test_a_full_state_file_system_answers_enospc(workdir, serve):
    """A FLUSH (or FUA write) whose persist cannot write the state file
    because its file system is full fails with ENOSPC, not EIO; once there
    is room again the next FLUSH persists the change."""
    if not storage.is_root():
        pytest.skip("needs root")
    path, model = make_image(workdir, "disk.img", SIZE, seed=40)
    with storage.tmpfs(1) as sd:
        checkpoint(path, "a", "--state-dir", sd)
        srv = track(serve, path, "--state-dir", sd)
        filler = fill(sd)
        with connected(srv.uri) as h:
            h.pwrite(b"\x21" * 4096, 3 * MiB)
            model[3 * MiB:3 * MiB + 4096] = b"\x21" * 4096
            with pytest.raises(nbd.Error) as e:
                h.flush()
            assert e.value.errno == "ENOSPC", e.value
            with pytest.raises(nbd.Error) as e:
                h.pwrite(b"\x22" * 4096, 9 * MiB, nbd.CMD_FLAG_FUA)
            model[9 * MiB:9 * MiB + 4096] = b"\x22" * 4096
            assert e.value.errno == "ENOSPC", e.value
            os.unlink(filler)
            h.flush()
        assert "NBD_ENOSPC" in srv.stderr(), srv.stderr()
        assert changed(srv.uri, "a") == chunks(3 * MiB, 4096) | chunks(9 * MiB, 4096)
        stop_and_check(srv, path, model)
        assert checkpoints(path, "--state-dir", sd) == {"a": True}


def test_a_second_tracking_server_is_refused(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=9)
    srv = track(serve, path)
    second = servers.Server(workdir, path, extra=["--track-changes"])
    with pytest.raises(servers.ServerFailedToStart):
        second.start()
    assert second.proc.returncode == 1
    # One error line: what, which state file, why.
    errors = [line for line in second.stderr().splitlines() if line.startswith("rawdisk:")]
    assert len(errors) == 1, second.stderr()
    assert path + STATE in errors[0] and "already tracks" in errors[0], errors
    srv.assert_alive()
    assert srv.terminate() == 0


def test_usage_errors(workdir):
    path, _ = make_image(workdir, "disk.img", MiB, seed=10)
    for args in (["--bitmap-granularity", "64K"], ["--state-dir", workdir],
                 ["--track-changes", "--bitmap-granularity", "3K"],
                 ["--track-changes", "--bitmap-granularity", "128M"]):
        r = rawdisk("serve", "-U", os.path.join(workdir, "x.sock"), *args, path, check=False)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert r.stderr.strip(), args
    assert not os.path.exists(path + STATE)


def test_dir_tracks_each_export_in_its_own_state(workdir, serve):
    d = os.path.join(workdir, "images")
    os.mkdir(d)
    states = os.path.join(workdir, "states")
    os.mkdir(states)
    models = {}
    for i, name in enumerate(["a.img", "b.img"]):
        models[name] = make_image(d, name, SIZE, seed=20 + i)[1]
    srv = serve(d, extra=["--track-changes", "--state-dir", states, "--dir"])
    uri = lambda n: f"nbd+unix:///{n}?socket={srv.sock}"  # noqa: E731
    for name in models:
        # Opened on first use.
        with connected(uri(name)):
            pass
        assert os.path.exists(os.path.join(states, name + STATE))
        checkpoint(os.path.join(d, name), "base", "--state-dir", states)
    touched = {name: random_changes(uri(name), models[name], seed=30 + i, conns=2, ops=15)
               for i, name in enumerate(models)}
    for name in models:
        assert changed(uri(name), "base") == touched[name]
        assert_export_is(uri(name), models[name])
    # State files in the directory are no exports, even when they exist.
    open(os.path.join(d, "c.img" + STATE), "wb").close()
    out = subprocess.run(["nbdinfo", "--list", "--json", uri("")], check=True,
                         capture_output=True, text=True).stdout
    assert sorted(e["export-name"] for e in json.loads(out)["exports"]) == ["a.img", "b.img"]
    assert srv.terminate() == 0
    for name in models:
        assert_target_is(os.path.join(d, name), models[name])
        assert checkpoints(os.path.join(d, name), "--state-dir", states) == {"base": True}


def test_dir_tracks_one_file_under_one_name(workdir, serve):
    """A symlink or a hard link in the directory is another name for the
    same file. Tracked under each name apart, a write through one would be
    missing from the other's checkpoints, and each clean stop would record
    the file as checked: a silently wrong backup. While one name tracks the
    file, the others are refused; what was written through any name is in
    the checkpoint."""
    d = os.path.join(workdir, "images")
    os.mkdir(d)
    path, model = make_image(d, "disk.img", SIZE, seed=40)
    os.symlink("disk.img", os.path.join(d, "cur.img"))
    os.link(path, os.path.join(d, "hard.img"))
    checkpoint(path, "c1")
    srv = serve(d, extra=["--track-changes", "--dir"])
    uri = lambda n: f"nbd+unix:///{n}?socket={srv.sock}"  # noqa: E731
    # disk.img's tracker opens first.
    assert changed(uri("disk.img"), "c1") == set()
    touched = set()
    for i, other in enumerate(["cur.img", "hard.img"]):
        off, data = (3 + 4 * i) * MiB + 123, random_bytes(5000, 41 + i)
        h = nbd.NBD()
        try:
            h.connect_uri(uri(other))
        except nbd.Error:
            continue
        h.pwrite(data, off)
        h.flush()
        h.shutdown()
        model[off:off + len(data)] = data
        touched |= chunks(off, len(data))
    assert changed(uri("disk.img"), "c1") == touched
    assert touched == set(), "a second name of a tracked file was served"
    assert "tracked under that name" in srv.stderr(), srv.stderr()[-3000:]
    assert_export_is(uri("disk.img"), model)
    assert srv.terminate() == 0
    assert_target_is(path, model)
    assert checkpoints(path) == {"c1": True}


def test_dir_a_renamed_file_is_served_under_its_new_name(workdir, serve):
    """The one-name rule keeps a name's tracker only while that name still
    names the file or an export holds the tracker: a file renamed after its
    last client left is served, tracked, under its new name, and every
    write through it is in the new name's state."""
    d = os.path.join(workdir, "images")
    os.mkdir(d)
    states = os.path.join(workdir, "states")
    os.mkdir(states)
    path, model = make_image(d, "a.img", SIZE, seed=44)
    srv = serve(d, extra=["--track-changes", "--state-dir", states, "--dir"])
    uri = lambda n: f"nbd+unix:///{n}?socket={srv.sock}"  # noqa: E731
    with connected(uri("a.img")):
        pass
    new = os.path.join(d, "c.img")
    os.rename(path, new)
    with connected(uri("c.img")):
        pass
    checkpoint(new, "base", "--state-dir", states)
    touched = random_changes(uri("c.img"), model, seed=45, conns=1, ops=10)
    assert touched
    assert changed(uri("c.img"), "base") == touched
    assert "tracked under that name" not in srv.stderr(), srv.stderr()[-3000:]
    assert srv.terminate() == 0
    assert_target_is(new, model)
    assert checkpoints(new, "--state-dir", states) == {"base": True}


def test_block_device_needs_a_state_dir(workdir, serve, loop512):
    dev = loop512
    size = 32 * MiB
    r = rawdisk("serve", "--track-changes", "-U", os.path.join(workdir, "x.sock"), dev,
                check=False)
    assert r.returncode == 1 and "--state-dir" in r.stderr, r.stderr
    states = os.path.join(workdir, "states")
    os.mkdir(states)
    checkpoint(dev, "a", "--state-dir", states)
    model = bytearray(read_target(dev))
    srv = track(serve, dev, "--state-dir", states)
    # A discard's contents are not defined on this device: writes and zeroes.
    touched = random_changes(srv.uri, model, seed=16, conns=2, ops=15, kinds=("write", "zero"))
    assert changed(srv.uri, "a", size=size) == touched
    assert_export_is(srv.uri, model)
    assert srv.terminate() == 0
    assert_target_is(dev, model)
    assert checkpoints(dev, "--state-dir", states) == {"a": True}
    assert os.path.exists(os.path.join(states, os.path.basename(dev) + STATE))


# -- context listing -----------------------------------------------------------------

def listed_contexts(uri, queries):
    h = nbd.NBD()
    h.set_opt_mode(True)
    h.connect_uri(uri)
    try:
        for q in queries:
            h.add_meta_context(q)
        got = []
        h.opt_list_meta_context(lambda name: got.append(name) or 0)
        return got
    finally:
        h.opt_abort()


def test_list_meta_context_answers_exactly(workdir, serve):
    path, _ = make_image(workdir, "disk.img", SIZE, seed=11)
    checkpoint(path, "a")
    checkpoint(path, "b")
    srv = track(serve, path)
    both = [CHANGED + "a", CHANGED + "b"]
    qemu = [DIRTY + "a", DIRTY + "b"]
    assert listed_contexts(srv.uri, []) == ["base:allocation", DEPTH] + both + qemu
    assert listed_contexts(srv.uri, ["rawdisk:"]) == both
    assert listed_contexts(srv.uri, ["rawdisk:changed:"]) == both
    assert listed_contexts(srv.uri, [CHANGED + "b"]) == [CHANGED + "b"]
    assert listed_contexts(srv.uri, [CHANGED + "zz", DIRTY + "zz", "x-y:"]) == []
    assert listed_contexts(srv.uri, ["base:", CHANGED + "a"]) == ["base:allocation", CHANGED + "a"]
    # A checkpoint made while served is listed at the next query.
    checkpoint(path, "c")
    assert listed_contexts(srv.uri, ["rawdisk:"]) == both + [CHANGED + "c"]
    # nbdinfo lists what an empty LIST_META_CONTEXT gets.
    out = subprocess.run(["nbdinfo", srv.uri], check=True, capture_output=True,
                         text=True).stdout.splitlines()
    shown = []
    for line in out[out.index("\tcontexts:") + 1:]:
        if not line.startswith("\t\t"):
            break
        shown.append(line.strip())
    assert shown == ["base:allocation", DEPTH] + both + [CHANGED + "c"] + qemu + [DIRTY + "c"], out
    assert srv.terminate() == 0


def test_without_tracking_nothing_is_listed(workdir, serve):
    path, _ = make_image(workdir, "disk.img", SIZE, seed=12)
    checkpoint(path, "a")
    srv = serve(path)
    assert listed_contexts(srv.uri, ["rawdisk:"]) == []
    assert listed_contexts(srv.uri, ["qemu:dirty-bitmap:"]) == []
    assert listed_contexts(srv.uri, []) == ["base:allocation", DEPTH]
    assert srv.terminate() == 0


# -- raw socket ---------------------------------------------------------------------

def raw(srv):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(srv.sock)
    c = wire.RawClient(s).start()
    c.send_option(OPT_STRUCTURED_REPLY)
    assert c.read_option_reply() == (OPT_STRUCTURED_REPLY, wire.REP_ACK, b"")
    return c


def meta_option(c, option, queries, name=b""):
    """(contexts as [(id, name)], final reply type)."""
    data = struct.pack(">I", len(name)) + name + struct.pack(">I", len(queries))
    data += b"".join(struct.pack(">I", len(q)) + q for q in queries)
    c.send_option(option, data)
    found = []
    while True:
        opt, rtype, payload = c.read_option_reply()
        assert opt == option
        if rtype == REP_META_CONTEXT:
            found.append((struct.unpack(">I", payload[:4])[0], payload[4:].decode()))
        else:
            return found, rtype


def read_chunk(c):
    magic, flags, rtype, cookie, n = struct.unpack(">IHHQI", wire.recv_exact(c.sock, 20))
    assert magic == STRUCTURED_REPLY_MAGIC, hex(magic)
    return flags, rtype, cookie, wire.recv_exact(c.sock, n)


def block_status(c, offset, length, flags=0):
    """{context id: [(length, status)]}, or ("error", errno, message)."""
    cookie = c.send_request(CMD_BLOCK_STATUS, offset, length, flags)
    out = {}
    while True:
        rflags, rtype, got, payload = read_chunk(c)
        assert got == cookie
        if rtype == REPLY_TYPE_ERROR:
            err, n = struct.unpack(">IH", payload[:6])
            assert rflags & REPLY_FLAG_DONE
            return ("error", err, payload[6:6 + n].decode())
        assert rtype == REPLY_TYPE_BLOCK_STATUS, rtype
        (ctx,) = struct.unpack(">I", payload[:4])
        assert ctx not in out
        d = payload[4:]
        out[ctx] = [struct.unpack(">II", d[i:i + 8]) for i in range(0, len(d), 8)]
        if rflags & REPLY_FLAG_DONE:
            return out


def test_hostile_queries_and_a_deleted_checkpoint(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=13)
    checkpoint(path, "a")
    checkpoint(path, "b")
    srv = track(serve, path)
    c = raw(srv)
    LIST, SET = wire.OPT_LIST_META_CONTEXT, wire.OPT_SET_META_CONTEXT
    # Too long, not UTF-8: the option is invalid, the connection goes on.
    assert meta_option(c, LIST, [b"rawdisk:changed:" + b"a" * 5000]) == ([], REP_ERR_INVALID)
    assert meta_option(c, LIST, [b"rawdisk:changed:\xff\xfe"]) == ([], REP_ERR_INVALID)
    # Unknown namespaces, no colon, leaf names of no checkpoint: ignored.
    assert meta_option(c, LIST, [b"nope", b"x-q:a", b"rawdisk:other", b"rawdisk:changed:c",
                                 b"rawdisk:changed:a/.."]) == ([], wire.REP_ACK)
    # Thousands of copies of one query list it once.
    found, rtype = meta_option(c, LIST, [b"rawdisk:changed:a"] * 2000)
    assert (found, rtype) == ([(0, CHANGED + "a")], wire.REP_ACK)
    # SET: wildcards select nothing; exact names get distinct ids, 1 for
    # base:allocation.
    assert meta_option(c, SET, [b"rawdisk:", b"rawdisk:changed:"]) == ([], wire.REP_ACK)
    found, rtype = meta_option(c, SET, [b"rawdisk:changed:b", b"base:allocation",
                                        b"rawdisk:changed:a", b"rawdisk:changed:b"])
    assert rtype == wire.REP_ACK
    assert found == [(1, "base:allocation"), (2, CHANGED + "a"), (3, CHANGED + "b")]
    c.go()

    assert c.request(wire.CMD_WRITE, 2 * MiB, 10, payload=b"z" * 10)[0] == 0
    model[2 * MiB:2 * MiB + 10] = b"z" * 10
    got = block_status(c, MiB, 2 * MiB)
    assert set(got) == {1, 2, 3}
    for ctx in (2, 3):
        assert got[ctx] == [(MiB, 0), (GRAIN, 1), (MiB - GRAIN, 0)], got[ctx]
    assert sum(n for n, _ in got[1]) <= 2 * MiB
    one = block_status(c, MiB, 2 * MiB, flags=1 << 3)
    assert one[2] == [(MiB, 0)] and one[3] == [(MiB, 0)] and len(one[1]) == 1

    # A checkpoint deleted after it was selected: EINVAL naming it.
    rawdisk("checkpoint", "delete", "--name", "b", path)
    got = block_status(c, 0, MiB)
    assert got[0] == "error" and got[1] == 22 and '"b"' in got[2], got
    c.disconnect()
    srv.assert_alive()
    stop_and_check(srv, path, model)


# -- scale ----------------------------------------------------------------------------

HUGE = 64 << 40


def data_regions(path):
    """(offset, bytes) of every data region of a sparse file (SEEK_DATA)."""
    out = []
    with open(path, "rb") as f:
        fd, end, at = f.fileno(), os.fstat(f.fileno()).st_size, 0
        while at < end:
            try:
                at = os.lseek(fd, at, os.SEEK_DATA)
            except OSError as e:
                assert e.errno == errno.ENXIO
                break
            hole = os.lseek(fd, at, os.SEEK_HOLE)
            out.append((at, os.pread(fd, hole - at, at)))
            at = hole
    return out


def test_memory_follows_changes_not_size(tmpfs_dir, serve):
    """A 64 TiB sparse file with four checkpoints and a few changes: the
    tracking server's anonymous memory stays small (a plain bitmap is 128
    MiB per checkpoint at this size), before and after the changes are
    persisted and loaded back by a restart, and it starts quickly. The sets
    and the file hold exactly the writes (everything else is a hole)."""
    path = os.path.join(tmpfs_dir, "huge.img")
    with open(path, "wb") as f:
        f.truncate(HUGE)
    try:
        for i in range(4):
            checkpoint(path, f"c{i}")
        offs = [0, 5 * GRAIN + 7, HUGE // 2 - 100, HUGE - 4 * KiB]
        writes = {off: random_bytes(4 * KiB, seed=60 + i) for i, off in enumerate(offs)}
        want = set().union(*(chunks(off, 4 * KiB) for off in offs))
        for restart in (False, True):
            t0 = time.monotonic()
            srv = track(serve, path)
            took = time.monotonic() - t0
            assert took < 5, f"took {took:.2f} s to start"
            if not restart:
                with connected(srv.uri) as h:
                    assert h.get_size() == HUGE
                    for off, data in writes.items():
                        h.pwrite(data, off)
                    h.flush()
            # The newest (marks in memory), then the oldest (loaded slots).
            name = "c0" if restart else "c3"
            assert changed(srv.uri, name, size=HUGE, step=(1 << 32) - GRAIN) == want
            with connected(srv.uri) as h:
                for off, data in writes.items():
                    assert h.pread(len(data), off) == data
            rss = srv.status("RssAnon")
            assert rss <= 32 * MiB, f"RssAnon {rss >> 20} MiB (restart: {restart})"
            assert srv.terminate() == 0
        model = {}
        for off, data in writes.items():
            for p in range(off // (4 * KiB), (off + len(data) - 1) // (4 * KiB) + 1):
                page = bytearray(model.get(p, bytes(4 * KiB)))
                lo, hi = max(off, p * 4 * KiB), min(off + len(data), (p + 1) * 4 * KiB)
                page[lo - p * 4 * KiB:hi - p * 4 * KiB] = data[lo - off:hi - off]
                model[p] = bytes(page)
        got = {}
        for at, data in data_regions(path):
            assert at % (4 * KiB) == 0 and len(data) % (4 * KiB) == 0, (at, len(data))
            for i in range(0, len(data), 4 * KiB):
                got[(at + i) // (4 * KiB)] = data[i:i + 4 * KiB]
        assert got == model
    finally:
        for p in (path, path + STATE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
