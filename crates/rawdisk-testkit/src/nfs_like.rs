//! An NFS-like file system: a FUSE pass-through over a backing directory
//! that offers only what the Linux NFS client offers (docs/capabilities.md,
//! NFS), waits a set latency per operation and counts what it receives.
//!
//! * [`Profile::Nfs3`]: no `fallocate` (EOPNOTSUPP), no `lseek` SEEK_DATA /
//!   SEEK_HOLE (answered ENOSYS once; the kernel then reports the whole file
//!   as data, as the NFS client does without the SEEK operation), no server
//!   side copy (`copy_file_range` is ENOSYS: the kernel copies through the
//!   page cache, reading and writing over the "wire").
//! * [`Profile::Nfs42`]: `fallocate(0)` (ALLOCATE) and `PUNCH_HOLE |
//!   KEEP_SIZE` (DEALLOCATE) only, SEEK_DATA/SEEK_HOLE (SEEK),
//!   `copy_file_range` (COPY).
//!
//! Neither has reflink (FUSE has no `remap_file_range`: FICLONE is
//! EOPNOTSUPP in the VFS). Writes are write-through (no FUSE writeback
//! cache) and at most `max_write` bytes each (`wsize`). The counts are read
//! from the virtual file [`STATS_NAME`] at the root (not listed, not
//! counted) as one JSON object, or from [`NfsLike::counts`] in process.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{
    DirBuilderExt, DirEntryExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Config, CopyFileRangeFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, KernelConfig, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen,
    ReplyStatfs, ReplyWrite, Request, Session, SessionACL, TimeOrNow, WriteFlags,
};
use nix::fcntl::FallocateFlags;

/// The virtual file at the root holding the counts (JSON).
pub const STATS_NAME: &str = ".nfs-like-stats";
const STATS_INO: u64 = u64::MAX - 1;
/// Attributes and names are cached by the kernel this long. Every change goes
/// through this mount, and the kernel invalidates what a write, truncate or
/// fallocate changes, so the cache is never stale here.
const TTL: Duration = Duration::from_secs(1);

/// Which NFS client the file system behaves like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Profile {
    Nfs3,
    Nfs42,
}

impl Profile {
    pub fn name(self) -> &'static str {
        match self {
            Profile::Nfs3 => "nfs3",
            Profile::Nfs42 => "nfs42",
        }
    }

    pub fn parse(s: &str) -> Option<Profile> {
        match s {
            "nfs3" => Some(Profile::Nfs3),
            "nfs42" => Some(Profile::Nfs42),
            _ => None,
        }
    }
}

/// How the file system is mounted.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub profile: Profile,
    /// Slept at the start of every operation (a round trip).
    pub latency: Duration,
    /// The largest write the kernel sends (`wsize`).
    pub max_write: u32,
    /// Threads answering requests (RPCs in flight at once).
    pub threads: usize,
}

impl Options {
    pub fn new(profile: Profile) -> Options {
        Options {
            profile,
            latency: Duration::ZERO,
            max_write: 1 << 20,
            threads: 4,
        }
    }
}

/// Operations received, by kind. Every request counts in `ops` (the round
/// trips), reading the stats file excepted.
#[derive(Debug, Default)]
pub struct Counts {
    pub ops: AtomicU64,
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    pub writes: AtomicU64,
    pub write_bytes: AtomicU64,
    /// `fallocate(0)` (ALLOCATE) done, and the bytes it covered.
    pub fallocate_alloc: AtomicU64,
    pub fallocate_alloc_bytes: AtomicU64,
    /// `PUNCH_HOLE | KEEP_SIZE` (DEALLOCATE) done.
    pub fallocate_punch: AtomicU64,
    pub fallocate_punch_bytes: AtomicU64,
    /// Any mode the profile refused (EOPNOTSUPP).
    pub fallocate_refused: AtomicU64,
    /// SEEK_DATA/SEEK_HOLE received (the kernel sends none after an ENOSYS).
    pub lseek: AtomicU64,
    pub fsync: AtomicU64,
    pub flush: AtomicU64,
    pub copy: AtomicU64,
    pub copy_bytes: AtomicU64,
    pub setattr: AtomicU64,
}

