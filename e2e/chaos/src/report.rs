//! The report: per round and in total, JSON and a human table.

use std::collections::BTreeMap;

use serde::Serialize;

/// Requests by outcome.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Outcomes {
    /// Resolved SUCCESS, every byte verified on the decode side.
    pub success: u64,
    /// Resolved FAILURE (failure, timeout, cancelled, engine gone, error).
    pub failure: u64,
    /// Not resolved within requestTimeout + slack.
    pub hang: u64,
    /// SUCCESS whose bytes were wrong (also counted in `failure`).
    pub corrupt_requests: u64,
    /// Wrong bytes in those.
    pub corrupt_bytes: u64,
    /// The two sides disagreed (one said SUCCESS, the other not; bytes
    /// verified all the same).
    pub sides_disagree: u64,
    /// Not submitted: no free blocks in a pool.
    pub skipped: u64,
}

impl Outcomes {
    /// Adds `o`.
    pub fn add(&mut self, o: &Outcomes) {
        self.success += o.success;
        self.failure += o.failure;
        self.hang += o.hang;
        self.corrupt_requests += o.corrupt_requests;
        self.corrupt_bytes += o.corrupt_bytes;
        self.sides_disagree += o.sides_disagree;
        self.skipped += o.skipped;
    }

    /// Submitted requests.
    pub fn submitted(&self) -> u64 {
        self.success + self.failure + self.hang
    }
}

/// One round.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RoundReport {
    /// Round number (0-based).
    pub round: usize,
    /// The fault kind.
    pub fault: String,
    /// What it hit.
    pub target: String,
    /// Requests of the round by outcome.
    pub outcomes: Outcomes,
    /// Peak concurrent hand-offs in flight.
    pub peak_in_flight: u64,
    /// Fault → a surviving pair's new transfer resolved SUCCESS, ms.
    pub probe_ms: Option<f64>,
    /// Fault → the peers forgot the dead or replaced agent, ms (external
    /// polling of /v1/peers), with the path expected.
    pub forget_ms: Option<f64>,
    /// The expected invalidation path of `forget_ms`.
    pub forget_path: Option<String>,
    /// Restart → the restarted agent carried a verified transfer, ms.
    pub rejoin_ms: Option<f64>,
    /// Leaks found at quiesce (agent: metric = value).
    pub leaks: Vec<String>,
    /// Invariant violations (fault, round and request named).
    pub violations: Vec<String>,
    /// Bounds missed that do not fail the run: a surviving pair's new
    /// transfer later than the probe bound (but within 10 s).
    pub warnings: Vec<String>,
    /// Notes (cancel hits, etcd downtime...).
    pub notes: Vec<String>,
    /// `partition-agent` rounds: what the cut did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition: Option<PartitionStats>,
    /// `control-loss` rounds: latency before and during the loss.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss: Option<LossStats>,
    /// Wall time of the round, s.
    pub wall_s: f64,
}

/// One `partition-agent` fault: the victim's control connections cut both
/// ways (nftables), then healed.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PartitionStats {
    /// The victim (agent name).
    pub victim: String,
    /// Its control port and the peers' (the rules' ports).
    pub control_ports: Vec<u16>,
    /// How long the cut lasted, ms.
    pub cut_ms: f64,
    /// Packets of the victim's control connections dropped on their way
    /// to the victim (peers' messages to its port, ACKs to its own
    /// connections) ...
    pub dropped_to_victim: u64,
    /// ... and from it (its messages to the peers' ports, ACKs from its
    /// port).
    pub dropped_from_victim: u64,
    /// ... and of the suite's own connection attempt to its control port
    /// (SYN and its retries; the attempt must time out).
    pub dropped_probe: u64,
    /// Hand-offs to or from the victim submitted during the cut: SUCCESS.
    pub victim_success: u64,
    /// ... of which resolved before the heal (the cut does not stop
    /// them: none expected).
    pub victim_success_during_cut: u64,
    /// ... FAILURE.
    pub victim_failure: u64,
    /// Submit → FAILURE of those (both sides resolved), ms.
    pub victim_failure_ms: Latency,
    /// Submit → the prefill side's FAILURE of those, ms.
    pub victim_failure_prefill_ms: Latency,
    /// Hand-offs between other agents submitted during the cut: SUCCESS.
    pub others_success: u64,
    /// ... FAILURE.
    pub others_failure: u64,
    /// Whether every other agent still listed the victim at the heal
    /// (etcd traffic not cut: it stayed in discovery).
    pub in_discovery_at_heal: bool,
    /// Heal → a verified hand-off through the victim, ms.
    pub recovery_ms: Option<f64>,
}

