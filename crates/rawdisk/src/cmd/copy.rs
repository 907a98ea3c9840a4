//! `rawdisk copy [options] SOURCE DESTINATION`
//!
//! Each side is a file, a block device or an NBD URI; the source may also
//! be `-` (standard input, copy/from_stream.rs), the destination `null:` or
//! `-` (standard output), as with nbdcopy. Prints one
//! summary line on stdout (stderr when stdout is the destination) when done
//! (suppressed by `-q`): bytes read, written, zeroed and skipped, time and
//! throughput, and the bytes the kernel moved (reflink, copy_file_range)
//! when it did. Any error ends the copy with exit status 1 and one line
//! naming the side, the offset and the cause. SIGINT or SIGTERM stops it
//! after the requests in flight, with a line saying how far it got and exit
//! status 130 or 143. A reader of `-` that goes away (`| head -c 1M`) ends
//! it quietly with status 141, as SIGPIPE would.
//!
//! `--changed-since NAME` copies only the ranges changed since a checkpoint
//! onto the previous backup (an incremental backup; copy/changed.rs).

use super::{CacheArg, FormatArg, FormatOpt, OutputArg, PreallocArg};
use std::process::ExitCode;
use std::time::Duration;

use rawdisk_image::copy::record::{self, Record, Source};
use rawdisk_image::copy::{
    self, CopyError, CopyOptions, CopyStats, OffloadMode, Report, Side, VerifyStats, ZeroMode,
};
use rawdisk_image::endpoint::Endpoint;
use std::path::PathBuf;

use crate::out;
use crate::signals::{self, Cancel};
use crate::size::size_arg;

/// Copy between files, block devices and NBD exports.
///
/// Sparse-aware and in parallel, like `qemu-img convert -n` and `nbdcopy`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk copy -p fedora.img nbd+unix:///?socket=/tmp/disk.sock\n  \
    rawdisk copy nbd://server/vm backup.img\n  \
    rawdisk copy disk.img /dev/vg0/lv0\n  \
    rawdisk copy --changed-since c1 nbd+unix:///?socket=/run/vm.sock backup.img")]
