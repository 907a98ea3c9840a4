//! The whole server over an in-memory stream: see
//! `rawdisk_nbd::fuzzing::server`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rawdisk_nbd::fuzzing::server(data));
