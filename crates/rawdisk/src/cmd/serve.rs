//! `rawdisk serve [-U|-k|--socket PATH | -b|-i|--bind HOST[:PORT] -p|--port PORT]
//! [-r|--read-only] [-f raw] [-e|--export-name NAME] [-P|--pid-file PATH] [-t] [--run CMD | --fork] [--cache writeback|none] [--write-behind] [--map-writes]
//! [--create SIZE [--preallocation off|falloc|full]] [--pid-file PATH]
//! [--idle-timeout DURATION] [--tls off|on|require] [--tls-certificates DIR]
//! [--tls-psk FILE] [--tls-verify-peer]
//! [--track-changes [--bitmap-granularity SIZE] [--state-dir DIR]] [-v] TARGET`
//!
//! Prints the URI to connect to on stdout, one line, once the listener is
//! accepting. SIGINT/SIGTERM/SIGHUP: stop accepting, finish in-flight
//! requests, flush, exit 0. SIGUSR1: log the server's totals.

use super::{CacheArg, PreallocArg};
use std::fs;
use std::io::{self, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use rawdisk_nbd::server::{Listener, Server, ServerConfig, Totals, WriteBehind};
use rawdisk_nbd::tls::ServerTls;
use rawdisk_storage::cbt::{TrackOptions, Tracker};
use rawdisk_storage::{CacheMode, OpenOptions, Prealloc, Target};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

/// Export a file or block device over NBD.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk serve --create 10G -U /tmp/disk.sock disk.img\n  \
    rawdisk serve -r -e vm -b 0.0.0.0 -p 10809 vm.img\n  \
    rawdisk serve --cache none --tls-certificates /etc/pki/rawdisk /dev/vg0/lv0\n  \
    rawdisk serve --dir /var/lib/images -U /run/images.sock")]
pub struct Args {
    /// Listen on this Unix socket (replaces a stale socket file). -U as
    /// nbdkit, -k as qemu-nbd.
    #[arg(short = 'U', short_alias = 'k', long, value_name = "PATH", conflicts_with_all = ["bind", "port"])]
    socket: Option<PathBuf>,
    /// Listen on this TCP address: HOST:PORT, HOST (port from --port or
    /// 10809), or PORT alone, which listens on 127.0.0.1 only, like the
    /// default [default: 127.0.0.1:10809]. -b as qemu-nbd, -i as nbdkit.
    #[arg(short = 'b', short_alias = 'i', long, value_name = "HOST[:PORT]")]
    bind: Option<String>,
    /// TCP port to listen on [default: 10809].
    #[arg(short = 'p', long, value_name = "PORT")]
    port: Option<u16>,
    /// Refuse writes (NBD_FLAG_READ_ONLY); opens the target read-only.
    #[arg(short = 'r', long)]
    read_only: bool,
    /// With --dir, exports that look like another image format are refused
    /// at NBD_OPT_GO unless this is given.
    #[command(flatten)]
    format: super::FormatOpt,
    /// Name of the export; clients asking for another name are refused.
    #[arg(
        short = 'e',
        long,
        value_name = "NAME",
        default_value = "",
        conflicts_with = "dir"
    )]
    export_name: String,
    /// Export every regular file and block device directly inside DIR, each
    /// under its file name (nbdkit's dir=); files added or removed are seen
    /// by the next connection. Symlinks are followed only inside DIR.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["target", "create"])]
    dir: Option<PathBuf>,
    /// With --dir: the export a client asking for the empty name gets
    /// (otherwise it is refused and told to pick a name).
    #[arg(long, value_name = "NAME", requires = "dir", conflicts_with = "target")]
    default_export: Option<String>,
    /// Accepted for qemu-nbd's habit: rawdisk always serves until stopped,
    /// whatever the clients do.
    #[arg(short = 't', long)]
    persistent: bool,
    /// Run this shell command once the server is ready, with $uri set to
    /// the URI to connect to, then stop the server when it exits and exit
    /// with its status (nbdkit's --run). The URI is not printed.
    #[arg(long, value_name = "CMD", conflicts_with = "fork")]
    run: Option<String>,
    /// Go into the background once listening (nbdkit's --fork): the command
    /// prints the URI and exits 0 only when the server accepts connections;
    /// the server keeps running, detached, and --pid-file gets its pid.
    #[arg(long)]
    fork: bool,
    /// Page cache or O_DIRECT.
    #[arg(long, value_enum, default_value = "writeback")]
    cache: CacheArg,
    /// Create TARGET with this size first (qemu-img suffixes); an existing
    /// target of the same size is served as it is, another size refused.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true, value_parser = crate::size::size_arg)]
    create: Option<u64>,
    /// Allocation of a file made by --create.
    #[arg(long, value_enum, requires = "create", default_value = "off")]
    preallocation: PreallocArg,
    /// Write the server's pid here once it is ready; removed at exit.
    #[arg(short = 'P', long, value_name = "PATH")]
    pid_file: Option<PathBuf>,
    /// Write the server's totals here as JSON when it exits (SIGUSR1 logs
    /// the same document; docs/json.md): uptime-seconds; connections: accepted, negotiated, open,
    /// refused-at-cap, closed-in-handshake, unknown-export, tls-required;
    /// requests: per command (read, write, flush, trim, cache,
    /// write-zeroes, block-status, disc, other) its requests and bytes;
    /// errors: replies per NBD error (eperm, eio, enomem, einval, enospc,
    /// eoverflow, enotsup, eshutdown, other); peak-in-flight.
    #[arg(long, value_name = "FILE")]
    stats: Option<PathBuf>,
    /// Seconds a client gets to finish the handshake.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    handshake_timeout: f64,
    /// Connections served at once; more are closed at accept. At most half
    /// of them may be in the handshake at once.
    #[arg(long, value_name = "N", default_value_t = 100)]
    max_connections: usize,
    /// Close a connection that has had nothing in flight and sent nothing,
    /// or has read none of its replies, for this long (90, 90s, 15m, 2h)
    /// [default: never].
    #[arg(long, value_name = "DURATION", value_parser = duration_arg)]
    idle_timeout: Option<Duration>,
    /// When writes of 256 KiB or more start their write-back right away
    /// (sync_file_range), so a client's final flush has little left to do:
    /// on (faster imports that end with a flush, slower streams of writes
    /// that are never flushed), off, or auto: on until the clients rewrite
    /// what they wrote since their last flush. `--write-behind` alone is
    /// on. No effect with --cache none or on tmpfs/ramfs.
    #[arg(long, value_enum, value_name = "WHEN", default_value = "auto",
          num_args = 0..=1, default_missing_value = "on")]
    write_behind: WriteBehindArg,
    /// Receive write payloads of 64 KiB or more straight into the file's
    /// page cache through a shared mapping (regular files, pages already
    /// cached, no FUA): one copy instead of two, and less memory. The cost:
    /// a client that disconnects in the middle of a write's payload leaves
    /// the part that arrived written (without it, nothing of that write is).
    /// No effect with --cache none or on block devices.
    #[arg(long)]
    map_writes: bool,
    /// Threads doing storage calls [default: 16, 64 with --cache none].
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// TLS (NBD_OPT_STARTTLS): `on` offers it and still serves plaintext
    /// clients, `require` refuses them. Giving --tls-certificates or
    /// --tls-psk without --tls means `require`.
    #[arg(long, value_enum, value_name = "MODE")]
    tls: Option<TlsArg>,
    /// X.509 credentials in nbdkit's and qemu's layout: DIR/server-cert.pem,
    /// DIR/server-key.pem, and for --tls-verify-peer DIR/ca-cert.pem and an
    /// optional DIR/ca-crl.pem.
    #[arg(long, value_name = "DIR", conflicts_with = "tls_psk")]
    tls_certificates: Option<PathBuf>,
    /// Pre-shared keys: lines `username:hexkey` (the psktool format of
    /// GnuTLS and nbdkit).
    #[arg(long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
    /// Require a client certificate that chains to DIR/ca-cert.pem and is
    /// not revoked by DIR/ca-crl.pem.
    #[arg(long)]
    tls_verify_peer: bool,
    /// Keep a bitmap of the ranges clients change (WRITE, WRITE_ZEROES,
    /// TRIM) in a state file next to the target (TARGET.rawdisk-cbt), made
    /// durable before each FLUSH is acknowledged; each checkpoint of
    /// `rawdisk checkpoint` is then offered as the metadata context
    /// rawdisk:changed:NAME (docs/cbt.md). With --dir, one per export.
    /// Only writes through this server are seen: another process writing
    /// the same file while it is served is not.
    #[arg(long)]
    track_changes: bool,
    /// Bytes per bit of a new state file's bitmaps: a power of two from 4K
    /// to 64M [default: 64K]; an existing state file's must match.
    #[arg(long, value_name = "SIZE", requires = "track_changes", value_parser = crate::size::size_arg)]
    bitmap_granularity: Option<u64>,
    /// Keep the state files here (DIR/NAME.rawdisk-cbt) instead of next
    /// to the target; needed for block devices.
    #[arg(long, value_name = "DIR", requires = "track_changes")]
    state_dir: Option<PathBuf>,
    /// File or block device to export.
    #[arg(required_unless_present = "dir")]
    target: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    // First, while the process has one thread: it unsets the variables, and
    // setenv/unsetenv race with any other thread's getenv.
    let activated = take_activation_fd();
    if let Some(t) = &args.target {
        super::local_only(t, "serve")?;
    }
    if !(args.handshake_timeout > 0.0 && args.handshake_timeout.is_finite()) {
        bail!("--handshake-timeout must be a positive number of seconds");
    }
    let tls = match server_tls(&args) {
        Ok(t) => t,
        Err(TlsSetup::Usage(msg)) => {
            eprintln!("rawdisk: {msg} (see 'rawdisk --help')");
            return Ok(ExitCode::from(crate::EXIT_USAGE));
        }
        Err(TlsSetup::Load(e)) => return Err(e),
    };
    if let Some(g) = args.bitmap_granularity {
        use rawdisk_storage::cbt::{MAX_GRANULARITY, MIN_GRANULARITY};
        if !g.is_power_of_two() || !(MIN_GRANULARITY..=MAX_GRANULARITY).contains(&g) {
            return Err(super::UsageError(format!(
                "--bitmap-granularity {g}: must be a power of two from 4K to 64M \
                 (see 'rawdisk serve --help')"
            ))
            .into());
        }
    }
    let track = args.track_changes.then(|| TrackOptions {
        granularity: args.bitmap_granularity,
        state_dir: args.state_dir.clone(),
    });
    let cache = args.cache.into();
    // Everything that can fail goes before --create makes anything: the
    // listening socket (in use, no permission) and the pid file.
    let mut cleanup = Cleanup::default();
    let listening = listen(&args, activated, &mut cleanup)?;
    let pid_file = open_pid_file(&args, &mut cleanup)?;
    if let Some(p) = &args.stats {
        // Made now, so a bad path fails before serving, not at exit.
        fs::File::create(p)
            .with_context(|| format!("cannot write statistics '{}'", p.display()))?;
        cleanup.stats = Some(p.clone());
    }
    let cfg = ServerConfig {
        export_name: args.export_name.clone(),
        read_only: args.read_only,
        max_connections: args.max_connections.max(1),
        handshake_timeout: Duration::from_secs_f64(args.handshake_timeout),
        idle_timeout: args.idle_timeout,
        write_behind: args.write_behind.into(),
        map_writes: args.map_writes,
        tls,
        track_changes: track.clone(),
        raw: args.format.raw(),
        ..Default::default()
    };
    let open = OpenOptions {
        read_only: args.read_only,
        cache,
        ..Default::default()
    };
    let (server, what) = match (&args.dir, &args.target) {
        (Some(dir), _) => {
            let server = Server::new_dir(dir, open, args.default_export.clone(), cfg)
                .map_err(|e| anyhow::anyhow!("cannot serve directory '{}': {e}", dir.display()))?;
            (server, format!("directory '{}'", dir.display()))
        }
        (None, Some(path)) => {
            let target = open_target(&args, path, open, &mut cleanup)?;
            if !args.format.raw() {
                let shown = path.display().to_string();
                let f = rawdisk_storage::format::probe_target(&target)
                    .with_context(|| format!("cannot read '{shown}'"))?;
                if let Some(f) = f {
                    bail!("{}", rawdisk_storage::format::refusal(&shown, f));
                }
            }
            let what = format!(
                "'{}' ({} bytes, {:?})",
                path.display(),
                target.size(),
                target.kind()
            );
            let tracker = match &track {
                Some(opts) => Some(open_tracker(path, &target, opts)?),
                None => None,
            };
            tracing::info!("storage capabilities: {}", target.caps().snapshot());
            (Server::new_tracked(target, tracker, cfg), what)
        }
        (None, None) => unreachable!("clap requires TARGET or --dir"),
    };
    // Forks here: everything that can fail on the command line has been
    // checked, the socket listens, the target is open, and no thread exists
    // yet (the server starts its threads with the runtime, below).
    let ready = if args.fork {
        Some(fork_into_background()?)
    } else {
        None
    };

    // Storage calls block on the blocking pool. Through the page cache more
    // threads than this only add wake-ups and lock contention; O_DIRECT reads
    // and writes wait on the device, so there the pool is the device queue
    // depth (docs/architecture.md, Threads).
    let threads = args.threads.unwrap_or(match cache {
        CacheMode::Writeback => 16,
        CacheMode::None => 64,
    });
    // Two arenas whatever the thread counts: the hot buffers come from the
    // server's pool, and an arena per blocking thread only keeps freed
    // buffers resident (docs/benchmarks.md, Memory).
    if !rawdisk_storage::sys::limit_malloc_arenas(2) {
        tracing::debug!("mallopt(M_ARENA_MAX) refused; default malloc arenas");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(async_workers())
        .max_blocking_threads(threads.max(1))
        .thread_name("rawdisk-serve")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(serve(
        args, server, what, listening, pid_file, cleanup, ready,
    ))
}

