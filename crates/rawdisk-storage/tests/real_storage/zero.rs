//! `zero` on every storage kind: aligned and unaligned ranges, with and
//! without may_trim, ending at EOF, more than 1 GiB; contents, allocation,
//! the method used, and that a method known to fail is never called again.

use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{Kind, Method, Tri, ZeroFlags};
use rawdisk_testkit::{
    assert_same, check_pattern, check_zero, pattern_vec, read_all, write_pattern, Scratch,
    StorageKind, GIB, KIB, MIB,
};

use crate::common::*;
use crate::per_kind;

/// Slack for st_blocks comparisons: file systems keep a few metadata or
/// speculative-preallocation blocks around that have nothing to do with the
/// zeroed range.
const SLACK: u64 = 256 * KIB;

fn flags_name(f: ZeroFlags) -> &'static str {
    if f.may_trim {
        "may_trim"
    } else {
        "no trim"
    }
}

/// The bytes of `[off, off+len)` that cover whole 4 KiB blocks: what a punch
/// must free on a file system with 4 KiB blocks (and on the ext4 file behind
/// a loop device).
fn inner_blocks(off: u64, len: u64) -> u64 {
    let a = off.div_ceil(4096) * 4096;
    let b = (off + len) / 4096 * 4096;
    b.saturating_sub(a)
}

/// Whether `[off, off+len)` contains an aligned middle the engine offloads.
fn has_aligned_middle(kind: StorageKind, off: u64, len: u64) -> bool {
    let ss = offload_align(kind);
    (off + len) / ss * ss > off.div_ceil(ss) * ss
}

