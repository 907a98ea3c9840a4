//! One module per subcommand. Each defines its clap `Args` and a `run`.
pub mod checkpoint;
pub mod checksum;
pub mod compare;
pub mod copy;
pub mod create;
pub mod detached;
pub mod info;
pub mod map;
pub mod probe;
pub mod qemu_nbd;
pub mod resize;
pub mod serve;

use std::path::Path;

use rawdisk_storage::{CacheMode, Prealloc};

/// A command line clap accepts but the command cannot (two flags that say
/// the same thing differently): exit 2, as clap's own usage errors.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Commands that work on a local file or block device only refuse an NBD URI
/// by name, instead of failing to open a file called "nbd://...".
pub fn local_only(path: &Path, verb: &str) -> anyhow::Result<()> {
    if let Some(s) = path.to_str() {
        if rawdisk_nbd::uri::looks_like_nbd_uri(s) {
            anyhow::bail!(
                "cannot {verb} '{s}': NBD URIs are not accepted here ({verb} works on a local file or block device)"
            );
        }
    }
    Ok(())
}

/// A flag that acts on a block device only is refused, not ignored, on
/// anything else (`why` says what happens there without it): a bad command
/// line. A missing target counts as the file the command would create when
/// `creates`; otherwise it, like one that cannot be looked at, is left to
/// the command to open and report.
pub fn block_device_only(
    flag: &str,
    target: &Path,
    creates: bool,
    why: &str,
) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let block = match std::fs::metadata(target) {
        Ok(md) => md.file_type().is_block_device(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && creates => false,
        Err(_) => return Ok(()),
    };
    if block {
        return Ok(());
    }
    Err(UsageError(format!(
        "{flag} is for a block device, and '{}' is not one: {why}",
        target.display()
    ))
    .into())
}

/// `--preallocation`, shared by create, serve --create and copy.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PreallocArg {
    /// Sparse: set the size only.
    Off,
    /// fallocate(); writes zeros where the file system has no fallocate.
    Falloc,
    /// Write zeros over the whole image, then flush.
    Full,
}

impl From<PreallocArg> for Prealloc {
    fn from(p: PreallocArg) -> Prealloc {
        match p {
            PreallocArg::Off => Prealloc::Off,
            PreallocArg::Falloc => Prealloc::Falloc,
            PreallocArg::Full => Prealloc::Full,
        }
    }
}

/// `-o KEY=VALUE[,KEY=VALUE...]`, qemu-img's spelling of image options, next
/// to `--preallocation` (`flag`). Raw has one option, `preallocation`; any
/// other key, a bad value or two different answers is a usage error.
pub fn prealloc_option(
    flag: Option<PreallocArg>,
    options: &[String],
) -> Result<PreallocArg, UsageError> {
    use clap::ValueEnum;
    let mut chosen = flag;
    for kv in options.iter().flat_map(|o| o.split(',')) {
        let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
        if key != "preallocation" {
            return Err(UsageError(format!(
                "-o: unknown option '{key}' (a raw image has one: preallocation=off|falloc|full)"
            )));
        }
        let mode = PreallocArg::from_str(value, false).map_err(|_| {
            UsageError(format!(
                "-o: preallocation '{value}' is not one of off, falloc, full"
            ))
        })?;
        if chosen.is_some_and(|c| c != mode) {
            return Err(UsageError(
                "--preallocation and -o preallocation= ask for different modes".into(),
            ));
        }
        chosen = Some(mode);
    }
    Ok(chosen.unwrap_or(PreallocArg::Off))
}

/// `--cache`, shared by serve, create and copy (qemu-nbd's and qemu-img's
/// names for the two modes).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CacheArg {
    /// Through the page cache; flush is fdatasync.
    Writeback,
    /// O_DIRECT; unaligned requests are served by read-modify-write.
    None,
}

impl From<CacheArg> for CacheMode {
    fn from(c: CacheArg) -> CacheMode {
        match c {
            CacheArg::Writeback => CacheMode::Writeback,
            CacheArg::None => CacheMode::None,
        }
    }
}

/// `-f`/`--format`, for qemu-img habits: rawdisk reads and writes raw only,
/// so any other format is refused by clap with the one allowed value.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum FormatArg {
    Raw,
}

/// `-f raw`, shared by every command that reads an image. Without it an
/// image that looks like another format is refused (docs/formats.md): its
/// bytes are not the disk.
#[derive(clap::Args)]
pub struct FormatOpt {
    /// Image format: only raw. Given, an image that looks like another
    /// format (qcow2, vmdk, vhdx...) is read as raw anyway; without it such
    /// an image is refused.
    #[arg(short = 'f', long = "format", value_enum, value_name = "FORMAT")]
    format: Option<FormatArg>,
}

impl FormatOpt {
    /// The user said the image is raw.
    pub fn raw(&self) -> bool {
        self.format.is_some()
    }
}

/// `--output`, shared by the commands that print a report (qemu-img's `--output=json`).
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum OutputArg {
    Human,
    Json,
}
