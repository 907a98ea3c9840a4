//! Fault injection through `FaultSys` on real storage: a "not supported"
//! errno on method k falls through to k+1 and is remembered; EIO and ENOSPC
//! are returned without falling through and without learning; fast_only with
//! only slow methods left fails with ENOTSUP and changes nothing.

use rawdisk_storage::sys::{CallKind, FallocMode};
use rawdisk_storage::{Method, Tri, ZeroFlags};
use rawdisk_testkit::{
    assert_same, pattern_vec, read_all, write_pattern, Scratch, StorageKind, MIB,
};

use crate::common::*;
use crate::write_zeroes::emulate_write_zeroes;
use crate::zero::{assert_failed_methods_not_retried, method_call_kinds};

const SIZE: u64 = 8 * MIB;

/// The syscall kinds to fail so that `m` fails (and nothing else does).
fn kinds_failing(m: Method) -> Vec<CallKind> {
    match m {
        Method::PunchAlloc => vec![
            CallKind::Fallocate(FallocMode::Allocate),
            CallKind::Fallocate(FallocMode::AllocateKeepSize),
        ],
        m => method_call_kinds(m),
    }
}

/// For each k, "not supported" on methods 0..=k of the chain: the zero
/// succeeds with method k+1, methods 0..=k are learned as failing and never
/// called again, the data reads zero and the surroundings are unchanged.
fn fall_through(chain: &[Method], flags: ZeroFlags, storage: impl Fn() -> Scratch, errno: i32) {
    for k in 0..chain.len() - 1 {
        let s = storage();
        let path = s.path().to_owned();
        let kind = s.kind();
        let what = format!(
            "{kind} {flags:?} errno {errno}: {:?} unsupported",
            &chain[..=k]
        );
        let p = open_probe(&path);
        for m in &chain[..=k] {
            fail_always(&p.fault, &kinds_failing(*m), errno);
        }
        write_pattern(&path, 0, SIZE, 1);
        let (off, len) = (MIB + 4096, 2 * MIB);
        let out = p
            .target
            .zero(off, len, flags)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(
            out.methods.contains(&chain[k + 1]),
            "{what}: expected {}, used {:?}",
            chain[k + 1],
            out.methods
        );
        for m in &chain[..=k] {
            assert_tri(&p.target, *m, Tri::Fails, &what);
        }
        let mut want = pattern_vec(1, 0, SIZE as usize);
        want[off as usize..(off + len) as usize].fill(0);
        assert_same(&what, 0, &read_all(&path), &want);
        assert_failed_methods_not_retried(&p, &what, |t| {
            let out = t.zero(4 * MIB, MIB, flags).unwrap();
            assert!(
                out.methods.contains(&chain[k + 1]),
                "{what}: second zero {out:?}"
            );
        });
        want[4 * MIB as usize..5 * MIB as usize].fill(0);
        assert_same(&what, 0, &read_all(&path), &want);
    }
}

fn ext4_file() -> Scratch {
    Scratch::new(StorageKind::Ext4, SIZE)
}
fn loop512() -> Scratch {
    Scratch::new(StorageKind::Loop512, SIZE)
}

#[test]
#[ignore = "needs root"]
fn file_chain_may_trim() {
    // Punch + allocate needs the punch: once PUNCH_HOLE is known to fail it
    // is skipped, so with may_trim the chain is punch, zero range, write.
    let chain = [Method::PunchHole, Method::ZeroRange, Method::WriteZeros];
    fall_through(&chain, TRIM, ext4_file, libc::EOPNOTSUPP);
    // ZERO_RANGE unsupported does not matter while the punch works.
    let s = ext4_file();
    let p = open_probe(s.path());
    fail_always(&p.fault, &ZERO_RANGE_KINDS, libc::EOPNOTSUPP);
    write_pattern(s.path(), 0, SIZE, 3);
    let out = p.target.zero(MIB, MIB, TRIM).unwrap();
    assert_eq!(out.methods, vec![Method::PunchHole]);
    assert_eq!(
        falloc_calls(&p.fault, FallocMode::ZeroRange { keep_size: true }),
        0
    );
    // Without may_trim the punch is still usable as half of punch + allocate.
    let out = p.target.zero(3 * MIB, MIB, NO_TRIM).unwrap();
    assert_eq!(out.methods, vec![Method::PunchAlloc]);
    assert_tri(&p.target, Method::ZeroRange, Tri::Fails, "ext4");
    let mut want = pattern_vec(3, 0, SIZE as usize);
    want[MIB as usize..2 * MIB as usize].fill(0);
    want[3 * MIB as usize..4 * MIB as usize].fill(0);
    assert_same("ext4", 0, &read_all(s.path()), &want);
}

