//! `rawdisk checksum`: the blkhash digest of an image, the value `blksum`
//! and `nbdcopy --blkhash` print, so an image checked here can be compared
//! with one checked by those tools elsewhere.
//!
//! The construction (blkhash's own definition, checked against its
//! published test vectors in this module's tests):
//!
//! ```text
//! digest = H( H(block 1) || H(block 2) || ... || H(block N) || size )
//! ```
//!
//! Blocks are `block_size` bytes (64 KiB by default), the last one shorter
//! when the size is not a multiple and hashed as it is; `size` is the image
//! size in bytes as a 64-bit little-endian integer; H is the digest chosen.
//!
//! What makes it fast on disk images:
//! - full blocks inside runs that read as zeros (holes, zero extents) are
//!   never read: H(zero block) is computed once and reused;
//! - data that is read is checked for zeros first (a scan at memory speed
//!   that stops at the first non-zero byte), and only non-zero blocks are
//!   hashed;
//! - blocks are hashed on all cores; each worker has one read in flight and
//!   the digests are put back in order through a bounded window, so memory
//!   stays `workers × read size` whatever the image size.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use openssl::hash::{Hasher, MessageDigest};
use serde::Serialize;

use crate::endpoint::{self, Endpoint, EndpointOptions, IoBuf};
use crate::error::{Error, Result};
use crate::output::serialize_secs;
use crate::progress::Progress;
use crate::scan::is_zero;
use crate::scan::{self, ExtentCursor};

/// blkhash's default block size; other values give other digests.
pub const DEFAULT_BLOCK_SIZE: u64 = 64 << 10;

/// Segments a worker may finish ahead of the oldest unfinished one.
const WINDOW: u64 = 256;

/// Zero runs are handed out in pieces this large (progress granularity).
const ZERO_PIECE: u64 = 1 << 30;

/// Names `--list-digests` tries: OpenSSL has no listing call in the
/// bindings, so these are the fixed-size digests OpenSSL 1.1 and 3 ship
/// (blksum takes the same names); the ones this OpenSSL cannot run are left
/// out. Any other name OpenSSL knows is accepted all the same.
const KNOWN: [&str; 19] = [
    "blake2b512",
    "blake2s256",
    "md4",
    "md5",
    "md5-sha1",
    "mdc2",
    "ripemd160",
    "sha1",
    "sha224",
    "sha256",
    "sha3-224",
    "sha3-256",
    "sha3-384",
    "sha3-512",
    "sha384",
    "sha512",
    "sha512-224",
    "sha512-256",
    "sm3",
];

/// A digest OpenSSL offers, by the name the user gave (lower case), as
/// blksum takes it.
#[derive(Clone)]
pub struct DigestAlg {
    name: String,
    md: MessageDigest,
}

impl std::fmt::Debug for DigestAlg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

impl PartialEq for DigestAlg {
    fn eq(&self, other: &Self) -> bool {
        self.md.type_() == other.md.type_()
    }
}

impl Serialize for DigestAlg {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.name)
    }
}

impl Default for DigestAlg {
    fn default() -> Self {
        DigestAlg::from_name("sha256").expect("OpenSSL has sha256")
    }
}

impl DigestAlg {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The digest OpenSSL knows by this name (any case) and can compute; None
    /// for an unknown one and for extendable-output functions (shake128,
    /// shake256: no fixed size for blkhash to chain).
    pub fn from_name(s: &str) -> Option<DigestAlg> {
        let name = s.to_ascii_lowercase();
        if name.starts_with("shake") {
            return None;
        }
        let md = MessageDigest::from_name(&name)?;
        // A name of the legacy table may have no implementation loaded.
        Hasher::new(md).ok()?;
        Some(DigestAlg { name, md })
    }

    /// The digests of [`KNOWN`] this OpenSSL can compute.
    pub fn available() -> Vec<DigestAlg> {
        KNOWN
            .iter()
            .filter_map(|n| DigestAlg::from_name(n))
            .collect()
    }

