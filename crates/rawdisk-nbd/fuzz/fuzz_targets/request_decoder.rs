//! Request headers and replies through the codec: see
//! `rawdisk_nbd::fuzzing::request_decoder`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rawdisk_nbd::fuzzing::request_decoder(data));