#[test]
#[ignore = "needs root"]
fn file_chain_no_trim() {
    let chain = [
        Method::FallocWriteZeroes,
        Method::ZeroRange,
        Method::PunchAlloc,
        Method::WriteZeros,
    ];
    fall_through(&chain, NO_TRIM, ext4_file, libc::EOPNOTSUPP);
    // ENOSYS and ENOTTY (old kernels) are "not supported" too.
    fall_through(&chain[..3], NO_TRIM, ext4_file, libc::ENOSYS);
}

#[test]
#[ignore = "needs root"]
fn block_chain_may_trim() {
    let chain = [
        Method::PunchHole,
        Method::ZeroRange,
        Method::BlkZeroout,
        Method::WriteZeros,
    ];
    fall_through(&chain, TRIM, loop512, libc::EOPNOTSUPP);
}

#[test]
#[ignore = "needs root"]
fn block_chain_no_trim() {
    let chain = [Method::ZeroRange, Method::BlkZeroout, Method::WriteZeros];
    fall_through(&chain, NO_TRIM, loop512, libc::EOPNOTSUPP);
    fall_through(&chain[..2], NO_TRIM, loop512, libc::ENOTTY);
    // fallocate on a block device before Linux 4.9: ENODEV.
    fall_through(&chain[..2], NO_TRIM, loop512, libc::ENODEV);
}

/// EINVAL means "bad arguments" for fallocate: returned, never learned. Only
/// lseek(SEEK_DATA) documents EINVAL as "not supported" (block devices,
/// kernels before 3.1), and there it is learned.
#[test]
#[ignore = "needs root"]
fn einval_learned_only_for_seek() {
    let s = ext4_file();
    let p = open_probe(s.path());
    write_pattern(s.path(), 0, SIZE, 13);
    for k in ZERO_RANGE_KINDS {
        p.fault.fail_once(k, 1, libc::EINVAL);
    }
    let e = p.target.zero(MIB, MIB, NO_TRIM).expect_err("EINVAL");
    assert_eq!(errno_of(&e), libc::EINVAL);
    assert_eq!(p.target.caps().get(Method::ZeroRange), Tri::Unknown);
    assert_same(
        "ext4",
        0,
        &read_all(s.path()),
        &pattern_vec(13, 0, SIZE as usize),
    );
    p.fault.fail_from(CallKind::SeekData, 1, libc::EINVAL);
    let ex = p.target.extents(0, SIZE, 16).unwrap();
    assert_eq!(ex.len(), 1, "{ex:?}");
    assert_tri(&p.target, Method::SeekHole, Tri::Fails, "ext4");
}