    pub fn hasher(&self) -> Digester {
        Digester(Hasher::new(self.md).expect("checked by from_name"))
    }

    pub fn output_size(&self) -> usize {
        self.md.size()
    }
}

/// One running digest; `finish` resets it for the next block.
pub struct Digester(Hasher);

impl Digester {
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data).expect("OpenSSL digest update");
    }

    pub fn finish_into(&mut self, out: &mut [u8]) {
        let d = self.0.finish().expect("OpenSSL digest final");
        out.copy_from_slice(&d);
    }
}

#[derive(Debug, Clone)]
pub struct ChecksumOptions {
    pub digest: DigestAlg,
    pub block_size: u64,
    /// Worker threads; 0: one per core (at least 4 for NBD).
    pub threads: usize,
    /// Bytes per read; 0: 2 MiB (within the NBD server's maximum).
    pub read_size: u64,
    /// NBD connections when the server allows multi-conn.
    pub connections: usize,
    /// `-f raw`: checksum an image that looks like another format as raw.
    pub raw: bool,
}

impl Default for ChecksumOptions {
    fn default() -> Self {
        ChecksumOptions {
            digest: DigestAlg::default(),
            block_size: DEFAULT_BLOCK_SIZE,
            threads: 0,
            read_size: 0,
            connections: 4,
            raw: false,
        }
    }
}

/// What `checksum` computed and how.
#[derive(Debug, Clone, Serialize)]
pub struct ChecksumReport {
    /// The target's name, under the key `info` uses.
    #[serde(rename = "filename")]
    pub target: String,
    /// Hex, lower case, as sha256sum and blksum print it.
    pub checksum: String,
    pub digest: DigestAlg,
    #[serde(rename = "block-size")]
    pub block_size: u64,
    #[serde(rename = "virtual-size")]
    pub size: u64,
    /// Bytes read from the target.
    #[serde(rename = "bytes-read")]
    pub bytes_read: u64,
    /// Bytes of full blocks known to be zero without reading.
    #[serde(rename = "bytes-skipped")]
    pub bytes_skipped: u64,
    /// Bytes read that were zero blocks (not hashed).
    #[serde(rename = "bytes-zero-read")]
    pub bytes_zero_read: u64,
    pub threads: usize,
    #[serde(rename = "elapsed-seconds", serialize_with = "serialize_secs")]
    pub elapsed: Duration,
}

impl ChecksumReport {
    /// `DIGEST  TARGET`, as sha256sum and blksum print it.
    pub fn to_human(&self) -> String {
        format!("{}  {}\n", self.checksum, self.target)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }
}

/// Checks the block size: blkhash needs an even size; powers of two from
/// 4 KiB to 16 MiB keep reads aligned for every endpoint.
pub fn check_block_size(bs: u64) -> std::result::Result<(), String> {
    if !bs.is_power_of_two() || !(4096..=16 << 20).contains(&bs) {
        return Err(format!(
            "block size {bs} must be a power of two from 4K to 16M"
        ));
    }
    Ok(())
}

/// Opens a file, block device or NBD URI read-only and computes its digest.
pub fn checksum(
    spec: &str,
    opts: &ChecksumOptions,
    progress: &dyn Progress,
) -> Result<ChecksumReport> {
    check_block_size(opts.block_size).map_err(Error::msg)?;
    if spec == "-" {
        let stdin = std::io::stdin();
        return checksum_stream(spec, &mut stdin.lock(), opts)
            .map_err(|e| Error::with("checksum", e));
    }
    let ep = Endpoint::open_with(
        spec,
        &EndpointOptions {
            writable: false,
            connections: opts.connections,
            raw: opts.raw,
            ..Default::default()
        },
    )
    .map_err(|e| Error::with("checksum", e))?;
    let r = checksum_endpoint(&ep, opts, progress).map_err(|e| Error::with("checksum", e))?;
    ep.close().map_err(|e| Error::with("checksum", e))?;
    // The name as the user gave it, as sha256sum and blksum print it.
    Ok(ChecksumReport {
        target: spec.to_string(),
        ..r
    })
}

