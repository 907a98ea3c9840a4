"""Graceful shutdown: on SIGTERM (or SIGINT) the server finishes what is in
flight, flushes and exits 0; every write it acknowledged is in the file,
and nothing else changed."""

import signal
import time

import nbd
import pytest

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
