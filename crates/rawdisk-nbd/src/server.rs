//! The NBD server: fixed newstyle handshake, then a transmission phase that
//! runs many requests per connection in parallel and answers them out of
//! order.
//!
//! Per connection (see docs/architecture.md):
//! - the connection task reads and decodes requests (and, for writes, reads
//!   the payload straight into the buffer the storage call will use);
//! - every storage call runs on tokio's blocking pool, where it also encodes
//!   its reply into one buffer (header and data together);
//! - one writer task owns the socket's write half and sends finished replies
//!   in completion order, so replies never interleave.
//!
//! Memory is bounded before it is allocated: a request takes a slot of the
//! per-connection request limit and its bytes from the per-connection and
//! server-wide byte limits, and gives them back only when its reply has been
//! written. Every connection shares one `Arc<Target>`, so a flush on any
//! connection (fdatasync) covers writes completed on all of them, which is
//! what NBD_FLAG_CAN_MULTI_CONN promises.

use std::cell::RefCell;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rawdisk_storage::{CacheMode, ExtentKind, Kind, Method, Target, ZeroFlags};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tracing::{debug, info, trace, warn, Instrument};

use crate::proto::*;
use crate::sock::{Pipe, RawSock};

/// Limits and identity of one export.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The export's name; "" is the default export.
    pub export_name: String,
    /// Sent as NBD_INFO_DESCRIPTION and in NBD_REP_SERVER when not empty.
    pub description: String,
    /// Refuse writes even if the target is writable.
    pub read_only: bool,
    /// Connections beyond this are closed right after accept.
    pub max_connections: usize,
    /// Requests in flight per connection; reading stops at the limit.
    pub max_requests_per_conn: usize,
    /// Payload and reply bytes in flight per connection.
    pub max_bytes_per_conn: usize,
    /// Payload and reply bytes in flight over all connections.
    pub max_bytes_total: usize,
    /// A client must reach the transmission phase within this time.
    pub handshake_timeout: Duration,
    /// Options per handshake before the server hangs up.
    pub max_options: usize,
    /// Largest option data accepted (spec: a server may refuse big options).
    pub max_option_len: u32,
    /// Maximum payload advertised in NBD_INFO_BLOCK_SIZE and enforced.
    pub max_payload: u32,
    /// After shutdown is requested, connections get this long to finish
    /// their in-flight requests before they are dropped.
    pub shutdown_grace: Duration,
    /// Start writing back each page-cache write of WRITE_BEHIND_MIN or more
    /// as soon as it is done (sync_file_range WRITE), so that a client's
    /// final FLUSH finds little left to write. A bulk import that ends with
    /// a flush gains; a stream of writes that is never flushed pays for
    /// device writes it would otherwise not have made in that time.
    pub write_behind: bool,
    /// Receive page-cache writes of MAP_WRITE_MIN or more straight into the
    /// target's mapped page cache (`Target::map_write`). A client that
    /// vanishes mid-payload then leaves the part that arrived written;
    /// without it a write lands only once its whole payload is in.
    pub map_writes: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            export_name: String::new(),
            description: String::new(),
            read_only: false,
            max_connections: 64,
            max_requests_per_conn: 256,
            max_bytes_per_conn: 128 << 20,
            max_bytes_total: 512 << 20,
            handshake_timeout: Duration::from_secs(30),
            max_options: 64,
            max_option_len: 64 << 10,
            max_payload: 32 << 20,
            shutdown_grace: Duration::from_secs(10),
            write_behind: false,
            map_writes: false,
        }
    }
}

/// Writes of at least this many bytes start their write-back at once under
/// `write_behind` (nbdcopy writes 256 KiB at a time, qemu-img 2 MiB).
const WRITE_BEHIND_MIN: u64 = 256 << 10;
/// Reads at least this long ask the storage for holes first and answer them
/// with hole chunks; below it a lookup costs more than reading zeros.
const SPARSE_READ_MIN: u64 = 64 << 10;
/// Extents looked up for one sparse read.
const SPARSE_READ_RUNS: usize = 64;
/// A hole lookup slower than this that found only data...
const SPARSE_LOOKUP_SLOW: Duration = Duration::from_micros(200);
/// ...makes this many following reads skip the lookup.
const SPARSE_SKIP_READS: u64 = 64;
/// Descriptors in one block status reply (the spec's SHOULD limit is 2^20;
/// clients ask again from where the reply ends).
const MAX_DESCRIPTORS: usize = 16 << 10;
/// Replies and payloads are laid out so the data starts on this boundary,
/// which lets O_DIRECT use the buffer without a bounce copy.
const DATA_ALIGN: usize = 4096;
/// At most this many small requests run as one blocking job...
const BATCH_MAX: usize = 16;
/// ...and only reads and writes up to this length.
const BATCH_MAX_LEN: u64 = 64 << 10;
/// Page-cache writes of at least this many bytes are received straight into
/// the target's mapped page cache (`Target::map_write`): one copy instead of
/// two, and no trip through the blocking pool.
const MAP_WRITE_MIN: u64 = 64 << 10;
/// Read-ahead of the request reader.
const READ_AHEAD: usize = 64 << 10;
/// Largest read or write run on the connection's reader when it is alone
/// (qemu-img convert writes 2 MiB at a time).
const INLINE_MAX_LEN: u64 = 4 << 20;
/// Largest page-cache write run on the reader while others are in flight
/// (see `transmission`). Measured at 256 KiB and 1 MiB only: a 256 KiB
/// payload is still in the CPU's 2 MiB L2 when it is written (fio 256 KiB
/// writes: ext4 +9 %, XFS +30 %, a loop device +27 %); at 1 MiB (and
/// qemu-img convert's 2 MiB) the
/// overlap of receiving one payload while the pool writes another was worth
/// more: ext4 1 MiB 2,276 -> 1,793 MiB/s.
const OWN_WRITE_MAX: u64 = 256 << 10;
/// How much a look for a queued request may read after a big payload: a
/// header and a little of its payload, which then costs one extra copy.
const PEEK_AHEAD: usize = 4 << 10;
/// Page-cache reads of at least this many bytes are spliced to the socket
/// (splice_read): below it a copy costs less than the splice calls and the
/// header's own send.
const SPLICE_MIN: u64 = 64 << 10;
/// Size of each pipe: /proc/sys/fs/pipe-max-size's default, the most a
/// process without CAP_SYS_RESOURCE may ask for.
const PIPE_BYTES: usize = 1 << 20;
/// Empty pipes kept between reads.
const PIPES_KEPT: usize = 32;
/// Pipes in existence at once, kept or in flight (two descriptors each).
const PIPES_MAX: usize = 128;
/// Granularity of pooled buffer sizes.
const POOL_ROUND: usize = 64 << 10;
/// Context id handed out for base:allocation.
const BASE_ALLOCATION_ID: u32 = 1;

/// A listening socket the server accepts on.
pub enum Listener {
    Unix(tokio::net::UnixListener),
    Tcp(tokio::net::TcpListener),
}

/// One export served to any number of connections.
pub struct Server {
    shared: Arc<Shared>,
}

struct Shared {
    target: Arc<Target>,
    cfg: ServerConfig,
    read_only: bool,
    min_block: u32,
    preferred_block: u32,
    conns: Arc<Semaphore>,
    bytes_total: Arc<Semaphore>,
    bytes_per_conn: usize,
    pool: BufPool,
    pipes: PipePool,
    caps_logged: AtomicU64,
    next_conn: AtomicU64,
    sparse_skip: AtomicU64,
}

impl Server {
    pub fn new(target: Arc<Target>, mut cfg: ServerConfig) -> Server {
        // The limits must admit the largest request, or it would wait forever.
        let biggest = cfg.max_payload as usize + 2 * DATA_ALIGN;
        cfg.max_bytes_total = cfg.max_bytes_total.max(biggest);
        let bytes_per_conn = cfg.max_bytes_per_conn.max(biggest);
        cfg.max_requests_per_conn = cfg.max_requests_per_conn.max(1);
        let read_only = cfg.read_only || target.is_read_only();
        let (min_block, preferred_block) = block_sizes(&target, cfg.max_payload);
        let caps_gen = target.caps().generation();
        Server {
            shared: Arc::new(Shared {
                conns: Arc::new(Semaphore::new(cfg.max_connections.max(1))),
                bytes_total: Arc::new(Semaphore::new(cfg.max_bytes_total)),
                bytes_per_conn,
                pool: BufPool::new(16, (4 << 20) + 2 * DATA_ALIGN),
                pipes: PipePool::new(),
                caps_logged: AtomicU64::new(caps_gen),
                next_conn: AtomicU64::new(1),
                sparse_skip: AtomicU64::new(0),
                target,
                cfg,
                read_only,
                min_block,
                preferred_block,
            }),
        }
    }

