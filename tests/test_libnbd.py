"""python3-libnbd against the server: 64 requests in flight at once, all
verified; structured replies (DF reads, chunked reads of sparse ranges);
block status equal to the kernel's SEEK_HOLE truth; zero with and without
may-trim; read-only exports refusing every write with EPERM; requests past
the end answered with the spec's errors while the connection stays usable;
several connections to one export (a flush on one covers writes made on
another, which is what CAN_MULTI_CONN promises)."""

import errno

import nbd
import pytest

from helpers import (KiB, MiB, allocated_bytes, assert_export_is, assert_target_is, connected,
                     is_hole_at, make_image, random_bytes, seek_hole_extents, wait_all)

SIZE = 32 * MiB


@pytest.fixture
def export(workdir, serve):
    path, model = make_image(workdir, "disk.img", SIZE, seed=21)
    return path, model, serve(path)


@pytest.fixture
def sparse_export(workdir, serve):
    path, model = make_image(workdir, "sparse.img", SIZE, seed=22, sparse=True)
    return path, model, serve(path)


def block_status_extents(h, offset, length, flags=0):
    """All base:allocation extents covering [offset, offset+length)."""
    out = []
    pos = offset
    while pos < offset + length:
        got = []

        def cb(context, off, entries, err):
            if context == nbd.CONTEXT_BASE_ALLOCATION:
                got.append((off, list(entries)))
            return 0

        h.block_status(offset + length - pos, pos, cb, flags)
        assert len(got) == 1, got
        off, entries = got[0]
        assert off == pos
        assert entries, "empty block status reply"
        for i in range(0, len(entries), 2):
            out.append((pos, entries[i], entries[i + 1]))
            pos += entries[i]
    return out


