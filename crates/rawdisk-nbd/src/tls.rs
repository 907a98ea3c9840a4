//! TLS for NBD (spec: "TLS support"), server and client, with the system's
//! OpenSSL: X.509 certificates in the directory layout nbdkit, qemu and
//! libnbd share, and pre-shared keys in GnuTLS's `psktool` file format.
//!
//! Why OpenSSL and not rustls: the GnuTLS peers (libnbd, qemu, nbdkit) speak
//! PSK, which mainline rustls does not (docs/architecture.md, TLS).
//!
//! The session is upgraded in place after NBD_OPT_STARTTLS: the plaintext
//! read and write halves are joined into one stream and handed to OpenSSL.

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, TryLockError};
use std::task::{Context, Poll, Waker};

use openssl::ex_data::Index;
use openssl::ssl::{
    Ssl, SslAcceptor, SslConnector, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslRef,
    SslVerifyMode, SslVersion,
};
use openssl::x509::store::X509Lookup;
use openssl::x509::verify::X509VerifyFlags;
use openssl::x509::{X509NameRef, X509VerifyResult};
use tokio::io::{AsyncRead, AsyncWrite, BufWriter, ReadBuf};
use tokio_openssl::SslStream;

/// A credential could not be loaded; the message names the file and why.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(String);

fn ssl_err(what: impl fmt::Display) -> impl FnOnce(openssl::error::ErrorStack) -> TlsError {
    move |e| TlsError(format!("{what}: {}", reasons(&e)))
}

/// What an OpenSSL error stack says, in words a person can act on: the
/// reasons only (not OpenSSL's source files and lines), and for the PEM
/// errors a file that does not parse gives, what to check.
fn reasons(e: &openssl::error::ErrorStack) -> String {
    let mut out: Vec<String> = Vec::new();
    for x in e.errors() {
        let r = match x.reason() {
            Some("no start line") => {
                "it holds no PEM block of the kind expected (a '-----BEGIN ...-----' line): \
                 check it is the right file, in PEM form"
            }
            Some("bad base64 decode") | Some("bad end line") | Some("ASN1 lib") => {
                "its PEM block is damaged: check the file's contents"
            }
            // OpenSSL 3's decoders: no decoder took the bytes.
            Some("unsupported") => {
                "it holds nothing OpenSSL reads as a key or certificate: check it is the \
                 right file, in PEM form"
            }
            // The line that follows a PEM error only repeats it.
            Some("PEM lib") if !out.is_empty() => continue,
            Some(r) => r,
            None => "unknown error",
        };
        if !out.iter().any(|o| o == r) {
            out.push(r.to_string());
        }
    }
    if out.is_empty() {
        e.to_string()
    } else {
        out.join("; ")
    }
}

/// TLS 1.2 is the floor the spec sets ("TLS versions").
const MIN_VERSION: SslVersion = SslVersion::TLS1_2;
/// TLS 1.2 PSK suites, for peers that do not offer TLS 1.3 (TLS 1.3 uses
/// the PSK with its own suites).
const PSK_CIPHERS: &str = "ECDHE-PSK:DHE-PSK:PSK:!NULL:!3DES:!RC4";

/// The PSK identity a client offered, and whether the server has a key for
/// it: kept on the connection to log who connected, or why the handshake
/// failed.
#[derive(Clone)]
struct PskSeen {
    identity: String,
    known: bool,
}

fn psk_identity_index() -> Result<Index<Ssl, PskSeen>, TlsError> {
    Ssl::new_ex_index().map_err(ssl_err("TLS: allocating connection data"))
}

/// Keys of a `psktool` file: `username:hexkey` lines.
pub fn load_psk_file(path: &Path) -> Result<HashMap<String, Vec<u8>>, TlsError> {
    let text = fs::read_to_string(path)
        .map_err(|e| TlsError(format!("cannot read PSK file '{}': {e}", path.display())))?;
    let mut keys = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| TlsError(format!("'{}' line {}: {why}", path.display(), n + 1));
        let (user, hex) = line
            .split_once(':')
            .ok_or_else(|| bad("expected username:hexkey"))?;
        if user.is_empty() {
            return Err(bad("empty username"));
        }
        let key =
            decode_hex(hex).ok_or_else(|| bad("the key is not an even number of hex digits"))?;
        if key.is_empty() {
            return Err(bad("empty key"));
        }
        keys.insert(user.to_string(), key);
    }
    if keys.is_empty() {
        return Err(TlsError(format!(
            "PSK file '{}' has no keys",
            path.display()
        )));
    }
    Ok(keys)
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}

