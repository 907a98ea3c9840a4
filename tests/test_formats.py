"""Another image format is never taken for raw without being told
(docs/formats.md): images qemu-img makes (and the few it cannot, crafted)
are reported by `info` and refused by copy, checksum, compare, map and
serve with one line; `-f raw` reads their bytes as raw; raw images of zeros
or random data are never refused. Local files, a loop device and an NBD
source."""

import json
import os
import subprocess
import urllib.parse

import nbd
import pytest

import servers
import storage
from conftest import require_root
from helpers import connected, random_bytes, read_export, read_target

pytestmark = pytest.mark.rawdisk_only("rawdisk's format rule")

MiB = 1 << 20

# (file name, qemu-img create arguments, what it looks like)
MADE = [
    ("a.qcow2", ["-f", "qcow2"], "qcow2"),
    ("a.qcow", ["-f", "qcow"], "qcow"),
    ("a.qed", ["-f", "qed"], "qed"),
    ("sparse.vmdk", ["-f", "vmdk"], "vmdk"),
    ("flat.vmdk", ["-f", "vmdk", "-o", "subformat=monolithicFlat"], "vmdk"),
    ("a.vhdx", ["-f", "vhdx"], "vhdx"),
    ("dynamic.vhd", ["-f", "vpc"], "vpc"),
    # Only a footer in the last 512 bytes: the tail is what shows it.
    ("fixed.vhd", ["-f", "vpc", "-o", "subformat=fixed"], "vpc"),
    ("a.vdi", ["-f", "vdi"], "vdi"),
    ("a.luks", ["-f", "luks", "--object", "secret,id=s0,data=pw", "-o", "key-secret=s0"],
     "luks"),
    ("a.parallels", ["-f", "parallels"], "parallels"),
]

REFUSAL = "looks like a {} image, not raw: convert it first (qemu-img convert -O raw), " \
          "or pass -f raw to read its bytes as raw anyway"


def rawdisk(*argv, timeout=60):
    return subprocess.run([servers.RAWDISK_BIN, *argv], capture_output=True, text=True,
                          timeout=timeout)


def qemu_img_create(workdir, name, args, size="2M"):
    path = os.path.join(workdir, name)
    subprocess.run(["qemu-img", "create", "-q", *args, path, size], check=True,
                   capture_output=True)
    return path


def assert_refused(res, name, fmt, status=1):
    assert res.returncode == status, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"{name} {REFUSAL.format(fmt)}" in lines[0], lines[0]
    assert res.stdout == "", res.stdout


