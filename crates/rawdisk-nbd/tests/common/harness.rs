//! The server in-process on a Unix socket over a temp file, and a raw client
//! that drives it with bytes through the codec: what the `server_*` test
//! files share.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rawdisk_nbd::proto::*;
use rawdisk_nbd::server::{Server, ServerConfig};
use rawdisk_storage::cbt::{StateFile, TrackOptions, Tracker};
use rawdisk_storage::sys::{CallKind, FallocMode};
use rawdisk_storage::{CacheMode, FaultSys, OpenOptions, Target};

use super::{assert_file_is, Bind, Running};

/// Every call that could zero a range: failed (or made to panic) over a
/// bad spot, all of them.
pub const WRITING: [CallKind; 9] = [
    CallKind::Fallocate(FallocMode::PunchHole),
    CallKind::Fallocate(FallocMode::ZeroRange { keep_size: true }),
    CallKind::Fallocate(FallocMode::ZeroRange { keep_size: false }),
    CallKind::Fallocate(FallocMode::WriteZeroes),
    CallKind::Fallocate(FallocMode::Allocate),
    CallKind::Fallocate(FallocMode::AllocateKeepSize),
    CallKind::Pwrite,
    CallKind::PwriteDsync,
    CallKind::BlkZeroout,
];

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;

// ---------------------------------------------------------------------------
// Harness: server thread
// ---------------------------------------------------------------------------

pub struct Harness {
    /// First, so the server stops before the directory goes.
    pub server: Running,
    _dir: tempfile::TempDir,
    pub path: PathBuf,
    pub sock: PathBuf,
    pub model: Vec<u8>,
    pub fault: Option<Arc<FaultSys>>,
    pub track_fault: Option<Arc<FaultSys>>,
}

pub struct Setup {
    pub size: u64,
    /// Fill the file with random bytes (else sparse zeros).
    pub fill: bool,
    pub cfg: ServerConfig,
    pub fault: bool,
    /// Changed-block tracking with these checkpoints made before the start.
    pub track: Option<Vec<&'static str>>,
    /// The tracker's state file I/O through a FaultSys of its own.
    pub track_fault: bool,
    /// Open the target with O_DIRECT (`--cache none`).
    pub cache_none: bool,
    /// Where the disk goes, e.g. a mounted test file system; else beside
    /// the socket in a temporary directory.
    pub disk_dir: Option<PathBuf>,
    /// Serve on a single-threaded runtime instead of two workers.
    pub current_thread: bool,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            size: 8 * MIB,
            fill: true,
            cfg: ServerConfig {
                handshake_timeout: Duration::from_secs(10),
                ..Default::default()
            },
            fault: false,
            track: None,
            track_fault: false,
            cache_none: false,
            disk_dir: None,
            current_thread: false,
        }
    }
}

impl Setup {
    /// The default setup with `f` applied to the server's configuration.
    pub fn cfg(f: impl FnOnce(&mut ServerConfig)) -> Setup {
        let mut s = Setup::default();
        f(&mut s.cfg);
        s
    }
}

