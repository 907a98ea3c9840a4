//! Linux native AIO (io_setup, io_submit, io_getevents) with an eventfd
//! that counts completions, for O_DIRECT reads and writes many at a time
//! from one thread. Outside the `syscalls!` table, like [`super::Mapping`]:
//! a request's buffer and its file are owned by the context while the
//! kernel may touch them, so no caller can free or reuse memory the kernel
//! still writes to. Every call is a raw syscall; libc wraps none of them.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

const IOCB_CMD_PREAD: u16 = 0;
const IOCB_CMD_PWRITE: u16 = 1;
/// Signal completions on `aio_resfd`.
const IOCB_FLAG_RESFD: u32 = 1;

/// `struct iocb` of <linux/aio_abi.h>.
#[repr(C)]
#[derive(Default)]
struct Iocb {
    aio_data: u64,
    #[cfg(target_endian = "little")]
    aio_key: u32,
    aio_rw_flags: i32,
    #[cfg(target_endian = "big")]
    aio_key: u32,
    aio_lio_opcode: u16,
    aio_reqprio: i16,
    aio_fildes: u32,
    aio_buf: u64,
    aio_nbytes: u64,
    aio_offset: i64,
    aio_reserved2: u64,
    aio_flags: u32,
    aio_resfd: u32,
}

/// `struct io_event` of <linux/aio_abi.h>.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

/// One read or write to submit: `len` bytes at `offset` of the file, from
/// or into `buf[start..start + len]`; `tag` comes back with its result.
pub struct AioOp<T> {
    pub write: bool,
    pub offset: u64,
    pub buf: Vec<u8>,
    pub start: usize,
    pub len: usize,
    pub tag: T,
}

impl<T> AioOp<T> {
    /// The same op, its tag replaced by `f` of it.
    pub fn map_tag<U>(self, f: impl FnOnce(T) -> U) -> AioOp<U> {
        AioOp {
            write: self.write,
            offset: self.offset,
            buf: self.buf,
            start: self.start,
            len: self.len,
            tag: f(self.tag),
        }
    }
}

/// A finished op with the kernel's result: the bytes moved, or the error.
pub struct AioDone<T> {
    pub op: AioOp<T>,
    pub result: io::Result<usize>,
}

/// A non-blocking eventfd the kernel counts completions on, shared by the
/// AIO and io_uring queues: the reaper waits for it to be readable.
pub(super) struct EventFd(OwnedFd);

impl EventFd {
    pub(super) fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd takes two integers and returns a new descriptor
        // or -1; nothing is borrowed.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by no one else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub(super) fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }

    pub(super) fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Makes it readable without a completion (wakes its waiter).
    pub(super) fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local array to our eventfd.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Clears the count, so a completion after this makes it readable again.
    pub(super) fn clear(&self) {
        let mut cnt = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local array from our
        // non-blocking eventfd; EAGAIN (nothing counted) is ignored.
        let _ = unsafe { libc::read(self.0.as_raw_fd(), cnt.as_mut_ptr().cast(), 8) };
    }
}

/// An AIO context of at most `depth` requests in flight on one file, and
/// the eventfd the kernel counts their completions on.
pub struct Aio<F: AsFd, T> {
    ctx: libc::c_ulong,
    efd: EventFd,
    /// In-flight ops by slot; the kernel's `aio_data` is the slot.
    slots: Vec<Option<AioOp<T>>>,
    free: Vec<usize>,
    /// Held so the descriptor stays open while requests are in flight.
    file: Arc<F>,
}

