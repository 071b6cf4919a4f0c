//! Bounce end to end over the direct TCP control channel (bounce config
//! `controlTransport: tcp`), real NIXL, byte-exact; and a ZMQ agent next to
//! a TCP one falls back to the standard path (the handshake checks the
//! control kind); with a control key, only agents holding it are heard.

mod common;

use std::time::Duration;

use common::*;
use kvfabric_agent::core::config::ControlTransport;
use kvfabric_agent::core::ControlKind;
use kvfabric_agent::runtime::control::auth::{AuthMode, ControlAuth};
use kvfabric_agent::runtime::fabric::PathKind;
use kvfabric_agent::runtime::transport::TransferOutcome;

const BLOCK: usize = 4096;

#[test]
fn bounce_over_the_tcp_control_channel_is_byte_exact_and_kinds_must_match() {
    let cfg = test_config("8MiB", "1MiB", 4);
    let mut src = Pool::new(2048 * BLOCK);
    let dst = Pool::new(2048 * BLOCK);
    let zdst = Pool::new(64 * BLOCK);
    // A ZMQ agent (the default transport) …
    let Some(zmq_rx) = agent("zrcv", &cfg, &[&zdst]) else {
        return;
    };
    // … and two TCP ones, chosen by the config field.
    let mut cfg = cfg;
    cfg.control_transport = ControlTransport::Tcp;
    let Some(tx) = agent("tsnd", &cfg, &[&src]) else {
        return;
    };
    let Some(rx) = agent("trcv", &cfg, &[&dst]) else {
        return;
    };
    assert_eq!(tx.handshake().unwrap().control_kind, ControlKind::Tcp);
    assert!(tx
        .handshake()
        .unwrap()
        .endpoint
        .starts_with(b"tcp://127.0.0.1:"));
    connect(&tx, &rx);
    assert!(tx.has_peer_handshake(rx.name()));
    // Several requests, 8 MiB each through a 8 MiB arena in 1 MiB chunks.
    for seed in 1..=4u64 {
        let slots = permutation(2048, seed);
        let descs = block_descs(&src, 0, &dst, &slots, BLOCK);
        fill(&mut src, &descs, seed);
        let (path, h) = tx.submit_write(rx.name(), descs.clone());
        assert_eq!(path, PathKind::Bounce);
        assert_eq!(
            h.wait(Duration::from_secs(20)),
            Some(TransferOutcome::Success)
        );
        verify(&dst, &descs, seed).unwrap();
    }
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));
    // A ZMQ peer: incompatible control kind → standard path, no WANT sent.
    connect(&tx, &zmq_rx);
    assert!(!tx.has_peer_handshake(zmq_rx.name()));
    let slots: Vec<usize> = (0..64).rev().collect();
    let descs = block_descs(&src, 0, &zdst, &slots, BLOCK);
    fill(&mut src, &descs, 9);
    let (path, h) = tx.submit_write(zmq_rx.name(), descs.clone());
    assert_eq!(path, PathKind::Standard);
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(&zdst, &descs, 9).unwrap();
}

#[test]
fn with_a_control_key_only_agents_holding_it_are_heard() {
    let cfg = config_with(
        "8MiB",
        "1MiB",
        4,
        &[
            ("KVFABRIC_BOUNCE_CONTROL_TRANSPORT", "tcp"),
            ("KVFABRIC_BOUNCE_REQUEST_TIMEOUT_MS", "1500"),
        ],
    );
    let key = |k: &[u8]| ControlAuth::new(AuthMode::Required, &[k]).unwrap();
    let fabric_key = b"the-fabric-control-key-0123456789abcdef";
    let mut src = Pool::new(512 * BLOCK);
    let dst = Pool::new(512 * BLOCK);
    let Some(tx) = agent_with_auth("ksnd", &cfg, &[&src], key(fabric_key)) else {
        return;
    };
    let Some(rx) = agent_with_auth("krcv", &cfg, &[&dst], key(fabric_key)) else {
        return;
    };
    let Some(intruder) = agent_with_auth(
        "kbad",
        &cfg,
        &[&src],
        key(b"not-the-fabric-key-0123456789abcdef!!"),
    ) else {
        return;
    };
    // Holders of the key: bounce, byte-exact.
    connect(&tx, &rx);
    let slots = permutation(512, 3);
    let descs = block_descs(&src, 0, &dst, &slots, BLOCK);
    fill(&mut src, &descs, 3);
    let (path, h) = tx.submit_write(rx.name(), descs.clone());
    assert_eq!(path, PathKind::Bounce);
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(&dst, &descs, 3).unwrap();
    // Another key: its WANT never reaches rx (the connection's hello is
    // refused), so the request fails at its timeout and rx's pool keeps
    // tx's bytes.
    connect(&intruder, &rx);
    let descs2 = block_descs(&src, 0, &dst, &permutation(512, 4), BLOCK);
    let (path, h) = intruder.submit_write(rx.name(), descs2);
    assert_eq!(path, PathKind::Bounce);
    match h.wait(Duration::from_secs(10)) {
        Some(TransferOutcome::Failure(why)) => assert!(
            why.contains("timed out") || why.contains("timeout"),
            "{why}"
        ),
        other => panic!("a request from an agent without the key: {other:?}"),
    }
    verify(&dst, &descs, 3).unwrap();
    // rx counted the refused connections (kvfabric_control_hellos_refused_total).
    assert!(wait_for(Duration::from_secs(5), || get(
        &tstats(&rx).control_hellos_refused
    ) > 0));
    assert_eq!(get(&tstats(&tx).control_hellos_refused), 0);
    assert_quiesced(&tx, Duration::from_secs(5));
    assert_quiesced(&rx, Duration::from_secs(5));
}

