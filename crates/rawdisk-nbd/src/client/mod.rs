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
//!
//! Where things are: this file holds the public types, [`Client`] (checks,
//! splitting, picking a connection); `error` the errors; `list`
//! [`list_exports`]; `conn` one connection (sending requests,
//! the reader task matching replies to them); `handshake` the option
//! negotiation; `stream` the byte stream both of them read and write;
//! `blocking` the synchronous facade.

pub mod blocking;
mod conn;
mod error;
mod handshake;
mod list;
mod stream;

use std::fmt;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::proto::*;
use crate::tls::ClientTls;
use crate::uri::{NbdUri, Transport};
use conn::{Conn, Done};
pub use error::{Error, HandshakeError, Result};
pub use list::{list_exports, ListedExport};

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
    /// The extra metadata contexts selected ([`ConnectOptions::extra_contexts`]),
    /// all of them: a connection without one of them fails to open.
    pub contexts: Vec<String>,
    /// What NBD_OPT_LIST_META_CONTEXT answered to
    /// [`ConnectOptions::list_contexts`] (empty when not asked, or refused).
    pub listed_contexts: Vec<String>,
    /// Connections actually opened (more than one only with multi-conn).
    pub connections: usize,
}

impl ExportInfo {
    /// The spec's defaults for `name`, before the server has said anything.
    fn unnegotiated(name: &str) -> ExportInfo {
        ExportInfo {
            name: name.to_string(),
            description: None,
            size: 0,
            flags: 0,
            min_block: 1,
            pref_block: 4096,
            max_payload: 32 << 20,
            block_size_advertised: false,
            structured_replies: false,
            extended_headers: false,
            meta_context: None,
            contexts: Vec::new(),
            listed_contexts: Vec::new(),
            connections: 1,
        }
    }
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
    /// More metadata contexts to select by name (`qemu:dirty-bitmap:NAME`,
    /// `rawdisk:changed:NAME`), for [`Client::block_status_context`]. The
    /// connection fails ([`Error::NoContext`]) when the server does not
    /// offer every one of them.
    pub extra_contexts: Vec<String>,
    /// Queries to list before selecting (NBD_OPT_LIST_META_CONTEXT, e.g.
    /// `rawdisk:checkpoint:`); the answer is
    /// [`ExportInfo::listed_contexts`].
    pub list_contexts: Vec<String>,
    /// Give up connecting and negotiating after this long.
    pub timeout: Duration,
    /// Abandon a connection whose server has not answered for this long
    /// while requests wait (its requests fail as on a broken connection).
    pub request_timeout: Option<Duration>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            connections: 1,
            extended_headers: true,
            structured_replies: true,
            block_status: true,
            extra_contexts: Vec::new(),
            list_contexts: Vec::new(),
            timeout: Duration::from_secs(30),
            request_timeout: None,
        }
    }
}

/// The TLS client for an `nbds://` URI (credentials read once, for every
/// connection), checking the server against the URI's host.
fn client_tls(uri: &NbdUri, target: &str) -> Result<Option<ClientTls>> {
    let Some(p) = &uri.tls else {
        return Ok(None);
    };
    let host = match &uri.transport {
        Transport::Tcp { host, .. } => Some(host.as_str()),
        Transport::Unix { .. } => None,
    };
    ClientTls::new(p, host)
        .map(Some)
        .map_err(|e| Error::Connect {
            target: target.to_string(),
            message: e.to_string(),
        })
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

/// One block status descriptor: of `base:allocation`, or of the context
/// [`Client::block_status_context`] names (flags then mean what it defines).
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
    /// The connection that negotiated `info`, then the extra ones
    /// (multi-conn) in the order their handshakes finished.
    conns: Arc<Conns>,
    /// Opens the extra connections; [`Client::connect_early`] returns
    /// before it is done.
    opener: std::sync::Mutex<Option<tokio::task::JoinHandle<Option<Error>>>>,
    info: ExportInfo,
    target: String,
}

/// The first connection and slots the extra ones fill as they open: a
/// request picks among the open ones without taking a lock.
struct Conns {
    first: Arc<Conn>,
    extra: Vec<std::sync::OnceLock<Arc<Conn>>>,
    /// The client is gone: a connection that opens now is closed at once.
    closed: std::sync::atomic::AtomicBool,
}

