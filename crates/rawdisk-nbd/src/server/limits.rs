//! What the server counts, how it keeps its logs short under attack, and
//! how it keeps connections that never finish the handshake from locking
//! everyone out: [`Stats`] (per-connection [`Counters`] and the totals
//! for SIGUSR1 and `--stats`), [`RateLimit`] (one line
//! per second with a count, however many events) and [`Handshakes`].

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, OwnedSemaphorePermit};
use tokio::time::Instant;

use crate::proto::{error_name, Command, ERROR_VALUES};

/// Commands counted one by one; anything else is counted as "other".
const COUNTED: [Command; 8] = [
    Command::Read,
    Command::Write,
    Command::Flush,
    Command::Trim,
    Command::Cache,
    Command::WriteZeroes,
    Command::BlockStatus,
    Command::Disc,
];

/// NBD errors counted one by one: the codec's list of the spec's error
/// values, then one slot, reported as 0, for any other value.
const ERRORS: [u32; ERROR_VALUES.len() + 1] = {
    let mut v = [0; ERROR_VALUES.len() + 1];
    let mut i = 0;
    while i < ERROR_VALUES.len() {
        v[i] = ERROR_VALUES[i];
        i += 1;
    }
    v
};

/// One connection's counts, kept by its own tasks (the reader counts
/// requests, whoever writes a reply its error), so requests touch nothing
/// another connection touches; summed into the server's totals when the
/// connection ends, and read live by [`Stats::totals`].
#[derive(Default)]
pub(super) struct Counters {
    requests: [AtomicU64; COUNTED.len() + 1],
    bytes: [AtomicU64; COUNTED.len() + 1],
    errors: [AtomicU64; ERRORS.len()],
    peak: AtomicU64,
    aio: AtomicU64,
    /// Replies written (into the buffer flushed right after them, or spliced).
    answered: AtomicU64,
}

impl Counters {
    /// A request read off the wire; `bytes` is its length (data moved, or
    /// the range a zero, trim, cache or status covers).
    pub(super) fn request(&self, c: Command, bytes: u64) {
        let i = COUNTED
            .iter()
            .position(|&k| k == c)
            .unwrap_or(COUNTED.len());
        self.requests[i].fetch_add(1, Ordering::Relaxed);
        self.bytes[i].fetch_add(bytes, Ordering::Relaxed);
    }

    /// An error reply sent with NBD error `err`.
    pub(super) fn error(&self, err: u32) {
        let i = ERRORS
            .iter()
            .position(|&e| e == err)
            .unwrap_or(ERRORS.len() - 1);
        self.errors[i].fetch_add(1, Ordering::Relaxed);
    }

    /// A request's whole reply was written to the connection.
    pub(super) fn answered(&self) {
        self.answered.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests read and not answered yet. NBD_CMD_DISC gets no reply
    /// (spec: Request message). A snapshot: exact once the connection is
    /// quiet, which is when it is asked for (a client waiting on a reply).
    pub(super) fn unanswered(&self) -> u64 {
        let answered = self.answered.load(Ordering::Relaxed);
        let disc = COUNTED.iter().position(|&k| k == Command::Disc);
        let read: u64 = self
            .requests
            .iter()
            .enumerate()
            .filter(|&(i, _)| Some(i) != disc)
            .map(|(_, n)| n.load(Ordering::Relaxed))
            .sum();
        read.saturating_sub(answered)
    }

    /// `n` requests are in flight (only the reader calls this).
    pub(super) fn in_flight(&self, n: u64) {
        if n > self.peak.load(Ordering::Relaxed) {
            self.peak.store(n, Ordering::Relaxed);
        }
    }

    /// A request answered from its in-kernel AIO completion (cache=none),
    /// not by a pool thread: shows that path is taken, since anything AIO
    /// refuses is served the blocking way with the same replies.
    pub(super) fn aio_completed(&self) {
        self.aio.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn snapshot(&self) -> Tally {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Tally {
            requests: self.requests.each_ref().map(get),
            bytes: self.bytes.each_ref().map(get),
            errors: self.errors.each_ref().map(get),
            peak_in_flight: get(&self.peak),
            aio_completed: get(&self.aio),
        }
    }
}

/// Requests and bytes per command, error replies per NBD error and the
/// most requests in flight at once: of one connection, or of all of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    requests: [u64; COUNTED.len() + 1],
    bytes: [u64; COUNTED.len() + 1],
    errors: [u64; ERRORS.len()],
    /// On one connection (the largest over connections in totals).
    pub peak_in_flight: u64,
    /// Requests answered from an in-kernel AIO completion.
    pub aio_completed: u64,
}

impl Tally {
    /// (command, requests, bytes) for every command counted, zeros
    /// included; None last: anything else.
    pub fn commands(&self) -> impl Iterator<Item = (Option<Command>, u64, u64)> + '_ {
        let names = COUNTED.iter().map(|&c| Some(c)).chain([None]);
        names
            .zip(self.requests)
            .zip(self.bytes)
            .map(|((c, n), b)| (c, n, b))
    }

