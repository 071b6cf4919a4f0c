//! Property tests of the transfer plan (issue 2 "Must show": plan
//! round-trip — every byte of every descriptor lands at exactly one offset,
//! expanded runs equal the per-descriptor list).
//!
//! Inputs mix contiguous, uniformly strided, repeated and random addresses
//! with shared or per-descriptor lengths (zero, tiny, around the chunk cap and
//! several chunks long), so merging, splitting and the move-to-fresh-chunk rule
//! are all exercised.

use kvfabric_core::plan::{expand, Chunk, ChunkBound, TransferPlan, ALIGN};
use kvfabric_core::wire::{decode_data, Data, Message};
use kvfabric_core::Descriptor;
use proptest::prelude::*;

/// How the next descriptor's address follows the previous one.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// Right after the previous descriptor (`prev + prev.len`).
    Contiguous,
    /// `prev + stride` (the case's shared stride).
    Strided,
    /// Same address as the previous one (stride 0).
    Same,
    /// Anywhere below 2^48.
    Random(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => Just(Step::Contiguous),
        4 => Just(Step::Strided),
        1 => Just(Step::Same),
        2 => (0u64..1 << 48).prop_map(Step::Random),
    ]
}

fn length(max: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        1 => Just(0u64),
        3 => 1u64..64,
        3 => 1u64..=max,
        1 => (max - 31)..=(max + 31),
        1 => max..=4 * max,
    ]
}

#[derive(Clone, Debug)]
struct Case {
    max: u64,
    descs: Vec<Descriptor>,
}

fn build_descs(
    shared_len: Option<u64>,
    stride: (u64, u64),
    items: Vec<(u64, Step, Step)>,
) -> Vec<Descriptor> {
    let mut out: Vec<Descriptor> = Vec::with_capacity(items.len());
    let mut prev = Descriptor::new(1 << 40, 1 << 44, 0);
    for (len, s_step, d_step) in items {
        let len = shared_len.unwrap_or(len);
        let next = |addr: u64, step: Step, stride: u64| match step {
            Step::Contiguous => addr + prev.len,
            Step::Strided => addr + stride,
            Step::Same => addr,
            Step::Random(a) => a,
        };
        let d = Descriptor::new(
            next(prev.src, s_step, stride.0),
            next(prev.dst, d_step, stride.1),
            len,
        );
        out.push(d);
        prev = d;
    }
    out
}

fn case() -> impl Strategy<Value = Case> {
    prop::sample::select(vec![32u64, 64, 96, 128, 256, 1024, 4096])
        .prop_flat_map(|max| {
            (
                Just(max),
                prop::option::weighted(0.4, length(max)),
                (
                    prop::sample::select(vec![0u64, 32, 48, 4096, 8192, 12_288]),
                    prop::sample::select(vec![0u64, 64, 100, 4096, 16_384]),
                ),
                prop::collection::vec((length(max), step(), step()), 0..40),
            )
        })
        .prop_map(|(max, shared_len, stride, items)| Case {
            max,
            descs: build_descs(shared_len, stride, items),
        })
}

/// Fuses adjacent segments that are contiguous in both the region and user
/// memory, so lists that differ only in how contiguous pieces were grouped
/// compare equal.
fn coalesce(v: impl Iterator<Item = (u64, u64, u64)>) -> Vec<(u64, u64, u64)> {
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for (r, a, l) in v {
        if let Some(last) = out.last_mut() {
            if last.0 + last.2 == r && last.1 + last.2 == a {
                last.2 += l;
                continue;
            }
        }
        out.push((r, a, l));
    }
    out
}

/// Pieces `(region_offset, src, dst, len)` of one chunk of an unmerged plan.
fn pieces(c: &Chunk) -> Vec<(u64, u64, u64, u64)> {
    assert_eq!(c.scatter_runs.len(), c.gather_runs.len());
    c.scatter_segments()
        .zip(c.gather_segments())
        .map(|((r, dst, l), (r2, src, l2))| {
            assert_eq!((r, l), (r2, l2), "scatter/gather views disagree");
            (r, src, dst, l)
        })
        .collect()
}

