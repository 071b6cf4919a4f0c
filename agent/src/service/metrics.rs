//! Agent metrics (issue "agent daemon", item 3): OpenTelemetry instruments
//! exported in the Prometheus text format through `opentelemetry-prometheus`
//! and a private `prometheus::Registry` (no global state, so several agents
//! in one process, e.g. tests, each get their own registry).
//!
//! Most instruments are *observable*: their callbacks read the atomics of
//! [`FabricStats`](crate::runtime::fabric::FabricStats) and
//! [`TransportStats`] at scrape
//! time, so the hot path pays nothing. The agents and discoveries are held
//! weakly: dropping an agent simply removes its series.
//!
//! Exported names (Prometheus spelling; every series carries `agent=<NIXL
//! agent name>`):
//!
//! | name | type | labels | source |
//! |---|---|---|---|
//! | `kvfabric_submissions_total` | counter | `path` = bounce/standard | routed submissions |
//! | `kvfabric_transfer_bytes_total` | counter | `path` | payload bytes submitted |
//! | `kvfabric_bounce_activations_total` | counter | | requests the bounce transport accepted |
//! | `kvfabric_bounce_outcomes_total` | counter | `outcome` = success/failure | bounce requests resolved |
//! | `kvfabric_bounce_sent_bytes_total` | counter | | payload bytes of successful bounce requests |
//! | `kvfabric_bounce_timeouts_total` | counter | | bounce requests failed by the no-progress timeout |
//! | `kvfabric_standard_failures_total` | counter | | standard-path transfers that failed |
//! | `kvfabric_transfer_latency_seconds` | histogram | `path`, `outcome` | submit → resolution, seconds (buckets [`LATENCY_BUCKETS_SECONDS`]; recorded by [`AgentMetrics::submit_timed`] / [`AgentMetrics::observe_transfer`]) |
//! | `kvfabric_peer_invalidation_seconds` | histogram | `path` = operator/lease | a peer's end known (operator: the pod event the operator saw, from its tombstone; lease: the later of deletion − lease TTL and the last control message heard from the peer — an upper bound) until forgotten by this agent, seconds ([`AgentMetrics::observe_invalidation`]) |
//! | `kvfabric_requests_in_flight` | gauge | `path` = bounce/standard | requests submitted and not yet resolved |
//! | `kvfabric_credit_grants_total` | counter | | credits granted by the receiver role |
//! | `kvfabric_credit_wait_seconds_total` | counter | | summed submit → first GRANT wait of bounce requests, seconds (µs resolution) |
//! | `kvfabric_chunks_written_total` | counter | | chunk writes completed |
//! | `kvfabric_chunks_scattered_total` | counter | | chunks scattered and ACKed |
//! | `kvfabric_data_rejected_total` | counter | | DATA messages dropped |
//! | `kvfabric_wants_rejected_total` | counter | | WANT messages rejected (unusable endpoint, chunk sizes the arena cannot serve, destination engine not attached) |
//! | `kvfabric_wants_stale_total` | counter | | WANT messages dropped as replays (their flow is live or ended within 2 × the request timeout) |
//! | `kvfabric_rejects_received_total` | counter | | REJECTs received: own bounce requests a receiver refused (destination engine not attached or detached, WANT refused, DATA runs outside the destination's memory) |
//! | `kvfabric_control_dropped_total` | counter | | control messages dropped on a full queue |
//! | `kvfabric_data_uniform_total` | counter | | DATA_UNIFORM messages sent: uniform chunks described by their pieces' destinations (issue 18 step 3) |
//! | `kvfabric_data_blocks_total` | counter | | DATA_BLOCKS messages sent: uniform chunks of a block hand-off described by their blocks (issue 18 step 3) |
//! | `kvfabric_control_hellos_refused_total` | counter | | control connections closed because their hello did not pass the control key (`controlAuth`) |
//! | `kvfabric_control_hellos_unsigned_total` | counter | | unsigned control hellos accepted in `controlAuth: optional` (0 growth: safe to require) |
//! | `kvfabric_reverse_routes_replaced_total` | counter | | reverse routes (from WANTs of peers not loaded) replaced at their cap by a WANT from a new name (the least recently used without a live flow, unused for 1 s) |
//! | `kvfabric_data_wire_bytes_total` | counter | | encoded bytes of the DATA, DATA_UNIFORM and DATA_BLOCKS messages sent |
//! | `kvfabric_fallbacks_total` | counter | `reason` | bounce → standard fallbacks (`bounce_init_failed`, and from [`AgentMetrics::submit_timed`]: `peer_incompatible`, `routing_gate`) |
//! | `kvfabric_peers_loaded_total` | counter | | peers loaded |
//! | `kvfabric_peers_forgotten_total` | counter | | peers forgotten |
//! | `kvfabric_peers` | gauge | `bounce` = compatible/incompatible | peers loaded now |
//! | `kvfabric_arena_in_use_bytes` | gauge | | arena bytes held (staging + granted + orphaned) |
//! | `kvfabric_arena_capacity_bytes` | gauge | | usable arena capacity (0 without bounce) |
//! | `kvfabric_drain_mode` | gauge | | 1 while the credit scheduler is in drain mode |
//! | `kvfabric_flows` | gauge | `side` = receiver/sender | live bounce flows: the credit scheduler's (WANT → last ACK) on the receiver side, the IO thread's request table on the sender side; both 0 at quiesce |
//! | `kvfabric_lease_state` | gauge | | [`LeaseState::code`](crate::service::discovery::LeaseState::code): 0 unpublished, 1 ok, 2 renewing, 3 regranting, 4 lost, 5 revoked |
//! | `kvfabric_discovery_resyncs_total` | counter | | full re-reads of the discovery store after the first (a lost and re-established etcd watch each) |
//! | `kvfabric_shutting_down` | gauge | | 1 once graceful shutdown began |
//! | `kvfabric_engines` | gauge | | serving engines attached through the engine API |
//! | `kvfabric_engine_pool_bytes` | gauge | | engine KV pool bytes mapped by the agent (0 once every detached pool is released) |
//! | `kvfabric_engine_transfers_total` | counter | `outcome` = success/failure | engine hand-offs resolved |
//! | `kvfabric_engine_arrivals_total` | counter | | arrival notices delivered to engines attached here |
//! | `kvfabric_engine_timeouts_total` | counter | `path` | engine-API hand-offs to another agent not resolved within their timeout |
//! | `kvfabric_peer_transfer_bytes_total` | counter | `peer`, `path` | payload bytes of successful engine-API hand-offs, by destination agent (series of forgotten peers are dropped) |
//! | `kvfabric_engine_transfer_bytes_total` | counter | `engine`, `path` | payload bytes of successful hand-offs to other agents, by source engine attached here (series of detached engines are dropped) |
//! | `kvfabric_chunks_in_flight` | gauge | | chunks of this agent's bounce requests staged and not yet ACKed |
//! | `kvfabric_drain_mode_entries_total` | counter | | times the credit scheduler entered drain mode |
//! | `kvfabric_config_generation` | gauge | | the bounce config generation in this agent's handshake (0 until the operator rolls generations out; 0 without bounce) |
//! | `kvfabric_transport_reports` | gauge | `verdict` = native/degraded | peers whose transport probe (first chunk writes) finished, by verdict (degraded: GPU to GPU writes below 5 GB/s, likely UCX TCP or software emulation) |
//! | `kvfabric_transport_degraded` | gauge | `peer` | 1 when the transport probe to a loaded peer judged it degraded, else 0 |
//! | `kvfabric_transport_probe_bytes_per_second` | gauge | `peer` | fastest chunk write of the probe to a loaded peer, bytes/s |
//!
//! The engine-API series (`kvfabric_engine_timeouts_total`,
//! `kvfabric_*_transfer_bytes_total`, and the engine path's share of
//! `kvfabric_transfer_latency_seconds` and `kvfabric_fallbacks_total`) are
//! recorded by [`AgentMetrics::observe_engine_transfer`].
//!
//! Units follow the Prometheus conventions (base units in the name:
//! `_seconds`, `_bytes`; counters end in `_total`); `promtool check
//! metrics` accepts the output (tested against a live `/metrics` in
//! `agent/tests/agent_http.rs`). The gauges of the IO thread
//! (`kvfabric_flows`, `kvfabric_arena_in_use_bytes`,
//! `kvfabric_drain_mode`) are stored by it once per tick (at most a few
//! ms old while it idles).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvfabric_core::Descriptor;
use opentelemetry::metrics::{AsyncInstrument, Histogram, Meter, MeterProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_sdk::metrics::SdkMeterProvider;

use super::discovery::Discovery;
use crate::runtime::fabric::{FabricAgent, FabricStats, PathKind};
use crate::runtime::transport::{TransferHandle, TransferOutcome, TransportReport, TransportStats};

/// Bucket boundaries (upper bounds) of `kvfabric_transfer_latency_seconds`,
/// seconds: 100 µs to 30 s.
pub const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];

