"""The changed-block state file and the pid file, against damage and tricks.

Damage to the state file's bitmaps (the file cut to its header, a hole
punched over a bitmap page) must read as damage: `checkpoint list` shows
the checkpoint inconsistent with the reason, and `copy --changed-since`
copies everything (never "0 bytes changed"). The state file is created and
opened where it is meant to be: a symlink at its path is refused for
`checkpoint create`, `checkpoint list` and `serve --track-changes` (the
link's target untouched, a dangling one not created), a FIFO there gets one
clear line and no hang. The pid file refuses a symlink too and is mode 0644
whatever the umask.
"""

import os
import stat
import subprocess

import pytest

import servers
from helpers import MiB, assert_same_bytes, connected, make_image, read_target, write_target

pytestmark = pytest.mark.rawdisk_only("changed-block tracking is rawdisk's")

SIZE = 64 * MiB


def rawdisk(*args, timeout=60, **kw):
    return subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True,
                          timeout=timeout, **kw)


def ok(res):
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    return res


def failed(res, *words):
    """The command failed (exit 1) with one stderr line naming `words`."""
    err = res.stderr.decode(errors="replace")
    assert res.returncode == 1, (res.returncode, err)
    assert err.count("\n") == 1 and err.startswith("rawdisk: "), err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"
    return err


@pytest.mark.parametrize("damage", ["truncate", "punch"])
def test_damaged_bitmaps_make_a_full_copy(workdir, serve, damage):
    """The issue's sequence: c0, writes at 0 and 32 MiB through a tracking
    server stopped with SIGTERM, then the state file damaged."""
    src, _ = make_image(workdir, "disk.img", SIZE, seed=37, sparse=True)
    state = src + ".rawdisk-cbt"
    ok(rawdisk("checkpoint", "create", "--name", "c0", src))
    backup = os.path.join(workdir, "backup.img")
    ok(rawdisk("copy", src, backup))
    srv = serve(src, extra=["--track-changes"])
    with connected(srv.uri) as h:
        h.pwrite(b"\x11" * 4096, 0)
        h.pwrite(b"\x22" * 4096, 32 * MiB)
        h.flush()
    assert srv.terminate() == 0
    if damage == "truncate":
        os.truncate(state, 4096)
    else:
        # c0's bitmap, slot 0: one 4 KiB page (1024 chunks of 64 KiB) that
        # holds both writes.
        subprocess.run(["fallocate", "--punch-hole", "--offset", "4096", "--length", "4096",
                        state], check=True)
    res = ok(rawdisk("checkpoint", "list", src))
    out, err = res.stdout.decode(), res.stderr.decode()
    assert out.startswith("c0 ") and "inconsistent (the state file's bitmap is damaged" in out, out
    assert err.startswith("rawdisk: warning: checkpoint c0 of") and "damaged" in err, err
    # A byte of the backup nobody changed: a full copy overwrites it.
    write_target(backup, b"\xa5" * 4096, 40 * MiB)
    res = ok(rawdisk("copy", "--changed-since", "c0", src, backup))
    assert f"({SIZE} of {SIZE} bytes)" in res.stdout.decode(), res.stdout
    assert "bitmap is damaged" in res.stderr.decode() and "full copy" in res.stderr.decode()
    assert_same_bytes(read_target(backup), read_target(src), "backup after a damaged state file")


def make_target(workdir):
    src = os.path.join(workdir, "disk.img")
    with open(src, "wb") as f:
        f.truncate(SIZE)
    return src, src + ".rawdisk-cbt"


def serve_tracking(src, workdir):
    """`serve --track-changes` that must fail before serving."""
    return rawdisk("serve", "--track-changes", "-U", os.path.join(workdir, "s.sock"), src,
                   timeout=20)


@pytest.mark.parametrize("link_to", ["empty file", "nowhere"])
def test_a_symlink_at_the_state_path_is_refused(workdir, link_to):
    src, state = make_target(workdir)
    victim = os.path.join(workdir, "victim")
    if link_to == "empty file":
        open(victim, "wb").close()
    os.symlink(victim, state)
    for res in (rawdisk("checkpoint", "create", "--name", "c0", src),
                rawdisk("checkpoint", "list", src),
                serve_tracking(src, workdir)):
        failed(res, "refusing to follow a symlink at", state)
        if link_to == "empty file":
            assert os.path.getsize(victim) == 0
        else:
            assert not os.path.lexists(victim)
        assert os.path.islink(state)


def test_a_fifo_at_the_state_path_is_one_clear_line(workdir):
    src, state = make_target(workdir)
    os.mkfifo(state)
    for res in (rawdisk("checkpoint", "create", "--name", "c0", src, timeout=20),
                rawdisk("checkpoint", "list", src, timeout=20),
                serve_tracking(src, workdir)):
        failed(res, f"{state} is a FIFO, not a state file")
        assert stat.S_ISFIFO(os.lstat(state).st_mode)


def test_pid_file_refuses_a_symlink_and_is_0644_at_umask_000(workdir):
    src, _ = make_target(workdir)
    victim = os.path.join(workdir, "victim")
    with open(victim, "wb") as f:
        f.write(b"keep")
    pid = os.path.join(workdir, "srv.pid")
    os.symlink(victim, pid)
    sock = os.path.join(workdir, "p.sock")
    res = rawdisk("serve", "-U", sock, "--pid-file", pid, "--run", "true", src)
    failed(res, "pid file", "refusing to follow a symlink")
    assert open(victim, "rb").read() == b"keep" and os.path.islink(pid)
    os.unlink(pid)
    # An existing regular file is replaced; the pid file's mode and content
    # as the --run command sees them.
    with open(pid, "wb") as f:
        f.write(b"stale\n")
    seen = os.path.join(workdir, "seen")
    res = rawdisk("serve", "-U", sock, "--pid-file", pid, "--run",
                  f"stat -c %a '{pid}' > '{seen}'; cat '{pid}' >> '{seen}'", src,
                  preexec_fn=lambda: os.umask(0))
    ok(res)
    mode, got_pid = open(seen).read().split()
    assert mode == "644", mode
    assert got_pid.isdigit() and got_pid != "stale"
    assert not os.path.lexists(pid), "the pid file is removed at exit"
    assert sorted(os.listdir(workdir)) == sorted(["disk.img", "victim", "seen"]), \
        os.listdir(workdir)
