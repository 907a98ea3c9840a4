//! `rawdisk checkpoint create|list|delete` on the command line: names,
//! human and JSON listings, --state-dir, errors in one line with exit 2 for
//! a bad command line and 1 for a failure, and the target never touched.

mod common;
use common::*;

use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;

fn image(dir: &Path) -> PathBuf {
    let p = dir.join("disk.img");
    std::fs::File::create(&p).unwrap().set_len(8 * MIB).unwrap();
    rawdisk_testkit::write_pattern(&p, MIB, MIB, 9);
    p
}

fn cp(args: &[&str], target: &Path) -> Run {
    let mut a = vec!["checkpoint"];
    a.extend_from_slice(args);
    a.push(target.to_str().unwrap());
    run_rawdisk(&a)
}

#[test]
fn create_list_delete() {
    let d = tempdir();
    let img = image(d.path());
    let before = fingerprint(&img);
    // Never tracked: nothing to list, and no state file made by listing.
    assert_eq!(cp(&["list"], &img).ok().stdout, "");
    assert_eq!(cp(&["list", "--output", "json"], &img).ok().stdout, "[]\n");
    assert!(!d.path().join("disk.img.rawdisk-cbt").exists());

    assert_eq!(cp(&["create"], &img).ok().stdout, "cp-1\n");
    assert_eq!(
        cp(&["create", "--name", "monday"], &img).ok().stdout,
        "monday\n"
    );
    assert_eq!(cp(&["create"], &img).ok().stdout, "cp-2\n");
    assert!(d.path().join("disk.img.rawdisk-cbt").exists());

    let human = cp(&["list"], &img).ok().stdout;
    let lines: Vec<Vec<&str>> = human
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), 3, "{human}");
    for (l, name) in lines.iter().zip(["cp-1", "monday", "cp-2"]) {
        assert_eq!(l.len(), 4, "{human}");
        assert_eq!(l[0], name);
        assert!(
            l[1].len() == 20 && l[1].ends_with('Z') && l[1].contains('T'),
            "{human}"
        );
        assert_eq!(l[3], "consistent");
    }
    // Identities: one source id, sequence numbers in creation order.
    let ids: Vec<&str> = lines.iter().map(|l| l[2]).collect();
    let source = &ids[0]["id=".len()..ids[0].len() - 2];
    assert_eq!(source.len(), 32, "{human}");
    for (id, seq) in ids.iter().zip(1..) {
        assert_eq!(*id, format!("id={source}:{seq}"), "{human}");
    }
    // Names are padded to one column.
    assert!(human.starts_with("cp-1    "), "{human}");

    let j = cp(&["list", "--output", "json"], &img).ok().json();
    let arr = j.as_array().unwrap();
    assert_eq!(arr.len(), 3);
    for (c, name) in arr.iter().zip(["cp-1", "monday", "cp-2"]) {
        // RFC 3339 in UTC, as the human form prints it.
        let created = c["created"].as_str().unwrap().to_string();
        let listed = lines.iter().find(|l| l[0] == name).unwrap();
        assert_eq!(created, listed[1], "{c}");
        assert_eq!(
            *c,
            serde_json::json!({
                "name": name, "created": created, "consistent": true, "reason": null,
                "id": &listed[2]["id=".len()..],
            })
        );
    }

    assert_eq!(cp(&["delete", "--name", "monday"], &img).ok().stdout, "");
    let names: Vec<String> = cp(&["list"], &img)
        .ok()
        .stdout
        .lines()
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect();
    assert_eq!(names, ["cp-1", "cp-2"]);
    assert_eq!(
        fingerprint(&img),
        before,
        "checkpoint commands changed the target"
    );
}

#[test]
fn errors_are_one_line_with_usage_exit_2_and_failure_exit_1() {
    let d = tempdir();
    let img = image(d.path());
    cp(&["create", "--name", "a"], &img).ok();
    for bad in ["a b", "x/y", &"n".repeat(64), ".hidden", "é"] {
        let r = cp(&["create", "--name", bad], &img).fails_one_line(2);
        assert!(r.stderr.contains("invalid checkpoint name"), "{}", r.stderr);
    }
    let r = cp(&["delete", "--name", "a b"], &img).fails_one_line(2);
    assert!(r.stderr.contains("invalid checkpoint name"), "{}", r.stderr);
    let r = cp(&["create", "--name", "a"], &img).fails_one_line(1);
    assert!(r.stderr.contains("'a' exists"), "{}", r.stderr);
    let r = cp(&["delete", "--name", "b"], &img).fails_one_line(1);
    assert!(
        r.stderr.contains("no checkpoint named 'b' (there are: a)"),
        "{}",
        r.stderr
    );
    // delete needs --name.
    cp(&["delete"], &img).fails_one_line(2);
    run_rawdisk(&["checkpoint", "list"]).fails_one_line(2);
    // A target never tracked has nothing to delete.
    let other = d.path().join("other.img");
    std::fs::File::create(&other).unwrap().set_len(MIB).unwrap();
    let r = cp(&["delete", "--name", "a"], &other).fails_one_line(1);
    assert!(r.stderr.contains("has no checkpoints yet"), "{}", r.stderr);
    let r = cp(&["create"], &d.path().join("missing.img")).fails_one_line(1);
    assert!(r.stderr.contains("missing.img"), "{}", r.stderr);
    let r = run_rawdisk(&["checkpoint", "list", "nbd://localhost/x"]).fails_one_line(1);
    assert!(
        r.stderr.contains("NBD URIs are not accepted"),
        "{}",
        r.stderr
    );
    // Still only the one checkpoint.
    assert_eq!(cp(&["list"], &img).ok().stdout.lines().count(), 1);
}

