//! `Transferring` and `Ready` from real bounce traffic, against a REAL
//! kube-apiserver (e2e/kube/up.sh) with the operator in process and two
//! real `kvfabric agent` processes (prefill, decode; bounce on; engine API
//! sockets): idle, the fabric is `Transferring=False` (NoBounceTraffic) and
//! not Ready; once `kvfabric bench` hands KV off through the agents' engine
//! API over bounce, it becomes `Transferring=True` and `Ready=True`, and
//! `TransportDegraded=False` (CPU pools: no GPU path to suspect).
//!
//! SKIP without the control-plane tools, the `kvfabric` binary or NIXL;
//! fails instead under `KVFABRIC_REQUIRE_SERVICES=1`.

mod kube_common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, PostParams};
use kube_common::{skip, wait_for, Cluster};
use kvfabric_operator::crd::KvFabric;
use kvfabric_operator::metrics::Metrics;
use serde_json::json;

fn kvfabric_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("kvfabric");
    p.is_file().then_some(p)
}

/// A `kvfabric agent`, killed on drop.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn agent(
    bin: &Path,
    etcd: &str,
    fabric: &str,
    logical: &str,
    role: &str,
    socket: &Path,
) -> Result<Agent, String> {
    let mut child = Command::new(bin)
        .args([
            "agent",
            "--etcd",
            etcd,
            "--fabric",
            fabric,
            "--logical-id",
            logical,
            "--role",
            role,
            "--listen",
            "127.0.0.1:0",
            "--pool-size",
            "4MiB",
            "--control-bind",
            "loopback",
            "--engine-socket",
        ])
        .arg(socket)
        .env("KVFABRIC_BOUNCE_ENABLE", "1")
        // Small arenas (the default, 512 MiB, is pre-faulted host memory).
        .env("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "16MiB")
        .env("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", "4MiB")
        .env("KVFABRIC_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let out = child.stdout.take().ok_or("stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if l.contains("listening on http://") {
                let _ = tx.send(());
            }
        }
    });
    let err = child.stderr.take().ok_or("stderr")?;
    let log = Arc::new(std::sync::Mutex::new(String::new()));
    let log2 = log.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            let mut g = log2.lock().unwrap_or_else(|p| p.into_inner());
            if g.len() < 16 * 1024 {
                g.push_str(&l);
                g.push('\n');
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(()) => Ok(Agent(child)),
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            std::thread::sleep(Duration::from_millis(200));
            let l = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
            Err(l)
        }
    }
}

fn condition(f: &KvFabric, ty: &str) -> Option<(String, String)> {
    f.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == ty)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_means_bounce_traffic_flows() {
    let Some(bin) = kvfabric_bin() else {
        skip("target/<profile>/kvfabric not built (cargo build -p kvfabric-agent)");
        return;
    };
    let Some(cluster) = Cluster::up("kvfabric-op-cond") else {
        return;
    };
    let etcd = cluster.var("KVFABRIC_KUBE_ETCD").to_string();
    let client = cluster.client().await;
    kube_common::apply_crd(&client).await;

    let fabric = format!("cond{}", std::process::id());
    let fabrics: Api<KvFabric> = Api::namespaced(client.clone(), "default");
    let f: KvFabric = serde_json::from_value(json!({
        "apiVersion": "kvfabric.io/v1alpha1", "kind": "KvFabric",
        "metadata": {"name": fabric},
        "spec": {
            "agentSelector": {"matchLabels": {"app": "cond-agent"}},
            "prefillSelector": {"matchLabels": {"role": "cond-prefill"}},
            "decodeSelector": {"matchLabels": {"role": "cond-decode"}},
            "etcd": {"endpoints": [etcd]}
        }
    }))
    .expect("KvFabric");
    fabrics
        .create(&PostParams::default(), &f)
        .await
        .expect("create KvFabric");
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let operator = tokio::spawn(kvfabric_operator::controller::run(client.clone(), metrics));

    let dir = std::env::temp_dir().join(format!("kvf-cond-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("socket dir");
    let (ps, ds) = (dir.join("prefill.sock"), dir.join("decode.sock"));
    let _prefill = match agent(&bin, &etcd, &fabric, "prefill", "prefill", &ps) {
        Ok(a) => a,
        Err(log) if log.contains("NIXL runtime") => {
            skip(&format!("NIXL runtime not available: {log}"));
            return;
        }
        Err(log) => panic!("prefill agent did not start:\n{log}"),
    };
    let _decode = agent(&bin, &etcd, &fabric, "decode", "decode", &ds).expect("decode agent");

    // Idle: reports answered, no bounce traffic → not Transferring, not Ready.
    let t0 = std::time::Instant::now();
    wait_for(
        "Transferring=False (NoBounceTraffic) while idle",
        Duration::from_secs(30),
        || {
            let fabrics = fabrics.clone();
            let f = fabric.clone();
            async move {
                fabrics.get(&f).await.ok().is_some_and(|k| {
                    condition(&k, "Transferring")
                        == Some(("False".into(), "NoBounceTraffic".into()))
                })
            }
        },
    )
    .await;
    let k = fabrics.get(&fabric).await.expect("get");
    assert_eq!(
        condition(&k, "Ready").map(|c| c.0).as_deref(),
        Some("False")
    );
    assert_eq!(
        condition(&k, "TransportDegraded").map(|c| c.0).as_deref(),
        Some("False")
    );

    println!("idle → Transferring=False after {:?}", t0.elapsed());
    let t1 = std::time::Instant::now();
    // Bounce traffic through the engine API.
    let out = tokio::task::spawn_blocking({
        let (bin, ps, ds, dir) = (bin.clone(), ps.clone(), ds.clone(), dir.clone());
        move || {
            Command::new(bin)
                .args([
                    "bench",
                    "--requests",
                    "4",
                    "--concurrency",
                    "4",
                    "--geometry",
                    "4,2,64,2",
                    "--tp",
                    "1",
                    "--paths",
                    "bounce",
                    "--prefill-socket",
                ])
                .arg(&ps)
                .arg("--decode-socket")
                .arg(&ds)
                .current_dir(&dir)
                .env("KVFABRIC_LOG", "warn")
                .output()
        }
    })
    .await
    .expect("join")
    .expect("run kvfabric bench");
    assert!(
        out.status.success(),
        "bench failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for(
        "Transferring=True and Ready=True after bounce traffic",
        Duration::from_secs(20),
        || {
            let fabrics = fabrics.clone();
            let f = fabric.clone();
            async move {
                fabrics.get(&f).await.ok().is_some_and(|k| {
                    condition(&k, "Transferring").map(|c| c.0).as_deref() == Some("True")
                        && condition(&k, "Ready") == Some(("True".into(), "AsExpected".into()))
                })
            }
        },
    )
    .await;
    println!("bench + Ready=True after {:?}", t1.elapsed());
    operator.abort();
    let _ = std::fs::remove_dir_all(&dir);
    drop(cluster);
}
