//! OpenTelemetry traces of engine hand-offs (issue 15, item 4).
//!
//! Off unless an OTLP endpoint is configured (`--otlp-endpoint`,
//! `KVFABRIC_OTLP_ENDPOINT`): the engine API then checks one empty
//! `OnceLock` per request and nothing else. With an endpoint, each
//! `Transfer` call starts a `kvfabric.transfer` span, parented by the
//! engine's W3C `traceparent` when it sends one, and sampled
//! `ParentBased(TraceIdRatioBased(traceSampleRatio))`: an engine whose
//! request span is sampled gets the agent's spans too; without a parent the
//! ratio decides. An unsampled request costs the sampler's decision and no
//! more: its bounce request records no stages.
//!
//! A sampled request gets, built at its end from the instants the request
//! already carried:
//!
//! * `kvfabric.transfer` (server span; the engine's span is its parent):
//!   `kvfabric.request_id`, `kvfabric.engine`, `kvfabric.dst_engine`,
//!   `kvfabric.peer` (the destination agent), `kvfabric.path`
//!   (`bounce`, `standard` or `direct`), `kvfabric.bytes`,
//!   `kvfabric.descriptors`, `kvfabric.outcome` (`success`, `failure`,
//!   `timeout`, `cancelled` or `rejected`), `kvfabric.reason` when not a
//!   success, `kvfabric.fallback` when the routing gate fell back; an
//!   `arrival` event when the ARRIVAL notice was sent.
//! * `kvfabric.submit`: call received → handed to the path (validation,
//!   resolution, descriptors).
//! * `kvfabric.bounce` / `kvfabric.standard` / `kvfabric.direct`: handed
//!   to the path (bounce: the sizing pass, then the IO thread) → resolved. A bounce span carries one event per chunk stage the IO
//!   thread saw (`want`, `gather`, `write`, `data`, `ack`, each with
//!   `kvfabric.chunk`; `ack` = the receiver scattered the chunk), at most
//!   [`MAX_STAGE_EVENTS`].
//! * `kvfabric.arrival` on the destination agent, a child of
//!   `kvfabric.transfer` (the ARRIVAL notice carries its `traceparent`):
//!   the notice was received and the arrival recorded.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};

use crate::runtime::transport::{StageEvent, MAX_STAGE_EVENTS};

/// Default `traceSampleRatio`: one request in a hundred without a sampled
/// parent.
pub const DEFAULT_SAMPLE_RATIO: f64 = 0.01;

