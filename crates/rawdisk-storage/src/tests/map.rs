//! Writes received straight into the mapped page cache.

use super::*;

/// A file of `size` bytes just written, so its pages are in the page cache.
fn cached_file(size: u64) -> Tmp {
    let tmp = tmp_file(size);
    std::fs::write(&tmp.path, pattern(0, size as usize)).unwrap();
    tmp
}

/// Pages that are not in the page cache are not mapped: a fault would read
/// them from the disk (or clear a page for a hole) before the overwrite,
/// which a whole-page pwrite does not. Here a hole, then the same range once
/// written.
#[test]
fn map_write_only_over_cached_pages() {
    let tmp = tmp_file(1 << 20);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    assert!(t.map_write(64 << 10, 128 << 10).is_none());
    assert_eq!(f.calls(CallKind::Resident), 1);
    assert_eq!(f.calls(CallKind::PopulateWrite), 0);
    assert_eq!(t.caps().get(Method::MapWrite), Tri::Unknown);
    t.write_at(&pattern(0, 256 << 10), 0, false).unwrap();
    assert!(t.map_write(64 << 10, 128 << 10).is_some());
    // Half cached is not cached.
    assert!(t.map_write(128 << 10, 256 << 10).is_none());
    f.fail_once(
        CallKind::Resident,
        f.calls(CallKind::Resident) + 1,
        libc::ENOMEM,
    );
    assert!(t.map_write(0, 4096).is_none());
    assert_eq!(t.caps().get(Method::MapWrite), Tri::Works);
}

/// mincore is asked 1 MiB of pages at a time: a write whose uncached pages
/// lie only past the first MiB is still not mapped, a fully cached one of
/// several MiB is.
#[test]
fn map_write_checks_every_page_of_a_long_write() {
    let tmp = tmp_file(8 << 20);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    t.write_at(&pattern(0, 3 << 20), 0, false).unwrap();
    assert!(t.map_write(4096, (3 << 20) - 4096).is_some());
    let n = f.calls(CallKind::PopulateWrite);
    assert!(t.map_write(4096, 3 << 20).is_none(), "last page uncached");
    assert!(t.map_write(1 << 20, 3 << 20).is_none(), "last MiB uncached");
    assert_eq!(
        f.calls(CallKind::PopulateWrite),
        n,
        "populated uncached pages"
    );
}

/// Receive `data` from the other end of a socket pair into `w`, in as many
/// recv calls as it takes.
fn recv_all(w: &mut crate::MappedWrite<'_>, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::fd::AsFd;
    let (mut tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
    let data = data.to_vec();
    let sender = std::thread::spawn(move || {
        let _ = tx.write_all(&data);
    });
    let r = loop {
        if w.remaining() == 0 {
            break Ok(());
        }
        match w.recv(rx.as_fd()) {
            Ok(0) => break Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) => break Err(e),
        }
    };
    drop(rx);
    sender.join().unwrap();
    r
}

#[test]
fn map_write_lands_in_the_file_and_nowhere_else() {
    let size = 4 << 20;
    let tmp = tmp_file(size);
    std::fs::write(&tmp.path, pattern(0, size as usize)).unwrap();
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    let (off, len) = (1_000_003u64, 300_001usize);
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let mut w = t
        .map_write(off, len)
        .expect("page cache of ext4 or tmpfs maps");
    recv_all(&mut w, &data).unwrap();
    assert_eq!(w.received(), len);
    drop(w);
    assert_eq!(t.caps().get(Method::MapWrite), Tri::Works);
    assert_eq!(t.caps().stats(Method::MapWrite).bytes, len as u64);
    assert_eq!(f.calls(CallKind::Mmap), 1);
    assert_eq!(f.calls(CallKind::PopulateWrite), 1);
    let mut want = pattern(0, size as usize);
    want[off as usize..off as usize + len].copy_from_slice(&data);
    assert!(std::fs::read(&tmp.path).unwrap() == want, "file differs");
    // A second write reuses the mapping; one that ends past the size at
    // open is not mapped (a file's last page maps past its end).
    let w = t.map_write(size - 4096, 4096).unwrap();
    drop(w);
    assert_eq!(f.calls(CallKind::Mmap), 1);
    assert!(t.map_write(size - 4096, 4097).is_none());
    assert!(t.map_write(u64::MAX - 10, 20).is_none());
    assert!(
        std::fs::read(&tmp.path).unwrap() == want,
        "an empty mapped write changed data"
    );
}

