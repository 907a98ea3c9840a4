//! The transmission phase of one connection. The reader's scheduling in
//! one file on purpose: its rules and its two waits hold only together; the
//! reply writer is in `writer.rs`, what a request holds until its reply is
//! sent (slots, byte budgets) and how the reader takes it in `permits.rs`.
//!
//! The connection's task is the [`Reader`]: for each request it takes the
//! permits, receives the header and payload, and schedules the request: run
//! right here, gathered with other small ones into a [`Batch`] for one
//! blocking job, or handed to the blocking pool alone; under cache=none the
//! small reads and writes of a batch go to the kernel instead (Linux AIO,
//! `inkernel.rs`). A writer task sends the replies of the blocking jobs in
//! completion order.
//!
//! The reader waits in two places, both of which first hand the held batch
//! to the blocking pool (held requests own slots and bytes the wait may
//! need): [`Batch::wait`] between requests, raced against shutdown, and
//! [`Batch::hold`] for what a request already read needs (a permit, the rest
//! of its payload), which shutdown does not interrupt: every request whose
//! header was read is answered. Everything else the reader does completes
//! from what is already buffered, except writing the reply of a request it
//! ran itself, which happens with nothing held.
//!
//! Shutting down, the reader goes on reading while requests keep coming and
//! answers each new one with NBD_ESHUTDOWN (spec: Terminating the
//! transmission phase), dropping its payload; it stops once the socket has
//! been quiet for DRAIN_QUIET with nothing in flight.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, error, info, trace, Instrument};

mod inkernel;
mod permits;
mod writer;

use super::buffers::{Input, DATA_ALIGN, READ_AHEAD};
use super::command::{
    execute, execute_zeros, failure, quick_status, read_cached, small_error, small_ok, validate,
    whole, zero_flags, Encoded,
};
use super::limits::Counters;
use super::{protocol_error, Session, Shared};
use crate::proto::*;
use crate::sock::RawSock;
use inkernel::InKernel;
pub(super) use permits::reserve_per_conn;
use permits::{slot_only, Permits, TLS_UNSENT_CONN};
use writer::{put_reply, within, writer, Out};

/// At most this many small requests run as one blocking job...
const BATCH_MAX: usize = 16;
/// ...and only reads and writes up to this length.
const BATCH_MAX_LEN: u64 = 64 << 10;
/// Page-cache writes of at least this many bytes are received straight into
/// the target's mapped page cache (`Target::map_write`): one copy instead of
/// two, and no trip through the blocking pool.
const MAP_WRITE_MIN: u64 = 64 << 10;
/// Largest read or write run on the connection's reader when it is alone
/// (qemu-img convert writes 2 MiB at a time).
const INLINE_MAX_LEN: u64 = 4 << 20;
/// Largest page-cache write run on the reader while others are in flight:
/// up to here the payload is still in the receiving CPU's cache; above it,
/// receiving one payload while the pool writes another is worth more
/// (docs/benchmarks.md, Write path).
const OWN_WRITE_MAX: u64 = 256 << 10;
/// The same over TLS, where the reader has just decrypted the payload on
/// this CPU: handing a 1 MiB write to a blocking thread cost more than it
/// overlapped (docs/benchmarks.md, TLS).
const OWN_WRITE_MAX_TLS: u64 = 1 << 20;
/// How much a look for a queued request may read after a big payload: a
/// header and a little of its payload, which then costs one extra copy.
const PEEK_AHEAD: usize = 4 << 10;
/// Shutting down, the reader stops once no byte has arrived for this long
/// with nothing in flight; requests arriving before that get NBD_ESHUTDOWN.
const DRAIN_QUIET: Duration = Duration::from_millis(200);
/// Write payloads over the maximum but at most this long are read and
/// dropped before the EINVAL, so the connection goes on (libnbd sends up to
/// 64 MiB and matches a reply only to a request it finished sending).
const OVERSIZED_SKIP_MAX: u64 = 64 << 20;
const NEVER_CLOSED: &str = "semaphore never closed";
/// Queued zeros that continue each other run as one storage call of at most
/// this many bytes (`execute_zeros`): the first of them waits for all.
const ZERO_MERGE_MAX: u64 = 64 << 20;
/// A validated request with everything it needs to run.
struct Job {
    req: Request,
    to: ReplyTo,
    data: Option<(Vec<u8>, usize, usize)>,
    permits: Permits,
}

