//! `rawdisk info [--output human|json] [-f raw] TARGET|NBD-URI`,
//! `rawdisk info --list NBD-URI`, `rawdisk info --size|--can FLAG|--is FLAG
//! TARGET|NBD-URI`, `rawdisk info --map[=CONTEXT] NBD-URI`

use std::process::ExitCode;

use rawdisk_image::info;

use super::{FormatOpt, OutputArg};

/// Print size, allocation and properties of a target or NBD export.
///
/// As `qemu-img info` does, plus the kind, sector sizes and I/O hints; for
/// an NBD URI the export's flags and block sizes, as nbdinfo shows them.
/// With --list, the exports an NBD server offers and their sizes, as
/// `nbdinfo --list` and `qemu-nbd -L`. --size, --can, --is and --map
/// answer one question each, as nbdinfo's do; the human output says
/// whether the connection used TLS (JSON: "TLS").
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk info disk.img\n  \
    rawdisk info --output json nbd://server/vm\n  \
    rawdisk info --list nbd+unix:///?socket=/tmp/disk.sock\n  \
    rawdisk info --can trim nbd://server/vm && echo trims\n  \
    rawdisk info --map=rawdisk:changed:monday nbd://server/vm")]
pub struct Args {
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    /// Reported either way: info reads any image as raw and says what else
    /// it looks like (looks-like: qcow2).
    #[command(flatten)]
    _format: FormatOpt,
    /// List the exports of the NBD server TARGET names (its export name is
    /// not used), with their sizes and descriptions.
    #[arg(short = 'L', long, conflicts_with_all = ["size", "can", "is", "map"])]
    list: bool,
    /// Print only the size in bytes.
    #[arg(long, conflicts_with_all = ["can", "is", "map"])]
    size: bool,
    /// Print nothing; exit 0 if the export can FLAG, 2 if it cannot (1 on
    /// an error): block-status, cache, connect, df, extended-headers,
    /// fast-zero, flush, fua, multi-conn, read, structured-reply, trim,
    /// write, zero. As nbdinfo --can.
    #[arg(long, value_name = "FLAG", conflicts_with_all = ["is", "map"])]
    can: Option<String>,
    /// Print nothing; exit 0 if the export is FLAG, 2 if not (1 on an
    /// error): read-only, rotational, tls. As nbdinfo --is.
    #[arg(long, value_name = "FLAG", conflicts_with = "map")]
    is: Option<String>,
    /// Print the runs of a metadata context of an NBD export (default
    /// base:allocation; rawdisk:changed:NAME for a checkpoint), as nbdinfo
    /// --map: start, length, the context's flags, their meaning.
    #[arg(long, value_name = "CONTEXT", num_args = 0..=1, require_equals = true,
          default_missing_value = "base:allocation")]
    map: Option<String>,
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
    if let Some(context) = &args.map {
        if !rawdisk_image::endpoint::is_nbd(&args.target) {
            return Err(super::UsageError(format!(
                "--map needs an NBD URI, not '{}' (a file's map: rawdisk map) (see 'rawdisk info --help')",
                args.target
            ))
            .into());
        }
        use rawdisk_image::context_map;
        let runs = context_map::context_runs(&args.target, context)?;
        crate::out::print(&match args.output {
            OutputArg::Human => context_map::to_text(context, &runs),
            OutputArg::Json => context_map::to_json(context, &runs),
        })?;
        return Ok(ExitCode::SUCCESS);
    }
    let i = info::info_target_or_uri(&args.target)?;
    if args.size {
        crate::out::println(i.virtual_size)?;
        return Ok(ExitCode::SUCCESS);
    }
    let question = match (&args.can, &args.is) {
        (Some(f), _) => Some((false, f)),
        (None, Some(f)) => Some((true, f)),
        (None, None) => None,
    };
    if let Some((is, flag)) = question {
        // nbdinfo's answer: 0 true, 2 false, 1 (an error) otherwise.
        return Ok(match i.test_flag(is, flag)? {
            true => ExitCode::SUCCESS,
            false => ExitCode::from(2),
        });
    }
    match args.output {
        OutputArg::Human => crate::out::print(&i.to_human())?,
        OutputArg::Json => crate::out::print(&i.to_json())?,
    }
    Ok(ExitCode::SUCCESS)
}
