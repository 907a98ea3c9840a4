//! `rawdisk copy`: sparse-aware, parallel copy between files, block devices
//! and NBD exports.
//!
//! The source's extents come first (SEEK_DATA/SEEK_HOLE, or BLOCK_STATUS):
//! runs known to read as zeros become zero requests on the destination (or
//! nothing, when the destination is known to be zero); data runs are read in
//! requests of `request_size`, scanned for all-zero blocks of `sparse_size`
//! (zero requests), and the rest is written. `requests` worker threads each
//! keep one request in flight, so memory is bounded by `requests ×
//! request_size` and requests complete in any order; over NBD they share
//! several connections when the server allows multi-conn.
//!
//! Every error ends the copy: the first one is returned with the side, the
//! offset and the cause, and the workers stop taking work. No error is
//! dropped (nbdcopy's CVE-2022-0485 was a copier that ignored asynchronous
//! write errors).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rawdisk_storage::{CacheMode, Prealloc};

use crate::endpoint::{self, Endpoint, EndpointOptions, IoBuf, MapExtent};

mod changed;
mod dst;
mod from_stream;
mod offload;
mod open;
mod pace;
pub mod record;
mod retry;
mod verify;

pub use changed::{copy_changed, open_changed, source_identity, Incremental};
pub use dst::Stream;
use dst::{Dst, Store, To};
pub use from_stream::{copy_from_stream, open_for_stream, StreamDestination};
pub use offload::OffloadMode;
pub use open::{open_destination, open_pair, open_pair_then, open_source, Destination};
pub use pace::{check_progress_fd, Report};
use retry::Link;
pub use verify::{verify, VerifyStats};

/// What to do with runs of the source that read as zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroMode {
    /// Zero requests that may punch holes (the default).
    #[default]
    MayTrim,
    /// Zero requests that keep the range allocated (`--allocated`, NO_HOLE).
    Allocated,
    /// Nothing: the destination already reads as zeros (`--target-is-zero`).
    Skip,
}

#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Requests in flight (worker threads); 0: 16 when a side is NBD, one
    /// per CPU between local targets through the page cache, 16 with
    /// O_DIRECT.
    pub requests: usize,
    /// NBD connections per side when the server allows multi-conn; 0: 4,
    /// at most one per CPU (nbdcopy's rule: more only add server threads
    /// writing the same file; docs/benchmarks.md, Copy).
    pub connections: usize,
    /// Bytes per read/write request; 0: 512 KiB when a side is NBD, 2 MiB
    /// between local targets (see `request_size`).
    pub request_size: u64,
    /// Granularity of the zero scan of data (0 disables it).
    pub sparse_size: u64,
    pub zero_mode: ZeroMode,
    /// For a file destination that is created or grown.
    pub preallocation: Prealloc,
    pub flush: bool,
    pub cache: CacheMode,
    /// Progress: none, `-p` (a bar on a terminal, else a line every few
    /// seconds) or `--progress=FD`.
    pub report: Report,
    /// Bytes of data per second at most (qemu-img convert -r); 0: no limit.
    pub rate_limit: u64,
    /// Reflink or copy_file_range between local files (see offload.rs).
    pub offload: OffloadMode,
    /// Shrink an existing regular file larger than the source.
    pub force: bool,
    /// `-n`: the destination exists and is never grown (qemu-img convert -n).
    pub no_create: bool,
    /// Set (by a signal handler) to stop handing out work: the copy then
    /// ends with [`CopyError::Interrupted`].
    pub cancel: Option<Arc<AtomicBool>>,
    /// How long to keep reconnecting an NBD side whose connection broke
    /// (zero: the error ends the copy).
    pub retry_timeout: Duration,
    /// An NBD connection whose server has not answered for this long while
    /// requests wait counts as dropped (zero: wait forever); also bounds
    /// each connect and handshake.
    pub request_timeout: Duration,
    /// `-f raw`: copy a source that looks like another image format as raw.
    pub raw: bool,
    /// `--no-extents` (nbdcopy's): the source's extents are not asked for;
    /// all of it is read, zero blocks still found by `sparse_size`.
    pub no_extents: bool,
}

