//! The state file on disk ([`Disk`]: locks, header, slots, all through
//! [`Sys`]), the checks every opener makes (crash, outside change, corrupt
//! header), and [`StateFile`]: `rawdisk checkpoint` and local
//! `copy --changed-since`.
//!
//! Locks are OFD locks (per open file description, so two handles in one
//! process exclude each other like two processes): byte 0 is the short
//! "mutation" lock held while reading-and-writing the header, byte 1 the
//! "served" lock a tracking server holds for its whole life.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::bitmap::{self, Bits};
use super::format::{Bad, Entry, Header, Reason, Stamp, PAGE, V1};
use super::index::{load_checked, upgrade, Loaded, PageIndex};
use super::{
    valid_name, CbtError, Chain, CheckpointInfo, DEFAULT_GRANULARITY, MAX_CHECKPOINTS, MAX_NAME_LEN,
};
use crate::errno::retry;
use crate::sys::{FallocMode, LockCmd, LockKind, OpenHow, Sys};

pub(crate) const MUTATION_BYTE: u64 = 0;
pub(crate) const SERVED_BYTE: u64 = 1;

/// The target as the checks see it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TargetStat {
    pub is_block: bool,
    /// Size, and for a regular file its mtime/ctime (zero for a block
    /// device: writes to a device do not move its inode's times).
    pub stamp: Stamp,
}

pub(crate) fn stat_target(sys: &dyn Sys, target: &Path) -> Result<TargetStat, CbtError> {
    let fd = open_target(sys, target)?;
    stat_fd(sys, fd.as_fd(), target)
}

/// The target opened read-only, to stat it (and, for a tracker, to stat the
/// very inode it serves at close).
pub(crate) fn open_target(sys: &dyn Sys, target: &Path) -> Result<OwnedFd, CbtError> {
    retry(|| {
        sys.open(
            target,
            OpenHow {
                read_only: true,
                ..OpenHow::default()
            },
        )
    })
    .map_err(|e| CbtError::io("stat target", target, e))
}

/// The stamp of the open target `fd` (named `target` in errors): what is
/// served, whatever the path names by now.
pub(crate) fn stat_fd(
    sys: &dyn Sys,
    fd: BorrowedFd<'_>,
    target: &Path,
) -> Result<TargetStat, CbtError> {
    const OP: &str = "stat target";
    let err = |e| CbtError::io(OP, target, e);
    let st = retry(|| sys.fstat(fd)).map_err(err)?;
    if st.is_block {
        let g = retry(|| sys.block_geometry(fd)).map_err(err)?;
        return Ok(TargetStat {
            is_block: true,
            stamp: Stamp {
                size: g.size,
                id: Some((st.rdev, 0)),
                ..Stamp::default()
            },
        });
    }
    if !st.is_regular {
        return Err(CbtError::io(
            OP,
            target,
            crate::engine::not_an_image(st.type_name),
        ));
    }
    Ok(TargetStat {
        is_block: false,
        stamp: Stamp {
            size: st.size,
            mtime: st.mtime,
            ctime: st.ctime,
            id: Some((st.dev, st.ino)),
        },
    })
}

/// Fails unless `target` is a regular file or a block device (a FIFO is
/// refused without waiting for a writer): for commands that find no state
/// file and would otherwise say nothing.
pub fn check_target(target: &Path) -> Result<(), CbtError> {
    stat_target(&crate::sys::RealSys, target).map(|_| ())
}

pub(crate) fn state_path_for(
    target: &Path,
    state_dir: Option<&Path>,
    is_block: bool,
) -> Result<PathBuf, CbtError> {
    if is_block && state_dir.is_none() {
        return Err(CbtError::msg(
            "find the changed-block state of",
            target,
            "a block device keeps its state in a directory: pass --state-dir DIR",
        ));
    }
    super::state_path(target, state_dir)
}

/// The state file's open descriptor and every I/O on it.
pub(crate) struct Disk {
    pub sys: Arc<dyn Sys>,
    pub path: PathBuf,
    pub fd: OwnedFd,
}

/// What reading a header found.
pub(crate) enum Read {
    Ok(Header),
    /// Never written.
    Blank,
    /// CRC mismatch: what still parses (names to report), if anything.
    Corrupt(Option<Header>),
}

