//! Chunk bitmaps: [`Bits`] (a checkpoint's, behind the tracker's lock),
//! [`AtomicBits`] (U, marked without a lock), and the runs a query returns.
//! Chunk `c` is bit `c % 64` of word `c / 64`; stored little endian, that is
//! bit `c % 8` of byte `c / 8` of a slot.

use std::sync::atomic::{AtomicU64, Ordering};

use super::format::PAGE;

const WORDS_PER_PAGE: usize = PAGE / 8;

/// The mask of bits `lo..=hi` of a word.
fn mask(lo: u64, hi: u64) -> u64 {
    (u64::MAX >> (63 - hi)) & (u64::MAX << lo)
}

/// Call `f(word index, mask)` for each word of chunks `first..=last`.
fn for_words(first: u64, last: u64, mut f: impl FnMut(usize, u64)) {
    let (w0, w1) = (first / 64, last / 64);
    for w in w0..=w1 {
        let lo = if w == w0 { first % 64 } else { 0 };
        let hi = if w == w1 { last % 64 } else { 63 };
        f(w as usize, mask(lo, hi));
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Bits {
    words: Vec<u64>,
}

impl Bits {
    pub(crate) fn new(chunks: u64) -> Self {
        Bits {
            words: vec![0; chunks.div_ceil(64) as usize],
        }
    }

    pub(crate) fn words(&self) -> &[u64] {
        &self.words
    }

    #[cfg(test)]
    pub(crate) fn set(&mut self, first: u64, last: u64) {
        for_words(first, last, |w, m| self.words[w] |= m);
    }

    #[cfg(test)]
    pub(crate) fn get(&self, chunk: u64) -> bool {
        self.words[(chunk / 64) as usize] >> (chunk % 64) & 1 == 1
    }

    pub(crate) fn or(&mut self, other: &Bits) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
    }

    /// Indexes of the slot pages (of [`PAGE`] bytes) holding a set bit.
    pub(crate) fn pages(&self) -> Vec<usize> {
        self.words
            .chunks(WORDS_PER_PAGE)
            .enumerate()
            .filter(|(_, ws)| ws.iter().any(|&w| w != 0))
            .map(|(i, _)| i)
            .collect()
    }

    /// Page `i` of the slot as stored (zero-padded past the last word).
    pub(crate) fn page(&self, i: usize) -> Vec<u8> {
        let mut p = vec![0u8; PAGE];
        let ws = self
            .words
            .iter()
            .skip(i * WORDS_PER_PAGE)
            .take(WORDS_PER_PAGE);
        for (dst, w) in p.chunks_mut(8).zip(ws) {
            dst.copy_from_slice(&w.to_le_bytes());
        }
        p
    }

    /// From a slot's bytes (at least 8 * words of them).
    pub(crate) fn from_bytes(chunks: u64, bytes: &[u8]) -> Self {
        let mut b = Bits::new(chunks);
        for (w, src) in b.words.iter_mut().zip(bytes.chunks_exact(8)) {
            *w = u64::from_le_bytes(src.try_into().unwrap());
        }
        // Bits past the last chunk would read as changes past the end.
        if !chunks.is_multiple_of(64) {
            if let Some(last) = b.words.last_mut() {
                *last &= mask(0, chunks % 64 - 1);
            }
        }
        b
    }
}

/// U: the chunks marked since the last persist. Marking is a load when the
/// bits are already set, else one fetch_or per word; no lock. A summary
/// bit per slot page says which pages may hold bits, so a persist visits
/// only those: its cost follows what changed, not the target's size.
#[derive(Debug)]
pub(crate) struct AtomicBits {
    words: Vec<AtomicU64>,
    /// Bit `p` of word `p / 64`: page `p` of `words` may hold bits.
    pages: Vec<AtomicU64>,
}

/// Bits taken out of U: only the pages that held some, `(index, words)`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Taken {
    pub pages: Vec<(usize, Vec<u64>)>,
}

