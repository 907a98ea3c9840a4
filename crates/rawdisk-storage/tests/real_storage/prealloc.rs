//! `preallocate` in every mode on every kind: size, allocation, contents,
//! the method that did it (falloc on ramfs and NFS 3 falls back to full).

use std::fs::File;

use rawdisk_storage::sys::{CallKind, FallocMode};
use rawdisk_storage::{Method, Prealloc, Tri};
use rawdisk_testkit::{
    allocated_bytes, check_pattern, check_zero, size_of, write_pattern, Fs, FsKind, LoopDev, KIB,
    MIB,
};

use crate::common::*;

const SIZE: u64 = 32 * MIB;

fn expected_method(fs: FsKind, mode: Prealloc) -> Option<Method> {
    match (fs, mode) {
        (_, Prealloc::Off) => None,
        (FsKind::Ramfs | FsKind::Nfs3, Prealloc::Falloc) => Some(Method::WriteZeros),
        (_, Prealloc::Falloc) => Some(Method::Fallocate),
        (_, Prealloc::Full) => Some(Method::WriteZeros),
    }
}

/// No fallocate at all: ramfs, the NFS 3 client.
fn no_fallocate(fs: FsKind) -> bool {
    matches!(fs, FsKind::Ramfs | FsKind::Nfs3)
}

fn prealloc_on(fs: FsKind) {
    if let Some(why) = fs.unavailable() {
        eprintln!("{fs} skipped: {why}");
        return;
    }
    let fsg = Fs::new(fs, 256 * MIB);
    for (i, mode) in [Prealloc::Off, Prealloc::Falloc, Prealloc::Full]
        .into_iter()
        .enumerate()
    {
        let what = format!("{fs} {mode:?}");
        // A new, empty image.
        let path = fsg.path(&format!("new{i}.img"));
        File::create(&path).unwrap();
        let p = open_probe(&path);
        let r = p
            .target
            .preallocate(SIZE, mode)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let want = expected_method(fs, mode);
        if mode != Prealloc::Off {
            assert_eq!(r.method, want, "{what}: {r:?}");
        }
        assert_eq!(size_of(&path), SIZE, "{what}");
        assert_eq!(
            p.target.size(),
            SIZE,
            "{what}: Target::size after preallocate"
        );
        let alloc = allocated_bytes(&path);
        match mode {
            // Sparse, but the first block allocated (for O_DIRECT alignment probing).
            Prealloc::Off => assert!(alloc <= 256 * KIB, "{what}: {alloc} bytes allocated"),
            _ => assert!(alloc >= SIZE, "{what}: only {alloc} bytes allocated"),
        }
        if no_fallocate(fs) && mode == Prealloc::Falloc {
            // Never glibc's posix_fallocate emulation (a 1-byte write per 4 KiB):
            // the fallback writes big chunks.
            let small = p
                .rec
                .take()
                .into_iter()
                .filter(|c| c.kind == CallKind::Pwrite && c.len < 64 * KIB)
                .count();
            assert!(small <= 1, "{what}: {small} small writes");
        }
        drop(p);
        check_zero(&path, 0, SIZE);

        // Growing an image that holds data: the old bytes stay, the new ones read zero.
        let path = fsg.path(&format!("grow{i}.img"));
        File::create(&path).unwrap();
        write_pattern(&path, 0, MIB + 100, 40 + i as u64);
        let p = open_probe(&path);
        p.target.preallocate(8 * MIB, mode).unwrap();
        assert_eq!(size_of(&path), 8 * MIB, "{what} grow");
        check_pattern(&path, 0, MIB + 100, 40 + i as u64);
        check_zero(&path, MIB + 100, 7 * MIB - 100);
        let alloc = allocated_bytes(&path);
        match mode {
            Prealloc::Off => {
                if fs != FsKind::Ramfs {
                    assert!(alloc <= 2 * MIB, "{what} grow: {alloc} allocated")
                }
            }
            _ => assert!(alloc >= 8 * MIB, "{what} grow: only {alloc} allocated"),
        }
        if mode == Prealloc::Falloc && !no_fallocate(fs) {
            // fallocate(0) from the old end, not over the data.
            let calls = p.rec.take();
            let fa: Vec<&Call> = calls
                .iter()
                .filter(|c| {
                    c.ok && matches!(
                        c.kind,
                        CallKind::Fallocate(FallocMode::Allocate | FallocMode::AllocateKeepSize)
                    )
                })
                .collect();
            assert!(!fa.is_empty(), "{what}: no fallocate: {calls:?}");
            assert!(
                fa.iter().all(|c| c.offset >= MIB),
                "{what}: fallocate over the old data: {fa:?}"
            );
        }
    }
}

