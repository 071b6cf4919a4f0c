//! etcd discovery against a real etcd started by each test (free ports, a
//! temporary data dir, killed at the end): publish + watch, graceful revoke,
//! lease expiry ⇒ forgetPeer, agent restart ⇒ new incarnation loaded and the
//! old one forgotten first, etcd restart within the TTL ⇒ nothing forgotten
//! and the same lease kept, lease lost entirely (revoked externally, data
//! wiped) ⇒ re-granted, republished, peers reload and transfers resume.
//!
//! Set `KVFABRIC_ETCD_BIN` to pick the etcd binary (default: `etcd` on the
//! PATH, then /usr/bin/etcd). Without one every test prints
//! "SKIP: etcd not installed" and passes (fails instead under `.ci/run`,
//! which installs etcd and sets `KVFABRIC_REQUIRE_SERVICES`).

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::etcd::Etcd;
use common::*;
use crossbeam_channel::Receiver;
use kvfabric_agent::runtime::fabric::{FabricAgent, PathKind};
use kvfabric_agent::runtime::transport::TransferOutcome;
use kvfabric_agent::service::discovery::{
    AgentRecord, Discovery, EtcdDiscovery, EtcdOptions, Incarnation, LeaseState, PeerEvent,
    PeerSync,
};

const BLOCK: usize = 4096;
const SLOTS: usize = 256;

// ------------------------------------------------------------- helpers ----

fn opts(etcd: &Etcd, fabric: &str, ttl_s: u64) -> EtcdOptions {
    let mut o = EtcdOptions::new(vec![etcd.endpoint()], fabric);
    o.lease_ttl = Duration::from_secs(ttl_s);
    o.request_timeout = Duration::from_secs(1);
    o.connect_timeout = Duration::from_secs(1);
    o.backoff_max = Duration::from_millis(500);
    o
}

fn fabric(test: &str) -> String {
    format!("{test}-{}", std::process::id())
}

fn fake_record(name: &str, logical: &str) -> AgentRecord {
    let mut r = AgentRecord::new(
        &kvfabric_agent::runtime::fabric::PeerDescriptor {
            name: name.into(),
            nixl_metadata: b"not-really-nixl".to_vec(),
            handshake: None,
            draining: false,
        },
        logical,
        Incarnation::generate(),
    );
    r.node = "node-a".into();
    r.config_generation = 3;
    r
}

fn record_of(agent: &FabricAgent, logical: &str, pool: &Pool) -> AgentRecord {
    let mut r = AgentRecord::new(
        &agent.local_descriptor().unwrap(),
        logical,
        Incarnation::generate(),
    );
    r.buffers
        .push(kvfabric_agent::service::discovery::BufferRegion {
            label: "kv".into(),
            kind: "dram".into(),
            device: 0,
            addr: pool.addr(),
            len: pool.buf.len() as u64,
        });
    r
}

/// Receives events until `pred` matches one (≤ `within`); returns all seen.
fn wait_event(
    rx: &Receiver<PeerEvent>,
    within: Duration,
    mut pred: impl FnMut(&PeerEvent) -> bool,
) -> Vec<PeerEvent> {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(ev) => {
                let hit = pred(&ev);
                seen.push(ev);
                if hit {
                    return seen;
                }
            }
            Err(_) => panic!("no matching event within {within:?}; saw {seen:?}"),
        }
    }
}

fn is_upsert(name: &str) -> impl FnMut(&PeerEvent) -> bool + '_ {
    move |e| matches!(e, PeerEvent::Upsert(r) if r.name == name)
}

fn is_removed(name: &str) -> impl FnMut(&PeerEvent) -> bool + '_ {
    move |e| matches!(e, PeerEvent::Removed { name: n } if n == name)
}

fn peer_names(a: &FabricAgent) -> Vec<String> {
    a.peers().into_iter().map(|(n, _)| n).collect()
}

fn has_peer(a: &FabricAgent, peer: &str) -> bool {
    a.peers().iter().any(|(n, _)| n == peer)
}

/// One bounce WRITE of SLOTS blocks `tx` → `rx_name` (into `dst`),
/// verified byte for byte.
fn transfer_ok(tx: &FabricAgent, src: &mut Pool, rx_name: &str, dst: &Pool, seed: u64) {
    let slots = permutation(SLOTS, seed);
    let descs = block_descs(src, 0, dst, &slots, BLOCK);
    fill(src, &descs, seed);
    let (path, h) = tx.submit_write(rx_name, descs.clone());
    assert_eq!(path, PathKind::Bounce, "{} → {rx_name}", tx.name());
    assert_eq!(
        h.wait(Duration::from_secs(20)),
        Some(TransferOutcome::Success)
    );
    verify(dst, &descs, seed).unwrap();
}

