//! `copy` end to end: file→file, file→NBD, NBD→file, NBD→NBD (nbdkit's file
//! plugin and qemu-nbd on Unix sockets in private temp dirs), block devices
//! both ways (root), sparse, dense and random images with sizes that are not
//! multiples of 512. Every byte is compared; destination allocation is
//! checked with and without `--allocated`; a server killed mid-copy and a
//! failing server end the copy with an error naming the side and offset;
//! verify catches a corrupted byte.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rawdisk_image::copy::{self, CopyError, CopyOptions, Side, ZeroMode};
use rawdisk_image::endpoint::Endpoint;
use rawdisk_testkit::{allocated_bytes, pattern, NbdServer, MIB};

// ---------------------------------------------------------------------------
// Fixtures

/// The reference servers come from the testkit; rawdisk's own from its binary.
fn server(kind: &str, file: &Path) -> NbdServer {
    match kind {
        "nbdkit" => NbdServer::nbdkit(file, &[], &[]),
        "qemu-nbd" => NbdServer::qemu_nbd(file),
        _ => NbdServer::rawdisk(&rawdisk_bin(), file),
    }
}

/// The `rawdisk` binary: RAWDISK_BIN (scripts/test.sh sets it), else the
/// one `cargo test --workspace` builds beside this test (same profile).
fn rawdisk_bin() -> std::path::PathBuf {
    if let Some(bin) = std::env::var_os("RAWDISK_BIN") {
        return bin.into();
    }
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/copy-HASH -> target/<profile>/rawdisk
    let bin = exe.parent().and_then(Path::parent).unwrap().join("rawdisk");
    assert!(
        bin.exists(),
        "no rawdisk binary at {}: set RAWDISK_BIN or build it (cargo build -p rawdisk)",
        bin.display()
    );
    bin
}

#[derive(Clone, Copy, Debug)]
enum Shape {
    /// Mostly holes, a few data runs (one holding zero blocks written out).
    Sparse,
    /// Fully allocated, patterned.
    Dense,
    /// Random data and random holes.
    Random(u64),
}

/// Builds a source image of `size` bytes; returns its expected contents.
fn make_image(path: &Path, size: u64, shape: Shape) -> Vec<u8> {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    let mut want = vec![0u8; size as usize];
    let mut put = |off: u64, len: u64, seed: u64| {
        let len = len.min(size - off.min(size));
        if len == 0 {
            return;
        }
        let r = off as usize..(off + len) as usize;
        pattern(seed, off, &mut want[r.clone()]);
        f.write_all_at(&want[r], off).unwrap();
    };
    match shape {
        Shape::Sparse => {
            put(0, 4096, 1);
            put(MIB + 512, 300_000, 2);
            put(3 * MIB, 64 * 1024, 3);
            put(size - 1000, 1000, 4);
            // Explicit zeros in an allocated run: the zero scan's job.
            f.write_all_at(&vec![0u8; 256 * 1024], 2 * MIB).unwrap();
        }
        Shape::Dense => put(0, size, 5),
        Shape::Random(seed) => {
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
            let mut off = 0;
            while off < size {
                let len = rng.gen_range(1..=400_000u64).min(size - off);
                match rng.gen_range(0..3) {
                    0 => {} // hole
                    1 => put(off, len, seed ^ off),
                    _ => f.write_all_at(&vec![0u8; len as usize], off).unwrap(),
                }
                off += len;
            }
        }
    }
    f.sync_all().unwrap();
    want
}

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

/// `e` is an I/O error of `side` whose message holds every one of `needles`.
fn assert_io_error(e: &CopyError, side: Side, needles: &[&str]) {
    let msg = e.to_string();
    assert!(
        matches!(e, CopyError::Io { side: s, .. } if *s == side),
        "{msg}"
    );
    for n in needles {
        assert!(msg.contains(n), "{n:?} missing from: {msg}");
    }
}

fn opts() -> CopyOptions {
    CopyOptions {
        requests: 8,
        connections: 2,
        ..Default::default()
    }
}

/// Size not a multiple of 512, for local and nbdkit tests.
const ODD: u64 = 5 * MIB + 333;
/// qemu-nbd rounds exports up to 512 bytes: its tests use a multiple.
const EVEN: u64 = 5 * MIB + 1536;

