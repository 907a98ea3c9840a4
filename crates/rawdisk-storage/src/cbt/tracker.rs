//! [`Tracker`]: the tracking server's side of a state file.
//!
//! Memory: the file's header and the bitmap of every consistent checkpoint
//! as last read or written (`Mem`, behind a lock queries share), and U
//! (atomic words, no lock); all sparse (bitmap.rs), so they cost what
//! changed, not the target's size. "Changed since ck" is Bk | .. | Bn | U:
//! U counts as part of whichever checkpoint is newest, also one another
//! process created since the last persist, so a change that may be after
//! it is never hidden. A persist moves U into Bn in memory and writes the pages
//! of slot n that gained bits; the state file's mutation lock is held from
//! re-reading the header to the fdatasync, so no checkpoint can be created
//! in between.

use std::collections::BTreeSet;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::bitmap::{self, AtomicBits, Bits, Leaves, Union};
use super::disk::{
    new_header, open_target, repair, stat_fd, state_path_for, Disk, Read, MUTATION_BYTE,
    SERVED_BYTE,
};
use super::file::{check_unserved, damage_text, infos, no_such, warn_blank, warn_damage};
use super::format::{Header, Reason};
use super::index::{load_checked, upgrade, Loaded, PageIndex};
use super::{valid_granularity, CbtError, CheckpointInfo, TrackOptions, DEFAULT_GRANULARITY};
use crate::sys::{LockKind, Sys};

/// The header and the bitmaps of its checkpoints (None: inconsistent).
struct Mem {
    header: Header,
    maps: Vec<Option<Bits>>,
    /// The page index of each consistent checkpoint (the newest's grows
    /// with each persist).
    index: Vec<Option<PageIndex>>,
    /// Pages of the newest bitmap holding bits the state file may lack:
    /// they gained bits, and no persist has written them since.
    unsynced: BTreeSet<usize>,
}

/// The changed-block state of one served target. One per served target per
/// process (Arc-shared by every connection). Send + Sync.
pub struct Tracker {
    disk: Disk,
    target: PathBuf,
    /// The served target's own descriptor: close records the identity and
    /// times of the inode that was served, not of whatever the path names
    /// by then (a file moved over it).
    served: OwnedFd,
    granularity: u64,
    chunks: u64,
    u: AtomicBits,
    /// Set by every mark after its bits are in U (also on the fast path, if
    /// it was clear); cleared by a persist before it takes U.
    dirty: AtomicBool,
    mem: RwLock<Mem>,
    /// Serializes persist, refresh and close.
    io: Mutex<()>,
    closed: AtomicBool,
    /// An fdatasync of the state file failed: the marks it held may be
    /// lost, so no later persist (nor close) may succeed (the flush-failure
    /// rule, as for the target). Cleared only by a new open.
    sync_failed: AtomicBool,
}

impl Tracker {
    /// Track the file or device at `target` as it is opened now; `size`:
    /// the target's size now. Takes the "served" lock, sets the open flag
    /// durably, detects crash / replacement / outside change (and warns),
    /// creates the state file if absent. `granularity: Some(g)` differing
    /// from an existing file's is an error naming both.
    pub fn open(target: &Path, size: u64, opts: &TrackOptions) -> Result<Tracker, CbtError> {
        Self::open_with_sys(target, size, opts, Arc::new(crate::sys::RealSys))
    }

    /// [`Tracker::open`] through `sys` (tests inject faults with it).
    pub fn open_with_sys(
        target: &Path,
        size: u64,
        opts: &TrackOptions,
        sys: Arc<dyn Sys>,
    ) -> Result<Tracker, CbtError> {
        let served = open_target(&*sys, target)?;
        Self::open_fd(target, served, size, opts, sys)
    }

    /// Track the opened target `t` (what a server serves): its identity is
    /// taken from its descriptor, so a file moved over its path meanwhile
    /// is seen as another file.
    pub fn for_target(t: &crate::Target, opts: &TrackOptions) -> Result<Tracker, CbtError> {
        let served = t
            .fd()
            .try_clone_to_owned()
            .map_err(|e| CbtError::io("track changes of", t.path(), e))?;
        Self::open_fd(t.path(), served, t.size(), opts, t.sys.clone())
    }

