//! Format 2's page index, and the integrity rule it serves: a bitmap page
//! that is missing, unreadable or not the one written is damage, never
//! "nothing changed".
//!
//! Each slot has an index region after the 32 slots: entry `p` (8 bytes)
//! is the CRC32 of bitmap page `p` and the owning checkpoint's stamp
//! ([`Entry::stamp`]); an all-zero entry is a page never written, which
//! reads as zeros. The checkpoint's table entry holds the CRC32 of the
//! whole region and the count of pages written, so a hole or stray write
//! in the index fails too. Checking reads the index (its holes cost no
//! I/O) and the pages it names: the cost follows the pages written, not
//! the target's size.

use std::collections::{BTreeMap, BTreeSet};

use super::bitmap::Bits;
use super::disk::{assign_ids, Disk};
use super::format::{crc32, crc32_update, Entry, Header, Reason, PAGE, V1};
use super::CbtError;

/// Index entries per index page.
const PER_PAGE: usize = PAGE / 8;

/// One slot's page index: bitmap page -> (CRC32 of the page, stamp).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PageIndex(BTreeMap<usize, (u32, u32)>);

/// A checkpoint's bitmap as read and checked, with its index.
pub(crate) type Loaded = (Bits, PageIndex);

impl PageIndex {
    /// Record that bitmap page `p` now holds `page`.
    pub(crate) fn record(&mut self, p: usize, page: &[u8], stamp: u32) {
        self.0.insert(p, (crc32(page), stamp));
    }

    /// The index of `bits` as stored (every page holding a bit).
    pub(crate) fn of_bits(bits: &Bits, stamp: u32) -> PageIndex {
        let mut idx = PageIndex::default();
        for p in bits.pages() {
            idx.record(p, &bits.page(p), stamp);
        }
        idx
    }

    /// The index pages holding the entries of bitmap pages `pages`.
    pub(crate) fn pages_of(pages: impl IntoIterator<Item = usize>) -> BTreeSet<usize> {
        pages.into_iter().map(|p| p / PER_PAGE).collect()
    }

    /// Index page `q` as stored.
    pub(crate) fn page(&self, q: usize) -> Vec<u8> {
        let mut out = vec![0u8; PAGE];
        for (&p, &(crc, stamp)) in self.0.range(q * PER_PAGE..(q + 1) * PER_PAGE) {
            let at = (p % PER_PAGE) * 8;
            out[at..at + 4].copy_from_slice(&crc.to_le_bytes());
            out[at + 4..at + 8].copy_from_slice(&stamp.to_le_bytes());
        }
        out
    }

    /// The CRC32 of the region of `len` bytes this index is stored as.
    fn region_crc(&self, len: u64) -> u32 {
        let (mut c, mut at) = (0, 0u64);
        for (&p, &(crc, stamp)) in &self.0 {
            c = crc_zeros(c, p as u64 * 8 - at);
            c = crc32_update(c, &crc.to_le_bytes());
            c = crc32_update(c, &stamp.to_le_bytes());
            at = p as u64 * 8 + 8;
        }
        crc_zeros(c, len - at)
    }

    /// Put this index's CRC and page count into its table entry.
    pub(crate) fn seal(&self, h: &Header, e: &mut Entry) {
        e.index_crc = self.region_crc(h.index_bytes());
        e.written = self.0.len() as u32;
    }
}

/// `crc` continued over `n` zero bytes.
fn crc_zeros(mut crc: u32, mut n: u64) -> u32 {
    static ZEROS: [u8; PAGE] = [0; PAGE];
    while n > 0 {
        let k = n.min(PAGE as u64);
        crc = crc32_update(crc, &ZEROS[..k as usize]);
        n -= k;
    }
    crc
}

/// Whether a failed read is the storage's "cannot read this" (damage),
/// not a misuse or a transient condition.
fn unreadable(e: &CbtError) -> bool {
    matches!(
        e.errno(),
        Some(libc::EIO | libc::EBADMSG | libc::ENODATA | libc::EUCLEAN)
    )
}

