//! The client's fixed newstyle handshake: client flags, NBD_OPT_STARTTLS
//! first for a TLS URI, extended headers or structured replies when wanted,
//! base:allocation, then NBD_OPT_GO with block-size information, falling
//! back to NBD_OPT_EXPORT_NAME for old servers. Also the options of a
//! listing (NBD_OPT_LIST, NBD_OPT_INFO per export, NBD_OPT_ABORT).

use tokio::io::AsyncWriteExt;

use super::stream::{read_exact, Reader, Writer};
use super::{ConnectOptions, ExportInfo, HandshakeError};
use crate::proto::*;

type HsResult<T> = std::result::Result<T, HandshakeError>;

fn protocol(message: impl Into<String>) -> HandshakeError {
    HandshakeError::Protocol(message.into())
}

/// A failed write: the connection broke.
pub(super) fn write_failed(e: std::io::Error) -> HandshakeError {
    HandshakeError::Dropped {
        kind: e.kind(),
        message: format!("writing to the server: {e}"),
    }
}

/// Reads the greeting and sends the client flags; returns whether the
/// server leaves out the zero padding of the NBD_OPT_EXPORT_NAME reply.
pub(super) async fn greet(r: &mut Reader, w: &mut Writer) -> HsResult<bool> {
    let mut b = [0u8; GREETING_LEN];
    read_exact(r, &mut b).await?;
    let (hflags, _) = decode_greeting(&b).map_err(|e| match e {
        DecodeError::Invalid("not a newstyle server") => {
            protocol("the server does not speak newstyle NBD (oldstyle servers are not supported)")
        }
        e => protocol(format!("not an NBD server: {e}")),
    })?;
    if hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(protocol(
            "the server does not support fixed newstyle negotiation",
        ));
    }
    let no_zeroes = hflags & FLAG_NO_ZEROES != 0;
    let mut out = Vec::new();
    encode_client_flags(
        &mut out,
        FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 },
    );
    w.write_all(&out).await.map_err(write_failed)?;
    Ok(no_zeroes)
}

/// NBD_OPT_STARTTLS, as the first option (spec: a client that wants TLS
/// whatever the server's mode SHOULD send it first). An error reply ends
/// the connection: a TLS URI means TLS or nothing.
pub(super) async fn starttls(r: &mut Reader, w: &mut Writer) -> HsResult<()> {
    send_option(w, &ClientOption::StartTls).await?;
    match option_reply(r, OPT_STARTTLS).await? {
        OptionReply::Ack => Ok(()),
        OptionReply::Error { reply, message } => {
            let why = match reply {
                REP_ERR_UNSUP | REP_ERR_POLICY => "the server does not offer TLS".to_string(),
                r => reply_type_name(r).to_string(),
            };
            Err(HandshakeError::Refused {
                option: OPT_STARTTLS,
                reply: Some(reply),
                message: if message.is_empty() {
                    format!("NBD_OPT_STARTTLS refused: {why}")
                } else {
                    format!("NBD_OPT_STARTTLS refused: {why}: {message}")
                },
            })
        }
        other => Err(protocol(format!(
            "unexpected reply {other:?} to NBD_OPT_STARTTLS"
        ))),
    }
}

/// What a handshake negotiated: the export, the id of `base:allocation`
/// and the (name, id) of each extra context.
pub(super) type Negotiated = (ExportInfo, Option<u32>, Vec<(String, u32)>);