/// Bucket boundaries of `kvfabric_peer_invalidation_seconds`, seconds:
/// 1 ms to 60 s (the operator path is ms; the lease path is bounded by the
/// lease TTL).
pub const INVALIDATION_BUCKETS_SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0,
];

/// The `path` label value of a [`PathKind`].
pub fn path_label(path: PathKind) -> &'static str {
    match path {
        PathKind::Bounce => "bounce",
        PathKind::Standard => "standard",
    }
}

/// What the observable instruments read, held weakly.
#[derive(Default)]
struct Sources {
    agents: Vec<Weak<FabricAgent>>,
    discoveries: Vec<(String, Weak<dyn Discovery>)>,
    /// Engine hubs (issue 12) with their agent names.
    engines: Vec<(String, Weak<super::engines::EngineHub>)>,
    /// Fallbacks recorded by [`AgentMetrics::submit_timed`]: (agent, reason) → count.
    fallbacks: BTreeMap<(String, &'static str), u64>,
    /// Engine-API timeouts: (agent, path) → count.
    engine_timeouts: BTreeMap<(String, &'static str), u64>,
    /// Engine-API bytes by destination agent: (agent, peer, path) → bytes.
    peer_bytes: BTreeMap<(String, String, &'static str), u64>,
    /// Engine-API bytes by source engine: (agent, engine, path) → bytes.
    engine_bytes: BTreeMap<(String, String, &'static str), u64>,
}

/// One engine-API hand-off to another agent, resolved (or timed out), for
/// [`AgentMetrics::observe_engine_transfer`].
pub struct EngineTransfer<'a> {
    /// This agent's name.
    pub agent: &'a str,
    /// The source engine (attached here).
    pub engine: &'a str,
    /// The destination agent.
    pub peer: &'a str,
    /// The path it took.
    pub path: PathKind,
    /// `Some(reason)` when an AUTO request went to the standard path
    /// while bounce runs here.
    pub fallback: Option<&'static str>,
    /// Resolved SUCCESS.
    pub ok: bool,
    /// Not resolved within the request's timeout.
    pub timed_out: bool,
    /// Payload bytes.
    pub bytes: u64,
    /// Call received → resolved (or given up).
    pub elapsed: Duration,
}

type SharedSources = Arc<Mutex<Sources>>;

fn lock(s: &SharedSources) -> std::sync::MutexGuard<'_, Sources> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// Live agents (upgraded), dead ones pruned.
fn live_agents(s: &SharedSources) -> Vec<Arc<FabricAgent>> {
    let mut g = lock(s);
    g.agents.retain(|w| w.strong_count() > 0);
    g.agents.iter().filter_map(Weak::upgrade).collect()
}

/// Live engine hubs (upgraded) with their agent names, dead ones pruned.
fn live_hubs(s: &SharedSources) -> Vec<(String, Arc<super::engines::EngineHub>)> {
    let mut g = lock(s);
    g.engines.retain(|(_, w)| w.strong_count() > 0);
    g.engines
        .iter()
        .filter_map(|(n, w)| w.upgrade().map(|h| (n.clone(), h)))
        .collect()
}

/// Live discoveries (upgraded) with their agent names, dead ones pruned.
fn live_discoveries(s: &SharedSources) -> Vec<(String, Arc<dyn Discovery>)> {
    let mut g = lock(s);
    g.discoveries.retain(|(_, w)| w.strong_count() > 0);
    g.discoveries
        .iter()
        .filter_map(|(n, w)| Some((n.clone(), w.upgrade()?)))
        .collect()
}

/// Bounce requests of `t` submitted and not yet resolved. The resolution
/// counters are read first: each request is counted in `submitted` before
/// it can be counted resolved, so the difference never goes below the
/// truth at the time of the later read (saturating all the same).
fn bounce_in_flight(t: &TransportStats) -> u64 {
    let resolved = ld(&t.succeeded) + ld(&t.failed);
    ld(&t.submitted).saturating_sub(resolved)
}

fn agent_kv(a: &FabricAgent) -> KeyValue {
    KeyValue::new("agent", a.name().to_string())
}

/// The agent metrics: a meter provider whose only reader is a Prometheus
/// exporter over a private registry. Cheap to share (`Arc`); `Send + Sync`.
pub struct AgentMetrics {
    registry: prometheus::Registry,
    /// Keeps the pipeline (and the exporter's reader) alive.
    _provider: SdkMeterProvider,
    latency: Histogram<f64>,
    invalidation: Histogram<f64>,
    sources: SharedSources,
    shutting_down: Arc<AtomicBool>,
}

impl std::fmt::Debug for AgentMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentMetrics").finish_non_exhaustive()
    }
}

/// Registers a u64 observable counter whose callback observes
/// `read(agent)` for each live agent.
fn agent_counter(
    meter: &Meter,
    sources: &SharedSources,
    name: &'static str,
    unit: Option<&'static str>,
    description: &'static str,
    read: impl Fn(&FabricAgent, &dyn AsyncInstrument<u64>, &KeyValue) + Send + Sync + 'static,
) {
    let s = sources.clone();
    let mut b = meter
        .u64_observable_counter(name)
        .with_description(description);
    if let Some(u) = unit {
        b = b.with_unit(u);
    }
    b.with_callback(move |obs| {
        for a in live_agents(&s) {
            read(&a, obs, &agent_kv(&a));
        }
    })
    .build();
}

/// Like [`agent_counter`] for a gauge.
fn agent_gauge(
    meter: &Meter,
    sources: &SharedSources,
    name: &'static str,
    unit: Option<&'static str>,
    description: &'static str,
    read: impl Fn(&FabricAgent, &dyn AsyncInstrument<u64>, &KeyValue) + Send + Sync + 'static,
) {
    let s = sources.clone();
    let mut b = meter
        .u64_observable_gauge(name)
        .with_description(description);
    if let Some(u) = unit {
        b = b.with_unit(u);
    }
    b.with_callback(move |obs| {
        for a in live_agents(&s) {
            read(&a, obs, &agent_kv(&a));
        }
    })
    .build();
}

/// The transport reports of `a`'s loaded peers (none without bounce).
fn transport_reports(a: &FabricAgent) -> Vec<(String, TransportReport)> {
    let Some(t) = a.transport() else {
        return Vec::new();
    };
    let loaded: std::collections::BTreeSet<String> =
        a.peers().into_iter().map(|(p, _)| p).collect();
    let reports = t
        .stats()
        .transport_reports
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    reports
        .iter()
        .filter(|(p, _)| loaded.contains(*p))
        .map(|(p, r)| (p.clone(), r.clone()))
        .collect()
}

/// A transport counter (0 when the agent runs without bounce).
fn tcount(a: &FabricAgent, f: impl Fn(&TransportStats) -> u64) -> u64 {
    a.transport().map(|t| f(t.stats())).unwrap_or(0)
}

fn ld(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// A [`TransportStats`] counter field.
type TransportField = fn(&TransportStats) -> &AtomicU64;
/// A [`FabricStats`] counter field.
type AgentField = fn(&FabricStats) -> &AtomicU64;

/// Single-series transport counters (0 for an agent without bounce):
/// (OpenTelemetry name, unit, description, field).
const TRANSPORT_COUNTERS: &[(&str, Option<&str>, &str, TransportField)] = &[
    (
        "kvfabric.bounce.activations",
        None,
        "Requests accepted by the bounce transport (gather -> write -> scatter)",
        |t| &t.submitted,
    ),
    (
        "kvfabric.bounce.sent",
        Some("By"),
        "Payload bytes of successful bounce requests",
        |t| &t.bytes_sent,
    ),
    (
        "kvfabric.bounce.timeouts",
        None,
        "Bounce requests failed by the no-progress timeout",
        |t| &t.timeouts,
    ),
    (
        "kvfabric.credit.grants",
        None,
        "Credits (arena regions) granted by this agent's receiver role",
        |t| &t.grants,
    ),
    (
        "kvfabric.chunks.written",
        None,
        "Bounce chunk writes that completed",
        |t| &t.chunks_written,
    ),
    (
        "kvfabric.chunks.scattered",
        None,
        "Chunks scattered and ACKed by the receiver role",
        |t| &t.chunks_scattered,
    ),
    (
        "kvfabric.data.rejected",
        None,
        "DATA messages dropped (late after cancel, or invalid scatter runs)",
        |t| &t.data_rejected,
    ),
    (
        "kvfabric.wants.rejected",
        None,
        "WANT messages rejected (unusable endpoint, chunk sizes the arena cannot serve, destination engine not attached)",
        |t| &t.wants_rejected,
    ),
    (
        "kvfabric.wants.stale",
        None,
        "WANT messages dropped as replays (their flow is live or ended within twice the request timeout)",
        |t| &t.wants_stale,
    ),
    (
        "kvfabric.rejects.received",
        None,
        "REJECTs received: own bounce requests a receiver refused (destination engine not attached or detached, WANT refused, DATA outside the destination's memory)",
        |t| &t.rejects_received,
    ),
    (
        "kvfabric.control.dropped",
        None,
        "Control messages dropped on a full queue",
        |t| &t.control_dropped,
    ),
    (
        "kvfabric.data.uniform",
        None,
        "DATA_UNIFORM messages sent (both agents advertise uniformData)",
        |t| &t.data_uniform,
    ),
    (
        "kvfabric.data.blocks",
        None,
        "DATA_BLOCKS messages sent (both agents advertise blockData)",
        |t| &t.data_blocks,
    ),
    (
        "kvfabric.control.hellos_refused",
        None,
        "Control connections closed because their hello did not pass the control key (controlAuth): unsigned where required, another key, made for another agent, replayed, or a clock off by more than 60 s",
        |t| &t.control_hellos_refused,
    ),
    (
        "kvfabric.control.hellos_unsigned",
        None,
        "Unsigned control hellos accepted in controlAuth optional: while it grows some agent does not sign yet, and required would refuse it",
        |t| &t.control_hellos_unsigned,
    ),
    (
        "kvfabric.reverse_routes.replaced",
        None,
        "Reverse routes (from WANTs of peers not loaded) replaced at their cap of 1,024 by a WANT from a new name: the least recently used without a live flow and unused for a second",
        |t| &t.reverse_routes_replaced,
    ),
    (
        "kvfabric.data.wire",
        Some("By"),
        "Encoded bytes of the DATA, DATA_UNIFORM and DATA_BLOCKS messages sent (the control-plane cost of describing scatters)",
        |t| &t.data_wire_bytes,
    ),
    (
        "kvfabric.drain_mode.entries",
        None,
        "Times the credit scheduler entered drain mode",
        |t| &t.drain_entries,
    ),
];

/// Single-series agent counters: (OpenTelemetry name, description, field).
const AGENT_COUNTERS: &[(&str, &str, AgentField)] = &[
    (
        "kvfabric.standard.failures",
        "Standard-path transfers that failed",
        |s| &s.standard_failed,
    ),
    (
        "kvfabric.peers.loaded",
        "Peers loaded (NIXL metadata + handshake)",
        |s| &s.peers_loaded,
    ),
    (
        "kvfabric.peers.forgotten",
        "Peers forgotten (removed, expired or superseded)",
        |s| &s.peers_forgotten,
    ),
];

impl AgentMetrics {
    /// Records one peer invalidation as seen by agent `agent`:
    /// `kvfabric_peer_invalidation_seconds{agent, path}` (issue 14; fed by
    /// [`crate::service::discovery::PeerSync::spawn_observed`]).
    pub fn observe_invalidation(&self, agent: &str, path: &'static str, latency: Duration) {
        self.invalidation.record(
            latency.as_secs_f64(),
            &[
                KeyValue::new("agent", agent.to_string()),
                KeyValue::new("path", path),
            ],
        );
    }

    /// Builds the provider, the exporter and every instrument.
    ///
    /// # Errors
    /// A text error when the Prometheus exporter cannot be built or
    /// registered (never expected with a fresh registry).
    pub fn new() -> Result<Self, String> {
        let registry = prometheus::Registry::new();
        let exporter = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .without_target_info()
            .scope_info_enabled(false)
            .build()
            .map_err(|e| format!("prometheus exporter: {e}"))?;
        let provider = SdkMeterProvider::builder().with_reader(exporter).build();
        let meter = provider.meter("kvfabric");
        let sources: SharedSources = Arc::default();
        let shutting_down = Arc::new(AtomicBool::new(false));

        agent_counter(
            &meter,
            &sources,
            "kvfabric.submissions",
            None,
            "Transfers submitted, by the path the routing gate picked",
            |a, o, kv| {
                let s = a.stats();
                o.observe(
                    ld(&s.submit_bounce),
                    &[kv.clone(), KeyValue::new("path", "bounce")],
                );
                o.observe(
                    ld(&s.submit_standard),
                    &[kv.clone(), KeyValue::new("path", "standard")],
                );
            },
        );
        agent_counter(
            &meter,
            &sources,
            "kvfabric.transfer",
            Some("By"),
            "Payload bytes submitted, by path",
            |a, o, kv| {
                let s = a.stats();
                o.observe(
                    ld(&s.bytes_bounce),
                    &[kv.clone(), KeyValue::new("path", "bounce")],
                );
                o.observe(
                    ld(&s.bytes_standard),
                    &[kv.clone(), KeyValue::new("path", "standard")],
                );
            },
        );
        agent_counter(
            &meter,
            &sources,
            "kvfabric.bounce.outcomes",
            None,
            "Bounce requests resolved, by outcome",
            |a, o, kv| {
                o.observe(
                    tcount(a, |t| ld(&t.succeeded)),
                    &[kv.clone(), KeyValue::new("outcome", "success")],
                );
                o.observe(
                    tcount(a, |t| ld(&t.failed)),
                    &[kv.clone(), KeyValue::new("outcome", "failure")],
                );
            },
        );
        for &(name, unit, description, field) in TRANSPORT_COUNTERS {
            agent_counter(
                &meter,
                &sources,
                name,
                unit,
                description,
                move |a, o, kv| o.observe(tcount(a, |t| ld(field(t))), std::slice::from_ref(kv)),
            );
        }
        for &(name, description, field) in AGENT_COUNTERS {
            agent_counter(
                &meter,
                &sources,
                name,
                None,
                description,
                move |a, o, kv| o.observe(ld(field(a.stats())), std::slice::from_ref(kv)),
            );
        }
        {
            let s = sources.clone();
            meter
                .u64_observable_counter("kvfabric.fallbacks")
                .with_description("Transfers or agents that fell back from bounce to the standard path, by reason")
                .with_callback(move |o| {
                    let agents = live_agents(&s);
                    let mut g = lock(&s);
                    for a in &agents {
                        o.observe(
                            ld(&a.stats().fallbacks),
                            &[agent_kv(a), KeyValue::new("reason", "bounce_init_failed")],
                        );
                        // Every reason exported from the start (0), so the
                        // first fallback shows up in rate()/increase().
                        for reason in ["peer_incompatible", "routing_gate"] {
                            g.fallbacks
                                .entry((a.name().to_string(), reason))
                                .or_insert(0);
                        }
                    }
                    for ((agent, reason), n) in &g.fallbacks {
                        o.observe(
                            *n,
                            &[
                                KeyValue::new("agent", agent.clone()),
                                KeyValue::new("reason", *reason),
                            ],
                        );
                    }
                })
                .build();
        }
        agent_gauge(
            &meter,
            &sources,
            "kvfabric.peers",
            None,
            "Peers loaded now, by handshake compatibility",
            |a, o, kv| {
                let peers = a.peers();
                let ok = peers.iter().filter(|(_, p)| p.bounce.is_ok()).count() as u64;
                o.observe(ok, &[kv.clone(), KeyValue::new("bounce", "compatible")]);
                o.observe(
                    peers.len() as u64 - ok,
                    &[kv.clone(), KeyValue::new("bounce", "incompatible")],
                );
            },
        );
        agent_gauge(
            &meter,
            &sources,
            "kvfabric.arena.in_use",
            Some("By"),
            "Arena bytes in use (local staging + granted + orphaned regions)",
            |a, o, kv| {
                o.observe(
                    tcount(a, |t| ld(&t.arena_bytes_in_use)),
                    std::slice::from_ref(kv),
                )
            },
        );
        agent_gauge(
            &meter,
            &sources,
            "kvfabric.arena.capacity",
            Some("By"),
            "Usable arena capacity (0 when bounce is off)",
            |a, o, kv| {
                let cap = a
                    .handshake()
                    .map(|h| h.arena_usable_capacity_bytes)
                    .unwrap_or(0);
                o.observe(cap, std::slice::from_ref(kv))
            },
        );
        agent_gauge(
            &meter,
            &sources,
            "kvfabric.drain_mode",
            None,
            "1 while the credit scheduler is in drain mode",
            |a, o, kv| o.observe(tcount(a, |t| ld(&t.drain_mode)), std::slice::from_ref(kv)),
        );
        agent_gauge(
            &meter,
            &sources,
            "kvfabric.flows",
            None,
            "Live bounce flows: receiver side = the credit scheduler's flows (WANT to last ACK), sender side = requests in the IO thread's table",
            |a, o, kv| {
                o.observe(
                    tcount(a, |t| ld(&t.recv_flows)),
                    &[kv.clone(), KeyValue::new("side", "receiver")],
                );
                o.observe(
                    tcount(a, |t| ld(&t.send_flows)),
                    &[kv.clone(), KeyValue::new("side", "sender")],
                );
            },
        );
        agent_gauge(
            &meter,
            &sources,
            "kvfabric.requests_in_flight",
            None,
            "Transfer requests submitted and not yet resolved, by path",
            |a, o, kv| {
                o.observe(
                    tcount(a, bounce_in_flight),
                    &[kv.clone(), KeyValue::new("path", "bounce")],
                );
                o.observe(
                    ld(&a.stats().standard_in_flight),
                    &[kv.clone(), KeyValue::new("path", "standard")],
                );
            },
        );
        {
            let s = sources.clone();
            meter
                .f64_observable_counter("kvfabric.credit.wait")
                .with_unit("s")
                .with_description(
                    "Summed credit wait (submit -> first GRANT) of bounce requests, seconds (microsecond resolution)",
                )
                .with_callback(move |o| {
                    for a in live_agents(&s) {
                        let us = tcount(&a, |t| ld(&t.credit_wait_us));
                        o.observe(us as f64 / 1e6, &[agent_kv(&a)]);
                    }
                })
                .build();
        }
        {
            let s = sources.clone();
            meter
                .u64_observable_gauge("kvfabric.lease_state")
                .with_description(
                    "Discovery lease state: 0 unpublished, 1 ok, 2 renewing, 3 regranting, 4 lost, 5 revoked",
                )
                .with_callback(move |o| {
                    for (name, d) in live_discoveries(&s) {
                        o.observe(
                            u64::from(d.lease_state().code()),
                            &[KeyValue::new("agent", name)],
                        );
                    }
                })
                .build();
        }
        {
            let s = sources.clone();
            meter
                .u64_observable_gauge("kvfabric.engines")
                .with_description("Serving engines attached through the engine API now")
                .with_callback(move |o| {
                    for (name, h) in live_hubs(&s) {
                        o.observe(h.stats().sessions, &[KeyValue::new("agent", name)]);
                    }
                })
                .build();
        }
        {
            let s = sources.clone();
            meter
                .u64_observable_gauge("kvfabric.engine.pool")
                .with_unit("By")
                .with_description(
                    "Bytes of engine KV pools mapped (and registered) by the agent now",
                )
                .with_callback(move |o| {
                    for (name, h) in live_hubs(&s) {
                        o.observe(h.stats().pool_bytes, &[KeyValue::new("agent", name)]);
                    }
                })
                .build();
        }
        {
            let s = sources.clone();
            meter
                .u64_observable_counter("kvfabric.engine.transfers")
                .with_description("Engine hand-offs resolved, by outcome")
                .with_callback(move |o| {
                    for (name, h) in live_hubs(&s) {
                        let st = h.stats();
                        for (outcome, v) in [("success", st.succeeded), ("failure", st.failed)] {
                            o.observe(
                                v,
                                &[
                                    KeyValue::new("agent", name.clone()),
                                    KeyValue::new("outcome", outcome),
                                ],
                            );
                        }
                    }
                })
                .build();
        }
        {
            let s = sources.clone();
            meter
                .u64_observable_counter("kvfabric.engine.arrivals")
                .with_description("Arrival notices delivered to engines attached here")
                .with_callback(move |o| {
                    for (name, h) in live_hubs(&s) {
                        o.observe(h.stats().arrivals, &[KeyValue::new("agent", name)]);
                    }
                })
                .build();
        }
        {
            let s = sources.clone();
            meter
                .u64_observable_counter("kvfabric.discovery.resyncs")
                .with_description(
                    "Full re-reads of the discovery store after the first (each a lost and re-established watch)",
                )
                .with_callback(move |o| {
                    for (name, d) in live_discoveries(&s) {
                        o.observe(d.resyncs(), &[KeyValue::new("agent", name)]);
                    }
                })
                .build();
        }
        {
            let s = sources.clone();
            let flag = shutting_down.clone();
            meter
                .u64_observable_gauge("kvfabric.shutting_down")
                .with_description("1 once graceful shutdown began (readyz answers 503)")
                .with_callback(move |o| {
                    let v = u64::from(flag.load(Ordering::SeqCst));
                    for a in live_agents(&s) {
                        o.observe(v, &[agent_kv(&a)]);
                    }
                })
                .build();
        }
        agent_gauge(
            &meter,
            &sources,
            "kvfabric.chunks_in_flight",
            None,
            "Chunks of this agent's bounce requests staged and not yet ACKed",
            |a, o, kv| {
                o.observe(
                    tcount(a, |t| ld(&t.chunks_in_flight)),
                    std::slice::from_ref(kv),
                )
            },
        );
        agent_gauge(
            &meter,
            &sources,
            "kvfabric.config_generation",
            None,
            "Bounce config generation in this agent's handshake (0 without bounce)",
            |a, o, kv| {
                let g = a.handshake().map_or(0, |h| h.config_generation);
                o.observe(g, std::slice::from_ref(kv))
            },
        );
        agent_gauge(
            &meter,
            &sources,
            "kvfabric.transport.reports",
            None,
            "Loaded peers whose transport probe finished, by verdict (degraded: GPU to GPU chunk writes below 5 GB/s, likely UCX TCP or software emulation)",
            |a, o, kv| {
                let (mut native, mut degraded) = (0, 0);
                for (_, r) in transport_reports(a) {
                    if r.suspect_fallback {
                        degraded += 1;
                    } else {
                        native += 1;
                    }
                }
                o.observe(native, &[kv.clone(), KeyValue::new("verdict", "native")]);
                o.observe(
                    degraded,
                    &[kv.clone(), KeyValue::new("verdict", "degraded")],
                );
            },
        );
        agent_gauge(
            &meter,
            &sources,
            "kvfabric.transport.degraded",
            None,
            "1 when the transport probe to a loaded peer judged it degraded (likely UCX TCP or software emulation), else 0",
            |a, o, kv| {
                for (peer, r) in transport_reports(a) {
                    o.observe(
                        u64::from(r.suspect_fallback),
                        &[kv.clone(), KeyValue::new("peer", peer)],
                    );
                }
            },
        );
        agent_gauge(
            &meter,
            &sources,
            "kvfabric.transport.probe",
            Some("By/s"),
            "Fastest chunk write of the transport probe to a loaded peer, bytes per second",
            |a, o, kv| {
                for (peer, r) in transport_reports(a) {
                    o.observe(
                        r.best_chunk_mbps.saturating_mul(1_000_000),
                        &[kv.clone(), KeyValue::new("peer", peer)],
                    );
                }
            },
        );
        {
            let s = sources.clone();
            meter
                .u64_observable_counter("kvfabric.engine.timeouts")
                .with_description(
                    "Engine-API hand-offs to another agent not resolved within their timeout, by path",
                )
                .with_callback(move |o| {
                    let hubs = live_hubs(&s);
                    let g = lock(&s);
                    for (name, _) in &hubs {
                        for path in ["bounce", "standard"] {
                            let n = g
                                .engine_timeouts
                                .get(&(name.clone(), path))
                                .copied()
                                .unwrap_or(0);
                            o.observe(
                                n,
                                &[
                                    KeyValue::new("agent", name.clone()),
                                    KeyValue::new("path", path),
                                ],
                            );
                        }
                    }
                })
                .build();
        }
        {
            let s = sources.clone();
            meter
                .u64_observable_counter("kvfabric.peer.transfer")
                .with_unit("By")
                .with_description(
                    "Payload bytes of successful engine-API hand-offs, by destination agent and path",
                )
                .with_callback(move |o| {
                    let agents = live_agents(&s);
                    let mut g = lock(&s);
                    // Only peers loaded now: a forgotten peer's series go.
                    let loaded: std::collections::BTreeSet<(String, String)> = agents
                        .iter()
                        .flat_map(|a| {
                            a.peers()
                                .into_iter()
                                .map(|(p, _)| (a.name().to_string(), p))
                        })
                        .collect();
                    g.peer_bytes
                        .retain(|(a, p, _), _| loaded.contains(&(a.clone(), p.clone())));
                    for ((agent, peer, path), n) in &g.peer_bytes {
                        o.observe(
                            *n,
                            &[
                                KeyValue::new("agent", agent.clone()),
                                KeyValue::new("peer", peer.clone()),
                                KeyValue::new("path", *path),
                            ],
                        );
                    }
                })
                .build();
        }
        {
            let s = sources.clone();
            meter
                .u64_observable_counter("kvfabric.engine.transfer")
                .with_unit("By")
                .with_description(
                    "Payload bytes of successful hand-offs to other agents, by source engine attached here and path",
                )
                .with_callback(move |o| {
                    let hubs = live_hubs(&s);
                    let mut g = lock(&s);
                    // Only engines attached now: a detached engine's series go.
                    let attached: std::collections::BTreeSet<(String, String)> = hubs
                        .iter()
                        .flat_map(|(n, h)| h.engine_ids().into_iter().map(|e| (n.clone(), e)))
                        .collect();
                    g.engine_bytes
                        .retain(|(a, e, _), _| attached.contains(&(a.clone(), e.clone())));
                    for ((agent, engine, path), n) in &g.engine_bytes {
                        o.observe(
                            *n,
                            &[
                                KeyValue::new("agent", agent.clone()),
                                KeyValue::new("engine", engine.clone()),
                                KeyValue::new("path", *path),
                            ],
                        );
                    }
                })
                .build();
        }
        let latency = meter
            .f64_histogram("kvfabric.transfer.latency")
            .with_unit("s")
            .with_description("Transfer latency from submit to resolution, seconds")
            .with_boundaries(LATENCY_BUCKETS_SECONDS.to_vec())
            .build();
        let invalidation = meter
            .f64_histogram("kvfabric.peer.invalidation")
            .with_unit("s")
            .with_description(
                "Peer end known (operator: pod event seen; lease: last sign of life, upper bound) until forgotten here, seconds",
            )
            .with_boundaries(INVALIDATION_BUCKETS_SECONDS.to_vec())
            .build();
        Ok(Self {
            registry,
            _provider: provider,
            latency,
            invalidation,
            sources,
            shutting_down,
        })
    }

    /// Exports `agent`'s counters (held weakly: series vanish once the
    /// agent is dropped). Idempotent per agent.
    pub fn watch_agent(&self, agent: &Arc<FabricAgent>) {
        let mut g = lock(&self.sources);
        if !g
            .agents
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(agent)))
        {
            g.agents.push(Arc::downgrade(agent));
        }
    }

