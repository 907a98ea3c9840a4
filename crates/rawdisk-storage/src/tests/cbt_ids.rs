//! Checkpoint identities and the page index's stamps, which fold in each
//! checkpoint's sequence number: a file is always read back with the
//! stamps it was written with, whatever path gave it its identities (a
//! new checkpoint, a tracking server's persist, a delete's merge, the
//! conversion of format 1, a format-2 file written before identities).

use super::cbt_damage::{
    all_changed_for_damage, cut, list, make_format_1, opts, ranges, rewrite_header, state_path,
    tracked, FILE_LEN, G, INDEX0, PAGE_SPAN, SIZE,
};
use super::Tmp;
use crate::cbt::format::{crc32, Entry};
use crate::cbt::{StateFile, Tracker};

const TABLE: usize = 128;
/// Each checkpoint's name and the ranges changed since it.
type Want = Vec<(&'static str, Vec<(u64, u64)>)>;
const ENTRY: usize = 96;

/// Seq, consistent and source id of every checkpoint as listed, the ranges
/// changed since each exact (`want`, by name), and a tracking server
/// reporting the same without finding damage.
fn reads_back_clean(t: &Tmp, want: &[(&str, Vec<(u64, u64)>)]) -> Vec<u64> {
    let l = list(t);
    let names: Vec<&str> = l.iter().map(|c| c.name.as_str()).collect();
    let want_names: Vec<&str> = want.iter().map(|w| w.0).collect();
    assert_eq!(names, want_names);
    let source = l[0].id.split(':').next().unwrap().to_string();
    assert_eq!(source.len(), 32);
    assert_ne!(source, "0".repeat(32));
    for c in &l {
        assert!(c.consistent, "{l:?}");
        assert_eq!(c.id, format!("{source}:{}", c.seq));
    }
    for (name, r) in want {
        assert_eq!(&ranges(t, name), r, "{name}");
    }
    let tr = Tracker::open(&t.path, SIZE, &opts()).unwrap();
    for (name, r) in want {
        let changed: Vec<(u64, u64)> = {
            let mut at = 0;
            let mut out = vec![];
            for (len, c) in tr.changed(name, 0, SIZE, usize::MAX).unwrap() {
                if c {
                    out.push((at, len));
                }
                at += len;
            }
            out
        };
        assert_eq!(&changed, r, "{name} through the tracker");
    }
    tr.close().unwrap();
    let again = list(t);
    assert_eq!(again, l, "a tracking server's start changed nothing");
    l.iter().map(|c| c.seq).collect()
}

/// Create, mark, persist (a tracking server), reopen: no damage; the same
/// after a delete merges a bitmap into the previous one, and after a name
/// and slot are reused (within the same second, most likely): the new
/// sequence number keeps the stamps apart.
#[test]
fn checkpoints_written_through_every_path_read_back_clean() {
    let t = tracked(&[("c0", &[0, 5 * PAGE_SPAN]), ("c1", &[3 * G])]);
    let seqs = reads_back_clean(
        &t,
        &[
            ("c0", vec![(0, G), (3 * G, G), (5 * PAGE_SPAN, G)]),
            ("c1", vec![(3 * G, G)]),
        ],
    );
    assert_eq!(seqs, [1, 2]);
    let mut sf = StateFile::open(&t.path, None, false).unwrap();
    sf.delete_checkpoint("c1").unwrap();
    sf.create_checkpoint(Some("c1")).unwrap();
    let tr = Tracker::open(&t.path, SIZE, &opts()).unwrap();
    tr.mark(7 * PAGE_SPAN, 1);
    tr.close().unwrap();
    let seqs = reads_back_clean(
        &t,
        &[
            (
                "c0",
                vec![(0, G), (3 * G, G), (5 * PAGE_SPAN, G), (7 * PAGE_SPAN, G)],
            ),
            ("c1", vec![(7 * PAGE_SPAN, G)]),
        ],
    );
    assert_eq!(seqs, [1, 3]);
}

/// An index entry stamped for another sequence number of the same name,
/// creation time and slot is stale: damage, not the checkpoint's page.
#[test]
fn a_page_stamped_for_another_sequence_number_is_damage() {
    let t = tracked(&[("c0", &[0])]);
    rewrite_header(&state_path(&t), |h| {
        h[TABLE + 80..TABLE + 88].copy_from_slice(&7u64.to_le_bytes());
        h[100..108].copy_from_slice(&8u64.to_le_bytes());
    });
    all_changed_for_damage(&t, &["c0"]);
}

/// Marks of c0 (two bitmap pages) and c1, and what each reads back as.
fn two_checkpoints() -> (Tmp, Want) {
    let t = tracked(&[("c0", &[G, 6 * PAGE_SPAN]), ("c1", &[4 * G])]);
    let want = vec![
        ("c0", vec![(G, G), (4 * G, G), (6 * PAGE_SPAN, G)]),
        ("c1", vec![(4 * G, G)]),
    ];
    (t, want)
}

/// The identity fields zeroed as older rawdisk left them.
fn drop_ids(h: &mut [u8]) {
    h[100..124].fill(0);
    for k in 0..2 {
        h[TABLE + k * ENTRY + 80..TABLE + k * ENTRY + 88].fill(0);
    }
}

/// A format-1 file without identities: whichever writer converts it (a
/// tracking server, or a checkpoint command after a reader gave it
/// identities), the ids come first and the index is stamped with them.
#[test]
fn a_format_1_file_gets_its_ids_before_its_index_is_written() {
    for server in [true, false] {
        let (t, mut want) = two_checkpoints();
        let p = state_path(&t);
        make_format_1(&p, 2);
        rewrite_header(&p, drop_ids);
        if server {
            Tracker::open(&t.path, SIZE, &opts())
                .unwrap()
                .close()
                .unwrap();
        } else {
            let mut sf = StateFile::open(&t.path, None, false).unwrap();
            // The reader's open gave it identities only: still format 1.
            assert_eq!(rawdisk_testkit::read_range(&p, 8, 1), [1]);
            assert_ne!(rawdisk_testkit::read_range(&p, 108, 16), [0; 16]);
            sf.create_checkpoint(Some("c2")).unwrap();
            want.push(("c2", vec![]));
        }
        assert_eq!(rawdisk_testkit::read_range(&p, 8, 1), [2]);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), FILE_LEN);
        let seqs = reads_back_clean(&t, &want);
        assert_eq!(seqs, (1..=want.len() as u64).collect::<Vec<_>>());
    }
}

