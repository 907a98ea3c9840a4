//! The NBD wire codec: constants, and encode/decode functions for every
//! message of the fixed newstyle handshake and of the transmission phase, in
//! both directions (server and client use the same code).
//!
//! Pure: no I/O, no clocks, no global state. Decoders take a byte slice and
//! return the value and the number of bytes consumed, or
//! [`DecodeError::NeedMore`] when the slice is a prefix of a valid message, or
//! [`DecodeError::Invalid`] / [`DecodeError::TooLarge`] when it can never
//! become one. They never panic and never allocate more than the slice (or
//! the cap the caller passes) justifies, so they can face hostile peers and
//! fuzzers.
//!
//! Encoders append to a caller-owned `Vec<u8>` so hot paths can reuse one
//! buffer per connection.
//!
//! One file for the whole wire format, every message in both directions, so
//! it can be read against the spec section by section; its tests are in
//! `tests.rs` beside it.
//!
//! All numbers are big-endian (spec: "Conventions"). Extended headers follow
//! the `extension-ext-header` branch of the spec, which is what qemu 8.2+ and
//! libnbd 1.18+ speak.

use std::fmt;

// ---------------------------------------------------------------------------
// Magics
// ---------------------------------------------------------------------------

/// "NBDMAGIC": first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle magic, sent by the server in the greeting and by the
/// client before every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every fixed newstyle option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

// ---------------------------------------------------------------------------
// Handshake flags (16 bits, server) and client flags (32 bits)
// ---------------------------------------------------------------------------

pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;

pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---------------------------------------------------------------------------
// Transmission flags (16 bits)
// ---------------------------------------------------------------------------

pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_SEND_DF: u16 = 1 << 7;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const FLAG_SEND_RESIZE: u16 = 1 << 9;
pub const FLAG_SEND_CACHE: u16 = 1 << 10;
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;
pub const FLAG_BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;

/// Every transmission flag with the name nbdinfo prints for it.
const TRANSMISSION_FLAGS: [(u16, &str); 13] = [
    (FLAG_HAS_FLAGS, "has_flags"),
    (FLAG_READ_ONLY, "read_only"),
    (FLAG_SEND_FLUSH, "send_flush"),
    (FLAG_SEND_FUA, "send_fua"),
    (FLAG_ROTATIONAL, "rotational"),
    (FLAG_SEND_TRIM, "send_trim"),
    (FLAG_SEND_WRITE_ZEROES, "send_write_zeroes"),
    (FLAG_SEND_DF, "send_df"),
    (FLAG_CAN_MULTI_CONN, "can_multi_conn"),
    (FLAG_SEND_RESIZE, "send_resize"),
    (FLAG_SEND_CACHE, "send_cache"),
    (FLAG_SEND_FAST_ZERO, "send_fast_zero"),
    (FLAG_BLOCK_STATUS_PAYLOAD, "block_status_payload"),
];

/// The names of the transmission flags set in `flags`, lowest bit first.
pub fn transmission_flag_names(flags: u16) -> impl Iterator<Item = &'static str> {
    TRANSMISSION_FLAGS
        .iter()
        .filter(move |(bit, _)| flags & bit != 0)
        .map(|(_, name)| *name)
}

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_PEEK_EXPORT: u32 = 4;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

/// A printable name for an option number, for logs.
pub fn option_name(opt: u32) -> &'static str {
    match opt {
        OPT_EXPORT_NAME => "NBD_OPT_EXPORT_NAME",
        OPT_ABORT => "NBD_OPT_ABORT",
        OPT_LIST => "NBD_OPT_LIST",
        OPT_PEEK_EXPORT => "NBD_OPT_PEEK_EXPORT",
        OPT_STARTTLS => "NBD_OPT_STARTTLS",
        OPT_INFO => "NBD_OPT_INFO",
        OPT_GO => "NBD_OPT_GO",
        OPT_STRUCTURED_REPLY => "NBD_OPT_STRUCTURED_REPLY",
        OPT_LIST_META_CONTEXT => "NBD_OPT_LIST_META_CONTEXT",
        OPT_SET_META_CONTEXT => "NBD_OPT_SET_META_CONTEXT",
        OPT_EXTENDED_HEADERS => "NBD_OPT_EXTENDED_HEADERS",
        _ => "unknown option",
    }
}

// ---------------------------------------------------------------------------
// Option reply types
// ---------------------------------------------------------------------------

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
/// Bit 31 marks every error reply.
pub const REP_FLAG_ERROR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
pub const REP_ERR_PLATFORM: u32 = REP_FLAG_ERROR | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_FLAG_ERROR | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;
pub const REP_ERR_EXT_HEADER_REQD: u32 = REP_FLAG_ERROR | 10;

/// A printable name for an option reply type, for logs and error messages.
pub fn reply_type_name(rep: u32) -> &'static str {
    match rep {
        REP_ACK => "NBD_REP_ACK",
        REP_SERVER => "NBD_REP_SERVER",
        REP_INFO => "NBD_REP_INFO",
        REP_META_CONTEXT => "NBD_REP_META_CONTEXT",
        REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP",
        REP_ERR_POLICY => "NBD_REP_ERR_POLICY",
        REP_ERR_INVALID => "NBD_REP_ERR_INVALID",
        REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM",
        REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD",
        REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN",
        REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN",
        REP_ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD",
        REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG",
        REP_ERR_EXT_HEADER_REQD => "NBD_REP_ERR_EXT_HEADER_REQD",
        r if r & REP_FLAG_ERROR != 0 => "unknown error reply",
        _ => "unknown reply",
    }
}

// ---------------------------------------------------------------------------
// NBD_INFO types
// ---------------------------------------------------------------------------

pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------
// Commands and command flags
// ---------------------------------------------------------------------------

