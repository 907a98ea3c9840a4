//! [`FaultSys`]: a [`Sys`] that forwards to another one and injects errnos, so
//! tests can produce failures the machine under test cannot (EIO, ENOSPC, a
//! method that stops being supported at run time) on exactly the call wanted,
//! can assert which syscalls the engine made (a method known to fail must
//! never be called again), can record the range of every call, and can
//! serve a fallocate mode the machine refuses by another one underneath
//! ([`FaultSys::stand_in`]), so the engine's success path for it runs.
//!
//! Built only with the `fault-injection` feature (and for this crate's unit
//! tests): tests enable it, the shipped binary does not contain it. Its
//! `impl Sys` is generated from the syscall table (`syscalls!` in sys.rs),
//! so every syscall is forwarded, counted under its own [`CallKind`] and can
//! be failed.

use std::collections::HashMap;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::sys::{
    syscalls, BlockGeometry, CallKind, DioAlign, FallocMode, FileStat, LockCmd, LockKind, MapSpan,
    Mapping, OpenHow, Sys,
};

/// "The `nth` call (1-based, counted per [`CallKind`]) of `kind` fails with
/// `errno`", once, or on every call from the `nth` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultRule {
    pub kind: CallKind,
    pub nth: u64,
    pub errno: i32,
    /// false: only the nth call fails; true: the nth and every later one.
    pub repeat: bool,
    /// Only calls whose range overlaps [start, end) count as hits.
    pub over: Option<(u64, u64)>,
    /// A hit panics instead of failing: a bug in the engine, for tests of
    /// what the caller does when a job unwinds.
    pub panic: bool,
    /// A hit waits this long and then runs the call: slow storage, for
    /// tests of who else waits meanwhile.
    pub delay: Option<std::time::Duration>,
}

impl FaultRule {
    /// Only the `nth` call of `kind` fails.
    pub fn once(kind: CallKind, nth: u64, errno: i32) -> Self {
        FaultRule {
            kind,
            nth,
            errno,
            repeat: false,
            over: None,
            panic: false,
            delay: None,
        }
    }

    /// The `nth` call of `kind` and every later one fail.
    pub fn from_nth(kind: CallKind, nth: u64, errno: i32) -> Self {
        FaultRule {
            kind,
            nth,
            errno,
            repeat: true,
            over: None,
            panic: false,
            delay: None,
        }
    }

    /// Every call of `kind` whose range overlaps [offset, offset+len) fails,
    /// whatever else it covers: a bad spot, for callers that may cover it
    /// in one call or in several.
    pub fn over(kind: CallKind, offset: u64, len: u64, errno: i32) -> Self {
        FaultRule {
            over: Some((offset, offset + len)),
            ..Self::always(kind, errno)
        }
    }

    /// Every call of `kind` fails.
    pub fn always(kind: CallKind, errno: i32) -> Self {
        Self::from_nth(kind, 1, errno)
    }

    /// The same hits panic instead of failing.
    pub fn panicking(self) -> Self {
        FaultRule {
            panic: true,
            ..self
        }
    }

    /// The same hits wait `d`, then run the call.
    pub fn slowed(self, d: std::time::Duration) -> Self {
        FaultRule {
            delay: Some(d),
            ..self
        }
    }

    fn hits(&self, call: &Call, n: u64) -> bool {
        self.kind == call.kind
            && (n == self.nth || (self.repeat && n > self.nth))
            && self
                .over
                .is_none_or(|(s, e)| call.offset < e && s < call.offset + call.len)
    }
}

/// Wraps another [`Sys`]; every call is counted, then failed if a rule says
/// so (the inner `Sys` is then not called), else forwarded.
pub struct FaultSys {
    inner: Arc<dyn Sys>,
    rules: Mutex<Vec<FaultRule>>,
    counts: Mutex<HashMap<CallKind, u64>>,
    /// 0 = unlimited; else pread/pwrite move at most this many bytes per call
    /// (short transfers, to exercise the whole-length loops).
    max_io: AtomicUsize,
    /// Whether to keep [`FaultSys::take_log`]'s log.
    recording: AtomicBool,
    log: Mutex<Vec<Call>>,
    /// Whether to keep [`FaultSys::take_spans`]'s log, and its clock.
    spanning: AtomicBool,
    clock: AtomicU64,
    spans: Mutex<Vec<Span>>,
    edit_geometry: Mutex<Option<GeometryEdit>>,
    stand_ins: Mutex<HashMap<FallocMode, FallocMode>>,
}

