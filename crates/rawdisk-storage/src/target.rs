//! An open regular file or block device.
//!
//! Every syscall goes through `self.sys` (see [`crate::sys`]); nothing here
//! touches the kernel directly, so tests can inject any errno on any call.
//!
//! Zeroing lives in `zero.rs` (the fallback chain and why each step exists),
//! O_DIRECT alignment handling in `direct.rs`, the process-wide capability
//! registry in `registry.rs`.
//!
//! Range rules: `read_at` must stay inside the target (a short read past the
//! end is an error naming the range); `write_at` on a regular file may extend
//! it (as pwrite does), on a block device it may not; `zero` and `trim` must
//! stay inside the target (they never change its size); `extents` clips to
//! the end.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use crate::caps::{Capabilities, Method, Tri};
use crate::direct::{AlignedBuf, Direct};
use crate::error::{Error, Result};
use crate::registry::{self, Key};
use crate::sys::{CallKind, FallocMode, OpenHow, RealSys, Sys};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Block,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::File => "file",
            Kind::Block => "block device",
        }
    }
}

/// Page cache (default) or O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    #[default]
    Writeback,
    None,
}

/// How to open a target. Build it with `OpenOptions { read_only: true,
/// ..Default::default() }`: fields may be added.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    pub read_only: bool,
    pub cache: CacheMode,
    /// Create the file if it does not exist (O_CREAT).
    pub create: bool,
    /// Create the file, failing if it exists (O_CREAT | O_EXCL).
    pub create_new: bool,
    /// Truncate an existing file to 0 (O_TRUNC).
    pub truncate: bool,
    /// Bytes per pwrite when zeroing by writing (default [`WRITE_ZEROS_CHUNK`]),
    /// capped at that default (the size of the shared zero buffer). Small
    /// values let tests drive the multi-chunk fallback path.
    pub write_zeros_chunk: Option<usize>,
    /// Bytes per zeroing/discarding syscall (default [`MAX_ZERO_CALL`]).
    pub max_zero_call: Option<u64>,
}

/// Default and maximum bytes per pwrite of the shared zero buffer.
pub const WRITE_ZEROS_CHUNK: usize = 4 << 20;
/// At most this many bytes per fallocate/BLKZEROOUT/BLKDISCARD call, so one
/// huge request cannot hold the device (or the inode lock) for seconds.
pub const MAX_ZERO_CALL: u64 = 1 << 30;

/// Sizes and hints of the open target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub size: u64,
    /// 1 for a regular file through the page cache; the O_DIRECT alignment
    /// for a regular file opened with cache=none; BLKSSZGET for block devices.
    pub logical_sector: u32,
    pub physical_sector: u32,
    pub min_io: u32,
    pub opt_io: u32,
    pub rotational: bool,
    pub read_only: bool,
    /// Required alignment of offsets, lengths and buffers under O_DIRECT:
    /// STATX_DIOALIGN where the kernel reports it (6.1+), else the logical
    /// sector size for block devices or 4096 for files. Reported in both
    /// cache modes; only cache=none needs it (the engine then hides it).
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

/// /sys/dev/block/MAJ:MIN/queue limits; None for an attribute that could not
/// be read (old kernels lack some, partitions read their disk's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueLimits {
    pub major: u32,
    pub minor: u32,
    pub logical_block_size: Option<u64>,
    pub physical_block_size: Option<u64>,
    pub write_zeroes_max_bytes: Option<u64>,
    pub discard_max_bytes: Option<u64>,
    pub discard_granularity: Option<u64>,
    pub rotational: Option<bool>,
    pub optimal_io_size: Option<u64>,
}

/// statfs f_type of tmpfs and ramfs (<linux/magic.h>).
const TMPFS_MAGIC: u64 = 0x0102_1994;
const RAMFS_MAGIC: u64 = 0x8584_58f6;

