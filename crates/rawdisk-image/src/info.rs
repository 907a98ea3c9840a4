//! `rawdisk info`: size, allocation and properties of a target, in the idiom
//! of `qemu-img info` (its first lines and JSON keys: `filename`, `format`,
//! `virtual-size`, `actual-size`), plus what qemu-img does not print: the kind,
//! sector sizes and I/O hints, the file system a file lives on, the file
//! behind a loop device.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use rawdisk_storage::Kind;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::output::{human_size, Fields};
use crate::sysinfo::{self, MountInfo};

#[derive(Debug, Clone, Serialize)]
pub struct Info {
    pub filename: String,
    /// Always "raw": rawdisk reads no image format.
    pub format: &'static str,
    #[serde(rename = "virtual-size")]
    pub virtual_size: u64,
    /// Bytes allocated (st_blocks × 512); absent where it cannot be known.
    #[serde(rename = "actual-size", skip_serializing_if = "Option::is_none")]
    pub actual_size: Option<u64>,
    /// "file", "block" or "nbd".
    pub kind: &'static str,
    #[serde(
        rename = "logical-sector-size",
        skip_serializing_if = "Option::is_none"
    )]
    pub logical_sector_size: Option<u32>,
    #[serde(
        rename = "physical-sector-size",
        skip_serializing_if = "Option::is_none"
    )]
    pub physical_sector_size: Option<u32>,
    #[serde(rename = "minimum-io-size", skip_serializing_if = "Option::is_none")]
    pub minimum_io_size: Option<u32>,
    #[serde(rename = "optimal-io-size", skip_serializing_if = "Option::is_none")]
    pub optimal_io_size: Option<u32>,
    pub rotational: bool,
    #[serde(rename = "read-only")]
    pub read_only: bool,
    /// For an NBD URI: what the handshake told, with nbdinfo's key names.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nbd: Option<NbdExport>,
    /// Alignment O_DIRECT (`--cache none`) needs; absent where O_DIRECT is
    /// not known to work.
    #[serde(
        rename = "direct-io-alignment",
        skip_serializing_if = "Option::is_none"
    )]
    pub dio_alignment: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filesystem: Option<MountInfo>,
    #[serde(rename = "loop-backing-file", skip_serializing_if = "Option::is_none")]
    pub loop_backing_file: Option<LoopBacking>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LoopBacking {
    pub filename: String,
    #[serde(rename = "actual-size", skip_serializing_if = "Option::is_none")]
    pub actual_size: Option<u64>,
}

/// Info about a file or block device (opened read-only; nothing is written).
pub fn info_path(path: &Path) -> Result<Info> {
    let t = crate::open_read_only(path)?;
    let g = t.geometry();
    let md = std::fs::metadata(path)
        .map_err(|e| Error::with(format!("stat '{}'", path.display()), e))?;
    let (kind, actual, fs, backing) = match t.kind() {
        Kind::File => (
            "file",
            Some(md.blocks() * 512),
            sysinfo::mount_of(path),
            None,
        ),
        Kind::Block => {
            let backing = sysinfo::loop_backing_file(path).map(|f| LoopBacking {
                actual_size: std::fs::metadata(&f).ok().map(|m| m.blocks() * 512),
                filename: f.display().to_string(),
            });
            ("block", None, None, backing)
        }
    };
    Ok(Info {
        filename: path.display().to_string(),
        format: "raw",
        virtual_size: t.size(),
        actual_size: actual,
        kind,
        logical_sector_size: Some(g.logical_sector),
        physical_sector_size: Some(g.physical_sector),
        minimum_io_size: Some(g.min_io),
        optimal_io_size: Some(g.opt_io),
        rotational: g.rotational,
        // The engine reports how the target was opened (read-only here);
        // the user wants to know whether it could be written.
        read_only: sysinfo::read_only(path),
        dio_alignment: (g.dio_align > 0).then_some(g.dio_align),
        nbd: None,
        filesystem: fs,
        loop_backing_file: backing,
    })
}

impl Info {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }

    /// qemu-img's first four lines, then the rest aligned.
    pub fn to_human(&self) -> String {
        let mut s = format!(
            "image: {}\nfile format: {}\nvirtual size: {} ({} bytes)\ndisk size: {}\n",
            self.filename,
            self.format,
            human_size(self.virtual_size),
            self.virtual_size,
            self.actual_size
                .map(human_size)
                .unwrap_or_else(|| "unavailable".into())
        );
        let mut f = Fields::new();
        f.add(
            "kind",
            match self.kind {
                "file" => "regular file",
                "block" => "block device",
                "nbd" => "NBD export",
                other => other,
            },
        );
        if let Some(m) = &self.filesystem {
            f.add(
                "file system",
                format!("{} on {} ({})", m.fs_type, m.mount_point, m.source),
            );
        }
        if let Some(b) = &self.loop_backing_file {
            f.add(
                "loop backing file",
                match b.actual_size {
                    Some(a) => format!("{} (disk size {})", b.filename, human_size(a)),
                    None => b.filename.clone(),
                },
            );
        }
        if let Some(n) = &self.nbd {
            n.add_human(&mut f);
        }
        if let Some(v) = self.logical_sector_size {
            f.add("logical sector size", v.to_string());
        }
        if let Some(v) = self.physical_sector_size {
            f.add("physical sector size", v.to_string());
        }
        if let Some(v) = self.minimum_io_size {
            f.add("minimum I/O size", v.to_string());
        }
        if let Some(v) = self.optimal_io_size {
            f.add(
                "optimal I/O size",
                if v == 0 {
                    "0 (none reported)".to_string()
                } else {
                    v.to_string()
                },
            );
        }
        if self.nbd.is_none() {
            f.add("rotational", yes_no(self.rotational));
            f.add("read-only", yes_no(self.read_only));
        }
        if self.nbd.is_none() {
            f.add(
                "direct I/O alignment",
                self.dio_alignment
                    .map(|a| a.to_string())
                    .unwrap_or_else(|| "unknown".into()),
            );
        }
        s.push_str(&f.render());
        s
    }
}

