//! `rawdisk serve [-U|-k|--socket PATH | -b|-i|--bind HOST[:PORT] -p|--port PORT]
//! [-r|--read-only|--readonly] [-f raw] [-e|-x|--export-name NAME] [-D|--description TEXT]
//! [-P|--pid-file PATH] [-t] [--run CMD | --fork] [--log stderr|syslog|null]
//! [--cache writeback|none] [--write-behind] [--map-writes]
//! [--create SIZE [--preallocation off|falloc|full]] [--pid-file PATH]
//! [--idle-timeout DURATION] [--max-connections|--shared N] [--exit-last]
//! [--discard ignore|unmap] [--detect-zeroes off|on|unmap]
//! [--aio threads|native|io_uring] [--print-uri]
//! [--tls off|on|require] [--tls-certificates DIR]
//! [--tls-psk FILE] [--tls-verify-peer]
//! [--track-changes | -B|--bitmap NAME...] [--bitmap-granularity SIZE] [--state-dir DIR]
//! [-v] TARGET`
//!
//! Prints the URI to connect to on stdout, one line, once the listener is
//! accepting. SIGINT/SIGTERM/SIGHUP: stop accepting, finish in-flight
//! requests, flush, exit 0. SIGUSR1: log the server's totals.
//!
//! The rooms: `args` (flags), `listen` and `activation` (the socket),
//! `open` (the single target), `daemon` (fork, pid file, `--run`, signals),
//! `stats` (`--stats`); this file puts them in order.

mod activation;
mod args;
mod daemon;
mod listen;
mod open;
mod snapshot;
mod stats;

use std::fs;
use std::io::{self, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use rawdisk_nbd::server::{Listener, Server, ServerConfig};
use rawdisk_storage::cbt::TrackOptions;
use rawdisk_storage::{CacheMode, OpenOptions};
use tokio::sync::watch;

use crate::cmd::CacheArg;
use activation::{activated_listener, take_activation_fd};
pub use args::Args;
pub use args::LogArg;
use args::{server_tls, TlsSetup, WriteBehindArg};
use daemon::{
    detach_stderr, fork_into_background, handle_signals, open_pid_file, start_run, Cleanup, PidFile,
};
use listen::{escape, listen, Bound, Listening};
use open::{open_target, window};
use stats::stats_json;

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    // First, while the process has one thread: it unsets the variables, and
    // setenv/unsetenv race with any other thread's getenv.
    let activated = take_activation_fd();
    daemon::unblock_signals()?;
    if args.exit_with_parent {
        daemon::exit_with_parent()?;
    }
    if let Some(t) = &args.target {
        crate::cmd::local_only(t, "serve")?;
    }
    if !(args.handshake_timeout > 0.0 && args.handshake_timeout.is_finite()) {
        return Err(crate::cmd::UsageError(
            "--handshake-timeout must be a positive number of seconds".into(),
        )
        .into());
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
            return Err(crate::cmd::UsageError(format!(
                "--bitmap-granularity {g}: must be a power of two from 4K to 64M \
                 (see 'rawdisk serve --help')"
            ))
            .into());
        }
    }
    let track = args.tracking().then(|| TrackOptions {
        granularity: args.bitmap_granularity,
        state_dir: args.state_dir.clone(),
    });
    let cache = args.cache.into();
    // Everything that can fail goes before --create makes anything: the
    // listening socket (in use, no permission) and the pid file.
    let mut cleanup = Cleanup::default();
    let listening = match activated {
        Some(fd) => activated_listener(fd, &escape(&args.export_name, false))?,
        None => listen(&args, &mut cleanup)?,
    };
    let pid_file = open_pid_file(&args, &mut cleanup)?;
    if let Some(p) = &args.stats {
        // Made now, so a bad path fails before serving, not at exit.
        fs::File::create(p)
            .with_context(|| format!("cannot write statistics '{}'", p.display()))?;
        cleanup.stats = Some(p.clone());
    }
    let mut cfg = ServerConfig {
        export_name: args.export_name.clone(),
        description: args.description.clone().unwrap_or_default(),
        read_only: args.read_only,
        max_connections: args.connection_cap(),
        handshake_timeout: Duration::from_secs_f64(args.handshake_timeout),
        idle_timeout: args.idle_timeout,
        write_behind: args.write_behind.into(),
        map_writes: args.map_writes,
        tls,
        track_changes: track,
        dirty_bitmaps: (!args.bitmap.is_empty()).then(|| args.bitmap.clone()),
        raw: args.format.raw(),
        serving: args.serving(),
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
            cfg.window = window(&args, path, &target)?;
            if !args.format.raw() {
                let shown = path.display().to_string();
                let f = rawdisk_storage::format::probe_target(&target)
                    .with_context(|| format!("cannot read '{shown}'"))?;
                if let Some(f) = f {
                    bail!("{}", rawdisk_storage::format::refusal(&shown, f));
                }
            }
            let kind = match target.kind() {
                rawdisk_storage::Kind::File => "regular file",
                rawdisk_storage::Kind::Block => "block device",
            };
            let what = match (args.offset, args.size) {
                (None, None) => format!("'{}' ({} bytes, {kind})", path.display(), target.size()),
                _ => format!(
                    "'{}' from byte {} ({} of its {} bytes, {kind})",
                    path.display(),
                    cfg.window.offset,
                    cfg.window.size.unwrap_or(target.size() - cfg.window.offset),
                    target.size()
                ),
            };
            let caps = target.caps().snapshot();
            let server = Server::open(target, cfg)
                .map_err(|e| anyhow::anyhow!("cannot serve '{}': {e}", path.display()))?;
            tracing::debug!("storage capabilities: {caps}");
            (server, what)
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

/// Async workers for the sockets: one per CPU the process may use. At least
/// two, so a request run on its connection's reader never holds up the other
/// connections; at most 16, as they only move bytes between sockets and
/// buffers while the storage calls run on the blocking pool.
fn async_workers() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 16))
}

