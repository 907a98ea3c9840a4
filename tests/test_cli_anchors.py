"""The anchors' flags where their users type them (qemu-img convert -n and
-o preallocation=, nbdcopy's `-` source and --progress=FD, qemu-img's -r
rate limit, blksum's digests), each byte of the result checked; and
advice that is true (no --read-only hint for a file that cannot be read)."""

import os
import re
import subprocess
import time

import pytest

import servers
from helpers import MiB, allocated_bytes, assert_target_is, make_image, random_bytes

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")

BIN = servers.RAWDISK_BIN


def rawdisk(*args, **kw):
    kw.setdefault("capture_output", True)
    return subprocess.run([BIN, *args], timeout=120, **kw)


def ok(r):
    assert r.returncode == 0, r.stderr
    return r


def test_copy_n_uses_an_existing_destination_and_creates_none(workdir):
    src, model = make_image(workdir, "src.img", 3 * MiB + 512, seed=3, sparse=True)
    dst = os.path.join(workdir, "dst.img")
    with open(dst, "wb") as f:
        f.write(b"\xaa" * (3 * MiB + 512))
    ok(rawdisk("copy", "-q", "-n", src, dst))
    assert_target_is(dst, model)
    missing = os.path.join(workdir, "missing.img")
    r = rawdisk("copy", "-n", src, missing, text=True)
    assert r.returncode == 1 and "-n" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not os.path.exists(missing)


@pytest.mark.parametrize("cmd", ["create", "copy"])
def test_o_preallocation_is_qemu_imgs_spelling(workdir, cmd):
    src, model = make_image(workdir, "src.img", 2 * MiB, seed=4, sparse=True)
    out = os.path.join(workdir, "out.img")
    args = [out, "2M"] if cmd == "create" else [src, out]
    ok(rawdisk(cmd, "-q", "-o", "preallocation=full", *args))
    assert os.path.getsize(out) == 2 * MiB
    assert allocated_bytes(out) >= 2 * MiB
    assert_target_is(out, model if cmd == "copy" else bytes(2 * MiB))
    os.unlink(out)
    for bad, word in [("cluster_size=64k", "'cluster_size'"),
                      ("preallocation=full,compat=1.1", "'compat'"),
                      ("preallocation=metadata", "'metadata'")]:
        r = rawdisk(cmd, "-o", bad, *args, text=True)
        assert r.returncode == 2 and word in r.stderr, (bad, r.returncode, r.stderr)
        assert not os.path.exists(out)
    r = rawdisk(cmd, "-o", "preallocation=off", "--preallocation", "full", *args, text=True)
    assert r.returncode == 2 and "different" in r.stderr, r.stderr


def as_nobody(args):
    """Run as an unprivileged user: root reads any file."""
    if os.geteuid() == 0:
        return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *args]
    return args


