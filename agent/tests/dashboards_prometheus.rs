//! The Grafana dashboards of the chart (`charts/kvfabric/dashboards/*.json`)
//! against a real Prometheus (the Debian binary) scraping real processes.
//!
//! [`dashboards_hide_no_empty_result`] (static, always runs): every panel
//! has targets, every query reads a `kvfabric_` metric, and none hides an
//! empty result behind a constant (`or vector(0)`, `or on() vector(...)`,
//! `absent(...)`, a bare `vector(...)`).
//!
//! [`every_panel_returns_data_under_faults`]: etcd, three `kvfabric agent`
//! processes serving the engine API (prefill, decode with a 4 MiB arena,
//! and "old" with a different max chunk size: bounce-incompatible with the
//! others), the `kvfabric-operator` binary serving its /metrics with an
//! unreachable kube-apiserver (its error series), a second operator on a
//! real control plane (e2e/kube/up.sh) whose KvFabric selects two pods
//! the test deletes 3 s apart (its invalidation series), and Prometheus
//! scraping them all every second. Then:
//!
//! - a bench slice (`kvfabric bench --prefill-socket --decode-socket`,
//!   concurrency 6 into the decode agent's small arena) through both paths;
//! - a fallback: an AUTO hand-off from an engine on the prefill agent to
//!   one on the bounce-incompatible agent (routed to the standard path,
//!   `kvfabric_fallbacks_total{reason="peer_incompatible"}`);
//! - a timeout: the decode agent frozen (SIGSTOP) for longer than
//!   `requestTimeoutMs` (1.5 s) while a bounce hand-off to it waits for
//!   credit (`kvfabric_bounce_timeouts_total`);
//! - a forgotten peer: the incompatible agent stopped (SIGTERM: its record
//!   revoked; `kvfabric_peers_forgotten_total`,
//!   `kvfabric_peer_invalidation_seconds`);
//! - drain mode: bounce hand-offs of mixed sizes racing for the decode
//!   agent's 2-chunk arena (`kvfabric_drain_mode_entries_total`);
//!
//! and every panel target of both dashboards, template variables
//! substituted (`$agent`, `$peer`, `$engine` → `.*`, `$__rate_interval` →
//! 5m), is run through `/api/v1/query`: each must return at least one
//! finite sample, the fault targets a non-zero one. Failures name the
//! dashboard, panel and target.
//!
//! `$PROMETHEUS` picks the server binary (default `prometheus` on the PATH,
//! then /usr/bin/prometheus; Debian package `prometheus`, installed by
//! e2e/setup.sh). Without Prometheus, etcd or NIXL the test prints SKIP,
//! or fails under `KVFABRIC_REQUIRE_SERVICES`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::etcd::{free_port, Etcd};
use common::proc::{Agent, Proc};
use kvfabric_client::{pb, Client, Session, ShmPool};
use serde_json::Value;

/// Distinguishes the shm pool names of one test process (see `attach`).
static SHM_SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn dashboards_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/kvfabric/dashboards")
}

