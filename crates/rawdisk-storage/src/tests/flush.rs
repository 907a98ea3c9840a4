//! The flush-failure rule: after one failed sync of a target (or of a
//! state file), every later flush and FUA write fails with EIO until the
//! target is opened again, because the kernel reports a write-back error
//! once and a second fdatasync would report success for lost data.

use super::*;
use crate::cbt::{StateFile, TrackOptions, Tracker};

fn eio<T: std::fmt::Debug>(r: crate::Result<T>) -> String {
    let e = r.unwrap_err();
    assert_eq!(e.errno(), Some(libc::EIO), "{e}");
    e.to_string()
}

#[test]
fn a_failed_flush_fails_every_later_flush_and_fua_write() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    let data = pattern(0, 64 << 10);
    t.write_at(&data, 0, false).unwrap();
    t.flush().unwrap();
    // fdatasync fails once, as the kernel reports a write-back error once.
    f.fail_once(
        CallKind::Fdatasync,
        f.calls(CallKind::Fdatasync) + 1,
        libc::EIO,
    );
    eio(t.flush());
    let syncs = f.calls(CallKind::Fdatasync);
    let msg = eio(t.flush());
    assert!(msg.contains("an earlier flush"), "{msg}");
    eio(t.flush());
    // Neither the RWF_DSYNC write nor the fdatasync fallback is tried, and
    // nothing of a refused FUA write is written.
    let dsyncs = f.calls(CallKind::PwriteDsync);
    eio(t.write_at(&[7u8; 4096], 4096, true));
    assert_eq!(f.calls(CallKind::PwriteDsync), dsyncs);
    assert_eq!(
        f.calls(CallKind::Fdatasync),
        syncs,
        "a refused sync was tried"
    );
    // Writes without FUA promise nothing durable and still work.
    t.write_at(&[9u8; 100], 100, false).unwrap();
    let mut back = vec![0u8; data.len()];
    t.read_at(&mut back, 0).unwrap();
    let mut want = data.clone();
    want[100..200].fill(9);
    assert_eq!(back, want);
    // A new open starts clean.
    let (t2, _f2) = open_fault(&tmp, OpenOptions::default());
    t2.write_at(&[5u8; 10], 0, true).unwrap();
    t2.flush().unwrap();
    eio(t.flush());
}

#[test]
fn a_failed_fua_sync_counts_as_a_failed_flush() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    // A FUA write by RWF_DSYNC failing with EIO consumed the error.
    f.fail_once(CallKind::PwriteDsync, 1, libc::EIO);
    eio(t.write_at(b"abc", 0, true));
    eio(t.flush());
    eio(t.write_at(b"abc", 0, true));
    // No space for a RWF_DSYNC write is a write error, not a lost sync.
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    f.fail_once(CallKind::PwriteDsync, 1, libc::ENOSPC);
    assert_eq!(
        t.write_at(b"abc", 0, true).unwrap_err().errno(),
        Some(libc::ENOSPC)
    );
    t.flush().unwrap();
    // The fdatasync behind a FUA write on a kernel without RWF_DSYNC.
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    f.fail_from(CallKind::PwriteDsync, 1, libc::ENOSYS);
    f.fail_once(CallKind::Fdatasync, 1, libc::EIO);
    eio(t.write_at(b"abc", 0, true));
    eio(t.flush());
    let mut b = [0u8; 3];
    t.read_at(&mut b, 0).unwrap();
    assert_eq!(&b, b"abc");
}

#[test]
fn under_cache_none_too() {
    let tmp = tmp_file(64 << 10);
    let (t, f) = open_fault(&tmp, direct_opts());
    f.fail_once(
        CallKind::Fdatasync,
        f.calls(CallKind::Fdatasync) + 1,
        libc::EIO,
    );
    eio(t.flush());
    eio(t.flush());
    eio(t.write_at(&[1u8; 4096], 0, true));
    let mut b = vec![1u8; 4096];
    t.read_at(&mut b, 0).unwrap();
    assert!(b.iter().all(|&x| x == 0), "a refused FUA write was written");
}

/// Concurrent flushes: one fdatasync sees the error, and none is made
/// after it.
#[test]
fn a_flush_overlapping_a_failing_one_does_not_succeed() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    t.write_at(&pattern(0, 4096), 0, false).unwrap();
    f.fail_once(
        CallKind::Fdatasync,
        f.calls(CallKind::Fdatasync) + 1,
        libc::EIO,
    );
    let before = f.calls(CallKind::Fdatasync);
    let t = Arc::new(t);
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let t = t.clone();
            std::thread::spawn(move || t.flush().is_ok())
        })
        .collect();
    let ok = threads.into_iter().map(|h| h.join().unwrap());
    let ok = ok.filter(|&ok| ok).count() as u64;
    // Those that succeeded ran before the failing call; none ran after it.
    assert!(ok < 8);
    assert_eq!(f.calls(CallKind::Fdatasync) - before, ok + 1);
    eio(t.flush());
}

#[test]
fn a_failed_persist_sync_fails_every_later_persist_and_the_close() {
    let t = tmp_file(256 << 20);
    let g = 64 << 10;
    let sys = FaultSys::real();
    let opts = TrackOptions::default();
    let mut sf = StateFile::open(&t.path, None, true).unwrap();
    sf.create_checkpoint(Some("a")).unwrap();
    let tr = Tracker::open_with_sys(&t.path, 256 << 20, &opts, sys.clone()).unwrap();
    tr.mark(0, g);
    tr.persist().unwrap();
    tr.mark(100 * g, g);
    let n = sys.calls(CallKind::Fdatasync);
    sys.fail_once(CallKind::Fdatasync, n + 1, libc::EIO);
    assert_eq!(tr.persist().unwrap_err().errno(), Some(libc::EIO));
    // Nothing new was marked, and the next fdatasync would succeed: the
    // persist still fails, without a call.
    for _ in 0..2 {
        let e = tr.persist().unwrap_err();
        assert_eq!(e.errno(), Some(libc::EIO), "{e}");
        assert!(e.to_string().contains("after a failed sync"), "{e}");
    }
    tr.mark(200 * g, g);
    assert_eq!(tr.persist().unwrap_err().errno(), Some(libc::EIO));
    assert_eq!(sys.calls(CallKind::Fdatasync), n + 1);
    // Closing cannot say the state is whole: the open flag stays, so the
    // next start treats the marks as lost.
    assert!(tr.close().is_err());
    drop(tr);
    super::cbt::wait_unserved(&sf);
    let list = sf.list().unwrap();
    assert_eq!(list.len(), 1);
    assert!(!list[0].consistent, "{:?}", list[0].reason);
    assert_eq!(sf.changed_ranges("a").unwrap(), vec![(0, 256 << 20)]);
    // A new open is clean.
    let tr = Tracker::open(&t.path, 256 << 20, &opts).unwrap();
    tr.mark(0, g);
    tr.persist().unwrap();
    tr.close().unwrap();
}
