//! The export layer: what every request does to an export's storage
//! (reads, block status and cache hints included), and the rules each one
//! obeys, in one place. The request loop (`transmission.rs`) only decides
//! where a request runs (the reader, the blocking pool, straight into the
//! page cache); `command.rs` turns a request into calls here and the
//! results into a reply. Nothing else touches the target while it is
//! served.
//!
//! The rules, each applied once, on every path:
//! - changed-block tracking: a write, zero or trim marks its range before
//!   any byte reaches the storage and again when the storage call returns
//!   ([`Change`]), so a checkpoint created while it was in flight sees it
//!   too; a FLUSH, and a write, zero or trim with FUA, persists the marks
//!   before it succeeds (docs/cbt.md, the persistence rule);
//! - write-behind: a page-cache write that succeeded, received into a
//!   buffer or straight into the mapped page cache, may start its
//!   write-back (`writeback.rs`); a FLUSH tells the policy;
//! - the hole-lookup skip: reads skip the lookup on fully allocated files,
//!   and a zero or trim of ours resets that;
//! - the learned capabilities are logged once per change, right after the
//!   call that learned them;
//! - `--discard ignore`: trims do nothing and zeroes never punch holes;
//!   `--detect-zeroes`: an all-zero write becomes a zero of its range
//!   ([`Serving`]), on every write path (the mapped and in-kernel paths
//!   leave such writes to [`Export::write`]);
//! - the window ([`Window`]): request offsets are the export's, and each
//!   storage call here is made at the window's offset plus the request's,
//!   so nothing outside the window is read or written (requests are
//!   checked against [`Export::size`] before they get here), and a failed
//!   call's range is given back in the export's offsets;
//! - written since the last flush ([`Dirty`]): every change counts, as the
//!   changed-block marks do; only a flush that succeeded counts as one, and
//!   covers only what had returned before it started; the final flush at
//!   stop is skipped when nothing is left (qemu's `write_gen`).

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rawdisk_storage::cbt::{CbtError, Tracker};
use rawdisk_storage::{
    CacheMode, DirectBackend, DirectDone, DirectOp, DirectQueue, Extent, ExtentKind, Kind,
    MappedWrite, Method, Target, ZeroFlags,
};
use tracing::{debug, trace};

use super::writeback::{Policy, WriteBehind};
use crate::proto::{errno_to_nbd, NBD_EINVAL, NBD_EIO, NBD_ENOMEM, NBD_ENOTSUP, NBD_EPERM};

#[cfg(test)]
mod dirty;
#[cfg(test)]
mod model;

/// Extents looked up for one sparse read.
const SPARSE_READ_RUNS: usize = 64;
/// A hole lookup slower than this that found only data...
const SPARSE_LOOKUP_SLOW: Duration = Duration::from_micros(200);
/// ...makes this many following reads skip the lookup.
const SPARSE_SKIP_READS: u64 = 64;

/// qemu-nbd's `--discard`: whether trims (and zeroes the client lets
/// become holes) may deallocate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Discard {
    /// NBD_FLAG_SEND_TRIM not advertised, a TRIM sent anyway does nothing,
    /// and zeroes keep their range allocated.
    Ignore,
    /// Trims punch holes; zeroes may, unless the client says NO_HOLE.
    #[default]
    Unmap,
}

/// qemu-nbd's `--detect-zeroes`: what an all-zero write payload becomes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DetectZeroes {
    /// Written as it came.
    #[default]
    Off,
    /// A zero of the same range, kept allocated.
    On,
    /// A zero that may leave a hole, when [`Discard::Unmap`] allows it.
    Unmap,
}

/// The I/O path of `--cache none` reads and writes (`serve --aio`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Aio {
    /// Linux AIO for small O_DIRECT requests, the blocking pool for the rest.
    #[default]
    Native,
    /// io_uring for the same requests; Linux AIO where the kernel refuses it.
    IoUring,
    /// The blocking pool only.
    Threads,
}