/// Opens TARGET, made first by --create; errors say how to fix them.
fn open_target(
    args: &Args,
    path: &Path,
    open: OpenOptions,
    cleanup: &mut Cleanup,
) -> anyhow::Result<Arc<Target>> {
    let created = match args.create {
        Some(size) => create_target(path, size, args.preallocation.into(), open.cache)?,
        None => false,
    };
    if created {
        // Removed again if serving fails before it starts.
        cleanup.created = Some(path.to_path_buf());
    }
    let opened = Target::open(path, &open);
    let target = match opened {
        Ok(t) => Arc::new(t),
        Err(e) => {
            let msg = rawdisk_image::endpoint::open_error_message(path, &e);
            // The path once: "cannot serve 'P': why", not "...: open P: why".
            let open = format!("open {}: ", path.display());
            let msg = msg.strip_prefix(&open).unwrap_or(&msg);
            // Opened for writing by default (qemu-nbd and nbdkit do the same):
            // a file the user may only read needs the flag, so say which.
            let denied = e
                .errno()
                .map(|n| std::io::Error::from_raw_os_error(n).kind());
            let hint = match denied {
                Some(
                    std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem,
                ) if !args.read_only => {
                    "; it cannot be opened for writing: serve it with --read-only"
                }
                _ => "",
            };
            bail!("cannot serve '{}': {msg}{hint}", path.display());
        }
    };
    if let Some(size) = args.create {
        if !created && target.size() != size {
            bail!(
                "'{}' exists with size {} bytes, not the {size} bytes --create asks for",
                path.display(),
                target.size()
            );
        }
    }
    Ok(target)
}

