//! `rawdisk map` against `qemu-img map` (and `nbdinfo --map`) on the same
//! files, devices and exports.

mod common;
use common::*;

use std::path::Path;
use std::process::{Child, Command, Stdio};

use rawdisk_testkit::{is_root, write_at, write_pattern, Fs, FsKind, LoopDev, MIB};

/// Data, written zeros, a fallocated range, holes, data at the very end.
fn make_image(path: &Path) -> u64 {
    let size = 16 * MIB;
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    drop(f);
    write_pattern(path, MIB, 192 * 1024, 1);
    write_pattern(path, 5 * MIB, MIB, 2);
    write_at(path, 8 * MIB, &vec![0u8; 128 * 1024]);
    // fallocate(0): unwritten extents on ext4/XFS (SEEK_DATA calls them
    // holes), plain pages on tmpfs; fails on ramfs, which is fine.
    let _ = Command::new("fallocate")
        .args(["-o", "10485760", "-l", "1048576"])
        .arg(path)
        .stderr(Stdio::null())
        .status();
    write_pattern(path, size - 4096, 4096, 3);
    size
}

fn compare_with_qemu(path: &Path, size: u64) {
    let p = path.to_str().unwrap();
    let ours = run_rawdisk(&["map", "--output", "json", p]).ok().stdout;
    let qemu = tool("qemu-img", &["map", "--output=json", "-f", "raw", p]);
    let (o, q) = (map_tuples(&ours), map_tuples(&qemu));
    assert_covers(&o, size);
    assert_eq!(o, q, "map of {p} differs from qemu-img's");
    // Same text, byte for byte: scripts can diff the two tools.
    assert_eq!(ours.trim_end(), qemu.trim_end());
    let ours_h = run_rawdisk(&["map", p]).ok().stdout;
    let qemu_h = tool("qemu-img", &["map", "-f", "raw", p]);
    assert_eq!(ours_h, qemu_h, "human map of {p}");
}

#[test]
fn map_matches_qemu_img_on_tmp() {
    let d = tempdir();
    let img = d.path().join("m.img");
    let size = make_image(&img);
    compare_with_qemu(&img, size);
    // The map shows the data where it was written.
    let m = map_tuples(
        &run_rawdisk(&["map", "--output", "json", img.to_str().unwrap()])
            .ok()
            .stdout,
    );
    let data_at = |off: u64| m.iter().any(|e| e.3 && e.0 <= off && off < e.0 + e.1);
    assert!(data_at(MIB) && data_at(5 * MIB) && data_at(size - 1));
    assert!(!data_at(3 * MIB), "a hole shows as data: {m:?}");
}

#[test]
fn empty_and_fully_sparse_files() {
    let d = tempdir();
    let e = d.path().join("empty.img");
    std::fs::File::create(&e).unwrap();
    let r = run_rawdisk(&["map", "--output", "json", e.to_str().unwrap()]).ok();
    assert_eq!(r.stdout, "[]\n");
    let s = d.path().join("sparse.img");
    std::fs::File::create(&s).unwrap().set_len(1 << 30).unwrap();
    compare_with_qemu(&s, 1 << 30);
}

#[test]
#[ignore = "needs root"]
fn map_matches_qemu_img_on_every_file_system() {
    for kind in FsKind::usable() {
        let fs = Fs::new(kind, 128 * MIB);
        let img = fs.path("m.img");
        let size = make_image(&img);
        compare_with_qemu(&img, size);
    }
}

#[test]
#[ignore = "needs root"]
fn map_of_block_devices_is_all_data() {
    assert!(is_root());
    for sector in [512u32, 4096] {
        let dev = LoopDev::new(32 * MIB, sector);
        compare_with_qemu(dev.path(), 32 * MIB);
        let m = map_tuples(
            &run_rawdisk(&["map", "--output", "json", dev.path().to_str().unwrap()])
                .ok()
                .stdout,
        );
        assert_eq!(m, vec![(0, 32 * MIB, false, true, Some(0), true, 0)]);
    }
}

