"""qemu's own NBD client drives single requests: `write -P`, `write -z`,
`write -z -u`, `discard`, `read -P` and aio reads and writes in flight
together. A Python model of the export tracks what every byte must be, and
the whole export and file are compared with it afterwards."""

import subprocess

import pytest

from helpers import KiB, MiB, allocated_bytes, assert_export_is, assert_target_is, make_image

SIZE = 16 * MiB


def qemu_io(uri, *commands, timeout=60):
    argv = ["qemu-io", "-f", "raw"]
    for c in commands:
        argv += ["-c", c]
    res = subprocess.run(argv + [uri], capture_output=True, text=True, timeout=timeout)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    for bad in ("Pattern verification failed", "failed:", "error"):
        assert bad not in out, out
    return out


@pytest.fixture
def export(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=11)
    return path, model, serve(path)


def test_write_pattern_then_read_pattern(export):
    path, model, srv = export
    qemu_io(srv.uri, "write -P 0xab 4096 65536", "write -P 0x5c 1048575 3")
    model[4096:4096 + 65536] = b"\xab" * 65536
    model[1048575:1048578] = b"\x5c" * 3
    qemu_io(srv.uri, "read -P 0xab 4096 65536", "read -P 0x5c 1048575 3")
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


def test_read_pattern_detects_a_mismatch(export):
    """The check above would be worthless if qemu-io accepted any data."""
    _, model, srv = export
    res = subprocess.run(["qemu-io", "-f", "raw", "-c", "read -P 0xab 0 4096", srv.uri],
                         capture_output=True, text=True, timeout=60)
    assert "Pattern verification failed" in res.stdout + res.stderr


def test_write_zeroes(export):
    path, model, srv = export
    qemu_io(srv.uri, "write -z 65536 1M", "write -z 3M 4097")
    model[65536:65536 + MiB] = bytes(MiB)
    model[3 * MiB:3 * MiB + 4097] = bytes(4097)
    qemu_io(srv.uri, "read -P 0 65536 1M")
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


def test_write_zeroes_may_unmap_frees_space(export):
    """`-u` sets may-trim: on a file system that punches holes (/tmp is ext4)
    the file's allocation must drop, and the range must read as zeros."""
    path, model, srv = export
    before = allocated_bytes(path)
    qemu_io(srv.uri, "write -z -u 2M 4M", "flush")
    model[2 * MiB:6 * MiB] = bytes(4 * MiB)
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)
    assert allocated_bytes(path) <= before - 3 * MiB


def test_discard_punches_a_hole(export):
    """TRIM on a regular file that supports PUNCH_HOLE: the range reads as
    zeros afterwards and no longer takes space; neighbours are untouched."""
    path, model, srv = export
    before = allocated_bytes(path)
    qemu_io(srv.uri, "discard 8M 2M", "flush")
    model[8 * MiB:10 * MiB] = bytes(2 * MiB)
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)
    assert allocated_bytes(path) <= before - MiB


def test_aio_writes_and_reads_in_flight(export):
    path, model, srv = export
    commands = []
    for i in range(32):
        off = i * 256 * KiB + 512
        pattern = 0x10 + i
        commands.append(f"aio_write -P {pattern:#x} {off} 100000")
        model[off:off + 100000] = bytes([pattern]) * 100000
    commands.append("aio_flush")
    for i in range(32):
        off = i * 256 * KiB + 512
        commands.append(f"aio_read -P {0x10 + i:#x} {off} 100000")
    commands.append("aio_flush")
    qemu_io(srv.uri, *commands)
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)
