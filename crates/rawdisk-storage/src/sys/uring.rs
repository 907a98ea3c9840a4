//! io_uring for the same O_DIRECT batches as [`super::Aio`], with the same
//! shape: one ring per queue, a batch submitted with one io_uring_enter,
//! completions counted on an eventfd registered with the ring. The file is
//! registered too (no descriptor lookup per request). The buffers are not:
//! they come from the connection's pool, not from one region the ring
//! could hold. As with AIO, a request's buffer and its file are owned by
//! the ring while the kernel may touch them.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;

use io_uring::{opcode, types, IoUring};

use super::aio::EventFd;
use super::{AioDone, AioOp};

/// A ring of at most `depth` requests in flight on one file, and the
/// eventfd the kernel signals each completion on.
pub struct Uring<F: AsFd, T> {
    ring: IoUring,
    efd: EventFd,
    /// In-flight ops by slot; the kernel's `user_data` is the slot.
    slots: Vec<Option<AioOp<T>>>,
    free: Vec<usize>,
    /// Held so the registered descriptor stays open while requests are in
    /// flight.
    _file: Arc<F>,
}

#[cfg(any(test, feature = "fault-injection"))]
thread_local! {
    /// The errno the next [`Uring::new`] on this thread fails with before
    /// io_uring_setup, as a kernel that refuses io_uring would; per thread,
    /// so a test does not turn io_uring off for the tests beside it.
    static REFUSE: std::cell::Cell<Option<i32>> = const { std::cell::Cell::new(None) };
}

/// Makes the next [`Uring::new`] on this thread fail with `errno` (tests).
#[cfg(any(test, feature = "fault-injection"))]
pub fn refuse_next_uring(errno: i32) {
    REFUSE.with(|r| r.set(Some(errno)));
}

