//! [`CbtError`]: one line naming the operation, the state file and the cause.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// A failed changed-block-tracking operation.
///
/// Display: one line with the operation, the object (the state file, or the
/// target where the state file is not known yet) and the cause, with a hint
/// where there is an obvious fix. [`CbtError::errno`] gives the errno of an
/// I/O cause to code.
#[derive(Debug)]
pub struct CbtError {
    op: &'static str,
    path: PathBuf,
    cause: Cause,
}

#[derive(Debug)]
enum Cause {
    Io(io::Error),
    Msg(String),
}

impl CbtError {
    /// An I/O failure of `op` on `path`.
    pub(crate) fn io(op: &'static str, path: &Path, e: io::Error) -> Self {
        CbtError {
            op,
            path: path.to_path_buf(),
            cause: Cause::Io(e),
        }
    }

    /// A refusal or a bad argument: `msg` is the cause (and hint).
    pub(crate) fn msg(op: &'static str, path: &Path, msg: impl Into<String>) -> Self {
        CbtError {
            op,
            path: path.to_path_buf(),
            cause: Cause::Msg(msg.into()),
        }
    }

    /// The errno, when the cause is an I/O error (or an injected one).
    pub fn errno(&self) -> Option<i32> {
        match &self.cause {
            Cause::Io(e) => e.raw_os_error(),
            Cause::Msg(_) => None,
        }
    }

    /// The operation that failed ("persist changed-block state", ...).
    pub fn op(&self) -> &str {
        self.op
    }

    /// The state file (or target) the operation was on.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl fmt::Display for CbtError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: ", self.op, self.path.display())?;
        match &self.cause {
            Cause::Io(e) => write!(f, "{e}"),
            Cause::Msg(m) => f.write_str(m),
        }
    }
}

/// The cause is part of the message (see [`crate::Error`] for why it is not
/// also the source).
impl std::error::Error for CbtError {}
