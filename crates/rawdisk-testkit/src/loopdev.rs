//! Loop devices: the [`LoopDev`] guard, on an ext4 file or directly on a
//! tmpfs file.

use std::path::{Path, PathBuf};

use crate::cmd::mkfs_ext4;
use crate::stack::{sparse_file, tmpfs_size_for, Stack};
use crate::{require_root, MIB};

/// A loop block device, detached (and its backing storage released) on drop.
pub struct LoopDev {
    path: PathBuf,
    backing: PathBuf,
    size: u64,
    sector_size: u32,
    on_tmpfs: bool,
    _stack: Stack,
}

impl LoopDev {
    /// A loop device of `size` bytes with `sector_size` (512 or 4096) logical
    /// sectors, backed by a sparse file on ext4 (on a loop device on tmpfs), so
    /// the device's write-zeroes and discard map to ext4's ZERO_RANGE and
    /// PUNCH_HOLE (docs/capabilities.md, Loop devices).
    pub fn new(size: u64, sector_size: u32) -> LoopDev {
        LoopDev::build(size, sector_size, false)
    }

    /// A loop device backed directly by a tmpfs file. Its write-zeroes offload
    /// disappears after the first use (tmpfs has no ZERO_RANGE); discard still
    /// works (docs/capabilities.md, tmpfs-backed loop devices).
    pub fn on_tmpfs(size: u64, sector_size: u32) -> LoopDev {
        LoopDev::build(size, sector_size, true)
    }

    fn build(size: u64, sector_size: u32, on_tmpfs: bool) -> LoopDev {
        require_root();
        assert!(
            sector_size == 512 || sector_size == 4096,
            "sector size {sector_size}: 512 or 4096"
        );
        assert!(
            size.is_multiple_of(sector_size as u64),
            "loop size {size} not a multiple of the sector size {sector_size}"
        );
        let mut st = Stack::new();
        let base = st.unique_dir(if on_tmpfs { "loop-tmpfs" } else { "loop" });
        let ram = st.subdir(&base, "backing");
        let backing_fs_size = size + size / 16 + 64 * MIB;
        st.mount(
            "tmpfs",
            "rawdisk-testkit",
            Some(&format!(
                "size={},mode=0700",
                tmpfs_size_for(backing_fs_size)
            )),
            &ram,
        );
        let backing = if on_tmpfs {
            let f = ram.join("disk.img");
            sparse_file(&f, size);
            f
        } else {
            let img = ram.join("fs.img");
            sparse_file(&img, backing_fs_size);
            let fsdev = st.attach(&img, 512);
            mkfs_ext4(&fsdev);
            let mnt = st.subdir(&base, "fs");
            st.mount(
                "ext4",
                &fsdev.to_string_lossy(),
                Some("noinit_itable"),
                &mnt,
            );
            let f = mnt.join("disk.img");
            sparse_file(&f, size);
            f
        };
        let path = st.attach(&backing, sector_size);
        LoopDev {
            path,
            backing,
            size,
            sector_size,
            on_tmpfs,
            _stack: st,
        }
    }

    /// `/dev/loopN`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file backing the device.
    pub fn backing(&self) -> &Path {
        &self.backing
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn sector_size(&self) -> u32 {
        self.sector_size
    }

    /// Whether the backing file is on tmpfs directly (no write-zeroes offload).
    pub fn is_on_tmpfs(&self) -> bool {
        self.on_tmpfs
    }

    /// `/sys/block/loopN/queue/<attr>` as a number (e.g. `write_zeroes_max_bytes`).
    pub fn queue_attr(&self, attr: &str) -> u64 {
        let name = self
            .path
            .file_name()
            .expect("loop device name")
            .to_string_lossy()
            .into_owned();
        let p = format!("/sys/block/{name}/queue/{attr}");
        let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {p}: {e}"));
        s.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{p}: {s:?}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::run;
    use crate::{check_pattern, size_of, write_pattern};

    #[test]
    #[ignore = "needs root"]
    fn loop_devices_attach_and_detach() {
        for (ss, tmp) in [(512, false), (4096, false), (512, true)] {
            let d = if tmp {
                LoopDev::on_tmpfs(16 * MIB, ss)
            } else {
                LoopDev::new(16 * MIB, ss)
            };
            assert_eq!(size_of(d.path()), 16 * MIB);
            assert_eq!(d.queue_attr("logical_block_size"), ss as u64);
            write_pattern(d.path(), 0, MIB, 9);
            check_pattern(d.path(), 0, MIB, 9);
            check_pattern(d.backing(), 0, MIB, 9);
            let dev = d.path().to_owned();
            let back = d.backing().to_owned();
            drop(d);
            // The number may be reused at once by a concurrent test: look for
            // this device with this backing file.
            let list = run("losetup", ["-l", "-n", "-O", "NAME,BACK-FILE"]);
            let mine = format!("{} {}", dev.display(), back.display());
            assert!(
                !list
                    .lines()
                    .any(|l| l.split_whitespace().collect::<Vec<_>>().join(" ") == mine),
                "{mine} still attached: {list}"
            );
        }
    }
}
