"""serve --dir: what NBD_OPT_LIST costs in a big directory. A listing
leaves out what GO would refuse (another image format), which takes an
open and a read of each file's head; a second LIST reads again only the
heads of files that changed (docs/formats.md)."""

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse

import nbd
import pytest

from wire import OPT_LIST, RawClient

pytestmark = pytest.mark.rawdisk_only("rawdisk serve --dir")

MiB = 1 << 20
FILES = 20000
# A file's verdict is kept once its last change is this old (listing.rs).
SETTLED = 2.0


def uri_for(srv, name):
    return "nbd+unix:///%s?socket=%s" % (urllib.parse.quote(name, safe=""), srv.sock)


def read_calls(pid):
    """Read syscalls the process made so far (read, pread, readv...)."""
    with open("/proc/%d/io" % pid) as f:
        for line in f:
            if line.startswith("syscr:"):
                return int(line.split()[1])
    raise AssertionError("no syscr in /proc/%d/io" % pid)


def rss(pid):
    """Resident memory of the process, in bytes."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/%d/status" % pid)


def lists(srv, n):
    """`n` NBD_OPT_LIST on one connection: each one's names, seconds and
    read syscalls of the server."""
    h = nbd.NBD()
    h.set_opt_mode(True)
    h.connect_unix(srv.sock)
    out = []
    for _ in range(n):
        names = []
        before, t = read_calls(srv.pid), time.monotonic()
        h.opt_list(lambda name, desc: names.append(name) or 0)
        out.append((names, time.monotonic() - t, read_calls(srv.pid) - before))
    h.opt_abort()
    return out


def test_a_big_directory_is_listed_reading_each_head_once(workdir, serve):
    d = os.path.join(workdir, "many")
    os.mkdir(d)
    sizes = {}
    for i in range(FILES):
        name = "d%05d.img" % i
        sizes[name] = 4096 * (1 + i % 256)
        with open(os.path.join(d, name), "wb") as f:
            f.truncate(sizes[name])
    qcow2 = os.path.join(d, "other.qcow2")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", qcow2, "1M"], check=True)
    os.mkdir(os.path.join(d, "subdir"))
    # Older than SETTLED when listed, so their verdicts are kept.
    time.sleep(SETTLED + 0.5)
    srv = serve(d, extra=("--dir",))

    t = time.monotonic()
    res = subprocess.run(["nbdinfo", "--list", "--json", uri_for(srv, "")],
                         capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t
    assert res.returncode == 0, res.stderr[-2000:]
    got = {e["export-name"]: e["export-size"] for e in json.loads(res.stdout)["exports"]}
    assert got == sizes, (len(got), sorted(set(got) ^ set(sizes))[:10])
    print("nbdinfo --list of %d exports: %.1f s" % (FILES, took))

    (first, t1, r1), (second, t2, r2) = lists(srv, 2)
    assert first == second == sorted(sizes)
    print("LIST: %.3f s, %d reads; again: %.3f s, %d reads" % (t1, r1, t2, r2))
    # Before: two reads (head and tail) of every file on every LIST.
    assert r2 < FILES // 20, "a second LIST read %d times for %d unchanged files" % (r2, FILES)

    # A file turned into qcow2 is read again and left out; one deleted is
    # gone; the rest is not read again.
    with open(qcow2, "rb") as f:
        head = f.read(4096)
    with open(os.path.join(d, "d00007.img"), "r+b") as f:
        f.write(head)
    os.unlink(os.path.join(d, "d00008.img"))
    del sizes["d00007.img"], sizes["d00008.img"]
    ((third, _, r3),) = lists(srv, 1)
    assert third == sorted(sizes)
    assert r3 < FILES // 20, r3
    log = srv.stderr()
    assert log.count("other.qcow2: not listed") == 1, log[-2000:]
    assert log.count("d00007.img: not listed") == 1, log[-2000:]
    shutil.rmtree(d)


def test_listers_that_do_not_read_hold_little_memory(workdir, serve):
    """A long list (20,000 names of 200 bytes: 4.5 MiB of replies) is
    sent as it is encoded: a lister that does not read holds 64 KiB of it,
    not all of it, and every connection shares the one listing."""
    d = os.path.join(workdir, "long")
    os.mkdir(d)
    stem = "n" * 190
    for i in range(FILES):
        open(os.path.join(d, "%s%05d.img" % (stem, i)), "wb").close()
    time.sleep(SETTLED + 0.5)
    srv = serve(d, extra=("--handshake-timeout", "60", "--dir"))
    ((names, _, _),) = lists(srv, 1)
    assert len(names) == FILES
    before = rss(srv.pid)
    stalled = []
    for _ in range(24):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(srv.sock)
        c = RawClient(s).start()
        c.send_option(OPT_LIST)
        stalled.append(s)
    # Each has its list encoded (and stuck in its socket) by now.
    time.sleep(3)
    grown = rss(srv.pid) - before
    print("RSS grew %.1f MiB with %d listers not reading" % (grown / MiB, len(stalled)))
    # Before: each held its whole list encoded, 4.5 MiB, 108 MiB in all.
    assert grown < 32 * MiB, grown
    for s in stalled:
        s.close()
    shutil.rmtree(d)