pub struct Args {
    /// File, block device or NBD URI (nbd://host[:port]/export,
    /// nbd+unix:///export?socket=PATH), or `-`: standard input, read in
    /// order to its end (a file destination then holds just what it held;
    /// an existing one with data needs --force). A FIFO, socket or
    /// character device named by path is refused (its size is not known).
    source: String,
    /// File (created or resized to the source size), block device, NBD URI,
    /// `null:` (read the source, write nothing) or `-` (standard output).
    destination: String,
    /// Progress on stderr: a bar with throughput and ETA on a terminal,
    /// else a line every few seconds. --progress=FD writes "N/100" lines
    /// to the open descriptor FD instead, as nbdcopy.
    #[arg(
        short,
        long,
        value_name = "FD",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "-",
        value_parser = progress_arg
    )]
    progress: Option<Report>,
    /// Bytes of data per second at most, with size suffixes (10M: 10 MiB/s),
    /// for a copy that must not saturate a link (qemu-img convert -r).
    #[arg(short = 'r', long, value_name = "RATE", value_parser = rate_arg)]
    rate_limit: Option<u64>,
    /// Source format (the destination is not looked at: it is overwritten).
    #[command(flatten)]
    format: FormatOpt,
    /// Destination format, for qemu-img convert habits: only raw.
    #[arg(short = 'O', long = "output-format", value_enum, default_value = "raw")]
    _output_format: FormatArg,
    /// Requests in flight [default: 16 when a side is NBD; between local
    /// files and devices one per CPU, 16 with --cache none].
    #[arg(short = 'm', long, visible_short_alias = 'R', value_parser = clap::value_parser!(u32).range(1..=1024))]
    requests: Option<u32>,
    /// NBD connections per side when the server allows multi-conn
    /// [default: 4, at most one per CPU, as nbdcopy].
    #[arg(short = 'C', long, value_parser = clap::value_parser!(u32).range(1..=64))]
    connections: Option<u32>,
    /// Bytes per read and write request, at most the NBD server's maximum
    /// [default: 512K when a side is NBD, 2M between local files and devices].
    #[arg(long, allow_hyphen_values = true, value_parser = size_arg)]
    request_size: Option<u64>,
    /// Zero blocks of this size in the data become zero requests (0: off).
    #[arg(
        short = 'S',
        long = "sparse-size",
        default_value = "4K",
        allow_hyphen_values = true,
        value_parser = size_arg
    )]
    sparse_size: u64,
    /// Keep zeroed ranges allocated in the destination (NBD_CMD_FLAG_NO_HOLE).
    #[arg(long, conflicts_with = "target_is_zero")]
    allocated: bool,
    /// The destination already reads as zeros: skip zero runs entirely.
    #[arg(long, visible_alias = "destination-is-zero")]
    target_is_zero: bool,
    /// Preallocation of a file destination that is created or grown
    /// [default: off].
    #[arg(long, value_enum)]
    preallocation: Option<PreallocArg>,
    /// Destination options as qemu-img convert takes them:
    /// preallocation=off|falloc|full (the only option of a raw image).
    #[arg(short = 'o', value_name = "OPTIONS")]
    options: Vec<String>,
    /// The destination exists: do not create it (qemu-img convert -n); a
    /// missing file is an error instead of a new image.
    #[arg(short = 'n')]
    no_create: bool,
    /// Do not flush the destination at the end.
    #[arg(long)]
    no_flush: bool,
    /// Flush the destination at the end (the default; nbdcopy's spelling).
    #[arg(long, conflicts_with = "no_flush")]
    flush: bool,
    /// Accepted for qemu-img convert's habit: writes always go out of
    /// order (in parallel).
    #[arg(short = 'W')]
    _out_of_order: bool,
    /// One request at a time on one connection (nbdcopy's --synchronous):
    /// as -R 1 -C 1.
    #[arg(long, conflicts_with_all = ["requests", "connections"])]
    synchronous: bool,
    /// Do not ask the source for its extents: read all of it, zero blocks
    /// still found by --sparse-size (nbdcopy's --no-extents).
    #[arg(long)]
    no_extents: bool,
    /// Shrink an existing regular file that is larger than the source.
    #[arg(long)]
    force: bool,
    /// When an NBD connection drops, keep reconnecting for this long
    /// (120, 90s, 500ms, 2m; 0: fail at once).
    #[arg(long, default_value = "60s", value_parser = duration_arg)]
    retry_timeout: Duration,
    /// An NBD server that leaves requests unanswered this long (stopped,
    /// hung, a silent network) counts as a dropped connection, which
    /// --retry-timeout retries (a final flush that takes longer is sent
    /// again on a new connection); also bounds each connect and handshake
    /// (0: requests wait forever).
    #[arg(long, default_value = "60s", value_parser = duration_arg)]
    request_timeout: Duration,
    /// After the copy, compare the whole destination with the source (also
    /// after --changed-since; runs both sides report as holes or zeros are
    /// not read) and fail on any difference.
    #[arg(long)]
    verify: bool,
    /// Incremental backup: copy only the ranges changed since checkpoint
    /// NAME (`rawdisk checkpoint`) onto DESTINATION, the previous backup
    /// (existing, the source's size; the rest of it is left as it is). The
    /// source is a `serve --track-changes` export (rawdisk:changed:NAME) or
    /// the local target itself while it is not served. DESTINATION's backup
    /// record must say it holds this source at NAME or a newer checkpoint
    /// (docs/cbt.md, the chain rule), else nothing is written.
    #[arg(
        long,
        value_name = "NAME",
        conflicts_with_all = ["target_is_zero", "force", "preallocation", "options"]
    )]
    changed_since: Option<String>,
    /// The backup record of a block device or NBD destination (a file
    /// destination's is DEST.rawdisk-backup): what it holds, written after
    /// a copy from a tracked source, checked by --changed-since (which
    /// needs it for such a destination).
    #[arg(long, value_name = "FILE")]
    backup_record: Option<std::path::PathBuf>,
    /// DANGEROUS: with --changed-since, write onto DESTINATION whatever its
    /// backup record says (none, another source, an older checkpoint, an
    /// unfinished copy). If it does not hold this source at NAME or newer,
    /// the result is a silently wrong backup.
    #[arg(long, requires = "changed_since")]
    trust_destination: bool,
    /// With a local source: the directory of its state file (as given to
    /// `serve --track-changes` and `checkpoint`), for --changed-since and
    /// for the backup record of a full copy.
    #[arg(long, value_name = "DIR")]
    state_dir: Option<std::path::PathBuf>,
    /// Page cache or O_DIRECT for local sides.
    #[arg(short = 't', long, value_enum, default_value = "writeback")]
    cache: CacheArg,
    /// Between local files, let the kernel copy data extents
    /// (FICLONERANGE, else copy_file_range) where the file systems allow.
    #[arg(long, value_enum, default_value = "auto")]
    copy_offload: OffloadArg,
    /// No summary line.
    #[arg(short, long)]
    quiet: bool,
    /// The summary as a line, or as a JSON object (docs/json.md).
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    if let Some(r) = a.request_size {
        if r == 0 || r > 32 << 20 {
            anyhow::bail!("--request-size must be between 1 byte and 32M");
        }
    }
    let sink = matches!(a.destination.as_str(), "null:" | "-");
    let preallocation = super::prealloc_option(a.preallocation, &a.options)?;
    if a.no_create && !sink && !rawdisk_image::endpoint::is_nbd(&a.destination) {
        let d = std::path::Path::new(&a.destination);
        if let Err(e) = std::fs::symlink_metadata(d) {
            anyhow::bail!("destination {}: {e} (-n: it is not created)", a.destination);
        }
    }
    if a.verify && sink {
        anyhow::bail!(
            "--verify needs a destination that can be read back, not {}",
            a.destination
        );
    }
    if a.state_dir.is_some() && rawdisk_image::endpoint::is_nbd(&a.source) {
        return Err(super::UsageError(
            "--state-dir is for a local source: an NBD source's server keeps its own state".into(),
        )
        .into());
    }
    if a.backup_record.is_some() && sink {
        return Err(super::UsageError(format!(
            "--backup-record records what a destination holds, and {} holds nothing",
            a.destination
        ))
        .into());
    }
    if a.changed_since.is_some() {
        if sink {
            return Err(super::UsageError(format!(
                "--changed-since updates a previous backup, not {}",
                a.destination
            ))
            .into());
        }
        if record::path_for(&a.destination, a.backup_record.as_deref()).is_none() {
            return Err(super::UsageError(format!(
                "--changed-since onto {} (a block device or NBD export) needs --backup-record \
                 FILE: the record of what it holds",
                a.destination
            ))
            .into());
        }
    }
    if a.source == "-" {
        refuse_for_stdin(&a)?;
    }
    if let Some(Report::Fd(n)) = a.progress {
        copy::check_progress_fd(n)?;
    }
    let cancel = signals::cancel_on_int_term(
        "; the destination is incomplete (what was written may not be durable)",
    )?;
    let signal = &cancel;
    let opts = CopyOptions {
        requests: if a.synchronous {
            1
        } else {
            a.requests.unwrap_or(0) as usize
        },
        connections: if a.synchronous {
            1
        } else {
            a.connections.unwrap_or(0) as usize
        },
        request_size: a.request_size.unwrap_or(0),
        sparse_size: a.sparse_size,
        zero_mode: if a.target_is_zero {
            ZeroMode::Skip
        } else if a.allocated {
            ZeroMode::Allocated
        } else {
            ZeroMode::MayTrim
        },
        preallocation: preallocation.into(),
        flush: !a.no_flush,
        cache: a.cache.into(),
        report: a.progress.unwrap_or(Report::None),
        rate_limit: a.rate_limit.unwrap_or(0),
        offload: match a.copy_offload {
            OffloadArg::Never => OffloadMode::Never,
            OffloadArg::Auto => OffloadMode::Auto,
        },
        force: a.force,
        no_create: a.no_create,
        cancel: Some(cancel.flag.clone()),
        retry_timeout: a.retry_timeout,
        request_timeout: a.request_timeout,
        raw: a.format.raw(),
        no_extents: a.no_extents,
    };
    if let Some(name) = &a.changed_since {
        return run_changed(&a, name, &opts, signal);
    }
    if a.source == "-" {
        return run_from_stdin(&a, &opts, signal);
    }
    let mut recorder = None;
    let (src, dst) = if sink {
        (copy::open_source(&a.source, &opts)?, None)
    } else {
        let (s, d) = copy::open_pair_then(&a.source, &a.destination, &opts, |src| {
            // Read before any data: a change made after the newest
            // checkpoint now is in the next incremental.
            let id = copy::source_identity(src, &a.source, a.state_dir.as_deref());
            let path = record::path_for(&a.destination, a.backup_record.as_deref());
            recorder =
                Some(Recorder::begin(path, id).map_err(|e| CopyError::Setup(e.to_string()))?);
            Ok(())
        })?;
        (s, Some(d))
    };
    let result = match (&dst, a.destination.as_str()) {
        (Some(d), _) => copy::copy_endpoints(&src, &d.endpoint, &opts, d.zeroed),
        (None, "-") => {
            let out = std::io::BufWriter::with_capacity(1 << 20, std::io::stdout());
            copy::copy_to_stream(&src, &copy::Stream::new("-", Box::new(out)), &opts)
        }
        (None, _) => copy::copy_to_null(&src, &opts),
    };
    let stats = match result {
        Ok(s) => s,
        Err(CopyError::Interrupted { done, size }) => {
            close_quietly(&src, dst.as_ref().map(|d| &d.endpoint));
            return Ok(interrupted(signal, done, size, &a.destination));
        }
        Err(CopyError::Io {
            side: Side::Destination,
            error,
        }) if dst.is_none() && error.errno == Some(libc::EPIPE) => {
            // The reader of standard output took what it wanted: not a
            // failure to report, but not a whole copy either (pipefail).
            close_quietly(&src, None);
            return Ok(ExitCode::from(EXIT_PIPE_CLOSED));
        }
        Err(e) => return Err(e.into()),
    };
    let verified = match &dst {
        // The connections the copy started with are gone after a
        // reconnect: compare through new ones.
        Some(_) if a.verify && stats.reconnects > 0 => {
            let s = copy::open_source(&a.source, &opts)?;
            // The destination is what was written, not an input to check.
            let d = copy::open_source(&a.destination, &as_written(&opts))?;
            let v = copy::verify(&s, &d, &opts)?;
            close_quietly(&s, Some(&d));
            Some(v)
        }
        Some(d) if a.verify => Some(copy::verify(&src, &d.endpoint, &opts)?),
        _ => None,
    };
    src.close().map_err(|e| anyhow::anyhow!("source {e}"))?;
    let mut recorded = None;
    if let Some(d) = &dst {
        let size = d.endpoint.size();
        d.endpoint
            .close()
            .map_err(|e| anyhow::anyhow!("destination {e}"))?;
        if let Some(r) = &recorder {
            recorded = r.finish(size, opts.flush)?;
        }
    }
    if !a.quiet && matches!(a.output, OutputArg::Json) {
        let doc = summary_json(&a, &stats, None, verified.as_ref(), recorded.as_ref());
        if a.destination == "-" {
            out::say(doc.trim_end_matches('\n'));
        } else {
            print!("{doc}");
        }
    } else if !a.quiet {
        let mut line = if a.destination == "null:" {
            read_summary(&stats)
        } else {
            summary(&stats)
        };
        push_outcome(&mut line, verified.as_ref(), recorded.as_ref());
        // Standard output carries the data when it is the destination.
        if a.destination == "-" {
            out::say(&line);
        } else {
            crate::out::println(&line)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What a stream source cannot do: be read twice, or go to another stream.
fn refuse_for_stdin(a: &Args) -> Result<(), super::UsageError> {
    let why = if matches!(a.destination.as_str(), "-" | "null:") {
        "a file, block device or NBD destination"
    } else if a.verify {
        "no --verify (standard input cannot be read again)"
    } else if a.changed_since.is_some() {
        "no --changed-since (standard input has no checkpoints)"
    } else {
        return Ok(());
    };
    Err(super::UsageError(format!(
        "copying from standard input (-) needs {why}"
    )))
}

/// `copy - DESTINATION`: standard input, in order, to its end.
fn run_from_stdin(a: &Args, opts: &CopyOptions, signal: &Cancel) -> anyhow::Result<ExitCode> {
    // Standard input has no checkpoints: whatever the destination held, its
    // record no longer says it.
    Recorder::begin(
        record::path_for(&a.destination, a.backup_record.as_deref()),
        None,
    )?;
    let to = copy::open_for_stream(&a.destination, opts)?;
    let stdin = std::io::stdin();
    let stats = match copy::copy_from_stream("-", &mut stdin.lock(), &to, opts) {
        Ok(s) => s,
        Err(CopyError::Interrupted { done, size }) => {
            let _ = to.dst.endpoint.close();
            return Ok(interrupted(signal, done, size, &a.destination));
        }
        Err(e) => return Err(e.into()),
    };
    to.dst
        .endpoint
        .close()
        .map_err(|e| anyhow::anyhow!("destination {e}"))?;
    if !a.quiet {
        crate::out::println(summary(&stats))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The status of a copy to `-` whose reader went away: the shell's for a
/// process SIGPIPE ended (128 + 13), as nbdcopy's and cat's.
const EXIT_PIPE_CLOSED: u8 = 141;

/// The line after SIGINT or SIGTERM stopped the copy; the exit status.
fn interrupted(signal: &Cancel, done: u64, size: u64, destination: &str) -> ExitCode {
    let sig = signal.signal();
    // Said even when stderr is closed: the status then says it alone.
    out::say(&format!(
        "rawdisk: copy interrupted by {} after {done} of {size} bytes ({}); \
         the destination {destination} is incomplete",
        signals::name(sig),
        human(done),
    ));
    ExitCode::from(128 + sig as u8)
}

/// `--changed-since NAME`: the changed ranges only, onto the previous backup.
/// Options to reopen the destination for --verify: it is read as raw
/// whatever the bytes past the source's size look like.
fn as_written(opts: &CopyOptions) -> CopyOptions {
    CopyOptions {
        raw: true,
        ..opts.clone()
    }
}

fn run_changed(
    a: &Args,
    name: &str,
    opts: &CopyOptions,
    signal: &Cancel,
) -> anyhow::Result<ExitCode> {
    let inc = copy::open_changed(
        &a.source,
        &a.destination,
        name,
        a.state_dir.as_deref(),
        opts,
    )?;
    let path = record::path_for(&a.destination, a.backup_record.as_deref())
        .expect("checked with the arguments");
    if !a.trust_destination && !inc.whole() {
        // Every byte the copy does not write must already be the source's.
        let Some((src, since)) = inc.source.as_ref().and_then(|s| Some((s, s.find(name)?))) else {
            anyhow::bail!(
                "{} does not tell its checkpoints' identities (a server older than this \
                 rawdisk?), so what {} holds cannot be checked; make a full copy, or pass \
                 --trust-destination if you know it holds this source at checkpoint {name} \
                 or newer",
                a.source,
                a.destination
            );
        };
        record::check(&record::read(&path), &path, &inc.dst, src, since)
            .map_err(CopyError::Setup)?;
    }
    if let Some(w) = &inc.warning {
        out::say(&format!("rawdisk: warning: {w}"));
    }
    let recorder = Recorder::begin(Some(path), inc.source.clone())?;
    let stats = match copy::copy_changed(&inc, opts) {
        Ok(s) => s,
        Err(CopyError::Interrupted { done, size }) => {
            close_quietly(&inc.src, Some(&inc.dst));
            return Ok(interrupted(signal, done, size, &a.destination));
        }
        Err(e) => return Err(e.into()),
    };
    // The whole destination, as after a full copy: what the copy did not
    // write is checked too (holes on both sides cost nothing).
    let verified = match a.verify {
        // As a whole copy's: after a reconnect, through new connections.
        true if stats.reconnects > 0 => {
            let s = copy::open_source(&a.source, opts)?;
            let d = copy::open_source(&a.destination, &as_written(opts))?;
            let v = copy::verify(&s, &d, opts)?;
            close_quietly(&s, Some(&d));
            Some(v)
        }
        true => Some(copy::verify(&inc.src, &inc.dst, opts)?),
        false => None,
    };
    inc.src.close().map_err(|e| anyhow::anyhow!("source {e}"))?;
    let size = inc.dst.size();
    inc.dst
        .close()
        .map_err(|e| anyhow::anyhow!("destination {e}"))?;
    let recorded = recorder.finish(size, opts.flush)?;
    if !a.quiet && matches!(a.output, OutputArg::Json) {
        print!(
            "{}",
            summary_json(a, &stats, Some(name), verified.as_ref(), recorded.as_ref())
        );
    } else if !a.quiet {
        let mut line = format!(
            "changed since {name}: {} of {} ({} of {} bytes); {}",
            human(inc.changed()),
            human(stats.size),
            inc.changed(),
            stats.size,
            summary(&stats)
        );
        push_outcome(&mut line, verified.as_ref(), recorded.as_ref());
        crate::out::println(&line)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The destination's backup record across a copy: invalidated before the
/// first byte is written, written when the copy is complete and durable.
struct Recorder {
    path: Option<PathBuf>,
    source: Option<Source>,
}

/// A record written: where, and the checkpoint it names.
struct Recorded {
    path: PathBuf,
    record: Record,
}

impl Recorder {
    /// Before the copy writes: the record at `path` (if any) becomes
    /// "incomplete" when the copy will record `source`, else it is removed,
    /// so an interrupted copy leaves no record of what the destination
    /// held before.
    fn begin(path: Option<PathBuf>, source: Option<Source>) -> anyhow::Result<Recorder> {
        let source = source.filter(|s| s.newest().is_some());
        if let Some(p) = &path {
            let r = match source.as_ref().and_then(|s| Record::of(s, 0, false)) {
                Some(r) => record::write(p, &r),
                None => record::remove(p),
            };
            r.map_err(|e| anyhow::anyhow!("invalidate backup record {}: {e}", p.display()))?;
        }
        Ok(Recorder { path, source })
    }

    /// After the copy (flushed, verified, closed): the record of what the
    /// destination, `size` bytes, now holds.
    fn finish(&self, size: u64, flushed: bool) -> anyhow::Result<Option<Recorded>> {
        let (Some(path), Some(src)) = (&self.path, &self.source) else {
            return Ok(None);
        };
        if !flushed {
            out::say(&format!(
                "rawdisk: warning: no backup record written: with --no-flush the destination \
                 may not hold the copy durably yet ({} says incomplete)",
                path.display()
            ));
            return Ok(None);
        }
        let r = Record::of(src, size, true).expect("a source with a checkpoint");
        record::write(path, &r)
            .map_err(|e| anyhow::anyhow!("write backup record {}: {e}", path.display()))?;
        Ok(Some(Recorded {
            path: path.clone(),
            record: r,
        }))
    }
}

/// What --verify compared and the record written, after the summary.
fn push_outcome(line: &mut String, verified: Option<&VerifyStats>, recorded: Option<&Recorded>) {
    if let Some(v) = verified {
        line.push_str(&format!(
            "; verified: whole destination equals source ({} compared, {} skipped as holes \
             on both sides)",
            human(v.bytes_compared),
            human(v.bytes_skipped)
        ));
    }
    if let Some(r) = recorded {
        line.push_str(&format!(
            "; recorded in {}: checkpoint {}",
            r.path.display(),
            r.record.checkpoint.name
        ));
    }
}

/// `copy --output json`: the summary's figures, bytes by method.
fn summary_json(
    a: &Args,
    stats: &CopyStats,
    changed_since: Option<&str>,
    verified: Option<&VerifyStats>,
    recorded: Option<&Recorded>,
) -> String {
    let mut v = serde_json::json!({
        "source": a.source,
        "destination": a.destination,
        "virtual-size": stats.size,
        "bytes-copied": stats.changed.unwrap_or(stats.size),
        "bytes-read": stats.bytes_read,
        "bytes-written": stats.bytes_written,
        "bytes-zeroed": stats.bytes_zeroed,
        "bytes-skipped": stats.bytes_skipped,
        "bytes-reflinked": stats.bytes_reflinked,
        "bytes-copy-file-range": stats.bytes_copy_range,
        "reconnects": stats.reconnects,
        "elapsed-seconds": rawdisk_image::output::secs(stats.elapsed),
    });
    if let Some(n) = changed_since {
        v["changed-since"] = n.into();
    }
    if let Some(s) = verified {
        v["verified"] = serde_json::json!({
            "bytes-compared": s.bytes_compared,
            "bytes-skipped": s.bytes_skipped,
        });
    }
    if let Some(r) = recorded {
        v["backup-record"] = serde_json::json!({
            "path": r.path.to_string_lossy(),
            "checkpoint": r.record.checkpoint.name,
            "checkpoint-id": format!("{}:{}", r.record.source_id, r.record.checkpoint.seq),
        });
    }
    serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
}

/// A copy to `null:` only reads: say what it read, not what it "wrote".
fn read_summary(stats: &CopyStats) -> String {
    format!(
        "read {} in {:.2} s ({}/s): read {}, skipped {} as holes or zeros; null: keeps nothing",
        human(stats.size),
        stats.elapsed.as_secs_f64(),
        human(stats.throughput() as u64),
        human(stats.bytes_read),
        human(stats.bytes_skipped + stats.bytes_zeroed),
    )
}

fn summary(stats: &CopyStats) -> String {
    let secs = stats.elapsed.as_secs_f64();
    let mut line = format!(
        "copied {} in {:.2} s ({}/s): read {}, written {}, zeroed {}, skipped {}",
        human(stats.changed.unwrap_or(stats.size)),
        secs,
        human(stats.throughput() as u64),
        human(stats.bytes_read),
        human(stats.bytes_written),
        human(stats.bytes_zeroed),
        human(stats.bytes_skipped),
    );
    if stats.reconnects > 0 {
        line.push_str(&format!("; reconnected {} time(s)", stats.reconnects));
    }
    if stats.bytes_reflinked + stats.bytes_copy_range > 0 {
        line.push_str(&format!(
            "; offloaded: reflink {}, copy_file_range {}",
            human(stats.bytes_reflinked),
            human(stats.bytes_copy_range)
        ));
    }
    line
}

/// Ends NBD connections after an interruption; errors no longer matter.
fn close_quietly(src: &Endpoint, dst: Option<&Endpoint>) {
    let _ = src.close();
    if let Some(d) = dst {
        let _ = d.close();
    }
}

/// `-p` (given as `-`) or `--progress=FD`.
fn progress_arg(v: &str) -> Result<Report, String> {
    if v == "-" {
        return Ok(Report::Stderr);
    }
    v.parse::<i32>()
        .ok()
        .filter(|&fd| fd >= 0)
        .map(Report::Fd)
        .ok_or_else(|| format!("{v:?} is not a file descriptor number"))
}

/// `--rate-limit`: a size per second, at least one byte.
fn rate_arg(v: &str) -> Result<u64, String> {
    match size_arg(v)? {
        0 => Err("a rate limit of 0 would copy nothing".into()),
        n => Ok(n),
    }
}

/// A duration: a number of seconds, or a number with `ms`, `s` or `m`.
fn duration_arg(v: &str) -> Result<Duration, String> {
    let (num, unit) = match v.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => v.split_at(i),
        None => (v, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{v:?} is not a duration (120, 90s, 500ms, 2m)"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n.saturating_mul(60))),
        _ => Err(format!("{v:?}: unknown unit {unit:?} (ms, s, m)")),
    }
}

/// `--copy-offload`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum OffloadArg {
    /// Always read and write.
    Never,
    /// Reflink, else copy_file_range, else read and write.
    Auto,
}

fn human(b: u64) -> String {
    const UNITS: [&str; 6] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if b < 1024 {
        return format!("{b} bytes");
    }
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}
