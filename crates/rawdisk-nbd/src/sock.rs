//! A connected socket (server or client side) as tokio read and write halves that keep reading and
//! writing until the kernel says EAGAIN.
//!
//! tokio's own `UnixStream`/`TcpStream` forget the socket's readiness after
//! every short read (fewer bytes than asked). A big write payload arrives
//! through a Unix socket in pieces, so each piece cost a trip through the
//! scheduler and an `epoll_wait`, most of which found more data waiting
//! (docs/benchmarks.md, Read path). Here readiness is dropped only
//! on EAGAIN, which is what qemu-nbd's and nbdkit's receive loops do.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use rawdisk_storage::MappedWrite;
use rustix::net::{RecvFlags, SendFlags, Shutdown};
use rustix::pipe::{PipeFlags, SpliceFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Both halves of one socket and a handle for splicing into it; the fd
/// closes when all three are dropped.
pub(crate) fn split(fd: OwnedFd) -> io::Result<(SockRead, SockWrite, RawSock)> {
    // SAFETY: the AsyncFd owns the OwnedFd, so the descriptor it registers
    // stays open and names the same socket until the AsyncFd is dropped.
    let fd = Arc::new(unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?);
    Ok((SockRead(fd.clone()), SockWrite(fd.clone()), RawSock(fd)))
}

pub(crate) struct SockRead(Arc<AsyncFd<OwnedFd>>);
pub(crate) struct SockWrite(Arc<AsyncFd<OwnedFd>>);

impl AsyncRead for SockRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.0.poll_read_ready(cx))?;
            // Payload buffers are initialized already: this does not memset.
            let dst = buf.initialize_unfilled();
            match guard.try_io(|fd| Ok(rustix::net::recv(fd, &mut *dst, RecvFlags::empty())?)) {
                Ok(Ok((n, _))) => {
                    // Less than asked: the socket is drained, so the next
                    // read waits for an event instead of meeting EAGAIN
                    // first, one recv per request saved (as tokio's own
                    // streams do; an event that came meanwhile is kept).
                    if n > 0 && n < dst.len() {
                        guard.clear_ready();
                    }
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                // EAGAIN: readiness is cleared, wait for the next event.
                Err(_) => continue,
            }
        }
    }
}

impl Drop for SockWrite {
    /// Like tokio's owned write half: dropping it sends EOF to the peer
    /// even while the read half lives on.
    fn drop(&mut self) {
        let _ = rustix::net::shutdown(self.0.get_ref(), Shutdown::Write);
    }
}

impl AsyncWrite for SockWrite {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.0.poll_write_ready(cx))?;
            // NOSIGNAL: a client that hung up is an EPIPE for this
            // connection, not a SIGPIPE for the process.
            match guard.try_io(|fd| Ok(rustix::net::send(fd, data, SendFlags::NOSIGNAL)?)) {
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(r) => return Poll::Ready(r),
                Err(_) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The peer may be gone already; that is not an error worth reporting.
        let _ = rustix::net::shutdown(self.0.get_ref(), Shutdown::Write);
        Poll::Ready(Ok(()))
    }
}

/// The socket itself, for the calls that move data without a user-space
/// buffer: read replies spliced from a [`Pipe`], and write payloads received
/// straight into the target's page cache. It shares the halves' readiness;
/// callers keep the uses from interleaving (the server holds its reply lock
/// and flushes the buffered write half before a splice, and receives only
/// from the connection's one reader, once it has taken what it read ahead).
#[derive(Clone)]
pub(crate) struct RawSock(Arc<AsyncFd<OwnedFd>>);

