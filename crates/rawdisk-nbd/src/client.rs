//! NBD client: fixed newstyle handshake, `NBD_OPT_GO` with block-size
//! information, structured replies (extended headers when the server offers
//! them), `base:allocation` block status, many requests in flight per
//! connection and several connections when the server allows multi-conn.
//!
//! One reader task per connection demultiplexes replies by cookie; structured
//! read chunks land directly in the caller's buffer, holes are zero-filled.
//! No error is ever dropped: every request's future resolves to the server's
//! error, or to the connection's failure when the connection dies with the
//! request in flight (nbdcopy once lost asynchronous errors: CVE-2022-0485).

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::proto::*;
use crate::uri::{NbdUri, Transport};

// ---------------------------------------------------------------------------
// Errors

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Could not reach the server.
    #[error("cannot connect to {target}: {message}")]
    Connect { target: String, message: String },
    /// The handshake failed (the server refused an option, the export, ...).
    #[error("NBD handshake with {target}: {message}")]
    Handshake { target: String, message: String },
    /// The server answered a request with an error.
    #[error("{cmd} at offset {offset} length {len}: server error {}{}", errno_name(*.errno), .message.as_deref().map(|m| format!(": {m}")).unwrap_or_default())]
    Server {
        cmd: &'static str,
        offset: u64,
        len: u64,
        errno: u32,
        message: Option<String>,
    },
    /// The connection broke with this request in flight (or before it was sent).
    #[error("{cmd} at offset {offset} length {len}: {reason}")]
    Connection {
        cmd: &'static str,
        offset: u64,
        len: u64,
        reason: String,
    },
    /// The request cannot be sent to this export (flag not advertised,
    /// range out of bounds, misaligned).
    #[error("{cmd} at offset {offset} length {len}: {why}")]
    Invalid {
        cmd: &'static str,
        offset: u64,
        len: u64,
        why: String,
    },
}

impl Error {
    /// The NBD error number, for server errors.
    pub fn errno(&self) -> Option<u32> {
        match self {
            Error::Server { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// "EIO (input/output error)" for the values the spec names, else the number.
fn errno_name(e: u32) -> String {
    match error_description(e) {
        Some(what) => format!("{} ({what})", error_name(e).trim_start_matches("NBD_")),
        None => e.to_string(),
    }
}

// ---------------------------------------------------------------------------
// Negotiated export

/// What the handshake learned about the export (what `nbdinfo` shows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// The name we asked for, or the server's canonical name (NBD_INFO_NAME).
    pub name: String,
    pub description: Option<String>,
    pub size: u64,
    /// Transmission flags (NBD_FLAG_*).
    pub flags: u16,
    /// NBD_INFO_BLOCK_SIZE when the server sent it, else the spec defaults
    /// (1, 4096, 32 MiB) and `block_size_advertised` is false.
    pub min_block: u32,
    pub pref_block: u32,
    pub max_payload: u32,
    pub block_size_advertised: bool,
    pub structured_replies: bool,
    pub extended_headers: bool,
    /// The metadata context used for block status, if one was negotiated.
    pub meta_context: Option<String>,
    /// Connections actually opened (more than one only with multi-conn).
    pub connections: usize,
}

impl ExportInfo {
    fn flag(&self, f: u16) -> bool {
        self.flags & f != 0
    }
    pub fn read_only(&self) -> bool {
        self.flag(FLAG_READ_ONLY)
    }
    pub fn can_flush(&self) -> bool {
        self.flag(FLAG_SEND_FLUSH)
    }
    pub fn can_fua(&self) -> bool {
        self.flag(FLAG_SEND_FUA)
    }
    pub fn rotational(&self) -> bool {
        self.flag(FLAG_ROTATIONAL)
    }
    pub fn can_trim(&self) -> bool {
        self.flag(FLAG_SEND_TRIM)
    }
    pub fn can_zero(&self) -> bool {
        self.flag(FLAG_SEND_WRITE_ZEROES)
    }
    pub fn can_df(&self) -> bool {
        self.flag(FLAG_SEND_DF)
    }
    pub fn can_multi_conn(&self) -> bool {
        self.flag(FLAG_CAN_MULTI_CONN)
    }
    pub fn can_cache(&self) -> bool {
        self.flag(FLAG_SEND_CACHE)
    }
    pub fn can_fast_zero(&self) -> bool {
        self.flag(FLAG_SEND_FAST_ZERO)
    }
    pub fn can_block_status(&self) -> bool {
        self.meta_context.is_some()
    }
    /// Names of the transmission flags that are set, for display.
    pub fn flag_names(&self) -> Vec<&'static str> {
        transmission_flag_names(self.flags).collect()
    }
    /// The largest read or write this export takes in one request, rounded
    /// down to the minimum block size.
    pub fn max_io(&self) -> u64 {
        let m = self.max_payload.min(32 << 20) as u64;
        m - m % self.min_block.max(1) as u64
    }
    /// The largest length of a request without payload (zero, trim, block
    /// status): the 32-bit length field without extended headers.
    pub fn max_effect(&self) -> u64 {
        let m: u64 = if self.extended_headers {
            1 << 40
        } else {
            u32::MAX as u64
        };
        let mb = self.min_block.max(4096) as u64;
        m - m % mb
    }
}

/// What to negotiate.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Connections to open when the server advertises CAN_MULTI_CONN.
    pub connections: usize,
    /// Offer NBD_OPT_EXTENDED_HEADERS (64-bit lengths) when possible.
    pub extended_headers: bool,
    /// Negotiate structured replies (sparse reads, error messages).
    pub structured_replies: bool,
    /// Select `base:allocation` for block status.
    pub block_status: bool,
    /// Give up connecting and negotiating after this long.
    pub timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            connections: 1,
            extended_headers: true,
            structured_replies: true,
            block_status: true,
            timeout: Duration::from_secs(30),
        }
    }
}

