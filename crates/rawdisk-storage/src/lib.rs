//! The storage engine: one open regular file or block device, every storage
//! operation done the cheapest way that storage supports, and what it learned
//! about the storage shared by every handle on the same target.
//!
//! No NBD here. Every syscall goes through [`sys::Sys`], so tests can inject
//! errors the machine cannot produce.

pub mod caps;
pub mod error;
pub mod sys;
mod target;

pub use caps::{Capabilities, CapsSnapshot, Method, MethodStats, Tri};
pub use error::{Error, Result};
pub use target::{
    CacheMode, Extent, ExtentKind, Geometry, Kind, OpenOptions, Prealloc, PreallocReport, Target,
    ZeroFlags, ZeroOutcome,
};
