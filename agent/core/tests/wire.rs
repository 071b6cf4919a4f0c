//! Wire codec: round-trip of every message, one test per rejection class,
//! and the generator of the fuzz seed corpus (`--ignored`).

use kvfabric_core::plan::TransferPlan;
use kvfabric_core::wire::{
    decode_ack, decode_data, decode_grant, decode_handshake, decode_want, encode_cancel,
    encode_handshake, is_cancel_want, peek_type, Ack, Credit, Data, Grant, Handshake, Message,
    MessageType, Reject, RejectReason, Want, WireError, CAP_PACKED_DATA, HEADER_LEN, MAGIC,
    MAX_ENDPOINT_LEN, MAX_ENTRIES, WIRE_VERSION,
};
use kvfabric_core::{ControlKind, Descriptor, ScatterRun};

fn want() -> Want {
    Want {
        request_id: 0x0102_0304_0506_0708,
        scope: 0,
        chunk_bytes: vec![32 << 20, 32 << 20, 4097],
        endpoint: b"tcp://192.168.1.20:41234".to_vec(),
    }
}

fn grant() -> Grant {
    Grant {
        request_id: 77,
        credits: (0..8)
            .map(|i| Credit {
                chunk_index: i,
                region_handle: u64::from(i) << 25,
                addr: 0x7f12_0000_0000 + (u64::from(i) << 25),
                len: 32 << 20,
                device_id: 3,
            })
            .collect(),
    }
}

fn data() -> Data {
    let descs: Vec<_> = (0..256u64)
        .map(|i| Descriptor::new(0x1000 + i * 8192, 0x10_0000 + i * 16_384, 4096))
        .collect();
    let plan = TransferPlan::build(&descs, 32 << 20, true).unwrap();
    Data {
        request_id: 77,
        chunk_index: 0,
        region_handle: 1 << 25,
        runs: plan.chunks()[0].scatter_runs.clone(),
    }
}

fn ack() -> Ack {
    Ack {
        request_id: 77,
        chunk_index: 5,
        region_handle: 5 << 25,
    }
}

fn handshake() -> Handshake {
    Handshake {
        wire_version: WIRE_VERSION,
        control_kind: ControlKind::Zmq,
        arena_usable_capacity_bytes: 1 << 30,
        max_chunk_size_bytes: 32 << 20,
        endpoint: b"tcp://10.1.2.3:5000".to_vec(),
        config_generation: 3,
        capabilities: CAP_PACKED_DATA,
    }
}

fn all() -> Vec<Message> {
    vec![
        want().into(),
        grant().into(),
        data().into(),
        ack().into(),
        handshake().into(),
        Reject {
            request_id: 77,
            reason: RejectReason::ScopeDetached,
        }
        .into(),
    ]
}

#[test]
fn round_trip_each_type() {
    let w = want();
    assert_eq!(decode_want(&Message::from(w.clone()).encode()).unwrap(), w);
    let g = grant();
    assert_eq!(decode_grant(&Message::from(g.clone()).encode()).unwrap(), g);
    let d = data();
    assert_eq!(d.runs.len(), 1, "strided plan collapses to one run");
    assert_eq!(decode_data(&Message::from(d.clone()).encode()).unwrap(), d);
    let a = ack();
    assert_eq!(decode_ack(&Message::from(a).encode()).unwrap(), a);
    let h = handshake();
    let hb = encode_handshake(&h);
    assert_eq!(hb, Message::from(h.clone()).encode());
    assert_eq!(decode_handshake(&hb).unwrap(), h);
    let big = Handshake {
        control_kind: ControlKind::NixlNotif,
        endpoint: vec![0x5a; MAX_ENDPOINT_LEN as usize],
        ..h
    };
    assert_eq!(decode_handshake(&encode_handshake(&big)).unwrap(), big);
}

#[test]
fn header_layout_is_little_endian() {
    let b = Message::from(ack()).encode();
    assert_eq!(&b[..4], &MAGIC);
    assert_eq!(u16::from_le_bytes([b[4], b[5]]), WIRE_VERSION);
    assert_eq!(b[6], MessageType::Ack.code());
    assert_eq!(b[7], 0);
    assert_eq!(&b[8..16], &[0u8; 8]);
    assert_eq!(u64::from_le_bytes(b[16..24].try_into().unwrap()), 77);
    assert_eq!(b.len(), HEADER_LEN + 24);
}