/// `NBD_CMD_WRITE_ZEROES` flags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// NBD_CMD_FLAG_NO_HOLE: the range must stay allocated.
    pub no_hole: bool,
    /// NBD_CMD_FLAG_FAST_ZERO: fail with ENOTSUP rather than write zeros.
    pub fast: bool,
    pub fua: bool,
}

/// One `base:allocation` descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStatus {
    pub len: u64,
    /// NBD_STATE_HOLE (1) and NBD_STATE_ZERO (2).
    pub flags: u64,
}

impl BlockStatus {
    pub fn is_hole(&self) -> bool {
        self.flags & STATE_HOLE as u64 != 0
    }
    pub fn is_zero(&self) -> bool {
        self.flags & STATE_ZERO as u64 != 0
    }
}

// ---------------------------------------------------------------------------
// Client

/// An open export, over one or several connections. Every method takes
/// `&self`: share it (`Arc`) between tasks to keep many requests in flight.
pub struct Client {
    conns: Vec<Arc<Conn>>,
    info: ExportInfo,
    target: String,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("target", &self.target)
            .field("info", &self.info)
            .finish()
    }
}

impl Client {
    /// Connect and negotiate. With multi-conn and `opts.connections > 1`,
    /// opens the extra connections too.
    pub async fn connect(uri: &NbdUri, opts: &ConnectOptions) -> Result<Client> {
        let target = uri.to_string();
        let first = tokio::time::timeout(opts.timeout, Conn::open(uri, opts, &target))
            .await
            .map_err(|_| Error::Connect {
                target: target.clone(),
                message: format!("timed out after {:?}", opts.timeout),
            })??;
        let mut info = first.1;
        let mut conns = vec![first.0];
        if info.can_multi_conn() && opts.connections > 1 {
            let mut set = tokio::task::JoinSet::new();
            for _ in 1..opts.connections {
                let (uri, opts, target) = (uri.clone(), opts.clone(), target.clone());
                set.spawn(async move {
                    tokio::time::timeout(opts.timeout, Conn::open(&uri, &opts, &target)).await
                });
            }
            while let Some(r) = set.join_next().await {
                let (conn, other) = r
                    .map_err(|e| Error::Connect {
                        target: target.clone(),
                        message: e.to_string(),
                    })?
                    .map_err(|_| Error::Connect {
                        target: target.clone(),
                        message: "timed out opening an extra connection".into(),
                    })??;
                // Multi-conn promises the same export on every connection;
                // anything else would make the connections disagree.
                if other.size != info.size || other.extended_headers != info.extended_headers {
                    return Err(Error::Handshake {
                        target: target.clone(),
                        message: "extra connection negotiated a different export".into(),
                    });
                }
                conns.push(conn);
            }
        }
        info.connections = conns.len();
        tracing::debug!(target = %target, ?info, "NBD export open");
        Ok(Client {
            conns,
            info,
            target,
        })
    }

    pub fn info(&self) -> &ExportInfo {
        &self.info
    }

    pub fn size(&self) -> u64 {
        self.info.size
    }

    /// The URI this client is connected to.
    pub fn target(&self) -> &str {
        &self.target
    }

    fn pick(&self) -> &Arc<Conn> {
        // Least loaded connection: replies come back out of order and at
        // different speeds, round robin would pile work on a slow one.
        self.conns
            .iter()
            .min_by_key(|c| c.inflight.load(Ordering::Relaxed))
            .expect("at least one connection")
    }

    fn check(&self, cmd: Command, offset: u64, len: u64) -> Result<()> {
        let invalid = |why: String| Error::Invalid {
            cmd: cmd.verb(),
            offset,
            len,
            why,
        };
        if offset.checked_add(len).is_none_or(|e| e > self.info.size) {
            return Err(invalid(format!(
                "beyond the end of the export ({} bytes)",
                self.info.size
            )));
        }
        let mb = self.info.min_block.max(1) as u64;
        if !offset.is_multiple_of(mb) || (!len.is_multiple_of(mb) && offset + len != self.info.size)
        {
            return Err(invalid(format!(
                "not aligned to the export's minimum block size {mb}"
            )));
        }
        Ok(())
    }

