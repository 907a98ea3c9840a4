//! One connection of the client: sending requests (each registered by
//! cookie before it is sent) and the reader task that matches replies and
//! structured chunks to them and completes each request's future.

use std::collections::HashMap;
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::handshake::{greet, handshake, starttls};
use super::stream::{read_exact, Reader, Writer};
use super::{BlockStatus, ConnectOptions, Error, ExportInfo, HandshakeError, Result};
use crate::proto::*;
use crate::tls::ClientTls;
use crate::uri::{NbdUri, Transport};

pub(super) enum Done {
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
    /// For block status: the context whose descriptors the caller wants.
    context: Option<u32>,
    status: Vec<BlockStatus>,
    tx: oneshot::Sender<Result<Done>>,
}

struct State {
    pending: HashMap<u64, Pending>,
    /// Why the connection is unusable; set once, never cleared.
    dead: Option<String>,
}

pub(super) struct Conn {
    writer: tokio::sync::Mutex<Option<Writer>>,
    state: Mutex<State>,
    next_cookie: AtomicU64,
    pub(super) inflight: AtomicUsize,
    extended: bool,
    structured: bool,
    /// The id of `base:allocation` on this connection.
    pub(super) context_id: Option<u32>,
    /// The extra contexts selected (name, id on this connection).
    pub(super) contexts: Vec<(String, u32)>,
    pub(super) reader: Mutex<Option<JoinHandle<()>>>,
    /// A duplicate of the socket, to shut it down under a blocked reader
    /// and writer when the server stops answering.
    sock: OwnedFd,
    /// When the server last showed life (a reply, or the first request
    /// after an idle spell), in milliseconds since `epoch`: what the
    /// request timeout measures. A send that went through does not count:
    /// the kernel takes bytes for a stopped server too.
    epoch: Instant,
    last_activity: AtomicU64,
}

/// A connection in the option phase: connected, greeted, TLS started for a
/// TLS URI. Also the socket (for shutting it down when the server stops
/// answering) and whether the server takes NO_ZEROES.
pub(super) async fn dial(
    uri: &NbdUri,
    target: &str,
    tls: Option<&ClientTls>,
) -> Result<(Reader, Writer, OwnedFd, bool)> {
    let connect_err = |e: std::io::Error| Error::Connect {
        target: target.to_string(),
        message: e.to_string(),
    };
    let (r, w, sock): (Box<dyn AsyncRead + Send + Unpin>, Writer, OwnedFd) = match &uri.transport {
        Transport::Tcp { host, port } => {
            let s = tokio::net::TcpStream::connect((host.as_str(), *port))
                .await
                .map_err(connect_err)?;
            s.set_nodelay(true).map_err(connect_err)?;
            let fd: OwnedFd = s.into_std().map_err(connect_err)?.into();
            let dup = fd.try_clone().map_err(connect_err)?;
            let (r, w, _) = crate::sock::split(fd).map_err(connect_err)?;
            (Box::new(r), Box::new(w), dup)
        }
        Transport::Unix { path } => {
            let s = tokio::net::UnixStream::connect(path)
                .await
                .map_err(connect_err)?;
            // Write payloads queue in this side's send buffer (AF_UNIX
            // charges the sender; docs/benchmarks.md, Copy).
            crate::sock::grow_unix_send_buffer(&s);
            let fd: OwnedFd = s.into_std().map_err(connect_err)?.into();
            let dup = fd.try_clone().map_err(connect_err)?;
            let (r, w, _) = crate::sock::split(fd).map_err(connect_err)?;
            (Box::new(r), Box::new(w), dup)
        }
    };
    let mut r = BufReader::with_capacity(256 * 1024, r);
    let mut w = w;
    let hs_err = |cause| handshake_error(target, cause);
    let no_zeroes = greet(&mut r, &mut w).await.map_err(hs_err)?;
    if let Some(tls) = tls {
        starttls(&mut r, &mut w).await.map_err(hs_err)?;
        // Spec: nothing but TLS follows the ACK; a server that sent more
        // in plaintext is not one to trust.
        if !r.buffer().is_empty() {
            return Err(hs_err(HandshakeError::Protocol(
                "the server sent plaintext after accepting NBD_OPT_STARTTLS".into(),
            )));
        }
        let stream = tokio::io::join(r.into_inner(), w);
        let (stream, info) = tls
            .connect(stream)
            .await
            .map_err(|e| hs_err(HandshakeError::Tls(e)))?;
        tracing::debug!("{target}: TLS {info}");
        let (tr, tw) = crate::tls::split(stream);
        r = BufReader::with_capacity(256 * 1024, Box::new(tr));
        w = Box::new(tw);
    }
    Ok((r, w, sock, no_zeroes))
}

