"""Storage stacks for the tests: private tmpfs/ramfs mounts, ext4 and XFS on a
loop device, and bare loop block devices.

Every stack is a context manager that undoes what it did in reverse order,
also when setting up a later layer failed. Backing files of loop devices live
on a private tmpfs so nothing touches the disk and concurrent runs
(which use their own mkdtemp directories) never collide.
"""

import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
import uuid

MiB = 1 << 20


def is_root():
    return os.geteuid() == 0


def run(*argv, timeout=60):
    """Run a setup command; a failure raises with the command's stderr."""
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


@contextlib.contextmanager
def scratch_dir(prefix="rawdisk-test-"):
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def scratch_dir_in(parent):
    """A unique directory inside a (shared, session-wide) mount."""
    path = tempfile.mkdtemp(prefix="t-", dir=parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def mounted(fstype, source, options=None):
    """Mount on a fresh unique directory; unmount (lazily if busy) and remove it."""
    with scratch_dir(prefix=f"rawdisk-{fstype}-") as mnt:
        argv = ["mount", "-t", fstype]
        if options:
            argv += ["-o", options]
        run(*argv, source, mnt)
        try:
            yield mnt
        finally:
            res = subprocess.run(["umount", mnt], capture_output=True)
            if res.returncode != 0:
                # A server killed by the watchdog may still hold a file open for
                # a moment; detach now so the loop device below can go.
                subprocess.run(["umount", "-l", mnt], capture_output=True)


@contextlib.contextmanager
def tmpfs(size_mib=512):
    with mounted("tmpfs", "tmpfs", f"size={size_mib}m,mode=0755") as mnt:
        yield mnt


@contextlib.contextmanager
def ramfs():
    with mounted("ramfs", "ramfs", "mode=0755") as mnt:
        yield mnt


@contextlib.contextmanager
def loop_device(backing_file, sector_size=512, direct_io=True):
    argv = ["losetup", "--find", "--show", "--sector-size", str(sector_size)]
    if direct_io:
        argv.append("--direct-io=on")
    dev = run(*argv, backing_file).strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


@contextlib.contextmanager
def sparse_file(directory, name, size):
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.truncate(size)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def filesystem_on_loop(fstype, size_mib):
    """ext4 or XFS made on a loop device backed by a file on a private tmpfs."""
    mkfs = {
        "ext4": ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"],
        # xfsprogs >= 5.19 refuses file systems under 300 MiB.
        "xfs": ["mkfs.xfs", "-q", "-f"],
    }[fstype]
    with tmpfs(size_mib + 64) as backing_dir, \
            sparse_file(backing_dir, f"{fstype}.img", size_mib * MiB) as backing, \
            loop_device(backing, 512, direct_io=True) as dev:
        run(*mkfs, dev, timeout=120)
        with mounted(fstype, dev) as mnt:
            yield mnt


@contextlib.contextmanager
def loop_on_tmpfs(sector_size, size_mib):
    """A bare loop block device whose backing file lives on a private tmpfs.

    Its write-zeroes is dropped at first use, after which PUNCH_HOLE fails
    and ZERO_RANGE/BLKZEROOUT make the kernel write zero pages
    (docs/capabilities.md, tmpfs-backed loop devices).
    """
    with tmpfs(size_mib + 16) as backing_dir, \
            sparse_file(backing_dir, f"loop{sector_size}.img", size_mib * MiB) as backing, \
            loop_device(backing, sector_size, direct_io=True) as dev:
        yield dev


@contextlib.contextmanager
def loop_on_dir(directory, sector_size, size_mib):
    """A loop device backed by a file in `directory` (e.g. on ext4, where the
    device's write-zeroes/discard end up as fallocate on the backing file)."""
    with sparse_file(directory, f"loop{sector_size}-{uuid.uuid4().hex[:8]}.img", size_mib * MiB) as backing, \
            loop_device(backing, sector_size, direct_io=True) as dev:
        yield dev


def fs_type(path):
    return run("stat", "-f", "-c", "%T", path).strip()


def logical_block_size(path):
    """The logical sector size of a block device, or of the device holding
    a file (what O_DIRECT alignment comes down to on ext4/XFS)."""
    st = os.stat(path)
    dev = st.st_rdev if stat.S_ISBLK(st.st_mode) else st.st_dev
    with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/logical_block_size") as f:
        return int(f.read())
