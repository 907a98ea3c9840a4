//! Opening the two sides of a copy: the source read-only, the destination
//! writable, a file destination created or resized to the source's size
//! (never cut short without `--force`), and the same file on both sides
//! refused.

use std::path::Path;

use super::{CopyError, CopyOptions, Result, Side};
use crate::endpoint::{self, Endpoint};

/// The destination and whether it is known to read as zeros (a file this
/// copy created, or grew from nothing).
pub struct Destination {
    pub endpoint: Endpoint,
    pub zeroed: bool,
}

/// Opens the source read-only and the destination writable, creating or
/// resizing a file destination to the source's size.
pub fn open_pair(
    source: &str,
    destination: &str,
    opts: &CopyOptions,
) -> Result<(Endpoint, Destination)> {
    open_pair_then(source, destination, opts, |_| Ok(()))
}

/// [`open_pair`], running `before` with the open source before the
/// destination is opened (created, resized): the last moment nothing of
/// the destination has changed yet.
pub fn open_pair_then(
    source: &str,
    destination: &str,
    opts: &CopyOptions,
    before: impl FnOnce(&Endpoint) -> Result<()>,
) -> Result<(Endpoint, Destination)> {
    let src = open_source(source, opts)?;
    if !endpoint::is_nbd(source) && !endpoint::is_nbd(destination) {
        refuse_same_file(source, destination)?;
    }
    before(&src)?;
    let dst = open_destination(destination, src.size(), opts)?;
    Ok((src, dst))
}

/// Opens the source read-only.
pub fn open_source(source: &str, opts: &CopyOptions) -> Result<Endpoint> {
    let eopts = opts.endpoint_options(false);
    super::retry::open(source, &eopts, Side::Source, opts.retry_timeout)
        .map_err(CopyError::io(Side::Source))
}

/// Opens (creating if needed) the destination for a source of `size` bytes.
/// A regular file is created or truncated/extended to `size` (with
/// `opts.preallocation`); a block device or NBD export must be at least
/// `size` bytes.
pub fn open_destination(spec: &str, size: u64, opts: &CopyOptions) -> Result<Destination> {
    let eopts = opts.endpoint_options(true);
    let io = CopyError::io(Side::Destination);
    if endpoint::is_nbd(spec) {
        let ep =
            super::retry::open(spec, &eopts, Side::Destination, opts.retry_timeout).map_err(&io)?;
        check_dest_size(&ep, size)?;
        return Ok(Destination {
            endpoint: ep,
            zeroed: false,
        });
    }
    let path = Path::new(spec);
    let meta = std::fs::metadata(path).ok();
    let is_file = meta.as_ref().map(|m| m.file_type().is_file());
    if let Some(m) = meta.as_ref().filter(|m| m.is_file() && m.len() > size) {
        if !opts.force {
            // As `create`: an existing image is only cut short on request.
            return Err(CopyError::Setup(format!(
                "destination {spec} is {} bytes, larger than the source ({size} bytes): \
                 refusing to truncate it (use --force)",
                m.len()
            )));
        }
    }
    if let Some(m) = meta.as_ref().filter(|m| m.is_file() && m.len() < size) {
        if opts.no_create {
            // As qemu-img convert -n: growing is creating what -n says exists.
            return Err(CopyError::Setup(format!(
                "destination {spec} is {} bytes, smaller than the source ({size} bytes): \
                 -n does not grow it",
                m.len()
            )));
        }
    }
    match is_file {
        Some(false) => {
            // Block device (or something the storage engine will refuse).
            let ep = Endpoint::open_local(path, &eopts, false).map_err(&io)?;
            check_dest_size(&ep, size)?;
            Ok(Destination {
                endpoint: ep,
                zeroed: false,
            })
        }
        existing => {
            let ep = Endpoint::open_local(path, &eopts, true).map_err(&io)?;
            let target = ep.target().expect("local").clone();
            let old = if existing.is_some() { target.size() } else { 0 };
            if old > size {
                // Shrink first: preallocation never shrinks, and the copy must
                // end with the source's size.
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .and_then(|f| f.set_len(size))
                    .map_err(|e| {
                        io(endpoint::Error {
                            endpoint: spec.to_string(),
                            errno: e.raw_os_error(),
                            message: format!("truncate to {size} bytes: {e}"),
                            nbd: None,
                        })
                    })?;
            }
            target.preallocate(size, opts.preallocation).map_err(|e| {
                io(endpoint::Error {
                    endpoint: spec.to_string(),
                    errno: e.errno(),
                    message: e.to_string(),
                    nbd: None,
                })
            })?;
            // A file that held nothing before reads as zeros everywhere, so
            // zero runs need no requests (unless they must be allocated).
            Ok(Destination {
                endpoint: ep,
                zeroed: old == 0,
            })
        }
    }
}

/// Two local paths naming the same file: resizing or writing the
/// destination would destroy the source.
pub(super) fn refuse_same_file(source: &str, destination: &str) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    if let (Ok(a), Ok(b)) = (std::fs::metadata(source), std::fs::metadata(destination)) {
        if (a.dev(), a.ino()) == (b.dev(), b.ino()) {
            return Err(CopyError::Setup(format!(
                "source {source} and destination {destination} are the same file"
            )));
        }
    }
    Ok(())
}

fn check_dest_size(ep: &Endpoint, size: u64) -> Result<()> {
    if ep.size() < size {
        return Err(CopyError::Setup(format!(
            "destination {} is {} bytes, smaller than the source ({size} bytes)",
            ep.name(),
            ep.size()
        )));
    }
    Ok(())
}
