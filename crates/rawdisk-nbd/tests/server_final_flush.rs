//! The final flush at stop runs only for an export written since its last
//! flush that succeeded, as qemu-nbd's: on NFS each one is a COMMIT round
//! trip. Counted as the fdatasync calls the target made (a FaultSys), with
//! every byte read back and the file compared after the stop.

use std::sync::Arc;

use rawdisk_nbd::proto::*;
use rawdisk_storage::sys::CallKind;
use rawdisk_storage::FaultSys;

mod common;
use common::harness::*;

fn start() -> (Harness, Arc<FaultSys>, Conn) {
    let h = Harness::start(Setup {
        fault: true,
        ..Default::default()
    });
    let fault = h.fault.clone().unwrap();
    let (c, _) = h.open(ReplyMode::Structured);
    (h, fault, c)
}

fn syncs(f: &FaultSys) -> u64 {
    f.calls(CallKind::Fdatasync) + f.calls(CallKind::Fsync)
}

fn write(h: &mut Harness, c: &mut Conn, offset: u64, seed: u64) {
    let data = random(64 * KIB as usize, seed);
    c.write(offset, &data);
    h.model[offset as usize..][..data.len()].copy_from_slice(&data);
}

fn flush(c: &mut Conn) -> Reply {
    c.cmd(Command::Flush, 0, 0, 0, &[])
}

/// Reads the export back, disconnects, stops the server (which must say
/// it stopped cleanly) and compares the file.
fn stop(h: &mut Harness, mut c: Conn) {
    check_reads(&mut c, &h.model);
    c.disc();
    h.stop().expect("the stop");
    h.check_file();
}

/// (a) A write and the client's FLUSH: that one fdatasync, none at stop.
#[test]
fn a_flushed_write_is_not_flushed_again_at_stop() {
    let (mut h, fault, mut c) = start();
    write(&mut h, &mut c, MIB, 1);
    assert_eq!(flush(&mut c).error, 0);
    assert_eq!(syncs(&fault), 1, "the client's flush");
    stop(&mut h, c);
    assert_eq!(
        syncs(&fault),
        1,
        "flushed again at stop with nothing written"
    );
}

/// A server only read from flushes nothing at stop.
#[test]
fn an_export_only_read_is_not_flushed_at_stop() {
    let (mut h, fault, c) = start();
    stop(&mut h, c);
    assert_eq!(syncs(&fault), 0, "flushed at stop with nothing written");
}

/// (b) A write never flushed by the client: flushed once, at stop.
#[test]
fn an_unflushed_write_is_flushed_at_stop() {
    let (mut h, fault, mut c) = start();
    write(&mut h, &mut c, MIB, 2);
    assert_eq!(syncs(&fault), 0);
    stop(&mut h, c);
    assert_eq!(syncs(&fault), 1, "the write was not flushed at stop");
}

/// (c) A write, a FLUSH, then WRITE_ZEROES (the zero line) and a write
/// past the flush: the stop flushes them.
#[test]
fn a_zero_after_the_last_flush_is_flushed_at_stop() {
    let (mut h, fault, mut c) = start();
    write(&mut h, &mut c, MIB, 3);
    assert_eq!(flush(&mut c).error, 0);
    let r = c.cmd(Command::WriteZeroes, 0, MIB + 4 * KIB, 8 * KIB, &[]);
    assert_eq!(r.error, 0, "{}", r.message);
    h.model[(MIB + 4 * KIB) as usize..][..8 * KIB as usize].fill(0);
    assert_eq!(syncs(&fault), 1);
    stop(&mut h, c);
    assert_eq!(syncs(&fault), 2, "the zero was not flushed at stop");
}

/// (d) A FLUSH that failed covers nothing: the stop flushes again, and
/// reports that the data may be lost (the target refuses every flush after
/// a failed one), exactly as before.
#[test]
fn after_a_failed_flush_the_stop_flushes_and_reports_it() {
    let (mut h, fault, mut c) = start();
    write(&mut h, &mut c, MIB, 4);
    fault.fail_once(CallKind::Fdatasync, 1, libc::EIO);
    assert_eq!(flush(&mut c).error, NBD_EIO, "the injected EIO");
    assert_eq!(syncs(&fault), 1);
    check_reads(&mut c, &h.model);
    c.disc();
    let err = h.stop().expect_err("a stop that hides the failed flush");
    assert!(err.to_string().contains("final flush"), "{err}");
    h.check_file();
}
