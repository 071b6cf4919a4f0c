//! Fuzz `plan::TransferPlan::build` with arbitrary descriptors: never panics,
//! and every successful plan satisfies the packing invariants (aligned,
//! non-overlapping pieces inside `packed_bytes <= max_chunk`; merged runs
//! expand to the unmerged pieces; pieces reconstruct every descriptor).
//!
//! Input: byte 0 selects `max_chunk = 32 << (b0 % 16)` (32 B..1 MiB), byte 1
//! bit 1 adds 8 (a misaligned cap) to exercise the error path, then 24-byte
//! little-endian (src, dst, len) descriptors; `len` is reduced modulo 1 MiB
//! (plans are local input; a multi-GiB descriptor with a 32-byte chunk cap is
//! a legal but memory-hungry request, not a bug), and inputs that could
//! produce more than ~2,000 pieces are skipped to keep executions fast.
#![no_main]

use kvfabric_core::plan::{expand, TransferPlan, ALIGN};
use kvfabric_core::Descriptor;
use libfuzzer_sys::fuzz_target;

fn coalesce(v: impl Iterator<Item = (u64, u64, u64)>) -> Vec<(u64, u64, u64)> {
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for (r, a, l) in v {
        if let Some(last) = out.last_mut() {
            if last.0 + last.2 == r && last.1.checked_add(last.2) == Some(a) {
                last.2 += l;
                continue;
            }
        }
        out.push((r, a, l));
    }
    out
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let mut max = 32u64 << (data[0] % 16);
    if data[1] & 2 != 0 {
        max += 8;
    }
    let descs: Vec<Descriptor> = data[2..]
        .chunks_exact(24)
        .take(4096)
        .map(|c| {
            let f = |i: usize| u64::from_le_bytes(c[i..i + 8].try_into().unwrap());
            Descriptor::new(f(0), f(8), f(16) % (1 << 20))
        })
        .collect();
    // Keep each input fast: bound the number of pieces (≈ chunks for long
    // descriptors) the plan can produce.
    let pieces: u64 = descs.iter().map(|d| d.len / max + 2).sum();
    if pieces > 2_000 {
        return;
    }
    let merged = TransferPlan::build(&descs, max, true);
    let plain = TransferPlan::build(&descs, max, false);
    let (merged, plain) = match (merged, plain) {
        (Ok(m), Ok(p)) => (m, p),
        (Err(a), Err(b)) => {
            assert_eq!(a, b);
            return;
        }
        (a, b) => panic!("merge flag changed the outcome: {a:?} vs {b:?}"),
    };
    assert_eq!(merged.chunk_bytes(), plain.chunk_bytes());
    // Walk pieces of the unmerged plan against the descriptors.
    let mut want = descs
        .iter()
        .filter(|d| d.len > 0)
        .map(|d| (d.src, d.dst, d.len));
    let mut cur: Option<(u64, u64, u64)> = None;
    for (c, m) in plain.chunks().iter().zip(merged.chunks()) {
        assert!(c.packed_bytes > 0 && c.packed_bytes <= max);
        let mut end = 0u64;
        for ((r, dst, l), (r2, src, l2)) in c.scatter_segments().zip(c.gather_segments()) {
            assert_eq!((r, l), (r2, l2));
            assert_eq!(r % ALIGN, 0);
            assert!(r >= end && l > 0);
            end = r + l;
            let (s, d, left) = match cur.take() {
                Some(x) => x,
                None => want.next().expect("piece without descriptor"),
            };
            assert_eq!((s, d), (src, dst));
            assert!(l <= left);
            if l < left {
                cur = Some((s + l, d + l, left - l));
            }
        }
        assert_eq!(end, c.packed_bytes);
        assert_eq!(
            coalesce(c.scatter_segments()),
            coalesce(m.scatter_segments())
        );
        assert_eq!(
            coalesce(c.gather_segments()),
            coalesce(expand(&m.gather_runs))
        );
        assert!(m.scatter_runs.len() <= c.scatter_runs.len());
    }
    assert!(cur.is_none() && want.next().is_none());
});
