//! An export that serves a window of its target (`ServerConfig::window`:
//! qemu's raw driver `offset`/`size`, qemu-nbd `--offset`): the client sees
//! only the window, at offset 0, and no storage call touches a byte outside
//! it, whatever the request (reads of every size, the hole and splice
//! paths, writes, mapped writes, zeroes, trims, cache hints, block status).

use rawdisk_nbd::proto::*;
use rawdisk_nbd::server::Window;
use rawdisk_storage::sys::CallKind;

mod common;
use common::harness::*;

/// A window that starts and ends off any power-of-two boundary a storage
/// path might round to.
const BASE: u64 = MIB + 3 * 512;
const SIZE: u64 = 4 * MIB + 512;
/// Under O_DIRECT serve requires a window on the direct I/O alignment.
const DIRECT_BASE: u64 = MIB + 3 * 4096;
const DIRECT_SIZE: u64 = 4 * MIB + 4096;

fn windowed(fault: bool, cache_none: bool, map_writes: bool) -> Harness {
    let (offset, size) = match cache_none {
        false => (BASE, SIZE),
        true => (DIRECT_BASE, DIRECT_SIZE),
    };
    let mut s = Setup::cfg(|c| {
        c.window = Window {
            offset,
            size: Some(size),
        };
        c.map_writes = map_writes;
    });
    s.fault = fault;
    s.cache_none = cache_none;
    Harness::start(s)
}

/// Every request kind the server runs, through `c`, with `want` (the
/// export's bytes, kept up to date) checked after each read.
fn drive(c: &mut Conn, want: &mut [u8]) {
    let size = want.len() as u64;
    // Reads: small ones, 64 KiB and more (splice, the hole lookup), the
    // last bytes, the whole export.
    for (off, len) in [
        (0, 4096),
        (4096, 8192),
        (64 * KIB, 256 * KIB),
        (size - 8192, 8192),
        (0, size),
    ] {
        let got = c.read(off, len);
        assert!(
            got == want[off as usize..(off + len) as usize],
            "read {off}+{len}"
        );
    }
    // Writes: a small one at the start, a mapped-size one, one at the end.
    for (off, len, seed) in [
        (0, 4096usize, 1),
        (MIB, 256 * KIB as usize, 2),
        (size - 4096, 4096, 3),
    ] {
        let d = random(len, seed);
        c.write(off, &d);
        want[off as usize..off as usize + len].copy_from_slice(&d);
    }
    // Zeroes that may punch and that may not, a trim, a cache hint.
    for (flags, off, len) in [
        (0, 2 * MIB, 128 * KIB),
        (CMD_FLAG_NO_HOLE, 3 * MIB, 64 * KIB),
    ] {
        let r = c.cmd(Command::WriteZeroes, flags, off, len, &[]);
        assert_eq!(r.error, 0, "zero: {}", r.message);
        want[off as usize..(off + len) as usize].fill(0);
    }
    let r = c.cmd(Command::Trim, 0, size - 64 * KIB, 64 * KIB, &[]);
    assert_eq!(r.error, 0, "trim: {}", r.message);
    // A trim may leave zeros or the old bytes: read what it left.
    let tail = c.read(size - 64 * KIB, 64 * KIB);
    want[(size - 64 * KIB) as usize..].copy_from_slice(&tail);
    let r = c.cmd(Command::Cache, 0, 0, size, &[]);
    assert_eq!(r.error, 0, "cache: {}", r.message);
    // Block status covers the export from 0, no further.
    let r = c.cmd(Command::BlockStatus, 0, 0, size, &[]);
    assert_eq!(r.error, 0, "block status: {}", r.message);
    let covered: u64 = r.descriptors.iter().map(|d| d.length).sum();
    assert!(
        covered > 0 && covered <= size,
        "block status covered {covered}"
    );
    let r = c.cmd(Command::Flush, 0, 0, 0, &[]);
    assert_eq!(r.error, 0, "flush: {}", r.message);
    // Past the window's end is the client's error, not the next bytes.
    let r = c.cmd(Command::Read, 0, size - 4096, 8192, &[]);
    assert_eq!(r.error, NBD_EINVAL, "a read past the end");
    let r = c.cmd(Command::Write, 0, size, 4096, &[7u8; 4096]);
    assert_eq!(r.error, NBD_ENOSPC, "a write past the end");
    let got = c.read(0, size);
    assert!(got == want, "the export differs from the model");
}

