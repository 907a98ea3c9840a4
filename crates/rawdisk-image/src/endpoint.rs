//! One side of an image command: a local file or block device (the storage
//! engine's [`Target`]) or an NBD export (the protocol crate's client), behind
//! one synchronous API that `map`, `info` and `copy` share.
//!
//! The NBD client is asynchronous; its reader tasks run on one process-wide
//! runtime ([`runtime`]) and the methods here block on it. Calling them from
//! many threads at once keeps that many NBD requests in flight: the copy
//! engine does exactly that.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rawdisk_nbd::client::{self, Client, ConnectOptions, ExportInfo};
use rawdisk_nbd::uri::{looks_like_nbd_uri, NbdUri};
use rawdisk_storage::format::{self, Format};
use rawdisk_storage::{CacheMode, ExtentKind, Kind, OpenOptions, Target, ZeroFlags};

/// A failed operation on an endpoint: which endpoint, and the operation's own
/// message (which names the operation, offset, length and errno).
#[derive(Debug, Clone)]
pub struct Error {
    pub endpoint: String,
    pub message: String,
    /// The errno (local) or NBD error (remote), when there is one.
    pub errno: Option<i32>,
    /// The NBD client's error this came from, to match on (copy's retry
    /// tells a dropped connection from a refusal by it).
    pub nbd: Option<Box<client::Error>>,
}

pub type Result<T> = std::result::Result<T, Error>;

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The object once: a message whose first part already names the
        // endpoint ("'U': unknown parameter", "open PATH: ...") is not
        // prefixed; a cause deeper in the message does not count.
        let head = self.message.split(": ").next().unwrap_or("");
        if head.contains(&self.endpoint) {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.endpoint, self.message)
        }
    }
}

impl std::error::Error for Error {}

/// The text of a failed open, worded the same in every command: a directory
/// opened for writing fails with EISDIR, for reading the engine refuses it as
/// "it is a directory, not a regular file or block device"; both are said
/// the second way.
pub fn open_error_message(path: &Path, e: &rawdisk_storage::Error) -> String {
    if e.errno() == Some(libc::EISDIR) {
        format!(
            "open {}: it is a directory, not a regular file or block device",
            path.display()
        )
    } else {
        e.to_string()
    }
}

/// The runtime NBD connections live on (two worker threads: the reader tasks
/// only move bytes).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("rawdisk-nbd")
            .enable_all()
            .build()
            .expect("cannot start the NBD runtime")
    })
}

/// How to open an endpoint.
#[derive(Debug, Clone)]
pub struct EndpointOptions {
    pub writable: bool,
    /// Local targets: page cache or O_DIRECT.
    pub cache: CacheMode,
    /// NBD: connections to open when the server allows multi-conn.
    pub connections: usize,
    /// NBD: give up connecting and negotiating after this long (None: the
    /// client's default).
    pub connect_timeout: Option<Duration>,
    /// NBD: abandon a connection whose server has not answered for this
    /// long while requests wait; its requests fail as on a dropped
    /// connection (None: wait forever).
    pub request_timeout: Option<Duration>,
    /// NBD: metadata contexts to select besides base:allocation, for
    /// [`Endpoint::context_status`]; the connection fails without them.
    pub extra_contexts: Vec<String>,
    /// NBD: metadata context queries to list at connect time (the answer
    /// is in [`Endpoint::nbd_info`]).
    pub list_contexts: Vec<String>,
    /// The user said the image is raw (`-f raw`): read-only opens take its
    /// bytes as raw whatever they look like. Otherwise an input that looks
    /// like another image format is refused ([`Endpoint::open_with`]).
    pub raw: bool,
}

impl Default for EndpointOptions {
    fn default() -> Self {
        EndpointOptions {
            writable: false,
            cache: CacheMode::Writeback,
            connections: 1,
            connect_timeout: None,
            request_timeout: None,
            extra_contexts: Vec::new(),
            list_contexts: Vec::new(),
            raw: false,
        }
    }
}

/// One run of a map: `data` is false for a hole (unallocated), `zero` true
/// when the run is known to read as zeros (qemu-img map's `data`/`zero`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapExtent {
    pub offset: u64,
    pub len: u64,
    pub data: bool,
    pub zero: bool,
}

