//! Copy offload (`Target::copy_from`) on real file systems: XFS with reflink
//! shares the aligned blocks and copies the unaligned head and tail with
//! copy_file_range; XFS without reflink and ext4 copy with copy_file_range;
//! tmpfs -> ext4 offloads nothing (EXDEV). Injected EOPNOTSUPP / EXDEV fall
//! through and are learned once per pair of file systems; an injected EIO
//! is returned, teaches nothing and moves nothing further. Every byte of the
//! destination is compared, inside and around the range.

use std::path::Path;
use std::sync::Arc;

use rawdisk_storage::fault::FaultSys;
use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{CopyMethod, CopyOffload, OpenOptions, Target, Tri};
use rawdisk_testkit::{assert_same, pattern_vec, read_all, shared_bytes, write_pattern, Fs, MIB};

use crate::common::open;

const SIZE: u64 = 8 * MIB;
const BOTH: CopyOffload = CopyOffload {
    reflink: true,
    copy_range: true,
};

/// Source patterned with seed 1, destination with seed 2, both SIZE bytes.
fn pair(src_fs: &Fs, dst_fs: &Fs) -> (std::path::PathBuf, std::path::PathBuf) {
    let (s, d) = (src_fs.path("src.img"), dst_fs.path("dst.img"));
    for (p, seed) in [(&s, 1), (&d, 2)] {
        std::fs::File::create(p).unwrap().set_len(SIZE).unwrap();
        write_pattern(p, 0, SIZE, seed);
    }
    (s, d)
}

fn open_rw(path: &Path, fault: &Arc<FaultSys>) -> Target {
    Target::open_with_sys(path, &OpenOptions::default(), fault.clone()).unwrap()
}

/// The destination holds the source's bytes in [off, off+len) and its own
/// pattern everywhere else.
#[track_caller]
fn check(dst: &Path, off: u64, len: u64, what: &str) {
    let mut want = pattern_vec(2, 0, SIZE as usize);
    let r = off as usize..(off + len) as usize;
    want[r.clone()].copy_from_slice(&pattern_vec(1, off, len as usize));
    assert_same(what, 0, &read_all(dst), &want);
}

// Head and tail inside a block: the middle is shared, the ends copied.
const OFF: u64 = MIB + 1000;
const LEN: u64 = 3 * MIB + 5000;

#[test]
#[ignore = "needs root"]
fn xfs_reflink_shares_the_aligned_part() {
    let fs = Fs::xfs(0);
    let (s, d) = pair(&fs, &fs);
    let (src, dst) = (open(&s), open(&d));
    let r = dst.copy_from(&src, OFF, LEN, BOTH).unwrap();
    let (a0, a1) = (OFF.div_ceil(4096) * 4096, (OFF + LEN) / 4096 * 4096);
    assert_eq!(r.reflinked, a1 - a0, "{r:?}");
    assert_eq!(r.copied, LEN - (a1 - a0), "head and tail: {r:?}");
    assert!(r.rest.is_empty(), "{r:?}");
    drop((src, dst));
    check(&d, OFF, LEN, "xfs reflink");
    let shared = shared_bytes(&d);
    assert!(
        shared >= a1 - a0 && shared <= a1 - a0 + 8192,
        "shared {shared}"
    );
    // Only the reflink is allowed: the ends are left to the caller.
    let (src, dst) = (open(&s), open(&d));
    let r = dst
        .copy_from(
            &src,
            0,
            4096 + 10,
            CopyOffload {
                reflink: true,
                copy_range: false,
            },
        )
        .unwrap();
    assert_eq!((r.reflinked, r.copied, r.rest), (4096, 0, vec![(4096, 10)]));
}

#[test]
#[ignore = "needs root"]
fn xfs_without_reflink_and_ext4_use_copy_file_range() {
    for fs in [Fs::xfs_with(0, &["-m", "reflink=0"]), Fs::ext4(64 * MIB)] {
        let what = fs.kind().name();
        let (s, d) = pair(&fs, &fs);
        let (src, dst) = (open(&s), open(&d));
        let r = dst.copy_from(&src, OFF, LEN, BOTH).unwrap();
        assert_eq!((r.reflinked, r.copied), (0, LEN), "{what}: {r:?}");
        assert!(r.rest.is_empty(), "{what}: {r:?}");
        let caps = dst.copy_caps(&src).unwrap();
        assert_eq!(caps.get(CopyMethod::Reflink), Tri::Fails, "{what}");
        assert_eq!(caps.get(CopyMethod::CopyRange), Tri::Works, "{what}");
        drop((src, dst, caps));
        check(&d, OFF, LEN, what);
        assert_eq!(shared_bytes(&d), 0, "{what}: nothing may be shared");
    }
}

