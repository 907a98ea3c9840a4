//! Replays the committed corpus of every fuzz target (`fuzz/corpus/<target>`)
//! through the same function the fuzzer calls, so the assertions the fuzzer
//! makes run on every `cargo test`, on stable Rust.

use std::path::Path;

use rawdisk_nbd::fuzzing;

/// Runs `target` on every file of its corpus; fails on an empty corpus so a
/// moved directory cannot pass silently.
fn replay(target: &str, run: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let entries =
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    let mut files: Vec<_> = entries
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no corpus in {}", dir.display());
    for path in files {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        eprintln!("{target}: {}", path.display());
        run(&data);
    }
}

#[test]
fn option_decoder_corpus() {
    replay("option_decoder", fuzzing::option_decoder);
}

#[test]
fn request_decoder_corpus() {
    replay("request_decoder", fuzzing::request_decoder);
}

#[test]
fn server_corpus() {
    replay("server", fuzzing::server);
}
