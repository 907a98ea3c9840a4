//! The client's errors: what failed (connect, handshake, a request) and,
//! for a handshake, why as a value ([`HandshakeError`]).

use crate::proto::*;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Could not reach the server.
    #[error("cannot connect to {target}: {message}")]
    Connect { target: String, message: String },
    /// The handshake failed: why, as a value ([`HandshakeError`]).
    #[error("NBD handshake with {target}: {cause}")]
    Handshake {
        target: String,
        cause: HandshakeError,
    },
    /// The server does not offer a metadata context the caller asked for
    /// ([`ConnectOptions::extra_contexts`]): asking again will not help.
    #[error("NBD handshake with {target}: {message}")]
    NoContext { target: String, message: String },
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

    /// The connection broke: under a request, or in the handshake (the
    /// server died or was restarted). Reconnecting may help.
    pub fn is_dropped(&self) -> bool {
        matches!(
            self,
            Error::Connection { .. }
                | Error::Handshake {
                    cause: HandshakeError::Dropped { .. },
                    ..
                }
        )
    }

    /// The server answered NBD_ESHUTDOWN: it is going down (a restart)
    /// and did not run the request. Reconnecting may help.
    pub fn is_shutdown(&self) -> bool {
        matches!(
            self,
            Error::Server {
                errno: NBD_ESHUTDOWN,
                ..
            }
        )
    }

    /// The server's NBD_REP_ERR_* when it refused the handshake with one.
    pub fn refusal(&self) -> Option<u32> {
        match self {
            Error::Handshake {
                cause: HandshakeError::Refused { reply, .. },
                ..
            } => *reply,
            _ => None,
        }
    }

    /// A refusal that says "not now" rather than "no": a connection cap
    /// (rawdisk's `--max-connections`, nbdkit's limit filter) answers
    /// NBD_REP_ERR_POLICY, a server on its way down NBD_REP_ERR_SHUTDOWN.
    pub fn is_busy(&self) -> bool {
        matches!(self.refusal(), Some(REP_ERR_POLICY | REP_ERR_SHUTDOWN))
    }
}

/// Why a handshake failed. The text is the one-line message shown after
/// "NBD handshake with TARGET: "; callers match on the variant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The connection broke (`kind` UnexpectedEof: the server closed it).
    #[error("{message}")]
    Dropped {
        kind: std::io::ErrorKind,
        message: String,
    },
    /// The server refused `option` with `reply` (NBD_REP_ERR_*); None when
    /// it refused by hanging up (NBD_OPT_EXPORT_NAME has no error reply).
    #[error("{message}")]
    Refused {
        option: u32,
        reply: Option<u32>,
        message: String,
    },
    /// The TLS handshake failed, or the server refused this client's
    /// credentials right after it.
    #[error("{0}")]
    Tls(String),
    /// The server broke the protocol, or is not a server this client can use.
    #[error("{0}")]
    Protocol(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// "EIO (input/output error)" for the values the spec names, else the number.
fn errno_name(e: u32) -> String {
    match error_description(e) {
        Some(what) => format!("{} ({what})", error_name(e).trim_start_matches("NBD_")),
        None => e.to_string(),
    }
}
