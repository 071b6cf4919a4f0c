//! Leader election against a REAL kube-apiserver (e2e/kube/up.sh): two
//! `kvfabric-operator` processes with `--leader-elect` on one Lease.
//!
//! Asserts: exactly one holds the Lease and acts (its
//! `kvfabric_operator_leader` is 1 and it reconciles the `KvFabric`: the
//! finalizer and status are written), the other does not act (leader 0, no
//! reconcile); SIGKILL of the leader hands over within the lease duration
//! plus one retry period (plus 1 s slack for this loaded 2-core machine);
//! the new leader acts (deleting the `KvFabric` runs its finalizer); a third
//! replica takes over from a SIGTERMed leader at once, because the leader
//! releases the Lease on the way out (well under the lease duration).
//!
//! SKIP without the control-plane tools; fails instead under
//! `KVFABRIC_REQUIRE_SERVICES=1`.

mod kube_common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, PostParams};
use kube_common::{wait_for, Cluster};
use kvfabric_operator::crd::KvFabric;
use serde_json::json;

const LEASE_MS: u64 = 3000;
const RENEW_MS: u64 = 2000;
const RETRY_MS: u64 = 250;

/// An operator process, SIGKILLed on drop.
struct Operator {
    child: Child,
    metrics: SocketAddr,
    id: String,
}

