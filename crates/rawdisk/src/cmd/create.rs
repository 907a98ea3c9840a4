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
use std::sync::atomic::{AtomicBool, Ordering};
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
        cancel: Some(cancel_on_signal()),
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
/// removes what it wrote (instead of dying with a half-written image).
pub(crate) fn cancel_on_signal() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(_) => return flag,
    };
    // Register the handlers before returning, so a signal arriving right
    // after is already caught.
    let term = rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        (
            signal(SignalKind::interrupt()).ok(),
            signal(SignalKind::terminate()).ok(),
        )
    });
    std::thread::spawn(move || {
        rt.block_on(async move {
            let (mut int, mut term) = term;
            tokio::select! {
                _ = recv_or_never(int.as_mut()) => {}
                _ = recv_or_never(term.as_mut()) => {}
            }
        });
        f.store(true, Ordering::Relaxed);
    });
    flag
}

async fn recv_or_never(s: Option<&mut tokio::signal::unix::Signal>) {
    match s {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}
