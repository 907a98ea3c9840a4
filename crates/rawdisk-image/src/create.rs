//! `rawdisk create`: a new raw image with preallocation, or a block device
//! checked (and, with `--zero`, zeroed) for use as one.
//!
//! Preallocation modes, as `qemu-img create -o preallocation=`:
//! * `off`: ftruncate; the image is sparse.
//! * `falloc`: fallocate(0). Where the file system has no fallocate (ramfs;
//!   NFS v3 in the field) it falls back to `full`, never to glibc's
//!   posix_fallocate emulation, which writes one byte per 4 KiB block and is
//!   far slower than writing zeros (docs/capabilities.md, glibc
//!   posix_fallocate emulation).
//! * `full`: ftruncate to the final size first (so the file system can
//!   allocate in large pieces), then write zeros in large chunks, then one
//!   flush.
//!
//! Every step that writes data reports through [`Progress`]. A failed create
//! removes the file it created (or truncated with `--force`) unless
//! `keep_on_error` is set.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rawdisk_storage::{CacheMode, Kind, Method, OpenOptions, Prealloc, Target, ZeroFlags};

use crate::error::{Error, Result};
use crate::output::human_size;
use crate::progress::Progress;

#[derive(Debug, Clone)]
pub struct CreateOptions {
    pub path: PathBuf,
    pub size: u64,
    pub prealloc: Prealloc,
    /// Overwrite an existing regular file.
    pub force: bool,
    /// On a block device: zero the whole device.
    pub zero: bool,
    pub cache: CacheMode,
    /// Keep a partial file when creating it fails.
    pub keep_on_error: bool,
    /// Set (by a signal handler) to stop at the next chunk: the create then
    /// fails as interrupted and cleans up like any other failure.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl CreateOptions {
    pub fn new(path: impl Into<PathBuf>, size: u64, prealloc: Prealloc) -> CreateOptions {
        CreateOptions {
            path: path.into(),
            size,
            prealloc,
            force: false,
            zero: false,
            cache: CacheMode::Writeback,
            keep_on_error: false,
            cancel: None,
        }
    }
}

/// What `create` did.
#[derive(Debug, Clone)]
pub struct CreateReport {
    pub path: PathBuf,
    pub kind: Kind,
    /// The requested size.
    pub size: u64,
    /// A block device's own size.
    pub device_size: Option<u64>,
    pub prealloc: Prealloc,
    /// What allocated the space: `Fallocate`, or `WriteZeros` for `full` and
    /// for `falloc` where fallocate is not supported. None for `off` and for
    /// block devices.
    pub method: Option<Method>,
    /// `falloc` was asked for and fallocate is not supported here.
    pub fell_back: bool,
    /// `--zero` on a block device: the methods the engine used.
    pub zeroed_with: Option<Vec<Method>>,
    /// Bytes of zeros written by `full` (or the `falloc` fallback).
    pub bytes_written: u64,
    /// An existing file was overwritten (`--force`).
    pub replaced: bool,
    pub elapsed: Duration,
}

pub fn prealloc_name(p: Prealloc) -> &'static str {
    match p {
        Prealloc::Off => "off",
        Prealloc::Falloc => "falloc",
        Prealloc::Full => "full",
    }
}

impl CreateReport {
    /// The one line `rawdisk create` prints on success.
    pub fn summary(&self) -> String {
        let secs = self.elapsed.as_secs_f64();
        let size = format!("{} bytes ({})", self.size, human_size(self.size));
        match self.kind {
            Kind::Block => {
                let dev = self.device_size.unwrap_or(self.size);
                let what = match &self.zeroed_with {
                    Some(m) => format!(
                        "zeroed all {} by {} in {secs:.2} s",
                        human_size(dev),
                        method_list(m)
                    ),
                    None => "nothing written (--zero zeroes the whole device)".into(),
                };
                format!(
                    "Block device '{}' ({}): {size} fit; {what}",
                    self.path.display(),
                    human_size(dev)
                )
            }
            Kind::File => {
                let how = match (self.prealloc, self.method, self.fell_back) {
                    (Prealloc::Off, _, _) => "sparse".to_string(),
                    (Prealloc::Falloc, _, true) => format!(
                        "fallocate not supported here, wrote {} of zeros instead",
                        human_size(self.bytes_written)
                    ),
                    (_, Some(Method::WriteZeros), _) => {
                        format!("wrote {} of zeros", human_size(self.bytes_written))
                    }
                    (_, Some(m), _) => format!("by {m}"),
                    (_, None, _) => "nothing to allocate".to_string(),
                };
                format!(
                    "{} '{}': raw, {size}, preallocation={} ({how}) in {secs:.2} s",
                    if self.replaced { "Replaced" } else { "Created" },
                    self.path.display(),
                    prealloc_name(self.prealloc),
                )
            }
        }
    }
}

