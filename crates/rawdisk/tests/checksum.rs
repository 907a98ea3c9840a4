//! `rawdisk checksum` on the command line: sha256sum's output shape, JSON
//! with the parameters, the same value for a file and its NBD export, one
//! line errors.

mod common;
use common::*;

use std::os::unix::fs::FileExt;
use std::path::Path;

const MIB: u64 = 1 << 20;

fn sparse(p: &Path, size: u64) {
    let f = std::fs::File::create(p).unwrap();
    f.set_len(size).unwrap();
    f.write_all_at(&rawdisk_testkit::pattern_vec(1, 0, 70_000), MIB + 3)
        .unwrap();
    f.write_all_at(b"end", size - 3).unwrap();
}

#[test]
fn output_like_sha256sum_and_json_with_the_parameters() {
    let d = tempdir();
    let p = d.path().join("a.img");
    sparse(&p, 20 * MIB + 5);
    let ps = p.to_str().unwrap();
    let r = run_rawdisk(&["checksum", ps]).ok();
    let line = r.stdout.trim_end_matches('\n');
    let (digest, name) = line.split_once("  ").expect("DIGEST  TARGET");
    assert_eq!(name, ps);
    assert_eq!(digest.len(), 64);
    assert!(digest
        .bytes()
        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));

    let j = run_rawdisk(&["checksum", "--output", "json", ps])
        .ok()
        .json();
    assert_eq!(j["checksum"], digest);
    assert_eq!(j["digest"], "sha256");
    assert_eq!(j["block-size"], 65536);
    assert_eq!(j["virtual-size"], 20 * MIB + 5);
    assert_eq!(j["filename"], ps);

    for (alg, hexlen) in [("sha1", 40), ("md5", 32), ("blake2b512", 128)] {
        let j = run_rawdisk(&["checksum", "-d", alg, "--output", "json", ps])
            .ok()
            .json();
        assert_eq!(j["digest"], alg);
        assert_eq!(j["checksum"].as_str().unwrap().len(), hexlen);
    }
    let j = run_rawdisk(&["checksum", "--block-size", "1M", "--output", "json", ps])
        .ok()
        .json();
    assert_eq!(j["block-size"], MIB);
    assert_ne!(j["checksum"], digest);
}

#[test]
fn an_nbd_export_has_the_files_checksum() {
    let d = tempdir();
    let p = d.path().join("n.img");
    sparse(&p, 33 * MIB + 4097);
    let want = run_rawdisk(&["checksum", p.to_str().unwrap()]).ok().stdout;
    let want = want.split_once("  ").unwrap().0.to_string();
    let srv = nbdkit_export(&p);
    let uri = srv.uri.clone();
    let r = run_rawdisk(&["checksum", &uri]);
    drop(srv);
    let r = r.ok();
    assert_eq!(r.stdout, format!("{want}  {uri}\n"));
}

#[test]
fn errors_are_one_line() {
    let d = tempdir();
    let missing = d.path().join("missing.img");
    let r = run_rawdisk(&["checksum", missing.to_str().unwrap()]).fails_one_line(1);
    assert!(r.stderr.contains("No such file"), "{}", r.stderr);
    let p = d.path().join("x.img");
    std::fs::write(&p, b"x").unwrap();
    let ps = p.to_str().unwrap();
    for args in [
        vec!["checksum", "--digest", "shake128", ps],
        vec!["checksum", "--digest", "sha257", ps],
        vec!["checksum", "--block-size", "1000", ps],
        vec!["checksum", "--block-size", "0", ps],
        vec!["checksum", "--output", "xml", ps],
        vec!["checksum"],
        vec!["checksum", ps, ps],
    ] {
        let r = run_rawdisk(&args).fails_one_line(2);
        assert!(r.stdout.is_empty(), "{args:?}");
    }
    let uri = format!("nbd+unix:///?socket={}", d.path().join("nobody").display());
    run_rawdisk(&["checksum", &uri]).fails_one_line(1);
    let h = run_rawdisk(&["checksum", "--help"]).ok();
    assert!(h.stdout.contains("Examples:"), "{}", h.stdout);
}
