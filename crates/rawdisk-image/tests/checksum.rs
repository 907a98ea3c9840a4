//! The blkhash checksum against a plain reference implementation written
//! from the definition (read every byte, hash every block, no shortcuts),
//! and against the published blkhash test vectors.

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use digest::DynDigest;
use rawdisk_image::checksum::{checksum, hex, ChecksumOptions, ChecksumReport, DigestAlg};
use rawdisk_image::progress::NoProgress;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const BS: u64 = 64 * KIB;

/// The digests the reference has from another implementation.
const REFERENCE_DIGESTS: [&str; 7] = [
    "sha256",
    "sha384",
    "sha512",
    "sha1",
    "md5",
    "blake2b512",
    "blake2s256",
];

fn sha256() -> DigestAlg {
    DigestAlg::from_name("sha256").unwrap()
}

/// H(H(block 1) || ... || H(block N) || size as u64 LE), straight from the
/// definition: every byte read, every block hashed (the digest of an
/// all-zero block is remembered by length only because debug builds hash
/// slowly; which blocks are zero is decided by reading them).
fn reference(path: &Path, alg: &DigestAlg, bs: u64) -> String {
    let new = |a: &DigestAlg| -> Box<dyn DynDigest> {
        match a.name() {
            "sha256" => Box::new(sha2::Sha256::default()),
            "sha384" => Box::new(sha2::Sha384::default()),
            "sha512" => Box::new(sha2::Sha512::default()),
            "sha1" => Box::new(sha1::Sha1::default()),
            "md5" => Box::new(md5::Md5::default()),
            "blake2b512" => Box::new(blake2::Blake2b512::default()),
            "blake2s256" => Box::new(blake2::Blake2s256::default()),
            n => panic!("no reference for {n}"),
        }
    };
    let mut f = std::fs::File::open(path).unwrap();
    let mut outer = new(alg);
    let mut buf = vec![0u8; bs as usize];
    let mut total = 0u64;
    let mut zero_mds: std::collections::HashMap<usize, Vec<u8>> = Default::default();
    loop {
        let mut n = 0;
        while n < buf.len() {
            let r = f.read(&mut buf[n..]).unwrap();
            if r == 0 {
                break;
            }
            n += r;
        }
        if n == 0 {
            break;
        }
        let block = &buf[..n];
        if block.iter().all(|&b| b == 0) {
            let md = zero_mds.entry(n).or_insert_with(|| {
                let mut h = new(alg);
                h.update(block);
                h.finalize().to_vec()
            });
            outer.update(md);
        } else {
            let mut h = new(alg);
            h.update(block);
            outer.update(&h.finalize());
        }
        total += n as u64;
        if n < buf.len() {
            break;
        }
    }
    outer.update(&total.to_le_bytes());
    hex(&outer.finalize())
}

fn ours(path: &Path, alg: &DigestAlg, bs: u64) -> ChecksumReport {
    let opts = ChecksumOptions {
        digest: alg.clone(),
        block_size: bs,
        ..Default::default()
    };
    checksum(path.to_str().unwrap(), &opts, &NoProgress).unwrap()
}

fn file_of(dir: &Path, name: &str, data: &[u8]) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().write_all(data).unwrap();
    p
}