#[test]
fn rejects_every_truncation() {
    for m in all() {
        let b = m.encode();
        for n in 0..b.len() {
            let err = Message::decode(&b[..n]).unwrap_err();
            assert!(
                matches!(err, WireError::Truncated { .. }),
                "{:?} cut at {n}: {err:?}",
                m.message_type()
            );
        }
    }
}

#[test]
fn rejects_trailing_bytes() {
    for m in all() {
        let mut b = m.encode();
        b.push(0);
        assert!(matches!(
            Message::decode(&b),
            Err(WireError::TrailingBytes { extra: 1, .. })
        ));
    }
}

#[test]
fn rejects_bad_magic() {
    let mut b = Message::from(ack()).encode();
    b[0] = b'X';
    assert_eq!(
        Message::decode(&b),
        Err(WireError::BadMagic { found: *b"XVFB" })
    );
    // Even a too-short buffer with wrong magic says so.
    assert!(matches!(
        Message::decode(b"HTTP/1.1"),
        Err(WireError::BadMagic { .. })
    ));
}

#[test]
fn rejects_wrong_version() {
    let mut b = Message::from(want()).encode();
    b[4..6].copy_from_slice(&(WIRE_VERSION + 1).to_le_bytes());
    assert_eq!(
        decode_want(&b),
        Err(WireError::UnsupportedVersion {
            found: WIRE_VERSION + 1,
            expected: WIRE_VERSION
        })
    );
}

#[test]
fn rejects_unknown_type() {
    for code in [0u8, 9, 0xff] {
        let mut b = Message::from(ack()).encode();
        b[6] = code;
        assert_eq!(Message::decode(&b), Err(WireError::UnknownType { code }));
        assert_eq!(decode_ack(&b), Err(WireError::UnknownType { code }));
    }
}

#[test]
fn rejects_cross_type_confusion() {
    let g = Message::from(grant()).encode();
    assert_eq!(
        decode_want(&g),
        Err(WireError::UnexpectedType {
            expected: MessageType::Want,
            found: MessageType::Grant
        })
    );
    // A same-length forgery: ACK and DATA share the fixed size, but the type
    // byte decides.
    let a = Message::from(ack()).encode();
    assert!(matches!(
        decode_data(&a),
        Err(WireError::UnexpectedType { .. })
    ));
    assert!(matches!(
        decode_handshake(&Message::from(want()).encode()),
        Err(WireError::UnexpectedType { .. })
    ));
    assert!(!is_cancel_want(&Message::from(ack()).encode()));
}

#[test]
fn rejects_absurd_counts_without_allocating() {
    // Header claims u32::MAX entries on a tiny buffer: rejected by the cap.
    for ty in [MessageType::Want, MessageType::Grant, MessageType::Data] {
        let mut b = Message::decode(&all()[0].encode()).unwrap().encode();
        b[6] = ty.code();
        b[12..16].copy_from_slice(&0u32.to_le_bytes()); // no trailer
        b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Message::decode(&b),
            Err(WireError::TooManyEntries { count, max: MAX_ENTRIES, .. }) if count == u64::from(u32::MAX)
        ));
        // Within the cap but far beyond the buffer: truncated, before any
        // allocation (the expected length is checked first).
        b[8..12].copy_from_slice(&MAX_ENTRIES.to_le_bytes());
        assert!(matches!(
            Message::decode(&b),
            Err(WireError::Truncated { .. })
        ));
    }
    // ACK / HANDSHAKE take no entries at all.
    let mut b = Message::from(ack()).encode();
    b[8..12].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(
        decode_ack(&b),
        Err(WireError::TooManyEntries { max: 0, .. })
    ));
}

