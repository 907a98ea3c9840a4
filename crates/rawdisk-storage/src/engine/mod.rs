//! An open regular file or block device.
//!
//! Every syscall goes through `self.sys` (see [`crate::sys`]); nothing here
//! touches the kernel directly, so tests can inject any errno on any call.
//!
//! The operations are `impl Target` blocks in submodules, because they are
//! the target's own and need its private state, which a child module sees
//! without the fields being opened to the crate:
//! - `rw.rs`: read, write (FUA), splice to a pipe, flush, write-back;
//! - `direct.rs`: cache=none (O_DIRECT) alignment, bounce buffers, range locks;
//! - `zero.rs`: the zero chain, cheapest method first, and why each step exists;
//! - `space.rs`: trim, extents, preallocation;
//! - `map.rs`: writes received from a socket straight into mapped page cache;
//! - `probe.rs`: trying the methods on purpose (`rawdisk probe`).
//!
//! The process-wide capability registry is `registry.rs`, the errno rules
//! `errno.rs`.
//!
//! Range rules: `read_at` must stay inside the target (a short read past the
//! end is an error naming the range); `write_at` on a regular file may extend
//! it (as pwrite does), on a block device it may not; `zero` and `trim` must
//! stay inside the target (they never change its size); `extents` clips to
//! the end.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::caps::{Capabilities, Method, Tri, TriCell};
use crate::errno::{errno, retry};
use crate::error::{Error, Result};
use crate::registry::{self, Key};
use crate::sys::{OpenHow, RealSys, Sys};

mod aio;
mod direct;
mod map;
mod offload;
mod probe;
mod rw;
mod space;
mod zero;

pub use aio::{DirectBackend, DirectDone, DirectOp, DirectQueue};
#[cfg(test)]
pub(crate) use aio::{FAILS as URING_REFUSED, UNKNOWN as URING_UNKNOWN};
pub use direct::AlignedBuf;
use direct::Direct;
pub use map::MappedWrite;
pub use offload::{CopyOffload, Offloaded};
pub use probe::{Probe, Seen, Trial};

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
    /// A block device only: fail (EBUSY) while it is mounted or open
    /// exclusively elsewhere (O_EXCL), so nothing writes under a mounted
    /// file system.
    pub exclusive: bool,
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
    pub minimum_io_size: Option<u64>,
    pub optimal_io_size: Option<u64>,
    pub rotational: Option<bool>,
    pub write_zeroes_max_bytes: Option<u64>,
    pub write_zeroes_unmap_max_bytes: Option<u64>,
    pub discard_max_bytes: Option<u64>,
    pub discard_granularity: Option<u64>,
    pub discard_zeroes_data: Option<bool>,
}

impl QueueLimits {
    /// The one reading of the queue limits of the block device MAJ:MIN,
    /// through `sys`; None when sysfs has no queue for it.
    fn read(sys: &dyn Sys, major: u32, minor: u32) -> Option<QueueLimits> {
        let a = |n: &str| read_queue_attr(sys, major, minor, n);
        let q = QueueLimits {
            major,
            minor,
            logical_block_size: a("logical_block_size"),
            physical_block_size: a("physical_block_size"),
            minimum_io_size: a("minimum_io_size"),
            optimal_io_size: a("optimal_io_size"),
            rotational: a("rotational").map(|v| v == 1),
            write_zeroes_max_bytes: a("write_zeroes_max_bytes"),
            write_zeroes_unmap_max_bytes: a("write_zeroes_unmap_max_bytes"),
            discard_max_bytes: a("discard_max_bytes"),
            discard_granularity: a("discard_granularity"),
            discard_zeroes_data: a("discard_zeroes_data").map(|v| v != 0),
        };
        if q.logical_block_size.is_none() && q.rotational.is_none() {
            return None;
        }
        Some(q)
    }
}

/// statfs f_type of tmpfs and ramfs (<linux/magic.h>).
const TMPFS_MAGIC: u64 = 0x0102_1994;
const RAMFS_MAGIC: u64 = 0x8584_58f6;

