//! What the server exports: one target, or every regular file and block
//! device directly inside a directory (`serve --dir`, like nbdkit's file
//! plugin with `dir=`). Each [`Export`] (`export.rs`) is a target with what
//! the server learns and decides about it, shared by every connection to it.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use rawdisk_storage::cbt::{CbtError, TrackOptions, Tracker, STATE_SUFFIX};
use rawdisk_storage::{Lookup, OpenOptions, Target};
use tracing::{debug, info, warn};

pub(super) use super::export::Export;
use super::writeback::WriteBehind;
use listing::Listing;

mod listing;

/// Longest export name a directory can hold (NAME_MAX).
const NAME_MAX: usize = 255;

/// A directory's exports.
pub(super) struct Dir {
    dir: PathBuf,
    /// O_PATH fd of the directory: exports are opened beneath it, so what
    /// is checked is what is opened.
    fd: OwnedFd,
    opts: OpenOptions,
    /// The export an empty name means, if any (`--default-export`).
    default: Option<String>,
    /// Exports some connection still holds, by name.
    open: Mutex<HashMap<String, Weak<Export>>>,
    /// With `--track-changes`: how to open each export's tracker.
    track: Option<TrackOptions>,
    /// Trackers by export name with the (st_dev, st_ino) they track. They
    /// outlive the connections: only the server's exit closes them cleanly.
    trackers: Mutex<Trackers>,
    /// Export files that look like another image format as raw (`-f raw`).
    pub(super) raw: bool,
    /// `--discard`, `--detect-zeroes`, `--aio` of every export.
    pub(super) serving: super::Serving,
    /// NBD_OPT_LIST's names, their cost bounded (`listing.rs`).
    listing: Arc<Listing>,
}

/// Tracker of each export name, with the (st_dev, st_ino) it tracks.
type Trackers = HashMap<String, ((u64, u64), Arc<Tracker>)>;

pub(super) enum Exports {
    One(Arc<Export>),
    Dir(Box<Dir>),
}

/// Why a name does not open an export: the message for NBD_REP_ERR_UNKNOWN.
pub(super) type Unknown = String;

/// Why a client's NBD_OPT_INFO/GO/SET_META_CONTEXT gets no export: the reply
/// (NBD_REP_ERR_UNKNOWN for a name that names no export it could open,
/// NBD_REP_ERR_POLICY for one the server will not serve, e.g. another image
/// format) and its message.
#[derive(Debug)]
pub(super) struct Refused {
    pub(super) reply: u32,
    pub(super) msg: String,
}

impl From<Unknown> for Refused {
    fn from(msg: Unknown) -> Refused {
        Refused {
            reply: crate::proto::REP_ERR_UNKNOWN,
            msg,
        }
    }
}

