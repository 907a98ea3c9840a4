//! Unit tests on temporary files under /tmp (ext4 on the CI machine), most
//! through [`FaultSys`] so errors the disk cannot produce can be injected.
//! The real-storage matrix (tmpfs, ramfs, XFS, loop devices) is in tests/.

use std::sync::Arc;

use rand::{Rng, SeedableRng};

use crate::sys::{CallKind, FallocMode, FaultSys, RealSys, Sys};
use crate::{CacheMode, ExtentKind, Kind, Method, OpenOptions, Prealloc, Target, Tri, ZeroFlags};

const PUNCH: CallKind = CallKind::Fallocate(FallocMode::PunchHole);
const ZRANGE: CallKind = CallKind::Fallocate(FallocMode::ZeroRange { keep_size: true });
const ALLOC: CallKind = CallKind::Fallocate(FallocMode::Allocate);

struct Tmp {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
}

fn tmp_file(size: u64) -> Tmp {
    let dir = tempfile::Builder::new()
        .prefix("rawdisk-storage-unit-")
        .tempdir_in("/tmp")
        .unwrap();
    let path = dir.path().join("img");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(size).unwrap();
    Tmp { _dir: dir, path }
}

/// Deterministic non-zero pattern keyed by absolute offset.
fn pattern(off: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = off + i;
            ((x ^ (x >> 8) ^ (x >> 16)) as u8) | 1
        })
        .collect()
}

fn open_fault(t: &Tmp, opts: OpenOptions) -> (Target, Arc<FaultSys>) {
    let f = FaultSys::real();
    let target = Target::open_with_sys(&t.path, &opts, f.clone()).unwrap();
    (target, f)
}

fn fill(t: &Target, size: u64) {
    t.write_at(&pattern(0, size as usize), 0, false).unwrap();
}

/// Assert [off, off+len) is zero and everything else in [0, size) still
/// holds the pattern.
fn check_zeroed(t: &Target, size: u64, off: u64, len: u64) {
    let mut all = vec![0u8; size as usize];
    t.read_at(&mut all, 0).unwrap();
    let want_pat = pattern(0, size as usize);
    for (i, b) in all.iter().enumerate() {
        let i64_ = i as u64;
        if i64_ >= off && i64_ < off + len {
            assert_eq!(
                *b, 0,
                "byte {i} in the zeroed range [{off}, +{len}) is not zero"
            );
        } else {
            assert_eq!(
                *b, want_pat[i],
                "byte {i} outside the zeroed range [{off}, +{len}) changed"
            );
        }
    }
}

#[test]
fn write_read_roundtrip_and_short_read_error() {
    let tmp = tmp_file(0);
    let t = Target::open(&tmp.path, &OpenOptions::default()).unwrap();
    assert_eq!(t.kind(), Kind::File);
    let data = pattern(100, 10_000);
    t.write_at(&data, 100, false).unwrap();
    t.write_at(&data[..10], 5000, true).unwrap();
    assert_eq!(t.size(), 10_100);
    let mut back = vec![0u8; 10_000];
    t.read_at(&mut back, 100).unwrap();
    let mut want = data.clone();
    want[4900..4910].copy_from_slice(&data[..10]);
    assert_eq!(back, want);
    let mut head = vec![1u8; 100];
    t.read_at(&mut head, 0).unwrap();
    assert!(head.iter().all(|b| *b == 0));
    let err = t.read_at(&mut [0u8; 200], 10_000).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("offset 10000 length 200") && msg.contains("10100"),
        "{msg}"
    );
    t.flush().unwrap();
}

#[test]
fn short_transfers_are_looped() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    f.set_max_io(7);
    let data = pattern(3, 1000);
    t.write_at(&data, 3, false).unwrap();
    t.write_at(&data[..100], 3, true).unwrap();
    let mut back = vec![0u8; 1000];
    t.read_at(&mut back, 3).unwrap();
    assert_eq!(back, data);
    assert!(f.calls(CallKind::Pwrite) >= 1000 / 7);
    assert!(f.calls(CallKind::Pread) >= 1000 / 7);
}

#[test]
fn eintr_is_retried() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    f.fail_once(CallKind::Pwrite, 1, libc::EINTR);
    f.fail_once(CallKind::Pread, 1, libc::EINTR);
    f.fail_once(PUNCH, 1, libc::EINTR);
    let data = pattern(0, 8192);
    t.write_at(&data, 0, false).unwrap();
    let mut back = vec![0u8; 8192];
    t.read_at(&mut back, 0).unwrap();
    assert_eq!(back, data);
    assert_eq!(f.calls(CallKind::Pwrite), 2);
    t.zero(
        1000,
        3000,
        ZeroFlags {
            may_trim: true,
            fast_only: false,
        },
    )
    .unwrap();
    assert_eq!(f.calls(PUNCH), 2);
    check_zeroed(&t, 8192, 1000, 3000);
}

#[test]
fn zero_uses_punch_hole_on_ext4_and_frees() {
    let size = 4 << 20;
    let tmp = tmp_file(0);
    let t = Target::open(&tmp.path, &OpenOptions::default()).unwrap();
    fill(&t, size);
    t.flush().unwrap();
    let before = t.allocated_bytes().unwrap();
    let o = t
        .zero(
            1 << 20,
            2 << 20,
            ZeroFlags {
                may_trim: true,
                fast_only: false,
            },
        )
        .unwrap();
    assert_eq!(o.methods, vec![Method::PunchHole]);
    check_zeroed(&t, size, 1 << 20, 2 << 20);
    let after = t.allocated_bytes().unwrap();
    assert!(after + (2 << 20) <= before, "before {before} after {after}");
    let ext = t.extents(0, size, 100).unwrap();
    assert_eq!(ext.len(), 3, "{ext:?}");
    assert_eq!(ext[1].kind, ExtentKind::Hole);
    assert_eq!((ext[1].offset, ext[1].len), (1 << 20, 2 << 20));
}

#[test]
fn zero_without_trim_uses_zero_range_and_keeps_allocation() {
    let size = 4 << 20;
    let tmp = tmp_file(0);
    let t = Target::open(&tmp.path, &OpenOptions::default()).unwrap();
    fill(&t, size);
    t.flush().unwrap();
    let before = t.allocated_bytes().unwrap();
    let o = t.zero(12345, 3 << 20, ZeroFlags::default()).unwrap();
    assert_eq!(o.methods, vec![Method::ZeroRange]);
    check_zeroed(&t, size, 12345, 3 << 20);
    assert_eq!(t.allocated_bytes().unwrap(), before);
}