/// The digest of a stream (`-`: standard input), read in order to its end:
/// its size is what it held. One thread; every byte is read.
pub fn checksum_stream(
    name: &str,
    input: &mut dyn std::io::Read,
    opts: &ChecksumOptions,
) -> std::result::Result<ChecksumReport, endpoint::Error> {
    let t0 = Instant::now();
    let bs = opts.block_size as usize;
    let alg = &opts.digest;
    let (mut inner, mut outer) = (alg.hasher(), alg.hasher());
    let mut md = vec![0u8; alg.output_size()];
    inner.update(&vec![0u8; bs]);
    inner.finish_into(&mut md);
    let zero_md = md.clone();
    let mut buf = vec![0u8; (2 << 20).max(bs)];
    let (mut size, mut zero_read) = (0u64, 0u64);
    loop {
        let n = crate::stream::read_full(input, &mut buf)
            .map_err(|e| crate::stream::error(name, "read", size, e))?;
        if size == 0 && !opts.raw {
            if let Some(f) = rawdisk_storage::format::detect(&buf[..n], None) {
                return Err(endpoint::Error {
                    endpoint: name.to_string(),
                    errno: None,
                    message: rawdisk_storage::format::refusal(name, f),
                    nbd: None,
                });
            }
        }
        for block in buf[..n].chunks(bs) {
            if block.len() == bs && is_zero(block) {
                zero_read += bs as u64;
                outer.update(&zero_md);
                continue;
            }
            inner.update(block);
            inner.finish_into(&mut md);
            outer.update(&md);
        }
        size += n as u64;
        if n < buf.len() {
            break;
        }
    }
    outer.update(&size.to_le_bytes());
    outer.finish_into(&mut md);
    Ok(ChecksumReport {
        target: name.to_string(),
        checksum: hex(&md),
        digest: alg.clone(),
        block_size: opts.block_size,
        size,
        bytes_read: size,
        bytes_skipped: 0,
        bytes_zero_read: zero_read,
        threads: 1,
        elapsed: t0.elapsed(),
    })
}

/// One piece of the plan: `count` full zero blocks from block `first`, or
/// the blocks in `[offset, offset + len)` to read.
#[derive(Debug, Clone, Copy)]
enum Seg {
    Zero { count: u64 },
    Data { offset: u64, len: u64 },
}

struct Planner<'a> {
    cursor: ExtentCursor<'a>,
    size: u64,
    bs: u64,
    /// End of the full blocks: the last partial block is always read.
    full_end: u64,
    read_size: u64,
    pos: u64,
    seq: u64,
}

impl Planner<'_> {
    /// Full zero blocks from `off` (a block boundary), at most `max`.
    fn zero_blocks(&mut self, off: u64, max: u64) -> std::result::Result<u64, endpoint::Error> {
        if off >= self.full_end {
            return Ok(0);
        }
        let limit = self.full_end.min(off.saturating_add(max * self.bs));
        let z = self.cursor.zero_until(off, limit)?;
        Ok((z - off) / self.bs)
    }

    fn next(&mut self) -> std::result::Result<Option<(u64, Seg)>, endpoint::Error> {
        if self.pos >= self.size {
            return Ok(None);
        }
        let off = self.pos;
        let z = self.zero_blocks(off, ZERO_PIECE / self.bs)?;
        let seg = if z > 0 {
            self.pos += z * self.bs;
            Seg::Zero { count: z }
        } else {
            // Data up to the next read-size boundary, the next full zero
            // block, or the end.
            let mut end = (off + self.bs).min(self.size);
            while end < self.size
                && !end.is_multiple_of(self.read_size)
                && self.zero_blocks(end, 1)? == 0
            {
                end = (end + self.bs).min(self.size);
            }
            self.pos = end;
            Seg::Data {
                offset: off,
                len: end - off,
            }
        };
        let seq = self.seq;
        self.seq += 1;
        Ok(Some((seq, seg)))
    }
}

