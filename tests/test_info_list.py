"""`rawdisk info --list URI`: the exports a server offers (NBD_OPT_LIST),
each with the size NBD_OPT_INFO gives, against rawdisk serve, nbdkit and
qemu-nbd; exact names, sizes and descriptions, in both output forms, and one
line when the server will not list."""

import json
import os
import socket
import subprocess
import time

import pytest

import servers
from helpers import MiB, make_image

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")


def rawdisk(*args):
    return subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                          timeout=60)


def listed(uri):
    """The --list JSON as {name: (size, read_only, description)}, checking
    the human form names the same exports and sizes."""
    r = rawdisk("info", "--list", "--output", "json", uri)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # nbdinfo --json --list's keys, so its users' scripts keep working.
    assert (doc["protocol"], doc["TLS"]) == ("newstyle-fixed", uri.startswith("nbds"))
    for e in doc["exports"]:
        assert e["uri"].startswith(uri.split(":", 1)[0] + ":"), e
    got = {e["export-name"]: (e.get("export-size"), e.get("is_read_only"), e.get("description"))
           for e in doc["exports"]}
    assert len(got) == len(doc["exports"]), "an export listed twice"
    human = rawdisk("info", "--list", uri)
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert lines[:2] == [f"server: {uri}", f"exports: {len(got)}"], human.stdout
    rows = lines[4:]  # after a blank line and the header
    assert len(rows) == len(got), human.stdout
    for name, (size, _, _) in got.items():
        assert any(row.startswith(f'"{name}"') and f" {size} (" in row for row in rows), \
            (name, human.stdout)
    return got


def accepts(sock):
    """Whether a server listens on the Unix socket `sock`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(sock)
            return True
        except OSError:
            return False


class Daemon:
    """A reference server in the foreground on a Unix socket."""

    def __init__(self, argv, sock):
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        # The socket file appears at bind(), before listen(): wait for a
        # connect to be accepted, or the first client may be refused.
        while not accepts(sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{argv[0]} did not start: {self.proc.stderr.read().decode()}")
            time.sleep(0.02)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stderr.close()


@pytest.fixture
def daemon():
    started = []

    def start(argv, sock):
        d = Daemon(argv, sock)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


def test_lists_rawdisk_serve_export(workdir, serve):
    path, _ = make_image(workdir, "disk.img", 3 * MiB + 4096)
    srv = serve(path, export_name="vm-1")
    # The URI's own export name does not matter for a listing.
    uri = f"nbd+unix:///whatever?socket={srv.sock}"
    assert listed(uri) == {"vm-1": (3 * MiB + 4096, False, None)}
    srv.assert_alive()


def test_lists_read_only_export(workdir, serve):
    path, _ = make_image(workdir, "disk.img", MiB)
    srv = serve(path, read_only=True)
    assert listed(srv.uri) == {"": (MiB, True, None)}


@pytest.mark.parametrize("sizes", [
    {"small": 512 * 1024, "big": 5 * MiB + 512, "mid": 2 * MiB},
    # More exports than one handshake's options are asked for.
    {f"disk{i:02}": (i + 1) * 4096 + i for i in range(40)},
], ids=["three", "forty"])
def test_lists_nbdkit_exports_with_their_sizes(workdir, daemon, sizes):
    """nbdkit's file plugin serves each file of a directory as an export:
    one listing, each export with its own size."""
    d = os.path.join(workdir, "dir")
    os.mkdir(d)
    for name, size in sizes.items():
        with open(os.path.join(d, name), "wb") as f:
            f.truncate(size)
    sock = os.path.join(workdir, "k.sock")
    daemon(["nbdkit", "-f", "-U", sock, "file", f"dir={d}"], sock)
    got = listed(f"nbd+unix:///?socket={sock}")
    assert got == {n: (s, False, None) for n, s in sizes.items()}


def test_lists_nbdkit_explicit_names_and_descriptions(workdir, daemon):
    sock = os.path.join(workdir, "e.sock")
    daemon(["nbdkit", "-f", "-U", sock, "--filter=exportname", "memory", "3M",
            "exportname=a", "exportname=b c", "exportname-list=explicit",
            "exportdesc=fixed:scratch disk"], sock)
    got = listed(f"nbd+unix:///?socket={sock}")
    assert got == {"a": (3 * MiB, False, "scratch disk"),
                   "b c": (3 * MiB, False, "scratch disk")}


def test_lists_qemu_nbd_export(workdir, daemon):
    path, _ = make_image(workdir, "q.img", 7 * MiB)
    sock = os.path.join(workdir, "q.sock")
    daemon(["qemu-nbd", "-k", sock, "-x", "qx", "-r", "-f", "raw", "-D", "made by qemu-nbd",
            path], sock)
    got = listed(f"nbd+unix:///?socket={sock}")
    assert got == {"qx": (7 * MiB, True, "made by qemu-nbd")}


def test_server_that_refuses_listing(workdir, daemon):
    sock = os.path.join(workdir, "f.sock")
    daemon(["nbdkit", "-f", "-U", sock, "--filter=exportname", "memory", "1M",
            "exportname-list=error"], sock)
    uri = f"nbd+unix:///?socket={sock}"
    r = rawdisk("info", "--list", uri)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"rawdisk: cannot list exports of '{uri}': "), r.stderr
    assert "refuses to list its exports" in r.stderr, r.stderr


def test_list_needs_a_uri(workdir):
    path, _ = make_image(workdir, "disk.img", MiB)
    r = rawdisk("info", "--list", path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "--list needs an NBD URI" in r.stderr, r.stderr
    gone = os.path.join(workdir, "gone.sock")
    r = rawdisk("info", "--list", f"nbd+unix:///?socket={gone}")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "cannot connect to" in r.stderr and "No such file" in r.stderr, r.stderr