#[test]
fn eopnotsupp_falls_through_and_is_remembered() {
    // Method k fails with EOPNOTSUPP: k+1 is used, k is learned and never
    // called again, by this handle or a second one on the same file.
    let size = 1 << 20;
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    fill(&t, size);
    f.fail_from(PUNCH, 1, libc::EOPNOTSUPP);
    let trim = ZeroFlags {
        may_trim: true,
        fast_only: false,
    };
    let o = t.zero(4096, 8192, trim).unwrap();
    assert_eq!(o.methods, vec![Method::ZeroRange]);
    assert_eq!(t.caps().get(Method::PunchHole), Tri::Fails);
    assert_eq!(t.caps().get(Method::ZeroRange), Tri::Works);
    check_zeroed(&t, size, 4096, 8192);

    f.fail_from(ZRANGE, 1, libc::EOPNOTSUPP);
    fill(&t, size);
    let o = t.zero(100, 50_000, trim).unwrap();
    // PunchAlloc needs PUNCH_HOLE, known to fail: straight to writing.
    assert_eq!(o.methods, vec![Method::WriteZeros]);
    assert_eq!(t.caps().get(Method::ZeroRange), Tri::Fails);
    check_zeroed(&t, size, 100, 50_000);
    assert_eq!(f.calls(PUNCH), 1);
    // One success before the rule, one failure.
    assert_eq!(f.calls(ZRANGE), 2);

    // A second handle on the same file shares what was learned.
    let (t2, f2) = open_fault(&tmp, OpenOptions::default());
    assert!(Arc::ptr_eq(t.caps(), t2.caps()));
    t2.zero(0, 10, trim).unwrap();
    t2.trim(0, 4096).unwrap();
    assert_eq!(f2.fallocate_calls(), 0, "{:?}", f2.counts());
    assert!(!t2.can_trim());
    assert!(!t2.can_fast_zero());
    drop((t, t2));
}

#[test]
fn zero_range_missing_uses_punch_then_allocate() {
    // tmpfs: no ZERO_RANGE; NO_HOLE zeroing is PUNCH_HOLE + fallocate(0).
    let size = 1 << 20;
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    fill(&t, size);
    t.flush().unwrap();
    f.fail_from(ZRANGE, 1, libc::EOPNOTSUPP);
    let before = t.allocated_bytes().unwrap();
    let o = t.zero(65536, 262144, ZeroFlags::default()).unwrap();
    assert_eq!(o.methods, vec![Method::PunchAlloc]);
    assert_eq!(f.calls(PUNCH), 1);
    assert_eq!(f.calls(ALLOC), 1);
    check_zeroed(&t, size, 65536, 262144);
    assert_eq!(t.allocated_bytes().unwrap(), before);
    assert_eq!(t.caps().get(Method::PunchAlloc), Tri::Works);

    // fast_only without trim is still served (PunchAlloc cannot fall back
    // to writing).
    let o = t
        .zero(
            0,
            4096,
            ZeroFlags {
                may_trim: false,
                fast_only: true,
            },
        )
        .unwrap();
    assert_eq!(o.methods, vec![Method::PunchAlloc]);
}

#[test]
fn fallocate0_missing_after_punch_writes_zeros() {
    let size = 1 << 20;
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    fill(&t, size);
    f.fail_from(ZRANGE, 1, libc::EOPNOTSUPP);
    f.fail_from(ALLOC, 1, libc::ENOSYS);
    let o = t.zero(1000, 100_000, ZeroFlags::default()).unwrap();
    assert_eq!(o.methods, vec![Method::WriteZeros]);
    assert_eq!(t.caps().get(Method::Fallocate), Tri::Fails);
    assert_eq!(t.caps().get(Method::PunchAlloc), Tri::Fails);
    assert_eq!(t.caps().get(Method::PunchHole), Tri::Works);
    check_zeroed(&t, size, 1000, 100_000);
    // Not tried again.
    t.zero(0, 10, ZeroFlags::default()).unwrap();
    assert_eq!(f.calls(ALLOC), 1);
    assert_eq!(f.calls(ZRANGE), 1);
}

#[test]
fn real_errors_are_returned_without_falling_through_or_learning() {
    for errno in [libc::EIO, libc::ENOSPC, libc::EPERM, libc::EINVAL] {
        let size = 256 << 10;
        let tmp = tmp_file(0);
        let (t, f) = open_fault(&tmp, OpenOptions::default());
        fill(&t, size);
        f.fail_once(PUNCH, 1, errno);
        let e = t
            .zero(
                4096,
                8192,
                ZeroFlags {
                    may_trim: true,
                    fast_only: false,
                },
            )
            .unwrap_err();
        assert_eq!(e.errno(), Some(errno));
        assert!(e.to_string().contains("offset 4096 length 8192"), "{e}");
        assert_eq!(f.fallocate_calls(), 1, "fell through: {:?}", f.counts());
        assert_eq!(f.calls(CallKind::Pwrite), 1, "fell through to writing");
        assert_eq!(t.caps().get(Method::PunchHole), Tri::Unknown);
        check_zeroed(&t, size, 0, 0);

        f.fail_once(ZRANGE, 1, errno);
        let e = t.zero(4096, 8192, ZeroFlags::default()).unwrap_err();
        assert_eq!(e.errno(), Some(errno));
        assert_eq!(t.caps().get(Method::ZeroRange), Tri::Unknown);
        assert_eq!(f.calls(CallKind::Pwrite), 1);
        check_zeroed(&t, size, 0, 0);

        // Trim is advisory for "unsupported" only: real errors come back.
        f.fail_once(PUNCH, 2, errno);
        let e = t.trim(0, 4096).unwrap_err();
        assert_eq!(e.errno(), Some(errno));
        assert_eq!(t.caps().get(Method::PunchHole), Tri::Unknown);

        // Write errors too.
        f.fail_once(CallKind::Pwrite, 2, errno);
        assert_eq!(t.write_at(b"x", 0, false).unwrap_err().errno(), Some(errno));
    }
}

#[test]
fn fast_only_with_only_slow_methods_left_fails_at_once_and_changes_nothing() {
    let size = 512 << 10;
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    fill(&t, size);
    f.fail_from(PUNCH, 1, libc::EOPNOTSUPP);
    f.fail_from(ZRANGE, 1, libc::EOPNOTSUPP);
    let fast = ZeroFlags {
        may_trim: true,
        fast_only: true,
    };
    // First call: tries the fast methods, learns they fail, ENOTSUP.
    let e = t.zero(8192, 65536, fast).unwrap_err();
    assert_eq!(e.errno(), Some(libc::ENOTSUP));
    check_zeroed(&t, size, 0, 0);
    // Second call: nothing but the range check (fstat) is done.
    let mut calls = f.counts();
    let e = t.zero(8192, 65536, fast).unwrap_err();
    assert_eq!(e.errno(), Some(libc::ENOTSUP));
    let mut now = f.counts();
    calls.remove(&CallKind::Fstat);
    now.remove(&CallKind::Fstat);
    assert_eq!(now, calls, "a syscall was made for a hopeless fast zero");
    assert!(!t.can_fast_zero());
    check_zeroed(&t, size, 0, 0);
    // Without fast_only the same request writes.
    let o = t
        .zero(
            8192,
            65536,
            ZeroFlags {
                may_trim: true,
                fast_only: false,
            },
        )
        .unwrap();
    assert_eq!(o.methods, vec![Method::WriteZeros]);
    check_zeroed(&t, size, 8192, 65536);
}

