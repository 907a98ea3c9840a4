//! The state file's byte layout, little endian (docs/cbt.md has the table):
//!
//! - bytes 0..4096: the header page: magic, version, granularity, the size
//!   the bitmaps cover, slot size, generation, open flag, checkpoint count,
//!   the target's mtime/ctime and identity (device, inode) recorded at the
//!   last clean close, the next checkpoint sequence number and the source
//!   id (a checkpoint's identity is the two), the
//!   checkpoint table (32 entries of 96 bytes from byte 128), and at byte
//!   4092 a CRC32 of bytes 0..4092;
//! - from byte 4096: bitmap slot `s` at `4096 + s * slot_bytes`, one bit per
//!   chunk (chunk `c` is bit `c % 8` of byte `c / 8`). Pages never written
//!   are holes, so a bitmap with few bits costs few blocks;
//! - after the 32 slots (format 2): one page index per slot (index.rs), a
//!   CRC32 and a stamp per bitmap page written, which the table entry's
//!   index CRC and page count cover: damage reads as damage, not as zeros.
//!
//! Nothing here does I/O: `encode` and `decode` between [`Header`] and the
//! page, so tests can corrupt a header byte by byte.

use super::{MAX_CHECKPOINTS, MAX_NAME_LEN};

pub(crate) const MAGIC: [u8; 8] = *b"RDSKCBT\0";
/// The format written; [`V1`] (no page index) is still read, and converted
/// by the first writer.
pub(crate) const VERSION: u32 = 2;
pub(crate) const V1: u32 = 1;
/// The header page, and the unit in which slots are written.
pub(crate) const PAGE: usize = 4096;
const TABLE: usize = 128;
const ENTRY: usize = 96;
const CRC_AT: usize = PAGE - 4;
/// The identity: dev, ino, then a word that is 1 when they are recorded.
/// Bytes once reserved (zero), so files of version 1 without it still load,
/// as "identity unknown".
const ID_AT: usize = 80;
/// Format 2: the file's expected apparent length (a shorter file is damage).
const LEN_AT: usize = 3200;
/// Format 2, in a table entry: the CRC32 of the slot's page index region,
/// then the number of bitmap pages it records as written.
const INDEX_CRC_AT: usize = 88;
const WRITTEN_AT: usize = 92;
/// The next checkpoint sequence number (u64) and the source id (16 bytes):
/// zero in format-1 files, assigned by their first writer.
const NEXT_SEQ_AT: usize = 100;
const SOURCE_AT: usize = 108;
/// A checkpoint entry's sequence number (u64), 0 = not yet assigned.
const ENTRY_SEQ_AT: usize = 80;
const _: () = assert!(TABLE + MAX_CHECKPOINTS * ENTRY <= CRC_AT);

/// Why a checkpoint is inconsistent; the byte stored in its table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The open flag was set with nobody holding the served lock.
    Crash = 1,
    /// The target's size differs from the one recorded.
    SizeChanged = 2,
    /// The target's mtime or ctime differs from the one recorded.
    Modified = 3,
    /// The header's CRC did not match.
    Corrupt = 4,
    /// The file at the target's path is another inode (or on another
    /// device) than the one recorded.
    Replaced = 5,
    /// A bitmap page (or its index) is missing, unreadable or fails its
    /// checksum, or the file is shorter than its layout.
    Damaged = 6,
    /// The target's size changed while a tracking server had it.
    SizeChangedTracked = 7,
}

impl Reason {
    fn from_byte(b: u8) -> Option<Reason> {
        Some(match b {
            1 => Reason::Crash,
            2 => Reason::SizeChanged,
            3 => Reason::Modified,
            4 => Reason::Corrupt,
            5 => Reason::Replaced,
            6 => Reason::Damaged,
            7 => Reason::SizeChangedTracked,
            _ => return None,
        })
    }

