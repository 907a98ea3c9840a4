//! Randomized model test per storage kind: random write / zero (every flag
//! combination) / trim / preallocate / flush / read sequences, compared byte
//! for byte with an in-memory model.
//!
//! What the engine guarantees, and so what the model says:
//! * write: the bytes; zero: zeros (fast_only may instead fail with ENOTSUP
//!   and change nothing);
//! * trim on a file: PUNCH_HOLE, so the range reads zero where the file
//!   system can punch (tmpfs, ext4, XFS) and is unchanged where it cannot
//!   (ramfs: trim is advisory);
//! * trim on a block device: BLKDISCARD of the whole sectors inside the range
//!   only, whose contents afterwards are "old or zero" (nothing promised);
//!   the partial sectors at either end are untouched;
//! * preallocate grows a file with zeros and keeps its data; on a block
//!   device it changes nothing.
//!
//! The seed is printed; set RAWDISK_MODEL_SEED to replay one.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use rawdisk_storage::{Prealloc, ZeroFlags};
use rawdisk_testkit::{pattern_vec, read_all, Scratch, StorageKind, KIB, MIB};

use crate::common::*;
use crate::per_kind;

struct Model {
    val: Vec<u8>,
    /// The byte may also read as zero (discarded sector of a block device).
    or_zero: Vec<bool>,
}

impl Model {
    fn check(&mut self, off: u64, got: &[u8], what: &str, log: &[String]) {
        let o = off as usize;
        let want = &self.val[o..o + got.len()];
        if got != want {
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                if g != w && !(g == 0 && self.or_zero[o + i]) {
                    let tail = &log[log.len().saturating_sub(12)..];
                    panic!(
                        "{what}: offset {} reads {g:#04x}, model says {w:#04x}{}; last ops:\n  {}",
                        off + i as u64,
                        if self.or_zero[o + i] { " or 0" } else { "" },
                        tail.join("\n  ")
                    );
                }
            }
        }
        // What was read is what the storage now holds.
        self.val[o..o + got.len()].copy_from_slice(got);
        self.or_zero[o..o + got.len()].fill(false);
    }

    fn set(&mut self, off: u64, data: &[u8]) {
        let o = off as usize;
        self.val[o..o + data.len()].copy_from_slice(data);
        self.or_zero[o..o + data.len()].fill(false);
    }

    fn zero(&mut self, off: u64, len: u64) {
        let (a, b) = (off as usize, (off + len) as usize);
        self.val[a..b].fill(0);
        self.or_zero[a..b].fill(false);
    }
}

fn seed_for(kind: StorageKind) -> u64 {
    match std::env::var("RAWDISK_MODEL_SEED") {
        Ok(s) => s.parse().expect("RAWDISK_MODEL_SEED: a number"),
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64;
            t ^ (kind as u64) << 56
        }
    }
}

