//! A WRITE_ZEROES sent alone that the storage answers with one extent call,
//! and a FLUSH sent alone, run on their connection's own thread
//! (`server/transmission.rs`, `SlowTurn`). These tests check that such zeros
//! stay byte-exact with each kind of flags, that a flush reaches the
//! storage every time, that an error still reaches only its request, and
//! that slow ones never hold every runtime worker: another client's read
//! is answered meanwhile. The zero tests mount ext4 and XFS (root): on the
//! usual tmpfs /tmp a zero is not one extent call and goes to the pool.

use std::path::Path;
use std::time::{Duration, Instant};

use rawdisk_nbd::proto::*;
use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{FaultRule, FaultSys};
use rawdisk_testkit::Fs;

mod common;
use common::harness::*;

/// Runs `test` with the disk on ext4 and on XFS, where a zero is one
/// extent call (an unwritten extent or a punched hole).
fn on_extent_zero_fs(test: impl Fn(&Path)) {
    for fs in [Fs::ext4(64 * MIB), Fs::xfs(0)] {
        test(fs.dir());
    }
}

/// One zero at a time, as an in-order client sends them: NO_HOLE, may
/// trim, FUA, fast, unaligned ends; every byte read back, the file too.
#[test]
#[ignore = "needs root"]
fn zeros_sent_one_at_a_time_are_byte_exact() {
    on_extent_zero_fs(zeros_one_at_a_time);
}

fn zeros_one_at_a_time(dir: &Path) {
    for mode in [ReplyMode::Simple, ReplyMode::Extended] {
        let mut h = Harness::start(Setup {
            disk_dir: Some(dir.into()),
            ..Default::default()
        });
        let (mut c, _) = h.open(mode);
        let zeros: [(u16, u64, u64); 7] = [
            (CMD_FLAG_NO_HOLE, 0, MIB),
            (CMD_FLAG_NO_HOLE, MIB, MIB),
            (0, 2 * MIB, 2 * MIB),
            (CMD_FLAG_NO_HOLE | CMD_FLAG_FUA, 4 * MIB + 4096, 64 * KIB),
            (CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO, 5 * MIB, 512 * KIB),
            (CMD_FLAG_NO_HOLE, 6 * MIB + 1000, 70_000),
            (0, 7 * MIB + 3, 4093),
        ];
        for (flags, off, len) in zeros {
            let r = c.cmd(Command::WriteZeroes, flags, off, len, &[]);
            // A fast zero may be refused; then nothing changed.
            if flags & CMD_FLAG_FAST_ZERO != 0 && r.error == NBD_ENOTSUP {
                continue;
            }
            assert_eq!(r.error, 0, "{mode:?} {flags:#x} {off}+{len}: {}", r.message);
            h.model[off as usize..(off + len) as usize].fill(0);
        }
        h.finish(c);
    }
}

/// An error on a zero sent alone is that request's: EIO, the bytes
/// around it unchanged, the connection usable.
#[test]
#[ignore = "needs root"]
fn an_error_on_a_zero_sent_alone_is_its_own() {
    on_extent_zero_fs(error_on_a_zero_alone);
}

fn error_on_a_zero_alone(dir: &Path) {
    let mut h = Harness::start(Setup {
        fault: true,
        disk_dir: Some(dir.into()),
        ..Default::default()
    });
    let fault = h.fault.clone().unwrap();
    let (mut c, _) = h.open(ReplyMode::Structured);
    // Learned first: the path under test needs the call seen working.
    let r = c.cmd(Command::WriteZeroes, CMD_FLAG_NO_HOLE, 0, 64 * KIB, &[]);
    assert_eq!(r.error, 0, "{}", r.message);
    h.model[..64 * KIB as usize].fill(0);
    for kind in WRITING {
        fault.add(FaultRule::over(kind, 3 * MIB, 4096, libc::EIO));
    }
    let r = c.cmd(
        Command::WriteZeroes,
        CMD_FLAG_NO_HOLE,
        2 * MIB,
        2 * MIB,
        &[],
    );
    assert_eq!(r.error, NBD_EIO, "{}", r.message);
    fault.clear_rules();
    // Each byte of the failed request is as before or zero.
    let got = c.read(2 * MIB, 2 * MIB);
    let (s, e) = (2 * MIB as usize, 4 * MIB as usize);
    let odd = (s..e).find(|&i| got[i - s] != 0 && got[i - s] != h.model[i]);
    assert_eq!(odd, None, "the failed zero wrote something else");
    h.model[s..e].copy_from_slice(&got);
    let r = c.cmd(Command::WriteZeroes, CMD_FLAG_NO_HOLE, 5 * MIB, MIB, &[]);
    assert_eq!(r.error, 0, "{}", r.message);
    h.model[5 * MIB as usize..6 * MIB as usize].fill(0);
    h.finish(c);
}