    /// The reason as `checkpoint list` shows it.
    pub(crate) fn text(self) -> &'static str {
        match self {
            Reason::Crash => "the tracking server did not shut down cleanly (crash or kill)",
            Reason::SizeChanged => "the target's size changed while it was not tracked",
            Reason::Modified => "the target was modified while it was not tracked",
            Reason::Corrupt => "the state file's header was corrupt",
            Reason::Replaced => {
                "the target is another file than the one tracked (its device or inode \
                 number differs: replaced, or moved to another file system)"
            }
            Reason::Damaged => {
                "the state file's bitmap is damaged (short file, hole, bad checksum or \
                 unreadable page)"
            }
            Reason::SizeChangedTracked => "the target's size changed while it was tracked",
        }
    }
}

/// The target's (size, mtime, ctime) as recorded; mtime/ctime are zero for
/// block devices, whose inode times say nothing about writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub size: u64,
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    /// (st_dev, st_ino) of a file, (st_rdev, 0) of a block device; None in
    /// a state file written before identities were recorded.
    pub id: Option<(u64, u64)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub name: String,
    pub created: u64,
    /// None: consistent.
    pub reason: Option<Reason>,
    /// Bitmap slot; meaningless for an inconsistent entry.
    pub slot: u32,
    /// Format 2: CRC32 of the slot's page index region, and the number of
    /// bitmap pages it records (zero in format 1).
    pub index_crc: u32,
    pub written: u32,
    /// Never reused within a source id (0: not yet assigned, format 1).
    pub seq: u64,
}

impl Entry {
    /// What this checkpoint's index entries carry besides the page CRC:
    /// derived from the checkpoint, never 0, so an entry left by an
    /// earlier occupant of the slot does not pass for this one's. The
    /// sequence number tells apart a name and slot reused within a second;
    /// so it must be assigned before any page is recorded with the stamp.
    pub(crate) fn stamp(&self) -> u32 {
        let mut c = crc32(self.name.as_bytes());
        c = crc32_update(c, &self.created.to_le_bytes());
        c = crc32_update(c, &self.slot.to_le_bytes());
        c = crc32_update(c, &self.seq.to_le_bytes());
        c.max(1)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    /// [`VERSION`], or [`V1`] until a writer converts it.
    pub version: u32,
    pub granularity: u64,
    /// Recorded at the last clean close (or by `rawdisk checkpoint` while
    /// unserved); `stamp.size` is also the size the bitmaps cover.
    pub stamp: Stamp,
    pub generation: u64,
    /// Set durably by a tracking server at start, cleared at clean close.
    pub open: bool,
    /// Oldest first; inconsistent ones are a prefix.
    pub checkpoints: Vec<Entry>,
    /// Random, made with the state file: with a sequence number, a
    /// checkpoint's identity (all zero: not yet assigned, format 1).
    pub source_id: [u8; 16],
    /// The sequence number the next checkpoint gets (never reused).
    pub next_seq: u64,
}

/// What a header page that is not a valid header is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Bad {
    /// Never written (all zeros): a file created by a process that died
    /// before its first header write.
    Blank,
    /// Another file (no magic): refused, never overwritten.
    NotState,
    /// A newer format.
    Version(u32),
    /// The CRC does not match: the fields that still parse, if any.
    Corrupt(Option<Header>),
}

impl Header {
    pub(crate) fn chunks(&self) -> u64 {
        self.stamp.size.div_ceil(self.granularity)
    }

    /// Bytes of one bitmap slot: the bitmap rounded up to whole pages.
    pub(crate) fn slot_bytes(&self) -> u64 {
        slot_bytes(self.stamp.size, self.granularity)
    }

    pub(crate) fn slot_offset(&self, slot: u32) -> u64 {
        PAGE as u64 + u64::from(slot) * self.slot_bytes()
    }

    /// Pages of one slot: entries of its page index.
    pub(crate) fn slot_pages(&self) -> u64 {
        self.slot_bytes() / PAGE as u64
    }