    /// (minimum, preferred, maximum payload) as advertised in
    /// NBD_INFO_BLOCK_SIZE.
    pub fn block_sizes(&self) -> (u32, u32, u32) {
        let s = &self.shared;
        (s.min_block, s.preferred_block, s.cfg.max_payload)
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
        loop {
            let accepted = tokio::select! {
                _ = shutdown.wait_for(|v| *v) => break,
                a = accept(&listener) => a,
            };
            while tasks.try_join_next().is_some() {}
            let (rd, wr, sink, peer) = match accepted {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(permit) = sh.conns.clone().try_acquire_owned() else {
                warn!(
                    "refusing connection from {peer}: already serving {} connections",
                    sh.cfg.max_connections
                );
                continue;
            };
            let id = sh.next_conn.fetch_add(1, Ordering::Relaxed);
            let span = tracing::debug_span!("conn", id);
            let fut = connection(
                sh.clone(),
                rd,
                wr,
                Some(sink),
                peer,
                shutdown.clone(),
                permit,
            );
            tasks.spawn(fut.instrument(span));
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
        let target = sh.target.clone();
        if !sh.read_only {
            match tokio::task::spawn_blocking(move || target.flush()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(io::Error::other(format!("final flush: {e}"))),
                Err(e) => return Err(io::Error::other(format!("final flush: {e}"))),
            }
        }
        Ok(())
    }

    /// Serves one already-connected stream (tests, socket activation of a
    /// single connection, pipes). Returns when the connection ends.
    pub async fn serve_stream<S>(&self, stream: S, shutdown: watch::Receiver<bool>)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let sh = &self.shared;
        let Ok(permit) = sh.conns.clone().try_acquire_owned() else {
            warn!("refusing stream: connection limit reached");
            return;
        };
        let (rd, wr) = tokio::io::split(stream);
        connection(sh.clone(), rd, wr, None, "stream".into(), shutdown, permit).await;
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

// ---------------------------------------------------------------------------
// Connection
// ---------------------------------------------------------------------------

/// What the handshake settled for the transmission phase.
#[derive(Debug, Clone)]
struct Session {
    mode: ReplyMode,
    flags: u16,
    size: u64,
    /// Context id of base:allocation if the client selected it for this export.
    base_allocation: Option<u32>,
    /// The client asked for NBD_INFO_BLOCK_SIZE in NBD_OPT_GO and so promised
    /// to honour the minimum block size (spec: Size constraints).
    enforce_min_block: bool,
    min_block: u32,
    max_payload: u32,
    /// The connection is a socket that read data can be spliced into.
    splice: bool,
}

fn protocol_error(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

async fn connection<R, W>(
    sh: Arc<Shared>,
    rd: R,
    wr: W,
    sink: Option<RawSock>,
    peer: String,
    mut shutdown: watch::Receiver<bool>,
    _conn_permit: OwnedSemaphorePermit,
) where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    debug!("connection from {peer}");
    let mut rd = Input::new(rd);
    let mut wr = BufWriter::with_capacity(64 << 10, wr);
    let hs = tokio::select! {
        r = tokio::time::timeout(sh.cfg.handshake_timeout, handshake(&sh, &mut rd, &mut wr)) => r,
        _ = shutdown.wait_for(|v| *v) => {
            debug!("shutting down during handshake");
            return;
        }
    };
    let session = match hs {
        Err(_) => {
            warn!(
                "{peer}: handshake not finished within {:?}; closing",
                sh.cfg.handshake_timeout
            );
            return;
        }
        Ok(Err(e)) => {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                debug!("{peer}: closed during handshake");
            } else {
                warn!("{peer}: handshake failed: {e}");
            }
            return;
        }
        Ok(Ok(None)) => {
            debug!("{peer}: client aborted the handshake");
            return;
        }
        Ok(Ok(Some(s))) => s,
    };
    let mut session = session;
    session.splice = sink.is_some();
    debug!(
        "{peer}: negotiated {} replies, flags {}, size {}, base:allocation {}, block size {} ({})",
        match session.mode {
            ReplyMode::Simple => "simple",
            ReplyMode::Structured => "structured",
            ReplyMode::Extended => "extended-header",
        },
        flag_names(session.flags),
        session.size,
        if session.base_allocation.is_some() {
            "on"
        } else {
            "off"
        },
        session.min_block,
        if session.enforce_min_block {
            "agreed"
        } else {
            "not requested"
        },
    );
    let result = transmission(sh, rd, wr, session, sink, shutdown).await;
    match result {
        Ok(()) => debug!("{peer}: connection closed"),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            debug!("{peer}: client went away")
        }
        Err(e) => warn!("{peer}: connection ended: {e}"),
    }
}

fn flag_names(f: u16) -> String {
    let names = [
        (FLAG_READ_ONLY, "READ_ONLY"),
        (FLAG_SEND_FLUSH, "FLUSH"),
        (FLAG_SEND_FUA, "FUA"),
        (FLAG_ROTATIONAL, "ROTATIONAL"),
        (FLAG_SEND_TRIM, "TRIM"),
        (FLAG_SEND_WRITE_ZEROES, "WRITE_ZEROES"),
        (FLAG_SEND_DF, "DF"),
        (FLAG_CAN_MULTI_CONN, "MULTI_CONN"),
        (FLAG_SEND_CACHE, "CACHE"),
        (FLAG_SEND_FAST_ZERO, "FAST_ZERO"),
    ];
    let mut s = String::new();
    for (bit, name) in names {
        if f & bit != 0 {
            if !s.is_empty() {
                s.push('|');
            }
            s.push_str(name);
        }
    }
    s
}

/// Transmission flags from what the target can do. Computed once per
/// connection, so they never change while it lasts.
fn transmission_flags(sh: &Shared) -> u16 {
    let t = &sh.target;
    let mut f =
        FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA | FLAG_SEND_CACHE | FLAG_CAN_MULTI_CONN;
    if sh.read_only {
        f |= FLAG_READ_ONLY;
    } else {
        f |= FLAG_SEND_WRITE_ZEROES;
        if t.can_trim() {
            f |= FLAG_SEND_TRIM;
        }
        if t.can_fast_zero() {
            f |= FLAG_SEND_FAST_ZERO;
        }
    }
    if t.geometry().rotational {
        f |= FLAG_ROTATIONAL;
    }
    f
}

async fn send<W: AsyncWrite + Unpin>(wr: &mut W, out: &mut Vec<u8>) -> io::Result<()> {
    wr.write_all(out).await?;
    wr.flush().await?;
    out.clear();
    Ok(())
}

/// The option haggling phase. Ok(None): the client aborted.
async fn handshake<R, W>(sh: &Shared, rd: &mut Input<R>, wr: &mut W) -> io::Result<Option<Session>>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let cfg = &sh.cfg;
    let mut out = Vec::with_capacity(512);
    encode_greeting(&mut out, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    send(wr, &mut out).await?;

    let mut b4 = [0u8; 4];
    rd.read_exact(&mut b4, 0).await?;
    let cflags = u32::from_be_bytes(b4);
    // Spec (Client flags): the server MUST drop the connection on unknown flags.
    if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(protocol_error(format!("unknown client flags {cflags:#x}")));
    }
    let no_zeroes = cflags & FLAG_C_NO_ZEROES != 0;

    let mut mode = ReplyMode::Simple;
    // (export name, selected base:allocation) from the last SET_META_CONTEXT.
    let mut meta: Option<(String, bool)> = None;
    // Flags are fixed at the first INFO/GO so INFO and GO agree (spec).
    let mut base_flags: Option<u16> = None;
    let mut data = Vec::new();

