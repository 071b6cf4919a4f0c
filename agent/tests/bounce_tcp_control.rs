//! Bounce end to end over the direct TCP control channel (bounce config
//! `controlTransport: tcp`), real NIXL, byte-exact; and a ZMQ agent next to
//! a TCP one falls back to the standard path (the handshake checks the
//! control kind).

mod common;

use std::time::Duration;

use common::*;
use kvfabric_agent::core::config::ControlTransport;
use kvfabric_agent::core::ControlKind;
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