// ---------------------------------------------------------------------------
// Local

#[test]
fn file_to_file_every_shape() {
    let dir = tempfile::tempdir().unwrap();
    for (i, shape) in [
        Shape::Sparse,
        Shape::Dense,
        Shape::Random(7),
        Shape::Random(8),
    ]
    .into_iter()
    .enumerate()
    {
        let src = dir.path().join(format!("src{i}.img"));
        let dst = dir.path().join(format!("dst{i}.img"));
        let want = make_image(&src, ODD, shape);
        // Default (2 MiB), NBD-like 256 KiB, and an odd size whose chunk
        // boundaries do not fall on zero-scan blocks.
        for request_size in [0, 256 << 10, 68 << 10] {
            let _ = std::fs::remove_file(&dst);
            let o = CopyOptions {
                request_size,
                ..opts()
            };
            let st = copy::copy(src.to_str().unwrap(), dst.to_str().unwrap(), &o).unwrap();
            let what = format!("{shape:?} request {request_size}");
            same(&std::fs::read(&dst).unwrap(), &want, &what);
            assert_eq!(st.size, ODD);
            assert_eq!(
                st.bytes_written + st.bytes_zeroed + st.bytes_skipped,
                ODD,
                "{what}: {st:?}"
            );
        }
    }
}

#[test]
fn sparse_destination_unless_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let want = make_image(&src, 16 * MIB + 333, Shape::Sparse);
    let data: u64 = 4096 + 300_000 + 64 * 1024 + 1000;

    let sparse = dir.path().join("sparse.img");
    copy::copy(src.to_str().unwrap(), sparse.to_str().unwrap(), &opts()).unwrap();
    same(&std::fs::read(&sparse).unwrap(), &want, "sparse copy");
    // The data plus block rounding; the 256 KiB of explicit zeros must not
    // be allocated (zero scan), nor any hole.
    let a = allocated_bytes(&sparse);
    assert!(
        a <= data + 64 * 1024,
        "sparse copy allocates {a} bytes for {data} of data"
    );

    let full = dir.path().join("full.img");
    let o = CopyOptions {
        zero_mode: ZeroMode::Allocated,
        ..opts()
    };
    copy::copy(src.to_str().unwrap(), full.to_str().unwrap(), &o).unwrap();
    same(&std::fs::read(&full).unwrap(), &want, "--allocated copy");
    let a = allocated_bytes(&full);
    assert!(a >= 16 * MIB, "--allocated copy allocates only {a} bytes");

    // -S 0: no zero scan, the explicit zeros are copied as data (by the
    // kernel where copy_file_range works between these files).
    let noscan = dir.path().join("noscan.img");
    let o = CopyOptions {
        sparse_size: 0,
        ..opts()
    };
    let st = copy::copy(src.to_str().unwrap(), noscan.to_str().unwrap(), &o).unwrap();
    same(&std::fs::read(&noscan).unwrap(), &want, "-S 0 copy");
    let moved = st.bytes_written + st.bytes_copy_range + st.bytes_reflinked;
    assert!(moved >= data + 256 * 1024, "{st:?}");
    assert!(allocated_bytes(&noscan) >= data + 256 * 1024);
}

