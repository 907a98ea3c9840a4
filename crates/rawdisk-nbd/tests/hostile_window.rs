//! A windowed export (`ServerConfig::window`) answered in the export's
//! offsets also when the storage fails: the error a client gets names the
//! export's byte, never the target's.

use rawdisk_nbd::proto::*;
use rawdisk_nbd::server::Window;
use rawdisk_storage::sys::CallKind;

mod common;
use common::harness::*;

/// A window smaller than the reads below it would be inside of them.
const BASE: u64 = 4096;

/// A read that fails in the storage: NBD_REPLY_TYPE_ERROR_OFFSET (and the
/// message) name the export's offset, where the request starts, not the
/// target's, BASE bytes further; libnbd only checks that it lies in the
/// request, so a shifted one goes unnoticed by the client.
#[test]
fn a_failed_read_names_the_exports_offset() {
    let mut s = Setup::cfg(|c| {
        c.window = Window {
            offset: BASE,
            size: Some(MIB),
        };
    });
    s.fault = true;
    let mut h = Harness::start(s);
    let fault = h.fault.clone().unwrap();
    let (mut c, info) = h.open(ReplyMode::Structured);
    assert_eq!(info.size, MIB);
    let (off, len) = (8192u64, 16 * KIB);
    fault.fail_from(CallKind::Pread, 1, libc::EIO);
    fault.fail_from(CallKind::PreadNowait, 1, libc::EIO);
    let r = c.cmd(Command::Read, 0, off, len, &[]);
    fault.clear_rules();
    assert_eq!(r.error, NBD_EIO, "{}", r.message);
    if let Some(at) = r.error_offset {
        assert_eq!(at, off, "error offset in the target's offsets");
    }
    assert!(
        !r.message.contains(&format!("offset {}", BASE + off)),
        "the message names the target's offset: {}",
        r.message
    );
    // The export still reads right afterwards.
    let got = c.read(off, len);
    assert!(got == h.model[(BASE + off) as usize..(BASE + off + len) as usize]);
    c.disc();
    h.stop().unwrap();
    h.check_file();
}

/// The pipes a spliced read fills hold PIPE_BYTES (1 MiB) of page cache
/// each when the piece is aligned to it in the target's offsets, not the
/// export's: a piece that straddles a target page boundary needs one page
/// more than the pipe has, its splice stops short, and the whole read
/// falls back to a copy after a wasted splice and pipe, on every read of
/// a window that does not start on a page.
#[test]
fn spliced_reads_of_an_unaligned_window_fill_their_pipes() {
    const PIPE_BYTES: u64 = MIB;
    let base = MIB + 1536;
    let mut s = Setup::cfg(|c| {
        c.window = Window {
            offset: base,
            size: Some(4 * MIB),
        };
    });
    s.fault = true;
    let mut h = Harness::start(s);
    let fault = h.fault.clone().unwrap();
    let (mut c, _) = h.open(ReplyMode::Structured);
    fault.record();
    for (off, len) in [(0, 2 * MIB), (64 * KIB, MIB), (MIB - 512, 2 * MIB)] {
        let got = c.read(off, len);
        let at = (base + off) as usize;
        assert!(got == h.model[at..at + len as usize], "read {off}+{len}");
    }
    c.disc();
    h.stop().unwrap();
    let splices: Vec<_> = fault
        .take_log()
        .into_iter()
        .filter(|c| c.kind == CallKind::Splice)
        .collect();
    assert!(!splices.is_empty(), "no read was spliced");
    for call in &splices {
        assert!(call.ok, "{call:?} failed: the read fell back to a copy");
        let first = call.offset / PIPE_BYTES;
        let last = (call.offset + call.len - 1) / PIPE_BYTES;
        assert_eq!(
            first, last,
            "{call:?} straddles a pipe's worth of the target"
        );
    }
}