#[test]
#[ignore = "needs root"]
fn tmpfs_to_ext4_offloads_nothing() {
    let (t, e) = (Fs::tmpfs(64 * MIB), Fs::ext4(64 * MIB));
    let (s, d) = pair(&t, &e);
    let fault = FaultSys::real();
    let (src, dst) = (open(&s), open_rw(&d, &fault));
    for _ in 0..3 {
        let r = dst.copy_from(&src, OFF, LEN, BOTH).unwrap();
        assert_eq!((r.reflinked, r.copied), (0, 0), "{r:?}");
        assert_eq!(r.rest, vec![(OFF, LEN)]);
    }
    // Learned from the first call of each, never tried again.
    assert_eq!(fault.calls(CallKind::CloneRange), 1);
    assert_eq!(fault.calls(CallKind::CopyFileRange), 1);
    drop((src, dst));
    check(&d, 0, 0, "tmpfs -> ext4: destination untouched");
}

#[test]
#[ignore = "needs root"]
fn injected_unsupported_falls_through_once_per_pair() {
    let fs = Fs::xfs(0);
    for errno in [libc::EOPNOTSUPP, libc::EXDEV, libc::EINVAL] {
        let (s, d) = pair(&fs, &fs);
        let fault = FaultSys::real();
        fault.fail_from(CallKind::CloneRange, 1, errno);
        let (src, dst) = (open(&s), open_rw(&d, &fault));
        let r = dst.copy_from(&src, OFF, LEN, BOTH).unwrap();
        assert_eq!((r.reflinked, r.copied), (0, LEN), "errno {errno}: {r:?}");
        // A second target on the same files shares what was learned.
        let dst2 = open_rw(&d, &fault);
        let r = dst2.copy_from(&src, 0, MIB, BOTH).unwrap();
        assert_eq!((r.reflinked, r.copied), (0, MIB), "errno {errno}");
        assert_eq!(fault.calls(CallKind::CloneRange), 1, "errno {errno}");
        // Now copy_file_range too: everything is left to the caller.
        fault.fail_from(CallKind::CopyFileRange, 1, errno);
        let r = dst2.copy_from(&src, 2 * MIB, MIB, BOTH).unwrap();
        assert_eq!(r.rest, vec![(2 * MIB, MIB)], "errno {errno}");
        let r = dst2.copy_from(&src, 5 * MIB, MIB, BOTH).unwrap();
        assert_eq!(r.rest, vec![(5 * MIB, MIB)], "errno {errno}");
        assert_eq!(fault.calls(CallKind::CopyFileRange), 3, "errno {errno}");
        drop((src, dst, dst2));
        let mut want = pattern_vec(2, 0, SIZE as usize);
        for (o, l) in [(OFF, LEN), (0, MIB)] {
            want[o as usize..(o + l) as usize].copy_from_slice(&pattern_vec(1, o, l as usize));
        }
        assert_same(&format!("errno {errno}"), 0, &read_all(&d), &want);
        std::fs::remove_file(&s).unwrap();
        std::fs::remove_file(&d).unwrap();
    }
}

#[test]
#[ignore = "needs root"]
fn injected_eio_is_returned_and_teaches_nothing() {
    let fs = Fs::xfs(0);
    for kind in [CallKind::CloneRange, CallKind::CopyFileRange] {
        let (s, d) = pair(&fs, &fs);
        let fault = FaultSys::real();
        fault.fail_from(kind, 1, libc::EIO);
        let (src, dst) = (open(&s), open_rw(&d, &fault));
        // copy_file_range alone for its own case.
        let allow = CopyOffload {
            reflink: kind == CallKind::CloneRange,
            copy_range: true,
        };
        let e = dst.copy_from(&src, OFF, LEN, allow).unwrap_err();
        let msg = e.to_string();
        assert_eq!(e.errno(), Some(libc::EIO), "{msg}");
        let call = if kind == CallKind::CloneRange {
            "FICLONERANGE"
        } else {
            "copy_file_range"
        };
        assert!(msg.contains(call) && msg.contains("offset"), "{msg}");
        let caps = dst.copy_caps(&src).unwrap();
        assert_eq!(caps.get(CopyMethod::Reflink), Tri::Unknown, "{kind:?}");
        assert_eq!(caps.get(CopyMethod::CopyRange), Tri::Unknown, "{kind:?}");
        if kind == CallKind::CloneRange {
            assert_eq!(fault.calls(CallKind::CopyFileRange), 0, "EIO fell through");
        }
        drop((src, dst, caps));
        check(&d, 0, 0, &format!("{kind:?} EIO: destination untouched"));
        std::fs::remove_file(&s).unwrap();
        std::fs::remove_file(&d).unwrap();
    }
}