/// `--track-changes` of a single target: fails when another server tracks
/// it or its state file cannot be made.
fn open_tracker(path: &Path, target: &Target, opts: &TrackOptions) -> anyhow::Result<Arc<Tracker>> {
    let t = Tracker::for_target(target, opts)
        .map_err(|e| anyhow::anyhow!("cannot serve '{}': {e}", path.display()))?;
    tracing::info!(
        "tracking changes in '{}' ({} bytes per bit)",
        t.state_path().display(),
        t.granularity()
    );
    Ok(Arc::new(t))
}

/// --fork: returns in the child, detached from the terminal, with the pipe
/// its URI line goes to once it serves. The parent waits for that line,
/// prints it and exits 0; without it (the child failed and said why on
/// stderr) it exits 1. Neither the parent nor anything it drops removes the
/// child's socket and pid files.
fn fork_into_background() -> anyhow::Result<fs::File> {
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
            let mut line = String::new();
            let _ = rd.read_to_string(&mut line);
            if line.ends_with('\n') {
                // The server runs either way; a closed stdout loses only
                // the URI, which the caller chose not to read.
                let mut out = io::stdout();
                let _ = out.write_all(line.as_bytes()).and_then(|()| out.flush());
                std::process::exit(0);
            }
            std::process::exit(1);
        }
    }
}