#[test]
fn rejects_oversized_or_unexpected_trailer() {
    let mut b = Message::from(want()).encode();
    b[12..16].copy_from_slice(&(MAX_ENDPOINT_LEN + 1).to_le_bytes());
    assert!(matches!(
        decode_want(&b),
        Err(WireError::TrailerTooLong {
            max: MAX_ENDPOINT_LEN,
            ..
        })
    ));
    let mut b = Message::from(grant()).encode();
    b[12..16].copy_from_slice(&1u32.to_le_bytes());
    b.push(0);
    assert!(matches!(
        decode_grant(&b),
        Err(WireError::TrailerTooLong { max: 0, .. })
    ));
    // The encoder side refuses the same through try_encode.
    let w = Want {
        endpoint: vec![0; MAX_ENDPOINT_LEN as usize + 1],
        ..want()
    };
    let m = Message::from(w);
    assert!(matches!(
        m.try_encode(),
        Err(WireError::TrailerTooLong { .. })
    ));
    assert!(Message::decode(&m.encode()).is_err());
}

#[test]
fn rejects_nonzero_reserved() {
    let mut b = Message::from(ack()).encode();
    b[7] = 1;
    assert!(matches!(
        decode_ack(&b),
        Err(WireError::NonZeroReserved {
            field: "header.reserved",
            ..
        })
    ));
    let mut b = Message::from(ack()).encode();
    *b.last_mut().unwrap() = 1;
    assert!(matches!(
        decode_ack(&b),
        Err(WireError::NonZeroReserved { .. })
    ));
    let mut b = Message::from(data()).encode();
    *b.last_mut().unwrap() = 1; // the last run's reserved word
    assert!(matches!(
        decode_data(&b),
        Err(WireError::NonZeroReserved {
            field: "run.reserved",
            ..
        })
    ));
    let mut b = encode_handshake(&handshake());
    b[HEADER_LEN + 3] = 1;
    assert!(matches!(
        decode_handshake(&b),
        Err(WireError::NonZeroReserved { .. })
    ));
}

#[test]
fn want_carries_its_scope_and_reject_its_reason() {
    let w = Want {
        scope: 0xdead_beef_0042,
        ..want()
    };
    let b = Message::from(w.clone()).encode();
    // The scope is the second fixed field, right after the request id.
    assert_eq!(
        &b[HEADER_LEN + 8..HEADER_LEN + 16],
        &0xdead_beef_0042u64.to_le_bytes()
    );
    assert_eq!(Message::decode(&b), Ok(Message::Want(w)));
    for reason in [
        RejectReason::UnknownScope,
        RejectReason::ScopeDetached,
        RejectReason::Refused,
        RejectReason::InvalidRuns,
    ] {
        let r = Reject {
            request_id: 5,
            reason,
        };
        let b = Message::from(r).encode();
        assert_eq!(b.len(), HEADER_LEN + 16);
        assert_eq!(Message::decode(&b), Ok(Message::Reject(r)));
    }
    let mut b = Message::from(Reject {
        request_id: 5,
        reason: RejectReason::Refused,
    })
    .encode();
    b[HEADER_LEN + 8] = 9;
    assert_eq!(
        Message::decode(&b),
        Err(WireError::UnknownRejectReason { code: 9 })
    );
    b[HEADER_LEN + 8] = 3;
    b[HEADER_LEN + 12] = 1;
    assert!(matches!(
        Message::decode(&b),
        Err(WireError::NonZeroReserved {
            field: "reject.reserved",
            ..
        })
    ));
}

#[test]
fn rejects_invalid_runs_and_control_kind() {
    for (field, reason) in [(0usize, "segment_len is 0"), (1, "count is 0")] {
        let mut d = data();
        d.runs.push(ScatterRun {
            region_offset: 0,
            addr: 1,
            segment_len: 1,
            count: 1,
            region_stride: 0,
            addr_stride: 0,
        });
        let last = d.runs.last_mut().unwrap();
        if field == 0 {
            last.segment_len = 0;
        } else {
            last.count = 0;
        }
        let m = Message::from(d);
        let expected = WireError::InvalidRun { index: 1, reason };
        assert_eq!(m.check_limits(), Err(expected.clone()));
        assert_eq!(decode_data(&m.encode()), Err(expected));
    }
    let mut b = encode_handshake(&handshake());
    b[HEADER_LEN + 2] = 9;
    assert_eq!(
        decode_handshake(&b),
        Err(WireError::UnknownControlKind { code: 9 })
    );
}