struct Nbdkit {
    child: Child,
    _dir: tempfile::TempDir,
    uri: String,
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nbdkit_file(path: &Path) -> Nbdkit {
    let dir = tempdir();
    let sock = dir.path().join("nbd.sock");
    let child = Command::new("nbdkit")
        .args(["-f", "-U"])
        .arg(&sock)
        .arg("file")
        .arg(path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nbdkit");
    for _ in 0..200 {
        if sock.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(sock.exists(), "nbdkit did not create its socket");
    Nbdkit {
        child,
        uri: format!("nbd+unix:///?socket={}", sock.display()),
        _dir: dir,
    }
}

#[test]
fn map_of_nbd_export_matches_qemu_img_and_nbdinfo() {
    let d = tempdir();
    let img = d.path().join("n.img");
    let size = make_image(&img);
    let srv = nbdkit_file(&img);
    let ours = run_rawdisk(&["map", "--output", "json", &srv.uri])
        .ok()
        .stdout;
    let qemu = tool("qemu-img", &["map", "--output=json", &srv.uri]);
    let o = map_tuples(&ours);
    assert_covers(&o, size);
    assert_eq!(o, map_tuples(&qemu), "NBD map differs from qemu-img's");
    // nbdinfo --map: type bit 0 = hole, bit 1 = zero.
    let nbdinfo = tool("nbdinfo", &["--map", "--json", &srv.uri]);
    let v: serde_json::Value = serde_json::from_str(&nbdinfo).unwrap();
    let mut theirs: Vec<(u64, u64, bool, bool)> = Vec::new();
    for e in v.as_array().unwrap() {
        let (off, len, ty) = (
            e["offset"].as_u64().unwrap(),
            e["length"].as_u64().unwrap(),
            e["type"].as_u64().unwrap(),
        );
        let (zero, data) = (ty & 2 != 0, ty & 1 == 0);
        match theirs.last_mut() {
            Some(l) if l.2 == zero && l.3 == data && l.0 + l.1 == off => l.1 += len,
            _ => theirs.push((off, len, zero, data)),
        }
    }
    let ours4: Vec<(u64, u64, bool, bool)> = o.iter().map(|e| (e.0, e.1, e.2, e.3)).collect();
    assert_eq!(ours4, theirs, "NBD map differs from nbdinfo --map");
    // And the export's map is the file's map.
    let local = map_tuples(
        &run_rawdisk(&["map", "--output", "json", img.to_str().unwrap()])
            .ok()
            .stdout,
    );
    assert_eq!(o, local);
}

/// `--start-offset`/`--max-length` cut the map as qemu-img cuts it, byte for
/// byte, including ranges that start or end inside a run and past the end.
#[test]
fn map_range_matches_qemu_img() {
    let d = tempdir();
    let img = d.path().join("m.img");
    make_image(&img);
    let p = img.to_str().unwrap();
    for (start, len) in [
        (Some("512K"), Some("2M")),
        (Some("1100K"), None),
        (None, Some("5632K")),
        (Some("15M"), Some("64M")),
        (Some("20M"), None),
        (Some("0"), Some("0")),
    ] {
        let mut args: Vec<&str> = vec!["map", "--output=json", "-f", "raw"];
        if let Some(s) = start {
            args.extend(["--start-offset", s]);
        }
        if let Some(l) = len {
            args.extend(["--max-length", l]);
        }
        args.push(p);
        let qemu = tool("qemu-img", &args);
        let ours = run_rawdisk(&args).ok().stdout;
        assert_eq!(ours.trim_end(), qemu.trim_end(), "{args:?}");
        args[1] = "--output=human";
        let qemu = tool("qemu-img", &args);
        let ours = run_rawdisk(&args).ok().stdout;
        assert_eq!(ours, qemu, "{args:?}");
    }
}

/// The same ranges over NBD: block status is asked for the range only, in
/// spans, and the runs are cut as qemu-img cuts them.
#[test]
fn map_range_of_nbd_export_matches_qemu_img() {
    let d = tempdir();
    let img = d.path().join("n.img");
    make_image(&img);
    let srv = nbdkit_file(&img);
    for (start, len) in [
        ("512K", "2M"),
        ("1100K", "15M"),
        ("0", "5632K"),
        ("15M", "64M"),
        ("20M", "1M"),
        ("4M", "0"),
    ] {
        let args = [
            "map",
            "--output=json",
            "--start-offset",
            start,
            "--max-length",
            len,
            &srv.uri,
        ];
        let qemu = tool("qemu-img", &args);
        let ours = run_rawdisk(&args).ok().stdout;
        assert_eq!(ours.trim_end(), qemu.trim_end(), "{args:?}");
    }
}

fn nbdkit_tcp(path: &Path) -> Nbdkit {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("nbdkit")
        .args([
            "-f",
            "-r",
            "-i",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "file",
        ])
        .arg(path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nbdkit");
    let up = (0..200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(10));
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    assert!(up, "nbdkit does not listen on port {port}");
    Nbdkit {
        child,
        uri: format!("nbd://127.0.0.1:{port}"),
        _dir: tempdir(),
    }
}

/// The human map over NBD, byte for byte: the File column names the export
/// as qemu-img spells its URI, with and without an export name.
#[test]
fn human_map_of_nbd_export_matches_qemu_img() {
    let d = tempdir();
    let img = d.path().join("n.img");
    make_image(&img);
    let unix = nbdkit_file(&img);
    let tcp = nbdkit_tcp(&img);
    let sock = unix.uri.strip_prefix("nbd+unix:///").unwrap();
    for uri in [
        unix.uri.clone(),
        format!("nbd+unix:///a%20b{sock}"),
        tcp.uri.clone(),
        format!("{}/", tcp.uri),
        format!("{}/x/y", tcp.uri),
    ] {
        let qemu = tool("qemu-img", &["map", &uri]);
        let ours = run_rawdisk(&["map", &uri]).ok().stdout;
        assert_eq!(ours, qemu, "{uri}");
        assert!(ours.lines().count() > 2, "no data runs: {ours}");
    }
}
