//! Bounce failure handling over real NIXL (UCX loopback), host memory —
//! seed §9: every request reaches a terminal state within its bound, no
//! region leaks (arena all free at quiesce, conservation at every sample),
//! and nothing is ever scattered that should not be. Every wait is bounded.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvfabric_agent::core::wire::{self, Data, Message, Want};
use kvfabric_agent::core::{Descriptor, ScatterRun};
use kvfabric_agent::runtime::fabric::{FabricAgent, PathKind};
use kvfabric_agent::runtime::transport::{ArenaSnapshot, FaultPlan, TransferOutcome};

const BLOCK: usize = 4096;

fn is_failure(o: &Option<TransferOutcome>) -> bool {
    matches!(o, Some(TransferOutcome::Failure(_)))
}

fn snap(a: &FabricAgent) -> ArenaSnapshot {
    a.transport()
        .expect("bounce up")
        .snapshot()
        .expect("snapshot")
}

fn all_bytes(pool: &Pool, value: u8) -> bool {
    pool.buf.iter().all(|&b| b == value)
}

/// Applies `faults` and waits until the IO thread has taken them (the
/// snapshot command is served after the fault command, in order).
fn set_faults(a: &FabricAgent, faults: FaultPlan) {
    let t = a.transport().expect("bounce up");
    t.set_faults(faults);
    t.snapshot().expect("IO thread answers");
}

// --------------------------------------------------------------------------
// Peer never GRANTs → FAILURE at requestTimeout
// --------------------------------------------------------------------------

#[test]
fn peer_never_grants_fails_at_request_timeout() {
    let timeout = Duration::from_millis(1000);
    let cfg = config_with(
        "4MiB",
        "256KiB",
        4,
        &[("KVFABRIC_BOUNCE_REQUEST_TIMEOUT_MS", "1000")],
    );
    let mut src = Pool::new(512 * BLOCK);
    let dst = Pool::new(512 * BLOCK);
    let Some(tx) = agent("nogrant-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("nogrant-rx", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    set_faults(
        &rx,
        FaultPlan {
            ignore_wants: true,
            ..FaultPlan::default()
        },
    );
    let descs = block_descs(&src, 0, &dst, &permutation(512, 3), BLOCK);
    fill(&mut src, &descs, 4);
    let t0 = Instant::now();
    let (path, h) = tx.submit_write(rx.name(), descs);
    assert_eq!(path, PathKind::Bounce);
    let outcome = h.wait(timeout + Duration::from_secs(5));
    let elapsed = t0.elapsed();
    println!("no GRANT: {outcome:?} after {elapsed:?} (timeout {timeout:?})");
    assert!(is_failure(&outcome), "outcome {outcome:?}");
    assert!(
        elapsed >= timeout && elapsed <= timeout + Duration::from_secs(2),
        "resolved after {elapsed:?}, expected within [{timeout:?}, {timeout:?} + 2 s]"
    );
    let st = tstats(&tx);
    assert_eq!(get(&st.timeouts), 1);
    assert_eq!(get(&st.failed), 1);
    assert_eq!(get(&st.chunks_written), 0);
    assert_eq!(get(&tstats(&rx).grants), 0);
    assert!(all_bytes(&dst, 0), "nothing may land without a GRANT");
    // The eager gathers' staging is released.
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));
}

#[test]
fn invalid_descriptor_fails_at_submit_without_a_want() {
    let cfg = test_config("4MiB", "256KiB", 4);
    let src = Pool::new(64 * BLOCK);
    let dst = Pool::new(64 * BLOCK);
    let Some(tx) = agent("baddesc-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("baddesc-rx", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    let mut descs = block_descs(&src, 0, &dst, &permutation(64, 5), BLOCK);
    // Descriptor 17's destination range wraps around the address space.
    descs[17].dst = u64::MAX - 100;
    let t0 = Instant::now();
    let (path, h) = tx.submit_write(rx.name(), descs);
    assert_eq!(path, PathKind::Bounce);
    // Resolved by the sizing pass in submit itself: no wait needed.
    let outcome = h.try_outcome();
    println!("bad descriptor: {outcome:?} after {:?}", t0.elapsed());
    match &outcome {
        Some(TransferOutcome::Failure(why)) => assert!(
            why.contains("planning") && why.contains("17"),
            "the failure must name the planning step and descriptor 17: {why}"
        ),
        other => panic!("expected FAILURE at submit, got {other:?}"),
    }
    let st = tstats(&tx);
    assert_eq!(get(&st.failed), 1);
    assert_eq!(get(&st.chunks_written), 0);
    // No WANT went out, so the receiver granted nothing and nothing landed.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(get(&tstats(&rx).grants), 0);
    assert!(
        all_bytes(&dst, 0),
        "nothing may land for a rejected request"
    );
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));
}

