//! Trying the methods on purpose (for `rawdisk probe` and `info`) instead of
//! waiting for the first real request to teach us. Every try runs the very
//! call the zero chain makes and is judged by the same rules (errno.rs), so
//! what a probe reports is what the engine learns.
//!
//! Two ways to try a method:
//! - [`Target::try_method`] and friends: on data written for the try, then
//!   read back and measured ([`Trial`]); the data is destroyed. `rawdisk
//!   probe` reports these, on a scratch file or (`--destructive`) on the
//!   device.
//! - [`Target::probe_methods`]: every method at once, either on a scratch
//!   range the caller gives up or, for regular files, past the end of the
//!   file without changing a byte that can be read: with KEEP_SIZE,
//!   fallocate past the end changes neither the size nor the contents, and
//!   what it allocated there is freed again (WRITE_ZEROES, which cannot
//!   keep the size, is left to be learned by use). Block devices have no such
//!   place and otherwise learn by use. Their queue limits
//!   ([`Target::block_queue_limits`]) are a hint, not proof: a loop device on
//!   tmpfs advertises write-zeroes until first use (see docs/capabilities.md,
//!   tmpfs-backed loop devices).

use std::io;
use std::os::fd::AsFd;
use std::path::Path;

use super::zero::Try;
use super::{Kind, Target};
use crate::caps::{Method, Tri};
use crate::errno::{is_unsupported, retry, Einval};
use crate::error::{Error, Result};
use crate::sys::{FallocMode, OpenHow, RealSys, Sys};

/// What probing one method found.
#[derive(Debug)]
pub struct Probe {
    pub method: Method,
    /// Works or Fails (learned, shared with every handle), or the real error
    /// the call returned (nothing learned).
    pub result: std::result::Result<Tri, Error>,
}

/// What trying one call found.
#[derive(Debug)]
pub enum Trial<T = Seen> {
    /// The call worked; what it left.
    Works(T),
    /// The storage does not support it (learned): the errno that said so.
    Unsupported(io::Error),
    /// The call failed otherwise; nothing learned.
    Failed(io::Error),
    /// Writing the data to try it on failed: not tried.
    NotTried(io::Error),
}

/// The range a zeroing call worked on, after it.
#[derive(Debug)]
pub struct Seen {
    /// Whether the range reads back as zeros (Err: reading it back failed).
    pub reads_zero: io::Result<bool>,
    /// Bytes allocated to the file (st_blocks * 512) before and after the
    /// call; 0 when fstat fails (and always for a block device node).
    pub allocated: (u64, u64),
    /// The target's size after the call.
    pub size: u64,
}

/// Bytes tried per method past the end of a file.
const PROBE_LEN: u64 = 64 << 10;

/// Non-zero bytes that depend on the offset, so a method that zeroed or
/// moved the wrong range is caught.
fn pattern(off: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (off + i).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56;
            (x as u8) | 1
        })
        .collect()
}

