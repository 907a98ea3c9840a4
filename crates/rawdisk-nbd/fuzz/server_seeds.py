#!/usr/bin/env python3
"""Writes the hand-made seeds of the `server` fuzz target to corpus/server/.

Each seed is what a client sends to the server (handshake, then requests);
the target feeds it over an in-memory stream and then closes the stream.
The export is the target's 1 MiB scratch file, default export name "".
Run from this directory: python3 server_seeds.py
"""

import os
import struct

IHAVEOPT = 0x49484156454F5054
REQUEST_MAGIC = 0x25609513
EXTENDED_REQUEST_MAGIC = 0x21E41C71

OPT_EXPORT_NAME, OPT_ABORT, OPT_LIST, OPT_STARTTLS = 1, 2, 3, 5
OPT_INFO, OPT_GO, OPT_STRUCTURED_REPLY = 6, 7, 8
OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT, OPT_EXTENDED_HEADERS = 9, 10, 11
INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE = 1, 2, 3

READ, WRITE, DISC, FLUSH, TRIM, CACHE, WRITE_ZEROES, BLOCK_STATUS = range(8)
FUA, NO_HOLE, DF, REQ_ONE, FAST_ZERO, PAYLOAD_LEN = (1 << i for i in range(6))

CLIENT_FLAGS = struct.pack(">I", 3)  # FIXED_NEWSTYLE | NO_ZEROES


def opt(option, data=b""):
    return struct.pack(">QII", IHAVEOPT, option, len(data)) + data


def name(s):
    b = s.encode()
    return struct.pack(">I", len(b)) + b


def go(export="", infos=()):
    data = name(export) + struct.pack(">H", len(infos))
    data += b"".join(struct.pack(">H", i) for i in infos)
    return opt(OPT_GO, data)


def meta(option, export="", queries=("base:allocation",)):
    data = name(export) + struct.pack(">I", len(queries))
    data += b"".join(name(q) for q in queries)
    return opt(option, data)


def req(typ, offset=0, length=0, flags=0, cookie=1, payload=b""):
    h = struct.pack(">IHHQQI", REQUEST_MAGIC, flags, typ, cookie, offset, length)
    return h + payload


def ext_req(typ, offset=0, length=0, flags=0, cookie=1, payload=b""):
    h = struct.pack(">IHHQQQ", EXTENDED_REQUEST_MAGIC, flags, typ, cookie, offset, length)
    return h + payload


def data(n, seed):
    return bytes((seed + i * 7) & 0xFF for i in range(n))


SEEDS = {
    # Simple replies: every command once, then a clean disconnect.
    "simple-every-command": CLIENT_FLAGS
    + go()
    + req(WRITE, 4096, 4096, cookie=1, payload=data(4096, 1))
    + req(READ, 4096, 4096, cookie=2)
    + req(WRITE, 0, 512, FUA, cookie=3, payload=data(512, 2))
    + req(FLUSH, cookie=4)
    + req(TRIM, 65536, 65536, cookie=5)
    + req(WRITE_ZEROES, 131072, 65536, NO_HOLE, cookie=6)
    + req(CACHE, 0, 65536, cookie=7)
    + req(READ, 0, 131072, cookie=8)
    + req(DISC, cookie=9),
    # Structured replies and base:allocation: sparse reads and block status.
    "structured-block-status": CLIENT_FLAGS
    + opt(OPT_STRUCTURED_REPLY)
    + meta(OPT_LIST_META_CONTEXT, queries=())
    + meta(OPT_SET_META_CONTEXT)
    + go(infos=(INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE))
    + req(TRIM, 0, 262144, cookie=1)
    + req(READ, 0, 131072, cookie=2)
    + req(READ, 0, 4096, DF, cookie=3)
    + req(BLOCK_STATUS, 0, 1 << 20, cookie=4)
    + req(BLOCK_STATUS, 0, 1 << 20, REQ_ONE, cookie=5)
    + req(WRITE_ZEROES, 0, 4096, FAST_ZERO, cookie=6)
    + req(DISC, cookie=7),
    # Extended headers: 64-bit lengths, payload-length flag, an unknown
    # command with a payload, many small requests in one burst.
    "extended-headers": CLIENT_FLAGS
    + opt(OPT_EXTENDED_HEADERS)
    + meta(OPT_SET_META_CONTEXT)
    + go()
    + ext_req(WRITE, 8192, 1024, PAYLOAD_LEN, cookie=1, payload=data(1024, 3))
    + ext_req(0x55, 0, 16, PAYLOAD_LEN, cookie=2, payload=data(16, 4))
    + b"".join(ext_req(READ, i * 4096, 4096, cookie=10 + i) for i in range(20))
    + ext_req(BLOCK_STATUS, 0, 1 << 20, cookie=3)
    + ext_req(WRITE_ZEROES, 0, 1 << 40, cookie=4)
    + ext_req(DISC, cookie=5),
    # The old way in: NBD_OPT_EXPORT_NAME, after LIST, INFO and a refused
    # STARTTLS; then the client vanishes mid-payload.
    "export-name-then-eof": CLIENT_FLAGS
    + opt(OPT_LIST)
    + opt(OPT_INFO, name("") + struct.pack(">H", 0))
    + opt(OPT_STARTTLS)
    + opt(OPT_EXPORT_NAME, b"")
    + req(READ, 0, 512, cookie=1)
    + req(WRITE, 0, 65536, cookie=2, payload=data(1000, 5)),
    # Refusals that keep the connection: bad flags, out of bounds, unknown
    # command, block status without a context; then a bad magic ends it.
    "refusals-then-bad-magic": CLIENT_FLAGS
    + opt(99, b"xyz")
    + go("no-such-export")
    + opt(OPT_STRUCTURED_REPLY)
    + opt(OPT_STRUCTURED_REPLY)
    + go()
    + req(READ, 0, 512, 1 << 7, cookie=1)
    + req(READ, (1 << 20) - 10, 11, cookie=2)
    + req(WRITE, (1 << 64) - 1, 8, cookie=3, payload=data(8, 6))
    + req(BLOCK_STATUS, 0, 4096, cookie=4)
    + req(99, cookie=5)
    + req(READ, 0, 512 << 10, cookie=6)
    + b"\xde\xad\xbe\xef" + bytes(24),
    # A write announcing more than the maximum payload: answered, then the
    # server hangs up.
    "oversized-payload": CLIENT_FLAGS + go() + req(WRITE, 0, 1 << 30, cookie=1) + data(64, 7),
    # Handshake abuse: an option too big to read, after an ABORT-less LIST.
    "huge-option": CLIENT_FLAGS + opt(OPT_LIST) + struct.pack(">QII", IHAVEOPT, OPT_GO, 1 << 30),
    # Unknown client flags: dropped at once.
    "unknown-client-flags": struct.pack(">I", 0xFF) + go(),
    # A polite goodbye during the handshake.
    "abort": CLIENT_FLAGS + opt(OPT_ABORT),
}

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "server")
    os.makedirs(out, exist_ok=True)
    for seed, b in SEEDS.items():
        with open(os.path.join(out, "seed-" + seed), "wb") as f:
            f.write(b)
