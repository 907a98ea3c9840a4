//! The one narrow layer every syscall of the storage engine goes through.
//! This file holds the table and the types it speaks; `sys/real.rs` the
//! real call behind each entry.
//!
//! `syscalls!` is the table of them; [`Sys`] is declared from it and
//! [`RealSys`] calls the kernel. The fault injector (`FaultSys` in fault.rs,
//! behind the `fault-injection` feature that only tests enable) is generated
//! from the same table, so it forwards, counts and can fail every call.
//!
//! Nothing here decides anything: no retries (not even EINTR), no fallbacks,
//! no learning. Each method is one syscall (or one ioctl group for
//! [`Sys::block_geometry`]), so the call counts a `FaultSys` records are the
//! syscalls the engine made. The one syscall outside the table is the
//! munmap of a dropped [`Mapping`]: the mapping is owned by a value, not
//! named by an address, so no caller can unmap memory it does not own.
//! Linux AIO ([`Aio`], `sys/aio.rs`) is outside it for the same reason:
//! the context owns each request's buffer and file until it completes;
//! so is io_uring ([`Uring`], `sys/uring.rs`), its alternative.
//! `unsafe` lives only here and in `sys/`, for what rustix does not wrap.

use std::io;
use std::marker::PhantomData;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;

mod aio;
mod real;
mod uring;
pub use aio::{Aio, AioDone, AioOp};
pub use real::{limit_malloc_arenas, page_size, RealSys};
#[cfg(any(test, feature = "fault-injection"))]
pub use uring::refuse_next_uring;
pub use uring::Uring;

/// fallocate(2) modes the engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FallocMode {
    /// FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    PunchHole,
    /// FALLOC_FL_ZERO_RANGE (| KEEP_SIZE when asked)
    ZeroRange { keep_size: bool },
    /// FALLOC_FL_WRITE_ZEROES, alone: the kernel refuses it with KEEP_SIZE.
    WriteZeroes,
    /// mode 0: allocate, extending the size
    Allocate,
    /// FALLOC_FL_KEEP_SIZE: allocate without changing the size
    AllocateKeepSize,
}

/// What a call of [`Sys`] is counted as: one kind per method (fallocate
/// one per mode), so a test can fail or count exactly the call it means.
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
    /// open(2) of the target.
    Open,
    /// openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS) of a target inside
    /// a directory.
    OpenBeneath,
    /// openat(2) of a target relative to a directory, resolved freely.
    OpenAt,
    Fstat,
    /// fstatfs(2) for the file system's magic number.
    FsMagic,
    /// statx(STATX_DIOALIGN)
    Statx,
    /// The BLKGETSIZE64/BLKSSZGET/... ioctl group of [`Sys::block_geometry`].
    BlockGeometry,
    /// pwritev2(RWF_DSYNC), used for FUA writes.
    PwriteDsync,
    /// preadv2(RWF_NOWAIT): a read served from the page cache or not at all.
    PreadNowait,
    /// A read of a small sysfs attribute file.
    ReadSysfs,
    /// sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)
    SyncRange,
    /// sync_file_range(WRITE): write-back started, not waited for.
    StartWriteback,
    /// splice(file -> pipe) of a page-cache read.
    Splice,
    /// mmap(MAP_SHARED) of the whole target, once per handle.
    Mmap,
    /// mincore(2) of the pages a write would land in.
    Resident,
    /// madvise(MADV_POPULATE_WRITE) of the pages a write will land in.
    PopulateWrite,
    /// madvise(MADV_DONTNEED) of the pages a mapped write used.
    Unpopulate,
    /// recv(2) from a socket into mapped pages.
    RecvToMap,
    /// ioctl(FICLONERANGE): blocks shared between two files.
    CloneRange,
    /// copy_file_range(2): the kernel copies between two files.
    CopyFileRange,
    /// fcntl(F_OFD_SETLK / F_OFD_SETLKW / F_OFD_GETLK)
    OfdLock(LockCmd),
}

/// Which fcntl command an open-file-description lock call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockCmd {
    /// F_OFD_SETLK: take or release without waiting (EAGAIN on conflict).
    Set,
    /// F_OFD_SETLKW: wait until it can be taken.
    SetWait,
    /// F_OFD_GETLK: only test whether another description holds a
    /// conflicting lock.
    Get,
}

/// What an open-file-description lock call asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockKind {
    /// F_RDLCK: shared.
    Read,
    /// F_WRLCK: exclusive.
    Write,
    /// F_UNLCK: release.
    Unlock,
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

