//! Surviving a dropped NBD connection (`--retry-timeout`): a side whose
//! connection breaks (the server closed it, reset it, the pipe broke,
//! answered NBD_ESHUTDOWN because it is restarting, or left requests
//! unanswered for `--request-timeout`, which the client reports as a
//! broken connection) is reopened from the same URI, with the same options, by the first worker
//! that notices; the others wait for it. The new export must be the same
//! size (and still writable, for the destination: `Endpoint::open_with`
//! refuses a read-only one), else the copy stops with that error. Every
//! request that failed with the connection is issued again by its worker on
//! the new one: reads, writes, zeroes and flushes are idempotent, so a
//! request that had reached the disk before the server died does no harm.
//! The final flush goes through the same path, so it is sent again after a
//! reconnect. It covers the lost connection's writes only where the server
//! had handed them to the kernel; one that held them in its own memory lost
//! them, so the copy runs a pass with a destination reconnect again whole
//! (`run` in copy/mod.rs).
//!
//! Attempts back off from 100 ms to 2 s, each bounded by the time left (a
//! stopped server accepts connections but never answers them); the timeout
//! counts from the first failure, and when it passes the error says what
//! broke and that the server did not come back. Only what waiting can mend
//! is tried again: nothing listening yet, a drop, a refusal as busy
//! ([`rawdisk_nbd::client::Error::is_busy`]); a wrong export name, TLS
//! required or failed, a protocol violation end the copy at once. The
//! progress bar shows the attempt while it lasts. The first connect is
//! retried only when the server dropped it mid-handshake ([`open`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rawdisk_nbd::client;

use super::Side;
use crate::endpoint::{self, Endpoint, EndpointOptions};

/// One side of a copy, reconnected when it is an NBD export whose
/// connection drops and a retry timeout is set.
pub(super) struct Link<'a> {
    /// The endpoint the copy was given; its size and limits hold for every
    /// reconnection (checked).
    pub(super) first: &'a Endpoint,
    retry: Option<Retry>,
}

struct Retry {
    side: Side,
    opts: EndpointOptions,
    timeout: Duration,
    /// The endpoint in use after a reconnect (None: still `first`).
    cur: RwLock<Option<Arc<Endpoint>>>,
    /// Bumped by each reconnect, so a worker that saw the old connection
    /// fail does not reconnect again after another worker did.
    generation: AtomicU64,
    /// Held while reconnecting; holds the error once reconnecting gave up,
    /// so the workers that waited do not start over with their own clock.
    reconnecting: Mutex<Option<endpoint::Error>>,
    /// The progress bar, which shows a reconnect while it lasts.
    bar: Option<indicatif::ProgressBar>,
}

impl<'a> Link<'a> {
    /// `timeout` zero: errors end the copy as they always did.
    pub(super) fn new(
        ep: &'a Endpoint,
        side: Side,
        opts: EndpointOptions,
        timeout: Duration,
    ) -> Link<'a> {
        let retry = (ep.is_nbd() && !timeout.is_zero()).then(|| Retry {
            side,
            opts,
            timeout,
            cur: RwLock::new(None),
            generation: AtomicU64::new(0),
            reconnecting: Mutex::new(None),
            bar: None,
        });
        Link { first: ep, retry }
    }

    /// Ends the connection made by a reconnect (the caller closes `first`).
    pub(super) fn close_reconnected(&self) -> endpoint::Result<()> {
        let cur = self
            .retry
            .as_ref()
            .and_then(|r| r.cur.read().unwrap_or_else(|p| p.into_inner()).clone());
        cur.map_or(Ok(()), |e| e.close())
    }

    /// Reconnections made so far.
    pub(super) fn reconnects(&self) -> u64 {
        self.retry
            .as_ref()
            .map_or(0, |r| r.generation.load(Ordering::Relaxed))
    }

    /// Runs `f` on the current endpoint; when the connection broke, waits
    /// for a new one and runs it again.
    pub(super) fn with<T>(
        &self,
        mut f: impl FnMut(&Endpoint) -> endpoint::Result<T>,
    ) -> endpoint::Result<T> {
        let Some(r) = &self.retry else {
            return f(self.first);
        };
        let mut deadline = None;
        loop {
            let generation = r.generation.load(Ordering::Acquire);
            let cur = r.cur.read().unwrap_or_else(|p| p.into_inner()).clone();
            let ep = cur.as_deref().unwrap_or(self.first);
            match f(ep) {
                Err(e) if is_disconnect(&e) => {
                    let d = *deadline.get_or_insert_with(|| Instant::now() + r.timeout);
                    if Instant::now() >= d {
                        // Reconnected, but the request keeps failing.
                        let name = self.first.name();
                        return Err(gave_up(&name, &e, r.timeout, "still failing"));
                    }
                    self.reconnect(r, generation, d, &e)?;
                }
                res => return res,
            }
        }
    }

    fn reconnect(
        &self,
        r: &Retry,
        seen: u64,
        deadline: Instant,
        cause: &endpoint::Error,
    ) -> endpoint::Result<()> {
        let mut failed = r.reconnecting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = &*failed {
            return Err(e.clone());
        }
        if r.generation.load(Ordering::Acquire) != seen {
            return Ok(()); // another worker already did
        }
        let first = self.first;
        let ep = reopen(
            &first.name(),
            &r.opts,
            r.side,
            r.timeout,
            deadline,
            cause,
            r.bar.as_ref(),
        );
        let ep = ep.inspect_err(|e| *failed = Some(e.clone()))?;
        if ep.size() != first.size() {
            let e = endpoint::Error {
                endpoint: first.name(),
                errno: None,
                message: format!(
                    "the export came back with {} bytes instead of {}",
                    ep.size(),
                    first.size()
                ),
                nbd: None,
            };
            *failed = Some(e.clone());
            return Err(e);
        }
        *r.cur.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(ep));
        r.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Shows the retry state on `bar` (and keeps log lines off it).
    pub(super) fn set_bar(&mut self, bar: Option<&indicatif::ProgressBar>) {
        if let Some(r) = &mut self.retry {
            r.bar = bar.cloned();
        }
    }
}