type GeometryEdit = Box<dyn Fn(BlockGeometry) -> BlockGeometry + Send + Sync>;

/// One call as [`FaultSys`] saw it: the range the table names for it, and
/// whether it succeeded. A transfer that moved fewer bytes than asked for
/// counts as what it moved; a failed one as what was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    pub kind: CallKind,
    pub offset: u64,
    pub len: u64,
    pub ok: bool,
}

/// When a call ran, in ticks of one counter taken as it was entered and as
/// it returned: whether one call started after another returned, for tests
/// of what concurrent callers may conclude.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub kind: CallKind,
    pub start: u64,
    pub end: u64,
    pub ok: bool,
}

impl std::fmt::Debug for FaultSys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultSys")
            .field("rules", &*self.rules.lock().unwrap())
            .field("counts", &*self.counts.lock().unwrap())
            .finish()
    }
}

impl FaultSys {
    pub fn new(inner: Arc<dyn Sys>) -> Self {
        FaultSys {
            inner,
            rules: Mutex::new(Vec::new()),
            counts: Mutex::new(HashMap::new()),
            max_io: AtomicUsize::new(0),
            recording: AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
            spanning: AtomicBool::new(false),
            clock: AtomicU64::new(0),
            spans: Mutex::new(Vec::new()),
            edit_geometry: Mutex::new(None),
            stand_ins: Mutex::new(HashMap::new()),
        }
    }

    /// A `FaultSys` over the kernel.
    pub fn real() -> Arc<Self> {
        Arc::new(Self::new(Arc::new(crate::sys::RealSys)))
    }

    /// Add a rule. Call numbers count from the creation of this `FaultSys`
    /// (or the last [`FaultSys::reset_counts`]), not from when the rule is added.
    pub fn add(&self, rule: FaultRule) -> &Self {
        self.rules.lock().unwrap().push(rule);
        self
    }

    /// Shorthand for `add(FaultRule::once(..))`.
    pub fn fail_once(&self, kind: CallKind, nth: u64, errno: i32) -> &Self {
        self.add(FaultRule::once(kind, nth, errno))
    }

    /// Shorthand for `add(FaultRule::from_nth(..))`.
    pub fn fail_from(&self, kind: CallKind, nth: u64, errno: i32) -> &Self {
        self.add(FaultRule::from_nth(kind, nth, errno))
    }

    /// Remove every rule (counts are kept).
    pub fn clear_rules(&self) {
        self.rules.lock().unwrap().clear();
    }

    pub fn reset_counts(&self) {
        self.counts.lock().unwrap().clear();
    }

    /// Limit pread/pwrite/pwrite_dsync/splice to `n` bytes per call (0 = no limit).
    pub fn set_max_io(&self, n: usize) {
        self.max_io.store(n, Ordering::Relaxed);
    }

    /// Keep a log of every call from now on (see [`FaultSys::take_log`]).
    pub fn record(&self) -> &Self {
        self.recording.store(true, Ordering::Relaxed);
        self
    }