    /// Read `range.len()` bytes at `offset` into `buf[range]`; returns `buf`.
    /// Holes in a structured reply are zero-filled.
    pub async fn read_into(
        &self,
        offset: u64,
        buf: Vec<u8>,
        range: Range<usize>,
    ) -> Result<Vec<u8>> {
        let len = range.len() as u64;
        self.check(Command::Read, offset, len)?;
        if len > self.info.max_io() {
            return Err(Error::Invalid {
                cmd: Command::Read.verb(),
                offset,
                len,
                why: format!("longer than the maximum payload {}", self.info.max_io()),
            });
        }
        match self
            .pick()
            .request(Command::Read, 0, offset, len, None, Some((buf, range)))
            .await?
        {
            Done::Read(b) => Ok(b),
            _ => unreachable!("read completes with its buffer"),
        }
    }

    /// Read into a new buffer.
    pub async fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        self.read_into(offset, vec![0; len], 0..len).await
    }

    pub async fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let len = data.len() as u64;
        self.check(Command::Write, offset, len)?;
        self.require(
            !self.info.read_only(),
            Command::Write,
            offset,
            len,
            "the export is read-only",
        )?;
        if len > self.info.max_io() {
            return Err(Error::Invalid {
                cmd: Command::Write.verb(),
                offset,
                len,
                why: format!("longer than the maximum payload {}", self.info.max_io()),
            });
        }
        let flags = self.fua_flag(fua);
        self.pick()
            .request(Command::Write, flags, offset, len, Some(data), None)
            .await
            .map(|_| ())
    }

    /// NBD_CMD_WRITE_ZEROES. Fails (without sending) if the server did not
    /// advertise SEND_WRITE_ZEROES (or SEND_FAST_ZERO for `flags.fast`).
    pub async fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.check(Command::WriteZeroes, offset, len)?;
        self.require(
            self.info.can_zero(),
            Command::WriteZeroes,
            offset,
            len,
            "the server does not support WRITE_ZEROES",
        )?;
        self.require(
            !flags.fast || self.info.can_fast_zero(),
            Command::WriteZeroes,
            offset,
            len,
            "the server does not support FAST_ZERO",
        )?;
        let mut f = self.fua_flag(flags.fua);
        if flags.no_hole {
            f |= CMD_FLAG_NO_HOLE;
        }
        if flags.fast {
            f |= CMD_FLAG_FAST_ZERO;
        }
        for (o, l) in split(offset, len, self.info.max_effect()) {
            self.pick()
                .request(Command::WriteZeroes, f, o, l, None, None)
                .await?;
        }
        Ok(())
    }

    pub async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check(Command::Trim, offset, len)?;
        self.require(
            self.info.can_trim(),
            Command::Trim,
            offset,
            len,
            "the server does not support TRIM",
        )?;
        let f = self.fua_flag(fua);
        for (o, l) in split(offset, len, self.info.max_effect()) {
            self.pick()
                .request(Command::Trim, f, o, l, None, None)
                .await?;
        }
        Ok(())
    }

    /// NBD_CMD_FLUSH on every connection. Callers must have received the
    /// replies to every write the flush is meant to cover (spec: "Ordering of
    /// messages and writes", multiple connections). A server without
    /// SEND_FLUSH has nothing to flush: Ok.
    pub async fn flush(&self) -> Result<()> {
        if !self.info.can_flush() {
            return Ok(());
        }
        let futs: Vec<_> = self
            .conns
            .iter()
            .map(|c| c.request(Command::Flush, 0, 0, 0, None, None))
            .collect();
        for f in futs {
            f.await?;
        }
        Ok(())
    }

    /// `base:allocation` descriptors starting at `offset` (at least one on
    /// success). They may cover less than `len`, or (the last one) more.
    pub async fn block_status(&self, offset: u64, len: u64) -> Result<Vec<BlockStatus>> {
        self.check(
            Command::BlockStatus,
            offset,
            len.min(self.info.size - offset.min(self.info.size)),
        )?;
        self.require(
            self.info.can_block_status(),
            Command::BlockStatus,
            offset,
            len,
            "no base:allocation context was negotiated",
        )?;
        let len = len.min(self.info.max_effect()).min(self.info.size - offset);
        match self
            .pick()
            .request(Command::BlockStatus, 0, offset, len, None, None)
            .await?
        {
            Done::Status(v) if !v.is_empty() => Ok(v),
            Done::Status(_) | Done::Ok => Err(Error::Connection {
                cmd: Command::BlockStatus.verb(),
                offset,
                len,
                reason: "protocol error: the server sent no base:allocation extents".into(),
            }),
            Done::Read(_) => unreachable!(),
        }
    }

    /// NBD_CMD_DISC on every connection once they are idle, then wait for the
    /// server to close them. Errors of requests still in flight are returned
    /// by those requests, not lost.
    pub async fn disconnect(&self) -> Result<()> {
        for c in &self.conns {
            c.disconnect().await;
        }
        Ok(())
    }

    fn fua_flag(&self, fua: bool) -> u16 {
        if fua && self.info.can_fua() {
            CMD_FLAG_FUA
        } else {
            0
        }
    }

    fn require(&self, ok: bool, cmd: Command, offset: u64, len: u64, why: &str) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(Error::Invalid {
                cmd: cmd.verb(),
                offset,
                len,
                why: why.to_string(),
            })
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        for c in &self.conns {
            if let Some(h) = c.reader.lock().unwrap().take() {
                h.abort();
            }
        }
    }
}