#[test]
fn write_zeros_fallback_advances_every_chunk() {
    // The bug nbdkit and nbd-server shipped: the fallback rewrote the first
    // chunk forever. 1000-byte chunks over an unaligned 50_001-byte range.
    let size = 200_000;
    let tmp = tmp_file(0);
    let opts = OpenOptions {
        write_zeros_chunk: Some(1000),
        ..Default::default()
    };
    let (t, f) = open_fault(&tmp, opts);
    fill(&t, size);
    f.fail_from(PUNCH, 1, libc::EOPNOTSUPP);
    f.fail_from(ZRANGE, 1, libc::EOPNOTSUPP);
    let writes_before = f.calls(CallKind::Pwrite);
    let o = t
        .zero(
            777,
            50_001,
            ZeroFlags {
                may_trim: true,
                fast_only: false,
            },
        )
        .unwrap();
    assert_eq!(o.methods, vec![Method::WriteZeros]);
    assert_eq!(f.calls(CallKind::Pwrite) - writes_before, 51);
    check_zeroed(&t, size, 777, 50_001);
    let st = t.caps().stats(Method::WriteZeros);
    assert_eq!(st.bytes, 50_001);
    assert_eq!(st.calls, 51);
}

#[test]
fn zero_is_split_at_the_per_call_limit() {
    let size = 1 << 20;
    let tmp = tmp_file(0);
    let opts = OpenOptions {
        max_zero_call: Some(100_000),
        ..Default::default()
    };
    let (t, f) = open_fault(&tmp, opts);
    fill(&t, size);
    // Fails on the third chunk: the first two were punched, the rest must
    // continue with the next method from where the failure happened.
    f.fail_from(PUNCH, 3, libc::EOPNOTSUPP);
    let o = t
        .zero(
            5,
            700_000,
            ZeroFlags {
                may_trim: true,
                fast_only: false,
            },
        )
        .unwrap();
    assert_eq!(o.methods, vec![Method::PunchHole, Method::ZeroRange]);
    assert_eq!(f.calls(PUNCH), 3);
    assert_eq!(f.calls(ZRANGE), 5);
    check_zeroed(&t, size, 5, 700_000);
}

#[test]
fn zero_and_trim_past_the_end_are_refused() {
    let tmp = tmp_file(10_000);
    let t = Target::open(&tmp.path, &OpenOptions::default()).unwrap();
    assert!(t.zero(9_000, 1_001, ZeroFlags::default()).is_err());
    assert!(t.trim(u64::MAX - 1, 10).is_err());
    let e = t.write_at(b"abc", u64::MAX - 1, false).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EINVAL));
    let e = t.read_at(&mut [0u8; 3], u64::MAX - 1).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EINVAL));
    let d = Target::open(&tmp.path, &direct_opts()).unwrap();
    assert!(d.write_at(b"abc", u64::MAX - 1, false).is_err());
    assert!(d.extents(u64::MAX - 1, 10, 10).unwrap().is_empty());
    t.zero(9_000, 1_000, ZeroFlags::default()).unwrap();
    assert_eq!(t.size(), 10_000);
}

#[test]
fn read_only_refuses_writes() {
    let tmp = tmp_file(4096);
    let t = Target::open(
        &tmp.path,
        &OpenOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(t.geometry().read_only);
    assert_eq!(
        t.write_at(b"a", 0, false).unwrap_err().errno(),
        Some(libc::EROFS)
    );
    assert_eq!(
        t.zero(0, 1, ZeroFlags::default()).unwrap_err().errno(),
        Some(libc::EROFS)
    );
    assert!(!t.can_trim());
    let mut b = [1u8; 16];
    t.read_at(&mut b, 0).unwrap();
    assert_eq!(b, [0u8; 16]);
}

#[test]
fn trim_unsupported_is_learned_and_succeeds() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    fill(&t, 65536);
    f.fail_from(PUNCH, 1, libc::EOPNOTSUPP);
    t.trim(0, 4096).unwrap();
    t.trim(0, 4096).unwrap();
    assert_eq!(f.calls(PUNCH), 1);
    assert!(!t.can_trim());
    check_zeroed(&t, 65536, 0, 0);
}

#[test]
fn extents_bounded_and_seek_unsupported_means_data() {
    let tmp = tmp_file(0);
    let t = Target::open(&tmp.path, &OpenOptions::default()).unwrap();
    let blk = 64 << 10;
    t.preallocate(16 * blk, Prealloc::Off).unwrap();
    for i in (0..16).step_by(2) {
        t.write_at(&pattern(i * blk, blk as usize), i * blk, false)
            .unwrap();
    }
    let all = t.extents(0, 16 * blk, 1000).unwrap();
    assert_eq!(all.len(), 16, "{all:?}");
    for (i, e) in all.iter().enumerate() {
        assert_eq!(e.offset, i as u64 * blk);
        assert_eq!(e.len, blk);
        let want = if i % 2 == 0 {
            ExtentKind::Data
        } else {
            ExtentKind::Hole
        };
        assert_eq!(e.kind, want);
    }
    let some = t.extents(blk / 2, 16 * blk, 3).unwrap();
    assert_eq!(some.len(), 3);
    assert_eq!(some[0].offset, blk / 2);
    assert_eq!(some[0].len, blk / 2);
    // Clipped at the end; nothing past it.
    assert!(t.extents(16 * blk, 10, 5).unwrap().is_empty());
    let tail = t.extents(15 * blk + 1, 100 * blk, 5).unwrap();
    assert_eq!(tail.len(), 1);
    assert_eq!(tail[0].len, blk - 1);

    let (t2, f) = open_fault(&tmp, OpenOptions::default());
    t2.caps().set(Method::SeekHole, Tri::Unknown);
    f.fail_from(CallKind::SeekData, 1, libc::EINVAL);
    let e = t2.extents(0, 16 * blk, 10).unwrap();
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].kind, ExtentKind::Data);
    assert_eq!(e[0].len, 16 * blk);
    assert_eq!(t2.caps().get(Method::SeekHole), Tri::Fails);
    t2.extents(0, 16 * blk, 10).unwrap();
    assert_eq!(f.calls(CallKind::SeekData), 1);
    // Reset for other handles of this (temporary) file.
    t2.caps().set(Method::SeekHole, Tri::Unknown);
}

