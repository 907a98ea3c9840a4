//! `serve`'s command line: the flags, their values and the TLS flag policy.

use std::path::PathBuf;
use std::time::Duration;

use crate::cmd::{CacheArg, PreallocArg};
use rawdisk_nbd::server::{Aio, DetectZeroes, Discard, ServerConfig, Serving, WriteBehind};
use rawdisk_nbd::tls::ServerTls;

/// Export a file or block device over NBD.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("tracking").multiple(true).args(["track_changes", "bitmap"])))]
#[command(after_help = "Examples:\n  \
    rawdisk serve --create 10G -U /tmp/disk.sock disk.img\n  \
    rawdisk serve -r -e vm -b 0.0.0.0 -p 10809 vm.img\n  \
    rawdisk serve --cache none --tls-certificates /etc/pki/rawdisk /dev/vg0/lv0\n  \
    rawdisk serve --dir /var/lib/images -U /run/images.sock\n  \
    rawdisk serve --discard=unmap --detect-zeroes=unmap --cache none -U /tmp/import.sock vm.img\n\n\
Coming from nbdkit: -f is rawdisk's format flag (-f raw), not --foreground: serve\n\
stays in the foreground already (--foreground is accepted; --fork goes to the\n\
background).\n\
--print-uri is accepted: the URI is always printed. nbdkit's exitlast filter is\n\
--exit-last. Coming from qemu-nbd: it exits after its last client unless -t;\n\
rawdisk serves until stopped unless --exit-last. docs/coming-from.md maps the rest.")]
pub struct Args {
    /// Listen on this Unix socket (replaces a stale socket file). -U as
    /// nbdkit, -k as qemu-nbd. `-U -`: a private socket in a new temporary
    /// directory, both removed at exit (nbdkit's); --run gets its path as
    /// $unixsocket.
    #[arg(short = 'U', short_alias = 'k', long, value_name = "PATH", conflicts_with_all = ["bind", "port"])]
    pub(super) socket: Option<PathBuf>,
    /// Listen on this TCP address: HOST:PORT, HOST (port from --port or
    /// 10809), or PORT alone, which listens on 127.0.0.1 only, like the
    /// default [default: 127.0.0.1:10809]. -b as qemu-nbd, -i as nbdkit.
    #[arg(short = 'b', short_alias = 'i', long, value_name = "HOST[:PORT]", value_parser = bind_arg)]
    pub(super) bind: Option<String>,
    /// TCP port to listen on [default: 10809].
    #[arg(short = 'p', long, value_name = "PORT")]
    pub(super) port: Option<u16>,
    /// Refuse writes (NBD_FLAG_READ_ONLY); opens the target read-only.
    /// --readonly as nbdkit.
    #[arg(short = 'r', long, visible_alias = "readonly")]
    pub(super) read_only: bool,
    /// With --dir, exports that look like another image format are refused
    /// at NBD_OPT_GO unless this is given.
    #[command(flatten)]
    pub(super) format: crate::cmd::FormatOpt,
    /// Name of the export; clients asking for another name are refused.
    /// -x as qemu-nbd.
    #[arg(
        short = 'e',
        visible_short_alias = 'x',
        long,
        value_name = "NAME",
        default_value = "",
        conflicts_with = "dir"
    )]
    pub(super) export_name: String,
    /// Description of the export, sent as NBD_INFO_DESCRIPTION and in the
    /// export list (`rawdisk info --list`, `nbdinfo --list`); -D as qemu-nbd.
    #[arg(short = 'D', long, value_name = "TEXT", conflicts_with = "dir")]
    pub(super) description: Option<String>,
    /// Export every regular file and block device directly inside DIR, each
    /// under its file name (nbdkit's dir=); files added or removed are seen
    /// by the next connection. Symlinks are followed only inside DIR.
    /// NBD_OPT_LIST names what GO would serve, reading at most 131,072
    /// entries and only the heads of files changed since the last listing
    /// (docs/formats.md).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["target", "create"])]
    pub(super) dir: Option<PathBuf>,
    /// With --dir: the export a client asking for the empty name gets
    /// (otherwise it is refused and told to pick a name).
    #[arg(long, value_name = "NAME", requires = "dir", conflicts_with = "target")]
    pub(super) default_export: Option<String>,
    /// Accepted for qemu-nbd's habit: rawdisk always serves until stopped,
    /// whatever the clients do.
    #[arg(short = 't', long, conflicts_with = "exit_last")]
    pub(super) persistent: bool,
    /// Exit (0, after the final flush) once the last client in the
    /// transmission phase disconnects, as qemu-nbd does without -t and
    /// nbdkit's exitlast filter: a client that only lists the exports or
    /// connects and closes does not count.
    #[arg(long)]
    pub(super) exit_last: bool,
    /// Accepted for nbdkit's habit: the URI is always printed.
    #[arg(long)]
    pub(super) print_uri: bool,
    /// Run this shell command once the server is ready, with $uri set to
    /// the URI to connect to, then stop the server when it exits and exit
    /// with its status (nbdkit's --run). The URI is not printed.
    #[arg(long, value_name = "CMD", conflicts_with = "fork")]
    pub(super) run: Option<String>,
    /// Go into the background once listening (nbdkit's --fork): the command
    /// prints the URI and exits 0 only when the server accepts connections;
    /// the server keeps running, detached, and --pid-file gets its pid. Its
    /// messages then go where --log says (syslog unless told).
    #[arg(long)]
    pub(super) fork: bool,
    /// Where messages go: stderr, syslog (facility daemon) or null
    /// (nowhere) [default: stderr; syslog with --fork], as nbdkit's --log.
    #[arg(long, value_enum, value_name = "DEST")]
    pub(super) log: Option<LogArg>,
    /// Page cache or O_DIRECT.
    #[arg(long, value_enum, default_value = "writeback")]
    pub(super) cache: CacheArg,
    /// TRIM (qemu-nbd's --discard): `unmap` advertises it and punches
    /// holes, and zeroes may too unless the client says NO_HOLE; `ignore`
    /// does not advertise it, and zeroes keep their range allocated.
    /// rawdisk's default is unmap (qemu-nbd's is ignore).
    #[arg(long, value_enum, value_name = "MODE", default_value = "unmap")]
    pub(super) discard: DiscardArg,
    /// What an all-zero WRITE becomes (qemu-nbd's --detect-zeroes): `on`, a
    /// zero of its range kept allocated; `unmap`, a zero that leaves a hole
    /// where --discard unmap allows (thin imports stay thin); `off`, written
    /// as it came. `on` and `unmap` turn --map-writes off (the payload must
    /// be seen before it lands).
    #[arg(long, value_enum, value_name = "MODE", default_value = "off")]
    pub(super) detect_zeroes: DetectZeroesArg,
    /// I/O path of --cache none (qemu-nbd's --aio): `native`, Linux AIO for
    /// small reads and writes and the thread pool for the rest; `io_uring`,
    /// io_uring for the same (Linux AIO where the kernel refuses it);
    /// `threads`, the thread pool only. Through the page cache every
    /// request uses the thread pool. -v names the path used.
    #[arg(long, value_enum, value_name = "MODE", default_value = "native")]
    pub(super) aio: AioArg,
    /// Create TARGET with this size first (qemu-img suffixes); an existing
    /// target of the same size is served as it is, another size refused.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true, value_parser = crate::size::size_arg)]
    pub(super) create: Option<u64>,
    /// Allocation of a file made by --create.
    #[arg(long, value_enum, requires = "create", default_value = "off")]
    pub(super) preallocation: PreallocArg,
    /// Write the server's pid here once it is ready (mode 0644, renamed into
    /// place; a symlink here is refused); removed at exit. --pidfile as
    /// nbdkit.
    #[arg(short = 'P', long, visible_alias = "pidfile", value_name = "PATH")]
    pub(super) pid_file: Option<PathBuf>,
    /// Exit (as on SIGTERM) when the process that started the server
    /// exits (nbdkit's --exit-with-parent): a captive server never
    /// outlives its stack. Not with --fork.
    #[arg(long, conflicts_with = "fork")]
    pub(super) exit_with_parent: bool,
    /// Accepted for nbdkit's habit: serve stays in the foreground unless
    /// --fork (-f is rawdisk's format flag, not this).
    #[arg(long, conflicts_with = "fork")]
    pub(super) foreground: bool,
    /// Serve TARGET from this byte on (qemu's raw driver `offset`,
    /// qemu-nbd --offset): the export's byte 0 is TARGET's byte OFFSET, and
    /// nothing before it is read or written.
    #[arg(long, value_name = "OFFSET", value_parser = crate::size::size_arg,
          conflicts_with_all = ["dir", "tracking", "create"])]
    pub(super) offset: Option<u64>,
    /// Serve only SIZE bytes (from --offset, or 0): qemu's raw driver
    /// `size`. The export is that long; nothing after it is read or
    /// written [default: to TARGET's end].
    #[arg(long, value_name = "SIZE", value_parser = crate::size::size_arg,
          conflicts_with_all = ["dir", "tracking", "create"])]
    pub(super) size: Option<u64>,
    /// Clients' writes go to a private copy of TARGET, discarded at exit:
    /// TARGET never changes (qemu-nbd -s). The copy is an unlinked file
    /// beside TARGET, sharing its blocks where the file system can
    /// (XFS, btrfs), else in $TMPDIR (/var/tmp), copied before serving
    /// starts; holes stay holes.
    #[arg(long, conflicts_with_all = ["dir", "tracking", "create"])]
    pub(super) snapshot: bool,
    /// Write the server's totals here as JSON when it exits (SIGUSR1 logs
    /// the same document; docs/json.md): uptime-seconds; connections: accepted, negotiated, open,
    /// refused-at-cap, closed-in-handshake, unknown-export, tls-required;
    /// requests: per command (read, write, flush, trim, cache,
    /// write-zeroes, block-status, disc, other) its requests and bytes;
    /// errors: replies per NBD error (eperm, eio, enomem, einval, enospc,
    /// eoverflow, enotsup, eshutdown, other); peak-in-flight;
    /// aio-completed (requests answered through Linux AIO or io_uring,
    /// cache=none).
    #[arg(long, value_name = "FILE")]
    pub(super) stats: Option<PathBuf>,
    /// Seconds a client gets to finish the handshake; one that listed the
    /// exports earns 10 ms more per query about a listed export.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    pub(super) handshake_timeout: f64,
    /// Connections served at once; one more waits up to a second for a
    /// place, then is refused with the reason. At most half of them may be
    /// in the handshake at once.
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub(super) max_connections: usize,
    /// qemu-nbd's spelling of --max-connections; 0 (qemu-nbd's "no
    /// limit") keeps rawdisk's cap of 100.
    #[arg(long, value_name = "N", conflicts_with = "max_connections")]
    pub(super) shared: Option<usize>,
    /// Close a connection that has had nothing in flight and sent nothing,
    /// or has read none of its replies, for this long (90, 90s, 15m, 2h)
    /// [default: never].
    #[arg(long, value_name = "DURATION", value_parser = duration_arg)]
    pub(super) idle_timeout: Option<Duration>,
    /// When writes of 256 KiB or more start their write-back right away
    /// (sync_file_range), so a client's final flush has little left to do:
    /// on (faster imports that end with a flush, slower streams of writes
    /// that are never flushed), off, or auto: on until the clients rewrite
    /// what they wrote since their last flush. `--write-behind` alone is
    /// on; a mode is given attached (`--write-behind=off`). No effect with
    /// --cache none or on tmpfs/ramfs.
    #[arg(long, value_enum, value_name = "WHEN", default_value = "auto",
          num_args = 0..=1, require_equals = true, default_missing_value = "on")]
    pub(super) write_behind: WriteBehindArg,
    /// Receive write payloads of 64 KiB or more straight into the file's
    /// page cache through a shared mapping (regular files, pages already
    /// cached, no FUA): one copy instead of two, and less memory. The cost:
    /// a client that disconnects in the middle of a write's payload leaves
    /// the part that arrived written (without it, nothing of that write is).
    /// No effect with --cache none or on block devices.
    #[arg(long)]
    pub(super) map_writes: bool,
    /// Threads doing storage calls [default: 16, 64 with --cache none].
    #[arg(long, value_name = "N")]
    pub(super) threads: Option<usize>,
    /// TLS (NBD_OPT_STARTTLS): `on` offers it and still serves plaintext
    /// clients, `require` refuses them. Giving --tls-certificates or
    /// --tls-psk without --tls means `require`.
    #[arg(long, value_enum, value_name = "MODE")]
    pub(super) tls: Option<TlsArg>,
    /// X.509 credentials in nbdkit's and qemu's layout: DIR/server-cert.pem,
    /// DIR/server-key.pem, and for --tls-verify-peer DIR/ca-cert.pem and an
    /// optional DIR/ca-crl.pem.
    #[arg(long, value_name = "DIR", conflicts_with = "tls_psk")]
    pub(super) tls_certificates: Option<PathBuf>,
    /// Pre-shared keys: lines `username:hexkey` (the psktool format of
    /// GnuTLS and nbdkit).
    #[arg(long, value_name = "FILE")]
    pub(super) tls_psk: Option<PathBuf>,
    /// Require a client certificate that chains to DIR/ca-cert.pem and is
    /// not revoked by DIR/ca-crl.pem.
    #[arg(long)]
    pub(super) tls_verify_peer: bool,
    /// Keep a bitmap of the ranges clients change (WRITE, WRITE_ZEROES,
    /// TRIM) in a state file next to the target (TARGET.rawdisk-cbt), made
    /// durable before each FLUSH is acknowledged; each checkpoint of
    /// `rawdisk checkpoint` is then offered as the metadata context
    /// rawdisk:changed:NAME and as qemu's qemu:dirty-bitmap:NAME
    /// (docs/cbt.md). With --dir, one per export. Only writes through this
    /// server are seen: another process writing the same file while it is
    /// served is not.
    #[arg(long)]
    pub(super) track_changes: bool,
    /// Offer checkpoint NAME as qemu:dirty-bitmap:NAME (qemu-nbd's -B: set
    /// where the extent changed since the checkpoint), and only the
    /// checkpoints named so; repeatable. Implies --track-changes; NAME
    /// must exist when the server starts (`rawdisk checkpoint create`).
    #[arg(
        short = 'B',
        long = "bitmap",
        value_name = "NAME",
        conflicts_with = "dir"
    )]
    pub(super) bitmap: Vec<String>,
    /// Bytes per bit of a new state file's bitmaps: a power of two from 4K
    /// to 64M [default: 64K]; an existing state file's must match.
    #[arg(long, value_name = "SIZE", requires = "tracking", value_parser = crate::size::size_arg)]
    pub(super) bitmap_granularity: Option<u64>,
    /// Keep the state files here (DIR/NAME.rawdisk-cbt) instead of next
    /// to the target; needed for block devices.
    #[arg(long, value_name = "DIR", requires = "tracking")]
    pub(super) state_dir: Option<PathBuf>,
    /// File or block device to export.
    #[arg(required_unless_present = "dir")]
    pub(super) target: Option<PathBuf>,
}