pub enum Endpoint {
    Local { path: PathBuf, target: Arc<Target> },
    Nbd { uri: NbdUri, client: Arc<Client> },
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Endpoint({})", self.name())
    }
}

/// Whether a command-line argument names an NBD export rather than a path.
pub fn is_nbd(spec: &str) -> bool {
    looks_like_nbd_uri(spec)
}

impl Endpoint {
    /// A path or an NBD URI, read-only or writable, with defaults otherwise.
    pub fn open(spec: &str, writable: bool) -> Result<Endpoint> {
        Endpoint::open_with(
            spec,
            &EndpointOptions {
                writable,
                ..Default::default()
            },
        )
    }

    /// An input (opened read-only) that looks like another image format is
    /// refused unless `opts.raw`; a destination (writable) is not looked at,
    /// it is overwritten.
    pub fn open_with(spec: &str, opts: &EndpointOptions) -> Result<Endpoint> {
        let ep = if is_nbd(spec) {
            let uri = NbdUri::parse(spec).map_err(|e| Error {
                endpoint: spec.to_string(),
                message: e.to_string(),
                errno: None,
                nbd: None,
            })?;
            Endpoint::connect(uri, opts)?
        } else {
            Endpoint::open_local(Path::new(spec), opts, false)?
        };
        if !opts.writable && !opts.raw {
            ep.refuse_other_format()?;
        }
        Ok(ep)
    }

    /// What the endpoint looks like, from its first and last bytes (None:
    /// raw, or nothing recognised).
    pub fn looks_like(&self) -> Result<Option<Format>> {
        let size = self.size();
        // A server with a minimum block size refuses the unaligned tail.
        let a = self.min_block();
        format::probe(size, |b, at| {
            let start = at / a * a;
            let end = (at + b.len() as u64)
                .div_ceil(a)
                .saturating_mul(a)
                .min(size);
            if (start, end) == (at, at + b.len() as u64) {
                return self.read_at(b, at);
            }
            let mut v = vec![0u8; (end - start) as usize];
            self.read_at(&mut v, start)?;
            let from = (at - start) as usize;
            b.copy_from_slice(&v[from..from + b.len()]);
            Ok(())
        })
    }

    /// Fails with the one line of [`format::refusal`] when the endpoint
    /// looks like another image format.
    pub fn refuse_other_format(&self) -> Result<()> {
        match self.looks_like()? {
            None => Ok(()),
            Some(f) => {
                let _ = self.close();
                Err(Error {
                    endpoint: self.name(),
                    message: format::refusal(&self.name(), f),
                    errno: None,
                    nbd: None,
                })
            }
        }
    }

    /// Opens a local target; `create` creates a missing regular file.
    pub fn open_local(path: &Path, opts: &EndpointOptions, create: bool) -> Result<Endpoint> {
        let target = Target::open(
            path,
            &OpenOptions {
                read_only: !opts.writable,
                cache: opts.cache,
                create,
                ..Default::default()
            },
        )
        .map_err(|e| Error {
            endpoint: path.display().to_string(),
            errno: e.errno(),
            message: open_error_message(path, &e),
            nbd: None,
        })?;
        Ok(Endpoint::Local {
            path: path.to_path_buf(),
            target: Arc::new(target),
        })
    }

    pub fn connect(uri: NbdUri, opts: &EndpointOptions) -> Result<Endpoint> {
        let mut copts = ConnectOptions {
            connections: opts.connections.max(1),
            request_timeout: opts.request_timeout,
            extra_contexts: opts.extra_contexts.clone(),
            list_contexts: opts.list_contexts.clone(),
            ..Default::default()
        };
        if let Some(t) = opts.connect_timeout {
            copts.timeout = t;
        }
        let client = connect_capped(&uri, copts).map_err(|e| nbd_err(&uri.to_string(), e))?;
        if opts.writable && client.info().read_only() {
            return Err(Error {
                endpoint: uri.to_string(),
                message: "the NBD export is read-only".into(),
                errno: Some(libc_eperm()),
                nbd: None,
            });
        }
        Ok(Endpoint::Nbd {
            uri,
            client: Arc::new(client),
        })
    }

