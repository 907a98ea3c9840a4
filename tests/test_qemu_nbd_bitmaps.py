"""`rawdisk qemu-nbd --bitmap` (issue 39, 5): imageio's handshake for an
incremental backup and virtnbdbackup's offline incremental, through a
`qemu-nbd` symlink to the rawdisk binary. -B maps onto `serve --bitmap`
(a rawdisk checkpoint offered as qemu:dirty-bitmap:NAME); -A needs
nothing, serve always offers qemu:allocation-depth."""

import json
import os
import re
import shutil
import signal
import subprocess
import time

import nbd
import pytest

import servers
from helpers import KiB, MiB, make_image, terminate, wait_gone
from test_qemu_nbd_stacks import qemu_nbd_path, run, start, uri, wait_for_socket, stop  # noqa: F401

pytestmark = pytest.mark.rawdisk_only("rawdisk's qemu-nbd command line")


def serve_has(flag):
    r = subprocess.run([servers.RAWDISK_BIN, "serve", "--help"], capture_output=True,
                       text=True, timeout=30)
    return re.search(re.escape(flag) + r"(?![\w-])", r.stdout) is not None


needs_bitmap = pytest.mark.skipif(not serve_has("--bitmap"), reason="needs serve --bitmap")

DEPTH = "qemu:allocation-depth"


def rawdisk(*args):
    r = subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, (args, r.stderr)
    return r.stdout


def write_tracked(workdir, path, writes):
    """Writes through a tracking server, as a running VM's would be seen."""
    sock = os.path.join(workdir, "vm.sock")
    p = subprocess.Popen([servers.RAWDISK_BIN, "serve", "--track-changes", "-f", "raw",
                          "-U", sock, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while not os.path.exists(sock):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.02)
        h = nbd.NBD()
        h.connect_uri(uri(sock))
        for off, data in writes:
            h.pwrite(data, off)
        h.flush()
        h.shutdown()
    finally:
        terminate(p)
        assert p.returncode == 0


@needs_bitmap
def test_imageio_incremental_handshake(workdir, qemu_nbd_path):
    """imageio's client: LIST with the qemu:dirty-bitmap: prefix finds
    exactly one bitmap; SET base:allocation, qemu:allocation-depth and it;
    block status of each; the dirty extents are the writes made since
    the checkpoint."""
    path, _ = make_image(workdir, "vol.img", 8 * MiB, seed=21)
    rawdisk("checkpoint", "create", "--name", "c1", path)
    write_tracked(workdir, path, [(MiB, b"\x33" * (64 * KiB))])
    sock = os.path.join(workdir, "io.sock")
    node = {"driver": "raw", "file": {"driver": "file", "filename": path}}
    p = start(qemu_nbd_path, ["--socket", sock, "--persistent", "--shared=8",
                              "--export-name=", "--cache=none", "--aio=native",
                              "--read-only", "--bitmap=c1", "-A", "json:" + json.dumps(node)])
    try:
        wait_for_socket(sock, p)
        h = nbd.NBD()
        h.set_opt_mode(True)
        h.connect_uri(uri(sock))
        found = []
        h.add_meta_context("qemu:dirty-bitmap:")
        h.opt_list_meta_context(lambda name: found.append(name))
        assert found == ["qemu:dirty-bitmap:c1"], found
        h.clear_meta_contexts()
        for c in (nbd.CONTEXT_BASE_ALLOCATION, DEPTH, "qemu:dirty-bitmap:c1"):
            h.add_meta_context(c)
        h.opt_go()
        for c in (nbd.CONTEXT_BASE_ALLOCATION, DEPTH, "qemu:dirty-bitmap:c1"):
            assert h.can_meta_context(c), c
        seen = {}

        def cb(ctx, offset, entries, err):
            seen[ctx] = entries
        h.block_status(h.get_size(), 0, cb)
        dirty = seen["qemu:dirty-bitmap:c1"]
        pos, ranges = 0, []
        for i in range(0, len(dirty), 2):
            if dirty[i + 1] & 1:
                ranges.append((pos, dirty[i]))
            pos += dirty[i]
        assert any(o <= MiB < o + n for o, n in ranges), ranges
        assert DEPTH in seen and sum(seen[DEPTH][0::2]) > 0
        h.shutdown()
    finally:
        stop(p)


@needs_bitmap
def test_virtnbdbackup_incremental_restores_byte_identical(workdir, qemu_nbd_path):
    """A full backup, writes through a tracking server, then
    virtnbdbackup's offline line with --bitmap=CHECKPOINT: the bitmap's
    types are 0 and 1 only, and the dirty extents applied to the full
    backup give the disk byte for byte."""
    path, _ = make_image(workdir, "sda.img", 8 * MiB, seed=22, sparse=True)
    rawdisk("checkpoint", "create", "--name", "c1", path)
    full = os.path.join(workdir, "full.img")
    shutil.copyfile(path, full)
    writes = [(512 * KiB, b"\x44" * (128 * KiB)), (5 * MiB, b"\x55" * 4096)]
    write_tracked(workdir, path, writes)
    sock = os.path.join(workdir, "inc.sock")
    pid_file = sock + ".pid"
    argv = ["-r", "--format=raw", "-x", "sda", path, "-k", sock, "-t", "-e 2", "--fork",
            "--detect-zeroes=on", f"--pid-file={pid_file}", "--bitmap=c1"]
    p = start(qemu_nbd_path, argv)
    assert p.wait(timeout=30) == 0, p.stderr.read()
    with open(pid_file) as f:
        pid = int(f.read())
    try:
        u = uri(sock, "sda")
        m = subprocess.run(["nbdinfo", "--json", "--map=qemu:dirty-bitmap:c1", u],
                           capture_output=True, text=True, timeout=60)
        assert m.returncode == 0, m.stderr
        extents = json.loads(m.stdout)
        assert {e["type"] for e in extents} <= {0, 1}, extents
        h = nbd.NBD()
        h.connect_uri(u)
        with open(full, "r+b") as f:
            for e in extents:
                if e["type"] == 1:
                    f.seek(e["offset"])
                    f.write(h.pread(e["length"], e["offset"]))
        h.shutdown()
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_gone(pid)
    with open(full, "rb") as a, open(path, "rb") as b:
        assert a.read() == b.read(), "the restored disk differs"
