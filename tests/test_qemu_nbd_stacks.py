"""`rawdisk qemu-nbd` (issue 39, 5): the command lines oVirt vdsm,
virtnbdbackup and virt-v2v type, run verbatim through a `qemu-nbd` symlink
to the rawdisk binary first on PATH, and the exports driven as those stacks
drive them (imageio's readiness probe and SIGTERM, virtnbdbackup's pid file
read the moment the --fork parent exits and its base:allocation map,
virt-v2v's pid-file wait and -s overlay). Every byte read back is checked,
and the bytes outside what a client may touch are checked unchanged.
The bitmap parts (imageio's qemu:dirty-bitmap: handshake, an incremental
backup) are in test_qemu_nbd_bitmaps.py."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

import servers
from helpers import (KiB, MiB, assert_export_is, assert_target_is, connected, make_image,
                     terminate, wait_gone)

pytestmark = pytest.mark.rawdisk_only("rawdisk's qemu-nbd command line")


@pytest.fixture
def qemu_nbd_path(workdir):
    """A directory whose `qemu-nbd` is the rawdisk binary, as an
    administrator puts it first on a stack's PATH; returns the PATH."""
    d = os.path.join(workdir, "bin")
    os.mkdir(d)
    os.symlink(os.path.abspath(servers.RAWDISK_BIN), os.path.join(d, "qemu-nbd"))
    return d + os.pathsep + os.environ["PATH"]