impl CopyOptions {
    /// How to open (and reopen) a side.
    pub(crate) fn endpoint_options(&self, writable: bool) -> EndpointOptions {
        let t = (!self.request_timeout.is_zero()).then_some(self.request_timeout);
        EndpointOptions {
            writable,
            cache: self.cache,
            connections: match self.connections {
                0 => std::thread::available_parallelism().map_or(4, |n| n.get().min(4)),
                n => n,
            },
            connect_timeout: t,
            request_timeout: t,
            extra_contexts: Vec::new(),
            // A source tells its checkpoints' identities, for the backup
            // record (nothing from a server without changed-block tracking).
            list_contexts: if writable {
                Vec::new()
            } else {
                vec![record::CHECKPOINT_QUERY.to_string()]
            },
            raw: self.raw,
        }
    }
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            requests: 0,
            connections: 0,
            request_size: 0,
            sparse_size: 4096,
            zero_mode: ZeroMode::MayTrim,
            preallocation: Prealloc::Off,
            flush: true,
            cache: CacheMode::Writeback,
            report: Report::None,
            rate_limit: 0,
            offload: OffloadMode::Auto,
            force: false,
            no_create: false,
            cancel: None,
            retry_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
            raw: false,
            no_extents: false,
        }
    }
}

/// What a copy did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyStats {
    pub size: u64,
    pub bytes_read: u64,
    /// Written by this process (read, then written).
    pub bytes_written: u64,
    /// Moved by FICLONERANGE: the destination shares the source's blocks.
    pub bytes_reflinked: u64,
    /// Moved by copy_file_range (the kernel's copy).
    pub bytes_copy_range: u64,
    /// Zero requests sent to the destination.
    pub bytes_zeroed: u64,
    /// Zero runs not touched because the destination already reads as zeros.
    pub bytes_skipped: u64,
    /// NBD connections reopened after they broke (both sides).
    pub reconnects: u64,
    /// `--changed-since`: the bytes of the ranges that changed (the only
    /// ones copied); None for a whole copy.
    pub changed: Option<u64>,
    pub elapsed: Duration,
}

impl CopyStats {
    pub fn throughput(&self) -> f64 {
        self.changed.unwrap_or(self.size) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Destination => "destination",
        })
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum CopyError {
    /// An operation failed on one side: `{side} {endpoint}: {op} at offset…: {cause}`.
    #[error("{side} {0}", .error)]
    Io { side: Side, error: endpoint::Error },
    /// The sides cannot be copied (sizes, options).
    #[error("{0}")]
    Setup(String),
    /// `--verify` found a difference.
    #[error("verify: {0}")]
    Mismatch(String),
    /// [`CopyOptions::cancel`] was set: `done` bytes of `size` were copied
    /// (not necessarily a prefix), and nothing was flushed.
    #[error("interrupted after {done} of {size} bytes")]
    Interrupted { done: u64, size: u64 },
}

impl CopyError {
    fn io(side: Side) -> impl Fn(endpoint::Error) -> CopyError {
        move |error| CopyError::Io { side, error }
    }
}

pub type Result<T> = std::result::Result<T, CopyError>;

/// Opens both sides and copies: the command's whole job, `--verify` aside.
pub fn copy(source: &str, destination: &str, opts: &CopyOptions) -> Result<CopyStats> {
    let (src, dst) = open_pair(source, destination, opts)?;
    let stats = copy_endpoints(&src, &dst.endpoint, opts, dst.zeroed)?;
    close_both(&src, &dst.endpoint)?;
    Ok(stats)
}

fn close_both(src: &Endpoint, dst: &Endpoint) -> Result<()> {
    src.close().map_err(CopyError::io(Side::Source))?;
    dst.close().map_err(CopyError::io(Side::Destination))
}

/// Passes of a copy whose destination reconnects during each before it
/// gives up (each pass is copied again whole, see `run`).
const MAX_PASSES: u32 = 3;

/// One unit of work.
#[derive(Debug, Clone, Copy)]
enum Work {
    Zero { offset: u64, len: u64 },
    Data { offset: u64, len: u64 },
}

/// The first error any worker hit; later ones are only logged. Workers stop
/// taking work once it is set.
#[derive(Default)]
struct FirstError {
    failed: AtomicBool,
    first: Mutex<Option<CopyError>>,
}

impl FirstError {
    fn set(&self, e: CopyError) {
        self.failed.store(true, Ordering::SeqCst);
        let mut g = self.first.lock().unwrap();
        if g.is_none() {
            *g = Some(e);
        } else {
            tracing::debug!(error = %e, "further copy error after the first");
        }
    }