    for _ in 0..cfg.max_options {
        let mut hb = [0u8; OPTION_HEADER_LEN];
        rd.read_exact(&mut hb, 0).await?;
        let (h, _) = decode_option_header(&hb).map_err(|e| protocol_error(e.to_string()))?;
        let name = option_name(h.option);
        if h.len > cfg.max_option_len {
            // Skipping megabytes of a hostile option is not worth it: say
            // why, then hang up (spec: a server MAY hard disconnect on DoS).
            let msg = format!(
                "{name} data of {} bytes exceeds the limit of {}",
                h.len, cfg.max_option_len
            );
            OptionReply::Error {
                reply: REP_ERR_TOO_BIG,
                message: msg.clone(),
            }
            .encode(h.option, &mut out);
            let _ = send(wr, &mut out).await;
            return Err(protocol_error(msg));
        }
        data.resize(h.len as usize, 0);
        rd.read_exact(&mut data, 0).await?;
        trace!("option {name} ({} bytes)", h.len);

        let opt = match ClientOption::parse(h.option, &data) {
            Ok(o) => o,
            Err(e) => {
                if h.option == OPT_EXPORT_NAME {
                    return Err(protocol_error(format!("{name}: {e}")));
                }
                reply_err(
                    wr,
                    &mut out,
                    h.option,
                    REP_ERR_INVALID,
                    &format!("{name}: {e}"),
                )
                .await?;
                continue;
            }
        };
        match opt {
            ClientOption::ExportName(export) => {
                // No way to report an error here: the spec says hang up.
                if export != cfg.export_name {
                    return Err(protocol_error(format!(
                        "NBD_OPT_EXPORT_NAME for unknown export {export:?}"
                    )));
                }
                let flags =
                    *base_flags.get_or_insert_with(|| transmission_flags(sh)) | df_flag(mode);
                let size = sh.target.size();
                encode_export_name_reply(&mut out, size, flags, no_zeroes);
                send(wr, &mut out).await?;
                let base_allocation = meta_for(&meta, &export);
                return Ok(Some(session(sh, mode, flags, size, base_allocation, false)));
            }
            ClientOption::Abort => {
                OptionReply::Ack.encode(h.option, &mut out);
                // The client may already be gone (spec: handle both).
                let _ = send(wr, &mut out).await;
                return Ok(None);
            }
            ClientOption::List => {
                OptionReply::Server {
                    name: cfg.export_name.clone(),
                    description: cfg.description.clone(),
                }
                .encode(h.option, &mut out);
                OptionReply::Ack.encode(h.option, &mut out);
                send(wr, &mut out).await?;
            }
            ClientOption::StartTls => {
                reply_err(
                    wr,
                    &mut out,
                    h.option,
                    REP_ERR_POLICY,
                    "TLS is not configured on this server",
                )
                .await?;
            }
            ClientOption::StructuredReply | ClientOption::ExtendedHeaders => {
                let want = if h.option == OPT_EXTENDED_HEADERS {
                    ReplyMode::Extended
                } else {
                    ReplyMode::Structured
                };
                // Structured -> extended is an upgrade; the way back is not
                // (spec: NBD_REP_ERR_EXT_HEADER_REQD), and repeating one is
                // invalid.
                let refusal = match (mode, want) {
                    (ReplyMode::Extended, ReplyMode::Structured) => Some((
                        REP_ERR_EXT_HEADER_REQD,
                        "extended headers already negotiated",
                    )),
                    (m, w) if m == w => Some((REP_ERR_INVALID, "already negotiated")),
                    _ => None,
                };
                match refusal {
                    Some((rep, msg)) => reply_err(wr, &mut out, h.option, rep, msg).await?,
                    None => {
                        mode = want;
                        OptionReply::Ack.encode(h.option, &mut out);
                        send(wr, &mut out).await?;
                    }
                }
            }
            ClientOption::ListMetaContext(req) | ClientOption::SetMetaContext(req) => {
                let set = h.option == OPT_SET_META_CONTEXT;
                if set {
                    // Spec: SET replaces the selection even when it fails.
                    meta = None;
                }
                if !mode.structured() {
                    reply_err(
                        wr,
                        &mut out,
                        h.option,
                        REP_ERR_INVALID,
                        "negotiate structured replies first",
                    )
                    .await?;
                    continue;
                }
                if req.name != cfg.export_name {
                    let msg = format!("no export named {:?}", req.name);
                    reply_err(wr, &mut out, h.option, REP_ERR_UNKNOWN, &msg).await?;
                    continue;
                }
                let matches = if set {
                    // "base:" alone selects nothing during SET (spec).
                    req.queries
                        .iter()
                        .any(|q| q == META_CONTEXT_BASE_ALLOCATION)
                } else {
                    req.queries.is_empty()
                        || req
                            .queries
                            .iter()
                            .any(|q| q == "base:" || q == META_CONTEXT_BASE_ALLOCATION)
                };
                if matches {
                    OptionReply::MetaContext {
                        // LIST: the id is reserved and SHOULD be zero.
                        id: if set { BASE_ALLOCATION_ID } else { 0 },
                        name: META_CONTEXT_BASE_ALLOCATION.into(),
                    }
                    .encode(h.option, &mut out);
                }
                OptionReply::Ack.encode(h.option, &mut out);
                send(wr, &mut out).await?;
                if set {
                    meta = Some((req.name, matches));
                }
            }
            ClientOption::Info(req) | ClientOption::Go(req) => {
                let go = h.option == OPT_GO;
                if req.name != cfg.export_name {
                    let msg = format!("no export named {:?}", req.name);
                    reply_err(wr, &mut out, h.option, REP_ERR_UNKNOWN, &msg).await?;
                    continue;
                }
                let flags =
                    *base_flags.get_or_insert_with(|| transmission_flags(sh)) | df_flag(mode);
                let size = sh.target.size();
                OptionReply::Info(Info::Export { size, flags }).encode(h.option, &mut out);
                if req.info.contains(&INFO_NAME) {
                    OptionReply::Info(Info::Name(cfg.export_name.clone()))
                        .encode(h.option, &mut out);
                }
                if req.info.contains(&INFO_DESCRIPTION) && !cfg.description.is_empty() {
                    OptionReply::Info(Info::Description(cfg.description.clone()))
                        .encode(h.option, &mut out);
                }
                // Sent even when not asked for: clients that understand it
                // benefit, the others must ignore it (spec: NBD_OPT_INFO).
                OptionReply::Info(Info::BlockSize {
                    min: sh.min_block,
                    preferred: sh.preferred_block,
                    max: cfg.max_payload,
                })
                .encode(h.option, &mut out);
                OptionReply::Ack.encode(h.option, &mut out);
                send(wr, &mut out).await?;
                if go {
                    let base_allocation = meta_for(&meta, &req.name);
                    let agreed = req.info.contains(&INFO_BLOCK_SIZE);
                    return Ok(Some(session(
                        sh,
                        mode,
                        flags,
                        size,
                        base_allocation,
                        agreed,
                    )));
                }
            }
            ClientOption::Unknown { option, .. } => {
                let msg = format!("option {option} is not supported");
                reply_err(wr, &mut out, option, REP_ERR_UNSUP, &msg).await?;
            }
        }
    }
    Err(protocol_error(format!(
        "more than {} options without entering transmission",
        cfg.max_options
    )))
}

fn df_flag(mode: ReplyMode) -> u16 {
    // Spec: SEND_DF only when structured replies are in use.
    if mode.structured() {
        FLAG_SEND_DF
    } else {
        0
    }
}

fn meta_for(meta: &Option<(String, bool)>, export: &str) -> Option<u32> {
    match meta {
        Some((name, true)) if name == export => Some(BASE_ALLOCATION_ID),
        _ => None,
    }
}

fn session(
    sh: &Shared,
    mode: ReplyMode,
    flags: u16,
    size: u64,
    base_allocation: Option<u32>,
    enforce_min_block: bool,
) -> Session {
    Session {
        mode,
        flags,
        size,
        base_allocation: if mode.structured() {
            base_allocation
        } else {
            None
        },
        enforce_min_block,
        min_block: sh.min_block,
        max_payload: sh.cfg.max_payload,
        splice: false,
    }
}

async fn reply_err<W: AsyncWrite + Unpin>(
    wr: &mut W,
    out: &mut Vec<u8>,
    option: u32,
    reply: u32,
    message: &str,
) -> io::Result<()> {
    debug!(
        "{} -> {}: {message}",
        option_name(option),
        reply_type_name(reply)
    );
    OptionReply::Error {
        reply,
        message: message.to_string(),
    }
    .encode(option, out);
    send(wr, out).await
}