pub(crate) fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// Info about a local path, or about an NBD export when `target` is an NBD URI.
pub fn info_target_or_uri(target: &str) -> Result<Info> {
    if crate::endpoint::is_nbd(target) {
        return info_nbd(target);
    }
    info_path(Path::new(target))
}

/// An NBD export as the handshake described it; the keys are nbdinfo's
/// (`nbdinfo --json`), so the two can be compared.
#[derive(Debug, Clone, Serialize)]
pub struct NbdExport {
    #[serde(rename = "export-name")]
    pub export_name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub protocol: &'static str,
    pub structured: bool,
    #[serde(rename = "extended-headers")]
    pub extended_headers: bool,
    pub contexts: Vec<String>,
    /// Transmission flags that are set (NBD_FLAG_* names).
    pub flags: Vec<&'static str>,
    pub is_rotational: bool,
    pub is_read_only: bool,
    pub can_cache: bool,
    pub can_df: bool,
    pub can_fast_zero: bool,
    pub can_flush: bool,
    pub can_fua: bool,
    pub can_multi_conn: bool,
    pub can_trim: bool,
    pub can_zero: bool,
    /// Only when the server sent NBD_INFO_BLOCK_SIZE (as nbdinfo).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size_minimum: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size_preferred: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size_maximum: Option<u32>,
    #[serde(rename = "export-size")]
    pub export_size: u64,
}

impl NbdExport {
    fn add_human(&self, f: &mut Fields) {
        f.add("export name", format!("{:?}", self.export_name));
        if let Some(d) = &self.description {
            f.add("description", d.clone());
        }
        let mut proto = self.protocol.to_string();
        if self.structured {
            proto.push_str(", structured replies");
        }
        if self.extended_headers {
            proto.push_str(", extended headers");
        }
        f.add("protocol", proto);
        f.add(
            "contexts",
            if self.contexts.is_empty() {
                "none (no block status)".to_string()
            } else {
                self.contexts.join(", ")
            },
        );
        for (k, v) in [
            ("is_rotational", self.is_rotational),
            ("is_read_only", self.is_read_only),
            ("can_cache", self.can_cache),
            ("can_df", self.can_df),
            ("can_fast_zero", self.can_fast_zero),
            ("can_flush", self.can_flush),
            ("can_fua", self.can_fua),
            ("can_multi_conn", self.can_multi_conn),
            ("can_trim", self.can_trim),
            ("can_zero", self.can_zero),
        ] {
            f.add(k, v.to_string());
        }
        match (
            self.block_size_minimum,
            self.block_size_preferred,
            self.block_size_maximum,
        ) {
            (Some(a), Some(b), Some(c)) => {
                f.add("block_size_minimum", a.to_string());
                f.add("block_size_preferred", b.to_string());
                f.add("block_size_maximum", c.to_string());
            }
            _ => {
                f.add("block sizes", "not advertised");
            }
        }
    }
}

/// Info about an NBD export: size and what the handshake negotiated. Nothing
/// is read or written.
pub fn info_nbd(uri: &str) -> Result<Info> {
    let ep = crate::endpoint::Endpoint::open(uri, false)
        .map_err(|e| Error::with(format!("cannot connect to '{uri}'"), e))?;
    let i = ep
        .nbd_info()
        .ok_or_else(|| Error::msg(format!("'{uri}' is not an NBD export")))?
        .clone();
    let size = ep.size();
    let _ = ep.close();
    let adv = i.block_size_advertised;
    let n = NbdExport {
        export_name: i.name.clone(),
        description: i.description.clone(),
        protocol: "newstyle-fixed",
        structured: i.structured_replies,
        extended_headers: i.extended_headers,
        contexts: i.meta_context.iter().cloned().collect(),
        flags: i.flag_names(),
        is_rotational: i.rotational(),
        is_read_only: i.read_only(),
        can_cache: i.can_cache(),
        can_df: i.can_df(),
        can_fast_zero: i.can_fast_zero(),
        can_flush: i.can_flush(),
        can_fua: i.can_fua(),
        can_multi_conn: i.can_multi_conn(),
        can_trim: i.can_trim(),
        can_zero: i.can_zero(),
        block_size_minimum: adv.then_some(i.min_block),
        block_size_preferred: adv.then_some(i.pref_block),
        block_size_maximum: adv.then_some(i.max_payload),
        export_size: size,
    };
    Ok(Info {
        filename: uri.to_string(),
        format: "raw",
        virtual_size: size,
        actual_size: None,
        kind: "nbd",
        logical_sector_size: None,
        physical_sector_size: None,
        minimum_io_size: None,
        optimal_io_size: None,
        rotational: n.is_rotational,
        read_only: n.is_read_only,
        nbd: Some(n),
        dio_alignment: None,
        filesystem: None,
        loop_backing_file: None,
    })
}
