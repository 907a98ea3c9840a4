//! [`FaultSys`]: a [`Sys`] that forwards to another one and injects errnos, so
//! tests can produce failures the machine under test cannot (EIO, ENOSPC, a
//! method that stops being supported at run time) on exactly the call wanted,
//! and can assert which syscalls the engine made (a method known to fail must
//! never be called again).

use std::collections::HashMap;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::sys::{BlockGeometry, CallKind, DioAlign, FallocMode, FileStat, MapSpan, OpenHow, Sys};

/// "The `nth` call (1-based, counted per [`CallKind`]) of `kind` fails with
/// `errno`", once, or on every call from the `nth` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultRule {
    pub kind: CallKind,
    pub nth: u64,
    pub errno: i32,
    /// false: only the nth call fails; true: the nth and every later one.
    pub repeat: bool,
}

impl FaultRule {
    /// Only the `nth` call of `kind` fails.
    pub fn once(kind: CallKind, nth: u64, errno: i32) -> Self {
        FaultRule {
            kind,
            nth,
            errno,
            repeat: false,
        }
    }

    /// The `nth` call of `kind` and every later one fail.
    pub fn from_nth(kind: CallKind, nth: u64, errno: i32) -> Self {
        FaultRule {
            kind,
            nth,
            errno,
            repeat: true,
        }
    }

    /// Every call of `kind` fails.
    pub fn always(kind: CallKind, errno: i32) -> Self {
        Self::from_nth(kind, 1, errno)
    }

    fn hits(&self, kind: CallKind, n: u64) -> bool {
        self.kind == kind && (n == self.nth || (self.repeat && n > self.nth))
    }
}

/// Wraps another [`Sys`]; every call is counted, then failed if a rule says
/// so (the inner `Sys` is then not called), else forwarded.
pub struct FaultSys {
    inner: Arc<dyn Sys>,
    rules: Mutex<Vec<FaultRule>>,
    counts: Mutex<HashMap<CallKind, u64>>,
    /// 0 = unlimited; else pread/pwrite move at most this many bytes per call
    /// (short transfers, to exercise the whole-length loops).
    max_io: AtomicUsize,
}

impl std::fmt::Debug for FaultSys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultSys")
            .field("rules", &*self.rules.lock().unwrap())
            .field("counts", &*self.counts.lock().unwrap())
            .finish()
    }
}

impl FaultSys {
    pub fn new(inner: Arc<dyn Sys>) -> Self {
        FaultSys {
            inner,
            rules: Mutex::new(Vec::new()),
            counts: Mutex::new(HashMap::new()),
            max_io: AtomicUsize::new(0),
        }
    }

    /// A `FaultSys` over the kernel.
    pub fn real() -> Arc<Self> {
        Arc::new(Self::new(Arc::new(crate::sys::RealSys)))
    }

    /// Add a rule. Call numbers count from the creation of this `FaultSys`
    /// (or the last [`FaultSys::reset_counts`]), not from when the rule is added.
    pub fn add(&self, rule: FaultRule) -> &Self {
        self.rules.lock().unwrap().push(rule);
        self
    }

    /// Shorthand for `add(FaultRule::once(..))`.
    pub fn fail_once(&self, kind: CallKind, nth: u64, errno: i32) -> &Self {
        self.add(FaultRule::once(kind, nth, errno))
    }

    /// Shorthand for `add(FaultRule::from_nth(..))`.
    pub fn fail_from(&self, kind: CallKind, nth: u64, errno: i32) -> &Self {
        self.add(FaultRule::from_nth(kind, nth, errno))
    }

    /// Remove every rule (counts are kept).
    pub fn clear_rules(&self) {
        self.rules.lock().unwrap().clear();
    }

    pub fn reset_counts(&self) {
        self.counts.lock().unwrap().clear();
    }

    /// Limit pread/pwrite/pwrite_dsync/splice to `n` bytes per call (0 = no limit).
    pub fn set_max_io(&self, n: usize) {
        self.max_io.store(n, Ordering::Relaxed);
    }

    /// Calls of `kind` made so far, failed ones included.
    pub fn calls(&self, kind: CallKind) -> u64 {
        self.counts.lock().unwrap().get(&kind).copied().unwrap_or(0)
    }

    /// Calls of every fallocate mode together.
    pub fn fallocate_calls(&self) -> u64 {
        self.counts
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| matches!(k, CallKind::Fallocate(_)))
            .map(|(_, n)| *n)
            .sum()
    }

    /// Every kind called so far with its count.
    pub fn counts(&self) -> HashMap<CallKind, u64> {
        self.counts.lock().unwrap().clone()
    }

    /// Count the call, and return the injected error if a rule hits it.
    fn enter(&self, kind: CallKind) -> io::Result<()> {
        let n = {
            let mut c = self.counts.lock().unwrap();
            let e = c.entry(kind).or_insert(0);
            *e += 1;
            *e
        };
        let rules = self.rules.lock().unwrap();
        match rules.iter().find(|r| r.hits(kind, n)) {
            Some(r) => Err(io::Error::from_raw_os_error(r.errno)),
            None => Ok(()),
        }
    }

    fn cap(&self, len: usize) -> usize {
        match self.max_io.load(Ordering::Relaxed) {
            0 => len,
            m => len.min(m),
        }
    }
}