impl Exports {
    pub(super) fn dir(
        dir: &Path,
        opts: OpenOptions,
        default: Option<String>,
        track: Option<TrackOptions>,
    ) -> io::Result<Dir> {
        // The caller names the directory; the errors say only why.
        let dir = dir.canonicalize()?;
        if !dir.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
        use rustix::fs::{Mode, OFlags};
        let fd = rustix::fs::open(
            &dir,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let listing = Arc::new(Listing::new(dir.clone(), fd.try_clone()?));
        Ok(Dir {
            dir,
            fd,
            opts,
            default,
            open: Mutex::new(HashMap::new()),
            track,
            trackers: Mutex::new(HashMap::new()),
            raw: false,
            serving: super::Serving::default(),
            listing,
        })
    }

    /// The export `name` opens (NBD_OPT_INFO, GO, EXPORT_NAME,
    /// SET_META_CONTEXT).
    pub(super) fn find(
        &self,
        name: &str,
        write_behind: WriteBehind,
        max_payload: u32,
    ) -> Result<Arc<Export>, Refused> {
        match self {
            Exports::One(e) if e.name == name => Ok(e.clone()),
            Exports::One(e) => Err(Refused::from(format!(
                "no export named {:?} (this server offers {:?})",
                shorten(name),
                e.name
            ))),
            Exports::Dir(d) => d.find(name, write_behind, max_payload),
        }
    }

    /// The names NBD_OPT_LIST tells and the description of each. A
    /// directory's are read on a blocking thread, one listing at a time,
    /// and shared by the connections that asked (`listing.rs`).
    pub(super) async fn list(&self, description: &str) -> (Arc<Vec<String>>, String) {
        match self {
            Exports::One(e) => (Arc::new(vec![e.name.clone()]), description.to_string()),
            Exports::Dir(d) => (d.listing.names(d.raw).await, String::new()),
        }
    }

    /// Every export some connection holds (the final flush).
    pub(super) fn open(&self) -> Vec<Arc<Export>> {
        match self {
            Exports::One(e) => vec![e.clone()],
            Exports::Dir(d) => {
                let open = d.open.lock().unwrap_or_else(|p| p.into_inner());
                open.values().filter_map(Weak::upgrade).collect()
            }
        }
    }

    /// Every tracker the server opened (closed at exit, after the final
    /// flush).
    pub(super) fn trackers(&self) -> Vec<(String, Arc<Tracker>)> {
        match self {
            Exports::One(e) => e
                .tracker()
                .into_iter()
                .map(|t| (e.name.clone(), t.clone()))
                .collect(),
            Exports::Dir(d) => {
                let t = d.trackers.lock().unwrap_or_else(|p| p.into_inner());
                t.iter().map(|(n, (_, t))| (n.clone(), t.clone())).collect()
            }
        }
    }

    /// The single export, when there is one.
    pub(super) fn single(&self) -> Option<&Arc<Export>> {
        match self {
            Exports::One(e) => Some(e),
            Exports::Dir(_) => None,
        }
    }
}

impl Dir {
    /// The (st_dev, st_ino) `name` stands for, checked ([`resolve`]).
    fn resolve(&self, name: &str) -> Result<(u64, u64), Unknown> {
        // As std's MetadataExt gives them, which file_id() compares with.
        resolve(&self.dir, self.fd.as_fd(), name).map(|st| (st.st_dev, st.st_ino))
    }

    fn find(
        &self,
        name: &str,
        write_behind: WriteBehind,
        max_payload: u32,
    ) -> Result<Arc<Export>, Refused> {
        let name = match (name, &self.default) {
            ("", Some(d)) => d.as_str(),
            ("", None) => {
                return Err(Refused::from(
                    "this server exports a directory: pick an export by name \
                     (list them with nbdinfo --list or rawdisk info --list)"
                        .to_string(),
                ))
            }
            (n, _) => n,
        };
        // A cheap check by path for a clear refusal; the open below does not
        // trust it (the name may be swapped in between).
        let checked = self.resolve(name)?;
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|_, w| w.strong_count() > 0);
        if let Some(e) = open.get(name).and_then(Weak::upgrade) {
            if e.id == checked {
                return Ok(e);
            }
        }
        // Named by the directory and the name, never by where a symlink led.
        let path = self.dir.join(name);
        let (target, read_only) = self.open_target(name, &path, checked)?;
        // The identity of what was opened, not of what the path names now.
        let id = target.file_id().map_err(|e| {
            warn!("cannot export {}: {e}", path.display());
            format!("cannot open {:?}: {e}", shorten(name))
        })?;
        if !self.raw {
            refuse_other_format(name, &target)?;
        }
        let tracker = self.tracker(name, &path, id, &target)?;
        let e = Arc::new(
            Export::new(
                name.to_string(),
                Arc::new(target),
                read_only,
                write_behind,
                max_payload,
                id,
                tracker,
            )
            .with_serving(self.serving),
        );
        debug!(
            "export {name:?}: {} bytes{}",
            e.size(),
            if e.read_only { ", read-only" } else { "" }
        );
        open.insert(name.to_string(), Arc::downgrade(&e));
        Ok(e)
    }