    fn is_set(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    fn into_inner(self) -> Option<CopyError> {
        self.first.into_inner().unwrap()
    }
}

/// The next piece of work for a worker: None when the plan is done or a
/// worker failed (a failure to map the source is recorded as the error).
fn next_work(
    planner: &Mutex<Planner<'_>>,
    errors: &FirstError,
    cancel: Option<&AtomicBool>,
) -> Option<Work> {
    if errors.is_set() || cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
        return None;
    }
    match planner.lock().unwrap().next() {
        Ok(w) => w,
        Err(e) => {
            errors.set(CopyError::Io {
                side: Side::Source,
                error: e,
            });
            None
        }
    }
}

/// Hands out work in offset order from the source's extents, fetched lazily.
struct Planner<'a> {
    src: &'a Link<'a>,
    size: u64,
    pos: u64,
    queue: VecDeque<MapExtent>,
    /// The only ranges to copy (`--changed-since`), in offset order; None:
    /// the whole source.
    only: Option<VecDeque<(u64, u64)>>,
    data_chunk: u64,
    zero_chunk: u64,
    /// How far the next refill maps the source.
    ahead: u64,
    /// While it may work, data goes out in pieces of `OFFLOAD_CHUNK`.
    offload: Option<&'a offload::Offload<'a>>,
    /// `--no-extents`: every range is data to read.
    no_extents: bool,
}

impl<'a> Planner<'a> {
    fn new(src: &'a Link<'a>, data_chunk: u64, zero_chunk: u64) -> Self {
        Planner {
            src,
            size: src.first.size(),
            pos: 0,
            queue: VecDeque::new(),
            only: None,
            data_chunk,
            zero_chunk,
            ahead: 64 << 20,
            offload: None,
            no_extents: false,
        }
    }

    fn next(&mut self) -> std::result::Result<Option<Work>, endpoint::Error> {
        if self.queue.is_empty() {
            // Look ahead far enough that the lock is rarely taken for I/O,
            // but start small: mapping a whole sparse image first kept every
            // worker waiting (docs/benchmarks.md, Copy).
            let ahead = self.ahead;
            self.ahead = (ahead * 4).min(8 << 30);
            if let Some(only) = &mut self.only {
                let Some((o, l)) = only.pop_front() else {
                    return Ok(None);
                };
                let end = o + l.min(ahead);
                let runs = self.src.with(|e| e.extents(o, end - o))?;
                let p = crate::scan::queue_runs(&mut self.queue, o, end, runs);
                if p < o + l {
                    only.push_front((p, o + l - p));
                }
            } else {
                if self.pos >= self.size {
                    return Ok(None);
                }
                let (pos, len) = (self.pos, (self.size - self.pos).min(ahead));
                let runs = if self.no_extents {
                    vec![endpoint::MapExtent {
                        offset: pos,
                        len,
                        data: true,
                        zero: false,
                    }]
                } else {
                    self.src.with(|e| e.extents(pos, len))?
                };
                self.pos = crate::scan::queue_runs(&mut self.queue, pos, self.size, runs);
            }
        }
        let data_chunk = match self.offload {
            Some(o) if o.may_work() => offload::OFFLOAD_CHUNK.max(self.data_chunk),
            _ => self.data_chunk,
        };
        let e = self.queue.front_mut().expect("refilled");
        let (chunk, zero) = if e.zero {
            (self.zero_chunk, true)
        } else {
            (data_chunk, false)
        };
        // Keep data requests aligned to the chunk size in the export, so an
        // extent boundary does not misalign every following request.
        let len = if zero {
            e.len.min(chunk)
        } else {
            let to_boundary = chunk - e.offset % chunk;
            e.len.min(to_boundary)
        };
        let w = if zero {
            Work::Zero {
                offset: e.offset,
                len,
            }
        } else {
            Work::Data {
                offset: e.offset,
                len,
            }
        };
        e.offset += len;
        e.len -= len;
        if e.len == 0 {
            self.queue.pop_front();
        }
        Ok(Some(w))
    }
}

#[derive(Default)]
pub(super) struct Counters {
    /// Work items finished, in bytes of the source.
    pub(super) done: AtomicU64,
    pub(super) read: AtomicU64,
    pub(super) written: AtomicU64,
    pub(super) reflinked: AtomicU64,
    pub(super) copy_range: AtomicU64,
    pub(super) zeroed: AtomicU64,
    pub(super) skipped: AtomicU64,
}

