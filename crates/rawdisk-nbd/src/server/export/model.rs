//! A model test of the export layer: random sequences of writes (buffered,
//! with FUA, and received into the mapped page cache), zeroes, trims,
//! flushes, checkpoints created and deleted by another process (as
//! `rawdisk checkpoint` does), clean restarts and crashes (the tracker
//! dropped without closing), checked against a model of the image and of
//! what each checkpoint must report. The mapped writes are fed from an
//! in-process socket pair: `MappedWrite` can only receive from a socket.
//! Under cache=none the same run sends aligned writes through the queue of
//! requests in flight in the kernel (Linux AIO) instead, reaped both by
//! polling and by waiting.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rawdisk_storage::cbt::{StateFile, TrackOptions, Tracker};
use rawdisk_storage::{CacheMode, DirectOp, OpenOptions, Target, ZeroFlags};

use super::Export;
use crate::server::writeback::WriteBehind;

const SIZE: u64 = 4 << 20;
const GRANULARITY: u64 = 4 << 10;
const CHUNKS: usize = (SIZE / GRANULARITY) as usize;
const STEPS: usize = 200;
/// Checkpoints kept at most (the state file holds 32).
const MAX_KEPT: usize = 6;

/// What the test expects of one checkpoint.
struct Checkpoint {
    name: String,
    /// Chunks changed since it was created: it must report each of them.
    must: Vec<bool>,
    /// False once a crash made it inconsistent (it then reports all).
    consistent: bool,
}

struct Run {
    path: PathBuf,
    rng: SmallRng,
    mode: WriteBehind,
    /// cache=none: the AIO path instead of the mapped one.
    direct: bool,
    export: Option<Export>,
    tracker: Option<Arc<Tracker>>,
    /// The image as it must read...
    want: Vec<u8>,
    /// ...but for trimmed bytes, which may also read as zeros.
    may_be_zero: Vec<bool>,
    checkpoints: Vec<Checkpoint>,
    next_name: u32,
    mapped: usize,
    mid_write_checkpoints: usize,
}

impl Run {
    fn new(dir: &Path, seed: u64, mode: WriteBehind, direct: bool) -> Run {
        let path = dir.join(format!("disk-{seed}.img"));
        let mut rng = SmallRng::seed_from_u64(seed);
        let want: Vec<u8> = (0..SIZE).map(|_| rng.gen()).collect();
        std::fs::write(&path, &want).unwrap();
        let mut r = Run {
            path,
            rng,
            mode,
            direct,
            export: None,
            tracker: None,
            want,
            may_be_zero: vec![false; SIZE as usize],
            checkpoints: Vec::new(),
            next_name: 0,
            mapped: 0,
            mid_write_checkpoints: 0,
        };
        r.start();
        r
    }

    /// Opens the target, its tracker and the export, as `serve` does.
    fn start(&mut self) {
        let cache = if self.direct {
            CacheMode::None
        } else {
            CacheMode::Writeback
        };
        let opts = OpenOptions {
            cache,
            ..Default::default()
        };
        let target = Target::open(&self.path, &opts).unwrap();
        let opts = TrackOptions {
            granularity: Some(GRANULARITY),
            state_dir: None,
        };
        let tracker = Arc::new(Tracker::open(&self.path, SIZE, &opts).unwrap());
        let export = Export::new(
            "model".into(),
            Arc::new(target),
            false,
            self.mode,
            32 << 20,
            (0, 0),
            Some(tracker.clone()),
        );
        self.export = Some(export);
        self.tracker = Some(tracker);
    }

    fn export(&self) -> &Export {
        self.export.as_ref().unwrap()
    }

    /// A range of at least one byte, often long enough for write-behind.
    fn range(&mut self) -> (u64, u64) {
        let len = match self.rng.gen_range(0..4) {
            0 => self.rng.gen_range(1..=8192),
            1 => self.rng.gen_range(1..=128 << 10),
            _ => self.rng.gen_range(256 << 10..=768 << 10),
        };
        let offset = self.rng.gen_range(0..SIZE - len);
        (offset, len)
    }

