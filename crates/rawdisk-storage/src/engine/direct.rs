//! cache=none: the target is open with O_DIRECT, which needs offsets, lengths
//! and buffer addresses aligned (STATX_DIOALIGN on Linux 6.1+, else the
//! logical sector of a block device or 4096 for files). Callers (NBD clients)
//! send any range, so:
//!
//! - aligned requests in aligned memory go straight to the kernel;
//! - anything else goes through an aligned bounce buffer covering the
//!   aligned span, with read-modify-write of the partial first and last
//!   blocks.
//!
//! Read-modify-write of a block shared by two concurrent requests would lose
//! one of them (both read the old block, both write back their version), so
//! every write, zero and trim in this mode holds a lock on its aligned span
//! while it runs. Reads need none: a block rewritten by a read-modify-write
//! keeps the bytes outside the request unchanged.
//!
//! A regular file whose size is not a multiple of the alignment: writing the
//! last partial block writes a whole aligned block and so would grow the
//! file. Writes whose span crosses the size last seen take `size_lock`,
//! re-read the size, and cut the file back to max(old size, request end).
//! Every write that can grow the file holds that lock, so the cut never
//! removes another writer's data.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::Ordering;
use std::sync::{Condvar, Mutex};

use super::{Kind, Target};
use crate::errno::{retry, short_read};
use crate::error::{Error, Result};

/// Largest bounce buffer; bigger requests go in pieces.
const BOUNCE_MAX: u64 = 8 << 20;

/// A zeroed buffer whose start is aligned to `align` (a power of two).
/// Over-allocates and slices, which keeps it free of `unsafe`.
pub struct AlignedBuf {
    v: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    pub fn zeroed(len: usize, align: usize) -> AlignedBuf {
        let align = align.max(1).next_power_of_two();
        // vec![0; n] is calloc: untouched pages cost nothing.
        let v = vec![0u8; len + align - 1];
        let start = v.as_ptr().align_offset(align);
        AlignedBuf { v, start, len }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.v[self.start..self.start + self.len]
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.v[self.start..self.start + self.len]
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

/// Byte-range lock: holders of overlapping ranges exclude each other.
#[derive(Default)]
pub(super) struct RangeLock {
    held: Mutex<Vec<(u64, u64)>>,
    cv: Condvar,
}

pub(super) struct RangeGuard<'a> {
    lock: &'a RangeLock,
    range: (u64, u64),
}

impl RangeLock {
    pub(super) fn lock(&self, start: u64, end: u64) -> RangeGuard<'_> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        while held.iter().any(|&(s, e)| s < end && start < e) {
            held = self.cv.wait(held).unwrap_or_else(|p| p.into_inner());
        }
        held.push((start, end));
        RangeGuard {
            lock: self,
            range: (start, end),
        }
    }
}

impl RangeLock {
    /// Takes [start, end) if no holder overlaps it, without waiting; the
    /// caller gives it back with [`RangeLock::unlock`] (a request in
    /// flight in the kernel holds it across calls, so no guard).
    pub(super) fn try_lock(&self, start: u64, end: u64) -> bool {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if held.iter().any(|&(s, e)| s < end && start < e) {
            return false;
        }
        held.push((start, end));
        true
    }

    /// Gives back a range taken by `lock` or `try_lock`.
    pub(super) fn unlock(&self, start: u64, end: u64) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = held.iter().position(|r| *r == (start, end)) {
            held.swap_remove(i);
        }
        drop(held);
        self.cv.notify_all();
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.lock.unlock(self.range.0, self.range.1);
    }
}

pub(super) struct Direct {
    align: u64,
    mem_align: usize,
    locks: RangeLock,
    size_lock: Mutex<()>,
}

impl Direct {
    pub(super) fn new(align: u64, mem_align: usize) -> Direct {
        Direct {
            align: align.max(1).next_power_of_two(),
            mem_align: mem_align.max(1).next_power_of_two(),
            locks: RangeLock::default(),
            size_lock: Mutex::new(()),
        }
    }

    pub(super) fn mem_align(&self) -> usize {
        self.mem_align.max(self.align as usize)
    }

    fn down(&self, v: u64) -> u64 {
        v / self.align * self.align
    }

    fn up(&self, v: u64) -> u64 {
        v.div_ceil(self.align) * self.align
    }

    pub(super) fn aligned(&self, off: u64, len: usize, ptr: *const u8) -> bool {
        off.is_multiple_of(self.align)
            && (len as u64).is_multiple_of(self.align)
            && (ptr as usize).is_multiple_of(self.mem_align)
    }

    pub(super) fn range_lock(&self) -> &RangeLock {
        &self.locks
    }