fn split(offset: u64, len: u64, max: u64) -> impl Iterator<Item = (u64, u64)> {
    let mut pos = offset;
    let end = offset + len;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let l = (end - pos).min(max);
        let r = (pos, l);
        pos += l;
        Some(r)
    })
}

// ---------------------------------------------------------------------------
// One connection

type Reader = BufReader<Box<dyn AsyncRead + Send + Unpin>>;
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

enum Done {
    Ok,
    Read(Vec<u8>),
    Status(Vec<BlockStatus>),
}

struct Pending {
    cmd: Command,
    offset: u64,
    len: u64,
    /// For reads: the caller's buffer and where in it the data goes.
    buf: Option<(Vec<u8>, Range<usize>)>,
    /// Bytes of a read covered by data and hole chunks so far.
    covered: u64,
    error: Option<(u32, Option<String>)>,
    status: Vec<BlockStatus>,
    tx: oneshot::Sender<Result<Done>>,
}

struct State {
    pending: HashMap<u64, Pending>,
    /// Why the connection is unusable; set once, never cleared.
    dead: Option<String>,
}

struct Conn {
    writer: tokio::sync::Mutex<Option<Writer>>,
    state: Mutex<State>,
    next_cookie: AtomicU64,
    inflight: AtomicUsize,
    extended: bool,
    structured: bool,
    context_id: Option<u32>,
    reader: Mutex<Option<JoinHandle<()>>>,
}

impl Conn {
    async fn open(
        uri: &NbdUri,
        opts: &ConnectOptions,
        target: &str,
    ) -> Result<(Arc<Conn>, ExportInfo)> {
        let connect_err = |e: std::io::Error| Error::Connect {
            target: target.to_string(),
            message: e.to_string(),
        };
        let (r, w): (Box<dyn AsyncRead + Send + Unpin>, Writer) = match &uri.transport {
            Transport::Tcp { host, port } => {
                let s = tokio::net::TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(connect_err)?;
                s.set_nodelay(true).map_err(connect_err)?;
                let (r, w, _) = crate::sock::split(s.into_std().map_err(connect_err)?.into())
                    .map_err(connect_err)?;
                (Box::new(r), Box::new(w))
            }
            Transport::Unix { path } => {
                let s = tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(connect_err)?;
                // Write payloads queue in this side's send buffer (AF_UNIX
                // charges the sender; docs/benchmarks.md, Unix socket send
                // buffer).
                crate::sock::grow_unix_send_buffer(&s);
                let (r, w, _) = crate::sock::split(s.into_std().map_err(connect_err)?.into())
                    .map_err(connect_err)?;
                (Box::new(r), Box::new(w))
            }
        };
        let mut r = BufReader::with_capacity(256 * 1024, r);
        let mut w = w;
        let (info, context_id) =
            handshake(&mut r, &mut w, &uri.export, opts)
                .await
                .map_err(|message| Error::Handshake {
                    target: target.to_string(),
                    message,
                })?;
        let conn = Arc::new(Conn {
            writer: tokio::sync::Mutex::new(Some(w)),
            state: Mutex::new(State {
                pending: HashMap::new(),
                dead: None,
            }),
            next_cookie: AtomicU64::new(1),
            inflight: AtomicUsize::new(0),
            extended: info.extended_headers,
            structured: info.structured_replies,
            context_id,
            reader: Mutex::new(None),
        });
        let c2 = conn.clone();
        let h = tokio::spawn(async move {
            let reason = match reader_loop(&c2, &mut r).await {
                Ok(()) => "the server closed the connection".to_string(),
                Err(e) => e,
            };
            c2.kill(&reason);
        });
        *conn.reader.lock().unwrap() = Some(h);
        Ok((conn, info))
    }

    /// Mark the connection dead and fail every request in flight.
    fn kill(&self, reason: &str) {
        let drained: Vec<Pending> = {
            let mut st = self.state.lock().unwrap();
            if st.dead.is_none() {
                st.dead = Some(reason.to_string());
            }
            st.pending.drain().map(|(_, p)| p).collect()
        };
        for p in drained {
            self.inflight.fetch_sub(1, Ordering::Relaxed);
            let _ = p.tx.send(Err(Error::Connection {
                cmd: p.cmd.verb(),
                offset: p.offset,
                len: p.len,
                reason: format!("connection lost: {reason}"),
            }));
        }
    }

