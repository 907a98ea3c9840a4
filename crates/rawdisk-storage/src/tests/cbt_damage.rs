//! The integrity rule of the state file: damage to its bitmaps (a short
//! file, a hole, a flipped byte, a lost index page), to its header, or the
//! whole file zeroed, reads as "everything changed" with the reason, never
//! as "nothing changed". The state file is edited here as another program
//! (or a failing disk) would, byte by byte, so the tests hold whatever the
//! encoder says.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use super::{tmp_file, Tmp};
use crate::cbt::format::crc32;
use crate::cbt::{CheckpointInfo, StateFile, TrackOptions, Tracker, STATE_SUFFIX};
use crate::fault::FaultSys;
use crate::sys::{FallocMode, RealSys, Sys};

pub(super) const G: u64 = 4096;
/// 1 GiB at 4 KiB: 8 bitmap pages per slot, of 32768 chunks each.
pub(super) const SIZE: u64 = 1 << 30;
pub(super) const SLOT: u64 = 8 * 4096;
/// Chunks (and so bytes / G) covered by one bitmap page.
pub(super) const PAGE_SPAN: u64 = 32768 * G;
/// The page index of slot 0: after the header and the 32 slots.
pub(super) const INDEX0: u64 = 4096 + 32 * SLOT;
/// Header, slots, and one index page per slot.
pub(super) const FILE_LEN: u64 = INDEX0 + 32 * 4096;

pub(super) fn opts() -> TrackOptions {
    TrackOptions {
        granularity: Some(G),
        state_dir: None,
    }
}

pub(super) fn state_path(t: &Tmp) -> PathBuf {
    let mut name = t.path.file_name().unwrap().to_os_string();
    name.push(STATE_SUFFIX);
    t.path.with_file_name(name)
}

/// A target with checkpoints `names`, each followed by writes at the
/// offsets of its list (through a tracking server, closed cleanly).
pub(super) fn tracked(names: &[(&str, &[u64])]) -> Tmp {
    let t = tmp_file(SIZE);
    Tracker::open(&t.path, SIZE, &opts())
        .unwrap()
        .close()
        .unwrap();
    for (name, writes) in names {
        let mut sf = StateFile::open(&t.path, None, false).unwrap();
        sf.create_checkpoint(Some(name)).unwrap();
        let tr = Tracker::open(&t.path, SIZE, &opts()).unwrap();
        for &w in *writes {
            tr.mark(w, 1);
        }
        tr.close().unwrap();
    }
    t
}

pub(super) fn list(t: &Tmp) -> Vec<CheckpointInfo> {
    StateFile::open(&t.path, None, false)
        .unwrap()
        .list()
        .unwrap()
}

pub(super) fn ranges(t: &Tmp, name: &str) -> Vec<(u64, u64)> {
    StateFile::open(&t.path, None, false)
        .unwrap()
        .changed_ranges(name)
        .unwrap()
}

/// Every checkpoint in `names` is inconsistent for damage, reported (by the
/// state file and by a tracking server) as all changed.
pub(super) fn all_changed_for_damage(t: &Tmp, names: &[&str]) {
    let l = list(t);
    for n in names {
        let c = l.iter().find(|c| c.name == *n).expect("listed");
        assert!(!c.consistent, "{n}: {l:?}");
        let why = c.reason.as_deref().unwrap();
        assert!(why.contains("bitmap is damaged"), "{n}: {why}");
        assert_eq!(ranges(t, n), vec![(0, SIZE)], "{n}");
    }
    let tr = Tracker::open(&t.path, SIZE, &opts()).unwrap();
    for n in names {
        assert_eq!(tr.changed(n, 0, SIZE, 4).unwrap(), vec![(SIZE, true)]);
    }
    tr.close().unwrap();
}

