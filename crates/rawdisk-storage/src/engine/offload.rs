//! Copy offload from another regular file: FICLONERANGE makes the
//! destination share the source's blocks (XFS with reflink, btrfs), and
//! copy_file_range has the kernel copy them (a reflink again on XFS and
//! btrfs, a server-side copy on NFS 4.2, a page-cache copy on ext4). Neither
//! moves the data through the caller's memory.
//!
//! Whether each works is a property of the pair of file systems, not of one
//! target (FICLONERANGE needs both files on one file system that shares
//! extents; copy_file_range between two file systems needs both to be the
//! same network file system), so it is learned per (source st_dev,
//! destination st_dev) in [`CopyCaps`]. Only "not supported" answers
//! (`errno::is_unsupported_copy`) teach; EIO, ENOSPC... are returned.
//!
//! Never offered: block devices (Linux refuses both calls on anything but
//! regular files) and O_DIRECT on either side (the data must then move
//! through the device, and the read-modify-write range locks of `direct.rs`
//! do not cover ranges the kernel writes).

use std::sync::Arc;

use super::{CacheMode, Kind, Target};
use crate::caps::{CopyCaps, CopyMethod, Tri};
use crate::errno::{is_unsupported_copy, retry, short_read};
use crate::error::{Error, Result};
use crate::registry::{self, PairKey};

/// Which offloads a [`Target::copy_from`] may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOffload {
    pub reflink: bool,
    pub copy_range: bool,
}

/// What [`Target::copy_from`] did with a range.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Offloaded {
    /// Bytes now sharing the source's blocks.
    pub reflinked: u64,
    /// Bytes copied by copy_file_range.
    pub copied: u64,
    /// (offset, length) of what neither moved, in order: the caller copies
    /// them the ordinary way.
    pub rest: Vec<(u64, u64)>,
}

impl Target {
    /// The copy offloads learned between `src`'s file system and this
    /// target's; None where no offload is ever tried (a block device or
    /// O_DIRECT on either side, or the same file).
    pub fn copy_caps(&self, src: &Target) -> Option<Arc<CopyCaps>> {
        if self.kind != Kind::File
            || src.kind != Kind::File
            || self.cache != CacheMode::Writeback
            || src.cache != CacheMode::Writeback
            || self.id == src.id
        {
            return None;
        }
        let mut g = self.copy_pair.lock().unwrap_or_else(|p| p.into_inner());
        match &*g {
            Some((dev, caps)) if *dev == src.id.0 => Some(caps.clone()),
            _ => {
                let caps = registry::copy_caps_for(PairKey {
                    src_dev: src.id.0,
                    dst_dev: self.id.0,
                });
                *g = Some((src.id.0, caps.clone()));
                Some(caps)
            }
        }
    }

    /// Copies `[offset, offset + len)` of `src` to the same range of this
    /// target without reading it: the block-aligned part by FICLONERANGE
    /// where the pair of file systems shares extents, then what is left by
    /// copy_file_range, as `allow` and what was learned permit. What neither
    /// moved is returned in [`Offloaded::rest`]; a "not supported" answer
    /// is learned for the pair and is not an error.
    pub fn copy_from(
        &self,
        src: &Target,
        offset: u64,
        len: u64,
        allow: CopyOffload,
    ) -> Result<Offloaded> {
        self.check_writable("copy", offset, len)?;
        let mut out = Offloaded {
            rest: vec![(offset, len)],
            ..Default::default()
        };
        let Some(caps) = self.copy_caps(src) else {
            return Ok(out);
        };
        if len == 0 {
            out.rest.clear();
            return Ok(out);
        }
        let end = match offset.checked_add(len) {
            Some(e) if e <= i64::MAX as u64 => e,
            _ => {
                return Err(Error::new(
                    "copy",
                    offset,
                    len,
                    crate::errno::errno(libc::EINVAL),
                ))
            }
        };
        if allow.reflink && caps.get(CopyMethod::Reflink).may_work() {
            // Both files' blocks: XFS and btrfs refuse (EINVAL) a range that
            // starts or ends inside one, except at the source's end.
            let a = self.fs_block.max(src.fs_block);
            let (s, e) = (offset.div_ceil(a) * a, end / a * a);
            if s < e {
                let done = self.clone_span(src, &caps, s, e, a)?;
                if done > 0 {
                    out.reflinked = done;
                    out.rest = [(offset, s - offset), (s + done, end - s - done)]
                        .into_iter()
                        .filter(|r| r.1 > 0)
                        .collect();
                }
            }
        }
        if allow.copy_range && caps.get(CopyMethod::CopyRange).may_work() {
            let mut rest = Vec::new();
            for (o, l) in std::mem::take(&mut out.rest) {
                let n = if caps.get(CopyMethod::CopyRange).may_work() {
                    self.copy_range_span(src, &caps, o, l)?
                } else {
                    0
                };
                out.copied += n;
                if n < l {
                    rest.push((o + n, l - n));
                }
            }
            out.rest = rest;
        }
        Ok(out)
    }

