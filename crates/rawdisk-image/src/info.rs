//! `rawdisk info`: size, allocation and properties of a target, in the idiom
//! of `qemu-img info` (its first lines and JSON keys: `filename`, `format`,
//! `virtual-size`, `actual-size`), plus what qemu-img does not print: the kind,
//! sector sizes and I/O hints, the file system a file lives on, the file
//! behind a loop device.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use rawdisk_storage::{Kind, OpenOptions, Target};
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
    #[serde(rename = "logical-sector-size")]
    pub logical_sector_size: u32,
    #[serde(rename = "physical-sector-size")]
    pub physical_sector_size: u32,
    #[serde(rename = "minimum-io-size")]
    pub minimum_io_size: u32,
    #[serde(rename = "optimal-io-size")]
    pub optimal_io_size: u32,
    pub rotational: bool,
    #[serde(rename = "read-only")]
    pub read_only: bool,
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
    let t = Target::open(
        path,
        &OpenOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .map_err(|e| Error::with(format!("open '{}'", path.display()), e))?;
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
        logical_sector_size: g.logical_sector,
        physical_sector_size: g.physical_sector,
        minimum_io_size: g.min_io,
        optimal_io_size: g.opt_io,
        rotational: g.rotational,
        // The engine reports how the target was opened (read-only here);
        // the user wants to know whether it could be written.
        read_only: sysinfo::read_only(path),
        dio_alignment: (g.dio_align > 0).then_some(g.dio_align),
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
        f.add("logical sector size", self.logical_sector_size.to_string());
        f.add(
            "physical sector size",
            self.physical_sector_size.to_string(),
        );
        f.add("minimum I/O size", self.minimum_io_size.to_string());
        f.add(
            "optimal I/O size",
            if self.optimal_io_size == 0 {
                "0 (none reported)".to_string()
            } else {
                self.optimal_io_size.to_string()
            },
        );
        f.add("rotational", yes_no(self.rotational));
        f.add("read-only", yes_no(self.read_only));
        f.add(
            "direct I/O alignment",
            self.dio_alignment
                .map(|a| a.to_string())
                .unwrap_or_else(|| "unknown".into()),
        );
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
    if rawdisk_nbd::uri::looks_like_nbd_uri(target) {
        return Err(Error::msg(format!(
            "'{target}': NBD URIs are not supported by info yet"
        )));
    }
    info_path(Path::new(target))
}
