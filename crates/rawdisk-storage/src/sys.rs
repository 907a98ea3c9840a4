//! The one narrow layer every syscall of the storage engine goes through.
//!
//! [`RealSys`] calls the kernel; [`FaultSys`] wraps another `Sys` and injects a
//! chosen errno on the Nth call of a chosen kind, so tests can produce EIO,
//! ENOSPC or EOPNOTSUPP on exactly one call.
//!
//! STUB: the storage engine issue fills this in; the trait shape below is the
//! contract other crates and tests build against, extend it rather than rename.

use std::io;
use std::os::fd::BorrowedFd;

/// fallocate(2) modes the engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FallocMode {
    /// FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    PunchHole,
    /// FALLOC_FL_ZERO_RANGE (| KEEP_SIZE when asked)
    ZeroRange { keep_size: bool },
    /// mode 0: allocate, extending the size
    Allocate,
    /// FALLOC_FL_KEEP_SIZE: allocate without changing the size
    AllocateKeepSize,
}

/// The kinds of call a fault can be injected into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallKind {
    Pread,
    Pwrite,
    Fallocate(FallocMode),
    BlkZeroout,
    BlkDiscard,
    SeekData,
    SeekHole,
    Fsync,
    Fdatasync,
    Ftruncate,
    Fadvise,
}

/// Block device geometry read by ioctls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockGeometry {
    pub size: u64,
    /// BLKSSZGET; None when the ioctl failed.
    pub logical_sector: Option<u32>,
    pub physical_sector: Option<u32>,
    pub min_io: Option<u32>,
    pub opt_io: Option<u32>,
    pub read_only: bool,
}

pub trait Sys: Send + Sync + 'static {
    fn pread(&self, fd: BorrowedFd<'_>, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    fn pwrite(&self, fd: BorrowedFd<'_>, buf: &[u8], offset: u64) -> io::Result<usize>;
    fn fallocate(
        &self,
        fd: BorrowedFd<'_>,
        mode: FallocMode,
        offset: u64,
        len: u64,
    ) -> io::Result<()>;
    fn blkzeroout(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()>;
    fn blkdiscard(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()>;
    /// lseek(SEEK_DATA); Ok(None) for ENXIO (no data at or after offset).
    fn seek_data(&self, fd: BorrowedFd<'_>, offset: u64) -> io::Result<Option<u64>>;
    /// lseek(SEEK_HOLE); Ok(None) for ENXIO (offset at or past the end).
    fn seek_hole(&self, fd: BorrowedFd<'_>, offset: u64) -> io::Result<Option<u64>>;
    fn fsync(&self, fd: BorrowedFd<'_>) -> io::Result<()>;
    fn fdatasync(&self, fd: BorrowedFd<'_>) -> io::Result<()>;
    fn ftruncate(&self, fd: BorrowedFd<'_>, size: u64) -> io::Result<()>;
    fn fadvise_willneed(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()>;
    fn block_geometry(&self, fd: BorrowedFd<'_>) -> io::Result<BlockGeometry>;
}

/// The kernel.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealSys;
