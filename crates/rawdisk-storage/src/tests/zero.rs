//! The zero chain: which method, falling through, learning, chunking.

use super::*;

#[test]
fn zero_uses_punch_hole_on_ext4_and_frees() {
    let size = 4 << 20;
    let tmp = tmp_file(0);
    let t = Target::open(&tmp.path, &OpenOptions::default()).unwrap();
    fill(&t, size);
    t.flush().unwrap();
    let before = t.allocated_bytes().unwrap();
    let o = t.zero(1 << 20, 2 << 20, TRIM).unwrap();
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
    let trim = TRIM;
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
        let e = t.zero(4096, 8192, TRIM).unwrap_err();
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
    // Second call: no syscall at all.
    let calls = f.counts();
    let e = t.zero(8192, 65536, fast).unwrap_err();
    assert_eq!(e.errno(), Some(libc::ENOTSUP));
    assert_eq!(
        f.counts(),
        calls,
        "a syscall was made for a hopeless fast zero"
    );
    assert!(!t.can_fast_zero());
    check_zeroed(&t, size, 0, 0);
    // Without fast_only the same request writes.
    let o = t.zero(8192, 65536, TRIM).unwrap();
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
    let o = t.zero(777, 50_001, TRIM).unwrap();
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
    let o = t.zero(5, 700_000, TRIM).unwrap();
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
fn zero_and_trim_inside_the_known_size_make_no_fstat() {
    // On NFS each fstat is a GETATTR round trip: one per request showed in
    // the seed's benchmark as more operations than nbdkit needs.
    let size = 1 << 20;
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    fill(&t, size);
    assert_eq!(t.size(), size);
    let before = f.calls(CallKind::Fstat);
    t.zero(4096, 65536, TRIM).unwrap();
    t.zero(100_000, 5000, ZeroFlags::default()).unwrap();
    t.trim(4096, 8192).unwrap();
    assert_eq!(f.calls(CallKind::Fstat), before);
    let mut want = pattern(0, size as usize);
    want[4096..4096 + 65536].fill(0);
    want[100_000..105_000].fill(0);
    let mut got = vec![0u8; size as usize];
    t.read_at(&mut got, 0).unwrap();
    assert!(got == want, "bytes differ from the model");

    // Past the size last seen the file is looked at again: grown by someone
    // else, the range is inside it; not grown, it is refused untouched.
    let e = t.zero(size - 4096, 8192, TRIM).unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
    assert_eq!(std::fs::metadata(&tmp.path).unwrap().len(), size);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&tmp.path)
        .unwrap()
        .set_len(size + 8192)
        .unwrap();
    let before = f.calls(CallKind::Fstat);
    t.zero(size - 4096, 8192, TRIM).unwrap();
    assert_eq!(f.calls(CallKind::Fstat), before + 1);
}