impl Disk {
    /// Open the state file at `path`, relative to its directory's
    /// descriptor and never through a symlink; with `create`, make it if
    /// absent (O_EXCL: the file made is the one opened). A symlink, a FIFO
    /// or anything but a regular file there is refused with one line.
    /// Returns whether this call made the file.
    pub(crate) fn open(
        sys: Arc<dyn Sys>,
        path: PathBuf,
        create: bool,
        target: &Path,
    ) -> Result<(Disk, bool), CbtError> {
        const OP: &str = "open changed-block state";
        let dir_path = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let name = Path::new(path.file_name().unwrap_or_default());
        let dir_how = OpenHow {
            read_only: true,
            directory: true,
            ..OpenHow::default()
        };
        let dir = retry(|| sys.open(dir_path, dir_how)).map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOENT) && create {
                CbtError::msg(
                    "create changed-block state",
                    &path,
                    "its directory does not exist: create it first",
                )
            } else {
                Self::open_err(&path, create, target, e)
            }
        })?;
        let how = OpenHow {
            no_follow: true,
            ..OpenHow::default()
        };
        let made = if create {
            let new = OpenHow {
                create_new: true,
                ..how
            };
            match retry(|| sys.open_at(dir.as_fd(), name, new)) {
                Ok(fd) => Some(fd),
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => None,
                Err(e) => return Err(Self::open_err(&path, create, target, e)),
            }
        } else {
            None
        };
        let created = made.is_some();
        let fd = match made {
            Some(fd) => fd,
            None => retry(|| sys.open_at(dir.as_fd(), name, how))
                .map_err(|e| Self::open_err(&path, create, target, e))?,
        };
        let st = retry(|| sys.fstat(fd.as_fd())).map_err(|e| CbtError::io(OP, &path, e))?;
        if !st.is_regular {
            return Err(CbtError::msg(
                OP,
                &path,
                format!(
                    "{} is a {}, not a state file: move it away",
                    path.display(),
                    st.type_name
                ),
            ));
        }
        Ok((Disk { sys, path, fd }, created))
    }

    /// The open of an existing state file failed: say why in one line.
    fn open_err(path: &Path, create: bool, target: &Path, e: std::io::Error) -> CbtError {
        const OP: &str = "open changed-block state";
        match e.raw_os_error() {
            // O_NOFOLLOW's answer for a symlink as the last component.
            Some(libc::ELOOP) => CbtError::msg(
                OP,
                path,
                format!(
                    "refusing to follow a symlink at {}: move it away",
                    path.display()
                ),
            ),
            Some(libc::ENOENT) if !create => CbtError::msg(
                OP,
                path,
                format!(
                    "no such file: {} has no checkpoints yet (rawdisk checkpoint create, \
                     or serve it with --track-changes)",
                    target.display()
                ),
            ),
            _ => CbtError::io(OP, path, e),
        }
    }

    fn err(&self, op: &'static str) -> impl Fn(std::io::Error) -> CbtError + '_ {
        move |e| CbtError::io(op, &self.path, e)
    }

    pub(crate) fn lock(&self, byte: u64, kind: LockKind) -> Result<(), CbtError> {
        retry(|| {
            self.sys
                .ofd_lock(self.fd.as_fd(), LockCmd::SetWait, kind, byte, 1)
        })
        .map(|_| ())
        .map_err(self.err("lock changed-block state"))
    }

    pub(crate) fn unlock(&self, byte: u64) {
        if let Err(e) = self
            .sys
            .ofd_lock(self.fd.as_fd(), LockCmd::Set, LockKind::Unlock, byte, 1)
        {
            // Closing the descriptor releases it anyway.
            tracing::warn!("unlock {}: {e}", self.path.display());
        }
    }

    /// Take a lock without waiting: Ok(false) when another holds it.
    pub(crate) fn try_lock(&self, byte: u64) -> Result<bool, CbtError> {
        match self
            .sys
            .ofd_lock(self.fd.as_fd(), LockCmd::Set, LockKind::Write, byte, 1)
        {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) => Ok(false),
            Err(e) => Err(self.err("lock changed-block state")(e)),
        }
    }

    /// Whether another description holds the served lock.
    pub(crate) fn served(&self) -> Result<bool, CbtError> {
        self.sys
            .ofd_lock(
                self.fd.as_fd(),
                LockCmd::Get,
                LockKind::Write,
                SERVED_BYTE,
                1,
            )
            .map_err(self.err("test the served lock of changed-block state"))
    }

    /// Read [offset, offset+buf.len()); bytes past the end of the file read
    /// as zeros (a slot never written).
    pub(crate) fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), CbtError> {
        let mut done = 0;
        while done < buf.len() {
            let n = retry(|| {
                self.sys
                    .pread(self.fd.as_fd(), &mut buf[done..], offset + done as u64)
            })
            .map_err(self.err("read changed-block state"))?;
            if n == 0 {
                buf[done..].fill(0);
                break;
            }
            done += n;
        }
        Ok(())
    }

    pub(crate) fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), CbtError> {
        let mut done = 0;
        while done < buf.len() {
            let n = retry(|| {
                self.sys
                    .pwrite(self.fd.as_fd(), &buf[done..], offset + done as u64)
            })
            .map_err(self.err("write changed-block state"))?;
            if n == 0 {
                return Err(self.err("write changed-block state")(std::io::Error::from(
                    std::io::ErrorKind::WriteZero,
                )));
            }
            done += n;
        }
        Ok(())
    }

    pub(crate) fn sync(&self) -> Result<(), CbtError> {
        retry(|| self.sys.fdatasync(self.fd.as_fd())).map_err(self.err("sync changed-block state"))
    }

    pub(crate) fn read_header(&self) -> Result<Read, CbtError> {
        let mut p = [0u8; PAGE];
        self.read_at(&mut p, 0)?;
        match Header::decode(&p) {
            Ok(h) => Ok(Read::Ok(h)),
            Err(Bad::Blank) => Ok(Read::Blank),
            Err(Bad::Corrupt(h)) => Ok(Read::Corrupt(h)),
            Err(Bad::NotState) => Err(CbtError::msg(
                "read changed-block state",
                &self.path,
                "not a rawdisk changed-block state file (bad magic); move it away",
            )),
            Err(Bad::Version(v)) => Err(CbtError::msg(
                "read changed-block state",
                &self.path,
                format!("format version {v} is newer than this rawdisk reads"),
            )),
        }
    }

    pub(crate) fn write_header(&self, h: &Header) -> Result<(), CbtError> {
        self.write_at(&h.encode(), 0)
    }

    /// The state file's apparent length.
    pub(crate) fn len(&self) -> Result<u64, CbtError> {
        retry(|| self.sys.fstat(self.fd.as_fd()))
            .map(|st| st.size)
            .map_err(self.err("stat changed-block state"))
    }

    /// Write header `h` (after making the file as long as its layout: a
    /// new file, a new geometry, a conversion, a short file repaired) and
    /// fdatasync: the commit point of every change.
    pub(crate) fn commit(&self, h: &Header) -> Result<(), CbtError> {
        self.commit_unsynced(h)?;
        self.sync()
    }

    /// [`Disk::commit`] without the fdatasync, for a caller that syncs
    /// through its own rule (the tracker: a failed sync stays failed).
    pub(crate) fn commit_unsynced(&self, h: &Header) -> Result<(), CbtError> {
        if self.len()? < h.file_len() {
            retry(|| self.sys.ftruncate(self.fd.as_fd(), h.file_len()))
                .map_err(self.err("extend changed-block state"))?;
        }
        self.write_header(h)
    }

    /// A slot's bitmap; holes are skipped (SEEK_DATA) and only pages with
    /// bits kept, so a sparse slot of a huge target reads and costs little.
    pub(crate) fn read_slot(&self, h: &Header, slot: u32) -> Result<Bits, CbtError> {
        let chunks = h.chunks();
        // The pages holding the bitmap's words; the slot has no others.
        let pages = (chunks.div_ceil(64) * 8).div_ceil(PAGE as u64);
        let mut bits = Bits::new(chunks);
        self.data_pages(h.slot_offset(slot), pages, &mut |p, page| {
            bits.load_page(p as usize, page)
        })?;
        Ok(bits)
    }

    /// Call `f(index, bytes)`, in order, for the pages of `pages` pages
    /// from `start` that may hold data: holes (SEEK_DATA) are skipped, so
    /// a sparse region costs what it holds.
    pub(crate) fn data_pages(
        &self,
        start: u64,
        pages: u64,
        f: &mut dyn FnMut(u64, &[u8]),
    ) -> Result<(), CbtError> {
        /// Pages read at once.
        const BATCH: u64 = 16;
        let end = start + pages * PAGE as u64;
        let mut buf = vec![0u8; BATCH as usize * PAGE];
        let mut at = start;
        while at < end {
            let data = match retry(|| self.sys.seek_data(self.fd.as_fd(), at)) {
                Ok(Some(d)) => d.max(at),
                Ok(None) => break,
                // No SEEK_DATA here: read it all.
                Err(_) => at,
            };
            if data >= end {
                break;
            }
            let hole = match retry(|| self.sys.seek_hole(self.fd.as_fd(), data)) {
                Ok(Some(h)) => h.min(end),
                _ => end,
            };
            let hole = hole.max(data + 1).min(end);
            // The whole pages around the data.
            let mut p = (data - start) / PAGE as u64;
            let stop = (hole - start).div_ceil(PAGE as u64);
            while p < stop {
                let n = (stop - p).min(BATCH);
                let buf = &mut buf[..n as usize * PAGE];
                self.read_at(buf, start + p * PAGE as u64)?;
                for (i, page) in buf.chunks_exact(PAGE).enumerate() {
                    f(p + i as u64, page);
                }
                p += n;
            }
            at = start + stop * PAGE as u64;
        }
        Ok(())
    }

    /// Write whole pages `(index, bytes)` into `slot`.
    pub(crate) fn write_page_bytes(
        &self,
        h: &Header,
        slot: u32,
        pages: &[(usize, Vec<u8>)],
    ) -> Result<(), CbtError> {
        let start = h.slot_offset(slot);
        for (p, bytes) in pages {
            self.write_at(bytes, start + (p * PAGE) as u64)?;
        }
        Ok(())
    }

    /// Make a slot all zeros: punch it out (a hole), or where the file
    /// system cannot, overwrite its data with zeros.
    pub(crate) fn clear_slot(&self, h: &Header, slot: u32) -> Result<(), CbtError> {
        self.clear_range(h.slot_offset(slot), h.slot_bytes())
    }

    /// Make a slot's page index all zeros (no page written).
    pub(crate) fn clear_index(&self, h: &Header, slot: u32) -> Result<(), CbtError> {
        self.clear_range(h.index_offset(slot), h.index_bytes())
    }

    /// Make whole pages all zeros: punch them out, or where the file system
    /// cannot, overwrite the pages holding data with zeros.
    fn clear_range(&self, start: u64, len: u64) -> Result<(), CbtError> {
        match retry(|| {
            self.sys
                .fallocate(self.fd.as_fd(), FallocMode::PunchHole, start, len)
        }) {
            Ok(()) => Ok(()),
            Err(e) if crate::errno::is_unsupported(&e, crate::errno::Einval::Invalid) => {
                let mut data = Vec::new();
                self.data_pages(start, len / PAGE as u64, &mut |p, page| {
                    if page.iter().any(|&b| b != 0) {
                        data.push(p);
                    }
                })?;
                let zero = [0u8; PAGE];
                for p in data {
                    self.write_at(&zero, start + p * PAGE as u64)?;
                }
                Ok(())
            }
            Err(e) => Err(self.err("clear part of changed-block state")(e)),
        }
    }
}