impl Counts {
    fn fields(&self) -> [(&'static str, &AtomicU64); 16] {
        [
            ("ops", &self.ops),
            ("reads", &self.reads),
            ("read_bytes", &self.read_bytes),
            ("writes", &self.writes),
            ("write_bytes", &self.write_bytes),
            ("fallocate_alloc", &self.fallocate_alloc),
            ("fallocate_alloc_bytes", &self.fallocate_alloc_bytes),
            ("fallocate_punch", &self.fallocate_punch),
            ("fallocate_punch_bytes", &self.fallocate_punch_bytes),
            ("fallocate_refused", &self.fallocate_refused),
            ("lseek", &self.lseek),
            ("fsync", &self.fsync),
            ("flush", &self.flush),
            ("copy", &self.copy),
            ("copy_bytes", &self.copy_bytes),
            ("setattr", &self.setattr),
        ]
    }

    /// A snapshot of every count by name.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        self.fields()
            .iter()
            .map(|(n, c)| (*n, c.load(Ordering::Relaxed)))
            .collect()
    }

    /// One count by name (see [`Counts::snapshot`] for the names).
    pub fn get(&self, name: &str) -> u64 {
        self.fields()
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, c)| c.load(Ordering::Relaxed))
            .unwrap_or_else(|| panic!("no count named {name}"))
    }

    /// The counts as one JSON object.
    pub fn json(&self) -> String {
        let body: Vec<String> = self
            .snapshot()
            .iter()
            .map(|(n, v)| format!("\"{n}\":{v}"))
            .collect();
        format!("{{{}}}\n", body.join(","))
    }
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

struct PassThrough {
    opts: Options,
    root: PathBuf,
    root_ino: u64,
    counts: Arc<Counts>,
    /// Inode number (the backing file's) to its path under `root`.
    paths: RwLock<HashMap<u64, PathBuf>>,
    /// Open handles: the inode and the backing file.
    files: RwLock<HashMap<u64, (u64, Arc<File>)>>,
    next_fh: AtomicU64,
}

fn errno(e: io::Error) -> Errno {
    Errno::from(e)
}

fn nix_errno(e: nix::errno::Errno) -> Errno {
    Errno::from_i32(e as i32)
}

fn answer_empty(reply: ReplyEmpty, r: Result<(), Errno>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

fn answer_entry(reply: ReplyEntry, r: Result<FileAttr, Errno>) {
    match r {
        Ok(a) => reply.entry(&TTL, &a, Generation(0)),
        Err(e) => reply.error(e),
    }
}

fn file_type(ft: std::fs::FileType) -> FileType {
    FileType::from_std(ft).unwrap_or(FileType::RegularFile)
}

fn time(secs: i64, nsecs: i64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nsecs as u32)
    } else {
        UNIX_EPOCH
    }
}

impl PassThrough {
    /// One round trip: counted, then the latency slept.
    fn op(&self) {
        add(&self.counts.ops, 1);
        if !self.opts.latency.is_zero() {
            std::thread::sleep(self.opts.latency);
        }
    }

    fn fuse_ino(&self, backing: u64) -> u64 {
        if backing == self.root_ino {
            INodeNo::ROOT.0
        } else {
            backing
        }
    }

    fn path(&self, ino: INodeNo) -> Result<PathBuf, Errno> {
        if ino == INodeNo::ROOT {
            return Ok(self.root.clone());
        }
        self.paths
            .read()
            .unwrap()
            .get(&ino.0)
            .cloned()
            .ok_or(Errno::ENOENT)
    }

    /// The inode at `path` is gone from it (unlinked, or replaced by a
    /// rename): requests for it by path must not reach what comes next.
    fn forget_path(&self, path: &Path) {
        self.paths.write().unwrap().retain(|_, p| p != path);
    }

    /// UNLINK or RMDIR (`how`) of `name` under `parent`.
    fn remove(
        &self,
        parent: INodeNo,
        name: &OsStr,
        how: fn(&Path) -> std::io::Result<()>,
    ) -> Result<(), Errno> {
        self.op();
        let p = self.child(parent, name)?;
        how(&p).map_err(errno)?;
        self.forget_path(&p);
        Ok(())
    }

    fn child(&self, parent: INodeNo, name: &OsStr) -> Result<PathBuf, Errno> {
        Ok(self.path(parent)?.join(name))
    }