#[test]
fn preallocate_modes() {
    let size = 8 << 20;
    for mode in [Prealloc::Off, Prealloc::Falloc, Prealloc::Full] {
        let tmp = tmp_file(0);
        let t = Target::open(&tmp.path, &OpenOptions::default()).unwrap();
        let r = t.preallocate(size, mode).unwrap();
        assert_eq!(t.size(), size);
        let alloc = t.allocated_bytes().unwrap();
        match mode {
            Prealloc::Off => {
                assert_eq!(r.method, None);
                // First block allocated, the rest sparse.
                assert!((4096..1 << 20).contains(&alloc), "{alloc}");
            }
            Prealloc::Falloc => {
                assert_eq!(r.method, Some(Method::Fallocate));
                assert!(alloc >= size, "{alloc}");
            }
            Prealloc::Full => {
                assert_eq!(r.method, Some(Method::WriteZeros));
                assert!(alloc >= size, "{alloc}");
            }
        }
        let mut b = vec![1u8; size as usize];
        t.read_at(&mut b, 0).unwrap();
        assert!(b.iter().all(|x| *x == 0));
        assert!(t.preallocate(size - 1, mode).is_err(), "shrank");
    }
}

#[test]
fn preallocate_falloc_falls_back_to_full_when_unsupported() {
    // ramfs has no fallocate: falloc must write, never posix_fallocate.
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    t.write_at(&pattern(0, 1000), 0, false).unwrap();
    f.fail_from(ALLOC, 1, libc::EOPNOTSUPP);
    let r = t.preallocate(3 << 20, Prealloc::Falloc).unwrap();
    assert_eq!(r.method, Some(Method::WriteZeros));
    assert_eq!(f.calls(ALLOC), 1);
    assert_eq!(t.size(), 3 << 20);
    assert!(t.allocated_bytes().unwrap() >= 3 << 20);
    let mut b = vec![1u8; 3 << 20];
    t.read_at(&mut b, 0).unwrap();
    assert_eq!(&b[..1000], &pattern(0, 1000)[..]);
    assert!(b[1000..].iter().all(|x| *x == 0));
    assert!(f.calls(CallKind::Fsync) >= 1);
}

#[test]
fn preallocate_full_failure_cuts_back() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    t.write_at(&pattern(0, 5000), 0, false).unwrap();
    f.fail_once(CallKind::Pwrite, 2, libc::ENOSPC);
    let e = t.preallocate(16 << 20, Prealloc::Full).unwrap_err();
    assert_eq!(e.errno(), Some(libc::ENOSPC));
    assert_eq!(t.size(), 5000);
    let mut b = vec![0u8; 5000];
    t.read_at(&mut b, 0).unwrap();
    assert_eq!(b, pattern(0, 5000));
}

#[test]
fn cache_and_geometry() {
    let tmp = tmp_file(1 << 20);
    let t = Target::open(&tmp.path, &OpenOptions::default()).unwrap();
    t.cache(0, 1 << 20).unwrap();
    let g = t.geometry();
    assert_eq!(g.size, 1 << 20);
    assert_eq!(g.logical_sector, 1);
    assert!(g.dio_align.is_power_of_two());
    assert!(!g.read_only);
    assert_eq!(t.path(), tmp.path.as_path());
    assert_eq!(t.cache_mode(), CacheMode::Writeback);
}

#[test]
fn random_ops_match_a_model() {
    for cache in [CacheMode::Writeback, CacheMode::None] {
        let size: u64 = 1 << 20;
        let tmp = tmp_file(size);
        let opts = OpenOptions {
            cache,
            write_zeros_chunk: Some(3000),
            max_zero_call: Some(50_000),
            ..Default::default()
        };
        let (t, f) = open_fault(&tmp, opts);
        let mut model = vec![0u8; size as usize];
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        for step in 0..300 {
            if step == 100 {
                f.fail_from(PUNCH, 1, libc::EOPNOTSUPP);
            }
            if step == 200 {
                f.fail_from(ZRANGE, 1, libc::EOPNOTSUPP);
            }
            let off = rng.gen_range(0..size);
            let len = rng.gen_range(0..=(size - off).min(200_000));
            match rng.gen_range(0..4) {
                0 | 1 => {
                    let d = pattern(rng.gen::<u32>() as u64, len as usize);
                    t.write_at(&d, off, rng.gen()).unwrap();
                    model[off as usize..(off + len) as usize].copy_from_slice(&d);
                }
                2 => {
                    let fl = ZeroFlags {
                        may_trim: rng.gen(),
                        fast_only: false,
                    };
                    t.zero(off, len, fl).unwrap();
                    model[off as usize..(off + len) as usize].fill(0);
                }
                _ => {
                    // Trim leaves old data or zeros; the model cannot know
                    // which, so read it back and adopt it if it is either.
                    t.trim(off, len).unwrap();
                    let mut b = vec![0u8; len as usize];
                    t.read_at(&mut b, off).unwrap();
                    let old = &model[off as usize..(off + len) as usize];
                    for (i, x) in b.iter().enumerate() {
                        assert!(*x == 0 || *x == old[i], "trim invented data");
                    }
                    model[off as usize..(off + len) as usize].copy_from_slice(&b);
                }
            }
        }
        let mut all = vec![0u8; size as usize];
        t.read_at(&mut all, 0).unwrap();
        assert!(all == model, "content differs from the model ({cache:?})");
        assert_eq!(t.size(), size);
    }
}

#[test]
fn real_sys_is_the_default() {
    // The default trait methods forward to the kernel.
    let s: Arc<dyn Sys> = Arc::new(RealSys);
    let tmp = tmp_file(100);
    let t = Target::open_with_sys(&tmp.path, &OpenOptions::default(), s).unwrap();
    assert_eq!(t.size(), 100);
}