/// The option haggling after the greeting (and TLS, if any). The inner
/// error: the server does not offer one of `opts.extra_contexts` (said
/// before NBD_OPT_GO, so the caller can end the option phase politely).
pub(super) async fn handshake(
    r: &mut Reader,
    w: &mut Writer,
    export: &str,
    opts: &ConnectOptions,
    no_zeroes: bool,
) -> HsResult<std::result::Result<Negotiated, String>> {
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

    let extra = &opts.extra_contexts;
    if !structured {
        if let Some(name) = extra.first() {
            return Ok(Err(format!(
                "the server does not support structured replies, which metadata context {name} needs"
            )));
        }
    }
    let listed = if structured && !opts.list_contexts.is_empty() {
        list_contexts(r, w, export, &opts.list_contexts).await?
    } else {
        Vec::new()
    };
    let mut context: Option<(u32, String)> = None;
    let mut contexts: Vec<(String, u32)> = Vec::new();
    let mut queries = Vec::new();
    if opts.block_status {
        queries.push(META_CONTEXT_BASE_ALLOCATION.to_string());
    }
    queries.extend(extra.iter().cloned());
    if structured && !queries.is_empty() {
        send_option(
            w,
            &ClientOption::SetMetaContext(MetaContextRequest {
                name: export.to_string(),
                queries,
            }),
        )
        .await?;
        loop {
            match option_reply(r, OPT_SET_META_CONTEXT).await? {
                OptionReply::MetaContext { id, name } => {
                    if name == META_CONTEXT_BASE_ALLOCATION && opts.block_status {
                        context = Some((id, name));
                    } else if extra.contains(&name) && !contexts.iter().any(|c| c.0 == name) {
                        contexts.push((name, id));
                    }
                }
                OptionReply::Ack => break,
                OptionReply::Error { reply, message } => {
                    // Block status is an optimisation: without it everything
                    // reads as data. Spec: disregard contexts sent before an
                    // error.
                    tracing::debug!(reply = reply_type_name(reply), %message, "server refused SET_META_CONTEXT");
                    if let Some(name) = extra.first() {
                        if matches!(reply, REP_ERR_TLS_REQD | REP_ERR_UNKNOWN | REP_ERR_SHUTDOWN) {
                            return Err(rep_error(
                                OPT_SET_META_CONTEXT,
                                "export",
                                export,
                                reply,
                                &message,
                            ));
                        }
                        let why = rep_text("metadata context", name, reply, &message);
                        return Ok(Err(format!("the server refused {why}")));
                    }
                    context = None;
                    break;
                }
                other => {
                    return Err(protocol(format!(
                        "unexpected reply {other:?} to SET_META_CONTEXT"
                    )))
                }
            }
        }
    }
    if let Some(name) = extra.iter().find(|n| !contexts.iter().any(|c| &c.0 == *n)) {
        return Ok(Err(missing_context(name)));
    }

    send_option(
        w,
        &ClientOption::Go(InfoRequest {
            name: export.to_string(),
            info: vec![INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION],
        }),
    )
    .await?;
    let mut info = ExportInfo::unnegotiated(export);
    info.structured_replies = structured;
    info.extended_headers = extended;
    let got_export = match info_replies(r, OPT_GO, &mut info).await? {
        Ok(got) => got,
        Err((reply, _)) if reply == REP_ERR_UNSUP => {
            // A server without NBD_OPT_GO: NBD_OPT_EXPORT_NAME cannot
            // report errors (a refusal is a hang-up), but it is all such a
            // server knows.
            send_option(w, &ClientOption::ExportName(export.to_string())).await?;
            let mut b = vec![0u8; 10 + if no_zeroes { 0 } else { EXPORT_NAME_PADDING }];
            read_exact(r, &mut b)
                .await
                .map_err(|e| HandshakeError::Refused {
                    option: OPT_EXPORT_NAME,
                    reply: None,
                    message: format!("export '{export}' refused: {e}"),
                })?;
            let ((size, flags), _) =
                decode_export_name_reply(&b, no_zeroes).map_err(|e| protocol(e.to_string()))?;
            info.size = size;
            info.flags = flags;
            if let Some(name) = extra.first() {
                // Contexts need NBD_OPT_GO: the spec ties them to it.
                return Ok(Err(format!(
                    "the server does not support NBD_OPT_GO, which metadata context {name} needs"
                )));
            }
            context = None;
            true
        }
        Err((reply, message)) => {
            // A wrong name: say which the server has, as nbdinfo --list
            // would (the option phase goes on after an error reply). The
            // list replaces the server's own words, which say the same.
            if reply == REP_ERR_UNKNOWN {
                if let Ok(list) = list_exports(r, w).await {
                    let names: Vec<String> = list.into_iter().map(|(n, _)| n).collect();
                    // Listed yet refused (e.g. rawdisk's format rule): only
                    // the server's words say why.
                    if names.iter().any(|n| n == export) && !message.is_empty() {
                        return Err(HandshakeError::Refused {
                            option: OPT_GO,
                            reply: Some(reply),
                            message: format!("export '{export}' refused: {message}"),
                        });
                    }
                    let mut e = rep_error(OPT_GO, "export", export, reply, "");
                    if let HandshakeError::Refused { message, .. } = &mut e {
                        message.push_str(&offered(&names));
                    }
                    return Err(e);
                }
            }
            return Err(rep_error(OPT_GO, "export", export, reply, &message));
        }
    };
    if !got_export {
        return Err(protocol(
            "the server accepted the export without sending its size",
        ));
    }
    if info.flags & FLAG_HAS_FLAGS == 0 {
        info.flags = 0;
    }
    info.meta_context = context.as_ref().map(|c| c.1.clone());
    info.contexts = contexts.iter().map(|c| c.0.clone()).collect();
    info.listed_contexts = listed;
    Ok(Ok((info, context.map(|c| c.0), contexts)))
}