impl<F: AsFd, T> Uring<F, T> {
    /// io_uring_setup for `depth` requests, the file and a non-blocking
    /// eventfd registered. Errors are io_uring_setup's (ENOSYS without
    /// io_uring; EPERM when kernel.io_uring_disabled or seccomp refuse it),
    /// eventfd's or io_uring_register's.
    pub fn new(file: Arc<F>, depth: usize) -> io::Result<Uring<F, T>> {
        #[cfg(any(test, feature = "fault-injection"))]
        if let Some(e) = REFUSE.with(|r| r.take()) {
            return Err(io::Error::from_raw_os_error(e));
        }
        let entries =
            u32::try_from(depth.max(1)).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SUBMIT_ALL (5.18): an op the kernel cannot start is consumed and
        // completes with its error, so a batch never stays half in the
        // submission queue; without it (older kernels) the rest waits there
        // for the next io_uring_enter.
        let ring = match IoUring::builder().setup_submit_all().build(entries) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => IoUring::new(entries)?,
            r => r?,
        };
        let efd = EventFd::new()?;
        let sub = ring.submitter();
        sub.register_files(&[file.as_fd().as_raw_fd()])?;
        sub.register_eventfd(efd.as_raw_fd())?;
        Ok(Uring {
            ring,
            efd,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            _file: file,
        })
    }

    /// The eventfd: readable once a completion is waiting.
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        self.efd.as_fd()
    }

    /// Requests submitted and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Makes the eventfd readable without a completion (wakes its waiter).
    pub fn wake(&self) {
        self.efd.wake();
    }

    /// Submits as many of `ops` as there are free slots, in one
    /// io_uring_enter. Returns those not queued (no slot, too long for one
    /// request) and the error of io_uring_enter, if any: what it did not
    /// take stays queued in the ring, in flight, for the next enter (a
    /// submit or a reap), and the eventfd is woken so that a reap comes.
    pub fn submit(&mut self, ops: Vec<AioOp<T>>) -> (Vec<AioOp<T>>, Option<io::Error>) {
        let mut back = Vec::new();
        let mut queued = 0;
        {
            let mut sq = self.ring.submission();
            for mut op in ops {
                let fits = op
                    .start
                    .checked_add(op.len)
                    .is_some_and(|e| e <= op.buf.len())
                    && u32::try_from(op.len).is_ok();
                let slot = if fits && !sq.is_full() {
                    self.free.pop()
                } else {
                    None
                };
                let Some(slot) = slot else {
                    back.push(op);
                    continue;
                };
                let ptr = op.buf[op.start..op.start + op.len].as_mut_ptr();
                let (fd, len) = (types::Fixed(0), op.len as u32);
                let sqe = if op.write {
                    opcode::Write::new(fd, ptr, len).offset(op.offset).build()
                } else {
                    opcode::Read::new(fd, ptr, len).offset(op.offset).build()
                };
                // SAFETY: the entry names registered file 0, `self.file`,
                // held open by the Arc in `self` until drop, which waits for
                // every request first; and `buf[start..start + len]` of the
                // op stored in its slot below, checked in bounds above: a
                // Vec's heap memory does not move while the Vec is moved,
                // and the op stays in its slot (never touched) until its
                // completion is reaped. The queue is not full (checked).
                let pushed = unsafe { sq.push(&sqe.user_data(slot as u64)) };
                if pushed.is_err() {
                    self.free.push(slot);
                    back.push(op);
                    continue;
                }
                self.slots[slot] = Some(op);
                queued += 1;
            }
        }
        if queued == 0 && self.ring.submission().is_empty() {
            return (back, None);
        }
        match self.enter(0) {
            Ok(()) => (back, None),
            Err(e) => {
                self.wake();
                (back, Some(e))
            }
        }
    }

    /// io_uring_enter for what is queued, waiting for `want` completions;
    /// EINTR is retried.
    fn enter(&self, want: usize) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(want) {
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
                Ok(_) => return Ok(()),
            }
        }
    }

    /// Every completion waiting; `wait`: at least one, blocking until it
    /// comes (when any is in flight). Clears the eventfd first so a
    /// completion after this call makes it readable again. What is still
    /// queued in the ring is submitted first; that failing is the error.
    pub fn reap(&mut self, out: &mut Vec<AioDone<T>>, wait: bool) -> io::Result<()> {
        self.efd.clear();
        let from = out.len();
        let mut first = true;
        while self.in_flight() > 0 {
            let queued = !self.ring.submission().is_empty();
            let block = wait && out.len() == from && !first;
            if queued || block {
                self.enter(usize::from(block))?;
            }
            first = false;
            for cqe in self.ring.completion() {
                let slot = cqe.user_data() as usize;
                let Some(op) = self.slots.get_mut(slot).and_then(Option::take) else {
                    continue;
                };
                self.free.push(slot);
                let res = cqe.result();
                let result = if res < 0 {
                    Err(io::Error::from_raw_os_error(-res))
                } else {
                    Ok(res as usize)
                };
                out.push(AioDone { op, result });
            }
            if !wait || out.len() > from {
                break;
            }
        }
        Ok(())
    }
}

