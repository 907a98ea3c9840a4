//! The listening socket: `--socket`, `--bind`/`--port` or the activated
//! one, and the URI that reaches it.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use super::args::Args;
use super::daemon::Cleanup;

/// Percent-encodes for an NBD URI (RFC 3986 unreserved characters stay,
/// and '/' where it separates path segments).
pub(super) fn escape(s: &str, keep_slash: bool) -> String {
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

/// A bound listening socket, before the runtime exists.
pub(super) enum Bound {
    Unix(std::os::unix::net::UnixListener),
    Tcp(std::net::TcpListener),
}

/// The socket the server listens on: the listener, the URI that reaches it
/// and, for a Unix socket, its path ($unixsocket for --run).
pub(super) struct Listening {
    pub(super) bound: Bound,
    pub(super) uri: String,
    pub(super) socket: Option<PathBuf>,
}

/// Binds and returns the socket with the URI that reaches it (a socket
/// systemd passed is taken by `activation::activated_listener` instead).
pub(super) fn listen(args: &Args, cleanup: &mut Cleanup) -> anyhow::Result<Listening> {
    let export = escape(&args.export_name, false);
    if let Some(path) = &args.socket {
        let path = if path.as_os_str() == "-" {
            private_socket(cleanup)?
        } else {
            remove_stale_socket(path)?;
            path.clone()
        };
        let l = std::os::unix::net::UnixListener::bind(&path)
            .with_context(|| format!("cannot listen on '{}'", path.display()))?;
        cleanup.files.push(path.clone());
        l.set_nonblocking(true)
            .with_context(|| format!("cannot listen on '{}'", path.display()))?;
        let abs = std::path::absolute(&path).unwrap_or_else(|_| path.clone());
        let uri = format!(
            "nbd+unix:///{export}?socket={}",
            escape(&abs.to_string_lossy(), true)
        );
        return Ok(Listening {
            bound: Bound::Unix(l),
            uri,
            socket: Some(abs),
        });
    }
    let bind = &listen_address(args.bind.as_deref(), args.port)?;
    let l =
        std::net::TcpListener::bind(bind).with_context(|| format!("cannot listen on {bind}"))?;
    l.set_nonblocking(true)
        .with_context(|| format!("cannot listen on {bind}"))?;
    let addr = l.local_addr().context("local address")?;
    Ok(Listening {
        bound: Bound::Tcp(l),
        uri: tcp_uri(addr, &export),
        socket: None,
    })
}

/// The URI a client uses to reach a TCP listener: a wildcard address
/// (0.0.0.0, ::) is no address to connect to, so it is named localhost.
pub(super) fn tcp_uri(addr: std::net::SocketAddr, export: &str) -> String {
    let host = match addr.ip() {
        ip if ip.is_unspecified() => "localhost".to_string(),
        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        std::net::IpAddr::V4(ip) => ip.to_string(),
    };
    format!("nbd://{host}:{}/{export}", addr.port())
}

/// `-U -`: DIR/socket in a new directory only this user may enter, made
/// under $TMPDIR; the directory is removed at exit after the socket.
fn private_socket(cleanup: &mut Cleanup) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let base = std::env::temp_dir();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    for attempt in 0u32..100 {
        let tag = (seed ^ std::process::id().rotate_left(16)).wrapping_add(attempt * 7919);
        let dir = base.join(format!("rawdisk{tag:08x}"));
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                cleanup.dirs.push(dir.clone());
                return Ok(dir.join("socket"));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("-U -: cannot make a directory in '{}'", base.display())
                })
            }
        }
    }
    bail!(
        "-U -: cannot make a directory in '{}': every name tried exists",
        base.display()
    )
}

/// The TCP address to listen on from --bind and --port. A bare PORT means
/// loopback, like the default: exposing a disk on every address must be
/// asked for by name (0.0.0.0, ::).
pub(super) fn listen_address(bind: Option<&str>, port: Option<u16>) -> anyhow::Result<String> {
    const PORT: u16 = 10809;
    let Some(b) = bind else {
        return Ok(format!("127.0.0.1:{}", port.unwrap_or(PORT)));
    };
    let both = || {
        anyhow::Error::new(crate::cmd::UsageError(format!(
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
        bail!(
            "cannot listen on '{}': it is in use by another server \
             (stop that one first, or choose another socket)",
            path.display()
        );
    }
    fs::remove_file(path)
        .with_context(|| format!("cannot remove stale socket '{}'", path.display()))
}
