//! Power-of-two buddy allocator over arena byte offsets (seed §4
//! `BuddyAllocator`). OWNER: buddy/scheduler helper — keep the two sizing
//! functions below (config validation depends on them).

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
