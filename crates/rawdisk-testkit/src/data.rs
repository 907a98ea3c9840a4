//! Data helpers: the deterministic [`pattern`], writing and checking it,
//! zero checks, buffer comparison, allocation and the page cache.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `buf` with the deterministic pseudo-random bytes that live at
/// `offset..offset+buf.len()` for `seed`. A byte depends only on the seed and
/// its absolute offset, so any range can be regenerated for checking. Every
/// 8-byte aligned word has its lowest bit set, so no aligned word reads as zero.
pub fn pattern(seed: u64, offset: u64, buf: &mut [u8]) {
    let key = splitmix64(seed ^ 0x5241_5744_4953_4B21);
    let mut pos = 0usize;
    let mut off = offset;
    while pos < buf.len() {
        let word = splitmix64(key ^ (off / 8)) | 1;
        let bytes = word.to_le_bytes();
        let start = (off % 8) as usize;
        let n = (8 - start).min(buf.len() - pos);
        buf[pos..pos + n].copy_from_slice(&bytes[start..start + n]);
        pos += n;
        off += n as u64;
    }
}

/// [`pattern`] as a new vector.
pub fn pattern_vec(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    pattern(seed, offset, &mut v);
    v
}

const CHUNK: usize = 8 << 20;

fn open_rw(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

fn open_ro(path: &Path) -> File {
    File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

/// Writes the [`pattern`] of `seed` over `offset..offset+len` of a file or
/// device (in 8 MiB chunks) and syncs it.
pub fn write_pattern(path: &Path, offset: u64, len: u64, seed: u64) {
    let f = open_rw(path);
    let mut buf = vec![0u8; CHUNK.min(len as usize)];
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(buf.len() as u64) as usize;
        pattern(seed, offset + done, &mut buf[..n]);
        f.write_all_at(&buf[..n], offset + done)
            .unwrap_or_else(|e| {
                panic!(
                    "write {} at {} length {n}: {e}",
                    path.display(),
                    offset + done
                )
            });
        done += n as u64;
    }
    f.sync_all()
        .unwrap_or_else(|e| panic!("fsync {}: {e}", path.display()));
}

/// Writes `data` at `offset` of a file or device and syncs it.
pub fn write_at(path: &Path, offset: u64, data: &[u8]) {
    let f = open_rw(path);
    f.write_all_at(data, offset).unwrap_or_else(|e| {
        panic!(
            "write {} at {offset} length {}: {e}",
            path.display(),
            data.len()
        )
    });
    f.sync_all()
        .unwrap_or_else(|e| panic!("fsync {}: {e}", path.display()));
}

/// Reads `len` bytes at `offset`; panics on a short read.
pub fn read_range(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let f = open_ro(path);
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset)
        .unwrap_or_else(|e| panic!("read {} at {offset} length {len}: {e}", path.display()));
    buf
}

/// Size of a file or block device (seeking to the end works for both).
pub fn size_of(path: &Path) -> u64 {
    let mut f = open_ro(path);
    f.seek(SeekFrom::End(0))
        .unwrap_or_else(|e| panic!("seek end of {}: {e}", path.display()))
}

/// The whole content of a file or block device.
pub fn read_all(path: &Path) -> Vec<u8> {
    let size = size_of(path);
    read_range(path, 0, size as usize)
}

/// Offset of the first byte where `a` and `b` differ (or where the shorter ends).
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    let n = a.len().min(b.len());
    // Compare word-sized blocks first: this runs over gigabytes in the tests.
    let mut i = 0;
    while i + 4096 <= n {
        if a[i..i + 4096] != b[i..i + 4096] {
            break;
        }
        i += 4096;
    }
    while i < n {
        if a[i] != b[i] {
            return Some(i);
        }
        i += 1;
    }
    if a.len() != b.len() {
        Some(n)
    } else {
        None
    }
}

/// Panics naming the first differing offset (`base` + index) and the bytes there.
#[track_caller]
pub fn assert_same(what: &str, base: u64, actual: &[u8], expected: &[u8]) {
    if let Some(i) = first_difference(actual, expected) {
        let show = |v: &[u8]| {
            let end = (i + 16).min(v.len());
            format!("{:02x?}", &v[i.min(end)..end])
        };
        panic!(
            "{what}: first difference at offset {} (index {i}; lengths {} vs {}): actual {} expected {}",
            base + i as u64,
            actual.len(),
            expected.len(),
            show(actual),
            show(expected)
        );
    }
}

/// Offset of the first non-zero byte of `buf`, if any.
pub fn first_nonzero(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    let zero = [0u8; 4096];
    while i + 4096 <= buf.len() {
        if buf[i..i + 4096] != zero {
            break;
        }
        i += 4096;
    }
    buf[i..].iter().position(|b| *b != 0).map(|p| i + p)
}

/// Checks that `offset..offset+len` reads as zeros, in 8 MiB reads; panics with
/// the first non-zero offset.
#[track_caller]
pub fn check_zero(path: &Path, offset: u64, len: u64) {
    if let Some(at) = find_nonzero(path, offset, len) {
        let b = read_range(path, at, 16.min((offset + len - at) as usize));
        panic!(
            "{}: range {offset}+{len} should read as zeros; first non-zero byte at offset {at}: {b:02x?}",
            path.display()
        );
    }
}