fn file_in(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}

fn must_exist(p: &Path) -> Result<(), TlsError> {
    match fs::metadata(p) {
        Ok(_) => Ok(()),
        Err(e) => Err(TlsError(format!("cannot read '{}': {e}", p.display()))),
    }
}

/// Trust `ca-cert.pem` (and the CRL `ca-crl.pem` when present) for peer
/// certificates.
fn trust_ca(b: &mut SslContextBuilder, dir: &Path) -> Result<(), TlsError> {
    let ca = file_in(dir, "ca-cert.pem");
    must_exist(&ca)?;
    b.set_ca_file(&ca)
        .map_err(ssl_err(format!("loading '{}'", ca.display())))?;
    let crl = file_in(dir, "ca-crl.pem");
    if crl.exists() {
        let store = b.cert_store_mut();
        let lookup = store
            .add_lookup(X509Lookup::file())
            .map_err(ssl_err("TLS: certificate store"))?;
        lookup
            .load_crl_file(&crl, SslFiletype::PEM)
            .map_err(ssl_err(format!("loading '{}'", crl.display())))?;
        store
            .set_flags(X509VerifyFlags::CRL_CHECK)
            .map_err(ssl_err("TLS: certificate store"))?;
    }
    Ok(())
}

/// Our own certificate (chain) and its key.
fn load_identity(b: &mut SslContextBuilder, cert: &Path, key: &Path) -> Result<(), TlsError> {
    b.set_certificate_chain_file(cert)
        .map_err(ssl_err(format!("loading '{}'", cert.display())))?;
    b.set_private_key_file(key, SslFiletype::PEM)
        .map_err(ssl_err(format!("loading '{}'", key.display())))?;
    b.check_private_key().map_err(ssl_err(format!(
        "'{}' does not match '{}'",
        key.display(),
        cert.display()
    )))
}

/// A client's directory: `ca-cert.pem`, and `client-cert.pem` with
/// `client-key.pem` when both are there.
fn load_client_x509(b: &mut SslContextBuilder, dir: &Path) -> Result<(), TlsError> {
    trust_ca(b, dir)?;
    let cert = file_in(dir, "client-cert.pem");
    let key = file_in(dir, "client-key.pem");
    if cert.exists() && key.exists() {
        load_identity(b, &cert, &key)?;
    }
    Ok(())
}

/// libnbd's compiled-in certificate directories (nbd_set_tls_certificates):
/// /etc/pki/libnbd for root, else $HOME/.pki/libnbd or
/// $HOME/.config/pki/libnbd; the first that holds a `ca-cert.pem`.
fn default_certificates() -> Option<PathBuf> {
    let mut dirs = Vec::new();
    if rustix::process::geteuid().is_root() {
        dirs.push(PathBuf::from("/etc/pki/libnbd"));
    } else if let Some(home) = std::env::var_os("HOME") {
        let home = PathBuf::from(home);
        dirs.push(home.join(".pki/libnbd"));
        dirs.push(home.join(".config/pki/libnbd"));
    }
    dirs.into_iter().find(|d| d.join("ca-cert.pem").exists())
}

