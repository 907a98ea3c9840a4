//! Unit tests on temporary files under /tmp (ext4 on the CI machine), most
//! through [`FaultSys`] so errors the disk cannot produce can be injected.
//! The real-storage matrix (tmpfs, ramfs, XFS, loop devices) is in tests/.

use std::sync::Arc;

use rand::{Rng, SeedableRng};

use crate::fault::FaultSys;
use crate::sys::{CallKind, FallocMode, RealSys, Sys};
use crate::{CacheMode, ExtentKind, Kind, Method, OpenOptions, Prealloc, Target, Tri, ZeroFlags};

mod cbt;
mod cbt_damage;
mod cbt_ids;
mod direct;
mod flush;
mod kinds;
mod map;
mod model;
mod probe;
mod rw;
mod space;
mod zero;

const PUNCH: CallKind = CallKind::Fallocate(FallocMode::PunchHole);
const ZRANGE: CallKind = CallKind::Fallocate(FallocMode::ZeroRange { keep_size: true });
const ALLOC: CallKind = CallKind::Fallocate(FallocMode::Allocate);
/// Zero, trimming where the storage can (NBD_CMD_WRITE_ZEROES without NO_HOLE).
const TRIM: ZeroFlags = ZeroFlags {
    may_trim: true,
    fast_only: false,
};

struct Tmp {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
}

fn tmp_file(size: u64) -> Tmp {
    let dir = tempfile::Builder::new()
        .prefix("rawdisk-storage-unit-")
        .tempdir_in("/tmp")
        .unwrap();
    let path = dir.path().join("img");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(size).unwrap();
    Tmp { _dir: dir, path }
}

/// Deterministic non-zero pattern keyed by absolute offset.
fn pattern(off: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = off + i;
            ((x ^ (x >> 8) ^ (x >> 16)) as u8) | 1
        })
        .collect()
}

fn open_fault(t: &Tmp, opts: OpenOptions) -> (Target, Arc<FaultSys>) {
    let f = FaultSys::real();
    let target = Target::open_with_sys(&t.path, &opts, f.clone()).unwrap();
    (target, f)
}

fn fill(t: &Target, size: u64) {
    t.write_at(&pattern(0, size as usize), 0, false).unwrap();
}

/// Assert [off, off+len) is zero and everything else in [0, size) still
/// holds the pattern.
fn check_zeroed(t: &Target, size: u64, off: u64, len: u64) {
    let mut all = vec![0u8; size as usize];
    t.read_at(&mut all, 0).unwrap();
    let want_pat = pattern(0, size as usize);
    for (i, b) in all.iter().enumerate() {
        let i64_ = i as u64;
        if i64_ >= off && i64_ < off + len {
            assert_eq!(
                *b, 0,
                "byte {i} in the zeroed range [{off}, +{len}) is not zero"
            );
        } else {
            assert_eq!(
                *b, want_pat[i],
                "byte {i} outside the zeroed range [{off}, +{len}) changed"
            );
        }
    }
}

fn direct_opts() -> OpenOptions {
    OpenOptions {
        cache: CacheMode::None,
        ..Default::default()
    }
}
