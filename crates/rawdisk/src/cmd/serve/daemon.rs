//! The process around the server: `--fork`, the pid file, `--run`, signals
//! and the files removed at exit.

use std::fs;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use rawdisk_nbd::server::Server;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use super::args::{Args, LogArg};

/// --exit-with-parent: the kernel sends SIGTERM (a clean stop) when the
/// process that started this one exits. A parent that exits while the
/// request is made ends it at once; one gone before this process first
/// looked (it was already adopted) cannot be told apart, as with nbdkit.
pub(super) fn exit_with_parent() -> anyhow::Result<()> {
    // SAFETY: getppid cannot fail; prctl(PR_SET_PDEATHSIG) takes plain
    // integers and changes only this process's death signal.
    let (parent, set) = unsafe {
        let parent = libc::getppid();
        let set = libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGTERM as libc::c_ulong,
            0,
            0,
            0,
        );
        (parent, set)
    };
    if set != 0 {
        bail!("--exit-with-parent: {}", io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::getppid() } != parent {
        bail!("--exit-with-parent: the parent process has already exited");
    }
    Ok(())
}

/// --fork: returns in the child, detached from the terminal, with the pipe
/// its URI line goes to once it serves. The parent waits for that line,
/// prints it and exits 0; without it (the child failed and said why on
/// stderr) it exits 1. Neither the parent nor anything it drops removes the
/// child's socket and pid files.
pub(super) fn fork_into_background() -> anyhow::Result<fs::File> {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let (mut rd, wr) = io::pipe().context("--fork: cannot make a pipe")?;
    // SAFETY: called before the runtime or any other thread exists, so the
    // child is a full copy of a single-threaded process and may run any code.
    match unsafe { libc::fork() } {
        -1 => bail!("--fork: {}", io::Error::last_os_error()),
        0 => {
            drop(rd);
            // Its own session, so the terminal's hang-up and ^C do not reach
            // it; stdin and stdout to /dev/null (a `$(...)` capturing the URI
            // waits for stdout to close). stderr keeps the logs.
            let null = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")
                .context("--fork: /dev/null")?;
            // SAFETY: plain syscalls on descriptors this process owns; 0 and 1
            // are replaced atomically, nothing else holds them as owned fds.
            unsafe {
                libc::setsid();
                libc::dup2(null.as_raw_fd(), 0);
                libc::dup2(null.as_raw_fd(), 1);
            }
            Ok(fs::File::from(OwnedFd::from(wr)))
        }
        _child => {
            drop(wr);
            let mut said = String::new();
            let _ = rd.read_to_string(&mut said);
            // The URI for stdout, then any note for the user (stderr).
            if let Some((uri, note)) = said.split_once('\n') {
                // The server runs either way; a closed stdout loses only
                // the URI, which the caller chose not to read.
                let mut out = io::stdout();
                let _ = writeln!(out, "{uri}").and_then(|()| out.flush());
                let _ = io::stderr().write_all(note.as_bytes());
                std::process::exit(0);
            }
            std::process::exit(1);
        }
    }
}

/// --fork, once serving: the daemon's stderr leaves the caller's terminal
/// for /dev/null unless --log=stderr asked to keep it; the log itself
/// goes to syslog or nowhere. Until then a failure still reaches the
/// caller, whose parent process is waiting.
pub(super) fn detach_stderr(log: LogArg) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    if log == LogArg::Stderr {
        return Ok(());
    }
    let null = fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .context("--fork: /dev/null")?;
    // SAFETY: dup2 on descriptors this process owns; fd 2 is replaced
    // atomically and is not held as an owned fd anywhere.
    if unsafe { libc::dup2(null.as_raw_fd(), 2) } < 0 {
        bail!("--fork: stderr: {}", io::Error::last_os_error());
    }
    Ok(())
}

