//! The experiment switch `KVFABRIC_SOLO_CHUNK_BYTES` (issue 18) over real
//! NIXL (UCX loopback), host memory: a request submitted while its
//! transport has nothing else in flight is cut into chunks of the solo
//! size, one submitted beside another into max-size chunks; every byte
//! lands, the arenas are free at quiesce, and the count of requests in
//! flight comes back to zero (the next lone request is cut small again).
//!
//! Its own test binary: the switch is read from the process environment
//! when a transport starts, so it is set once here before any agent
//! exists, with no other test in the process to race with.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use kvfabric_agent::runtime::fabric::{FabricAgent, PathKind};
use kvfabric_agent::runtime::transport::TransferOutcome;

const BLOCK: usize = 4096;

/// Waits (at most 5 s) until `tx` has written `n` chunks; returns the count.
fn chunks_written(tx: &FabricAgent, n: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let w = tx
            .transport()
            .unwrap()
            .stats()
            .chunks_written
            .load(Ordering::Relaxed);
        if w >= n || Instant::now() >= deadline {
            return w;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_lone_request_is_cut_into_solo_chunks_and_one_beside_another_into_max_chunks() {
    // SAFETY (edition 2021: safe fn): no other thread of this process
    // reads the environment yet.
    std::env::set_var("KVFABRIC_SOLO_CHUNK_BYTES", "256KiB");
    let cfg = test_config("8MiB", "1MiB", 4);
    let n = 1024; // 1024 x 4 KiB = 4 MiB a request
    let mut src = Pool::new(3 * n * BLOCK);
    let dst = Pool::new(3 * n * BLOCK);
    let Some(tx) = agent("snd", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("rcv", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    let descs: Vec<_> = (0..3)
        .map(|k| {
            let slots: Vec<usize> = permutation(n, 5 + k as u64)
                .into_iter()
                .map(|s| s + k * n)
                .collect();
            let d = block_descs(&src, k * n, &dst, &slots, BLOCK);
            fill(&mut src, &d, 10 + k as u64);
            d
        })
        .collect();
    let wait = |h: kvfabric_agent::runtime::transport::TransferHandle| {
        assert_eq!(
            h.wait(Duration::from_secs(20)),
            Some(TransferOutcome::Success)
        );
    };
    // Alone: 4 MiB in 256 KiB chunks.
    let (path, h) = tx.submit_write(rx.name(), descs[0].clone());
    assert_eq!(path, PathKind::Bounce);
    wait(h);
    assert_eq!(
        chunks_written(&tx, 16),
        16,
        "a lone request: 16 solo chunks"
    );
    // Two at once: the first alone (16 solo chunks), the second beside it
    // (4 chunks of 1 MiB) — certainly when the first was still in flight
    // after the second's submit returned; if it had resolved by then, the
    // second went beside it or alone (4 or 16 chunks).
    let (_, h1) = tx.submit_write(rx.name(), descs[1].clone());
    let (_, h2) = tx.submit_write(rx.name(), descs[2].clone());
    let beside = h1.try_outcome().is_none();
    wait(h1);
    wait(h2);
    let w = chunks_written(&tx, 36);
    if beside {
        assert_eq!(
            w, 36,
            "16 solo chunks, then 16 + 4 (the second beside the first)"
        );
    } else {
        println!("the first request resolved around the second's submit");
        assert!(w == 36 || w == 48, "{w} chunks: not 16 + 16 + 4 or 16 × 3");
    }
    for (k, d) in descs.iter().enumerate() {
        verify(&dst, d, 10 + k as u64).unwrap();
    }
    // Both resolved: the next lone request is cut small again.
    let (_, h) = tx.submit_write(rx.name(), descs[0].clone());
    wait(h);
    assert_eq!(
        chunks_written(&tx, w + 16),
        w + 16,
        "the in-flight count came back to 0"
    );
    verify(&dst, &descs[0], 10).unwrap();
    for a in [&tx, &rx] {
        let t = a.transport().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let s = t.snapshot().expect("snapshot");
            if s.free_bytes == s.capacity && s.flows == 0 && s.send_orphans == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "arena not free at quiesce: {s:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