    /// Bytes of one slot's page index region: 8 per slot page, whole pages.
    pub(crate) fn index_bytes(&self) -> u64 {
        (self.slot_pages() * 8).next_multiple_of(PAGE as u64)
    }

    pub(crate) fn index_offset(&self, slot: u32) -> u64 {
        self.slot_offset(MAX_CHECKPOINTS as u32) + u64::from(slot) * self.index_bytes()
    }

    /// The apparent length of a format-2 file: header, slots, indexes.
    pub(crate) fn file_len(&self) -> u64 {
        self.index_offset(MAX_CHECKPOINTS as u32)
    }

    pub(crate) fn find(&self, name: &str) -> Option<usize> {
        self.checkpoints.iter().position(|e| e.name == name)
    }

    /// Whether the source id and sequence numbers are assigned (a format-1
    /// file has zeros there).
    pub(crate) fn has_ids(&self) -> bool {
        self.source_id != [0; 16] && self.checkpoints.iter().all(|e| e.seq != 0)
    }

    /// Give a header without them a source id (`fresh`) and its checkpoints
    /// sequence numbers in table order, the counter past them. Returns
    /// whether anything was assigned (the caller then writes the header).
    pub(crate) fn assign_ids(&mut self, fresh: [u8; 16]) -> bool {
        if self.has_ids() {
            return false;
        }
        if self.source_id == [0; 16] {
            self.source_id = fresh;
        }
        self.next_seq = self.next_seq.max(1);
        for e in &mut self.checkpoints {
            if e.seq == 0 {
                e.seq = self.next_seq;
                self.next_seq += 1;
            }
        }
        true
    }

    /// The identity of the checkpoint at `k`: `<source id hex>:<seq>`.
    pub(crate) fn identity(&self, k: usize) -> String {
        identity(&self.source_id, self.checkpoints[k].seq)
    }

    /// Mark every checkpoint inconsistent (their bitmaps are dropped).
    pub(crate) fn all_inconsistent(&mut self, reason: Reason) {
        if self.checkpoints.iter().any(|e| e.reason.is_none()) {
            self.generation += 1;
        }
        for e in &mut self.checkpoints {
            e.reason.get_or_insert(reason);
        }
    }

    pub(crate) fn encode(&self) -> [u8; PAGE] {
        let mut p = [0u8; PAGE];
        p[0..8].copy_from_slice(&MAGIC);
        put32(&mut p, 8, self.version);
        put32(&mut p, 12, PAGE as u32);
        put64(&mut p, 16, self.granularity);
        put64(&mut p, 24, self.stamp.size);
        put64(&mut p, 32, self.slot_bytes());
        put64(&mut p, 40, self.generation);
        put32(&mut p, 48, u32::from(self.open));
        put32(&mut p, 52, self.checkpoints.len() as u32);
        put64(&mut p, 56, self.stamp.mtime.0 as u64);
        put32(&mut p, 64, self.stamp.mtime.1);
        put32(&mut p, 68, self.stamp.ctime.1);
        put64(&mut p, 72, self.stamp.ctime.0 as u64);
        if let Some((dev, ino)) = self.stamp.id {
            put64(&mut p, ID_AT, dev);
            put64(&mut p, ID_AT + 8, ino);
            put32(&mut p, ID_AT + 16, 1);
        }
        put64(&mut p, NEXT_SEQ_AT, self.next_seq);
        p[SOURCE_AT..SOURCE_AT + 16].copy_from_slice(&self.source_id);
        for (i, e) in self.checkpoints.iter().enumerate() {
            let at = TABLE + i * ENTRY;
            p[at..at + e.name.len()].copy_from_slice(e.name.as_bytes());
            put64(&mut p, at + 64, e.created);
            p[at + 72] = u8::from(e.reason.is_none());
            p[at + 73] = e.reason.map_or(0, |r| r as u8);
            put32(&mut p, at + 76, e.slot);
            put64(&mut p, at + ENTRY_SEQ_AT, e.seq);
            if self.version >= VERSION {
                put32(&mut p, at + INDEX_CRC_AT, e.index_crc);
                put32(&mut p, at + WRITTEN_AT, e.written);
            }
        }
        if self.version >= VERSION {
            put64(&mut p, LEN_AT, self.file_len());
        }
        let crc = crc32(&p[..CRC_AT]);
        put32(&mut p, CRC_AT, crc);
        p
    }

