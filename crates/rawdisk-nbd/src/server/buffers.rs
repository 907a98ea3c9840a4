//! Memory the server reuses: the request reader's read-ahead buffer
//! ([`Input`]), payload and reply buffers ([`BufPool`]) and the pipes of
//! spliced reads ([`PipePool`]).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt};
use tracing::{debug, warn};

use crate::sock::Pipe;

/// Replies and payloads are laid out so the data starts on this boundary,
/// which lets O_DIRECT use the buffer without a bounce copy.
pub(super) const DATA_ALIGN: usize = 4096;
/// Read-ahead of the request reader.
pub(super) const READ_AHEAD: usize = 64 << 10;
/// The reader's buffer starts this small and doubles, up to READ_AHEAD,
/// each time a read fills it: an idle connection holds little.
const INPUT_MIN: usize = 4 << 10;
/// A connection that sent nothing for this long lets its buffer go.
const INPUT_IDLE: Duration = Duration::from_secs(1);
/// Size of each pipe: /proc/sys/fs/pipe-max-size's default, the most a
/// process without CAP_SYS_RESOURCE may ask for.
pub(super) const PIPE_BYTES: usize = 1 << 20;
/// Empty pipes kept between reads.
const PIPES_KEPT: usize = 32;
/// Pipes in existence at once, kept or in flight (two descriptors each).
const PIPES_MAX: usize = 128;
/// Granularity of pooled buffer sizes.
const POOL_ROUND: usize = 64 << 10;
/// Pooled pipes and buffers unused this long are let go, also while
/// clients stay connected: an idle server keeps no descriptors or memory
/// for a burst that is over.
pub(super) const POOL_IDLE: Duration = Duration::from_secs(3);

/// The socket's read half with a read-ahead buffer whose use the caller
/// controls per read, so payloads land in their own buffer in one copy.
pub(super) struct Input<R> {
    r: R,
    buf: Vec<u8>,
    pos: usize,
    end: usize,
}

impl<R: AsyncRead + Unpin> Input<R> {
    pub(super) fn new(r: R) -> Self {
        Input {
            r,
            buf: Vec::new(),
            pos: 0,
            end: 0,
        }
    }

    /// Makes the buffer at least `n` bytes (INPUT_MIN at the least), the
    /// buffered bytes moved to its start.
    fn room(&mut self, n: usize) {
        if self.buf.len() >= n.max(1) {
            return;
        }
        let mut b = vec![0u8; n.max(INPUT_MIN)];
        let held = self.end - self.pos;
        b[..held].copy_from_slice(&self.buf[self.pos..self.end]);
        (self.buf, self.pos, self.end) = (b, 0, held);
    }

    /// After a read that filled the buffer, doubles it (up to `want`) for
    /// the next: the client sends more than fits.
    fn grow_if_full(&mut self, want: usize) {
        if self.end == self.buf.len() && self.buf.len() < want.min(READ_AHEAD) {
            self.room((self.buf.len() * 2).min(READ_AHEAD));
        }
    }

    /// [`Input::fill_to`] for the wait between requests: once nothing has
    /// come for INPUT_IDLE, the empty buffer is let go (57 KiB of an idle
    /// connection's memory were mostly this) until bytes arrive.
    pub(super) async fn fill_idle(&mut self, n: usize, ahead: usize) -> io::Result<()> {
        if self.buffered() > 0 || self.buf.is_empty() {
            return self.fill_to(n, ahead).await;
        }
        if let Ok(r) = tokio::time::timeout(INPUT_IDLE, self.fill_to(n, ahead)).await {
            return r;
        }
        if self.buffered() == 0 {
            (self.buf, self.pos, self.end) = (Vec::new(), 0, 0);
            let mut first = [0u8; 64];
            let k = self.r.read(&mut first).await?;
            if k == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.room(k);
            self.buf[..k].copy_from_slice(&first[..k]);
            self.end = k;
        }
        self.fill_to(n, ahead).await
    }

    /// The stream underneath; bytes read ahead and not consumed are dropped.
    pub(super) fn into_inner(self) -> R {
        self.r
    }

    /// Bytes read ahead and not consumed yet.
    pub(super) fn buffered(&self) -> usize {
        self.end - self.pos
    }