// --------------------------------------------------------------------------
// Transfer engine reports failure → FAILURE
// --------------------------------------------------------------------------

#[test]
fn engine_failure_fails_the_request_and_both_sides_reclaim() {
    let cfg = test_config("4MiB", "256KiB", 4);
    let mut src = Pool::new(1024 * BLOCK);
    let dst = Pool::new(1024 * BLOCK);
    let Some(tx) = agent("engfail-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("engfail-rx", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    set_faults(
        &tx,
        FaultPlan {
            fail_writes: true,
            ..FaultPlan::default()
        },
    );
    let descs = block_descs(&src, 0, &dst, &permutation(1024, 5), BLOCK);
    fill(&mut src, &descs, 6);
    let t0 = Instant::now();
    let (path, h) = tx.submit_write(rx.name(), descs.clone());
    assert_eq!(path, PathKind::Bounce);
    let outcome = h.wait(Duration::from_secs(5));
    let elapsed = t0.elapsed();
    println!("engine failure: {outcome:?} after {elapsed:?}");
    match &outcome {
        Some(TransferOutcome::Failure(why)) => {
            assert!(why.contains("injected engine failure"), "reason {why:?}")
        }
        o => panic!("expected FAILURE, got {o:?}"),
    }
    // Well before the 5 s request timeout: the poll failure fails it.
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
    assert_eq!(get(&tstats(&tx).timeouts), 0);
    assert!(get(&tstats(&rx).grants) > 0, "the receiver granted credits");
    // No DATA was sent for a failed write: nothing scattered.
    assert_eq!(get(&tstats(&rx).chunks_scattered), 0);
    assert!(all_bytes(&dst, 0), "a failed write must never be scattered");
    // The sender's cancel lets the receiver reclaim the flow's regions;
    // the sender frees its staging (orphaned writes drained).
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));
    assert!(get(&tstats(&rx).cancels_received) >= 1);

    // Healed: the same pair moves bytes again.
    set_faults(&tx, FaultPlan::default());
    fill(&mut src, &descs, 7);
    let (_, h) = tx.submit_write(rx.name(), descs.clone());
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(&dst, &descs, 7).unwrap();
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));
}

// --------------------------------------------------------------------------
// Shutdown with transfers in flight → every request resolves
// --------------------------------------------------------------------------

