//! `rawdisk probe`: what the storage under a target supports, method by
//! method, and which method `rawdisk`'s zero would use.
//!
//! A report over the storage engine's own probing
//! ([`rawdisk_storage::Target::try_method`] and friends): the engine tries
//! each method with the very call its zero chain makes and judges the
//! answer by its own rules, so the report cannot disagree with what serving
//! or copying will do. This module only chooses where to try (never on the
//! target's own data unless `--destructive`) and words the answers.
//!
//! * Regular file: every method is tried on a scratch file created beside the
//!   target (same directory, so same file system and mount options) and
//!   removed afterwards; the target itself is only stat'ed. Each method runs
//!   on its own 1 MiB of written data, checked (reads back zeros; allocation
//!   freed or kept), then the engine's zero chain runs on the scratch file to
//!   show which method it picks.
//! * Block device, default: nothing is written. The device is opened
//!   read-only and its queue limits in sysfs say what the kernel will do:
//!   `write_zeroes_max_bytes` = 0 means PUNCH_HOLE fails and ZERO_RANGE /
//!   BLKZEROOUT make the kernel write zeros; non-zero is only an
//!   advertisement (a loop device over tmpfs drops it on first use), so it
//!   stays "unknown". `discard_max_bytes` = 0 means BLKDISCARD fails.
//! * Block device, `--destructive`: the device is opened O_EXCL (refused
//!   while mounted), the first 6 MiB are saved, every method is tried on
//!   them, and the saved bytes are written back.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rawdisk_storage::{Kind, Method, OpenOptions, Prealloc, Target, Trial, ZeroFlags};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::sysinfo::{self, MountInfo, QueueLimits};

mod output;
mod words;

use words::{discard, errno_name, file_methods_unknown, fixed_rows, mr, not_working, zeroing};

#[derive(Debug, Clone)]
pub struct ProbeOptions {
    pub path: PathBuf,
    /// Block devices: try each method on the device itself.
    pub destructive: bool,
}

/// What is known about one method; JSON has the words the human form has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Works,
    Fails,
    Unknown,
    NotApplicable,
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            State::Works => "works",
            State::Fails => "known to fail",
            State::Unknown => "unknown",
            State::NotApplicable => "n/a",
        }
    }
}

impl Serialize for State {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct MethodReport {
    pub method: &'static str,
    /// The call behind the method.
    pub call: &'static str,
    pub state: State,
    /// Why: the errno, what the data and allocation looked like after, or the
    /// sysfs value the state was inferred from.
    pub detail: String,
}

/// Which method a zero request would use.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Choice {
    /// The method(s), joined with " + " when the engine split the request
    /// (an unaligned head written, the aligned middle offloaded).
    pub method: String,
    /// Observed (the engine did it) or inferred from known states; false when
    /// an earlier method in the chain is still unknown.
    pub certain: bool,
    /// What it would fall back to if the uncertain method failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otherwise: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ZeroReport {
    #[serde(rename = "with-trim")]
    pub with_trim: Choice,
    #[serde(rename = "without-trim")]
    pub without_trim: Choice,
    /// Whether a zero that must not fall back to writing can succeed
    /// (NBD_FLAG_SEND_FAST_ZERO); None (null) when unknown.
    #[serde(rename = "fast-zero")]
    pub fast_zero: Option<bool>,
    #[serde(rename = "fast-zero-method", skip_serializing_if = "Option::is_none")]
    pub fast_zero_method: Option<String>,
    /// Whether trim can free space; None (null) when unknown.
    pub trim: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// The target's name, under the key `info` uses.
    #[serde(rename = "filename")]
    pub target: String,
    /// "file" or "block".
    pub kind: &'static str,
    #[serde(rename = "virtual-size")]
    pub size: u64,
    #[serde(rename = "logical-sector-size")]
    pub logical_sector_size: u32,
    #[serde(rename = "physical-sector-size")]
    pub physical_sector_size: u32,
    #[serde(rename = "minimum-io-size")]
    pub minimum_io_size: u32,
    #[serde(rename = "optimal-io-size")]
    pub optimal_io_size: u32,
    pub rotational: bool,
    #[serde(rename = "read-only")]
    pub read_only: bool,
    #[serde(rename = "direct-io")]
    pub direct_io: State,
    #[serde(
        rename = "direct-io-alignment",
        skip_serializing_if = "Option::is_none"
    )]
    pub direct_io_alignment: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filesystem: Option<MountInfo>,
    #[serde(rename = "queue-limits", skip_serializing_if = "Option::is_none")]
    pub queue_limits: Option<QueueLimits>,
    /// Queue limits after a destructive probe, when trying changed them (a
    /// loop device dropping write-zeroes).
    #[serde(rename = "queue-limits-after", skip_serializing_if = "Option::is_none")]
    pub queue_limits_after: Option<QueueLimits>,
    /// "scratch-file", "sysfs" (nothing tried) or "device" (--destructive).
    #[serde(rename = "tested-on")]
    pub tested_on: &'static str,
    #[serde(rename = "scratch-file", skip_serializing_if = "Option::is_none")]
    pub scratch_file: Option<String>,
    /// Why the scratch file could not be used (methods then stay unknown).
    #[serde(rename = "scratch-error", skip_serializing_if = "Option::is_none")]
    pub scratch_error: Option<String>,
    pub methods: Vec<MethodReport>,
    pub zero: ZeroReport,
}