fn handshake_error(target: &str, cause: HandshakeError) -> Error {
    Error::Handshake {
        target: target.to_string(),
        cause,
    }
}

impl Conn {
    pub(super) async fn open(
        uri: &NbdUri,
        opts: &ConnectOptions,
        target: &str,
        tls: Option<&ClientTls>,
    ) -> Result<(Arc<Conn>, ExportInfo)> {
        let (mut r, mut w, sock, no_zeroes) = dial(uri, target, tls).await?;
        let negotiated = match handshake(&mut r, &mut w, &uri.export, opts, no_zeroes).await {
            Ok(n) => n,
            Err(e) => {
                // Refused by an error reply: the option phase is still open,
                // so end it as the spec asks rather than hang up mid-phase
                // (which servers log as a failure of their own).
                if matches!(e, HandshakeError::Refused { reply: Some(_), .. }) {
                    super::handshake::abort(&mut w).await;
                }
                return Err(handshake_error(target, after_tls(tls, e)));
            }
        };
        let (info, context_id, contexts) = match negotiated {
            Ok(negotiated) => negotiated,
            Err(message) => {
                super::handshake::abort(&mut w).await;
                return Err(Error::NoContext {
                    target: target.to_string(),
                    message,
                });
            }
        };
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
            contexts,
            reader: Mutex::new(None),
            sock,
            epoch: Instant::now(),
            last_activity: AtomicU64::new(0),
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
        if let Some(limit) = opts.request_timeout.filter(|t| !t.is_zero()) {
            tokio::spawn(watchdog(Arc::downgrade(&conn), limit));
        }
        Ok((conn, info))
    }

    /// The server showed life now.
    fn touch(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.last_activity.store(ms, Ordering::Relaxed);
    }

    fn idle(&self) -> Duration {
        let last = Duration::from_millis(self.last_activity.load(Ordering::Relaxed));
        self.epoch.elapsed().saturating_sub(last)
    }

    /// Gives up on a connection whose server stopped answering: every
    /// request in flight fails with `reason`, and the socket is shut down
    /// so the reader and a writer blocked on a full socket stop too (the
    /// server sees the connection end).
    fn abandon(&self, reason: &str) {
        self.kill(reason);
        let _ = rustix::net::shutdown(&self.sock, rustix::net::Shutdown::Both);
    }

