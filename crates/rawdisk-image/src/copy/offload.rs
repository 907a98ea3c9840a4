//! Copy offload in the copy engine: between two local regular files, each
//! data extent of the source is handed to the kernel (FICLONERANGE, then
//! copy_file_range: `Target::copy_from`) before the ordinary read and write.
//! Holes are never offloaded: they stay holes (zeroed or skipped as on the
//! ordinary path).
//!
//! `--sparse-size` and offload: a reflink shares the source's blocks, so a
//! zero block in a reflinked extent takes no new space, which is all the
//! zero scan is for; reflinks are used whatever `--sparse-size` says. A
//! copy_file_range that does not share writes new blocks, zero ones
//! included, and finding the zero runs means reading the data, after which
//! writing it from that buffer costs no more than the kernel's copy: so
//! copy_file_range is only used when the scan is off (`--sparse-size 0`).
//! A preallocated destination (`--preallocation`) is never offloaded
//! either: shared blocks need new space at their first overwrite, which is
//! what preallocation is there to avoid.

use std::sync::Arc;

use rawdisk_storage::{CopyCaps, CopyMethod, CopyOffload, Offloaded, Prealloc, Target};

use super::CopyOptions;
use crate::endpoint::{self, Endpoint};

/// `--copy-offload`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadMode {
    /// Always the ordinary read and write.
    Never,
    /// Reflink or copy_file_range where the pair of file systems allows it.
    #[default]
    Auto,
}

/// Work items while an offload may work: one call moves a whole extent
/// piece instead of a request's worth (the kernel's cost is per call, not
/// per byte, when it shares blocks).
pub(super) const OFFLOAD_CHUNK: u64 = 256 << 20;

/// Offload between this copy's two sides.
pub(super) struct Offload<'a> {
    src: &'a Target,
    dst: &'a Endpoint,
    allow: CopyOffload,
    caps: Arc<CopyCaps>,
}

impl<'a> Offload<'a> {
    /// None where no offload applies (see the module doc), `sparse` being
    /// the zero-scan block in effect (0: off).
    pub(super) fn new(
        src: &'a Endpoint,
        dst: &'a Endpoint,
        opts: &CopyOptions,
        sparse: u64,
    ) -> Option<Offload<'a>> {
        if opts.offload == OffloadMode::Never || opts.preallocation != Prealloc::Off {
            return None;
        }
        let (s, d) = (src.target()?, dst.target()?);
        let caps = d.copy_caps(s)?;
        Some(Offload {
            src: s,
            dst,
            allow: CopyOffload {
                reflink: true,
                copy_range: sparse == 0,
            },
            caps,
        })
    }

    /// Whether an allowed offload is not known to fail for this pair.
    pub(super) fn may_work(&self) -> bool {
        (self.allow.reflink && self.caps.get(CopyMethod::Reflink).may_work())
            || (self.allow.copy_range && self.caps.get(CopyMethod::CopyRange).may_work())
    }

    /// Offloads what it can of `[offset, offset + len)`; the rest is for the
    /// ordinary path.
    pub(super) fn copy(&self, offset: u64, len: u64) -> endpoint::Result<Offloaded> {
        let t = self.dst.target().expect("local destination");
        t.copy_from(self.src, offset, len, self.allow)
            .map_err(|e| endpoint::Error {
                endpoint: self.dst.name(),
                errno: e.errno(),
                message: e.to_string(),
                nbd: None,
            })
    }
}
