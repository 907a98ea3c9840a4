//! Bad command lines: one line on stderr, exit 2, nothing created.

mod common;
use common::*;

#[test]
fn bad_arguments_give_one_line_and_exit_2() {
    let d = tempdir();
    let img = d.path().join("x.img");
    let img_s = img.to_str().unwrap();
    let cases: Vec<Vec<&str>> = vec![
        vec!["create", img_s, "10Q"],
        vec!["create", img_s, "1.2.3G"],
        vec!["create", img_s, "-5"],
        vec!["create", img_s],
        vec!["create", "--preallocation", "metadata", img_s, "1M"],
        vec!["create", "--cache", "unsafe", img_s, "1M"],
        vec!["create", "-f", "qcow2", img_s, "1M"],
        vec!["create", "--no-such-flag", img_s, "1M"],
        vec!["create", img_s, "1M", "extra"],
        vec!["probe", "--output", "xml", img_s],
        vec!["probe"],
        vec!["map", "--output", "yaml", img_s],
        vec!["info", "--output", "text", img_s],
        vec!["map"],
    ];
    for args in cases {
        let r = run_rawdisk(&args);
        assert_eq!(r.code, 2, "{args:?}: stderr={:?}", r.stderr);
        assert_eq!(r.stderr.lines().count(), 1, "{args:?}: {:?}", r.stderr);
        assert!(r.stdout.is_empty(), "{args:?}: stdout {:?}", r.stdout);
        assert!(!img.exists(), "{args:?} created the file");
    }
}

#[test]
fn run_errors_give_one_line_and_exit_1() {
    let d = tempdir();
    let missing = d.path().join("missing.img");
    for cmd in ["info", "map", "probe"] {
        let r = run_rawdisk(&[cmd, missing.to_str().unwrap()]).fails_one_line(1);
        assert!(r.stderr.contains("No such file"), "{cmd}: {}", r.stderr);
    }
    // A directory is neither a file nor a device.
    let r = run_rawdisk(&["create", d.path().to_str().unwrap(), "1M"]).fails_one_line(1);
    assert!(
        r.stderr.contains("not a regular file or block device"),
        "{}",
        r.stderr
    );
    let r = run_rawdisk(&["probe", d.path().to_str().unwrap()]).fails_one_line(1);
    assert!(
        r.stderr.contains("not a regular file or block device"),
        "{}",
        r.stderr
    );
    // A parent directory that does not exist.
    let r = run_rawdisk(&[
        "create",
        d.path().join("no/such/dir.img").to_str().unwrap(),
        "1M",
    ])
    .fails_one_line(1);
    assert!(r.stderr.contains("No such file"), "{}", r.stderr);
    // An NBD URI nobody listens on.
    let sock = d.path().join("nobody.sock");
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    run_rawdisk(&["info", &uri]).fails_one_line(1);
    run_rawdisk(&["map", &uri]).fails_one_line(1);
}

/// clap's detail survives the flattening to one line, and the hint names the
/// help of the subcommand being typed.
#[test]
fn usage_errors_keep_the_detail() {
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["copy"],
            &["<SOURCE>", "<DESTINATION>", "(see 'rawdisk copy --help')"],
        ),
        (
            &["info", "--output", "jsn", "x.img"],
            &["human, json", "'json'", "(see 'rawdisk info --help')"],
        ),
        (
            &["serve", "--read-onyl", "x.img"],
            &["'--read-only'", "(see 'rawdisk serve --help')"],
        ),
        (&["mapp", "x.img"], &["'map'", "(see 'rawdisk --help')"]),
    ];
    for (args, wants) in cases {
        let r = run_rawdisk(args).fails_one_line(2);
        for want in *wants {
            assert!(
                r.stderr.contains(want),
                "{args:?}: {want} in {:?}",
                r.stderr
            );
        }
    }
}

