//! Engine-scoped flows (issue 12, item 2) over real NIXL, two in-process
//! agents: a WANT names the destination engine's scope, the receiver
//! scatters its DATA only into that engine's pool, refuses a scope that is
//! not attached, and closing a scope (the engine detached) fails the
//! requests into it at once while other engines' flows go on.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvfabric_agent::runtime::engine::MemKind;
use kvfabric_agent::runtime::fabric::{FabricAgent, PathKind};
use kvfabric_agent::runtime::transport::{FaultPlan, TransferHandle, TransferOutcome};

const BLOCK: usize = 16 * 1024;
/// The test config's request timeout is 5 s: a REJECT must fail a request
/// well before it.
const FAST: Duration = Duration::from_millis(2_500);

fn scoped(
    tx: &FabricAgent,
    rx: &FabricAgent,
    descs: Vec<kvfabric_agent::core::Descriptor>,
    scope: u64,
) -> TransferHandle {
    let (path, h) =
        tx.submit_write_scoped(rx.name(), descs, MemKind::Dram, MemKind::Dram, scope, false);
    assert_eq!(path, PathKind::Bounce);
    h
}

fn failure_within(h: &TransferHandle, within: Duration) -> String {
    let t0 = Instant::now();
    match h.wait(within) {
        Some(TransferOutcome::Failure(why)) => {
            println!("failed after {:?}: {why}", t0.elapsed());
            why
        }
        other => panic!("expected FAILURE within {within:?}, got {other:?}"),
    }
}

#[test]
fn a_scoped_flow_scatters_only_into_its_engines_pool() {
    let cfg = test_config("4MiB", "256KiB", 4);
    let mut src = Pool::new(64 * BLOCK);
    let own = Pool::new(64 * BLOCK);
    let (pool_a, pool_b) = (Pool::new(64 * BLOCK), Pool::new(64 * BLOCK));
    let Some(tx) = agent("scope-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("scope-rx", &cfg, &[&own]) else {
        return;
    };
    // Two engines attached to the receiver: scopes 3 and 4.
    rx.allow_scope(3, pool_a.addr(), pool_a.buf.len() as u64);
    rx.allow_scope(4, pool_b.addr(), pool_b.buf.len() as u64);
    connect(&tx, &rx);

    // Into engine 3's pool, named as scope 3: lands byte-exact.
    let into_a = block_descs(&src, 0, &pool_a, &permutation(48, 5), BLOCK);
    fill(&mut src, &into_a, 11);
    let h = scoped(&tx, &rx, into_a.clone(), 3);
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(&pool_a, &into_a, 11).unwrap();

    // Into engine 4's pool (or the agent's own) while naming scope 3 — a
    // sender holding a stale address: nothing scattered, FAILURE at once.
    let rejected_before = get(&tstats(&rx).data_rejected);
    for (dst, seed) in [(&pool_b, 12u64), (&own, 13)] {
        let descs = block_descs(&src, 0, dst, &permutation(48, 6), BLOCK);
        fill(&mut src, &descs, seed);
        let why = failure_within(&scoped(&tx, &rx, descs, 3), FAST);
        assert!(why.contains("outside the destination"), "{why}");
    }
    assert!(get(&tstats(&rx).data_rejected) > rejected_before);
    assert!(
        pool_b.buf.iter().all(|&b| b == 0),
        "engine 4's pool written"
    );
    assert!(
        own.buf.iter().all(|&b| b == 0),
        "the agent's own pool written"
    );

    // A scope the receiver does not have: refused at the WANT.
    let descs = block_descs(&src, 0, &pool_a, &permutation(8, 7), BLOCK);
    let why = failure_within(&scoped(&tx, &rx, descs, 99), FAST);
    assert!(why.contains("not attached"), "{why}");
    assert!(get(&tstats(&tx).rejects_received) >= 3);

    // Scope 0 (the agent's own memory) still works, and nothing leaked.
    let into_own = block_descs(&src, 0, &own, &permutation(32, 8), BLOCK);
    fill(&mut src, &into_own, 14);
    let h = scoped(&tx, &rx, into_own.clone(), 0);
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(&own, &into_own, 14).unwrap();
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));
}

#[test]
fn closing_a_scope_fails_its_requests_at_once_and_spares_other_engines() {
    let cfg = test_config("4MiB", "256KiB", 4);
    let mut src = Pool::new(128 * BLOCK);
    let own = Pool::new(4 * BLOCK);
    let (pool_a, pool_b) = (Pool::new(64 * BLOCK), Pool::new(64 * BLOCK));
    let Some(tx) = agent("scopeclose-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("scopeclose-rx", &cfg, &[&own]) else {
        return;
    };
    rx.allow_scope(3, pool_a.addr(), pool_a.buf.len() as u64);
    rx.allow_scope(4, pool_b.addr(), pool_b.buf.len() as u64);
    connect(&tx, &rx);

    // Hold both requests in flight: granted, writes never completing.
    tx.transport().unwrap().set_faults(FaultPlan {
        hang_writes: true,
        ..FaultPlan::default()
    });
    let into_a = block_descs(&src, 0, &pool_a, &permutation(48, 1), BLOCK);
    let into_b = block_descs(&src, 64, &pool_b, &permutation(48, 2), BLOCK);
    fill(&mut src, &into_a, 21);
    fill(&mut src, &into_b, 22);
    let ha = scoped(&tx, &rx, into_a.clone(), 3);
    let hb = scoped(&tx, &rx, into_b.clone(), 4);
    let rt = rx.transport().unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || rt
            .snapshot()
            .is_some_and(|s| s.flows == 2 && s.held_bytes > 0)),
        "both flows granted: {:?}",
        rt.snapshot()
    );

    // Engine 3 detaches: only its flow's sender is told, at once.
    let t0 = Instant::now();
    assert_eq!(rx.forget_scope(3), 1);
    let why = failure_within(&ha, Duration::from_secs(1));
    assert!(why.contains("detached"), "{why}");
    println!(
        "request into the detached engine failed {:?} after the detach",
        t0.elapsed()
    );
    assert_eq!(hb.try_outcome(), None, "engine 4's request is untouched");

    // Writes complete again: engine 4's hand-off finishes byte-exact, and
    // nothing of the failed request reaches engine 3's pool.
    tx.transport().unwrap().set_faults(FaultPlan::default());
    assert_eq!(
        hb.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(&pool_b, &into_b, 22).unwrap();
    assert!(
        pool_a.buf.iter().all(|&b| b == 0),
        "detached engine's pool written"
    );

    // Scope 3 stays closed; the failed flow's regions came back (the
    // sender's cancel after its writes settled).
    let descs = block_descs(&src, 0, &pool_a, &permutation(8, 3), BLOCK);
    let why = failure_within(&scoped(&tx, &rx, descs, 3), FAST);
    assert!(why.contains("not attached"), "{why}");
    assert_quiesced(&tx, Duration::from_secs(10));
    assert_quiesced(&rx, Duration::from_secs(10));
}