/// The export is the window: its size, its bytes; every storage call lies
/// inside the window, and the bytes around it are never changed.
#[test]
fn no_storage_call_leaves_the_window() {
    for map_writes in [false, true] {
        let mut h = windowed(true, false, map_writes);
        let fault = h.fault.clone().unwrap();
        fault.record();
        let (mut c, info) = h.open(ReplyMode::Structured);
        assert_eq!(info.size, SIZE, "the export's size is the window's");
        let mut want = h.model[BASE as usize..(BASE + SIZE) as usize].to_vec();
        drive(&mut c, &mut want);
        c.disc();
        h.stop().unwrap();
        let calls = fault.take_log();
        assert!(
            calls.iter().any(|c| c.kind == CallKind::Pwrite),
            "no write reached the storage"
        );
        for call in &calls {
            let ranged = call.len > 0 && call.kind != CallKind::Mmap;
            let seek = matches!(call.kind, CallKind::SeekData | CallKind::SeekHole);
            if ranged {
                assert!(
                    call.offset >= BASE && call.offset + call.len <= BASE + SIZE,
                    "{call:?} leaves the window [{BASE}, {})",
                    BASE + SIZE
                );
            } else if seek {
                assert!(
                    (BASE..=BASE + SIZE).contains(&call.offset),
                    "{call:?} starts outside the window"
                );
            }
        }
        h.model[BASE as usize..(BASE + SIZE) as usize].copy_from_slice(&want);
        h.check_file();
    }
}

/// Under O_DIRECT (a window on the direct I/O alignment, which serve
/// requires), the in-kernel path too keeps to the window.
#[test]
fn o_direct_keeps_to_the_window() {
    let (base, size) = (DIRECT_BASE as usize, DIRECT_SIZE as usize);
    let mut h = windowed(false, true, false);
    let (mut c, info) = h.open(ReplyMode::Structured);
    assert_eq!(info.size, DIRECT_SIZE);
    let mut want = h.model[base..base + size].to_vec();
    drive(&mut c, &mut want);
    // Many small requests at once: gathered and submitted to the kernel.
    let mut out = Vec::new();
    let mut sent = Vec::new();
    for i in 0..32u64 {
        let off = i * 8 * KIB;
        let d = random(4096, 100 + i);
        sent.push((c.queue_req(&mut out, Command::Write, off, 4096, &d), off, d));
    }
    c.send(&out);
    for _ in 0..sent.len() {
        let r = c.recv();
        assert_eq!(r.error, 0, "{}", r.message);
    }
    for (_, off, d) in sent {
        want[off as usize..off as usize + 4096].copy_from_slice(&d);
    }
    assert!(c.read(0, DIRECT_SIZE) == want);
    c.disc();
    h.stop().unwrap();
    h.model[base..base + size].copy_from_slice(&want);
    h.check_file();
}

/// Without a size the window runs to the target's end.
#[test]
fn a_window_without_a_size_runs_to_the_end() {
    let mut s = Setup::cfg(|c| {
        c.window = Window {
            offset: BASE,
            size: None,
        };
    });
    s.size = 8 * MIB;
    let h = Harness::start(s);
    let (mut c, info) = h.open(ReplyMode::Structured);
    assert_eq!(info.size, 8 * MIB - BASE);
    let got = c.read(0, info.size);
    assert!(got == h.model[BASE as usize..], "the tail differs");
    c.disc();
}
