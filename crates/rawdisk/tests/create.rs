//! `rawdisk create` through the real binary.

mod common;
use common::*;

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use rawdisk_testkit::{check_zero, is_root, write_pattern, Fs, FsKind, LoopDev, MIB};

fn assert_zero_image(path: &Path, size: u64) {
    assert_eq!(
        std::fs::metadata(path).unwrap().len(),
        size,
        "{}",
        path.display()
    );
    check_zero(path, 0, size);
}

#[test]
fn existing_file_needs_force() {
    let d = tempdir();
    let img = d.path().join("a.img");
    std::fs::write(&img, b"precious data").unwrap();
    let r = run_rawdisk(&["create", img.to_str().unwrap(), "1M"]).fails_one_line(1);
    assert!(
        r.stderr.contains("already exists") && r.stderr.contains("--force"),
        "{}",
        r.stderr
    );
    assert_eq!(std::fs::read(&img).unwrap(), b"precious data");

    let r = run_rawdisk(&["create", "--force", img.to_str().unwrap(), "3M"]).ok();
    assert!(r.stdout.starts_with("Replaced "), "{}", r.stdout);
    assert_zero_image(&img, 3 * MIB);
}

#[test]
fn sizes_are_exact_and_images_read_zero() {
    let d = tempdir();
    for (arg, size) in [
        ("0", 0u64),
        ("12345", 12345),
        ("64K", 65536),
        ("1.5M", 3 * MIB / 2),
    ] {
        for mode in ["off", "falloc", "full"] {
            let img = d.path().join(format!("s-{arg}-{mode}.img"));
            let r = run_rawdisk(&[
                "create",
                "--preallocation",
                mode,
                img.to_str().unwrap(),
                arg,
            ])
            .ok();
            assert_eq!(r.stdout.lines().count(), 1, "{}", r.stdout);
            assert!(
                r.stdout.contains(&format!("preallocation={mode}")),
                "{}",
                r.stdout
            );
            assert!(
                r.stderr.is_empty(),
                "stderr not a terminal: no progress: {:?}",
                r.stderr
            );
            assert_zero_image(&img, size);
        }
    }
    // -q prints nothing.
    let img = d.path().join("quiet.img");
    let r = run_rawdisk(&["create", "-q", img.to_str().unwrap(), "1M"]).ok();
    assert!(r.stdout.is_empty() && r.stderr.is_empty());
}

/// off is sparse; falloc and full are allocated; the line says the method.
fn check_modes_on(dir: &Path, fs: FsKind) {
    let size = 32 * MIB;
    for mode in ["off", "falloc", "full"] {
        let img = dir.join(format!("m-{mode}.img"));
        let r = run_rawdisk(&[
            "create",
            "--preallocation",
            mode,
            img.to_str().unwrap(),
            "32M",
        ])
        .ok();
        let alloc = std::fs::metadata(&img).unwrap().blocks() * 512;
        match (mode, fs) {
            ("off", FsKind::Ramfs) => {} // ramfs reports pages written (the first block)
            ("off", _) => assert!(alloc <= 64 * 1024, "{fs} off: {alloc} bytes allocated"),
            _ => assert!(alloc >= size, "{fs} {mode}: only {alloc} bytes allocated"),
        }
        match (mode, fs) {
            ("falloc", FsKind::Ramfs | FsKind::Nfs3) => assert!(
                r.stdout
                    .contains("fallocate not supported here, wrote 32 MiB of zeros"),
                "{}",
                r.stdout
            ),
            ("falloc", _) => assert!(r.stdout.contains("by fallocate"), "{}", r.stdout),
            ("full", _) => assert!(r.stdout.contains("wrote 32 MiB of zeros"), "{}", r.stdout),
            _ => assert!(r.stdout.contains("(sparse)"), "{}", r.stdout),
        }
        assert_zero_image(&img, size);
        std::fs::remove_file(&img).unwrap();
    }
    // O_DIRECT where the file system has it.
    if fs != FsKind::Ramfs {
        let img = dir.join("direct.img");
        run_rawdisk(&[
            "create",
            "--preallocation",
            "full",
            "--cache",
            "none",
            img.to_str().unwrap(),
            "5000000",
        ])
        .ok();
        assert_zero_image(&img, 5_000_000);
        std::fs::remove_file(&img).unwrap();
    } else {
        let img = dir.join("direct.img");
        run_rawdisk(&["create", "--cache", "none", img.to_str().unwrap(), "1M"]).fails_one_line(1);
        assert!(!img.exists(), "failed create left the file");
    }
}

