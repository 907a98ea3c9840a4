//! `rawdisk probe`: what it reports on each storage kind, and that without
//! --destructive it changes neither the bytes nor the allocation of the
//! target (and leaves no scratch file behind).

mod common;
use common::*;

use std::path::Path;

use rawdisk_testkit::{allocated_bytes, write_pattern, Fs, FsKind, LoopDev, MIB};

fn dir_listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn method<'a>(j: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    j["methods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["method"] == name)
        .unwrap_or_else(|| panic!("no method {name} in {j}"))
}

/// Probes a file and checks nothing changed: bytes, allocation, size,
/// modification time, and the directory's entries.
fn probe_file_unchanged(path: &Path) -> serde_json::Value {
    let dir = path.parent().unwrap();
    let (fp, blocks, md) = (
        fingerprint(path),
        st_blocks(path),
        std::fs::metadata(path).unwrap(),
    );
    let listing = dir_listing(dir);
    let j = run_rawdisk(&["probe", "--output", "json", path.to_str().unwrap()])
        .ok()
        .json();
    let human = run_rawdisk(&["probe", path.to_str().unwrap()]).ok().stdout;
    assert_eq!(
        fingerprint(path),
        fp,
        "probe changed the bytes of {}",
        path.display()
    );
    assert_eq!(st_blocks(path), blocks, "probe changed the allocation");
    let md2 = std::fs::metadata(path).unwrap();
    assert_eq!(md2.len(), md.len());
    assert_eq!(md2.modified().unwrap(), md.modified().unwrap());
    assert_eq!(dir_listing(dir), listing, "scratch file left behind");
    assert!(human.contains("zero with trim:"), "{human}");
    // JSON says what the human form says, in the same words; yes/no are
    // booleans (null when unknown).
    for m in j["methods"].as_array().unwrap() {
        let (name, state) = (m["method"].as_str().unwrap(), m["state"].as_str().unwrap());
        assert!(
            human
                .lines()
                .any(|l| l.starts_with(&format!("{name} ")) && l.contains(&format!(" {state} "))),
            "{name} {state} not in\n{human}"
        );
    }
    for k in ["fast-zero", "trim"] {
        let v = &j["zero"][k];
        assert!(v.is_boolean() || v.is_null(), "{k}: {v}");
        let word = match v.as_bool() {
            Some(true) => "yes",
            Some(false) => "no",
            None => "unknown",
        };
        let label = k.replace('-', " ");
        assert!(
            human.contains(&format!("{label}:"))
                && human
                    .lines()
                    .any(|l| l.starts_with(&format!("{label}:")) && l.contains(word)),
            "{k} {word} not in\n{human}"
        );
    }
    assert_eq!(j["kind"], "file");
    assert_eq!(j["tested-on"], "scratch-file");
    assert_eq!(j["virtual-size"].as_u64().unwrap(), md.len());
    j
}

