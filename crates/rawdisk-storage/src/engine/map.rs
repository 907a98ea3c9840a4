//! Writes received straight into the page cache.
//!
//! A page-cache write normally costs two copies: socket -> payload buffer
//! (recv) and buffer -> page cache (pwrite). With the target mapped shared,
//! recv can copy into the page cache itself. The pages are faulted in first
//! with MADV_POPULATE_WRITE, so that no space, a hole beyond the end or an
//! I/O error is an errno here (and the caller writes the ordinary way, which
//! reports it), and dropped from the page tables again afterwards, so the
//! process's RSS does not grow with the target. Only the kernel ever touches
//! mapped memory (recv's copy), which turns a page it cannot fault in into
//! EFAULT; a store from user space would be a SIGBUS.
//!
//! Only over pages already in the page cache (mincore): a fault cannot know
//! that the whole page is about to be overwritten, so on a page that is not
//! cached it reads it from the disk first (or clears a new one for a hole),
//! which pwrite of a whole page never does. And only on regular files: on a
//! loop device the mapped path is slower for mid-sized writes, for a cause
//! not found (docs/benchmarks.md, Write path, where the gains on
//! XFS and ext4 and the lower RSS are measured too).

use std::io;
use std::os::fd::BorrowedFd;

use super::{Kind, Target};
use crate::caps::{Method, Tri};
use crate::errno::{is_unsupported, retry, Einval};
use crate::sys::{page_size, MapSpan, Mapping};

/// A shared mapping of the whole target, made on the first mapped write and
/// unmapped with the handle.
pub(super) struct WriteMap {
    map: Mapping,
    /// Writes may not end past the size at open: the rest of the last page
    /// of a file is mapped, but not part of the file.
    len: usize,
}

/// The pages one write lands in, populated; receive the payload with
/// [`MappedWrite::recv`]. Dropping it drops the pages from the page tables
/// (the data stays in the page cache, as after a pwrite).
pub struct MappedWrite<'a> {
    t: &'a Target,
    span: MapSpan<'a>,
    /// Where the write's first byte is inside `span`.
    head: usize,
    len: usize,
    done: usize,
}

impl MappedWrite<'_> {
    /// Bytes of the write received so far.
    pub fn received(&self) -> usize {
        self.done
    }

    /// Bytes still to receive.
    pub fn remaining(&self) -> usize {
        self.len - self.done
    }

    /// Receive what the socket `sock` has queued of the rest of the write,
    /// without waiting. Ok(0): end of stream. WouldBlock: nothing queued.
    /// EFAULT: the next page could not be faulted in (the caller writes the
    /// rest the ordinary way, which reports why).
    pub fn recv(&mut self, sock: BorrowedFd<'_>) -> io::Result<usize> {
        loop {
            let r = self.t.sys.recv_to_map(
                sock,
                &self.span,
                self.head + self.done,
                self.len - self.done,
            );
            match r {
                Ok(n) => {
                    self.done += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for MappedWrite<'_> {
    fn drop(&mut self) {
        let _ = self.t.sys.unpopulate(&self.span);
        self.t.caps.count(Method::MapWrite, Some(self.done as u64));
    }
}

impl Target {
    /// The page cache of [offset, offset+len), mapped and populated for a
    /// write received straight from a socket, or None: O_DIRECT (nothing to
    /// gain), read-only, outside the size at open, the mapping known not to
    /// work here, or populating failed (the ordinary write then reports the
    /// error: ENOSPC, EIO).
    pub fn map_write(&self, offset: u64, len: usize) -> Option<MappedWrite<'_>> {
        if self.direct.is_some()
            || self.kind != Kind::File
            || self.read_only
            || len == 0
            || !self.caps.get(Method::MapWrite).may_work()
        {
            return None;
        }
        let map = self
            .write_map
            .get_or_init(|| self.make_write_map())
            .as_ref()?;
        let end = usize::try_from(offset.checked_add(len as u64)?).ok()?;
        if end > map.len {
            return None;
        }
        let span = map.map.span(offset as usize, len)?;
        match self.sys.resident(&span) {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => {
                tracing::debug!(
                    offset,
                    len,
                    "mincore for a mapped write: {e}; writing instead"
                );
                return None;
            }
        }
        match retry(|| self.sys.populate_write(&span)) {
            Ok(()) => {
                self.learn(Method::MapWrite, Tri::Works, None);
                Some(MappedWrite {
                    t: self,
                    head: offset as usize - span.offset(),
                    span,
                    len,
                    done: 0,
                })
            }
            // MADV_POPULATE_WRITE is Linux 5.14; before, EINVAL.
            Err(e) if is_unsupported(&e, Einval::Unsupported) => {
                self.learn(Method::MapWrite, Tri::Fails, Some(&e));
                None
            }
            Err(e) => {
                tracing::debug!(
                    offset,
                    len,
                    "populate for a mapped write: {e}; writing instead"
                );
                None
            }
        }
    }

    fn make_write_map(&self) -> Option<WriteMap> {
        let size = usize::try_from(self.geom.size).ok()?;
        if size == 0 {
            return None;
        }
        let page = page_size() as usize;
        let len = size.div_ceil(page) * page;
        match self.sys.map_shared(self.fd(), len) {
            Ok(map) => Some(WriteMap { map, len: size }),
            Err(e) => {
                // ENODEV: a file system without mmap. Others (ENOMEM under
                // a ulimit -v) are this handle's, not the storage's.
                if is_unsupported(&e, Method::MapWrite.einval()) {
                    self.learn(Method::MapWrite, Tri::Fails, Some(&e));
                } else {
                    tracing::info!(path = %self.path.display(), "mmap of the target: {e}; writes are copied");
                }
                None
            }
        }
    }
}
