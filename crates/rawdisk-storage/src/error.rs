use std::fmt;
use std::io;

/// A failed storage operation: what was attempted, on which range, and the errno.
#[derive(Debug)]
pub struct Error {
    pub op: &'static str,
    pub offset: u64,
    pub len: u64,
    pub source: io::Error,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(op: &'static str, offset: u64, len: u64, source: io::Error) -> Self {
        Error {
            op,
            offset,
            len,
            source,
        }
    }

    /// The errno, when the failure came from the kernel (or was injected as one).
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Whole-target operations (open, flush) carry no range.
        if self.offset == 0 && self.len == 0 {
            return write!(f, "{}: {}", self.op, self.source);
        }
        write!(
            f,
            "{} at offset {} length {}: {}",
            self.op, self.offset, self.len, self.source
        )
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}