/// The source is mapped in growing windows (64 MiB, then 256 MiB, ...): a
/// data run across the first boundary and a hole across the second are
/// copied whole, into a dirty destination, locally and through NBD.
#[test]
fn extents_across_the_look_ahead_windows() {
    let dir = tempfile::tempdir().unwrap();
    let size = 332 * MIB;
    let src = dir.path().join("src.img");
    let f = std::fs::File::create(&src).unwrap();
    f.set_len(size).unwrap();
    let data = [(63 * MIB, 2 * MIB), (330 * MIB, MIB)];
    let mut buf = vec![0u8; 2 * MIB as usize];
    for &(off, len) in &data {
        pattern(off, off, &mut buf[..len as usize]);
        f.write_all_at(&buf[..len as usize], off).unwrap();
    }
    std::fs::File::create(dir.path().join("exp.img")).unwrap();
    let srv = server("nbdkit", &dir.path().join("exp.img"));
    for dst in [dir.path().join("dst.img"), dir.path().join("exp.img")] {
        let junk = vec![0xa5u8; MIB as usize];
        let d = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&dst)
            .unwrap();
        for i in 0..size / MIB {
            d.write_all_at(&junk, i * MIB).unwrap();
        }
        let to = if dst.ends_with("exp.img") {
            srv.uri()
        } else {
            dst.to_str().unwrap().to_string()
        };
        let st = copy::copy(src.to_str().unwrap(), &to, &opts()).unwrap();
        assert_eq!(st.bytes_written, 3 * MIB, "{to}: {st:?}");
        assert_eq!(st.bytes_zeroed, size - 3 * MIB, "{to}: {st:?}");
        let mut got = vec![0u8; MIB as usize];
        let mut want = vec![0u8; MIB as usize];
        for i in 0..size / MIB {
            let off = i * MIB;
            d.read_exact_at(&mut got, off).unwrap();
            want.fill(0);
            if let Some(&(o, _)) = data.iter().find(|(o, l)| (*o..o + l).contains(&off)) {
                pattern(o, off, &mut want);
            }
            same(&got, &want, &format!("{to} at {off}"));
        }
    }
}

#[test]
fn dirty_destination_is_overwritten_and_resized() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let want = make_image(&src, ODD, Shape::Random(11));
    for (name, dsize) in [("bigger", ODD + 3 * MIB + 7), ("smaller", MIB + 1)] {
        let dst = dir.path().join(format!("{name}.img"));
        let mut junk = vec![0u8; dsize as usize];
        pattern(99, 0, &mut junk);
        std::fs::write(&dst, &junk).unwrap();
        if dsize > ODD {
            // Cut short only with --force, as `create` overwrites.
            let e = copy::copy(src.to_str().unwrap(), dst.to_str().unwrap(), &opts()).unwrap_err();
            assert!(matches!(e, CopyError::Setup(_)), "{e}");
            assert!(e.to_string().contains("--force"), "{e}");
            same(&std::fs::read(&dst).unwrap(), &junk, "refused destination");
        }
        for mode in [ZeroMode::MayTrim, ZeroMode::Allocated] {
            let o = CopyOptions {
                zero_mode: mode,
                force: true,
                ..opts()
            };
            let st = copy::copy(src.to_str().unwrap(), dst.to_str().unwrap(), &o).unwrap();
            same(
                &std::fs::read(&dst).unwrap(),
                &want,
                &format!("{name} {mode:?}"),
            );
            assert_eq!(
                st.bytes_skipped, 0,
                "{name}: a dirty destination skipped zeroing"
            );
            std::fs::write(&dst, &junk).unwrap();
        }
    }
    // --target-is-zero on a dirty destination leaves the junk in the holes:
    // the option is the user's promise, and the copy must trust it.
    let dst = dir.path().join("trusting.img");
    let mut junk = vec![0u8; ODD as usize];
    pattern(98, 0, &mut junk);
    std::fs::write(&dst, &junk).unwrap();
    let o = CopyOptions {
        zero_mode: ZeroMode::Skip,
        ..opts()
    };
    let st = copy::copy(src.to_str().unwrap(), dst.to_str().unwrap(), &o).unwrap();
    assert!(st.bytes_skipped > 0 && st.bytes_zeroed == 0, "{st:?}");
    let got = std::fs::read(&dst).unwrap();
    assert!(got != want, "--target-is-zero zeroed anyway");
}

#[test]
fn preallocation_of_a_new_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let want = make_image(&src, ODD, Shape::Sparse);
    let dst = dir.path().join("falloc.img");
    let o = CopyOptions {
        preallocation: rawdisk_storage::Prealloc::Falloc,
        ..opts()
    };
    copy::copy(src.to_str().unwrap(), dst.to_str().unwrap(), &o).unwrap();
    same(&std::fs::read(&dst).unwrap(), &want, "falloc copy");
    assert!(
        allocated_bytes(&dst) >= ODD - 4096,
        "{}",
        allocated_bytes(&dst)
    );
}