/// How to open a target (the subset of open(2) flags the engine uses).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenHow {
    pub read_only: bool,
    /// O_DIRECT
    pub direct: bool,
    /// O_CREAT
    pub create: bool,
    /// O_CREAT | O_EXCL
    pub create_new: bool,
    /// O_TRUNC
    pub truncate: bool,
    /// O_EXCL without O_CREAT: on a block device, refused (EBUSY) while it
    /// is mounted or held by another exclusive user.
    pub exclusive: bool,
    /// O_NOFOLLOW: a symlink as the last component fails with ELOOP.
    pub no_follow: bool,
    /// O_DIRECTORY (with `read_only`): only a directory opens.
    pub directory: bool,
}

/// The fields of fstat(2) the engine uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileStat {
    /// What the file is, as an error names it ("FIFO", "socket", ...).
    pub type_name: &'static str,
    pub is_block: bool,
    pub is_regular: bool,
    pub dev: u64,
    pub ino: u64,
    pub rdev: u64,
    pub size: u64,
    /// st_blocks: 512-byte units allocated.
    pub blocks: u64,
    pub blksize: u64,
    /// st_mtime and st_ctime as (seconds, nanoseconds).
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
}

impl FileStat {
    pub fn rdev_major(&self) -> u32 {
        rustix::fs::major(self.rdev)
    }
    pub fn rdev_minor(&self) -> u32 {
        rustix::fs::minor(self.rdev)
    }
}

/// statx(STATX_DIOALIGN) result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DioAlign {
    /// stx_dio_mem_align: buffer address alignment.
    pub mem: u32,
    /// stx_dio_offset_align: file offset and length alignment.
    pub offset: u32,
}

