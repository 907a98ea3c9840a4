"""The server's limits hold against clients that misbehave on purpose
(docs/architecture.md, Limits): clients that never read their replies,
connections that never finish the handshake, connections that idle, writes
over the maximum payload, and what the server keeps when everyone has left.
In each case the other clients are still answered promptly and every byte
they read or wrote is checked."""

import errno
import os
import re
import socket
import subprocess
import time

import nbd
import pytest

import servers
import wire
from helpers import (KiB, MiB, assert_export_is, assert_target_is, connect, connected,
                     make_image, random_bytes, wait_all)

SIZE = 64 * MiB


@pytest.fixture
def sockets():
    """Raw sockets a test opens; all closed at teardown, before the server
    is stopped (`serve` is set up first, so torn down last)."""
    opened = []
    yield opened
    for s in opened:
        s.close()


def fd_count(srv):
    return len(os.listdir(f"/proc/{srv.pid}/fd"))


def wait_for(cond, timeout, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def timed(h, issue, limit):
    """Seconds until the command `issue()` started is answered, or None if
    it is not answered within `limit` seconds."""
    t0 = time.monotonic()
    cookie = issue()
    while True:
        if h.aio_command_completed(cookie):
            return time.monotonic() - t0
        left = t0 + limit - time.monotonic()
        if left <= 0:
            return None
        h.poll(max(1, int(left * 1000)))


def warm_up(srv, model, fds):
    """Start the server's threads and pools before anything is measured;
    the pools are let go when the last connection ends (back to `fds`)."""
    with connected(srv.uri) as h:
        assert h.pread(2 * MiB, 0) == model[:2 * MiB]
    wait_for(lambda: fd_count(srv) <= fds, 5)


def non_reader(srv, sockets, requests=256, length=MiB):
    """A client that sends `requests` READ headers of `length` and never
    reads a reply (about 7 KB sent)."""
    c = wire.RawClient(srv.connect_unix_or_tcp())
    sockets.append(c.sock)
    c.start().go()
    c.sock.sendall(b"".join(
        wire.request_bytes(wire.CMD_READ, (i * length) % SIZE, length, cookie=i)
        for i in range(requests)))
    return c


# -- clients that never read their replies ----------------------------------------

def test_clients_that_never_read_replies_do_not_starve_others(workdir, serve, sockets):
    """Five connections each ask for 256 MiB of reads and read nothing. The
    sixth client's 4 KiB reads and writes are answered within a second, the
    server's memory stays bounded, and once the five hang up their
    connections are cleaned up (descriptors back to the baseline)."""
    path, model = make_image(workdir, "disk.img", SIZE, seed=41)
    srv = serve(path)
    fds = fd_count(srv)
    warm_up(srv, model, fds)
    rss_before = srv.status("VmRSS")
    for _ in range(5):
        non_reader(srv, sockets)
    # Let the server run as far ahead of them as it will.
    time.sleep(1.5)
    h = connect(srv.uri)
    try:
        for i in range(20):
            off = (7 + 3 * i) * 4 * KiB
            buf = nbd.Buffer(4 * KiB)
            took = timed(h, lambda: h.aio_pread(buf, off), 5)
            assert took is not None and took < 1, f"4 KiB read {i} took {took} s"
            assert buf.to_bytearray() == model[off:off + 4 * KiB]
            data = random_bytes(4 * KiB, seed=4100 + i)
            took = timed(h, lambda: h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)),
                                                 off + 32 * MiB), 5)
            assert took is not None and took < 1, f"4 KiB write {i} took {took} s"
            model[off + 32 * MiB:off + 32 * MiB + 4 * KiB] = data
        grown = srv.status("VmRSS") - rss_before
        assert grown < 200 * MiB, f"server RSS grew by {grown >> 20} MiB"
    finally:
        h.shutdown()
        del h
    for s in sockets:
        s.close()
    sockets.clear()
    assert wait_for(lambda: fd_count(srv) <= fds, 10), \
        f"{fd_count(srv)} descriptors open after the clients left, {fds} before"
    srv.assert_alive()
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


