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
    // The keys qemu-img info --output=json prints for a raw file agree.
    let q: serde_json::Value = serde_json::from_str(&tool(
        "qemu-img",
        &["info", "-f", "raw", "--output=json", p],
    ))
    .unwrap();
    for k in [
        "filename",
        "format",
        "virtual-size",
        "actual-size",
        "dirty-flag",
    ] {
        assert_eq!(j[k], q[k], "key {k}: ours {j} qemu-img {q}");
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
    for kind in FsKind::usable() {
        let fs = Fs::new(kind, 128 * MIB);
        let img = fs.sparse_file("i.img", 10 * MIB);
        write_pattern(&img, MIB, 512 * 1024, 4);
        let fstype = if kind.nfs_profile().is_some() {
            "fuse"
        } else {
            kind.name()
        };
        check_file_info(&img, Some(fstype));
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
    // nbdinfo's document key for key, so scripts written for it keep
    // working; only its human strings (content, export-size-str) are not
    // computed, and rawdisk adds extended-headers (and looks-like).
    for (k, v) in theirs.as_object().unwrap() {
        if k != "exports" {
            assert_eq!(&ours[k], v, "key {k}: ours {ours} nbdinfo {theirs}");
        }
    }
    let (o, e) = (&ours["exports"][0], &theirs["exports"][0]);
    assert_eq!(ours["exports"].as_array().unwrap().len(), 1, "{ours}");
    for (k, v) in e.as_object().unwrap() {
        if !["content", "export-size-str"].contains(&k.as_str()) {
            assert_eq!(&o[k], v, "key {k}: ours {o} nbdinfo {e}");
        }
    }
    for k in o.as_object().unwrap().keys() {
        assert!(
            e.get(k).is_some() || k == "looks-like",
            "{k}: not nbdinfo's: {o}"
        );
    }
    for k in ours.as_object().unwrap().keys() {
        assert!(
            theirs.get(k).is_some() || k == "extended-headers",
            "{k}: {ours}"
        );
    }
    assert_eq!(o["block_size_minimum"].as_u64(), Some(512));
    assert_eq!(o["export-size"].as_u64(), Some(10 * MIB));
    let human = run_rawdisk(&["info", &uri]).ok().stdout;
    assert!(human.starts_with(&format!("image: {uri}\nfile format: raw\nvirtual size: 10 MiB (10485760 bytes)\ndisk size: unavailable\n")), "{human}");
    assert!(human.contains("block size preferred: 65536"), "{human}");
}
