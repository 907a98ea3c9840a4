//! cache=none reads and writes of one connection in flight in the kernel
//! (Linux AIO or io_uring, through the export layer): the reader submits a
//! gathered batch in one call, a reaper task answers each when its
//! completion shows on the queue's eventfd, writing the replies under the
//! writer's lock as the reader does. Under O_DIRECT a pool thread woken per
//! batch ran its requests one after another, so the device saw few at a
//! time and the wake-ups were most of the server's CPU (docs/benchmarks.md,
//! Small O_DIRECT requests). A FUA write, and whatever the queue refuses or
//! fails, still goes to the pool.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use rawdisk_storage::{DirectDone, DirectOp, DirectQueue};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::mpsc;
use tracing::{debug, warn, Instrument};

use super::writer::{put_reply, within, Out};
use super::{is_small, on_pool, Job, Permits};
use crate::proto::{Command, ReplyTo, Request};
use crate::server::command::{data_buffer, data_reply, plain_read, small_ok, whole};
use crate::server::limits::Counters;
use crate::server::{Session, Shared};
use crate::sock::RawSock;

/// Requests one connection keeps in the kernel at most; more go to the
/// pool (64 threads by default, so this is already the deeper queue).
const DEPTH: usize = 128;

/// What the reaper writes replies with: the connection's writer.
pub(super) struct Direct<W> {
    pub(super) wr: Arc<tokio::sync::Mutex<BufWriter<W>>>,
    pub(super) sink: Option<RawSock>,
    pub(super) counters: Arc<Counters>,
}

/// What a request in flight needs for its reply.
struct Pending {
    req: Request,
    to: ReplyTo,
    permits: Permits,
    /// Where a read's reply header starts in its buffer.
    hdr: usize,
}

/// The connection's queue and what its reaper needs to know.
pub(super) struct InKernel {
    q: Mutex<DirectQueue<Pending>>,
    efd: RawFd,
    /// The reader is done: the reaper ends once nothing is in flight.
    closed: AtomicBool,
    /// The reaper could not poll or reap: set under the queue's lock, after
    /// which nothing more is submitted (all goes to the pool).
    stuck: AtomicBool,
}

/// The eventfd as tokio polls it; the queue owns it, and the reaper holds
/// the queue.
struct EventFd(Arc<InKernel>);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.efd
    }
}

