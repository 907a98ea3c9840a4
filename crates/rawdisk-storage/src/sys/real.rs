//! [`RealSys`]: the kernel behind each entry of the syscall table (sys.rs).

use std::io;
use std::num::NonZeroU64;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use super::{
    BlockGeometry, DioAlign, FallocMode, FileStat, LockCmd, LockKind, MapSpan, Mapping, OpenHow,
    Sys,
};

/// The kernel.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealSys;

/// FALLOC_FL_WRITE_ZEROES of <linux/falloc.h> (Linux 6.17), which neither
/// libc nor rustix names yet.
const FALLOC_FL_WRITE_ZEROES: u32 = 0x80;

/// Linux ioctl numbers for x86, ARM, RISC-V and the other architectures that
/// use the generic `_IOC` encoding (dir in bits 30-31, size in 16-29).
/// libc only exports a few of the BLK* requests, so they are computed here
/// from <linux/fs.h>.
#[allow(non_snake_case)]
mod blk {
    const fn io(nr: u32) -> u32 {
        (0x12 << 8) | nr
    }
    const fn ior(nr: u32, size: u32) -> u32 {
        (2 << 30) | (size << 16) | (0x12 << 8) | nr
    }
    pub const BLKROGET: u32 = io(94);
    pub const BLKSSZGET: u32 = io(104);
    pub const BLKGETSIZE64: u32 = ior(114, std::mem::size_of::<usize>() as u32);
    pub const BLKDISCARD: u32 = io(119);
    pub const BLKIOMIN: u32 = io(120);
    pub const BLKIOOPT: u32 = io(121);
    pub const BLKPBSZGET: u32 = io(123);
    pub const BLKZEROOUT: u32 = io(127);
    /// _IOW(0x94, 13, struct file_clone_range) from <linux/fs.h>.
    pub const FICLONERANGE: u32 = (1 << 30)
        | ((std::mem::size_of::<super::FileCloneRange>() as u32) << 16)
        | (0x94 << 8)
        | 13;
}

// The value <linux/fs.h> gives on every architecture of the list below.
const _: () = assert!(blk::FICLONERANGE == 0x4020_940d);

/// struct file_clone_range from <linux/fs.h>.
#[repr(C)]
struct FileCloneRange {
    src_fd: i64,
    src_offset: u64,
    src_length: u64,
    dest_offset: u64,
}

#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "x86",
    target_arch = "aarch64",
    target_arch = "arm",
    target_arch = "riscv64",
    target_arch = "loongarch64",
    target_arch = "s390x"
)))]
compile_error!("BLK* ioctl numbers are only encoded for the generic _IOC layout");

/// The kernel's page size (sysconf(_SC_PAGESIZE)); 4096 if it cannot say.
pub fn page_size() -> u64 {
    // Asked once: mapped writes need it per request.
    static PAGE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf only reads its integer argument and has no preconditions.
        let r = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if r > 0 {
            r as u64
        } else {
            4096
        }
    })
}

/// Caps glibc's malloc arenas for this process (mallopt M_ARENA_MAX). By
/// default every thread that allocates may get its own arena (up to 8 per
/// core), and each keeps the large buffers freed into it: a server whose
/// blocking threads allocate I/O buffers grows by a set of buffers per
/// arena. Returns whether glibc took the setting.
pub fn limit_malloc_arenas(n: u32) -> bool {
    let n = libc::c_int::try_from(n).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt only reads its two integer arguments; called before
    // the threads that allocate are started.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, n) == 1 }
}