pub fn zero_ranges(kind: StorageKind) {
    const SIZE: u64 = 16 * MIB;
    let s = Scratch::new(kind, SIZE);
    let path = s.path().to_owned();
    let p = open_probe(&path);
    let t = &p.target;
    assert_eq!(t.size(), SIZE);
    assert_eq!(
        t.kind(),
        if kind.is_block() {
            Kind::Block
        } else {
            Kind::File
        }
    );
    if kind.is_block() {
        assert_eq!(t.geometry().logical_sector, kind.sector_size());
    }

    let cases: [(&str, u64, u64, ZeroFlags); 9] = [
        ("aligned", MIB, 4 * MIB, TRIM),
        ("aligned", 6 * MIB, 4 * MIB, NO_TRIM),
        ("unaligned", MIB + 777, 4 * MIB + 1000, TRIM),
        ("unaligned", 6 * MIB + 4095, 4 * MIB + 3, NO_TRIM),
        ("inside one sector", 5 * MIB + 100, 200, TRIM),
        ("inside one sector", 5 * MIB + 4000, 90, NO_TRIM),
        (
            "sector-aligned, not 4K-aligned",
            3 * MIB + 512,
            8 * 512,
            NO_TRIM,
        ),
        ("to EOF", SIZE - 3 * MIB - 513, 3 * MIB + 513, TRIM),
        ("to EOF", SIZE - 2 * MIB - 1, 2 * MIB + 1, NO_TRIM),
    ];
    // A loop device on tmpfs loses write-zeroes at its first no-trim zero:
    // ZERO_RANGE on the device asks the loop driver for ZERO_RANGE on tmpfs,
    // which fails, and the driver sets write_zeroes_max_bytes to 0 for good.
    // From then on PUNCH_HOLE on the device fails with EOPNOTSUPP and the
    // engine must learn that a method that worked no longer does.
    let mut wz_lost = false;
    for (i, &(name, off, len, flags)) in cases.iter().enumerate() {
        let what = format!("{kind}: {name} {off}+{len} {}", flags_name(flags));
        let seed = 100 + i as u64;
        write_pattern(&path, 0, SIZE, seed);
        let before = s.allocated();
        let stats_before = t.caps().snapshot();
        p.rec.take();
        let out = t
            .zero(off, len, flags)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let calls = p.rec.take();
        let stats_after = t.caps().snapshot();

        let mut want = pattern_vec(seed, 0, SIZE as usize);
        want[off as usize..(off + len) as usize].fill(0);
        assert_same(&format!("{what}: read back"), 0, &read_all(&path), &want);
        let mut via = vec![0u8; (len + 8192).min(SIZE - off + 4096) as usize];
        let from = off.saturating_sub(4096);
        let via_len = via.len().min((SIZE - from) as usize);
        t.read_at(&mut via[..via_len], from).unwrap();
        assert_same(
            &format!("{what}: read_at"),
            from,
            &via[..via_len],
            &want[from as usize..from as usize + via_len],
        );

        let mut main = expected_zero_method(kind, flags.may_trim);
        if kind == StorageKind::LoopTmpfs && wz_lost {
            main = Method::ZeroRange;
        }
        if has_aligned_middle(kind, off, len) {
            assert!(
                out.methods.contains(&main),
                "{what}: expected {main}, used {:?}",
                out.methods
            );
            let mut kinds = method_call_kinds(main);
            if kind.is_block() {
                kinds.push(CallKind::Pwrite);
            }
            if main != Method::PunchAlloc {
                assert_tiles(&calls, &kinds, off, len, GIB);
            }
        } else {
            assert_eq!(
                out.methods,
                vec![Method::WriteZeros],
                "{what}: less than a sector must be written by hand"
            );
            assert_tiles(&calls, &[CallKind::Pwrite], off, len, len);
        }
        for m in &out.methods {
            assert!(
                *m == main || allowed_extra(kind).contains(m),
                "{what}: unexpected method {m} in {:?}",
                out.methods
            );
        }
        // The counters: bytes per method add up to the request, split into
        // the offloaded middle and the hand-written head and tail.
        let a = offload_align(kind);
        let (ms, me) = (off.div_ceil(a) * a, (off + len) / a * a);
        let middle = me.saturating_sub(ms);
        let delta = |m: Method| {
            let get = |snap: &rawdisk_storage::CapsSnapshot| {
                snap.methods
                    .iter()
                    .find(|(mm, _, _)| *mm == m)
                    .map(|(_, _, st)| st.bytes)
                    .unwrap_or(0)
            };
            get(&stats_after) - get(&stats_before)
        };
        if main == Method::WriteZeros {
            assert_eq!(delta(Method::WriteZeros), len, "{what}: write-zeros bytes");
        } else {
            assert_eq!(delta(main), middle, "{what}: {main} bytes");
            assert_eq!(
                delta(Method::WriteZeros),
                len - middle,
                "{what}: write-zeros bytes"
            );
        }

        let after = s.allocated();
        let inner = inner_blocks(off, len);
        let punched = flags.may_trim
            && punch_frees(kind)
            && !(kind == StorageKind::LoopTmpfs && wz_lost)
            && has_aligned_middle(kind, off, len);
        if punched && inner >= MIB {
            assert!(
                before.saturating_sub(after) + SLACK >= inner,
                "{what}: allocation {before} -> {after}, expected about {inner} bytes freed"
            );
        }
        if !flags.may_trim {
            assert!(
                after + SLACK >= before,
                "{what}: allocation {before} -> {after}: no-trim zero must keep the space allocated"
            );
        }
        if kind == StorageKind::LoopTmpfs && !flags.may_trim && has_aligned_middle(kind, off, len) {
            wz_lost = true;
            assert_eq!(
                s.loop_dev().unwrap().queue_attr("write_zeroes_max_bytes"),
                0,
                "the loop driver should have dropped write-zeroes (kernel behaviour changed?)"
            );
        }
    }

    // What the engine learned, and that nothing known to fail is tried again.
    let expect: &[(Method, Tri)] = match kind {
        StorageKind::Tmpfs => &[
            (Method::PunchHole, Tri::Works),
            (Method::ZeroRange, Tri::Fails),
            // Never tried: writing zeros costs less there.
            (Method::PunchAlloc, Tri::Unknown),
        ],
        // The NFS 3 client has no fallocate at all.
        StorageKind::Ramfs | StorageKind::Nfs3 => &[
            (Method::PunchHole, Tri::Fails),
            (Method::ZeroRange, Tri::Fails),
        ],
        // The NFS 4.2 client: DEALLOCATE and ALLOCATE, no ZERO_RANGE.
        StorageKind::Nfs42 => &[
            (Method::PunchHole, Tri::Works),
            (Method::ZeroRange, Tri::Fails),
            (Method::PunchAlloc, Tri::Works),
        ],
        StorageKind::Ext4 | StorageKind::Xfs | StorageKind::Btrfs => &[
            (Method::PunchHole, Tri::Works),
            (Method::ZeroRange, Tri::Works),
        ],
        StorageKind::Loop512 | StorageKind::Loop4k => &[
            (Method::PunchHole, Tri::Works),
            (Method::ZeroRange, Tri::Works),
        ],
        StorageKind::LoopTmpfs => &[
            (Method::PunchHole, Tri::Fails),
            (Method::ZeroRange, Tri::Works),
        ],
    };
    for &(m, tri) in expect {
        assert_tri(t, m, tri, &format!("{kind} after zeroing"));
    }
    assert_failed_methods_not_retried(&p, &format!("{kind}"), |t| {
        t.zero(2 * MIB + 3, 5 * MIB, TRIM).unwrap();
        t.zero(9 * MIB + 5, 5 * MIB, NO_TRIM).unwrap();
    });
    let mut want = pattern_vec(100 + cases.len() as u64 - 1, 0, SIZE as usize);
    want[(SIZE - 2 * MIB - 1) as usize..].fill(0);
    want[(2 * MIB + 3) as usize..(7 * MIB + 3) as usize].fill(0);
    want[(9 * MIB + 5) as usize..(14 * MIB + 5) as usize].fill(0);
    assert_same(
        &format!("{kind}: final read back"),
        0,
        &read_all(&path),
        &want,
    );
}
per_kind!(zero_ranges);

