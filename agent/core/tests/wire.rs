//! Wire codec: round-trip of every message, one test per rejection class,
//! and the generator of the fuzz seed corpus (`--ignored`).

use kvfabric_core::plan::TransferPlan;
use kvfabric_core::wire::{
    decode_ack, decode_data, decode_grant, decode_handshake, decode_want, encode_cancel,
    encode_handshake, is_cancel_want, peek_type, Ack, Credit, Data, DataBlocks, DataUniform, Grant,
    Handshake, Message, MessageType, Reject, RejectReason, Want, WireError, CAP_BLOCK_DATA,
    CAP_UNIFORM_DATA, HEADER_LEN, MAGIC, MAX_ENDPOINT_LEN, MAX_ENTRIES, WIRE_VERSION,
};
use kvfabric_core::{BlockScatter, ControlKind, Descriptor, ScatterRun, UniformScatter};

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
        capabilities: CAP_UNIFORM_DATA,
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
        data_uniform().into(),
        data_blocks().into(),
    ]
}

/// `m` is refused by `check_limits` and by the decoder of its encoding,
/// both as `InvalidRun { index: 0, reason }`.
fn refused_as_invalid(m: Message, reason: &str) {
    let want = WireError::InvalidRun {
        index: 0,
        reason: reason.to_string().leak(),
    };
    assert_eq!(m.check_limits().unwrap_err(), want);
    assert_eq!(Message::decode(&m.encode()).unwrap_err(), want);
}

/// 40 pieces of 4 KiB from piece 100 of a request of 32-block planes
/// (the last 28 blocks of plane 3, the first 12 of plane 4).
fn data_blocks() -> DataBlocks {
    DataBlocks {
        request_id: 10,
        chunk_index: 2,
        region_handle: 2 << 20,
        scatter: BlockScatter {
            segment_len: 4096,
            region_stride: 4096,
            first: 100,
            count: 40,
            plane_stride: 1 << 30,
            offsets: (0..32u64)
                .map(|i| 0x7f00_0000_0000 + (i * 7 % 32) * 4096)
                .collect(),
        },
    }
}

/// DATA_BLOCKS (issue 18 step 3): 56 fixed bytes and 8 a block (not a
/// piece); the destinations it names are those of the same pieces listed
/// one by one (`to_uniform`), inside `dst_bounds`; structurally invalid
/// scatters are refused by the decoder and by `check_limits`.
#[test]
fn data_blocks_round_trip_and_name_the_same_destinations() {
    let d = data_blocks();
    let m = Message::from(d.clone());
    let b = m.encode();
    assert_eq!(b.len(), HEADER_LEN + 56 + 32 * 8);
    assert_eq!(peek_type(&b).unwrap(), MessageType::DataBlocks);
    assert_eq!(Message::decode(&b).unwrap(), m);
    let s = &d.scatter;
    let u = s.to_uniform().unwrap();
    assert_eq!(u.dsts.len(), 40);
    for (j, &a) in u.dsts.iter().enumerate() {
        let k = 100 + j as u64;
        let want = (k / 32) * (1 << 30) + 0x7f00_0000_0000 + ((k % 32) * 7 % 32) * 4096;
        assert_eq!(a, want, "piece {j}");
        assert_eq!(s.dst(j as u32), Some(a));
    }
    assert_eq!(s.dst(40), None);
    let (lo, hi) = s.dst_bounds().unwrap();
    assert!(u.dsts.iter().all(|&a| a >= lo && a + 4096 <= hi));
    assert_eq!(lo, 3 * (1 << 30) + 0x7f00_0000_0000);
    assert_eq!(hi, 4 * (1 << 30) + 0x7f00_0000_0000 + 31 * 4096 + 4096);
    assert_eq!(s.total_bytes(), u.total_bytes());
    assert_eq!(s.region_end(), u.region_end());
    let bad = |f: &dyn Fn(&mut BlockScatter), reason: &str| {
        let mut x = d.clone();
        f(&mut x.scatter);
        refused_as_invalid(Message::from(x), reason);
    };
    bad(&|b| b.offsets.clear(), "no block destinations");
    bad(&|b| b.count = 0, "no pieces");
    bad(&|b| b.segment_len = 0, "segment_len is 0");
    bad(
        &|b| b.region_stride = 4095,
        "region_stride is below segment_len",
    );
    bad(&|b| b.first = u64::MAX - 10, "first + count overflows");
    bad(
        &|b| b.count = MAX_ENTRIES + 1,
        "more pieces than MAX_ENTRIES",
    );
    // The last piece fills its plane and the next plane's base is past
    // u64: still a list (review: the next base was computed eagerly).
    let edge = BlockScatter {
        segment_len: 8,
        region_stride: 8,
        first: 0,
        count: 2,
        plane_stride: u64::MAX / 2,
        offsets: vec![16],
    };
    assert_eq!(edge.to_uniform().unwrap().dsts, [16, u64::MAX / 2 + 16]);
    assert_eq!(edge.dst_bounds(), Some((16, u64::MAX / 2 + 16 + 8)));
    // Overflowing destinations: no bounds, no list.
    let mut x = d.scatter.clone();
    x.plane_stride = u64::MAX / 2;
    assert_eq!(x.dst_bounds(), None);
    assert_eq!(x.to_uniform(), None);
    let mut h = handshake();
    h.capabilities = CAP_UNIFORM_DATA | CAP_BLOCK_DATA;
    assert_eq!(decode_handshake(&encode_handshake(&h)).unwrap(), h);
}

