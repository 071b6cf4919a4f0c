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
//! | `kvfabric_transfer_latency_milliseconds` | histogram | `path`, `outcome` | submit → resolution, ms (recorded by [`AgentMetrics::submit_timed`] / [`AgentMetrics::observe_transfer`]) |
//! | `kvfabric_credit_grants_total` | counter | | credits granted by the receiver role |
//! | `kvfabric_credit_wait_microseconds_total` | counter | | summed submit → first GRANT wait, µs |
//! | `kvfabric_chunks_written_total` | counter | | chunk writes completed |
//! | `kvfabric_chunks_scattered_total` | counter | | chunks scattered and ACKed |
//! | `kvfabric_data_rejected_total` | counter | | DATA messages dropped |
//! | `kvfabric_wants_rejected_total` | counter | | WANT messages rejected |
//! | `kvfabric_control_dropped_total` | counter | | control messages dropped on a full queue |
//! | `kvfabric_fallbacks_total` | counter | `reason` | bounce → standard fallbacks (`bounce_init_failed`, and from [`AgentMetrics::submit_timed`]: `peer_incompatible`, `routing_gate`) |
//! | `kvfabric_peers_loaded_total` | counter | | peers loaded |
//! | `kvfabric_peers_forgotten_total` | counter | | peers forgotten |
//! | `kvfabric_peers` | gauge | `bounce` = compatible/incompatible | peers loaded now |
//! | `kvfabric_arena_in_use_bytes` | gauge | | arena bytes held (staging + granted + orphaned) |
//! | `kvfabric_arena_capacity_bytes` | gauge | | usable arena capacity (0 without bounce) |
//! | `kvfabric_drain_mode` | gauge | | 1 while the credit scheduler is in drain mode |
//! | `kvfabric_lease_state` | gauge | | [`LeaseState::code`](crate::service::discovery::LeaseState::code): 0 unpublished, 1 ok, 2 renewing, 3 regranting, 4 lost, 5 revoked |
//! | `kvfabric_shutting_down` | gauge | | 1 once graceful shutdown began |

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
use crate::runtime::transport::{TransferHandle, TransferOutcome, TransportStats};

/// Bucket boundaries of the transfer latency histogram, milliseconds.
pub const LATENCY_BUCKETS_MS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
    10000.0, 30000.0,
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
    /// Fallbacks recorded by [`AgentMetrics::submit_timed`]: (agent, reason) → count.
    fallbacks: BTreeMap<(String, &'static str), u64>,
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
        "kvfabric.credit.wait",
        Some("us"),
        "Summed credit wait (submit -> first GRANT) of bounce requests, microseconds",
        |t| &t.credit_wait_us,
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
        "WANT messages rejected (bad endpoint or chunk sizes)",
        |t| &t.wants_rejected,
    ),
    (
        "kvfabric.control.dropped",
        None,
        "Control messages dropped on a full queue",
        |t| &t.control_dropped,
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
                    for a in live_agents(&s) {
                        o.observe(
                            ld(&a.stats().fallbacks),
                            &[agent_kv(&a), KeyValue::new("reason", "bounce_init_failed")],
                        );
                    }
                    for ((agent, reason), n) in &lock(&s).fallbacks {
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
        {
            let s = sources.clone();
            meter
                .u64_observable_gauge("kvfabric.lease_state")
                .with_description(
                    "Discovery lease state: 0 unpublished, 1 ok, 2 renewing, 3 regranting, 4 lost, 5 revoked",
                )
                .with_callback(move |o| {
                    let ds: Vec<(String, Arc<dyn Discovery>)> = {
                        let mut g = lock(&s);
                        g.discoveries.retain(|(_, w)| w.strong_count() > 0);
                        g.discoveries
                            .iter()
                            .filter_map(|(n, w)| Some((n.clone(), w.upgrade()?)))
                            .collect()
                    };
                    for (name, d) in ds {
                        o.observe(
                            u64::from(d.lease_state().code()),
                            &[KeyValue::new("agent", name)],
                        );
                    }
                })
                .build();
        }
        {
            let flag = shutting_down.clone();
            meter
                .u64_observable_gauge("kvfabric.shutting_down")
                .with_description("1 once graceful shutdown began (readyz answers 503)")
                .with_callback(move |o| o.observe(u64::from(flag.load(Ordering::SeqCst)), &[]))
                .build();
        }
        let latency = meter
            .f64_histogram("kvfabric.transfer.latency")
            .with_unit("ms")
            .with_description("Transfer latency from submit to resolution, milliseconds")
            .with_boundaries(LATENCY_BUCKETS_MS.to_vec())
            .build();
        Ok(Self {
            registry,
            _provider: provider,
            latency,
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

    /// Exports the lease state of `discovery` under `agent=<agent_name>`
    /// (held weakly).
    pub fn watch_discovery(&self, agent_name: &str, discovery: &Arc<dyn Discovery>) {
        lock(&self.sources)
            .discoveries
            .push((agent_name.to_string(), Arc::downgrade(discovery)));
    }

    /// Sets the `kvfabric_shutting_down` gauge.
    pub fn set_shutting_down(&self, on: bool) {
        self.shutting_down.store(on, Ordering::SeqCst);
    }

    /// Records one resolved transfer of `agent` in the latency histogram
    /// (`elapsed` is converted to milliseconds).
    pub fn observe_transfer(&self, agent: &str, path: PathKind, ok: bool, elapsed: Duration) {
        self.latency.record(
            elapsed.as_secs_f64() * 1e3,
            &[
                KeyValue::new("agent", agent.to_string()),
                KeyValue::new("path", path_label(path)),
                KeyValue::new("outcome", if ok { "success" } else { "failure" }),
            ],
        );
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
/// `kvfabric_transfer_latency_milliseconds` — measured from submit to that
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
