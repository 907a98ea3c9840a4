//! The `rawdisk` command: argument parsing and printing only. Every subcommand
//! lives in `cmd/` and calls into the library crates, where the logic is.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;
mod docs;
mod out;
mod signals;
#[allow(dead_code)] // used by the subcommands as they land
mod size;
mod syslog;

#[derive(Parser)]
#[command(
    name = "rawdisk",
    version,
    about = "Serve, create, probe, map, copy, resize and compare raw disk images and block devices"
)]
struct Cli {
    /// More logging (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

// Each command's summary (the first paragraph) and description (all of it)
// are its Args' doc comment, so `--help` and the man pages say the same.
#[derive(Subcommand)]
enum Command {
    Serve(Box<cmd::serve::Args>),
    Create(cmd::create::Args),
    Probe(cmd::probe::Args),
    Map(cmd::map::Args),
    Info(cmd::info::Args),
    Copy(cmd::copy::Args),
    Resize(cmd::resize::Args),
    Checksum(cmd::checksum::Args),
    Compare(cmd::compare::Args),
    Checkpoint(cmd::checkpoint::Args),
    #[command(name = "qemu-nbd")]
    QemuNbd(cmd::qemu_nbd::Args),
    /// Write man pages and shell completions (for packaging).
    #[command(hide = true)]
    GenerateDocs(docs::Args),
}

/// Exit code for a bad command line (as clap and qemu-img use).
pub const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    out::quiet_on_closed_stdout();
    // qemu-nbd's command line, by the binary's name or as the first word:
    // read by getopt's rules, never by clap's.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let by_name = argv
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .is_some_and(|n| n == "qemu-nbd");
    if by_name {
        return qemu_nbd("qemu-nbd", &argv[1..]);
    }
    if argv.get(1).is_some_and(|a| a == "qemu-nbd") {
        return qemu_nbd("rawdisk qemu-nbd", &argv[2..]);
    }
    let matches = <Cli as clap::CommandFactory>::command().try_get_matches();
    let cli = match matches
        .and_then(|m| <Cli as clap::FromArgMatches>::from_arg_matches(&m).map(|c| (c, m)))
    {
        Ok((cli, m)) => {
            if let Err(e) = check_uris(&m) {
                eprintln!("rawdisk: {e} (see '{}')", help_of_typed());
                return ExitCode::from(EXIT_USAGE);
            }
            // `--write-behind on disk.img`: `on` parsed as an argument of
            // its own, which is not what the user meant.
            if let Some(d) = detached_value().filter(|d| d.is_value) {
                eprintln!(
                    "rawdisk: '{}' after {} is read as an argument, not as its value; {} (see '{}')",
                    d.word,
                    d.flag,
                    d.hint(),
                    help_of_typed()
                );
                return ExitCode::from(EXIT_USAGE);
            }
            cli
        }
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion)
                || e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            {
                let _ = e.print();
                return if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                    ExitCode::from(EXIT_USAGE)
                } else {
                    ExitCode::SUCCESS
                };
            }
            // One line, not clap's multi-line usage block: scripts grep it and
            // users read it. The detail (missing names, allowed values, "did
            // you mean") is kept.
            let sub = subcommand_typed();
            let hint = detached_value().map(|d| d.hint());
            eprintln!(
                "rawdisk: {}",
                usage_line(&e.render().to_string(), sub.as_deref(), hint)
            );
            return ExitCode::from(EXIT_USAGE);
        }
    };
    // The one-shot commands print their result themselves; the engine's
    // info-level notes (capabilities learned) would only clutter stderr,
    // where a failure must stay one line. The server keeps info.
    let (quiet, dest) = match &cli.command {
        Command::Serve(a) => (false, (a.log_dest(), a.log_named())),
        _ => (true, (cmd::serve::LogArg::Stderr, false)),
    };
    init_logging(cli.verbose, quiet, dest);
    let result = match cli.command {
        Command::Serve(a) => cmd::serve::run(*a),
        Command::QemuNbd(a) => return qemu_nbd("rawdisk qemu-nbd", &a.args),
        Command::Create(a) => cmd::create::run(a),
        Command::Probe(a) => cmd::probe::run(a),
        Command::Map(a) => cmd::map::run(a),
        Command::Info(a) => cmd::info::run(a),
        Command::Copy(a) => cmd::copy::run(a),
        Command::Resize(a) => cmd::resize::run(a),
        Command::Checksum(a) => cmd::checksum::run(a),
        Command::Compare(a) => cmd::compare::run(a),
        Command::Checkpoint(a) => cmd::checkpoint::run(a),
        Command::GenerateDocs(a) => docs::run(<Cli as clap::CommandFactory>::command(), a),
    };
    exit_with(result)
}

