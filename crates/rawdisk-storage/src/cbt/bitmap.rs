//! Chunk bitmaps, sparse: cut into leaves of one slot page (4096 bytes,
//! 32768 chunks) each, of which only those holding bits exist, so memory
//! and walks follow what changed, not the target's size. [`Bits`] (a
//! checkpoint's, behind the tracker's lock) maps leaf indexes to words;
//! [`AtomicBits`] (U, marked without a lock) is a two-level directory of
//! leaves, each allocated once, by its first mark. Chunk `c` is bit
//! `c % 64` of word `c / 64`; stored little endian, that is bit `c % 8` of
//! byte `c / 8` of a slot, and leaf `l` is page `l` of the slot.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use super::format::PAGE;

/// Words of a leaf: one slot page.
pub(crate) const LEAF_WORDS: usize = PAGE / 8;
/// Chunks of a leaf.
pub(crate) const LEAF_BITS: u64 = PAGE as u64 * 8;
/// Leaves per directory node of U: a node (8 KiB of pointers) exists only
/// where some leaf under it was marked, so the fixed cost stays tiny.
const DIR_LEAVES: usize = 512;

type Words = [u64; LEAF_WORDS];

/// The mask of bits `lo..=hi` of a word.
fn mask(lo: u64, hi: u64) -> u64 {
    (u64::MAX >> (63 - hi)) & (u64::MAX << lo)
}

/// Call `f(word index, mask)` for each word of chunks `first..=last`.
#[cfg(test)]
fn for_words(first: u64, last: u64, mut f: impl FnMut(usize, u64)) {
    let (w0, w1) = (first / 64, last / 64);
    for w in w0..=w1 {
        let lo = if w == w0 { first % 64 } else { 0 };
        let hi = if w == w1 { last % 64 } else { 63 };
        f(w as usize, mask(lo, hi));
    }
}

/// Where bits may be, leaf by leaf: what [`runs`] walks.
pub(crate) trait Leaves {
    /// The first leaf of `l..end` that may hold a bit, if any.
    fn next_leaf(&self, l: usize, end: usize) -> Option<usize>;
    /// OR the words of leaf `l` into `out`.
    fn or_leaf(&self, l: usize, out: &mut Words);
}

/// The OR of several bitmaps ("changed since ck": Bk | .. | Bn | U).
pub(crate) struct Union<'a>(pub Vec<&'a dyn Leaves>);

impl Leaves for Union<'_> {
    fn next_leaf(&self, l: usize, end: usize) -> Option<usize> {
        self.0.iter().filter_map(|b| b.next_leaf(l, end)).min()
    }

    fn or_leaf(&self, l: usize, out: &mut Words) {
        for b in &self.0 {
            b.or_leaf(l, out);
        }
    }
}

/// A checkpoint's bitmap: the leaves holding a bit, never an all-zero one
/// (so equal sets compare equal).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Bits {
    chunks: u64,
    leaves: BTreeMap<usize, Box<Words>>,
}

impl Bits {
    pub(crate) fn new(chunks: u64) -> Self {
        Bits {
            chunks,
            leaves: BTreeMap::new(),
        }
    }

    fn leaf_mut(&mut self, l: usize) -> &mut Words {
        self.leaves
            .entry(l)
            .or_insert_with(|| Box::new([0; LEAF_WORDS]))
    }

    #[cfg(test)]
    pub(crate) fn set(&mut self, first: u64, last: u64) {
        for_words(first, last, |w, m| {
            self.leaf_mut(w / LEAF_WORDS)[w % LEAF_WORDS] |= m
        });
    }

    #[cfg(test)]
    pub(crate) fn get(&self, chunk: u64) -> bool {
        let w = (chunk / 64) as usize;
        self.leaves
            .get(&(w / LEAF_WORDS))
            .is_some_and(|l| l[w % LEAF_WORDS] >> (chunk % 64) & 1 == 1)
    }

    pub(crate) fn or(&mut self, other: &Bits) {
        for (&l, ws) in &other.leaves {
            for (a, b) in self.leaf_mut(l).iter_mut().zip(ws.iter()) {
                *a |= b;
            }
        }
    }

