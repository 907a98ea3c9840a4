//! The fixed newstyle handshake: greeting, client flags, then option
//! haggling until NBD_OPT_GO or NBD_OPT_EXPORT_NAME settles a [`Session`]
//! (spec: "Newstyle negotiation" and "Option types").

use std::io;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tracing::{debug, trace};

use super::buffers::Input;
use super::{protocol_error, Session, Shared};
use crate::proto::*;

/// Context id handed out for base:allocation.
pub(super) const BASE_ALLOCATION_ID: u32 = 1;

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
pub(super) async fn handshake<R, W>(
    sh: &Shared,
    rd: &mut Input<R>,
    wr: &mut W,
) -> io::Result<Option<Session>>
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
