//! Control channels (seed §4 `ControlChannel`, §5 endpoints, §9 "Control
//! message can't be sent"): ZMQ over 127.0.0.1 and NIXL notifications
//! between two in-process agents.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric_agent::runtime::control::notif::NixlNotifControlChannel;
use kvfabric_agent::runtime::control::zmq::{
    local_routable_ip, tcp_endpoint, validate_endpoint, BindAddr, ZmqControlChannel, SEND_HWM,
};
use kvfabric_agent::runtime::control::{ControlChannel, ControlError};
use kvfabric_agent::runtime::engine::{EngineError, NixlTransferEngine, TransferEngine};

const WAIT: Duration = Duration::from_secs(5);

fn pair() -> (ZmqControlChannel, ZmqControlChannel) {
    let mut a = ZmqControlChannel::bind("alpha", BindAddr::Loopback).expect("bind alpha");
    let mut b = ZmqControlChannel::bind("bravo", BindAddr::Loopback).expect("bind bravo");
    let (ea, eb) = (a.local_endpoint(), b.local_endpoint());
    a.add_peer("bravo", &eb).expect("alpha adds bravo");
    b.add_peer("alpha", &ea).expect("bravo adds alpha");
    (a, b)
}

fn recv_one(ch: &mut dyn ControlChannel) -> (String, Vec<u8>) {
    ch.recv(WAIT)
        .expect("recv")
        .expect("a message within the timeout")
}

#[test]
fn zmq_endpoint_is_concrete_loopback() {
    let a = ZmqControlChannel::bind("alpha", BindAddr::Loopback).unwrap();
    let ep = String::from_utf8(a.local_endpoint()).unwrap();
    assert!(ep.starts_with("tcp://127.0.0.1:"), "{ep}");
    assert!(!ep.ends_with(":*") && !ep.ends_with(":0"), "{ep}");
    validate_endpoint("self", ep.as_bytes()).expect("own endpoint validates");
}

#[test]
fn zmq_exchange_both_ways() {
    let (mut a, mut b) = pair();
    a.send_to("bravo", b"want from alpha").unwrap();
    assert_eq!(
        recv_one(&mut b),
        ("alpha".to_string(), b"want from alpha".to_vec())
    );
    b.send_to("alpha", b"grant from bravo").unwrap();
    assert_eq!(
        recv_one(&mut a),
        ("bravo".to_string(), b"grant from bravo".to_vec())
    );
    // Ordering is preserved per peer, and an empty message is a message.
    for i in 0..100u32 {
        a.send_to("bravo", &i.to_le_bytes()).unwrap();
    }
    a.send_to("bravo", b"").unwrap();
    for i in 0..100u32 {
        assert_eq!(recv_one(&mut b).1, i.to_le_bytes());
    }
    assert_eq!(recv_one(&mut b), ("alpha".to_string(), Vec::new()));
    // Nothing more: a zero timeout polls and returns None.
    assert!(b.recv(Duration::ZERO).unwrap().is_none());
    let t = Instant::now();
    assert!(b.recv(Duration::from_millis(50)).unwrap().is_none());
    assert!(t.elapsed() >= Duration::from_millis(45));
}

#[test]
fn zmq_reverse_path_bootstrap() {
    // Seed §5: only the sender knows the receiver; the WANT carries the
    // sender's endpoint and the receiver adds it to reply.
    let mut s = ZmqControlChannel::bind("sender", BindAddr::Loopback).unwrap();
    let mut r = ZmqControlChannel::bind("receiver", BindAddr::Loopback).unwrap();
    s.add_peer("receiver", &r.local_endpoint()).unwrap();
    s.send_to("receiver", &s.local_endpoint()).unwrap();
    let (from, ep) = recv_one(&mut r);
    assert_eq!(from, "sender");
    assert!(!r.has_peer("sender"));
    r.add_peer(&from, &ep).unwrap();
    assert!(r.has_peer("sender"));
    r.send_to("sender", b"GRANT").unwrap();
    assert_eq!(recv_one(&mut s), ("receiver".into(), b"GRANT".to_vec()));
}