    fn attr(&self, md: &std::fs::Metadata) -> FileAttr {
        FileAttr {
            ino: INodeNo(self.fuse_ino(md.ino())),
            size: md.size(),
            blocks: md.blocks(),
            atime: time(md.atime(), md.atime_nsec()),
            mtime: time(md.mtime(), md.mtime_nsec()),
            ctime: time(md.ctime(), md.ctime_nsec()),
            crtime: UNIX_EPOCH,
            kind: file_type(md.file_type()),
            perm: (md.mode() & 0o7777) as u16,
            nlink: md.nlink() as u32,
            uid: md.uid(),
            gid: md.gid(),
            rdev: md.rdev() as u32,
            flags: 0,
            blksize: md.blksize() as u32,
        }
    }

    /// Stats `path`, remembers its inode and returns the attributes.
    fn remember(&self, path: PathBuf) -> Result<FileAttr, Errno> {
        let md = std::fs::symlink_metadata(&path).map_err(errno)?;
        let attr = self.attr(&md);
        if attr.ino != INodeNo::ROOT {
            self.paths.write().unwrap().insert(attr.ino.0, path);
        }
        Ok(attr)
    }

    fn stats_attr(&self) -> FileAttr {
        FileAttr {
            ino: INodeNo(STATS_INO),
            size: 0,
            blocks: 0,
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind: FileType::RegularFile,
            perm: 0o444,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            flags: 0,
            blksize: 4096,
        }
    }

    fn file(&self, fh: FileHandle) -> Result<Arc<File>, Errno> {
        self.files
            .read()
            .unwrap()
            .get(&fh.0)
            .map(|(_, f)| f.clone())
            .ok_or(Errno::EBADF)
    }

    /// A handle open on `ino`: how an inode unlinked or renamed over while
    /// open is still reached (the kernel's fstat sends no handle), as the
    /// NFS client's silly rename keeps it reachable.
    fn open_file_of(&self, ino: INodeNo) -> Option<Arc<File>> {
        let files = self.files.read().unwrap();
        files
            .values()
            .find(|(i, _)| *i == ino.0)
            .map(|(_, f)| f.clone())
    }

    fn keep(&self, f: File, ino: INodeNo) -> FileHandle {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.files.write().unwrap().insert(fh, (ino.0, Arc::new(f)));
        FileHandle(fh)
    }

    fn open_options(flags: i32) -> OpenOptions {
        let mut o = OpenOptions::new();
        match flags & libc::O_ACCMODE {
            libc::O_WRONLY => o.write(true),
            libc::O_RDWR => o.read(true).write(true),
            _ => o.read(true),
        };
        // The backing file is opened buffered: O_DIRECT is the client's
        // business (the kernel sends its requests here uncached either way).
        let keep = libc::O_APPEND | libc::O_SYNC | libc::O_DSYNC | libc::O_NOATIME;
        o.custom_flags(flags & keep);
        o
    }

    fn fallocate(&self, fh: FileHandle, offset: u64, length: u64, mode: i32) -> Result<(), Errno> {
        let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        let allowed = self.opts.profile == Profile::Nfs42 && (mode == 0 || mode == punch);
        if !allowed {
            add(&self.counts.fallocate_refused, 1);
            return Err(Errno::EOPNOTSUPP);
        }
        let f = self.file(fh)?;
        nix::fcntl::fallocate(
            &*f,
            FallocateFlags::from_bits_retain(mode),
            offset as i64,
            length as i64,
        )
        .map_err(nix_errno)?;
        if mode == 0 {
            add(&self.counts.fallocate_alloc, 1);
            add(&self.counts.fallocate_alloc_bytes, length);
        } else {
            add(&self.counts.fallocate_punch, 1);
            add(&self.counts.fallocate_punch_bytes, length);
        }
        Ok(())
    }

