//! `rawdisk generate-docs DIR` (hidden): man pages and shell completions
//! made from the clap definitions, so they never drift from `--help`.
//! scripts/install.sh runs it and copies the files under a PREFIX.
//!
//! A page per command and per nested command (`rawdisk-checkpoint-create`).
//! NAME, SYNOPSIS, DESCRIPTION, OPTIONS and EXAMPLES come from clap; EXIT
//! STATUS, SIGNALS, ENVIRONMENT, FILES and SEE ALSO from [`PAGES`] below,
//! which a unit test keeps in step with the commands.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap_complete::Shell;

/// Write DIR/man1/rawdisk.1 and rawdisk-COMMAND[-SUBCOMMAND].1 for each
/// command, and DIR/completions/rawdisk.bash, _rawdisk (zsh), rawdisk.fish.
#[derive(clap::Args)]
#[command(after_help = "Example:\n  rawdisk generate-docs target/docs")]
pub struct Args {
    /// Directory to write into (created if missing).
    dir: PathBuf,
}

/// What a page says beyond the command-line definitions. Each entry is
/// `(term, text)`; texts are plain sentences (escaped when rendered).
struct Page {
    /// The command path after `rawdisk` ("" for rawdisk(1) itself).
    path: &'static str,
    exit: &'static [(&'static str, &'static str)],
    signals: &'static [(&'static str, &'static str)],
    environment: &'static [(&'static str, &'static str)],
    files: &'static [(&'static str, &'static str)],
    /// Pages outside rawdisk's own (the parent and nested pages are added).
    see_also: &'static [&'static str],
}

const EXIT: &[(&str, &str)] = &[
    ("0", "Success."),
    (
        "1",
        "The operation failed; one line on standard error names the operation, \
         the object (and range) and the cause.",
    ),
    (
        "2",
        "A bad command line; one line on standard error, naming the help to read.",
    ),
];

const EXIT_COPY: &[(&str, &str)] = &[
    ("0", "The copy is complete (and flushed unless --no-flush)."),
    (
        "1",
        "The copy failed; one line on standard error names the side, the offset and the cause.",
    ),
    ("2", "A bad command line."),
    (
        "130",
        "Stopped by SIGINT (see SIGNALS): the destination is incomplete.",
    ),
    (
        "143",
        "Stopped by SIGTERM (see SIGNALS): the destination is incomplete.",
    ),
];

/// qemu-nbd exits 1 for a bad command line too.
const EXIT_QEMU_NBD: &[(&str, &str)] = &[
    (
        "0",
        "Stopped by a signal after finishing the requests in flight and flushing, \
         or after the last client without -t; with --fork, the server is listening.",
    ),
    (
        "1",
        "A bad command line or something rawdisk does not serve (one line on \
         standard error), or the server could not start or failed.",
    ),
];

const EXIT_SERVE: &[(&str, &str)] = &[
    (
        "0",
        "Stopped by a signal after finishing the requests in flight and flushing; \
         with --fork, the server is listening (its pid in --pid-file).",
    ),
    (
        "1",
        "The server could not start or failed (one line on standard error), or a \
         second signal stopped it without waiting.",
    ),
    ("2", "A bad command line."),
    (
        "N",
        "With --run: the command's exit status (128 plus the signal's number when \
         a signal killed it).",
    ),
];

const EXIT_COMPARE: &[(&str, &str)] = &[
    ("0", "The images read the same."),
    (
        "1",
        "The images differ; the first differing offset is printed (as qemu-img compare).",
    ),
    (
        "2",
        "An error, including a bad command line; one line on standard error.",
    ),
];

const SIGNALS_SERVE: &[(&str, &str)] = &[
    (
        "SIGTERM, SIGINT, SIGHUP",
        "Stop accepting connections, finish the requests in flight (later ones are \
         answered NBD_ESHUTDOWN), flush, persist the changed-block state and exit 0. \
         SIGQUIT, SIGUSR2 and SIGALRM do the same.",
    ),
    (
        "a second signal",
        "Any of those while the requests in flight finish: remove the socket and \
         pid files and exit 1 at once, without waiting for them.",
    ),
    (
        "SIGUSR1",
        "Log the server's totals (connections, requests and bytes per command, \
         errors) as one line of JSON, the document --stats writes, and go on serving.",
    ),
];

