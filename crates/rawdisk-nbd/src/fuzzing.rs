//! The bodies of the fuzz targets in `fuzz/`: the cargo-fuzz binaries call
//! these, and `tests/fuzz_corpus.rs` replays every committed corpus file
//! through them on stable Rust, so each run of the tests repeats the same
//! assertions the fuzzer makes. Not an API.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once, OnceLock};
use std::time::Duration;

use rawdisk_storage::{OpenOptions, Target};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;
use tokio::sync::watch;

use crate::proto::*;
use crate::server::{Server, ServerConfig};

/// The option cap the server applies (`ServerConfig::max_option_len`).
const OPTION_CAP: u32 = 64 << 10;

/// The handshake as a server reads it: a stream of options, decoded one
/// after the other with the server's 64 KiB cap; and the same bytes as a
/// client reads option replies. Whatever decodes must encode back to a
/// message that decodes to the same value.
pub fn option_decoder(data: &[u8]) {
    let mut rest = data;
    while !rest.is_empty() {
        match decode_option(rest, OPTION_CAP) {
            Ok((opt, n)) => {
                assert!(n >= OPTION_HEADER_LEN && n <= rest.len());
                let mut b = Vec::new();
                opt.encode(&mut b);
                let (again, m) = decode_option(&b, u32::MAX).expect("re-encoded option decodes");
                assert_eq!(again, opt);
                assert_eq!(m, b.len());
                rest = &rest[n..];
            }
            Err(DecodeError::NeedMore(k)) => {
                assert!(k > 0);
                break;
            }
            // The server answers NBD_REP_ERR_INVALID for a parse error once
            // the whole option is read; model that by skipping it.
            Err(DecodeError::Invalid(_)) => match decode_option_header(rest) {
                Ok((h, n)) if (h.len as usize) <= rest.len() - n => {
                    rest = &rest[n + h.len as usize..];
                }
                _ => break,
            },
            Err(DecodeError::TooLarge { .. }) => break,
        }
    }

    let mut rest = data;
    while !rest.is_empty() {
        match decode_option_reply(rest, OPTION_CAP) {
            Ok(((option, rep), n)) => {
                assert!(n >= OPTION_REPLY_HEADER_LEN && n <= rest.len());
                let mut b = Vec::new();
                rep.encode(option, &mut b);
                let ((o2, r2), _) =
                    decode_option_reply(&b, u32::MAX).expect("re-encoded reply decodes");
                assert_eq!(o2, option);
                assert_eq!(r2, rep);
                rest = &rest[n..];
            }
            Err(_) => break,
        }
    }
    let _ = decode_greeting(data);
    let _ = decode_export_name_reply(data, data.first().is_some_and(|b| b & 1 == 1));
}

/// The transmission phase as a server reads it: request headers (compact or
/// extended, chosen by the first byte) each followed by the payload its
/// header announces; and the same bytes as a client reads replies. Decoded
/// headers must encode back to the same bytes.
pub fn request_decoder(data: &[u8]) {
    let Some((&first, body)) = data.split_first() else {
        return;
    };
    let extended = first & 1 == 1;
    let mut rest = body;
    while !rest.is_empty() {
        match decode_request(rest, extended) {
            Ok((req, n)) => {
                assert_eq!(n, request_header_len(extended));
                let mut b = Vec::new();
                req.encode(&mut b, extended);
                assert_eq!(&b[..], &rest[..n]);
                let payload = req.payload_len(extended);
                if payload > (rest.len() - n) as u64 {
                    break;
                }
                rest = &rest[n + payload as usize..];
            }
            Err(DecodeError::NeedMore(k)) => {
                assert!(k > 0 && k <= request_header_len(extended));
                break;
            }
            Err(_) => break,
        }
    }

    let mode = match first >> 1 & 3 {
        0 => ReplyMode::Simple,
        1 => ReplyMode::Structured,
        _ => ReplyMode::Extended,
    };
    let mut rest = body;
    while !rest.is_empty() {
        match decode_reply_header(rest, mode) {
            Ok((ReplyHeader::Simple { .. }, n)) => rest = &rest[n..],
            Ok((ReplyHeader::Chunk { typ, length, .. }, n)) => {
                if length > (rest.len() - n) as u64 {
                    break;
                }
                let end = n + length as usize;
                let _ = decode_chunk(typ, &rest[n..end]);
                rest = &rest[end..];
            }
            Err(_) => break,
        }
    }
}

