//! Criterion benchmark of the sans-IO protocol machine alone under a
//! closed loop (issue 18: is the machine's own work per chunk flat in the
//! number of requests in flight?).
//!
//! A sender and a receiver [`Machine`] exchange messages through one FIFO
//! event queue; every gather, write and scatter completes as soon as the
//! queue reaches it (no device, no sockets, no clock: `now` advances 1 µs
//! per event). `C` requests are kept in flight until `REQUESTS` have
//! resolved. Geometry as the GPU bench's seed-shaped load with the seed's
//! sizes: 151 MB requests
//! (36,900 × 4 KiB descriptors) in 32 MiB chunks, arena 256 MiB with 1 MiB
//! granularity, W = 8, 8 copy contexts, uniform DATA (8 bytes a piece).
//!
//! Throughput is reported as elements = requests per second of machine
//! work (both machines on one thread), which includes copying each
//! chunk's 8,192-entry destination list as a gather's output (the same at
//! every concurrency). A machine whose per-event work grows
//! with the requests in flight shows as a lower rate at `c128` than `c8`.
//!
//! Run: `cargo bench -p kvfabric-core --bench protocol_pair`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvfabric_core::plan::ChunkBound;
use kvfabric_core::protocol::{Action, Input, Machine, Outcome, Route};
use kvfabric_core::scheduler::GrantPolicy;

#[path = "common/pair.rs"]
mod pair;
use kvfabric_core::{ScatterList, UniformScatter};
use pair::{bounds, config, PIECE};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Requests resolved per measured iteration.
const REQUESTS: u64 = 1024;
/// Descriptors per request (gpt-oss-120b, TP 4, 8,192 tokens: 151 MB).
const PIECES: u64 = 36_900;

/// Something the queue delivers to machine `to_receiver` (false: sender).
struct Pending {
    to_receiver: bool,
    input: Input,
}

/// Submits request `rid` of `chunks` from `tx` to "rx".
fn submit(tx: &mut Machine, now: u64, rid: u64, chunks: &[ChunkBound]) {
    tx.handle(
        now,
        Input::Submit {
            rid,
            peer: "rx".into(),
            scope: 0,
            chunks: chunks.to_vec(),
        },
    );
}

/// Runs `requests` requests at `concurrency` in flight; returns the
/// wall time of the machine work.
fn closed_loop(concurrency: u64, requests: u64, policy: GrantPolicy) -> Duration {
    let mut tx = Machine::new(config("tx", policy, 10_000_000_000)).unwrap();
    let mut rx = Machine::new(config("rx", policy, 10_000_000_000)).unwrap();
    rx.handle(
        0,
        Input::AllowScatter {
            addr: 0x1000_0000_0000,
            len: 1 << 40,
        },
    );
    tx.handle(0, Input::PeerAdded { peer: "rx".into() });
    let chunks = bounds(PIECES);
    // Each chunk's destinations, made once (a gather's output is a copy).
    let dsts_by_chunk: Vec<Vec<u64>> = chunks
        .iter()
        .map(|b| {
            (0..b.pieces)
                .map(|i| 0x1000_0000_0000 + (b.first_desc as u64 + i) * PIECE)
                .collect()
        })
        .collect();
    let mut queue: VecDeque<Pending> = VecDeque::new();
    let (mut next_rid, mut resolved, mut now) = (1u64, 0u64, 1u64);
    let start = Instant::now();
    for _ in 0..concurrency.min(requests) {
        submit(&mut tx, now, next_rid, &chunks);
        next_rid += 1;
    }
    loop {
        for (is_rx, m) in [(false, &mut tx), (true, &mut rx)] {
            while let Some(act) = m.poll_action() {
                match act {
                    Action::Send { msg, .. } => queue.push_back(Pending {
                        to_receiver: !is_rx,
                        input: Input::Message {
                            from: if is_rx { "rx" } else { "tx" }.into(),
                            msg,
                            route: Route::Usable,
                        },
                    }),
                    Action::StartGather { job, bound, .. } => {
                        let dsts = dsts_by_chunk[bound.index as usize].clone();
                        queue.push_back(Pending {
                            to_receiver: is_rx,
                            input: Input::GatherDone {
                                job,
                                result: Ok(ScatterList::Uniform(UniformScatter {
                                    segment_len: PIECE,
                                    region_stride: PIECE,
                                    dsts,
                                })),
                            },
                        })
                    }
                    Action::PostWrite { write, .. } => queue.push_back(Pending {
                        to_receiver: is_rx,
                        input: Input::WriteDone {
                            write,
                            result: Ok(()),
                        },
                    }),
                    Action::StartScatter { job, .. } => queue.push_back(Pending {
                        to_receiver: is_rx,
                        input: Input::ScatterDone {
                            job,
                            result: Ok(()),
                        },
                    }),
                    Action::Resolve { outcome, .. } => {
                        assert_eq!(outcome, Outcome::Success);
                        resolved += 1;
                        if next_rid <= requests {
                            submit(m, now, next_rid, &chunks);
                            next_rid += 1;
                        }
                    }
                    _ => {}
                }
            }
        }
        let Some(p) = queue.pop_front() else { break };
        now += 1_000;
        if p.to_receiver {
            rx.handle(now, p.input);
        } else {
            tx.handle(now, p.input);
        }
    }
    let took = start.elapsed();
    assert_eq!(resolved, requests);
    took
}

fn pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("protocol_pair");
    g.measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
        .sample_size(10)
        .throughput(Throughput::Elements(REQUESTS));
    for policy in [
        GrantPolicy::RoundRobin,
        GrantPolicy::OldestFirst,
        GrantPolicy::ShortestFirst,
    ] {
        for conc in [1u64, 8, 32, 128] {
            let name = format!("{policy:?}/c{conc}");
            g.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| closed_loop(conc, REQUESTS, policy))
                        .sum()
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, pair);
criterion_main!(benches);
