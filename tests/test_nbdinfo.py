"""nbdinfo sees what the server advertises: the size, transmission flags
that tell the truth about the target (writable or read-only), block sizes
(minimum, preferred, maximum), `--map` equal to the file's SEEK_HOLE truth,
and `--list` with the export name."""

import json
import os
import re
import shutil
import subprocess
import time

import pytest

import helpers
from conftest import require_root
from helpers import KiB, MiB, make_image, seek_hole_extents

SIZE = 8 * MiB + 12345


def nbdinfo(*args, check=True):
    res = subprocess.run(["nbdinfo", *args], capture_output=True, text=True, timeout=60)
    if check:
        assert res.returncode == 0, res.stderr
    return res


def export_info(uri):
    info = json.loads(nbdinfo("--json", uri).stdout)
    (export,) = info["exports"]
    return info, export


def test_size_and_flags_of_a_writable_file(workdir, serve):
    path, _ = make_image(workdir, "disk.img", SIZE)
    srv = serve(path)
    info, ex = export_info(srv.uri)
    assert info["protocol"] == "newstyle-fixed"
    assert info["structured"] is True
    assert ex["export-size"] == SIZE
    assert ex["is_read_only"] is False
    for flag in ("can_trim", "can_zero", "can_multi_conn", "can_flush", "can_fua",
                 "can_cache", "can_df"):
        assert ex[flag] is True, flag
    assert "base:allocation" in ex["contexts"]


@pytest.mark.rawdisk_only("nbdkit 1.32's file plugin has no fast zero")
def test_fast_zero_is_advertised_on_ext4(workdir, serve):
    path, _ = make_image(workdir, "disk.img", SIZE)
    _, ex = export_info(serve(path).uri)
    assert ex["can_fast_zero"] is True


def test_read_only_flags(workdir, serve):
    path, _ = make_image(workdir, "disk.img", SIZE)
    _, ex = export_info(serve(path, read_only=True).uri)
    assert ex["is_read_only"] is True
    assert ex["export-size"] == SIZE


@pytest.mark.rawdisk_only("nbdkit 1.32's file plugin sends no NBD_INFO_BLOCK_SIZE")
def test_block_sizes_through_the_page_cache(workdir, serve):
    """Through the page cache any byte range works (minimum 1); the maximum
    payload is at least the 2^25 the spec says never to treat as an attack
    is fine to send, unless the server argues for less (never below 1 MiB)."""
    path, _ = make_image(workdir, "disk.img", SIZE)
    _, ex = export_info(serve(path).uri)
    minimum, preferred, maximum = (ex[f"block_size_{k}"] for k in ("minimum", "preferred", "maximum"))
    assert minimum == 1
    assert preferred >= 512 and preferred & (preferred - 1) == 0
    assert maximum >= MiB and maximum >= preferred
    assert maximum <= 0xFFFFFFFF


def test_map_matches_seek_hole(workdir, serve):
    path, model = make_image(workdir, "sparse.img", SIZE, seed=3, sparse=True)
    srv = serve(path)
    out = nbdinfo("--map", "--json", srv.uri).stdout
    extents = json.loads(out)
    truth = seek_hole_extents(path)
    expect = 0
    for e in extents:
        assert e["offset"] == expect, out
        expect += e["length"]
        is_hole = bool(e["type"] & 1)
        is_zero = bool(e["type"] & 2)
        start, end = e["offset"], e["offset"] + e["length"]
        # Extents may be split or merged differently, but never lie: each one
        # is entirely hole or entirely data in the kernel's view, and "zero"
        # only where the bytes are zero.
        for off in range(start, end, 4 * KiB):
            assert helpers.is_hole_at(truth, off) == is_hole, (off, e, truth)
        if is_zero:
            assert model[start:end] == bytes(end - start), e
    assert expect == SIZE
    holes = sum(length for _, length, hole in truth if hole)
    reported = sum(e["length"] for e in extents if e["type"] & 1)
    assert reported == holes


@pytest.mark.rawdisk_only("the syscall bound is rawdisk's")
def test_map_of_a_huge_file_costs_no_fstat_or_hand_off_per_request(workdir, serve):
    """`nbdinfo --map` of 1 TiB asks 257 BLOCK_STATUS of 4 GiB, one at a
    time: each is a few lseeks on the connection's reader, with no fstat, no
    trip to a blocking thread and back (6.5 futex calls a request before,
    strace -c of the server) and one recv (two before)."""
    require_root()  # strace -p
    assert shutil.which("strace"), "strace is missing (scripts/deps.sh installs it)"
    path = os.path.join(workdir, "huge.img")
    size = 1 << 40
    with open(path, "wb") as f:
        f.truncate(size)
        for i in range(10):
            f.seek(i * (size // 10) // 4096 * 4096)
            f.write(b"x" * 4096)
    srv = serve(path, read_only=True)
    log = os.path.join(workdir, "strace.log")
    tracer = subprocess.Popen(["strace", "-f", "-c", "-p", str(srv.pid), "-o", log],
                              stderr=subprocess.PIPE)
    time.sleep(1)  # attached to every thread
    out = json.loads(nbdinfo("--map", "--json", srv.uri).stdout)
    # strace detaches, writes the table, then dies of the same SIGINT.
    tracer.send_signal(2)
    tracer.wait(timeout=30)
    assert sum(e["length"] for e in out) == size
    data = [e for e in out if not e["type"] & 1]
    assert len(data) == 10 and all(e["length"] == 4096 for e in data), data
    with open(log) as f:
        calls = {m[2]: int(m[1]) for m in re.finditer(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$",
                                                     f.read(), re.M)}
    requests = size // (4 << 30) + 1
    assert calls.get("lseek", 0) >= requests, calls
    assert calls.get("fstat", 0) + calls.get("newfstatat", 0) + calls.get("statx", 0) <= 4, calls
    assert calls.get("futex", 0) <= 64 + requests // 10, calls
    # A short read drains the socket: no recv that meets EAGAIN per request.
    assert calls.get("recvfrom", 0) + calls.get("recvmsg", 0) <= requests + 32, calls


def test_list_shows_the_export(workdir, serve):
    path, _ = make_image(workdir, "disk.img", SIZE)
    srv = serve(path)
    info = json.loads(nbdinfo("--list", "--json", srv.uri).stdout)
    names = [e["export-name"] for e in info["exports"]]
    assert names == [""]
    assert info["exports"][0]["export-size"] == SIZE


@pytest.mark.rawdisk_only("nbdkit serves any name the client asks for")
def test_named_export_is_listed_and_others_refused(workdir, serve):
    path, _ = make_image(workdir, "disk.img", SIZE)
    srv = serve(path, export_name="disk0")
    info = json.loads(nbdinfo("--list", "--json", srv.uri).stdout)
    assert [e["export-name"] for e in info["exports"]] == ["disk0"]
    _, ex = export_info(srv.uri)
    assert ex["export-size"] == SIZE
    wrong = f"nbd+unix:///nosuch?socket={srv.sock}"
    res = nbdinfo("--json", wrong, check=False)
    assert res.returncode != 0
    srv.assert_alive()
