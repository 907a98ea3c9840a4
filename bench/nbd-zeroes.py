#!/usr/bin/python3
"""NBD_CMD_WRITE_ZEROES over a whole export, DEPTH requests of CHUNK bytes in
flight, then a FLUSH. Prints "SECONDS ok", or "SECONDS errno N" for the
first request that failed. Used by bench/zero-holes.sh and bench/nfs-seed.sh.

Usage: nbd-zeroes.py URI CHUNK DEPTH [nohole|trim]   (default nohole)"""
import sys
import time

import nbd

uri, chunk, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
flags = nbd.CMD_FLAG_NO_HOLE if (sys.argv[4:] or ["nohole"])[0] == "nohole" else 0
h = nbd.NBD()
h.connect_uri(uri)
size, errors, off = h.get_size(), [], 0


def done(err):
    if err.value:
        errors.append(err.value)
    return 1


t0 = time.monotonic()
while off < size or h.aio_in_flight() > 0:
    while off < size and h.aio_in_flight() < depth:
        n = min(chunk, size - off)
        h.aio_zero(n, off, completion=done, flags=flags)
        off += n
    h.poll(-1)
h.flush()
dt = time.monotonic() - t0
h.shutdown()
print("%.4f %s" % (dt, "ok" if not errors else "errno %d" % errors[0]))