/// Declares [`Command`] and its lookups from one table, so a number or a
/// name cannot be added in one place and forgotten in another.
macro_rules! commands {
    ($($variant:ident = $num:literal, $name:literal, $verb:literal;)*) => {
        /// A transmission command (spec: "Request types"). Numbers the codec
        /// does not know stay representable, so a server can refuse them.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Command {
            $($variant,)*
            /// Any other number. [`Command::from_wire`] never puts a known
            /// command's number here.
            Unknown(u16),
        }

        impl Command {
            /// The command a request header's type field names.
            pub const fn from_wire(n: u16) -> Command {
                match n {
                    $($num => Command::$variant,)*
                    n => Command::Unknown(n),
                }
            }

            /// The number on the wire.
            pub const fn wire(self) -> u16 {
                match self {
                    $(Command::$variant => $num,)*
                    Command::Unknown(n) => n,
                }
            }

            /// The spec's name (`NBD_CMD_READ`), for logs.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Command::$variant => $name,)*
                    Command::Unknown(_) => "unknown command",
                }
            }

            /// A short word for messages to users (`read`, `block status`).
            pub const fn verb(self) -> &'static str {
                match self {
                    $(Command::$variant => $verb,)*
                    Command::Unknown(_) => "request",
                }
            }
        }
    };
}

commands! {
    Read = 0, "NBD_CMD_READ", "read";
    Write = 1, "NBD_CMD_WRITE", "write";
    Disc = 2, "NBD_CMD_DISC", "disconnect";
    Flush = 3, "NBD_CMD_FLUSH", "flush";
    Trim = 4, "NBD_CMD_TRIM", "trim";
    Cache = 5, "NBD_CMD_CACHE", "cache";
    WriteZeroes = 6, "NBD_CMD_WRITE_ZEROES", "zero";
    BlockStatus = 7, "NBD_CMD_BLOCK_STATUS", "block status";
    Resize = 8, "NBD_CMD_RESIZE", "resize";
}

impl Command {
    /// Whether NBD_REPLY_TYPE_ERROR_OFFSET is a valid reply to it (the
    /// spec's list); every other command's error is NBD_REPLY_TYPE_ERROR.
    pub const fn allows_error_offset(self) -> bool {
        matches!(
            self,
            Command::Read
                | Command::Write
                | Command::Trim
                | Command::Cache
                | Command::WriteZeroes
                | Command::BlockStatus
        )
    }
}

/// What an all-zero request header carries (NBD_CMD_READ).
impl Default for Command {
    fn default() -> Command {
        Command::from_wire(0)
    }
}

pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
pub const CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

// ---------------------------------------------------------------------------
// Structured / extended reply flags and chunk types
// ---------------------------------------------------------------------------

pub const REPLY_FLAG_DONE: u16 = 1 << 0;

pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
/// Bit 15 marks every error chunk type.
pub const REPLY_TYPE_FLAG_ERROR: u16 = 1 << 15;
pub const REPLY_TYPE_ERROR: u16 = REPLY_TYPE_FLAG_ERROR | 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = REPLY_TYPE_FLAG_ERROR | 2;

// ---------------------------------------------------------------------------
// base:allocation
// ---------------------------------------------------------------------------

pub const META_CONTEXT_BASE_ALLOCATION: &str = "base:allocation";
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

// ---------------------------------------------------------------------------
// Error values
// ---------------------------------------------------------------------------

pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

/// Maps a host errno to the NBD error the spec ("Error values") allows on the
/// wire: EDQUOT and EFBIG are out-of-space conditions for the client, EROFS
/// is a permission problem, and anything without an NBD counterpart is EIO.
pub fn errno_to_nbd(errno: i32) -> u32 {
    match errno {
        libc::EPERM | libc::EROFS | libc::EACCES => NBD_EPERM,
        libc::EIO => NBD_EIO,
        libc::ENOMEM => NBD_ENOMEM,
        libc::EINVAL => NBD_EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => NBD_ENOSPC,
        libc::EOVERFLOW => NBD_EOVERFLOW,
        // EOPNOTSUPP == ENOTSUP on Linux.
        libc::ENOTSUP => NBD_ENOTSUP,
        libc::ESHUTDOWN => NBD_ESHUTDOWN,
        _ => NBD_EIO,
    }
}

/// Every error value the spec names ("Error values"), in the spec's order.
pub const ERROR_VALUES: [u32; ERRORS.len()] = {
    let mut v = [0; ERRORS.len()];
    let mut i = 0;
    while i < ERRORS.len() {
        v[i] = ERRORS[i].0;
        i += 1;
    }
    v
};

/// The error values the spec names ("Error values"): number, name, the host
/// errno a client reports, and what it means.
const ERRORS: [(u32, &str, i32, &str); 8] = [
    (
        NBD_EPERM,
        "NBD_EPERM",
        libc::EPERM,
        "operation not permitted",
    ),
    (NBD_EIO, "NBD_EIO", libc::EIO, "input/output error"),
    (
        NBD_ENOMEM,
        "NBD_ENOMEM",
        libc::ENOMEM,
        "cannot allocate memory",
    ),
    (NBD_EINVAL, "NBD_EINVAL", libc::EINVAL, "invalid argument"),
    (
        NBD_ENOSPC,
        "NBD_ENOSPC",
        libc::ENOSPC,
        "no space left on device",
    ),
    (
        NBD_EOVERFLOW,
        "NBD_EOVERFLOW",
        libc::EOVERFLOW,
        "value too large",
    ),
    (
        NBD_ENOTSUP,
        "NBD_ENOTSUP",
        libc::ENOTSUP,
        "operation not supported",
    ),
    (
        NBD_ESHUTDOWN,
        "NBD_ESHUTDOWN",
        libc::ESHUTDOWN,
        "server is shutting down",
    ),
];

fn known_error(err: u32) -> Option<&'static (u32, &'static str, i32, &'static str)> {
    ERRORS.iter().find(|e| e.0 == err)
}

/// Maps an NBD error from the wire to a host errno. Unknown values are
/// treated as EINVAL, as the spec tells clients to.
pub fn nbd_to_errno(err: u32) -> i32 {
    known_error(err).map_or(libc::EINVAL, |e| e.2)
}

