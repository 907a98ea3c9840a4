//! `rawdisk map`: the allocation map of a target, in the form of
//! `qemu-img map` (checked against qemu-img 10.0 on raw files):
//!
//! * JSON: one object per run with the keys `start`, `length`, `depth`,
//!   `present`, `zero`, `data`, `compressed`, `offset`, in that order, printed
//!   as qemu-img does (`[{ "start": 0, ...},\n{ ...}]`) so output of the two
//!   tools can be compared with `diff`. A hole is `zero: true, data: false`,
//!   allocated data `zero: false, data: true`; a raw target maps onto itself,
//!   so `offset` equals `start`. Adjacent runs with the same flags are merged.
//! * human: qemu-img's table of the data runs only (`Offset Length Mapped
//!   to File`, hexadecimal).
//!
//! Two deliberate differences: the last run ends at the real size of a file
//! whose size is not a multiple of 512 (qemu-img rounds it up to the sector),
//! and an empty target prints `[]` (qemu-img prints a zero-length,
//! not-present run).

use std::path::Path;

use rawdisk_storage::{ExtentKind, Target};
use serde::Serialize;

use crate::error::{Error, Result};

/// One run of the map, with qemu-img's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MapEntry {
    pub start: u64,
    pub length: u64,
    pub depth: u32,
    pub present: bool,
    pub zero: bool,
    pub data: bool,
    pub compressed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
}

impl MapEntry {
    /// A run of a raw target: present, mapped onto itself.
    pub fn raw(start: u64, length: u64, zero: bool, data: bool) -> MapEntry {
        MapEntry {
            start,
            length,
            depth: 0,
            present: true,
            zero,
            data,
            compressed: false,
            offset: Some(start),
        }
    }

    pub fn end(&self) -> u64 {
        self.start + self.length
    }

    /// qemu-img merges runs with equal flags whose offsets are contiguous.
    fn mergeable(&self, next: &MapEntry) -> bool {
        self.end() == next.start
            && self.depth == next.depth
            && self.present == next.present
            && self.zero == next.zero
            && self.data == next.data
            && self.compressed == next.compressed
            && match (self.offset, next.offset) {
                (Some(a), Some(b)) => a + self.length == b,
                (None, None) => true,
                _ => false,
            }
    }
}

/// Appends `e` to `out`, merging it into the last run when qemu-img would.
pub fn push_merged(out: &mut Vec<MapEntry>, e: MapEntry) {
    if e.length == 0 {
        return;
    }
    if let Some(last) = out.last_mut() {
        if last.mergeable(&e) {
            last.length += e.length;
            return;
        }
    }
    out.push(e);
}

/// Most runs asked from the engine per call: bounds memory on a badly
/// fragmented file while keeping the number of calls small.
const RUNS_PER_CALL: usize = 4096;

/// The map of a file or block device; one that looks like another image
/// format is refused unless `raw` (its map would not be the disk's).
pub fn map_path(path: &Path, raw: bool) -> Result<Vec<MapEntry>> {
    let t = crate::open_read_only(path)?;
    if !raw {
        crate::refuse_other_format(&t, path)?;
    }
    map_target(&t).map_err(|e| Error::with(format!("map '{}'", path.display()), e))
}

/// The map of an open target, from the engine's extents (SEEK_DATA /
/// SEEK_HOLE on files; a block device is all data).
pub fn map_target(t: &Target) -> std::result::Result<Vec<MapEntry>, rawdisk_storage::Error> {
    let size = t.size();
    let mut out = Vec::new();
    let mut off = 0u64;
    while off < size {
        let runs = t.extents(off, size - off, RUNS_PER_CALL)?;
        if runs.is_empty() {
            return Err(no_progress(off, size - off));
        }
        for r in runs {
            // The engine promises a contiguous prefix of the request; a gap or
            // an overlap would make the map lie, so refuse it.
            if r.offset != off || r.len == 0 || r.offset + r.len > size {
                return Err(no_progress(off, size - off));
            }
            let hole = r.kind == ExtentKind::Hole;
            push_merged(&mut out, MapEntry::raw(r.offset, r.len, hole, !hole));
            off += r.len;
        }
    }
    Ok(out)
}

fn no_progress(off: u64, len: u64) -> rawdisk_storage::Error {
    rawdisk_storage::Error::new(
        "extents",
        off,
        len,
        std::io::Error::other("the storage engine returned no contiguous run"),
    )
}

/// qemu-img's JSON layout, byte for byte.
pub fn to_json(entries: &[MapEntry]) -> String {
    let mut s = String::from("[");
    for (i, e) in entries.iter().enumerate() {
        if i > 0 {
            s.push_str(",\n");
        }
        s.push_str(&format!(
            "{{ \"start\": {}, \"length\": {}, \"depth\": {}, \"present\": {}, \"zero\": {}, \"data\": {}, \"compressed\": {}",
            e.start, e.length, e.depth, e.present, e.zero, e.data, e.compressed
        ));
        if let Some(o) = e.offset {
            s.push_str(&format!(", \"offset\": {o}"));
        }
        s.push('}');
    }
    s.push_str("]\n");
    s
}