/// One open file or block device. Cheap to share (`Arc`), every method takes
/// `&self` and is safe from many threads.
pub struct Target {
    pub(crate) sys: Arc<dyn Sys>,
    fd: OwnedFd,
    path: PathBuf,
    kind: Kind,
    geom: Geometry,
    caps: Arc<Capabilities>,
    cache: CacheMode,
    read_only: bool,
    /// Alignment of fallocate/BLKZEROOUT/BLKDISCARD ranges: the logical
    /// sector or the page, whichever is larger, on block devices; 1 on files.
    offload_align: u64,
    /// Some under cache=none.
    direct: Option<Direct>,
    zero_chunk: usize,
    max_call: u64,
    /// PUNCH_HOLE + fallocate(0) and writing zeros cost about the same here
    /// and which is cheaper differs from machine to machine (tmpfs), so a
    /// no-trim zero times both before it settles on one (`Capabilities::
    /// keep_zero`); until then punch-alloc does not count as fast.
    punch_alloc_timed: bool,
    /// The data lives only in the page cache (tmpfs, ramfs): nothing to
    /// write back, so [`Target::start_writeback`] makes no call.
    memory_only: bool,
    /// pwritev2(RWF_DSYNC) for FUA.
    dsync: TriCell,
    /// A sync of this target failed: the kernel may have dropped the dirty
    /// pages it could not write, so no later sync may report success
    /// (`rw.rs`, the flush-failure rule). Cleared only by a new open.
    sync_failed: AtomicBool,
    /// Held across each fdatasync/fsync (`rw.rs`, `sync`).
    sync_lock: std::sync::Mutex<()>,
    /// preadv2(RWF_NOWAIT) for [`Target::read_cached`] (file systems
    /// without nowait buffered reads answer EOPNOTSUPP).
    nowait: TriCell,
    /// Key of the block device under a file (its st_dev), or the device itself.
    sysfs_dev: Option<(u32, u32)>,
    /// The file size last seen, for O_DIRECT writes near the end.
    known_size: AtomicU64,
    /// Opened with [`RealSys`]: calls outside the `Sys` table (Linux AIO)
    /// would bypass a test's injected one.
    real_kernel: bool,
    /// Made on the first [`Target::map_write`]; None if mapping failed.
    write_map: OnceLock<Option<map::WriteMap>>,
    /// st_dev and st_ino (st_rdev and 0 for a block device).
    id: (u64, u64),
    /// st_blksize: the block a reflink must be aligned to.
    fs_block: u64,
    /// The copy offloads learned for the last source file system this
    /// target copied from (its st_dev), held so they live as long as the
    /// target (the registry only keeps weak references).
    copy_pair: std::sync::Mutex<Option<(u64, Arc<crate::caps::CopyCaps>)>>,
}

/// How [`Target::open_in`] resolves a name under its directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// No step of the lookup, symlinks included, leaves the directory:
    /// openat2 with RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS, EXDEV for a
    /// path that would, ENOSYS on kernels without openat2.
    Beneath,
    /// Plain openat: for callers that check the opened target's identity
    /// ([`Target::file_id`]) themselves where openat2 is missing.
    Unrestricted,
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

impl Target {
    pub fn open(path: &Path, opts: &OpenOptions) -> Result<Target> {
        let mut t = Self::open_with_sys(path, opts, Arc::new(RealSys))?;
        t.real_kernel = true;
        Ok(t)
    }

    pub fn open_with_sys(path: &Path, opts: &OpenOptions, sys: Arc<dyn Sys>) -> Result<Target> {
        Self::open_by(sys, path, opts, |s, how| s.open(path, how))
    }

    /// Opens `name` inside the directory `dir` (an fd, O_PATH will do),
    /// resolving it as `lookup` says. `path` names the target in messages.
    /// What is opened is classified as [`Target::open`] does.
    pub fn open_in(
        dir: BorrowedFd<'_>,
        name: &Path,
        path: &Path,
        opts: &OpenOptions,
        lookup: Lookup,
    ) -> Result<Target> {
        let mut t = Self::open_by(Arc::new(RealSys), path, opts, |s, how| match lookup {
            Lookup::Beneath => s.open_beneath(dir, name, how),
            Lookup::Unrestricted => s.open_at(dir, name, how),
        })?;
        t.real_kernel = true;
        Ok(t)
    }

    /// Opens with `open` as `opts` says and classifies the result: the one
    /// place the open flags and the open error of every way in are made.
    fn open_by(
        sys: Arc<dyn Sys>,
        path: &Path,
        opts: &OpenOptions,
        open: impl FnOnce(&dyn Sys, OpenHow) -> io::Result<OwnedFd>,
    ) -> Result<Target> {
        let how = open_how(opts);
        let fd = open(&*sys, how).map_err(|e| open_failed(path, how, e))?;
        Self::from_fd(fd, path, opts, sys)
    }

