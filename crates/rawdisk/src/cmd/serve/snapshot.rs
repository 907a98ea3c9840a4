//! `--snapshot` (qemu-nbd's `-s`): clients write to a private copy of the
//! target that no other process can open and that is gone when the server
//! exits, so the target itself never changes. rawdisk has no overlay
//! format; the copy is an unlinked file (O_TMPFILE) next to the target,
//! where the file system may share the target's blocks (reflink) or copy
//! them in the kernel (copy_file_range), else in $TMPDIR (/var/tmp, as
//! qemu), where the data is copied. Holes stay holes.

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use rawdisk_storage::{CacheMode, CopyOffload, ExtentKind, OpenOptions, Target};

/// Bytes read and written per call where no offload moves them.
const CHUNK: u64 = 1 << 20;
/// Extents asked for per lookup.
const RUNS: usize = 1024;

/// The target `path` names, copied into a private file; opened as `open`
/// says (writable).
pub(super) fn private_copy(path: &Path, open: &OpenOptions) -> anyhow::Result<Arc<Target>> {
    let what = || format!("--snapshot: cannot copy '{}'", path.display());
    let src = Target::open(
        path,
        &OpenOptions {
            read_only: true,
            cache: CacheMode::Writeback,
            ..Default::default()
        },
    )
    .with_context(what)?;
    let size = src.size();
    // Blocks are shared only between files: a device's copy goes to $TMPDIR
    // (not to /dev, which is memory).
    let near = src.kind() == rawdisk_storage::Kind::File;
    let (file, dir) = unlinked_file(path, near).with_context(what)?;
    file.set_len(size).with_context(what)?;
    // The file has no name: the kernel's link to the descriptor opens it.
    let fd_path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    let dst = Target::open(&fd_path, &OpenOptions::default()).with_context(what)?;
    let (mut shared, mut copied) = (0u64, 0u64);
    let mut pos = 0;
    while pos < size {
        let runs = src.extents(pos, size - pos, RUNS).with_context(what)?;
        let next = runs.last().map_or(pos, |l| l.offset + l.len);
        // No run, or none past `pos`: the rest would be served as zeros
        // whatever the target holds there.
        if next <= pos {
            bail!("{}: no extent found at offset {pos} of {size}", what());
        }
        for e in runs.iter().filter(|e| e.kind == ExtentKind::Data) {
            let moved = dst
                .copy_from(
                    &src,
                    e.offset,
                    e.len,
                    CopyOffload {
                        reflink: true,
                        copy_range: true,
                    },
                )
                .with_context(what)?;
            shared += moved.reflinked;
            copied += moved.copied;
            for (o, l) in moved.rest {
                copy_span(&src, &dst, o, l).with_context(what)?;
                copied += l;
            }
        }
        pos = next;
    }
    drop(dst);
    tracing::info!(
        "--snapshot: writes go to a private copy of '{}' in '{}' ({shared} bytes shared, \
         {copied} copied), discarded at exit",
        path.display(),
        dir.display()
    );
    let served = Target::open(&fd_path, open).with_context(what)?;
    // The served target holds its own descriptor of the file.
    drop(file);
    Ok(Arc::new(served))
}

/// `len` bytes at `offset`, read and written.
fn copy_span(src: &Target, dst: &Target, offset: u64, len: u64) -> rawdisk_storage::Result<()> {
    let mut buf = vec![0u8; CHUNK.min(len) as usize];
    let mut done = 0;
    while done < len {
        let n = CHUNK.min(len - done) as usize;
        src.read_at(&mut buf[..n], offset + done)?;
        dst.write_at(&buf[..n], offset + done, false)?;
        done += n as u64;
    }
    Ok(())
}

/// A new file without a name (O_TMPFILE, mode 0600): in the target's
/// directory (`near`), where its blocks may be shared, else in $TMPDIR or
/// /var/tmp.
fn unlinked_file(path: &Path, near: bool) -> anyhow::Result<(fs::File, PathBuf)> {
    let beside = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = std::env::var_os("TMPDIR")
        .filter(|t| !t.is_empty())
        .map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from);
    let mut last = None;
    let dirs = if near { vec![beside, tmp] } else { vec![tmp] };
    for dir in dirs {
        match fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_TMPFILE)
            .mode(0o600)
            .open(&dir)
        {
            Ok(f) => return Ok((f, dir)),
            Err(e) => last = Some((dir, e)),
        }
    }
    match last {
        Some((dir, e)) => {
            Err(e).with_context(|| format!("cannot make a temporary file in '{}'", dir.display()))
        }
        None => bail!("no directory for a temporary file"),
    }
}