#[test]
fn probe_on_tmp_leaves_the_file_alone() {
    let d = tempdir();
    let img = d.path().join("p.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 * MIB)
        .unwrap();
    write_pattern(&img, MIB, 2 * MIB, 5);
    let j = probe_file_unchanged(&img);
    assert_eq!(method(&j, "write-zeros")["state"], "works");
    assert_eq!(method(&j, "blkzeroout")["state"], "n/a");
    check_write_zeroes(&j);
}

/// The falloc-write-zeroes row of a file probe: tried on the scratch file,
/// it either works (zeros, space kept) or is known to fail with the
/// kernel's errno, and the no-trim zero uses it exactly when it works.
fn check_write_zeroes(j: &serde_json::Value) -> bool {
    let m = method(j, "falloc-write-zeroes");
    assert_eq!(m["call"], "fallocate(WRITE_ZEROES)", "{j}");
    let detail = m["detail"].as_str().unwrap();
    let works = match m["state"].as_str().unwrap() {
        "works" => {
            assert_eq!(detail, "reads back zeros, keeps allocation", "{j}");
            true
        }
        "known to fail" => {
            assert_eq!(detail, "EOPNOTSUPP", "{j}");
            false
        }
        other => panic!("falloc-write-zeroes {other}: {j}"),
    };
    assert_eq!(
        j["zero"]["without-trim"]["method"] == "falloc-write-zeroes",
        works,
        "{j}"
    );
    works
}

#[test]
#[ignore = "needs root"]
fn probe_on_every_file_system() {
    for kind in FsKind::usable() {
        let fs = Fs::new(kind, 128 * MIB);
        let img = fs.sparse_file("p.img", 8 * MIB);
        write_pattern(&img, MIB, 2 * MIB, 6);
        let j = probe_file_unchanged(&img);
        let fstype = if kind.nfs_profile().is_some() {
            "fuse"
        } else {
            kind.name()
        };
        assert_eq!(j["filesystem"]["type"], fstype, "{j}");
        let st = |m: &str| method(&j, m)["state"].as_str().unwrap().to_string();
        let with_trim = j["zero"]["with-trim"]["method"].as_str().unwrap();
        let without = j["zero"]["without-trim"]["method"].as_str().unwrap();
        match kind {
            FsKind::Tmpfs => {
                assert_eq!(st("falloc-write-zeroes"), "known to fail", "{j}");
                assert_eq!(st("punch-hole"), "works");
                assert_eq!(st("zero-range"), "known to fail", "{j}");
                assert_eq!(st("punch-alloc"), "works");
                assert_eq!(st("fallocate"), "works");
                assert_eq!(with_trim, "punch-hole");
                // punch-alloc works but costs more than writing on tmpfs.
                assert_eq!(without, "write-zeros");
                assert_eq!(j["zero"]["fast-zero"], false);
                assert_eq!(j["direct-io"], "works");
            }
            // ramfs and the NFS 3 client: no fallocate at all. NFS 3 has
            // O_DIRECT, and no SEEK (the kernel reports all data).
            FsKind::Ramfs | FsKind::Nfs3 => {
                for m in [
                    "punch-hole",
                    "falloc-write-zeroes",
                    "zero-range",
                    "punch-alloc",
                    "fallocate",
                ] {
                    assert_eq!(st(m), "known to fail", "{kind} {m}: {j}");
                }
                assert_eq!(with_trim, "write-zeros");
                assert_eq!(without, "write-zeros");
                assert_eq!(j["zero"]["fast-zero"], false);
                assert_eq!(j["zero"]["trim"], false);
                if kind == FsKind::Nfs3 {
                    assert_eq!(j["direct-io"], "works");
                    assert!(method(&j, "seek-hole")["detail"]
                        .as_str()
                        .unwrap()
                        .contains("everything as data"));
                } else {
                    assert_eq!(j["direct-io"], "known to fail");
                }
            }
            // The NFS 4.2 client: ALLOCATE and DEALLOCATE, no ZERO_RANGE, so a
            // zero that keeps the space punches and allocates again.
            FsKind::Nfs42 => {
                for m in ["punch-hole", "punch-alloc", "fallocate", "seek-hole"] {
                    assert_eq!(st(m), "works", "nfs42 {m}: {j}");
                }
                for m in ["falloc-write-zeroes", "zero-range"] {
                    assert_eq!(st(m), "known to fail", "nfs42 {m}: {j}");
                }
                assert!(method(&j, "seek-hole")["detail"]
                    .as_str()
                    .unwrap()
                    .contains("reports holes"));
                assert_eq!(with_trim, "punch-hole");
                assert_eq!(without, "punch-alloc");
                assert_eq!(j["zero"]["fast-zero"], true);
                assert_eq!(j["zero"]["trim"], true);
                assert_eq!(j["direct-io"], "works");
            }
            FsKind::Ext4 | FsKind::Xfs | FsKind::Btrfs => {
                for m in [
                    "punch-hole",
                    "zero-range",
                    "punch-alloc",
                    "fallocate",
                    "seek-hole",
                ] {
                    assert_eq!(st(m), "works", "{kind} {m}: {j}");
                }
                assert!(method(&j, "seek-hole")["detail"]
                    .as_str()
                    .unwrap()
                    .contains("reports holes"));
                assert_eq!(with_trim, "punch-hole");
                if !check_write_zeroes(&j) {
                    assert_eq!(without, "zero-range");
                }
                assert_eq!(j["zero"]["fast-zero"], true);
                assert_eq!(j["zero"]["trim"], true);
            }
        }
    }
}

#[test]
#[ignore = "needs root"]
fn probe_of_block_devices_reads_only() {
    for (sector, on_tmpfs) in [(512u32, false), (4096, false), (512, true)] {
        let dev = if on_tmpfs {
            LoopDev::on_tmpfs(16 * MIB, sector)
        } else {
            LoopDev::new(16 * MIB, sector)
        };
        write_pattern(dev.path(), 0, 16 * MIB, 8);
        let (fp, alloc) = (fingerprint(dev.path()), allocated_bytes(dev.backing()));
        let wz = dev.queue_attr("write_zeroes_max_bytes");
        let p = dev.path().to_str().unwrap();
        let j = run_rawdisk(&["probe", "--output", "json", p]).ok().json();
        run_rawdisk(&["probe", p]).ok();
        assert_eq!(fingerprint(dev.path()), fp, "probe wrote to {p}");
        assert_eq!(
            allocated_bytes(dev.backing()),
            alloc,
            "probe changed the allocation"
        );
        assert_eq!(
            dev.queue_attr("write_zeroes_max_bytes"),
            wz,
            "probe used write-zeroes"
        );
        assert_eq!(j["kind"], "block");
        assert_eq!(j["tested-on"], "sysfs");
        assert_eq!(
            j["logical-sector-size"].as_u64().unwrap(),
            u64::from(sector)
        );
        assert_eq!(
            j["queue-limits"]["write-zeroes-max-bytes"]
                .as_u64()
                .unwrap(),
            wz
        );
        // Advertised write-zeroes stays unknown until tried.
        assert_eq!(
            method(&j, "punch-hole")["state"],
            if wz == 0 { "known to fail" } else { "unknown" }
        );
        assert_eq!(method(&j, "blkdiscard")["state"], "works");
        assert_eq!(method(&j, "falloc-write-zeroes")["state"], "n/a");
        assert_eq!(
            j["zero"]["with-trim"]["method"],
            if wz == 0 { "zero-range" } else { "punch-hole" }
        );
    }
}

#[test]
#[ignore = "needs root"]
fn destructive_probe_restores_the_device() {
    for (sector, on_tmpfs) in [(512u32, false), (4096, false), (512, true)] {
        let dev = if on_tmpfs {
            LoopDev::on_tmpfs(16 * MIB, sector)
        } else {
            LoopDev::new(16 * MIB, sector)
        };
        write_pattern(dev.path(), 0, 16 * MIB, 11);
        let p = dev.path().to_str().unwrap();
        let j = run_rawdisk(&["probe", "--destructive", "--output", "json", p])
            .ok()
            .json();
        // Every byte is back.
        rawdisk_testkit::check_pattern(dev.path(), 0, 16 * MIB, 11);
        assert_eq!(j["tested-on"], "device");
        let st = |m: &str| method(&j, m)["state"].as_str().unwrap().to_string();
        assert_eq!(st("zero-range"), "works", "{j}");
        assert_eq!(st("blkzeroout"), "works", "{j}");
        assert_eq!(st("blkdiscard"), "works", "{j}");
        if on_tmpfs {
            // tmpfs has no ZERO_RANGE: the loop driver's write-zeroes fails
            // and is switched off (docs/capabilities.md, tmpfs-backed loop
            // devices).
            assert_eq!(st("punch-hole"), "known to fail", "{j}");
            assert_eq!(dev.queue_attr("write_zeroes_max_bytes"), 0);
            assert_eq!(j["zero"]["fast-zero"], false, "{j}");
        } else {
            assert_eq!(st("punch-hole"), "works", "{j}");
            assert_eq!(j["zero"]["with-trim"]["method"], "punch-hole", "{j}");
            assert_eq!(j["zero"]["fast-zero"], true, "{j}");
        }
    }
}

#[test]
#[ignore = "needs root"]
fn destructive_probe_refuses_a_mounted_device() {
    let fs = Fs::ext4(64 * MIB);
    let dev = fs.device().unwrap().to_path_buf();
    let fp = fingerprint(&dev);
    let r = run_rawdisk(&["probe", "--destructive", dev.to_str().unwrap()]).fails_one_line(1);
    assert!(r.stderr.contains("Device or resource busy"), "{}", r.stderr);
    assert_eq!(fingerprint(&dev), fp);
}