/// A format-2 file written before identities (its stamps made with
/// sequence number 0) gets them from its first opener, a reader or a
/// tracking server, and its pages are stamped anew: no damage.
#[test]
fn a_format_2_file_without_ids_is_stamped_anew() {
    for server in [true, false] {
        let (t, want) = two_checkpoints();
        let p = state_path(&t);
        let header = rawdisk_testkit::read_range(&p, 0, 4096);
        let mut crcs = vec![];
        for k in 0..2u32 {
            let at = TABLE + k as usize * ENTRY;
            let len = header[at..at + 64].iter().position(|&b| b == 0).unwrap();
            let e = Entry {
                name: String::from_utf8(header[at..at + len].to_vec()).unwrap(),
                created: u64::from_le_bytes(header[at + 64..at + 72].try_into().unwrap()),
                reason: None,
                slot: k,
                index_crc: 0,
                written: 0,
                seq: 0,
            };
            assert_eq!(
                u32::from_le_bytes(header[at + 76..at + 80].try_into().unwrap()),
                k
            );
            let off = INDEX0 + u64::from(k) * 4096;
            let mut idx = rawdisk_testkit::read_range(&p, off, 4096);
            for entry in idx.chunks_exact_mut(8) {
                if entry != [0; 8] {
                    entry[4..].copy_from_slice(&e.stamp().to_le_bytes());
                }
            }
            rawdisk_testkit::write_at(&p, off, &idx);
            crcs.push(crc32(&idx));
        }
        rewrite_header(&p, |h| {
            drop_ids(h);
            for (k, crc) in crcs.iter().enumerate() {
                h[TABLE + k * ENTRY + 88..TABLE + k * ENTRY + 92]
                    .copy_from_slice(&crc.to_le_bytes());
            }
        });
        if server {
            Tracker::open(&t.path, SIZE, &opts())
                .unwrap()
                .close()
                .unwrap();
        }
        let seqs = reads_back_clean(&t, &want);
        assert_eq!(seqs, [1, 2]);
    }
}

/// The source id of the state file, as listed (with a checkpoint).
fn source_of(t: &Tmp) -> String {
    let l = list(t);
    l.last().expect("a checkpoint").id[..32].to_string()
}

/// A state file found zeroed, or with a corrupt header, and made usable by
/// a writer (a checkpoint command or a tracking server) gets a new source
/// id: its old counter cannot be trusted. A reader does not write the
/// repair, so its chain names no source id.
#[test]
fn a_state_file_made_anew_or_repaired_gets_a_new_source_id() {
    for (zeroed, server) in [(true, false), (true, true), (false, false), (false, true)] {
        let (t, _) = two_checkpoints();
        let p = state_path(&t);
        let old = source_of(&t);
        if zeroed {
            cut(&p, 0);
            cut(&p, FILE_LEN);
        } else {
            let mut b = rawdisk_testkit::read_range(&p, 52, 1);
            b[0] ^= 0x40;
            rawdisk_testkit::write_at(&p, 52, &b);
            let chain = StateFile::open(&t.path, None, false)
                .unwrap()
                .chain()
                .unwrap();
            assert_eq!(chain.source_id, None, "a reader's repair is not durable");
        }
        if server {
            Tracker::open(&t.path, SIZE, &opts())
                .unwrap()
                .close()
                .unwrap();
        }
        let mut sf = StateFile::open(&t.path, None, true).unwrap();
        sf.create_checkpoint(Some("new")).unwrap();
        let new = source_of(&t);
        assert_ne!(new, old, "zeroed {zeroed}, server {server}");
        let chain = sf.chain().unwrap();
        assert_eq!(chain.source_id.as_deref(), Some(new.as_str()));
        // Survivors of a repair are renumbered under the new id, before
        // the new checkpoint.
        let seqs: Vec<u64> = chain.checkpoints.iter().map(|c| c.seq).collect();
        let want: Vec<u64> = if zeroed { vec![1] } else { vec![1, 2, 3] };
        assert_eq!(seqs, want, "zeroed {zeroed}, server {server}");
    }
}
