//! Distributed mode end to end: a real etcd, two real `kvfabric agent`
//! processes (prefill and decode) serving the engine API
//! (`--engine-socket`) and no debug endpoints, and `kvfabric bench
//! --prefill-socket ... --decode-socket ...` attaching one engine to each
//! (shm pools, the model's layout), replaying a slice of the Mooncake
//! conversation trace with Qwen2.5-7B's KV geometry (TP 4, block 16)
//! through bounce and the standard path by block id; the bench verifies
//! every byte in its own decode pool. The agents count the hand-offs and
//! release the bench's engines and pools once it exits. Then SIGTERM →
//! both agents exit 0.
//!
//! The debug endpoints (behind `--debug-api`) are covered on a second pair
//! of agents with them on ([`debug_transfer_api`]).
//!
//! Set `KVFABRIC_ETCD_BIN` to pick the etcd binary (default: `etcd` on the
//! PATH, then /usr/bin/etcd). Without one the test prints
//! "SKIP: etcd not installed" and passes (fails instead under `.ci/run`,
//! which installs etcd and sets `KVFABRIC_REQUIRE_SERVICES`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::etcd::Etcd;
use common::proc::{Agent, Proc};
use kvfabric_agent::bench::remote::{http_json, lookup_agents, RemoteAgent};
use serde_json::{json, Value};
/// Slice of the real trace: six consecutive short requests (895–1459
/// tokens), so 64 MiB pools hold them with Qwen2.5-7B TP 4 geometry.
const TRACE_START: usize = 8087;
const TRACE_LENGTHS: [u64; 6] = [909, 897, 900, 896, 895, 1459];
const REQUESTS: usize = TRACE_LENGTHS.len();

/// The real trace when present, else a synthetic one with the same input
/// lengths; returns (path, --start).
fn trace(dir: &Path) -> (PathBuf, usize) {
    let real = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/traces/mooncake_conversation_trace.jsonl");
    if let Ok(text) = std::fs::read_to_string(&real) {
        let lens: Vec<u64> = text
            .lines()
            .skip(TRACE_START)
            .take(REQUESTS)
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| v["input_length"].as_u64())
            .collect();
        if lens == TRACE_LENGTHS {
            return (real, TRACE_START);
        }
    }
    eprintln!("note: Mooncake trace not found beside the checkout; using a synthetic slice");
    let p = dir.join("trace.jsonl");
    let text: String = TRACE_LENGTHS
        .iter()
        .enumerate()
        .map(|(i, n)| {
            format!(
                "{{\"timestamp\": {}, \"input_length\": {n}, \"output_length\": 100, \"hash_ids\": []}}\n",
                i * 100
            )
        })
        .collect();
    std::fs::write(&p, text).unwrap();
    (p, 0)
}

