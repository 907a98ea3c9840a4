//! NBD_OPT_LIST of a directory (`serve --dir`), its cost bounded: a
//! listing reads at most `EXAMINE_MAX` directory entries, looks at the
//! head of a regular file only when its (st_dev, st_ino, size, mtime,
//! ctime) changed since the last listing, and runs on a blocking thread,
//! one at a time: LISTs that arrive while one runs share the next.
//! nbdkit's `file dir=` reads the whole directory per LIST and opens
//! nothing; this server also leaves out what GO would refuse, which costs
//! an open and a read per file the first time.

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use rawdisk_storage::format::Format;
use rustix::fs::{FileType, Stat};
use tracing::{debug, info, warn};

/// Most names one NBD_OPT_LIST reply carries.
const LIST_MAX: usize = 65536;
/// Most directory entries one listing reads; names past them are left out
/// of the list (GO still opens them).
const EXAMINE_MAX: usize = 2 * LIST_MAX;
/// Most left-out names remembered so as to log each once.
const UNLISTED_MAX: usize = 4096;
/// A file changed this recently may change again within the same tick of
/// its file system's clock (1-2 s on FAT and old ext inodes) without its
/// times moving: its verdict is not kept.
const SETTLED: Duration = Duration::from_secs(2);

/// One inode as a listing saw it: (st_dev, st_ino).
type Id = (u64, u64);

/// What changes when a regular file's bytes do: size, mtime, ctime (ns).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Stamp {
    size: i64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(st: &Stat) -> Stamp {
        Stamp {
            size: st.st_size,
            mtime: (st.st_mtime, st.st_mtime_nsec as i64),
            ctime: (st.st_ctime, st.st_ctime_nsec as i64),
        }
    }

    /// Whether the file last changed before `settled` (see SETTLED).
    fn before(&self, settled: SystemTime) -> bool {
        let Ok(t) = settled.duration_since(SystemTime::UNIX_EPOCH) else {
            return false;
        };
        (self.ctime.0, self.ctime.1) < (t.as_secs() as i64, t.subsec_nanos() as i64)
    }
}

/// What a file's head showed: raw (None), another format, or an errno.
type Verdict = Result<Option<Format>, i32>;

/// A verdict and the stamp of the file it is about.
#[derive(Clone, Copy)]
struct Seen {
    stamp: Stamp,
    verdict: Verdict,
}

/// What one listing cost (debug log, tests).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Cost {
    /// Directory entries read.
    pub(super) entries: usize,
    /// Files opened to look at their head.
    pub(super) heads: usize,
}

/// The listings of one directory.
pub(super) struct Listing {
    dir: PathBuf,
    /// O_PATH fd of the directory (a duplicate of the exports').
    fd: OwnedFd,
    /// Entries a listing reads at most (EXAMINE_MAX; tests lower it).
    examine_max: usize,
    /// Listings started so far; a LIST reuses one started after it came.
    runs: AtomicU64,
    /// Held for the whole of a listing, by the blocking thread that runs it.
    state: Arc<tokio::sync::Mutex<State>>,
    /// Names a listing left out, each logged once (at most UNLISTED_MAX).
    unlisted: Mutex<HashSet<String>>,
}

#[derive(Default)]
struct State {
    /// Regular files' verdicts from the last listing, at most one per
    /// entry it read.
    seen: HashMap<Id, Seen>,
    /// The last listing's number and names.
    last: Option<(u64, Arc<Vec<String>>)>,
    /// The directory held more than a listing reads (logged once).
    cut: bool,
}

impl Listing {
    pub(super) fn new(dir: PathBuf, fd: OwnedFd) -> Listing {
        Listing {
            dir,
            fd,
            examine_max: EXAMINE_MAX,
            runs: AtomicU64::new(0),
            state: Arc::default(),
            unlisted: Mutex::new(HashSet::new()),
        }
    }

