#!/usr/bin/python3
"""One NBD request at a time: the server's latency per request.

Usage: qd1.py URI OP SIZE COUNT    (OP: r, w, or f: a write and a FLUSH)
Prints the mean microseconds per request (f: per write and its flush). Requests cycle over the first
512 MiB of the export, so a dirty target keeps its pages (no allocation in
the measurement) and the client's own cost (libnbd + Python) is the same
for every server.
"""
import os
import sys
import time

import nbd

uri, op, size, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
h = nbd.NBD()
h.connect_uri(uri)
span = min(512 << 20, h.get_size()) // size * size
buf = os.urandom(size)
t0 = time.perf_counter()
for i in range(count):
    off = (i * size) % span
    if op == "w":
        h.pwrite(buf, off)
    elif op == "f":
        h.pwrite(buf, off)
        h.flush()
    else:
        h.pread(size, off)
dt = time.perf_counter() - t0
print(f"{dt / count * 1e6:.1f}")
h.shutdown()
