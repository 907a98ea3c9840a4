"""Graceful shutdown: on SIGTERM (or SIGINT, SIGHUP) the server finishes what
is in flight, answers what it will not start with NBD_ESHUTDOWN, flushes and
exits 0; every write it acknowledged is in the file, and nothing else
changed. SIGUSR1 logs the server's totals and changes nothing."""

import errno
import json
import os
import signal
import struct
import time

import nbd
import pytest

import wire
from helpers import KiB, MiB, assert_target_is, connect, make_image, random_bytes, read_target

SIZE = 48 * MiB


def drive_until_done(h, cookies, deadline_s=60):
    """Poll until every command is retired or the connection is gone.
    Returns {cookie: True (acknowledged) / False (failed or stranded)}."""
    result = {}
    deadline = time.monotonic() + deadline_s
    while len(result) < len(cookies) and time.monotonic() < deadline:
        for c in cookies:
            if c in result:
                continue
            try:
                if h.aio_command_completed(c):
                    result[c] = True
            except nbd.Error:
                result[c] = False
        if len(result) == len(cookies) or h.aio_is_dead() or h.aio_is_closed():
            break
        try:
            h.poll(100)
        except nbd.Error:
            break
    for c in cookies:
        result.setdefault(c, False)
    return result


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_with_writes_in_flight(workdir, serve, sig):
    path, model = make_image(workdir, "disk.img", SIZE, seed=61)
    old = bytes(model)
    srv = serve(path)
    h = connect(srv.uri)
    writes = {}
    for i in range(64):
        off = i * 768 * KiB
        data = random_bytes(512 * KiB, seed=600 + i)
        writes[h.aio_pwrite(nbd.Buffer.from_bytearray(data), off)] = (off, data)
    # Let the server get going so the signal lands mid-stream.
    acked = {}
    while len(acked) < 4:
        h.poll(100)
        for c in writes:
            if c not in acked and h.aio_command_completed(c):
                acked[c] = True
    assert len(acked) < len(writes), "nothing left in flight: the test proves nothing"
    srv.proc.send_signal(sig)
    acked.update(drive_until_done(h, [c for c in writes if c not in acked]))
    assert srv.wait_exit(30) == 0, srv.stderr()
    assert "panicked" not in srv.stderr()
    del h
    now = read_target(path)
    for c, (off, data) in writes.items():
        if acked[c]:
            model[off:off + len(data)] = data
        else:
            for b in range(0, len(data), 4 * KiB):
                block = now[off + b:off + b + 4 * KiB]
                assert block in (old[off + b:off + b + 4 * KiB], data[b:b + 4 * KiB]), off + b
            model[off:off + len(data)] = now[off:off + len(data)]
    assert_target_is(path, model)


@pytest.mark.rawdisk_only("nbdkit waits for connected clients to leave")
def test_acknowledged_writes_are_in_the_file_after_sigterm(workdir, serve):
    """Plain writes (no FUA, no flush from the client): exit must flush."""
    path, model = make_image(workdir, "disk.img", 8 * MiB, seed=62)
    srv = serve(path)
    h = connect(srv.uri)
    data = random_bytes(3 * MiB, seed=63)
    h.pwrite(data, 1234)
    model[1234:1234 + len(data)] = data
    assert srv.terminate(30) == 0, srv.stderr()
    del h
    assert_target_is(path, model)


@pytest.mark.rawdisk_only("nbdkit waits for connected clients to leave")
def test_sigterm_with_an_idle_client_exits_promptly(workdir, serve):
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=64)
    srv = serve(path)
    h = connect(srv.uri)
    assert h.pread(4096, 0) == model[:4096]
    start = time.monotonic()
    assert srv.terminate(15) == 0, srv.stderr()
    assert time.monotonic() - start < 10
    del h
    assert_target_is(path, model)


# -- other signals -------------------------------------------------------------

@pytest.mark.rawdisk_only("nbdkit waits for connected clients to leave")
def test_sighup_shuts_down_like_sigterm(workdir, serve):
    """Exit 0, writes flushed, socket and pid file removed (nbdkit also
    exits 0 on SIGHUP)."""
    path, model = make_image(workdir, "disk.img", 8 * MiB, seed=65)
    pid_file = os.path.join(workdir, "srv.pid")
    srv = serve(path, pid_file=pid_file)
    assert os.path.exists(pid_file) and os.path.exists(srv.sock)
    h = connect(srv.uri)
    data = random_bytes(MiB, seed=66)
    h.pwrite(data, 3 * MiB)
    model[3 * MiB:4 * MiB] = data
    srv.proc.send_signal(signal.SIGHUP)
    assert srv.wait_exit(15) == 0, srv.stderr()
    del h
    assert "SIGHUP" in srv.stderr()
    assert not os.path.exists(pid_file), "pid file left behind"
    assert not os.path.exists(srv.sock), "socket left behind"
    assert_target_is(path, model)


