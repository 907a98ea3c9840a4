//! `--verify`: compare both sides after a copy, reading only where the
//! source has data or the destination is not known to read as zeros.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::retry::Link;
use super::{
    is_zero, next_work, request_size, CopyError, CopyOptions, FirstError, Planner, Result, Side,
    Work,
};
use crate::endpoint::{Endpoint, IoBuf};

/// What a verification compared.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyStats {
    /// Bytes read from each side and compared.
    pub bytes_compared: u64,
    /// Bytes known to be zero on both sides without reading.
    pub bytes_skipped: u64,
    pub elapsed: Duration,
}

/// Compares `[0, src.size())` of both sides; fails with the first differing
/// offset. Runs both sides report as zeros are not read.
pub fn verify(src: &Endpoint, dst: &Endpoint, opts: &CopyOptions) -> Result<VerifyStats> {
    let t0 = Instant::now();
    let size = src.size();
    if dst.size() < size {
        return Err(CopyError::Mismatch(format!(
            "destination is {} bytes, the source {size}",
            dst.size()
        )));
    }
    let align = src.min_block().max(dst.min_block());
    let dst_link = Link::fixed(dst);
    let request = request_size(src, &super::Dst::Ep(&dst_link), opts);
    // Zero runs are checked against the destination's map in pieces of
    // 64 MiB, read where the destination has data.
    let src_link = Link::fixed(src);
    let planner = Mutex::new(Planner::new(&src_link, request, 64 << 20));
    // The first mismatch found is enough to fail; it need not be the lowest.
    let errors = FirstError::default();
    let compared = AtomicU64::new(0);
    let skipped = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..opts.requests.clamp(1, 16) {
            s.spawn(|| {
                let mut a = IoBuf::new(request as usize, align.max(4096) as usize);
                let mut b = IoBuf::new(request as usize, align.max(4096) as usize);
                while let Some(w) = next_work(&planner, &errors, opts.cancel.as_deref()) {
                    let r = match w {
                        Work::Data { offset, len } => {
                            verify_data(src, dst, &mut a, &mut b, offset, len).map(|_| {
                                compared.fetch_add(len, Ordering::Relaxed);
                            })
                        }
                        Work::Zero { offset, len } => {
                            verify_zero(dst, &mut b, offset, len, request, &compared, &skipped)
                        }
                    };
                    if let Err(e) = r {
                        errors.set(e);
                        break;
                    }
                }
            });
        }
    });
    if let Some(e) = errors.into_inner() {
        return Err(e);
    }
    Ok(VerifyStats {
        bytes_compared: compared.into_inner(),
        bytes_skipped: skipped.into_inner(),
        elapsed: t0.elapsed(),
    })
}

fn verify_data(
    src: &Endpoint,
    dst: &Endpoint,
    a: &mut IoBuf,
    b: &mut IoBuf,
    offset: u64,
    len: u64,
) -> Result<()> {
    a.set_len(len as usize);
    b.set_len(len as usize);
    src.read_buf(a, offset)
        .map_err(CopyError::io(Side::Source))?;
    dst.read_buf(b, offset)
        .map_err(CopyError::io(Side::Destination))?;
    if a.as_slice() != b.as_slice() {
        let i = a
            .as_slice()
            .iter()
            .zip(b.as_slice())
            .position(|(x, y)| x != y)
            .unwrap_or(0);
        return Err(CopyError::Mismatch(format!(
            "{} and {} differ at offset {}",
            src.name(),
            dst.name(),
            offset + i as u64
        )));
    }
    Ok(())
}

fn verify_zero(
    dst: &Endpoint,
    b: &mut IoBuf,
    offset: u64,
    len: u64,
    request: u64,
    compared: &AtomicU64,
    skipped: &AtomicU64,
) -> Result<()> {
    let end = offset + len;
    let mut pos = offset;
    while pos < end {
        let exts = dst
            .extents(pos, end - pos)
            .map_err(CopyError::io(Side::Destination))?;
        if exts.is_empty() {
            break;
        }
        for e in exts {
            let e_end = (e.offset + e.len).min(end);
            if e.zero {
                skipped.fetch_add(e_end - e.offset, Ordering::Relaxed);
            } else {
                let mut p = e.offset;
                while p < e_end {
                    let n = (e_end - p).min(request);
                    b.set_len(n as usize);
                    dst.read_buf(b, p)
                        .map_err(CopyError::io(Side::Destination))?;
                    if !is_zero(b.as_slice()) {
                        let i = b.as_slice().iter().position(|&x| x != 0).unwrap_or(0);
                        return Err(CopyError::Mismatch(format!(
                            "{} has non-zero data at offset {} where the source reads as zeros",
                            dst.name(),
                            p + i as u64
                        )));
                    }
                    compared.fetch_add(n, Ordering::Relaxed);
                    p += n;
                }
            }
            pos = e_end;
        }
    }
    Ok(())
}
