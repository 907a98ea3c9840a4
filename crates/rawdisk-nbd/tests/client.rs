//! The NBD client against real servers (nbdkit's file plugin and qemu-nbd,
//! started on Unix sockets in private temp dirs): handshake, every command,
//! sparse reads, block status, multi-conn, and that server errors and a dying
//! server reach the caller.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rawdisk_nbd::client::{Client, ConnectOptions, Error, ZeroFlags};
use rawdisk_nbd::uri::NbdUri;
use rawdisk_testkit::NbdServer;

/// The reference servers (testkit) as this crate's URI type.
fn uri(s: &NbdServer) -> NbdUri {
    NbdUri::parse(&s.uri()).unwrap()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn pattern(off: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (off + i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (x >> 56) as u8 | 1
        })
        .collect()
}

/// A sparse file: data at [64K, 192K) and [1M, 1M+5), size not a multiple of 512.
fn sparse_image(dir: &Path) -> (PathBuf, Vec<u8>) {
    let size = 2 * 1024 * 1024 + 777;
    let mut want = vec![0u8; size];
    want[65536..196608].copy_from_slice(&pattern(65536, 131072));
    want[1 << 20..(1 << 20) + 5].copy_from_slice(b"hello");
    want[size - 3..].copy_from_slice(b"end");
    let p = dir.join("img.raw");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(size as u64).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&want[65536..196608], 65536).unwrap();
    f.write_all_at(b"hello", 1 << 20).unwrap();
    f.write_all_at(b"end", size as u64 - 3).unwrap();
    (p, want)
}

/// Compares without printing megabytes: names the first differing offset.
#[track_caller]
fn same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at offset {i}: {} != {}",
            got[i], want[i]
        );
    }
}

/// qemu-nbd exports a raw file rounded up to 512 bytes; the tail reads as zeros.
fn exported(name: &str, want: &[u8]) -> Vec<u8> {
    let mut w = want.to_vec();
    if name == "qemu-nbd" {
        w.resize(want.len().div_ceil(512) * 512, 0);
    }
    w
}

async fn read_all(c: &Client) -> Vec<u8> {
    let mut out = Vec::new();
    let mut off = 0;
    while off < c.size() {
        let n = (c.size() - off).min(1 << 20) as usize;
        out.extend(c.read(off, n).await.unwrap());
        off += n as u64;
    }
    out
}

fn server(kind: &str, file: &Path) -> NbdServer {
    match kind {
        "nbdkit" => NbdServer::nbdkit(file, &[], &[]),
        _ => NbdServer::qemu_nbd(file),
    }
}

fn servers(file: &Path) -> Vec<(&'static str, NbdServer)> {
    vec![
        ("nbdkit", NbdServer::nbdkit(file, &[], &[])),
        ("qemu-nbd", NbdServer::qemu_nbd(file)),
    ]
}