/// (file name, dashboard JSON) of every dashboard.
fn dashboards() -> Vec<(String, Value)> {
    let mut v: Vec<(String, Value)> = std::fs::read_dir(dashboards_dir())
        .expect("charts/kvfabric/dashboards")
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            let json = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{}: not JSON: {e}", p.display()));
            (p.file_name().unwrap().to_string_lossy().into_owned(), json)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// A panel target: (dashboard, panel title, refId, expr).
type Target = (String, String, String, String);

fn targets() -> Vec<Target> {
    let mut out = Vec::new();
    for (file, d) in dashboards() {
        for p in d["panels"].as_array().expect("panels") {
            if p["type"] == "row" {
                continue;
            }
            let title = p["title"].as_str().unwrap_or("").to_string();
            let ts = p["targets"].as_array().cloned().unwrap_or_default();
            assert!(!ts.is_empty(), "{file}: panel {title:?} has no targets");
            for t in ts {
                out.push((
                    file.clone(),
                    title.clone(),
                    t["refId"].as_str().unwrap_or("?").to_string(),
                    t["expr"].as_str().unwrap_or("").to_string(),
                ));
            }
        }
    }
    out
}

#[test]
fn dashboards_hide_no_empty_result() {
    let ds = dashboards();
    let names: Vec<&str> = ds.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(names, ["kvfabric-overview.json", "kvfabric-peers.json"]);
    for (file, d) in &ds {
        let vars: Vec<&str> = d["templating"]["list"]
            .as_array()
            .expect("templating.list")
            .iter()
            .filter_map(|v| v["name"].as_str())
            .collect();
        for want in ["datasource", "agent"] {
            assert!(
                vars.contains(&want),
                "{file}: no ${want} variable: {vars:?}"
            );
        }
        assert!(
            d["uid"].as_str().is_some_and(|u| !u.is_empty()),
            "{file}: uid"
        );
    }
    let ts = targets();
    assert!(ts.len() >= 30, "only {} targets", ts.len());
    for (file, title, r, expr) in &ts {
        let flat: String = expr.split_whitespace().collect::<Vec<_>>().join(" ");
        let squeezed: String = expr.chars().filter(|c| !c.is_whitespace()).collect();
        assert!(
            expr.contains("kvfabric_"),
            "{file}: panel {title:?} {r}: reads no kvfabric metric: {expr}"
        );
        for bad in ["vector(", "absent(", "absent_over_time("] {
            assert!(
                !squeezed.contains(bad),
                "{file}: panel {title:?} {r}: `{bad}` can hide an empty result: {flat}"
            );
        }
        assert!(
            !squeezed.contains("oron(") && !flat.contains(" or "),
            "{file}: panel {title:?} {r}: `or` can pad an empty result: {flat}"
        );
    }
}

// ---------------------------------------------------------------------------
// The live test
// ---------------------------------------------------------------------------

/// Fault targets: (dashboard, panel, refId) that must be non-zero.
const FAULTS: &[(&str, &str, &str, &str)] = &[
    (
        "kvfabric-overview.json",
        "Failures and timeouts/s",
        "A",
        "bounce failures (the SIGSTOPped decode agent)",
    ),
    (
        "kvfabric-overview.json",
        "Failures and timeouts/s",
        "C",
        "bounce timeouts (the SIGSTOPped decode agent)",
    ),
    (
        "kvfabric-overview.json",
        "Fallbacks/s by reason",
        "A",
        "AUTO hand-off to the bounce-incompatible agent",
    ),
    (
        "kvfabric-overview.json",
        "Peers loaded / forgotten",
        "C",
        "the incompatible agent stopped",
    ),
    (
        "kvfabric-overview.json",
        "Peer invalidation latency p99",
        "A",
        "the incompatible agent stopped",
    ),
    (
        "kvfabric-overview.json",
        "Operator errors/s",
        "A",
        "operator without a reachable kube-apiserver",
    ),
    (
        "kvfabric-overview.json",
        "Operator invalidations/s",
        "A",
        "two pods deleted through a real kube-apiserver, 3 s apart",
    ),
    (
        "kvfabric-overview.json",
        "Peer invalidation latency p99",
        "B",
        "two pods deleted through a real kube-apiserver, 3 s apart",
    ),
    (
        "kvfabric-peers.json",
        "Drain mode",
        "B",
        "mixed-size bounce hand-offs into a 2-chunk arena",
    ),
];

/// Targets this test cannot feed: (dashboard, panel, refId, why).
const NOT_EXERCISED: &[(&str, &str, &str, &str)] = &[];

fn prometheus_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PROMETHEUS") {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("prometheus"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| {
        let p = PathBuf::from("/usr/bin/prometheus");
        p.is_file().then_some(p)
    })
}

/// The operator binary next to the test's target dir.
fn operator_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("kvfabric-operator");
    p.is_file().then_some(p)
}

