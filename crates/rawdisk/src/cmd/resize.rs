//! `rawdisk resize [--preallocation off|falloc|full] [--shrink] [--force]
//! TARGET [+|-]SIZE`

use std::process::ExitCode;

use rawdisk_image::progress::Bar;
use rawdisk_image::resize::{self, ResizeOptions, SizeSpec};

use super::{CacheArg, FormatOpt, OutputArg, PreallocArg};
use crate::size::parse_size;

/// Grow or shrink an image file, as `qemu-img resize` does.
///
/// SIZE is absolute (10G) or relative (+2G, -512M). Growing preallocates
/// only the new tail, as `create` would; bytes below the old size are never
/// touched, and a failure (no space left) restores the old size. Shrinking
/// needs --shrink: the data past the new end is lost. A block device cannot
/// be resized: asking for its current size succeeds, anything else fails. A
/// running `rawdisk serve` may keep the file open: its existing connections
/// keep the old size, new connections see the new one.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk resize disk.img +10G\n  \
    rawdisk resize --preallocation falloc disk.img 64G\n  \
    rawdisk resize --shrink disk.img -512M")]
pub struct Args {
    /// How to allocate the new tail when growing (shrinking takes off).
    #[arg(long, value_enum, default_value = "off")]
    preallocation: PreallocArg,
    /// Allow shrinking; the data past the new end is lost.
    #[arg(long)]
    shrink: bool,
    /// Resize a file that looks like another image format (qcow2, vmdk...)
    /// as raw anyway.
    #[arg(long)]
    force: bool,
    /// -f raw: the file is raw, whatever it looks like (as --force).
    #[command(flatten)]
    format: FormatOpt,
    /// Page cache or O_DIRECT for the writes of --preallocation full.
    #[arg(long, value_enum, default_value = "writeback")]
    cache: CacheArg,
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    /// Print nothing on success and no progress.
    #[arg(short, long)]
    quiet: bool,
    /// File (or block device, which is only checked).
    target: std::path::PathBuf,
    /// New size (10G), or a change of size (+2G, -512M); qemu-img suffixes.
    #[arg(allow_hyphen_values = true, value_parser = size_spec)]
    size: SizeSpec,
}

fn size_spec(s: &str) -> Result<SizeSpec, String> {
    if let Some(r) = s.strip_prefix('+') {
        parse_size(r).map(SizeSpec::Grow)
    } else if let Some(r) = s.strip_prefix('-') {
        parse_size(r).map(SizeSpec::Shrink)
    } else {
        parse_size(s).map(SizeSpec::Absolute)
    }
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    super::local_only(&a.target, "resize")?;
    let opts = ResizeOptions {
        path: a.target,
        size: a.size,
        prealloc: a.preallocation.into(),
        shrink: a.shrink,
        force: a.force || a.format.raw(),
        cache: a.cache.into(),
        cancel: Some(super::create::cancel_on_signal(
            "; the image may be left partly grown",
        )?),
    };
    let bar = if a.quiet {
        Bar::hidden()
    } else {
        Bar::stderr()
    };
    let r = resize::resize(&opts, &bar)?;
    match a.output {
        OutputArg::Json => crate::out::print(&r.to_json())?,
        OutputArg::Human if !a.quiet => crate::out::println(r.summary())?,
        OutputArg::Human => {}
    }
    Ok(ExitCode::SUCCESS)
}
