//! Changed-block tracking: which chunks of a target changed since a
//! checkpoint, kept in a sidecar state file that survives restarts.
//!
//! # The model
//! Checkpoints c1..cn, oldest first, each own a bitmap Bi at the state
//! file's granularity: the chunks changed (WRITE, WRITE_ZEROES, TRIM) after
//! ci was created and before c(i+1) was. Only the newest receives marks.
//! "Changed since ck" is Bk | .. | Bn. Deleting ck ORs Bk into B(k-1) (or
//! drops it when ck is the oldest). An inconsistent checkpoint (after a
//! crash, an outside change of the target, a corrupt header) reports
//! everything as changed, forever; they are always the oldest ones.
//!
//! # The persistence rule
//! A range is in the persisted bitmap before a FLUSH (or FUA write) covering
//! it is acknowledged: the server [`Tracker::mark`]s before it issues a
//! write and [`Tracker::persist`]s before it acknowledges a FLUSH. Marks go
//! to U, the chunks marked since the last persist (atomic words, no lock);
//! a persist moves U into the newest bitmap, writes the pages that gained
//! bits and fdatasyncs, or on failure gives the bits back to U. U is kept
//! even with no checkpoint, and counts as part of whichever bitmap is newest
//! (also one another process created since the last persist): a change that
//! might be after a checkpoint is reported, never hidden.
//!
//! # Where things are
//! - `format.rs`: the state file's byte layout (header page, checkpoint
//!   table, CRC32, bitmap slots) and its encoding; docs/cbt.md has the table.
//! - `bitmap.rs`: chunk bitmaps, the atomic one of U, and runs of them.
//! - `disk.rs`: the state file's handle: locks, reading and writing the
//!   header and slots; the target's identity; new and repaired headers.
//! - `file.rs`: the crash / outside-change checks, [`StateFile`].
//! - `index.rs`: format 2's page index (a CRC32 and stamp per bitmap page)
//!   and the integrity checks every opener makes with it.
//! - `tracker.rs`: [`Tracker`], the server's side.
//! - `error.rs`: [`CbtError`].

pub(crate) mod bitmap;
mod disk;
mod error;
mod file;
pub(crate) mod format;
mod index;
mod tracker;

use std::path::{Path, PathBuf};

pub use disk::check_target;
pub use error::CbtError;
pub use file::StateFile;

pub use tracker::Tracker;

/// What a state file's name is the target's file name followed by.
pub const STATE_SUFFIX: &str = ".rawdisk-cbt";
/// Bitmap granularity when none is asked for.
pub const DEFAULT_GRANULARITY: u64 = 64 << 10;
/// Smallest and largest granularity (powers of two in between).
pub const MIN_GRANULARITY: u64 = 4 << 10;
pub const MAX_GRANULARITY: u64 = 64 << 20;
/// Checkpoints a state file holds at most.
pub const MAX_CHECKPOINTS: usize = 32;
/// Longest checkpoint name, in bytes of `[A-Za-z0-9._-]`.
pub const MAX_NAME_LEN: usize = 63;

/// How a [`Tracker`] opens a target's state.
#[derive(Clone, Debug, Default)]
pub struct TrackOptions {
    /// Bytes per bitmap bit for a new state file; an existing file's must
    /// match. None: the existing file's, or [`DEFAULT_GRANULARITY`].
    pub granularity: Option<u64>,
    /// Where the state file lives; None: next to the target (files only).
    pub state_dir: Option<PathBuf>,
}

/// One checkpoint as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointInfo {
    pub name: String,
    /// Unix seconds.
    pub created: u64,
    pub consistent: bool,
    /// Why it is inconsistent (None when consistent).
    pub reason: Option<String>,
    /// Unique identity: `<source id, 32 hex digits>:<seq>` (a name can be
    /// reused after a delete, an identity never).
    pub id: String,
    /// Sequence number: higher is newer, never reused for a source id.
    pub seq: u64,
}

/// A source's identity and its checkpoints, from one look at its state:
/// what a backup of it records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// The state file's source id, 32 hex digits; None when the state read
    /// was not on disk yet (a blank or corrupt header a reader repaired in
    /// memory): nothing may be recorded against it.
    pub source_id: Option<String>,
    /// The target's size the state covers.
    pub size: u64,
    /// Oldest first (sequence numbers increasing).
    pub checkpoints: Vec<CheckpointInfo>,
}

/// The state file of `target`: `TARGET.rawdisk-cbt` next to a file, or
/// `DIR/<file name of TARGET>.rawdisk-cbt` with a state dir. A block device
/// needs a state dir (its directory is /dev, a tmpfs gone at reboot).
pub fn state_path(target: &Path, state_dir: Option<&Path>) -> Result<PathBuf, CbtError> {
    const OP: &str = "find the changed-block state of";
    let Some(file_name) = target.file_name() else {
        return Err(CbtError::msg(OP, target, "the target has no file name"));
    };
    let mut name = file_name.to_os_string();
    name.push(STATE_SUFFIX);
    if let Some(dir) = state_dir {
        return Ok(dir.join(name));
    }
    let meta = std::fs::metadata(target).map_err(|e| CbtError::io(OP, target, e))?;
    if std::os::unix::fs::FileTypeExt::is_block_device(&meta.file_type()) {
        return Err(CbtError::msg(
            OP,
            target,
            "a block device keeps its state in a directory: pass --state-dir DIR",
        ));
    }
    Ok(target.with_file_name(name))
}

/// Whether `g` is a granularity a state file may have.
pub fn valid_granularity(g: u64) -> bool {
    g.is_power_of_two() && (MIN_GRANULARITY..=MAX_GRANULARITY).contains(&g)
}

/// Whether `name` is a valid checkpoint name: 1..=63 bytes of
/// `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}