#[test]
fn verify_catches_a_corrupted_byte() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    make_image(&src, ODD, Shape::Sparse);
    let dst = dir.path().join("dst.img");
    let o = opts();
    let (s, d) = copy::open_pair(src.to_str().unwrap(), dst.to_str().unwrap(), &o).unwrap();
    copy::copy_endpoints(&s, &d.endpoint, &o, d.zeroed).unwrap();
    let v = copy::verify(&s, &d.endpoint, &o).unwrap();
    assert!(v.bytes_compared > 0 && v.bytes_skipped > 0, "{v:?}");

    // One byte in a data run, then one in a hole of the source.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&dst)
        .unwrap();
    for (off, good) in [(MIB + 10_000, None), (4 * MIB + 17, Some(0u8))] {
        let mut b = [0u8; 1];
        f.read_at(&mut b, off).unwrap();
        f.write_all_at(&[b[0] ^ 0x40], off).unwrap();
        let e = copy::verify(&s, &d.endpoint, &o).unwrap_err();
        assert!(matches!(e, CopyError::Mismatch(_)), "{e}");
        assert!(e.to_string().contains(&format!("offset {off}")), "{e}");
        f.write_all_at(&[good.unwrap_or(b[0])], off).unwrap();
    }
    copy::verify(&s, &d.endpoint, &o).unwrap();
}

#[test]
fn source_errors_name_the_side() {
    let dir = tempfile::tempdir().unwrap();
    let e = copy::copy(
        dir.path().join("missing").to_str().unwrap(),
        dir.path().join("dst").to_str().unwrap(),
        &opts(),
    )
    .unwrap_err();
    assert_io_error(&e, Side::Source, &[]);
    assert!(e.to_string().starts_with("source "), "{e}");
    assert!(
        !dir.path().join("dst").exists(),
        "destination created for a missing source"
    );
}

// ---------------------------------------------------------------------------
// NBD

fn nbd_matrix(kind: &str) {
    let dir = tempfile::tempdir().unwrap();
    let size = if kind == "qemu-nbd" { EVEN } else { ODD };
    for (i, shape) in [Shape::Sparse, Shape::Random(21)].into_iter().enumerate() {
        let src = dir.path().join(format!("src{i}.img"));
        let want = make_image(&src, size, shape);

        // file -> NBD (a dirty export of the same size)
        let exp = dir.path().join(format!("export{i}.img"));
        let mut junk = vec![0u8; size as usize];
        pattern(77, 0, &mut junk);
        std::fs::write(&exp, &junk).unwrap();
        let srv = server(kind, &exp);
        let st = copy::copy(src.to_str().unwrap(), &srv.uri(), &opts())
            .unwrap_or_else(|e| panic!("{kind}: file -> nbd: {e}"));
        assert_eq!(st.bytes_skipped, 0);
        same(
            &std::fs::read(&exp).unwrap(),
            &want,
            &format!("{kind} {shape:?}: file -> nbd"),
        );

        // NBD -> file (new file)
        let back = dir.path().join(format!("back{i}.img"));
        copy::copy(&srv.uri(), back.to_str().unwrap(), &opts())
            .unwrap_or_else(|e| panic!("{kind}: nbd -> file: {e}"));
        same(
            &std::fs::read(&back).unwrap(),
            &want,
            &format!("{kind} {shape:?}: nbd -> file"),
        );
        if matches!(shape, Shape::Sparse) {
            let a = allocated_bytes(&back);
            assert!(a < 2 * MIB, "{kind}: nbd -> file allocated {a} bytes");
        }

        // NBD -> NBD (into a second dirty export)
        let exp2 = dir.path().join(format!("export{i}b.img"));
        std::fs::write(&exp2, &junk).unwrap();
        let srv2 = server(kind, &exp2);
        copy::copy(&srv.uri(), &srv2.uri(), &opts())
            .unwrap_or_else(|e| panic!("{kind}: nbd -> nbd: {e}"));
        same(
            &std::fs::read(&exp2).unwrap(),
            &want,
            &format!("{kind} {shape:?}: nbd -> nbd"),
        );

        // And verify over NBD on both sides.
        let s = Endpoint::open(&srv.uri(), false).unwrap();
        let d = Endpoint::open(&srv2.uri(), false).unwrap();
        copy::verify(&s, &d, &opts()).unwrap();
    }
}

