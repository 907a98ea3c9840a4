//! cache=none (O_DIRECT): unaligned requests, read-modify-write races, the file end.

use super::*;
use crate::DirectBackend;

#[test]
fn direct_unaligned_io_and_file_end() {
    // /tmp is ext4: O_DIRECT works, alignment from STATX_DIOALIGN (512 or
    // 4096 depending on the disk).
    let tmp = tmp_file(0);
    let t = Target::open(&tmp.path, &direct_opts()).unwrap();
    let a = t.geometry().dio_align as u64;
    assert!(a.is_power_of_two() && a >= 512, "{a}");
    assert_eq!(t.geometry().logical_sector as u64, a);
    // A write ending mid-block must not grow the file to the block end.
    let d = pattern(0, 1000);
    t.write_at(&d, 0, false).unwrap();
    assert_eq!(t.size(), 1000);
    t.write_at(&d[..10], 2 * a + 3, true).unwrap();
    assert_eq!(t.size(), 2 * a + 13);
    let mut b = vec![0u8; (2 * a + 13) as usize];
    t.read_at(&mut b, 0).unwrap();
    assert_eq!(&b[..1000], &d[..]);
    assert!(b[1000..(2 * a + 3) as usize].iter().all(|x| *x == 0));
    assert_eq!(&b[(2 * a + 3) as usize..], &d[..10]);
    // Unaligned buffer address, aligned offset and length: bounced too.
    let big = pattern(7, 3 * a as usize + 1);
    t.write_at(&big[1..], a, false).unwrap();
    let mut r = vec![0u8; 3 * a as usize + 1];
    t.read_at(&mut r[1..], a).unwrap();
    assert_eq!(&r[1..], &big[1..]);
    // Larger than one bounce buffer, unaligned both ends.
    let huge = pattern(9, (20 << 20) + 77);
    t.write_at(&huge, 12345, false).unwrap();
    let mut hr = vec![0u8; huge.len()];
    t.read_at(&mut hr, 12345).unwrap();
    assert!(hr == huge);
    // Byte before is the earlier pattern, untouched by the RMW.
    let mut one = [0u8; 1];
    t.read_at(&mut one, 12344).unwrap();
    let mut expect = vec![0u8; 12345];
    t.read_at(&mut expect, 0).unwrap();
    assert_eq!(one[0], expect[12344]);
    assert!(t.read_at(&mut [0u8; 10], t.size() - 5).is_err());
    // Zero with unaligned head/tail and preallocation under O_DIRECT.
    let sz = t.size();
    t.zero(100, sz - 200, ZeroFlags::default()).unwrap();
    let mut all = vec![1u8; sz as usize];
    t.read_at(&mut all, 0).unwrap();
    assert!(all[100..(sz - 100) as usize].iter().all(|x| *x == 0));
    assert_eq!(&all[..100], &d[..100]);
    t.preallocate(sz + 5000, Prealloc::Full).unwrap();
    assert_eq!(t.size(), sz + 5000);
}

