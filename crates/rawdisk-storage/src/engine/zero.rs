//! Zeroing: the fallback chain, cheapest first.
//!
//! Regular files, per chunk of at most `max_zero_call` (1 GiB) bytes:
//! 1. `may_trim`: fallocate(PUNCH_HOLE | KEEP_SIZE). Frees the blocks; reads
//!    return zeros. Missing on ramfs (no fallocate at all) and on file
//!    systems without hole support.
//! 2. fallocate(WRITE_ZEROES), Linux 6.17: zeros the range as written,
//!    allocated extents through the device's write-zeroes. ext4 (and XFS
//!    where it has it) offer it only when the device zeroes by unmapping,
//!    so it is fast; EOPNOTSUPP everywhere else (tmpfs, ramfs, a file
//!    system on a device without it).
//! 3. fallocate(ZERO_RANGE | KEEP_SIZE): zeros without freeing (unwritten
//!    extents on ext4/XFS). Missing on tmpfs (no ZERO_RANGE in shmem), NFS,
//!    and every kernel before 3.15.
//! 4. PUNCH_HOLE then fallocate(0) over the same range: the data reads zero
//!    and the space stays allocated (file systems with holes but without
//!    ZERO_RANGE: NFS 4.2, where it is far cheaper than writing). On tmpfs
//!    it frees and re-clears every page, which costs about what writing
//!    zeros does, more on one machine and less on another (see
//!    `punch_alloc_timed`): there the first no-trim zeros of at least
//!    `KEEP_ZERO_SPLIT_MIN` are done half one way and half the other, timed,
//!    until each way has zeroed `KEEP_ZERO_SAMPLE` bytes; then the cheaper one
//!    is used for good by every handle on the target. Until then punch-alloc
//!    does not count as fast on tmpfs. Once the chain is down to these two
//!    there, the range is walked by SEEK_DATA/SEEK_HOLE: holes already read
//!    as zeros and are only allocated (fallocate(KEEP_SIZE)), where writing
//!    would allocate and then copy zeros in; only data is timed and zeroed.
//! 5. pwrite from one shared zero buffer, `write_zeros_chunk` bytes a call,
//!    the offset advancing every chunk (nbdkit and the reference nbd-server
//!    shipped a fallback that rewrote the first chunk over and over).
//!
//! Block devices: the kernel rejects ranges not aligned to the logical
//! sector with EINVAL (and a failing fallocate corrupts the cached copy of a
//! partially covered page, see `offload_align` in engine/mod.rs), so the request
//! is aligned to max(sector, page) and split into an unaligned head and
//! tail (written by hand, under O_DIRECT through the read-modify-write path)
//! and an aligned middle (offloaded), the middle first so a fast-only request
//! that cannot be served changes nothing. For the middle:
//! 1. `may_trim` or `fast_only`: fallocate(PUNCH_HOLE | KEEP_SIZE), which the
//!    block layer turns into REQ_OP_WRITE_ZEROES that may unmap and never
//!    falls back to writing: fast or EOPNOTSUPP. (For `fast_only` without
//!    `may_trim` this may deallocate thin-provisioned space: NBD only says
//!    a server SHOULD NOT punch for NO_HOLE, and it is the only offload that
//!    is guaranteed fast.)
//! 2. fallocate(ZERO_RANGE): write-zeroes keeping the allocation, with an
//!    in-kernel fallback to writing zero pages.
//! 3. ioctl(BLKZEROOUT): the same for kernels before 4.9 (no fallocate on
//!    block devices: ENODEV).
//! 4. pwrite of zeros, as for files.
//!
//! fallocate(WRITE_ZEROES) is not used on block devices: there the kernel
//! issues a write-zeroes that may unmap (which a no-trim zero must not ask
//! for) with a fallback to writing (which a fast zero must not have), and
//! only where step 1 works as well: it adds nothing.
//!
//! Steps 2 and 3 may silently write in the kernel: a loop device backed by
//! tmpfs advertises write-zeroes until the first use, then drops it for good
//! (see docs/capabilities.md, tmpfs-backed loop devices). So on block
//! devices only step 1 counts as fast, and each chunk re-reads the learned
//! state: a method that starts failing at run time is learned and the chain
//! goes on from there.
//!
//! `fast_only`: when no fast method is left (learned), fail at once with
//! ENOTSUP, before touching anything.

