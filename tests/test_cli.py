"""The `rawdisk serve` command line contract: the URI it prints once ready
(Unix socket, TCP, export name), --pid-file, --create with each
--preallocation, --max-connections and --handshake-timeout, and one-line
errors for targets it cannot serve."""

import os
import socket
import subprocess
import time
import urllib.parse

import nbd
import pytest

import servers
import wire
from helpers import (MiB, allocated_bytes, assert_export_is, assert_target_is, connect, connected,
                     make_image, open_flags, random_bytes)

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")


def test_prints_the_unix_uri_once_ready(workdir, serve):
    path, model = make_image(workdir, "disk.img", MiB, seed=91)
    srv = serve(path)
    assert srv.printed_uri == f"nbd+unix:///?socket={srv.sock}"
    assert_export_is(srv.printed_uri, model)


def test_prints_the_tcp_uri_with_export_name(workdir, serve):
    path, model = make_image(workdir, "disk.img", MiB, seed=92)
    srv = serve(path, tcp=True, export_name="vm1")
    uri = urllib.parse.urlparse(srv.printed_uri)
    assert (uri.scheme, uri.hostname, uri.path) == ("nbd", "127.0.0.1", "/vm1")
    assert srv.bind == "127.0.0.1:0" and uri.port > 0
    assert_export_is(srv.printed_uri, model)


def test_pid_file_while_running(workdir, serve):
    path, _ = make_image(workdir, "disk.img", MiB, seed=93)
    pid_file = os.path.join(workdir, "rawdisk.pid")
    srv = serve(path, pid_file=pid_file)
    with open(pid_file) as f:
        assert int(f.read().strip()) == srv.pid
    assert srv.terminate() == 0
    assert not os.path.exists(pid_file), "--pid-file is documented as removed at exit"


@pytest.mark.parametrize("prealloc", ["off", "falloc", "full"])
def test_create_then_serve(workdir, serve, prealloc):
    path = os.path.join(workdir, "new.img")
    size = 8 * MiB + 4096
    srv = serve(path, create=size, preallocation=prealloc)
    assert os.path.getsize(path) == size
    allocated = allocated_bytes(path)
    if prealloc == "off":
        assert allocated < MiB
    else:
        assert allocated >= size
    model = bytearray(size)
    with connected(srv.uri) as h:
        data = random_bytes(MiB, seed=94)
        h.pwrite(data, 3 * MiB + 1)
        model[3 * MiB + 1:4 * MiB + 1] = data
        h.flush()
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


def test_create_refuses_an_existing_file_of_another_size(workdir):
    path, model = make_image(workdir, "disk.img", MiB, seed=95)
    argv = servers.server_argv("rawdisk", path, sock=os.path.join(workdir, "s"), create=2 * MiB)
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert res.returncode == 1
    assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith("rawdisk:"), res.stderr
    assert_target_is(path, model)


def test_missing_target_is_a_one_line_error(workdir):
    path = os.path.join(workdir, "nosuch.img")
    argv = servers.server_argv("rawdisk", path, sock=os.path.join(workdir, "s"))
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rawdisk:") and "nosuch.img" in lines[0], lines
    assert not os.path.exists(path)


def test_a_connection_over_the_cap_waits_for_a_place_that_frees(workdir, serve):
    """A client that connects while the server is full, just before another
    connection ends (a copy, then its check), is served, not refused: it
    waits up to a second for the place, as qemu-nbd's listen backlog does."""
    path, model = make_image(workdir, "disk.img", MiB, seed=97)
    srv = serve(path, extra=["--max-connections", "1"])
    a = connect(srv.uri, name="a")
    second = wire.RawClient(srv.connect_unix_or_tcp())
    # Waiting, it gets no greeting (a refusal would send one at once).
    second.sock.settimeout(0.2)
    with pytest.raises(socket.timeout):
        second.sock.recv(1)
    a.shutdown()
    del a
    second.sock.settimeout(10)
    second.read_greeting()
    second.send_client_flags()
    second.go()
    assert second.request(wire.CMD_READ, 0, 4096) == (0, bytes(model[:4096]))
    second.disconnect()