/// Removes the socket and pid files at exit, also on error, and the image
/// --create made if serving never started.
#[derive(Default)]
pub(super) struct Cleanup {
    pub(super) files: Vec<PathBuf>,
    /// Directories made for `-U -`, removed once the files in them are.
    pub(super) dirs: Vec<PathBuf>,
    pub(super) created: Option<PathBuf>,
    /// The --stats file, empty until the server has served.
    pub(super) stats: Option<PathBuf>,
}

impl Cleanup {
    /// The socket and pid files and their directories, for an exit that
    /// skips `drop` (a second signal).
    pub(super) fn at_exit(&self) -> ExitFiles {
        ExitFiles {
            files: self.files.clone(),
            dirs: self.dirs.clone(),
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for f in self.created.iter().chain(&self.stats) {
            let _ = fs::remove_file(f);
        }
        ExitFiles {
            files: std::mem::take(&mut self.files),
            dirs: std::mem::take(&mut self.dirs),
        }
        .remove();
    }
}

/// What [`Cleanup`] removes whenever the server exits.
#[derive(Clone)]
pub(super) struct ExitFiles {
    files: Vec<PathBuf>,
    dirs: Vec<PathBuf>,
}

impl ExitFiles {
    fn remove(&self) {
        for f in &self.files {
            let _ = fs::remove_file(f);
        }
        for d in &self.dirs {
            let _ = fs::remove_dir(d);
        }
    }
}

/// The pid file being made: a new file next to its path, renamed over it
/// once the pid is in it, so a file (or a symlink) put at the path is
/// replaced, never written through.
pub(super) struct PidFile {
    file: fs::File,
    tmp: PathBuf,
    path: PathBuf,
}

/// Makes the pid file's temporary file now (O_EXCL | O_NOFOLLOW, mode 0644
/// whatever the umask), so a bad path fails before anything is made; a
/// symlink or anything but a regular file at the path is refused. The pid
/// is written once the server is ready ([`PidFile::write`]).
pub(super) fn open_pid_file(args: &Args, cleanup: &mut Cleanup) -> anyhow::Result<Option<PidFile>> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let Some(p) = &args.pid_file else {
        return Ok(None);
    };
    let what = || format!("cannot write pid file '{}'", p.display());
    match fs::symlink_metadata(p) {
        Ok(m) if m.file_type().is_symlink() => {
            bail!("{}: refusing to follow a symlink there", what())
        }
        Ok(m) if !m.is_file() => bail!("{}: it exists and is not a regular file", what()),
        _ => {}
    }
    let Some(name) = p.file_name() else {
        bail!("{}: the path names no file", what());
    };
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = p.with_file_name(tmp_name);
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o644)
        .open(&tmp)
        .with_context(what)?;
    cleanup.files.push(tmp.clone());
    // fchmod: the mode asked for, not what the umask left of it.
    file.set_permissions(fs::Permissions::from_mode(0o644))
        .with_context(what)?;
    cleanup.files.push(p.clone());
    Ok(Some(PidFile {
        file,
        tmp,
        path: p.clone(),
    }))
}

impl PidFile {
    /// Write `pid` and put the file at its path (rename: atomic, and a
    /// symlink put there meanwhile is replaced, not followed).
    pub(super) fn write(mut self, pid: u32) -> anyhow::Result<()> {
        let what = || format!("cannot write pid file '{}'", self.path.display());
        writeln!(self.file, "{pid}").with_context(what)?;
        fs::rename(&self.tmp, &self.path).with_context(what)
    }
}

/// Starts `sh -c CMD` with $uri (and $unixsocket on a Unix socket) set; when it exits the server is stopped as
/// by SIGTERM, and its exit status (128+signal when killed, as the shell
/// reports it) is sent on the returned channel.
pub(super) fn start_run(
    cmd: &str,
    uri: &str,
    socket: Option<&Path>,
    stop: Arc<watch::Sender<bool>>,
) -> anyhow::Result<std::sync::mpsc::Receiver<u8>> {
    use std::os::unix::process::ExitStatusExt;
    let mut sh = std::process::Command::new("/bin/sh");
    sh.arg("-c").arg(cmd).env("uri", uri);
    // nbdkit's $unixsocket: the path, for clients that want no URI.
    if let Some(p) = socket {
        sh.env("unixsocket", p);
    }
    let mut child = sh.spawn().with_context(|| format!("cannot run '{cmd}'"))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let code = match child.wait() {
            Ok(st) => st
                .code()
                .map(|c| c as u8)
                .or(st.signal().map(|n| 128 + n as u8))
                .unwrap_or(1),
            Err(_) => 1,
        };
        tracing::info!("--run command exited with status {code}: stopping");
        let _ = tx.send(code);
        let _ = stop.send(true);
    });
    Ok(rx)
}

