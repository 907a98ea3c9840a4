//! Where a copy writes: an endpoint, nothing (`null:`, nbdcopy's: the
//! source's read throughput), or a byte stream (`-`, standard output).
//!
//! A stream has no offsets: the engine runs one worker for it, so requests
//! arrive in order, and zero runs are written out as zeros. An out-of-order
//! request would be a bug of the engine and is refused, not written.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use super::retry::Link;
use super::{CopyError, Counters, Result, Side};
use crate::endpoint::{self, Endpoint};
use crate::scan::is_zero;

/// A byte stream destination and the offset it has reached.
pub struct Stream {
    name: String,
    out: Mutex<(Box<dyn Write + Send>, u64)>,
}

impl Stream {
    pub fn new(name: &str, out: Box<dyn Write + Send>) -> Stream {
        Stream {
            name: name.to_string(),
            out: Mutex::new((out, 0)),
        }
    }

    fn err(&self, offset: u64, len: u64, e: std::io::Error) -> endpoint::Error {
        endpoint::Error {
            endpoint: self.name.clone(),
            errno: e.raw_os_error(),
            message: format!("write at offset {offset} length {len}: {e}"),
            nbd: None,
        }
    }

    fn write(&self, offset: u64, len: u64, data: Option<&[u8]>) -> endpoint::Result<()> {
        static ZEROS: [u8; 1 << 20] = [0; 1 << 20];
        let mut g = self.out.lock().unwrap_or_else(|p| p.into_inner());
        if g.1 != offset {
            let e = std::io::Error::other(format!("out of order (stream at {})", g.1));
            return Err(self.err(offset, len, e));
        }
        let r = match data {
            Some(d) => g.0.write_all(d),
            None => {
                let mut left = len;
                let mut r = Ok(());
                while left > 0 && r.is_ok() {
                    let n = left.min(ZEROS.len() as u64);
                    r = g.0.write_all(&ZEROS[..n as usize]);
                    left -= n;
                }
                r
            }
        };
        r.map_err(|e| self.err(offset, len, e))?;
        g.1 += len;
        Ok(())
    }

    fn flush(&self) -> endpoint::Result<()> {
        let mut g = self.out.lock().unwrap_or_else(|p| p.into_inner());
        let at = g.1;
        g.0.flush().map_err(|e| endpoint::Error {
            endpoint: self.name.clone(),
            errno: e.raw_os_error(),
            message: format!("flush after {at} bytes: {e}"),
            nbd: None,
        })
    }
}

/// What a copy was asked to write to.
#[derive(Clone, Copy)]
pub(super) enum To<'a> {
    Ep(&'a Endpoint),
    Null,
    Stream(&'a Stream),
}

/// The destination as the engine uses it: an endpoint through its [`Link`]
/// (reconnected when its connection breaks).
#[derive(Clone, Copy)]
pub(super) enum Dst<'a> {
    Ep(&'a Link<'a>),
    Null,
    Stream(&'a Stream),
}

impl<'a> Dst<'a> {
    pub(super) fn endpoint(&self) -> Option<&'a Endpoint> {
        match self {
            Dst::Ep(l) => Some(l.first),
            _ => None,
        }
    }

    /// An endpoint's size; None for `null:` and `-`, which take any size.
    pub(super) fn size(&self) -> Option<u64> {
        self.endpoint().map(|e| e.size())
    }

    pub(super) fn name(&self) -> String {
        match self {
            Dst::Ep(l) => l.first.name(),
            Dst::Null => "null:".into(),
            Dst::Stream(s) => s.name.clone(),
        }
    }

    pub(super) fn min_block(&self) -> u64 {
        self.endpoint().map_or(1, |e| e.min_block())
    }

    pub(super) fn max_io(&self) -> u64 {
        self.endpoint().map_or(64 << 20, |e| e.max_io())
    }

    pub(super) fn is_nbd(&self) -> bool {
        self.endpoint().is_some_and(|e| e.is_nbd())
    }

    pub(super) fn write_at(&self, data: &[u8], offset: u64) -> endpoint::Result<()> {
        match self {
            Dst::Ep(l) => l.with(|e| e.write_at(data, offset)),
            Dst::Null => Ok(()),
            Dst::Stream(s) => s.write(offset, data.len() as u64, Some(data)),
        }
    }

    pub(super) fn zero(&self, offset: u64, len: u64, may_trim: bool) -> endpoint::Result<()> {
        match self {
            Dst::Ep(l) => l.with(|e| e.zero(offset, len, may_trim)),
            Dst::Null => Ok(()),
            Dst::Stream(s) => s.write(offset, len, None),
        }
    }

    pub(super) fn start_writeback(&self, offset: u64, len: u64) {
        if let Dst::Ep(l) = self {
            l.first.start_writeback(offset, len);
        }
    }

    pub(super) fn flush(&self) -> endpoint::Result<()> {
        match self {
            Dst::Ep(l) => l.with(|e| e.flush()),
            Dst::Null => Ok(()),
            Dst::Stream(s) => s.flush(),
        }
    }
}

/// How data read from the source lands on the destination: runs of whole
/// zero blocks of `sparse` bytes (aligned in the export; 0: no scan) become
/// zero requests, or nothing when the destination already reads as zeros.
pub(super) struct Store<'a> {
    pub(super) dst: Dst<'a>,
    pub(super) sparse: u64,
    pub(super) skip_zero: bool,
    pub(super) may_trim: bool,
    pub(super) c: &'a Counters,
}

impl Store<'_> {
    pub(super) fn put(&self, data: &[u8], offset: u64) -> Result<()> {
        let (dst, c, sparse) = (self.dst, self.c, self.sparse);
        let io = CopyError::io(Side::Destination);
        if sparse == 0 {
            dst.write_at(data, offset).map_err(&io)?;
            c.written.fetch_add(data.len() as u64, Ordering::Relaxed);
            return Ok(());
        }
        let mut pos = 0usize;
        while pos < data.len() {
            let abs = offset + pos as u64;
            let blk = (sparse - abs % sparse) as usize;
            let first_end = (pos + blk).min(data.len());
            let zero = is_zero(&data[pos..first_end]);
            let mut end = first_end;
            while end < data.len() {
                let e = (end + sparse as usize).min(data.len());
                if is_zero(&data[end..e]) != zero {
                    break;
                }
                end = e;
            }
            let (o, l) = (offset + pos as u64, (end - pos) as u64);
            if zero && self.skip_zero {
                c.skipped.fetch_add(l, Ordering::Relaxed);
            } else if zero {
                dst.zero(o, l, self.may_trim).map_err(&io)?;
                c.zeroed.fetch_add(l, Ordering::Relaxed);
            } else {
                dst.write_at(&data[pos..end], o).map_err(&io)?;
                c.written.fetch_add(l, Ordering::Relaxed);
            }
            pos = end;
        }
        Ok(())
    }
}
