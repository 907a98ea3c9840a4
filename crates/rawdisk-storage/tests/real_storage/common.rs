//! Shared helpers of the real-storage tests: opening targets through a
//! recording / fault-injecting syscall layer, and what each storage kind is
//! expected to support (see docs/capabilities.md, the capability matrix).

use std::path::Path;
use std::sync::Arc;

use rawdisk_storage::fault::FaultSys;
use rawdisk_storage::sys::{CallKind, FallocMode, RealSys};
use rawdisk_storage::{Method, OpenOptions, Target, Tri, ZeroFlags};
use rawdisk_testkit::StorageKind;

pub const TRIM: ZeroFlags = ZeroFlags {
    may_trim: true,
    fast_only: false,
};
pub const NO_TRIM: ZeroFlags = ZeroFlags {
    may_trim: false,
    fast_only: false,
};

/// One syscall as the engine issued it (its range, whether it succeeded).
pub use rawdisk_storage::fault::Call;

/// The data-changing calls the [`FaultSys`] under a target logged, so tests
/// can check how a request was split: offsets advance, nothing overlaps,
/// every byte is covered, no call is over the size limit.
pub struct Recorder {
    fault: Arc<FaultSys>,
}

impl Recorder {
    /// The calls that change data since the last `take`.
    pub fn take(&self) -> Vec<Call> {
        self.fault
            .take_log()
            .into_iter()
            .filter(|c| {
                matches!(
                    c.kind,
                    CallKind::Pwrite
                        | CallKind::PwriteDsync
                        | CallKind::Fallocate(_)
                        | CallKind::BlkZeroout
                        | CallKind::BlkDiscard
                        | CallKind::Ftruncate
                )
            })
            .collect()
    }
}

/// A target opened through a recording FaultSys over the kernel.
pub struct Probe {
    pub target: Target,
    pub fault: Arc<FaultSys>,
    pub rec: Recorder,
}

pub fn open_probe(path: &Path) -> Probe {
    let fault = FaultSys::real();
    fault.record();
    let target = Target::open_with_sys(path, &OpenOptions::default(), fault.clone())
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let rec = Recorder {
        fault: fault.clone(),
    };
    Probe { target, fault, rec }
}

pub fn open(path: &Path) -> Target {
    Target::open_with_sys(path, &OpenOptions::default(), Arc::new(RealSys))
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

/// Fallocate calls of `mode` in either keep-size variant of ZERO_RANGE.
pub fn falloc_calls(fault: &FaultSys, mode: FallocMode) -> u64 {
    match mode {
        FallocMode::ZeroRange { .. } => {
            fault.calls(CallKind::Fallocate(FallocMode::ZeroRange {
                keep_size: true,
            })) + fault.calls(CallKind::Fallocate(FallocMode::ZeroRange {
                keep_size: false,
            }))
        }
        m => fault.calls(CallKind::Fallocate(m)),
    }
}

/// Both ZERO_RANGE call kinds (the engine may or may not add KEEP_SIZE).
pub const ZERO_RANGE_KINDS: [CallKind; 2] = [
    CallKind::Fallocate(FallocMode::ZeroRange { keep_size: true }),
    CallKind::Fallocate(FallocMode::ZeroRange { keep_size: false }),
];
pub const PUNCH: CallKind = CallKind::Fallocate(FallocMode::PunchHole);
pub const WRITE_ZEROES: CallKind = CallKind::Fallocate(FallocMode::WriteZeroes);

/// Make every call of `kinds` fail with `errno`.
pub fn fail_always(fault: &FaultSys, kinds: &[CallKind], errno: i32) {
    for k in kinds {
        fault.fail_from(*k, 1, errno);
    }
}

/// The method `zero` is expected to do the bulk of the work with on a fresh
/// target of this kind (baseline capability matrix). Block devices: PUNCH_HOLE
/// on a device is REQ_OP_WRITE_ZEROES with unmap and no fallback, and a loop
/// device turns it into PUNCH_HOLE on its backing file, which works on ext4
/// and on tmpfs alike; ZERO_RANGE on a device is write-zeroes with the kernel's
/// own fallback to writing zero pages, so it "works" everywhere.
pub fn expected_zero_method(kind: StorageKind, may_trim: bool) -> Method {
    use StorageKind::*;
    match (kind, may_trim) {
        // No fallocate at all (ramfs, the NFS 3 client).
        (Ramfs | Nfs3, _) => Method::WriteZeros,
        (Tmpfs | Ext4 | Xfs | Btrfs | Nfs42, true) => Method::PunchHole,
        // The NFS 4.2 client has ALLOCATE and DEALLOCATE, no ZERO_RANGE.
        (Nfs42, false) => Method::PunchAlloc,
        // Punch + fallocate(0) works on tmpfs but costs twice what writing
        // zeros does, so the engine writes.
        (Tmpfs, false) => Method::WriteZeros,
        (Ext4 | Xfs | Btrfs, false) => Method::ZeroRange,
        (Loop512 | Loop4k | LoopTmpfs, true) => Method::PunchHole,
        (Loop512 | Loop4k | LoopTmpfs, false) => Method::ZeroRange,
    }
}

/// Methods a zero call may legitimately use besides the expected one: the
/// hand-written unaligned head/tail on block devices.
pub fn allowed_extra(kind: StorageKind) -> &'static [Method] {
    if kind.is_block() {
        &[Method::WriteZeros]
    } else {
        &[]
    }
}

