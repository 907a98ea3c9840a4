//! Learned capabilities: for each storage method, whether it works on this
//! target, is known to fail, or has not been tried yet. One `Capabilities` is
//! shared by every handle opened on the same target in the process (keyed by
//! device and inode), so an unsupported call is paid for once per process.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::errno::Einval;

/// A way of zeroing, trimming, allocating or mapping that the storage may or
/// may not support.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Method {
    /// fallocate(PUNCH_HOLE | KEEP_SIZE)
    PunchHole,
    /// fallocate(WRITE_ZEROES), Linux 6.17: zeros as written extents
    FallocWriteZeroes,
    /// fallocate(ZERO_RANGE)
    ZeroRange,
    /// fallocate(PUNCH_HOLE | KEEP_SIZE) then fallocate(0) on the same range
    PunchAlloc,
    /// fallocate(0), used by preallocation
    Fallocate,
    /// ioctl(BLKZEROOUT)
    BlkZeroout,
    /// ioctl(BLKDISCARD)
    BlkDiscard,
    /// lseek(SEEK_DATA / SEEK_HOLE)
    SeekHole,
    /// pwrite of a zero buffer; always works, counted only
    WriteZeros,
    /// splice(file -> pipe): page-cache reads handed to a socket by page
    /// reference instead of copied through a buffer
    Splice,
    /// mmap + MADV_POPULATE_WRITE: write payloads received from the socket
    /// straight into the page cache
    MapWrite,
}

impl Method {
    pub const ALL: [Method; 11] = [
        Method::PunchHole,
        Method::FallocWriteZeroes,
        Method::ZeroRange,
        Method::PunchAlloc,
        Method::Fallocate,
        Method::BlkZeroout,
        Method::BlkDiscard,
        Method::SeekHole,
        Method::WriteZeros,
        Method::Splice,
        Method::MapWrite,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Method::PunchHole => "punch-hole",
            Method::FallocWriteZeroes => "falloc-write-zeroes",
            Method::ZeroRange => "zero-range",
            Method::PunchAlloc => "punch-alloc",
            Method::Fallocate => "fallocate",
            Method::BlkZeroout => "blkzeroout",
            Method::BlkDiscard => "blkdiscard",
            Method::SeekHole => "seek-hole",
            Method::WriteZeros => "write-zeros",
            Method::Splice => "splice",
            Method::MapWrite => "map-write",
        }
    }

    /// What the method does and what it costs, one line, for `probe`,
    /// `info` and logs.
    pub fn explain(self) -> &'static str {
        match self {
            Method::PunchHole => {
                "fallocate(PUNCH_HOLE|KEEP_SIZE): frees the range, reads zeros; on a block \
                 device a write-zeroes that may unmap and never falls back to writing"
            }
            Method::FallocWriteZeroes => {
                "fallocate(WRITE_ZEROES): zeros keeping the space allocated and written, by \
                 the device's write-zeroes; offered only where the device zeroes by unmapping \
                 (Linux 6.17 and later)"
            }
            Method::ZeroRange => {
                "fallocate(ZERO_RANGE): zeros keeping the space allocated; on a block device \
                 the kernel may fall back to writing zero pages"
            }
            Method::PunchAlloc => {
                "PUNCH_HOLE then fallocate(0) on the same range: zeros keeping the space \
                 allocated where ZERO_RANGE is missing (tmpfs)"
            }
            Method::Fallocate => {
                "fallocate(0): allocate space without writing (preallocation=falloc)"
            }
            Method::BlkZeroout => {
                "ioctl(BLKZEROOUT): device write-zeroes, the kernel writing zero pages \
                 when the device cannot"
            }
            Method::BlkDiscard => "ioctl(BLKDISCARD): discard (trim) a block device range",
            Method::SeekHole => "lseek(SEEK_DATA/SEEK_HOLE): map data and holes",
            Method::WriteZeros => "pwrite of a zero buffer: always works, costs a full write",
            Method::Splice => {
                "splice(file -> pipe): reads served from the page cache by page reference, \
                 without copying through a buffer"
            }
            Method::MapWrite => {
                "mmap + MADV_POPULATE_WRITE: write payloads received from the socket straight \
                 into the page cache, one copy instead of two"
            }
        }
    }

    /// What an EINVAL from this method's call means: lack of support for
    /// lseek(SEEK_DATA/SEEK_HOLE) (block devices, kernels before 3.1) and
    /// splice (file systems without splice_read), a bad argument otherwise.
    pub(crate) fn einval(self) -> Einval {
        match self {
            Method::SeekHole | Method::Splice => Einval::Unsupported,
            _ => Einval::Invalid,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What is known about one method on one target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tri {
    Unknown,
    Works,
    Fails,
}

impl Tri {
    pub fn name(self) -> &'static str {
        match self {
            Tri::Unknown => "unknown",
            Tri::Works => "works",
            Tri::Fails => "known to fail",
        }
    }

    /// Worth trying: not known to fail.
    pub fn may_work(self) -> bool {
        self != Tri::Fails
    }

    fn from_u8(v: u8) -> Tri {
        match v {
            1 => Tri::Works,
            2 => Tri::Fails,
            _ => Tri::Unknown,
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            Tri::Unknown => 0,
            Tri::Works => 1,
            Tri::Fails => 2,
        }
    }
}

/// A [`Tri`] learned per target outside the shared method table (what
/// depends on the kernel, not the storage: RWF_DSYNC, RWF_NOWAIT).
#[derive(Debug, Default)]
pub(crate) struct TriCell(AtomicU8);

impl TriCell {
    pub(crate) fn get(&self) -> Tri {
        Tri::from_u8(self.0.load(Ordering::Relaxed))
    }

    pub(crate) fn set(&self, t: Tri) {
        self.0.store(t.to_u8(), Ordering::Relaxed);
    }
}

/// Calls made and bytes handled by one method (successful calls only count bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MethodStats {
    pub calls: u64,
    pub failures: u64,
    pub bytes: u64,
}

