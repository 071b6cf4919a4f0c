//! OpenTelemetry traces of engine hand-offs (issue 15, item 4): a real
//! etcd, two `kvfabric agent` processes exporting OTLP/gRPC to a small
//! receiver in this test (no collector is packaged here), and an engine
//! (this process, through `kvfabric-client`) handing blocks off with a W3C
//! `traceparent` whose trace id the test chose. The spans must arrive with
//! their names, attributes, stage events and parent/child structure —
//! `kvfabric.transfer` parented by the caller's span, `kvfabric.submit` and
//! `kvfabric.bounce` its children, `kvfabric.arrival` on the destination
//! agent its child too — and an unsampled caller must get no spans.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::etcd::Etcd;
use common::proc::Agent;
use kvfabric_client::{pb, Client, ClientError, Session, ShmPool};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value::Value, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;

/// Distinguishes the shm pool names of one test process (see `attach`).
static SHM_SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A received span with the `kvfabric.agent` of its resource.
#[derive(Clone, Debug)]
struct Got {
    agent: String,
    span: Span,
}

/// The OTLP trace receiver: keeps every span it is sent.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Got>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut g = self.spans.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            let agent = rs
                .resource
                .as_ref()
                .and_then(|r| attr(&r.attributes, "kvfabric.agent"))
                .map(|v| v.to_string())
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    g.push(Got {
                        agent: agent.clone(),
                        span,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// An attribute's value, as text (strings) or its number.
#[derive(Clone, Debug, PartialEq)]
enum V {
    S(String),
    I(i64),
}

impl std::fmt::Display for V {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            V::S(s) => f.write_str(s),
            V::I(i) => write!(f, "{i}"),
        }
    }
}

fn attr(attrs: &[KeyValue], key: &str) -> Option<V> {
    let kv = attrs.iter().find(|kv| kv.key == key)?;
    match kv.value.as_ref()?.value.as_ref()? {
        Value::StringValue(s) => Some(V::S(s.clone())),
        Value::IntValue(i) => Some(V::I(*i)),
        other => Some(V::S(format!("{other:?}"))),
    }
}

/// Serves the receiver on 127.0.0.1 (its own thread and runtime, so it
/// answers while the test blocks); returns the endpoint URL.
fn start_receiver(r: Receiver) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(r))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l))
                .await
                .unwrap();
        });
    });
    format!("http://{addr}")
}

fn layout(blocks: u32) -> pb::KvLayout {
    pb::KvLayout {
        layers: 3,
        num_blocks: blocks,
        block_bytes: 16 * 4 * 32 * 2,
        kv_split: true,
        dtype: "bf16".into(),
        tp_rank: 0,
        tp_size: 1,
        block_tokens: 16,
        kv_heads: 4,
        head_dim: 32,
        device: -1,
        device_uuid: String::new(),
    }
}

struct Node {
    agent: Agent,
    socket: PathBuf,
}

