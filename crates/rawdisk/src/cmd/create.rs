//! `rawdisk create [--preallocation off|falloc|full | -o preallocation=MODE]
//! [--force] [--zero]
//! [--cache writeback|none] TARGET SIZE`
//!
//! Prints one line on stdout when done (suppressed by `-q`), e.g.
//! `Created 'disk.img': raw, 6442450944 bytes (6 GiB), preallocation=falloc
//! (by fallocate) in 1.43 s`; where fallocate is unsupported it says so and
//! how much it wrote instead. Progress (bytes/s, ETA) goes to stderr while
//! data is written, only when stderr is a terminal.

use super::{CacheArg, FormatArg, OutputArg, PreallocArg};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use rawdisk_image::create::{create, CreateOptions};
use rawdisk_image::progress::Bar;

/// Create a raw image (or check, and with --zero zero, a block device).
///
/// On success prints one line on stdout saying what was done and which
/// method allocated the space (fallocate, or zeros written where fallocate
/// is unsupported). A failed create removes the file it created.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk create disk.img 10G\n  \
    rawdisk create --preallocation falloc vm.img 20G")]
pub struct Args {
    /// How to allocate the image's space [default: off].
    #[arg(long, value_enum)]
    preallocation: Option<PreallocArg>,
    /// Image options as qemu-img takes them: preallocation=off|falloc|full
    /// (the only option of a raw image).
    #[arg(short = 'o', value_name = "OPTIONS")]
    options: Vec<String>,
    /// Overwrite an existing file.
    #[arg(long)]
    force: bool,
    /// Block device: zero the whole device, the fastest way it allows
    /// (refused for a file, which reads as zeros when created).
    #[arg(long)]
    zero: bool,
    /// Page cache or O_DIRECT for the writes.
    #[arg(long, value_enum, default_value = "writeback")]
    cache: CacheArg,
    /// Keep a partially created file when creating fails.
    #[arg(long)]
    keep_on_error: bool,
    /// Image format, for qemu-img habits: only raw.
    #[arg(short = 'f', long = "format", value_enum, default_value = "raw")]
    _format: FormatArg,
    /// Print nothing on success and no progress.
    #[arg(short, long)]
    quiet: bool,
    /// The line on success, or a JSON object (docs/json.md).
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    /// File to create, or block device.
    target: PathBuf,
    /// Size, with qemu-img suffixes: 512, 64K, 10G, 1.5T.
    #[arg(allow_hyphen_values = true, value_parser = crate::size::size_arg)]
    size: u64,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let prealloc = super::prealloc_option(args.preallocation, &args.options)?;
    super::local_only(&args.target, "create")?;
    if args.zero {
        super::block_device_only(
            "--zero",
            &args.target,
            true,
            "a new image file reads as zeros without it",
        )?;
    }
    let opts = CreateOptions {
        path: args.target,
        size: args.size,
        prealloc: prealloc.into(),
        force: args.force,
        zero: args.zero,
        cache: args.cache.into(),
        keep_on_error: args.keep_on_error,
        cancel: Some(cancel_on_signal("; the image may be left partly created")?),
    };
    let bar = if args.quiet {
        Bar::hidden()
    } else {
        Bar::stderr()
    };
    let report = create(&opts, &bar)?;
    if !args.quiet {
        match args.output {
            OutputArg::Human => crate::out::println(report.summary())?,
            OutputArg::Json => crate::out::print(&report.to_json())?,
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A flag set on SIGINT or SIGTERM: the create stops at its next chunk and
/// removes what it wrote (instead of dying with a half-written image). A
/// second signal exits at once, leaving what `left` says.
pub(crate) fn cancel_on_signal(left: &'static str) -> anyhow::Result<Arc<AtomicBool>> {
    Ok(crate::signals::cancel_on_int_term(left)?.flag)
}
