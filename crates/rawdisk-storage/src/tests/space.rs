//! Trim, extents and preallocation.

use super::*;

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

/// One lookup per run (and one to find the end): where SEEK_DATA found the
/// end of a hole, data starts, so only SEEK_HOLE is asked there.
#[test]
fn extents_look_up_each_run_once() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    let blk = 64 << 10;
    t.preallocate(16 * blk, Prealloc::Off).unwrap();
    for i in (0..16).step_by(2) {
        t.write_at(&pattern(i * blk, blk as usize), i * blk, false)
            .unwrap();
    }
    let (data0, hole0) = (f.calls(CallKind::SeekData), f.calls(CallKind::SeekHole));
    let all = t.extents(0, 16 * blk, 1000).unwrap();
    assert_eq!(all.len(), 16, "{all:?}");
    for (i, e) in all.iter().enumerate() {
        assert_eq!((e.offset, e.len), (i as u64 * blk, blk));
        assert_eq!(e.kind == ExtentKind::Data, i % 2 == 0, "{all:?}");
    }
    let data = f.calls(CallKind::SeekData) - data0;
    let hole = f.calls(CallKind::SeekHole) - hole0;
    assert_eq!((data, hole), (9, 8), "SEEK_DATA and SEEK_HOLE calls");
    // From inside a hole: the hole's end, then each data run's.
    let some = t.extents(blk + 5, 3 * blk, 1000).unwrap();
    assert_eq!(some.len(), 4, "{some:?}");
    assert_eq!(some[0].offset, blk + 5);
    assert_eq!(some[3].offset + some[3].len, 4 * blk + 5);
    assert_eq!(f.calls(CallKind::SeekData) - data0 - data, 2);
    assert_eq!(f.calls(CallKind::SeekHole) - hole0 - hole, 2);
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