    fn open_fd(
        target: &Path,
        served: OwnedFd,
        size: u64,
        opts: &TrackOptions,
        sys: Arc<dyn Sys>,
    ) -> Result<Tracker, CbtError> {
        const OP: &str = "track changes with";
        let mut st = stat_fd(&*sys, served.as_fd(), target)?;
        st.stamp.size = size;
        let path = state_path_for(target, opts.state_dir.as_deref(), st.is_block)?;
        if let Some(g) = opts.granularity {
            if !valid_granularity(g) {
                return Err(CbtError::msg(
                    OP,
                    &path,
                    format!("bitmap granularity {g} is not a power of two from 4 KiB to 64 MiB"),
                ));
            }
        }
        let (disk, created) = Disk::open(sys, path, true, target)?;
        if !disk.try_lock(SERVED_BYTE)? {
            return Err(CbtError::msg(
                OP,
                &disk.path,
                "another process already tracks this target (one server per target)",
            ));
        }
        disk.lock(MUTATION_BYTE, LockKind::Write)?;
        let r = Self::start(&disk, &st, opts.granularity, created);
        disk.unlock(MUTATION_BYTE);
        let (mem, damage) = r?;
        for e in &mem.header.checkpoints {
            if let Some(r) = e.reason {
                let why = match (&damage, r) {
                    (Some(what), Reason::Damaged) => damage_text(what),
                    _ => r.text().to_string(),
                };
                tracing::warn!(
                    "checkpoint {} of {} is inconsistent, reported as all changed: {why}",
                    e.name,
                    target.display(),
                );
            }
        }
        let (granularity, chunks) = (mem.header.granularity, mem.header.chunks());
        Ok(Tracker {
            disk,
            target: target.to_path_buf(),
            served,
            granularity,
            chunks,
            u: AtomicBits::new(chunks),
            dirty: AtomicBool::new(false),
            mem: RwLock::new(mem),
            io: Mutex::new(()),
            closed: AtomicBool::new(false),
            sync_failed: AtomicBool::new(false),
        })
    }

    /// Under the mutation lock: read (or make) the header, run the checks
    /// (bitmap damage included), give the file identities and format 2, set the open flag
    /// durably. Returns the memory and the damage found, if any.
    fn start(
        disk: &Disk,
        st: &super::disk::TargetStat,
        want: Option<u64>,
        created: bool,
    ) -> Result<(Mem, Option<String>), CbtError> {
        let mut h = match disk.read_header()? {
            Read::Ok(h) => {
                if let Some(g) = want.filter(|&g| g != h.granularity) {
                    return Err(CbtError::msg(
                        "track changes with",
                        &disk.path,
                        format!(
                            "bitmap granularity {g} asked for, but the state file has {}; \
                             omit --bitmap-granularity or delete the state file",
                            h.granularity
                        ),
                    ));
                }
                h
            }
            Read::Blank => {
                if !created {
                    warn_blank(&disk.path, true);
                }
                new_header(want.unwrap_or(DEFAULT_GRANULARITY), st.stamp)
            }
            Read::Corrupt(old) => {
                tracing::warn!(
                    "changed-block state {} is corrupt: every checkpoint is now inconsistent",
                    disk.path.display()
                );
                let g = old
                    .as_ref()
                    .map(|h| h.granularity)
                    .or(want)
                    .unwrap_or(DEFAULT_GRANULARITY);
                repair(old, g, st.stamp)
            }
        };
        check_unserved(&mut h, st);
        let (mut loaded, damage) = load_checked(disk, &mut h)?;
        // Identities (and format 2) before the open flag is committed: a
        // checkpoint's pages are stamped with its sequence number.
        upgrade(disk, &mut h, &mut loaded)?;
        h.open = true;
        disk.commit(&h)?;
        Ok((mem_of(h, loaded), damage))
    }

