//! `rawdisk compare`: whether two raw images read the same, in the words
//! and exit codes of `qemu-img compare` (0 identical, 1 different, 2 error).
//!
//! The common part `[0, min(size A, size B))` is compared; when the sizes
//! differ the longer image's tail must read as zeros, unless `strict`, where
//! any size difference is a mismatch. Ranges both sides report as zeros
//! (holes, zero extents) are not read; a range only one side reports as
//! zeros is read on the other side and checked for zeros. Requests run on
//! several threads; the first difference reported is the lowest one,
//! because work is handed out in offset order and nothing past a known
//! difference is started.
//!
//! The offset is reported as qemu-img reports it: requests start where runs
//! start (and every 2 MiB within a run), as qemu-img's do, and the offset is
//! that of the first differing 512-byte piece counted from the start of its
//! request. Unlike `qemu-img compare -s`, allocation is never compared: a
//! hole and allocated zeros hold the same image.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::endpoint::{self, Endpoint, EndpointOptions, IoBuf};
use crate::progress::Progress;
use crate::scan::is_zero;
use crate::scan::{self, ExtentCursor};

/// qemu-img reports differences by 512-byte sector.
const SECTOR: u64 = 512;
/// Bytes per read request (less where an NBD server allows less).
const CHUNK: u64 = 2 << 20;

#[derive(Debug, Clone, Default)]
pub struct CompareOptions {
    /// Sizes must be equal.
    pub strict: bool,
    /// Worker threads; 0: one per core (at least 4 with an NBD side).
    pub threads: usize,
    /// NBD connections per side when the server allows multi-conn.
    pub connections: usize,
    /// Compare only the first N bytes and ignore what lies past them: `copy
    /// --verify`, whose destination may be longer than its source.
    pub only_first: Option<u64>,
    /// `-f raw` / `-F raw`: read the first / second image as raw even if it
    /// looks like another image format.
    pub raw_a: bool,
    pub raw_b: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    Identical,
    /// The images differ from this offset on (qemu-img's sector offset).
    Mismatch(u64),
    /// `strict` and the sizes differ.
    SizeMismatch,
}

/// What `compare` found; `--output json` prints it in the vocabulary of
/// docs/json.md (`outcome` always a string, each image as `info` names it).
#[derive(Debug, Clone)]
pub struct CompareReport {
    pub outcome: Outcome,
    pub filename_a: String,
    pub filename_b: String,
    pub size_a: u64,
    pub size_b: u64,
    /// The first byte that differs, when there is a mismatch.
    pub first_byte: Option<u64>,
    pub bytes_read: u64,
    pub bytes_skipped: u64,
    pub elapsed: Duration,
}

impl CompareReport {
    /// What qemu-img compare prints on stdout for this outcome.
    pub fn to_human(&self) -> String {
        let mut s = String::new();
        if self.size_a != self.size_b && self.outcome != Outcome::SizeMismatch {
            let common = self.size_a.min(self.size_b);
            if !matches!(self.outcome, Outcome::Mismatch(o) if o < common) {
                s.push_str("Warning: Image size mismatch!\n");
            }
        }
        match self.outcome {
            Outcome::Identical => s.push_str("Images are identical.\n"),
            Outcome::Mismatch(o) => s.push_str(&format!("Content mismatch at offset {o}!\n")),
            Outcome::SizeMismatch => s.push_str("Strict mode: Image size mismatch!\n"),
        }
        s
    }

    pub fn to_json(&self) -> String {
        let mut v = serde_json::json!({
            "outcome": match self.outcome {
                Outcome::Identical => "identical",
                Outcome::Mismatch(_) => "mismatch",
                Outcome::SizeMismatch => "size-mismatch",
            },
            "a": { "filename": self.filename_a, "virtual-size": self.size_a },
            "b": { "filename": self.filename_b, "virtual-size": self.size_b },
            "bytes-read": self.bytes_read,
            "bytes-skipped": self.bytes_skipped,
            "elapsed-seconds": crate::output::secs(self.elapsed),
        });
        if let Outcome::Mismatch(o) = self.outcome {
            v["mismatch-offset"] = o.into();
        }
        if let Some(b) = self.first_byte {
            v["first-byte"] = b.into();
        }
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
    }

