//! In-process reconfiguration of a fabric agent (issue 14, item 4), real
//! NIXL, byte-exact: `FabricAgent::reconfigure` replaces the arena and the
//! transport of a running agent without touching its peers or its KV
//! regions; agents of different config generations route through the
//! standard path (and still succeed); once both run the new generation
//! bounce resumes through the new arena; the control endpoint survives the
//! rebuild; a draining agent sends nothing new through bounce; a config
//! that cannot be built rolls back to the running one; requests in flight
//! when the old transport stops resolve (never hang).

mod common;

use std::time::Duration;

use common::*;
use kvfabric_agent::runtime::fabric::{Incompatibility, PathKind, Reconfigured};
use kvfabric_agent::runtime::transport::TransferOutcome;

const BLOCK: usize = 4096;
const SLOTS: usize = 1024;

/// One 4 MiB hand-off `tx → rx` of `seed`; returns the path taken.
fn hand_off(
    tx: &kvfabric_agent::runtime::fabric::FabricAgent,
    rx_name: &str,
    src: &mut Pool,
    dst: &Pool,
    seed: u64,
) -> PathKind {
    let slots = permutation(SLOTS, seed);
    let descs = block_descs(src, 0, dst, &slots, BLOCK);
    fill(src, &descs, seed);
    let (path, h) = tx.submit_write(rx_name, descs.clone());
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success),
        "seed {seed} over {path:?}"
    );
    verify(dst, &descs, seed).unwrap_or_else(|e| panic!("seed {seed} over {path:?}: {e}"));
    path
}

#[test]
fn arena_rebuilt_in_process_generations_isolate_and_bounce_resumes() {
    let cfg = test_config("8MiB", "1MiB", 4);
    let mut src = Pool::new(SLOTS * BLOCK);
    let dst = Pool::new(SLOTS * BLOCK);
    let Some(tx) = agent("rcfg-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("rcfg-rx", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    assert_eq!(
        hand_off(&tx, rx.name(), &mut src, &dst, 1),
        PathKind::Bounce
    );
    let endpoint = rx.handshake().unwrap().endpoint;

    // rx moves to generation 1 with a 16 MiB arena.
    let next = test_config("16MiB", "1MiB", 4).validate().unwrap();
    rx.begin_drain();
    assert!(rx.is_draining());
    assert!(
        rx.local_descriptor().unwrap().handshake.is_none(),
        "no handshake while draining"
    );
    assert!(rx.bounce_idle());
    assert_eq!(
        rx.reconfigure(next.clone(), 1),
        Reconfigured::Applied { rebuilt: true }
    );
    assert!(!rx.is_draining());
    let hs = rx.handshake().unwrap();
    assert_eq!(hs.config_generation, 1);
    assert_eq!(
        hs.endpoint, endpoint,
        "the control endpoint survives the rebuild"
    );
    assert!(hs.arena_usable_capacity_bytes > 8 << 20);
    // Peers learn it by reloading rx's descriptor (discovery does this).
    tx.load_peer(&rx.local_descriptor().unwrap()).unwrap();
    let why = tx
        .peers()
        .into_iter()
        .find(|(n, _)| n == rx.name())
        .unwrap()
        .1
        .bounce
        .unwrap_err();
    assert_eq!(why, Incompatibility::ConfigGeneration { local: 0, peer: 1 });
    // Mixed generations: the standard path, still byte-exact.
    assert_eq!(
        hand_off(&tx, rx.name(), &mut src, &dst, 2),
        PathKind::Standard
    );

    // tx follows; bounce resumes through the new arenas; its counters
    // continue (exported `_total` counters never go backwards).
    let submitted = get(&tstats(&tx).submitted);
    assert!(submitted >= 1);
    tx.begin_drain();
    assert_eq!(
        tx.reconfigure(next.clone(), 1),
        Reconfigured::Applied { rebuilt: true }
    );
    assert_eq!(
        get(&tstats(&tx).submitted),
        submitted,
        "counters carried over"
    );
    rx.load_peer(&tx.local_descriptor().unwrap()).unwrap();
    assert!(tx.has_peer_handshake(rx.name()));
    assert!(rx.has_peer_handshake(tx.name()));
    for seed in 3..=5 {
        assert_eq!(
            hand_off(&tx, rx.name(), &mut src, &dst, seed),
            PathKind::Bounce
        );
    }
    assert_eq!(get(&tstats(&tx).submitted), submitted + 3);
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));

    // Same config, next generation: in place, nothing rebuilt; a draining
    // agent routes everything through the standard path.
    let t_before = tx.transport().unwrap();
    tx.begin_drain();
    assert_eq!(
        hand_off(&tx, rx.name(), &mut src, &dst, 6),
        PathKind::Standard
    );
    assert_eq!(
        tx.reconfigure(next.clone(), 2),
        Reconfigured::Applied { rebuilt: false }
    );
    assert!(std::sync::Arc::ptr_eq(&t_before, &tx.transport().unwrap()));
    assert_eq!(tx.config_generation(), 2);

    // A config that cannot be built (a 1 PiB arena) rolls back: the
    // running config and generation stay, bounce keeps working.
    let huge = test_config("1125899906842624", "1MiB", 4)
        .validate()
        .unwrap();
    rx.begin_drain();
    match rx.reconfigure(huge, 2) {
        Reconfigured::RolledBack { why } => assert!(!why.is_empty()),
        other => panic!("expected a rollback, got {other:?}"),
    }
    assert_eq!(rx.config_generation(), 1);
    assert_eq!(rx.bounce_config(), next);
    assert_eq!(
        rx.handshake().unwrap().endpoint,
        endpoint,
        "the rollback keeps the control endpoint too"
    );
    rx.set_config_generation(2);
    tx.load_peer(&rx.local_descriptor().unwrap()).unwrap();
    rx.load_peer(&tx.local_descriptor().unwrap()).unwrap();
    assert_eq!(
        hand_off(&tx, rx.name(), &mut src, &dst, 7),
        PathKind::Bounce
    );
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));
}