impl InKernel {
    /// The queue and its reaper, or None: the pool serves this connection.
    pub(super) fn start<W: AsyncWrite + Unpin + Send + 'static>(
        sh: &Arc<Shared>,
        s: &Arc<Session>,
        tx: &mpsc::UnboundedSender<Box<Out>>,
        out: Direct<W>,
    ) -> Option<Arc<InKernel>> {
        let q: DirectQueue<Pending> = s.export.direct_queue(DEPTH)?;
        let efd = q.event_fd().as_raw_fd();
        let k = Arc::new(InKernel {
            q: Mutex::new(q),
            efd,
            closed: AtomicBool::new(false),
            stuck: AtomicBool::new(false),
        });
        let interest = tokio::io::Interest::READABLE;
        // SAFETY: EventFd holds the queue, which owns the eventfd, so the
        // descriptor registered stays open and the same until the AsyncFd
        // (and with it that hold) is dropped; as in sock.rs.
        let fd = match unsafe { AsyncFd::register_with_interest(EventFd(k.clone()), interest) } {
            Ok(fd) => fd,
            Err(e) => {
                warn!("polling the AIO eventfd: {e}; requests use threads");
                return None;
            }
        };
        let reaper = reaper(fd, sh.clone(), s.clone(), tx.clone(), out);
        tokio::spawn(
            async move {
                if let Err(e) = reaper.await {
                    warn!("waiting for AIO completions: {e}");
                }
            }
            .in_current_span(),
        );
        Some(k)
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, DirectQueue<Pending>> {
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Submits the reads and writes of `jobs` that may run in the kernel;
    /// returns the others, in order, for the pool.
    pub(super) fn submit(&self, sh: &Shared, s: &Session, jobs: Vec<Job>) -> Vec<Job> {
        let mut rest = Vec::new();
        let mut ops = Vec::with_capacity(jobs.len());
        for j in jobs {
            // Small ones only (not FUA): bigger writes were not measured
            // this way (docs/benchmarks.md, Small O_DIRECT requests).
            let write = j.req.command == Command::Write && is_small(&j.req) && j.data.is_some();
            if write {
                let Job {
                    req,
                    to,
                    data,
                    permits,
                } = j;
                let (buf, start, len) = data.expect("checked above");
                ops.push(DirectOp {
                    write: true,
                    offset: req.offset,
                    buf,
                    start,
                    len,
                    tag: Pending {
                        req,
                        to,
                        permits,
                        hdr: 0,
                    },
                });
            } else if plain_read(&j.req) {
                let n = j.req.length as usize;
                let (buf, hdr, d) = data_buffer(sh, s, n);
                ops.push(DirectOp {
                    write: false,
                    offset: j.req.offset,
                    buf,
                    start: d,
                    len: n,
                    tag: Pending {
                        req: j.req,
                        to: j.to,
                        permits: j.permits,
                        hdr,
                    },
                });
            } else {
                rest.push(j);
            }
        }
        if ops.is_empty() {
            return rest;
        }
        let refused = if self.stuck.load(Ordering::Acquire) {
            ops
        } else {
            // Checked again under the lock the reaper sets it under: what is
            // submitted here, the reaper drains.
            let mut q = self.queue();
            if self.stuck.load(Ordering::Acquire) {
                ops
            } else {
                s.export.submit_direct(&mut q, ops)
            }
        };
        rest.extend(refused.into_iter().map(|op| job_of(sh, op)));
        rest
    }

    /// The reader is done: the reaper ends after the last completion.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        // A stuck reaper waits on the queue's lock and wakes by itself.
        if !self.stuck.load(Ordering::Acquire) {
            self.queue().wake();
        }
    }
}

/// The job an op came from, to run the blocking way (a read's buffer goes
/// back to the pool: `execute` reads into its own).
fn job_of(sh: &Shared, op: DirectOp<Pending>) -> Job {
    let Pending {
        req, to, permits, ..
    } = op.tag;
    let data = if op.write {
        Some((op.buf, op.start, op.len))
    } else {
        sh.pool.put(op.buf);
        None
    };
    Job {
        req,
        to,
        data,
        permits,
    }
}

/// Answers completions as the eventfd shows them, until the reader is
/// done and nothing is in flight. If the eventfd cannot be polled or
/// io_getevents fails, the requests in flight are still answered: see
/// [`drain`].
async fn reaper<W: AsyncWrite + Unpin + Send>(
    fd: AsyncFd<EventFd>,
    sh: Arc<Shared>,
    s: Arc<Session>,
    tx: mpsc::UnboundedSender<Box<Out>>,
    out: Direct<W>,
) -> io::Result<()> {
    let k = fd.get_ref().0.clone();
    let mut a = Answers {
        sh,
        s,
        tx,
        out,
        own: true,
        replies: Vec::new(),
    };
    let mut done: Vec<DirectDone<Pending>> = Vec::new();
    loop {
        let polled = fd.readable().await;
        #[cfg(feature = "fault-injection")]
        let polled = polled.and_then(|r| {
            if crate::server::fault::aio_poll_fails() {
                Err(io::Error::other(
                    "injected: the AIO eventfd cannot be polled",
                ))
            } else {
                Ok(r)
            }
        });
        let reaped = match polled {
            Ok(mut ready) => {
                ready.clear_ready();
                let mut q = k.queue();
                a.s.export.reap_direct(&mut q, &mut done, false)
            }
            Err(e) => Err(e),
        };
        a.answer(&mut done).await;
        if let Err(e) = reaped {
            return drain(&k, &mut a, e).await;
        }
        if k.queue().in_flight() == 0 && k.closed.load(Ordering::Acquire) {
            return Ok(());
        }
    }
}