/// Ok(None): the connection ends without an error (shutdown, the client
/// hung up between requests or mid-payload, or sent NBD_CMD_DISC).
type Step<T> = io::Result<Option<T>>;

/// End of input: a clean end when the peer closed, else the error.
fn ended<T>(e: io::Error) -> Step<T> {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        Ok(None)
    } else {
        Err(e)
    }
}

/// Runs the transmission phase until the client disconnects, the
/// connection fails or shutdown is requested; then waits until every
/// request in flight has its reply written.
pub(super) async fn transmission<R, W>(
    sh: Arc<Shared>,
    rd: Input<R>,
    wr: BufWriter<W>,
    s: Session,
    sink: Option<RawSock>,
    shutdown: watch::Receiver<bool>,
    counters: &Arc<Counters>,
) -> io::Result<()>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let s = Arc::new(s);
    // Unbounded is safe: every message holds a request slot, so at most
    // max_requests_per_conn messages exist.
    // Boxed: the channel allocates its first block of 32 messages up front,
    // 4.3 KiB of every idle connection unboxed.
    let (tx, rx) = mpsc::unbounded_channel::<Box<Out>>();
    // Shared by the writer task (replies from blocking threads) and the
    // reader (replies of requests it ran itself); the lock keeps replies
    // from interleaving on the socket.
    let wr = Arc::new(tokio::sync::Mutex::new(wr));
    let writer = writer(wr.clone(), rx, sh.clone(), sink.clone(), counters.clone());
    let writer = tokio::spawn(writer.in_current_span());
    let ext = s.mode.extended();
    // No raw socket to splice to: the stream is TLS.
    let own_write_max = if sink.is_some() {
        OWN_WRITE_MAX
    } else {
        OWN_WRITE_MAX_TLS
    };
    let mut reader = Reader {
        slots: Arc::new(Semaphore::new(sh.cfg.max_requests_per_conn)),
        max_slots: sh.cfg.max_requests_per_conn,
        draining: false,
        conn_bytes: Arc::new(Semaphore::new(sh.bytes_per_conn)),
        reserve: Arc::new(Semaphore::new(sh.reserve_per_conn)),
        conn_unsent: sink
            .is_none()
            .then(|| Arc::new(Semaphore::new(TLS_UNSENT_CONN))),
        batch: Batch {
            // Allocated by the first batch: idle connections hold none.
            jobs: Vec::new(),
            in_kernel: None,
            start_in_kernel: {
                let out = (wr.clone(), sink.clone(), counters.clone());
                Box::new(move |sh, s, tx| {
                    let (wr, sink, counters) = out.clone();
                    let out = inkernel::Direct { wr, sink, counters };
                    InKernel::start(sh, s, tx, out)
                })
            },
            zeros: Arc::default(),
            sh: sh.clone(),
            s: s.clone(),
            tx,
            shutdown,
        },
        sh,
        s,
        rd,
        wr,
        sink,
        counters: counters.clone(),
        ext,
        hlen: request_header_len(ext),
        read_ahead: READ_AHEAD,
        own_write_max,
    };
    let mut result = reader.run().await;
    // In-flight requests hold clones of tx: the writer ends after their
    // replies are sent. The read half stays open until then.
    let Reader { batch, .. } = reader;
    batch.close();
    match writer.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            if result.is_ok() {
                result = Err(e);
            }
        }
        Err(e) => {
            if result.is_ok() {
                result = Err(io::Error::other(e));
            }
        }
    }
    result
}

type StartInKernel = Box<
    dyn Fn(&Arc<Shared>, &Arc<Session>, &mpsc::UnboundedSender<Box<Out>>) -> Option<Arc<InKernel>>
        + Send
        + Sync,
>;

/// Requests gathered to run as one blocking job, and the reader's ways to
/// wait.
struct Batch {
    jobs: Vec<Job>,
    /// Under cache=none, reads and writes in flight in the kernel; made by
    /// the first batch (Some(None): not available, the pool serves).
    in_kernel: Option<Option<Arc<InKernel>>>,
    /// Makes the queue and its reaper, which writes to the connection.
    start_in_kernel: StartInKernel,
    /// WRITE_ZEROES waiting for the connection's zeroing job.
    zeros: Arc<Mutex<ZeroLine>>,
    sh: Arc<Shared>,
    s: Arc<Session>,
    tx: mpsc::UnboundedSender<Box<Out>>,
    shutdown: watch::Receiver<bool>,
}