#[test]
fn direct_concurrent_unaligned_writes_to_one_block_lose_nothing() {
    // Many threads write disjoint, unaligned byte ranges that share blocks:
    // without the range lock two read-modify-writes of the same block would
    // overwrite each other's bytes with stale data.
    let tmp = tmp_file(64 << 10);
    let t = Arc::new(Target::open(&tmp.path, &direct_opts()).unwrap());
    let threads = 8u64;
    let rounds = 200u64;
    let piece = 37u64; // odd so pieces straddle block boundaries
    let hs: Vec<_> = (0..threads)
        .map(|k| {
            let t = t.clone();
            std::thread::spawn(move || {
                for r in 0..rounds {
                    // Slot (r, k): thread k owns every threads-th piece.
                    let idx = r * threads + k;
                    let off = idx * piece;
                    let data = pattern(off, piece as usize);
                    t.write_at(&data, off, false).unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let total = threads * rounds * piece;
    let mut b = vec![0u8; total as usize];
    t.read_at(&mut b, 0).unwrap();
    let want = pattern(0, total as usize);
    let bad = b.iter().zip(&want).position(|(x, y)| x != y);
    assert_eq!(bad, None, "lost write at byte {bad:?}");
}

#[test]
fn direct_zero_racing_unaligned_writes_in_the_same_block() {
    let tmp = tmp_file(1 << 20);
    let t = Arc::new(Target::open(&tmp.path, &direct_opts()).unwrap());
    fill(&t, 1 << 20);
    let a = t.geometry().dio_align as u64;
    // In every block: bytes [0, a/2) are zeroed by one thread, [a/2, a)
    // written by another.
    let blocks = (1u64 << 20) / a;
    let tz = t.clone();
    let z = std::thread::spawn(move || {
        for i in 0..blocks {
            tz.zero(i * a, a / 2, ZeroFlags::default()).unwrap();
        }
    });
    let tw = t.clone();
    let w = std::thread::spawn(move || {
        for i in 0..blocks {
            let off = i * a + a / 2;
            tw.write_at(&pattern(off + 99, (a / 2) as usize), off, false)
                .unwrap();
        }
    });
    z.join().unwrap();
    w.join().unwrap();
    let mut b = vec![0u8; 1 << 20];
    t.read_at(&mut b, 0).unwrap();
    for i in 0..blocks {
        let s = (i * a) as usize;
        let h = (a / 2) as usize;
        assert!(b[s..s + h].iter().all(|x| *x == 0), "block {i}: zero lost");
        assert_eq!(
            &b[s + h..s + 2 * h],
            &pattern(i * a + a / 2 + 99, h)[..],
            "block {i}: write lost"
        );
    }
}

#[test]
fn direct_failed_write_past_the_end_leaves_the_size() {
    let tmp = tmp_file(0);
    let (t, f) = open_fault(&tmp, direct_opts());
    t.write_at(&pattern(0, 1000), 0, false).unwrap();
    assert_eq!(t.size(), 1000);
    // The read-modify-write reads the block, then the write fails: the size
    // must still be 1000 and the data intact.
    f.fail_once(CallKind::Pwrite, f.calls(CallKind::Pwrite) + 1, libc::EIO);
    let e = t.write_at(&pattern(1000, 50), 1000, false).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EIO));
    assert_eq!(t.size(), 1000);
    let mut b = vec![0u8; 1000];
    t.read_at(&mut b, 0).unwrap();
    assert_eq!(b, pattern(0, 1000));
    // FUA growth: padded block written durably, then cut and synced.
    let syncs = f.calls(CallKind::Fdatasync);
    t.write_at(&pattern(1000, 50), 1000, true).unwrap();
    assert_eq!(t.size(), 1050);
    assert_eq!(f.calls(CallKind::Fdatasync), syncs + 1);
    let mut b = vec![0u8; 1050];
    t.read_at(&mut b, 0).unwrap();
    assert_eq!(b, pattern(0, 1050));
}

/// Reaps until nothing is in flight (the test's files are small and local).
fn reap_all<T>(q: &mut crate::DirectQueue<T>) -> Vec<crate::DirectDone<T>> {
    let mut out = Vec::new();
    for _ in 0..10_000 {
        q.reap(&mut out, false).unwrap();
        if q.in_flight() == 0 {
            return out;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("AIO requests never completed");
}

/// A read or write of `data.len()` bytes at `offset` from a buffer aligned
/// to 4096 bytes, holding `data`.
fn aligned_op<T>(write: bool, offset: u64, data: &[u8], tag: T) -> crate::DirectOp<T> {
    let mut v = vec![0u8; data.len() + 4096];
    let start = v.as_ptr().align_offset(4096);
    v[start..start + data.len()].copy_from_slice(data);
    crate::DirectOp {
        write,
        offset,
        buf: v,
        start,
        len: data.len(),
        tag,
    }
}

/// A queue through `b`, which this kernel must give.
fn queue<T>(t: &Arc<Target>, depth: usize, b: DirectBackend) -> crate::DirectQueue<T> {
    let q = t.direct_queue_on(depth, b).expect("a queue on this kernel");
    assert_eq!(q.backend(), b, "the kernel refused {b:?}");
    q
}

#[test]
fn direct_queue_reads_and_writes_in_flight_and_refuses_what_it_cannot() {
    direct_queue_reads_and_writes_in_flight_and_refuses_what_it_cannot_on(DirectBackend::Native);
}

#[test]
fn uring_reads_and_writes_in_flight_and_refuses_what_it_cannot() {
    direct_queue_reads_and_writes_in_flight_and_refuses_what_it_cannot_on(DirectBackend::IoUring);
}

fn direct_queue_reads_and_writes_in_flight_and_refuses_what_it_cannot_on(b: DirectBackend) {
    let a = 4096u64;
    let size = 64 * a;
    let tmp = tmp_file(size);
    let t = Arc::new(Target::open(&tmp.path, &direct_opts()).unwrap());
    let mut q = queue::<u32>(&t, 8, b);
    let op = aligned_op::<u32>;
    // Ten aligned writes on a queue of eight: two come back at once.
    let ops: Vec<_> = (0..10u32)
        .map(|i| {
            let off = i as u64 * 2 * a;
            op(true, off, &pattern(off, 2 * a as usize), i)
        })
        .collect();
    let back = q.submit(ops);
    assert_eq!(back.len(), 2, "a full queue takes no more");
    let done = reap_all(&mut q);
    assert_eq!(done.len(), 8);
    assert!(done.iter().all(|d| d.done && d.op.write));
    for d in back {
        t.write_at(&d.buf[d.start..d.start + d.len], d.offset, false)
            .unwrap();
    }
    let mut all = vec![0u8; 20 * a as usize];
    t.read_at(&mut all, 0).unwrap();
    assert!(all == pattern(0, all.len()), "written data differs");
    // Reads come back with the data; an unaligned one is refused.
    let reads = vec![
        op(false, 3 * a, &vec![0u8; a as usize], 1),
        op(false, 0, &vec![0u8; 3 * a as usize], 2),
        op(false, 5, &vec![0u8; a as usize], 3),
    ];
    let back = q.submit(reads);
    assert_eq!(back.iter().map(|o| o.tag).collect::<Vec<_>>(), vec![3]);
    for d in reap_all(&mut q) {
        assert!(d.done);
        let got = &d.op.buf[d.op.start..d.op.start + d.op.len];
        assert!(got == pattern(d.op.offset, d.op.len), "read {}", d.op.tag);
    }
    // A write past the size last seen needs the blocking path's cut.
    let past = q.submit(vec![op(true, size, &pattern(size, a as usize), 9)]);
    assert_eq!(past.len(), 1);
    assert_eq!(t.size(), size);
    // A read past the end comes back short: not done, for the blocking
    // path to report.
    let short = q.submit(vec![op(false, size - a, &vec![0u8; 2 * a as usize], 4)]);
    assert!(short.is_empty());
    let d = reap_all(&mut q);
    assert_eq!(d.len(), 1);
    assert!(!d[0].done);
}

#[test]
fn direct_queue_write_holds_its_span_until_reaped() {
    direct_queue_write_holds_its_span_until_reaped_on(DirectBackend::Native);
}

#[test]
fn uring_write_holds_its_span_until_reaped() {
    direct_queue_write_holds_its_span_until_reaped_on(DirectBackend::IoUring);
}

fn direct_queue_write_holds_its_span_until_reaped_on(b: DirectBackend) {
    // A read-modify-write of a block an AIO write is writing would put the
    // old bytes back: the span stays locked from submit to reap, and a
    // second write of the same span is refused rather than waited for.
    let a = 4096u64;
    let tmp = tmp_file(16 * a);
    let t = Arc::new(Target::open(&tmp.path, &direct_opts()).unwrap());
    let mut q = queue::<u32>(&t, 4, b);
    let mk = |tag: u32| aligned_op(true, a, &vec![tag as u8; a as usize], tag);
    let back = q.submit(vec![mk(1), mk(2)]);
    assert_eq!(back.iter().map(|o| o.tag).collect::<Vec<_>>(), vec![2]);
    let done = reap_all(&mut q);
    assert!(done.len() == 1 && done[0].done);
    // Reaped: the span is free again, for the queue and for a blocking
    // unaligned write (which would wait forever on a leaked span).
    t.write_at(&[7u8; 10], a + 100, false).unwrap();
    assert!(q.submit(vec![mk(3)]).is_empty());
    reap_all(&mut q);
    let mut b = vec![0u8; a as usize];
    t.read_at(&mut b, a).unwrap();
    assert!(b.iter().all(|x| *x == 3));
}

#[test]
fn direct_queue_only_for_cache_none_on_the_kernel() {
    let tmp = tmp_file(1 << 20);
    let t = Arc::new(Target::open(&tmp.path, &OpenOptions::default()).unwrap());
    assert!(t.direct_queue::<()>(4).is_none(), "page cache");
    let (f, _) = open_fault(&tmp, direct_opts());
    assert!(
        Arc::new(f).direct_queue::<()>(4).is_none(),
        "an injected Sys must see every read and write"
    );
}

#[test]
fn direct_queue_reap_can_wait_instead_of_polling() {
    direct_queue_reap_can_wait_instead_of_polling_on(DirectBackend::Native);
}

#[test]
fn uring_reap_can_wait_instead_of_polling() {
    direct_queue_reap_can_wait_instead_of_polling_on(DirectBackend::IoUring);
}

fn direct_queue_reap_can_wait_instead_of_polling_on(b: DirectBackend) {
    // For a caller that lost its eventfd: each waiting reap returns at
    // least one completion, so at most as many calls as ops in flight.
    let a = 4096u64;
    let tmp = tmp_file(16 * a);
    let t = Arc::new(Target::open(&tmp.path, &direct_opts()).unwrap());
    let mut q = queue::<u64>(&t, 8, b);
    let ops = (0..6u64)
        .map(|i| aligned_op(true, i * a, &pattern(i * a, a as usize), i))
        .collect();
    assert!(q.submit(ops).is_empty());
    let mut done = Vec::new();
    for _ in 0..6 {
        q.reap(&mut done, true).unwrap();
        if q.in_flight() == 0 {
            break;
        }
    }
    assert_eq!(q.in_flight(), 0);
    assert_eq!(done.len(), 6);
    assert!(done.iter().all(|d| d.done));
    // Reaped, so the spans are free: an unaligned blocking write (a
    // read-modify-write, which would wait forever on a leaked span).
    t.write_at(&[7u8; 10], a + 100, false).unwrap();
    // Nothing in flight: a waiting reap returns at once.
    q.reap(&mut done, true).unwrap();
    assert_eq!(done.len(), 6);
}

#[test]
fn uring_refused_falls_back_to_aio_once_for_all() {
    use crate::engine::{URING_REFUSED, URING_UNKNOWN};
    use crate::sys::refuse_next_uring;
    use std::sync::atomic::{AtomicU8, Ordering};
    let a = 4096u64;
    let tmp = tmp_file(16 * a);
    let t = Arc::new(Target::open(&tmp.path, &direct_opts()).unwrap());
    // Its own state: a refusal here must not turn io_uring off for the
    // tests running beside it.
    let state = AtomicU8::new(URING_UNKNOWN);
    // ENOMEM is this ring's trouble: Linux AIO for it, io_uring next time.
    refuse_next_uring(libc::ENOMEM);
    let q = t.direct_queue_in::<u64>(4, DirectBackend::IoUring, &state);
    assert_eq!(q.map(|q| q.backend()), Some(DirectBackend::Native));
    assert_eq!(state.load(Ordering::Relaxed), URING_UNKNOWN);
    let q = t.direct_queue_in::<u64>(4, DirectBackend::IoUring, &state);
    assert_eq!(q.map(|q| q.backend()), Some(DirectBackend::IoUring));
    // EPERM (kernel.io_uring_disabled, seccomp): Linux AIO, from now on
    // without asking the kernel again; and the fallback queue works.
    let state = AtomicU8::new(URING_UNKNOWN);
    refuse_next_uring(libc::EPERM);
    let mut q = t
        .direct_queue_in::<u64>(4, DirectBackend::IoUring, &state)
        .expect("Linux AIO");
    assert_eq!(q.backend(), DirectBackend::Native);
    assert_eq!(state.load(Ordering::Relaxed), URING_REFUSED);
    let q2 = t.direct_queue_in::<u64>(4, DirectBackend::IoUring, &state);
    assert_eq!(q2.map(|q| q.backend()), Some(DirectBackend::Native));
    assert!(q
        .submit(vec![aligned_op(true, a, &pattern(a, a as usize), 1)])
        .is_empty());
    let d = reap_all(&mut q);
    assert!(d.len() == 1 && d[0].done);
    let mut b = vec![0u8; a as usize];
    t.read_at(&mut b, a).unwrap();
    assert!(b == pattern(a, a as usize), "written data differs");
}