/// A printable name for an NBD error value.
pub fn error_name(err: u32) -> &'static str {
    match known_error(err) {
        Some(e) => e.1,
        None if err == 0 => "success",
        None => "unknown NBD error",
    }
}

/// What an NBD error value means, for messages to users; None for values
/// the spec does not name.
pub fn error_description(err: u32) -> Option<&'static str> {
    known_error(err).map(|e| e.3)
}

// ---------------------------------------------------------------------------
// Sizes
// ---------------------------------------------------------------------------

/// Strings (export names, messages, context names): spec "Conventions".
pub const MAX_STRING: usize = 4096;
pub const GREETING_LEN: usize = 18;
pub const OPTION_HEADER_LEN: usize = 16;
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
pub const COMPACT_REQUEST_LEN: usize = 28;
pub const EXTENDED_REQUEST_LEN: usize = 32;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const STRUCTURED_REPLY_HEADER_LEN: usize = 20;
pub const EXTENDED_REPLY_HEADER_LEN: usize = 32;
/// The zero padding after an NBD_OPT_EXPORT_NAME reply without NO_ZEROES.
pub const EXPORT_NAME_PADDING: usize = 124;

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// Why a decoder could not produce a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// The input is a valid prefix; at least this many more bytes are needed.
    NeedMore(usize),
    /// The input can never become a valid message.
    Invalid(&'static str),
    /// A length field exceeds the cap the caller allows.
    TooLarge {
        what: &'static str,
        len: u64,
        cap: u64,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::NeedMore(n) => write!(f, "need {n} more bytes"),
            DecodeError::Invalid(why) => write!(f, "invalid message: {why}"),
            DecodeError::TooLarge { what, len, cap } => {
                write!(f, "{what} of {len} bytes exceeds the limit of {cap}")
            }
        }
    }
}

impl std::error::Error for DecodeError {}

/// A decoded value and the number of input bytes it used.
pub type Decoded<T> = Result<(T, usize), DecodeError>;

/// Big-endian reader over a slice. Running out of input yields `short`:
/// NeedMore for headers read from a stream, Invalid for payloads whose length
/// is already known.
struct Rd<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Total length of the message, when known, for NeedMore.
    need_total: Option<usize>,
}

impl<'a> Rd<'a> {
    /// For a message whose full length is known to be `total`.
    fn header(buf: &'a [u8], total: usize) -> Result<Self, DecodeError> {
        if buf.len() < total {
            return Err(DecodeError::NeedMore(total - buf.len()));
        }
        Ok(Rd {
            buf,
            pos: 0,
            need_total: Some(total),
        })
    }

    /// For a payload whose bytes are all present.
    fn payload(buf: &'a [u8]) -> Self {
        Rd {
            buf,
            pos: 0,
            need_total: None,
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.remaining() < n {
            return Err(match self.need_total {
                Some(_) => DecodeError::NeedMore(n - self.remaining()),
                None => DecodeError::Invalid("truncated payload"),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }

    /// A length-prefixed (32-bit) string within a payload.
    fn string32(&mut self) -> Result<String, DecodeError> {
        let len = self.u32()? as usize;
        if len > self.remaining() {
            return Err(DecodeError::Invalid("string length exceeds the payload"));
        }
        let b = self.take(len)?;
        check_string(b)
    }

    fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }

    fn end(&self) -> Result<(), DecodeError> {
        if self.remaining() != 0 {
            return Err(DecodeError::Invalid("trailing bytes in payload"));
        }
        Ok(())
    }
}

/// Validates a protocol string: UTF-8, no NUL, at most 4096 bytes.
fn check_string(b: &[u8]) -> Result<String, DecodeError> {
    if b.len() > MAX_STRING {
        return Err(DecodeError::Invalid("string longer than 4096 bytes"));
    }
    if b.contains(&0) {
        return Err(DecodeError::Invalid("string contains NUL"));
    }
    match std::str::from_utf8(b) {
        Ok(s) => Ok(s.to_owned()),
        Err(_) => Err(DecodeError::Invalid("string is not UTF-8")),
    }
}

/// Lossy string for human-readable text (descriptions, error messages) where
/// a broken peer should not make the message undecodable.
fn lossy_string(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_be_bytes());
}
fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_be_bytes());
}
fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_be_bytes());
}
/// Truncates to the protocol's string limit at a character boundary, so
/// encoders never emit a string a strict peer must reject.
fn clip(s: &str) -> &str {
    if s.len() <= MAX_STRING {
        return s;
    }
    let mut end = MAX_STRING;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
fn put_string32(out: &mut Vec<u8>, s: &str) {
    let s = clip(s);
    put_u32(out, s.len() as u32);
    out.extend_from_slice(s.as_bytes());
}

// ---------------------------------------------------------------------------
// Greeting and client flags
// ---------------------------------------------------------------------------

/// S: NBDMAGIC, IHAVEOPT, 16-bit handshake flags.
pub fn encode_greeting(out: &mut Vec<u8>, handshake_flags: u16) {
    put_u64(out, NBDMAGIC);
    put_u64(out, IHAVEOPT);
    put_u16(out, handshake_flags);
}

/// Decodes the newstyle greeting; returns the handshake flags. Oldstyle
/// servers (second magic `cliserv_magic`) are rejected.
pub fn decode_greeting(buf: &[u8]) -> Decoded<u16> {
    let mut r = Rd::header(buf, GREETING_LEN)?;
    if r.u64()? != NBDMAGIC {
        return Err(DecodeError::Invalid("bad NBDMAGIC"));
    }
    if r.u64()? != IHAVEOPT {
        return Err(DecodeError::Invalid("not a newstyle server"));
    }
    Ok((r.u16()?, GREETING_LEN))
}

pub fn encode_client_flags(out: &mut Vec<u8>, flags: u32) {
    put_u32(out, flags);
}

pub fn decode_client_flags(buf: &[u8]) -> Decoded<u32> {
    let mut r = Rd::header(buf, 4)?;
    Ok((r.u32()?, 4))
}

// ---------------------------------------------------------------------------
// Option requests (client -> server)
// ---------------------------------------------------------------------------

/// C: IHAVEOPT, 32-bit option, 32-bit data length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

impl OptionHeader {
    pub fn encode(&self, out: &mut Vec<u8>) {
        put_u64(out, IHAVEOPT);
        put_u32(out, self.option);
        put_u32(out, self.len);
    }
}

/// Decodes an option header only (16 bytes), so a server can decide what to
/// do with an oversized length before reading the data.
pub fn decode_option_header(buf: &[u8]) -> Decoded<OptionHeader> {
    let mut r = Rd::header(buf, OPTION_HEADER_LEN)?;
    if r.u64()? != IHAVEOPT {
        return Err(DecodeError::Invalid("option without IHAVEOPT magic"));
    }
    let option = r.u32()?;
    let len = r.u32()?;
    Ok((OptionHeader { option, len }, OPTION_HEADER_LEN))
}

/// Decodes a whole option (header and data) and parses it. Data longer than
/// `cap` is TooLarge before anything is buffered.
pub fn decode_option(buf: &[u8], cap: u32) -> Decoded<ClientOption> {
    let (h, n) = decode_option_header(buf)?;
    if h.len > cap {
        return Err(DecodeError::TooLarge {
            what: "option data",
            len: h.len as u64,
            cap: cap as u64,
        });
    }
    let total = n + h.len as usize;
    if buf.len() < total {
        return Err(DecodeError::NeedMore(total - buf.len()));
    }
    let opt = ClientOption::parse(h.option, &buf[n..total])?;
    Ok((opt, total))
}

/// The data of NBD_OPT_INFO and NBD_OPT_GO.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InfoRequest {
    pub name: String,
    pub info: Vec<u16>,
}

