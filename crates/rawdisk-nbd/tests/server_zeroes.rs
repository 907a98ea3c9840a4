//! WRITE_ZEROES queued on one connection (`server/transmission.rs`, the
//! zero line; `server/command.rs`, `execute_zeros`): zeros that continue
//! each other run as one storage call, and each still gets its own reply,
//! its own error and its changed-block marks. Each test checks through the
//! storage calls it saw that a merged call happened, and compares every
//! byte of the file with a model.

use std::collections::HashMap;
use std::sync::Arc;

use rawdisk_nbd::proto::*;
use rawdisk_storage::cbt::StateFile;
use rawdisk_storage::fault::Call;
use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{FaultRule, FaultSys};

mod common;
use common::harness::*;

/// One WRITE_ZEROES: flags, offset, length.
type Zero = (u16, u64, u64);

const NO_HOLE: u16 = CMD_FLAG_NO_HOLE;

/// `n` zeros of `len` bytes with `flags`, each starting where the one
/// before ends, from `start`.
fn run(flags: u16, start: u64, len: u64, n: u64) -> impl Iterator<Item = Zero> {
    (0..n).map(move |i| (flags, start + i * len, len))
}

/// Storage calls that change bytes.
fn writes(kind: CallKind) -> bool {
    matches!(
        kind,
        CallKind::Fallocate(_) | CallKind::Pwrite | CallKind::PwriteDsync | CallKind::BlkZeroout
    )
}

/// Whether a call that changes bytes covered [start, end) and more: the
/// request and at least a byte of a neighbour.
fn covered_beyond(log: &[Call], start: u64, end: u64) -> Option<Call> {
    log.iter()
        .find(|c| {
            writes(c.kind)
                && c.offset < end
                && start < c.offset + c.len
                && (c.offset < start || c.offset + c.len > end)
        })
        .copied()
}

/// Whether one storage call covered the boundary between two zeros that
/// continue each other.
fn merged(log: &[Call], zs: &[Zero]) -> bool {
    zs.windows(2).any(|w| {
        let b = w[0].1 + w[0].2;
        b == w[1].1
            && log
                .iter()
                .any(|c| writes(c.kind) && c.offset < b && b < c.offset + c.len)
    })
}

/// The server over a file of random bytes, its storage calls through a
/// FaultSys; with changed-block tracking and checkpoint "a" when `track`.
fn start(track: bool) -> (Harness, Arc<FaultSys>) {
    let h = Harness::start(Setup {
        fault: true,
        track: track.then(|| vec!["a"]),
        ..Default::default()
    });
    let fault = h.fault.clone().unwrap();
    (h, fault)
}

/// Sends every zero in one write (so the server holds several at once)
/// and returns the replies in the order of `zs`.
fn send_all(c: &mut Conn, zs: &[Zero]) -> Vec<Reply> {
    let mut out = Vec::new();
    for (i, &(flags, off, len)) in zs.iter().enumerate() {
        c.encode_req(
            &mut out,
            i as u64 + 1,
            Command::WriteZeroes,
            flags,
            off,
            len,
            &[],
        );
    }
    c.send(&out);
    let mut got: HashMap<u64, Reply> = (0..zs.len())
        .map(|_| c.recv())
        .map(|r| (r.cookie, r))
        .collect();
    (1..=zs.len() as u64)
        .map(|i| got.remove(&i).unwrap())
        .collect()
}

/// Runs that continue each other with each kind of flags (NO_HOLE, may
/// trim, FUA, unaligned ends), gaps between runs, and a run whose flags
/// alternate (never merged).
fn mixed() -> Vec<Zero> {
    let mut v: Vec<Zero> = run(NO_HOLE, MIB, 192 * KIB, 12).collect();
    v.extend(run(0, 4 * MIB, 128 * KIB, 8));
    v.extend(run(NO_HOLE, 6 * MIB + 1000, 5000, 6));
    v.extend(run(NO_HOLE | CMD_FLAG_FUA, 7 * MIB, 64 * KIB, 4));
    v.extend((0..6).map(|i| {
        (
            if i % 2 == 0 { NO_HOLE } else { 0 },
            7 * MIB + 512 * KIB + i * 8192,
            8192,
        )
    }));
    v
}

