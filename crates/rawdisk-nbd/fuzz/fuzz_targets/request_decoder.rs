//! The transmission phase as a server reads it: request headers (compact or
//! extended, chosen by the first byte) each followed by the payload its
//! header announces; and the same bytes as a client reads replies. Decoded
//! headers must encode back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rawdisk_nbd::proto::*;

fuzz_target!(|data: &[u8]| {
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
});