/// A real error on the first method of the chain still worth trying (the
/// methods of `missing` before it are learned unsupported first): returned
/// as is (operation, range and errno), nothing else tried, nothing learned,
/// data unchanged; the next call works with the same method. WRITE_ZEROES,
/// which the storage here lacks, is served by ZERO_RANGE underneath.
fn hard_error(
    storage: fn() -> Scratch,
    flags: ZeroFlags,
    errno: i32,
    first: Method,
    missing: &[Method],
) {
    let s = storage();
    let path = s.path().to_owned();
    let what = format!("{} {flags:?} errno {errno} on {first}", s.kind());
    let p = open_probe(&path);
    emulate_write_zeroes(&p);
    for m in missing {
        fail_always(&p.fault, &kinds_failing(*m), libc::EOPNOTSUPP);
    }
    p.target.zero(0, MIB, flags).unwrap();
    for m in missing {
        assert_tri(&p.target, *m, Tri::Fails, &what);
    }
    for k in kinds_failing(first) {
        p.fault.fail_once(k, p.fault.calls(k) + 1, errno);
    }
    write_pattern(&path, 0, SIZE, 2);
    let before = p.target.caps().snapshot();
    p.rec.take();
    let (off, len) = (2 * MIB, 3 * MIB);
    let e = p
        .target
        .zero(off, len, flags)
        .expect_err(&format!("{what}: zero should fail"));
    assert_eq!(errno_of(&e), errno, "{what}: {e}");
    let msg = e.to_string();
    assert!(
        msg.contains(&off.to_string()) && msg.contains(&len.to_string()),
        "{what}: error should name the range: {msg}"
    );
    let calls = p.rec.take();
    assert!(
        calls.iter().all(|c| !c.ok),
        "{what}: after a hard error nothing else may run: {calls:?}"
    );
    assert_eq!(calls.len(), 1, "{what}: exactly one failed call: {calls:?}");
    let after = p.target.caps().snapshot();
    for (m, tri, _) in &after.methods {
        assert_eq!(
            *tri,
            before.get(*m),
            "{what}: {m} changed from {} on a hard error",
            before.get(*m).name()
        );
    }
    assert_same(
        &what,
        0,
        &read_all(&path),
        &pattern_vec(2, 0, SIZE as usize),
    );

    // Works afterwards, with the same method, which is now known to work.
    let out = p.target.zero(off, len, flags).unwrap();
    assert!(
        out.methods.contains(&first),
        "{what}: retry used {:?}",
        out.methods
    );
    assert_tri(&p.target, first, Tri::Works, &what);
    // And a hard error on a method known to work does not unlearn it.
    for k in kinds_failing(first) {
        p.fault.fail_once(k, p.fault.calls(k) + 1, errno);
    }
    let e = p
        .target
        .zero(off, len, flags)
        .expect_err("second injected error");
    assert_eq!(errno_of(&e), errno);
    assert_tri(&p.target, first, Tri::Works, &what);
}

#[test]
#[ignore = "needs root"]
fn eio_and_enospc_are_returned_not_learned() {
    let wz = [Method::FallocWriteZeroes];
    for errno in [libc::EIO, libc::ENOSPC] {
        hard_error(ext4_file, TRIM, errno, Method::PunchHole, &[]);
        hard_error(ext4_file, NO_TRIM, errno, Method::FallocWriteZeroes, &[]);
        hard_error(ext4_file, NO_TRIM, errno, Method::ZeroRange, &wz);
        hard_error(loop512, TRIM, errno, Method::PunchHole, &[]);
        hard_error(loop512, NO_TRIM, errno, Method::ZeroRange, &[]);
    }
    // EPERM (e.g. an immutable or append-only file) is not "unsupported" either.
    hard_error(
        ext4_file,
        NO_TRIM,
        libc::EPERM,
        Method::FallocWriteZeroes,
        &[],
    );
    hard_error(ext4_file, NO_TRIM, libc::EPERM, Method::ZeroRange, &wz);
}

/// A hard error in the middle of the write-zeros fallback is returned.
#[test]
#[ignore = "needs root"]
fn eio_while_writing_zeros() {
    let s = Scratch::new(StorageKind::Ramfs, SIZE);
    let p = open_probe(s.path());
    p.fault.set_max_io(MIB as usize / 4);
    p.fault.fail_once(CallKind::Pwrite, 3, libc::EIO);
    let e = p
        .target
        .zero(0, 4 * MIB, NO_TRIM)
        .expect_err("EIO on the 3rd write");
    assert_eq!(errno_of(&e), libc::EIO, "{e}");
    assert_ne!(p.target.caps().get(Method::WriteZeros), Tri::Fails);
    assert_eq!(
        p.fault.calls(CallKind::Pwrite),
        3,
        "stopped at the failing write"
    );
}