impl Batch {
    /// Where the reader waits between requests: hands the held requests to
    /// the blocking pool first, since they hold slots and bytes the wait may
    /// need, then waits for `fut` (cancel-safe) or shutdown (None).
    async fn wait<T>(&mut self, fut: impl Future<Output = T>) -> Option<T> {
        self.dispatch();
        tokio::select! {
            v = fut => Some(v),
            _ = self.shutdown.wait_for(|v| *v) => None,
        }
    }

    /// Where the reader waits for what a request already read needs: like
    /// `wait`, but shutdown does not interrupt it (the request is answered;
    /// the server's shutdown grace bounds the wait).
    async fn hold<T>(&mut self, fut: impl Future<Output = T>) -> T {
        self.dispatch();
        fut.await
    }

    /// Holds a small request back for the next blocking job.
    fn push(&mut self, job: Job) {
        self.jobs.push(job);
        if self.jobs.len() >= BATCH_MAX {
            self.dispatch();
        }
    }

    /// Sends `job` to the blocking pool on its own, behind what is held.
    fn alone(&mut self, job: Job) {
        self.dispatch();
        self.jobs.push(job);
        self.dispatch();
    }

    /// Queues a WRITE_ZEROES for the connection's zeroing job, starting it
    /// unless it runs. Zeros of one file serialise in the kernel (fallocate
    /// takes the inode lock on tmpfs, ext4 and XFS, the invalidate lock on
    /// block devices): one job per zero only added a thread wake-up and lock
    /// contention to each (docs/benchmarks.md, NO_HOLE zeros).
    fn zero(&mut self, job: Job) {
        self.dispatch();
        let mut line = lock(&self.zeros);
        line.queue.push_back(job);
        if line.running {
            return;
        }
        line.running = true;
        drop(line);
        let (sh, s, tx, zeros) = (
            self.sh.clone(),
            self.s.clone(),
            self.tx.clone(),
            self.zeros.clone(),
        );
        // The storage calls run under `caught`: a panic there would leave
        // `running` set and the queued zeros unanswered for good.
        tokio::task::spawn_blocking(move || loop {
            let run = {
                let mut line = lock(&zeros);
                let run = line.next_run();
                if run.is_empty() {
                    line.running = false;
                    return;
                }
                run
            };
            let reqs: Vec<_> = run.iter().map(|j| (j.req, j.to)).collect();
            let replies =
                caught(&sh, &s, &reqs, || execute_zeros(&sh, &s, &reqs)).unwrap_or_else(|eio| eio);
            for (j, reply) in run.into_iter().zip(replies) {
                let _ = tx.send(Box::new(Out {
                    reply,
                    _permits: j.permits.produced(),
                }));
            }
        });
    }

    /// Hands the held requests to one blocking thread, which runs them in
    /// order and queues each reply as soon as it is done. Through the page
    /// cache, small writes and the reads it holds run here instead, up to the
    /// first read that would wait for the device: copying a few KiB costs
    /// less than waking a pool thread and putting it back to sleep, which
    /// was most of the server's time at 4 KiB (docs/benchmarks.md, Write
    /// path). Under cache=none the small reads and writes go to the kernel
    /// together (`inkernel.rs`). The rest keeps its order on the pool.
    fn dispatch(&mut self) {
        if self.jobs.is_empty() {
            return;
        }
        let jobs = std::mem::replace(&mut self.jobs, Vec::with_capacity(BATCH_MAX));
        let mut rest = jobs.into_iter();
        let mut left = Vec::new();
        if self.s.export.page_cache() {
            for mut j in rest.by_ref() {
                let (sh, s, req, to) = (&self.sh, &self.s, &j.req, j.to);
                let reply = caught_one(sh, s, req, to, || {
                    if req.command == Command::Write && is_small(req) {
                        Some(execute(sh, s, req, to, j.data.take()))
                    } else {
                        read_cached(sh, s, req, to)
                    }
                })
                .unwrap_or_else(Some);
                let Some(reply) = reply else {
                    left.push(j);
                    break;
                };
                self.reply(reply, j.permits);
            }
        }
        left.extend(rest);
        if !self.s.export.page_cache() {
            let (sh, s, tx) = (&self.sh, &self.s, &self.tx);
            let start = &self.start_in_kernel;
            let k = self.in_kernel.get_or_insert_with(|| start(sh, s, tx));
            if let Some(k) = k {
                left = k.submit(&self.sh, &self.s, left);
            }
        }
        on_pool(&self.sh, &self.s, &self.tx, left);
    }

