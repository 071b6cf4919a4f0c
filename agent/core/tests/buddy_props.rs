//! Property tests of `BuddyAllocator` (seed §4): random alloc/free
//! sequences against a model — no overlap, alignment, bounds, internal
//! fragmentation < 2×, exact byte accounting, errors never change state, and
//! the fully freed allocator equals a fresh one (no external fragmentation).

use kvfabric_core::buddy::{max_allocation, usable_capacity, BuddyAllocator, BuddyError};
use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64),
    Free(usize),
    Garbage(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u64..u64::MAX).prop_map(Op::Alloc),
        4 => any::<usize>().prop_map(Op::Free),
        1 => any::<u64>().prop_map(Op::Garbage),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 3_000,
        rng_algorithm: proptest::test_runner::RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_alloc_free(
        gran_shift in 0u32..13,
        units in 1u64..300,
        slack in any::<u64>(),
        ops in prop::collection::vec(op(), 1..120),
        free_order in any::<u64>(),
    ) {
        let g = 1u64 << gran_shift;
        let arena = units * g + slack % g;
        let mut b = BuddyAllocator::new(arena, g).unwrap();
        let fresh = b.clone();
        prop_assert_eq!(b.capacity(), usable_capacity(arena, g));
        prop_assert_eq!(b.max_allocation(), max_allocation(arena, g));
        let cap = b.capacity();
        let max = b.max_allocation();
        // offset -> (requested bytes, block bytes)
        let mut live: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        for op in &ops {
            match *op {
                Op::Alloc(raw) => {
                    // Mostly sizes in range, sometimes 0 or too large.
                    let bytes = match raw % 16 {
                        0 => 0,
                        1 => max + 1 + raw % 1000,
                        _ => 1 + raw % max,
                    };
                    let largest = b.largest_free_block();
                    match b.alloc(bytes) {
                        Some(off) => {
                            let block = b.block_size(bytes).unwrap();
                            prop_assert!(block >= bytes && block < 2 * bytes.max(g));
                            prop_assert!(block.is_power_of_two() && block >= g);
                            prop_assert_eq!(off % block, 0, "aligned to its size");
                            prop_assert!(off + block <= cap);
                            prop_assert_eq!(b.allocated_block(off), Some(block));
                            // No overlap with neighbours.
                            if let Some((&po, &(_, pb))) = live.range(..off).next_back() {
                                prop_assert!(po + pb <= off);
                            }
                            if let Some((&no, _)) = live.range(off..).next() {
                                prop_assert!(off + block <= no);
                            }
                            live.insert(off, (bytes, block));
                        }
                        None => {
                            // Refused only when impossible or no block is big enough.
                            match b.block_size(bytes) {
                                None => prop_assert!(bytes == 0 || bytes > max),
                                Some(block) => prop_assert!(largest < block),
                            }
                        }
                    }
                }
                Op::Free(pick) => {
                    if live.is_empty() {
                        continue;
                    }
                    let off = *live.keys().nth(pick % live.len()).unwrap();
                    let (_, block) = live.remove(&off).unwrap();
                    prop_assert_eq!(b.free(off), Ok(block));
                    prop_assert_eq!(b.free(off), Err(BuddyError::NotAllocated { offset: off }));
                }
                Op::Garbage(raw) => {
                    // Half in range (interior / free-block / misaligned
                    // offsets), half anywhere.
                    let off = if raw & 1 == 0 { (raw >> 1) % (cap + g) } else { raw };
                    if live.contains_key(&off) {
                        continue;
                    }
                    let before = b.clone();
                    prop_assert!(b.free(off).is_err());
                    prop_assert_eq!(&b, &before);
                }
            }
            let used: u64 = live.values().map(|v| v.1).sum();
            prop_assert_eq!(b.free_bytes() + used, cap);
            prop_assert_eq!(b.allocation_count(), live.len());
            if let Err(e) = b.check_invariants() {
                return Err(TestCaseError::fail(e));
            }
        }
        // Free the rest in a random order: the allocator is fresh again.
        let mut offs: Vec<u64> = live.keys().copied().collect();
        let mut x = free_order | 1;
        for i in (1..offs.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            offs.swap(i, (x % (i as u64 + 1)) as usize);
        }
        for off in offs {
            b.free(off).unwrap();
        }
        prop_assert_eq!(&b, &fresh);
        prop_assert_eq!(b.alloc(max), Some(0));
    }
}

/// Many equal small blocks, freed in an interleaved order, coalesce back to
/// the whole arena.
#[test]
fn interleaved_free_coalesces_completely() {
    let g = 4096;
    let mut b = BuddyAllocator::new(1024 * g, g).unwrap();
    let offs: Vec<u64> = (0..1024).map(|_| b.alloc(g).unwrap()).collect();
    assert_eq!(b.alloc(1), None);
    for stride_start in [3usize, 1, 2, 0] {
        for o in offs.iter().skip(stride_start).step_by(4) {
            b.free(*o).unwrap();
        }
        b.check_invariants().unwrap();
    }
    assert_eq!(b, BuddyAllocator::new(1024 * g, g).unwrap());
    assert_eq!(b.largest_free_block(), 1024 * g);
}