impl Harness {
    pub fn start(setup: Setup) -> Harness {
        let dir = tempfile::Builder::new()
            .prefix("rawdisk-nbd-server-")
            .tempdir()
            .unwrap();
        let path = setup
            .disk_dir
            .as_deref()
            .unwrap_or(dir.path())
            .join("disk.img");
        let sock = dir.path().join("nbd.sock");
        let mut model = vec![0u8; setup.size as usize];
        if setup.fill {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(setup.size);
            rng.fill(&mut model[..]);
            std::fs::write(&path, &model).unwrap();
        } else {
            let f = std::fs::File::create(&path).unwrap();
            f.set_len(setup.size).unwrap();
        }
        let opts = OpenOptions {
            read_only: setup.cfg.read_only,
            cache: if setup.cache_none {
                CacheMode::None
            } else {
                CacheMode::default()
            },
            ..Default::default()
        };
        let (target, fault) = if setup.fault {
            let fs = FaultSys::real();
            let t = Target::open_with_sys(&path, &opts, fs.clone()).unwrap();
            (t, Some(fs))
        } else {
            (Target::open(&path, &opts).unwrap(), None)
        };
        let target = Arc::new(target);
        let track_fault = setup.track_fault.then(FaultSys::real);
        // With `cfg.track_changes` the server opens the tracker itself.
        let by_config = setup.cfg.track_changes.is_some();
        if let Some(names) = &setup.track {
            let mut st = StateFile::open(&path, None, true).unwrap();
            for n in names {
                st.create_checkpoint(Some(n)).unwrap();
            }
        }
        let tracker = setup.track.filter(|_| !by_config).map(|_| {
            let opts = TrackOptions::default();
            let t = match &track_fault {
                Some(fs) => Tracker::open_with_sys(&path, setup.size, &opts, fs.clone()),
                None => Tracker::open(&path, setup.size, &opts),
            };
            Arc::new(t.unwrap())
        });
        let server = if by_config {
            Server::open(target, setup.cfg).unwrap()
        } else {
            Server::new_tracked(target, tracker, setup.cfg)
        };
        let server = Running::start_on(server, Bind::Unix(sock.clone()), setup.current_thread);
        Harness {
            server,
            _dir: dir,
            path,
            sock,
            model,
            fault,
            track_fault,
        }
    }

    pub fn conn(&self) -> Conn {
        Conn::connect(&self.sock)
    }

    /// Negotiated connection in `mode`, with base:allocation.
    pub fn open(&self, mode: ReplyMode) -> (Conn, GoInfo) {
        let mut c = self.conn();
        let info = c.negotiate(mode, true);
        (c, info)
    }

    pub fn check_file(&self) {
        assert_file_is(&self.path, &self.model);
    }

    /// The end of a test: reads the whole export back through `c` and
    /// compares it with the model, disconnects, stops the server cleanly
    /// and compares the file.
    pub fn finish(&mut self, mut c: Conn) {
        check_reads(&mut c, &self.model);
        c.disc();
        self.stop().unwrap();
        self.check_file();
    }

    /// Stops the server and returns what serve() returned.
    pub fn stop(&mut self) -> io::Result<()> {
        self.server.stop()
    }
}

// ---------------------------------------------------------------------------
// Raw client through the codec
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
pub struct GoInfo {
    pub size: u64,
    pub flags: u16,
    pub min: u32,
    pub pref: u32,
    pub max: u32,
}

#[derive(Debug, Clone, Copy)]
pub struct Pending {
    pub typ: Command,
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, Default)]
pub struct Reply {
    pub cookie: u64,
    pub error: u32,
    pub message: String,
    pub data: Vec<u8>,
    pub data_chunks: usize,
    pub hole_chunks: usize,
    pub descriptors: Vec<Descriptor>,
    pub context_id: Option<u32>,
    /// Every block status chunk: (context id, descriptors).
    pub contexts: Vec<(u32, Vec<Descriptor>)>,
    pub simple: bool,
    pub covered: Vec<(u64, u64)>,
    /// Where NBD_REPLY_TYPE_ERROR_OFFSET said the request failed.
    pub error_offset: Option<u64>,
}

pub struct Conn {
    pub s: UnixStream,
    pub mode: ReplyMode,
    pub pending: HashMap<u64, Pending>,
    pub partial: HashMap<u64, Reply>,
    pub next_cookie: u64,
}

impl Conn {
    pub fn connect(path: &Path) -> Conn {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        // A server that stops reading fails the test instead of hanging it.
        s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
        Conn {
            s,
            mode: ReplyMode::Simple,
            pending: HashMap::new(),
            partial: HashMap::new(),
            next_cookie: 1,
        }
    }

    pub fn read_n(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut b = vec![0u8; n];
        self.s.read_exact(&mut b)?;
        Ok(b)
    }

    pub fn send(&mut self, b: &[u8]) {
        self.s.write_all(b).unwrap();
    }