    /// Queues a reply decided without running anything.
    fn reply(&self, reply: Encoded, permits: Permits) {
        let _ = self.tx.send(Box::new(Out {
            reply,
            _permits: permits.produced(),
        }));
    }

    /// Dispatches what is held and lets go of the reply channel.
    fn close(mut self) {
        self.dispatch();
        if let Some(Some(k)) = &self.in_kernel {
            k.close();
        }
    }
}

/// A connection's WRITE_ZEROES in arrival order, and whether the job that
/// runs them is running (it stops when the queue is empty).
#[derive(Default)]
struct ZeroLine {
    queue: VecDeque<Job>,
    running: bool,
}

impl ZeroLine {
    /// The next zeros to run as one: the first queued and those that
    /// continue it (same flags, each starting where the one before ends),
    /// up to ZERO_MERGE_MAX bytes.
    fn next_run(&mut self) -> Vec<Job> {
        let Some(first) = self.queue.pop_front() else {
            return Vec::new();
        };
        let (flags, mut end) = (first.req.flags, first.req.offset + first.req.length);
        let mut len = first.req.length;
        let mut run = vec![first];
        while let Some(j) = self.queue.front() {
            let r = &j.req;
            if r.flags != flags || r.offset != end || len + r.length > ZERO_MERGE_MAX {
                break;
            }
            (end, len) = (end + r.length, len + r.length);
            run.extend(self.queue.pop_front());
        }
        run
    }
}

/// The message of a request whose job panicked.
const UNWOUND: &str = "internal error: the server's job for this request failed";

/// Runs `f`, the storage calls of `reqs`. If it panics (a bug), each
/// request gets NBD_EIO, since whether it took effect is unknown, instead
/// of no reply: the client would wait forever.
fn caught<T>(
    sh: &Shared,
    s: &Session,
    reqs: &[(Request, ReplyTo)],
    f: impl FnOnce() -> T,
) -> Result<T, Vec<Encoded>> {
    let p = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => return Ok(v),
        Err(p) => p,
    };
    let why = p
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message");
    if sh.storage_errors.allow() {
        let (first, _) = reqs[0];
        let more = match reqs.len() {
            1 => String::new(),
            n => format!(" and {} requests after it", n - 1),
        };
        error!(
            "{} of {} bytes at offset {}{more} panicked: {why}; answered NBD_EIO",
            first.command.name(),
            first.length,
            first.offset,
        );
    }
    Err(reqs
        .iter()
        .map(|(_, to)| small_error(s, *to, NBD_EIO, UNWOUND))
        .collect())
}

/// [`caught`] for one request.
fn caught_one<T>(
    sh: &Shared,
    s: &Session,
    req: &Request,
    to: ReplyTo,
    f: impl FnOnce() -> T,
) -> Result<T, Encoded> {
    caught(sh, s, &[(*req, to)], f).map_err(|mut eio| eio.remove(0))
}

/// A zero's or flush's turn to run on its connection's own thread: at most
/// one fewer server-wide than the runtime has workers, so slow ones never
/// hold every worker (and never any on a single-threaded runtime).
struct SlowTurn(Arc<AtomicUsize>);

impl SlowTurn {
    fn take(running: &Arc<AtomicUsize>) -> Option<SlowTurn> {
        let workers =
            tokio::runtime::Handle::try_current().map_or(1, |h| h.metrics().num_workers());
        running
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n + 1 < workers).then_some(n + 1)
            })
            .ok()?;
        Some(SlowTurn(running.clone()))
    }
}

