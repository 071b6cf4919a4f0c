//! Bounce end to end over real NIXL (UCX loopback) with host memory: every
//! transfer verified byte-exact with a pattern distinct per transfer.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvfabric_agent::runtime::fabric::PathKind;
use kvfabric_agent::runtime::transport::TransferOutcome;

const BLOCK: usize = 4096;

fn quiesced(agent: &kvfabric_agent::runtime::fabric::FabricAgent) {
    let t = agent.transport().expect("bounce up");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = t.snapshot().expect("snapshot");
        assert_eq!(s.conservation, Ok(()), "conservation on {}", agent.name());
        if s.free_bytes == s.capacity && s.flows == 0 && s.send_orphans == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{}: arena not free at quiesce: {s:?}",
            agent.name()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn one_transfer_lands_byte_exact() {
    let cfg = test_config("8MiB", "1MiB", 4);
    let mut src = Pool::new(1024 * BLOCK);
    let dst = Pool::new(1024 * BLOCK);
    let Some(tx) = agent("snd", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("rcv", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    assert!(tx.has_peer_handshake(rx.name()));
    let slots = permutation(1024, 7);
    let descs = block_descs(&src, 0, &dst, &slots, BLOCK);
    fill(&mut src, &descs, 1);
    let (path, h) = tx.submit_write(rx.name(), descs.clone());
    assert_eq!(path, PathKind::Bounce);
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(&dst, &descs, 1).unwrap();
    quiesced(&tx);
    quiesced(&rx);
    assert_eq!(
        tx.transport()
            .unwrap()
            .stats()
            .succeeded
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // Transport report: made once PROBE_CHUNKS chunk writes to the peer
    // landed (4 MiB in 1 MiB chunks = 4 writes); host → host is never
    // flagged as a GPU fallback.
    let r = tx
        .transport()
        .unwrap()
        .transport_report(rx.name())
        .expect("transport report after 4 chunk writes");
    assert_eq!(r.chunks, kvfabric_agent::runtime::transport::PROBE_CHUNKS);
    let total: u64 = descs.iter().map(|d| d.len).sum();
    assert_eq!(r.bytes, total);
    assert!(r.best_chunk_mbps > 0 && r.best_chunk_bytes > 0);
    assert_eq!(
        (r.local_kind.as_str(), r.remote_kind.as_str()),
        ("Dram", "Dram")
    );
    assert!(!r.suspect_fallback);
    assert!(tx.transport().unwrap().transport_report("nobody").is_none());
    // Forgetting the peer drops its report (a new incarnation gets its own).
    tx.forget_peer(rx.name());
    assert!(tx
        .transport()
        .unwrap()
        .transport_report(rx.name())
        .is_none());
}

#[test]
fn request_sixteen_times_the_arena_streams_within_w_regions() {
    // Arena 2 MiB, chunk 128 KiB, W = 2: a 32 MiB request (16x the arena).
    let cfg = test_config("2MiB", "128KiB", 2);
    let n = 8192; // 8192 x 4 KiB = 32 MiB
    let mut src = Pool::new(n * BLOCK);
    let dst = Pool::new(n * BLOCK);
    let Some(tx) = agent("snd", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("rcv", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    let slots = permutation(n, 11);
    let descs = block_descs(&src, 0, &dst, &slots, BLOCK);
    fill(&mut src, &descs, 2);
    let (_, h) = tx.submit_write(rx.name(), descs.clone());
    let limit = 2 * 128 * 1024; // W regions of one chunk each
    let mut max_rx = 0;
    let mut max_tx = 0;
    let outcome = loop {
        if let Some(o) = h.wait(Duration::from_millis(1)) {
            break o;
        }
        let r = rx.transport().unwrap().snapshot().unwrap();
        let t = tx.transport().unwrap().snapshot().unwrap();
        max_rx = max_rx.max(r.held_bytes);
        max_tx = max_tx.max(t.local_held_bytes);
    };
    assert_eq!(outcome, TransferOutcome::Success);
    verify(&dst, &descs, 2).unwrap();
    assert!(
        max_rx <= limit,
        "receiver held {max_rx} > W regions ({limit})"
    );
    assert!(
        max_tx <= limit,
        "sender staged {max_tx} > W regions ({limit})"
    );
    assert!(max_rx > 0, "sampling saw the receiver hold regions");
    quiesced(&tx);
    quiesced(&rx);
}
