//! What a request does once the reader has it: [`validate`] against the
//! spec and the session, [`execute`] through the export layer (reads plain,
//! sparse or spliced, writes, zeroes, trims, flushes, block status), and
//! the encoded reply each one sends. Nothing here calls the target itself.

use std::cell::RefCell;

use rawdisk_storage::{ExtentKind, ZeroFlags};
use tracing::{debug, warn};

use super::buffers::PIPE_BYTES;
use super::export::{storage_errno, Cause, Failure, ZERO_OP};
use super::meta::{Context, Selected, DEPTH_THIS_LAYER, STATE_CHANGED};
use super::{Session, Shared};
use crate::proto::*;
use crate::sock::Pipe;

/// Reads at least this long ask the storage for holes first and answer them
/// with hole chunks; below it a lookup costs more than reading zeros.
const SPARSE_READ_MIN: u64 = 64 << 10;
/// Descriptors in one block status reply (the spec's SHOULD limit is 2^20;
/// clients ask again from where the reply ends).
const MAX_DESCRIPTORS: usize = 16 << 10;
/// Page-cache reads of at least this many bytes are spliced to the socket
/// (splice_read): below it a copy costs less than the splice calls and the
/// header's own send.
const SPLICE_MIN: u64 = 64 << 10;

pub(super) type Reject = (u32, &'static str);

/// Checks a request against the spec and the session before any work.
pub(super) fn validate(s: &Session, req: &Request) -> Result<(), Reject> {
    let ext = s.mode.extended();
    let allowed = match req.command {
        Command::Read => {
            CMD_FLAG_FUA
                | if s.flags & FLAG_SEND_DF != 0 {
                    CMD_FLAG_DF
                } else {
                    0
                }
        }
        Command::Write => CMD_FLAG_FUA | if ext { CMD_FLAG_PAYLOAD_LEN } else { 0 },
        Command::WriteZeroes => {
            CMD_FLAG_FUA
                | CMD_FLAG_NO_HOLE
                | if s.flags & FLAG_SEND_FAST_ZERO != 0 {
                    CMD_FLAG_FAST_ZERO
                } else {
                    0
                }
        }
        Command::BlockStatus => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        Command::Flush | Command::Trim | Command::Cache => CMD_FLAG_FUA,
        // DISC ends the connection before it gets here; RESIZE is not
        // offered (no NBD_FLAG_SEND_RESIZE).
        Command::Disc | Command::Resize | Command::Unknown(_) => {
            return Err((NBD_EINVAL, "unknown command"))
        }
    };
    if req.flags & !allowed != 0 {
        return Err((NBD_EINVAL, "command flag not valid for this command"));
    }
    let writes = matches!(
        req.command,
        Command::Write | Command::WriteZeroes | Command::Trim
    );
    if writes && s.flags & FLAG_READ_ONLY != 0 {
        return Err((NBD_EPERM, "export is read-only"));
    }
    if req.command == Command::Flush {
        return Ok(());
    }
    let past_end = match req.offset.checked_add(req.length) {
        Some(end) => end > s.size,
        None => true,
    };
    if past_end {
        // Spec (Error values): writes past the end are ENOSPC, reads, trims
        // and status queries EINVAL.
        let err = if matches!(req.command, Command::Write | Command::WriteZeroes) {
            NBD_ENOSPC
        } else {
            NBD_EINVAL
        };
        return Err((err, "request extends past the end of the export"));
    }
    if req.command == Command::Read && req.length > s.max_payload as u64 {
        return Err((NBD_EINVAL, "read longer than the maximum payload"));
    }
    // TRIM is advisory, and qemu sends it unaligned on purpose (and fails
    // the guest's I/O on EINVAL): the storage trims the aligned part.
    let exempt = matches!(req.command, Command::BlockStatus | Command::Trim);
    if s.enforce_min_block && s.min_block > 1 && !exempt {
        // min_block is a power of two.
        let mask = s.min_block as u64 - 1;
        let end = req.offset + req.length;
        if req.offset & mask != 0 || (req.length & mask != 0 && end != s.size) {
            return Err((NBD_EINVAL, "request not aligned to the minimum block size"));
        }
    }
    if req.command == Command::BlockStatus {
        if s.contexts.is_empty() {
            return Err((NBD_EINVAL, "no metadata context was negotiated"));
        }
        if req.length == 0 {
            return Err((NBD_EINVAL, "block status of an empty range"));
        }
    }
    Ok(())
}

/// A reply without payload: success.
pub(super) fn small_ok(s: &Session, to: ReplyTo) -> Vec<u8> {
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
pub(super) fn small_error(s: &Session, to: ReplyTo, err: u32, msg: &str) -> Encoded {
    error_reply(s, to, err, msg, None)
}

fn error_reply(s: &Session, to: ReplyTo, err: u32, msg: &str, offset: Option<u64>) -> Encoded {
    let mut b = Vec::with_capacity(64 + msg.len());
    match s.mode {
        ReplyMode::Simple => encode_simple_reply(&mut b, to.cookie, err),
        _ => encode_error_chunk(&mut b, s.mode, to, REPLY_FLAG_DONE, err, msg, offset),
    }
    let mut e = whole(b);
    e.err = err;
    e
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
pub(super) struct Encoded {
    pub(super) buf: Vec<u8>,
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) spliced: Vec<Spliced>,
    /// The NBD error this reply carries (0: success), for the totals.
    pub(super) err: u32,
}

/// `len` bytes of read data in `pipe`.
pub(super) struct Spliced {
    pub(super) pipe: Pipe,
    pub(super) len: usize,
}

impl Encoded {
    fn bytes(buf: Vec<u8>, start: usize, end: usize) -> Encoded {
        Encoded {
            buf,
            start,
            end,
            spliced: Vec::new(),
            err: 0,
        }
    }
}

pub(super) fn whole(b: Vec<u8>) -> Encoded {
    let n = b.len();
    Encoded::bytes(b, 0, n)
}

/// The reply to `req` that failed in the storage with `e`.
pub(super) fn storage_error(
    sh: &Shared,
    s: &Session,
    req: &Request,
    to: ReplyTo,
    op: &str,
    e: &rawdisk_storage::Error,
) -> Encoded {
    failed(
        sh,
        s,
        req,
        to,
        op,
        e,
        storage_errno(e),
        error_offset(req, e),
    )
}

/// Where `req` failed, for NBD_REPLY_TYPE_ERROR_OFFSET: only for the
/// commands the spec allows it on, and only inside the request's range.
/// Elsewhere (FLUSH, a zero-length request, an error with no place in the
/// range) the reply is NBD_REPLY_TYPE_ERROR: a client checks the offset,
/// and libnbd drops the connection for one outside the range.
fn error_offset(req: &Request, e: &rawdisk_storage::Error) -> Option<u64> {
    let inside = e.len > 0 && e.offset >= req.offset && e.offset - req.offset < req.length;
    (req.command.allows_error_offset() && inside).then_some(e.offset)
}

/// The reply carrying `err` for `req`, which failed in the storage with
/// `e`. No space and I/O errors are the operator's business, not only the
/// client's: they are logged, at most one line per second.
#[allow(clippy::too_many_arguments)]
fn failed(
    sh: &Shared,
    s: &Session,
    req: &Request,
    to: ReplyTo,
    op: &str,
    e: &rawdisk_storage::Error,
    err: u32,
    off: Option<u64>,
) -> Encoded {
    if err == NBD_ENOSPC || err == NBD_EIO {
        if sh.storage_errors.allow() {
            warn!(
                "{op} of {} bytes at offset {} answered {}: {e}",
                req.length,
                req.offset,
                error_name(err),
            );
        }
    } else {
        debug!("{op}: {e} -> {}", error_name(err));
    }
    error_reply(s, to, err, &e.to_string(), off)
}

/// Runs one validated request on the blocking pool; returns the encoded reply.
pub(super) fn execute(
    sh: &Shared,
    s: &Session,
    req: &Request,
    to: ReplyTo,
    data: Option<(Vec<u8>, usize, usize)>,
) -> Encoded {
    let e = &*s.export;
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let done = |r: Result<(), Failure>| answer(sh, s, req, to, r);
    match req.command {
        Command::Read => read(sh, s, req, to),
        Command::Write => {
            let Some((buf, start, n)) = data else {
                return whole(small_ok(s, to));
            };
            let r = e.write(req.offset, &buf[start..start + n], fua);
            sh.pool.put(buf);
            done(r)
        }
        Command::Flush => done(e.flush()),
        Command::Trim => done(e.trim(req.offset, req.length, fua)),
        Command::Cache => done(e.cache(req.offset, req.length)),
        Command::WriteZeroes => {
            let flags = zero_flags(req);
            match e.zero(req.offset, req.length, flags, fua) {
                Err(Failure {
                    op: ZERO_OP,
                    cause: Cause::Storage(err),
                }) => {
                    let mut code = storage_errno(&err);
                    // Spec: ENOTSUP only answers FAST_ZERO.
                    if code == NBD_ENOTSUP && !flags.fast_only {
                        code = NBD_EIO;
                    }
                    failed(sh, s, req, to, ZERO_OP, &err, code, None)
                }
                r => done(r),
            }
        }
        Command::BlockStatus => block_status(s, req, to),
        Command::Disc | Command::Resize | Command::Unknown(_) => {
            small_error(s, to, NBD_EINVAL, "unknown command")
        }
    }
}

/// What a WRITE_ZEROES asks of the storage.
pub(super) fn zero_flags(req: &Request) -> ZeroFlags {
    ZeroFlags {
        may_trim: req.flags & CMD_FLAG_NO_HOLE == 0,
        fast_only: req.flags & CMD_FLAG_FAST_ZERO != 0,
    }
}

/// Runs WRITE_ZEROES requests with the same flags, each starting where the
/// one before ends, as one zero of their whole range and answers each. If
/// that fails, each runs again on its own: every request gets its own
/// outcome, and none is answered success for a range left unzeroed.
pub(super) fn execute_zeros(sh: &Shared, s: &Session, run: &[(Request, ReplyTo)]) -> Vec<Encoded> {
    let each = || {
        run.iter()
            .map(|(r, to)| execute(sh, s, r, *to, None))
            .collect()
    };
    let [(first, _), .., (last, _)] = run else {
        return each();
    };
    let fua = first.flags & CMD_FLAG_FUA != 0;
    let len = last.offset + last.length - first.offset;
    match s.export.zero(first.offset, len, zero_flags(first), fua) {
        Ok(()) => run.iter().map(|(_, to)| whole(small_ok(s, *to))).collect(),
        Err(f) => {
            debug!(
                "write zeroes of {len} bytes at offset {} (merged) failed: {:?}; each on its own",
                first.offset, f.cause
            );
            each()
        }
    }
}

fn read(sh: &Shared, s: &Session, req: &Request, to: ReplyTo) -> Encoded {
    let n = req.length as usize;
    let df = req.flags & CMD_FLAG_DF != 0;
    if s.mode != ReplyMode::Simple {
        if n == 0 {
            let mut b = Vec::new();
            encode_chunk_none(&mut b, s.mode, to);
            return whole(b);
        }
        if !df && req.length >= SPARSE_READ_MIN {
            if let Some(ext) = s.export.holes(req.offset, req.length, s.size) {
                return sparse_read(sh, s, req, to, &ext);
            }
        }
    }
    match splice_read(sh, s, req) {
        Some(Ok(spliced)) => return spliced_reply(s, req, to, spliced),
        Some(Err(f)) => return failure(sh, s, req, to, f),
        None => {}
    }
    let (mut buf, start, d) = data_buffer(sh, s, n);
    if let Err(f) = s.export.read(&mut buf[d..d + n], req.offset) {
        sh.pool.put(buf);
        return failure(sh, s, req, to, f);
    }
    data_reply(s, req, to, buf, start, d)
}

/// A small read answered from the page cache where it is asked for (the
/// connection's reader), or None when part of it is not cached: then
/// [`execute`] runs it where it may wait for the device. Only reads below
/// the sparse and splice sizes, which [`read`] also copies whole.
pub(super) fn read_cached(sh: &Shared, s: &Session, req: &Request, to: ReplyTo) -> Option<Encoded> {
    let e = &*s.export;
    if req.command != Command::Read
        || req.length == 0
        || req.length >= SPARSE_READ_MIN.min(SPLICE_MIN)
        || !e.may_read_cached()
    {
        return None;
    }
    let n = req.length as usize;
    let (mut buf, start, d) = data_buffer(sh, s, n);
    if e.read_cached(&mut buf[d..d + n], req.offset) {
        return Some(data_reply(s, req, to, buf, start, d));
    }
    // Not cached, or an error the blocking read will meet and report.
    sh.pool.put(buf);
    None
}

/// Whether [`read`] reads `req` whole into a [`data_buffer`] and answers
/// with [`data_reply`] (no hole lookup, no splice): then it may be read
/// elsewhere (in flight in the kernel) with the same answer.
pub(super) fn plain_read(req: &Request) -> bool {
    req.command == Command::Read && req.length > 0 && req.length < SPARSE_READ_MIN.min(SPLICE_MIN)
}

/// A pooled buffer for a read of `n` bytes behind its reply header: the
/// buffer, where the header starts and where the data starts.
pub(super) fn data_buffer(sh: &Shared, s: &Session, n: usize) -> (Vec<u8>, usize, usize) {
    let p = match s.mode {
        ReplyMode::Simple => SIMPLE_REPLY_LEN,
        ReplyMode::Structured | ReplyMode::Extended => offset_data_header_len(s.mode),
    };
    let (buf, start) = sh.pool.get(p, n);
    (buf, start, start + p)
}

/// The reply of a read whose data [`data_buffer`] holds at `d`.
pub(super) fn data_reply(
    s: &Session,
    req: &Request,
    to: ReplyTo,
    mut buf: Vec<u8>,
    start: usize,
    d: usize,
) -> Encoded {
    let n = req.length;
    put_header(&mut buf[start..d], |h| match s.mode {
        ReplyMode::Simple => encode_simple_reply(h, to.cookie, 0),
        // Everything is read before the chunk goes out, so it may carry
        // DONE itself (spec: no error can follow).
        ReplyMode::Structured | ReplyMode::Extended => {
            encode_offset_data_header(h, s.mode, to, REPLY_FLAG_DONE, req.offset, n)
        }
    });
    Encoded::bytes(buf, start, d + n as usize)
}

/// A read whose data goes to the socket through pipes (Target::read_to_pipe)
/// instead of a buffer, in pieces that end on PIPE_BYTES boundaries of the
/// target so that each fills at most one pipe of PIPE_BYTES. None when this
/// read does not qualify or a pipe is not to be had; the caller then copies.
fn splice_read(sh: &Shared, s: &Session, req: &Request) -> Option<Result<Vec<Spliced>, Failure>> {
    let e = &*s.export;
    if !s.splice || req.length < SPLICE_MIN || !e.may_splice() {
        return None;
    }
    let end = req.offset + req.length;
    let mut out = Vec::with_capacity(req.length.div_ceil(PIPE_BYTES as u64) as usize + 1);
    let mut pos = req.offset;
    while pos < end {
        let piece_end = e.piece_end(pos, PIPE_BYTES as u64).min(end);
        let n = (piece_end - pos) as usize;
        let pipe = sh.pipes.get()?;
        match e.read_to_pipe(pipe.write_end(), pos, n) {
            Ok(true) => out.push(Spliced { pipe, len: n }),
            // This pipe may hold part of the piece: it is dropped, not
            // pooled; the pieces already filled go back empty-handed too.
            Ok(false) => return None,
            Err(f) => return Some(Err(f)),
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
        err: 0,
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
            if let Err(f) = s.export.read(&mut buf[d..d + len as usize], off) {
                sh.pool.put(buf);
                return failure(sh, s, req, to, f);
            }
            at = d + len as usize;
        }
    }
    Encoded::bytes(buf, start, at)
}

/// A BLOCK_STATUS of base:allocation and qemu:allocation-depth alone: a
/// few lseeks at most (none on a block device), cheap enough to run where
/// it is read, as nbdkit does, instead of a hand-off to the blocking pool
/// and back per request.
pub(super) fn quick_status(s: &Session, req: &Request) -> bool {
    req.command == Command::BlockStatus && s.contexts.iter().all(|(_, c)| c.checkpoint().is_none())
}

/// One block status chunk per selected context, each from the request's
/// offset (spec: NBD_CMD_BLOCK_STATUS). A checkpoint deleted since the
/// client selected its context (also one whose name a newer checkpoint
/// took since) fails the whole request.
fn block_status(s: &Session, req: &Request, to: ReplyTo) -> Encoded {
    let max_runs = if req.flags & CMD_FLAG_REQ_ONE != 0 {
        1
    } else {
        MAX_DESCRIPTORS
    };
    if s.contexts.iter().any(|(_, c)| c.checkpoint().is_some()) {
        // Checkpoints made or deleted since the last look (one pread when
        // none were).
        super::meta::refresh(&s.export);
    }
    let mut chunks = Vec::with_capacity(s.contexts.len());
    for (id, c) in &s.contexts {
        let ds = match c {
            Context::Allocation => allocation(s, req, max_runs),
            Context::Depth => vec![Descriptor {
                length: req.length,
                status: DEPTH_THIS_LAYER as u64,
            }],
            Context::Changed(cp) | Context::Dirty(cp) => match changed(s, cp, req, max_runs) {
                Some(ds) => ds,
                None => {
                    let msg = format!("checkpoint {:?} no longer exists (it was deleted)", cp.name);
                    debug!("block status: {msg}");
                    return small_error(s, to, NBD_EINVAL, &msg);
                }
            },
        };
        chunks.push((*id, ds));
    }
    let size: usize = chunks.iter().map(|(_, ds)| 40 + 16 * ds.len()).sum();
    let mut b = Vec::with_capacity(size);
    let last = chunks.len().saturating_sub(1);
    for (i, (id, ds)) in chunks.iter().enumerate() {
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        encode_block_status(&mut b, s.mode, to, flags, *id, ds);
    }
    whole(b)
}

/// base:allocation: holes (reading as zeros) and data.
fn allocation(s: &Session, req: &Request, max_runs: usize) -> Vec<Descriptor> {
    let ext = s.export.extents(req.offset, req.length, max_runs, s.size);
    let mut ds: Vec<Descriptor> = ext
        .unwrap_or_default()
        .iter()
        .filter(|e| e.len > 0)
        .map(|e| Descriptor {
            length: e.len,
            status: match e.kind {
                ExtentKind::Hole => (STATE_HOLE | STATE_ZERO) as u64,
                ExtentKind::Data => 0,
            },
        })
        .collect();
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
    ds
}

/// rawdisk:changed:NAME and qemu:dirty-bitmap:NAME: the ranges changed
/// since the checkpoint (all of them for an inconsistent one); None when it
/// no longer exists. The tracker's runs cover the request exactly.
fn changed(s: &Session, cp: &Selected, req: &Request, max_runs: usize) -> Option<Vec<Descriptor>> {
    let tracker = s.export.tracker()?;
    let runs = tracker.changed_seq(&cp.name, cp.seq, req.offset, req.length, max_runs)?;
    let mut ds: Vec<Descriptor> = runs
        .into_iter()
        .filter(|&(len, _)| len > 0)
        .map(|(length, changed)| Descriptor {
            length,
            status: if changed { STATE_CHANGED as u64 } else { 0 },
        })
        .collect();
    if ds.is_empty() {
        // Never an empty chunk; "changed" is the answer that hides nothing.
        ds.push(Descriptor {
            length: req.length,
            status: STATE_CHANGED as u64,
        });
    }
    Some(ds)
}

/// The reply to a request that changed the export (or failed to):
/// success, the storage's error, or EIO when the tracker's marks could not
/// be made durable.
fn answer(sh: &Shared, s: &Session, req: &Request, to: ReplyTo, r: Result<(), Failure>) -> Encoded {
    match r {
        Ok(()) => whole(small_ok(s, to)),
        Err(f) => failure(sh, s, req, to, f),
    }
}

/// The error reply for `f`, the failure of `req`.
pub(super) fn failure(sh: &Shared, s: &Session, req: &Request, to: ReplyTo, f: Failure) -> Encoded {
    let Failure { op, cause } = f;
    match cause {
        Cause::Storage(e) => storage_error(sh, s, req, to, op, &e),
        Cause::Persist(err) => {
            // A full file system under the state file is ENOSPC, so a client
            // that pauses on ENOSPC (a hypervisor's policy) pauses.
            let (code, name) = match err.errno() {
                Some(libc::ENOSPC | libc::EDQUOT) => (NBD_ENOSPC, "NBD_ENOSPC"),
                _ => (NBD_EIO, "NBD_EIO"),
            };
            if sh.storage_errors.allow() {
                warn!(
                    "{op} of {} bytes at offset {} answered {name}: {err}",
                    req.length, req.offset
                );
            }
            error_reply(s, to, code, &err.to_string(), None)
        }
    }
}
