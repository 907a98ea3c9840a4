//! Trying the methods on purpose (for `rawdisk probe` and `info`) instead of
//! waiting for the first real request to teach us.
//!
//! Regular files can be probed without touching data: with KEEP_SIZE,
//! fallocate past the end of the file changes neither the size nor any byte
//! that can be read, and whatever it allocated there is punched away again.
//! Block devices have no such place: they are probed only on a scratch range
//! the caller gives up (its data is destroyed), and otherwise learn by use.
//! The device's queue limits ([`Target::block_queue_limits`]) are a hint, not
//! proof: a loop device on tmpfs advertises write-zeroes until first use.

use std::io;

use super::zero::Try;
use super::{Kind, Target};
use crate::caps::{Method, Tri};
use crate::errno::{is_unsupported, retry};
use crate::error::{Error, Result};
use crate::sys::FallocMode;

/// What probing one method found.
#[derive(Debug)]
pub struct Probe {
    pub method: Method,
    /// Works or Fails (learned, shared with every handle), or the real error
    /// the call returned (nothing learned).
    pub result: std::result::Result<Tri, Error>,
}

/// Bytes tried per method.
const PROBE_LEN: u64 = 64 << 10;

impl Target {
    /// Try every zero/trim/allocate/map method this kind of target has and
    /// learn the answers (also visible through [`Target::caps`]).
    ///
    /// `scratch`: a range whose data the caller does not need; every method
    /// is run on it (regular files: PUNCH_HOLE, ZERO_RANGE, PUNCH_HOLE +
    /// fallocate(0); block devices: PUNCH_HOLE, ZERO_RANGE, BLKZEROOUT,
    /// BLKDISCARD on its sector-aligned part). It ends up zero or discarded.
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
            (Kind::File, Some((off, len))) => {
                self.check_range("probe", off, len)?;
                let _l = self.direct.as_ref().map(|d| d.lock_span(off, len));
                for m in [Method::PunchHole, Method::ZeroRange] {
                    out.push(self.probe_one(m, || self.try_falloc(m, off, len)));
                }
                out.push(self.probe_one(Method::PunchAlloc, || self.try_punch_alloc(off, len)));
            }
            (Kind::Block, None) => {}
            (Kind::Block, Some((off, len))) => {
                self.check_range("probe", off, len)?;
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
                let n = (e - s).min(self.max_call_aligned());
                let _l = self.direct.as_ref().map(|d| d.lock_span(s, n));
                for m in [Method::PunchHole, Method::ZeroRange] {
                    out.push(self.probe_one(m, || self.try_falloc(m, s, n)));
                }
                out.push(self.probe_one(Method::BlkZeroout, || {
                    let r = retry(|| self.sys.blkzeroout(self.fd(), s, n));
                    self.judge(Method::BlkZeroout, s, n, r)
                }));
                out.push(self.probe_one(Method::BlkDiscard, || {
                    let r = retry(|| self.sys.blkdiscard(self.fd(), s, n));
                    self.judge(Method::BlkDiscard, s, n, r)
                }));
            }
        }
        if self.kind == Kind::File {
            out.push(self.probe_seek());
        }
        Ok(out)
    }

    fn probe_one(&self, m: Method, f: impl FnOnce() -> Result<Try>) -> Probe {
        let result = f().map(|t| match t {
            Try::Done => Tri::Works,
            Try::Unsupported => Tri::Fails,
        });
        // A try that fails part-way (punch-alloc) learns the parts; report
        // the method's own state.
        let result = result.map(|_| self.caps.get(m));
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
        out.push(self.probe_one(Method::Fallocate, || {
            let r = retry(|| {
                self.sys
                    .fallocate(self.fd(), FallocMode::AllocateKeepSize, off, n)
            });
            let t = self.judge(Method::Fallocate, off, n, r);
            free();
            t
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
        let r = retry(|| self.sys.seek_data(self.fd(), 0));
        let result = match r {
            Ok(_) => {
                self.learn(Method::SeekHole, Tri::Works, None);
                Ok(Tri::Works)
            }
            Err(e) if is_unsupported(&e, Method::SeekHole.einval()) => {
                self.learn(Method::SeekHole, Tri::Fails, Some(&e));
                Ok(Tri::Fails)
            }
            Err(e) => Err(Error::new("probe (SEEK_DATA)", 0, 0, e)),
        };
        Probe {
            method: Method::SeekHole,
            result,
        }
    }
}