/// Syscall kinds a method issues for the bulk of its work.
pub fn method_call_kinds(m: Method) -> Vec<CallKind> {
    match m {
        Method::PunchHole => vec![PUNCH],
        Method::FallocWriteZeroes => vec![WRITE_ZEROES],
        Method::ZeroRange => ZERO_RANGE_KINDS.to_vec(),
        Method::PunchAlloc => vec![PUNCH],
        Method::BlkZeroout => vec![CallKind::BlkZeroout],
        Method::BlkDiscard => vec![CallKind::BlkDiscard],
        Method::WriteZeros => vec![CallKind::Pwrite, CallKind::PwriteDsync],
        Method::Fallocate => vec![
            CallKind::Fallocate(rawdisk_storage::sys::FallocMode::Allocate),
            CallKind::Fallocate(rawdisk_storage::sys::FallocMode::AllocateKeepSize),
        ],
        Method::SeekHole => vec![CallKind::SeekHole, CallKind::SeekData],
        Method::Splice => vec![CallKind::Splice],
        Method::MapWrite => vec![CallKind::PopulateWrite, CallKind::RecvToMap],
    }
}

/// Runs `ops` and asserts that no syscall kind used only by methods known to
/// fail was issued, and that the failure counters of those methods stay put.
pub fn assert_failed_methods_not_retried(
    p: &Probe,
    what: &str,
    ops: impl FnOnce(&rawdisk_storage::Target),
) {
    let t = &p.target;
    let failed: Vec<Method> = Method::ALL
        .iter()
        .copied()
        .filter(|m| t.caps().get(*m) == Tri::Fails)
        .collect();
    let working: Vec<CallKind> = Method::ALL
        .iter()
        .filter(|m| t.caps().get(**m) != Tri::Fails)
        .flat_map(|m| method_call_kinds(*m))
        .collect();
    let only_failed: Vec<CallKind> = failed
        .iter()
        .flat_map(|m| method_call_kinds(*m))
        .filter(|k| !working.contains(k))
        .collect();
    let counts_before = p.fault.counts();
    let stats_before: Vec<_> = failed.iter().map(|m| t.caps().stats(*m)).collect();
    ops(t);
    let counts_after = p.fault.counts();
    for k in &only_failed {
        assert_eq!(
            counts_before.get(k).copied().unwrap_or(0),
            counts_after.get(k).copied().unwrap_or(0),
            "{what}: {k:?} called again although its method is known to fail ({failed:?})"
        );
    }
    for (m, sb) in failed.iter().zip(stats_before) {
        assert_eq!(
            t.caps().stats(*m).calls,
            sb.calls,
            "{what}: {m} known to fail but called again"
        );
        assert_eq!(t.caps().get(*m), Tri::Fails);
    }
}