/// A fresh header for a new (or blank, or unreadable) state file.
pub(crate) fn new_header(granularity: u64, stamp: Stamp) -> Header {
    Header {
        version: super::format::VERSION,
        granularity,
        stamp,
        generation: 1,
        open: false,
        checkpoints: Vec::new(),
        source_id: random_id(),
        next_seq: 1,
    }
}

/// 16 random bytes: a new state file's source id. The kernel's, else (no
/// /dev/urandom) the std hasher's OS-seeded keys mixed with the time and
/// the process id.
pub(crate) fn random_id() -> [u8; 16] {
    use std::io::Read as _;
    let mut id = [0u8; 16];
    let kernel = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut id));
    if kernel.is_err() || id == [0; 16] {
        use std::hash::{BuildHasher, Hasher};
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        for half in id.chunks_exact_mut(8) {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(now);
            h.write_u32(std::process::id());
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    id
}

/// Assigns a format-1 header's source id and sequence numbers; true when
/// it did (the caller writes the header).
pub(crate) fn assign_ids(h: &mut Header) -> bool {
    !h.has_ids() && h.assign_ids(random_id())
}

/// A corrupt header made usable: every checkpoint whose name still parses
/// is kept as inconsistent ("corrupt"), the rest forgotten.
pub(crate) fn repair(h: Option<Header>, granularity: u64, stamp: Stamp) -> Header {
    let mut fixed = new_header(granularity, stamp);
    if let Some(old) = h {
        fixed.generation = old.generation.wrapping_add(1);
        fixed.checkpoints = old.checkpoints;
        // Under the new source id, numbered afresh: an old sequence number
        // could be one the new counter hands out again.
        for e in &mut fixed.checkpoints {
            e.reason = Some(Reason::Corrupt);
            e.seq = 0;
        }
        fixed.assign_ids(fixed.source_id);
    }
    fixed
}

/// The checks of an opener that finds nobody serving: a set open flag is a
/// crash; a target of another identity (device, inode) is another file; a
/// target whose size or times moved since they were recorded was changed
/// from outside. An identity not recorded (older state files) is recorded
/// now; the other checks still apply. Either makes every checkpoint inconsistent. Then
/// the current stamp is recorded and the open flag cleared (in `h`; the
/// caller writes it if it writes at all). Returns what was found when it
/// made a consistent checkpoint inconsistent: the caller says it, once.
pub(crate) fn check_unserved(h: &mut Header, now: &TargetStat) -> Option<Reason> {
    let found = if h.open {
        Some(Reason::Crash)
    } else if h.stamp.id.is_some() && now.stamp.id != h.stamp.id {
        // Compared strictly, device included: a device number that moved
        // (a remount) costs a full backup, a missed replacement a wrong one.
        Some(Reason::Replaced)
    } else if now.stamp.size != h.stamp.size {
        Some(Reason::SizeChanged)
    } else if !now.is_block
        && (now.stamp.mtime != h.stamp.mtime || now.stamp.ctime != h.stamp.ctime)
    {
        Some(Reason::Modified)
    } else {
        None
    };
    let mut news = None;
    if let Some(r) = found {
        if h.checkpoints.iter().any(|e| e.reason.is_none()) {
            news = Some(r);
        }
        h.all_inconsistent(r);
    }
    h.open = false;
    // A new size changes the slot layout: only with every checkpoint
    // inconsistent (above), whose slots are never read again.
    h.stamp = now.stamp;
    news
}

pub(crate) fn infos(h: &Header) -> Vec<CheckpointInfo> {
    h.checkpoints
        .iter()
        .enumerate()
        .map(|(k, e)| CheckpointInfo {
            id: h.identity(k),
            seq: e.seq,
            name: e.name.clone(),
            created: e.created,
            consistent: e.reason.is_none(),
            reason: e.reason.map(|r| r.text().to_string()),
        })
        .collect()
}

/// OR of the bitmaps of checkpoints `k..` (all consistent: loaded).
pub(crate) fn changed_since(h: &Header, loaded: &[Option<Loaded>], k: usize) -> Bits {
    let mut acc = Bits::new(h.chunks());
    for (bits, _) in loaded[k..].iter().flatten() {
        acc.or(bits);
    }
    acc
}

/// The reason text of a damage found now, with what was found.
pub(crate) fn damage_text(what: &str) -> String {
    format!("the state file's bitmap is damaged ({what})")
}

/// Say that checkpoints became inconsistent because of `what` (damage).
pub(crate) fn warn_damage(h: &Header, target: &Path, what: &str) {
    let names: Vec<&str> = h
        .checkpoints
        .iter()
        .filter(|e| e.reason == Some(Reason::Damaged))
        .map(|e| e.name.as_str())
        .collect();
    tracing::warn!(
        "checkpoint {} of {} inconsistent, reported as all changed: {}",
        names.join(", "),
        target.display(),
        damage_text(what)
    );
}

/// Say that an existing state file was empty (0 bytes or all zeros): damage,
/// not a new file. `remade`: a writer made a new one in its place.
pub(crate) fn warn_blank(path: &Path, remade: bool) {
    tracing::warn!(
        "changed-block state {} {} empty (0 bytes or all zeros): damaged{}; the checkpoints \
         it held, if any, are lost, and the next backup must be a full copy",
        path.display(),
        if remade { "was" } else { "is" },
        if remade { ", made anew" } else { "" }
    );
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// (offset, length) ranges in offset order.
type Ranges = Vec<(u64, u64)>;

/// A header as an opener's checks leave it: see [`StateFile::checked_header`].
struct Checked {
    h: Header,
    served: bool,
    /// The bitmap and index of each consistent checkpoint.
    loaded: Vec<Option<Loaded>>,
    /// What damage the checks found now, if any.
    damage: Option<String>,
}

/// A target's state file opened for checkpoint commands; works while a
/// server tracks the target (edits happen under the mutation lock).
pub struct StateFile {
    disk: Disk,
    target: PathBuf,
}

impl StateFile {
    /// `create`: make the state file (recording the target's
    /// size/mtime/ctime) if absent.
    pub fn open(
        target: &Path,
        state_dir: Option<&Path>,
        create: bool,
    ) -> Result<StateFile, CbtError> {
        Self::open_with_sys(target, state_dir, create, Arc::new(crate::sys::RealSys))
    }

    /// [`StateFile::open`] through `sys` (tests inject faults with it).
    pub fn open_with_sys(
        target: &Path,
        state_dir: Option<&Path>,
        create: bool,
        sys: Arc<dyn Sys>,
    ) -> Result<StateFile, CbtError> {
        let st = stat_target(&*sys, target)?;
        let path = state_path_for(target, state_dir, st.is_block)?;
        let (disk, created) = Disk::open(sys, path, create, target)?;
        let f = StateFile {
            disk,
            target: target.to_path_buf(),
        };
        f.locked(LockKind::Write, |d| match d.read_header()? {
            Read::Blank if create => {
                if !created {
                    warn_blank(&d.path, true);
                }
                d.commit(&new_header(DEFAULT_GRANULARITY, st.stamp))
            }
            // A file without identities: its first opener gives them,
            // durably, so every later reader sees the same. Only those in
            // format 1 (the checks and the conversion are the commands'
            // own); format 2 stamps its pages with the sequence numbers,
            // so its checked bitmaps are indexed anew with them (unless a
            // server owns them: it gave its file identities at start).
            Read::Ok(mut h) if !h.has_ids() => {
                if h.version == V1 {
                    assign_ids(&mut h);
                } else if d.served()? {
                    return Ok(());
                } else {
                    let (mut loaded, damage) = load_checked(d, &mut h)?;
                    if let Some(what) = damage {
                        warn_damage(&h, &f.target, &what);
                    }
                    upgrade(d, &mut h, &mut loaded)?;
                }
                d.commit(&h)
            }
            _ => Ok(()),
        })?;
        Ok(f)
    }

    /// The state file's path.
    pub fn path(&self) -> &Path {
        &self.disk.path
    }

    /// Whether a tracking server holds the state file (its "served" lock).
    pub fn served(&self) -> Result<bool, CbtError> {
        self.disk.served()
    }

    fn locked<T>(
        &self,
        kind: LockKind,
        f: impl FnOnce(&Disk) -> Result<T, CbtError>,
    ) -> Result<T, CbtError> {
        self.disk.lock(MUTATION_BYTE, kind)?;
        let r = f(&self.disk);
        self.disk.unlock(MUTATION_BYTE);
        r
    }

    /// The header as the checks leave it (under the mutation lock), whether
    /// a server tracks the target, and the checked bitmaps. While served
    /// the server owns the open flag and the stamp, so only a corrupt
    /// header and damaged bitmaps are handled (the file is consistent under
    /// the lock). `say`: warn when the checks made checkpoints
    /// inconsistent; a caller that reports the inconsistency itself passes
    /// false, so it is said once (and an empty file is its error).
    fn checked_header(&self, d: &Disk, say: bool) -> Result<Checked, CbtError> {
        let served = d.served()?;
        let st = stat_target(&*d.sys, &self.target)?;
        let mut h = match d.read_header()? {
            Read::Ok(h) => h,
            Read::Blank if say => {
                warn_blank(&d.path, false);
                new_header(DEFAULT_GRANULARITY, st.stamp)
            }
            Read::Blank => {
                return Err(CbtError::msg(
                    "read changed-block state",
                    &d.path,
                    "it is empty (0 bytes or all zeros): damaged, its checkpoints are lost; \
                     make a full copy",
                ))
            }
            Read::Corrupt(old) => {
                if say {
                    tracing::warn!(
                        "changed-block state {} is corrupt: every checkpoint is now inconsistent",
                        d.path.display()
                    );
                }
                let g = old.as_ref().map_or(DEFAULT_GRANULARITY, |h| h.granularity);
                let mut h = repair(old, g, st.stamp);
                // The server (if any) set the open flag it still holds.
                h.open = served;
                h
            }
        };
        if !served {
            if let Some(r) = check_unserved(&mut h, &st).filter(|_| say) {
                tracing::warn!(
                    "every checkpoint of {} is inconsistent, reported as all changed: {}",
                    self.target.display(),
                    r.text()
                );
            }
        }
        let (loaded, damage) = load_checked(d, &mut h)?;
        if let Some(what) = damage.as_deref().filter(|_| say) {
            warn_damage(&h, &self.target, what);
        }
        Ok(Checked {
            h,
            served,
            loaded,
            damage,
        })
    }

    /// `name: None` picks "cp-N" (N = 1 + highest used). Duplicate name: error.
    pub fn create_checkpoint(&mut self, name: Option<&str>) -> Result<CheckpointInfo, CbtError> {
        const OP: &str = "create checkpoint in";
        if let Some(n) = name {
            check_name(OP, &self.disk.path, n)?;
        }
        self.locked(LockKind::Write, |d| {
            let Checked {
                mut h, mut loaded, ..
            } = self.checked_header(d, true)?;
            let name = match name {
                Some(n) => n.to_string(),
                None => {
                    let top = h
                        .checkpoints
                        .iter()
                        .filter_map(|e| e.name.strip_prefix("cp-")?.parse::<u64>().ok())
                        .max()
                        .unwrap_or(0);
                    format!("cp-{}", top + 1)
                }
            };
            if h.find(&name).is_some() {
                return Err(CbtError::msg(
                    OP,
                    &d.path,
                    format!("a checkpoint named '{name}' exists; pick another name"),
                ));
            }
            if h.checkpoints.len() >= MAX_CHECKPOINTS {
                return Err(CbtError::msg(
                    OP,
                    &d.path,
                    format!("it holds {MAX_CHECKPOINTS} checkpoints, the most it can: delete one"),
                ));
            }
            // Identities and format 2 before anything is stamped.
            upgrade(d, &mut h, &mut loaded)?;
            let used: Vec<u32> = h
                .checkpoints
                .iter()
                .filter(|e| e.reason.is_none())
                .map(|e| e.slot)
                .collect();
            let slot = (0..MAX_CHECKPOINTS as u32)
                .find(|s| !used.contains(s))
                .expect("fewer checkpoints than slots");
            // The slot and its index may hold a deleted checkpoint's: clear
            // them, make that durable, then commit the header that points
            // to them.
            d.clear_slot(&h, slot)?;
            d.clear_index(&h, slot)?;
            d.sync()?;
            let mut e = Entry {
                name,
                created: now_secs(),
                reason: None,
                slot,
                index_crc: 0,
                written: 0,
                seq: h.next_seq,
            };
            h.next_seq += 1;
            PageIndex::default().seal(&h, &mut e);
            h.checkpoints.push(e.clone());
            h.generation += 1;
            d.commit(&h)?;
            tracing::info!("checkpoint {} created in {}", e.name, d.path.display());
            Ok(infos(&h).pop().expect("the checkpoint just added"))
        })
    }

    pub fn delete_checkpoint(&mut self, name: &str) -> Result<(), CbtError> {
        const OP: &str = "delete checkpoint from";
        self.locked(LockKind::Write, |d| {
            let Checked {
                mut h, mut loaded, ..
            } = self.checked_header(d, true)?;
            let Some(k) = h.find(name) else {
                return Err(no_such(OP, &d.path, &h, name));
            };
            // Identities and format 2 before anything is stamped.
            upgrade(d, &mut h, &mut loaded)?;
            let victim = h.checkpoints[k].clone();
            if let (Some(pk), Some((bits, _))) = (k.checked_sub(1), loaded[k].take()) {
                if let Some((mut merged, mut idx)) = loaded[pk].take() {
                    // The previous checkpoint's bitmap (and index) takes
                    // this one's bits durably before the header forgets it.
                    merged.or(&bits);
                    let pages: Vec<(usize, Vec<u8>)> = bits
                        .pages()
                        .into_iter()
                        .map(|p| (p, merged.page(p)))
                        .collect();
                    let mut prev = h.checkpoints[pk].clone();
                    d.write_recorded(&h, &mut prev, &mut idx, &pages)?;
                    h.checkpoints[pk] = prev;
                    d.sync()?;
                }
            }
            h.checkpoints.remove(k);
            h.generation += 1;
            d.commit(&h)?;
            if victim.reason.is_none() {
                // Give the freed slot's blocks back; nothing reads it again
                // before a create clears it anyway.
                if let Err(e) = d.clear_slot(&h, victim.slot) {
                    tracing::debug!("{e}");
                }
                if let Err(e) = d.clear_index(&h, victim.slot) {
                    tracing::debug!("{e}");
                }
            }
            tracing::info!("checkpoint {name} deleted from {}", d.path.display());
            Ok(())
        })
    }

    pub fn list(&self) -> Result<Vec<CheckpointInfo>, CbtError> {
        self.locked(LockKind::Read, |d| {
            Ok(infos(&self.checked_header(d, true)?.h))
        })
    }

    /// (offset, length) ranges changed since `name`, merged, covering the
    /// target's size. Error while served (the server holds unpersisted
    /// changes: read them through its NBD export). Checks for outside change
    /// and damage first (then everything is changed). Inconsistent: one
    /// range, the whole target.
    pub fn changed_ranges(&self, name: &str) -> Result<Vec<(u64, u64)>, CbtError> {
        self.changes_since(name).map(|(ranges, _)| ranges)
    }

    /// [`StateFile::changed_ranges`], and why checkpoint `name` is
    /// inconsistent when it is, from one look at the state. Logs nothing:
    /// the caller tells the user what it means for them.
    pub fn changes_since(&self, name: &str) -> Result<(Ranges, Option<String>), CbtError> {
        self.changes_and_chain(name).map(|(r, why, _)| (r, why))
    }

    /// The source's identity and checkpoints as the checks leave them
    /// (read under the mutation lock): what a full copy records.
    pub fn chain(&self) -> Result<Chain, CbtError> {
        self.locked(LockKind::Read, |d| {
            chain_of(d, &self.checked_header(d, false)?.h)
        })
    }

    /// [`StateFile::changes_since`] and the [`Chain`] of the same look at
    /// the state: the checkpoints that existed when the ranges were read.
    pub fn changes_and_chain(
        &self,
        name: &str,
    ) -> Result<(Ranges, Option<String>, Chain), CbtError> {
        const OP: &str = "read changed ranges from";
        self.locked(LockKind::Read, |d| {
            let Checked {
                h,
                served,
                loaded,
                damage,
            } = self.checked_header(d, false)?;
            let chain = chain_of(d, &h)?;
            if served {
                return Err(CbtError::msg(
                    OP,
                    &d.path,
                    "a server tracks this target and holds changes not yet persisted: \
                     read them through its NBD export (copy --changed-since with an nbd:// \
                     or nbd+unix:// source)",
                ));
            }
            let Some(k) = h.find(name) else {
                return Err(no_such(OP, &d.path, &h, name));
            };
            let size = h.stamp.size;
            if let Some(r) = h.checkpoints[k].reason {
                let whole = if size == 0 { vec![] } else { vec![(0, size)] };
                let why = match (&damage, r) {
                    (Some(what), Reason::Damaged) => damage_text(what),
                    _ => r.text().to_string(),
                };
                return Ok((whole, Some(why), chain));
            }
            let bits = changed_since(&h, &loaded, k);
            let mut out = Vec::new();
            let mut at = 0;
            for (len, changed) in
                bitmap::runs(h.granularity, h.chunks(), 0, size, usize::MAX, &bits)
            {
                if changed {
                    out.push((at, len));
                }
                at += len;
            }
            Ok((out, None, chain))
        })
    }
}

/// `h` as a [`Chain`]: its identities count only when they are the ones on
/// disk (a header repaired or made in memory by a reader is not written).
fn chain_of(d: &Disk, h: &Header) -> Result<Chain, CbtError> {
    let durable = match d.read_header()? {
        Read::Ok(disk) => disk.has_ids() && disk.source_id == h.source_id,
        _ => false,
    };
    Ok(Chain {
        source_id: durable.then(|| super::format::hex(&h.source_id)),
        size: h.stamp.size,
        checkpoints: infos(h),
    })
}

fn check_name(op: &'static str, path: &Path, name: &str) -> Result<(), CbtError> {
    if valid_name(name) {
        return Ok(());
    }
    Err(CbtError::msg(
        op,
        path,
        format!(
            "invalid checkpoint name '{name}': use 1 to {MAX_NAME_LEN} of A-Z a-z 0-9 . _ - \
             (not starting with . or -)"
        ),
    ))
}

pub(crate) fn no_such(op: &'static str, path: &Path, h: &Header, name: &str) -> CbtError {
    let names: Vec<&str> = h.checkpoints.iter().map(|e| e.name.as_str()).collect();
    let have = if names.is_empty() {
        "there are none".to_string()
    } else {
        format!("there are: {}", names.join(", "))
    };
    CbtError::msg(op, path, format!("no checkpoint named '{name}' ({have})"))
}