/// `GET path` on `addr` → (status, body).
fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Instant query → the result vector (panics on an API error).
fn query(prom: &str, q: &str) -> Vec<Value> {
    let (code, body) = http_get(prom, &format!("/api/v1/query?query={}", urlencode(q)))
        .unwrap_or_else(|| panic!("Prometheus at {prom} did not answer"));
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{code}: {body}"));
    assert_eq!(v["status"], "success", "query {q}: {body}");
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

/// Finite sample values of a query result.
fn values(result: &[Value]) -> Vec<f64> {
    result
        .iter()
        .filter_map(|s| s["value"][1].as_str()?.parse::<f64>().ok())
        .filter(|x| x.is_finite())
        .collect()
}

fn sample(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| label.is_empty() || l.contains(label))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

struct Killed(Child);

/// A control plane from e2e/kube/up.sh in `dir` (stopped on drop), driven
/// with its own kubectl.
struct Kube {
    dir: PathBuf,
    env: std::collections::BTreeMap<String, String>,
}

impl Kube {
    /// `None` (after a SKIP) when the control-plane tools are not cached.
    fn up(dir: &Path) -> Option<Self> {
        let kube = Path::new(env!("CARGO_MANIFEST_DIR")).join("../e2e/kube");
        let cached = Command::new(kube.join("install.sh"))
            .arg("--path")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !cached {
            common::skip("control-plane tools not installed (e2e/setup.sh --tests); operator invalidation panels untested");
            return None;
        }
        let out = Command::new(kube.join("up.sh"))
            .arg(dir)
            .stdin(Stdio::null())
            .output()
            .expect("run e2e/kube/up.sh");
        let k = Self {
            dir: dir.to_path_buf(),
            env: std::fs::read_to_string(dir.join("env"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.split_once('='))
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        };
        assert!(
            out.status.success(),
            "up.sh failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(k)
    }

    fn var(&self, k: &str) -> &str {
        self.env
            .get(k)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("{k} missing from the kube env"))
    }

    /// Runs kubectl with `args` (stdin `input`); panics naming the command
    /// on failure.
    fn kubectl(&self, args: &[&str], input: Option<&str>) -> String {
        self.try_kubectl(args, input)
            .unwrap_or_else(|e| panic!("kubectl {args:?}: {e}"))
    }

    /// Waits (≤ 30 s) for the KvFabric CRD to be Established. `kubectl
    /// wait` right after the apply can fail at once with ".status.conditions
    /// accessor error: <nil>" (the CRD has no status yet): retried, as in
    /// the chaos suite.
    fn wait_crd_established(&self) {
        let t0 = Instant::now();
        let args = [
            "wait",
            "--for=condition=Established",
            "crd/kvfabrics.kvfabric.io",
            "--timeout=30s",
        ];
        loop {
            match self.try_kubectl(&args, None) {
                Ok(_) => return,
                Err(e)
                    if e.contains("accessor error") && t0.elapsed() < Duration::from_secs(30) =>
                {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!("kubectl {args:?}: {e}"),
            }
        }
    }

    /// Runs kubectl with `args` (stdin `input`): its stdout, or its stderr
    /// when it failed.
    fn try_kubectl(&self, args: &[&str], input: Option<&str>) -> Result<String, String> {
        let bin = self
            .var("KVFABRIC_KUBE_PATH")
            .split(':')
            .map(|d| Path::new(d).join("kubectl"))
            .find(|p| p.is_file())
            .expect("kubectl in KVFABRIC_KUBE_PATH");
        let mut child = Command::new(bin)
            .arg("--kubeconfig")
            .arg(self.dir.join("kubeconfig"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kubectl");
        if let Some(i) = input {
            child.stdin.take().unwrap().write_all(i.as_bytes()).unwrap();
        }
        drop(child.stdin.take());
        let out = child.wait_with_output().expect("kubectl");
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Kube {
    fn drop(&mut self) {
        let _ = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../e2e/kube/down.sh"))
            .arg(&self.dir)
            .arg("--purge")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn layout(blocks: u32) -> pb::KvLayout {
    pb::KvLayout {
        layers: 4,
        num_blocks: blocks,
        block_bytes: 64 << 10,
        kv_split: true,
        dtype: "bf16".into(),
        tp_rank: 0,
        tp_size: 1,
        block_tokens: 16,
        kv_heads: 16,
        head_dim: 128,
        device: -1,
        device_uuid: String::new(),
    }
}

async fn attach(socket: &Path, id: &str, role: pb::Role, blocks: u32) -> (Session, ShmPool) {
    let client = Client::connect(socket).await.expect("connect");
    let l = layout(blocks);
    let pool = ShmPool::create(
        &format!(
            "/kvf-dash-{}-{id}-{}",
            std::process::id(),
            // Tests of one binary run in parallel in one process and reuse
            // engine ids: the sequence keeps their shm names apart.
            SHM_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ),
        kvfabric_client::pool_bytes(&l),
    )
    .expect("shm pool");
    let s = client
        .attach(id, &format!("uid-{id}"), role, l)
        .await
        .expect("attach");
    s.register_shm(&pool).await.expect("register");
    (s, pool)
}

/// `transfer`, retried while the destination engine's record is still
/// propagating (NotFound), at most 20 s.
async fn transfer(s: &Session, req: pb::TransferRequest) -> pb::TransferResponse {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match s.transfer(req.clone()).await {
            Ok(r) => return r,
            Err(e)
                if (e.code() == Some(tonic::Code::NotFound)
                    || e.code() == Some(tonic::Code::FailedPrecondition))
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("transfer {req:?}: {e}"),
        }
    }
}

fn xfer(rid: u64, dst: &str, src: &[u32], dstb: &[u32], path: pb::Path) -> pb::TransferRequest {
    pb::TransferRequest {
        request_id: rid,
        dst_engine: dst.into(),
        src_blocks: src.to_vec(),
        dst_blocks: dstb.to_vec(),
        path: path as i32,
        timeout_ms: 10_000,
        ..Default::default()
    }
}

fn signal(a: &Agent, sig: libc::c_int) {
    // SAFETY: plain kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(a.proc.pid() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({sig})");
}

#[test]
fn every_panel_returns_data_under_faults() {
    let t_start = Instant::now();
    let Some(prom_bin) = prometheus_bin() else {
        common::skip("prometheus not installed (Debian: apt-get install prometheus)");
        return;
    };
    let Some(etcd) = Etcd::start("dash") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvfabric-dash-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fabric = format!("dash-{}", std::process::id());
    let sock = |who: &str| dir.join(format!("{who}.sock"));
    let (psock, dsock, osock) = (sock("prefill"), sock("decode"), sock("old"));
    let common_env = [
        ("KVFABRIC_BOUNCE_REQUEST_TIMEOUT_MS", "1500"),
        ("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", "1MiB"),
    ];
    let spawn = |logical: &str, role: &str, socket: &Path, env: &[(&str, &str)]| {
        let mut e: Vec<(&str, &str)> = common_env.to_vec();
        e.extend_from_slice(env);
        Agent::spawn_opts(
            &etcd.endpoint(),
            &fabric,
            logical,
            role,
            &["--engine-socket", socket.to_str().unwrap()],
            &e,
            false,
        )
    };
    let mut prefill = spawn("prefill", "prefill", &psock, &[]);
    let mut decode = spawn(
        "decode",
        "decode",
        &dsock,
        // Round-robin (the seed's policy, set here: step
        // 4's mixed sizes bypass a large head under it within a few
        // rounds, so drain mode shows on the dashboard quickly).
        &[
            ("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "2MiB"),
            ("KVFABRIC_BOUNCE_GRANT_POLICY", "roundRobin"),
        ],
    );
    // Bounce-incompatible with both: another max chunk size.
    let mut old = spawn(
        "old",
        "decode",
        &osock,
        &[("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", "512KiB")],
    );
    // A second peer to leave (the invalidation histogram's first event
    // creates its series; the second one moves its rate).
    let mut spare = spawn("spare", "decode", &dir.join("spare.sock"), &[]);
    let mut http = Vec::new();
    for a in [&mut prefill, &mut decode, &mut old, &mut spare] {
        match a.addr.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => http.push(addr),
            Err(_) => {
                let err = a.kill_and_log();
                if err.contains("NIXL runtime") {
                    common::skip(&format!("NIXL runtime not available: {err}"));
                    return;
                }
                panic!("agent never announced its address; stderr:\n{err}");
            }
        }
    }

    // The operator: /metrics served, its kube-apiserver unreachable.
    let mut scrape: Vec<SocketAddr> = http.clone();
    let _operator = match operator_bin() {
        Some(bin) => {
            let kubeconfig = dir.join("kubeconfig");
            let dead = free_port();
            std::fs::write(
                &kubeconfig,
                format!(
                    "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:{dead}\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n"
                ),
            )
            .unwrap();
            let mut child = Command::new(bin)
                .args(["--metrics-listen", "127.0.0.1:0", "--kubeconfig"])
                .arg(&kubeconfig)
                .env("KVFABRIC_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn kvfabric-operator");
            let out = child.stdout.take().unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if let Some(a) = line.split("metrics on http://").nth(1) {
                        if let Ok(a) = a.trim_end_matches("/metrics").trim().parse::<SocketAddr>() {
                            let _ = tx.send(a);
                        }
                    }
                }
            });
            let addr = rx
                .recv_timeout(Duration::from_secs(20))
                .expect("operator printed its metrics address");
            scrape.push(addr);
            Some(Killed(child))
        }
        None => {
            common::skip("target/<profile>/kvfabric-operator not built (cargo build -p kvfabric-operator); operator panels untested");
            None
        }
    };

    // A second operator on a real control plane (e2e/kube/up.sh): a
    // KvFabric whose agent selector matches two pods the test deletes
    // later (the operator's invalidation series). Its fabric prefix is its
    // own, so it never touches the agents above.
    let kube = Kube::up(&dir.join("kube"));
    let operator2 = kube.as_ref().and_then(|k| {
        let bin = operator_bin()?;
        let crd = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/kvfabric.io_kvfabrics.yaml");
        k.kubectl(&["apply", "-f", crd.to_str().unwrap()], None);
        k.wait_crd_established();
        k.kubectl(
            &["apply", "-f", "-"],
            Some(&format!(
                "apiVersion: kvfabric.io/v1alpha1\nkind: KvFabric\nmetadata: {{name: dash, namespace: default}}\nspec:\n  fabricName: {fabric}-op\n  agentSelector: {{matchLabels: {{app: dash-agent}}}}\n  prefillSelector: {{matchLabels: {{role: dash-prefill}}}}\n  decodeSelector: {{matchLabels: {{role: dash-decode}}}}\n  etcd: {{endpoints: ['{}']}}\n",
                etcd.endpoint()
            )),
        );
        let node = k.var("KVFABRIC_KUBE_NODES").split(',').next().unwrap_or("kwok-gpu-0").to_string();
        for i in 0..2 {
            k.kubectl(
                &["apply", "-f", "-"],
                Some(&format!(
                    "apiVersion: v1\nkind: Pod\nmetadata: {{name: dash-agent-{i}, namespace: default, labels: {{app: dash-agent}}}}\nspec:\n  nodeName: {node}\n  containers: [{{name: agent, image: kvfabric:test}}]\n"
                )),
            );
        }
        k.kubectl(
            &["wait", "--for=condition=Ready", "pod/dash-agent-0", "pod/dash-agent-1", "--timeout=30s"],
            None,
        );
        let mut child = Command::new(bin)
            .args(["--metrics-listen", "127.0.0.1:0", "--kubeconfig"])
            .arg(k.dir.join("kubeconfig"))
            .env("KVFABRIC_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kvfabric-operator");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some(a) = line.split("metrics on http://").nth(1) {
                    if let Ok(a) = a.trim_end_matches("/metrics").trim().parse::<SocketAddr>() {
                        let _ = tx.send(a);
                    }
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("operator (real apiserver) printed its metrics address");
        scrape.push(addr);
        Some((Killed(child), addr))
    });

    // Prometheus, scraping every second.
    let prom_port = free_port();
    let prom = format!("127.0.0.1:{prom_port}");
    let scrape_targets: Vec<String> = scrape.iter().map(|a| format!("'{a}'")).collect();
    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: kvfabric\n    static_configs:\n      - targets: [{}]\n",
            scrape_targets.join(", ")
        ),
    )
    .unwrap();
    let prom_child = Command::new(&prom_bin)
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address={prom}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn prometheus");
    let _prom_child = Killed(prom_child);
    let t0 = Instant::now();
    while http_get(&prom, "/-/ready").map(|r| r.0) != Some(200) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "prometheus not ready"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Every target scraped (up) at least twice before anything moves, so
    // each counter has a baseline sample (Prometheus applies its targets
    // a few seconds after it is ready).
    let t0 = Instant::now();
    loop {
        let up = values(&query(&prom, "count_over_time(up[1m]) >= 2 and up == 1"));
        if up.len() == scrape.len() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "Prometheus scraped {} of {} targets: {:?}",
            up.len(),
            scrape.len(),
            query(&prom, "up")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("targets scraped at {:.1?}", t_start.elapsed());

    // 0. The operator's invalidations: two pods deleted 3 s apart (the
    // first creates the series, the second moves its rate).
    if let (Some(k), Some((_, op_addr))) = (&kube, &operator2) {
        for i in 0..2 {
            k.kubectl(
                &["delete", "pod", &format!("dash-agent-{i}"), "--wait=false"],
                None,
            );
            let t0 = Instant::now();
            loop {
                let m = http_get(&op_addr.to_string(), "/metrics")
                    .map(|r| r.1)
                    .unwrap_or_default();
                let n: f64 = m
                    .lines()
                    .filter(|l| l.starts_with("kvfabric_operator_invalidations_total{"))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum();
                if n >= f64::from(i + 1) {
                    break;
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(15),
                    "operator did not invalidate dash-agent-{i} within 15 s:\n{m}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            std::thread::sleep(Duration::from_secs(3));
        }
    }

    // 1. The bench slice, both paths, through the engine API.
    let trace = dir.join("trace.jsonl");
    let lens = [909u64, 897, 900, 896, 895, 1459, 910, 1200];
    let text: String = lens
        .iter()
        .enumerate()
        .map(|(i, n)| {
            format!(
                "{{\"timestamp\": {}, \"input_length\": {n}, \"output_length\": 100, \"hash_ids\": []}}\n",
                i * 10
            )
        })
        .collect();
    std::fs::write(&trace, text).unwrap();
    let bench = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .arg("bench")
        .arg("--prefill-socket")
        .arg(&psock)
        .arg("--decode-socket")
        .arg(&dsock)
        .arg("--trace")
        .arg(&trace)
        .args(["--requests", &lens.len().to_string()])
        .args(["--model", "Qwen2.5-7B", "--tp", "4", "--block", "16"])
        .args(["--concurrency", "6", "--wait", "30", "--quiet"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvfabric bench");
    let mut bench = Proc { child: Some(bench) };
    let status = bench.wait_for(Duration::from_secs(90));
    let mut out = String::new();
    let mut err = String::new();
    if let Some(c) = bench.child.as_mut() {
        let _ = c.stdout.take().map(|mut o| o.read_to_string(&mut out));
        let _ = c.stderr.take().map(|mut e| e.read_to_string(&mut err));
    }
    assert!(
        status.is_some_and(|s| s.success()),
        "bench: {status:?}\n{out}\n{err}\nprefill:\n{}\ndecode:\n{}",
        prefill.kill_and_log(),
        decode.kill_and_log()
    );
    eprintln!("bench done at {:.1?}", t_start.elapsed());

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let p_metrics = |a: SocketAddr| http_get(&a.to_string(), "/metrics").unwrap().1;
    rt.block_on(async {
        let (pe, _pp) = attach(&psock, "dash-prefill", pb::Role::Prefill, 64).await;
        let (de, _dp) = attach(&dsock, "dash-decode", pb::Role::Decode, 64).await;
        let (oe, _op) = attach(&osock, "dash-old", pb::Role::Decode, 64).await;

        // 2. Fallback: AUTO to the incompatible agent → standard path.
        let r = transfer(
            &pe,
            xfer(1, "dash-old", &[1, 2, 3], &[4, 5, 6], pb::Path::Auto),
        )
        .await;
        assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");
        assert_eq!(r.path, "standard", "{r:?}");
        let m = p_metrics(http[0]);
        assert!(
            sample(
                &m,
                "kvfabric_fallbacks_total",
                "reason=\"peer_incompatible\""
            ) >= 1.0,
            "{m}"
        );

        // 4. Drain mode: hand-offs of mixed sizes racing for the decode
        // agent's 2 MiB arena (1 MiB chunks: a 1-block request's single
        // chunk fits where a full chunk does not).
        let t0 = Instant::now();
        let mut rid = 100;
        loop {
            let mut calls = Vec::new();
            for k in 0..8u64 {
                rid += 1;
                let n = if k % 2 == 0 { 24 } else { 1 };
                let src: Vec<u32> = (0..n).collect();
                let dst: Vec<u32> = (0..n).map(|b| (b + (k as u32) * 3) % 64).collect();
                calls.push(transfer(
                    &pe,
                    xfer(rid, "dash-decode", &src, &dst, pb::Path::Bounce),
                ));
            }
            for r in join_all(calls).await {
                assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");
            }
            let m = p_metrics(http[1]);
            if sample(&m, "kvfabric_drain_mode_entries_total", "") >= 1.0 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "decode agent never entered drain mode:\n{m}"
            );
        }
        eprintln!("drain mode seen at {:.1?}", t_start.elapsed());

        // 3. Timeout: the decode agent frozen past requestTimeoutMs.
        signal(&decode, libc::SIGSTOP);
        let r = transfer(
            &pe,
            xfer(2, "dash-decode", &[1, 2], &[7, 8], pb::Path::Bounce),
        )
        .await;
        signal(&decode, libc::SIGCONT);
        assert_ne!(r.outcome(), pb::Outcome::Success, "{r:?}");
        let m = p_metrics(http[0]);
        assert!(
            sample(&m, "kvfabric_bounce_timeouts_total", "") >= 1.0,
            "{r:?}\n{m}"
        );
        // And the path recovers once the decode agent runs again.
        let t0 = Instant::now();
        loop {
            let src: Vec<u32> = (0..24).collect();
            let r = transfer(&pe, xfer(3, "dash-decode", &src, &src, pb::Path::Bounce)).await;
            if r.outcome() == pb::Outcome::Success {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "no recovery: {r:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        drop((de, oe));
        drop(pe);
    });

    // 5. Forgotten peers: the incompatible agent leaves (record revoked),
    // then, a few scrapes later, the spare one.
    for (n, who) in [(1.0, &mut old), (2.0, &mut spare)] {
        let (st, log) = who.terminate();
        assert!(st.is_some_and(|s| s.success()), "agent: {st:?}\n{log}");
        let t0 = Instant::now();
        while sample(&p_metrics(http[0]), "kvfabric_peers_forgotten_total", "") < n {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "prefill forgot < {n} peers"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_millis(2500));
    }
    // A few scrapes after the last fault.
    std::thread::sleep(Duration::from_secs(4));
    eprintln!("faults done at {:.1?}; querying", t_start.elapsed());

    // Every target, template variables substituted.
    let mut failures = Vec::new();
    let mut checked = 0;
    for (file, title, r, expr) in targets() {
        if let Some(n) = NOT_EXERCISED
            .iter()
            .find(|n| n.0 == file && n.1 == title && n.2 == r)
        {
            eprintln!("not exercised: {file} / {title} / {r}: {}", n.3);
            continue;
        }
        let q = expr
            .replace("$__rate_interval", "5m")
            .replace("$__range", "5m")
            .replace("$agent", ".*")
            .replace("$peer", ".*")
            .replace("$engine", ".*");
        assert!(
            !q.contains('$'),
            "{file} / {title} / {r}: unsubstituted: {q}"
        );
        let res = query(&prom, &q);
        let vals = values(&res);
        checked += 1;
        let fault = FAULTS
            .iter()
            .find(|f| f.0 == file && f.1 == title && f.2 == r);
        if vals.is_empty() {
            failures.push(format!("{file} / panel {title:?} / {r}: no data: {q}"));
        } else if let Some(f) = fault {
            if !vals.iter().any(|v| *v > 0.0) {
                failures.push(format!(
                    "{file} / panel {title:?} / {r}: only zeros though the test injected it ({}): {q} → {res:?}",
                    f.3
                ));
            }
        }
    }
    for f in FAULTS {
        assert!(
            targets()
                .iter()
                .any(|t| t.0 == f.0 && t.1 == f.1 && t.2 == f.2),
            "fault target {f:?} is not in the dashboards"
        );
    }
    if !failures.is_empty() {
        for q in [
            "up",
            "kvfabric_bounce_timeouts_total[20s]",
            "kvfabric_submissions_total[20s]",
        ] {
            eprintln!("{q}: {:?}", query(&prom, q));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} panel targets failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!(
        "{checked} panel targets returned data ({} fault targets non-zero) in {:.1?}",
        FAULTS.len(),
        t_start.elapsed()
    );
    for a in [&mut prefill, &mut decode] {
        let (st, log) = a.terminate();
        assert!(st.is_some_and(|s| s.success()), "{st:?}\n{log}");
    }
    drop(etcd);
    // The control plane lives in `dir`: stop it (down.sh finds it there)
    // before the directory goes.
    drop(operator2);
    drop(kube);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Awaits every future of `v` concurrently; the outputs in order.
async fn join_all<F: std::future::Future>(v: Vec<F>) -> Vec<F::Output> {
    use std::pin::Pin;
    use std::task::Poll;
    let mut futs: Vec<Pin<Box<F>>> = v.into_iter().map(Box::pin).collect();
    let mut outs: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(move |cx| {
        let mut pending = false;
        for (i, f) in futs.iter_mut().enumerate() {
            if outs[i].is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(o) => outs[i] = Some(o),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(outs.iter_mut().map(|o| o.take().unwrap()).collect())
        }
    })
    .await
}
