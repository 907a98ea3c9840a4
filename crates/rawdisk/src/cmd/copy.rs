//! `rawdisk copy [options] SOURCE DESTINATION`
//!
//! Each side is a file, a block device or an NBD URI. Prints one summary
//! line on stdout when done (suppressed by `-q`): bytes read, written,
//! zeroed and skipped, time and throughput, and the bytes the kernel moved
//! (reflink, copy_file_range) when it did. Any error ends the copy with exit
//! status 1 and one line naming the side, the offset and the cause.

use super::{CacheArg, PreallocArg};
use std::process::ExitCode;

use rawdisk_image::copy::{self, CopyOptions, OffloadMode, ZeroMode};

use crate::size::size_arg;

/// Copy between files, block devices and NBD exports, sparse-aware and in
/// parallel (like `qemu-img convert -n` and `nbdcopy`).
#[derive(clap::Args)]
pub struct Args {
    /// File, block device or NBD URI (nbd://host[:port]/export,
    /// nbd+unix:///export?socket=PATH).
    source: String,
    /// File (created or resized to the source size), block device or NBD URI.
    destination: String,
    /// Progress bar with throughput and ETA (only when stderr is a terminal).
    #[arg(short, long)]
    progress: bool,
    /// Requests in flight [default: 16 when a side is NBD; between local
    /// files and devices one per CPU, 16 with --cache none].
    #[arg(short = 'm', long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    requests: Option<u32>,
    /// NBD connections per side when the server allows multi-conn.
    #[arg(short = 'C', long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    connections: u32,
    /// Bytes per read and write request, at most the NBD server's maximum
    /// [default: 2M].
    #[arg(long, value_parser = size_arg)]
    request_size: Option<u64>,
    /// Zero blocks of this size in the data become zero requests (0: off).
    #[arg(short = 'S', long = "sparse-size", default_value = "4K", value_parser = size_arg)]
    sparse_size: u64,
    /// Keep zeroed ranges allocated in the destination (NBD_CMD_FLAG_NO_HOLE).
    #[arg(long, conflicts_with = "target_is_zero")]
    allocated: bool,
    /// The destination already reads as zeros: skip zero runs entirely.
    #[arg(long)]
    target_is_zero: bool,
    /// Preallocation of a file destination that is created or grown.
    #[arg(long, value_enum, default_value = "off")]
    preallocation: PreallocArg,
    /// Do not flush the destination at the end.
    #[arg(long)]
    no_flush: bool,
    /// After the copy, compare both sides and fail on any difference.
    #[arg(long)]
    verify: bool,
    /// Page cache or O_DIRECT for local sides.
    #[arg(short = 't', long, value_enum, default_value = "writeback")]
    cache: CacheArg,
    /// Between local files, let the kernel copy data extents
    /// (FICLONERANGE, else copy_file_range) where the file systems allow.
    #[arg(long, value_enum, default_value = "auto")]
    copy_offload: OffloadArg,
    /// No summary line.
    #[arg(short, long)]
    quiet: bool,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    if let Some(r) = a.request_size {
        if r == 0 || r > 32 << 20 {
            anyhow::bail!("--request-size must be between 1 byte and 32M");
        }
    }
    let opts = CopyOptions {
        requests: a.requests.unwrap_or(0) as usize,
        connections: a.connections as usize,
        request_size: a.request_size.unwrap_or(0),
        sparse_size: a.sparse_size,
        zero_mode: if a.target_is_zero {
            ZeroMode::Skip
        } else if a.allocated {
            ZeroMode::Allocated
        } else {
            ZeroMode::MayTrim
        },
        preallocation: a.preallocation.into(),
        flush: !a.no_flush,
        cache: a.cache.into(),
        progress: a.progress,
        offload: match a.copy_offload {
            OffloadArg::Never => OffloadMode::Never,
            OffloadArg::Auto => OffloadMode::Auto,
        },
    };
    let (src, dst) = copy::open_pair(&a.source, &a.destination, &opts)?;
    let stats = copy::copy_endpoints(&src, &dst.endpoint, &opts, dst.zeroed)?;
    let verified = if a.verify {
        Some(copy::verify(&src, &dst.endpoint, &opts)?)
    } else {
        None
    };
    src.close().map_err(|e| anyhow::anyhow!("source {e}"))?;
    dst.endpoint
        .close()
        .map_err(|e| anyhow::anyhow!("destination {e}"))?;
    if !a.quiet {
        let secs = stats.elapsed.as_secs_f64();
        let mut line = format!(
            "copied {} in {:.2} s ({}/s): read {}, written {}, zeroed {}, skipped {}",
            human(stats.size),
            secs,
            human(stats.throughput() as u64),
            human(stats.bytes_read),
            human(stats.bytes_written),
            human(stats.bytes_zeroed),
            human(stats.bytes_skipped),
        );
        if stats.bytes_reflinked + stats.bytes_copy_range > 0 {
            line.push_str(&format!(
                "; offloaded: reflink {}, copy_file_range {}",
                human(stats.bytes_reflinked),
                human(stats.bytes_copy_range)
            ));
        }
        if let Some(v) = verified {
            line.push_str(&format!(
                "; verified: {} compared, {} known zero on both sides",
                human(v.bytes_compared),
                human(v.bytes_skipped)
            ));
        }
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `--copy-offload`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum OffloadArg {
    /// Always read and write.
    Never,
    /// Reflink, else copy_file_range, else read and write.
    Auto,
}

fn human(b: u64) -> String {
    const UNITS: [&str; 6] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if b < 1024 {
        return format!("{b} bytes");
    }
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}