impl Operator {
    fn spawn(kubeconfig: &std::path::Path, id: &str) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvfabric-operator"))
            .args([
                "--kubeconfig",
                &kubeconfig.display().to_string(),
                "--metrics-listen",
                "127.0.0.1:0",
                "--leader-elect",
                "--leader-election-namespace",
                "default",
                "--leader-election-lease-name",
                "kvfabric-operator-test",
                "--leader-election-identity",
                id,
                "--leader-election-lease-duration-ms",
                &LEASE_MS.to_string(),
                "--leader-election-renew-deadline-ms",
                &RENEW_MS.to_string(),
                "--leader-election-retry-ms",
                &RETRY_MS.to_string(),
            ])
            .env("KVFABRIC_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvfabric-operator");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(a) = line.split("metrics on http://").nth(1) {
                    if let Ok(a) = a.trim_end_matches("/metrics").parse::<SocketAddr>() {
                        let _ = tx.send(a);
                    }
                }
            }
        });
        let metrics = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("operator printed its metrics address");
        Self {
            child,
            metrics,
            id: id.to_string(),
        }
    }

    /// The value of an unlabelled or single-series metric, `None` when the
    /// series is absent or the endpoint does not answer.
    fn metric(&self, name: &str) -> Option<f64> {
        let mut s = TcpStream::connect_timeout(&self.metrics, Duration::from_secs(2)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
        let mut raw = String::new();
        let _ = s.read_to_string(&mut raw);
        let vals: Vec<f64> = raw
            .lines()
            .filter(|l| {
                l.starts_with(name)
                    && matches!(l.as_bytes().get(name.len()), Some(b' ') | Some(b'{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        (!vals.is_empty()).then(|| vals.iter().sum())
    }

    fn leading(&self) -> bool {
        self.metric("kvfabric_operator_leader") == Some(1.0)
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill {sig} {}", self.child.id());
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn holder(leases: &Api<Lease>) -> Option<String> {
    leases
        .get_opt("kvfabric-operator-test")
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_acts_and_hands_over_within_the_lease() {
    let Some(cluster) = Cluster::up("kvfabric-op-leader") else {
        return;
    };
    let kubeconfig = cluster.dir.join("kubeconfig");
    let client = cluster.client().await;
    kube_common::apply_crd(&client).await;

    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    let a = Operator::spawn(&kubeconfig, "op-a");
    let b = Operator::spawn(&kubeconfig, "op-b");
    wait_for(
        "one replica holds the Lease",
        Duration::from_secs(20),
        || {
            let leases = leases.clone();
            async move { holder(&leases).await.is_some() }
        },
    )
    .await;
    let first = holder(&leases).await.expect("holder");
    let (leader, follower) = if first == a.id { (a, b) } else { (b, a) };
    assert_eq!(first, leader.id, "holder is one of the replicas");

    // The leader acts on a KvFabric; the follower does not.
    let fabrics: Api<KvFabric> = Api::namespaced(client.clone(), "default");
    let etcd = cluster.var("KVFABRIC_KUBE_ETCD").to_string();
    let f: KvFabric = serde_json::from_value(json!({
        "apiVersion": "kvfabric.io/v1alpha1", "kind": "KvFabric",
        "metadata": {"name": "leader-test"},
        "spec": {
            "agentSelector": {"matchLabels": {"app": "none"}},
            "prefillSelector": {"matchLabels": {"role": "none-p"}},
            "decodeSelector": {"matchLabels": {"role": "none-d"}},
            "etcd": {"endpoints": [etcd]}
        }
    }))
    .expect("KvFabric");
    fabrics
        .create(&PostParams::default(), &f)
        .await
        .expect("create KvFabric");
    wait_for(
        "the leader adds the finalizer and writes status",
        Duration::from_secs(15),
        || {
            let fabrics = fabrics.clone();
            async move {
                fabrics.get("leader-test").await.ok().is_some_and(|k| {
                    k.metadata
                        .finalizers
                        .unwrap_or_default()
                        .iter()
                        .any(|x| x == kvfabric_operator::controller::FINALIZER)
                        && k.status.and_then(|s| s.observed_generation).is_some()
                })
            }
        },
    )
    .await;
    wait_for("leader reconciles", Duration::from_secs(10), || {
        let v = leader.metric("kvfabric_operator_reconciles_total");
        async move { v.unwrap_or(0.0) > 0.0 }
    })
    .await;
    assert!(leader.leading(), "leader's kvfabric_operator_leader is 1");
    assert_eq!(
        follower.metric("kvfabric_operator_leader"),
        Some(0.0),
        "follower's kvfabric_operator_leader"
    );
    assert_eq!(
        follower
            .metric("kvfabric_operator_reconciles_total")
            .unwrap_or(0.0),
        0.0,
        "the follower reconciled"
    );

    // SIGKILL: no release; the follower takes over once the lease expires.
    let t0 = Instant::now();
    leader.signal("-KILL");
    let bound = Duration::from_millis(LEASE_MS + RETRY_MS + 1000);
    wait_for(
        "the follower leads after the leader was killed",
        bound,
        || {
            let l = follower.leading();
            async move { l }
        },
    )
    .await;
    let handover = t0.elapsed();
    assert_eq!(holder(&leases).await.as_deref(), Some(follower.id.as_str()));
    println!(
        "SIGKILL of the leader → follower leads after {:.0} ms (lease {LEASE_MS} ms, retry {RETRY_MS} ms)",
        handover.as_secs_f64() * 1e3
    );
    drop(leader);

    // The new leader acts: deleting the KvFabric runs its finalizer.
    fabrics
        .delete("leader-test", &DeleteParams::default())
        .await
        .expect("delete KvFabric");
    wait_for(
        "the new leader finalizes the deleted KvFabric",
        Duration::from_secs(15),
        || {
            let fabrics = fabrics.clone();
            async move { matches!(fabrics.get_opt("leader-test").await, Ok(None)) }
        },
    )
    .await;

    // SIGTERM: the leader releases the Lease; a waiting replica takes over
    // without waiting for expiry.
    let c = Operator::spawn(&kubeconfig, "op-c");
    tokio::time::sleep(Duration::from_millis(2 * RETRY_MS)).await;
    assert!(
        !c.leading(),
        "op-c leads while op-{} holds the Lease",
        follower.id
    );
    let t1 = Instant::now();
    follower.signal("-TERM");
    wait_for(
        "op-c leads after the leader was stopped",
        Duration::from_millis(LEASE_MS),
        || {
            let l = c.leading();
            async move { l }
        },
    )
    .await;
    let released = t1.elapsed();
    println!(
        "SIGTERM of the leader (lease released) → next replica leads after {:.0} ms",
        released.as_secs_f64() * 1e3
    );
    let transitions = leases
        .get("kvfabric-operator-test")
        .await
        .expect("lease")
        .spec
        .and_then(|s| s.lease_transitions)
        .unwrap_or(0);
    assert!(transitions >= 2, "leaseTransitions {transitions}");
    drop(follower);
    drop(c);
    drop(cluster);
}
