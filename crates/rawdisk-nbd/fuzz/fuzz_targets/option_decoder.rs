//! The handshake as a server reads it: a stream of options, decoded one
//! after the other with the server's 64 KiB cap; and the same bytes as a
//! client reads option replies. Whatever decodes must encode back to a
//! message that decodes to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rawdisk_nbd::proto::*;

const CAP: u32 = 64 << 10;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while !rest.is_empty() {
        match decode_option(rest, CAP) {
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
        match decode_option_reply(rest, CAP) {
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
});
