//! "Written since the last flush" ([`super::Dirty`]), which decides whether
//! the final flush at stop runs: every path that changes the export sets it
//! (a table of them, each on its own export), a hint that writes nothing
//! does not, a flush clears it only for what returned before the flush
//! started (in-kernel and mapped writes that a flush overtakes, and writes
//! racing flushes, checked against the syscalls' own order), and a failed
//! flush never clears it.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Barrier};

use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{CacheMode, DirectOp, FaultSys, OpenOptions, Target, ZeroFlags};

use super::{DetectZeroes, Export, Serving, Window};
use crate::server::writeback::WriteBehind;

const SIZE: u64 = 4 << 20;
const A: u64 = 4096;

/// An export of a 4 MiB file of ones, through `sys` when given.
fn export(dir: &Path, cache: CacheMode, sys: Option<Arc<FaultSys>>) -> Export {
    let path = dir.join("disk.img");
    std::fs::write(&path, vec![1u8; SIZE as usize]).unwrap();
    let opts = OpenOptions {
        cache,
        ..Default::default()
    };
    let target = match sys {
        Some(s) => Target::open_with_sys(&path, &opts, s),
        None => Target::open(&path, &opts),
    };
    Export::new(
        "t".into(),
        Arc::new(target.unwrap()),
        false,
        WriteBehind::Off,
        32 << 20,
        (0, 0),
        None,
    )
}

fn flags(may_trim: bool) -> ZeroFlags {
    ZeroFlags {
        may_trim,
        fast_only: false,
    }
}

/// A write of `data` at `offset` received into the mapped page cache, a
/// flush (another connection's) made while its payload is on its way.
fn mapped_write(e: &Export, path: &Path, offset: u64, data: &[u8]) {
    let len = data.len() as u64;
    // Only cached pages map.
    let f = std::fs::File::open(path).unwrap();
    f.read_exact_at(&mut vec![0; len as usize], offset).unwrap();
    let mut mw = e.map_write(offset, len, 512).expect("a mapped write");
    mw.write_head(&data[..512]).unwrap();
    e.flush().unwrap();
    let (mut tx, rx) = UnixStream::pair().unwrap();
    std::thread::scope(|s| {
        s.spawn(|| tx.write_all(&data[512..]).unwrap());
        while mw.pages().remaining() > 0 {
            match mw.pages().recv(rx.as_fd()) {
                Ok(n) => assert!(n > 0, "socket closed early"),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("mapped write: {e}"),
            }
        }
    });
    mw.finish(true);
}

/// Aligned writes in flight in the kernel, a flush made after they were
/// submitted and before they are reaped.
fn in_kernel_write(e: &Export, offset: u64, data: &[u8]) {
    let mut q = e.direct_queue::<usize>(4).expect("an AIO queue");
    let mut buf = vec![0u8; data.len() + A as usize];
    let start = buf.as_ptr().align_offset(A as usize);
    buf[start..start + data.len()].copy_from_slice(data);
    let op = DirectOp {
        write: true,
        offset,
        buf,
        start,
        len: data.len(),
        tag: 0,
    };
    assert!(e.submit_direct(&mut q, vec![op]).is_empty(), "refused");
    e.flush().unwrap();
    let mut done = Vec::new();
    while q.in_flight() > 0 {
        e.reap_direct(&mut q, &mut done, true).unwrap();
    }
    assert!(done.iter().all(|d| d.done), "the in-kernel write failed");
}