/// A reconfiguration that does not wait for the drain (the daemon's bound
/// passed) still resolves every request in flight: FAILURE or SUCCESS,
/// never a hang, and the agent keeps working on the new transport.
#[test]
fn requests_in_flight_at_a_forced_rebuild_resolve() {
    let cfg = test_config("8MiB", "1MiB", 4);
    let mut src = Pool::new(SLOTS * BLOCK);
    let dst = Pool::new(SLOTS * BLOCK);
    let Some(tx) = agent("rcff-tx", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("rcff-rx", &cfg, &[&dst]) else {
        return;
    };
    connect(&tx, &rx);
    let mut handles = Vec::new();
    for seed in 1..=8u64 {
        let slots = permutation(SLOTS, seed);
        let descs = block_descs(&src, 0, &dst, &slots, BLOCK);
        fill(&mut src, &descs, seed);
        let (path, h) = tx.submit_write(rx.name(), descs);
        assert_eq!(path, PathKind::Bounce);
        handles.push(h);
    }
    let next = test_config("12MiB", "1MiB", 4).validate().unwrap();
    assert_eq!(
        tx.reconfigure(next, 1),
        Reconfigured::Applied { rebuilt: true }
    );
    for h in handles {
        assert!(
            h.wait(Duration::from_secs(10)).is_some(),
            "a request in flight at the rebuild never resolved"
        );
    }
    rx.set_config_generation(1);
    tx.load_peer(&rx.local_descriptor().unwrap()).unwrap();
    rx.load_peer(&tx.local_descriptor().unwrap()).unwrap();
    assert_eq!(
        hand_off(&tx, rx.name(), &mut src, &dst, 9),
        PathKind::Bounce
    );
    assert_quiesced(&tx, Duration::from_secs(10));
    assert_quiesced(&rx, Duration::from_secs(10));
}