// ---------------------------------------------------------------------------
// Transmission
// ---------------------------------------------------------------------------

/// Resources a request holds until its reply is on the socket.
struct Permits {
    _slot: OwnedSemaphorePermit,
    _conn_bytes: Option<OwnedSemaphorePermit>,
    _total_bytes: Option<OwnedSemaphorePermit>,
}

/// A finished reply on its way to the writer.
struct Out {
    reply: Encoded,
    _permits: Permits,
}

async fn transmission<R, W>(
    sh: Arc<Shared>,
    mut rd: Input<R>,
    wr: BufWriter<W>,
    s: Session,
    sink: Option<RawSock>,
    mut shutdown: watch::Receiver<bool>,
) -> io::Result<()>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let s = Arc::new(s);
    // Unbounded is safe: every message holds a request slot, so at most
    // max_requests_per_conn messages exist.
    let (tx, rx) = mpsc::unbounded_channel::<Out>();
    // Shared by the writer task (replies from blocking threads) and this
    // reader (replies of requests it ran itself); the lock keeps replies
    // from interleaving on the socket.
    let wr = Arc::new(tokio::sync::Mutex::new(wr));
    let writer = tokio::spawn(writer(wr.clone(), rx, sh.clone(), sink.clone()).in_current_span());
    let slots = Arc::new(Semaphore::new(sh.cfg.max_requests_per_conn));
    let conn_bytes = Arc::new(Semaphore::new(sh.bytes_per_conn));
    let ext = s.mode.extended();
    let hlen = request_header_len(ext);
    let mut hdr = [0u8; EXTENDED_REQUEST_LEN];
    let mut result = Ok(());
    // Bytes to read ahead with a header: many small requests per syscall,
    // but after a big payload none, since read-ahead would be payload bytes
    // copied twice (socket -> buffer -> payload buffer).
    let mut read_ahead = READ_AHEAD;
    let mut batch: Vec<Job> = Vec::with_capacity(BATCH_MAX);

    loop {
        if tx.is_closed() {
            break;
        }
        // Never wait with a batch held back: its requests hold slots and
        // bytes that waiting may need.
        let slot = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                dispatch(&sh, &s, &tx, &mut batch);
                tokio::select! {
                    p = slots.clone().acquire_owned() => p.expect("semaphore never closed"),
                    _ = shutdown.wait_for(|v| *v) => break,
                }
            }
        };
        // A held-back batch waits for nothing but the next buffered header.
        if rd.buffered() < hlen {
            dispatch(&sh, &s, &tx, &mut batch);
        }
        let read = tokio::select! {
            r = rd.read_exact(&mut hdr[..hlen], read_ahead) => r,
            _ = shutdown.wait_for(|v| *v) => break,
        };
        if let Err(e) = read {
            if e.kind() != io::ErrorKind::UnexpectedEof {
                result = Err(e);
            }
            // EOF between requests is a client hanging up without DISC.
            break;
        }
        let req = match decode_request(&hdr[..hlen], ext) {
            Ok((r, _)) => r,
            Err(e) => {
                // Without a valid header there is no way to find the next
                // one: hard disconnect (spec: violation of a MUST).
                result = Err(protocol_error(format!("bad request header: {e}")));
                break;
            }
        };
        trace!(
            "{} flags {:#x} offset {} length {} cookie {:#x}",
            command_name(req.typ),
            req.flags,
            req.offset,
            req.length,
            req.cookie
        );
        let to = ReplyTo {
            cookie: req.cookie,
            offset: req.offset,
        };
        if req.typ == CMD_DISC {
            // Spec: finish what is in flight, then close; no reply.
            break;
        }
        let payload = req.payload_len(ext);
        read_ahead = if payload >= READ_AHEAD as u64 / 4 {
            0
        } else {
            READ_AHEAD
        };
        if payload > s.max_payload as u64 {
            // Reading it would cost unbounded memory or time, and skipping it
            // unread would parse data as requests: answer, then hang up.
            let msg = format!(
                "payload of {payload} bytes exceeds the maximum of {}",
                s.max_payload
            );
            let buf = small_error(&s, to, NBD_EINVAL, &msg);
            send_small(&tx, buf, slot);
            result = Err(protocol_error(msg));
            break;
        }
        let check = validate(&s, &req);
        // Bytes this request will hold: its payload, or the read reply.
        let need = match (&check, req.typ) {
            (Ok(()), CMD_READ) => req.length as usize + 2 * DATA_ALIGN,
            _ if payload > 0 => payload as usize + DATA_ALIGN,
            _ => 0,
        };
        let ready = if need > 0 {
            let c = conn_bytes.clone().try_acquire_many_owned(need as u32).ok();
            let t = sh
                .bytes_total
                .clone()
                .try_acquire_many_owned(need as u32)
                .ok();
            match (c, t) {
                (Some(c), Some(t)) => Some((c, t)),
                _ => None,
            }
        } else {
            None
        };
        if need > 0 && ready.is_none() {
            dispatch(&sh, &s, &tx, &mut batch);
        }
        let bytes = if let Some(p) = ready {
            Some(p)
        } else if need > 0 {
            let limits = async {
                let c = conn_bytes
                    .clone()
                    .acquire_many_owned(need as u32)
                    .await
                    .expect("semaphore never closed");
                let t = sh
                    .bytes_total
                    .clone()
                    .acquire_many_owned(need as u32)
                    .await
                    .expect("semaphore never closed");
                (c, t)
            };
            tokio::select! {
                p = limits => Some(p),
                _ = shutdown.wait_for(|v| *v) => break,
            }
        } else {
            None
        };
        let permits = match bytes {
            Some((c, t)) => Permits {
                _slot: slot,
                _conn_bytes: Some(c),
                _total_bytes: Some(t),
            },
            None => Permits {
                _slot: slot,
                _conn_bytes: None,
                _total_bytes: None,
            },
        };

        // A page-cache write of a good size goes straight from the socket
        // into the page cache, here on the reader (not with FUA: that needs
        // the RWF_DSYNC write). What the reader already read ahead of the
        // payload (at most 64 KiB, after small requests) is written first;
        // if that fails, the rest is read the ordinary way and the head's
        // error is the answer.
        let mut req = req;
        let mut failed = None;
        let head = rd.buffered().min(payload as usize) as u64;
        if sh.cfg.map_writes
            && payload >= MAP_WRITE_MIN
            && payload - head >= MAP_WRITE_MIN
            && req.typ == CMD_WRITE
            && check.is_ok()
            && req.flags & CMD_FLAG_FUA == 0
        {
            if let Some((sock, mut mw)) = sink.as_ref().and_then(|sock| {
                let mw = sh
                    .target
                    .map_write(req.offset + head, (payload - head) as usize)?;
                Some((sock, mw))
            }) {
                if head > 0 {
                    let r = sh
                        .target
                        .write_at(rd.take(head as usize), req.offset, false);
                    if let Err(e) = r {
                        failed = Some(storage_error(&s, &req, to, "write", &e));
                    }
                    req.offset += head;
                    req.length -= head;
                }
                if failed.is_none() {
                    // Waiting for the payload must not hold back a batch.
                    dispatch(&sh, &s, &tx, &mut batch);
                    let r = tokio::select! {
                        r = sock.recv_mapped(&mut mw) => r,
                        _ = shutdown.wait_for(|v| *v) => break,
                    };
                    let got = mw.received() as u64;
                    drop(mw);
                    match r {
                        Ok(()) => {
                            if sh.cfg.write_behind && payload >= WRITE_BEHIND_MIN {
                                sh.target.start_writeback(to.offset, payload);
                            }
                            let _ = tx.send(Out {
                                reply: whole(small_ok(&s, to)),
                                _permits: permits,
                            });
                            continue;
                        }
                        // A page that could not be faulted in (no space, an
                        // I/O error): the rest is written the ordinary way,
                        // which reports the error.
                        Err(e) if e.raw_os_error() == Some(libc::EFAULT) => {
                            debug!("mapped write at {}: {e} after {got} bytes", req.offset);
                            req.offset += got;
                            req.length -= got;
                        }
                        Err(e) => {
                            if e.kind() != io::ErrorKind::UnexpectedEof {
                                result = Err(e);
                            }
                            break;
                        }
                    }
                }
            }
        }
        let payload = req.payload_len(ext);

        let mut data = None;
        if payload > 0 {
            let n = payload as usize;
            if rd.buffered() < n {
                dispatch(&sh, &s, &tx, &mut batch);
            }
            let (mut buf, start) = sh.pool.get(0, n);
            let r = tokio::select! {
                r = rd.read_exact(&mut buf[start..start + n], read_ahead) => r,
                _ = shutdown.wait_for(|v| *v) => break,
            };
            if let Err(e) = r {
                // Client vanished mid-payload: nothing to write.
                if e.kind() != io::ErrorKind::UnexpectedEof {
                    result = Err(e);
                }
                break;
            }
            data = Some((buf, start, n));
        }

        if let Some(reply) = failed {
            if let Some((buf, _, _)) = data {
                sh.pool.put(buf);
            }
            let _ = tx.send(Out {
                reply,
                _permits: permits,
            });
            continue;
        }
        if let Err((err, msg)) = check {
            debug!(
                "{} offset {} length {}: {}: {msg}",
                command_name(req.typ),
                req.offset,
                req.length,
                error_name(err)
            );
            if let Some((buf, _, _)) = data {
                sh.pool.put(buf);
            }
            let _ = tx.send(Out {
                reply: whole(small_error(&s, to, err, msg)),
                _permits: permits,
            });
            continue;
        }

        let job = Job {
            req,
            to,
            data,
            permits,
        };
        // Small page-cache reads and writes cost less than handing one to a
        // blocking thread: while more requests are already buffered, gather
        // them and hand them over together. Anything else goes alone, so big
        // or slow requests still run in parallel.
        let small = matches!(req.typ, CMD_READ | CMD_WRITE)
            && req.length <= BATCH_MAX_LEN
            && req.flags & CMD_FLAG_FUA == 0;
        // A request with nothing else in flight or buffered (a client that
        // waits for each reply: qemu-img convert without -W, any queue depth
        // of 1) runs right here and its reply is written from here: handing
        // it to a blocking thread and the reply to the writer task cost two
        // thread wake-ups, which at queue depth 1 is all latency
        // (bench/qd1.sh on tmpfs, per request: 4 KiB writes 86 -> 50 us,
        // 4 KiB reads 71 -> 54 us). Only reads and writes of at most INLINE_MAX_LEN, whose
        // cost is a bounded copy: a zero or trim may take milliseconds (a
        // 64 MiB punch on ext4, zeros written on ramfs) and FLUSH may wait
        // on a disk, and a request that the client sends a moment later
        // would wait behind it instead of running beside it.
        // Whether the client sent more is only known by looking: without
        // that, a client with 16 big writes queued would have them run one
        // after the other here (each header arrives after the previous
        // payload) instead of in parallel on the pool.
        let idle = batch.is_empty()
            && slots.available_permits() + 1 == sh.cfg.max_requests_per_conn
            && matches!(req.typ, CMD_READ | CMD_WRITE)
            && req.length <= INLINE_MAX_LEN;
        // A mid-sized page-cache write also runs here, whatever else is in
        // flight: its payload was just copied in by this thread and is
        // still in this CPU's cache, and file systems take the inode lock
        // for every buffered write (ext4, XFS and tmpfs alike), so pwrites
        // from several threads only queue on it. Handed to the pool, a
        // payload waited behind up to 15 others and was copied out by
        // another CPU: fio 256 KiB writes to XFS cost 0.46-0.52 s of server
        // CPU per GiB with 20k context switches, against 0.33-0.36 s and
        // 3.5k here, with one payload buffer in memory instead of 16. A
        // loop device's page cache (no inode lock) gained as much: fio
        // 256 KiB 1,985 -> 2,528 MiB/s. Not under O_DIRECT, where a write
        // waits on the device and the pool's threads are its queue depth.
        let own_write = sh.target.cache_mode() == CacheMode::Writeback
            && req.typ == CMD_WRITE
            && req.flags & CMD_FLAG_FUA == 0
            && req.length > BATCH_MAX_LEN
            && req.length <= OWN_WRITE_MAX;
        if own_write {
            dispatch(&sh, &s, &tx, &mut batch);
        }
        // (Any byte buffered, even part of a header, is a next request.) An
        // own write runs here whatever is queued: no need to look.
        if idle && !own_write && rd.buffered() == 0 {
            if let Err(e) = rd.top_up(read_ahead.max(PEEK_AHEAD)).await {
                result = Err(e);
                break;
            }
        }
        let alone = own_write || (idle && rd.buffered() == 0);
        if alone {
            let reply = execute(&sh, &s, &job.req, job.to, job.data);
            sh.note_caps();
            let mut w = wr.lock().await;
            let sent = async {
                put_reply(&sh, &mut w, sink.as_ref(), reply).await?;
                w.flush().await
            }
            .await;
            drop(w);
            drop(job.permits);
            if let Err(e) = sent {
                result = Err(e);
                break;
            }
        } else if small {
            batch.push(job);
            if batch.len() >= BATCH_MAX || rd.buffered() < hlen {
                dispatch(&sh, &s, &tx, &mut batch);
            }
        } else {
            dispatch(&sh, &s, &tx, &mut batch);
            batch.push(job);
            dispatch(&sh, &s, &tx, &mut batch);
        }
    }
    dispatch(&sh, &s, &tx, &mut batch);

    // In-flight requests hold clones of tx: the writer ends after their
    // replies are sent.
    drop(tx);
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