#[derive(Default)]
struct Slot {
    state: AtomicU8,
    calls: AtomicU64,
    failures: AtomicU64,
    bytes: AtomicU64,
}

/// Which of the two ways to zero while keeping the space allocated is cheaper
/// on a target where both work and neither wins everywhere (tmpfs: see
/// `Target::punch_alloc_timed`), learned by timing both on real requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepZero {
    Unknown,
    PunchAlloc,
    WriteZeros,
}

impl KeepZero {
    pub fn name(self) -> &'static str {
        match self {
            KeepZero::Unknown => "unknown",
            KeepZero::PunchAlloc => "punch-alloc",
            KeepZero::WriteZeros => "write-zeros",
        }
    }

    fn from_u8(v: u8) -> KeepZero {
        match v {
            1 => KeepZero::PunchAlloc,
            2 => KeepZero::WriteZeros,
            _ => KeepZero::Unknown,
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            KeepZero::Unknown => 0,
            KeepZero::PunchAlloc => 1,
            KeepZero::WriteZeros => 2,
        }
    }
}

/// Bytes each way must have zeroed before the timings are compared: enough
/// milliseconds of each on tmpfs, also beside other requests on the same
/// file, that one preempted call on a 2-core machine does not decide it.
pub const KEEP_ZERO_SAMPLE: u64 = 64 << 20;

/// Time and bytes spent so far on each way, while the choice is open.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct KeepZeroTrial {
    pub punch_alloc: (Duration, u64),
    pub write_zeros: (Duration, u64),
}

impl KeepZeroTrial {
    /// The cheaper way per byte, once both have zeroed enough to tell.
    pub fn verdict(&self) -> Option<KeepZero> {
        let (pt, pb) = self.punch_alloc;
        let (wt, wb) = self.write_zeros;
        if pb < KEEP_ZERO_SAMPLE || wb < KEEP_ZERO_SAMPLE {
            return None;
        }
        // pt/pb < wt/wb, without division.
        if pt.as_nanos() * (wb as u128) < wt.as_nanos() * (pb as u128) {
            Some(KeepZero::PunchAlloc)
        } else {
            Some(KeepZero::WriteZeros)
        }
    }
}

/// The shared, lock-free record of what a target supports.
#[derive(Default)]
pub struct Capabilities {
    slots: [Slot; Method::ALL.len()],
    /// A KeepZero as u8.
    keep_zero: AtomicU8,
    /// Only touched while `keep_zero` is Unknown, a few times per target.
    keep_zero_trial: Mutex<KeepZeroTrial>,
    /// Bumped on every state change so observers (the server's logger) can
    /// notice a change without polling every slot.
    generation: AtomicU64,
}

impl std::fmt::Debug for Capabilities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(Method::ALL.iter().map(|m| (m.name(), self.get(*m).name())))
            .finish()
    }
}

impl Capabilities {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get(&self, m: Method) -> Tri {
        Tri::from_u8(self.slots[m.index()].state.load(Ordering::Acquire))
    }

