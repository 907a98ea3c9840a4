//! Walking an endpoint's allocation forward, for the commands that read a
//! whole image (checksum, compare, copy): which runs read as zeros without being
//! read (holes: SEEK_DATA/SEEK_HOLE on files, `base:allocation` on NBD), and
//! the number of worker threads to read and hash with.

use std::collections::VecDeque;

use crate::endpoint::{self, Endpoint, MapExtent};

/// Extents of an NBD endpoint are fetched this far ahead, so the planner's
/// lock is rarely held across an extents call. A local file is asked about
/// the whole rest: its answer is bounded by a number of runs, not bytes, so
/// a huge sparse file costs a few SEEK_DATA/SEEK_HOLE calls, not one per
/// window.
const LOOKAHEAD: u64 = 8 << 30;

/// The runs of one endpoint in `[0, end)`, fetched lazily, asked for at
/// offsets that never go backwards.
pub(crate) struct ExtentCursor<'a> {
    ep: &'a Endpoint,
    end: u64,
    queue: VecDeque<MapExtent>,
}

impl<'a> ExtentCursor<'a> {
    pub fn new(ep: &'a Endpoint, end: u64) -> ExtentCursor<'a> {
        ExtentCursor {
            ep,
            end: end.min(ep.size()),
            queue: VecDeque::new(),
        }
    }

    /// The run holding `off` (< end): whether it reads as zeros, and where it
    /// ends. `off` must not be below an offset asked for before.
    pub fn run_at(&mut self, off: u64) -> Result<(bool, u64), endpoint::Error> {
        debug_assert!(off < self.end);
        while let Some(f) = self.queue.front() {
            if f.offset + f.len <= off {
                self.queue.pop_front();
            } else {
                break;
            }
        }
        if self.queue.is_empty() {
            let want = match self.ep {
                Endpoint::Local { .. } => self.end - off,
                Endpoint::Nbd { .. } => (self.end - off).min(LOOKAHEAD),
            };
            let runs = self.ep.extents(off, want)?;
            queue_runs(&mut self.queue, off, self.end, runs);
        }
        let f = self.queue.front().expect("refilled");
        Ok((f.zero, (f.offset + f.len).min(self.end)))
    }

    /// Where the zeros starting at `off` end (`off` itself when the run at
    /// `off` has data), looking at most up to `limit`.
    pub fn zero_until(&mut self, off: u64, limit: u64) -> Result<u64, endpoint::Error> {
        let limit = limit.min(self.end);
        let mut p = off;
        while p < limit {
            let (zero, e) = self.run_at(p)?;
            if !zero {
                break;
            }
            p = e;
        }
        Ok(p.min(limit))
    }
}

/// Appends to `queue` the leading `runs` that follow on from `off` without a
/// gap and returns where they end. When none does (a file that shrank, a
/// server that answered nothing) it queues the rest up to `end` as data, to
/// be read rather than asked about forever, and returns `end`.
pub(crate) fn queue_runs(
    queue: &mut VecDeque<MapExtent>,
    off: u64,
    end: u64,
    runs: Vec<MapExtent>,
) -> u64 {
    let mut p = off;
    for e in runs {
        if e.offset != p || e.len == 0 {
            break;
        }
        p += e.len;
        queue.push_back(e);
    }
    if p > off {
        return p;
    }
    queue.push_back(MapExtent {
        offset: off,
        len: end - off,
        data: true,
        zero: false,
    });
    end
}

/// Worker threads for reading and hashing or comparing: one per core (the
/// work is CPU-bound once the data is in memory), and for NBD at least 4, so
/// some reads are in flight while others are hashed.
pub(crate) fn workers(threads: usize, nbd: bool) -> usize {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    match threads {
        0 if nbd => cores.clamp(4, 64),
        0 => cores.clamp(1, 64),
        n => n.clamp(1, 256),
    }
}

/// Whether every byte is zero; data usually differs early, so look at the
/// head before scanning the whole block in wide words.
pub(crate) fn is_zero(b: &[u8]) -> bool {
    let head = b.len().min(16);
    if b[..head].iter().any(|&x| x != 0) {
        return false;
    }
    let mut chunks = b.chunks_exact(64);
    for c in &mut chunks {
        let mut acc = 0u64;
        for w in c.chunks_exact(8) {
            acc |= u64::from_ne_bytes(w.try_into().unwrap());
        }
        if acc != 0 {
            return false;
        }
    }
    chunks.remainder().iter().all(|&x| x == 0)
}

#[cfg(test)]
mod tests {
    use super::is_zero;

    #[test]
    fn zero_detection() {
        for n in [0usize, 1, 15, 16, 17, 63, 64, 65, 4096, 4099] {
            let z = vec![0u8; n];
            assert!(is_zero(&z), "{n}");
            for i in 0..n {
                let mut v = z.clone();
                v[i] = 1;
                assert!(!is_zero(&v), "{n} {i}");
            }
        }
    }
}