    /// The calls logged since [`FaultSys::record`] or the last `take_log`.
    pub fn take_log(&self) -> Vec<Call> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }

    /// Keep the [`Span`] of every call from now on.
    pub fn record_spans(&self) -> &Self {
        self.spanning.store(true, Ordering::SeqCst);
        self
    }

    /// The spans kept since [`FaultSys::record_spans`] or the last call.
    pub fn take_spans(&self) -> Vec<Span> {
        std::mem::take(&mut *self.spans.lock().unwrap())
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }

    fn log_span(&self, kind: CallKind, start: u64, ok: bool) {
        if self.spanning.load(Ordering::SeqCst) {
            let end = self.tick();
            self.spans.lock().unwrap().push(Span {
                kind,
                start,
                end,
                ok,
            });
        }
    }

    /// Rewrite what [`Sys::block_geometry`] returns: a driver that fails
    /// some ioctls of the group (BLKSSZGET on old drivers).
    pub fn set_geometry_edit(
        &self,
        f: impl Fn(BlockGeometry) -> BlockGeometry + Send + Sync + 'static,
    ) {
        *self.edit_geometry.lock().unwrap() = Some(Box::new(f));
    }

    /// Serve fallocate in mode `mode` by calling the inner `Sys` with `with`
    /// instead: the call is still counted, logged and failed as `mode`. For
    /// a mode the machine refuses (FALLOC_FL_WRITE_ZEROES without a device
    /// that zeroes by unmapping), so its success path runs on real bytes.
    pub fn stand_in(&self, mode: FallocMode, with: FallocMode) {
        self.stand_ins.lock().unwrap().insert(mode, with);
    }

    /// Calls of `kind` made so far, failed ones included.
    pub fn calls(&self, kind: CallKind) -> u64 {
        self.counts.lock().unwrap().get(&kind).copied().unwrap_or(0)
    }

    /// Calls of every fallocate mode together.
    pub fn fallocate_calls(&self) -> u64 {
        self.counts
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| matches!(k, CallKind::Fallocate(_)))
            .map(|(_, n)| *n)
            .sum()
    }

    /// Every kind called so far with its count.
    pub fn counts(&self) -> HashMap<CallKind, u64> {
        self.counts.lock().unwrap().clone()
    }

    /// Count the call, and return the injected error if a rule hits it.
    fn enter(&self, call: &Call) -> io::Result<()> {
        let n = {
            let mut c = self.counts.lock().unwrap();
            let e = c.entry(call.kind).or_insert(0);
            *e += 1;
            *e
        };
        let hit = self
            .rules
            .lock()
            .unwrap()
            .iter()
            .find(|r| r.hits(call, n))
            .copied();
        match hit {
            // With no lock held: the injector must outlive the panic.
            Some(r) if r.panic => panic!("injected panic: {:?} call {n}", call.kind),
            Some(FaultRule { delay: Some(d), .. }) => {
                std::thread::sleep(d);
                Ok(())
            }
            Some(r) => Err(io::Error::from_raw_os_error(r.errno)),
            None => Ok(()),
        }
    }

    /// Shorten a transfer to the limit of [`FaultSys::set_max_io`].
    fn cap<T: Capped>(&self, v: T) -> T {
        match self.max_io.load(Ordering::Relaxed) {
            0 => v,
            m => v.capped(m),
        }
    }

    fn edit_geometry(&self, g: BlockGeometry) -> BlockGeometry {
        match &*self.edit_geometry.lock().unwrap() {
            Some(f) => f(g),
            None => g,
        }
    }

    fn stand_in_for(&self, mode: FallocMode) -> FallocMode {
        self.stand_ins
            .lock()
            .unwrap()
            .get(&mode)
            .copied()
            .unwrap_or(mode)
    }

    fn log_call(&self, call: Call) {
        if self.recording.load(Ordering::Relaxed) {
            self.log.lock().unwrap().push(call);
        }
    }
}

/// A transfer that [`FaultSys::set_max_io`] can shorten.
trait Capped {
    fn capped(self, max: usize) -> Self;
}

impl Capped for usize {
    fn capped(self, max: usize) -> usize {
        self.min(max)
    }
}

impl Capped for &[u8] {
    fn capped(self, max: usize) -> Self {
        &self[..self.len().min(max)]
    }
}

impl Capped for &mut [u8] {
    fn capped(self, max: usize) -> Self {
        let n = self.len().min(max);
        &mut self[..n]
    }
}

/// `impl Sys for FaultSys` from the syscall table: count, maybe fail, maybe
/// shorten or stand in, forward, maybe edit, log.
macro_rules! fault_sys {
    ($(
        $(#[$doc:meta])*
        fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty
            [$kind:ident $(($karg:ident))?, $off:expr, $len:expr $(, cap $cap:ident)? $(, then $edit:ident)?
                $(, swap $swap:ident by $swapf:ident)?];
    )*) => {
        impl Sys for FaultSys {
            $(
                fn $name(&self, $($arg: $ty),*) -> io::Result<$ret> {
                    let mut call = Call {
                        kind: CallKind::$kind $(($karg))?,
                        offset: ($off) as u64,
                        len: ($len) as u64,
                        ok: false,
                    };
                    let start = self.tick();
                    let r = self.enter(&call).and_then(|()| {
                        $(let $cap = self.cap($cap);)?
                        $(let $swap = self.$swapf($swap);)?
                        self.inner.$name($($arg),*)
                    });
                    $(let r = r.map(|v| self.$edit(v));)?
                    call.ok = r.is_ok();
                    $(
                        let _ = stringify!($cap);
                        if let Ok(n) = &r {
                            call.len = *n as u64;
                        }
                    )?
                    self.log_span(call.kind, start, call.ok);
                    self.log_call(call);
                    r
                }
            )*
        }
    };
}
syscalls!(fault_sys);
