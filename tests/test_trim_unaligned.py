"""TRIM not aligned to the advertised minimum block size, as qemu's NBD
client sends it (its block layer leaves unaligned discards to the device, and
turns an error into a guest I/O error: `mkfs.ext4 -E discard` fails). TRIM is
advisory: the server succeeds, under every cache mode and on every kind of
target; bytes inside the request read as their old data or zero, bytes
outside are unchanged. WRITE_ZEROES of unaligned ranges from the same client
still zeroes exactly. Needs root (tmpfs, file systems and loop devices)."""

import pytest

import storage
from helpers import (MiB, assert_export_is, assert_target_is, connected, fill_device,
                     make_image, read_export, read_target)
from test_qemu_io import qemu_io

# tmpfs with --cache none advertises 4096 bytes (O_DIRECT's alignment there);
# loop4096 4096 in both modes.
TARGETS = ["tmpfs_dir", "ext4_dir", "xfs_dir", "loop512", "loop4096"]
SIZE = 16 * MiB


@pytest.fixture
def target(request):
    where = request.getfixturevalue(request.param)
    if request.param.startswith("loop"):
        yield where, fill_device(where, seed=91)
        return
    with storage.scratch_dir_in(where) as d:
        yield make_image(d, "disk.img", SIZE, seed=91)


def check_trimmed(got, model, ranges, what):
    """Outside every range: the model exactly. Inside: each byte its old
    value or zero (which parts a trim zeroes is the storage's choice)."""
    assert len(got) == len(model), what
    inside = bytearray(len(model))
    for off, n in ranges:
        inside[off:off + n] = b"\x01" * n
    for i in range(0, len(model), MiB):
        g, m, w = got[i:i + MiB], model[i:i + MiB], inside[i:i + MiB]
        if g == m:
            continue
        for j in range(len(m)):
            if g[j] == m[j]:
                continue
            assert w[j], f"{what}: byte {i + j} outside the trims changed"
            assert g[j] == 0, f"{what}: byte {i + j} inside a trim is neither old nor zero"


@pytest.mark.parametrize("cache", ["writeback", "none"])
@pytest.mark.parametrize("target", TARGETS, indirect=True)
def test_unaligned_discard_succeeds_and_touches_nothing_else(target, cache, serve):
    path, model = target
    size = len(model)
    srv = serve(path, cache=cache)
    ranges = [(512, 512), (4097, 9000), (65536 + 1, 1), (size - 512, 512), (MiB, 3 * 4096)]
    qemu_io(srv.uri, *[f"discard {off} {n}" for off, n in ranges], "flush")
    for what, got in [("file", read_target(path)), ("export", export_bytes(srv.uri))]:
        check_trimmed(got, model, ranges, f"{cache} {what}")


def export_bytes(uri):
    with connected(uri, name="verify") as h:
        return read_export(h)


@pytest.mark.parametrize("target", TARGETS, indirect=True)
def test_unaligned_write_zeroes_under_cache_none_zeroes_exactly(target, serve):
    """qemu aligns WRITE_ZEROES to the advertised minimum itself (head and
    tail by read-modify-write): the zeroed bytes are exactly the request's."""
    path, model = target
    srv = serve(path, cache="none")
    zeroes = [(512, 512), (4097, 9000), (MiB - 1, 2), (len(model) - 700, 700)]
    qemu_io(srv.uri, *[f"write -z {off} {n}" for off, n in zeroes], "flush")
    for off, n in zeroes:
        model[off:off + n] = bytes(n)
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)
