//! Option requests and replies through the codec: see
//! `rawdisk_nbd::fuzzing::option_decoder`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rawdisk_nbd::fuzzing::option_decoder(data));