/// Alignment of the ranges the engine offloads (fallocate, BLKZEROOUT,
/// BLKDISCARD): 1 on files; on block devices the logical sector, but at least
/// a page: blkdev_fallocate drops the device's page cache over the range
/// before it tries the zero-out, zeroing the cached part of a partially
/// covered page, and when the zero-out then fails (a loop device that lost
/// write-zeroes) that page reads zeros the device never got. This suite's
/// fast_only test on a loop device on tmpfs caught it with a 512-byte-aligned
/// middle.
pub fn offload_align(kind: StorageKind) -> u64 {
    if kind.is_block() {
        (kind.sector_size() as u64).max(4096)
    } else {
        1
    }
}

/// Whether punching works and frees the allocation on this kind (for
/// trims and st_blocks checks). ramfs and the NFS 3 client cannot punch.
pub fn punch_frees(kind: StorageKind) -> bool {
    !matches!(kind, StorageKind::Ramfs | StorageKind::Nfs3)
}

/// Whether SEEK_HOLE reports every file as one data run here: ramfs, and
/// the NFS 3 client (no SEEK operation: the kernel answers from the size).
pub fn all_data(kind: StorageKind) -> bool {
    matches!(kind, StorageKind::Ramfs | StorageKind::Nfs3)
}

/// Asserts the state of `m` in the target's learned capabilities.
#[track_caller]
pub fn assert_tri(t: &Target, m: Method, want: Tri, what: &str) {
    let got = t.caps().get(m);
    assert_eq!(
        got,
        want,
        "{what}: {m} is {}, expected {}; caps {:?}",
        got.name(),
        want.name(),
        t.caps()
    );
}

/// Checks that the successful calls of `calls` of the given kinds tile
/// `[offset, offset+len)` exactly: no gap, no overlap (the write-zeros
/// fallback must advance its offset every chunk; nbdkit and nbd-server once
/// zeroed the first chunk over and over) and none is longer than `max`.
#[track_caller]
pub fn assert_tiles(calls: &[Call], kinds: &[CallKind], offset: u64, len: u64, max: u64) {
    let mut sel: Vec<&Call> = calls
        .iter()
        .filter(|c| c.ok && kinds.contains(&c.kind))
        .collect();
    sel.sort_by_key(|c| c.offset);
    let mut pos = offset;
    for (n, c) in sel.into_iter().enumerate() {
        assert_eq!(
            c.offset, pos,
            "call {n} ({:?} at {} len {}) does not continue at {pos}; calls {calls:?}",
            c.kind, c.offset, c.len
        );
        assert!(
            c.len > 0 && c.len <= max,
            "call {n} length {} not in 1..={max}",
            c.len
        );
        pos += c.len;
    }
    assert_eq!(
        pos,
        offset + len,
        "calls cover {offset}..{pos}, expected ..{}: {calls:?}",
        offset + len
    );
}

/// Errno of an engine error (panics when it carries none).
#[track_caller]
pub fn errno_of(e: &rawdisk_storage::Error) -> i32 {
    e.errno()
        .unwrap_or_else(|| panic!("error without errno: {e}"))
}
