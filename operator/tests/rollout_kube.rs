//! Generation-isolated config rollout (issue 14, item 4) against a REAL
//! kube-apiserver (e2e/kube/up.sh) and etcd, with the operator in process
//! and three real `kvfabric agent` processes (prefill and decode with
//! engine sockets, and a third agent), under continuous hand-off load from
//! `kvfabric bench --paths auto` through the engine API:
//!
//! 1. the fabric converges on generation 1 (`Progressing=False
//!    RolloutComplete`, every agent's `/v1/config` at generation 1 with the
//!    spec's arena);
//! 2. changing `spec.bounce.arenaSizeBytes` rolls generation 2 out one
//!    agent at a time (`maxUnavailable: 1`) while bench runs hand KV off
//!    back to back, alternately AUTO and BOUNCE (bounce required, as for GPU
//!    pools): **every bench run succeeds (zero failed transfers)**,
//!    the agents rebuild their arenas in process (same incarnation, same
//!    PID, engines attached by a running bench stay attached), mixed pairs
//!    took the standard path, bounce resumes afterwards, status reaches
//!    `Ready=True` at generation 2, and `RolloutStarted` / `RolloutStep` /
//!    `RolloutComplete` Events are recorded;
//! 3. an arena no agent can allocate (schema-valid: 1 PiB) is refused by
//!    the first agent assigned it, which rolls back to its running config:
//!    the fabric is `Degraded=True ConfigRefused`, the rollout halts
//!    (`Progressing=False RolloutHalted`), and every agent still runs
//!    generation 2 with its arena;
//! 4. a spec the apiserver's schema refuses (granularity not a power of
//!    two) never reaches the operator.
//!
//! SKIP without the control-plane tools, the `kvfabric` binary or NIXL;
//! fails instead under `KVFABRIC_REQUIRE_SERVICES=1`.

mod kube_common;

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{Api, Patch, PatchParams, PostParams};
use kube_common::agent::{get_json, get_text, kvfabric_bin, AgentProc};
use kube_common::{skip, wait_for, Cluster};
use kvfabric_operator::crd::KvFabric;
use kvfabric_operator::metrics::Metrics;
use serde_json::json;

const ARENA_1: u64 = 16 << 20;
const ARENA_2: u64 = 24 << 20;
/// 1 PiB: schema-valid, beyond any agent's address space.
const ARENA_HUGE: u64 = 1 << 50;

fn condition(f: &KvFabric, ty: &str) -> Option<(String, String)> {
    f.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == ty)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

/// `(config_generation, arena_usable_capacity_bytes, draining)` of an
/// agent's `/v1/config`.
fn effective(a: &AgentProc) -> (u64, u64, bool) {
    let v = get_json(a.addr, "/v1/config");
    let e = &v["bounce_effective"];
    (
        e["config_generation"].as_u64().unwrap_or(0),
        e["arena_usable_capacity_bytes"].as_u64().unwrap_or(0),
        e["draining"].as_bool().unwrap_or(false),
    )
}