#[test]
fn cancel_round_trip() {
    let b = encode_cancel(123, b"tcp://1.2.3.4:5");
    assert!(is_cancel_want(&b));
    assert_eq!(peek_type(&b), Ok(MessageType::Want));
    let w = decode_want(&b).unwrap();
    assert_eq!(w.request_id, 123);
    assert!(w.is_cancel());
    assert_eq!(w.endpoint, b"tcp://1.2.3.4:5");
    assert!(!is_cancel_want(&Message::from(want()).encode()));
}

/// Writes the fuzz seed corpus (valid encodings of every message) into
/// `fuzz/corpus/<target>/seed_*`. Run with
/// `cargo test -p kvfabric-core --test wire -- --ignored write_fuzz_corpus`.
#[test]
#[ignore = "writes the fuzz seed corpus into the source tree"]
fn write_fuzz_corpus() {
    use std::fs;
    use std::path::PathBuf;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let unmerged = {
        let descs: Vec<_> = (0..64u64)
            .map(|i| Descriptor::new(0x1000 + i * 8192, 0x10_0000 + (i * 7919 % 64) * 4096, 4096))
            .collect();
        let plan = TransferPlan::build(&descs, 1 << 20, false).unwrap();
        Data {
            request_id: 1,
            chunk_index: 0,
            region_handle: 0,
            runs: plan.chunks()[0].scatter_runs.clone(),
        }
    };
    let sets: Vec<(&str, Vec<Vec<u8>>)> = vec![
        (
            "fuzz_want",
            vec![
                Message::from(want()).encode(),
                encode_cancel(9, b"tcp://[::1]:7000"),
                Message::from(Want::default()).encode(),
            ],
        ),
        (
            "fuzz_grant",
            vec![
                Message::from(grant()).encode(),
                Message::from(Grant::default()).encode(),
            ],
        ),
        (
            "fuzz_data",
            vec![
                Message::from(data()).encode(),
                Message::from(unmerged).encode(),
                Message::from(Data::default()).encode(),
            ],
        ),
        ("fuzz_ack", vec![Message::from(ack()).encode()]),
        (
            "fuzz_handshake",
            vec![
                encode_handshake(&handshake()),
                encode_handshake(&Handshake {
                    control_kind: ControlKind::NixlNotif,
                    endpoint: (0..2048u32).map(|i| (i * 31) as u8).collect(),
                    ..handshake()
                }),
            ],
        ),
        (
            "fuzz_message",
            all()
                .iter()
                .map(Message::encode)
                .chain([encode_for(
                    &Message::from(random_chunk_data()),
                    CAP_PACKED_DATA,
                )])
                .collect(),
        ),
        (
            "fuzz_plan",
            vec![
                // max_chunk selector byte, merge flag, then 24-byte descriptors
                // (see fuzz_targets/fuzz_plan.rs).
                {
                    let mut v = vec![3u8, 1];
                    for i in 0..16u64 {
                        v.extend_from_slice(&(i * 4096).to_le_bytes());
                        v.extend_from_slice(&(i * 8192).to_le_bytes());
                        v.extend_from_slice(&4096u64.to_le_bytes());
                    }
                    v
                },
            ],
        ),
    ];
    for (target, seeds) in sets {
        let dir = root.join(target);
        fs::create_dir_all(&dir).unwrap();
        for (i, s) in seeds.iter().enumerate() {
            fs::write(dir.join(format!("seed_{i}")), s).unwrap();
        }
    }
}

// ------------------------------------------------------------ packed DATA

/// The DATA of one 16 MiB chunk of 4,096 random-slot 4 KiB blocks, as the
/// planner builds it (merged runs: strided pairs and singles).
fn random_chunk_data() -> Data {
    let n = 4096u64;
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D) % (1 << 20)
    };
    let descs: Vec<Descriptor> = (0..n)
        .map(|_| {
            Descriptor::new(
                0x7f00_0000_0000 + next() * 4096,
                0x7e00_0000_0000 + next() * 4096,
                4096,
            )
        })
        .collect();
    let plan = TransferPlan::build(&descs, n * 4096, true).unwrap();
    Data {
        request_id: 9,
        chunk_index: 0,
        region_handle: 1 << 20,
        runs: plan.into_chunks().remove(0).scatter_runs,
    }
}

