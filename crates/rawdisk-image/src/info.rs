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
use crate::output::{human_size, table, Fields};
use crate::sysinfo::{self, MountInfo};

#[derive(Debug, Clone, Serialize)]
pub struct Info {
    pub filename: String,
    /// Always "raw": rawdisk reads no image format.
    pub format: &'static str,
    /// The image format the first and last bytes show (qcow2, vmdk...),
    /// when they show one: rawdisk reads it as raw only when told.
    #[serde(rename = "looks-like", skip_serializing_if = "Option::is_none")]
    pub looks_like: Option<&'static str>,
    #[serde(rename = "virtual-size")]
    pub virtual_size: u64,
    /// Bytes allocated (st_blocks × 512); absent where it cannot be known.
    #[serde(rename = "actual-size", skip_serializing_if = "Option::is_none")]
    pub actual_size: Option<u64>,
    /// Always false, as qemu-img prints it for raw: no format to mark dirty.
    #[serde(rename = "dirty-flag")]
    pub dirty_flag: bool,
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
    /// For an NBD URI: what the handshake told; its JSON is nbdinfo's
    /// instead of this one's (`to_json`).
    #[serde(skip)]
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
    let looks_like = rawdisk_storage::format::probe_target(&t)
        .map_err(|e| Error::with(format!("cannot read '{}'", path.display()), e))?
        .map(|f| f.name());
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
        looks_like,
        virtual_size: t.size(),
        actual_size: actual,
        dirty_flag: false,
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
    /// qemu-img's keys for a file or block device, `nbdinfo --json`'s for
    /// an NBD export, so scripts written for either keep working.
    pub fn to_json(&self) -> String {
        let text = match &self.nbd {
            Some(n) => serde_json::to_string_pretty(&NbdInfoJson {
                protocol: n.protocol,
                tls: n.tls,
                structured: Some(n.structured_replies),
                extended_headers: Some(n.extended_headers),
                exports: vec![NbdExportJson {
                    export_name: n.export_name.clone(),
                    description: n.description.clone(),
                    uri: self.filename.clone(),
                    contexts: Some(n.contexts.clone()),
                    is_rotational: Some(self.rotational),
                    is_read_only: Some(self.read_only),
                    can_cache: Some(n.can_cache),
                    can_df: Some(n.can_df),
                    can_fast_zero: Some(n.can_fast_zero),
                    can_flush: Some(n.can_flush),
                    can_fua: Some(n.can_fua),
                    can_multi_conn: Some(n.can_multi_conn),
                    can_trim: Some(n.can_trim),
                    can_zero: Some(n.can_zero),
                    block_size_minimum: n.block_size_minimum,
                    block_size_preferred: n.block_size_preferred,
                    block_size_maximum: n.block_size_maximum,
                    export_size: Some(self.virtual_size),
                    looks_like: self.looks_like,
                }],
            }),
            None => serde_json::to_string_pretty(self),
        };
        text.unwrap_or_default() + "\n"
    }