    // The error is as large as a header: it carries the one that still
    // parses, read once per open; no hot path returns it.
    #[allow(clippy::result_large_err)]
    pub(crate) fn decode(p: &[u8; PAGE]) -> Result<Header, Bad> {
        if p.iter().all(|&b| b == 0) {
            return Err(Bad::Blank);
        }
        if p[0..8] != MAGIC {
            return Err(Bad::NotState);
        }
        let version = get32(p, 8);
        if version != VERSION && version != V1 {
            return Err(Bad::Version(version));
        }
        if crc32(&p[..CRC_AT]) != get32(p, CRC_AT) {
            return Err(Bad::Corrupt(Some(Self::salvage(p))));
        }
        let h = Self::parse(p).ok_or(Bad::Corrupt(Some(Self::salvage(p))))?;
        if h.version >= VERSION && get64(p, LEN_AT) != h.file_len() {
            return Err(Bad::Corrupt(Some(Self::salvage(p))));
        }
        Ok(h)
    }

    /// The fields, when they are within bounds (a CRC match is checked by
    /// the caller).
    fn parse(p: &[u8; PAGE]) -> Option<Header> {
        let granularity = get64(p, 16);
        if !super::valid_granularity(granularity) {
            return None;
        }
        let count = get32(p, 52) as usize;
        if count > MAX_CHECKPOINTS {
            return None;
        }
        let mut checkpoints = Vec::with_capacity(count);
        for i in 0..count {
            let at = TABLE + i * ENTRY;
            let name = entry_name(p, at)?;
            let reason = match p[at + 72] {
                1 => None,
                _ => Some(Reason::from_byte(p[at + 73])?),
            };
            let v2 = get32(p, 8) >= VERSION;
            checkpoints.push(Entry {
                name,
                created: get64(p, at + 64),
                reason,
                slot: get32(p, at + 76),
                index_crc: if v2 { get32(p, at + INDEX_CRC_AT) } else { 0 },
                written: if v2 { get32(p, at + WRITTEN_AT) } else { 0 },
                seq: get64(p, at + ENTRY_SEQ_AT),
            });
        }
        Some(Self::fields(p, granularity, checkpoints))
    }

    /// What a header failing its checks still names: every table entry
    /// with a valid checkpoint name (once), whatever the count says, so
    /// that they are listed as inconsistent instead of forgotten.
    fn salvage(p: &[u8; PAGE]) -> Header {
        let mut checkpoints: Vec<Entry> = Vec::new();
        for i in 0..MAX_CHECKPOINTS {
            let at = TABLE + i * ENTRY;
            let Some(name) = entry_name(p, at) else {
                continue;
            };
            if checkpoints.iter().any(|e| e.name == name) {
                continue;
            }
            checkpoints.push(Entry {
                name,
                created: get64(p, at + 64),
                reason: Some(Reason::Corrupt),
                slot: 0,
                index_crc: 0,
                written: 0,
                // The repair numbers them afresh under a new source id.
                seq: 0,
            });
        }
        let g = Some(get64(p, 16))
            .filter(|&g| super::valid_granularity(g))
            .unwrap_or(super::DEFAULT_GRANULARITY);
        Self::fields(p, g, checkpoints)
    }

