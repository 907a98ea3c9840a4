//! cache=none, many requests in flight from one thread: aligned reads and
//! writes submitted with Linux AIO or io_uring in one call per batch,
//! completions counted on an eventfd the caller polls. Under O_DIRECT a
//! blocking thread per request costs a wake-up each; one submit and one
//! reap cost two syscalls for the whole batch (docs/benchmarks.md, Small
//! O_DIRECT requests).
//!
//! Only what the kernel does in one call goes this way: aligned offset,
//! length and buffer, a write inside the size last seen (the padding cut of
//! `direct.rs` needs the blocking path). A write holds the aligned span in
//! the range lock from submission to completion, so no read-modify-write
//! runs over it; a span already held is refused rather than waited for.
//! Everything refused, and every op that failed or came back short, is the
//! caller's to run the blocking way, which reports the error as usual.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use super::{Kind, Target};
use crate::errno::{is_unsupported, Einval};
use crate::sys::{Aio, AioDone, AioOp, Uring};

/// Whether io_setup / io_uring_setup works on this kernel, learned once
/// per process.
pub(crate) const UNKNOWN: u8 = 0;
const WORKS: u8 = 1;
pub(crate) const FAILS: u8 = 2;
static AIO_STATE: AtomicU8 = AtomicU8::new(UNKNOWN);
static URING_STATE: AtomicU8 = AtomicU8::new(UNKNOWN);

/// The kernel interface of a [`DirectQueue`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DirectBackend {
    /// Linux native AIO (io_submit).
    #[default]
    Native,
    /// io_uring; Linux AIO where the kernel refuses it.
    IoUring,
}

/// The target's descriptor for the AIO context, which holds it open.
struct Handle(Arc<Target>);

impl AsFd for Handle {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.fd()
    }
}

/// What the context carries beside an op: the caller's tag and the span a
/// write holds in the range lock.
struct Held<T> {
    tag: T,
    span: Option<(u64, u64)>,
}

/// One read or write of `len` bytes at `offset`, from or into
/// `buf[start..start + len]`.
pub type DirectOp<T> = AioOp<T>;

/// A finished op; `done` false: it failed or moved fewer bytes, and is to be
/// run again the blocking way (which reports the error).
pub struct DirectDone<T> {
    pub op: DirectOp<T>,
    pub done: bool,
}

/// The kernel interface a queue got.
enum Ring<T> {
    Aio(Aio<Handle, Held<T>>),
    /// Boxed: the ring is several times the size of an AIO context.
    Uring(Box<Uring<Handle, Held<T>>>),
}

/// The same call on whichever interface `$r` is.
macro_rules! on_ring {
    ($r:expr, $q:ident => $e:expr) => {
        match $r {
            Ring::Aio($q) => $e,
            Ring::Uring($q) => $e,
        }
    };
}

/// Reads and writes of one cache=none target in flight in the kernel.
pub struct DirectQueue<T> {
    aio: Ring<T>,
    target: Arc<Target>,
}

impl Target {
    /// A queue of at most `depth` requests on the default interface
    /// ([`DirectBackend::default`]); see [`Target::direct_queue_on`].
    pub fn direct_queue<T>(self: &Arc<Self>, depth: usize) -> Option<DirectQueue<T>> {
        self.direct_queue_on(depth, DirectBackend::default())
    }

    /// A queue of at most `depth` requests through `backend`, or None: not
    /// cache=none, not the kernel's own calls (a test's fault injector must
    /// see every read and write), or setting it up failed. A kernel that
    /// refuses io_uring gets Linux AIO; one without AIO, threads: each
    /// learned for the process (any other error only fails this one).
    pub fn direct_queue_on<T>(
        self: &Arc<Self>,
        depth: usize,
        backend: DirectBackend,
    ) -> Option<DirectQueue<T>> {
        self.direct_queue_in(depth, backend, &URING_STATE)
    }

    /// [`Target::direct_queue_on`] learning whether io_uring works in
    /// `uring` (a test's own, so that its refusal stays its own).
    pub(crate) fn direct_queue_in<T>(
        self: &Arc<Self>,
        depth: usize,
        backend: DirectBackend,
        uring: &AtomicU8,
    ) -> Option<DirectQueue<T>> {
        if self.direct.is_none() || !self.real_kernel {
            return None;
        }
        if backend == DirectBackend::IoUring {
            if let Some(q) = self.uring_queue(depth, uring) {
                return Some(q);
            }
        }
        self.aio_queue(depth)
    }

    /// An io_uring queue, or None (`state`: whether io_uring works).
    fn uring_queue<T>(self: &Arc<Self>, depth: usize, state: &AtomicU8) -> Option<DirectQueue<T>> {
        if state.load(Ordering::Relaxed) == FAILS {
            return None;
        }
        match Uring::new(Arc::new(Handle(self.clone())), depth) {
            Ok(r) => {
                state.store(WORKS, Ordering::Relaxed);
                Some(DirectQueue {
                    aio: Ring::Uring(Box::new(r)),
                    target: self.clone(),
                })
            }
            // Refused for the process: EPERM (kernel.io_uring_disabled,
            // seccomp), ENOSYS (no io_uring), EINVAL (too old for a plain
            // ring). ENOMEM, EMFILE pass, as for AIO below.
            Err(e) if uring_refused(&e) => {
                if state.swap(FAILS, Ordering::Relaxed) != FAILS {
                    tracing::info!("io_uring_setup: {e}; cache=none requests use Linux AIO");
                }
                None
            }
            Err(e) => {
                tracing::debug!(path = %self.path.display(), "io_uring: {e}; this connection uses Linux AIO");
                None
            }
        }
    }