/// `rawdisk qemu-nbd` (`prog`) with `args`: serve as they say, or exit.
fn qemu_nbd(prog: &str, args: &[std::ffi::OsString]) -> ExitCode {
    match cmd::qemu_nbd::parse(prog, args) {
        cmd::qemu_nbd::Outcome::Exit(code) => code,
        cmd::qemu_nbd::Outcome::Serve(a, verbose) => {
            init_logging(verbose, false, (a.log_dest(), a.log_named()));
            exit_with(cmd::serve::run(*a))
        }
    }
}

/// The exit status of a command's result, its error said in one line.
fn exit_with(result: anyhow::Result<ExitCode>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(e) if e.downcast_ref::<cmd::UsageError>().is_some() => {
            let line = one_line(&e);
            if line.contains("(see 'rawdisk") {
                out::say(&format!("rawdisk: {line}"));
            } else {
                out::say(&format!("rawdisk: {line} (see '{}')", help_of_typed()));
            }
            ExitCode::from(EXIT_USAGE)
        }
        Err(e) => {
            // Never a panic: a closed stderr must not turn status 1 into 101.
            out::say(&format!("rawdisk: {}", one_line(&e)));
            ExitCode::FAILURE
        }
    }
}

/// The commands that take NBD URIs check them before anything runs: a
/// malformed one (an unknown query parameter, TLS parameters on nbd://) is
/// a bad command line, said as clap says its own.
const URI_COMMANDS: &[&str] = &["info", "map", "copy", "checksum", "compare"];

fn check_uris(matches: &clap::ArgMatches) -> Result<(), rawdisk_nbd::uri::UriError> {
    let Some((name, sub)) = matches.subcommand() else {
        return Ok(());
    };
    if !URI_COMMANDS.contains(&name) {
        return Ok(());
    }
    for id in sub.ids() {
        let Ok(Some(values)) = sub.try_get_raw(id.as_str()) else {
            continue;
        };
        for v in values.filter_map(|v| v.to_str()) {
            if !rawdisk_nbd::uri::looks_like_nbd_uri(v) {
                continue;
            }
            rawdisk_nbd::uri::NbdUri::parse(v)?;
        }
    }
    Ok(())
}

/// A failure as one line: the context and each cause, joined by ": ".
/// Errors that put their cause in their own message (the storage engine's,
/// the image commands') return no source, so nothing repeats.
fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}")
}

/// Flattens clap's rendered error into one line: the message and its detail
/// lines (missing arguments, possible values, tips) joined, then a hint naming
/// the help of the subcommand the user was typing.
fn usage_line(text: &str, sub: Option<&str>, hint: Option<String>) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut help = match sub {
        Some(sub) => format!("rawdisk {sub} --help"),
        None => "rawdisk --help".to_string(),
    };
    for line in text.lines().map(str::trim) {
        if let Some(usage) = line.strip_prefix("Usage: ") {
            // "Usage: rawdisk copy [OPTIONS] <SRC> <DST>": the command path is
            // the words before the first option or placeholder.
            let path: Vec<&str> = usage
                .split_whitespace()
                .take_while(|w| !w.starts_with(['[', '<', '-']))
                .collect();
            if !path.is_empty() {
                help = format!("{} --help", path.join(" "));
            }
            continue;
        }
        if line.is_empty() || line.starts_with("For more information") {
            continue;
        }
        let line = line.trim_start_matches("error: ");
        let line = line.strip_prefix("tip: ").unwrap_or(line);
        match parts.last_mut() {
            // "...not provided:" is followed by the names, one per line.
            Some(last) if last.ends_with(':') => {
                last.push(' ');
                last.push_str(line);
            }
            Some(last) if line.starts_with('<') || line.starts_with("--") => {
                last.push_str(", ");
                last.push_str(line);
            }
            Some(last) if line.starts_with('[') => {
                last.push(' ');
                last.push_str(line);
            }
            _ => parts.push(line.to_string()),
        }
    }
    if parts.is_empty() {
        parts.push("invalid arguments".into());
    }
    parts.extend(hint);
    format!("{} (see '{help}')", parts.join("; "))
}

