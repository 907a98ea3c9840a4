//! Reading and writing: whole-length pread/pwrite loops, FUA by
//! pwritev2(RWF_DSYNC) or fdatasync, splice of page-cache reads into a pipe,
//! flush and write-back. O_DIRECT requests go through `direct.rs`.
//!
//! The flush-failure rule: once a sync of the target (fdatasync, fsync, or
//! a FUA write's RWF_DSYNC failing with EIO) failed, every later flush and
//! FUA write fails with EIO without trying, until the target is opened
//! again. The kernel reports a write-back error once and may have dropped
//! the pages it could not write, so a later sync would succeed for data
//! that is lost.

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;

use super::{Kind, Target};
use crate::caps::{Method, Tri};
use crate::errno::{errno, is_unsupported, retry, short_read, Einval};
use crate::error::{Error, Result};

impl Target {
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_offset("read", offset, buf.len())?;
        if let Some(d) = &self.direct {
            return d.read_at(self, buf, offset);
        }
        self.pread_all(buf, offset)
    }

    /// Fills `buf` only from the page cache, never waiting for the device:
    /// Ok(false) when part of it is not cached (or the target cannot tell:
    /// O_DIRECT, or no RWF_NOWAIT, learned once), and the caller reads it
    /// where blocking is allowed. `buf` may be partly filled then.
    pub fn read_cached(&self, buf: &mut [u8], offset: u64) -> Result<bool> {
        check_offset("read", offset, buf.len())?;
        if !self.may_read_cached() {
            return Ok(false);
        }
        // tmpfs and ramfs hold the data in memory (tmpfs has no RWF_NOWAIT
        // for reads as of Linux 6.18); only swap could make this wait.
        if self.memory_only {
            return self.pread_all(buf, offset).map(|()| true);
        }
        let mut done = 0usize;
        while done < buf.len() {
            let off = offset + done as u64;
            match self.sys.pread_nowait(self.fd(), &mut buf[done..], off) {
                // End of file: the blocking read reports it.
                Ok(0) => return Ok(false),
                Ok(n) => done += n,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => return Ok(false),
                Err(e) if is_unsupported(&e, Einval::Invalid) => {
                    tracing::debug!(path = %self.path.display(), "no preadv2(RWF_NOWAIT): {e}");
                    self.nowait.set(Tri::Fails);
                    return Ok(false);
                }
                Err(e) => return Err(Error::new("read", offset, buf.len() as u64, e)),
            }
        }
        Ok(true)
    }

    /// Whether [`Target::read_cached`] can answer at all: not under
    /// O_DIRECT, and not where RWF_NOWAIT is known to fail. Callers check
    /// it before taking a buffer for every small read.
    pub fn may_read_cached(&self) -> bool {
        self.direct.is_none() && (self.memory_only || self.nowait.get().may_work())
    }

    /// pread until `buf` is full; EOF first is an error naming the range.
    pub(super) fn pread_all(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = self.pread_upto(buf, offset)?;
        if n < buf.len() {
            let len = buf.len() as u64;
            return Err(Error::new(
                "read",
                offset,
                len,
                short_read(offset, len, offset + n as u64),
            ));
        }
        Ok(())
    }

    /// pread until `buf` is full or EOF; returns the bytes read.
    pub(super) fn pread_upto(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let mut done = 0usize;
        while done < buf.len() {
            match self
                .sys
                .pread(self.fd(), &mut buf[done..], offset + done as u64)
            {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(Error::new("read", offset, buf.len() as u64, e)),
            }
        }
        Ok(done)
    }

    /// Moves `[offset, offset + len)` into `pipe` by splice(2): the pipe then
    /// holds references to the page-cache pages, which a splice to a socket
    /// sends without the two copies of read + send. The pipe must have room
    /// for every page the range touches.
    ///
    /// Ok(true): all of it is in the pipe. Ok(false): not done this way —
    /// O_DIRECT (the pages would be copied anyway), splice known not to work
    /// here, or the pipe filled up; the pipe may hold part of the range and
    /// must be discarded, and the caller reads with [`Target::read_at`].
    /// Errors are the read's (EIO, a short file) and the pipe holds part of
    /// the range too.
    pub fn read_to_pipe(&self, pipe: BorrowedFd<'_>, offset: u64, len: usize) -> Result<bool> {
        check_offset("read", offset, len)?;
        if self.direct.is_some() || !self.caps.get(Method::Splice).may_work() {
            return Ok(false);
        }
        let mut done = 0usize;
        while done < len {
            let pos = offset + done as u64;
            match self.sys.splice_to_pipe(self.fd(), pos, pipe, len - done) {
                Ok(0) => {
                    let e = short_read(offset, len as u64, pos);
                    return Err(Error::new("read", offset, len as u64, e));
                }
                Ok(n) => done += n,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => return Ok(false),
                Err(e) if done == 0 && is_unsupported(&e, Method::Splice.einval()) => {
                    self.learn(Method::Splice, Tri::Fails, Some(&e));
                    return Ok(false);
                }
                Err(e) => return Err(Error::new("read", offset, len as u64, e)),
            }
        }
        self.caps.count(Method::Splice, Some(len as u64));
        self.learn(Method::Splice, Tri::Works, None);
        Ok(true)
    }

    /// `fua`: the data is durable when this returns.
    pub fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.check_writable("write", offset, buf.len() as u64)?;
        check_offset("write", offset, buf.len())?;
        if fua {
            self.check_synced(offset, buf.len() as u64)?;
        }
        if let Some(d) = &self.direct {
            return d.write_at(self, buf, offset, fua);
        }
        self.pwrite_all(buf, offset, fua)
    }

    /// pwrite until all of `buf` is written; with `fua` each piece is written
    /// with RWF_DSYNC (or followed by fdatasync on kernels without it).
    pub(super) fn pwrite_all(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let use_dsync = fua && self.dsync.get().may_work();
        let mut done = 0usize;
        let mut dsync_failed = false;
        while done < buf.len() {
            let off = offset + done as u64;
            let dsynced = use_dsync && !dsync_failed;
            let r = if dsynced {
                match self.sys.pwrite_dsync(self.fd(), &buf[done..], off) {
                    Err(e) if is_unsupported(&e, Einval::Invalid) => {
                        // pwritev2 (4.6) or RWF_DSYNC (4.7) missing.
                        tracing::info!(
                            path = %self.path.display(),
                            "pwritev2(RWF_DSYNC) unsupported ({e}); FUA writes use fdatasync"
                        );
                        self.dsync.set(Tri::Fails);
                        dsync_failed = true;
                        continue;
                    }
                    r => r,
                }
            } else {
                self.sys.pwrite(self.fd(), &buf[done..], off)
            };
            match r {
                Ok(0) => {
                    return Err(Error::new(
                        "write",
                        offset,
                        buf.len() as u64,
                        io::Error::new(io::ErrorKind::WriteZero, "pwrite wrote nothing"),
                    ))
                }
                Ok(n) => done += n,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => {
                    // RWF_DSYNC syncs the written range, which reports (and
                    // consumes) a write-back error of the file.
                    if dsynced && e.raw_os_error() == Some(libc::EIO) {
                        self.sync_failed_with(&e);
                    }
                    return Err(Error::new("write", offset, buf.len() as u64, e));
                }
            }
        }
        if fua && (!use_dsync || dsync_failed) {
            self.sync("write (FUA sync)", offset, buf.len() as u64)?;
        } else if use_dsync {
            self.dsync.set(Tri::Works);
            // A sync that failed meanwhile may have taken this write's error.
            self.check_synced(offset, buf.len() as u64)?;
        }
        Ok(())
    }

    /// fdatasync (fsync on a block device) under the flush-failure rule.
    pub(super) fn sync(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        self.under_sync_rule(op, offset, len, true, || self.datasync_raw())
    }

    /// Runs `call`, a call whose wait reports (and consumes) the file's
    /// write-back error (fdatasync, fsync, sync_file_range with WAIT), under
    /// the flush-failure rule: one at a time, since the kernel tells one
    /// caller and a call overlapping a failing one could return success;
    /// its failure recorded for every later flush and FUA write. `refuse`:
    /// fail at once if an earlier one failed.
    pub(super) fn under_sync_rule(
        &self,
        op: &'static str,
        offset: u64,
        len: u64,
        refuse: bool,
        mut call: impl FnMut() -> io::Result<()>,
    ) -> Result<()> {
        let _one = self.sync_lock.lock().unwrap_or_else(|e| e.into_inner());
        if refuse {
            self.check_synced(offset, len)?;
        }
        retry(&mut call).map_err(|e| {
            self.sync_failed_with(&e);
            Error::new(op, offset, len, e)
        })
    }

    /// EIO once a sync of this target failed (the flush-failure rule).
    fn check_synced(&self, offset: u64, len: u64) -> Result<()> {
        if !self.sync_failed.load(Ordering::Acquire) {
            return Ok(());
        }
        Err(Error::new(
            "refused: an earlier flush of this target failed, data written before it may be lost",
            offset,
            len,
            errno(libc::EIO),
        ))
    }

    /// Records the first failed sync, and says once why every later flush
    /// and FUA write will fail.
    fn sync_failed_with(&self, e: &io::Error) {
        if !self.sync_failed.swap(true, Ordering::AcqRel) {
            tracing::error!(
                "writing back {} failed ({e}): the kernel may have dropped the data it could not \
                 write, so every later flush and FUA write fails with EIO until it is opened again",
                self.path.display()
            );
        }
    }

    fn datasync_raw(&self) -> io::Result<()> {
        match self.kind {
            Kind::File => self.sys.fdatasync(self.fd()),
            // fdatasync and fsync are the same on a block device node, but
            // fsync is the documented way to flush its cache.
            Kind::Block => self.sys.fsync(self.fd()),
        }
    }

    /// Start writing back what the page cache holds of this range, without
    /// waiting: a copy that will flush at the end overlaps that write-back
    /// with the rest of the copy instead of paying it all in the final
    /// fdatasync. Advisory: errors are left for the flush to report. No call
    /// where nothing is ever written back (O_DIRECT, tmpfs, ramfs): with
    /// `serve --write-behind` or a flushing copy that would be one useless
    /// syscall per request.
    /// Whether writes go through a page cache that is written back to a
    /// device (not `--cache none`, not tmpfs or ramfs).
    pub fn has_write_back(&self) -> bool {
        self.direct.is_none() && !self.memory_only
    }

    pub fn start_writeback(&self, offset: u64, len: u64) {
        if !self.has_write_back() || len == 0 {
            return;
        }
        if let Err(e) = self.sys.start_writeback(self.fd(), offset, len) {
            tracing::debug!(offset, len, "sync_file_range(WRITE): {e}");
        }
    }

    /// Makes every completed write durable; see the flush-failure rule above.
    pub fn flush(&self) -> Result<()> {
        self.sync("flush", 0, 0)
    }
}

/// Offsets past what off_t can hold are refused before any arithmetic
/// (the kernel would say EINVAL; the alignment maths would overflow first).
fn check_offset(op: &'static str, offset: u64, len: usize) -> Result<()> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= i64::MAX as u64 => Ok(()),
        _ => Err(Error::new(op, offset, len as u64, errno(libc::EINVAL))),
    }
}