/// `probe_methods` on real storage: files past their end (nothing changes),
/// block devices on a scratch range.
fn probe_check(t: &Target, s: &rawdisk_testkit::Scratch, kind: rawdisk_testkit::StorageKind) {
    use rawdisk_testkit::StorageKind as K;
    use Method::*;
    let (size, alloc) = (t.size(), s.allocated());
    let scratch = kind.is_block().then_some((0, 1 << 20));
    let p = t.probe_methods(scratch).unwrap();
    let got = |m: Method| {
        p.iter()
            .find(|p| p.method == m)
            .map(|p| *p.result.as_ref().unwrap())
    };
    let (w, f) = (Some(Tri::Works), Some(Tri::Fails));
    match kind {
        K::Tmpfs => assert_eq!(
            [
                got(PunchHole),
                got(ZeroRange),
                got(Fallocate),
                got(PunchAlloc)
            ],
            [w, f, w, w]
        ),
        K::Ramfs => assert_eq!(
            [
                got(PunchHole),
                got(ZeroRange),
                got(Fallocate),
                got(PunchAlloc)
            ],
            [f, f, f, f]
        ),
        K::Ext4 | K::Xfs => assert_eq!(
            [
                got(PunchHole),
                got(ZeroRange),
                got(Fallocate),
                got(PunchAlloc)
            ],
            [w, w, w, w]
        ),
        K::Loop512 | K::Loop4k => assert_eq!(
            [
                got(PunchHole),
                got(ZeroRange),
                got(BlkZeroout),
                got(BlkDiscard)
            ],
            [w, w, w, w]
        ),
        K::LoopTmpfs => assert_eq!(
            [got(ZeroRange), got(BlkZeroout), got(BlkDiscard)],
            [w, w, w]
        ),
    }
    if !kind.is_block() {
        assert_eq!(got(SeekHole), w, "{kind}");
        assert_eq!(t.size(), size, "{kind}: probe changed the size");
        // The probed data blocks are freed again; an extent-tree block the
        // file system added for them may stay (ext4 with 1 KiB blocks).
        let now = s.allocated();
        assert!(
            now < alloc + (64 << 10),
            "{kind}: probe left allocation behind: {alloc} -> {now}"
        );
    }
}

/// Real storage, every kind: the chain picks the method the storage has
/// (see docs/capabilities.md, the capability matrix), unaligned ranges on
/// block devices work, data around the range is untouched.
#[test]
#[ignore = "needs root"]
fn smoke_every_storage_kind() {
    use rawdisk_testkit::{Scratch, StorageKind, MIB};
    use std::thread;
    let trim = ZeroFlags {
        may_trim: true,
        fast_only: false,
    };
    let nohole = ZeroFlags::default();
    let fast_nohole = ZeroFlags {
        may_trim: false,
        fast_only: true,
    };
    let handles: Vec<_> = StorageKind::ALL
        .into_iter()
        .filter(|k| std::env::var("RAWDISK_SMOKE_KIND").map_or(true, |v| v == k.name()))
        .map(|kind| {
            thread::spawn(move || {
                let size = 8 * MIB;
                let s = Scratch::new(kind, size);
                let modes: &[CacheMode] = if kind == StorageKind::Ramfs {
                    &[CacheMode::Writeback]
                } else {
                    &[CacheMode::Writeback, CacheMode::None]
                };
                for &cache in modes {
                    let opts = OpenOptions {
                        cache,
                        ..Default::default()
                    };
                    let t = Target::open(s.path(), &opts).unwrap();
                    let g = t.geometry();
                    assert_eq!(g.size, size, "{kind}");
                    if kind.is_block() {
                        assert_eq!(t.kind(), Kind::Block);
                        assert_eq!(g.logical_sector, kind.sector_size(), "{kind}");
                        let q = t.block_queue_limits().expect("queue limits");
                        assert_eq!(q.logical_block_size, Some(kind.sector_size() as u64));
                    }
                    probe_check(&t, &s, kind);
                    fill(&t, size);
                    // Unaligned on every sector size: head and tail by hand.
                    let (off, len) = (4097 + 511, 2 * MIB + 1234);
                    let o1 = t.zero(off, len, trim).unwrap();
                    check_zeroed(&t, size, off, len);
                    fill(&t, size);
                    let o2 = t.zero(off, len, nohole).unwrap();
                    check_zeroed(&t, size, off, len);
                    fill(&t, size);
                    let o3 = t.zero(off, len, fast_nohole).map(|o| o.methods);
                    if o3.is_ok() {
                        check_zeroed(&t, size, off, len);
                    } else {
                        check_zeroed(&t, size, 0, 0);
                    }
                    let (m1, m2) = (o1.methods, o2.methods);
                    use Method::*;
                    let w = WriteZeros;
                    match kind {
                        StorageKind::Tmpfs => {
                            // Without trim, writing beats punch + fallocate
                            // there, so a fast zero without trim is refused.
                            assert_eq!((m1, m2), (vec![PunchHole], vec![w]), "{cache:?}");
                            assert_eq!(o3.unwrap_err().errno(), Some(libc::ENOTSUP));
                        }
                        StorageKind::Ramfs => {
                            assert_eq!((m1, m2), (vec![w], vec![w]));
                            assert_eq!(o3.unwrap_err().errno(), Some(libc::ENOTSUP));
                            let e = Target::open(
                                s.path(),
                                &OpenOptions {
                                    cache: CacheMode::None,
                                    ..Default::default()
                                },
                            )
                            .unwrap_err()
                            .to_string();
                            assert!(e.contains("O_DIRECT") && e.contains("disk.img"), "{e}");
                        }
                        StorageKind::Ext4 | StorageKind::Xfs => {
                            assert_eq!((m1, m2), (vec![PunchHole], vec![ZeroRange]));
                            assert_eq!(o3.unwrap(), vec![ZeroRange]);
                        }
                        StorageKind::Loop512 | StorageKind::Loop4k => {
                            assert_eq!((m1, m2), (vec![PunchHole, w], vec![ZeroRange, w]));
                            assert_eq!(o3.unwrap(), vec![PunchHole, w]);
                        }
                        StorageKind::LoopTmpfs => {
                            // PUNCH_HOLE needs the device's write-zeroes, which
                            // the loop driver drops on first use: learned gone.
                            assert_eq!(m1.last(), Some(&w), "{m1:?}");
                            assert_eq!(t.caps().get(PunchHole), Tri::Fails);
                            assert_eq!(o3.unwrap_err().errno(), Some(libc::ENOTSUP));
                            assert!(!t.can_fast_zero());
                        }
                    }
                    fill(&t, size);
                    t.trim(off, len).unwrap();
                    t.flush().unwrap();
                    let mut b = vec![0u8; size as usize];
                    t.read_at(&mut b, 0).unwrap();
                    let p = pattern(0, size as usize);
                    for i in
                        (0..size as usize).filter(|i| (*i as u64) < off || *i as u64 >= off + len)
                    {
                        assert_eq!(
                            b[i], p[i],
                            "{kind}: trim changed byte {i} outside its range"
                        );
                    }
                    drop(t);
                }
                drop(s);
            })
        })
        .collect();
    let mut failed = Vec::new();
    for (h, k) in handles.into_iter().zip(StorageKind::ALL) {
        if h.join().is_err() {
            failed.push(k);
        }
    }
    assert!(failed.is_empty(), "failed on {failed:?}");
}

fn direct_opts() -> OpenOptions {
    OpenOptions {
        cache: CacheMode::None,
        ..Default::default()
    }
}

