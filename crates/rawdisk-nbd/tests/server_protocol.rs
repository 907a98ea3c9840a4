//! The server in-process on a Unix socket over a temp file, driven with raw
//! bytes through the codec (`common::harness`): every handshake path, every
//! command in each reply mode, block status and changed-block contexts.
//! Every test that writes compares the whole file with a model afterwards,
//! bytes it did not touch included.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use rawdisk_nbd::proto::*;
use rawdisk_nbd::server::{Server, ServerConfig};

mod common;
use common::harness::*;
use rawdisk_storage::cbt::{StateFile, TrackOptions};
use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{OpenOptions, Target};

// ---------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------

#[test]
fn handshake_options_and_errors() {
    let h = Harness::start(Setup::default());
    let mut c = h.conn();
    c.start();

    let r = c.opt(&ClientOption::List);
    assert_eq!(
        r,
        [
            OptionReply::Server {
                name: String::new(),
                description: String::new()
            },
            OptionReply::Ack
        ]
    );
    // Unknown option: ERR_UNSUP and the handshake goes on.
    let r = c.opt(&ClientOption::Unknown {
        option: 0x7777,
        data: vec![1, 2, 3],
    });
    assert!(is_error(&r[0], REP_ERR_UNSUP), "{r:?}");
    let r = c.opt(&ClientOption::StartTls);
    assert!(matches!(&r[0], OptionReply::Error { reply, .. } if reply & REP_FLAG_ERROR != 0));
    // LIST with data is invalid.
    let r = c.opt(&ClientOption::Unknown {
        option: OPT_LIST,
        data: vec![0],
    });
    assert!(is_error(&r[0], REP_ERR_INVALID), "{r:?}");
    // Meta contexts need structured replies first.
    let r = c.opt(&ClientOption::SetMetaContext(MetaContextRequest {
        name: String::new(),
        queries: vec![META_CONTEXT_BASE_ALLOCATION.into()],
    }));
    assert!(is_error(&r[0], REP_ERR_INVALID), "{r:?}");
    // Unknown export.
    let r = c.opt(&ClientOption::Info(InfoRequest {
        name: "nope".into(),
        info: vec![],
    }));
    assert!(is_error(&r[0], REP_ERR_UNKNOWN), "{r:?}");
    // A malformed GO gets ERR_INVALID, not a disconnect.
    let r = c.opt(&ClientOption::Unknown {
        option: OPT_GO,
        data: vec![0, 0, 0, 9],
    });
    assert!(is_error(&r[0], REP_ERR_INVALID), "{r:?}");

    assert_eq!(c.opt(&ClientOption::StructuredReply), [OptionReply::Ack]);
    let r = c.opt(&ClientOption::StructuredReply);
    assert!(is_error(&r[0], REP_ERR_INVALID), "{r:?}");
    assert_eq!(c.opt(&ClientOption::ExtendedHeaders), [OptionReply::Ack]);
    let r = c.opt(&ClientOption::StructuredReply);
    assert!(is_error(&r[0], REP_ERR_EXT_HEADER_REQD), "{r:?}");

    // LIST_META_CONTEXT: all, "base:" wildcard, unknown namespace.
    for (queries, found) in [
        (vec![], true),
        (vec!["base:".to_string()], true),
        (vec!["qemu:dirty-bitmap:x".to_string()], false),
    ] {
        let r = c.opt(&ClientOption::ListMetaContext(MetaContextRequest {
            name: String::new(),
            queries,
        }));
        let n = r
            .iter()
            .filter(|x| matches!(x, OptionReply::MetaContext { name, .. } if name == META_CONTEXT_BASE_ALLOCATION))
            .count();
        assert_eq!(n, found as usize, "{r:?}");
        assert_eq!(r.last(), Some(&OptionReply::Ack));
    }
    // SET with only "base:" selects nothing.
    let r = c.opt(&ClientOption::SetMetaContext(MetaContextRequest {
        name: String::new(),
        queries: vec!["base:".into()],
    }));
    assert_eq!(r, [OptionReply::Ack]);
    let r = c.opt(&ClientOption::SetMetaContext(MetaContextRequest {
        name: String::new(),
        queries: vec![META_CONTEXT_BASE_ALLOCATION.into()],
    }));
    let id = match &r[0] {
        OptionReply::MetaContext { id, .. } => *id,
        x => panic!("{x:?}"),
    };

    let r = c.opt(&ClientOption::Info(InfoRequest {
        name: String::new(),
        info: vec![INFO_NAME, INFO_BLOCK_SIZE, INFO_DESCRIPTION, 999],
    }));
    let g = go_info(&r);
    assert!(r.contains(&OptionReply::Info(Info::Name(String::new()))));
    assert_eq!(g.size, 8 * MIB);
    assert_eq!((g.min, g.pref, g.max), (1, 4096, 32 << 20));
    for f in [
        FLAG_HAS_FLAGS,
        FLAG_SEND_FLUSH,
        FLAG_SEND_FUA,
        FLAG_SEND_WRITE_ZEROES,
        FLAG_SEND_DF,
        FLAG_CAN_MULTI_CONN,
        FLAG_SEND_CACHE,
    ] {
        assert!(g.flags & f != 0, "flag {f:#x} missing from {:#x}", g.flags);
    }
    assert_eq!(g.flags & FLAG_READ_ONLY, 0);
    let r = c.opt(&ClientOption::Go(InfoRequest {
        name: String::new(),
        info: vec![INFO_BLOCK_SIZE],
    }));
    // Spec: GO after INFO with nothing in between gives the same flags.
    assert_eq!(go_info(&r).flags, g.flags);
    c.mode = ReplyMode::Extended;
    let r = c.cmd(Command::BlockStatus, 0, 0, 4096, &[]);
    assert_eq!(r.error, 0);
    assert_eq!(r.context_id, Some(id));
    assert_eq!(c.read(100, 50), h.model[100..150]);
    c.disc();

    // ABORT: ACK, then the server closes.
    let mut c = h.conn();
    c.start();
    assert_eq!(c.opt(&ClientOption::Abort), [OptionReply::Ack]);
    assert!(c.closed_by_server());
}