/// One open file or block device. Cheap to share (`Arc`), every method takes
/// `&self` and is safe from many threads.
pub struct Target {
    pub(crate) sys: Arc<dyn Sys>,
    pub(crate) fd: OwnedFd,
    pub(crate) path: PathBuf,
    pub(crate) kind: Kind,
    pub(crate) geom: Geometry,
    pub(crate) caps: Arc<Capabilities>,
    pub(crate) cache: CacheMode,
    pub(crate) read_only: bool,
    /// Alignment of fallocate/BLKZEROOUT/BLKDISCARD ranges: the logical
    /// sector or the page, whichever is larger, on block devices; 1 on files.
    pub(crate) offload_align: u64,
    /// Some under cache=none.
    pub(crate) direct: Option<Direct>,
    pub(crate) zero_chunk: usize,
    pub(crate) max_call: u64,
    /// PUNCH_HOLE + fallocate(0) and writing zeros cost about the same here
    /// and which is cheaper differs from machine to machine (tmpfs), so a
    /// no-trim zero times both before it settles on one (`Capabilities::
    /// keep_zero`); until then punch-alloc does not count as fast.
    pub(crate) punch_alloc_timed: bool,
    /// The data lives only in the page cache (tmpfs, ramfs): nothing to
    /// write back, so [`Target::start_writeback`] makes no call.
    memory_only: bool,
    /// pwritev2(RWF_DSYNC) for FUA: Tri as u8 (not a shared [`Method`]: it
    /// depends on the kernel, not the storage).
    dsync: AtomicU8,
    /// Key of the block device under a file (its st_dev), or the device itself.
    sysfs_dev: Option<(u32, u32)>,
    /// The file size last seen, for O_DIRECT writes near the end.
    pub(crate) known_size: AtomicU64,
    /// Made on the first [`Target::map_write`]; None if mapping failed.
    pub(crate) write_map: OnceLock<Option<crate::map::WriteMap>>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("path", &self.path)
            .field("kind", &self.kind)
            .field("cache", &self.cache)
            .field("geometry", &self.geom)
            .field("caps", &self.caps)
            .finish()
    }
}

/// "Not supported" errnos: the only ones that teach us a method is missing.
///
/// EINVAL is ambiguous (bad alignment, bad range, or "no such operation");
/// it counts only where a kernel documents it as lack of support:
/// - lseek(SEEK_DATA/SEEK_HOLE) on block devices (fixed_size_llseek accepts
///   only SET/CUR/END) and on kernels before 3.1 (whence > SEEK_END).
/// - splice(2) from a file whose file system has no splice_read.
///
/// ENODEV: fallocate on a block device before Linux 4.9 (vfs_fallocate only
/// allowed regular files and directories). ENOTTY: an ioctl the kernel or
/// driver does not know (BLKZEROOUT before 3.7, BLKDISCARD on some drivers).
/// ENOSYS: syscall missing (pwritev2 before 4.6, old seccomp filters).
pub(crate) fn is_unsupported(e: &io::Error, m: Method) -> bool {
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::ENOTTY) | Some(libc::ENODEV) => {
            true
        }
        // splice(2) on a file system without splice_read.
        Some(libc::EINVAL) => m == Method::SeekHole || m == Method::Splice,
        _ => false,
    }
}

/// The error of a read of `[offset, offset + len)` that met the end of the
/// target at byte `end` (the file shrank under us, or a device went away).
pub(crate) fn short_read(offset: u64, len: u64, end: u64) -> Error {
    Error::new(
        "read",
        offset,
        len,
        io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "short read: end of target at byte {end} (range ends at {})",
                offset + len
            ),
        ),
    )
}

/// Retry a syscall interrupted by a signal before it did anything. Every call
/// retried here is idempotent on its range (fallocate, ioctls, fsync).
pub(crate) fn retry<T>(mut f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match f() {
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            r => return r,
        }
    }
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

impl Target {
    pub fn open(path: &Path, opts: &OpenOptions) -> Result<Target> {
        Self::open_with_sys(path, opts, Arc::new(RealSys))
    }