#[test]
#[ignore = "needs root"]
fn prealloc_tmpfs() {
    prealloc_on(FsKind::Tmpfs)
}
#[test]
#[ignore = "needs root"]
fn prealloc_ramfs() {
    prealloc_on(FsKind::Ramfs)
}
#[test]
#[ignore = "needs root"]
fn prealloc_ext4() {
    prealloc_on(FsKind::Ext4)
}
#[test]
#[ignore = "needs root"]
fn prealloc_xfs() {
    prealloc_on(FsKind::Xfs)
}
#[test]
#[ignore = "needs root"]
fn prealloc_btrfs() {
    prealloc_on(FsKind::Btrfs)
}
#[test]
#[ignore = "needs root"]
fn prealloc_nfs3() {
    prealloc_on(FsKind::Nfs3)
}
#[test]
#[ignore = "needs root"]
fn prealloc_nfs42() {
    prealloc_on(FsKind::Nfs42)
}

/// Block devices: a no-op when the size fits (data untouched), an error when
/// it does not.
#[test]
#[ignore = "needs root"]
fn prealloc_block() {
    for ss in [512, 4096] {
        let d = LoopDev::new(16 * MIB, ss);
        write_pattern(d.path(), 0, 16 * MIB, 50);
        let p = open_probe(d.path());
        for mode in [Prealloc::Off, Prealloc::Falloc, Prealloc::Full] {
            p.target
                .preallocate(16 * MIB, mode)
                .unwrap_or_else(|e| panic!("loop{ss} {mode:?}: {e}"));
            p.target.preallocate(MIB, mode).unwrap();
            let e = p
                .target
                .preallocate(16 * MIB + 4096, mode)
                .expect_err("larger than the device");
            let _ = e.to_string();
        }
        let calls = p.rec.take();
        assert!(
            calls.iter().all(|c| !c.ok),
            "loop{ss}: preallocate changed something: {calls:?}"
        );
        assert_eq!(p.target.size(), 16 * MIB);
        check_pattern(d.path(), 0, 16 * MIB, 50);
    }
}

/// The probe allocates past the end with KEEP_SIZE, which the NFS 4.2 client
/// refuses (it has fallocate(0) and PUNCH_HOLE | KEEP_SIZE only): that must
/// not teach every handle that fallocate(0) fails, or a falloc preallocation
/// writes every byte instead of one ALLOCATE.
#[test]
#[ignore = "needs root"]
fn probe_past_the_end_does_not_unlearn_nfs42_allocate() {
    if let Some(why) = FsKind::Nfs42.unavailable() {
        eprintln!("nfs42 skipped: {why}");
        return;
    }
    let fsg = Fs::new(FsKind::Nfs42, 64 * MIB);
    let path = fsg.sparse_file("p.img", MIB);
    write_pattern(&path, 0, MIB, 9);
    let p = open_probe(&path);
    p.target.probe_methods(None).unwrap();
    assert_ne!(p.target.caps().get(Method::Fallocate), Tri::Fails);
    let c = fsg.nfs_counts().unwrap();
    let (writes, allocs) = (c.get("write_bytes"), c.get("fallocate_alloc"));
    let r = p.target.preallocate(SIZE, Prealloc::Falloc).unwrap();
    assert_eq!(r.method, Some(Method::Fallocate), "{r:?}");
    assert_eq!(c.get("fallocate_alloc"), allocs + 1);
    assert_eq!(c.get("write_bytes"), writes, "zeros written");
    drop(p);
    check_pattern(&path, 0, MIB, 9);
    check_zero(&path, MIB, SIZE - MIB);
    assert_eq!(size_of(&path), SIZE);
}