/// A duration: seconds, or a number with ms, s, m or h.
fn duration_arg(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale = match unit.trim() {
        "" | "s" => 1.0,
        "ms" => 0.001,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        u => return Err(format!("unknown unit '{u}' (use ms, s, m or h)")),
    };
    match num.parse::<f64>() {
        Ok(v) if v > 0.0 && (v * scale).is_finite() => Ok(Duration::from_secs_f64(v * scale)),
        _ => Err(format!("'{s}' is not a positive duration")),
    }
}

/// `--tls`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TlsArg {
    /// No TLS: NBD_OPT_STARTTLS is refused.
    Off,
    /// TLS offered; plaintext clients are served too.
    On,
    /// Only NBD_OPT_STARTTLS and NBD_OPT_ABORT are answered before TLS.
    Require,
}

enum TlsSetup {
    /// A bad combination of flags (exit 2).
    Usage(&'static str),
    /// Credentials that cannot be loaded.
    Load(anyhow::Error),
}

/// The server's TLS from the --tls* flags; None when TLS is off.
fn server_tls(args: &Args) -> Result<Option<ServerTls>, TlsSetup> {
    if args.tls_verify_peer && args.tls_certificates.is_none() {
        return Err(TlsSetup::Usage(
            "--tls-verify-peer needs --tls-certificates DIR",
        ));
    }
    let creds = args.tls_certificates.is_some() || args.tls_psk.is_some();
    // Credentials alone mean require: giving them and still serving
    // plaintext clients would be a trap.
    let require = match args.tls {
        Some(TlsArg::Off) => {
            if creds {
                tracing::info!("--tls off: the TLS credentials are not used");
            }
            return Ok(None);
        }
        None if !creds => return Ok(None),
        Some(TlsArg::On) => false,
        Some(TlsArg::Require) | None => true,
    };
    let loaded = match (&args.tls_certificates, &args.tls_psk) {
        (Some(dir), _) => ServerTls::x509(dir, args.tls_verify_peer, require),
        (None, Some(file)) => ServerTls::psk(file, require),
        (None, None) => {
            return Err(TlsSetup::Usage(
                "--tls on/require needs --tls-certificates DIR or --tls-psk FILE",
            ))
        }
    };
    loaded
        .map(Some)
        .map_err(|e| TlsSetup::Load(anyhow::Error::new(e).context("cannot set up TLS")))
}

/// Async workers for the sockets: one per CPU the process may use. At least
/// two, so a request run on its connection's reader never holds up the other
/// connections; at most 16, as they only move bytes between sockets and
/// buffers while the storage calls run on the blocking pool.
fn async_workers() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 16))
}

