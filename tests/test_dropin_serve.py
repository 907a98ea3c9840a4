"""`rawdisk serve` with qemu-nbd's and nbdkit's serving flags (issue 39, 3):
--discard=ignore|unmap, --detect-zeroes=off|on|unmap, --aio=threads|native|
io_uring, --shared=N, --exit-last (qemu-nbd's exit after the last client,
behind a flag) and nbdkit's --print-uri; -f, which is rawdisk's format flag
and not nbdkit's --foreground, is explained in --help. Each flag is driven
through the anchors' clients (nbdinfo, qemu-io, qemu-img) and every byte is
read back. The scratch directory is on ext4, where a zero kept allocated
(ZERO_RANGE) reads back as a hole to SEEK_DATA while its blocks stay."""

import errno
import json
import os
import subprocess
import sys
import time

import pytest

import servers
import wire
from helpers import (KiB, MiB, allocated_bytes, assert_export_is, assert_target_is, connected,
                     is_hole_at, make_image, seek_hole_extents)

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")

NO_HOLE = 2  # NBD_CMD_FLAG_NO_HOLE


def rawdisk(*args, **kw):
    return subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                          timeout=60, **kw)


def run(*argv):
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60)


def qemu_io(uri, *cmds):
    argv = ["qemu-io", "-f", "raw"]
    for c in cmds:
        argv += ["-c", c]
    r = run(*argv, uri)
    assert r.returncode == 0 and "error" not in r.stdout.lower(), (r.stdout, r.stderr)
    return r.stdout


def qemu_img_map(path):
    r = run("qemu-img", "map", "--output=json", "-f", "raw", path)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def map_at(entries, off):
    """The qemu-img map entry covering `off`: (zero, data)."""
    for e in entries:
        if e["start"] <= off < e["start"] + e["length"]:
            return e["zero"], e["data"]
    raise AssertionError(f"{off} not in {entries}")


# -- --discard ------------------------------------------------------------------

def test_discard_ignore_advertises_no_trim_and_keeps_zeroes_allocated(workdir, serve):
    """--discard=ignore: nbdinfo --can trim exits 2 (0 with the default
    unmap, on the same file), a zero the client lets become a hole keeps
    its blocks, and a TRIM sent anyway changes nothing."""
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=31)
    srv = serve(path)
    assert run("nbdinfo", "--can", "trim", srv.uri).returncode == 0
    assert srv.terminate() == 0

    srv = serve(path, extra=["--discard=ignore"])
    assert run("nbdinfo", "--can", "trim", srv.uri).returncode == 2
    assert run("nbdinfo", "--can", "zero", srv.uri).returncode == 0
    before = allocated_bytes(path)
    with connected(srv.uri, strict=False) as h:
        assert not h.can_trim()
        h.zero(MiB, MiB)                       # may punch, but must not here
        model[MiB:2 * MiB] = bytes(MiB)
        h.trim(MiB, 3 * MiB)                   # not advertised: ignored
        h.flush()
    assert_export_is(srv.uri, model)
    assert srv.terminate() == 0
    assert allocated_bytes(path) == before, "--discard=ignore deallocated blocks"
    assert_target_is(path, model)


def test_discard_unmap_is_the_default_and_punches(workdir, serve):
    """--discard=unmap (spelled out, as virt-v2v does): TRIM and a zero
    that allows a hole deallocate, qemu-io's discard included."""
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=32)
    srv = serve(path, extra=["--discard=unmap"])
    qemu_io(srv.uri, f"discard 0 {MiB}")
    model[:MiB] = bytes(MiB)
    assert_export_is(srv.uri, model)
    assert srv.terminate() == 0
    assert is_hole_at(seek_hole_extents(path), 0)
    assert_target_is(path, model)


# -- --detect-zeroes ------------------------------------------------------------

def zero_writes(uri):
    """qemu-io writes 1 MiB of zeros at 1 MiB; libnbd 1 MiB whose last byte
    only is not zero at 2 MiB (a write to keep as it is)."""
    qemu_io(uri, f"write -P 0 {MiB} {MiB}")
    with connected(uri) as h:
        h.pwrite(bytes(MiB - 1) + b"\x07", 2 * MiB)


def expected_after_zero_writes(model):
    model[MiB:3 * MiB] = bytes(2 * MiB)
    model[3 * MiB - 1] = 7


