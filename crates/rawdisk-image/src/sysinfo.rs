//! What the system says about a target without touching it: the file system a
//! file lives on (from /proc/self/mountinfo), a block device's queue limits
//! (read by the target, through the syscall seam) and loop backing file (from
//! sysfs). Nothing is changed.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rawdisk_storage::{Kind, Target};
use serde::Serialize;

/// The mount a path lives on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MountInfo {
    #[serde(rename = "type")]
    pub fs_type: String,
    #[serde(rename = "mount-point")]
    pub mount_point: String,
    pub source: String,
}

/// The mount whose mount point is the longest prefix of `path` (made
/// absolute and canonical), from /proc/self/mountinfo.
pub fn mount_of(path: &Path) -> Option<MountInfo> {
    let abs = std::fs::canonicalize(path).ok()?;
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut best: Option<(usize, MountInfo)> = None;
    for line in text.lines() {
        // 36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
        let (left, right) = match line.split_once(" - ") {
            Some(x) => x,
            None => continue,
        };
        let mp = match left.split(' ').nth(4) {
            Some(m) => unescape_mount(m),
            None => continue,
        };
        let mut r = right.split(' ');
        let fs_type = r.next().unwrap_or("").to_string();
        let source = unescape_mount(r.next().unwrap_or(""));
        let mpp = Path::new(&mp);
        if abs.starts_with(mpp) {
            let len = mp.len();
            // Later lines win on equal length: a mount stacked on the same
            // point hides the earlier one.
            if best.as_ref().map(|(l, _)| len >= *l).unwrap_or(true) {
                best = Some((
                    len,
                    MountInfo {
                        fs_type,
                        mount_point: mp.clone(),
                        source,
                    },
                ));
            }
        }
    }
    best.map(|(_, m)| m)
}

/// mountinfo escapes space, tab, newline and backslash as \ooo.
fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = oct.iter().fold(0u32, |a, c| a * 8 + u32::from(c - b'0'));
                if let Ok(v) = u8::try_from(v) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether the target can be opened for writing: access(W_OK) (which fails
/// with EROFS on a read-only mount, and for a read-only block device node the
/// kernel checks at open), and a block device's `ro` flag in sysfs.
pub fn read_only(path: &Path) -> bool {
    if rustix::fs::access(path, rustix::fs::Access::WRITE_OK).is_err() {
        return true;
    }
    sysfs_block_dir(path)
        .filter(|_| {
            std::fs::metadata(path)
                .map(|m| {
                    use std::os::unix::fs::FileTypeExt;
                    m.file_type().is_block_device()
                })
                .unwrap_or(false)
        })
        .and_then(|d| std::fs::read_to_string(d.join("ro")).ok())
        .map(|s| s.trim() == "1")
        .unwrap_or(false)
}

/// Linux `dev_t` → (major, minor), the glibc encoding.
pub fn dev_major_minor(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfffu64);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xffu64);
    (major, minor & 0xffff_ffff)
}

/// The sysfs directory of a block device (`/sys/dev/block/MAJ:MIN`, resolved).
pub fn sysfs_block_dir(dev_path: &Path) -> Option<PathBuf> {
    let md = std::fs::metadata(dev_path).ok()?;
    let (ma, mi) = dev_major_minor(md.rdev());
    std::fs::canonicalize(format!("/sys/dev/block/{ma}:{mi}")).ok()
}

/// The request-queue limits that tell which offloads a block device offers.
/// Each is None when the attribute is missing (old kernels, odd drivers).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct QueueLimits {
    #[serde(rename = "logical-block-size")]
    pub logical_block_size: Option<u64>,
    #[serde(rename = "physical-block-size")]
    pub physical_block_size: Option<u64>,
    #[serde(rename = "minimum-io-size")]
    pub minimum_io_size: Option<u64>,
    #[serde(rename = "optimal-io-size")]
    pub optimal_io_size: Option<u64>,
    pub rotational: Option<bool>,
    #[serde(rename = "write-zeroes-max-bytes")]
    pub write_zeroes_max_bytes: Option<u64>,
    #[serde(rename = "write-zeroes-unmap-max-bytes")]
    pub write_zeroes_unmap_max_bytes: Option<u64>,
    #[serde(rename = "discard-max-bytes")]
    pub discard_max_bytes: Option<u64>,
    #[serde(rename = "discard-granularity")]
    pub discard_granularity: Option<u64>,
    #[serde(rename = "discard-zeroes-data")]
    pub discard_zeroes_data: Option<bool>,
}

