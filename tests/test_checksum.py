"""`rawdisk checksum` computes blkhash's value (what blksum and nbdcopy
--blkhash print): checked against a reference written here from the
definition with hashlib, on files, on NBD exports of rawdisk serve and of
nbdkit, and on a loop device; a changed byte anywhere changes it."""

import hashlib
import json
import os
import struct
import subprocess

import pytest

import servers
from helpers import KiB, MiB, random_bytes, write_target

BLOCK = 64 * KiB
GiB = 1 << 30


def blkhash(path, digest="sha256", block=BLOCK):
    """H(H(block 1) || ... || H(block N) || size as u64 little endian)."""
    outer = hashlib.new(digest)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(block)
            while b and len(b) < block:
                more = f.read(block - len(b))
                if not more:
                    break
                b += more
            if not b:
                break
            outer.update(hashlib.new(digest, b).digest())
            size += len(b)
    outer.update(struct.pack("<Q", size))
    return outer.hexdigest()


def rawdisk_checksum(target, *extra):
    res = subprocess.run([servers.RAWDISK_BIN, "checksum", *extra, target],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    digest, name = res.stdout.rstrip("\n").split("  ", 1)
    assert name == target
    return digest


def sparse_image(workdir, name, size, seed):
    """Scattered data (not block aligned), the rest holes, a partial last block."""
    path = os.path.join(workdir, name)
    with open(path, "wb") as f:
        f.truncate(size)
    offsets = [0, 3 * BLOCK + 17, 100 * MiB - 5, size // 3, size - 1000]
    for i, off in enumerate(o for o in offsets if o < size):
        n = min(50_000, size - off)
        write_target(path, random_bytes(n, seed + i), off)
    return path


@pytest.fixture
def nbd_server(workdir):
    """nbd_server(kind, path) starts rawdisk serve or nbdkit read-only."""
    started = []

    def start(kind, path):
        srv = servers.Server(workdir, path, kind=kind, read_only=True)
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        srv.terminate()
        assert srv.returncode == 0 or srv.kind != "rawdisk", srv.stderr()
        assert "panicked" not in srv.stderr()


SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1]


@pytest.mark.parametrize("size", SIZES)
def test_small_files_and_exports(workdir, nbd_server, size):
    path = os.path.join(workdir, f"s{size}.img")
    with open(path, "wb") as f:
        f.write(random_bytes(size, size))
    want = blkhash(path)
    assert rawdisk_checksum(path) == want
    for kind in ("rawdisk", "nbdkit"):
        srv = nbd_server(kind, path)
        assert rawdisk_checksum(srv.uri) == want, kind


def test_sparse_1g_file_and_exports(workdir, nbd_server):
    path = sparse_image(workdir, "sparse.img", GiB + 12345, seed=3)
    want = blkhash(path)
    assert rawdisk_checksum(path) == want
    for kind in ("rawdisk", "nbdkit"):
        srv = nbd_server(kind, path)
        assert rawdisk_checksum(srv.uri) == want, kind


@pytest.mark.parametrize("digest,name", [("sha1", "sha1"), ("md5", "md5"),
                                         ("blake2b512", "blake2b")])
def test_other_digests(workdir, digest, name):
    path = sparse_image(workdir, "d.img", 20 * MiB + 3, seed=4)
    assert rawdisk_checksum(path, "--digest", digest) == blkhash(path, name)
    assert rawdisk_checksum(path, "--block-size", "4K") == blkhash(path, block=4096)


def test_changed_byte_anywhere_changes_the_digest(workdir):
    size = 8 * MiB + 100
    path = sparse_image(workdir, "c.img", size, seed=5)
    base = rawdisk_checksum(path)
    assert base == blkhash(path)
    for off in [0, BLOCK - 1, BLOCK, 5 * MiB + 1, size - 1001, size - 1]:
        with open(path, "r+b") as f:
            f.seek(off)
            old = f.read(1)
            f.seek(off)
            f.write(bytes([old[0] ^ 0x80]))
        changed = rawdisk_checksum(path)
        assert changed != base, off
        assert changed == blkhash(path), off
        write_target(path, old, off)
    assert rawdisk_checksum(path) == base


def test_json_has_the_parameters(workdir):
    path = sparse_image(workdir, "j.img", 4 * MiB, seed=6)
    res = subprocess.run([servers.RAWDISK_BIN, "checksum", "--output", "json", path],
                         capture_output=True, text=True, check=True)
    j = json.loads(res.stdout)
    assert j["checksum"] == blkhash(path)
    assert (j["digest"], j["block-size"], j["virtual-size"], j["filename"]) == \
        ("sha256", BLOCK, 4 * MiB, path)
    assert j["bytes-read"] + j["bytes-skipped"] == 4 * MiB


@pytest.mark.parametrize("dev", ["loop512", "loop4096"])
def test_block_device(request, dev):
    dev = request.getfixturevalue(dev)
    write_target(dev, random_bytes(3 * MiB, 7), 5 * MiB + 4096)
    assert rawdisk_checksum(dev) == blkhash(dev)


def new_file(path, data):
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("digest", ["sha512", "sha384", "blake2s256", "sha3-256",
                                    "sha512-256", "SHA224"])
def test_any_digest_openssl_offers(workdir, digest):
    """blksum's names beyond the first four: blkhash's construction with
    the chosen digest, the model's from hashlib (OpenSSL's too)."""
    path = os.path.join(workdir, "d.img")
    new_file(path, random_bytes(3 * BLOCK + 777, 23))
    assert rawdisk_checksum(path, "--digest", digest) == blkhash(path, digest.lower())


def test_list_digests_names_each_one_that_works(workdir):
    r = subprocess.run([servers.RAWDISK_BIN, "checksum", "--list-digests"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    names = r.stdout.splitlines()
    for n in ["sha256", "sha512", "sha384", "blake2b512", "blake2s256", "sha1", "md5"]:
        assert n in names, names
    assert not any(n.startswith("shake") for n in names), names
    path = os.path.join(workdir, "l.img")
    new_file(path, random_bytes(BLOCK + 5, 24))
    for n in names:
        try:
            want = blkhash(path, n)
        except ValueError:
            continue  # a digest this Python's hashlib lacks
        assert rawdisk_checksum(path, "-d", n) == want, n
    bad = subprocess.run([servers.RAWDISK_BIN, "checksum", "-d", "shake128", path],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--list-digests" in bad.stderr, bad.stderr


def test_the_name_as_given_and_standard_input(workdir):
    """`./a.img` stays `./a.img`, as sha256sum and blksum print it; `-`
    reads standard input to its end (zeros, data and a short last block)."""
    path = os.path.join(workdir, "a.img")
    data = bytes(2 * BLOCK) + random_bytes(5 * MiB + 3, 25) + bytes(BLOCK)
    new_file(path, data)
    want = blkhash(path)
    r = subprocess.run([servers.RAWDISK_BIN, "checksum", "./a.img"], cwd=workdir,
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, f"{want}  ./a.img\n"), r.stderr
    for digest in ["sha256", "blake2b512"]:
        with open(path, "rb") as f:
            r = subprocess.run([servers.RAWDISK_BIN, "checksum", "-d", digest, "-"],
                               stdin=f, capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout) == (0, f"{blkhash(path, digest)}  -\n"), r.stderr
    cat = subprocess.Popen(["cat", path], stdout=subprocess.PIPE)
    r = subprocess.run([servers.RAWDISK_BIN, "checksum", "--output", "json", "-"],
                       stdin=cat.stdout, capture_output=True, text=True, timeout=60)
    cat.wait()
    j = json.loads(r.stdout)
    assert (j["checksum"], j["virtual-size"], j["filename"]) == (want, len(data), "-"), j
    r = subprocess.run([servers.RAWDISK_BIN, "checksum", "-"], input=b"",
                       capture_output=True, timeout=30)
    assert r.stdout.decode() == f"{blkhash(os.devnull)}  -\n"
