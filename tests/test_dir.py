"""serve --dir: every regular file and block device in a directory, one
process, each an export named by its file name (nbdkit's file plugin with
dir=). Listing, concurrent clients on many exports, hostile names, files
added and deleted while served, the default export, socket activation."""

import json
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.parse

import nbd
import pytest

import servers
from helpers import assert_target_is, make_image, random_bytes
from wire import (CMD_FLUSH, CMD_READ, CMD_WRITE, OPT_GO, OPT_INFO, OPT_LIST, REP_ACK, REP_ERR,
                  REP_SERVER, RawClient)

pytestmark = pytest.mark.rawdisk_only("rawdisk serve --dir")

MiB = 1 << 20
REP_ERR_UNKNOWN = REP_ERR | 6


def uri_for(srv, name):
    return "nbd+unix:///%s?socket=%s" % (urllib.parse.quote(name, safe=""), srv.sock)


def serve_dir(serve, d, *extra):
    return serve(d, extra=tuple(extra) + ("--dir",))


def listed(srv):
    out = subprocess.run(["nbdinfo", "--list", "--json", uri_for(srv, "")],
                         check=True, capture_output=True, text=True).stdout
    return {e["export-name"]: e["export-size"] for e in json.loads(out)["exports"]}


def raw(srv):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(srv.sock)
    return RawClient(s).start()


def go_reply(c, name):
    """NBD_OPT_GO for `name` (bytes); the final reply type and payload."""
    data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    c.send_option(OPT_GO, data)
    while True:
        _, rtype, payload = c.read_option_reply()
        if rtype == REP_ACK or rtype & REP_ERR:
            return rtype, payload


def go_reply_info(c, name):
    """NBD_OPT_INFO for `name` (bytes); the final reply type."""
    c.send_option(OPT_INFO, struct.pack(">I", len(name)) + name + struct.pack(">H", 0))
    while True:
        _, rtype, _ = c.read_option_reply()
        if rtype == REP_ACK or rtype & REP_ERR:
            return rtype