fn data_uniform() -> DataUniform {
    DataUniform {
        request_id: 9,
        chunk_index: 3,
        region_handle: 1 << 20,
        scatter: UniformScatter {
            segment_len: 4096,
            region_stride: 4096,
            dsts: (0..64u64)
                .map(|i| 0x7f00_0000_0000 + (i * 7919 % 64) * 4096)
                .collect(),
        },
    }
}

/// DATA_UNIFORM (issue 18 step 3): 40 fixed bytes and 8 a destination; a
/// structurally invalid list (no pieces, empty pieces, pieces overlapping
/// in the region) is refused by the decoder and by `check_limits`; a
/// handshake's capability word survives the round trip, unknown bits too.
#[test]
fn data_uniform_round_trips_and_refuses_bad_lists() {
    let d = data_uniform();
    let m = Message::from(d.clone());
    let b = m.encode();
    assert_eq!(b.len(), HEADER_LEN + 40 + 64 * 8);
    assert_eq!(peek_type(&b).unwrap(), MessageType::DataUniform);
    assert_eq!(Message::decode(&b).unwrap(), m);
    assert_eq!(
        decode_data(&b).unwrap_err(),
        WireError::UnexpectedType {
            expected: MessageType::Data,
            found: MessageType::DataUniform
        }
    );
    // Same bytes moved as the seed's runs, one a piece.
    assert_eq!(
        d.scatter
            .to_runs()
            .iter()
            .map(ScatterRun::total_bytes)
            .sum::<u64>(),
        d.scatter.total_bytes()
    );
    assert_eq!(d.scatter.region_end(), Some(63 * 4096 + 4096));
    let bad = |f: &dyn Fn(&mut UniformScatter), reason: &str| {
        let mut x = d.clone();
        f(&mut x.scatter);
        refused_as_invalid(Message::from(x), reason);
    };
    bad(&|u| u.dsts.clear(), "no destinations");
    bad(&|u| u.segment_len = 0, "segment_len is 0");
    bad(
        &|u| u.region_stride = 4095,
        "region_stride is below segment_len",
    );
    let mut h = handshake();
    h.capabilities = CAP_UNIFORM_DATA | 0x4000_0000;
    assert_eq!(decode_handshake(&encode_handshake(&h)).unwrap(), h);
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
    for code in [0u8, 10, 0xff] {
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
        ("fuzz_message", all().iter().map(Message::encode).collect()),
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