/// The test vectors of blkhash's own test suite (sha256, 64 KiB blocks):
/// runs of bytes ('-' a zero run given as a hole, '\0' zeros written).
#[test]
fn published_blkhash_vectors() {
    let d = tempfile::tempdir().unwrap();
    let h = (BS / 2) as usize;
    let b = BS as usize;
    // Data and zeros (holes and written) mixed within blocks.
    let mix: Vec<(u8, usize)> = [b'A', b'-', b'-', 0, b'E', b'-', b'-']
        .into_iter()
        .map(|c| (c, h))
        .collect();
    let cases: Vec<(Vec<(u8, usize)>, &str)> = vec![
        (
            vec![(b'A', b)],
            "2e3a5f57d5e726ee5de62db1a85ff816f4fa6ea4627807d9a51bdc4c883e165e",
        ),
        (
            vec![(0, b)],
            "8ab067ab7939a3d4f40cbb118956c07c06aeae2d075d6e0a2ebbb94bd42832af",
        ),
        (
            vec![(b'A', h)],
            "9467334d6d7668a2f06898185b5cddc78cdfbd962f50c6bf250101f03a0e54dc",
        ),
        (
            vec![(0, h)],
            "842d185f0ff348b0d689e184bddc47f69a19032a6934c89b879479f1e86f9d56",
        ),
        (
            vec![(b'-', 8 * b)],
            "722ac11a3a81034edf196aa3ee68d1a2e345cd0838b0c78c2ce2fb015d4d817d",
        ),
        (
            vec![(b'-', 8 * b), (b'-', h)],
            "e623a5702b1feb08fbb3d18e35bbb7ec10146b8cd1bcff811200a3948c78c55c",
        ),
        (
            "ABCDEF".bytes().map(|c| (c, h)).collect(),
            "4ab1586084326f5beb911621282e9557cd26856105eff7f78cace5986af4738b",
        ),
        (
            "ABCDE".bytes().map(|c| (c, h)).collect(),
            "2cad558b3a2a8d87435e80fe7bae69fa664d92eaa1b9411f573b9fbb412a4d43",
        ),
        (
            [&mix[..], &[(0, h)]].concat(),
            "4b2b5acd96f8105f4fb26abaf35c7c5756338ef9ccce19ffe7714c9ad94b4398",
        ),
        (
            mix.clone(),
            "2510ac29c7103f2e68c672d728cbd43db4ed3dc809a24cde96e62dc5862a0f57",
        ),
        (
            vec![(b'-', GIB as usize)],
            "c6d6562c3074a2caa0ceea3e1f460f3af678c792ed05e64157eb51e68ae5260d",
        ),
    ];
    for (i, (runs, want)) in cases.iter().enumerate() {
        let p = d.path().join(format!("v{i}.img"));
        let f = std::fs::File::create(&p).unwrap();
        let mut off = 0u64;
        for &(c, n) in runs {
            // '-' stays a hole; everything else is written.
            if c != b'-' {
                f.write_all_at(&vec![c; n], off).unwrap();
            }
            off += n as u64;
        }
        f.set_len(off).unwrap();
        assert_eq!(ours(&p, &sha256(), BS).checksum, *want, "vector {i}");
    }
}

#[test]
fn small_sizes_agree_with_the_reference() {
    let d = tempfile::tempdir().unwrap();
    for size in [0, 1, BS - 1, BS, BS + 1, 3 * BS + 17] {
        let data = rawdisk_testkit::pattern_vec(size, 0, size as usize);
        let p = file_of(d.path(), &format!("s{size}.img"), &data);
        for name in REFERENCE_DIGESTS {
            let alg = &DigestAlg::from_name(name).unwrap();
            let r = ours(&p, alg, BS);
            assert_eq!(r.checksum, reference(&p, alg, BS), "{size} {alg:?}");
            assert_eq!(r.checksum.len(), alg.output_size() * 2);
            assert_eq!(r.size, size);
        }
    }
    // Another block size is another checksum, and still the definition's.
    let data = rawdisk_testkit::pattern_vec(9, 0, (5 * BS + 3) as usize);
    let p = file_of(d.path(), "bs.img", &data);
    let r4 = ours(&p, &sha256(), 4 * KIB);
    assert_eq!(r4.checksum, reference(&p, &sha256(), 4 * KIB));
    assert_ne!(r4.checksum, ours(&p, &sha256(), BS).checksum);
}