/// The cause is said once, and the object once, in every command.
#[test]
fn causes_and_objects_said_once() {
    let d = tempdir();
    let missing = d.path().join("nosuch.img");
    let m = missing.to_str().unwrap();
    let dst = d.path().join("dst.img");
    let dst = dst.to_str().unwrap();
    let cmds: Vec<Vec<&str>> = vec![
        vec!["serve", m],
        vec!["info", m],
        vec!["map", m],
        vec!["probe", m],
        vec!["copy", m, dst],
        vec!["checksum", m],
        vec!["resize", m, "1M"],
    ];
    for args in &cmds {
        let r = run_rawdisk(args).fails_one_line(1);
        assert_eq!(
            r.stderr.matches("No such file or directory").count(),
            1,
            "{args:?}: {:?}",
            r.stderr
        );
        assert_eq!(r.stderr.matches(m).count(), 1, "{args:?}: {:?}", r.stderr);
    }
    let uri = format!("nbd+unix:///?sock={}", d.path().join("s").display());
    for args in [
        vec!["info", uri.as_str()],
        vec!["map", uri.as_str()],
        vec!["copy", uri.as_str(), dst],
        vec!["checksum", uri.as_str()],
    ] {
        // A malformed URI is a bad command line.
        let r = run_rawdisk(&args).fails_one_line(2);
        assert_eq!(
            r.stderr.matches(&uri).count(),
            1,
            "{args:?}: {:?}",
            r.stderr
        );
        assert!(
            r.stderr.contains("did you mean \"socket\"?"),
            "{args:?}: {:?}",
            r.stderr
        );
    }
}

/// `10GB` and `5MB` are refused (qemu-img refuses them) with the forms that
/// are accepted; a negative size reaches the size parser and is named so.
#[test]
fn decimal_looking_and_negative_sizes_refused() {
    let d = tempdir();
    let img = d.path().join("x.img");
    let img_s = img.to_str().unwrap();
    for (args, want) in [
        (vec!["create", img_s, "10GB"], "write 10G or 10GiB"),
        (vec!["create", img_s, "5MB"], "write 5M or 5MiB"),
        (vec!["resize", img_s, "5MB"], "write 5M or 5MiB"),
        (vec!["create", img_s, "-5M"], "negative size"),
        (vec!["serve", "--create", "-5M", img_s], "negative size"),
        (vec!["copy", "-S", "-4K", img_s, img_s], "negative size"),
    ] {
        let r = run_rawdisk(&args).fails_one_line(2);
        assert!(r.stderr.contains(want), "{args:?}: {:?}", r.stderr);
        assert!(!img.exists(), "{args:?} created the file");
    }
    // The binary spellings stay accepted.
    run_rawdisk(&["create", img_s, "64KiB"]).ok();
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 65536);
}

/// The same mistake gets the same words in every command: an NBD URI where
/// only a local target makes sense, and a directory.
#[test]
fn same_mistake_same_words() {
    let d = tempdir();
    let uri = format!("nbd+unix:///?socket={}", d.path().join("s").display());
    for args in [
        vec!["create", uri.as_str(), "1M"],
        vec!["probe", uri.as_str()],
        vec!["resize", uri.as_str(), "1M"],
        vec!["serve", uri.as_str()],
    ] {
        let r = run_rawdisk(&args).fails_one_line(1);
        assert!(
            r.stderr.contains("NBD URIs are not accepted here"),
            "{args:?}: {:?}",
            r.stderr
        );
    }
    let dir = d.path().join("dir");
    std::fs::create_dir(&dir).unwrap();
    let dir = dir.to_str().unwrap();
    let file = d.path().join("f.img");
    std::fs::write(&file, b"data").unwrap();
    let file = file.to_str().unwrap();
    for args in [
        vec!["info", dir],
        vec!["map", dir],
        vec!["probe", dir],
        vec!["copy", dir, file],
        vec!["copy", file, dir],
        vec!["checksum", dir],
        vec!["compare", dir, file],
        vec!["serve", dir],
        vec!["serve", "--create", "1M", dir],
        vec!["create", dir, "1M"],
        vec!["resize", dir, "1M"],
    ] {
        // compare keeps cmp's codes: 1 means "different", 2 an error.
        let code = if args[0] == "compare" { 2 } else { 1 };
        let r = run_rawdisk(&args).fails_one_line(code);
        assert!(
            r.stderr.contains("not a regular file or block device"),
            "{args:?}: {:?}",
            r.stderr
        );
    }
    assert_eq!(std::fs::read(file).unwrap(), b"data");
}