/// Every path that changes the export leaves it to flush at stop; a cache
/// hint (a readahead) does not. Zeroes and trims with FUA flush after their
/// change returned, so they leave it clean, having counted the change.
#[test]
fn every_write_path_leaves_the_export_to_flush() {
    type Op = fn(&Export, &Path);
    let data: Vec<u8> = (0..64 * A).map(|i| (i % 251) as u8).collect();
    let ops: Vec<(&str, CacheMode, Serving, Window, Op, bool)> = vec![
        (
            "write",
            CacheMode::Writeback,
            Serving::default(),
            Window::default(),
            |e, _| e.write(A, &[7; 4096], false).unwrap(),
            true,
        ),
        (
            "write with FUA",
            CacheMode::Writeback,
            Serving::default(),
            Window::default(),
            |e, _| e.write(A, &[7; 4096], true).unwrap(),
            true,
        ),
        (
            "write of zeroes, --detect-zeroes",
            CacheMode::Writeback,
            Serving {
                detect_zeroes: DetectZeroes::Unmap,
                ..Serving::default()
            },
            Window::default(),
            |e, _| e.write(A, &[0; 4096], false).unwrap(),
            true,
        ),
        (
            "zero",
            CacheMode::Writeback,
            Serving::default(),
            Window::default(),
            |e, _| e.zero(A, 8 * A, flags(false), false).unwrap(),
            true,
        ),
        (
            "zero that may trim",
            CacheMode::Writeback,
            Serving::default(),
            Window::default(),
            |e, _| e.zero(A, 8 * A, flags(true), false).unwrap(),
            true,
        ),
        (
            "zero with FUA",
            CacheMode::Writeback,
            Serving::default(),
            Window::default(),
            |e, _| e.zero(A, 8 * A, flags(false), true).unwrap(),
            false,
        ),
        (
            "trim",
            CacheMode::Writeback,
            Serving::default(),
            Window::default(),
            |e, _| e.trim(A, 8 * A, false).unwrap(),
            true,
        ),
        (
            "trim with FUA",
            CacheMode::Writeback,
            Serving::default(),
            Window::default(),
            |e, _| e.trim(A, 8 * A, true).unwrap(),
            false,
        ),
        (
            "write through a window",
            CacheMode::Writeback,
            Serving::default(),
            Window {
                offset: 1 << 20,
                size: Some(1 << 20),
            },
            |e, _| e.write(0, &[7; 4096], false).unwrap(),
            true,
        ),
        (
            "zero through a window",
            CacheMode::Writeback,
            Serving::default(),
            Window {
                offset: 1 << 20,
                size: Some(1 << 20),
            },
            |e, _| e.zero(0, A, flags(true), false).unwrap(),
            true,
        ),
        (
            "write, cache=none",
            CacheMode::None,
            Serving::default(),
            Window::default(),
            |e, _| e.write(A, &[7; 4096], false).unwrap(),
            true,
        ),
        (
            "cache hint",
            CacheMode::Writeback,
            Serving::default(),
            Window::default(),
            |e, _| e.cache(0, SIZE).unwrap(),
            false,
        ),
    ];
    for (what, cache, serving, window, op, dirty) in ops {
        let dir = tempfile::tempdir().unwrap();
        let e = export(dir.path(), cache, None)
            .with_serving(serving)
            .with_window(window);
        assert!(!e.dirty(), "{what}: dirty before anything was written");
        let before = e.dirty.flush_starts();
        op(&e, &dir.path().join("disk.img"));
        assert_eq!(e.dirty(), dirty, "{what}");
        let counted = e.dirty.flush_starts() > before;
        assert_eq!(counted, what != "cache hint", "{what}: counted as a change");
        e.flush().unwrap();
        assert!(!e.dirty(), "{what}: dirty after a flush");
    }

    // A flush that overtakes a write still arriving in the page cache, or
    // still in flight in the kernel, does not cover it.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    let e = export(dir.path(), CacheMode::Writeback, None);
    mapped_write(&e, &path, 64 * A, &data);
    assert!(
        e.dirty(),
        "mapped write (--map-writes) finished after a flush"
    );
    let dir = tempfile::tempdir().unwrap();
    let e = export(dir.path(), CacheMode::None, None);
    in_kernel_write(&e, 64 * A, &data);
    assert!(e.dirty(), "in-kernel (AIO) write reaped after a flush");
    assert_eq!(
        std::fs::read(dir.path().join("disk.img")).unwrap()[64 * A as usize..][..data.len()],
        data[..]
    );
}

/// A flush that fails leaves the export dirty (its data may be lost); the
/// final flush then still runs and reports the failure, as every later
/// flush of a target whose sync failed does.
#[test]
fn a_failed_flush_leaves_the_export_dirty() {
    let dir = tempfile::tempdir().unwrap();
    let fault = FaultSys::real();
    let e = export(dir.path(), CacheMode::Writeback, Some(fault.clone()));
    e.write(0, &[7; 4096], false).unwrap();
    fault.fail_once(CallKind::Fdatasync, 1, libc::EIO);
    assert!(e.flush().is_err(), "the injected EIO was not met");
    assert!(e.dirty(), "clean after a failed flush");
    assert!(e.final_flush().is_err(), "the final flush hid the failure");
    assert!(e.dirty());
}

/// Writes racing flushes, many times: whenever the export ends clean, a
/// flush that succeeded started after the last write returned (the
/// syscalls' own clock, not the export's), so nothing was left unflushed.
/// Both outcomes must occur, or the race was not run.
#[test]
fn a_write_racing_a_flush_never_leaves_unflushed_data_clean() {
    let dir = tempfile::tempdir().unwrap();
    let fault = FaultSys::real();
    let e = export(dir.path(), CacheMode::Writeback, Some(fault.clone()));
    fault.record_spans();
    let (mut clean, mut dirty) = (0, 0);
    for i in 0..400u64 {
        let go = Barrier::new(2);
        std::thread::scope(|s| {
            s.spawn(|| {
                go.wait();
                e.write((i % 64) * A, &[i as u8; 4096], false).unwrap();
            });
            go.wait();
            e.flush().unwrap();
        });
        let spans = fault.take_spans();
        let wrote = spans
            .iter()
            .filter(|c| c.kind == CallKind::Pwrite)
            .map(|c| c.end)
            .max()
            .expect("a pwrite");
        let covered = spans
            .iter()
            .any(|c| c.kind == CallKind::Fdatasync && c.ok && c.start > wrote);
        if e.dirty() {
            dirty += 1;
        } else {
            assert!(
                covered,
                "round {i}: clean, but no flush started after the write"
            );
            clean += 1;
        }
        // The next round starts clean.
        e.flush().unwrap();
        assert!(!e.dirty());
        fault.take_spans();
    }
    assert!(
        clean > 0 && dirty > 0,
        "clean {clean}, dirty {dirty}: no race"
    );
}