/// Sum of `kvfabric_submissions_total` samples with `path="<path>"`.
fn submissions(a: &AgentProc, path: &str) -> f64 {
    let label = format!("path=\"{path}\"");
    get_text(a.addr, "/metrics")
        .lines()
        .filter(|l| l.starts_with("kvfabric_submissions_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One bench run through the engine API over `path` (`auto`: the routing
/// gate picks; `bounce`: bounce required, as for GPU pools, which have no
/// standard path): `Ok(seconds)` or the output of a failed run.
fn bench(
    bin: &Path,
    dir: &Path,
    ps: &Path,
    ds: &Path,
    start: usize,
    path: &str,
) -> Result<f64, String> {
    let t = Instant::now();
    let start = start.to_string();
    let out = Command::new(bin)
        .args([
            "bench",
            "--start",
            &start,
            "--requests",
            "48",
            "--concurrency",
            "8",
            "--geometry",
            "2,1,32,2",
            "--tp",
            "1",
            "--paths",
            path,
            "--quiet",
            "--prefill-socket",
        ])
        .arg(ps)
        .arg("--decode-socket")
        .arg(ds)
        .args(["--wait", "20", "--json"])
        .arg(dir.join(format!("bench-{start}.json")))
        .current_dir(dir)
        .env("KVFABRIC_LOG", "warn")
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(t.elapsed().as_secs_f64())
    } else {
        Err(format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arena_change_rolls_out_in_process_with_zero_failed_transfers() {
    let Some(bin) = kvfabric_bin() else {
        skip("target/<profile>/kvfabric not built (cargo build -p kvfabric-agent)");
        return;
    };
    let Some(cluster) = Cluster::up("kvfabric-op-rollout") else {
        return;
    };
    let etcd = cluster.var("KVFABRIC_KUBE_ETCD").to_string();
    let client = cluster.client().await;
    kube_common::apply_crd(&client).await;

    let fabric = format!("roll{}", std::process::id());
    let fabrics: Api<KvFabric> = Api::namespaced(client.clone(), "default");
    let spec = |arena: u64| {
        json!({
            "agentSelector": {"matchLabels": {"app": "roll-agent"}},
            "prefillSelector": {"matchLabels": {"role": "roll-prefill"}},
            "decodeSelector": {"matchLabels": {"role": "roll-decode"}},
            "etcd": {"endpoints": [etcd]},
            "bounce": {"enabled": true, "arenaSizeBytes": arena, "maxChunkSizeBytes": 1 << 20},
            "rollout": {"maxUnavailable": 1}
        })
    };
    let f: KvFabric = serde_json::from_value(json!({
        "apiVersion": "kvfabric.io/v1alpha1", "kind": "KvFabric",
        "metadata": {"name": fabric},
        "spec": spec(ARENA_1),
    }))
    .expect("KvFabric");
    fabrics
        .create(&PostParams::default(), &f)
        .await
        .expect("create KvFabric");
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let operator = tokio::spawn(kvfabric_operator::controller::run(client.clone(), metrics));

    let dir = std::env::temp_dir().join(format!("kvf-rollout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("socket dir");
    let (ps, ds) = (dir.join("prefill.sock"), dir.join("decode.sock"));
    let start = |logical: &str, role: &str, socket: Option<&Path>| {
        let mut args = vec![
            "--etcd",
            etcd.as_str(),
            "--fabric",
            fabric.as_str(),
            "--logical-id",
            logical,
            "--role",
            role,
            "--pool-size",
            "4MiB",
            "--control-bind",
            "loopback",
        ];
        let s;
        if let Some(p) = socket {
            s = p.to_string_lossy().into_owned();
            args.extend(["--engine-socket", s.as_str()]);
        }
        AgentProc::spawn(
            &bin,
            &args,
            &[("KVFABRIC_BOUNCE_ENABLE", "1"), ("KVFABRIC_LOG", "info")],
        )
    };
    let prefill = match start("prefill", "prefill", Some(&ps)) {
        Ok(a) => a,
        Err(log) if log.contains("NIXL runtime") => {
            skip(&format!("NIXL runtime not available: {log}"));
            return;
        }
        Err(log) => panic!("prefill agent did not start:\n{log}"),
    };
    let decode = start("decode", "decode", Some(&ds)).expect("decode agent");
    let third = start("third", "both", None).expect("third agent");
    let agents = [&prefill, &decode, &third];
    let pids: Vec<u32> = agents.iter().map(|a| a.child.id()).collect();

    // 1. Converged on generation 1 with the spec's arena.
    let converged = |gen: u64| {
        let fabrics = fabrics.clone();
        let f = fabric.clone();
        move || {
            let fabrics = fabrics.clone();
            let f = f.clone();
            async move {
                fabrics.get(&f).await.ok().is_some_and(|k| {
                    let s = k.status.clone().unwrap_or_default();
                    s.config_generation == Some(gen)
                        && s.agent_records == 3
                        && s.agents_at_desired_generation == 3
                        && condition(&k, "Progressing")
                            == Some(("False".into(), "RolloutComplete".into()))
                })
            }
        }
    };
    wait_for(
        "generation 1 rolled out to 3 agents",
        Duration::from_secs(60),
        converged(1),
    )
    .await;
    for a in agents {
        assert_eq!(effective(a).0, 1, "{} generation", a.name);
        assert!(effective(a).1 <= ARENA_1 && effective(a).1 > 0);
    }
    let arena_1 = effective(&prefill).1;

    // 2. Roll generation 2 out under back-to-back bench runs.
    let stop = Arc::new(AtomicBool::new(false));
    let runs: Arc<Mutex<Vec<Result<f64, String>>>> = Arc::default();
    let load = {
        let (stop, runs) = (stop.clone(), runs.clone());
        let (bin, dir, ps, ds) = (bin.clone(), dir.clone(), ps.clone(), ds.clone());
        std::thread::spawn(move || {
            let mut k = 0;
            while !stop.load(Ordering::SeqCst) {
                // Alternately AUTO (mixed pairs take the standard path) and
                // BOUNCE (held while a peer drains, served across
                // generations: what GPU pools get).
                let path = if k % 2 == 0 { "auto" } else { "bounce" };
                let r = bench(&bin, &dir, &ps, &ds, (k * 48) % 11000, path);
                runs.lock().unwrap().push(r);
                k += 1;
            }
        })
    };
    wait_for(
        "a first bench run before the rollout",
        Duration::from_secs(60),
        || {
            let runs = runs.clone();
            async move { !runs.lock().unwrap().is_empty() }
        },
    )
    .await;
    let standard_before = submissions(&prefill, "standard");
    let t_roll = Instant::now();
    fabrics
        .patch(
            &fabric,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"bounce": {"arenaSizeBytes": ARENA_2}}})),
        )
        .await
        .expect("patch arena size");
    // One agent at a time: never two draining at once.
    let mut max_draining = 0;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let draining = agents.iter().filter(|a| effective(a).2).count();
        max_draining = max_draining.max(draining);
        let k = fabrics.get(&fabric).await.expect("get");
        let s = k.status.clone().unwrap_or_default();
        if s.config_generation == Some(2)
            && s.agents_at_desired_generation == 3
            && condition(&k, "Progressing") == Some(("False".into(), "RolloutComplete".into()))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "generation 2 not rolled out within 90 s: {s:?}\nprefill log:\n{}",
            prefill.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rolled = t_roll.elapsed();
    // Let a run start and end wholly after the rollout, then stop the load.
    let n = runs.lock().unwrap().len();
    let more = kube_common::poll_until(Duration::from_secs(60), || {
        let runs = runs.clone();
        async move { runs.lock().unwrap().len() >= n + 2 }
    })
    .await;
    assert!(
        more,
        "bench runs stalled after the rollout\nprefill:\n{}\ndecode:\n{}",
        prefill.log_tail(),
        decode.log_tail()
    );
    stop.store(true, Ordering::SeqCst);
    tokio::task::spawn_blocking(move || load.join())
        .await
        .expect("join")
        .expect("load thread");
    let runs = runs.lock().unwrap().clone();
    let failed: Vec<&String> = runs.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} bench runs failed during the rollout; first:\n{}\nprefill:\n{}\ndecode:\n{}",
        failed.len(),
        runs.len(),
        failed[0],
        prefill.log_tail(),
        decode.log_tail()
    );
    println!(
        "rollout of generation 2 to 3 agents took {:.2} s; {} bench runs × 48 hand-offs, 0 failed; at most {max_draining} agent(s) draining at once",
        rolled.as_secs_f64(),
        runs.len()
    );
    assert!(max_draining <= 1, "maxUnavailable 1, saw {max_draining}");
    for (a, pid) in agents.iter().zip(&pids) {
        let (gen, arena, draining) = effective(a);
        assert_eq!((gen, draining), (2, false), "{}", a.name);
        assert!(
            arena > arena_1 && arena <= ARENA_2,
            "{} arena {arena}",
            a.name
        );
        assert_eq!(a.child.id(), *pid, "rolled in process");
        let name = get_json(a.addr, "/v1/config")["agent"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert_eq!(name, a.name, "same incarnation");
    }
    assert!(
        submissions(&prefill, "standard") > standard_before,
        "mixed-generation pairs took the standard path during the rollout"
    );
    let bounce_after = submissions(&prefill, "bounce");
    bench(&bin, &dir, &ps, &ds, 5000, "auto").expect("bench after the rollout");
    assert!(
        submissions(&prefill, "bounce") > bounce_after,
        "bounce resumed between agents of generation 2"
    );
    wait_for(
        "Ready=True at generation 2",
        Duration::from_secs(30),
        || {
            let fabrics = fabrics.clone();
            let f = fabric.clone();
            async move {
                fabrics.get(&f).await.ok().is_some_and(|k| {
                    condition(&k, "Ready") == Some(("True".into(), "AsExpected".into()))
                        && k.status.as_ref().and_then(|s| s.config_generation) == Some(2)
                })
            }
        },
    )
    .await;
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    wait_for("rollout Events", Duration::from_secs(10), || {
        let events = events.clone();
        let fabric = fabric.clone();
        async move {
            let Ok(l) = events.list(&Default::default()).await else {
                return false;
            };
            let reasons: Vec<String> = l
                .items
                .iter()
                .filter(|e| {
                    e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(fabric.as_str())
                })
                .filter_map(|e| e.reason.clone())
                .collect();
            ["RolloutStarted", "RolloutStep", "RolloutComplete"]
                .iter()
                .all(|r| reasons.iter().any(|x| x == r))
        }
    })
    .await;

    // 3. A schema-valid arena no agent can allocate: refused, halted, the
    //    running config stays.
    fabrics
        .patch(
            &fabric,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"bounce": {"arenaSizeBytes": ARENA_HUGE}}})),
        )
        .await
        .expect("schema-valid patch accepted");
    wait_for(
        "Degraded=True ConfigRefused and Progressing=False RolloutHalted",
        Duration::from_secs(60),
        || {
            let fabrics = fabrics.clone();
            let f = fabric.clone();
            async move {
                fabrics.get(&f).await.ok().is_some_and(|k| {
                    condition(&k, "Degraded") == Some(("True".into(), "ConfigRefused".into()))
                        && condition(&k, "Progressing")
                            == Some(("False".into(), "RolloutHalted".into()))
                })
            }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    for a in agents {
        let (gen, arena, draining) = effective(a);
        assert_eq!((gen, draining), (2, false), "{} keeps generation 2", a.name);
        assert!(
            arena > arena_1 && arena <= ARENA_2,
            "{} keeps its arena",
            a.name
        );
    }
    bench(&bin, &dir, &ps, &ds, 6000, "auto").expect("bench on the running config");

    // 4. The apiserver's schema refuses a granularity that is not a power
    //    of two.
    let err = fabrics
        .patch(
            &fabric,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"bounce": {"arenaAllocationGranularityBytes": 48}}})),
        )
        .await
        .expect_err("granularity 48 refused by the schema");
    assert!(
        err.to_string().contains("power of two"),
        "apiserver message names the rule: {err}"
    );

    operator.abort();
    drop((prefill, decode, third));
    let _ = std::fs::remove_dir_all(&dir);
    drop(cluster);
}
