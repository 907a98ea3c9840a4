//! The checks every opener of a state file makes (crash, outside change,
//! corrupt header, damaged pages) and [`StateFile`]: `rawdisk checkpoint`
//! and local `copy --changed-since`. The handle itself is `disk.rs`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::bitmap::{self, Bits};
use super::disk::{
    assign_ids, new_header, repair, stat_target, state_path_for, Disk, Read, TargetStat,
    MUTATION_BYTE,
};
use super::format::{Entry, Header, Reason, V1};
use super::index::{load_checked, upgrade, Loaded, PageIndex};
use super::{
    valid_name, CbtError, Chain, CheckpointInfo, DEFAULT_GRANULARITY, MAX_CHECKPOINTS, MAX_NAME_LEN,
};
use crate::sys::{LockKind, Sys};

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