#[test]
fn state_dir_holds_the_state_file() {
    let d = tempdir();
    let img = image(d.path());
    let sd = d.path().join("state");
    std::fs::create_dir(&sd).unwrap();
    let dir = sd.to_str().unwrap();
    let r = cp(
        &["create", "--state-dir", "/nonexistent-dir", "--name", "s"],
        &img,
    );
    let r = r.fails_one_line(1);
    assert!(
        r.stderr.contains("does not exist: create it"),
        "{}",
        r.stderr
    );
    cp(&["create", "--state-dir", dir, "--name", "s"], &img).ok();
    assert!(sd.join("disk.img.rawdisk-cbt").exists());
    assert!(!d.path().join("disk.img.rawdisk-cbt").exists());
    assert_eq!(cp(&["list"], &img).ok().stdout, "");
    assert!(cp(&["list", "--state-dir", dir], &img)
        .ok()
        .stdout
        .starts_with("s  "));
    cp(&["delete", "--state-dir", dir, "--name", "s"], &img).ok();
    assert_eq!(cp(&["list", "--state-dir", dir], &img).ok().stdout, "");
}

/// A write to the target while nothing tracked it makes the older
/// checkpoints inconsistent, said in the listing and on stderr; a new
/// checkpoint is consistent.
#[test]
fn outside_write_is_listed_as_inconsistent() {
    let d = tempdir();
    let img = image(d.path());
    cp(&["create", "--name", "before"], &img).ok();
    // Past the file system's timestamp granularity.
    std::thread::sleep(std::time::Duration::from_millis(30));
    rawdisk_testkit::write_at(&img, 3 * MIB, b"changed behind its back");
    let r = cp(&["list"], &img).ok();
    assert_eq!(
        r.stdout
            .split_whitespace()
            .skip(3)
            .collect::<Vec<_>>()
            .join(" "),
        "inconsistent (the target was modified while it was not tracked)"
    );
    assert!(r.stderr.contains("inconsistent"), "{}", r.stderr);
    let j = cp(&["list", "--output", "json"], &img).ok().json();
    assert_eq!(j[0]["consistent"], false);
    assert_eq!(
        j[0]["reason"],
        "the target was modified while it was not tracked"
    );
    cp(&["create", "--name", "after"], &img).ok();
    let j = cp(&["list", "--output", "json"], &img).ok().json();
    assert_eq!(j[0]["consistent"], false);
    assert_eq!(j[1]["consistent"], true);
    assert_eq!(
        rawdisk_testkit::read_range(&img, 3 * MIB, 23),
        b"changed behind its back"
    );
}

/// While a tracker (standing in for `serve --track-changes`) holds the
/// target, the command edits the state file under its lock: the tracker
/// sees the new checkpoint at its next refresh, with the marks it had not
/// persisted; nothing is called inconsistent while it is alive, everything
/// once it dies without closing.
#[test]
fn commands_work_while_a_tracker_holds_the_target() {
    use rawdisk_storage::cbt::{TrackOptions, Tracker};
    let d = tempdir();
    let img = image(d.path());
    let g = 64 << 10;
    let tr = Tracker::open(&img, 8 * MIB, &TrackOptions::default()).unwrap();
    cp(&["create", "--name", "a"], &img).ok();
    tr.refresh().unwrap();
    tr.mark(0, 1);
    tr.persist().unwrap();
    tr.mark(5 * g, 1);
    cp(&["create", "--name", "b"], &img).ok();
    tr.refresh().unwrap();
    let runs = tr.changed("b", 0, 8 * MIB, 10).unwrap();
    assert_eq!(
        runs,
        vec![(5 * g, false), (g, true), (8 * MIB - 6 * g, false)]
    );
    let r = cp(&["list"], &img).ok();
    assert_eq!(r.stdout.matches(" consistent\n").count(), 2, "{}", r.stdout);
    assert_eq!(r.stderr, "");
    cp(&["delete", "--name", "a"], &img).ok();
    tr.refresh().unwrap();
    assert_eq!(tr.checkpoints().len(), 1);
    // Killed: the open flag stays, the kernel drops the lock. A child of a
    // test running beside this one, forked but not yet exec'd, briefly
    // shares the descriptor and so the lock: wait for it to go.
    tr.abandon();
    let sf = rawdisk_storage::cbt::StateFile::open(&img, None, false).unwrap();
    let t0 = std::time::Instant::now();
    while sf.served().unwrap() {
        assert!(
            t0.elapsed().as_secs() < 10,
            "the served lock outlived its tracker"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let j = cp(&["list", "--output", "json"], &img).ok().json();
    assert_eq!(j[0]["name"], "b");
    assert_eq!(j[0]["consistent"], false);
    assert_eq!(
        j[0]["reason"],
        "the tracking server did not shut down cleanly (crash or kill)"
    );
}
