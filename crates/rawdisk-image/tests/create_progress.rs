//! The library side of `create`: what it reports through `Progress`, and
//! the report it returns.

use rawdisk_image::create::{create, CreateOptions};
use rawdisk_image::progress::{NoProgress, Recorder};
use rawdisk_storage::{Method, Prealloc};
use rawdisk_testkit::{check_zero, Fs, MIB};

#[test]
fn full_reports_every_byte_written() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("full.img");
    let rec = Recorder::default();
    let r = create(
        &CreateOptions::new(&p, 20 * MIB + 12345, Prealloc::Full),
        &rec,
    )
    .unwrap();
    assert_eq!(r.method, Some(Method::WriteZeros));
    assert_eq!(r.bytes_written, 20 * MIB + 12345);
    let steps = rec.steps.lock().unwrap().clone();
    assert_eq!(
        steps,
        vec![(
            "writing zeros".to_string(),
            20 * MIB + 12345,
            20 * MIB + 12345
        )]
    );
    check_zero(&p, 0, 20 * MIB + 12345);
}

#[test]
fn falloc_reports_allocation_steps_and_off_reports_none() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("falloc.img");
    let rec = Recorder::default();
    let r = create(&CreateOptions::new(&p, 100 * MIB, Prealloc::Falloc), &rec).unwrap();
    // /tmp is ext4 here: fallocate works.
    assert_eq!(r.method, Some(Method::Fallocate));
    assert!(!r.fell_back);
    assert_eq!(
        rec.steps.lock().unwrap().clone(),
        vec![("allocating".to_string(), 100 * MIB, 100 * MIB)]
    );
    let p2 = d.path().join("off.img");
    let r = create(
        &CreateOptions::new(&p2, 100 * MIB, Prealloc::Off),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(r.method, None);
    assert!(r.summary().contains("(sparse)"), "{}", r.summary());
}

#[test]
#[ignore = "needs root"]
fn falloc_on_ramfs_falls_back_with_progress() {
    let fs = Fs::ramfs();
    let p = fs.path("r.img");
    let rec = Recorder::default();
    let r = create(&CreateOptions::new(&p, 100 * MIB, Prealloc::Falloc), &rec).unwrap();
    assert!(r.fell_back);
    assert_eq!(r.method, Some(Method::WriteZeros));
    assert_eq!(r.bytes_written, 100 * MIB);
    // The first 16 MiB went through the engine's own fallback; the rest was
    // written here, with progress.
    assert_eq!(
        rec.steps.lock().unwrap().clone(),
        vec![("writing zeros".to_string(), 84 * MIB, 84 * MIB)]
    );
    assert!(
        r.summary().contains("fallocate not supported here"),
        "{}",
        r.summary()
    );
    check_zero(&p, 0, 100 * MIB);
}