/// An agent + its etcd discovery + the sync applying peer events to it.
struct Node {
    sync: PeerSync,
    disc: EtcdDiscovery,
    agent: Arc<FabricAgent>,
}

impl Node {
    /// Starts discovery, subscribes the agent, publishes its record.
    fn up(
        etcd: &Etcd,
        fabric: &str,
        ttl_s: u64,
        logical: &str,
        agent: FabricAgent,
        pool: &Pool,
    ) -> Self {
        let disc = EtcdDiscovery::start(opts(etcd, fabric, ttl_s)).unwrap();
        let agent = Arc::new(agent);
        let sync = PeerSync::spawn(agent.clone(), disc.events(), Some(logical.into()));
        disc.publish(record_of(&agent, logical, pool)).unwrap();
        Self { sync, disc, agent }
    }

    fn name(&self) -> &str {
        self.agent.name()
    }
}

fn wait_true(what: &str, within: Duration, cond: impl FnMut() -> bool) {
    assert!(wait_for(within, cond), "{what}: not within {within:?}");
}

// --------------------------------------------------------------- tests ----

#[test]
fn publish_watch_and_graceful_revoke() {
    let Some(etcd) = Etcd::start("pub") else {
        return;
    };
    let fab = fabric("pub");
    let da = EtcdDiscovery::start(opts(&etcd, &fab, 10)).unwrap();
    let db = EtcdDiscovery::start(opts(&etcd, &fab, 10)).unwrap();
    let rb = db.events();
    assert_eq!(da.lease_state(), LeaseState::Unpublished);
    let ra = fake_record("prefill-a-1", "prefill-a");
    da.publish(ra.clone()).unwrap();
    assert_eq!(da.lease_state(), LeaseState::Ok);
    assert!(da.lease_id().is_some());
    let seen = wait_event(&rb, Duration::from_secs(5), is_upsert("prefill-a-1"));
    let PeerEvent::Upsert(got) = seen.last().unwrap() else {
        unreachable!()
    };
    assert_eq!(got.nixl_metadata, ra.nixl_metadata);
    assert_eq!(got.config_generation, 3);
    assert_eq!(got.incarnation, ra.incarnation);

    // The key is where the issue says, and its value is the record's JSON.
    let key = da.key_of("prefill-a-1");
    assert_eq!(key, format!("/kvfabric/{fab}/agents/prefill-a-1"));
    let value = etcd.with_client(|c| {
        let key = key.clone();
        Box::pin(async move { c.get(key, None).await })
    });
    let stored = AgentRecord::decode(value.kvs()[0].value()).unwrap();
    assert_eq!(stored.name, "prefill-a-1");
    assert_eq!(value.kvs()[0].lease(), da.lease_id().unwrap());

    // A late subscriber starts with a snapshot of every live peer.
    db.publish(fake_record("decode-b-1", "decode-b")).unwrap();
    wait_true("a sees both", Duration::from_secs(5), || {
        da.peers().len() == 2
    });
    let late = da.events();
    let snap: Vec<_> = late.try_iter().collect();
    assert_eq!(snap.len(), 2, "{snap:?}");

    // Garbage under the prefix is ignored, not fatal.
    etcd.with_client(|c| {
        let k = da.key_of("garbage-1");
        Box::pin(async move { c.put(k, "{not json", None).await })
    });

    // Graceful revoke: removed at once, long before the 10 s TTL.
    let t0 = Instant::now();
    da.revoke().unwrap();
    assert_eq!(da.lease_state(), LeaseState::Revoked);
    wait_event(&rb, Duration::from_secs(3), is_removed("prefill-a-1"));
    assert!(t0.elapsed() < Duration::from_secs(3));
    wait_true("b's view", Duration::from_secs(2), || {
        db.peers()
            .iter()
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>()
            == ["decode-b-1"]
    });
}

