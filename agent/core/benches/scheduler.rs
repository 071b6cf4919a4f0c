//! Criterion benchmarks of the credit scheduler and the buddy allocator
//! (issue 2 "Must show": `schedule()` with 10,000 active flows, grants per
//! second).
//!
//! * `schedule/burst_10k_flows`: one `schedule()` call over 10,000 fresh
//!   flows (4 chunks each, W=4, room for all): 40,000 grants in one call.
//! * `schedule/steady_10k_flows_at_cap`: 10,000 flows all at their cap W;
//!   each event completes the oldest region and re-schedules (1 grant).
//! * `schedule/steady_10k_flows_backpressure`: 10,000 flows, arena room for
//!   4,096 regions; each event completes one region and re-schedules. The
//!   final sweep of each `schedule()` visits every blocked flow (seed §5
//!   design: O(ring) per event under backpressure).
//! * `buddy/alloc_free_10k`: 10,000 random-size allocations (4 KiB..1 MiB)
//!   then 10,000 frees, in a 4 GiB arena with 4 KiB granularity.
//!
//! Throughput is reported as elements = grants (schedule) or operations
//! (buddy) per second. Run: `cargo bench -p kvfabric-core --bench scheduler`.

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvfabric_core::buddy::BuddyAllocator;
use kvfabric_core::scheduler::{CreditScheduler, Grant};
use kvfabric_core::FlowKey;
use std::collections::VecDeque;
use std::time::Duration;

const FLOWS: u64 = 10_000;
const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;

fn keys() -> Vec<FlowKey> {
    (0..FLOWS)
        .map(|i| FlowKey::new(format!("peer-{}", i % 64), i))
        .collect()
}

fn burst(c: &mut Criterion) {
    let mut g = c.benchmark_group("schedule");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_secs(1))
        .sample_size(10);
    let keys = keys();
    g.throughput(Throughput::Elements(FLOWS * 4));
    g.bench_function("burst_10k_flows", |b| {
        b.iter_batched(
            || {
                let mut s = CreditScheduler::new(256 * MIB, 4 * KIB, 4).unwrap();
                for k in &keys {
                    s.on_want(k.clone(), &[4 * KIB; 4]).unwrap();
                }
                s
            },
            |mut s| {
                let grants = s.schedule();
                assert_eq!(grants.len() as u64, FLOWS * 4);
                (s, grants)
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

/// A scheduler with 10,000 flows and its outstanding grants (FIFO).
struct Steady {
    s: CreditScheduler,
    inflight: VecDeque<Grant>,
}

impl Steady {
    fn new(keys: &[FlowKey], arena: u64, w: usize) -> Self {
        let mut s = CreditScheduler::new(arena, 4 * KIB, w).unwrap();
        for k in keys {
            s.on_want(k.clone(), &[4 * KIB; 64]).unwrap();
        }
        let inflight = s.schedule().into();
        Self { s, inflight }
    }

    /// One event: the oldest region's scatter completes, then schedule().
    fn step(&mut self) -> usize {
        let g = self.inflight.pop_front().expect("regions in flight");
        self.s.begin_scatter(&g.flow, g.region_offset).unwrap();
        self.s.scatter_done(g.region_offset).unwrap();
        if self.s.pending_count(&g.flow) < 2 {
            self.s.on_want(g.flow.clone(), &[4 * KIB; 64]).unwrap();
        }
        let new = self.s.schedule();
        let n = new.len();
        self.inflight.extend(new);
        n
    }
}

fn steady(c: &mut Criterion) {
    let mut g = c.benchmark_group("schedule");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_secs(1))
        .sample_size(10);
    let keys = keys();
    g.throughput(Throughput::Elements(1));

    // W=2, arena 128 MiB / 4 KiB = 32,768 regions >= 20,000: cap-bound.
    let mut at_cap = Steady::new(&keys, 128 * MIB, 2);
    assert_eq!(at_cap.inflight.len() as u64, 2 * FLOWS);
    g.bench_function("steady_10k_flows_at_cap", |b| {
        b.iter(|| black_box(at_cap.step()))
    });

    // W=2, arena 16 MiB / 4 KiB = 4,096 regions < 20,000: arena-bound.
    let mut bp = Steady::new(&keys, 16 * MIB, 2);
    assert_eq!(bp.inflight.len(), 4096);
    g.bench_function("steady_10k_flows_backpressure", |b| {
        b.iter(|| black_box(bp.step()))
    });
    g.finish();
}

fn buddy(c: &mut Criterion) {
    let mut g = c.benchmark_group("buddy");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_secs(1))
        .sample_size(20);
    // Deterministic sizes 4 KiB ..= 1 MiB, skewed small.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let sizes: Vec<u64> = (0..10_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let shift = x % 9; // 4 KiB << 0..=8
            ((4 * KIB) << shift) - (x >> 40) % (2 * KIB)
        })
        .collect();
    let mut b = BuddyAllocator::new(4 * GIB, 4 * KIB).unwrap();
    let mut offs = Vec::with_capacity(sizes.len());
    g.throughput(Throughput::Elements(2 * sizes.len() as u64));
    g.bench_function("alloc_free_10k", |bench| {
        bench.iter(|| {
            offs.clear();
            for &s in &sizes {
                if let Some(o) = b.alloc(s) {
                    offs.push(o);
                }
            }
            // Free in an interleaved order (evens, then odds) to exercise
            // partial coalescing.
            for o in offs.iter().step_by(2).chain(offs.iter().skip(1).step_by(2)) {
                black_box(b.free(*o).unwrap());
            }
        })
    });
    assert_eq!(b.free_bytes(), b.capacity());
    g.finish();
}

criterion_group!(benches, burst, steady, buddy);
criterion_main!(benches);