/// `--log`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum LogArg {
    Stderr,
    Syslog,
    Null,
}

/// `--discard`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum DiscardArg {
    Ignore,
    Unmap,
}

/// `--detect-zeroes`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum DetectZeroesArg {
    Off,
    On,
    Unmap,
}

/// `--aio`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum AioArg {
    Threads,
    Native,
    #[value(name = "io_uring")]
    IoUring,
}

impl Args {
    /// The connection cap: --shared as --max-connections, its 0 the default.
    pub(super) fn connection_cap(&self) -> usize {
        match self.shared {
            Some(0) => ServerConfig::default().max_connections,
            Some(n) => n,
            None => self.max_connections,
        }
        .max(1)
    }

    /// --discard, --detect-zeroes and --aio for the server.
    /// Change tracking: --track-changes, or implied by --bitmap.
    pub(super) fn tracking(&self) -> bool {
        self.track_changes || !self.bitmap.is_empty()
    }

    pub(super) fn serving(&self) -> Serving {
        Serving {
            discard: match self.discard {
                DiscardArg::Ignore => Discard::Ignore,
                DiscardArg::Unmap => Discard::Unmap,
            },
            detect_zeroes: match self.detect_zeroes {
                DetectZeroesArg::Off => DetectZeroes::Off,
                DetectZeroesArg::On => DetectZeroes::On,
                DetectZeroesArg::Unmap => DetectZeroes::Unmap,
            },
            aio: match self.aio {
                AioArg::Threads => Aio::Threads,
                AioArg::Native => Aio::Native,
                AioArg::IoUring => Aio::IoUring,
            },
        }
    }

