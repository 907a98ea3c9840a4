//! `rawdisk compare [-s] [-p] [-q] [--output human|json] A B`
//!
//! Prints what `qemu-img compare` prints and exits as it does: 0 when the
//! images read the same, 1 when they differ, 2 on an error (one line on
//! stderr).

use std::process::ExitCode;

use rawdisk_image::compare::{self, CompareOptions};
use rawdisk_image::progress::Bar;

use super::{FormatArg, FormatOpt, OutputArg};

/// Compare two images (exit 0 identical, 1 different, 2 error).
///
/// As `qemu-img compare` does, for files, block devices or NBD URIs.
/// Exit status 0: identical; 1: different ("Content mismatch at offset N!",
/// N the first differing 512-byte sector); 2: error. When the sizes differ
/// the common part is compared and the longer image's tail must read as
/// zeros, unless --strict. Allocation is not compared: a hole and written
/// zeros are the same content.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk compare disk.img nbd://backup-host/disk\n  \
    rawdisk compare -s a.img /dev/vg/b\n  \
    rawdisk compare --output json a.img b.img")]
pub struct Args {
    /// Strict: images of different sizes differ.
    #[arg(short, long)]
    strict: bool,
    /// Progress bar with throughput and ETA (only when stderr is a terminal).
    #[arg(short, long)]
    progress: bool,
    /// Print nothing; the exit status says the result.
    #[arg(short, long)]
    quiet: bool,
    /// Output format; json prints the outcome, both sizes, the first
    /// differing byte and what was read (the exit status is the same).
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    /// The first image's format.
    #[command(flatten)]
    format: FormatOpt,
    /// The second image's format: only raw (as -f, for the second image).
    #[arg(short = 'F', long = "second-format", value_enum, value_name = "FORMAT")]
    second_format: Option<FormatArg>,
    /// First image: file, block device or NBD URI.
    a: String,
    /// Second image: file, block device or NBD URI.
    b: String,
}

/// Exit status for an error: 1 means "different" here, as in qemu-img.
const EXIT_ERROR: u8 = 2;

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let opts = CompareOptions {
        strict: a.strict,
        threads: 0,
        connections: 4,
        raw_a: a.format.raw(),
        raw_b: a.second_format.is_some(),
        ..Default::default()
    };
    let bar = if a.progress && !a.quiet {
        Bar::stderr()
    } else {
        Bar::hidden()
    };
    match compare::compare(&a.a, &a.b, &opts, &bar) {
        Ok(r) => {
            let text = match a.output {
                _ if a.quiet => String::new(),
                OutputArg::Human => r.to_human(),
                OutputArg::Json => r.to_json(),
            };
            // cmp's codes: a failed write is an error (2), not "different".
            if let Err(e) = crate::out::print(&text) {
                eprintln!("rawdisk: compare: {e}");
                return Ok(ExitCode::from(EXIT_ERROR));
            }
            Ok(ExitCode::from(r.exit_code()))
        }
        Err(e) => {
            eprintln!("rawdisk: compare: {e}");
            Ok(ExitCode::from(EXIT_ERROR))
        }
    }
}
