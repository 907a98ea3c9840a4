"""Statistics of `rawdisk serve`: the per-connection summary line with -v,
the totals SIGUSR1 logs and `--stats FILE` writes as JSON at exit, and the
log line (with its reason) of each refused connection. A raw-socket client
makes a known workload, so every count and byte total is exact."""

import errno
import json
import os
import re
import struct
import subprocess
import time

import pytest

import servers
import wire
from helpers import KiB, MiB, assert_target_is, make_image, sigusr1_totals, wait_for_line

pytestmark = pytest.mark.rawdisk_only("statistics")

SIZE = 8 * MiB
REP_ERR_TLS_REQD = wire.REP_ERR + 5
REP_ERR_UNKNOWN = wire.REP_ERR + 6


def workload(srv, model):
    """Requests with known counts and lengths over one connection, simple
    replies: 12 reads (20480 bytes, one past the end), 3 writes (20480
    bytes, one past the end), a flush, a trim of 4 KiB, a zero of 64 KiB,
    8 reads pipelined at once, then NBD_CMD_DISC. `model` gets the writes."""
    c = wire.RawClient(srv.connect_unix_or_tcp()).start().go()
    for i in range(3):
        assert c.request(wire.CMD_READ, i * 4 * KiB, 4 * KiB) == \
            (0, bytes(model[i * 4 * KiB:(i + 1) * 4 * KiB]))
    for i in range(2):
        off = MiB + i * 8 * KiB
        data = bytes([0x30 + i]) * (8 * KiB)
        assert c.request(wire.CMD_WRITE, off, len(data), payload=data) == (0, b"")
        model[off:off + len(data)] = data
    assert c.request(wire.CMD_FLUSH) == (0, b"")
    assert c.request(wire.CMD_WRITE_ZEROES, 2 * MiB, 64 * KiB) == (0, b"")
    model[2 * MiB:2 * MiB + 64 * KiB] = bytes(64 * KiB)
    # Trim is advisory: the range reads as before or as zeros; make it a
    # range that is zeros already, so either way the model holds.
    assert c.request(wire.CMD_TRIM, 2 * MiB, 4 * KiB) == (0, b"")
    assert c.request(wire.CMD_READ, SIZE, 4 * KiB)[0] == errno.EINVAL
    assert c.request(wire.CMD_WRITE, SIZE - 2 * KiB, 4 * KiB,
                     payload=b"\xee" * 4 * KiB)[0] == errno.ENOSPC
    # One send: the server reads all eight headers before any reply.
    c.sock.sendall(b"".join(wire.request_bytes(wire.CMD_READ, i * 512, 512, cookie=100 + i)
                            for i in range(8)))
    got = {}
    for _ in range(8):
        cookie, err, data = c.read_simple_reply(512)
        assert err == 0 and cookie not in got, (cookie, err)
        got[cookie] = data
    assert got == {100 + i: bytes(model[i * 512:(i + 1) * 512]) for i in range(8)}
    c.disconnect()


COMMANDS_LINE = ("requests: read 12 (20480 bytes), write 3 (20480 bytes), flush 1 (0 bytes), "
                 "trim 1 (4096 bytes), zero 1 (65536 bytes), disconnect 1 (0 bytes); "
                 "errors: NBD_EINVAL 1, NBD_ENOSPC 1; peak 8 in flight")


def test_verbose_logs_one_summary_line_per_connection(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=81)
    srv = serve(path, extra=["-v"])
    workload(srv, model)
    line = wait_for_line(srv, "connection closed after")
    m = re.search(r"connection closed after (\d+\.\d+) s; (.*)$", line)
    assert m, line
    assert 0 < float(m.group(1)) < 30, line
    assert m.group(2) == COMMANDS_LINE, line
    lines = [x for x in srv.stderr().splitlines() if "connection closed after" in x]
    assert len(lines) == 1, lines
    assert_target_is(path, model)


def totals(open_now, disc):
    """The --stats document after `workload` and one 64 KiB read on a second
    connection, but for uptime-seconds."""
    zero = {"requests": 0, "bytes": 0}
    return {
        "connections": {"accepted": 2, "negotiated": 2, "open": open_now, "refused-at-cap": 0,
                        "closed-in-handshake": 0, "unknown-export": 0, "tls-required": 0},
        "requests": {
            "read": {"requests": 13, "bytes": 86016},
            "write": {"requests": 3, "bytes": 20480},
            "flush": {"requests": 1, "bytes": 0},
            "trim": {"requests": 1, "bytes": 4096},
            "cache": zero,
            "write-zeroes": {"requests": 1, "bytes": 65536},
            "block-status": zero,
            "disc": {"requests": disc, "bytes": 0},
            "other": zero,
        },
        "errors": {"eperm": 0, "eio": 0, "enomem": 0, "einval": 1, "enospc": 1, "eoverflow": 0,
                   "enotsup": 0, "eshutdown": 0, "other": 0},
        "peak-in-flight": 8,
        "aio-completed": 0,
        # Every reply read before the totals are asked for.
        "unanswered": [],
    }


