//! The agent daemon's HTTP API over real NIXL agents: health, readiness,
//! live metrics that move with real transfers, peers, config, the bench's
//! verify endpoint, graceful shutdown; and the real `kvfabric agent` binary
//! (ephemeral port, readiness, SIGTERM → exit 0).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{agent, block_descs, init_tracing, permutation, test_config, wait_for, Pool};
use kvfabric_agent::bench::pattern::fill_fast;
use kvfabric_agent::core::config::ByteSize;
use kvfabric_agent::core::Descriptor;
use kvfabric_agent::runtime::fabric::{FabricAgent, PathKind};
use kvfabric_agent::runtime::transport::{FaultPlan, TransferOutcome};
use kvfabric_agent::service::daemon::{AgentConfig, AgentOverrides, Node, NodeOptions};
use kvfabric_agent::service::discovery::{BufferRegion, EmbeddedRegistry, Incarnation};
use kvfabric_agent::service::http::{self, ServiceState, VerifyRegion};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------
// A minimal HTTP/1.0 client (one request per connection, read to EOF).
// ---------------------------------------------------------------------------

fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    let text = String::from_utf8(raw).expect("utf-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("header/body split");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {head:?}"));
    (status, body.to_string())
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    request(addr, "GET", path, None)
}

fn get_json(addr: SocketAddr, path: &str) -> (u16, Value) {
    let (c, b) = get(addr, path);
    (
        c,
        serde_json::from_str(&b).unwrap_or_else(|e| panic!("{path}: {e}: {b}")),
    )
}

fn post_json(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (c, b) = request(addr, "POST", path, Some(&body.to_string()));
    (
        c,
        serde_json::from_str(&b).unwrap_or_else(|e| panic!("{path}: {e}: {b}")),
    )
}

/// Sum of the samples of `name` whose labels include every `(key, value)`
/// of `labels` (Prometheus text format). `None` when no sample matches.
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (n, lbl) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        if n != name {
            continue;
        }
        if labels
            .iter()
            .all(|(k, v)| lbl.split(',').any(|kv| kv == format!("{k}=\"{v}\"")))
        {
            *found.get_or_insert(0.0) += value.parse::<f64>().expect("sample value");
        }
    }
    found
}

// ---------------------------------------------------------------------------
// In-process servers
// ---------------------------------------------------------------------------

