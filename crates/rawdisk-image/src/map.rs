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
//!   to File`, hexadecimal); an NBD export is named in `File` by its URI as
//!   qemu-img spells it.
//! * Streamed: each run is printed once the next one shows it cannot grow,
//!   so memory does not grow with the number of extents, and only the range
//!   asked for (`--start-offset`, `--max-length`) is looked up. An error
//!   found midway ends the output where it is, as qemu-img's does.
//!
//! Two deliberate differences: the last run ends at the real size of a file
//! whose size is not a multiple of 512 (qemu-img rounds it up to the sector),
//! and an empty target prints `[]` (qemu-img prints a zero-length,
//! not-present run).

use std::io::{self, Write};
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

/// Which part of the target to map, as qemu-img's `--start-offset` and
/// `--max-length` give it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapRange {
    pub start: u64,
    /// None: to the end of the target.
    pub max_length: Option<u64>,
}

impl MapRange {
    /// The end of the range on a target of `size` bytes (at most `size`).
    fn end(&self, size: u64) -> u64 {
        match self.max_length {
            Some(l) => self.start.saturating_add(l).min(size),
            None => size,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapFormat {
    Human,
    Json,
}

/// Prints runs as they come, merging neighbours as qemu-img does: only the
/// run being merged is held, so memory stays flat at any extent count.
pub struct MapPrinter<'a> {
    out: &'a mut dyn Write,
    format: MapFormat,
    file: &'a str,
    pending: Option<MapEntry>,
    printed: bool,
}

impl<'a> MapPrinter<'a> {
    /// Writes the header (`[` or the table's titles).
    pub fn begin(
        out: &'a mut dyn Write,
        format: MapFormat,
        file: &'a str,
    ) -> io::Result<MapPrinter<'a>> {
        match format {
            MapFormat::Json => out.write_all(b"[")?,
            MapFormat::Human => writeln!(
                out,
                "{:<16}{:<16}{:<16}File",
                "Offset", "Length", "Mapped to"
            )?,
        }
        Ok(MapPrinter {
            out,
            format,
            file,
            pending: None,
            printed: false,
        })
    }

    /// Adds the next run; it must start where the previous one ended.
    pub fn push(&mut self, e: MapEntry) -> io::Result<()> {
        if e.length == 0 {
            return Ok(());
        }
        if let Some(p) = self.pending.as_mut() {
            if p.mergeable(&e) {
                p.length += e.length;
                return Ok(());
            }
            let p = *p;
            self.emit(&p)?;
        }
        self.pending = Some(e);
        Ok(())
    }

    /// Prints the last run, or `empty` when there was none, closes the list
    /// and flushes.
    pub fn finish(mut self, empty: Option<MapEntry>) -> io::Result<()> {
        if let Some(e) = self.pending.take().or(empty) {
            self.emit(&e)?;
        }
        if self.format == MapFormat::Json {
            self.out.write_all(b"]\n")?;
        }
        self.out.flush()
    }

    fn emit(&mut self, e: &MapEntry) -> io::Result<()> {
        match self.format {
            MapFormat::Json => {
                if self.printed {
                    self.out.write_all(b",\n")?;
                }
                write!(
                    self.out,
                    "{{ \"start\": {}, \"length\": {}, \"depth\": {}, \"present\": {}, \"zero\": {}, \"data\": {}, \"compressed\": {}",
                    e.start, e.length, e.depth, e.present, e.zero, e.data, e.compressed
                )?;
                if let Some(o) = e.offset {
                    write!(self.out, ", \"offset\": {o}")?;
                }
                self.out.write_all(b"}")?;
            }
            MapFormat::Human => {
                if e.data && !e.zero {
                    writeln!(
                        self.out,
                        "{:<16}{:<16}{:<16}{}",
                        CHex(e.start),
                        CHex(e.length),
                        CHex(e.offset.unwrap_or(0)),
                        self.file
                    )?;
                }
            }
        }
        self.printed = true;
        Ok(())
    }
}

/// printf's `%#x`: "0x..." except for zero, which is plain "0".
struct CHex(u64);

impl std::fmt::Display for CHex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0 == 0 {
            f.pad("0")
        } else {
            f.pad(&format!("{:#x}", self.0))
        }
    }
}

/// Most runs asked from the engine per call: bounds memory on a badly
/// fragmented file while keeping the number of calls small.
const RUNS_PER_CALL: usize = 4096;

/// The span one NBD block status request asks about, adapted to the
/// export: a reply's descriptors (its memory) grow with the span on a
/// fragmented export, while a sparse one needs few requests only if the
/// span is large. It starts at the first, halves down to the second while
/// replies are long, doubles up to the third while they are short.
const NBD_SPAN: (u64, u64, u64) = (64 << 20, 1 << 20, 1 << 30);
/// Reply lengths (descriptors) that halve and double the span.
const NBD_LONG_REPLY: usize = 4096;
const NBD_SHORT_REPLY: usize = 64;