/// A validated request with everything it needs to run.
struct Job {
    req: Request,
    to: ReplyTo,
    data: Option<(Vec<u8>, usize, usize)>,
    permits: Permits,
}

/// Hands the gathered requests to one blocking thread, which runs them in
/// order and queues each reply as soon as it is done.
fn dispatch(
    sh: &Arc<Shared>,
    s: &Arc<Session>,
    tx: &mpsc::UnboundedSender<Out>,
    batch: &mut Vec<Job>,
) {
    if batch.is_empty() {
        return;
    }
    let jobs = std::mem::replace(batch, Vec::with_capacity(BATCH_MAX));
    let (sh, s, tx) = (sh.clone(), s.clone(), tx.clone());
    tokio::task::spawn_blocking(move || {
        for j in jobs {
            let reply = execute(&sh, &s, &j.req, j.to, j.data);
            let _ = tx.send(Out {
                reply,
                _permits: j.permits,
            });
        }
        sh.note_caps();
    });
}

fn send_small(tx: &mpsc::UnboundedSender<Out>, buf: Vec<u8>, slot: OwnedSemaphorePermit) {
    let _ = tx.send(Out {
        reply: whole(buf),
        _permits: Permits {
            _slot: slot,
            _conn_bytes: None,
            _total_bytes: None,
        },
    });
}

async fn writer<W: AsyncWrite + Unpin>(
    wr: Arc<tokio::sync::Mutex<BufWriter<W>>>,
    mut rx: mpsc::UnboundedReceiver<Out>,
    sh: Arc<Shared>,
    sink: Option<RawSock>,
) -> io::Result<()> {
    while let Some(out) = rx.recv().await {
        let mut wr = wr.lock().await;
        put_reply(&sh, &mut wr, sink.as_ref(), out.reply).await?;
        // Coalesce whatever else is ready into the same flush.
        while let Ok(out) = rx.try_recv() {
            put_reply(&sh, &mut wr, sink.as_ref(), out.reply).await?;
        }
        wr.flush().await?;
    }
    wr.lock().await.shutdown().await
}

/// Queues one reply on the buffered writer; a spliced read's header is
/// flushed and its data spliced from the pipes to the socket behind it.
async fn put_reply<W: AsyncWrite + Unpin>(
    sh: &Shared,
    wr: &mut BufWriter<W>,
    sink: Option<&RawSock>,
    reply: Encoded,
) -> io::Result<()> {
    wr.write_all(&reply.buf[reply.start..reply.end]).await?;
    sh.pool.put(reply.buf);
    if reply.spliced.is_empty() {
        return Ok(());
    }
    let sink = sink.expect("spliced replies only on sessions with a splice sink");
    wr.flush().await?;
    for sp in reply.spliced {
        sink.send_from(&sp.pipe, sp.len).await?;
        // Only an emptied pipe goes back: an error above drops the rest
        // with whatever they still hold.
        sh.pipes.put(sp.pipe);
    }
    Ok(())
}

impl Shared {
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
        if matches!(t.allocated_bytes(), Ok(a) if a >= size) {
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
            info!("storage capabilities: {}", caps.snapshot());
        }
    }
}