    /// When nothing is buffered, reads whatever the socket has ready now, up
    /// to `limit` bytes, without waiting. EOF is not an error here: the
    /// next read_exact reports it.
    pub(super) async fn top_up(&mut self, limit: usize) -> io::Result<()> {
        if self.pos < self.end {
            return Ok(());
        }
        self.pos = 0;
        self.end = 0;
        self.room(INPUT_MIN);
        let want = limit;
        let limit = limit.min(self.buf.len());
        // One poll: a socket with nothing new since its last EAGAIN answers
        // Pending without a syscall.
        let r = tokio::select! {
            biased;
            r = self.r.read(&mut self.buf[self.end..limit]) => Some(r),
            _ = std::future::ready(()) => None,
        };
        match r {
            Some(Ok(n)) => {
                self.end += n;
                self.grow_if_full(want);
            }
            Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => {}
            Some(Err(e)) => return Err(e),
            None => {}
        }
        Ok(())
    }

    /// Reads until at least `n` bytes (at most READ_AHEAD) are buffered,
    /// and at most `ahead` more. Cancel-safe, unlike
    /// [`Input::read_exact`]: what arrived stays buffered, so a wait for a
    /// request header can be given up (shutdown, idle) and resumed.
    pub(super) async fn fill_to(&mut self, n: usize, ahead: usize) -> io::Result<()> {
        if self.buffered() >= n {
            return Ok(());
        }
        if self.pos > 0 {
            self.buf.copy_within(self.pos..self.end, 0);
            self.end -= self.pos;
            self.pos = 0;
        }
        self.room(n);
        let limit = (n + ahead).min(self.buf.len());
        while self.end < n {
            match self.r.read(&mut self.buf[self.end..limit]).await? {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                k => self.end += k,
            }
        }
        self.grow_if_full(n + ahead);
        Ok(())
    }

    /// Reads and drops the next `n` bytes (a payload the server refuses).
    pub(super) async fn skip(&mut self, n: u64) -> io::Result<()> {
        let held = (self.buffered() as u64).min(n);
        self.pos += held as usize;
        let mut left = n - held;
        while left > 0 {
            self.pos = 0;
            self.end = 0;
            self.room(INPUT_MIN);
            let k = left.min(self.buf.len() as u64) as usize;
            match self.r.read(&mut self.buf[..k]).await? {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                got => left -= got as u64,
            }
        }
        Ok(())
    }

    /// Consumes `n` of the buffered bytes (at most [`Input::buffered`]).
    pub(super) fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.buffered());
        self.pos += n;
        &self.buf[self.pos - n..self.pos]
    }

    /// Fills `dst`, reading at most `ahead` bytes beyond it into the buffer.
    /// EOF before `dst` is full is UnexpectedEof.
    pub(super) async fn read_exact(&mut self, dst: &mut [u8], ahead: usize) -> io::Result<()> {
        let n = (self.end - self.pos).min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        let mut done = n;
        if done == dst.len() {
            return Ok(());
        }
        let rest = dst.len() - done;
        // Big remainders go straight to `dst`: copying them through the
        // buffer would cost more than the syscall it saves.
        if ahead == 0 || rest >= READ_AHEAD / 2 {
            while done < dst.len() {
                match self.r.read(&mut dst[done..]).await? {
                    0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                    k => done += k,
                }
            }
            return Ok(());
        }
        // The buffer is empty here: refill it with this read and what follows.
        self.pos = 0;
        self.end = 0;
        self.fill_to(rest, ahead).await?;
        dst[done..].copy_from_slice(&self.buf[..rest]);
        self.pos = rest;
        Ok(())
    }
}

/// Recycles large payload buffers, so a steady stream of 1 MiB reads or
/// writes does not fault in fresh pages for every request. Small bounded
/// retention: at most `max_bufs` buffers of at most `max_len` bytes.
pub(super) struct BufPool {
    /// Each with when it was put back.
    bufs: Mutex<Vec<(Vec<u8>, Instant)>>,
    max_bufs: usize,
    max_len: usize,
}

impl BufPool {
    pub(super) fn new(max_bufs: usize, max_len: usize) -> Self {
        BufPool {
            bufs: Mutex::new(Vec::new()),
            max_bufs,
            max_len,
        }
    }