/// "CN=client,O=example" from a certificate's subject.
fn name_string(n: &X509NameRef) -> String {
    n.entries()
        .map(|e| {
            let key = e.object().nid().short_name().unwrap_or("?");
            let val = String::from_utf8_lossy(e.data().as_slice());
            format!("{key}={val}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// What one finished handshake agreed, for the log.
pub(crate) fn describe(ssl: &SslRef, psk_user: Option<&str>) -> String {
    let peer = match (psk_user, ssl.peer_certificate()) {
        (Some(u), _) => format!("PSK user {u:?}"),
        (None, Some(c)) => format!("certificate {}", name_string(c.subject_name())),
        (None, None) => "no client certificate".into(),
    };
    format!(
        "{} {}, peer {peer}",
        ssl.version_str(),
        ssl.current_cipher().map_or("(no cipher)", |c| c.name())
    )
}

// ---------------------------------------------------------------------------
// Splitting a TLS stream

/// Read and write halves of one TLS stream for two tasks (the request
/// reader and the reply writer). OpenSSL's session is one object, so each
/// call takes a lock; a half that finds it taken yields and is woken when
/// the other half is done, instead of blocking its worker thread on a
/// futex the way tokio::io::split's mutex does (which made small requests
/// over TLS cost a context switch each).
pub(crate) fn split<S>(s: S) -> (TlsHalf<S>, TlsHalf<S>) {
    let inner = Arc::new(Halves {
        stream: Mutex::new(s),
        parked: [Mutex::new(None), Mutex::new(None)],
    });
    (
        TlsHalf {
            inner: inner.clone(),
            side: 0,
        },
        TlsHalf { inner, side: 1 },
    )
}

struct Halves<S> {
    stream: Mutex<S>,
    /// The waker of each half that found the stream taken.
    parked: [Mutex<Option<Waker>>; 2],
}

/// A TLS session over a socket whose ciphertext is gathered (see [`gather`]).
pub(crate) type TlsStream<S> = SslStream<BufWriter<S>>;

/// OpenSSL hands the socket one record (at most 16 KiB) per write, so a
/// 1 MiB payload would be 64 sends; gathered below OpenSSL it is a few.
/// Both directions flush after each message (OpenSSL after each handshake
/// flight, the server after each batch of replies, the client after each
/// request), and SslStream passes the flush down to this buffer.
fn gather<S: AsyncWrite>(s: S) -> BufWriter<S> {
    BufWriter::with_capacity(256 << 10, s)
}

/// One half of [`split`]: side 0 reads, side 1 writes.
pub(crate) struct TlsHalf<S> {
    inner: Arc<Halves<S>>,
    side: usize,
}

impl<S> TlsHalf<S> {
    fn with<R>(
        &self,
        cx: &mut Context<'_>,
        f: impl FnOnce(&mut S, &mut Context<'_>) -> Poll<R>,
    ) -> Poll<R> {
        let h = &*self.inner;
        let mut f = Some(f);
        for attempt in 0..2 {
            let guard = match h.stream.try_lock() {
                Ok(g) => Some(g),
                Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            };
            if let Some(mut g) = guard {
                let r = (f.take().expect("called once"))(&mut g, cx);
                drop(g);
                let other = lock(&h.parked[1 - self.side]).take();
                if let Some(w) = other {
                    w.wake();
                }
                return r;
            }
            // Park, then try once more: the holder may have finished before
            // it could see us parked.
            if attempt == 0 {
                *lock(&h.parked[self.side]) = Some(cx.waker().clone());
            }
        }
        Poll::Pending
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<S: AsyncRead + Unpin> AsyncRead for TlsHalf<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.with(cx, |s, cx| {
            let start = buf.filled().len();
            match Pin::new(&mut *s).poll_read(cx, buf) {
                Poll::Ready(Ok(())) if buf.filled().len() > start => {}
                other => return other,
            }
            // One call yields one TLS record; take the records already
            // here too, so the reader sees every queued request at once
            // (as it does on a plain socket) and can batch them. A Pending
            // here only leaves a waker behind; an error or EOF shows again
            // on the next read.
            while buf.remaining() > 0 {
                let n = buf.filled().len();
                match Pin::new(&mut *s).poll_read(cx, buf) {
                    Poll::Ready(Ok(())) if buf.filled().len() > n => {}
                    _ => break,
                }
            }
            Poll::Ready(Ok(()))
        })
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for TlsHalf<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.with(cx, |s, cx| Pin::new(s).poll_write(cx, data))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(cx, |s, cx| Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(cx, |s, cx| Pin::new(s).poll_shutdown(cx))
    }
}

// ---------------------------------------------------------------------------
// Server

/// The server's TLS credentials and policy.
#[derive(Clone)]
pub struct ServerTls {
    ctx: SslContext,
    require: bool,
    psk_user: Option<Index<Ssl, PskSeen>>,
    what: String,
    /// The PSK file, to name in a failed handshake's log line.
    psk_file: Option<PathBuf>,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("require", &self.require)
            .field("credentials", &self.what)
            .finish()
    }
}

impl ServerTls {
    /// X.509 from `dir`: `server-cert.pem`, `server-key.pem`, and with
    /// `verify_peer` client certificates checked against `ca-cert.pem` and
    /// the optional `ca-crl.pem`.
    pub fn x509(dir: &Path, verify_peer: bool, require: bool) -> Result<ServerTls, TlsError> {
        let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())
            .map_err(ssl_err("TLS: server context"))?;
        let cert = file_in(dir, "server-cert.pem");
        let key = file_in(dir, "server-key.pem");
        must_exist(&cert)?;
        must_exist(&key)?;
        load_identity(&mut b, &cert, &key)?;
        if verify_peer {
            trust_ca(&mut b, dir)?;
            let ca = file_in(dir, "ca-cert.pem");
            let names = openssl::x509::X509Name::load_client_ca_file(&ca)
                .map_err(ssl_err(format!("loading '{}'", ca.display())))?;
            b.set_client_ca_list(names);
            b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
        }
        common_server(&mut b)?;
        Ok(ServerTls {
            ctx: b.build().into_context(),
            require,
            psk_user: None,
            psk_file: None,
            what: format!(
                "X.509 from '{}'{}",
                dir.display(),
                if verify_peer {
                    ", client certificates verified"
                } else {
                    ""
                }
            ),
        })
    }

    /// Pre-shared keys from a `psktool` file.
    pub fn psk(file: &Path, require: bool) -> Result<ServerTls, TlsError> {
        let keys = Arc::new(load_psk_file(file)?);
        let idx = psk_identity_index()?;
        let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())
            .map_err(ssl_err("TLS: server context"))?;
        b.set_cipher_list(PSK_CIPHERS)
            .map_err(ssl_err("TLS: PSK cipher list"))?;
        // OpenSSL uses this callback for TLS 1.2 PSK suites and, with the
        // SHA-256 TLS 1.3 suites, for TLS 1.3 external PSKs too.
        b.set_psk_server_callback(move |ssl, identity, out| {
            let offered = identity.map(|i| String::from_utf8_lossy(i).into_owned());
            let user = identity.and_then(|i| std::str::from_utf8(i).ok());
            let Some((user, key)) = user.and_then(|u| keys.get_key_value(u)) else {
                if let Some(identity) = offered {
                    ssl.set_ex_data(
                        idx,
                        PskSeen {
                            identity,
                            known: false,
                        },
                    );
                }
                return Ok(0);
            };
            if key.len() > out.len() {
                tracing::warn!("TLS: the PSK of {user:?} is longer than OpenSSL accepts");
                return Ok(0);
            }
            out[..key.len()].copy_from_slice(key);
            ssl.set_ex_data(
                idx,
                PskSeen {
                    identity: user.clone(),
                    known: true,
                },
            );
            Ok(key.len())
        });
        common_server(&mut b)?;
        Ok(ServerTls {
            ctx: b.build().into_context(),
            require,
            psk_user: Some(idx),
            what: format!("PSK from '{}'", file.display()),
            psk_file: Some(file.to_path_buf()),
        })
    }

    /// Whether plaintext clients are refused (NBD_REP_ERR_TLS_REQD).
    pub fn required(&self) -> bool {
        self.require
    }

    /// A one-line description of the credentials, for the start-up log.
    pub fn describe(&self) -> &str {
        &self.what
    }

    /// Runs the server side of the TLS handshake over `s`.
    pub(crate) async fn accept<S>(&self, s: S) -> io::Result<(TlsStream<S>, String)>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let ssl = Ssl::new(&self.ctx).map_err(io::Error::other)?;
        let mut stream = SslStream::new(ssl, gather(s)).map_err(io::Error::other)?;
        if let Err(e) = Pin::new(&mut stream).accept().await {
            let seen = self.psk_user.and_then(|i| stream.ssl().ex_data(i)).cloned();
            return Err(self
                .psk_failure(seen, &e)
                .unwrap_or_else(|| handshake_error(e)));
        }
        let ssl = stream.ssl();
        let user = self
            .psk_user
            .and_then(|i| ssl.ex_data(i))
            .map(|s| s.identity.clone());
        let info = describe(ssl, user.as_deref());
        Ok((stream, info))
    }

    /// A PSK handshake that failed, in a sentence: OpenSSL's reasons
    /// ("no suitable signature algorithm" for an unknown user, "binder does
    /// not verify" for a wrong key) say nothing an operator can act on.
    fn psk_failure(&self, seen: Option<PskSeen>, e: &openssl::ssl::Error) -> Option<io::Error> {
        let file = self.psk_file.as_ref()?.display();
        if e.io_error()
            .is_some_and(|io| io.kind() == io::ErrorKind::UnexpectedEof)
        {
            return None;
        }
        let msg = match seen {
            Some(PskSeen {
                identity,
                known: false,
            }) => format!(
                "TLS handshake failed: unknown PSK identity {identity:?}: '{file}' has no key \
                 for that user (check the user name in the client's URI)"
            ),
            Some(PskSeen {
                identity,
                known: true,
            }) => format!(
                "TLS handshake failed: PSK user {identity:?} has another key than the one in \
                 '{file}' (check the key on both sides)"
            ),
            None => format!(
                "TLS handshake failed: the client offered no pre-shared key (this server takes \
                 PSK users from '{file}'; a client with X.509 certificates cannot connect): {}",
                handshake_error_text(e)
            ),
        };
        Some(io::Error::new(io::ErrorKind::InvalidData, msg))
    }
}

fn common_server(b: &mut SslContextBuilder) -> Result<(), TlsError> {
    b.set_min_proto_version(Some(MIN_VERSION))
        .map_err(ssl_err("TLS: minimum version"))?;
    read_ahead(b);
    // One session per connection and no resumption: tickets would only be
    // bytes on the wire.
    b.set_num_tickets(0)
        .map_err(ssl_err("TLS: session tickets"))?;
    Ok(())
}

/// OpenSSL reads whatever the socket holds, not a record header and then
/// its body: two recv calls per record otherwise.
fn read_ahead(b: &mut SslContextBuilder) {
    b.set_read_ahead(true);
}

/// An OpenSSL handshake error as an io::Error that says what failed.
fn handshake_error(e: openssl::ssl::Error) -> io::Error {
    if let Some(io) = e.io_error() {
        if io.kind() == io::ErrorKind::UnexpectedEof {
            return io::Error::new(io::ErrorKind::UnexpectedEof, "closed during TLS handshake");
        }
    }
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("TLS handshake failed: {}", handshake_error_text(&e)),
    )
}

fn handshake_error_text(e: &openssl::ssl::Error) -> String {
    let msg = match e.ssl_error() {
        Some(stack) => reasons(stack),
        None => e.to_string(),
    };
    if msg.is_empty() {
        "the peer closed the connection".to_string()
    } else {
        msg
    }
}

// ---------------------------------------------------------------------------
// Client

// X509_V_ERR_* (x509_vfy.h): a chain without a trusted root.
const X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT: i32 = 2;
const X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT: i32 = 18;
const X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN: i32 = 19;
const X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY: i32 = 20;
const X509_V_ERR_UNABLE_TO_VERIFY_LEAF_SIGNATURE: i32 = 21;

/// TLS settings of a `nbds://` URI (the NBD URI spec's `tls-*` query
/// parameters, and libnbd's `tls-certificates` and `tls-psk-file`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsParams {
    /// `tls-certificates=DIR`: `ca-cert.pem`, optional `client-cert.pem` and
    /// `client-key.pem`. Without it (and without a PSK) libnbd's default
    /// directories, then the system's CAs.
    pub certificates: Option<PathBuf>,
    /// `tls-psk-file=FILE`: `username:hexkey` lines.
    pub psk_file: Option<PathBuf>,
    /// The URI's user part: the PSK identity.
    pub username: Option<String>,
    /// `tls-hostname=NAME`: the name the server certificate must carry.
    pub hostname: Option<String>,
    /// `tls-verify-peer=0` turns server certificate checks off.
    pub verify_peer: bool,
}