/// An optional-value flag given its value as a separate word.
fn detached_value() -> Option<cmd::detached::Detached> {
    use clap::CommandFactory;
    let args: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    cmd::detached::find(&Cli::command(), &args)
}

/// The subcommand named on the command line, when clap's error does not carry
/// a usage line (an invalid value) to say which help to point at.
fn subcommand_typed() -> Option<String> {
    use clap::CommandFactory;
    let cmd = Cli::command();
    std::env::args()
        .skip(1)
        .find(|a| cmd.get_subcommands().any(|c| c.get_name() == a.as_str()))
}

/// "rawdisk SUBCOMMAND [ACTION] --help" for what was typed: the deepest
/// subcommand named on the command line (`checkpoint create`).
fn help_of_typed() -> String {
    use clap::CommandFactory;
    let mut cmd = Cli::command();
    let mut path = vec!["rawdisk".to_string()];
    for a in std::env::args().skip(1) {
        match cmd.find_subcommand(&a) {
            Some(sub) => {
                path.push(a);
                cmd = sub.clone();
            }
            None if a.starts_with('-') => continue,
            None => break,
        }
    }
    format!("{} --help", path.join(" "))
}

/// `dest`: where the messages go, and whether the user named it (--log).
fn init_logging(verbose: u8, quiet: bool, dest: (cmd::serve::LogArg, bool)) {
    use cmd::serve::LogArg;
    use tracing_subscriber::fmt::writer::BoxMakeWriter;
    use tracing_subscriber::EnvFilter;
    let default = match verbose {
        0 if quiet => "warn",
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let env = EnvFilter::try_from_default_env().ok();
    // A one-shot command's warning reads like its error line; a log (the
    // server's, or one asked for with -v or RUST_LOG) keeps time and level.
    let plain = quiet && verbose == 0 && env.is_none();
    let filter = env.unwrap_or_else(|| EnvFilter::new(default));
    // A line that cannot be written is dropped: by default the failure is
    // said with eprintln!, which panics when stderr is a closed pipe, and a
    // panic in the signal task left a forked server deaf to SIGTERM.
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .log_internal_errors(false);
    let fmt = match dest.0 {
        // Escape codes only for a person at a terminal, never in log files.
        LogArg::Stderr => fmt
            .with_writer(BoxMakeWriter::new(std::io::stderr))
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
        LogArg::Null => fmt
            .with_writer(BoxMakeWriter::new(std::io::sink))
            .with_ansi(false),
        // The system log stamps the time and the priority says the level.
        LogArg::Syslog => {
            return fmt
                .with_writer(syslog::Syslog::connect(dest.1))
                .with_ansi(false)
                .without_time()
                .with_level(false)
                .init()
        }
    };
    if plain {
        fmt.event_format(Plain).init();
    } else {
        fmt.init();
    }
}

/// "rawdisk: warning: MESSAGE", as the one-line errors are written.
struct Plain;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for Plain
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut w: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let level = match *event.metadata().level() {
            tracing::Level::ERROR => "error",
            tracing::Level::WARN => "warning",
            _ => "note",
        };
        write!(w, "rawdisk: {level}: ")?;
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}
