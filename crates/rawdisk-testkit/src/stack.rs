//! The undo stack shared by all guards, their unique directories under the
//! temp dir, [`sweep_stale`] for what dead test processes left behind, and
//! the sparse files and tmpfs sizes the guards build on.

use std::ffi::OsStr;
use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::cmd::{run, try_run};
use crate::{is_root, MIB};

enum Undo {
    Umount(PathBuf),
    Detach(PathBuf),
    RemoveDir(PathBuf),
}

/// What a guard set up, undone in reverse on drop.
pub(crate) struct Stack {
    undo: Vec<Undo>,
}

impl Stack {
    pub(crate) fn new() -> Stack {
        Stack { undo: Vec::new() }
    }

    /// A fresh, unique, empty directory under the system temp dir.
    pub(crate) fn unique_dir(&mut self, what: &str) -> PathBuf {
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

    pub(crate) fn subdir(&mut self, parent: &Path, name: &str) -> PathBuf {
        let dir = parent.join(name);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        self.undo.push(Undo::RemoveDir(dir.clone()));
        dir
    }

    pub(crate) fn mount(&mut self, fstype: &str, source: &str, options: Option<&str>, dir: &Path) {
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

    /// A tmpfs of `size` bytes on `dir`, its root of `mode` (octal).
    pub(crate) fn tmpfs(&mut self, dir: &Path, size: u64, mode: &str) {
        let opts = format!("size={size},mode={mode}");
        self.mount("tmpfs", "rawdisk-testkit", Some(&opts), dir);
    }

    /// Registers a mount made by other means (the NFS-like FUSE file system)
    /// to be unmounted like the others.
    pub(crate) fn mounted(&mut self, dir: &Path) {
        self.undo.push(Undo::Umount(dir.to_owned()));
    }

    /// Attaches `file` to a free loop device and returns the device path.
    pub(crate) fn attach(&mut self, file: &Path, sector_size: u32) -> PathBuf {
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

pub(crate) fn sparse_file(path: &Path, size: u64) {
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
pub(crate) fn tmpfs_size_for(size: u64) -> u64 {
    size + size / 8 + 64 * MIB
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Fs, LoopDev};
    use std::fs::File;
    use std::process::Command;

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
                "stack::tests::sweep_cleans_after_a_killed_process",
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
