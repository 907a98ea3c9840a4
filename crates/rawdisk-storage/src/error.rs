use std::fmt;
use std::io;
use std::path::PathBuf;

/// A failed storage operation: what was attempted, on which range, and the errno.
#[derive(Debug)]
pub struct Error {
    pub op: &'static str,
    pub offset: u64,
    pub len: u64,
    pub source: io::Error,
    /// The file or device, where the operation has no range to name it by
    /// (open); None otherwise (callers know which target they used).
    pub path: Option<PathBuf>,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(op: &'static str, offset: u64, len: u64, source: io::Error) -> Self {
        Error {
            op,
            offset,
            len,
            source,
            path: None,
        }
    }

    /// Name the file or device in the message.
    pub fn with_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.path = Some(path.into());
        self
    }

    /// The errno, when the failure came from the kernel (or was injected as one).
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.op)?;
        if let Some(p) = &self.path {
            write!(f, " {}", p.display())?;
        }
        // Whole-target operations (open, flush) carry no range.
        if self.offset != 0 || self.len != 0 {
            write!(f, " at offset {} length {}", self.offset, self.len)?;
        }
        write!(f, ": {}", self.source)
    }
}

/// The errno is part of the message, so it is not also returned as the
/// source: a printer that walks the chain would say it twice.
/// [`Error::errno`] and the `source` field give it to code.
impl std::error::Error for Error {}