fn check(case: &Case) -> Result<(), TestCaseError> {
    let Case { max, descs } = case;
    let max = *max;
    let merged = TransferPlan::build(descs, max, true).expect("valid input");
    let plain = TransferPlan::build(descs, max, false).expect("valid input");

    // Same packing either way; chunk_bytes is what WANT carries.
    prop_assert_eq!(merged.chunk_bytes(), plain.chunk_bytes());
    let total: u64 = descs.iter().map(|d| d.len).sum();
    prop_assert_eq!(plain.total_bytes, total);
    prop_assert_eq!(merged.total_bytes, total);

    // Walk the pieces of the unmerged plan in order against the descriptors:
    // consecutive pieces of one descriptor continue it byte for byte, so every
    // byte of every descriptor lands at exactly one (chunk, region offset).
    let mut expect = descs.iter().filter(|d| d.len > 0);
    let mut cur: Option<(Descriptor, u64)> = None; // (descriptor, bytes done)
    let mut pieces_of_current = 0u32;
    for (i, (c, m)) in plain.chunks().iter().zip(merged.chunks()).enumerate() {
        prop_assert_eq!(c.index as usize, i);
        prop_assert!(c.packed_bytes > 0 && c.packed_bytes <= max);
        let ps = pieces(c);
        prop_assert_eq!(ps.len() as u64, c.pieces);
        let mut end = 0u64;
        let mut payload = 0u64;
        for &(r, src, dst, len) in &ps {
            prop_assert_eq!(r % ALIGN, 0, "unaligned piece offset");
            prop_assert!(len > 0);
            prop_assert!(r >= end, "overlapping pieces in chunk {}", i);
            end = r + len;
            prop_assert!(end <= c.packed_bytes);
            payload += len;
            let (d, done) = match cur.take() {
                Some(x) => x,
                None => {
                    pieces_of_current = 0;
                    (*expect.next().expect("piece beyond the descriptors"), 0)
                }
            };
            pieces_of_current += 1;
            prop_assert_eq!((src, dst), (d.src + done, d.dst + done));
            prop_assert!(done + len <= d.len);
            if done + len < d.len {
                cur = Some((d, done + len));
            } else if d.len <= max {
                // Descriptors that fit in a chunk are never split.
                prop_assert_eq!(pieces_of_current, 1);
            }
        }
        prop_assert_eq!(
            end,
            c.packed_bytes,
            "packed_bytes is the end of the last piece"
        );
        prop_assert_eq!(payload, c.payload_bytes);

        // Merged runs expand to the same bytes as the per-descriptor list.
        prop_assert_eq!(
            coalesce(c.scatter_segments()),
            coalesce(m.scatter_segments())
        );
        prop_assert_eq!(
            coalesce(c.gather_segments()),
            coalesce(expand(&m.gather_runs))
        );
        prop_assert!(m.scatter_runs.len() <= c.scatter_runs.len());
        prop_assert_eq!(m.pieces, c.pieces);
        prop_assert_eq!(m.packed_bytes, c.packed_bytes);
        // The receiver's bound check (seed §9) accepts every run.
        for r in &m.scatter_runs {
            prop_assert!(r.count >= 1 && r.segment_len > 0);
            prop_assert!(r.region_end().is_some_and(|e| e <= m.packed_bytes));
        }
        // DATA carries the runs losslessly.
        let data = Data {
            request_id: 1,
            chunk_index: m.index,
            region_handle: 0,
            runs: m.scatter_runs.clone(),
        };
        let enc = Message::from(data.clone()).encode();
        prop_assert_eq!(decode_data(&enc).expect("decodes"), data);
    }
    prop_assert!(cur.is_none(), "descriptor left unfinished");
    prop_assert!(expect.next().is_none(), "descriptor never placed");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    /// Plan round-trip: exact byte coverage, alignment, no overlap, packed
    /// bytes ≤ max chunk, merged ≡ unmerged.
    #[test]
    fn plan_round_trip(case in case()) {
        check(&case)?;
    }

    /// The sizing pass a sender uses to send its WANT early gives exactly
    /// the chunk sizes of the full plan (same packing rule).
    #[test]
    fn chunk_sizes_equal_the_plans(case in case()) {
        let sizes = TransferPlan::chunk_sizes(&case.descs, case.max).expect("valid case");
        let plan = TransferPlan::build(&case.descs, case.max, true).expect("valid case");
        prop_assert_eq!(sizes, plan.chunk_bytes());
    }

    /// Each chunk built alone from its bound (as a copy worker does) is
    /// exactly the full plan's chunk, merged and unmerged; the bounds carry
    /// the plan's sizes, payloads and piece counts.
    #[test]
    fn chunks_built_alone_equal_the_plans(case in case(), merge in any::<bool>()) {
        let bounds = TransferPlan::chunk_bounds(&case.descs, case.max).expect("valid case");
        let plan = TransferPlan::build(&case.descs, case.max, merge).expect("valid case");
        prop_assert_eq!(bounds.len(), plan.chunk_count());
        // The length measured with the bounds is the list's common length
        // when every descriptor has one (non-zero), else `None` — a sender
        // trusts it to skip comparing a chunk's lengths.
        let (measured_bounds, measured) =
            TransferPlan::chunk_bounds_measured(&case.descs, case.max).expect("valid");
        prop_assert_eq!(&measured_bounds, &bounds);
        let common = case.descs.first().map(|d| d.len).filter(|&l| {
            l > 0 && case.descs.iter().all(|d| d.len == l)
        });
        prop_assert_eq!(measured, common);
        for (b, c) in bounds.iter().zip(plan.chunks()) {
            prop_assert_eq!(b.index, c.index);
            prop_assert_eq!(b.packed_bytes, c.packed_bytes);
            prop_assert_eq!(b.payload_bytes, c.payload_bytes);
            prop_assert_eq!(b.pieces, c.pieces);
            let alone = TransferPlan::build_chunk(&case.descs, b, case.max, merge)
                .expect("bound from the same list");
            prop_assert_eq!(&alone, c);
            // Without gather runs: the same chunk otherwise.
            let scatter = TransferPlan::build_chunk_scatter_runs(&case.descs, b, case.max, merge)
                .expect("bound from the same list");
            prop_assert!(scatter.gather_runs.is_empty());
            prop_assert_eq!(&scatter.scatter_runs, &c.scatter_runs);
            prop_assert_eq!(
                (scatter.index, scatter.packed_bytes, scatter.payload_bytes, scatter.pieces),
                (c.index, c.packed_bytes, c.payload_bytes, c.pieces)
            );
            // It finds the same uniform chunks in O(1).
            if let Some(len) = measured {
                prop_assert_eq!(
                    TransferPlan::uniform_pieces_of_len(&case.descs, b, case.max, len),
                    TransferPlan::uniform_pieces(&case.descs, b, case.max)
                );
            }
            // A uniform chunk's gather is exactly descriptor i at i × stride.
            if let Some(u) = TransferPlan::uniform_pieces(&case.descs, b, case.max) {
                let segs = (0..u.count)
                    .map(|i| (i as u64 * u.stride, case.descs[u.first_desc + i].src, u.len));
                prop_assert_eq!(coalesce(c.gather_segments()), coalesce(segs));
                prop_assert_eq!(u.stride % ALIGN, 0);
            }
        }
    }

    /// Equal-length descriptors no longer than the cap make every chunk
    /// uniform (the gather needs no runs); longer ones are split, and no
    /// chunk is.
    #[test]
    fn equal_lengths_make_uniform_chunks(
        max in prop::sample::select(vec![32u64, 96, 4096, 65_536]),
        len in 1u64..70_000,
        slots in prop::collection::vec((0u64..1 << 20, 0u64..1 << 20), 1..60),
    ) {
        let descs: Vec<Descriptor> = slots
            .iter()
            .map(|&(s, d)| Descriptor::new(s * 70_016, (1 << 40) + d * 70_016, len))
            .collect();
        let (bounds, measured) = TransferPlan::chunk_bounds_measured(&descs, max).expect("valid");
        prop_assert_eq!(&bounds, &TransferPlan::chunk_bounds(&descs, max).expect("valid"));
        prop_assert_eq!(measured, Some(len));
        let mut covered = 0;
        for b in &bounds {
            let u = TransferPlan::uniform_pieces(&descs, b, max);
            prop_assert_eq!(u.is_some(), len <= max, "{:?}", b);
            prop_assert_eq!(TransferPlan::uniform_pieces_of_len(&descs, b, max, len), u);
            // Another length than the list's is no layout.
            prop_assert!(TransferPlan::uniform_pieces_of_len(&descs, b, max, len + 1).is_none());
            if let Some(u) = u {
                prop_assert_eq!(u.first_desc, covered);
                covered += u.count;
                // The layout is the plan's: piece i of the chunk at i × stride.
                let c = TransferPlan::build_chunk(&descs, b, max, false).expect("valid");
                let segs = (0..u.count)
                    .map(|i| (i as u64 * u.stride, descs[u.first_desc + i].src, u.len));
                prop_assert_eq!(coalesce(c.gather_segments()), coalesce(segs));
                // A bound whose sizes are not this layout's, or that points
                // past the list, is not uniform (the region is sized from it).
                let forged = [
                    ChunkBound { packed_bytes: b.packed_bytes - 1, ..*b },
                    ChunkBound { payload_bytes: b.payload_bytes + 1, ..*b },
                    ChunkBound { first_desc: descs.len(), ..*b },
                    ChunkBound { pieces: b.pieces + descs.len() as u64, ..*b },
                ];
                for f in forged {
                    prop_assert!(TransferPlan::uniform_pieces(&descs, &f, max).is_none(), "{:?}", f);
                    prop_assert!(
                        TransferPlan::uniform_pieces_of_len(&descs, &f, max, len).is_none(),
                        "{:?}", f
                    );
                }
            }
        }
        if len <= max {
            prop_assert_eq!(covered, descs.len());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1_000))]

    /// The dense case: equal-length descriptors whose src and dst advance by
    /// uniform forward strides collapse to exactly one gather and one scatter
    /// run per chunk, however many descriptors there are.
    #[test]
    fn uniform_stride_is_one_run_per_chunk(
        max in prop::sample::select(vec![4096u64, 65_536, 1 << 20]),
        n in 1u64..600,
        len in 1u64..=4096,
        src_gap in 0u64..10_000,
        dst_gap in 0u64..10_000,
    ) {
        let descs: Vec<_> = (0..n)
            .map(|i| Descriptor::new(i * (len + src_gap), (1 << 40) + i * (len + dst_gap), len))
            .collect();
        let p = TransferPlan::build(&descs, max, true).unwrap();
        for c in p.chunks() {
            prop_assert_eq!(c.scatter_runs.len(), 1, "{:?}", c.scatter_runs);
            prop_assert_eq!(c.gather_runs.len(), 1);
        }
        check(&Case { max, descs })?;
    }
}

