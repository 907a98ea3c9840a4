//! `rawdisk resize`: grow or shrink a raw image file, as `qemu-img resize`.
//!
//! - Growing preallocates only the new tail `[old size, new size)` with the
//!   engine `create` uses (`off`: sparse, and the first block of a file grown
//!   from 0 written; `falloc`: fallocate(), writing zeros where the file
//!   system has none; `full`: zeros written, then flushed). Bytes below the
//!   old size are never written. If growing fails (ENOSPC half way) the old
//!   size is restored and the error says how far it got.
//! - Shrinking needs `shrink` (the data past the new end is lost, and the
//!   report says how much of it was allocated) and only `off`, as qemu-img.
//! - Block devices cannot be resized here: asking for their current size
//!   succeeds, anything else fails naming the device's size.
//! - A file that looks like another image format (`rawdisk_storage::format`:
//!   qcow2, VMDK, VHD...) is refused unless `force`: resizing such a file as
//!   raw corrupts it.
//!
//! A running `rawdisk serve` may have the file open: existing connections
//! keep the size they were given at the handshake, new connections see the
//! new size.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rawdisk_storage::{CacheMode, ExtentKind, Kind, Method, OpenOptions, Prealloc, Target};
use serde::Serialize;

use crate::create::{grow, prealloc_name, Grow};
use crate::error::{Error, Result};
use crate::output::{human_size, serialize_secs};
use crate::progress::Progress;

/// The size argument: absolute, or relative to the current size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeSpec {
    Absolute(u64),
    Grow(u64),
    Shrink(u64),
}