#[test]
fn lease_expiry_forgets_peer() {
    let Some(etcd) = Etcd::start("exp") else {
        return;
    };
    let fab = fabric("exp");
    let cfg = test_config("4MiB", "256KiB", 2);
    let pa = Pool::new(SLOTS * BLOCK);
    let pb = Pool::new(SLOTS * BLOCK);
    let Some(fa) = agent("prefill", &cfg, &[&pa]) else {
        return;
    };
    let Some(fb) = agent("decode", &cfg, &[&pb]) else {
        return;
    };
    let a = Node::up(&etcd, &fab, 2, "prefill", fa, &pa);
    let b = Node::up(&etcd, &fab, 2, "decode", fb, &pb);
    let b_name = b.name().to_string();
    wait_true("a loads b", Duration::from_secs(10), || {
        has_peer(&a.agent, &b_name)
    });
    wait_true("b loads a", Duration::from_secs(10), || {
        has_peer(&b.agent, a.name())
    });
    assert!(a.agent.has_peer_handshake(&b_name));

    // b "crashes": its keep-alive stops, nothing is revoked.
    let t0 = Instant::now();
    let Node {
        sync,
        disc,
        agent: b_agent,
        ..
    } = b;
    drop(sync);
    drop(disc);
    wait_true("a forgets b after the TTL", Duration::from_secs(8), || {
        a.agent.stats().peers_forgotten.load(Ordering::SeqCst) == 1
    });
    assert!(!has_peer(&a.agent, &b_name));
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "forgotten before the lease could expire: {took:?}"
    );
    assert_eq!(a.agent.stats().peers_forgotten.load(Ordering::SeqCst), 1);
    assert_eq!(a.sync.stats().forgotten.load(Ordering::SeqCst), 1);
    assert_eq!(a.disc.lease_state(), LeaseState::Ok);
    assert_eq!(a.disc.peers().len(), 1, "only a itself is left");
    drop(a);
    drop(b_agent);
}

#[test]
fn restart_loads_new_incarnation_and_forgets_old_first() {
    let Some(etcd) = Etcd::start("inc") else {
        return;
    };
    let fab = fabric("inc");
    let cfg = test_config("4MiB", "256KiB", 2);
    let mut pa = Pool::new(SLOTS * BLOCK);
    let pb1 = Pool::new(SLOTS * BLOCK);
    let pb2 = Pool::new(SLOTS * BLOCK);
    let Some(fa) = agent("prefill", &cfg, &[&pa]) else {
        return;
    };
    let Some(fb1) = agent("decode", &cfg, &[&pb1]) else {
        return;
    };
    // TTL 10 s: anything forgotten within a few seconds was replaced, not
    // expired.
    let a = Node::up(&etcd, &fab, 10, "prefill", fa, &pa);
    let b1 = Node::up(&etcd, &fab, 10, "decode-0", fb1, &pb1);
    let old = b1.name().to_string();
    wait_true("a loads b1", Duration::from_secs(10), || {
        has_peer(&a.agent, &old)
    });
    transfer_ok(&a.agent, &mut pa, &old, &pb1, 1);

    // b crashes (no revoke: its key lingers until the TTL) and restarts as a
    // new incarnation with new memory.
    drop(b1);
    std::thread::sleep(Duration::from_millis(5));
    let Some(fb2) = agent("decode", &cfg, &[&pb2]) else {
        return;
    };
    let t0 = Instant::now();
    let b2 = Node::up(&etcd, &fab, 10, "decode-0", fb2, &pb2);
    let new = b2.name().to_string();
    assert_ne!(old, new);
    wait_true("a swaps b1 for b2", Duration::from_secs(5), || {
        peer_names(&a.agent) == [new.clone()]
            && a.agent.stats().peers_forgotten.load(Ordering::SeqCst) == 1
    });
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "replacement must not wait for the old TTL"
    );
    assert_eq!(a.agent.stats().peers_forgotten.load(Ordering::SeqCst), 1);
    // The new incarnation's restarted discovery sees the old key but never
    // loads its predecessor (same logical id).
    assert!(!b2.sync.loaded().contains(&old));

    // Transfers go to the new incarnation, byte-exact; none can reach the
    // old metadata.
    transfer_ok(&a.agent, &mut pa, &new, &pb2, 2);
    let descs = block_descs(&pa, 0, &pb1, &permutation(SLOTS, 3), BLOCK);
    let (path, h) = a.agent.submit_write(&old, descs);
    assert_eq!(
        path,
        PathKind::Standard,
        "no handshake left for the old incarnation"
    );
    assert!(matches!(
        h.wait(Duration::from_secs(10)),
        Some(TransferOutcome::Failure(_))
    ));
    drop(b2);
    drop(a);
}

