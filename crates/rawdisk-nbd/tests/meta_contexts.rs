//! Metadata contexts beyond `base:allocation`, against qemu-nbd: a qcow2
//! image with a persistent dirty bitmap, exported with `-B NAME`, offers
//! `qemu:dirty-bitmap:NAME`. The client selects it next to base:allocation,
//! and the extents of each are checked against what made them: the bitmap
//! against the writes done after it was added, base:allocation against
//! `qemu-img map`.

use std::path::Path;

use rawdisk_nbd::client::{BlockStatus, Client, ConnectOptions, Error};
use rawdisk_nbd::uri::NbdUri;
use rawdisk_testkit::{run, NbdServer};

const SIZE: u64 = 8 << 20;
const GRANULARITY: u64 = 64 << 10;
const BITMAP: &str = "qemu:dirty-bitmap:b0";

/// Writes after the bitmap was added: (offset, length, byte; 0 = write zeroes).
const WRITES: [(u64, u64, u8); 5] = [
    (100 << 10, 10 << 10, 0x22),
    (1 << 20, 200 << 10, 0x33),
    (3 << 20, 128 << 10, 0),
    ((5 << 20) - 4096, 8192, 0x44),
    (SIZE - 512, 512, 0x55),
];

/// A qcow2 with data written before the bitmap (not in it) and [`WRITES`]
/// after it.
fn image(dir: &Path) -> std::path::PathBuf {
    let img = dir.join("img.qcow2");
    let s = img.to_str().unwrap();
    run(
        "qemu-img",
        ["create", "-q", "-f", "qcow2", s, &SIZE.to_string()],
    );
    run("qemu-io", ["-f", "qcow2", "-c", "write -P 0x11 0 2M", s]);
    run(
        "qemu-img",
        ["bitmap", "--add", "-g", &GRANULARITY.to_string(), s, "b0"],
    );
    for (off, len, byte) in WRITES {
        let c = if byte == 0 {
            format!("write -z {off} {len}")
        } else {
            format!("write -P {byte:#x} {off} {len}")
        };
        run("qemu-io", ["-f", "qcow2", "-c", &c, s]);
    }
    img
}

/// [`image`] served by qemu-nbd (the temp dir holds the image).
fn served() -> (tempfile::TempDir, NbdServer, NbdUri) {
    let dir = tempfile::tempdir().unwrap();
    let srv = qemu_nbd(&image(dir.path()));
    let uri = NbdUri::parse(&srv.uri()).unwrap();
    (dir, srv, uri)
}

fn qemu_nbd(img: &Path) -> NbdServer {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let mut c = std::process::Command::new("qemu-nbd");
    // Read-only: qemu then allows multi-conn, so each connection negotiates
    // its own context ids.
    c.args(["-f", "qcow2", "-r", "-t", "-e", "4", "-B", "b0", "-k"])
        .arg(&sock)
        .arg(img);
    NbdServer::spawn(c, dir, sock)
}

/// Every descriptor from 0 to `SIZE` as (offset, length, flags), asking in
/// pieces so a reply that covers less than asked is followed up.
async fn walk(c: &Client, context: Option<&str>) -> Vec<(u64, u64, u64)> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < SIZE {
        let v: Vec<BlockStatus> = match context {
            Some(name) => c.block_status_context(name, pos, SIZE - pos).await,
            None => c.block_status(pos, SIZE - pos).await,
        }
        .unwrap();
        assert!(!v.is_empty());
        for d in v {
            let len = d.len.min(SIZE - pos);
            if len == 0 {
                break;
            }
            out.push((pos, len, d.flags));
            pos += len;
        }
    }
    merge(out)
}

fn merge(v: Vec<(u64, u64, u64)>) -> Vec<(u64, u64, u64)> {
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for (o, l, f) in v {
        match out.last_mut() {
            Some(last) if last.2 == f && last.0 + last.1 == o => last.1 += l,
            _ => out.push((o, l, f)),
        }
    }
    out
}

/// The dirty runs [`WRITES`] make at the bitmap's granularity, as the
/// context's descriptors (1 = dirty).
fn expected_dirty() -> Vec<(u64, u64, u64)> {
    let chunks = SIZE / GRANULARITY;
    let mut dirty = vec![false; chunks as usize];
    for (off, len, _) in WRITES {
        for c in off / GRANULARITY..(off + len).div_ceil(GRANULARITY) {
            dirty[c as usize] = true;
        }
    }
    merge(
        dirty
            .iter()
            .enumerate()
            .map(|(i, &d)| (i as u64 * GRANULARITY, GRANULARITY, d as u64))
            .collect(),
    )
}

