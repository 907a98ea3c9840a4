//! Round trips, prefixes and refusals of every message the codec knows.

use super::*;

/// Every strict prefix of an encoded header must ask for more bytes, and
/// asking must be accurate.
fn check_prefixes<T: std::fmt::Debug>(buf: &[u8], dec: impl Fn(&[u8]) -> Decoded<T>) {
    for cut in 0..buf.len() {
        match dec(&buf[..cut]) {
            Err(DecodeError::NeedMore(n)) => assert!(n >= 1 && cut + n <= buf.len()),
            other => panic!("prefix {cut}/{}: {other:?}", buf.len()),
        }
    }
}

#[test]
fn greeting_round_trip() {
    let mut b = Vec::new();
    encode_greeting(&mut b, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    assert_eq!(b.len(), GREETING_LEN);
    assert_eq!(&b[..8], b"NBDMAGIC");
    assert_eq!(&b[8..16], b"IHAVEOPT");
    assert_eq!(decode_greeting(&b), Ok((3, 18)));
    check_prefixes(&b, decode_greeting);
    let mut bad = b.clone();
    bad[9] ^= 1;
    assert!(matches!(
        decode_greeting(&bad),
        Err(DecodeError::Invalid(_))
    ));
}

#[test]
fn client_flags_round_trip() {
    let mut b = Vec::new();
    encode_client_flags(&mut b, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    assert_eq!(b, [0, 0, 0, 3]);
    assert_eq!(decode_client_flags(&b), Ok((3, 4)));
    check_prefixes(&b, decode_client_flags);
}

fn all_options() -> Vec<ClientOption> {
    vec![
        ClientOption::ExportName(String::new()),
        ClientOption::ExportName("disk é".into()),
        ClientOption::Abort,
        ClientOption::List,
        ClientOption::StartTls,
        ClientOption::Info(InfoRequest {
            name: "x".into(),
            info: vec![INFO_EXPORT, INFO_BLOCK_SIZE],
        }),
        ClientOption::Go(InfoRequest {
            name: String::new(),
            info: vec![],
        }),
        ClientOption::Go(InfoRequest {
            name: "name".into(),
            info: vec![INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE, 77],
        }),
        ClientOption::StructuredReply,
        ClientOption::ListMetaContext(MetaContextRequest {
            name: "".into(),
            queries: vec![],
        }),
        ClientOption::ListMetaContext(MetaContextRequest {
            name: "e".into(),
            queries: vec!["base:".into()],
        }),
        ClientOption::SetMetaContext(MetaContextRequest {
            name: "e".into(),
            queries: vec!["base:allocation".into(), "qemu:dirty-bitmap:x".into()],
        }),
        ClientOption::ExtendedHeaders,
        ClientOption::Unknown {
            option: 0x1234,
            data: vec![1, 2, 3],
        },
    ]
}

#[test]
fn options_round_trip() {
    for opt in all_options() {
        let mut b = Vec::new();
        opt.encode(&mut b);
        let (h, n) = decode_option_header(&b).unwrap();
        assert_eq!(n, 16);
        assert_eq!(h.option, opt.option());
        assert_eq!(h.len as usize, b.len() - 16);
        assert_eq!(decode_option(&b, 65536), Ok((opt.clone(), b.len())));
        check_prefixes(&b, |x| decode_option(x, 65536));
        // Trailing bytes belong to the next message.
        let mut more = b.clone();
        more.extend_from_slice(b"IHAVEOPT");
        assert_eq!(decode_option(&more, 65536), Ok((opt.clone(), b.len())));
    }
}

#[test]
fn option_go_wire_format() {
    let mut b = Vec::new();
    ClientOption::Go(InfoRequest {
        name: "ab".into(),
        info: vec![INFO_BLOCK_SIZE],
    })
    .encode(&mut b);
    let want: Vec<u8> = [
        &b"IHAVEOPT"[..],
        &[0, 0, 0, 7],
        &[0, 0, 0, 10],
        &[0, 0, 0, 2],
        b"ab",
        &[0, 1],
        &[0, 3],
    ]
    .concat();
    assert_eq!(b, want);
}

#[test]
fn option_errors() {
    // Oversized length is refused from the header alone.
    let mut b = Vec::new();
    OptionHeader {
        option: OPT_GO,
        len: 0xffff_ffff,
    }
    .encode(&mut b);
    assert!(matches!(
        decode_option(&b, 65536),
        Err(DecodeError::TooLarge { .. })
    ));
    // Data on options that take none.
    for opt in [
        OPT_LIST,
        OPT_STARTTLS,
        OPT_STRUCTURED_REPLY,
        OPT_EXTENDED_HEADERS,
    ] {
        assert!(ClientOption::parse(opt, &[0]).is_err());
        assert!(ClientOption::parse(opt, &[]).is_ok());
    }
    assert_eq!(
        ClientOption::parse(OPT_ABORT, &[1, 2]),
        Ok(ClientOption::Abort)
    );
    // GO: name length beyond the data; count mismatch; NUL in name.
    assert!(ClientOption::parse(OPT_GO, &[0, 0, 0, 9, b'a', 0, 0]).is_err());
    assert!(ClientOption::parse(OPT_GO, &[0, 0, 0, 0, 0, 2, 0, 1]).is_err());
    assert!(ClientOption::parse(OPT_GO, &[0, 0, 0, 1, 0, 0, 0]).is_err());
    assert!(ClientOption::parse(OPT_GO, &[0, 0, 0, 0, 0]).is_err());
    // Invalid UTF-8 export name.
    assert!(ClientOption::parse(OPT_EXPORT_NAME, &[0xff]).is_err());
    // Meta context: huge query count with no data must not allocate.
    assert!(
        ClientOption::parse(OPT_SET_META_CONTEXT, &[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]).is_err()
    );
    // Trailing garbage after queries.
    assert!(ClientOption::parse(OPT_SET_META_CONTEXT, &[0, 0, 0, 0, 0, 0, 0, 0, 1]).is_err());
    // Bad magic.
    let mut b = Vec::new();
    ClientOption::List.encode(&mut b);
    b[0] = b'X';
    assert!(matches!(
        decode_option(&b, 65536),
        Err(DecodeError::Invalid(_))
    ));
}

fn all_replies() -> Vec<OptionReply> {
    vec![
        OptionReply::Ack,
        OptionReply::Server {
            name: "".into(),
            description: "".into(),
        },
        OptionReply::Server {
            name: "disk".into(),
            description: "a disk".into(),
        },
        OptionReply::Info(Info::Export {
            size: 1 << 40,
            flags: FLAG_HAS_FLAGS | FLAG_SEND_FLUSH,
        }),
        OptionReply::Info(Info::Name("disk".into())),
        OptionReply::Info(Info::Description("desc".into())),
        OptionReply::Info(Info::BlockSize {
            min: 1,
            preferred: 4096,
            max: 32 << 20,
        }),
        OptionReply::Info(Info::Unknown {
            info: 99,
            data: vec![9, 9],
        }),
        OptionReply::MetaContext {
            id: 7,
            name: META_CONTEXT_BASE_ALLOCATION.into(),
        },
        OptionReply::Error {
            reply: REP_ERR_UNSUP,
            message: "no".into(),
        },
        OptionReply::Error {
            reply: REP_ERR_EXT_HEADER_REQD,
            message: "".into(),
        },
        OptionReply::Unknown {
            reply: 77,
            data: vec![1],
        },
    ]
}

#[test]
fn option_replies_round_trip() {
    for rep in all_replies() {
        let mut b = Vec::new();
        rep.encode(OPT_GO, &mut b);
        let (h, _) = decode_option_reply_header(&b).unwrap();
        assert_eq!(h.reply, rep.reply_type());
        assert_eq!(h.len as usize, b.len() - 20);
        assert_eq!(
            decode_option_reply(&b, 65536),
            Ok(((OPT_GO, rep.clone()), b.len()))
        );
        check_prefixes(&b, |x| decode_option_reply(x, 65536));
    }
}

#[test]
fn info_export_wire_format() {
    let mut b = Vec::new();
    OptionReply::Info(Info::Export {
        size: 0x0102,
        flags: 0x0304,
    })
    .encode(OPT_GO, &mut b);
    assert_eq!(b.len(), 20 + 12);
    assert_eq!(&b[16..20], &[0, 0, 0, 12]);
    assert_eq!(&b[20..], &[0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]);
}

#[test]
fn export_name_reply_round_trip() {
    for nz in [false, true] {
        let mut b = Vec::new();
        encode_export_name_reply(&mut b, 12345, 0x1ff, nz);
        assert_eq!(b.len(), if nz { 10 } else { 134 });
        assert_eq!(
            decode_export_name_reply(&b, nz),
            Ok(((12345, 0x1ff), b.len()))
        );
        check_prefixes(&b, |x| decode_export_name_reply(x, nz));
    }
}

#[test]
fn requests_round_trip() {
    let reqs = [
        Request {
            flags: CMD_FLAG_FUA,
            command: Command::Write,
            cookie: 0xdead_beef_0000_0001,
            offset: 1 << 40,
            length: 4096,
        },
        Request {
            flags: CMD_FLAG_REQ_ONE,
            command: Command::BlockStatus,
            cookie: 2,
            offset: 0,
            length: u32::MAX as u64,
        },
        Request {
            command: Command::Disc,
            ..Default::default()
        },
    ];
    for ext in [false, true] {
        for req in reqs {
            let mut b = Vec::new();
            req.encode(&mut b, ext);
            assert_eq!(b.len(), request_header_len(ext));
            assert_eq!(decode_request(&b, ext), Ok((req, b.len())));
            check_prefixes(&b, |x| decode_request(x, ext));
            // The other mode must refuse this magic.
            let mut other = b.clone();
            other.resize(32, 0);
            assert!(matches!(
                decode_request(&other, !ext),
                Err(DecodeError::Invalid(_))
            ));
        }
    }
    // 64-bit lengths survive extended headers.
    let big = Request {
        flags: 0,
        command: Command::WriteZeroes,
        cookie: 9,
        offset: 0,
        length: 1 << 40,
    };
    let mut b = Vec::new();
    big.encode(&mut b, true);
    assert_eq!(decode_request(&b, true), Ok((big, 32)));
}

#[test]
fn command_numbers_round_trip() {
    for n in 0..=u16::MAX {
        let c = Command::from_wire(n);
        assert_eq!(c.wire(), n);
        let known = !matches!(c, Command::Unknown(_));
        assert_eq!(known, n <= 8, "{n}");
        assert_eq!(c.name().starts_with("NBD_CMD_"), known, "{n}");
    }
    assert_eq!(Command::default(), Command::Read);
    assert_eq!(Command::WriteZeroes.name(), "NBD_CMD_WRITE_ZEROES");
    assert_eq!(Command::BlockStatus.verb(), "block status");
}

#[test]
fn error_and_flag_names() {
    assert_eq!(error_name(NBD_ENOSPC), "NBD_ENOSPC");
    assert_eq!(error_name(0), "success");
    assert_eq!(error_name(4242), "unknown NBD error");
    assert_eq!(error_description(NBD_EIO), Some("input/output error"));
    assert_eq!(nbd_to_errno(NBD_ENOTSUP), libc::ENOTSUP);
    assert_eq!(nbd_to_errno(4242), libc::EINVAL);
    for e in ERRORS {
        assert_eq!(errno_to_nbd(nbd_to_errno(e.0)), e.0);
    }
    let names: Vec<_> = transmission_flag_names(FLAG_HAS_FLAGS | FLAG_SEND_TRIM).collect();
    assert_eq!(names, ["has_flags", "send_trim"]);
}

#[test]
fn payload_len_rules() {
    let w = Request {
        command: Command::Write,
        length: 512,
        ..Default::default()
    };
    assert_eq!(w.payload_len(false), 512);
    assert_eq!(w.payload_len(true), 512);
    let bs = Request {
        command: Command::BlockStatus,
        flags: CMD_FLAG_PAYLOAD_LEN,
        length: 16,
        ..Default::default()
    };
    assert_eq!(bs.payload_len(true), 16);
    assert_eq!(bs.payload_len(false), 0);
    let wp = Request {
        flags: CMD_FLAG_PAYLOAD_LEN,
        ..w
    };
    assert_eq!(wp.payload_len(true), 512);
    let r = Request {
        command: Command::Read,
        length: 512,
        ..Default::default()
    };
    assert_eq!(r.payload_len(false), 0);
}

#[test]
fn simple_reply_round_trip() {
    let mut b = Vec::new();
    encode_simple_reply(&mut b, 77, NBD_EIO);
    assert_eq!(b.len(), 16);
    for mode in [ReplyMode::Simple, ReplyMode::Structured] {
        assert_eq!(
            decode_reply_header(&b, mode),
            Ok((
                ReplyHeader::Simple {
                    cookie: 77,
                    error: NBD_EIO
                },
                16
            ))
        );
        check_prefixes(&b, |x| decode_reply_header(x, mode));
    }
    assert!(decode_reply_header(&b, ReplyMode::Extended).is_err());
}

/// Encodes with `f`, decodes header and chunk, returns the chunk header
/// and an owned copy of the parse result's debug form.
fn chunk_round_trip(
    mode: ReplyMode,
    f: impl Fn(&mut Vec<u8>, ReplyTo),
    check: impl Fn(&ReplyHeader, Chunk<'_>),
) {
    let to = ReplyTo {
        cookie: 0x0102_0304_0506_0708,
        offset: 4096,
    };
    let mut b = Vec::new();
    f(&mut b, to);
    let (h, n) = decode_reply_header(&b, mode).unwrap();
    check_prefixes(&b[..n], |x| decode_reply_header(x, mode));
    let ReplyHeader::Chunk {
        typ,
        length,
        cookie,
        offset,
        extended,
        ..
    } = h
    else {
        panic!("not a chunk")
    };
    assert_eq!(cookie, to.cookie);
    assert_eq!(extended, mode.extended());
    assert_eq!(offset, if extended { to.offset } else { 0 });
    assert_eq!(n + length as usize, b.len());
    let c = decode_chunk(typ, &b[n..]).unwrap();
    check(&h, c);
}

#[test]
fn chunks_round_trip() {
    for mode in [ReplyMode::Structured, ReplyMode::Extended] {
        chunk_round_trip(
            mode,
            |b, to| encode_chunk_none(b, mode, to),
            |h, c| {
                assert!(matches!(
                    h,
                    ReplyHeader::Chunk {
                        flags: REPLY_FLAG_DONE,
                        typ: REPLY_TYPE_NONE,
                        ..
                    }
                ));
                assert_eq!(c, Chunk::None);
            },
        );
        chunk_round_trip(
            mode,
            |b, to| {
                encode_offset_data_header(b, mode, to, 0, 8192, 5);
                assert_eq!(b.len(), offset_data_header_len(mode));
                b.extend_from_slice(b"hello");
            },
            |_, c| {
                assert_eq!(
                    c,
                    Chunk::OffsetData {
                        offset: 8192,
                        data: b"hello"
                    }
                )
            },
        );
        chunk_round_trip(
            mode,
            |b, to| encode_offset_hole(b, mode, to, REPLY_FLAG_DONE, 99, 1 << 20),
            |_, c| {
                assert_eq!(
                    c,
                    Chunk::OffsetHole {
                        offset: 99,
                        length: 1 << 20
                    }
                )
            },
        );
        let ds = [
            Descriptor {
                length: 4096,
                status: (STATE_HOLE | STATE_ZERO) as u64,
            },
            Descriptor {
                length: 65536,
                status: 0,
            },
        ];
        chunk_round_trip(
            mode,
            |b, to| encode_block_status(b, mode, to, REPLY_FLAG_DONE, 1, &ds),
            |h, c| {
                let want = if mode.extended() {
                    REPLY_TYPE_BLOCK_STATUS_EXT
                } else {
                    REPLY_TYPE_BLOCK_STATUS
                };
                assert!(matches!(h, ReplyHeader::Chunk { typ, .. } if *typ == want));
                assert_eq!(
                    c,
                    Chunk::BlockStatus {
                        context_id: 1,
                        descriptors: ds.to_vec()
                    }
                )
            },
        );
        chunk_round_trip(
            mode,
            |b, to| encode_error_chunk(b, mode, to, REPLY_FLAG_DONE, NBD_ENOSPC, "full", None),
            |_, c| {
                assert_eq!(
                    c,
                    Chunk::Error {
                        error: NBD_ENOSPC,
                        message: "full".into()
                    }
                )
            },
        );
        chunk_round_trip(
            mode,
            |b, to| encode_error_chunk(b, mode, to, REPLY_FLAG_DONE, NBD_EIO, "bad", Some(12345)),
            |_, c| {
                assert_eq!(
                    c,
                    Chunk::ErrorOffset {
                        error: NBD_EIO,
                        message: "bad".into(),
                        offset: 12345
                    }
                )
            },
        );
    }
    // 64-bit extents only fit the extended form.
    let big = [Descriptor {
        length: 1 << 40,
        status: 0,
    }];
    chunk_round_trip(
        ReplyMode::Extended,
        |b, to| encode_block_status(b, ReplyMode::Extended, to, REPLY_FLAG_DONE, 3, &big),
        |_, c| {
            assert_eq!(
                c,
                Chunk::BlockStatus {
                    context_id: 3,
                    descriptors: big.to_vec()
                }
            )
        },
    );
}

#[test]
fn reply_header_mode_checks() {
    let to = ReplyTo {
        cookie: 1,
        offset: 0,
    };
    let mut s = Vec::new();
    encode_chunk_none(&mut s, ReplyMode::Structured, to);
    assert!(decode_reply_header(&s, ReplyMode::Simple).is_err());
    assert!(decode_reply_header(&s, ReplyMode::Extended).is_err());
    let mut e = Vec::new();
    encode_chunk_none(&mut e, ReplyMode::Extended, to);
    assert!(decode_reply_header(&e, ReplyMode::Structured).is_err());
    assert!(
        decode_reply_header(b"\0\0\0\0xxxxxxxxxxxxxxxxxxxxxxxxxxxx", ReplyMode::Extended).is_err()
    );
}

#[test]
fn bad_chunks() {
    assert!(decode_chunk(REPLY_TYPE_NONE, &[0]).is_err());
    assert!(decode_chunk(REPLY_TYPE_OFFSET_DATA, &[0; 8]).is_err());
    assert!(decode_chunk(REPLY_TYPE_OFFSET_DATA, &[0; 7]).is_err());
    assert!(decode_chunk(REPLY_TYPE_OFFSET_HOLE, &[0; 12]).is_err());
    assert!(decode_chunk(REPLY_TYPE_BLOCK_STATUS, &[0; 4]).is_err());
    assert!(decode_chunk(REPLY_TYPE_BLOCK_STATUS, &[0; 13]).is_err());
    // Count claims more descriptors than present.
    assert!(decode_chunk(
        REPLY_TYPE_BLOCK_STATUS_EXT,
        &[0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff]
    )
    .is_err());
    // Message length beyond the chunk.
    assert!(decode_chunk(REPLY_TYPE_ERROR, &[0, 0, 0, 5, 0, 9, b'x']).is_err());
    assert!(decode_chunk(REPLY_TYPE_ERROR_OFFSET, &[0, 0, 0, 5, 0, 0, 1, 2, 3]).is_err());
    assert!(matches!(
        decode_chunk(0x8009, &[1, 2]),
        Ok(Chunk::Unknown { typ: 0x8009, .. })
    ));
}

#[test]
fn errno_mapping() {
    let cases = [
        (libc::EPERM, NBD_EPERM),
        (libc::EROFS, NBD_EPERM),
        (libc::EIO, NBD_EIO),
        (libc::ENOMEM, NBD_ENOMEM),
        (libc::EINVAL, NBD_EINVAL),
        (libc::ENOSPC, NBD_ENOSPC),
        (libc::EDQUOT, NBD_ENOSPC),
        (libc::EFBIG, NBD_ENOSPC),
        (libc::EOVERFLOW, NBD_EOVERFLOW),
        (libc::EOPNOTSUPP, NBD_ENOTSUP),
        (libc::ESHUTDOWN, NBD_ESHUTDOWN),
        (libc::ENXIO, NBD_EIO),
        (libc::EBADF, NBD_EIO),
    ];
    for (e, n) in cases {
        assert_eq!(errno_to_nbd(e), n, "errno {e}");
    }
    for n in [
        NBD_EPERM,
        NBD_EIO,
        NBD_ENOMEM,
        NBD_EINVAL,
        NBD_ENOSPC,
        NBD_EOVERFLOW,
        NBD_ENOTSUP,
        NBD_ESHUTDOWN,
    ] {
        assert_eq!(errno_to_nbd(nbd_to_errno(n)), n);
    }
    assert_eq!(nbd_to_errno(4242), libc::EINVAL);
}

#[test]
fn decoders_survive_random_input() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x006e_6264);
    for _ in 0..20_000 {
        let len = rng.gen_range(0..64);
        let mut b: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        // Give the magics a chance so decoders get past them.
        if rng.gen_bool(0.5) && b.len() >= 8 {
            b[..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        }
        let _ = decode_option(&b, 64);
        let _ = decode_option_reply(&b, 64);
        let _ = decode_request(&b, rng.gen());
        let _ = decode_reply_header(&b, ReplyMode::Structured);
        let _ = decode_chunk(rng.gen(), &b);
        for opt in 0..12 {
            let _ = ClientOption::parse(opt, &b);
        }
        for rep in [
            REP_ACK,
            REP_SERVER,
            REP_INFO,
            REP_META_CONTEXT,
            REP_ERR_UNSUP,
        ] {
            let _ = OptionReply::parse(rep, &b);
        }
    }
}