/// How an export treats discards, zero writes and its I/O path; the same
/// for every export of a server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Serving {
    pub discard: Discard,
    pub detect_zeroes: DetectZeroes,
    pub aio: Aio,
}

impl Serving {
    /// Whether a zero may leave a hole where the client allows one.
    fn may_unmap(&self) -> bool {
        self.discard == Discard::Unmap
    }
}

/// The part of the target an export serves (qemu's raw driver `offset`
/// and `size`, qemu-nbd `--offset`): byte 0 of the export is byte `offset`
/// of the target, and the export is `size` bytes long (None: up to the
/// target's end, following it as a file grows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub offset: u64,
    pub size: Option<u64>,
}

/// Whether a payload is all zeros (`--detect-zeroes`): 16 bytes at a time,
/// stopping at the first that is not.
fn is_zero(data: &[u8]) -> bool {
    let mut words = data.chunks_exact(16);
    words
        .by_ref()
        .all(|w| <[u8; 16]>::try_from(w).is_ok_and(|w| u128::from_ne_bytes(w) == 0))
        && words.remainder().iter().all(|&b| b == 0)
}

/// Whether anything was written since the last flush that covers it, as
/// qemu counts `write_gen` against `flushed_gen`: the final flush at stop is
/// skipped when not (an fsync, a COMMIT round trip on NFS).
#[derive(Debug, Default)]
struct Dirty {
    /// Bumped as each change starts and again once its storage call returned.
    changes: AtomicU64,
    /// `changes` as read just before the latest successful flush started.
    flushed: AtomicU64,
}

impl Dirty {
    fn changed(&self) {
        self.changes.fetch_add(1, Ordering::SeqCst);
    }

    /// Read before the flush starts: a change that returns later bumps past
    /// it, so a write racing the flush leaves the export dirty.
    fn flush_starts(&self) -> u64 {
        self.changes.load(Ordering::SeqCst)
    }

    /// The flush that started at `at` succeeded (a failed one changes
    /// nothing: its data may be lost, the final flush must try again).
    fn flushed(&self, at: u64) {
        self.flushed.fetch_max(at, Ordering::SeqCst);
    }

    fn is_dirty(&self) -> bool {
        self.flushed.load(Ordering::SeqCst) != self.changes.load(Ordering::SeqCst)
    }
}

/// The NBD error for a storage failure.
pub(super) fn storage_errno(e: &rawdisk_storage::Error) -> u32 {
    if let Some(n) = e.errno() {
        return errno_to_nbd(n);
    }
    match e.source.kind() {
        io::ErrorKind::InvalidInput => NBD_EINVAL,
        io::ErrorKind::PermissionDenied => NBD_EPERM,
        io::ErrorKind::OutOfMemory => NBD_ENOMEM,
        io::ErrorKind::Unsupported => NBD_ENOTSUP,
        _ => NBD_EIO,
    }
}

/// One exported target, shared by every connection to it.
pub(super) struct Export {
    pub name: String,
    /// Requests reach it only through the methods below; the handshake
    /// reads its size and kind, and the final flush at exit calls it.
    pub target: Arc<Target>,
    pub read_only: bool,
    pub min_block: u32,
    pub preferred_block: u32,
    write_behind: Policy,
    /// Reads left that skip the hole lookup.
    sparse_skip: AtomicU64,
    /// Written since the last flush.
    dirty: Dirty,
    /// Capability generation last logged.
    caps_logged: AtomicU64,
    /// Changed-block tracking (`--track-changes`), shared with every other
    /// connection to the same target.
    tracker: Option<Arc<Tracker>>,
    /// `--discard`, `--detect-zeroes`, `--aio`.
    serving: Serving,
    /// The part of the target served.
    window: Window,
    /// (st_dev, st_ino) of what was opened: a file replaced under the same
    /// name is a new export.
    pub(super) id: (u64, u64),
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Export({:?})", self.name)
    }
}