    /// The path or URI, for messages.
    pub fn name(&self) -> String {
        match self {
            Endpoint::Local { path, .. } => path.display().to_string(),
            Endpoint::Nbd { uri, .. } => uri.to_string(),
        }
    }

    pub fn is_nbd(&self) -> bool {
        matches!(self, Endpoint::Nbd { .. })
    }

    pub fn is_block_device(&self) -> bool {
        matches!(self, Endpoint::Local { target, .. } if target.kind() == Kind::Block)
    }

    pub fn target(&self) -> Option<&Arc<Target>> {
        match self {
            Endpoint::Local { target, .. } => Some(target),
            Endpoint::Nbd { .. } => None,
        }
    }

    pub fn client(&self) -> Option<&Arc<Client>> {
        match self {
            Endpoint::Nbd { client, .. } => Some(client),
            Endpoint::Local { .. } => None,
        }
    }

    /// Export flags, block sizes, description... of an NBD endpoint.
    pub fn nbd_info(&self) -> Option<&ExportInfo> {
        self.client().map(|c| c.info())
    }

    pub fn size(&self) -> u64 {
        match self {
            Endpoint::Local { target, .. } => target.size(),
            Endpoint::Nbd { client, .. } => client.size(),
        }
    }

    /// Smallest unit of I/O the endpoint accepts (alignment of offsets and
    /// lengths): the NBD minimum block size, or the logical sector under
    /// O_DIRECT, else 1.
    pub fn min_block(&self) -> u64 {
        match self {
            Endpoint::Local { target, .. } => {
                let g = target.geometry();
                g.dio_align.max(1) as u64
            }
            Endpoint::Nbd { client, .. } => client.info().min_block.max(1) as u64,
        }
    }

    /// Largest read or write in one request (NBD maximum payload).
    pub fn max_io(&self) -> u64 {
        match self {
            Endpoint::Local { .. } => 64 << 20,
            Endpoint::Nbd { client, .. } => client.info().max_io(),
        }
    }

    /// Runs covering a prefix of `[offset, offset+len)` (at least one run
    /// unless the range is empty or past the end). Endpoints that cannot tell
    /// report everything as data.
    pub fn extents(&self, offset: u64, len: u64) -> Result<Vec<MapExtent>> {
        let end = offset.saturating_add(len).min(self.size());
        if offset >= end {
            return Ok(Vec::new());
        }
        match self {
            Endpoint::Local { target, .. } => {
                let v = target
                    .extents(offset, end - offset, 4096)
                    .map_err(|e| self.local_err(e))?;
                let mut out: Vec<MapExtent> = v
                    .into_iter()
                    .map(|e| MapExtent {
                        offset: e.offset,
                        len: e.len,
                        data: e.kind == ExtentKind::Data,
                        zero: e.kind == ExtentKind::Hole,
                    })
                    .collect();
                if out.is_empty() {
                    // The file shrank under us; say data so callers read (and
                    // see the short read as an error) rather than loop.
                    out.push(MapExtent {
                        offset,
                        len: end - offset,
                        data: true,
                        zero: false,
                    });
                }
                Ok(out)
            }
            Endpoint::Nbd { client, .. } => {
                if !client.info().can_block_status() {
                    return Ok(vec![MapExtent {
                        offset,
                        len: end - offset,
                        data: true,
                        zero: false,
                    }]);
                }
                let v = runtime()
                    .block_on(client.block_status(offset, end - offset))
                    .map_err(|e| self.nbd_err(e))?;
                let mut out = Vec::with_capacity(v.len());
                let mut pos = offset;
                for d in v {
                    if pos >= end {
                        break;
                    }
                    let l = d.len.min(end - pos);
                    let e = MapExtent {
                        offset: pos,
                        len: l,
                        data: !d.is_hole(),
                        zero: d.is_zero(),
                    };
                    match out.last_mut() {
                        Some(last)
                            if MapExtent::same_kind(last, &e) && last.offset + last.len == pos =>
                        {
                            last.len += l
                        }
                        _ => out.push(e),
                    }
                    pos += l;
                }
                Ok(out)
            }
        }
    }