    fn aio_queue<T>(self: &Arc<Self>, depth: usize) -> Option<DirectQueue<T>> {
        if AIO_STATE.load(Ordering::Relaxed) == FAILS {
            return None;
        }
        match Aio::new(Arc::new(Handle(self.clone())), depth) {
            Ok(aio) => {
                AIO_STATE.store(WORKS, Ordering::Relaxed);
                Some(DirectQueue {
                    aio: Ring::Aio(aio),
                    target: self.clone(),
                })
            }
            // Only "no AIO here" is learned for the process; EAGAIN
            // (fs.aio-max-nr), EMFILE (the eventfd) or ENOMEM pass, and a
            // thousand connections must not turn AIO off for good.
            Err(e) if is_unsupported(&e, Einval::Invalid) => {
                if AIO_STATE.swap(FAILS, Ordering::Relaxed) != FAILS {
                    tracing::info!("io_setup: {e}; cache=none requests use threads");
                }
                None
            }
            Err(e) => {
                tracing::debug!(path = %self.path.display(), "io_setup: {e}; this connection uses threads");
                None
            }
        }
    }
}

/// io_uring_setup's "not here, for anyone in this process".
fn uring_refused(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EPERM | libc::EACCES | libc::EINVAL)
    ) || is_unsupported(e, Einval::Invalid)
}

impl<T> DirectQueue<T> {
    /// Submits what qualifies in one call; returns the rest, to run the
    /// blocking way.
    pub fn submit(&mut self, ops: Vec<DirectOp<T>>) -> Vec<DirectOp<T>> {
        let t = &*self.target;
        let Some(d) = &t.direct else {
            return ops;
        };
        let mut refused = Vec::new();
        let mut go = Vec::with_capacity(ops.len());
        let known = t.known_size.load(Ordering::Relaxed);
        for op in ops {
            let ok = op.len > 0
                && op
                    .start
                    .checked_add(op.len)
                    .is_some_and(|e| e <= op.buf.len())
                && op
                    .offset
                    .checked_add(op.len as u64)
                    .is_some_and(|e| e <= i64::MAX as u64)
                && d.aligned(op.offset, op.len, op.buf[op.start..].as_ptr());
            // Aligned, so the span is the op's own range (saturating: an op
            // past i64::MAX is refused above, and must not overflow here).
            let span = (op.offset, op.offset.saturating_add(op.len as u64));
            let ok = ok
                && (!op.write
                    || !t.read_only
                        && (t.kind == Kind::Block || span.1 <= known)
                        && d.range_lock().try_lock(span.0, span.1));
            if !ok {
                refused.push(op);
                continue;
            }
            let span = op.write.then_some(span);
            go.push(op.map_tag(|tag| Held { tag, span }));
        }
        let (back, err) = on_ring!(&mut self.aio, q => q.submit(go));
        if let Some(e) = &err {
            tracing::debug!(path = %t.path.display(), "submitting to the kernel: {e}");
        }
        for op in back {
            refused.push(self.give_back(op));
        }
        refused
    }

    /// Every completion waiting; `wait`: at least one, blocking until it
    /// comes (when any is in flight), for a caller that cannot poll the
    /// eventfd. What came back is in `out` also when io_getevents failed.
    pub fn reap(&mut self, out: &mut Vec<DirectDone<T>>, wait: bool) -> std::io::Result<()> {
        let mut done: Vec<AioDone<Held<T>>> = Vec::new();
        let r = on_ring!(&mut self.aio, q => q.reap(&mut done, wait));
        for AioDone { op, result } in done {
            let len = op.len;
            let offset = op.offset;
            let ok = matches!(result, Ok(n) if n == len);
            if let Err(e) = &result {
                tracing::debug!(offset, len, "in the kernel: {e}; run again by a thread");
            }
            out.push(DirectDone {
                op: self.give_back(op),
                done: ok,
            });
        }
        r
    }

    /// The op as the caller gave it, its span unlocked.
    fn give_back(&self, op: AioOp<Held<T>>) -> DirectOp<T> {
        if let (Some((a0, a1)), Some(d)) = (op.tag.span, &self.target.direct) {
            d.range_lock().unlock(a0, a1);
        }
        op.map_tag(|h| h.tag)
    }

    /// Readable once a completion waits (or after [`DirectQueue::wake`]).
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        on_ring!(&self.aio, q => q.event_fd())
    }

    pub fn in_flight(&self) -> usize {
        on_ring!(&self.aio, q => q.in_flight())
    }

    /// Makes the eventfd readable, to wake whoever waits on it.
    pub fn wake(&self) {
        on_ring!(&self.aio, q => q.wake());
    }

    /// The kernel interface this queue got.
    pub fn backend(&self) -> DirectBackend {
        match self.aio {
            Ring::Aio(_) => DirectBackend::Native,
            Ring::Uring(_) => DirectBackend::IoUring,
        }
    }
}

impl<T> Drop for DirectQueue<T> {
    /// Waits for what is in flight, so that the spans its writes hold are
    /// given back (else a later read-modify-write of them would wait
    /// forever).
    fn drop(&mut self) {
        while self.in_flight() > 0 {
            let mut done = Vec::new();
            if let Err(e) = on_ring!(&mut self.aio, q => q.reap(&mut done, true)) {
                tracing::warn!(path = %self.target.path.display(), "waiting for requests in flight: {e}");
                return;
            }
            for AioDone { op, .. } in done {
                drop(self.give_back(op));
            }
        }
    }
}
