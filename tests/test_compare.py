"""`rawdisk compare` on exports of the server under test gives what
`qemu-img compare` gives on the same exports: the same words and exit
status, identical or not, same size or not."""

import subprocess

import pytest

import servers
from helpers import MiB, make_image, write_target

SIZE = 24 * MiB + 4096


def ours(a, b, *extra):
    res = subprocess.run([servers.RAWDISK_BIN, "compare", *extra, a, b],
                         capture_output=True, text=True, timeout=120)
    assert res.stderr == "", res.stderr
    return res.returncode, res.stdout


def qemu(a, b, *extra):
    res = subprocess.run(["qemu-img", "compare", "-f", "raw", "-F", "raw", *extra, a, b],
                         capture_output=True, text=True, timeout=120)
    return res.returncode, res.stdout


@pytest.mark.parametrize("poke", [None, 0, 3 * MiB + 777, SIZE - 1])
def test_exports_compare_like_qemu_img(workdir, serve, poke):
    a, model = make_image(workdir, "a.img", SIZE, seed=91, sparse=True)
    b, _ = make_image(workdir, "b.img", SIZE, seed=91, sparse=True)
    if poke is not None:
        write_target(b, bytes([model[poke] ^ 1]), poke)
    sa = serve(a, read_only=True)
    sb = serve(b, read_only=True)
    got = ours(sa.uri, sb.uri)
    assert got == qemu(sa.uri, sb.uri)
    assert got[0] == (0 if poke is None else 1)
    # An export against a file.
    assert ours(sa.uri, b) == got


def test_longer_export_with_data_in_its_tail(workdir, serve):
    a, _ = make_image(workdir, "a.img", SIZE, seed=92, sparse=True)
    b, model = make_image(workdir, "b.img", SIZE + 3 * MiB, seed=92, sparse=True)
    write_target(b, bytes(3 * MiB), SIZE)
    write_target(b, bytes(SIZE), 0)
    write_target(a, bytes(SIZE), 0)
    sa, sb = serve(a, read_only=True), serve(b, read_only=True)
    got = ours(sa.uri, sb.uri)
    assert got == qemu(sa.uri, sb.uri) == (0, "Warning: Image size mismatch!\nImages are identical.\n")
    write_target(b, b"\x01", SIZE + 2 * MiB + 9)
    got = ours(sa.uri, sb.uri)
    assert got == qemu(sa.uri, sb.uri)
    assert got[0] == 1
    assert ours(sa.uri, sb.uri, "-s") == (1, "Strict mode: Image size mismatch!\n")
