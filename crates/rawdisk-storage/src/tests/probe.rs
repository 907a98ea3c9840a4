//! Trying the methods on purpose (`probe_methods`).

use super::*;

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
    // A refused KEEP_SIZE says nothing of fallocate(0), the mode the engine
    // uses (the NFS 4.2 client refuses KEEP_SIZE alone): nothing learned,
    // so punch-alloc stays open too.
    assert_eq!(t.caps().get(Method::Fallocate), Tri::Unknown);
    assert_eq!(t.caps().get(Method::PunchAlloc), Tri::Unknown);
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