    async fn request(
        &self,
        cmd: Command,
        flags: u16,
        offset: u64,
        len: u64,
        payload: Option<&[u8]>,
        buf: Option<(Vec<u8>, Range<usize>)>,
    ) -> Result<Done> {
        let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let conn_err = |reason: String| Error::Connection {
            cmd: cmd.verb(),
            offset,
            len,
            reason,
        };
        // Register before sending: the reply may arrive before send returns.
        {
            let mut st = self.state.lock().unwrap();
            if let Some(d) = &st.dead {
                return Err(conn_err(format!("connection lost: {d}")));
            }
            st.pending.insert(
                cookie,
                Pending {
                    cmd,
                    offset,
                    len,
                    buf,
                    covered: 0,
                    error: None,
                    status: Vec::new(),
                    tx,
                },
            );
            self.inflight.fetch_add(1, Ordering::Relaxed);
        }
        let mut hdr = Vec::with_capacity(EXTENDED_REQUEST_LEN);
        Request {
            flags,
            command: cmd,
            cookie,
            offset,
            length: len,
        }
        .encode(&mut hdr, self.extended);
        if let Err(e) = self.send(&hdr, payload).await {
            // The request may be half on the wire: the stream is unusable.
            self.kill(&e);
            return Err(conn_err(format!("sending the request: {e}")));
        }
        match rx.await {
            Ok(r) => r,
            Err(_) => Err(conn_err("connection lost".into())),
        }
    }

    async fn send(&self, hdr: &[u8], payload: Option<&[u8]>) -> std::result::Result<(), String> {
        let mut guard = self.writer.lock().await;
        let w = guard
            .as_mut()
            .ok_or_else(|| "connection closed".to_string())?;
        // If this future is dropped mid-way the stream is corrupt; the guard
        // below kills the connection in that case.
        let mut poison = Poison {
            conn: self,
            armed: true,
        };
        let r = async {
            w.write_all(hdr).await?;
            if let Some(p) = payload {
                w.write_all(p).await?;
            }
            w.flush().await
        }
        .await;
        poison.armed = false;
        r.map_err(|e| e.to_string())
    }

    async fn disconnect(&self) {
        {
            let mut guard = self.writer.lock().await;
            if let Some(w) = guard.as_mut() {
                let mut hdr = Vec::with_capacity(EXTENDED_REQUEST_LEN);
                Request {
                    command: Command::Disc,
                    ..Default::default()
                }
                .encode(&mut hdr, self.extended);
                let _ = w.write_all(&hdr).await;
                let _ = w.flush().await;
                let _ = w.shutdown().await;
            }
            *guard = None;
        }
        let h = self.reader.lock().unwrap().take();
        if let Some(h) = h {
            // The server closes after answering what was in flight.
            let abort = h.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), h)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
        self.kill("disconnected");
    }
}

struct Poison<'a> {
    conn: &'a Conn,
    armed: bool,
}

impl Drop for Poison<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.conn.kill("a request was abandoned half-sent");
        }
    }
}

async fn read_exact(r: &mut Reader, buf: &mut [u8]) -> std::result::Result<(), String> {
    r.read_exact(buf).await.map(|_| ()).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            "the server closed the connection".to_string()
        } else {
            format!("reading from the server: {e}")
        }
    })
}

/// Reads replies until the connection ends; returns why it ended.
async fn reader_loop(conn: &Conn, r: &mut Reader) -> std::result::Result<(), String> {
    let mode = if conn.extended {
        ReplyMode::Extended
    } else if conn.structured {
        ReplyMode::Structured
    } else {
        ReplyMode::Simple
    };
    let mut hb = [0u8; EXTENDED_REPLY_HEADER_LEN];
    loop {
        match r.read_exact(&mut hb[..4]).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                let st = conn.state.lock().unwrap();
                if st.pending.is_empty() {
                    return Ok(());
                }
                return Err("the server closed the connection".into());
            }
            Err(e) => return Err(format!("reading from the server: {e}")),
        }
        let hlen = match u32::from_be_bytes(hb[..4].try_into().unwrap()) {
            SIMPLE_REPLY_MAGIC => SIMPLE_REPLY_LEN,
            STRUCTURED_REPLY_MAGIC => STRUCTURED_REPLY_HEADER_LEN,
            EXTENDED_REPLY_MAGIC => EXTENDED_REPLY_HEADER_LEN,
            m => return Err(format!("protocol error: unexpected reply magic {m:#010x}")),
        };
        read_exact(r, &mut hb[4..hlen]).await?;
        let (hdr, _) =
            decode_reply_header(&hb[..hlen], mode).map_err(|e| format!("protocol error: {e}"))?;
        let cookie = hdr.cookie();
        let mut p = conn
            .state
            .lock()
            .unwrap()
            .pending
            .remove(&cookie)
            .ok_or_else(|| format!("protocol error: reply for unknown cookie {cookie}"))?;
        let done = match hdr {
            ReplyHeader::Simple { error, .. } => {
                if error != 0 {
                    p.error = Some((error, None));
                } else if p.cmd == Command::Read {
                    if conn.structured {
                        return Err("protocol error: simple reply to a read after structured replies were negotiated".into());
                    }
                    let (buf, range) = p.buf.as_mut().expect("read has a buffer");
                    read_exact(r, &mut buf[range.clone()]).await?;
                    p.covered = p.len;
                }
                true
            }
            ReplyHeader::Chunk {
                flags, typ, length, ..
            } => {
                handle_chunk(conn, r, &mut p, typ, length).await?;
                flags & REPLY_FLAG_DONE != 0
            }
        };
        if done {
            conn.inflight.fetch_sub(1, Ordering::Relaxed);
            let res = finish(
                p.cmd,
                p.offset,
                p.len,
                p.error.take(),
                p.covered,
                p.buf.take(),
                std::mem::take(&mut p.status),
            );
            let _ = p.tx.send(res);
        } else {
            conn.state.lock().unwrap().pending.insert(cookie, p);
        }
    }
}