    /// (NBD error, replies) for every error counted, zeros included; the
    /// last, 0, counts any other value.
    pub fn errors(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        ERRORS.iter().copied().zip(self.errors)
    }

    fn add(&mut self, o: &Tally) {
        let sum = |a: &mut [u64], b: &[u64]| a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        sum(&mut self.requests, &o.requests);
        sum(&mut self.bytes, &o.bytes);
        sum(&mut self.errors, &o.errors);
        self.peak_in_flight = self.peak_in_flight.max(o.peak_in_flight);
        self.aio_completed += o.aio_completed;
    }
}

/// "requests: read 4 (200704 bytes), write 1 (4096 bytes); errors: NBD_EIO
/// 1; peak 3 in flight; 4 through AIO", naming only what happened.
impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = String::from("requests:");
        for (c, n, b) in self.commands().filter(|&(_, n, _)| n > 0) {
            let name = c.map_or("other", Command::verb);
            let _ = write!(s, " {name} {n} ({b} bytes),");
        }
        if s.ends_with(',') {
            s.pop();
        } else {
            s.push_str(" none");
        }
        s.push_str("; errors:");
        let mut any = false;
        for (e, n) in self.errors().filter(|&(_, n)| n > 0) {
            let name = if e == 0 { "other" } else { error_name(e) };
            let _ = write!(s, " {name} {n},");
            any = true;
        }
        if any {
            s.pop();
        } else {
            s.push_str(" none");
        }
        write!(f, "{s}; peak {} in flight", self.peak_in_flight)?;
        if self.aio_completed > 0 {
            write!(f, "; {} through AIO", self.aio_completed)?;
        }
        Ok(())
    }
}

/// The server's totals since it started (SIGUSR1, `--stats`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Totals {
    /// Since the server was made.
    pub uptime: Duration,
    /// Connections accepted (under the cap).
    pub accepted: u64,
    /// Connections refused at accept: the connection cap was reached.
    pub refused_at_cap: u64,
    /// Connections closed in the handshake to admit a newer one.
    pub closed_in_handshake: u64,
    /// Options refused because they named an export the server lacks.
    pub unknown_export: u64,
    /// Options refused because TLS is required and was not started.
    pub tls_required: u64,
    /// Connections that reached the transmission phase.
    pub negotiated: u64,
    /// Connections in the transmission phase now.
    pub open: u64,
    /// (connection id, requests read and not answered yet), for each open
    /// connection that has any: a client waiting on a reply shows whether
    /// the server still owes it.
    pub unanswered: Vec<(u64, u64)>,
    /// Over every connection, those still open included.
    pub tally: Tally,
}

/// One line, the SIGUSR1 report.
impl std::fmt::Display for Totals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "up {:.3} s; connections: {} accepted, {} refused at the cap, {} dropped in the \
             handshake, {} refused for an unknown export, {} refused without TLS, {} \
             negotiated, {} open; {}",
            self.uptime.as_secs_f64(),
            self.accepted,
            self.refused_at_cap,
            self.closed_in_handshake,
            self.unknown_export,
            self.tls_required,
            self.negotiated,
            self.open,
            self.tally
        )?;
        if self.unanswered.is_empty() {
            return write!(f, "; unanswered now: none");
        }
        write!(f, "; unanswered now:")?;
        for (i, (id, n)) in self.unanswered.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(f, "{sep} {n} on connection {id}")?;
        }
        Ok(())
    }
}