/// One `control-loss` fault: random loss on every agent's control traffic.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LossStats {
    /// Loss, % of packets (each direction).
    pub percent: u32,
    /// How long, ms.
    pub loss_ms: f64,
    /// Control packets seen while the loss was on, and dropped.
    pub packets: u64,
    /// See `packets`.
    pub dropped: u64,
    /// SUCCESS latency (submit → resolved) of hand-offs submitted and
    /// resolved before the loss, ms.
    pub before: Latency,
    /// ... of hand-offs submitted during the loss.
    pub during: Latency,
    /// FAILURE among hand-offs before the loss.
    pub failures_before: u64,
    /// FAILURE among hand-offs submitted during the loss.
    pub failures_during: u64,
}

/// Latency summary.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    /// Samples.
    pub count: u64,
    /// p50, ms.
    pub p50_ms: Option<f64>,
    /// p99, ms.
    pub p99_ms: Option<f64>,
    /// max, ms (external samples only).
    pub max_ms: Option<f64>,
    /// mean, ms.
    pub mean_ms: Option<f64>,
}

impl Latency {
    /// From samples in ms.
    pub fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let p = |q: f64| v[(((v.len() - 1) as f64) * q).round() as usize];
        Self {
            count: v.len() as u64,
            p50_ms: Some(p(0.5)),
            p99_ms: Some(p(0.99)),
            max_ms: v.last().copied(),
            mean_ms: Some(v.iter().sum::<f64>() / v.len() as f64),
        }
    }
}

/// A cumulative Prometheus histogram: upper bound (s) → count.
pub type Buckets = BTreeMap<String, f64>;

/// Quantile `q` (ms) of a cumulative histogram, interpolated linearly
/// inside the bucket (the +Inf bucket answers its lower bound).
pub fn histogram_quantile(b: &Buckets, q: f64) -> Option<f64> {
    let mut v: Vec<(f64, f64)> = b
        .iter()
        .map(|(le, c)| {
            (
                if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::INFINITY)
                },
                *c,
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = v.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lo, mut below) = (0.0, 0.0);
    for (le, c) in v {
        if c >= rank {
            if le.is_infinite() {
                return Some(lo * 1e3);
            }
            let in_bucket = c - below;
            let frac = if in_bucket > 0.0 {
                (rank - below) / in_bucket
            } else {
                1.0
            };
            return Some((lo + (le - lo) * frac) * 1e3);
        }
        lo = le;
        below = c;
    }
    None
}

/// Detection latency of one path.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PathLatency {
    /// From the agents' `kvfabric_peer_invalidation_seconds{path}`
    /// histograms (every agent incarnation's last scrape, summed).
    pub histogram: Latency,
    /// Fault → forgotten, polled from outside (/v1/peers of the observers).
    pub external: Latency,
}

/// The whole run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// Seed of the fault order and the load.
    pub seed: u64,
    /// Rounds run.
    pub rounds: usize,
    /// Topology notes (network namespaces or loopback, and why).
    pub topology: Vec<String>,
    /// Settings (request timeout, slack, lease TTL, geometry, load).
    pub settings: BTreeMap<String, String>,
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, u64>,
    /// Fault kinds not implemented.
    pub faults_missing: Vec<String>,
    /// Fault kinds asked for but not run here, with the reason (nftables
    /// unusable; never under `KVFABRIC_REQUIRE_SERVICES=1`, which fails).
    pub faults_skipped: BTreeMap<String, String>,
    /// All requests by outcome.
    pub outcomes: Outcomes,
    /// Detection latency per path (`operator`, `lease`).
    pub detection: BTreeMap<String, PathLatency>,
    /// Fault → surviving pair's new transfer, ms.
    pub probe: Latency,
    /// Leaks found (all rounds).
    pub leaks: u64,
    /// Every violation, naming fault, round and request.
    pub violations: Vec<String>,
    /// Every warning (see [`RoundReport::warnings`]).
    pub warnings: Vec<String>,
    /// Rounds.
    pub round_reports: Vec<RoundReport>,
    /// Wall time, s.
    pub wall_s: f64,
}

fn opt(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into())
}

