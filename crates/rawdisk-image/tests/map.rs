//! `map` of a target whose syscalls go through a FaultSys: the lookups a
//! range costs, counted at the syscall seam, and what an error midway
//! leaves on the output.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use rawdisk_image::map::{write_target_map, MapFormat, MapRange};
use rawdisk_storage::fault::FaultSys;
use rawdisk_storage::sys::CallKind;
use rawdisk_storage::{OpenOptions, Target};

const BLOCK: u64 = 4096;

/// `pairs` of one hole block and one data block.
fn fragmented(path: &Path, pairs: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(pairs * 2 * BLOCK).unwrap();
    for i in 0..pairs {
        f.write_all_at(&[i as u8 | 1; BLOCK as usize], (2 * i + 1) * BLOCK)
            .unwrap();
    }
}

fn open(path: &Path) -> (Target, Arc<FaultSys>) {
    let fault = FaultSys::real();
    let opts = OpenOptions {
        read_only: true,
        ..Default::default()
    };
    (
        Target::open_with_sys(path, &opts, fault.clone()).unwrap(),
        fault,
    )
}

fn lookups(f: &FaultSys) -> u64 {
    f.calls(CallKind::SeekData) + f.calls(CallKind::SeekHole)
}

fn map(t: &Target, range: Option<MapRange>) -> (rawdisk_image::Result<()>, String) {
    let mut out = Vec::new();
    let r = write_target_map(t, "m.img", range, MapFormat::Json, &mut out);
    (r, String::from_utf8(out).unwrap())
}

#[test]
fn a_range_costs_one_lookup_per_run() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("m.img");
    fragmented(&img, 1000);
    let (t, f) = open(&img);
    let (r, whole) = map(&t, None);
    r.unwrap();
    assert_eq!(whole.lines().count(), 2000);
    assert_eq!(lookups(&f), 2000);
    for (start, len, runs) in [
        (BLOCK + 7, Some(BLOCK), 2),
        (100 * BLOCK, Some(16 * BLOCK), 16),
        (2000 * BLOCK - 3 * BLOCK, None, 3),
        (500 * BLOCK, Some(0), 0),
        (2000 * BLOCK, None, 0),
        (5000 * BLOCK, Some(BLOCK), 0),
    ] {
        let before = lookups(&f);
        let range = MapRange {
            start,
            max_length: len,
        };
        let (r, text) = map(&t, Some(range));
        r.unwrap();
        let n = lookups(&f) - before;
        let want = if runs == 0 { 0 } else { runs + 1 };
        assert!(n <= want, "{n} lookups for {runs} runs from {start}");
        assert_eq!(text.lines().count() as u64, runs.max(1), "{text}");
    }
}

#[test]
fn an_error_midway_ends_the_output_after_whole_runs() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("m.img");
    // More runs than one engine call returns, so the error comes after
    // some have been printed.
    fragmented(&img, 3000);
    let (t, _) = open(&img);
    let (r, whole) = map(&t, None);
    r.unwrap();
    let (t, f) = open(&img);
    f.fail_from(CallKind::SeekHole, 2500, libc::EIO);
    let (r, part) = map(&t, None);
    let msg = r.unwrap_err().to_string();
    assert!(msg.starts_with("map 'm.img': extents (SEEK_HOLE)"), "{msg}");
    assert_eq!(msg.matches("Input/output error").count(), 1, "{msg}");
    assert!(whole.starts_with(&part), "not a prefix of the map: {part}");
    assert!(part.ends_with('}') && !part.contains(']'), "{part}");
    assert!(part.lines().count() >= 4000, "{}", part.lines().count());
}