fn finish(
    cmd: Command,
    offset: u64,
    len: u64,
    error: Option<(u32, Option<String>)>,
    covered: u64,
    buf: Option<(Vec<u8>, Range<usize>)>,
    status: Vec<BlockStatus>,
) -> Result<Done> {
    if let Some((errno, message)) = error {
        return Err(Error::Server {
            cmd: cmd.verb(),
            offset,
            len,
            errno,
            message,
        });
    }
    match cmd {
        Command::Read => {
            if covered != len {
                // Spec: on success the chunks cover the whole request.
                return Err(Error::Connection {
                    cmd: Command::Read.verb(),
                    offset,
                    len,
                    reason: format!("protocol error: the server sent {covered} of {len} bytes and claimed success"),
                });
            }
            Ok(Done::Read(buf.map(|b| b.0).unwrap_or_default()))
        }
        Command::BlockStatus => Ok(Done::Status(status)),
        Command::Write
        | Command::Flush
        | Command::Trim
        | Command::WriteZeroes
        | Command::Disc
        | Command::Cache
        | Command::Resize
        | Command::Unknown(_) => Ok(Done::Ok),
    }
}

async fn handle_chunk(
    conn: &Conn,
    r: &mut Reader,
    p: &mut Pending,
    typ: u16,
    len: u64,
) -> std::result::Result<(), String> {
    if typ == REPLY_TYPE_OFFSET_DATA && p.cmd == Command::Read {
        // Read the data straight into the caller's buffer, not via a copy.
        if len < 9 {
            return Err(format!("protocol error: OFFSET_DATA chunk of {len} bytes"));
        }
        let mut b = [0u8; 8];
        read_exact(r, &mut b).await?;
        let off = u64::from_be_bytes(b);
        let n = len - 8;
        let (start, end) = chunk_range(p, off, n)?;
        let (buf, range) = p.buf.as_mut().expect("read has a buffer");
        read_exact(r, &mut buf[range.start + start..range.start + end]).await?;
        p.covered += n;
        return Ok(());
    }
    // Everything else is small: block status is bounded by the spec's 2^20
    // descriptors, error messages by 4 KiB.
    if len > 16 + 16 * (1 << 20) {
        return Err(format!("protocol error: chunk type {typ} of {len} bytes"));
    }
    let mut payload = vec![0u8; len as usize];
    read_exact(r, &mut payload).await?;
    let chunk = decode_chunk(typ, &payload).map_err(|e| format!("protocol error: {e}"))?;
    let unexpected = || {
        format!(
            "protocol error: unexpected chunk type {typ} in the reply to {}",
            p.cmd.verb()
        )
    };
    match chunk {
        Chunk::None => {}
        Chunk::OffsetHole { offset, length } if p.cmd == Command::Read => {
            let (start, end) = chunk_range(p, offset, length as u64)?;
            let (buf, range) = p.buf.as_mut().expect("read has a buffer");
            buf[range.start + start..range.start + end].fill(0);
            p.covered += length as u64;
        }
        Chunk::BlockStatus {
            context_id,
            descriptors,
        } if p.cmd == Command::BlockStatus => {
            // Only base:allocation was selected; ignore any other context.
            if Some(context_id) == conn.context_id {
                for d in descriptors {
                    if d.length == 0 {
                        return Err("protocol error: zero-length block status extent".into());
                    }
                    p.status.push(BlockStatus {
                        len: d.length,
                        flags: d.status,
                    });
                }
            }
        }
        Chunk::Error { error, message } => p.set_error(error, message),
        Chunk::ErrorOffset {
            error,
            message,
            offset,
        } => p.set_error(
            error,
            if message.is_empty() {
                format!("at offset {offset}")
            } else {
                format!("{message} (at offset {offset})")
            },
        ),
        Chunk::Unknown { typ, .. } if typ & REPLY_TYPE_FLAG_ERROR != 0 => {
            // Spec: an unknown error chunk fails the reply, the connection lives.
            p.set_error(NBD_EINVAL, format!("unknown error chunk type {typ}"))
        }
        // Spec: unknown or unexpected non-error chunk: hard disconnect.
        _ => return Err(unexpected()),
    }
    Ok(())
}

impl Pending {
    fn set_error(&mut self, errno: u32, message: String) {
        // Spec: errno 0 in an error chunk is invalid; unknown values are
        // treated as EINVAL. Keep the first error of a reply.
        let errno = if errno == 0 { NBD_EINVAL } else { errno };
        if self.error.is_none() {
            self.error = Some((errno, (!message.is_empty()).then_some(message)));
        }
    }
}

