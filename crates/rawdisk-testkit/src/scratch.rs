//! Parametrized storage: [`StorageKind`] and the [`Scratch`] guard, one
//! target of a given size on any kind, for tests run over all kinds.

use std::path::{Path, PathBuf};

use crate::{allocated_bytes, Fs, FsKind, LoopDev, MIB};

/// Every kind of storage the engine's tests cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageKind {
    Tmpfs,
    Ramfs,
    Ext4,
    Xfs,
    Btrfs,
    /// The NFS-like FUSE file system, NFS 3 profile (latency 0).
    Nfs3,
    /// The NFS-like FUSE file system, NFS 4.2 profile (latency 0).
    Nfs42,
    /// Loop device, 512-byte sectors, on an ext4 file.
    Loop512,
    /// Loop device, 4096-byte sectors, on an ext4 file.
    Loop4k,
    /// Loop device, 512-byte sectors, directly on a tmpfs file.
    LoopTmpfs,
}

impl StorageKind {
    pub const ALL: [StorageKind; 10] = [
        StorageKind::Tmpfs,
        StorageKind::Ramfs,
        StorageKind::Ext4,
        StorageKind::Xfs,
        StorageKind::Btrfs,
        StorageKind::Nfs3,
        StorageKind::Nfs42,
        StorageKind::Loop512,
        StorageKind::Loop4k,
        StorageKind::LoopTmpfs,
    ];

    pub fn name(self) -> &'static str {
        match self {
            StorageKind::Tmpfs => "tmpfs",
            StorageKind::Ramfs => "ramfs",
            StorageKind::Ext4 => "ext4",
            StorageKind::Xfs => "xfs",
            StorageKind::Btrfs => "btrfs",
            StorageKind::Nfs3 => "nfs3",
            StorageKind::Nfs42 => "nfs42",
            StorageKind::Loop512 => "loop512",
            StorageKind::Loop4k => "loop4k",
            StorageKind::LoopTmpfs => "loop-tmpfs",
        }
    }

    pub fn is_block(self) -> bool {
        matches!(
            self,
            StorageKind::Loop512 | StorageKind::Loop4k | StorageKind::LoopTmpfs
        )
    }

    /// The logical sector size of the device (1 for files).
    pub fn sector_size(self) -> u32 {
        match self {
            StorageKind::Loop4k => 4096,
            StorageKind::Loop512 | StorageKind::LoopTmpfs => 512,
            _ => 1,
        }
    }

    pub fn fs_kind(self) -> Option<FsKind> {
        match self {
            StorageKind::Tmpfs => Some(FsKind::Tmpfs),
            StorageKind::Ramfs => Some(FsKind::Ramfs),
            StorageKind::Ext4 => Some(FsKind::Ext4),
            StorageKind::Xfs => Some(FsKind::Xfs),
            StorageKind::Btrfs => Some(FsKind::Btrfs),
            StorageKind::Nfs3 => Some(FsKind::Nfs3),
            StorageKind::Nfs42 => Some(FsKind::Nfs42),
            _ => None,
        }
    }

    /// Whether this is one of the NFS-like kinds.
    pub fn is_nfs(self) -> bool {
        matches!(self, StorageKind::Nfs3 | StorageKind::Nfs42)
    }

    /// Why this machine cannot build the kind (see [`FsKind::unavailable`]).
    pub fn unavailable(self) -> Option<String> {
        self.fs_kind().and_then(FsKind::unavailable)
    }

    /// [`StorageKind::ALL`] less the kinds this machine cannot build, each
    /// named in one line on stderr (see [`FsKind::usable`]).
    pub fn usable() -> Vec<StorageKind> {
        crate::fs::usable(StorageKind::ALL, StorageKind::unavailable)
    }
}

impl std::fmt::Display for StorageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

enum ScratchGuard {
    Fs(Fs),
    Loop(LoopDev),
}

/// Storage of a kind plus one target on it of `size` bytes: a new sparse
/// file `disk.img` on a file system, or the loop device itself.
pub struct Scratch {
    kind: StorageKind,
    path: PathBuf,
    size: u64,
    guard: ScratchGuard,
}

impl Scratch {
    pub fn new(kind: StorageKind, size: u64) -> Scratch {
        Scratch::with_room(kind, size, size + size / 8 + 16 * MIB)
    }

    /// Like [`Scratch::new`], with a file system of `room` bytes (for targets
    /// that grow; ignored for loop devices and ramfs).
    pub fn with_room(kind: StorageKind, size: u64, room: u64) -> Scratch {
        let (guard, path) = match kind {
            StorageKind::Loop512 => {
                let d = LoopDev::new(size, 512);
                let p = d.path().to_owned();
                (ScratchGuard::Loop(d), p)
            }
            StorageKind::Loop4k => {
                let d = LoopDev::new(size, 4096);
                let p = d.path().to_owned();
                (ScratchGuard::Loop(d), p)
            }
            StorageKind::LoopTmpfs => {
                let d = LoopDev::on_tmpfs(size, 512);
                let p = d.path().to_owned();
                (ScratchGuard::Loop(d), p)
            }
            _ => {
                let fs = Fs::new(kind.fs_kind().expect("file system kind"), room);
                let p = fs.sparse_file("disk.img", size);
                (ScratchGuard::Fs(fs), p)
            }
        };
        Scratch {
            kind,
            path,
            size,
            guard,
        }
    }

    pub fn kind(&self) -> StorageKind {
        self.kind
    }

    /// The file or device to open.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn fs(&self) -> Option<&Fs> {
        match &self.guard {
            ScratchGuard::Fs(f) => Some(f),
            ScratchGuard::Loop(_) => None,
        }
    }

    pub fn loop_dev(&self) -> Option<&LoopDev> {
        match &self.guard {
            ScratchGuard::Loop(d) => Some(d),
            ScratchGuard::Fs(_) => None,
        }
    }

    /// Allocation of the storage behind the target in bytes: the file's
    /// `st_blocks`, or for a loop device its backing file's.
    pub fn allocated(&self) -> u64 {
        match &self.guard {
            ScratchGuard::Fs(_) => allocated_bytes(&self.path),
            ScratchGuard::Loop(d) => allocated_bytes(d.backing()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{check_pattern, size_of, write_pattern, GIB};

    #[test]
    #[ignore = "needs root"]
    fn scratch_of_every_kind_is_big_and_cheap() {
        for kind in StorageKind::usable() {
            let size = if kind == StorageKind::Ramfs {
                64 * MIB
            } else {
                3 * GIB
            };
            let t = std::time::Instant::now();
            let s = Scratch::new(kind, size);
            assert_eq!(size_of(s.path()), size, "{kind}");
            write_pattern(s.path(), size - MIB, MIB, 5);
            check_pattern(s.path(), size - MIB, MIB, 5);
            assert!(s.allocated() >= MIB, "{kind}: allocated {}", s.allocated());
            assert!(
                s.allocated() < size / 2,
                "{kind}: allocated {}",
                s.allocated()
            );
            eprintln!("{kind}: {:?}", t.elapsed());
        }
    }
}