/// Why a request that changes the export failed: the operation, as the
/// error reply and the log name it, and the cause.
#[derive(Debug)]
pub(super) struct Failure {
    pub op: &'static str,
    pub cause: Cause,
}

#[derive(Debug)]
pub(super) enum Cause {
    /// The storage call failed.
    Storage(rawdisk_storage::Error),
    /// The tracker's marks could not be made durable (answered EIO).
    Persist(CbtError),
}

/// The operation a failed zero names; its errors map to NBD errors by a
/// rule of their own (command.rs).
pub(super) const ZERO_OP: &str = "write zeroes";

/// A range being changed: marked in the tracker and counted as unflushed
/// when made, and again when dropped, after the storage call returned (also
/// when it failed or panicked: part of the range may have changed).
struct Change<'a> {
    tracker: Option<&'a Tracker>,
    dirty: &'a Dirty,
    offset: u64,
    len: u64,
}

impl Change<'_> {
    /// The only place the tracker is marked and a change counted.
    fn record(&self) {
        self.dirty.changed();
        if let Some(t) = self.tracker {
            t.mark(self.offset, self.len);
        }
    }
}

impl Drop for Change<'_> {
    fn drop(&mut self) {
        self.record();
    }
}

/// A write received straight into the target's mapped page cache
/// (`--map-writes`): made by [`Export::map_write`], which marks the whole
/// write; the caller receives the payload into [`Mapped::pages`], then
/// calls [`Mapped::finish`].
pub(super) struct Mapped<'a> {
    export: &'a Export,
    pages: MappedWrite<'a>,
    /// The target's offset of the write (the window's applied).
    offset: u64,
    len: u64,
    head: u64,
    change: Change<'a>,
}

impl<'a> Mapped<'a> {
    /// Writes the first bytes of the payload, which arrived before the
    /// mapping was made, the ordinary way.
    pub(super) fn write_head(&self, head: &[u8]) -> Result<(), Failure> {
        debug_assert_eq!(head.len() as u64, self.head);
        self.export
            .target
            .write_at(head, self.offset, false)
            .map_err(self.export.failed("write"))
    }

    /// The pages the rest of the payload goes to.
    pub(super) fn pages(&mut self) -> &mut MappedWrite<'a> {
        &mut self.pages
    }

    /// The payload is received (`complete`) or not: the pages leave the
    /// page tables, the write is marked again, and a complete write may
    /// start its write-back.
    pub(super) fn finish(self, complete: bool) {
        let Mapped {
            export,
            pages,
            offset,
            len,
            change,
            ..
        } = self;
        drop(pages);
        drop(change);
        if complete {
            export.written(offset, len);
        }
    }
}

impl Export {
    pub(super) fn new(
        name: String,
        target: Arc<Target>,
        read_only: bool,
        write_behind: WriteBehind,
        max_payload: u32,
        id: (u64, u64),
        tracker: Option<Arc<Tracker>>,
    ) -> Export {
        let read_only = read_only || target.is_read_only();
        let (min_block, preferred_block) = block_sizes(&target, max_payload);
        Export {
            name,
            write_behind: Policy::new(
                write_behind,
                target.has_write_back() && !read_only,
                target.size(),
            ),
            caps_logged: AtomicU64::new(target.caps().generation()),
            sparse_skip: AtomicU64::new(0),
            dirty: Dirty::default(),
            target,
            read_only,
            min_block,
            preferred_block,
            id,
            tracker,
            serving: Serving::default(),
            window: Window::default(),
        }
    }

    /// The export serving only `window` of its target.
    pub(super) fn with_window(mut self, window: Window) -> Export {
        self.window = window;
        self
    }