/// Runs `f` (a log line) above the progress bar, not through it.
fn say(bar: Option<&indicatif::ProgressBar>, f: impl FnOnce()) {
    match bar {
        Some(b) => b.suspend(f),
        None => f(),
    }
}

/// Opens `spec` again after `cause` broke the connection: attempts back off
/// from 100 ms to 2 s until `deadline`, each bounded by the time left. A
/// server that is back but refuses what the copy needs (a read-only export
/// for the destination) ends it at once.
fn reopen(
    name: &str,
    opts: &EndpointOptions,
    side: Side,
    timeout: Duration,
    deadline: Instant,
    cause: &endpoint::Error,
    bar: Option<&indicatif::ProgressBar>,
) -> endpoint::Result<Endpoint> {
    say(bar, || {
        tracing::warn!("{side} {cause}; reconnecting (for up to {timeout:?})")
    });
    let status = |msg: String| {
        if let Some(b) = bar {
            b.set_message(msg);
        }
    };
    let mut pause = Duration::from_millis(100);
    for attempt in 1.. {
        std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
        status(format!("{side} reconnecting (attempt {attempt})…"));
        // A server that accepts but does not answer (stopped) must not
        // hold an attempt past the deadline.
        let left = deadline.saturating_duration_since(Instant::now());
        let mut o = opts.clone();
        o.connect_timeout = Some(
            o.connect_timeout
                .map_or(left, |t| t.min(left))
                .max(Duration::from_millis(100)),
        );
        let last = match Endpoint::open_with(name, &o) {
            Ok(ep) => {
                status(String::new());
                say(bar, || {
                    tracing::warn!("{side} {name}: reconnected (attempt {attempt})")
                });
                return Ok(ep);
            }
            Err(e) if !may_mend(&e) => {
                status(String::new());
                return Err(e);
            }
            Err(e) => e,
        };
        tracing::debug!("{side} reconnect attempt {attempt}: {last}");
        if Instant::now() >= deadline {
            status(String::new());
            let why = format!("the server did not come back ({})", last.message);
            return Err(gave_up(name, cause, timeout, &why));
        }
        pause = (pause * 2).min(Duration::from_secs(2));
    }
    unreachable!("the attempts never end")
}

/// Opens one side of a copy. An NBD server that closed or reset the
/// connection during the first handshake (killed, restarting) is tried
/// again as a later drop would be, for up to `timeout`; every other failure
/// of the first connect is final at once: nothing listening (no such
/// socket, connection refused, unknown host), the server refusing the
/// export or the TLS credentials, a timeout (so a typo never waits).
pub(super) fn open(
    spec: &str,
    opts: &EndpointOptions,
    side: Side,
    timeout: Duration,
) -> endpoint::Result<Endpoint> {
    match Endpoint::open_with(spec, opts) {
        Err(e) if endpoint::is_nbd(spec) && !timeout.is_zero() && is_disconnect(&e) => {
            let deadline = Instant::now() + timeout;
            reopen(spec, opts, side, timeout, deadline, &e, None)
        }
        r => r,
    }
}

/// The error after `timeout` of reconnecting.
fn gave_up(name: &str, cause: &endpoint::Error, timeout: Duration, why: &str) -> endpoint::Error {
    endpoint::Error {
        endpoint: name.to_string(),
        errno: cause.errno,
        message: format!(
            "{}; gave up reconnecting after {timeout:?}: {why}",
            cause.message
        ),
        nbd: None,
    }
}

/// The connection broke, under a request or in the handshake, or the
/// server answered that it is shutting down (a graceful restart: the
/// request was not run, and the connection closes next).
fn is_disconnect(e: &endpoint::Error) -> bool {
    e.nbd
        .as_ref()
        .is_some_and(|c| c.is_dropped() || c.is_shutdown())
}

/// A failed reconnect that waiting can mend: the server is not back yet
/// (nothing listening, a timeout), dropped the connection again, or turned
/// it away as busy.
fn may_mend(e: &endpoint::Error) -> bool {
    e.nbd.as_ref().is_some_and(|c| {
        c.is_dropped() || c.is_busy() || matches!(**c, client::Error::Connect { .. })
    })
}