# -- the handshake ----------------------------------------------------------------

@pytest.mark.rawdisk_only("nbdkit and qemu-nbd have other caps")
def test_silent_connections_cannot_lock_out_clients(workdir, serve, sockets):
    """300 connections that send nothing: at most half of the connection cap
    may sit in the handshake (a newer connection takes the oldest one's
    place), so an established client keeps working and a new one gets in
    at once; what is closed is logged at most once a second, with a count."""
    path, model = make_image(workdir, "disk.img", 8 * MiB, seed=42)
    srv = serve(path)
    h = connect(srv.uri)
    try:
        for _ in range(300):
            sockets.append(srv.connect_unix_or_tcp())
        t0 = time.monotonic()
        with connected(srv.uri) as fresh:
            data = random_bytes(64 * KiB, seed=43)
            fresh.pwrite(data, MiB)
            model[MiB:MiB + len(data)] = data
            assert fresh.pread(4 * KiB, 0) == model[:4 * KiB]
        assert time.monotonic() - t0 < 2
        assert h.pread(64 * KiB, MiB) == model[MiB:MiB + 64 * KiB]
    finally:
        h.shutdown()
        del h
    # 250 of the 300 and one more for `fresh` were closed to make room: the
    # server says how many when the burst's second ends, with no further
    # event to carry the count.
    assert wait_for(lambda: handshake_evictions(srv.stderr()) == 251, 3), \
        f"{handshake_evictions(srv.stderr())} evictions logged, not 251: {srv.stderr()[-2000:]}"
    closed = [line for line in srv.stderr().splitlines() if "still in the handshake" in line]
    assert len(closed) <= 5, "\n".join(closed)
    assert_export_is(srv.uri, model)


def handshake_evictions(log):
    """Connections the log says were closed in the handshake: one per
    event line, plus the counts of the per-second summaries."""
    n = 0
    for line in log.splitlines():
        if "closing the oldest to admit" in line:
            n += 1
        m = re.search(r"closed (\d+) more connection\(s\) still in the handshake", line)
        if m:
            n += int(m.group(1))
    return n


@pytest.mark.rawdisk_only("the reason in NBD_REP_ERR_POLICY")
def test_a_client_over_the_cap_is_told_why(workdir, serve):
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=53)
    srv = serve(path, extra=["--max-connections", "1"])
    h = connect(srv.uri)
    try:
        with pytest.raises(nbd.Error) as e:
            connect(srv.uri, name="over")
        # libnbd 1.14 names the refusal, not its message.
        assert "policy" in str(e.value), e.value
        assert h.pread(4096, 0) == model[:4096]
    finally:
        h.shutdown()
        del h
    assert "refusing connection" in srv.stderr()
    assert_export_is(srv.uri, model)


@pytest.mark.rawdisk_only("nbdkit 1.32 has no handshake timeout")
def test_handshake_timeout_defaults_to_10_seconds(workdir, serve, sockets):
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=44)
    srv = serve(path)
    s = srv.connect_unix_or_tcp()
    sockets.append(s)
    wire.RawClient(s).read_greeting()
    t0 = time.monotonic()
    assert wire.wait_for_close(s, 15), "stalled handshake still open after 15 s"
    assert 9 <= time.monotonic() - t0 <= 11.5
    assert_export_is(srv.uri, model)


