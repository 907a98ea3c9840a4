//! The single target: made by `--create`, then opened.

use std::fs;
use std::io;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use rawdisk_nbd::server::Window;
use rawdisk_storage::{CacheMode, OpenOptions, Prealloc, Target};

use super::args::Args;
use super::daemon::Cleanup;

/// Opens TARGET, made first by --create; errors say how to fix them.
pub(super) fn open_target(
    args: &Args,
    path: &Path,
    open: OpenOptions,
    cleanup: &mut Cleanup,
) -> anyhow::Result<Arc<Target>> {
    let created = match args.create {
        Some(size) => create_target(path, size, args.preallocation.into(), open.cache)?,
        None => false,
    };
    if created {
        // Removed again if serving fails before it starts.
        cleanup.created = Some(path.to_path_buf());
    }
    if args.snapshot && !args.read_only {
        return super::snapshot::private_copy(path, &open);
    }
    let opened = Target::open(path, &open);
    let target = match opened {
        Ok(t) => Arc::new(t),
        Err(e) => {
            let msg = rawdisk_image::endpoint::open_error_message(path, &e);
            // The path once: "cannot serve 'P': why", not "...: open P: why".
            let open = format!("open {}: ", path.display());
            let msg = msg.strip_prefix(&open).unwrap_or(&msg);
            // Opened for writing by default (qemu-nbd and nbdkit do the same):
            // a file the user may only read needs the flag, so say which. One
            // that cannot be read either would fail with it too: no advice.
            let denied = e
                .errno()
                .map(|n| std::io::Error::from_raw_os_error(n).kind());
            let hint = match denied {
                Some(
                    std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem,
                ) if !args.read_only && fs::File::open(path).is_ok() => {
                    "; it cannot be opened for writing: serve it with --read-only"
                }
                _ => "",
            };
            bail!("cannot serve '{}': {msg}{hint}", path.display());
        }
    };
    if let Some(size) = args.create {
        if !created && target.size() != size {
            bail!(
                "'{}' exists with size {} bytes, not the {size} bytes --create asks for",
                path.display(),
                target.size()
            );
        }
    }
    Ok(target)
}

/// --create: make the file if it does not exist. Returns whether it did.
pub(super) fn create_target(
    path: &Path,
    size: u64,
    mode: Prealloc,
    cache: CacheMode,
) -> anyhow::Result<bool> {
    match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
    {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("cannot create '{}'", path.display())),
    }
    let made = (|| -> anyhow::Result<()> {
        let t = Target::open(
            path,
            &OpenOptions {
                cache,
                ..Default::default()
            },
        )?;
        t.preallocate(size, mode)?;
        t.flush()?;
        Ok(())
    })();
    if let Err(e) = made {
        let _ = fs::remove_file(path);
        return Err(e)
            .with_context(|| format!("cannot create '{}' ({size} bytes)", path.display()));
    }
    tracing::info!("created '{}' ({size} bytes)", path.display());
    Ok(true)
}

/// The part of `target` served (--offset, --size), checked against its
/// size; under --cache none both on the direct I/O alignment, since an
/// unaligned edge would be read-modify-written with the bytes beside it.
pub(super) fn window(args: &Args, path: &Path, target: &Target) -> anyhow::Result<Window> {
    let offset = args.offset.unwrap_or(0);
    let total = target.size();
    let end = match args.size {
        Some(s) => offset.checked_add(s),
        None => Some(total),
    };
    match end {
        Some(end) if offset <= total && end <= total => {}
        _ => bail!(
            "cannot serve '{}': --offset {offset}{} reaches past its end ({total} bytes)",
            path.display(),
            args.size
                .map(|s| format!(" --size {s}"))
                .unwrap_or_default()
        ),
    }
    if target.cache_mode() == CacheMode::None {
        let g = target.geometry();
        let align = u64::from(g.dio_align.max(g.logical_sector).max(1));
        if !offset.is_multiple_of(align) || args.size.is_some_and(|s| !s.is_multiple_of(align)) {
            return Err(crate::cmd::UsageError(format!(
                "--offset and --size must be multiples of {align} with --cache none \
                 (the direct I/O alignment of '{}')",
                path.display()
            ))
            .into());
        }
    }
    Ok(Window {
        offset,
        size: args.size,
    })
}