/// An HTTP server on its own thread and runtime; stops on drop.
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(state: Arc<ServiceState>) -> Self {
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let addr = std_listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
                http::serve(listener, state, async move {
                    let _ = rx.await;
                })
                .await
                .unwrap();
            });
        });
        Self {
            addr,
            stop: Some(tx),
            thread: Some(thread),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn agent_config(logical: &str, bounce: &kvfabric_agent::core::config::BounceConfig) -> AgentConfig {
    AgentConfig {
        listen: "127.0.0.1:0".into(),
        logical_id: logical.into(),
        pool_size_bytes: ByteSize(4 << 20),
        control_bind: "loopback".into(),
        bounce: bounce.clone(),
        ..AgentConfig::default()
    }
}

fn start_node(
    agent: &Arc<FabricAgent>,
    reg: &EmbeddedRegistry,
    pool: &Pool,
    cfg: &AgentConfig,
) -> (Node, Incarnation) {
    let inc = Incarnation::generate();
    let node = Node::start(
        agent.clone(),
        Arc::new(reg.handle()),
        NodeOptions {
            logical_id: cfg.logical_id.clone(),
            incarnation: inc,
            node: "test-host".into(),
            buffers: vec![BufferRegion {
                label: "kv".into(),
                kind: "dram".into(),
                device: 0,
                addr: pool.addr(),
                len: pool.buf.len() as u64,
            }],
            http: String::new(),
            role: "both".into(),
            pod_uid: String::new(),
            // SAFETY: the pools outlive the nodes and servers (dropped
            // first at the end of the test).
            verify_regions: vec![unsafe {
                VerifyRegion::new(pool.addr(), pool.buf.len() as u64, None)
            }],
            config: serde_json::to_value(cfg).unwrap(),
            bounce_requested: cfg.bounce.enabled,
            debug_api: true,
        },
    )
    .expect("node starts");
    (node, inc)
}

/// Fills the source of each descriptor `k` with the fast pattern (the
/// layout `/v1/debug/verify` checks).
fn fill_fast_src(descs: &[Descriptor], seed: u64) {
    for (k, d) in descs.iter().enumerate() {
        // SAFETY: the sources lie in the test's own pool.
        unsafe { fill_fast(d.src, d.len, seed, k as u64) };
    }
}

fn verify_body(descs: &[Descriptor], seed: u64) -> Value {
    json!({
        "seed": seed,
        "descriptors": descs.iter().map(|d| json!({"dst": d.dst, "len": d.len})).collect::<Vec<_>>(),
    })
}

const NAMES: &[&str] = &[
    "kvfabric_submissions_total",
    "kvfabric_transfer_bytes_total",
    "kvfabric_bounce_activations_total",
    "kvfabric_bounce_outcomes_total",
    "kvfabric_bounce_timeouts_total",
    "kvfabric_transfer_latency_seconds_bucket",
    "kvfabric_transfer_latency_seconds_count",
    "kvfabric_credit_grants_total",
    "kvfabric_credit_wait_seconds_total",
    "kvfabric_fallbacks_total",
    "kvfabric_peers_loaded_total",
    "kvfabric_peers_forgotten_total",
    "kvfabric_arena_in_use_bytes",
    "kvfabric_drain_mode",
    "kvfabric_lease_state",
    "kvfabric_discovery_resyncs_total",
    "kvfabric_requests_in_flight",
    "kvfabric_flows",
    "kvfabric_shutting_down",
    "kvfabric_control_hellos_refused_total",
    "kvfabric_control_hellos_unsigned_total",
    "kvfabric_reverse_routes_replaced_total",
];

// ---------------------------------------------------------------------------
// promtool
// ---------------------------------------------------------------------------

/// The `promtool` binary (`$PROMTOOL`, else `promtool` on `PATH`), or
/// `None` after [`common::skip`] (a panic under `KVFABRIC_REQUIRE_SERVICES`)
/// when it is not installed.
fn promtool() -> Option<std::ffi::OsString> {
    let bin = std::env::var_os("PROMTOOL").unwrap_or_else(|| "promtool".into());
    match Command::new(&bin)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => Some(bin),
        Ok(s) => panic!("{bin:?} --version: {s}"),
        Err(e) => {
            common::skip(&format!(
                "promtool not available ({bin:?}: {e}; Debian: apt-get install prometheus)"
            ));
            None
        }
    }
}

/// Runs `promtool check metrics` on `text` (on stdin) and asserts that it
/// exits 0 without a word of output (any lint problem is printed).
fn assert_promtool_clean(bin: &std::ffi::OsStr, text: &str, what: &str) {
    let mut child = Command::new(bin)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn promtool");
    let mut stdin = child.stdin.take().unwrap();
    let input = text.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().expect("promtool output");
    writer.join().unwrap().expect("write to promtool");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics on {what}: {}\n{said}\n--- metrics ---\n{text}",
        out.status
    );
}