/// After damage a new checkpoint works and reports exactly its changes;
/// the file is at least as long as its layout again. `g`: the file's
/// granularity.
fn a_new_checkpoint_works(t: &Tmp, g: u64, file_len: u64) {
    let mut sf = StateFile::open(&t.path, None, true).unwrap();
    sf.create_checkpoint(Some("fresh")).unwrap();
    let tr = Tracker::open(&t.path, SIZE, &TrackOptions::default()).unwrap();
    let at = 3 * PAGE_SPAN + 7 * G;
    tr.mark(at, 1);
    tr.close().unwrap();
    assert_eq!(ranges(t, "fresh"), vec![(at / g * g, g)]);
    assert!(std::fs::metadata(state_path(t)).unwrap().len() >= file_len);
}

fn punch(path: &Path, offset: u64, len: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    RealSys
        .fallocate(f.as_fd(), FallocMode::PunchHole, offset, len)
        .unwrap();
}

/// Edit the header page and give it a valid CRC again.
pub(super) fn rewrite_header(path: &Path, edit: impl FnOnce(&mut [u8])) {
    let mut page = rawdisk_testkit::read_range(path, 0, 4096);
    edit(&mut page);
    let crc = crc32(&page[..4092]);
    page[4092..].copy_from_slice(&crc.to_le_bytes());
    rawdisk_testkit::write_at(path, 0, &page);
}

/// Set the apparent length of the file at `p`.
pub(super) fn cut(p: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(len)
        .unwrap();
}

/// Make the state file at `p`, with `n` checkpoints, format 1 as older
/// rawdisk wrote it: version 1, no length, no index fields, the file
/// ending after the 32 slots.
pub(super) fn make_format_1(p: &Path, n: usize) {
    rewrite_header(p, |h| {
        h[8..12].copy_from_slice(&1u32.to_le_bytes());
        h[3200..3208].fill(0);
        for i in 0..n {
            h[128 + i * 96 + 88..128 + i * 96 + 96].fill(0);
        }
    });
    cut(p, INDEX0);
}

/// The sequence: writes at 0 and 32 MiB after c0, a clean stop,
/// then the state file cut to its header.
#[test]
fn a_truncated_state_file_reports_everything_changed() {
    let t = tracked(&[("c0", &[0, 32 << 20])]);
    assert_eq!(ranges(&t, "c0"), vec![(0, G), (32 << 20, G)]);
    assert_eq!(std::fs::metadata(state_path(&t)).unwrap().len(), FILE_LEN);
    cut(&state_path(&t), 4096);
    all_changed_for_damage(&t, &["c0"]);
    a_new_checkpoint_works(&t, G, FILE_LEN);
}

#[test]
fn a_hole_over_a_bitmap_page_reports_everything_changed() {
    let t = tracked(&[("c0", &[0, 5 * PAGE_SPAN + 9 * G])]);
    assert_eq!(ranges(&t, "c0"), vec![(0, G), (5 * PAGE_SPAN + 9 * G, G)]);
    // c0 is in slot 0: its page 5.
    punch(&state_path(&t), 4096 + 5 * 4096, 4096);
    all_changed_for_damage(&t, &["c0"]);
    a_new_checkpoint_works(&t, G, FILE_LEN);
}

#[test]
fn a_hole_over_an_index_page_reports_everything_changed() {
    let t = tracked(&[("c0", &[2 * PAGE_SPAN])]);
    punch(&state_path(&t), INDEX0, 4096);
    all_changed_for_damage(&t, &["c0"]);
}

#[test]
fn one_flipped_byte_in_a_bitmap_page_reports_everything_changed() {
    let t = tracked(&[("c0", &[0])]);
    let p = state_path(&t);
    // A bit of chunk 8 * 100 set that was never written: more changed, but
    // not what was recorded, so no longer trusted either.
    let mut b = rawdisk_testkit::read_range(&p, 4096 + 100, 1);
    b[0] ^= 1;
    rawdisk_testkit::write_at(&p, 4096 + 100, &b);
    all_changed_for_damage(&t, &["c0"]);
}