#[test]
fn nbdkit_file_to_nbd_to_file_and_nbd_to_nbd() {
    nbd_matrix("nbdkit");
}

#[test]
fn qemu_nbd_file_to_nbd_to_file_and_nbd_to_nbd() {
    nbd_matrix("qemu-nbd");
}

#[test]
fn rawdisk_server_file_to_nbd_to_file_and_nbd_to_nbd() {
    nbd_matrix("rawdisk");
}

#[test]
fn server_killed_mid_copy_fails_fast_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    make_image(&src, 32 * MIB, Shape::Dense);
    let exp = dir.path().join("export.img");
    std::fs::write(&exp, vec![0u8; 32 * MIB as usize]).unwrap();
    // Slow writes so the copy is still running when the server dies.
    let mut srv = NbdServer::nbdkit(&exp, &["--filter=delay"], &["delay-write=50ms"]);
    let uri = srv.uri();
    let t0 = Instant::now();
    let handle = std::thread::spawn({
        let src = src.clone();
        // 128 requests of 256 KiB at 50 ms each over 8 in flight: ~800 ms.
        // Without retrying: the server does not come back here.
        let o = CopyOptions {
            request_size: 256 << 10,
            retry_timeout: Duration::ZERO,
            ..opts()
        };
        move || copy::copy(src.to_str().unwrap(), &uri, &o)
    });
    std::thread::sleep(Duration::from_millis(400));
    assert!(
        !handle.is_finished(),
        "copy ended before the server was killed"
    );
    srv.child.kill().unwrap();
    let e = handle.join().unwrap().unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    assert_io_error(&e, Side::Destination, &["offset", "connection"]);

    // The binary: non-zero exit and one clear line.
    if let Some(bin) = std::env::var_os("RAWDISK_BIN") {
        // 128 writes of 256 KiB, 4 at a time, 200 ms each: ~6 s of copying,
        // so the kill below lands mid-copy even on a loaded machine.
        let mut srv = NbdServer::nbdkit(&exp, &["--filter=delay"], &["delay-write=200ms"]);
        let child = Command::new(bin)
            .args([
                "copy",
                "-m",
                "4",
                "-C",
                "1",
                "--request-size",
                "256K",
                "--retry-timeout",
                "0",
                src.to_str().unwrap(),
                &srv.uri(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(400));
        let mut child = child;
        if let Some(st) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            panic!(
                "copy ended before the kill ({st}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        srv.child.kill().unwrap();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("rawdisk: destination nbd+unix://"), "{err}");
    }
}

#[test]
fn server_errors_end_the_copy() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    make_image(&src, 8 * MIB, Shape::Dense);
    let exp = dir.path().join("export.img");
    std::fs::write(&exp, vec![0u8; 8 * MIB as usize]).unwrap();
    // A quarter of the writes fail with ENOSPC.
    let srv = NbdServer::nbdkit(
        &exp,
        &["--filter=error"],
        &["error=ENOSPC", "error-pwrite-rate=25%"],
    );
    // 512 requests of 16 KiB: all of them succeeding has odds of 1e-64
    // (writes, 25 %) and 1e-23 (reads, 10 %).
    let o = CopyOptions {
        request_size: 16 << 10,
        ..opts()
    };
    let e = copy::copy(src.to_str().unwrap(), &srv.uri(), &o).unwrap_err();
    assert_io_error(&e, Side::Destination, &["write at offset", "ENOSPC"]);

    // Failing reads on an NBD source.
    let srv = NbdServer::nbdkit(
        &src,
        &["--filter=error"],
        &["error=EIO", "error-pread-rate=10%"],
    );
    let e = copy::copy(&srv.uri(), dir.path().join("o.img").to_str().unwrap(), &o).unwrap_err();
    assert_io_error(&e, Side::Source, &["read at offset", "EIO"]);
}

// ---------------------------------------------------------------------------
// Block devices

#[test]
#[ignore = "needs root"]
fn block_device_both_ways() {
    use rawdisk_testkit::LoopDev;
    let dir = tempfile::tempdir().unwrap();
    for sector in [512u32, 4096] {
        let dev = LoopDev::new(16 * MIB, sector);
        let devp = dev.path().to_str().unwrap().to_string();
        // Dirty the device first so zero runs must really be zeroed.
        rawdisk_testkit::write_pattern(dev.path(), 0, 16 * MIB, 55);
        let src = dir.path().join(format!("src{sector}.img"));
        let size = 12 * MIB + 333;
        let want = make_image(&src, size, Shape::Random(sector as u64));
        copy::copy(src.to_str().unwrap(), &devp, &opts()).unwrap();
        let got = rawdisk_testkit::read_range(dev.path(), 0, 16 * MIB as usize);
        same(
            &got[..size as usize],
            &want,
            &format!("file -> loop{sector}"),
        );
        // Beyond the source's size the device is untouched.
        let mut tail = vec![0u8; (16 * MIB - size) as usize];
        pattern(55, size, &mut tail);
        same(&got[size as usize..], &tail, "bytes past the source");

        // Device -> file: the whole device, holes where it reads zeros.
        let back = dir.path().join(format!("back{sector}.img"));
        let o = CopyOptions {
            cache: rawdisk_storage::CacheMode::None,
            ..opts()
        };
        copy::copy(&devp, back.to_str().unwrap(), &o).unwrap();
        same(
            &std::fs::read(&back).unwrap(),
            &got,
            &format!("loop{sector} -> file"),
        );
        // Zero blocks of the device became holes (-S 4k).
        let zeros = got
            .chunks(4096)
            .filter(|c| c.iter().all(|&b| b == 0))
            .count() as u64;
        assert!(
            allocated_bytes(&back) <= 16 * MIB - zeros * 4096 + 64 * 1024,
            "loop{sector} -> file allocates {} bytes with {zeros} zero blocks",
            allocated_bytes(&back)
        );
    }
}

#[test]
fn copying_a_file_onto_itself_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let want = make_image(&src, ODD, Shape::Sparse);
    let link = dir.path().join("link.img");
    std::fs::hard_link(&src, &link).unwrap();
    let e = copy::copy(src.to_str().unwrap(), link.to_str().unwrap(), &opts()).unwrap_err();
    assert!(matches!(e, CopyError::Setup(_)), "{e}");
    same(
        &std::fs::read(&src).unwrap(),
        &want,
        "source after a refused self-copy",
    );
}