#[test]
fn http_api_reports_live_values_over_real_transfers() {
    init_tracing();
    const BLOCK: usize = 16 << 10;
    const SLOTS: usize = 256; // 4 MiB pools
    let cfg = test_config("8MiB", "1MiB", 4);
    let src = Pool::new(SLOTS * BLOCK);
    let dst = Pool::new(SLOTS * BLOCK);
    let Some(a) = agent("http-prefill", &cfg, &[&src]) else {
        return;
    };
    let Some(b) = agent("http-decode", &cfg, &[&dst]) else {
        return;
    };
    let (a, b) = (Arc::new(a), Arc::new(b));
    let reg = EmbeddedRegistry::new();
    let cfg_a = agent_config(a.name(), &cfg);
    let cfg_b = agent_config(b.name(), &cfg);
    let (na, _inc_a) = start_node(&a, &reg, &src, &cfg_a);
    let (nb, inc_b) = start_node(&b, &reg, &dst, &cfg_b);
    assert!(
        wait_for(Duration::from_secs(10), || na
            .loaded_peers()
            .contains(&b.name().to_string())
            && nb.loaded_peers().contains(&a.name().to_string())),
        "peers loaded through discovery: {:?} / {:?}",
        na.loaded_peers(),
        nb.loaded_peers()
    );
    let sa = Server::start(na.state().clone());
    let sb = Server::start(nb.state().clone());

    // Health and readiness.
    assert_eq!(get(sa.addr, "/healthz").0, 200);
    for s in [&sa, &sb] {
        let (code, r) = get_json(s.addr, "/readyz");
        assert_eq!(code, 200, "readyz: {r}");
        assert_eq!(r["ready"], true);
        assert_eq!(r["lease_state"], "ok");
    }

    // Peers: the decode agent, bounce-compatible, with its incarnation.
    let (code, p) = get_json(sa.addr, "/v1/peers");
    assert_eq!(code, 200);
    let peers = p["peers"].as_array().unwrap();
    assert_eq!(peers.len(), 1, "{p}");
    assert_eq!(peers[0]["name"], b.name());
    assert_eq!(peers[0]["bounce_compatible"], true);
    assert_eq!(peers[0]["reason"], Value::Null);
    assert_eq!(peers[0]["path"], "bounce");
    assert_eq!(peers[0]["incarnation"], inc_b.to_string());
    assert_eq!(peers[0]["logical_id"], b.name());
    assert_eq!(peers[0]["buffers"][0]["addr"], dst.addr());

    // Config round-trips.
    let (code, c) = get_json(sb.addr, "/v1/config");
    assert_eq!(code, 200);
    let back: AgentConfig = serde_json::from_value(c["config"].clone()).unwrap();
    assert_eq!(back, cfg_b);
    assert_eq!(c["agent"], b.name());
    assert_eq!(c["bounce_effective"]["active"], true);
    assert_eq!(c["bounce_effective"]["max_chunk_size_bytes"], 1 << 20);

    // Metrics before.
    let (code, m0a) = get(sa.addr, "/metrics");
    assert_eq!(code, 200);
    let m0b = get(sb.addr, "/metrics").1;
    let an = a.name();
    let bn = b.name();
    let subs = |t: &str, path| {
        metric(
            t,
            "kvfabric_submissions_total",
            &[("agent", an), ("path", path)],
        )
        .unwrap()
    };
    let bytes = |t: &str, path| {
        metric(
            t,
            "kvfabric_transfer_bytes_total",
            &[("agent", an), ("path", path)],
        )
        .unwrap()
    };
    let grants = |t: &str| metric(t, "kvfabric_credit_grants_total", &[("agent", bn)]).unwrap();
    let scattered =
        |t: &str| metric(t, "kvfabric_chunks_scattered_total", &[("agent", bn)]).unwrap();
    assert_eq!(
        metric(&m0a, "kvfabric_peers_loaded_total", &[("agent", an)]),
        Some(1.0)
    );
    assert_eq!(
        metric(&m0a, "kvfabric_lease_state", &[("agent", an)]),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m0a,
            "kvfabric_peers",
            &[("agent", an), ("bounce", "compatible")]
        ),
        Some(1.0)
    );

    // Real transfers: bounce (timed), then the standard path.
    let metrics_a = na.state().metrics().clone();
    let mut total = 0u64;
    const ROUNDS: u64 = 3;
    for seed in 1..=ROUNDS {
        let slots = permutation(SLOTS, seed * 7);
        let descs = block_descs(&src, 0, &dst, &slots[..128], BLOCK);
        fill_fast_src(&descs, seed);
        total += descs.iter().map(|d| d.len).sum::<u64>();
        let t = metrics_a.submit_timed(&a, bn, descs.clone());
        assert_eq!(t.path, PathKind::Bounce);
        assert_eq!(
            t.wait(Duration::from_secs(30)),
            Some(TransferOutcome::Success)
        );
        let (code, v) = post_json(sb.addr, "/v1/debug/verify", &verify_body(&descs, seed));
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["ok"], true, "{v}");
        assert_eq!(v["first_mismatch"], Value::Null);
        assert_eq!(v["bytes"], 128 * BLOCK as u64);
        // A wrong seed is caught at descriptor 0, offset 0.
        let (code, v) = post_json(
            sb.addr,
            "/v1/debug/verify",
            &verify_body(&descs, seed + 100),
        );
        assert_eq!(code, 200);
        assert_eq!(v["ok"], false);
        assert_eq!(v["first_mismatch"], json!({"descriptor": 0, "offset": 0}));
    }
    let slots = permutation(SLOTS, 99);
    let std_descs = block_descs(&src, 128, &dst, &slots[..16], BLOCK);
    fill_fast_src(&std_descs, 42);
    let h = a.submit_standard(bn, std_descs.clone());
    assert_eq!(
        h.wait(Duration::from_secs(30)),
        Some(TransferOutcome::Success)
    );
    let (code, v) = post_json(sb.addr, "/v1/debug/verify", &verify_body(&std_descs, 42));
    assert_eq!((code, &v["ok"]), (200, &json!(true)), "{v}");

    // Metrics after: counters moved by exactly the traffic sent.
    let m1a = get(sa.addr, "/metrics").1;
    let m1b = get(sb.addr, "/metrics").1;
    for n in NAMES {
        assert!(m1a.contains(n), "metric {n} missing:\n{m1a}");
    }
    assert_eq!(subs(&m1a, "bounce") - subs(&m0a, "bounce"), ROUNDS as f64);
    assert_eq!(subs(&m1a, "standard") - subs(&m0a, "standard"), 1.0);
    assert_eq!(bytes(&m1a, "bounce") - bytes(&m0a, "bounce"), total as f64);
    assert_eq!(
        bytes(&m1a, "standard") - bytes(&m0a, "standard"),
        (16 * BLOCK) as f64
    );
    assert!(
        grants(&m1b) > grants(&m0b),
        "grants did not increase:\n{m1b}"
    );
    assert!(scattered(&m1b) > scattered(&m0b));
    assert_eq!(
        metric(
            &m1a,
            "kvfabric_bounce_outcomes_total",
            &[("agent", an), ("outcome", "success")]
        ),
        Some(ROUNDS as f64)
    );
    assert_eq!(
        metric(
            &m1a,
            "kvfabric_transfer_latency_seconds_count",
            &[("agent", an), ("path", "bounce"), ("outcome", "success")]
        ),
        Some(ROUNDS as f64),
        "{m1a}"
    );
    assert!(
        metric(
            &m1a,
            "kvfabric_transfer_latency_seconds_sum",
            &[("agent", an)]
        )
        .unwrap()
            > 0.0
    );
    assert!(metric(&m1a, "kvfabric_chunks_written_total", &[("agent", an)]).unwrap() > 0.0);
    // /v1/peers now carries the transport report of the first chunk writes
    // (absent before any traffic; 3 × 2 MiB in 1 MiB chunks is enough).
    assert_eq!(peers[0]["transport"], Value::Null);
    let (_, p1) = get_json(sa.addr, "/v1/peers");
    let tr = &p1["peers"][0]["transport"];
    assert_eq!(tr["chunks"], 4, "{p1}");
    assert_eq!(tr["local_kind"], "Dram");
    assert_eq!(tr["suspect_fallback"], false);
    assert!(tr["best_chunk_mbps"].as_u64().unwrap() > 0);

    // Verify rejects ranges outside the decode agent's pool.
    let end = dst.addr() + dst.buf.len() as u64;
    for (bad, what) in [
        (json!({"dst": end - 10, "len": 100}), "straddles the end"),
        (json!({"dst": src.addr(), "len": 4096}), "the sender's pool"),
        (json!({"dst": u64::MAX - 1, "len": 8}), "wraps around"),
    ] {
        let body = json!({"seed": 1, "descriptors": [{"dst": dst.addr(), "len": 64}, bad]});
        let (code, v) = post_json(sb.addr, "/v1/debug/verify", &body);
        assert_eq!(code, 400, "{what}: {v}");
        let e = v["error"].as_str().unwrap();
        assert!(e.starts_with("descriptor 1: range"), "{what}: {e}");
    }
    let (code, _) = request(sb.addr, "POST", "/v1/debug/verify", Some("{not json"));
    assert_eq!(code, 400);

    // Graceful shutdown of the decode node: readyz 503, the lease revoked,
    // and the prefill agent forgets it at once.
    let report = nb.shutdown(Duration::from_secs(5));
    assert!(report.drained, "{report:?}");
    assert_eq!(report.revoke_error, None);
    let (code, r) = get_json(sb.addr, "/readyz");
    assert_eq!(code, 503, "{r}");
    assert!(
        r["reason"].as_str().unwrap().contains("shutting down"),
        "{r}"
    );
    assert_eq!(r["lease_state"], "revoked");
    assert_eq!(get(sb.addr, "/healthz").0, 200, "alive while draining");
    assert!(
        wait_for(Duration::from_secs(5), || na.loaded_peers().is_empty()),
        "prefill still has {:?}",
        na.loaded_peers()
    );
    let m2a = get(sa.addr, "/metrics").1;
    assert_eq!(
        metric(&m2a, "kvfabric_peers_forgotten_total", &[("agent", an)]),
        Some(1.0)
    );
    let (_, p) = get_json(sa.addr, "/v1/peers");
    assert!(p["peers"].as_array().unwrap().is_empty(), "{p}");
    let m2b = get(sb.addr, "/metrics").1;
    assert_eq!(
        metric(&m2b, "kvfabric_shutting_down", &[("agent", bn)]),
        Some(1.0)
    );
    assert_eq!(
        metric(&m2b, "kvfabric_lease_state", &[("agent", bn)]),
        Some(5.0)
    );

    drop((sa, sb));
    na.shutdown(Duration::from_secs(5));
    drop((na, nb, a, b));
}