#[test]
fn two_agents_and_bench_engines_move_a_trace_slice_byte_exact() {
    let dir = std::env::temp_dir().join(format!("kvfabric-distributed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let Some(etcd) = Etcd::start("dist") else {
        return;
    };
    let fabric = format!("dist-{}", std::process::id());
    let debug_fabric = format!("{fabric}-debug");
    let sock = |who: &str| dir.join(format!("{who}.sock"));
    let (psock, dsock) = (sock("prefill"), sock("decode"));
    // The bench's agents: engine API on, debug API off.
    let engine_agent = |logical: &str, socket: &Path| {
        Agent::spawn_opts(
            &etcd.endpoint(),
            &fabric,
            logical,
            logical,
            &["--engine-socket", socket.to_str().unwrap()],
            &[],
            false,
        )
    };
    let mut prefill = engine_agent("prefill", &psock);
    let mut decode = engine_agent("decode", &dsock);
    // debug_transfer_api's agents: --debug-api, as before.
    let mut dbg_prefill = Agent::spawn(&etcd.endpoint(), &debug_fabric, "prefill", "prefill");
    let mut dbg_decode = Agent::spawn(&etcd.endpoint(), &debug_fabric, "decode", "decode");
    let mut http = Vec::new();
    for a in [&mut prefill, &mut decode, &mut dbg_prefill, &mut dbg_decode] {
        match a.addr.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => http.push(format!("http://{addr}")),
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
    let (p_http, d_http) = (&http[0], &http[1]);

    let (trace, start) = trace(&dir);
    let json = dir.join("report.json");
    let t0 = Instant::now();
    let bench = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .arg("bench")
        .arg("--prefill-socket")
        .arg(&psock)
        .arg("--decode-socket")
        .arg(&dsock)
        .arg("--trace")
        .arg(&trace)
        .args(["--start", &start.to_string()])
        .args(["--requests", &REQUESTS.to_string()])
        .args(["--model", "Qwen2.5-7B", "--tp", "4", "--block", "16"])
        .args(["--concurrency", "3", "--wait", "20", "--quiet"])
        .arg("--json")
        .arg(&json)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvfabric bench");
    let mut bench = Proc { child: Some(bench) };
    let bench_pid = bench.pid();
    let mut out = bench.child.as_mut().unwrap().stdout.take().unwrap();
    let mut err = bench.child.as_mut().unwrap().stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = bench.wait_for(Duration::from_secs(40));
    let took = t0.elapsed();
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    let logs = |p: &mut Agent, d: &mut Agent| {
        format!(
            "bench stdout:\n{out}\nbench stderr:\n{err}\nprefill:\n{}\ndecode:\n{}",
            p.kill_and_log(),
            d.kill_and_log()
        )
    };
    match status {
        Some(s) if s.success() => {}
        Some(s) => panic!("bench exited {s}\n{}", logs(&mut prefill, &mut decode)),
        None => panic!(
            "bench did not finish within 40 s\n{}",
            logs(&mut prefill, &mut decode)
        ),
    }
    eprintln!("{err}{out}");
    eprintln!("distributed bench run (process start to exit): {took:.2?}");

    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("report written"))
            .expect("report is JSON");
    assert_eq!(report["model"], "Qwen2.5-7B", "{report}");
    assert_eq!(report["requests"], REQUESTS, "{report}");
    assert_eq!(report["request_id_key"], "request", "{report}");
    let paths = report["paths"].as_array().expect("paths");
    let names: Vec<&str> = paths.iter().filter_map(|p| p["path"].as_str()).collect();
    assert_eq!(names, ["bounce", "standard"], "{report}");
    for p in paths {
        assert_eq!(p["failures"], 0, "{p}");
        assert_eq!(p["requests"], REQUESTS, "{p}");
        assert!(p["bytes"].as_u64().unwrap() > 0, "{p}");
        assert!(p["p99_ms"].as_f64().unwrap() > 0.0, "{p}");
    }
    assert!(
        report["p99_ratio_bounce_over_standard"].as_f64().is_some(),
        "{report}"
    );
    assert!(out.contains("bounce / standard"), "{out}");
    assert!(
        err.contains(&format!("engine bench-prefill-{bench_pid} on agent")),
        "{err}"
    );

    // Through the engine API, not the debug API: the bench's agents serve
    // no debug endpoint, count the engine hand-offs and arrivals, and have
    // released the bench's engines and pools (it detached at exit).
    for base in [p_http, d_http] {
        for path in ["/v1/debug/transfer", "/v1/debug/verify"] {
            assert_eq!(http_text(base, "POST", path).0, 404, "{base}{path}");
        }
    }
    let hand_offs = (2 * REQUESTS) as f64;
    let m = get_text(p_http, "/metrics");
    let ok = sample(&m, "kvfabric_engine_transfers_total", "outcome=\"success\"");
    assert!(ok >= hand_offs, "prefill engine transfers {ok}:\n{m}");
    let m = get_text(d_http, "/metrics");
    let arrived = sample(&m, "kvfabric_engine_arrivals_total", "");
    assert!(arrived >= hand_offs, "decode arrivals {arrived}:\n{m}");
    for base in [p_http, d_http] {
        let t0 = Instant::now();
        loop {
            let m = get_text(base, "/metrics");
            let (engines, pools) = (
                sample(&m, "kvfabric_engines", ""),
                sample(&m, "kvfabric_engine_pool_bytes", ""),
            );
            if engines == 0.0 && pools == 0.0 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{base}: {engines} engines, {pools} pool bytes still held after the bench exited"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(&format!("kvfabric-bench-{bench_pid}-")))
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "shm pools left behind: {left:?}");

    debug_transfer_api(&etcd.endpoint(), &debug_fabric);

    for (who, a) in [
        ("prefill", &mut prefill),
        ("decode", &mut decode),
        ("debug prefill", &mut dbg_prefill),
        ("debug decode", &mut dbg_decode),
    ] {
        let (status, log) = a.terminate();
        match status {
            Some(s) => assert!(s.success(), "{who} exited {s}; stderr:\n{log}"),
            None => panic!("{who} did not exit within 20 s of SIGTERM; stderr:\n{log}"),
        }
    }
    assert!(
        !psock.exists() && !dsock.exists(),
        "sockets removed at exit"
    );
    drop(etcd);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The debug endpoints of agents started with `--debug-api` (fabric
/// `fabric`, logical ids prefill / decode): records in etcd carry the HTTP
/// URL, role and pool; `/v1/debug/transfer` resolves a logical id, rejects
/// bad requests with the documented codes, moves bytes that
/// `/v1/debug/verify` finds exact (and a wrong seed does not), and the
/// prefill agent's metrics count the traffic.
fn debug_transfer_api(etcd: &str, fabric: &str) {
    let recs = lookup_agents(
        &[etcd.to_string()],
        fabric,
        &["prefill", "decode"],
        Duration::from_secs(5),
    )
    .expect("both records in etcd");
    let p = RemoteAgent::from_record(recs[0].clone()).expect("prefill record usable");
    let d = RemoteAgent::from_record(recs[1].clone()).expect("decode record usable");
    assert_eq!(
        (p.record.role.as_str(), d.record.role.as_str()),
        ("prefill", "decode")
    );
    assert_eq!(p.pool.len, 64 << 20);
    // Each has loaded the other (the prefill agent: bounce-compatible).
    let t0 = Instant::now();
    let loaded = |a: &RemoteAgent, peer: &str, bounce: bool| {
        let (code, v) = a.get("/v1/peers").expect("/v1/peers");
        code == 200
            && v["peers"].as_array().is_some_and(|ps| {
                ps.iter().any(|x| {
                    x["name"] == peer && (!bounce || x["bounce_compatible"] == json!(true))
                })
            })
    };
    while !(loaded(&p, d.name(), true) && loaded(&d, p.name(), false)) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "debug agents not paired after 20 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let t = Duration::from_secs(30);
    let post = |a: &RemoteAgent, path: &str, body: Value| {
        http_json(&a.record.http, "POST", path, Some(&body.to_string()), t).expect(path)
    };
    let descs: Vec<Value> = (0..8u64)
        .map(|k| {
            json!({"src": p.pool.addr + k * 8192, "dst": d.pool.addr + (7 - k) * 8192 + 64, "len": 4096 + k})
        })
        .collect();
    let xfer = |peer: &str, path: &str, descriptors: &[Value]| {
        post(
            &p,
            "/v1/debug/transfer",
            json!({"peer": peer, "path": path, "seed": 99, "descriptors": descriptors}),
        )
    };
    let (code, v) = xfer("nobody", "bounce", &descs);
    assert_eq!(code, 404, "{v}");
    let (code, v) = xfer("decode", "sideways", &descs);
    assert_eq!(code, 400, "{v}");
    let (code, v) = xfer(
        "decode",
        "standard",
        &[json!({"src": 4096, "dst": d.pool.addr, "len": 8})],
    );
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("source"), "{v}");
    let (code, v) = xfer(
        "decode",
        "standard",
        &[json!({"src": p.pool.addr, "dst": d.pool.addr + d.pool.len - 4, "len": 8})],
    );
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("destination"), "{v}");

    let verify = |seed: u64| {
        let ds: Vec<Value> = descs
            .iter()
            .map(|x| json!({"dst": x["dst"], "len": x["len"]}))
            .collect();
        post(
            &d,
            "/v1/debug/verify",
            json!({"seed": seed, "descriptors": ds}),
        )
    };
    for path in ["bounce", "standard"] {
        let (code, v) = xfer("decode", path, &descs);
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["outcome"], "success", "{v}");
        assert_eq!(
            v["peer"],
            d.name(),
            "logical id resolved to the live incarnation"
        );
        assert_eq!(v["path"], path);
        assert_eq!(v["descriptors"], 8);
        assert!(v["latency_ms"].as_f64().unwrap() > 0.0, "{v}");
        let (code, v) = verify(99);
        assert_eq!((code, &v["ok"]), (200, &json!(true)), "{v}");
    }
    let (code, v) = verify(98);
    assert_eq!(
        (code, &v["ok"]),
        (200, &json!(false)),
        "a wrong seed must not verify: {v}"
    );

    let m = get_text(&p.record.http, "/metrics");
    for path in ["bounce", "standard"] {
        let series = "kvfabric_submissions_total{";
        let n: f64 = m
            .lines()
            .filter(|l| l.starts_with(series) && l.contains(&format!("path=\"{path}\"")))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum();
        assert!(n >= 1.0, "{path} submissions {n}:\n{m}");
    }
    assert!(m.contains("kvfabric_transfer_latency_seconds"), "{m}");
}

/// `METHOD path` (empty body) → (status, body text) (HTTP/1.0, read to
/// EOF).
fn http_text(base: &str, method: &str, path: &str) -> (u16, String) {
    let hostport = base.strip_prefix("http://").unwrap();
    let mut s = TcpStream::connect(hostport).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: {hostport}\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line: {head}"));
    (code, body.to_string())
}

/// `GET path` as text; the answer must be 200.
fn get_text(base: &str, path: &str) -> String {
    let (code, body) = http_text(base, "GET", path);
    assert_eq!(code, 200, "GET {base}{path}: {body}");
    body
}

/// Sum of the samples of metric `name` in `text` whose labels contain
/// `label` (every label set when empty).
fn sample(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| label.is_empty() || l.contains(label))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}