const SIGNALS_COPY: &[(&str, &str)] = &[
    (
        "SIGINT, SIGTERM",
        "Stop handing out work, finish the requests in flight, print how far the copy \
         got and exit 128 plus the signal's number: 130 for SIGINT, 143 for SIGTERM.",
    ),
    (
        "a second signal",
        "SIGINT or SIGTERM again: exit 130 or 143 at once, without waiting for the \
         requests in flight.",
    ),
];

const SIGNALS_CREATE: &[(&str, &str)] = &[
    (
        "SIGINT, SIGTERM",
        "Stop at the next chunk written or allocated, undo the change (a created file \
         is removed, a grown one gets its old size back) and exit 1.",
    ),
    (
        "a second signal",
        "SIGINT or SIGTERM again: exit 130 or 143 at once, leaving the image as it is \
         (partly created or grown).",
    ),
];

const ENV_LOG: (&str, &str) = (
    "RUST_LOG",
    "Which log messages are written to standard error (tracing's filter syntax, e.g. \
     debug); overrides -v.",
);

const ENV: &[(&str, &str)] = &[ENV_LOG];

const ENV_CLIENT: &[(&str, &str)] = &[
    (
        "HOME",
        "An nbds:// URI without tls-certificates= or tls-psk-file= uses the first \
         of HOME/.pki/libnbd and HOME/.config/pki/libnbd (root: /etc/pki/libnbd) \
         that holds ca-cert.pem, as libnbd does, else the system's CA certificates.",
    ),
    (
        "USER, LOGNAME",
        "The PSK user of an nbds:// URI with tls-psk-file= that names none.",
    ),
    ENV_LOG,
];

const ENV_SERVE: &[(&str, &str)] = &[
    (
        "LISTEN_PID, LISTEN_FDS",
        "Socket activation (sd_listen_fds(3)): when LISTEN_PID is the server's pid \
         and LISTEN_FDS is 1 or more, the server listens on file descriptor 3, which \
         systemd passed, instead of --socket or --bind. Only the first socket is used.",
    ),
    (
        "LISTEN_FDNAMES",
        "Not read; removed from the environment together with LISTEN_PID and \
         LISTEN_FDS once the socket is taken.",
    ),
    (
        "uri",
        "Set for the --run command: the URI that reaches the server.",
    ),
    ENV_LOG,
];

const FILES_CBT: (&str, &str) = (
    "TARGET.rawdisk-cbt",
    "The changed-block tracking state of TARGET: its checkpoints and bitmaps, next \
     to a file, or DIR/NAME.rawdisk-cbt with --state-dir DIR (NAME being TARGET's \
     file name; needed for block devices).",
);

const FILES_CHECKPOINT: &[(&str, &str)] = &[FILES_CBT];

const FILES_SERVE: &[(&str, &str)] = &[
    (
        "TARGET.rawdisk-cbt",
        "With --track-changes or --bitmap: the changed-block tracking state, made durable before \
         each FLUSH is acknowledged (DIR/NAME.rawdisk-cbt with --state-dir DIR; one \
         per export with --dir).",
    ),
    (
        "--pid-file PATH",
        "The server's pid, written once it listens (mode 0644, put in place by a \
         rename; a symlink at PATH is refused); removed at exit.",
    ),
    (
        "--socket PATH",
        "The Unix socket; a stale one is replaced, and it is removed at exit.",
    ),
];

const FILES_COPY: &[(&str, &str)] = &[
    (
        "SOURCE.rawdisk-cbt",
        "With a local source: the source's changed-block tracking state \
         (DIR/NAME.rawdisk-cbt with --state-dir DIR), read for --changed-since and \
         for the backup record.",
    ),
    (
        "DESTINATION.rawdisk-backup",
        "The backup record of a file destination (--backup-record FILE for a block \
         device or NBD destination): the source and checkpoint it holds, written \
         after a copy from a tracked source, checked by --changed-since.",
    ),
];

/// rawdisk-checkpoint(1) and its nested commands' pages differ only in
/// the command.
const fn checkpoint_page(path: &'static str) -> Page {
    Page {
        path,
        exit: EXIT,
        signals: &[],
        environment: ENV,
        files: FILES_CHECKPOINT,
        see_also: &["rawdisk-copy(1)", "rawdisk-serve(1)"],
    }
}

