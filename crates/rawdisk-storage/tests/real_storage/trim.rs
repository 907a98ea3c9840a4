//! `trim`: PUNCH_HOLE on files, BLKDISCARD on the aligned middle of block
//! devices; advisory (unsupported = success, learned), real errors returned.

use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{Method, Tri};
use rawdisk_testkit::{
    assert_same, pattern_vec, read_all, write_pattern, Scratch, StorageKind, KIB, MIB,
};

use crate::common::*;
use crate::per_kind;

pub fn trim_ranges(kind: StorageKind) {
    const SIZE: u64 = 16 * MIB;
    let s = Scratch::new(kind, SIZE);
    let path = s.path().to_owned();
    let p = open_probe(&path);
    let t = &p.target;
    let ss = offload_align(kind);
    let cases = [
        (MIB, 4 * MIB),
        (6 * MIB + 777, 3 * MIB + 1000),
        (11 * MIB + 100, 200),
        (SIZE - 2 * MIB - 5, 2 * MIB + 5),
    ];
    for (i, (off, len)) in cases.into_iter().enumerate() {
        let what = format!("{kind}: trim {off}+{len}");
        let seed = 200 + i as u64;
        write_pattern(&path, 0, SIZE, seed);
        let before = s.allocated();
        p.rec.take();
        t.trim(off, len).unwrap_or_else(|e| panic!("{what}: {e}"));
        let calls = p.rec.take();
        assert!(
            !calls
                .iter()
                .any(|c| matches!(c.kind, CallKind::Pwrite | CallKind::PwriteDsync)),
            "{what}: trim must never write: {calls:?}"
        );

        let old = pattern_vec(seed, 0, SIZE as usize);
        let got = read_all(&path);
        let (a, b) = (off as usize, (off + len) as usize);
        let mid_start = off.div_ceil(ss) * ss;
        let mid_end = (off + len) / ss * ss;
        match kind {
            k if !punch_frees(k) => assert_same(&what, 0, &got, &old),
            k if k.is_block() => {
                // Outside the aligned middle nothing may change; inside it a
                // discarded sector reads either as before or as zeros (loop
                // devices punch their backing file, but BLKDISCARD promises
                // nothing about contents).
                let (ms, me) = if mid_end > mid_start {
                    (mid_start as usize, mid_end as usize)
                } else {
                    (a, a)
                };
                assert_same(&what, 0, &got[..ms], &old[..ms]);
                assert_same(&what, me as u64, &got[me..], &old[me..]);
                for i in ms..me {
                    assert!(
                        got[i] == old[i] || got[i] == 0,
                        "{what}: byte {i} is {:#x}, neither old {:#x} nor zero",
                        got[i],
                        old[i]
                    );
                }
                let discards: Vec<&Call> = calls
                    .iter()
                    .filter(|c| c.kind == CallKind::BlkDiscard)
                    .collect();
                if mid_end > mid_start {
                    assert_tiles(
                        &calls,
                        &[CallKind::BlkDiscard],
                        mid_start,
                        mid_end - mid_start,
                        1 << 30,
                    );
                } else {
                    assert!(
                        discards.is_empty(),
                        "{what}: discard outside the range: {calls:?}"
                    );
                }
            }
            _ => {
                let mut want = old.clone();
                want[a..b].fill(0);
                assert_same(&what, 0, &got, &want);
            }
        }
        let after = s.allocated();
        let inner = ((off + len) / 4096 * 4096).saturating_sub(off.div_ceil(4096) * 4096);
        if punch_frees(kind) && inner >= MIB {
            assert!(
                before.saturating_sub(after) + 256 * KIB >= inner,
                "{what}: allocation {before} -> {after}, expected {inner} bytes freed"
            );
        }
    }
    if !punch_frees(kind) {
        assert_tri(t, Method::PunchHole, Tri::Fails, &format!("{kind} trim"));
        assert!(!t.can_trim(), "{kind}: can_trim after learning punch fails");
        let n = p.fault.calls(PUNCH);
        t.trim(0, MIB).unwrap();
        assert_eq!(p.fault.calls(PUNCH), n, "{kind}: punch tried again");
    } else if kind.is_block() {
        assert_tri(t, Method::BlkDiscard, Tri::Works, &format!("{kind}"));
        assert!(t.can_trim());
    } else {
        assert_tri(t, Method::PunchHole, Tri::Works, &format!("{kind}"));
        assert!(t.can_trim());
    }
}
per_kind!(trim_ranges);

fn trim_kind(kind: StorageKind) -> CallKind {
    if kind.is_block() {
        CallKind::BlkDiscard
    } else {
        PUNCH
    }
}

fn trim_method(kind: StorageKind) -> Method {
    if kind.is_block() {
        Method::BlkDiscard
    } else {
        Method::PunchHole
    }
}

/// "Not supported" makes trim a successful no-op, learned once.
#[test]
#[ignore = "needs root"]
fn unsupported_trim_is_advisory() {
    for kind in [StorageKind::Ext4, StorageKind::Loop512] {
        let s = Scratch::new(kind, 8 * MIB);
        let p = open_probe(s.path());
        fail_always(&p.fault, &[trim_kind(kind)], libc::EOPNOTSUPP);
        write_pattern(s.path(), 0, 8 * MIB, 20);
        p.target.trim(MIB, 2 * MIB).unwrap();
        assert_tri(&p.target, trim_method(kind), Tri::Fails, &format!("{kind}"));
        assert!(!p.target.can_trim(), "{kind}");
        let n = p.fault.calls(trim_kind(kind));
        assert_eq!(n, 1, "{kind}");
        p.target.trim(3 * MIB, 2 * MIB).unwrap();
        assert_eq!(p.fault.calls(trim_kind(kind)), n, "{kind}: tried again");
        assert_same(
            &format!("{kind}"),
            0,
            &read_all(s.path()),
            &pattern_vec(20, 0, 8 * MIB as usize),
        );
    }
}

/// EIO, EPERM, ENOSPC from trim are returned and teach nothing.
#[test]
#[ignore = "needs root"]
fn trim_errors_are_returned() {
    for kind in [StorageKind::Ext4, StorageKind::Loop4k] {
        let s = Scratch::new(kind, 8 * MIB);
        let p = open_probe(s.path());
        write_pattern(s.path(), 0, 8 * MIB, 21);
        for (i, errno) in [libc::EIO, libc::EPERM, libc::ENOSPC]
            .into_iter()
            .enumerate()
        {
            p.fault.fail_once(trim_kind(kind), i as u64 + 1, errno);
            let e = p.target.trim(MIB, 2 * MIB).expect_err("injected");
            assert_eq!(errno_of(&e), errno, "{kind}: {e}");
            assert_ne!(p.target.caps().get(trim_method(kind)), Tri::Fails, "{kind}");
        }
        assert_same(
            &format!("{kind}"),
            0,
            &read_all(s.path()),
            &pattern_vec(21, 0, 8 * MIB as usize),
        );
        p.target.trim(MIB, 2 * MIB).unwrap();
        assert_tri(&p.target, trim_method(kind), Tri::Works, &format!("{kind}"));
    }
}