/// Copies `src` onto `dst` (already open, `dst` at least as large).
/// `dst_zeroed`: the destination is known to read as zeros.
pub fn copy_endpoints(
    src: &Endpoint,
    dst: &Endpoint,
    opts: &CopyOptions,
    dst_zeroed: bool,
) -> Result<CopyStats> {
    run(src, To::Ep(dst), opts, dst_zeroed, None)
}

/// Reads the source and discards it (`null:`): the source's throughput.
pub fn copy_to_null(src: &Endpoint, opts: &CopyOptions) -> Result<CopyStats> {
    run(src, To::Null, opts, true, None)
}

/// Writes the source to a byte stream in order (`-`: standard output),
/// zero runs as zeros.
pub fn copy_to_stream(src: &Endpoint, out: &Stream, opts: &CopyOptions) -> Result<CopyStats> {
    run(src, To::Stream(out), opts, false, None)
}

/// `only`: copy just these ranges (offset order, not overlapping).
fn run(
    src: &Endpoint,
    to: To<'_>,
    opts: &CopyOptions,
    dst_zeroed: bool,
    only: Option<&[(u64, u64)]>,
) -> Result<CopyStats> {
    let t0 = Instant::now();
    let eopts = |writable| opts.endpoint_options(writable);
    let mut src_link = Link::new(src, Side::Source, eopts(false), opts.retry_timeout);
    let mut dst_link = match to {
        To::Ep(e) => Some(Link::new(
            e,
            Side::Destination,
            eopts(true),
            opts.retry_timeout,
        )),
        _ => None,
    };
    let changed = only.map(|r| r.iter().map(|r| r.1).sum::<u64>());
    let pace = pace::Pace::new(opts, changed.unwrap_or(src.size()))
        .map_err(|e| CopyError::Setup(e.to_string()))?;
    let bar = pace.bar.clone();
    src_link.set_bar(bar.as_ref());
    if let Some(l) = &mut dst_link {
        l.set_bar(bar.as_ref());
    }
    let dst = match (to, &dst_link) {
        (_, Some(l)) => Dst::Ep(l),
        (To::Stream(s), _) => Dst::Stream(s),
        _ => Dst::Null,
    };
    let size = src.size();
    if let Some(d) = dst.size().filter(|&d| d < size) {
        if let Some(b) = &bar {
            b.finish_and_clear();
        }
        return Err(CopyError::Setup(format!(
            "destination {} is {d} bytes, smaller than the source ({size} bytes)",
            dst.name(),
        )));
    }
    let align = src.min_block().max(dst.min_block());
    let request = request_size(src, &dst, opts);
    // Into nothing or a stream, zero blocks cost the same as data: no scan.
    let sparse = if opts.sparse_size == 0 || dst.endpoint().is_none() {
        0
    } else {
        opts.sparse_size.max(align).min(request)
    };
    let skip_zero = match opts.zero_mode {
        _ if matches!(dst, Dst::Stream(_)) => false,
        ZeroMode::Skip => true,
        ZeroMode::MayTrim => dst_zeroed,
        ZeroMode::Allocated => false,
    };
    let may_trim = opts.zero_mode != ZeroMode::Allocated;
    // Memory is workers × request: keep it under 1 GiB whatever the options.
    let wanted = match opts.requests {
        // 16 x 2 MiB: what qemu-img convert -m 16 keeps in flight; 32 MiB.
        0 if src.is_nbd() || dst.is_nbd() => 16,
        // Through the page cache a local copy is memcpy and page
        // allocation: one worker per CPU is fastest, more only fight over
        // the destination inode's lock (docs/benchmarks.md, Copy). O_DIRECT
        // waits on the device: keep a queue.
        0 if opts.cache == CacheMode::None => 16,
        0 => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .clamp(2, 16),
        n => n,
    };
    let workers = match dst {
        // In order, so one at a time.
        Dst::Stream(_) => 1,
        _ => wanted.clamp(1, ((1u64 << 30) / request).max(1) as usize),
    };
    let counters = Counters::default();
    tracing::debug!(
        size,
        request,
        sparse,
        workers,
        skip_zero,
        may_trim,
        "copy {} -> {}",
        src.name(),
        dst.name()
    );

    // A rate limit paces every byte this process moves: no kernel copy.
    let offload = dst
        .endpoint()
        .filter(|_| opts.rate_limit == 0)
        .and_then(|d| offload::Offload::new(src, d, opts, sparse));
    // Locally a zero run is one fallocate however long. An NBD server
    // punches a long run on one thread while the other workers idle at the
    // tail of the image: in 32 MiB pieces (qemu-img's) they run beside the
    // writes and each other (docs/benchmarks.md, Copy).
    let zero_chunk = if dst.is_nbd() { 32 << 20 } else { 1 << 30 };
    // A destination that reconnected may have dropped writes it had
    // acknowledged on the lost connection and not flushed (a server that
    // keeps them in its own memory, a host that crashed): only the requests
    // that failed are sent again. A pass during which it reconnected is run
    // again whole over the new connection, whose final flush then covers
    // every write of that pass.
    let dst_reconnects = || dst_link.as_ref().map_or(0, |l| l.reconnects());
    let worker = Worker {
        src: &src_link,
        dst,
        offload: offload.as_ref(),
        request,
        sparse,
        skip_zero,
        may_trim,
        c: &counters,
    };
    let mut passes = 0;
    let errors = loop {
        passes += 1;
        let before = dst_reconnects();
        let errors = FirstError::default();
        let mut planner = Planner::new(&src_link, request, zero_chunk);
        planner.offload = offload.as_ref();
        planner.no_extents = opts.no_extents;
        planner.only = only.map(|r| r.iter().copied().collect());
        worker.pass(&Mutex::new(planner), &errors, workers, align, opts, &pace);
        let stopped = opts
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed));
        if errors.is_set() || stopped {
            break errors;
        }
        // A stream is always flushed: its buffer holds the last bytes.
        if opts.flush || matches!(dst, Dst::Stream(_)) {
            if let Err(e) = dst.flush() {
                errors.set(CopyError::io(Side::Destination)(e));
                break errors;
            }
        }
        if dst_reconnects() == before {
            break errors;
        }
        if passes == MAX_PASSES {
            errors.set(CopyError::Setup(format!(
                "destination {} reconnected during each of {MAX_PASSES} passes of the copy: \
                 what it acknowledged before each reconnect may not have been kept",
                dst.name()
            )));
            break errors;
        }
        tracing::warn!(
            "destination {} reconnected during the copy: copying again over the new \
             connection, since writes it acknowledged before may not have been kept",
            dst.name()
        );
        // The progress and an interruption's count are of the pass running.
        counters.done.store(0, Ordering::Relaxed);
        pace.again();
    };
    let cancelled = opts
        .cancel
        .as_ref()
        .is_some_and(|c| c.load(Ordering::Relaxed));
    if let Some(b) = &bar {
        if cancelled {
            // Leave the bar where it stopped, then a new line for the message.
            b.abandon();
        } else {
            b.finish_and_clear();
        }
    }
    if let Some(e) = errors.into_inner() {
        return Err(e);
    }
    if cancelled {
        return Err(CopyError::Interrupted {
            done: counters.done.into_inner(),
            size: changed.unwrap_or(size),
        });
    }
    src_link
        .close_reconnected()
        .map_err(CopyError::io(Side::Source))?;
    if let Some(l) = &dst_link {
        l.close_reconnected()
            .map_err(CopyError::io(Side::Destination))?;
    }
    pace.complete();
    let reconnects = src_link.reconnects() + dst_link.as_ref().map_or(0, |l| l.reconnects());
    Ok(CopyStats {
        size,
        bytes_read: counters.read.into_inner(),
        bytes_written: counters.written.into_inner(),
        bytes_reflinked: counters.reflinked.into_inner(),
        bytes_copy_range: counters.copy_range.into_inner(),
        bytes_zeroed: counters.zeroed.into_inner(),
        bytes_skipped: counters.skipped.into_inner(),
        reconnects,
        changed,
        elapsed: t0.elapsed(),
    })
}

