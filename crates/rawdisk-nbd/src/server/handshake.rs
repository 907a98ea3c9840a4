//! The fixed newstyle handshake: greeting, client flags, then option
//! haggling until NBD_OPT_GO or NBD_OPT_EXPORT_NAME settles a [`Session`]
//! (spec: "Newstyle negotiation" and "Option types"), with an upgrade to
//! TLS on NBD_OPT_STARTTLS (spec: "TLS support"). Once the server shuts
//! down, the next option is answered NBD_REP_ERR_SHUTDOWN and the
//! connection closed (spec: "Option haggling").

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{watch, OwnedSemaphorePermit};
use tracing::{debug, trace, warn};

use super::buffers::{Input, READ_AHEAD};
use super::exports::{Export, Refused};
use super::limits::HandshakeSlot;
use super::meta::{self, Context};
use super::{protocol_error, BoxRead, BoxWrite, Session, Shared};
use crate::proto::*;

/// Transmission flags from what the target can do. Computed once per
/// connection, so they never change while it lasts.
fn transmission_flags(e: &Export) -> u16 {
    let t = &e.target;
    let mut f =
        FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA | FLAG_SEND_CACHE | FLAG_CAN_MULTI_CONN;
    if e.read_only {
        f |= FLAG_READ_ONLY;
    } else {
        f |= FLAG_SEND_WRITE_ZEROES;
        if t.can_trim() && e.trims() {
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

/// The transmission flags of `e`, fixed for this connection at the first
/// INFO/GO naming it, so INFO and GO agree (spec: NBD_OPT_INFO).
fn flags_for(fixed: &mut VecDeque<(String, u16)>, e: &Export) -> u16 {
    if let Some((_, f)) = fixed.iter().find(|(n, _)| *n == e.name) {
        return *f;
    }
    let f = transmission_flags(e);
    if fixed.len() == FLAGS_KEPT {
        fixed.pop_front();
    }
    fixed.push_back((e.name.clone(), f));
    f
}

/// Exports whose flags a connection keeps fixed: a lister asks about one
/// export after another, so the last few are the ones INFO and GO must
/// agree on, and a list of 65,536 long names is not held per connection.
const FLAGS_KEPT: usize = 16;

/// The export a client named, or why it gets none (counted and logged: an
/// operator wants to see clients asking for the wrong name, or for a file
/// the server will not serve).
fn find(sh: &Shared, peer: &str, option: &str, name: &str) -> Result<Arc<Export>, Refused> {
    sh.exports
        .find(name, sh.cfg.write_behind, sh.cfg.max_payload)
        .inspect_err(|r| refused_export(sh, peer, option, r))
}

async fn send<W: AsyncWrite + Unpin>(wr: &mut W, out: &mut Vec<u8>) -> io::Result<()> {
    wr.write_all(out).await?;
    wr.flush().await?;
    out.clear();
    Ok(())
}

/// The streams the transmission phase runs on: the accepted ones, or after
/// NBD_OPT_STARTTLS the TLS session over them, on the generic stream path
/// (the raw-socket fast paths would bypass TLS).
pub(super) enum Link<R, W> {
    Plain(Input<R>, BufWriter<W>),
    Tls(Input<BoxRead>, BufWriter<BoxWrite>),
}

/// Where the option haggling stands with respect to TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TlsPhase {
    /// The server has no TLS (spec: NOTLS mode).
    Off,
    /// TLS is configured and not started yet; `required`: FORCEDTLS.
    Offered { required: bool },
    /// Options now travel over TLS.
    Active,
}

enum Outcome {
    Aborted,
    Session(Session),
    StartTls,
}

/// What may end the handshake from outside: the server's shutdown, and a
/// newer connection taking this one's place among those in the handshake.
pub(super) struct Stop {
    rx: watch::Receiver<bool>,
    requested: bool,
    slot: HandshakeSlot,
    /// Queries answered about names a listing told (at most as many as the
    /// longest NBD_OPT_LIST reply named); the caller's handshake deadline
    /// grows with them (`TIME_PER_LISTED`).
    earned: Arc<AtomicUsize>,
}

impl Stop {
    pub(super) fn new(
        rx: watch::Receiver<bool>,
        slot: HandshakeSlot,
        earned: Arc<AtomicUsize>,
    ) -> Stop {
        Stop {
            rx,
            requested: false,
            slot,
            earned,
        }
    }

    /// Leaves the connections in the handshake before the reply that ends
    /// it goes out, so a client told it may transmit is never evicted
    /// after; false if it was evicted already.
    fn enter_transmission(&mut self) -> bool {
        self.slot.finish()
    }

    /// Waits until `n` bytes from the client are buffered (reading no
    /// further: TLS may start behind them), noting a shutdown that comes
    /// meanwhile. After it, the caller bounds the wait.
    async fn bytes<R: AsyncRead + Unpin>(&mut self, rd: &mut Input<R>, n: usize) -> io::Result<()> {
        if !self.requested {
            let got = tokio::select! {
                r = rd.fill_to(n, 0) => Some(r),
                _ = self.rx.wait_for(|v| *v) => None,
            };
            // An option that arrived with the shutdown is answered as one
            // after it.
            self.requested = got.is_none() || *self.rx.borrow();
            if let Some(r) = got {
                return r;
            }
        }
        rd.fill_to(n, 0).await
    }
}

/// The whole handshake, including a TLS upgrade. Ok(None): the client
/// aborted or was refused, or the handshake was ended from outside
/// (shutdown, eviction); Some also carries the connection's place under
/// the cap. The caller's handshake timeout covers the TLS handshake too.
pub(super) async fn handshake<R, W>(
    sh: &Shared,
    mut rd: Input<R>,
    mut wr: BufWriter<W>,
    peer: &str,
    mut stop: Stop,
) -> io::Result<Option<(Session, Link<R, W>, OwnedSemaphorePermit)>>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut out = Vec::with_capacity(512);
    encode_greeting(&mut out, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    send(&mut wr, &mut out).await.map_err(silent_close)?;

    stop.bytes(&mut rd, 4).await.map_err(silent_close)?;
    let mut b4 = [0u8; 4];
    b4.copy_from_slice(rd.take(4));
    let cflags = u32::from_be_bytes(b4);
    // Spec (Client flags): the server MUST drop the connection on unknown flags.
    if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(protocol_error(format!("unknown client flags {cflags:#x}")));
    }
    let no_zeroes = cflags & FLAG_C_NO_ZEROES != 0;
    // Spec (TLS support): without fixed newstyle from both sides, NOTLS.
    let phase = match &sh.cfg.tls {
        Some(t) if cflags & FLAG_C_FIXED_NEWSTYLE != 0 => TlsPhase::Offered {
            required: t.required(),
        },
        Some(t) if t.required() => {
            tls_required(
                sh,
                peer,
                "the connection",
                "the client does not speak fixed newstyle",
            );
            return Ok(None);
        }
        _ => TlsPhase::Off,
    };
    match options(sh, &mut rd, &mut wr, no_zeroes, phase, &mut stop, peer).await? {
        Outcome::Aborted => return Ok(None),
        Outcome::Session(s) => return Ok(stop.slot.place().map(|p| (s, Link::Plain(rd, wr), p))),
        Outcome::StartTls => {}
    }
    let tls = sh
        .cfg
        .tls
        .as_ref()
        .expect("STARTTLS accepted only with TLS configured");
    // discard_pipelined left nothing read ahead: TLS starts at the socket.
    let stream = tokio::io::join(rd.into_inner(), wr.into_inner());
    let (stream, info) = tls.accept(stream).await?;
    debug!("{peer}: TLS {info}");
    let (r, w) = crate::tls::split(stream);
    let mut rd = Input::new(Box::new(r) as BoxRead);
    let mut wr = BufWriter::with_capacity(64 << 10, Box::new(w) as BoxWrite);
    // Spec: everything negotiated before TLS is forgotten (CVE-2021-3716:
    // a server that kept structured replies across STARTTLS).
    match options(
        sh,
        &mut rd,
        &mut wr,
        no_zeroes,
        TlsPhase::Active,
        &mut stop,
        peer,
    )
    .await?
    {
        Outcome::Aborted => Ok(None),
        Outcome::Session(s) => Ok(stop.slot.place().map(|p| (s, Link::Tls(rd, wr), p))),
        Outcome::StartTls => unreachable!("a second NBD_OPT_STARTTLS is refused"),
    }
}

/// A peer that goes away before sending a byte (another server checking
/// whether the socket is live, a port probe) closed the connection; it
/// did not break a handshake, so it is not logged as one.
fn silent_close(e: io::Error) -> io::Error {
    match e.kind() {
        io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted => io::Error::new(io::ErrorKind::UnexpectedEof, e),
        _ => e,
    }
}

/// Plaintext a client pipelined after NBD_OPT_STARTTLS, before it could
/// have seen the ACK, is read and dropped, up to this much; more and the
/// connection is closed.
const PIPELINED_MAX: usize = 1 << 20;

/// Bytes of NBD_OPT_LIST replies a connection encodes before sending them.
const LIST_CHUNK: usize = 64 << 10;

/// Options a listing client may send per name NBD_OPT_LIST told it, over
/// `max_options`: NBD_OPT_INFO or GO, and a meta context query.
const OPTIONS_PER_LISTED: usize = 4;

/// Handshake time a listing client earns per query it sends about the
/// names NBD_OPT_LIST told it (up to one per name), over the handshake
/// timeout: asking about 10,000 exports takes seconds on a loaded machine,
/// which a fixed deadline would cut off midway. Earned, not granted at the
/// LIST, so a client that lists and then idles is still closed on time.
pub(super) const TIME_PER_LISTED: Duration = Duration::from_millis(10);

/// The option haggling phase.
async fn options<R, W>(
    sh: &Shared,
    rd: &mut Input<R>,
    wr: &mut W,
    no_zeroes: bool,
    phase: TlsPhase,
    stop: &mut Stop,
    peer: &str,
) -> io::Result<Outcome>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let cfg = &sh.cfg;
    let mut out = Vec::with_capacity(512);
    let mut mode = ReplyMode::Simple;
    // (export name, selected contexts) from the last SET_META_CONTEXT.
    let mut selected: Option<(String, Vec<(u32, Context)>)> = None;
    // Per export, fixed at the first INFO/GO so INFO and GO agree (spec).
    let mut base_flags: VecDeque<(String, u16)> = VecDeque::new();
    // The export the last option named, held so the INFO or GO a lister
    // sends after its meta context query finds it open.
    let mut recent: Option<Arc<Export>> = None;
    let mut data = Vec::new();
    // The longest list NBD_OPT_LIST sent, and the queries about it answered
    // so far. A listing client (nbdinfo --list, qemu-nbd -L) asks about
    // every name on the same connection, so the options allowed before
    // transmission grow with the list, and its time with the queries.
    let (mut listed, mut earned) = (0usize, 0usize);
    let allowed = |listed: usize| {
        cfg.max_options
            .saturating_add(listed.saturating_mul(OPTIONS_PER_LISTED))
    };
    let mut received = 0usize;

    while received < allowed(listed) {
        received += 1;
        stop.bytes(rd, OPTION_HEADER_LEN).await?;
        let mut hb = [0u8; OPTION_HEADER_LEN];
        hb.copy_from_slice(rd.take(OPTION_HEADER_LEN));
        let (h, _) = decode_option_header(&hb).map_err(|e| protocol_error(e.to_string()))?;
        let name = option_name(h.option);
        let query = matches!(
            h.option,
            OPT_INFO | OPT_GO | OPT_SET_META_CONTEXT | OPT_LIST_META_CONTEXT
        );
        if query && earned < listed {
            earned += 1;
            stop.earned.store(earned, Ordering::Relaxed);
        }
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

        if stop.requested {
            // Spec (Option haggling): while shutting down the server SHOULD
            // answer options other than NBD_OPT_ABORT with
            // NBD_REP_ERR_SHUTDOWN; the client then disconnects.
            match h.option {
                OPT_ABORT => OptionReply::Ack.encode(h.option, &mut out),
                // Has no error reply: the spec says hang up.
                OPT_EXPORT_NAME => return Ok(Outcome::Aborted),
                _ => OptionReply::Error {
                    reply: REP_ERR_SHUTDOWN,
                    message: "the server is shutting down".into(),
                }
                .encode(h.option, &mut out),
            }
            let _ = send(wr, &mut out).await;
            return Ok(Outcome::Aborted);
        }

        if phase == (TlsPhase::Offered { required: true })
            && h.option != OPT_STARTTLS
            && h.option != OPT_ABORT
        {
            // Spec (FORCEDTLS): every other option is refused, and
            // NBD_OPT_EXPORT_NAME, which cannot be refused, ends the session.
            if matches!(h.option, OPT_EXPORT_NAME | OPT_INFO | OPT_GO) {
                tls_required(sh, peer, name, "the client did not start it");
            }
            if h.option == OPT_EXPORT_NAME {
                return Ok(Outcome::Aborted);
            }
            let msg = format!("{name}: TLS is required (send NBD_OPT_STARTTLS)");
            reply_err(wr, &mut out, h.option, REP_ERR_TLS_REQD, &msg).await?;
            continue;
        }

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
                let e = match find(sh, peer, name, &export) {
                    Ok(e) => e,
                    Err(_) => return Ok(Outcome::Aborted),
                };
                let flags = flags_for(&mut base_flags, &e) | df_flag(mode);
                let size = e.size();
                if !stop.enter_transmission() {
                    return Ok(Outcome::Aborted);
                }
                encode_export_name_reply(&mut out, size, flags, no_zeroes);
                send(wr, &mut out).await?;
                let contexts = contexts_for(&mut selected, &export);
                let s = session(sh, e, mode, flags, size, contexts, false);
                return Ok(Outcome::Session(s));
            }
            ClientOption::Abort => {
                OptionReply::Ack.encode(h.option, &mut out);
                // The client may already be gone (spec: handle both).
                let _ = send(wr, &mut out).await;
                return Ok(Outcome::Aborted);
            }
            ClientOption::List => {
                let (names, description) = sh.exports.list(&cfg.description).await;
                listed = listed.max(names.len());
                for name in names.iter() {
                    let (name, description) = (name.clone(), description.clone());
                    OptionReply::Server { name, description }.encode(h.option, &mut out);
                    // Sent as encoded: a connection holds LIST_CHUNK of a
                    // long list (up to 16 MiB of names), not all of it.
                    if out.len() >= LIST_CHUNK {
                        send(wr, &mut out).await?;
                    }
                }
                OptionReply::Ack.encode(h.option, &mut out);
                send(wr, &mut out).await?;
            }
            ClientOption::StartTls => match phase {
                TlsPhase::Off => {
                    let msg = "TLS is not configured on this server";
                    reply_err(wr, &mut out, h.option, REP_ERR_POLICY, msg).await?;
                }
                TlsPhase::Active => {
                    let msg = "TLS is already active";
                    reply_err(wr, &mut out, h.option, REP_ERR_INVALID, msg).await?;
                }
                TlsPhase::Offered { .. } => {
                    discard_pipelined(rd).await?;
                    OptionReply::Ack.encode(h.option, &mut out);
                    send(wr, &mut out).await?;
                    return Ok(Outcome::StartTls);
                }
            },
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
                    selected = None;
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
                // Not logged: the INFO/GO that follows is.
                let e = match sh
                    .exports
                    .find(&req.name, cfg.write_behind, cfg.max_payload)
                {
                    Ok(e) => recent.insert(e).clone(),
                    Err(r) => {
                        reply_err(wr, &mut out, h.option, r.reply, &r.msg).await?;
                        continue;
                    }
                };
                let bitmaps = cfg.dirty_bitmaps.as_deref();
                let found = meta::numbered(meta::matching(&e, &req.queries, set, bitmaps));
                for (id, c) in &found {
                    OptionReply::MetaContext {
                        // LIST: the id is reserved and SHOULD be zero.
                        id: if set { *id } else { 0 },
                        name: c.name(),
                    }
                    .encode(h.option, &mut out);
                }
                for name in meta::listed_only(&e, &req.queries, set) {
                    OptionReply::MetaContext { id: 0, name }.encode(h.option, &mut out);
                }
                OptionReply::Ack.encode(h.option, &mut out);
                send(wr, &mut out).await?;
                if set {
                    selected = Some((req.name, found));
                }
            }
            ClientOption::Info(req) | ClientOption::Go(req) => {
                let go = h.option == OPT_GO;
                let e = match find(sh, peer, name, &req.name) {
                    Ok(e) => recent.insert(e).clone(),
                    Err(r) => {
                        reply_err(wr, &mut out, h.option, r.reply, &r.msg).await?;
                        continue;
                    }
                };
                meta::refresh(&e);
                let flags = flags_for(&mut base_flags, &e) | df_flag(mode);
                let size = e.size();
                OptionReply::Info(Info::Export { size, flags }).encode(h.option, &mut out);
                if req.info.contains(&INFO_NAME) {
                    OptionReply::Info(Info::Name(e.name.clone())).encode(h.option, &mut out);
                }
                if req.info.contains(&INFO_DESCRIPTION) && !cfg.description.is_empty() {
                    OptionReply::Info(Info::Description(cfg.description.clone()))
                        .encode(h.option, &mut out);
                }
                // Sent even when not asked for: clients that understand it
                // benefit, the others must ignore it (spec: NBD_OPT_INFO).
                OptionReply::Info(Info::BlockSize {
                    min: e.min_block,
                    preferred: e.preferred_block,
                    max: cfg.max_payload,
                })
                .encode(h.option, &mut out);
                if go && !stop.enter_transmission() {
                    return Ok(Outcome::Aborted);
                }
                OptionReply::Ack.encode(h.option, &mut out);
                send(wr, &mut out).await?;
                if go {
                    let contexts = contexts_for(&mut selected, &req.name);
                    let agreed = req.info.contains(&INFO_BLOCK_SIZE);
                    let s = session(sh, e, mode, flags, size, contexts, agreed);
                    return Ok(Outcome::Session(s));
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
        allowed(listed)
    )))
}

