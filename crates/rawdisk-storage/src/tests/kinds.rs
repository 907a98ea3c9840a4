//! Every storage kind the test kit can build (root): the chain and the probe
//! find what docs/capabilities.md says each kind supports.

use super::*;

/// `probe_methods` on real storage: files past their end (nothing changes),
/// block devices on a scratch range.
fn probe_check(t: &Target, s: &rawdisk_testkit::Scratch, kind: rawdisk_testkit::StorageKind) {
    use rawdisk_testkit::StorageKind as K;
    use Method::*;
    let (size, alloc) = (t.size(), s.allocated());
    let scratch = kind.is_block().then_some((0, 1 << 20));
    let p = t.probe_methods(scratch).unwrap();
    let got = |m: Method| {
        p.iter()
            .find(|p| p.method == m)
            .map(|p| *p.result.as_ref().unwrap())
    };
    let (w, f) = (Some(Tri::Works), Some(Tri::Fails));
    match kind {
        K::Tmpfs => assert_eq!(
            [
                got(PunchHole),
                got(ZeroRange),
                got(Fallocate),
                got(PunchAlloc)
            ],
            [w, f, w, w]
        ),
        // KEEP_SIZE refused teaches nothing of fallocate(0): left to use.
        K::Ramfs | K::Nfs3 => assert_eq!(
            [
                got(PunchHole),
                got(ZeroRange),
                got(Fallocate),
                got(PunchAlloc)
            ],
            [f, f, Some(Tri::Unknown), f]
        ),
        K::Ext4 | K::Xfs | K::Btrfs => assert_eq!(
            [
                got(PunchHole),
                got(ZeroRange),
                got(Fallocate),
                got(PunchAlloc)
            ],
            [w, w, w, w]
        ),
        // The NFS 4.2 client refuses fallocate(KEEP_SIZE), the probe's way
        // past the end, but has fallocate(0).
        K::Nfs42 => assert_eq!(
            [
                got(PunchHole),
                got(ZeroRange),
                got(Fallocate),
                got(PunchAlloc)
            ],
            [w, f, Some(Tri::Unknown), None]
        ),
        K::Loop512 | K::Loop4k => assert_eq!(
            [
                got(PunchHole),
                got(ZeroRange),
                got(BlkZeroout),
                got(BlkDiscard)
            ],
            [w, w, w, w]
        ),
        K::LoopTmpfs => assert_eq!(
            [got(ZeroRange), got(BlkZeroout), got(BlkDiscard)],
            [w, w, w]
        ),
    }
    if !kind.is_block() {
        assert_eq!(got(SeekHole), w, "{kind}");
        assert_eq!(t.size(), size, "{kind}: probe changed the size");
        // The probed data blocks are freed again; an extent-tree block the
        // file system added for them may stay (ext4 with 1 KiB blocks).
        let now = s.allocated();
        assert!(
            now < alloc + (64 << 10),
            "{kind}: probe left allocation behind: {alloc} -> {now}"
        );
    }
}

