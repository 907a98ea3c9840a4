//! One error type for the image commands: a one-line context ("create
//! 'disk.img'") and the cause it came from (a storage error with its range and
//! errno, or an io::Error), printed as one line "context: cause".

use std::fmt;
use std::io;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug)]
pub struct Error {
    context: String,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    /// Printed after the cause ("removed the partial file").
    note: Option<String>,
}

impl Error {
    /// An error with no underlying cause (a refused request, a bad size).
    pub fn msg(context: impl Into<String>) -> Error {
        Error {
            context: context.into(),
            source: None,
            note: None,
        }
    }

    pub fn with(
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Error {
        Error {
            context: context.into(),
            source: Some(Box::new(source)),
            note: None,
        }
    }

    /// Adds a trailing remark ("; removed the partial file").
    pub fn note(mut self, note: impl Into<String>) -> Error {
        self.note = Some(note.into());
        self
    }

    /// The errno behind this error, if the chain of causes has one.
    pub fn errno(&self) -> Option<i32> {
        let mut cur: Option<&(dyn std::error::Error + 'static)> = self
            .source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static));
        while let Some(e) = cur {
            if let Some(se) = e.downcast_ref::<rawdisk_storage::Error>() {
                return se.errno();
            }
            if let Some(ie) = e.downcast_ref::<io::Error>() {
                if let Some(n) = ie.raw_os_error() {
                    return Some(n);
                }
            }
            cur = e.source();
        }
        None
    }

    pub fn context(&self) -> &str {
        &self.context
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The cause is printed here, and `source()` hides it: the storage
        // error already prints its own errno text, and anyhow's "{:#}" would
        // otherwise repeat it ("...: No space left: No space left").
        f.write_str(&self.context)?;
        if let Some(s) = &self.source {
            let s = s.to_string();
            // The object once: "cannot connect to 'U'" followed by a cause
            // that starts by quoting 'U' again drops the cause's copy.
            // The client's "NBD handshake with U: ..." likewise loses its U.
            let s = match self.context.rfind(" '") {
                Some(i) => {
                    let quoted = &self.context[i + 1..];
                    let bare = quoted.trim_matches('\'');
                    // "cannot connect to 'U'" + "cannot connect to U: why".
                    let verb = &self.context[..i];
                    let same = format!("{verb} {bare}: ");
                    // "cannot open 'P'" + "open P: why" (the storage error).
                    let last = verb.rsplit(' ').next().unwrap_or(verb);
                    let op = format!("{last} {bare}: ");
                    s.strip_prefix(&format!("{quoted}: "))
                        .or_else(|| s.strip_prefix(&same))
                        .or_else(|| s.strip_prefix(&op))
                        .unwrap_or(&s)
                        .replacen(&format!(" with {bare}: "), ": ", 1)
                }
                None => s,
            };
            write!(f, ": {s}")?;
        }
        if let Some(n) = &self.note {
            write!(f, "; {n}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}