/// ioctl with an `int` result written through a pointer (BLKSSZGET, BLKROGET, ...).
fn ioctl_get_int(fd: BorrowedFd<'_>, req: u32) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    // SAFETY: `fd` is a valid open descriptor for the duration of the borrow;
    // these requests write exactly one `int` through the pointer, which points
    // to a live, properly aligned local.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, &mut v as *mut libc::c_int) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}

/// ioctl with an `unsigned int` result (BLKIOMIN, BLKIOOPT, BLKPBSZGET).
fn ioctl_get_uint(fd: BorrowedFd<'_>, req: u32) -> io::Result<u32> {
    let mut v: libc::c_uint = 0;
    // SAFETY: as above; these requests write one `unsigned int`.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, &mut v as *mut libc::c_uint) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}

/// ioctl taking a `uint64_t range[2]` = {offset, length} (BLKZEROOUT, BLKDISCARD).
fn ioctl_range(fd: BorrowedFd<'_>, req: u32, offset: u64, len: u64) -> io::Result<()> {
    let range: [u64; 2] = [offset, len];
    // SAFETY: `fd` is valid for the borrow; the kernel reads two u64 from the
    // pointer, which points to a live local array of exactly that shape.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, range.as_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl Sys for RealSys {
    fn pread(&self, fd: BorrowedFd<'_>, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        Ok(rustix::io::pread(fd, buf, offset)?)
    }

    fn pwrite(&self, fd: BorrowedFd<'_>, buf: &[u8], offset: u64) -> io::Result<usize> {
        Ok(rustix::io::pwrite(fd, buf, offset)?)
    }

    fn fallocate(
        &self,
        fd: BorrowedFd<'_>,
        mode: FallocMode,
        offset: u64,
        len: u64,
    ) -> io::Result<()> {
        use rustix::fs::FallocateFlags as F;
        let flags = match mode {
            FallocMode::PunchHole => F::PUNCH_HOLE | F::KEEP_SIZE,
            FallocMode::ZeroRange { keep_size: true } => F::ZERO_RANGE | F::KEEP_SIZE,
            FallocMode::ZeroRange { keep_size: false } => F::ZERO_RANGE,
            FallocMode::WriteZeroes => F::from_bits_retain(FALLOC_FL_WRITE_ZEROES),
            FallocMode::Allocate => F::empty(),
            FallocMode::AllocateKeepSize => F::KEEP_SIZE,
        };
        Ok(rustix::fs::fallocate(fd, flags, offset, len)?)
    }

    fn blkzeroout(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
        ioctl_range(fd, blk::BLKZEROOUT, offset, len)
    }

    fn blkdiscard(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
        ioctl_range(fd, blk::BLKDISCARD, offset, len)
    }

    fn seek_data(&self, fd: BorrowedFd<'_>, offset: u64) -> io::Result<Option<u64>> {
        match rustix::fs::seek(fd, rustix::fs::SeekFrom::Data(offset)) {
            Ok(o) => Ok(Some(o)),
            Err(rustix::io::Errno::NXIO) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn seek_hole(&self, fd: BorrowedFd<'_>, offset: u64) -> io::Result<Option<u64>> {
        match rustix::fs::seek(fd, rustix::fs::SeekFrom::Hole(offset)) {
            Ok(o) => Ok(Some(o)),
            Err(rustix::io::Errno::NXIO) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn fsync(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        Ok(rustix::fs::fsync(fd)?)
    }

    fn fdatasync(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        Ok(rustix::fs::fdatasync(fd)?)
    }

    fn ftruncate(&self, fd: BorrowedFd<'_>, size: u64) -> io::Result<()> {
        Ok(rustix::fs::ftruncate(fd, size)?)
    }

    fn ofd_lock(
        &self,
        fd: BorrowedFd<'_>,
        cmd: LockCmd,
        kind: LockKind,
        start: u64,
        len: u64,
    ) -> io::Result<bool> {
        let inval = || io::Error::from_raw_os_error(libc::EINVAL);
        // SAFETY: flock is a plain C struct; all-zero is a valid value of it
        // (and l_pid must be 0 for OFD locks).
        let mut l: libc::flock = unsafe { std::mem::zeroed() };
        l.l_type = match kind {
            LockKind::Read => libc::F_RDLCK,
            LockKind::Write => libc::F_WRLCK,
            LockKind::Unlock => libc::F_UNLCK,
        } as libc::c_short;
        l.l_whence = libc::SEEK_SET as libc::c_short;
        l.l_start = libc::off_t::try_from(start).map_err(|_| inval())?;
        l.l_len = libc::off_t::try_from(len).map_err(|_| inval())?;
        let cmd = match cmd {
            LockCmd::Set => libc::F_OFD_SETLK,
            LockCmd::SetWait => libc::F_OFD_SETLKW,
            LockCmd::Get => libc::F_OFD_GETLK,
        };
        // SAFETY: `fd` is valid for the borrow; the F_OFD_* commands read
        // (and GETLK writes) one struct flock through the pointer, which
        // points to a live local of that type.
        let r = unsafe { libc::fcntl(fd.as_raw_fd(), cmd, &mut l as *mut libc::flock) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(cmd == libc::F_OFD_GETLK && l.l_type != libc::F_UNLCK as libc::c_short)
    }

    fn fadvise_willneed(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
        Ok(rustix::fs::fadvise(
            fd,
            offset,
            NonZeroU64::new(len),
            rustix::fs::Advice::WillNeed,
        )?)
    }

    fn block_geometry(&self, fd: BorrowedFd<'_>) -> io::Result<BlockGeometry> {
        let mut size: u64 = 0;
        // SAFETY: `fd` is valid for the borrow; BLKGETSIZE64 writes one u64
        // (size_t on 64-bit; the request encodes sizeof(size_t)) through the
        // pointer, which points to a live, aligned local u64.
        let r = unsafe {
            libc::ioctl(
                fd.as_raw_fd(),
                blk::BLKGETSIZE64 as _,
                &mut size as *mut u64,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let ok_u32 = |v: io::Result<libc::c_int>| v.ok().and_then(|v| u32::try_from(v).ok());
        Ok(BlockGeometry {
            size,
            logical_sector: ok_u32(ioctl_get_int(fd, blk::BLKSSZGET)).filter(|&v| v > 0),
            physical_sector: ioctl_get_uint(fd, blk::BLKPBSZGET).ok().filter(|&v| v > 0),
            min_io: ioctl_get_uint(fd, blk::BLKIOMIN).ok().filter(|&v| v > 0),
            opt_io: ioctl_get_uint(fd, blk::BLKIOOPT).ok().filter(|&v| v > 0),
            read_only: ioctl_get_int(fd, blk::BLKROGET)
                .map(|v| v != 0)
                .unwrap_or(false),
        })
    }

    fn open(&self, path: &Path, how: OpenHow) -> io::Result<OwnedFd> {
        use rustix::fs::Mode;
        blocking(rustix::fs::open(
            path,
            open_flags(how),
            Mode::from_raw_mode(0o644),
        )?)
    }

    fn open_beneath(&self, dir: BorrowedFd<'_>, name: &Path, how: OpenHow) -> io::Result<OwnedFd> {
        use rustix::fs::{Mode, ResolveFlags};
        let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
        // openat2 refuses (EINVAL) a mode without O_CREAT.
        let mode = if how.create || how.create_new {
            Mode::from_raw_mode(0o644)
        } else {
            Mode::empty()
        };
        blocking(rustix::fs::openat2(
            dir,
            name,
            open_flags(how),
            mode,
            resolve,
        )?)
    }

    fn open_at(&self, dir: BorrowedFd<'_>, name: &Path, how: OpenHow) -> io::Result<OwnedFd> {
        use rustix::fs::Mode;
        blocking(rustix::fs::openat(
            dir,
            name,
            open_flags(how),
            Mode::from_raw_mode(0o644),
        )?)
    }

    fn fs_magic(&self, fd: BorrowedFd<'_>) -> io::Result<u64> {
        Ok(rustix::fs::fstatfs(fd)?.f_type as u64)
    }

    fn fstat(&self, fd: BorrowedFd<'_>) -> io::Result<FileStat> {
        let st = rustix::fs::fstat(fd)?;
        let ft = rustix::fs::FileType::from_raw_mode(st.st_mode);
        use rustix::fs::FileType as T;
        Ok(FileStat {
            type_name: match ft {
                T::RegularFile => "regular file",
                T::BlockDevice => "block device",
                T::Directory => "directory",
                T::Fifo => "FIFO",
                T::Socket => "socket",
                T::CharacterDevice => "character device",
                T::Symlink => "symbolic link",
                _ => "file of unknown type",
            },
            is_block: ft == rustix::fs::FileType::BlockDevice,
            is_regular: ft == rustix::fs::FileType::RegularFile,
            dev: st.st_dev,
            ino: st.st_ino,
            rdev: st.st_rdev,
            size: st.st_size as u64,
            blocks: st.st_blocks as u64,
            blksize: st.st_blksize as u64,
            mtime: (st.st_mtime, st.st_mtime_nsec as u32),
            ctime: (st.st_ctime, st.st_ctime_nsec as u32),
        })
    }

    fn dio_align(&self, fd: BorrowedFd<'_>) -> io::Result<Option<DioAlign>> {
        use rustix::fs::{AtFlags, StatxFlags};
        match rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN) {
            Ok(stx) => {
                if stx.stx_mask & StatxFlags::DIOALIGN.bits() == 0 {
                    return Ok(None);
                }
                Ok(Some(DioAlign {
                    mem: stx.stx_dio_mem_align,
                    offset: stx.stx_dio_offset_align,
                }))
            }
            // statx itself is missing (Linux < 4.11, some sandboxes).
            Err(rustix::io::Errno::NOSYS) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn pwrite_dsync(&self, fd: BorrowedFd<'_>, buf: &[u8], offset: u64) -> io::Result<usize> {
        Ok(rustix::io::pwritev2(
            fd,
            &[io::IoSlice::new(buf)],
            offset,
            rustix::io::ReadWriteFlags::DSYNC,
        )?)
    }

    fn pread_nowait(&self, fd: BorrowedFd<'_>, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        Ok(rustix::io::preadv2(
            fd,
            &mut [io::IoSliceMut::new(buf)],
            offset,
            rustix::io::ReadWriteFlags::NOWAIT,
        )?)
    }

    fn read_sysfs(&self, path: &Path) -> io::Result<String> {
        std::fs::read_to_string(path)
    }

    fn sync_range(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        sync_file_range(fd, offset, len, flags)
    }

    fn start_writeback(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
        sync_file_range(fd, offset, len, libc::SYNC_FILE_RANGE_WRITE)
    }

    fn splice_to_pipe(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        pipe: BorrowedFd<'_>,
        len: usize,
    ) -> io::Result<usize> {
        let mut off = offset;
        // NONBLOCK applies to the pipe only: a read of uncached pages still
        // waits for the disk (callers run on blocking threads).
        Ok(rustix::pipe::splice(
            fd,
            Some(&mut off),
            pipe,
            None,
            len,
            rustix::pipe::SpliceFlags::NONBLOCK,
        )?)
    }

    fn map_shared(&self, fd: BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh mapping at an address of the kernel's choosing
        // overlaps nothing the program uses; `fd` is valid for the borrow
        // and the mapping keeps its own reference to the file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            addr: p as usize,
            len,
        })
    }

    fn resident(&self, span: &MapSpan<'_>) -> io::Result<bool> {
        // Called per mapped write: a fixed buffer, 1 MiB of pages per call,
        // instead of an allocation sized to the write.
        let mut vec = [0u8; 256];
        let page = page_size() as usize;
        let step = vec.len() * page;
        let mut at = 0;
        while at < span.len {
            let n = (span.len - at).min(step);
            // SAFETY: [addr + at, addr + at + n) is page-aligned (spans are
            // whole pages, `step` a multiple of the page) and inside the live
            // mapping the span borrows; mincore writes one byte per page of
            // it, at most vec.len() bytes, into `vec`.
            let r = unsafe {
                libc::mincore(
                    (span.addr + at) as *mut libc::c_void,
                    n,
                    vec.as_mut_ptr() as *mut libc::c_uchar,
                )
            };
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
            if !vec[..n.div_ceil(page)].iter().all(|v| v & 1 == 1) {
                return Ok(false);
            }
            at += n;
        }
        Ok(true)
    }

    fn populate_write(&self, span: &MapSpan<'_>) -> io::Result<()> {
        self.madvise(span, libc::MADV_POPULATE_WRITE)
    }

    fn unpopulate(&self, span: &MapSpan<'_>) -> io::Result<()> {
        self.madvise(span, libc::MADV_DONTNEED)
    }

    fn recv_to_map(
        &self,
        sock: BorrowedFd<'_>,
        span: &MapSpan<'_>,
        at: usize,
        len: usize,
    ) -> io::Result<usize> {
        if at.checked_add(len).is_none_or(|end| end > span.len) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: [addr + at, addr + at + len) lies inside the span (checked
        // above), hence inside the live shared mapping it borrows. Only the kernel writes
        // it, from recv's own copy: a page it cannot fault in is EFAULT, not
        // a SIGBUS, which a store from user space could be. Nothing in the
        // program holds a reference to mapped memory.
        let r = unsafe {
            libc::recv(
                sock.as_raw_fd(),
                (span.addr + at) as *mut libc::c_void,
                len,
                libc::MSG_DONTWAIT,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(r as usize)
    }

    fn clone_range(
        &self,
        src: BorrowedFd<'_>,
        src_offset: u64,
        dst: BorrowedFd<'_>,
        dst_offset: u64,
        len: u64,
    ) -> io::Result<()> {
        let arg = FileCloneRange {
            src_fd: src.as_raw_fd() as i64,
            src_offset,
            src_length: len,
            dest_offset: dst_offset,
        };
        // SAFETY: `src` and `dst` are valid for the borrows; FICLONERANGE
        // only reads one struct file_clone_range through the pointer, which
        // points to a live local of exactly that layout.
        let r = unsafe {
            libc::ioctl(
                dst.as_raw_fd(),
                blk::FICLONERANGE as _,
                &arg as *const FileCloneRange,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn copy_file_range(
        &self,
        src: BorrowedFd<'_>,
        src_offset: u64,
        dst: BorrowedFd<'_>,
        dst_offset: u64,
        len: usize,
    ) -> io::Result<usize> {
        let (mut i, mut o) = (src_offset, dst_offset);
        Ok(rustix::fs::copy_file_range(
            src,
            Some(&mut i),
            dst,
            Some(&mut o),
            len,
        )?)
    }
}

/// The open(2) flags of `how`, always O_CLOEXEC.
fn open_flags(how: OpenHow) -> rustix::fs::OFlags {
    use rustix::fs::OFlags;
    let mut flags = OFlags::CLOEXEC;
    flags |= if how.read_only {
        OFlags::RDONLY
    } else {
        OFlags::RDWR
    };
    if how.direct {
        flags |= OFlags::DIRECT;
    }
    if how.create_new {
        flags |= OFlags::CREATE | OFlags::EXCL;
    } else if how.create {
        flags |= OFlags::CREATE;
    }
    if how.truncate {
        flags |= OFlags::TRUNC;
    }
    if how.exclusive {
        flags |= OFlags::EXCL;
    }
    if how.no_follow {
        flags |= OFlags::NOFOLLOW;
    }
    if how.directory {
        flags |= OFlags::DIRECTORY;
    }
    // Non-blocking, so a FIFO (or a device that waits for a peer) opens at
    // once and its type can be refused; `blocking` clears it before any I/O.
    flags | OFlags::NONBLOCK
}

/// Clears the O_NONBLOCK every open sets (see `open_flags`).
fn blocking(fd: OwnedFd) -> io::Result<OwnedFd> {
    use rustix::fs::{fcntl_getfl, fcntl_setfl, OFlags};
    fcntl_setfl(&fd, fcntl_getfl(&fd)? - OFlags::NONBLOCK)?;
    Ok(fd)
}

impl RealSys {
    fn madvise(&self, span: &MapSpan<'_>, advice: libc::c_int) -> io::Result<()> {
        // SAFETY: a MapSpan names whole pages inside the live shared mapping
        // it borrows (Mapping::span); these advices change no
        // memory the program holds references to: POPULATE_WRITE faults the
        // pages in, DONTNEED drops page-table entries of a file mapping
        // whose contents live on in the page cache.
        let r = unsafe { libc::madvise(span.addr as *mut libc::c_void, span.len, advice) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

fn sync_file_range(
    fd: BorrowedFd<'_>,
    offset: u64,
    len: u64,
    flags: libc::c_uint,
) -> io::Result<()> {
    let (off, n) = (
        i64::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?,
        i64::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?,
    );
    // SAFETY: sync_file_range only reads its integer arguments; `fd` is a
    // valid open descriptor for the duration of the borrow.
    let r = unsafe { libc::sync_file_range(fd.as_raw_fd(), off, n, flags) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