    /// FICLONERANGE over `[s, e)` (aligned to `a`) in calls of at most the
    /// zero-call limit; returns the bytes shared from `s` (fewer than asked
    /// when the pair turned out not to support it).
    fn clone_span(&self, src: &Target, caps: &CopyCaps, s: u64, e: u64, a: u64) -> Result<u64> {
        let step = (self.max_call / a * a).max(a);
        let mut pos = s;
        while pos < e {
            let n = (e - pos).min(step);
            match retry(|| self.sys.clone_range(src.fd(), pos, self.fd(), pos, n)) {
                Ok(()) => {
                    caps.count(CopyMethod::Reflink, Some(n));
                    self.learn_copy(src, caps, CopyMethod::Reflink, Tri::Works, None);
                    pos += n;
                }
                Err(err) => {
                    caps.count(CopyMethod::Reflink, None);
                    if is_unsupported_copy(&err) {
                        self.learn_copy(src, caps, CopyMethod::Reflink, Tri::Fails, Some(&err));
                        break;
                    }
                    return Err(Error::new("copy (FICLONERANGE)", pos, n, err));
                }
            }
        }
        Ok(pos - s)
    }

    /// copy_file_range over `[o, o + l)`; returns the bytes copied from `o`.
    fn copy_range_span(&self, src: &Target, caps: &CopyCaps, o: u64, l: u64) -> Result<u64> {
        let mut done = 0u64;
        while done < l {
            let pos = o + done;
            let n = (l - done).min(self.max_call) as usize;
            match self.sys.copy_file_range(src.fd(), pos, self.fd(), pos, n) {
                Ok(0) => {
                    let err = short_read(o, l, pos);
                    return Err(Error::new("copy (copy_file_range)", o, l, err));
                }
                Ok(k) => {
                    caps.count(CopyMethod::CopyRange, Some(k as u64));
                    self.learn_copy(src, caps, CopyMethod::CopyRange, Tri::Works, None);
                    done += k as u64;
                }
                Err(err) if err.raw_os_error() == Some(libc::EINTR) => {}
                Err(err) => {
                    caps.count(CopyMethod::CopyRange, None);
                    if is_unsupported_copy(&err) {
                        self.learn_copy(src, caps, CopyMethod::CopyRange, Tri::Fails, Some(&err));
                        break;
                    }
                    return Err(Error::new("copy (copy_file_range)", pos, n as u64, err));
                }
            }
        }
        Ok(done)
    }

    fn learn_copy(
        &self,
        src: &Target,
        caps: &CopyCaps,
        m: CopyMethod,
        t: Tri,
        why: Option<&std::io::Error>,
    ) {
        if caps.set(m, t) {
            let why = why.map(|e| format!(" ({e})")).unwrap_or_default();
            tracing::info!(
                src = %src.path.display(),
                dst = %self.path.display(),
                method = m.name(),
                state = t.name(),
                "copy offload learned for this pair of file systems: {m} {}{why}",
                t.name()
            );
        }
    }
}