impl CreateReport {
    /// `create --output json` (docs/json.md).
    pub fn to_json(&self) -> String {
        let mut v = serde_json::json!({
            "filename": self.path.display().to_string(),
            "kind": match self.kind {
                Kind::File => "file",
                Kind::Block => "block",
            },
            "virtual-size": self.size,
            "preallocation": prealloc_name(self.prealloc),
            "fell-back": self.fell_back,
            "bytes-written": self.bytes_written,
            "replaced": self.replaced,
            "elapsed-seconds": crate::output::secs(self.elapsed),
        });
        if let Some(m) = self.method {
            v["method"] = m.name().into();
        }
        if let Some(d) = self.device_size {
            v["device-size"] = d.into();
        }
        if let Some(m) = &self.zeroed_with {
            v["zeroed-with"] = m.iter().map(|m| m.name()).collect::<Vec<_>>().into();
        }
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
    }
}

fn method_list(m: &[Method]) -> String {
    if m.is_empty() {
        "nothing (empty device)".into()
    } else {
        m.iter().map(|m| m.name()).collect::<Vec<_>>().join(" + ")
    }
}

/// Removes the file on drop unless disarmed: a failed create leaves nothing.
struct RemoveOnDrop<'a> {
    path: &'a Path,
    armed: bool,
}

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = fs::remove_file(self.path) {
                tracing::warn!("could not remove partial '{}': {e}", self.path.display());
            }
        }
    }
}

pub fn create(opts: &CreateOptions, progress: &dyn Progress) -> Result<CreateReport> {
    let path = &opts.path;
    let shown = path.display();
    match fs::metadata(path) {
        Ok(md) => {
            use std::os::unix::fs::FileTypeExt;
            let ft = md.file_type();
            if ft.is_block_device() {
                return create_on_device(opts, progress);
            }
            if !ft.is_file() {
                return Err(Error::msg(format!(
                    "cannot create '{shown}': it exists and is not a regular file or block device"
                )));
            }
            if !opts.force {
                return Err(Error::msg(format!(
                    "'{shown}' already exists (use --force to overwrite it)"
                )));
            }
            create_file(opts, progress, true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => create_file(opts, progress, false),
        Err(e) => Err(Error::with(format!("cannot create '{shown}'"), e)),
    }
}

fn create_file(
    opts: &CreateOptions,
    progress: &dyn Progress,
    existing: bool,
) -> Result<CreateReport> {
    let path = &opts.path;
    let shown = path.display();
    let t0 = Instant::now();
    {
        // O_EXCL for a new file: a file that appears between the check above
        // and here is not overwritten without --force.
        let mut o = fs::OpenOptions::new();
        o.write(true);
        if existing {
            o.truncate(true);
        } else {
            o.create_new(true);
        }
        o.open(path).map_err(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                Error::msg(format!(
                    "'{shown}' already exists (use --force to overwrite it)"
                ))
            } else {
                Error::with(format!("cannot create '{shown}'"), e)
            }
        })?;
    }
    let mut guard = RemoveOnDrop {
        path,
        armed: !opts.keep_on_error,
    };
    let note = || {
        if opts.keep_on_error {
            format!("kept the partial file '{shown}' (--keep-on-error)")
        } else {
            format!("removed '{shown}'")
        }
    };
    let t = Target::open(
        path,
        &OpenOptions {
            read_only: false,
            cache: opts.cache,
            ..Default::default()
        },
    )
    .map_err(|e| Error::with(format!("cannot open '{shown}'"), e).note(note()))?;
    if t.kind() != Kind::File {
        return Err(Error::msg(format!("'{shown}' is not a regular file")).note(note()));
    }
    let what = format!(
        "cannot create '{shown}' ({}, preallocation={})",
        human_size(opts.size),
        prealloc_name(opts.prealloc)
    );
    let (method, fell_back, written) =
        preallocate(&t, opts, progress).map_err(|e| Error::with(what.clone(), e).note(note()))?;
    drop(t);
    guard.armed = false;
    Ok(CreateReport {
        path: path.clone(),
        kind: Kind::File,
        size: opts.size,
        device_size: None,
        prealloc: opts.prealloc,
        method,
        fell_back,
        zeroed_with: None,
        bytes_written: written,
        replaced: existing,
        elapsed: t0.elapsed(),
    })
}

