//! Distributed mode end to end: a real etcd, two real `kvfabric agent`
//! processes (prefill and decode) registered in it, and `kvfabric bench
//! --etcd ...` as a client of both, replaying a slice of the Mooncake
//! conversation trace with Qwen2.5-7B's KV geometry (TP 4, block 16)
//! through bounce and the standard path; every byte is verified by the
//! decode agent (`/v1/debug/verify`). Then SIGTERM → both agents exit 0.
//!
//! Set `KVFABRIC_ETCD_BIN` to pick the etcd binary (default: `etcd` on the
//! PATH, then /usr/bin/etcd). Without one the test prints
//! "SKIP: etcd not installed" and passes (fails instead under `.ci/run`,
//! which installs etcd and sets `KVFABRIC_REQUIRE_SERVICES`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

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
fn two_agents_etcd_and_bench_client_move_a_trace_slice_byte_exact() {
    let dir = std::env::temp_dir().join(format!("kvfabric-distributed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let Some(etcd) = Etcd::start("dist") else {
        return;
    };
    let fabric = format!("dist-{}", std::process::id());
    let mut prefill = Agent::spawn(&etcd.endpoint(), &fabric, "prefill", "prefill");
    let mut decode = Agent::spawn(&etcd.endpoint(), &fabric, "decode", "decode");
    for a in [&mut prefill, &mut decode] {
        if a.addr.recv_timeout(Duration::from_secs(30)).is_err() {
            let err = a.kill_and_log();
            if err.contains("NIXL runtime") {
                common::skip(&format!("NIXL runtime not available: {err}"));
                return;
            }
            panic!("agent never announced its address; stderr:\n{err}");
        }
    }

    let (trace, start) = trace(&dir);
    let json = dir.join("report.json");
    let bench = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(["bench", "--etcd", &etcd.endpoint(), "--fabric", &fabric])
        .args(["--prefill", "prefill", "--decode", "decode"])
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

    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("report written"))
            .expect("report is JSON");
    assert_eq!(report["model"], "Qwen2.5-7B", "{report}");
    assert_eq!(report["requests"], REQUESTS, "{report}");
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

    debug_transfer_api(&etcd.endpoint(), &fabric);

    for (who, a) in [("prefill", &mut prefill), ("decode", &mut decode)] {
        let (status, log) = a.terminate();
        match status {
            Some(s) => assert!(s.success(), "{who} exited {s}; stderr:\n{log}"),
            None => panic!("{who} did not exit within 20 s of SIGTERM; stderr:\n{log}"),
        }
    }
    drop(etcd);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The daemon side of distributed mode, directly: records in etcd carry the
/// HTTP URL, role and pool; `/v1/debug/transfer` resolves a logical id,
/// rejects bad requests with the documented codes, moves bytes that
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
        assert!(n >= (REQUESTS + 1) as f64, "{path} submissions {n}:\n{m}");
    }
    assert!(m.contains("kvfabric_transfer_latency_seconds"), "{m}");
}

/// `GET path` as text (HTTP/1.0, read to EOF).
fn get_text(base: &str, path: &str) -> String {
    let hostport = base.strip_prefix("http://").unwrap();
    let mut s = TcpStream::connect(hostport).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {hostport}\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    body.to_string()
}