def crafted(workdir, name, head=b"", tail=b"", size=MiB):
    """A file of `size` bytes of random data with `head` at 0 and `tail` at
    the start of its last 512 bytes: the formats qemu-img cannot create."""
    data = bytearray(random_bytes(size, seed=len(name)))
    data[:len(head)] = head
    if tail:
        data[size - 512:size - 512 + len(tail)] = tail
    path = os.path.join(workdir, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def crafted_images(workdir):
    cloop = b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n"
    bochs = bytearray(512)
    bochs[:22] = b"Bochs Virtual HD Image"
    bochs[32:39] = b"Redolog"
    bochs[48:55] = b"Growing"
    koly = b"koly" + (4).to_bytes(4, "big") + (512).to_bytes(4, "big")
    return [
        (crafted(workdir, "a.bochs", head=bytes(bochs)), "bochs"),
        (crafted(workdir, "a.cloop", head=cloop), "cloop"),
        (crafted(workdir, "a.dmg", tail=koly), "dmg"),
        (crafted(workdir, "cowd.vmdk", head=b"COWD"), "vmdk"),
    ]


def check_local(workdir, path, fmt):
    """info reports it; every reader refuses it; -f raw reads its bytes."""
    name = os.path.basename(path)
    before = read_target(path)
    human = rawdisk("info", path)
    assert human.returncode == 0, human.stderr
    assert "file format: raw\nlooks-like: %s\n" % fmt in human.stdout, human.stdout
    js = rawdisk("info", "--output", "json", path)
    assert json.loads(js.stdout)["looks-like"] == fmt
    assert json.loads(js.stdout)["format"] == "raw"

    out = os.path.join(workdir, "out-" + name)
    assert_refused(rawdisk("copy", path, out), path, fmt)
    assert not os.path.exists(out), "a refused copy created its destination"
    assert_refused(rawdisk("checksum", path), path, fmt)
    assert_refused(rawdisk("map", path), path, fmt)
    assert_refused(rawdisk("map", "--output", "json", path), path, fmt)

    # -f raw: the bytes, exactly.
    res = rawdisk("copy", "-f", "raw", path, out)
    assert res.returncode == 0, res.stderr
    assert read_target(out) == before
    # compare: 2 is its error status (1 means "different"); -f names the
    # first image, -F the second, and the copy looks the same.
    assert_refused(rawdisk("compare", path, out), path, fmt, status=2)
    assert_refused(rawdisk("compare", "-f", "raw", path, out), out, fmt, status=2)
    res = rawdisk("compare", "-f", "raw", "-F", "raw", path, out)
    assert (res.returncode, res.stdout) == (0, "Images are identical.\n"), res
    a = rawdisk("checksum", "-f", "raw", path)
    b = rawdisk("checksum", "--format", "raw", out)
    assert a.returncode == 0 and b.returncode == 0, (a, b)
    assert a.stdout.split()[0] == b.stdout.split()[0], (a.stdout, b.stdout)
    m = rawdisk("map", "-f", "raw", "--output", "json", path)
    assert m.returncode == 0, m.stderr
    assert sum(e["length"] for e in json.loads(m.stdout)) == len(before)
    assert read_target(path) == before, "a reader changed the image"
    os.unlink(out)


@pytest.mark.parametrize("name,args,fmt", MADE, ids=[m[0] for m in MADE])
def test_images_qemu_img_makes_are_refused_unless_raw(workdir, name, args, fmt):
    path = qemu_img_create(workdir, name, args)
    check_local(workdir, path, fmt)


def test_crafted_headers_and_trailers(workdir):
    for path, fmt in crafted_images(workdir):
        check_local(workdir, path, fmt)


def test_raw_zeros_and_random_data_are_not_refused(workdir):
    sparse = os.path.join(workdir, "sparse.img")
    with open(sparse, "wb") as f:
        f.truncate(4 * MiB)
    written = os.path.join(workdir, "zeros.img")
    with open(written, "wb") as f:
        f.write(bytes(4 * MiB))
    rnd = os.path.join(workdir, "random.img")
    with open(rnd, "wb") as f:
        f.write(random_bytes(4 * MiB, seed=27))
    tiny = os.path.join(workdir, "tiny.img")
    with open(tiny, "wb") as f:
        f.write(b"QFI")
    for path in (sparse, written, rnd, tiny):
        before = read_target(path)
        i = rawdisk("info", "--output", "json", path)
        assert i.returncode == 0 and "looks-like" not in json.loads(i.stdout), i
        out = path + ".copy"
        for argv in (["copy", path, out], ["checksum", path], ["map", path],
                     ["compare", path, out]):
            res = rawdisk(*argv)
            assert res.returncode == 0, (argv, res.stderr)
        assert read_target(out) == before
        assert read_target(path) == before


def test_resize_refuses_a_fixed_vhd_unless_raw(workdir):
    # The old check looked at offset 0 only; a fixed VHD shows at the end.
    path = qemu_img_create(workdir, "fixed.vhd", ["-f", "vpc", "-o", "subformat=fixed"])
    before = read_target(path)
    res = rawdisk("resize", path, "+1M")
    assert res.returncode == 1 and "looks like a vpc image" in res.stderr, res
    assert read_target(path) == before
    res = rawdisk("resize", "-f", "raw", path, "+1M")
    assert res.returncode == 0, res.stderr
    after = read_target(path)
    assert after[:len(before)] == before and after[len(before):] == bytes(MiB)


@pytest.mark.parametrize("cmd", [["copy"], ["checksum"], ["compare"], ["map"], ["info"],
                                 ["resize"], ["serve"]])
def test_format_other_than_raw_is_a_usage_error(workdir, cmd):
    argv = cmd + ["-f", "qcow2", "x.img"]
    if cmd[0] in ("copy", "compare", "resize"):
        argv.append("1M")
    res = rawdisk(*argv)
    assert res.returncode == 2, res
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "'qcow2'" in res.stderr and "raw" in res.stderr, res.stderr


def test_serve_refuses_a_qcow2_target_unless_raw(workdir, serve):
    path = qemu_img_create(workdir, "a.qcow2", ["-f", "qcow2"])
    before = read_target(path)
    sock = os.path.join(workdir, "q.sock")
    res = rawdisk("serve", "--socket", sock, path, timeout=30)
    assert_refused(res, path, "qcow2")
    assert not os.path.exists(sock)
    srv = serve(path, extra=("-f", "raw"))
    with connected(srv.uri) as h:
        assert read_export(h) == before


def test_serve_dir_refuses_such_exports_at_go(workdir, serve):
    d = os.path.join(workdir, "exports")
    os.mkdir(d)
    q = qemu_img_create(d, "a.qcow2", ["-f", "qcow2"])
    plain = os.path.join(d, "plain.img")
    with open(plain, "wb") as f:
        f.write(random_bytes(MiB, seed=5))

    def uri(srv, name):
        return "nbd+unix:///%s?socket=%s" % (urllib.parse.quote(name), srv.sock)

    srv = serve(d, extra=("--dir",))
    with pytest.raises(nbd.Error) as refused:
        with connected(uri(srv, "a.qcow2")):
            pass
    # A policy refusal (NBD_REP_ERR_POLICY), not an unknown export.
    assert "server policy prevents" in str(refused.value), refused.value
    # libnbd does not show the server's message; rawdisk's client does.
    res = rawdisk("info", uri(srv, "a.qcow2"))
    assert res.returncode == 1, res
    why = '"a.qcow2" looks like a qcow2 image, not raw: ' \
          'the server exports it only when started with -f raw'
    assert why in res.stderr, res.stderr
    assert why in srv.stderr(), srv.stderr()
    assert "(not served)" in srv.stderr() and "unknown export" not in srv.stderr()
    with connected(uri(srv, "plain.img")) as h:
        assert read_export(h) == read_target(plain)
    srv2 = serve(d, extra=("-f", "raw", "--dir"))
    with connected(uri(srv2, "a.qcow2")) as h:
        assert read_export(h) == read_target(q)


def test_nbd_source(workdir, serve):
    """The check reads an NBD export's first and last bytes through the
    client: a qcow2 file and a fixed VHD (footer only) served as raw."""
    for name, args, fmt in (("a.qcow2", ["-f", "qcow2"], "qcow2"),
                            ("fixed.vhd", ["-f", "vpc", "-o", "subformat=fixed"], "vpc")):
        path = qemu_img_create(workdir, name, args)
        before = read_target(path)
        srv = serve(path, read_only=True, extra=("-f", "raw"))
        uri = srv.uri
        i = rawdisk("info", "--output", "json", uri)
        assert json.loads(i.stdout)["exports"][0]["looks-like"] == fmt, i
        out = os.path.join(workdir, "out-" + name)
        assert_refused(rawdisk("copy", uri, out), uri, fmt)
        assert not os.path.exists(out)
        assert_refused(rawdisk("checksum", uri), uri, fmt)
        assert_refused(rawdisk("map", uri), uri, fmt)
        assert_refused(rawdisk("compare", uri, path, "-F", "raw"), uri, fmt, status=2)
        res = rawdisk("copy", "-f", "raw", uri, out)
        assert res.returncode == 0, res.stderr
        assert read_target(out) == before
        res = rawdisk("compare", "-f", "raw", "-F", "raw", uri, path)
        assert res.returncode == 0, res


def test_loop_device_holding_a_qcow2(workdir):
    require_root()
    path = qemu_img_create(workdir, "a.qcow2", ["-f", "qcow2"], size="4M")
    # A loop device ends at a sector boundary: pad the file to one.
    size = os.path.getsize(path)
    os.truncate(path, (size + 511) // 512 * 512)
    before = read_target(path)
    with storage.loop_device(path, direct_io=False) as dev:
        check_local(workdir, dev, "qcow2")
    assert read_target(path) == before