/// Two clients each send one request that the storage makes take 600 ms
/// (`slowed` calls) and a third reads: the read is answered long before the
/// slow ones end, as at most one of them at a time runs on a runtime worker
/// (the harness has two). Either guard alone keeps the read answered
/// (`SlowTurn` leaves a worker free, `block_in_place` hands the busy one's
/// core on): this fails with both removed. `send` sends client `i`'s
/// request (0 or 1) and returns the model's range it zeroes, if any; the
/// disk is in `disk_dir`.
fn slow_ones_leave_a_worker_for_others(
    what: &str,
    disk_dir: Option<&Path>,
    slowed: &[CallKind],
    prepare: impl FnOnce(&mut Harness, &mut Conn),
    send: impl Fn(&mut Conn, u64) -> Option<std::ops::Range<usize>>,
) {
    const SLOW: Duration = Duration::from_millis(600);
    let mut h = Harness::start(Setup {
        fault: true,
        disk_dir: disk_dir.map(Into::into),
        ..Default::default()
    });
    let fault = h.fault.clone().unwrap();
    let (mut a, _) = h.open(ReplyMode::Structured);
    let (mut b, _) = h.open(ReplyMode::Structured);
    let (mut r, _) = h.open(ReplyMode::Structured);
    prepare(&mut h, &mut a);
    // The page cache warm for the reader.
    assert_eq!(
        r.read(7 * MIB, 4096),
        h.model[7 * MIB as usize..7 * MIB as usize + 4096]
    );
    for &kind in slowed {
        fault.add(FaultRule::always(kind, 0).slowed(SLOW));
    }
    let t0 = Instant::now();
    let zeroed: Vec<_> = [&mut a, &mut b]
        .into_iter()
        .enumerate()
        .filter_map(|(i, c)| send(c, i as u64))
        .collect();
    // Both are running before the read arrives.
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    let got = r.read(7 * MIB, 4096);
    let waited = t.elapsed();
    assert_eq!(got, h.model[7 * MIB as usize..7 * MIB as usize + 4096]);
    assert!(
        waited < Duration::from_millis(300),
        "a read waited {waited:?} behind two slow {what}"
    );
    for c in [&mut a, &mut b] {
        let rep = c.recv();
        assert_eq!(rep.error, 0, "{}", rep.message);
    }
    assert!(t0.elapsed() >= SLOW, "the {what} were not slowed");
    fault.clear_rules();
    for range in zeroed {
        h.model[range].fill(0);
    }
    a.disc();
    b.disc();
    h.finish(r);
}

#[test]
#[ignore = "needs root"]
fn slow_zeros_sent_alone_leave_a_worker_for_others() {
    on_extent_zero_fs(slow_zeros_leave_a_worker);
}

fn slow_zeros_leave_a_worker(dir: &Path) {
    slow_ones_leave_a_worker_for_others(
        "zeros",
        Some(dir),
        &WRITING,
        |h, a| {
            // Learned first: the path under test needs the call seen working.
            let r = a.cmd(Command::WriteZeroes, CMD_FLAG_NO_HOLE, 0, 64 * KIB, &[]);
            assert_eq!(r.error, 0, "{}", r.message);
            h.model[..64 * KIB as usize].fill(0);
        },
        |c, i| {
            let off = (1 + 2 * i) * MIB;
            c.send_req(Command::WriteZeroes, CMD_FLAG_NO_HOLE, off, MIB, &[]);
            Some(off as usize..(off + MIB) as usize)
        },
    );
}

fn syncs(f: &FaultSys) -> u64 {
    f.calls(CallKind::Fdatasync) + f.calls(CallKind::Fsync)
}

/// Writes 64 KiB of data `i` at MiB `i`, then sends a FLUSH alone: it
/// succeeds and made exactly one fdatasync.
fn write_then_flush(h: &mut Harness, c: &mut Conn, fault: &FaultSys, i: u64, what: &str) {
    let data = random(64 * KIB as usize, 40 + i);
    c.write(i * MIB, &data);
    h.model[(i * MIB) as usize..][..data.len()].copy_from_slice(&data);
    let before = syncs(fault);
    let r = c.cmd(Command::Flush, 0, 0, 0, &[]);
    assert_eq!(r.error, 0, "{what} flush {i}: {}", r.message);
    assert_eq!(syncs(fault), before + 1, "{what} flush {i}: no fdatasync");
}