/// Real storage, every kind: the chain picks the method the storage has
/// (see docs/capabilities.md, the capability matrix), unaligned ranges on
/// block devices work, data around the range is untouched.
#[test]
#[ignore = "needs root"]
fn smoke_every_storage_kind() {
    use rawdisk_testkit::{Scratch, StorageKind, MIB};
    use std::thread;
    let trim = TRIM;
    let nohole = ZeroFlags::default();
    let fast_nohole = ZeroFlags {
        may_trim: false,
        fast_only: true,
    };
    let kinds: Vec<StorageKind> = StorageKind::usable()
        .into_iter()
        .filter(|k| std::env::var("RAWDISK_SMOKE_KIND").map_or(true, |v| v == k.name()))
        .collect();
    let handles: Vec<_> = kinds
        .iter()
        .map(|&kind| {
            thread::spawn(move || {
                let size = 8 * MIB;
                let s = Scratch::new(kind, size);
                let modes: &[CacheMode] = if kind == StorageKind::Ramfs {
                    &[CacheMode::Writeback]
                } else {
                    &[CacheMode::Writeback, CacheMode::None]
                };
                for &cache in modes {
                    let opts = OpenOptions {
                        cache,
                        ..Default::default()
                    };
                    let t = Target::open(s.path(), &opts).unwrap();
                    let g = t.geometry();
                    assert_eq!(g.size, size, "{kind}");
                    if kind.is_block() {
                        assert_eq!(t.kind(), Kind::Block);
                        assert_eq!(g.logical_sector, kind.sector_size(), "{kind}");
                        let q = t.block_queue_limits().expect("queue limits");
                        assert_eq!(q.logical_block_size, Some(kind.sector_size() as u64));
                    }
                    probe_check(&t, &s, kind);
                    fill(&t, size);
                    // Unaligned on every sector size: head and tail by hand.
                    let (off, len) = (4097 + 511, 2 * MIB + 1234);
                    let o1 = t.zero(off, len, trim).unwrap();
                    check_zeroed(&t, size, off, len);
                    fill(&t, size);
                    let o2 = t.zero(off, len, nohole).unwrap();
                    check_zeroed(&t, size, off, len);
                    fill(&t, size);
                    let o3 = t.zero(off, len, fast_nohole).map(|o| o.methods);
                    if o3.is_ok() {
                        check_zeroed(&t, size, off, len);
                    } else {
                        check_zeroed(&t, size, 0, 0);
                    }
                    let (m1, m2) = (o1.methods, o2.methods);
                    use Method::*;
                    let w = WriteZeros;
                    match kind {
                        StorageKind::Tmpfs => {
                            // Without trim, writing beats punch + fallocate
                            // there, so a fast zero without trim is refused.
                            assert_eq!((m1, m2), (vec![PunchHole], vec![w]), "{cache:?}");
                            assert_eq!(o3.unwrap_err().errno(), Some(libc::ENOTSUP));
                        }
                        StorageKind::Ramfs => {
                            assert_eq!((m1, m2), (vec![w], vec![w]));
                            assert_eq!(o3.unwrap_err().errno(), Some(libc::ENOTSUP));
                            let e = Target::open(
                                s.path(),
                                &OpenOptions {
                                    cache: CacheMode::None,
                                    ..Default::default()
                                },
                            )
                            .unwrap_err()
                            .to_string();
                            assert!(e.contains("O_DIRECT") && e.contains("disk.img"), "{e}");
                        }
                        StorageKind::Ext4 | StorageKind::Xfs | StorageKind::Btrfs => {
                            assert_eq!((m1, m2), (vec![PunchHole], vec![ZeroRange]));
                            assert_eq!(o3.unwrap(), vec![ZeroRange]);
                        }
                        // The NFS 3 client: no fallocate; O_DIRECT works.
                        StorageKind::Nfs3 => {
                            assert_eq!((m1, m2), (vec![w], vec![w]), "{cache:?}");
                            assert_eq!(o3.unwrap_err().errno(), Some(libc::ENOTSUP));
                        }
                        // The NFS 4.2 client: DEALLOCATE, then ALLOCATE again
                        // for a zero that keeps the space (no ZERO_RANGE).
                        StorageKind::Nfs42 => {
                            assert_eq!((m1, m2), (vec![PunchHole], vec![PunchAlloc]));
                            assert_eq!(o3.unwrap(), vec![PunchAlloc]);
                        }
                        StorageKind::Loop512 | StorageKind::Loop4k => {
                            assert_eq!((m1, m2), (vec![PunchHole, w], vec![ZeroRange, w]));
                            assert_eq!(o3.unwrap(), vec![PunchHole, w]);
                        }
                        StorageKind::LoopTmpfs => {
                            // PUNCH_HOLE needs the device's write-zeroes, which
                            // the loop driver drops on first use: learned gone.
                            assert_eq!(m1.last(), Some(&w), "{m1:?}");
                            assert_eq!(t.caps().get(PunchHole), Tri::Fails);
                            assert_eq!(o3.unwrap_err().errno(), Some(libc::ENOTSUP));
                            assert!(!t.can_fast_zero());
                        }
                    }
                    fill(&t, size);
                    t.trim(off, len).unwrap();
                    t.flush().unwrap();
                    let mut b = vec![0u8; size as usize];
                    t.read_at(&mut b, 0).unwrap();
                    let p = pattern(0, size as usize);
                    for i in
                        (0..size as usize).filter(|i| (*i as u64) < off || *i as u64 >= off + len)
                    {
                        assert_eq!(
                            b[i], p[i],
                            "{kind}: trim changed byte {i} outside its range"
                        );
                    }
                    drop(t);
                }
                drop(s);
            })
        })
        .collect();
    let mut failed = Vec::new();
    for (h, k) in handles.into_iter().zip(kinds) {
        if h.join().is_err() {
            failed.push(k);
        }
    }
    assert!(failed.is_empty(), "failed on {failed:?}");
}