@pytest.mark.parametrize("mode", ["off", "on", "unmap"])
def test_detect_zeroes_turns_zero_writes_into_zeroes(workdir, serve, mode):
    """An all-zero WRITE: off writes it (no zero call in the -vv trace,
    data to qemu-img map), on zeroes it keeping its blocks (the trace names
    the zero method; allocation unchanged), unmap leaves a hole (blocks
    freed; qemu-img map and rawdisk map show no data). A write that is not
    all zeros is written as data in every mode; every byte of the export
    and the file is checked."""
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=33)
    srv = serve(path, extra=[f"--detect-zeroes={mode}", "-vv"])
    before = allocated_bytes(path)
    zero_writes(srv.uri)
    expected_after_zero_writes(model)
    assert_export_is(srv.uri, model)
    assert srv.terminate() == 0
    assert_target_is(path, model)
    m = qemu_img_map(path)
    assert map_at(m, 2 * MiB)[1], "a write with data became a zero"
    zeroed = "zero used" in srv.stderr()
    after = allocated_bytes(path)
    if mode == "off":
        assert not zeroed and map_at(m, MiB)[1] and after == before, (m, before, after)
    elif mode == "on":
        assert zeroed and after == before, (srv.stderr(), before, after)
    else:
        assert zeroed and after == before - MiB, (m, before, after)
        assert map_at(m, MiB) == (True, False), m
        r = rawdisk("map", "--output", "json", path)
        entry = next(e for e in json.loads(r.stdout)
                     if e["start"] <= MiB < e["start"] + e["length"])
        assert not entry["data"], entry


def test_detect_zeroes_unmap_needs_discard_unmap(workdir, serve):
    """qemu's rule: --detect-zeroes=unmap with --discard=ignore zeroes but
    never deallocates."""
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=34)
    srv = serve(path, extra=["--detect-zeroes=unmap", "--discard=ignore"])
    before = allocated_bytes(path)
    zero_writes(srv.uri)
    expected_after_zero_writes(model)
    assert_export_is(srv.uri, model)
    assert srv.terminate() == 0
    assert allocated_bytes(path) == before
    assert_target_is(path, model)


def test_detect_zeroes_thin_import_with_cache_none_and_map_writes(workdir, serve):
    """A thin import: qemu-img convert of an image whose first half is
    zeros written as data, into a sparse export with --detect-zeroes=unmap
    and --cache none (small writes through Linux AIO), then the same with
    --map-writes (writes straight into the page cache): the zeros stay
    holes, the data lands, every byte matches the source."""
    for extra in (["--cache", "none"], ["--map-writes"]):
        src, model = make_image(workdir, "src.img", 8 * MiB, seed=35)
        with open(src, "r+b") as f:
            f.write(bytes(4 * MiB))
        model[:4 * MiB] = bytes(4 * MiB)
        dst = os.path.join(workdir, "dst.img")
        with open(dst, "wb") as f:
            f.truncate(8 * MiB)
        srv = serve(dst, extra=["--detect-zeroes=unmap", *extra])
        # -S 0: qemu-img sends the zeros as writes, as a client without
        # sparse detection does.
        r = run("qemu-img", "convert", "-n", "-S", "0", "-f", "raw", "-O", "raw", src, srv.uri)
        assert r.returncode == 0, r.stderr
        # Small writes, 16 at once, half of them zeros (the AIO path).
        c = wire.RawClient(srv.connect_unix_or_tcp(timeout=30)).start().go()
        sent = []
        for i in range(32):
            off = 4 * MiB + i * 4 * KiB
            data = bytes(4 * KiB) if i % 2 == 0 else bytes([i + 1]) * (4 * KiB)
            model[off:off + 4 * KiB] = data
            sent.append(wire.request_bytes(wire.CMD_WRITE, off, 4 * KiB, cookie=i, payload=data))
        c.sock.sendall(b"".join(sent))
        for _ in sent:
            cookie, err, _ = c.read_simple_reply()
            assert err == 0, cookie
        c.disconnect()
        assert_export_is(srv.uri, model)
        assert srv.terminate() == 0
        assert_target_is(dst, model)
        ext = seek_hole_extents(dst)
        for off in range(0, 4 * MiB, 64 * KiB):
            assert is_hole_at(ext, off), (extra, off, ext)
        for i in range(0, 32, 2):
            assert is_hole_at(ext, 4 * MiB + i * 4 * KiB), (extra, i, ext)
        assert not is_hole_at(ext, 4 * MiB + 4 * KiB)
        os.unlink(dst)


