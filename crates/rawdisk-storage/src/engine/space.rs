//! Space: trim (discard), extents (SEEK_DATA/SEEK_HOLE) and preallocation.

use std::io;
use std::sync::atomic::Ordering;

use super::{Extent, ExtentKind, Kind, Prealloc, PreallocReport, Target, WRITE_ZEROS_CHUNK};
use crate::caps::{Method, Tri};
use crate::errno::{is_unsupported, retry};
use crate::error::{Error, Result};
use crate::sys::{CallKind, FallocMode};

impl Target {
    // ---- trim ----

    /// Discard the range. Advisory: an unsupported method is learned and the
    /// call succeeds doing nothing; real errors (EIO, EPERM, ENOSPC...) are
    /// returned. The range reads back as either the old data or zeros.
    pub fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.check_writable("trim", offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.check_range("trim", offset, len)?;
        let (method, start, end) = match self.kind {
            Kind::File => (Method::PunchHole, offset, offset + len),
            Kind::Block => {
                let a = self.offload_align;
                let s = offset.div_ceil(a) * a;
                let e = (offset + len) / a * a;
                (Method::BlkDiscard, s, e)
            }
        };
        if start >= end || !self.caps.get(method).may_work() {
            return Ok(());
        }
        let _lock = self
            .direct
            .as_ref()
            .map(|d| d.lock_span(start, end - start));
        let mut pos = start;
        while pos < end {
            let n = (end - pos).min(self.max_call_aligned());
            let r = retry(|| match method {
                Method::PunchHole => self.sys.fallocate(self.fd(), FallocMode::PunchHole, pos, n),
                _ => self.sys.blkdiscard(self.fd(), pos, n),
            });
            match r {
                Ok(()) => {
                    self.caps.count(method, Some(n));
                    self.learn(method, Tri::Works, None);
                }
                Err(e) => {
                    self.caps.count(method, None);
                    if is_unsupported(&e, method.einval()) {
                        self.learn(method, Tri::Fails, Some(&e));
                        return Ok(());
                    }
                    return Err(Error::new("trim", pos, n, e));
                }
            }
            pos += n;
        }
        Ok(())
    }

    /// The per-syscall limit rounded down to the offload alignment.
    pub(super) fn max_call_aligned(&self) -> u64 {
        let a = self.offload_align;
        (self.max_call / a * a).max(a)
    }

    // ---- extents ----

    /// At most `max_runs` extents covering a prefix of [offset, offset+len),
    /// clipped to the end of the target (empty when `offset` is at or past
    /// it). Adjacent runs of the same kind are merged. Block devices, and
    /// files where SEEK_HOLE is unsupported, report one data run.
    pub fn extents(&self, offset: u64, len: u64, max_runs: usize) -> Result<Vec<Extent>> {
        let size = match self.kind {
            Kind::Block => self.geom.size,
            Kind::File => self
                .file_size()
                .map_err(|e| Error::new("extents", offset, len, e))?,
        };
        self.extents_within(offset, len, max_runs, size)
    }

    /// [`Target::extents`] clipped to a `size` the caller holds (an NBD
    /// export's, fixed at its handshake) instead of an fstat per call. A
    /// file shrunk below `size` since reports the part past its end as a
    /// hole (SEEK_DATA finds no data there).
    pub fn extents_within(
        &self,
        offset: u64,
        len: u64,
        max_runs: usize,
        size: u64,
    ) -> Result<Vec<Extent>> {
        let end = offset.saturating_add(len).min(size);
        if offset >= end || max_runs == 0 {
            return Ok(Vec::new());
        }
        let all_data = || {
            vec![Extent {
                offset,
                len: end - offset,
                kind: ExtentKind::Data,
            }]
        };
        if self.kind == Kind::Block || !self.caps.get(Method::SeekHole).may_work() {
            return Ok(all_data());
        }
        let mut out: Vec<Extent> = Vec::new();
        let mut pos = offset;
        let push = |out: &mut Vec<Extent>, off: u64, len: u64, kind: ExtentKind| {
            if let Some(last) = out.last_mut() {
                if last.kind == kind && last.offset + last.len == off {
                    last.len += len;
                    return;
                }
            }
            out.push(Extent {
                offset: off,
                len,
                kind,
            });
        };
        // Where SEEK_DATA just found data, asking again would only repeat
        // it: go straight to SEEK_HOLE (two lookups per hole and data pair).
        let mut at_data = false;
        while pos < end {
            if out.len() >= max_runs {
                // The last run may still grow by merging; stop only once a
                // new, different run would be needed.
                break;
            }
            let d = if std::mem::take(&mut at_data) {
                Ok(Some(pos))
            } else {
                self.seek(CallKind::SeekData, pos)
            };
            let d = match d {
                Ok(v) => v,
                Err(e) if is_unsupported(&e, Method::SeekHole.einval()) && out.is_empty() => {
                    self.learn(Method::SeekHole, Tri::Fails, Some(&e));
                    return Ok(all_data());
                }
                Err(e) => return Err(Error::new("extents (SEEK_DATA)", pos, end - pos, e)),
            };
            match d {
                // ENXIO: no data at or after pos, the rest is a hole.
                None => {
                    push(&mut out, pos, end - pos, ExtentKind::Hole);
                    pos = end;
                }
                Some(d) if d > pos => {
                    let e = d.min(end);
                    push(&mut out, pos, e - pos, ExtentKind::Hole);
                    pos = e;
                    at_data = true;
                }
                Some(_) => {
                    let h = match self.seek(CallKind::SeekHole, pos) {
                        Ok(v) => v,
                        Err(e) => return Err(Error::new("extents (SEEK_HOLE)", pos, end - pos, e)),
                    };
                    // None: the file shrank under us; call the rest data.
                    let e = h.unwrap_or(end).min(end).max(pos + 1);
                    push(&mut out, pos, e - pos, ExtentKind::Data);
                    pos = e;
                }
            }
        }
        self.caps.count(Method::SeekHole, Some(pos - offset));
        self.learn(Method::SeekHole, Tri::Works, None);
        if out.len() > max_runs {
            out.truncate(max_runs);
        }
        Ok(out)
    }

