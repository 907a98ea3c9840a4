//! What every command that stops cleanly on a signal (serve, copy, create,
//! resize) needs whatever else it does: the signals unblocked, and a second
//! one that ends the process even when no other thread can run.

use std::io::{self, Read};
use std::os::fd::{IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};

/// The signals that stop copy, create and resize.
pub(crate) const INT_TERM: [(libc::c_int, &str); 2] =
    [(libc::SIGINT, "SIGINT"), (libc::SIGTERM, "SIGTERM")];

/// How long the line a second signal writes may take before the process
/// exits without it (a stderr pipe nobody reads, or a thread blocked on it
/// holding the stderr lock).
const SAY_WAIT: Duration = Duration::from_secs(1);

/// Unblocks `signals` in the calling thread, and so in every thread it
/// starts later. A mask is kept across fork and exec from whoever started
/// the process (a thread waiting in sigwait, a supervisor), and a handler
/// alone never sees a blocked signal: it would stay pending for ever.
/// Called from the main thread, which lives as long as the process, so a
/// process-directed signal always has a thread to go to.
pub(crate) fn unblock(signals: &[libc::c_int]) -> anyhow::Result<()> {
    // SAFETY: sigemptyset initialises the set before sigaddset and
    // pthread_sigmask read it; pthread_sigmask changes only this thread's
    // mask.
    let rc = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &n in signals {
            libc::sigaddset(&mut set, n);
        }
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut())
    };
    if rc != 0 {
        bail!(
            "cannot unblock the signals: {}",
            io::Error::from_raw_os_error(rc)
        );
    }
    Ok(())
}

/// Counts `signals` from their handlers, which run next to any other
/// handler of the same signal (tokio's: signal-hook-registry is its
/// registry). The first one calls `first` in the handler: it may only
/// touch atomics. The second wakes a plain thread, outside any runtime and
/// needing no lock, which calls `exit` with the signal's number and name
/// and ends the process at once (`_exit`) with the status it returns.
pub(crate) fn on_two<F, E>(
    signals: &'static [(libc::c_int, &'static str)],
    first: F,
    exit: E,
) -> anyhow::Result<()>
where
    F: Fn(libc::c_int) + Send + Sync + 'static,
    E: FnOnce(libc::c_int, &'static str) -> i32 + Send + 'static,
{
    let (mut rd, wr) = io::pipe().context("signal handler: pipe")?;
    // Never closed: a handler may write to it until the process ends.
    let wr = OwnedFd::from(wr).into_raw_fd();
    let seen = Arc::new(AtomicU32::new(0));
    let first = Arc::new(first);
    for &(n, name) in signals {
        let (seen, first) = (seen.clone(), first.clone());
        // SAFETY: the action only touches atomics (`first` is documented to)
        // and calls write(2), all async-signal-safe; it is registered from
        // one thread before any other handler of this process's own.
        unsafe {
            signal_hook_registry::register(n, move || match seen.fetch_add(1, Ordering::SeqCst) {
                0 => first(n),
                1 => {
                    let b = [n as u8];
                    libc::write(wr, b.as_ptr().cast(), 1);
                }
                _ => {}
            })
        }
        .with_context(|| format!("{name} handler"))?;
    }
    std::thread::Builder::new()
        .name("rawdisk-signal".into())
        .spawn(move || {
            let mut b = [0u8];
            if rd.read_exact(&mut b).is_ok() {
                let n = libc::c_int::from(b[0]);
                let name = signals
                    .iter()
                    .find(|s| s.0 == n)
                    .map_or("a signal", |s| s.1);
                let status = exit(n, name);
                // SAFETY: _exit ends the process at once; exit would first
                // run handlers that may wait on a lock a stuck thread holds.
                unsafe { libc::_exit(status) }
            }
        })
        .context("second-signal thread")?;
    Ok(())
}

/// Writes `line` to stderr if that takes less than a second: it may be a
/// pipe nobody reads, and another thread may hold the stderr lock while it
/// waits on it. Never panics (eprintln! does on a closed stderr).
pub(crate) fn say_soon(line: String) {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new().spawn(move || {
        crate::out::say(&line);
        let _ = tx.send(());
    });
    if spawned.is_ok() {
        let _ = rx.recv_timeout(SAY_WAIT);
    }
}

/// A command stopped by SIGINT or SIGTERM: the flag the work polls, and
/// which signal set it.
pub(crate) struct Cancel {
    pub(crate) flag: Arc<AtomicBool>,
    signal: Arc<AtomicI32>,
}

impl Cancel {
    /// The signal that set the flag (0: none).
    pub(crate) fn signal(&self) -> libc::c_int {
        self.signal.load(Ordering::SeqCst)
    }
}

/// SIGINT and SIGTERM, unblocked: the first sets [`Cancel::flag`] (the
/// command finishes what is in flight and says how far it got); a second
/// one says `rawdisk: SIGINT again: exiting now` and `left` (what the
/// command leaves behind) and exits with 128 + its number.
pub(crate) fn cancel_on_int_term(left: &'static str) -> anyhow::Result<Cancel> {
    unblock(&INT_TERM.map(|s| s.0))?;
    let c = Cancel {
        flag: Arc::new(AtomicBool::new(false)),
        signal: Arc::new(AtomicI32::new(0)),
    };
    let (flag, signal) = (c.flag.clone(), c.signal.clone());
    on_two(
        &INT_TERM,
        move |n| {
            signal.store(n, Ordering::SeqCst);
            flag.store(true, Ordering::SeqCst);
        },
        move |n, name| {
            say_soon(format!("rawdisk: {name} again: exiting now{left}"));
            128 + n
        },
    )?;
    Ok(c)
}

/// The name of a stop signal, as the messages say it.
pub(crate) fn name(n: libc::c_int) -> &'static str {
    INT_TERM
        .iter()
        .find(|s| s.0 == n)
        .map_or("a signal", |s| s.1)
}