#[test]
fn etcd_restart_within_ttl_forgets_nothing() {
    let Some(mut etcd) = Etcd::start("rst") else {
        return;
    };
    let fab = fabric("rst");
    let cfg = test_config("4MiB", "256KiB", 2);
    let mut pa = Pool::new(SLOTS * BLOCK);
    let pb = Pool::new(SLOTS * BLOCK);
    let Some(fa) = agent("prefill", &cfg, &[&pa]) else {
        return;
    };
    let Some(fb) = agent("decode", &cfg, &[&pb]) else {
        return;
    };
    let a = Node::up(&etcd, &fab, 6, "prefill", fa, &pa);
    let b = Node::up(&etcd, &fab, 6, "decode", fb, &pb);
    wait_true("a loads b", Duration::from_secs(10), || {
        has_peer(&a.agent, b.name())
    });
    wait_true("b loads a", Duration::from_secs(10), || {
        has_peer(&b.agent, a.name())
    });
    let (lease_a, lease_b) = (a.disc.lease_id(), b.disc.lease_id());
    let ka = a.disc.keepalives();
    let rx = a.disc.events();
    let _ = rx.try_iter().count();

    etcd.kill();
    std::thread::sleep(Duration::from_millis(1500));
    etcd.spawn();
    // Watch a TTL's worth of time past the restart: no removal anywhere,
    // the same leases, keep-alives flowing again.
    let until = Instant::now() + Duration::from_secs(7);
    while Instant::now() < until {
        if let Ok(ev) = rx.recv_timeout(Duration::from_millis(100)) {
            assert!(
                !matches!(ev, PeerEvent::Removed { .. }),
                "unexpected {ev:?}"
            );
        }
    }
    for n in [&a, &b] {
        assert_eq!(
            n.agent.stats().peers_forgotten.load(Ordering::SeqCst),
            0,
            "{}",
            n.name()
        );
        assert_eq!(n.sync.stats().forgotten.load(Ordering::SeqCst), 0);
        assert_eq!(n.disc.lease_grants(), 1, "{} re-granted", n.name());
        assert!(n.disc.is_watching());
    }
    wait_true("leases confirmed again", Duration::from_secs(5), || {
        a.disc.lease_state() == LeaseState::Ok && b.disc.lease_state() == LeaseState::Ok
    });
    assert_eq!((a.disc.lease_id(), b.disc.lease_id()), (lease_a, lease_b));
    assert!(a.disc.keepalives() > ka);
    transfer_ok(&a.agent, &mut pa, b.name(), &pb, 4);
}

#[test]
fn lease_lost_entirely_is_regranted_and_peers_reload() {
    let Some(mut etcd) = Etcd::start("lost") else {
        return;
    };
    let fab = fabric("lost");
    let cfg = test_config("4MiB", "256KiB", 2);
    let mut pa = Pool::new(SLOTS * BLOCK);
    let mut pb = Pool::new(SLOTS * BLOCK);
    let Some(fa) = agent("prefill", &cfg, &[&pa]) else {
        return;
    };
    let Some(fb) = agent("decode", &cfg, &[&pb]) else {
        return;
    };
    let a = Node::up(&etcd, &fab, 3, "prefill", fa, &pa);
    let b = Node::up(&etcd, &fab, 3, "decode", fb, &pb);
    let a_name = a.name().to_string();
    wait_true("b loads a", Duration::from_secs(10), || {
        has_peer(&b.agent, &a_name)
    });
    wait_true("a loads b", Duration::from_secs(10), || {
        has_peer(&a.agent, b.name())
    });
    let rx = b.disc.events();
    let _ = rx.try_iter().count();

    // 1. Someone revokes a's lease behind its back.
    let lease = a.disc.lease_id().unwrap();
    etcd.with_client(|c| Box::pin(async move { c.lease_revoke(lease).await }));
    let seen = wait_event(&rx, Duration::from_secs(5), is_upsert(&a_name));
    assert!(seen.iter().any(is_removed(&a_name)), "{seen:?}");
    wait_true("a re-granted", Duration::from_secs(5), || {
        a.disc.lease_grants() == 2 && a.disc.lease_state() == LeaseState::Ok
    });
    assert_ne!(a.disc.lease_id(), Some(lease));
    wait_true("b reloads a", Duration::from_secs(5), || {
        has_peer(&b.agent, &a_name) && b.sync.stats().loaded.load(Ordering::SeqCst) == 2
    });
    assert_eq!(b.sync.stats().forgotten.load(Ordering::SeqCst), 1);
    transfer_ok(&b.agent, &mut pb, &a_name, &pa, 5);
    transfer_ok(&a.agent, &mut pa, b.name(), &pb, 6);

    // 2. etcd loses everything (data wiped): both agents re-grant and
    //    republish without restarting; each sees the other again.
    let (ga, gb) = (a.disc.lease_grants(), b.disc.lease_grants());
    etcd.kill();
    etcd.wipe();
    etcd.spawn();
    wait_true("both re-granted", Duration::from_secs(15), || {
        a.disc.lease_grants() > ga
            && b.disc.lease_grants() > gb
            && a.disc.lease_state() == LeaseState::Ok
            && b.disc.lease_state() == LeaseState::Ok
    });
    wait_true("both republished and seen", Duration::from_secs(10), || {
        a.disc.peers().len() == 2 && b.disc.peers().len() == 2
    });
    wait_true("peers loaded again", Duration::from_secs(5), || {
        has_peer(&a.agent, b.name()) && has_peer(&b.agent, &a_name)
    });
    transfer_ok(&a.agent, &mut pa, b.name(), &pb, 7);
    transfer_ok(&b.agent, &mut pb, &a_name, &pa, 8);
}

