//! Test fixtures: real file systems and loop devices that the tests mount and
//! attach themselves, and helpers to fill and check their contents.
//!
//! Nothing here touches the real disk: every file system lives on a loop
//! device backed by a sparse file on a tmpfs the guard mounts itself, so a
//! "4 GiB" ext4 costs only the memory of the blocks actually written. Only the
//! empty mount points are created under the system temp dir (one unique
//! directory per guard, so several test runs can share a machine).
//!
//! # Guards
//!
//! | constructor | what | notes |
//! |---|---|---|
//! | [`Fs::tmpfs`] | tmpfs of `size` | no `FALLOC_FL_ZERO_RANGE` |
//! | [`Fs::ramfs`] | ramfs | no fallocate at all, no O_DIRECT, no size limit |
//! | [`Fs::ext4`] | ext4 on loop on a tmpfs file | mounted `noinit_itable` so no background writes |
//! | [`Fs::xfs`] | XFS on loop on a tmpfs file | device at least 320 MiB: xfsprogs ≥ 5.19 refuses smaller |
//! | [`LoopDev::new`] | loop device (512 or 4096-byte sectors, `--direct-io=on`) backed by a sparse file on ext4 (itself on tmpfs) | write-zeroes and discard offload work (ext4 has ZERO_RANGE and PUNCH_HOLE) |
//! | [`LoopDev::on_tmpfs`] | loop device backed directly by a tmpfs file | "blk-nowz": the loop driver advertises write-zeroes, the first one fails in tmpfs (no ZERO_RANGE) and the driver sets `write_zeroes_max_bytes` to 0 for good; later BLKZEROOUT writes zero pages in the kernel and PUNCH_HOLE on the device fails with EOPNOTSUPP |
//! | [`Scratch::new`] | one of the above by [`StorageKind`], with a target of `size` bytes (a sparse file or the device) | for tests parametrized over all kinds; [`Scratch::with_room`] for files that grow |
//!
//! Every guard undoes what it did (unmount, detach, remove its directories)
//! in reverse order on `Drop`, which also runs when a test panics. A guard
//! that could not be built panics with the command and its stderr: when the
//! tests run as root a failed mount or attach is a test failure, not a skip.
//! Without root the constructors panic with "needs root"; mark such tests
//! `#[ignore = "needs root"]` so they are reported as ignored.
//!
//! A test process killed without unwinding (SIGKILL, a CI timeout) cannot
//! run its guards' `Drop`; the first guard of the next test process sweeps
//! what such dead processes left behind ([`sweep_stale`]).
//!
//! Drop order matters: declare the guard before anything that keeps files
//! open on it (a `Target`), so the open handles are dropped first. If a
//! mount is still busy the guard retries, then detaches it lazily.
//!
//! # Data helpers
//!
//! [`pattern`] produces deterministic pseudo-random bytes that depend on the
//! seed and the *absolute offset* only, so any sub-range can be regenerated
//! and checked without keeping a copy: [`write_pattern`] / [`check_pattern`].
//! [`check_zero`] reads big chunks and reports the first non-zero offset;
//! [`first_difference`] / [`assert_same`] compare buffers and name the first
//! differing offset. [`allocated_bytes`] is `st_blocks * 512`;
//! [`drop_cache`] syncs and drops a file's page cache.

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
pub const GIB: u64 = 1024 * MIB;

/// Whether the tests run with the privileges to mount and attach loop devices.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Panics unless root: a root-only test that runs must do the real work or fail.
pub fn require_root() {
    assert!(
        is_root(),
        "needs root (mount, losetup, mkfs): run as root or without --include-ignored"
    );
}

// ---------------------------------------------------------------------------
// Commands

/// Runs a command; panics with its stderr when it fails to start or exits non-zero.
pub fn run<I, S>(prog: &str, args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    match try_run(prog, &args) {
        Ok(out) => out,
        Err(e) => panic!("{e}"),
    }
}

