//! `rawdisk info [--output human|json] [-f raw] TARGET|NBD-URI`,
//! `rawdisk info --list NBD-URI`

use std::process::ExitCode;

use rawdisk_image::info;

use super::{FormatOpt, OutputArg};

/// Print size, allocation and properties of a target or NBD export.
///
/// As `qemu-img info` does, plus the kind, sector sizes and I/O hints; for
/// an NBD URI the export's flags and block sizes, as nbdinfo shows them.
/// With --list, the exports an NBD server offers and their sizes, as
/// `nbdinfo --list` and `qemu-nbd -L`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk info disk.img\n  \
    rawdisk info --output json nbd://server/vm\n  \
    rawdisk info --list nbd+unix:///?socket=/tmp/disk.sock")]
pub struct Args {
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    /// Reported either way: info reads any image as raw and says what else
    /// it looks like (looks-like: qcow2).
    #[command(flatten)]
    _format: FormatOpt,
    /// List the exports of the NBD server TARGET names (its export name is
    /// not used), with their sizes and descriptions.
    #[arg(short = 'L', long)]
    list: bool,
    /// File, block device, or NBD URI.
    target: String,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.list {
        if !rawdisk_image::endpoint::is_nbd(&args.target) {
            return Err(super::UsageError(format!(
                "--list needs an NBD URI, not '{}' (nbd://HOST[:PORT] or nbd+unix:///?socket=PATH) (see 'rawdisk info --help')",
                args.target
            ))
            .into());
        }
        let l = info::list_nbd(&args.target)?;
        match args.output {
            OutputArg::Human => crate::out::print(&l.to_human())?,
            OutputArg::Json => crate::out::print(&l.to_json())?,
        }
        return Ok(ExitCode::SUCCESS);
    }
    let i = info::info_target_or_uri(&args.target)?;
    match args.output {
        OutputArg::Human => crate::out::print(&i.to_human())?,
        OutputArg::Json => crate::out::print(&i.to_json())?,
    }
    Ok(ExitCode::SUCCESS)
}