/// Streams the map of a file, block device or NBD URI, cut to `range`
/// (None: the whole target), to `out` in qemu-img's layout. Output errors
/// are returned with the context "map: write the output".
pub fn write_map(
    target: &str,
    raw: bool,
    range: Option<MapRange>,
    format: MapFormat,
    out: &mut dyn Write,
) -> Result<()> {
    if crate::endpoint::is_nbd(target) {
        return map_nbd(target, raw, range, format, out);
    }
    let path = Path::new(target);
    let t = crate::open_read_only(path)?;
    if !raw {
        crate::refuse_other_format(&t, path)?;
    }
    write_target_map(&t, target, range, format, out)
}

/// [`write_map`] of an open file or block device, named `name` in errors
/// and in the human map.
pub fn write_target_map(
    t: &Target,
    name: &str,
    range: Option<MapRange>,
    format: MapFormat,
    out: &mut dyn Write,
) -> Result<()> {
    let r = range.unwrap_or_default();
    let end = r.end(t.size());
    let mut p = MapPrinter::begin(out, format, name).map_err(output_err)?;
    let mut off = r.start;
    while off < end {
        let runs = t
            .extents(off, end - off, RUNS_PER_CALL)
            .map_err(|e| Error::with(format!("map '{name}'"), e))?;
        if runs.is_empty() {
            return Err(Error::with(
                format!("map '{name}'"),
                no_progress(off, end - off),
            ));
        }
        for run in runs {
            // The engine promises a contiguous prefix of the request; a gap or
            // an overlap would make the map lie, so refuse it.
            if run.offset != off || run.len == 0 || run.offset + run.len > end {
                return Err(Error::with(
                    format!("map '{name}'"),
                    no_progress(off, end - off),
                ));
            }
            let hole = run.kind == ExtentKind::Hole;
            p.push(MapEntry::raw(run.offset, run.len, hole, !hole))
                .map_err(output_err)?;
            off += run.len;
        }
    }
    p.finish(range.map(empty_run)).map_err(output_err)
}

/// What qemu-img prints for a range with nothing in it (past the end, or
/// `--max-length 0`): one empty run, not present, at the start offset. The
/// whole map of an empty target is `[]`.
fn empty_run(r: MapRange) -> MapEntry {
    MapEntry {
        start: r.start,
        length: 0,
        depth: 0,
        present: false,
        zero: false,
        data: false,
        compressed: false,
        offset: None,
    }
}

fn output_err(e: io::Error) -> Error {
    Error::with("map: write the output", e)
}

fn no_progress(off: u64, len: u64) -> rawdisk_storage::Error {
    rawdisk_storage::Error::new(
        "extents",
        off,
        len,
        std::io::Error::other("the storage engine returned no contiguous run"),
    )
}

/// An export's name in the human map's File column, spelled as qemu-img
/// spells it: the default port written out, the export name decoded and
/// left out when empty, an IPv6 address without brackets. A TLS URI, which
/// qemu-img cannot open as one, is left as given.
fn qemu_name(uri: &str) -> String {
    use rawdisk_nbd::uri::{NbdUri, Transport};
    let Ok(u) = NbdUri::parse(uri) else {
        return uri.to_string();
    };
    if u.tls.is_some() {
        return uri.to_string();
    }
    let export = if u.export.is_empty() {
        String::new()
    } else {
        format!("/{}", u.export)
    };
    match u.transport {
        Transport::Unix { path } => format!("nbd+unix://{export}?socket={}", path.display()),
        Transport::Tcp { host, port } => format!("nbd://{host}:{port}{export}"),
    }
}

/// The map of an NBD export from NBD_CMD_BLOCK_STATUS (base:allocation):
/// NBD_STATE_HOLE clear is `data`, NBD_STATE_ZERO is `zero`, as qemu-img
/// maps them. A server without block status maps as all data.
fn map_nbd(
    uri: &str,
    raw: bool,
    range: Option<MapRange>,
    format: MapFormat,
    out: &mut dyn Write,
) -> Result<()> {
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
    // Disconnect politely also when the output fails (a closed pipe).
    let r = map_endpoint(&ep, uri, range, format, out);
    let _ = ep.close();
    r
}