use std::io;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::direct::AlignedBuf;
use super::{Kind, Target, ZeroFlags, ZeroOutcome, WRITE_ZEROS_CHUNK};
use crate::caps::{KeepZero, Method, Tri};
use crate::errno::{is_unsupported, retry};
use crate::error::{Error, Result};
use crate::sys::FallocMode;

/// The one shared zero buffer: page aligned (usable under O_DIRECT) and
/// allocated zeroed, so its pages are the kernel's shared zero page until
/// written (never): no RSS cost.
pub(super) fn zero_buf() -> &'static [u8] {
    static Z: OnceLock<AlignedBuf> = OnceLock::new();
    Z.get_or_init(|| AlignedBuf::zeroed(WRITE_ZEROS_CHUNK, 4096))
}

/// Whether a method that cannot fall back to writing may still work.
pub(super) fn fast_methods_left(t: &Target, may_trim: bool) -> bool {
    let c = &t.caps;
    match t.kind {
        Kind::File => {
            (may_trim && c.get(Method::PunchHole).may_work())
                || c.get(Method::FallocWriteZeroes).may_work()
                || c.get(Method::ZeroRange).may_work()
                || punch_alloc_may_work(t)
        }
        Kind::Block => c.get(Method::PunchHole).may_work(),
    }
}

impl Target {
    /// Whether a zero with `flags` would be one fallocate this file is
    /// known to answer, extents only: a hole punched, or WRITE_ZEROES /
    /// ZERO_RANGE (unwritten extents). Not on block devices (their
    /// write-zeroes may write in the kernel), not where zeroing is timed
    /// (tmpfs, where it is page by page), not before the call was seen to
    /// work. The server runs such a zero on the connection's own thread.
    pub fn zero_is_one_call(&self, flags: ZeroFlags) -> bool {
        let c = &self.caps;
        if self.kind != Kind::File || self.punch_alloc_timed {
            return false;
        }
        if flags.may_trim && c.get(Method::PunchHole) != Tri::Fails {
            return c.get(Method::PunchHole) == Tri::Works;
        }
        // The chain's order: the first not known to fail is the one tried.
        [Method::FallocWriteZeroes, Method::ZeroRange]
            .into_iter()
            .map(|m| c.get(m))
            .find(|t| *t != Tri::Fails)
            == Some(Tri::Works)
    }
}

/// No-trim zeros smaller than this on a timed target are written, without
/// a sample: halves of 4 MiB and up keep the calls' fixed costs out of the
/// timing.
pub(super) const KEEP_ZERO_SPLIT_MIN: u64 = 8 << 20;

/// How far a no-trim zero on a timed target takes data found by SEEK_DATA
/// before asking again (`zero_by_extent`): a sample's worth, so data runs
/// are still timed as whole requests.
const DATA_STEP: u64 = KEEP_ZERO_SPLIT_MIN;

/// Not known to fail, as far as the calls it is made of go.
fn punch_alloc_supported(t: &Target) -> bool {
    let c = &t.caps;
    c.get(Method::PunchAlloc).may_work()
        && c.get(Method::PunchHole).may_work()
        && c.get(Method::Fallocate).may_work()
}

/// Supported and, where its cost is timed, timed cheaper than writing.
fn punch_alloc_may_work(t: &Target) -> bool {
    punch_alloc_supported(t) && (!t.punch_alloc_timed || t.caps.keep_zero() == KeepZero::PunchAlloc)
}

fn enotsup(offset: u64, len: u64) -> Error {
    Error::new(
        "zero (fast only)",
        offset,
        len,
        io::Error::from_raw_os_error(libc::ENOTSUP),
    )
}