/// The first non-zero offset in `offset..offset+len`, read in 8 MiB chunks.
pub fn find_nonzero(path: &Path, offset: u64, len: u64) -> Option<u64> {
    let mut found = None;
    for_each_chunk(path, offset, len, |at, data| {
        found = first_nonzero(data).map(|i| at + i as u64);
        found.is_none()
    });
    found
}

/// Reads `offset..offset+len` in 8 MiB chunks, handing each (its offset,
/// its bytes) to `f` until `f` returns false; panics naming a failed read.
fn for_each_chunk(path: &Path, offset: u64, len: u64, mut f: impl FnMut(u64, &[u8]) -> bool) {
    let file = open_ro(path);
    let mut buf = vec![0u8; CHUNK.min(len as usize)];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(buf.len() as u64) as usize;
        let at = offset + done;
        file.read_exact_at(&mut buf[..n], at)
            .unwrap_or_else(|e| panic!("read {} at {at} length {n}: {e}", path.display()));
        if !f(at, &buf[..n]) {
            return;
        }
        done += n as u64;
    }
}

/// Checks that `offset..offset+len` holds the [`pattern`] of `seed`; panics
/// with the first differing offset.
#[track_caller]
pub fn check_pattern(path: &Path, offset: u64, len: u64, seed: u64) {
    let mut want = vec![0u8; CHUNK.min(len as usize)];
    for_each_chunk(path, offset, len, |at, data| {
        let want = &mut want[..data.len()];
        pattern(seed, at, want);
        assert_same(
            &format!("{}: pattern {seed} in {offset}+{len}", path.display()),
            at,
            data,
            want,
        );
        true
    });
}

/// Allocated bytes of a file (`st_blocks * 512`).
pub fn allocated_bytes(path: &Path) -> u64 {
    let m = std::fs::metadata(path).unwrap_or_else(|e| panic!("stat {}: {e}", path.display()));
    m.blocks() * 512
}

/// Bytes of a file in extents FIEMAP flags as shared with another file
/// (reflinked), from `filefrag -v`.
pub fn shared_bytes(path: &Path) -> u64 {
    let out = crate::run("filefrag", [std::ffi::OsStr::new("-v"), path.as_os_str()]);
    // "File size of F is N (B blocks of S bytes)"
    let block: u64 = out
        .split("blocks of ")
        .nth(1)
        .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no block size in filefrag output: {out}"));
    // " 1:  257..  1024:  281..  1048:  768:  2329: shared"
    out.lines()
        .filter(|l| {
            l.split(':')
                .next()
                .is_some_and(|n| n.trim().parse::<u64>().is_ok())
        })
        .filter(|l| l.contains("shared"))
        .map(|l| {
            let len = l
                .split(':')
                .nth(3)
                .map(str::trim)
                .and_then(|n| n.parse::<u64>().ok());
            len.unwrap_or_else(|| panic!("unexpected filefrag line: {l}")) * block
        })
        .sum::<u64>()
}

/// Syncs a file or device and drops its clean pages from the page cache, so
/// the next read comes from the file system / device (posix_fadvise DONTNEED).
pub fn drop_cache(path: &Path) {
    let f = open_ro(path);
    f.sync_all()
        .unwrap_or_else(|e| panic!("fsync {}: {e}", path.display()));
    // SAFETY: f is an open descriptor owned for the duration of the call.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(
        r,
        0,
        "posix_fadvise(DONTNEED) on {}: errno {r}",
        path.display()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunked checks see a byte in a later chunk and at the very end.
    #[test]
    fn chunked_checks_find_the_first_difference() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let len = 2 * CHUNK as u64 + 100;
        std::fs::File::create(&p).unwrap().set_len(len).unwrap();
        assert_eq!(find_nonzero(&p, 0, len), None);
        write_at(&p, CHUNK as u64 + 5, &[1]);
        write_at(&p, len - 1, &[2]);
        assert_eq!(find_nonzero(&p, 0, len), Some(CHUNK as u64 + 5));
        assert_eq!(
            find_nonzero(&p, CHUNK as u64 + 6, len - CHUNK as u64 - 6),
            Some(len - 1)
        );
        write_pattern(&p, 0, len, 9);
        check_pattern(&p, 0, len, 9);
        write_at(&p, len - 1, &[!pattern_vec(9, len - 1, 1)[0]]);
        let r = std::panic::catch_unwind(|| check_pattern(&p, 0, len, 9));
        assert!(r.is_err(), "a changed last byte must fail check_pattern");
    }

    #[test]
    fn pattern_depends_on_offset_only() {
        let whole = pattern_vec(7, 1000, 100);
        for start in 0..20 {
            let part = pattern_vec(7, 1000 + start, 30);
            assert_eq!(&part[..], &whole[start as usize..start as usize + 30]);
        }
        assert_ne!(pattern_vec(7, 0, 64), pattern_vec(8, 0, 64));
        assert!(first_nonzero(&pattern_vec(1, 0, 1 << 20)).is_some());
    }

    #[test]
    fn difference_helpers() {
        let a = vec![0u8; 10000];
        let mut b = a.clone();
        assert_eq!(first_difference(&a, &b), None);
        b[9000] = 1;
        assert_eq!(first_difference(&a, &b), Some(9000));
        assert_eq!(first_nonzero(&b), Some(9000));
        assert_eq!(first_difference(&a, &a[..5]), Some(5));
    }
}
