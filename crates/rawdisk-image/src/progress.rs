//! Progress of the steps that write data (full preallocation, zeroing a
//! device). The library reports through [`Progress`]; the binary passes a
//! [`Bar`] (indicatif, on stderr, hidden when stderr is not a terminal) and
//! tests pass [`NoProgress`] or a recorder.

use std::io::IsTerminal;
use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Receives progress of one step at a time.
pub trait Progress: Send + Sync {
    /// A step that will handle `total` bytes starts.
    fn start(&self, what: &str, total: u64);
    /// `bytes` more are done.
    fn advance(&self, bytes: u64);
    /// The step ended (successfully or not).
    fn finish(&self);
}

/// Reports nothing.
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&self, _what: &str, _total: u64) {}
    fn advance(&self, _bytes: u64) {}
    fn finish(&self) {}
}

/// An indicatif bar with bytes/s and ETA on stderr.
pub struct Bar {
    bar: Mutex<Option<ProgressBar>>,
    visible: bool,
}

impl Bar {
    /// Visible only when stderr is a terminal: a log file or a pipe gets no
    /// control characters.
    pub fn stderr() -> Bar {
        Bar {
            bar: Mutex::new(None),
            visible: std::io::stderr().is_terminal(),
        }
    }

    /// Never drawn (`--quiet`).
    pub fn hidden() -> Bar {
        Bar {
            bar: Mutex::new(None),
            visible: false,
        }
    }
}

impl Progress for Bar {
    fn start(&self, what: &str, total: u64) {
        let target = if self.visible {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let pb = ProgressBar::with_draw_target(Some(total), target);
        if let Ok(style) = ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
        ) {
            pb.set_style(style.progress_chars("=> "));
        }
        pb.set_message(what.to_string());
        if let Ok(mut g) = self.bar.lock() {
            if let Some(old) = g.replace(pb) {
                old.finish_and_clear();
            }
        }
    }

    fn advance(&self, bytes: u64) {
        if let Ok(g) = self.bar.lock() {
            if let Some(pb) = g.as_ref() {
                pb.inc(bytes);
            }
        }
    }

    fn finish(&self) {
        if let Ok(mut g) = self.bar.lock() {
            if let Some(pb) = g.take() {
                pb.finish_and_clear();
            }
        }
    }
}

/// Records what it was told (for tests of the callers).
#[derive(Default)]
pub struct Recorder {
    pub steps: Mutex<Vec<(String, u64, u64)>>,
}

impl Progress for Recorder {
    fn start(&self, what: &str, total: u64) {
        self.steps
            .lock()
            .unwrap()
            .push((what.to_string(), total, 0));
    }
    fn advance(&self, bytes: u64) {
        if let Some(last) = self.steps.lock().unwrap().last_mut() {
            last.2 += bytes;
        }
    }
    fn finish(&self) {}
}
