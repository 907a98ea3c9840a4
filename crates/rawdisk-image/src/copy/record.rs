//! The backup record: what a copy's destination holds (docs/cbt.md, "The
//! backup record"), so that `copy --changed-since NAME` can refuse a
//! destination it would make silently wrong: an empty image, another disk's
//! backup, a backup older than NAME, a copy that never finished.
//!
//! A small text file, `key = value` lines and a final `sha256` line over
//! the bytes before it: a damaged record is refused, never trusted. It is
//! `DEST.rawdisk-backup` next to a file destination, or the file given with
//! `--backup-record` (a block device or NBD destination). Written whole
//! (a temporary file in the same directory, fsync, rename, fsync of the
//! directory), so a reader sees the old record or the new one.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rawdisk_storage::cbt::Chain;

use crate::endpoint::{self, Endpoint};

/// What a file destination's record is named: its name followed by this.
pub const SUFFIX: &str = ".rawdisk-backup";
/// The metadata context query that lists a tracking server's checkpoint
/// identities, `rawdisk:checkpoint:NAME:<source id hex>:<seq>`.
pub const CHECKPOINT_QUERY: &str = "rawdisk:checkpoint:";
const FORMAT: &str = "1";
/// A record is a few hundred bytes; anything longer is not one.
const MAX_LEN: usize = 4096;
const KEYS: [&str; 9] = [
    "format",
    "state",
    "source-id",
    "source-size",
    "checkpoint",
    "checkpoint-id",
    "written",
    "destination-size",
    "sha256",
];

/// A checkpoint as a record names it: the name, and with the source id its
/// identity, the sequence number (higher is newer, never reused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub name: String,
    pub seq: u64,
}

/// A tracked source as a copy saw it when it started: its id, size and
/// checkpoints, oldest first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// 32 lower-case hex digits.
    pub id: String,
    pub size: u64,
    pub checkpoints: Vec<Checkpoint>,
}

impl Source {
    /// From a local target's state; None when its ids are not on disk yet.
    pub fn from_chain(c: &Chain) -> Option<Source> {
        Some(Source {
            id: c.source_id.clone()?,
            size: c.size,
            checkpoints: c
                .checkpoints
                .iter()
                .map(|i| Checkpoint {
                    name: i.name.clone(),
                    seq: i.seq,
                })
                .collect(),
        })
    }

    /// From what an NBD source listed for [`CHECKPOINT_QUERY`]; None when
    /// it listed nothing (no tracking, no checkpoint, or a server that does
    /// not tell identities) or disagrees with itself.
    pub fn from_listed(listed: &[String], size: u64) -> Option<Source> {
        let mut id: Option<&str> = None;
        let mut checkpoints = Vec::new();
        for l in listed {
            // NAME has no ':' (checkpoint names are [A-Za-z0-9._-]).
            let rest = l.strip_prefix(CHECKPOINT_QUERY)?;
            let mut it = rest.rsplitn(3, ':');
            let (seq, sid, name) = (it.next()?, it.next()?, it.next()?);
            if !is_source_id(sid) || id.is_some_and(|i| i != sid) {
                return None;
            }
            id = Some(sid);
            let seq = seq.parse().ok().filter(|&s| s > 0)?;
            checkpoints.push(Checkpoint {
                name: name.to_string(),
                seq,
            });
        }
        checkpoints.sort_by_key(|c| c.seq);
        Some(Source {
            id: id?.to_string(),
            size,
            checkpoints,
        })
    }

    /// The newest checkpoint: every change after it is in the next
    /// incremental, so a copy that started now holds the source at it.
    pub fn newest(&self) -> Option<&Checkpoint> {
        self.checkpoints.last()
    }

    pub fn find(&self, name: &str) -> Option<&Checkpoint> {
        self.checkpoints.iter().find(|c| c.name == name)
    }
}

/// What a destination holds, or (`complete` false) what a copy onto it that
/// has not finished was making it hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub complete: bool,
    pub source_id: String,
    pub source_size: u64,
    pub checkpoint: Checkpoint,
    /// Unix seconds.
    pub written: u64,
    pub destination_size: u64,
}

impl Record {
    /// The record of a copy of `src` onto a destination of `dest_size`
    /// bytes; None when the source has no checkpoint (nothing to chain to).
    pub fn of(src: &Source, dest_size: u64, complete: bool) -> Option<Record> {
        Some(Record {
            complete,
            source_id: src.id.clone(),
            source_size: src.size,
            checkpoint: src.newest()?.clone(),
            written: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            destination_size: dest_size,
        })
    }

    pub fn encode(&self) -> String {
        let mut s = format!(
            "# rawdisk backup record: what this destination holds (docs/cbt.md)\n\
             format = {FORMAT}\n\
             state = {}\n\
             source-id = {}\n\
             source-size = {}\n\
             checkpoint = {}\n\
             checkpoint-id = {}:{}\n\
             written = {}\n\
             destination-size = {}\n",
            if self.complete {
                "complete"
            } else {
                "incomplete"
            },
            self.source_id,
            self.source_size,
            self.checkpoint.name,
            self.source_id,
            self.checkpoint.seq,
            self.written,
            self.destination_size,
        );
        let sum = hex(&openssl::sha::sha256(s.as_bytes()));
        s.push_str(&format!("sha256 = {sum}\n"));
        s
    }

