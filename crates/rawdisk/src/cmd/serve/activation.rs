//! systemd socket activation: the listening socket passed as fd 3.

use std::os::fd::{FromRawFd, OwnedFd};

use anyhow::Context;

use super::listen::{escape, tcp_uri, Bound, Listening};

/// systemd socket activation (sd_listen_fds(3)): when LISTEN_PID names this
/// process, the listening socket is fd 3 and --socket/--bind are ignored.
/// The variables are then unset, so children (none today) do not think the
/// sockets are theirs. Must run before any other thread exists.
pub(super) fn take_activation_fd() -> Option<OwnedFd> {
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
pub(super) fn activated_listener(fd: OwnedFd, export: &str) -> anyhow::Result<Listening> {
    let unix = std::os::unix::net::UnixListener::from(fd);
    match unix.local_addr() {
        Ok(addr) => {
            unix.set_nonblocking(true)
                .context("socket activation: fd 3")?;
            let path = addr.as_pathname().map(|p| p.to_path_buf());
            let shown = path
                .as_deref()
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            let uri = format!("nbd+unix:///{export}?socket={}", escape(&shown, true));
            Ok(Listening {
                bound: Bound::Unix(unix),
                uri,
                socket: path,
            })
        }
        Err(_) => {
            // Not AF_UNIX: take it as TCP (getsockname tells us which).
            let tcp = std::net::TcpListener::from(OwnedFd::from(unix));
            let addr = tcp
                .local_addr()
                .context("socket activation: fd 3 is neither a Unix nor a TCP socket")?;
            tcp.set_nonblocking(true)
                .context("socket activation: fd 3")?;
            Ok(Listening {
                bound: Bound::Tcp(tcp),
                uri: tcp_uri(addr, export),
                socket: None,
            })
        }
    }
}
