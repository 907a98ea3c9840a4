//! fallocate(WRITE_ZEROES) in the zero chain: a no-trim zero on a regular
//! file tries it before ZERO_RANGE; "not supported" falls through and is
//! learned once for every handle on the target; EIO is returned (see
//! faults.rs, `hard_error`). The storage here answers EOPNOTSUPP, so the
//! success path runs with the call served by ZERO_RANGE underneath
//! (`FaultSys::stand_in`), and a per-kind test checks what the real call
//! does, whichever answer the kernel gives.

use std::os::fd::AsFd;

use rawdisk_storage::sys::{FallocMode, RealSys, Sys};
use rawdisk_storage::{Method, Tri, ZeroFlags};
use rawdisk_testkit::{
    allocated_bytes, assert_same, pattern_vec, read_all, write_pattern, Scratch, StorageKind, MIB,
};

use crate::common::*;
use crate::per_kind;

const SIZE: u64 = 8 * MIB;

const FAST_NO_TRIM: ZeroFlags = ZeroFlags {
    may_trim: false,
    fast_only: true,
};

/// Serve WRITE_ZEROES by ZERO_RANGE underneath: the same range reads zeros
/// and stays allocated, as a device that zeroes by unmapping would leave it.
pub fn emulate_write_zeroes(p: &Probe) {
    p.fault.stand_in(
        FallocMode::WriteZeroes,
        FallocMode::ZeroRange { keep_size: true },
    );
}

/// The one data-changing call a zero of [off, off+len) made when
/// WRITE_ZEROES did it all.
fn only_write_zeroes(calls: &[Call], off: u64, len: u64, what: &str) {
    assert_eq!(
        calls,
        &[Call {
            kind: WRITE_ZEROES,
            offset: off,
            len,
            ok: true,
        }],
        "{what}"
    );
}

fn file_used_when_it_works(kind: StorageKind) {
    let s = Scratch::new(kind, SIZE);
    let path = s.path().to_owned();
    let p = open_probe(&path);
    emulate_write_zeroes(&p);
    let t = &p.target;
    write_pattern(&path, 0, SIZE, 21);
    let mut want = pattern_vec(21, 0, SIZE as usize);
    let before = allocated_bytes(&path);
    p.rec.take();

    let (off, len) = (MIB + 4096, 2 * MIB);
    let out = t.zero(off, len, NO_TRIM).unwrap();
    assert_eq!(out.methods, vec![Method::FallocWriteZeroes], "{kind}");
    only_write_zeroes(&p.rec.take(), off, len, &format!("{kind} no trim"));
    assert_tri(t, Method::FallocWriteZeroes, Tri::Works, "after success");
    assert_tri(t, Method::ZeroRange, Tri::Unknown, "never reached");
    want[off as usize..(off + len) as usize].fill(0);
    assert_same(&format!("{kind} no trim"), 0, &read_all(&path), &want);
    assert!(
        allocated_bytes(&path) >= before,
        "{kind}: a no-trim zero freed space"
    );

    // A fast zero may use it: it never falls back to writing.
    assert!(t.can_fast_zero());
    let (off, len) = (4 * MIB, MIB);
    let out = t.zero(off, len, FAST_NO_TRIM).unwrap();
    assert_eq!(out.methods, vec![Method::FallocWriteZeroes], "{kind} fast");
    only_write_zeroes(&p.rec.take(), off, len, &format!("{kind} fast"));
    want[off as usize..(off + len) as usize].fill(0);

    // Trim allowed: punching still comes first.
    let (off, len) = (6 * MIB, MIB);
    let out = t.zero(off, len, TRIM).unwrap();
    assert_eq!(out.methods, vec![Method::PunchHole], "{kind} trim");
    let calls = p.rec.take();
    assert!(
        calls.iter().all(|c| c.kind == PUNCH && c.ok),
        "{kind} trim: {calls:?}"
    );
    want[off as usize..(off + len) as usize].fill(0);
    assert_same(&format!("{kind} at the end"), 0, &read_all(&path), &want);
}

#[test]
#[ignore = "needs root"]
fn used_before_zero_range_ext4() {
    file_used_when_it_works(StorageKind::Ext4);
}

#[test]
#[ignore = "needs root"]
fn used_before_zero_range_xfs() {
    file_used_when_it_works(StorageKind::Xfs);
}