    /// Indexes of the slot pages (of [`PAGE`] bytes) holding a set bit.
    pub(crate) fn pages(&self) -> Vec<usize> {
        self.leaves.keys().copied().collect()
    }

    /// Page `i` of the slot as stored.
    pub(crate) fn page(&self, i: usize) -> Vec<u8> {
        let mut p = vec![0u8; PAGE];
        if let Some(ws) = self.leaves.get(&i) {
            for (dst, w) in p.chunks_mut(8).zip(ws.iter()) {
                dst.copy_from_slice(&w.to_le_bytes());
            }
        }
        p
    }

    /// OR page `p` of a slot, as stored ([`PAGE`] bytes), into the bitmap.
    /// Bits past the last chunk are dropped: they would read as changes
    /// past the end.
    pub(crate) fn load_page(&mut self, p: usize, bytes: &[u8]) {
        let mut ws = [0u64; LEAF_WORDS];
        for (w, src) in ws.iter_mut().zip(bytes.chunks_exact(8)) {
            *w = u64::from_le_bytes(src.try_into().unwrap());
        }
        let words = self.chunks.div_ceil(64);
        for (i, w) in ws.iter_mut().enumerate() {
            let at = (p * LEAF_WORDS + i) as u64;
            if at >= words {
                *w = 0;
            } else if at == words - 1 && !self.chunks.is_multiple_of(64) {
                *w &= mask(0, self.chunks % 64 - 1);
            }
        }
        self.or_page(p, &ws);
    }

    /// OR taken words into page `p`; whether the page gained a bit.
    pub(crate) fn or_page(&mut self, p: usize, words: &[u64]) -> bool {
        if words.iter().all(|&w| w == 0) {
            return false;
        }
        let mut gained = false;
        for (a, b) in self.leaf_mut(p).iter_mut().zip(words) {
            gained |= b & !*a != 0;
            *a |= b;
        }
        gained
    }
}

impl Leaves for Bits {
    fn next_leaf(&self, l: usize, end: usize) -> Option<usize> {
        (l < end).then(|| self.leaves.range(l..end).next().map(|(&k, _)| k))?
    }

    fn or_leaf(&self, l: usize, out: &mut Words) {
        if let Some(ws) = self.leaves.get(&l) {
            for (o, w) in out.iter_mut().zip(ws.iter()) {
                *o |= w;
            }
        }
    }
}

type Leaf = [AtomicU64; LEAF_WORDS];
type Dir = [OnceLock<Box<Leaf>>; DIR_LEAVES];

/// U: the chunks marked since the last persist. Marking is a load when the
/// bits are already set, else one fetch_or per word; no lock. A leaf and
/// its directory node are made by the first mark that needs them, once
/// (`OnceLock`: a racing first mark waits for that allocation only); later
/// marks find them with an atomic load. Leaves stay once made: U's memory
/// follows the chunks marked in the server's life. A summary bit per leaf
/// says which may hold bits, so a persist visits only those: its cost
/// follows what changed, not the target's size.
#[derive(Debug)]
pub(crate) struct AtomicBits {
    dirs: Vec<OnceLock<Box<Dir>>>,
    /// Bit `p` of word `p / 64`: leaf `p` may hold bits.
    pages: Vec<AtomicU64>,
}

/// Bits taken out of U: only the pages that held some, `(index, words)`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Taken {
    pub pages: Vec<(usize, Vec<u64>)>,
}

