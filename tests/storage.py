"""Storage stacks for the tests: private tmpfs/ramfs mounts, ext4, XFS and
btrfs on a loop device, the NFS-like FUSE file system (nfs3, nfs42) over a
tmpfs, and bare loop block devices.

Every stack is a context manager that undoes what it did in reverse order,
also when setting up a later layer failed. Backing files of loop devices live
on a private tmpfs so nothing touches the disk and concurrent runs
(which use their own mkdtemp directories) never collide.
"""

import contextlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid

MiB = 1 << 20

# Every file system kind the tests are parametrized over, by fixture name
# (conftest.py): `FILE_SYSTEMS` in test files means all of these.
FILE_SYSTEMS = ["tmpfs_dir", "ramfs_dir", "ext4_dir", "xfs_dir", "btrfs_dir",
                "nfs3_dir", "nfs42_dir"]

# The NFS-like FUSE file system's daemon (crates/rawdisk-testkit,
# src/bin/nfs-like-fs.rs), built beside the rawdisk binary by
# `cargo build --release --workspace --bins`.
NFS_LIKE_BIN = os.environ.get("NFS_LIKE_BIN") or os.path.join(
    os.path.dirname(os.path.abspath(os.environ.get("RAWDISK_BIN") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "rawdisk"))),
    "nfs-like-fs")
NFS_STATS = ".nfs-like-stats"
# The backing directory of each NFS-like mount (what the "server" holds).
NFS_BACKING = {}


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
        # mkfs.btrfs refuses devices under about 110 MiB.
        "btrfs": ["mkfs.btrfs", "-q", "-f"],
    }[fstype]
    with tmpfs(size_mib + 64) as backing_dir, \
            sparse_file(backing_dir, f"{fstype}.img", size_mib * MiB) as backing, \
            loop_device(backing, 512, direct_io=True) as dev:
        run(*mkfs, dev, timeout=120)
        with mounted(fstype, dev) as mnt:
            yield mnt


def fuse_unavailable():
    """Why the NFS-like kinds cannot run here (no /dev/fuse), or None."""
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"no FUSE (/dev/fuse: {e.strerror})"
    if not os.access(NFS_LIKE_BIN, os.X_OK):
        raise RuntimeError(f"NFS_LIKE_BIN={NFS_LIKE_BIN} is not an executable; build it "
                           "(cargo build --release -p rawdisk-testkit --bins) or set NFS_LIKE_BIN")
    return None


@contextlib.contextmanager
def nfs_like(profile, size_mib=512, latency_us=0):
    """The NFS-like FUSE file system (docs/capabilities.md, NFS) with `profile`
    ("nfs3" or "nfs42") over a private tmpfs; its daemon is stopped by
    unmounting it."""
    with tmpfs(size_mib) as backing, scratch_dir(prefix=f"rawdisk-{profile}-") as mnt:
        proc = subprocess.Popen(
            [NFS_LIKE_BIN, "--profile", profile, "--latency-us", str(latency_us), backing, mnt],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            if line.strip() != "ready":
                proc.wait(timeout=10)
                raise RuntimeError(f"nfs-like-fs {profile} did not start: {proc.stderr.read().strip()}")
            NFS_BACKING[mnt] = backing
            yield mnt
        finally:
            NFS_BACKING.pop(mnt, None)
            res = subprocess.run(["umount", mnt], capture_output=True)
            if res.returncode != 0:
                subprocess.run(["umount", "-l", mnt], capture_output=True)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def nfs_backing(path):
    """The file in the NFS-like file system's backing directory ("on the
    server") behind `path` on one of its mounts."""
    for mnt, backing in NFS_BACKING.items():
        if path.startswith(mnt.rstrip("/") + "/"):
            return backing + path[len(mnt.rstrip("/")):]
    raise ValueError(f"{path} is on no NFS-like mount")


def nfs_counts(mnt):
    """What the NFS-like file system mounted on `mnt` received so far (a
    dict: ops, writes, write_bytes, fallocate_alloc, ..., see nfs_like.rs)."""
    with open(os.path.join(mnt, NFS_STATS)) as f:
        return json.load(f)


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


def direct_io_alignment(path):
    """The alignment O_DIRECT needs for `path`: the logical sector of the
    device under ext4/XFS or of a block device; btrfs's sector size (its
    st_dev is anonymous, and direct I/O must be aligned to the file system's
    blocks); 4096 on the NFS-like FUSE kinds, which report no STATX_DIOALIGN
    (nor does NFS): the engine's default."""
    kind = fs_type(path)
    if kind == "btrfs":
        return os.statvfs(path).f_bsize
    if kind.startswith("fuse"):
        return 4096
    return logical_block_size(path)
