//! The server in-process, driven with raw bytes through the codec
//! (`common::harness`): bounds errors, refused and failing requests, hostile
//! clients, the connection limit and shutdown. Every test that writes
//! compares the whole file with a model afterwards.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use rawdisk_nbd::proto::*;

mod common;
use common::harness::*;
use rawdisk_storage::sys::CallKind;

#[test]
fn bounds_and_bad_requests_keep_the_connection() {
    for mode in [
        ReplyMode::Simple,
        ReplyMode::Structured,
        ReplyMode::Extended,
    ] {
        let mut h = Harness::start(Setup::default());
        let (mut c, g) = h.open(mode);
        let size = g.size;
        let cases: Vec<(Command, u16, u64, u64, Vec<u8>, u32)> = vec![
            (Command::Read, 0, size, 1, vec![], NBD_EINVAL),
            (Command::Read, 0, size - 10, 11, vec![], NBD_EINVAL),
            (Command::Read, 0, u64::MAX - 10, 100, vec![], NBD_EINVAL),
            (Command::Write, 0, size - 10, 20, vec![7; 20], NBD_ENOSPC),
            (Command::Write, 0, u64::MAX, 20, vec![7; 20], NBD_ENOSPC),
            (Command::WriteZeroes, 0, size - 10, 20, vec![], NBD_ENOSPC),
            (Command::Trim, 0, size, 4096, vec![], NBD_EINVAL),
            (Command::Cache, 0, u64::MAX, 2, vec![], NBD_EINVAL),
            (Command::BlockStatus, 0, size, 4096, vec![], NBD_EINVAL),
            (Command::Unknown(99), 0, 0, 0, vec![], NBD_EINVAL),
            (Command::Read, 1 << 7, 0, 512, vec![], NBD_EINVAL),
            (
                Command::Read,
                CMD_FLAG_FAST_ZERO,
                0,
                512,
                vec![],
                NBD_EINVAL,
            ),
            (
                Command::Write,
                CMD_FLAG_NO_HOLE,
                0,
                4,
                vec![9; 4],
                NBD_EINVAL,
            ),
            (Command::Read, 0, 0, 33 << 20, vec![], NBD_EINVAL),
        ];
        for (typ, flags, off, len, payload, want) in cases {
            let r = c.cmd(typ, flags, off, len, &payload);
            assert_eq!(
                r.error,
                want,
                "{:?}: {} flags {flags:#x} at {off}+{len}",
                mode,
                typ.name()
            );
            // Still in sync: a read right after works.
            assert_eq!(c.read(10, 10), h.model[10..20]);
        }
        if mode == ReplyMode::Simple {
            // DF without structured replies is not allowed.
            assert_eq!(
                c.cmd(Command::Read, CMD_FLAG_DF, 0, 512, &[]).error,
                NBD_EINVAL
            );
        }
        c.disc();
        h.stop().unwrap();
        h.check_file();
    }
}

#[test]
fn read_only_export_refuses_writes() {
    let mut h = Harness::start(Setup::cfg(|c| {
        c.read_only = true;
    }));
    let (mut c, g) = h.open(ReplyMode::Structured);
    assert!(g.flags & FLAG_READ_ONLY != 0);
    assert_eq!(
        g.flags & (FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_FAST_ZERO),
        0
    );
    assert_eq!(c.cmd(Command::Write, 0, 0, 16, &[1; 16]).error, NBD_EPERM);
    assert_eq!(
        c.cmd(Command::WriteZeroes, 0, 0, 4096, &[]).error,
        NBD_EPERM
    );
    assert_eq!(c.cmd(Command::Trim, 0, 0, 4096, &[]).error, NBD_EPERM);
    assert_eq!(c.cmd(Command::Flush, 0, 0, 0, &[]).error, 0);
    assert_eq!(c.read(0, 4096), h.model[..4096]);
    c.disc();
    h.stop().unwrap();
    h.check_file();
}