/// Finished segments, folded into the outer hash in order.
struct Ordered {
    next: u64,
    done: BTreeMap<u64, Done>,
    outer: Digester,
}

enum Done {
    Zero(u64),
    Digests(Vec<u8>),
}

struct Shared<'a> {
    planner: Mutex<Planner<'a>>,
    ordered: Mutex<Ordered>,
    /// Signalled when `ordered.next` moves or a worker fails.
    moved: Condvar,
    failed: AtomicBool,
    error: Mutex<Option<endpoint::Error>>,
    /// H(block of zeros), repeated so zero runs are hashed in few calls.
    zero_run: Vec<u8>,
    md_len: usize,
    read: AtomicU64,
    skipped: AtomicU64,
    zero_read: AtomicU64,
}

impl Shared<'_> {
    fn fail(&self, e: endpoint::Error) {
        self.failed.store(true, Ordering::SeqCst);
        let mut g = self.error.lock().unwrap();
        if g.is_none() {
            *g = Some(e);
        }
        drop(g);
        // Wake workers waiting for the window; they see `failed` and stop.
        let _o = self.ordered.lock().unwrap();
        self.moved.notify_all();
    }

    /// The next segment, once it is inside the window.
    fn take(&self) -> Option<(u64, Seg)> {
        if self.failed.load(Ordering::SeqCst) {
            return None;
        }
        let mut p = self.planner.lock().unwrap();
        let item = match p.next() {
            Ok(Some(item)) => item,
            Ok(None) => return None,
            Err(e) => {
                drop(p);
                self.fail(e);
                return None;
            }
        };
        let mut o = self.ordered.lock().unwrap();
        while item.0 >= o.next + WINDOW && !self.failed.load(Ordering::SeqCst) {
            o = self.moved.wait(o).unwrap();
        }
        drop(o);
        drop(p);
        (!self.failed.load(Ordering::SeqCst)).then_some(item)
    }

    fn finish(&self, seq: u64, done: Done) {
        let mut o = self.ordered.lock().unwrap();
        o.done.insert(seq, done);
        let start = o.next;
        loop {
            let n = o.next;
            let Some(d) = o.done.remove(&n) else { break };
            match d {
                Done::Zero(count) => {
                    let per = (self.zero_run.len() / self.md_len) as u64;
                    let mut left = count;
                    while left > 0 {
                        let k = left.min(per);
                        o.outer.update(&self.zero_run[..k as usize * self.md_len]);
                        left -= k;
                    }
                }
                Done::Digests(v) => o.outer.update(&v),
            }
            o.next += 1;
        }
        if o.next != start {
            self.moved.notify_all();
        }
    }
}