    fn fields(p: &[u8; PAGE], granularity: u64, checkpoints: Vec<Entry>) -> Header {
        Header {
            version: get32(p, 8),
            granularity,
            stamp: Stamp {
                size: get64(p, 24),
                mtime: (get64(p, 56) as i64, get32(p, 64)),
                ctime: (get64(p, 72) as i64, get32(p, 68)),
                id: (get32(p, ID_AT + 16) == 1).then(|| (get64(p, ID_AT), get64(p, ID_AT + 8))),
            },
            generation: get64(p, 40),
            open: get32(p, 48) != 0,
            checkpoints,
            source_id: p[SOURCE_AT..SOURCE_AT + 16].try_into().unwrap(),
            next_seq: get64(p, NEXT_SEQ_AT),
        }
    }
}

/// The valid checkpoint name of the table entry at `at`, if it holds one.
fn entry_name(p: &[u8; PAGE], at: usize) -> Option<String> {
    let raw = &p[at..at + MAX_NAME_LEN + 1];
    let len = raw.iter().position(|&b| b == 0)?;
    let name = std::str::from_utf8(&raw[..len]).ok()?;
    super::valid_name(name).then(|| name.to_string())
}

/// A checkpoint's identity as printed: `<source id, 32 hex digits>:<seq>`.
pub(crate) fn identity(source_id: &[u8; 16], seq: u64) -> String {
    format!("{}:{seq}", hex(source_id))
}