/// A client's TLS context, built once per URI and shared by its connections.
pub struct ClientTls {
    ctx: SslContext,
    /// Name checked against the server certificate (None: chain only).
    hostname: Option<String>,
    /// What the refusals are explained with.
    creds: Creds,
}

/// The credentials a client offers, to say which one a server refused.
#[derive(Debug, Clone)]
enum Creds {
    /// X.509 from this directory (None: the system's CAs), with or
    /// without a client certificate.
    X509 {
        dir: Option<PathBuf>,
        cert: bool,
    },
    Psk {
        user: String,
    },
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("hostname", &self.hostname)
            .finish()
    }
}

impl ClientTls {
    /// `host`: the URI's host, the default for the certificate's name.
    pub fn new(p: &TlsParams, host: Option<&str>) -> Result<ClientTls, TlsError> {
        let mut b = SslConnector::builder(SslMethod::tls_client())
            .map_err(ssl_err("TLS: client context"))?;
        b.set_min_proto_version(Some(MIN_VERSION))
            .map_err(ssl_err("TLS: minimum version"))?;
        read_ahead(&mut b);
        let mut hostname = p.hostname.clone().or_else(|| host.map(String::from));
        let has_cert = |d: &Path| {
            file_in(d, "client-cert.pem").exists() && file_in(d, "client-key.pem").exists()
        };
        let creds;
        match (&p.certificates, &p.psk_file) {
            (Some(_), Some(_)) => {
                return Err(TlsError(
                    "tls-certificates and tls-psk-file are alternatives: give one".into(),
                ))
            }
            (_, Some(file)) => {
                let keys = load_psk_file(file)?;
                let user = match &p.username {
                    Some(u) => u.clone(),
                    None => std::env::var("USER")
                        .or_else(|_| std::env::var("LOGNAME"))
                        .map_err(|_| {
                            TlsError(
                                "tls-psk-file: name the PSK user in the URI (nbds://USER@host/)"
                                    .into(),
                            )
                        })?,
                };
                let key = keys.get(&user).cloned().ok_or_else(|| {
                    TlsError(format!("'{}' has no key for user {user:?}", file.display()))
                })?;
                creds = Creds::Psk { user: user.clone() };
                b.set_cipher_list(PSK_CIPHERS)
                    .map_err(ssl_err("TLS: PSK cipher list"))?;
                b.set_psk_client_callback(move |_ssl, _hint, identity, out| {
                    // The identity goes out NUL-terminated.
                    if user.len() + 1 > identity.len() || key.len() > out.len() {
                        return Ok(0);
                    }
                    identity[..user.len()].copy_from_slice(user.as_bytes());
                    identity[user.len()] = 0;
                    out[..key.len()].copy_from_slice(&key);
                    Ok(key.len())
                });
                // A PSK handshake has no certificate to check a name against.
                hostname = None;
            }
            (Some(dir), None) => {
                load_client_x509(&mut b, dir)?;
                creds = Creds::X509 {
                    dir: Some(dir.clone()),
                    cert: has_cert(dir),
                };
            }
            // libnbd's default directories, so one set of files serves
            // both; else the system's CAs (SslConnector's default).
            (None, None) => {
                let dir = default_certificates();
                if let Some(dir) = &dir {
                    load_client_x509(&mut b, dir)?;
                }
                creds = Creds::X509 {
                    cert: dir.as_deref().is_some_and(has_cert),
                    dir,
                };
            }
        }
        if !p.verify_peer {
            b.set_verify(SslVerifyMode::NONE);
            hostname = None;
        }
        Ok(ClientTls {
            ctx: b.build().into_context(),
            hostname,
            creds,
        })
    }

