//! `rawdisk map [--output human|json] [-f raw] [--start-offset OFFSET]
//! [--max-length LENGTH] TARGET|NBD-URI`

use std::process::ExitCode;

use rawdisk_image::map;

use super::{FormatOpt, OutputArg};
use crate::size::size_arg;

/// Print the allocation map of a target or NBD export, as `qemu-img map`
/// does.
///
/// JSON: the keys and merging of `qemu-img map --output=json`. Human: the
/// data runs in qemu-img's table.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk map disk.img\n  \
    rawdisk map --output json --start-offset 1G --max-length 64M disk.img\n  \
    rawdisk map nbd+unix:///?socket=/tmp/disk.sock")]
pub struct Args {
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    #[command(flatten)]
    format: FormatOpt,
    /// Map from this byte offset on (qemu-img suffixes).
    #[arg(long, value_name = "OFFSET", allow_hyphen_values = true, value_parser = size_arg)]
    start_offset: Option<u64>,
    /// Map at most this many bytes (qemu-img suffixes).
    #[arg(long, value_name = "LENGTH", allow_hyphen_values = true, value_parser = size_arg)]
    max_length: Option<u64>,
    /// File, block device, or NBD URI (nbd://host/export, nbd+unix:///export?socket=PATH).
    target: String,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let mut entries = map::map_target_or_uri(&args.target, args.format.raw())?;
    if args.start_offset.is_some() || args.max_length.is_some() {
        let start = args.start_offset.unwrap_or(0);
        let end = start.saturating_add(args.max_length.unwrap_or(u64::MAX));
        entries = clip(&entries, start, end);
    }
    match args.output {
        OutputArg::Human => print!("{}", map::to_human(&entries, &args.target)),
        OutputArg::Json => print!("{}", map::to_json(&entries)),
    }
    Ok(ExitCode::SUCCESS)
}

/// The runs inside [start, end), cut at both ends as qemu-img cuts them: the
/// first run starts at `start`, its file offset moved by the same amount.
fn clip(entries: &[map::MapEntry], start: u64, end: u64) -> Vec<map::MapEntry> {
    let out: Vec<map::MapEntry> = entries
        .iter()
        .filter(|e| e.end() > start && e.start < end)
        .map(|e| {
            let s = e.start.max(start);
            let mut c = *e;
            c.offset = e.offset.map(|o| o + (s - e.start));
            c.start = s;
            c.length = e.end().min(end) - s;
            c
        })
        .collect();
    if !out.is_empty() {
        return out;
    }
    // An empty range (past the end, or --max-length 0): qemu-img prints one
    // empty run, not present, at the start offset.
    vec![map::MapEntry {
        start,
        length: 0,
        depth: 0,
        present: false,
        zero: false,
        data: false,
        compressed: false,
        offset: None,
    }]
}