#[test]
fn direct_unaligned_io_and_file_end() {
    // /tmp is ext4: O_DIRECT works, alignment from STATX_DIOALIGN (512 or
    // 4096 depending on the disk).
    let tmp = tmp_file(0);
    let t = Target::open(&tmp.path, &direct_opts()).unwrap();
    let a = t.geometry().dio_align as u64;
    assert!(a.is_power_of_two() && a >= 512, "{a}");
    assert_eq!(t.geometry().logical_sector as u64, a);
    // A write ending mid-block must not grow the file to the block end.
    let d = pattern(0, 1000);
    t.write_at(&d, 0, false).unwrap();
    assert_eq!(t.size(), 1000);
    t.write_at(&d[..10], 2 * a + 3, true).unwrap();
    assert_eq!(t.size(), 2 * a + 13);
    let mut b = vec![0u8; (2 * a + 13) as usize];
    t.read_at(&mut b, 0).unwrap();
    assert_eq!(&b[..1000], &d[..]);
    assert!(b[1000..(2 * a + 3) as usize].iter().all(|x| *x == 0));
    assert_eq!(&b[(2 * a + 3) as usize..], &d[..10]);
    // Unaligned buffer address, aligned offset and length: bounced too.
    let big = pattern(7, 3 * a as usize + 1);
    t.write_at(&big[1..], a, false).unwrap();
    let mut r = vec![0u8; 3 * a as usize + 1];
    t.read_at(&mut r[1..], a).unwrap();
    assert_eq!(&r[1..], &big[1..]);
    // Larger than one bounce buffer, unaligned both ends.
    let huge = pattern(9, (20 << 20) + 77);
    t.write_at(&huge, 12345, false).unwrap();
    let mut hr = vec![0u8; huge.len()];
    t.read_at(&mut hr, 12345).unwrap();
    assert!(hr == huge);
    // Byte before is the earlier pattern, untouched by the RMW.
    let mut one = [0u8; 1];
    t.read_at(&mut one, 12344).unwrap();
    let mut expect = vec![0u8; 12345];
    t.read_at(&mut expect, 0).unwrap();
    assert_eq!(one[0], expect[12344]);
    assert!(t.read_at(&mut [0u8; 10], t.size() - 5).is_err());
    // Zero with unaligned head/tail and preallocation under O_DIRECT.
    let sz = t.size();
    t.zero(100, sz - 200, ZeroFlags::default()).unwrap();
    let mut all = vec![1u8; sz as usize];
    t.read_at(&mut all, 0).unwrap();
    assert!(all[100..(sz - 100) as usize].iter().all(|x| *x == 0));
    assert_eq!(&all[..100], &d[..100]);
    t.preallocate(sz + 5000, Prealloc::Full).unwrap();
    assert_eq!(t.size(), sz + 5000);
}

#[test]
fn direct_concurrent_unaligned_writes_to_one_block_lose_nothing() {
    // Many threads write disjoint, unaligned byte ranges that share blocks:
    // without the range lock two read-modify-writes of the same block would
    // overwrite each other's bytes with stale data.
    let tmp = tmp_file(64 << 10);
    let t = Arc::new(Target::open(&tmp.path, &direct_opts()).unwrap());
    let threads = 8u64;
    let rounds = 200u64;
    let piece = 37u64; // odd so pieces straddle block boundaries
    let hs: Vec<_> = (0..threads)
        .map(|k| {
            let t = t.clone();
            std::thread::spawn(move || {
                for r in 0..rounds {
                    // Slot (r, k): thread k owns every threads-th piece.
                    let idx = r * threads + k;
                    let off = idx * piece;
                    let data = pattern(off, piece as usize);
                    t.write_at(&data, off, false).unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let total = threads * rounds * piece;
    let mut b = vec![0u8; total as usize];
    t.read_at(&mut b, 0).unwrap();
    let want = pattern(0, total as usize);
    let bad = b.iter().zip(&want).position(|(x, y)| x != y);
    assert_eq!(bad, None, "lost write at byte {bad:?}");
}

#[test]
fn direct_zero_racing_unaligned_writes_in_the_same_block() {
    let tmp = tmp_file(1 << 20);
    let t = Arc::new(Target::open(&tmp.path, &direct_opts()).unwrap());
    fill(&t, 1 << 20);
    let a = t.geometry().dio_align as u64;
    // In every block: bytes [0, a/2) are zeroed by one thread, [a/2, a)
    // written by another.
    let blocks = (1u64 << 20) / a;
    let tz = t.clone();
    let z = std::thread::spawn(move || {
        for i in 0..blocks {
            tz.zero(i * a, a / 2, ZeroFlags::default()).unwrap();
        }
    });
    let tw = t.clone();
    let w = std::thread::spawn(move || {
        for i in 0..blocks {
            let off = i * a + a / 2;
            tw.write_at(&pattern(off + 99, (a / 2) as usize), off, false)
                .unwrap();
        }
    });
    z.join().unwrap();
    w.join().unwrap();
    let mut b = vec![0u8; 1 << 20];
    t.read_at(&mut b, 0).unwrap();
    for i in 0..blocks {
        let s = (i * a) as usize;
        let h = (a / 2) as usize;
        assert!(b[s..s + h].iter().all(|x| *x == 0), "block {i}: zero lost");
        assert_eq!(
            &b[s + h..s + 2 * h],
            &pattern(i * a + a / 2 + 99, h)[..],
            "block {i}: write lost"
        );
    }
}

#[test]
fn probe_past_the_end_changes_nothing() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    fill(&t, 300_000);
    t.flush().unwrap();
    let alloc = t.allocated_bytes().unwrap();
    let p = t.probe_methods(None).unwrap();
    let got: Vec<_> = p
        .iter()
        .map(|p| (p.method, *p.result.as_ref().unwrap()))
        .collect();
    // /tmp is ext4: everything works.
    for m in [
        Method::PunchHole,
        Method::ZeroRange,
        Method::Fallocate,
        Method::PunchAlloc,
        Method::SeekHole,
    ] {
        assert!(got.contains(&(m, Tri::Works)), "{m}: {got:?}");
        assert_eq!(t.caps().get(m), Tri::Works);
    }
    assert_eq!(t.size(), 300_000);
    assert_eq!(t.allocated_bytes().unwrap(), alloc);
    check_zeroed(&t, 300_000, 0, 0);
    assert!(f.fallocate_calls() >= 3);
}

#[test]
fn probe_learns_unsupported_and_scratch_range() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    fill(&t, 300_000);
    f.fail_from(ZRANGE, 1, libc::EOPNOTSUPP);
    f.fail_from(
        CallKind::Fallocate(FallocMode::AllocateKeepSize),
        1,
        libc::EOPNOTSUPP,
    );
    let p = t.probe_methods(None).unwrap();
    assert_eq!(t.caps().get(Method::ZeroRange), Tri::Fails);
    assert_eq!(t.caps().get(Method::Fallocate), Tri::Fails);
    assert_eq!(t.caps().get(Method::PunchAlloc), Tri::Fails);
    assert_eq!(t.caps().get(Method::PunchHole), Tri::Works);
    assert!(p.iter().all(|p| p.result.is_ok()));
    check_zeroed(&t, 300_000, 0, 0);
    // Real errors are reported per method, not learned.
    f.fail_once(PUNCH, f.calls(PUNCH) + 1, libc::EIO);
    let p = t.probe_methods(Some((4096, 8192))).unwrap();
    let punch = p.iter().find(|p| p.method == Method::PunchHole).unwrap();
    assert_eq!(punch.result.as_ref().unwrap_err().errno(), Some(libc::EIO));
    assert_eq!(t.caps().get(Method::PunchHole), Tri::Works);
    // The scratch range was zeroed by the punch-alloc try; nothing else moved.
    check_zeroed(&t, 300_000, 4096, 8192);
    for m in Method::ALL {
        assert!(!m.explain().is_empty());
    }
}

#[test]
fn target_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Target>();
    check::<FaultSys>();
}

/// BLKSSZGET failing (some old drivers) must not refuse the device: 4096 is
/// assumed with a warning, which is safe for both 512 and 4096 devices.
#[test]
#[ignore = "needs root"]
fn blksszget_failure_assumes_4096() {
    let sys = FaultSys::real();
    sys.set_geometry_edit(|g| crate::sys::BlockGeometry {
        logical_sector: None,
        ..g
    });
    let dev = rawdisk_testkit::LoopDev::new(8 << 20, 512);
    let t = Target::open_with_sys(dev.path(), &OpenOptions::default(), sys).unwrap();
    assert_eq!(t.kind(), Kind::Block);
    assert_eq!(t.geometry().logical_sector, 4096);
    fill(&t, 8 << 20);
    t.zero(1000, 20_000, ZeroFlags::default()).unwrap();
    check_zeroed(&t, 8 << 20, 1000, 20_000);
    drop(t);
}

#[test]
fn fua_uses_rwf_dsync_and_falls_back_to_fdatasync() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    t.write_at(b"abc", 0, true).unwrap();
    assert_eq!(f.calls(CallKind::PwriteDsync), 1);
    assert_eq!(f.calls(CallKind::Fdatasync), 0);
    t.write_at(b"abc", 3, false).unwrap();
    assert_eq!(f.calls(CallKind::PwriteDsync), 1);
    // A kernel without pwritev2 / RWF_DSYNC: learned once, then
    // pwrite + fdatasync.
    f.fail_from(CallKind::PwriteDsync, 2, libc::ENOSYS);
    t.write_at(b"def", 6, true).unwrap();
    t.write_at(b"ghi", 9, true).unwrap();
    assert_eq!(f.calls(CallKind::PwriteDsync), 2);
    assert_eq!(f.calls(CallKind::Fdatasync), 2);
    let mut b = [0u8; 12];
    t.read_at(&mut b, 0).unwrap();
    assert_eq!(&b, b"abcabcdefghi");
    // A real error from the durable write is returned.
    let (t2, f2) = open_fault(&tmp, OpenOptions::default());
    f2.fail_once(CallKind::PwriteDsync, 1, libc::EIO);
    assert_eq!(
        t2.write_at(b"x", 0, true).unwrap_err().errno(),
        Some(libc::EIO)
    );
}

#[test]
fn open_refuses_what_is_not_a_file_or_device() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let e = Target::open(dir.path(), &OpenOptions::default()).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EISDIR), "{e}");
    let e = Target::open(&dir.path().join("missing"), &OpenOptions::default()).unwrap_err();
    assert_eq!(e.errno(), Some(libc::ENOENT), "{e}");
    assert!(e.to_string().starts_with("open /tmp/"), "{e}");
    assert!(e.to_string().contains("missing: "), "{e}");
    let p = dir.path().join("new.img");
    let opts = OpenOptions {
        create_new: true,
        ..Default::default()
    };
    let t = Target::open(&p, &opts).unwrap();
    assert_eq!(t.size(), 0);
    assert!(
        Target::open(&p, &opts).is_err(),
        "create_new on an existing file"
    );
}