/// Result of one offloaded attempt.
pub(super) enum Try {
    Done,
    /// The storage does not support it (learned), and the errno that said so.
    Unsupported(io::Error),
}

impl Target {
    /// Make [offset, offset+len) read as zeros, the cheapest way the storage
    /// allows (see the module docs for the chain). The range must lie within
    /// the target. Returns the methods used, in the order used.
    pub fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<ZeroOutcome> {
        self.check_writable("zero", offset, len)?;
        let mut out = ZeroOutcome::default();
        if len == 0 {
            return Ok(out);
        }
        self.check_range("zero", offset, len)?;
        if flags.fast_only && !fast_methods_left(self, flags.may_trim) {
            return Err(enotsup(offset, len));
        }
        let end = offset + len;
        let a = self.offload_align;
        let (mid_s, mid_e) = (offset.div_ceil(a) * a, end / a * a);
        if mid_s >= mid_e {
            // No whole aligned block inside (less than two): by hand.
            self.write_zeros(offset, len, self.zero_chunk)?;
            push(&mut out, Method::WriteZeros);
            return Ok(out);
        }
        let mut pos = mid_s;
        let step = self.max_call_aligned();
        while pos < mid_e {
            let n = (mid_e - pos).min(step);
            if self.holes_only_allocated(flags) {
                self.zero_by_extent(pos, n, flags, &mut out)?;
            } else {
                self.zero_chunk(pos, n, flags, &mut out)?;
            }
            pos += n;
        }
        if offset < mid_s {
            self.write_zeros(offset, mid_s - offset, self.zero_chunk)?;
            push(&mut out, Method::WriteZeros);
        }
        if mid_e < end {
            self.write_zeros(mid_e, end - mid_e, self.zero_chunk)?;
            push(&mut out, Method::WriteZeros);
        }
        Ok(out)
    }

    /// One aligned chunk through the chain: a timed sample, an offload, or
    /// written.
    fn zero_chunk(&self, pos: u64, n: u64, flags: ZeroFlags, out: &mut ZeroOutcome) -> Result<()> {
        if self.keep_zero_trial_due(n, flags) {
            return self.keep_zero_trial(pos, n, out);
        }
        match self.offload_chunk(pos, n, flags)? {
            Some(m) => push(out, m),
            None if flags.fast_only => return Err(enotsup(pos, n)),
            None => {
                self.write_zeros(pos, n, self.zero_chunk)?;
                push(out, Method::WriteZeros);
            }
        }
        Ok(())
    }

    /// Whether a no-trim zero here should look at what is under it: on a
    /// timed target (tmpfs) whose only ways to keep zeros allocated are
    /// punch-alloc and writing, a hole already reads as zeros and needs only
    /// allocating (fallocate(0), as punch-alloc ends), where writing would
    /// allocate and then copy zeros in. Data keeps the timed choice.
    fn holes_only_allocated(&self, flags: ZeroFlags) -> bool {
        let c = &self.caps;
        self.punch_alloc_timed
            && !flags.fast_only
            && !(flags.may_trim && c.get(Method::PunchHole).may_work())
            && c.get(Method::FallocWriteZeroes) == Tri::Fails
            && c.get(Method::ZeroRange) == Tri::Fails
            && c.get(Method::Fallocate).may_work()
            && c.get(Method::SeekHole).may_work()
    }