    /// The (offset, length, flags) runs of NBD metadata context `name` (one
    /// of [`EndpointOptions::extra_contexts`]) covering a prefix of
    /// `[offset, offset+len)`, clipped to it (at least one run unless the
    /// range is empty).
    pub fn context_status(
        &self,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<(u64, u64, u64)>> {
        let end = offset.saturating_add(len).min(self.size());
        let Endpoint::Nbd { client, .. } = self else {
            return Err(Error {
                endpoint: self.name(),
                message: format!("metadata context {name}: not an NBD export"),
                errno: None,
                nbd: None,
            });
        };
        if offset >= end {
            return Ok(Vec::new());
        }
        let v = runtime()
            .block_on(client.block_status_context(name, offset, end - offset))
            .map_err(|e| self.nbd_err(e))?;
        let mut out: Vec<(u64, u64, u64)> = Vec::with_capacity(v.len());
        let mut pos = offset;
        for d in v {
            if pos >= end {
                break;
            }
            let l = d.len.min(end - pos);
            match out.last_mut() {
                Some(last) if last.2 == d.flags => last.1 += l,
                _ => out.push((pos, l, d.flags)),
            }
            pos += l;
        }
        Ok(out)
    }

    /// Reads exactly `buf.len()` bytes at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        match self {
            Endpoint::Local { target, .. } => {
                target.read_at(buf, offset).map_err(|e| self.local_err(e))
            }
            Endpoint::Nbd { client, .. } => {
                // One reply buffer for every chunk, not one per request.
                let max = client.info().max_io().max(4096) as usize;
                let mut v = vec![0u8; buf.len().min(max)];
                let mut done = 0;
                while done < buf.len() {
                    let n = (buf.len() - done).min(max);
                    v = runtime()
                        .block_on(client.read_into(offset + done as u64, v, 0..n))
                        .map_err(|e| self.nbd_err(e))?;
                    buf[done..done + n].copy_from_slice(&v[..n]);
                    done += n;
                }
                Ok(())
            }
        }
    }

    /// Reads `buf.len()` bytes at `offset` into `buf` without an extra copy
    /// for NBD (the reply lands in the buffer). One request: `buf.len()`
    /// must not exceed [`Endpoint::max_io`].
    pub fn read_buf(&self, buf: &mut IoBuf, offset: u64) -> Result<()> {
        match self {
            Endpoint::Local { .. } => self.read_at(buf.as_mut_slice(), offset),
            Endpoint::Nbd { client, .. } => {
                let range = buf.start..buf.start + buf.len;
                let v = std::mem::take(&mut buf.v);
                match runtime().block_on(client.read_into(offset, v, range)) {
                    Ok(v) => {
                        buf.v = v;
                        Ok(())
                    }
                    Err(e) => {
                        // The failed request kept the memory: the buffer
                        // must hold some again before it is reused.
                        *buf = IoBuf::new(buf.cap, buf.align);
                        Err(self.nbd_err(e))
                    }
                }
            }
        }
    }

    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        match self {
            Endpoint::Local { target, .. } => target
                .write_at(buf, offset, false)
                .map_err(|e| self.local_err(e)),
            Endpoint::Nbd { client, .. } => {
                let max = client.info().max_io().max(4096) as usize;
                for (i, c) in buf.chunks(max).enumerate() {
                    runtime()
                        .block_on(client.write(offset + (i * max) as u64, c, false))
                        .map_err(|e| self.nbd_err(e))?;
                }
                Ok(())
            }
        }
    }

    /// Makes `[offset, offset+len)` read as zeros. `may_trim`: the range may
    /// become a hole (else it stays or becomes allocated). NBD servers
    /// without WRITE_ZEROES get zero buffers written.
    pub fn zero(&self, offset: u64, len: u64, may_trim: bool) -> Result<()> {
        match self {
            Endpoint::Local { target, .. } => target
                .zero(
                    offset,
                    len,
                    ZeroFlags {
                        may_trim,
                        fast_only: false,
                    },
                )
                .map(|_| ())
                .map_err(|e| self.local_err(e)),
            Endpoint::Nbd { client, .. } => {
                if client.info().can_zero() {
                    return runtime()
                        .block_on(client.zero(
                            offset,
                            len,
                            client::ZeroFlags {
                                no_hole: !may_trim,
                                ..Default::default()
                            },
                        ))
                        .map_err(|e| self.nbd_err(e));
                }
                let max = client.info().max_io().clamp(4096, 1 << 20);
                let zeros = vec![0u8; max as usize];
                let mut pos = offset;
                while pos < offset + len {
                    let n = (offset + len - pos).min(max);
                    runtime()
                        .block_on(client.write(pos, &zeros[..n as usize], false))
                        .map_err(|e| self.nbd_err(e))?;
                    pos += n;
                }
                Ok(())
            }
        }
    }

    /// See [`rawdisk_storage::Target::start_writeback`]; nothing for NBD
    /// (the server decides when its cache is written).
    pub fn start_writeback(&self, offset: u64, len: u64) {
        if let Endpoint::Local { target, .. } = self {
            target.start_writeback(offset, len);
        }
    }

    pub fn flush(&self) -> Result<()> {
        match self {
            Endpoint::Local { target, .. } => target.flush().map_err(|e| self.local_err(e)),
            Endpoint::Nbd { client, .. } => runtime()
                .block_on(client.flush())
                .map_err(|e| self.nbd_err(e)),
        }
    }

    /// Ends NBD connections cleanly (NBD_CMD_DISC); nothing for local targets.
    pub fn close(&self) -> Result<()> {
        if let Endpoint::Nbd { client, .. } = self {
            runtime()
                .block_on(client.disconnect())
                .map_err(|e| self.nbd_err(e))?;
        }
        Ok(())
    }

    fn local_err(&self, e: rawdisk_storage::Error) -> Error {
        Error {
            endpoint: self.name(),
            errno: e.errno(),
            message: e.to_string(),
            nbd: None,
        }
    }

    fn nbd_err(&self, e: client::Error) -> Error {
        nbd_err(&self.name(), e)
    }
}