impl AtomicBits {
    pub(crate) fn new(chunks: u64) -> Self {
        let leaves = chunks.div_ceil(LEAF_BITS) as usize;
        AtomicBits {
            dirs: (0..leaves.div_ceil(DIR_LEAVES))
                .map(|_| OnceLock::new())
                .collect(),
            pages: (0..leaves.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    fn leaf(&self, l: usize) -> Option<&Leaf> {
        self.dirs[l / DIR_LEAVES].get()?[l % DIR_LEAVES]
            .get()
            .map(|b| &**b)
    }

    fn leaf_or_new(&self, l: usize) -> &Leaf {
        let dir = self.dirs[l / DIR_LEAVES]
            .get_or_init(|| Box::new(std::array::from_fn(|_| OnceLock::new())));
        dir[l % DIR_LEAVES].get_or_init(|| Box::new(std::array::from_fn(|_| AtomicU64::new(0))))
    }

    /// Set chunks `first..=last`. Each leaf's summary bit is checked after
    /// its words, also when they were already set (by a mark that may not
    /// have reached the summary yet): when this returns, a take that starts
    /// later finds the bits.
    pub(crate) fn set(&self, first: u64, last: u64) {
        let (w0, w1) = ((first / 64) as usize, (last / 64) as usize);
        let mut w = w0;
        while w <= w1 {
            let p = w / LEAF_WORDS;
            let leaf = self.leaf_or_new(p);
            let end = w1.min((p + 1) * LEAF_WORDS - 1);
            for w in w..=end {
                let lo = if w == w0 { first % 64 } else { 0 };
                let hi = if w == w1 { last % 64 } else { 63 };
                let (word, m) = (&leaf[w % LEAF_WORDS], mask(lo, hi));
                if word.load(Ordering::SeqCst) & m != m {
                    word.fetch_or(m, Ordering::SeqCst);
                }
            }
            let (word, bit) = (&self.pages[p / 64], 1u64 << (p % 64));
            if word.load(Ordering::SeqCst) & bit == 0 {
                word.fetch_or(bit, Ordering::SeqCst);
            }
            w = end + 1;
        }
    }

    /// Take every bit out: each summary word swapped with zero, then the
    /// words of the leaves it named (which exist: the summary bit is set
    /// after the leaf is made).
    pub(crate) fn take(&self) -> Taken {
        let mut t = Taken::default();
        for (i, sw) in self.pages.iter().enumerate() {
            let mut bits = sw.swap(0, Ordering::SeqCst);
            while bits != 0 {
                let p = i * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let Some(leaf) = self.leaf(p) else { continue };
                let words: Vec<u64> = leaf.iter().map(|w| w.swap(0, Ordering::SeqCst)).collect();
                if words.iter().any(|&w| w != 0) {
                    t.pages.push((p, words));
                }
            }
        }
        t
    }

    /// Put bits back (a persist that failed).
    pub(crate) fn give_back(&self, t: &Taken) {
        for (p, words) in &t.pages {
            for (w, &v) in self.leaf_or_new(*p).iter().zip(words) {
                if v != 0 {
                    w.fetch_or(v, Ordering::SeqCst);
                }
            }
            self.pages[p / 64].fetch_or(1 << (p % 64), Ordering::SeqCst);
        }
    }

    /// How many leaves exist (memory: 4 KiB each).
    #[cfg(test)]
    pub(crate) fn leaves(&self) -> usize {
        (0..self.dirs.len() * DIR_LEAVES)
            .filter(|&l| self.leaf(l).is_some())
            .count()
    }
}

impl Leaves for AtomicBits {
    /// Leaves that exist, even if a take emptied them since.
    fn next_leaf(&self, l: usize, end: usize) -> Option<usize> {
        let end = end.min(self.dirs.len() * DIR_LEAVES);
        let mut at = l;
        while at < end {
            let next_dir = (at / DIR_LEAVES + 1) * DIR_LEAVES;
            // A directory not made yet has no leaves: skipped whole.
            if let Some(dir) = self.dirs[at / DIR_LEAVES].get() {
                let stop = next_dir.min(end);
                if let Some(i) = (at..stop).find(|&i| dir[i % DIR_LEAVES].get().is_some()) {
                    return Some(i);
                }
            }
            at = next_dir;
        }
        None
    }

    fn or_leaf(&self, l: usize, out: &mut Words) {
        if let Some(leaf) = self.leaf(l) {
            for (o, w) in out.iter_mut().zip(leaf) {
                *o |= w.load(Ordering::Acquire);
            }
        }
    }
}

/// Runs `(length, changed)` covering exactly `[offset, offset+len)` of a
/// target of `chunks` chunks of `g` bytes, where `bits` holds the changed
/// set; only the leaves it has are visited. Chunks past the end count as
/// changed. At most `max_runs` runs (the last then ends early); empty only
/// for `len == 0`.
pub(crate) fn runs(
    g: u64,
    chunks: u64,
    offset: u64,
    len: u64,
    max_runs: usize,
    bits: &dyn Leaves,
) -> Vec<(u64, bool)> {
    let mut out = Runs {
        v: Vec::new(),
        max: max_runs.max(1),
    };
    let end = offset.saturating_add(len);
    let tracked = chunks.saturating_mul(g).min(end);
    let mut at = offset;
    if at < tracked {
        let mut full = false;
        set_runs(bits, at / g, tracked.div_ceil(g), |a, b| {
            let (sa, sb) = ((a * g).max(offset), (b * g).min(tracked));
            full = !(out.push(sa - at, false) && out.push(sb - sa, true));
            at = sb;
            !full
        });
        if full || !out.push(tracked - at, false) {
            return out.v;
        }
        at = tracked;
    }
    out.push(end - at, true);
    out.v
}

/// Merged runs, at most `max`.
struct Runs {
    v: Vec<(u64, bool)>,
    max: usize,
}

impl Runs {
    /// Append a run (merged with the last if of the same kind); false when
    /// it would be one too many.
    fn push(&mut self, len: u64, changed: bool) -> bool {
        if len == 0 {
            return true;
        }
        let n = self.v.len();
        match self.v.last_mut() {
            Some((l, ch)) if *ch == changed => *l += len,
            _ if n == self.max => return false,
            _ => self.v.push((len, changed)),
        }
        true
    }
}

/// Call `f(a, b)` for each run `a..b` of set chunks in `c0..c1`, in order,
/// visiting only the leaves `bits` has, until `f` returns false.
fn set_runs(bits: &dyn Leaves, c0: u64, c1: u64, mut f: impl FnMut(u64, u64) -> bool) {
    let mut buf = [0u64; LEAF_WORDS];
    let mut l = (c0 / LEAF_BITS) as usize;
    let end = c1.div_ceil(LEAF_BITS) as usize;
    while let Some(next) = bits.next_leaf(l, end) {
        let base = next as u64 * LEAF_BITS;
        buf.fill(0);
        bits.or_leaf(next, &mut buf);
        let hi = (c1 - base).min(LEAF_BITS);
        let mut i = c0.saturating_sub(base);
        while i < hi {
            let a = next_bit(&buf, i, true, hi);
            if a == hi {
                break;
            }
            let b = next_bit(&buf, a, false, hi);
            if !f(base + a, base + b) {
                return;
            }
            i = b;
        }
        l = next + 1;
    }
}

/// The first bit in `from..hi` of `ws` that is `set`, else `hi`; a word at
/// a time.
fn next_bit(ws: &Words, from: u64, set: bool, hi: u64) -> u64 {
    let mut n = from;
    while n < hi {
        let w = ws[(n / 64) as usize];
        // Only bits from n % 64 up are chunks from n on.
        let w = if set { w } else { !w } >> (n % 64);
        if w != 0 {
            return (n + u64::from(w.trailing_zeros())).min(hi);
        }
        n = (n / 64 + 1) * 64;
    }
    hi
}

/// The chunk-by-chunk definition [`runs`] must equal, for tests.
#[cfg(test)]
pub(crate) fn naive_runs(
    g: u64,
    chunks: u64,
    is_set: impl Fn(u64) -> bool,
    offset: u64,
    len: u64,
    max: usize,
) -> Vec<(u64, bool)> {
    let mut out: Vec<(u64, bool)> = Vec::new();
    let mut at = offset;
    while at < offset + len {
        let c = at / g;
        let ch = c >= chunks || is_set(c);
        let stop = ((c + 1) * g).min(offset + len);
        let n = out.len();
        match out.last_mut() {
            Some((l, x)) if *x == ch => *l += stop - at,
            _ if n == max => break,
            _ => out.push((stop - at, ch)),
        }
        at = stop;
    }
    out
}

#[cfg(test)]
mod tests {
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
    /// and across the whole. U only at 64 MiB: its fixed part (a summary bit
    /// per leaf, a directory slot per 512 leaves) is gigabytes at 4 KiB.
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
            let mut bitmaps: Vec<Box<dyn Leaves>> = vec![Box::new(b.clone())];
            if g == 64 << 20 {
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
                u.give_back(&t);
                bitmaps.push(Box::new(u));
            }
            for bits in &bitmaps {
                let runs = |offset, len, max| runs(g, chunks, offset, len, max, &**bits);
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
}
