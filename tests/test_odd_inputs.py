"""Inputs that are not disk images: every command refuses a FIFO (either
side of `compare`, the source of `copy`, `serve`, `checkpoint`) at once with
one line naming what it is, instead of hanging in open(); `checkpoint list`
fails on a FIFO or a state directory that does not exist instead of listing
nothing; `compare` of two sparse files of 2^63-1 bytes follows their
extents, not their size (docs/inputs.md)."""

import os
import subprocess

import pytest

import servers
from helpers import write_target

BIG = (1 << 63) - 1


def rawdisk(*args, timeout=10):
    """Run rawdisk; a hang fails the test (TimeoutExpired) within `timeout`."""
    return subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                          timeout=timeout)


def one_line(res, status, *words):
    assert res.returncode == status, (res.returncode, res.stderr)
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("rawdisk: "), res.stderr
    for w in words:
        assert w in res.stderr, f"{w!r} not in {res.stderr!r}"


@pytest.fixture
def fifo(workdir):
    path = os.path.join(workdir, "pipe")
    os.mkfifo(path)
    image = os.path.join(workdir, "a.img")
    with open(image, "wb") as f:
        f.truncate(1 << 20)
    return path, image


COMMANDS = {
    "info": lambda f, img, d: ["info", f],
    "map": lambda f, img, d: ["map", f],
    "checksum": lambda f, img, d: ["checksum", f],
    "compare-first": lambda f, img, d: ["compare", f, img],
    "compare-second": lambda f, img, d: ["compare", img, f],
    "copy-source": lambda f, img, d: ["copy", f, os.path.join(d, "out.img")],
    "checkpoint-create": lambda f, img, d: ["checkpoint", "create", f],
    "checkpoint-list": lambda f, img, d: ["checkpoint", "list", f],
    "serve": lambda f, img, d: ["serve", "--socket", os.path.join(d, "s.sock"), f],
}
STATUS = {"compare-first": 2, "compare-second": 2}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_fifo_is_refused_at_once(workdir, fifo, command):
    path, image = fifo
    before = sorted(os.listdir(workdir))
    res = rawdisk(*COMMANDS[command](path, image, workdir), timeout=5)
    one_line(res, STATUS.get(command, 1), "pipe", "is a FIFO, not a regular file or block device")
    # Nothing made or changed: no output file, no state file, no socket.
    assert sorted(os.listdir(workdir)) == before
    assert os.stat(image).st_size == 1 << 20


def test_checkpoint_list_of_a_missing_state_dir_fails(workdir, fifo):
    _, image = fifo
    missing = os.path.join(workdir, "no-such-dir")
    res = rawdisk("checkpoint", "list", "--state-dir", missing, image)
    one_line(res, 1, missing, "does not exist")
    # A target never tracked, in a directory that exists, lists nothing.
    res = rawdisk("checkpoint", "list", "--state-dir", workdir, image)
    assert res.returncode == 0 and res.stdout == "" and res.stderr == "", res


def test_compare_of_huge_sparse_files_follows_the_extents(tmpfs_dir):
    a, b = os.path.join(tmpfs_dir, "a.img"), os.path.join(tmpfs_dir, "b.img")
    for p in (a, b):
        with open(p, "wb") as f:
            f.truncate(BIG)
    res = rawdisk("compare", a, b, timeout=20)
    assert (res.returncode, res.stdout, res.stderr) == (0, "Images are identical.\n", ""), res
    far = (1 << 62) + 12345 * 512 + 320
    write_target(b, b"Z", far)
    for x, y in ((a, b), (b, a)):
        res = rawdisk("compare", x, y, timeout=20)
        # The offset of the sector holding the difference, as qemu-img says.
        want = f"Content mismatch at offset {far - far % 512}!\n"
        assert (res.returncode, res.stdout, res.stderr) == (1, want, ""), res
    assert os.path.getsize(a) == BIG and os.path.getsize(b) == BIG
    with open(b, "rb") as f:
        f.seek(far - 1)
        assert f.read(3) == b"\0Z\0"