/// A source id as printed: 32 lower-case hex digits.
pub(crate) fn hex(source_id: &[u8; 16]) -> String {
    source_id.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn slot_bytes(size: u64, granularity: u64) -> u64 {
    size.div_ceil(granularity)
        .div_ceil(8)
        .next_multiple_of(PAGE as u64)
        .max(PAGE as u64)
}

fn put32(p: &mut [u8], at: usize, v: u32) {
    p[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(p: &mut [u8], at: usize, v: u64) {
    p[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get32(p: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(p[at..at + 4].try_into().unwrap())
}

fn get64(p: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(p[at..at + 8].try_into().unwrap())
}

/// CRC-32 (IEEE 802.3, the zlib one: reflected polynomial 0xEDB88320).
pub(crate) fn crc32(data: &[u8]) -> u32 {
    crc32_update(0, data)
}

/// The CRC-32 of what `crc` was the CRC of, followed by `data`.
pub(crate) fn crc32_update(crc: u32, data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut c = !crc;
    for &b in data {
        c = TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    fn sample() -> Header {
        Header {
            version: VERSION,
            granularity: 64 << 10,
            stamp: Stamp {
                size: 1 << 40,
                mtime: (1_700_000_000, 5),
                ctime: (-3, 999_999_999),
                id: Some((0xfd01, 1 << 40)),
            },
            generation: 7,
            open: true,
            checkpoints: vec![
                Entry {
                    name: "old".into(),
                    created: 1,
                    reason: Some(Reason::Crash),
                    slot: 0,
                    index_crc: 0,
                    written: 0,
                    seq: 3,
                },
                Entry {
                    name: "a".repeat(MAX_NAME_LEN),
                    created: 2,
                    reason: None,
                    slot: 31,
                    index_crc: 0x1234_5678,
                    written: 9,
                    seq: u64::MAX - 1,
                },
            ],
            source_id: *b"0123456789abcdef",
            next_seq: u64::MAX,
        }
    }

    #[test]
    fn header_round_trips_and_any_flipped_byte_is_corrupt() {
        let h = sample();
        let p = h.encode();
        assert_eq!(Header::decode(&p), Ok(h.clone()));
        for at in [8usize, 16, 40, 48, 130, 200, 3000, CRC_AT + 1] {
            let mut q = p;
            q[at] ^= 0x10;
            let r = Header::decode(&q);
            assert!(
                matches!(r, Err(Bad::Corrupt(_)) | Err(Bad::Version(_))),
                "byte {at}: {r:?}"
            );
        }
        let mut q = p;
        q[0] = b'X';
        assert_eq!(Header::decode(&q), Err(Bad::NotState));
        assert_eq!(Header::decode(&[0; PAGE]), Err(Bad::Blank));
    }

    #[test]
    fn a_header_without_identity_loads_as_unknown() {
        let mut h = sample();
        h.stamp.id = None;
        let p = h.encode();
        assert!(p[ID_AT..ID_AT + 20].iter().all(|&b| b == 0));
        assert_eq!(Header::decode(&p), Ok(h));
        let mut h = sample();
        h.checkpoints[0].reason = Some(Reason::Replaced);
        assert_eq!(Header::decode(&h.encode()), Ok(h));
    }

    /// Format 2's fields sit where docs/cbt.md says; a format-1 header
    /// still decodes, with no index fields; a header failing its CRC still
    /// names its checkpoints (all as "corrupt"), whatever its count says.
    #[test]
    fn format_2_fields_and_what_a_damaged_header_still_names() {
        let h = sample();
        let p = h.encode();
        assert_eq!(get32(&p, 8), 2);
        // 1 TiB at 64 KiB: 2 MiB slots of 512 pages, 4 KiB of index each.
        assert_eq!(h.index_bytes(), 4096);
        assert_eq!(h.file_len(), 4096 + 32 * (2 << 20) + 32 * 4096);
        assert_eq!(get64(&p, LEN_AT), h.file_len());
        let at = TABLE + ENTRY;
        assert_eq!(get32(&p, at + INDEX_CRC_AT), 0x1234_5678);
        assert_eq!(get32(&p, at + WRITTEN_AT), 9);
        let mut v1 = sample();
        v1.version = V1;
        let q = v1.encode();
        assert!(q[LEN_AT..LEN_AT + 8].iter().all(|&b| b == 0));
        assert_eq!(get32(&q, at + INDEX_CRC_AT), 0);
        let d = Header::decode(&q).unwrap();
        assert_eq!((d.version, d.checkpoints[1].written), (V1, 0));
        let mut bad = p;
        put32(&mut bad, 52, 99);
        let Err(Bad::Corrupt(Some(s))) = Header::decode(&bad) else {
            panic!("not corrupt");
        };
        let names: Vec<_> = s.checkpoints.iter().map(|e| e.name.clone()).collect();
        assert_eq!(names, ["old".to_string(), "a".repeat(MAX_NAME_LEN)]);
        assert!(s
            .checkpoints
            .iter()
            .all(|e| e.reason == Some(Reason::Corrupt)));
    }

    #[test]
    fn format_1_headers_get_ids_once_in_table_order() {
        let mut h = sample();
        h.source_id = [0; 16];
        h.next_seq = 0;
        for e in &mut h.checkpoints {
            e.seq = 0;
        }
        let p = h.encode();
        assert!(p[NEXT_SEQ_AT..SOURCE_AT + 16].iter().all(|&b| b == 0));
        assert!(!Header::decode(&p).unwrap().has_ids());
        assert!(h.assign_ids([7; 16]));
        assert_eq!(h.source_id, [7; 16]);
        let seqs: Vec<u64> = h.checkpoints.iter().map(|e| e.seq).collect();
        assert_eq!((seqs, h.next_seq), (vec![1, 2], 3));
        assert!(!h.assign_ids([8; 16]));
        assert_eq!(Header::decode(&h.encode()), Ok(h.clone()));
        assert_eq!(h.identity(1), format!("{}:2", "07".repeat(16)));
    }

    #[test]
    fn slot_bytes_are_whole_pages_of_one_bit_per_chunk() {
        assert_eq!(slot_bytes(0, 4096), 4096);
        assert_eq!(slot_bytes(1, 4096), 4096);
        // 1 TiB at 64 KiB: 16 Mi chunks, 2 MiB of bits.
        assert_eq!(slot_bytes(1 << 40, 64 << 10), 2 << 20);
        assert_eq!(slot_bytes((4096 * 8 * 4096) + 1, 4096), 8192);
    }
}
