//! `rawdisk info` against `qemu-img info`, stat and `nbdinfo`.

mod common;
use common::*;

use std::path::Path;
use std::process::{Child, Command, Stdio};

use rawdisk_testkit::{write_pattern, Fs, FsKind, LoopDev, MIB};

fn check_file_info(path: &Path, fs_type: Option<&str>) {
    let p = path.to_str().unwrap();
    let j = run_rawdisk(&["info", "--output", "json", p]).ok().json();
    assert_eq!(j["filename"], p);
    assert_eq!(j["format"], "raw");
    assert_eq!(j["kind"], "file");
    assert_eq!(
        j["virtual-size"].as_u64().unwrap(),
        std::fs::metadata(path).unwrap().len()
    );
    assert_eq!(j["actual-size"].as_u64().unwrap(), st_blocks(path) * 512);
    if let Some(t) = fs_type {
        assert_eq!(j["filesystem"]["type"], t, "{j}");
    }
    // qemu-img info's own lines come first and agree.
    let ours = run_rawdisk(&["info", p]).ok().stdout;
    let qemu = tool("qemu-img", &["info", "-f", "raw", p]);
    let first4 = |s: &str| s.lines().take(4).map(String::from).collect::<Vec<_>>();
    assert_eq!(
        first4(&ours),
        first4(&qemu),
        "ours:\n{ours}\nqemu-img:\n{qemu}"
    );
}

#[test]
fn info_of_a_file_on_tmp() {
    let d = tempdir();
    let img = d.path().join("i.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    write_pattern(&img, 3 * MIB, 1376256, 9);
    check_file_info(&img, None);
}

#[test]
#[ignore = "needs root"]
fn info_on_every_file_system() {
    for kind in FsKind::ALL {
        let fs = Fs::new(kind, 128 * MIB);
        let img = fs.sparse_file("i.img", 10 * MIB);
        write_pattern(&img, MIB, 512 * 1024, 4);
        check_file_info(&img, Some(kind.name()));
    }
}

#[test]
#[ignore = "needs root"]
fn info_of_loop_devices() {
    for sector in [512u32, 4096] {
        let dev = LoopDev::new(32 * MIB, sector);
        let p = dev.path().to_str().unwrap();
        let j = run_rawdisk(&["info", "--output", "json", p]).ok().json();
        assert_eq!(j["kind"], "block");
        assert_eq!(j["virtual-size"].as_u64().unwrap(), 32 * MIB);
        assert_eq!(
            j["logical-sector-size"].as_u64().unwrap(),
            u64::from(sector)
        );
        assert_eq!(
            j["loop-backing-file"]["filename"].as_str().unwrap(),
            dev.backing().to_str().unwrap()
        );
        let human = run_rawdisk(&["info", p]).ok().stdout;
        assert!(human.contains("block device"), "{human}");
        assert!(
            human.contains(&format!("logical sector size:  {sector}")),
            "{human}"
        );
    }
}

struct Server {
    child: Child,
    _dir: tempfile::TempDir,
}
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn info_of_nbd_export_matches_nbdinfo() {
    let d = tempdir();
    let img = d.path().join("n.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(10 * MIB)
        .unwrap();
    let sd = tempdir();
    let sock = sd.path().join("s.sock");
    // blocksize-policy advertises block sizes, as nbdinfo shows them.
    let child = Command::new("nbdkit")
        .args(["-f", "-U"])
        .arg(&sock)
        .args(["--filter=blocksize-policy", "file"])
        .arg(&img)
        .args([
            "blocksize-minimum=512",
            "blocksize-preferred=65536",
            "blocksize-maximum=4194304",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nbdkit");
    let _srv = Server { child, _dir: sd };
    for _ in 0..200 {
        if sock.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let ours = run_rawdisk(&["info", "--output", "json", &uri]).ok().json();
    let theirs: serde_json::Value =
        serde_json::from_str(&tool("nbdinfo", &["--json", &uri])).unwrap();
    let e = &theirs["exports"][0];
    assert_eq!(ours["kind"], "nbd");
    assert_eq!(ours["virtual-size"].as_u64().unwrap(), 10 * MIB);
    let n = &ours["nbd"];
    // One naming style (kebab-case) and nothing said twice: nbdinfo's size,
    // is_rotational and is_read_only are the top level's.
    assert_eq!(ours["virtual-size"], e["export-size"]);
    assert_eq!(ours["rotational"], e["is_rotational"]);
    assert_eq!(ours["read-only"], e["is_read_only"]);
    for k in [
        "export-name",
        "can_cache",
        "can_df",
        "can_fast_zero",
        "can_flush",
        "can_fua",
        "can_multi_conn",
        "can_trim",
        "can_zero",
        "block_size_minimum",
        "block_size_preferred",
        "block_size_maximum",
        "contexts",
    ] {
        let ours_k = k.replace('_', "-");
        assert_eq!(n[&ours_k], e[k], "key {k}: ours {n} nbdinfo {e}");
    }
    assert_eq!(n["structured-replies"], theirs["structured"]);
    let keys: Vec<&String> = n.as_object().unwrap().keys().collect();
    for k in &keys {
        assert!(!k.contains('_'), "{k} is not kebab-case: {n}");
        assert!(
            ![
                "export-size",
                "is-rotational",
                "is-read-only",
                "rotational",
                "read-only"
            ]
            .contains(&k.as_str()),
            "{k} repeats the top level: {n}"
        );
    }
    assert_eq!(n["block-size-minimum"].as_u64(), Some(512));
    let human = run_rawdisk(&["info", &uri]).ok().stdout;
    assert!(human.starts_with(&format!("image: {uri}\nfile format: raw\nvirtual size: 10 MiB (10485760 bytes)\ndisk size: unavailable\n")), "{human}");
    assert!(human.contains("block size preferred: 65536"), "{human}");
}