/// The one table of syscalls. `syscalls!(m)` calls the macro `m` with every
/// method of [`Sys`]: its doc, signature, and in brackets the [`CallKind`] it
/// is counted as, the (offset, length) it touches, `cap ARG` for the calls
/// whose transfer a test may shorten, `then F` for a result a test may edit,
/// `swap ARG by F` for an argument a test may replace before the call.
/// [`Sys`] itself and every wrapping layer (the fault injector) are generated
/// from it, so a syscall added here is added to all of them or fails to
/// compile.
macro_rules! syscalls {
    ($m:ident) => {
        $m! {
            /// pread(2).
            fn pread(fd: BorrowedFd<'_>, buf: &mut [u8], offset: u64) -> usize
                [Pread, offset, buf.len(), cap buf];
            /// pwrite(2).
            fn pwrite(fd: BorrowedFd<'_>, buf: &[u8], offset: u64) -> usize
                [Pwrite, offset, buf.len(), cap buf];
            /// fallocate(2) in one of the modes the engine uses.
            fn fallocate(fd: BorrowedFd<'_>, mode: FallocMode, offset: u64, len: u64) -> ()
                [Fallocate(mode), offset, len, swap mode by stand_in_for];
            /// ioctl(BLKZEROOUT).
            fn blkzeroout(fd: BorrowedFd<'_>, offset: u64, len: u64) -> ()
                [BlkZeroout, offset, len];
            /// ioctl(BLKDISCARD).
            fn blkdiscard(fd: BorrowedFd<'_>, offset: u64, len: u64) -> ()
                [BlkDiscard, offset, len];
            /// lseek(SEEK_DATA); Ok(None) for ENXIO (no data at or after offset).
            fn seek_data(fd: BorrowedFd<'_>, offset: u64) -> Option<u64>
                [SeekData, offset, 0];
            /// lseek(SEEK_HOLE); Ok(None) for ENXIO (offset at or past the end).
            fn seek_hole(fd: BorrowedFd<'_>, offset: u64) -> Option<u64>
                [SeekHole, offset, 0];
            /// fsync(2).
            fn fsync(fd: BorrowedFd<'_>) -> () [Fsync, 0, 0];
            /// fdatasync(2).
            fn fdatasync(fd: BorrowedFd<'_>) -> () [Fdatasync, 0, 0];
            /// ftruncate(2).
            fn ftruncate(fd: BorrowedFd<'_>, size: u64) -> () [Ftruncate, size, 0];
            /// fcntl(F_OFD_SETLK / SETLKW / GETLK) of `kind` on [start, start+len)
            /// (open-file-description locks: two descriptions exclude each
            /// other even in one process). Set/SetWait return false; Get
            /// returns whether another description holds a conflicting lock.
            fn ofd_lock(fd: BorrowedFd<'_>, cmd: LockCmd, kind: LockKind, start: u64, len: u64) -> bool
                [OfdLock(cmd), start, len];
            /// posix_fadvise(WILLNEED).
            fn fadvise_willneed(fd: BorrowedFd<'_>, offset: u64, len: u64) -> ()
                [Fadvise, offset, len];
            /// The BLKGETSIZE64/BLKSSZGET/BLKPBSZGET/BLKIOMIN/BLKIOOPT/BLKROGET
            /// ioctls of a block device; only BLKGETSIZE64 failing fails it.
            fn block_geometry(fd: BorrowedFd<'_>) -> BlockGeometry
                [BlockGeometry, 0, 0, then edit_geometry];
            /// open(2) of the target, O_CLOEXEC.
            fn open(path: &Path, how: OpenHow) -> OwnedFd [Open, 0, 0];
            /// openat2(2) of `name` relative to the directory `dir` with
            /// RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS: every step of the
            /// lookup, symlinks included, stays inside `dir` (EXDEV
            /// otherwise); O_CLOEXEC. ENOSYS before Linux 5.6.
            fn open_beneath(dir: BorrowedFd<'_>, name: &Path, how: OpenHow) -> OwnedFd
                [OpenBeneath, 0, 0];
            /// openat(2) of `name` relative to the directory `dir`, O_CLOEXEC,
            /// resolved without restriction.
            fn open_at(dir: BorrowedFd<'_>, name: &Path, how: OpenHow) -> OwnedFd [OpenAt, 0, 0];
            /// fstat(2).
            fn fstat(fd: BorrowedFd<'_>) -> FileStat [Fstat, 0, 0];
            /// The file system's magic number (fstatfs f_type).
            fn fs_magic(fd: BorrowedFd<'_>) -> u64 [FsMagic, 0, 0];
            /// statx(STATX_DIOALIGN); Ok(None) when the kernel or file system
            /// does not fill it in (before Linux 6.1, or file systems that do
            /// not report it).
            fn dio_align(fd: BorrowedFd<'_>) -> Option<DioAlign> [Statx, 0, 0];
            /// pwritev2(RWF_DSYNC): the data is durable when it returns.
            fn pwrite_dsync(fd: BorrowedFd<'_>, buf: &[u8], offset: u64) -> usize
                [PwriteDsync, offset, buf.len(), cap buf];
            /// preadv2(RWF_NOWAIT): reads what the page cache holds; EAGAIN
            /// (or a short count) where the rest would wait for the device.
            fn pread_nowait(fd: BorrowedFd<'_>, buf: &mut [u8], offset: u64) -> usize
                [PreadNowait, offset, buf.len(), cap buf];
            /// Read a small text file (sysfs attributes).
            fn read_sysfs(path: &Path) -> String [ReadSysfs, 0, 0];
            /// Write back the dirty page cache of [offset, offset+len) and wait
            /// for it (sync_file_range; no device cache flush, no metadata).
            fn sync_range(fd: BorrowedFd<'_>, offset: u64, len: u64) -> ()
                [SyncRange, offset, len];
            /// Start writing back the dirty page cache of [offset, offset+len)
            /// without waiting for it (sync_file_range WRITE only).
            fn start_writeback(fd: BorrowedFd<'_>, offset: u64, len: u64) -> ()
                [StartWriteback, offset, len];
            /// splice(2) up to `len` bytes at `offset` into the pipe `pipe`
            /// without blocking on the pipe (EAGAIN when it is full); returns
            /// the bytes moved, 0 at end of file.
            fn splice_to_pipe(fd: BorrowedFd<'_>, offset: u64, pipe: BorrowedFd<'_>, len: usize) -> usize
                [Splice, offset, len, cap len];
            /// mmap(PROT_READ | PROT_WRITE, MAP_SHARED) of `len` bytes of `fd`
            /// from offset 0; unmapped when the [`Mapping`] is dropped.
            fn map_shared(fd: BorrowedFd<'_>, len: usize) -> Mapping [Mmap, 0, len];
            /// mincore(2): whether every page of the span is in the page cache.
            fn resident(span: &MapSpan<'_>) -> bool [Resident, span.offset(), span.len()];
            /// madvise(MADV_POPULATE_WRITE, Linux 5.14): fault the span in
            /// writable now, so that a failure (no space, an I/O error reading
            /// a partly written page) is this errno instead of a fault later.
            /// EINVAL on older kernels.
            fn populate_write(span: &MapSpan<'_>) -> ()
                [PopulateWrite, span.offset(), span.len()];
            /// madvise(MADV_DONTNEED): drop the span's page-table entries (the
            /// data stays in the page cache, dirty bits moved to it), so mapped
            /// pages do not pile up in the process's RSS.
            fn unpopulate(span: &MapSpan<'_>) -> () [Unpopulate, span.offset(), span.len()];
            /// recv(2) on the socket `sock` into the first `len` bytes of `span`
            /// from byte `at`, without waiting (MSG_DONTWAIT): EAGAIN when
            /// nothing is queued, EINVAL when the range leaves the span. A page
            /// the kernel cannot fault in makes it EFAULT (never a signal: the
            /// copy is the kernel's), with the bytes before it received.
            fn recv_to_map(sock: BorrowedFd<'_>, span: &MapSpan<'_>, at: usize, len: usize) -> usize
                [RecvToMap, span.offset() + at, len, cap len];
            /// ioctl(FICLONERANGE) on `dst`: [dst_offset, dst_offset+len) of
            /// `dst` shares the blocks of [src_offset, src_offset+len) of
            /// `src`. Offsets and length block-aligned, both files on one
            /// file system that can share extents (XFS reflink, btrfs).
            fn clone_range(src: BorrowedFd<'_>, src_offset: u64, dst: BorrowedFd<'_>, dst_offset: u64, len: u64) -> ()
                [CloneRange, dst_offset, len];
            /// copy_file_range(2) of up to `len` bytes at `src_offset` of `src`
            /// to `dst_offset` of `dst`; returns the bytes copied, 0 at the
            /// end of `src`.
            fn copy_file_range(src: BorrowedFd<'_>, src_offset: u64, dst: BorrowedFd<'_>, dst_offset: u64, len: usize) -> usize
                [CopyFileRange, dst_offset, len, cap len];
        }
    };
}
#[cfg(any(test, feature = "fault-injection"))]
pub(crate) use syscalls;

/// Declares [`Sys`] from the table.
macro_rules! declare_sys {
    ($( $(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty [$($how:tt)*]; )*) => {
        /// The syscalls of the storage engine, one method per syscall (or
        /// ioctl group). No method has a default: a layer over another `Sys`
        /// forwards each one explicitly (generated from `syscalls!`), so it
        /// can never reach the kernel behind the layer's back.
        pub trait Sys: Send + Sync + 'static {
            $( $(#[$doc])* fn $name(&self, $($arg: $ty),*) -> io::Result<$ret>; )*
        }
    };
}
syscalls!(declare_sys);

/// A shared mapping of a target, as [`Sys::map_shared`] made it; unmapped
/// when dropped. Only [`RealSys`] makes one, from the address mmap returned,
/// and a [`MapSpan`] borrows it: a span always lies inside a live mapping,
/// which is what makes the span calls of [`Sys`] safe.
#[derive(Debug)]
pub struct Mapping {
    addr: usize,
    len: usize,
}

impl Mapping {
    /// Bytes mapped (whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole pages covering [offset, offset+len) of the mapping, or
    /// None when that leaves it.
    pub fn span(&self, offset: usize, len: usize) -> Option<MapSpan<'_>> {
        let page = page_size() as usize;
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        let start = offset / page * page;
        let stop = end.div_ceil(page) * page;
        if stop > self.len {
            return None;
        }
        Some(MapSpan {
            addr: self.addr + start,
            offset: start,
            len: stop - start,
            _map: PhantomData,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: this value owns the mapping mmap made at `addr` with `len`
        // and is dropped once; every span of it borrows it, so none is left,
        // and nothing in the program holds a reference into mapped memory.
        let r = unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
        if r < 0 {
            tracing::warn!("munmap of a target mapping: {}", io::Error::last_os_error());
        }
    }
}

/// Whole pages of a [`Mapping`], borrowed from it.
#[derive(Debug)]
pub struct MapSpan<'a> {
    addr: usize,
    /// Offset of the first byte in the mapping (= in the target).
    offset: usize,
    len: usize,
    _map: PhantomData<&'a Mapping>,
}

impl MapSpan<'_> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Offset of the span's first byte in the target.
    pub fn offset(&self) -> usize {
        self.offset
    }
}