pub fn model(kind: StorageKind) {
    const START: u64 = 8 * MIB;
    const OPS: usize = 300;
    let seed = seed_for(kind);
    eprintln!("model {kind}: RAWDISK_MODEL_SEED={seed}");
    let mut rng = SmallRng::seed_from_u64(seed);
    // Room for the growth by preallocate (up to 24 MiB + 2 MiB).
    let s = Scratch::with_room(kind, START, 64 * MIB);
    let path = s.path().to_owned();
    let p = open_probe(&path);
    let t = &p.target;
    let ss = offload_align(kind);
    let mut m = Model {
        val: vec![0; START as usize],
        or_zero: vec![false; START as usize],
    };
    let mut log: Vec<String> = Vec::new();
    let what = |i: usize| format!("{kind} seed {seed} op {i}");

    // Random range: often sector/block aligned, sometimes up to the end.
    let range = |rng: &mut SmallRng, size: u64, max: u64| -> (u64, u64) {
        let mut len = rng.gen_range(1..=max.min(size));
        let mut off = rng.gen_range(0..=size - len);
        match rng.gen_range(0..4) {
            0 => {
                let a = if rng.gen_bool(0.5) { 4096 } else { 512 };
                off = off / a * a;
                len = (len / a * a).max(a).min(size - off);
            }
            1 => len = size - off,
            _ => {}
        }
        (off, len)
    };

    for i in 0..OPS {
        let size = m.val.len() as u64;
        match rng.gen_range(0..100) {
            0..=29 => {
                let (off, len) = range(&mut rng, size, 256 * KIB);
                let data = pattern_vec(rng.gen(), off, len as usize);
                let fua = rng.gen_bool(0.2);
                log.push(format!("write {off}+{len} fua={fua}"));
                t.write_at(&data, off, fua)
                    .unwrap_or_else(|e| panic!("{}: {e}", what(i)));
                m.set(off, &data);
            }
            30..=59 => {
                let (off, len) = range(&mut rng, size, 2 * MIB);
                let flags = ZeroFlags {
                    may_trim: rng.gen_bool(0.5),
                    fast_only: rng.gen_bool(0.3),
                };
                let r = t.zero(off, len, flags);
                log.push(format!("zero {off}+{len} {flags:?} -> {r:?}"));
                match r {
                    Ok(_) => m.zero(off, len),
                    Err(e) if flags.fast_only && e.errno() == Some(libc::EOPNOTSUPP) => {}
                    Err(e) => panic!("{}: zero {off}+{len} {flags:?}: {e}", what(i)),
                }
            }
            60..=74 => {
                let (off, len) = range(&mut rng, size, 2 * MIB);
                log.push(format!("trim {off}+{len}"));
                t.trim(off, len)
                    .unwrap_or_else(|e| panic!("{}: trim: {e}", what(i)));
                match kind {
                    k if !punch_frees(k) => {}
                    k if k.is_block() => {
                        let a = off.div_ceil(ss) * ss;
                        let b = (off + len) / ss * ss;
                        if b > a {
                            m.or_zero[a as usize..b as usize].fill(true);
                        }
                    }
                    _ => m.zero(off, len),
                }
            }
            75..=79 => {
                let mode = [Prealloc::Off, Prealloc::Falloc, Prealloc::Full][rng.gen_range(0..3)];
                let new = if kind.is_block() || size >= 24 * MIB {
                    size - rng.gen_range(0..=size / 2)
                } else {
                    size + rng.gen_range(0..=2 * MIB)
                };
                log.push(format!("preallocate {new} {mode:?}"));
                if new >= size {
                    t.preallocate(new, mode)
                        .unwrap_or_else(|e| panic!("{}: preallocate: {e}", what(i)));
                    m.val.resize(new as usize, 0);
                    m.or_zero.resize(new as usize, false);
                } else if kind.is_block() {
                    // Fits the device: nothing happens.
                    t.preallocate(new, mode)
                        .unwrap_or_else(|e| panic!("{}: preallocate: {e}", what(i)));
                }
                assert_eq!(t.size(), m.val.len() as u64, "{}: size", what(i));
            }
            80..=84 => {
                log.push("flush".into());
                t.flush()
                    .unwrap_or_else(|e| panic!("{}: flush: {e}", what(i)));
            }
            _ => {
                let (off, len) = range(&mut rng, size, 512 * KIB);
                log.push(format!("read {off}+{len}"));
                let mut buf = vec![0xa5u8; len as usize];
                t.read_at(&mut buf, off)
                    .unwrap_or_else(|e| panic!("{}: read: {e}", what(i)));
                m.check(off, &buf, &what(i), &log);
            }
        }
        if i % 50 == 49 {
            let all = read_all(&path);
            assert_eq!(all.len(), m.val.len(), "{}: size", what(i));
            m.check(0, &all, &format!("{} full read", what(i)), &log);
        }
    }
    t.flush().unwrap();
    let all = read_all(&path);
    assert_eq!(all.len(), m.val.len(), "{kind}: final size");
    m.check(0, &all, &format!("{kind} seed {seed} final"), &log);
}
per_kind!(model);
