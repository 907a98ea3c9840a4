"""qemu-img 10 (which asks for extended headers first) talks to the server:
`info` sees the right size, `convert` into and out of the export moves every
byte, zeroing what the sparse source leaves out of a dirty export, and
`compare` agrees (and notices a one-byte difference). Unix socket and TCP."""

import json
import os
import re
import subprocess

import pytest

import storage

from helpers import (MiB, assert_export_is, assert_target_is, is_hole_at, make_image, read_target,
                     seek_hole_extents, write_target)

SIZE = 24 * MiB + 3 * 4096


def qemu_img(*args, check=True, timeout=60):
    res = subprocess.run(["qemu-img", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert res.returncode == 0, f"qemu-img {' '.join(args)}: {res.stderr}"
    return res


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_info_reports_raw_size(workdir, serve, tcp):
    path, _ = make_image(workdir, "disk.img", SIZE)
    srv = serve(path, tcp=tcp)
    info = json.loads(qemu_img("info", "--output=json", srv.uri).stdout)
    assert info["virtual-size"] == SIZE
    assert info["format"] == "raw"


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_convert_sparse_source_into_dirty_export(workdir, serve, tcp):
    """The holes of the source must end up as zeros over the dirty export:
    qemu-img uses WRITE_ZEROES (and trim) for them, never skips them."""
    src, model = make_image(workdir, "src.img", SIZE, seed=2, sparse=True)
    dst, _ = make_image(workdir, "dst.img", SIZE, seed=3)
    srv = serve(dst, tcp=tcp)
    qemu_img("convert", "-n", "-f", "raw", "-O", "raw", src, srv.uri)
    assert_export_is(srv.uri, model)
    assert_target_is(dst, model)


def test_convert_with_out_of_order_writes(workdir, serve):
    """-W lets qemu-img keep many writes in flight out of order (-m 16)."""
    src, model = make_image(workdir, "src.img", SIZE, seed=4, sparse=True)
    dst, _ = make_image(workdir, "dst.img", SIZE, seed=5)
    srv = serve(dst)
    qemu_img("convert", "-n", "-W", "-m", "16", "-f", "raw", "-O", "raw", src, srv.uri)
    assert_target_is(dst, model)


@pytest.mark.rawdisk_only("rawdisk serve's --write-behind")
@pytest.mark.parametrize("mode", ["on", "off", "auto"])
def test_convert_with_write_behind(workdir, serve, mode):
    """--write-behind starts write-back of big writes as they land (auto: while
    they land on ranges not written since the last flush); the bytes are the
    same in every mode, the trailing FLUSH just has less to do."""
    src, model = make_image(workdir, "src.img", SIZE, seed=6, sparse=True)
    dst, _ = make_image(workdir, "dst.img", SIZE, seed=7)
    srv = serve(dst, extra=(f"--write-behind={mode}",))
    qemu_img("convert", "-n", "-W", "-m", "16", "-f", "raw", "-O", "raw", src, srv.uri)
    assert_export_is(srv.uri, model)
    assert_target_is(dst, model)


@pytest.mark.rawdisk_only("rawdisk serve's --map-writes")
@pytest.mark.parametrize("fs_dir", storage.FILE_SYSTEMS,
                         indirect=True)
def test_convert_with_map_writes(fs_dir, serve):
    """--map-writes receives big write payloads straight into the page cache
    of a dirty (cached) export; qemu-img convert -W (2 MiB writes in any
    order, zeros for the holes) and qemu-io's unaligned writes must leave
    exactly the source's bytes, on every file system that maps."""
    src, model = make_image(fs_dir, "mw-src.img", SIZE, seed=8, sparse=True)
    dst, _ = make_image(fs_dir, "mw-dst.img", SIZE, seed=9)
    try:
        srv = serve(dst, extra=("--map-writes", "-v"))
        qemu_img("convert", "-n", "-W", "-m", "16", "-f", "raw", "-O", "raw", src, srv.uri)
        assert_export_is(srv.uri, model)
        off, n = 3 * MiB + 777, 300001
        res = subprocess.run(["qemu-io", "-f", "raw", "-c", f"write -P 0x5a {off} {n}", srv.uri],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        model[off:off + n] = b"\x5a" * n
        assert_export_is(srv.uri, model)
        assert srv.terminate() == 0
        assert "panicked" not in srv.stderr()
        assert "capability learned: map-write works" in srv.stderr(), srv.stderr()[-2000:]
        assert_target_is(dst, model)
    finally:
        for p in (src, dst):
            if os.path.exists(p):
                os.unlink(p)


def test_convert_out_of_export(workdir, serve):
    src, model = make_image(workdir, "src.img", SIZE, seed=6, sparse=True)
    srv = serve(src, read_only=True)
    out = f"{workdir}/out.img"
    qemu_img("convert", "-f", "raw", "-O", "raw", srv.uri, out)
    assert read_target(out) == model
    assert_target_is(src, model, "source after being read")


def test_compare_equal_then_one_byte_off(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=7)
    copy = f"{workdir}/copy.img"
    with open(copy, "wb") as f:
        f.write(model)
    srv = serve(path)
    assert qemu_img("compare", "-f", "raw", "-F", "raw", copy, srv.uri).returncode == 0
    flipped = bytes([model[SIZE - 5] ^ 0xFF])
    write_target(copy, flipped, SIZE - 5)
    res = qemu_img("compare", "-f", "raw", "-F", "raw", copy, srv.uri, check=False)
    assert res.returncode == 1, res.stdout + res.stderr
    # qemu-img reports the sector (512 bytes) holding the first difference.
    reported = int(re.search(r"offset (\d+)", res.stdout).group(1))
    assert reported <= SIZE - 5 < reported + 512, res.stdout
    assert_target_is(path, model)


def test_map_matches_seek_hole(workdir, serve):
    """qemu-img 10 negotiates extended headers, so this is block status with
    64-bit extents: every extent's data/zero must agree with the kernel."""
    path, model = make_image(workdir, "sparse.img", SIZE, seed=8, sparse=True)
    srv = serve(path)
    extents = json.loads(qemu_img("map", "--output=json", "-f", "raw", srv.uri).stdout)
    truth = seek_hole_extents(path)
    pos = 0
    for e in extents:
        assert e["start"] == pos, extents[:4]
        pos += e["length"]
        for off in range(e["start"], e["start"] + e["length"], 4096):
            assert is_hole_at(truth, off) == (not e["data"]), (e, off)
        if e["zero"]:
            assert model[e["start"]:e["start"] + e["length"]] == bytes(e["length"])
    assert pos == SIZE