#[test]
fn storage_errors_are_mapped_and_the_connection_survives() {
    let mut h = Harness::start(Setup {
        fault: true,
        ..Default::default()
    });
    let fault = h.fault.clone().unwrap();
    for mode in [ReplyMode::Simple, ReplyMode::Structured] {
        let (mut c, _) = h.open(mode);
        fault.fail_from(CallKind::Pread, 1, libc::EIO);
        let r = c.cmd(Command::Read, 0, 4096, 4096, &[]);
        assert_eq!(r.error, NBD_EIO);
        assert!(r.data.is_empty() || mode != ReplyMode::Simple);
        fault.clear_rules();
        for (errno, want) in [
            (libc::ENOSPC, NBD_ENOSPC),
            (libc::EDQUOT, NBD_ENOSPC),
            (libc::EFBIG, NBD_ENOSPC),
            (libc::EROFS, NBD_EPERM),
            (libc::ENXIO, NBD_EIO),
        ] {
            fault.fail_from(CallKind::Pwrite, 1, errno);
            fault.fail_from(CallKind::PwriteDsync, 1, errno);
            let r = c.cmd(Command::Write, 0, 0, 512, &[5; 512]);
            assert_eq!(r.error, want, "errno {errno}");
            fault.clear_rules();
        }
        fault.fail_from(CallKind::Fdatasync, 1, libc::EIO);
        fault.fail_from(CallKind::Fsync, 1, libc::EIO);
        assert_eq!(c.cmd(Command::Flush, 0, 0, 0, &[]).error, NBD_EIO);
        fault.clear_rules();
        // The flush-failure rule: failed for good, on every connection.
        assert_eq!(c.cmd(Command::Flush, 0, 0, 0, &[]).error, NBD_EIO);
        assert_eq!(c.read(0, 4096), h.model[..4096]);
        c.disc();
    }
    // The final flush fails too.
    let e = h.stop().unwrap_err();
    assert!(e.to_string().contains("final flush"), "{e}");
    h.check_file();
}

// ---------------------------------------------------------------------------
// Hostile clients
// ---------------------------------------------------------------------------