    /// The exit status qemu-img uses: 0 identical, 1 different.
    pub fn exit_code(&self) -> u8 {
        match self.outcome {
            Outcome::Identical => 0,
            _ => 1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    A,
    B,
}

#[derive(Debug, Clone, Copy)]
enum Work {
    /// Both sides read as zeros.
    Skip { len: u64 },
    /// Read both and compare.
    Both { offset: u64, len: u64 },
    /// Read one side; it must be zeros.
    Zero { side: Side, offset: u64, len: u64 },
}

impl Work {
    fn offset(&self, pos: u64) -> u64 {
        match *self {
            Work::Skip { .. } => pos,
            Work::Both { offset, .. } | Work::Zero { offset, .. } => offset,
        }
    }
}

struct Planner<'a> {
    a: ExtentCursor<'a>,
    b: ExtentCursor<'a>,
    common: u64,
    longer: u64,
    /// The side holding the tail past `common`.
    tail: Side,
    pos: u64,
    chunk: u64,
}

impl Planner<'_> {
    fn next(&mut self) -> std::result::Result<Option<Work>, (Side, endpoint::Error)> {
        let pos = self.pos;
        let w = if pos < self.common {
            let (za, ea) = self.a.run_at(pos).map_err(|e| (Side::A, e))?;
            let (zb, eb) = self.b.run_at(pos).map_err(|e| (Side::B, e))?;
            let end = ea.min(eb).min(self.common);
            match (za, zb) {
                // Whole: a hole's cost must not grow with its size.
                (true, true) => Work::Skip { len: end - pos },
                (true, false) => Work::Zero {
                    side: Side::B,
                    offset: pos,
                    len: chunk_len(pos, end, self.chunk),
                },
                (false, true) => Work::Zero {
                    side: Side::A,
                    offset: pos,
                    len: chunk_len(pos, end, self.chunk),
                },
                (false, false) => Work::Both {
                    offset: pos,
                    len: chunk_len(pos, end, self.chunk),
                },
            }
        } else if pos < self.longer {
            let cur = match self.tail {
                Side::A => &mut self.a,
                Side::B => &mut self.b,
            };
            let (z, e) = cur.run_at(pos).map_err(|e| (self.tail, e))?;
            if z {
                Work::Skip { len: e - pos }
            } else {
                Work::Zero {
                    side: self.tail,
                    offset: pos,
                    len: chunk_len(pos, e, self.chunk),
                }
            }
        } else {
            return Ok(None);
        };
        self.pos += match w {
            Work::Skip { len } | Work::Both { len, .. } | Work::Zero { len, .. } => len,
        };
        Ok(Some(w))
    }
}

/// A read from `pos` up to `end`, at most one chunk: requests start where
/// runs start, as qemu-img's do, so the sector offsets reported agree.
fn chunk_len(pos: u64, end: u64, chunk: u64) -> u64 {
    (end - pos).min(chunk)
}

/// Opens both sides read-only and compares them. Errors name the side.
pub fn compare(
    a: &str,
    b: &str,
    opts: &CompareOptions,
    progress: &dyn Progress,
) -> Result<CompareReport, endpoint::Error> {
    let eo = |raw| EndpointOptions {
        writable: false,
        connections: opts.connections.max(1),
        raw,
        ..Default::default()
    };
    let ea = Endpoint::open_with(a, &eo(opts.raw_a))?;
    let eb = Endpoint::open_with(b, &eo(opts.raw_b))?;
    let r = compare_endpoints(&ea, &eb, opts, progress)?;
    ea.close()?;
    eb.close()?;
    Ok(r)
}

