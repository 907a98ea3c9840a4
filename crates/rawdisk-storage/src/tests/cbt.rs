//! Changed-block tracking on real files: a tracker and state-file commands
//! against a model of the checkpoints (a set of chunks each, and U), and the
//! safety rules (crash, outside change, corrupt header, locks, I/O errors).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};

use super::{tmp_file, Tmp};
use crate::cbt::{CbtError, StateFile, TrackOptions, Tracker, STATE_SUFFIX};
use crate::fault::FaultSys;
use crate::sys::CallKind;

const G: u64 = 4096;

fn opts() -> TrackOptions {
    TrackOptions {
        granularity: Some(G),
        state_dir: None,
    }
}

fn size_of(t: &Tmp) -> u64 {
    std::fs::metadata(&t.path).unwrap().len()
}

/// Resize the target as another program would.
fn set_len(t: &Tmp, size: u64) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&t.path)
        .unwrap();
    f.set_len(size).unwrap();
}

fn track(t: &Tmp) -> Tracker {
    Tracker::open(&t.path, size_of(t), &opts()).unwrap()
}

/// The state file, made by a tracker at granularity [`G`] if absent.
fn state(t: &Tmp) -> StateFile {
    let mut name = t.path.file_name().unwrap().to_os_string();
    name.push(STATE_SUFFIX);
    if !t.path.with_file_name(name).exists() {
        track(t).close().unwrap();
    }
    StateFile::open(&t.path, None, true).unwrap()
}

/// The checkpoints and U as the model has them: what every query must equal.
#[derive(Default, Clone)]
struct Model {
    cps: Vec<(String, BTreeSet<u64>)>,
    u: BTreeSet<u64>,
}

impl Model {
    fn mark(&mut self, offset: u64, len: u64, chunks: u64) {
        if len == 0 {
            return;
        }
        let last = ((offset + len - 1) / G).min(chunks - 1);
        self.u.extend(offset / G..=last);
    }

    fn persist(&mut self) {
        if let Some((_, b)) = self.cps.last_mut() {
            b.extend(&self.u);
        }
        self.u.clear();
    }

    fn delete(&mut self, k: usize) {
        let (_, b) = self.cps.remove(k);
        if k > 0 {
            self.cps[k - 1].1.extend(b);
        }
    }

    fn since(&self, k: usize) -> BTreeSet<u64> {
        let mut s = self.u.clone();
        for (_, b) in &self.cps[k..] {
            s.extend(b);
        }
        s
    }

    /// `Tracker::changed` by definition, chunk by chunk.
    fn runs(&self, k: usize, chunks: u64, offset: u64, len: u64, max: usize) -> Vec<(u64, bool)> {
        let set = self.since(k);
        crate::cbt::bitmap::naive_runs(G, chunks, |c| set.contains(&c), offset, len, max)
    }
}

fn check_all(tr: &Tracker, m: &Model, chunks: u64, size: u64, rng: &mut impl Rng) {
    let names: Vec<String> = tr.checkpoints().into_iter().map(|c| c.name).collect();
    let want: Vec<String> = m.cps.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(names, want);
    for (k, (name, _)) in m.cps.iter().enumerate() {
        // The whole target, unlimited: exactly the model's set.
        let whole = tr.changed(name, 0, size, usize::MAX).unwrap();
        assert_eq!(
            whole,
            m.runs(k, chunks, 0, size, usize::MAX),
            "{name} whole"
        );
        for _ in 0..4 {
            let offset = rng.gen_range(0..size);
            let len = rng.gen_range(1..=size - offset);
            let max = rng.gen_range(1..5);
            let got = tr.changed(name, offset, len, max).unwrap();
            assert_eq!(
                got,
                m.runs(k, chunks, offset, len, max),
                "{name} at {offset} len {len} max {max}"
            );
        }
    }
    assert_eq!(tr.changed("never-made", 0, size, 8), None);
}

