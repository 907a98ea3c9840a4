//! `copy --changed-since NAME`: an incremental backup. Only the ranges that
//! changed since checkpoint NAME are read from the source and written to
//! the destination, the previous backup of the same disk; the rest of the
//! destination is not touched.
//!
//! The ranges come from the source's server when it is an NBD export (the
//! metadata context `rawdisk:changed:NAME` of `serve --track-changes`, flag
//! bit 0 = changed), else from the target's state file (which refuses while
//! a server tracks the target: that server holds changes not yet in it).
//! They are all known before the copy starts, so the copy is the usual one
//! restricted to them: zero runs inside them become zero requests, data is
//! read and written in requests, on several workers and connections.

use std::path::Path;

use rawdisk_storage::cbt::{Chain, StateFile};

use super::record::Source;
use super::{CopyError, CopyOptions, CopyStats, Result, Side, ZeroMode};
use crate::endpoint::{self, Endpoint};

/// (offset, length) ranges in offset order.
type Ranges = Vec<(u64, u64)>;

/// Block status flag of a `rawdisk:changed:` context: changed since the
/// checkpoint.
const CHANGED: u64 = 1;

/// Both sides of an incremental copy, open, and what to copy.
pub struct Incremental {
    pub src: Endpoint,
    pub dst: Endpoint,
    /// (offset, length) ranges changed since the checkpoint, in offset order.
    pub ranges: Vec<(u64, u64)>,
    /// Set when everything counts as changed: why this is a full copy.
    pub warning: Option<String>,
    /// The source's identity and checkpoints when the ranges were read;
    /// None when it does not tell them (a server that lists no checkpoint
    /// identities, a state file not written yet).
    pub source: Option<Source>,
}

impl Incremental {
    /// Bytes in the changed ranges.
    pub fn changed(&self) -> u64 {
        self.ranges.iter().map(|r| r.1).sum()
    }

    /// Whether every byte is copied: then the destination's earlier
    /// contents do not matter.
    pub fn whole(&self) -> bool {
        let size = self.src.size();
        size == 0 || self.ranges == [(0, size)]
    }
}

/// The metadata context of checkpoint `name`.
pub fn context_name(name: &str) -> String {
    format!("rawdisk:changed:{name}")
}

/// Opens the source, learns what changed since `checkpoint` (through its
/// NBD export, or its state file in `state_dir` for a local source) and
/// opens the destination, which must exist with the source's size (a block
/// device may be larger).
pub fn open_changed(
    source: &str,
    destination: &str,
    checkpoint: &str,
    state_dir: Option<&Path>,
    opts: &CopyOptions,
) -> Result<Incremental> {
    if opts.zero_mode == ZeroMode::Skip {
        return Err(CopyError::Setup(
            "--changed-since copies onto a previous backup, which does not read as zeros".into(),
        ));
    }
    // The identities are learnt before the ranges are read: the newest
    // checkpoint then is one every later change is recorded after.
    let (src, mut ranges, inconsistent, ids) = if endpoint::is_nbd(source) {
        let context = context_name(checkpoint);
        let mut eopts = opts.endpoint_options(false);
        eopts.extra_contexts = vec![context.clone()];
        let src = super::retry::open(source, &eopts, Side::Source, opts.retry_timeout)
            .map_err(CopyError::io(Side::Source))?;
        let ids = listed_source(&src);
        let ranges = nbd_ranges(&src, &context).map_err(CopyError::io(Side::Source))?;
        (src, ranges, None, ids)
    } else {
        let (ranges, inconsistent, chain) = state_ranges(source, checkpoint, state_dir)?;
        let src = super::open_source(source, opts)?;
        (src, ranges, inconsistent, Source::from_chain(&chain))
    };
    let size = src.size();
    let ids = ids.map(|s| Source { size, ..s });
    // The state file covers the size it recorded; a target resized since
    // is refused below (the backup's size differs), but never read past.
    ranges.retain(|r| r.0 < size);
    if let Some(last) = ranges.last_mut() {
        last.1 = last.1.min(size - last.0);
    }
    if !endpoint::is_nbd(source) && !endpoint::is_nbd(destination) {
        super::open::refuse_same_file(source, destination)?;
    }
    let dst = open_existing(destination, size, opts)?;
    let whole = size > 0 && ranges == [(0, size)];
    let warning = match inconsistent {
        Some(reason) => Some(format!(
            "checkpoint {checkpoint} is inconsistent ({reason}): every byte counts as changed, this is a full copy"
        )),
        None if whole => Some(format!(
            "every byte of {source} is reported changed since checkpoint {checkpoint}: this is a full copy \
             (the checkpoint is inconsistent after a crash or a change made without tracking, or the whole disk was written)"
        )),
        None => None,
    };
    Ok(Incremental {
        src,
        dst,
        ranges,
        warning,
        source: ids,
    })
}

