//! Opening, read/write, geometry, shared capabilities and many threads at once.

use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{CacheMode, Kind, Method, OpenOptions, Target, Tri, ZeroFlags};
use rawdisk_testkit::{
    assert_same, pattern_vec, read_all, read_range, write_pattern, Fs, LoopDev, Scratch,
    StorageKind, KIB, MIB,
};

use crate::common::*;
use crate::per_kind;

pub fn read_write_geometry(kind: StorageKind) {
    const SIZE: u64 = 8 * MIB;
    let s = Scratch::new(kind, SIZE);
    let t = open(s.path());
    let g = t.geometry();
    assert_eq!(g.size, SIZE);
    assert!(!g.read_only);
    if kind.is_block() {
        assert_eq!(t.kind(), Kind::Block);
        assert_eq!(g.logical_sector, kind.sector_size());
        assert!(g.physical_sector >= g.logical_sector, "{g:?}");
    } else {
        assert_eq!(t.kind(), Kind::File);
    }
    // Unaligned writes of odd sizes, fua and not, read back through both paths.
    write_pattern(s.path(), 0, SIZE, 60);
    let mut want = pattern_vec(60, 0, SIZE as usize);
    for (i, (off, len)) in [(1u64, 1usize), (4095, 2), (MIB - 3, 70_001), (SIZE - 5, 5)]
        .into_iter()
        .enumerate()
    {
        let data = pattern_vec(61 + i as u64, off, len);
        t.write_at(&data, off, i % 2 == 0).unwrap();
        want[off as usize..off as usize + len].copy_from_slice(&data);
        let mut back = vec![0u8; len];
        t.read_at(&mut back, off).unwrap();
        assert_same(&format!("{kind} read_at"), off, &back, &data);
    }
    t.flush().unwrap();
    t.cache(0, SIZE).unwrap();
    assert_same(&format!("{kind}"), 0, &read_all(s.path()), &want);
    // Zero and trim past the end are errors and change nothing.
    assert!(
        t.zero(SIZE - 10, 20, NO_TRIM).is_err(),
        "{kind}: zero past EOF"
    );
    assert!(
        t.zero(SIZE - 10, 20, TRIM).is_err(),
        "{kind}: zero past EOF"
    );
    assert!(t.trim(SIZE - 10, 20).is_err(), "{kind}: trim past EOF");
    assert_eq!(t.size(), SIZE, "{kind}: size changed");
    // Reading past the end is an error, not a short read passed off as data.
    let mut buf = [0u8; 10];
    assert!(
        t.read_at(&mut buf, SIZE - 5).is_err(),
        "{kind}: read past EOF"
    );

    // Read-only: reads work, writes and zeroes fail and change nothing.
    let ro = Target::open(
        s.path(),
        &OpenOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(ro.geometry().read_only);
    let mut b = vec![0u8; 4096];
    ro.read_at(&mut b, 0).unwrap();
    assert_same(&format!("{kind} ro"), 0, &b, &want[..4096]);
    assert!(ro.write_at(&[1, 2, 3], 0, false).is_err());
    assert!(ro.zero(0, MIB, NO_TRIM).is_err());
    assert_same(&format!("{kind} after ro"), 0, &read_all(s.path()), &want);
}
per_kind!(read_write_geometry);

/// A read that must not wait for the device (`read_cached`, the server's
/// reader): data just written is in the page cache and comes back exact on
/// every file system; memory-only storage answers without RWF_NOWAIT. A
/// block device may answer "not cached" (then `buf` is not used), never
/// wrong bytes.
pub fn cached_read(kind: StorageKind) {
    const SIZE: u64 = 8 * MIB;
    let s = Scratch::new(kind, SIZE);
    let p = open_probe(s.path());
    let data = pattern_vec(90, MIB + 1000, 60 * KIB as usize);
    p.target.write_at(&data, MIB + 1000, false).unwrap();
    let mut back = vec![0u8; data.len()];
    let cached = p.target.read_cached(&mut back, MIB + 1000).unwrap();
    let memory_only = matches!(kind, StorageKind::Tmpfs | StorageKind::Ramfs);
    // FUSE has no RWF_NOWAIT (EOPNOTSUPP, learned once): the NFS-like kinds
    // answer "not cached", and the server reads on its threads.
    if memory_only || !(kind.is_block() || kind.is_nfs()) {
        assert!(cached, "{kind}: just-written data not read from the cache");
    }
    if kind.is_nfs() {
        assert!(!cached, "{kind}: RWF_NOWAIT worked on FUSE?");
        assert!(!p.target.read_cached(&mut back, MIB + 1000).unwrap());
        let asked = p.fault.calls(CallKind::PreadNowait);
        assert_eq!(asked, 1, "{kind}: RWF_NOWAIT asked again after EOPNOTSUPP");
    }
    if cached {
        assert_same(&format!("{kind} cached read"), MIB + 1000, &back, &data);
    }
    let asked = p.fault.calls(CallKind::PreadNowait);
    assert_eq!(asked == 0, memory_only, "{kind}: RWF_NOWAIT calls {asked}");
}
per_kind!(cached_read);

/// O_DIRECT (CacheMode::None), where the storage has it (not ramfs): aligned
/// I/O round-trips, zero of an unaligned range still works.
pub fn direct_io(kind: StorageKind) {
    const SIZE: u64 = 8 * MIB;
    let s = Scratch::new(kind, SIZE);
    write_pattern(s.path(), 0, SIZE, 70);
    let t = Target::open(
        s.path(),
        &OpenOptions {
            cache: CacheMode::None,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{kind} O_DIRECT: {e}"));
    let align = t.geometry().dio_align.max(1) as usize;
    assert!(align <= 4096, "{kind}: dio_align {align}");
    let data = pattern_vec(71, MIB, 64 * KIB as usize);
    t.write_at(&data, MIB, false).unwrap();
    let mut back = vec![0u8; 64 * KIB as usize];
    t.read_at(&mut back, MIB).unwrap();
    assert_same(&format!("{kind} dio"), MIB, &back, &data);
    t.zero(2 * MIB + 100, MIB + 5, NO_TRIM).unwrap();
    t.zero(4 * MIB + 1, 100, TRIM).unwrap();
    t.flush().unwrap();
    let mut want = pattern_vec(70, 0, SIZE as usize);
    want[MIB as usize..(MIB + 64 * KIB) as usize].copy_from_slice(&data);
    want[(2 * MIB + 100) as usize..(3 * MIB + 105) as usize].fill(0);
    want[(4 * MIB + 1) as usize..(4 * MIB + 101) as usize].fill(0);
    assert_same(&format!("{kind} dio"), 0, &read_all(s.path()), &want);
}
per_kind!(direct_io:
    tmpfs => Tmpfs,
    ext4 => Ext4,
    xfs => Xfs,
    btrfs => Btrfs,
    nfs3 => Nfs3,
    nfs42 => Nfs42,
    loop512 => Loop512,
    loop4k => Loop4k,
);

/// Handles on the same file or device share one `Capabilities` (keyed by
/// device and inode), so what one learned the other does not pay for again.
#[test]
#[ignore = "needs root"]
fn handles_share_capabilities() {
    let fs = Fs::tmpfs(64 * MIB);
    let a = fs.sparse_file("a.img", 8 * MIB);
    let other = fs.sparse_file("b.img", 8 * MIB);
    let link = fs.path("a-link.img");
    std::fs::hard_link(&a, &link).unwrap();
    let p1 = open_probe(&a);
    let p2 = open_probe(&a);
    let t3 = open(&link);
    let t4 = open(&other);
    assert!(Arc::ptr_eq(p1.target.caps(), p2.target.caps()));
    assert!(
        Arc::ptr_eq(p1.target.caps(), t3.caps()),
        "hard link = same inode"
    );
    assert!(!Arc::ptr_eq(p1.target.caps(), t4.caps()));
    // tmpfs has no ZERO_RANGE: learned through p1, p2 never tries it.
    p1.target.zero(0, MIB, NO_TRIM).unwrap();
    assert_eq!(p2.target.caps().get(Method::ZeroRange), Tri::Fails);
    assert_eq!(t4.caps().get(Method::ZeroRange), Tri::Unknown);
    p2.target.zero(MIB, MIB, NO_TRIM).unwrap();
    assert_eq!(
        falloc_calls(
            &p2.fault,
            rawdisk_storage::sys::FallocMode::ZeroRange { keep_size: false }
        ),
        0
    );
    assert_eq!(p1.target.caps().stats(Method::ZeroRange).calls, 1);

    let d = LoopDev::new(8 * MIB, 512);
    let b1 = open(d.path());
    let b2 = open(d.path());
    assert!(Arc::ptr_eq(b1.caps(), b2.caps()));
    assert!(!Arc::ptr_eq(b1.caps(), p1.target.caps()));
}

/// Many threads writing, zeroing and trimming disjoint ranges of one target
/// at once; every thread's range ends up exactly as its own model says.
pub fn concurrent_disjoint(kind: StorageKind) {
    const THREADS: u64 = 8;
    const REGION: u64 = 2 * MIB;
    let s = Scratch::new(kind, THREADS * REGION);
    write_pattern(s.path(), 0, THREADS * REGION, 80);
    let t = Arc::new(open(s.path()));
    let ss = offload_align(kind);
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let t = t.clone();
            std::thread::spawn(move || {
                let base = i * REGION;
                let mut rng = SmallRng::seed_from_u64(1000 + i);
                let mut val = pattern_vec(80, base, REGION as usize);
                let mut or_zero = vec![false; REGION as usize];
                for _ in 0..40 {
                    let len = rng.gen_range(1..=REGION / 2);
                    let off = rng.gen_range(0..=REGION - len);
                    let (a, b) = (off as usize, (off + len) as usize);
                    match rng.gen_range(0..3) {
                        0 => {
                            let d = pattern_vec(rng.gen(), base + off, len as usize);
                            t.write_at(&d, base + off, false).unwrap();
                            val[a..b].copy_from_slice(&d);
                            or_zero[a..b].fill(false);
                        }
                        1 => {
                            let flags = ZeroFlags {
                                may_trim: rng.gen_bool(0.5),
                                fast_only: false,
                            };
                            t.zero(base + off, len, flags).unwrap();
                            val[a..b].fill(0);
                            or_zero[a..b].fill(false);
                        }
                        _ => {
                            t.trim(base + off, len).unwrap();
                            if ss > 1 {
                                let ma = (base + off).div_ceil(ss) * ss - base;
                                let mb = (base + off + len) / ss * ss - base;
                                if mb > ma {
                                    or_zero[ma as usize..mb as usize].fill(true);
                                }
                            } else if punch_frees(kind) {
                                val[a..b].fill(0);
                            }
                        }
                    }
                }
                (val, or_zero)
            })
        })
        .collect();
    let models: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    t.flush().unwrap();
    for (i, (val, or_zero)) in models.into_iter().enumerate() {
        let base = i as u64 * REGION;
        let got = read_range(s.path(), base, REGION as usize);
        for j in 0..REGION as usize {
            assert!(
                got[j] == val[j] || (or_zero[j] && got[j] == 0),
                "{kind}: thread {i} offset {}: {:#x}, model {:#x}",
                base + j as u64,
                got[j],
                val[j]
            );
        }
    }
    drop(t);
}
per_kind!(concurrent_disjoint:
    tmpfs => Tmpfs,
    ramfs => Ramfs,
    ext4 => Ext4,
    xfs => Xfs,
    btrfs => Btrfs,
    nfs3 => Nfs3,
    nfs42 => Nfs42,
    loop512 => Loop512,
    loop4k => Loop4k,
);

/// Write-back is started only where there is any: tmpfs and ramfs keep
/// their data in the page cache alone and get no sync_file_range call (it
/// would be one useless syscall per request under `serve --write-behind`);
/// files on disks and block devices get one. The data is intact either way.
pub fn start_writeback_only_where_data_is_written_back(kind: StorageKind) {
    const SIZE: u64 = 4 * MIB;
    let s = Scratch::new(kind, SIZE);
    let p = open_probe(s.path());
    let data = pattern_vec(77, MIB + 1, (2 * MIB) as usize);
    p.target.write_at(&data, MIB + 1, false).unwrap();
    let before = p.fault.calls(CallKind::StartWriteback);
    p.target.start_writeback(MIB + 1, 2 * MIB);
    let want = match kind {
        StorageKind::Tmpfs | StorageKind::Ramfs => 0,
        _ => 1,
    };
    assert_eq!(
        p.fault.calls(CallKind::StartWriteback) - before,
        want,
        "{kind:?}"
    );
    p.target.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    p.target.read_at(&mut back, MIB + 1).unwrap();
    assert!(back == data, "{kind:?}: data differs after write-back");
}
per_kind!(start_writeback_only_where_data_is_written_back);