def test_detect_zeroes_marks_changed_blocks(workdir, serve):
    """A zero write that became a hole is a change: --track-changes marks
    exactly its range in the checkpoint's context."""
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=44)
    srv = serve(path, extra=["--track-changes", "--detect-zeroes=unmap"])
    r = rawdisk("checkpoint", "create", "--name", "a", path)
    assert r.returncode == 0, r.stderr
    qemu_io(srv.uri, f"write -P 0 {MiB} {MiB}")
    model[MiB:2 * MiB] = bytes(MiB)
    r = rawdisk("info", "--map=rawdisk:changed:a", "--output", "json", srv.uri)
    assert r.returncode == 0, r.stderr
    changed = [(e["offset"], e["length"]) for e in json.loads(r.stdout) if e["type"] == 1]
    assert changed == [(MiB, MiB)], r.stdout
    assert_export_is(srv.uri, model)
    assert srv.terminate() == 0
    assert is_hole_at(seek_hole_extents(path), MiB)
    assert_target_is(path, model)


# -- --aio ----------------------------------------------------------------------

@pytest.mark.parametrize("aio,path_named,through_aio", [
    ("native", "Linux AIO", True),
    ("io_uring", "io_uring for small requests", True),
    ("threads", "thread pool only", False),
])
def test_aio_chooses_the_path_and_names_it(workdir, serve, aio, path_named, through_aio):
    """--aio with --cache none: native and io_uring answer small requests
    in the kernel (Linux AIO, io_uring), threads through the pool only;
    -v names the path; --stats aio-completed shows which one ran."""
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=36)
    stats = os.path.join(workdir, f"stats-{aio}.json")
    srv = serve(path, cache="none", extra=[f"--aio={aio}", "-v", "--stats", stats])
    c = wire.RawClient(srv.connect_unix_or_tcp(timeout=30)).start().go()
    sent = [wire.request_bytes(wire.CMD_READ, i * 4 * KiB, 4 * KiB, cookie=i) for i in range(64)]
    c.sock.sendall(b"".join(sent))
    for _ in sent:
        cookie, err, _ = c.read_simple_reply()
        assert err == 0
        assert wire.recv_exact(c.sock, 4 * KiB) == bytes(model[cookie * 4 * KiB:
                                                              (cookie + 1) * 4 * KiB])
    c.disconnect()
    assert srv.terminate() == 0
    assert f"aio={aio}" in srv.stderr() and path_named in srv.stderr(), srv.stderr()
    with open(stats) as f:
        done = json.load(f)["aio-completed"]
    assert (done > 0) == through_aio, done


# Runs argv[1:] with io_uring_setup failing as `errno` says, as under
# kernel.io_uring_disabled=2 or a container's seccomp profile.
REFUSE_URING = """
import os, sys, seccomp
f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
f.add_rule(seccomp.ERRNO(int(sys.argv[1])), "io_uring_setup")
f.load()
os.execv(sys.argv[2], sys.argv[2:])
"""


@pytest.mark.parametrize("refusal", ["EPERM", "ENOSYS"])
def test_aio_io_uring_refused_by_the_kernel_uses_linux_aio(workdir, refusal):
    """--aio=io_uring where io_uring_setup fails with EPERM or ENOSYS: the
    server says so once and answers the same requests through Linux AIO,
    every byte as in the image."""
    # Not a skip: scripts/deps.sh installs python3-seccomp, and a missing
    # one fails here by name rather than as a server that did not start.
    import seccomp  # noqa: F401
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=38)
    stats = os.path.join(workdir, "stats.json")
    srv = servers.Server(workdir, path, cache="none",
                         extra=["--aio=io_uring", "-v", "--stats", stats])
    srv.argv = [sys.executable, "-c", REFUSE_URING, str(getattr(errno, refusal)), *srv.argv]
    srv.start()
    try:
        for _ in range(2):  # two connections: the refusal is learned once
            c = wire.RawClient(srv.connect_unix_or_tcp(timeout=30)).start().go()
            sent = [wire.request_bytes(wire.CMD_READ, i * 8 * KiB, 4 * KiB, cookie=i)
                    for i in range(64)]
            c.sock.sendall(b"".join(sent))
            for _ in sent:
                cookie, err, _ = c.read_simple_reply()
                assert err == 0
                want = bytes(model[cookie * 8 * KiB:cookie * 8 * KiB + 4 * KiB])
                assert wire.recv_exact(c.sock, 4 * KiB) == want
            c.disconnect()
        assert srv.terminate() == 0
    finally:
        srv.kill()
    log = srv.stderr()
    assert log.count("io_uring_setup") == 1, log
    assert "requests use Linux AIO" in log, log
    with open(stats) as f:
        done = json.load(f)["aio-completed"]
    assert done == 128, done


