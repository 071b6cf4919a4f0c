//! Grant policies on real traces, in a model (issue 18, ninth session:
//! does `oldestFirst` queue small requests behind large ones?). Not a
//! criterion benchmark: a report.
//!
//! A sender and a receiver protocol [`Machine`] (the real ones, pure) move
//! the requests of a Mooncake trace in a discrete-event model with
//! virtual time:
//!
//! * one GPU: every gather, write and scatter is served first come first
//!   served by one copy server taking `COPY_FIXED_NS` plus the bytes at
//!   `COPY_BYTES_PER_NS` (a request of the seed's 151 MB shape, five
//!   chunks, takes 0.30 ms of copying: ≈ 3,370 requests a second at
//!   saturation, near the H200's measured 3,150–3,800). An assumption:
//!   the real GPU runs copies on several streams at once, sharing the
//!   bandwidth, where this server runs one at a time (a scatter can wait
//!   behind another request's eager gathers);
//! * control messages arrive `CONTROL_NS` after they are sent;
//! * KV geometry of the GPU bench's seed-shaped load: gpt-oss-120b, TP 4,
//!   16-token blocks, K/V split: 72 descriptors of 4 KiB per block.
//!
//! Arrivals keep the trace's order and spacing (sorted by timestamp;
//! requests sharing a timestamp, which the conversation trace rounds to
//! 3 s, are spread evenly up to the next one), sped up so that the
//! offered copy load is a given share of the copy server's capacity.
//! Latency counts from the arrival to the sender's resolution; the report
//! gives p50 / p99 of all requests and of the smallest quarter by prompt
//! (by rank) under each policy.
//!
//! Run: `cargo bench -p kvfabric-core --bench policy_model` (traces:
//! `KVFABRIC_TRACE`, default the conversation and synthetic traces of
//! `../shared/data/traces/` beside the repository;
//! `KVFABRIC_MODEL_REQUESTS` caps the requests of each, default 4,000;
//! `KVFABRIC_MODEL_SIZE_WEIGHTS=1,8` adds shortest first at those
//! `grantSizeWeight`s beside the default).

use kvfabric_core::model::{parse_trace, TraceRecord};
use kvfabric_core::protocol::{Action, Input, Machine, Outcome, Route};
use kvfabric_core::scheduler::{GrantPolicy, DEFAULT_SIZE_WEIGHT};

#[path = "common/pair.rs"]
mod pair;
use kvfabric_core::{ScatterList, UniformScatter};
use pair::{bounds, config, PIECE};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Descriptors per 16-token block (gpt-oss-120b, TP 4, K/V split).
const PIECES_PER_BLOCK: u64 = 72;
/// Tokens per block.
const BLOCK_TOKENS: u64 = 16;
/// Fixed cost of one copy (launch, completion), ns.
const COPY_FIXED_NS: u64 = 3_000;
/// Copy bandwidth of the one GPU, bytes per ns (1.8 TB/s).
const COPY_BYTES_PER_NS: u64 = 1_800;
/// One control message's delay, ns.
const CONTROL_NS: u64 = 25_000;

/// Pieces of a prompt of `tokens` tokens.
fn pieces(tokens: u64) -> u64 {
    tokens.div_ceil(BLOCK_TOKENS) * PIECES_PER_BLOCK
}

/// What the event queue delivers.
enum Event {
    /// Request `k` of the run arrives at the sender.
    Arrive(usize),
    /// An input for the receiver (`true`) or the sender.
    Deliver(bool, Input),
}

/// Events by time (ties in the order pushed).
#[derive(Default)]
struct Queue {
    order: BinaryHeap<Reverse<(u64, u64)>>,
    events: HashMap<u64, Event>,
    seq: u64,
}

impl Queue {
    fn push(&mut self, at: u64, e: Event) {
        self.seq += 1;
        self.events.insert(self.seq, e);
        self.order.push(Reverse((at, self.seq)));
    }

    fn pop(&mut self) -> Option<(u64, Event)> {
        let Reverse((at, id)) = self.order.pop()?;
        self.events.remove(&id).map(|e| (at, e))
    }
}

/// Requests to model: prompt tokens and arrival offsets (ms, from the
/// first, not decreasing).
struct Workload {
    tokens: Vec<u64>,
    arrival_ms: Vec<f64>,
}