    fn set_attr(
        &self,
        ino: INodeNo,
        fh: Option<FileHandle>,
        mode: Option<u32>,
        owner: (Option<u32>, Option<u32>),
        size: Option<u64>,
        times: (Option<TimeOrNow>, Option<TimeOrNow>),
    ) -> Result<FileAttr, Errno> {
        let held = match fh {
            Some(fh) => Some(self.file(fh)?),
            None => self.open_file_of(ino),
        };
        let path = self.path(ino);
        if let Some(m) = mode {
            let perm = std::fs::Permissions::from_mode(m & 0o7777);
            match (&held, &path) {
                (Some(f), _) => f.set_permissions(perm),
                (None, Ok(p)) => std::fs::set_permissions(p, perm),
                (None, Err(_)) => Err(io::ErrorKind::NotFound.into()),
            }
            .map_err(errno)?;
        }
        if owner.0.is_some() || owner.1.is_some() {
            match (&held, &path) {
                (Some(f), _) => std::os::unix::fs::fchown(&**f, owner.0, owner.1),
                (None, Ok(p)) => std::os::unix::fs::lchown(p, owner.0, owner.1),
                (None, Err(_)) => Err(io::ErrorKind::NotFound.into()),
            }
            .map_err(errno)?;
        }
        let open = |write: bool| -> Result<Arc<File>, Errno> {
            match (&held, &path) {
                (Some(f), _) => Ok(f.clone()),
                (None, Ok(p)) => OpenOptions::new()
                    .write(write)
                    .read(!write)
                    .open(p)
                    .map(Arc::new)
                    .map_err(errno),
                (None, Err(e)) => Err(*e),
            }
        };
        if let Some(s) = size {
            open(true)?.set_len(s).map_err(errno)?;
        }
        if times.0.is_some() || times.1.is_some() {
            let conv = |t: TimeOrNow| match t {
                TimeOrNow::SpecificTime(t) => t,
                TimeOrNow::Now => SystemTime::now(),
            };
            let mut ft = std::fs::FileTimes::new();
            if let Some(a) = times.0 {
                ft = ft.set_accessed(conv(a));
            }
            if let Some(m) = times.1 {
                ft = ft.set_modified(conv(m));
            }
            open(false)?.set_times(ft).map_err(errno)?;
        }
        match (held, path) {
            (Some(f), _) => Ok(self.attr(&f.metadata().map_err(errno)?)),
            (None, Ok(p)) => self.remember(p),
            (None, Err(e)) => Err(e),
        }
    }
}

