//! The NBD server: fixed newstyle handshake, then a transmission phase that
//! runs many requests per connection in parallel and answers them out of
//! order.
//!
//! Where things are: this file holds the configuration, the accept loop and
//! the setup of each connection; `handshake` the option negotiation and the
//! upgrade to TLS (`crate::tls`);
//! `transmission` the request reader, its scheduling and the reply writer;
//! `command` validation, execution and replies of each command; `export`
//! what a request does to the storage and the rules every write obeys;
//! `buffers`
//! the read-ahead buffer and the buffer and pipe pools.
//!
//! Per connection (see docs/architecture.md):
//! - the connection task reads and decodes requests (and, for writes, reads
//!   the payload straight into the buffer the storage call will use);
//! - storage calls run on tokio's blocking pool, small ones gathered into
//!   one job, and each encodes its reply into one buffer (header and data
//!   together); a lone request or a mid-sized page-cache write runs on the
//!   connection task itself, which then writes its reply;
//! - one writer task owns the socket's write half and sends finished replies
//!   in completion order, so replies never interleave.
//!
//! Memory is bounded before it is allocated: a request takes a slot of the
//! per-connection request limit and its bytes from the per-connection limit
//! (given back when its reply has been written) and from the server-wide
//! limit (given back when its reply is made); a read also takes its reply's
//! bytes from the server-wide budget of replies waiting to be sent, which a
//! connection with nothing else in flight may overdraw by one reply. So a
//! client that never reads its replies stalls only itself (docs/
//! architecture.md, Limits).
//!
//! Every connection shares one `Arc<Target>`, so a flush on any connection
//! (fdatasync) covers writes completed on all of them, which is what
//! NBD_FLAG_CAN_MULTI_CONN promises.

mod buffers;
mod command;
mod export;
mod exports;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod handshake;
mod limits;
mod meta;
mod refuse;
mod transmission;
mod writeback;

use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rawdisk_storage::cbt::{CbtError, TrackOptions, Tracker};
use rawdisk_storage::{OpenOptions, Target};
use tokio::io::{AsyncRead, AsyncWrite, BufWriter};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tracing::{debug, warn, Instrument};

use crate::proto::*;
use crate::sock::RawSock;
use buffers::{BufPool, Input, PipePool, DATA_ALIGN, POOL_IDLE};
pub use export::{Aio, DetectZeroes, Discard, Serving, Window};
use exports::{Export, Exports};
use handshake::Link;
use limits::{HandshakeSlot, Handshakes, RateLimit, Stats};
pub use limits::{Tally, Totals};
pub use writeback::WriteBehind;

