//! `rawdisk probe [--output human|json] [--destructive] TARGET`

use std::path::PathBuf;
use std::process::ExitCode;

use rawdisk_image::probe::{probe, ProbeOptions};

use super::OutputArg;

/// Report what the storage under a file or block device supports.
///
/// For a file, each method is tried on a scratch file created beside it
/// (removed after); the file itself is not changed. For a block device only
/// sysfs and ioctls are read, unless --destructive.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk probe disk.img\n  \
    rawdisk probe --output json /dev/vg0/lv0")]
pub struct Args {
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    /// Block device: try each method on the device itself (its first
    /// megabytes are saved and written back; refused while it is mounted,
    /// and for a file, which is always probed on a scratch file).
    #[arg(long)]
    destructive: bool,
    /// File or block device.
    target: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    super::local_only(&args.target, "probe")?;
    if args.destructive {
        super::block_device_only(
            "--destructive",
            &args.target,
            false,
            "a file is probed on a scratch file beside it, and never changed",
        )?;
    }
    let r = probe(&ProbeOptions {
        path: args.target,
        destructive: args.destructive,
    })?;
    match args.output {
        OutputArg::Human => crate::out::print(&r.to_human())?,
        OutputArg::Json => crate::out::print(&r.to_json())?,
    }
    Ok(ExitCode::SUCCESS)
}