#[test]
fn shutdown_with_transfers_in_flight_resolves_every_request() {
    const N: usize = 4;
    const BLOCKS: usize = 2048; // 8 MiB each
    let cfg = test_config("2MiB", "128KiB", 2);
    let mut src = Pool::new(N * BLOCKS * BLOCK);
    let dst = Pool::new(N * BLOCKS * BLOCK);
    let Some(mut tx) = agent("shut-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("shut-rx", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    let perm = permutation(N * BLOCKS, 9);
    let all: Vec<Vec<Descriptor>> = (0..N)
        .map(|i| {
            block_descs(
                &src,
                i * BLOCKS,
                &dst,
                &perm[i * BLOCKS..(i + 1) * BLOCKS],
                BLOCK,
            )
        })
        .collect();
    for (i, d) in all.iter().enumerate() {
        fill(&mut src, d, 20 + i as u64);
    }
    let handles: Vec<_> = all
        .iter()
        .map(|d| {
            let (path, h) = tx.submit_write(rx.name(), d.clone());
            assert_eq!(path, PathKind::Bounce);
            h
        })
        .collect();
    // Let the pipeline fill, then shut down under load.
    assert!(
        wait_for(Duration::from_secs(10), || get(&tstats(&rx).grants) >= 2),
        "no grants"
    );
    let t0 = Instant::now();
    tx.shutdown();
    let shutdown_took = t0.elapsed();
    let outcomes: Vec<_> = handles
        .iter()
        .map(|h| h.wait(Duration::from_secs(1)))
        .collect();
    let resolved_by = t0.elapsed();
    println!("shutdown took {shutdown_took:?}; all resolved by {resolved_by:?}: {outcomes:?}");
    assert!(
        outcomes.iter().all(Option::is_some),
        "unresolved after shutdown: {outcomes:?}"
    );
    assert!(
        shutdown_took < Duration::from_secs(6),
        "shutdown took {shutdown_took:?}"
    );
    // No write was stuck: the arena is released normally, not leaked.
    assert!(!tstats(&tx)
        .arena_in_doubt
        .load(std::sync::atomic::Ordering::SeqCst));
    assert!(tx.owns_arena());
    assert!(
        outcomes.iter().any(is_failure),
        "32 MiB cannot all have landed before shutdown: {outcomes:?}"
    );
    // Requests that did report SUCCESS landed byte-exact.
    for (i, o) in outcomes.iter().enumerate() {
        if o == &Some(TransferOutcome::Success) {
            verify(&dst, &all[i], 20 + i as u64).unwrap();
        }
    }
    // After shutdown every submission resolves at once, on either path.
    let (_, late) = tx.submit_write(rx.name(), all[0].clone());
    assert!(
        is_failure(&late.wait(Duration::from_secs(1))),
        "bounce submit after shutdown"
    );
    let late_std = tx.submit_standard(rx.name(), all[0][..16].to_vec());
    assert!(
        is_failure(&late_std.wait(Duration::from_secs(1))),
        "standard submit after shutdown"
    );
    assert!(
        tx.transport().unwrap().snapshot().is_none(),
        "IO thread stopped"
    );
    // The receiver reclaims the failed requests' flows (cancels), and frees
    // regions whose scatter was in flight once it completes.
    assert_quiesced(&rx, Duration::from_secs(5));
}

#[test]
fn submits_racing_a_shutdown_all_resolve_and_are_counted_once() {
    let cfg = test_config("2MiB", "128KiB", 2);
    let src = Pool::new(64 * BLOCK);
    let dst = Pool::new(64 * BLOCK);
    let Some(tx) = agent("race-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("race-rx", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    let t = tx.transport().expect("bounce transport");
    let descs = block_descs(&src, 0, &dst, &permutation(16, 3), BLOCK);
    let handles = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..200 {
                    let h = t.submit(rx.name(), descs.clone());
                    handles.lock().unwrap().push(h);
                }
            });
        }
        std::thread::sleep(Duration::from_millis(3));
        t.shutdown();
    });
    let handles = handles.into_inner().unwrap();
    let t0 = Instant::now();
    let unresolved = handles
        .iter()
        .filter(|h| h.wait(Duration::from_secs(5)).is_none())
        .count();
    assert_eq!(unresolved, 0, "handles never resolved after shutdown");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // Every request counted exactly once, as success or failure.
    let st = tstats(&tx);
    assert_eq!(get(&st.submitted), 800);
    assert_eq!(get(&st.succeeded) + get(&st.failed), 800);
}

// --------------------------------------------------------------------------
// forgetPeer in flight → FAILURE, regions reclaimed, conservation holds
// --------------------------------------------------------------------------