impl Report {
    /// Whether every invariant held.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The human table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        s.push_str(&format!(
            "kvfabric chaos: {} rounds, seed {}, {:.0} s\n",
            self.rounds, self.seed, self.wall_s
        ));
        for t in &self.topology {
            s.push_str(&format!("topology: {t}\n"));
        }
        s.push_str(&format!(
            "{:<5} {:<22} {:<26} {:>6} {:>6} {:>4} {:>7} {:>5} {:>9} {:>9} {:>9} {:>5}\n",
            "round",
            "fault",
            "target",
            "ok",
            "fail",
            "hang",
            "corrupt",
            "peak",
            "probe ms",
            "forget ms",
            "rejoin ms",
            "leaks"
        ));
        for r in &self.round_reports {
            s.push_str(&format!(
                "{:<5} {:<22} {:<26} {:>6} {:>6} {:>4} {:>7} {:>5} {:>9} {:>9} {:>9} {:>5}\n",
                r.round,
                r.fault,
                truncate(&r.target, 26),
                r.outcomes.success,
                r.outcomes.failure,
                r.outcomes.hang,
                r.outcomes.corrupt_bytes,
                r.peak_in_flight,
                opt(r.probe_ms),
                opt(r.forget_ms),
                opt(r.rejoin_ms),
                r.leaks.len()
            ));
        }
        s.push_str("\nfaults injected:");
        for (k, n) in &self.faults {
            s.push_str(&format!(" {k}={n}"));
        }
        s.push('\n');
        if !self.faults_missing.is_empty() {
            s.push_str(&format!(
                "fault kinds not implemented: {}\n",
                self.faults_missing.join(", ")
            ));
        }
        for (k, why) in &self.faults_skipped {
            s.push_str(&format!("SKIP {k}: {why}\n"));
        }
        for r in &self.round_reports {
            if let Some(p) = &r.partition {
                s.push_str(&format!(
                    "round {} partition {} ({:.0} ms cut, ports {:?}): dropped {} packets to it, {} from it ({} of the suite's probe SYN); victim hand-offs {} ok ({} before the heal) {} fail, prefill side failed after p50 {} ms max {} ms, both sides p50 {} ms max {} ms; others {} ok {} fail; in discovery at heal {}; recovery {} ms\n",
                    r.round, p.victim, p.cut_ms, p.control_ports, p.dropped_to_victim, p.dropped_from_victim, p.dropped_probe,
                    p.victim_success, p.victim_success_during_cut, p.victim_failure, opt(p.victim_failure_prefill_ms.p50_ms), opt(p.victim_failure_prefill_ms.max_ms),
                    opt(p.victim_failure_ms.p50_ms), opt(p.victim_failure_ms.max_ms),
                    p.others_success, p.others_failure, p.in_discovery_at_heal, opt(p.recovery_ms)
                ));
            }
            if let Some(l) = &r.loss {
                s.push_str(&format!(
                    "round {} control loss {}% for {:.0} ms: {} of {} control packets dropped; latency before n={} p50 {} p99 {} ms, during n={} p50 {} p99 {} ms; failures before {} during {}\n",
                    r.round, l.percent, l.loss_ms, l.dropped, l.packets,
                    l.before.count, opt(l.before.p50_ms), opt(l.before.p99_ms),
                    l.during.count, opt(l.during.p50_ms), opt(l.during.p99_ms),
                    l.failures_before, l.failures_during
                ));
            }
        }
        let o = &self.outcomes;
        s.push_str(&format!(
            "requests: {} submitted, {} success (verified), {} failure, {} hang, {} corrupt bytes in {} requests, {} sides disagreed, {} skipped (no blocks)\n",
            o.submitted(), o.success, o.failure, o.hang, o.corrupt_bytes, o.corrupt_requests, o.sides_disagree, o.skipped
        ));
        for (path, l) in &self.detection {
            s.push_str(&format!(
                "detection {path:<8}: histogram n={} p50 {} ms p99 {} ms mean {} ms | external n={} p50 {} ms p99 {} ms max {} ms\n",
                l.histogram.count,
                opt(l.histogram.p50_ms),
                opt(l.histogram.p99_ms),
                opt(l.histogram.mean_ms),
                l.external.count,
                opt(l.external.p50_ms),
                opt(l.external.p99_ms),
                opt(l.external.max_ms)
            ));
        }
        s.push_str(&format!(
            "probe (fault → surviving pair's new transfer): n={} p50 {} ms p99 {} ms max {} ms\n",
            self.probe.count,
            opt(self.probe.p50_ms),
            opt(self.probe.p99_ms),
            opt(self.probe.max_ms)
        ));
        s.push_str(&format!("leaks: {}\n", self.leaks));
        if !self.warnings.is_empty() {
            s.push_str(&format!(
                "warnings ({}; the run still passes):\n",
                self.warnings.len()
            ));
            for w in self.warnings.iter().take(20) {
                s.push_str(&format!("  {w}\n"));
            }
        }
        if self.violations.is_empty() {
            s.push_str("invariants: all held\n");
        } else {
            s.push_str(&format!("VIOLATIONS ({}):\n", self.violations.len()));
            for v in self.violations.iter().take(50) {
                s.push_str(&format!("  {v}\n"));
            }
        }
        s
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).collect::<String>() + "…"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_of_a_histogram() {
        let mut b = Buckets::new();
        b.insert("0.01".into(), 50.0);
        b.insert("0.1".into(), 100.0);
        b.insert("+Inf".into(), 100.0);
        let p50 = histogram_quantile(&b, 0.5).unwrap();
        assert!((p50 - 10.0).abs() < 1e-6, "{p50}");
        let p99 = histogram_quantile(&b, 0.99).unwrap();
        assert!(p99 > 90.0 && p99 <= 100.0, "{p99}");
        assert_eq!(histogram_quantile(&Buckets::new(), 0.5), None);
        let l = Latency::of(vec![3.0, 1.0, 2.0]);
        assert_eq!(l.p50_ms, Some(2.0));
        assert_eq!(l.max_ms, Some(3.0));
    }
}