impl Drop for SlowTurn {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The zero line's lock; a panic while it was held left the queue whole.
fn lock(m: &Mutex<ZeroLine>) -> MutexGuard<'_, ZeroLine> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `jobs` in order on one blocking thread, queueing each reply as
/// soon as it is made.
fn on_pool(
    sh: &Arc<Shared>,
    s: &Arc<Session>,
    tx: &mpsc::UnboundedSender<Box<Out>>,
    jobs: Vec<Job>,
) {
    if jobs.is_empty() {
        return;
    }
    let (sh, s, tx) = (sh.clone(), s.clone(), tx.clone());
    tokio::task::spawn_blocking(move || {
        for j in jobs {
            let (req, to, data) = (j.req, j.to, j.data);
            let run = || execute(&sh, &s, &req, to, data);
            let reply = caught_one(&sh, &s, &req, to, run).unwrap_or_else(|eio| eio);
            let _ = tx.send(Box::new(Out {
                reply,
                _permits: j.permits.produced(),
            }));
        }
    });
}

/// A read or write short enough to be gathered with others into one job
/// (and, through the page cache, to run on the reader); not FUA, which
/// waits for the device.
fn is_small(req: &Request) -> bool {
    matches!(req.command, Command::Read | Command::Write)
        && req.length <= BATCH_MAX_LEN
        && req.flags & CMD_FLAG_FUA == 0
}

/// Fills `dst` (a payload) from what `rd` has buffered, or else waits for
/// the socket through [`Batch::hold`].
async fn fill<R: AsyncRead + Unpin>(
    rd: &mut Input<R>,
    batch: &mut Batch,
    dst: &mut [u8],
    ahead: usize,
) -> io::Result<()> {
    if rd.buffered() >= dst.len() {
        dst.copy_from_slice(rd.take(dst.len()));
        return Ok(());
    }
    batch.hold(rd.read_exact(dst, ahead)).await
}

/// Waits until `n` bytes are buffered. None: `quiet` went by without a
/// byte arriving while nothing was in flight (but the reader's own slot).
async fn header_bytes<R: AsyncRead + Unpin>(
    rd: &mut Input<R>,
    n: usize,
    ahead: usize,
    quiet: Option<Duration>,
    slots: &Semaphore,
    max_slots: usize,
) -> Option<io::Result<()>> {
    let Some(q) = quiet else {
        return Some(rd.fill_idle(n, ahead).await);
    };
    loop {
        let before = rd.buffered();
        match tokio::time::timeout(q, rd.fill_idle(n, ahead)).await {
            Ok(r) => return Some(r),
            Err(_) if slots.available_permits() + 1 >= max_slots && rd.buffered() == before => {
                return None
            }
            Err(_) => {}
        }
    }
}

/// What receiving a request's payload left to do.
// Moved once per request; boxing the job would allocate once per request.
#[allow(clippy::large_enum_variant)]
enum Received {
    /// A mapped write stored the whole payload and its reply is queued.
    Answered,
    /// The request to run, and the answer already decided when the head of
    /// a mapped write failed.
    Job(Job, Option<Encoded>),
}

/// The connection's reader: requests in, jobs out.
struct Reader<R, W> {
    sh: Arc<Shared>,
    s: Arc<Session>,
    rd: Input<R>,
    wr: Arc<tokio::sync::Mutex<BufWriter<W>>>,
    /// The socket itself, for mapped writes and spliced reads.
    sink: Option<RawSock>,
    counters: Arc<Counters>,
    batch: Batch,
    slots: Arc<Semaphore>,
    max_slots: usize,
    conn_bytes: Arc<Semaphore>,
    /// This connection's reserve of the server's bytes being received or
    /// made (permits.rs, the fairness rule).
    reserve: Arc<Semaphore>,
    /// Without a raw socket (TLS): this connection's budget of read
    /// replies not yet sent.
    conn_unsent: Option<Arc<Semaphore>>,
    /// Shutdown was requested: new requests get NBD_ESHUTDOWN.
    draining: bool,
    ext: bool,
    hlen: usize,
    /// Bytes to read ahead with a header: many small requests per syscall,
    /// but after a big payload none, since read-ahead would be payload bytes
    /// copied twice (socket -> buffer -> payload buffer).
    read_ahead: usize,
    /// Largest page-cache write run here while others are in flight.
    own_write_max: u64,
}

impl<R, W> Reader<R, W>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    async fn run(&mut self) -> io::Result<()> {
        // The writer is gone only after a write failed: that error is the
        // connection's.
        while !self.batch.tx.is_closed() {
            if self.next().await?.is_none() {
                break;
            }
        }
        Ok(())
    }

