//! `rawdisk map [--output human|json] [-f raw] [--start-offset OFFSET]
//! [--max-length LENGTH] TARGET|NBD-URI`

use std::io::{self, Write};
use std::process::ExitCode;

use rawdisk_image::map::{self, MapFormat, MapRange};

use super::{FormatOpt, OutputArg};
use crate::size::size_arg;

/// Print the allocation map of a target or NBD export, as `qemu-img map`
/// does.
///
/// JSON: the keys and merging of `qemu-img map --output=json`. Human: the
/// data runs in qemu-img's table.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    rawdisk map disk.img\n  \
    rawdisk map --output json --start-offset 1G --max-length 64M disk.img\n  \
    rawdisk map nbd+unix:///?socket=/tmp/disk.sock")]
pub struct Args {
    #[arg(long, value_enum, default_value = "human")]
    output: OutputArg,
    #[command(flatten)]
    format: FormatOpt,
    /// Map from this byte offset on (qemu-img suffixes).
    #[arg(long, value_name = "OFFSET", allow_hyphen_values = true, value_parser = size_arg)]
    start_offset: Option<u64>,
    /// Map at most this many bytes (qemu-img suffixes).
    #[arg(long, value_name = "LENGTH", allow_hyphen_values = true, value_parser = size_arg)]
    max_length: Option<u64>,
    /// File, block device, or NBD URI (nbd://host/export, nbd+unix:///export?socket=PATH).
    target: String,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let range = (args.start_offset.is_some() || args.max_length.is_some()).then(|| MapRange {
        start: args.start_offset.unwrap_or(0),
        max_length: args.max_length,
    });
    let format = match args.output {
        OutputArg::Human => MapFormat::Human,
        OutputArg::Json => MapFormat::Json,
    };
    let mut out = PipeOut {
        inner: io::BufWriter::with_capacity(64 << 10, io::stdout().lock()),
        closed: false,
    };
    match map::write_map(&args.target, args.format.raw(), range, format, &mut out) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        // A reader that stopped reading (`| head`) wanted no more: end
        // quietly with success, as qemu-img map does.
        Err(_) if out.closed => Ok(ExitCode::SUCCESS),
        Err(e) => Err(e.into()),
    }
}

/// Standard output that remembers whether the reader closed the pipe, so
/// that case alone is told apart from every other error.
struct PipeOut<W: Write> {
    inner: W,
    closed: bool,
}

impl<W: Write> PipeOut<W> {
    fn note(&mut self, e: io::Error) -> io::Error {
        if e.kind() == io::ErrorKind::BrokenPipe {
            self.closed = true;
        }
        e
    }
}

impl<W: Write> Write for PipeOut<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf).map_err(|e| self.note(e))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush().map_err(|e| self.note(e))
    }
}