/// A sparse image: data at offsets that cut blocks in the middle, a block of
/// written zeros, a partial last block; holes must not be read.
fn sparse_image(path: &Path, size: u64) -> Vec<(u64, u64)> {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    let runs = vec![
        (0, 4096),
        (BS + 100, 3 * BS),
        (10 * MIB + 12345, 5 * MIB),
        (300 * MIB, 64 * KIB),
        (size / 2 - 3, 7),
        (size - BS / 3, BS / 3 - 10),
    ];
    for (i, &(off, len)) in runs.iter().enumerate() {
        let v = rawdisk_testkit::pattern_vec(i as u64, off, len as usize);
        f.write_all_at(&v, off).unwrap();
    }
    // Written zeros: data on disk that reads as zeros.
    f.write_all_at(&vec![0u8; 2 * BS as usize], 200 * MIB)
        .unwrap();
    runs
}

#[test]
fn sparse_image_agrees_and_holes_are_not_read() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("sparse.img");
    let size = 512 * MIB + 4321;
    sparse_image(&p, size);
    let r = ours(&p, &sha256(), BS);
    assert_eq!(r.checksum, reference(&p, &sha256(), BS));
    // Only blocks touching data are read (a little more where the file
    // system allocates in larger units), the rest is skipped.
    assert!(r.bytes_read < 32 * MIB, "read {} bytes", r.bytes_read);
    assert!(r.bytes_skipped > 400 * MIB, "{r:?}");
    assert!(
        r.bytes_zero_read >= 2 * BS,
        "written zeros not detected: {r:?}"
    );
    assert_eq!(r.bytes_read + r.bytes_skipped, size);
}

#[test]
fn a_changed_byte_anywhere_changes_the_digest() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("c.img");
    let size = 8 * MIB + 999;
    sparse_image(&p, size);
    let base = ours(&p, &sha256(), BS).checksum;
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    // In data, in a hole, on block edges, the last byte.
    for off in [0, 1, BS - 1, BS, 5 * MIB + 7, size / 2, size - 1] {
        let mut old = [0u8];
        std::fs::File::open(&p)
            .unwrap()
            .read_exact_at(&mut old, off)
            .unwrap();
        f.write_all_at(&[old[0] ^ 0x5a], off).unwrap();
        let r = ours(&p, &sha256(), BS).checksum;
        assert_ne!(r, base, "byte {off} changed, digest did not");
        assert_eq!(r, reference(&p, &sha256(), BS), "{off}");
        f.write_all_at(&old, off).unwrap();
        assert_eq!(ours(&p, &sha256(), BS).checksum, base);
    }
    // One more byte of zeros is another image.
    f.set_len(size + 1).unwrap();
    assert_ne!(ours(&p, &sha256(), BS).checksum, base);
}

#[test]
fn all_holes_are_never_read() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("holes.img");
    let size = 64 * GIB;
    std::fs::File::create(&p).unwrap().set_len(size).unwrap();
    let r = ours(&p, &sha256(), BS);
    assert_eq!(r.bytes_read, 0, "{r:?}");
    assert_eq!(r.bytes_skipped, size);
    // The digest of 2^20 zero blocks, by folding the zero-block digest.
    let mut z = sha2::Sha256::default();
    DynDigest::update(&mut z, &vec![0u8; BS as usize]);
    let zmd = DynDigest::finalize_reset(&mut z);
    let mut outer = sha2::Sha256::default();
    for _ in 0..size / BS {
        DynDigest::update(&mut outer, &zmd);
    }
    DynDigest::update(&mut outer, &size.to_le_bytes());
    assert_eq!(r.checksum, hex(&DynDigest::finalize_reset(&mut outer)));
}

#[test]
#[ignore = "needs root"]
fn block_devices_agree_with_the_reference() {
    use rawdisk_testkit::LoopDev;
    for sector in [512, 4096] {
        let dev = LoopDev::new(48 * MIB, sector);
        let p = dev.path().to_path_buf();
        rawdisk_testkit::write_pattern(&p, MIB + 512, 3 * MIB, 7);
        rawdisk_testkit::write_pattern(&p, 40 * MIB, 4096, 8);
        let r = ours(&p, &sha256(), BS);
        assert_eq!(r.checksum, reference(&p, &sha256(), BS), "{sector}");
        assert_eq!(r.size, 48 * MIB);
        // A device has no holes to skip: everything is read.
        assert_eq!(r.bytes_read, 48 * MIB);
    }
}