async fn serve(
    args: Args,
    server: Server,
    what: String,
    Listening { bound, uri, socket }: Listening,
    pid_file: Option<PidFile>,
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
        tracing::debug!("TLS {mode}: {}", t.describe());
    }
    let read_only = server.read_only();
    let (min, pref, max) = server.block_sizes();
    // At start only the URI is said; what is served, and how, is for -v.
    tracing::debug!(
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
        if args.map_writes
            && args.cache == CacheArg::Writeback
            && args.serving().detect_zeroes == rawdisk_nbd::server::DetectZeroes::Off
        {
            ", map-writes"
        } else {
            ""
        },
    );

    tracing::debug!("{}", args.aio_path());

    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    handle_signals(stop_tx.clone(), server.clone(), cleanup.at_exit())?;
    if args.exit_last {
        let (server, stop) = (server.clone(), stop_tx.clone());
        tokio::spawn(async move {
            server.all_closed().await;
            tracing::info!("--exit-last: the last client disconnected; stopping");
            let _ = stop.send(true);
        });
    }

    if let Some(f) = pid_file {
        f.write(std::process::id())?;
    }
    // Serving starts: the created image stays whatever happens next.
    cleanup.created = None;
    cleanup.stats = None;
    let run = match &args.run {
        Some(cmd) => Some(start_run(cmd, &uri, socket.as_deref(), stop_tx)?),
        None => {
            // With --dir the URI names no export: say how to see them.
            let note = match &args.dir {
                Some(_) => format!(
                    "rawdisk: list the exports with: rawdisk info --list '{uri}' \
                     (or nbdinfo --list '{uri}')\n"
                ),
                None => String::new(),
            };
            match ready {
                // --fork: the parent prints them and exits.
                Some(mut pipe) => {
                    detach_stderr(args.log_dest())?;
                    write!(pipe, "{uri}\n{note}").context("--fork: telling the parent")?
                }
                None => {
                    let mut out = io::stdout().lock();
                    writeln!(out, "{uri}").context("stdout")?;
                    out.flush().context("stdout")?;
                    eprint!("{note}");
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

#[cfg(test)]
mod tests {
    use super::args::bind_arg;
    use super::args::duration_arg;
    use super::listen::{listen_address, tcp_uri};
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
        for ok in [
            "0.0.0.0",
            "0.0.0.0:1",
            "h:65535",
            "::1",
            "[::1]",
            "[::]:5",
            "99",
            "h",
        ] {
            assert_eq!(bind_arg(ok).as_deref(), Ok(ok));
        }
        for bad in [
            "0.0.0.0:abc",
            "h:65536",
            "99999",
            "[::1]x",
            "[h]:1",
            "1:2:x",
            "",
        ] {
            assert!(bind_arg(bad).is_err(), "{bad:?} accepted");
        }
        let uri = |a: &str| tcp_uri(a.parse().unwrap(), "vm");
        assert_eq!(uri("0.0.0.0:7"), "nbd://localhost:7/vm");
        assert_eq!(uri("[::]:7"), "nbd://localhost:7/vm");
        assert_eq!(uri("[::1]:7"), "nbd://[::1]:7/vm");
        assert_eq!(uri("10.1.2.3:7"), "nbd://10.1.2.3:7/vm");
        assert_eq!(duration_arg("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(duration_arg("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(duration_arg("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(duration_arg("2h"), Ok(Duration::from_secs(7200)));
        for bad in ["", "0", "-1", "1d", "s", "1..2s", "inf"] {
            assert!(duration_arg(bad).is_err(), "{bad:?} accepted");
        }
    }
}
