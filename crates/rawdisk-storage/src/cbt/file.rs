//! The state file on disk, and [`StateFile`]: `rawdisk checkpoint` and local
//! `copy --changed-since`.

use std::path::Path;
use std::sync::Arc;

use super::{CbtError, CheckpointInfo};
use crate::sys::Sys;

/// A target's state file opened for checkpoint commands; works while a
/// server tracks the target (edits happen under the mutation lock).
pub struct StateFile {
    _sys: Arc<dyn Sys>,
}

impl StateFile {
    /// `create`: make the state file (recording the target's
    /// size/mtime/ctime) if absent.
    pub fn open(
        target: &Path,
        state_dir: Option<&Path>,
        create: bool,
    ) -> Result<StateFile, CbtError> {
        Self::open_with_sys(target, state_dir, create, Arc::new(crate::sys::RealSys))
    }

    /// [`StateFile::open`] through `sys` (tests inject faults with it).
    pub fn open_with_sys(
        target: &Path,
        state_dir: Option<&Path>,
        create: bool,
        sys: Arc<dyn Sys>,
    ) -> Result<StateFile, CbtError> {
        let _ = (target, state_dir, create, sys);
        unimplemented!()
    }

    /// Whether a tracking server holds the state file (its "served" lock).
    pub fn served(&self) -> Result<bool, CbtError> {
        unimplemented!()
    }

    /// `name: None` picks "cp-N" (N = 1 + highest used). Duplicate name: error.
    pub fn create_checkpoint(&mut self, name: Option<&str>) -> Result<CheckpointInfo, CbtError> {
        let _ = name;
        unimplemented!()
    }

    pub fn delete_checkpoint(&mut self, name: &str) -> Result<(), CbtError> {
        let _ = name;
        unimplemented!()
    }

    pub fn list(&self) -> Result<Vec<CheckpointInfo>, CbtError> {
        unimplemented!()
    }

    /// (offset, length) ranges changed since `name`, merged, covering the
    /// target's size. Error while served (the server holds unpersisted
    /// changes: read them through its NBD export). Checks for outside change
    /// first (then everything is changed, with a warning). Inconsistent:
    /// one range, the whole target.
    pub fn changed_ranges(&self, name: &str) -> Result<Vec<(u64, u64)>, CbtError> {
        let _ = name;
        unimplemented!()
    }
}
