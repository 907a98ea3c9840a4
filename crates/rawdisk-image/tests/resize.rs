//! The library side of `resize`: only the new tail is allocated, bytes below
//! the old size never change, a failure half way restores the old size, and
//! every storage kind behaves.

use std::path::Path;

use rawdisk_image::progress::{NoProgress, Recorder};
use rawdisk_image::resize::{resize, resize_target, ResizeOptions, SizeSpec};
use rawdisk_storage::sys::{CallKind, FallocMode};
use rawdisk_storage::{FaultSys, OpenOptions, Prealloc, Target};
use rawdisk_testkit::{
    allocated_bytes, check_pattern, check_zero, write_pattern, Fs, Scratch, StorageKind, MIB,
};

const ENOSPC: i32 = 28;

fn opts(p: &Path, size: SizeSpec, prealloc: Prealloc) -> ResizeOptions {
    ResizeOptions {
        prealloc,
        ..ResizeOptions::new(p, size)
    }
}

/// A file of `size` bytes with pattern data over all of it.
fn image(dir: &Path, name: &str, size: u64, seed: u64) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().set_len(size).unwrap();
    write_pattern(&p, 0, size, seed);
    p
}

fn len(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

#[test]
fn grow_keeps_the_old_bytes_and_zeroes_the_tail() {
    let d = tempfile::tempdir().unwrap();
    for (i, mode) in [Prealloc::Off, Prealloc::Falloc, Prealloc::Full]
        .into_iter()
        .enumerate()
    {
        let old = 3 * MIB + 555;
        let p = image(d.path(), &format!("g{i}.img"), old, i as u64);
        let before = allocated_bytes(&p);
        let rec = Recorder::default();
        let r = resize(&opts(&p, SizeSpec::Grow(40 * MIB), mode), &rec).unwrap();
        assert_eq!((r.old_size, r.new_size), (old, old + 40 * MIB));
        assert_eq!(len(&p), old + 40 * MIB);
        check_pattern(&p, 0, old, i as u64);
        check_zero(&p, old, 40 * MIB);
        let grown = allocated_bytes(&p) - before;
        match mode {
            // /tmp is ext4 here: the tail stays a hole.
            Prealloc::Off => assert!(grown < MIB, "off allocated {grown}"),
            _ => assert!(grown >= 40 * MIB, "{mode:?} allocated only {grown}"),
        }
        if mode == Prealloc::Full {
            // Only the tail is written, with progress.
            assert_eq!(r.bytes_written, 40 * MIB);
            let steps = rec.steps.lock().unwrap().clone();
            assert_eq!(
                steps,
                vec![("writing zeros".to_string(), 40 * MIB, 40 * MIB)]
            );
        }
    }
}

#[test]
fn shrink_needs_the_flag_and_preallocation_off() {
    let d = tempfile::tempdir().unwrap();
    let p = image(d.path(), "s.img", 8 * MIB, 3);
    let e = resize(&opts(&p, SizeSpec::Shrink(MIB), Prealloc::Off), &NoProgress).unwrap_err();
    assert!(e.to_string().contains("--shrink"), "{e}");
    assert_eq!(len(&p), 8 * MIB);
    let mut o = opts(&p, SizeSpec::Absolute(2 * MIB), Prealloc::Full);
    o.shrink = true;
    let e = resize(&o, &NoProgress).unwrap_err();
    assert!(e.to_string().contains("preallocation=off"), "{e}");
    assert_eq!(len(&p), 8 * MIB);
    o.prealloc = Prealloc::Off;
    let r = resize(&o, &NoProgress).unwrap();
    assert_eq!(len(&p), 2 * MIB);
    assert_eq!(r.data_discarded, Some(6 * MIB));
    assert!(
        r.summary()
            .contains("the 6 MiB past the new end are gone (6 MiB of it allocated)"),
        "{}",
        r.summary()
    );
    check_pattern(&p, 0, 2 * MIB, 3);
    // Shrinking by more than the size is an error, not a wrap.
    let e = resize(
        &ResizeOptions {
            shrink: true,
            ..ResizeOptions::new(&p, SizeSpec::Shrink(3 * MIB))
        },
        &NoProgress,
    )
    .unwrap_err();
    assert!(e.to_string().contains("only 2097152 bytes"), "{e}");
    // Grown from 0 with off, the first block is written as create does.
    let z = d.path().join("zero.img");
    std::fs::File::create(&z).unwrap();
    resize(
        &opts(&z, SizeSpec::Absolute(MIB), Prealloc::Off),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(len(&z), MIB);
    assert!(allocated_bytes(&z) >= 4096);
    check_zero(&z, 0, MIB);
    // The same size: nothing changes.
    let r = resize(
        &opts(&z, SizeSpec::Absolute(MIB), Prealloc::Full),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(r.bytes_written, 0);
    assert!(r.summary().contains("unchanged"), "{}", r.summary());
}

#[test]
fn other_image_formats_are_refused_without_force() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("q.qcow2");
    let mut head = b"QFI\xfb\0\0\0\x03".to_vec();
    head.resize(4096, 7);
    std::fs::write(&p, &head).unwrap();
    let e = resize(&opts(&p, SizeSpec::Grow(MIB), Prealloc::Off), &NoProgress).unwrap_err();
    assert!(e.to_string().contains("qcow2"), "{e}");
    assert_eq!(len(&p), 4096);
    let mut o = opts(&p, SizeSpec::Grow(MIB), Prealloc::Off);
    o.force = true;
    resize(&o, &NoProgress).unwrap();
    assert_eq!(len(&p), 4096 + MIB);
    assert_eq!(&std::fs::read(&p).unwrap()[..4096], &head[..]);
}

/// ENOSPC half way through writing the tail: the old size comes back, the
/// old bytes are intact, the error says how far it got.
#[test]
fn enospc_while_growing_restores_the_old_size() {
    let d = tempfile::tempdir().unwrap();
    let cases: [(Prealloc, CallKind, u64); 3] = [
        // The third 4 MiB write of zeros fails.
        (Prealloc::Full, CallKind::Pwrite, 3),
        // The first fallocate step (the 16 MiB trial) fails.
        (
            Prealloc::Falloc,
            CallKind::Fallocate(FallocMode::Allocate),
            1,
        ),
        // The trial works, the next 1 GiB step runs out of space.
        (
            Prealloc::Falloc,
            CallKind::Fallocate(FallocMode::Allocate),
            2,
        ),
    ];
    for (i, (mode, kind, nth)) in cases.into_iter().enumerate() {
        let old = 5 * MIB + 123;
        let p = image(d.path(), &format!("f{i}.img"), old, 10 + i as u64);
        let before = allocated_bytes(&p);
        let sys = FaultSys::real();
        sys.fail_once(kind, nth, ENOSPC);
        let t = Target::open_with_sys(
            &p,
            &OpenOptions {
                read_only: false,
                ..Default::default()
            },
            sys.clone(),
        )
        .unwrap();
        let grow = if mode == Prealloc::Full {
            64 * MIB
        } else {
            2048 * MIB
        };
        let e = resize_target(&t, &opts(&p, SizeSpec::Grow(grow), mode), &NoProgress).unwrap_err();
        let msg = e.to_string();
        assert_eq!(e.errno(), Some(ENOSPC), "{msg}");
        assert!(msg.contains("restored the old size"), "{msg}");
        assert!(msg.contains(&format!("of {grow} bytes")), "{msg}");
        if mode == Prealloc::Full {
            assert!(msg.contains(&format!("after {} of", 8 * MIB)), "{msg}");
        }
        assert_eq!(msg.lines().count(), 1);
        assert_eq!(len(&p), old, "case {i}");
        check_pattern(&p, 0, old, 10 + i as u64);
        assert!(allocated_bytes(&p) <= before + 64 * 1024, "case {i}");
        assert!(sys.calls(kind) >= nth);
    }
}

/// A real full file system: the tmpfs runs out of space, the file comes back.
#[test]
#[ignore = "needs root"]
fn full_file_system_restores_the_old_size() {
    for mode in [Prealloc::Full, Prealloc::Falloc] {
        let fs = Fs::tmpfs(32 * MIB);
        let p = fs.path("disk.img");
        std::fs::File::create(&p).unwrap().set_len(4 * MIB).unwrap();
        write_pattern(&p, 0, 4 * MIB, 5);
        let e = resize(&opts(&p, SizeSpec::Grow(64 * MIB), mode), &NoProgress).unwrap_err();
        assert_eq!(e.errno(), Some(ENOSPC), "{mode:?}: {e}");
        assert_eq!(len(&p), 4 * MIB);
        check_pattern(&p, 0, 4 * MIB, 5);
        // The space is given back: a small grow still fits.
        resize(&opts(&p, SizeSpec::Grow(8 * MIB), mode), &NoProgress).unwrap();
        check_pattern(&p, 0, 4 * MIB, 5);
        check_zero(&p, 4 * MIB, 8 * MIB);
    }
}

/// Every storage kind: files grow and shrink with each preallocation; block
/// devices accept their own size and refuse any other, naming theirs.
#[test]
#[ignore = "needs root"]
fn every_storage_kind() {
    for kind in StorageKind::usable() {
        let s = Scratch::with_room(kind, 16 * MIB, 128 * MIB);
        let p = s.path().to_path_buf();
        write_pattern(&p, 0, 16 * MIB, 21);
        if kind.is_block() {
            let r = resize(
                &opts(&p, SizeSpec::Absolute(16 * MIB), Prealloc::Off),
                &NoProgress,
            )
            .unwrap();
            assert_eq!(r.kind, "block");
            for spec in [SizeSpec::Grow(MIB), SizeSpec::Shrink(MIB)] {
                let mut o = opts(&p, spec, Prealloc::Off);
                o.shrink = true;
                let e = resize(&o, &NoProgress).unwrap_err().to_string();
                assert!(
                    e.contains(&format!("block device of {} bytes", 16 * MIB)),
                    "{kind}: {e}"
                );
                assert!(e.contains("lvextend"), "{e}");
            }
            check_pattern(&p, 0, 16 * MIB, 21);
            continue;
        }
        let mut size = 16 * MIB;
        for mode in [Prealloc::Off, Prealloc::Falloc, Prealloc::Full] {
            let r = resize(&opts(&p, SizeSpec::Grow(8 * MIB + 1), mode), &NoProgress)
                .unwrap_or_else(|e| panic!("{kind} {mode:?}: {e}"));
            assert_eq!(r.new_size, size + 8 * MIB + 1);
            check_pattern(&p, 0, 16 * MIB, 21);
            check_zero(&p, 16 * MIB, r.new_size - 16 * MIB);
            size = r.new_size;
        }
        let mut o = opts(&p, SizeSpec::Absolute(10 * MIB), Prealloc::Off);
        o.shrink = true;
        resize(&o, &NoProgress).unwrap();
        assert_eq!(len(&p), 10 * MIB, "{kind}");
        check_pattern(&p, 0, 10 * MIB, 21);
    }
}