#[test]
fn zmq_invalid_endpoints_rejected() {
    let mut a = ZmqControlChannel::bind("alpha", BindAddr::Loopback).unwrap();
    let long = format!("tcp://{}.example:5555", "a".repeat(300));
    let bad: Vec<&[u8]> = vec![
        b"",
        b"\xff\xfe\x00garbage\x80",
        b"tcp://127.0.0.1",
        b"tcp://127.0.0.1:",
        b"tcp://127.0.0.1:0",
        b"tcp://127.0.0.1:70000",
        b"tcp://127.0.0.1:65536",
        b"tcp://127.0.0.1:+80",
        b"tcp://127.0.0.1:-1",
        b"tcp://127.0.0.1:8x",
        b"tcp://*:5",
        b"tcp://*:*",
        b"tcp://127.0.0.1:*",
        b"tcp://0.0.0.0:5555",
        b"tcp://[::]:5555",
        b"tcp://224.0.0.1:5555",
        b"tcp://:5555",
        b"tcp://999.1.1.1:5555",
        b"tcp://1.2.3:5555",
        b"tcp://::1:5555",
        b"tcp://[::1:5555",
        b"tcp://[not-v6]:5555",
        b"tcp://[::1%]:5555",
        b"tcp://host_name:5555",
        b"tcp://-bad.example:5555",
        b"tcp://a..b:5555",
        b"tcp://10.0.0.1:1;10.0.0.2:2",
        b"tcp://10.0.0.1 :5555",
        b"ipc:///tmp/sock",
        b"udp://10.0.0.1:5555",
        b"TCP://10.0.0.1:5555",
        b"10.0.0.1:5555",
        long.as_bytes(),
    ];
    for ep in bad {
        match a.add_peer("p", ep) {
            Err(ControlError::InvalidEndpoint { peer, .. }) => assert_eq!(peer, "p"),
            other => panic!(
                "{:?} should be rejected, got {other:?}",
                String::from_utf8_lossy(ep)
            ),
        }
        assert!(!a.has_peer("p"), "{:?}", String::from_utf8_lossy(ep));
    }
    let good: &[&[u8]] = &[
        b"tcp://127.0.0.1:1",
        b"tcp://10.1.2.3:65535",
        b"tcp://[::1]:5555",
        b"tcp://[fd00::1:2]:5555",
        b"tcp://[fe80::1%eth0]:5555",
        b"tcp://node-7.cluster.local:5555",
        b"tcp://localhost:5555",
    ];
    for ep in good {
        validate_endpoint("p", ep)
            .unwrap_or_else(|e| panic!("{:?} should be valid: {e}", String::from_utf8_lossy(ep)));
    }
    // A bad endpoint does not disturb an existing route.
    let b = ZmqControlChannel::bind("bravo", BindAddr::Loopback).unwrap();
    a.add_peer("bravo", &b.local_endpoint()).unwrap();
    assert!(matches!(
        a.add_peer("bravo", b"tcp://*:5"),
        Err(ControlError::InvalidEndpoint { .. })
    ));
    assert!(a.has_peer("bravo"));
}

#[test]
fn zmq_unknown_peer() {
    let (mut a, _b) = pair();
    assert!(matches!(
        a.send_to("nobody", b"x"),
        Err(ControlError::UnknownPeer(p)) if p == "nobody"
    ));
    a.remove_peer("bravo");
    assert!(!a.has_peer("bravo"));
    assert!(matches!(
        a.send_to("bravo", b"x"),
        Err(ControlError::UnknownPeer(_))
    ));
    a.remove_peer("never-added"); // no-op
}