/// Damage to the newest checkpoint's bitmap makes every older one
/// inconsistent too ("changed since ck" includes the newest); damage to
/// the oldest leaves the newer ones exact.
#[test]
fn damage_to_a_newer_bitmap_makes_the_older_checkpoints_inconsistent() {
    let writes: [(&str, &[u64]); 3] = [("c1", &[G]), ("c2", &[PAGE_SPAN]), ("c3", &[7 * G])];
    let t = tracked(&writes);
    // Slots in creation order: c3's page 0 is in slot 2.
    let mut b = rawdisk_testkit::read_range(&state_path(&t), 4096 + 2 * SLOT, 1);
    b[0] ^= 0x80;
    rawdisk_testkit::write_at(&state_path(&t), 4096 + 2 * SLOT, &b);
    all_changed_for_damage(&t, &["c1", "c2", "c3"]);

    let t = tracked(&writes);
    punch(&state_path(&t), 4096, 4096);
    let l = list(&t);
    assert!(
        !l[0].consistent && l[1].consistent && l[2].consistent,
        "{l:?}"
    );
    assert_eq!(ranges(&t, "c2"), vec![(7 * G, G), (PAGE_SPAN, G)]);
    assert_eq!(ranges(&t, "c3"), vec![(7 * G, G)]);
    assert_eq!(ranges(&t, "c1"), vec![(0, SIZE)]);
}

/// A header failing its CRC whose count is garbage still names every
/// checkpoint it holds, as inconsistent: listed, not dropped.
#[test]
fn a_damaged_header_lists_the_checkpoints_it_names_as_inconsistent() {
    let t = tracked(&[("c0", &[0]), ("c1", &[G])]);
    let p = state_path(&t);
    let mut page = rawdisk_testkit::read_range(&p, 0, 4096);
    page[52..56].copy_from_slice(&1000u32.to_le_bytes());
    rawdisk_testkit::write_at(&p, 0, &page);
    let l = list(&t);
    let names: Vec<&str> = l.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["c0", "c1"]);
    for c in &l {
        assert!(!c.consistent, "{l:?}");
        assert!(c.reason.as_deref().unwrap().contains("corrupt"), "{l:?}");
    }
    assert_eq!(ranges(&t, "c1"), vec![(0, SIZE)]);
}

/// A 0-byte or all-zero state file is damage, not a new file: a reader
/// fails with that said; a writer makes a new one (and warns).
#[test]
fn an_empty_or_zeroed_state_file_is_damage_not_a_new_file() {
    for len in [0, FILE_LEN] {
        let t = tracked(&[("c0", &[0])]);
        let p = state_path(&t);
        std::fs::write(&p, b"").unwrap();
        cut(&p, len);
        let sf = StateFile::open(&t.path, None, false).unwrap();
        let e = sf.changed_ranges("c0").unwrap_err().to_string();
        assert!(e.contains("empty") && e.contains("full copy"), "{e}");
        assert_eq!(sf.list().unwrap(), vec![]);
        drop(sf);
        a_new_checkpoint_works(&t, 64 << 10, 4096 + 64 * 4096);
    }
}

