//! `rawdisk checkpoint create [--name NAME] [--output human|json] [--state-dir DIR] TARGET`,
//! `rawdisk checkpoint list [--output human|json] [--state-dir DIR] TARGET`,
//! `rawdisk checkpoint delete --name NAME [--state-dir DIR] TARGET`

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use rawdisk_storage::cbt::{self, CheckpointInfo, StateFile};

use super::{OutputArg, UsageError};

/// Create, list or delete the checkpoints of a target's changed-block
/// tracking.
///
/// A checkpoint starts a new generation of the target's changed-block
/// state: `rawdisk serve --track-changes` then offers the NBD metadata
/// context `rawdisk:changed:NAME`, whose extents say which ranges changed
/// since the checkpoint, and `rawdisk copy --changed-since NAME` copies only
/// those. The state lives in TARGET.rawdisk-cbt next to a file, or with
/// --state-dir DIR in DIR (required for block devices). All three work while
/// a server tracks the target.
///
/// create [--name NAME] [--output human|json] [--state-dir DIR] TARGET: a
/// new checkpoint (NAME: 1 to 63 of A-Z a-z 0-9 . _ -, not starting with .
/// or -; default cp-N), printing its name (--output json: the checkpoint
/// as list prints it, with the target's filename).
///
/// list [--output human|json] [--state-dir DIR] TARGET: one line per
/// checkpoint, oldest first: name, creation time (UTC), its identity
/// `id=<source id>:<sequence>` (unique: a name can be used again after a
/// delete, an identity never), and `consistent` or `inconsistent (reason)`. An inconsistent checkpoint (after a crash of
/// the tracking server, or a change of the target while it was not
/// tracked) reports everything as changed; create a new one.
///
/// delete --name NAME [--state-dir DIR] TARGET: its changes are kept by the
/// checkpoint before it.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk checkpoint create --name monday disk.img\n  \
    rawdisk checkpoint list --output json disk.img\n  \
    rawdisk checkpoint delete --name monday disk.img\n  \
    rawdisk checkpoint create --state-dir /var/lib/rawdisk /dev/vg0/vm1")]
pub struct Args {
    #[command(subcommand)]
    action: Action,
}

#[derive(clap::Subcommand)]
enum Action {
    /// Create a checkpoint and print its name.
    #[command(after_help = "Examples:\n  \
        rawdisk checkpoint create --name monday disk.img\n  \
        rawdisk checkpoint create --state-dir /var/lib/rawdisk /dev/vg0/vm1")]
    Create {
        /// The checkpoint's name (default: cp-N, N one more than the highest).
        #[arg(long)]
        name: Option<String>,
        /// The name alone, or a JSON object (docs/json.md).
        #[arg(long, value_enum, default_value = "human")]
        output: OutputArg,
        #[command(flatten)]
        common: Common,
    },
    /// List the checkpoints, oldest first.
    #[command(after_help = "Examples:\n  \
        rawdisk checkpoint list disk.img\n  \
        rawdisk checkpoint list --output json disk.img")]
    List {
        #[arg(long, value_enum, default_value = "human")]
        output: OutputArg,
        #[command(flatten)]
        common: Common,
    },
    /// Delete a checkpoint; the one before it keeps its changes.
    #[command(after_help = "Example:\n  \
        rawdisk checkpoint delete --name monday disk.img")]
    Delete {
        /// The checkpoint to delete.
        #[arg(long)]
        name: String,
        #[command(flatten)]
        common: Common,
    },
}

#[derive(clap::Args)]
struct Common {
    /// Directory of the state file, named after TARGET's file name
    /// (required for block devices; default: next to TARGET).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// File or block device.
    target: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.action {
        Action::Create {
            name,
            output,
            common,
        } => {
            check_name(name.as_deref())?;
            let mut f = open(&common, true)?;
            let cp = f.create_checkpoint(name.as_deref())?;
            match output {
                OutputArg::Human => crate::out::println(&cp.name)?,
                OutputArg::Json => {
                    let mut v = checkpoint_json(&cp);
                    v["filename"] = common.target.display().to_string().into();
                    crate::out::println(serde_json::to_string_pretty(&v).unwrap_or_default())?;
                }
            }
        }
        Action::List { output, common } => {
            let cps = match state_exists(&common)? {
                true => open(&common, false)?.list()?,
                false => Vec::new(),
            };
            match output {
                OutputArg::Human => crate::out::print(&to_human(&cps))?,
                OutputArg::Json => crate::out::print(&to_json(&cps))?,
            }
        }
        Action::Delete { name, common } => {
            check_name(Some(&name))?;
            open(&common, false)?.delete_checkpoint(&name)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn open(c: &Common, create: bool) -> anyhow::Result<StateFile> {
    super::local_only(&c.target, "checkpoint")?;
    Ok(StateFile::open(&c.target, c.state_dir.as_deref(), create)?)
}

/// Whether the state file exists: a target never tracked lists no
/// checkpoints rather than failing.
fn state_exists(c: &Common) -> anyhow::Result<bool> {
    super::local_only(&c.target, "checkpoint")?;
    // Nothing to list is an answer only for a target that can be tracked,
    // in a state directory that exists.
    cbt::check_target(&c.target)?;
    if let Some(d) = &c.state_dir {
        if !d.is_dir() {
            anyhow::bail!(
                "list checkpoints of {}: state directory {} does not exist or is not a directory",
                c.target.display(),
                d.display()
            );
        }
    }
    let p = cbt::state_path(&c.target, c.state_dir.as_deref())?;
    // Not followed: a symlink there is refused by the open, not skipped.
    Ok(std::fs::symlink_metadata(Path::new(&p)).is_ok())
}

/// A malformed name is a bad command line (exit 2), said before any I/O.
fn check_name(name: Option<&str>) -> anyhow::Result<()> {
    match name {
        Some(n) if !cbt::valid_name(n) => Err(UsageError(format!(
            "invalid checkpoint name '{n}': use 1 to {} of A-Z a-z 0-9 . _ - (not starting \
             with . or -) (see 'rawdisk checkpoint --help')",
            cbt::MAX_NAME_LEN
        ))
        .into()),
        _ => Ok(()),
    }
}

fn state_text(c: &CheckpointInfo) -> String {
    match &c.reason {
        None => "consistent".to_string(),
        Some(r) => format!("inconsistent ({r})"),
    }
}

fn to_human(cps: &[CheckpointInfo]) -> String {
    let width = cps.iter().map(|c| c.name.len()).max().unwrap_or(0);
    cps.iter()
        .map(|c| {
            let (name, created, state) = (&c.name, utc(c.created), state_text(c));
            format!("{name:width$}  {created}  id={}  {state}\n", c.id)
        })
        .collect()
}

/// One checkpoint in the JSON of `list` and `create`: its time in RFC 3339,
/// as the human form prints it.
fn checkpoint_json(c: &CheckpointInfo) -> serde_json::Value {
    serde_json::json!({
        "name": c.name,
        "created": utc(c.created),
        "consistent": c.consistent,
        "reason": c.reason,
        "id": c.id,
    })
}

fn to_json(cps: &[CheckpointInfo]) -> String {
    let v: Vec<serde_json::Value> = cps.iter().map(checkpoint_json).collect();
    serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
}

/// Unix seconds as `YYYY-MM-DDTHH:MM:SSZ` (proleptic Gregorian, UTC).
pub(crate) fn utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days, shifted to the year starting in March.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(utc(4_107_542_399), "2100-02-28T23:59:59Z");
    }
}