/// More than 1 GiB, unaligned, on every kind that can hold it: the range
/// reads back as zeros (read in big chunks: the data lives only in scattered
/// 1 MiB pieces, so this stays fast), the bytes around it exactly, each
/// offload call is at most 1 GiB, and st_blocks shows the hole or the
/// allocation.
pub fn zero_big(kind: StorageKind) {
    let size = GIB + 256 * MIB;
    let s = Scratch::new(kind, size);
    let path = s.path().to_owned();
    let p = open_probe(&path);
    let t = &p.target;
    let cases = [
        ("to EOF", TRIM, 3 * MIB + 5 * 4096 + 1234, size),
        ("inside", NO_TRIM, 2 * MIB + 17, size - 5 * MIB + 1),
    ];
    for (i, (name, flags, off, end)) in cases.into_iter().enumerate() {
        let what = format!("{kind}: big {name} {off}..{end} {}", flags_name(flags));
        let len = end - off;
        assert!(len > GIB);
        let seed = 7 + i as u64;
        write_pattern(&path, 0, 8 * MIB, seed);
        let mut k = 8 * MIB;
        while k + 9 * MIB < size {
            write_pattern(&path, k, MIB, seed);
            k += 64 * MIB;
        }
        write_pattern(&path, size - 8 * MIB, 8 * MIB, seed);
        let before = s.allocated();
        p.rec.take();
        let out = t
            .zero(off, len, flags)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let calls = p.rec.take();

        check_pattern(&path, 0, off, seed);
        check_zero(&path, off, len);
        if end < size {
            check_pattern(&path, end, size - end, seed);
        }

        let main = expected_zero_method(kind, flags.may_trim);
        let main = if kind == StorageKind::LoopTmpfs && i > 0 {
            Method::ZeroRange
        } else {
            main
        };
        assert!(
            out.methods.contains(&main),
            "{what}: expected {main}, used {:?}",
            out.methods
        );
        let kinds = method_call_kinds(main);
        let offload: Vec<&Call> = calls
            .iter()
            .filter(|c| c.ok && kinds.contains(&c.kind))
            .collect();
        assert!(
            offload.len() >= 2,
            "{what}: {} bytes in {} call(s): more than 1 GiB per syscall",
            len,
            offload.len()
        );
        for c in &offload {
            assert!(c.len <= GIB, "{what}: one call of {} bytes", c.len);
        }

        let after = s.allocated();
        let outside = off + (size - end);
        if flags.may_trim && punch_frees(kind) {
            assert!(
                after <= outside + 2 * MIB,
                "{what}: allocation {before} -> {after}: the range should be a hole"
            );
        } else {
            assert!(
                after + SLACK >= len,
                "{what}: allocation {before} -> {after}: the range should stay allocated"
            );
        }
    }
}
per_kind!(zero_big:
    tmpfs => Tmpfs,
    ext4 => Ext4,
    xfs => Xfs,
    btrfs => Btrfs,
    nfs42 => Nfs42,
    loop512 => Loop512,
    loop4k => Loop4k,
    loop_tmpfs => LoopTmpfs,
);