#[test]
fn handshake_read_write_zero_trim_flush() {
    for name in ["nbdkit", "qemu-nbd"] {
        let dir = tempfile::tempdir().unwrap();
        let (img, want) = sparse_image(dir.path());
        let srv = server(name, &img);
        let want = rt().block_on(async {
            let c = Client::connect(&uri(&srv), &ConnectOptions::default())
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let i = c.info().clone();
            let mut want = exported(name, &want);
            assert_eq!(i.size, want.len() as u64, "{name}");
            assert!(i.structured_replies, "{name}");
            // qemu-nbd ≥ 8.2 offers extended headers; nbdkit 1.32 does not.
            assert_eq!(i.extended_headers, name == "qemu-nbd", "{name}");
            assert!(
                i.can_zero() && i.can_flush(),
                "{name}: {:?}",
                i.flag_names()
            );
            assert_eq!(i.meta_context.as_deref(), Some("base:allocation"), "{name}");
            same(&read_all(&c).await, &want, &format!("{name}: initial read"));

            // Unaligned write in the middle of a hole, then read around it.
            let data = pattern(300_001, 70_000);
            c.write(300_001, &data, false).await.unwrap();
            want[300_001..370_001].copy_from_slice(&data);
            // Zero inside the data run, with and without NO_HOLE.
            c.zero(70_000, 10_000, ZeroFlags::default()).await.unwrap();
            want[70_000..80_000].fill(0);
            c.zero(
                100_000,
                4096,
                ZeroFlags {
                    no_hole: true,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
            want[100_000..104_096].fill(0);
            c.write(0, b"first", true).await.unwrap();
            want[..5].copy_from_slice(b"first");
            c.flush().await.unwrap();
            same(&read_all(&c).await, &want, &format!("{name}: after writes"));
            if i.can_trim() {
                // Trim leaves the contents unspecified: only check it succeeds.
                c.trim(1 << 20, 4096, false).await.unwrap();
                c.write(1 << 20, &want[1 << 20..(1 << 20) + 4096], false)
                    .await
                    .unwrap();
            }
            c.disconnect().await.unwrap();
            want
        });
        let file = std::fs::read(&img).unwrap();
        same(
            &file,
            &want[..file.len()],
            &format!("{name}: file after disconnect"),
        );
    }
}

#[test]
fn block_status_matches_the_file_layout() {
    let dir = tempfile::tempdir().unwrap();
    let (img, want) = sparse_image(dir.path());
    for (name, srv) in servers(&img) {
        let want = exported(name, &want);
        rt().block_on(async {
            let c = Client::connect(&uri(&srv), &ConnectOptions::default())
                .await
                .unwrap();
            let mut off = 0;
            let mut runs = Vec::new();
            while off < c.size() {
                let v = c.block_status(off, c.size() - off).await.unwrap();
                for d in v {
                    let len = d.len.min(c.size() - off);
                    runs.push((off, len, d.is_zero()));
                    off += len;
                    if off >= c.size() {
                        break;
                    }
                }
            }
            // Every range reported zero must read as zero; the data must be
            // inside ranges not reported zero.
            for (o, l, z) in &runs {
                if *z {
                    let s = &want[*o as usize..(*o + *l) as usize];
                    assert!(s.iter().all(|&b| b == 0), "{name}: {o}+{l} reported zero");
                }
            }
            let zero_at = |x: u64| runs.iter().any(|(o, l, z)| *z && *o <= x && x < o + l);
            assert!(!zero_at(65536) && !zero_at(1 << 20), "{name}: {runs:?}");
            assert!(
                zero_at(1 << 19),
                "{name}: the hole at 512K is not reported: {runs:?}"
            );
        });
    }
}

#[test]
fn many_requests_in_flight_and_multi_conn() {
    let dir = tempfile::tempdir().unwrap();
    let size = 8 << 20;
    let img = dir.path().join("img.raw");
    std::fs::write(&img, vec![0u8; size]).unwrap();
    for (name, srv) in servers(&img) {
        rt().block_on(async {
            let opts = ConnectOptions {
                connections: 4,
                ..Default::default()
            };
            let c = Arc::new(Client::connect(&uri(&srv), &opts).await.unwrap());
            if c.info().can_multi_conn() {
                assert_eq!(c.info().connections, 4, "{name}");
            } else {
                assert_eq!(c.info().connections, 1, "{name}");
            }
            write_blocks(&c, 128, true).await;
            c.flush().await.unwrap();
            c.disconnect().await.unwrap();
        });
        file_holds_blocks(&img, 128, name);
        std::fs::write(&img, vec![0u8; size]).unwrap();
    }
}

/// `connect_early` returns after the first handshake; the extra connections
/// join while it works, and those a connection cap refuses are left out
/// (`connect` fails on them instead, for the caller to ask for fewer).
#[test]
fn extra_connections_join_late_and_a_cap_leaves_them_out() {
    let dir = tempfile::tempdir().unwrap();
    let size = 4 << 20;
    let img = dir.path().join("img.raw");
    std::fs::write(&img, vec![0u8; size]).unwrap();
    let opts = ConnectOptions {
        connections: 4,
        ..Default::default()
    };
    for (cap, want) in [(None, 4), (Some("limit=2"), 2)] {
        let srv = match cap {
            Some(p) => NbdServer::nbdkit(&img, &["--filter=limit"], &[p]),
            None => NbdServer::nbdkit(&img, &[], &[]),
        };
        rt().block_on(async {
            let c = Arc::new(Client::connect_early(&uri(&srv), &opts).await.unwrap());
            assert_eq!(c.info().connections, 1, "{cap:?}");
            write_blocks(&c, 64, false).await;
            let t = Instant::now();
            while c.connections() < want && t.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // Joined connections carry requests: reads and writes on all.
            for i in 0..64u64 {
                let off = i * 65536;
                same(
                    &c.read(off, 65536).await.unwrap(),
                    &pattern(off, 65536),
                    "read",
                );
            }
            c.flush().await.unwrap();
            c.disconnect().await.unwrap();
            assert_eq!(c.connections(), want, "{cap:?}");
            if cap.is_some() {
                // The server needs a moment to free the slots.
                tokio::time::sleep(Duration::from_millis(200)).await;
                let e = Client::connect(&uri(&srv), &opts).await.unwrap_err();
                assert!(
                    matches!(e, Error::Handshake { .. } | Error::Connect { .. }),
                    "{e:?}"
                );
            }
        });
        file_holds_blocks(&img, 64, &format!("{cap:?}"));
    }
}

/// Writes `blocks` 64 KiB blocks of [`pattern`] at once, each its own
/// request (and reads each back after its write when `read_back`).
async fn write_blocks(c: &Arc<Client>, blocks: u64, read_back: bool) {
    let mut set = tokio::task::JoinSet::new();
    for i in 0..blocks {
        let c = c.clone();
        set.spawn(async move {
            let off = i * 65536;
            c.write(off, &pattern(off, 65536), false).await.unwrap();
            if read_back {
                let back = c.read(off, 65536).await.unwrap();
                assert!(back == pattern(off, 65536), "read back at {off}");
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
}

/// The file holds what [`write_blocks`] wrote.
#[track_caller]
fn file_holds_blocks(img: &Path, blocks: u64, what: &str) {
    let got = std::fs::read(img).unwrap();
    for i in 0..blocks {
        let off = i * 65536;
        same(&got[off as usize..][..65536], &pattern(off, 65536), what);
    }
}

#[test]
fn server_errors_reach_the_caller() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = sparse_image(dir.path());
    // Every pread fails with EIO.
    let srv = NbdServer::nbdkit(
        &img,
        &["--filter=error"],
        &["error=EIO", "error-pread-rate=1"],
    );
    rt().block_on(async {
        let c = Client::connect(&uri(&srv), &ConnectOptions::default())
            .await
            .unwrap();
        let e = c.read(65536, 4096).await.unwrap_err();
        assert!(matches!(e, Error::Server { errno: 5, .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("read at offset 65536 length 4096") && msg.contains("EIO"),
            "{msg}"
        );
        // The connection survives a failed request.
        c.write(0, b"x", false).await.unwrap();
    });
}

#[test]
fn dead_server_fails_every_request_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = sparse_image(dir.path());
    // Slow reads so requests are in flight when the server dies.
    let mut srv = NbdServer::nbdkit(&img, &["--filter=delay"], &["delay-read=2"]);
    rt().block_on(async {
        let c = Arc::new(
            Client::connect(&uri(&srv), &ConnectOptions::default())
                .await
                .unwrap(),
        );
        let mut set = tokio::task::JoinSet::new();
        for i in 0..8u64 {
            let c = c.clone();
            set.spawn(async move { c.read(i * 4096, 4096).await });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        srv.child.kill().unwrap();
        let t0 = Instant::now();
        let mut failed = 0;
        while let Some(r) = set.join_next().await {
            let e = r.unwrap().unwrap_err();
            assert!(matches!(e, Error::Connection { .. }), "{e}");
            failed += 1;
        }
        assert_eq!(failed, 8);
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "took {:?}",
            t0.elapsed()
        );
        // And new requests fail at once instead of hanging.
        let e = c.read(0, 512).await.unwrap_err();
        assert!(e.to_string().contains("connection lost"), "{e}");
    });
}

#[test]
fn unknown_export_and_no_server_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = sparse_image(dir.path());
    let srv = NbdServer::qemu_nbd(&img);
    rt().block_on(async {
        let mut u = uri(&srv);
        u.export = "nope".into();
        let e = Client::connect(&u, &ConnectOptions::default())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        let u = NbdUri::parse(&format!(
            "nbd+unix:///?socket={}",
            dir.path().join("missing.sock").display()
        ))
        .unwrap();
        let e = Client::connect(&u, &ConnectOptions::default())
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Connect { .. }), "{e}");
    });
}

#[test]
fn without_structured_replies_or_extended_headers() {
    let dir = tempfile::tempdir().unwrap();
    let (img, want) = sparse_image(dir.path());
    for (name, srv) in servers(&img) {
        for (ext, sr) in [(false, true), (false, false)] {
            rt().block_on(async {
                let opts = ConnectOptions {
                    extended_headers: ext,
                    structured_replies: sr,
                    ..Default::default()
                };
                let c = Client::connect(&uri(&srv), &opts).await.unwrap();
                assert_eq!(c.info().structured_replies, sr, "{name}");
                assert!(!c.info().extended_headers);
                same(
                    &read_all(&c).await,
                    &exported(name, &want),
                    &format!("{name} structured={sr}"),
                );
                c.disconnect().await.unwrap();
            });
        }
    }
}

#[test]
fn blocking_facade() {
    let dir = tempfile::tempdir().unwrap();
    let (img, want) = sparse_image(dir.path());
    let srv = NbdServer::nbdkit(&img, &[], &[]);
    let c = rawdisk_nbd::client::blocking::Client::connect(&uri(&srv), &ConnectOptions::default())
        .unwrap();
    let mut buf = vec![0u8; want.len()];
    c.read_at(&mut buf, 0).unwrap();
    same(&buf, &want, "blocking read");
    c.disconnect().unwrap();
}

fn signal(srv: &NbdServer, sig: &str) {
    let st = std::process::Command::new("kill")
        .args([sig, &srv.child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn request_timeout_abandons_a_server_that_stops_answering() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.raw");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    let srv = NbdServer::qemu_nbd(&img);
    let limit = Duration::from_millis(800);
    rt().block_on(async {
        let opts = ConnectOptions {
            connections: 2,
            request_timeout: Some(limit),
            ..Default::default()
        };
        let c = Arc::new(Client::connect(&uri(&srv), &opts).await.unwrap());
        c.write(0, &pattern(0, 4096), false).await.unwrap();
        // Idle for longer than the limit: nothing was waiting, nothing ends.
        tokio::time::sleep(limit * 2).await;
        same(
            &c.read(0, 4096).await.unwrap(),
            &pattern(0, 4096),
            "after idle",
        );
        // Stopped: big writes fill the socket and block in send, small
        // reads wait for replies; all must fail once the limit passes.
        signal(&srv, "-STOP");
        let t0 = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for i in 0..8u64 {
            let w = c.clone();
            set.spawn(async move {
                let data = vec![0xa5u8; 16 << 20];
                w.write(i * (16 << 20), &data, false).await
            });
            let r = c.clone();
            set.spawn(async move { r.read(i * 4096, 4096).await.map(|_| ()) });
        }
        while let Some(r) = set.join_next().await {
            let e = r.unwrap().unwrap_err();
            assert!(matches!(e, Error::Connection { .. }), "{e}");
            assert!(e.to_string().contains("did not answer for 800ms"), "{e}");
        }
        let took = t0.elapsed();
        assert!(took >= limit && took < limit * 3, "{took:?}");
        let e = c.read(0, 512).await.unwrap_err();
        assert!(e.to_string().contains("connection lost"), "{e}");
    });
    signal(&srv, "-CONT");
}

#[test]
fn request_timeout_counts_silence_not_busy_time() {
    let dir = tempfile::tempdir().unwrap();
    let (img, want) = sparse_image(dir.path());
    // Each read is answered after 300 ms; two are always in flight, staggered,
    // so the connection is busy far longer than the limit but the server is
    // never silent that long.
    let srv = NbdServer::nbdkit(&img, &["--filter=delay"], &["delay-read=300ms"]);
    rt().block_on(async {
        let opts = ConnectOptions {
            request_timeout: Some(Duration::from_millis(700)),
            ..Default::default()
        };
        let c = Arc::new(Client::connect(&uri(&srv), &opts).await.unwrap());
        let t0 = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        let read = |i: u64| {
            let c = c.clone();
            async move { (i, c.read(i * 4096, 4096).await) }
        };
        set.spawn(read(0));
        tokio::time::sleep(Duration::from_millis(150)).await;
        set.spawn(read(1));
        let mut next = 2;
        while let Some(r) = set.join_next().await {
            let (i, got) = r.unwrap();
            let got = got.unwrap_or_else(|e| panic!("read {i} after {:?}: {e}", t0.elapsed()));
            same(&got, &want[i as usize * 4096..][..4096], "slow read");
            if next < 8 {
                set.spawn(read(next));
                next += 1;
            }
        }
        assert!(t0.elapsed() > Duration::from_millis(1200));
    });
}

#[test]
fn a_handshake_cut_short_is_dropped_a_silent_one_times_out() {
    use std::os::unix::net::UnixListener;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let l = UnixListener::bind(&sock).unwrap();
    let u = NbdUri::parse(&format!("nbd+unix:///?socket={}", sock.display())).unwrap();
    // Accepts and closes at once: a server that died in the handshake.
    let closer = std::thread::spawn(move || {
        let (c, _) = l.accept().unwrap();
        drop(c);
        l
    });
    let e = rt()
        .block_on(Client::connect(&u, &ConnectOptions::default()))
        .unwrap_err();
    assert!(e.is_dropped(), "{e:?}");
    assert!(e.to_string().contains("closed the connection"), "{e}");
    // Never answers (the listener is not even accepting): the handshake's
    // bound applies.
    let _l = closer.join().unwrap();
    let opts = ConnectOptions {
        timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let t0 = Instant::now();
    let e = rt().block_on(Client::connect(&u, &opts)).unwrap_err();
    assert!(matches!(e, Error::Connect { .. }), "{e:?}");
    assert!(e.to_string().contains("timed out"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2));
}
