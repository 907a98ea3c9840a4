"""`rawdisk map` on a badly fragmented file, locally and over NBD: the same
bytes as `qemu-img map`, memory that does not grow with the number of
extents, lookups bounded by the range asked for, and a reader that closes
the pipe early ends it quietly."""

import functools
import hashlib
import os
import re
import shutil
import subprocess

import pytest

import servers
import storage
from conftest import require_root

KiB = 1024
MiB = 1024 * KiB
BLOCK = 4096
# Data in every other block: 2 * PAIRS runs, alternating hole and data.
PAIRS = 100_000
SIZE = PAIRS * 2 * BLOCK
SMALL_PAIRS = 500
# Peak RSS of a map, whatever the extent count (qemu-img map: under 8 MiB).
RSS_BOUND_KIB = 16 * 1024
# Growth of the peak from a few hundred runs to 200,000.
RSS_GROWTH_KIB = 4 * 1024


def fragmented(directory, name, pairs):
    """A file of `pairs` hole/data pairs of one block each, the data blocks
    holding their own index so no two read alike."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
    try:
        os.ftruncate(fd, pairs * 2 * BLOCK)
        for i in range(pairs):
            os.pwrite(fd, i.to_bytes(8, "little") * (BLOCK // 8), (2 * i + 1) * BLOCK)
    finally:
        os.close(fd)
    return path


def digest(path):
    h = hashlib.blake2b()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def frag():
    """(big, small): fragmented files on a private tmpfs, checked unchanged
    by every map at the end."""
    require_root()
    with storage.tmpfs(SIZE // MiB + 64) as d:
        big = fragmented(d, "big.img", PAIRS)
        small = fragmented(d, "small.img", SMALL_PAIRS)
        before = {p: digest(p) for p in (big, small)}
        yield big, small
        for p, h in before.items():
            assert digest(p) == h, f"map changed {p}"


def run_measured(argv, out_path):
    """Runs argv with stdout to out_path; returns (exit code, stderr, peak
    RSS in KiB of that process alone). GNU time measures it: a child forked
    from this (large) Python process would start its peak at Python's."""
    rss_path = out_path + ".rss"
    with open(out_path, "wb") as out:
        res = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss_path, *argv],
                             stdout=out, stderr=subprocess.PIPE, timeout=120)
    with open(rss_path) as f:
        peak = int(f.read().split()[-1])
    return res.returncode, res.stderr.decode(errors="replace"), peak


