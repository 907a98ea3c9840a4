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
    rawdisk info --map=rawdisk:changed:monday nbd://server/vm\n  \
    rawdisk info --map --totals --json nbd://server/vm")]
pub struct Args {
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    /// --output json, as nbdinfo --json.
    #[arg(long)]
    json: bool,
    /// Add a `content:` line (JSON: "content") saying what the first bytes
    /// look like: another image format's name, else "data" (nbdinfo's
    /// --content; rawdisk's own probe, not file(1)). --no-content: without
    /// it, the default.
    #[arg(long, overrides_with = "no_content")]
    content: bool,
    #[arg(long, hide = true)]
    no_content: bool,
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
    /// an error): block-status, cache, connect, df, extended-headers (0
    /// only when negotiated), fast-zero, flush, fua, multi-conn, read,
    /// structured-reply, trim, write, zero. As nbdinfo --can, which like
    /// --is takes any of the names of both.
    #[arg(long, value_name = "FLAG", conflicts_with_all = ["is", "map"])]
    can: Option<String>,
    /// Print nothing; exit 0 if the export is FLAG, 2 if not (1 on an
    /// error): read-only (or readonly), rotational, tls. As nbdinfo --is.
    #[arg(long, value_name = "FLAG", conflicts_with = "map")]
    is: Option<String>,
    /// Print the runs of a metadata context of an NBD export (default
    /// base:allocation; rawdisk:changed:NAME for a checkpoint), as nbdinfo
    /// --map: start, length, the context's flags, their meaning.
    #[arg(long, value_name = "CONTEXT", num_args = 0..=1, require_equals = true,
          default_missing_value = "base:allocation")]
    map: Option<String>,
    /// With --map: the bytes of each type and their share of the export
    /// (size, percent, type, description), as nbdinfo --map --totals.
    #[arg(long, requires = "map")]
    totals: bool,
    /// File, block device, or NBD URI.
    target: String,
}

pub fn run(mut args: Args) -> anyhow::Result<ExitCode> {
    if args.json {
        args.output = OutputArg::Json;
    }
    // A name nbdinfo would not know is a bad command line: said before
    // connecting, with the names there are.
    if let Some(flag) = args.can.as_ref().or(args.is.as_ref()) {
        if !info::FLAGS.contains(&flag.as_str()) {
            let opt = if args.can.is_some() { "--can" } else { "--is" };
            return Err(super::UsageError(format!(
                "{opt}: unknown flag '{flag}' (one of: {}) (see 'rawdisk info --help')",
                info::FLAGS.join(", ")
            ))
            .into());
        }
    }
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
        crate::out::print(&match (args.output, args.totals) {
            (OutputArg::Human, false) => context_map::to_text(context, &runs),
            (OutputArg::Json, false) => context_map::to_json(context, &runs),
            (OutputArg::Human, true) => context_map::totals_to_text(context, &runs),
            (OutputArg::Json, true) => context_map::totals_to_json(context, &runs),
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
    let content = args.content.then(|| match i.looks_like {
        Some(f) => format!("{f} image"),
        None => "data".to_string(),
    });
    match (args.output, content) {
        (OutputArg::Human, None) => crate::out::print(&i.to_human())?,
        (OutputArg::Json, None) => crate::out::print(&i.to_json())?,
        (OutputArg::Human, Some(c)) => {
            crate::out::print(&(i.to_human() + &format!("content: {c}\n")))?
        }
        (OutputArg::Json, Some(c)) => crate::out::print(&with_content(&i.to_json(), c))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `--content --output json`: the key in the export's object (nbdinfo's
/// place), or at the top for a local target.
fn with_content(json: &str, content: String) -> String {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(json) else {
        return json.to_string();
    };
    let obj = match v.pointer_mut("/exports/0") {
        Some(e) => e,
        None => &mut v,
    };
    if let Some(o) = obj.as_object_mut() {
        o.insert("content".into(), content.into());
    }
    serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
}