/// The write-zeros fallback over many chunks with short writes: every chunk
/// advances, no byte is zeroed twice or skipped (nbdkit and the reference
/// nbd-server both shipped a loop that zeroed its first chunk over and over).
pub fn write_zeros_advances(kind: StorageKind) {
    const SIZE: u64 = 96 * MIB;
    let s = Scratch::new(kind, SIZE);
    let path = s.path().to_owned();
    let p = open_probe(&path);
    // Force the last method of the chain on every kind.
    fail_always(
        &p.fault,
        &[
            PUNCH,
            ZERO_RANGE_KINDS[0],
            ZERO_RANGE_KINDS[1],
            CallKind::BlkZeroout,
            CallKind::Fallocate(rawdisk_storage::sys::FallocMode::Allocate),
            CallKind::Fallocate(rawdisk_storage::sys::FallocMode::AllocateKeepSize),
        ],
        libc::EOPNOTSUPP,
    );
    let t = &p.target;
    for (j, short) in [0usize, 1 << 20, 4097].into_iter().enumerate() {
        p.fault.set_max_io(short);
        let seed = 40 + j as u64;
        write_pattern(&path, 0, SIZE, seed);
        let (off, len) = (MIB + 4096 * 3 + 7 * j as u64, 80 * MIB + 11);
        p.rec.take();
        let out = t.zero(off, len, NO_TRIM).unwrap();
        let calls = p.rec.take();
        assert_eq!(out.methods, vec![Method::WriteZeros], "{kind}");
        assert_tiles(
            &calls,
            &[CallKind::Pwrite, CallKind::PwriteDsync],
            off,
            len,
            // Bounded chunks from one shared buffer: no write of the whole range.
            64 * MIB,
        );
        p.fault.set_max_io(0);
        check_pattern(&path, 0, off, seed);
        check_zero(&path, off, len);
        check_pattern(&path, off + len, SIZE - off - len, seed);
    }
}
per_kind!(write_zeros_advances:
    tmpfs => Tmpfs,
    ramfs => Ramfs,
    ext4 => Ext4,
    nfs3 => Nfs3,
    nfs42 => Nfs42,
    loop4k => Loop4k,
);

/// tmpfs, no trim: the first zero only learns that ZERO_RANGE is missing and
/// writes; the next big ones are split between punch-alloc and writing and
/// timed until each has done KEEP_ZERO_SAMPLE bytes; from then on only the
/// cheaper way is used, and a fast-only zero is served exactly when that way
/// is punch-alloc. Every byte is checked after each step, and the allocation
/// stays.
#[test]
#[ignore = "needs root"]
fn tmpfs_no_trim_zero_times_both_ways() {
    use rawdisk_storage::{KeepZero, KEEP_ZERO_SAMPLE};
    const SIZE: u64 = 256 * MIB;
    let s = Scratch::new(StorageKind::Tmpfs, SIZE);
    let path = s.path().to_owned();
    let p = open_probe(&path);
    let t = &p.target;
    write_pattern(&path, 0, SIZE, 61);
    let mut want = pattern_vec(61, 0, SIZE as usize);
    let zero = |off: u64, len: u64, flags: ZeroFlags, want: &mut Vec<u8>| {
        let r = t.zero(off, len, flags);
        if r.is_ok() {
            want[off as usize..(off + len) as usize].fill(0);
        }
        assert_same(
            &format!("zero {off}+{len} {flags:?}"),
            0,
            &read_all(&path),
            want,
        );
        r
    };

    let out = zero(MIB, 16 * MIB, NO_TRIM, &mut want).unwrap();
    assert_eq!(out.methods, vec![Method::WriteZeros]);
    assert_tri(t, Method::ZeroRange, Tri::Fails, "tmpfs");
    assert_eq!(t.caps().keep_zero(), KeepZero::Unknown);

    // Below the split size: written, no sample.
    let out = zero(20 * MIB, 4 * MIB, NO_TRIM, &mut want).unwrap();
    assert_eq!(out.methods, vec![Method::WriteZeros]);
    assert_eq!(t.caps().keep_zero(), KeepZero::Unknown);
    // Not fast yet: refused, nothing changed.
    let fast = ZeroFlags {
        may_trim: false,
        fast_only: true,
    };
    let e = zero(30 * MIB, 8 * MIB, fast, &mut want).unwrap_err();
    assert_eq!(e.errno(), Some(libc::ENOTSUP), "{e}");

    // One 2 * KEEP_ZERO_SAMPLE zero is half of each: the trial decides.
    let n = 2 * KEEP_ZERO_SAMPLE;
    let out = zero(40 * MIB + 4096, n, NO_TRIM, &mut want).unwrap();
    assert_eq!(out.methods, vec![Method::PunchAlloc, Method::WriteZeros]);
    let v = t.caps().keep_zero();
    assert_ne!(v, KeepZero::Unknown);
    let chosen = match v {
        KeepZero::PunchAlloc => Method::PunchAlloc,
        _ => Method::WriteZeros,
    };

    // Decided: one way only, and fast-only follows the verdict.
    let out = zero(180 * MIB + 333, 40 * MIB, NO_TRIM, &mut want).unwrap();
    assert_eq!(out.methods, vec![chosen]);
    let r = zero(230 * MIB, 8 * MIB, fast, &mut want);
    match v {
        KeepZero::PunchAlloc => assert_eq!(r.unwrap().methods, vec![Method::PunchAlloc]),
        _ => assert_eq!(r.unwrap_err().errno(), Some(libc::ENOTSUP)),
    }
    assert!(t.can_fast_zero(), "punching with trim is still fast");
    // Another handle on the same file shares the verdict.
    assert_eq!(open(&path).caps().keep_zero(), v);
    assert!(
        s.allocated() + SLACK >= SIZE,
        "no-trim zeros must keep the space allocated: {} of {SIZE}",
        s.allocated()
    );
}