/// The reaper lost its eventfd (`e`): nothing more is submitted, and each
/// request in flight is answered as it completes, waited for on a blocking
/// thread, since nothing will wake the reaper for it. If even that fails,
/// the connection's write side is shut, so the client sees the connection
/// end instead of waiting for replies that cannot come.
async fn drain<W: AsyncWrite + Unpin + Send>(
    k: &Arc<InKernel>,
    a: &mut Answers<W>,
    e: io::Error,
) -> io::Result<()> {
    let left = {
        let q = k.queue();
        k.stuck.store(true, Ordering::Release);
        q.in_flight()
    };
    warn!("AIO completions: {e}; waiting for the {left} requests in flight");
    while k.queue().in_flight() > 0 {
        let (k2, s) = (k.clone(), a.s.clone());
        let waited = tokio::task::spawn_blocking(move || {
            let mut done = Vec::new();
            let r = s.export.reap_direct(&mut k2.queue(), &mut done, true);
            (done, r)
        })
        .await;
        let (mut done, r) = match waited {
            Ok(v) => v,
            Err(j) => (Vec::new(), Err(io::Error::other(j))),
        };
        a.answer(&mut done).await;
        if let Err(e) = r {
            let mut w = a.out.wr.lock().await;
            let _ = within(a.sh.cfg.idle_timeout, w.shutdown()).await;
            // Logged once, by the reaper's task.
            return Err(io::Error::new(e.kind(), format!("{e}; connection shut")));
        }
    }
    Ok(())
}

/// Turns completions into replies and sends them.
struct Answers<W> {
    sh: Arc<Shared>,
    s: Arc<Session>,
    tx: mpsc::UnboundedSender<Box<Out>>,
    out: Direct<W>,
    /// After a failed write the writer task sends (and meets the error).
    own: bool,
    replies: Vec<Out>,
}

impl<W: AsyncWrite + Unpin + Send> Answers<W> {
    /// Answers each of `done`; what failed or came back short goes to the
    /// pool, which runs it again and reports the error.
    async fn answer(&mut self, done: &mut Vec<DirectDone<Pending>>) {
        let (sh, s) = (&self.sh, &self.s);
        let mut again = Vec::new();
        for d in done.drain(..) {
            if !d.done {
                again.push(job_of(sh, d.op));
                continue;
            }
            let DirectOp {
                buf, start, tag, ..
            } = d.op;
            let Pending {
                req,
                to,
                permits,
                hdr,
            } = tag;
            let reply = if req.command == Command::Read {
                data_reply(s, &req, to, buf, hdr, start)
            } else {
                sh.pool.put(buf);
                whole(small_ok(s, to))
            };
            self.out.counters.aio_completed();
            self.replies.push(Out {
                reply,
                _permits: permits.produced(),
            });
        }
        on_pool(sh, s, &self.tx, again);
        if self.own && !self.replies.is_empty() {
            // Sent from here: handing them to the writer task cost a task
            // wake-up per completion batch.
            let mut w = self.out.wr.lock().await;
            let sink = self.out.sink.as_ref();
            let (counters, replies) = (&self.out.counters, &mut self.replies);
            let sent = within(sh.cfg.idle_timeout, async {
                for o in replies.drain(..) {
                    put_reply(sh, &mut w, sink, counters, o.reply).await?;
                }
                w.flush().await
            })
            .await;
            drop(w);
            if let Err(e) = sent {
                debug!("sending AIO replies: {e}");
                self.own = false;
            }
        }
        for o in self.replies.drain(..) {
            let _ = self.tx.send(Box::new(o));
        }
    }
}