/// The data of NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MetaContextRequest {
    pub name: String,
    pub queries: Vec<String>,
}

/// An option request, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOption {
    ExportName(String),
    /// Any data sent with ABORT is ignored (spec: server SHOULD ignore it).
    Abort,
    List,
    StartTls,
    Info(InfoRequest),
    Go(InfoRequest),
    StructuredReply,
    ListMetaContext(MetaContextRequest),
    SetMetaContext(MetaContextRequest),
    ExtendedHeaders,
    /// An option this codec does not know; the data is kept for encoding.
    Unknown {
        option: u32,
        data: Vec<u8>,
    },
}

impl ClientOption {
    pub fn option(&self) -> u32 {
        match self {
            ClientOption::ExportName(_) => OPT_EXPORT_NAME,
            ClientOption::Abort => OPT_ABORT,
            ClientOption::List => OPT_LIST,
            ClientOption::StartTls => OPT_STARTTLS,
            ClientOption::Info(_) => OPT_INFO,
            ClientOption::Go(_) => OPT_GO,
            ClientOption::StructuredReply => OPT_STRUCTURED_REPLY,
            ClientOption::ListMetaContext(_) => OPT_LIST_META_CONTEXT,
            ClientOption::SetMetaContext(_) => OPT_SET_META_CONTEXT,
            ClientOption::ExtendedHeaders => OPT_EXTENDED_HEADERS,
            ClientOption::Unknown { option, .. } => *option,
        }
    }

    /// Parses the data of option `option`. Errors mean the request is
    /// syntactically invalid (the server answers NBD_REP_ERR_INVALID).
    pub fn parse(option: u32, data: &[u8]) -> Result<ClientOption, DecodeError> {
        let no_data = |o: ClientOption| {
            if data.is_empty() {
                Ok(o)
            } else {
                Err(DecodeError::Invalid("option must not carry data"))
            }
        };
        match option {
            OPT_EXPORT_NAME => Ok(ClientOption::ExportName(check_string(data)?)),
            OPT_ABORT => Ok(ClientOption::Abort),
            OPT_LIST => no_data(ClientOption::List),
            OPT_STARTTLS => no_data(ClientOption::StartTls),
            OPT_STRUCTURED_REPLY => no_data(ClientOption::StructuredReply),
            OPT_EXTENDED_HEADERS => no_data(ClientOption::ExtendedHeaders),
            OPT_INFO | OPT_GO => {
                let mut r = Rd::payload(data);
                let name = r.string32()?;
                let n = r.u16()? as usize;
                if r.remaining() != n * 2 {
                    return Err(DecodeError::Invalid(
                        "information request count does not match the length",
                    ));
                }
                let mut info = Vec::with_capacity(n);
                for _ in 0..n {
                    info.push(r.u16()?);
                }
                let req = InfoRequest { name, info };
                Ok(if option == OPT_INFO {
                    ClientOption::Info(req)
                } else {
                    ClientOption::Go(req)
                })
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let mut r = Rd::payload(data);
                let name = r.string32()?;
                let n = r.u32()? as usize;
                // Each query takes at least its 4-byte length: a count the
                // data cannot hold is invalid, and never drives allocation.
                if n > r.remaining() / 4 {
                    return Err(DecodeError::Invalid(
                        "query count exceeds the option length",
                    ));
                }
                let mut queries = Vec::with_capacity(n);
                for _ in 0..n {
                    queries.push(r.string32()?);
                }
                r.end()?;
                let req = MetaContextRequest { name, queries };
                Ok(if option == OPT_LIST_META_CONTEXT {
                    ClientOption::ListMetaContext(req)
                } else {
                    ClientOption::SetMetaContext(req)
                })
            }
            _ => Ok(ClientOption::Unknown {
                option,
                data: data.to_vec(),
            }),
        }
    }

    /// Appends the whole option (header and data).
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        OptionHeader {
            option: self.option(),
            len: 0,
        }
        .encode(out);
        let data_start = out.len();
        match self {
            ClientOption::ExportName(name) => out.extend_from_slice(clip(name).as_bytes()),
            ClientOption::Abort
            | ClientOption::List
            | ClientOption::StartTls
            | ClientOption::StructuredReply
            | ClientOption::ExtendedHeaders => {}
            ClientOption::Info(req) | ClientOption::Go(req) => {
                put_string32(out, &req.name);
                put_u16(out, req.info.len() as u16);
                for i in &req.info {
                    put_u16(out, *i);
                }
            }
            ClientOption::ListMetaContext(req) | ClientOption::SetMetaContext(req) => {
                put_string32(out, &req.name);
                put_u32(out, req.queries.len() as u32);
                for q in &req.queries {
                    put_string32(out, q);
                }
            }
            ClientOption::Unknown { data, .. } => out.extend_from_slice(data),
        }
        let len = (out.len() - data_start) as u32;
        out[start + 12..start + 16].copy_from_slice(&len.to_be_bytes());
    }
}