    pub fn open_with_sys(path: &Path, opts: &OpenOptions, sys: Arc<dyn Sys>) -> Result<Target> {
        let direct = opts.cache == CacheMode::None;
        let how = OpenHow {
            read_only: opts.read_only,
            direct,
            create: opts.create,
            create_new: opts.create_new,
            truncate: opts.truncate,
        };
        let fd = match sys.open(path, how) {
            Ok(fd) => fd,
            // ramfs (no direct_IO address-space op) and tmpfs before 6.6
            // refuse O_DIRECT at open with EINVAL. Say so instead of failing
            // obscurely, and never fall back silently (issue #3).
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                return Err(no_direct(path, &format!("the kernel refused it: {e}")));
            }
            Err(e) => return Err(open_err(path, "open", e)),
        };
        let st = sys
            .fstat(fd.as_fd())
            .map_err(|e| open_err(path, "fstat", e))?;
        let kind = if st.is_block {
            Kind::Block
        } else if st.is_regular {
            Kind::File
        } else {
            return Err(open_err(
                path,
                "open",
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "not a regular file or block device",
                ),
            ));
        };

        let mut geom = Geometry {
            size: st.size,
            logical_sector: 1,
            physical_sector: st.blksize.clamp(512, u32::MAX as u64) as u32,
            min_io: 1,
            opt_io: st.blksize.clamp(512, u32::MAX as u64) as u32,
            rotational: false,
            read_only: opts.read_only,
            dio_align: 4096,
        };
        let sysfs_dev;
        let key;
        if kind == Kind::Block {
            let bg = sys
                .block_geometry(fd.as_fd())
                .map_err(|e| open_err(path, "block device ioctls", e))?;
            let lss = match bg.logical_sector {
                Some(l) => l,
                None => {
                    tracing::warn!(
                        path = %path.display(),
                        "BLKSSZGET failed; assuming 4096-byte logical sectors"
                    );
                    4096
                }
            };
            geom.size = bg.size;
            geom.logical_sector = lss;
            geom.physical_sector = bg.physical_sector.unwrap_or(lss).max(lss);
            geom.min_io = bg.min_io.unwrap_or(lss);
            geom.opt_io = bg.opt_io.unwrap_or(0);
            geom.read_only = opts.read_only || bg.read_only;
            geom.dio_align = lss;
            sysfs_dev = Some((st.rdev_major(), st.rdev_minor()));
            key = Key::Block { rdev: st.rdev };
        } else {
            sysfs_dev = Some((rustix::fs::major(st.dev), rustix::fs::minor(st.dev)));
            key = Key::File {
                dev: st.dev,
                ino: st.ino,
            };
        }
        if let Some((maj, min)) = sysfs_dev {
            if let Some(r) = read_queue_attr(&*sys, maj, min, "rotational") {
                geom.rotational = r == 1;
            }
        }
        let dio = sys.dio_align(fd.as_fd());
        let mut mem_align = 0;
        match dio {
            Ok(Some(a)) if a.offset > 0 => {
                geom.dio_align = a.offset;
                mem_align = a.mem;
            }
            // The kernel says this file cannot do direct I/O at all.
            Ok(Some(_)) if direct => {
                return Err(no_direct(path, "statx reports no direct I/O alignment"));
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(path = %path.display(), "statx(STATX_DIOALIGN) failed: {e}")
            }
        }
        // Bounce buffers also meet the offset alignment: simpler, and some
        // drivers want it even when STATX reports a smaller memory alignment.
        let mem_align = mem_align.max(geom.dio_align);
        let direct_state = if direct {
            if kind == Kind::File {
                geom.logical_sector = geom.dio_align;
            }
            Some(Direct::new(geom.dio_align as u64, mem_align as usize))
        } else {
            None
        };
        // Block devices: the kernel wants sector-aligned ranges (EINVAL
        // otherwise), but we also keep to whole pages. blkdev_fallocate
        // truncates the device's page cache over the range before it tries
        // the zero-out, zeroing the cached part of a partially covered page;
        // when the zero-out then fails (a loop device that lost its
        // write-zeroes offload: EOPNOTSUPP) that page keeps reading zeros the
        // device never got. Whole pages are only dropped, and re-read intact.
        let offload_align = if kind == Kind::Block {
            (geom.logical_sector as u64).max(crate::sys::page_size())
        } else {
            1
        };
        let caps = registry::capabilities_for(key);
        if kind == Kind::Block {
            // Block devices have neither fallocate(0) nor SEEK_HOLE (see the
            // capability matrix in RESULTS-baseline.md); record it without a
            // wasted call per handle.
            caps.set(Method::Fallocate, Tri::Fails);
            caps.set(Method::PunchAlloc, Tri::Fails);
            caps.set(Method::SeekHole, Tri::Fails);
        }
        // tmpfs: punching frees the pages and fallocate(0) allocates and
        // clears them again, against one copy into resident pages when
        // writing zeros. Which costs less depends on the machine, not the
        // kernel: 4 GiB of dirty data, kernel 6.18, both quiet 2-core VMs
        // (bench/zero-methods.sh --kinds tmpfs), one machine: punch+fallocate
        // 1.38 s, writing zeros 0.735 s; another: punch 0.24-0.28 s plus
        // fallocate 0.39-0.45 s (util-linux fallocate, one call each),
        // writing zeros 0.75-0.97 s. So the engine times both on the first
        // big no-trim zeros (zero.rs) instead of trusting a constant.
        let magic = match kind {
            Kind::File => sys.fs_magic(fd.as_fd()).ok(),
            Kind::Block => None,
        };
        let punch_alloc_timed = magic == Some(TMPFS_MAGIC);
        let memory_only = matches!(magic, Some(TMPFS_MAGIC | RAMFS_MAGIC));
        tracing::debug!(
            path = %path.display(),
            kind = kind.name(),
            ?geom,
            cache = ?opts.cache,
            punch_alloc_timed,
            memory_only,
            "opened target"
        );
        Ok(Target {
            sys,
            fd,
            path: path.to_path_buf(),
            kind,
            known_size: AtomicU64::new(geom.size),
            geom,
            caps,
            cache: opts.cache,
            read_only: geom.read_only,
            offload_align,
            direct: direct_state,
            zero_chunk: opts
                .write_zeros_chunk
                .unwrap_or(WRITE_ZEROS_CHUNK)
                .clamp(1, WRITE_ZEROS_CHUNK),
            max_call: opts.max_zero_call.unwrap_or(MAX_ZERO_CALL).max(1),
            punch_alloc_timed,
            memory_only,
            dsync: AtomicU8::new(0),
            sysfs_dev,
            write_map: OnceLock::new(),
        })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn cache_mode(&self) -> CacheMode {
        self.cache
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Current size: BLKGETSIZE64 at open for block devices, fstat for files
    /// (so it follows preallocate and writes past the end). 0 if fstat fails.
    pub fn size(&self) -> u64 {
        match self.kind {
            Kind::Block => self.geom.size,
            Kind::File => self.file_size().unwrap_or(0),
        }
    }

    pub(crate) fn file_size(&self) -> io::Result<u64> {
        let s = self.sys.fstat(self.fd())?.size;
        self.known_size.store(s, Ordering::Relaxed);
        Ok(s)
    }

    pub fn geometry(&self) -> Geometry {
        Geometry {
            size: self.size(),
            ..self.geom
        }
    }

    pub fn caps(&self) -> &Arc<Capabilities> {
        &self.caps
    }

    /// Bytes allocated to the file (st_blocks * 512). For a block device this
    /// is the device node's, i.e. 0: use [`Target::block_queue_limits`].
    pub fn allocated_bytes(&self) -> Result<u64> {
        self.sys
            .fstat(self.fd())
            .map(|s| s.blocks * 512)
            .map_err(|e| Error::new("fstat", 0, 0, e))
    }

    /// The request queue limits of the block device, or of the device under
    /// a regular file's file system; None when sysfs has no queue for it
    /// (tmpfs, ramfs, overlay...). Read fresh on every call: a loop device's
    /// write_zeroes_max_bytes drops to 0 at run time (RESULTS-baseline.md).
    pub fn block_queue_limits(&self) -> Option<QueueLimits> {
        let (maj, min) = self.sysfs_dev?;
        let a = |n: &str| read_queue_attr(&*self.sys, maj, min, n);
        let q = QueueLimits {
            major: maj,
            minor: min,
            logical_block_size: a("logical_block_size"),
            physical_block_size: a("physical_block_size"),
            write_zeroes_max_bytes: a("write_zeroes_max_bytes"),
            discard_max_bytes: a("discard_max_bytes"),
            discard_granularity: a("discard_granularity"),
            rotational: a("rotational").map(|v| v == 1),
            optimal_io_size: a("optimal_io_size"),
        };
        if q.logical_block_size.is_none() && q.rotational.is_none() {
            return None;
        }
        Some(q)
    }

    pub(crate) fn check_writable(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        if self.read_only {
            return Err(Error::new(op, offset, len, errno(libc::EROFS)));
        }
        Ok(())
    }

    /// Zero and trim must stay within the target.
    pub(crate) fn check_range(&self, op: &'static str, offset: u64, len: u64) -> Result<u64> {
        let size = match self.kind {
            Kind::Block => self.geom.size,
            Kind::File => self
                .file_size()
                .map_err(|e| Error::new(op, offset, len, e))?,
        };
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(size),
            _ => Err(Error::new(
                op,
                offset,
                len,
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("range ends past the end of the target ({size} bytes)"),
                ),
            )),
        }
    }

    /// Record what a call taught us; log changes at info.
    pub(crate) fn learn(&self, m: Method, t: Tri, why: Option<&io::Error>) {
        if self.caps.set(m, t) {
            match why {
                Some(e) => tracing::info!(
                    path = %self.path.display(),
                    method = m.name(),
                    state = t.name(),
                    "storage capability learned: {m} {} ({e})",
                    t.name()
                ),
                None => tracing::info!(
                    path = %self.path.display(),
                    method = m.name(),
                    state = t.name(),
                    "storage capability learned: {m} {}",
                    t.name()
                ),
            }
        }
    }

    // ---- read / write ----

    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_offset("read", offset, buf.len())?;
        if let Some(d) = &self.direct {
            return d.read_at(self, buf, offset);
        }
        self.pread_all(buf, offset)
    }

    /// pread until `buf` is full; EOF first is an error naming the range.
    pub(crate) fn pread_all(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = self.pread_upto(buf, offset)?;
        if n < buf.len() {
            return Err(short_read(offset, buf.len() as u64, offset + n as u64));
        }
        Ok(())
    }

    /// pread until `buf` is full or EOF; returns the bytes read.
    pub(crate) fn pread_upto(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
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
                Ok(0) => return Err(short_read(offset, len as u64, pos)),
                Ok(n) => done += n,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => return Ok(false),
                Err(e) if done == 0 && is_unsupported(&e, Method::Splice) => {
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
        if let Some(d) = &self.direct {
            return d.write_at(self, buf, offset, fua);
        }
        self.pwrite_all(buf, offset, fua)
    }

    /// pwrite until all of `buf` is written; with `fua` each piece is written
    /// with RWF_DSYNC (or followed by fdatasync on kernels without it).
    pub(crate) fn pwrite_all(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let use_dsync = fua && self.dsync.load(Ordering::Relaxed) != 2;
        let mut done = 0usize;
        let mut dsync_failed = false;
        while done < buf.len() {
            let off = offset + done as u64;
            let r = if use_dsync && !dsync_failed {
                match self.sys.pwrite_dsync(self.fd(), &buf[done..], off) {
                    Err(e) if is_unsupported(&e, Method::WriteZeros) => {
                        // pwritev2 (4.6) or RWF_DSYNC (4.7) missing.
                        tracing::info!(
                            path = %self.path.display(),
                            "pwritev2(RWF_DSYNC) unsupported ({e}); FUA writes use fdatasync"
                        );
                        self.dsync.store(2, Ordering::Relaxed);
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
                Err(e) => return Err(Error::new("write", offset, buf.len() as u64, e)),
            }
        }
        if fua && (!use_dsync || dsync_failed) {
            retry(|| self.datasync_raw())
                .map_err(|e| Error::new("write (FUA sync)", offset, buf.len() as u64, e))?;
        } else if use_dsync {
            self.dsync.store(1, Ordering::Relaxed);
        }
        Ok(())
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
    pub fn start_writeback(&self, offset: u64, len: u64) {
        if self.direct.is_some() || self.memory_only || len == 0 {
            return;
        }
        if let Err(e) = self.sys.start_writeback(self.fd(), offset, len) {
            tracing::debug!(offset, len, "sync_file_range(WRITE): {e}");
        }
    }

    pub fn flush(&self) -> Result<()> {
        retry(|| self.datasync_raw()).map_err(|e| Error::new("flush", 0, 0, e))
    }

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
                    if is_unsupported(&e, method) {
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
    pub(crate) fn max_call_aligned(&self) -> u64 {
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
        while pos < end {
            if out.len() >= max_runs {
                // The last run may still grow by merging; stop only once a
                // new, different run would be needed.
                break;
            }
            let d = self.seek(CallKind::SeekData, pos);
            let d = match d {
                Ok(v) => v,
                Err(e) if is_unsupported(&e, Method::SeekHole) && out.is_empty() => {
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
        self.check_writable("preallocate", 0, size)?;
        if self.kind == Kind::Block {
            if size <= self.geom.size {
                return Ok(PreallocReport { method: None });
            }
            return Err(Error::new(
                "preallocate",
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
            .map_err(|e| Error::new("preallocate (fstat)", 0, size, e))?;
        if size < old {
            return Err(Error::new(
                "preallocate",
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
                self.truncate_to(old, size)?;
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

    fn truncate_to(&self, old: u64, size: u64) -> Result<()> {
        if size == old {
            return Ok(());
        }
        retry(|| self.sys.ftruncate(self.fd(), size))
            .map_err(|e| Error::new("preallocate (ftruncate)", old, size - old, e))
    }

    /// fallocate(0) from the old end. Ok(false): unsupported here (learned),
    /// the caller falls back to writing. Never posix_fallocate: glibc's
    /// emulation writes one byte per 4 KiB block, slower than writing zeros
    /// (5.0 s vs 3.7 s for 6 GiB on ramfs in RESULTS-baseline.md).
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
                if is_unsupported(&e, Method::Fallocate) {
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
        self.truncate_to(old, size)?;
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
        let z = crate::zero::zero_buf();
        self.write_at(&z[..n], 0, false)
    }

    // ---- cache ----

    /// posix_fadvise(WILLNEED): start reading the range into the page cache.
    pub fn cache(&self, offset: u64, len: u64) -> Result<()> {
        retry(|| self.sys.fadvise_willneed(self.fd(), offset, len))
            .map_err(|e| Error::new("cache (fadvise WILLNEED)", offset, len, e))
    }

    // ---- what to advertise ----

    /// Whether trim may do something (advertise SEND_TRIM).
    pub fn can_trim(&self) -> bool {
        !self.read_only
            && match self.kind {
                Kind::File => self.caps.get(Method::PunchHole).may_work(),
                Kind::Block => self.caps.get(Method::BlkDiscard).may_work(),
            }
    }

    /// Whether a fast (no-write-fallback) zero may succeed (advertise SEND_FAST_ZERO).
    pub fn can_fast_zero(&self) -> bool {
        !self.read_only && crate::zero::fast_methods_left(self, true)
    }

    /// A page-aligned zeroed buffer of `len` bytes (for callers that need
    /// O_DIRECT-friendly memory).
    pub fn aligned_buffer(&self, len: usize) -> AlignedBuf {
        AlignedBuf::zeroed(len, self.direct.as_ref().map_or(4096, |d| d.mem_align()))
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

/// The error for storage that refuses O_DIRECT: never a silent fallback.
fn no_direct(path: &Path, why: &str) -> Error {
    Error::new(
        "open",
        0,
        0,
        io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "O_DIRECT (cache=none) is unsupported on this storage ({why}); use cache=writeback"
            ),
        ),
    )
    .with_path(path)
}

fn open_err(path: &Path, what: &'static str, e: io::Error) -> Error {
    Error::new(what, 0, 0, e).with_path(path)
}

/// Read /sys/dev/block/MAJ:MIN/queue/NAME as a number. Partitions have no
/// queue directory of their own; their disk's is one level up.
fn read_queue_attr(sys: &dyn Sys, maj: u32, min: u32, name: &str) -> Option<u64> {
    for dir in ["queue", "../queue"] {
        let p = PathBuf::from(format!("/sys/dev/block/{maj}:{min}/{dir}/{name}"));
        if let Ok(s) = sys.read_sysfs(&p) {
            return s.trim().parse().ok();
        }
    }
    None
}
