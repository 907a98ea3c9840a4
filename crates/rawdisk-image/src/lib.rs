//! The image commands' logic (the binary only parses arguments and prints).
//!
//! * [`create`]: new images with preallocation, or checking (and zeroing) a
//!   block device, in `qemu-img create`'s idiom.
//! * [`probe`]: what the storage under a target supports, without changing
//!   a byte of it unless asked.
//! * [`map`]: allocation map in `qemu-img map`'s JSON and human forms.
//! * [`info`]: size, allocation and properties, in `qemu-img info`'s idiom.
//! * [`checksum`]: the blkhash digest (blksum's value), sparse-aware and
//!   parallel.
//! * [`compare`]: `qemu-img compare` for raw images and NBD exports.
//! * [`resize`]: grow (with preallocation) or shrink a file.

pub mod checksum;
pub mod compare;
pub mod context_map;
pub mod copy;
pub mod create;
pub mod endpoint;
pub mod error;
pub mod info;
pub mod map;
pub mod output;
pub mod probe;
pub mod progress;
pub mod resize;
mod scan;
pub mod stream;
pub mod sysinfo;

pub use error::{Error, Result};

/// Fails with the one line of [`rawdisk_storage::format::refusal`] when the
/// target looks like another image format.
pub(crate) fn refuse_other_format(
    t: &rawdisk_storage::Target,
    path: &std::path::Path,
) -> Result<()> {
    let shown = path.display().to_string();
    match rawdisk_storage::format::probe_target(t) {
        Ok(None) => Ok(()),
        Ok(Some(f)) => Err(Error::msg(rawdisk_storage::format::refusal(&shown, f))),
        Err(e) => Err(Error::with(format!("cannot read '{shown}'"), e)),
    }
}

/// Opens a file or block device read-only, for the commands that only look
/// (probe, map, info); the error names the path.
pub(crate) fn open_read_only(path: &std::path::Path) -> Result<rawdisk_storage::Target> {
    rawdisk_storage::Target::open(
        path,
        &rawdisk_storage::OpenOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .map_err(|e| Error::with(format!("cannot open '{}'", path.display()), e))
}