#[test]
fn export_name_with_and_without_zeroes() {
    let h = Harness::start(Setup::cfg(|c| {
        c.export_name = "disk".into();
        c.description = "a test disk".into();
    }));
    for no_zeroes in [false, true] {
        let mut c = h.conn();
        c.greeting();
        c.client_flags(FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 });
        c.send_opt(&ClientOption::ExportName("disk".into()));
        let n = 10 + if no_zeroes { 0 } else { EXPORT_NAME_PADDING };
        let b = c.read_n(n).unwrap();
        let ((size, flags), used) = decode_export_name_reply(&b, no_zeroes).unwrap();
        assert_eq!(used, n);
        assert_eq!(size, h.model.len() as u64);
        assert!(flags & FLAG_HAS_FLAGS != 0);
        assert_eq!(flags & FLAG_SEND_DF, 0, "DF without structured replies");
        if !no_zeroes {
            assert!(b[10..].iter().all(|&x| x == 0));
        }
        assert_eq!(c.read(4096, 4096), h.model[4096..8192]);
        c.disc();
    }
    // Named export: LIST shows it with its description, GO "" is unknown.
    let mut c = h.conn();
    c.start();
    assert_eq!(
        c.opt(&ClientOption::List)[0],
        OptionReply::Server {
            name: "disk".into(),
            description: "a test disk".into()
        }
    );
    let r = c.opt(&ClientOption::Go(InfoRequest::default()));
    assert!(is_error(&r[0], REP_ERR_UNKNOWN));
    let r = c.opt(&ClientOption::Go(InfoRequest {
        name: "disk".into(),
        info: vec![INFO_DESCRIPTION],
    }));
    assert!(r.contains(&OptionReply::Info(Info::Description("a test disk".into()))));
    c.disc();
    // EXPORT_NAME of an unknown export: no way to say so but hang up.
    let mut c = h.conn();
    c.start();
    c.send_opt(&ClientOption::ExportName("other".into()));
    assert!(c.closed_by_server());
}

// ---------------------------------------------------------------------------
// Commands
// ---------------------------------------------------------------------------