/// The request size for this pair: the option or the default for the pair,
/// within both sides' maximum and a multiple of both sides' minimum block.
fn request_size(src: &Endpoint, dst: &Dst<'_>, opts: &CopyOptions) -> u64 {
    let align = src.min_block().max(dst.min_block());
    let max_io = src.max_io().min(dst.max_io());
    let wanted = match opts.request_size {
        // Through NBD the bytes in flight count, not the requests: 16 x 512
        // KiB keeps the client's buffers, the socket's and the server's
        // within the CPU cache, where 16 x 2 MiB spilled (docs/benchmarks.md,
        // Copy). The server's maximum still caps it.
        0 if src.is_nbd() || dst.is_nbd() => 512 << 10,
        // Locally fewer, bigger requests: fewer syscalls and file system
        // lock round trips (one worker per CPU keeps the bytes in flight low).
        0 => 2 << 20,
        n => n,
    };
    // Under a rate limit, requests of a quarter second's bytes keep the
    // pace even and a signal answered soon.
    let wanted = match opts.rate_limit {
        0 => wanted,
        rate => wanted.min((rate / 4).max(64 << 10)),
    };
    let r = wanted.clamp(align.max(4096), max_io.max(align));
    r - r % align
}

/// What every worker of one copy shares.
struct Worker<'a> {
    src: &'a Link<'a>,
    dst: Dst<'a>,
    offload: Option<&'a offload::Offload<'a>>,
    request: u64,
    sparse: u64,
    skip_zero: bool,
    may_trim: bool,
    c: &'a Counters,
}