    /// [off, off+n) hole by hole: each hole allocated, the data between
    /// through the chain (and the timing, which so sees only what it decides
    /// on). Only SEEK_DATA is asked, never SEEK_HOLE: on tmpfs SEEK_HOLE
    /// walks the page cache to the next hole, as far as the end of a file
    /// full of data, where SEEK_DATA at data answers at once. So data runs
    /// are found in steps of `DATA_STEP`; a hole shorter than that between
    /// data is zeroed with it.
    fn zero_by_extent(
        &self,
        off: u64,
        n: u64,
        flags: ZeroFlags,
        out: &mut ZeroOutcome,
    ) -> Result<()> {
        let end = off + n;
        let mut pos = off;
        let mut data_from = None;
        while pos < end {
            let next = match retry(|| self.sys.seek_data(self.fd(), pos)) {
                Ok(v) => v,
                Err(e) if is_unsupported(&e, Method::SeekHole.einval()) => {
                    self.learn(Method::SeekHole, Tri::Fails, Some(&e));
                    let d = data_from.unwrap_or(pos);
                    return self.zero_chunk(d, end - d, flags, out);
                }
                Err(e) => return Err(Error::new("zero (SEEK_DATA)", pos, end - pos, e)),
            };
            // None (ENXIO): no data from here on.
            let data = next.unwrap_or(end).min(end);
            if data == pos {
                data_from.get_or_insert(pos);
                pos = (pos + DATA_STEP).min(end);
                continue;
            }
            if let Some(d) = data_from.take() {
                self.zero_chunk(d, pos - d, flags, out)?;
            }
            // [pos, data) reads as zeros: allocate it. KEEP_SIZE: a file cut
            // short under us is not grown.
            let done = {
                let _lock = self.direct.as_ref().map(|d| d.lock_span(pos, data - pos));
                let r = retry(|| {
                    self.sys
                        .fallocate(self.fd(), FallocMode::AllocateKeepSize, pos, data - pos)
                });
                matches!(
                    self.judge(Method::Fallocate, pos, data - pos, r)?,
                    Try::Done
                )
            };
            if done {
                push(out, Method::Fallocate);
            } else {
                self.zero_chunk(pos, data - pos, flags, out)?;
            }
            pos = data;
        }
        if let Some(d) = data_from {
            self.zero_chunk(d, end - d, flags, out)?;
        }
        Ok(())
    }

    /// Whether this chunk should be a timed sample: the chain would reach
    /// punch-alloc (no trim, or no punching; WRITE_ZEROES and ZERO_RANGE
    /// learned missing) on a timed target whose choice is still open. Never
    /// for fast-only requests: until the timing says so, punch-alloc is not
    /// fast here.
    fn keep_zero_trial_due(&self, n: u64, flags: ZeroFlags) -> bool {
        let c = &self.caps;
        // (Only files are ever timed: the magic is read for files only.)
        self.punch_alloc_timed
            && !flags.fast_only
            && n >= KEEP_ZERO_SPLIT_MIN
            && c.keep_zero() == KeepZero::Unknown
            && !(flags.may_trim && c.get(Method::PunchHole).may_work())
            && c.get(Method::FallocWriteZeroes) == Tri::Fails
            && c.get(Method::ZeroRange) == Tri::Fails
            && punch_alloc_supported(self)
    }

    /// Zero the first half of [off, off+n) by punch-alloc and the rest by
    /// writing, timing each, and add both to the target's trial.
    fn keep_zero_trial(&self, off: u64, n: u64, out: &mut ZeroOutcome) -> Result<()> {
        let page = crate::sys::page_size();
        let half = n / 2 / page * page;
        let t0 = Instant::now();
        let punched = {
            let _lock = self.direct.as_ref().map(|d| d.lock_span(off, half));
            matches!(self.try_punch_alloc(off, half)?, Try::Done)
        };
        if punched {
            push(out, Method::PunchAlloc);
            self.sample_keep_zero(Method::PunchAlloc, half, t0.elapsed());
        } else {
            // Learned unsupported just now: no trial from here on.
            self.write_zeros(off, half, self.zero_chunk)?;
            push(out, Method::WriteZeros);
        }
        let t1 = Instant::now();
        self.write_zeros(off + half, n - half, self.zero_chunk)?;
        push(out, Method::WriteZeros);
        if punched {
            self.sample_keep_zero(Method::WriteZeros, n - half, t1.elapsed());
        }
        Ok(())
    }