def start(path_env, argv, **kw):
    """qemu-nbd ARGV found on PATH, as the stacks run it."""
    env = dict(os.environ, PATH=path_env)
    return subprocess.Popen(["qemu-nbd", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def run(path_env, argv):
    env = dict(os.environ, PATH=path_env)
    return subprocess.run(["qemu-nbd", *argv], env=env, capture_output=True, text=True,
                          timeout=60)


def wait_for_socket(sock, proc, timeout=10.0):
    """imageio's readiness check: connect, then close at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"qemu-nbd exited {proc.returncode}: {proc.stderr.read()}")
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
            return
        except OSError:
            time.sleep(0.02)
    raise AssertionError("the socket never accepted")


def stop(proc):
    """imageio and vdsm stop the server with SIGTERM and expect status 0."""
    _, err = terminate(proc)
    assert proc.returncode == 0, (proc.returncode, err)
    return err


def uri(sock, name=""):
    return f"nbd+unix:///{name}?socket={sock}"


def vdsm_argv(sock, image, read_only=False, discard=False, driver="file", extra=None):
    """vdsm's start_transient_service() command line (lib/vdsm/storage/nbd.py)."""
    argv = ["--socket", sock, "--persistent", "--shared=8", "--export-name=",
            "--cache=none", "--aio=native"]
    if read_only:
        argv.append("--read-only")
    elif discard:
        argv += ["--discard=unmap", "--detect-zeroes=unmap"]
    node = {"driver": "raw", "file": {"driver": driver, "filename": image}}
    node.update(extra or {})
    return argv + ["json:" + json.dumps(node)]


# -- oVirt: vdsm's command line, imageio's probe and stop ----------------------

def test_vdsm_command_line_serves_and_outlives_the_probe(workdir, qemu_nbd_path):
    """vdsm's line with --discard=unmap --detect-zeroes=unmap: the server
    outlives imageio's connect-and-close probe, serves every byte, writes
    land in the file, an all-zero write punches a hole (detect-zeroes=
    unmap), and SIGTERM ends it with status 0."""
    path, model = make_image(workdir, "vol.img", 8 * MiB, seed=5)
    sock = os.path.join(workdir, "vdsm.sock")
    p = start(qemu_nbd_path, vdsm_argv(sock, path, discard=True))
    try:
        wait_for_socket(sock, p)
        time.sleep(0.2)
        assert p.poll() is None, "the probe ended the server"
        with connected(uri(sock)) as h:
            assert h.get_size() == len(model)
            assert h.can_trim() and h.can_multi_conn()
            h.pwrite(b"\xab" * (256 * KiB), MiB)
            model[MiB:MiB + 256 * KiB] = b"\xab" * (256 * KiB)
            h.pwrite(bytes(MiB), 4 * MiB)
            model[4 * MiB:5 * MiB] = bytes(MiB)
            h.flush()
        assert_export_is(uri(sock), model)
    finally:
        stop(p)
    assert_target_is(path, model)
    # detect-zeroes=unmap: the zero megabyte left a hole.
    with open(path, "rb") as f:
        assert os.lseek(f.fileno(), 4 * MiB, os.SEEK_HOLE) == 4 * MiB


def test_vdsm_read_only(workdir, qemu_nbd_path):
    """--read-only: the export says so and a write sent anyway is refused;
    the file is unchanged."""
    path, model = make_image(workdir, "vol.img", 4 * MiB, seed=6)
    sock = os.path.join(workdir, "ro.sock")
    p = start(qemu_nbd_path, vdsm_argv(sock, path, read_only=True))
    try:
        wait_for_socket(sock, p)
        with connected(uri(sock), strict=False) as h:
            assert h.is_read_only()
            with pytest.raises(Exception):
                h.pwrite(b"x" * 4096, 0)
        assert_export_is(uri(sock), model)
    finally:
        stop(p)
    assert_target_is(path, model)


def test_vdsm_slice_touches_nothing_outside(workdir, qemu_nbd_path):
    """A nested raw node with offset and size (imageio's slice of a raw
    file): the export is the slice; rewriting all of it changes nothing
    before or after it."""
    path, model = make_image(workdir, "ova.img", 8 * MiB, seed=7)
    off, size = 3 * MiB, 2 * MiB
    sock = os.path.join(workdir, "slice.sock")
    p = start(qemu_nbd_path, vdsm_argv(sock, path, extra={"offset": off, "size": size}))
    try:
        wait_for_socket(sock, p)
        assert_export_is(uri(sock), model[off:off + size], "the slice")
        new = bytes((i * 7) & 0xFF for i in range(size))
        with connected(uri(sock), strict=False) as h:
            h.pwrite(new, 0)
            h.flush()
            with pytest.raises(Exception):
                h.pwrite(b"x" * 4096, size)
        model[off:off + size] = new
    finally:
        stop(p)
    assert_target_is(path, model)


def test_vdsm_host_device(workdir, qemu_nbd_path, loop4096):
    """The host_device driver on a block device (vdsm's block storage)."""
    with open(loop4096, "rb") as f:
        model = bytearray(f.read(4 * MiB))
    sock = os.path.join(workdir, "blk.sock")
    p = start(qemu_nbd_path, vdsm_argv(sock, loop4096, driver="host_device"))
    try:
        wait_for_socket(sock, p)
        with connected(uri(sock)) as h:
            h.pwrite(b"\x5a" * 8192, 4096)
            model[4096:4096 + 8192] = b"\x5a" * 8192
            h.flush()
            assert h.pread(len(model), 0) == model
    finally:
        stop(p)
    # A file named with host_device is refused as qemu-nbd refuses it.
    path, _ = make_image(workdir, "f.img", MiB)
    r = run(qemu_nbd_path, vdsm_argv(os.path.join(workdir, "x.sock"), path,
                                     driver="host_device"))
    assert r.returncode == 1 and "host_device" in r.stderr, r.stderr


def test_version_is_parsed_as_the_stacks_parse_it(qemu_nbd_path):
    """imageio: the second word of the first line, split on dots into
    integers; virt-v2v: the first X.Y.Z on that line."""
    r = run(qemu_nbd_path, ["--version"])
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert tuple(int(n) for n in first.split(None, 2)[1].split(".")) >= (5, 2, 0)
    assert re.search(r"(\d+)\.(\d+)\.(\d+)", first)
    assert first.startswith("qemu-nbd ") and "(rawdisk " in first, first
    # virt-v2v looks for --selinux-label in --help; rawdisk has none.
    h = run(qemu_nbd_path, ["--help"])
    assert h.returncode == 0 and "selinux" not in h.stdout


# -- virtnbdbackup ---------------------------------------------------------------

def test_virtnbdbackup_offline_backup(workdir, qemu_nbd_path):
    """startBackupNbdServer()'s argv, element for element ("-e 2" one word,
    a bare "--" last): the --fork parent exits 0 and the pid file names the
    running server at that moment; the map nbdinfo prints has only
    base:allocation types 0-3; the data and zero runs rebuild the image."""
    path, model = make_image(workdir, "sda.img", 8 * MiB, seed=8, sparse=True)
    sock = os.path.join(workdir, "backup.sock")
    pid_file = sock + ".pid"
    argv = ["-r", "--format=raw", "-x", "sda", path, "-k", sock, "-t", "-e 2", "--fork",
            "--detect-zeroes=on", f"--pid-file={pid_file}", "--"]
    p = start(qemu_nbd_path, argv)
    p.wait(timeout=30)
    # runcmd(): the pid file is read as soon as the parent has exited.
    with open(pid_file) as f:
        pid = int(f.read())
    try:
        assert p.returncode == 0, p.stderr.read()
        os.kill(pid, 0)
        u = uri(sock, "sda")
        m = subprocess.run(["nbdinfo", "--json", "--map", u], capture_output=True,
                           text=True, timeout=60)
        assert m.returncode == 0, m.stderr
        extents = json.loads(m.stdout)
        assert {e["type"] for e in extents} <= {0, 1, 2, 3}, extents
        # Rebuild the disk as the backup does: data read, zero runs skipped.
        rebuilt = bytearray(len(model))
        with connected(u) as h:
            assert h.is_read_only() and h.get_size() == len(model)
            for e in extents:
                if e["type"] & 2 == 0:
                    rebuilt[e["offset"]:e["offset"] + e["length"]] = \
                        h.pread(e["length"], e["offset"])
        assert rebuilt == model, "the backup differs from the disk"
        # "-e 2": a third client is refused (two may share the export).
        with connected(u), connected(u):
            r = subprocess.run(["nbdinfo", "--size", u], capture_output=True, text=True,
                               timeout=30)
            assert r.returncode != 0, "a third client was served with -e 2"
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_gone(pid)
    assert not os.path.exists(pid_file), "the pid file outlived the server"
    assert_target_is(path, model)


# -- virt-v2v ---------------------------------------------------------------------

def test_virt_v2v_snapshot_overlay(workdir, qemu_nbd_path):
    """QemuNBD.run_unix's line with -s: the pid file appears (virt-v2v waits
    for it), any number of clients share the export (--shared=0), the
    clients see their writes and trims, and the disk is byte-for-byte what
    it was when the server is gone."""
    path, model = make_image(workdir, "guest.img", 8 * MiB, seed=9, sparse=True)
    base = bytes(model)
    sock = os.path.join(workdir, "v2v.sock")
    pid_file = os.path.join(workdir, "qemunbd1.pid")
    argv = ["-t", "--shared=0", "--discard=unmap", "--pid-file", pid_file,
            "--socket", sock, "-s", "--format", "raw", path]
    p = start(qemu_nbd_path, argv)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(pid_file):
            assert time.monotonic() < deadline and p.poll() is None, p.stderr.read()
            time.sleep(0.05)
        with open(pid_file) as f:
            assert int(f.read()) == p.pid
        hs = [connected(uri(sock)) for _ in range(12)]
        handles = [c.__enter__() for c in hs]
        try:
            h = handles[0]
            h.pwrite(b"\x11" * MiB, 0)
            model[0:MiB] = b"\x11" * MiB
            h.zero(64 * KiB, 2 * MiB)
            model[2 * MiB:2 * MiB + 64 * KiB] = bytes(64 * KiB)
            h.flush()
            for other in handles[1:]:
                assert other.pread(MiB, 0) == model[0:MiB]
        finally:
            for c in hs:
                c.__exit__(None, None, None)
        assert_export_is(uri(sock), model, "the overlay")
    finally:
        stop(p)
    assert_target_is(path, base, "the disk under -s")


def test_virt_v2v_without_snapshot_writes_the_disk(workdir, qemu_nbd_path):
    """The same line without -s: writes reach the file."""
    path, model = make_image(workdir, "guest.img", 4 * MiB, seed=10)
    sock = os.path.join(workdir, "v2v.sock")
    pid_file = os.path.join(workdir, "qemunbd2.pid")
    p = start(qemu_nbd_path, ["-t", "--shared=0", "--discard=unmap", "--pid-file", pid_file,
                              "--socket", sock, "--format", "raw", path])
    try:
        wait_for_socket(sock, p)
        with connected(uri(sock)) as h:
            h.pwrite(b"\x22" * 4096, 8192)
            model[8192:8192 + 4096] = b"\x22" * 4096
            h.flush()
    finally:
        stop(p)
    assert_target_is(path, model)


# -- qemu-nbd's own rules ------------------------------------------------------------

def test_without_t_the_server_ends_after_its_client_not_the_probe(workdir, qemu_nbd_path):
    """qemu-nbd without -t exits after the last client that reached the
    transmission phase; a connect-and-close probe does not count."""
    path, model = make_image(workdir, "d.img", MiB, seed=11)
    sock = os.path.join(workdir, "once.sock")
    p = start(qemu_nbd_path, ["-k", sock, "-f", "raw", path])
    wait_for_socket(sock, p)
    time.sleep(0.3)
    assert p.poll() is None, "the probe ended the server"
    assert_export_is(uri(sock), model)
    assert p.wait(timeout=30) == 0, p.stderr.read()


def test_getopt_forms(workdir, qemu_nbd_path):
    """Attached short values (-kPATH, -xNAME), clustered flags (-rt), long
    prefixes (--sock, --export=), --offset in hexadecimal, and a file named
    like an option after --."""
    path, model = make_image(workdir, "-odd.img", 2 * MiB, seed=12)
    sock = os.path.join(workdir, "g.sock")
    p = start(qemu_nbd_path, [f"-k{sock}", "-xvm", "-rt", "--sha= 3", "--form=raw",
                              "--offset", "0x100000", "--", path])
    try:
        wait_for_socket(sock, p)
        assert_export_is(uri(sock, "vm"), model[MiB:])
        with connected(uri(sock, "vm")) as h:
            assert h.is_read_only()
    finally:
        stop(p)


@pytest.mark.parametrize("argv,words", [
    (["-f", "qcow2", "IMG"], ["format 'qcow2'", "qemu's qemu-nbd"]),
    (["-c", "/dev/nbd0", "IMG"], ["-c /dev/nbd0", "qemu's qemu-nbd"]),
    (['json:{"driver":"qcow2","file":{"driver":"file","filename":"IMG"}}'],
     ["driver 'qcow2'", "qemu's qemu-nbd"]),
    (["nbd:unix:/x.sock"], ["protocol 'nbd:'", "qemu's qemu-nbd"]),
    (["--de", "x", "IMG"], ["ambiguous"]),
    (["-k", "rel.sock", "IMG"], ["socket path must be absolute"]),
    (["--detect-zeroes=unmap", "IMG"], ["without setting discard operation to unmap"]),
])
def test_refusals_are_one_line(workdir, qemu_nbd_path, argv, words):
    """What rawdisk does not serve, and what qemu-nbd itself refuses: exit
    1 with one line that says why."""
    path, _ = make_image(workdir, "d.img", MiB)
    r = run(qemu_nbd_path, [a.replace("IMG", path) for a in argv])
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_another_format_is_not_probed_into_raw(workdir, qemu_nbd_path):
    """Without -f qemu-nbd would serve a qcow2 file as qcow2; rawdisk
    refuses it rather than serve the file's bytes as the disk."""
    img = os.path.join(workdir, "disk.qcow2")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", img, "16M"], check=True)
    r = run(qemu_nbd_path, ["-k", os.path.join(workdir, "q.sock"), img])
    assert r.returncode == 1 and "qcow2" in r.stderr, r.stderr


# -- nbdkit's habits on serve ------------------------------------------------------

def test_serve_exit_with_parent(workdir):
    """serve --exit-with-parent --pidfile: when the process that started
    it exits, the server stops cleanly and removes its pid file."""
    path, _ = make_image(workdir, "d.img", MiB)
    sock = os.path.join(workdir, "p.sock")
    pid_file = os.path.join(workdir, "p.pid")
    parent = ("import subprocess, sys, time, os\n"
              f"subprocess.Popen([{servers.RAWDISK_BIN!r}, 'serve', '--exit-with-parent',"
              f" '--foreground', '--pidfile', {pid_file!r}, '-U', {sock!r}, {path!r}],"
              " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
              f"while not os.path.exists({pid_file!r}): time.sleep(0.02)\n"
              f"print(open({pid_file!r}).read().strip())\n")
    r = subprocess.run([sys.executable, "-c", parent], check=True, timeout=30,
                       capture_output=True, text=True)
    pid = int(r.stdout)
    wait_gone(pid, timeout=15, what="the server whose parent exited")
    assert not os.path.exists(pid_file) and not os.path.exists(sock)