#[test]
fn forget_peer_in_flight_fails_reclaims_and_recovers() {
    let cfg = test_config("2MiB", "128KiB", 2);
    let n = 8192; // 32 MiB: 16x the arena, streams for a while
    let mut src = Pool::new(n * BLOCK);
    let dst = Pool::new(n * BLOCK);
    let Some(tx) = agent("forget-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("forget-rx", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    let descs = block_descs(&src, 0, &dst, &permutation(n, 13), BLOCK);
    fill(&mut src, &descs, 30);
    let (path, h) = tx.submit_write(rx.name(), descs.clone());
    assert_eq!(path, PathKind::Bounce);
    assert!(
        wait_for(Duration::from_secs(10), || get(
            &tstats(&rx).chunks_scattered
        ) >= 2),
        "transfer did not get going"
    );
    assert!(h.try_outcome().is_none(), "still in flight when forgotten");
    let t0 = Instant::now();
    tx.forget_peer(rx.name());
    let took = t0.elapsed();
    // Synchronous: resolved by the time forget_peer returns.
    let outcome = h.try_outcome();
    println!("forget_peer took {took:?}; outcome {outcome:?}");
    assert!(
        is_failure(&outcome),
        "outcome right after forget_peer: {outcome:?}"
    );
    assert!(took < Duration::from_secs(1));
    assert!(!tx.has_peer_handshake(rx.name()));
    // Send-side orphans (writes the NIC may still read) drain; arena free.
    assert_quiesced(&tx, Duration::from_secs(5));

    // The receiver still holds the flow (the sender dropped its route, so
    // no cancel reached it) until it forgets the sender too.
    let before = snap(&rx);
    println!("receiver before its forget_peer: {before:?}");
    assert_eq!(before.conservation, Ok(()));
    rx.forget_peer(tx.name());
    let after = snap(&rx);
    assert_eq!(after.conservation, Ok(()));
    assert_eq!(
        after.flows, 0,
        "forget_peer reclaims every flow of the peer: {after:?}"
    );
    // Scatters in flight finish, then their orphaned regions are freed.
    assert_quiesced(&rx, Duration::from_secs(5));

    // A fresh load re-validates the handshake and bounce works again.
    connect(&tx, &rx);
    assert!(tx.has_peer_handshake(rx.name()));
    fill(&mut src, &descs[..1024], 31);
    let (path, h) = tx.submit_write(rx.name(), descs[..1024].to_vec());
    assert_eq!(path, PathKind::Bounce);
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(&dst, &descs[..1024], 31).unwrap();
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));
}

// --------------------------------------------------------------------------
// Malformed WANT endpoint → no grant, no panic, cancel still honoured
// --------------------------------------------------------------------------

#[test]
fn malformed_want_endpoint_is_rejected_and_cancel_still_honoured() {
    let cfg = test_config("4MiB", "256KiB", 4);
    let mut src = Pool::new(256 * BLOCK);
    let dst = Pool::new(256 * BLOCK);
    let Some(tx) = agent("badep-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("badep-rx", &cfg, &[&dst]) else {
        return;
    };
    // Only the sender loads the receiver: the receiver has no route back
    // and must take it from the WANT's endpoint (reverse-path bootstrap).
    tx.load_peer(&rx.local_descriptor().unwrap()).unwrap();
    let t = tx.transport().unwrap();
    let bad = b"not an endpoint".to_vec();
    t.send_raw(
        rx.name(),
        Message::Want(Want {
            request_id: 999,
            scope: 0,
            chunk_bytes: vec![65536],
            endpoint: bad.clone(),
        })
        .encode(),
    );
    let rs = tstats(&rx);
    assert!(
        wait_for(Duration::from_secs(5), || get(&rs.wants_rejected) == 1),
        "malformed WANT not rejected"
    );
    assert_eq!(
        get(&rs.grants),
        0,
        "no grant for a WANT with a bad endpoint"
    );
    let s = snap(&rx);
    assert_eq!((s.flows, s.free_bytes), (0, s.capacity), "{s:?}");

    // A cancel with a bad endpoint (no route yet) is still honoured.
    t.send_raw(rx.name(), wire::encode_cancel(999, &bad));
    assert!(
        wait_for(Duration::from_secs(5), || get(&rs.cancels_received) == 1),
        "cancel with a bad endpoint not processed"
    );
    assert_eq!(get(&rs.wants_rejected), 1);

    // The receiver still works: a real transfer bootstraps the route.
    let descs = block_descs(&src, 0, &dst, &permutation(256, 21), BLOCK);
    fill(&mut src, &descs, 40);
    let (path, h) = tx.submit_write(rx.name(), descs.clone());
    assert_eq!(path, PathKind::Bounce);
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(&dst, &descs, 40).unwrap();
    assert_quiesced(&rx, Duration::from_secs(5));

    // Flow state left by a valid WANT is reclaimed by a cancel even when
    // the cancel's endpoint is garbage.
    let grants = get(&rs.grants);
    t.send_raw(
        rx.name(),
        Message::Want(Want {
            request_id: 1000,
            scope: 0,
            chunk_bytes: vec![65536, 65536],
            endpoint: t.local_endpoint().to_vec(),
        })
        .encode(),
    );
    assert!(
        wait_for(Duration::from_secs(5), || get(&rs.grants) == grants + 2),
        "valid WANT not granted"
    );
    let s = snap(&rx);
    assert_eq!((s.flows, s.held_bytes), (1, 2 * 65536), "{s:?}");
    t.send_raw(rx.name(), wire::encode_cancel(1000, &bad));
    assert!(
        wait_for(Duration::from_secs(5), || get(&rs.cancels_received) == 2),
        "cancel not processed"
    );
    assert_quiesced(&rx, Duration::from_secs(5));
    assert_eq!(get(&rs.wants_rejected), 1);
    assert_quiesced(&tx, Duration::from_secs(5));
}