/// fast_only when only slow methods are left: ENOTSUP at once, data unchanged,
/// nothing written.
fn fast_only_refused(s: &Scratch, p: &Probe, flags: ZeroFlags, seed: u64) {
    let what = format!("{} fast_only {flags:?}", s.kind());
    let path = s.path();
    write_pattern(path, 0, s.size(), seed);
    p.rec.take();
    let e = p
        .target
        .zero(
            MIB + 1,
            2 * MIB,
            ZeroFlags {
                fast_only: true,
                ..flags
            },
        )
        .expect_err(&format!("{what}: should refuse"));
    assert_eq!(errno_of(&e), libc::EOPNOTSUPP, "{what}: {e}");
    let calls = p.rec.take();
    assert!(
        calls.iter().all(|c| !c.ok),
        "{what}: nothing may change: {calls:?}"
    );
    assert!(
        !calls
            .iter()
            .any(|c| matches!(c.kind, CallKind::Pwrite | CallKind::PwriteDsync)),
        "{what}: wrote: {calls:?}"
    );
    assert_same(
        &what,
        0,
        &read_all(path),
        &pattern_vec(seed, 0, s.size() as usize),
    );
    assert!(
        !p.target.can_fast_zero(),
        "{what}: can_fast_zero after a refusal"
    );
}

#[test]
#[ignore = "needs root"]
fn fast_only_ramfs() {
    let s = Scratch::new(StorageKind::Ramfs, SIZE);
    let p = open_probe(s.path());
    fast_only_refused(&s, &p, NO_TRIM, 3);
    fast_only_refused(&s, &p, TRIM, 4);
    // A slow zero still works afterwards.
    p.target.zero(0, MIB, NO_TRIM).unwrap();
}

#[test]
#[ignore = "needs root"]
fn fast_only_file_without_fallocate() {
    let s = ext4_file();
    let p = open_probe(s.path());
    fail_always(
        &p.fault,
        &[
            PUNCH,
            ZERO_RANGE_KINDS[0],
            ZERO_RANGE_KINDS[1],
            CallKind::Fallocate(FallocMode::Allocate),
            CallKind::Fallocate(FallocMode::AllocateKeepSize),
        ],
        libc::EOPNOTSUPP,
    );
    fast_only_refused(&s, &p, NO_TRIM, 5);
    fast_only_refused(&s, &p, TRIM, 6);
}

/// On a block device only the no-fallback PUNCH_HOLE zero-out is fast: when
/// the loop device has lost write-zeroes it fails and fast_only is refused.
#[test]
#[ignore = "needs root"]
fn fast_only_loop_without_write_zeroes() {
    let s = Scratch::new(StorageKind::LoopTmpfs, SIZE);
    let p = open_probe(s.path());
    // Fresh: punch works (the loop driver punches the tmpfs file).
    write_pattern(s.path(), 0, SIZE, 8);
    let out = p
        .target
        .zero(
            0,
            MIB,
            ZeroFlags {
                may_trim: true,
                fast_only: true,
            },
        )
        .unwrap();
    assert_eq!(out.methods, vec![Method::PunchHole]);
    // A no-trim zero makes the driver drop write-zeroes for good.
    p.target.zero(MIB, MIB, NO_TRIM).unwrap();
    assert_eq!(
        s.loop_dev().unwrap().queue_attr("write_zeroes_max_bytes"),
        0
    );
    fast_only_refused(&s, &p, TRIM, 9);
    fast_only_refused(&s, &p, NO_TRIM, 10);
    assert_tri(&p.target, Method::PunchHole, Tri::Fails, "loop on tmpfs");
}

/// fast_only where a fast method exists: it is used.
#[test]
#[ignore = "needs root"]
fn fast_only_when_fast_works() {
    for (kind, flags, m) in [
        (StorageKind::Ext4, NO_TRIM, Method::ZeroRange),
        (StorageKind::Ext4, TRIM, Method::PunchHole),
        (StorageKind::Xfs, NO_TRIM, Method::ZeroRange),
        (StorageKind::Tmpfs, TRIM, Method::PunchHole),
        (StorageKind::Loop512, TRIM, Method::PunchHole),
        (StorageKind::Loop4k, TRIM, Method::PunchHole),
    ] {
        let s = Scratch::new(kind, SIZE);
        let p = open_probe(s.path());
        assert!(p.target.can_fast_zero(), "{kind}");
        write_pattern(s.path(), 0, SIZE, 11);
        let out = p
            .target
            .zero(
                MIB,
                2 * MIB,
                ZeroFlags {
                    fast_only: true,
                    ..flags
                },
            )
            .unwrap_or_else(|e| panic!("{kind} {flags:?}: {e}"));
        assert!(out.methods.contains(&m), "{kind} {flags:?}: {out:?}");
        assert!(
            !out.methods.contains(&Method::WriteZeros),
            "{kind}: {out:?}"
        );
        let mut want = pattern_vec(11, 0, SIZE as usize);
        want[MIB as usize..3 * MIB as usize].fill(0);
        assert_same(&format!("{kind}"), 0, &read_all(s.path()), &want);
    }
}