/// Limits and identity of one export.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The export's name; "" is the default export.
    pub export_name: String,
    /// Sent as NBD_INFO_DESCRIPTION and in NBD_REP_SERVER when not empty.
    pub description: String,
    /// Refuse writes even if the target is writable.
    pub read_only: bool,
    /// Connections beyond this are closed right after accept; at most half
    /// of them (rounded up) may be in the handshake at once.
    pub max_connections: usize,
    /// Requests in flight per connection; reading stops at the limit.
    pub max_requests_per_conn: usize,
    /// Payload and reply bytes in flight per connection.
    pub max_bytes_per_conn: usize,
    /// Payload and reply bytes being received or made over all connections,
    /// each connection's reserve of it included (raised to admit the
    /// reserves and the largest request beside them).
    pub max_bytes_total: usize,
    /// Read reply bytes waiting to be sent over all connections; a
    /// connection with nothing else in flight may go one reply beyond.
    pub max_unsent_total: usize,
    /// A client must reach the transmission phase within this time.
    pub handshake_timeout: Duration,
    /// Close a connection in transmission after this long with nothing in
    /// flight and no byte received, or with replies the client does not
    /// take; None: never.
    pub idle_timeout: Option<Duration>,
    /// Options per handshake before the server hangs up.
    pub max_options: usize,
    /// Largest option data accepted (spec: a server may refuse big options).
    pub max_option_len: u32,
    /// Maximum payload advertised in NBD_INFO_BLOCK_SIZE and enforced on
    /// clients that asked for it.
    pub max_payload: u32,
    /// Maximum payload of a client that did not ask for NBD_INFO_BLOCK_SIZE
    /// (at least `max_payload`): many such clients assume more than the
    /// spec's 32 MiB default, and the byte budgets still bound memory.
    pub max_payload_unnegotiated: u32,
    /// After shutdown is requested, connections get this long to finish
    /// their in-flight requests before they are dropped.
    pub shutdown_grace: Duration,
    /// When page-cache writes start their write-back at once
    /// (sync_file_range WRITE) so that a client's final FLUSH finds little
    /// left to write; `Auto` decides from what the clients do (writeback.rs).
    pub write_behind: WriteBehind,
    /// Receive page-cache writes of MAP_WRITE_MIN or more straight into the
    /// target's mapped page cache (`Target::map_write`). A client that
    /// vanishes mid-payload then leaves the part that arrived written;
    /// without it a write lands only once its whole payload is in.
    pub map_writes: bool,
    /// TLS credentials and whether TLS is required; None: no TLS.
    pub tls: Option<crate::tls::ServerTls>,
    /// Changed-block tracking (`--track-changes`): the tracker of each
    /// export, opened by [`Server::open`] for a single export and on first
    /// use for each `--dir` export.
    pub track_changes: Option<TrackOptions>,
    /// `serve --bitmap NAME...`: only these checkpoints are offered as
    /// `qemu:dirty-bitmap:NAME` (each must exist at [`Server::open`]);
    /// None: every checkpoint is. `rawdisk:changed:` offers every one.
    pub dirty_bitmaps: Option<Vec<String>>,
    /// `--dir`: export files that look like another image format (qcow2,
    /// VMDK...) as raw (`serve -f raw`); without it NBD_OPT_GO refuses them.
    pub raw: bool,
    /// `--discard`, `--detect-zeroes`, `--aio`: the same for every export.
    pub serving: Serving,
    /// The part of a single export's target served (`serve --offset`,
    /// `--size`); the whole target by default. Not with `--dir`, nor with
    /// changed-block tracking, whose marks are the target's.
    pub window: Window,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            export_name: String::new(),
            description: String::new(),
            read_only: false,
            // qemu-nbd's choices after CVE-2024-7409.
            max_connections: 100,
            max_requests_per_conn: 256,
            max_bytes_per_conn: 128 << 20,
            max_bytes_total: 512 << 20,
            max_unsent_total: 128 << 20,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: None,
            max_options: 64,
            max_option_len: 64 << 10,
            max_payload: 32 << 20,
            max_payload_unnegotiated: 64 << 20,
            shutdown_grace: Duration::from_secs(10),
            write_behind: WriteBehind::Auto,
            map_writes: false,
            tls: None,
            track_changes: None,
            dirty_bitmaps: None,
            raw: false,
            serving: Serving::default(),
            window: Window::default(),
        }
    }
}
/// Once shutdown starts, how long a connection still in the handshake has
/// to send its next option (answered NBD_REP_ERR_SHUTDOWN) before it is
/// closed.
const SHUTDOWN_HANDSHAKE_MAX: Duration = Duration::from_secs(1);
/// Stands for "never" where a deadline would overflow the clock.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 86_400);

/// A listening socket the server accepts on.
pub enum Listener {
    Unix(tokio::net::UnixListener),
    Tcp(tokio::net::TcpListener),
}

/// One export served to any number of connections. Clones share it.
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
}

struct Shared {
    exports: Exports,
    cfg: ServerConfig,
    conns: Arc<Semaphore>,
    /// Connections still in the handshake: at most half of `conns`, so
    /// clients that never finish it cannot lock out everyone else.
    handshakes: Handshakes,
    /// The bytes being received or made that are not set aside as the
    /// connections' reserves (`reserve_per_conn` each).
    bytes_total: Arc<Semaphore>,
    unsent: Arc<Semaphore>,
    /// Connections over the cap being told why (refuse.rs).
    refusing: Arc<Semaphore>,
    stats: Stats,
    refusals: RateLimit,
    export_refusals: RateLimit,
    tls_refusals: RateLimit,
    evictions: RateLimit,
    storage_errors: RateLimit,
    /// accept(2) failures (EMFILE: out of descriptors), one a second.
    accept_errors: RateLimit,
    bytes_per_conn: usize,
    reserve_per_conn: usize,
    pool: BufPool,
    pipes: PipePool,
    next_conn: AtomicU64,
    /// Told when the last connection in transmission ends
    /// ([`Server::all_closed`]).
    all_closed: tokio::sync::Notify,
    /// Zeros and flushes running on their connection's own thread now
    /// (transmission.rs, `SlowTurn`): fewer than the runtime's workers, so
    /// one is always free.
    slow_here: Arc<AtomicUsize>,
}