impl Conns {
    fn iter(&self) -> impl Iterator<Item = &Arc<Conn>> {
        std::iter::once(&self.first).chain(self.extra.iter().map_while(|s| s.get()))
    }
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
    /// opens the extra connections too, and fails if one of them fails.
    pub async fn connect(uri: &NbdUri, opts: &ConnectOptions) -> Result<Client> {
        let mut c = Self::open(uri, opts, false).await?;
        let opener = c.opener.get_mut().unwrap().take();
        if let Some(h) = opener {
            if let Some(e) = h.await.unwrap_or_else(|e| {
                Some(Error::Connect {
                    target: c.target.clone(),
                    message: e.to_string(),
                })
            }) {
                return Err(e);
            }
        }
        c.info.connections = c.connections();
        tracing::debug!(target = %c.target, info = ?c.info, "NBD export open");
        Ok(c)
    }

    /// As [`Client::connect`], but returns once the first connection is
    /// negotiated: the extra ones join as their handshakes finish (a server
    /// whose open is slow costs one handshake, not one after another), and
    /// one that fails or is refused (a connection cap) is left out with a
    /// log line. `info().connections` is 1; [`Client::connections`] counts.
    pub async fn connect_early(uri: &NbdUri, opts: &ConnectOptions) -> Result<Client> {
        Self::open(uri, opts, true).await
    }

    /// The first connection; the extra ones opening in the background
    /// (`early`: a failed one is logged, not an error).
    async fn open(uri: &NbdUri, opts: &ConnectOptions, early: bool) -> Result<Client> {
        let target = uri.to_string();
        // Credentials are read once and shared by every connection.
        let tls = client_tls(uri, &target)?.map(Arc::new);
        let (first, mut info) =
            tokio::time::timeout(opts.timeout, Conn::open(uri, opts, &target, tls.as_deref()))
                .await
                .map_err(|_| Error::Connect {
                    target: target.clone(),
                    message: format!("timed out after {:?}", opts.timeout),
                })??;
        let extra = if info.can_multi_conn() {
            opts.connections.saturating_sub(1)
        } else {
            0
        };
        let conns = Arc::new(Conns {
            first,
            extra: (0..extra).map(|_| std::sync::OnceLock::new()).collect(),
            closed: Default::default(),
        });
        info.connections = 1;
        let opener = (extra > 0).then(|| {
            let (uri, opts, target, conns) =
                (uri.clone(), opts.clone(), target.clone(), conns.clone());
            let want = info.clone();
            tokio::spawn(async move {
                let failed = open_extra(&uri, &opts, &target, tls, &conns, &want).await;
                if let Some(e) = failed.as_ref().filter(|_| early) {
                    tracing::info!(
                        "{target}: {e}; going on with {} connection(s)",
                        conns.iter().count()
                    );
                }
                failed
            })
        });
        Ok(Client {
            conns,
            opener: std::sync::Mutex::new(opener),
            info,
            target,
        })
    }

    /// Connections open now (extra ones may still be joining).
    pub fn connections(&self) -> usize {
        self.conns.iter().count()
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
            .unwrap_or(&self.conns.first)
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
            .request(
                Command::Read,
                0,
                offset,
                len,
                None,
                Some((buf, range)),
                None,
            )
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
            .request(Command::Write, flags, offset, len, Some(data), None, None)
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
                .request(Command::WriteZeroes, f, o, l, None, None, None)
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
                .request(Command::Trim, f, o, l, None, None, None)
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
            .map(|c| c.request(Command::Flush, 0, 0, 0, None, None, None))
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
        let conn = self.pick();
        let id = conn.context_id;
        status_of(conn, id, offset, len, META_CONTEXT_BASE_ALLOCATION).await
    }