    /// True if the server closed the connection (EOF or reset) within 5 s,
    /// skipping anything it still sends.
    pub fn closed_by_server(&mut self) -> bool {
        self.s
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 4096];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }

    pub fn greeting(&mut self) -> u16 {
        let b = self.read_n(GREETING_LEN).unwrap();
        decode_greeting(&b).unwrap().0
    }

    pub fn client_flags(&mut self, f: u32) {
        let mut b = Vec::new();
        encode_client_flags(&mut b, f);
        self.send(&b);
    }

    pub fn start(&mut self) {
        let hf = self.greeting();
        assert_eq!(hf, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        self.client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    }

    pub fn send_opt(&mut self, o: &ClientOption) {
        let mut b = Vec::new();
        o.encode(&mut b);
        self.send(&b);
    }

    pub fn opt_reply(&mut self) -> io::Result<(u32, OptionReply)> {
        let h = self.read_n(OPTION_REPLY_HEADER_LEN)?;
        let (hdr, _) = decode_option_reply_header(&h).unwrap();
        assert!(hdr.len <= 64 * 1024, "option reply of {} bytes", hdr.len);
        let data = self.read_n(hdr.len as usize)?;
        Ok((hdr.option, OptionReply::parse(hdr.reply, &data).unwrap()))
    }

    /// Sends `o` and collects replies up to and including the final one.
    pub fn opt(&mut self, o: &ClientOption) -> Vec<OptionReply> {
        self.send_opt(o);
        let mut v = Vec::new();
        loop {
            let (opt, r) = self.opt_reply().unwrap();
            assert_eq!(opt, o.option(), "reply to the wrong option");
            let fin = !matches!(
                r,
                OptionReply::Info(_) | OptionReply::Server { .. } | OptionReply::MetaContext { .. }
            );
            v.push(r);
            if fin {
                return v;
            }
        }
    }

    pub fn negotiate(&mut self, mode: ReplyMode, meta: bool) -> GoInfo {
        self.start();
        match mode {
            ReplyMode::Simple => {}
            ReplyMode::Structured => {
                assert_eq!(self.opt(&ClientOption::StructuredReply), [OptionReply::Ack])
            }
            ReplyMode::Extended => {
                assert_eq!(self.opt(&ClientOption::ExtendedHeaders), [OptionReply::Ack])
            }
        }
        if meta && mode != ReplyMode::Simple {
            let r = self.opt(&ClientOption::SetMetaContext(MetaContextRequest {
                name: String::new(),
                queries: vec![META_CONTEXT_BASE_ALLOCATION.into()],
            }));
            assert_eq!(r.len(), 2, "{r:?}");
            assert!(
                matches!(&r[0], OptionReply::MetaContext { name, .. } if name == META_CONTEXT_BASE_ALLOCATION)
            );
        }
        let r = self.opt(&ClientOption::Go(InfoRequest {
            name: String::new(),
            info: vec![INFO_BLOCK_SIZE],
        }));
        self.mode = mode;
        go_info(&r)
    }

    pub fn send_req(
        &mut self,
        typ: Command,
        flags: u16,
        offset: u64,
        len: u64,
        payload: &[u8],
    ) -> u64 {
        let cookie = self.new_cookie();
        self.send_req_cookie(cookie, typ, flags, offset, len, payload);
        cookie
    }

    /// The cookie for the next request.
    fn new_cookie(&mut self) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        cookie
    }

    pub fn send_req_cookie(
        &mut self,
        cookie: u64,
        typ: Command,
        flags: u16,
        offset: u64,
        len: u64,
        payload: &[u8],
    ) {
        let mut b = Vec::with_capacity(32 + payload.len());
        self.encode_req(&mut b, cookie, typ, flags, offset, len, payload);
        self.send(&b);
    }

    /// Appends the request to `b` and expects its reply, without sending:
    /// for tests that send from another thread.
    #[allow(clippy::too_many_arguments)]
    pub fn encode_req(
        &mut self,
        b: &mut Vec<u8>,
        cookie: u64,
        typ: Command,
        mut flags: u16,
        offset: u64,
        len: u64,
        payload: &[u8],
    ) {
        let ext = self.mode.extended();
        if ext && !payload.is_empty() {
            flags |= CMD_FLAG_PAYLOAD_LEN;
        }
        Request {
            flags,
            command: typ,
            cookie,
            offset,
            length: len,
        }
        .encode(b, ext);
        b.extend_from_slice(payload);
        self.pending.insert(cookie, Pending { typ, offset, len });
    }

    /// Like `send_req`, into `b`.
    pub fn queue_req(
        &mut self,
        b: &mut Vec<u8>,
        typ: Command,
        offset: u64,
        len: u64,
        payload: &[u8],
    ) -> u64 {
        let cookie = self.new_cookie();
        self.encode_req(b, cookie, typ, 0, offset, len, payload);
        cookie
    }

    /// Reads messages until one reply is complete.
    pub fn recv(&mut self) -> Reply {
        loop {
            if let Some(r) = self.recv_one() {
                return r;
            }
        }
    }

    pub fn recv_one(&mut self) -> Option<Reply> {
        let hl = match self.mode {
            ReplyMode::Extended => EXTENDED_REPLY_HEADER_LEN,
            _ => 4,
        };
        let mut h = self.read_n(hl).unwrap();
        if !self.mode.extended() {
            let magic = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
            let rest = if magic == SIMPLE_REPLY_MAGIC {
                SIMPLE_REPLY_LEN - 4
            } else {
                STRUCTURED_REPLY_HEADER_LEN - 4
            };
            h.extend(self.read_n(rest).unwrap());
        }
        let (hdr, _) = decode_reply_header(&h, self.mode).unwrap();
        let cookie = hdr.cookie();
        let p = *self
            .pending
            .get(&cookie)
            .unwrap_or_else(|| panic!("reply for unknown cookie {cookie}: {hdr:?}"));
        match hdr {
            ReplyHeader::Simple { error, .. } => {
                assert!(
                    !self.partial.contains_key(&cookie),
                    "simple reply after chunks"
                );
                let mut r = Reply {
                    cookie,
                    error,
                    simple: true,
                    ..Default::default()
                };
                if p.typ == Command::Read && error == 0 {
                    assert_ne!(
                        self.mode,
                        ReplyMode::Structured,
                        "simple reply to a structured read"
                    );
                    r.data = self.read_n(p.len as usize).unwrap();
                }
                self.pending.remove(&cookie);
                Some(r)
            }
            ReplyHeader::Chunk {
                flags,
                typ,
                offset,
                length,
                extended,
                ..
            } => {
                if extended {
                    assert_eq!(
                        offset, p.offset,
                        "extended reply offset must match the request"
                    );
                }
                assert!(length <= 40 * MIB, "chunk of {length} bytes");
                let payload = self.read_n(length as usize).unwrap();
                let chunk = decode_chunk(typ, &payload).unwrap();
                let r = self.partial.entry(cookie).or_insert_with(|| Reply {
                    cookie,
                    data: if p.typ == Command::Read {
                        vec![0xee; p.len as usize]
                    } else {
                        Vec::new()
                    },
                    ..Default::default()
                });
                match chunk {
                    Chunk::None => {
                        assert!(flags & REPLY_FLAG_DONE != 0, "NONE without DONE");
                    }
                    Chunk::OffsetData { offset, data } => {
                        assert_eq!(p.typ, Command::Read);
                        let start = offset - p.offset;
                        assert!(offset >= p.offset && start + data.len() as u64 <= p.len);
                        r.data[start as usize..start as usize + data.len()].copy_from_slice(data);
                        r.covered.push((start, data.len() as u64));
                        r.data_chunks += 1;
                    }
                    Chunk::OffsetHole { offset, length } => {
                        assert_eq!(p.typ, Command::Read);
                        let start = offset - p.offset;
                        assert!(offset >= p.offset && start + length as u64 <= p.len);
                        r.data[start as usize..(start + length as u64) as usize].fill(0);
                        r.covered.push((start, length as u64));
                        r.hole_chunks += 1;
                    }
                    Chunk::BlockStatus {
                        context_id,
                        descriptors,
                    } => {
                        assert_eq!(p.typ, Command::BlockStatus);
                        let want = if extended {
                            REPLY_TYPE_BLOCK_STATUS_EXT
                        } else {
                            REPLY_TYPE_BLOCK_STATUS
                        };
                        assert_eq!(typ, want);
                        r.context_id = Some(context_id);
                        r.contexts.push((context_id, descriptors.clone()));
                        r.descriptors = descriptors;
                    }
                    Chunk::Error { error, message } => {
                        r.error = error;
                        r.message = message;
                    }
                    Chunk::ErrorOffset {
                        error,
                        message,
                        offset,
                    } => {
                        // As libnbd checks (it drops the connection): only
                        // for a ranged command, inside its range.
                        assert!(
                            p.typ.allows_error_offset(),
                            "NBD_REPLY_TYPE_ERROR_OFFSET for {:?}",
                            p.typ
                        );
                        assert!(
                            offset >= p.offset && offset - p.offset < p.len,
                            "error offset {offset} outside the request {p:?}"
                        );
                        r.error = error;
                        r.message = message;
                        r.error_offset = Some(offset);
                    }
                    Chunk::Unknown { typ, .. } => panic!("unknown chunk type {typ}"),
                }
                if flags & REPLY_FLAG_DONE == 0 {
                    return None;
                }
                let mut r = self.partial.remove(&cookie).unwrap();
                self.pending.remove(&cookie);
                if p.typ == Command::Read && r.error == 0 {
                    // Chunks must not overlap and must cover the request.
                    r.covered.sort();
                    let mut pos = 0;
                    for &(s, l) in &r.covered {
                        assert_eq!(s, pos, "read chunks overlap or leave a gap");
                        pos += l;
                    }
                    assert_eq!(pos, p.len, "read chunks do not cover the request");
                }
                Some(r)
            }
        }
    }

    pub fn cmd(&mut self, typ: Command, flags: u16, offset: u64, len: u64, data: &[u8]) -> Reply {
        let c = self.send_req(typ, flags, offset, len, data);
        let r = self.recv();
        assert_eq!(r.cookie, c);
        r
    }

    pub fn read(&mut self, offset: u64, len: u64) -> Vec<u8> {
        let r = self.cmd(Command::Read, 0, offset, len, &[]);
        assert_eq!(r.error, 0, "read failed: {}", r.message);
        r.data
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let r = self.cmd(Command::Write, 0, offset, data.len() as u64, data);
        assert_eq!(r.error, 0, "write failed: {}", r.message);
    }

    pub fn disc(&mut self) {
        self.send_req(Command::Disc, 0, 0, 0, &[]);
        assert!(self.closed_by_server(), "no close after NBD_CMD_DISC");
    }
}

