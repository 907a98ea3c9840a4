//! The count of requests read and not yet answered, per open connection,
//! that SIGUSR1 logs (`Totals::unanswered`): when a client waits on a
//! reply, it tells whether the server still owes one. So every reply must
//! be counted once, whatever path sent it (on the reader, from the pool,
//! spliced, an error, in each reply mode), and NBD_CMD_DISC, which gets no
//! reply, not at all.

use std::time::{Duration, Instant};

use rawdisk_nbd::proto::*;
use rawdisk_storage::sys::CallKind;
use rawdisk_storage::FaultRule;

mod common;
use common::harness::*;

/// The counts of requests owed, connection by connection.
fn owed(h: &Harness) -> Vec<u64> {
    h.server
        .totals()
        .unanswered
        .iter()
        .map(|&(_, n)| n)
        .collect()
}

/// Every kind of request, one at a time and many in flight, leaves
/// nothing owed once each has its reply.
#[test]
fn every_reply_is_counted_once() {
    for mode in [
        ReplyMode::Simple,
        ReplyMode::Structured,
        ReplyMode::Extended,
    ] {
        let mut h = Harness::start(Setup::default());
        let (mut c, info) = h.open(mode);
        let size = info.size;
        assert_eq!(
            owed(&h),
            Vec::<u64>::new(),
            "{mode:?}: owed before any request"
        );
        let data: Vec<u8> = (0..MIB).map(|i| (i * 7 % 251) as u8).collect();
        c.write(MIB, &data);
        h.model[MIB as usize..2 * MIB as usize].copy_from_slice(&data);
        // A big read (spliced to the socket where it can be) and a small one.
        assert_eq!(c.read(MIB, MIB), data);
        assert_eq!(c.read(0, 4096), h.model[..4096]);
        for (typ, flags, off, len) in [
            (Command::Flush, 0, 0, 0),
            (Command::Trim, 0, 3 * MIB, MIB),
            (Command::WriteZeroes, CMD_FLAG_NO_HOLE, 4 * MIB, 64 * KIB),
            (Command::Cache, 0, 0, MIB),
            // An error reply: past the end.
            (Command::Read, 0, size, 4096),
        ] {
            let r = c.cmd(typ, flags, off, len, &[]);
            assert_eq!(r.error != 0, off == size, "{mode:?} {typ:?}: {}", r.message);
        }
        // The trim may leave the range as it was or zeroed: the model
        // takes what the server reads back, then the zero's range is zero.
        let trimmed = c.read(3 * MIB, MIB);
        h.model[3 * MIB as usize..4 * MIB as usize].copy_from_slice(&trimmed);
        h.model[4 * MIB as usize..4 * MIB as usize + 64 * KIB as usize].fill(0);
        // Sixteen small writes in flight at once: gathered onto the pool.
        let mut b = Vec::new();
        let mut cookies = Vec::new();
        for i in 0..16u64 {
            let off = 5 * MIB + i * 4096;
            let block = vec![i as u8 + 1; 4096];
            cookies.push(c.queue_req(&mut b, Command::Write, off, 4096, &block));
            h.model[off as usize..(off + 4096) as usize].copy_from_slice(&block);
        }
        c.send(&b);
        for _ in &cookies {
            let r = c.recv();
            assert!(cookies.contains(&r.cookie));
            assert_eq!(r.error, 0, "{mode:?}: {}", r.message);
        }
        assert_eq!(
            owed(&h),
            Vec::<u64>::new(),
            "{mode:?}: owed with every reply read"
        );
        let t = h.server.totals();
        assert!(t.to_string().ends_with("; unanswered now: none"), "{t}");
        h.finish(c);
    }
}

/// Writes the storage holds for a while are owed, on their connection
/// only, until their replies are sent; the DISC sent behind them is not
/// (it gets no reply). SIGUSR1's line names the connection.
#[test]
fn requests_held_by_the_storage_are_owed_until_answered() {
    const SLOW: Duration = Duration::from_millis(800);
    let mut h = Harness::start(Setup {
        fault: true,
        ..Default::default()
    });
    let fault = h.fault.clone().unwrap();
    let (mut idle, _) = h.open(ReplyMode::Structured);
    let (mut c, _) = h.open(ReplyMode::Structured);
    assert_eq!(idle.read(0, 4096), h.model[..4096]);
    fault.add(FaultRule::always(CallKind::Pwrite, 0).slowed(SLOW));
    // Two writes and a DISC in one send: the reader reads all three (the
    // writes go to the pool together) while the storage holds the writes.
    let mut b = Vec::new();
    let mut cookies = Vec::new();
    for i in 0..2u64 {
        let off = 6 * MIB + i * 4096;
        let block = vec![0x5a + i as u8; 4096];
        cookies.push(c.queue_req(&mut b, Command::Write, off, 4096, &block));
        h.model[off as usize..(off + 4096) as usize].copy_from_slice(&block);
    }
    c.queue_req(&mut b, Command::Disc, 0, 0, &[]);
    let t0 = Instant::now();
    c.send(&b);
    std::thread::sleep(SLOW / 4);
    let t = h.server.totals();
    assert!(t0.elapsed() < SLOW, "the check came after the writes ended");
    assert_eq!(t.unanswered.len(), 1, "{t}");
    let (id, n) = t.unanswered[0];
    assert_eq!(n, 2, "{t}");
    assert!(
        t.to_string()
            .ends_with(&format!("; unanswered now: 2 on connection {id}")),
        "{t}"
    );
    for _ in 0..2 {
        let r = c.recv();
        assert!(cookies.contains(&r.cookie), "cookie {}", r.cookie);
        assert_eq!(r.error, 0, "{}", r.message);
    }
    assert!(c.closed_by_server(), "no close after NBD_CMD_DISC");
    assert!(t0.elapsed() >= SLOW, "the writes were not held");
    fault.clear_rules();
    assert_eq!(
        owed(&h),
        Vec::<u64>::new(),
        "owed after the replies were read"
    );
    h.finish(idle);
}

/// Shutting down, a connection still waiting on the storage when the grace
/// runs out is cut off: the totals at exit (what `--stats` writes) count it
/// closed, not open, and its requests are no longer listed as owed.
#[test]
fn a_connection_cut_off_by_the_shutdown_grace_is_closed_at_exit() {
    const SLOW: Duration = Duration::from_millis(1500);
    let mut h = Harness::start(Setup {
        fault: true,
        ..Setup::cfg(|c| c.shutdown_grace = Duration::from_millis(200))
    });
    let fault = h.fault.clone().unwrap();
    let (mut c, _) = h.open(ReplyMode::Structured);
    fault.add(FaultRule::always(CallKind::Pwrite, 0).slowed(SLOW));
    // Two writes in one send: both go to the pool, where the storage holds
    // them past the grace.
    let mut b = Vec::new();
    for i in 0..2u64 {
        let off = 2 * MIB + i * 4096;
        let block = vec![0xa0 + i as u8; 4096];
        c.queue_req(&mut b, Command::Write, off, 4096, &block);
        h.model[off as usize..(off + 4096) as usize].copy_from_slice(&block);
    }
    c.send(&b);
    std::thread::sleep(Duration::from_millis(100));
    h.stop().expect("serve() failed");
    let t = h.server.totals();
    assert_eq!((t.negotiated, t.open), (1, 0), "{t}");
    assert_eq!(t.unanswered, vec![], "{t}");
    // The pool finished the writes (the runtime waits for them): the file
    // holds them, and nothing else moved.
    h.check_file();
}
