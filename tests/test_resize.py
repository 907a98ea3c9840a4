"""`rawdisk resize` on a file a running `rawdisk serve` has open, while a
client reads and writes it: the connection that was open keeps the size it
was given and keeps working; a new connection sees the new size; no byte
below the old size changes except by the client's own writes."""

import os
import subprocess
import threading

import nbd
import pytest

import servers
from helpers import MiB, connected, make_image, read_target


def resize(path, size, *extra):
    res = subprocess.run([servers.RAWDISK_BIN, "resize", *extra, path, size],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_resize_a_served_file_under_load(workdir, serve):
    if servers.SERVER_KIND == "qemu-nbd":
        pytest.skip("qemu-nbd gives every connection the size it found at start")
    size = 16 * MiB
    path, model = make_image(workdir, "served.img", size, seed=81)
    srv = serve(path)
    stop = threading.Event()
    errors = []
    writes = []

    def load(h):
        # Rewrite the first 4 MiB in 64 KiB pieces and read them back.
        i = 0
        try:
            while not stop.is_set():
                off = (i * 64 * 1024) % (4 * MiB)
                data = bytes([i % 251]) * (64 * 1024)
                h.pwrite(data, off)
                assert h.pread(len(data), off) == data
                writes.append((off, data))
                i += 1
        except Exception as e:  # reported by the test thread
            errors.append(e)

    # Not strict: a request past the old size reaches the server, which
    # must refuse it on this connection.
    with connected(srv.uri, strict=False) as old:
        assert old.get_size() == size
        t = threading.Thread(target=load, args=(old,))
        t.start()
        try:
            resize(path, "+8M", "--preallocation", "full")
            assert os.path.getsize(path) == size + 8 * MiB
            # The open connection keeps its size and keeps working.
            assert old.get_size() == size
            with connected(srv.uri) as new:
                assert new.get_size() == size + 8 * MiB
                assert new.pread(8 * MiB, size) == bytes(8 * MiB)
                new.pwrite(b"tail", size + 8 * MiB - 4)
            resize(path, "+4M")
            with connected(srv.uri) as newer:
                assert newer.get_size() == size + 12 * MiB
        finally:
            stop.set()
            t.join()
        assert not errors, errors
        assert writes, "the load did not run"
        # Past its size the old connection is refused, as before the resize.
        try:
            old.pread(512, size)
            raise AssertionError("read past the old size succeeded")
        except nbd.Error as e:
            # libnbd names the errno the server sent.
            assert e.errno == "EINVAL", e
    srv.assert_alive()
    for off, data in writes:
        model[off:off + len(data)] = data
    got = read_target(path)
    assert got[:size] == model, "bytes below the old size changed"
    assert got[size:size + 8 * MiB - 4] == bytes(8 * MiB - 4)
    assert got[size + 8 * MiB - 4:size + 8 * MiB] == b"tail"
    assert got[size + 8 * MiB:] == bytes(4 * MiB)