def test_twenty_exports_listed_and_written_at_once(workdir, serve):
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    models = {}
    for i in range(20):
        name = "disk%02d.img" % i
        size = (i % 4 + 1) * MiB
        _, models[name] = make_image(d, name, size, seed=100 + i)
    # Not exports: a subdirectory, a socket-like oddity, a symlink out.
    os.mkdir(os.path.join(d, "subdir"))
    os.symlink("/etc/passwd", os.path.join(d, "outside"))
    srv = serve_dir(serve, d)
    assert listed(srv) == {n: len(m) for n, m in models.items()}

    errors = []

    def client(name):
        try:
            model = bytearray(models[name])
            rng = random.Random(name)
            h = nbd.NBD()
            h.connect_uri(uri_for(srv, name))
            assert h.get_size() == len(model)
            for k in range(20):
                off = rng.randrange(0, len(model) - 65536)
                n = rng.randrange(1, 65536)
                if k % 5 == 4:
                    h.zero(n, off)
                    data = bytes(n)
                else:
                    data = random_bytes(n, rng.randrange(1 << 30))
                    h.pwrite(data, off)
                model[off:off + n] = data
            h.flush()
            got = h.pread(len(model), 0)
            if got != model:
                errors.append(f"{name}: read back differs")
            h.shutdown()
            models[name] = bytes(model)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(f"{name}: {e}")

    threads = [threading.Thread(target=client, args=(n,)) for n in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    srv.terminate()
    for name, model in models.items():
        assert_target_is(os.path.join(d, name), model, name)


@pytest.mark.parametrize("name", [
    b"../etc/passwd", b"/etc/passwd", b"subdir/../a.img", b"..", b".", b"outside",
    b"subdir", b"missing.img", b"a" * 5000, b"\xff\xfe.img", b"a.img\x00x",
], ids=lambda n: repr(n[:24]))
def test_hostile_and_unknown_names_are_refused(workdir, serve, name):
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    _, model = make_image(d, "a.img", MiB, seed=1)
    os.mkdir(os.path.join(d, "subdir"))
    os.symlink("/etc/passwd", os.path.join(d, "outside"))
    srv = serve_dir(serve, d)
    c = raw(srv)
    rtype, payload = go_reply(c, name)
    # Unknown names: NBD_REP_ERR_UNKNOWN; names that are not valid UTF-8
    # or hold a NUL do not even parse (NBD_REP_ERR_INVALID).
    assert rtype & REP_ERR, (name, rtype)
    assert len(payload) < 1024
    # The connection stays usable: the right name still works.
    rtype, _ = go_reply(c, b"a.img")
    assert rtype == REP_ACK
    c.sock.close()
    # Names that parse are refused with a log line; the rest (not UTF-8, a
    # NUL, over the spec's 4096 bytes) never reach the export lookup.
    parses = len(name) <= 4096 and b"\xff" not in name and b"\x00" not in name
    assert ("refused NBD_OPT_GO" in srv.stderr()) == parses, srv.stderr()
    assert_target_is(os.path.join(d, "a.img"), model)


def test_symlink_inside_is_served_and_outside_refused(workdir, serve):
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    path, model = make_image(d, "real.img", MiB, seed=7)
    out_path, out_model = make_image(workdir, "outside.img", MiB, seed=8)
    os.symlink("real.img", os.path.join(d, "link.img"))
    os.symlink(out_path, os.path.join(d, "out.img"))
    srv = serve_dir(serve, d)
    assert listed(srv) == {"real.img": MiB, "link.img": MiB}
    h = nbd.NBD()
    h.connect_uri(uri_for(srv, "link.img"))
    assert h.pread(MiB, 0) == model
    h.pwrite(b"\xa5" * 4096, 8192)
    h.flush()
    h.shutdown()
    model[8192:12288] = b"\xa5" * 4096
    c = raw(srv)
    rtype, payload = go_reply(c, b"out.img")
    assert rtype == REP_ERR_UNKNOWN, (rtype, payload)
    assert b"leads outside the exported directory" in payload
    c.sock.close()
    srv.terminate()
    assert_target_is(path, model)
    assert_target_is(out_path, out_model)


def test_a_parent_swapped_after_start_shows_nothing_outside(workdir, serve):
    """The directory's parent is renamed away and a symlink to another
    directory put in its place: the listing and the exports are still the
    directory opened at start (read through its fd), never the other."""
    parent = os.path.join(workdir, "p")
    d = os.path.join(parent, "disks")
    os.makedirs(d)
    _, model = make_image(d, "a.img", MiB, seed=5)
    other = os.path.join(workdir, "other", "disks")
    os.makedirs(other)
    make_image(other, "a.img", MiB, seed=6)
    make_image(other, "evil.img", MiB, seed=7)
    srv = serve_dir(serve, d)
    os.rename(parent, os.path.join(workdir, "p-moved"))
    os.symlink(os.path.join(workdir, "other"), parent)
    assert listed(srv) == {"a.img": MiB}
    c = raw(srv)
    assert go_reply(c, b"evil.img")[0] == REP_ERR_UNKNOWN
    c = raw(srv).go(b"a.img")
    assert c.request(CMD_READ, 0, 4096) == (0, bytes(model[:4096]))
    c.disconnect()


def test_swapped_symlink_never_opens_outside(workdir, serve):
    """A writer of the directory flips `x` between a file inside and a
    symlink to a file outside while clients open `x` and read, write and
    flush: the name is checked and then opened, and nothing opened may be
    the outside file. Bounded by time, not by a count."""
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    size = 64 * 1024
    inside = os.path.join(d, "inside.img")
    with open(inside, "wb") as f:
        f.write(b"I" * size)
    out_model = b"OUTSIDE!" * (size // 8)
    outside = os.path.join(workdir, "outside.img")
    with open(outside, "wb") as f:
        f.write(out_model)
    x = os.path.join(d, "x")
    os.link(inside, x)
    srv = serve_dir(serve, d)
    stop = threading.Event()
    swaps = [0]
    opened = [0]
    leaks = []
    errors = []

    def swapper():
        # Odd k: a symlink out; even k: a hard link of the file inside
        # (starting with the symlink, as x is that file now).
        k = 1
        try:
            while not stop.is_set():
                tmp = os.path.join(d, "tmp%d" % (k % 2))
                if k % 2:
                    os.symlink(outside, tmp)
                else:
                    os.link(inside, tmp)
                os.rename(tmp, x)
                k += 1
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(repr(e))
        swaps[0] = k - 1

    def client():
        while not stop.is_set():
            try:
                c = raw(srv)
                rtype, _ = go_reply(c, b"x")
                if rtype != REP_ACK:
                    c.close()
                    continue
                opened[0] += 1
                c.send_request(CMD_READ, 0, 4096)
                _, err, data = c.read_simple_reply(4096)
                if err == 0 and data != b"I" * 4096:
                    leaks.append(data[:16])
                c.request(CMD_WRITE, 4096, 8, payload=b"I" * 8)
                c.request(CMD_FLUSH)
                c.disconnect()
            except Exception as e:  # noqa: BLE001 -- reported below
                errors.append(repr(e))
                return

    threads = [threading.Thread(target=swapper)]
    threads += [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    stop.wait(4)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors[:5]
    # The race was run: the name flipped and clients opened it many times.
    assert swaps[0] > 100 and opened[0] > 50, (swaps, opened)
    assert not leaks, "%d reads returned the outside file: %r" % (len(leaks), leaks[:3])
    with open(outside, "rb") as f:
        assert f.read() == out_model, "the outside file was written"
    srv.terminate()
    assert_target_is(inside, b"I" * size)


def test_listers_read_ten_thousand_exports(workdir, serve):
    """nbdinfo --list and qemu-nbd -L ask about every listed export on one
    connection (an INFO and meta context queries each): the bound on
    options before transmission must let them, within the handshake
    timeout."""
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    sizes = {}
    for i in range(10000):
        name = "disk%05d.img" % i
        sizes[name] = 4096 * (1 + i % 3)
        with open(os.path.join(d, name), "wb") as f:
            f.truncate(sizes[name])
    srv = serve_dir(serve, d)
    assert listed(srv) == sizes
    out = subprocess.run(["qemu-nbd", "-L", "-k", srv.sock], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("exports available: 10000\n"), out[:200]
    got = re.findall(r"^ export: '(.*)'\n  size:  (\d+)$", out, re.M)
    assert got == sorted((n, str(sz)) for n, sz in sizes.items()), (len(got), out[-500:])


def test_a_listing_lengthens_the_handshake_deadline(workdir, serve):
    """A client earns 10 ms of handshake time per query it sends about the
    names NBD_OPT_LIST told it (so a lister can ask about each export on a
    loaded machine); one that lists and then idles is closed on time."""
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    for i in range(300):
        with open(os.path.join(d, "d%03d.img" % i), "wb") as f:
            f.truncate(4096)
    srv = serve_dir(serve, d, "--handshake-timeout", "0.5")

    def listing():
        c = raw(srv)
        c.send_option(OPT_LIST)
        n = 0
        while c.read_option_reply()[1] == REP_SERVER:
            n += 1
        assert n == 300
        return c

    def closed(c, within):
        c.sock.settimeout(within)
        try:
            return c.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False

    # Asks about each name, 3 ms apart: about 1 s in all, past the 0.5 s
    # timeout, while each query earns 10 ms more.
    lister = listing()
    t0 = time.monotonic()
    for i in range(300):
        assert go_reply_info(lister, b"d%03d.img" % i) == REP_ACK
        time.sleep(0.003)
    assert time.monotonic() - t0 > 0.5
    assert go_reply(lister, b"d299.img")[0] == REP_ACK
    # One that listed and then sent nothing has earned nothing: closed at
    # 0.5 s, long before the 3.5 s a grant at the LIST would have given.
    idle = listing()
    time.sleep(1.0)
    assert closed(idle, 0.5)


def test_list_over_the_wire(workdir, serve):
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    for n in ["b.img", "a.img", "c.raw"]:
        make_image(d, n, MiB, seed=2)
    srv = serve_dir(serve, d)
    c = raw(srv)
    c.send_option(OPT_LIST)
    names = []
    while True:
        _, rtype, payload = c.read_option_reply()
        if rtype == REP_ACK:
            break
        assert rtype == REP_SERVER
        (n,) = struct.unpack(">I", payload[:4])
        names.append(payload[4:4 + n].decode())
    assert names == ["a.img", "b.img", "c.raw"]


def test_files_added_and_deleted_while_served(workdir, serve):
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    _, model = make_image(d, "a.img", 2 * MiB, seed=3)
    srv = serve_dir(serve, d)
    h = nbd.NBD()
    h.connect_uri(uri_for(srv, "a.img"))
    os.unlink(os.path.join(d, "a.img"))
    # The open connection keeps working on the open file.
    h.pwrite(b"\x5a" * 4096, 4096)
    h.flush()
    model = model[:4096] + b"\x5a" * 4096 + model[8192:]
    assert h.pread(len(model), 0) == model
    # A new connection does not find it; a new file is seen at once.
    assert listed(srv) == {}
    with pytest.raises(nbd.Error):
        nbd.NBD().connect_uri(uri_for(srv, "a.img"))
    _, model_b = make_image(d, "b.img", MiB, seed=4)
    assert listed(srv) == {"b.img": MiB}
    h2 = nbd.NBD()
    h2.connect_uri(uri_for(srv, "b.img"))
    assert h2.pread(MiB, 0) == model_b
    h2.shutdown()
    h.shutdown()


def test_default_export(workdir, serve):
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    _, model = make_image(d, "vm.img", MiB, seed=5)
    srv = serve_dir(serve, d)
    c = raw(srv)
    rtype, payload = go_reply(c, b"")
    assert rtype == REP_ERR_UNKNOWN
    assert b"pick an export by name" in payload
    c.sock.close()
    srv2 = serve_dir(serve, d, "--default-export", "vm.img")
    h = nbd.NBD()
    h.connect_uri(uri_for(srv2, ""))
    assert h.pread(MiB, 0) == model
    h.shutdown()


def test_read_only_file_is_exported_read_only(workdir, serve):
    """A file the server may only read is exported read-only. Mode 0444
    stops a user; root is stopped by the immutable attribute instead."""
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    path, model = make_image(d, "ro.img", MiB, seed=6)
    os.chmod(path, 0o444)
    immutable = os.geteuid() == 0
    if immutable:
        r = subprocess.run(["chattr", "+i", path], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"needs chattr +i on the test's file system: {r.stderr.strip()}")
    try:
        srv = serve_dir(serve, d)
        h = nbd.NBD()
        h.connect_uri(uri_for(srv, "ro.img"))
        assert h.is_read_only()
        assert h.pread(MiB, 0) == model
        h.shutdown()
        srv.terminate()
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", path], check=True)
    assert_target_is(path, model)


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None,
                    reason="needs systemd-socket-activate")
def test_socket_activated_dir_service(workdir):
    """systemd-socket-activate passes the listener as fd 3; --dir serves
    every file of the directory through it."""
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    _, model_a = make_image(d, "a.img", MiB, seed=7)
    _, model_b = make_image(d, "b.img", 2 * MiB, seed=8)
    sock = os.path.join(workdir, "act.sock")
    proc = subprocess.Popen(
        ["systemd-socket-activate", "-l", sock, servers.RAWDISK_BIN, "serve", "--dir", d],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = 100
        while not os.path.exists(sock) and deadline:
            deadline -= 1
            threading.Event().wait(0.05)
        for name, model in [("a.img", model_a), ("b.img", model_b)]:
            h = nbd.NBD()
            h.connect_uri("nbd+unix:///%s?socket=%s" % (name, sock))
            assert h.pread(len(model), 0) == model
            h.pwrite(b"\x33" * 512, 0)
            h.flush()
            h.shutdown()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()
    assert_target_is(os.path.join(d, "a.img"), b"\x33" * 512 + model_a[512:])
    assert_target_is(os.path.join(d, "b.img"), b"\x33" * 512 + model_b[512:])


def test_rawdisk_commands_against_a_dir_server(workdir, serve):
    """info --list names every export; info, map, checksum and copy reach
    one by name (nbd+unix:///NAME?socket=...)."""
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    _, model_a = make_image(d, "a.img", 2 * MiB, seed=9)
    make_image(d, "b.img", MiB, seed=10, sparse=True)
    srv = serve_dir(serve, d)

    def rawdisk(*args):
        return subprocess.run([servers.RAWDISK_BIN, *args], check=True,
                              capture_output=True, text=True).stdout

    listing = json.loads(rawdisk("info", "--list", "--output", "json", uri_for(srv, "")))
    assert {e["export-name"]: e["export-size"] for e in listing["exports"]} == {
        "a.img": 2 * MiB, "b.img": MiB}
    info = json.loads(rawdisk("info", "--output", "json", uri_for(srv, "b.img")))
    assert info["exports"][0]["export-size"] == MiB
    extents = json.loads(rawdisk("map", "--output", "json", uri_for(srv, "b.img")))
    assert sum(e["length"] for e in extents) == MiB
    # An export by name to a file, and a file into an export by name.
    out = os.path.join(workdir, "a-copy.img")
    rawdisk("copy", uri_for(srv, "a.img"), out)
    assert_target_is(out, model_a)
    src = os.path.join(workdir, "b-new.img")
    with open(src, "wb") as f:
        f.write(random_bytes(MiB, 11))
    rawdisk("copy", src, uri_for(srv, "b.img"))
    with open(src, "rb") as f:
        new_b = f.read()
    srv.terminate()
    assert_target_is(os.path.join(d, "b.img"), new_b, "b.img")
    assert_target_is(os.path.join(d, "a.img"), model_a, "a.img")


@pytest.mark.parametrize("args,code,says", [
    (["--dir", "DIR", "--create", "1G"], 2, "cannot be used with"),
    (["--dir", "DIR", "-e", "x"], 2, "cannot be used with"),
    (["--default-export", "a", "FILE"], 2, "cannot be used with"),
    (["--dir", "MISSING"], 1, "cannot serve directory 'MISSING': No such file or directory"),
    (["--dir", "FILE"], 1, "cannot serve directory 'FILE': Not a directory"),
])
def test_dir_usage_errors(workdir, args, code, says):
    d = os.path.join(workdir, "disks")
    os.mkdir(d)
    path, _ = make_image(workdir, "f.img", MiB)
    subst = {"DIR": d, "FILE": path, "MISSING": os.path.join(workdir, "missing")}
    argv = [subst.get(a, a) for a in args]
    r = subprocess.run([servers.RAWDISK_BIN, "serve", "--socket", os.path.join(workdir, "s.sock"),
                        *argv], capture_output=True, text=True, timeout=30)
    for k, v in subst.items():
        says = says.replace(k, v)
    assert r.returncode == code, r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_directory_of_mixed_files_lists_with_any_tool(workdir, serve):
    """nbdinfo --list and qemu-nbd -L open every export the list names and
    stop at a refusal: what GO would refuse (another image format, a file
    that cannot be read) is left out of the list, logged once, not as an
    unknown export; FIFOs and symlinks leading outside never appear."""
    d = os.path.join(workdir, "mixed")
    os.mkdir(d)
    make_image(d, "a.img", MiB, seed=3)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", os.path.join(d, "b.qcow2"),
                    "1M"], check=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "vmdk", os.path.join(d, "c.vmdk"),
                    "1M"], check=True)
    open(os.path.join(d, "empty.img"), "wb").close()
    make_image(d, "locked.img", MiB, seed=4)
    os.chmod(os.path.join(d, "locked.img"), 0)
    os.mkfifo(os.path.join(d, "fifo"))
    outside = os.path.join(workdir, "outside.img")
    make_image(workdir, "outside.img", MiB, seed=5)
    os.symlink(outside, os.path.join(d, "out.img"))
    srv = serve_dir(serve, d)
    # Root reads a mode-0 file; anyone else cannot, and it is left out.
    want = {"a.img": MiB, "empty.img": 0}
    if os.geteuid() == 0:
        want["locked.img"] = MiB
    for _ in range(2):
        res = subprocess.run(["nbdinfo", "--list", "--json", uri_for(srv, "")],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        exports = json.loads(res.stdout)["exports"]
        assert {e["export-name"]: e["export-size"] for e in exports} == want
    res = subprocess.run(["qemu-nbd", "-L", "-k", srv.sock], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert re.findall(r"export: '([^']*)'", res.stdout) == sorted(want)
    log = srv.stderr()
    for name, fmt in [("b.qcow2", "qcow2"), ("c.vmdk", "vmdk")]:
        lines = [line for line in log.splitlines() if f"{name}: not listed" in line]
        assert len(lines) == 1 and f"looks like a {fmt} image" in lines[0], log
    assert "unknown export" not in log and "refused" not in log, log
    # Named anyway, the refusal still says what it is.
    c = raw(srv)
    rtype, payload = go_reply(c, b"b.qcow2")
    assert rtype & REP_ERR and b"looks like a qcow2 image" in payload
    # -f raw serves their bytes, so they are listed.
    srv.terminate()
    srv = serve_dir(serve, d, "-f", "raw")
    assert set(listed(srv)) == set(want) | {"b.qcow2", "c.vmdk"}