    /// The tracker of the export `name` (file `path`, `id`), opened on first
    /// use. A file replaced under the same name gets a new one: the old one
    /// is closed first, as both use the same state file.
    fn tracker(
        &self,
        name: &str,
        path: &Path,
        id: (u64, u64),
        target: &Target,
    ) -> Result<Option<Arc<Tracker>>, Unknown> {
        let Some(opts) = &self.track else {
            return Ok(None);
        };
        let mut trackers = self.trackers.lock().unwrap_or_else(|p| p.into_inner());
        // The tracker opens by path: it must name the file that was opened.
        match std::fs::metadata(path) {
            Ok(m) if (m.dev(), m.ino()) == id => {}
            _ => return Err(format!("{name:?} changed while it was opened; try again")),
        }
        if let Some((tid, t)) = trackers.get(name) {
            if *tid == id {
                return Ok(Some(t.clone()));
            }
            if let Err(e) = t.close() {
                warn!("export {name:?}: {e}");
            }
            trackers.remove(name);
        }
        // One file under two names (a symlink or hard link in the
        // directory) would be tracked in two state files, each missing the
        // other's writes and each recording the file as checked when it
        // closes: the name that tracks it first keeps it. A name that no
        // longer names that file (deleted, its inode number reused) lets go
        // once no export holds its tracker: one still served keeps marking.
        let stale: Vec<String> = trackers
            .iter()
            .filter(|(other, (tid, t))| {
                *tid == id
                    && other.as_str() != name
                    && Arc::strong_count(t) == 1
                    && !matches!(std::fs::metadata(self.dir.join(other.as_str())),
                                 Ok(m) if (m.dev(), m.ino()) == id)
            })
            .map(|(other, _)| other.clone())
            .collect();
        for other in stale {
            if let Some((_, t)) = trackers.remove(&other) {
                if let Err(e) = t.close() {
                    warn!("export {other:?}: {e}");
                }
            }
        }
        if let Some((other, _)) = trackers.iter().find(|(_, (tid, _))| *tid == id) {
            warn!(
                "cannot export {}: it is the file {other:?} names, tracked under that name",
                path.display()
            );
            return Err(format!(
                "{:?} is the file {:?} names, whose changes are tracked under that name: \
                 use that name",
                shorten(name),
                shorten(other)
            ));
        }
        match open_tracker(target, opts) {
            Ok(t) => {
                trackers.insert(name.to_string(), (id, t.clone()));
                Ok(Some(t))
            }
            Err(e) => {
                // Serving it untracked would hide its changes from backups.
                warn!("cannot export {}: {e}", path.display());
                Err(format!("cannot track changes of {name:?}: {e}"))
            }
        }
    }

    /// Opens read-write unless the server is read-only; a file the server
    /// may only read is exported read-only, as nbdkit's file plugin does.
    fn open_target(
        &self,
        name: &str,
        path: &Path,
        checked: (u64, u64),
    ) -> Result<(Target, bool), Unknown> {
        let cant = |e: &rawdisk_storage::Error| {
            warn!("cannot export {}: {e}", path.display());
            if e.errno() == Some(libc::EXDEV) {
                return format!("{:?} leads outside the exported directory", shorten(name));
            }
            format!("cannot open {:?}: {}", shorten(name), e)
        };
        match self.open_beneath(name, path, checked, &self.opts) {
            Ok(t) => Ok((t, self.opts.read_only)),
            Err(e)
                if !self.opts.read_only
                    && matches!(
                        e.errno(),
                        Some(libc::EACCES | libc::EPERM | libc::EROFS | libc::ETXTBSY)
                    ) =>
            {
                let ro = OpenOptions {
                    read_only: true,
                    ..self.opts.clone()
                };
                debug!("{}: {e}; exporting it read-only", path.display());
                self.open_beneath(name, path, checked, &ro)
                    .map(|t| (t, true))
                    .map_err(|e| cant(&e))
            }
            Err(e) => Err(cant(&e)),
        }
    }