    /// Exports the lease state and resync count of `discovery` under
    /// `agent=<agent_name>` (held weakly).
    pub fn watch_discovery(&self, agent_name: &str, discovery: &Arc<dyn Discovery>) {
        lock(&self.sources)
            .discoveries
            .push((agent_name.to_string(), Arc::downgrade(discovery)));
    }

    /// Exports `hub`'s engine gauges and counters under `agent_name`
    /// (held weakly).
    pub fn watch_engines(&self, agent_name: &str, hub: &Arc<super::engines::EngineHub>) {
        lock(&self.sources)
            .engines
            .push((agent_name.to_string(), Arc::downgrade(hub)));
    }

    /// Sets the `kvfabric_shutting_down` gauge (1 when `on`) of every
    /// watched agent.
    pub fn set_shutting_down(&self, on: bool) {
        self.shutting_down.store(on, Ordering::SeqCst);
    }

    /// Records one resolved transfer of `agent` in
    /// `kvfabric_transfer_latency_seconds` (`elapsed`, submit → resolution,
    /// recorded in seconds).
    pub fn observe_transfer(&self, agent: &str, path: PathKind, ok: bool, elapsed: Duration) {
        self.latency.record(
            elapsed.as_secs_f64(),
            &[
                KeyValue::new("agent", agent.to_string()),
                KeyValue::new("path", path_label(path)),
                KeyValue::new("outcome", if ok { "success" } else { "failure" }),
            ],
        );
    }

