//! `copy` with copy offload between local files, on file systems the tests
//! mount: XFS with reflink (extents shared, checked with FIEMAP through
//! `filefrag -v`), XFS without reflink and ext4 (copy_file_range, only with
//! the zero scan off), tmpfs -> ext4 (nothing offloaded), `--copy-offload
//! never`; and an injected EIO / EXDEV on the offload call. Every byte is
//! compared and the destination's holes are checked against the source's.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use rawdisk_image::copy::{self, CopyError, CopyOptions, CopyStats, OffloadMode, Side};
use rawdisk_image::endpoint::Endpoint;
use rawdisk_storage::fault::FaultSys;
use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{OpenOptions, Target};
use rawdisk_testkit::{pattern, shared_bytes, Fs, MIB};

const SIZE: u64 = 24 * MIB + 333;

/// Data runs (some of explicit zeros) between holes; returns the contents
/// and the bytes of non-zero data.
fn make_source(path: &Path) -> (Vec<u8>, u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(SIZE).unwrap();
    let mut want = vec![0u8; SIZE as usize];
    let mut data = 0;
    for (i, (off, len)) in [
        (0, 64 * 1024),
        (MIB, 3 * MIB + 4096),
        (6 * MIB + 8192, 512 * 1024),
        (9 * MIB, 5 * MIB),
        (24 * MIB - 65536, 65536 + 333),
    ]
    .into_iter()
    .enumerate()
    {
        let r = off as usize..(off + len) as usize;
        pattern(i as u64 + 1, off, &mut want[r.clone()]);
        data += len;
        f.write_all_at(&want[r], off).unwrap();
    }
    // Explicit zeros: allocated in the source, a hole after the zero scan.
    f.write_all_at(&vec![0u8; 2 * MIB as usize], 16 * MIB)
        .unwrap();
    f.sync_all().unwrap();
    (want, data)
}

/// The data runs of a file (SEEK_DATA / SEEK_HOLE).
fn data_map(path: &Path) -> Vec<(u64, u64)> {
    let ep = Endpoint::open(path.to_str().unwrap(), false).unwrap();
    ep.extents(0, ep.size())
        .unwrap()
        .into_iter()
        .filter(|e| e.data)
        .map(|e| (e.offset, e.len))
        .collect()
}

#[track_caller]
fn check_bytes(dst: &Path, want: &[u8], what: &str) {
    let got = std::fs::read(dst).unwrap();
    assert_eq!(got.len(), want.len(), "{what}: size");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: first difference at offset {i}");
    }
}

fn run(src: &Path, dst: &Path, o: &CopyOptions) -> CopyStats {
    let _ = std::fs::remove_file(dst);
    copy::copy(src.to_str().unwrap(), dst.to_str().unwrap(), o).unwrap()
}

fn opts(sparse_size: u64) -> CopyOptions {
    CopyOptions {
        requests: 4,
        sparse_size,
        ..Default::default()
    }
}

#[test]
#[ignore = "needs root"]
fn xfs_reflink_shares_data_extents_and_keeps_holes() {
    let fs = Fs::xfs(0);
    let (src, dst) = (fs.path("src.img"), fs.path("dst.img"));
    let (want, data) = make_source(&src);
    for sparse in [4096, 0] {
        let st = run(&src, &dst, &opts(sparse));
        let what = format!("xfs reflink -S {sparse}");
        check_bytes(&dst, &want, &what);
        // Everything but the unaligned end of the last run is shared.
        let shared = shared_bytes(&dst);
        assert!(st.bytes_reflinked >= data - 4096, "{what}: {st:?}");
        assert!(shared >= data - 4096, "{what}: {shared} bytes shared");
        assert!(st.bytes_read < 8192, "{what}: data was read: {st:?}");
        // Holes stay holes; reflinked zeros stay (shared) data.
        assert_eq!(data_map(&dst), data_map(&src), "{what}");
    }
    // Never: the ordinary path, zero runs become holes, nothing shared.
    let st = run(
        &src,
        &dst,
        &CopyOptions {
            offload: OffloadMode::Never,
            ..opts(4096)
        },
    );
    check_bytes(&dst, &want, "--copy-offload never");
    assert_eq!((st.bytes_reflinked, st.bytes_copy_range), (0, 0), "{st:?}");
    assert_eq!(st.bytes_written, data, "{st:?}");
    assert_eq!(shared_bytes(&dst), 0);
    let holes: u64 = data_map(&dst).iter().map(|r| r.1).sum();
    assert_eq!(holes, data, "never: the explicit zeros must be holes");
}

