//! Faults for tests that the storage crate's injector cannot reach: a
//! target opened through it has no in-kernel AIO queue, so it never sees
//! the eventfd the reaper polls. Process-wide; built only with the
//! `fault-injection` feature, which only the tests enable.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static AIO_POLL_FAILS: AtomicBool = AtomicBool::new(false);
static AIO_POLLS_FAILED: AtomicU64 = AtomicU64::new(0);

/// While on, every AIO eventfd poll that found a completion fails instead,
/// as if the eventfd could no longer be polled, with requests in flight.
pub fn fail_aio_polls(on: bool) {
    AIO_POLL_FAILS.store(on, Ordering::Relaxed);
}

/// How many polls were made to fail, so a test knows the fault was met.
pub fn aio_polls_failed() -> u64 {
    AIO_POLLS_FAILED.load(Ordering::Relaxed)
}

/// Whether this poll fails (counted).
pub(crate) fn aio_poll_fails() -> bool {
    let on = AIO_POLL_FAILS.load(Ordering::Relaxed);
    if on {
        AIO_POLLS_FAILED.fetch_add(1, Ordering::Relaxed);
    }
    on
}