/// `qemu-img map --output=json` as base:allocation descriptors (hole 1,
/// zero 2). Its lines are flat objects; the fields needed are numbers and
/// booleans.
fn qemu_img_map(img: &Path) -> Vec<(u64, u64, u64)> {
    let out = run(
        "qemu-img",
        ["map", "-f", "qcow2", "--output=json", img.to_str().unwrap()],
    );
    let field = |line: &str, name: &str| -> String {
        let key = format!("\"{name}\":");
        let at = line
            .find(&key)
            .unwrap_or_else(|| panic!("{name} in {line}"))
            + key.len();
        line[at..]
            .trim_start()
            .split([',', '}'])
            .next()
            .unwrap()
            .trim()
            .to_string()
    };
    let v = out
        .lines()
        .filter(|l| l.contains("\"start\""))
        .map(|l| {
            let data = field(l, "data") == "true";
            let zero = field(l, "zero") == "true";
            let flags = if data { 0 } else { 1 } | if zero { 2 } else { 0 };
            (
                field(l, "start").parse().unwrap(),
                field(l, "length").parse().unwrap(),
                flags,
            )
        })
        .collect();
    merge(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dirty_bitmap_context_of_qemu_nbd() {
    let (dir, _srv, uri) = served();
    let want_map = qemu_img_map(&dir.path().join("img.qcow2"));
    // Extended headers (BLOCK_STATUS_EXT chunks) and structured replies only
    // (32-bit BLOCK_STATUS chunks).
    for extended in [true, false] {
        let opts = ConnectOptions {
            connections: 2,
            extended_headers: extended,
            extra_contexts: vec![BITMAP.to_string()],
            ..Default::default()
        };
        let c = Client::connect(&uri, &opts).await.unwrap();
        assert_eq!(c.info().extended_headers, extended);
        assert_eq!(c.info().contexts, vec![BITMAP.to_string()]);
        assert_eq!(c.info().connections, 2, "qemu-nbd -r allows multi-conn");
        assert_eq!(
            walk(&c, Some(BITMAP)).await,
            expected_dirty(),
            "dirty bitmap, extended={extended}"
        );
        // The same replies carry base:allocation: each call keeps its own.
        assert_eq!(
            walk(&c, None).await,
            want_map,
            "base:allocation, extended={extended}"
        );
        // A request inside a run starts at its offset.
        let v = c
            .block_status_context(BITMAP, 100 << 10, 4096)
            .await
            .unwrap();
        assert_eq!(v[0].flags, 1);
        assert!(v[0].len >= 4096, "{v:?}");
        // And the data the writes put there reads back.
        let got = c.read(100 << 10, 10 << 10).await.unwrap();
        assert!(got.iter().all(|&b| b == 0x22));
        let got = c.read((100 << 10) - 512, 512).await.unwrap();
        assert!(got.iter().all(|&b| b == 0x11));
        c.disconnect().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_the_server_does_not_offer_fails_the_connection() {
    let (_dir, _srv, uri) = served();
    for (name, hint) in [
        ("qemu:dirty-bitmap:nope", false),
        ("rawdisk:changed:c9", true),
    ] {
        let opts = ConnectOptions {
            extra_contexts: vec![name.to_string()],
            ..Default::default()
        };
        let e = Client::connect(&uri, &opts).await.unwrap_err();
        assert!(matches!(e, Error::NoContext { .. }), "{e:?}");
        let m = e.to_string();
        assert!(
            m.contains(&format!("does not offer metadata context {name}")),
            "{m}"
        );
        assert_eq!(m.contains("--track-changes"), hint, "{m}");
    }
    // Asking a connection for a context it did not select is refused
    // before anything is sent.
    let c = Client::connect(&uri, &ConnectOptions::default())
        .await
        .unwrap();
    let e = c.block_status_context(BITMAP, 0, 4096).await.unwrap_err();
    assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
    assert!(e.to_string().contains("was not selected"), "{e}");
    // The server is still fine after the refused handshakes.
    assert_eq!(c.read(0, 4).await.unwrap(), vec![0x11; 4]);
    c.disconnect().await.unwrap();
}