/// First `falloc` step: small, so that where fallocate is not supported the
/// engine's own fallback writes only this much without progress; the rest
/// is written here, with progress.
const FALLOC_TRIAL: u64 = 16 << 20;
/// `falloc` steps after the trial: tmpfs clears every page it allocates,
/// which takes seconds at these sizes, so show progress.
const FALLOC_STEP: u64 = 1 << 30;
/// Zeros per write: large enough that syscalls cost nothing, small enough to
/// stay in cache (docs/benchmarks.md, Preallocation).
const WRITE_CHUNK: usize = 4 << 20;
/// Zero requests on a block device: the engine caps a syscall at ~1 GiB, and
/// this is also the progress granularity.
const ZERO_STEP: u64 = 1 << 30;

type StorageResult<T> = std::result::Result<T, rawdisk_storage::Error>;

/// EINTR-like error for a create stopped by the user at `off`.
fn check_cancel(
    cancel: Option<&AtomicBool>,
    op: &'static str,
    off: u64,
    len: u64,
) -> StorageResult<()> {
    match cancel {
        Some(c) if c.load(Ordering::Relaxed) => Err(rawdisk_storage::Error::new(
            op,
            off,
            len,
            io::Error::new(io::ErrorKind::Interrupted, "interrupted by a signal"),
        )),
        _ => Ok(()),
    }
}

/// Growing a file from `from` (its current size) to `size` with one
/// preallocation mode: the engine `create` (from 0) and `resize` share.
/// Bytes below `from` are never written.
pub(crate) struct Grow<'a> {
    pub from: u64,
    pub size: u64,
    pub prealloc: Prealloc,
    pub cancel: Option<&'a AtomicBool>,
}

/// Returns (method, fell back, bytes written).
fn preallocate(
    t: &Target,
    opts: &CreateOptions,
    progress: &dyn Progress,
) -> StorageResult<(Option<Method>, bool, u64)> {
    grow(
        t,
        &Grow {
            from: 0,
            size: opts.size,
            prealloc: opts.prealloc,
            cancel: opts.cancel.as_deref(),
        },
        progress,
    )
}

/// Returns (method, fell back, bytes written).
pub(crate) fn grow(
    t: &Target,
    g: &Grow<'_>,
    progress: &dyn Progress,
) -> StorageResult<(Option<Method>, bool, u64)> {
    let (from, size) = (g.from, g.size);
    match g.prealloc {
        Prealloc::Off => {
            let r = t.preallocate(size, Prealloc::Off)?;
            Ok((r.method, false, 0))
        }
        Prealloc::Full => {
            let written = write_zeros_from(t, g, from, progress)?;
            Ok((Some(Method::WriteZeros), false, written))
        }
        Prealloc::Falloc => {
            if size <= from {
                t.preallocate(size, Prealloc::Off)?;
                return Ok((None, false, 0));
            }
            let first = from + (size - from).min(FALLOC_TRIAL);
            let r = t.preallocate(first, Prealloc::Falloc)?;
            if r.method == Some(Method::WriteZeros) {
                // No fallocate here: the engine wrote the trial step; write
                // the rest as `full` does.
                let rest = write_zeros_from(t, g, first, progress)?;
                return Ok((Some(Method::WriteZeros), true, first - from + rest));
            }
            if first < size {
                progress.start("allocating", size - from);
                progress.advance(first - from);
                let mut end = first;
                let res = (|| {
                    while end < size {
                        check_cancel(g.cancel, "preallocate (fallocate)", end, size - end)?;
                        let next = (end + FALLOC_STEP).min(size);
                        let r = t.preallocate(next, Prealloc::Falloc)?;
                        progress.advance(next - end);
                        end = next;
                        if r.method == Some(Method::WriteZeros) {
                            // The engine learned half way that fallocate does
                            // not work and wrote this step itself.
                            return Ok(true);
                        }
                    }
                    Ok(false)
                })();
                progress.finish();
                if res? {
                    let rest = write_zeros_from(t, g, end, progress)?;
                    return Ok((Some(Method::WriteZeros), true, rest));
                }
            }
            Ok((r.method.or(Some(Method::Fallocate)), false, 0))
        }
    }
}