/// Random marks, persists, and checkpoints created and deleted by another
/// handle while served: every query equals the model; a clean close and a
/// new tracker give the same answers (U persisted by the close).
#[test]
fn tracker_matches_the_model_through_creates_deletes_and_reopen() {
    let chunks = 300;
    let size = chunks * G - 1000; // a partial last chunk
    let t = tmp_file(size);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(2020);
    let tr = track(&t);
    let mut sf = state(&t);
    assert!(sf.served().unwrap());
    let mut m = Model::default();
    let mut next = 0;
    for step in 0..300 {
        match rng.gen_range(0..20) {
            0..=9 => {
                let offset = rng.gen_range(0..size);
                let len = rng.gen_range(0..(64 * G).min(size - offset) + 1);
                tr.mark(offset, len);
                m.mark(offset, len, chunks);
            }
            10..=12 => {
                tr.persist().unwrap();
                m.persist();
            }
            13..=14 if m.cps.len() < 6 => {
                next += 1;
                let name = format!("c{next}");
                sf.create_checkpoint(Some(&name)).unwrap();
                tr.refresh().unwrap();
                m.cps.push((name, BTreeSet::new()));
            }
            15 if !m.cps.is_empty() => {
                let k = rng.gen_range(0..m.cps.len());
                sf.delete_checkpoint(&m.cps[k].0.clone()).unwrap();
                tr.refresh().unwrap();
                m.delete(k);
            }
            _ => {}
        }
        if step % 10 == 0 {
            check_all(&tr, &m, chunks, size, &mut rng);
        }
    }
    check_all(&tr, &m, chunks, size, &mut rng);
    tr.close().unwrap();
    drop(tr);
    m.persist();
    // The file alone (unserved): changed_ranges agree.
    for (k, (name, _)) in m.cps.iter().enumerate() {
        let mut want = Vec::new();
        let mut at = 0;
        for (len, ch) in m.runs(k, chunks, 0, size, usize::MAX) {
            if ch {
                want.push((at, len));
            }
            at += len;
        }
        assert_eq!(sf.changed_ranges(name).unwrap(), want, "{name}");
        assert!(sf.list().unwrap().iter().all(|c| c.consistent));
    }
    let tr = track(&t);
    check_all(&tr, &m, chunks, size, &mut rng);
}

/// A checkpoint created by another process between two persists gets the
/// marks made since the last persist (they may be after it); marks
/// persisted before it are not in it.
#[test]
fn checkpoint_made_while_served_gets_the_unpersisted_marks() {
    let t = tmp_file(64 * G);
    let tr = track(&t);
    let mut sf = state(&t);
    sf.create_checkpoint(Some("a")).unwrap();
    tr.refresh().unwrap();
    tr.mark(0, G);
    tr.persist().unwrap();
    tr.mark(10 * G, 1);
    let b = sf.create_checkpoint(None).unwrap();
    assert_eq!(b.name, "cp-1");
    tr.refresh().unwrap();
    tr.mark(20 * G, 1);
    let runs = tr.changed("cp-1", 0, 64 * G, usize::MAX).unwrap();
    assert_eq!(
        runs,
        vec![
            (10 * G, false),
            (G, true),
            (9 * G, false),
            (G, true),
            (43 * G, false)
        ]
    );
    // persist writes U into the newest checkpoint's slot only.
    tr.persist().unwrap();
    assert_eq!(tr.persisted("cp-1"), vec![10, 20]);
    assert_eq!(tr.persisted("a"), vec![0, 10, 20]);
}

/// Marks from several threads while persists run: after a clean close,
/// every chunk marked is in the file, and nothing else.
#[test]
fn concurrent_marks_and_persists_lose_nothing() {
    let chunks = 4096;
    let t = tmp_file(chunks * G);
    state(&t).create_checkpoint(Some("a")).unwrap();
    let tr = Arc::new(track(&t));
    let marked: Vec<BTreeSet<u64>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4u64)
            .map(|i| {
                let tr = tr.clone();
                s.spawn(move || {
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(i);
                    let mut set = BTreeSet::new();
                    for _ in 0..2000 {
                        let c = rng.gen_range(0..chunks);
                        tr.mark(c * G + rng.gen_range(0..G), 1);
                        set.insert(c);
                    }
                    set
                })
            })
            .collect();
        for _ in 0..50 {
            tr.persist().unwrap();
        }
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    tr.persist().unwrap();
    let want: Vec<u64> = marked
        .into_iter()
        .flatten()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(tr.persisted("a"), want);
    tr.close().unwrap();
}