#[test]
fn direct_failed_write_past_the_end_leaves_the_size() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, direct_opts());
    t.write_at(&pattern(0, 1000), 0, false).unwrap();
    assert_eq!(t.size(), 1000);
    // The read-modify-write reads the block, then the write fails: the size
    // must still be 1000 and the data intact.
    f.fail_once(CallKind::Pwrite, f.calls(CallKind::Pwrite) + 1, libc::EIO);
    let e = t.write_at(&pattern(1000, 50), 1000, false).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EIO));
    assert_eq!(t.size(), 1000);
    let mut b = vec![0u8; 1000];
    t.read_at(&mut b, 0).unwrap();
    assert_eq!(b, pattern(0, 1000));
    // FUA growth: padded block written durably, then cut and synced.
    let syncs = f.calls(CallKind::Fdatasync);
    t.write_at(&pattern(1000, 50), 1000, true).unwrap();
    assert_eq!(t.size(), 1050);
    assert_eq!(f.calls(CallKind::Fdatasync), syncs + 1);
    let mut b = vec![0u8; 1050];
    t.read_at(&mut b, 0).unwrap();
    assert_eq!(b, pattern(0, 1050));
}

#[test]
fn start_writeback_is_advisory_and_skipped_under_o_direct() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    let data = pattern(0, 64 << 10);
    t.write_at(&data, 0, false).unwrap();
    // An error here is not the caller's: the final flush reports real ones.
    f.fail_once(CallKind::StartWriteback, 1, libc::EIO);
    t.start_writeback(0, 64 << 10);
    t.start_writeback(0, 64 << 10);
    assert_eq!(f.calls(CallKind::StartWriteback), 2);
    t.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    t.read_at(&mut back, 0).unwrap();
    assert_eq!(back, data);

    // O_DIRECT leaves nothing in the page cache to write back.
    let opts = OpenOptions {
        cache: CacheMode::None,
        ..OpenOptions::default()
    };
    let d = Target::open_with_sys(&tmp.path, &opts, f.clone()).unwrap();
    d.start_writeback(0, 64 << 10);
    assert_eq!(f.calls(CallKind::StartWriteback), 2);
}

/// A file of `size` bytes just written, so its pages are in the page cache.
fn cached_file(size: u64) -> Tmp {
    let tmp = tmp_file(size);
    std::fs::write(&tmp.path, pattern(0, size as usize)).unwrap();
    tmp
}