impl RawSock {
    /// Receives the rest of a write's payload into its mapped pages.
    /// EFAULT: a page could not be faulted in; `w` tells how much arrived.
    pub(crate) async fn recv_mapped(&self, w: &mut MappedWrite<'_>) -> io::Result<()> {
        while w.remaining() > 0 {
            let mut guard = self.0.readable().await?;
            match guard.try_io(|fd| w.recv(fd.as_fd())) {
                Ok(Ok(0)) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e),
                // EAGAIN: readiness is cleared, wait for the next event.
                Err(_) => {}
            }
        }
        Ok(())
    }

    /// Sends exactly `len` bytes that are already in `pipe`.
    ///
    /// splice(2) to a socket sends without MSG_NOSIGNAL: a peer that hung up
    /// raises SIGPIPE, which Rust programs ignore from start-up (the error
    /// comes back as EPIPE like for send).
    pub(crate) async fn send_from(&self, pipe: &Pipe, len: usize) -> io::Result<()> {
        let mut left = len;
        while left > 0 {
            let mut guard = self.0.writable().await?;
            // NONBLOCK is for the pipe side (the socket is non-blocking
            // already); the pipe holds `left` bytes, so EAGAIN can only mean
            // a full socket buffer. On Linux 6.5+ a Unix or TCP socket takes
            // references to the page-cache pages instead of copying them.
            let r = guard.try_io(|fd| {
                Ok(rustix::pipe::splice(
                    &pipe.r,
                    None,
                    fd,
                    None,
                    left,
                    SpliceFlags::NONBLOCK | SpliceFlags::MOVE,
                )?)
            });
            match r {
                Ok(Ok(0)) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        format!("splice to socket: pipe empty with {left} bytes still to send"),
                    ))
                }
                Ok(Ok(n)) => left -= n,
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => {}
            }
        }
        Ok(())
    }
}

/// A pipe used to carry page-cache pages from the target to a socket
/// without copying them through user memory (splice file -> pipe on a
/// blocking thread, pipe -> socket on the connection's writer).
pub(crate) struct Pipe {
    r: OwnedFd,
    w: OwnedFd,
    /// Pipes alive in the owner's pool, counting this one (reserved by the
    /// caller before creating it); dropping the pipe gives its count back.
    live: Arc<AtomicUsize>,
}

impl Pipe {
    /// A pipe that holds at least `bytes` (the kernel rounds the size up to
    /// a power of two pages). Fails where F_SETPIPE_SZ is refused: above
    /// /proc/sys/fs/pipe-max-size (1 MiB) or past the per-user pipe page
    /// budget, for processes without CAP_SYS_RESOURCE.
    /// `live` already counts this pipe; on error that count is given back.
    pub(crate) fn with_capacity(bytes: usize, live: Arc<AtomicUsize>) -> io::Result<Pipe> {
        let made = rustix::pipe::pipe_with(PipeFlags::CLOEXEC).and_then(|(r, w)| {
            rustix::pipe::fcntl_setpipe_size(&w, bytes)?;
            Ok((r, w))
        });
        match made {
            Ok((r, w)) => Ok(Pipe { r, w, live }),
            Err(e) => {
                live.fetch_sub(1, Ordering::Relaxed);
                Err(e.into())
            }
        }
    }

    /// The end the target splices its pages into.
    pub(crate) fn write_end(&self) -> BorrowedFd<'_> {
        self.w.as_fd()
    }
}

impl Drop for Pipe {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Lets the server run further ahead of a client on a Unix socket: its
/// send buffer bounds the reply bytes queued before the client reads them
/// (AF_UNIX charges the sender only), and the default 208 KiB is a fifth of
/// one 1 MiB read (docs/benchmarks.md, Read path).
/// SO_SNDBUFFORCE needs CAP_NET_ADMIN; without it SO_SNDBUF is capped at
/// net.core.wmem_max (the kernel then doubles either value).
pub(crate) fn grow_unix_send_buffer(s: &tokio::net::UnixStream) {
    const WANT: usize = 2 << 20;
    if rustix::net::sockopt::set_socket_send_buffer_size_force(s, WANT).is_err() {
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(s, WANT);
    }
}

/// Gives the heap's free pages back to the kernel (glibc's malloc_trim),
/// for when the last connection has closed: free() alone keeps what 1,000
/// connections touched, since it only shrinks the top of each arena.
pub(crate) fn trim_heap() {
    // SAFETY: malloc_trim only walks glibc's own arenas under their locks;
    // it takes no pointers from us.
    unsafe {
        libc::malloc_trim(0);
    }
}