    fn sample_keep_zero(&self, m: Method, bytes: u64, took: Duration) {
        let Some((trial, v)) = self.caps.sample_keep_zero(m, bytes, took) else {
            return;
        };
        let rate =
            |(t, b): (Duration, u64)| b as f64 / t.as_secs_f64().max(1e-9) / (1u64 << 30) as f64;
        tracing::info!(
            path = %self.path.display(),
            keep_zero = v.name(),
            "no-trim zeros timed: punch+fallocate {:.2} GiB/s, writing zeros {:.2} GiB/s: zeroing by {} from now on",
            rate(trial.punch_alloc),
            rate(trial.write_zeros),
            v.name()
        );
    }

    /// Run the offload chain on one chunk. Ok(None): no offload method is
    /// left (all known to fail, or just learned to); the caller writes.
    fn offload_chunk(&self, off: u64, n: u64, flags: ZeroFlags) -> Result<Option<Method>> {
        let _lock = self.direct.as_ref().map(|d| d.lock_span(off, n));
        let c = &self.caps;
        match self.kind {
            Kind::File => {
                if flags.may_trim && c.get(Method::PunchHole).may_work() {
                    if let Try::Done = self.try_falloc(Method::PunchHole, off, n)? {
                        return Ok(Some(Method::PunchHole));
                    }
                }
                // Before ZERO_RANGE: written extents make later writes plain
                // overwrites, where unwritten ones cost a conversion each.
                if c.get(Method::FallocWriteZeroes).may_work() {
                    if let Try::Done = self.try_falloc(Method::FallocWriteZeroes, off, n)? {
                        return Ok(Some(Method::FallocWriteZeroes));
                    }
                }
                if c.get(Method::ZeroRange).may_work() {
                    if let Try::Done = self.try_falloc(Method::ZeroRange, off, n)? {
                        return Ok(Some(Method::ZeroRange));
                    }
                }
                if punch_alloc_may_work(self) {
                    if let Try::Done = self.try_punch_alloc(off, n)? {
                        return Ok(Some(Method::PunchAlloc));
                    }
                }
            }
            Kind::Block => {
                if (flags.may_trim || flags.fast_only) && c.get(Method::PunchHole).may_work() {
                    if flags.fast_only && self.direct.is_none() {
                        // blkdev_fallocate drops the range's page cache,
                        // dirty pages included, *before* it knows whether the
                        // zero-out will work. If it then fails (a loop device
                        // that lost write-zeroes), writes still in the cache
                        // are gone and stale data reads back. Falling through
                        // to the next method zeroes the range anyway; a fast
                        // zero that fails must leave the data as it was, so
                        // write the cache back first (cheap: usually clean).
                        // Its wait reports the file's write-back error as
                        // fdatasync does, so it obeys the same rule.
                        self.under_sync_rule("zero (write back cache)", off, n, false, || {
                            self.sys.sync_range(self.fd(), off, n)
                        })?;
                    }
                    if let Try::Done = self.try_falloc(Method::PunchHole, off, n)? {
                        return Ok(Some(Method::PunchHole));
                    }
                }
                if flags.fast_only {
                    return Ok(None);
                }
                if c.get(Method::ZeroRange).may_work() {
                    if let Try::Done = self.try_falloc(Method::ZeroRange, off, n)? {
                        return Ok(Some(Method::ZeroRange));
                    }
                }
                if c.get(Method::BlkZeroout).may_work() {
                    let r = retry(|| self.sys.blkzeroout(self.fd(), off, n));
                    if let Try::Done = self.judge(Method::BlkZeroout, off, n, r)? {
                        return Ok(Some(Method::BlkZeroout));
                    }
                }
            }
        }
        Ok(None)
    }

    pub(super) fn try_falloc(&self, m: Method, off: u64, n: u64) -> Result<Try> {
        let mode = match m {
            Method::PunchHole => FallocMode::PunchHole,
            Method::ZeroRange => FallocMode::ZeroRange { keep_size: true },
            Method::FallocWriteZeroes => FallocMode::WriteZeroes,
            _ => FallocMode::Allocate,
        };
        let r = retry(|| self.sys.fallocate(self.fd(), mode, off, n));
        self.judge(m, off, n, r)
    }