type Reject = (u32, &'static str);

/// Checks a request against the spec and the session before any work.
fn validate(s: &Session, req: &Request) -> Result<(), Reject> {
    let ext = s.mode.extended();
    let allowed = match req.typ {
        CMD_READ => {
            CMD_FLAG_FUA
                | if s.flags & FLAG_SEND_DF != 0 {
                    CMD_FLAG_DF
                } else {
                    0
                }
        }
        CMD_WRITE => CMD_FLAG_FUA | if ext { CMD_FLAG_PAYLOAD_LEN } else { 0 },
        CMD_WRITE_ZEROES => {
            CMD_FLAG_FUA
                | CMD_FLAG_NO_HOLE
                | if s.flags & FLAG_SEND_FAST_ZERO != 0 {
                    CMD_FLAG_FAST_ZERO
                } else {
                    0
                }
        }
        CMD_BLOCK_STATUS => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        CMD_FLUSH | CMD_TRIM | CMD_CACHE => CMD_FLAG_FUA,
        _ => return Err((NBD_EINVAL, "unknown command")),
    };
    if req.flags & !allowed != 0 {
        return Err((NBD_EINVAL, "command flag not valid for this command"));
    }
    let writes = matches!(req.typ, CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM);
    if writes && s.flags & FLAG_READ_ONLY != 0 {
        return Err((NBD_EPERM, "export is read-only"));
    }
    if req.typ == CMD_FLUSH {
        return Ok(());
    }
    let past_end = match req.offset.checked_add(req.length) {
        Some(end) => end > s.size,
        None => true,
    };
    if past_end {
        // Spec (Error values): writes past the end are ENOSPC, reads, trims
        // and status queries EINVAL.
        let err = if matches!(req.typ, CMD_WRITE | CMD_WRITE_ZEROES) {
            NBD_ENOSPC
        } else {
            NBD_EINVAL
        };
        return Err((err, "request extends past the end of the export"));
    }
    if req.typ == CMD_READ && req.length > s.max_payload as u64 {
        return Err((NBD_EINVAL, "read longer than the maximum payload"));
    }
    if s.enforce_min_block && s.min_block > 1 && req.typ != CMD_BLOCK_STATUS {
        // min_block is a power of two.
        let mask = s.min_block as u64 - 1;
        let end = req.offset + req.length;
        if req.offset & mask != 0 || (req.length & mask != 0 && end != s.size) {
            return Err((NBD_EINVAL, "request not aligned to the minimum block size"));
        }
    }
    if req.typ == CMD_BLOCK_STATUS {
        if s.base_allocation.is_none() {
            return Err((NBD_EINVAL, "no metadata context was negotiated"));
        }
        if req.length == 0 {
            return Err((NBD_EINVAL, "block status of an empty range"));
        }
    }
    Ok(())
}

/// A reply without payload: success.
fn small_ok(s: &Session, to: ReplyTo) -> Vec<u8> {
    let mut b = Vec::with_capacity(EXTENDED_REPLY_HEADER_LEN);
    match s.mode {
        // Spec: simple replies stay allowed for payload-less success when
        // structured replies are on, and are shorter.
        ReplyMode::Simple | ReplyMode::Structured => encode_simple_reply(&mut b, to.cookie, 0),
        ReplyMode::Extended => encode_chunk_none(&mut b, s.mode, to),
    }
    b
}

/// A reply without payload: failure, with a message when the mode has room
/// for one.
fn small_error(s: &Session, to: ReplyTo, err: u32, msg: &str) -> Vec<u8> {
    error_reply(s, to, err, msg, None)
}

fn error_reply(s: &Session, to: ReplyTo, err: u32, msg: &str, offset: Option<u64>) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + msg.len());
    match s.mode {
        ReplyMode::Simple => encode_simple_reply(&mut b, to.cookie, err),
        _ => encode_error_chunk(&mut b, s.mode, to, REPLY_FLAG_DONE, err, msg, offset),
    }
    b
}

/// The NBD error for a storage failure.
fn storage_errno(e: &rawdisk_storage::Error) -> u32 {
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

thread_local! {
    /// Scratch for chunk headers encoded in place on the blocking threads.
    static HDR: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(64));
}

/// Encodes a header with `f` and copies it to `dst` (exactly its length).
fn put_header(dst: &mut [u8], f: impl FnOnce(&mut Vec<u8>)) {
    HDR.with(|h| {
        let mut h = h.borrow_mut();
        h.clear();
        f(&mut h);
        debug_assert_eq!(h.len(), dst.len());
        dst.copy_from_slice(&h);
    })
}

/// One encoded reply: `buf[start..end]`, then for a spliced read the data
/// waiting in pipes.
struct Encoded {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    spliced: Vec<Spliced>,
}

/// `len` bytes of read data in `pipe`.
struct Spliced {
    pipe: Pipe,
    len: usize,
}

impl Encoded {
    fn bytes(buf: Vec<u8>, start: usize, end: usize) -> Encoded {
        Encoded {
            buf,
            start,
            end,
            spliced: Vec::new(),
        }
    }
}

fn whole(b: Vec<u8>) -> Encoded {
    let n = b.len();
    Encoded::bytes(b, 0, n)
}

/// The reply to `req` that failed in the storage with `e`.
fn storage_error(
    s: &Session,
    req: &Request,
    to: ReplyTo,
    op: &str,
    e: &rawdisk_storage::Error,
) -> Encoded {
    let err = storage_errno(e);
    debug!("{op}: {e} -> {}", error_name(err));
    let off =
        (e.offset >= req.offset && e.offset < req.offset + req.length.max(1)).then_some(e.offset);
    whole(error_reply(s, to, err, &e.to_string(), off))
}

/// Runs one validated request on the blocking pool; returns the encoded reply.
fn execute(
    sh: &Shared,
    s: &Session,
    req: &Request,
    to: ReplyTo,
    data: Option<(Vec<u8>, usize, usize)>,
) -> Encoded {
    let t = &*sh.target;
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let fail = |op: &str, e: &rawdisk_storage::Error| storage_error(s, req, to, op, e);
    match req.typ {
        CMD_READ => read(sh, s, req, to),
        CMD_WRITE => {
            let Some((buf, start, n)) = data else {
                return whole(small_ok(s, to));
            };
            let r = t.write_at(&buf[start..start + n], req.offset, fua);
            if r.is_ok() && sh.cfg.write_behind && !fua && n as u64 >= WRITE_BEHIND_MIN {
                t.start_writeback(req.offset, n as u64);
            }
            sh.pool.put(buf);
            match r {
                Ok(()) => whole(small_ok(s, to)),
                Err(e) => fail("write", &e),
            }
        }
        CMD_FLUSH => match t.flush() {
            Ok(()) => whole(small_ok(s, to)),
            Err(e) => fail("flush", &e),
        },
        CMD_TRIM => {
            if req.length == 0 {
                return whole(small_ok(s, to));
            }
            match t.trim(req.offset, req.length) {
                Ok(()) => sh.holes_made(),
                // Trim is advisory; "not supported" is success (and the spec
                // reserves ENOTSUP for fast zero).
                Err(e) if storage_errno(&e) == NBD_ENOTSUP => {}
                Err(e) => return fail("trim", &e),
            }
            if fua {
                if let Err(e) = t.flush() {
                    return fail("trim (FUA flush)", &e);
                }
            }
            whole(small_ok(s, to))
        }
        CMD_CACHE => {
            if req.length == 0 {
                return whole(small_ok(s, to));
            }
            match t.cache(req.offset, req.length) {
                Ok(()) => whole(small_ok(s, to)),
                Err(e) => fail("cache", &e),
            }
        }
        CMD_WRITE_ZEROES => {
            if req.length == 0 {
                return whole(small_ok(s, to));
            }
            let flags = ZeroFlags {
                may_trim: req.flags & CMD_FLAG_NO_HOLE == 0,
                fast_only: req.flags & CMD_FLAG_FAST_ZERO != 0,
            };
            match t.zero(req.offset, req.length, flags) {
                Ok(outcome) => {
                    trace!("zero used {:?}", outcome.methods);
                    sh.holes_made();
                }
                Err(e) => {
                    let mut err = storage_errno(&e);
                    // Spec: ENOTSUP only answers FAST_ZERO.
                    if err == NBD_ENOTSUP && !flags.fast_only {
                        err = NBD_EIO;
                    }
                    debug!("write zeroes: {e} -> {}", error_name(err));
                    return whole(error_reply(s, to, err, &e.to_string(), None));
                }
            }
            if fua {
                if let Err(e) = t.flush() {
                    return fail("write zeroes (FUA flush)", &e);
                }
            }
            whole(small_ok(s, to))
        }
        CMD_BLOCK_STATUS => block_status(sh, s, req, to),
        _ => whole(small_error(s, to, NBD_EINVAL, "unknown command")),
    }
}