/// --create: make the file if it does not exist. Returns whether it did.
fn create_target(path: &Path, size: u64, mode: Prealloc, cache: CacheMode) -> anyhow::Result<bool> {
    match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
    {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("cannot create '{}'", path.display())),
    }
    let made = (|| -> anyhow::Result<()> {
        let t = Target::open(
            path,
            &OpenOptions {
                cache,
                ..Default::default()
            },
        )?;
        t.preallocate(size, mode)?;
        t.flush()?;
        Ok(())
    })();
    if let Err(e) = made {
        let _ = fs::remove_file(path);
        return Err(e)
            .with_context(|| format!("cannot create '{}' ({size} bytes)", path.display()));
    }
    tracing::info!("created '{}' ({size} bytes)", path.display());
    Ok(true)
}

/// Percent-encodes for an NBD URI (RFC 3986 unreserved characters stay,
/// and '/' where it separates path segments).
fn escape(s: &str, keep_slash: bool) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'.' | b'_' | b'~')
            || (keep_slash && b == b'/')
        {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Removes the socket and pid files at exit, also on error, and the image
/// --create made if serving never started.
#[derive(Default)]
struct Cleanup {
    files: Vec<PathBuf>,
    created: Option<PathBuf>,
    /// The --stats file, empty until the server has served.
    stats: Option<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for f in self.files.iter().chain(&self.created).chain(&self.stats) {
            let _ = fs::remove_file(f);
        }
    }
}

/// A bound listening socket, before the runtime exists.
enum Bound {
    Unix(std::os::unix::net::UnixListener),
    Tcp(std::net::TcpListener),
}

/// Binds (or takes the activated socket) and returns it with the URI that
/// reaches it.
fn listen(
    args: &Args,
    activated: Option<OwnedFd>,
    cleanup: &mut Cleanup,
) -> anyhow::Result<(Bound, String)> {
    let export = escape(&args.export_name, false);
    if let Some(fd) = activated {
        return activated_listener(fd, &export);
    }
    if let Some(path) = &args.socket {
        remove_stale_socket(path)?;
        let l = std::os::unix::net::UnixListener::bind(path)
            .with_context(|| format!("cannot listen on '{}'", path.display()))?;
        cleanup.files.push(path.clone());
        l.set_nonblocking(true)
            .with_context(|| format!("cannot listen on '{}'", path.display()))?;
        let abs = std::path::absolute(path).unwrap_or_else(|_| path.clone());
        let uri = format!(
            "nbd+unix:///{export}?socket={}",
            escape(&abs.to_string_lossy(), true)
        );
        return Ok((Bound::Unix(l), uri));
    }
    let bind = &listen_address(args.bind.as_deref(), args.port)?;
    let l =
        std::net::TcpListener::bind(bind).with_context(|| format!("cannot listen on {bind}"))?;
    l.set_nonblocking(true)
        .with_context(|| format!("cannot listen on {bind}"))?;
    let addr = l.local_addr().context("local address")?;
    let host = match addr.ip() {
        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        std::net::IpAddr::V4(ip) => ip.to_string(),
    };
    Ok((
        Bound::Tcp(l),
        format!("nbd://{host}:{}/{export}", addr.port()),
    ))
}

