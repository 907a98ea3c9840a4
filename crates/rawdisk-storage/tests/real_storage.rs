//! The storage engine on real storage the tests mount and attach themselves
//! (tmpfs, ramfs, ext4, XFS, btrfs, the NFS-like nfs3 and nfs42, loop
//! devices with 512 and 4096-byte sectors, a loop device on tmpfs that
//! loses its write-zeroes offload at run time).
//!
//! Everything here needs root and is `#[ignore = "needs root"]`; the suite
//! runs it with `--include-ignored` as root. One test binary, so the
//! workspace links it once.

#[path = "real_storage/common.rs"]
mod common;
#[path = "real_storage/extents.rs"]
mod extents;
#[path = "real_storage/faults.rs"]
mod faults;
#[path = "real_storage/misc.rs"]
mod misc;
#[path = "real_storage/model.rs"]
mod model;
#[path = "real_storage/offload.rs"]
mod offload;
#[path = "real_storage/prealloc.rs"]
mod prealloc;
#[path = "real_storage/trim.rs"]
mod trim;
#[path = "real_storage/write_zeroes.rs"]
mod write_zeroes;
#[path = "real_storage/zero.rs"]
mod zero;

/// One `#[test]` per storage kind calling `$module::$func(kind)`, named
/// `$module::$func::<kind>` so a failure names the storage. A kind this
/// machine cannot build (no /dev/fuse) says so in one line and returns.
#[macro_export]
macro_rules! per_kind {
    ($func:ident: $($name:ident => $kind:ident),+ $(,)?) => {
        mod $func {
            $(
                #[test]
                #[ignore = "needs root"]
                fn $name() {
                    let kind = rawdisk_testkit::StorageKind::$kind;
                    if let Some(why) = kind.unavailable() {
                        eprintln!("{kind} skipped: {why}");
                        return;
                    }
                    super::$func(kind)
                }
            )+
        }
    };
    ($func:ident) => {
        $crate::per_kind!($func:
            tmpfs => Tmpfs,
            ramfs => Ramfs,
            ext4 => Ext4,
            xfs => Xfs,
            btrfs => Btrfs,
            nfs3 => Nfs3,
            nfs42 => Nfs42,
            loop512 => Loop512,
            loop4k => Loop4k,
            loop_tmpfs => LoopTmpfs,
        );
    };
}