    /// A storage failure of `op`, its range moved to the export's offsets:
    /// the error reply (and its offset) and the log speak the client's.
    fn failed(&self, op: &'static str) -> impl FnOnce(rawdisk_storage::Error) -> Failure + '_ {
        move |mut e| {
            // Whole-target failures (a flush) name no range.
            if e.offset != 0 || e.len != 0 {
                match e.offset.checked_sub(self.window.offset) {
                    Some(o) => e.offset = o,
                    None => (e.offset, e.len) = (0, 0),
                }
            }
            Failure {
                op,
                cause: Cause::Storage(e),
            }
        }
    }

    /// The export's size: the window's, else the target's.
    pub(super) fn size(&self) -> u64 {
        match self.window.size {
            Some(s) => s,
            None => self.target.size().saturating_sub(self.window.offset),
        }
    }

    /// The target's offset of the export's `offset`.
    fn at(&self, offset: u64) -> u64 {
        self.window.offset + offset
    }

    /// Extents the target reported, in the export's offsets.
    fn in_export(&self, mut ext: Vec<Extent>) -> Vec<Extent> {
        for e in &mut ext {
            e.offset -= self.window.offset;
        }
        ext
    }

    /// The export with `serving`'s rules (`serve --discard`,
    /// `--detect-zeroes`, `--aio`).
    pub(super) fn with_serving(mut self, serving: Serving) -> Export {
        self.serving = serving;
        self
    }

    /// Whether NBD_FLAG_SEND_TRIM may be advertised.
    pub(super) fn trims(&self) -> bool {
        self.serving.discard == Discard::Unmap
    }

    /// Whether a write of `data` is left to [`Export::write`], which turns
    /// it into a zero (`--detect-zeroes`), instead of a faster path.
    pub(super) fn detects_zeroes(&self, data: Option<&[u8]>) -> bool {
        self.serving.detect_zeroes != DetectZeroes::Off && data.is_none_or(is_zero)
    }

    /// The changed-block tracker, with `--track-changes`.
    pub(super) fn tracker(&self) -> Option<&Arc<Tracker>> {
        self.tracker.as_ref()
    }

    /// A change of the range starts: marked now and when it is dropped.
    fn change(&self, offset: u64, len: u64) -> Change<'_> {
        let c = Change {
            tracker: self.tracker.as_deref(),
            dirty: &self.dirty,
            offset,
            len,
        };
        c.record();
        c
    }

    /// NBD_CMD_WRITE of `data` at `offset`.
    pub(super) fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Failure> {
        let len = data.len() as u64;
        if self.detects_zeroes(Some(data)) {
            // qemu's detect-zeroes: unmap only where discards may.
            let flags = ZeroFlags {
                may_trim: self.serving.detect_zeroes == DetectZeroes::Unmap
                    && self.serving.may_unmap(),
                fast_only: false,
            };
            return self.zero(offset, len, flags, fua).map_err(|f| Failure {
                op: if f.op == ZERO_OP { "write" } else { f.op },
                ..f
            });
        }
        let change = self.change(offset, len);
        self.target
            .write_at(data, self.at(offset), fua)
            .map_err(self.failed("write"))?;
        drop(change);
        if fua {
            return self.persist("write (FUA)");
        }
        self.written(self.at(offset), len);
        Ok(())
    }

    /// A queue for cache=none reads and writes in flight in the kernel
    /// (Linux AIO or io_uring), or None: served by the blocking pool.
    pub(super) fn direct_queue<T>(&self, depth: usize) -> Option<DirectQueue<T>> {
        let backend = match self.serving.aio {
            Aio::Threads => return None,
            Aio::Native => DirectBackend::Native,
            Aio::IoUring => DirectBackend::IoUring,
        };
        self.target.direct_queue_on(depth, backend)
    }