/// One entry per page, rawdisk(1) first, then each command in --help's
/// order with its nested commands after it.
const PAGES: &[Page] = &[
    Page {
        path: "",
        exit: EXIT,
        signals: &[],
        environment: ENV,
        files: &[],
        see_also: &["nbdkit(1)", "qemu-img(1)", "qemu-nbd(8)"],
    },
    Page {
        path: "serve",
        exit: EXIT_SERVE,
        signals: SIGNALS_SERVE,
        environment: ENV_SERVE,
        files: FILES_SERVE,
        see_also: &[
            "rawdisk-checkpoint(1)",
            "nbdinfo(1)",
            "nbdkit(1)",
            "sd_listen_fds(3)",
            "systemd.socket(5)",
            "qemu-nbd(8)",
        ],
    },
    Page {
        path: "create",
        exit: EXIT,
        signals: SIGNALS_CREATE,
        environment: ENV,
        files: &[],
        see_also: &["rawdisk-probe(1)", "rawdisk-resize(1)", "qemu-img(1)"],
    },
    Page {
        path: "probe",
        exit: EXIT,
        signals: &[],
        environment: ENV,
        files: &[],
        see_also: &["rawdisk-create(1)", "rawdisk-serve(1)"],
    },
    Page {
        path: "map",
        exit: EXIT,
        signals: &[],
        environment: ENV_CLIENT,
        files: &[],
        see_also: &["rawdisk-info(1)", "nbdinfo(1)", "qemu-img(1)"],
    },
    Page {
        path: "info",
        exit: EXIT,
        signals: &[],
        environment: ENV_CLIENT,
        files: &[],
        see_also: &["rawdisk-map(1)", "nbdinfo(1)", "qemu-img(1)", "qemu-nbd(8)"],
    },
    Page {
        path: "copy",
        exit: EXIT_COPY,
        signals: SIGNALS_COPY,
        environment: ENV_CLIENT,
        files: FILES_COPY,
        see_also: &[
            "rawdisk-checkpoint(1)",
            "rawdisk-compare(1)",
            "rawdisk-serve(1)",
            "nbdcopy(1)",
            "qemu-img(1)",
        ],
    },
    Page {
        path: "resize",
        exit: EXIT,
        signals: SIGNALS_CREATE,
        environment: ENV,
        files: &[],
        see_also: &["rawdisk-create(1)", "qemu-img(1)"],
    },
    Page {
        path: "checksum",
        exit: EXIT,
        signals: &[],
        environment: ENV_CLIENT,
        files: &[],
        see_also: &["rawdisk-compare(1)", "nbdcopy(1)"],
    },
    Page {
        path: "compare",
        exit: EXIT_COMPARE,
        signals: &[],
        environment: ENV_CLIENT,
        files: &[],
        see_also: &["rawdisk-checksum(1)", "rawdisk-copy(1)", "qemu-img(1)"],
    },
    checkpoint_page("checkpoint"),
    checkpoint_page("checkpoint create"),
    checkpoint_page("checkpoint list"),
    checkpoint_page("checkpoint delete"),
    Page {
        path: "qemu-nbd",
        exit: EXIT_QEMU_NBD,
        signals: SIGNALS_SERVE,
        environment: ENV_SERVE,
        files: FILES_SERVE,
        see_also: &["rawdisk-serve(1)", "qemu-nbd(8)"],
    },
];

pub fn run(cmd: clap::Command, args: Args) -> anyhow::Result<ExitCode> {
    let man = args.dir.join("man1");
    let comp = args.dir.join("completions");
    for d in [&man, &comp] {
        fs::create_dir_all(d).with_context(|| format!("cannot create '{}'", d.display()))?;
    }
    let cmd = shown(&cmd);
    let date = today();
    for (name, roff) in pages(&cmd, &date)? {
        let path = man.join(format!("{name}.1"));
        fs::write(&path, roff).with_context(|| format!("cannot write '{}'", path.display()))?;
    }
    for (shell, file) in [
        (Shell::Bash, "rawdisk.bash"),
        (Shell::Zsh, "_rawdisk"),
        (Shell::Fish, "rawdisk.fish"),
    ] {
        completion(&cmd, shell, &comp.join(file))?;
    }
    crate::out::println(args.dir.display())?;
    Ok(ExitCode::SUCCESS)
}