#[allow(clippy::too_many_arguments)]
impl Filesystem for PassThrough {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        if let Err(nearest) = config.set_max_write(self.opts.max_write) {
            let _ = config.set_max_write(nearest);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == INodeNo::ROOT && name == STATS_NAME {
            return reply.entry(&Duration::ZERO, &self.stats_attr(), Generation(0));
        }
        self.op();
        match self.child(parent, name).and_then(|p| self.remember(p)) {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino.0 == STATS_INO {
            return reply.attr(&Duration::ZERO, &self.stats_attr());
        }
        self.op();
        let held = fh.and_then(|fh| self.file(fh).ok());
        let md = match held {
            Some(f) => f.metadata().map_err(errno),
            None => match self.path(ino) {
                Ok(p) => std::fs::symlink_metadata(p).map_err(errno),
                Err(e) => match self.open_file_of(ino) {
                    Some(f) => f.metadata().map_err(errno),
                    None => Err(e),
                },
            },
        };
        match md {
            Ok(md) => reply.attr(&TTL, &self.attr(&md)),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if ino.0 == STATS_INO {
            return reply.error(Errno::EACCES);
        }
        self.op();
        add(&self.counts.setattr, 1);
        match self.set_attr(ino, fh, mode, (uid, gid), size, (atime, mtime)) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        self.op();
        match self
            .path(ino)
            .and_then(|p| std::fs::read_link(p).map_err(errno))
        {
            Ok(t) => reply.data(t.as_os_str().as_bytes()),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        self.op();
        let r = self.child(parent, name).and_then(|p| {
            let kind = nix::sys::stat::SFlag::from_bits_truncate(mode & libc::S_IFMT);
            let perm = nix::sys::stat::Mode::from_bits_truncate(mode & !umask & 0o7777);
            nix::sys::stat::mknod(&p, kind, perm, rdev.into()).map_err(nix_errno)?;
            self.remember(p)
        });
        answer_entry(reply, r)
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        self.op();
        let r = self.child(parent, name).and_then(|p| {
            std::fs::DirBuilder::new()
                .mode(mode & !umask & 0o7777)
                .create(&p)
                .map_err(errno)?;
            self.remember(p)
        });
        answer_entry(reply, r)
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        answer_empty(
            reply,
            self.remove(parent, name, |p| std::fs::remove_file(p)),
        )
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        answer_empty(reply, self.remove(parent, name, |p| std::fs::remove_dir(p)))
    }

    fn symlink(
        &self,
        _req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        self.op();
        let r = self.child(parent, link_name).and_then(|p| {
            std::os::unix::fs::symlink(target, &p).map_err(errno)?;
            self.remember(p)
        });
        answer_entry(reply, r)
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        self.op();
        let r = (|| {
            let from = self.child(parent, name)?;
            let to = self.child(newparent, newname)?;
            let cwd = nix::fcntl::AT_FDCWD;
            let fl = nix::fcntl::RenameFlags::from_bits_retain(flags.bits());
            nix::fcntl::renameat2(cwd, &from, cwd, &to, fl).map_err(nix_errno)?;
            let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
            // `p` moved from under `a` to under `b`.
            let moved = |p: &Path, a: &Path, b: &Path| {
                let rest = p.strip_prefix(a).ok()?;
                Some(if rest.as_os_str().is_empty() {
                    b.to_path_buf()
                } else {
                    b.join(rest)
                })
            };
            // Everything at or under the old name now lives under the new
            // one (and the other way round for an exchange); what the new
            // name held before is gone.
            let mut paths = self.paths.write().unwrap();
            for p in paths.values_mut() {
                if let Some(n) = moved(p, &from, &to) {
                    *p = n;
                } else if let Some(n) = moved(p, &to, &from) {
                    *p = if exchange { n } else { PathBuf::new() };
                }
            }
            paths.retain(|_, p| !p.as_os_str().is_empty());
            Ok(())
        })();
        answer_empty(reply, r)
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        self.op();
        let r = (|| {
            let from = self.path(ino)?;
            let to = self.child(newparent, newname)?;
            std::fs::hard_link(&from, &to).map_err(errno)?;
            let md = std::fs::symlink_metadata(&to).map_err(errno)?;
            Ok(self.attr(&md))
        })();
        answer_entry(reply, r)
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino.0 == STATS_INO {
            // Read by the daemon at each read, whatever its size says.
            return reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
        }
        self.op();
        match self
            .path(ino)
            .and_then(|p| Self::open_options(flags.0).open(p).map_err(errno))
        {
            // Keep the page cache across opens, as an NFS client does when
            // close-to-open revalidation finds the file unchanged: every
            // change goes through this one mount, so it is never stale.
            Ok(f) => reply.opened(self.keep(f, ino), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino.0 == STATS_INO {
            let j = self.counts.json().into_bytes();
            let start = (offset as usize).min(j.len());
            let end = (start + size as usize).min(j.len());
            return reply.data(&j[start..end]);
        }
        self.op();
        let r = self.file(fh).and_then(|f| {
            let mut buf = vec![0u8; size as usize];
            let mut done = 0;
            while done < buf.len() {
                match f.read_at(&mut buf[done..], offset + done as u64) {
                    Ok(0) => break,
                    Ok(n) => done += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(errno(e)),
                }
            }
            buf.truncate(done);
            Ok(buf)
        });
        match r {
            Ok(b) => {
                add(&self.counts.reads, 1);
                add(&self.counts.read_bytes, b.len() as u64);
                reply.data(&b)
            }
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        self.op();
        match self
            .file(fh)
            .and_then(|f| f.write_all_at(data, offset).map_err(errno))
        {
            Ok(()) => {
                add(&self.counts.writes, 1);
                add(&self.counts.write_bytes, data.len() as u64);
                reply.written(data.len() as u32)
            }
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        if ino.0 != STATS_INO {
            self.op();
            add(&self.counts.flush, 1);
        }
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if ino.0 != STATS_INO {
            self.op();
            self.files.write().unwrap().remove(&fh.0);
        }
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.op();
        add(&self.counts.fsync, 1);
        let r = self.file(fh).and_then(|f| {
            if datasync {
                f.sync_data().map_err(errno)
            } else {
                f.sync_all().map_err(errno)
            }
        });
        answer_empty(reply, r)
    }

    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.op();
        reply.opened(FileHandle(0), FopenFlags::empty());
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        self.op();
        let r = (|| {
            let dir = self.path(ino)?;
            let md = std::fs::metadata(&dir).map_err(errno)?;
            let mut entries: Vec<(u64, FileType, OsString)> = vec![
                (self.fuse_ino(md.ino()), FileType::Directory, ".".into()),
                (INodeNo::ROOT.0, FileType::Directory, "..".into()),
            ];
            for e in std::fs::read_dir(&dir).map_err(errno)? {
                let e = e.map_err(errno)?;
                let ft = e.file_type().map_err(errno)?;
                entries.push((self.fuse_ino(e.ino()), file_type(ft), e.file_name()));
            }
            Ok(entries)
        })();
        match r {
            Ok(entries) => {
                for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(*ino), (i + 1) as u64, *kind, name) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(e),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.op();
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.op();
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.op();
        match nix::sys::statvfs::statvfs(&self.root) {
            Ok(s) => reply.statfs(
                s.blocks(),
                s.blocks_free(),
                s.blocks_available(),
                s.files(),
                s.files_free(),
                s.block_size() as u32,
                s.name_max() as u32,
                s.fragment_size() as u32,
            ),
            Err(e) => reply.error(nix_errno(e)),
        }
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        // default_permissions: the kernel checks; this is only for access(2).
        self.op();
        reply.ok();
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        self.op();
        let r = self.child(parent, name).and_then(|p| {
            let mut o = Self::open_options(flags);
            o.create(true).mode(mode & !umask & 0o7777);
            if flags & libc::O_EXCL != 0 {
                o.create_new(true);
            }
            if flags & libc::O_TRUNC != 0 {
                o.truncate(true);
            }
            let f = o.open(&p).map_err(errno)?;
            let a = self.remember(p)?;
            let fh = self.keep(f, a.ino);
            Ok((a, fh))
        });
        match r {
            Ok((a, fh)) => reply.created(&TTL, &a, Generation(0), fh, FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        self.op();
        match PassThrough::fallocate(self, fh, offset, length, mode) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn lseek(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        self.op();
        add(&self.counts.lseek, 1);
        if self.opts.profile == Profile::Nfs3 {
            // As an NFS 3 client: no SEEK operation. The kernel remembers the
            // ENOSYS and answers from the size alone from then on.
            return reply.error(Errno::ENOSYS);
        }
        let w = match whence {
            libc::SEEK_DATA => nix::unistd::Whence::SeekData,
            libc::SEEK_HOLE => nix::unistd::Whence::SeekHole,
            libc::SEEK_SET => nix::unistd::Whence::SeekSet,
            libc::SEEK_END => nix::unistd::Whence::SeekEnd,
            _ => return reply.error(Errno::EINVAL),
        };
        match self
            .file(fh)
            .and_then(|f| nix::unistd::lseek(&*f, offset, w).map_err(nix_errno))
        {
            Ok(o) => reply.offset(o),
            Err(e) => reply.error(e),
        }
    }

    fn copy_file_range(
        &self,
        _req: &Request,
        _ino_in: INodeNo,
        fh_in: FileHandle,
        offset_in: u64,
        _ino_out: INodeNo,
        fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        self.op();
        if self.opts.profile == Profile::Nfs3 {
            // No COPY: the kernel falls back to copying through the page
            // cache (reads and writes sent here), as the NFS 3 client does.
            return reply.error(Errno::ENOSYS);
        }
        let r = (|| {
            let fin = self.file(fh_in)?;
            let fout = self.file(fh_out)?;
            let mut oi = offset_in as i64;
            let mut oo = offset_out as i64;
            // The reply holds 32 bits of length: one call copies at most 1 GiB.
            let n = len.min(1 << 30) as usize;
            nix::fcntl::copy_file_range(&*fin, Some(&mut oi), &*fout, Some(&mut oo), n)
                .map_err(nix_errno)
        })();
        match r {
            Ok(n) => {
                add(&self.counts.copy, 1);
                add(&self.counts.copy_bytes, n as u64);
                reply.written(n as u32)
            }
            Err(e) => reply.error(e),
        }
    }
}

/// A mounted NFS-like file system; unmount it (`umount DIR`) to stop it.
/// The threads answering requests end when the mount goes away.
pub struct NfsLike {
    counts: Arc<Counts>,
    opts: Options,
}

impl NfsLike {
    /// Mounts a pass-through of `backing` on `mountpoint` and answers its
    /// requests on background threads. Needs root (mount(2)) and /dev/fuse.
    pub fn mount(backing: &Path, mountpoint: &Path, opts: Options) -> io::Result<NfsLike> {
        let session = Self::session(backing, mountpoint, opts)?;
        let counts = session.filesystem_counts();
        std::thread::Builder::new()
            .name(format!("nfs-like-{}", opts.profile.name()))
            .spawn(move || {
                if let Err(e) = session.0.run() {
                    eprintln!("nfs-like-fs: session ended: {e}");
                }
            })?;
        Ok(NfsLike { counts, opts })
    }

    /// Mounts and answers requests on this thread until the file system is
    /// unmounted (for the `nfs-like-fs` binary).
    pub fn serve(
        backing: &Path,
        mountpoint: &Path,
        opts: Options,
        ready: impl FnOnce(),
    ) -> io::Result<()> {
        let session = Self::session(backing, mountpoint, opts)?;
        ready();
        session.0.run()
    }

    fn session(backing: &Path, mountpoint: &Path, opts: Options) -> io::Result<Mounted> {
        let root = backing.canonicalize()?;
        let root_ino = std::fs::metadata(&root)?.ino();
        let counts = Arc::new(Counts::default());
        let fs = PassThrough {
            opts,
            root,
            root_ino,
            counts: counts.clone(),
            paths: RwLock::new(HashMap::new()),
            files: RwLock::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
        };
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName(format!("nfs-like-{}", opts.profile.name())),
            MountOption::Subtype(opts.profile.name().to_owned()),
            MountOption::DefaultPermissions,
            MountOption::RW,
        ];
        // allow_other: the servers and tools under test may run as other users.
        config.acl = SessionACL::All;
        config.n_threads = Some(opts.threads.max(1));
        config.clone_fd = true;
        let session = Session::new(fs, mountpoint, &config)?;
        Ok(Mounted(session, counts))
    }

    /// What the file system has received so far.
    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    pub fn options(&self) -> Options {
        self.opts
    }
}

struct Mounted(Session<PassThrough>, Arc<Counts>);

impl Mounted {
    fn filesystem_counts(&self) -> Arc<Counts> {
        self.1.clone()
    }
}

/// Whether this machine can mount FUSE file systems (`/dev/fuse`); the
/// reason when not.
pub fn fuse_available() -> Result<(), String> {
    match File::options().read(true).write(true).open("/dev/fuse") {
        Ok(_) => Ok(()),
        Err(e) => Err(format!("no FUSE (/dev/fuse: {e})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{check_pattern, check_zero, drop_cache, write_pattern, Fs, FsKind, MIB};
    use nix::errno::Errno as E;
    use nix::unistd::Whence;

    fn falloc(f: &File, mode: i32, off: i64, len: i64) -> nix::Result<()> {
        nix::fcntl::fallocate(f, FallocateFlags::from_bits_retain(mode), off, len)
    }

    /// Each profile offers exactly the client's operations, and counts them.
    #[test]
    #[ignore = "needs root"]
    fn profiles_offer_what_the_nfs_client_offers() {
        for kind in [FsKind::Nfs3, FsKind::Nfs42] {
            if let Some(why) = kind.unavailable() {
                eprintln!("{kind} skipped: {why}");
                continue;
            }
            let fs = Fs::new(kind, 64 * MIB);
            let c = fs.nfs_counts().unwrap();
            let nfs42 = kind == FsKind::Nfs42;
            let p = fs.sparse_file("f", 8 * MIB);
            write_pattern(&p, MIB, 3 * MIB, 1);
            // Write-through, at most wsize (1 MiB) per write.
            assert_eq!(c.get("writes"), 3, "{kind}");
            assert_eq!(c.get("write_bytes"), 3 * MIB, "{kind}");
            let f = File::options().read(true).write(true).open(&p).unwrap();
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            let expect = |r: nix::Result<()>, ok: bool, what: &str| {
                if ok {
                    r.unwrap_or_else(|e| panic!("{kind}: {what}: {e}"));
                } else {
                    assert_eq!(r, Err(E::EOPNOTSUPP), "{kind}: {what}");
                }
            };
            expect(
                falloc(&f, 0, 12 * MIB as i64, MIB as i64),
                nfs42,
                "fallocate(0)",
            );
            expect(
                falloc(&f, punch, 2 * MIB as i64, MIB as i64),
                nfs42,
                "punch",
            );
            let zero = libc::FALLOC_FL_ZERO_RANGE;
            expect(falloc(&f, zero, 0, MIB as i64), false, "zero range");
            let keep = libc::FALLOC_FL_KEEP_SIZE;
            expect(falloc(&f, keep, 0, MIB as i64), false, "keep size");
            assert_eq!(c.get("fallocate_alloc"), nfs42 as u64, "{kind}");
            assert_eq!(c.get("fallocate_punch"), nfs42 as u64, "{kind}");
            let size = if nfs42 { 13 * MIB } else { 8 * MIB };
            assert_eq!(f.metadata().unwrap().len(), size, "{kind}");
            drop_cache(&p);
            check_pattern(&p, MIB, MIB, 1);
            if nfs42 {
                check_zero(&p, 2 * MIB, MIB);
            } else {
                check_pattern(&p, 2 * MIB, MIB, 1);
            }
            check_pattern(&p, 3 * MIB, MIB, 1);
            // SEEK_DATA/SEEK_HOLE: the file's holes on 4.2; on 3 the kernel
            // answers from the size (all data) after one ENOSYS.
            let data = nix::unistd::lseek(&f, 0, Whence::SeekData).unwrap();
            let hole = nix::unistd::lseek(&f, MIB as i64, Whence::SeekHole).unwrap();
            if nfs42 {
                assert_eq!((data, hole), (MIB as i64, 2 * MIB as i64), "{kind}");
            } else {
                assert_eq!((data, hole), (0, size as i64), "{kind}");
                assert_eq!(c.get("lseek"), 1, "{kind}: the kernel remembers ENOSYS");
            }
            // copy_file_range: COPY on 4.2; on 3 the kernel's page-cache copy
            // (reads and writes received here). Never a reflink.
            let q = fs.sparse_file("g", 8 * MIB);
            let g = File::options().read(true).write(true).open(&q).unwrap();
            let writes = c.get("write_bytes");
            let (mut oi, mut oo) = (MIB as i64, 0i64);
            let n = nix::fcntl::copy_file_range(&f, Some(&mut oi), &g, Some(&mut oo), MIB as usize)
                .unwrap();
            assert_eq!(n, MIB as usize, "{kind}");
            if nfs42 {
                assert_eq!(c.get("copy_bytes"), MIB, "{kind}");
                assert_eq!(c.get("write_bytes"), writes, "{kind}");
            } else {
                assert_eq!(c.get("copy_bytes"), 0, "{kind}");
                assert_eq!(c.get("write_bytes"), writes + MIB, "{kind}");
            }
            drop_cache(&q);
            let mut got = vec![0u8; MIB as usize];
            g.read_exact_at(&mut got, 0).unwrap();
            assert_eq!(got, crate::pattern_vec(1, MIB, MIB as usize), "{kind}");
            let r = std::process::Command::new("cp")
                .args(["--reflink=always"])
                .arg(&p)
                .arg(fs.path("h"))
                .output()
                .unwrap();
            assert!(!r.status.success(), "{kind}: reflink worked");
            // The counts are also a file, not listed.
            let j = std::fs::read_to_string(fs.path(STATS_NAME)).unwrap();
            assert!(
                j.contains(&format!("\"writes\":{}", c.get("writes"))),
                "{j}"
            );
            let names: Vec<_> = std::fs::read_dir(fs.dir())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert!(!names.iter().any(|n| n == STATS_NAME), "{names:?}");
        }
    }

    /// A file renamed over while open stays reachable through its handle
    /// (fstat and ftruncate send no handle to FUSE), and the name reaches
    /// the new file, as NFS's silly rename behaves.
    #[test]
    #[ignore = "needs root"]
    fn a_file_renamed_over_while_open_stays_reachable() {
        if let Some(why) = FsKind::Nfs3.unavailable() {
            eprintln!("nfs3 skipped: {why}");
            return;
        }
        let fs = Fs::new(FsKind::Nfs3, 16 * MIB);
        let a = fs.sparse_file("a", MIB);
        let f = File::options().read(true).write(true).open(&a).unwrap();
        f.write_all_at(b"old", 100).unwrap();
        let b = fs.sparse_file("b", 2 * MIB);
        std::fs::rename(&b, &a).unwrap();
        assert_eq!(f.metadata().unwrap().len(), MIB);
        f.set_len(3 * MIB).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 3 * MIB);
        let mut got = [0u8; 3];
        f.read_exact_at(&mut got, 100).unwrap();
        assert_eq!(&got, b"old");
        assert_eq!(std::fs::metadata(&a).unwrap().len(), 2 * MIB);
        assert!(!b.exists());
        drop(f);
        std::fs::remove_file(&a).unwrap();
        assert!(!a.exists());
    }
}