// ---------------------------------------------------------------------------
// Option replies (server -> client)
// ---------------------------------------------------------------------------

/// S: magic, option, reply type, length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply: u32,
    pub len: u32,
}

impl OptionReplyHeader {
    pub fn encode(&self, out: &mut Vec<u8>) {
        put_u64(out, OPTION_REPLY_MAGIC);
        put_u32(out, self.option);
        put_u32(out, self.reply);
        put_u32(out, self.len);
    }
}

pub fn decode_option_reply_header(buf: &[u8]) -> Decoded<OptionReplyHeader> {
    let mut r = Rd::header(buf, OPTION_REPLY_HEADER_LEN)?;
    if r.u64()? != OPTION_REPLY_MAGIC {
        return Err(DecodeError::Invalid("bad option reply magic"));
    }
    let option = r.u32()?;
    let reply = r.u32()?;
    let len = r.u32()?;
    Ok((
        OptionReplyHeader { option, reply, len },
        OPTION_REPLY_HEADER_LEN,
    ))
}

/// The payload of an NBD_REP_INFO reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Info {
    Export {
        size: u64,
        flags: u16,
    },
    Name(String),
    Description(String),
    BlockSize {
        min: u32,
        preferred: u32,
        max: u32,
    },
    /// Clients must ignore information types they do not know.
    Unknown {
        info: u16,
        data: Vec<u8>,
    },
}

impl Info {
    fn encode_data(&self, out: &mut Vec<u8>) {
        match self {
            Info::Export { size, flags } => {
                put_u16(out, INFO_EXPORT);
                put_u64(out, *size);
                put_u16(out, *flags);
            }
            Info::Name(s) => {
                put_u16(out, INFO_NAME);
                out.extend_from_slice(clip(s).as_bytes());
            }
            Info::Description(s) => {
                put_u16(out, INFO_DESCRIPTION);
                out.extend_from_slice(clip(s).as_bytes());
            }
            Info::BlockSize {
                min,
                preferred,
                max,
            } => {
                put_u16(out, INFO_BLOCK_SIZE);
                put_u32(out, *min);
                put_u32(out, *preferred);
                put_u32(out, *max);
            }
            Info::Unknown { info, data } => {
                put_u16(out, *info);
                out.extend_from_slice(data);
            }
        }
    }

    fn parse(data: &[u8]) -> Result<Info, DecodeError> {
        let mut r = Rd::payload(data);
        let info = r.u16()?;
        let v = match info {
            INFO_EXPORT => {
                let size = r.u64()?;
                let flags = r.u16()?;
                r.end()?;
                Info::Export { size, flags }
            }
            INFO_NAME => Info::Name(check_string(r.rest())?),
            INFO_DESCRIPTION => Info::Description(lossy_string(r.rest())),
            INFO_BLOCK_SIZE => {
                let min = r.u32()?;
                let preferred = r.u32()?;
                let max = r.u32()?;
                r.end()?;
                Info::BlockSize {
                    min,
                    preferred,
                    max,
                }
            }
            _ => Info::Unknown {
                info,
                data: r.rest().to_vec(),
            },
        };
        Ok(v)
    }
}

/// An option reply, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionReply {
    Ack,
    /// NBD_REP_SERVER: export name and optional description.
    Server {
        name: String,
        description: String,
    },
    Info(Info),
    MetaContext {
        id: u32,
        name: String,
    },
    /// Any reply type with bit 31 set; `message` may be empty.
    Error {
        reply: u32,
        message: String,
    },
    /// A non-error reply type this codec does not know.
    Unknown {
        reply: u32,
        data: Vec<u8>,
    },
}

impl OptionReply {
    pub fn reply_type(&self) -> u32 {
        match self {
            OptionReply::Ack => REP_ACK,
            OptionReply::Server { .. } => REP_SERVER,
            OptionReply::Info(_) => REP_INFO,
            OptionReply::MetaContext { .. } => REP_META_CONTEXT,
            OptionReply::Error { reply, .. } => *reply,
            OptionReply::Unknown { reply, .. } => *reply,
        }
    }

    /// Appends header and data of a reply to `option`.
    pub fn encode(&self, option: u32, out: &mut Vec<u8>) {
        let start = out.len();
        OptionReplyHeader {
            option,
            reply: self.reply_type(),
            len: 0,
        }
        .encode(out);
        let data_start = out.len();
        match self {
            OptionReply::Ack => {}
            OptionReply::Server { name, description } => {
                put_string32(out, name);
                out.extend_from_slice(clip(description).as_bytes());
            }
            OptionReply::Info(info) => info.encode_data(out),
            OptionReply::MetaContext { id, name } => {
                put_u32(out, *id);
                out.extend_from_slice(clip(name).as_bytes());
            }
            OptionReply::Error { message, .. } => out.extend_from_slice(clip(message).as_bytes()),
            OptionReply::Unknown { data, .. } => out.extend_from_slice(data),
        }
        let len = (out.len() - data_start) as u32;
        out[start + 16..start + 20].copy_from_slice(&len.to_be_bytes());
    }