/// Computes the digest of an open endpoint.
pub fn checksum_endpoint(
    ep: &Endpoint,
    opts: &ChecksumOptions,
    progress: &dyn Progress,
) -> std::result::Result<ChecksumReport, endpoint::Error> {
    let t0 = Instant::now();
    let bs = opts.block_size;
    let size = ep.size();
    let alg = &opts.digest;
    let md_len = alg.output_size();
    let mut h = alg.hasher();
    let mut zero_md = vec![0u8; md_len];
    h.update(&vec![0u8; bs as usize]);
    h.finish_into(&mut zero_md);
    let read_size = {
        let want = if opts.read_size == 0 {
            2 << 20
        } else {
            opts.read_size
        };
        let r = want.min(ep.max_io()).max(bs);
        r - r % bs
    };
    let workers = scan::workers(opts.threads, ep.is_nbd());
    let shared = Shared {
        planner: Mutex::new(Planner {
            cursor: ExtentCursor::new(ep, size),
            size,
            bs,
            full_end: size - size % bs,
            read_size,
            pos: 0,
            seq: 0,
        }),
        ordered: Mutex::new(Ordered {
            next: 0,
            done: BTreeMap::new(),
            outer: alg.hasher(),
        }),
        moved: Condvar::new(),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        zero_run: zero_md.repeat(4096),
        md_len,
        read: AtomicU64::new(0),
        skipped: AtomicU64::new(0),
        zero_read: AtomicU64::new(0),
    };
    tracing::debug!(size, bs, read_size, workers, "checksum {}", ep.name());
    progress.start("checksum", size);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let mut hasher = alg.hasher();
                let mut md = vec![0u8; md_len];
                let mut buf = IoBuf::new(read_size as usize, ep.min_block().max(4096) as usize);
                while let Some((seq, seg)) = shared.take() {
                    let done = match seg {
                        Seg::Zero { count } => {
                            shared.skipped.fetch_add(count * bs, Ordering::Relaxed);
                            progress.advance(count * bs);
                            Done::Zero(count)
                        }
                        Seg::Data { offset, len } => {
                            buf.set_len(len as usize);
                            // One request unless a block is larger than the
                            // server allows in one.
                            let r = if len > ep.max_io() {
                                ep.read_at(buf.as_mut_slice(), offset)
                            } else {
                                ep.read_buf(&mut buf, offset)
                            };
                            if let Err(e) = r {
                                shared.fail(e);
                                break;
                            }
                            shared.read.fetch_add(len, Ordering::Relaxed);
                            let mut out = Vec::with_capacity(len.div_ceil(bs) as usize * md_len);
                            for block in buf.as_slice().chunks(bs as usize) {
                                if block.len() as u64 == bs && is_zero(block) {
                                    shared.zero_read.fetch_add(bs, Ordering::Relaxed);
                                    out.extend_from_slice(&zero_md);
                                } else {
                                    hasher.update(block);
                                    hasher.finish_into(&mut md);
                                    out.extend_from_slice(&md);
                                }
                            }
                            progress.advance(len);
                            Done::Digests(out)
                        }
                    };
                    shared.finish(seq, done);
                }
            });
        }
    });
    progress.finish();
    if let Some(e) = shared.error.into_inner().unwrap() {
        return Err(e);
    }
    let mut o = shared.ordered.into_inner().unwrap();
    let planned = shared.planner.into_inner().unwrap().seq;
    assert!(
        o.next == planned && o.done.is_empty(),
        "checksum: {} of {planned} segments folded",
        o.next
    );
    o.outer.update(&size.to_le_bytes());
    let mut out = vec![0u8; md_len];
    o.outer.finish_into(&mut out);
    Ok(ChecksumReport {
        target: ep.name(),
        checksum: hex(&out),
        digest: alg.clone(),
        block_size: bs,
        size,
        bytes_read: shared.read.into_inner(),
        bytes_skipped: shared.skipped.into_inner(),
        bytes_zero_read: shared.zero_read.into_inner(),
        threads: workers,
        elapsed: t0.elapsed(),
    })
}

pub fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_names() {
        let all = DigestAlg::available();
        for d in &all {
            assert_eq!(DigestAlg::from_name(d.name()).as_ref(), Some(d));
        }
        for n in [
            "sha256",
            "sha1",
            "md5",
            "blake2b512",
            "sha512",
            "blake2s256",
        ] {
            assert!(all.iter().any(|d| d.name() == n), "{n}");
        }
        let upper = DigestAlg::from_name("SHA256").unwrap();
        assert_eq!(upper.name(), "sha256");
        assert!(DigestAlg::from_name("shake128").is_none());
        assert!(DigestAlg::from_name("sha257").is_none());
        assert_eq!(
            DigestAlg::from_name("blake2b512").unwrap().output_size(),
            64
        );
        assert_eq!(DigestAlg::from_name("md5").unwrap().output_size(), 16);
    }

    #[test]
    fn block_sizes() {
        assert!(check_block_size(64 << 10).is_ok());
        assert!(check_block_size(4096).is_ok());
        assert!(check_block_size(16 << 20).is_ok());
        for bad in [0, 1, 2048, 3 << 12, 32 << 20] {
            assert!(check_block_size(bad).is_err(), "{bad}");
        }
    }
}