impl Sys for FaultSys {
    fn pread(&self, fd: BorrowedFd<'_>, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.enter(CallKind::Pread)?;
        let n = self.cap(buf.len());
        self.inner.pread(fd, &mut buf[..n], offset)
    }
    fn pwrite(&self, fd: BorrowedFd<'_>, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.enter(CallKind::Pwrite)?;
        let n = self.cap(buf.len());
        self.inner.pwrite(fd, &buf[..n], offset)
    }
    fn fallocate(
        &self,
        fd: BorrowedFd<'_>,
        mode: FallocMode,
        offset: u64,
        len: u64,
    ) -> io::Result<()> {
        self.enter(CallKind::Fallocate(mode))?;
        self.inner.fallocate(fd, mode, offset, len)
    }
    fn blkzeroout(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
        self.enter(CallKind::BlkZeroout)?;
        self.inner.blkzeroout(fd, offset, len)
    }
    fn blkdiscard(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
        self.enter(CallKind::BlkDiscard)?;
        self.inner.blkdiscard(fd, offset, len)
    }
    fn seek_data(&self, fd: BorrowedFd<'_>, offset: u64) -> io::Result<Option<u64>> {
        self.enter(CallKind::SeekData)?;
        self.inner.seek_data(fd, offset)
    }
    fn seek_hole(&self, fd: BorrowedFd<'_>, offset: u64) -> io::Result<Option<u64>> {
        self.enter(CallKind::SeekHole)?;
        self.inner.seek_hole(fd, offset)
    }
    fn fsync(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.enter(CallKind::Fsync)?;
        self.inner.fsync(fd)
    }
    fn fdatasync(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.enter(CallKind::Fdatasync)?;
        self.inner.fdatasync(fd)
    }
    fn ftruncate(&self, fd: BorrowedFd<'_>, size: u64) -> io::Result<()> {
        self.enter(CallKind::Ftruncate)?;
        self.inner.ftruncate(fd, size)
    }
    fn fadvise_willneed(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
        self.enter(CallKind::Fadvise)?;
        self.inner.fadvise_willneed(fd, offset, len)
    }
    fn block_geometry(&self, fd: BorrowedFd<'_>) -> io::Result<BlockGeometry> {
        self.enter(CallKind::BlockGeometry)?;
        self.inner.block_geometry(fd)
    }
    fn open(&self, path: &Path, how: OpenHow) -> io::Result<OwnedFd> {
        self.enter(CallKind::Open)?;
        self.inner.open(path, how)
    }
    fn fstat(&self, fd: BorrowedFd<'_>) -> io::Result<FileStat> {
        self.enter(CallKind::Fstat)?;
        self.inner.fstat(fd)
    }
    fn fs_magic(&self, fd: BorrowedFd<'_>) -> io::Result<u64> {
        self.inner.fs_magic(fd)
    }
    fn dio_align(&self, fd: BorrowedFd<'_>) -> io::Result<Option<DioAlign>> {
        self.enter(CallKind::Statx)?;
        self.inner.dio_align(fd)
    }
    fn pwrite_dsync(&self, fd: BorrowedFd<'_>, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.enter(CallKind::PwriteDsync)?;
        let n = self.cap(buf.len());
        self.inner.pwrite_dsync(fd, &buf[..n], offset)
    }
    fn read_sysfs(&self, path: &Path) -> io::Result<String> {
        self.enter(CallKind::ReadSysfs)?;
        self.inner.read_sysfs(path)
    }
    fn sync_range(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
        self.enter(CallKind::SyncRange)?;
        self.inner.sync_range(fd, offset, len)
    }
    fn start_writeback(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
        self.enter(CallKind::SyncRange)?;
        self.inner.start_writeback(fd, offset, len)
    }
    fn splice_to_pipe(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        pipe: BorrowedFd<'_>,
        len: usize,
    ) -> io::Result<usize> {
        self.enter(CallKind::Splice)?;
        let n = self.cap(len);
        self.inner.splice_to_pipe(fd, offset, pipe, n)
    }
    fn map_shared(&self, fd: BorrowedFd<'_>, len: usize) -> io::Result<usize> {
        self.enter(CallKind::Mmap)?;
        self.inner.map_shared(fd, len)
    }
    fn unmap(&self, addr: usize, len: usize) -> io::Result<()> {
        self.inner.unmap(addr, len)
    }
    fn resident(&self, span: &MapSpan<'_>) -> io::Result<bool> {
        self.enter(CallKind::Resident)?;
        self.inner.resident(span)
    }
    fn populate_write(&self, span: &MapSpan<'_>) -> io::Result<()> {
        self.enter(CallKind::PopulateWrite)?;
        self.inner.populate_write(span)
    }
    fn unpopulate(&self, span: &MapSpan<'_>) -> io::Result<()> {
        self.inner.unpopulate(span)
    }
    fn recv_to_map(
        &self,
        sock: BorrowedFd<'_>,
        span: &MapSpan<'_>,
        at: usize,
        len: usize,
    ) -> io::Result<usize> {
        self.enter(CallKind::RecvToMap)?;
        let n = self.cap(len);
        self.inner.recv_to_map(sock, span, at, n)
    }
}