// --------------------------------------------------------------------------
// Out-of-bounds scatter run → no scatter, no ACK
// --------------------------------------------------------------------------

#[test]
fn scatter_outside_registered_memory_is_refused_and_sender_fails_at_once() {
    let cfg = config_with(
        "4MiB",
        "256KiB",
        4,
        &[("KVFABRIC_BOUNCE_REQUEST_TIMEOUT_MS", "1000")],
    );
    let mut src = Pool::new(256 * BLOCK);
    let kv = Pool::new(64 * BLOCK);
    // Not registered with the receiver: no scatter may write it.
    let foreign = Pool::new(256 * BLOCK);
    let Some(tx) = agent("oob-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("oob-rx", &cfg, &[&kv]) else {
        return;
    };
    connect(&tx, &rx);
    let descs = block_descs(&src, 0, &foreign, &permutation(256, 23), BLOCK);
    fill(&mut src, &descs, 50);
    let t0 = Instant::now();
    let (path, h) = tx.submit_write(rx.name(), descs);
    assert_eq!(path, PathKind::Bounce);
    let outcome = h.wait(Duration::from_secs(6));
    let elapsed = t0.elapsed();
    println!("scatter outside registered memory: {outcome:?} after {elapsed:?}");
    assert!(is_failure(&outcome), "{outcome:?}");
    let (ts, rs) = (tstats(&tx), tstats(&rx));
    assert!(
        get(&ts.chunks_written) > 0,
        "chunks were written to the arena"
    );
    assert!(get(&rs.data_rejected) > 0, "DATA was refused");
    assert_eq!(get(&rs.chunks_scattered), 0, "no scatter, hence no ACK");
    // The receiver REJECTs the request (wire version 2): it fails at once,
    // not at its 1 s timeout, naming why.
    assert_eq!(get(&ts.timeouts), 0, "failed by REJECT, not by timeout");
    assert_eq!(get(&ts.rejects_received), 1);
    match &outcome {
        Some(TransferOutcome::Failure(why)) => {
            assert!(why.contains("outside the destination"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    assert!(elapsed < Duration::from_millis(900), "took {elapsed:?}");
    assert!(all_bytes(&foreign, 0), "unregistered memory was written");
    assert!(all_bytes(&kv, 0));
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));
}

/// A receiver with one flow (request `rid` of `tx`) holding exactly one
/// fresh 64 KiB region. The buddy arena hands out its lowest block first,
/// so the region handle is 0; the positive controls below prove it.
fn grant_one_region(tx: &FabricAgent, rx: &FabricAgent, rid: u64) {
    let t = tx.transport().unwrap();
    let rs = tstats(rx);
    let grants = get(&rs.grants);
    t.send_raw(
        rx.name(),
        Message::Want(Want {
            request_id: rid,
            scope: 0,
            chunk_bytes: vec![65536],
            endpoint: t.local_endpoint().to_vec(),
        })
        .encode(),
    );
    assert!(
        wait_for(Duration::from_secs(5), || get(&rs.grants) == grants + 1),
        "WANT {rid} not granted"
    );
    let s = snap(rx);
    assert_eq!((s.flows, s.held_bytes), (1, 65536), "{s:?}");
}

fn send_data(tx: &FabricAgent, rx: &FabricAgent, rid: u64, region: u64, runs: Vec<ScatterRun>) {
    tx.transport().unwrap().send_raw(
        rx.name(),
        Message::Data(Data {
            request_id: rid,
            chunk_index: 0,
            region_handle: region,
            runs,
        })
        .encode(),
    );
}

fn run(region_offset: u64, addr: u64, segment_len: u64, count: u32, stride: u64) -> ScatterRun {
    ScatterRun {
        region_offset,
        addr,
        segment_len,
        count,
        region_stride: stride,
        addr_stride: stride,
    }
}

#[test]
fn out_of_bounds_scatter_runs_are_refused_without_scatter_or_ack() {
    let cfg = test_config("4MiB", "256KiB", 4);
    let mut dst = Pool::new(64 * BLOCK);
    dst.buf.fill(0xAA);
    let Some(tx) = agent("runs-tx", &cfg, &[]) else {
        return;
    };
    let Some(rx) = agent("runs-rx", &cfg, &[&dst]) else {
        return;
    };
    tx.load_peer(&rx.local_descriptor().unwrap()).unwrap();
    let rs = tstats(&rx);
    grant_one_region(&tx, &rx, 7);
    let base = dst.addr();
    let len = dst.buf.len() as u64;
    let bad: Vec<(&str, Vec<ScatterRun>)> = vec![
        (
            "run past the granted region",
            vec![run(0, base, 65536 + 4096, 1, 0)],
        ),
        (
            "strided run past the region",
            vec![run(0, base, 4096, 17, 4096)],
        ),
        (
            "run starting past the region",
            vec![run(65536, base, 4096, 1, 0)],
        ),
        (
            "runs moving more than the region",
            vec![run(0, base, 65536, 1, 0), run(0, base + 65536, 4096, 1, 0)],
        ),
        (
            "destination straddling the end of KV memory",
            vec![run(0, base + len - 2048, 4096, 1, 0)],
        ),
        (
            "destination outside registered memory",
            vec![run(0, 0x1000, 4096, 1, 0)],
        ),
        (
            "overflowing stride",
            vec![run(0, base, 4096, 3, u64::MAX / 2)],
        ),
    ];
    for (k, (what, runs)) in bad.into_iter().enumerate() {
        send_data(&tx, &rx, 7, 0, runs);
        assert!(
            wait_for(Duration::from_secs(5), || get(&rs.data_rejected)
                == k as u64 + 1),
            "{what}: DATA not refused"
        );
        let s = snap(&rx);
        assert_eq!(get(&rs.chunks_scattered), 0, "{what}: scattered");
        assert_eq!(
            (s.flows, s.held_bytes),
            (1, 65536),
            "{what}: region must stay held: {s:?}"
        );
    }
    assert!(all_bytes(&dst, 0xAA), "a refused DATA wrote KV memory");
    // Positive control: the same region with a valid run is scattered (the
    // arena's zeros land) and the flow completes — so the refusals above
    // were for the bounds, not for a wrong handle.
    send_data(&tx, &rx, 7, 0, vec![run(0, base + 65536, 65536, 1, 0)]);
    assert!(
        wait_for(Duration::from_secs(5), || get(&rs.chunks_scattered) == 1),
        "valid DATA not scattered"
    );
    assert_quiesced(&rx, Duration::from_secs(5));
    assert!(dst.buf[..65536].iter().all(|&b| b == 0xAA));
    assert!(dst.buf[65536..131072].iter().all(|&b| b == 0));
    assert!(dst.buf[131072..].iter().all(|&b| b == 0xAA));
    assert_eq!(get(&rs.data_rejected), 7);
    assert_quiesced(&tx, Duration::from_secs(5));
}

// --------------------------------------------------------------------------
// Late DATA after cancel dropped
// --------------------------------------------------------------------------

#[test]
fn late_data_after_cancel_is_dropped() {
    let cfg = test_config("4MiB", "256KiB", 4);
    let mut dst = Pool::new(64 * BLOCK);
    dst.buf.fill(0xAA);
    let Some(tx) = agent("late-tx", &cfg, &[]) else {
        return;
    };
    let Some(rx) = agent("late-rx", &cfg, &[&dst]) else {
        return;
    };
    tx.load_peer(&rx.local_descriptor().unwrap()).unwrap();
    let t = tx.transport().unwrap();
    let rs = tstats(&rx);
    let base = dst.addr();

    // DATA for a flow the receiver never had.
    send_data(&tx, &rx, 41, 0, vec![run(0, base, 4096, 1, 0)]);
    assert!(wait_for(Duration::from_secs(5), || get(&rs.data_rejected) == 1));

    // Request 42 is granted region 0, then cancelled; its late DATA drops.
    grant_one_region(&tx, &rx, 42);
    t.send_raw(rx.name(), wire::encode_cancel(42, t.local_endpoint()));
    assert!(wait_for(Duration::from_secs(5), || get(
        &rs.cancels_received
    ) == 1));
    assert_quiesced(&rx, Duration::from_secs(5));
    send_data(&tx, &rx, 42, 0, vec![run(0, base, 65536, 1, 0)]);
    assert!(wait_for(Duration::from_secs(5), || get(&rs.data_rejected) == 2));

    // Region 0 is re-granted to request 43: a late DATA of 42 for it must
    // not scatter a region now owned by someone else.
    grant_one_region(&tx, &rx, 43);
    send_data(&tx, &rx, 42, 0, vec![run(0, base, 65536, 1, 0)]);
    assert!(wait_for(Duration::from_secs(5), || get(&rs.data_rejected) == 3));
    let s = snap(&rx);
    assert_eq!((s.flows, s.held_bytes), (1, 65536), "{s:?}");
    assert_eq!(get(&rs.chunks_scattered), 0);
    assert!(all_bytes(&dst, 0xAA), "a late DATA was scattered");

    // The owner's DATA for the same region is scattered (positive control).
    send_data(&tx, &rx, 43, 0, vec![run(0, base + 65536, 65536, 1, 0)]);
    assert!(wait_for(Duration::from_secs(5), || get(
        &rs.chunks_scattered
    ) == 1));
    assert_quiesced(&rx, Duration::from_secs(5));
    assert!(
        dst.buf[..65536].iter().all(|&b| b == 0xAA),
        "late DATA landed"
    );
    assert!(dst.buf[65536..131072].iter().all(|&b| b == 0));
    assert_eq!(get(&rs.data_rejected), 3);
}

/// A sender that vanishes after its WANT was granted (no DATA, no cancel —
/// the receiver is never told to forget it): the receiver reclaims the
/// silent flow after twice its request timeout, and its arena is whole again.
#[test]
fn silent_flow_of_a_vanished_sender_is_reclaimed() {
    let cfg = config_with(
        "4MiB",
        "256KiB",
        4,
        &[("KVFABRIC_BOUNCE_REQUEST_TIMEOUT_MS", "500")],
    );
    let src = Pool::new(64 * BLOCK);
    let dst = Pool::new(64 * BLOCK);
    let Some(tx) = agent("silent-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("silent-rx", &cfg, &[&dst]) else {
        return;
    };
    tx.load_peer(&rx.local_descriptor().unwrap()).unwrap();
    let t = tx.transport().unwrap();
    // A raw WANT: no request behind it on the sender, so nothing will ever
    // write, send DATA or cancel.
    t.send_raw(
        rx.name(),
        Message::Want(Want {
            request_id: 4242,
            scope: 0,
            chunk_bytes: vec![65536, 65536],
            endpoint: t.local_endpoint().to_vec(),
        })
        .encode(),
    );
    let rs = tstats(&rx);
    assert!(
        wait_for(Duration::from_secs(5), || get(&rs.grants) == 2),
        "the WANT was not granted"
    );
    let held = snap(&rx);
    assert_eq!(held.flows, 1, "{held:?}");
    assert!(held.held_bytes > 0, "{held:?}");
    let t0 = Instant::now();
    assert!(
        wait_for(Duration::from_secs(5), || {
            let s = snap(&rx);
            s.flows == 0 && s.free_bytes == s.capacity
        }),
        "silent flow not reclaimed: {:?}",
        snap(&rx)
    );
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(500),
        "reclaimed before the timeout: {waited:?}"
    );
    assert_eq!(snap(&rx).conservation, Ok(()));
}

#[test]
fn shutdown_with_a_write_stuck_in_flight_leaks_the_arena_instead_of_freeing_it() {
    const BLOCKS: usize = 512; // 2 MiB
    let cfg = test_config("2MiB", "128KiB", 2);
    let mut src = Pool::new(BLOCKS * BLOCK);
    let dst = Pool::new(BLOCKS * BLOCK);
    let Some(mut tx) = agent("stuck-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("stuck-rx", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    assert!(tx.owns_arena());
    // The NIC never reports the writes complete.
    set_faults(
        &tx,
        FaultPlan {
            hang_writes: true,
            ..FaultPlan::default()
        },
    );
    let descs = block_descs(&src, 0, &dst, &permutation(BLOCKS, 3), BLOCK);
    fill(&mut src, &descs, 5);
    let (_, h) = tx.submit_write(rx.name(), descs);
    assert!(
        wait_for(Duration::from_secs(10), || get(&tstats(&rx).grants) >= 1),
        "no grants"
    );
    // Let the granted chunks be gathered and posted.
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    tx.shutdown();
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(8), "shutdown took {took:?}");
    assert!(is_failure(&h.wait(Duration::from_secs(1))));
    // Writes were still "in flight" at the bound: the arena is not freed.
    assert!(tstats(&tx)
        .arena_in_doubt
        .load(std::sync::atomic::Ordering::SeqCst));
    assert!(!tx.owns_arena(), "the arena was kept for freeing");
    // And the receiver, which never got DATA, is unaffected.
    assert!(rx.owns_arena());
}

// --------------------------------------------------------------------------
// A replayed WANT of an ended flow does not bring it back (bug 6)
// --------------------------------------------------------------------------

#[test]
fn a_replayed_want_after_its_cancel_is_dropped() {
    let cfg = test_config("4MiB", "256KiB", 4);
    let src = Pool::new(16 * BLOCK);
    let dst = Pool::new(16 * BLOCK);
    let Some(tx) = agent("replay-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("replay-rx", &cfg, &[&dst]) else {
        return;
    };
    tx.load_peer(&rx.local_descriptor().unwrap()).unwrap();
    let t = tx.transport().unwrap();
    let rs = tstats(&rx);
    let want = Message::Want(Want {
        request_id: 4242,
        scope: 0,
        chunk_bytes: vec![65536, 65536],
        endpoint: t.local_endpoint().to_vec(),
    })
    .encode();
    t.send_raw(rx.name(), want.clone());
    assert!(
        wait_for(Duration::from_secs(5), || get(&rs.grants) == 2),
        "WANT not granted"
    );
    // The same WANT again while the flow lives: a replay, dropped.
    t.send_raw(rx.name(), want.clone());
    assert!(wait_for(Duration::from_secs(5), || get(&rs.wants_stale) == 1));
    assert_eq!(get(&rs.grants), 2);
    t.send_raw(rx.name(), wire::encode_cancel(4242, t.local_endpoint()));
    assert!(wait_for(Duration::from_secs(5), || get(
        &rs.cancels_received
    ) == 1));
    assert_quiesced(&rx, Duration::from_secs(5));
    // And after its cancel: the reclaimed flow is not re-created, no
    // region is granted to it again.
    t.send_raw(rx.name(), want);
    assert!(wait_for(Duration::from_secs(5), || get(&rs.wants_stale) == 2));
    assert_eq!(get(&rs.grants), 2, "the ended flow was granted again");
    let s = snap(&rx);
    assert_eq!((s.flows, s.free_bytes), (0, s.capacity), "{s:?}");
}