    /// Submits non-FUA reads and writes to `q`; returns those it refused,
    /// for [`Export::read`] / [`Export::write`]. A write is marked before it
    /// is submitted and again when reaped ([`Export::reap_direct`]).
    pub(super) fn submit_direct<T>(
        &self,
        q: &mut DirectQueue<T>,
        ops: Vec<DirectOp<T>>,
    ) -> Vec<DirectOp<T>> {
        // Zero writes go the blocking way, to become zeroes there.
        let (ops, mut zeros): (Vec<_>, Vec<_>) = ops.into_iter().partition(|op| {
            !(op.write && self.detects_zeroes(op.buf.get(op.start..op.start + op.len)))
        });
        for op in ops.iter().filter(|op| op.write) {
            self.mark(op.offset, op.len as u64);
        }
        let base = self.window.offset;
        let ops = ops
            .into_iter()
            .map(|op| DirectOp {
                offset: op.offset + base,
                ..op
            })
            .collect();
        let mut refused = q.submit(ops);
        for op in &mut refused {
            op.offset -= base;
        }
        refused.append(&mut zeros);
        refused
    }

    /// What `q` finished; `wait`: block for at least one, when any is in
    /// flight. A write is marked again whether it succeeded or not (part of
    /// it may have reached the storage); one that did not is the caller's to
    /// run with [`Export::write`], which reports the error. On an error of
    /// io_getevents what came back before it is in `out`, marked; what is
    /// still in flight was marked when submitted.
    pub(super) fn reap_direct<T>(
        &self,
        q: &mut DirectQueue<T>,
        out: &mut Vec<DirectDone<T>>,
        wait: bool,
    ) -> std::io::Result<()> {
        let from = out.len();
        let r = q.reap(out, wait);
        for d in &mut out[from..] {
            d.op.offset -= self.window.offset;
            if !d.op.write {
                continue;
            }
            let (offset, len) = (d.op.offset, d.op.len as u64);
            self.mark(offset, len);
            if d.done {
                self.written(self.at(offset), len);
            }
        }
        r
    }

    /// Marks a change whose storage call is not a scope here (a write in
    /// flight in the kernel): the Change marks once, as it is dropped.
    fn mark(&self, offset: u64, len: u64) {
        drop(Change {
            tracker: self.tracker.as_deref(),
            dirty: &self.dirty,
            offset,
            len,
        });
    }