fn encode_for(m: &Message, caps: u32) -> Vec<u8> {
    let mut b = vec![0xEE; 3]; // appends after what is there
    m.encode_into_for(&mut b, caps);
    b.drain(..3);
    b
}

#[test]
fn packed_data_round_trips_smaller_and_only_for_capable_peers() {
    let d = random_chunk_data();
    let m = Message::from(d.clone());
    let plain = m.encode();
    let packed = encode_for(&m, CAP_PACKED_DATA);
    assert_eq!(peek_type(&packed), Ok(MessageType::DataPacked));
    assert_eq!(Message::decode(&packed).unwrap(), m);
    // 4,096 blocks merge to ≈ 2,600 runs: 48 bytes each plain; packed the
    // address delta dominates (≤ 7 bytes for a 4 GiB pool).
    let runs = d.runs.len();
    assert!(runs > 2000, "{runs}");
    assert!(
        packed.len() * 3 < plain.len(),
        "packed {} vs plain {} bytes for {runs} runs",
        packed.len(),
        plain.len()
    );
    // Without the capability (or an unknown bit only) the seed's DATA.
    assert_eq!(encode_for(&m, 0), plain);
    assert_eq!(encode_for(&m, 0x8000_0000), plain);
    // Other messages are unaffected by the capability.
    for other in all() {
        if !matches!(other, Message::Data(_)) {
            assert_eq!(encode_for(&other, CAP_PACKED_DATA), other.encode());
        }
    }
    // No runs: an empty trailer.
    let empty = Message::from(Data::default());
    let e = encode_for(&empty, CAP_PACKED_DATA);
    assert_eq!(e.len(), HEADER_LEN + 24);
    assert_eq!(Message::decode(&e).unwrap(), empty);
}

#[test]
fn packed_data_falls_back_to_plain_when_not_smaller() {
    // Every field far from its prediction: tag + 5 ten-byte varints + count.
    let runs = (1..4u64)
        .map(|k| ScatterRun {
            region_offset: u64::MAX / (3 * k),
            addr: (u64::MAX / 5) * (k & 1),
            segment_len: u64::MAX / (7 * k),
            region_stride: u64::MAX / 11,
            addr_stride: u64::MAX / 13,
            count: u32::MAX,
        })
        .collect();
    let m = Message::from(Data {
        request_id: 1,
        chunk_index: 2,
        region_handle: 3,
        runs,
    });
    let b = encode_for(&m, CAP_PACKED_DATA);
    assert_eq!(peek_type(&b), Ok(MessageType::Data));
    assert_eq!(b, m.encode());
}

/// Byte offset of the packed runs in a packed DATA frame.
const PACKED_BODY: usize = HEADER_LEN + 24;

fn packed_frame(runs_bytes: &[u8], count: u32) -> Vec<u8> {
    let mut b = encode_for(&Message::from(Data::default()), CAP_PACKED_DATA);
    b[8..12].copy_from_slice(&count.to_le_bytes());
    b[12..16].copy_from_slice(&(runs_bytes.len() as u32).to_le_bytes());
    b.extend_from_slice(runs_bytes);
    b
}