#[test]
fn persist_does_io_only_for_newly_marked_chunks() {
    let t = tmp_file(64 * G);
    let sys = FaultSys::real();
    let tr = Tracker::open_with_sys(&t.path, 64 * G, &opts(), sys.clone()).unwrap();
    state(&t).create_checkpoint(Some("a")).unwrap();
    tr.mark(5 * G, 3 * G);
    tr.persist().unwrap();
    // Nothing marked since the last persist: no syscall at all.
    let before = sys.counts();
    tr.persist().unwrap();
    tr.persist().unwrap();
    assert_eq!(sys.counts(), before);
    let io = || (sys.calls(CallKind::Pwrite), sys.calls(CallKind::Fdatasync));
    let before = io();
    // Already in the newest bitmap: the persist re-reads the header (a
    // checkpoint may have come) but writes and syncs nothing.
    tr.mark(5 * G, G);
    tr.persist().unwrap();
    assert_eq!(io(), before);
    // One new chunk: its page, its index page and the header are written,
    // and synced once.
    tr.mark(9 * G, 1);
    tr.persist().unwrap();
    assert_eq!(io(), (before.0 + 3, before.1 + 1));
    let g = tr.granularity();
    assert_eq!(
        tr.changed("a", 9 * G, 4 * g, 8),
        Some(vec![(g, true), (3 * g, false)])
    );
}