/// Pages that are not in the page cache are not mapped: a fault would read
/// them from the disk (or clear a page for a hole) before the overwrite,
/// which a whole-page pwrite does not. Here a hole, then the same range once
/// written.
#[test]
fn map_write_only_over_cached_pages() {
    let tmp = tmp_file(1 << 20);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    assert!(t.map_write(64 << 10, 128 << 10).is_none());
    assert_eq!(f.calls(CallKind::Resident), 1);
    assert_eq!(f.calls(CallKind::PopulateWrite), 0);
    assert_eq!(t.caps().get(Method::MapWrite), Tri::Unknown);
    t.write_at(&pattern(0, 256 << 10), 0, false).unwrap();
    assert!(t.map_write(64 << 10, 128 << 10).is_some());
    // Half cached is not cached.
    assert!(t.map_write(128 << 10, 256 << 10).is_none());
    f.fail_once(
        CallKind::Resident,
        f.calls(CallKind::Resident) + 1,
        libc::ENOMEM,
    );
    assert!(t.map_write(0, 4096).is_none());
    assert_eq!(t.caps().get(Method::MapWrite), Tri::Works);
}

/// mincore is asked 1 MiB of pages at a time: a write whose uncached pages
/// lie only past the first MiB is still not mapped, a fully cached one of
/// several MiB is.
#[test]
fn map_write_checks_every_page_of_a_long_write() {
    let tmp = tmp_file(8 << 20);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    t.write_at(&pattern(0, 3 << 20), 0, false).unwrap();
    assert!(t.map_write(4096, (3 << 20) - 4096).is_some());
    let n = f.calls(CallKind::PopulateWrite);
    assert!(t.map_write(4096, 3 << 20).is_none(), "last page uncached");
    assert!(t.map_write(1 << 20, 3 << 20).is_none(), "last MiB uncached");
    assert_eq!(
        f.calls(CallKind::PopulateWrite),
        n,
        "populated uncached pages"
    );
}

/// Receive `data` from the other end of a socket pair into `w`, in as many
/// recv calls as it takes.
fn recv_all(w: &mut crate::MappedWrite<'_>, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::fd::AsFd;
    let (mut tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
    let data = data.to_vec();
    let sender = std::thread::spawn(move || {
        let _ = tx.write_all(&data);
    });
    let r = loop {
        if w.remaining() == 0 {
            break Ok(());
        }
        match w.recv(rx.as_fd()) {
            Ok(0) => break Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) => break Err(e),
        }
    };
    drop(rx);
    sender.join().unwrap();
    r
}

#[test]
fn map_write_lands_in_the_file_and_nowhere_else() {
    let size = 4 << 20;
    let tmp = tmp_file(size);
    std::fs::write(&tmp.path, pattern(0, size as usize)).unwrap();
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    let (off, len) = (1_000_003u64, 300_001usize);
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let mut w = t
        .map_write(off, len)
        .expect("page cache of ext4 or tmpfs maps");
    recv_all(&mut w, &data).unwrap();
    assert_eq!(w.received(), len);
    drop(w);
    assert_eq!(t.caps().get(Method::MapWrite), Tri::Works);
    assert_eq!(t.caps().stats(Method::MapWrite).bytes, len as u64);
    assert_eq!(f.calls(CallKind::Mmap), 1);
    assert_eq!(f.calls(CallKind::PopulateWrite), 1);
    let mut want = pattern(0, size as usize);
    want[off as usize..off as usize + len].copy_from_slice(&data);
    assert!(std::fs::read(&tmp.path).unwrap() == want, "file differs");
    // A second write reuses the mapping; one that ends past the size at
    // open is not mapped (a file's last page maps past its end).
    let w = t.map_write(size - 4096, 4096).unwrap();
    drop(w);
    assert_eq!(f.calls(CallKind::Mmap), 1);
    assert!(t.map_write(size - 4096, 4097).is_none());
    assert!(t.map_write(u64::MAX - 10, 20).is_none());
    assert!(
        std::fs::read(&tmp.path).unwrap() == want,
        "an empty mapped write changed data"
    );
}

#[test]
fn map_write_is_never_used_where_it_cannot_help_or_work() {
    let tmp = tmp_file(1 << 20);
    let ro = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let (t, f) = open_fault(&tmp, ro);
    assert!(t.map_write(0, 4096).is_none());
    let direct = OpenOptions {
        cache: CacheMode::None,
        ..OpenOptions::default()
    };
    let d = Target::open_with_sys(&tmp.path, &direct, f.clone()).unwrap();
    assert!(d.map_write(0, 4096).is_none());
    assert_eq!(f.calls(CallKind::Mmap), 0);
    let empty = tmp_file(0);
    let (e, f) = open_fault(&empty, OpenOptions::default());
    assert!(e.map_write(0, 4096).is_none());
    assert_eq!(f.calls(CallKind::Mmap), 0);
}

#[test]
fn map_write_populate_errors_are_left_to_the_ordinary_write() {
    let tmp = cached_file(1 << 20);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    // No space (EFAULT is what populate says for a fault that would be a
    // SIGBUS): not mapped this time, nothing learned.
    for errno in [libc::EFAULT, libc::ENOMEM, libc::ENOSPC] {
        f.fail_once(
            CallKind::PopulateWrite,
            f.calls(CallKind::PopulateWrite) + 1,
            errno,
        );
        assert!(t.map_write(0, 8192).is_none());
        assert_eq!(t.caps().get(Method::MapWrite), Tri::Unknown);
    }
    assert!(t.map_write(0, 8192).is_some());
    assert_eq!(t.caps().get(Method::MapWrite), Tri::Works);
    // A kernel without MADV_POPULATE_WRITE (before 5.14): learned, never
    // asked again.
    let tmp2 = cached_file(1 << 20);
    let (t2, f2) = open_fault(&tmp2, OpenOptions::default());
    f2.fail_from(CallKind::PopulateWrite, 1, libc::EINVAL);
    assert!(t2.map_write(0, 8192).is_none());
    assert_eq!(t2.caps().get(Method::MapWrite), Tri::Fails);
    assert!(t2.map_write(0, 8192).is_none());
    assert_eq!(f2.calls(CallKind::PopulateWrite), 1);
    // A file system without mmap.
    let tmp3 = cached_file(1 << 20);
    let (t3, f3) = open_fault(&tmp3, OpenOptions::default());
    f3.fail_from(CallKind::Mmap, 1, libc::ENODEV);
    assert!(t3.map_write(0, 8192).is_none());
    assert_eq!(t3.caps().get(Method::MapWrite), Tri::Fails);
}

/// The reason mapped writes are safe: a page that cannot be faulted in
/// during recv's copy is EFAULT, not a SIGBUS. The file is truncated under a
/// populated mapping, so the pages recv copies into lie past its end.
#[test]
fn map_write_into_pages_gone_past_the_end_is_efault_not_sigbus() {
    let size = 1u64 << 20;
    let tmp = cached_file(size);
    let (t, _f) = open_fault(&tmp, OpenOptions::default());
    let mut w = t.map_write(512 << 10, 256 << 10).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&tmp.path)
        .unwrap()
        .set_len(0)
        .unwrap();
    let e = recv_all(&mut w, &[7u8; 256 << 10]).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
    assert_eq!(w.received(), 0);
}