    /// Mark the connection dead and fail every request in flight.
    pub(super) fn kill(&self, reason: &str) {
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

    /// `context`: for block status, the context whose descriptors to keep
    /// (the server sends a chunk for every context the connection selected).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn request(
        &self,
        cmd: Command,
        flags: u16,
        offset: u64,
        len: u64,
        payload: Option<&[u8]>,
        buf: Option<(Vec<u8>, Range<usize>)>,
        context: Option<u32>,
    ) -> Result<Done> {
        let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let conn_err = |reason: String| Error::Connection {
            cmd: cmd.verb(),
            offset,
            len,
            reason,
        };
        // The reader task writes replies into `buf[range]`: a range that does
        // not fit would panic there, far from the caller's mistake.
        if let Some((v, range)) = &buf {
            if range.start > range.end || range.end > v.len() || (range.len() as u64) != len {
                return Err(Error::Invalid {
                    cmd: cmd.verb(),
                    offset,
                    len,
                    why: format!(
                        "buffer range {range:?} of a {}-byte buffer does not hold {len} bytes",
                        v.len()
                    ),
                });
            }
        }
        // Register before sending: the reply may arrive before send returns.
        {
            let mut st = self.state.lock().unwrap();
            if let Some(d) = &st.dead {
                return Err(conn_err(format!("connection lost: {d}")));
            }
            // After an idle spell the server's silence counts from now.
            if self.inflight.load(Ordering::Relaxed) == 0 {
                self.touch();
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
                    context,
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
            // Abandoned (the server stopped answering): say that, not EPIPE.
            if let Some(d) = self.state.lock().unwrap().dead.clone() {
                return Err(conn_err(format!("connection lost: {d}")));
            }
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

    /// Sends NBD_CMD_DISC and closes the writing side; the server then
    /// answers what is in flight and closes. [`Conn::finish_disconnect`]
    /// waits for that: a client with several connections sends every DISC
    /// first, so the servers close them at once, not one after another.
    pub(super) async fn begin_disconnect(&self) {
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
    }

    pub(super) async fn finish_disconnect(&self) {
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

/// Abandons the connection once requests have waited `limit` without the
/// server showing life (a stopped server, a hung one, a network path that
/// dropped silently): their callers see a broken connection, which copy
/// answers by reconnecting. Ends with the connection.
async fn watchdog(conn: Weak<Conn>, limit: Duration) {
    let tick = (limit / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
    loop {
        tokio::time::sleep(tick).await;
        let Some(c) = conn.upgrade() else { return };
        if c.state.lock().unwrap().dead.is_some() {
            return;
        }
        if c.inflight.load(Ordering::Relaxed) > 0 && c.idle() >= limit {
            tracing::debug!("no reply for {limit:?}: abandoning the connection");
            c.abandon(&format!("the server did not answer for {limit:?}"));
            return;
        }
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

/// With TLS 1.3 the server checks the client's certificate after the
/// client has finished its side of the handshake: a refusal then shows up
/// as the first option failing (EPIPE, EOF, a reset). That is a TLS
/// failure, not a drop worth retrying.
fn after_tls(tls: Option<&ClientTls>, e: HandshakeError) -> HandshakeError {
    match (tls, e) {
        (Some(tls), HandshakeError::Dropped { message, .. }) => {
            HandshakeError::Tls(tls.refused_after_handshake(&message))
        }
        (_, e) => e,
    }
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
            Ok(_) => conn.touch(),
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
        read_exact(r, &mut hb[4..hlen])
            .await
            .map_err(|e| e.to_string())?;
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
                    read_exact(r, &mut buf[range.clone()])
                        .await
                        .map_err(|e| e.to_string())?;
                    p.covered = p.len;
                }
                true
            }
            ReplyHeader::Chunk {
                flags, typ, length, ..
            } => {
                handle_chunk(r, &mut p, typ, length).await?;
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
        read_exact(r, &mut b).await.map_err(|e| e.to_string())?;
        let off = u64::from_be_bytes(b);
        let n = len - 8;
        let (start, end) = chunk_range(p, off, n)?;
        let (buf, range) = p.buf.as_mut().expect("read has a buffer");
        read_exact(r, &mut buf[range.start + start..range.start + end])
            .await
            .map_err(|e| e.to_string())?;
        p.covered += n;
        return Ok(());
    }
    // Everything else is small: block status is bounded by the spec's 2^20
    // descriptors, error messages by 4 KiB.
    if len > 16 + 16 * (1 << 20) {
        return Err(format!("protocol error: chunk type {typ} of {len} bytes"));
    }
    let mut payload = vec![0u8; len as usize];
    read_exact(r, &mut payload)
        .await
        .map_err(|e| e.to_string())?;
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
            // One chunk per selected context: keep the one asked for.
            if Some(context_id) == p.context {
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