    /// Count the call; learn from success or a "not supported" errno; return
    /// any other error.
    pub(super) fn judge(&self, m: Method, off: u64, n: u64, r: io::Result<()>) -> Result<Try> {
        match r {
            Ok(()) => {
                self.caps.count(m, Some(n));
                self.learn(m, Tri::Works, None);
                Ok(Try::Done)
            }
            Err(e) => {
                self.caps.count(m, None);
                if is_unsupported(&e, m.einval()) {
                    self.learn(m, Tri::Fails, Some(&e));
                    Ok(Try::Unsupported(e))
                } else {
                    Err(Error::new(op_name(m), off, n, e))
                }
            }
        }
    }

    pub(super) fn try_punch_alloc(&self, off: u64, n: u64) -> Result<Try> {
        let r = retry(|| self.sys.fallocate(self.fd(), FallocMode::PunchHole, off, n));
        match r {
            Ok(()) => {
                self.learn(Method::PunchHole, Tri::Works, None);
            }
            Err(e) => {
                self.caps.count(Method::PunchAlloc, None);
                if is_unsupported(&e, Method::PunchHole.einval()) {
                    self.learn(Method::PunchHole, Tri::Fails, Some(&e));
                    self.learn(Method::PunchAlloc, Tri::Fails, Some(&e));
                    return Ok(Try::Unsupported(e));
                }
                return Err(Error::new("zero (punch hole)", off, n, e));
            }
        }
        let r = retry(|| self.sys.fallocate(self.fd(), FallocMode::Allocate, off, n));
        match r {
            Ok(()) => {
                self.caps.count(Method::PunchAlloc, Some(n));
                self.learn(Method::Fallocate, Tri::Works, None);
                self.learn(Method::PunchAlloc, Tri::Works, None);
                Ok(Try::Done)
            }
            Err(e) => {
                self.caps.count(Method::PunchAlloc, None);
                if is_unsupported(&e, Method::Fallocate.einval()) {
                    // The range is a hole now (zeros); the next step
                    // allocates it again by writing.
                    self.learn(Method::Fallocate, Tri::Fails, Some(&e));
                    self.learn(Method::PunchAlloc, Tri::Fails, Some(&e));
                    return Ok(Try::Unsupported(e));
                }
                Err(Error::new("zero (fallocate after punch)", off, n, e))
            }
        }
    }

    /// Write zeros over [offset, offset+len) from the shared zero buffer,
    /// `chunk` bytes per write, advancing the offset every chunk.
    pub(super) fn write_zeros(&self, offset: u64, len: u64, chunk: usize) -> Result<()> {
        let z = zero_buf();
        let chunk = chunk.clamp(1, z.len()) as u64;
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let n = (end - pos).min(chunk);
            let buf = &z[..n as usize];
            let r = match &self.direct {
                Some(d) => d.write_at(self, buf, pos, false),
                None => self.pwrite_all(buf, pos, false),
            };
            match r {
                Ok(()) => self.caps.count(Method::WriteZeros, Some(n)),
                Err(e) => {
                    self.caps.count(Method::WriteZeros, None);
                    return Err(Error::new("zero (write zeros)", pos, n, e.source));
                }
            }
            pos += n;
        }
        Ok(())
    }
}

fn push(out: &mut ZeroOutcome, m: Method) {
    if !out.methods.contains(&m) {
        out.methods.push(m);
    }
}

fn op_name(m: Method) -> &'static str {
    match m {
        Method::PunchHole => "zero (punch hole)",
        Method::ZeroRange => "zero (zero range)",
        Method::FallocWriteZeroes => "zero (fallocate WRITE_ZEROES)",
        Method::BlkZeroout => "zero (BLKZEROOUT)",
        _ => "zero",
    }
}
