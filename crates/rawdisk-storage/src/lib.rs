//! The storage engine: one open regular file or block device, every storage
//! operation done the cheapest way that storage supports, and what it learned
//! about the storage shared by every handle on the same target.
//!
//! No NBD here. Every syscall goes through [`sys::Sys`], so tests can count
//! and fail any of them.
//!
//! # Where things are
//! - `engine/mod.rs`: [`Target`], its options and geometry, and opening it;
//!   the operations are `impl Target` blocks beside it:
//!   - `engine/zero.rs`: **the zero chain** ([`Target::zero`]): per chunk of
//!     at most 1 GiB, PUNCH_HOLE (when trimming is allowed), ZERO_RANGE,
//!     PUNCH_HOLE + fallocate(0) on files or BLKZEROOUT on block devices,
//!     then writing zeros; why each step exists is that file's doc;
//!   - `engine/rw.rs`: read, write (FUA), splice to a pipe, flush, write-back;
//!   - `engine/direct.rs`: cache=none (O_DIRECT): bounce buffers and
//!     read-modify-write under a range lock for unaligned requests;
//!   - `engine/space.rs`: trim, extents, preallocation;
//!   - `engine/map.rs`: writes received straight into mapped page cache;
//!   - `engine/offload.rs`: copy offload from another file (FICLONERANGE,
//!     copy_file_range), learned per pair of file systems;
//!   - `engine/probe.rs`: trying the methods on purpose (`rawdisk probe`).
//! - [`cbt`]: **changed-block tracking**: the sidecar state file of
//!   checkpoints and their bitmaps ([`cbt::Tracker`] for a server,
//!   [`cbt::StateFile`] for `rawdisk checkpoint`); docs/cbt.md.
//! - `errno.rs`: which errnos mean "not supported" (the only ones the engine
//!   learns from; EIO, ENOSPC, EPERM... are returned and teach nothing),
//!   EINTR retry, short reads.
//! - [`caps`]: learned tri-state capabilities and per-method counters;
//!   `registry.rs` shares them process-wide per target (keyed by
//!   st_dev/st_ino, st_rdev for block devices) through weak references.
//! - [`sys`]: the syscall layer: the table of syscalls (`syscalls!`), the
//!   [`sys::Sys`] trait declared from it and [`sys::RealSys`], the kernel.
//! - `fault.rs`: **the fault injection**, `FaultSys`, generated from the same
//!   table: counts, records and fails any call. Built only with the
//!   `fault-injection` feature, which only tests enable.
//!
//! What each storage kind supports (tmpfs has no ZERO_RANGE, ramfs no
//! fallocate or O_DIRECT, a tmpfs-backed loop device drops write-zeroes on
//! first use...) is in docs/capabilities.md.

pub mod caps;
pub mod cbt;
mod engine;
mod errno;
pub mod error;
#[cfg(any(test, feature = "fault-injection"))]
pub mod fault;
pub mod format;
mod registry;
pub mod sys;
#[cfg(test)]
mod tests;

pub use caps::{
    Capabilities, CapsSnapshot, CopyCaps, CopyMethod, KeepZero, KeepZeroTrial, Method, MethodStats,
    Tri, KEEP_ZERO_SAMPLE,
};
pub use engine::{
    AlignedBuf, CacheMode, CopyOffload, DirectBackend, DirectDone, DirectOp, DirectQueue, Extent,
    ExtentKind, Geometry, Kind, Lookup, MappedWrite, Offloaded, OpenOptions, Prealloc,
    PreallocReport, Probe, QueueLimits, Seen, Target, Trial, ZeroFlags, ZeroOutcome, MAX_ZERO_CALL,
    WRITE_ZEROS_CHUNK,
};
pub use error::{Error, Result};
#[cfg(any(test, feature = "fault-injection"))]
pub use fault::{FaultRule, FaultSys, Span};
