//! A connected socket (server or client side) as tokio read and write halves that keep reading and
//! writing until the kernel says EAGAIN.
//!
//! tokio's own `UnixStream`/`TcpStream` forget the socket's readiness after
//! every short read (fewer bytes than asked). A 2 MiB write payload arrives
//! through a Unix socket in ~200 KiB pieces, so each piece cost a trip
//! through the scheduler and an `epoll_wait` (3,600 of them for one
//! `qemu-img convert` of the seed image, against 440 reads that actually
//! found the socket empty). Here readiness is dropped only on EAGAIN, which
//! is what qemu-nbd's and nbdkit's receive loops do.

use std::io;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use rustix::net::{RecvFlags, SendFlags, Shutdown};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Both halves of one socket; the fd closes when both are dropped.
pub(crate) fn split(fd: OwnedFd) -> io::Result<(SockRead, SockWrite)> {
    // SAFETY: the AsyncFd owns the OwnedFd, so the descriptor it registers
    // stays open and names the same socket until the AsyncFd is dropped.
    let fd = Arc::new(unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?);
    Ok((SockRead(fd.clone()), SockWrite(fd)))
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
