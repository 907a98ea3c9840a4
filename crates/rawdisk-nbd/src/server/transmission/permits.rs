//! What a request holds from its header until its reply is on the socket:
//! a slot, its bytes in the connection's and the server's budgets, and a
//! read reply's share of the unsent bytes; and the reader's ways of taking
//! them, each waiting (with the held batch handed on) while one is spent.
//!
//! The fairness rule: every connection in transmission has a reserve of its
//! own ([`reserve_per_conn`]) of the server's bytes being received or made,
//! carved out of that budget, so a request that fits it never waits for
//! bytes other connections hold (slow writers holding their payloads).

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{Reader, DATA_ALIGN, NEVER_CLOSED};

/// Read replies a TLS connection may have made and not yet sent. There the
/// cipher, not the read, is the bound: replies made further ahead only
/// wait in memory (four connections of 1 MiB reads held 73 MiB against
/// nbdkit's 67 and qemu-nbd's 30; docs/benchmarks.md, TLS). A reply
/// bigger than this takes all of it. Applies wherever there is no raw
/// socket, as OWN_WRITE_MAX_TLS does.
pub(super) const TLS_UNSENT_CONN: usize = 2 << 20;

/// A connection's reserve admits one request of up to this length (or the
/// maximum payload, if smaller): a normal-sized one.
const RESERVE_LEN: u32 = 1 << 20;

/// The bytes each connection in transmission may hold of the server's
/// budget of bytes being received or made without ever waiting for
/// another connection: one read of RESERVE_LEN (its reply and alignment).
/// The server sets aside this much per connection under its cap.
pub(in crate::server) fn reserve_per_conn(max_payload: u32) -> usize {
    max_payload.min(RESERVE_LEN) as usize + 2 * DATA_ALIGN
}

/// Resources a request holds until its reply is on the socket.
pub(super) struct Permits {
    _slot: OwnedSemaphorePermit,
    _conn_bytes: Option<OwnedSemaphorePermit>,
    /// Bytes of payloads and replies being received or made, from the
    /// connection's reserve or the server's shared budget: given back once
    /// the reply is ready, so peers that do not read their replies cannot
    /// hold them.
    total_bytes: Option<OwnedSemaphorePermit>,
    /// Server-wide bytes of read replies waiting to be sent (None for the
    /// one a connection with nothing else in flight may always have).
    _unsent: Option<OwnedSemaphorePermit>,
    /// A TLS connection's own share of those (TLS_UNSENT_CONN).
    _conn_unsent: Option<OwnedSemaphorePermit>,
}

impl Permits {
    /// The reply is made: what remains held is the connection's own budget
    /// and the reply's share of the server's unsent bytes.
    pub(super) fn produced(mut self) -> Permits {
        drop(self.total_bytes.take());
        self
    }
}

pub(super) fn slot_only(slot: OwnedSemaphorePermit) -> Permits {
    Permits {
        _slot: slot,
        _conn_bytes: None,
        total_bytes: None,
        _unsent: None,
        _conn_unsent: None,
    }
}

impl<R, W> Reader<R, W> {
    /// A request slot; without one, waits for a reply to free one.
    pub(super) async fn take_slot(&mut self) -> OwnedSemaphorePermit {
        self.take(self.slots.clone(), 1).await
    }

    /// `need` bytes from the connection's budget, then (for a read's
    /// `reply`) from the server's budget of unsent replies, then of the
    /// bytes being received or made (`take_made`). Waits while one is
    /// spent; the shared ones are taken last, so nothing shared is held
    /// while this connection waits for its own.
    pub(super) async fn take_bytes(
        &mut self,
        slot: OwnedSemaphorePermit,
        need: usize,
        reply: bool,
    ) -> Permits {
        if need == 0 {
            return slot_only(slot);
        }
        let n = need as u32;
        let conn = self.take(self.conn_bytes.clone(), n).await;
        let conn_unsent = match self.conn_unsent.clone() {
            Some(sem) if reply => Some(self.take(sem, n.min(TLS_UNSENT_CONN as u32)).await),
            _ => None,
        };
        let unsent = if reply {
            self.take_unsent(n).await
        } else {
            None
        };
        let total = self.take_made(n).await;
        Permits {
            _slot: slot,
            _conn_bytes: Some(conn),
            total_bytes: Some(total),
            _unsent: unsent,
            _conn_unsent: conn_unsent,
        }
    }

    /// `n` of `sem`, waiting (with the held batch handed on) while spent.
    async fn take(&mut self, sem: Arc<Semaphore>, n: u32) -> OwnedSemaphorePermit {
        if let Ok(p) = sem.clone().try_acquire_many_owned(n) {
            return p;
        }
        let p = self.batch.hold(sem.acquire_many_owned(n)).await;
        p.expect(NEVER_CLOSED)
    }

    /// `n` bytes of the server's budget of replies waiting to be sent. When
    /// peers that do not read hold all of it, a connection with nothing else
    /// in flight goes ahead without (None): a client that reads its replies
    /// always has at least one request at a time answered.
    async fn take_unsent(&mut self, n: u32) -> Option<OwnedSemaphorePermit> {
        let unsent = self.sh.unsent.clone();
        if let Ok(p) = unsent.clone().try_acquire_many_owned(n) {
            return Some(p);
        }
        let slots = self.slots.clone();
        let others = (self.max_slots - 1) as u32;
        self.batch
            .hold(async move {
                tokio::select! {
                    p = unsent.acquire_many_owned(n) => Some(p.expect(NEVER_CLOSED)),
                    // Every other slot free: nothing else of ours in flight.
                    _ = slots.acquire_many_owned(others) => None,
                }
            })
            .await
    }

    /// `n` bytes being received or made: from the connection's reserve
    /// when they fit it, which only this connection's requests hold, and
    /// those are all received (the reader takes one payload at a time) and
    /// free it once their replies are made, whatever any client does. Else,
    /// or while the reserve is in use, from the shared budget; a request
    /// bigger than the reserve waits there in order of arrival.
    async fn take_made(&mut self, n: u32) -> OwnedSemaphorePermit {
        let (own, shared) = (self.reserve.clone(), self.sh.bytes_total.clone());
        if n as usize > self.sh.reserve_per_conn {
            return self.take(shared, n).await;
        }
        if let Ok(p) = own.clone().try_acquire_many_owned(n) {
            return p;
        }
        if let Ok(p) = shared.clone().try_acquire_many_owned(n) {
            return p;
        }
        // A place in the shared queue lost to the reserve gives back what
        // it was granted.
        let p = self
            .batch
            .hold(async move {
                tokio::select! {
                    biased;
                    p = own.acquire_many_owned(n) => p,
                    p = shared.acquire_many_owned(n) => p,
                }
            })
            .await;
        p.expect(NEVER_CLOSED)
    }
}