    fn seek(&self, kind: CallKind, pos: u64) -> io::Result<Option<u64>> {
        retry(|| match kind {
            CallKind::SeekData => self.sys.seek_data(self.fd(), pos),
            _ => self.sys.seek_hole(self.fd(), pos),
        })
    }

    // ---- preallocation ----

    /// Grow the file to `size` with the chosen allocation. Never shrinks (an
    /// error). Block devices: nothing to do when `size` fits, else an error.
    /// A file grown from 0 gets its first block written (as qemu's
    /// allocate_first_block) so O_DIRECT alignment probing by later users
    /// finds allocated data.
    pub fn preallocate(&self, size: u64, mode: Prealloc) -> Result<PreallocReport> {
        // preallocation=off only sets the size: its failures say so.
        let (op, fstat_op, truncate_op) = match mode {
            Prealloc::Off => (
                "set the size",
                "set the size (fstat)",
                "set the size (ftruncate)",
            ),
            Prealloc::Falloc | Prealloc::Full => (
                "preallocate",
                "preallocate (fstat)",
                "preallocate (ftruncate)",
            ),
        };
        self.check_writable(op, 0, size)?;
        if self.kind == Kind::Block {
            if size <= self.geom.size {
                return Ok(PreallocReport { method: None });
            }
            return Err(Error::new(
                op,
                0,
                size,
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{}: block device is {} bytes, smaller than the requested size",
                        self.path.display(),
                        self.geom.size
                    ),
                ),
            ));
        }
        let old = self
            .file_size()
            .map_err(|e| Error::new(fstat_op, 0, size, e))?;
        if size < old {
            return Err(Error::new(
                op,
                0,
                size,
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("file is already {old} bytes; preallocation never shrinks"),
                ),
            ));
        }
        let method = match mode {
            Prealloc::Off => {
                self.truncate_to(truncate_op, old, size)?;
                None
            }
            Prealloc::Falloc => match self.prealloc_falloc(old, size)? {
                true => Some(Method::Fallocate),
                false => {
                    self.prealloc_full(old, size)?;
                    Some(Method::WriteZeros)
                }
            },
            Prealloc::Full => {
                self.prealloc_full(old, size)?;
                Some(Method::WriteZeros)
            }
        };
        if old == 0 && size > 0 && mode == Prealloc::Off {
            self.allocate_first_block(size)?;
        }
        self.known_size.store(size, Ordering::Relaxed);
        Ok(PreallocReport { method })
    }

    fn truncate_to(&self, op: &'static str, old: u64, size: u64) -> Result<()> {
        if size == old {
            return Ok(());
        }
        retry(|| self.sys.ftruncate(self.fd(), size))
            .map_err(|e| Error::new(op, old, size - old, e))
    }

    /// fallocate(0) from the old end. Ok(false): unsupported here (learned),
    /// the caller falls back to writing. Never posix_fallocate: glibc's
    /// emulation writes one byte per 4 KiB block, slower than writing zeros
    /// (see docs/capabilities.md, ramfs).
    fn prealloc_falloc(&self, old: u64, size: u64) -> Result<bool> {
        if size == old {
            return Ok(true);
        }
        if !self.caps.get(Method::Fallocate).may_work() {
            return Ok(false);
        }
        match retry(|| {
            self.sys
                .fallocate(self.fd(), FallocMode::Allocate, old, size - old)
        }) {
            Ok(()) => {
                self.caps.count(Method::Fallocate, Some(size - old));
                self.learn(Method::Fallocate, Tri::Works, None);
                Ok(true)
            }
            Err(e) => {
                self.caps.count(Method::Fallocate, None);
                if is_unsupported(&e, Method::Fallocate.einval()) {
                    self.learn(Method::Fallocate, Tri::Fails, Some(&e));
                    return Ok(false);
                }
                Err(Error::new("preallocate (fallocate)", old, size - old, e))
            }
        }
    }

    /// ftruncate, write zeros from the old end, fsync. On failure the file is
    /// cut back to its old size so no half-allocated image is left behind.
    fn prealloc_full(&self, old: u64, size: u64) -> Result<()> {
        if size == old {
            return Ok(());
        }
        self.truncate_to("preallocate (ftruncate)", old, size)?;
        let r = self
            .write_zeros(old, size - old, WRITE_ZEROS_CHUNK.max(self.zero_chunk))
            .and_then(|()| {
                retry(|| self.sys.fsync(self.fd()))
                    .map_err(|e| Error::new("preallocate (fsync)", old, size - old, e))
            });
        if let Err(e) = r {
            if let Err(e2) = retry(|| self.sys.ftruncate(self.fd(), old)) {
                tracing::warn!(
                    path = %self.path.display(),
                    "could not cut the file back to {old} bytes after failed preallocation: {e2}"
                );
            }
            return Err(e);
        }
        Ok(())
    }

    fn allocate_first_block(&self, size: u64) -> Result<()> {
        let n = (self.geom.dio_align.max(4096) as u64).min(size) as usize;
        let z = super::zero::zero_buf();
        self.write_at(&z[..n], 0, false)
    }
}
