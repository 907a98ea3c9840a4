"""A tiny NBD client on a raw socket, written from the protocol document, for
the hostile tests: it can say exactly the wrong thing at exactly the wrong
time, which libnbd never does."""

import socket
import ssl
import struct

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698

FLAG_FIXED_NEWSTYLE = 1
FLAG_NO_ZEROES = 2

OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_STARTTLS = 5
OPT_INFO = 6
OPT_GO = 7
OPT_STRUCTURED_REPLY = 8
OPT_LIST_META_CONTEXT = 9
OPT_SET_META_CONTEXT = 10

REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_ERR = 1 << 31
REP_ERR_UNSUP = REP_ERR + 1
REP_ERR_INVALID = REP_ERR + 3

INFO_EXPORT = 0
INFO_BLOCK_SIZE = 3

CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3
CMD_TRIM = 4
CMD_CACHE = 5
CMD_WRITE_ZEROES = 6

TX_READ_ONLY = 1 << 1


class Closed(Exception):
    """The server closed the connection."""


# How a peer's close shows besides EOF: a reset or broken pipe, and on a TLS
# socket a close without close_notify (SSLEOFError) or after one
# (SSLZeroReturnError).
PEER_CLOSED = (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError, ssl.SSLZeroReturnError)


def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except PEER_CLOSED as e:
            raise Closed(f"{e!r} after {len(buf)} of {n} bytes") from e
        if not chunk:
            raise Closed(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def wait_for_close(sock, timeout):
    """True if the server closes (EOF or reset) within `timeout` seconds;
    whatever it sends before closing is discarded."""
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except PEER_CLOSED:
        return True
    except (socket.timeout, TimeoutError):
        return False


class RawClient:
    def __init__(self, sock, tls=None):
        """`tls`: an ssl context; then start() also upgrades to TLS."""
        self.sock = sock
        self.tls = tls
        self.size = None
        self.tx_flags = None
        self.block_size = None
        self.next_cookie = 1

    # -- handshake ------------------------------------------------------------

    def read_greeting(self):
        magic, opt_magic, flags = struct.unpack(">QQH", recv_exact(self.sock, 18))
        assert magic == NBDMAGIC and opt_magic == IHAVEOPT, "not a fixed newstyle server"
        assert flags & FLAG_FIXED_NEWSTYLE
        return flags

    def send_client_flags(self, flags=FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES):
        self.sock.sendall(struct.pack(">I", flags))

    def start(self):
        self.read_greeting()
        self.send_client_flags()
        if self.tls is not None:
            self.starttls(self.tls)
        return self

    def starttls(self, context, server_hostname="localhost"):
        """NBD_OPT_STARTTLS, which must be acknowledged, then the TLS
        handshake: from here on every byte travels inside TLS."""
        self.send_option(OPT_STARTTLS)
        reply = self.read_option_reply()
        assert reply == (OPT_STARTTLS, REP_ACK, b""), f"STARTTLS not acknowledged: {reply}"
        self.sock = context.wrap_socket(self.sock, server_hostname=server_hostname)
        return self

    def send_option(self, option, data=b"", declared_len=None):
        n = len(data) if declared_len is None else declared_len
        self.sock.sendall(struct.pack(">QII", IHAVEOPT, option, n) + data)

    def read_option_reply(self):
        magic, option, rtype, n = struct.unpack(">QIII", recv_exact(self.sock, 20))
        assert magic == REPLY_MAGIC, f"bad option reply magic {magic:#x}"
        return option, rtype, recv_exact(self.sock, n)

    def go(self, name=b"", ask_block_size=True):
        """NBD_OPT_GO; fills size, tx_flags, block_size. Asking for
        INFO_BLOCK_SIZE is a promise to honour the minimum block size (spec:
        Size constraints), so a client that wants to send unaligned requests
        the server must still serve does not ask."""
        infos = [INFO_BLOCK_SIZE] if ask_block_size else []
        data = struct.pack(">I", len(name)) + name + struct.pack(">H", len(infos))
        data += b"".join(struct.pack(">H", i) for i in infos)
        self.send_option(OPT_GO, data)
        while True:
            option, rtype, payload = self.read_option_reply()
            assert option == OPT_GO
            if rtype == REP_ACK:
                assert self.size is not None, "GO acknowledged without NBD_INFO_EXPORT"
                return self
            if rtype & REP_ERR:
                raise AssertionError(f"GO refused: {rtype:#x} {payload!r}")
            assert rtype == REP_INFO, rtype
            (info,) = struct.unpack(">H", payload[:2])
            if info == INFO_EXPORT:
                self.size, self.tx_flags = struct.unpack(">QH", payload[2:12])
            elif info == INFO_BLOCK_SIZE:
                self.block_size = struct.unpack(">III", payload[2:14])

    # -- transmission (simple replies only: structured replies not negotiated)

    def send_request(self, cmd, offset=0, length=0, flags=0, payload=b"", cookie=None):
        if cookie is None:
            cookie = self.next_cookie
            self.next_cookie += 1
        self.sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, cookie, offset, length)
                          + payload)
        return cookie

    def read_simple_reply(self, read_len=0):
        magic, error, cookie = struct.unpack(">IIQ", recv_exact(self.sock, 16))
        assert magic == SIMPLE_REPLY_MAGIC, f"bad reply magic {magic:#x}"
        data = recv_exact(self.sock, read_len) if error == 0 and read_len else b""
        return cookie, error, data

    def pipeline(self, requests):
        """Send all (cmd, offset, length, payload) requests before reading
        any reply, so the server has them all in flight; returns the errors
        in request order (replies may come in any order)."""
        cookies = [self.send_request(cmd, off, n, payload=p) for cmd, off, n, p in requests]
        errors = {}
        for _ in cookies:
            cookie, error, _ = self.read_simple_reply()
            assert cookie in cookies and cookie not in errors, cookie
            errors[cookie] = error
        return [errors[c] for c in cookies]

    def request(self, cmd, offset=0, length=0, flags=0, payload=b""):
        """One request, one reply; returns (errno, data)."""
        cookie = self.send_request(cmd, offset, length, flags, payload)
        got, error, data = self.read_simple_reply(length if cmd == CMD_READ else 0)
        assert got == cookie, f"reply for cookie {got}, expected {cookie}"
        return error, data

    def disconnect(self):
        self.send_request(CMD_DISC)
        self.sock.close()

    def close(self):
        self.sock.close()


def request_bytes(cmd, offset, length, flags=0, cookie=0xBAD0BAD0, payload=b""):
    return struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, cookie, offset, length) + payload