@pytest.mark.rawdisk_only("--idle-timeout")
def test_idle_timeout_closes_only_idle_connections(workdir, serve, sockets):
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=45)
    srv = serve(path, extra=["--idle-timeout", "1s"])
    idle = wire.RawClient(srv.connect_unix_or_tcp()).start().go()
    sockets.append(idle.sock)
    busy = wire.RawClient(srv.connect_unix_or_tcp()).start().go()
    sockets.append(busy.sock)
    t0 = time.monotonic()
    # A request every 0.3 s keeps a connection open.
    while time.monotonic() - t0 < 2.5:
        assert busy.request(wire.CMD_READ, 4096, 4096) == (0, bytes(model[4096:8192]))
        time.sleep(0.3)
    assert wire.wait_for_close(idle.sock, 1), "idle connection still open"
    assert busy.request(wire.CMD_READ, 0, 512) == (0, bytes(model[:512]))
    busy.disconnect()
    assert "idle" in srv.stderr()


@pytest.mark.rawdisk_only("--idle-timeout")
def test_idle_timeout_also_closes_clients_that_stopped_reading(workdir, serve, sockets):
    """A client that keeps its socket open but reads no reply holds its
    place under the connection cap until the idle timeout ends it."""
    path, model = make_image(workdir, "disk.img", SIZE, seed=54)
    srv = serve(path, extra=["--idle-timeout", "1s"])
    fds = fd_count(srv)
    non_reader(srv, sockets)
    assert wait_for(lambda: "read no reply" in srv.stderr(), 10), srv.stderr()[-2000:]
    assert wait_for(lambda: fd_count(srv) <= fds, 10), \
        f"{fd_count(srv)} descriptors open, {fds} before the client came"
    assert_export_is(srv.uri, model)


def test_idle_connections_stay_by_default(workdir, serve, sockets):
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=46)
    srv = serve(path)
    c = wire.RawClient(srv.connect_unix_or_tcp()).start().go()
    sockets.append(c.sock)
    assert not wire.wait_for_close(c.sock, 3)
    assert c.request(wire.CMD_READ, 0, 4096) == (0, bytes(model[:4096]))
    c.disconnect()


@pytest.mark.rawdisk_only("the memory bound is rawdisk's")
def test_idle_connections_cost_little_memory_and_give_it_back(workdir, serve, sockets):
    """200 connections idle after the handshake: at most 24 KiB of private
    memory each (was 57 KiB: a 64 KiB read-ahead buffer, a reply channel's
    first block), and back within 2 MiB of the start once all have closed."""
    n = 200
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=47)
    srv = serve(path, extra=["--max-connections", str(n + 10)])
    warm_up(srv, model, fd_count(srv))
    time.sleep(1)
    start = srv.status("RssAnon")
    conns = []
    for _ in range(n):
        c = wire.RawClient(srv.connect_unix_or_tcp()).start().go()
        sockets.append(c.sock)
        conns.append(c)
    # Buffers of connections quiet for a second are let go.
    time.sleep(2.5)
    idle = srv.status("RssAnon")
    assert idle - start <= n * 24 * KiB, f"{(idle - start) / n / KiB:.1f} KiB per idle connection"
    # An idle connection still answers, its buffer back.
    for c in (conns[0], conns[-1]):
        assert c.request(wire.CMD_READ, 4096, 8192) == (0, bytes(model[4096:12288]))
    for c in conns:
        c.disconnect()
    sockets.clear()
    assert wait_for(lambda: srv.status("RssAnon") - start <= 2 * MiB, 5), \
        f"{(srv.status('RssAnon') - start) / MiB:.1f} MiB more after all closed"


# -- oversized payloads ----------------------------------------------------------------

@pytest.mark.rawdisk_only("nbdkit closes the connection")
def test_oversized_write_is_a_plain_error_and_the_connection_goes_on(workdir, serve):
    """33 MiB is over the 32 MiB maximum: the payload is read and dropped,
    the write fails with EINVAL, and the same connection keeps working
    (libnbd matches a reply only to a request it has finished sending)."""
    path, model = make_image(workdir, "disk.img", SIZE, seed=47)
    srv = serve(path)
    with connected(srv.uri, strict=False) as h:
        with pytest.raises(nbd.Error) as e:
            h.pwrite(random_bytes(33 * MiB, seed=48), 0)
        assert e.value.errnum == errno.EINVAL, e.value
        assert h.pread(MiB, 5 * MiB) == model[5 * MiB:6 * MiB]
        data = random_bytes(MiB, seed=49)
        h.pwrite(data, 7 * MiB)
        model[7 * MiB:8 * MiB] = data
    assert_target_is(path, model)