/// Flushes sent one at a time, with and without writes between them: each
/// one the client sees succeed made its own fdatasync, after the write it
/// follows, and every byte reads back.
#[test]
fn flushes_sent_alone_each_reach_the_storage() {
    for mode in [ReplyMode::Simple, ReplyMode::Extended] {
        let mut h = Harness::start(Setup {
            fault: true,
            ..Default::default()
        });
        let fault = h.fault.clone().unwrap();
        fault.record_spans();
        let (mut c, _) = h.open(mode);
        for i in 0..4u64 {
            write_then_flush(&mut h, &mut c, &fault, i, &format!("{mode:?}"));
        }
        // The storage saw each write before the flush that follows it.
        let spans = fault.take_spans();
        let order: Vec<bool> = spans
            .iter()
            .filter(|s| matches!(s.kind, CallKind::Pwrite | CallKind::Fdatasync))
            .map(|s| s.kind == CallKind::Fdatasync)
            .collect();
        assert_eq!(
            order,
            [false, true].repeat(4),
            "{mode:?}: writes and flushes out of order"
        );
        h.finish(c);
    }
}

/// A flush that fails is answered EIO, and so is every later one (the
/// kernel may have dropped what it could not write: the flush-failure
/// rule), without another fdatasync to answer success falsely; the
/// connection stays usable and the data reads back.
#[test]
fn a_failed_flush_sent_alone_is_remembered() {
    let mut h = Harness::start(Setup {
        fault: true,
        ..Default::default()
    });
    let fault = h.fault.clone().unwrap();
    let (mut c, _) = h.open(ReplyMode::Structured);
    let data = random(64 * KIB as usize, 7);
    c.write(MIB, &data);
    h.model[MIB as usize..][..data.len()].copy_from_slice(&data);
    fault.add(FaultRule::always(CallKind::Fdatasync, libc::EIO));
    fault.add(FaultRule::always(CallKind::Fsync, libc::EIO));
    let r = c.cmd(Command::Flush, 0, 0, 0, &[]);
    assert_eq!(r.error, NBD_EIO, "{}", r.message);
    fault.clear_rules();
    let before = syncs(&fault);
    for _ in 0..2 {
        let r = c.cmd(Command::Flush, 0, 0, 0, &[]);
        assert_eq!(
            r.error, NBD_EIO,
            "a flush after a failed one: {}",
            r.message
        );
    }
    assert_eq!(syncs(&fault), before, "synced again after a failed flush");
    check_reads(&mut c, &h.model);
    c.disc();
    // The stop's flush is refused too: the stop says so.
    let e = h
        .stop()
        .expect_err("a stop after a failed flush said it flushed");
    assert!(e.to_string().contains("earlier flush"), "{e}");
}

#[test]
fn slow_flushes_sent_alone_leave_a_worker_for_others() {
    slow_ones_leave_a_worker_for_others(
        "flushes",
        None,
        &[CallKind::Fdatasync, CallKind::Fsync],
        |_, _| {},
        |c, _| {
            c.send_req(Command::Flush, 0, 0, 0, &[]);
            None
        },
    );
}

/// On a single-threaded runtime (the library's embedder may choose one)
/// nothing takes a connection's own thread: `block_in_place` would panic
/// there. Lone flushes and zeros are answered, each flush reaching the
/// storage, and every byte reads back.
#[test]
fn on_a_single_threaded_runtime_lone_flushes_and_zeros_are_answered() {
    let mut h = Harness::start(Setup {
        fault: true,
        current_thread: true,
        ..Default::default()
    });
    let fault = h.fault.clone().unwrap();
    let (mut c, _) = h.open(ReplyMode::Structured);
    for i in 0..3u64 {
        write_then_flush(&mut h, &mut c, &fault, i, "single-threaded");
        let off = 4 * MIB + i * MIB;
        let r = c.cmd(Command::WriteZeroes, CMD_FLAG_NO_HOLE, off, MIB, &[]);
        assert_eq!(r.error, 0, "zero {i}: {}", r.message);
        h.model[off as usize..(off + MIB) as usize].fill(0);
    }
    h.finish(c);
}
