//! `extents` against the truth: our own SEEK_DATA / SEEK_HOLE walk on files,
//! the bytes themselves (holes read zero, written bytes lie in data runs),
//! the request bounds and the run limit.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{Extent, ExtentKind, Method, Target, Tri};
use rawdisk_testkit::{check_zero, write_pattern, Scratch, StorageKind, MIB};

use crate::common::*;
use crate::per_kind;

/// (start, end, is_data) runs of `[from, to)` by lseek, the way the kernel reports them.
fn lseek_runs(path: &Path, from: u64, to: u64) -> Vec<(u64, u64, bool)> {
    let f = File::open(path).unwrap();
    let fd = f.as_raw_fd();
    let mut runs: Vec<(u64, u64, bool)> = Vec::new();
    let mut pos = from;
    while pos < to {
        // SAFETY: fd is open for the lifetime of `f`; lseek has no memory effects.
        let d = unsafe { libc::lseek(fd, pos as i64, libc::SEEK_DATA) };
        let data_at = if d < 0 {
            let e = std::io::Error::last_os_error();
            assert_eq!(
                e.raw_os_error(),
                Some(libc::ENXIO),
                "SEEK_DATA at {pos}: {e}"
            );
            to
        } else {
            (d as u64).min(to)
        };
        if data_at > pos {
            runs.push((pos, data_at, false));
            pos = data_at;
            continue;
        }
        // SAFETY: as above.
        let h = unsafe { libc::lseek(fd, pos as i64, libc::SEEK_HOLE) };
        assert!(
            h >= 0,
            "SEEK_HOLE at {pos}: {}",
            std::io::Error::last_os_error()
        );
        let end = (h as u64).min(to);
        runs.push((pos, end, true));
        pos = end;
    }
    runs
}

/// All runs of `[off, off+len)` by asking the engine repeatedly.
fn all_extents(t: &Target, off: u64, len: u64, max: usize) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::new();
    let mut pos = off;
    while pos < off + len {
        let ex = t.extents(pos, off + len - pos, max).unwrap();
        assert!(
            !ex.is_empty() && ex.len() <= max,
            "{} runs for max {max}",
            ex.len()
        );
        for e in ex {
            assert_eq!(
                e.offset, pos,
                "runs must be contiguous from the request offset"
            );
            assert!(
                e.len > 0 && e.offset + e.len <= off + len,
                "run {e:?} outside the request"
            );
            pos += e.len;
            // Merge neighbours of the same kind (a limit may cut a run).
            match out.last_mut() {
                Some(l) if l.kind == e.kind => l.len += e.len,
                _ => out.push(e),
            }
        }
    }
    out
}

pub fn extents_truth(kind: StorageKind) {
    const SIZE: u64 = 16 * MIB;
    let s = Scratch::new(kind, SIZE);
    let path = s.path().to_owned();
    let data = [
        (MIB, MIB),
        (4 * MIB + 4096, 4096),
        (6 * MIB, 3 * MIB),
        (SIZE - MIB, MIB),
    ];
    for (o, l) in data {
        write_pattern(&path, o, l, 30);
    }
    let p = open_probe(&path);
    let t = &p.target;
    // A hole punched inside data.
    t.zero(7 * MIB, MIB, TRIM).unwrap();

    for (off, len) in [
        (0, SIZE),
        (MIB + 100, 10),
        (3 * MIB, 5 * MIB + 7),
        (SIZE - 5, 5),
    ] {
        let ex = all_extents(t, off, len, 64);
        if kind.is_block() {
            assert_eq!(
                ex,
                vec![Extent {
                    offset: off,
                    len,
                    kind: ExtentKind::Data
                }],
                "{kind}: a block device reports data"
            );
            continue;
        }
        let truth: Vec<(u64, u64, bool)> = lseek_runs(&path, off, off + len);
        let got: Vec<(u64, u64, bool)> = ex
            .iter()
            .map(|e| (e.offset, e.offset + e.len, e.kind == ExtentKind::Data))
            .collect();
        assert_eq!(got, truth, "{kind}: extents({off}, {len}) vs lseek");
        for e in &ex {
            if e.kind == ExtentKind::Hole {
                check_zero(&path, e.offset, e.len);
            }
        }
        // Every written byte (outside the punched MiB) is in a data run.
        for (o, l) in data {
            let (a, b) = (o.max(off), (o + l).min(off + len));
            for (x, y) in [(a, b.min(7 * MIB)), (a.max(8 * MIB), b)] {
                if x < y {
                    assert!(
                        ex.iter().any(|e| e.kind == ExtentKind::Data
                            && e.offset <= x
                            && e.offset + e.len >= y),
                        "{kind}: written {x}..{y} not inside one data run: {ex:?}"
                    );
                }
            }
        }
    }
    if all_data(kind) {
        // ramfs has SEEK_HOLE but reports everything as data; the NFS 3
        // client has none and the kernel answers from the size.
        assert_eq!(all_extents(t, 0, SIZE, 8).len(), 1);
    } else if !kind.is_block() {
        assert_tri(t, Method::SeekHole, Tri::Works, &format!("{kind}"));
        // The run limit: a prefix, at most max runs.
        let two = t.extents(0, SIZE, 2).unwrap();
        assert_eq!(two.len(), 2, "{kind}: {two:?}");
        assert_eq!(
            two[0],
            Extent {
                offset: 0,
                len: MIB,
                kind: ExtentKind::Hole
            }
        );
        assert_eq!(
            two[1],
            Extent {
                offset: MIB,
                len: MIB,
                kind: ExtentKind::Data
            }
        );
    }
}
per_kind!(extents_truth);

/// SEEK_DATA unsupported (EOPNOTSUPP / EINVAL from some file systems): data
/// everywhere, learned, not asked again.
#[test]
#[ignore = "needs root"]
fn seek_unsupported_reports_data() {
    let s = Scratch::new(StorageKind::Tmpfs, 8 * MIB);
    write_pattern(s.path(), MIB, MIB, 31);
    let p = open_probe(s.path());
    fail_always(
        &p.fault,
        &[CallKind::SeekData, CallKind::SeekHole],
        libc::EOPNOTSUPP,
    );
    let ex = p.target.extents(0, 8 * MIB, 16).unwrap();
    assert_eq!(
        ex,
        vec![Extent {
            offset: 0,
            len: 8 * MIB,
            kind: ExtentKind::Data
        }]
    );
    assert_tri(&p.target, Method::SeekHole, Tri::Fails, "tmpfs");
    let n = p.fault.calls(CallKind::SeekData) + p.fault.calls(CallKind::SeekHole);
    p.target.extents(0, 8 * MIB, 16).unwrap();
    assert_eq!(
        p.fault.calls(CallKind::SeekData) + p.fault.calls(CallKind::SeekHole),
        n
    );
    // A real error is returned.
    let s2 = Scratch::new(StorageKind::Tmpfs, 8 * MIB);
    let p2 = open_probe(s2.path());
    p2.fault.fail_once(CallKind::SeekData, 1, libc::EIO);
    p2.fault.fail_once(CallKind::SeekHole, 1, libc::EIO);
    let e = p2.target.extents(0, 8 * MIB, 16).expect_err("EIO");
    assert_eq!(errno_of(&e), libc::EIO);
    assert_ne!(p2.target.caps().get(Method::SeekHole), Tri::Fails);
}