/// NBD_OPT_LIST_META_CONTEXT of `queries`: the names the server lists. An
/// error reply lists nothing (a server that knows none of them).
async fn list_contexts(
    r: &mut Reader,
    w: &mut Writer,
    export: &str,
    queries: &[String],
) -> HsResult<Vec<String>> {
    send_option(
        w,
        &ClientOption::ListMetaContext(MetaContextRequest {
            name: export.to_string(),
            queries: queries.to_vec(),
        }),
    )
    .await?;
    let mut names = Vec::new();
    loop {
        match option_reply(r, OPT_LIST_META_CONTEXT).await? {
            OptionReply::MetaContext { name, .. } => names.push(name),
            OptionReply::Ack => return Ok(names),
            OptionReply::Error { reply, message } => {
                tracing::debug!(reply = reply_type_name(reply), %message, "server refused LIST_META_CONTEXT");
                return Ok(Vec::new());
            }
            other => {
                return Err(protocol(format!(
                    "unexpected reply {other:?} to LIST_META_CONTEXT"
                )))
            }
        }
    }
}

/// Why a context the caller asked for is missing, with a hint for rawdisk's
/// own (a checkpoint context exists only with tracking and the checkpoint).
fn missing_context(name: &str) -> String {
    match name.strip_prefix("rawdisk:changed:") {
        Some(cp) => format!(
            "the server does not offer metadata context {name}: is it served with --track-changes and does checkpoint {cp} exist?"
        ),
        None => format!("the server does not offer metadata context {name}"),
    }
}

/// Reads the NBD_INFO replies to NBD_OPT_GO or NBD_OPT_INFO into `info` up
/// to the ACK: Ok(whether NBD_INFO_EXPORT came), or the server's error reply.
async fn info_replies(
    r: &mut Reader,
    opt: u32,
    info: &mut ExportInfo,
) -> HsResult<std::result::Result<bool, (u32, String)>> {
    let mut got_export = false;
    loop {
        match option_reply(r, opt).await? {
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
                        return Err(protocol(format!(
                            "invalid block sizes from the server: minimum {min}, preferred {preferred}, maximum payload {max}"
                        )));
                    }
                    info.min_block = min;
                    info.pref_block = preferred;
                    info.max_payload = max;
                    info.block_size_advertised = true;
                }
                // Spec: ignore information types we do not know.
                Info::Unknown { .. } => {}
            },
            OptionReply::Ack => return Ok(Ok(got_export)),
            OptionReply::Error { reply, message } => return Ok(Err((reply, message))),
            other => {
                return Err(protocol(format!(
                    "unexpected reply {other:?} to {}",
                    option_name(opt)
                )))
            }
        }
    }
}

/// NBD_OPT_LIST: each export's name and description (empty when the server
/// gives none), or why the server would not list them (spec: it may refuse,
/// by policy).
pub(super) async fn list_exports(
    r: &mut Reader,
    w: &mut Writer,
) -> HsResult<Vec<(String, String)>> {
    send_option(w, &ClientOption::List).await?;
    let mut exports = Vec::new();
    loop {
        match option_reply(r, OPT_LIST).await? {
            OptionReply::Server { name, description } => exports.push((name, description)),
            OptionReply::Ack => return Ok(exports),
            OptionReply::Error { reply, message } => {
                let why = match reply {
                    REP_ERR_UNSUP => "the server does not support listing exports".to_string(),
                    REP_ERR_TLS_REQD => {
                        "the server requires TLS: connect with an nbds:// or nbds+unix:// URI"
                            .to_string()
                    }
                    r => format!(
                        "the server refuses to list its exports ({})",
                        reply_type_name(r)
                    ),
                };
                return Err(HandshakeError::Refused {
                    option: OPT_LIST,
                    reply: Some(reply),
                    message: if message.is_empty() || reply == REP_ERR_TLS_REQD {
                        format!("NBD_OPT_LIST refused: {why}")
                    } else {
                        format!("NBD_OPT_LIST refused: {why}: {message}")
                    },
                });
            }
            other => {
                return Err(protocol(format!(
                    "unexpected reply {other:?} to NBD_OPT_LIST"
                )))
            }
        }
    }
}