    /// Opens `name` so that it cannot resolve outside the directory:
    /// openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS) under the directory's
    /// fd. Where the kernel has no openat2 (ENOSYS) the name is opened under
    /// the fd and kept only if its fstat (st_dev, st_ino) is the inode the
    /// path check found inside (`checked`); anything else is EXDEV.
    fn open_beneath(
        &self,
        name: &str,
        path: &Path,
        checked: (u64, u64),
        opts: &OpenOptions,
    ) -> rawdisk_storage::Result<Target> {
        let dir = self.fd.as_fd();
        match Target::open_in(dir, Path::new(name), path, opts, Lookup::Beneath) {
            Err(e) if e.errno() == Some(libc::ENOSYS) => {
                let t = Target::open_in(dir, Path::new(name), path, opts, Lookup::Unrestricted)?;
                if t.file_id()? != checked {
                    return Err(rawdisk_storage::Error::new(
                        "open",
                        0,
                        0,
                        io::Error::from_raw_os_error(libc::EXDEV),
                    )
                    .with_path(path));
                }
                Ok(t)
            }
            r => r,
        }
    }
}

/// What `name` stands for, checked: a plain file name, naming a regular
/// file or block device that (through symlinks too) is inside `dir` (whose
/// O_PATH fd is `fd`); its stat, after symlinks.
fn resolve(dir: &Path, fd: BorrowedFd<'_>, name: &str) -> Result<rustix::fs::Stat, Unknown> {
    if name.is_empty()
        || name.len() > NAME_MAX
        || name == "."
        || name == ".."
        || name.contains(['/', '\0'])
    {
        return Err(format!(
            "{:?} is not a file name in the exported directory",
            shorten(name)
        ));
    }
    if name.ends_with(STATE_SUFFIX) {
        // Changed-block tracking state, not a disk.
        return Err(format!(
            "{:?} is a changed-block tracking state file, not an export",
            shorten(name)
        ));
    }
    let unknown = || format!("no export named {:?}", shorten(name));
    use rustix::fs::{AtFlags, FileType};
    // A name that is no symlink is inside: one fstatat under the
    // directory's fd (not its path, which may have been swapped), where
    // resolving every component costs a listing of 10,000 names seconds.
    let st = rustix::fs::statat(fd, name, AtFlags::SYMLINK_NOFOLLOW).map_err(|_| unknown())?;
    let st = if FileType::from_raw_mode(st.st_mode) == FileType::Symlink {
        let path = dir.join(name).canonicalize().map_err(|_| unknown())?;
        if !path.starts_with(dir) {
            return Err(format!(
                "{:?} leads outside the exported directory",
                shorten(name)
            ));
        }
        rustix::fs::stat(&path).map_err(|_| unknown())?
    } else {
        st
    };
    let ft = FileType::from_raw_mode(st.st_mode);
    if ft != FileType::RegularFile && ft != FileType::BlockDevice {
        return Err(format!(
            "{:?} is not a regular file or block device",
            shorten(name)
        ));
    }
    Ok(st)
}

/// Opens the changed-block tracker of an export's target
/// (`--track-changes`), for the single export and each `--dir` export
/// alike; fails when another server tracks it or its state file cannot be
/// made.
pub(super) fn open_tracker(target: &Target, opts: &TrackOptions) -> Result<Arc<Tracker>, CbtError> {
    let t = Tracker::for_target(target, opts)?;
    info!(
        "tracking changes in '{}' ({} bytes per bit)",
        t.state_path().display(),
        t.granularity()
    );
    Ok(Arc::new(t))
}

/// A client would take a qcow2 or VMDK file's bytes for its disk: only
/// `serve -f raw` exports such a file.
fn refuse_other_format(name: &str, target: &Target) -> Result<(), Refused> {
    match rawdisk_storage::format::probe_target(target) {
        Ok(None) => Ok(()),
        Ok(Some(f)) => Err(Refused {
            reply: crate::proto::REP_ERR_POLICY,
            msg: format!(
                "{:?} looks like a {f} image, not raw: the server exports it only when \
                 started with -f raw",
                shorten(name)
            ),
        }),
        Err(e) => Err(format!("cannot read {:?}: {e}", shorten(name)).into()),
    }
}

/// A hostile name is quoted in replies and logs only in part.
fn shorten(name: &str) -> &str {
    match name.char_indices().nth(64) {
        Some((i, _)) => &name[..i],
        None => name,
    }
}