def test_aio_through_the_page_cache_says_threads(workdir, serve):
    path, _ = make_image(workdir, "disk.img", MiB, seed=37)
    srv = serve(path, extra=["--aio=native", "-v"])
    assert srv.terminate() == 0
    assert "the thread pool (Linux AIO serves --cache none only)" in srv.stderr()


# -- --shared -------------------------------------------------------------------

def test_shared_is_the_connection_cap(workdir, serve):
    """--shared=1 (qemu-nbd's default): a second client is refused while
    the first is connected; --shared=0 (qemu-nbd's no limit) keeps the
    default cap; --shared with --max-connections is a usage error."""
    path, model = make_image(workdir, "disk.img", MiB, seed=38)
    srv = serve(path, extra=["--shared=1"])
    with connected(srv.uri) as h:
        r = run("nbdinfo", "--size", srv.uri)
        assert r.returncode != 0
        assert h.pread(4096, 0) == bytes(model[:4096])
    assert run("nbdinfo", "--size", srv.uri).stdout.strip() == str(MiB)
    assert srv.terminate() == 0
    srv = serve(path, extra=["--shared", "0"])
    with connected(srv.uri), connected(srv.uri), connected(srv.uri) as h:
        assert h.pread(4096, 0) == bytes(model[:4096])
    assert srv.terminate() == 0
    r = rawdisk("serve", "--shared", "2", "--max-connections", "3", path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) <= 3, r.stderr


# -- --exit-last ----------------------------------------------------------------

def test_exit_last_exits_after_the_last_client(workdir, serve):
    """--exit-last: a probe (connect and close) and a --list do not count;
    the server exits 0 once the client that wrote disconnects, its data
    flushed to the file."""
    path, model = make_image(workdir, "disk.img", 2 * MiB, seed=39)
    srv = serve(path, extra=["--exit-last"])
    srv.connect_unix_or_tcp(timeout=5).close()
    assert run("nbdinfo", "--list", srv.uri).returncode == 0
    time.sleep(0.2)
    assert srv.proc.poll() is None, "a probe or a list ended the server"
    qemu_io(srv.uri, f"write -P 9 {MiB} 4096")
    model[MiB:MiB + 4096] = b"\x09" * 4096
    assert srv.wait_exit(timeout=10) == 0
    assert "last client disconnected" in srv.stderr()
    assert not os.path.exists(srv.sock)
    assert_target_is(path, model)


def test_exit_last_waits_for_every_client(workdir, serve):
    """Two clients: the server outlives the first and exits after the second."""
    path, model = make_image(workdir, "disk.img", MiB, seed=40)
    srv = serve(path, extra=["--exit-last"])
    with connected(srv.uri) as a:
        with connected(srv.uri) as b:
            b.pwrite(b"\x05" * 512, 0)
            model[:512] = b"\x05" * 512
            b.flush()
        time.sleep(0.2)
        assert srv.proc.poll() is None, "exited with a client still connected"
        assert a.pread(512, 0) == b"\x05" * 512
    assert srv.wait_exit(timeout=10) == 0
    assert_target_is(path, model)


def test_exit_last_and_persistent_conflict(workdir):
    path, _ = make_image(workdir, "disk.img", MiB, seed=41)
    r = rawdisk("serve", "-t", "--exit-last", path)
    assert r.returncode == 2 and "cannot be used with" in r.stderr, r.stderr


def test_persistent_serves_after_the_last_client(workdir, serve):
    path, model = make_image(workdir, "disk.img", MiB, seed=42)
    srv = serve(path, extra=["-t"])
    assert_export_is(srv.uri, model)
    time.sleep(0.2)
    assert srv.proc.poll() is None
    assert srv.terminate() == 0


# -- nbdkit: --print-uri, -f ------------------------------------------------------

def test_print_uri_is_accepted(workdir, serve):
    path, model = make_image(workdir, "disk.img", MiB, seed=43)
    srv = serve(path, extra=["--print-uri"])
    assert srv.printed_uri == srv.uri
    assert_export_is(srv.printed_uri, model)


def test_help_tells_an_nbdkit_user_about_f(workdir):
    """-f is the format flag: --help says what nbdkit's -f/--foreground
    becomes, and --exit-last, --discard and --detect-zeroes are listed."""
    r = rawdisk("serve", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "-f is rawdisk's format flag (-f raw), not --foreground" in text, text
    for flag in ("--exit-last", "--discard", "--detect-zeroes", "--aio", "--shared",
                 "--print-uri"):
        assert flag in text, flag
