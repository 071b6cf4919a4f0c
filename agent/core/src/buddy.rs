//! Power-of-two buddy allocator over arena byte offsets (seed §4
//! `BuddyAllocator`, used by the credit scheduler of seed §5).
//!
//! The allocator never touches memory: it hands out **byte offsets** into an
//! arena of `arena_bytes` whose base address the caller owns (a region's
//! address is `base + offset`, seed §3 "region").
//!
//! # Layout
//!
//! The arena is rounded down to a multiple of the minimum block
//! (`granularity`, a power of two) — [`usable_capacity`] — and that usable
//! capacity is managed as a sequence of power-of-two **top-level blocks,
//! largest first**: an arena of 11 granules is one 8-granule block at offset
//! 0, one 2-granule block at 8 and one 1-granule block at 10. Because the
//! blocks are placed largest first, every block (top-level or split) starts
//! at an offset that is a multiple of its own size, so a block's buddy is
//! found by flipping one offset bit; coalescing never crosses a top-level
//! block boundary. The largest request that can ever be satisfied is the
//! first top-level block, [`max_allocation`].
//!
//! # Guarantees
//!
//! * **No external fragmentation:** freed buddies are coalesced eagerly, so
//!   once every allocation is freed the allocator is equal (`==`) to a fresh
//!   one and [`BuddyAllocator::max_allocation`] bytes fit again.
//! * **Internal fragmentation ≤ 2×:** a request of `b` bytes takes a block of
//!   [`BuddyAllocator::block_size`]`(b)` < `2 * max(b, granularity)` bytes.
//! * **Cost:** `alloc` and `free` are O(log n) in the number of blocks: one
//!   ordered free set per order (lowest offset first, so allocation is
//!   deterministic), a bitmask of non-empty orders, and a hash map of live
//!   allocations (offset → order).
//! * **Misuse never corrupts state:** freeing an offset that is out of range,
//!   not granularity-aligned, or not the start of a live allocation (double
//!   free, interior or foreign offset) is an error and changes nothing.

use std::collections::{BTreeSet, HashMap};
use thiserror::Error;

/// Bytes of an arena of `arena_bytes` that the buddy allocator can manage
/// with minimum block `granularity` bytes: the arena rounded down to a
/// multiple of the granularity (it is managed as a sequence of power-of-two
/// top-level blocks, largest first). Returns 0 when `granularity` is 0.
pub const fn usable_capacity(arena_bytes: u64, granularity: u64) -> u64 {
    if granularity == 0 {
        return 0;
    }
    arena_bytes / granularity * granularity
}

/// Largest single allocation an arena of `arena_bytes` with minimum block
/// `granularity` can ever satisfy: its largest top-level block,
/// `granularity * 2^floor(log2(arena_bytes / granularity))`. Returns 0 when
/// the arena is smaller than one block or `granularity` is 0.
pub const fn max_allocation(arena_bytes: u64, granularity: u64) -> u64 {
    if granularity == 0 {
        return 0;
    }
    let blocks = arena_bytes / granularity;
    if blocks == 0 {
        return 0;
    }
    let top = 1u64 << (63 - blocks.leading_zeros());
    granularity * top
}