    /// Descriptors of the metadata context `name`, one of
    /// [`ConnectOptions::extra_contexts`], starting at `offset` (at least one
    /// on success; they may cover less than `len`, or the last one more).
    /// Chunks of the other selected contexts are ignored.
    pub async fn block_status_context(
        &self,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<BlockStatus>> {
        self.check(
            Command::BlockStatus,
            offset,
            len.min(self.info.size - offset.min(self.info.size)),
        )?;
        let conn = self.pick();
        // Each connection negotiated its own ids.
        let id = conn.contexts.iter().find(|c| c.0 == name).map(|c| c.1);
        self.require(
            id.is_some(),
            Command::BlockStatus,
            offset,
            len,
            &format!("metadata context {name} was not selected when connecting"),
        )?;
        let len = len.min(self.info.max_effect()).min(self.info.size - offset);
        status_of(conn, id, offset, len, name).await
    }

    /// NBD_CMD_DISC on every connection once they are idle, then wait for the
    /// server to close them. Errors of requests still in flight are returned
    /// by those requests, not lost.
    pub async fn disconnect(&self) -> Result<()> {
        // Extra connections still opening finish first (each within the
        // connect timeout), so none is left behind half negotiated.
        let opener = self.opener.lock().unwrap().take();
        if let Some(h) = opener {
            let _ = h.await;
        }
        for c in self.conns.iter() {
            c.begin_disconnect().await;
        }
        for c in self.conns.iter() {
            c.finish_disconnect().await;
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
        self.conns.closed.store(true, Ordering::SeqCst);
        if let Some(h) = self.opener.get_mut().unwrap().take() {
            h.abort();
        }
        abort_readers(self.conns.iter());
    }
}

/// Opens the extra connections of `conns` concurrently, each into the next
/// free slot once negotiated. Returns the first failure: one that fails or
/// negotiates another export is closed and left out.
async fn open_extra(
    uri: &NbdUri,
    opts: &ConnectOptions,
    target: &str,
    tls: Option<Arc<ClientTls>>,
    conns: &Conns,
    want: &ExportInfo,
) -> Option<Error> {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..conns.extra.len() {
        let (uri, opts, target, tls) = (uri.clone(), opts.clone(), target.to_string(), tls.clone());
        set.spawn(async move {
            let open = Conn::open(&uri, &opts, &target, tls.as_deref());
            match tokio::time::timeout(opts.timeout, open).await {
                Ok(r) => r,
                Err(_) => Err(Error::Connect {
                    target,
                    message: "timed out opening an extra connection".into(),
                }),
            }
        });
    }
    let (mut failed, mut next) = (None, 0);
    while let Some(r) = set.join_next().await {
        let r = r
            .map_err(|e| Error::Connect {
                target: target.to_string(),
                message: e.to_string(),
            })
            .and_then(|r| r);
        let e = match r {
            // Multi-conn promises the same export on every connection;
            // anything else would make them disagree.
            Ok((conn, other))
                if other.size != want.size || other.extended_headers != want.extended_headers =>
            {
                abort_readers(std::iter::once(&conn));
                Error::Handshake {
                    target: target.to_string(),
                    cause: HandshakeError::Protocol(
                        "extra connection negotiated a different export".into(),
                    ),
                }
            }
            Ok((conn, _)) => {
                let _ = conns.extra[next].set(conn.clone());
                next += 1;
                // Dropped meanwhile (the abort above may come too late):
                // whichever of the two runs second closes it.
                if conns.closed.load(Ordering::SeqCst) {
                    abort_readers(std::iter::once(&conn));
                }
                continue;
            }
            Err(e) => e,
        };
        tracing::debug!("{target}: extra connection: {e}");
        failed.get_or_insert(e);
    }
    failed
}

/// Each reader task holds its connection (and the socket's read half), so a
/// connection closes only once its reader is stopped.
fn abort_readers<'a>(conns: impl Iterator<Item = &'a Arc<Conn>>) {
    for c in conns {
        if let Some(h) = c.reader.lock().unwrap().take() {
            h.abort();
        }
    }
}

/// One BLOCK_STATUS request on `conn`, keeping the descriptors of context `id`.
async fn status_of(
    conn: &Conn,
    id: Option<u32>,
    offset: u64,
    len: u64,
    name: &str,
) -> Result<Vec<BlockStatus>> {
    match conn
        .request(Command::BlockStatus, 0, offset, len, None, None, id)
        .await?
    {
        Done::Status(v) if !v.is_empty() => Ok(v),
        Done::Status(_) | Done::Ok => Err(Error::Connection {
            cmd: Command::BlockStatus.verb(),
            offset,
            len,
            reason: format!("protocol error: the server sent no {name} extents"),
        }),
        Done::Read(_) => unreachable!(),
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