    /// The names of the regular files and block devices in the directory
    /// that GO would serve (all of them with `raw`), sorted, at most
    /// LIST_MAX. Read on a blocking thread, not the connection's: a slow
    /// or huge directory must not stall other connections' requests.
    pub(super) async fn names(self: &Arc<Self>, raw: bool) -> Arc<Vec<String>> {
        let asked = self.runs.load(Ordering::Acquire);
        let mut st = self.state.clone().lock_owned().await;
        if let Some((n, names)) = &st.last {
            // Started after this LIST came: it saw every change before it.
            if *n > asked {
                return names.clone();
            }
        }
        // The guard moves to the job: a handshake that times out meanwhile
        // leaves the listing to finish, and the next one waits for it.
        let me = self.clone();
        let job = tokio::task::spawn_blocking(move || {
            let n = me.runs.fetch_add(1, Ordering::AcqRel) + 1;
            let (names, cost) = me.scan(&mut st, raw, SystemTime::now());
            debug!(
                "listing {}: {} names, {} entries read, {} heads",
                me.dir.display(),
                names.len(),
                cost.entries,
                cost.heads
            );
            let names = Arc::new(names);
            st.last = Some((n, names.clone()));
            names
        });
        job.await.unwrap_or_else(|e| {
            warn!("listing {}: {e}", self.dir.display());
            Arc::default()
        })
    }