    /// Record what a call taught us. Returns true when the state changed.
    pub fn set(&self, m: Method, t: Tri) -> bool {
        let state = &self.slots[m.index()].state;
        // Every successful spliced read and mapped write confirms `works`:
        // a read keeps the slot's cache line shared between the connections'
        // threads, where a swap would take it exclusive each time.
        if state.load(Ordering::Acquire) == t.to_u8() {
            return false;
        }
        let old = state.swap(t.to_u8(), Ordering::AcqRel);
        let changed = old != t.to_u8();
        if changed {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
        changed
    }

    /// Count one call of `m`; `ok_bytes` is Some(bytes) when it succeeded.
    pub fn count(&self, m: Method, ok_bytes: Option<u64>) {
        let s = &self.slots[m.index()];
        s.calls.fetch_add(1, Ordering::Relaxed);
        match ok_bytes {
            Some(b) => {
                s.bytes.fetch_add(b, Ordering::Relaxed);
            }
            None => {
                s.failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub fn stats(&self, m: Method) -> MethodStats {
        let s = &self.slots[m.index()];
        MethodStats {
            calls: s.calls.load(Ordering::Relaxed),
            failures: s.failures.load(Ordering::Relaxed),
            bytes: s.bytes.load(Ordering::Relaxed),
        }
    }

    pub fn keep_zero(&self) -> KeepZero {
        KeepZero::from_u8(self.keep_zero.load(Ordering::Acquire))
    }

    /// Add one timed zeroing by `m` (PunchAlloc or WriteZeros) to the trial.
    /// Returns the trial and the verdict when this sample decided it; later
    /// samples (requests that ran beside the deciding one) change nothing.
    pub fn sample_keep_zero(
        &self,
        m: Method,
        bytes: u64,
        took: Duration,
    ) -> Option<(KeepZeroTrial, KeepZero)> {
        let mut t = self
            .keep_zero_trial
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if self.keep_zero() != KeepZero::Unknown {
            return None;
        }
        let slot = match m {
            Method::PunchAlloc => &mut t.punch_alloc,
            Method::WriteZeros => &mut t.write_zeros,
            _ => return None,
        };
        slot.0 += took;
        slot.1 += bytes;
        let v = t.verdict()?;
        self.keep_zero.store(v.to_u8(), Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
        Some((*t, v))
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn snapshot(&self) -> CapsSnapshot {
        CapsSnapshot {
            generation: self.generation(),
            keep_zero: self.keep_zero(),
            methods: Method::ALL
                .iter()
                .map(|m| (*m, self.get(*m), self.stats(*m)))
                .collect(),
        }
    }
}

/// A way to copy between two regular files that a pair of file systems may
/// or may not support. Learned per pair (source file system, destination
/// file system), not per target: see [`CopyCaps`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyMethod {
    /// ioctl(FICLONERANGE): the destination shares the source's blocks.
    Reflink,
    /// copy_file_range(2): the kernel copies (a reflink again on XFS and
    /// btrfs, a server-side copy on NFS 4.2, a page-cache copy elsewhere).
    CopyRange,
}

impl CopyMethod {
    pub const ALL: [CopyMethod; 2] = [CopyMethod::Reflink, CopyMethod::CopyRange];

    pub fn name(self) -> &'static str {
        match self {
            CopyMethod::Reflink => "reflink",
            CopyMethod::CopyRange => "copy_file_range",
        }
    }
}

impl std::fmt::Display for CopyMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What is known about the copy offloads between one pair of file systems,
/// shared process-wide like [`Capabilities`] (the registry keys it by the
/// two st_dev), so a refused call is paid for once per pair.
#[derive(Default)]
pub struct CopyCaps {
    slots: [Slot; CopyMethod::ALL.len()],
}

impl std::fmt::Debug for CopyCaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(
                CopyMethod::ALL
                    .iter()
                    .map(|m| (m.name(), self.get(*m).name())),
            )
            .finish()
    }
}

impl CopyCaps {
    pub fn get(&self, m: CopyMethod) -> Tri {
        Tri::from_u8(self.slots[m as usize].state.load(Ordering::Acquire))
    }

    /// Record what a call taught us. Returns true when the state changed.
    pub fn set(&self, m: CopyMethod, t: Tri) -> bool {
        let state = &self.slots[m as usize].state;
        state.load(Ordering::Acquire) != t.to_u8()
            && state.swap(t.to_u8(), Ordering::AcqRel) != t.to_u8()
    }

    /// Count one call of `m`; `ok_bytes` is Some(bytes) when it succeeded.
    pub fn count(&self, m: CopyMethod, ok_bytes: Option<u64>) {
        let s = &self.slots[m as usize];
        s.calls.fetch_add(1, Ordering::Relaxed);
        match ok_bytes {
            Some(b) => s.bytes.fetch_add(b, Ordering::Relaxed),
            None => s.failures.fetch_add(1, Ordering::Relaxed),
        };
    }

    pub fn stats(&self, m: CopyMethod) -> MethodStats {
        let s = &self.slots[m as usize];
        MethodStats {
            calls: s.calls.load(Ordering::Relaxed),
            failures: s.failures.load(Ordering::Relaxed),
            bytes: s.bytes.load(Ordering::Relaxed),
        }
    }
}

/// A point-in-time copy of [`Capabilities`], for printing and logging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapsSnapshot {
    pub generation: u64,
    /// Unknown unless the target times its ways to zero (tmpfs).
    pub keep_zero: KeepZero,
    pub methods: Vec<(Method, Tri, MethodStats)>,
}

impl CapsSnapshot {
    pub fn get(&self, m: Method) -> Tri {
        self.methods
            .iter()
            .find(|(mm, _, _)| *mm == m)
            .map(|(_, t, _)| *t)
            .unwrap_or(Tri::Unknown)
    }
}

impl std::fmt::Display for CapsSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut first = true;
        for (m, t, _) in &self.methods {
            if *m == Method::WriteZeros {
                continue;
            }
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            write!(f, "{}={}", m.name(), t.name())?;
        }
        if self.keep_zero != KeepZero::Unknown {
            write!(f, ", no-trim zero by {}", self.keep_zero.name())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn keep_zero_verdict_waits_for_both_samples_and_compares_per_byte() {
        let s = KEEP_ZERO_SAMPLE;
        let t = |p: (u32, u64), w: (u32, u64)| KeepZeroTrial {
            punch_alloc: (MS * p.0, p.1),
            write_zeros: (MS * w.0, w.1),
        };
        assert_eq!(t((1, s - 1), (100, s)).verdict(), None);
        assert_eq!(t((100, s), (1, s - 1)).verdict(), None);
        assert_eq!(t((5, s), (6, s)).verdict(), Some(KeepZero::PunchAlloc));
        assert_eq!(t((6, s), (5, s)).verdict(), Some(KeepZero::WriteZeros));
        // More time but for three times the bytes: punch-alloc is cheaper.
        assert_eq!(t((12, 3 * s), (5, s)).verdict(), Some(KeepZero::PunchAlloc));
        // A tie writes: the way that needs no fallocate support.
        assert_eq!(t((5, s), (5, s)).verdict(), Some(KeepZero::WriteZeros));
    }

    #[test]
    fn set_reports_and_counts_only_changes() {
        let c = Capabilities::new();
        assert!(c.set(Method::Splice, Tri::Works));
        let g = c.generation();
        assert!(
            !c.set(Method::Splice, Tri::Works),
            "same state reported as a change"
        );
        assert_eq!(c.generation(), g);
        assert!(c.set(Method::Splice, Tri::Fails));
        assert_eq!(c.get(Method::Splice), Tri::Fails);
        assert_eq!(c.generation(), g + 1);
    }

    #[test]
    fn keep_zero_is_decided_once_and_announced() {
        let c = Capabilities::new();
        let half = KEEP_ZERO_SAMPLE / 2;
        assert_eq!(c.sample_keep_zero(Method::PunchAlloc, half, 3 * MS), None);
        assert_eq!(
            c.sample_keep_zero(Method::WriteZeros, 2 * half, 4 * MS),
            None
        );
        // Other methods are not samples.
        assert_eq!(c.sample_keep_zero(Method::PunchHole, 1 << 40, MS), None);
        assert_eq!(c.keep_zero(), KeepZero::Unknown);
        let g = c.generation();
        let (trial, v) = c
            .sample_keep_zero(Method::PunchAlloc, half, 3 * MS)
            .expect("both sampled");
        assert_eq!(v, KeepZero::WriteZeros, "{trial:?}: 6 ms against 4 ms");
        assert_eq!(trial.punch_alloc, (6 * MS, KEEP_ZERO_SAMPLE));
        assert_eq!(c.keep_zero(), KeepZero::WriteZeros);
        assert_eq!(c.generation(), g + 1);
        assert_eq!(c.snapshot().keep_zero, KeepZero::WriteZeros);
        assert!(c
            .snapshot()
            .to_string()
            .ends_with("no-trim zero by write-zeros"));
        // A late sample from a request that ran beside the deciding one.
        assert_eq!(c.sample_keep_zero(Method::PunchAlloc, 1 << 30, MS), None);
        assert_eq!(c.keep_zero(), KeepZero::WriteZeros);
        assert_eq!(c.generation(), g + 1);
    }
}
