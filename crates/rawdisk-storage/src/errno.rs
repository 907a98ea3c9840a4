//! What an errno means to the engine: "not supported" (the only answer that
//! teaches it a method is missing), "interrupted, try again", "the target
//! ended early". A leaf: it imports nothing from the crate, so every module
//! (and the probe) uses this one definition.

use std::io;

/// What an EINVAL from a call means. EINVAL is ambiguous (bad alignment,
/// bad range, or "no such operation"), so each call site says which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Einval {
    /// A bad argument: an error like any other.
    Invalid,
    /// The kernel documents EINVAL as lack of support for this call: lseek
    /// SEEK_DATA/SEEK_HOLE on a block device (fixed_size_llseek accepts only
    /// SET/CUR/END) or before Linux 3.1; splice(2) from a file system
    /// without splice_read; madvise(MADV_POPULATE_WRITE) before Linux 5.14.
    Unsupported,
}

/// "Not supported" errnos: the only ones that teach us a method is missing.
///
/// EOPNOTSUPP: the file system or device lacks the operation. ENODEV:
/// fallocate on a block device before Linux 4.9 (vfs_fallocate only allowed
/// regular files and directories), mmap on a file system without it.
/// ENOTTY: an ioctl the kernel or driver does not know (BLKZEROOUT before
/// 3.7, BLKDISCARD on some drivers). ENOSYS: syscall missing (pwritev2
/// before 4.6, old seccomp filters). EINVAL only where `einval` says so.
/// EIO, ENOSPC, EPERM... say nothing about support.
pub(crate) fn is_unsupported(e: &io::Error, einval: Einval) -> bool {
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::ENOTTY | libc::ENODEV) => true,
        Some(libc::EINVAL) => einval == Einval::Unsupported,
        _ => false,
    }
}

/// "This pair of files cannot be copied this way", from FICLONERANGE or
/// copy_file_range: EXDEV (two file systems: FICLONERANGE always,
/// copy_file_range unless both are the same network file system), the
/// errnos of [`is_unsupported`], and EINVAL, which both calls return for
/// what the file systems refuse (a block size mismatch, a file system whose
/// reflink is off, a file that is not regular); the engine passes only
/// aligned ranges of two distinct regular files, so EINVAL is never its own
/// bad argument. EIO, ENOSPC, EPERM... are real errors.
pub(crate) fn is_unsupported_copy(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EXDEV) || is_unsupported(e, Einval::Unsupported)
}

/// Retry a syscall interrupted by a signal before it did anything. Every call
/// retried here is idempotent on its range (fallocate, ioctls, fsync).
pub(crate) fn retry<T>(mut f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match f() {
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            r => return r,
        }
    }
}

/// The cause of a read of `[offset, offset + len)` that met the end of the
/// target at byte `end` (the file shrank under us, or a device went away).
pub(crate) fn short_read(offset: u64, len: u64, end: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!(
            "short read: end of target at byte {end} (range ends at {})",
            offset + len
        ),
    )
}

pub(crate) fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}
