//! File systems: [`FsKind`] and the [`Fs`] guard (tmpfs, ramfs, and ext4 or
//! XFS on a loop device over a tmpfs file).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use crate::cmd::{mkfs_ext4, run};
use crate::stack::{sparse_file, tmpfs_size_for, Stack};
use crate::{require_root, MIB};

/// The file systems the tests mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FsKind {
    Tmpfs,
    Ramfs,
    Ext4,
    Xfs,
}

impl FsKind {
    pub const ALL: [FsKind; 4] = [FsKind::Tmpfs, FsKind::Ramfs, FsKind::Ext4, FsKind::Xfs];

    pub fn name(self) -> &'static str {
        match self {
            FsKind::Tmpfs => "tmpfs",
            FsKind::Ramfs => "ramfs",
            FsKind::Ext4 => "ext4",
            FsKind::Xfs => "xfs",
        }
    }
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
        }
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
        st.mount(
            "tmpfs",
            "rawdisk-testkit",
            Some(&format!("size={},mode=0700", tmpfs_size_for(size))),
            &ram,
        );
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
            FsKind::Tmpfs | FsKind::Ramfs => unreachable!(),
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

    /// The tmpfs file backing the loop device under ext4/XFS.
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
        for kind in FsKind::ALL {
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