    /// Reads one request and schedules it.
    async fn next(&mut self) -> Step<()> {
        let slot = self.take_slot().await;
        let Some(req) = self.read_header().await? else {
            return Ok(None);
        };
        self.counters.request(req.command, req.length);
        let in_flight = self.max_slots - self.slots.available_permits();
        self.counters.in_flight(in_flight as u64);
        if req.command == Command::Disc {
            // Spec: finish what is in flight, then close; no reply.
            return Ok(None);
        }
        let to = ReplyTo {
            cookie: req.cookie,
            offset: req.offset,
        };
        let payload = req.payload_len(self.ext);
        self.read_ahead = if payload >= READ_AHEAD as u64 / 4 {
            0
        } else {
            READ_AHEAD
        };
        if payload > self.s.max_payload as u64 {
            return self.refuse_oversized(to, payload, slot).await;
        }
        if self.draining {
            // Spec (Terminating the transmission phase): requests received
            // while the server shuts down SHOULD get NBD_ESHUTDOWN.
            if let Err(e) = self.batch.hold(self.rd.skip(payload)).await {
                return ended(e);
            }
            let reply = small_error(&self.s, to, NBD_ESHUTDOWN, "the server is shutting down");
            self.batch.reply(reply, slot_only(slot));
            return Ok(Some(()));
        }
        let check = validate(&self.s, &req);
        // Bytes this request will hold: its payload, or the read reply.
        let (need, reply) = match (&check, req.command) {
            (Ok(()), Command::Read) => (req.length as usize + 2 * DATA_ALIGN, true),
            _ if payload > 0 => (payload as usize + DATA_ALIGN, false),
            _ => (0, false),
        };
        let permits = self.take_bytes(slot, need, reply).await;
        let (job, failed) = match self.receive(req, to, check.is_ok(), permits).await? {
            None => return Ok(None),
            Some(Received::Answered) => return Ok(Some(())),
            Some(Received::Job(job, failed)) => (job, failed),
        };
        let refused = failed.or_else(|| {
            let (err, msg) = check.err()?;
            debug!(
                "{} offset {} length {}: {}: {msg}",
                req.command.name(),
                req.offset,
                req.length,
                error_name(err)
            );
            Some(small_error(&self.s, to, err, msg))
        });
        if let Some(reply) = refused {
            if let Some((buf, _, _)) = job.data {
                self.sh.pool.put(buf);
            }
            self.batch.reply(reply, job.permits);
            return Ok(Some(()));
        }
        self.schedule(job).await.map(Some)
    }

    /// A payload over the maximum (spec: Size constraints) gets EINVAL. Up
    /// to OVERSIZED_SKIP_MAX it is read and dropped first and the
    /// connection goes on; a bigger one would cost unbounded time, and
    /// skipped unread it would be parsed as requests: answer, then hang up.
    async fn refuse_oversized(
        &mut self,
        to: ReplyTo,
        payload: u64,
        slot: OwnedSemaphorePermit,
    ) -> Step<()> {
        let msg = format!(
            "payload of {payload} bytes exceeds the maximum of {}",
            self.s.max_payload
        );
        debug!("{msg}");
        if payload <= OVERSIZED_SKIP_MAX {
            if let Err(e) = self.batch.hold(self.rd.skip(payload)).await {
                return ended(e);
            }
            let reply = small_error(&self.s, to, NBD_EINVAL, &msg);
            self.batch.reply(reply, slot_only(slot));
            return Ok(Some(()));
        }
        let reply = small_error(&self.s, to, NBD_EINVAL, &msg);
        self.batch.reply(reply, slot_only(slot));
        Err(protocol_error(msg))
    }