/// The queue limits of an open block device (a partition's are its
/// disk's); None for a regular file, whose device is not what is probed.
pub fn queue_limits(t: &Target) -> Option<QueueLimits> {
    if t.kind() != Kind::Block {
        return None;
    }
    let q = t.block_queue_limits()?;
    Some(QueueLimits {
        logical_block_size: q.logical_block_size,
        physical_block_size: q.physical_block_size,
        minimum_io_size: q.minimum_io_size,
        optimal_io_size: q.optimal_io_size,
        rotational: q.rotational,
        write_zeroes_max_bytes: q.write_zeroes_max_bytes,
        write_zeroes_unmap_max_bytes: q.write_zeroes_unmap_max_bytes,
        discard_max_bytes: q.discard_max_bytes,
        discard_granularity: q.discard_granularity,
        discard_zeroes_data: q.discard_zeroes_data,
    })
}

/// For a loop device: the file behind it.
pub fn loop_backing_file(dev_path: &Path) -> Option<PathBuf> {
    let dir = sysfs_block_dir(dev_path)?;
    let s = std::fs::read_to_string(dir.join("loop/backing_file")).ok()?;
    let s = s.trim_end_matches('\n');
    if s.is_empty() {
        None
    } else {
        Some(PathBuf::from(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn major_minor() {
        // makedev(7, 3) and makedev(259, 65536) in glibc's encoding.
        assert_eq!(dev_major_minor(0x703), (7, 3));
        let (ma, mi) = (259u64, 65536u64);
        let dev = ((ma & 0xfff) << 8) | ((ma & !0xfff) << 32) | (mi & 0xff) | ((mi & !0xff) << 12);
        assert_eq!(dev_major_minor(dev), (259, 65536));
    }

    #[test]
    fn mount_escapes() {
        assert_eq!(unescape_mount("/mnt/a\\040b"), "/mnt/a b");
        assert_eq!(unescape_mount("/plain"), "/plain");
        assert_eq!(unescape_mount("/x\\"), "/x\\");
    }

    /// The queue limits are the target's one reading, through the syscall
    /// seam: each attribute as sysfs has it, a failing read is seen, and a
    /// regular file has none.
    #[test]
    #[ignore = "needs root"]
    fn queue_limits_are_read_through_the_seam() {
        use rawdisk_storage::sys::CallKind;
        use rawdisk_storage::{FaultSys, OpenOptions};
        use rawdisk_testkit::LoopDev;
        rawdisk_testkit::require_root();
        let dev = LoopDev::new(64 << 20, 4096);
        let fs = FaultSys::real();
        let ro = OpenOptions {
            read_only: true,
            ..Default::default()
        };
        let t = Target::open_with_sys(dev.path(), &ro, fs.clone()).unwrap();
        fs.reset_counts();
        let q = queue_limits(&t).expect("queue limits of a loop device");
        assert!(fs.calls(CallKind::ReadSysfs) >= 10, "not through the seam");
        let n = |a: &str| Some(dev.queue_attr(a));
        let b = |a: &str| Some(dev.queue_attr(a) != 0);
        let want = QueueLimits {
            logical_block_size: n("logical_block_size"),
            physical_block_size: n("physical_block_size"),
            minimum_io_size: n("minimum_io_size"),
            optimal_io_size: n("optimal_io_size"),
            rotational: b("rotational"),
            write_zeroes_max_bytes: n("write_zeroes_max_bytes"),
            write_zeroes_unmap_max_bytes: n("write_zeroes_unmap_max_bytes"),
            discard_max_bytes: n("discard_max_bytes"),
            discard_granularity: n("discard_granularity"),
            discard_zeroes_data: b("discard_zeroes_data"),
        };
        assert_eq!(q, want);
        assert_eq!(q.logical_block_size, Some(4096));
        fs.fail_from(CallKind::ReadSysfs, 1, libc::EIO);
        assert_eq!(queue_limits(&t), None, "a failing sysfs read unseen");
        let file = Target::open(dev.backing(), &ro).unwrap();
        assert_eq!(queue_limits(&file), None, "a regular file has queue limits");
    }

    #[test]
    fn root_is_mounted() {
        let m = mount_of(Path::new("/")).expect("/ in mountinfo");
        assert_eq!(m.mount_point, "/");
        assert!(!m.fs_type.is_empty());
    }
}