const MIB: u64 = 1 << 20;

pub fn probe(opts: &ProbeOptions) -> Result<ProbeReport> {
    let path = &opts.path;
    let shown = path.display();
    let md = fs::metadata(path).map_err(|e| Error::with(format!("cannot probe '{shown}'"), e))?;
    let ft = md.file_type();
    if !ft.is_file() && !ft.is_block_device() {
        return Err(Error::msg(format!(
            "cannot probe '{shown}': not a regular file or block device"
        )));
    }
    let t = crate::open_read_only(path)?;
    let g = t.geometry();
    let mut r = ProbeReport {
        target: path.display().to_string(),
        kind: if t.kind() == Kind::Block {
            "block"
        } else {
            "file"
        },
        size: t.size(),
        logical_sector_size: g.logical_sector,
        physical_sector_size: g.physical_sector,
        minimum_io_size: g.min_io,
        optimal_io_size: g.opt_io,
        rotational: g.rotational,
        read_only: sysinfo::read_only(path),
        direct_io: State::Unknown,
        direct_io_alignment: None,
        filesystem: None,
        queue_limits: None,
        queue_limits_after: None,
        tested_on: "sysfs",
        scratch_file: None,
        scratch_error: None,
        methods: Vec::new(),
        zero: ZeroReport {
            with_trim: unknown_choice(),
            without_trim: unknown_choice(),
            fast_zero: None,
            fast_zero_method: None,
            trim: None,
        },
    };
    match md.file_type().is_block_device() {
        false => {
            drop(t);
            probe_file(path, &mut r)
        }
        true if opts.destructive => {
            // The device is opened again, exclusively.
            drop(t);
            probe_device_destructive(path, &mut r)?
        }
        true => probe_device_sysfs(&t, &mut r),
    }
    // One order for every kind: the engine's method list.
    r.methods.sort_by_key(|m| {
        Method::ALL
            .iter()
            .position(|x| x.name() == m.method)
            .unwrap_or(usize::MAX)
    });
    Ok(r)
}

fn unknown_choice() -> Choice {
    Choice {
        method: "unknown".into(),
        certain: false,
        otherwise: None,
    }
}

// ---------------------------------------------------------------------------
// Regular files: a scratch file beside the target

