//! `rawdisk map [--output human|json] TARGET|NBD-URI`

use std::process::ExitCode;

use rawdisk_image::map;

use super::OutputArg;

/// Print the allocation map, as `qemu-img map` does.
///
/// JSON: the keys and merging of `qemu-img map --output=json`. Human: the
/// data runs in qemu-img's table.
#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    /// File, block device, or NBD URI (nbd://host/export, nbd+unix:///export?socket=PATH).
    target: String,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let entries = map::map_target_or_uri(&args.target)?;
    match args.output {
        OutputArg::Human => print!("{}", map::to_human(&entries, &args.target)),
        OutputArg::Json => print!("{}", map::to_json(&entries)),
    }
    Ok(ExitCode::SUCCESS)
}
