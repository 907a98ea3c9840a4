//! When a page-cache write starts its write-back at once (`--write-behind`).
//!
//! Starting write-back as each big write lands lets a client's final FLUSH
//! find little left to write: a bulk import (qemu-img convert, nbdcopy)
//! overlaps the device writes with the transfer. It only pays when the
//! data is flushed before it is written again: a stream that rewrites the
//! same range and never flushes (a benchmark, a scratch disk) would make
//! the device write pages that are dirtied again at once, and a write to a
//! page under write-back waits for it.
//!
//! `auto` therefore follows what the clients do, shared by every
//! connection to the target: write-behind is on while the writes since the
//! last FLUSH land on ranges not written since that FLUSH, and off from the
//! point the clients rewrite more than [`REWRITE_LIMIT`] of them until the
//! next FLUSH (which shows the clients care for durability again). Targets
//! with no write-back at all (tmpfs, ramfs, `--cache none`) never track.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, OnceLock};

use rawdisk_storage::Target;

/// `--write-behind on|off|auto`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WriteBehind {
    On,
    Off,
    #[default]
    Auto,
}

/// Writes of at least this many bytes are candidates (nbdcopy writes
/// 256 KiB at a time, qemu-img 2 MiB); smaller ones are left to the kernel.
pub(super) const WRITE_BEHIND_MIN: u64 = 256 << 10;
/// Smallest tracked chunk: no bigger than the smallest candidate write, so
/// that an aligned candidate always covers a whole chunk.
const MIN_CHUNK_SHIFT: u32 = 16;
/// At most this many chunks (larger targets get larger chunks): the
/// bitmap's leaves are made where writes land, 2 MiB if all of it is.
const MAX_CHUNKS_SHIFT: u32 = 24;
/// Chunks per leaf of the two-level bitmap (64 words).
const LEAF_WORDS: usize = 64;
const LEAF_CHUNKS: u64 = (LEAF_WORDS * 64) as u64;
/// Rewritten chunks since the last FLUSH that turn `auto` off: a few
/// re-sent requests (a client's retry after a reconnect) do not.
pub(super) const REWRITE_LIMIT: u64 = 64;

/// Ranges queued for the starter thread; when it is this far behind, new
/// ones are dropped (the kernel writes them back at the FLUSH anyway).
const QUEUE: usize = 256;
/// Contiguous queued ranges are started together up to this size.
const MERGE_MAX: u64 = 64 << 20;

type Leaf = Box<[AtomicU64; LEAF_WORDS]>;

/// The decision, shared by every connection to one target.
pub(super) struct Policy {
    mode: WriteBehind,
    chunk_shift: u32,
    /// Chunks written since the last FLUSH; leaves are made on first use.
    written: Box<[OnceLock<Leaf>]>,
    /// Chunks written again since the last FLUSH.
    rewritten: AtomicU64,
    /// Whether any chunk was marked since the last FLUSH: a client that
    /// flushes often must not pay a walk of the whole bitmap each time.
    marked: AtomicBool,
    /// The thread that starts write-back, made at first use: a write's
    /// reply must not wait while sync_file_range queues device writes.
    starter: OnceLock<Option<SyncSender<(u64, u64)>>>,
}

impl Policy {
    /// `can_write_back`: whether the target has write-back at all (a page
    /// cache over a device or a disk file system).
    pub(super) fn new(mode: WriteBehind, can_write_back: bool, size: u64) -> Policy {
        let mode = if can_write_back {
            mode
        } else {
            WriteBehind::Off
        };
        let mut chunk_shift = MIN_CHUNK_SHIFT;
        while size >> chunk_shift > 1 << MAX_CHUNKS_SHIFT {
            chunk_shift += 1;
        }
        let leaves = if mode == WriteBehind::Auto {
            (size >> chunk_shift).div_ceil(LEAF_CHUNKS) + 1
        } else {
            0
        };
        Policy {
            mode,
            chunk_shift,
            written: (0..leaves).map(|_| OnceLock::new()).collect(),
            rewritten: AtomicU64::new(0),
            marked: AtomicBool::new(false),
            starter: OnceLock::new(),
        }
    }