impl Server {
    /// One export, untracked whatever `cfg.track_changes` says.
    pub fn new(target: Arc<Target>, cfg: ServerConfig) -> Server {
        Server::new_tracked(target, None, cfg)
    }

    /// One export, with the tracker `cfg.track_changes` asks for opened
    /// first.
    pub fn open(target: Arc<Target>, cfg: ServerConfig) -> Result<Server, CbtError> {
        let tracker = match &cfg.track_changes {
            Some(opts) => {
                if let Some(names) = &cfg.dirty_bitmaps {
                    rawdisk_storage::cbt::require_state(
                        target.path(),
                        opts.state_dir.as_deref(),
                        names,
                    )?;
                }
                Some(exports::open_tracker(&target, opts)?)
            }
            None => None,
        };
        if let Some(t) = &tracker {
            for name in cfg.dirty_bitmaps.iter().flatten() {
                t.require(name)?;
            }
        }
        Ok(Server::new_tracked(target, tracker, cfg))
    }

    /// One export whose changes `tracker` records (`--track-changes`); the
    /// server closes it cleanly when `serve` returns.
    pub fn new_tracked(
        target: Arc<Target>,
        tracker: Option<Arc<Tracker>>,
        cfg: ServerConfig,
    ) -> Server {
        let export = Export::new(
            cfg.export_name.clone(),
            target,
            cfg.read_only,
            cfg.write_behind,
            cfg.max_payload,
            (0, 0),
            tracker,
        )
        .with_serving(cfg.serving)
        .with_window(cfg.window);
        Server::with_exports(Exports::One(Arc::new(export)), cfg)
    }

    /// A server for every regular file and block device directly inside
    /// `dir`, each an export named by its file name (`serve --dir`); the
    /// empty name means `default_export` when given, else it is refused.
    pub fn new_dir(
        dir: &std::path::Path,
        opts: OpenOptions,
        default_export: Option<String>,
        cfg: ServerConfig,
    ) -> io::Result<Server> {
        let opts = OpenOptions {
            read_only: opts.read_only || cfg.read_only,
            ..opts
        };
        let mut dir = Exports::dir(dir, opts, default_export, cfg.track_changes.clone())?;
        dir.raw = cfg.raw;
        dir.serving = cfg.serving;
        Ok(Server::with_exports(Exports::Dir(Box::new(dir)), cfg))
    }

    fn with_exports(exports: Exports, mut cfg: ServerConfig) -> Server {
        // The limits must admit the largest request, or it would wait forever.
        cfg.max_payload_unnegotiated = cfg.max_payload_unnegotiated.max(cfg.max_payload);
        let biggest = cfg.max_payload_unnegotiated as usize + 2 * DATA_ALIGN;
        cfg.max_unsent_total = cfg.max_unsent_total.max(biggest);
        cfg.max_connections = cfg.max_connections.max(1);
        // Each connection's reserve is set aside from the bytes being
        // received or made; the rest is shared, and admits the largest.
        let reserve_per_conn = transmission::reserve_per_conn(cfg.max_payload);
        let reserved = reserve_per_conn.saturating_mul(cfg.max_connections);
        let shared = cfg.max_bytes_total.saturating_sub(reserved).max(biggest);
        cfg.max_bytes_total = shared.saturating_add(reserved);
        let bytes_per_conn = cfg.max_bytes_per_conn.max(biggest);
        cfg.max_requests_per_conn = cfg.max_requests_per_conn.max(1);
        let cap = cfg.max_connections;
        Server {
            shared: Arc::new(Shared {
                conns: Arc::new(Semaphore::new(cfg.max_connections)),
                handshakes: Handshakes::new(cfg.max_connections.div_ceil(2)),
                bytes_total: Arc::new(Semaphore::new(shared)),
                unsent: Arc::new(Semaphore::new(cfg.max_unsent_total)),
                refusing: Arc::new(Semaphore::new(refuse::REFUSING_MAX)),
                stats: Stats::new(),
                refusals: RateLimit::new(move |n| {
                    warn!("refused {n} more connection(s) in the last second: at the cap of {cap}")
                }),
                export_refusals: RateLimit::new(|n| {
                    warn!("refused {n} more option(s) naming an unknown export in the last second")
                }),
                tls_refusals: RateLimit::new(|n| {
                    warn!("refused {n} more option(s) without TLS in the last second")
                }),
                evictions: RateLimit::new(|n| {
                    warn!(
                        "closed {n} more connection(s) still in the handshake in the last \
                         second, to admit newer ones"
                    )
                }),
                storage_errors: RateLimit::new(|n| {
                    warn!("{n} more storage error(s) answered NBD_ENOSPC or NBD_EIO in the last second")
                }),
                accept_errors: RateLimit::new(|n| {
                    warn!("accept failed {n} more time(s) in the last second")
                }),
                bytes_per_conn,
                reserve_per_conn,
                pool: BufPool::new(16, (4 << 20) + 2 * DATA_ALIGN),
                pipes: PipePool::new(),
                next_conn: AtomicU64::new(1),
                all_closed: tokio::sync::Notify::new(),
                slow_here: Arc::new(AtomicUsize::new(0)),
                exports,
                cfg,
            }),
        }
    }