/// The agent's trace pipeline: an OTLP/gRPC exporter behind a batch span
/// processor.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
    /// Stops the runtime thread that drives the exporter's channel.
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl Traces {
    /// Starts the pipeline exporting to `endpoint` (`http://host:4317`)
    /// with the given sample ratio; `agent` names the resource
    /// (`service.name` = `kvfabric-agent`, `kvfabric.agent` = `agent`).
    ///
    /// # Errors
    /// The exporter could not be built (an invalid endpoint).
    pub fn start(endpoint: &str, ratio: f64, agent: &str) -> Result<Self, String> {
        use opentelemetry_otlp::WithExportConfig as _;
        // tonic's channel runs its connection on a tokio runtime: a
        // dedicated current-thread one on its own thread, so export never
        // depends on the daemon's runtime (nor blocks it).
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("trace exporter runtime: {e}"))?;
        let exporter = {
            let _g = rt.enter();
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(Duration::from_secs(5))
                .build()
                .map_err(|e| format!("OTLP exporter for {endpoint:?}: {e}"))?
        };
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("kvfabric-otlp".into())
            .spawn(move || {
                rt.block_on(async {
                    let _ = stop_rx.await;
                });
            })
            .map_err(|e| format!("trace exporter thread: {e}"))?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name("kvfabric-agent")
            .with_attribute(KeyValue::new("kvfabric.agent", agent.to_string()))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                ratio,
            ))))
            .with_max_events_per_span(MAX_STAGE_EVENTS as u32 + 8)
            .with_resource(resource)
            .with_batch_exporter(exporter)
            .build();
        let tracer = provider.tracer("kvfabric");
        Ok(Self {
            provider,
            tracer,
            propagator: TraceContextPropagator::new(),
            stop: Mutex::new(Some(stop_tx)),
        })
    }

    /// Flushes the spans still queued (bounded) and stops the exporter.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown_with_timeout(Duration::from_secs(5)) {
            tracing::warn!(error = %e, "trace pipeline shutdown");
        }
        if let Some(tx) = self.stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = tx.send(());
        }
    }

    /// The parent context of a W3C `traceparent` (empty or invalid: none).
    fn parent(&self, traceparent: &str) -> Context {
        if traceparent.is_empty() {
            return Context::new();
        }
        let mut carrier = HashMap::with_capacity(1);
        carrier.insert("traceparent".to_string(), traceparent.to_string());
        self.propagator.extract(&carrier)
    }

    /// Starts the `kvfabric.transfer` span of a request received at
    /// `received`, parented by the engine's `traceparent`. `None` when the
    /// sampler drops it: nothing else is then recorded for the request.
    /// `attributes` are built only for a sampled request.
    pub fn begin_transfer(
        &self,
        traceparent: &str,
        received: Instant,
        attributes: impl FnOnce() -> Vec<KeyValue>,
    ) -> Option<TransferTrace> {
        let parent = self.parent(traceparent);
        let wall = SystemTime::now();
        let received_wall = wall.checked_sub(received.elapsed()).unwrap_or(wall);
        let span = self
            .tracer
            .span_builder("kvfabric.transfer")
            .with_kind(SpanKind::Server)
            .with_start_time(received_wall)
            .start_with_context(&self.tracer, &parent);
        if !span.span_context().is_sampled() {
            return None;
        }
        let mut span = span;
        span.set_attributes(attributes());
        Some(TransferTrace {
            tracer: self.tracer.clone(),
            cx: Context::new().with_span(span),
            received,
            received_wall,
            peer: None,
            path: None,
            timeline: Vec::new(),
            dropped: 0,
            arrival_sent: None,
        })
    }

    /// The `kvfabric.arrival` span on the destination agent, child of the
    /// sender's `kvfabric.transfer` (`traceparent` from the notice).
    pub fn arrival(&self, traceparent: &str, attributes: Vec<KeyValue>, ok: bool) {
        let parent = self.parent(traceparent);
        if !parent.span().span_context().is_valid() {
            return;
        }
        let mut span = self
            .tracer
            .span_builder("kvfabric.arrival")
            .with_kind(SpanKind::Consumer)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &parent);
        if !ok {
            span.set_status(Status::error("hand-off failed"));
        }
        span.end();
    }
}

/// The trace of one sampled `Transfer` call; its spans are built in
/// [`finish`](Self::finish) from instants the request carried.
pub struct TransferTrace {
    tracer: SdkTracer,
    /// Holds the `kvfabric.transfer` span.
    cx: Context,
    received: Instant,
    received_wall: SystemTime,
    /// The destination agent (this agent's name for a local hand-off).
    pub peer: Option<String>,
    /// Submitted → resolved on the named path.
    pub path: Option<(&'static str, Instant, Instant)>,
    /// The bounce request's stage events.
    pub timeline: Vec<StageEvent>,
    /// Stage events past [`MAX_STAGE_EVENTS`].
    pub dropped: u32,
    /// When the ARRIVAL notice went out.
    pub arrival_sent: Option<Instant>,
}

impl TransferTrace {
    /// The wall-clock time of `at` (anchored at the request's receipt).
    fn wall(&self, at: Instant) -> SystemTime {
        match at.checked_duration_since(self.received) {
            Some(d) => self.received_wall + d,
            None => self
                .received_wall
                .checked_sub(self.received.duration_since(at))
                .unwrap_or(self.received_wall),
        }
    }

