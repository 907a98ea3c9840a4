//! `rawdisk resize` on the command line: absolute and relative sizes
//! (`-512M` is a size, not an option), JSON, errors in one line.

mod common;
use common::*;

use std::path::Path;
use std::process::Command;

const MIB: u64 = 1 << 20;

fn len(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

#[test]
fn relative_and_absolute_sizes() {
    let d = tempdir();
    let p = d.path().join("r.img");
    std::fs::File::create(&p).unwrap().set_len(MIB).unwrap();
    rawdisk_testkit::write_pattern(&p, 0, MIB, 4);
    let ps = p.to_str().unwrap();
    let r = run_rawdisk(&["resize", ps, "+2M"]).ok();
    assert!(
        r.stdout.starts_with(&format!(
            "Grew '{ps}' from 1048576 bytes (1 MiB) to 3145728 bytes (3 MiB)"
        )),
        "{}",
        r.stdout
    );
    assert_eq!(len(&p), 3 * MIB);
    run_rawdisk(&["resize", "--shrink", ps, "-512K"]).ok();
    assert_eq!(len(&p), 3 * MIB - 512 * 1024);
    // Without --shrink nothing changes and the message says why.
    let r = run_rawdisk(&["resize", ps, "-512K"]).fails_one_line(1);
    assert!(r.stderr.contains("--shrink"), "{}", r.stderr);
    assert_eq!(len(&p), 3 * MIB - 512 * 1024);
    let j = run_rawdisk(&[
        "resize",
        "--output",
        "json",
        "--preallocation",
        "full",
        ps,
        "4M",
    ])
    .ok()
    .json();
    assert_eq!(j["old-virtual-size"], 3 * MIB - 512 * 1024);
    assert_eq!(j["virtual-size"], 4 * MIB);
    assert_eq!(j["preallocation"], "full");
    assert_eq!(j["method"], "write-zeros");
    assert_eq!(j["bytes-written"], MIB + 512 * 1024);
    rawdisk_testkit::check_pattern(&p, 0, MIB, 4);
    rawdisk_testkit::check_zero(&p, MIB, 3 * MIB);
    let q = run_rawdisk(&["resize", "-q", ps, "+1M"]).ok();
    assert!(q.stdout.is_empty());
    assert_eq!(len(&p), 5 * MIB);
}

#[test]
fn bad_command_lines_exit_2_and_failures_1() {
    let d = tempdir();
    let p = d.path().join("b.img");
    std::fs::File::create(&p).unwrap().set_len(MIB).unwrap();
    let ps = p.to_str().unwrap();
    for args in [
        vec!["resize", ps],
        vec!["resize", ps, "+"],
        vec!["resize", ps, "10Q"],
        vec!["resize", ps, "--5M"],
        vec!["resize", "--preallocation", "metadata", ps, "2M"],
        vec!["resize", ps, "2M", "3M"],
    ] {
        run_rawdisk(&args).fails_one_line(2);
        assert_eq!(len(&p), MIB, "{args:?} changed the file");
    }
    let r = run_rawdisk(&["resize", "--shrink", "--preallocation", "falloc", ps, "-1K"])
        .fails_one_line(1);
    assert!(r.stderr.contains("preallocation=off"), "{}", r.stderr);
    let r = run_rawdisk(&["resize", "--shrink", ps, "-2M"]).fails_one_line(1);
    assert!(r.stderr.contains("only 1048576 bytes"), "{}", r.stderr);
    let missing = d.path().join("missing.img");
    let r = run_rawdisk(&["resize", missing.to_str().unwrap(), "1M"]).fails_one_line(1);
    assert!(r.stderr.contains("No such file"), "{}", r.stderr);
    assert!(!missing.exists());
    let r = run_rawdisk(&["resize", d.path().to_str().unwrap(), "1M"]).fails_one_line(1);
    assert!(r.stderr.contains("not a regular file"), "{}", r.stderr);
    let h = run_rawdisk(&["resize", "--help"]).ok();
    assert!(h.stdout.contains("Examples:"), "{}", h.stdout);
}

#[test]
#[ignore = "needs root"]
fn block_devices_only_keep_their_size() {
    let dev = rawdisk_testkit::LoopDev::new(8 * MIB, 512);
    let ds = dev.path().to_str().unwrap();
    let r = run_rawdisk(&["resize", ds, "8M"]).ok();
    assert!(r.stdout.contains("unchanged"), "{}", r.stdout);
    run_rawdisk(&["resize", ds, "+0"]).ok();
    let r = run_rawdisk(&["resize", ds, "+1M"]).fails_one_line(1);
    assert!(
        r.stderr.contains("block device of 8388608 bytes"),
        "{}",
        r.stderr
    );
    let r = run_rawdisk(&["resize", "--shrink", ds, "4M"]).fails_one_line(1);
    assert!(
        r.stderr.contains("block device of 8388608 bytes"),
        "{}",
        r.stderr
    );
}

#[test]
#[ignore = "needs root"]
fn interrupted_grow_restores_the_old_size() {
    use std::os::unix::fs::MetadataExt;
    let fs = rawdisk_testkit::Fs::tmpfs(3 << 30);
    let img = fs.path("big.img");
    std::fs::File::create(&img).unwrap().set_len(MIB).unwrap();
    rawdisk_testkit::write_pattern(&img, 0, MIB, 6);
    let child = rawdisk()
        .args([
            "resize",
            "--preallocation",
            "full",
            img.to_str().unwrap(),
            "+2G",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Signal once it is writing the tail.
    let t0 = std::time::Instant::now();
    while std::fs::metadata(&img).unwrap().blocks() < 8192 {
        assert!(t0.elapsed().as_secs() < 20, "resize never started writing");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let st = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let r = to_run(child.wait_with_output().unwrap()).fails_one_line(1);
    assert!(r.stderr.contains("interrupted"), "{}", r.stderr);
    assert!(r.stderr.contains("restored the old size"), "{}", r.stderr);
    assert_eq!(len(&img), MIB);
    rawdisk_testkit::check_pattern(&img, 0, MIB, 6);
}
