//! Bounce under concurrency over real NIXL (UCX loopback), host memory:
//! bidirectional traffic from many threads through one shared arena per
//! agent, the same over arenas of two max-size chunks (eager staging must
//! leave a grantable block), many senders into one receiver (fairness),
//! and the handshake
//! mismatch that must keep a peer on the standard path. Every transfer is
//! verified byte-exact with a pattern distinct per transfer, and every
//! agent is checked quiesced (arena all free, no flows, no orphans,
//! conservation) at the end. Every wait is bounded.

mod common;

use std::sync::Barrier;
use std::time::{Duration, Instant};

use common::*;
use kvfabric_agent::core::scheduler::GrantPolicy;
use kvfabric_agent::core::Descriptor;
use kvfabric_agent::runtime::fabric::{FabricAgent, Incompatibility, PathKind};
use kvfabric_agent::runtime::transport::TransferOutcome;

const BLOCK: usize = 4096;

/// Bound on any single transfer in these tests (a deadlock shows up as a
/// failure after this long, never as a hung test).
const TRANSFER_BOUND: Duration = Duration::from_secs(30);

fn snapshots(agents: &[&FabricAgent]) -> String {
    agents
        .iter()
        .map(|a| {
            format!(
                "{}: {:?}",
                a.name(),
                a.transport().and_then(|t| t.snapshot())
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// One transfer of the bidirectional test.
struct Job {
    seed: u64,
    descs: Vec<Descriptor>,
}

#[test]
fn bidirectional_eight_threads_each_way_share_one_arena() {
    const THREADS: usize = 8;
    const PER_THREAD: usize = 4;
    const BLOCKS: usize = 256; // 1 MiB per transfer
    const SLOTS: usize = THREADS * PER_THREAD * BLOCKS; // 32 MiB per direction
                                                        // A small shared arena (16 regions of 256 KiB) serving both roles:
                                                        // 32 flows in each direction contend for it.
    init_tracing();
    let cfg = test_config("4MiB", "256KiB", 4);
    let mut a_src = Pool::new(SLOTS * BLOCK);
    let a_dst = Pool::new(SLOTS * BLOCK);
    let mut b_src = Pool::new(SLOTS * BLOCK);
    let b_dst = Pool::new(SLOTS * BLOCK);
    let Some(a) = agent("bidi-a", &cfg, &[&a_src, &a_dst]) else {
        return;
    };
    let Some(b) = agent("bidi-b", &cfg, &[&b_src, &b_dst]) else {
        return;
    };
    connect(&a, &b);
    assert!(a.has_peer_handshake(b.name()) && b.has_peer_handshake(a.name()));

    // jobs[dir][thread][k]; dir 0 = a→b, 1 = b→a. Disjoint src and dst
    // slots per transfer, destinations randomly permuted.
    let mut jobs: Vec<Vec<Vec<Job>>> = Vec::new();
    for dir in 0..2 {
        let perm = permutation(SLOTS, 101 + dir as u64);
        let mut per_dir = Vec::new();
        for t in 0..THREADS {
            let mut per_thread = Vec::new();
            for k in 0..PER_THREAD {
                let first = (t * PER_THREAD + k) * BLOCKS;
                let seed = 10_000 + (dir * 1000 + t * PER_THREAD + k) as u64;
                let (src, dst) = if dir == 0 {
                    (&a_src, &b_dst)
                } else {
                    (&b_src, &a_dst)
                };
                let descs = block_descs(src, first, dst, &perm[first..first + BLOCKS], BLOCK);
                per_thread.push(Job { seed, descs });
            }
            per_dir.push(per_thread);
        }
        jobs.push(per_dir);
    }
    for (dir, per_dir) in jobs.iter().enumerate() {
        let src = if dir == 0 { &mut a_src } else { &mut b_src };
        for job in per_dir.iter().flatten() {
            fill(src, &job.descs, job.seed);
        }
    }

    let barrier = Barrier::new(2 * THREADS);
    let t0 = Instant::now();
    let results: Vec<(usize, usize, usize, Option<TransferOutcome>)> = std::thread::scope(|s| {
        let mut threads = Vec::new();
        for (dir, per_dir) in jobs.iter().enumerate() {
            let (from, to) = if dir == 0 { (&a, &b) } else { (&b, &a) };
            for (t, per_thread) in per_dir.iter().enumerate() {
                let barrier = &barrier;
                threads.push(s.spawn(move || {
                    barrier.wait();
                    let handles: Vec<_> = per_thread
                        .iter()
                        .map(|job| {
                            let (path, h) = from.submit_write(to.name(), job.descs.clone());
                            assert_eq!(path, PathKind::Bounce);
                            h
                        })
                        .collect();
                    let deadline = Instant::now() + TRANSFER_BOUND;
                    handles
                        .iter()
                        .enumerate()
                        .map(|(k, h)| {
                            let left = deadline.saturating_duration_since(Instant::now());
                            (dir, t, k, h.wait(left))
                        })
                        .collect::<Vec<_>>()
                }));
            }
        }
        threads
            .into_iter()
            .flat_map(|h| h.join().expect("submit thread"))
            .collect()
    });
    let elapsed = t0.elapsed();
    println!(
        "bidirectional: {} transfers ({} MiB each way) in {elapsed:?}",
        results.len(),
        (SLOTS * BLOCK) >> 20
    );
    for (dir, t, k, outcome) in &results {
        assert_eq!(
            outcome.as_ref(),
            Some(&TransferOutcome::Success),
            "dir {dir} thread {t} transfer {k} (None = no outcome within {TRANSFER_BOUND:?}, \
             deadlock?)\n{}",
            snapshots(&[&a, &b])
        );
    }
    assert_eq!(results.len(), 2 * THREADS * PER_THREAD);
    for (dir, per_dir) in jobs.iter().enumerate() {
        let dst = if dir == 0 { &b_dst } else { &a_dst };
        for (t, job) in per_dir.iter().flatten().enumerate() {
            verify(dst, &job.descs, job.seed)
                .unwrap_or_else(|e| panic!("dir {dir} transfer {t}: {e}"));
        }
    }
    for x in [&a, &b] {
        let st = tstats(x);
        assert_eq!(
            get(&st.succeeded),
            (THREADS * PER_THREAD) as u64,
            "{}",
            x.name()
        );
        assert_eq!(get(&st.failed), 0, "{}", x.name());
        assert!(get(&st.grants) > 0, "{} served as receiver too", x.name());
    }
    assert_quiesced(&a, Duration::from_secs(5));
    assert_quiesced(&b, Duration::from_secs(5));
}

#[test]
fn many_senders_into_one_receiver_complete_fairly() {
    let Some(done) = fan_in(GrantPolicy::RoundRobin) else {
        return;
    };
    let max = done.iter().cloned().fold(f64::MIN, f64::max);
    let min = done.iter().cloned().fold(f64::MAX, f64::min);
    let spread = max / min;
    // Served one after another, the first of 4 equal senders would finish
    // at ~1/4 of the total (spread ≈ 4). Round-robin grants keep them
    // finishing together; 2.5 leaves room for a noisy 2-core machine while
    // still failing a FIFO receiver.
    assert!(
        spread <= 2.5,
        "completion spread {spread:.2} (times {done:?}): senders were not served fairly"
    );
}

/// The receiver's `oldestFirst` and `shortestFirst` grant policies
/// through the agents: every sender's bytes land exactly, every region and
/// credit comes back (completion order is the policy's business, not
/// asserted).
#[test]
fn many_senders_into_one_receiver_under_oldest_and_shortest_first() {
    let _ = fan_in(GrantPolicy::OldestFirst);
    let _ = fan_in(GrantPolicy::ShortestFirst);
}

/// Four senders of 8 MiB each into one receiver whose arena holds half
/// their windows, granted under `policy`: asserts every hand-off
/// succeeded byte-exact, every chunk scattered and all agents quiesced;
/// returns each sender's completion time (s from the first submit), or
/// `None` when the NIXL runtime is not installed.
fn fan_in(policy: GrantPolicy) -> Option<Vec<f64>> {
    const SENDERS: usize = 4;
    // 8 MiB per sender.
    const BLOCKS: usize = 2048;
    // The receiver's arena holds 8 regions of 128 KiB while the senders
    // want 4 × W = 16: grants are contended and handed out by `policy`.
    let mut cfg = test_config("1MiB", "128KiB", 4);
    cfg.grant_policy = policy;
    let dst = Pool::new(SENDERS * BLOCKS * BLOCK);
    let mut srcs: Vec<Pool> = (0..SENDERS).map(|_| Pool::new(BLOCKS * BLOCK)).collect();
    let rx = agent("fan-rx", &cfg, &[&dst])?;
    let mut txs = Vec::new();
    for (i, src) in srcs.iter().enumerate() {
        let tx = agent(&format!("fan-tx{i}"), &cfg, &[src])?;
        connect(&tx, &rx);
        txs.push(tx);
    }
    let perm = permutation(SENDERS * BLOCKS, 303);
    let descs: Vec<Vec<Descriptor>> = (0..SENDERS)
        .map(|i| {
            block_descs(
                &srcs[i],
                0,
                &dst,
                &perm[i * BLOCKS..(i + 1) * BLOCKS],
                BLOCK,
            )
        })
        .collect();
    for (i, src) in srcs.iter_mut().enumerate() {
        fill(src, &descs[i], 500 + i as u64);
    }

    let barrier = Barrier::new(SENDERS);
    let results: Vec<(Instant, Instant, Option<TransferOutcome>)> = std::thread::scope(|s| {
        let threads: Vec<_> = txs
            .iter()
            .zip(&descs)
            .map(|(tx, d)| {
                let (barrier, rx) = (&barrier, &rx);
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    let (path, h) = tx.submit_write(rx.name(), d.clone());
                    assert_eq!(path, PathKind::Bounce);
                    let outcome = h.wait(TRANSFER_BOUND);
                    (start, Instant::now(), outcome)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("sender thread"))
            .collect()
    });
    for (i, (_, _, o)) in results.iter().enumerate() {
        assert_eq!(
            o.as_ref(),
            Some(&TransferOutcome::Success),
            "sender {i}\n{}",
            snapshots(&[&rx])
        );
    }
    // Completion times from the first submission.
    let t0 = results.iter().map(|r| r.0).min().expect("senders");
    let done: Vec<f64> = results.iter().map(|r| (r.1 - t0).as_secs_f64()).collect();
    println!(
        "many senders ({policy:?}): completion times (s) {:?}",
        done.iter().map(|d| format!("{d:.3}")).collect::<Vec<_>>()
    );
    for (i, d) in descs.iter().enumerate() {
        verify(&dst, d, 500 + i as u64).unwrap_or_else(|e| panic!("sender {i}: {e}"));
    }
    assert_eq!(
        get(&tstats(&rx).chunks_scattered),
        (SENDERS * BLOCKS * BLOCK / (128 << 10)) as u64
    );
    assert_quiesced(&rx, Duration::from_secs(5));
    for tx in &txs {
        assert_quiesced(tx, Duration::from_secs(5));
    }
    Some(done)
}

/// A sender whose peer fails the handshake: `load_peer` reports why, the
/// gate picks the standard path, the bytes still land, and the receiver
/// never sees a WANT.
fn mismatch_uses_standard_path(
    rx_overrides: &[(&str, &str)],
    expect: impl Fn(&Incompatibility) -> bool,
) {
    let cfg = test_config("4MiB", "256KiB", 4);
    let rx_cfg = config_with("4MiB", "256KiB", 4, rx_overrides);
    let mut src = Pool::new(1024 * BLOCK);
    let dst = Pool::new(1024 * BLOCK);
    let Some(tx) = agent("hs-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("hs-rx", &rx_cfg, &[&dst]) else {
        return;
    };
    assert!(
        rx.transport().is_some(),
        "receiver runs bounce: {:?}",
        rx.bounce_unavailable()
    );
    let state = tx.load_peer(&rx.local_descriptor().unwrap()).unwrap();
    let why = state.bounce.expect_err("peer must be incompatible");
    assert!(expect(&why), "unexpected incompatibility {why:?}");
    let back = rx.load_peer(&tx.local_descriptor().unwrap()).unwrap();
    assert!(
        back.bounce.is_err(),
        "mismatch is symmetric: {:?}",
        back.bounce
    );
    assert!(!tx.has_peer_handshake(rx.name()));

    let slots = permutation(1024, 17);
    let descs = block_descs(&src, 0, &dst, &slots, BLOCK);
    fill(&mut src, &descs, 77);
    assert!(!tx.should_use_bounce(
        rx.name(),
        &descs,
        kvfabric_agent::runtime::engine::MemKind::Dram,
        kvfabric_agent::runtime::engine::MemKind::Dram
    ));
    let t0 = Instant::now();
    let (path, h) = tx.submit_write(rx.name(), descs.clone());
    assert_eq!(path, PathKind::Standard);
    assert_eq!(h.wait(TRANSFER_BOUND), Some(TransferOutcome::Success));
    println!("standard path (peer {why:?}): {:?}", t0.elapsed());
    verify(&dst, &descs, 77).unwrap();
    // Nothing went through bounce, on either side.
    let (ts, rs) = (tstats(&tx), tstats(&rx));
    assert_eq!(get(&ts.submitted), 0);
    assert_eq!(get(&tx.stats().submit_bounce), 0);
    assert_eq!(get(&tx.stats().submit_standard), 1);
    // Give a stray WANT time to arrive before concluding none was sent.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(get(&rs.grants), 0, "receiver granted: a WANT was sent");
    assert_eq!(
        get(&rs.wants_rejected),
        0,
        "receiver rejected a WANT: one was sent"
    );
    assert_eq!(get(&rs.cancels_received), 0);
    assert_eq!(get(&rs.data_rejected), 0);
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));
}

#[test]
fn handshake_max_chunk_mismatch_uses_standard_path_and_sends_no_want() {
    mismatch_uses_standard_path(&[("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", "128KiB")], |w| {
        matches!(
            w,
            Incompatibility::MaxChunk {
                local: 262_144,
                peer: 131_072
            }
        )
    });
}

#[test]
fn handshake_control_kind_mismatch_uses_standard_path_and_sends_no_want() {
    mismatch_uses_standard_path(&[("KVFABRIC_BOUNCE_USE_NIXL_NOTIFICATIONS", "1")], |w| {
        matches!(w, Incompatibility::ControlKind { .. })
    });
}

/// Blocks per pool of the small-arena test.
const SMALL_SLOTS: usize = 1024;

/// Two agents sending to each other over arenas of a few max-size chunks,
/// eager staging on: each side's eager gathers must leave a grantable
/// block beside the reserve, or both hold all but the reserve and grant
/// nothing until the request timeout (the protocol simulator's bug 3,
/// docs/protocol.md, ported to the runtime).
#[test]
fn small_arenas_both_ways_never_wait_for_the_timeout() {
    let cfg = config_with(
        "2MiB",
        "1MiB",
        4,
        &[("KVFABRIC_BOUNCE_REQUEST_TIMEOUT_MS", "60000")],
    );
    let mut a_pool = Pool::new(SMALL_SLOTS * BLOCK);
    let mut b_pool = Pool::new(SMALL_SLOTS * BLOCK);
    let Some(a) = agent("small-a", &cfg, &[&a_pool]) else {
        return;
    };
    let Some(b) = agent("small-b", &cfg, &[&b_pool]) else {
        return;
    };
    connect(&a, &b);
    // A deadlock would hold both requests until their 60 s timeout: each
    // must resolve within 30 s.
    for round in 0..5u64 {
        // 4 MiB each way at once: 4 chunks per request into arenas of two
        // max-size blocks (with the old rule both sides stage one chunk
        // eagerly, keep the other block as the reserve and grant nothing).
        let half = SMALL_SLOTS / 2;
        let slots_ab: Vec<usize> = permutation(half, round + 10)
            .into_iter()
            .map(|s| s + half)
            .collect();
        let slots_ba: Vec<usize> = permutation(half, round + 20)
            .into_iter()
            .map(|s| s + half)
            .collect();
        let d_ab = block_descs(&a_pool, 0, &b_pool, &slots_ab, BLOCK);
        let d_ba = block_descs(&b_pool, 0, &a_pool, &slots_ba, BLOCK);
        fill(&mut a_pool, &d_ab, round + 100);
        fill(&mut b_pool, &d_ba, round + 200);
        let (pa, ha) = a.submit_write(b.name(), d_ab.clone());
        let (pb, hb) = b.submit_write(a.name(), d_ba.clone());
        assert_eq!((pa, pb), (PathKind::Bounce, PathKind::Bounce));
        assert_eq!(ha.wait(TRANSFER_BOUND), Some(TransferOutcome::Success));
        assert_eq!(hb.wait(TRANSFER_BOUND), Some(TransferOutcome::Success));
        verify(&b_pool, &d_ab, round + 100).unwrap();
        verify(&a_pool, &d_ba, round + 200).unwrap();
    }
    assert_quiesced(&a, Duration::from_secs(5));
    assert_quiesced(&b, Duration::from_secs(5));
}
