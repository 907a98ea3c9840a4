//! File systems: [`FsKind`] and the [`Fs`] guard (tmpfs, ramfs, ext4, XFS or
//! btrfs on a loop device over a tmpfs file, and the NFS-like FUSE file
//! system over a tmpfs directory).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use std::time::Duration;

use crate::cmd::{mkfs_ext4, run};
use crate::nfs_like::{fuse_available, Counts, NfsLike, Options, Profile};
use crate::stack::{sparse_file, tmpfs_size_for, Stack};
use crate::{require_root, MIB};

/// The file systems the tests mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FsKind {
    Tmpfs,
    Ramfs,
    Ext4,
    Xfs,
    Btrfs,
    /// The NFS-like FUSE file system as an NFS 3 client sees it (nfs_like.rs).
    Nfs3,
    /// The NFS-like FUSE file system as an NFS 4.2 client sees it.
    Nfs42,
}

impl FsKind {
    pub const ALL: [FsKind; 7] = [
        FsKind::Tmpfs,
        FsKind::Ramfs,
        FsKind::Ext4,
        FsKind::Xfs,
        FsKind::Btrfs,
        FsKind::Nfs3,
        FsKind::Nfs42,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FsKind::Tmpfs => "tmpfs",
            FsKind::Ramfs => "ramfs",
            FsKind::Ext4 => "ext4",
            FsKind::Xfs => "xfs",
            FsKind::Btrfs => "btrfs",
            FsKind::Nfs3 => "nfs3",
            FsKind::Nfs42 => "nfs42",
        }
    }

    /// The NFS-like profile of an NFS kind.
    pub fn nfs_profile(self) -> Option<Profile> {
        match self {
            FsKind::Nfs3 => Some(Profile::Nfs3),
            FsKind::Nfs42 => Some(Profile::Nfs42),
            _ => None,
        }
    }

    /// Why this machine cannot mount the kind (no /dev/fuse for the NFS-like
    /// kinds), or None.
    pub fn unavailable(self) -> Option<String> {
        self.nfs_profile()?;
        fuse_available().err()
    }

    /// [`FsKind::ALL`] less the kinds this machine cannot mount, each of
    /// those named in one line on stderr: skipped, never silently.
    pub fn usable() -> Vec<FsKind> {
        usable(FsKind::ALL, FsKind::unavailable)
    }
}

/// `all` less the kinds `unavailable` gives a reason for, each of those
/// named in one line on stderr.
pub(crate) fn usable<K: Copy + std::fmt::Display>(
    all: impl IntoIterator<Item = K>,
    unavailable: impl Fn(K) -> Option<String>,
) -> Vec<K> {
    all.into_iter()
        .filter(|&k| match unavailable(k) {
            None => true,
            Some(why) => {
                eprintln!("rawdisk-testkit: {k} skipped: {why}");
                false
            }
        })
        .collect()
}

impl std::fmt::Display for FsKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A mounted file system, unmounted (and everything under it released) on drop.
pub struct Fs {
    kind: FsKind,
    dir: PathBuf,
    device: Option<PathBuf>,
    backing: Option<PathBuf>,
    nfs: Option<NfsLike>,
    _stack: Stack,
}

impl Fs {
    /// Mounts a file system of `kind`; `size` is ignored for ramfs (which has no limit).
    pub fn new(kind: FsKind, size: u64) -> Fs {
        match kind {
            FsKind::Tmpfs => Fs::tmpfs(size),
            FsKind::Ramfs => Fs::ramfs(),
            FsKind::Ext4 => Fs::ext4(size),
            FsKind::Xfs => Fs::xfs(size),
            FsKind::Btrfs => Fs::btrfs(size),
            FsKind::Nfs3 => Fs::nfs_like(Options::new(Profile::Nfs3), size),
            FsKind::Nfs42 => Fs::nfs_like(Options::new(Profile::Nfs42), size),
        }
    }

    /// btrfs of `max(size * 5 / 4, 256 MiB)` bytes on a loop device backed
    /// by a sparse file on tmpfs: mkfs.btrfs refuses devices under about
    /// 110 MiB, and its metadata (two copies) takes more than ext4's, so
    /// `size` bytes of data still fit.
    pub fn btrfs(size: u64) -> Fs {
        Fs::on_loop(FsKind::Btrfs, (size + size / 4).max(256 * MIB), &[])
    }

    /// The NFS-like FUSE file system (nfs_like.rs) over a tmpfs of `size`
    /// bytes, answered by threads of this process.
    pub fn nfs_like(opts: Options, size: u64) -> Fs {
        require_root();
        let kind = match opts.profile {
            Profile::Nfs3 => FsKind::Nfs3,
            Profile::Nfs42 => FsKind::Nfs42,
        };
        let mut st = Stack::new();
        let base = st.unique_dir(kind.name());
        let backing = st.subdir(&base, "backing");
        st.tmpfs(&backing, size, "0755");
        let dir = st.subdir(&base, "mnt");
        let nfs = NfsLike::mount(&backing, &dir, opts)
            .unwrap_or_else(|e| panic!("mount {kind} on {}: {e}", dir.display()));
        // Unmounted by the stack (retried, lazily at worst) before the tmpfs;
        // the threads answering the mount end with it.
        st.mounted(&dir);
        Fs {
            kind,
            dir,
            device: None,
            backing: Some(backing),
            nfs: Some(nfs),
            _stack: st,
        }
    }

    /// [`Fs::nfs_like`] with a latency per operation.
    pub fn nfs_like_with_latency(profile: Profile, size: u64, latency: Duration) -> Fs {
        let mut o = Options::new(profile);
        o.latency = latency;
        Fs::nfs_like(o, size)
    }