impl Worker<'_> {
    /// One pass over the plan: `workers` threads take work until it is done,
    /// a worker fails (the error in `errors`) or the copy is cancelled.
    fn pass(
        &self,
        planner: &Mutex<Planner<'_>>,
        errors: &FirstError,
        workers: usize,
        align: u64,
        opts: &CopyOptions,
        pace: &pace::Pace,
    ) {
        let (dst, counters) = (&self.dst, self.c);
        std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(|| {
                    let mut buf = IoBuf::new(self.request as usize, align.max(4096) as usize);
                    while let Some(w) = next_work(planner, errors, opts.cancel.as_deref()) {
                        let r = match w {
                            Work::Zero { offset, len } => if self.skip_zero {
                                counters.skipped.fetch_add(len, Ordering::Relaxed);
                                Ok(())
                            } else {
                                dst.zero(offset, len, self.may_trim)
                                    .map(|_| {
                                        counters.zeroed.fetch_add(len, Ordering::Relaxed);
                                    })
                                    .map_err(CopyError::io(Side::Destination))
                            }
                            .map(|_| len),
                            Work::Data { offset, len } => {
                                pace.throttle(len);
                                self.data(&mut buf, offset, len).map(|_| {
                                    if opts.flush {
                                        dst.start_writeback(offset, len);
                                    }
                                    len
                                })
                            }
                        };
                        match r {
                            Ok(n) => {
                                counters.done.fetch_add(n, Ordering::Relaxed);
                                pace.advance(n);
                            }
                            Err(e) => {
                                errors.set(e);
                                break;
                            }
                        }
                    }
                });
            }
        });
    }

    /// A data run: offloaded where it can be, the rest read and written in
    /// requests (aligned in the export, as the planner hands them out).
    fn data(&self, buf: &mut IoBuf, offset: u64, len: u64) -> Result<()> {
        let rest = match self.offload {
            Some(o) if o.may_work() => {
                let r = o
                    .copy(offset, len)
                    .map_err(CopyError::io(Side::Destination))?;
                let c = self.c;
                c.reflinked.fetch_add(r.reflinked, Ordering::Relaxed);
                c.copy_range.fetch_add(r.copied, Ordering::Relaxed);
                r.rest
            }
            _ => vec![(offset, len)],
        };
        for (o, l) in rest {
            let end = o + l;
            let mut p = o;
            while p < end {
                let n = (end - p).min(self.request - p % self.request);
                self.copy_data(buf, p, n)?;
                p += n;
            }
        }
        Ok(())
    }

    fn copy_data(&self, buf: &mut IoBuf, offset: u64, len: u64) -> Result<()> {
        let (src, dst, c) = (self.src, self.dst, self.c);
        let (sparse, skip_zero, may_trim) = (self.sparse, self.skip_zero, self.may_trim);
        buf.set_len(len as usize);
        src.with(|e| e.read_buf(buf, offset))
            .map_err(CopyError::io(Side::Source))?;
        c.read.fetch_add(len, Ordering::Relaxed);
        Store {
            dst,
            sparse,
            skip_zero,
            may_trim,
            c,
        }
        .put(buf.as_slice(), offset)
    }
}