/// Every command in one mode, checked against the model.
fn all_commands(mode: ReplyMode) {
    let mut h = Harness::start(Setup::default());
    let (mut c, g) = h.open(mode);
    assert_eq!(g.size, h.model.len() as u64);

    // Unaligned and aligned writes, with and without FUA.
    for (i, (off, len, fua)) in [
        (0u64, 4096usize, false),
        (12345, 777, true),
        (MIB - 100, 300, false),
        (3 * MIB, 1 << 20, true),
        (8 * MIB - 512, 512, false),
    ]
    .into_iter()
    .enumerate()
    {
        let d = random(len, i as u64 + 100);
        let r = c.cmd(
            Command::Write,
            if fua { CMD_FLAG_FUA } else { 0 },
            off,
            len as u64,
            &d,
        );
        assert_eq!(r.error, 0, "{}", r.message);
        h.model[off as usize..off as usize + len].copy_from_slice(&d);
    }
    for (off, len) in [
        (0u64, 8 * MIB),
        (12000, 2000),
        (MIB - 100, 300),
        (8 * MIB - 1, 1),
    ] {
        assert!(c.read(off, len) == h.model[off as usize..(off + len) as usize]);
    }
    // Zeroes: may punch, must not punch, FUA.
    for (off, len, flags) in [
        (64 * KIB, 64 * KIB, 0),
        (200 * KIB + 3, 10_000, CMD_FLAG_NO_HOLE),
        (5 * MIB, 2 * MIB, CMD_FLAG_FUA),
    ] {
        let r = c.cmd(Command::WriteZeroes, flags, off, len, &[]);
        assert_eq!(r.error, 0, "{}", r.message);
        h.model[off as usize..(off + len) as usize].fill(0);
        assert!(c.read(off, len).iter().all(|&b| b == 0));
    }
    // Trim: contents undefined afterwards, so write over it again.
    let r = c.cmd(Command::Trim, 0, 6 * MIB, MIB, &[]);
    assert_eq!(r.error, 0, "{}", r.message);
    let d = random(MIB as usize, 7);
    c.write(6 * MIB, &d);
    h.model[6 * MIB as usize..7 * MIB as usize].copy_from_slice(&d);
    for typ in [Command::Flush, Command::Cache] {
        let len = if typ == Command::Cache { MIB } else { 0 };
        let r = c.cmd(typ, 0, 0, len, &[]);
        assert_eq!(r.error, 0, "{}: {}", typ.name(), r.message);
        if mode != ReplyMode::Extended {
            assert!(r.simple, "payload-less success may be a simple reply");
        }
    }
    // Zero-length requests are harmless.
    for typ in [
        Command::Read,
        Command::Write,
        Command::WriteZeroes,
        Command::Trim,
        Command::Cache,
    ] {
        assert_eq!(c.cmd(typ, 0, 100, 0, &[]).error, 0, "{}", typ.name());
    }
    if mode == ReplyMode::Simple {
        // No context negotiated: EINVAL, connection stays usable.
        assert_eq!(
            c.cmd(Command::BlockStatus, 0, 0, 4096, &[]).error,
            NBD_EINVAL
        );
    } else {
        let r = c.cmd(Command::BlockStatus, CMD_FLAG_REQ_ONE, 0, 4096, &[]);
        assert_eq!(r.error, 0);
        assert_eq!(r.descriptors.len(), 1);
        assert!(r.descriptors[0].length <= 4096 && r.descriptors[0].length > 0);
    }
    c.disc();
    h.stop().unwrap();
    h.check_file();
}

#[test]
fn commands_with_simple_replies() {
    all_commands(ReplyMode::Simple);
}

#[test]
fn commands_with_structured_replies() {
    all_commands(ReplyMode::Structured);
}

#[test]
fn commands_with_extended_headers() {
    all_commands(ReplyMode::Extended);
}

/// Data/hole truth from lseek, for comparing block status and hole chunks.
fn seek_truth(path: &Path, off: u64, end: u64) -> Vec<(u64, u64, bool)> {
    use rustix::fs::{seek, SeekFrom};
    let f = std::fs::File::open(path).unwrap();
    let mut v = Vec::new();
    let mut pos = off;
    while pos < end {
        let data = match seek(&f, SeekFrom::Data(pos)) {
            Ok(d) => d.min(end),
            Err(_) => end,
        };
        if data > pos {
            v.push((pos, data - pos, true));
            pos = data;
            continue;
        }
        let hole = seek(&f, SeekFrom::Hole(pos)).unwrap().min(end);
        v.push((pos, hole - pos, false));
        pos = hole;
    }
    v
}