def test_64_writes_then_64_reads_in_flight(export):
    path, model, srv = export
    with connected(srv.uri) as h:
        writes = {}
        for i in range(64):
            # Odd sizes and offsets that straddle pages, spread over the export.
            off = i * (SIZE // 64) + 1000 + i
            data = random_bytes(64 * KiB + 7 * i, seed=100 + i)
            cookie = h.aio_pwrite(nbd.Buffer.from_bytearray(data), off)
            writes[cookie] = (off, data)
            model[off:off + len(data)] = data
        assert h.aio_in_flight() == 64
        assert set(wait_all(h, writes).values()) == {0}
        reads = {}
        for i in range(64):
            off = i * (SIZE // 64) + 500
            n = 96 * KiB + i
            buf = nbd.Buffer(n)
            reads[h.aio_pread(buf, off)] = (off, n, buf)
        assert set(wait_all(h, reads).values()) == {0}
        for off, n, buf in reads.values():
            assert buf.to_bytearray() == model[off:off + n], f"read at {off}"
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


def read_chunks(h, count, offset, flags=0):
    chunks = []

    def chunk(buf, off, status, err):
        chunks.append((off, status, bytes(buf)))
        return 0

    data = h.pread_structured(count, offset, chunk, flags)
    return data, sorted(chunks)


def test_df_read_of_a_sparse_range_is_one_data_chunk(sparse_export):
    """NBD_CMD_FLAG_DF: the server must not fragment the reply, so even a
    range full of holes comes back as a single data chunk."""
    _, model, srv = sparse_export
    with connected(srv.uri) as h:
        assert h.get_structured_replies_negotiated()
        assert h.can_df()
        data, chunks = read_chunks(h, MiB, MiB - 12345, nbd.CMD_FLAG_DF)
    assert data == model[MiB - 12345:2 * MiB - 12345]
    assert [(off, status, len(buf)) for off, status, buf in chunks] == \
        [(MiB - 12345, nbd.READ_DATA, MiB)]


def test_structured_read_chunks_cover_the_range_once(sparse_export):
    _, model, srv = sparse_export
    with connected(srv.uri) as h:
        data, chunks = read_chunks(h, 4 * MiB, 3 * MiB - 100)
    assert data == model[3 * MiB - 100:7 * MiB - 100]
    pos = 3 * MiB - 100
    for off, status, buf in chunks:
        assert off == pos, chunks[:5]
        assert status in (nbd.READ_DATA, nbd.READ_HOLE)
        if status == nbd.READ_DATA:
            assert buf == model[off:off + len(buf)]
            pos += len(buf)
        else:
            # A hole chunk carries only its length; the bytes must be zero.
            n = len(buf)
            assert model[off:off + n] == bytes(n), f"hole chunk over data at {off}"
            pos += n
    assert pos == 7 * MiB - 100


@pytest.mark.rawdisk_only("nbdkit 1.32 sends only data chunks")
def test_read_of_a_hole_uses_hole_chunks(sparse_export):
    _, model, srv = sparse_export
    with connected(srv.uri) as h:
        data, chunks = read_chunks(h, 2 * MiB, MiB)
    assert data == model[MiB:3 * MiB]
    assert any(status == nbd.READ_HOLE for _, status, _ in chunks), \
        "no hole chunk for a range the file system knows are holes"


@pytest.mark.parametrize("req_one", [False, True], ids=["all", "req_one"])
def test_block_status_matches_seek_hole(sparse_export, req_one):
    path, model, srv = sparse_export
    truth = seek_hole_extents(path)
    flags = nbd.CMD_FLAG_REQ_ONE if req_one else 0
    with connected(srv.uri, meta=True) as h:
        assert h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
        extents = block_status_extents(h, 0, SIZE, flags)
    assert extents[0][0] == 0 and sum(e[1] for e in extents) >= SIZE
    for start, length, state in extents:
        end = min(start + length, SIZE)
        hole = bool(state & nbd.STATE_HOLE)
        for off in range(start, end, 4 * KiB):
            assert is_hole_at(truth, off) == hole, (start, length, state)
        if state & nbd.STATE_ZERO:
            assert model[start:end] == bytes(end - start)
    reported_holes = sum(min(s + n, SIZE) - s for s, n, st in extents if st & nbd.STATE_HOLE)
    assert reported_holes == sum(n for _, n, hole in truth if hole)


def test_zero_with_may_trim_punches_a_hole(export):
    path, model, srv = export
    before = allocated_bytes(path)
    with connected(srv.uri) as h:
        h.zero(8 * MiB, 4 * MiB)
        h.flush()
    model[4 * MiB:12 * MiB] = bytes(8 * MiB)
    assert allocated_bytes(path) <= before - 7 * MiB
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


def test_zero_with_no_hole_keeps_the_allocation(export):
    path, model, srv = export
    before = allocated_bytes(path)
    with connected(srv.uri) as h:
        h.zero(8 * MiB, 4 * MiB, nbd.CMD_FLAG_NO_HOLE)
        h.zero(1, SIZE - 1, nbd.CMD_FLAG_NO_HOLE)
        h.flush()
    model[4 * MiB:12 * MiB] = bytes(8 * MiB)
    model[SIZE - 1] = 0
    assert allocated_bytes(path) >= before - 64 * KiB
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


def test_fua_writes_trim_and_cache(export):
    path, model, srv = export
    with connected(srv.uri) as h:
        assert h.can_fua() and h.can_cache() and h.can_trim()
        data = random_bytes(300 * KiB + 1, seed=5)
        h.pwrite(data, 777, nbd.CMD_FLAG_FUA)
        model[777:777 + len(data)] = data
        h.zero(65536, 2 * MiB, nbd.CMD_FLAG_FUA)
        model[2 * MiB:2 * MiB + 65536] = bytes(65536)
        h.cache(4 * MiB, 0)
        h.trim(MiB, 20 * MiB, nbd.CMD_FLAG_FUA)
        h.flush()
        # TRIM leaves the contents undefined by the protocol; on this file
        # system it punches, so the range reads as zeros.
        model[20 * MiB:21 * MiB] = bytes(MiB)
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


def test_read_only_refuses_every_write(workdir, serve):
    path, model = make_image(workdir, "disk.img", 4 * MiB, seed=23)
    srv = serve(path, read_only=True)
    with connected(srv.uri, strict=False) as h:
        assert h.is_read_only()
        with pytest.raises(nbd.Error) as e:
            h.pwrite(b"x" * 4096, 0)
        assert e.value.errnum == errno.EPERM
        with pytest.raises(nbd.Error) as e:
            h.zero(4096, 4096)
        assert e.value.errnum == errno.EPERM
        with pytest.raises(nbd.Error) as e:
            h.trim(4096, 8192)
        assert e.value.errnum == errno.EPERM
        assert h.pread(4096, 0) == model[:4096]
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


PAST_END = [
    # (name, expected errno, call) -- the spec: ENOSPC for writes (and
    # write-zeroes) beyond the end, EINVAL for reads and trims.
    ("write", errno.ENOSPC, lambda h, off, n: h.pwrite(b"\xee" * n, off)),
    ("zero", errno.ENOSPC, lambda h, off, n: h.zero(n, off)),
    ("read", errno.EINVAL, lambda h, off, n: h.pread(n, off)),
    ("trim", errno.EINVAL, lambda h, off, n: h.trim(n, off)),
]


@pytest.mark.parametrize("name,expected,call", PAST_END, ids=[p[0] for p in PAST_END])
@pytest.mark.parametrize("where", ["straddling", "beyond"])
def test_request_past_the_end(export, name, expected, call, where):
    path, model, srv = export
    off, n = (SIZE - 4096, 8192) if where == "straddling" else (SIZE + MiB, 4096)
    with connected(srv.uri, strict=False) as h:
        with pytest.raises(nbd.Error) as e:
            call(h, off, n)
        assert e.value.errnum == expected, f"{name} past the end: {e.value}"
        # The connection is still usable after the error.
        assert h.pread(8192, SIZE - 8192) == model[SIZE - 8192:]
        h.pwrite(b"\x42" * 10, SIZE - 10)
        model[SIZE - 10:] = b"\x42" * 10
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


def test_multi_conn_flush_covers_other_connections(export):
    path, model, srv = export
    with connected(srv.uri, name="a") as a, connected(srv.uri, name="b") as b, \
            connected(srv.uri, name="c") as c:
        assert a.can_multi_conn()
        for i, h in enumerate((a, b, c)):
            data = random_bytes(200 * KiB, seed=40 + i)
            off = i * 3 * MiB + 333
            h.pwrite(data, off)
            model[off:off + len(data)] = data
        # CAN_MULTI_CONN: a flush on one connection covers the writes the
        # server completed on all of them.
        a.flush()
        for h in (a, b, c):
            assert h.pread(10 * MiB, 0) == model[:10 * MiB]
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


def test_connections_in_parallel_with_requests_in_flight(export):
    path, model, srv = export
    handles = [connected(srv.uri, name=f"c{i}") for i in range(4)]
    hs = [cm.__enter__() for cm in handles]
    try:
        cookies = []
        for i, h in enumerate(hs):
            mine = []
            for j in range(16):
                off = (i * 16 + j) * 512 * KiB + 1
                data = random_bytes(128 * KiB, seed=1000 + i * 16 + j)
                mine.append(h.aio_pwrite(nbd.Buffer.from_bytearray(data), off))
                model[off:off + len(data)] = data
            cookies.append(mine)
        for h, mine in zip(hs, cookies):
            assert set(wait_all(h, mine).values()) == {0}
            h.flush()
    finally:
        for cm in handles:
            cm.__exit__(None, None, None)
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)


def test_every_command_kind_in_flight_at_once(sparse_export):
    """Big reads, writes, zeroes, trims, cache, block status and flushes all
    in flight on one connection: replies come back in any order but never
    interleave (libnbd fails the connection if a reply is torn), and the
    disjoint ranges end up exactly as the model says."""
    path, model, srv = sparse_export
    seen_extents = []

    def extent(context, off, entries, err):
        seen_extents.append((context, off, len(entries)))
        return 0

    with connected(srv.uri, meta=True) as h:
        cookies, reads = [], []
        for i in range(8):
            base = i * 4 * MiB
            data = random_bytes(MiB, seed=900 + i)
            cookies.append(h.aio_pwrite(nbd.Buffer.from_bytearray(data), base))
            model[base:base + MiB] = data
            buf = nbd.Buffer(2 * MiB - 3)
            reads.append((h.aio_pread(buf, base + MiB + 1), base + MiB + 1, buf))
            cookies.append(h.aio_zero(256 * 1024, base + 3 * MiB))
            model[base + 3 * MiB:base + 3 * MiB + 256 * 1024] = bytes(256 * 1024)
            cookies.append(h.aio_trim(128 * 1024, base + 3 * MiB + 512 * 1024))
            model[base + 3 * MiB + 512 * 1024:base + 3 * MiB + 640 * 1024] = bytes(128 * 1024)
            cookies.append(h.aio_cache(MiB, base + MiB))
            cookies.append(h.aio_block_status(MiB, base + MiB, extent))
            cookies.append(h.aio_flush())
        # Reads look only at ranges nothing in flight writes to.
        results = wait_all(h, cookies + [c for c, _, _ in reads])
        assert set(results.values()) == {0}, results
        for _, off, buf in reads:
            assert buf.to_bytearray() == model[off:off + 2 * MiB - 3], f"read at {off}"
    assert len(seen_extents) == 8 and all(c == nbd.CONTEXT_BASE_ALLOCATION for c, _, _ in seen_extents)
    assert_export_is(srv.uri, model)
    assert_target_is(path, model)