    /// Records one engine-API hand-off to another agent: its latency in
    /// `kvfabric_transfer_latency_seconds` (a timeout as a failure, at the
    /// moment it was given up), its fallback, its timeout, and (on success)
    /// its bytes by destination agent and by source engine.
    pub fn observe_engine_transfer(&self, t: &EngineTransfer<'_>) {
        let path = path_label(t.path);
        self.observe_transfer(t.agent, t.path, t.ok, t.elapsed);
        if let Some(reason) = t.fallback {
            self.record_fallback(t.agent, reason);
        }
        let mut g = lock(&self.sources);
        if t.timed_out {
            *g.engine_timeouts
                .entry((t.agent.to_string(), path))
                .or_insert(0) += 1;
        }
        if t.ok {
            *g.peer_bytes
                .entry((t.agent.to_string(), t.peer.to_string(), path))
                .or_insert(0) += t.bytes;
            *g.engine_bytes
                .entry((t.agent.to_string(), t.engine.to_string(), path))
                .or_insert(0) += t.bytes;
        }
    }

    /// Counts a fallback of `agent` to the standard path for `reason`
    /// (exported in `kvfabric_fallbacks_total{reason}`).
    pub fn record_fallback(&self, agent: &str, reason: &'static str) {
        *lock(&self.sources)
            .fallbacks
            .entry((agent.to_string(), reason))
            .or_insert(0) += 1;
    }

