//! TLS end to end inside the crate: the server on TCP loopback with a PKI
//! and a PSK file made by `openssl` in a temp dir, this crate's client with
//! `nbds://` URIs, and a raw client (blocking sockets, OpenSSL's own
//! stream) for what the NBD STARTTLS rules say about each byte. Every
//! refusal is followed by a good client reading the export.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command as Proc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode, SslVersion};
use rawdisk_nbd::client::{Client, ConnectOptions};
use rawdisk_nbd::proto::*;
use rawdisk_nbd::server::{Server, ServerConfig};
use rawdisk_nbd::tls::ServerTls;
use rawdisk_nbd::uri::NbdUri;

mod common;
use common::{assert_file_is, Bind, Running};
use rawdisk_storage::{OpenOptions, Target};

const SIZE: usize = 4 << 20;
const PSK_KEY: &str = "5eb1a8c1f0c4a9c2b4d2e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7";
const OTHER_KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

// ---------------------------------------------------------------------------
// PKI

/// Runs `openssl` with whitespace-separated `args` in `dir`.
fn openssl(dir: &Path, args: &str) {
    let out = Proc::new("openssl")
        .args(args.split_whitespace())
        .current_dir(dir)
        .output()
        .expect("openssl must be installed (Debian: openssl)");
    assert!(
        out.status.success(),
        "openssl {args}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const NEW_KEY: &str = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";

fn ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &format!(
            "req -x509 {NEW_KEY} -keyout {name}-key.pem -out {name}-cert.pem -days 2 \
             -subj /CN={name} -addext basicConstraints=critical,CA:TRUE \
             -addext keyUsage=critical,keyCertSign,cRLSign"
        ),
    );
}

/// A certificate for `cn` (no spaces) signed by CA `by`, with `ext`
/// extensions.
fn leaf(dir: &Path, name: &str, cn: &str, by: &str, ext: &str) {
    openssl(
        dir,
        &format!("req {NEW_KEY} -keyout {name}-key.pem -out {name}.csr -subj /CN={cn}"),
    );
    std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
    openssl(
        dir,
        &format!(
            "x509 -req -in {name}.csr -CA {by}-cert.pem -CAkey {by}-key.pem \
             -CAcreateserial -days 2 -out {name}-cert.pem -extfile {name}.ext"
        ),
    );
}

/// Directories in the nbdkit/qemu/libnbd layouts.
struct Pki {
    _tmp: tempfile::TempDir,
    root: PathBuf,
}

impl Pki {
    fn new() -> Pki {
        let tmp = tempfile::Builder::new()
            .prefix("rawdisk-tls-")
            .tempdir()
            .unwrap();
        let w = tmp.path().join("work");
        std::fs::create_dir(&w).unwrap();
        ca(&w, "ca");
        ca(&w, "rogue");
        let server_ext = "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n";
        let client_ext = "extendedKeyUsage=clientAuth\n";
        leaf(&w, "server", "localhost", "ca", server_ext);
        leaf(&w, "rogue-server", "localhost", "rogue", server_ext);
        leaf(&w, "client", "good-client", "ca", client_ext);
        leaf(&w, "revoked", "revoked-client", "ca", client_ext);
        leaf(&w, "stranger", "stranger", "rogue", client_ext);
        // A CRL that revokes "revoked" (openssl ca needs its little database).
        std::fs::write(w.join("index.txt"), "").unwrap();
        std::fs::write(w.join("crlnumber"), "01\n").unwrap();
        std::fs::write(
            w.join("ca.cnf"),
            "[ca]\ndefault_ca=d\n[d]\ndatabase=index.txt\ncrlnumber=crlnumber\n\
             default_md=sha256\ndefault_crl_days=2\n",
        )
        .unwrap();
        let ca_args = "-keyfile ca-key.pem -cert ca-cert.pem -config ca.cnf";
        openssl(&w, &format!("ca -revoke revoked-cert.pem {ca_args}"));
        openssl(&w, &format!("ca -gencrl -out ca-crl.pem {ca_args}"));

        let root = tmp.path().to_path_buf();
        let layout: &[(&str, &[(&str, &str)])] = &[
            (
                "srv",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("server-cert.pem", "server-cert.pem"),
                    ("server-key.pem", "server-key.pem"),
                ],
            ),
            (
                "srv-crl",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("ca-crl.pem", "ca-crl.pem"),
                    ("server-cert.pem", "server-cert.pem"),
                    ("server-key.pem", "server-key.pem"),
                ],
            ),
            (
                "cli",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("client-cert.pem", "client-cert.pem"),
                    ("client-key.pem", "client-key.pem"),
                ],
            ),
            ("cli-nocert", &[("ca-cert.pem", "ca-cert.pem")]),
            (
                "cli-revoked",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("client-cert.pem", "revoked-cert.pem"),
                    ("client-key.pem", "revoked-key.pem"),
                ],
            ),
            (
                "cli-stranger",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("client-cert.pem", "stranger-cert.pem"),
                    ("client-key.pem", "stranger-key.pem"),
                ],
            ),
            ("cli-rogue-ca", &[("ca-cert.pem", "rogue-cert.pem")]),
        ];
        for (d, files) in layout {
            let dd = root.join(d);
            std::fs::create_dir(&dd).unwrap();
            for (to, from) in *files {
                std::fs::copy(w.join(from), dd.join(to)).unwrap();
            }
        }
        std::fs::write(
            root.join("keys.psk"),
            format!("alice:{PSK_KEY}\nbob:{OTHER_KEY}\n"),
        )
        .unwrap();
        std::fs::write(root.join("wrong.psk"), format!("alice:{OTHER_KEY}\n")).unwrap();
        std::fs::write(root.join("mallory.psk"), format!("mallory:{PSK_KEY}\n")).unwrap();
        Pki { _tmp: tmp, root }
    }

    fn dir(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }
}

