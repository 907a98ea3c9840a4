//! Helpers shared by the CLI tests: run the real binary, parse its JSON,
//! fingerprint files, run the reference tools (qemu-img, nbdinfo, nbdkit).
#![allow(dead_code)]

use std::hash::Hasher;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Output};

pub fn rawdisk() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rawdisk"));
    // The tests check stderr line by line: no inherited log filter.
    c.env_remove("RUST_LOG");
    c
}

pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

pub fn run_rawdisk<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Run {
    let out = rawdisk().args(args).output().expect("run rawdisk");
    to_run(out)
}

pub fn to_run(out: Output) -> Run {
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

impl Run {
    /// Succeeded; panics with both streams otherwise.
    pub fn ok(self) -> Run {
        assert_eq!(
            self.code, 0,
            "rawdisk failed: stdout={:?} stderr={:?}",
            self.stdout, self.stderr
        );
        self
    }

    /// Failed with `code` and exactly one line on stderr, starting "rawdisk: ".
    pub fn fails_one_line(self, code: i32) -> Run {
        assert_eq!(
            self.code, code,
            "exit code: stdout={:?} stderr={:?}",
            self.stdout, self.stderr
        );
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "stderr must be one line: {:?}", self.stderr);
        assert!(
            lines[0].starts_with("rawdisk: "),
            "stderr: {:?}",
            self.stderr
        );
        self
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.stdout))
    }
}

/// Runs a reference tool; panics when it fails.
pub fn tool(prog: &str, args: &[&str]) -> String {
    rawdisk_testkit::run(prog, args)
}

/// A hash of every byte of a file or device (not cryptographic: it catches
/// any change a buggy probe could make).
pub fn fingerprint(path: &Path) -> u64 {
    let mut f = std::fs::File::open(path).expect("open for fingerprint");
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).expect("read for fingerprint");
        if n == 0 {
            break;
        }
        h.write(&buf[..n]);
        total += n as u64;
    }
    h.write_u64(total);
    h.finish()
}

pub fn st_blocks(path: &Path) -> u64 {
    rawdisk_testkit::allocated_bytes(path) / 512
}

/// One map run: (start, length, zero, data, offset, present, depth).
pub type Run7 = (u64, u64, bool, bool, Option<u64>, bool, u64);

/// Parses `qemu-img map --output=json` (or ours) into comparable tuples.
pub fn map_tuples(json: &str) -> Vec<Run7> {
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("map JSON ({e}): {json}"));
    v.as_array()
        .expect("array")
        .iter()
        .map(|e| {
            (
                e["start"].as_u64().expect("start"),
                e["length"].as_u64().expect("length"),
                e["zero"].as_bool().expect("zero"),
                e["data"].as_bool().expect("data"),
                e["offset"].as_u64(),
                e["present"].as_bool().expect("present"),
                e["depth"].as_u64().expect("depth"),
            )
        })
        .collect()
}

/// Checks a map covers [0, size) contiguously.
pub fn assert_covers(map: &[Run7], size: u64) {
    let mut pos = 0;
    for e in map {
        assert_eq!(e.0, pos, "map not contiguous at {pos}: {map:?}");
        assert!(e.1 > 0, "empty run: {map:?}");
        pos += e.1;
    }
    assert_eq!(pos, size, "map does not end at the size: {map:?}");
}

/// A unique temporary directory on /tmp (ext4 here) for tests without root.
pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("rawdisk-cli-test-")
        .tempdir()
        .expect("tempdir")
}

/// nbdkit's file plugin exporting `path` read-only on a Unix socket, killed
/// on drop.
pub struct NbdkitExport {
    child: std::process::Child,
    _dir: tempfile::TempDir,
    pub uri: String,
}

impl Drop for NbdkitExport {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn nbdkit_export(path: &Path) -> NbdkitExport {
    let dir = tempdir();
    let sock = dir.path().join("nbd.sock");
    let child = Command::new("nbdkit")
        .args(["-f", "-r", "-U"])
        .arg(&sock)
        .arg("file")
        .arg(path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start nbdkit");
    for _ in 0..500 {
        if sock.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(sock.exists(), "nbdkit did not create its socket");
    NbdkitExport {
        child,
        uri: format!("nbd+unix:///?socket={}", sock.display()),
        _dir: dir,
    }
}