    /// Parses the data of a reply of type `reply`.
    pub fn parse(reply: u32, data: &[u8]) -> Result<OptionReply, DecodeError> {
        let mut r = Rd::payload(data);
        match reply {
            REP_ACK => {
                r.end()?;
                Ok(OptionReply::Ack)
            }
            REP_SERVER => {
                let name = r.string32()?;
                let description = lossy_string(r.rest());
                Ok(OptionReply::Server { name, description })
            }
            REP_INFO => Ok(OptionReply::Info(Info::parse(data)?)),
            REP_META_CONTEXT => {
                let id = r.u32()?;
                let name = check_string(r.rest())?;
                Ok(OptionReply::MetaContext { id, name })
            }
            e if e & REP_FLAG_ERROR != 0 => Ok(OptionReply::Error {
                reply: e,
                // Invalid UTF-8 grows in the lossy decode (U+FFFD is 3 bytes):
                // clip again so what decodes is what `encode` sends back.
                message: clip(&lossy_string(&data[..data.len().min(MAX_STRING)])).to_owned(),
            }),
            _ => Ok(OptionReply::Unknown {
                reply,
                data: data.to_vec(),
            }),
        }
    }
}

/// Decodes a whole option reply (header and data, at most `cap` data bytes).
/// Returns the option it answers and the parsed reply.
pub fn decode_option_reply(buf: &[u8], cap: u32) -> Decoded<(u32, OptionReply)> {
    let (h, n) = decode_option_reply_header(buf)?;
    if h.len > cap {
        return Err(DecodeError::TooLarge {
            what: "option reply data",
            len: h.len as u64,
            cap: cap as u64,
        });
    }
    let total = n + h.len as usize;
    if buf.len() < total {
        return Err(DecodeError::NeedMore(total - buf.len()));
    }
    let rep = OptionReply::parse(h.reply, &buf[n..total])?;
    Ok(((h.option, rep), total))
}

/// The server's answer to NBD_OPT_EXPORT_NAME: size, flags, and 124 zero
/// bytes unless both sides agreed on NO_ZEROES.
pub fn encode_export_name_reply(out: &mut Vec<u8>, size: u64, flags: u16, no_zeroes: bool) {
    put_u64(out, size);
    put_u16(out, flags);
    if !no_zeroes {
        out.extend_from_slice(&[0u8; EXPORT_NAME_PADDING]);
    }
}

/// Decodes the NBD_OPT_EXPORT_NAME answer into (size, transmission flags).
pub fn decode_export_name_reply(buf: &[u8], no_zeroes: bool) -> Decoded<(u64, u16)> {
    let total = 10 + if no_zeroes { 0 } else { EXPORT_NAME_PADDING };
    let mut r = Rd::header(buf, total)?;
    let size = r.u64()?;
    let flags = r.u16()?;
    Ok(((size, flags), total))
}

// ---------------------------------------------------------------------------
// Transmission: requests
// ---------------------------------------------------------------------------

/// A transmission request header. `length` is 32 bits on the wire unless
/// extended headers were negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Request {
    pub flags: u16,
    pub command: Command,
    pub cookie: u64,
    pub offset: u64,
    pub length: u64,
}

impl Request {
    /// Appends the header: 32-byte extended form when `extended`, else the
    /// 28-byte compact form (`length` must then fit in 32 bits; it is
    /// saturated otherwise, which a caller must have prevented).
    pub fn encode(&self, out: &mut Vec<u8>, extended: bool) {
        if extended {
            put_u32(out, EXTENDED_REQUEST_MAGIC);
            put_u16(out, self.flags);
            put_u16(out, self.command.wire());
            put_u64(out, self.cookie);
            put_u64(out, self.offset);
            put_u64(out, self.length);
        } else {
            debug_assert!(self.length <= u32::MAX as u64);
            put_u32(out, REQUEST_MAGIC);
            put_u16(out, self.flags);
            put_u16(out, self.command.wire());
            put_u64(out, self.cookie);
            put_u64(out, self.offset);
            put_u32(out, self.length.min(u32::MAX as u64) as u32);
        }
    }

    /// Number of payload bytes that follow this header on the wire. Compact
    /// headers: only NBD_CMD_WRITE carries one. Extended headers: whatever
    /// sets NBD_CMD_FLAG_PAYLOAD_LEN, and NBD_CMD_WRITE always: the spec says
    /// a write MUST set the flag, but qemu 10's client sends extended writes
    /// without it, and its length can only be the payload's.
    pub fn payload_len(&self, extended: bool) -> u64 {
        if self.command == Command::Write || (extended && self.flags & CMD_FLAG_PAYLOAD_LEN != 0) {
            self.length
        } else {
            0
        }
    }
}

/// The length of a request header in the negotiated mode.
pub fn request_header_len(extended: bool) -> usize {
    if extended {
        EXTENDED_REQUEST_LEN
    } else {
        COMPACT_REQUEST_LEN
    }
}

/// Decodes a request header (not its payload). The magic must match the
/// negotiated mode: a compact header on an extended connection (or the other
/// way round) is Invalid, and the connection cannot be resynchronised.
pub fn decode_request(buf: &[u8], extended: bool) -> Decoded<Request> {
    let total = request_header_len(extended);
    let mut r = Rd::header(buf, total)?;
    let magic = r.u32()?;
    let want = if extended {
        EXTENDED_REQUEST_MAGIC
    } else {
        REQUEST_MAGIC
    };
    if magic != want {
        return Err(DecodeError::Invalid("bad request magic"));
    }
    let flags = r.u16()?;
    let command = Command::from_wire(r.u16()?);
    let cookie = r.u64()?;
    let offset = r.u64()?;
    let length = if extended { r.u64()? } else { r.u32()? as u64 };
    Ok((
        Request {
            flags,
            command,
            cookie,
            offset,
            length,
        },
        total,
    ))
}

// ---------------------------------------------------------------------------
// Transmission: replies
// ---------------------------------------------------------------------------

/// Which reply headers a connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplyMode {
    /// Only simple replies (no NBD_OPT_STRUCTURED_REPLY).
    #[default]
    Simple,
    /// Structured replies with 20-byte chunk headers.
    Structured,
    /// Extended headers: 32-byte requests and reply chunks.
    Extended,
}