    /// The I/O path --aio and --cache choose, for -v.
    pub(super) fn aio_path(&self) -> &'static str {
        match (self.cache, self.aio) {
            (CacheArg::Writeback, AioArg::Threads) => "aio=threads: the thread pool",
            (CacheArg::Writeback, _) => "aio: the thread pool (Linux AIO serves --cache none only)",
            (CacheArg::None, AioArg::Threads) => "aio=threads: the thread pool only",
            (CacheArg::None, AioArg::Native) => {
                "aio=native: Linux AIO for small requests, the thread pool for the rest"
            }
            (CacheArg::None, AioArg::IoUring) => {
                "aio=io_uring: io_uring for small requests (Linux AIO where the kernel \
                 refuses it), the thread pool for the rest"
            }
        }
    }
    /// Where the server's messages go: --log, else syslog for a --fork
    /// daemon (nbdkit's default) and stderr in the foreground.
    pub fn log_dest(&self) -> LogArg {
        self.log.unwrap_or(if self.fork {
            LogArg::Syslog
        } else {
            LogArg::Stderr
        })
    }

    /// Whether --log was given: a system log asked for by name and missing
    /// is worth a warning, the --fork default is not (nbdkit's syslog(3)
    /// drops the lines too).
    pub fn log_named(&self) -> bool {
        self.log.is_some()
    }
}