    /// Parses a record; any damage (a changed byte, a missing or extra
    /// line, a checksum that does not match) is an error saying what.
    pub fn decode(b: &[u8]) -> Result<Record, String> {
        if b.len() > MAX_LEN {
            return Err(format!("longer than {MAX_LEN} bytes"));
        }
        let text = std::str::from_utf8(b).map_err(|_| "not text".to_string())?;
        let body_end = text
            .trim_end_matches('\n')
            .rfind('\n')
            .map(|i| i + 1)
            .ok_or("no checksum line")?;
        let (body, last) = text.split_at(body_end);
        let sum = last
            .strip_prefix("sha256 = ")
            .and_then(|s| s.strip_suffix('\n'))
            .ok_or("no checksum line")?;
        if sum != hex(&openssl::sha::sha256(body.as_bytes())) {
            return Err("its sha256 does not match its contents".into());
        }
        let mut vals: Vec<(&str, &str)> = Vec::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (k, v) = line
                .split_once(" = ")
                .ok_or_else(|| format!("line {line:?} is not `key = value`"))?;
            vals.push((k, v));
        }
        let keys: Vec<&str> = vals.iter().map(|p| p.0).collect();
        if keys != KEYS {
            return Err(format!("keys {keys:?}, expected {KEYS:?}"));
        }
        let v = |i: usize| vals[i].1;
        if v(0) != FORMAT {
            return Err(format!("format {} (this rawdisk reads {FORMAT})", v(0)));
        }
        let complete = match v(1) {
            "complete" => true,
            "incomplete" => false,
            s => return Err(format!("state {s:?}")),
        };
        let num = |i: usize| {
            v(i).parse::<u64>()
                .map_err(|_| format!("{} {:?} is not a number", KEYS[i], v(i)))
        };
        let source_id = v(2);
        let seq = v(5)
            .strip_prefix(source_id)
            .and_then(|s| s.strip_prefix(':'))
            .and_then(|s| s.parse::<u64>().ok())
            .filter(|&s| s > 0);
        let (true, Some(seq)) = (is_source_id(source_id), seq) else {
            return Err("bad source or checkpoint id".into());
        };
        if !rawdisk_storage::cbt::valid_name(v(4)) {
            return Err(format!("bad checkpoint name {:?}", v(4)));
        }
        Ok(Record {
            complete,
            source_id: source_id.to_string(),
            source_size: num(3)?,
            checkpoint: Checkpoint {
                name: v(4).to_string(),
                seq,
            },
            written: num(6)?,
            destination_size: num(7)?,
        })
    }
}