#[test]
fn a_control_key_needs_the_tcp_control_channel() {
    let cfg = test_config("8MiB", "1MiB", 4);
    let pool = Pool::new(64 * BLOCK);
    let auth = ControlAuth::new(
        AuthMode::Required,
        &[b"the-fabric-control-key-0123456789abcdef"],
    )
    .unwrap();
    let Some(a) = agent_with_auth("kzmq", &cfg, &[&pool], auth) else {
        return;
    };
    // Bounce does not start (ZMQ cannot carry the key); the agent says why.
    assert!(a.handshake().is_none());
    let why = format!("{:?}", a.bounce_unavailable());
    assert!(why.contains("TCP control channel"), "{why}");
}

#[test]
fn an_agent_that_requires_signed_hellos_and_one_that_does_not_sign_use_the_standard_path() {
    let cfg = config_with(
        "8MiB",
        "1MiB",
        4,
        &[("KVFABRIC_BOUNCE_CONTROL_TRANSPORT", "tcp")],
    );
    let key: &[u8] = b"the-fabric-control-key-0123456789abcdef";
    let mut src = Pool::new(256 * BLOCK);
    let dst = Pool::new(256 * BLOCK);
    let Some(plain) = agent("noauth", &cfg, &[&src]) else {
        return;
    };
    let Some(strict) = agent_with_auth(
        "strict",
        &cfg,
        &[&dst],
        ControlAuth::new(AuthMode::Required, &[key]).unwrap(),
    ) else {
        return;
    };
    let Some(signing) = agent_with_auth(
        "signing",
        &cfg,
        &[&dst],
        ControlAuth::new(AuthMode::Optional, &[key]).unwrap(),
    ) else {
        return;
    };
    // The handshakes say who signs and who requires: off ↔ required is
    // incompatible both ways (its control connections would be refused),
    // so hand-offs take the standard path at once instead of timing out.
    connect(&plain, &strict);
    assert!(!plain.has_peer_handshake(strict.name()));
    assert!(!strict.has_peer_handshake(plain.name()));
    let why = format!(
        "{:?}",
        plain
            .peers()
            .into_iter()
            .find(|(n, _)| n == strict.name())
            .unwrap()
            .1
            .bounce
    );
    assert!(why.contains("ControlAuth"), "{why}");
    let descs = block_descs(&src, 0, &dst, &permutation(256, 5), BLOCK);
    fill(&mut src, &descs, 5);
    let (path, h) = plain.submit_write(strict.name(), descs.clone());
    assert_eq!(path, PathKind::Standard);
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(&dst, &descs, 5).unwrap();
    // off ↔ optional (the rollout step): bounce.
    connect(&plain, &signing);
    assert!(plain.has_peer_handshake(signing.name()));
    let descs = block_descs(&src, 0, &dst, &permutation(256, 6), BLOCK);
    fill(&mut src, &descs, 6);
    let (path, h) = plain.submit_write(signing.name(), descs.clone());
    assert_eq!(path, PathKind::Bounce);
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(&dst, &descs, 6).unwrap();
}