/// The TCP address to listen on from --bind and --port. A bare PORT means
/// loopback, like the default: exposing a disk on every address must be
/// asked for by name (0.0.0.0, ::).
fn listen_address(bind: Option<&str>, port: Option<u16>) -> anyhow::Result<String> {
    const PORT: u16 = 10809;
    let Some(b) = bind else {
        return Ok(format!("127.0.0.1:{}", port.unwrap_or(PORT)));
    };
    let both = || {
        anyhow::Error::new(super::UsageError(format!(
            "--bind '{b}' already names a port; --port cannot change it (see 'rawdisk serve --help')"
        )))
    };
    if !b.is_empty() && b.bytes().all(|c| c.is_ascii_digit()) {
        return match port {
            Some(_) => Err(both()),
            None => Ok(format!("127.0.0.1:{b}")),
        };
    }
    // HOST:PORT, [V6]:PORT; a bare V6 address has several colons.
    let has_port = if b.starts_with('[') {
        b.contains("]:")
    } else {
        b.matches(':').count() == 1
    };
    if has_port {
        return match port {
            Some(_) => Err(both()),
            None => Ok(b.to_string()),
        };
    }
    let host = b.trim_start_matches('[').trim_end_matches(']');
    let port = port.unwrap_or(PORT);
    Ok(if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}

/// Opens (creates) the pid file now, so a bad path fails before anything is
/// made; the pid is written once the server is ready.
fn open_pid_file(args: &Args, cleanup: &mut Cleanup) -> anyhow::Result<Option<fs::File>> {
    let Some(p) = &args.pid_file else {
        return Ok(None);
    };
    let f =
        fs::File::create(p).with_context(|| format!("cannot write pid file '{}'", p.display()))?;
    cleanup.files.push(p.clone());
    Ok(Some(f))
}

async fn serve(
    args: Args,
    server: Server,
    what: String,
    (bound, uri): (Bound, String),
    pid_file: Option<fs::File>,
    mut cleanup: Cleanup,
    ready: Option<fs::File>,
) -> anyhow::Result<ExitCode> {
    let listener = match bound {
        Bound::Unix(l) => {
            Listener::Unix(tokio::net::UnixListener::from_std(l).context("listening socket")?)
        }
        Bound::Tcp(l) => {
            Listener::Tcp(tokio::net::TcpListener::from_std(l).context("listening socket")?)
        }
    };

    // The URI spec's schemes for "TLS or nothing".
    let uri = match server.tls() {
        Some(t) if t.required() => uri.replacen("nbd", "nbds", 1),
        _ => uri,
    };
    if let Some(t) = server.tls() {
        let mode = if t.required() { "required" } else { "offered" };
        tracing::info!("TLS {mode}: {}", t.describe());
    }
    let read_only = server.read_only();
    let (min, pref, max) = server.block_sizes();
    tracing::info!(
        "serving {what} (cache={}{}{}{}) block sizes {min}/{pref}/{max}",
        match args.cache {
            CacheArg::Writeback => "writeback",
            CacheArg::None => "none",
        },
        if args.read_only { ", read-only" } else { "" },
        match (args.write_behind, args.cache) {
            (WriteBehindArg::On, CacheArg::Writeback) => ", write-behind",
            (WriteBehindArg::Off, CacheArg::Writeback) => ", write-behind off",
            _ => "",
        },
        if args.map_writes && args.cache == CacheArg::Writeback {
            ", map-writes"
        } else {
            ""
        },
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    handle_signals(stop_tx.clone(), server.clone())?;

    if let (Some(mut f), Some(p)) = (pid_file, &args.pid_file) {
        writeln!(f, "{}", std::process::id())
            .with_context(|| format!("cannot write pid file '{}'", p.display()))?;
    }
    // Serving starts: the created image stays whatever happens next.
    cleanup.created = None;
    cleanup.stats = None;
    let run = match &args.run {
        Some(cmd) => Some(start_run(cmd, &uri, stop_tx)?),
        None => {
            match ready {
                // --fork: the parent prints it and exits.
                Some(mut pipe) => writeln!(pipe, "{uri}").context("--fork: telling the parent")?,
                None => {
                    let mut out = io::stdout().lock();
                    writeln!(out, "{uri}").context("stdout")?;
                    out.flush().context("stdout")?;
                }
            }
            None
        }
    };

    let served = server.serve(listener, stop_rx).await;
    if let Some(p) = &args.stats {
        let json = stats_json(&server.totals()).to_string() + "\n";
        fs::write(p, json).with_context(|| format!("cannot write statistics '{}'", p.display()))?;
    }
    served.context("server failed")?;
    if read_only {
        tracing::info!("all connections closed");
    } else {
        tracing::info!("all connections closed; target flushed");
    }
    match run {
        // Stopped by a signal before the command ended: the command's status
        // is not known; the server's own is the answer.
        Some(status) => match status.try_recv() {
            Ok(code) => Ok(ExitCode::from(code)),
            Err(_) => Ok(ExitCode::SUCCESS),
        },
        None => Ok(ExitCode::SUCCESS),
    }
}

/// `--stats`: the totals as JSON, keys in qemu-img's kebab-case
/// (NBD_CMD_WRITE_ZEROES is "write-zeroes", NBD_EIO "eio").
fn stats_json(t: &Totals) -> serde_json::Value {
    use serde_json::{json, Map, Value};
    let key = |name: &str, prefix: &str| {
        name.trim_start_matches(prefix)
            .to_ascii_lowercase()
            .replace('_', "-")
    };
    let requests: Map<String, Value> = t
        .tally
        .commands()
        .map(|(c, n, bytes)| {
            let k = c.map_or("other".into(), |c| key(c.name(), "NBD_CMD_"));
            (k, json!({ "requests": n, "bytes": bytes }))
        })
        .collect();
    let errors: Map<String, Value> = t
        .tally
        .errors()
        .map(|(e, n)| {
            let k = match e {
                0 => "other".into(),
                e => key(rawdisk_nbd::proto::error_name(e), "NBD_"),
            };
            (k, json!(n))
        })
        .collect();
    json!({
        "uptime-seconds": t.uptime.as_secs_f64(),
        "connections": {
            "accepted": t.accepted,
            "negotiated": t.negotiated,
            "open": t.open,
            "refused-at-cap": t.refused_at_cap,
            "closed-in-handshake": t.closed_in_handshake,
            "unknown-export": t.unknown_export,
            "tls-required": t.tls_required,
        },
        "requests": requests,
        "errors": errors,
        "peak-in-flight": t.tally.peak_in_flight,
    })
}

/// Starts `sh -c CMD` with $uri set; when it exits the server is stopped as
/// by SIGTERM, and its exit status (128+signal when killed, as the shell
/// reports it) is sent on the returned channel.
fn start_run(
    cmd: &str,
    uri: &str,
    stop: Arc<watch::Sender<bool>>,
) -> anyhow::Result<std::sync::mpsc::Receiver<u8>> {
    use std::os::unix::process::ExitStatusExt;
    let mut child = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(cmd)
        .env("uri", uri)
        .spawn()
        .with_context(|| format!("cannot run '{cmd}'"))?;
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

/// SIGTERM, SIGINT, SIGHUP (and SIGQUIT, SIGUSR2, SIGALRM, which would
/// otherwise end the process without a flush): stop accepting, finish
/// in-flight requests, flush, exit 0; a second one exits at once with
/// status 1. SIGUSR1: log the totals (the `--stats` document) and go on.
fn handle_signals(stop: Arc<watch::Sender<bool>>, server: Server) -> anyhow::Result<()> {
    let kinds = [
        (SignalKind::terminate(), "SIGTERM"),
        (SignalKind::interrupt(), "SIGINT"),
        (SignalKind::hangup(), "SIGHUP"),
        (SignalKind::quit(), "SIGQUIT"),
        (SignalKind::user_defined2(), "SIGUSR2"),
        (SignalKind::alarm(), "SIGALRM"),
    ];
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for (kind, name) in kinds {
        let mut sig = signal(kind).with_context(|| format!("{name} handler"))?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while sig.recv().await.is_some() {
                if tx.send(name).is_err() {
                    break;
                }
            }
        });
    }
    tokio::spawn(async move {
        if let Some(name) = rx.recv().await {
            tracing::info!("{name}: finishing in-flight requests");
            let _ = stop.send(true);
        }
        // A second signal while draining: give up waiting.
        if let Some(name) = rx.recv().await {
            tracing::warn!("second signal ({name}): exiting without waiting");
            std::process::exit(1);
        }
    });
    let mut usr1 = signal(SignalKind::user_defined1()).context("SIGUSR1 handler")?;
    tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            // The --stats document, so one set of names serves both.
            tracing::info!("SIGUSR1: totals {}", stats_json(&server.totals()));
        }
    });
    Ok(())
}