impl Workload {
    /// From a trace: sorted by timestamp (stable); requests sharing a
    /// timestamp spread evenly up to the next distinct one (the last
    /// group over the mean gap between distinct timestamps).
    fn of(trace: &[TraceRecord]) -> Self {
        let mut recs: Vec<&TraceRecord> = trace.iter().collect();
        recs.sort_by_key(|r| r.timestamp);
        let t0 = recs.first().map_or(0, |r| r.timestamp);
        let distinct: Vec<u64> = {
            let mut d: Vec<u64> = recs.iter().map(|r| r.timestamp).collect();
            d.dedup();
            d
        };
        let mean_gap = if distinct.len() > 1 {
            (distinct[distinct.len() - 1] - distinct[0]) as f64 / (distinct.len() - 1) as f64
        } else {
            0.0
        };
        let mut arrival_ms = Vec::with_capacity(recs.len());
        let mut i = 0;
        while i < recs.len() {
            let ts = recs[i].timestamp;
            let n = recs[i..].iter().take_while(|r| r.timestamp == ts).count();
            let gap = recs
                .get(i + n)
                .map_or(mean_gap, |r| (r.timestamp - ts) as f64);
            for k in 0..n {
                arrival_ms.push((ts - t0) as f64 + gap * k as f64 / n as f64);
            }
            i += n;
        }
        Self {
            tokens: recs.iter().map(|r| r.input_length).collect(),
            arrival_ms,
        }
    }

    fn len(&self) -> usize {
        self.tokens.len()
    }

    /// The same arrivals, every prompt `tokens` long.
    fn with_prompts(&self, tokens: u64) -> Self {
        Self {
            tokens: vec![tokens; self.len()],
            arrival_ms: self.arrival_ms.clone(),
        }
    }
}

/// Latencies from arrival (ms) of one run, by request; `size_weight`:
/// `grantSizeWeight` of both machines (shortest first only).
fn run(w: &Workload, speed: f64, policy: GrantPolicy, size_weight: u64) -> Vec<f64> {
    let cfg = |name: &str| {
        let mut c = config(name, policy, 600_000_000_000);
        c.grant_size_weight = size_weight;
        c
    };
    let mut tx = Machine::new(cfg("tx")).expect("sender config");
    let mut rx = Machine::new(cfg("rx")).expect("receiver config");
    rx.handle(
        0,
        Input::AllowScatter {
            addr: 0x1000_0000_0000,
            len: 1 << 46,
        },
    );
    tx.handle(0, Input::PeerAdded { peer: "rx".into() });
    let mut events = Queue::default();
    let mut arrival_ns = vec![0u64; w.len()];
    for (k, &at) in w.arrival_ms.iter().enumerate() {
        arrival_ns[k] = (at * 1e6 / speed) as u64;
        events.push(arrival_ns[k], Event::Arrive(k));
    }
    let mut copy_free_at = 0u64;
    let mut latency = vec![f64::NAN; w.len()];
    let mut resolved = 0usize;
    while let Some((now, e)) = events.pop() {
        match e {
            Event::Arrive(k) => {
                let chunks = bounds(pieces(w.tokens[k]));
                tx.handle(
                    now,
                    Input::Submit {
                        rid: k as u64 + 1,
                        peer: "rx".into(),
                        scope: 0,
                        chunks,
                    },
                );
            }
            Event::Deliver(true, input) => rx.handle(now, input),
            Event::Deliver(false, input) => tx.handle(now, input),
        }
        for (is_rx, m) in [(false, &mut tx), (true, &mut rx)] {
            while let Some(act) = m.poll_action() {
                // One copy server, first come first served.
                let mut copy = |bytes: u64| {
                    let start = copy_free_at.max(now);
                    copy_free_at = start + COPY_FIXED_NS + bytes / COPY_BYTES_PER_NS;
                    copy_free_at
                };
                match act {
                    Action::Send { msg, .. } => {
                        let from = if is_rx { "rx" } else { "tx" };
                        events.push(
                            now + CONTROL_NS,
                            Event::Deliver(
                                !is_rx,
                                Input::Message {
                                    from: from.into(),
                                    msg,
                                    route: Route::Usable,
                                },
                            ),
                        );
                    }
                    Action::StartGather { job, bound, .. } => {
                        let at = copy(bound.packed_bytes);
                        let dsts = (0..bound.pieces)
                            .map(|i| 0x1000_0000_0000 + (bound.first_desc as u64 + i) * PIECE)
                            .collect();
                        let result = Ok(ScatterList::Uniform(UniformScatter {
                            segment_len: PIECE,
                            region_stride: PIECE,
                            dsts,
                        }));
                        events.push(at, Event::Deliver(is_rx, Input::GatherDone { job, result }));
                    }
                    Action::PostWrite { write, bytes, .. } => {
                        let at = copy(bytes);
                        let input = Input::WriteDone {
                            write,
                            result: Ok(()),
                        };
                        events.push(at, Event::Deliver(is_rx, input));
                    }
                    Action::StartScatter { job, runs, .. } => {
                        let bytes = runs.total_bytes();
                        let at = copy(bytes);
                        let input = Input::ScatterDone {
                            job,
                            result: Ok(()),
                        };
                        events.push(at, Event::Deliver(is_rx, input));
                    }
                    Action::Resolve { rid, outcome, .. } => {
                        assert_eq!(outcome, Outcome::Success, "request {rid}");
                        let k = (rid - 1) as usize;
                        latency[k] = (now - arrival_ns[k]) as f64 / 1e6;
                        resolved += 1;
                    }
                    _ => {}
                }
            }
        }
    }
    assert_eq!(resolved, w.len(), "every request resolves");
    latency
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s: Vec<f64> = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
    s[i]
}