/// Errors of [`BuddyAllocator`]. Construction errors come from
/// [`BuddyAllocator::new`]; the offset errors come from
/// [`BuddyAllocator::free`] and leave the allocator unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum BuddyError {
    /// The granularity (minimum block, bytes) is 0 or not a power of two.
    #[error("buddy granularity {0} bytes is not a non-zero power of two")]
    InvalidGranularity(u64),
    /// The arena is smaller than one minimum block, so nothing can ever be
    /// allocated.
    #[error("arena of {arena_bytes} bytes is smaller than one {granularity}-byte block")]
    ArenaTooSmall {
        /// Requested arena size (bytes).
        arena_bytes: u64,
        /// Minimum block (bytes).
        granularity: u64,
    },
    /// The offset lies at or past the end of the usable capacity.
    #[error("offset {offset} is outside the {capacity}-byte arena")]
    OutOfRange {
        /// Offending offset (bytes).
        offset: u64,
        /// Usable capacity (bytes).
        capacity: u64,
    },
    /// The offset is not a multiple of the granularity, so it cannot be the
    /// start of any block.
    #[error("offset {offset} is not aligned to the {granularity}-byte granularity")]
    Misaligned {
        /// Offending offset (bytes).
        offset: u64,
        /// Minimum block (bytes).
        granularity: u64,
    },
    /// The offset is in range and aligned but is not the start of a live
    /// allocation: a double free, or an interior/foreign offset.
    #[error(
        "offset {offset} is not the start of a live allocation (double free or foreign offset)"
    )]
    NotAllocated {
        /// Offending offset (bytes).
        offset: u64,
    },
}

/// Power-of-two buddy allocator over the byte offsets of an arena (seed §4).
/// See the [module docs](self) for the layout and guarantees.
///
/// Two allocators compare equal when they manage the same arena and have the
/// same free blocks and live allocations; a fully freed allocator equals a
/// fresh one (the "no external fragmentation" property, checked by tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuddyAllocator {
    /// Minimum block (bytes), a power of two.
    granularity: u64,
    /// `log2(granularity)`.
    gran_shift: u32,
    /// Usable capacity in granules (`capacity / granularity`).
    units: u64,
    /// Largest order (`floor(log2(units))`); order `k` is a block of
    /// `granularity << k` bytes.
    max_order: u32,
    /// Free blocks per order, as byte offsets (lowest first).
    free_lists: Vec<BTreeSet<u64>>,
    /// Bit `k` set iff `free_lists[k]` is non-empty.
    nonempty: u64,
    /// Live allocations: start offset (bytes) → order.
    allocated: HashMap<u64, u32>,
    /// Sum of free block sizes (bytes).
    free_bytes: u64,
}