    /// The page cache of the `len` bytes at `offset`, but for the first
    /// `head` (already at hand: [`Mapped::write_head`]), mapped to receive
    /// a write straight from the socket; None: write the ordinary way.
    pub(super) fn map_write(&self, offset: u64, len: u64, head: u64) -> Option<Mapped<'_>> {
        // The payload is not seen before it lands: zero detection needs it.
        if self.detects_zeroes(None) {
            return None;
        }
        let pages = self
            .target
            .map_write(self.at(offset + head), usize::try_from(len - head).ok()?);
        self.note_caps();
        Some(Mapped {
            pages: pages?,
            export: self,
            offset: self.at(offset),
            len,
            head,
            change: self.change(offset, len),
        })
    }

    /// NBD_CMD_WRITE_ZEROES.
    pub(super) fn zero(
        &self,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
        fua: bool,
    ) -> Result<(), Failure> {
        if len == 0 {
            return Ok(());
        }
        let flags = ZeroFlags {
            may_trim: flags.may_trim && self.serving.may_unmap(),
            ..flags
        };
        let change = self.change(offset, len);
        let outcome = self.target.zero(self.at(offset), len, flags);
        self.note_caps();
        let outcome = outcome.map_err(self.failed(ZERO_OP))?;
        trace!("zero used {:?}", outcome.methods);
        self.holes_made();
        drop(change);
        if fua {
            return self.fua("write zeroes (FUA flush)", "write zeroes (FUA)");
        }
        Ok(())
    }

    /// Whether a WRITE_ZEROES with `flags` is one extent call the storage is
    /// known to answer (`Target::zero_is_one_call`) and nothing else: no
    /// FUA flush to wait for, no changed-block marks to record.
    pub(super) fn zero_is_one_call(&self, flags: ZeroFlags, fua: bool) -> bool {
        let flags = ZeroFlags {
            may_trim: flags.may_trim && self.serving.may_unmap(),
            ..flags
        };
        !fua && self.tracker.is_none() && self.target.zero_is_one_call(flags)
    }

    /// NBD_CMD_TRIM. Advisory: "not supported" is success (and the spec
    /// reserves ENOTSUP for fast zero).
    pub(super) fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), Failure> {
        if len == 0 || !self.trims() {
            return Ok(());
        }
        let change = self.change(offset, len);
        let trimmed = self.target.trim(self.at(offset), len);
        self.note_caps();
        match trimmed {
            Ok(()) => self.holes_made(),
            Err(e) if storage_errno(&e) == NBD_ENOTSUP => {}
            Err(e) => return Err(self.failed("trim")(e)),
        }
        drop(change);
        if fua {
            return self.fua("trim (FUA flush)", "trim (FUA)");
        }
        Ok(())
    }

    /// NBD_CMD_FLUSH: the storage, then the tracker's marks.
    pub(super) fn flush(&self) -> Result<(), Failure> {
        self.flush_storage().map_err(self.failed("flush"))?;
        self.write_behind.flushed();
        self.persist("flush")
    }

    /// FUA of a zero or trim: a flush, then the marks.
    fn fua(&self, flush_op: &'static str, persist_op: &'static str) -> Result<(), Failure> {
        self.flush_storage().map_err(self.failed(flush_op))?;
        self.persist(persist_op)
    }

    /// Every flush of the target: what returned before it started is
    /// flushed once it succeeds.
    fn flush_storage(&self) -> Result<(), rawdisk_storage::Error> {
        let at = self.dirty.flush_starts();
        self.target.flush()?;
        self.dirty.flushed(at);
        Ok(())
    }

    /// The flush at stop, when the export is writable and anything was
    /// written since the last flush that succeeded; false: skipped.
    pub(super) fn final_flush(&self) -> Result<bool, rawdisk_storage::Error> {
        if self.read_only || !self.dirty.is_dirty() {
            return Ok(false);
        }
        self.flush_storage().map(|()| true)
    }

    /// Whether anything was written since the last flush that covers it.
    #[cfg(test)]
    fn dirty(&self) -> bool {
        self.dirty.is_dirty()
    }

    /// Makes the marks durable before a FLUSH or FUA reply tells the client
    /// its data is.
    fn persist(&self, op: &'static str) -> Result<(), Failure> {
        match &self.tracker {
            Some(t) => t.persist().map_err(|e| Failure {
                op,
                cause: Cause::Persist(e),
            }),
            None => Ok(()),
        }
    }

    /// A page-cache write of `len` bytes at `offset` succeeded: perhaps
    /// start its write-back.
    fn written(&self, offset: u64, len: u64) {
        if self.write_behind.after_write(offset, len) {
            self.write_behind.start(&self.target, offset, len);
        }
    }

    /// The extents of a read of `len` bytes at `offset` worth answering
    /// with hole chunks (export of `size` bytes), or None: read it all.
    pub(super) fn holes(&self, offset: u64, len: u64, size: u64) -> Option<Vec<Extent>> {
        if !self.may_have_holes(size) {
            return None;
        }
        let t0 = Instant::now();
        let found =
            self.target
                .extents_within(self.at(offset), len, SPARSE_READ_RUNS, self.at(size));
        self.note_caps();
        if let Ok(ext) = found {
            if ext.iter().any(|e| e.kind == ExtentKind::Hole) {
                return Some(self.in_export(ext));
            }
        }
        // SEEK_HOLE walks the whole data run on tmpfs (page cache lookups
        // up to the next hole, not just this read's range): inside a long
        // run, stop asking for a while.
        if t0.elapsed() > SPARSE_LOOKUP_SLOW {
            self.sparse_skip.store(SPARSE_SKIP_READS, Ordering::Relaxed);
        }
        None
    }

    /// Whether a read is worth a hole lookup: not on block devices (no
    /// SEEK_HOLE there), not on fully allocated files (one fstat tells), not
    /// right after lookups that were slow and found only data.
    fn may_have_holes(&self, size: u64) -> bool {
        let t = &self.target;
        if t.kind() == Kind::Block {
            return false;
        }
        let skipped = self
            .sparse_skip
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1));
        if skipped.is_ok() {
            return false;
        }
        // With a window, the whole file's allocation decides: a skip
        // only costs holes served as data.
        if matches!(t.allocated_bytes(), Ok(a) if a >= self.at(size)) {
            // Fully allocated: trust that for the next reads instead of an
            // fstat per request (it showed in strace of 1 MiB reads). Holes
            // punched through this server reset the skip (`holes_made`);
            // one punched by someone else is served as data, which is
            // always a correct answer.
            self.sparse_skip.store(SPARSE_SKIP_READS, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// A trim or zero of ours may have made a hole: look again at the next
    /// read.
    fn holes_made(&self) {
        self.sparse_skip.store(0, Ordering::Relaxed);
    }

    /// Whether the target is served through the page cache (not O_DIRECT).
    pub(super) fn page_cache(&self) -> bool {
        self.target.cache_mode() == CacheMode::Writeback
    }

    /// NBD_CMD_READ of `buf.len()` bytes at `offset`.
    pub(super) fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), Failure> {
        self.target
            .read_at(buf, self.at(offset))
            .map_err(self.failed("read"))
    }

    /// Whether a read may be answered from the page cache without waiting
    /// for the device ([`Export::read_cached`]).
    pub(super) fn may_read_cached(&self) -> bool {
        self.target.may_read_cached()
    }

    /// A read answered from the page cache; false when part of it is not
    /// cached, or on an error the blocking [`Export::read`] will meet and
    /// report.
    pub(super) fn read_cached(&self, buf: &mut [u8], offset: u64) -> bool {
        matches!(self.target.read_cached(buf, self.at(offset)), Ok(true))
    }

    /// Whether reads may go to the socket through pipes: through the page
    /// cache, and splice not known to fail here.
    pub(super) fn may_splice(&self) -> bool {
        self.page_cache() && self.target.caps().get(Method::Splice).may_work()
    }

    /// Where a piece of a spliced read that starts at the export's `pos`
    /// ends: the next multiple of `piece` in the target's offsets, so that
    /// a pipe of `piece` bytes takes it whole (a window that starts off a
    /// page would otherwise need one page more than the pipe holds).
    pub(super) fn piece_end(&self, pos: u64, piece: u64) -> u64 {
        (self.at(pos) / piece + 1) * piece - self.window.offset
    }

    /// `len` bytes at `offset` into `pipe`; false: the target cannot splice
    /// (the pipe may hold part of them), copy instead.
    pub(super) fn read_to_pipe(
        &self,
        pipe: BorrowedFd<'_>,
        offset: u64,
        len: usize,
    ) -> Result<bool, Failure> {
        let r = self.target.read_to_pipe(pipe, self.at(offset), len);
        self.note_caps();
        r.map_err(self.failed("read"))
    }

    /// NBD_CMD_CACHE: a hint to read the range ahead.
    pub(super) fn cache(&self, offset: u64, len: u64) -> Result<(), Failure> {
        if len == 0 {
            return Ok(());
        }
        self.target
            .cache(self.at(offset), len)
            .map_err(self.failed("cache"))
    }

    /// base:allocation: at most `max_runs` extents from `offset` within an
    /// export of `size` bytes, or None when the lookup failed; the caller
    /// then reports data (spec: a server MAY, when the error is not the
    /// client's fault). The size is the handshake's: no fstat per request.
    pub(super) fn extents(
        &self,
        offset: u64,
        len: u64,
        max_runs: usize,
        size: u64,
    ) -> Option<Vec<Extent>> {
        let found = self
            .target
            .extents_within(self.at(offset), len, max_runs, self.at(size));
        self.note_caps();
        match found {
            Ok(ext) => Some(self.in_export(ext)),
            Err(e) => {
                debug!("block status: {e}; reporting data");
                None
            }
        }
    }

    /// Logs the target's learned capabilities once per change.
    fn note_caps(&self) {
        let caps = self.target.caps();
        let gen = caps.generation();
        let last = self.caps_logged.load(Ordering::Relaxed);
        if gen != last
            && self
                .caps_logged
                .compare_exchange(last, gen, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            debug!(
                "storage capabilities of {:?}: {}",
                self.name,
                caps.snapshot()
            );
        }
    }
}