#[test]
fn hostile_clients_get_errors_or_a_clean_close() {
    let mut h = Harness::start(Setup::cfg(|c| {
        c.handshake_timeout = Duration::from_millis(500);
        c.max_options = 32;
    }));
    // One well-behaved client in transmission throughout.
    let (mut good, _) = h.open(ReplyMode::Structured);
    let mut check_good = |h: &Harness, what: &str| {
        let d = good.read(0, 64 * KIB);
        assert!(
            d == h.model[..64 * KIB as usize],
            "good client broken after {what}"
        );
    };

    // Garbage instead of an option.
    let mut c = h.conn();
    c.start();
    c.send(b"GARBAGE!GARBAGE!GARBAGE!");
    assert!(c.closed_by_server(), "garbage option magic");
    check_good(&h, "garbage magic");

    // Unknown client flags.
    let mut c = h.conn();
    c.greeting();
    c.client_flags(0x80);
    assert!(c.closed_by_server(), "unknown client flags");

    // Truncated handshake: half the client flags, then gone.
    let mut c = h.conn();
    c.greeting();
    c.send(&[0, 0]);
    drop(c);
    check_good(&h, "truncated handshake");

    // An option declaring 1 GiB of data: refused before any allocation.
    let mut c = h.conn();
    c.start();
    let mut b = Vec::new();
    OptionHeader {
        option: OPT_GO,
        len: 1 << 30,
    }
    .encode(&mut b);
    c.send(&b);
    let (opt, r) = c.opt_reply().unwrap();
    assert_eq!(opt, OPT_GO);
    assert!(is_error(&r, REP_ERR_TOO_BIG), "{r:?}");
    assert!(c.closed_by_server());
    check_good(&h, "huge option");

    // Too many options: each answered, then the server hangs up.
    let mut c = h.conn();
    c.start();
    let mut answered = 0;
    for _ in 0..40 {
        let mut b = Vec::new();
        ClientOption::Unknown {
            option: 0x4242,
            data: vec![],
        }
        .encode(&mut b);
        // The server may already have hung up.
        if c.s.write_all(&b).is_err() {
            break;
        }
        match c.opt_reply() {
            Ok((_, r)) => {
                assert!(is_error(&r, REP_ERR_UNSUP));
                answered += 1;
            }
            Err(_) => break,
        }
    }
    assert_eq!(answered, 32);
    check_good(&h, "option flood");

    // A client that never finishes the handshake is timed out.
    let mut c = h.conn();
    c.greeting();
    let t0 = Instant::now();
    assert!(c.closed_by_server(), "stalled handshake");
    assert!(t0.elapsed() < Duration::from_secs(3));

    // Transmission: garbage request magic.
    let (mut c, _) = h.open(ReplyMode::Simple);
    c.send(&[0xab; 28]);
    assert!(c.closed_by_server(), "garbage request");
    check_good(&h, "garbage request");

    // Compact header on an extended connection.
    let (mut c, _) = h.open(ReplyMode::Extended);
    let mut b = raw_request(Command::Read, 1, 512, false);
    b.extend_from_slice(&[0; 4]);
    c.send(&b);
    assert!(
        c.closed_by_server(),
        "compact header on extended connection"
    );

    // A write larger than the maximum payload, and too large to be read and
    // dropped: answered with an error and closed; its payload is never
    // parsed as requests.
    let (mut c, _) = h.open(ReplyMode::Simple);
    let len = 64 * MIB + 4096;
    let mut evil = Vec::new();
    for i in 0..(4 * MIB / 28) {
        // Payload that looks like valid write requests to offset 0.
        evil.extend(raw_request(Command::Write, 1_000_000 + i, 0, false));
    }
    c.send_req_cookie(77, Command::Write, 0, 0, len, &[]);
    let _ = c.s.write_all(&evil);
    let r = c.recv();
    assert_eq!((r.cookie, r.error), (77, NBD_EINVAL));
    assert!(c.closed_by_server(), "oversized write");
    check_good(&h, "oversized write");

    // Vanishing mid-payload: the partial write must not land.
    let (mut c, _) = h.open(ReplyMode::Simple);
    let mut b = raw_request(Command::Write, 5, MIB, false);
    b.extend_from_slice(&[0x55; 1000]);
    c.send(&b);
    drop(c);
    check_good(&h, "vanishing mid-payload");

    // Vanishing with requests in flight.
    let (mut c, _) = h.open(ReplyMode::Structured);
    for i in 0..32 {
        c.send_req(Command::Read, 0, i * 64 * KIB, 64 * KIB, &[]);
    }
    drop(c);
    check_good(&h, "vanishing with reads in flight");

    // Unknown command with an extended payload: consumed, refused.
    let (mut c, _) = h.open(ReplyMode::Extended);
    let r = c.cmd(Command::Unknown(0x55), 0, 0, 100, &[0x25; 100]);
    assert_eq!(r.error, NBD_EINVAL);
    assert_eq!(c.read(0, 4096), h.model[..4096]);
    c.disc();

    good.disc();
    h.stop().unwrap();
    h.check_file();
}