    /// Bytes per bitmap bit.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    pub fn state_path(&self) -> &Path {
        &self.disk.path
    }

    /// Before WRITE / WRITE_ZEROES / TRIM of [offset, offset+len) is issued.
    /// Lock-free fast path (atomic words) when the chunks are already
    /// marked; never fails, never does I/O.
    ///
    /// A write still in flight when a checkpoint is created may land after
    /// it: marking again after the write completes puts it in the newer
    /// checkpoint too (usually the fast path).
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 || self.chunks == 0 {
            return;
        }
        let first = offset / self.granularity;
        if first >= self.chunks {
            return;
        }
        let last = ((offset.saturating_add(len) - 1) / self.granularity).min(self.chunks - 1);
        // The flag after the bits (and their page summary), also when they
        // were set by another mark that may not have raised it yet: once
        // this returns, a persist that starts later takes these bits.
        self.u.set(first, last);
        if !self.dirty.load(Ordering::SeqCst) {
            self.dirty.store(true, Ordering::SeqCst);
        }
    }

    /// Before a FLUSH or FUA write is acknowledged. No I/O when nothing was
    /// marked since the last.
    pub fn persist(&self) -> Result<(), CbtError> {
        let _io = self.io.lock().unwrap_or_else(|e| e.into_inner());
        self.persist_locked()
    }

    /// With `io` held. Clearing `dirty` before taking U: a mark whose bits
    /// miss this take raises it again after.
    fn persist_locked(&self) -> Result<(), CbtError> {
        if self.sync_failed.load(Ordering::SeqCst) {
            return Err(CbtError::io(
                "persist changed-block state after a failed sync of",
                &self.disk.path,
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        if !self.dirty.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        let r = self.with_mutation(|| {
            self.refresh_locked()?;
            let (taken, write) = {
                let mut guard = self.mem_mut();
                let mem = &mut *guard;
                let taken = self.u.take();
                // The newest checkpoint, if consistent; with none (or only
                // inconsistent ones) the bits are needed by nobody.
                let newest = mem.header.checkpoints.len().checked_sub(1);
                let write = match (newest, mem.maps.last_mut()) {
                    (Some(k), Some(Some(map))) => {
                        // Only pages that gained bits (or that a failed
                        // persist left unwritten) are written: rewriting
                        // chunks already recorded costs no I/O, no sync.
                        for (p, words) in &taken.pages {
                            if map.or_page(*p, words) {
                                mem.unsynced.insert(*p);
                            }
                        }
                        let pages: Vec<(usize, Vec<u8>)> =
                            mem.unsynced.iter().map(|&p| (p, map.page(p))).collect();
                        (!pages.is_empty()).then_some((k, pages))
                    }
                    _ => None,
                };
                let idx = mem.index.last().cloned().flatten().unwrap_or_default();
                (taken, write.map(|w| (w, mem.header.clone(), idx)))
            };
            let Some(((k, pages), mut h, mut idx)) = write else {
                return Ok(());
            };
            // Pages, their index entries, then the header: its entry's new
            // index CRC commits them.
            let mut e = h.checkpoints[k].clone();
            let written = self
                .disk
                .write_recorded(&h, &mut e, &mut idx, &pages)
                .and_then(|()| {
                    h.checkpoints[k] = e;
                    self.disk.write_header(&h)
                });
            if written.is_ok() {
                // The file's header is this one now, synced or not: a
                // refresh must not take it for another process's change.
                let mut mem = self.mem_mut();
                mem.header = h;
                mem.index[k] = Some(idx);
            }
            let done = written.and_then(|()| self.sync());
            if done.is_err() {
                self.u.give_back(&taken);
            } else {
                // Serialized by `io`: nothing was added since the copy.
                let mut mem = self.mem_mut();
                mem.unsynced.clear();
            }
            done
        });
        if r.is_err() {
            self.dirty.store(true, Ordering::SeqCst);
        }
        r
    }

    /// fdatasync of the state file; the first failure is remembered and
    /// said once.
    fn sync(&self) -> Result<(), CbtError> {
        let r = self.disk.sync();
        if let Err(e) = &r {
            if !self.sync_failed.swap(true, Ordering::SeqCst) {
                tracing::error!(
                    "{e}: the marks it held may be lost, so every later FLUSH and FUA write \
                     fails with EIO and the next start finds the state not closed cleanly"
                );
            }
        }
        r
    }

    /// The in-memory state; a poisoned lock still holds consistent data
    /// (every writer replaces or ORs whole values).
    fn mem(&self) -> RwLockReadGuard<'_, Mem> {
        self.mem.read().unwrap_or_else(|e| e.into_inner())
    }

    fn mem_mut(&self) -> RwLockWriteGuard<'_, Mem> {
        self.mem.write().unwrap_or_else(|e| e.into_inner())
    }

    fn with_mutation<T>(&self, f: impl FnOnce() -> Result<T, CbtError>) -> Result<T, CbtError> {
        self.disk.lock(MUTATION_BYTE, LockKind::Write)?;
        let r = f();
        self.disk.unlock(MUTATION_BYTE);
        r
    }

    /// Pick up checkpoints created or deleted by another process.
    pub fn refresh(&self) -> Result<(), CbtError> {
        let _io = self.io.lock().unwrap_or_else(|e| e.into_inner());
        self.with_mutation(|| self.refresh_locked())
    }

    /// With the mutation lock held: re-read the header; reload everything
    /// when its generation moved (U stays: it is part of the newest).
    fn refresh_locked(&self) -> Result<(), CbtError> {
        let h = match self.disk.read_header()? {
            Read::Ok(h) => h,
            Read::Blank | Read::Corrupt(_) => self.overwritten(0)?,
        };
        // The same header and a file as long as its layout (a truncation
        // while served is seen here): nothing to do.
        if self.mem().header == h && super::index::short(&self.disk, &h)?.is_none() {
            return Ok(());
        }
        // Every other writer of this file (checkpoint create, delete) moves
        // the generation on; one that makes it anew gives it a new source
        // id. Our id without that is an older copy put back in place (or a
        // write of ours that failed half way): its bitmaps may lack what was
        // persisted since, so none is trusted.
        let (ours, id) = {
            let m = self.mem();
            (m.header.generation, m.header.source_id)
        };
        let h = if h.source_id == id && h.generation <= ours && h != self.mem().header {
            self.overwritten(ours)?
        } else {
            h
        };
        let h = if h.granularity != self.granularity || h.chunks() != self.chunks {
            // Rewritten with another geometry (a header repaired without
            // knowing ours): keep serving ours, every checkpoint as lost.
            tracing::warn!(
                "changed-block state {} changed granularity or size while served: every \
                 checkpoint is now inconsistent",
                self.disk.path.display()
            );
            let mut h = h;
            h.granularity = self.granularity;
            h.stamp = self.mem().header.stamp;
            h.all_inconsistent(Reason::Corrupt);
            h.generation += 1;
            h.open = true;
            self.disk.commit_unsynced(&h)?;
            self.sync()?;
            h
        } else {
            h
        };
        let mut h = h;
        let (loaded, damage) = load_checked(&self.disk, &mut h)?;
        if let Some(what) = damage {
            warn_damage(&h, &self.target, &what);
            self.disk.commit_unsynced(&h)?;
            self.sync()?;
        }
        *self.mem_mut() = mem_of(h, loaded);
        Ok(())
    }

    /// The file no longer holds what this server wrote (blank, corrupt, or
    /// written over): the header it knows, every checkpoint inconsistent,
    /// committed with a generation past `seen` and synced.
    fn overwritten(&self, seen: u64) -> Result<Header, CbtError> {
        tracing::warn!(
            "changed-block state {} was overwritten while served: every checkpoint \
             is now inconsistent",
            self.disk.path.display()
        );
        let mut h = self.mem().header.clone();
        h.all_inconsistent(Reason::Corrupt);
        h.generation = h.generation.max(seen) + 1;
        self.disk.commit_unsynced(&h)?;
        self.sync()?;
        Ok(h)
    }

    pub fn checkpoints(&self) -> Vec<CheckpointInfo> {
        infos(&self.mem().header)
    }

    /// Fails, naming the checkpoints there are, unless checkpoint `name`
    /// exists now (`serve --bitmap NAME`, checked at start).
    pub fn require(&self, name: &str) -> Result<(), CbtError> {
        let mem = self.mem();
        match mem.header.find(name) {
            Some(_) => Ok(()),
            None => Err(no_such(
                "find checkpoint in",
                &self.disk.path,
                &mem.header,
                name,
            )),
        }
    }

    /// Runs (length, changed) covering exactly [offset, offset+len)
    /// (chunk-aligned inside, the first and last run clipped to the
    /// request), merged (adjacent runs differ), at most `max_runs` (the last
    /// run then ends early; at least one run, none for `len == 0`). None: no
    /// such checkpoint. Inconsistent checkpoint: one run, all changed.
    pub fn changed(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Option<Vec<(u64, bool)>> {
        self.changed_of(name, None, offset, len, max_runs)
    }

    /// As [`Tracker::changed`] for the checkpoint `name` with sequence
    /// number `seq`: None also when the name now belongs to a newer
    /// checkpoint (deleted and made again), so a connection never reads
    /// another checkpoint's changes under the name it selected.
    pub fn changed_seq(
        &self,
        name: &str,
        seq: u64,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Option<Vec<(u64, bool)>> {
        self.changed_of(name, Some(seq), offset, len, max_runs)
    }

    fn changed_of(
        &self,
        name: &str,
        seq: Option<u64>,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Option<Vec<(u64, bool)>> {
        let mem = self.mem();
        let k = mem.header.find(name)?;
        if seq.is_some_and(|s| mem.header.checkpoints[k].seq != s) {
            return None;
        }
        if len == 0 {
            return Some(Vec::new());
        }
        let maps: Option<Vec<&dyn Leaves>> = mem.maps[k..]
            .iter()
            .map(|m| m.as_ref().map(|b| b as &dyn Leaves))
            .collect();
        let Some(mut maps) = maps else {
            return Some(vec![(len, true)]);
        };
        maps.push(&self.u);
        Some(bitmap::runs(
            self.granularity,
            self.chunks,
            offset,
            len,
            max_runs,
            &Union(maps),
        ))
    }

    /// Clean shutdown: persist, record the served target's identity,
    /// size/mtime/ctime (from its descriptor), clear
    /// the open flag, fdatasync, release the served lock. Idempotent; Drop
    /// does it best-effort with a log line on failure. After a failure the
    /// open flag stays set: the next start treats it as a crash.
    pub fn close(&self) -> Result<(), CbtError> {
        let _io = self.io.lock().unwrap_or_else(|e| e.into_inner());
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let r = self.persist_locked().and_then(|()| {
            self.with_mutation(|| {
                self.refresh_locked()?;
                let st = stat_fd(&*self.disk.sys, self.served.as_fd(), &self.target)?;
                let mut h = self.mem().header.clone();
                h.open = false;
                h.stamp.mtime = st.stamp.mtime;
                h.stamp.ctime = st.stamp.ctime;
                h.stamp.id = st.stamp.id;
                if st.stamp.size != h.stamp.size {
                    // Resized behind the server's back: the bitmaps no
                    // longer describe it, and the slot layout follows the
                    // size, so they could not even be found.
                    tracing::warn!(
                        "{} changed size while tracked ({} -> {} bytes): every checkpoint \
                         is now inconsistent",
                        self.target.display(),
                        h.stamp.size,
                        st.stamp.size
                    );
                    h.all_inconsistent(Reason::SizeChangedTracked);
                    h.stamp.size = st.stamp.size;
                }
                self.disk.commit_unsynced(&h)?;
                self.sync()?;
                self.mem_mut().header = h;
                Ok(())
            })
        });
        self.disk.unlock(SERVED_BYTE);
        r
    }

    /// Let go of the state file as a killed process would: no persist, the
    /// open flag left set, the locks released. For crash tests.
    pub fn abandon(self) {
        self.closed.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
impl Tracker {
    /// The chunks the state file (not memory) holds as changed since
    /// `name`, read under the mutation lock.
    pub(crate) fn persisted(&self, name: &str) -> Vec<u64> {
        self.with_mutation(|| {
            let Read::Ok(mut h) = self.disk.read_header()? else {
                panic!("unreadable header");
            };
            let k = h.find(name).expect("no such checkpoint");
            let (loaded, damage) = load_checked(&self.disk, &mut h)?;
            assert_eq!(damage, None);
            let bits = super::file::changed_since(&h, &loaded, k);
            Ok((0..h.chunks()).filter(|&c| bits.get(c)).collect())
        })
        .unwrap()
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::warn!("{e}");
        }
    }
}

/// Memory for header `header` and its checked bitmaps.
fn mem_of(header: Header, loaded: Vec<Option<Loaded>>) -> Mem {
    let (maps, index) = loaded
        .into_iter()
        .map(|l| match l {
            Some((bits, idx)) => (Some(bits), Some(idx)),
            None => (None, None),
        })
        .unzip();
    Mem {
        header,
        maps,
        index,
        unsynced: BTreeSet::new(),
    }
}

// Shared by every connection of a server.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Tracker>();
};

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker")
            .field("state", &self.disk.path)
            .field("granularity", &self.granularity)
            .finish_non_exhaustive()
    }
}