#[test]
fn map_write_is_never_used_where_it_cannot_help_or_work() {
    let tmp = tmp_file(1 << 20);
    let ro = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let (t, f) = open_fault(&tmp, ro);
    assert!(t.map_write(0, 4096).is_none());
    let direct = OpenOptions {
        cache: CacheMode::None,
        ..OpenOptions::default()
    };
    let d = Target::open_with_sys(&tmp.path, &direct, f.clone()).unwrap();
    assert!(d.map_write(0, 4096).is_none());
    assert_eq!(f.calls(CallKind::Mmap), 0);
    let empty = tmp_file(0);
    let (e, f) = open_fault(&empty, OpenOptions::default());
    assert!(e.map_write(0, 4096).is_none());
    assert_eq!(f.calls(CallKind::Mmap), 0);
}

#[test]
fn map_write_populate_errors_are_left_to_the_ordinary_write() {
    let tmp = cached_file(1 << 20);
    let (t, f) = open_fault(&tmp, OpenOptions::default());
    // No space (EFAULT is what populate says for a fault that would be a
    // SIGBUS): not mapped this time, nothing learned.
    for errno in [libc::EFAULT, libc::ENOMEM, libc::ENOSPC] {
        f.fail_once(
            CallKind::PopulateWrite,
            f.calls(CallKind::PopulateWrite) + 1,
            errno,
        );
        assert!(t.map_write(0, 8192).is_none());
        assert_eq!(t.caps().get(Method::MapWrite), Tri::Unknown);
    }
    assert!(t.map_write(0, 8192).is_some());
    assert_eq!(t.caps().get(Method::MapWrite), Tri::Works);
    // A kernel without MADV_POPULATE_WRITE (before 5.14): learned, never
    // asked again.
    let tmp2 = cached_file(1 << 20);
    let (t2, f2) = open_fault(&tmp2, OpenOptions::default());
    f2.fail_from(CallKind::PopulateWrite, 1, libc::EINVAL);
    assert!(t2.map_write(0, 8192).is_none());
    assert_eq!(t2.caps().get(Method::MapWrite), Tri::Fails);
    assert!(t2.map_write(0, 8192).is_none());
    assert_eq!(f2.calls(CallKind::PopulateWrite), 1);
    // A file system without mmap.
    let tmp3 = cached_file(1 << 20);
    let (t3, f3) = open_fault(&tmp3, OpenOptions::default());
    f3.fail_from(CallKind::Mmap, 1, libc::ENODEV);
    assert!(t3.map_write(0, 8192).is_none());
    assert_eq!(t3.caps().get(Method::MapWrite), Tri::Fails);
}

/// The reason mapped writes are safe: a page that cannot be faulted in
/// during recv's copy is EFAULT, not a SIGBUS. The file is truncated under a
/// populated mapping, so the pages recv copies into lie past its end.
#[test]
fn map_write_into_pages_gone_past_the_end_is_efault_not_sigbus() {
    let size = 1u64 << 20;
    let tmp = cached_file(size);
    let (t, _f) = open_fault(&tmp, OpenOptions::default());
    let mut w = t.map_write(512 << 10, 256 << 10).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&tmp.path)
        .unwrap()
        .set_len(0)
        .unwrap();
    let e = recv_all(&mut w, &[7u8; 256 << 10]).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
    assert_eq!(w.received(), 0);
}