fn main() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data/traces/");
    let paths: Vec<String> = match std::env::var("KVFABRIC_TRACE") {
        Ok(p) => vec![p],
        Err(_) => [
            "mooncake_conversation_trace.jsonl",
            "mooncake_synthetic_trace.jsonl",
        ]
        .iter()
        .map(|f| format!("{dir}{f}"))
        .collect(),
    };
    let limit: usize = std::env::var("KVFABRIC_MODEL_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4_000);
    for (i, path) in paths.iter().enumerate() {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("policy_model: skipped: trace {path}: {e} (set KVFABRIC_TRACE)");
                continue;
            }
        };
        let trace = match parse_trace(&text, 0, limit) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("policy_model: skipped: trace {path}: {e}");
                continue;
            }
        };
        let w = Workload::of(&trace);
        if w.len() < 2 || w.arrival_ms.last().copied().unwrap_or(0.0) <= 0.0 {
            eprintln!("policy_model: skipped: {path}: fewer than 2 requests or no time span");
            continue;
        }
        let name = path.rsplit('/').next().unwrap_or(path);
        report(&format!("{name}, its prompts"), &w);
        if i == 0 {
            // The GPU bench's seed shape: every prompt 8,192 tokens (151
            // MB), the same arrivals.
            report(
                &format!("{name}, every prompt 8,192 tokens"),
                &w.with_prompts(8192),
            );
        }
    }
}

/// Runs `w` at four loads under each policy (shortest first at each
/// size weight) and prints a table.
fn report(what: &str, w: &Workload) {
    // Offered copy work (three passes of every chunk) per ns of trace time.
    let span_ns = w.arrival_ms.last().copied().unwrap_or(0.0) * 1e6;
    let copy_ns: f64 = w
        .tokens
        .iter()
        .map(|&t| {
            let b = bounds(pieces(t));
            b.iter()
                .map(|c| 3.0 * (COPY_FIXED_NS + c.packed_bytes / COPY_BYTES_PER_NS) as f64)
                .sum::<f64>()
        })
        .sum();
    // The smallest quarter by rank (ties by position).
    let mut order: Vec<usize> = (0..w.len()).collect();
    order.sort_by_key(|&k| w.tokens[k]);
    let small: Vec<usize> = order[..(w.len() / 4).max(1)].to_vec();
    let (lo, hi) = (w.tokens[order[0]], w.tokens[order[w.len() - 1]]);
    println!(
        "{what}: {} requests (prompts {lo}..{hi} tokens; the smallest quarter: {} requests of \
         <= {} tokens); one GPU copying at {} GB/s + {} us a copy, control {} us",
        w.len(),
        small.len(),
        w.tokens[*small.last().unwrap_or(&0)],
        COPY_BYTES_PER_NS,
        COPY_FIXED_NS / 1000,
        CONTROL_NS / 1000
    );
    println!(
        "{:>6} {:>12} {:>10} {:>10} {:>12} {:>12}",
        "load", "policy", "p50 ms", "p99 ms", "small p50", "small p99"
    );
    // Shortest first at the default weight, plus any in
    // KVFABRIC_MODEL_SIZE_WEIGHTS (comma-separated).
    let mut weights = vec![DEFAULT_SIZE_WEIGHT];
    if let Ok(list) = std::env::var("KVFABRIC_MODEL_SIZE_WEIGHTS") {
        for v in list.split(',') {
            match v.trim().parse::<u64>() {
                Ok(k) if k >= 1 && !weights.contains(&k) => weights.push(k),
                Ok(_) => {}
                Err(_) => eprintln!(
                    "policy_model: KVFABRIC_MODEL_SIZE_WEIGHTS: {v:?} is not a whole number; ignored"
                ),
            }
        }
    }
    let mut runs = vec![
        (GrantPolicy::RoundRobin, 1, "RoundRobin".to_string()),
        (GrantPolicy::OldestFirst, 1, "OldestFirst".to_string()),
    ];
    runs.extend(
        weights
            .iter()
            .map(|&k| (GrantPolicy::ShortestFirst, k, format!("Shortest/{k}"))),
    );
    for load in [0.5, 0.7, 0.85, 0.95] {
        // Speed-up so that the copy work offered is `load` of capacity.
        let speed = load * span_ns / copy_ns;
        for (policy, k, label) in &runs {
            let lat = run(w, speed, *policy, *k);
            let small_lat: Vec<f64> = small.iter().map(|&k| lat[k]).collect();
            println!(
                "{:>6.2} {:>12} {:>10.2} {:>10.2} {:>12.2} {:>12.2}",
                load,
                label,
                percentile(&lat, 50.0),
                percentile(&lat, 99.0),
                percentile(&small_lat, 50.0),
                percentile(&small_lat, 99.0)
            );
        }
    }
}