fn is_source_id(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where the record of `destination` is: `given` (`--backup-record`), else
/// `DEST.rawdisk-backup` for a file destination (existing or to be made);
/// None for a block device or NBD destination without one.
pub fn path_for(destination: &str, given: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = given {
        return Some(p.to_path_buf());
    }
    if endpoint::is_nbd(destination) || matches!(destination, "-" | "null:") {
        return None;
    }
    match std::fs::metadata(destination) {
        Ok(m) if !m.is_file() => None,
        _ => {
            let mut p = PathBuf::from(destination).into_os_string();
            p.push(SUFFIX);
            Some(p.into())
        }
    }
}

/// The record at `path`: Ok(None) when there is none, Err(why) when it
/// cannot be read or is damaged.
pub fn read(path: &Path) -> Result<Option<Record>, String> {
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let mut b = Vec::new();
    f.take(MAX_LEN as u64 + 1)
        .read_to_end(&mut b)
        .map_err(|e| e.to_string())?;
    Record::decode(&b).map(Some)
}

/// Replaces the record at `path` with `r`, durably: a new file beside it
/// (O_EXCL, O_NOFOLLOW), fsync, rename over, fsync of the directory.
pub fn write(path: &Path, r: &Record) -> io::Result<()> {
    let dir = dir_of(path);
    let name = path.file_name().ok_or(io::ErrorKind::InvalidInput)?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.{nanos}.tmp", std::process::id()));
    let tmp = dir.join(tmp_name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    let done = f
        .write_all(r.encode().as_bytes())
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    File::open(dir)?.sync_all()
}

/// Removes the record at `path` (none is fine), durably.
pub fn remove(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => File::open(dir_of(path))?.sync_all(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn dir_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// The chain rule: `copy --changed-since NAME` (`since`) of `src` may write
/// onto the destination `dest` only when its record `found` is a complete
/// backup of the same source, of its size, at NAME or a newer checkpoint
/// (NAME's changes then cover everything since the record's). Err: one line
/// saying what was found and how to proceed.
pub fn check(
    found: &Result<Option<Record>, String>,
    path: &Path,
    dest: &Endpoint,
    src: &Source,
    since: &Checkpoint,
) -> Result<(), String> {
    let d = dest.name();
    let p = path.display();
    let proceed = "make a full copy (without --changed-since), or pass --trust-destination \
                   if you know better";
    let r = match found {
        Ok(Some(r)) => r,
        Ok(None) => {
            return Err(format!(
                "{d} has no backup record ({p}): it is not known to hold a backup of this \
                 source at checkpoint {} or newer; {proceed}",
                since.name
            ))
        }
        Err(e) => {
            return Err(format!(
                "the backup record {p} of {d} is damaged ({e}); {proceed}"
            ))
        }
    };
    if !r.complete {
        return Err(format!(
            "{d} holds no known state: a copy onto it did not finish (its backup record {p} \
             says incomplete); {proceed}"
        ));
    }
    if r.source_id != src.id {
        return Err(format!(
            "{d} holds a backup of another source (id {}), not of this one (id {}); {proceed}",
            r.source_id, src.id
        ));
    }
    let held = &r.checkpoint;
    if held.seq < since.seq {
        let older = match src.find(&held.name).filter(|c| c.seq == held.seq) {
            Some(_) => format!(", or --changed-since {}", held.name),
            None => String::new(),
        };
        return Err(format!(
            "{d} holds source {} at checkpoint {} (seq {}); --changed-since {} (seq {}) would \
             skip {} to {}'s changes; make a full copy{older}, or pass --trust-destination \
             if you know better",
            r.source_id, held.name, held.seq, since.name, since.seq, held.name, since.name
        ));
    }
    if r.source_size != src.size || r.destination_size != dest.size() {
        return Err(format!(
            "{d} holds a backup of {} bytes on {} bytes (its record {p}); the source is {} \
             bytes, the destination {}; {proceed}",
            r.source_size,
            r.destination_size,
            src.size,
            dest.size()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        Record {
            complete: true,
            source_id: "0123456789abcdef0123456789abcdef".into(),
            source_size: 1 << 30,
            checkpoint: Checkpoint {
                name: "c-1.x_y".into(),
                seq: 42,
            },
            written: 1_700_000_000,
            destination_size: 1 << 30,
        }
    }

    #[test]
    fn a_record_round_trips() {
        for complete in [true, false] {
            let r = Record {
                complete,
                ..sample()
            };
            assert_eq!(Record::decode(r.encode().as_bytes()), Ok(r));
        }
    }

    #[test]
    fn every_flipped_byte_is_refused() {
        let b = sample().encode().into_bytes();
        for at in 0..b.len() {
            for bit in [0x01u8, 0x20, 0x80] {
                let mut c = b.clone();
                c[at] ^= bit;
                assert!(Record::decode(&c).is_err(), "byte {at} ^ {bit:#x}");
            }
        }
        for cut in 0..b.len() {
            assert!(Record::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = b.clone();
        longer.extend_from_slice(b"x = 1\n");
        assert!(Record::decode(&longer).is_err());
    }

    #[test]
    fn garbage_is_refused_without_panic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(37);
        let good = sample().encode().into_bytes();
        for i in 0..20_000 {
            let len = rng.gen_range(0..600);
            let mut b: Vec<u8> = if i % 2 == 0 {
                (0..len).map(|_| rng.gen()).collect()
            } else {
                // Near misses: a valid record with random lines spliced in.
                let mut b = good.clone();
                let at = rng.gen_range(0..b.len());
                b.splice(
                    at..at,
                    (0..1 + len % 40).map(|_| rng.gen_range(b' '..=b'~')),
                );
                b
            };
            if i % 3 == 0 {
                b.push(b'\n');
            }
            assert!(Record::decode(&b).is_err());
        }
        // A well-formed record with a bad value and a matching checksum.
        let body = "format = 1\nstate = complete\nsource-id = 0123456789abcdef0123456789abcdef\n\
                    source-size = x\ncheckpoint = c\ncheckpoint-id = 0123456789abcdef0123456789abcdef:1\n\
                    written = 0\ndestination-size = 0\n";
        let doc = format!(
            "{body}sha256 = {}\n",
            hex(&openssl::sha::sha256(body.as_bytes()))
        );
        assert!(Record::decode(doc.as_bytes())
            .unwrap_err()
            .contains("source-size"));
    }

    #[test]
    fn listed_identities_give_the_source() {
        let id = "ab".repeat(16);
        let l = vec![
            format!("rawdisk:checkpoint:c2:{id}:7"),
            format!("rawdisk:checkpoint:c1:{id}:3"),
        ];
        let s = Source::from_listed(&l, 10).unwrap();
        assert_eq!(s.id, id);
        assert_eq!(s.newest().unwrap().name, "c2");
        assert_eq!(s.find("c1").unwrap().seq, 3);
        assert_eq!(Source::from_listed(&[], 10), None);
        let mixed = vec![
            l[0].clone(),
            format!("rawdisk:checkpoint:c1:{}:3", "cd".repeat(16)),
        ];
        assert_eq!(Source::from_listed(&mixed, 10), None);
        assert_eq!(
            Source::from_listed(&["rawdisk:checkpoint:c1:zz:1".to_string()], 10),
            None
        );
    }
}