/// fast_only where the first fast method is unsupported but a later one is
/// fast: it falls through to it rather than refusing.
#[test]
#[ignore = "needs root"]
fn fast_only_falls_through_to_next_fast() {
    let s = ext4_file();
    let p = open_probe(s.path());
    fail_always(&p.fault, &[PUNCH], libc::EOPNOTSUPP);
    write_pattern(s.path(), 0, SIZE, 12);
    let out = p
        .target
        .zero(
            MIB,
            MIB,
            ZeroFlags {
                may_trim: true,
                fast_only: true,
            },
        )
        .unwrap();
    assert_eq!(out.methods, vec![Method::ZeroRange]);
    assert_tri(&p.target, Method::PunchHole, Tri::Fails, "ext4");
}

/// The timed split on tmpfs goes through the same judging as the chain: EIO
/// from the fallocate after the punch is reported with its operation and
/// range and teaches nothing; "not supported" is learned, the whole range is
/// written, no sample is taken and punch-alloc is never tried again. Bytes
/// outside the requests never change.
#[test]
#[ignore = "needs root"]
fn tmpfs_keep_zero_trial_faults() {
    const SIZE: u64 = 64 * MIB;
    let alloc = CallKind::Fallocate(FallocMode::Allocate);
    let s = Scratch::new(StorageKind::Tmpfs, SIZE);
    let path = s.path().to_owned();
    let p = open_probe(&path);
    let t = &p.target;
    write_pattern(&path, 0, SIZE, 71);
    let mut want = pattern_vec(71, 0, SIZE as usize);
    // Learn that ZERO_RANGE is missing.
    t.zero(0, MIB, NO_TRIM).unwrap();
    want[..MIB as usize].fill(0);

    let n_alloc = p.fault.calls(alloc);
    p.fault.fail_once(alloc, n_alloc + 1, libc::EIO);
    let (off, len) = (2 * MIB, 16 * MIB);
    let e = t.zero(off, len, NO_TRIM).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EIO), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("fallocate after punch"), "{msg}");
    assert!(msg.contains(&off.to_string()), "{msg}");
    assert_tri(t, Method::PunchAlloc, Tri::Unknown, "EIO teaches nothing");
    // The punched half reads zeros, the rest of the request and everything
    // outside it are untouched.
    want[off as usize..(off + len / 2) as usize].fill(0);
    assert_same("after EIO", 0, &read_all(&path), &want);

    fail_always(&p.fault, &[alloc], libc::EOPNOTSUPP);
    let (off, len) = (20 * MIB + 4096, 16 * MIB);
    let out = t.zero(off, len, NO_TRIM).unwrap();
    assert_eq!(out.methods, vec![Method::WriteZeros]);
    assert_tri(t, Method::PunchAlloc, Tri::Fails, "tmpfs without fallocate");
    assert_eq!(t.caps().keep_zero(), rawdisk_storage::KeepZero::Unknown);
    want[off as usize..(off + len) as usize].fill(0);
    assert_same("after EOPNOTSUPP", 0, &read_all(&path), &want);
    let punches = p.fault.calls(PUNCH);
    let out = t.zero(40 * MIB, 16 * MIB, NO_TRIM).unwrap();
    assert_eq!(out.methods, vec![Method::WriteZeros]);
    assert_eq!(p.fault.calls(PUNCH), punches, "punch-alloc tried again");
    want[40 * MIB as usize..56 * MIB as usize].fill(0);
    assert_same("after learning", 0, &read_all(&path), &want);
}