impl ReplyMode {
    pub fn extended(self) -> bool {
        self == ReplyMode::Extended
    }
    pub fn structured(self) -> bool {
        self != ReplyMode::Simple
    }
    /// Length of one chunk header in this mode (Simple: the simple reply).
    pub fn header_len(self) -> usize {
        match self {
            ReplyMode::Simple => SIMPLE_REPLY_LEN,
            ReplyMode::Structured => STRUCTURED_REPLY_HEADER_LEN,
            ReplyMode::Extended => EXTENDED_REPLY_HEADER_LEN,
        }
    }
}

/// S: simple reply header; for a successful read, the data follows.
pub fn encode_simple_reply(out: &mut Vec<u8>, cookie: u64, error: u32) {
    put_u32(out, SIMPLE_REPLY_MAGIC);
    put_u32(out, error);
    put_u64(out, cookie);
}

/// Identifies the request a chunk answers: cookie, and the request offset
/// that extended reply headers repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplyTo {
    pub cookie: u64,
    pub offset: u64,
}

/// Appends a structured (20-byte) or extended (32-byte) chunk header.
/// `mode` must not be Simple. In structured mode `len` must fit 32 bits.
pub fn encode_chunk_header(
    out: &mut Vec<u8>,
    mode: ReplyMode,
    to: ReplyTo,
    flags: u16,
    typ: u16,
    len: u64,
) {
    if mode.extended() {
        put_u32(out, EXTENDED_REPLY_MAGIC);
        put_u16(out, flags);
        put_u16(out, typ);
        put_u64(out, to.cookie);
        put_u64(out, to.offset);
        put_u64(out, len);
    } else {
        debug_assert!(mode == ReplyMode::Structured);
        debug_assert!(len <= u32::MAX as u64);
        put_u32(out, STRUCTURED_REPLY_MAGIC);
        put_u16(out, flags);
        put_u16(out, typ);
        put_u64(out, to.cookie);
        put_u32(out, len.min(u32::MAX as u64) as u32);
    }
}

/// NBD_REPLY_TYPE_NONE with DONE.
pub fn encode_chunk_none(out: &mut Vec<u8>, mode: ReplyMode, to: ReplyTo) {
    encode_chunk_header(out, mode, to, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
}

/// The header of an NBD_REPLY_TYPE_OFFSET_DATA chunk carrying `data_len`
/// bytes of export data at `data_offset`. The caller appends (or sends) the
/// data itself, so it can be read straight into place.
pub fn encode_offset_data_header(
    out: &mut Vec<u8>,
    mode: ReplyMode,
    to: ReplyTo,
    flags: u16,
    data_offset: u64,
    data_len: u64,
) {
    encode_chunk_header(out, mode, to, flags, REPLY_TYPE_OFFSET_DATA, 8 + data_len);
    put_u64(out, data_offset);
}

/// Bytes an NBD_REPLY_TYPE_OFFSET_DATA header takes before the data.
pub fn offset_data_header_len(mode: ReplyMode) -> usize {
    mode.header_len() + 8
}

pub fn encode_offset_hole(
    out: &mut Vec<u8>,
    mode: ReplyMode,
    to: ReplyTo,
    flags: u16,
    hole_offset: u64,
    hole_len: u32,
) {
    encode_chunk_header(out, mode, to, flags, REPLY_TYPE_OFFSET_HOLE, 12);
    put_u64(out, hole_offset);
    put_u32(out, hole_len);
}

/// One block status descriptor. Compact chunks carry 32-bit length and
/// status; extended chunks 64-bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub length: u64,
    pub status: u64,
}

/// NBD_REPLY_TYPE_BLOCK_STATUS (structured mode) or _EXT (extended mode).
/// In structured mode lengths must fit 32 bits (the caller clamps).
pub fn encode_block_status(
    out: &mut Vec<u8>,
    mode: ReplyMode,
    to: ReplyTo,
    flags: u16,
    context_id: u32,
    descriptors: &[Descriptor],
) {
    if mode.extended() {
        let len = 8 + 16 * descriptors.len() as u64;
        encode_chunk_header(out, mode, to, flags, REPLY_TYPE_BLOCK_STATUS_EXT, len);
        put_u32(out, context_id);
        put_u32(out, descriptors.len() as u32);
        for d in descriptors {
            put_u64(out, d.length);
            put_u64(out, d.status);
        }
    } else {
        let len = 4 + 8 * descriptors.len() as u64;
        encode_chunk_header(out, mode, to, flags, REPLY_TYPE_BLOCK_STATUS, len);
        put_u32(out, context_id);
        for d in descriptors {
            debug_assert!(d.length <= u32::MAX as u64);
            put_u32(out, d.length.min(u32::MAX as u64) as u32);
            put_u32(out, d.status as u32);
        }
    }
}

/// NBD_REPLY_TYPE_ERROR (offset None) or NBD_REPLY_TYPE_ERROR_OFFSET.
pub fn encode_error_chunk(
    out: &mut Vec<u8>,
    mode: ReplyMode,
    to: ReplyTo,
    flags: u16,
    error: u32,
    message: &str,
    offset: Option<u64>,
) {
    let msg = clip(message).as_bytes();
    let (typ, extra) = match offset {
        Some(_) => (REPLY_TYPE_ERROR_OFFSET, 8),
        None => (REPLY_TYPE_ERROR, 0),
    };
    let len = 6 + msg.len() as u64 + extra;
    encode_chunk_header(out, mode, to, flags, typ, len);
    put_u32(out, error);
    put_u16(out, msg.len() as u16);
    out.extend_from_slice(msg);
    if let Some(o) = offset {
        put_u64(out, o);
    }
}

/// A reply header as the client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    Simple {
        cookie: u64,
        error: u32,
    },
    /// A structured or extended chunk header; `offset` is 0 for structured.
    Chunk {
        flags: u16,
        typ: u16,
        cookie: u64,
        offset: u64,
        length: u64,
        extended: bool,
    },
}

impl ReplyHeader {
    pub fn cookie(&self) -> u64 {
        match self {
            ReplyHeader::Simple { cookie, .. } | ReplyHeader::Chunk { cookie, .. } => *cookie,
        }
    }
}