    /// [`FabricAgent::submit_write`] with instrumentation: a submission the
    /// gate sends to the standard path while bounce is up counts as a
    /// fallback (`peer_incompatible` when the peer failed the handshake,
    /// else `routing_gate`), and the returned [`TimedTransfer`] records the
    /// latency when it is waited on.
    pub fn submit_timed(
        self: &Arc<Self>,
        agent: &FabricAgent,
        peer: &str,
        descs: Vec<Descriptor>,
    ) -> TimedTransfer {
        let start = Instant::now();
        let (path, handle) = agent.submit_write(peer, descs);
        if path == PathKind::Standard && agent.transport().is_some() {
            let reason = if agent.has_peer_handshake(peer) {
                "routing_gate"
            } else {
                "peer_incompatible"
            };
            self.record_fallback(agent.name(), reason);
        }
        TimedTransfer {
            metrics: self.clone(),
            agent: agent.name().to_string(),
            path,
            handle,
            start,
            recorded: AtomicBool::new(false),
        }
    }

    /// The current values in the Prometheus text exposition format
    /// (version 0.0.4). Runs every observable callback.
    ///
    /// # Errors
    /// A text error when encoding fails.
    pub fn render(&self) -> Result<String, String> {
        use prometheus::Encoder as _;
        let families = self.registry.gather();
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&families, &mut out)
            .map_err(|e| e.to_string())?;
        String::from_utf8(out).map_err(|e| e.to_string())
    }

    /// The content type of [`render`](Self::render)'s output.
    pub fn content_type(&self) -> &'static str {
        "text/plain; version=0.0.4; charset=utf-8"
    }
}

