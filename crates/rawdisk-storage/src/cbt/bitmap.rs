//! Chunk bitmaps, sparse: cut into leaves of one slot page (4096 bytes,
//! 32768 chunks) each, of which only those holding bits exist, so memory
//! and walks follow what changed, not the target's size. [`Bits`] (a
//! checkpoint's, behind the tracker's lock) maps leaf indexes to words;
//! [`AtomicBits`] (U, marked without a lock) is a tree of leaves and the
//! nodes above them, each allocated once, by the first mark below it.
//! Chunk `c` is bit `c % 64` of word `c / 64`; stored little endian, that
//! is bit `c % 8` of byte `c / 8` of a slot, and leaf `l` is page `l` of
//! the slot.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use super::format::PAGE;

/// Words of a leaf: one slot page.
pub(crate) const LEAF_WORDS: usize = PAGE / 8;
/// Chunks of a leaf.
pub(crate) const LEAF_BITS: u64 = PAGE as u64 * 8;
/// Kids per inner node of U: 1 KiB of pointers, made only where some leaf
/// under it was marked.
const FAN_BITS: usize = 6;
const FAN: usize = 1 << FAN_BITS;
/// Inner levels enough for any chunk count (2^64 / 2^15 leaves).
const MAX_LEVELS: usize = 49usize.div_ceil(FAN_BITS);

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

/// An inner node of U's tree (kids, each made by the first mark below it,
/// and a summary bit per kid) or a leaf (words).
#[derive(Debug)]
struct Node {
    kids: Box<[OnceLock<Box<Node>>]>,
    /// Bit `i`: kid `i` may hold bits.
    dirty: AtomicU64,
    words: Box<[AtomicU64]>,
}

impl Node {
    fn inner() -> Self {
        Node {
            kids: (0..FAN).map(|_| OnceLock::new()).collect(),
            dirty: AtomicU64::new(0),
            words: Box::new([]),
        }
    }