    /// (minimum, preferred, maximum payload) as advertised in
    /// NBD_INFO_BLOCK_SIZE; for `--dir` the page-cache values (each export
    /// has its own).
    pub fn block_sizes(&self) -> (u32, u32, u32) {
        let s = &self.shared;
        match s.exports.single() {
            Some(e) => (e.min_block, e.preferred_block, s.cfg.max_payload),
            None => (1, 4096, s.cfg.max_payload),
        }
    }

    /// Accepts connections until `shutdown` becomes true, then lets every
    /// connection finish its in-flight requests, flushes the target and
    /// returns.
    pub async fn serve(
        &self,
        listener: Listener,
        mut shutdown: watch::Receiver<bool>,
    ) -> io::Result<()> {
        let sh = &self.shared;
        let mut tasks = JoinSet::new();
        let mut sweep = tokio::time::interval(POOL_IDLE / 3);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let accepted = tokio::select! {
                _ = shutdown.wait_for(|v| *v) => break,
                _ = sweep.tick() => {
                    sh.pipes.release_idle(POOL_IDLE);
                    sh.pool.release_idle(POOL_IDLE);
                    continue;
                }
                // A finished connection's task is freed only once joined.
                _ = tasks.join_next(), if !tasks.is_empty() => {
                    if tasks.is_empty() {
                        crate::sock::trim_heap();
                    }
                    continue;
                }
                a = accept(&listener) => a,
            };
            while tasks.try_join_next().is_some() {}
            let (rd, wr, sink, peer) = match accepted {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    if sh.accept_errors.allow() {
                        warn!("accept failed: {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(place) = sh.conns.clone().try_acquire_owned() else {
                sh.wait_or_refuse(&mut tasks, rd, wr, sink, peer, shutdown.clone());
                continue;
            };
            let fut = admitted(
                sh.clone(),
                rd,
                wr,
                Some(sink),
                peer,
                shutdown.clone(),
                place,
            );
            tasks.spawn(fut);
        }
        drop(listener);
        let grace = sh.cfg.shutdown_grace;
        let drained =
            tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} }).await;
        if drained.is_err() {
            warn!(
                "{} connection(s) still busy after {grace:?}; closing them",
                tasks.len()
            );
            tasks.shutdown().await;
        }
        let closed = self.close_exports().await;
        // The timers that would say how many lines were held back do not
        // run once the server returns.
        for limit in [
            &sh.refusals,
            &sh.export_refusals,
            &sh.tls_refusals,
            &sh.evictions,
            &sh.storage_errors,
            &sh.accept_errors,
        ] {
            limit.report_held();
        }
        closed
    }

    /// The final flush of every export still open and written since its
    /// last flush, then the clean close of every tracker.
    async fn close_exports(&self) -> io::Result<()> {
        let sh = &self.shared;
        for e in sh.exports.open() {
            let export = e.clone();
            match tokio::task::spawn_blocking(move || export.final_flush()).await {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => debug!(
                    "export {:?}: nothing written since the last flush, none at stop",
                    e.name
                ),
                Ok(Err(err)) => {
                    return Err(io::Error::other(format!(
                        "final flush of {:?}: {err}",
                        e.name
                    )))
                }
                Err(err) => {
                    return Err(io::Error::other(format!(
                        "final flush of {:?}: {err}",
                        e.name
                    )))
                }
            }
        }
        // After the final flush: the clean close records the target as it
        // is on disk now. Every tracker is closed even when one fails.
        let mut failed = None;
        for (name, t) in sh.exports.trackers() {
            let closed = tokio::task::spawn_blocking(move || t.close()).await;
            let err = match closed {
                Ok(Ok(())) => {
                    debug!("export {name:?}: changed-block tracking state closed");
                    continue;
                }
                Ok(Err(err)) => err.to_string(),
                Err(err) => format!("closing the tracking state of {name:?}: {err}"),
            };
            // The first is the server's error; any further ones are logged.
            if failed.is_some() {
                warn!("{err}");
            } else {
                failed = Some(err);
            }
        }
        match failed {
            Some(err) => Err(io::Error::other(err)),
            None => Ok(()),
        }
    }

    /// Serves one already-connected stream (tests, the fuzz target, pipes)
    /// and returns when the connection ends. Any byte stream works: with no
    /// socket underneath, reads are copied instead of spliced and
    /// `map_writes` does not apply.
    pub async fn serve_stream<S>(&self, stream: S, shutdown: watch::Receiver<bool>)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let sh = &self.shared;
        let Ok(place) = sh.conns.clone().try_acquire_owned() else {
            sh.refused("stream");
            return;
        };
        let (rd, wr) = tokio::io::split(stream);
        admitted(sh.clone(), rd, wr, None, "stream".into(), shutdown, place).await;
    }

    /// TLS as configured.
    pub fn tls(&self) -> Option<&crate::tls::ServerTls> {
        self.shared.cfg.tls.as_ref()
    }

    /// Whether every export refuses writes (`--read-only`, or the single
    /// target could only be opened for reading).
    pub fn read_only(&self) -> bool {
        let s = &self.shared;
        s.cfg.read_only || s.exports.single().is_some_and(|e| e.read_only)
    }

    /// The server's totals since it started, in one line (for SIGUSR1).
    pub fn stats(&self) -> String {
        self.totals().to_string()
    }

    /// The server's totals since it started: connections, and requests,
    /// bytes and errors over every connection, open ones included.
    pub fn totals(&self) -> Totals {
        self.shared.stats.totals()
    }

    /// Resolves once no connection is in transmission after one was
    /// (`serve --exit-last`): a client that only lists or probes never
    /// counts.
    pub async fn all_closed(&self) {
        self.shared.all_closed.notified().await
    }
}