/// The signals that stop the server (SIGQUIT, SIGUSR2 and SIGALRM would
/// otherwise end the process without a flush).
const STOP_SIGNALS: [(libc::c_int, &str); 6] = [
    (libc::SIGTERM, "SIGTERM"),
    (libc::SIGINT, "SIGINT"),
    (libc::SIGHUP, "SIGHUP"),
    (libc::SIGQUIT, "SIGQUIT"),
    (libc::SIGUSR2, "SIGUSR2"),
    (libc::SIGALRM, "SIGALRM"),
];

/// Unblocks the signals the server handles, in the one thread there is
/// (the runtime's threads inherit the mask): see [`crate::signals::unblock`].
pub(super) fn unblock_signals() -> anyhow::Result<()> {
    let mut all = STOP_SIGNALS.map(|s| s.0).to_vec();
    all.push(libc::SIGUSR1);
    crate::signals::unblock(&all)
}

/// [`STOP_SIGNALS`]: stop accepting, finish in-flight requests, flush,
/// exit 0; a second one removes the socket and pid files (`files`) and
/// exits at once with status 1. SIGUSR1: log the totals (the `--stats`
/// document) and go on.
pub(super) fn handle_signals(
    stop: Arc<watch::Sender<bool>>,
    server: Server,
    files: ExitFiles,
) -> anyhow::Result<()> {
    second_signal_backstop(files.clone())?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for (n, name) in STOP_SIGNALS {
        let mut sig = signal(SignalKind::from_raw(n)).with_context(|| format!("{name} handler"))?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while sig.recv().await.is_some() {
                if tx.send(name).is_err() {
                    break;
                }
            }
        });
    }
    // A log line must never cost the stop: a panic in one (it happened on
    // a closed stderr) ended this task and left every later signal unheard.
    let log = |line: &dyn Fn()| {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(line));
    };
    tokio::spawn(async move {
        if let Some(name) = rx.recv().await {
            log(&|| tracing::info!("{name}: finishing in-flight requests"));
            let _ = stop.send(true);
        }
        // A second signal while draining: give up waiting.
        if let Some(name) = rx.recv().await {
            log(&|| tracing::warn!("second signal ({name}): exiting without waiting"));
            // process::exit runs no destructors: remove them here, so the
            // next start finds no stale socket or pid file (GNU timeout and
            // impatient operators send two signals).
            files.remove();
            std::process::exit(1);
        }
    });
    let mut usr1 = signal(SignalKind::user_defined1()).context("SIGUSR1 handler")?;
    tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            // The --stats document, so one set of names serves both.
            tracing::info!(
                "SIGUSR1: totals {}",
                super::stats::stats_json(&server.totals())
            );
        }
    });
    Ok(())
}

/// How long the signal task has to log a second signal and exit before the
/// backstop exits without it.
const BACKSTOP_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The second stop signal ends the process even when no runtime thread is
/// free to run the signal task (each stuck writing to a stderr pipe that
/// its reader never reads): a plain thread, woken from the signal handler
/// itself, removes `files` and exits with status 1 a moment after the task
/// would have.
fn second_signal_backstop(files: ExitFiles) -> anyhow::Result<()> {
    crate::signals::on_two(
        &STOP_SIGNALS,
        |_| {},
        move |_, _| {
            std::thread::sleep(BACKSTOP_WAIT);
            files.remove();
            1
        },
    )
}