/// tmpfs, no trim, once the chain is down to punch-alloc or writing: a hole
/// already reads as zeros and is only allocated (fallocate KEEP_SIZE), the
/// data between holes goes through the chain. Every byte of the file is
/// checked, the size is kept, and the range stays allocated.
#[test]
#[ignore = "needs root"]
fn tmpfs_no_trim_zero_allocates_holes_and_zeroes_data() {
    const SIZE: u64 = 64 * MIB;
    let s = Scratch::new(StorageKind::Tmpfs, SIZE);
    let path = s.path().to_owned();
    let t = open(&path);
    let mut want = vec![0u8; SIZE as usize];
    for (off, len, seed) in [(8 * MIB, 8 * MIB, 71), (40 * MIB + 4096, 4 * MIB, 72)] {
        write_pattern(&path, off, len, seed);
        want[off as usize..(off + len) as usize].copy_from_slice(&pattern_vec(
            seed,
            off,
            len as usize,
        ));
    }
    // A bit of data at the very end, outside every request below.
    write_pattern(&path, SIZE - 4096, 4096, 73);
    want[(SIZE - 4096) as usize..].copy_from_slice(&pattern_vec(73, SIZE - 4096, 4096));
    // The first no-trim zero learns that WRITE_ZEROES and ZERO_RANGE are
    // missing; it is over data, so it writes.
    let out = t.zero(9 * MIB, 4096, NO_TRIM).unwrap();
    assert_eq!(out.methods, vec![Method::WriteZeros]);
    want[(9 * MIB) as usize..(9 * MIB + 4096) as usize].fill(0);
    assert_tri(&t, Method::ZeroRange, Tri::Fails, "tmpfs");

    let (off, len) = (2 * MIB + 333, 56 * MIB);
    let before = s.allocated();
    let out = t.zero(off, len, NO_TRIM).unwrap();
    want[off as usize..(off + len) as usize].fill(0);
    assert!(
        out.methods.contains(&Method::Fallocate),
        "{:?}",
        out.methods
    );
    assert!(
        out.methods
            .iter()
            .any(|m| [Method::PunchAlloc, Method::WriteZeros].contains(m)),
        "the data between the holes is zeroed through the chain: {:?}",
        out.methods
    );
    assert_same("zero over holes and data", 0, &read_all(&path), &want);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), SIZE, "size kept");
    assert!(
        s.allocated() + SLACK >= before + len - 12 * MIB,
        "no-trim zeros keep the range allocated: {} before, {} after",
        before,
        s.allocated()
    );
}