/// The server's counts: connection events, and the counters of each
/// connection in transmission beside the sum of those that ended.
pub(super) struct Stats {
    started: std::time::Instant,
    accepted: AtomicU64,
    refused: AtomicU64,
    evicted: AtomicU64,
    unknown_export: AtomicU64,
    tls_required: AtomicU64,
    handshakes: AtomicU64,
    conns: Mutex<Conns>,
}

#[derive(Default)]
struct Conns {
    open: Vec<(u64, Arc<Counters>)>,
    ended: Tally,
}

impl Stats {
    pub(super) fn new() -> Stats {
        Stats {
            started: std::time::Instant::now(),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            unknown_export: AtomicU64::new(0),
            tls_required: AtomicU64::new(0),
            handshakes: AtomicU64::new(0),
            conns: Mutex::new(Conns::default()),
        }
    }

    pub(super) fn accepted(&self) {
        self.accepted.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn evicted(&self) {
        self.evicted.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn unknown_export(&self) {
        self.unknown_export.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn tls_required(&self) {
        self.tls_required.fetch_add(1, Ordering::Relaxed);
    }

    /// Connection `id` entered transmission: its counters.
    pub(super) fn opened(&self, id: u64) -> Arc<Counters> {
        self.handshakes.fetch_add(1, Ordering::Relaxed);
        let c = Arc::new(Counters::default());
        self.lock().open.push((id, c.clone()));
        c
    }

    /// Connection `id` in transmission ended: its counts go into the
    /// totals. True if it was the last one open.
    pub(super) fn closed(&self, id: u64) -> bool {
        let mut g = self.lock();
        if let Some(i) = g.open.iter().position(|(k, _)| *k == id) {
            let (_, c) = g.open.swap_remove(i);
            g.ended.add(&c.snapshot());
        }
        g.open.is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn totals(&self) -> Totals {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (tally, open, unanswered) = {
            let g = self.lock();
            let mut t = g.ended.clone();
            let mut owed = Vec::new();
            for (id, c) in &g.open {
                t.add(&c.snapshot());
                let n = c.unanswered();
                if n > 0 {
                    owed.push((*id, n));
                }
            }
            owed.sort_unstable();
            (t, g.open.len() as u64, owed)
        };
        Totals {
            uptime: self.started.elapsed(),
            accepted: get(&self.accepted),
            refused_at_cap: get(&self.refused),
            closed_in_handshake: get(&self.evicted),
            unknown_export: get(&self.unknown_export),
            tls_required: get(&self.tls_required),
            negotiated: get(&self.handshakes),
            open,
            unanswered,
            tally,
        }
    }
}

/// How long one logged event holds back the lines of the next ones.
const LOG_WINDOW: Duration = Duration::from_secs(1);

/// Lets an event be logged at most once per second: the first one of a
/// second is logged, the others are counted, and when the second ends a
/// timer logs how many there were (through `summary`), so a burst followed
/// by silence still says how big it was.
pub(super) struct RateLimit {
    window: Arc<Mutex<Window>>,
    summary: Arc<dyn Fn(u64) + Send + Sync>,
}

#[derive(Default)]
struct Window {
    /// When the current second began; None: no event for a second or more.
    start: Option<Instant>,
    /// Events held back in it.
    held: u64,
    /// A timer will report `held` when the second ends.
    timer: bool,
}

impl RateLimit {
    /// `summary(n)` logs "n more such events in the last second".
    pub(super) fn new(summary: impl Fn(u64) + Send + Sync + 'static) -> RateLimit {
        RateLimit {
            window: Arc::new(Mutex::new(Window::default())),
            summary: Arc::new(summary),
        }
    }

    /// True: log this event now. False: stay quiet; it is counted and
    /// reported when its second ends.
    pub(super) fn allow(&self) -> bool {
        let now = Instant::now();
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        match w.start {
            Some(t) if now.duration_since(t) < LOG_WINDOW => {
                w.held += 1;
                if !w.timer {
                    w.timer = self.arm(t + LOG_WINDOW);
                }
                false
            }
            _ => {
                // Only without a runtime for the timer (unit tests): the
                // count comes out with the next event instead.
                let held = std::mem::take(&mut w.held);
                w.start = Some(now);
                drop(w);
                if held > 0 {
                    (self.summary)(held);
                }
                true
            }
        }
    }

    /// Reports what is held back now: at exit, where the timer would not
    /// get to run.
    pub(super) fn report_held(&self) {
        let held = {
            let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
            std::mem::take(&mut w.held)
        };
        if held > 0 {
            (self.summary)(held);
        }
    }

    /// Starts the timer that reports the held-back count at `end`; false
    /// when there is no runtime to run it on.
    fn arm(&self, end: Instant) -> bool {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let (window, summary) = (self.window.clone(), self.summary.clone());
        rt.spawn(async move {
            tokio::time::sleep_until(end).await;
            let held = {
                let mut w = window.lock().unwrap_or_else(|p| p.into_inner());
                w.timer = false;
                let held = std::mem::take(&mut w.held);
                // Reported: the next second starts now, so a flood goes on
                // getting one line per second, not one event line and one
                // count line.
                w.start = Some(Instant::now());
                held
            };
            summary(held);
        });
        true
    }
}

/// The connections still in the handshake, oldest first, at most `cap`
/// (a share of the connection cap). A new connection that finds them all
/// taken takes the place of the oldest, which is closed: clients that never
/// finish the handshake cannot keep out the ones that do, which take
/// milliseconds, nor hold more than the share.
pub(super) struct Handshakes {
    cap: usize,
    queue: Waiting,
}

/// Connection ids in the handshake, oldest first, each with the sender
/// whose drop tells it to close and its place under the connection cap.
/// Evicting drops both at once: the place is free before the next accept,
/// not only once the evicted task gets to run (under a flood it may not).
type Waiting = Arc<Mutex<VecDeque<(u64, oneshot::Sender<()>, OwnedSemaphorePermit)>>>;

/// A place among the connections in the handshake; given up when dropped.
pub(super) struct HandshakeSlot {
    id: u64,
    queue: Waiting,
    /// The place under the cap, once out of the queue, and the sender
    /// whose drop would tell the connection it was evicted.
    place: Option<OwnedSemaphorePermit>,
    kept: Option<oneshot::Sender<()>>,
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = q.iter().position(|(id, ..)| *id == self.id) {
            q.remove(i);
        }
    }
}

impl HandshakeSlot {
    /// The handshake is over: leave the queue, keeping the place under the
    /// cap; false if the connection was evicted meanwhile.
    pub(super) fn finish(&mut self) -> bool {
        if self.place.is_none() {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            let Some(i) = q.iter().position(|(id, ..)| *id == self.id) else {
                return false;
            };
            let (_, kept, place) = q.remove(i).expect("position is in the queue");
            (self.place, self.kept) = (Some(place), Some(kept));
        }
        true
    }

    /// The place under the cap, kept for the transmission phase; None if
    /// the connection was evicted before `finish`.
    pub(super) fn place(&mut self) -> Option<OwnedSemaphorePermit> {
        self.finish();
        self.place.take()
    }
}

impl Handshakes {
    pub(super) fn new(cap: usize) -> Handshakes {
        Handshakes {
            cap: cap.max(1),
            queue: Arc::new(Mutex::new(VecDeque::new())),
        }
    }

    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    /// A place for connection `id`, and what resolves if it is taken away;
    /// true if the oldest connection had to give its place up.
    pub(super) fn enter(
        &self,
        id: u64,
        place: OwnedSemaphorePermit,
    ) -> (HandshakeSlot, oneshot::Receiver<()>, bool) {
        let (tx, rx) = oneshot::channel();
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        // Dropping its sender wakes the evicted connection.
        let evicted = q.len() >= self.cap && q.pop_front().is_some();
        q.push_back((id, tx, place));
        let slot = HandshakeSlot {
            id,
            queue: self.queue.clone(),
            place: None,
            kept: None,
        };
        (slot, rx, evicted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A limiter whose summaries land in the returned list.
    fn counting() -> (RateLimit, Arc<Mutex<Vec<u64>>>) {
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        (RateLimit::new(move |n| g.lock().unwrap().push(n)), got)
    }

    #[tokio::test(start_paused = true)]
    async fn rate_limit_reports_the_count_when_its_second_ends() {
        let (r, got) = counting();
        assert!(r.allow());
        for _ in 0..5 {
            assert!(!r.allow());
        }
        // A burst, then silence: the count comes out at the second's end,
        // with no further event to carry it.
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert!(got.lock().unwrap().is_empty());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(*got.lock().unwrap(), [5]);
        // A reported second starts the next one: a flood gets one line a
        // second.
        assert!(!r.allow());
        assert!(!r.allow());
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(*got.lock().unwrap(), [5, 2]);
        // Quiet for a second: the next event is logged itself.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(r.allow());
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(*got.lock().unwrap(), [5, 2]);
    }

    #[test]
    fn rate_limit_without_a_runtime_reports_with_the_next_event() {
        let (r, got) = counting();
        assert!(r.allow());
        for _ in 0..5 {
            assert!(!r.allow());
        }
        r.window.lock().unwrap().start = Some(Instant::now() - Duration::from_secs(2));
        assert!(r.allow());
        assert_eq!(*got.lock().unwrap(), [5]);
        assert!(!r.allow());
    }

    #[test]
    fn handshakes_beyond_the_share_evict_the_oldest() {
        let cap = Arc::new(tokio::sync::Semaphore::new(3));
        let place = || cap.clone().try_acquire_owned().unwrap();
        let h = Handshakes::new(2);
        let (a, mut ra, e) = h.enter(1, place());
        assert!(!e);
        let (b, mut rb, e) = h.enter(2, place());
        assert!(!e);
        let (_c, mut rc, e) = h.enter(3, place());
        assert!(e);
        assert!(matches!(
            ra.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
        assert!(matches!(
            rb.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        ));
        // The evicted connection's place is free at once, before its task
        // has run (`a` is still alive here).
        assert_eq!(cap.available_permits(), 1);
        let (mut a, mut b) = (a, b);
        assert!(!a.finish(), "an evicted connection keeps no place");
        assert!(a.place().is_none());
        // A finished handshake keeps its place and evicts no one.
        assert!(b.finish());
        let kept = b.place().expect("place kept");
        assert_eq!(cap.available_permits(), 1);
        let (_d, _rd, e) = h.enter(4, place());
        assert!(!e);
        assert!(matches!(
            rc.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        ));
        drop(kept);
        assert_eq!(cap.available_permits(), 1);
    }

    #[test]
    fn totals_sum_open_and_ended_connections() {
        let s = Stats::new();
        let r = s.totals().to_string();
        assert!(
            r.ends_with("requests: none; errors: none; peak 0 in flight; unanswered now: none"),
            "{r}"
        );
        s.accepted();
        s.accepted();
        let a = s.opened(1);
        let b = s.opened(2);
        a.request(Command::Read, 4096);
        a.request(Command::Read, 512);
        a.in_flight(3);
        a.in_flight(2);
        b.request(Command::Unknown(99), 0);
        b.in_flight(1);
        b.error(28);
        b.error(4242);
        assert_eq!(
            a.snapshot().to_string(),
            "requests: read 2 (4608 bytes); errors: none; peak 3 in flight"
        );
        assert!(!s.closed(1));
        let t = s.totals();
        assert_eq!((t.accepted, t.negotiated, t.open), (2, 2, 1));
        let r = t.to_string();
        assert!(r.contains("2 accepted"), "{r}");
        assert!(
            r.ends_with(
                "requests: read 2 (4608 bytes), other 1 (0 bytes); errors: NBD_ENOSPC 1, \
                 other 1; peak 3 in flight; unanswered now: 1 on connection 2"
            ),
            "{r}"
        );
        // Connection 1 is closed: its reads are no longer anyone's to answer.
        b.answered();
        assert_eq!(s.totals().unanswered, vec![]);
        // Counted once, whether open or ended.
        assert!(s.closed(2));
        assert_eq!(s.totals().tally, t.tally);
        let reads = t.tally.commands().next().unwrap();
        assert_eq!(reads, (Some(Command::Read), 2, 4608));
        assert_eq!(t.tally.errors().count(), ERRORS.len());
    }

    #[test]
    fn aio_completions_are_summed_and_named_only_when_any() {
        let s = Stats::new();
        let a = s.opened(1);
        let b = s.opened(2);
        a.request(Command::Read, 4096);
        a.aio_completed();
        b.aio_completed();
        b.aio_completed();
        assert_eq!(
            a.snapshot().to_string(),
            "requests: read 1 (4096 bytes); errors: none; peak 0 in flight; 1 through AIO"
        );
        assert!(!s.closed(1));
        assert_eq!(s.totals().tally.aio_completed, 3);
        assert!(s.closed(2));
        assert_eq!(s.totals().tally.aio_completed, 3);
    }
}
