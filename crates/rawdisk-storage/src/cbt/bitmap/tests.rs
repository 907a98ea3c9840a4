//! The bitmaps against plain models: runs chunk by chunk, random marks,
//! takes and merges, pages stored and loaded, the ends of huge targets.

use std::collections::BTreeSet;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

#[test]
fn runs_equal_the_chunk_by_chunk_definition() {
    let mut rng = SmallRng::seed_from_u64(20);
    for _ in 0..2000 {
        let g = 1u64 << rng.gen_range(0..4);
        let chunks = rng.gen_range(1..300);
        let mut b = Bits::new(chunks);
        for _ in 0..rng.gen_range(0..6) {
            let first = rng.gen_range(0..chunks);
            let last = rng.gen_range(first..chunks.min(first + 80));
            b.set(first, last);
        }
        let size = chunks * g;
        let offset = rng.gen_range(0..size + 3);
        let len = rng.gen_range(0..size + 10 - offset);
        let max = rng.gen_range(1..6);
        let got = runs(g, chunks, offset, len, max, &b);
        let want = naive_runs(g, chunks, |c| b.get(c), offset, len, max);
        assert_eq!(
            got, want,
            "g {g} chunks {chunks} off {offset} len {len} max {max}"
        );
        if len > 0 {
            assert!(!got.is_empty());
        }
    }
}

/// Runs of `bits` against the same from the plain model `m`, over a
/// random window (or the whole target) with a random cap.
fn check_runs(rng: &mut SmallRng, g: u64, bits: &dyn Leaves, m: &[bool], whole: bool) {
    let chunks = m.len() as u64;
    let size = chunks * g;
    let (offset, len, max) = if whole {
        (0, size, usize::MAX)
    } else {
        let offset = rng.gen_range(0..size + 3);
        let len = rng.gen_range(0..(size + 10 - offset).min(4 * LEAF_BITS * g));
        (offset, len, rng.gen_range(1..8))
    };
    let got = runs(g, chunks, offset, len, max, bits);
    let want = naive_runs(g, chunks, |c| m[c as usize], offset, len, max);
    assert_eq!(
        got, want,
        "g {g} chunks {chunks} off {offset} len {len} max {max}"
    );
}

fn leaves_with_bits(m: &[bool]) -> Vec<usize> {
    m.chunks(LEAF_BITS as usize)
        .enumerate()
        .filter(|(_, l)| l.iter().any(|&b| b))
        .map(|(i, _)| i)
        .collect()
}

fn or_into(a: &mut [bool], b: &[bool]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x |= y;
    }
}

/// The sparse bitmaps against plain `Vec<bool>`s: random marks into U
/// (some spanning leaves), U taken (cleared) into the newest bitmap or
/// given back (a failed persist), the newest merged into an older one
/// and cleared (a delete, a new checkpoint), pages stored and loaded
/// back, and the runs of each and of their union equal chunk by chunk.
/// Leaves exist only where marks fell.
#[test]
fn sparse_bitmaps_equal_a_plain_model() {
    let mut rng = SmallRng::seed_from_u64(30);
    for _ in 0..24 {
        let chunks = rng.gen_range(1..4 * LEAF_BITS + 100);
        let n = chunks as usize;
        let g = 1u64 << rng.gen_range(0..3);
        let u = AtomicBits::new(chunks);
        let (mut older, mut newest) = (Bits::new(chunks), Bits::new(chunks));
        let (mut mu, mut mo, mut mn) = (vec![false; n], vec![false; n], vec![false; n]);
        let mut touched = BTreeSet::new();
        for _ in 0..30 {
            match rng.gen_range(0..10) {
                0..=4 => {
                    let first = rng.gen_range(0..chunks);
                    let span = if rng.gen_bool(0.2) {
                        2 * LEAF_BITS
                    } else {
                        130
                    };
                    let last = rng.gen_range(first..chunks.min(first + span));
                    u.set(first, last);
                    mu[first as usize..=last as usize].fill(true);
                    touched.extend(first / LEAF_BITS..=last / LEAF_BITS);
                }
                5 | 6 => {
                    let t = u.take();
                    if rng.gen_bool(0.3) {
                        u.give_back(&t);
                        continue;
                    }
                    for (p, w) in &t.pages {
                        newest.or_page(*p, w);
                    }
                    assert_eq!(u.take(), Taken::default(), "a take clears U");
                    or_into(&mut mn, &mu);
                    mu.fill(false);
                }
                7 => {
                    older.or(&newest);
                    newest = Bits::new(chunks);
                    or_into(&mut mo, &mn);
                    mn.fill(false);
                }
                _ => {
                    let mut back = Bits::new(chunks);
                    for p in newest.pages() {
                        back.load_page(p, &newest.page(p));
                    }
                    assert_eq!(back, newest, "stored pages load back the same");
                }
            }
            let mut all = mo.clone();
            or_into(&mut all, &mn);
            let mut recent = mn.clone();
            or_into(&mut recent, &mu);
            or_into(&mut all, &mu);
            check_runs(&mut rng, g, &Union(vec![&older, &newest, &u]), &all, false);
            check_runs(&mut rng, g, &Union(vec![&newest, &u]), &recent, false);
            check_runs(&mut rng, g, &older, &mo, false);
            check_runs(&mut rng, g, &u, &mu, false);
            assert_eq!(newest.pages(), leaves_with_bits(&mn));
            assert_eq!(older.pages(), leaves_with_bits(&mo));
            assert_eq!(u.leaves(), touched.len(), "U made leaves only where marked");
        }
        let mut all = mo.clone();
        or_into(&mut all, &mn);
        or_into(&mut all, &mu);
        check_runs(&mut rng, g, &Union(vec![&older, &newest, &u]), &all, true);
        assert!((0..chunks).all(|c| newest.get(c) == mn[c as usize]));
        assert!((0..chunks).all(|c| older.get(c) == mo[c as usize]));
    }
}