    /// A buffer holding `prefix + n` usable bytes from the returned start,
    /// placed so that `start + prefix` is DATA_ALIGN-aligned in memory.
    pub(super) fn get(&self, prefix: usize, n: usize) -> (Vec<u8>, usize) {
        let need = prefix + n + DATA_ALIGN;
        let picked = {
            let mut g = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
            // The smallest buffer that fits; a bigger request than any kept
            // gets a fresh zeroed allocation (calloc/mmap), not a grown one
            // (realloc would copy the old contents and memset the rest).
            let best = g
                .iter()
                .enumerate()
                .filter(|(_, (b, _))| b.len() >= need)
                .min_by_key(|(_, (b, _))| b.len())
                .map(|(i, _)| i);
            best.map(|i| g.swap_remove(i).0)
        };
        // Fresh buffers are rounded up to 64 KiB: a 1 MiB write payload and
        // a 1 MiB read reply (which carries a header) then fit each other's
        // recycled buffers, instead of the pool holding 16 of one size while
        // 16 more of the other are allocated beside them.
        let size = if need >= POOL_ROUND {
            need.next_multiple_of(POOL_ROUND)
        } else {
            need
        };
        let buf = picked.unwrap_or_else(|| vec![0u8; size]);
        let addr = buf.as_ptr() as usize + prefix;
        let start = (DATA_ALIGN - addr % DATA_ALIGN) % DATA_ALIGN;
        (buf, start)
    }

    /// Frees every kept buffer (no connection left to reuse them).
    pub(super) fn clear(&self) {
        self.bufs.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Frees the buffers unused for `idle`.
    pub(super) fn release_idle(&self, idle: Duration) {
        let mut g = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        g.retain(|(_, at)| at.elapsed() < idle);
    }

    pub(super) fn put(&self, buf: Vec<u8>) {
        if buf.capacity() < (64 << 10) || buf.capacity() > self.max_len {
            return;
        }
        let mut g = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if g.len() < self.max_bufs {
            g.push((buf, now));
            return;
        }
        // Full: keep the bigger buffers, which are the costly ones to fault in.
        if let Some((i, _)) = g.iter().enumerate().min_by_key(|(_, (b, _))| b.len()) {
            if g[i].0.len() < buf.len() {
                g[i] = (buf, now);
            }
        }
    }
}

/// Pipes of PIPE_BYTES kept for spliced reads, so a read does not pay
/// pipe2 + fcntl + two closes, and a cap on how many exist at all (each is
/// two descriptors, which accept() needs too).
pub(super) struct PipePool {
    /// Each with when it was put back; the most recent last.
    pipes: Mutex<Vec<(Pipe, Instant)>>,
    live: Arc<AtomicUsize>,
    /// The kernel refused a pipe of PIPE_BYTES (pipe-max-size lowered, the
    /// per-user pipe budget spent): reads are copied from then on.
    refused: AtomicBool,
}

impl PipePool {
    pub(super) fn new() -> Self {
        PipePool {
            pipes: Mutex::new(Vec::new()),
            live: Arc::new(AtomicUsize::new(0)),
            refused: AtomicBool::new(false),
        }
    }

    pub(super) fn get(&self) -> Option<Pipe> {
        if let Some((p, _)) = self.pipes.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Some(p);
        }
        if self.refused.load(Ordering::Relaxed) {
            return None;
        }
        // Reserve before creating, so racing readers cannot overshoot.
        if self.live.fetch_add(1, Ordering::Relaxed) >= PIPES_MAX {
            self.live.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        match Pipe::with_capacity(PIPE_BYTES, self.live.clone()) {
            Ok(p) => Some(p),
            Err(e) => {
                if e.raw_os_error() == Some(libc::EPERM) {
                    if !self.refused.swap(true, Ordering::Relaxed) {
                        warn!("a pipe of {PIPE_BYTES} bytes was refused ({e}): reads are copied");
                    }
                } else {
                    // EMFILE, ENFILE: this read is copied, the next may not be.
                    debug!("no pipe for a spliced read: {e}");
                }
                None
            }
        }
    }

    /// Closes every kept pipe (no connection left to reuse them): two
    /// descriptors each, which accept() may need.
    pub(super) fn clear(&self) {
        self.pipes.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Closes the pipes unused for `idle` (the oldest are first).
    pub(super) fn release_idle(&self, idle: Duration) {
        let mut g = self.pipes.lock().unwrap_or_else(|p| p.into_inner());
        let stale = g.partition_point(|(_, at)| at.elapsed() >= idle);
        g.drain(..stale);
    }

    pub(super) fn put(&self, p: Pipe) {
        let mut g = self.pipes.lock().unwrap_or_else(|p| p.into_inner());
        if g.len() < PIPES_KEPT {
            g.push((p, Instant::now()));
        }
    }
}