def qemu_map(target, *args):
    res = subprocess.run(["qemu-img", "map", *args, target], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


@functools.lru_cache(maxsize=None)
def expected(path, output, *opts, name=None):
    """qemu-img map's output for the file at `path`; `name`: for an NBD
    export of it, that URI's File column as qemu-img prints it. Over NBD the
    runs are the file's (crates/rawdisk/tests/map.rs checks qemu-img over
    NBD on a small image); asking qemu-img here would take 200,000
    one-extent requests."""
    out = qemu_map(path, f"--output={output}", "-f", "raw", *opts)
    if name is not None and output == "human":
        # One data block: qemu-img's own spelling of the export's URI.
        one = qemu_map(name, "--output=human", "--start-offset", str(BLOCK),
                       "--max-length", str(BLOCK))
        spelled = one.split(b"\n")[1][48:]
        lines = out.split(b"\n")
        out = b"\n".join(lines[:1] + [ln[:48] + spelled if ln else ln for ln in lines[1:]])
    return out


def nbd_uri_for(serve, path):
    return serve(path, read_only=True).uri


@pytest.mark.parametrize("where", ["local", "nbd"])
@pytest.mark.parametrize("output", ["json", "human"])
def test_memory_flat_with_many_extents(frag, workdir, serve, where, output):
    big, small = frag
    peaks = {}
    for path in (small, big):
        target = path if where == "local" else nbd_uri_for(serve, path)
        out = os.path.join(workdir, "map.out")
        code, err, peak = run_measured(
            [servers.RAWDISK_BIN, "map", "--output", output, target], out)
        assert code == 0 and err == "", err
        with open(out, "rb") as f:
            ours = f.read()
        want = expected(path, output, name=None if where == "local" else target)
        assert ours == want, f"map of {target} differs from qemu-img's"
        peaks[path] = peak
    runs = 2 * PAIRS
    assert (output == "human" and ours.count(b"\n") == 1 + PAIRS) or \
        (output == "json" and ours.count(b"\n") == runs)
    assert peaks[big] <= RSS_BOUND_KIB, \
        f"peak RSS {peaks[big]} KiB mapping {runs} runs ({where}, {output})"
    assert peaks[big] - peaks[small] <= RSS_GROWTH_KIB, \
        f"peak RSS grows with the extent count: {peaks}"


def lookups(argv):
    """(stdout, number of lseek SEEK_DATA/SEEK_HOLE calls) of argv."""
    with storage.scratch_dir() as d:
        log = os.path.join(d, "strace.log")
        res = subprocess.run(["strace", "-f", "-qq", "-e", "trace=lseek", "-o", log, *argv],
                             capture_output=True, timeout=120)
        assert res.returncode == 0, res.stderr
        with open(log) as f:
            n = len(re.findall(r"SEEK_(DATA|HOLE)", f.read()))
    return res.stdout, n


RANGES = [
    # (start, max_length): None leaves the option out.
    (BLOCK + 100, 1000),                  # inside one data block
    (2 * BLOCK + 1, 3 * BLOCK),           # from inside a hole to inside data
    (2 * BLOCK, 2 * BLOCK),               # a whole hole and data, at boundaries
    (200 * BLOCK, 64 * KiB),              # sixteen runs, at boundaries
    (None, 3 * BLOCK + 7),                # from the start, ending inside data
    (SIZE - 5 * BLOCK, None),             # to the end
    (SIZE - BLOCK, 64 * MiB),             # past the end
    (SIZE // 2, 0),                       # nothing
    (SIZE, None),                         # at the end
    (SIZE + BLOCK, 1000),                 # beyond the end
    (0, 0),
]


@pytest.mark.parametrize("start,length", RANGES, ids=[f"{s}+{n}" for s, n in RANGES])
def test_range_is_qemu_imgs_and_looks_up_only_the_range(frag, start, length):
    assert shutil.which("strace"), "strace is missing (scripts/deps.sh installs it)"
    big, _ = frag
    opts = []
    if start is not None:
        opts += ["--start-offset", str(start)]
    if length is not None:
        opts += ["--max-length", str(length)]
    for output in ("json", "human"):
        ours, n = lookups([servers.RAWDISK_BIN, "map", "--output", output, *opts, big])
        assert ours == expected(big, output, *opts), (output, opts)
        # One lookup per run: SEEK_DATA ends a hole where data starts, so
        # only SEEK_HOLE is asked there; plus one at the range's start.
        s = start or 0
        end = min(SIZE, s + length) if length is not None else SIZE
        runs = 0 if s >= end else (end - 1) // BLOCK - s // BLOCK + 1
        assert n <= runs + 1, f"{n} lookups for {runs} runs ({output}, {opts})"


@pytest.mark.parametrize("where", ["local", "nbd"])
@pytest.mark.parametrize("output", ["json", "human"])
def test_closed_pipe_ends_quietly(frag, serve, where, output):
    big, _ = frag
    target = big if where == "local" else nbd_uri_for(serve, big)
    # What `rawdisk map ... | head -c 300` does: read a little, then close.
    p = subprocess.Popen([servers.RAWDISK_BIN, "map", "--output", output, target],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = p.stdout.read(300)
    p.stdout.close()
    try:
        err = p.stderr.read()
        code = p.wait(timeout=60)
    finally:
        p.kill()
    assert head == expected(big, output, name=None if where == "local" else target)[:300]
    # qemu-img map ignores SIGPIPE and exits 0 without a word.
    assert err == b"", err.decode(errors="replace")
    assert code == 0
