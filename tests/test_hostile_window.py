"""Windows of a target as a careless or hostile caller asks for them:
qemu-nbd's --offset over a json: raw node that already has an offset and a
size, and the export's edges driven with every command. qemu's own
qemu-nbd is the reference where it is installed; every byte outside what a
client may touch is checked unchanged in the file."""

import json
import os
import shutil
import socket
import subprocess
import time

import nbd
import pytest

import servers
from helpers import (KiB, MiB, assert_export_is, assert_target_is, connected, make_image,
                     terminate)

pytestmark = pytest.mark.rawdisk_only("rawdisk's qemu-nbd command line")

QEMU_NBD = shutil.which("qemu-nbd", path="/usr/bin:/usr/local/bin")


def start(argv, prog):
    return subprocess.Popen([*prog, *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def wait_for_socket(sock, proc, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read()}")
        if os.path.exists(sock):
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(sock)
                return
            except OSError:
                pass
        time.sleep(0.02)
    raise AssertionError("the socket never accepted")


def stop(proc):
    terminate(proc)


def uri(sock):
    return f"nbd+unix:///?socket={sock}"


def slice_json(path, off, size):
    node = {"driver": "raw", "offset": off, "size": size,
            "file": {"driver": "file", "filename": path}}
    return "json:" + json.dumps(node)


def export_size(prog, argv, sock):
    p = start(argv, prog)
    try:
        wait_for_socket(sock, p)
        with connected(uri(sock)) as h:
            return h.get_size()
    finally:
        stop(p)


def test_offset_over_a_sized_slice_stays_inside_it(workdir):
    """qemu-nbd -o puts a raw node with that offset over the image, so over
    a json: slice of SIZE bytes the export is SIZE - OFFSET bytes, and ends
    where the slice does. Writing all of it, its last byte included,
    changes nothing after the slice."""
    path, model = make_image(workdir, "disk.img", 8 * MiB, seed=11)
    off, size, dev_off = 3 * MiB, 2 * MiB, 64 * KiB
    sock = os.path.join(workdir, "r.sock")
    argv = ["-k", sock, "-t", "-f", "raw", "-o", str(dev_off), slice_json(path, off, size)]
    if QEMU_NBD:
        qsock = os.path.join(workdir, "q.sock")
        qargv = ["-k", qsock, "-t", "-o", str(dev_off), slice_json(path, off, size)]
        assert export_size([QEMU_NBD], qargv, qsock) == size - dev_off
    p = start(argv, [servers.RAWDISK_BIN, "qemu-nbd"])
    try:
        wait_for_socket(sock, p)
        start_at = off + dev_off
        want = model[start_at:off + size]
        assert_export_is(uri(sock), want, "the slice past -o")
        new = bytes((i * 13 + 5) & 0xFF for i in range(len(want)))
        with connected(uri(sock), strict=False) as h:
            h.pwrite(new, 0)
            h.flush()
            with pytest.raises(nbd.Error):
                h.pwrite(b"\xee", h.get_size())
        model[start_at:off + size] = new
    finally:
        stop(p)
    assert_target_is(path, model)


def test_offset_past_a_sized_slice_is_refused(workdir):
    """-o beyond the slice's size is qemu-nbd's error, not a window that
    starts after the slice."""
    path, model = make_image(workdir, "disk.img", 8 * MiB, seed=12)
    sock = os.path.join(workdir, "r.sock")
    r = subprocess.run([servers.RAWDISK_BIN, "qemu-nbd", "-k", sock, "-o", str(MiB + 1),
                        slice_json(path, 3 * MiB, MiB)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r
    assert "cannot be greater than" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.path.exists(sock)
    assert_target_is(path, model)