/// A format-1 state file (no page index) is read as it is, and converted
/// once by the first writer with its bitmaps intact; after that, damage to
/// them is seen.
#[test]
fn a_format_1_state_file_is_read_and_converted_with_its_bitmaps() {
    let marks = [3 * G, 6 * PAGE_SPAN + 2 * G];
    let t = tracked(&[("c0", &marks), ("c1", &[5 * G])]);
    let p = state_path(&t);
    make_format_1(&p, 2);
    let want = vec![(3 * G, G), (5 * G, G), (6 * PAGE_SPAN + 2 * G, G)];
    // Readers leave it format 1.
    assert!(list(&t).iter().all(|c| c.consistent));
    assert_eq!(ranges(&t, "c0"), want);
    assert_eq!(rawdisk_testkit::read_range(&p, 8, 1), [1]);
    // The first writer converts it.
    Tracker::open(&t.path, SIZE, &opts())
        .unwrap()
        .close()
        .unwrap();
    assert_eq!(rawdisk_testkit::read_range(&p, 8, 1), [2]);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), FILE_LEN);
    assert_eq!(ranges(&t, "c0"), want);
    assert_eq!(ranges(&t, "c1"), vec![(5 * G, G)]);
    // Indexed now: c0's page 6 punched out is damage.
    punch(&p, 4096 + 6 * 4096, 4096);
    all_changed_for_damage(&t, &["c0"]);
    assert_eq!(ranges(&t, "c1"), vec![(5 * G, G)]);
}

/// A bitmap page the storage cannot read (EIO) is damage: the checkpoint is
/// listed inconsistent and reported all changed, not an error and not clean.
#[test]
fn an_unreadable_bitmap_page_is_damage() {
    let t = tracked(&[("c0", &[0])]);
    let pread = crate::sys::CallKind::Pread;
    // Which pread of a listing reads c0's page 0 (slot 0, right after the
    // header): the same one fails in the next listing.
    let sys = FaultSys::real();
    sys.record();
    let sf = StateFile::open_with_sys(&t.path, None, false, sys.clone()).unwrap();
    assert!(sf.list().unwrap()[0].consistent);
    let reads: Vec<u64> = sys
        .take_log()
        .iter()
        .filter(|c| c.kind == pread)
        .map(|c| c.offset)
        .collect();
    let nth = reads.iter().position(|&o| o == 4096).expect("page 0 read") as u64 + 1;
    let sys = FaultSys::real();
    sys.fail_once(pread, nth, libc::EIO);
    let sf = StateFile::open_with_sys(&t.path, None, false, sys).unwrap();
    let l = sf.list().unwrap();
    assert!(!l[0].consistent, "{l:?}");
    assert!(l[0]
        .reason
        .as_deref()
        .unwrap()
        .contains("bitmap is damaged"));
}

/// An older copy of the state file put back in place while a server tracks
/// it (`cp state.bak state`: same inode, a valid header and index) lacks the
/// changes persisted since the copy. The server must not take it for a
/// change another process made: after it, and after the clean close that
/// records the target as checked, the change is still reported.
#[test]
fn an_older_copy_written_over_the_served_state_loses_no_change() {
    let t = tracked(&[("c0", &[])]);
    let p = state_path(&t);
    let tr = Tracker::open(&t.path, SIZE, &opts()).unwrap();
    let (a, b) = (5 * G, 2 * PAGE_SPAN + 9 * G);
    tr.mark(a, 1);
    tr.persist().unwrap();
    let older = std::fs::read(&p).unwrap();
    tr.mark(b, 1);
    tr.persist().unwrap();
    // In place, as cp does: the server's descriptor sees these bytes.
    std::fs::write(&p, &older).unwrap();
    tr.refresh().unwrap();
    let runs = tr.changed("c0", 0, SIZE, usize::MAX).unwrap();
    let changed: Vec<(u64, u64)> = runs
        .iter()
        .scan(0, |at, &(len, ch)| {
            let r = (*at, len, ch);
            *at += len;
            Some(r)
        })
        .filter(|r| r.2)
        .map(|r| (r.0, r.1))
        .collect();
    let covers = |x: u64| changed.iter().any(|&(o, l)| o <= x && x < o + l);
    assert!(covers(a) && covers(b), "served: {changed:?}");
    tr.close().unwrap();
    drop(tr);
    let r = ranges(&t, "c0");
    let covers = |x: u64| r.iter().any(|&(o, l)| o <= x && x < o + l);
    assert!(covers(a) && covers(b), "after the close: {r:?}");
}
