//! Learned capabilities: for each storage method, whether it works on this
//! target, is known to fail, or has not been tried yet. One `Capabilities` is
//! shared by every handle opened on the same target in the process (keyed by
//! device and inode), so an unsupported call is paid for once per process.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// A way of zeroing, trimming, allocating or mapping that the storage may or
/// may not support.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Method {
    /// fallocate(PUNCH_HOLE | KEEP_SIZE)
    PunchHole,
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
}

impl Method {
    pub const ALL: [Method; 9] = [
        Method::PunchHole,
        Method::ZeroRange,
        Method::PunchAlloc,
        Method::Fallocate,
        Method::BlkZeroout,
        Method::BlkDiscard,
        Method::SeekHole,
        Method::WriteZeros,
        Method::Splice,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Method::PunchHole => "punch-hole",
            Method::ZeroRange => "zero-range",
            Method::PunchAlloc => "punch-alloc",
            Method::Fallocate => "fallocate",
            Method::BlkZeroout => "blkzeroout",
            Method::BlkDiscard => "blkdiscard",
            Method::SeekHole => "seek-hole",
            Method::WriteZeros => "write-zeros",
            Method::Splice => "splice",
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

/// The shared, lock-free record of what a target supports.
#[derive(Default)]
pub struct Capabilities {
    slots: [Slot; Method::ALL.len()],
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
        let old = self.slots[m.index()]
            .state
            .swap(t.to_u8(), Ordering::AcqRel);
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

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn snapshot(&self) -> CapsSnapshot {
        CapsSnapshot {
            generation: self.generation(),
            methods: Method::ALL
                .iter()
                .map(|m| (*m, self.get(*m), self.stats(*m)))
                .collect(),
        }
    }
}

/// A point-in-time copy of [`Capabilities`], for printing and logging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapsSnapshot {
    pub generation: u64,
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
        Ok(())
    }
}