    /// What the NFS-like file system received so far (None for other kinds).
    pub fn nfs_counts(&self) -> Option<&Counts> {
        self.nfs.as_ref().map(NfsLike::counts)
    }

    /// A tmpfs limited to `size` bytes.
    pub fn tmpfs(size: u64) -> Fs {
        require_root();
        let mut st = Stack::new();
        let base = st.unique_dir("tmpfs");
        let dir = st.subdir(&base, "mnt");
        st.mount(
            "tmpfs",
            "rawdisk-testkit",
            Some(&format!("size={size},mode=0755")),
            &dir,
        );
        Fs {
            kind: FsKind::Tmpfs,
            dir,
            device: None,
            backing: None,
            nfs: None,
            _stack: st,
        }
    }

    /// A ramfs. It has no size limit: keep what the test writes small, and
    /// remember that reading a hole allocates memory on ramfs.
    pub fn ramfs() -> Fs {
        require_root();
        let mut st = Stack::new();
        let base = st.unique_dir("ramfs");
        let dir = st.subdir(&base, "mnt");
        st.mount("ramfs", "rawdisk-testkit", Some("mode=0755"), &dir);
        Fs {
            kind: FsKind::Ramfs,
            dir,
            device: None,
            backing: None,
            nfs: None,
            _stack: st,
        }
    }

    /// ext4 of `size` bytes on a loop device backed by a sparse file on tmpfs.
    pub fn ext4(size: u64) -> Fs {
        Fs::on_loop(FsKind::Ext4, size, &[])
    }

    /// XFS of `max(size, 320 MiB)` bytes on a loop device backed by a sparse file
    /// on tmpfs (xfsprogs ≥ 5.19 refuses devices under 300 MB).
    pub fn xfs(size: u64) -> Fs {
        Fs::on_loop(FsKind::Xfs, size.max(320 * MIB), &[])
    }

    /// [`Fs::xfs`] made with extra mkfs.xfs options (`["-m", "reflink=0"]`).
    pub fn xfs_with(size: u64, mkfs_options: &[&str]) -> Fs {
        Fs::on_loop(FsKind::Xfs, size.max(320 * MIB), mkfs_options)
    }

    fn on_loop(kind: FsKind, size: u64, extra: &[&str]) -> Fs {
        require_root();
        let mut st = Stack::new();
        let base = st.unique_dir(kind.name());
        let ram = st.subdir(&base, "backing");
        st.tmpfs(&ram, tmpfs_size_for(size), "0700");
        let img = ram.join("fs.img");
        sparse_file(&img, size);
        let dev = st.attach(&img, 512);
        match kind {
            // The image is a fresh sparse file, so it already reads as zeros:
            // skip the discard and the journal zeroing, and mount with
            // noinit_itable so the ext4lazyinit thread does not write inode
            // tables in the background while the tests time things.
            FsKind::Ext4 => {
                mkfs_ext4(&dev);
            }
            FsKind::Xfs => {
                let mut args = vec![OsStr::new("-q"), OsStr::new("-f"), OsStr::new("-K")];
                args.extend(extra.iter().map(OsStr::new));
                args.push(dev.as_os_str());
                run("mkfs.xfs", args);
            }
            FsKind::Btrfs => {
                run(
                    "mkfs.btrfs",
                    [OsStr::new("-q"), OsStr::new("-f"), dev.as_os_str()],
                );
            }
            _ => unreachable!("{kind} is not made on a loop device"),
        }
        let dir = st.subdir(&base, "mnt");
        let dev_s = dev.to_string_lossy().into_owned();
        let opts = match kind {
            FsKind::Ext4 => Some("noinit_itable"),
            _ => None,
        };
        st.mount(kind.name(), &dev_s, opts, &dir);
        Fs {
            kind,
            dir,
            device: Some(dev),
            backing: Some(img),
            nfs: None,
            _stack: st,
        }
    }

    /// The mount point (unique to this guard).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn kind(&self) -> FsKind {
        self.kind
    }

    /// `dir()/name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// A new sparse file `name` of `size` bytes in this file system.
    pub fn sparse_file(&self, name: &str, size: u64) -> PathBuf {
        let p = self.path(name);
        sparse_file(&p, size);
        p
    }

    /// The loop device under ext4/XFS.
    pub fn device(&self) -> Option<&Path> {
        self.device.as_deref()
    }

    /// The tmpfs file backing the loop device under ext4/XFS/btrfs, or the
    /// tmpfs directory behind the NFS-like file system.
    pub fn backing(&self) -> Option<&Path> {
        self.backing.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{check_pattern, check_zero, drop_cache, write_pattern};

    #[test]
    #[ignore = "needs root"]
    fn guards_mount_and_clean_up() {
        let mut dirs = Vec::new();
        for kind in FsKind::usable() {
            let fs = Fs::new(kind, 64 * MIB);
            assert_eq!(fs.kind(), kind);
            let p = fs.sparse_file("f", 3 * MIB);
            write_pattern(&p, 4096, 100_000, 3);
            drop_cache(&p);
            check_pattern(&p, 4096, 100_000, 3);
            check_zero(&p, 0, 4096);
            check_zero(&p, 104_096, 3 * MIB - 104_096);
            let mnt = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
            assert!(
                mnt.contains(fs.dir().to_str().unwrap()),
                "{kind} not mounted"
            );
            dirs.push(fs.dir().to_owned());
        }
        let mnt = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        for d in dirs {
            assert!(
                !mnt.contains(d.to_str().unwrap()),
                "{} still mounted",
                d.display()
            );
            assert!(!d.exists(), "{} not removed", d.display());
        }
    }
}
