//! What the server counts, how it keeps its logs short under attack, and
//! how it keeps connections that never finish the handshake from locking
//! everyone out: [`Stats`] (totals for SIGUSR1), [`RateLimit`] (one line
//! per second with a count, however many events) and [`Handshakes`].

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, OwnedSemaphorePermit};
use tokio::time::Instant;

use crate::proto::{error_name, Command};

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

/// NBD errors counted one by one (spec: Error values); the last slot holds
/// any other value.
const ERRORS: [u32; 9] = [1, 5, 12, 22, 28, 75, 95, 108, 0];

#[derive(Default)]
struct PerCommand {
    requests: AtomicU64,
    bytes: AtomicU64,
}

/// The server's totals since it started.
#[derive(Default)]
pub(super) struct Stats {
    accepted: AtomicU64,
    refused: AtomicU64,
    evicted: AtomicU64,
    handshakes: AtomicU64,
    active: AtomicU64,
    commands: [PerCommand; COUNTED.len() + 1],
    errors: [AtomicU64; ERRORS.len()],
}

impl Stats {
    pub(super) fn accepted(&self) {
        self.accepted.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn evicted(&self) {
        self.evicted.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection entered transmission.
    pub(super) fn opened(&self) {
        self.handshakes.fetch_add(1, Ordering::Relaxed);
        self.active.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection in transmission ended; true if it was the last one.
    pub(super) fn closed(&self) -> bool {
        self.active.fetch_sub(1, Ordering::Relaxed) == 1
    }

    /// A request read off the wire; `bytes` is its length (data moved, or
    /// the range a zero, trim, cache or status covers).
    pub(super) fn request(&self, c: Command, bytes: u64) {
        let i = COUNTED
            .iter()
            .position(|&k| k == c)
            .unwrap_or(COUNTED.len());
        self.commands[i].requests.fetch_add(1, Ordering::Relaxed);
        self.commands[i].bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// An error reply sent with NBD error `err`.
    pub(super) fn error(&self, err: u32) {
        let i = ERRORS
            .iter()
            .position(|&e| e == err)
            .unwrap_or(ERRORS.len() - 1);
        self.errors[i].fetch_add(1, Ordering::Relaxed);
    }

    /// One line: connections, then requests and bytes per command, then
    /// errors by NBD error.
    pub(super) fn report(&self) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut s = format!(
            "connections: {} accepted, {} refused, {} dropped in the handshake, {} negotiated, \
             {} open; requests:",
            get(&self.accepted),
            get(&self.refused),
            get(&self.evicted),
            get(&self.handshakes),
            get(&self.active),
        );
        let names = COUNTED.iter().map(|c| c.verb()).chain(["other"]);
        for (name, pc) in names.zip(&self.commands) {
            let n = get(&pc.requests);
            if n > 0 {
                let _ = write!(s, " {name} {n} ({} bytes),", get(&pc.bytes));
            }
        }
        if s.ends_with(',') {
            s.pop();
        } else {
            s.push_str(" none");
        }
        s.push_str("; errors:");
        let mut any = false;
        for (&e, n) in ERRORS.iter().zip(&self.errors) {
            let n = get(n);
            if n > 0 {
                let name = if e == 0 { "other" } else { error_name(e) };
                let _ = write!(s, " {name} {n},");
                any = true;
            }
        }
        if any {
            s.pop();
        } else {
            s.push_str(" none");
        }
        s
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
    /// cap; None if the connection was evicted meanwhile.
    pub(super) fn finish(self) -> Option<OwnedSemaphorePermit> {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let i = q.iter().position(|(id, ..)| *id == self.id)?;
        q.remove(i).map(|(_, _, place)| place)
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
        assert!(a.finish().is_none(), "an evicted connection keeps no place");
        // A finished handshake keeps its place and evicts no one.
        let kept = b.finish().expect("place kept");
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
    fn report_names_commands_and_errors() {
        let s = Stats::default();
        assert!(s.report().ends_with("requests: none; errors: none"));
        s.accepted();
        s.opened();
        s.request(Command::Read, 4096);
        s.request(Command::Read, 512);
        s.request(Command::Unknown(99), 0);
        s.error(28);
        s.error(4242);
        let r = s.report();
        assert!(r.contains("1 accepted"), "{r}");
        assert!(r.contains("read 2 (4608 bytes)"), "{r}");
        assert!(r.contains("other 1 (0 bytes)"), "{r}");
        assert!(r.contains("NBD_ENOSPC 1"), "{r}");
        assert!(r.contains("other 1"), "{r}");
    }
}
