//! Test fixtures: real file systems and loop devices that the tests mount and
//! attach themselves, and helpers to fill and check their contents.
//!
//! Nothing here touches the real disk: every file system lives on a loop
//! device backed by a sparse file on a tmpfs the guard mounts itself, so a
//! "4 GiB" ext4 costs only the memory of the blocks actually written. Only the
//! empty mount points are created under the system temp dir (one unique
//! directory per guard, so several test runs can share a machine).
//!
//! # Guards
//!
//! | constructor | what | notes |
//! |---|---|---|
//! | [`Fs::tmpfs`] | tmpfs of `size` | no `FALLOC_FL_ZERO_RANGE` |
//! | [`Fs::ramfs`] | ramfs | no fallocate at all, no O_DIRECT, no size limit |
//! | [`Fs::ext4`] | ext4 on loop on a tmpfs file | mounted `noinit_itable` so no background writes |
//! | [`Fs::xfs`] | XFS on loop on a tmpfs file | device at least 320 MiB: xfsprogs ≥ 5.19 refuses smaller |
//! | [`Fs::btrfs`] | btrfs on loop on a tmpfs file | device at least 256 MiB; reflink |
//! | [`Fs::nfs_like`] | the NFS-like FUSE file system ([`nfs_like`]) over a tmpfs, served by threads of the test process | profiles `nfs3` (no fallocate, no SEEK_DATA, no server-side copy) and `nfs42` (`fallocate(0)` and `PUNCH_HOLE` only, SEEK_DATA, COPY); latency per operation, 1 MiB writes, counts ([`Fs::nfs_counts`]); needs /dev/fuse: [`FsKind::usable`] names a kind it skips |
//! | [`LoopDev::new`] | loop device (512 or 4096-byte sectors, `--direct-io=on`) backed by a sparse file on ext4 (itself on tmpfs) | write-zeroes and discard offload work (ext4 has ZERO_RANGE and PUNCH_HOLE) |
//! | [`LoopDev::on_tmpfs`] | loop device backed directly by a tmpfs file | "blk-nowz": the loop driver advertises write-zeroes, the first one fails in tmpfs (no ZERO_RANGE) and the driver sets `write_zeroes_max_bytes` to 0 for good; later BLKZEROOUT writes zero pages in the kernel and PUNCH_HOLE on the device fails with EOPNOTSUPP |
//! | [`Scratch::new`] | one of the above by [`StorageKind`], with a target of `size` bytes (a sparse file or the device) | for tests parametrized over all kinds; [`Scratch::with_room`] for files that grow |
//!
//! Every guard undoes what it did (unmount, detach, remove its directories)
//! in reverse order on `Drop`, which also runs when a test panics. A guard
//! that could not be built panics with the command and its stderr: when the
//! tests run as root a failed mount or attach is a test failure, not a skip.
//! Without root the constructors panic with "needs root"; mark such tests
//! `#[ignore = "needs root"]` so they are reported as ignored.
//!
//! A test process killed without unwinding (SIGKILL, a CI timeout) cannot
//! run its guards' `Drop`; the first guard of the next test process sweeps
//! what such dead processes left behind ([`sweep_stale`]).
//!
//! Drop order matters: declare the guard before anything that keeps files
//! open on it (a `Target`), so the open handles are dropped first. If a
//! mount is still busy the guard retries, then detaches it lazily.
//!
//! # Data helpers
//!
//! [`pattern`] produces deterministic pseudo-random bytes that depend on the
//! seed and the *absolute offset* only, so any sub-range can be regenerated
//! and checked without keeping a copy: [`write_pattern`] / [`check_pattern`].
//! [`check_zero`] reads big chunks and reports the first non-zero offset;
//! [`first_difference`] / [`assert_same`] compare buffers and name the first
//! differing offset. [`allocated_bytes`] is `st_blocks * 512`,
//! [`shared_bytes`] what FIEMAP flags as shared (reflinked);
//! [`drop_cache`] syncs and drops a file's page cache.
//!
//! # NBD servers
//!
//! [`NbdServer`] runs nbdkit's file plugin, qemu-nbd or `rawdisk serve` on a
//! Unix socket in a private temp dir and kills it on drop.
//!
//! # Files
//!
//! Everything is re-exported here, so callers name `rawdisk_testkit::Fs` and
//! never a module. Each file holds its own unit tests.
//!
//! | file | holds |
//! |---|---|
//! | `lib.rs` | this map, [`KIB`] / [`MIB`] / [`GIB`], [`is_root`], [`require_root`] |
//! | `cmd.rs` | [`run`], and `try_run` for cleanup that must go on after a failure |
//! | `stack.rs` | the undo stack every guard keeps (unique dirs, mounts, loop attaches, undone on drop), [`sweep_stale`], sparse files, tmpfs sizing |
//! | `fs.rs` | [`FsKind`], [`Fs`] |
//! | `nfs_like.rs` | the NFS-like FUSE file system (also the `nfs-like-fs` binary, `src/bin/`, for the Python tests and benchmarks) |
//! | `loopdev.rs` | [`LoopDev`] |
//! | `scratch.rs` | [`StorageKind`], [`Scratch`] |
//! | `data.rs` | the data helpers above: [`pattern`], [`write_pattern`], [`check_pattern`], [`check_zero`], [`first_difference`], [`assert_same`], [`allocated_bytes`], [`drop_cache`], … |
//! | `nbd.rs` | [`NbdServer`] |

mod cmd;
mod data;
mod fs;
mod loopdev;
mod nbd;
pub mod nfs_like;
mod scratch;
mod stack;

pub use cmd::run;
pub use data::{
    allocated_bytes, assert_same, check_pattern, check_zero, drop_cache, find_nonzero,
    first_difference, first_nonzero, pattern, pattern_vec, read_all, read_range, shared_bytes,
    size_of, write_at, write_pattern,
};
pub use fs::{Fs, FsKind};
pub use loopdev::LoopDev;
pub use nbd::NbdServer;
pub use scratch::{Scratch, StorageKind};
pub use stack::sweep_stale;

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
pub const GIB: u64 = 1024 * MIB;

/// Whether the tests run with the privileges to mount and attach loop devices.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Panics unless root: a root-only test that runs must do the real work or fail.
pub fn require_root() {
    assert!(
        is_root(),
        "needs root (mount, losetup, mkfs): run as root or without --include-ignored"
    );
}
