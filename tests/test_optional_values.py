"""Flags whose value is optional take it attached only (`--write-behind=on`,
`--map=CONTEXT`, `--progress=FD`), as getopt_long does: `serve --write-behind
disk.img` serves disk.img with write-behind on, and a detached word that is
one of the flag's values is refused in one line with the attached spelling
rather than taken for a file."""

import os
import subprocess

import pytest

import servers
from helpers import MiB, assert_target_is, make_image

pytestmark = pytest.mark.rawdisk_only("the rawdisk command line")


def rawdisk(*args, cwd=None):
    return subprocess.run([servers.RAWDISK_BIN, *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def one_usage_line(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("rawdisk: "), r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)
    assert r.stdout == "", r.stdout


WRITE = "qemu-io -f raw -c 'write -P 0x5a 4096 262144' \"$uri\" >/dev/null"


def test_write_behind_before_the_target_is_the_flag_alone(workdir):
    """`serve --write-behind disk.img`: disk.img is the target, write-behind
    is on, and a client's write lands there, exactly."""
    path, model = make_image(workdir, "disk.img", 2 * MiB, seed=31)
    r = rawdisk("serve", "-v", "-U", "-", "--run", WRITE, "--write-behind", path)
    assert r.returncode == 0, r.stderr
    assert "write-behind" in r.stderr and "write-behind off" not in r.stderr, r.stderr
    model[4096:4096 + 262144] = b"\x5a" * 262144
    assert_target_is(path, model)
    # The documented attached spelling still works, each mode.
    for mode in ["on", "off", "auto"]:
        r = rawdisk("serve", "-U", "-", "--run", "true", f"--write-behind={mode}", path)
        assert r.returncode == 0, (mode, r.stderr)
    assert_target_is(path, model)


@pytest.mark.parametrize("args, hint", [
    # `on` would be the target and disk.img one argument too many.
    (["serve", "-U", "s.sock", "--write-behind", "on", "disk.img"], "--write-behind=on"),
    # `off` would silently be the target: refused as well.
    (["serve", "-U", "s.sock", "--write-behind", "off"], "--write-behind=off"),
    (["serve", "-U", "s.sock", "--write-behind", "auto"], "--write-behind=auto"),
    (["info", "--map", "base:allocation", "nbd+unix:///?socket=s.sock"],
     "--map=base:allocation"),
    (["copy", "--progress", "3", "disk.img", "out.img"], "--progress=3"),
    (["copy", "-p", "3", "disk.img", "out.img"], "--progress=3"),
], ids=["serve-on-target", "serve-off-alone", "serve-auto-alone", "info-map", "copy-progress",
        "copy-p"])
def test_detached_value_is_one_usage_line_with_the_attached_spelling(workdir, args, hint):
    path, model = make_image(workdir, "disk.img", MiB, seed=32)
    before = sorted(os.listdir(workdir))
    r = rawdisk(*args, cwd=workdir)
    one_usage_line(r, hint, "takes its value attached")
    assert sorted(os.listdir(workdir)) == before, "something was created"
    assert_target_is(path, model)


def test_a_file_named_like_a_mode_is_served_by_its_path(workdir):
    """The way to serve a file called `on` after --write-behind: ./on."""
    path, model = make_image(workdir, "on", MiB, seed=33)
    r = rawdisk("serve", "-U", "-", "--run", "qemu-io -f raw -c 'read -P 0 0 512' \"$uri\" "
                ">/dev/null || true", "--write-behind", "./on", cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert_target_is(path, model)
