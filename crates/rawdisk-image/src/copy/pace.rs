//! How a copy shows and paces its progress: the bar (`-p` on a terminal),
//! a line every few seconds (`-p` anywhere else: a log gets no redraws),
//! nbdcopy's `N/100` lines on a descriptor (`--progress=FD`), and qemu-img
//! convert's rate limit (`-r`: bytes of data per second).

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::CopyOptions;

/// Seconds between the lines `-p` prints when stderr is not a terminal.
const LINE_EVERY: Duration = Duration::from_secs(2);

/// Where progress goes besides the terminal bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Report {
    #[default]
    None,
    /// `-p`: the bar on a terminal, else a line every few seconds.
    Stderr,
    /// `--progress=FD`: `N/100` lines on this open descriptor.
    Fd(i32),
}

pub(super) struct Pace {
    pub(super) bar: Option<indicatif::ProgressBar>,
    /// The bytes to copy; 0: not known (a stream source).
    total: u64,
    done: AtomicU64,
    t0: Instant,
    /// `-p` off a terminal: when the last line was printed.
    lines: Option<Mutex<Instant>>,
    /// `--progress=FD` and the last percentage written to it (MAX: none yet).
    fd: Option<Mutex<(std::fs::File, u64)>>,
    /// Rate limit: bytes per second, and when the next request may start.
    rate: u64,
    next: Mutex<Instant>,
}

impl Pace {
    /// Fails when `--progress=FD` names no descriptor open for writing.
    pub(super) fn new(opts: &CopyOptions, total: u64) -> std::io::Result<Pace> {
        let tty = std::io::stderr().is_terminal();
        let bar = (opts.report == Report::Stderr && tty).then(|| bar(total));
        let fd = match opts.report {
            Report::Fd(n) => Some(Mutex::new((open_fd(n)?, u64::MAX))),
            _ => None,
        };
        let now = Instant::now();
        let p = Pace {
            bar,
            total,
            done: AtomicU64::new(0),
            t0: now,
            lines: (opts.report == Report::Stderr && !tty).then(|| Mutex::new(now)),
            fd,
            rate: opts.rate_limit,
            next: Mutex::new(now),
        };
        p.to_fd(0);
        Ok(p)
    }

    /// Waits until `len` more bytes of data fit in the rate limit.
    pub(super) fn throttle(&self, len: u64) {
        if self.rate == 0 {
            return;
        }
        let now = Instant::now();
        let start = {
            let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
            let start = (*next).max(now);
            *next = start + Duration::from_secs_f64(len as f64 / self.rate as f64);
            start
        };
        std::thread::sleep(start - now);
    }

    /// `n` more bytes are done.
    pub(super) fn advance(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        if let Some(b) = &self.bar {
            b.inc(n);
        }
        if let Some(pct) = (done * 100).checked_div(self.total) {
            // 100 only from `complete`: the last byte of a pass is not the
            // end of the copy (its final flush, a pass repeated).
            self.to_fd(pct.min(99));
        }
        if let Some(l) = &self.lines {
            // Whoever finds the interval over prints; the others go on.
            if let Ok(mut last) = l.try_lock() {
                if last.elapsed() >= LINE_EVERY {
                    *last = Instant::now();
                    eprintln!("rawdisk: copy: {}", self.line(done));
                }
            }
        }
    }

    /// The copy starts again from nothing (a pass repeated): the bar and the
    /// count go back; the descriptor keeps what it said, never going back.
    pub(super) fn again(&self) {
        self.done.store(0, Ordering::Relaxed);
        if let Some(b) = &self.bar {
            b.set_position(0);
        }
    }

    /// The copy is complete: 100/100 on the descriptor, the bar cleared.
    /// Under a rate limit, only once the last request's share of time has
    /// passed, so the whole copy keeps to the rate, not all but one request.
    pub(super) fn complete(&self) {
        if self.rate > 0 {
            let next = *self.next.lock().unwrap_or_else(|p| p.into_inner());
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
        }
        self.to_fd(100);
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }

    fn line(&self, done: u64) -> String {
        let secs = self.t0.elapsed().as_secs_f64().max(1e-3);
        let rate = done as f64 / secs;
        let mib = |b: f64| b / (1 << 20) as f64;
        if self.total == 0 {
            return format!("{:.1} MiB, {:.1} MiB/s", mib(done as f64), mib(rate));
        }
        let left = self.total.saturating_sub(done) as f64 / rate.max(1.0);
        format!(
            "{}% ({:.1} of {:.1} MiB), {:.1} MiB/s, ETA {:.0} s",
            done * 100 / self.total,
            mib(done as f64),
            mib(self.total as f64),
            mib(rate),
            left
        )
    }

    /// Writes `N/100` when the percentage moved (nbdcopy's format); a
    /// reader that went away does not stop the copy.
    fn to_fd(&self, pct: u64) {
        if let Some(f) = &self.fd {
            let mut g = f.lock().unwrap_or_else(|p| p.into_inner());
            if g.1 == u64::MAX || pct > g.1 {
                g.1 = pct;
                let _ = writeln!(g.0, "{}/100", pct.min(100));
            }
        }
    }
}

/// Fails as a copy with `--progress=FD` would, before anything is opened:
/// a destination is not created for a copy that cannot start.
pub fn check_progress_fd(n: i32) -> std::io::Result<()> {
    open_fd(n).map(drop)
}

/// The descriptor the caller opened, through /proc (no unsafe adoption of
/// a raw descriptor): a pipe or a file, written at its end.
fn open_fd(n: i32) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .append(true)
        .open(format!("/proc/self/fd/{n}"))
        .map_err(|e| std::io::Error::new(e.kind(), format!("--progress={n}: descriptor {n}: {e}")))
}

/// A bar, or for a size not known (a stream) a counter of bytes.
fn bar(size: u64) -> indicatif::ProgressBar {
    let (b, template) = match size {
        0 => (
            indicatif::ProgressBar::new_spinner(),
            "{spinner} {bytes} {binary_bytes_per_sec} {msg}",
        ),
        _ => (
            indicatif::ProgressBar::new(size),
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
        ),
    };
    b.set_style(
        indicatif::ProgressStyle::with_template(template)
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b
}
