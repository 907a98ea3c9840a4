//! The image commands' logic (the binary only parses arguments and prints).

pub mod copy;
pub mod endpoint;