/// printf's `%#x`: "0x..." except for zero, which is plain "0".
fn c_hex(v: u64) -> String {
    if v == 0 {
        "0".into()
    } else {
        format!("{v:#x}")
    }
}

/// qemu-img's human map: the runs that hold data, in hexadecimal.
pub fn to_human(entries: &[MapEntry], file: &str) -> String {
    let mut s = format!(
        "{:<16}{:<16}{:<16}{}\n",
        "Offset", "Length", "Mapped to", "File"
    );
    for e in entries.iter().filter(|e| e.data && !e.zero) {
        s.push_str(&format!(
            "{:<16}{:<16}{:<16}{}\n",
            c_hex(e.start),
            c_hex(e.length),
            c_hex(e.offset.unwrap_or(0)),
            file
        ));
    }
    s
}

/// The map of a local path, or of an NBD export when `target` is an NBD URI.
pub fn map_target_or_uri(target: &str, raw: bool) -> Result<Vec<MapEntry>> {
    if crate::endpoint::is_nbd(target) {
        return map_nbd(target, raw);
    }
    map_path(Path::new(target), raw)
}

/// The map of an NBD export from NBD_CMD_BLOCK_STATUS (base:allocation):
/// NBD_STATE_HOLE clear is `data`, NBD_STATE_ZERO is `zero`, as qemu-img
/// maps them. A server without block status maps as all data.
pub fn map_nbd(uri: &str, raw: bool) -> Result<Vec<MapEntry>> {
    let opts = crate::endpoint::EndpointOptions {
        raw: true,
        ..Default::default()
    };
    let ep = crate::endpoint::Endpoint::open_with(uri, &opts)
        .map_err(|e| Error::with(format!("cannot connect to '{uri}'"), e))?;
    if !raw {
        ep.refuse_other_format()
            .map_err(|e| Error::msg(e.to_string()))?;
    }
    let size = ep.size();
    let mut out = Vec::new();
    let mut off = 0u64;
    while off < size {
        let runs = ep
            .extents(off, size - off)
            .map_err(|e| Error::with(format!("map '{uri}'"), e))?;
        let before = off;
        for r in runs {
            if r.offset != off || r.len == 0 {
                break;
            }
            push_merged(&mut out, MapEntry::raw(r.offset, r.len, r.zero, r.data));
            off += r.len;
        }
        if off == before {
            return Err(Error::msg(format!(
                "map '{uri}': the server returned no block status at offset {off}"
            )));
        }
    }
    let _ = ep.close();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_equal_neighbours_only() {
        let mut v = Vec::new();
        push_merged(&mut v, MapEntry::raw(0, 10, true, false));
        push_merged(&mut v, MapEntry::raw(10, 5, true, false));
        push_merged(&mut v, MapEntry::raw(15, 0, false, true));
        push_merged(&mut v, MapEntry::raw(15, 5, false, true));
        push_merged(&mut v, MapEntry::raw(20, 5, true, false));
        assert_eq!(
            v,
            vec![
                MapEntry::raw(0, 15, true, false),
                MapEntry::raw(15, 5, false, true),
                MapEntry::raw(20, 5, true, false)
            ]
        );
    }

    #[test]
    fn json_layout_is_qemu_imgs() {
        // What qemu-img 10.0 prints for a 10 MiB raw file with data at 320 KiB.
        let v = vec![
            MapEntry::raw(0, 327680, true, false),
            MapEntry::raw(327680, 196608, false, true),
        ];
        assert_eq!(
            to_json(&v),
            "[{ \"start\": 0, \"length\": 327680, \"depth\": 0, \"present\": true, \"zero\": true, \"data\": false, \"compressed\": false, \"offset\": 0},\n\
             { \"start\": 327680, \"length\": 196608, \"depth\": 0, \"present\": true, \"zero\": false, \"data\": true, \"compressed\": false, \"offset\": 327680}]\n"
        );
        let parsed: serde_json::Value = serde_json::from_str(&to_json(&v)).unwrap();
        assert_eq!(parsed.as_array().unwrap().len(), 2);
        assert_eq!(to_json(&[]), "[]\n");
    }

    #[test]
    fn human_lists_data_runs() {
        let v = vec![
            MapEntry::raw(0, 0x50000, true, false),
            MapEntry::raw(0x50000, 0x30000, false, true),
        ];
        assert_eq!(
            to_human(&v, "a.img"),
            "Offset          Length          Mapped to       File\n\
             0x50000         0x30000         0x50000         a.img\n"
        );
    }
}
