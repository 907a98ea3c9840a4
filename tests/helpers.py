"""Shared helpers: test images with a byte-exact Python model, comparing an
export or a file with its model, SEEK_HOLE truth, libnbd connections."""

import contextlib
import errno
import glob
import os
import random
import shutil
import signal
import stat
import subprocess
import time

import nbd

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 4 * MiB


def random_bytes(n, seed):
    return random.Random(seed).randbytes(n)


def is_block_device(path):
    return stat.S_ISBLK(os.stat(path).st_mode)


def target_size(path):
    with open(path, "rb") as f:
        return f.seek(0, os.SEEK_END)


def write_target(path, data, offset=0):
    """Write and fsync, so later reads (ours or the server's) see it."""
    fd = os.open(path, os.O_WRONLY)
    try:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_target(path):
    """The whole file or device as the kernel sees it now."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if is_block_device(path):
            # The server may have written with O_DIRECT; drop clean cached pages.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.lseek(fd, 0, os.SEEK_END)
        out = bytearray(size)
        view = memoryview(out)
        done = 0
        while done < size:
            n = os.preadv(fd, [view[done:done + CHUNK]], done)
            assert n > 0, f"short read of {path} at {done}"
            done += n
        return out
    finally:
        os.close(fd)


def first_difference(actual, expected):
    if len(actual) != len(expected):
        return f"length {len(actual)} != expected {len(expected)}"
    if actual == expected:
        return None
    block = next(off for off in range(0, len(expected), MiB)
                 if actual[off:off + MiB] != expected[off:off + MiB])
    base = next(off for off in range(block, len(expected)) if actual[off] != expected[off])
    end = base
    while end < len(expected) and actual[end] != expected[end]:
        end += 1
    return (f"first difference at offset {base}: got {bytes(actual[base:base + 16]).hex()} "
            f"expected {bytes(expected[base:base + 16]).hex()} ({end - base} bytes differ there)")


def assert_same_bytes(actual, expected, what):
    diff = first_difference(actual, expected)
    assert diff is None, f"{what}: {diff}"


def assert_target_is(path, model, what="target"):
    assert_same_bytes(read_target(path), model, f"{what} {path}")


def make_image(directory, name, size, seed=1, sparse=False):
    """A file of `size` bytes: random data, or for `sparse` random 64 KiB
    islands every 1 MiB in holes. Returns (path, model bytearray)."""
    path = os.path.join(directory, name)
    model = bytearray(size)
    with open(path, "wb") as f:
        f.truncate(size)
    if sparse:
        rnd = random.Random(seed)
        for off in range(0, size, MiB):
            n = min(64 * KiB, size - off)
            model[off:off + n] = rnd.randbytes(n)
            write_target(path, model[off:off + n], off)
    else:
        model[:] = random_bytes(size, seed)
        write_target(path, model)
    return path, model


def fill_device(dev, seed=1):
    """Dirty a whole block device with random data; returns the model."""
    model = bytearray(random_bytes(target_size(dev), seed))
    write_target(dev, model)
    return model


def allocated_bytes(path):
    return os.stat(path).st_blocks * 512


def seek_hole_extents(path):
    """[(offset, length, is_hole)] from SEEK_DATA/SEEK_HOLE: the kernel's truth."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        out = []
        off = 0
        while off < size:
            try:
                data = os.lseek(fd, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                data = size
            if data > off:
                out.append((off, data - off, True))
                off = data
                continue
            hole = os.lseek(fd, off, os.SEEK_HOLE)
            out.append((off, hole - off, False))
            off = hole
        return out
    finally:
        os.close(fd)


def is_hole_at(extents, off):
    for start, length, hole in extents:
        if start <= off < start + length:
            return hole
    raise AssertionError(f"offset {off} not covered by {extents}")


def open_flags(pid, path):
    """The open(2) flags of every descriptor `pid` has on `path`."""
    real = os.path.realpath(path)
    flags = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != real:
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                for line in f:
                    if line.startswith("flags:"):
                        flags.append(int(line.split()[1], 8))
        except FileNotFoundError:
            continue
    return flags


# -- libnbd -------------------------------------------------------------------

def connect(uri, strict=True, meta=False, name="test"):
    """A libnbd handle. strict=False lets requests the server must reject
    (past the end, unaligned, read-only writes) reach the server instead of
    libnbd refusing them client-side."""
    h = nbd.NBD()
    h.set_handle_name(name)
    if not strict:
        h.set_strict_mode(0)
    if meta:
        h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    # TLS URIs name the client's credentials (tls-certificates=DIR).
    h.set_uri_allow_local_file(True)
    h.connect_uri(uri)
    return h


@contextlib.contextmanager
def connected(uri, **kw):
    h = connect(uri, **kw)
    try:
        yield h
    finally:
        with contextlib.suppress(nbd.Error):
            h.shutdown()
        del h


def read_export(h):
    size = h.get_size()
    out = bytearray(size)
    for off in range(0, size, CHUNK):
        n = min(CHUNK, size - off)
        out[off:off + n] = h.pread(n, off)
    return out


def assert_export_is(uri, model, what="export"):
    """A fresh client reads every byte of the export and compares."""
    with connected(uri, name="verify") as h:
        assert h.get_size() == len(model), f"{what}: size {h.get_size()} != {len(model)}"
        assert_same_bytes(read_export(h), model, f"{what} read over NBD")


def wait_all(h, cookies, timeout_s=60):
    """Drive the handle until every cookie is retired; {cookie: errno or 0}."""
    result = {}
    pending = set(cookies)
    rounds = 0
    while pending:
        h.poll(1000)
        rounds += 1
        assert rounds < timeout_s * 10, f"{len(pending)} commands never completed"
        for c in list(pending):
            try:
                done = h.aio_command_completed(c)
            except nbd.Error as e:
                result[c] = e.errnum
                pending.discard(c)
                continue
            if done:
                result[c] = 0
                pending.discard(c)
    return result


def sigusr1_totals(srv, timeout=10):
    """Sends the server SIGUSR1 and returns the totals document (JSON text)
    of the line that signal logs, not of one an earlier signal logged."""
    needle = "SIGUSR1: totals {"
    asked = srv.stderr().count(needle)
    srv.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while True:
        lines = [x for x in srv.stderr().splitlines() if needle in x]
        if len(lines) > asked:
            return lines[asked][lines[asked].index("{"):]
        assert time.monotonic() < deadline, f"no new {needle!r} in: {srv.stderr()[-3000:]}"
        time.sleep(0.05)


def wait_for_line(srv, needle, timeout=10):
    """The first line of the server's log holding `needle`, waiting for it:
    the server may close a socket before it logs why."""
    deadline = time.monotonic() + timeout
    while True:
        line = next((x for x in srv.stderr().splitlines() if needle in x), None)
        if line is not None:
            return line
        assert time.monotonic() < deadline, f"no {needle!r} in: {srv.stderr()[-3000:]}"
        time.sleep(0.05)


def failed(res, status, *words):
    """A rawdisk command's run (bytes output) failed with `status` and one
    stderr line naming `words`."""
    err = res.stderr.decode(errors="replace")
    assert res.returncode == status, (res.returncode, err)
    assert err.count("\n") == 1 and err.startswith("rawdisk: "), err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"
    return err


# -- processes that must end ---------------------------------------------------

def alive(pid):
    """Running, not a zombie waiting for its (new) parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _signal_names(mask):
    """A /proc status mask (hex) as signal names."""
    bits = int(mask, 16)
    names = []
    for n in range(1, 65):
        if bits >> (n - 1) & 1:
            try:
                names.append(signal.Signals(n).name)
            except ValueError:
                names.append(str(n))
    return ",".join(names) or "-"


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"({e.strerror})"


def process_report(pid):
    """What a process that does not end is doing: its signal masks (blocked,
    ignored, caught, pending), each thread's state, wait channel and kernel
    stack, and gdb's backtrace of every thread when gdb is installed."""
    out = [f"pid {pid}:"]
    for line in _read(f"/proc/{pid}/status").splitlines():
        key, _, value = line.partition(":")
        if key in ("State", "Threads", "PPid"):
            out.append(f"  {key}: {value.strip()}")
        elif key in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"):
            out.append(f"  {key}: {value.strip()} ({_signal_names(value.strip())})")
    for task in sorted(glob.glob(f"/proc/{pid}/task/*")):
        stat_ = _read(f"{task}/stat")
        comm = stat_[stat_.find("(") + 1:stat_.rfind(")")]
        state = (stat_.rsplit(")", 1)[-1].split() or ["?"])[0]
        blk = next((x.split()[1] for x in _read(f"{task}/status").splitlines()
                    if x.startswith("SigBlk:")), "?")
        out.append(f"  thread {os.path.basename(task)} {comm!r} state {state} "
                   f"wchan {_read(task + '/wchan')} SigBlk {blk}")
        stack = _read(f"{task}/stack")
        out.extend("    " + x for x in stack.splitlines()[:12])
    if shutil.which("gdb"):
        try:
            g = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 15"],
                               capture_output=True, text=True, timeout=120)
            out.append(g.stdout[-12000:])
        except subprocess.TimeoutExpired:
            out.append("gdb timed out")
    else:
        out.append("(no gdb for backtraces)")
    return "\n".join(out)


def wait_gone(pid, timeout=30, what="the server"):
    """Waits for `pid` (a server told to stop: SIGTERM, its parent gone) to
    end, also when it is not this process's child (--fork). One still
    running after `timeout` seconds fails the test with process_report(),
    taken before it is killed so that nothing outlives the test."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() >= deadline:
            report = process_report(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise AssertionError(f"{what} (pid {pid}) still running {timeout}s after it "
                                 f"was told to stop; killed:\n{report}")
        time.sleep(0.02)


def finish(proc, timeout=30, after="SIGTERM"):
    """(stdout, stderr) of `proc` (a Popen told to stop by `after`) once it
    has exited, its status in proc.returncode. One still running after
    `timeout` seconds fails the test as wait_gone() does."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        report = process_report(proc.pid)
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{proc.args!r} (pid {proc.pid}) still running {timeout}s after "
                             f"{after}; killed:\n{report}") from None


def terminate(proc, timeout=30):
    """SIGTERM to a server started as `proc` (a Popen), then finish()."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return finish(proc, timeout)
