//! The state file's handle ([`Disk`]: locks, header, slots, all through
//! [`Sys`]), the target's identity as the checks see it, and the header
//! helpers a new, converted or repaired file needs. `index.rs` adds the page
//! index on top; `file.rs` the checks every opener makes and [`StateFile`].
//!
//! Locks are OFD locks (per open file description, so two handles in one
//! process exclude each other like two processes): byte 0 is the short
//! "mutation" lock held while reading-and-writing the header, byte 1 the
//! "served" lock a tracking server holds for its whole life.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::bitmap::Bits;
use super::format::{Bad, Header, Reason, Stamp, PAGE};
use super::CbtError;
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