    /// Starts the write-back of a range `after_write` chose, on the starter
    /// thread (here when no thread can be made).
    pub(super) fn start(&self, target: &Arc<Target>, offset: u64, len: u64) {
        match self.starter.get_or_init(|| spawn_starter(target.clone())) {
            // Full: the starter is behind the device; dropping the range
            // only leaves it to the kernel.
            Some(tx) => drop(tx.try_send((offset, len))),
            None => target.start_writeback(offset, len),
        }
    }

    /// Called after a successful, non-FUA write of `len` bytes at `offset`:
    /// whether to start its write-back now.
    pub(super) fn after_write(&self, offset: u64, len: u64) -> bool {
        if len < WRITE_BEHIND_MIN {
            return false;
        }
        match self.mode {
            WriteBehind::On => true,
            WriteBehind::Off => false,
            WriteBehind::Auto => {
                let again = self.note_written(offset, len);
                let total = self.rewritten.fetch_add(again, Ordering::Relaxed) + again;
                total <= REWRITE_LIMIT
            }
        }
    }

    /// A FLUSH succeeded: everything written before it is clean.
    pub(super) fn flushed(&self) {
        if self.mode != WriteBehind::Auto || !self.marked.swap(false, Ordering::Relaxed) {
            return;
        }
        for leaf in self.written.iter().filter_map(OnceLock::get) {
            for w in leaf.iter() {
                w.store(0, Ordering::Relaxed);
            }
        }
        self.rewritten.store(0, Ordering::Relaxed);
    }

    /// Marks the chunks the range covers whole; returns how many of them
    /// were marked already.
    fn note_written(&self, offset: u64, len: u64) -> u64 {
        let unit = 1u64 << self.chunk_shift;
        let first = offset.div_ceil(unit);
        let end = offset.saturating_add(len) / unit;
        if first < end && !self.marked.load(Ordering::Relaxed) {
            self.marked.store(true, Ordering::Relaxed);
        }
        let mut again = 0;
        let mut chunk = first;
        while chunk < end {
            let Some(slot) = self.written.get((chunk / LEAF_CHUNKS) as usize) else {
                break;
            };
            let leaf = slot.get_or_init(|| Box::new([const { AtomicU64::new(0) }; LEAF_WORDS]));
            let word = ((chunk % LEAF_CHUNKS) / 64) as usize;
            let bit = chunk % 64;
            // Bits of this word the range covers, at most up to its end.
            let n = (64 - bit).min(end - chunk);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            let old = leaf[word].fetch_or(mask, Ordering::Relaxed);
            again += u64::from((old & mask).count_ones());
            chunk += n;
        }
        again
    }
}