impl BuddyAllocator {
    /// Builds an allocator managing [`usable_capacity`]`(arena_bytes,
    /// granularity)` bytes, all free, as power-of-two top-level blocks
    /// largest first.
    ///
    /// # Errors
    /// [`BuddyError::InvalidGranularity`] when `granularity` (bytes) is 0 or
    /// not a power of two; [`BuddyError::ArenaTooSmall`] when `arena_bytes <
    /// granularity`.
    pub fn new(arena_bytes: u64, granularity: u64) -> Result<Self, BuddyError> {
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(BuddyError::InvalidGranularity(granularity));
        }
        let units = arena_bytes / granularity;
        if units == 0 {
            return Err(BuddyError::ArenaTooSmall {
                arena_bytes,
                granularity,
            });
        }
        let gran_shift = granularity.trailing_zeros();
        let max_order = 63 - units.leading_zeros();
        let mut this = Self {
            granularity,
            gran_shift,
            units,
            max_order,
            free_lists: vec![BTreeSet::new(); max_order as usize + 1],
            nonempty: 0,
            allocated: HashMap::new(),
            free_bytes: units << gran_shift,
        };
        // Top-level blocks: the set bits of `units`, largest first.
        let mut start_unit = 0u64;
        for order in (0..=max_order).rev() {
            if units & (1u64 << order) != 0 {
                this.push_free(order, start_unit << gran_shift);
                start_unit += 1u64 << order;
            }
        }
        Ok(this)
    }

    /// Usable capacity managed by this allocator (bytes); equals
    /// [`usable_capacity`] of the construction arguments.
    pub fn capacity(&self) -> u64 {
        self.units << self.gran_shift
    }

    /// Minimum block size (bytes).
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Largest request this allocator can ever satisfy (bytes): its first
    /// top-level block; equals [`max_allocation`] of the construction
    /// arguments.
    pub fn max_allocation(&self) -> u64 {
        self.granularity << self.max_order
    }

    /// Sum of all currently free block sizes (bytes). A request may still
    /// fail when this is large enough, if no single free block is.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Bytes currently handed out (block sizes, not requested sizes):
    /// `capacity() - free_bytes()`.
    pub fn allocated_bytes(&self) -> u64 {
        self.capacity() - self.free_bytes
    }

    /// Number of live allocations.
    pub fn allocation_count(&self) -> usize {
        self.allocated.len()
    }

    /// Size of the largest currently free block (bytes), i.e. the largest
    /// request that [`alloc`](Self::alloc) would satisfy right now; 0 when
    /// the arena is full.
    pub fn largest_free_block(&self) -> u64 {
        if self.nonempty == 0 {
            0
        } else {
            self.granularity << (63 - self.nonempty.leading_zeros())
        }
    }

    /// Block size (bytes) a request of `bytes` would occupy: `bytes` rounded
    /// up to the granularity and then to a power-of-two multiple of it, so
    /// `block_size(b) < 2 * max(b, granularity)`. `None` when `bytes` is 0 or
    /// larger than [`max_allocation`](Self::max_allocation).
    pub fn block_size(&self, bytes: u64) -> Option<u64> {
        self.order_for(bytes).map(|k| self.granularity << k)
    }

    /// Block size (bytes) of the live allocation starting at `offset`, or
    /// `None` when `offset` is not the start of a live allocation.
    pub fn allocated_block(&self, offset: u64) -> Option<u64> {
        self.allocated.get(&offset).map(|&k| self.granularity << k)
    }

    /// Allocates a block for `bytes` bytes and returns its offset (bytes from
    /// the arena start; aligned to the block size). The lowest-offset block
    /// of the smallest sufficient order is used, splitting larger blocks as
    /// needed.
    ///
    /// Returns `None` — never panics, never errors — when no free block is
    /// large enough right now (backpressure: retry after a `free`), and also
    /// when `bytes` is 0 or exceeds [`max_allocation`](Self::max_allocation)
    /// (such a request can never be satisfied; callers that need to tell the
    /// two apart check `block_size(bytes).is_none()` first).
    pub fn alloc(&mut self, bytes: u64) -> Option<u64> {
        let want = self.order_for(bytes)?;
        let avail = self.nonempty >> want;
        if avail == 0 {
            return None;
        }
        let mut order = want + avail.trailing_zeros();
        let offset = self.pop_free(order);
        // Split down: keep the lower half, free the upper half.
        while order > want {
            order -= 1;
            self.push_free(order, offset + (self.granularity << order));
        }
        self.allocated.insert(offset, want);
        self.free_bytes -= self.granularity << want;
        Some(offset)
    }

    /// Frees the allocation starting at `offset` and returns its block size
    /// (bytes), coalescing it with its free buddy repeatedly (never across a
    /// top-level block).
    ///
    /// # Errors
    /// [`BuddyError::OutOfRange`], [`BuddyError::Misaligned`] or
    /// [`BuddyError::NotAllocated`] (double free, interior or foreign
    /// offset); the allocator is unchanged in every error case.
    pub fn free(&mut self, offset: u64) -> Result<u64, BuddyError> {
        let capacity = self.capacity();
        if offset >= capacity {
            return Err(BuddyError::OutOfRange { offset, capacity });
        }
        if offset & (self.granularity - 1) != 0 {
            return Err(BuddyError::Misaligned {
                offset,
                granularity: self.granularity,
            });
        }
        let Some(order) = self.allocated.remove(&offset) else {
            return Err(BuddyError::NotAllocated { offset });
        };
        let block = self.granularity << order;
        self.free_bytes += block;

        let mut unit = offset >> self.gran_shift;
        let mut k = order;
        while self.can_merge(unit, k) {
            let buddy = unit ^ (1u64 << k);
            let set = &mut self.free_lists[k as usize];
            if !set.remove(&(buddy << self.gran_shift)) {
                break;
            }
            if set.is_empty() {
                self.nonempty &= !(1u64 << k);
            }
            unit &= !(1u64 << k);
            k += 1;
        }
        self.push_free(k, unit << self.gran_shift);
        Ok(block)
    }

    /// Verifies the internal bookkeeping (for tests and
    /// `CreditScheduler::check_conservation`): free-list sizes sum to
    /// `free_bytes`, free + allocated = capacity, the non-empty mask matches,
    /// every block is aligned to its size and inside one top-level block, no
    /// two blocks overlap, and no two free buddies are left uncoalesced.
    ///
    /// # Errors
    /// A human-readable description of the first violation found.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut blocks: Vec<(u64, u32, bool)> = Vec::new(); // (unit, order, free)
        let mut free_sum = 0u64;
        for (k, set) in self.free_lists.iter().enumerate() {
            let k = k as u32;
            if set.is_empty() == (self.nonempty & (1u64 << k) != 0) {
                return Err(format!("nonempty mask wrong at order {k}"));
            }
            for &off in set {
                free_sum += self.granularity << k;
                blocks.push((off >> self.gran_shift, k, true));
            }
        }
        if free_sum != self.free_bytes {
            return Err(format!(
                "free lists hold {free_sum} bytes but free_bytes = {}",
                self.free_bytes
            ));
        }
        let mut alloc_sum = 0u64;
        for (&off, &k) in &self.allocated {
            alloc_sum += self.granularity << k;
            blocks.push((off >> self.gran_shift, k, false));
        }
        if free_sum + alloc_sum != self.capacity() {
            return Err(format!(
                "free {free_sum} + allocated {alloc_sum} != capacity {}",
                self.capacity()
            ));
        }
        blocks.sort_unstable();
        let mut end = 0u64;
        for &(unit, k, _) in &blocks {
            if unit & ((1u64 << k) - 1) != 0 {
                return Err(format!("block at unit {unit} misaligned for order {k}"));
            }
            // Inside one top-level block: all top-level blocks of order >= k
            // cover [0, units & !(2^k - 1)).
            if unit + (1u64 << k) > (self.units >> k) << k {
                return Err(format!(
                    "block at unit {unit} order {k} crosses a top-level block"
                ));
            }
            if unit < end {
                return Err(format!("block at unit {unit} overlaps the previous block"));
            }
            end = unit + (1u64 << k);
        }
        for (k, set) in self.free_lists.iter().enumerate() {
            let k = k as u32;
            for &off in set {
                let unit = off >> self.gran_shift;
                if self.can_merge(unit, k)
                    && set.contains(&((unit ^ (1u64 << k)) << self.gran_shift))
                {
                    return Err(format!(
                        "free buddies at unit {unit} order {k} not coalesced"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Order of the block serving `bytes`, or `None` for 0 / too large.
    fn order_for(&self, bytes: u64) -> Option<u32> {
        if bytes == 0 || bytes > self.max_allocation() {
            return None;
        }
        let units = (bytes - 1) >> self.gran_shift; // ceil(bytes / g) - 1
        Some(if units == 0 {
            0
        } else {
            64 - units.leading_zeros()
        })
    }

    /// Whether the order-`k` block at granule `unit` may merge with its
    /// buddy: the merged order-`k+1` block must lie inside one top-level
    /// block. Top-level blocks of order ≥ k+1 exactly cover granules
    /// `[0, units & !(2^(k+1) - 1))`.
    fn can_merge(&self, unit: u64, k: u32) -> bool {
        k < self.max_order && unit < (self.units >> (k + 1)) << (k + 1)
    }

    fn push_free(&mut self, order: u32, offset: u64) {
        self.free_lists[order as usize].insert(offset);
        self.nonempty |= 1u64 << order;
    }

    fn pop_free(&mut self, order: u32) -> u64 {
        let set = &mut self.free_lists[order as usize];
        let offset = set
            .pop_first()
            .expect("nonempty mask says order has a free block");
        if set.is_empty() {
            self.nonempty &= !(1u64 << order);
        }
        offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 4096;

    #[test]
    fn sizing_functions() {
        assert_eq!(usable_capacity(11 * G + 5, G), 11 * G);
        assert_eq!(max_allocation(11 * G + 5, G), 8 * G);
        assert_eq!(max_allocation(G - 1, G), 0);
        assert_eq!(usable_capacity(100, 0), 0);
        assert_eq!(max_allocation(100, 0), 0);
        let b = BuddyAllocator::new(11 * G + 5, G).unwrap();
        assert_eq!(b.capacity(), usable_capacity(11 * G + 5, G));
        assert_eq!(b.max_allocation(), max_allocation(11 * G + 5, G));
        assert_eq!(b.free_bytes(), 11 * G);
    }

    #[test]
    fn construction_errors() {
        assert_eq!(
            BuddyAllocator::new(1 << 20, 0),
            Err(BuddyError::InvalidGranularity(0))
        );
        assert_eq!(
            BuddyAllocator::new(1 << 20, 3000),
            Err(BuddyError::InvalidGranularity(3000))
        );
        assert!(matches!(
            BuddyAllocator::new(G - 1, G),
            Err(BuddyError::ArenaTooSmall { .. })
        ));
        // Huge arena: no shift overflow.
        let b = BuddyAllocator::new(u64::MAX, 1).unwrap();
        assert_eq!(b.max_allocation(), 1u64 << 63);
        assert_eq!(b.capacity(), u64::MAX);
    }

    #[test]
    fn block_size_rounding() {
        let b = BuddyAllocator::new(16 * G, G).unwrap();
        assert_eq!(b.block_size(0), None);
        assert_eq!(b.block_size(1), Some(G));
        assert_eq!(b.block_size(G), Some(G));
        assert_eq!(b.block_size(G + 1), Some(2 * G));
        assert_eq!(b.block_size(3 * G), Some(4 * G));
        assert_eq!(b.block_size(16 * G), Some(16 * G));
        assert_eq!(b.block_size(16 * G + 1), None);
    }

    #[test]
    fn split_and_coalesce() {
        let mut b = BuddyAllocator::new(8 * G, G).unwrap();
        let fresh = b.clone();
        let a = b.alloc(G).unwrap();
        assert_eq!(a, 0);
        // 8 split into 1(a) + 1 + 2 + 4 free.
        assert_eq!(b.free_bytes(), 7 * G);
        assert_eq!(b.largest_free_block(), 4 * G);
        let c = b.alloc(G).unwrap();
        assert_eq!(c, G); // the buddy of a
        let d = b.alloc(2 * G).unwrap();
        assert_eq!(d, 2 * G);
        let e = b.alloc(4 * G).unwrap();
        assert_eq!(e, 4 * G);
        assert_eq!(b.free_bytes(), 0);
        assert_eq!(b.alloc(1), None);
        b.check_invariants().unwrap();
        assert_eq!(b.free(c), Ok(G));
        assert_eq!(b.free(a), Ok(G)); // coalesces to a 2G block at 0
        assert_eq!(b.largest_free_block(), 2 * G);
        assert_eq!(b.free(e), Ok(4 * G));
        assert_eq!(b.free(d), Ok(2 * G)); // 0..4 then 0..8
        b.check_invariants().unwrap();
        assert_eq!(b, fresh);
        assert_eq!(b.alloc(8 * G), Some(0));
    }

    #[test]
    fn non_power_of_two_arena_top_blocks() {
        // 11 granules = 8 @0, 2 @8, 1 @10.
        let mut b = BuddyAllocator::new(11 * G, G).unwrap();
        let fresh = b.clone();
        assert_eq!(b.alloc(8 * G), Some(0));
        assert_eq!(b.alloc(2 * G), Some(8 * G));
        assert_eq!(b.alloc(G), Some(10 * G));
        assert_eq!(b.alloc(G), None);
        // The 2G and 1G top-level blocks must never merge with each other or
        // with the 8G block.
        b.free(10 * G).unwrap();
        b.free(8 * G).unwrap();
        b.check_invariants().unwrap();
        assert_eq!(b.largest_free_block(), 2 * G);
        assert_eq!(b.alloc(4 * G), None);
        b.free(0).unwrap();
        assert_eq!(b, fresh);
    }

    #[test]
    fn small_requests_prefer_small_blocks() {
        // With 8@0, 2@8, 1@10 free, a 1-granule request takes the 1G block
        // rather than splitting a larger one.
        let mut b = BuddyAllocator::new(11 * G, G).unwrap();
        assert_eq!(b.alloc(1), Some(10 * G));
        assert_eq!(b.alloc(G + 1), Some(8 * G));
        assert_eq!(b.largest_free_block(), 8 * G);
    }

    #[test]
    fn boundaries() {
        let mut b = BuddyAllocator::new(16 * G, G).unwrap();
        assert_eq!(b.alloc(0), None);
        assert_eq!(b.alloc(16 * G + 1), None);
        assert_eq!(b.alloc(u64::MAX), None);
        assert_eq!(b.alloc(16 * G), Some(0));
        assert_eq!(b.alloc(1), None);
        assert_eq!(b.free(0), Ok(16 * G));
        // Granularity 1 and a 1-byte arena.
        let mut one = BuddyAllocator::new(1, 1).unwrap();
        assert_eq!(one.alloc(1), Some(0));
        assert_eq!(one.alloc(1), None);
        assert_eq!(one.free(0), Ok(1));
    }

    #[test]
    fn double_free_and_foreign_offsets_are_errors() {
        let mut b = BuddyAllocator::new(16 * G, G).unwrap();
        let a = b.alloc(4 * G).unwrap();
        let _c = b.alloc(G).unwrap();
        let before = b.clone();
        assert_eq!(
            b.free(16 * G),
            Err(BuddyError::OutOfRange {
                offset: 16 * G,
                capacity: 16 * G
            })
        );
        assert_eq!(
            b.free(a + 1),
            Err(BuddyError::Misaligned {
                offset: a + 1,
                granularity: G
            })
        );
        // Interior offset of a live block.
        assert_eq!(
            b.free(a + G),
            Err(BuddyError::NotAllocated { offset: a + G })
        );
        // Start of a free block.
        assert_eq!(
            b.free(8 * G),
            Err(BuddyError::NotAllocated { offset: 8 * G })
        );
        assert_eq!(b, before);
        assert_eq!(b.free(a), Ok(4 * G));
        let after = b.clone();
        assert_eq!(b.free(a), Err(BuddyError::NotAllocated { offset: a }));
        assert_eq!(b, after);
        b.check_invariants().unwrap();
    }

    #[test]
    fn allocated_block_reports_block_size() {
        let mut b = BuddyAllocator::new(16 * G, G).unwrap();
        let a = b.alloc(3 * G).unwrap();
        assert_eq!(b.allocated_block(a), Some(4 * G));
        assert_eq!(b.allocated_block(a + G), None);
        assert_eq!(b.allocation_count(), 1);
        assert_eq!(b.allocated_bytes(), 4 * G);
    }

    #[test]
    fn fragmentation_recovers_after_free() {
        // Fill with granules, free every other one: 8 free granules but no
        // 2-granule block; freeing the rest restores the full arena.
        let mut b = BuddyAllocator::new(16 * G, G).unwrap();
        let offs: Vec<u64> = (0..16).map(|_| b.alloc(G).unwrap()).collect();
        for o in offs.iter().step_by(2) {
            b.free(*o).unwrap();
        }
        assert_eq!(b.free_bytes(), 8 * G);
        assert_eq!(b.alloc(2 * G), None);
        for o in offs.iter().skip(1).step_by(2) {
            b.free(*o).unwrap();
        }
        assert_eq!(b, BuddyAllocator::new(16 * G, G).unwrap());
        assert_eq!(b.alloc(16 * G), Some(0));
    }
}
