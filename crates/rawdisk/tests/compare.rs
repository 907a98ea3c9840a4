//! `rawdisk compare` against `qemu-img compare` on the same inputs: the same
//! words on stdout and the same exit status, for files, NBD exports and
//! block devices.

mod common;
use common::*;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// A sparse image: pattern data at a few places, holes elsewhere.
fn image(dir: &Path, name: &str, size: u64, runs: &[(u64, u64)], seed: u64) -> PathBuf {
    let p = dir.join(name);
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(size).unwrap();
    for &(off, len) in runs {
        f.write_all_at(&rawdisk_testkit::pattern_vec(seed, off, len as usize), off)
            .unwrap();
    }
    p
}

fn poke(p: &Path, off: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    f.write_all_at(bytes, off).unwrap();
}

/// (exit status, stdout) of `qemu-img compare -f raw -F raw [extra] a b`.
fn qemu(a: &str, b: &str, extra: &[&str]) -> (i32, String) {
    let out = Command::new("qemu-img")
        .arg("compare")
        .args(["-f", "raw", "-F", "raw"])
        .args(extra)
        .args([a, b])
        .output()
        .expect("qemu-img");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn ours(a: &str, b: &str, extra: &[&str]) -> (i32, String) {
    let mut args = vec!["compare"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&[a, b]);
    let r = run_rawdisk(&args);
    assert!(r.stderr.is_empty(), "stderr: {}", r.stderr);
    (r.code, r.stdout)
}

/// Both directions give what qemu-img gives; returns ours. `strict_too`:
/// also with -s, which qemu-img fails on any difference of allocation (not
/// compared here), so only for images allocated alike.
fn same_as_qemu(a: &Path, b: &Path, strict_too: bool) -> (i32, String) {
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let modes: &[&[&str]] = if strict_too { &[&[], &["-s"]] } else { &[&[]] };
    for (x, y) in [(a, b), (b, a)] {
        for &extra in modes {
            assert_eq!(
                ours(x, y, extra),
                qemu(x, y, extra),
                "compare {extra:?} {x} {y}"
            );
        }
    }
    ours(a, b, &[])
}

/// Only the exit status is qemu-img's (its words differ where a size is
/// not a multiple of 512); returns ours.
fn same_status_as_qemu(a: &Path, b: &Path) -> (i32, String) {
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    for (x, y) in [(a, b), (b, a)] {
        assert_eq!(ours(x, y, &[]).0, qemu(x, y, &[]).0, "compare {x} {y}");
    }
    ours(a, b, &[])
}

#[test]
fn identical_and_different_files_match_qemu_img() {
    let d = tempdir();
    let dir = d.path();
    let runs = [(0, 8 * KIB), (MIB + 100, 300 * KIB), (5 * MIB, 2 * MIB + 3)];
    let size = 9 * MIB + 1000;
    let a = image(dir, "a.img", size, &runs, 1);
    let b = image(dir, "b.img", size, &runs, 1);
    assert_eq!(
        same_as_qemu(&a, &b, true),
        (0, "Images are identical.\n".into())
    );

    // A difference inside data, mid-sector: qemu-img names the sector.
    poke(&b, MIB + 5000, b"\xff\xfe");
    let r = same_as_qemu(&a, &b, true);
    assert_eq!(r.0, 1);
    assert_eq!(r.1, format!("Content mismatch at offset {}!\n", MIB + 4608));

    // The lowest of several differences wins, whatever thread finds it.
    let c = image(dir, "c.img", size, &runs, 1);
    poke(&c, 7 * MIB - 1, b"x");
    poke(&c, 6 * MIB + 77, b"y");
    poke(&c, 5 * MIB + 9999, b"z");
    assert_eq!(
        same_as_qemu(&a, &c, true).1,
        format!("Content mismatch at offset {}!\n", 5 * MIB + 9728)
    );

    // Data where the other side has a hole.
    let e = image(dir, "e.img", size, &runs, 1);
    poke(&e, 8 * MIB + 3, b"q");
    assert_eq!(
        same_as_qemu(&a, &e, false).1,
        format!("Content mismatch at offset {}!\n", 8 * MIB)
    );

    // Written zeros against a hole: the same image.
    let z = image(dir, "z.img", size, &runs, 1);
    poke(&z, 8 * MIB, &vec![0u8; 64 * KIB as usize]);
    assert_eq!(same_as_qemu(&a, &z, false).0, 0);
}

#[test]
fn different_sizes_match_qemu_img() {
    let d = tempdir();
    let dir = d.path();
    let runs = [(0, 64 * KIB), (2 * MIB, 4 * KIB)];
    let short = image(dir, "short.img", 4 * MIB + 700, &runs, 2);
    // A longer image whose tail reads as zeros (hole, then written zeros).
    let long = image(dir, "long.img", 12 * MIB + 3, &runs, 2);
    poke(&long, 10 * MIB, &vec![0u8; 8192]);
    let r = same_as_qemu(&short, &long, true);
    assert_eq!(
        r,
        (
            0,
            "Warning: Image size mismatch!\nImages are identical.\n".into()
        )
    );
    // Strict: the sizes alone differ.
    assert_eq!(
        ours(short.to_str().unwrap(), long.to_str().unwrap(), &["-s"]),
        (1, "Strict mode: Image size mismatch!\n".into())
    );
    // Data in the tail, right after the common end, in its first sector
    // and far from it.
    let aligned = image(dir, "aligned.img", 4 * MIB + 512, &runs, 2);
    for off in [4 * MIB + 512, 4 * MIB + 1000, 11 * MIB + 5] {
        let t = image(dir, "tail.img", 12 * MIB + 3, &runs, 2);
        poke(&t, off, b"!");
        let r = same_as_qemu(&aligned, &t, true);
        assert_eq!(r.0, 1, "{off}: {}", r.1);
        assert!(r.1.starts_with("Warning: Image size mismatch!\n"), "{r:?}");
        // A common part that ends inside a sector: qemu-img compares that
        // sector whole (reading past the short image's end as zeros) and
        // reports its start without the warning; here the tail starts at
        // the exact end. Both say "different".
        let (code, text) = same_status_as_qemu(&short, &t);
        assert_eq!(code, 1);
        let want = match off {
            // Inside the common part after all.
            o if o < 4 * MIB + 700 => format!("Content mismatch at offset {o}!\n"),
            // The tail's first request starts at the common end.
            o if o < 4 * MIB + 4096 => format!(
                "Warning: Image size mismatch!\nContent mismatch at offset {}!\n",
                4 * MIB + 700
            ),
            // Later ones where the data starts.
            _ => format!(
                "Warning: Image size mismatch!\nContent mismatch at offset {}!\n",
                11 * MIB
            ),
        };
        assert_eq!(text, want, "{off}");
    }
    // Empty against empty, and empty against sparse.
    let e1 = image(dir, "e1.img", 0, &[], 0);
    let e2 = image(dir, "e2.img", 0, &[], 0);
    assert_eq!(same_as_qemu(&e1, &e2, true).0, 0);
    let holes = image(dir, "holes.img", 3 * MIB, &[], 0);
    assert_eq!(same_as_qemu(&e1, &holes, true).0, 0);
}

#[test]
fn nbd_exports_compare_like_files() {
    let d = tempdir();
    let dir = d.path();
    let runs = [(0, 4 * KIB), (3 * MIB, MIB)];
    let a = image(dir, "a.img", 6 * MIB, &runs, 3);
    let b = image(dir, "b.img", 6 * MIB, &runs, 3);
    let (sa, sb) = (nbdkit_export(&a), nbdkit_export(&b));
    assert_eq!(ours(&sa.uri, &sb.uri, &[]).0, 0);
    assert_eq!(ours(&sa.uri, b.to_str().unwrap(), &[]).0, 0);
    poke(&b, 3 * MIB + 1, b"\x01");
    let r = ours(&sa.uri, &sb.uri, &[]);
    assert_eq!(r, qemu(&sa.uri, &sb.uri, &[]));
    assert_eq!(r, (1, format!("Content mismatch at offset {}!\n", 3 * MIB)));
}

#[test]
fn errors_exit_2_with_one_line() {
    let d = tempdir();
    let a = image(d.path(), "a.img", MIB, &[], 0);
    let missing = d.path().join("missing.img");
    let r =
        run_rawdisk(&["compare", a.to_str().unwrap(), missing.to_str().unwrap()]).fails_one_line(2);
    assert!(r.stderr.contains("missing.img"), "{}", r.stderr);
    assert!(r.stdout.is_empty());
    let uri = format!("nbd+unix:///?socket={}", d.path().join("nobody").display());
    run_rawdisk(&["compare", a.to_str().unwrap(), &uri]).fails_one_line(2);
    // Usage errors are 2 as well.
    run_rawdisk(&["compare", a.to_str().unwrap()]).fails_one_line(2);
    run_rawdisk(&["compare", "--bogus", "a", "b"]).fails_one_line(2);
    // -q prints nothing; the status says it.
    let b = image(d.path(), "b.img", MIB, &[(0, 10)], 1);
    let r = run_rawdisk(&["compare", "-q", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert_eq!((r.code, r.stdout.as_str()), (1, ""));
    let h = run_rawdisk(&["compare", "--help"]).ok();
    assert!(h.stdout.contains("Examples:"), "{}", h.stdout);
}

#[test]
#[ignore = "needs root"]
fn block_device_against_its_backing_content() {
    use rawdisk_testkit::LoopDev;
    let d = tempdir();
    let dev = LoopDev::new(16 * MIB, 512);
    rawdisk_testkit::write_pattern(dev.path(), 2 * MIB + 512, MIB, 4);
    let copy = d.path().join("copy.img");
    std::io::copy(
        &mut std::fs::File::open(dev.path()).unwrap(),
        &mut std::fs::File::create(&copy).unwrap(),
    )
    .unwrap();
    let devs = dev.path().to_str().unwrap();
    let copys = copy.to_str().unwrap();
    assert_eq!(ours(devs, copys, &[]), qemu(devs, copys, &[]));
    assert_eq!(ours(devs, copys, &[]).0, 0);
    poke(&copy, 15 * MIB + 3, b"D");
    let r = ours(devs, copys, &[]);
    assert_eq!(r, qemu(devs, copys, &[]));
    assert_eq!(r.0, 1);
}

#[test]
fn json_output_names_outcome_sizes_and_first_byte() {
    let d = tempdir();
    let dir = d.path();
    let runs = [(0, 64 * KIB), (3 * MIB, MIB)];
    let a = image(dir, "a.img", 4 * MIB, &runs, 7);
    let b = image(dir, "b.img", 4 * MIB, &runs, 7);
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let (code, out) = ours(a, b, &["--output", "json"]);
    let j: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
    assert_eq!(code, 0, "{out}");
    assert_eq!(j["outcome"], "identical", "{j}");
    assert_eq!(
        j["a"],
        serde_json::json!({"filename": a, "virtual-size": 4 * MIB})
    );
    assert!(j.get("first-byte").is_none(), "{j}");

    poke(Path::new(b), 3 * MIB + 1234, b"!");
    let (code, out) = ours(a, b, &["--output", "json"]);
    let j: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
    assert_eq!(code, 1, "{out}");
    assert_eq!(j["outcome"], "mismatch", "{j}");
    assert_eq!(j["mismatch-offset"], 3 * MIB + 1024, "{j}");
    assert_eq!(j["first-byte"], 3 * MIB + 1234, "{j}");
    assert_eq!(
        j["b"],
        serde_json::json!({"filename": b, "virtual-size": 4 * MIB})
    );
}