/// The etcd-free default: agents of one process find each other through an
/// [`EmbeddedRegistry`] (runs without etcd).
#[test]
fn embedded_registry_wires_agents_without_etcd() {
    use kvfabric_agent::service::discovery::EmbeddedRegistry;
    init_tracing();
    let cfg = test_config("4MiB", "256KiB", 2);
    let mut pa = Pool::new(SLOTS * BLOCK);
    let pb = Pool::new(SLOTS * BLOCK);
    let Some(fa) = agent("prefill", &cfg, &[&pa]) else {
        return;
    };
    let Some(fb) = agent("decode", &cfg, &[&pb]) else {
        return;
    };
    let (fa, fb) = (Arc::new(fa), Arc::new(fb));
    let reg = EmbeddedRegistry::new();
    let (da, db) = (reg.handle(), reg.handle());
    let sa = PeerSync::spawn(fa.clone(), da.events(), Some("prefill".into()));
    let sb = PeerSync::spawn(fb.clone(), db.events(), Some("decode".into()));
    da.publish(record_of(&fa, "prefill", &pa)).unwrap();
    db.publish(record_of(&fb, "decode", &pb)).unwrap();
    wait_true("loaded both ways", Duration::from_secs(5), || {
        has_peer(&fa, fb.name()) && has_peer(&fb, fa.name())
    });
    transfer_ok(&fa, &mut pa, fb.name(), &pb, 9);
    db.revoke().unwrap();
    wait_true("a forgets b", Duration::from_secs(5), || {
        fa.stats().peers_forgotten.load(Ordering::SeqCst) == 1
    });
    assert_eq!(reg.peers().len(), 1);
    drop((sa, sb));
}

/// Issue 11 item 4: against an etcd started with its defaults
/// (`--grpc-keepalive-min-time` 5 s), the connections stay up — no watch
/// resync and no lease re-grant over 20 s, while keep-alives keep
/// flowing. With 2 s HTTP/2 pings etcd closed the connection every ~8 s.
#[test]
fn default_etcd_keeps_the_connection_no_resyncs() {
    let Some(etcd) = Etcd::start("keepalive") else {
        return;
    };
    // Default options (TTL 10 s, default timeouts), as the daemon uses.
    let d = EtcdDiscovery::start(EtcdOptions::new(
        vec![etcd.endpoint()],
        &fabric("keepalive"),
    ))
    .expect("discovery starts");
    d.publish(fake_record("ka-1", "ka")).expect("published");
    wait_true("watch up", Duration::from_secs(10), || d.is_watching());
    let before = d.keepalives();
    std::thread::sleep(Duration::from_secs(20));
    assert_eq!(d.resyncs(), 0, "the watch was lost and re-read");
    assert_eq!(d.lease_grants(), 1, "the lease was re-granted");
    assert_eq!(d.lease_state(), LeaseState::Ok);
    assert!(
        d.keepalives() >= before + 4,
        "keep-alives confirmed: {} → {}",
        before,
        d.keepalives()
    );
    assert!(d.is_watching());
}