impl Disk {
    /// Slot `slot`'s index as stored, and the CRC32 of its region.
    fn read_index(&self, h: &Header, slot: u32) -> Result<(u32, PageIndex), CbtError> {
        let (start, len) = (h.index_offset(slot), h.index_bytes());
        let (mut c, mut at) = (0u32, 0u64);
        let mut idx = PageIndex::default();
        self.data_pages(start, len / PAGE as u64, &mut |q, page| {
            let here = q * PAGE as u64;
            c = crc_zeros(c, here - at);
            c = crc32_update(c, page);
            at = here + PAGE as u64;
            for (i, e) in page.chunks_exact(8).enumerate() {
                if e != [0; 8] {
                    let crc = u32::from_le_bytes(e[..4].try_into().unwrap());
                    let stamp = u32::from_le_bytes(e[4..].try_into().unwrap());
                    idx.0.insert(q as usize * PER_PAGE + i, (crc, stamp));
                }
            }
        })?;
        Ok((crc_zeros(c, len - at), idx))
    }

    /// Checkpoint `e`'s bitmap, checked against its index: Ok(Err(what))
    /// when it is damaged.
    fn check_slot(&self, h: &Header, e: &Entry) -> Result<Result<Loaded, String>, CbtError> {
        let of = |what: String| format!("{what} of checkpoint {}", e.name);
        let (crc, idx) = match self.read_index(h, e.slot) {
            Ok(r) => r,
            Err(err) if unreadable(&err) => return Ok(Err(of("unreadable page index".into()))),
            Err(err) => return Err(err),
        };
        if crc != e.index_crc || idx.0.len() != e.written as usize {
            return Ok(Err(of("hole or bad checksum in the page index".into())));
        }
        let mut bits = Bits::new(h.chunks());
        let mut page = vec![0u8; PAGE];
        let start = h.slot_offset(e.slot);
        for (&p, &(pcrc, stamp)) in &idx.0 {
            if p as u64 >= h.slot_pages() || stamp != e.stamp() {
                return Ok(Err(of(format!("stale index entry for page {p}"))));
            }
            match self.read_at(&mut page, start + (p * PAGE) as u64) {
                Ok(()) => {}
                Err(err) if unreadable(&err) => {
                    return Ok(Err(of(format!("unreadable page {p}"))));
                }
                Err(err) => return Err(err),
            }
            if crc32(&page) != pcrc {
                return Ok(Err(of(format!("hole or bad checksum in page {p}"))));
            }
            bits.load_page(p, &page);
        }
        Ok(Ok((bits, idx)))
    }

    /// Write index pages `qs` of `idx` into slot `slot`'s index region.
    pub(crate) fn write_index(
        &self,
        h: &Header,
        slot: u32,
        idx: &PageIndex,
        qs: &BTreeSet<usize>,
    ) -> Result<(), CbtError> {
        let start = h.index_offset(slot);
        for &q in qs {
            self.write_at(&idx.page(q), start + (q * PAGE) as u64)?;
        }
        Ok(())
    }

    /// Write bitmap pages `pages` of `bits` into checkpoint `e`'s slot, then
    /// their index entries, and seal `e` with the new index (the header,
    /// written by the caller, commits them).
    pub(crate) fn write_recorded(
        &self,
        h: &Header,
        e: &mut Entry,
        idx: &mut PageIndex,
        pages: &[(usize, Vec<u8>)],
    ) -> Result<(), CbtError> {
        self.write_page_bytes(h, e.slot, pages)?;
        for (p, bytes) in pages {
            idx.record(*p, bytes, e.stamp());
        }
        self.write_index(
            h,
            e.slot,
            idx,
            &PageIndex::pages_of(pages.iter().map(|p| p.0)),
        )?;
        idx.seal(h, e);
        Ok(())
    }
}