pub fn compare_endpoints(
    a: &Endpoint,
    b: &Endpoint,
    opts: &CompareOptions,
    progress: &dyn Progress,
) -> Result<CompareReport, endpoint::Error> {
    let t0 = Instant::now();
    let (size_a, size_b) = (a.size(), b.size());
    let (common, longer) = match opts.only_first {
        Some(n) => (size_a.min(size_b).min(n), size_a.min(size_b).min(n)),
        None => (size_a.min(size_b), size_a.max(size_b)),
    };
    let mut report = CompareReport {
        outcome: Outcome::Identical,
        filename_a: a.name(),
        filename_b: b.name(),
        size_a,
        size_b,
        first_byte: None,
        bytes_read: 0,
        bytes_skipped: 0,
        elapsed: Duration::ZERO,
    };
    if opts.strict && size_a != size_b {
        report.outcome = Outcome::SizeMismatch;
        report.elapsed = t0.elapsed();
        return Ok(report);
    }
    let align = a.min_block().max(b.min_block()).max(4096);
    let chunk = {
        let c = CHUNK.min(a.max_io()).min(b.max_io()).max(align);
        c - c % align
    };
    let planner = Mutex::new(Planner {
        a: ExtentCursor::new(a, size_a),
        b: ExtentCursor::new(b, size_b),
        common,
        longer,
        tail: if size_a > size_b { Side::A } else { Side::B },
        pos: 0,
        chunk,
    });
    // The lowest differing byte found so far, and (under the lock) what
    // qemu-img would report for it.
    let first_diff = AtomicU64::new(u64::MAX);
    let reported: Mutex<Option<(u64, u64)>> = Mutex::new(None);
    let failed = AtomicBool::new(false);
    let error: Mutex<Option<endpoint::Error>> = Mutex::new(None);
    let read = AtomicU64::new(0);
    let skipped = AtomicU64::new(0);
    let fail = |e: endpoint::Error| {
        failed.store(true, Ordering::SeqCst);
        error.lock().unwrap().get_or_insert(e);
    };
    let workers = scan::workers(opts.threads, a.is_nbd() || b.is_nbd());
    progress.start("compare", longer);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let mut ba = IoBuf::new(chunk as usize, align as usize);
                let mut bb = IoBuf::new(chunk as usize, align as usize);
                loop {
                    if failed.load(Ordering::SeqCst) {
                        break;
                    }
                    let w = {
                        let mut p = planner.lock().unwrap();
                        let pos = p.pos;
                        match p.next() {
                            // Nothing at or past a known difference matters.
                            Ok(Some(w)) if w.offset(pos) < first_diff.load(Ordering::SeqCst) => w,
                            Ok(_) => break,
                            Err((_, e)) => {
                                fail(e);
                                break;
                            }
                        }
                    };
                    let r = match w {
                        Work::Skip { len } => {
                            skipped.fetch_add(len, Ordering::Relaxed);
                            progress.advance(len);
                            Ok(None)
                        }
                        Work::Both { offset, len } => {
                            read.fetch_add(2 * len, Ordering::Relaxed);
                            compare_both(a, b, &mut ba, &mut bb, offset, len)
                        }
                        Work::Zero { side, offset, len } => {
                            read.fetch_add(len, Ordering::Relaxed);
                            let ep = if side == Side::A { a } else { b };
                            check_zero(ep, &mut ba, offset, len)
                        }
                    };
                    match r {
                        Ok(Some(d)) => {
                            let start = w.offset(0);
                            let words = start + (d - start) / SECTOR * SECTOR;
                            let mut g = reported.lock().unwrap();
                            if g.is_none_or(|(x, _)| d < x) {
                                *g = Some((d, words));
                            }
                            first_diff.fetch_min(d, Ordering::SeqCst);
                        }
                        Ok(None) => {
                            if let Work::Both { len, .. } | Work::Zero { len, .. } = w {
                                progress.advance(len);
                            }
                        }
                        Err(e) => {
                            fail(e);
                            break;
                        }
                    }
                }
            });
        }
    });
    progress.finish();
    if let Some(e) = error.into_inner().unwrap() {
        return Err(e);
    }
    if let Some((d, words)) = reported.into_inner().unwrap() {
        report.outcome = Outcome::Mismatch(words);
        report.first_byte = Some(d);
    }
    report.bytes_read = read.into_inner();
    report.bytes_skipped = skipped.into_inner();
    report.elapsed = t0.elapsed();
    Ok(report)
}

/// The first differing byte in `[offset, offset + len)`, if any.
pub(crate) fn compare_both(
    a: &Endpoint,
    b: &Endpoint,
    ba: &mut IoBuf,
    bb: &mut IoBuf,
    offset: u64,
    len: u64,
) -> Result<Option<u64>, endpoint::Error> {
    ba.set_len(len as usize);
    bb.set_len(len as usize);
    a.read_buf(ba, offset)?;
    b.read_buf(bb, offset)?;
    let (x, y) = (ba.as_slice(), bb.as_slice());
    if x == y {
        return Ok(None);
    }
    let i = x.iter().zip(y).position(|(p, q)| p != q).unwrap_or(0);
    Ok(Some(offset + i as u64))
}

/// The first non-zero byte in `[offset, offset + len)` of `ep`, if any.
fn check_zero(
    ep: &Endpoint,
    buf: &mut IoBuf,
    offset: u64,
    len: u64,
) -> Result<Option<u64>, endpoint::Error> {
    buf.set_len(len as usize);
    ep.read_buf(buf, offset)?;
    let s = buf.as_slice();
    if is_zero(s) {
        return Ok(None);
    }
    let i = s.iter().position(|&x| x != 0).unwrap_or(0);
    Ok(Some(offset + i as u64))
}