/// `--bind`, checked as typed so a bad port is a usage error: HOST[:PORT],
/// [V6][:PORT], a bare V6 address or PORT alone.
pub(super) fn bind_arg(s: &str) -> Result<String, String> {
    let bad_port = |p: &str| format!("invalid port '{p}' (a number from 0 to 65535)");
    if s.is_empty() {
        return Err("empty address".into());
    }
    let port = if let Some(rest) = s.strip_prefix('[') {
        let Some((host, after)) = rest.split_once(']') else {
            return Err("missing ']' after the IPv6 address".into());
        };
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("'{host}' is not an IPv6 address"));
        }
        match after {
            "" => None,
            a => Some(a.strip_prefix(':').ok_or_else(|| bad_port(a))?),
        }
    } else if s.matches(':').count() == 1 {
        s.split_once(':').map(|(_, p)| p)
    } else if s.contains(':') {
        if s.parse::<std::net::Ipv6Addr>().is_err() {
            return Err("not an IPv6 address (use [ADDR]:PORT)".into());
        }
        None
    } else if s.bytes().all(|c| c.is_ascii_digit()) {
        Some(s)
    } else {
        None
    };
    match port {
        Some(p) if p.parse::<u16>().is_err() => Err(bad_port(p)),
        _ => Ok(s.to_string()),
    }
}

/// A duration: seconds, or a number with ms, s, m or h.
pub(super) fn duration_arg(s: &str) -> Result<Duration, String> {
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
pub(super) enum TlsArg {
    /// No TLS: NBD_OPT_STARTTLS is refused.
    Off,
    /// TLS offered; plaintext clients are served too.
    On,
    /// Only NBD_OPT_STARTTLS and NBD_OPT_ABORT are answered before TLS.
    Require,
}

pub(super) enum TlsSetup {
    /// A bad combination of flags (exit 2).
    Usage(&'static str),
    /// Credentials that cannot be loaded.
    Load(anyhow::Error),
}

/// The server's TLS from the --tls* flags; None when TLS is off.
pub(super) fn server_tls(args: &Args) -> Result<Option<ServerTls>, TlsSetup> {
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

/// `--write-behind`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum WriteBehindArg {
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
