//! [`Tracker`]: the tracking server's side of a state file.

use std::path::Path;
use std::sync::Arc;

use super::{CbtError, CheckpointInfo, TrackOptions};
use crate::sys::Sys;

/// The changed-block state of one served target. One per served target per
/// process (Arc-shared by every connection). Send + Sync.
pub struct Tracker {
    _sys: Arc<dyn Sys>,
}

impl Tracker {
    /// `size`: the target's size now. Takes the "served" lock, sets the open
    /// flag durably, detects crash / outside change (and warns), creates the
    /// state file if absent. `granularity: Some(g)` differing from an
    /// existing file's is an error naming both.
    pub fn open(target: &Path, size: u64, opts: &TrackOptions) -> Result<Tracker, CbtError> {
        Self::open_with_sys(target, size, opts, Arc::new(crate::sys::RealSys))
    }

    /// [`Tracker::open`] through `sys` (tests inject faults with it).
    pub fn open_with_sys(
        target: &Path,
        size: u64,
        opts: &TrackOptions,
        sys: Arc<dyn Sys>,
    ) -> Result<Tracker, CbtError> {
        let _ = (target, size, opts, sys);
        unimplemented!()
    }

    /// Bytes per bitmap bit.
    pub fn granularity(&self) -> u64 {
        unimplemented!()
    }

    pub fn state_path(&self) -> &Path {
        unimplemented!()
    }

    /// Before WRITE / WRITE_ZEROES / TRIM of [offset, offset+len) is issued.
    /// Lock-free fast path (atomic words) when the chunks are already
    /// marked; never fails, never does I/O.
    pub fn mark(&self, offset: u64, len: u64) {
        let _ = (offset, len);
        unimplemented!()
    }

    /// Before a FLUSH or FUA write is acknowledged. No I/O when nothing was
    /// marked since the last.
    pub fn persist(&self) -> Result<(), CbtError> {
        unimplemented!()
    }

    /// Pick up checkpoints created or deleted by another process.
    pub fn refresh(&self) -> Result<(), CbtError> {
        unimplemented!()
    }

    pub fn checkpoints(&self) -> Vec<CheckpointInfo> {
        unimplemented!()
    }

    /// Runs (length, changed) covering exactly [offset, offset+len)
    /// (chunk-aligned inside, the first and last run clipped to the
    /// request), merged (adjacent runs differ), at most `max_runs` (the last
    /// run then ends early; at least one run). None: no such checkpoint.
    /// Inconsistent checkpoint: one run, all changed.
    pub fn changed(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Option<Vec<(u64, bool)>> {
        let _ = (name, offset, len, max_runs);
        unimplemented!()
    }

    /// Clean shutdown: persist, record the target's size/mtime/ctime, clear
    /// the open flag, fdatasync, release the served lock. Idempotent; Drop
    /// does it best-effort with a log line on failure.
    pub fn close(&self) -> Result<(), CbtError> {
        unimplemented!()
    }
}