fn spawn_agent(
    etcd: &Etcd,
    fabric: &str,
    logical: &str,
    dir: &std::path::Path,
    otlp: &str,
) -> Option<Node> {
    let socket = dir.join(format!("{logical}.sock"));
    let sock = socket.to_string_lossy().into_owned();
    let mut agent = Agent::spawn_with(
        &etcd.endpoint(),
        fabric,
        logical,
        "both",
        &[
            "--engine-socket",
            &sock,
            "--otlp-endpoint",
            otlp,
            "--trace-sample-ratio",
            "1.0",
        ],
        &[
            ("KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT", "1"),
            // Several chunks per hand-off: per-chunk stage events.
            ("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", "64KiB"),
            // Export within 100 ms (the SDK's batch delay; default 5 s).
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    match agent.addr.recv_timeout(Duration::from_secs(30)) {
        Ok(_) => Some(Node { agent, socket }),
        Err(_) => {
            let err = agent.kill_and_log();
            if err.contains("NIXL runtime") {
                common::skip(&format!("NIXL runtime not available: {err}"));
                return None;
            }
            panic!("agent never announced its address; stderr:\n{err}");
        }
    }
}

async fn attach(node: &Node, id: &str, role: pb::Role, l: pb::KvLayout) -> (Session, ShmPool) {
    let client = Client::connect(&node.socket).await.expect("connect");
    let pool = ShmPool::create(
        &format!(
            "/kvf-otel-{}-{id}-{}",
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

/// Retries while the destination's record is still propagating (≤ 10 s).
async fn until_found<T, F, Fut>(mut f: F) -> Result<T, ClientError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match f().await {
            Err(e) if e.code() == Some(tonic::Code::NotFound) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => return other,
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The spans of `trace` received so far, by name (several per name allowed).
fn spans_of(r: &Receiver, trace: &str) -> Vec<Got> {
    r.spans
        .lock()
        .unwrap()
        .iter()
        .filter(|g| hex(&g.span.trace_id) == trace)
        .cloned()
        .collect()
}

fn one<'a>(spans: &'a [Got], name: &str) -> &'a Got {
    let v: Vec<&Got> = spans.iter().filter(|g| g.span.name == name).collect();
    assert_eq!(v.len(), 1, "one {name} span expected, got {v:#?}");
    v[0]
}

#[tokio::test(flavor = "current_thread")]
async fn engine_hand_off_spans_reach_an_otlp_receiver_parented_by_the_caller() {
    let t_test = Instant::now();
    let Some(etcd) = Etcd::start("otel") else {
        return;
    };
    let receiver = Receiver::default();
    let otlp = start_receiver(receiver.clone());
    let dir = std::env::temp_dir().join(format!("kvf-otel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fabric = format!("otel-{}", std::process::id());
    let Some(mut a) = spawn_agent(&etcd, &fabric, "node-a", &dir, &otlp) else {
        return;
    };
    let mut b = spawn_agent(&etcd, &fabric, "node-b", &dir, &otlp).expect("agent b");

    let l = layout(32);
    let (prefill, mut ppool) = attach(&a, "prefill-0", pb::Role::Prefill, l.clone()).await;
    let (decode, _dpool) = attach(&b, "decode-0", pb::Role::Decode, l.clone()).await;
    for (i, x) in ppool.as_mut_slice().iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }

    // The engine's own request span: a trace id and span id the test chose.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let blocks: Vec<u32> = (0..8).collect();
    let dst: Vec<u32> = (10..18).collect();
    let bytes = 8 * 3 * 2 * l.block_bytes;
    let req =
        |rid: u64, path: pb::Path, traceparent: String, dst_engine: &str| pb::TransferRequest {
            request_id: rid,
            dst_engine: dst_engine.into(),
            src_blocks: blocks.clone(),
            dst_blocks: dst.clone(),
            path: path as i32,
            traceparent,
            ..Default::default()
        };
    let r = until_found(|| {
        prefill.transfer(req(
            7,
            pb::Path::Bounce,
            format!("00-{trace_id}-{caller_span}-01"),
            "decode-0",
        ))
    })
    .await
    .expect("transfer");
    assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");
    assert_eq!(r.path, "bounce");
    assert_eq!(r.bytes, bytes);
    let arr = decode
        .await_arrival(7, "prefill-0", Duration::from_secs(10))
        .await
        .expect("await");
    assert_eq!(arr.outcome(), pb::Outcome::Success, "{arr:?}");

    // The same caller trace, unsampled (flags 00): ParentBased follows it,
    // so no span of request 8 is ever exported, ratio 1.0 or not.
    let unsampled = "0af7651916cd43dd8448eb211c80319c";
    let r = prefill
        .transfer(req(
            8,
            pb::Path::Bounce,
            format!("00-{unsampled}-b7ad6b7169203331-00"),
            "decode-0",
        ))
        .await
        .expect("transfer 8");
    assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");
    // A request the agent refuses (unknown destination) is traced too:
    // outcome `rejected`, status error.
    let rejected = "a3ce929d0e0e47364bf92f3577b34da6";
    let e = prefill
        .transfer(req(
            9,
            pb::Path::Auto,
            format!("00-{rejected}-{caller_span}-01"),
            "nobody",
        ))
        .await
        .expect_err("unknown destination");
    assert_eq!(e.code(), Some(tonic::Code::NotFound), "{e:?}");

    // Wait for the spans (batch delay 100 ms; bounded).
    let deadline = Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let s = spans_of(&receiver, trace_id);
        let names: Vec<&str> = s.iter().map(|g| g.span.name.as_str()).collect();
        let rej = spans_of(&receiver, rejected);
        if [
            "kvfabric.transfer",
            "kvfabric.submit",
            "kvfabric.bounce",
            "kvfabric.arrival",
        ]
        .iter()
        .all(|n| names.contains(n))
            && !rej.is_empty()
        {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "spans did not arrive within 20 s; got {names:?}, rejected {}\nagent a:\n{}\nagent b:\n{}",
            rej.len(),
            a.agent.kill_and_log(),
            b.agent.kill_and_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    let caller = caller_span.to_string();
    // kvfabric.transfer: the caller's span is its parent, on agent a.
    let t = one(&spans, "kvfabric.transfer");
    let ts = &t.span;
    assert_eq!(
        hex(&ts.parent_span_id),
        caller,
        "parented by the caller's span"
    );
    assert_eq!(ts.kind, 2, "SPAN_KIND_SERVER");
    assert!(
        t.agent.starts_with("node-a"),
        "exported by agent a: {}",
        t.agent
    );
    let a_attr = |k: &str| attr(&ts.attributes, k);
    assert_eq!(a_attr("kvfabric.request_id"), Some(V::I(7)));
    assert_eq!(a_attr("kvfabric.engine"), Some(V::S("prefill-0".into())));
    assert_eq!(a_attr("kvfabric.dst_engine"), Some(V::S("decode-0".into())));
    assert_eq!(a_attr("kvfabric.path"), Some(V::S("bounce".into())));
    assert_eq!(a_attr("kvfabric.bytes"), Some(V::I(bytes as i64)));
    assert_eq!(a_attr("kvfabric.outcome"), Some(V::S("success".into())));
    assert!(a_attr("kvfabric.reason").is_none());
    let peer = a_attr("kvfabric.peer").expect("peer").to_string();
    assert!(peer.starts_with("node-b"), "peer is agent b: {peer}");
    assert!(
        ts.events.iter().any(|e| e.name == "arrival"),
        "arrival notice event: {:?}",
        ts.events
    );
    let transfer_id = hex(&ts.span_id);
    let within = |s: &Span, what: &str| {
        assert!(
            s.start_time_unix_nano >= ts.start_time_unix_nano
                && s.end_time_unix_nano <= ts.end_time_unix_nano
                && s.start_time_unix_nano <= s.end_time_unix_nano,
            "{what} [{}, {}] inside kvfabric.transfer [{}, {}]",
            s.start_time_unix_nano,
            s.end_time_unix_nano,
            ts.start_time_unix_nano,
            ts.end_time_unix_nano
        );
    };

    // kvfabric.submit and kvfabric.bounce: children of kvfabric.transfer.
    let sub = &one(&spans, "kvfabric.submit").span;
    assert_eq!(hex(&sub.parent_span_id), transfer_id);
    within(sub, "kvfabric.submit");
    let bounce = &one(&spans, "kvfabric.bounce").span;
    assert_eq!(hex(&bounce.parent_span_id), transfer_id);
    within(bounce, "kvfabric.bounce");
    assert!(sub.end_time_unix_nano <= bounce.start_time_unix_nano + 1_000);

    // Per-chunk stage events on kvfabric.bounce, in order per chunk.
    let mut per_chunk: HashMap<i64, HashMap<String, u64>> = HashMap::new();
    for e in &bounce.events {
        let Some(V::I(c)) = attr(&e.attributes, "kvfabric.chunk") else {
            panic!("event {} without kvfabric.chunk", e.name);
        };
        per_chunk
            .entry(c)
            .or_default()
            .insert(e.name.clone(), e.time_unix_nano);
        assert!(
            e.time_unix_nano >= bounce.start_time_unix_nano
                && e.time_unix_nano <= bounce.end_time_unix_nano,
            "event {} inside its span",
            e.name
        );
    }
    // 192 KiB in chunks of at most 64 KiB: every chunk 0..n has its events.
    let chunks = per_chunk.len() as i64;
    assert!(chunks >= 3, "{:#?}", bounce.events);
    assert!((0..chunks).all(|c| per_chunk.contains_key(&c)));
    assert!(per_chunk[&0].contains_key("want"));
    for (c, ev) in &per_chunk {
        let at = |n: &str| {
            *ev.get(n)
                .unwrap_or_else(|| panic!("chunk {c}: no {n} event: {ev:?}"))
        };
        assert!(
            at("gather") <= at("write") && at("write") <= at("data") && at("data") <= at("ack"),
            "chunk {c}: gather ≤ write ≤ data ≤ ack: {ev:?}"
        );
    }

    // kvfabric.arrival: on agent b, a child of kvfabric.transfer.
    let arr = one(&spans, "kvfabric.arrival");
    assert_eq!(arr.agent, peer, "exported by the destination agent");
    assert_eq!(hex(&arr.span.parent_span_id), transfer_id);
    assert_eq!(
        attr(&arr.span.attributes, "kvfabric.request_id"),
        Some(V::I(7))
    );
    assert_eq!(
        attr(&arr.span.attributes, "kvfabric.outcome"),
        Some(V::S("success".into()))
    );
    assert_eq!(
        attr(&arr.span.attributes, "kvfabric.bytes"),
        Some(V::I(bytes as i64))
    );

    // The refused request: one span, outcome rejected, status error.
    let rej = spans_of(&receiver, rejected);
    let rt = &one(&rej, "kvfabric.transfer").span;
    assert_eq!(hex(&rt.parent_span_id), caller);
    assert_eq!(
        attr(&rt.attributes, "kvfabric.outcome"),
        Some(V::S("rejected".into()))
    );
    assert_eq!(
        rt.status.as_ref().map(|s| s.code),
        Some(2),
        "STATUS_CODE_ERROR"
    );

    // Nothing of the unsampled caller (given a further export period).
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        spans_of(&receiver, unsampled).is_empty(),
        "an unsampled traceparent is followed"
    );
    // Engines gone first (an open engine connection holds the agent's
    // shutdown for its 5 s drain bound).
    drop((prefill, decode, ppool, _dpool));
    // (This runtime closes their connections.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (sa, la) = a.agent.terminate();
    let (sb, lb) = b.agent.terminate();
    assert!(sa.is_some_and(|s| s.success()), "agent a exit: {la}");
    assert!(sb.is_some_and(|s| s.success()), "agent b exit: {lb}");
    eprintln!("otel_traces: {:.1} s", t_test.elapsed().as_secs_f64());
}

/// Overhead of tracing at the default sample ratio (a benchmark, not a
/// timed test; run it explicitly, numbers in docs/benchmarks.md):
///
/// `cargo test --release -p kvfabric-agent --test otel_traces -- --ignored --nocapture`
///
/// Two agent pairs on this host: one without `--otlp-endpoint`, one
/// exporting to the receiver at the default ratio (no `traceparent` from
/// the engine, so the ratio decides). Rounds of sequential bounce hand-offs
/// alternate between the pairs; the engine's call latency and the agent's
/// `submit_us` are compared.
#[tokio::test(flavor = "current_thread")]
#[ignore = "benchmark: run with --ignored --nocapture"]
async fn overhead_at_default_sample_ratio() {
    let rounds: usize = std::env::var("OTEL_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let per_round: usize = std::env::var("OTEL_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let Some(etcd) = Etcd::start("otel-bench") else {
        return;
    };
    let receiver = Receiver::default();
    let otlp = start_receiver(receiver.clone());
    let dir = std::env::temp_dir().join(format!("kvf-otel-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fabric = format!("otelb-{}", std::process::id());
    let spawn = |logical: &str, traced: bool| {
        let socket = dir.join(format!("{logical}.sock"));
        let sock = socket.to_string_lossy().into_owned();
        let mut args = vec!["--engine-socket".to_string(), sock];
        if traced {
            args.extend(["--otlp-endpoint".to_string(), otlp.clone()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut agent = Agent::spawn_with(
            &etcd.endpoint(),
            &fabric,
            logical,
            "both",
            &args,
            &[("KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT", "1")],
        );
        agent
            .addr
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("agent {logical}: {}", agent.kill_and_log()));
        Node { agent, socket }
    };
    // OTEL_BENCH_SWAP=1 starts and attaches the traced pair first (a
    // check that the order of the pairs does not decide the result).
    let names = if std::env::var_os("OTEL_BENCH_SWAP").is_some() {
        ["traced", "plain"]
    } else {
        ["plain", "traced"]
    };
    let nodes: Vec<Node> = names
        .iter()
        .flat_map(|n| [format!("{n}-a"), format!("{n}-b")])
        .map(|logical| spawn(&logical, logical.starts_with("traced")))
        .collect();
    let l = layout(64);
    let mut pairs = Vec::new();
    for (k, name) in names.into_iter().enumerate() {
        let (src, sp) = attach(
            &nodes[2 * k],
            &format!("{name}-p"),
            pb::Role::Prefill,
            l.clone(),
        )
        .await;
        let (dst, dp) = attach(
            &nodes[2 * k + 1],
            &format!("{name}-d"),
            pb::Role::Decode,
            l.clone(),
        )
        .await;
        // Warm-up (and the destination's record propagated).
        let dst_engine = format!("{name}-d");
        until_found(|| src.transfer_blocks(1, &dst_engine, &[0], &[0]))
            .await
            .expect("warm-up");
        pairs.push((name, src, dst, sp, dp));
    }
    let blocks: Vec<u32> = (0..8).collect();
    // [config][round] → call latencies (µs); [config] → submit_us.
    let mut lat: [Vec<Vec<f64>>; 2] = [Vec::new(), Vec::new()];
    let mut sub: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut rid = 100u64;
    for round in 0..rounds {
        // AB, then BA: neither pair always goes first.
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            let (name, src, _, _, _) = &pairs[k];
            let dst_engine = format!("{name}-d");
            let mut v = Vec::with_capacity(per_round);
            for _ in 0..per_round {
                rid += 1;
                let t0 = Instant::now();
                let r = src
                    .transfer(pb::TransferRequest {
                        request_id: rid,
                        dst_engine: dst_engine.clone(),
                        src_blocks: blocks.clone(),
                        dst_blocks: blocks.clone(),
                        path: pb::Path::Bounce as i32,
                        ..Default::default()
                    })
                    .await
                    .expect("transfer");
                v.push(t0.elapsed().as_secs_f64() * 1e6);
                assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");
                sub[k].push(r.submit_us as f64);
            }
            lat[k].push(v);
        }
    }
    fn pct(v: &[f64], p: f64) -> f64 {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v[((v.len() - 1) as f64 * p).round() as usize]
    }
    let bytes = 8 * 3 * 2 * l.block_bytes;
    println!(
        "otel overhead: {rounds} rounds × {per_round} bounce hand-offs of {bytes} B per config, interleaved"
    );
    let traced_k = names.iter().position(|n| *n == "traced").unwrap();
    for k in [1 - traced_k, traced_k] {
        let all: Vec<f64> = lat[k].concat();
        let mean = all.iter().sum::<f64>() / all.len() as f64;
        println!(
            "{:>6}: call µs mean {mean:.1} p50 {:.1} p99 {:.1}; submit_us p50 {:.0} p99 {:.0}",
            names[k],
            pct(&all, 0.5),
            pct(&all, 0.99),
            pct(&sub[k], 0.5),
            pct(&sub[k], 0.99)
        );
    }
    // Per round: traced p50 − plain p50 (the pairs ran back to back).
    let diffs: Vec<f64> = (0..rounds)
        .map(|r| pct(&lat[traced_k][r], 0.5) - pct(&lat[1 - traced_k][r], 0.5))
        .collect();
    println!(
        "per-round p50 difference traced − plain, µs: median {:.1}, min {:.1}, max {:.1}",
        pct(&diffs, 0.5),
        pct(&diffs, 0.0),
        pct(&diffs, 1.0)
    );
    let exported = receiver
        .spans
        .lock()
        .unwrap()
        .iter()
        .filter(|g| g.span.name == "kvfabric.transfer")
        .count();
    println!(
        "traced pair: {exported} kvfabric.transfer spans exported of {} calls",
        rounds * per_round + 1
    );
    drop(pairs);
    tokio::time::sleep(Duration::from_millis(200)).await;
    for mut n in nodes {
        n.agent.terminate();
    }
    micro(&otlp);
}

/// [`micro`] alone: `cargo test --release -p kvfabric-agent --test
/// otel_traces trace_cost_in_process -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn trace_cost_in_process() {
    micro(&start_receiver(Receiver::default()));
}

/// The trace code's own cost per `Transfer` call, in process: the
/// sampler's decision at the default ratio (almost always "drop"), and a
/// sampled call's whole trace (4 spans' worth, 4 chunks × 4 stage events).
fn micro(otlp: &str) {
    use kvfabric_agent::runtime::transport::{Stage, StageEvent};
    use kvfabric_agent::service::traces::{Traces, DEFAULT_SAMPLE_RATIO};
    use opentelemetry::KeyValue;
    for (ratio, n) in [(DEFAULT_SAMPLE_RATIO, 200_000u32), (1.0, 20_000)] {
        let t = Traces::start(otlp, ratio, "bench").expect("pipeline");
        let mut sampled = 0u32;
        let t0 = Instant::now();
        for i in 0..n {
            let received = Instant::now();
            let attrs = || {
                vec![
                    KeyValue::new("kvfabric.request_id", i64::from(i)),
                    KeyValue::new("kvfabric.engine", "prefill-0".to_string()),
                    KeyValue::new("kvfabric.dst_engine", "decode-0".to_string()),
                    KeyValue::new("kvfabric.agent", "bench".to_string()),
                ]
            };
            let Some(mut tr) = t.begin_transfer("", received, attrs) else {
                continue;
            };
            sampled += 1;
            tr.peer = Some("peer".into());
            let now = Instant::now();
            tr.timeline = (0..4u32)
                .flat_map(|chunk| {
                    [
                        Stage::Gathered,
                        Stage::WritePosted,
                        Stage::DataSent,
                        Stage::Acked,
                    ]
                    .map(|stage| StageEvent {
                        stage,
                        chunk,
                        at: now,
                    })
                })
                .collect();
            tr.path = Some(("kvfabric.bounce", received, now));
            tr.arrival_sent = Some(now);
            let _ = tr.traceparent();
            tr.finish(
                "success",
                "",
                "bounce",
                196_608,
                48,
                None,
                None,
                Instant::now(),
            );
        }
        let ns = t0.elapsed().as_nanos() as f64 / f64::from(n);
        println!("in-process, ratio {ratio}: {ns:.0} ns per call ({sampled} of {n} sampled)");
        t.shutdown();
    }
}
