"""A soak run: for SOAK_SECONDS (60 in the suite; scripts/soak.sh --minutes N
for longer) the server gets everything at once: connection churn with
abrupt closes (mid-handshake, mid-payload, with requests in flight), clients
that never read their replies, silent connections, and verified random I/O
from several clients. Throughout, a normal 4 KiB read is answered within a
second; at the end descriptors and memory are back to their baseline and
every byte of the export matches the model."""

import os
import random
import socket
import struct
import threading
import time

import nbd

import wire
from helpers import KiB, MiB, assert_export_is, assert_target_is, connected, make_image

SECONDS = float(os.environ.get("SOAK_SECONDS", "60"))
SIZE = 64 * MiB
# [0, 24 MiB): read-only (non-readers, probe); [24, 28 MiB): abrupt
# clients send partial writes here, which must never land; [32, 64 MiB):
# the verified writers, 8 MiB each.
WRITERS = 4
WRITER_BASE = 32 * MiB
WRITER_SPAN = 8 * MiB
PARTIAL_BASE = 24 * MiB


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


class Soak:
    def __init__(self, srv, model):
        self.srv = srv
        self.model = model
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors = []
        self.latencies = []
        self.counts = {}

    def count(self, what, n=1):
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def run(self, name, fn, *args):
        def body():
            try:
                fn(*args)
            except Exception as e:  # reported by the test
                self.errors.append(f"{name}: {type(e).__name__}: {e}")
                self.stop.set()
        t = threading.Thread(target=body, name=name, daemon=True)
        t.start()
        return t

    def writer(self, k):
        rnd = random.Random(900 + k)
        base = WRITER_BASE + k * WRITER_SPAN
        with connected(self.srv.uri, name=f"writer{k}") as h:
            while not self.stop.is_set():
                n = rnd.choice([512, 4 * KiB, 64 * KiB, 256 * KiB, MiB])
                off = base + rnd.randrange(0, WRITER_SPAN - n + 1, 512)
                if rnd.random() < 0.5:
                    data = rnd.randbytes(n)
                    h.pwrite(data, off, flags=nbd.CMD_FLAG_FUA if rnd.random() < 0.1 else 0)
                    self.model[off:off + n] = data
                    self.count("writes")
                else:
                    got = h.pread(n, off)
                    if got != self.model[off:off + n]:
                        raise AssertionError(f"writer{k}: read at {off} ({n} bytes) differs")
                    self.count("reads")

    def probe(self):
        """A normal client: one 4 KiB read every 0.2 s, each answered
        within a second."""
        rnd = random.Random(7)
        with connected(self.srv.uri, name="probe") as h:
            while not self.stop.is_set():
                off = rnd.randrange(0, 24 * MiB - 4 * KiB, 4 * KiB)
                buf = nbd.Buffer(4 * KiB)
                t0 = time.monotonic()
                cookie = h.aio_pread(buf, off)
                while not h.aio_command_completed(cookie):
                    if time.monotonic() - t0 > 5:
                        raise AssertionError("probe read not answered within 5 s")
                    h.poll(100)
                took = time.monotonic() - t0
                self.latencies.append(took)
                if took >= 1:
                    raise AssertionError(f"probe read took {took:.2f} s")
                if buf.to_bytearray() != self.model[off:off + 4 * KiB]:
                    raise AssertionError(f"probe read at {off} differs")
                time.sleep(0.2)

    def churn(self, seed):
        """Connections that end abruptly at every stage."""
        rnd = random.Random(seed)
        while not self.stop.is_set():
            s = self.srv.connect_unix_or_tcp()
            try:
                c = wire.RawClient(s)
                stage = rnd.randrange(6)
                if stage >= 1:
                    c.read_greeting()
                if stage >= 2:
                    c.send_client_flags()
                if stage == 3:
                    s.sendall(struct.pack(">QII", wire.IHAVEOPT, wire.OPT_GO, 100) + b"\0" * 10)
                if stage >= 4:
                    c.go()
                if stage == 4:
                    # Requests in flight, then gone.
                    for i in range(16):
                        c.send_request(wire.CMD_READ, i * 64 * KiB, 64 * KiB)
                if stage == 5:
                    # Half a write's payload, then gone: none of it may land.
                    off = PARTIAL_BASE + rnd.randrange(0, 3 * MiB, 4096)
                    c.send_request(wire.CMD_WRITE, off, MiB)
                    s.sendall(b"\xee" * rnd.randrange(1, MiB))
                if rnd.random() < 0.5:
                    # RST instead of FIN.
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except (wire.Closed, OSError):
                pass
            finally:
                s.close()
            self.count("churned")
            time.sleep(rnd.random() * 0.02)

    def non_readers(self):
        """Five at a time, 128 reads of 1 MiB each (more than the server's
        byte budgets together), never read, held for a couple of seconds,
        then dropped."""
        rnd = random.Random(11)
        while not self.stop.is_set():
            held = []
            for _ in range(5):
                c = wire.RawClient(self.srv.connect_unix_or_tcp()).start().go()
                c.sock.sendall(b"".join(
                    wire.request_bytes(wire.CMD_READ, rnd.randrange(0, 23) * MiB, MiB, cookie=i)
                    for i in range(128)))
                held.append(c.sock)
            self.stop.wait(2)
            for s in held:
                s.close()
            self.count("non_readers", len(held))

    def silent(self):
        """Connections that never say a word, 20 at a time for 3 s."""
        while not self.stop.is_set():
            held = [self.srv.connect_unix_or_tcp() for _ in range(20)]
            self.stop.wait(3)
            for s in held:
                s.close()
            self.count("silent", len(held))


def test_soak(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=80)
    srv = serve(path)
    fds = fd_count(srv.pid)
    # Threads and pools start; the pools are let go once it is over.
    with connected(srv.uri) as h:
        assert h.pread(4 * MiB, 0) == model[:4 * MiB]
    time.sleep(0.5)
    rss = srv.status("VmRSS")
    soak = Soak(srv, model)
    threads = [soak.run("probe", soak.probe)]
    threads += [soak.run(f"writer{k}", soak.writer, k) for k in range(WRITERS)]
    threads += [soak.run(f"churn{k}", soak.churn, k) for k in range(2)]
    threads += [soak.run("non_readers", soak.non_readers), soak.run("silent", soak.silent)]
    soak.stop.wait(SECONDS)
    soak.stop.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), f"{t.name} still running"
    assert not soak.errors, "\n".join(soak.errors)
    srv.assert_alive()
    lat = sorted(soak.latencies)
    assert lat, "the probe never ran"
    print(f"soak {SECONDS:.0f} s: {soak.counts}; probe reads {len(lat)}, "
          f"median {lat[len(lat) // 2] * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms")
    assert soak.counts.get("writes", 0) > 0 and soak.counts.get("non_readers", 0) > 0

    deadline = time.monotonic() + 10
    while fd_count(srv.pid) > fds and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fd_count(srv.pid) <= fds, f"{fd_count(srv.pid)} descriptors open, {fds} at the start"
    grown = srv.status("VmRSS") - rss
    print(f"RSS {rss >> 20} MiB at the start, {grown / MiB:+.1f} MiB at the end; "
          f"{fds} descriptors")
    assert grown < 32 * MiB, f"RSS {grown >> 20} MiB above the start with no client"
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)
