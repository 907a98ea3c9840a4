//! Surviving a dropped NBD connection (`--retry-timeout`): a side whose
//! connection breaks (the server closed it, reset it, the pipe broke) is
//! reopened from the same URI, with the same options, by the first worker
//! that notices; the others wait for it. The new export must be the same
//! size (and still writable, for the destination: `Endpoint::open_with`
//! refuses a read-only one), else the copy stops with that error. Every
//! request that failed with the connection is issued again by its worker on
//! the new one: reads, writes, zeroes and flushes are idempotent, so a
//! request that had reached the disk before the server died does no harm.
//! The final flush goes through the same path, so it is sent again after a
//! reconnect and covers the writes of the lost connection (a server killed
//! with SIGKILL leaves its writes in the page cache, which the flush writes
//! out).
//!
//! Attempts back off from 100 ms to 2 s; the timeout counts from the first
//! failure, and when it passes the error says what broke and that the
//! server did not come back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

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
    reconnecting: Mutex<()>,
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
            reconnecting: Mutex::new(()),
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
                        return Err(gave_up(self.first, &e, r.timeout, "still failing"));
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
        let _g = r.reconnecting.lock().unwrap_or_else(|p| p.into_inner());
        if r.generation.load(Ordering::Acquire) != seen {
            return Ok(()); // another worker already did
        }
        let name = self.first.name();
        tracing::warn!(
            "{} {}; reconnecting (for up to {:?})",
            r.side,
            cause,
            r.timeout
        );
        let mut pause = Duration::from_millis(100);
        loop {
            std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
            let last = match Endpoint::open_with(&name, &r.opts) {
                Ok(ep) if ep.size() != self.first.size() => {
                    return Err(endpoint::Error {
                        endpoint: name,
                        errno: None,
                        message: format!(
                            "the export came back with {} bytes instead of {}",
                            ep.size(),
                            self.first.size()
                        ),
                    });
                }
                Ok(ep) => {
                    *r.cur.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(ep));
                    r.generation.fetch_add(1, Ordering::AcqRel);
                    tracing::warn!("{} {name}: reconnected", r.side);
                    return Ok(());
                }
                // The server is back but refuses what the copy needs (a
                // read-only export for the destination): not worth waiting.
                Err(e) if e.errno.is_some() => return Err(e),
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                let last = format!("the server did not come back ({})", last.message);
                return Err(gave_up(self.first, cause, r.timeout, &last));
            }
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }
}

/// The error after `timeout` of reconnecting.
fn gave_up(
    ep: &Endpoint,
    cause: &endpoint::Error,
    timeout: Duration,
    why: &str,
) -> endpoint::Error {
    endpoint::Error {
        endpoint: ep.name(),
        errno: cause.errno,
        message: format!(
            "{}; gave up reconnecting after {timeout:?}: {why}",
            cause.message
        ),
    }
}

/// The connection broke under the request (`Endpoint` maps the client's
/// connection errors to ECONNRESET; NBD servers never send that errno).
fn is_disconnect(e: &endpoint::Error) -> bool {
    e.errno == Some(libc::ECONNRESET)
}