fn chunk_range(p: &Pending, off: u64, n: u64) -> std::result::Result<(usize, usize), String> {
    if off < p.offset || off.checked_add(n).is_none_or(|e| e > p.offset + p.len) {
        return Err(format!(
            "protocol error: chunk at {off} length {n} outside the request at {} length {}",
            p.offset, p.len
        ));
    }
    let start = (off - p.offset) as usize;
    Ok((start, start + n as usize))
}

// ---------------------------------------------------------------------------
// Handshake

async fn handshake(
    r: &mut Reader,
    w: &mut Writer,
    export: &str,
    opts: &ConnectOptions,
) -> std::result::Result<(ExportInfo, Option<u32>), String> {
    let io = |e: std::io::Error| format!("writing to the server: {e}");
    let mut b = [0u8; GREETING_LEN];
    read_exact(r, &mut b).await?;
    let (hflags, _) = decode_greeting(&b).map_err(|e| match e {
        DecodeError::Invalid("not a newstyle server") => {
            "the server does not speak newstyle NBD (oldstyle servers are not supported)".into()
        }
        e => format!("not an NBD server: {e}"),
    })?;
    if hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err("the server does not support fixed newstyle negotiation".into());
    }
    let no_zeroes = hflags & FLAG_NO_ZEROES != 0;
    let mut out = Vec::new();
    encode_client_flags(
        &mut out,
        FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 },
    );
    w.write_all(&out).await.map_err(io)?;

    let mut extended = false;
    let mut structured = false;
    if opts.extended_headers {
        // Extended headers imply structured replies (64-bit lengths in both
        // directions); offered first, as servers that know them prefer them.
        extended = optional(r, w, ClientOption::ExtendedHeaders).await?;
        structured = extended;
    }
    if !structured && opts.structured_replies {
        structured = optional(r, w, ClientOption::StructuredReply).await?;
    }

    let mut context: Option<(u32, String)> = None;
    if structured && opts.block_status {
        send_option(
            w,
            &ClientOption::SetMetaContext(MetaContextRequest {
                name: export.to_string(),
                queries: vec![META_CONTEXT_BASE_ALLOCATION.to_string()],
            }),
        )
        .await?;
        loop {
            match option_reply(r, OPT_SET_META_CONTEXT).await? {
                OptionReply::MetaContext { id, name } => {
                    if name == META_CONTEXT_BASE_ALLOCATION {
                        context = Some((id, name));
                    }
                }
                OptionReply::Ack => break,
                OptionReply::Error { reply, message } => {
                    // Block status is an optimisation: without it everything
                    // reads as data. Spec: disregard contexts sent before an
                    // error.
                    tracing::debug!(reply = reply_type_name(reply), %message, "server refused SET_META_CONTEXT");
                    context = None;
                    break;
                }
                other => return Err(format!("unexpected reply {other:?} to SET_META_CONTEXT")),
            }
        }
    }

    send_option(
        w,
        &ClientOption::Go(InfoRequest {
            name: export.to_string(),
            info: vec![INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION],
        }),
    )
    .await?;
    let mut info = ExportInfo {
        name: export.to_string(),
        description: None,
        size: 0,
        flags: 0,
        min_block: 1,
        pref_block: 4096,
        max_payload: 32 << 20,
        block_size_advertised: false,
        structured_replies: structured,
        extended_headers: extended,
        meta_context: None,
        connections: 1,
    };
    let mut got_export = false;
    loop {
        match option_reply(r, OPT_GO).await? {
            OptionReply::Info(i) => match i {
                Info::Export { size, flags } => {
                    info.size = size;
                    info.flags = flags;
                    got_export = true;
                }
                Info::Name(n) => info.name = n,
                Info::Description(d) => info.description = Some(d),
                Info::BlockSize {
                    min,
                    preferred,
                    max,
                } => {
                    if !min.is_power_of_two()
                        || min > 65536
                        || !preferred.is_power_of_two()
                        || preferred < min
                        || max < preferred
                    {
                        return Err(format!(
                            "invalid block sizes from the server: minimum {min}, preferred {preferred}, maximum payload {max}"
                        ));
                    }
                    info.min_block = min;
                    info.pref_block = preferred;
                    info.max_payload = max;
                    info.block_size_advertised = true;
                }
                // Spec: ignore information types we do not know.
                Info::Unknown { .. } => {}
            },
            OptionReply::Ack => break,
            OptionReply::Error { reply, .. } if reply == REP_ERR_UNSUP => {
                // A server without NBD_OPT_GO: NBD_OPT_EXPORT_NAME cannot
                // report errors (a refusal is a hang-up), but it is all such a
                // server knows.
                send_option(w, &ClientOption::ExportName(export.to_string())).await?;
                let mut b = vec![0u8; 10 + if no_zeroes { 0 } else { EXPORT_NAME_PADDING }];
                read_exact(r, &mut b)
                    .await
                    .map_err(|e| format!("export '{export}' refused: {e}"))?;
                let ((size, flags), _) =
                    decode_export_name_reply(&b, no_zeroes).map_err(|e| e.to_string())?;
                info.size = size;
                info.flags = flags;
                context = None;
                got_export = true;
                break;
            }
            OptionReply::Error { reply, message } => {
                return Err(rep_error("export", export, reply, &message))
            }
            other => return Err(format!("unexpected reply {other:?} to NBD_OPT_GO")),
        }
    }
    if !got_export {
        return Err("the server accepted the export without sending its size".into());
    }
    if info.flags & FLAG_HAS_FLAGS == 0 {
        info.flags = 0;
    }
    info.meta_context = context.as_ref().map(|c| c.1.clone());
    Ok((info, context.map(|c| c.0)))
}