#[test]
fn sparse_reads_df_and_block_status() {
    for mode in [ReplyMode::Structured, ReplyMode::Extended] {
        let mut h = Harness::start(Setup {
            fill: false,
            ..Default::default()
        });
        let (mut c, _) = h.open(mode);
        let d = random(256 * KIB as usize, 1);
        c.write(MIB, &d);
        c.write(4 * MIB + 4096, &d[..4096]);
        h.model[MIB as usize..(MIB + 256 * KIB) as usize].copy_from_slice(&d);
        h.model[(4 * MIB + 4096) as usize..(4 * MIB + 8192) as usize].copy_from_slice(&d[..4096]);
        assert_eq!(c.cmd(Command::Flush, 0, 0, 0, &[]).error, 0);

        // A read over holes and data: hole chunks where the file has holes.
        let r = c.cmd(Command::Read, 0, 0, 2 * MIB, &[]);
        assert_eq!(r.error, 0);
        assert_eq!(r.data, h.model[..2 * MIB as usize]);
        assert!(r.hole_chunks >= 1, "no hole chunks over a sparse range");
        assert!(r.data_chunks >= 1);
        // DF: one data chunk with the zeros spelled out.
        let r = c.cmd(Command::Read, CMD_FLAG_DF, 0, 2 * MIB, &[]);
        assert_eq!((r.data_chunks, r.hole_chunks), (1, 0));
        assert_eq!(r.data, h.model[..2 * MIB as usize]);

        // Block status against SEEK_DATA/SEEK_HOLE.
        let size = h.model.len() as u64;
        let truth = seek_truth(&h.path, 0, size);
        let r = c.cmd(Command::BlockStatus, 0, 0, size, &[]);
        assert_eq!(r.error, 0, "{}", r.message);
        let mut pos = 0;
        for d in &r.descriptors {
            assert!(d.length > 0);
            let hole = d.status & STATE_HOLE as u64 != 0;
            for &(o, l, th) in &truth {
                let (s, e) = (o.max(pos), (o + l).min(pos + d.length));
                if s < e {
                    assert_eq!(
                        hole, th,
                        "descriptor at {pos}+{} vs lseek {o}+{l}",
                        d.length
                    );
                }
            }
            if hole {
                assert!(d.status & STATE_ZERO as u64 != 0);
                assert!(h.model[pos as usize..(pos + d.length) as usize]
                    .iter()
                    .all(|&b| b == 0));
            }
            pos += d.length;
        }
        assert_eq!(pos, size, "descriptors cover the export");
        // REQ_ONE in the middle of the data run.
        let r = c.cmd(
            Command::BlockStatus,
            CMD_FLAG_REQ_ONE,
            MIB + 4096,
            8192,
            &[],
        );
        assert_eq!(r.descriptors.len(), 1);
        assert_eq!(r.descriptors[0].status, 0);
        assert!(r.descriptors[0].length <= 8192);
        c.disc();
        h.stop().unwrap();
        h.check_file();
    }
}

/// BLOCK_STATUS clips to the size of the handshake: no fstat per request
/// (16,387 of them for `nbdinfo --map` of 64 TiB), only the lookups.
#[test]
fn block_status_does_no_fstat_per_request() {
    let mut h = Harness::start(Setup {
        fill: false,
        fault: true,
        ..Default::default()
    });
    let (mut c, info) = h.open(ReplyMode::Structured);
    let d = random(64 * KIB as usize, 7);
    for at in [0, 3 * MIB, 8 * MIB - 64 * KIB] {
        c.write(at, &d);
        h.model[at as usize..(at + 64 * KIB) as usize].copy_from_slice(&d);
    }
    let truth = seek_truth(&h.path, 0, info.size);
    let f = h.fault.clone().unwrap();
    f.reset_counts();
    let step = 256 * KIB;
    for off in (0..info.size).step_by(step as usize) {
        let r = c.cmd(Command::BlockStatus, 0, off, step, &[]);
        assert_eq!(r.error, 0, "{}", r.message);
        let mut pos = off;
        for d in &r.descriptors {
            let hole = d.status & STATE_HOLE as u64 != 0;
            for &(o, l, th) in &truth {
                if o.max(pos) < (o + l).min(pos + d.length) {
                    assert_eq!(hole, th, "descriptor at {pos}+{}", d.length);
                }
            }
            pos += d.length;
        }
        assert_eq!(pos, off + step, "descriptors cover the request");
    }
    let requests = info.size / step;
    assert_eq!(f.calls(CallKind::Fstat), 0, "fstat in {requests} requests");
    assert!(f.calls(CallKind::SeekData) >= requests, "{:?}", f.counts());
    c.disc();
    h.stop().unwrap();
    h.check_file();
}

/// Descriptors as (length, status) pairs.
fn pairs(ds: &[Descriptor]) -> Vec<(u64, u64)> {
    ds.iter().map(|d| (d.length, d.status)).collect()
}

