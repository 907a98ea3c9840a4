//! NBD for rawdisk: a pure wire codec (`proto`: bytes in, values out, no I/O,
//! fuzzed), and the server and client built on it.

pub mod client;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod proto;
pub mod server;
mod sock;
pub mod tls;
pub mod uri;
