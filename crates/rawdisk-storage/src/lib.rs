//! The storage engine: one open regular file or block device, every storage
//! operation done the cheapest way that storage supports, and what it learned
//! about the storage shared by every handle on the same target.
//!
//! No NBD here. Every syscall goes through [`sys::Sys`], so tests can inject
//! errors the machine cannot produce.

pub mod caps;
mod direct;
pub mod error;
pub mod fault;
mod probe;
mod registry;
pub mod sys;
mod target;
#[cfg(test)]
mod tests;
mod zero;

pub use caps::{Capabilities, CapsSnapshot, Method, MethodStats, Tri};
pub use direct::AlignedBuf;
pub use error::{Error, Result};
pub use fault::{FaultRule, FaultSys};
pub use probe::Probe;
pub use target::{
    CacheMode, Extent, ExtentKind, Geometry, Kind, OpenOptions, Prealloc, PreallocReport,
    QueueLimits, Target, ZeroFlags, ZeroOutcome, MAX_ZERO_CALL, WRITE_ZEROS_CHUNK,
};