fn read(sh: &Shared, s: &Session, req: &Request, to: ReplyTo) -> Encoded {
    let t = &*sh.target;
    let n = req.length as usize;
    let df = req.flags & CMD_FLAG_DF != 0;
    let read_err = |e: &rawdisk_storage::Error| -> Encoded {
        let err = storage_errno(e);
        debug!("read: {e} -> {}", error_name(err));
        let off =
            (e.offset >= req.offset && e.offset < req.offset + req.length).then_some(e.offset);
        whole(error_reply(s, to, err, &e.to_string(), off))
    };
    match s.mode {
        ReplyMode::Simple => {
            match splice_read(sh, s, req) {
                Some(Ok(spliced)) => return spliced_reply(s, req, to, spliced),
                Some(Err(e)) => return read_err(&e),
                None => {}
            }
            let (mut buf, start) = sh.pool.get(SIMPLE_REPLY_LEN, n);
            let d = start + SIMPLE_REPLY_LEN;
            if let Err(e) = t.read_at(&mut buf[d..d + n], req.offset) {
                sh.pool.put(buf);
                return read_err(&e);
            }
            put_header(&mut buf[start..d], |h| encode_simple_reply(h, to.cookie, 0));
            Encoded::bytes(buf, start, d + n)
        }
        ReplyMode::Structured | ReplyMode::Extended => {
            if n == 0 {
                let mut b = Vec::new();
                encode_chunk_none(&mut b, s.mode, to);
                return whole(b);
            }
            if !df && req.length >= SPARSE_READ_MIN && sh.may_have_holes(s.size) {
                let t0 = Instant::now();
                if let Ok(ext) = t.extents(req.offset, req.length, SPARSE_READ_RUNS) {
                    if ext.iter().any(|e| e.kind == ExtentKind::Hole) {
                        return sparse_read(sh, s, req, to, &ext);
                    }
                }
                // SEEK_HOLE walks the whole data run on tmpfs (page cache
                // lookups up to the next hole, not just this read's range):
                // inside a long run, stop asking for a while.
                if t0.elapsed() > SPARSE_LOOKUP_SLOW {
                    sh.sparse_skip.store(SPARSE_SKIP_READS, Ordering::Relaxed);
                }
            }
            match splice_read(sh, s, req) {
                Some(Ok(spliced)) => return spliced_reply(s, req, to, spliced),
                Some(Err(e)) => return read_err(&e),
                None => {}
            }
            let p = offset_data_header_len(s.mode);
            let (mut buf, start) = sh.pool.get(p, n);
            let d = start + p;
            if let Err(e) = t.read_at(&mut buf[d..d + n], req.offset) {
                sh.pool.put(buf);
                return read_err(&e);
            }
            // Everything is read before the chunk goes out, so it may carry
            // DONE itself (spec: no error can follow).
            put_header(&mut buf[start..d], |h| {
                encode_offset_data_header(h, s.mode, to, REPLY_FLAG_DONE, req.offset, n as u64)
            });
            Encoded::bytes(buf, start, d + n)
        }
    }
}

/// A read whose data goes to the socket through pipes (Target::read_to_pipe)
/// instead of a buffer, in pieces that end on PIPE_BYTES boundaries of the
/// target so that each fills at most one pipe of PIPE_BYTES. None when this
/// read does not qualify or a pipe is not to be had; the caller then copies.
fn splice_read(
    sh: &Shared,
    s: &Session,
    req: &Request,
) -> Option<Result<Vec<Spliced>, rawdisk_storage::Error>> {
    let t = &*sh.target;
    if !s.splice
        || req.length < SPLICE_MIN
        || t.cache_mode() == CacheMode::None
        || !t.caps().get(Method::Splice).may_work()
    {
        return None;
    }
    let end = req.offset + req.length;
    let mut out = Vec::with_capacity(req.length.div_ceil(PIPE_BYTES as u64) as usize + 1);
    let mut pos = req.offset;
    while pos < end {
        let piece_end = ((pos / PIPE_BYTES as u64 + 1) * PIPE_BYTES as u64).min(end);
        let n = (piece_end - pos) as usize;
        let pipe = sh.pipes.get()?;
        match t.read_to_pipe(pipe.write_end(), pos, n) {
            Ok(true) => out.push(Spliced { pipe, len: n }),
            // This pipe may hold part of the piece: it is dropped, not
            // pooled; the pieces already filled go back empty-handed too.
            Ok(false) => return None,
            Err(e) => return Some(Err(e)),
        }
        pos = piece_end;
    }
    Some(Ok(out))
}

/// The header of a read whose data is all in `spliced`; in structured modes
/// one data chunk carrying DONE (the data is read already: no error can
/// follow).
fn spliced_reply(s: &Session, req: &Request, to: ReplyTo, spliced: Vec<Spliced>) -> Encoded {
    let mut b = Vec::with_capacity(offset_data_header_len(s.mode).max(SIMPLE_REPLY_LEN));
    match s.mode {
        ReplyMode::Simple => encode_simple_reply(&mut b, to.cookie, 0),
        _ => encode_offset_data_header(&mut b, s.mode, to, REPLY_FLAG_DONE, req.offset, req.length),
    }
    Encoded {
        end: b.len(),
        buf: b,
        start: 0,
        spliced,
    }
}

/// Pipes of PIPE_BYTES kept for spliced reads, so a read does not pay
/// pipe2 + fcntl + two closes, and a cap on how many exist at all (each is
/// two descriptors, which accept() needs too).
struct PipePool {
    pipes: Mutex<Vec<Pipe>>,
    live: Arc<AtomicUsize>,
    /// The kernel refused a pipe of PIPE_BYTES (pipe-max-size lowered, the
    /// per-user pipe budget spent): reads are copied from then on.
    refused: AtomicBool,
}

impl PipePool {
    fn new() -> Self {
        PipePool {
            pipes: Mutex::new(Vec::new()),
            live: Arc::new(AtomicUsize::new(0)),
            refused: AtomicBool::new(false),
        }
    }

    fn get(&self) -> Option<Pipe> {
        if let Some(p) = self.pipes.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Some(p);
        }
        if self.refused.load(Ordering::Relaxed) {
            return None;
        }
        // Reserve before creating, so racing readers cannot overshoot.
        if self.live.fetch_add(1, Ordering::Relaxed) >= PIPES_MAX {
            self.live.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        match Pipe::with_capacity(PIPE_BYTES, self.live.clone()) {
            Ok(p) => Some(p),
            Err(e) => {
                if e.raw_os_error() == Some(libc::EPERM) {
                    if !self.refused.swap(true, Ordering::Relaxed) {
                        warn!("a pipe of {PIPE_BYTES} bytes was refused ({e}): reads are copied");
                    }
                } else {
                    // EMFILE, ENFILE: this read is copied, the next may not be.
                    debug!("no pipe for a spliced read: {e}");
                }
                None
            }
        }
    }

    fn put(&self, p: Pipe) {
        let mut g = self.pipes.lock().unwrap_or_else(|p| p.into_inner());
        if g.len() < PIPES_KEPT {
            g.push(p);
        }
    }
}