/// Wait for the served lock of an abandoned tracker to go: a child of a
/// test running beside this one, forked but not yet exec'd, briefly shares
/// the descriptor and so the lock.
pub(super) fn wait_unserved(sf: &StateFile) {
    let t0 = std::time::Instant::now();
    while sf.served().unwrap() {
        assert!(
            t0.elapsed().as_secs() < 10,
            "the served lock outlived its tracker"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A persist writes the bitmap pages that gained bits, then the index page
/// recording them, then the header (the commit point), nothing else, then
/// fdatasyncs: its I/O follows the changes, not the target's size.
#[test]
fn persist_writes_only_the_pages_that_gained_bits() {
    // 1 GiB at 4 KiB: 8 bitmap pages of 32768 chunks each, in slot 0.
    let size = 1 << 30;
    let t = tmp_file(size);
    state(&t).create_checkpoint(Some("a")).unwrap();
    let sys = FaultSys::real();
    let tr = Tracker::open_with_sys(&t.path, size, &opts(), sys.clone()).unwrap();
    let page_span = 32768 * G;
    tr.mark(7, 1);
    tr.mark(5 * page_span + 3 * G, 10 * G);
    tr.mark(5 * page_span, 1);
    sys.record();
    tr.persist().unwrap();
    let log = sys.take_log();
    let writes: Vec<(u64, u64)> = log
        .iter()
        .filter(|c| c.kind == CallKind::Pwrite)
        .map(|c| (c.offset, c.len))
        .collect();
    // Slot 0's pages; the index of slot 0 after the 32 slots of 8 pages.
    let index = 4096 + 32 * 8 * 4096;
    assert_eq!(
        writes,
        [
            (4096, 4096),
            (4096 + 5 * 4096, 4096),
            (index, 4096),
            (0, 4096)
        ]
    );
    let last = log
        .iter()
        .rposition(|c| c.kind == CallKind::Pwrite)
        .unwrap();
    assert!(
        log[last..].iter().any(|c| c.kind == CallKind::Fdatasync),
        "{log:?}"
    );
    let mut want = vec![0, 5 * 32768];
    want.extend(5 * 32768 + 3..5 * 32768 + 13);
    assert_eq!(tr.persisted("a"), want);
}

fn reasons(sf: &StateFile) -> Vec<(String, bool, Option<String>)> {
    sf.list()
        .unwrap()
        .into_iter()
        .map(|c| (c.name, c.consistent, c.reason))
        .collect()
}

/// A tracker that goes away without closing (kill -9: open flag left, lock
/// released by the kernel) makes every checkpoint inconsistent, all
/// changed; a checkpoint made after it is consistent.
#[test]
fn crash_makes_every_checkpoint_inconsistent() {
    let t = tmp_file(64 * G);
    let mut sf = state(&t);
    sf.create_checkpoint(Some("a")).unwrap();
    sf.create_checkpoint(Some("b")).unwrap();
    let tr = track(&t);
    tr.mark(G, G);
    tr.persist().unwrap();
    tr.abandon();
    wait_unserved(&sf);
    let r = reasons(&sf);
    assert_eq!(r.len(), 2);
    for (_, consistent, reason) in &r {
        assert!(!consistent);
        assert!(reason
            .as_deref()
            .unwrap()
            .contains("did not shut down cleanly"));
    }
    assert_eq!(sf.changed_ranges("a").unwrap(), vec![(0, 64 * G)]);
    let tr = track(&t);
    assert_eq!(tr.changed("b", 100, 5000, 8).unwrap(), vec![(5000, true)]);
    tr.close().unwrap();
    sf.create_checkpoint(Some("c")).unwrap();
    let tr = track(&t);
    tr.mark(3 * G, 1);
    assert_eq!(
        tr.changed("c", 0, 64 * G, 9).unwrap(),
        vec![(3 * G, false), (G, true), (60 * G, false)]
    );
    tr.close().unwrap();
    let r = reasons(&sf);
    assert_eq!(
        r.iter().map(|(_, c, _)| *c).collect::<Vec<_>>(),
        [false, false, true]
    );
    // Deleting the oldest inconsistent one leaves the others as they were.
    sf.delete_checkpoint("a").unwrap();
    assert_eq!(sf.changed_ranges("c").unwrap(), vec![(3 * G, G)]);
}

/// Changes made while no tracker had the target (a write moves mtime, a
/// resize the size) make every checkpoint inconsistent.
#[test]
fn outside_change_is_detected() {
    for resize in [false, true] {
        let t = tmp_file(64 * G);
        let mut sf = state(&t);
        sf.create_checkpoint(Some("a")).unwrap();
        let tr = track(&t);
        tr.mark(0, 1);
        tr.close().unwrap();
        drop(tr);
        assert_eq!(sf.changed_ranges("a").unwrap(), vec![(0, G)]);
        // Past the file system's timestamp granularity.
        std::thread::sleep(Duration::from_millis(30));
        if resize {
            set_len(&t, 65 * G);
        } else {
            rawdisk_testkit::write_at(&t.path, 7 * G, b"outside");
            assert_eq!(rawdisk_testkit::read_range(&t.path, 7 * G, 7), b"outside");
        }
        let r = reasons(&sf);
        let why = if resize {
            "size changed"
        } else {
            "was modified"
        };
        assert!(!r[0].1, "{why}");
        assert!(r[0].2.as_deref().unwrap().contains(why), "{r:?}");
        let whole = size_of(&t);
        assert_eq!(sf.changed_ranges("a").unwrap(), vec![(0, whole)]);
        // A tracker started now sees it too (and records the new size).
        let tr = Tracker::open(&t.path, whole, &opts()).unwrap();
        assert_eq!(tr.changed("a", 0, whole, 4).unwrap(), vec![(whole, true)]);
        assert!(!tr.checkpoints()[0].consistent);
    }
}

/// A target resized behind a tracking server's back: the close says so
/// and the bitmaps (whose layout follows the size) are dropped.
#[test]
fn resize_while_served_makes_every_checkpoint_inconsistent() {
    let t = tmp_file(64 * G);
    state(&t).create_checkpoint(Some("a")).unwrap();
    let tr = track(&t);
    tr.mark(G, 1);
    set_len(&t, 1000 * G);
    tr.close().unwrap();
    drop(tr);
    let sf = state(&t);
    let r = reasons(&sf);
    // Said as it happened: while a tracking server had it.
    let why = r[0].2.as_deref().unwrap();
    assert!(why.contains("size changed while it was tracked"), "{r:?}");
    assert_eq!(sf.changed_ranges("a").unwrap(), vec![(0, 1000 * G)]);
    let tr = Tracker::open(&t.path, 1000 * G, &opts()).unwrap();
    tr.mark(999 * G, G);
    tr.close().unwrap();
}

/// A file moved over the target while it is served: the close records the
/// inode it served, so the next opener sees another file at the path and
/// makes every checkpoint inconsistent. The same target closed untouched
/// stays consistent, and a state file without an identity (older rawdisk)
/// takes the one it finds.
#[test]
fn a_file_moved_over_the_served_one_is_another_file() {
    for replace in [false, true] {
        let t = tmp_file(64 * G);
        let mut sf = state(&t);
        sf.create_checkpoint(Some("a")).unwrap();
        let tr = track(&t);
        tr.mark(2 * G, 1);
        tr.persist().unwrap();
        if replace {
            let new = t.path.with_file_name("new");
            std::fs::File::create(&new)
                .unwrap()
                .set_len(64 * G)
                .unwrap();
            std::fs::rename(&new, &t.path).unwrap();
        }
        tr.close().unwrap();
        drop(tr);
        let r = reasons(&sf);
        if replace {
            assert!(!r[0].1, "{r:?}");
            assert!(r[0].2.as_deref().unwrap().contains("another file"), "{r:?}");
            assert_eq!(sf.changed_ranges("a").unwrap(), vec![(0, 64 * G)]);
        } else {
            assert!(r[0].1, "{r:?}");
            assert_eq!(sf.changed_ranges("a").unwrap(), vec![(2 * G, G)]);
        }
    }
    // Identity unknown (the reserved bytes zero, CRC fixed): recorded now,
    // nothing made inconsistent.
    let t = tmp_file(64 * G);
    let mut sf = state(&t);
    sf.create_checkpoint(Some("a")).unwrap();
    let mut name = t.path.file_name().unwrap().to_os_string();
    name.push(STATE_SUFFIX);
    let sp = t.path.with_file_name(name);
    let mut page = rawdisk_testkit::read_range(&sp, 0, 4096);
    page[80..100].fill(0);
    let crc = crate::cbt::format::crc32(&page[..4092]);
    page[4092..].copy_from_slice(&crc.to_le_bytes());
    rawdisk_testkit::write_at(&sp, 0, &page);
    assert!(reasons(&sf)[0].1);
    let tr = track(&t);
    tr.close().unwrap();
    drop(tr);
    let page = rawdisk_testkit::read_range(&sp, 0, 4096);
    assert_eq!(&page[96..100], &1u32.to_le_bytes());
    assert!(reasons(&sf)[0].1);
}

/// A header whose CRC does not match: every checkpoint inconsistent
/// ("corrupt"), names kept; new checkpoints work.
#[test]
fn corrupt_header_makes_every_checkpoint_inconsistent() {
    let t = tmp_file(64 * G);
    let mut sf = state(&t);
    sf.create_checkpoint(Some("a")).unwrap();
    sf.create_checkpoint(Some("b")).unwrap();
    let path = sf.path().to_path_buf();
    drop(sf);
    // One bit of a's creation time.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[128 + 64] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let mut sf = state(&t);
    let r = reasons(&sf);
    assert_eq!(r.len(), 2);
    for (_, consistent, reason) in &r {
        assert!(!consistent && reason.as_deref().unwrap().contains("corrupt"));
    }
    let tr = track(&t);
    assert_eq!(tr.changed("a", 0, G, 1).unwrap(), vec![(G, true)]);
    tr.close().unwrap();
    drop(tr);
    sf.create_checkpoint(Some("after")).unwrap();
    assert_eq!(sf.changed_ranges("after").unwrap(), vec![]);
    assert!(sf.list().unwrap()[2].consistent);
}

#[test]
fn second_tracker_is_refused_until_the_first_closes() {
    let t = tmp_file(64 * G);
    let tr = track(&t);
    let e = Tracker::open(&t.path, 64 * G, &opts()).unwrap_err();
    assert!(
        e.to_string().contains("another process already tracks"),
        "{e}"
    );
    assert!(e.to_string().contains(STATE_SUFFIX), "{e}");
    tr.close().unwrap();
    assert!(!state(&t).served().unwrap());
    track(&t).close().unwrap();
}

#[test]
fn granularity_mismatch_names_both() {
    let t = tmp_file(64 * G);
    track(&t).close().unwrap();
    let o = TrackOptions {
        granularity: Some(64 << 10),
        state_dir: None,
    };
    let e = Tracker::open(&t.path, 64 * G, &o).unwrap_err().to_string();
    assert!(e.contains("65536") && e.contains("4096"), "{e}");
    let o = TrackOptions {
        granularity: Some(3000),
        state_dir: None,
    };
    let e = Tracker::open(&t.path, 64 * G, &o).unwrap_err().to_string();
    assert!(e.contains("power of two"), "{e}");
    // None takes the file's.
    let tr = Tracker::open(&t.path, 64 * G, &TrackOptions::default()).unwrap();
    assert_eq!(tr.granularity(), G);
}

#[test]
fn names_duplicates_and_missing_are_refused() {
    let t = tmp_file(64 * G);
    let mut sf = state(&t);
    for bad in ["", "-x", ".x", "a b", "a/b", &"x".repeat(64), "ä"] {
        let e = sf.create_checkpoint(Some(bad)).unwrap_err().to_string();
        assert!(e.contains("invalid checkpoint name"), "{bad:?}: {e}");
    }
    sf.create_checkpoint(Some(&"x".repeat(63))).unwrap();
    sf.create_checkpoint(Some("cp-7")).unwrap();
    assert_eq!(sf.create_checkpoint(None).unwrap().name, "cp-8");
    let e = sf.create_checkpoint(Some("cp-7")).unwrap_err().to_string();
    assert!(e.contains("'cp-7' exists"), "{e}");
    let e = sf.delete_checkpoint("nope").unwrap_err().to_string();
    assert!(
        e.contains("no checkpoint named 'nope'") && e.contains("cp-8"),
        "{e}"
    );
    let e = sf.changed_ranges("nope").unwrap_err().to_string();
    assert!(e.contains("no checkpoint named 'nope'"), "{e}");
    assert!(!e.contains('\n'));
    while sf.list().unwrap().len() < crate::cbt::MAX_CHECKPOINTS {
        sf.create_checkpoint(None).unwrap();
    }
    let e = sf.create_checkpoint(None).unwrap_err().to_string();
    assert!(e.contains("delete one"), "{e}");
    // Without `create`, a missing state file is one clear line.
    let u = tmp_file(G);
    let e = StateFile::open(&u.path, None, false)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("has no checkpoints yet"), "{e}");
}

/// changed_ranges refuses while served: the server holds unpersisted bits.
#[test]
fn changed_ranges_refuses_while_served() {
    let t = tmp_file(64 * G);
    let mut sf = state(&t);
    sf.create_checkpoint(Some("a")).unwrap();
    let tr = track(&t);
    let e = sf.changed_ranges("a").unwrap_err().to_string();
    assert!(e.contains("NBD export"), "{e}");
    tr.close().unwrap();
    assert_eq!(sf.changed_ranges("a").unwrap(), vec![]);
}

fn failing_persist(kind: CallKind, errno: i32) {
    let t = tmp_file(256 * G);
    let sys = FaultSys::real();
    let tr = Tracker::open_with_sys(&t.path, 256 * G, &opts(), sys.clone()).unwrap();
    state(&t).create_checkpoint(Some("a")).unwrap();
    tr.mark(0, G);
    tr.mark(200 * G, 2 * G);
    sys.fail_once(kind, sys.calls(kind) + 1, errno);
    let e: CbtError = tr.persist().unwrap_err();
    assert_eq!(e.errno(), Some(errno), "{e}");
    assert!(e.to_string().contains(STATE_SUFFIX), "{e}");
    // Still reported while they wait for the next persist.
    assert_eq!(
        tr.changed("a", 0, 256 * G, 9).unwrap(),
        vec![(G, true), (199 * G, false), (2 * G, true), (54 * G, false)]
    );
    tr.persist().unwrap();
    assert_eq!(tr.persisted("a"), vec![0, 200, 201]);
    tr.close().unwrap();
    drop(tr);
    assert_eq!(
        state(&t).changed_ranges("a").unwrap(),
        vec![(0, G), (200 * G, 2 * G)]
    );
}

#[test]
fn persist_failing_on_pwrite_keeps_the_bits_for_the_next() {
    failing_persist(CallKind::Pwrite, libc::EIO);
    failing_persist(CallKind::Pwrite, libc::ENOSPC);
}

/// The state file of a 1 TiB sparse target with a few marks stays small:
/// untouched bitmap pages are holes.
#[test]
fn state_of_a_sparse_terabyte_stays_small() {
    let t = tmp_file(1 << 40);
    let mut sf = StateFile::open(&t.path, None, true).unwrap();
    sf.create_checkpoint(Some("a")).unwrap();
    sf.create_checkpoint(Some("b")).unwrap();
    let tr = Tracker::open(&t.path, 1 << 40, &TrackOptions::default()).unwrap();
    for i in 0..8u64 {
        tr.mark(i * (100 << 30), 1 << 20);
    }
    tr.close().unwrap();
    drop(tr);
    sf.delete_checkpoint("b").unwrap();
    let path = sf.path().to_path_buf();
    let allocated = rawdisk_testkit::allocated_bytes(&path);
    let apparent = std::fs::metadata(&path).unwrap().len();
    println!("state file of a 1 TiB sparse target, 8 marks, 64 KiB granularity: allocated {allocated} bytes, apparent {apparent} bytes");
    // The header and 8 bitmap pages (b's slot punched out by its delete),
    // plus what the file system rounds up; 2 MiB would be one whole slot.
    assert!(allocated <= 128 << 10, "allocated {allocated}");
    assert_eq!(sf.changed_ranges("a").unwrap().len(), 8);
}

/// A block device keeps its state in a state dir; without one the error
/// says to pass it.
#[test]
#[ignore = "needs root"]
fn block_device_needs_a_state_dir() {
    rawdisk_testkit::require_root();
    let dev = rawdisk_testkit::LoopDev::new(8 << 20, 512);
    let e = Tracker::open(dev.path(), 8 << 20, &TrackOptions::default()).unwrap_err();
    assert!(e.to_string().contains("--state-dir"), "{e}");
    let e = StateFile::open(dev.path(), None, true).err().unwrap();
    assert!(e.to_string().contains("--state-dir"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let o = TrackOptions {
        granularity: None,
        state_dir: Some(dir.path().to_path_buf()),
    };
    let mut sf = StateFile::open(dev.path(), Some(dir.path()), true).unwrap();
    sf.create_checkpoint(Some("a")).unwrap();
    let tr = Tracker::open(dev.path(), 8 << 20, &o).unwrap();
    tr.mark(1 << 20, 1);
    tr.close().unwrap();
    drop(tr);
    let name = format!(
        "{}{STATE_SUFFIX}",
        dev.path().file_name().unwrap().to_str().unwrap()
    );
    assert_eq!(sf.path(), dir.path().join(name));
    assert_eq!(sf.changed_ranges("a").unwrap(), vec![(1 << 20, 64 << 10)]);
}