/// Issue 14, tombstones: the operator deletes a dead pod's record and
/// writes `/kvfabric/<fabric>/tombstones/<pod uid>`. Peers drop the record
/// and never load it again (a late put of it is ignored), and the agent
/// itself does not put its record back (it would resurrect a dead peer).
#[test]
fn tombstoned_pod_uid_is_never_loaded_again() {
    let Some(etcd) = Etcd::start("tomb") else {
        return;
    };
    let fab = fabric("tomb");
    let da = EtcdDiscovery::start(opts(&etcd, &fab, 10)).unwrap();
    let db = EtcdDiscovery::start(opts(&etcd, &fab, 10)).unwrap();
    let rb = db.events();
    let mut ra = fake_record("prefill-p-1", "prefill-p");
    ra.pod_uid = "uid-1234".into();
    da.publish(ra.clone()).unwrap();
    wait_event(&rb, Duration::from_secs(5), is_upsert("prefill-p-1"));
    // Without a tombstone a deleted own key is put back (lease loss etc.).
    let key = da.key_of("prefill-p-1");
    let k2 = key.clone();
    etcd.with_client(|c| Box::pin(async move { c.delete(k2, None).await }));
    // The peer sees the removal, then the republish (checking its peer
    // list instead would pass before either arrived, and leave both
    // events in the channel for the assertions below).
    wait_event(&rb, Duration::from_secs(5), is_removed("prefill-p-1"));
    wait_event(&rb, Duration::from_secs(5), is_upsert("prefill-p-1"));
    // The operator's invalidation: tombstone + delete, in one transaction.
    let tomb = format!("/kvfabric/{fab}/tombstones/uid-1234");
    let k3 = key.clone();
    etcd.with_client(|c| {
        Box::pin(async move {
            use etcd_client::{Txn, TxnOp};
            c.txn(Txn::new().and_then([
                TxnOp::put(tomb, "pod deleted", None),
                TxnOp::delete(k3, None),
            ]))
            .await
        })
    });
    wait_event(&rb, Duration::from_secs(3), is_removed("prefill-p-1"));
    // The agent does not put it back; a late put of the record (a stale
    // writer) is ignored by peers.
    std::thread::sleep(Duration::from_millis(1500));
    let k4 = key.clone();
    let got = etcd.with_client(|c| Box::pin(async move { c.get(k4, None).await }));
    assert!(
        got.kvs().is_empty(),
        "the invalidated agent put its record back"
    );
    let value = ra.encode();
    let k5 = key.clone();
    etcd.with_client(|c| Box::pin(async move { c.put(k5, value, None).await }));
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !db.peers().iter().any(|r| r.name == "prefill-p-1"),
        "a tombstoned pod's record was loaded again"
    );
    let after: Vec<PeerEvent> = rb.try_iter().collect();
    assert!(
        !after
            .iter()
            .any(|e| matches!(e, PeerEvent::Upsert(r) if r.name == "prefill-p-1")),
        "an Upsert of the tombstoned record reached the peer: {after:?}"
    );
    // A second agent reading the store afresh skips it too.
    let dc = EtcdDiscovery::start(opts(&etcd, &fab, 10)).unwrap();
    wait_true("c watching", Duration::from_secs(5), || dc.is_watching());
    assert!(!dc.peers().iter().any(|r| r.name == "prefill-p-1"));
}

/// A put does not renew an etcd lease: republishing more often than the
/// keep-alive interval (engines attaching and detaching, rollout steps)
/// must not postpone the keep-alives, or the lease expires under a live
/// agent and every peer forgets it. Regression: the record of an agent
/// republished every 300 ms vanished after one TTL (2 s here).
#[test]
fn frequent_republishes_keep_the_lease_alive() {
    let Some(etcd) = Etcd::start("republish") else {
        return;
    };
    let fab = fabric("republish");
    let da = EtcdDiscovery::start(opts(&etcd, &fab, 2)).unwrap();
    let db = EtcdDiscovery::start(opts(&etcd, &fab, 2)).unwrap();
    let rb = db.events();
    let mut rec = fake_record("agent-r-1", "agent-r");
    da.publish(rec.clone()).unwrap();
    wait_event(&rb, Duration::from_secs(5), is_upsert("agent-r-1"));
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(6) {
        rec.config_generation += 1;
        da.publish(rec.clone()).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !rb.try_iter()
                .any(|e| matches!(&e, PeerEvent::Removed { name } if name == "agent-r-1")),
            "the record vanished after {:?} of republishes (lease expired)",
            t0.elapsed()
        );
    }
    assert_eq!(da.lease_grants(), 1, "one lease, kept alive throughout");
    assert!(da.keepalives() >= 2, "keep-alives ran: {}", da.keepalives());
}