    /// Every checkpoint must now report the chunks of the range.
    fn changed(&mut self, offset: u64, len: u64) {
        let first = (offset / GRANULARITY) as usize;
        let last = ((offset + len - 1) / GRANULARITY) as usize;
        for c in &mut self.checkpoints {
            c.must[first..=last].fill(true);
        }
    }

    fn step(&mut self, i: usize) {
        match self.rng.gen_range(0..100) {
            0..=29 => self.write(),
            30..=49 if self.direct => self.in_kernel_write(),
            30..=49 => self.mapped_write(),
            50..=59 => self.zero(),
            60..=69 => self.trim(),
            70..=79 => self.export().flush().unwrap(),
            80..=87 => self.create_checkpoint(),
            88..=92 => self.delete_checkpoint(),
            93..=96 => self.restart(),
            _ => self.crash(),
        }
        self.check_tracking(&format!("after step {i}"));
    }

    fn write(&mut self) {
        let (offset, len) = self.range();
        let data: Vec<u8> = (0..len).map(|_| self.rng.gen()).collect();
        let fua = self.rng.gen_bool(0.2);
        self.export().write(offset, &data, fua).unwrap();
        self.wrote(offset, &data);
    }

    fn wrote(&mut self, offset: u64, data: &[u8]) {
        let (o, n) = (offset as usize, data.len());
        self.want[o..o + n].copy_from_slice(data);
        self.may_be_zero[o..o + n].fill(false);
        self.changed(offset, n as u64);
    }