    fn leaf() -> Self {
        Node {
            kids: Box::new([]),
            dirty: AtomicU64::new(0),
            words: (0..LEAF_WORDS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

/// The kid, at inner level `k` (0: right above the leaves), that leads to
/// leaf `l`.
fn digit(l: usize, k: usize) -> usize {
    (l >> (FAN_BITS * k)) & (FAN - 1)
}

/// U: the chunks marked since the last persist. Marking is a load when the
/// bits are already set, else one fetch_or per word; no lock. U is a tree
/// of `FAN`-way inner nodes over leaves, as deep as the target needs (3
/// levels at 64 TiB and 64 KiB); a leaf and the nodes above it are made by
/// the first mark that needs them, once (`OnceLock`: a racing first mark
/// waits for that allocation only), later marks find them with atomic
/// loads. Nodes stay once made: U's memory follows the chunks marked in the
/// server's life, its fixed part is one node. Each inner node has a summary
/// bit per kid that may hold bits, so a persist visits only those: its cost
/// follows what changed, not the target's size.
#[derive(Debug)]
pub(crate) struct AtomicBits {
    root: Node,
    /// Inner levels, at least 1.
    levels: usize,
}

/// Bits taken out of U: only the pages that held some, `(index, words)`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Taken {
    pub pages: Vec<(usize, Vec<u64>)>,
}

impl AtomicBits {
    pub(crate) fn new(chunks: u64) -> Self {
        let leaves = chunks.div_ceil(LEAF_BITS).max(1);
        let bits = (64 - (leaves - 1).leading_zeros()) as usize;
        AtomicBits {
            root: Node::inner(),
            levels: bits.div_ceil(FAN_BITS).max(1),
        }
    }

    fn leaf(&self, l: usize) -> Option<&Node> {
        let mut node = &self.root;
        for k in (0..self.levels).rev() {
            node = node.kids[digit(l, k)].get()?;
        }
        Some(node)
    }

    /// Leaf `l` and the inner nodes above it (`path[k]` at level `k`),
    /// made where missing.
    fn leaf_or_new(&self, l: usize) -> (&Node, [&Node; MAX_LEVELS]) {
        let mut path = [&self.root; MAX_LEVELS];
        let mut node = &self.root;
        for k in (0..self.levels).rev() {
            path[k] = node;
            node = node.kids[digit(l, k)]
                .get_or_init(|| Box::new(if k == 0 { Node::leaf() } else { Node::inner() }));
        }
        (node, path)
    }

    /// The summary bits naming leaf `l`, bottom up, each checked also when
    /// already set (by a mark that may not have reached the ones above
    /// yet): a take that starts later walks down to the leaf.
    fn raise(&self, l: usize, path: &[&Node]) {
        for (k, node) in path[..self.levels].iter().enumerate() {
            let bit = 1u64 << digit(l, k);
            if node.dirty.load(Ordering::SeqCst) & bit == 0 {
                node.dirty.fetch_or(bit, Ordering::SeqCst);
            }
        }
    }

    /// Set chunks `first..=last`: each leaf's words, then its summary bits.
    /// When this returns, a take that starts later finds the bits.
    pub(crate) fn set(&self, first: u64, last: u64) {
        let (w0, w1) = ((first / 64) as usize, (last / 64) as usize);
        let mut w = w0;
        while w <= w1 {
            let p = w / LEAF_WORDS;
            let (leaf, path) = self.leaf_or_new(p);
            let end = w1.min((p + 1) * LEAF_WORDS - 1);
            for w in w..=end {
                let lo = if w == w0 { first % 64 } else { 0 };
                let hi = if w == w1 { last % 64 } else { 63 };
                let (word, m) = (&leaf.words[w % LEAF_WORDS], mask(lo, hi));
                if word.load(Ordering::SeqCst) & m != m {
                    word.fetch_or(m, Ordering::SeqCst);
                }
            }
            self.raise(p, &path);
            w = end + 1;
        }
    }

    /// Take every bit out, top down: a node's summary swapped with zero,
    /// then the kids it named (which exist: a bit is set after its kid is
    /// made), down to the leaves' words.
    pub(crate) fn take(&self) -> Taken {
        fn below(node: &Node, k: usize, first: usize, t: &mut Taken) {
            let mut bits = node.dirty.swap(0, Ordering::SeqCst);
            while bits != 0 {
                let i = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let Some(kid) = node.kids[i].get() else {
                    continue;
                };
                let at = first + (i << (FAN_BITS * k));
                if k > 0 {
                    below(kid, k - 1, at, t);
                    continue;
                }
                let words: Vec<u64> = kid
                    .words
                    .iter()
                    .map(|w| w.swap(0, Ordering::SeqCst))
                    .collect();
                if words.iter().any(|&w| w != 0) {
                    t.pages.push((at, words));
                }
            }
        }
        let mut t = Taken::default();
        below(&self.root, self.levels - 1, 0, &mut t);
        t
    }

    /// Put bits back (a persist that failed).
    pub(crate) fn give_back(&self, t: &Taken) {
        for (p, words) in &t.pages {
            let (leaf, path) = self.leaf_or_new(*p);
            for (w, &v) in leaf.words.iter().zip(words) {
                if v != 0 {
                    w.fetch_or(v, Ordering::SeqCst);
                }
            }
            self.raise(*p, &path);
        }
    }

    /// How many leaves exist (memory: 4 KiB each).
    #[cfg(test)]
    pub(crate) fn leaves(&self) -> usize {
        fn below(node: &Node, k: usize) -> usize {
            let kids = node.kids.iter().filter_map(|n| n.get());
            match k {
                0 => kids.count(),
                _ => kids.map(|n| below(n, k - 1)).sum(),
            }
        }
        below(&self.root, self.levels - 1)
    }
}

impl Leaves for AtomicBits {
    /// Leaves that exist, even if a take emptied them since; only nodes
    /// that exist are visited.
    fn next_leaf(&self, l: usize, end: usize) -> Option<usize> {
        fn below(node: &Node, k: usize, first: usize, l: usize, end: usize) -> Option<usize> {
            let span = 1usize << (FAN_BITS * k);
            for i in l.saturating_sub(first) / span..FAN {
                let at = first + i * span;
                if at >= end {
                    break;
                }
                let Some(kid) = node.kids[i].get() else {
                    continue;
                };
                if k == 0 {
                    return Some(at);
                }
                if let Some(found) = below(kid, k - 1, at, l, end) {
                    return Some(found);
                }
            }
            None
        }
        below(&self.root, self.levels - 1, 0, l, end)
    }

    fn or_leaf(&self, l: usize, out: &mut Words) {
        if let Some(leaf) = self.leaf(l) {
            for (o, w) in out.iter_mut().zip(leaf.words.iter()) {
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
mod tests;