/// `full` from `from`: set the final size first, write zeros over
/// [from, size), flush. Returns the bytes written.
fn write_zeros_from(
    t: &Target,
    g: &Grow<'_>,
    from: u64,
    progress: &dyn Progress,
) -> StorageResult<u64> {
    let size = g.size;
    // Knowing the final size up front lets the file system allocate in large
    // extents instead of growing the file write by write.
    t.preallocate(size, Prealloc::Off)?;
    if from >= size {
        t.flush()?;
        return Ok(0);
    }
    // Allocated zeroed and never written, so every page of it is the
    // kernel's shared zero page: the copy source stays in cache, and under
    // cache=none it is aligned as O_DIRECT needs (the engine handles an
    // unaligned tail).
    let buf = t.aligned_buffer(WRITE_CHUNK);
    progress.start("writing zeros", size - from);
    let res = (|| {
        let mut off = from;
        while off < size {
            check_cancel(g.cancel, "preallocate (write zeros)", off, size - off)?;
            let n = (size - off).min(WRITE_CHUNK as u64) as usize;
            t.write_at(&buf[..n], off, false)?;
            progress.advance(n as u64);
            off += n as u64;
        }
        t.flush()
    })();
    progress.finish();
    res?;
    Ok(size - from)
}

fn create_on_device(opts: &CreateOptions, progress: &dyn Progress) -> Result<CreateReport> {
    let path = &opts.path;
    let shown = path.display();
    let t0 = Instant::now();
    let t = Target::open(
        path,
        &OpenOptions {
            read_only: !opts.zero,
            cache: opts.cache,
            ..Default::default()
        },
    )
    .map_err(|e| Error::with(format!("cannot open '{shown}'"), e))?;
    let dev = t.size();
    if opts.size > dev {
        return Err(Error::msg(format!(
            "'{shown}' is a block device of {dev} bytes ({}): {} bytes ({}) do not fit",
            human_size(dev),
            opts.size,
            human_size(opts.size)
        )));
    }
    let zeroed_with = if opts.zero {
        let mut methods: Vec<Method> = Vec::new();
        progress.start("zeroing", dev);
        let res = (|| {
            let mut off = 0;
            while off < dev {
                check_cancel(opts.cancel.as_deref(), "zero", off, dev - off)?;
                let n = (dev - off).min(ZERO_STEP);
                let out = t.zero(
                    off,
                    n,
                    ZeroFlags {
                        may_trim: true,
                        fast_only: false,
                    },
                )?;
                for m in out.methods {
                    if !methods.contains(&m) {
                        methods.push(m);
                    }
                }
                progress.advance(n);
                off += n;
            }
            t.flush()
        })();
        progress.finish();
        res.map_err(|e| Error::with(format!("cannot zero '{shown}'"), e))?;
        Some(methods)
    } else {
        None
    };
    Ok(CreateReport {
        path: path.clone(),
        kind: Kind::Block,
        size: opts.size,
        device_size: Some(dev),
        prealloc: opts.prealloc,
        method: None,
        fell_back: false,
        zeroed_with,
        bytes_written: 0,
        replaced: false,
        elapsed: t0.elapsed(),
    })
}