#[test]
fn connection_limit() {
    let h = Harness::start(Setup::cfg(|c| {
        c.max_connections = 2;
    }));
    let (mut a, _) = h.open(ReplyMode::Structured);
    let mut b = h.conn();
    b.greeting();
    // The third is refused: each option gets NBD_REP_ERR_POLICY with the
    // reason, until the client aborts.
    let mut c = h.conn();
    c.start();
    let r = c.opt(&ClientOption::StructuredReply);
    assert!(is_error(&r[0], REP_ERR_POLICY), "{r:?}");
    let r = c.opt(&ClientOption::Go(InfoRequest {
        name: String::new(),
        info: vec![],
    }));
    match &r[..] {
        [OptionReply::Error { reply, message }] => {
            assert_eq!(*reply, REP_ERR_POLICY);
            assert!(message.contains("too many connections"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.opt(&ClientOption::Abort), [OptionReply::Ack]);
    assert!(c.closed_by_server());
    // One that says nothing is closed after a second.
    let mut c = h.conn();
    let t0 = Instant::now();
    assert!(c.closed_by_server());
    assert!(t0.elapsed() < Duration::from_secs(3));
    drop(b);
    // A slot frees up once a connection ends.
    let t0 = Instant::now();
    loop {
        let mut d = h.conn();
        let mut g = [0u8; GREETING_LEN];
        if d.s.read_exact(&mut g).is_ok() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "slot never freed");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(a.read(0, 512), h.model[..512]);
    a.disc();
}

#[test]
fn flush_covers_all_connections_and_shutdown_finishes_in_flight() {
    let mut h = Harness::start(Setup::default());
    let (mut a, _) = h.open(ReplyMode::Structured);
    let (mut b, _) = h.open(ReplyMode::Extended);
    let d = random(MIB as usize, 9);
    a.write(2 * MIB, &d);
    h.model[2 * MIB as usize..3 * MIB as usize].copy_from_slice(&d);
    assert_eq!(b.cmd(Command::Flush, 0, 0, 0, &[]).error, 0);
    assert!(b.read(2 * MIB, MIB) == d);

    // Requests in flight when shutdown starts are finished and answered.
    let mut sent = HashMap::new();
    for i in 0..16u64 {
        let d = random(64 * KIB as usize, 50 + i);
        let off = 4 * MIB + i * 64 * KIB;
        let cookie = a.send_req(Command::Write, 0, off, d.len() as u64, &d);
        sent.insert(cookie, (off, d));
    }
    // Let the server read them off the socket before asking it to stop.
    std::thread::sleep(Duration::from_millis(300));
    h.server.request_stop();
    for _ in 0..16 {
        let r = a.recv();
        assert_eq!(r.error, 0);
        let (off, d) = sent.remove(&r.cookie).unwrap();
        h.model[off as usize..off as usize + d.len()].copy_from_slice(&d);
    }
    assert!(a.closed_by_server());
    assert!(b.closed_by_server());
    h.server.stop().unwrap();
    h.check_file();
}

#[test]
fn shutdown_answers_the_handshake_err_shutdown_and_closes_idle_ones() {
    let mut h = Harness::start(Setup::default());
    // Mid-haggling, idle after the client flags, idle before them, and one
    // that will abort.
    let mut busy = h.conn();
    busy.start();
    assert_eq!(busy.opt(&ClientOption::StructuredReply), [OptionReply::Ack]);
    let mut idle = h.conn();
    idle.start();
    let mut mute = h.conn();
    mute.greeting();
    let mut quits = h.conn();
    quits.start();
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    h.server.request_stop();
    std::thread::sleep(Duration::from_millis(200));
    let r = busy.opt(&ClientOption::Go(InfoRequest {
        name: String::new(),
        info: vec![],
    }));
    match &r[..] {
        [OptionReply::Error { reply, message }] => {
            assert_eq!(*reply, REP_ERR_SHUTDOWN, "{message}");
            assert!(message.contains("shutting down"), "{message}");
        }
        other => panic!("GO while shutting down: {other:?}"),
    }
    assert!(busy.closed_by_server());
    // Spec: NBD_OPT_ABORT is still acknowledged.
    assert_eq!(quits.opt(&ClientOption::Abort), [OptionReply::Ack]);
    assert!(quits.closed_by_server());
    assert!(idle.closed_by_server());
    assert!(mute.closed_by_server());
    h.server.stop().unwrap();
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "idle handshakes held up shutdown for {took:?}"
    );
    h.check_file();
}