/// A block hand-off's descriptors as `layout::block_descriptors` orders
/// them: plane-major (`planes` planes `plane` bytes apart), the same
/// `blocks` (ids into a pool of `len`-byte blocks) in each.
fn block_handoff(blocks: &[u64], planes: u64, plane: u64, len: u64) -> Vec<Descriptor> {
    (0..planes)
        .flat_map(|q| {
            blocks.iter().enumerate().map(move |(i, &b)| {
                Descriptor::new(i as u64 * len, (1 << 40) + q * plane + b * len, len)
            })
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// DATA_BLOCKS (issue 18 step 3): a block hand-off's destinations are
    /// found to repeat plane after plane (`BlockPlanes::of`), with a plane of
    /// at most the request's blocks, and every chunk's block form names
    /// exactly its pieces' destinations — also from a chunk that starts
    /// inside a plane. Whatever the list (random destinations too), a
    /// period found always names every descriptor's destination.
    #[test]
    fn block_form_names_every_pieces_destination(
        max in prop::sample::select(vec![4096u64, 65_536, 1 << 20]),
        ids in prop::collection::vec(0u64..4096, 1..80),
        planes in 2u64..12,
        len in prop::sample::select(vec![64u64, 4096]),
        random in prop::collection::vec(0u64..1 << 20, 2..60),
    ) {
        let plane = 4096 * len;
        let descs = block_handoff(&ids, planes, plane, len);
        let p = kvfabric_core::plan::BlockPlanes::of_dsts(&descs);
        let p = p.expect("a block hand-off repeats plane after plane");
        prop_assert!(p.offsets.len() <= ids.len());
        prop_assert_eq!(ids.len() % p.offsets.len(), 0);
        let (bounds, measured) = TransferPlan::chunk_bounds_measured(&descs, max).unwrap();
        for b in &bounds {
            let Some(u) = TransferPlan::uniform_pieces_of_len(&descs, b, max, measured.unwrap())
            else {
                continue;
            };
            let want: Vec<u64> = descs[u.first_desc..u.first_desc + u.count].iter().map(|d| d.dst).collect();
            match p.scatter(&u) {
                Some(s) => {
                    prop_assert!(u.count > p.offsets.len());
                    prop_assert_eq!(s.first, u.first_desc as u64);
                    prop_assert_eq!(&s.to_uniform().unwrap().dsts, &want);
                    let (lo, hi) = s.dst_bounds().unwrap();
                    prop_assert!(want.iter().all(|&a| a >= lo && a + len <= hi));
                }
                None => prop_assert!(u.count <= p.offsets.len()),
            }
        }
        // Any list — random, or a hand-off with one destination moved (the
        // samples may all pass and the full check not) — a period found is
        // a true one.
        let mut moved = block_handoff(&ids, planes, plane, len);
        let at = random[0] as usize % moved.len();
        moved[at].dst += len * (1 + random[1] % 3);
        let random: Vec<Descriptor> = random.iter().map(|&d| Descriptor::new(0, d * 64, 64)).collect();
        for descs in [random, moved] {
            if let Some(p) = kvfabric_core::plan::BlockPlanes::of_dsts(&descs) {
                let n = p.offsets.len();
                for (k, d) in descs.iter().enumerate() {
                    prop_assert_eq!(d.dst, (k / n) as u64 * p.plane_stride + p.offsets[k % n]);
                }
            }
        }
    }
}

/// Lists without a period: random destinations, a plane that differs in
/// one block, fewer than two planes.
#[test]
fn no_block_form_without_a_period() {
    use kvfabric_core::plan::BlockPlanes;
    let mut descs = block_handoff(&[5, 1, 9, 2], 3, 1 << 20, 4096);
    assert!(BlockPlanes::of_dsts(&descs).is_some());
    descs[9].dst += 4096;
    assert_eq!(BlockPlanes::of_dsts(&descs), None);
    assert_eq!(
        BlockPlanes::of_dsts(&block_handoff(&[5, 1, 9, 2], 1, 1 << 20, 4096)),
        None
    );
    assert_eq!(BlockPlanes::of_dsts(&descs[..1]), None);
    // Contiguous destinations: one block a plane.
    let p = BlockPlanes::of_dsts(&block_handoff(&[0, 1, 2, 3], 2, 4 * 4096, 4096)).unwrap();
    assert_eq!((p.offsets.len(), p.plane_stride), (1, 4096));
    // Sources: a hand-off's sources found the same way, every one derived.
    let d = block_handoff(&[5, 1, 9, 2], 3, 1 << 20, 4096);
    let mut d2 = d.clone();
    for (k, x) in d2.iter_mut().enumerate() {
        (x.src, x.dst) = (x.dst + 7, k as u64 * 64);
    }
    let p = BlockPlanes::of_srcs(&d2).unwrap();
    assert_eq!(p.offsets.len(), 4);
    for (k, x) in d2.iter().enumerate() {
        assert_eq!(p.addr(k as u64), Some(x.src));
    }
    assert_eq!(BlockPlanes::of_srcs(&d2[..4]), None);
}