/// systemd socket activation (sd_listen_fds(3)): when LISTEN_PID names this
/// process, the listening socket is fd 3 and --socket/--bind are ignored.
/// The variables are then unset, so children (none today) do not think the
/// sockets are theirs. Must run before any other thread exists.
fn take_activation_fd() -> Option<OwnedFd> {
    const SD_LISTEN_FDS_START: i32 = 3;
    let ours = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
        == Some(std::process::id());
    let n: u32 = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    if !ours || n == 0 {
        return None;
    }
    if n > 1 {
        tracing::warn!("LISTEN_FDS={n}: serving on the first socket only");
    }
    std::env::remove_var("LISTEN_PID");
    std::env::remove_var("LISTEN_FDS");
    std::env::remove_var("LISTEN_FDNAMES");
    // SAFETY: LISTEN_PID names this process, so the service manager passed
    // fd 3 to us as a listening socket and nothing else in the process has
    // taken it; ownership is taken exactly once, here.
    Some(unsafe { OwnedFd::from_raw_fd(SD_LISTEN_FDS_START) })
}

/// The activated socket as a listener, with the URI that reaches it. The
/// socket file, if any, belongs to systemd: it is not removed at exit.
fn activated_listener(fd: OwnedFd, export: &str) -> anyhow::Result<(Bound, String)> {
    let unix = std::os::unix::net::UnixListener::from(fd);
    match unix.local_addr() {
        Ok(addr) => {
            unix.set_nonblocking(true)
                .context("socket activation: fd 3")?;
            let path = addr
                .as_pathname()
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            let uri = format!("nbd+unix:///{export}?socket={}", escape(&path, true));
            Ok((Bound::Unix(unix), uri))
        }
        Err(_) => {
            // Not AF_UNIX: take it as TCP (getsockname tells us which).
            let tcp = std::net::TcpListener::from(OwnedFd::from(unix));
            let addr = tcp
                .local_addr()
                .context("socket activation: fd 3 is neither a Unix nor a TCP socket")?;
            tcp.set_nonblocking(true)
                .context("socket activation: fd 3")?;
            Ok((Bound::Tcp(tcp), format!("nbd://{addr}/{export}")))
        }
    }
}