    /// The next request header. None: shutdown with the socket quiet, or
    /// an idle connection timed out.
    async fn read_header(&mut self) -> Step<Request> {
        let (hlen, ahead) = (self.hlen, self.read_ahead);
        if self.rd.buffered() < hlen {
            let (slots, max) = (&*self.slots, self.max_slots);
            let mut got = None;
            if !self.draining {
                let idle = self.sh.cfg.idle_timeout;
                let bytes = header_bytes(&mut self.rd, hlen, ahead, idle, slots, max);
                match self.batch.wait(bytes).await {
                    Some(Some(r)) => got = Some(r),
                    Some(None) => {
                        let idle = idle.unwrap_or_default();
                        info!("closing a connection idle for {idle:?}");
                        return Ok(None);
                    }
                    None => {
                        debug!("shutting down: answering new requests with NBD_ESHUTDOWN");
                        self.draining = true;
                    }
                }
            }
            let got = match got {
                Some(r) => r,
                None => {
                    self.batch.dispatch();
                    let bytes =
                        header_bytes(&mut self.rd, hlen, ahead, Some(DRAIN_QUIET), slots, max);
                    match bytes.await {
                        Some(r) => r,
                        None => return Ok(None),
                    }
                }
            };
            // EOF between requests is a client hanging up without DISC.
            if let Err(e) = got {
                return ended(e);
            }
        }
        let mut buf = [0u8; EXTENDED_REQUEST_LEN];
        let hdr = &mut buf[..hlen];
        hdr.copy_from_slice(self.rd.take(hlen));
        // Without a valid header there is no way to find the next one: hard
        // disconnect (spec: violation of a MUST).
        let (req, _) = decode_request(hdr, self.ext)
            .map_err(|e| protocol_error(format!("bad request header: {e}")))?;
        trace!(
            "{} flags {:#x} offset {} length {} cookie {:#x}",
            req.command.name(),
            req.flags,
            req.offset,
            req.length,
            req.cookie
        );
        Ok(Some(req))
    }

    /// Receives the payload of `req` (a write's data; nothing for other
    /// commands). A page-cache write of a good size goes straight from the
    /// socket into the page cache, here on the reader (not with FUA: that
    /// needs the RWF_DSYNC write); any other payload lands in a pooled
    /// buffer for the storage call.
    async fn receive(
        &mut self,
        mut req: Request,
        to: ReplyTo,
        valid: bool,
        permits: Permits,
    ) -> Step<Received> {
        let payload = req.payload_len(self.ext);
        let head = self.rd.buffered().min(payload as usize) as u64;
        let mut failed = None;
        let mapped = self.sh.cfg.map_writes
            && payload >= MAP_WRITE_MIN
            && payload - head >= MAP_WRITE_MIN
            && req.command == Command::Write
            && valid
            && req.flags & CMD_FLAG_FUA == 0;
        let export = &self.s.export;
        let mapping = if mapped {
            self.sink
                .as_ref()
                .and_then(|sock| Some((sock, export.map_write(req.offset, payload, head)?)))
        } else {
            None
        };
        if let Some((sock, mut mw)) = mapping {
            // What the reader already read ahead of the payload (at most 64
            // KiB, after small requests) is written first; if that fails,
            // the rest is read the ordinary way and the head's error is the
            // answer.
            if head > 0 {
                if let Err(f) = mw.write_head(self.rd.take(head as usize)) {
                    failed = Some(failure(&self.sh, &self.s, &req, to, f));
                }
                req.offset += head;
                req.length -= head;
            }
            if failed.is_none() {
                let r = self.batch.hold(sock.recv_mapped(mw.pages())).await;
                let got = mw.pages().received() as u64;
                mw.finish(r.is_ok());
                match r {
                    Ok(()) => {
                        self.batch.reply(whole(small_ok(&self.s, to)), permits);
                        return Ok(Some(Received::Answered));
                    }
                    // A page that could not be faulted in (no space, an
                    // I/O error): the rest is written the ordinary way,
                    // which reports the error.
                    Err(e) if e.raw_os_error() == Some(libc::EFAULT) => {
                        debug!("mapped write at {}: {e} after {got} bytes", req.offset);
                        req.offset += got;
                        req.length -= got;
                    }
                    Err(e) => return ended(e),
                }
            }
        }
        let payload = req.payload_len(self.ext);
        let mut data = None;
        if payload > 0 {
            let n = payload as usize;
            let (mut buf, start) = self.sh.pool.get(0, n);
            let dst = &mut buf[start..start + n];
            match fill(&mut self.rd, &mut self.batch, dst, self.read_ahead).await {
                // Client vanished mid-payload: nothing to write.
                Err(e) => return ended(e),
                Ok(()) => data = Some((buf, start, n)),
            }
        }
        let job = Job {
            req,
            to,
            data,
            permits,
        };
        Ok(Some(Received::Job(job, failed)))
    }