/// A file the user may not write, served without --read-only: the error says
/// so and names the flag. Root ignores the mode bits, so for root the file is
/// made immutable instead (EPERM).
#[test]
fn read_only_file_served_suggests_read_only() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempdir();
    let img = d.path().join("ro.img");
    std::fs::write(&img, vec![7u8; 4096]).unwrap();
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o444)).unwrap();
    let img_s = img.to_str().unwrap();
    let root = rawdisk_testkit::is_root();
    if root {
        tool("chattr", &["+i", img_s]);
    }
    let r = run_rawdisk(&["serve", img_s]);
    if root {
        tool("chattr", &["-i", img_s]);
    }
    let r = r.fails_one_line(1);
    assert!(
        r.stderr.contains("serve it with --read-only"),
        "{:?}",
        r.stderr
    );
    assert_eq!(r.stderr.matches("os error").count(), 1, "{:?}", r.stderr);
    assert_eq!(std::fs::read(&img).unwrap(), vec![7u8; 4096]);
}

/// `-f raw` as qemu-img users type it, on every command that takes an image
/// (and -O raw in copy, -F raw for compare's second image); any other format
/// is refused with the one accepted.
#[test]
fn format_raw_accepted_others_refused() {
    let d = tempdir();
    let src = d.path().join("s.img");
    std::fs::write(&src, vec![9u8; 65536]).unwrap();
    let src = src.to_str().unwrap();
    let dst = d.path().join("d.img");
    let dst_s = dst.to_str().unwrap();
    run_rawdisk(&["info", "-f", "raw", src]).ok();
    run_rawdisk(&["map", "-f", "raw", src]).ok();
    run_rawdisk(&["copy", "-q", "-f", "raw", "-O", "raw", src, dst_s]).ok();
    assert_eq!(std::fs::read(&dst).unwrap(), vec![9u8; 65536]);
    run_rawdisk(&["checksum", "-f", "raw", src]).ok();
    let r = run_rawdisk(&["compare", "-f", "raw", "-F", "raw", src, dst_s]).ok();
    assert_eq!(r.stdout, "Images are identical.\n");
    run_rawdisk(&["resize", "-q", "--format", "raw", dst_s, "+4K"]).ok();
    let mut want = vec![9u8; 65536];
    want.resize(65536 + 4096, 0);
    assert_eq!(std::fs::read(&dst).unwrap(), want);
    std::fs::remove_file(&dst).unwrap();
    for args in [
        vec!["info", "-f", "qcow2", src],
        vec!["map", "--format", "vmdk", src],
        vec!["copy", "-f", "qcow2", src, dst_s],
        vec!["copy", "-O", "qcow2", src, dst_s],
        vec!["checksum", "-f", "qcow2", src],
        vec!["compare", "-f", "qcow2", src, src],
        vec!["compare", "-F", "vmdk", src, src],
        vec!["resize", "-f", "qcow2", src, "+1M"],
        vec!["serve", "-f", "qcow2", "--socket", dst_s, src],
    ] {
        let r = run_rawdisk(&args).fails_one_line(2);
        assert!(
            r.stderr.contains("[possible values: raw]"),
            "{args:?}: {:?}",
            r.stderr
        );
    }
    assert!(!dst.exists());
}

/// Every command the README's table lists is in `rawdisk --help`, and the
/// README's tagline names no command that does not exist.
#[test]
fn help_lists_the_readme_commands() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let help = run_rawdisk(&["--help"]).ok().stdout;
    let listed: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let documented: Vec<&str> = readme
        .lines()
        .filter_map(|l| l.strip_prefix("| `rawdisk "))
        .filter_map(|l| l.split([' ', '`']).next())
        .collect();
    assert!(documented.len() >= 9, "{documented:?}");
    for c in &documented {
        assert!(
            listed.contains(c),
            "README's {c} missing from --help: {listed:?}"
        );
        // Each command's help ends with examples of itself.
        let h = run_rawdisk(&[c, "--help"]).ok().stdout;
        let want = format!("Examples:\n  rawdisk {c} ");
        assert!(h.contains(&want), "{c} --help has no examples: {h}");
    }
    let tagline = readme.lines().nth(2).unwrap();
    for word in tagline.split([',', ' ']).filter(|w| w.len() > 2) {
        let w = word.to_ascii_lowercase();
        let verbish = ["zero", "trim", "discard", "convert", "check"];
        assert!(
            !verbish.contains(&w.as_str()) || listed.contains(&w.as_str()),
            "README tagline names '{w}', which is no command: {tagline}"
        );
    }
}
