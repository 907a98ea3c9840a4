"""A hostile client on a raw socket (no libnbd) sends bad input: garbage magic, truncated handshakes, unknown and
oversized options, floods of options, unknown commands and flags, writes
declaring more than the maximum payload, offsets that overflow, clients that
vanish mid-payload or with requests in flight, and clients that never finish
the handshake.

Each gets the spec's error or a clean disconnect. After each, the server is
still alive, has not panicked, and a fresh libnbd client reads exactly the
bytes the export must hold (a payload parsed as requests would show up here
as changed bytes).

Every test runs twice: in plaintext, and against a server that requires TLS,
where `RawClient.start()` upgrades with NBD_OPT_STARTTLS so the hostile bytes
after the client flags travel inside TLS (bytes sent before or instead of
the client flags stay plaintext, which a TLS server must survive too), and
the health checks use a TLS libnbd client."""

import errno
import socket
import struct
import threading
import time

import pytest

import tlspki
import wire
from helpers import (KiB, MiB, assert_export_is, assert_target_is, connected, make_image,
                     random_bytes, wait_for_line)

SIZE = 8 * MiB


class Transport:
    """Plaintext (pki None) or TLS with the test PKI: the server's flags and
    how the clients reach it."""

    def __init__(self, pki=None):
        self.pki = pki
        self.tls = tlspki.client_context(pki) if pki else None

    def server_args(self):
        return ["--tls-certificates", self.pki["srv"]] if self.pki else []

    def uri(self, srv):
        if not self.pki:
            return srv.uri
        return tlspki.tls_uri(srv, f"tls-certificates={self.pki['cli-nocert']}")


@pytest.fixture(params=["plain", pytest.param("tls", marks=pytest.mark.rawdisk_only(
    "rawdisk's --tls flags"))])
def transport(request):
    if request.param == "plain":
        return Transport()
    return Transport(request.getfixturevalue("pki"))


def start_export(serve, transport, path, *args):
    srv = serve(path, extra=transport.server_args() + list(args))
    # raw(), uri() and the health checks take the server: it carries how to reach it.
    srv.transport = transport
    return srv


@pytest.fixture
def export(workdir, serve, transport):
    path, model = make_image(workdir, "disk.img", SIZE, seed=31)
    return path, model, start_export(serve, transport, path)


def uri(srv):
    """The URI a libnbd client uses: nbds+unix:// in TLS mode."""
    return srv.transport.uri(srv)


def assert_healthy(srv, path, model):
    srv.assert_alive()
    assert_export_is(uri(srv), model, "export after the hostile client")
    assert_target_is(path, model)
    srv.assert_alive()


_open_clients = []


def raw(srv):
    """A raw client; in TLS mode its start() does STARTTLS and the handshake."""
    c = wire.RawClient(srv.connect_unix_or_tcp(), tls=srv.transport.tls)
    _open_clients.append(c)
    return c


@pytest.fixture(autouse=True)
def close_raw_sockets(serve):
    """A failed test must not leave a socket open: the server would wait for
    it at SIGTERM. (Depends on `serve` so it is torn down before it.)"""
    yield
    while _open_clients:
        # The client, not the socket it started with: TLS replaced that.
        _open_clients.pop().close()


def warm_up(srv):
    """Make the server start its threads and pools (and over TLS its TLS
    library state) before memory is measured."""
    with connected(uri(srv)) as h:
        h.pread(2 * MiB, 0)


# -- handshake ------------------------------------------------------------------

def test_garbage_instead_of_client_flags(export):
    path, model, srv = export
    c = raw(srv)
    c.read_greeting()
    c.sock.sendall(random_bytes(64, seed=1))
    assert wire.wait_for_close(c.sock, 10), "server kept a garbage-speaking client"
    assert_healthy(srv, path, model)


def test_bad_option_magic(export):
    path, model, srv = export
    c = raw(srv).start()
    c.sock.sendall(struct.pack(">QII", 0x1122334455667788, wire.OPT_GO, 0))
    assert wire.wait_for_close(c.sock, 10)
    assert_healthy(srv, path, model)


def test_bad_request_magic(export):
    path, model, srv = export
    c = raw(srv).start().go()
    c.sock.sendall(struct.pack(">IHHQQI", 0xDEADBEEF, 0, wire.CMD_WRITE, 1, 0, 4096)
                   + b"\xee" * 4096)
    assert wire.wait_for_close(c.sock, 10), "a request with a bad magic must end the connection"
    assert_healthy(srv, path, model)