#[test]
fn packed_data_rejects_non_canonical_forms() {
    // A valid single run: tag implied|single, addr delta zigzag(64)=128
    // (two bytes), segment_len 4096 (two bytes).
    let ok = [0b011, 0x80, 0x01, 0x80, 0x20];
    let d = Message::decode(&packed_frame(&ok, 1)).unwrap();
    let Message::Data(d) = d else { panic!() };
    assert_eq!(
        d.runs,
        vec![ScatterRun {
            region_offset: 0,
            addr: 64,
            segment_len: 4096,
            region_stride: 0,
            addr_stride: 0,
            count: 1
        }]
    );
    let cases: &[(&[u8], u32, &str)] = &[
        (
            &[0b1011, 0x80, 0x01, 0x80, 0x20],
            1,
            "unknown packed tag bits",
        ),
        // The offset 0 spelled out although it is the implied one.
        (
            &[0b010, 0x00, 0x80, 0x01, 0x80, 0x20],
            1,
            "explicit offset equal to the implied one",
        ),
        // An overlong varint (4096 with a trailing zero group).
        (
            &[0b011, 0x80, 0x01, 0x80, 0xA0, 0x00],
            1,
            "varint not minimal",
        ),
        // SAME_LEN on the first run: length 0.
        (&[0b111, 0x80, 0x01], 1, "segment_len is 0"),
        // count 1 with zero strides in the explicit form.
        (
            &[0b001, 0x80, 0x01, 0x80, 0x20, 0x01, 0x00, 0x00],
            1,
            "explicit form of a single run",
        ),
        // count over u32.
        (
            &[
                0b001, 0x80, 0x01, 0x80, 0x20, 0x80, 0x80, 0x80, 0x80, 0x10, 0x00, 0x00,
            ],
            1,
            "count over u32",
        ),
        // Announces two runs, holds one (and fits the trailer cap).
        (&[0b011, 0x80, 0x01, 0x80, 0x20], 2, "packed run truncated"),
    ];
    for &(bytes, count, reason) in cases {
        match Message::decode(&packed_frame(bytes, count)) {
            Err(WireError::InvalidRun { reason: r, .. }) => assert_eq!(r, reason, "{bytes:?}"),
            other => panic!("{bytes:?}: expected {reason:?}, got {other:?}"),
        }
    }
    // Bytes after the last run.
    let mut extra = ok.to_vec();
    extra.push(0);
    assert!(matches!(
        Message::decode(&packed_frame(&extra, 1)),
        Err(WireError::TrailingBytes { .. })
    ));
    // A trailer longer than the plain entries would be.
    assert!(matches!(
        Message::decode(&packed_frame(&[0u8; 49], 1)),
        Err(WireError::TrailerTooLong { .. })
    ));
    assert_eq!(PACKED_BODY, 40);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    /// Any run list round-trips through the packed form (or its plain
    /// fallback), and any mutation of a packed frame either fails to decode
    /// or re-encodes to exactly itself (canonical), without panicking.
    #[test]
    fn packed_data_round_trips_and_is_canonical(
        runs in proptest::collection::vec(
            (0u64..1 << 40, proptest::prelude::any::<u64>(), 1u64..1 << 20,
             0u64..1 << 30, 0u64..1 << 30, 1u32..4, proptest::prelude::any::<bool>()),
            0..40),
        flips in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 0..4),
    ) {
        let mut off = 0u64;
        let runs: Vec<ScatterRun> = runs
            .into_iter()
            .map(|(gap, addr, len, rs, as_, count, contiguous)| {
                let region_offset = if contiguous { off.div_ceil(32) * 32 } else { off + gap };
                let (region_stride, addr_stride) = if count == 1 { (0, 0) } else { (rs, as_) };
                let r = ScatterRun { region_offset, addr, segment_len: len, region_stride, addr_stride, count };
                off = r.region_end().unwrap_or(0);
                r
            })
            .collect();
        let m = Message::from(Data { request_id: 7, chunk_index: 1, region_handle: 64, runs });
        let b = encode_for(&m, CAP_PACKED_DATA);
        proptest::prop_assert!(b.len() <= m.encoded_len());
        proptest::prop_assert_eq!(&Message::decode(&b).unwrap(), &m);
        let mut bad = b.clone();
        for (at, v) in flips {
            let at = PACKED_BODY.min(bad.len()) + at % (bad.len() - PACKED_BODY.min(bad.len())).max(1);
            if let Some(x) = bad.get_mut(at) {
                *x ^= v;
            }
        }
        if let Ok(d) = Message::decode(&bad) {
            let caps = if peek_type(&bad) == Ok(MessageType::DataPacked) { CAP_PACKED_DATA } else { 0 };
            proptest::prop_assert_eq!(encode_for(&d, caps), bad);
        }
    }
}