/// What an NBD source listed of its checkpoints' identities.
pub(super) fn listed_source(src: &Endpoint) -> Option<Source> {
    let info = src.nbd_info()?;
    Source::from_listed(&info.listed_contexts, src.size())
}

/// The identity of a full copy's source, read before its data: the local
/// target's state file (`state_dir` as for `checkpoint`), or what its NBD
/// server listed. None for an untracked source; a state file that cannot
/// be read is said and counts as none (the copy itself does not need it).
pub fn source_identity(src: &Endpoint, spec: &str, state_dir: Option<&Path>) -> Option<Source> {
    if src.is_nbd() {
        return listed_source(src);
    }
    let path = Path::new(spec);
    let state = rawdisk_storage::cbt::state_path(path, state_dir).ok()?;
    if std::fs::symlink_metadata(&state).is_err() {
        return None;
    }
    let chain = StateFile::open(path, state_dir, false).and_then(|s| s.chain());
    match chain {
        Ok(c) => Source::from_chain(&c).map(|s| Source {
            size: src.size(),
            ..s
        }),
        Err(e) => {
            tracing::warn!("{e}: the copy records no backup identity");
            None
        }
    }
}

/// Copies the changed ranges of `inc.src` onto `inc.dst` and flushes it.
pub fn copy_changed(inc: &Incremental, opts: &CopyOptions) -> Result<CopyStats> {
    super::run(
        &inc.src,
        super::To::Ep(&inc.dst),
        opts,
        false,
        Some(&inc.ranges),
    )
}

/// The changed ranges the source's server reports, merged.
fn nbd_ranges(src: &Endpoint, context: &str) -> endpoint::Result<Vec<(u64, u64)>> {
    let size = src.size();
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut pos = 0;
    while pos < size {
        let runs = src.context_status(context, pos, size - pos)?;
        if runs.is_empty() {
            return Err(endpoint::Error {
                endpoint: src.name(),
                message: format!("block status of {context} at offset {pos}: no extents"),
                errno: None,
                nbd: None,
            });
        }
        for (o, l, flags) in runs {
            if flags & CHANGED != 0 {
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == o => last.1 += l,
                    _ => out.push((o, l)),
                }
            }
            pos = o + l;
        }
    }
    Ok(out)
}

/// The changed ranges in a local target's state file, and why the
/// checkpoint is inconsistent if it is.
fn state_ranges(
    source: &str,
    checkpoint: &str,
    state_dir: Option<&Path>,
) -> Result<(Ranges, Option<String>, Chain)> {
    let setup = |e: rawdisk_storage::cbt::CbtError| CopyError::Setup(e.to_string());
    let state = StateFile::open(Path::new(source), state_dir, false).map_err(setup)?;
    // It refuses while served, and names the checkpoints there are. Says
    // nothing itself: the copy's warning is the one line about it.
    state.changes_and_chain(checkpoint).map_err(setup)
}

/// Opens the destination of an incremental copy: it must exist (it is the
/// previous backup) and hold exactly the source's size (a block device may
/// be larger: volumes are rounded up to their extent size).
fn open_existing(spec: &str, size: u64, opts: &CopyOptions) -> Result<Endpoint> {
    let eopts = opts.endpoint_options(true);
    let io = CopyError::io(Side::Destination);
    let ep = if endpoint::is_nbd(spec) {
        super::retry::open(spec, &eopts, Side::Destination, opts.retry_timeout).map_err(&io)?
    } else {
        if std::fs::symlink_metadata(spec).is_err() {
            return Err(CopyError::Setup(format!(
                "destination {spec} does not exist: --changed-since updates the previous backup \
                 (make a full copy first)"
            )));
        }
        Endpoint::open_local(Path::new(spec), &eopts, false).map_err(&io)?
    };
    let dsize = ep.size();
    if dsize != size && !(ep.is_block_device() && dsize > size) {
        let _ = ep.close();
        return Err(CopyError::Setup(format!(
            "destination {spec} is {dsize} bytes, the source {size}: --changed-since updates \
             the previous backup of the same disk, which has its size"
        )));
    }
    Ok(ep)
}