/// Every page as (name without ".1", roff), rawdisk first.
fn pages(cmd: &clap::Command, date: &str) -> anyhow::Result<Vec<(String, String)>> {
    let mut built = cmd.clone().disable_help_subcommand(true);
    built.build();
    let mut out = Vec::new();
    let mut todo = vec![(Vec::<String>::new(), built)];
    while let Some((path, c)) = todo.pop() {
        let key = path.join(" ");
        let page = PAGES
            .iter()
            .find(|p| p.path == key)
            .with_context(|| format!("no man page entry for 'rawdisk {key}' in docs.rs"))?;
        out.push((page_name(&path), render(&c, &path, page, date)));
        for sub in c.get_subcommands().collect::<Vec<_>>().into_iter().rev() {
            let mut p = path.clone();
            p.push(sub.get_name().to_string());
            todo.push((p, sub.clone()));
        }
    }
    Ok(out)
}

/// The command without its hidden subcommands (this one), which neither
/// the man pages nor the completions should offer.
fn shown(cmd: &clap::Command) -> clap::Command {
    let mut c = clap::Command::new("rawdisk")
        .version(env!("CARGO_PKG_VERSION"))
        .args(cmd.get_arguments().cloned())
        .subcommands(cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned());
    if let Some(about) = cmd.get_about() {
        c = c.about(about.clone());
    }
    c
}

fn completion(cmd: &clap::Command, shell: Shell, path: &Path) -> anyhow::Result<()> {
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd.clone(), "rawdisk", &mut out);
    fs::write(path, out).with_context(|| format!("cannot write '{}'", path.display()))
}

/// The page's date: SOURCE_DATE_EPOCH when set (reproducible builds), else
/// today, as YYYY-MM-DD.
fn today() -> String {
    let secs = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        });
    crate::cmd::checkpoint::utc(secs)[..10].to_string()
}