#[test]
fn changed_block_contexts_in_structured_and_extended_replies() {
    const GRAIN: u64 = 64 * KIB;
    for mode in [ReplyMode::Structured, ReplyMode::Extended] {
        let mut h = Harness::start(Setup {
            track: Some(vec!["a", "b"]),
            ..Default::default()
        });
        let mut c = h.conn();
        c.start();
        let opt = match mode {
            ReplyMode::Extended => ClientOption::ExtendedHeaders,
            _ => ClientOption::StructuredReply,
        };
        assert_eq!(c.opt(&opt), [OptionReply::Ack]);
        let queries = ["rawdisk:changed:b", "base:allocation", "rawdisk:changed:a"];
        let r = c.opt(&ClientOption::SetMetaContext(MetaContextRequest {
            name: String::new(),
            queries: queries.iter().map(|q| q.to_string()).collect(),
        }));
        let ctx = |id: u32, name: &str| OptionReply::MetaContext {
            id,
            name: name.into(),
        };
        let want = [
            ctx(1, "base:allocation"),
            ctx(2, "rawdisk:changed:a"),
            ctx(3, "rawdisk:changed:b"),
            OptionReply::Ack,
        ];
        assert_eq!(r, want);
        c.opt(&ClientOption::Go(InfoRequest::default()));
        c.mode = mode;

        let d = random(4096, 9);
        c.write(MIB + 10, &d);
        h.model[(MIB + 10) as usize..(MIB + 10 + 4096) as usize].copy_from_slice(&d);
        let r = c.cmd(Command::BlockStatus, 0, 0, 4 * MIB, &[]);
        assert_eq!(r.error, 0, "{}", r.message);
        let ids: Vec<u32> = r.contexts.iter().map(|(id, _)| *id).collect();
        assert_eq!(
            ids.iter().copied().collect::<HashSet<_>>(),
            [1, 2, 3].into()
        );
        for (id, ds) in &r.contexts {
            let total: u64 = ds.iter().map(|d| d.length).sum();
            assert!(total <= 4 * MIB && total > 0, "context {id}: {ds:?}");
            if *id != 1 {
                let want = [(MIB, 0), (GRAIN, 1), (3 * MIB - GRAIN, 0)];
                assert_eq!(pairs(ds), want, "context {id}");
            }
        }
        // REQ_ONE: one descriptor per context, within the request.
        let r = c.cmd(
            Command::BlockStatus,
            CMD_FLAG_REQ_ONE,
            MIB + GRAIN / 2,
            MIB,
            &[],
        );
        assert_eq!(r.contexts.len(), 3);
        for (id, ds) in &r.contexts {
            assert_eq!(ds.len(), 1, "context {id}");
            assert!(ds[0].length <= MIB);
            if *id != 1 {
                assert_eq!(pairs(ds), [(GRAIN / 2, 1)], "context {id}");
            }
        }
        // A checkpoint deleted by another process while selected: EINVAL
        // naming it.
        StateFile::open(&h.path, None, false)
            .unwrap()
            .delete_checkpoint("b")
            .unwrap();
        let r = c.cmd(Command::BlockStatus, 0, 0, MIB, &[]);
        assert_eq!(r.error, NBD_EINVAL);
        assert!(r.message.contains("\"b\""), "{}", r.message);
        assert!(r.contexts.is_empty());
        c.disc();
        h.stop().unwrap();
        h.check_file();
        let left = StateFile::open(&h.path, None, false)
            .unwrap()
            .list()
            .unwrap();
        assert_eq!(left.len(), 1);
        assert!(left[0].consistent && left[0].name == "a", "{left:?}");
    }
}