    /// One listing: reads up to `examine_max` entries, reusing the
    /// verdicts of files unchanged and settled by `now`.
    fn scan(&self, st: &mut State, raw: bool, now: SystemTime) -> (Vec<String>, Cost) {
        use rustix::fs::{Mode, OFlags};
        let mut cost = Cost::default();
        // Read through the directory's fd, as every name is checked and
        // opened: a parent swapped for a symlink since start leads nowhere.
        let listed = rustix::fs::openat(
            &self.fd,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .and_then(rustix::fs::Dir::read_from);
        let entries = match listed {
            Ok(r) => r,
            Err(e) => {
                warn!("listing {}: {e}", self.dir.display());
                return (Vec::new(), cost);
            }
        };
        let settled = now.checked_sub(SETTLED).unwrap_or(SystemTime::UNIX_EPOCH);
        let mut old = std::mem::take(&mut st.seen);
        let mut names = Vec::new();
        for e in entries {
            if cost.entries == self.examine_max {
                if !st.cut {
                    st.cut = true;
                    warn!(
                        "listing {}: more than {} entries; the names past them are not \
                         listed (they are still served)",
                        self.dir.display(),
                        self.examine_max
                    );
                }
                break;
            }
            cost.entries += 1;
            let e = match e {
                Ok(e) => e,
                Err(e) => {
                    warn!("listing {}: {e}", self.dir.display());
                    break;
                }
            };
            // What the directory says it is spares a stat of the rest.
            let kind = e.file_type();
            if !matches!(
                kind,
                FileType::RegularFile
                    | FileType::BlockDevice
                    | FileType::Symlink
                    | FileType::Unknown
            ) {
                continue;
            }
            let Ok(name) = e.file_name().to_str() else {
                continue;
            };
            let Ok(stat) = super::resolve(&self.dir, self.fd.as_fd(), name) else {
                continue;
            };
            if raw || self.servable(name, &stat, &mut old, &mut st.seen, settled, &mut cost) {
                names.push(name.to_owned());
            }
        }
        names.sort_unstable();
        names.truncate(LIST_MAX);
        (names, cost)
    }

    /// Whether a listed name is one GO would serve: listers (nbdinfo
    /// --list, qemu-nbd -L) open every export they are told of and fail
    /// on a refusal, so a file that looks like another image format (unless
    /// `-f raw`), or that cannot be read, is left out, and why is logged
    /// once per name. A regular file's verdict is taken from `old` while
    /// its stamp is the same, and kept in `new` once settled; a block
    /// device's bytes change with no stamp of its inode: read each time.
    fn servable(
        &self,
        name: &str,
        stat: &Stat,
        old: &mut HashMap<Id, Seen>,
        new: &mut HashMap<Id, Seen>,
        settled: SystemTime,
        cost: &mut Cost,
    ) -> bool {
        let id = (stat.st_dev, stat.st_ino);
        let stamp = Stamp::of(stat);
        let file = FileType::from_raw_mode(stat.st_mode) == FileType::RegularFile;
        // A second name of the same inode finds it in `new`.
        let known = old.remove(&id).or_else(|| new.get(&id).copied());
        let verdict = match known {
            Some(s) if file && s.stamp == stamp => {
                new.insert(id, s);
                s.verdict
            }
            _ => {
                cost.heads += 1;
                let (verdict, keep) = match self.looks_like(name) {
                    // Kept only if what was read is what was stat'ed.
                    Ok((seen, f)) => (Ok(f), Stamp::of(&seen) == stamp),
                    Err(e) => {
                        let errno = e.raw_os_error().unwrap_or(libc::EIO);
                        // Only a refusal lasts until a chmod (a new ctime).
                        (Err(errno), matches!(errno, libc::EACCES | libc::EPERM))
                    }
                };
                if file && keep && stamp.before(settled) {
                    new.insert(id, Seen { stamp, verdict });
                }
                verdict
            }
        };
        let why = match verdict {
            Ok(None) => return true,
            Ok(Some(f)) => {
                format!(
                    "it looks like a {f} image, not raw (serve with -f raw to export its bytes)"
                )
            }
            Err(errno) => format!("it cannot be read: {}", io::Error::from_raw_os_error(errno)),
        };
        let mut logged = self.unlisted.lock().unwrap_or_else(|p| p.into_inner());
        if logged.len() < UNLISTED_MAX && logged.insert(name.to_string()) {
            info!("{}: not listed: {why}", self.dir.join(name).display());
        }
        false
    }

    /// What `name` looks like, read beneath the directory's fd (a FIFO
    /// swapped in cannot block: O_NONBLOCK, and only regular files and
    /// block devices are read), with the stat of what was read.
    fn looks_like(&self, name: &str) -> io::Result<(Stat, Option<Format>)> {
        use rustix::fs::{Mode, OFlags, ResolveFlags, SeekFrom};
        let flags = OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK | OFlags::NOCTTY;
        let fd = match rustix::fs::openat2(
            &self.fd,
            name,
            flags,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        ) {
            // No openat2: the name was checked to be inside just before.
            Err(rustix::io::Errno::NOSYS) => {
                rustix::fs::openat(&self.fd, name, flags, Mode::empty())?
            }
            r => r?,
        };
        let st = rustix::fs::fstat(&fd)?;
        let size = match FileType::from_raw_mode(st.st_mode) {
            FileType::RegularFile => st.st_size as u64,
            FileType::BlockDevice => rustix::fs::seek(&fd, SeekFrom::End(0))?,
            _ => return Err(io::Error::from_raw_os_error(libc::EINVAL)),
        };
        let f = rawdisk_storage::format::probe(size, |buf: &mut [u8], at| -> io::Result<()> {
            let mut done = 0;
            while done < buf.len() {
                match rustix::io::pread(&fd, &mut buf[done..], at + done as u64)? {
                    0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                    n => done += n,
                }
            }
            Ok(())
        })?;
        Ok((st, f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::path::Path;

    /// qcow2's magic and version 3: what a listing must leave out.
    const QCOW2_HEAD: &[u8] = b"QFI\xfb\0\0\0\x03";

    /// `n` sparse raw files of 64 KiB and one qcow2 head, in a new
    /// directory.
    fn dir_of(n: usize) -> (tempfile::TempDir, Vec<String>) {
        let d = tempfile::tempdir().unwrap();
        let mut raw = Vec::new();
        for i in 0..n {
            let name = format!("disk{i:05}.img");
            let f = std::fs::File::create(d.path().join(&name)).unwrap();
            f.set_len(64 << 10).unwrap();
            raw.push(name);
        }
        write_head(&d.path().join("other.qcow2"), QCOW2_HEAD);
        std::fs::create_dir(d.path().join("subdir")).unwrap();
        raw.sort();
        (d, raw)
    }

    fn write_head(path: &Path, head: &[u8]) {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .unwrap();
        f.write_all(head).unwrap();
        f.set_len(64 << 10).unwrap();
    }

    fn listing(d: &Path) -> Listing {
        let fd = std::fs::File::open(d).unwrap();
        Listing::new(d.to_path_buf(), OwnedFd::from(fd))
    }

    /// A scan at a time when every file has settled.
    fn scan_later(l: &Listing, st: &mut State) -> (Vec<String>, Cost) {
        l.scan(st, false, SystemTime::now() + Duration::from_secs(3600))
    }

    #[test]
    fn a_second_listing_reads_only_the_heads_that_changed() {
        let n = 2000;
        let (d, mut raw) = dir_of(n);
        let l = listing(d.path());
        let mut st = State::default();
        let (names, first) = scan_later(&l, &mut st);
        assert_eq!(names, raw);
        // The subdirectory is skipped by its entry's type, unread.
        assert_eq!(first.heads, n + 1);
        let (names, second) = scan_later(&l, &mut st);
        assert_eq!(names, raw);
        assert_eq!(second.heads, 0, "unchanged heads were read again");
        assert_eq!(second.entries, first.entries);
        // A file rewritten as qcow2 is read again and left out; a deleted
        // one is forgotten; a new one is read.
        write_head(&d.path().join(&raw[7]), QCOW2_HEAD);
        std::fs::remove_file(d.path().join(&raw[8])).unwrap();
        write_head(&d.path().join("new.img"), b"raw bytes");
        let (names, third) = scan_later(&l, &mut st);
        raw.drain(7..9);
        raw.push("new.img".into());
        raw.sort();
        assert_eq!(names, raw);
        assert_eq!(third.heads, 2);
        assert_eq!(st.seen.len(), n + 1);
    }

    #[test]
    fn a_file_changed_just_now_is_read_again() {
        let (d, raw) = dir_of(50);
        let l = listing(d.path());
        let mut st = State::default();
        for _ in 0..2 {
            // Within SETTLED of their last change: no verdict is kept.
            let (names, cost) = l.scan(&mut st, false, SystemTime::now());
            assert_eq!((names, cost.heads), (raw.clone(), 51));
        }
        assert!(st.seen.is_empty());
    }

    #[test]
    fn a_listing_reads_a_bounded_number_of_entries() {
        let (d, raw) = dir_of(300);
        let mut l = listing(d.path());
        l.examine_max = 100;
        let mut st = State::default();
        for _ in 0..2 {
            let (names, cost) = scan_later(&l, &mut st);
            assert_eq!(cost.entries, 100);
            assert!(cost.heads <= 100 && names.len() <= 100 && !names.is_empty());
            assert!(names.iter().all(|n| raw.contains(n)));
            assert!(st.seen.len() <= 100);
        }
        assert!(st.cut);
        // Without -f raw checks nothing, the bound still holds.
        let (names, cost) = l.scan(&mut st, true, SystemTime::now());
        assert_eq!((cost.entries, cost.heads), (100, 0));
        assert!(names.len() <= 100);
    }

    #[test]
    fn lists_that_arrive_together_share_one_listing() {
        let (d, raw) = dir_of(20);
        let l = Arc::new(listing(d.path()));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            // A listing runs: eight LISTs come and wait for it.
            let held = l.state.clone().lock_owned().await;
            let lists: Vec<_> = (0..8)
                .map(|_| {
                    let l = l.clone();
                    tokio::spawn(async move { l.names(false).await })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(held);
            for t in lists {
                assert_eq!(*t.await.unwrap(), raw);
            }
            assert_eq!(l.runs.load(Ordering::Relaxed), 1);
            // One that comes after it runs its own.
            assert_eq!(*l.names(false).await, raw);
            assert_eq!(l.runs.load(Ordering::Relaxed), 2);
        });
    }
}