#[test]
fn zmq_full_queue_drops_instead_of_blocking() {
    // Peer bound but never reading: the ROUTER's receive queue, the TCP
    // buffers and then our SEND_HWM fill; sends must then drop, fast.
    let mut a = ZmqControlChannel::bind("alpha", BindAddr::Loopback).unwrap();
    let b = ZmqControlChannel::bind("bravo", BindAddr::Loopback).unwrap();
    a.add_peer("bravo", &b.local_endpoint()).unwrap();
    let msg = vec![0xabu8; 16 << 10];
    let (mut sent, mut dropped) = (0u64, 0u64);
    let t = Instant::now();
    for _ in 0..50_000 {
        match a.send_to("bravo", &msg) {
            Ok(()) => sent += 1,
            Err(ControlError::Dropped(p)) => {
                assert_eq!(p, "bravo");
                dropped += 1;
                if dropped >= 2_000 {
                    break;
                }
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    let took = t.elapsed();
    eprintln!("stalled peer: sent {sent}, dropped {dropped} in {took:?}");
    assert!(dropped > 0, "no drops after {sent} sends");
    assert!(sent >= SEND_HWM as u64, "sent only {sent}");
    assert!(took < Duration::from_secs(1), "sending took {took:?}");
    assert_eq!(a.dropped_messages(), dropped);
    drop(b);

    // Peer that never comes up: exactly SEND_HWM queue, then drops.
    let mut c = ZmqControlChannel::bind("charlie", BindAddr::Loopback).unwrap();
    let dead = {
        // A port that was bound and released: nothing listens there.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    c.add_peer("dead", format!("tcp://127.0.0.1:{dead}").as_bytes())
        .unwrap();
    let t = Instant::now();
    let mut ok = 0;
    let mut drops = 0;
    for _ in 0..(SEND_HWM as usize * 3) {
        match c.send_to("dead", b"hello") {
            Ok(()) => ok += 1,
            Err(ControlError::Dropped(_)) => drops += 1,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(
        ok <= SEND_HWM as usize + 16 && ok >= SEND_HWM as usize / 2,
        "ok={ok}"
    );
    assert_eq!(ok + drops, SEND_HWM as usize * 3);
}

#[test]
fn zmq_remove_and_readd_handover() {
    let (mut a, mut b) = pair();
    let eb = b.local_endpoint();
    a.send_to("bravo", b"one").unwrap();
    assert_eq!(recv_one(&mut b).1, b"one");
    // Forget and immediately re-add: the new DEALER reuses routing id
    // "alpha" while the old TCP connection may still be alive on bravo's
    // ROUTER. With ROUTER_HANDOVER the new connection wins at once.
    for round in 0..5 {
        a.remove_peer("bravo");
        a.add_peer("bravo", &eb).unwrap();
        let m = format!("after re-add {round}");
        a.send_to("bravo", m.as_bytes()).unwrap();
        assert_eq!(recv_one(&mut b), ("alpha".to_string(), m.into_bytes()));
    }
    // Same endpoint again is a no-op that keeps the route working.
    a.add_peer("bravo", &eb).unwrap();
    a.send_to("bravo", b"idempotent").unwrap();
    assert_eq!(recv_one(&mut b).1, b"idempotent");

    // An agent restart: a fresh channel with the same name connects while
    // the old one is still connected; bravo hears the new one.
    let mut a2 = ZmqControlChannel::bind("alpha", BindAddr::Loopback).unwrap();
    a2.add_peer("bravo", &eb).unwrap();
    a2.send_to("bravo", b"from the new alpha").unwrap();
    assert_eq!(
        recv_one(&mut b),
        ("alpha".to_string(), b"from the new alpha".to_vec())
    );
    // And bravo reaches the new incarnation after re-adding its endpoint.
    b.add_peer("alpha", &a2.local_endpoint()).unwrap();
    b.send_to("alpha", b"hi new alpha").unwrap();
    assert_eq!(recv_one(&mut a2).1, b"hi new alpha");
}

#[test]
fn zmq_large_message_round_trips() {
    let (mut a, mut b) = pair();
    let big: Vec<u8> = (0..(4u32 << 20)).map(|i| (i * 31 + 7) as u8).collect();
    a.send_to("bravo", &big).unwrap();
    let (from, got) = recv_one(&mut b);
    assert_eq!(from, "alpha");
    assert_eq!(got.len(), big.len());
    assert!(got == big, "4 MiB payload corrupted");
    b.send_to("alpha", &got[..300 << 10]).unwrap();
    assert_eq!(recv_one(&mut a).1, &big[..300 << 10]);
}

#[test]
fn zmq_ipv6_loopback_if_available() {
    let mut a = match ZmqControlChannel::bind("alpha6", BindAddr::Ip("::1".parse().unwrap())) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("SKIP ipv6: cannot bind [::1] here: {e}");
            return;
        }
    };
    let ep = String::from_utf8(a.local_endpoint()).unwrap();
    assert!(ep.starts_with("tcp://[::1]:"), "{ep}");
    // An IPv4 channel's DEALER (ZMQ_IPV6 always on) reaches it.
    let mut b = ZmqControlChannel::bind("bravo4", BindAddr::Loopback).unwrap();
    b.add_peer("alpha6", ep.as_bytes()).unwrap();
    a.add_peer("bravo4", &b.local_endpoint()).unwrap();
    b.send_to("alpha6", b"v4->v6").unwrap();
    assert_eq!(recv_one(&mut a), ("bravo4".into(), b"v4->v6".to_vec()));
    a.send_to("bravo4", b"v6->v4").unwrap();
    assert_eq!(recv_one(&mut b), ("alpha6".into(), b"v6->v4".to_vec()));
}

#[test]
fn zmq_bind_addresses() {
    assert_eq!(
        tcp_endpoint("10.0.0.1".parse().unwrap(), "*"),
        "tcp://10.0.0.1:*"
    );
    assert_eq!(
        tcp_endpoint("fd00::1".parse().unwrap(), "80"),
        "tcp://[fd00::1]:80"
    );
    assert!(BindAddr::Ip("0.0.0.0".parse().unwrap()).resolve().is_err());
    assert!(BindAddr::Interface("no-such-nic0".into())
        .resolve()
        .is_err());
    assert!(ZmqControlChannel::bind("", BindAddr::Loopback).is_err());
    let lo = BindAddr::Interface("lo".into()).resolve();
    if let Ok(ip) = lo {
        assert!(ip.is_loopback(), "{ip}");
    }
    match local_routable_ip(None) {
        Ok(ip) => {
            assert!(!ip.is_loopback() && !ip.is_unspecified(), "{ip}");
            // Binding the routable address works and is advertised as is.
            let ch = ZmqControlChannel::bind("routable", BindAddr::Ip(ip)).unwrap();
            let ep = String::from_utf8(ch.local_endpoint()).unwrap();
            assert!(ep.starts_with(&tcp_endpoint(ip, "")), "{ep}");
            validate_endpoint("self", ep.as_bytes()).unwrap();
        }
        Err(e) => eprintln!("SKIP routable IP: {e}"),
    }
}

// ---------------------------------------------------------------- NIXL

fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "cc-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn engine(tag: &str) -> Option<Arc<dyn TransferEngine>> {
    match NixlTransferEngine::new(&unique(tag)) {
        Ok(e) => Some(Arc::new(e)),
        Err(EngineError::Runtime(e)) => {
            common::skip(&format!("NIXL control channel test: {e}"));
            None
        }
        Err(e) => panic!("NIXL engine: {e}"),
    }
}

/// Receives on `rx` while also progressing `other`, as two IO threads would.
/// With NIXL's progress thread off, the first notification after a peer is
/// loaded only leaves once the *sender* is progressed through UCX wire-up
/// (observed: ~20–45 ms; without it, it never arrives).
fn recv_both(
    rx: &mut NixlNotifControlChannel,
    other: &mut NixlNotifControlChannel,
) -> Option<(String, Vec<u8>)> {
    let t = Instant::now();
    while t.elapsed() < WAIT {
        if let Some(m) = rx.recv(Duration::from_millis(1)).unwrap() {
            return Some(m);
        }
        assert!(other.recv(Duration::ZERO).unwrap().is_none());
    }
    None
}

#[test]
fn nixl_notif_exchange_both_ways() {
    let (Some(ea), Some(eb)) = (engine("a"), engine("b")) else {
        return;
    };
    let (na, nb) = (ea.agent_name().to_string(), eb.agent_name().to_string());
    let mut a = NixlNotifControlChannel::new(ea);
    let mut b = NixlNotifControlChannel::new(eb);
    let (mda, mdb) = (a.local_endpoint(), b.local_endpoint());
    assert!(!mda.is_empty() && !mdb.is_empty());

    // Wrong name for the metadata, garbage and empty metadata are rejected.
    assert!(matches!(
        a.add_peer("someone-else", &mdb),
        Err(ControlError::InvalidEndpoint { .. })
    ));
    assert!(matches!(
        a.add_peer(&nb, b"\x00garbage metadata\xff"),
        Err(ControlError::InvalidEndpoint { .. })
    ));
    assert!(matches!(
        a.add_peer(&nb, b""),
        Err(ControlError::InvalidEndpoint { .. })
    ));
    assert!(matches!(
        a.send_to(&nb, b"x"),
        Err(ControlError::UnknownPeer(_))
    ));

    // Reverse-path bootstrap: only a knows b at first.
    a.add_peer(&nb, &mdb).unwrap();
    a.add_peer(&nb, &mdb).unwrap(); // idempotent
    assert!(a.has_peer(&nb));
    a.send_to(&nb, &mda).unwrap();
    let t = Instant::now();
    let (from, ep) = recv_both(&mut b, &mut a).expect("WANT via notification");
    eprintln!(
        "WANT a->b ({} B) arrived after {:?}",
        mda.len(),
        t.elapsed()
    );
    assert_eq!(from, na);
    assert_eq!(ep, mda);
    b.add_peer(&from, &ep).unwrap();
    b.send_to(&na, b"GRANT").unwrap();
    let t = Instant::now();
    let got = recv_both(&mut a, &mut b).expect("GRANT via notification");
    eprintln!("notification b->a arrived after {:?}", t.elapsed());
    assert_eq!(got, (nb.clone(), b"GRANT".to_vec()));

    // Ordering and sizes (DATA can be hundreds of KiB unmerged).
    let sizes = [1usize, 64, 4 << 10, 64 << 10, 300 << 10];
    for (i, &n) in sizes.iter().enumerate() {
        let msg: Vec<u8> = (0..n).map(|j| (i * 7 + j) as u8).collect();
        a.send_to(&nb, &msg).unwrap();
    }
    for (i, &n) in sizes.iter().enumerate() {
        // Progress the sender too while waiting (the real IO thread does).
        let mut got = None;
        let t = Instant::now();
        while got.is_none() && t.elapsed() < WAIT {
            assert!(a.recv(Duration::ZERO).unwrap().is_none());
            got = b.recv(Duration::from_millis(1)).unwrap();
        }
        let (from, msg) = got.unwrap_or_else(|| panic!("message {i} ({n} B) not received"));
        assert_eq!(from, na);
        let want: Vec<u8> = (0..n).map(|j| (i * 7 + j) as u8).collect();
        assert!(msg == want, "message {i}: {} B, want {n} B", msg.len());
    }
    assert!(b.recv(Duration::from_millis(20)).unwrap().is_none());

    // remove_peer forgets the peer; sending then fails as unknown.
    b.remove_peer(&na);
    assert!(!b.has_peer(&na));
    assert!(matches!(
        b.send_to(&na, b"x"),
        Err(ControlError::UnknownPeer(_))
    ));
    // Re-adding after a forget works.
    b.add_peer(&na, &mda).unwrap();
    b.send_to(&na, b"again").unwrap();
    assert_eq!(recv_both(&mut a, &mut b), Some((nb, b"again".to_vec())));
}