/// Reads and drops what the client sent after NBD_OPT_STARTTLS and before
/// our ACK: a client that follows the spec waits for the ACK before its TLS
/// ClientHello, so whatever is already here is plaintext pipelined past
/// STARTTLS. Bytes still in flight get to TLS, which rejects them.
async fn discard_pipelined<R: AsyncRead + Unpin>(rd: &mut Input<R>) -> io::Result<()> {
    let mut dropped = 0;
    loop {
        let n = rd.buffered();
        rd.take(n);
        dropped += n;
        if dropped > PIPELINED_MAX {
            return Err(protocol_error(format!(
                "more than {PIPELINED_MAX} bytes of plaintext after NBD_OPT_STARTTLS"
            )));
        }
        rd.top_up(READ_AHEAD).await?;
        if rd.buffered() == 0 {
            break;
        }
    }
    if dropped > 0 {
        debug!("discarded {dropped} plaintext bytes pipelined after NBD_OPT_STARTTLS");
    }
    Ok(())
}

/// Logs (at most once a second) and counts a refusal for want of TLS.
fn tls_required(sh: &Shared, peer: &str, what: &str, why: &str) {
    sh.stats.tls_required();
    if sh.tls_refusals.allow() {
        warn!("{peer}: refused {what}: TLS is required and {why}");
    }
}

