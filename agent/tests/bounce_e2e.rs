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

/// Issue 18 step 3, DATA_UNIFORM: agents that both advertise `uniformData`
/// describe uniform chunks by their blocks' destinations (8 bytes a block
/// instead of 48 a run); an agent with it off gets the seed's DATA from a
/// peer that has it on, and sends the seed's DATA itself. Every transfer
/// lands byte-exact and both arenas quiesce.
#[test]
fn uniform_data_is_used_only_between_agents_that_advertise_it() {
    let on = test_config("8MiB", "1MiB", 4);
    let mut off = on.clone();
    off.uniform_data = false;
    let mut src = Pool::new(1024 * BLOCK);
    let dst = Pool::new(1024 * BLOCK);
    let Some(a) = agent("ud-a", &on, &[&src, &dst]) else {
        return;
    };
    let Some(b) = agent("ud-b", &on, &[&src, &dst]) else {
        return;
    };
    let Some(c) = agent("ud-c", &off, &[&src, &dst]) else {
        return;
    };
    connect(&a, &b);
    connect(&a, &c);
    let stats = |x: &kvfabric_agent::runtime::fabric::FabricAgent| {
        let t = x.transport().unwrap();
        let s = t.stats();
        let o = std::sync::atomic::Ordering::Relaxed;
        (
            s.data_uniform.load(o),
            s.data_wire_bytes.load(o),
            s.chunks_written.load(o),
        )
    };
    let slots = permutation(1024, 11);
    let descs = block_descs(&src, 0, &dst, &slots, BLOCK);
    // (sender, receiver, whether DATA is uniform)
    for (k, (tx, rx, uniform)) in [(&a, &b, true), (&a, &c, false), (&c, &a, false)]
        .into_iter()
        .enumerate()
    {
        let value = 20 + k as u64;
        fill(&mut src, &descs, value);
        let before = stats(tx);
        let (path, h) = tx.submit_write(rx.name(), descs.clone());
        assert_eq!(path, PathKind::Bounce, "{} -> {}", tx.name(), rx.name());
        assert_eq!(
            h.wait(Duration::from_secs(20)),
            Some(TransferOutcome::Success),
            "{} -> {}",
            tx.name(),
            rx.name()
        );
        verify(&dst, &descs, value).unwrap();
        quiesced(tx);
        quiesced(rx);
        let after = stats(tx);
        let chunks = after.2 - before.2;
        let uniform_sent = after.0 - before.0;
        let bytes_per_chunk = (after.1 - before.1) / chunks;
        assert_eq!(chunks, 4, "4 MiB in 1 MiB chunks");
        if uniform {
            assert_eq!(uniform_sent, chunks, "{} -> {}", tx.name(), rx.name());
            // 256 blocks a chunk: 56 bytes of header and fixed fields and
            // 8 a block.
            assert_eq!(bytes_per_chunk, 56 + 256 * 8);
        } else {
            assert_eq!(uniform_sent, 0, "{} -> {}", tx.name(), rx.name());
            // ≈ 160 merged runs of random blocks, 48 bytes each.
            assert!(bytes_per_chunk > 100 * 48, "{bytes_per_chunk} bytes a DATA");
        }
    }
}

/// Issue 18 step 3, DATA_BLOCKS: a block hand-off (8 planes of 128
/// blocks, the same shuffled blocks in every plane, as a layer-major pool
/// lays them out) between agents that both advertise `blockData` is
/// described by its blocks — 8 bytes a block of the plane, not a piece —
/// and lands byte-exact; with an agent that has it off (but takes
/// DATA_UNIFORM) the same hand-off goes as DATA_UNIFORM, both ways. Both
/// arenas quiesce after each.
#[test]
fn block_data_is_used_only_between_agents_that_advertise_it() {
    let on = test_config("8MiB", "1MiB", 4);
    let mut off = on.clone();
    off.block_data = false;
    let mut src = Pool::new(1024 * BLOCK);
    let dst = Pool::new(1024 * BLOCK);
    let Some(a) = agent("bd-a", &on, &[&src, &dst]) else {
        return;
    };
    let Some(b) = agent("bd-b", &on, &[&src, &dst]) else {
        return;
    };
    let Some(c) = agent("bd-c", &off, &[&src, &dst]) else {
        return;
    };
    connect(&a, &b);
    connect(&a, &c);
    let stats = |x: &kvfabric_agent::runtime::fabric::FabricAgent| {
        let t = x.transport().unwrap();
        let s = t.stats();
        let o = std::sync::atomic::Ordering::Relaxed;
        (
            s.data_blocks.load(o),
            s.data_uniform.load(o),
            s.data_wire_bytes.load(o),
            s.chunks_written.load(o),
        )
    };
    let perm = permutation(128, 5);
    let slots: Vec<usize> = (0..8)
        .flat_map(|q| perm.iter().map(move |&p| q * 128 + p))
        .collect();
    let descs = block_descs(&src, 0, &dst, &slots, BLOCK);
    // (sender, receiver, whether DATA names blocks)
    for (k, (tx, rx, blocks)) in [(&a, &b, true), (&a, &c, false), (&c, &a, false)]
        .into_iter()
        .enumerate()
    {
        let value = 40 + k as u64;
        fill(&mut src, &descs, value);
        let before = stats(tx);
        let (path, h) = tx.submit_write(rx.name(), descs.clone());
        assert_eq!(path, PathKind::Bounce, "{} -> {}", tx.name(), rx.name());
        assert_eq!(
            h.wait(Duration::from_secs(20)),
            Some(TransferOutcome::Success),
            "{} -> {}",
            tx.name(),
            rx.name()
        );
        verify(&dst, &descs, value).unwrap();
        quiesced(tx);
        quiesced(rx);
        let after = stats(tx);
        let chunks = after.3 - before.3;
        let (blocks_sent, uniform_sent) = (after.0 - before.0, after.1 - before.1);
        let bytes_per_chunk = (after.2 - before.2) / chunks;
        assert_eq!(chunks, 4, "4 MiB in 1 MiB chunks");
        let what = format!("{} -> {}", tx.name(), rx.name());
        if blocks {
            assert_eq!((blocks_sent, uniform_sent), (chunks, 0), "{what}");
            // Header and 56 bytes of fixed fields, 8 a block of the plane.
            assert_eq!(bytes_per_chunk, 16 + 56 + 128 * 8, "{what}");
        } else {
            assert_eq!((blocks_sent, uniform_sent), (0, chunks), "{what}");
            assert_eq!(bytes_per_chunk, 56 + 256 * 8, "{what}");
        }
    }
}