/// The starter thread: starts each queued range's write-back, contiguous
/// ones together; it ends when the policy (the sender) is dropped.
fn spawn_starter(target: Arc<Target>) -> Option<SyncSender<(u64, u64)>> {
    let (tx, rx) = sync_channel::<(u64, u64)>(QUEUE);
    let spawned = std::thread::Builder::new()
        .name("rawdisk-wb".into())
        .spawn(move || {
            while let Ok((mut off, mut len)) = rx.recv() {
                while let Ok((o, l)) = rx.try_recv() {
                    if o == off + len && len + l <= MERGE_MAX {
                        len += l;
                    } else {
                        target.start_writeback(off, len);
                        (off, len) = (o, l);
                    }
                }
                target.start_writeback(off, len);
            }
        });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::debug!("no write-behind thread ({e}): starting write-back inline");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A client's writes of `size` bytes each, from `start` to `end`, and
    /// how many started their write-back.
    fn pass(p: &Policy, start: u64, end: u64, size: u64) -> usize {
        (start..end)
            .step_by(size as usize)
            .filter(|&off| p.after_write(off, size))
            .count()
    }

    #[test]
    fn an_import_writes_behind_throughout() {
        // qemu-img convert: 2 MiB writes, each range once, then a flush.
        let p = Policy::new(WriteBehind::Auto, true, 2 << 30);
        assert_eq!(pass(&p, 0, 2 << 30, 2 * MIB), 1024);
        // Out of order (convert -W, nbdcopy's several connections).
        let p = Policy::new(WriteBehind::Auto, true, 64 * MIB);
        let mut offs: Vec<u64> = (0..256).map(|i| i * (256 << 10)).collect();
        offs.reverse();
        offs.rotate_left(100);
        assert!(offs.iter().all(|&o| p.after_write(o, 256 << 10)));
    }

    #[test]
    fn a_stream_that_rewrites_without_flush_stops_it_until_a_flush() {
        let p = Policy::new(WriteBehind::Auto, true, 64 * MIB);
        // First pass over the file: every write is new.
        assert_eq!(pass(&p, 0, 64 * MIB, MIB), 64);
        // Second pass: the first REWRITE_LIMIT chunks (64 KiB each) are
        // tolerated, i.e. the first 4 writes of 1 MiB; then off.
        assert_eq!(pass(&p, 0, 64 * MIB, MIB), 4);
        assert_eq!(pass(&p, 0, 64 * MIB, MIB), 0);
        // A flush shows the clients want durability: on again.
        p.flushed();
        assert_eq!(pass(&p, 0, 64 * MIB, MIB), 64);
    }

    #[test]
    fn a_flush_walks_the_bitmap_only_after_writes() {
        let p = Policy::new(WriteBehind::Auto, true, 64 * MIB);
        p.flushed();
        assert!(!p.marked.load(Ordering::Relaxed));
        assert_eq!(pass(&p, 0, 8 * MIB, MIB), 8);
        assert!(p.marked.load(Ordering::Relaxed));
        p.flushed();
        assert!(!p.marked.load(Ordering::Relaxed));
        // Cleared: the same ranges are new again.
        assert_eq!(pass(&p, 0, 8 * MIB, MIB), 8);
        assert_eq!(p.rewritten.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_retried_request_does_not_turn_it_off() {
        let p = Policy::new(WriteBehind::Auto, true, 64 * MIB);
        assert!(p.after_write(0, 2 * MIB));
        // The same request re-sent after a reconnect: 32 chunks again.
        assert!(p.after_write(0, 2 * MIB));
        assert!(p.after_write(2 * MIB, 2 * MIB));
    }

    #[test]
    fn small_and_unaligned_writes() {
        let p = Policy::new(WriteBehind::Auto, true, 64 * MIB);
        // Below the minimum: left to the kernel, not tracked.
        assert!(!p.after_write(0, 128 << 10));
        // Unaligned: only chunks covered whole are marked, so two writes
        // sharing a chunk at their edges are not a rewrite.
        for i in 0..200u64 {
            assert!(p.after_write(1000 + i * 300_000, 300_000), "write {i}");
        }
        assert_eq!(p.rewritten.load(Ordering::Relaxed), 0);
        // Past the end (the server validates ranges; the policy must not
        // panic on them anyway).
        assert!(p.after_write(u64::MAX - MIB, MIB));
    }

    #[test]
    fn modes_and_targets_without_write_back() {
        for (mode, want) in [(WriteBehind::On, true), (WriteBehind::Off, false)] {
            let p = Policy::new(mode, true, 64 * MIB);
            assert_eq!(pass(&p, 0, 64 * MIB, MIB), if want { 64 } else { 0 });
            assert_eq!(pass(&p, 0, 64 * MIB, MIB), if want { 64 } else { 0 });
        }
        for mode in [WriteBehind::On, WriteBehind::Auto] {
            let p = Policy::new(mode, false, 64 * MIB);
            assert_eq!(pass(&p, 0, 64 * MIB, MIB), 0);
            assert!(p.written.is_empty());
        }
    }

    #[test]
    fn tracking_stays_small_on_huge_targets() {
        let p = Policy::new(WriteBehind::Auto, true, 1 << 50);
        assert!(p.written.len() as u64 * LEAF_CHUNKS <= 2 << MAX_CHUNKS_SHIFT);
        // Chunks grew to fit: a 256 MiB write covers whole chunks.
        assert!(p.after_write(1 << 40, 256 * MIB));
        assert!(p.after_write(1 << 40, 256 * MIB));
        assert!(p.rewritten.load(Ordering::Relaxed) > 0);
    }
}