/// EOPNOTSUPP: the same zero goes on with ZERO_RANGE, and neither this
/// handle nor a second one opened on the same file tries it again.
#[test]
#[ignore = "needs root"]
fn unsupported_falls_through_once_for_every_handle() {
    let s = Scratch::new(StorageKind::Ext4, SIZE);
    let path = s.path().to_owned();
    let p = open_probe(&path);
    fail_always(&p.fault, &[WRITE_ZEROES], libc::EOPNOTSUPP);
    write_pattern(&path, 0, SIZE, 22);
    let mut want = pattern_vec(22, 0, SIZE as usize);
    p.rec.take();

    let (off, len) = (MIB + 512, 2 * MIB);
    let out = p.target.zero(off, len, NO_TRIM).unwrap();
    assert_eq!(out.methods, vec![Method::ZeroRange]);
    let calls = p.rec.take();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(
        (calls[0].kind, calls[0].offset, calls[0].len, calls[0].ok),
        (WRITE_ZEROES, off, len, false)
    );
    assert!(
        ZERO_RANGE_KINDS.contains(&calls[1].kind) && calls[1].ok,
        "{calls:?}"
    );
    assert_tri(&p.target, Method::FallocWriteZeroes, Tri::Fails, "learned");
    want[off as usize..(off + len) as usize].fill(0);
    assert_same("first zero", 0, &read_all(&path), &want);

    // Learned: not called again on this handle...
    let out = p.target.zero(4 * MIB, MIB, FAST_NO_TRIM).unwrap();
    assert_eq!(out.methods, vec![Method::ZeroRange]);
    assert_eq!(p.fault.calls(WRITE_ZEROES), 1);
    want[4 * MIB as usize..5 * MIB as usize].fill(0);

    // ...nor on a second handle of the same file, which never sees the
    // injected error: the capabilities are shared.
    let q = open_probe(&path);
    assert_tri(&q.target, Method::FallocWriteZeroes, Tri::Fails, "2nd open");
    let out = q.target.zero(6 * MIB, MIB, NO_TRIM).unwrap();
    assert_eq!(out.methods, vec![Method::ZeroRange]);
    assert_eq!(q.fault.calls(WRITE_ZEROES), 0, "second handle tried it");
    assert_eq!(p.fault.calls(WRITE_ZEROES), 1);
    want[6 * MIB as usize..7 * MIB as usize].fill(0);
    assert_same("after both handles", 0, &read_all(&path), &want);
}

/// The real call, no injection: on files the chain asks the kernel first
/// for a no-trim zero and learns what it answers (compared with the same
/// call made directly); block devices never issue it. Either way the range
/// reads zeros and nothing around it changes.
fn real_call(kind: StorageKind) {
    let s = Scratch::new(kind, SIZE);
    let path = s.path().to_owned();
    let p = open_probe(&path);
    let t = &p.target;
    write_pattern(&path, 0, SIZE, 23);
    let mut want = pattern_vec(23, 0, SIZE as usize);
    let before = allocated_bytes(&path);
    p.rec.take();
    let (off, len) = (MIB, 2 * MIB);
    let out = t.zero(off, len, NO_TRIM).unwrap();
    let calls = p.rec.take();
    want[off as usize..(off + len) as usize].fill(0);
    assert_same(&format!("{kind}"), 0, &read_all(&path), &want);

    if kind.is_block() {
        assert!(
            !calls.iter().any(|c| c.kind == WRITE_ZEROES),
            "{kind}: {calls:?}"
        );
        assert_tri(t, Method::FallocWriteZeroes, Tri::Unknown, "block device");
        return;
    }
    let first = calls.first().expect("no call");
    assert_eq!(
        (first.kind, first.offset, first.len),
        (WRITE_ZEROES, off, len),
        "{kind}: {calls:?}"
    );
    // The kernel's own answer for the same call on the same file (the
    // range already reads zeros, so it changes nothing that is checked).
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let kernel = RealSys.fallocate(f.as_fd(), FallocMode::WriteZeroes, off, len);
    match kernel {
        Ok(()) => {
            assert!(first.ok, "{kind}: {calls:?}");
            assert_eq!(out.methods, vec![Method::FallocWriteZeroes]);
            assert_tri(t, Method::FallocWriteZeroes, Tri::Works, "kernel has it");
            assert!(allocated_bytes(&path) >= before, "{kind}: space freed");
        }
        Err(e) => {
            assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP), "{kind}: {e}");
            assert!(!first.ok, "{kind}: {calls:?}");
            assert!(!out.methods.contains(&Method::FallocWriteZeroes));
            assert_tri(t, Method::FallocWriteZeroes, Tri::Fails, "kernel lacks it");
        }
    }
    assert_same(&format!("{kind} at the end"), 0, &read_all(&path), &want);
}
per_kind!(real_call);
