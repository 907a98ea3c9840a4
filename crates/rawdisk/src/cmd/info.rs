//! `rawdisk info [--output human|json] TARGET|NBD-URI`

use std::process::ExitCode;

use rawdisk_image::info;

use super::{FormatArg, OutputArg};

/// Print size, allocation and properties, as `qemu-img info` does (plus
/// kind, sector sizes and I/O hints; for an NBD URI the export's flags and
/// block sizes, as nbdinfo shows them).
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk info disk.img\n  \
    rawdisk info --output json nbd://server/vm")]
pub struct Args {
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    /// Image format, for qemu-img habits: only raw.
    #[arg(short = 'f', long = "format", value_enum, default_value = "raw")]
    _format: FormatArg,
    /// File, block device, or NBD URI.
    target: String,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let i = info::info_target_or_uri(&args.target)?;
    match args.output {
        OutputArg::Human => print!("{}", i.to_human()),
        OutputArg::Json => print!("{}", i.to_json()),
    }
    Ok(ExitCode::SUCCESS)
}