def test_max_connections(workdir, serve):
    path, model = make_image(workdir, "disk.img", MiB, seed=96)
    srv = serve(path, extra=["--max-connections", "2"])
    a = connect(srv.uri, name="a")
    b = connect(srv.uri, name="b")
    with pytest.raises(nbd.Error):
        connect(srv.uri, name="c")
    assert a.pread(4096, 0) == model[:4096]
    b.shutdown()
    del b
    deadline = time.monotonic() + 5
    while True:
        try:
            c = connect(srv.uri, name="c")
            break
        except nbd.Error:
            assert time.monotonic() < deadline, "a freed slot was never reused"
            time.sleep(0.1)
    assert c.pread(4096, 4096) == model[4096:8192]
    a.shutdown()
    c.shutdown()


def test_short_handshake_timeout_and_others_still_served(workdir, serve):
    path, model = make_image(workdir, "disk.img", MiB, seed=97)
    srv = serve(path, extra=["--handshake-timeout", "2"])
    stalled = [srv.connect_unix_or_tcp() for _ in range(4)]
    try:
        wire.RawClient(stalled[0]).read_greeting()
        start = time.monotonic()
        with connected(srv.uri) as h:
            assert h.pread(MiB, 0) == model
        for s in stalled:
            assert wire.wait_for_close(s, 10)
        assert time.monotonic() - start < 8
    finally:
        for s in stalled:
            s.close()
    assert_export_is(srv.uri, model)
    srv.assert_alive()


def test_read_only_opens_the_target_read_only(workdir, serve):
    path, model = make_image(workdir, "disk.img", MiB, seed=98)
    srv = serve(path, read_only=True)
    with connected(srv.uri) as h:
        assert h.pread(4096, 0) == model[:4096]
        modes = [flags & os.O_ACCMODE for flags in open_flags(srv.pid, path)]
    assert modes and set(modes) == {os.O_RDONLY}, modes
    assert_target_is(path, model)


@pytest.mark.parametrize("family", ["unix", "tcp"])
def test_systemd_socket_activation(workdir, family):
    """LISTEN_FDS/LISTEN_PID (sd_listen_fds): the server takes fd 3 as its
    listener, prints a URI for it, and serves it."""
    import socket
    img = os.path.join(workdir, "act.img")
    with open(img, "wb") as f:
        f.truncate(4 * MiB)
    if family == "unix":
        path = os.path.join(workdir, "act.sock")
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(path)
        uri = "nbd+unix:///?socket=" + path
    else:
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.bind(("127.0.0.1", 0))
        uri = "nbd://127.0.0.1:%d/" % lsock.getsockname()[1]
    lsock.listen(16)

    def as_fd3():
        os.dup2(lsock.fileno(), 3)
        os.set_inheritable(3, True)

    # LISTEN_PID must name the server itself: the shell sets it, then execs.
    proc = subprocess.Popen(
        ["/bin/sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" serve "$1"',
         servers.RAWDISK_BIN, img],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=as_fd3, close_fds=False)
    try:
        printed = proc.stdout.readline().decode().strip()
        # Printed before anything connects: a server that ignored fd 3 would
        # print its default listener here instead.
        assert printed == uri, printed
        h = nbd.NBD()
        h.connect_uri(uri)
        h.pwrite(b"\xa5" * 4096, 8192)
        assert h.pread(4096, 8192) == b"\xa5" * 4096
        h.shutdown()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()
        lsock.close()
    with open(img, "rb") as f:
        data = f.read()
    assert data[8192:12288] == b"\xa5" * 4096
    assert data[:8192] == bytes(8192) and data[12288:] == bytes(len(data) - 12288)
