//! STUB: public shape of the open target. The storage engine issue fills in
//! the bodies; signatures may be extended, not renamed.

use std::path::Path;
use std::sync::Arc;

use crate::caps::{Capabilities, Method};
use crate::error::Result;
use crate::sys::Sys;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Block,
}

/// Page cache (default) or O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    #[default]
    Writeback,
    None,
}

#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    pub read_only: bool,
    pub cache: CacheMode,
}

/// Sizes and hints of the open target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub size: u64,
    /// 1 for a regular file through the page cache.
    pub logical_sector: u32,
    pub physical_sector: u32,
    pub min_io: u32,
    pub opt_io: u32,
    pub rotational: bool,
    pub read_only: bool,
    /// Required alignment of offsets, lengths and buffers under O_DIRECT.
    pub dio_align: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ZeroFlags {
    /// The client allows the range to become a hole.
    pub may_trim: bool,
    /// Fail with ENOTSUP, changing nothing, unless a method that cannot fall
    /// back to writing is available.
    pub fast_only: bool,
}

/// Which method(s) a zero call ended up using.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ZeroOutcome {
    pub methods: Vec<Method>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentKind {
    Data,
    /// A hole: reads as zeros.
    Hole,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
    pub kind: ExtentKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prealloc {
    Off,
    Falloc,
    Full,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreallocReport {
    /// What actually allocated the space (e.g. Fallocate, or WriteZeros when
    /// falloc fell back to full).
    pub method: Option<Method>,
}

/// One open file or block device. Cheap to share (`Arc`), every method takes
/// `&self` and is safe from many threads.
pub struct Target {
    _sys: Arc<dyn Sys>,
}

impl Target {
    pub fn open(_path: &Path, _opts: &OpenOptions) -> Result<Target> {
        todo!("storage engine: Self::open_with_sys(path, opts, Arc::new(RealSys))")
    }

    pub fn open_with_sys(_path: &Path, _opts: &OpenOptions, _sys: Arc<dyn Sys>) -> Result<Target> {
        todo!("storage engine")
    }

    pub fn kind(&self) -> Kind {
        todo!()
    }
    pub fn size(&self) -> u64 {
        todo!()
    }
    pub fn geometry(&self) -> Geometry {
        todo!()
    }
    pub fn caps(&self) -> &Arc<Capabilities> {
        todo!()
    }
    pub fn read_at(&self, _buf: &mut [u8], _offset: u64) -> Result<()> {
        todo!()
    }
    /// `fua`: the data is durable when this returns.
    pub fn write_at(&self, _buf: &[u8], _offset: u64, _fua: bool) -> Result<()> {
        todo!()
    }
    pub fn flush(&self) -> Result<()> {
        todo!()
    }
    pub fn zero(&self, _offset: u64, _len: u64, _flags: ZeroFlags) -> Result<ZeroOutcome> {
        todo!()
    }
    pub fn trim(&self, _offset: u64, _len: u64) -> Result<()> {
        todo!()
    }
    /// At most `max_runs` extents covering a prefix of [offset, offset+len).
    pub fn extents(&self, _offset: u64, _len: u64, _max_runs: usize) -> Result<Vec<Extent>> {
        todo!()
    }
    pub fn preallocate(&self, _size: u64, _mode: Prealloc) -> Result<PreallocReport> {
        todo!()
    }
    pub fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        todo!()
    }
    /// Whether trim may do something (advertise SEND_TRIM).
    pub fn can_trim(&self) -> bool {
        todo!()
    }
    /// Whether a fast (no-write-fallback) zero may succeed (advertise SEND_FAST_ZERO).
    pub fn can_fast_zero(&self) -> bool {
        todo!()
    }
}