#[test]
#[ignore = "needs root"]
fn modes_on_every_file_system() {
    for kind in FsKind::usable() {
        let fs = Fs::new(kind, 256 * MIB);
        check_modes_on(fs.dir(), kind);
    }
}

#[test]
#[ignore = "needs root"]
fn no_space_leaves_no_file() {
    let fs = Fs::tmpfs(16 * MIB);
    for mode in ["falloc", "full"] {
        let img = fs.path(&format!("big-{mode}.img"));
        let r = run_rawdisk(&[
            "create",
            "--preallocation",
            mode,
            img.to_str().unwrap(),
            "64M",
        ])
        .fails_one_line(1);
        assert!(
            r.stderr.contains("No space left on device"),
            "{mode}: {}",
            r.stderr
        );
        assert!(r.stderr.contains("removed"), "{mode}: {}", r.stderr);
        assert!(!img.exists(), "{mode}: the partial file was left behind");
    }
    // Asked to keep it: it stays.
    let img = fs.path("kept.img");
    let r = run_rawdisk(&[
        "create",
        "--preallocation",
        "full",
        "--keep-on-error",
        img.to_str().unwrap(),
        "64M",
    ])
    .fails_one_line(1);
    assert!(r.stderr.contains("kept"), "{}", r.stderr);
    assert!(img.exists());
    std::fs::remove_file(&img).unwrap();
    // The file system is whole again: a fitting image works.
    let img = fs.path("fits.img");
    run_rawdisk(&[
        "create",
        "--preallocation",
        "full",
        img.to_str().unwrap(),
        "8M",
    ])
    .ok();
    assert_zero_image(&img, 8 * MIB);
}

#[test]
#[ignore = "needs root"]
fn unwritable_directory_is_one_line() {
    assert!(is_root());
    let d = tempdir();
    let img = d.path().join("a.img");
    // Root ignores permissions: run as nobody, in a directory nobody cannot
    // write to (0755, owned by root).
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_rawdisk"))
        .args([
            "create",
            "--preallocation",
            "full",
            img.to_str().unwrap(),
            "1M",
        ])
        .env_remove("RUST_LOG")
        .output()
        .expect("setpriv");
    let r = to_run(out).fails_one_line(1);
    assert!(r.stderr.contains("Permission denied"), "{}", r.stderr);
    assert!(!img.exists());
}

#[test]
#[ignore = "needs root"]
fn block_devices_fit_and_zero() {
    for sector in [512u32, 4096] {
        let dev = LoopDev::new(64 * MIB, sector);
        let p = dev.path().to_str().unwrap().to_string();
        // Fits: nothing written.
        write_pattern(dev.path(), 0, 64 * MIB, 7);
        let r = run_rawdisk(&["create", &p, "32M"]).ok();
        assert!(r.stdout.contains("nothing written"), "{}", r.stdout);
        rawdisk_testkit::check_pattern(dev.path(), 0, 64 * MIB, 7);
        // Too big.
        let r = run_rawdisk(&["create", &p, "65M"]).fails_one_line(1);
        assert!(r.stderr.contains("do not fit"), "{}", r.stderr);
        // --zero: the whole device reads zero.
        let r = run_rawdisk(&["create", "--zero", &p, "64M"]).ok();
        assert!(r.stdout.contains("zeroed all 64 MiB by"), "{}", r.stdout);
        check_zero(dev.path(), 0, 64 * MIB);
    }
}

#[test]
#[ignore = "needs root"]
fn interrupted_create_removes_the_file() {
    let fs = Fs::tmpfs(3 << 30);
    for signal in ["TERM", "INT"] {
        let img = fs.path("big.img");
        let child = rawdisk()
            .args([
                "create",
                "--preallocation",
                "full",
                img.to_str().unwrap(),
                "2G",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Signal once it is writing.
        let t0 = std::time::Instant::now();
        while std::fs::metadata(&img).map(|m| m.blocks()).unwrap_or(0) < 2048 {
            assert!(t0.elapsed().as_secs() < 20, "create never started writing");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let st = std::process::Command::new("kill")
            .args([format!("-{signal}"), child.id().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
        let out = child.wait_with_output().unwrap();
        let r = to_run(out).fails_one_line(1);
        assert!(r.stderr.contains("interrupted"), "{signal}: {}", r.stderr);
        assert!(!img.exists(), "{signal}: interrupted create left the file");
    }
}
