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

/// [`random_slots`] as a block hand-off between layer-major pools lays
/// them out: `planes` equal planes of each pool, the same `count / planes`
/// random block slots in every plane of the pool at `dst` (and another
/// random choice, the same in every plane, of the pool at `src`), plane
/// after plane. `planes` must divide `count` (1 = random slots of one
/// plane on each side).
pub fn plane_slots(
    src: u64,
    dst: u64,
    count: usize,
    planes: usize,
    block: u64,
    seed: u64,
) -> Vec<Descriptor> {
    let per = count / planes.max(1);
    let s = permutation(per, seed);
    let d = permutation(per, seed.wrapping_add(0x5151));
    (0..count)
        .map(|i| {
            let (q, k) = (i / per, i % per);
            let (from, to) = ((q * per + s[k]) as u64, (q * per + d[k]) as u64);
            Descriptor::new(src + from * block, dst + to * block, block)
        })
        .collect()
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Word `i` of descriptor `k` of transfer `seed` for the fast pattern: a
/// per-(seed, k) key plus the word index times an odd constant, so every
/// 8-byte word differs within a descriptor and across descriptors/transfers.
#[inline]
fn fast_word(key: u64, i: u64) -> u64 {
    key.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Fills `len` bytes at `addr` with the fast (memory-bandwidth) pattern of
/// descriptor `k` of transfer `seed`. Used by the trace bench, where
/// hundreds of MB per request are filled and verified.
///
/// # Safety
/// `[addr, addr + len)` must be writable memory owned by the caller.
pub unsafe fn fill_fast(addr: u64, len: u64, seed: u64, k: u64) {
    let key = mix(seed ^ mix(k));
    let s = std::slice::from_raw_parts_mut(addr as usize as *mut u8, len as usize);
    let mut chunks = s.chunks_exact_mut(8);
    for (i, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&fast_word(key, i as u64).to_le_bytes());
    }
    let tail_word = fast_word(key, len / 8).to_le_bytes();
    let rem = chunks.into_remainder();
    let n = rem.len();
    rem.copy_from_slice(&tail_word[..n]);
}

/// Verifies the fast pattern written by [`fill_fast`]; returns the first
/// mismatching byte offset.
///
/// # Safety
/// `[addr, addr + len)` must be readable memory.
pub unsafe fn check_fast(addr: u64, len: u64, seed: u64, k: u64) -> Result<(), u64> {
    let key = mix(seed ^ mix(k));
    let s = std::slice::from_raw_parts(addr as usize as *const u8, len as usize);
    let mut chunks = s.chunks_exact(8);
    for (i, c) in (&mut chunks).enumerate() {
        if c != fast_word(key, i as u64).to_le_bytes() {
            return Err(i as u64 * 8);
        }
    }
    let tail_word = fast_word(key, len / 8).to_le_bytes();
    let rem = chunks.remainder();
    if rem != &tail_word[..rem.len()] {
        return Err(len - rem.len() as u64);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `plane_slots`: every slot used once on each side, plane `q` inside
    /// its own `count / planes` slots, the same blocks in every plane (the
    /// periods DATA_BLOCKS and the block gather find).
    #[test]
    fn plane_slots_repeat_the_blocks_in_every_plane() {
        let (count, planes, block) = (1024usize, 8usize, 4096u64);
        let d = plane_slots(0, 1 << 30, count, planes, block, 7);
        let mut dst: Vec<u64> = d.iter().map(|x| (x.dst - (1 << 30)) / block).collect();
        let mut src: Vec<u64> = d.iter().map(|x| x.src / block).collect();
        for (i, &slot) in dst.iter().enumerate() {
            assert_eq!(slot as usize / (count / planes), i / (count / planes));
        }
        let p = kvfabric_core::plan::BlockPlanes::of_dsts(&d).unwrap();
        assert_eq!(p.offsets.len(), count / planes);
        let ps = kvfabric_core::plan::BlockPlanes::of_srcs(&d).unwrap();
        assert_eq!(ps.offsets.len(), count / planes);
        assert_eq!(p.plane_stride, (count / planes) as u64 * block);
        dst.sort_unstable();
        src.sort_unstable();
        assert!(dst.iter().copied().eq(0..count as u64));
        assert!(src.iter().copied().eq(0..count as u64));
        assert_eq!(
            kvfabric_core::plan::BlockPlanes::of_dsts(&random_slots(0, 1 << 30, count, block, 7)),
            None
        );
    }

    #[test]
    fn fast_pattern_round_trips_and_catches_corruption() {
        let mut buf = vec![0u8; 8195];
        let a = buf.as_mut_ptr() as u64;
        unsafe {
            fill_fast(a, 8195, 9, 3);
            assert_eq!(check_fast(a, 8195, 9, 3), Ok(()));
            assert!(check_fast(a, 8195, 10, 3).is_err(), "other transfer");
            assert!(check_fast(a, 8195, 9, 4).is_err(), "other descriptor");
        }
        buf[8194] ^= 1;
        assert_eq!(unsafe { check_fast(a, 8195, 9, 3) }, Err(8192));
        buf[8194] ^= 1;
        buf[17] ^= 0x80;
        assert_eq!(unsafe { check_fast(a, 8195, 9, 3) }, Err(16));
    }

    #[test]
    fn slow_pattern_and_permutation() {
        let mut buf = vec![0u8; 100];
        let a = buf.as_mut_ptr() as u64;
        unsafe {
            fill_raw(a, 100, 1, 2);
            assert_eq!(check_raw(a, 100, 1, 2), Ok(()));
        }
        buf[50] ^= 1;
        assert_eq!(unsafe { check_raw(a, 100, 1, 2) }, Err(50));
        let mut p = permutation(1000, 5);
        p.sort_unstable();
        assert_eq!(p, (0..1000).collect::<Vec<_>>());
    }
}
