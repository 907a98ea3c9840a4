//! `copy` between two files of one btrfs (reflink), one nfs42 mount
//! (server-side COPY) and one nfs3 mount (no offload but the kernel's
//! page-cache copy): every byte compared, and on the NFS-like kinds what
//! the "server" received (docs/capabilities.md, Copy offload).

use std::os::unix::fs::FileExt;
use std::path::Path;

use rawdisk_image::copy::{self, CopyOptions, CopyStats};
use rawdisk_testkit::{pattern, shared_bytes, Fs, FsKind, MIB};

const SIZE: u64 = 24 * MIB;
/// Data runs of the source; the rest is holes, and 2 MiB of explicit zeros.
const RUNS: [(u64, u64); 3] = [(0, MIB), (5 * MIB, 3 * MIB), (20 * MIB, 2 * MIB)];
const DATA: u64 = 6 * MIB;

fn make_source(path: &Path) -> Vec<u8> {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(SIZE).unwrap();
    let mut want = vec![0u8; SIZE as usize];
    for (i, (off, len)) in RUNS.into_iter().enumerate() {
        let r = off as usize..(off + len) as usize;
        pattern(i as u64 + 1, off, &mut want[r.clone()]);
        f.write_all_at(&want[r], off).unwrap();
    }
    f.write_all_at(&vec![0u8; 2 * MIB as usize], 12 * MIB)
        .unwrap();
    f.sync_all().unwrap();
    want
}

fn copy_to(src: &Path, dst: &Path, sparse_size: u64) -> CopyStats {
    let _ = std::fs::remove_file(dst);
    let o = CopyOptions {
        requests: 4,
        sparse_size,
        ..Default::default()
    };
    copy::copy(src.to_str().unwrap(), dst.to_str().unwrap(), &o).unwrap()
}

#[track_caller]
fn check_bytes(dst: &Path, want: &[u8], what: &str) {
    let got = std::fs::read(dst).unwrap();
    assert_eq!(got.len(), want.len(), "{what}: size");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: first difference at offset {i}");
    }
}

#[test]
#[ignore = "needs root"]
fn btrfs_reflinks_the_data() {
    let fs = Fs::btrfs(128 * MIB);
    let (src, dst) = (fs.path("src.img"), fs.path("dst.img"));
    let want = make_source(&src);
    for sparse in [4096, 0] {
        let st = copy_to(&src, &dst, sparse);
        let what = format!("btrfs -S {sparse}");
        check_bytes(&dst, &want, &what);
        assert!(st.bytes_reflinked >= DATA, "{what}: {st:?}");
        assert_eq!(st.bytes_read, 0, "{what}: {st:?}");
        assert!(shared_bytes(&dst) >= DATA, "{what}: not shared");
    }
}

/// nfs42: with the zero scan off the data runs are one server-side COPY
/// each and nothing crosses the wire; with it, read and written.
/// nfs3: no COPY: copy_file_range is the kernel's page-cache copy of every
/// byte (nfs3 reports no holes), so the default zero scan writes less.
#[test]
#[ignore = "needs root"]
fn nfs_like_copies_as_the_client_can() {
    for kind in [FsKind::Nfs42, FsKind::Nfs3] {
        if let Some(why) = kind.unavailable() {
            eprintln!("{kind} skipped: {why}");
            continue;
        }
        let fs = Fs::new(kind, 128 * MIB);
        let c = fs.nfs_counts().unwrap();
        let (src, dst) = (fs.path("src.img"), fs.path("dst.img"));
        let want = make_source(&src);

        let (w0, cp0) = (c.get("write_bytes"), c.get("copy_bytes"));
        let st = copy_to(&src, &dst, 0);
        let what = format!("{kind} -S 0");
        check_bytes(&dst, &want, &what);
        let (written, copied) = (c.get("write_bytes") - w0, c.get("copy_bytes") - cp0);
        assert_eq!(st.bytes_reflinked, 0, "{what}: {st:?}");
        if kind == FsKind::Nfs42 {
            assert_eq!(copied, DATA + 2 * MIB, "{what}: server-side copy {st:?}");
            assert!(written < MIB, "{what}: {written} bytes written");
        } else {
            assert_eq!(copied, 0, "{what}: no COPY on NFS 3");
            assert!(written >= SIZE, "{what}: the kernel copies every byte");
        }

        let (w0, cp0) = (c.get("write_bytes"), c.get("copy_bytes"));
        let st = copy_to(&src, &dst, 4096);
        let what = format!("{kind} -S 4096");
        check_bytes(&dst, &want, &what);
        assert_eq!(c.get("copy_bytes"), cp0, "{what}: {st:?}");
        let written = c.get("write_bytes") - w0;
        assert!(
            (DATA..DATA + MIB).contains(&written),
            "{what}: {written} bytes written"
        );
    }
}