/// A socket file left by a server that died would make bind fail. Remove
/// it only if it is a socket nobody listens on.
fn remove_stale_socket(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(md) = fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !md.file_type().is_socket() {
        bail!(
            "'{}' exists and is not a socket; refusing to replace it",
            path.display()
        );
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        bail!("'{}' is in use by another server", path.display());
    }
    fs::remove_file(path)
        .with_context(|| format!("cannot remove stale socket '{}'", path.display()))
}

#[cfg(test)]
mod tests {
    use super::{duration_arg, listen_address};
    use std::time::Duration;

    #[test]
    fn durations() {
        assert_eq!(duration_arg("90"), Ok(Duration::from_secs(90)));
        let la = |b, p| listen_address(b, p).ok();
        assert_eq!(la(None, None).as_deref(), Some("127.0.0.1:10809"));
        assert_eq!(la(None, Some(99)).as_deref(), Some("127.0.0.1:99"));
        assert_eq!(la(Some("99"), None).as_deref(), Some("127.0.0.1:99"));
        assert_eq!(la(Some("0.0.0.0"), Some(99)).as_deref(), Some("0.0.0.0:99"));
        assert_eq!(la(Some("h:1"), None).as_deref(), Some("h:1"));
        assert_eq!(la(Some("::1"), None).as_deref(), Some("[::1]:10809"));
        assert_eq!(la(Some("[::1]:5"), None).as_deref(), Some("[::1]:5"));
        assert_eq!(la(Some("h:1"), Some(2)), None);
        assert_eq!(la(Some("1"), Some(2)), None);
        assert_eq!(duration_arg("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(duration_arg("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(duration_arg("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(duration_arg("2h"), Ok(Duration::from_secs(7200)));
        for bad in ["", "0", "-1", "1d", "s", "1..2s", "inf"] {
            assert!(duration_arg(bad).is_err(), "{bad:?} accepted");
        }
    }
}

/// `--write-behind`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum WriteBehindArg {
    On,
    Off,
    Auto,
}

impl From<WriteBehindArg> for WriteBehind {
    fn from(w: WriteBehindArg) -> WriteBehind {
        match w {
            WriteBehindArg::On => WriteBehind::On,
            WriteBehindArg::Off => WriteBehind::Off,
            WriteBehindArg::Auto => WriteBehind::Auto,
        }
    }
}