/// Size of the file the server target exports.
pub const SERVER_EXPORT_SIZE: u64 = 1 << 20;
/// Largest payload the server target takes (a fuzzer's input is smaller,
/// but a header may announce more).
pub const SERVER_MAX_PAYLOAD: u32 = 256 << 10;
/// A connection fed all its input and then EOF ends long before this.
const SERVER_HANG: Duration = Duration::from_secs(10);

/// The whole server as a client would meet it: `data` is everything the
/// client sends (handshake, then requests), followed by EOF, over an
/// in-memory stream to [`Server::serve_stream`] with a 1 MiB scratch file as
/// the export. The server must not panic on any thread, must finish (a
/// hang panics here) and must have begun with its greeting.
pub fn server(data: &[u8]) {
    let panics = panics_so_far();
    let rt = runtime();
    let cfg = ServerConfig {
        max_requests_per_conn: 16,
        max_bytes_per_conn: 1 << 20,
        max_bytes_total: 2 << 20,
        max_payload: SERVER_MAX_PAYLOAD,
        max_payload_unnegotiated: SERVER_MAX_PAYLOAD,
        ..ServerConfig::default()
    };
    let server = Arc::new(Server::new(scratch_target(), cfg));
    let (client, conn) = tokio::io::duplex(64 << 10);
    let (stop_tx, stop) = watch::channel(false);
    let input = data.to_vec();
    let sent = rt.block_on(async move {
        // On worker threads, so that a server stuck in a loop cannot stop
        // the timeout below from firing.
        let served = tokio::spawn(async move { server.serve_stream(conn, stop).await });
        let (mut from_server, mut to_server) = tokio::io::split(client);
        let feed = tokio::spawn(async move {
            // The server may hang up before reading it all.
            let _ = to_server.write_all(&input).await;
            let _ = to_server.shutdown().await;
        });
        let drain = tokio::spawn(async move {
            let mut out = Vec::new();
            let _ = from_server.read_to_end(&mut out).await;
            out
        });
        let all = async {
            served.await.expect("serve_stream panicked");
            feed.await.expect("feeding the input panicked");
            drain.await.expect("reading the replies panicked")
        };
        let out = tokio::time::timeout(SERVER_HANG, all).await;
        drop(stop_tx);
        out
    });
    let out = sent.unwrap_or_else(|_| panic!("the server did not finish within {SERVER_HANG:?}"));
    assert_eq!(
        panics_so_far(),
        panics,
        "the server panicked on a thread of its own"
    );
    assert!(
        matches!(decode_greeting(&out), Ok((_, GREETING_LEN))),
        "the server did not start with its greeting"
    );
}

fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime for the server target")
    })
}

/// One scratch file per process, unlinked once open: inputs share it, so
/// one input's writes are the next one's data.
fn scratch_target() -> Arc<Target> {
    static TARGET: OnceLock<Arc<Target>> = OnceLock::new();
    TARGET
        .get_or_init(|| {
            let path: PathBuf =
                std::env::temp_dir().join(format!("rawdisk-nbd-fuzz-{}", std::process::id()));
            let file = std::fs::File::create(&path)
                .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
            file.set_len(SERVER_EXPORT_SIZE)
                .unwrap_or_else(|e| panic!("sizing {}: {e}", path.display()));
            let t = Target::open(&path, &OpenOptions::default())
                .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
            let _ = std::fs::remove_file(&path);
            Arc::new(t)
        })
        .clone()
}

/// Panics seen by the process so far: tokio catches a panic in a spawned
/// task or blocking job, so the server target counts them with a hook.
fn panics_so_far() -> usize {
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
    PANICS.load(Ordering::SeqCst)
}