// ---------------------------------------------------------------------------
// Server

struct Harness {
    /// First, so the server stops before the directory goes.
    server: Running,
    _dir: tempfile::TempDir,
    path: PathBuf,
    model: Vec<u8>,
}

impl Harness {
    fn start(tls: ServerTls, timeout: Duration) -> Harness {
        Harness::start_cfg(ServerConfig {
            handshake_timeout: timeout,
            tls: Some(tls),
            ..Default::default()
        })
    }

    fn start_cfg(cfg: ServerConfig) -> Harness {
        let dir = tempfile::Builder::new()
            .prefix("rawdisk-tls-srv-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("disk.img");
        let model: Vec<u8> = (0..SIZE).map(|i| (i * 7 % 251) as u8 | 1).collect();
        std::fs::write(&path, &model).unwrap();
        let target = Arc::new(Target::open(&path, &OpenOptions::default()).unwrap());
        let server = Running::start(Server::new(target, cfg), Bind::Tcp);
        Harness {
            server,
            _dir: dir,
            path,
            model,
        }
    }

    fn uri(&self, scheme_user: &str, query: &str) -> NbdUri {
        let s = format!("{scheme_user}127.0.0.1:{}/?{query}", self.server.port);
        NbdUri::parse(&s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn check_file(&self) {
        assert_file_is(&self.path, &self.model);
    }

    /// A raw connection past the greeting and the client flags.
    fn greeted(&self) -> TcpStream {
        let mut s = TcpStream::connect(("127.0.0.1", self.server.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        greet(&mut s);
        s
    }
}

/// One client runtime for every test: a client's connection tasks live
/// on the runtime it connected on.
fn rt() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    })
}

fn connect(uri: &NbdUri, connections: usize) -> Result<Client, String> {
    let opts = ConnectOptions {
        connections,
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    rt().block_on(Client::connect(uri, &opts))
        .map_err(|e| e.to_string())
}

/// A good client reads the first and last MiB and finds the model there.
fn assert_serves(h: &Harness, uri: &NbdUri) {
    let c = connect(uri, 1).expect("a good client after a refusal");
    let rt = rt();
    for off in [0, SIZE - (1 << 20)] {
        let got = rt.block_on(c.read(off as u64, 1 << 20)).unwrap();
        assert!(
            got == h.model[off..off + (1 << 20)],
            "read at {off} differs"
        );
    }
    rt.block_on(c.disconnect()).unwrap();
}

/// Writes a pattern through `c` over several connections, reads it back,
/// flushes and compares the whole file with the model.
fn write_read_compare(h: &mut Harness, c: &Client) {
    let rt = rt();
    let data: Vec<u8> = (0..(3 << 20) + 5)
        .map(|i: usize| (i % 241) as u8 ^ 0x5a)
        .collect();
    let off = 123_457usize;
    rt.block_on(async {
        let mut set = Vec::new();
        for (k, piece) in data.chunks(256 << 10).enumerate() {
            set.push(c.write((off + k * (256 << 10)) as u64, piece, false));
        }
        for f in set {
            f.await.unwrap();
        }
        c.flush().await.unwrap();
        let back = c.read(off as u64, data.len()).await.unwrap();
        assert!(back == data, "read back over TLS differs");
        c.disconnect().await.unwrap();
    });
    h.model[off..off + data.len()].copy_from_slice(&data);
    h.check_file();
}

// ---------------------------------------------------------------------------
// Client through the crate's client

#[test]
fn x509_write_read_multi_conn() {
    let (pki, mut h) = x509_server(true, 10);
    let certs = format!("tls-certificates={}", pki.dir("cli-nocert").display());
    let uri = h.uri("nbds://", &certs);
    let c = connect(&uri, 4).unwrap();
    assert_eq!(c.info().connections, 4);
    assert!(c.info().extended_headers, "extended headers over TLS");
    write_read_compare(&mut h, &c);
    // tls-hostname names what the certificate must carry.
    let named = h.uri("nbds://", &format!("{certs}&tls-hostname=localhost"));
    assert_serves(&h, &named);
    let wrong = h.uri(
        "nbds://",
        &format!("{certs}&tls-hostname=elsewhere.example"),
    );
    let e = connect(&wrong, 1).unwrap_err();
    assert!(e.contains("TLS"), "{e}");
    assert_serves(&h, &uri);
}

/// A server with the X.509 credentials of `srv`, TLS required or offered.
fn x509_server(require: bool, timeout_secs: u64) -> (Pki, Harness) {
    let pki = Pki::new();
    let tls = ServerTls::x509(&pki.dir("srv"), false, require).unwrap();
    (pki, Harness::start(tls, Duration::from_secs(timeout_secs)))
}

fn cert_uri(h: &Harness, pki: &Pki, dir: &str) -> NbdUri {
    h.uri(
        "nbds://",
        &format!("tls-certificates={}", pki.dir(dir).display()),
    )
}

fn psk_uri(h: &Harness, pki: &Pki, user: &str, file: &str) -> NbdUri {
    let query = format!("tls-psk-file={}", pki.dir(file).display());
    h.uri(&format!("nbds://{user}@"), &query)
}

#[test]
fn psk_write_read_and_refusals() {
    let pki = Pki::new();
    let tls = ServerTls::psk(&pki.dir("keys.psk"), true).unwrap();
    let mut h = Harness::start(tls, Duration::from_secs(10));
    let good = psk_uri(&h, &pki, "alice", "keys.psk");
    let c = connect(&good, 2).unwrap();
    write_read_compare(&mut h, &c);

    for (user, file, what) in [
        ("alice", "wrong.psk", "wrong key"),
        ("mallory", "mallory.psk", "unknown user"),
    ] {
        let e = connect(&psk_uri(&h, &pki, user, file), 1).unwrap_err();
        assert!(e.contains("TLS handshake failed"), "{what}: {e}");
        let said = format!("the server rejected the key for user {user} (");
        assert_eq!(e.matches(&said).count(), 1, "{what}: {e}");
        assert_serves(&h, &good);
    }

    // No key for the URI's user in the file: refused before connecting.
    let e = connect(&psk_uri(&h, &pki, "carol", "keys.psk"), 1).unwrap_err();
    assert!(e.contains("no key for user \"carol\""), "{e}");

    let plain = h.uri("nbd://", "");
    let e = connect(&plain, 1).unwrap_err();
    assert!(
        e.contains("nbds://"),
        "plaintext client to a TLS server: {e}"
    );
    // Said once: not again as the option it met, nor the server's words.
    assert_eq!(e.matches("requires TLS").count(), 1, "{e}");
    assert_eq!(e.matches("TLS").count(), 1, "{e}");
    assert_serves(&h, &good);
}

#[test]
fn server_certificate_must_be_trusted() {
    let (pki, h) = x509_server(true, 10);
    let rogue = cert_uri(&h, &pki, "cli-rogue-ca");
    let e = connect(&rogue, 1).unwrap_err();
    let said = format!(
        "the server's certificate is not signed by ca-cert.pem in {} (or pass tls-verify-peer=0)",
        pki.dir("cli-rogue-ca").display()
    );
    assert_eq!(
        e.matches(&said).count(),
        1,
        "untrusted server certificate: {e}"
    );
    // tls-verify-peer=0 is the way to accept any certificate.
    let blind = h.uri(
        "nbds://",
        &format!(
            "tls-certificates={}&tls-verify-peer=0",
            pki.dir("cli-rogue-ca").display()
        ),
    );
    assert_serves(&h, &blind);
}

#[test]
fn verify_peer_checks_client_certificates_and_crl() {
    let pki = Pki::new();
    let tls = ServerTls::x509(&pki.dir("srv-crl"), true, true).unwrap();
    let h = Harness::start(tls, Duration::from_secs(10));
    let good = cert_uri(&h, &pki, "cli");
    assert_serves(&h, &good);
    for (dir, what) in [
        ("cli-nocert", "no client certificate"),
        ("cli-stranger", "a certificate from another CA"),
        ("cli-revoked", "a revoked certificate"),
    ] {
        let u = h.uri(
            "nbds://",
            &format!("tls-certificates={}", pki.dir(dir).display()),
        );
        // TLS 1.3: the client may finish its side before the server's alert
        // arrives, so the refusal can show at the first option instead.
        let e = connect(&u, 1).unwrap_err();
        if dir == "cli-nocert" {
            let said = format!(
                "the server requires a client certificate (client-cert.pem in {})",
                pki.dir(dir).display()
            );
            assert_eq!(e.matches(&said).count(), 1, "{what}: {e}");
        }
        assert!(
            e.contains("TLS handshake failed")
                || e.contains("client certificate")
                || e.contains(" alert ")
                || e.contains("refuse this client's certificate"),
            "{what}: {e}"
        );
        assert_serves(&h, &good);
    }
}

#[test]
fn tls_on_serves_plaintext_and_tls_clients() {
    let (pki, mut h) = x509_server(false, 10);
    let plain = h.uri("nbd://", "");
    let c = connect(&plain, 2).unwrap();
    write_read_compare(&mut h, &c);
    let secure = cert_uri(&h, &pki, "cli-nocert");
    assert_serves(&h, &secure);
}

#[test]
fn bad_credentials_are_clear_errors() {
    let pki = Pki::new();
    let e = ServerTls::x509(&pki.dir("cli"), false, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("server-cert.pem"), "{e}");
    let e = ServerTls::x509(&pki.dir("srv"), true, true);
    assert!(e.is_ok());
    let e = ServerTls::x509(&pki.dir("cli-nocert"), true, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("server-cert.pem"), "{e}");
    std::fs::write(pki.dir("bad.psk"), "alice:xyz\n").unwrap();
    let e = ServerTls::psk(&pki.dir("bad.psk"), true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 1"), "{e}");
    std::fs::write(pki.dir("empty.psk"), "\n").unwrap();
    let e = ServerTls::psk(&pki.dir("empty.psk"), true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no keys"), "{e}");
    let e = ServerTls::psk(&pki.dir("missing.psk"), true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.psk"), "{e}");
}

// ---------------------------------------------------------------------------
// Raw client: the STARTTLS rules byte by byte

fn greet<S: Read + Write>(s: &mut S) {
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    assert_eq!(&g[..8], b"NBDMAGIC");
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
}

fn starttls<S: Read + Write>(s: &mut S) {
    send_opt(s, OPT_STARTTLS, &[]);
    assert_eq!(reply(s), (OPT_STARTTLS, REP_ACK, vec![]));
}

fn send_opt<S: Write>(s: &mut S, opt: u32, data: &[u8]) {
    s.write_all(&opt_bytes(opt, data)).unwrap();
}

fn opt_bytes(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// (option, reply type, data) of one option reply.
fn reply<S: Read>(s: &mut S) -> (u32, u32, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(
        u64::from_be_bytes(h[..8].try_into().unwrap()),
        OPTION_REPLY_MAGIC
    );
    let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
    let typ = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let mut d = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
    s.read_exact(&mut d).unwrap();
    (opt, typ, d)
}

fn go_data() -> Vec<u8> {
    let mut d = 0u32.to_be_bytes().to_vec(); // default export ""
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

/// NBD_OPT_GO; the export's transmission flags.
fn go<S: Read + Write>(s: &mut S) -> u16 {
    send_opt(s, OPT_GO, &go_data());
    let mut flags = None;
    loop {
        let (opt, typ, d) = reply(s);
        assert_eq!(opt, OPT_GO);
        match typ {
            REP_ACK => return flags.expect("NBD_INFO_EXPORT"),
            REP_INFO if u16::from_be_bytes([d[0], d[1]]) == INFO_EXPORT => {
                flags = Some(u16::from_be_bytes([d[10], d[11]]));
            }
            REP_INFO => {}
            t => panic!("GO refused: {t:#x} {}", String::from_utf8_lossy(&d)),
        }
    }
}

fn tls_over(tcp: TcpStream) -> openssl::ssl::SslStream<TcpStream> {
    let mut b = SslConnector::builder(SslMethod::tls_client()).unwrap();
    b.set_verify(SslVerifyMode::NONE);
    b.build().connect("localhost", tcp).expect("TLS handshake")
}

/// Reads until EOF; false if the server kept the connection open.
fn closed_within<S: Read>(s: &mut S, secs: u64) -> bool {
    let start = Instant::now();
    let mut b = [0u8; 4096];
    while start.elapsed() < Duration::from_secs(secs) {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return true,
        }
    }
    false
}

#[test]
fn starttls_rules() {
    let (pki, h) = x509_server(true, 2);
    let good = cert_uri(&h, &pki, "cli-nocert");

    // FORCEDTLS: every option but STARTTLS and ABORT is refused before TLS.
    let mut s = h.greeted();
    for opt in [
        OPT_LIST,
        OPT_INFO,
        OPT_GO,
        OPT_STRUCTURED_REPLY,
        OPT_EXTENDED_HEADERS,
        99,
    ] {
        let data = if opt == OPT_INFO || opt == OPT_GO {
            go_data()
        } else {
            vec![]
        };
        send_opt(&mut s, opt, &data);
        let (o, t, _) = reply(&mut s);
        assert_eq!((o, t), (opt, REP_ERR_TLS_REQD), "option {opt}");
    }
    // STARTTLS with a payload is invalid; the connection goes on.
    send_opt(&mut s, OPT_STARTTLS, b"x");
    assert_eq!(reply(&mut s).1, REP_ERR_INVALID);
    send_opt(&mut s, OPT_ABORT, &[]);
    assert_eq!(reply(&mut s).1, REP_ACK);

    // A bare EXPORT_NAME before TLS closes the connection.
    let mut s = h.greeted();
    send_opt(&mut s, OPT_EXPORT_NAME, b"");
    assert!(
        closed_within(&mut s, 5),
        "EXPORT_NAME before TLS must close"
    );
    assert_serves(&h, &good);

    // STARTTLS, then TLS; a second STARTTLS is invalid; then GO over TLS.
    let mut s = h.greeted();
    starttls(&mut s);
    let mut t = tls_over(s);
    send_opt(&mut t, OPT_STARTTLS, &[]);
    assert_eq!(reply(&mut t).1, REP_ERR_INVALID);
    let flags = go(&mut t);
    assert!(flags & FLAG_HAS_FLAGS != 0);
    read_simple(&mut t, &h.model);
}

/// A READ of the first 4 KiB; the reply must be a simple one.
fn read_simple<S: Read + Write>(s: &mut S, model: &[u8]) {
    let mut r = Vec::new();
    r.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    r.extend_from_slice(&0u16.to_be_bytes());
    r.extend_from_slice(&0u16.to_be_bytes()); // NBD_CMD_READ
    r.extend_from_slice(&7u64.to_be_bytes());
    r.extend_from_slice(&0u64.to_be_bytes());
    r.extend_from_slice(&4096u32.to_be_bytes());
    s.write_all(&r).unwrap();
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    assert_eq!(
        u32::from_be_bytes(h[..4].try_into().unwrap()),
        SIMPLE_REPLY_MAGIC,
        "not a simple reply: structured replies survived STARTTLS"
    );
    assert_eq!(
        u32::from_be_bytes(h[4..8].try_into().unwrap()),
        0,
        "read error"
    );
    let mut d = vec![0u8; 4096];
    s.read_exact(&mut d).unwrap();
    assert!(d == model[..4096]);
}

#[test]
fn plaintext_pipelined_after_starttls_is_discarded() {
    let (_pki, h) = x509_server(true, 5);
    let mut s = h.greeted();
    // STARTTLS and a plaintext GO in one segment: the GO must never be
    // answered, nor reach TLS (which would then fail).
    let mut burst = opt_bytes(OPT_STARTTLS, &[]);
    burst.extend(opt_bytes(OPT_GO, &go_data()));
    s.write_all(&burst).unwrap();
    assert_eq!(reply(&mut s), (OPT_STARTTLS, REP_ACK, vec![]));
    let mut t = tls_over(s);
    go(&mut t);
    read_simple(&mut t, &h.model);
}

#[test]
fn negotiation_before_starttls_is_forgotten() {
    // `on`: plaintext options are answered, so there is something to forget.
    let (_pki, h) = x509_server(false, 5);
    let mut s = h.greeted();
    send_opt(&mut s, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(reply(&mut s).1, REP_ACK);
    starttls(&mut s);
    let mut t = tls_over(s);
    let flags = go(&mut t);
    assert_eq!(
        flags & FLAG_SEND_DF,
        0,
        "DF advertised without structured replies"
    );
    read_simple(&mut t, &h.model);
}

#[test]
fn stalled_tls_handshake_times_out() {
    let (pki, h) = x509_server(true, 1);
    let mut s = h.greeted();
    starttls(&mut s);
    // Half a ClientHello record header, then nothing.
    s.write_all(&[0x16, 0x03]).unwrap();
    let start = Instant::now();
    assert!(
        closed_within(&mut s, 8),
        "a stalled TLS handshake must be closed"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "closed after {:?}",
        start.elapsed()
    );
    let good = cert_uri(&h, &pki, "cli-nocert");
    assert_serves(&h, &good);
}

#[test]
fn tls_handshake_holds_a_connection_slot() {
    let pki = Pki::new();
    let tls = ServerTls::x509(&pki.dir("srv"), false, true).unwrap();
    let h = Harness::start_cfg(ServerConfig {
        handshake_timeout: Duration::from_secs(2),
        max_connections: 1,
        tls: Some(tls),
        ..Default::default()
    });
    let mut stalled = h.greeted();
    starttls(&mut stalled);
    stalled.write_all(&[0x16, 0x03]).unwrap();
    // The only slot is taken: the next connection is refused; it is told
    // why (NBD_REP_ERR_POLICY to its options) and never gets an export.
    let mut refused = TcpStream::connect(("127.0.0.1", h.server.port)).unwrap();
    refused
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    greet(&mut refused);
    send_opt(&mut refused, OPT_GO, &go_data());
    let (opt, typ, why) = reply(&mut refused);
    assert_eq!(
        (opt, typ),
        (OPT_GO, REP_ERR_POLICY),
        "a connection beyond the cap was served"
    );
    assert!(
        String::from_utf8_lossy(&why).contains("too many connections"),
        "{}",
        String::from_utf8_lossy(&why)
    );
    assert!(
        closed_within(&mut stalled, 8),
        "stalled handshake not timed out"
    );
    assert_serves(&h, &cert_uri(&h, &pki, "cli-nocert"));
}

#[test]
fn psk_over_tls12_suites() {
    // GnuTLS peers negotiate TLS 1.3; a TLS 1.2-only PSK client must work
    // too, with the PSK suites the server enables.
    let pki = Pki::new();
    let tls = ServerTls::psk(&pki.dir("keys.psk"), true).unwrap();
    let h = Harness::start(tls, Duration::from_secs(5));
    let mut s = h.greeted();
    starttls(&mut s);
    let mut b = SslConnector::builder(SslMethod::tls_client()).unwrap();
    b.set_max_proto_version(Some(SslVersion::TLS1_2)).unwrap();
    b.set_cipher_list("PSK").unwrap();
    b.set_psk_client_callback(|_, _, identity, key| {
        identity[..6].copy_from_slice(b"alice\0");
        let k: Vec<u8> = (0..PSK_KEY.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&PSK_KEY[i..i + 2], 16).unwrap())
            .collect();
        key[..k.len()].copy_from_slice(&k);
        Ok(k.len())
    });
    let mut t = b
        .build()
        .connect("localhost", s)
        .expect("TLS 1.2 PSK handshake");
    assert_eq!(t.ssl().version_str(), "TLSv1.2");
    assert!(t.ssl().current_cipher().unwrap().name().contains("PSK"));
    go(&mut t);
    read_simple(&mut t, &h.model);
}