#[test]
fn queued_zeros_are_merged_and_byte_exact() {
    for mode in [ReplyMode::Simple, ReplyMode::Extended] {
        let (mut h, fault) = start(false);
        fault.record();
        let (mut c, _) = h.open(mode);
        let zs = mixed();
        for (r, z) in send_all(&mut c, &zs).iter().zip(&zs) {
            assert_eq!(r.error, 0, "{z:?}: {}", r.message);
        }
        for &(_, off, len) in &zs {
            h.model[off as usize..(off + len) as usize].fill(0);
        }
        check_reads(&mut c, &h.model);
        assert!(
            merged(&fault.take_log(), &zs),
            "{mode:?}: no storage call covered two zeros"
        );
        c.disc();
        h.stop().unwrap();
        h.check_file();
    }
}

/// A bad spot inside one request of a merged run fails the merged call;
/// each request then runs on its own: that one is answered EIO, its
/// neighbours succeed and read as zeros, and nothing outside changes.
#[test]
fn an_error_inside_merged_zeros_fails_only_its_request() {
    for flags in [NO_HOLE, 0] {
        let (mut h, fault) = start(false);
        let zs: Vec<Zero> = run(flags, MIB, 192 * KIB, 12).collect();
        let (_, bad_off, bad_len) = zs[5];
        let spot = bad_off + 64 * KIB;
        for kind in WRITING {
            fault.add(FaultRule::over(kind, spot, 4096, libc::EIO));
        }
        fault.record();
        let (mut c, _) = h.open(ReplyMode::Structured);
        let replies = send_all(&mut c, &zs);
        let log = fault.take_log();
        for (i, (r, z)) in replies.iter().zip(&zs).enumerate() {
            let want = if i == 5 { NBD_EIO } else { 0 };
            assert_eq!(
                r.error, want,
                "flags {flags:#x}, zero {i} {z:?}: {}",
                r.message
            );
        }
        let failed: Vec<_> = log.iter().filter(|c| !c.ok).copied().collect();
        let wide = covered_beyond(&failed, bad_off, bad_off + bad_len);
        assert!(
            wide.is_some(),
            "flags {flags:#x}: no merged call over the bad spot failed: {failed:?}"
        );
        fault.clear_rules();
        // The failed request's bytes are each either as before or zero.
        let (s, e) = (bad_off as usize, (bad_off + bad_len) as usize);
        let got = c.read(bad_off, bad_len);
        let odd = (s..e).find(|&i| got[i - s] != 0 && got[i - s] != h.model[i]);
        assert_eq!(
            odd, None,
            "flags {flags:#x}: the failed zero wrote something else"
        );
        h.model[s..e].copy_from_slice(&got);
        for (i, &(_, off, len)) in zs.iter().enumerate() {
            if i != 5 {
                h.model[off as usize..(off + len) as usize].fill(0);
            }
        }
        h.finish(c);
    }
}

/// Merged zeros mark every range they cover in the checkpoint, FUA ones
/// persisted, and nothing between them.
#[test]
fn merged_zeros_mark_each_range() {
    const GRAIN: u64 = 64 * KIB;
    let (mut h, fault) = start(true);
    fault.record();
    let (mut c, _) = h.open(ReplyMode::Structured);
    let mut zs: Vec<Zero> = run(NO_HOLE, MIB, 128 * KIB, 8).collect();
    zs.extend(run(0, 3 * MIB, GRAIN, 4));
    zs.extend(run(NO_HOLE | CMD_FLAG_FUA, 5 * MIB, GRAIN, 4));
    zs.push((NO_HOLE, 7 * MIB, GRAIN));
    for (r, z) in send_all(&mut c, &zs).iter().zip(&zs) {
        assert_eq!(r.error, 0, "{z:?}: {}", r.message);
    }
    assert!(
        merged(&fault.take_log(), &zs),
        "no storage call covered two zeros"
    );
    for &(_, off, len) in &zs {
        h.model[off as usize..(off + len) as usize].fill(0);
    }
    assert_eq!(c.cmd(Command::Flush, 0, 0, 0, &[]).error, 0);
    h.finish(c);
    let st = StateFile::open(&h.path, None, false).unwrap();
    assert_eq!(
        st.changed_ranges("a").unwrap(),
        [
            (MIB, MIB),
            (3 * MIB, 4 * GRAIN),
            (5 * MIB, 4 * GRAIN),
            (7 * MIB, GRAIN)
        ]
    );
}