#[test]
#[ignore = "needs root"]
fn full_destination_file_system_is_a_clear_error() {
    let fs = rawdisk_testkit::Fs::tmpfs(4 * MIB);
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    make_image(&src, 8 * MIB, Shape::Dense);
    let dst = fs.path("dst.img");
    let e = copy::copy(src.to_str().unwrap(), dst.to_str().unwrap(), &opts()).unwrap_err();
    assert_io_error(&e, Side::Destination, &["offset", "No space left"]);
}

#[test]
fn destination_smaller_than_source_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    make_image(&src, ODD, Shape::Sparse);
    let exp = dir.path().join("small.img");
    std::fs::write(&exp, vec![0u8; MIB as usize]).unwrap();
    let srv = NbdServer::nbdkit(&exp, &[], &[]);
    let e = copy::copy(src.to_str().unwrap(), &srv.uri(), &opts()).unwrap_err();
    assert!(matches!(e, CopyError::Setup(_)), "{e}");
    assert!(e.to_string().contains("smaller than the source"), "{e}");
}

#[test]
fn nbd_endpoint_read_at_spans_several_requests() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let want = make_image(&src, 40 * MIB + 333, Shape::Random(7));
    // More than one 32 MiB maximum payload (nbdkit's): two requests.
    let srv = NbdServer::nbdkit(&src, &[], &[]);
    let ep = Endpoint::open(&srv.uri(), false).unwrap();
    assert!(ep.max_io() < 36 * MIB, "max_io {}", ep.max_io());
    let (off, len) = (4097usize, 36 * MIB as usize + 12345);
    let mut got = vec![0u8; len];
    ep.read_at(&mut got, off as u64).unwrap();
    assert!(got == want[off..off + len], "read_at over NBD differs");
}