def test_only_a_readable_file_is_told_to_serve_read_only(workdir):
    os.chmod(workdir, 0o755)
    img = os.path.join(workdir, "a.img")
    with open(img, "wb") as f:
        f.write(b"\x07" * 4096)
    os.chmod(img, 0o444)
    r = subprocess.run(as_nobody([BIN, "serve", img]), capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1 and "serve it with --read-only" in r.stderr, r.stderr
    os.chmod(img, 0o200)
    r = subprocess.run(as_nobody([BIN, "serve", img]), capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1, r.stderr
    assert "Permission denied" in r.stderr and "read-only" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    os.chmod(img, 0o644)
    with open(img, "rb") as f:
        assert f.read() == b"\x07" * 4096


def test_rate_limit_paces_the_copy(workdir):
    """qemu-img convert -r: 8 MiB at 4M/s takes 2 s, the last request's
    share of time included; every byte still copied."""
    src, model = make_image(workdir, "src.img", 8 * MiB, seed=5)
    dst = os.path.join(workdir, "dst.img")
    t0 = time.monotonic()
    r = ok(rawdisk("copy", "--rate-limit", "4M", src, dst, text=True))
    took = time.monotonic() - t0
    assert took >= 1.95, took
    rate = float(re.search(r"\(([\d.]+) MiB/s\)", r.stdout).group(1))
    assert rate <= 4.0, r.stdout
    assert_target_is(dst, model)
    r = rawdisk("copy", "-r", "0", src, dst, text=True)
    assert r.returncode == 2, r.stderr


def test_progress_fd_writes_nbdcopys_lines(workdir):
    """--progress=FD: "N/100" lines only, rising from 0 to 100."""
    src, model = make_image(workdir, "src.img", 8 * MiB, seed=6)
    dst = os.path.join(workdir, "dst.img")
    rfd, wfd = os.pipe()
    try:
        p = subprocess.Popen([BIN, "copy", "-q", f"--progress={wfd}", "-r", "8M", src, dst],
                             pass_fds=(wfd,), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        os.close(wfd)
        with os.fdopen(rfd, "r") as f:
            text = f.read()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert (out, err) == (b"", b"")
    lines = text.splitlines()
    assert all(re.fullmatch(r"(\d+)/100", x) for x in lines), text
    pcts = [int(x.split("/")[0]) for x in lines]
    assert pcts[0] == 0 and pcts[-1] == 100 and pcts == sorted(set(pcts)), pcts
    assert len(pcts) >= 4, pcts
    assert_target_is(dst, model)
    new = os.path.join(workdir, "new.img")
    r = rawdisk("copy", "--progress=99", src, new, text=True)
    assert r.returncode == 1 and "--progress=99" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and not os.path.exists(new), r.stderr


def test_p_reports_in_lines_when_stderr_is_not_a_terminal(workdir):
    """-p into a log: a plain line every few seconds, no redraws."""
    src, model = make_image(workdir, "src.img", 8 * MiB, seed=7)
    dst = os.path.join(workdir, "dst.img")
    r = ok(rawdisk("copy", "-p", "-r", "2M", src, dst, text=True))
    lines = r.stderr.splitlines()
    assert 1 <= len(lines) <= 3, r.stderr
    for x in lines:
        assert re.fullmatch(r"rawdisk: copy: \d+% \([\d.]+ of 8\.0 MiB\), [\d.]+ MiB/s, "
                            r"ETA \d+ s", x), x
    assert "\r" not in r.stderr and "\x1b" not in r.stderr
    assert r.stdout.startswith("copied 8.0 MiB"), r.stdout
    assert_target_is(dst, model)


def stream_data():
    """Zeros, data, zeros and a short data tail: holes and a size that is
    no multiple of a block."""
    return bytes(MiB) + random_bytes(3 * MiB + 1237, 8) + bytes(2 * MiB) + random_bytes(5000, 9)


def copy_from_pipe(data, *args):
    """`producer | rawdisk copy ARGS`, standard input a pipe (no size)."""
    p = subprocess.Popen([BIN, "copy", *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(data, timeout=120)
    return p.returncode, out.decode(), err.decode()


def test_copy_reads_standard_input_onto_a_file(workdir):
    data = stream_data()
    dst = os.path.join(workdir, "dst.img")
    rc, out, err = copy_from_pipe(data, "-", dst)
    assert rc == 0 and err == "", err
    assert out.startswith(f"copied {len(data) / MiB:.1f} MiB"), out
    assert_target_is(dst, data)
    # The zero runs were not written.
    assert allocated_bytes(dst) <= len(data) - 2 * MiB, allocated_bytes(dst)
    # An existing file with data: only with --force, then just the stream.
    with open(dst, "wb") as f:
        f.write(b"\x55" * (9 * MiB))
    rc, _, err = copy_from_pipe(data, "-q", "-", dst)
    assert rc == 1 and "--force" in err and err.count("\n") == 1, err
    assert_target_is(dst, b"\x55" * (9 * MiB))
    rc, _, err = copy_from_pipe(data[:MiB + 7], "-q", "--force", "-", dst)
    assert rc == 0, err
    assert_target_is(dst, data[:MiB + 7])
    rc, _, err = copy_from_pipe(b"", "-q", "-", os.path.join(workdir, "empty.img"))
    assert rc == 0 and os.path.getsize(os.path.join(workdir, "empty.img")) == 0, err
    for bad in [["-", "-"], ["-", "null:"], ["--verify", "-", dst]]:
        rc, _, err = copy_from_pipe(data, *bad)
        assert rc == 2 and "standard input" in err, (bad, err)


def test_copy_reads_standard_input_onto_an_export(workdir, serve):
    """The stream's bytes, the rest of the export as it was; a stream
    longer than the export is an error."""
    size = 12 * MiB
    img = os.path.join(workdir, "exp.img")
    with open(img, "wb") as f:
        f.write(b"\xaa" * size)
    srv = serve(img)
    data = stream_data()
    rc, _, err = copy_from_pipe(data, "-q", "--progress=2", "-", srv.uri)
    assert rc == 0, err
    assert err == "0/100\n100/100\n", err
    srv.terminate()
    assert_target_is(img, data + b"\xaa" * (size - len(data)))
    srv = serve(img)
    rc, _, err = copy_from_pipe(bytes(size) + b"x", "-q", "-", srv.uri)
    assert rc == 1 and "longer than" in err and err.count("\n") == 1, err
    srv.terminate()