/// A read answered with data chunks for data and hole chunks for holes.
fn sparse_read(
    sh: &Shared,
    s: &Session,
    req: &Request,
    to: ReplyTo,
    extents: &[rawdisk_storage::Extent],
) -> Encoded {
    let t = &*sh.target;
    let end = req.offset + req.length;
    // (offset, len, hole), contiguous from req.offset to end.
    let mut pieces: Vec<(u64, u64, bool)> = Vec::with_capacity(extents.len() + 1);
    let mut pos = req.offset;
    for e in extents {
        let e_end = e.offset.saturating_add(e.len).min(end);
        if e.offset > pos || e_end <= pos {
            // Not contiguous with what we have: treat the rest as data.
            break;
        }
        let hole = e.kind == ExtentKind::Hole;
        match pieces.last_mut() {
            Some(last) if last.2 == hole => last.1 += e_end - pos,
            _ => pieces.push((pos, e_end - pos, hole)),
        }
        pos = e_end;
    }
    if pos < end {
        match pieces.last_mut() {
            Some(last) if !last.2 => last.1 += end - pos,
            _ => pieces.push((pos, end - pos, false)),
        }
    }
    let hl = s.mode.header_len();
    let total: usize = pieces
        .iter()
        .map(|&(_, len, hole)| if hole { hl + 12 } else { hl + 8 + len as usize })
        .sum();
    let (mut buf, start) = sh.pool.get(0, total);
    let mut at = start;
    let last = pieces.len() - 1;
    for (i, &(off, len, hole)) in pieces.iter().enumerate() {
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        if hole {
            put_header(&mut buf[at..at + hl + 12], |h| {
                encode_offset_hole(h, s.mode, to, flags, off, len as u32)
            });
            at += hl + 12;
        } else {
            let p = hl + 8;
            put_header(&mut buf[at..at + p], |h| {
                encode_offset_data_header(h, s.mode, to, flags, off, len)
            });
            let d = at + p;
            if let Err(e) = t.read_at(&mut buf[d..d + len as usize], off) {
                sh.pool.put(buf);
                let err = storage_errno(&e);
                debug!("read: {e} -> {}", error_name(err));
                let eoff = (e.offset >= req.offset && e.offset < end).then_some(e.offset);
                return whole(error_reply(s, to, err, &e.to_string(), eoff));
            }
            at = d + len as usize;
        }
    }
    Encoded::bytes(buf, start, at)
}

fn block_status(sh: &Shared, s: &Session, req: &Request, to: ReplyTo) -> Encoded {
    let t = &*sh.target;
    let id = s.base_allocation.unwrap_or(BASE_ALLOCATION_ID);
    let max_runs = if req.flags & CMD_FLAG_REQ_ONE != 0 {
        1
    } else {
        MAX_DESCRIPTORS
    };
    let mut ds: Vec<Descriptor> = match t.extents(req.offset, req.length, max_runs) {
        Ok(ext) => ext
            .iter()
            .filter(|e| e.len > 0)
            .map(|e| Descriptor {
                length: e.len,
                status: match e.kind {
                    ExtentKind::Hole => (STATE_HOLE | STATE_ZERO) as u64,
                    ExtentKind::Data => 0,
                },
            })
            .collect(),
        Err(e) => {
            // Spec: a server MAY describe the range as plain data instead of
            // failing when the error is not the client's fault.
            debug!("block status: {e}; reporting data");
            Vec::new()
        }
    };
    if ds.is_empty() {
        ds.push(Descriptor {
            length: req.length,
            status: 0,
        });
    }
    if !s.mode.extended() {
        // Compact requests are 32-bit, so extents within them are too; clamp
        // anyway rather than emit a wrapped length.
        for d in &mut ds {
            d.length = d.length.min(u32::MAX as u64 & !511);
        }
    }
    let mut b = Vec::with_capacity(s.mode.header_len() + 8 + 16 * ds.len());
    encode_block_status(&mut b, s.mode, to, REPLY_FLAG_DONE, id, &ds);
    whole(b)
}

// ---------------------------------------------------------------------------
// Request input
// ---------------------------------------------------------------------------

/// The socket's read half with a read-ahead buffer whose use the caller
/// controls per read, so payloads land in their own buffer in one copy.
struct Input<R> {
    r: R,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
}

impl<R: AsyncRead + Unpin> Input<R> {
    fn new(r: R) -> Self {
        Input {
            r,
            buf: vec![0u8; READ_AHEAD].into_boxed_slice(),
            pos: 0,
            end: 0,
        }
    }

    /// Bytes read ahead and not consumed yet.
    fn buffered(&self) -> usize {
        self.end - self.pos
    }

    /// When nothing is buffered, reads whatever the socket has ready now, up
    /// to `limit` bytes, without waiting. EOF is not an error here: the
    /// next read_exact reports it.
    async fn top_up(&mut self, limit: usize) -> io::Result<()> {
        if self.pos < self.end {
            return Ok(());
        }
        self.pos = 0;
        self.end = 0;
        let limit = limit.min(self.buf.len());
        // One poll: a socket with nothing new since its last EAGAIN answers
        // Pending without a syscall.
        let r = tokio::select! {
            biased;
            r = self.r.read(&mut self.buf[self.end..limit]) => Some(r),
            _ = std::future::ready(()) => None,
        };
        match r {
            Some(Ok(n)) => self.end += n,
            Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => {}
            Some(Err(e)) => return Err(e),
            None => {}
        }
        Ok(())
    }

    /// Consumes `n` of the buffered bytes (at most [`Input::buffered`]).
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.buffered());
        self.pos += n;
        &self.buf[self.pos - n..self.pos]
    }

    /// Fills `dst`, reading at most `ahead` bytes beyond it into the buffer.
    /// EOF before `dst` is full is UnexpectedEof.
    async fn read_exact(&mut self, dst: &mut [u8], ahead: usize) -> io::Result<()> {
        let n = (self.end - self.pos).min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        let mut done = n;
        if done == dst.len() {
            return Ok(());
        }
        let rest = dst.len() - done;
        // Big remainders go straight to `dst`: copying them through the
        // buffer would cost more than the syscall it saves.
        if ahead == 0 || rest >= self.buf.len() / 2 {
            while done < dst.len() {
                match self.r.read(&mut dst[done..]).await? {
                    0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                    k => done += k,
                }
            }
            return Ok(());
        }
        // The buffer is empty here: refill it with this read and what follows.
        self.pos = 0;
        self.end = 0;
        let limit = (rest + ahead).min(self.buf.len());
        while self.end < rest {
            match self.r.read(&mut self.buf[self.end..limit]).await? {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                k => self.end += k,
            }
        }
        dst[done..].copy_from_slice(&self.buf[..rest]);
        self.pos = rest;
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Buffer pool
// ---------------------------------------------------------------------------

/// Recycles large payload buffers, so a steady stream of 1 MiB reads or
/// writes does not fault in fresh pages for every request. Small bounded
/// retention: at most `max_bufs` buffers of at most `max_len` bytes.
struct BufPool {
    bufs: Mutex<Vec<Vec<u8>>>,
    max_bufs: usize,
    max_len: usize,
}

impl BufPool {
    fn new(max_bufs: usize, max_len: usize) -> Self {
        BufPool {
            bufs: Mutex::new(Vec::new()),
            max_bufs,
            max_len,
        }
    }

    /// A buffer holding `prefix + n` usable bytes from the returned start,
    /// placed so that `start + prefix` is DATA_ALIGN-aligned in memory.
    fn get(&self, prefix: usize, n: usize) -> (Vec<u8>, usize) {
        let need = prefix + n + DATA_ALIGN;
        let picked = {
            let mut g = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
            // The smallest buffer that fits; a bigger request than any kept
            // gets a fresh zeroed allocation (calloc/mmap), not a grown one
            // (realloc would copy the old contents and memset the rest).
            let best = g
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= need)
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            best.map(|i| g.swap_remove(i))
        };
        // Fresh buffers are rounded up to 64 KiB: a 1 MiB write payload and
        // a 1 MiB read reply (which carries a header) then fit each other's
        // recycled buffers, instead of the pool holding 16 of one size while
        // 16 more of the other are allocated beside them.
        let size = if need >= POOL_ROUND {
            need.next_multiple_of(POOL_ROUND)
        } else {
            need
        };
        let buf = picked.unwrap_or_else(|| vec![0u8; size]);
        let addr = buf.as_ptr() as usize + prefix;
        let start = (DATA_ALIGN - addr % DATA_ALIGN) % DATA_ALIGN;
        (buf, start)
    }

    fn put(&self, buf: Vec<u8>) {
        if buf.capacity() < (64 << 10) || buf.capacity() > self.max_len {
            return;
        }
        let mut g = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        if g.len() < self.max_bufs {
            g.push(buf);
            return;
        }
        // Full: keep the bigger buffers, which are the costly ones to fault in.
        if let Some((i, _)) = g.iter().enumerate().min_by_key(|(_, b)| b.len()) {
            if g[i].len() < buf.len() {
                g[i] = buf;
            }
        }
    }
}