/// `Server::open` opens the tracker the configuration asks for, as each
/// `--dir` export gets its own: a write and a zero are in the state file
/// after the flush, and a second tracker of the same target is refused.
#[test]
fn a_single_export_opens_the_tracker_its_config_asks_for() {
    const GRAIN: u64 = 64 * KIB;
    let track = || Some(TrackOptions::default());
    let mut h = Harness::start(Setup {
        track: Some(vec!["a"]),
        ..Setup::cfg(|c| c.track_changes = track())
    });
    let again = Arc::new(Target::open(&h.path, &OpenOptions::default()).unwrap());
    let cfg = ServerConfig {
        track_changes: track(),
        ..Default::default()
    };
    let err = Server::open(again, cfg)
        .err()
        .expect("a second tracker opened");
    assert!(err.to_string().contains("already tracks"), "{err}");
    let (mut c, _) = h.open(ReplyMode::Structured);
    let d = random(4096, 12);
    c.write(MIB + 100, &d);
    h.model[(MIB + 100) as usize..(MIB + 4196) as usize].copy_from_slice(&d);
    assert_eq!(c.cmd(Command::WriteZeroes, 0, 3 * MIB, 8192, &[]).error, 0);
    h.model[(3 * MIB) as usize..(3 * MIB + 8192) as usize].fill(0);
    assert_eq!(c.cmd(Command::Flush, 0, 0, 0, &[]).error, 0);
    c.disc();
    h.stop().unwrap();
    h.check_file();
    let st = StateFile::open(&h.path, None, false).unwrap();
    assert_eq!(
        st.changed_ranges("a").unwrap(),
        [(MIB, GRAIN), (3 * MIB, GRAIN)]
    );
    assert!(st.list().unwrap()[0].consistent);
}

/// A failed sync of the state file may have lost marks: every later FLUSH
/// and FUA write fails (the flush-failure rule), and the state is left
/// not closed cleanly, so the next start reports everything changed.
#[test]
fn a_failed_persist_fails_every_later_flush() {
    let mut h = Harness::start(Setup {
        track: Some(vec!["a"]),
        track_fault: true,
        ..Default::default()
    });
    let fs = h.track_fault.clone().unwrap();
    let (mut c, _) = h.open(ReplyMode::Structured);
    let d = random(4096, 11);
    c.write(MIB, &d);
    h.model[MIB as usize..(MIB + 4096) as usize].copy_from_slice(&d);
    fs.reset_counts();
    fs.fail_once(CallKind::Fdatasync, 1, libc::EIO);
    let r = c.cmd(Command::Flush, 0, 0, 0, &[]);
    assert_eq!(r.error, NBD_EIO);
    assert!(!r.message.is_empty());
    // A FUA write lands but is not acknowledged as durable.
    let r = c.cmd(Command::Write, CMD_FLAG_FUA, 3 * MIB, 4096, &d);
    assert_eq!(r.error, NBD_EIO);
    h.model[(3 * MIB) as usize..(3 * MIB + 4096) as usize].copy_from_slice(&d);
    // The state file's fdatasync would work now; the flush still fails.
    let r = c.cmd(Command::Flush, 0, 0, 0, &[]);
    assert_eq!(r.error, NBD_EIO);
    assert!(r.message.contains("after a failed sync"), "{}", r.message);
    assert_eq!(fs.calls(CallKind::Fdatasync), 1);
    c.disc();
    let e = h.stop().unwrap_err();
    assert!(e.to_string().contains("after a failed sync"), "{e}");
    h.check_file();
    let st = StateFile::open(&h.path, None, false).unwrap();
    let list = st.list().unwrap();
    assert!(!list[0].consistent, "{:?}", list[0].reason);
    assert_eq!(st.changed_ranges("a").unwrap(), [(0, h.model.len() as u64)]);
}

#[test]
fn extended_headers_carry_64_bit_lengths() {
    let size = 6 << 30;
    let h = Harness::start(Setup {
        size,
        fill: false,
        ..Default::default()
    });
    let (mut c, g) = h.open(ReplyMode::Extended);
    assert_eq!(g.size, size);
    // One request over more than 4 GiB, which compact headers cannot say.
    let r = c.cmd(Command::BlockStatus, 0, 0, size, &[]);
    assert_eq!(r.error, 0, "{}", r.message);
    assert!(
        r.descriptors[0].length > u32::MAX as u64,
        "{:?}",
        r.descriptors
    );
    let d = random(4096, 3);
    c.write(5 << 30, &d);
    let r = c.cmd(Command::WriteZeroes, 0, 0, 5 << 30, &[]);
    assert_eq!(r.error, 0, "{}", r.message);
    assert_eq!(c.read(5 << 30, 4096), d);
    assert!(c.read((5 << 30) - 4096, 4096).iter().all(|&b| b == 0));
    // Errors come as extended error chunks.
    let r = c.cmd(Command::Read, 0, size, 1, &[]);
    assert_eq!(r.error, NBD_EINVAL);
    assert!(!r.simple && !r.message.is_empty());
    // A payload on a command that takes none is consumed, then refused.
    let r = c.cmd(Command::Trim, 0, 0, 8, &[1; 8]);
    assert_eq!(r.error, NBD_EINVAL);
    assert_eq!(c.read(5 << 30, 4096), d);
    c.disc();
}
