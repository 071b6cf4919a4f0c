//! The operator's Prometheus metrics and their `/metrics` endpoint.

use std::net::SocketAddr;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

/// Buckets of [`Metrics::invalidation_seconds`], seconds (1 ms … 10 s).
pub const INVALIDATION_BUCKETS_S: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];

/// Metrics of one operator process.
#[derive(Clone)]
pub struct Metrics {
    /// Registry holding everything below.
    pub registry: Registry,
    /// `kvfabric_operator_invalidation_seconds{reason}`: pod event seen →
    /// its records removed from etcd (and tombstone written), seconds.
    pub invalidation_seconds: HistogramVec,
    /// `kvfabric_operator_invalidations_total{reason}`.
    pub invalidations: IntCounterVec,
    /// `kvfabric_operator_records_removed_total`: agent records deleted.
    pub records_removed: IntCounterVec,
    /// `kvfabric_operator_errors_total{kind}` (`etcd`, `kube`, `watch`).
    pub errors: IntCounterVec,
    /// `kvfabric_operator_leader`: 1 while this replica leads (or runs
    /// without leader election), else 0.
    pub leader: IntGauge,
    /// `kvfabric_operator_reconciles_total{fabric}`: reconcile passes (one
    /// per batch of watch events or deadline) of each fabric task.
    pub reconciles: IntCounterVec,
    /// `kvfabric_operator_reconcile_duration_seconds{fabric}`: one reconcile
    /// pass (invalidations and status update), seconds.
    pub reconcile_seconds: HistogramVec,
}

impl Metrics {
    /// Fresh metrics in their own registry.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let invalidation_seconds = HistogramVec::new(
            HistogramOpts::new(
                "kvfabric_operator_invalidation_seconds",
                "Pod event seen by the operator until the peer's etcd records are removed, seconds.",
            )
            .buckets(INVALIDATION_BUCKETS_S.to_vec()),
            &["reason"],
        )?;
        let invalidations = IntCounterVec::new(
            Opts::new(
                "kvfabric_operator_invalidations_total",
                "Peers invalidated.",
            ),
            &["reason"],
        )?;
        let records_removed = IntCounterVec::new(
            Opts::new(
                "kvfabric_operator_records_removed_total",
                "Agent records removed from etcd by invalidations.",
            ),
            &["fabric"],
        )?;
        let errors = IntCounterVec::new(
            Opts::new(
                "kvfabric_operator_errors_total",
                "Errors, retried, by kind.",
            ),
            &["kind"],
        )?;
        let leader = IntGauge::new(
            "kvfabric_operator_leader",
            "1 while this replica is the acting leader, else 0.",
        )?;
        let reconciles = IntCounterVec::new(
            Opts::new(
                "kvfabric_operator_reconciles_total",
                "Reconcile passes of a fabric task.",
            ),
            &["fabric"],
        )?;
        let reconcile_seconds = HistogramVec::new(
            HistogramOpts::new(
                "kvfabric_operator_reconcile_duration_seconds",
                "One reconcile pass (invalidations, status update), seconds.",
            )
            .buckets(INVALIDATION_BUCKETS_S.to_vec()),
            &["fabric"],
        )?;
        registry.register(Box::new(leader.clone()))?;
        registry.register(Box::new(reconciles.clone()))?;
        registry.register(Box::new(reconcile_seconds.clone()))?;
        registry.register(Box::new(invalidation_seconds.clone()))?;
        registry.register(Box::new(invalidations.clone()))?;
        registry.register(Box::new(records_removed.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        Ok(Self {
            registry,
            invalidation_seconds,
            invalidations,
            records_removed,
            errors,
            leader,
            reconciles,
            reconcile_seconds,
        })
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// Serves `GET /metrics` (and `GET /healthz`, 200 while the process
    /// runs: the liveness probe) on `addr` until the task is dropped; returns
    /// the bound address (port 0 = ephemeral).
    pub async fn serve(&self, addr: SocketAddr) -> std::io::Result<SocketAddr> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let bound = listener.local_addr()?;
        let me = self.clone();
        let app = axum::Router::new()
            .route(
                "/metrics",
                axum::routing::get(move || {
                    let m = me.clone();
                    async move { m.render() }
                }),
            )
            .route("/healthz", axum::routing::get(|| async { "ok\n" }));
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "metrics server stopped");
            }
        });
        Ok(bound)
    }
}