impl MapExtent {
    fn same_kind(a: &MapExtent, b: &MapExtent) -> bool {
        a.data == b.data && a.zero == b.zero
    }
}

fn nbd_err(name: &str, e: client::Error) -> Error {
    Error {
        endpoint: name.to_string(),
        errno: e.errno().map(|n| n as i32),
        message: e.to_string(),
        nbd: Some(Box::new(e)),
    }
}

/// Connects; the extra connections join while the first one works, and
/// those a server refuses (a connection cap such as `serve
/// --max-connections` closes them) are left out.
///
/// A first connection refused as busy (a cap answers NBD_REP_ERR_POLICY
/// in the handshake) may be the slot of a previous client not yet freed on
/// a busy server: a client asking for several connections (a copy) tries
/// it again a few times with longer pauses. Any other refusal (a wrong
/// export name, TLS required) is final at once. A drop is left to the
/// caller (copy retries it in the open, with a log line), and so is a
/// server nothing listens on.
fn connect_capped(uri: &NbdUri, opts: ConnectOptions) -> client::Result<Client> {
    let tries = if opts.connections > 1 { 3 } else { 0 };
    for again in 1..=tries {
        match runtime().block_on(Client::connect_early(uri, &opts)) {
            Err(e) if e.is_busy() => {
                tracing::info!("{uri}: {e}; trying again");
                std::thread::sleep(Duration::from_millis(200 * again));
            }
            r => return r,
        }
    }
    runtime().block_on(Client::connect_early(uri, &opts))
}

fn libc_eperm() -> i32 {
    1
}

/// An I/O buffer aligned for O_DIRECT (to `align` bytes), reusable for many
/// requests.
pub struct IoBuf {
    v: Vec<u8>,
    start: usize,
    len: usize,
    cap: usize,
    align: usize,
}

impl IoBuf {
    pub fn new(cap: usize, align: usize) -> IoBuf {
        let align = align.max(1).next_power_of_two();
        let v = vec![0u8; cap + align];
        let start = v.as_ptr().align_offset(align).min(align);
        IoBuf {
            v,
            start,
            len: cap,
            cap,
            align,
        }
    }
    /// Uses the first `len` bytes (at most the capacity).
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.cap,
            "IoBuf of {} bytes cannot hold {len}",
            self.cap
        );
        self.len = len;
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> &[u8] {
        &self.v[self.start..self.start + self.len]
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.v[self.start..self.start + self.len]
    }
}
