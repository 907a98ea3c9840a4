//! `copy - DESTINATION`: a byte stream (standard input) onto a file, block
//! device or NBD export, in order to the stream's end (nbdcopy's `-`
//! source). Its size is known only at its end: a file destination is
//! written from empty and ends with the stream's size; a device or export
//! must hold it all, and the rest of it is left as it is.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::dst::{Dst, Store};
use super::pace::Pace;
use super::retry::Link;
use super::{open_destination, CopyError, CopyOptions, CopyStats, Counters, Result, Side};
use super::{Destination, ZeroMode};
use crate::endpoint::{self, IoBuf};

/// The destination of a stream, and whether it is a file that grows with
/// it (what lies past its end reads as zeros).
pub struct StreamDestination {
    pub dst: Destination,
    grows: bool,
}

/// Opens DESTINATION for a stream. A file holding data is only emptied
/// with `--force`: the stream may be shorter than what it replaces.
pub fn open_for_stream(spec: &str, opts: &CopyOptions) -> Result<StreamDestination> {
    let file = !endpoint::is_nbd(spec);
    let meta = file.then(|| std::fs::metadata(spec).ok()).flatten();
    if let Some(m) = meta.as_ref().filter(|m| m.is_file() && m.len() > 0) {
        if !opts.force {
            return Err(CopyError::Setup(format!(
                "destination {spec} holds {} bytes and standard input's size is known only \
                 at its end: refusing to overwrite it (use --force)",
                m.len()
            )));
        }
    }
    let grows = file && meta.as_ref().is_none_or(|m| m.is_file());
    let forced = CopyOptions {
        force: true,
        ..opts.clone()
    };
    let dst = open_destination(spec, 0, &forced)?;
    Ok(StreamDestination { dst, grows })
}

/// Copies `input` (named `name`) onto `to` in order, to the stream's end.
pub fn copy_from_stream(
    name: &str,
    input: &mut dyn Read,
    to: &StreamDestination,
    opts: &CopyOptions,
) -> Result<CopyStats> {
    let t0 = Instant::now();
    let ep = &to.dst.endpoint;
    let link = Link::new(
        ep,
        Side::Destination,
        opts.endpoint_options(true),
        opts.retry_timeout,
    );
    let dst = Dst::Ep(&link);
    let pace = Pace::new(opts, 0).map_err(|e| CopyError::Setup(e.to_string()))?;
    let align = ep.min_block().max(4096);
    let want = if ep.is_nbd() { 512 << 10 } else { 2 << 20 };
    let want = match opts.rate_limit {
        0 => want,
        rate => want.min((rate / 4).max(64 << 10)),
    };
    let request = want.min(ep.max_io()).max(align) / align * align;
    let c = Counters::default();
    // A growing file is zeros past its end; --allocated writes them.
    let allocated = opts.zero_mode == ZeroMode::Allocated;
    let store = Store {
        dst,
        sparse: match opts.sparse_size {
            0 => 0,
            _ if to.grows && allocated => 0,
            s => s.max(ep.min_block()).min(request),
        },
        skip_zero: opts.zero_mode == ZeroMode::Skip || (to.grows && !allocated),
        may_trim: !allocated,
        c: &c,
    };
    let limit = if to.grows { u64::MAX } else { ep.size() };
    let src_err = |at, e| CopyError::Io {
        side: Side::Source,
        error: crate::stream::error(name, "read", at, e),
    };
    let mut buf = IoBuf::new(request as usize, align as usize);
    let mut off = 0u64;
    loop {
        if opts.cancel.as_deref().is_some_and(stopped) {
            return Err(CopyError::Interrupted {
                done: off,
                size: off,
            });
        }
        buf.set_len(request as usize);
        let n = crate::stream::read_full(input, buf.as_mut_slice()).map_err(|e| src_err(off, e))?;
        if off == 0 && !opts.raw {
            if let Some(f) = rawdisk_storage::format::detect(&buf.as_slice()[..n], None) {
                return Err(CopyError::Setup(rawdisk_storage::format::refusal(
                    "standard input",
                    f,
                )));
            }
        }
        if n == 0 {
            break;
        }
        if off + n as u64 > limit {
            return Err(CopyError::Setup(format!(
                "standard input is longer than destination {} ({limit} bytes)",
                ep.name()
            )));
        }
        pace.throttle(n as u64);
        buf.set_len(n);
        store.put(buf.as_slice(), off)?;
        c.read.fetch_add(n as u64, Ordering::Relaxed);
        off += n as u64;
        pace.advance(n as u64);
        if (n as u64) < request {
            break;
        }
    }
    if let (true, Some(t)) = (to.grows, ep.target()) {
        // A zero tail was not written: the file ends with the stream.
        t.preallocate(off, opts.preallocation).map_err(|e| {
            CopyError::io(Side::Destination)(endpoint::Error {
                endpoint: ep.name(),
                errno: e.errno(),
                message: e.to_string(),
                nbd: None,
            })
        })?;
    }
    if opts.flush {
        dst.flush().map_err(CopyError::io(Side::Destination))?;
    }
    // A reconnected destination may have dropped what it acknowledged on the
    // lost connection (copy/mod.rs, `run`), and standard input cannot be
    // read again to write it anew.
    if link.reconnects() > 0 {
        return Err(CopyError::Setup(format!(
            "destination {} reconnected during the copy from standard input: what it \
             acknowledged before may not have been kept, and the input cannot be read again",
            ep.name()
        )));
    }
    link.close_reconnected()
        .map_err(CopyError::io(Side::Destination))?;
    pace.complete();
    Ok(CopyStats {
        size: off,
        bytes_read: c.read.into_inner(),
        bytes_written: c.written.into_inner(),
        bytes_zeroed: c.zeroed.into_inner(),
        bytes_skipped: c.skipped.into_inner(),
        reconnects: link.reconnects(),
        elapsed: t0.elapsed(),
        ..Default::default()
    })
}

fn stopped(flag: &AtomicBool) -> bool {
    flag.load(Ordering::Relaxed)
}