    /// The target behind `fd`, freshly opened as `opts` says: its type,
    /// geometry and capabilities come from the fd, never from `path`.
    fn from_fd(fd: OwnedFd, path: &Path, opts: &OpenOptions, sys: Arc<dyn Sys>) -> Result<Target> {
        let direct = opts.cache == CacheMode::None;
        let st = sys
            .fstat(fd.as_fd())
            .map_err(|e| open_err(path, "fstat", e))?;
        let kind = if st.is_block {
            Kind::Block
        } else if st.is_regular {
            Kind::File
        } else {
            return Err(open_err(path, "open", not_an_image(st.type_name)));
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
        let id = if st.is_block {
            (st.rdev, 0)
        } else {
            (st.dev, st.ino)
        };
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
            // Block devices have neither fallocate(0) nor SEEK_HOLE (see
            // docs/capabilities.md, Loop devices); record it without a
            // wasted call per handle.
            caps.set(Method::Fallocate, Tri::Fails);
            caps.set(Method::PunchAlloc, Tri::Fails);
            caps.set(Method::SeekHole, Tri::Fails);
        }
        // tmpfs: punching frees the pages and fallocate(0) allocates and
        // clears them again, against one copy into resident pages when
        // writing zeros. Which costs less depends on the machine, not the
        // kernel (see docs/capabilities.md, tmpfs), so the engine times both
        // on the first big no-trim zeros (zero.rs) instead of trusting a
        // constant.
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
            dsync: TriCell::default(),
            sync_failed: AtomicBool::new(false),
            sync_lock: std::sync::Mutex::new(()),
            nowait: TriCell::default(),
            sysfs_dev,
            write_map: OnceLock::new(),
            id,
            fs_block: st.blksize.max(1),
            copy_pair: std::sync::Mutex::new(None),
            real_kernel: false,
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

    fn file_size(&self) -> io::Result<u64> {
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

    /// st_dev and st_ino of what is open (the device node's for a block
    /// device), from the fd: its identity, whatever its path now names.
    pub fn file_id(&self) -> Result<(u64, u64)> {
        self.sys
            .fstat(self.fd())
            .map(|s| (s.dev, s.ino))
            .map_err(|e| open_err(&self.path, "fstat", e))
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
    /// write_zeroes_max_bytes drops to 0 at run time (see
    /// docs/capabilities.md, tmpfs-backed loop devices).
    pub fn block_queue_limits(&self) -> Option<QueueLimits> {
        let (maj, min) = self.sysfs_dev?;
        QueueLimits::read(&*self.sys, maj, min)
    }

    fn check_writable(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        if self.read_only {
            return Err(Error::new(op, offset, len, errno(libc::EROFS)));
        }
        Ok(())
    }

    /// Zero and trim must stay within the target.
    fn check_range(&self, op: &'static str, offset: u64, len: u64) -> Result<u64> {
        let size = match self.kind {
            Kind::Block => self.geom.size,
            // Inside the size last seen: no fstat. Each one is a GETATTR
            // round trip on NFS, once per zero or trim; a file shrunk
            // under us is then regrown as a write would (nbdkit, qemu).
            Kind::File => match self.known_size.load(Ordering::Relaxed) {
                known if offset.checked_add(len).is_some_and(|e| e <= known) => known,
                _ => self
                    .file_size()
                    .map_err(|e| Error::new(op, offset, len, e))?,
            },
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

    /// Record what a call taught us; log changes at debug (`-v`): they are
    /// the engine's business, not the user's.
    fn learn(&self, m: Method, t: Tri, why: Option<&io::Error>) {
        if self.caps.set(m, t) {
            match why {
                Some(e) => tracing::debug!(
                    path = %self.path.display(),
                    method = m.name(),
                    state = t.name(),
                    "storage capability learned: {m} {} ({e})",
                    t.name()
                ),
                None => tracing::debug!(
                    path = %self.path.display(),
                    method = m.name(),
                    state = t.name(),
                    "storage capability learned: {m} {}",
                    t.name()
                ),
            }
        }
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
        !self.read_only && zero::fast_methods_left(self, true)
    }

    /// A page-aligned zeroed buffer of `len` bytes (for callers that need
    /// O_DIRECT-friendly memory).
    pub fn aligned_buffer(&self, len: usize) -> AlignedBuf {
        AlignedBuf::zeroed(len, self.direct.as_ref().map_or(4096, |d| d.mem_align()))
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

fn open_how(opts: &OpenOptions) -> OpenHow {
    OpenHow {
        read_only: opts.read_only,
        direct: opts.cache == CacheMode::None,
        create: opts.create,
        create_new: opts.create_new,
        truncate: opts.truncate,
        exclusive: opts.exclusive,
        ..OpenHow::default()
    }
}

fn open_failed(path: &Path, how: OpenHow, e: io::Error) -> Error {
    // ramfs (no direct_IO address-space op) and tmpfs before 6.6 refuse
    // O_DIRECT at open with EINVAL. Say so instead of failing obscurely,
    // and never fall back silently to the page cache.
    if how.direct && e.raw_os_error() == Some(libc::EINVAL) {
        return no_direct(path, &format!("the kernel refused it: {e}"));
    }
    open_err(path, "open", e)
}

/// The cause for a path that is neither a regular file nor a block device.
pub(crate) fn not_an_image(type_name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("it is a {type_name}, not a regular file or block device"),
    )
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