fn map_endpoint(
    ep: &crate::endpoint::Endpoint,
    uri: &str,
    range: Option<MapRange>,
    format: MapFormat,
    out: &mut dyn Write,
) -> Result<()> {
    let r = range.unwrap_or_default();
    let end = r.end(ep.size());
    let name = qemu_name(uri);
    let mut p = MapPrinter::begin(out, format, &name).map_err(output_err)?;
    let mut off = r.start;
    let mut span = NBD_SPAN.0;
    while off < end {
        let runs = ep
            .extents(off, (end - off).min(span))
            .map_err(|e| Error::with(format!("map '{uri}'"), e))?;
        if runs.len() > NBD_LONG_REPLY {
            span = (span / 2).max(NBD_SPAN.1);
        } else if runs.len() < NBD_SHORT_REPLY {
            span = (span * 2).min(NBD_SPAN.2);
        }
        let before = off;
        for run in runs {
            if run.offset != off || run.len == 0 || off >= end {
                break;
            }
            let len = run.len.min(end - off);
            p.push(MapEntry::raw(off, len, run.zero, run.data))
                .map_err(output_err)?;
            off += len;
        }
        if off == before {
            return Err(Error::msg(format!(
                "map '{uri}': the server returned no block status at offset {off}"
            )));
        }
    }
    p.finish(range.map(empty_run)).map_err(output_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(entries: &[MapEntry], format: MapFormat, empty: Option<MapEntry>) -> String {
        let mut buf = Vec::new();
        let mut p = MapPrinter::begin(&mut buf, format, "a.img").unwrap();
        for e in entries {
            p.push(*e).unwrap();
        }
        p.finish(empty).unwrap();
        String::from_utf8(buf).unwrap()
    }

    #[test]
    fn merges_equal_neighbours_only() {
        let v = [
            MapEntry::raw(0, 10, true, false),
            MapEntry::raw(10, 5, true, false),
            MapEntry::raw(15, 0, false, true),
            MapEntry::raw(15, 5, false, true),
            MapEntry::raw(20, 5, true, false),
        ];
        let merged = [
            MapEntry::raw(0, 15, true, false),
            MapEntry::raw(15, 5, false, true),
            MapEntry::raw(20, 5, true, false),
        ];
        for format in [MapFormat::Json, MapFormat::Human] {
            assert_eq!(render(&v, format, None), render(&merged, format, None));
        }
        assert_eq!(render(&merged, MapFormat::Json, None).lines().count(), 3);
    }

    #[test]
    fn json_layout_is_qemu_imgs() {
        // What qemu-img 10.0 prints for a 10 MiB raw file with data at 320 KiB.
        let v = [
            MapEntry::raw(0, 327680, true, false),
            MapEntry::raw(327680, 196608, false, true),
        ];
        let text = render(&v, MapFormat::Json, None);
        assert_eq!(
            text,
            "[{ \"start\": 0, \"length\": 327680, \"depth\": 0, \"present\": true, \"zero\": true, \"data\": false, \"compressed\": false, \"offset\": 0},\n\
             { \"start\": 327680, \"length\": 196608, \"depth\": 0, \"present\": true, \"zero\": false, \"data\": true, \"compressed\": false, \"offset\": 327680}]\n"
        );
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(parsed.as_array().unwrap().len(), 2);
        assert_eq!(render(&[], MapFormat::Json, None), "[]\n");
        // An empty range: qemu-img's one empty, not present run.
        let empty = empty_run(MapRange {
            start: 7,
            max_length: Some(0),
        });
        assert_eq!(
            render(&[], MapFormat::Json, Some(empty)),
            "[{ \"start\": 7, \"length\": 0, \"depth\": 0, \"present\": false, \"zero\": false, \"data\": false, \"compressed\": false}]\n"
        );
        // It stands in only for a range with no runs.
        assert_eq!(render(&v, MapFormat::Json, Some(empty)), text);
    }

    #[test]
    fn human_lists_data_runs() {
        let v = [
            MapEntry::raw(0, 0x50000, true, false),
            MapEntry::raw(0x50000, 0x30000, false, true),
        ];
        assert_eq!(
            render(&v, MapFormat::Human, None),
            "Offset          Length          Mapped to       File\n\
             0x50000         0x30000         0x50000         a.img\n"
        );
        let at0 = [MapEntry::raw(0, 0x1000, false, true)];
        assert_eq!(
            render(&at0, MapFormat::Human, None),
            "Offset          Length          Mapped to       File\n\
             0               0x1000          0               a.img\n"
        );
    }

    #[test]
    fn nbd_names_are_spelled_as_qemu_img_spells_them() {
        // What qemu-img 10.0 prints in the File column for each URI.
        for (uri, want) in [
            (
                "nbd+unix:///?socket=/run/a.sock",
                "nbd+unix://?socket=/run/a.sock",
            ),
            (
                "nbd+unix:///a%20b?socket=/run/a.sock",
                "nbd+unix:///a b?socket=/run/a.sock",
            ),
            ("nbd://127.0.0.1/e", "nbd://127.0.0.1:10809/e"),
            ("nbd://127.0.0.1:2000/", "nbd://127.0.0.1:2000"),
            ("nbd://localhost:2000/x/y", "nbd://localhost:2000/x/y"),
            ("nbd://[::1]:2000/e", "nbd://::1:2000/e"),
            ("nbd://localhost:2000/%41", "nbd://localhost:2000/A"),
            ("nbds://h/e", "nbds://h/e"),
        ] {
            assert_eq!(qemu_name(uri), want, "{uri}");
        }
    }

    #[test]
    fn range_end_is_clipped_to_the_size() {
        let r = |start, max_length| MapRange { start, max_length };
        assert_eq!(r(0, None).end(100), 100);
        assert_eq!(r(10, Some(20)).end(100), 30);
        assert_eq!(r(90, Some(20)).end(100), 100);
        assert_eq!(r(u64::MAX - 1, Some(u64::MAX)).end(100), 100);
    }
}