/// NBD_OPT_INFO for one export: its size, flags, block sizes and description
/// as NBD_OPT_GO would give them, without entering transmission. Ok(None)
/// when the server refuses (an old server without NBD_OPT_INFO, an export it
/// lists but will not serve).
pub(super) async fn export_info(
    r: &mut Reader,
    w: &mut Writer,
    name: &str,
) -> HsResult<Option<ExportInfo>> {
    send_option(
        w,
        &ClientOption::Info(InfoRequest {
            name: name.to_string(),
            info: vec![INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION],
        }),
    )
    .await?;
    let mut info = ExportInfo::unnegotiated(name);
    match info_replies(r, OPT_INFO, &mut info).await? {
        Ok(true) => {
            if info.flags & FLAG_HAS_FLAGS == 0 {
                info.flags = 0;
            }
            Ok(Some(info))
        }
        Ok(false) => Err(protocol(format!(
            "the server described export '{name}' without its size"
        ))),
        Err((reply, message)) => {
            if reply == REP_ERR_TLS_REQD || reply == REP_ERR_SHUTDOWN {
                return Err(rep_error(OPT_INFO, "export", name, reply, &message));
            }
            tracing::debug!(export = name, reply = reply_type_name(reply), %message, "NBD_OPT_INFO refused");
            Ok(None)
        }
    }
}

/// NBD_OPT_ABORT, the polite end of a negotiation that does not go on to
/// transmission. The server's ACK (if any) is not waited for.
pub(super) async fn abort(w: &mut Writer) {
    let _ = send_option(w, &ClientOption::Abort).await;
    let _ = w.shutdown().await;
}

/// "; the server offers 'a', 'b'" (the default export shown as '').
fn offered(names: &[String]) -> String {
    const SHOWN: usize = 10;
    if names.is_empty() {
        return "; the server lists no exports".into();
    }
    let mut s = "; the server offers ".to_string();
    let quoted: Vec<String> = names.iter().take(SHOWN).map(|n| format!("'{n}'")).collect();
    s.push_str(&quoted.join(", "));
    if names.len() > SHOWN {
        s.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    s
}

/// The server refused `option` with `reply`.
fn rep_error(option: u32, what: &str, export: &str, reply: u32, message: &str) -> HandshakeError {
    HandshakeError::Refused {
        option,
        reply: Some(reply),
        message: rep_text(what, export, reply, message),
    }
}

fn rep_text(what: &str, export: &str, reply: u32, message: &str) -> String {
    // Said once: which option or export met the TLS requirement, and the
    // server's own "TLS is required", add nothing to it.
    if reply == REP_ERR_TLS_REQD {
        return TLS_REQUIRED.to_string();
    }
    let name = match reply {
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

const TLS_REQUIRED: &str = "the server requires TLS: connect with an nbds:// or nbds+unix:// URI";

/// Sends an option that needs no data and may be refused: true on ACK.
async fn optional(r: &mut Reader, w: &mut Writer, opt: ClientOption) -> HsResult<bool> {
    let code = opt.option();
    send_option(w, &opt).await?;
    match option_reply(r, code).await? {
        OptionReply::Ack => Ok(true),
        OptionReply::Error { reply, message }
            if reply == REP_ERR_SHUTDOWN || reply == REP_ERR_TLS_REQD =>
        {
            Err(rep_error(
                code,
                "option",
                option_name(code),
                reply,
                &message,
            ))
        }
        // An optional feature the server refuses is simply not available.
        OptionReply::Error { .. } => Ok(false),
        other => Err(protocol(format!(
            "unexpected reply {other:?} to {}",
            option_name(code)
        ))),
    }
}

async fn send_option(w: &mut Writer, opt: &ClientOption) -> HsResult<()> {
    let mut b = Vec::new();
    opt.encode(&mut b);
    w.write_all(&b).await.map_err(write_failed)?;
    w.flush().await.map_err(write_failed)
}

async fn option_reply(r: &mut Reader, opt: u32) -> HsResult<OptionReply> {
    let mut b = [0u8; OPTION_REPLY_HEADER_LEN];
    read_exact(r, &mut b).await?;
    let (h, _) =
        decode_option_reply_header(&b).map_err(|e| protocol(format!("bad option reply: {e}")))?;
    if h.option != opt {
        return Err(protocol(format!(
            "reply to option {} while waiting for {}",
            option_name(h.option),
            option_name(opt)
        )));
    }
    if h.len > 16 << 20 {
        return Err(protocol(format!("option reply of {} bytes", h.len)));
    }
    let mut data = vec![0u8; h.len as usize];
    read_exact(r, &mut data).await?;
    OptionReply::parse(h.reply, &data).map_err(|e| protocol(format!("bad option reply: {e}")))
}