/// Issue 11 item 9: a live `/metrics` after real transfers passes
/// `promtool check metrics` (seconds, not ms/µs; every series labelled by
/// agent), and the in-flight and flow gauges read 1 while a bounce request
/// is held mid-write and 0 on both agents once everything resolved.
#[test]
fn live_metrics_pass_promtool_and_gauges_read_zero_at_quiesce() {
    init_tracing();
    let Some(promtool) = promtool() else {
        return;
    };
    const BLOCK: usize = 16 << 10;
    const SLOTS: usize = 256; // 4 MiB pools
    let cfg = test_config("8MiB", "1MiB", 4);
    let src = Pool::new(SLOTS * BLOCK);
    let dst = Pool::new(SLOTS * BLOCK);
    let Some(a) = agent("prom-prefill", &cfg, &[&src]) else {
        return;
    };
    let Some(b) = agent("prom-decode", &cfg, &[&dst]) else {
        return;
    };
    let (a, b) = (Arc::new(a), Arc::new(b));
    let reg = EmbeddedRegistry::new();
    let (na, _) = start_node(&a, &reg, &src, &agent_config(a.name(), &cfg));
    let (nb, _) = start_node(&b, &reg, &dst, &agent_config(b.name(), &cfg));
    assert!(
        wait_for(Duration::from_secs(10), || na
            .loaded_peers()
            .contains(&b.name().to_string())
            && nb.loaded_peers().contains(&a.name().to_string())),
        "peers loaded through discovery"
    );
    let sa = Server::start(na.state().clone());
    let sb = Server::start(nb.state().clone());
    let (an, bn) = (a.name(), b.name());
    // The gauges that must read 0 at quiesce: (name, extra label).
    const GAUGES: [(&str, (&str, &str)); 4] = [
        ("kvfabric_requests_in_flight", ("path", "bounce")),
        ("kvfabric_flows", ("side", "sender")),
        ("kvfabric_flows", ("side", "receiver")),
        ("kvfabric_requests_in_flight", ("path", "standard")),
    ];
    // Polls `agent`'s gauge until it reads `want` (bounded by `within`: the
    // IO thread stores them once per tick); the last scrape on failure.
    let await_gauge = |addr, agent: &str, (name, label): (&str, (&str, &str)), want, within| {
        let mut last = String::new();
        let ok = wait_for(within, || {
            last = get(addr, "/metrics").1;
            metric(&last, name, &[("agent", agent), label]) == Some(want)
        });
        assert!(ok, "{agent}: {name}{label:?} never read {want}:\n{last}");
    };

    // Idle: every new series exists and reads 0.
    for (addr, n) in [(sa.addr, an), (sb.addr, bn)] {
        let m = get(addr, "/metrics").1;
        for (name, label) in GAUGES {
            assert_eq!(
                metric(&m, name, &[("agent", n), label]),
                Some(0.0),
                "{name}{label:?}:\n{m}"
            );
        }
        assert_eq!(
            metric(&m, "kvfabric_discovery_resyncs_total", &[("agent", n)]),
            Some(0.0)
        );
        assert_eq!(
            metric(&m, "kvfabric_shutting_down", &[("agent", n)]),
            Some(0.0)
        );
    }

    // One bounce request held mid-write (the sender's writes never
    // complete): in flight on the sender, a flow on both sides.
    let t = a.transport().expect("bounce up");
    t.set_faults(FaultPlan {
        hang_writes: true,
        ..FaultPlan::default()
    });
    let slots = permutation(SLOTS, 5);
    let held = block_descs(&src, 0, &dst, &slots[..64], BLOCK);
    fill_fast_src(&held, 5);
    let metrics_a = na.state().metrics().clone();
    let h = metrics_a.submit_timed(&a, bn, held.clone());
    assert_eq!(h.path, PathKind::Bounce);
    let within = Duration::from_secs(3); // < the 5 s request timeout
    await_gauge(sa.addr, an, GAUGES[0], 1.0, within);
    await_gauge(sa.addr, an, GAUGES[1], 1.0, within);
    await_gauge(sb.addr, bn, GAUGES[2], 1.0, within);
    t.set_faults(FaultPlan::default());
    assert_eq!(
        h.wait(Duration::from_secs(30)),
        Some(TransferOutcome::Success)
    );
    let (code, v) = post_json(sb.addr, "/v1/debug/verify", &verify_body(&held, 5));
    assert_eq!((code, &v["ok"]), (200, &json!(true)), "{v}");

    // Concurrent bounce requests (disjoint destinations), then the
    // standard path.
    let perm = permutation(SLOTS, 10);
    let mut timed = Vec::new();
    for k in 0..4u64 {
        let seed = 10 + k;
        let first = 64 + 32 * k as usize;
        let slots = &perm[32 * k as usize..32 * (k + 1) as usize];
        let descs = block_descs(&src, first, &dst, slots, BLOCK);
        fill_fast_src(&descs, seed);
        timed.push((seed, descs.clone(), metrics_a.submit_timed(&a, bn, descs)));
    }
    for (seed, descs, t) in &timed {
        assert_eq!(
            t.wait(Duration::from_secs(30)),
            Some(TransferOutcome::Success)
        );
        let (code, v) = post_json(sb.addr, "/v1/debug/verify", &verify_body(descs, *seed));
        assert_eq!((code, &v["ok"]), (200, &json!(true)), "{v}");
    }
    let std_descs = block_descs(&src, 192, &dst, &permutation(SLOTS, 77)[..16], BLOCK);
    fill_fast_src(&std_descs, 77);
    let h = a.submit_standard(bn, std_descs.clone());
    assert_eq!(
        h.wait(Duration::from_secs(30)),
        Some(TransferOutcome::Success)
    );

    // Quiesce: 0 in flight and no flows on either side, read from outside
    // (the IO threads store the gauges each tick: allow a few).
    for (addr, n) in [(sa.addr, an), (sb.addr, bn)] {
        for g in GAUGES {
            await_gauge(addr, n, g, 0.0, Duration::from_secs(5));
        }
    }

    // The live exposition of both agents passes promtool's lint.
    let ma = get(sa.addr, "/metrics").1;
    let mb = get(sb.addr, "/metrics").1;
    for n in NAMES {
        assert!(ma.contains(n), "metric {n} missing:\n{ma}");
    }
    assert_eq!(
        metric(
            &ma,
            "kvfabric_transfer_latency_seconds_count",
            &[("agent", an), ("path", "bounce"), ("outcome", "success")]
        ),
        Some(5.0),
        "{ma}"
    );
    // Seconds, not milliseconds: five loopback transfers of ≤ 1 MiB take
    // well under a minute in all.
    let sum = metric(
        &ma,
        "kvfabric_transfer_latency_seconds_sum",
        &[("agent", an)],
    )
    .unwrap();
    assert!(sum > 0.0 && sum < 60.0, "latency sum {sum} s");
    for old in [
        "kvfabric_transfer_latency_milliseconds",
        "kvfabric_credit_wait_microseconds_total",
    ] {
        assert!(!ma.contains(old), "{old} still exported");
    }
    assert!(
        metric(&ma, "kvfabric_credit_wait_seconds_total", &[("agent", an)]).is_some(),
        "{ma}"
    );
    assert_promtool_clean(&promtool, &ma, "the prefill agent's /metrics");
    assert_promtool_clean(&promtool, &mb, "the decode agent's /metrics");

    drop((sa, sb));
    nb.shutdown(Duration::from_secs(5));
    na.shutdown(Duration::from_secs(5));
    drop((na, nb, a, b));
}