impl<F: AsFd, T> Drop for Uring<F, T> {
    fn drop(&mut self) {
        // Closing a ring does not wait for its requests: the kernel may
        // write into their buffers after. Wait here, and if that fails,
        // never free what the kernel may still write into.
        let mut done = Vec::new();
        while self.in_flight() > 0 {
            if let Err(e) = self.reap(&mut done, true) {
                tracing::warn!(
                    "io_uring_enter waiting for requests: {e}; their buffers are leaked"
                );
                for op in self.slots.drain(..).flatten() {
                    std::mem::forget(op.buf);
                }
                return;
            }
            done.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::unix::fs::FileExt;

    fn op(write: bool, offset: u64, data: &[u8], tag: u32) -> AioOp<u32> {
        // Two spare bytes in front: `start` is honoured.
        let mut buf = vec![0xEE; data.len() + 2];
        buf[2..].copy_from_slice(data);
        AioOp {
            write,
            offset,
            buf,
            start: 2,
            len: data.len(),
            tag,
        }
    }

    fn reap_all(u: &mut Uring<File, u32>) -> Vec<AioDone<u32>> {
        let mut out = Vec::new();
        while u.in_flight() > 0 {
            u.reap(&mut out, true).unwrap();
        }
        out
    }

    fn file(len: usize) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + 1) as u8).collect();
        std::fs::write(&path, data).unwrap();
        (dir, path)
    }

    #[test]
    fn writes_and_reads_come_back_with_their_bytes() {
        let (_d, path) = file(64 << 10);
        let f = File::options().read(true).write(true).open(&path).unwrap();
        let f = Arc::new(f);
        let mut u = Uring::<File, u32>::new(f.clone(), 4).unwrap();
        let data = |i: u32| vec![i as u8 + 0x40; 1000];
        // Six ops on four slots: two come back at once, untouched.
        let ops = (0..6)
            .map(|i| op(true, i as u64 * 4096, &data(i), i))
            .collect();
        let (back, err) = u.submit(ops);
        assert!(err.is_none());
        assert_eq!(back.iter().map(|o| o.tag).collect::<Vec<_>>(), vec![4, 5]);
        assert_eq!(back[0].buf[2..], data(4)[..]);
        let done = reap_all(&mut u);
        let mut tags: Vec<_> = done.iter().map(|d| d.op.tag).collect();
        tags.sort();
        assert_eq!(tags, vec![0, 1, 2, 3]);
        assert!(done.iter().all(|d| matches!(d.result, Ok(1000))));
        for i in 0..4u32 {
            let mut b = vec![0u8; 1000];
            f.read_exact_at(&mut b, i as u64 * 4096).unwrap();
            assert_eq!(b, data(i), "write {i}");
        }
        // Reads land at `start`, the bytes before it untouched.
        let ops = (0..4)
            .map(|i| op(false, i as u64 * 4096, &[0; 1000], i))
            .collect();
        assert!(u.submit(ops).0.is_empty());
        for d in reap_all(&mut u) {
            assert!(matches!(d.result, Ok(1000)));
            assert_eq!(d.op.buf[..2], [0xEE, 0xEE]);
            assert_eq!(d.op.buf[2..], data(d.op.tag)[..], "read {}", d.op.tag);
        }
        assert!(u.submit(Vec::new()).0.is_empty());
        // Nothing in flight: a waiting reap returns at once.
        let mut out = Vec::new();
        u.reap(&mut out, true).unwrap();
        assert!(out.is_empty());
    }

    #[test]
    fn short_and_failed_ops_come_back_as_such() {
        let (_d, path) = file(10_000);
        let ro = Arc::new(File::open(&path).unwrap());
        let mut u = Uring::<File, u32>::new(ro, 4).unwrap();
        let ops = vec![
            op(false, 8192, &[0; 4096], 1),
            op(true, 0, &[9; 512], 2),
            op(false, 20_000, &[0; 512], 3),
        ];
        assert!(u.submit(ops).0.is_empty());
        let mut done = reap_all(&mut u);
        done.sort_by_key(|d| d.op.tag);
        assert!(matches!(done[0].result, Ok(n) if n == 10_000 - 8192));
        let want: Vec<u8> = (8192..10_000).map(|i| (i * 7 + 1) as u8).collect();
        assert_eq!(done[0].op.buf[2..2 + want.len()], want[..]);
        let e = done[1].result.as_ref().unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(libc::EBADF),
            "a write to a read-only file"
        );
        assert!(matches!(done[2].result, Ok(0)), "past the end");
        // An op whose range is not in its buffer is never submitted.
        let mut bad = op(false, 0, &[0; 16], 4);
        bad.len = 100;
        let (back, err) = u.submit(vec![bad]);
        assert!(err.is_none() && back.len() == 1 && u.in_flight() == 0);
    }

    #[test]
    fn drop_waits_for_what_is_in_flight() {
        let (_d, path) = file(1 << 20);
        let f = Arc::new(File::open(&path).unwrap());
        let mut u = Uring::<File, u32>::new(f, 64).unwrap();
        let ops = (0..64)
            .map(|i| op(false, i as u64 * 16384, &[0; 16384], i))
            .collect();
        assert!(u.submit(ops).0.is_empty());
        drop(u);
    }
}