    /// Lock the aligned span around [off, off+len).
    pub(super) fn lock_span(&self, off: u64, len: u64) -> RangeGuard<'_> {
        self.locks.lock(self.down(off), self.up(off + len))
    }

    /// Split [off, off+len) into pieces whose aligned spans are at most
    /// BOUNCE_MAX (piece boundaries aligned, so pieces never share a block).
    fn pieces(&self, off: u64, len: u64) -> Vec<(u64, u64)> {
        let step = (BOUNCE_MAX / self.align * self.align).max(self.align);
        let end = off + len;
        let mut v = Vec::new();
        let mut pos = off;
        while pos < end {
            let next = (self.down(pos) + step).min(end);
            v.push((pos, next - pos));
            pos = next;
        }
        v
    }

    pub(super) fn read_at(&self, t: &Target, buf: &mut [u8], offset: u64) -> Result<()> {
        if self.aligned(offset, buf.len(), buf.as_ptr()) {
            return t.pread_all(buf, offset);
        }
        let total = buf.len() as u64;
        for (p_off, p_len) in self.pieces(offset, total) {
            let (a0, a1) = (self.down(p_off), self.up(p_off + p_len));
            let mut bounce = AlignedBuf::zeroed((a1 - a0) as usize, self.mem_align());
            let n = t.pread_upto(&mut bounce, a0)? as u64;
            if a0 + n < p_off + p_len {
                return Err(Error::new(
                    "read",
                    offset,
                    total,
                    short_read(offset, total, a0 + n),
                ));
            }
            let s = (p_off - offset) as usize;
            buf[s..s + p_len as usize]
                .copy_from_slice(&bounce[(p_off - a0) as usize..(p_off - a0 + p_len) as usize]);
        }
        Ok(())
    }

    pub(super) fn write_at(&self, t: &Target, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let total = buf.len() as u64;
        if total == 0 {
            return Ok(());
        }
        let whole_aligned = self.aligned(offset, buf.len(), buf.as_ptr());
        let pieces = if whole_aligned {
            vec![(offset, total)]
        } else {
            self.pieces(offset, total)
        };
        for (p_off, p_len) in pieces {
            let p_end = p_off + p_len;
            let (a0, a1) = (self.down(p_off), self.up(p_end));
            let _g = self.locks.lock(a0, a1);
            let s = (p_off - offset) as usize;
            let data = &buf[s..s + p_len as usize];
            // May this write grow a regular file?
            let grows = t.kind == Kind::File && a1 > t.known_size.load(Ordering::Relaxed);
            let _size_guard = if grows {
                Some(self.size_lock.lock().unwrap_or_else(|p| p.into_inner()))
            } else {
                None
            };
            let size_before = if grows {
                Some(
                    t.file_size()
                        .map_err(|e| Error::new("write (fstat)", p_off, p_len, e))?,
                )
            } else {
                None
            };
            let written = if whole_aligned {
                t.pwrite_all(data, p_off, fua)
            } else {
                self.rmw(t, data, p_off, a0, a1, fua)
            };
            // Cut the block padding past the end, also when the write failed
            // half-way (it may have grown the file already).
            if let Some(old) = size_before {
                let want = if written.is_ok() { old.max(p_end) } else { old };
                if a1 > want {
                    retry(|| t.sys.ftruncate(t.fd(), want)).map_err(|e| {
                        Error::new(
                            "write (cut the block padding past the end)",
                            p_off,
                            p_len,
                            e,
                        )
                    })?;
                    if fua && written.is_ok() {
                        // RWF_DSYNC made the padded size durable; make the
                        // real one durable too.
                        t.sync("write (FUA sync)", p_off, p_len)?;
                    }
                }
                t.known_size.store(want, Ordering::Relaxed);
            }
            written?;
        }
        Ok(())
    }

    /// Read the partial first and last blocks of [a0, a1), lay `data` over
    /// them at `p_off`, write the whole span. Caller holds the range lock.
    fn rmw(&self, t: &Target, data: &[u8], p_off: u64, a0: u64, a1: u64, fua: bool) -> Result<()> {
        let p_end = p_off + data.len() as u64;
        let mut bounce = AlignedBuf::zeroed((a1 - a0) as usize, self.mem_align());
        let al = self.align as usize;
        // Short reads (the end of a file inside the block) leave zeros.
        let first_partial = p_off > a0 || (p_end < a1 && a1 - a0 == self.align);
        if first_partial {
            t.pread_upto(&mut bounce[..al], a0)?;
        }
        if p_end < a1 && a1 - a0 > self.align {
            let l = bounce.len();
            t.pread_upto(&mut bounce[l - al..], a1 - self.align)?;
        }
        bounce[(p_off - a0) as usize..(p_end - a0) as usize].copy_from_slice(data);
        t.pwrite_all(&bounce, a0, fua)
    }
}