/// What an accepted connection holds: its place under the connection cap,
/// and until its handshake is over a place among the connections in the
/// handshake, which a newer connection may take (`evicted` resolves).
struct Admission {
    id: u64,
    /// Holds the place under the cap until the handshake is over.
    handshake: HandshakeSlot,
    evicted: tokio::sync::oneshot::Receiver<()>,
}

impl Shared {
    /// A connection there is no place for is counted and logged (at most
    /// once a second, with a count).
    fn refused(&self, peer: &str) {
        self.stats.refused();
        if self.refusals.allow() {
            warn!(
                "refusing connection from {peer}: already serving {} connections",
                self.cfg.max_connections,
            );
        }
    }

    /// Admits a new connection to `conn`, its place under the cap, and
    /// to a place among those in the handshake. Evictions are logged at
    /// most once a second, with a count.
    fn admit(&self, peer: &str, conn: OwnedSemaphorePermit) -> Admission {
        self.stats.accepted();
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let (handshake, evicted, full) = self.handshakes.enter(id, conn);
        if full {
            self.stats.evicted();
            if self.evictions.allow() {
                warn!(
                    "{} connections are still in the handshake: closing the oldest to admit \
                     {peer}",
                    self.handshakes.cap(),
                );
            }
        }
        Admission {
            id,
            handshake,
            evicted,
        }
    }