    /// A write received into the mapped page cache, the first bytes (read
    /// ahead with the header) written the ordinary way. Sometimes, while the
    /// payload is arriving, another connection flushes (which persists the
    /// write's first mark into the older checkpoint) and another process
    /// creates a checkpoint: only the mark when the write is done puts it
    /// in the new one.
    fn mapped_write(&mut self) {
        let (offset, len) = self.range();
        let data: Vec<u8> = (0..len).map(|_| self.rng.gen()).collect();
        let head = self.rng.gen_range(0..len.min(64 << 10));
        let during = self.rng.gen_bool(0.3) && self.checkpoints.len() < MAX_KEPT;
        let name = during.then(|| self.next_name());
        // Only cached pages map: read the range into the page cache.
        let f = std::fs::File::open(&self.path).unwrap();
        f.read_exact_at(&mut vec![0; len as usize], offset).unwrap();
        let e = self.export.as_ref().unwrap();
        let Some(mut mw) = e.map_write(offset, len, head) else {
            self.export().write(offset, &data, false).unwrap();
            self.wrote(offset, &data);
            return;
        };
        mw.write_head(&data[..head as usize]).unwrap();
        let new = name.map(|name| {
            e.flush().unwrap();
            self.make_checkpoint(name)
        });
        let (mut tx, rx) = UnixStream::pair().unwrap();
        rx.set_nonblocking(true).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| tx.write_all(&data[head as usize..]).unwrap());
            while mw.pages().remaining() > 0 {
                match mw.pages().recv(rx.as_fd()) {
                    Ok(n) => assert!(n > 0, "socket closed early"),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::yield_now()
                    }
                    Err(e) => panic!("mapped write: {e}"),
                }
            }
        });
        mw.finish(true);
        self.mapped += 1;
        if let Some(c) = new {
            // The write landed after the checkpoint: it must be in it.
            self.checkpoints.push(c);
            self.mid_write_checkpoints += 1;
        }
        self.wrote(offset, &data);
    }

    /// Aligned writes in flight in the kernel. Sometimes, after they are
    /// submitted and before they are reaped, another connection flushes and
    /// another process creates a checkpoint: only the mark at the reap puts
    /// them in the new one. What the queue refuses or fails goes the
    /// blocking way, as the server does.
    fn in_kernel_write(&mut self) {
        const A: u64 = 4096;
        let e = self.export.as_ref().unwrap();
        let Some(mut q) = e.direct_queue::<usize>(8) else {
            return self.write();
        };
        let n = self.rng.gen_range(1..=4);
        let mut ops = Vec::new();
        let mut writes = Vec::new();
        for i in 0..n {
            let len = self.rng.gen_range(1..=16) * A;
            let offset = self.rng.gen_range(0..(SIZE - len) / A) * A;
            let data: Vec<u8> = (0..len).map(|_| self.rng.gen()).collect();
            let mut buf = vec![0u8; len as usize + A as usize];
            let start = buf.as_ptr().align_offset(A as usize);
            buf[start..start + len as usize].copy_from_slice(&data);
            ops.push(DirectOp {
                write: true,
                offset,
                buf,
                start,
                len: len as usize,
                tag: i,
            });
            writes.push((offset, data));
        }
        let during = self.rng.gen_bool(0.3) && self.checkpoints.len() < MAX_KEPT;
        let name = during.then(|| self.next_name());
        let e = self.export.as_ref().unwrap();
        let mut redo = e.submit_direct(&mut q, ops);
        let new = name.map(|name| {
            e.flush().unwrap();
            self.make_checkpoint(name)
        });
        let mut done = Vec::new();
        // Half the batches are reaped by waiting, as a reaper that cannot
        // poll the eventfd drains its queue (inkernel.rs): the same marks.
        let wait = n % 2 == 0;
        while q.in_flight() > 0 {
            e.reap_direct(&mut q, &mut done, wait).unwrap();
            std::thread::yield_now();
        }
        for d in done {
            if d.done {
                self.mapped += 1;
            } else {
                redo.push(d.op);
            }
        }
        for op in redo {
            let data = &op.buf[op.start..op.start + op.len];
            e.write(op.offset, data, false).unwrap();
        }
        if let Some(c) = new {
            self.checkpoints.push(c);
            self.mid_write_checkpoints += 1;
        }
        // Overlapping writes in one batch land in any order: the model
        // takes them in order, so the batch's ranges are written again in
        // order the blocking way when two overlap.
        let overlap = writes.iter().enumerate().any(|(i, (o, d))| {
            writes[..i]
                .iter()
                .any(|(p, f)| *p < o + d.len() as u64 && *o < p + f.len() as u64)
        });
        for (offset, data) in writes {
            if overlap {
                self.export().write(offset, &data, false).unwrap();
            }
            self.wrote(offset, &data);
        }
    }

    fn zero(&mut self) {
        let (offset, len) = self.range();
        let flags = ZeroFlags {
            may_trim: self.rng.gen_bool(0.5),
            fast_only: false,
        };
        let fua = self.rng.gen_bool(0.2);
        self.export().zero(offset, len, flags, fua).unwrap();
        self.wrote(offset, &vec![0; len as usize]);
    }

    fn trim(&mut self) {
        let (offset, len) = self.range();
        let fua = self.rng.gen_bool(0.2);
        self.export().trim(offset, len, fua).unwrap();
        let (o, n) = (offset as usize, len as usize);
        self.may_be_zero[o..o + n].fill(true);
        self.changed(offset, len);
    }

    fn state_file(&self) -> StateFile {
        StateFile::open(&self.path, None, false).unwrap()
    }

    fn next_name(&mut self) -> String {
        self.next_name += 1;
        format!("c{}", self.next_name)
    }

    /// A checkpoint made by another process, as `rawdisk checkpoint create`.
    fn make_checkpoint(&self, name: String) -> Checkpoint {
        self.state_file().create_checkpoint(Some(&name)).unwrap();
        Checkpoint {
            name,
            must: vec![false; CHUNKS],
            consistent: true,
        }
    }

    fn create_checkpoint(&mut self) {
        if self.checkpoints.len() >= MAX_KEPT {
            self.delete_checkpoint();
        }
        let name = self.next_name();
        let c = self.make_checkpoint(name);
        self.checkpoints.push(c);
    }

    fn delete_checkpoint(&mut self) {
        if self.checkpoints.is_empty() {
            return;
        }
        let k = self.rng.gen_range(0..self.checkpoints.len());
        let c = self.checkpoints.remove(k);
        self.state_file().delete_checkpoint(&c.name).unwrap();
    }

    /// A clean stop (the tracker closed) and a new start.
    fn restart(&mut self) {
        self.export = None;
        let t = self.tracker.take().unwrap();
        t.close().unwrap();
        drop(t);
        self.start();
        self.check_data("after a restart");
    }

    /// The server killed: the tracker let go of without closing. Every
    /// checkpoint from before is then inconsistent.
    fn crash(&mut self) {
        self.export = None;
        let t = self.tracker.take().unwrap();
        Arc::try_unwrap(t)
            .expect("the export held the only other reference")
            .abandon();
        for c in &mut self.checkpoints {
            c.consistent = false;
        }
        self.start();
        self.check_data("after a crash");
    }

    /// What the tracker reports against the model, as block status would
    /// ask it (after picking up checkpoints of other processes).
    fn check_tracking(&self, when: &str) {
        let t = self.tracker.as_ref().unwrap();
        t.refresh().unwrap();
        let listed = t.checkpoints();
        let names: Vec<&str> = listed.iter().map(|c| c.name.as_str()).collect();
        let want: Vec<&str> = self.checkpoints.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, want, "checkpoints {when}");
        for (c, info) in self.checkpoints.iter().zip(&listed) {
            assert_eq!(
                info.consistent, c.consistent,
                "checkpoint {} consistent {when}",
                c.name
            );
            let runs = t.changed(&c.name, 0, SIZE, usize::MAX).unwrap();
            assert_eq!(runs.iter().map(|r| r.0).sum::<u64>(), SIZE);
            let mut at = 0u64;
            let mut reported = vec![false; CHUNKS];
            for (len, changed) in runs {
                if changed {
                    let first = (at / GRANULARITY) as usize;
                    let last = ((at + len - 1) / GRANULARITY) as usize;
                    reported[first..=last].fill(true);
                }
                at += len;
            }
            if !c.consistent {
                assert!(reported.iter().all(|&r| r), "{} reports all {when}", c.name);
            }
            let hidden: Vec<usize> = (0..CHUNKS).filter(|&k| c.must[k] && !reported[k]).collect();
            assert!(
                hidden.is_empty(),
                "checkpoint {} hides changed chunks {when}: {:?}",
                c.name,
                &hidden[..hidden.len().min(16)]
            );
        }
    }

    /// Every byte of the image against the model.
    fn check_data(&self, when: &str) {
        let got = std::fs::read(&self.path).unwrap();
        assert_eq!(got.len() as u64, SIZE, "size {when}");
        let bad = (0..SIZE as usize)
            .find(|&i| got[i] != self.want[i] && !(self.may_be_zero[i] && got[i] == 0));
        assert_eq!(bad, None, "first byte that differs {when}");
    }
}