fn rep_error(what: &str, export: &str, reply: u32, message: &str) -> String {
    let name = match reply {
        REP_ERR_TLS_REQD => "the server requires TLS, which rawdisk does not support",
        REP_ERR_UNKNOWN => "no such export",
        REP_ERR_SHUTDOWN => "the server is shutting down",
        r => reply_type_name(r),
    };
    if message.is_empty() {
        format!("{what} '{export}': {name}")
    } else {
        format!("{what} '{export}': {name}: {message}")
    }
}

/// Sends an option that needs no data and may be refused: true on ACK.
async fn optional(
    r: &mut Reader,
    w: &mut Writer,
    opt: ClientOption,
) -> std::result::Result<bool, String> {
    let code = opt.option();
    send_option(w, &opt).await?;
    match option_reply(r, code).await? {
        OptionReply::Ack => Ok(true),
        OptionReply::Error { reply, message } if reply == REP_ERR_SHUTDOWN => {
            Err(rep_error("option", option_name(code), reply, &message))
        }
        // An optional feature the server refuses is simply not available.
        OptionReply::Error { .. } => Ok(false),
        other => Err(format!(
            "unexpected reply {other:?} to {}",
            option_name(code)
        )),
    }
}

async fn send_option(w: &mut Writer, opt: &ClientOption) -> std::result::Result<(), String> {
    let mut b = Vec::new();
    opt.encode(&mut b);
    w.write_all(&b)
        .await
        .map_err(|e| format!("writing to the server: {e}"))?;
    w.flush()
        .await
        .map_err(|e| format!("writing to the server: {e}"))
}

async fn option_reply(r: &mut Reader, opt: u32) -> std::result::Result<OptionReply, String> {
    let mut b = [0u8; OPTION_REPLY_HEADER_LEN];
    read_exact(r, &mut b).await?;
    let (h, _) = decode_option_reply_header(&b).map_err(|e| format!("bad option reply: {e}"))?;
    if h.option != opt {
        return Err(format!(
            "reply to option {} while waiting for {}",
            option_name(h.option),
            option_name(opt)
        ));
    }
    if h.len > 16 << 20 {
        return Err(format!("option reply of {} bytes", h.len));
    }
    let mut data = vec![0u8; h.len as usize];
    read_exact(r, &mut data).await?;
    OptionReply::parse(h.reply, &data).map_err(|e| format!("bad option reply: {e}"))
}

// ---------------------------------------------------------------------------
// Blocking facade

/// The same client for synchronous callers (the CLI): owns a small runtime.
pub mod blocking {
    use super::*;

    pub struct Client {
        rt: tokio::runtime::Runtime,
        inner: Arc<super::Client>,
    }

    impl Client {
        pub fn connect(uri: &NbdUri, opts: &ConnectOptions) -> Result<Client> {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .map_err(|e| Error::Connect {
                    target: uri.to_string(),
                    message: format!("cannot start the I/O runtime: {e}"),
                })?;
            let inner = Arc::new(rt.block_on(super::Client::connect(uri, opts))?);
            Ok(Client { rt, inner })
        }
        pub fn info(&self) -> &ExportInfo {
            self.inner.info()
        }
        pub fn size(&self) -> u64 {
            self.inner.size()
        }
        /// The async client, for use inside [`Client::runtime`].
        pub fn inner(&self) -> &Arc<super::Client> {
            &self.inner
        }
        pub fn runtime(&self) -> &tokio::runtime::Runtime {
            &self.rt
        }
        pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            // One reply buffer for every chunk, not one per request.
            let max = self.info().max_io().max(4096) as usize;
            let mut v = vec![0u8; buf.len().min(max)];
            let mut done = 0;
            while done < buf.len() {
                let n = (buf.len() - done).min(max);
                v = self
                    .rt
                    .block_on(self.inner.read_into(offset + done as u64, v, 0..n))?;
                buf[done..done + n].copy_from_slice(&v[..n]);
                done += n;
            }
            Ok(())
        }
        pub fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
            let max = self.info().max_io().max(4096) as usize;
            for (i, c) in buf.chunks(max).enumerate() {
                self.rt
                    .block_on(self.inner.write(offset + (i * max) as u64, c, fua))?;
            }
            Ok(())
        }
        pub fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
            self.rt.block_on(self.inner.zero(offset, len, flags))
        }
        pub fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
            self.rt.block_on(self.inner.trim(offset, len, fua))
        }
        pub fn flush(&self) -> Result<()> {
            self.rt.block_on(self.inner.flush())
        }
        pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<BlockStatus>> {
            self.rt.block_on(self.inner.block_status(offset, len))
        }
        pub fn disconnect(&self) -> Result<()> {
            self.rt.block_on(self.inner.disconnect())
        }
    }
}