@pytest.mark.rawdisk_only("SIGUSR1 statistics")
def test_sigusr1_logs_totals_and_serving_goes_on(workdir, serve):
    path, model = make_image(workdir, "disk.img", 8 * MiB, seed=67)
    srv = serve(path)
    h = connect(srv.uri)
    for i in range(3):
        assert h.pread(64 * KiB, i * MiB) == model[i * MiB:i * MiB + 64 * KiB]
    data = random_bytes(128 * KiB, seed=68)
    h.pwrite(data, 5 * MiB)
    model[5 * MiB:5 * MiB + len(data)] = data
    # Past the end: reaches the server only with libnbd's checks off.
    h2 = connect(srv.uri, strict=False)
    with pytest.raises(nbd.Error):
        h2.pread(4096, 8 * MiB)
    srv.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while "SIGUSR1" not in srv.stderr():
        assert time.monotonic() < deadline, srv.stderr()
        time.sleep(0.05)
    line = next(x for x in srv.stderr().splitlines() if "SIGUSR1" in x)
    # The --stats document on one line.
    got = json.loads(line[line.index("{"):])
    assert got["connections"]["accepted"] == 2, line
    assert got["requests"]["read"] == {"requests": 4, "bytes": 200704}, line
    assert got["requests"]["write"] == {"requests": 1, "bytes": 131072}, line
    assert got["errors"]["einval"] == 1, line
    srv.assert_alive()
    assert h.pread(len(data), 5 * MiB) == data
    h2.shutdown()
    h.shutdown()
    del h, h2
    assert_target_is(path, model)


# -- connections in the handshake ------------------------------------------------

@pytest.mark.rawdisk_only("NBD_REP_ERR_SHUTDOWN in the handshake")
def test_sigterm_answers_an_option_in_the_handshake_with_err_shutdown(workdir, serve):
    """Spec (Option haggling): while shutting down, the server answers
    options with NBD_REP_ERR_SHUTDOWN; a connection idle in the handshake
    is closed without holding up the exit."""
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=71)
    srv = serve(path)
    c = wire.RawClient(srv.connect_unix_or_tcp()).start()
    idle = wire.RawClient(srv.connect_unix_or_tcp()).start()
    try:
        time.sleep(0.1)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        c.send_option(wire.OPT_GO, struct.pack(">IH", 0, 0))
        option, rtype, msg = c.read_option_reply()
        assert (option, rtype) == (wire.OPT_GO, wire.REP_ERR + 7), (option, hex(rtype), msg)
        assert b"shutting down" in msg, msg
        assert wire.wait_for_close(c.sock, 5)
        assert wire.wait_for_close(idle.sock, 5)
        assert srv.wait_exit(10) == 0, srv.stderr()
        assert time.monotonic() - t0 < 3
    finally:
        c.sock.close()
        idle.sock.close()
    assert_target_is(path, model)


# -- requests queued at SIGTERM --------------------------------------------------

@pytest.mark.rawdisk_only("NBD_ESHUTDOWN for what is not started")
def test_sigterm_answers_every_request_it_has_read(workdir, serve):
    """16 FUA writes of 8 MiB in flight at SIGTERM: every one is answered,
    done or NBD_ESHUTDOWN, before the connection closes; a done write is in
    the file, a refused one left no byte behind."""
    size = 136 * MiB
    path, model = make_image(workdir, "disk.img", size, seed=69, sparse=True)
    old = bytes(model)
    srv = serve(path)
    h = connect(srv.uri)
    writes = {}
    for i in range(16):
        off = i * 8 * MiB + 4096
        data = random_bytes(8 * MiB, seed=700 + i)
        c = h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)), off, flags=nbd.CMD_FLAG_FUA)
        writes[c] = (off, data)
    first = None
    while first is None:
        h.poll(1000)
        first = next((c for c in writes if h.aio_command_completed(c)), None)
    srv.proc.send_signal(signal.SIGTERM)
    result = {first: 0}
    pending = set(writes) - {first}
    deadline = time.monotonic() + 30
    while pending and time.monotonic() < deadline and not h.aio_is_dead():
        h.poll(100)
        for c in list(pending):
            try:
                if h.aio_command_completed(c):
                    result[c] = 0
                    pending.discard(c)
            except nbd.Error as e:
                result[c] = e.errnum
                pending.discard(c)
    result.update((c, None) for c in pending)
    assert srv.wait_exit(30) == 0, srv.stderr()
    del h
    assert all(e in (0, errno.ESHUTDOWN) for e in result.values()), \
        f"{sum(e not in (0, errno.ESHUTDOWN) for e in result.values())} of 16 writes got no " \
        f"answer: {sorted(result.values())}"
    refused = [c for c, e in result.items() if e == errno.ESHUTDOWN]
    assert len(refused) < 16
    for c, (off, data) in writes.items():
        if result[c] == 0:
            model[off:off + len(data)] = data
    assert model != bytearray(old)
    assert_target_is(path, model)