    /// Connection `id` in transmission ended: when it was the last, pooled
    /// pipes and buffers are let go (descriptors and memory back to idle).
    fn connection_closed(&self, id: u64) {
        if self.stats.closed(id) {
            self.pipes.clear();
            self.pool.clear();
            self.all_closed.notify_one();
        }
    }
}

type BoxRead = Box<dyn AsyncRead + Unpin + Send>;
type BoxWrite = Box<dyn AsyncWrite + Unpin + Send>;

async fn accept(l: &Listener) -> io::Result<(BoxRead, BoxWrite, RawSock, String)> {
    match l {
        Listener::Unix(l) => {
            let (s, _) = l.accept().await?;
            crate::sock::grow_unix_send_buffer(&s);
            let (r, w, sink) = crate::sock::split(s.into_std()?.into())?;
            Ok((Box::new(r), Box::new(w), sink, "unix socket".into()))
        }
        Listener::Tcp(l) => {
            let (s, peer) = l.accept().await?;
            // Spec (Protocol phases): both sides SHOULD disable Nagle, or a
            // reply header can wait for an ACK of the previous packet.
            if let Err(e) = s.set_nodelay(true) {
                warn!("TCP_NODELAY on {peer}: {e}");
            }
            let (r, w, sink) = crate::sock::split(s.into_std()?.into())?;
            Ok((Box::new(r), Box::new(w), sink, peer.to_string()))
        }
    }
}

// ---------------------------------------------------------------------------
// Connection
// ---------------------------------------------------------------------------

/// What the handshake settled for the transmission phase.
#[derive(Debug, Clone)]
struct Session {
    mode: ReplyMode,
    flags: u16,
    size: u64,
    /// The metadata contexts the client selected for this export, with
    /// their ids; BLOCK_STATUS answers one chunk per context.
    contexts: Vec<(u32, meta::Context)>,
    /// The client asked for NBD_INFO_BLOCK_SIZE in NBD_OPT_GO and so promised
    /// to honour the minimum block size (spec: Size constraints).
    enforce_min_block: bool,
    min_block: u32,
    /// The export the handshake settled on.
    export: Arc<Export>,
    max_payload: u32,
    /// The connection is a socket that read data can be spliced into.
    splice: bool,
}

fn protocol_error(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// A connection given `place` under the cap: admitted, then served to its
/// end in its own log span.
fn admitted<R, W>(
    sh: Arc<Shared>,
    rd: R,
    wr: W,
    sink: Option<RawSock>,
    peer: String,
    shutdown: watch::Receiver<bool>,
    place: OwnedSemaphorePermit,
) -> impl std::future::Future<Output = ()>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let permit = sh.admit(&peer, place);
    let span = tracing::debug_span!("conn", id = permit.id);
    connection(sh, rd, wr, sink, peer, shutdown, permit).instrument(span)
}