fn try_run(prog: &str, args: &[std::ffi::OsString]) -> Result<String, String> {
    let shown = format!(
        "{prog} {}",
        args.iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let out = Command::new(prog)
        .args(args)
        // mkfs.*, losetup and mount live in /sbin; a test environment may not
        // have it on PATH.
        .env(
            "PATH",
            format!(
                "/usr/sbin:/usr/bin:/sbin:/bin:{}",
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .output()
        .map_err(|e| format!("cannot run `{shown}`: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`{shown}` failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

// ---------------------------------------------------------------------------
// Undo stack shared by all guards

enum Undo {
    Umount(PathBuf),
    Detach(PathBuf),
    RemoveDir(PathBuf),
}

/// What a guard set up, undone in reverse on drop.
struct Stack {
    undo: Vec<Undo>,
}

impl Stack {
    fn new() -> Stack {
        Stack { undo: Vec::new() }
    }

    /// A fresh, unique, empty directory under the system temp dir.
    fn unique_dir(&mut self, what: &str) -> PathBuf {
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(sweep_stale);
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "rawdisk-tk-{what}-{}-{n}-{nanos:08x}",
            std::process::id()
        ));
        std::fs::create_dir(&dir)
            .unwrap_or_else(|e| panic!("create temp dir {}: {e}", dir.display()));
        self.undo.push(Undo::RemoveDir(dir.clone()));
        dir
    }

    fn subdir(&mut self, parent: &Path, name: &str) -> PathBuf {
        let dir = parent.join(name);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        self.undo.push(Undo::RemoveDir(dir.clone()));
        dir
    }

    fn mount(&mut self, fstype: &str, source: &str, options: Option<&str>, dir: &Path) {
        let mut args: Vec<std::ffi::OsString> = vec!["-t".into(), fstype.into()];
        if let Some(o) = options {
            args.push("-o".into());
            args.push(o.into());
        }
        args.push(source.into());
        args.push(dir.into());
        run("mount", &args);
        self.undo.push(Undo::Umount(dir.to_owned()));
    }

    /// Attaches `file` to a free loop device and returns the device path.
    fn attach(&mut self, file: &Path, sector_size: u32) -> PathBuf {
        let ss = sector_size.to_string();
        let out = run(
            "losetup",
            [
                OsStr::new("--find"),
                OsStr::new("--show"),
                OsStr::new("--sector-size"),
                OsStr::new(&ss),
                // No double caching of the backing file, and the sector size
                // must be honoured by O_DIRECT (docs/capabilities.md, Loop devices).
                OsStr::new("--direct-io=on"),
                file.as_os_str(),
            ],
        );
        let dev = PathBuf::from(out.trim());
        // Registered before checking, so a surprising answer is still detached.
        self.undo.push(Undo::Detach(dev.clone()));
        assert!(
            out.trim().starts_with("/dev/loop"),
            "losetup printed {out:?}, expected a /dev/loopN path"
        );
        dev
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        while let Some(u) = self.undo.pop() {
            match u {
                Undo::Umount(dir) => {
                    let d = dir.as_os_str().to_owned();
                    let mut ok = false;
                    // A thread of a panicking test may still hold a file open for
                    // a moment; retry before falling back to a lazy unmount.
                    for _ in 0..20 {
                        if try_run("umount", std::slice::from_ref(&d)).is_ok() {
                            ok = true;
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    if !ok {
                        let r = try_run("umount", &["-l".into(), d.clone()]);
                        eprintln!(
                            "rawdisk-testkit: {} busy, lazy unmount: {r:?}",
                            dir.display()
                        );
                    }
                }
                Undo::Detach(dev) => {
                    if let Err(e) = try_run("losetup", &["-d".into(), dev.clone().into()]) {
                        eprintln!("rawdisk-testkit: {e}");
                    }
                }
                Undo::RemoveDir(dir) => {
                    // Only plain files we created ourselves can be here (the
                    // backing file of a loop device on tmpfs is inside the tmpfs,
                    // already gone); never recurse into something still mounted.
                    if let Err(e) = std::fs::remove_dir(&dir) {
                        if e.kind() != io::ErrorKind::NotFound {
                            eprintln!("rawdisk-testkit: rmdir {}: {e}", dir.display());
                        }
                    }
                }
            }
        }
    }
}

/// The pid that created a guard directory `rawdisk-tk-<what>-<pid>-<n>-<nanos>`.
fn guard_pid(component: &str) -> Option<u32> {
    let rest = component.strip_prefix("rawdisk-tk-")?;
    let mut parts = rest.rsplitn(4, '-');
    let _nanos = parts.next()?;
    let _n = parts.next()?;
    parts.next()?.parse().ok()
}

/// The guard directory (under the temp dir) a path lies in, if its creator is dead.
fn stale_guard_dir(path: &str) -> Option<PathBuf> {
    let tmp = std::env::temp_dir();
    let rel = Path::new(path).strip_prefix(&tmp).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let pid = guard_pid(first)?;
    if Path::new(&format!("/proc/{pid}")).exists() {
        return None;
    }
    Some(tmp.join(first))
}

/// Cleans up what guards of test processes that died without unwinding
/// (SIGKILL, a CI timeout) left behind: unmounts (lazily) every mount under a
/// `rawdisk-tk-*` directory whose creating process is gone, detaches loop
/// devices backed by files there, removes the empty directories. Guards of
/// live processes (other test runs going on now) are never touched. Called
/// once per process by the first guard.
pub fn sweep_stale() {
    if !is_root() {
        return;
    }
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    // Field 5 is the mount point (octal escapes for spaces, never in ours).
    let mut mounts: Vec<String> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| stale_guard_dir(m).is_some())
        .map(str::to_owned)
        .collect();
    let mut dirs = std::collections::BTreeSet::new();
    // Loop devices first, while their backing files still have their paths
    // (after a lazy unmount losetup only shows "/fs.img"). A device still
    // holding a mounted file system is only marked autoclear and goes away
    // when that file system's lazy unmount completes.
    if let Ok(list) = try_run(
        "losetup",
        &[
            "-l".into(),
            "-n".into(),
            "-O".into(),
            "NAME,BACK-FILE".into(),
        ],
    ) {
        let mut stale: Vec<(String, String)> = list
            .lines()
            .filter_map(|line| {
                let mut f = line.split_whitespace();
                Some((f.next()?.to_owned(), f.next()?.to_owned()))
            })
            .filter(|(_, back)| stale_guard_dir(back).is_some())
            .collect();
        // A loop device over a file on a loop-backed ext4 before that one.
        stale.sort_by_key(|(_, back)| std::cmp::Reverse(back.len()));
        for (dev, back) in stale {
            dirs.insert(stale_guard_dir(&back).unwrap());
            let r = try_run("losetup", &["-d".into(), dev.clone().into()]);
            eprintln!("rawdisk-testkit: stale loop device {dev} ({back}) of a dead test process: losetup -d: {r:?}");
        }
    }
    // Deepest first: the file system before the tmpfs under its loop device.
    mounts.sort_by_key(|m| std::cmp::Reverse(m.matches('/').count()));
    for m in &mounts {
        dirs.insert(stale_guard_dir(m).unwrap());
        let r = try_run("umount", &["-l".into(), m.into()]);
        eprintln!("rawdisk-testkit: stale mount {m} of a dead test process: umount -l: {r:?}");
    }
    if let Ok(rd) = std::fs::read_dir(std::env::temp_dir()) {
        for e in rd.flatten() {
            let p = e.path();
            if let Some(d) = p.to_str().and_then(stale_guard_dir) {
                dirs.insert(d);
            }
        }
    }
    for d in dirs {
        for sub in ["mnt", "fs", "backing"] {
            let _ = std::fs::remove_dir(d.join(sub));
        }
        let _ = std::fs::remove_dir(&d);
    }
}

fn sparse_file(path: &Path, size: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.set_len(size)
        .unwrap_or_else(|e| panic!("truncate {} to {size}: {e}", path.display()));
}

/// Size of a tmpfs that holds a sparse file of `size` plus file system metadata
/// written by mkfs and the tests (tmpfs counts only pages in use, so a generous
/// limit costs nothing).
fn tmpfs_size_for(size: u64) -> u64 {
    size + size / 8 + 64 * MIB
}

// ---------------------------------------------------------------------------
// File systems

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
        Fs::on_loop(FsKind::Ext4, size)
    }

    /// XFS of `max(size, 320 MiB)` bytes on a loop device backed by a sparse file
    /// on tmpfs (xfsprogs ≥ 5.19 refuses devices under 300 MB).
    pub fn xfs(size: u64) -> Fs {
        Fs::on_loop(FsKind::Xfs, size.max(320 * MIB))
    }

    fn on_loop(kind: FsKind, size: u64) -> Fs {
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
                run(
                    "mkfs.ext4",
                    [
                        OsStr::new("-q"),
                        OsStr::new("-F"),
                        OsStr::new("-E"),
                        OsStr::new("nodiscard,lazy_itable_init=1,lazy_journal_init=1"),
                        dev.as_os_str(),
                    ],
                );
            }
            FsKind::Xfs => {
                run(
                    "mkfs.xfs",
                    [
                        OsStr::new("-q"),
                        OsStr::new("-f"),
                        OsStr::new("-K"),
                        dev.as_os_str(),
                    ],
                );
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

// ---------------------------------------------------------------------------
// Loop devices

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
            run(
                "mkfs.ext4",
                [
                    OsStr::new("-q"),
                    OsStr::new("-F"),
                    OsStr::new("-E"),
                    OsStr::new("nodiscard,lazy_itable_init=1,lazy_journal_init=1"),
                    fsdev.as_os_str(),
                ],
            );
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

// ---------------------------------------------------------------------------
// Parametrized storage

/// Every kind of storage the engine's tests cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageKind {
    Tmpfs,
    Ramfs,
    Ext4,
    Xfs,
    /// Loop device, 512-byte sectors, on an ext4 file.
    Loop512,
    /// Loop device, 4096-byte sectors, on an ext4 file.
    Loop4k,
    /// Loop device, 512-byte sectors, directly on a tmpfs file.
    LoopTmpfs,
}

impl StorageKind {
    pub const ALL: [StorageKind; 7] = [
        StorageKind::Tmpfs,
        StorageKind::Ramfs,
        StorageKind::Ext4,
        StorageKind::Xfs,
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
            _ => None,
        }
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

// ---------------------------------------------------------------------------
// Data helpers

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

/// An NBD server under test or for reference (nbdkit's file plugin, qemu-nbd,
/// `rawdisk serve`), listening on a Unix socket in a private temp dir;
/// killed on Drop.
pub struct NbdServer {
    /// The server process, for tests that kill it on purpose.
    pub child: std::process::Child,
    sock: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// Whether a Unix socket bound at `path` is listening: /proc/net/unix
/// lists it with __SO_ACCEPTCON (0x10000) in its flags. Unlike a test
/// connect, this leaves no half-open connection for the server to log.
fn unix_listening(path: &Path) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return path.exists();
    };
    let want = path.to_string_lossy();
    table.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() >= 8
            && f[7] == want
            && u32::from_str_radix(f[3], 16).is_ok_and(|flags| flags & 0x10000 != 0)
    })
}

impl NbdServer {
    /// Starts `cmd` (which must listen on `sock`) and waits for the socket.
    pub fn spawn(
        mut cmd: std::process::Command,
        dir: tempfile::TempDir,
        sock: std::path::PathBuf,
    ) -> NbdServer {
        use std::process::Stdio;
        use std::time::{Duration, Instant};
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
        let mut s = NbdServer {
            child,
            sock,
            _dir: dir,
        };
        let t0 = Instant::now();
        // The socket file appears at bind(), before listen(): a connect in
        // between is refused. Wait for the kernel to list it as listening.
        while !unix_listening(&s.sock) {
            if let Ok(Some(st)) = s.child.try_wait() {
                panic!("{cmd:?} exited early: {st}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{cmd:?} did not start"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }

    fn new_socket() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("nbd.sock");
        (dir, sock)
    }

    /// nbdkit's file plugin; `filters` go before the plugin, `params` after.
    pub fn nbdkit(file: &Path, filters: &[&str], params: &[&str]) -> NbdServer {
        let (dir, sock) = Self::new_socket();
        let mut c = std::process::Command::new("nbdkit");
        c.args(["-f", "--exit-with-parent", "-U"])
            .arg(&sock)
            .args(filters)
            .arg("file")
            .arg(format!("file={}", file.display()))
            .args(params);
        Self::spawn(c, dir, sock)
    }

    /// qemu-nbd with qemu's defaults (page cache, 8 connections allowed).
    pub fn qemu_nbd(file: &Path) -> NbdServer {
        let (dir, sock) = Self::new_socket();
        let mut c = std::process::Command::new("qemu-nbd");
        c.args(["-f", "raw", "-t", "-e", "8", "--cache=writeback", "-k"])
            .arg(&sock)
            .arg(file);
        Self::spawn(c, dir, sock)
    }

    /// `rawdisk serve` from the binary at `bin`.
    pub fn rawdisk(bin: &Path, file: &Path) -> NbdServer {
        let (dir, sock) = Self::new_socket();
        let mut c = std::process::Command::new(bin);
        c.args(["serve", "--socket"]).arg(&sock).arg(file);
        c.stderr(std::process::Stdio::null());
        Self::spawn(c, dir, sock)
    }

    pub fn socket(&self) -> &Path {
        &self.sock
    }

    /// `nbd+unix:///?socket=PATH`
    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

    #[test]
    #[ignore = "needs root"]
    fn cleanup_runs_when_a_test_panics() {
        let dir = std::sync::Mutex::new(PathBuf::new());
        let r = std::panic::catch_unwind(|| {
            let fs = Fs::ext4(64 * MIB);
            *dir.lock().unwrap() = fs.dir().to_owned();
            let _f = File::create(fs.path("held")).unwrap();
            panic!("boom");
        });
        assert!(r.is_err());
        let d = dir.into_inner().unwrap();
        let mnt = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mnt.contains(d.to_str().unwrap()));
        assert!(!d.exists());
    }

    #[test]
    #[ignore = "needs root"]
    fn scratch_of_every_kind_is_big_and_cheap() {
        for kind in StorageKind::ALL {
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

    /// A test process killed without unwinding leaves its mounts and loop
    /// devices behind; the next process's sweep removes them.
    #[test]
    #[ignore = "needs root"]
    fn sweep_cleans_after_a_killed_process() {
        if std::env::var_os("RAWDISK_TK_ABORT_CHILD").is_some() {
            let _fs = Fs::ext4(64 * MIB);
            let _d = LoopDev::new(16 * MIB, 4096);
            let _t = Fs::tmpfs(MIB);
            std::process::abort();
        }
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--include-ignored",
                "--exact",
                "tests::sweep_cleans_after_a_killed_process",
            ])
            .env("RAWDISK_TK_ABORT_CHILD", "1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(!child.wait().unwrap().success(), "the child should abort");
        let tag = format!("-{pid}-");
        let left = |what: &str| -> usize {
            let mnt = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
            let loops = run("losetup", ["-l", "-n", "-O", "BACK-FILE"]);
            let dirs = std::fs::read_dir(std::env::temp_dir())
                .unwrap()
                .flatten()
                .filter(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.starts_with("rawdisk-tk-") && n.contains(&tag)
                })
                .count();
            let m = mnt
                .lines()
                .filter(|l| l.contains("rawdisk-tk-") && l.contains(&tag))
                .count();
            let l = loops
                .lines()
                .filter(|l| l.contains("rawdisk-tk-") && l.contains(&tag))
                .count();
            eprintln!("{what}: {m} mounts, {l} loop devices, {dirs} dirs of pid {pid}");
            m + l + dirs
        };
        assert!(
            left("before the sweep") >= 3,
            "the aborted child left nothing to sweep?"
        );
        let child_loops: Vec<String> = run("losetup", ["-l", "-n", "-O", "NAME,BACK-FILE"])
            .lines()
            .filter(|l| l.contains(&tag))
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .collect();
        assert_eq!(child_loops.len(), 3, "ext4 + LoopDev::new (2)");
        sweep_stale();
        // Lazy unmounts and autoclear detaches finish asynchronously.
        let mut n = left("after the sweep");
        for _ in 0..50 {
            if n == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            sweep_stale();
            n = left("after the sweep");
        }
        assert_eq!(n, 0, "stale mounts, loop devices or dirs of pid {pid} left");
        // Once unmounted, a leaked device's backing path no longer names the
        // guard (losetup shows "/fs.img"): check by device name. A number may
        // already be reused by a live guard, whose backing path is complete.
        for _ in 0..50 {
            let leaked: Vec<String> = run("losetup", ["-l", "-n", "-O", "NAME,BACK-FILE"])
                .lines()
                .filter(|l| {
                    let mut f = l.split_whitespace();
                    let (dev, back) = (f.next().unwrap_or(""), f.next().unwrap_or(""));
                    child_loops.iter().any(|c| c == dev) && !back.contains("/rawdisk-tk-")
                })
                .map(str::to_owned)
                .collect();
            if leaked.is_empty() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("loop devices of pid {pid} still attached");
    }
}