    /// qemu-img's first four lines, then the rest aligned.
    pub fn to_human(&self) -> String {
        let looks = self
            .looks_like
            .map(|f| format!("looks-like: {f}\n"))
            .unwrap_or_default();
        let mut s = format!(
            "image: {}\nfile format: {}\n{looks}virtual size: {} ({} bytes)\ndisk size: {}\n",
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
        f.add("rotational", yes_no(self.rotational));
        f.add("read-only", yes_no(self.read_only));
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

/// The properties `--can` and `--is` test, as nbdinfo 1.14 names them
/// (it takes each name after either), plus block-status and
/// extended-headers, which rawdisk's handshake reports too.
pub const FLAGS: &[&str] = &[
    "block-status",
    "cache",
    "connect",
    "df",
    "extended-headers",
    "fast-zero",
    "flush",
    "fua",
    "multi-conn",
    "read",
    "read-only",
    "readonly",
    "rotational",
    "structured-reply",
    "tls",
    "trim",
    "write",
    "zero",
];

impl Info {
    /// `--can FLAG` (`is` false) or `--is FLAG`: whether the property
    /// holds. An unknown name, or one only an NBD export has asked of a
    /// local target, is an error.
    pub fn test_flag(&self, is: bool, flag: &str) -> Result<bool> {
        let opt = if is { "--is" } else { "--can" };
        if !FLAGS.contains(&flag) {
            return Err(Error::msg(format!(
                "unknown {opt} flag '{flag}' (one of: {})",
                FLAGS.join(", ")
            )));
        }
        let local = match flag {
            "read-only" | "readonly" => Some(self.read_only),
            "rotational" => Some(self.rotational),
            "write" => Some(!self.read_only),
            "connect" | "read" => Some(true),
            _ => None,
        };
        let Some(n) = &self.nbd else {
            return match flag {
                "tls" => Ok(false),
                _ => local.ok_or_else(|| {
                    Error::msg(format!(
                        "{opt} {flag} needs an NBD URI; '{}' is a local target",
                        self.filename
                    ))
                }),
            };
        };
        Ok(match flag {
            "tls" => n.tls,
            "block-status" => n.contexts.iter().any(|c| c == "base:allocation"),
            "cache" => n.can_cache,
            "df" => n.can_df,
            "extended-headers" => n.extended_headers,
            "fast-zero" => n.can_fast_zero,
            "flush" => n.can_flush,
            "fua" => n.can_fua,
            "multi-conn" => n.can_multi_conn,
            "structured-reply" => n.structured_replies,
            "trim" => n.can_trim,
            "zero" => n.can_zero,
            _ => local.unwrap_or(false),
        })
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

/// `info --output json` on an NBD URI and `info --list`: `nbdinfo --json`'s
/// document, key for key (docs/json.md).
#[derive(Debug, Clone, Serialize)]
pub struct NbdInfoJson {
    pub protocol: &'static str,
    #[serde(rename = "TLS")]
    pub tls: bool,
    /// Absent from a listing, which negotiates nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub structured: Option<bool>,
    /// Not in nbdinfo's document: whether extended headers were negotiated.
    #[serde(rename = "extended-headers", skip_serializing_if = "Option::is_none")]
    pub extended_headers: Option<bool>,
    pub exports: Vec<NbdExportJson>,
}

/// One export in nbdinfo's words; what a listing could not learn is absent.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NbdExportJson {
    #[serde(rename = "export-name")]
    pub export_name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub uri: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contexts: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub is_rotational: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub is_read_only: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub can_cache: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub can_df: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub can_fast_zero: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub can_flush: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub can_fua: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub can_multi_conn: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub can_trim: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub can_zero: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size_minimum: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size_preferred: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size_maximum: Option<u32>,
    #[serde(rename = "export-size", skip_serializing_if = "Option::is_none")]
    pub export_size: Option<u64>,
    /// Not in nbdinfo's document: the image format the export's bytes show.
    #[serde(rename = "looks-like", skip_serializing_if = "Option::is_none")]
    pub looks_like: Option<&'static str>,
}

/// An NBD export as the handshake described it (the human form's fields).
#[derive(Debug, Clone)]
pub struct NbdExport {
    pub export_name: String,
    pub description: Option<String>,
    pub protocol: &'static str,
    /// Whether the connection used TLS.
    pub tls: bool,
    pub structured_replies: bool,
    pub extended_headers: bool,
    pub contexts: Vec<String>,
    pub can_cache: bool,
    pub can_df: bool,
    pub can_fast_zero: bool,
    pub can_flush: bool,
    pub can_fua: bool,
    pub can_multi_conn: bool,
    pub can_trim: bool,
    pub can_zero: bool,
    /// Only when the server sent NBD_INFO_BLOCK_SIZE (as nbdinfo).
    pub block_size_minimum: Option<u32>,
    pub block_size_preferred: Option<u32>,
    pub block_size_maximum: Option<u32>,
}

impl NbdExport {
    fn add_human(&self, f: &mut Fields) {
        f.add("export name", format!("{:?}", self.export_name));
        if let Some(d) = &self.description {
            f.add("description", d.clone());
        }
        // nbdinfo's words.
        let mut proto = format!(
            "{} {} TLS",
            self.protocol,
            if self.tls { "with" } else { "without" }
        );
        if self.structured_replies {
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
            ("can cache", self.can_cache),
            ("can df", self.can_df),
            ("can fast zero", self.can_fast_zero),
            ("can flush", self.can_flush),
            ("can fua", self.can_fua),
            ("can multi-conn", self.can_multi_conn),
            ("can trim", self.can_trim),
            ("can zero", self.can_zero),
        ] {
            f.add(k, yes_no(v));
        }
        match (
            self.block_size_minimum,
            self.block_size_preferred,
            self.block_size_maximum,
        ) {
            (Some(a), Some(b), Some(c)) => {
                f.add("block size minimum", a.to_string());
                f.add("block size preferred", b.to_string());
                f.add("block size maximum", c.to_string());
            }
            _ => {
                f.add("block sizes", "not advertised");
            }
        }
    }
}

/// Info about an NBD export: size and what the handshake negotiated, and
/// what its first and last bytes look like (the only reads; nothing is
/// written).
pub fn info_nbd(uri: &str) -> Result<Info> {
    let opts = crate::endpoint::EndpointOptions {
        raw: true,
        ..Default::default()
    };
    let ep = crate::endpoint::Endpoint::open_with(uri, &opts)
        .map_err(|e| Error::with(format!("cannot connect to '{uri}'"), e))?;
    let looks_like = ep
        .looks_like()
        .map_err(|e| Error::with(format!("cannot read '{uri}'"), e))?
        .map(|f| f.name());
    let i = ep
        .nbd_info()
        .ok_or_else(|| Error::msg(format!("'{uri}' is not an NBD export")))?
        .clone();
    let size = ep.size();
    // The client uses TLS exactly when the URI asks for it (nbds://), and
    // then fails rather than go on without.
    let tls = matches!(&ep, crate::endpoint::Endpoint::Nbd { uri, .. } if uri.tls.is_some());
    let _ = ep.close();
    let adv = i.block_size_advertised;
    let n = NbdExport {
        export_name: i.name.clone(),
        description: i.description.clone(),
        protocol: "newstyle-fixed",
        tls,
        structured_replies: i.structured_replies,
        extended_headers: i.extended_headers,
        contexts: i.meta_context.iter().cloned().collect(),
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
    };
    Ok(Info {
        filename: uri.to_string(),
        format: "raw",
        looks_like,
        virtual_size: size,
        actual_size: None,
        dirty_flag: false,
        kind: "nbd",
        logical_sector_size: None,
        physical_sector_size: None,
        minimum_io_size: None,
        optimal_io_size: None,
        rotational: i.rotational(),
        read_only: i.read_only(),
        nbd: Some(n),
        dio_alignment: None,
        filesystem: None,
        loop_backing_file: None,
    })
}

/// The exports an NBD server offers (`rawdisk info --list`), as NBD_OPT_LIST
/// names them and NBD_OPT_INFO sizes them.
#[derive(Debug, Clone)]
pub struct ExportList {
    pub server: String,
    pub tls: bool,
    pub exports: Vec<ListedExport>,
}

/// One listed export.
#[derive(Debug, Clone)]
pub struct ListedExport {
    pub export_name: String,
    /// The URI that connects to this export.
    pub uri: String,
    pub description: Option<String>,
    /// Absent when the server would not describe the export.
    pub virtual_size: Option<u64>,
    pub read_only: Option<bool>,
}

/// Asks the server `uri` names which exports it offers; the URI's export
/// name is not used.
pub fn list_nbd(uri: &str) -> Result<ExportList> {
    use rawdisk_nbd::client;
    if !crate::endpoint::is_nbd(uri) {
        return Err(Error::msg(format!(
            "cannot list exports of '{uri}': not an NBD URI (--list asks an NBD server, e.g. nbd://host or nbd+unix:///?socket=PATH)"
        )));
    }
    use rawdisk_nbd::uri::NbdUri;
    let parsed = NbdUri::parse(uri)
        .map_err(|e| Error::msg(format!("cannot list exports of '{uri}': {e}")))?;
    let timeout = std::time::Duration::from_secs(30);
    let listed = crate::endpoint::runtime()
        .block_on(client::list_exports(&parsed, timeout))
        .map_err(|e| match e {
            client::Error::Connect { message, .. } => {
                Error::msg(format!("cannot connect to '{uri}': {message}"))
            }
            client::Error::Handshake { cause, .. } => {
                Error::msg(format!("cannot list exports of '{uri}': {cause}"))
            }
            e => Error::msg(format!("cannot list exports of '{uri}': {e}")),
        })?;
    Ok(ExportList {
        server: uri.to_string(),
        tls: parsed.tls.is_some(),
        exports: listed
            .into_iter()
            .map(|e| ListedExport {
                uri: NbdUri {
                    export: e.name.clone(),
                    ..parsed.clone()
                }
                .to_string(),
                export_name: e.name,
                description: e.description,
                virtual_size: e.info.as_ref().map(|i| i.size),
                read_only: e.info.as_ref().map(|i| i.read_only()),
            })
            .collect(),
    })
}

impl ExportList {
    /// `nbdinfo --json --list`'s document, with what the listing learned.
    pub fn to_json(&self) -> String {
        let doc = NbdInfoJson {
            protocol: "newstyle-fixed",
            tls: self.tls,
            structured: None,
            extended_headers: None,
            exports: self
                .exports
                .iter()
                .map(|e| NbdExportJson {
                    export_name: e.export_name.clone(),
                    description: e.description.clone(),
                    uri: e.uri.clone(),
                    is_read_only: e.read_only,
                    export_size: e.virtual_size,
                    ..NbdExportJson::default()
                })
                .collect(),
        };
        serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n"
    }

    /// One row per export: name, size, access, description.
    pub fn to_human(&self) -> String {
        let n = self.exports.len();
        let mut s = format!("server: {}\nexports: {n}\n", self.server);
        if n == 0 {
            return s;
        }
        s.push('\n');
        let rows: Vec<Vec<String>> = self
            .exports
            .iter()
            .map(|e| {
                vec![
                    format!("{:?}", e.export_name),
                    e.virtual_size
                        .map(|v| format!("{v} ({})", human_size(v)))
                        .unwrap_or_else(|| "unknown".into()),
                    match e.read_only {
                        Some(true) => "read-only",
                        Some(false) => "read-write",
                        None => "unknown",
                    }
                    .to_string(),
                    e.description.clone().unwrap_or_default(),
                ]
            })
            .collect();
        s.push_str(&table(&["export", "size", "access", "description"], &rows));
        s
    }
}