/// Logs (at most once a second) an option refused for naming an export
/// this server does not have (counted as an unknown export) or will not
/// serve (a policy refusal, logged as one).
fn refused_export(sh: &Shared, peer: &str, option: &str, r: &Refused) {
    let what = if r.reply == REP_ERR_POLICY {
        "not served"
    } else {
        sh.stats.unknown_export();
        "unknown export"
    };
    if sh.export_refusals.allow() {
        warn!("{peer}: refused {option} ({what}): {}", r.msg);
    }
}

fn df_flag(mode: ReplyMode) -> u16 {
    // Spec: SEND_DF only when structured replies are in use.
    if mode.structured() {
        FLAG_SEND_DF
    } else {
        0
    }
}

/// The contexts the last SET_META_CONTEXT selected, if it named the export
/// the client goes on with (spec).
fn contexts_for(
    selected: &mut Option<(String, Vec<(u32, Context)>)>,
    export: &str,
) -> Vec<(u32, Context)> {
    match selected.take() {
        Some((name, found)) if name == export => found,
        _ => Vec::new(),
    }
}

fn session(
    sh: &Shared,
    export: Arc<Export>,
    mode: ReplyMode,
    flags: u16,
    size: u64,
    contexts: Vec<(u32, Context)>,
    enforce_min_block: bool,
) -> Session {
    Session {
        mode,
        flags,
        size,
        contexts: if mode.structured() {
            contexts
        } else {
            Vec::new()
        },
        enforce_min_block,
        min_block: export.min_block,
        // Held to what NBD_INFO_BLOCK_SIZE said only if the client asked.
        max_payload: if enforce_min_block {
            sh.cfg.max_payload
        } else {
            sh.cfg.max_payload_unnegotiated
        },
        export,
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