TRUNCATIONS = {
    "nothing": b"",
    "half_client_flags": b"\x00\x00",
    "half_option_header": struct.pack(">QII", wire.IHAVEOPT, wire.OPT_GO, 20)[:11],
    "half_option_data": struct.pack(">QII", wire.IHAVEOPT, wire.OPT_GO, 100) + b"\x00" * 50,
}


@pytest.mark.parametrize("sent", TRUNCATIONS.values(), ids=TRUNCATIONS.keys())
def test_truncated_handshake_then_close(export, sent):
    path, model, srv = export
    c = raw(srv)
    if sent and sent != TRUNCATIONS["half_client_flags"]:
        c.start()  # over TLS the truncated option is inside TLS
    else:
        c.read_greeting()
    c.sock.sendall(sent)
    c.sock.close()
    assert_healthy(srv, path, model)


def test_unknown_option_is_unsupported_and_the_handshake_goes_on(export):
    path, model, srv = export
    c = raw(srv).start()
    c.send_option(0x7777, b"whatever the client wants")
    option, rtype, _ = c.read_option_reply()
    assert (option, rtype) == (0x7777, wire.REP_ERR_UNSUP)
    c.send_option(0x4242)
    option, rtype, _ = c.read_option_reply()
    assert (option, rtype) == (0x4242, wire.REP_ERR_UNSUP)
    c.go()
    assert c.size == SIZE
    assert c.request(wire.CMD_READ, 4096, 8192) == (0, bytes(model[4096:12288]))
    c.disconnect()
    assert_healthy(srv, path, model)


def test_starttls_gets_a_clean_error(export):
    """Plaintext: no TLS configured, STARTTLS must be refused with an error
    reply, not an ACK (which would make the client start a TLS handshake)
    and not a hang. Over TLS: a second STARTTLS inside TLS is invalid (spec).
    Either way the handshake goes on."""
    path, model, srv = export
    c = raw(srv).start()
    c.send_option(wire.OPT_STARTTLS)
    option, rtype, _ = c.read_option_reply()
    assert option == wire.OPT_STARTTLS and rtype & wire.REP_ERR, hex(rtype)
    if srv.transport.tls:
        assert rtype == wire.REP_ERR_INVALID, hex(rtype)
    c.go()
    assert c.request(wire.CMD_READ, 0, 512) == (0, bytes(model[:512]))
    c.disconnect()
    assert_healthy(srv, path, model)


HUGE_OPTIONS = {"unknown": 0x7777, "export_name": wire.OPT_EXPORT_NAME, "go": wire.OPT_GO,
                "list": wire.OPT_LIST, "set_meta_context": wire.OPT_SET_META_CONTEXT}


@pytest.mark.parametrize("option", HUGE_OPTIONS.values(), ids=HUGE_OPTIONS.keys())
def test_option_declaring_one_gib_is_not_allocated(export, option):
    """Option data is capped (at 64 KiB): a declared 1 GiB
    must get an error or a disconnect, never a 1 GiB buffer."""
    path, model, srv = export
    warm_up(srv)
    peak_before, hwm_before = srv.status("VmPeak"), srv.status("VmHWM")
    c = raw(srv).start()
    c.send_option(option, declared_len=1 << 30)
    c.sock.settimeout(0.5)
    sent = 0
    try:
        # Keep feeding data as a real flood would, up to 8 MiB.
        while sent < 8 * MiB:
            sent += c.sock.send(b"\x00" * (256 * KiB))
    except (*wire.PEER_CLOSED, socket.timeout, TimeoutError):
        pass
    srv.assert_alive()
    assert srv.status("VmPeak") - peak_before < 512 * MiB, "server reserved the declared length"
    assert srv.status("VmHWM") - hwm_before < 48 * MiB
    c.sock.close()
    assert_healthy(srv, path, model)


def test_flood_of_options(export):
    """Thousands of options: each answered, or the server hangs up on a
    client that never gets to the point; either way memory stays flat."""
    path, model, srv = export
    warm_up(srv)
    hwm_before = srv.status("VmHWM")
    c = raw(srv).start()
    answered = 0
    try:
        for _ in range(40):
            c.sock.sendall(b"".join(struct.pack(">QII", wire.IHAVEOPT, 0x7000 + i, 4) + b"abcd"
                                    for i in range(500)))
            for i in range(500):
                option, rtype, _ = c.read_option_reply()
                assert (option, rtype) == (0x7000 + i, wire.REP_ERR_UNSUP)
                answered += 1
        c.go()
        assert c.request(wire.CMD_READ, 0, 4096) == (0, bytes(model[:4096]))
    except (wire.Closed, *wire.PEER_CLOSED):
        assert answered >= 16, "cut off after too few options to be a flood"
    c.sock.close()
    assert srv.status("VmHWM") - hwm_before < 32 * MiB
    assert_healthy(srv, path, model)