fn run(seed: u64, mode: WriteBehind, direct: bool) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let mut r = Run::new(dir.path(), seed, mode, direct);
    for i in 0..STEPS {
        r.step(i);
    }
    r.restart();
    r.check_tracking("at the end");
    r.export = None;
    r.tracker = None;
    r
}

#[test]
fn every_change_is_reported_on_every_path() {
    let mut mapped = 0;
    let mut during = 0;
    for (seed, mode) in [
        (1, WriteBehind::Off),
        (2, WriteBehind::On),
        (3, WriteBehind::Auto),
        (4, WriteBehind::On),
    ] {
        let r = run(seed, mode, false);
        mapped += r.mapped;
        during += r.mid_write_checkpoints;
    }
    // The mapped path ran, and checkpoints were made in the middle of it.
    assert!(mapped > 40, "{mapped} mapped writes");
    assert!(during > 5, "{during} checkpoints during a write");
}

#[test]
fn every_change_is_reported_with_writes_in_flight_in_the_kernel() {
    let mut in_kernel = 0;
    let mut during = 0;
    for seed in [5, 6] {
        let r = run(seed, WriteBehind::Off, true);
        in_kernel += r.mapped;
        during += r.mid_write_checkpoints;
    }
    // The AIO path ran, and checkpoints were made while writes were in it.
    assert!(in_kernel > 40, "{in_kernel} writes in flight in the kernel");
    assert!(during > 5, "{during} checkpoints during a write");
}