/// Decodes any reply header allowed in `mode`: simple replies in Simple and
/// Structured mode, structured chunks in Structured mode, extended chunks only
/// (and exclusively) in Extended mode.
pub fn decode_reply_header(buf: &[u8], mode: ReplyMode) -> Decoded<ReplyHeader> {
    let mut r = Rd::header(buf, 4)?;
    let magic = r.u32()?;
    match (magic, mode) {
        (SIMPLE_REPLY_MAGIC, ReplyMode::Simple | ReplyMode::Structured) => {
            let mut r = Rd::header(buf, SIMPLE_REPLY_LEN)?;
            r.u32()?;
            let error = r.u32()?;
            let cookie = r.u64()?;
            Ok((ReplyHeader::Simple { cookie, error }, SIMPLE_REPLY_LEN))
        }
        (STRUCTURED_REPLY_MAGIC, ReplyMode::Structured) => {
            let mut r = Rd::header(buf, STRUCTURED_REPLY_HEADER_LEN)?;
            r.u32()?;
            let flags = r.u16()?;
            let typ = r.u16()?;
            let cookie = r.u64()?;
            let length = r.u32()? as u64;
            Ok((
                ReplyHeader::Chunk {
                    flags,
                    typ,
                    cookie,
                    offset: 0,
                    length,
                    extended: false,
                },
                STRUCTURED_REPLY_HEADER_LEN,
            ))
        }
        (EXTENDED_REPLY_MAGIC, ReplyMode::Extended) => {
            let mut r = Rd::header(buf, EXTENDED_REPLY_HEADER_LEN)?;
            r.u32()?;
            let flags = r.u16()?;
            let typ = r.u16()?;
            let cookie = r.u64()?;
            let offset = r.u64()?;
            let length = r.u64()?;
            Ok((
                ReplyHeader::Chunk {
                    flags,
                    typ,
                    cookie,
                    offset,
                    length,
                    extended: true,
                },
                EXTENDED_REPLY_HEADER_LEN,
            ))
        }
        (SIMPLE_REPLY_MAGIC | STRUCTURED_REPLY_MAGIC | EXTENDED_REPLY_MAGIC, _) => Err(
            DecodeError::Invalid("reply magic not allowed in the negotiated mode"),
        ),
        _ => Err(DecodeError::Invalid("bad reply magic")),
    }
}

/// A structured/extended chunk payload, parsed. Data borrows from the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk<'a> {
    None,
    OffsetData {
        offset: u64,
        data: &'a [u8],
    },
    OffsetHole {
        offset: u64,
        length: u32,
    },
    /// From either BLOCK_STATUS (32-bit fields widened) or BLOCK_STATUS_EXT.
    BlockStatus {
        context_id: u32,
        descriptors: Vec<Descriptor>,
    },
    Error {
        error: u32,
        message: String,
    },
    ErrorOffset {
        error: u32,
        message: String,
        offset: u64,
    },
    /// A chunk type this codec does not know. If `typ` has bit 15 set it is
    /// an error chunk and the reply failed; otherwise the client must hang up.
    Unknown {
        typ: u16,
        payload: &'a [u8],
    },
}

/// Parses the payload of a chunk of type `typ`. The payload length comes
/// from the chunk header, which the caller has already bounded.
pub fn decode_chunk(typ: u16, payload: &[u8]) -> Result<Chunk<'_>, DecodeError> {
    let mut r = Rd::payload(payload);
    match typ {
        REPLY_TYPE_NONE => {
            r.end()?;
            Ok(Chunk::None)
        }
        REPLY_TYPE_OFFSET_DATA => {
            let offset = r.u64()?;
            let data = r.rest();
            if data.is_empty() {
                return Err(DecodeError::Invalid("data chunk without data"));
            }
            Ok(Chunk::OffsetData { offset, data })
        }
        REPLY_TYPE_OFFSET_HOLE => {
            let offset = r.u64()?;
            let length = r.u32()?;
            r.end()?;
            if length == 0 {
                return Err(DecodeError::Invalid("hole chunk of length 0"));
            }
            Ok(Chunk::OffsetHole { offset, length })
        }
        REPLY_TYPE_BLOCK_STATUS => {
            let context_id = r.u32()?;
            if r.remaining() == 0 || r.remaining() & 7 != 0 {
                return Err(DecodeError::Invalid("bad block status length"));
            }
            let mut descriptors = Vec::with_capacity(r.remaining() / 8);
            while r.remaining() > 0 {
                let length = r.u32()? as u64;
                let status = r.u32()? as u64;
                descriptors.push(Descriptor { length, status });
            }
            Ok(Chunk::BlockStatus {
                context_id,
                descriptors,
            })
        }
        REPLY_TYPE_BLOCK_STATUS_EXT => {
            let context_id = r.u32()?;
            let count = r.u32()? as usize;
            if count == 0 || r.remaining() & 15 != 0 || r.remaining() / 16 != count {
                return Err(DecodeError::Invalid(
                    "block status descriptor count does not match the length",
                ));
            }
            let mut descriptors = Vec::with_capacity(count);
            for _ in 0..count {
                let length = r.u64()?;
                let status = r.u64()?;
                descriptors.push(Descriptor { length, status });
            }
            Ok(Chunk::BlockStatus {
                context_id,
                descriptors,
            })
        }
        REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET => {
            let error = r.u32()?;
            let mlen = r.u16()? as usize;
            let tail = if typ == REPLY_TYPE_ERROR_OFFSET { 8 } else { 0 };
            if mlen + tail > r.remaining() {
                return Err(DecodeError::Invalid("error message longer than the chunk"));
            }
            let message = lossy_string(r.take(mlen)?);
            if typ == REPLY_TYPE_ERROR {
                // Bytes after the message are reserved; tolerate them.
                Ok(Chunk::Error { error, message })
            } else {
                let offset = r.u64()?;
                Ok(Chunk::ErrorOffset {
                    error,
                    message,
                    offset,
                })
            }
        }
        _ => Ok(Chunk::Unknown { typ, payload }),
    }
}

#[cfg(test)]
mod tests;