/// The scratch file, removed on drop (also when probing panics).
struct ScratchFile {
    path: PathBuf,
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

fn create_scratch(target: &Path) -> io::Result<(ScratchFile, File)> {
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let base = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "target".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    for i in 0..16u32 {
        let p = dir.join(format!(
            ".{base}.rawdisk-probe-{}-{:08x}",
            std::process::id(),
            nanos.wrapping_add(i)
        ));
        match fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&p)
        {
            Ok(f) => return Ok((ScratchFile { path: p }, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::from(io::ErrorKind::AlreadyExists))
}

/// Scratch layout, 1 MiB regions: 0..4 one per tried method (punch-hole,
/// falloc-write-zeroes, zero-range, punch-alloc), 4..7 the engine's zero
/// chain, 7 data, 8 a hole (never written), then fallocate(0) extends the
/// file from 9 to 10 MiB.
fn probe_file(path: &Path, r: &mut ProbeReport) {
    r.filesystem = sysinfo::mount_of(path);
    r.tested_on = "scratch-file";
    let (scratch, f) = match create_scratch(path) {
        Ok(x) => x,
        Err(e) => {
            r.scratch_error = Some(format!(
                "cannot create a scratch file beside '{}': {e}",
                path.display()
            ));
            r.methods = file_methods_unknown(&r.scratch_error.clone().unwrap_or_default());
            return;
        }
    };
    drop(f);
    r.scratch_file = Some(scratch.path.display().to_string());
    let setup = Target::open(&scratch.path, &OpenOptions::default()).and_then(|t| {
        t.write_at(&fill_data(), 7 * MIB, false)?;
        t.preallocate(9 * MIB, Prealloc::Off)?;
        t.flush()?;
        Ok(t)
    });
    let t = match setup {
        Ok(t) => t,
        Err(e) => {
            r.scratch_error = Some(format!(
                "cannot write the scratch file '{}': {}",
                scratch.path.display(),
                errno_name(&e.source)
            ));
            r.methods = file_methods_unknown(&r.scratch_error.clone().unwrap_or_default());
            return;
        }
    };

    let mut methods = Vec::new();
    for (i, &m) in t.trial_methods().iter().enumerate() {
        let tried = t.try_method(m, i as u64 * MIB, MIB);
        methods.push(mr(m, Kind::File, zeroing(tried, true)));
    }

    // SEEK_HOLE before fallocate(0) fills the tail: [7, 8) MiB is data and
    // [8, 9) MiB was never written.
    let seek = match t.try_seek_hole(7 * MIB) {
        Trial::Works(Some(h)) if h == 8 * MIB => (State::Works, "reports holes".to_string()),
        Trial::Works(Some(h)) if h == 9 * MIB => (
            State::Works,
            "reports everything as data (no holes: map shows all data)".to_string(),
        ),
        Trial::Works(other) => (
            State::Unknown,
            format!("unexpected answer {other:?} for a hole at 8 MiB"),
        ),
        t => not_working(t),
    };
    methods.push(mr(Method::SeekHole, Kind::File, seek));

    let falloc = match t.try_allocate(9 * MIB, MIB) {
        Trial::Works(seen) => {
            let grew = seen.size == 10 * MIB;
            let alloc = seen.allocated.1 > seen.allocated.0;
            match (grew, alloc) {
                (true, true) => (
                    State::Works,
                    "allocates (preallocation=falloc uses it)".into(),
                ),
                (true, false) => (
                    State::Works,
                    "extends the file but allocation did not grow".into(),
                ),
                _ => (State::Unknown, "succeeded but the file did not grow".into()),
            }
        }
        Trial::Unsupported(e) => (
            State::Fails,
            format!(
                "{} (preallocation=falloc falls back to writing zeros)",
                errno_name(&e)
            ),
        ),
        t => not_working(t),
    };
    methods.push(mr(Method::Fallocate, Kind::File, falloc));
    methods.extend(fixed_rows(Kind::File));

    // O_DIRECT (--cache none): ramfs refuses it with EINVAL.
    match Target::try_direct_io(&scratch.path) {
        Trial::Works(align) => {
            r.direct_io = State::Works;
            r.direct_io_alignment = align;
        }
        Trial::Unsupported(_) => r.direct_io = State::Fails,
        _ => r.direct_io = State::Unknown,
    }

    r.methods = methods;
    engine_zero_chain(&t, 4 * MIB, r);
    drop(t);
    drop(scratch);
}

/// Non-zero data the zero chain is run over.
fn fill_data() -> Vec<u8> {
    vec![0x5a; MIB as usize]
}

/// Runs the engine's zero chain on three 1 MiB ranges from `base` of a file
/// or device that may be written, filled with data first, and records which
/// methods it used.
fn engine_zero_chain(t: &Target, base: u64, r: &mut ProbeReport) {
    let fill = |off: u64| {
        let _ = t
            .write_at(&fill_data(), off, false)
            .and_then(|()| t.flush());
    };
    let names = |ms: &[Method]| {
        if ms.is_empty() {
            "none".to_string()
        } else {
            ms.iter().map(|m| m.name()).collect::<Vec<_>>().join(" + ")
        }
    };
    let chosen = |off: u64, may_trim: bool| {
        fill(off);
        let flags = ZeroFlags {
            may_trim,
            fast_only: false,
        };
        match t.zero(off, MIB, flags) {
            Ok(o) => Choice {
                method: names(&o.methods),
                certain: true,
                otherwise: None,
            },
            Err(e) => Choice {
                method: format!("error: {e}"),
                certain: false,
                otherwise: None,
            },
        }
    };
    r.zero.with_trim = chosen(base, true);
    r.zero.without_trim = chosen(base + MIB, false);
    fill(base + 2 * MIB);
    let fast = t.zero(
        base + 2 * MIB,
        MIB,
        ZeroFlags {
            may_trim: false,
            fast_only: true,
        },
    );
    match fast {
        Ok(o) => {
            r.zero.fast_zero = Some(true);
            r.zero.fast_zero_method = Some(names(&o.methods));
        }
        Err(e) if e.errno().map(|n| n == libc::EOPNOTSUPP).unwrap_or(false) => {
            r.zero.fast_zero = Some(false);
        }
        Err(_) => r.zero.fast_zero = None,
    }
    r.zero.trim = Some(t.can_trim());
}

// ---------------------------------------------------------------------------
// Block devices

fn probe_device_sysfs(t: &Target, r: &mut ProbeReport) {
    r.tested_on = "sysfs";
    r.direct_io = State::Works;
    r.direct_io_alignment = Some(r.logical_sector_size);
    let q = sysinfo::queue_limits(t);
    let wz = q.as_ref().and_then(|q| q.write_zeroes_max_bytes);
    let dmax = q.as_ref().and_then(|q| q.discard_max_bytes);
    r.queue_limits = q;
    let mut methods = Vec::new();
    let (punch, zr_detail) = match wz {
        Some(0) => (
            (State::Fails, "write_zeroes_max_bytes=0: no write-zeroes, and PUNCH_HOLE never falls back".to_string()),
            "write_zeroes_max_bytes=0: the kernel writes zero pages (slow)".to_string(),
        ),
        Some(n) => (
            (
                State::Unknown,
                format!("write-zeroes advertised (write_zeroes_max_bytes={n}); only trying tells (--destructive): a loop device over tmpfs drops it on first use"),
            ),
            format!("offloaded while write-zeroes holds (write_zeroes_max_bytes={n}), else the kernel writes zero pages"),
        ),
        None => (
            (State::Unknown, "write_zeroes_max_bytes not readable".to_string()),
            "the kernel falls back to writing zero pages".to_string(),
        ),
    };
    let k = Kind::Block;
    methods.push(mr(Method::PunchHole, k, punch));
    methods.push(mr(Method::ZeroRange, k, (State::Works, zr_detail.clone())));
    methods.push(mr(Method::BlkZeroout, k, (State::Works, zr_detail)));
    let discard = match dmax {
        Some(0) => (State::Fails, "discard_max_bytes=0: no discard".to_string()),
        Some(n) => (State::Works, format!("advertised (discard_max_bytes={n}); whether the device then reads zeros is not promised")),
        None => (State::Unknown, "discard_max_bytes not readable".to_string()),
    };
    methods.push(mr(Method::BlkDiscard, k, discard));
    methods.extend(fixed_rows(k));
    r.methods = methods;

    predict_block_chain(r);
    let st = |m: Method| state_in(&r.methods, m);
    // On a block device only PUNCH_HOLE cannot fall back to writing.
    r.zero.fast_zero = known(st(Method::PunchHole));
    if r.zero.fast_zero != Some(false) {
        r.zero.fast_zero_method = Some(Method::PunchHole.name().into());
    }
    r.zero.trim = known(st(Method::BlkDiscard));
}

/// Works or known to fail as a yes or no; anything else is not known.
fn known(s: State) -> Option<bool> {
    match s {
        State::Works => Some(true),
        State::Fails => Some(false),
        _ => None,
    }
}

fn state_in(methods: &[MethodReport], m: Method) -> State {
    methods
        .iter()
        .find(|x| x.method == m.name())
        .map(|x| x.state)
        .unwrap_or(State::Unknown)
}

/// The first method of `chain` that is not known to fail; certain when it is
/// known to work.
fn predict(chain: &[Method], st: &dyn Fn(Method) -> State) -> Choice {
    let mut it = chain
        .iter()
        .filter(|m| !matches!(st(**m), State::Fails | State::NotApplicable));
    match it.next() {
        Some(m) => {
            let certain = st(*m) == State::Works;
            Choice {
                method: m.name().into(),
                certain,
                otherwise: if certain {
                    None
                } else {
                    it.next().map(|n| n.name().to_string())
                },
            }
        }
        None => unknown_choice(),
    }
}

/// The engine's zero chain on a block device as far as its learned states
/// tell, without running it.
fn predict_block_chain(r: &mut ProbeReport) {
    let st = |m: Method| state_in(&r.methods, m);
    r.zero.with_trim = predict(
        &[
            Method::PunchHole,
            Method::ZeroRange,
            Method::BlkZeroout,
            Method::WriteZeros,
        ],
        &st,
    );
    r.zero.without_trim = predict(
        &[Method::ZeroRange, Method::BlkZeroout, Method::WriteZeros],
        &st,
    );
}

fn probe_device_destructive(path: &Path, r: &mut ProbeReport) -> Result<()> {
    let shown = path.display();
    r.tested_on = "device";
    r.direct_io = State::Works;
    r.direct_io_alignment = Some(r.logical_sector_size);
    if r.read_only {
        return Err(Error::msg(format!(
            "cannot probe '{shown}' destructively: the device is read-only"
        )));
    }
    // O_EXCL on a block device: refused (EBUSY) while it is mounted or held
    // by another exclusive user, so the probe never writes under a mounted
    // file system.
    let opts = OpenOptions {
        exclusive: true,
        ..Default::default()
    };
    let t = Target::open(path, &opts).map_err(|e| {
        Error::with(
            format!("cannot open '{shown}' exclusively (is it mounted or in use?)"),
            e.source,
        )
    })?;
    r.queue_limits = sysinfo::queue_limits(&t);
    let sector = u64::from(r.logical_sector_size.max(512));
    // One range per tried method, three for the engine's chain.
    let len = (MIB.min(r.size / 8) / sector) * sector;
    if len == 0 {
        return Err(Error::msg(format!(
            "cannot probe '{shown}' destructively: the device is too small ({} bytes)",
            r.size
        )));
    }
    let area = 6 * len;
    let mut saved = vec![0u8; area as usize];
    t.read_at(&mut saved, 0).map_err(|e| {
        Error::with(
            format!("cannot save the first {area} bytes of '{shown}'"),
            e.source,
        )
    })?;

    let mut methods = Vec::new();
    for (i, &m) in t.trial_methods().iter().enumerate() {
        let tried = t.try_method(m, i as u64 * len, len);
        let row = match m {
            Method::BlkDiscard => discard(tried),
            _ => zeroing(tried, false),
        };
        methods.push(mr(m, Kind::Block, row));
    }
    methods.extend(fixed_rows(Kind::Block));
    // A loop device over a file system without ZERO_RANGE (tmpfs) serves
    // PUNCH_HOLE (the driver punches the backing file) until a write-zeroes
    // without unmap fails underneath; then it turns write-zeroes off for
    // good. Report the device as it is now, and say what happened.
    let wz_before = r
        .queue_limits
        .as_ref()
        .and_then(|q| q.write_zeroes_max_bytes);
    let wz_now = sysinfo::queue_limits(&t).and_then(|q| q.write_zeroes_max_bytes);
    let kernel_writes = match (wz_before, wz_now) {
        (Some(b), Some(0)) if b > 0 => {
            let (s, d) = zeroing(t.try_method(Method::PunchHole, 0, len), false);
            if let Some(m) = methods
                .iter_mut()
                .find(|m| m.method == Method::PunchHole.name())
            {
                if s != State::Works {
                    m.state = s;
                    m.detail = format!(
                        "{d} now: worked at first, then the device turned write-zeroes off \
                         (write_zeroes_max_bytes {b} -> 0) when ZERO_RANGE failed in the \
                         storage underneath"
                    );
                }
            }
            true
        }
        (_, Some(0)) => true,
        _ => false,
    };
    if kernel_writes {
        for m in methods.iter_mut().filter(|m| {
            m.state == State::Works
                && (m.method == Method::ZeroRange.name() || m.method == Method::BlkZeroout.name())
        }) {
            m.detail = "reads back zeros, written by the kernel (no write-zeroes offload)".into();
        }
    }
    r.methods = methods;

    // The engine's chain on ranges 3..6 (1 MiB each, or `len` when smaller).
    if len == MIB {
        engine_zero_chain(&t, 3 * MIB, r);
    } else {
        predict_block_chain(r);
    }
    let after = sysinfo::queue_limits(&t);
    if after != r.queue_limits {
        r.queue_limits_after = after;
    }

    t.write_at(&saved, 0, false)
        .and_then(|()| t.flush())
        .map_err(|e| {
            Error::with(
                format!("could not restore the first {area} bytes of '{shown}' after probing"),
                e.source,
            )
        })?;
    Ok(())
}
