//! The storage engine: one open regular file or block device, every storage
//! operation done the cheapest way that storage supports, and what it learned
//! about the storage shared by every handle on the same target.
//!
//! No NBD here. Every syscall goes through [`sys::Sys`], so tests can inject
//! errors the machine cannot produce ([`FaultSys`]).
//!
//! # Zeroing: the chain and why each step exists
//!
//! [`Target::zero`] tries, per chunk of at most 1 GiB (one syscall must not
//! hold the device or the inode lock for seconds):
//!
//! | step | regular file | block device (aligned middle) |
//! |---|---|---|
//! | 1 | `may_trim`: PUNCH_HOLE | `may_trim` or `fast_only`: PUNCH_HOLE (write-zeroes, no fallback) |
//! | 2 | ZERO_RANGE | ZERO_RANGE (kernel may write zero pages) |
//! | 3 | PUNCH_HOLE + fallocate(0) | BLKZEROOUT (kernels before 4.9: no fallocate on block devices, ENODEV) |
//! | 4 | pwrite from the shared zero buffer | the same |
//!
//! - ZERO_RANGE appeared in Linux 3.15 and is missing on tmpfs and NFS: tmpfs
//!   zeroes without a hole by punching and reallocating (step 3).
//! - ramfs has no fallocate at all (and no O_DIRECT): only step 4 works.
//! - A loop device backed by tmpfs advertises write-zeroes and drops it on
//!   first use (RESULTS-baseline.md, "Surprises" 2): PUNCH_HOLE then fails
//!   with EOPNOTSUPP and ZERO_RANGE/BLKZEROOUT silently write in the kernel.
//!   Each chunk re-reads the learned state, so a method that disappears at
//!   run time is learned and the chain goes on from there; on block devices
//!   only PUNCH_HOLE counts as fast.
//! - Block devices want sector-aligned ranges: the unaligned head and tail
//!   are written by hand, the middle (aligned to max(sector, page)) offloaded.
//! - Step 4 advances its offset every chunk (nbdkit and nbd-server shipped a
//!   fallback that rewrote the first chunk for years).
//!
//! `fast_only` fails with ENOTSUP before touching anything when no fast
//! method is left. Only "not supported" errnos are learned (see
//! `is_unsupported` in target.rs for the list and the one EINVAL case);
//! EIO, ENOSPC, EPERM... are returned and teach nothing.
//!
//! # Modules
//! - [`sys`]: the syscall layer ([`sys::RealSys`]) and its fault injector.
//! - [`caps`]: learned tri-state capabilities and per-method counters,
//!   shared process-wide per target (keyed by st_dev/st_ino, st_rdev for
//!   block devices) through a registry of weak references.
//! - [`Target`]: open, read/write (FUA), flush, zero, trim, extents,
//!   preallocate, cache, probe; cache=none (O_DIRECT) with bounce buffers and
//!   read-modify-write under a range lock for unaligned requests.

pub mod caps;
mod errno;
pub mod error;
#[cfg(any(test, feature = "fault-injection"))]
pub mod fault;
mod registry;
pub mod sys;
mod target;
#[cfg(test)]
mod tests;

pub use caps::{
    Capabilities, CapsSnapshot, KeepZero, KeepZeroTrial, Method, MethodStats, Tri, KEEP_ZERO_SAMPLE,
};
pub use error::{Error, Result};
#[cfg(any(test, feature = "fault-injection"))]
pub use fault::{FaultRule, FaultSys};
pub use target::{
    AlignedBuf, CacheMode, Extent, ExtentKind, Geometry, Kind, MappedWrite, OpenOptions, Prealloc,
    PreallocReport, Probe, QueueLimits, Seen, Target, Trial, ZeroFlags, ZeroOutcome, MAX_ZERO_CALL,
    WRITE_ZEROS_CHUNK,
};