async fn connection<R, W>(
    sh: Arc<Shared>,
    rd: R,
    wr: W,
    sink: Option<RawSock>,
    peer: String,
    mut shutdown: watch::Receiver<bool>,
    admission: Admission,
) where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    debug!("connection from {peer}");
    // A blocking thread made now, during the handshake, is idle in the pool
    // when the first request needs one (a job, or `block_in_place` for an
    // inline zero): made then, its ~0.2 ms falls on that request.
    drop(tokio::task::spawn_blocking(|| {}));
    let since = Instant::now();
    let rd = Input::new(rd);
    let wr = BufWriter::with_capacity(64 << 10, wr);
    let Admission {
        id,
        handshake: in_handshake,
        mut evicted,
    } = admission;
    let earned = Arc::new(AtomicUsize::new(0));
    let stop = handshake::Stop::new(shutdown.clone(), in_handshake, earned.clone());
    let negotiate = handshake::handshake(&sh, rd, wr, &peer, stop);
    // The handshake timeout, plus a little per query a listing client
    // sends about the names it was told.
    let start = tokio::time::Instant::now();
    let deadline = async {
        // A timeout too large for the clock's range is no timeout.
        let after = |d: Duration| start.checked_add(d).unwrap_or(start + FAR_FUTURE);
        let mut until = after(sh.cfg.handshake_timeout);
        loop {
            tokio::time::sleep_until(until).await;
            let n = earned.load(Ordering::Relaxed);
            let extra = handshake::TIME_PER_LISTED.saturating_mul(n.try_into().unwrap_or(u32::MAX));
            let due = after(sh.cfg.handshake_timeout.saturating_add(extra));
            if due <= until {
                break;
            }
            until = due;
        }
    };
    // Shutting down, the handshake answers the client's next option with
    // NBD_REP_ERR_SHUTDOWN; a client that sends none within this time is
    // closed, so it cannot hold up the server's exit.
    let stopped = async {
        let _ = shutdown.wait_for(|v| *v).await;
        tokio::time::sleep(SHUTDOWN_HANDSHAKE_MAX).await;
    };
    let hs = tokio::select! {
        r = negotiate => Ok(r),
        _ = deadline => Err(()),
        _ = stopped => {
            debug!("{peer}: closed in the handshake: the server is shutting down");
            return;
        }
        _ = &mut evicted => {
            debug!("{peer}: closed in the handshake to admit a newer connection");
            return;
        }
    };
    // The place under the cap is held until the connection ends.
    let (session, link, _place) = match hs {
        Err(_) => {
            warn!(
                "{peer}: handshake not finished within {:?}; closing",
                sh.cfg.handshake_timeout
            );
            return;
        }
        Ok(Err(e)) => {
            if e.kind() == io::ErrorKind::UnexpectedEof || *shutdown.borrow() {
                debug!("{peer}: closed during handshake: {e}");
            } else {
                warn!("{peer}: handshake failed: {e}");
            }
            return;
        }
        Ok(Ok(None)) => {
            debug!("{peer}: handshake aborted");
            return;
        }
        Ok(Ok(Some(s))) => s,
    };
    let who = Who { id, peer, since };
    match link {
        Link::Plain(rd, wr) => transmit(sh, rd, wr, session, sink, who, shutdown).await,
        Link::Tls(rd, wr) => transmit(sh, rd, wr, session, None, who, shutdown).await,
    }
}

/// Calls `connection_closed` when dropped, however the connection ends.
struct Closing<'a>(&'a Shared, u64);

impl Drop for Closing<'_> {
    fn drop(&mut self) {
        self.0.connection_closed(self.1);
    }
}

/// Which connection, for its log lines and counters.
struct Who {
    id: u64,
    peer: String,
    /// Accepted at.
    since: Instant,
}

/// The transmission phase of one negotiated connection, with its logging.
/// `sink` is the raw socket for splice and mapped writes: None over TLS.
async fn transmit<R, W>(
    sh: Arc<Shared>,
    rd: Input<R>,
    wr: BufWriter<W>,
    mut session: Session,
    sink: Option<RawSock>,
    who: Who,
    shutdown: watch::Receiver<bool>,
) where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    session.splice = sink.is_some();
    let peer = &who.peer;
    debug!(
        "{peer}: negotiated {} replies, flags {}, size {}, metadata contexts [{}], block size {} ({})",
        match session.mode {
            ReplyMode::Simple => "simple",
            ReplyMode::Structured => "structured",
            ReplyMode::Extended => "extended-header",
        },
        transmission_flag_names(session.flags)
            .collect::<Vec<_>>()
            .join("|"),
        session.size,
        session
            .contexts
            .iter()
            .map(|(_, c)| c.name())
            .collect::<Vec<_>>()
            .join(", "),
        session.min_block,
        if session.enforce_min_block {
            "agreed"
        } else {
            "not requested"
        },
    );
    let counters = sh.stats.opened(who.id);
    // Closed in the totals even when the task is dropped mid-await (the
    // shutdown grace ran out): else it stays "open" at exit.
    let closing = Closing(&sh, who.id);
    let result =
        transmission::transmission(sh.clone(), rd, wr, session, sink, shutdown, &counters).await;
    drop(closing);
    let how = match result {
        Ok(()) => "closed".to_string(),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => "closed by the client".to_string(),
        Err(e) => {
            warn!("{peer}: connection ended: {e}");
            format!("ended ({e})")
        }
    };
    // One line per connection with -v (the totals: SIGUSR1, --stats).
    debug!(
        "{peer}: connection {how} after {:.3} s; {}",
        who.since.elapsed().as_secs_f64(),
        counters.snapshot()
    );
}
