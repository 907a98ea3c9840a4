//! Byte streams as a side (`-`: standard input): read in order to the end,
//! their size what they held.

use std::io::{ErrorKind, Read};

use crate::endpoint;

/// Fills `buf` unless the stream ends first; returns the bytes read (fewer
/// than `buf.len()` only at the end).
pub fn read_full(input: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(r) => n += r,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// `op` on the stream `name` failed after `at` bytes.
pub fn error(name: &str, op: &str, at: u64, e: std::io::Error) -> endpoint::Error {
    endpoint::Error {
        endpoint: if name == "-" {
            "standard input".into()
        } else {
            name.into()
        },
        errno: e.raw_os_error(),
        message: format!("{op} at offset {at}: {e}"),
        nbd: None,
    }
}