    /// Sets an attribute of `kvfabric.transfer`.
    pub fn set(&self, kv: KeyValue) {
        self.cx.span().set_attribute(kv);
    }

    /// The `traceparent` the ARRIVAL notice carries: `kvfabric.transfer`.
    pub fn traceparent(&self) -> String {
        let mut carrier: HashMap<String, String> = HashMap::with_capacity(1);
        TraceContextPropagator::new().inject_context(&self.cx, &mut carrier);
        carrier.remove("traceparent").unwrap_or_default()
    }

    fn child(&self, name: &'static str, start: Instant) -> opentelemetry_sdk::trace::Span {
        self.tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(self.wall(start))
            .start_with_context(&self.tracer, &self.cx)
    }

    /// Ends the trace: the child spans, the outcome attributes and the
    /// `kvfabric.transfer` span itself (at `end`). `submit_us` is the
    /// response's received → submitted time; `transfer_us` submitted →
    /// resolved (both from the response, for paths that did not set
    /// [`path`](Self::path) themselves).
    #[allow(clippy::too_many_arguments)]
    pub fn finish(
        mut self,
        outcome: &str,
        reason: &str,
        path: &str,
        bytes: u64,
        descriptors: u32,
        submit_us: Option<u64>,
        transfer_us: Option<u64>,
        end: Instant,
    ) {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new("kvfabric.outcome", outcome.to_string()));
        if !path.is_empty() {
            span.set_attribute(KeyValue::new("kvfabric.path", path.to_string()));
        }
        span.set_attribute(KeyValue::new("kvfabric.bytes", bytes as i64));
        span.set_attribute(KeyValue::new(
            "kvfabric.descriptors",
            i64::from(descriptors),
        ));
        if let Some(p) = &self.peer {
            span.set_attribute(KeyValue::new("kvfabric.peer", p.clone()));
        }
        if outcome != "success" {
            span.set_attribute(KeyValue::new("kvfabric.reason", reason.to_string()));
            span.set_status(Status::error(format!("{outcome}: {reason}")));
        }
        // received → submitted.
        let submitted = match (self.path, submit_us) {
            (Some((_, s, _)), _) => Some(s),
            (None, Some(us)) => Some(self.received + Duration::from_micros(us)),
            (None, None) => None,
        };
        if let Some(s) = submitted {
            let mut sub = self.child("kvfabric.submit", self.received);
            sub.end_with_timestamp(self.wall(s));
        }
        // submitted → resolved, with the stage events.
        let on_path = match (self.path, submitted, transfer_us) {
            (Some((name, s, e)), _, _) => Some((name, s, e)),
            (None, Some(s), Some(us)) => Some((
                match path {
                    "direct" => "kvfabric.direct",
                    "standard" => "kvfabric.standard",
                    _ => "kvfabric.bounce",
                },
                s,
                s + Duration::from_micros(us),
            )),
            _ => None,
        };
        if let Some((name, s, e)) = on_path {
            let mut p = self.child(name, s);
            p.set_attribute(KeyValue::new("kvfabric.path", path.to_string()));
            for ev in std::mem::take(&mut self.timeline) {
                p.add_event_with_timestamp(
                    ev.stage.name(),
                    self.wall(ev.at),
                    vec![KeyValue::new("kvfabric.chunk", i64::from(ev.chunk))],
                );
            }
            if self.dropped > 0 {
                p.set_attribute(KeyValue::new(
                    "kvfabric.stage_events_dropped",
                    i64::from(self.dropped),
                ));
            }
            p.end_with_timestamp(self.wall(e));
        }
        if let Some(at) = self.arrival_sent {
            self.cx
                .span()
                .add_event_with_timestamp("arrival", self.wall(at), Vec::new());
        }
        let end = self.wall(end);
        self.cx.span().end_with_timestamp(end);
    }
}
