//! Deterministic per-transfer byte patterns and slot permutations, shared by
//! the bench processes and the tests (sender fills, receiver verifies).

use kvfabric_core::Descriptor;

/// Byte `j` of descriptor `k` of the transfer seeded `seed`. Distinct per
/// transfer (seed), per descriptor and per offset, so cross-talk between
/// transfers or misplaced blocks are caught.
pub fn pattern_byte(seed: u64, k: u64, j: u64) -> u8 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ k.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ (j >> 3).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 29;
    (x >> ((j & 7) * 8)) as u8
}

/// Fills `len` bytes at `addr` with descriptor `k`'s pattern.
///
/// # Safety
/// `[addr, addr + len)` must be writable memory owned by the caller.
pub unsafe fn fill_raw(addr: u64, len: u64, seed: u64, k: u64) {
    let s = std::slice::from_raw_parts_mut(addr as usize as *mut u8, len as usize);
    for (j, b) in s.iter_mut().enumerate() {
        *b = pattern_byte(seed, k, j as u64);
    }
}

/// Checks `len` bytes at `addr` against descriptor `k`'s pattern; returns
/// the first mismatching offset.
///
/// # Safety
/// `[addr, addr + len)` must be readable memory.
pub unsafe fn check_raw(addr: u64, len: u64, seed: u64, k: u64) -> Result<(), u64> {
    let s = std::slice::from_raw_parts(addr as usize as *const u8, len as usize);
    for (j, b) in s.iter().enumerate() {
        if *b != pattern_byte(seed, k, j as u64) {
            return Err(j as u64);
        }
    }
    Ok(())
}

/// A deterministic permutation of `n` slots (xorshift Fisher–Yates).
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut s = seed | 1;
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.swap(i, (s % (i as u64 + 1)) as usize);
    }
    v
}

/// `count` descriptors of `block` bytes from random source slots of the
/// pool at `src` to random destination slots of the pool at `dst` (both
/// pools hold at least `count` slots): the fragmented layout a paged KV
/// cache has.
pub fn random_slots(src: u64, dst: u64, count: usize, block: u64, seed: u64) -> Vec<Descriptor> {
    let s = permutation(count, seed);
    let d = permutation(count, seed.wrapping_add(0x5151));
    (0..count)
        .map(|i| Descriptor::new(src + s[i] as u64 * block, dst + d[i] as u64 * block, block))
        .collect()
}