    /// Decides where `job` runs: here, in the held batch, or alone on the
    /// blocking pool.
    async fn schedule(&mut self, job: Job) -> io::Result<()> {
        let req = job.req;
        // Small page-cache reads and writes cost less than handing one to a
        // blocking thread: while more requests are already buffered, gather
        // them and hand them over together. Anything else goes alone, so big
        // or slow requests still run in parallel.
        let small = is_small(&req);
        // A read or write with nothing else in flight or buffered (queue
        // depth 1) runs here: the pool and writer task would add two thread
        // wake-ups of latency (docs/benchmarks.md, Latency). Not a trim or
        // any other zero, which may take long (writing zeros) and would hold
        // up a request the client sends a moment later. A block status of
        // base:allocation does too: `nbdinfo --map` sends one at a time.
        // So does a zero that is one extent call the storage is known to
        // answer (ext4, XFS: unwritten extents or a punched hole), within
        // ZERO_MERGE_MAX: an in-order client pays the two wake-ups on every
        // request (docs/benchmarks.md, NO_HOLE zeros); and a flush, which a
        // guest's fsync waits for alone (docs/benchmarks.md, Latency). Both
        // may wait on the storage: `SlowTurn` keeps one runtime worker free
        // of them.
        let slow_here = req.command == Command::Flush
            || req.command == Command::WriteZeroes
                && req.length <= ZERO_MERGE_MAX
                && self
                    .s
                    .export
                    .zero_is_one_call(zero_flags(&req), req.flags & CMD_FLAG_FUA != 0);
        let idle = self.batch.jobs.is_empty()
            && self.slots.available_permits() + 1 == self.sh.cfg.max_requests_per_conn
            && (matches!(req.command, Command::Read | Command::Write)
                && req.length <= INLINE_MAX_LEN
                || quick_status(&self.s, &req)
                || slow_here);
        // A mid-sized page-cache write runs here whatever else is in flight:
        // its payload is still in this CPU's cache, and buffered writes to
        // one inode serialize on its lock anyway (docs/benchmarks.md, Write
        // path). Not under O_DIRECT, where the pool's threads are
        // the device's queue depth.
        let own_write = self.s.export.page_cache()
            && req.command == Command::Write
            && req.flags & CMD_FLAG_FUA == 0
            && req.length > BATCH_MAX_LEN
            && req.length <= self.own_write_max;
        // Whether the client sent more is only known by looking (any byte
        // buffered, even part of a header, is a next request): else queued
        // big writes, each header arriving after the previous payload, would
        // run here one after the other. An own write runs here regardless.
        if idle && !own_write && self.rd.buffered() == 0 {
            self.rd.top_up(self.read_ahead.max(PEEK_AHEAD)).await?;
        }
        let turn = if slow_here && idle && self.rd.buffered() == 0 {
            SlowTurn::take(&self.sh.slow_here)
        } else {
            None
        };
        if turn.is_some() || own_write || (idle && !slow_here && self.rd.buffered() == 0) {
            self.run_here(job, turn).await
        } else if small {
            self.batch.push(job);
            Ok(())
        } else if req.command == Command::WriteZeroes {
            self.batch.zero(job);
            Ok(())
        } else {
            self.batch.alone(job);
            Ok(())
        }
    }

    /// Runs `job` on the reader and writes its reply from here.
    async fn run_here(&mut self, job: Job, turn: Option<SlowTurn>) -> io::Result<()> {
        // Nothing may wait behind it (an idle request has nothing held).
        self.batch.dispatch();
        let (sh, s, req, to) = (&self.sh, &self.s, &job.req, job.to);
        let run = || caught_one(sh, s, req, to, || execute(sh, s, req, to, job.data));
        // A zero or flush may wait on the storage: the worker hands its
        // core (its run queue, and the task a wake-up left in its LIFO
        // slot, which no other worker may steal) to another thread first,
        // so nothing queued on it waits behind the storage.
        let reply = match turn {
            Some(_) => tokio::task::block_in_place(run),
            None => run(),
        }
        .unwrap_or_else(|e| e);
        drop(turn);
        let permits = job.permits.produced();
        let mut w = self.wr.lock().await;
        let sent = within(self.sh.cfg.idle_timeout, async {
            put_reply(&self.sh, &mut w, self.sink.as_ref(), &self.counters, reply).await?;
            w.flush().await
        })
        .await;
        drop(w);
        drop(permits);
        sent
    }
}