def test_sigusr1_and_stats_file_give_the_totals(workdir, serve):
    """Two connections: the workload, then one that only reads 64 KiB and
    stays open while SIGUSR1 asks for the totals. SIGUSR1 logs the document
    --stats writes at exit, with the same names."""
    path, model = make_image(workdir, "disk.img", SIZE, seed=82)
    stats = os.path.join(workdir, "stats.json")
    srv = serve(path, extra=["--stats", stats])
    assert os.path.exists(stats), "--stats FILE is made at start"
    workload(srv, model)
    c = wire.RawClient(srv.connect_unix_or_tcp()).start().go()
    assert c.request(wire.CMD_READ, 0, 64 * KiB) == (0, bytes(model[:64 * KiB]))
    # The workload's connection is counted closed once the server is done
    # with it, which may trail the client's close: ask again until it is.
    deadline = time.monotonic() + 10
    while True:
        line = sigusr1_totals(srv)
        logged = json.loads(line)
        if logged["connections"]["open"] == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert 0 < logged.pop("uptime-seconds") < 120, line
    assert logged == totals(1, 1), line
    srv.assert_alive()
    c.disconnect()
    assert srv.terminate() == 0, srv.stderr()
    with open(stats) as f:
        got = json.load(f)
    assert 0 < got.pop("uptime-seconds") < 120
    assert got == totals(0, 2), got
    assert_target_is(path, model)


# -- refused connections ----------------------------------------------------------

def test_a_connection_over_the_cap_is_logged_with_the_reason(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=83)
    srv = serve(path, extra=["--max-connections", "1"])
    first = wire.RawClient(srv.connect_unix_or_tcp()).start().go()
    over = wire.RawClient(srv.connect_unix_or_tcp()).start()
    over.send_option(wire.OPT_GO, struct.pack(">IH", 0, 0))
    _, rtype, msg = over.read_option_reply()
    assert rtype == wire.REP_ERR + 2 and b"too many connections" in msg, (hex(rtype), msg)
    over.sock.close()
    line = wait_for_line(srv, "refusing connection")
    assert "already serving 1 connections" in line, line
    assert first.request(wire.CMD_READ, 0, 4 * KiB) == (0, bytes(model[:4 * KiB]))
    first.disconnect()


def test_an_unknown_export_is_logged_with_the_names(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=84)
    srv = serve(path, export_name="vm")
    c = wire.RawClient(srv.connect_unix_or_tcp()).start()
    c.send_option(wire.OPT_GO, struct.pack(">I", 4) + b"nope" + struct.pack(">H", 0))
    _, rtype, msg = c.read_option_reply()
    assert rtype == REP_ERR_UNKNOWN, (hex(rtype), msg)
    c.sock.close()
    line = wait_for_line(srv, "refused NBD_OPT_GO")
    assert 'no export named "nope" (this server offers "vm")' in line, line
    assert " WARN " in line, line


def test_a_plaintext_client_of_a_tls_server_is_logged(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=85)
    keys = os.path.join(workdir, "keys.psk")
    with open(keys, "w") as f:
        f.write("alice:" + "ab" * 32 + "\n")
    srv = serve(path, extra=["--tls-psk", keys])
    c = wire.RawClient(srv.connect_unix_or_tcp()).start()
    c.send_option(wire.OPT_GO, struct.pack(">IH", 0, 0))
    _, rtype, msg = c.read_option_reply()
    assert rtype == REP_ERR_TLS_REQD, (hex(rtype), msg)
    c.sock.close()
    line = wait_for_line(srv, "refused NBD_OPT_GO")
    assert "TLS is required and the client did not start it" in line, line
    line = sigusr1_totals(srv)
    assert json.loads(line)["connections"]["tls-required"] == 1, line


# -- --stats FILE that cannot be written ------------------------------------------

def test_stats_file_that_cannot_be_made_fails_before_serving(workdir):
    path, _ = make_image(workdir, "disk.img", SIZE, seed=86)
    sock = os.path.join(workdir, "s.sock")
    res = subprocess.run([servers.RAWDISK_BIN, "serve", "--socket", sock, "--stats",
                          os.path.join(workdir, "no", "such", "stats.json"), path],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1, res
    assert "cannot write statistics" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not os.path.exists(sock)


def test_no_empty_stats_file_is_left_when_serving_fails(workdir):
    stats = os.path.join(workdir, "stats.json")
    res = subprocess.run([servers.RAWDISK_BIN, "serve", "--socket",
                          os.path.join(workdir, "s.sock"), "--stats", stats,
                          os.path.join(workdir, "missing.img")],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1, res
    assert "cannot serve" in res.stderr, res.stderr
    assert not os.path.exists(stats)