impl Target {
    /// The methods [`Target::try_method`] tries on this kind of target, in
    /// the order a probe should try them. On a block device PUNCH_HOLE comes
    /// first: on a loop device whose backing file system has no ZERO_RANGE
    /// the first write-zeroes without unmap fails and the driver turns the
    /// offload off, so trying it first shows the device as it will behave.
    pub fn trial_methods(&self) -> &'static [Method] {
        match self.kind {
            Kind::File => &[
                Method::PunchHole,
                Method::FallocWriteZeroes,
                Method::ZeroRange,
                Method::PunchAlloc,
            ],
            Kind::Block => &[
                Method::PunchHole,
                Method::ZeroRange,
                Method::BlkZeroout,
                Method::BlkDiscard,
            ],
        }
    }

    /// Write data over [offset, offset+len), make it durable, run the call
    /// of `m` (one of [`Target::trial_methods`]) on it as the zero chain
    /// would, learning the same way, and read the range back. The data in
    /// the range is destroyed.
    pub fn try_method(&self, m: Method, offset: u64, len: u64) -> Trial {
        if let Err(e) = self
            .write_at(&pattern(offset, len as usize), offset, false)
            .and_then(|()| self.flush())
        {
            return Trial::NotTried(e.source);
        }
        let before = self.allocated_bytes().unwrap_or(0);
        let r = {
            let _l = self.direct.as_ref().map(|d| d.lock_span(offset, len));
            match m {
                Method::PunchAlloc => self.try_punch_alloc(offset, len),
                Method::BlkZeroout => {
                    let r = retry(|| self.sys.blkzeroout(self.fd(), offset, len));
                    self.judge(m, offset, len, r)
                }
                Method::BlkDiscard => {
                    let r = retry(|| self.sys.blkdiscard(self.fd(), offset, len));
                    self.judge(m, offset, len, r)
                }
                _ => self.try_falloc(m, offset, len),
            }
        };
        self.trial(r, offset, len, before)
    }

    /// fallocate(0) of [offset, offset+len), which grows a file whose end
    /// is inside or before the range (preallocation=falloc).
    pub fn try_allocate(&self, offset: u64, len: u64) -> Trial {
        let before = self.allocated_bytes().unwrap_or(0);
        let r = retry(|| {
            self.sys
                .fallocate(self.fd(), FallocMode::Allocate, offset, len)
        });
        self.trial(
            self.judge(Method::Fallocate, offset, len, r),
            offset,
            len,
            before,
        )
    }

    /// lseek(SEEK_HOLE) from `offset`: where the next hole starts (None: at
    /// or past the end).
    pub fn try_seek_hole(&self, offset: u64) -> Trial<Option<u64>> {
        self.learn_seek(retry(|| self.sys.seek_hole(self.fd(), offset)))
    }

    /// Learn SEEK_HOLE/SEEK_DATA from the answer of one lseek.
    fn learn_seek<T>(&self, r: io::Result<T>) -> Trial<T> {
        match r {
            Ok(h) => {
                self.learn(Method::SeekHole, Tri::Works, None);
                Trial::Works(h)
            }
            Err(e) if is_unsupported(&e, Method::SeekHole.einval()) => {
                self.learn(Method::SeekHole, Tri::Fails, Some(&e));
                Trial::Unsupported(e)
            }
            Err(e) => Trial::Failed(e),
        }
    }

    /// Open `path` read-only with O_DIRECT (cache=none): works, with the
    /// alignment STATX_DIOALIGN reports (None where the kernel or file
    /// system does not say), or refused. ramfs, and tmpfs before Linux 6.6,
    /// refuse it with EINVAL at open.
    pub fn try_direct_io(path: &Path) -> Trial<Option<u32>> {
        let how = OpenHow {
            read_only: true,
            direct: true,
            ..OpenHow::default()
        };
        match RealSys.open(path, how) {
            Ok(fd) => Trial::Works(
                RealSys
                    .dio_align(fd.as_fd())
                    .ok()
                    .flatten()
                    .map(|a| a.offset),
            ),
            Err(e) if is_unsupported(&e, Einval::Unsupported) => Trial::Unsupported(e),
            Err(e) => Trial::Failed(e),
        }
    }

    /// The [`Trial`] of a zeroing call judged as the zero chain judges it.
    fn trial(&self, r: Result<Try>, offset: u64, len: u64, allocated_before: u64) -> Trial {
        match r {
            Ok(Try::Done) => Trial::Works(self.seen(offset, len, allocated_before)),
            Ok(Try::Unsupported(e)) => Trial::Unsupported(e),
            Err(e) => Trial::Failed(e.source),
        }
    }

    fn seen(&self, offset: u64, len: u64, allocated_before: u64) -> Seen {
        let mut buf = vec![0u8; len as usize];
        let reads_zero = match self.read_at(&mut buf, offset) {
            Ok(()) => Ok(buf.iter().all(|&b| b == 0)),
            Err(e) => Err(e.source),
        };
        Seen {
            reads_zero,
            allocated: (allocated_before, self.allocated_bytes().unwrap_or(0)),
            size: self.size(),
        }
    }

    /// Try every zero/trim/allocate/map method this kind of target has and
    /// learn the answers (also visible through [`Target::caps`]).
    ///
    /// `scratch`: a range whose data the caller does not need; each of
    /// [`Target::trial_methods`] is tried on it in turn by
    /// [`Target::try_method`] (block devices: on its sector-aligned part).
    /// It ends up zero or discarded.
    ///
    /// Without `scratch`, regular files are probed past their end with
    /// KEEP_SIZE: size and contents unchanged, the blocks allocated there
    /// freed again (an extent-tree block the file system added may stay).
    /// Do not run this while another process grows the file. Block devices
    /// without `scratch` only report what is known.
    pub fn probe_methods(&self, scratch: Option<(u64, u64)>) -> Result<Vec<Probe>> {
        self.check_writable("probe", 0, 0)?;
        let mut out = Vec::new();
        match (self.kind, scratch) {
            (Kind::File, None) => self.probe_file_past_end(&mut out)?,
            (Kind::Block, None) => {}
            (kind, Some((off, len))) => {
                self.check_range("probe", off, len)?;
                let (s, n) = match kind {
                    Kind::File => (off, len),
                    Kind::Block => {
                        let a = self.offload_align;
                        let (s, e) = (off.div_ceil(a) * a, (off + len) / a * a);
                        if s >= e {
                            return Err(Error::new(
                                "probe",
                                off,
                                len,
                                io::Error::new(
                                    io::ErrorKind::InvalidInput,
                                    format!("scratch range holds no whole {a}-byte block"),
                                ),
                            ));
                        }
                        (s, (e - s).min(self.max_call_aligned()))
                    }
                };
                for &m in self.trial_methods() {
                    let result = match self.try_method(m, s, n) {
                        // A try that fails part-way (punch-alloc) learns the
                        // parts; report the method's own state.
                        Trial::Works(_) | Trial::Unsupported(_) => Ok(self.caps.get(m)),
                        Trial::Failed(e) => Err(Error::new("probe", s, n, e)),
                        Trial::NotTried(e) => Err(Error::new("probe (write)", s, n, e)),
                    };
                    out.push(Probe { method: m, result });
                }
            }
        }
        if self.kind == Kind::File {
            out.push(self.probe_seek());
        }
        Ok(out)
    }

    fn probe_one(&self, m: Method, f: impl FnOnce() -> Result<Try>) -> Probe {
        // A try that fails part-way (punch-alloc) learns the parts; report
        // the method's own state.
        let result = f().map(|_| self.caps.get(m));
        Probe { method: m, result }
    }

    fn probe_file_past_end(&self, out: &mut Vec<Probe>) -> Result<()> {
        let size = self
            .file_size()
            .map_err(|e| Error::new("probe (fstat)", 0, 0, e))?;
        let mib = 1 << 20;
        let off = size.div_ceil(mib) * mib + mib;
        let n = PROBE_LEN;
        let punch = self.probe_one(Method::PunchHole, || {
            self.try_falloc(Method::PunchHole, off, n)
        });
        out.push(punch);
        // Whatever ZERO_RANGE / fallocate allocated past the end is freed
        // again by ftruncate to the same size (ext4, XFS and tmpfs drop
        // blocks past EOF on truncate). Not by PUNCH_HOLE: ext4 ignores
        // punches that start past EOF.
        let free = || {
            if let Err(e) = retry(|| self.sys.ftruncate(self.fd(), size)) {
                tracing::warn!(
                    path = %self.path.display(),
                    "probe: could not free the space allocated past the end: {e}"
                );
            }
        };
        out.push(self.probe_one(Method::ZeroRange, || {
            let r = self.try_falloc(Method::ZeroRange, off, n);
            free();
            r
        }));
        // WRITE_ZEROES cannot keep the size (the kernel refuses KEEP_SIZE
        // with it), so past the end it would grow the file: learned by use.
        out.push(self.probe_one(Method::Fallocate, || {
            let r = retry(|| {
                self.sys
                    .fallocate(self.fd(), FallocMode::AllocateKeepSize, off, n)
            });
            free();
            match r {
                // KEEP_SIZE is only the probe's way not to grow the file; a
                // refusal says nothing of mode 0, which the engine uses (the
                // NFS 4.2 client has mode 0 and PUNCH_HOLE | KEEP_SIZE only):
                // not learned, left to be learned by use.
                Err(e) if is_unsupported(&e, Method::Fallocate.einval()) => Ok(Try::Unsupported(e)),
                r => self.judge(Method::Fallocate, off, n, r),
            }
        }));
        // PUNCH_HOLE + fallocate(0) works exactly when both parts do.
        let pa = match (
            self.caps.get(Method::PunchHole),
            self.caps.get(Method::Fallocate),
        ) {
            (Tri::Works, Tri::Works) => Tri::Works,
            (Tri::Fails, _) | (_, Tri::Fails) => Tri::Fails,
            _ => Tri::Unknown,
        };
        if pa != Tri::Unknown {
            self.learn(Method::PunchAlloc, pa, None);
            out.push(Probe {
                method: Method::PunchAlloc,
                result: Ok(pa),
            });
        }
        Ok(())
    }

    fn probe_seek(&self) -> Probe {
        let result = match self.learn_seek(retry(|| self.sys.seek_data(self.fd(), 0))) {
            Trial::Works(_) => Ok(Tri::Works),
            Trial::Unsupported(_) => Ok(Tri::Fails),
            Trial::Failed(e) | Trial::NotTried(e) => Err(Error::new("probe (SEEK_DATA)", 0, 0, e)),
        };
        Probe {
            method: Method::SeekHole,
            result,
        }
    }
}
