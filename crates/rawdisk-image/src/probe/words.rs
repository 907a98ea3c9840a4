//! How the report words the engine's answers: errno names, the state and
//! detail of each kind of try, the call behind each method, and the rows
//! that are fixed by the kind of target.

use std::io;

use rawdisk_storage::{Kind, Method, Seen, Trial};

use super::{MethodReport, State};

/// The errno name for the report ("EOPNOTSUPP"), or the io::Error text.
pub(super) fn errno_name(e: &io::Error) -> String {
    let names: &[(i32, &str)] = &[
        (libc::EOPNOTSUPP, "EOPNOTSUPP"),
        (libc::ENOSYS, "ENOSYS"),
        (libc::ENOTTY, "ENOTTY"),
        (libc::ENODEV, "ENODEV"),
        (libc::EINVAL, "EINVAL"),
        (libc::EIO, "EIO"),
        (libc::ENOSPC, "ENOSPC"),
        (libc::EPERM, "EPERM"),
        (libc::EACCES, "EACCES"),
        (libc::EROFS, "EROFS"),
        (libc::EBADF, "EBADF"),
        (libc::EBUSY, "EBUSY"),
        (libc::ENXIO, "ENXIO"),
    ];
    match e.raw_os_error() {
        Some(n) => names
            .iter()
            .find(|(v, _)| *v == n)
            .map(|(_, s)| s.to_string())
            .unwrap_or_else(|| e.to_string()),
        None => e.to_string(),
    }
}

/// A try that did not work: "known to fail" when the engine learned the
/// method is missing, else unknown (a real error says nothing about support).
pub(super) fn not_working<T>(t: Trial<T>) -> (State, String) {
    match t {
        Trial::Works(_) => (State::Works, String::new()),
        Trial::Unsupported(e) => (State::Fails, errno_name(&e)),
        Trial::Failed(e) => (State::Unknown, format!("error {}", errno_name(&e))),
        Trial::NotTried(e) => (
            State::Unknown,
            format!("could not write test data: {}", errno_name(&e)),
        ),
    }
}

/// A zeroing try: whether the range read back as zeros and, with
/// `check_alloc`, whether the allocation was freed or kept.
pub(super) fn zeroing(t: Trial, check_alloc: bool) -> (State, String) {
    let seen = match t {
        Trial::Works(s) => s,
        t => return not_working(t),
    };
    match seen.reads_zero {
        Ok(true) => {}
        Ok(false) => {
            return (
                State::Fails,
                "succeeded but the range does not read back as zeros".into(),
            )
        }
        Err(e) => return (State::Unknown, format!("read back: {}", errno_name(&e))),
    }
    if !check_alloc {
        return (State::Works, "reads back zeros".into());
    }
    let (before, after) = seen.allocated;
    let detail = if after < before {
        "reads back zeros, frees allocation"
    } else {
        "reads back zeros, keeps allocation"
    };
    (State::Works, detail.into())
}

/// A discard: it works when the call does; whether the range then reads
/// zeros is the device's business.
pub(super) fn discard(t: Trial) -> (State, String) {
    match t {
        Trial::Works(Seen {
            reads_zero: Ok(true),
            ..
        }) => (State::Works, "discarded range reads back zeros".into()),
        Trial::Works(Seen {
            reads_zero: Ok(false),
            ..
        }) => (
            State::Works,
            "works, but the discarded range still reads data".into(),
        ),
        Trial::Works(Seen {
            reads_zero: Err(e), ..
        }) => (State::Works, format!("read back: {}", errno_name(&e))),
        Trial::NotTried(e) => (State::Unknown, format!("error {}", errno_name(&e))),
        t => not_working(t),
    }
}

/// The call behind a method, as the report names it.
pub(super) fn call_of(m: Method, kind: Kind) -> &'static str {
    match (m, kind) {
        (Method::PunchHole, Kind::Block) => {
            "fallocate(PUNCH_HOLE|KEEP_SIZE) = write-zeroes with unmap, no fallback"
        }
        (Method::PunchHole, Kind::File) => "fallocate(PUNCH_HOLE|KEEP_SIZE)",
        (Method::FallocWriteZeroes, _) => "fallocate(WRITE_ZEROES)",
        (Method::ZeroRange, Kind::Block) => "fallocate(ZERO_RANGE) = write-zeroes, kernel fallback",
        (Method::ZeroRange, Kind::File) => "fallocate(ZERO_RANGE)",
        (Method::PunchAlloc, _) => "fallocate(PUNCH_HOLE) + fallocate(0)",
        (Method::Fallocate, _) => "fallocate(0)",
        (Method::BlkZeroout, _) => "ioctl(BLKZEROOUT)",
        (Method::BlkDiscard, _) => "ioctl(BLKDISCARD)",
        (Method::SeekHole, _) => "lseek(SEEK_DATA/SEEK_HOLE)",
        (Method::WriteZeros, _) => "pwrite of zeros",
        (Method::Splice, _) => "splice(2)",
        (Method::MapWrite, _) => "mmap + MADV_POPULATE_WRITE",
    }
}

pub(super) fn mr(m: Method, kind: Kind, (state, detail): (State, String)) -> MethodReport {
    MethodReport {
        method: m.name(),
        call: call_of(m, kind),
        state,
        detail,
    }
}

/// The rows whose answer is fixed by the kind of target: the other kind's
/// methods, no allocation or holes on a block device, and writing zeros,
/// which always works.
pub(super) fn fixed_rows(kind: Kind) -> Vec<MethodReport> {
    let na = |why: &str| (State::NotApplicable, why.to_string());
    let mut v = match kind {
        Kind::File => vec![
            mr(Method::BlkZeroout, kind, na("block devices only")),
            mr(Method::BlkDiscard, kind, na("block devices only")),
        ],
        Kind::Block => vec![
            mr(
                Method::FallocWriteZeroes,
                kind,
                na("not used on block devices: a write-zeroes that may unmap, with a kernel fallback"),
            ),
            mr(Method::PunchAlloc, kind, na("regular files only")),
            mr(
                Method::Fallocate,
                kind,
                na("a block device is allocated already"),
            ),
            mr(
                Method::SeekHole,
                kind,
                na("a block device maps as all data"),
            ),
        ],
    };
    v.push(mr(
        Method::WriteZeros,
        kind,
        (State::Works, "always (the last resort)".into()),
    ));
    v
}

/// The file rows when no scratch file could be used.
pub(super) fn file_methods_unknown(why: &str) -> Vec<MethodReport> {
    let mut v: Vec<MethodReport> = [
        Method::PunchHole,
        Method::FallocWriteZeroes,
        Method::ZeroRange,
        Method::PunchAlloc,
        Method::SeekHole,
        Method::Fallocate,
    ]
    .into_iter()
    .map(|m| mr(m, Kind::File, (State::Unknown, why.to_string())))
    .collect();
    v.extend(fixed_rows(Kind::File));
    v
}