impl AtomicBits {
    pub(crate) fn new(chunks: u64) -> Self {
        let words = chunks.div_ceil(64) as usize;
        AtomicBits {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            pages: (0..words.div_ceil(WORDS_PER_PAGE).div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    /// Set chunks `first..=last`. Each page's summary bit is checked after
    /// its words, also when they were already set (by a mark that may not
    /// have reached the summary yet): when this returns, a take that starts
    /// later finds the bits.
    pub(crate) fn set(&self, first: u64, last: u64) {
        for_words(first, last, |w, m| {
            let word = &self.words[w];
            if word.load(Ordering::SeqCst) & m != m {
                word.fetch_or(m, Ordering::SeqCst);
            }
        });
        let (p0, p1) = (
            first as usize / 64 / WORDS_PER_PAGE,
            last as usize / 64 / WORDS_PER_PAGE,
        );
        for p in p0..=p1 {
            let (word, bit) = (&self.pages[p / 64], 1u64 << (p % 64));
            if word.load(Ordering::SeqCst) & bit == 0 {
                word.fetch_or(bit, Ordering::SeqCst);
            }
        }
    }

    /// Take every bit out: each summary word swapped with zero, then the
    /// words of the pages it named.
    pub(crate) fn take(&self) -> Taken {
        let mut t = Taken::default();
        for (i, sw) in self.pages.iter().enumerate() {
            let mut bits = sw.swap(0, Ordering::SeqCst);
            while bits != 0 {
                let p = i * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let end = ((p + 1) * WORDS_PER_PAGE).min(self.words.len());
                let words: Vec<u64> = self.words[p * WORDS_PER_PAGE..end]
                    .iter()
                    .map(|w| w.swap(0, Ordering::SeqCst))
                    .collect();
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
            for (w, &v) in self.words[p * WORDS_PER_PAGE..].iter().zip(words) {
                if v != 0 {
                    w.fetch_or(v, Ordering::SeqCst);
                }
            }
            self.pages[p / 64].fetch_or(1 << (p % 64), Ordering::SeqCst);
        }
    }

    pub(crate) fn word(&self, w: usize) -> u64 {
        self.words[w].load(Ordering::Acquire)
    }
}

impl Bits {
    /// OR taken words into page `p`; whether the page gained a bit.
    pub(crate) fn or_page(&mut self, p: usize, words: &[u64]) -> bool {
        let mut gained = false;
        for (a, b) in self.words[p * WORDS_PER_PAGE..].iter_mut().zip(words) {
            gained |= b & !*a != 0;
            *a |= b;
        }
        gained
    }
}

/// Runs `(length, changed)` covering exactly `[offset, offset+len)` of a
/// target of `chunks` chunks of `g` bytes, where `word(w)` is word `w` of
/// the changed set. Chunks past the end count as changed. At most
/// `max_runs` runs (the last then ends early); empty only for `len == 0`.
pub(crate) fn runs(
    g: u64,
    chunks: u64,
    offset: u64,
    len: u64,
    max_runs: usize,
    word: impl Fn(usize) -> u64,
) -> Vec<(u64, bool)> {
    let mut out: Vec<(u64, bool)> = Vec::new();
    let end = offset.saturating_add(len);
    let max_runs = max_runs.max(1);
    let mut at = offset;
    while at < end {
        let c = at / g;
        let (changed, next) = if c >= chunks {
            (true, u64::MAX)
        } else {
            let changed = word((c / 64) as usize) >> (c % 64) & 1 == 1;
            let limit = chunks.min(end.div_ceil(g));
            (changed, next_differing(c + 1, limit, changed, &word))
        };
        let stop = next.saturating_mul(g).min(end);
        let n = out.len();
        match out.last_mut() {
            Some((l, ch)) if *ch == changed => *l += stop - at,
            _ if n == max_runs => break,
            _ => out.push((stop - at, changed)),
        }
        at = stop;
    }
    out
}

/// The first chunk in `n..limit` whose bit is not `state`, else `limit`;
/// a word at a time.
fn next_differing(mut n: u64, limit: u64, state: bool, word: &impl Fn(usize) -> u64) -> u64 {
    while n < limit {
        let w = word((n / 64) as usize) >> (n % 64);
        let differ = if state { !w } else { w };
        // Only the low 64 - n % 64 bits are chunks from n on.
        let avail = 64 - n % 64;
        let tz = u64::from(differ.trailing_zeros());
        if tz < avail {
            return (n + tz).min(limit);
        }
        n += avail;
    }
    limit
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
    use super::*;

    #[test]
    fn runs_equal_the_chunk_by_chunk_definition() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(20);
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
            let got = runs(g, chunks, offset, len, max, |w| b.words()[w]);
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

    #[test]
    fn atomic_marks_are_taken_once_and_given_back() {
        // Three pages of words and a bit: marks in pages 0, 1 and 3.
        let chunks = 3 * 64 * WORDS_PER_PAGE as u64 + 1;
        let page = 64 * WORDS_PER_PAGE as u64;
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
        let mut bytes = Vec::new();
        for p in 0..4 {
            bytes.extend(b.page(p));
        }
        assert_eq!(bytes[0], 1 << 5);
        assert_eq!(Bits::from_bytes(100_000, &bytes), b);
        // Stray bits past the last chunk are not changes.
        bytes[100_000 / 8] |= 0x80;
        assert_eq!(Bits::from_bytes(100_000, &bytes), b);
    }
}