/// copy_file_range without sharing: used only with the zero scan off.
fn copy_range_fs(fs: Fs) {
    let what = fs.kind().name();
    let (src, dst) = (fs.path("src.img"), fs.path("dst.img"));
    let (want, data) = make_source(&src);
    let explicit = 2 * MIB;

    let st = run(&src, &dst, &opts(4096));
    check_bytes(&dst, &want, what);
    assert_eq!(
        (st.bytes_reflinked, st.bytes_copy_range),
        (0, 0),
        "{what}: {st:?}"
    );
    assert_eq!(st.bytes_written, data, "{what}: {st:?}");
    let mapped: u64 = data_map(&dst).iter().map(|r| r.1).sum();
    assert_eq!(mapped, data, "{what}: zero runs must become holes");

    let st = run(&src, &dst, &opts(0));
    check_bytes(&dst, &want, &format!("{what} -S 0"));
    assert_eq!(st.bytes_reflinked, 0, "{what}: {st:?}");
    assert_eq!(st.bytes_copy_range, data + explicit, "{what} -S 0: {st:?}");
    assert_eq!(st.bytes_read, 0, "{what} -S 0: {st:?}");
    assert_eq!(data_map(&dst), data_map(&src), "{what} -S 0: holes");
    assert_eq!(shared_bytes(&dst), 0, "{what}: nothing may be shared");
}

#[test]
#[ignore = "needs root"]
fn ext4_uses_copy_file_range_without_zero_scan() {
    copy_range_fs(Fs::ext4(128 * MIB));
}

#[test]
#[ignore = "needs root"]
fn xfs_without_reflink_uses_copy_file_range_without_zero_scan() {
    copy_range_fs(Fs::xfs_with(0, &["-m", "reflink=0"]));
}

#[test]
#[ignore = "needs root"]
fn tmpfs_to_ext4_takes_the_ordinary_path() {
    let (t, e) = (Fs::tmpfs(64 * MIB), Fs::ext4(128 * MIB));
    let (src, dst) = (t.path("src.img"), e.path("dst.img"));
    let (want, data) = make_source(&src);
    for sparse in [4096, 0] {
        let st = run(&src, &dst, &opts(sparse));
        let what = format!("tmpfs -> ext4 -S {sparse}");
        check_bytes(&dst, &want, &what);
        assert_eq!(
            (st.bytes_reflinked, st.bytes_copy_range),
            (0, 0),
            "{what}: {st:?}"
        );
        assert!(st.bytes_written >= data, "{what}: {st:?}");
        let mapped: u64 = data_map(&dst).iter().map(|r| r.1).sum();
        let explicit = if sparse == 0 { 2 * MIB } else { 0 };
        assert_eq!(mapped, data + explicit, "{what}: holes");
    }
}

/// A copy into `dst` (already SIZE bytes, zero) through a FaultSys.
fn copy_with_faults(src: &Path, dst: &Path, fault: Arc<FaultSys>) -> copy::Result<CopyStats> {
    let s = Endpoint::open(src.to_str().unwrap(), false).unwrap();
    let t = Target::open_with_sys(dst, &OpenOptions::default(), fault).unwrap();
    let d = Endpoint::Local {
        path: dst.to_path_buf(),
        target: Arc::new(t),
    };
    copy::copy_endpoints(&s, &d, &opts(0), true)
}

#[test]
fn injected_offload_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (dir.path().join("src.img"), dir.path().join("dst.img"));
    let (want, _) = make_source(&src);
    // EIO on the first FICLONERANGE: the copy fails naming it; nothing falls
    // through to copy_file_range.
    std::fs::File::create(&dst).unwrap().set_len(SIZE).unwrap();
    let fault = FaultSys::real();
    fault.fail_from(CallKind::CloneRange, 1, libc::EIO);
    let e = copy_with_faults(&src, &dst, fault.clone()).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            CopyError::Io {
                side: Side::Destination,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("FICLONERANGE") && msg.contains("offset"),
        "{msg}"
    );
    assert!(msg.contains("Input/output error"), "{msg}");
    assert_eq!(fault.calls(CallKind::CopyFileRange), 0, "EIO fell through");

    // EXDEV on both: the ordinary path copies everything.
    for errno in [libc::EXDEV, libc::EOPNOTSUPP] {
        std::fs::remove_file(&dst).unwrap();
        std::fs::File::create(&dst).unwrap().set_len(SIZE).unwrap();
        let fault = FaultSys::real();
        fault.fail_from(CallKind::CloneRange, 1, errno);
        fault.fail_from(CallKind::CopyFileRange, 1, errno);
        let st = copy_with_faults(&src, &dst, fault.clone()).unwrap();
        assert_eq!((st.bytes_reflinked, st.bytes_copy_range), (0, 0), "{st:?}");
        check_bytes(&dst, &want, &format!("errno {errno}"));
        // Learned once per pair: at most one call per worker in flight.
        assert!(
            fault.calls(CallKind::CloneRange) <= 4,
            "{:?}",
            fault.counts()
        );
        assert!(
            fault.calls(CallKind::CopyFileRange) <= 4,
            "{:?}",
            fault.counts()
        );
    }
}