/// Reads the whole export back and compares it with `model`, naming the
/// first byte that differs.
pub fn check_reads(c: &mut Conn, model: &[u8]) {
    let got = c.read(0, model.len() as u64);
    let diff = got.iter().zip(model).position(|(a, b)| a != b);
    assert_eq!(diff, None, "read back differs from the model");
}

pub fn go_info(r: &[OptionReply]) -> GoInfo {
    assert_eq!(r.last(), Some(&OptionReply::Ack), "{r:?}");
    let mut g = GoInfo {
        size: 0,
        flags: 0,
        min: 0,
        pref: 0,
        max: 0,
    };
    let mut saw_export = false;
    for x in r {
        match x {
            OptionReply::Info(Info::Export { size, flags }) => {
                saw_export = true;
                g.size = *size;
                g.flags = *flags;
            }
            OptionReply::Info(Info::BlockSize {
                min,
                preferred,
                max,
            }) => {
                g.min = *min;
                g.pref = *preferred;
                g.max = *max;
            }
            _ => {}
        }
    }
    assert!(saw_export, "no NBD_INFO_EXPORT before ACK");
    g
}

pub fn random(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut v = vec![0u8; n];
    rng.fill(&mut v[..]);
    v
}

/// A request header at offset 0, for bytes a well-behaved client would not send.
pub fn raw_request(typ: Command, cookie: u64, length: u64, extended: bool) -> Vec<u8> {
    let mut b = Vec::new();
    Request {
        command: typ,
        cookie,
        length,
        ..Default::default()
    }
    .encode(&mut b, extended);
    b
}

pub fn is_error(r: &OptionReply, want: u32) -> bool {
    matches!(r, OptionReply::Error { reply, .. } if *reply == want)
}