def test_flood_after_a_list_is_still_cut_off(export):
    """NBD_OPT_LIST raises the option bound only by what a lister needs for
    the names it was told (one here): listing again and again does not
    open the way to an endless stream of options."""
    path, model, srv = export
    c = raw(srv).start()
    answered = 0
    try:
        for _ in range(10):
            c.send_option(wire.OPT_LIST)
            while c.read_option_reply()[1] != wire.REP_ACK:
                pass
            answered += 1
        c.sock.sendall(b"".join(struct.pack(">QII", wire.IHAVEOPT, 0x7000, 0) for _ in range(1000)))
        for _ in range(1000):
            assert c.read_option_reply()[:2] == (0x7000, wire.REP_ERR_UNSUP)
            answered += 1
    except (wire.Closed, *wire.PEER_CLOSED):
        pass
    c.sock.close()
    assert 16 <= answered <= 64 + 4, answered
    assert_healthy(srv, path, model)


def test_export_name_option_old_style_entry(export):
    """NBD_OPT_EXPORT_NAME (what old clients use instead of GO): the server
    answers with size and flags directly (no zero padding: NO_ZEROES)."""
    path, model, srv = export
    c = raw(srv).start()
    c.send_option(wire.OPT_EXPORT_NAME, b"")
    size, flags = struct.unpack(">QH", wire.recv_exact(c.sock, 10))
    assert size == SIZE and not flags & wire.TX_READ_ONLY
    assert c.request(wire.CMD_READ, 100, 1000) == (0, bytes(model[100:1100]))
    c.disconnect()
    assert_healthy(srv, path, model)


def test_list_then_abort(export):
    path, model, srv = export
    c = raw(srv).start()
    c.send_option(wire.OPT_LIST)
    option, rtype, data = c.read_option_reply()
    assert (option, rtype) == (wire.OPT_LIST, wire.REP_SERVER)
    (n,) = struct.unpack(">I", data[:4])
    assert data[4:4 + n] == b""
    assert c.read_option_reply()[:2] == (wire.OPT_LIST, wire.REP_ACK)
    c.send_option(wire.OPT_ABORT)
    # The spec: the server SHOULD acknowledge ABORT, then closes.
    c.sock.settimeout(10)
    try:
        option, rtype, _ = c.read_option_reply()
        assert (option, rtype) == (wire.OPT_ABORT, wire.REP_ACK)
    except wire.Closed:
        pass
    assert wire.wait_for_close(c.sock, 10)
    assert_healthy(srv, path, model)


# -- transmission -----------------------------------------------------------------

def test_unknown_command_and_unknown_flags_get_einval(export):
    path, model, srv = export
    c = raw(srv).start().go()
    assert c.request(99, 0, 4096) == (errno.EINVAL, b"")
    assert c.request(wire.CMD_READ, 0, 4096, flags=0x8000) == (errno.EINVAL, b"")
    # NO_HOLE is documented for WRITE_ZEROES only.
    assert c.request(wire.CMD_READ, 0, 4096, flags=0x2) == (errno.EINVAL, b"")
    # BLOCK_STATUS without a negotiated meta context (and without
    # structured replies): the spec says EINVAL.
    assert c.request(7, 0, 4096) == (errno.EINVAL, b"")
    assert c.request(wire.CMD_READ, 512, 1024) == (0, bytes(model[512:1536]))
    c.disconnect()
    assert_healthy(srv, path, model)