@pytest.mark.rawdisk_only("nbdkit closes the connection")
def test_oversized_write_payload_is_skipped_not_parsed(workdir, serve, sockets):
    path, model = make_image(workdir, "disk.img", SIZE, seed=50)
    srv = serve(path)
    c = wire.RawClient(srv.connect_unix_or_tcp()).start().go()
    sockets.append(c.sock)
    one = wire.request_bytes(wire.CMD_WRITE, 0, 4096, payload=b"\xee" * 4096)
    payload = (one * (40 * MiB // len(one) + 1))[:40 * MiB]
    cookie = c.send_request(wire.CMD_WRITE, 0, len(payload), payload=payload)
    c.sock.settimeout(20)
    got, error, _ = c.read_simple_reply()
    assert (got, error) == (cookie, errno.EINVAL)
    assert c.request(wire.CMD_READ, 0, 8192) == (0, bytes(model[:8192]))
    c.disconnect()
    assert_target_is(path, model)


@pytest.mark.rawdisk_only("qemu-nbd takes 32 MiB at most")
def test_48_mib_requests_from_a_client_that_negotiated_no_block_sizes(workdir, serve, sockets):
    """A client that did not ask for NBD_INFO_BLOCK_SIZE may send up to
    64 MiB (many assume more than the spec's 32 MiB default); one that
    asked is held to the 32 MiB it was told."""
    path, model = make_image(workdir, "disk.img", 128 * MiB, seed=52, sparse=True)
    srv = serve(path)
    big = 48 * MiB
    off = 40 * MiB + 4096
    data = random_bytes(big, seed=53)
    c = wire.RawClient(srv.connect_unix_or_tcp()).start().go(ask_block_size=False)
    sockets.append(c.sock)
    c.sock.settimeout(60)
    assert c.request(wire.CMD_WRITE, off, big, payload=data) == (0, b"")
    assert c.request(wire.CMD_FLUSH) == (0, b"")
    model[off:off + big] = data
    # The write and a MiB either side of it.
    err, got = c.request(wire.CMD_READ, off - MiB, big + 2 * MiB)
    assert err == 0
    assert got == model[off - MiB:off + big + MiB]
    c.disconnect()

    asked = wire.RawClient(srv.connect_unix_or_tcp()).start().go()
    sockets.append(asked.sock)
    asked.sock.settimeout(60)
    assert asked.block_size[2] == 32 * MiB
    other = random_bytes(big, seed=54)
    assert asked.request(wire.CMD_WRITE, 0, big, payload=other) == (errno.EINVAL, b"")
    assert asked.request(wire.CMD_READ, 0, big) == (errno.EINVAL, b"")
    # The connection goes on.
    assert asked.request(wire.CMD_READ, 0, 8192) == (0, bytes(model[:8192]))
    asked.disconnect()
    srv.terminate()
    assert_target_is(path, model)


# -- serve --create ----------------------------------------------------------------------

@pytest.mark.rawdisk_only("--create")
def test_create_makes_nothing_when_the_socket_is_in_use(workdir, serve):
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=51)
    srv = serve(path)
    new = os.path.join(workdir, "new.img")
    pid_file = os.path.join(workdir, "second.pid")
    res = subprocess.run([servers.RAWDISK_BIN, "serve", "--socket", srv.sock, "--create", "1M",
                          "--pid-file", pid_file, new],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0
    assert "in use" in res.stderr, res.stderr
    assert not os.path.exists(new), "--create made the image before failing"
    assert not os.path.exists(pid_file)
    assert_export_is(srv.uri, model)


@pytest.mark.rawdisk_only("--create")
def test_create_removes_what_it_made_when_serving_fails(workdir):
    """The pid file cannot be written (its directory is missing): nothing
    is created."""
    new = os.path.join(workdir, "new.img")
    res = subprocess.run([servers.RAWDISK_BIN, "serve", "--socket",
                          os.path.join(workdir, "s.sock"), "--create", "1M",
                          "--pid-file", os.path.join(workdir, "no", "such", "dir.pid"), new],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0
    assert "pid file" in res.stderr, res.stderr
    assert not os.path.exists(new)
    assert not os.path.exists(os.path.join(workdir, "s.sock"))


# -- what the server keeps when everyone has left ------------------------------------------

def test_pooled_pipes_and_buffers_are_let_go_when_clients_leave(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=52)
    srv = serve(path)
    fds = fd_count(srv)
    for round_ in range(3):
        with connected(srv.uri) as h:
            # Spliced reads in flight at once: many pipes.
            bufs = [(nbd.Buffer(MiB), i * MiB) for i in range(48)]
            cookies = [h.aio_pread(b, off) for b, off in bufs]
            assert set(wait_all(h, cookies).values()) == {0}
            for b, off in bufs:
                assert b.to_bytearray() == model[off:off + MiB]
        assert wait_for(lambda: fd_count(srv) <= fds, 5), \
            f"round {round_}: {fd_count(srv)} descriptors open with no client, {fds} before"


@pytest.mark.rawdisk_only("pipes for spliced reads")
def test_pooled_pipes_are_let_go_when_idle_while_a_client_stays(workdir, serve):
    """A burst of spliced reads fills the pipe pool; a few seconds without
    use close the pipes again although the client stays connected."""
    path, model = make_image(workdir, "disk.img", SIZE, seed=55)
    srv = serve(path)
    with connected(srv.uri) as h:
        assert h.pread(4096, 0) == model[:4096]
        fds = fd_count(srv)
        bufs = [(nbd.Buffer(MiB), i * MiB) for i in range(48)]
        cookies = [h.aio_pread(b, off) for b, off in bufs]
        assert set(wait_all(h, cookies).values()) == {0}
        for b, off in bufs:
            assert b.to_bytearray() == model[off:off + MiB]
        held = fd_count(srv)
        assert held >= fds + 16, f"{held} descriptors after the burst, {fds} before: no pipes kept"
        assert wait_for(lambda: fd_count(srv) <= fds, 10), \
            f"{fd_count(srv)} descriptors open after idling, {fds} before the burst"
        # Still served, spliced again from fresh pipes.
        assert h.pread(2 * MiB, 8 * MiB) == model[8 * MiB:10 * MiB]


# -- storage errors are logged -------------------------------------------------------------

def test_no_space_is_logged_with_the_range_at_most_once_a_second(tmpfs_dir, serve):
    """On a full file system each failed write is answered ENOSPC and
    logged with its range, at most one line per second with a count."""
    with open(os.path.join(tmpfs_dir, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\x01" * MiB)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    try:
        path = os.path.join(tmpfs_dir, "sparse.img")
        with open(path, "wb") as f:
            f.truncate(64 * MiB)
        srv = serve(path)
        c = wire.RawClient(srv.connect_unix_or_tcp()).start().go()
        for i in range(40):
            off = 8 * MiB + i * 64 * KiB
            err, _ = c.request(wire.CMD_WRITE, off, 64 * KiB, payload=b"\x42" * 64 * KiB)
            assert err == errno.ENOSPC, err
        c.disconnect()
        lines = [line for line in srv.stderr().splitlines() if "NBD_ENOSPC" in line]
        assert 1 <= len(lines) <= 4, "\n".join(lines)
        assert "at offset 8388608" in lines[0] and "65536 bytes" in lines[0], lines[0]
    finally:
        for name in ("filler", "sparse.img"):
            if os.path.exists(os.path.join(tmpfs_dir, name)):
                os.remove(os.path.join(tmpfs_dir, name))