impl<F: AsFd, T> Aio<F, T> {
    /// io_setup for `depth` requests and a non-blocking eventfd. Errors are
    /// io_setup's (ENOSYS without AIO, EAGAIN past fs.aio-max-nr) or
    /// eventfd's.
    pub fn new(file: Arc<F>, depth: usize) -> io::Result<Aio<F, T>> {
        let efd = EventFd::new()?;
        let mut ctx: libc::c_ulong = 0;
        // SAFETY: io_setup writes one aio_context_t through the pointer,
        // which points to a live local initialised to 0 as it requires.
        let r = unsafe {
            libc::syscall(
                libc::SYS_io_setup,
                depth as libc::c_long,
                &mut ctx as *mut libc::c_ulong,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Aio {
            ctx,
            efd,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            file,
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

    /// Submits as many of `ops` as there are free slots, in one io_submit.
    /// Returns those not submitted (no slot, or the kernel took only part)
    /// and, when io_submit failed for the first one, its error.
    pub fn submit(&mut self, ops: Vec<AioOp<T>>) -> (Vec<AioOp<T>>, Option<io::Error>) {
        let mut back = Vec::new();
        let mut iocbs: Vec<Iocb> = Vec::with_capacity(ops.len());
        let mut used = Vec::with_capacity(ops.len());
        let fd = self.file.as_fd().as_raw_fd() as u32;
        let resfd = self.efd.as_raw_fd() as u32;
        for mut op in ops {
            let fits = op
                .start
                .checked_add(op.len)
                .is_some_and(|e| e <= op.buf.len());
            let slot = if fits { self.free.pop() } else { None };
            let Some(slot) = slot else {
                back.push(op);
                continue;
            };
            let ptr = op.buf[op.start..op.start + op.len].as_mut_ptr() as u64;
            iocbs.push(Iocb {
                aio_data: slot as u64,
                aio_lio_opcode: if op.write {
                    IOCB_CMD_PWRITE
                } else {
                    IOCB_CMD_PREAD
                },
                aio_fildes: fd,
                aio_buf: ptr,
                aio_nbytes: op.len as u64,
                aio_offset: op.offset as i64,
                aio_flags: IOCB_FLAG_RESFD,
                aio_resfd: resfd,
                ..Iocb::default()
            });
            self.slots[slot] = Some(op);
            used.push(slot);
        }
        if iocbs.is_empty() {
            return (back, None);
        }
        let mut ptrs: Vec<*mut Iocb> = iocbs.iter_mut().map(|c| c as *mut Iocb).collect();
        // SAFETY: every pointer in `ptrs` is a live, initialised iocb (the
        // kernel copies them during the call). Each names `self.file`'s
        // descriptor, held open by the Arc in `self` until drop, which
        // io_destroy's first; and `buf[start..start + len]` of an op stored
        // in its slot, checked in bounds above: a Vec's heap memory does not
        // move while the Vec is moved, and the op stays in its slot (never
        // touched) until io_getevents returns it or drop has io_destroy wait.
        let r = unsafe {
            libc::syscall(
                libc::SYS_io_submit,
                self.ctx,
                ptrs.len() as libc::c_long,
                ptrs.as_mut_ptr(),
            )
        };
        let (taken, err) = if r < 0 {
            (0, Some(io::Error::last_os_error()))
        } else {
            (r as usize, None)
        };
        for &slot in &used[taken..] {
            back.extend(self.slots[slot].take());
            self.free.push(slot);
        }
        (back, err)
    }

    /// Every completion waiting; `wait`: at least one, blocking until it
    /// comes (when any is in flight). Clears the eventfd first so a
    /// completion after this call makes it readable again.
    pub fn reap(&mut self, out: &mut Vec<AioDone<T>>, wait: bool) -> io::Result<()> {
        self.efd.clear();
        let mut events = [IoEvent::default(); 64];
        while self.in_flight() > 0 {
            let zero = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            let (min, timeout) = if wait && out.is_empty() {
                (1, std::ptr::null())
            } else {
                (0, &zero as *const libc::timespec)
            };
            // SAFETY: io_getevents writes at most `events.len()` io_events
            // into the live local array and reads the timespec, if any; a
            // zero timeout makes it return at once.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_getevents,
                    self.ctx,
                    min as libc::c_long,
                    events.len() as libc::c_long,
                    events.as_mut_ptr(),
                    timeout,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(e);
            }
            let n = r as usize;
            for ev in &events[..n] {
                let slot = ev.data as usize;
                let Some(op) = self.slots.get_mut(slot).and_then(Option::take) else {
                    continue;
                };
                self.free.push(slot);
                let result = if ev.res < 0 {
                    Err(io::Error::from_raw_os_error(-ev.res as i32))
                } else {
                    Ok(ev.res as usize)
                };
                out.push(AioDone { op, result });
            }
            if n < events.len() {
                break;
            }
        }
        Ok(())
    }
}

impl<F: AsFd, T> Drop for Aio<F, T> {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from io_setup and is destroyed once. io_destroy
        // waits for every request in flight, so the buffers and the file
        // dropped after it are no longer the kernel's.
        let r = unsafe { libc::syscall(libc::SYS_io_destroy, self.ctx) };
        if r < 0 {
            let e = io::Error::last_os_error();
            tracing::warn!("io_destroy of an AIO context: {e}; its buffers are leaked");
            // The kernel may still write into them: never free them.
            for op in self.slots.drain(..).flatten() {
                std::mem::forget(op.buf);
            }
        }
    }
}