def crafted_writes(total):
    """Bytes that are, back to back, valid WRITE requests putting 0xEE at
    offset 0: if any of them is ever parsed as a request, the file shows it."""
    one = wire.request_bytes(wire.CMD_WRITE, 0, 4096, payload=b"\xee" * 4096)
    return (one * (total // len(one) + 1))[:total]


def max_payload(c):
    return c.block_size[2] if c.block_size else 32 * MiB


def replies_until_close(c, timeout, limit=None):
    """(cookie, error) of the simple replies received until the server
    closes, goes quiet for `timeout` seconds, or `limit` replies came."""
    c.sock.settimeout(timeout)
    got = []
    try:
        while limit is None or len(got) < limit:
            cookie, error, _ = c.read_simple_reply()
            got.append((cookie, error))
    except (wire.Closed, socket.timeout, TimeoutError, *wire.PEER_CLOSED):
        pass
    return got


@pytest.fixture
def big_export(workdir, serve, transport):
    """128 MiB, so a 64 MiB write is oversized without being out of bounds."""
    path, model = make_image(workdir, "big.img", 128 * MiB, seed=32, sparse=True)
    return path, model, start_export(serve, transport, path)


def test_oversized_write_header_without_payload(big_export):
    path, model, srv = big_export
    c = raw(srv).start().go()
    declared = max_payload(c) + 4096
    cookie = c.send_request(wire.CMD_WRITE, 0, declared)
    try:
        c.sock.sendall(crafted_writes(10 * 4124))
    except wire.PEER_CLOSED:
        pass  # the server already hung up: allowed
    replies = replies_until_close(c, 2)
    assert all(cookie_ == cookie and err != 0 for cookie_, err in replies), replies
    c.sock.close()
    assert_healthy(srv, path, model)


def test_oversized_write_with_payload_is_never_parsed(big_export):
    """The payload (valid-looking WRITE requests) is consumed or the
    connection closed; it is never read as requests."""
    path, model, srv = big_export
    c = raw(srv).start().go()
    declared = max(max_payload(c), 32 * MiB) * 2 + 4096
    assert declared < 128 * MiB
    cookie = c.send_request(wire.CMD_WRITE, 0, declared)
    payload = crafted_writes(declared)

    failed = []

    def feed():
        try:
            c.sock.sendall(payload)
        except OSError as e:
            failed.append(e)  # the server hung up: allowed

    feeder = threading.Thread(target=feed)
    feeder.start()
    if srv.transport.tls:
        # One TLS connection must not be read and written from two threads
        # at once (OpenSSL), so over TLS the reply is read after the payload
        # went out or the server hung up.
        feeder.join(30)
    replies = replies_until_close(c, 10, limit=1)
    feeder.join(30)
    assert not feeder.is_alive()
    assert not any(isinstance(e, TimeoutError) for e in failed), \
        "the server stopped reading the payload without closing"
    if replies:
        assert replies[0][0] == cookie and replies[0][1] != 0, replies
    if replies and not failed:
        # The server answered and consumed the payload: the next request is
        # read as one (or the server closes now). After a failed send a TLS
        # connection cannot be written to, so the check is for this case.
        try:
            read = c.send_request(wire.CMD_READ, 0, 4096)
            got, error, data = c.read_simple_reply(4096)
            assert (got, error, data) == (read, 0, bytes(model[:4096]))
        except (wire.Closed, *wire.PEER_CLOSED):
            pass
    c.sock.close()
    assert_healthy(srv, path, model)


OUT_OF_BOUNDS = [
    # The spec: ENOSPC for writes beyond the end, EINVAL for reads and trims.
    ("read", wire.CMD_READ, (1 << 64) - 1, 1, errno.EINVAL),
    ("read_wrapping", wire.CMD_READ, (1 << 64) - 4096, 8192, errno.EINVAL),
    ("write", wire.CMD_WRITE, (1 << 64) - 512, 1024, errno.ENOSPC),
    ("write_zeroes", wire.CMD_WRITE_ZEROES, (1 << 64) - 4096, 8192, errno.ENOSPC),
    ("trim", wire.CMD_TRIM, (1 << 64) - 4096, 8192, errno.EINVAL),
    ("read_straddling_end", wire.CMD_READ, SIZE - 4096, 8192, errno.EINVAL),
    ("write_straddling_end", wire.CMD_WRITE, SIZE - 4096, 8192, errno.ENOSPC),
]


@pytest.mark.parametrize("cmd,offset,length,expected",
                         [o[1:] for o in OUT_OF_BOUNDS], ids=[o[0] for o in OUT_OF_BOUNDS])
def test_offsets_out_of_bounds(export, cmd, offset, length, expected):
    """Offsets that overflow 64 bits and requests straddling the end: the
    spec's error, nothing written (a write's payload is consumed, not
    parsed), and the connection goes on."""
    path, model, srv = export
    c = raw(srv).start().go()
    payload = b"\xee" * length if cmd == wire.CMD_WRITE else b""
    cookie = c.send_request(cmd, offset, length, payload=payload)
    got, error, _ = c.read_simple_reply()
    assert (got, error) == (cookie, expected)
    assert c.request(wire.CMD_READ, SIZE - 4096, 4096) == (0, bytes(model[SIZE - 4096:]))
    c.disconnect()
    assert_healthy(srv, path, model)


def test_read_declaring_4_gib(export):
    """A READ of 2^32-1 bytes with simple replies would make the server
    allocate and send 4 GiB: it must answer with an error (or hang up)
    instead, without reserving the memory."""
    path, model, srv = export
    warm_up(srv)
    peak_before = srv.status("VmPeak")
    c = raw(srv).start().go()
    cookie = c.send_request(wire.CMD_READ, 0, 0xFFFFFFFF)
    c.sock.settimeout(10)
    try:
        got, error, _ = c.read_simple_reply()
        assert got == cookie and error in (errno.EINVAL, errno.EOVERFLOW, errno.ENOMEM), error
        assert c.request(wire.CMD_READ, 0, 4096) == (0, bytes(model[:4096]))
    except wire.Closed:
        pass
    assert srv.status("VmPeak") - peak_before < 512 * MiB
    c.sock.close()
    assert_healthy(srv, path, model)


def test_client_disappears_mid_payload(export):
    """Half a write is not a write: nothing of it may reach the file."""
    path, model, srv = export
    c = raw(srv).start().go()
    c.send_request(wire.CMD_WRITE, MiB, MiB)
    c.sock.sendall(b"\xee" * (100 * KiB))
    c.sock.close()
    time.sleep(0.2)
    assert_healthy(srv, path, model)


def test_client_disappears_with_requests_in_flight(export):
    path, model, srv = export
    c = raw(srv).start().go()
    writes = []
    for i in range(64):
        off = i * 96 * KiB
        data = random_bytes(64 * KiB, seed=300 + i)
        writes.append((off, data))
        c.send_request(wire.CMD_WRITE, off, len(data), payload=data)
        # Small reads: the replies must fit in the socket buffers, since this
        # client never reads them.
        c.send_request(wire.CMD_READ, SIZE - 512, 512)
    c.sock.close()
    # The server may have done any of the writes before noticing: each 4 KiB
    # block of them is either old or new, and nothing else changed.
    srv.assert_alive()
    time.sleep(0.5)
    with connected(uri(srv)) as h:
        now = bytearray(h.pread(SIZE, 0))
    for off, data in writes:
        for b in range(0, len(data), 4 * KiB):
            block = now[off + b:off + b + 4 * KiB]
            assert block in (model[off + b:off + b + 4 * KiB], data[b:b + 4 * KiB]), off + b
        model[off:off + len(data)] = now[off:off + len(data)]
    assert_healthy(srv, path, model)


def test_stalled_handshakes_do_not_block_other_clients(export):
    """Clients stalled at each point of the handshake: silent, after the
    greeting, in the options (over TLS: after the TLS handshake), and over
    TLS inside the TLS handshake."""
    path, model, srv = export
    stalled = []
    for i in range(8):
        c = raw(srv)
        if i % 4 == 1:
            c.read_greeting()  # and then never answer
        elif i % 4 == 2:
            c.start()
        elif i % 4 == 3 and srv.transport.tls:
            c.read_greeting()
            c.send_client_flags()
            c.send_option(wire.OPT_STARTTLS)
            assert c.read_option_reply()[:2] == (wire.OPT_STARTTLS, wire.REP_ACK)
            c.sock.sendall(b"\x16\x03")  # half a TLS record header
        stalled.append(c)
    with connected(uri(srv)) as h:
        data = random_bytes(MiB, seed=77)
        h.pwrite(data, 3 * MiB)
        h.flush()
        model[3 * MiB:4 * MiB] = data
    assert_healthy(srv, path, model)
    for c in stalled:
        c.close()


@pytest.mark.rawdisk_only("nbdkit 1.32 has no handshake timeout")
def test_handshake_timeout_closes_a_stalled_client(workdir, serve, transport):
    """A client that never finishes the handshake is dropped after a
    timeout of at most 30 s. Over TLS the client stalls after the TLS
    handshake: the deadline covers the whole negotiation, TLS included (a
    2 s timeout there, so the default is waited for only once)."""
    path, model = make_image(workdir, "disk.img", SIZE, seed=31)
    if transport.tls:
        srv = start_export(serve, transport, path, "--handshake-timeout", "2")
        limit = 2
    else:
        srv = start_export(serve, transport, path)
        limit = 30
    c = raw(srv)
    start = time.monotonic()
    if transport.tls:
        c.start()
    else:
        c.read_greeting()
    assert wire.wait_for_close(c.sock, limit + 5), "stalled handshake still open"
    assert time.monotonic() - start <= limit + 1
    wait_for_line(srv, "handshake not finished", timeout=5)
    c.close()
    assert_healthy(srv, path, model)