/// A transfer submitted through [`AgentMetrics::submit_timed`]: the first
/// [`wait`](Self::wait) that sees the outcome records the latency in
/// `kvfabric_transfer_latency_seconds` — measured from submit to that
/// moment, so wait promptly (as the bench does) for an exact figure.
pub struct TimedTransfer {
    metrics: Arc<AgentMetrics>,
    agent: String,
    /// The path the gate picked.
    pub path: PathKind,
    /// The underlying handle.
    pub handle: TransferHandle,
    start: Instant,
    recorded: AtomicBool,
}

impl TimedTransfer {
    /// Waits at most `timeout` for the outcome (`None` while still
    /// running); the first resolution seen is recorded.
    pub fn wait(&self, timeout: Duration) -> Option<TransferOutcome> {
        let out = self.handle.wait(timeout)?;
        if !self.recorded.swap(true, Ordering::SeqCst) {
            self.metrics.observe_transfer(
                &self.agent,
                self.path,
                out == TransferOutcome::Success,
                self.start.elapsed(),
            );
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::discovery::{AgentRecord, DiscoveryError, LeaseState, PeerEvent};

    /// A discovery that only reports a lease state and a resync count.
    struct Fake(u64);

    impl Discovery for Fake {
        fn publish(&self, _: AgentRecord) -> Result<(), DiscoveryError> {
            Ok(())
        }
        fn events(&self) -> crossbeam_channel::Receiver<PeerEvent> {
            crossbeam_channel::never()
        }
        fn revoke(&self) -> Result<(), DiscoveryError> {
            Ok(())
        }
        fn lease_state(&self) -> LeaseState {
            LeaseState::Ok
        }
        fn peers(&self) -> Vec<AgentRecord> {
            Vec::new()
        }
        fn resyncs(&self) -> u64 {
            self.0
        }
    }

    #[test]
    fn discovery_series_carry_the_agent_and_vanish_with_it() {
        let m = AgentMetrics::new().unwrap();
        let d: Arc<dyn Discovery> = Arc::new(Fake(3));
        m.watch_discovery("a1", &d);
        let text = m.render().unwrap();
        assert!(
            text.contains("kvfabric_discovery_resyncs_total{agent=\"a1\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("kvfabric_lease_state{agent=\"a1\"} 1\n"),
            "{text}"
        );
        drop(d);
        let text = m.render().unwrap();
        assert!(!text.contains("agent=\"a1\""), "{text}");
    }

    #[test]
    fn engine_transfers_record_latency_fallbacks_timeouts_and_bytes() {
        let m = AgentMetrics::new().unwrap();
        let t = |ok, timed_out, fallback| EngineTransfer {
            agent: "a1",
            engine: "e1",
            peer: "p1",
            path: PathKind::Standard,
            fallback,
            ok,
            timed_out,
            bytes: 4096,
            elapsed: Duration::from_millis(2),
        };
        m.observe_engine_transfer(&t(true, false, Some("peer_incompatible")));
        m.observe_engine_transfer(&t(false, true, None));
        let text = m.render().unwrap();
        for want in [
            "kvfabric_fallbacks_total{agent=\"a1\",reason=\"peer_incompatible\"} 1\n",
            "kvfabric_transfer_latency_seconds_count{agent=\"a1\",outcome=\"success\",path=\"standard\"} 1\n",
            "kvfabric_transfer_latency_seconds_count{agent=\"a1\",outcome=\"failure\",path=\"standard\"} 1\n",
        ] {
            assert!(text.contains(want), "no {want:?} in:\n{text}");
        }
        // Recorded, then dropped at the scrape: no agent has `p1` loaded and
        // no hub has `e1` attached (the series follow what is live).
        assert!(
            !text.contains("kvfabric_peer_transfer_bytes_total{"),
            "{text}"
        );
        assert!(
            !text.contains("kvfabric_engine_transfer_bytes_total{"),
            "{text}"
        );
        let g = lock(&m.sources);
        assert_eq!(g.engine_timeouts.get(&("a1".into(), "standard")), Some(&1));
        assert!(g.peer_bytes.is_empty() && g.engine_bytes.is_empty());
        drop(g);
        m.observe_engine_transfer(&t(true, false, None));
        let g = lock(&m.sources);
        assert_eq!(
            g.peer_bytes.get(&("a1".into(), "p1".into(), "standard")),
            Some(&4096)
        );
        assert_eq!(
            g.engine_bytes.get(&("a1".into(), "e1".into(), "standard")),
            Some(&4096)
        );
    }

    #[test]
    fn latency_is_recorded_in_seconds() {
        let m = AgentMetrics::new().unwrap();
        m.observe_transfer("a1", PathKind::Bounce, true, Duration::from_micros(1500));
        let text = m.render().unwrap();
        let labels = "agent=\"a1\",outcome=\"success\",path=\"bounce\"";
        for want in [
            format!("kvfabric_transfer_latency_seconds_sum{{{labels}}} 0.0015\n"),
            format!("kvfabric_transfer_latency_seconds_count{{{labels}}} 1\n"),
            format!("kvfabric_transfer_latency_seconds_bucket{{{labels},le=\"0.001\"}} 0\n"),
            format!("kvfabric_transfer_latency_seconds_bucket{{{labels},le=\"0.0025\"}} 1\n"),
        ] {
            assert!(text.contains(&want), "no {want:?} in:\n{text}");
        }
        assert!(!text.contains("milliseconds"), "{text}");
    }
}
