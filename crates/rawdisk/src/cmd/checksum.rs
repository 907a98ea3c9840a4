//! `rawdisk checksum [--digest NAME] [--block-size 64K] [-p]
//! [--output human|json] TARGET|NBD-URI|-` and `rawdisk checksum
//! --list-digests`

use std::process::ExitCode;

use rawdisk_image::checksum::{self, ChecksumOptions, DigestAlg};
use rawdisk_image::progress::Bar;

use super::{FormatOpt, OutputArg};
use crate::size::size_arg;

/// A digest OpenSSL offers, by name (sha256, blake2b512, sha3-256...).
fn digest_arg(s: &str) -> Result<DigestAlg, String> {
    DigestAlg::from_name(s).ok_or_else(|| {
        format!("OpenSSL offers no digest named {s:?} (rawdisk checksum --list-digests)")
    })
}

/// Print the blkhash checksum (blksum's value) of a target or NBD export.
///
/// The value `blksum` and `nbdcopy --blkhash` print for the same content:
/// digest = H(H(block 1) || ... || H(block N) || size as 64-bit little
/// endian), blocks of --block-size bytes (the last one shorter). Holes and
/// zero extents are not read; blocks are hashed on all cores.
///
/// The format needs one digest per block, holes included, so the time grows
/// with the size, not the data: about 0.3 s of CPU per TiB of holes at 64K
/// blocks (a sparse 64 TiB file: 20 s of CPU; 8 EiB: weeks); -p shows the
/// progress and the ETA.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk checksum disk.img\n  \
    rawdisk checksum --digest blake2b512 nbd+unix:///?socket=/tmp/nbd.sock\n  \
    xzcat disk.img.xz | rawdisk checksum -")]
pub struct Args {
    /// Digest algorithm: any OpenSSL offers, by blksum's names (sha256,
    /// sha512, sha384, sha3-256, blake2b512, blake2s256, sha1, md5...).
    #[arg(short, long, default_value = "sha256", value_parser = digest_arg)]
    digest: DigestAlg,
    /// Print the digests this OpenSSL offers, one a line, and exit.
    #[arg(long, exclusive = true)]
    list_digests: bool,
    /// Bytes hashed per block; other values give other checksums.
    #[arg(long, default_value = "64K", allow_hyphen_values = true, value_parser = block_size)]
    block_size: u64,
    /// Progress bar with throughput and ETA (only when stderr is a terminal).
    #[arg(short, long)]
    progress: bool,
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    #[command(flatten)]
    format: FormatOpt,
    /// File, block device, NBD URI (nbd://host/export,
    /// nbd+unix:///export?socket=PATH) or `-` (standard input, read to its
    /// end). Printed as given.
    #[arg(required_unless_present = "list_digests")]
    target: Option<String>,
}

fn block_size(s: &str) -> Result<u64, String> {
    let v = size_arg(s)?;
    checksum::check_block_size(v)?;
    Ok(v)
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let Some(target) = a.target else {
        let names: String = DigestAlg::available()
            .iter()
            .map(|d| format!("{}\n", d.name()))
            .collect();
        crate::out::print(&names)?;
        return Ok(ExitCode::SUCCESS);
    };
    let opts = ChecksumOptions {
        digest: a.digest,
        block_size: a.block_size,
        raw: a.format.raw(),
        ..Default::default()
    };
    let bar = if a.progress {
        Bar::stderr()
    } else {
        Bar::hidden()
    };
    let r = checksum::checksum(&target, &opts, &bar)?;
    match a.output {
        OutputArg::Human => crate::out::print(&r.to_human())?,
        OutputArg::Json => crate::out::print(&r.to_json())?,
    }
    Ok(ExitCode::SUCCESS)
}