impl SizeSpec {
    /// The new size for a target of `old` bytes.
    pub fn resolve(self, old: u64) -> std::result::Result<u64, String> {
        match self {
            SizeSpec::Absolute(n) => Ok(n),
            SizeSpec::Grow(n) => old
                .checked_add(n)
                .filter(|v| *v <= i64::MAX as u64)
                .ok_or_else(|| format!("{old} + {n} bytes is too large")),
            SizeSpec::Shrink(n) => old.checked_sub(n).ok_or_else(|| {
                format!(
                    "cannot shrink by {n} bytes ({}): the image is only {old} bytes",
                    human_size(n)
                )
            }),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ResizeOptions {
    pub path: PathBuf,
    pub size: SizeSpec,
    pub prealloc: Prealloc,
    /// Allow shrinking (data past the new end is lost).
    pub shrink: bool,
    /// Resize a file that looks like another image format.
    pub force: bool,
    pub cache: CacheMode,
    /// Set (by a signal handler) to stop growing at the next chunk; the old
    /// size is then restored.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl ResizeOptions {
    pub fn new(path: impl Into<PathBuf>, size: SizeSpec) -> ResizeOptions {
        ResizeOptions {
            path: path.into(),
            size,
            prealloc: Prealloc::Off,
            shrink: false,
            force: false,
            cache: CacheMode::Writeback,
            cancel: None,
        }
    }
}

/// What `resize` did.
#[derive(Debug, Clone, Serialize)]
pub struct ResizeReport {
    pub filename: String,
    /// "file" or "block".
    pub kind: &'static str,
    #[serde(rename = "old-virtual-size")]
    pub old_size: u64,
    /// The size now, under the key every command uses for a target's size.
    #[serde(rename = "virtual-size")]
    pub new_size: u64,
    pub preallocation: &'static str,
    /// What allocated the new tail: "fallocate" or "write-zeros".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub method: Option<&'static str>,
    /// `falloc` asked for where fallocate is not supported.
    #[serde(rename = "fell-back")]
    pub fell_back: bool,
    #[serde(rename = "bytes-written")]
    pub bytes_written: u64,
    /// Shrinking: bytes of allocated data that were past the new end.
    #[serde(rename = "data-discarded", skip_serializing_if = "Option::is_none")]
    pub data_discarded: Option<u64>,
    #[serde(rename = "elapsed-seconds", serialize_with = "serialize_secs")]
    pub elapsed: Duration,
}

impl ResizeReport {
    /// The one line printed on success.
    pub fn summary(&self) -> String {
        let sz = |n: u64| format!("{n} bytes ({})", human_size(n));
        let what = if self.new_size == self.old_size {
            format!(
                "Size of '{}' unchanged: {}",
                self.filename,
                sz(self.new_size)
            )
        } else if self.new_size > self.old_size {
            let how = match (self.method, self.fell_back) {
                (_, true) => format!(
                    "fallocate not supported here, wrote {} of zeros instead",
                    human_size(self.bytes_written)
                ),
                (Some("write-zeros"), _) => {
                    format!("wrote {} of zeros", human_size(self.bytes_written))
                }
                (Some(m), _) => format!("by {m}"),
                (None, _) => "sparse".into(),
            };
            format!(
                "Grew '{}' from {} to {}, preallocation={} ({how})",
                self.filename,
                sz(self.old_size),
                sz(self.new_size),
                self.preallocation
            )
        } else {
            format!(
                "Shrank '{}' from {} to {}; the {} past the new end are gone ({} of it allocated)",
                self.filename,
                sz(self.old_size),
                sz(self.new_size),
                human_size(self.old_size - self.new_size),
                human_size(self.data_discarded.unwrap_or(0))
            )
        };
        format!("{what} in {:.2} s", self.elapsed.as_secs_f64())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }
}

/// Resizes the file or checks the block device at `opts.path`.
pub fn resize(opts: &ResizeOptions, progress: &dyn Progress) -> Result<ResizeReport> {
    let path = &opts.path;
    let shown = path.display();
    let md =
        std::fs::metadata(path).map_err(|e| Error::with(format!("cannot resize '{shown}'"), e))?;
    let ft = md.file_type();
    if !ft.is_file() && !ft.is_block_device() {
        return Err(Error::msg(format!(
            "cannot resize '{shown}': not a regular file or block device"
        )));
    }
    let t = Target::open(
        path,
        &OpenOptions {
            // A block device is only looked at.
            read_only: ft.is_block_device(),
            cache: opts.cache,
            ..Default::default()
        },
    )
    .map_err(|e| Error::with(format!("cannot open '{shown}'"), e))?;
    resize_target(&t, opts, progress)
}

/// Resizes an open target (tests pass one whose syscalls fail on purpose).
pub fn resize_target(
    t: &Target,
    opts: &ResizeOptions,
    progress: &dyn Progress,
) -> Result<ResizeReport> {
    let t0 = Instant::now();
    let shown = opts.path.display();
    let old = t.size();
    let new = opts
        .size
        .resolve(old)
        .map_err(|m| Error::msg(format!("cannot resize '{shown}': {m}")))?;
    let mut report = ResizeReport {
        filename: shown.to_string(),
        kind: if t.kind() == Kind::Block {
            "block"
        } else {
            "file"
        },
        old_size: old,
        new_size: new,
        preallocation: prealloc_name(opts.prealloc),
        method: None,
        fell_back: false,
        bytes_written: 0,
        data_discarded: None,
        elapsed: Duration::ZERO,
    };
    if t.kind() == Kind::Block {
        if new != old {
            return Err(Error::msg(format!(
                "cannot resize '{shown}' to {new} bytes: it is a block device of {old} bytes ({}); \
                 rawdisk does not resize devices (use lvextend, losetup -c or the like)",
                human_size(old)
            )));
        }
        report.elapsed = t0.elapsed();
        return Ok(report);
    }
    if !opts.force {
        refuse_other_format(t, &opts.path)?;
    }
    if new < old {
        if !opts.shrink {
            return Err(Error::msg(format!(
                "'{shown}' is {old} bytes; shrinking it to {new} bytes loses the data past the new end (use --shrink to do so)"
            )));
        }
        if opts.prealloc != Prealloc::Off {
            return Err(Error::msg(format!(
                "cannot shrink '{shown}' with preallocation={}: shrinking takes preallocation=off",
                prealloc_name(opts.prealloc)
            )));
        }
        report.data_discarded = Some(allocated_in(t, new, old)?);
        set_len(&opts.path, new)
            .map_err(|e| Error::with(format!("cannot shrink '{shown}' to {new} bytes"), e))?;
    } else if new > old {
        let done = Counting {
            inner: progress,
            bytes: AtomicU64::new(0),
        };
        let g = Grow {
            from: old,
            size: new,
            prealloc: opts.prealloc,
            cancel: opts.cancel.as_deref(),
        };
        match grow(t, &g, &done) {
            Ok((method, fell_back, written)) => {
                report.method = method.map(method_name);
                report.fell_back = fell_back;
                report.bytes_written = written;
            }
            Err(e) => {
                let restored = match set_len(&opts.path, old) {
                    Ok(()) => format!("restored the old size, {old} bytes"),
                    Err(e2) => format!("could not restore the old size, {old} bytes: {e2}"),
                };
                let how_far = done.bytes.load(Ordering::Relaxed);
                return Err(Error::with(
                    format!(
                        "cannot grow '{shown}' from {old} to {new} bytes (preallocation={}) after {how_far} of {} bytes",
                        prealloc_name(opts.prealloc),
                        new - old
                    ),
                    e,
                )
                .note(restored));
            }
        }
    }
    report.elapsed = t0.elapsed();
    Ok(report)
}

fn method_name(m: Method) -> &'static str {
    match m {
        Method::WriteZeros => "write-zeros",
        _ => "fallocate",
    }
}

/// ftruncate through a new descriptor: the engine never shrinks a file.
fn set_len(path: &Path, len: u64) -> io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .set_len(len)
}

/// Bytes of data (not holes) in `[from, to)`.
fn allocated_in(t: &Target, from: u64, to: u64) -> Result<u64> {
    let mut pos = from;
    let mut data = 0;
    while pos < to {
        let v = t
            .extents(pos, to - pos, 4096)
            .map_err(|e| Error::with(format!("map '{}'", t.path().display()), e))?;
        let Some(last) = v.last() else { break };
        let end = last.offset + last.len;
        data += v
            .iter()
            .filter(|e| e.kind == ExtentKind::Data)
            .map(|e| e.len)
            .sum::<u64>();
        if end <= pos {
            break;
        }
        pos = end;
    }
    Ok(data)
}

/// Resizing another format's container as raw truncates or pads it and
/// breaks it.
fn refuse_other_format(t: &Target, path: &Path) -> Result<()> {
    let f = rawdisk_storage::format::probe_target(t)
        .map_err(|e| Error::with(format!("cannot read '{}'", path.display()), e))?;
    if let Some(name) = f {
        return Err(Error::msg(format!(
            "'{}' looks like a {name} image, not raw: resizing it as raw would corrupt it (use qemu-img resize, or --force to resize it as raw anyway)",
            path.display()
        )));
    }
    Ok(())
}

/// Passes progress on and counts the bytes done, for the error message.
struct Counting<'a> {
    inner: &'a dyn Progress,
    bytes: AtomicU64,
}

impl Progress for Counting<'_> {
    fn start(&self, what: &str, total: u64) {
        self.inner.start(what, total)
    }
    fn advance(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.inner.advance(bytes)
    }
    fn finish(&self) {
        self.inner.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::SizeSpec;

    #[test]
    fn relative_sizes() {
        assert_eq!(SizeSpec::Absolute(5).resolve(10), Ok(5));
        assert_eq!(SizeSpec::Grow(5).resolve(10), Ok(15));
        assert_eq!(SizeSpec::Shrink(5).resolve(10), Ok(5));
        assert!(SizeSpec::Shrink(11).resolve(10).is_err());
        assert!(SizeSpec::Grow(u64::MAX).resolve(1).is_err());
        assert!(SizeSpec::Grow(i64::MAX as u64).resolve(1).is_err());
    }
}