/// Minimum and preferred block size. Through the page cache any byte range
/// works (minimum 1); under O_DIRECT the storage needs dio_align-aligned
/// I/O and serves anything else through a read-modify-write, so that is the
/// honest minimum. Preferred: the device's optimal I/O size when it is a
/// usable power of two, else 4096.
fn block_sizes(target: &Target, max_payload: u32) -> (u32, u32) {
    let g = target.geometry();
    let mut min = 1u32;
    if target.cache_mode() == CacheMode::None {
        min = g.dio_align.max(g.logical_sector).max(1);
        // Spec (Size constraints): a power of two no larger than 64 KiB.
        if !min.is_power_of_two() || min > 65536 {
            min = 4096;
        }
    }
    let floor = min.max(4096);
    let mut pref = g.opt_io.max(floor);
    if !pref.is_power_of_two() || pref > max_payload {
        pref = floor;
    }
    (min, pref)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use rawdisk_storage::{ExtentKind, OpenOptions, Target, ZeroFlags};

    use super::Export;
    use crate::server::writeback::WriteBehind;

    const MIB: usize = 1 << 20;
    const KIB64: u64 = 64 << 10;

    /// Zero detection looks at every byte, the tail past the last 16 too.
    #[test]
    fn zero_payloads_are_found_whole() {
        for len in [0, 1, 15, 16, 17, 4096, 4099] {
            let mut buf = vec![0u8; len];
            assert!(super::is_zero(&buf), "{len}");
            for at in [0, len / 2, len.saturating_sub(1)] {
                if len > 0 {
                    buf[at] = 1;
                    assert!(!super::is_zero(&buf), "{len} {at}");
                    buf[at] = 0;
                }
            }
        }
    }

    /// What a storage call learns is logged by the layer right after that
    /// call, whoever made it: the request loop has no part in it.
    #[test]
    fn capabilities_are_noted_by_the_call_that_learns_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        // 1 MiB of data, then a 1 MiB hole.
        let mut want: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8 + 1).collect();
        std::fs::write(&path, &want).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(2 * MIB as u64)
            .unwrap();
        want.resize(2 * MIB, 0);
        let target = Arc::new(Target::open(&path, &OpenOptions::default()).unwrap());
        let e = Export::new(
            "t".into(),
            target.clone(),
            false,
            WriteBehind::Off,
            32 << 20,
            (0, 0),
            None,
        );
        let noted = || e.caps_logged.load(Ordering::Relaxed);
        let g0 = target.caps().generation();
        assert_eq!(noted(), g0);

        let ext = e
            .extents(0, 2 * MIB as u64, 16, 2 * MIB as u64)
            .expect("extents");
        assert_eq!(ext.last().map(|x| x.kind), Some(ExtentKind::Hole));
        let g1 = target.caps().generation();
        assert!(g1 > g0, "the hole lookup learned nothing");
        assert_eq!(noted(), g1, "block status did not note what it learned");

        let flags = ZeroFlags {
            may_trim: true,
            fast_only: false,
        };
        e.zero(KIB64, KIB64, flags, false).expect("zero");
        let g2 = target.caps().generation();
        assert!(g2 > g1, "the zero learned nothing");
        assert_eq!(noted(), g2, "the zero did not note what it learned");

        want[KIB64 as usize..2 * KIB64 as usize].fill(0);
        assert!(std::fs::read(&path).unwrap() == want, "image differs");
    }
}