fn page_name(path: &[String]) -> String {
    std::iter::once("rawdisk")
        .chain(path.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("-")
}

fn render(c: &clap::Command, path: &[String], page: &Page, date: &str) -> String {
    let name = page_name(path);
    let words = std::iter::once("rawdisk")
        .chain(path.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join(" ");
    let mut r = String::new();
    let _ = writeln!(
        r,
        ".TH \"{}\" \"1\" \"{date}\" \"rawdisk {}\" \"rawdisk manual\"",
        esc(&name),
        env!("CARGO_PKG_VERSION")
    );
    let about = c.get_about().map(|a| a.to_string()).unwrap_or_default();
    r.push_str(".SH NAME\n");
    let _ = writeln!(r, "{} \\- {}", esc(&name), esc(about.trim_end_matches('.')));

    r.push_str(".SH SYNOPSIS\n");
    let subs: Vec<&clap::Command> = c.get_subcommands().collect();
    if subs.is_empty() {
        let _ = writeln!(r, "{}", synopsis(c, &words));
    } else {
        let _ = writeln!(r, "\\fB{}\\fR \\fICOMMAND\\fR ...", esc(&words));
        r.push_str(".br\n");
        let _ = writeln!(r, "{}", synopsis(c, &words));
        // rawdisk(1) leaves each command's to its page; a command's page
        // shows its nested commands' (rawdisk checkpoint create ...).
        for s in subs.iter().filter(|_| !path.is_empty()) {
            r.push_str(".br\n");
            let _ = writeln!(r, "{}", synopsis(s, &format!("{words} {}", s.get_name())));
        }
    }

    r.push_str(".SH DESCRIPTION\n");
    let long = c
        .get_long_about()
        .or(c.get_about())
        .map(|a| a.to_string())
        .unwrap_or_default();
    paragraphs(&mut r, &long);

    let args: Vec<&clap::Arg> = c.get_arguments().filter(|a| !a.is_hide_set()).collect();
    r.push_str(".SH OPTIONS\n");
    for a in args.iter().filter(|a| !a.is_positional()) {
        option(&mut r, a);
    }
    for a in args.iter().filter(|a| a.is_positional()) {
        option(&mut r, a);
    }

    if !subs.is_empty() {
        r.push_str(".SH COMMANDS\n");
        for s in &subs {
            let mut p = path.to_vec();
            p.push(s.get_name().to_string());
            let _ = writeln!(r, ".TP\n\\fB{}\\fR(1)", esc(&page_name(&p)));
            let about = s.get_about().map(|a| a.to_string()).unwrap_or_default();
            let _ = writeln!(r, "{}", esc(&about));
        }
    }

    section(&mut r, "EXIT STATUS", page.exit);
    section(&mut r, "SIGNALS", page.signals);
    section(&mut r, "ENVIRONMENT", page.environment);
    section(&mut r, "FILES", page.files);

    if let Some(after) = c.get_after_help() {
        let text = after.to_string();
        let lines: Vec<&str> = text
            .lines()
            .skip_while(|l| l.trim().ends_with(':'))
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        if !lines.is_empty() {
            r.push_str(".SH EXAMPLES\n.nf\n");
            for l in lines {
                let _ = writeln!(r, "{}", esc(l));
            }
            r.push_str(".fi\n");
        }
    }

    let mut see: Vec<String> = Vec::new();
    if !path.is_empty() {
        see.push(format!("{}(1)", page_name(&path[..path.len() - 1])));
    }
    for s in &subs {
        let mut p = path.to_vec();
        p.push(s.get_name().to_string());
        see.push(format!("{}(1)", page_name(&p)));
    }
    see.extend(page.see_also.iter().map(|s| s.to_string()));
    r.push_str(".SH SEE ALSO\n");
    let refs: Vec<String> = see
        .iter()
        .map(|s| match s.split_once('(') {
            Some((n, sect)) => format!(".BR {} ({}", esc(n), sect),
            None => esc(s),
        })
        .collect();
    let n = refs.len();
    for (i, line) in refs.into_iter().enumerate() {
        if i + 1 < n {
            let _ = writeln!(r, "{line},");
        } else {
            let _ = writeln!(r, "{line}");
        }
    }
    r
}

/// `\fBrawdisk copy\fR [\fB\-p\fR|\fB\-\-progress\fR] ... \fISOURCE\fR`:
/// every flag `--help` lists, with its value's placeholder.
fn synopsis(c: &clap::Command, words: &str) -> String {
    let mut parts = vec![format!("\\fB{}\\fR", esc(words))];
    let args: Vec<&clap::Arg> = c.get_arguments().filter(|a| !a.is_hide_set()).collect();
    for a in args.iter().filter(|a| !a.is_positional()) {
        let mut flag = Vec::new();
        if let Some(s) = a.get_short() {
            flag.push(format!("\\fB\\-{s}\\fR"));
        }
        if let Some(l) = a.get_long() {
            flag.push(format!("\\fB\\-\\-{}\\fR", esc(l)));
        }
        let mut s = flag.join("|");
        s.push_str(&value(a));
        let repeat = matches!(a.get_action(), clap::ArgAction::Count);
        let required = a.is_required_set();
        parts.push(match (required, repeat) {
            (true, _) => s,
            (false, true) => format!("[{s}]..."),
            (false, false) => format!("[{s}]"),
        });
    }
    for a in args.iter().filter(|a| a.is_positional()) {
        let v = format!("\\fI{}\\fR", esc(&placeholder(a)));
        parts.push(if a.is_required_set() {
            v
        } else {
            format!("[{v}]")
        });
    }
    // \% keeps a flag or placeholder from being hyphenated across lines.
    parts
        .iter()
        .map(|p| format!("\\%{p}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// What follows a flag that takes a value: ` \fIPATH\fR`, ` \fIoff\fR|...`,
/// or `[=\fIWHEN\fR]` for an optional one; empty for a switch.
fn value(a: &clap::Arg) -> String {
    if !a.get_action().takes_values() {
        return String::new();
    }
    let optional = a.get_num_args().is_some_and(|n| n.min_values() == 0);
    // The values themselves where there are few (`off|falloc|full`), as
    // README's table writes them; else the placeholder --help shows.
    let values: Vec<String> = a
        .get_possible_values()
        .iter()
        .filter(|p| !p.is_hide_set())
        .map(|p| format!("\\fI{}\\fR", esc(p.get_name())))
        .collect();
    let v = if values.is_empty() {
        format!("\\fI{}\\fR", esc(&placeholder(a)))
    } else {
        values.join("|")
    };
    if optional {
        format!("[={v}]")
    } else {
        format!(" {v}")
    }
}

/// The value's name as `--help` shows it: value_name, else the id in capitals.
fn placeholder(a: &clap::Arg) -> String {
    match a.get_value_names() {
        Some(names) if !names.is_empty() => names
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(" "),
        _ => a.get_id().as_str().to_uppercase(),
    }
}

fn option(r: &mut String, a: &clap::Arg) {
    r.push_str(".TP\n");
    if a.is_positional() {
        let _ = writeln!(r, "\\fI{}\\fR", esc(&placeholder(a)));
    } else {
        let mut names = Vec::new();
        if let Some(s) = a.get_short() {
            names.push(format!("\\fB\\-{s}\\fR"));
        }
        for s in a.get_visible_short_aliases().unwrap_or_default() {
            names.push(format!("\\fB\\-{s}\\fR"));
        }
        if let Some(l) = a.get_long() {
            names.push(format!("\\fB\\-\\-{}\\fR", esc(l)));
        }
        for l in a.get_visible_aliases().unwrap_or_default() {
            names.push(format!("\\fB\\-\\-{}\\fR", esc(l)));
        }
        let _ = writeln!(r, "{}{}", names.join(", "), value(a));
    }
    let help = a
        .get_long_help()
        .or(a.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default();
    let mut text = help.trim().to_string();
    if !text.is_empty() && !text.ends_with(['.', ')', ']']) {
        text.push('.');
    }
    let defaults: Vec<String> = a
        .get_default_values()
        .iter()
        .map(|d| d.to_string_lossy().into_owned())
        .filter(|d| !d.is_empty())
        .collect();
    if !defaults.is_empty() && !a.is_hide_default_value_set() && a.get_action().takes_values() {
        let _ = write!(text, " [default: {}]", defaults.join(", "));
    }
    // Paragraphs inside an item: .IP keeps the item's indent.
    for (i, p) in text.split("\n\n").enumerate() {
        if i > 0 {
            r.push_str(".IP\n");
        }
        let _ = writeln!(r, "{}", esc(&p.replace('\n', " ")));
    }
    let values: Vec<_> = a
        .get_possible_values()
        .into_iter()
        .filter(|p| !p.is_hide_set() && p.get_help().is_some())
        .collect();
    if !values.is_empty() && !a.is_hide_possible_values_set() {
        r.push_str(".RS\n");
        for p in values {
            let help = p.get_help().map(|h| h.to_string()).unwrap_or_default();
            let _ = writeln!(r, ".TP\n\\fB{}\\fR\n{}", esc(p.get_name()), esc(&help));
        }
        r.push_str(".RE\n");
    }
}

fn section(r: &mut String, title: &str, items: &[(&str, &str)]) {
    if items.is_empty() {
        return;
    }
    let _ = writeln!(r, ".SH {title}");
    for (term, text) in items {
        let _ = writeln!(r, ".TP\n\\fB{}\\fR\n{}", esc(term), esc(text));
    }
}

fn paragraphs(r: &mut String, text: &str) {
    for (i, p) in text.trim().split("\n\n").enumerate() {
        if i > 0 {
            r.push_str(".PP\n");
        }
        let _ = writeln!(r, "{}", esc(&p.replace('\n', " ")));
    }
}

/// Text safe as a roff text line: backslashes and hyphens escaped, and a
/// leading dot or quote kept from being read as a request.
fn esc(s: &str) -> String {
    let t = s.replace('\\', "\\e").replace('-', "\\-");
    if t.starts_with(['.', '\'']) {
        format!("\\&{t}")
    } else {
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every command has an entry in PAGES and every entry names a command,
    /// so a new command or a renamed one cannot ship without its sections.
    #[test]
    fn pages_match_the_commands() {
        let cmd = shown(&crate::Cli::command());
        let made = pages(&cmd, "2000-01-01").expect("every command has a PAGES entry");
        let names: Vec<String> = made.iter().map(|(n, _)| n.clone()).collect();
        let listed: Vec<String> = PAGES
            .iter()
            .map(|p| {
                let path: Vec<String> = p.path.split_whitespace().map(String::from).collect();
                page_name(&path)
            })
            .collect();
        assert_eq!(names, listed);
        assert!(names.contains(&"rawdisk-checkpoint-create".to_string()));
        assert!(!names.iter().any(|n| n.contains("generate-docs")));
    }

    #[test]
    fn escapes_roff() {
        assert_eq!(esc("a-b\\c"), "a\\-b\\ec");
        assert_eq!(esc(".x"), "\\&.x");
        assert_eq!(esc("'x"), "\\&'x");
    }
}