#[test]
fn a_huge_target_costs_what_was_marked() {
    // 64 TiB at 64 KiB: 2^30 chunks, 32768 leaves of 4 KiB.
    let (g, chunks) = (64 << 10, 1u64 << 30);
    let u = AtomicBits::new(chunks);
    let marks = [7, 12_345_678, chunks / 2, chunks - 1];
    for c in marks {
        u.set(c, c);
    }
    assert_eq!(u.leaves(), 4);
    let mut b = Bits::new(chunks);
    for (p, w) in &u.take().pages {
        b.or_page(*p, w);
    }
    assert_eq!(b.pages().len(), 4);
    u.set(100, 100);
    let got = runs(g, chunks, 0, chunks * g, usize::MAX, &Union(vec![&b, &u]));
    let mut want = Vec::new();
    let mut at = 0;
    for c in [7, 100, 12_345_678, chunks / 2, chunks - 1] {
        if c > at {
            want.push(((c - at) * g, false));
        }
        want.push((g, true));
        at = c + 1;
    }
    assert_eq!(got, want);
}

/// The largest target (2^63 - 1 bytes) at the finest, the default and
/// the coarsest granularity: the first chunk and the last two, stored
/// and loaded back, found by runs at 0, at the last block, past the end
/// and across the whole, in a checkpoint's bitmap and in U (whose tree
/// then holds the two leaves and the nodes above them only).
#[test]
fn the_ends_of_a_2_63_byte_target() {
    let size = i64::MAX as u64;
    for g in [4 << 10, 64 << 10, 64 << 20] {
        let chunks = size.div_ceil(g);
        let last = chunks - 1;
        let mut b = Bits::new(chunks);
        b.set(0, 0);
        b.set(last - 1, last);
        let ends = vec![0, (last / LEAF_BITS) as usize];
        assert_eq!(b.pages(), ends);
        let mut back = Bits::new(chunks);
        for p in b.pages() {
            back.load_page(p, &b.page(p));
        }
        assert_eq!(back, b);
        let u = AtomicBits::new(chunks);
        u.set(0, 0);
        u.set(last - 1, last);
        assert_eq!(u.leaves(), 2);
        let t = u.take();
        assert_eq!(t.pages.iter().map(|(p, _)| *p).collect::<Vec<_>>(), ends);
        let mut taken = Bits::new(chunks);
        for (p, w) in &t.pages {
            taken.or_page(*p, w);
        }
        assert_eq!(taken, b);
        assert_eq!(u.take(), Taken::default());
        u.give_back(&t);
        for bits in [&b as &dyn Leaves, &u] {
            let runs = |offset, len, max| runs(g, chunks, offset, len, max, bits);
            let tail = size - (last - 1) * g;
            let whole = vec![(g, true), ((chunks - 3) * g, false), (tail, true)];
            assert_eq!(runs(0, size, usize::MAX), whole, "g {g}");
            assert_eq!(runs(0, size, 2), whole[..2]);
            assert_eq!(runs(0, 1, 9), [(1, true)]);
            assert_eq!(runs(g, 4096, 9), [(4096, false)]);
            assert_eq!(runs(size - 4096, 4096, 9), [(4096, true)]);
            assert_eq!(runs(size - 1, 1, 9), [(1, true)]);
            assert_eq!(runs((last - 2) * g, g + 1, 9), [(g, false), (1, true)]);
        }
    }
}

#[test]
fn atomic_marks_are_taken_once_and_given_back() {
    // Three leaves and a bit: marks in leaves 0, 1 and 3.
    let chunks = 3 * LEAF_BITS + 1;
    let page = LEAF_BITS;
    let u = AtomicBits::new(chunks);
    u.set(3, 130);
    u.set(64, 100);
    u.set(page + 5, page + 5);
    u.set(chunks - 1, chunks - 1);
    let t = u.take();
    let idx: Vec<usize> = t.pages.iter().map(|(p, _)| *p).collect();
    assert_eq!(idx, [0, 1, 3]);
    let mut b = Bits::new(chunks);
    for (p, w) in &t.pages {
        assert!(b.or_page(*p, w));
        assert!(!b.or_page(*p, w), "nothing new the second time");
    }
    let set: Vec<u64> = (0..chunks).filter(|&c| b.get(c)).collect();
    let mut want: Vec<u64> = (3..=130).collect();
    want.extend([page + 5, chunks - 1]);
    assert_eq!(set, want);
    assert_eq!(u.take(), Taken::default());
    u.give_back(&t);
    assert_eq!(u.take(), t);
}

#[test]
fn pages_and_bytes_round_trip() {
    let mut b = Bits::new(100_000);
    b.set(5, 5);
    b.set(99_999, 99_999);
    assert_eq!(b.pages(), vec![0, 3]);
    let mut pages: Vec<Vec<u8>> = (0..4).map(|p| b.page(p)).collect();
    assert_eq!(pages[0][0], 1 << 5);
    let load = |pages: &[Vec<u8>]| {
        let mut l = Bits::new(100_000);
        for (p, bytes) in pages.iter().enumerate() {
            l.load_page(p, bytes);
        }
        l
    };
    assert_eq!(load(&pages), b);
    // Stray bits past the last chunk are not changes.
    pages[3][100_000 / 8 - 3 * PAGE] |= 0x80;
    pages[3][PAGE - 1] |= 0x80;
    assert_eq!(load(&pages), b);
}