/// The bitmap and index of every consistent checkpoint of `h`, checked
/// (the integrity rule): a state file shorter than its layout, an index
/// whose CRC or count differs from the table entry, a page whose CRC or
/// stamp differs from its index entry, or a page that cannot be read is
/// damage. Damage to checkpoint k makes c1..ck inconsistent (reason
/// [`Reason::Damaged`], in `h`); returns what was found, for the warning.
/// A format-1 file is read as before and indexed in memory.
pub(crate) fn load_checked(
    disk: &Disk,
    h: &mut Header,
) -> Result<(Vec<Option<Loaded>>, Option<String>), CbtError> {
    let n = h.checkpoints.len();
    let mut out: Vec<Option<Loaded>> = vec![None; n];
    let mut damage = None;
    if let Some(what) = short(disk, h)? {
        damage = Some((n, what));
    }
    if damage.is_none() {
        for k in (0..n).rev() {
            let e = &h.checkpoints[k];
            if e.reason.is_some() {
                break;
            }
            if h.version == V1 {
                let bits = disk.read_slot(h, e.slot)?;
                let idx = PageIndex::of_bits(&bits, e.stamp());
                out[k] = Some((bits, idx));
                continue;
            }
            match disk.check_slot(h, e)? {
                Ok(l) => out[k] = Some(l),
                Err(what) => {
                    damage = Some((k + 1, what));
                    break;
                }
            }
        }
    }
    let Some((upto, what)) = damage else {
        return Ok((out, None));
    };
    for (e, l) in h.checkpoints[..upto].iter_mut().zip(&mut out) {
        *l = None;
        if e.reason.is_none() {
            e.reason = Some(Reason::Damaged);
        }
    }
    h.generation += 1;
    Ok((out, Some(what)))
}

/// "short file ..." when a format-2 file with a consistent checkpoint is
/// shorter than its layout (truncated): its bitmaps cannot all be there.
pub(crate) fn short(disk: &Disk, h: &Header) -> Result<Option<String>, CbtError> {
    if h.version == V1 || h.checkpoints.iter().all(|e| e.reason.is_some()) {
        return Ok(None);
    }
    let len = disk.len()?;
    Ok((len < h.file_len()).then(|| format!("short file: {len} of {} bytes", h.file_len())))
}

/// Bring `h` (and its file) to what this rawdisk writes, after
/// [`load_checked`]: a format-1 file is converted to format 2, and a header
/// without checkpoint identities (format 1, or format 2 written before
/// them) gets them, ids first: the stamps of the index fold in each
/// checkpoint's sequence number, so every consistent checkpoint's index is
/// then written anew with them (`loaded` updated to match). Returns whether
/// anything changed: the caller commits the header (which makes the file
/// format 2, and long enough).
pub(crate) fn upgrade(
    disk: &Disk,
    h: &mut Header,
    loaded: &mut [Option<Loaded>],
) -> Result<bool, CbtError> {
    let v1 = h.version == V1;
    if !assign_ids(h) && !v1 {
        return Ok(false);
    }
    h.version = super::format::VERSION;
    let snapshot = h.clone();
    for (e, l) in h.checkpoints.iter_mut().zip(loaded) {
        let Some((bits, idx)) = l else {
            continue;
        };
        *idx = PageIndex::of_bits(bits, e.stamp());
        disk.clear_index(&snapshot, e.slot)?;
        let qs = PageIndex::pages_of(idx.0.keys().copied());
        disk.write_index(&snapshot, e.slot, idx, &qs)?;
        idx.seal(&snapshot, e);
    }
    if v1 {
        // Said at warning level: rawdisk before format 2 cannot read it now.
        tracing::warn!(
            "converted changed-block state {} to format 2 (checksummed bitmap pages; older \
             rawdisk cannot read it)",
            disk.path.display()
        );
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_crc_streams_zeros_as_the_bytes_would() {
        let mut idx = PageIndex::default();
        idx.0.insert(3, (0xdead_beef, 7));
        idx.0.insert(700, (1, 2));
        let len = 2 * PAGE as u64;
        let mut bytes = idx.page(0);
        bytes.extend(idx.page(1));
        assert_eq!(idx.region_crc(len), crc32(&bytes));
        assert_eq!(PageIndex::default().region_crc(len), crc32(&[0; 2 * PAGE]));
    }
}