    /// Why the server ended the connection right after the TLS handshake
    /// (`raw`: how it ended). With TLS 1.3 the server checks the client's
    /// certificate after the client finished its side, so a refusal shows
    /// up as the first option failing (EPIPE, EOF, a reset).
    pub(crate) fn refused_after_handshake(&self, raw: &str) -> String {
        match &self.creds {
            Creds::X509 {
                dir: Some(dir),
                cert: false,
            } => format!(
                "the server requires a client certificate (client-cert.pem in {})",
                dir.display()
            ),
            _ => format!(
                "{raw} right after the TLS handshake (did the server refuse this client's certificate?)"
            ),
        }
    }

    /// A failed handshake as a sentence for the common refusals, the
    /// OpenSSL reasons in brackets; else what OpenSSL said.
    fn explain(&self, e: openssl::ssl::Error, verify: X509VerifyResult) -> String {
        let reasons: Vec<i32> = e
            .ssl_error()
            .map(|s| s.errors().iter().map(|x| x.reason_code()).collect())
            .unwrap_or_default();
        // The server hung up: EOF with nothing said (OpenSSL reports it as
        // an io error, as no error at all, or as reason 294,
        // SSL_R_UNEXPECTED_EOF_WHILE_READING).
        let closed = match e.io_error() {
            Some(io) => io.kind() == io::ErrorKind::UnexpectedEof,
            None => reasons.is_empty() || reasons.contains(&294),
        };
        // OpenSSL's reason code for a received alert is 1000 + the alert.
        let alerts: Vec<i32> = reasons.iter().map(|r| r - 1000).collect();
        let raw = handshake_error(e).to_string();
        match &self.creds {
            // handshake_failure, illegal_parameter, bad_record_mac,
            // decrypt_error, unknown_psk_identity; GnuTLS servers just
            // hang up.
            Creds::Psk { user }
                if closed || alerts.iter().any(|a| matches!(a, 40 | 47 | 20 | 51 | 115)) =>
            {
                format!("the server rejected the key for user {user} ({raw})")
            }
            // certificate_required: a server that saw no client
            // certificate in the handshake itself.
            Creds::X509 {
                dir: Some(_),
                cert: false,
            } if alerts.contains(&116) => {
                format!("{} ({raw})", self.refused_after_handshake(&raw))
            }
            // The chain does not lead to a CA this client trusts.
            Creds::X509 { dir, .. }
                if matches!(
                    verify.as_raw(),
                    X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT
                        | X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT
                        | X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN
                        | X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY
                        | X509_V_ERR_UNABLE_TO_VERIFY_LEAF_SIGNATURE
                ) =>
            {
                let ca = match dir {
                    Some(d) => format!("ca-cert.pem in {}", d.display()),
                    None => "the system's CAs".to_string(),
                };
                format!(
                    "the server's certificate is not signed by {ca} (or pass tls-verify-peer=0) ({raw}: {})",
                    verify.error_string()
                )
            }
            _ if verify != X509VerifyResult::OK => {
                format!("{raw} (server certificate: {})", verify.error_string())
            }
            _ => raw,
        }
    }

    /// Runs the client side of the TLS handshake over `s`; the message says
    /// what failed.
    pub(crate) async fn connect<S>(&self, s: S) -> Result<(TlsStream<S>, String), String>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let mut ssl = Ssl::new(&self.ctx).map_err(|e| e.to_string())?;
        if let Some(h) = &self.hostname {
            match h.parse::<std::net::IpAddr>() {
                Ok(ip) => ssl.param_mut().set_ip(ip),
                Err(_) => {
                    // SNI, and the name the certificate must carry.
                    ssl.set_hostname(h).map_err(|e| e.to_string())?;
                    ssl.param_mut().set_host(h)
                }
            }
            .map_err(|e| format!("TLS hostname {h:?}: {e}"))?;
        }
        let mut stream = SslStream::new(ssl, gather(s)).map_err(|e| e.to_string())?;
        if let Err(e) = Pin::new(&mut stream).connect().await {
            let verify = stream.ssl().verify_result();
            return Err(self.explain(e, verify));
        }
        let info = describe(stream.ssl(), None);
        Ok((stream, info))
    }
}