#[test]
fn agent_config_layers_yaml_env_and_flags() {
    let dir = std::env::temp_dir().join(format!("kvfabric-agent-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("agent.yaml");
    std::fs::write(
        &path,
        "listen: 127.0.0.1:9999\nfabric: yamlfab\nlogicalId: from-yaml\nrole: decode\n\
         poolSizeBytes: 64MiB\nleaseTtlSeconds: 7\nbounce:\n  enabled: true\n  arenaSizeBytes: 32MiB\n",
    )
    .unwrap();
    let env = [
        ("KVFABRIC_FABRIC", "envfab"),
        (
            "KVFABRIC_ETCD_ENDPOINTS",
            "http://127.0.0.1:2379, http://127.0.0.1:22379",
        ),
        ("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", "2MiB"),
        // A bad byte size keeps the YAML value, with a warning (seed §10).
        ("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "huge"),
        ("KVFABRIC_LOG", "debug"),
        ("OTHER", "x"),
    ];
    let flags = AgentOverrides {
        logical_id: Some("from-flag".into()),
        pool_size_bytes: Some(8 << 20),
        ..AgentOverrides::default()
    };
    let (cfg, warnings) = AgentConfig::load(Some(&path), env, &flags).unwrap();
    assert_eq!(cfg.listen, "127.0.0.1:9999");
    assert_eq!(cfg.fabric, "envfab", "env beats YAML");
    assert_eq!(cfg.logical_id, "from-flag", "flags beat YAML");
    assert_eq!(cfg.role, "decode");
    assert_eq!(cfg.pool_size_bytes.get(), 8 << 20);
    assert_eq!(cfg.lease_ttl_seconds, 7);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES"));
    assert_eq!(cfg.env_warnings, warnings, "kept for /v1/config");
    // Any other unparsable value stops the load, naming the variable.
    let e = AgentConfig::load(
        Some(&path),
        [("KVFABRIC_LEASE_TTL_SECONDS", "soon")],
        &flags,
    )
    .unwrap_err();
    assert!(
        e.contains("KVFABRIC_LEASE_TTL_SECONDS") && e.contains("whole number of seconds"),
        "{e}"
    );
    assert_eq!(
        cfg.etcd_endpoints,
        vec!["http://127.0.0.1:2379", "http://127.0.0.1:22379"]
    );
    assert!(cfg.bounce.enabled);
    assert_eq!(cfg.bounce.arena_size_bytes.get(), 32 << 20);
    assert_eq!(cfg.bounce.max_chunk_size_bytes.get(), 2 << 20);

    std::fs::write(&path, "listen: 127.0.0.1:1\nbogusKey: 1\n").unwrap();
    let e = AgentConfig::load(
        Some(&path),
        Vec::<(String, String)>::new(),
        &AgentOverrides::default(),
    )
    .unwrap_err();
    assert!(e.contains("bogusKey"), "{e}");
    std::fs::write(&path, "role: router\nbounce:\n  arenaSizeBytes: 0\n").unwrap();
    let e = AgentConfig::load(
        Some(&path),
        Vec::<(String, String)>::new(),
        &AgentOverrides::default(),
    )
    .unwrap_err();
    assert!(e.contains("role") && e.contains("arenaSizeBytes"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Reads the child's stdout until the "listening on http://ADDR" line.
fn read_listen_addr(stdout: std::process::ChildStdout) -> std::sync::mpsc::Receiver<SocketAddr> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(a) = line.split("listening on http://").nth(1) {
                if let Ok(addr) = a.trim().parse() {
                    let _ = tx.send(addr);
                }
            }
        }
    });
    rx
}

#[test]
fn agent_binary_becomes_ready_and_exits_zero_on_sigterm() {
    let logical = format!("bin-agent-{}", std::process::id());
    // With the TCP control channel and a control key (required by default
    // with a key file): the daemon reads it at start-up.
    let key = std::env::temp_dir().join(format!("kvfabric-bin-key-{}", std::process::id()));
    std::fs::write(&key, "k".repeat(48) + "\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args([
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--pool-size",
            "16MiB",
            "--control-bind",
            "loopback",
            "--logical-id",
            &logical,
            "--log-format",
            "json",
            "--control-key-file",
            key.to_str().unwrap(),
        ])
        .env("KVFABRIC_BOUNCE_CONTROL_TRANSPORT", "tcp")
        .env("KVFABRIC_BOUNCE_ENABLE", "1")
        .env("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "8MiB")
        .env(
            "KVFABRIC_BOUNCE_ARENA_ALLOCATION_GRANULARITY_BYTES",
            "64KiB",
        )
        .env("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", "1MiB")
        .env("KVFABRIC_LOG", "info")
        .env_remove("KVFABRIC_ETCD_ENDPOINTS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvfabric agent");
    let addrs = read_listen_addr(child.stdout.take().unwrap());
    let mut stderr = child.stderr.take().unwrap();
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let addr = match addrs.recv_timeout(Duration::from_secs(60)) {
        Ok(a) => a,
        Err(_) => {
            let _ = child.kill();
            let status = child.wait().unwrap();
            let err = err_thread.join().unwrap();
            if err.contains("NIXL runtime") {
                common::skip(&format!("NIXL runtime not available: {err}"));
                return;
            }
            panic!("agent never announced its address ({status}); stderr:\n{err}");
        }
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, body) = get(addr, "/readyz");
        if code == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {code} {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(get(addr, "/healthz").0, 200);
    let (_, c) = get_json(addr, "/v1/config");
    assert_eq!(c["config"]["logicalId"], logical.as_str());
    let name = c["agent"].as_str().unwrap();
    let inc = name
        .strip_prefix(&format!("{logical}-"))
        .expect("incarnation name");
    assert_eq!(inc.len(), 32, "{name}");
    assert_eq!(c["incarnation"], inc);
    assert_eq!(c["bounce_effective"]["active"], true);
    assert_eq!(c["bounce_effective"]["control_kind"], "Tcp");
    assert_eq!(c["bounce_effective"]["control_auth"], "required");
    let _ = std::fs::remove_file(&key);
    let m = get(addr, "/metrics").1;
    assert_eq!(
        metric(&m, "kvfabric_lease_state", &[("agent", name)]),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, "kvfabric_arena_capacity_bytes", &[("agent", name)]),
        Some((8 << 20) as f64)
    );
    // The daemon's own exposition passes promtool's lint as well.
    if let Some(promtool) = promtool() {
        assert_promtool_clean(&promtool, &m, "the agent binary's /metrics");
    }

    // SAFETY: plain kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("agent did not exit within 20 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = err_thread.join().unwrap();
    assert!(status.success(), "exit status {status}; stderr:\n{err}");
    // Structured (JSON) logs of the shutdown sequence.
    let lines: Vec<Value> = err
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let msgs: Vec<&str> = lines
        .iter()
        .filter_map(|v| v["fields"]["message"].as_str())
        .collect();
    for want in ["agent started", "shutting down", "agent stopped", "exit"] {
        assert!(msgs.contains(&want), "no {want:?} log in {msgs:?}");
    }
}
