//! The agent's HTTP API (issue "agent daemon", item 3), on axum:
//!
//! | route | answer |
//! |---|---|
//! | `GET /healthz` | 200 `{"status":"ok"}` while the process runs |
//! | `GET /readyz` | 200 when the NIXL agent is up, the bounce arena is up (or bounce is disabled by config), discovery has published (lease `ok` or `renewing`) and no shutdown began; else 503 with the failing checks and a `reason` |
//! | `GET /metrics` | Prometheus text format ([`AgentMetrics`]) |
//! | `GET /v1/peers` | loaded peers: name, logical id, incarnation, handshake compatibility (and why not), path in use |
//! | `GET /v1/report` | [`AgentReport`](crate::core::report::AgentReport) for the operator: config generation, bounce activity counters (requests sent, chunks scattered), peers whose transport probe suspects a silent TCP/emulation fallback |
//! | `GET /v1/config` | the effective config (as given by the daemon; `config.warnings` lists environment values it did not apply) plus the bounce sizes in force |
//!
//! Only with [`ServiceInit::debug_api`] (the daemon's `--debug-api`, off by
//! default, loopback listeners only; 404 otherwise):
//!
//! | route | answer |
//! |---|---|
//! | `POST /v1/debug/verify` | `{seed, descriptors:[{dst,len}]}` → `{ok, first_mismatch}`: checks the fast bench pattern ([`check_fast`] with `k` = descriptor index) over ranges that must lie inside this agent's registered pool (400 naming the first bad range otherwise) |
//! | `POST /v1/debug/transfer` | `{peer, path, seed, descriptors:[{src,dst,len}]}` → `{outcome, latency_ms, ...}`: fills each source with the fast bench pattern ([`fill_fast`], `k` = descriptor index) and WRITEs the descriptors to `peer` (its agent name, or its logical id → its live incarnation) through `path` (`bounce` or `standard`), waiting at most [`TRANSFER_WAIT`]; sources must lie in this agent's writable pool and destinations in the peer's published buffers (400), the peer must be loaded (404) and, for `bounce`, the transport up and the peer bounce-compatible (409); 503 while shutting down. (the distributed `kvfabric bench` used it before engines attached through the engine API; now only tests and debugging do) |
//!
//! All JSON errors have the shape `{"error": "..."}`; a body over its limit
//! is 413, any other malformed body 400.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::discovery::{AgentRecord, BufferRegion, Discovery, Incarnation, LeaseState};
use super::metrics::AgentMetrics;
use crate::core::Descriptor;
use crate::pattern::{check_fast, fill_fast};
use crate::runtime::fabric::{FabricAgent, Incompatibility, PathKind};
use crate::runtime::transport::TransferOutcome;

/// Largest accepted `/v1/debug/verify` body (bytes).
pub const VERIFY_BODY_LIMIT: usize = 64 << 20;

/// Largest accepted `/v1/debug/transfer` body (bytes).
pub const TRANSFER_BODY_LIMIT: usize = 64 << 20;

/// Bound on waiting for one `/v1/debug/transfer` to resolve.
pub const TRANSFER_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

/// A memory range `/v1/debug/verify` may read (the agent's registered KV
/// pool), optionally keeping its owner alive; when writable,
/// `/v1/debug/transfer` may also fill transfer sources in it.
pub struct VerifyRegion {
    addr: u64,
    len: u64,
    writable: bool,
    _keep: Option<Arc<dyn Any + Send + Sync>>,
}

impl VerifyRegion {
    /// `[addr, addr + len)` may be read by verify requests.
    ///
    /// # Safety
    /// The range must stay allocated and readable for as long as the
    /// [`ServiceState`] holding it lives (pass its owner as `keep` to
    /// guarantee that). Concurrent writes by transfers are tolerated (the
    /// check then simply reports a mismatch).
    pub unsafe fn new(addr: u64, len: u64, keep: Option<Arc<dyn Any + Send + Sync>>) -> Self {
        Self {
            addr,
            len,
            writable: false,
            _keep: keep,
        }
    }

    /// `[addr, addr + len)` may be read by verify requests and written by
    /// `/v1/debug/transfer` (the sources it fills before sending).
    ///
    /// # Safety
    /// As [`new`](Self::new), and the range must be writable memory that
    /// nothing else in the process relies on the contents of (a KV pool
    /// whose blocks belong to the client driving the debug API).
    pub unsafe fn new_writable(
        addr: u64,
        len: u64,
        keep: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Self {
        Self {
            addr,
            len,
            writable: true,
            _keep: keep,
        }
    }

    /// Whether `/v1/debug/transfer` may write the region.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// Base address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn contains(&self, dst: u64, len: u64) -> bool {
        dst >= self.addr
            && dst
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

/// What a [`ServiceState`] is built from.
pub struct ServiceInit {
    /// The fabric agent served.
    pub agent: Arc<FabricAgent>,
    /// Its discovery (readiness needs a published record); `None` = no
    /// discovery check (e.g. a standalone agent).
    pub discovery: Option<Arc<dyn Discovery>>,
    /// Its metrics (must already watch the agent).
    pub metrics: Arc<AgentMetrics>,
    /// The effective configuration document served by `/v1/config`.
    pub config: serde_json::Value,
    /// Whether the configuration asks for bounce (readiness then needs the
    /// arena up).
    pub bounce_requested: bool,
    /// Stable identity of the agent.
    pub logical_id: String,
    /// This process start's incarnation, when known.
    pub incarnation: Option<Incarnation>,
    /// Ranges `/v1/debug/verify` may read.
    pub verify_regions: Vec<VerifyRegion>,
    /// Serve `/v1/debug/verify` and `/v1/debug/transfer` (off by default
    /// in the daemon: `--debug-api`, loopback listeners only).
    pub debug_api: bool,
}

/// Shared state of the HTTP handlers.
pub struct ServiceState {
    agent: Arc<FabricAgent>,
    discovery: Option<Arc<dyn Discovery>>,
    metrics: Arc<AgentMetrics>,
    config: serde_json::Value,
    bounce_requested: bool,
    logical_id: String,
    incarnation: Option<Incarnation>,
    regions: Vec<VerifyRegion>,
    debug_api: bool,
    shutting_down: AtomicBool,
}

/// The result of the readiness checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    /// All checks pass.
    pub ready: bool,
    /// The NIXL agent exists and serializes its metadata.
    pub nixl: bool,
    /// The bounce arena and transport are up, or bounce is disabled by
    /// config.
    pub arena: bool,
    /// Discovery published the record and the lease is `ok` or `renewing`
    /// (always true without discovery).
    pub discovery: bool,
    /// The lease state (`unpublished`, `ok`, ...), when there is discovery.
    pub lease_state: Option<String>,
    /// Graceful shutdown began.
    pub shutting_down: bool,
    /// Why not ready (empty when ready), `; `-separated.
    pub reason: String,
}

impl ServiceState {
    /// Builds the state.
    pub fn new(init: ServiceInit) -> Arc<Self> {
        Arc::new(Self {
            agent: init.agent,
            discovery: init.discovery,
            metrics: init.metrics,
            config: init.config,
            bounce_requested: init.bounce_requested,
            logical_id: init.logical_id,
            incarnation: init.incarnation,
            regions: init.verify_regions,
            debug_api: init.debug_api,
            shutting_down: AtomicBool::new(false),
        })
    }

    /// The agent served.
    pub fn agent(&self) -> &Arc<FabricAgent> {
        &self.agent
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<AgentMetrics> {
        &self.metrics
    }

    /// Marks graceful shutdown: `/readyz` answers 503 from now on.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.metrics.set_shutting_down(true);
    }

    /// Whether graceful shutdown began.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Runs the readiness checks (serializes the NIXL metadata once to prove
    /// the agent is usable; blocking, call off the async executor).
    pub fn readiness(&self) -> Readiness {
        let mut reasons = Vec::new();
        let nixl = match self.agent.local_descriptor() {
            Ok(_) => true,
            Err(e) => {
                reasons.push(format!("NIXL agent not usable: {e}"));
                false
            }
        };
        let arena = if !self.bounce_requested || self.agent.transport().is_some() {
            true
        } else {
            reasons.push(format!(
                "bounce arena not up: {}",
                self.agent
                    .bounce_unavailable()
                    .as_deref()
                    .unwrap_or("unknown reason")
            ));
            false
        };
        let lease = self.discovery.as_ref().map(|d| d.lease_state());
        let discovery = match lease {
            None | Some(LeaseState::Ok) | Some(LeaseState::Renewing) => true,
            Some(s) => {
                reasons.push(format!("discovery lease {s}"));
                false
            }
        };
        let shutting_down = self.is_shutting_down();
        if shutting_down {
            reasons.push("shutting down".into());
        }
        Readiness {
            ready: reasons.is_empty(),
            nixl,
            arena,
            discovery,
            lease_state: lease.map(|s| s.as_str().to_string()),
            shutting_down,
            reason: reasons.join("; "),
        }
    }
}

/// Human-readable form of an [`Incompatibility`].
pub fn describe_incompatibility(why: &Incompatibility) -> String {
    match why {
        Incompatibility::LocalBounceOff => "bounce is off on this agent".into(),
        Incompatibility::NoHandshake => "peer advertises no bounce handshake".into(),
        Incompatibility::Malformed(e) => format!("peer handshake is malformed: {e}"),
        Incompatibility::WireVersion { local, peer } => {
            format!("wire version differs (local {local}, peer {peer})")
        }
        Incompatibility::ControlKind { local, peer } => {
            format!("control kind differs (local {local:?}, peer {peer:?})")
        }
        Incompatibility::MaxChunk { local, peer } => {
            format!("max chunk size differs (local {local} B, peer {peer} B)")
        }
        Incompatibility::Endpoint(e) => format!("peer control endpoint unusable: {e}"),
        Incompatibility::Draining => {
            "a config rollout step is draining this agent or the peer".into()
        }
        Incompatibility::ControlAuth { local_requires: true } => "this agent requires signed control hellos (controlAuth required) and the peer does not sign (controlAuth off): standard path for data, no control route (its arrival notices cannot reach engines here): give it the control key".into(),
        Incompatibility::ControlAuth { local_requires: false } => "the peer requires signed control hellos (controlAuth required) and this agent does not sign (controlAuth off): standard path for data, no control route (arrival notices to its engines cannot be sent): give this agent the control key".into(),
        Incompatibility::ConfigGeneration { local, peer } => format!(
            "config generation differs (local {local}, peer {peer}): a rollout is advancing; standard path until both run the same generation"
        ),
    }
}

/// One peer in `/v1/peers`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// NIXL agent name (incarnation included).
    pub name: String,
    /// Logical id, when discovery knows the peer.
    pub logical_id: Option<String>,
    /// The peer's incarnation (from its record, else parsed from its name).
    pub incarnation: Option<String>,
    /// Node the peer runs on, when published.
    pub node: Option<String>,
    /// Whether the bounce handshake passed.
    pub bounce_compatible: bool,
    /// Why not, when it did not.
    pub reason: Option<String>,
    /// Path transfers to this peer use: `bounce` (when the routing gate
    /// also passes) or `standard`.
    pub path: String,
    /// Buffers the peer published.
    pub buffers: Vec<BufferRegion>,
    /// Transport report of the first bounce chunk writes to the peer
    /// (fastest write in MB/s, memory kinds, `suspect_fallback`), once
    /// there were enough.
    #[serde(default)]
    pub transport: Option<crate::runtime::transport::TransportReport>,
}

/// A `/v1/debug/verify` descriptor: `len` bytes at `dst` in this agent's
/// pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyDescriptor {
    /// Destination address (this agent's address space).
    pub dst: u64,
    /// Length in bytes.
    pub len: u64,
}

/// `/v1/debug/verify` request body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyRequest {
    /// The transfer's pattern seed.
    pub seed: u64,
    /// Descriptor `k` must hold `fill_fast(.., seed, k)`.
    pub descriptors: Vec<VerifyDescriptor>,
}

/// The first mismatch `/v1/debug/verify` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mismatch {
    /// Descriptor index.
    pub descriptor: usize,
    /// Byte offset within the descriptor.
    pub offset: u64,
}

/// `/v1/debug/verify` answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyResponse {
    /// Every byte matched.
    pub ok: bool,
    /// The first mismatch, if any.
    pub first_mismatch: Option<Mismatch>,
    /// Descriptors checked.
    pub descriptors: usize,
    /// Bytes checked.
    pub bytes: u64,
}

/// A `/v1/debug/transfer` descriptor: `len` bytes from `src` (this
/// agent's address space) to `dst` (the peer's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferDescriptor {
    /// Source address in this agent's writable pool.
    pub src: u64,
    /// Destination address in the peer's published buffers.
    pub dst: u64,
    /// Length in bytes.
    pub len: u64,
}

/// `/v1/debug/transfer` request body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferRequest {
    /// The destination agent: its NIXL agent name, or its logical id (the
    /// live incarnation loaded through discovery is used).
    pub peer: String,
    /// `bounce` or `standard`.
    pub path: String,
    /// Pattern seed: source `k` is filled with `fill_fast(.., seed, k)`.
    pub seed: u64,
    /// What to write.
    pub descriptors: Vec<TransferDescriptor>,
}

/// `/v1/debug/transfer` answer (HTTP 200 whenever the transfer was
/// submitted, whatever its outcome).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransferResponse {
    /// `success`, `failure` or `timeout` (not resolved within
    /// [`TRANSFER_WAIT`]).
    pub outcome: String,
    /// The failure reason, when not `success`.
    pub error: Option<String>,
    /// The peer's agent name the transfer went to.
    pub peer: String,
    /// The agent's request id (as in its logs).
    pub request_id: u64,
    /// The path used.
    pub path: String,
    /// Descriptors sent.
    pub descriptors: usize,
    /// Payload bytes sent.
    pub bytes: u64,
    /// Submit → resolution, milliseconds (the source fill excluded).
    pub latency_ms: f64,
}

fn json_error(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(json!({ "error": msg.into() }))).into_response()
}

type St = State<Arc<ServiceState>>;

async fn healthz() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn readyz(State(s): St) -> Response {
    let s2 = s.clone();
    let r = tokio::task::spawn_blocking(move || s2.readiness())
        .await
        .unwrap_or_else(|e| Readiness {
            ready: false,
            nixl: false,
            arena: false,
            discovery: false,
            lease_state: None,
            shutting_down: s.is_shutting_down(),
            reason: format!("readiness check panicked: {e}"),
        });
    let code = if r.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(r)).into_response()
}

async fn metrics(State(s): St) -> Response {
    let m = s.metrics.clone();
    match tokio::task::spawn_blocking(move || m.render()).await {
        Ok(Ok(text)) => ([(header::CONTENT_TYPE, s.metrics.content_type())], text).into_response(),
        Ok(Err(e)) => json_error(StatusCode::INTERNAL_SERVER_ERROR, e),
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

fn incarnation_from_name(name: &str) -> Option<String> {
    let (_, tail) = name.rsplit_once('-')?;
    (tail.len() == 32)
        .then(|| tail.parse::<Incarnation>().ok())
        .flatten()
        .map(|i| i.to_string())
}

fn peer_infos(s: &ServiceState) -> Vec<PeerInfo> {
    let records: HashMap<String, AgentRecord> = s
        .discovery
        .as_ref()
        .map(|d| d.peers().into_iter().map(|r| (r.name.clone(), r)).collect())
        .unwrap_or_default();
    s.agent
        .peers()
        .into_iter()
        .map(|(name, st)| {
            let rec = records.get(&name);
            let (compatible, reason) = match &st.bounce {
                Ok(_) => (true, None),
                Err(why) => (false, Some(describe_incompatibility(why))),
            };
            PeerInfo {
                logical_id: rec.map(|r| r.logical_id.clone()),
                incarnation: rec
                    .map(|r| r.incarnation.to_string())
                    .or_else(|| incarnation_from_name(&name)),
                node: rec.map(|r| r.node.clone()).filter(|n| !n.is_empty()),
                bounce_compatible: compatible,
                reason,
                path: if compatible { "bounce" } else { "standard" }.into(),
                buffers: rec.map(|r| r.buffers.clone()).unwrap_or_default(),
                transport: s.agent.transport().and_then(|t| t.transport_report(&name)),
                name,
            }
        })
        .collect()
}

async fn peers(State(s): St) -> Response {
    let s2 = s.clone();
    match tokio::task::spawn_blocking(move || peer_infos(&s2)).await {
        Ok(p) => Json(json!({
            "agent": s.agent.name(),
            "logical_id": s.logical_id,
            "incarnation": s.incarnation.map(|i| i.to_string()),
            "peers": p,
        }))
        .into_response(),
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// The agent's [`crate::core::report::AgentReport`].
pub fn agent_report(s: &ServiceState) -> crate::core::report::AgentReport {
    let a = &s.agent;
    let (succeeded, sent, scattered, mut degraded) = match a.transport() {
        Some(t) => {
            let st = t.stats();
            let degraded: Vec<String> = st
                .transport_reports
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .filter(|(_, r)| r.suspect_fallback)
                .map(|(peer, _)| peer.clone())
                .collect();
            (
                st.succeeded.load(Ordering::Relaxed),
                st.bytes_sent.load(Ordering::Relaxed),
                st.chunks_scattered.load(Ordering::Relaxed),
                degraded,
            )
        }
        None => (0, 0, 0, Vec::new()),
    };
    degraded.sort();
    crate::core::report::AgentReport {
        agent: a.name().to_string(),
        config_generation: a.handshake().map_or(0, |h| h.config_generation),
        bounce_active: a.transport().is_some(),
        bounce_succeeded_total: succeeded,
        bounce_sent_bytes_total: sent,
        bounce_chunks_scattered_total: scattered,
        degraded_peers: degraded,
    }
}

async fn report(State(s): St) -> Response {
    Json(agent_report(&s)).into_response()
}

async fn config(State(s): St) -> Response {
    let a = &s.agent;
    let hs = a.handshake();
    let hs = hs.as_ref();
    Json(json!({
        "agent": a.name(),
        "logical_id": s.logical_id,
        "incarnation": s.incarnation.map(|i| i.to_string()),
        "config": s.config,
        "bounce_effective": {
            "requested": s.bounce_requested,
            "active": a.transport().is_some(),
            "unavailable_reason": a.bounce_unavailable(),
            "max_chunk_size_bytes": hs.map(|h| h.max_chunk_size_bytes),
            "arena_usable_capacity_bytes": hs.map(|h| h.arena_usable_capacity_bytes),
            "control_kind": hs.map(|h| format!("{:?}", h.control_kind)),
            "control_auth": a.control_auth_mode(),
            "wire_version": hs.map(|h| h.wire_version),
            "config_generation": hs.map(|h| h.config_generation),
            "config_fingerprint": crate::service::rollout::running_fingerprint(a),
            "draining": a.is_draining(),
        },
    }))
    .into_response()
}

fn verify_blocking(s: &ServiceState, req: &VerifyRequest) -> Result<VerifyResponse, String> {
    for (k, d) in req.descriptors.iter().enumerate() {
        if !s.regions.iter().any(|r| r.contains(d.dst, d.len)) {
            let pools: Vec<String> = s
                .regions
                .iter()
                .map(|r| format!("[{:#x}, {:#x})", r.addr, r.addr + r.len))
                .collect();
            return Err(format!(
                "descriptor {k}: range [{:#x}, {:#x}) ({} bytes) is not inside this agent's registered pool {}",
                d.dst,
                d.dst.saturating_add(d.len),
                d.len,
                if pools.is_empty() {
                    "(none registered)".to_string()
                } else {
                    pools.join(", ")
                }
            ));
        }
    }
    let mut bytes = 0;
    for (k, d) in req.descriptors.iter().enumerate() {
        // SAFETY: the range lies inside a VerifyRegion, whose constructor's
        // contract keeps it readable while the state lives.
        if let Err(offset) = unsafe { check_fast(d.dst, d.len, req.seed, k as u64) } {
            return Ok(VerifyResponse {
                ok: false,
                first_mismatch: Some(Mismatch {
                    descriptor: k,
                    offset,
                }),
                descriptors: req.descriptors.len(),
                bytes: bytes + offset,
            });
        }
        bytes += d.len;
    }
    Ok(VerifyResponse {
        ok: true,
        first_mismatch: None,
        descriptors: req.descriptors.len(),
        bytes,
    })
}

async fn verify(
    State(s): St,
    body: Result<Json<VerifyRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return json_error(rejection_status(&e), e.body_text()),
    };
    match tokio::task::spawn_blocking(move || verify_blocking(&s, &req)).await {
        Ok(Ok(r)) => Json(r).into_response(),
        Ok(Err(e)) => json_error(StatusCode::BAD_REQUEST, e),
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// Resolves `peer` (agent name or logical id) to a loaded peer's name and
/// its discovery record, if any.
fn resolve_peer(
    s: &ServiceState,
    peer: &str,
) -> Result<(String, Option<AgentRecord>), (StatusCode, String)> {
    let loaded = s.agent.peers();
    let records = s.discovery.as_ref().map(|d| d.peers()).unwrap_or_default();
    let is_loaded = |name: &str| loaded.iter().any(|(n, _)| n == name);
    if is_loaded(peer) {
        let rec = records.into_iter().find(|r| r.name == peer);
        return Ok((peer.to_string(), rec));
    }
    let newest = records
        .into_iter()
        .filter(|r| r.logical_id == peer && is_loaded(&r.name))
        .reduce(|a, b| if b.newer_than(&a) { b } else { a });
    match newest {
        Some(r) => Ok((r.name.clone(), Some(r))),
        None => Err((
            StatusCode::NOT_FOUND,
            format!(
                "peer {peer:?} is not loaded (by agent name or logical id); loaded: [{}]",
                loaded
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

fn transfer_blocking(
    s: &ServiceState,
    req: TransferRequest,
) -> Result<TransferResponse, (StatusCode, String)> {
    let bad = |m: String| (StatusCode::BAD_REQUEST, m);
    if s.is_shutting_down() {
        return Err((
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting down: no new transfers".into(),
        ));
    }
    let bounce = match req.path.as_str() {
        "bounce" => true,
        "standard" => false,
        other => {
            return Err(bad(format!(
                "path: expected bounce or standard, got {other:?}"
            )))
        }
    };
    let (peer, record) = resolve_peer(s, &req.peer)?;
    for (k, d) in req.descriptors.iter().enumerate() {
        if !s
            .regions
            .iter()
            .any(|r| r.writable && r.contains(d.src, d.len))
        {
            return Err(bad(format!(
                "descriptor {k}: source [{:#x}, {:#x}) is not inside this agent's writable pool",
                d.src,
                d.src.saturating_add(d.len)
            )));
        }
        if let Some(rec) = record.as_ref().filter(|r| !r.buffers.is_empty()) {
            let inside = rec.buffers.iter().any(|b| {
                d.dst >= b.addr
                    && d.dst
                        .checked_add(d.len)
                        .is_some_and(|end| end <= b.addr.saturating_add(b.len))
            });
            if !inside {
                return Err(bad(format!(
                    "descriptor {k}: destination [{:#x}, {:#x}) is not inside a buffer {peer} published",
                    d.dst,
                    d.dst.saturating_add(d.len)
                )));
            }
        }
    }
    if bounce {
        if s.agent.transport().is_none() {
            return Err((
                StatusCode::CONFLICT,
                format!(
                    "bounce is not running on this agent: {}",
                    s.agent
                        .bounce_unavailable()
                        .as_deref()
                        .unwrap_or("disabled")
                ),
            ));
        }
        if let Some((_, st)) = s.agent.peers().into_iter().find(|(n, _)| *n == peer) {
            if let Err(why) = &st.bounce {
                return Err((
                    StatusCode::CONFLICT,
                    format!(
                        "peer {peer} is not bounce-compatible: {}",
                        describe_incompatibility(why)
                    ),
                ));
            }
        }
    }
    let descs: Vec<Descriptor> = req
        .descriptors
        .iter()
        .map(|d| Descriptor::new(d.src, d.dst, d.len))
        .collect();
    for (k, d) in descs.iter().enumerate() {
        // SAFETY: `src` lies inside a writable VerifyRegion (checked
        // above), whose constructor's contract makes it ours to write.
        unsafe { fill_fast(d.src, d.len, req.seed, k as u64) };
    }
    let bytes: u64 = descs.iter().map(|d| d.len).sum();
    let n = descs.len();
    let t0 = std::time::Instant::now();
    let handle = if bounce {
        let stats = s.agent.stats();
        stats.submit_bounce.fetch_add(1, Ordering::Relaxed);
        stats.bytes_bounce.fetch_add(bytes, Ordering::Relaxed);
        s.agent
            .transport()
            .expect("checked above")
            .submit(&peer, descs)
    } else {
        s.agent.submit_standard(&peer, descs)
    };
    let request_id = handle.request_id;
    let outcome = handle.wait(TRANSFER_WAIT);
    let elapsed = t0.elapsed();
    let latency_ms = elapsed.as_secs_f64() * 1e3;
    if outcome.is_some() {
        s.metrics.observe_transfer(
            s.agent.name(),
            if bounce {
                PathKind::Bounce
            } else {
                PathKind::Standard
            },
            outcome == Some(TransferOutcome::Success),
            elapsed,
        );
    }
    let (outcome, error) = match outcome {
        Some(TransferOutcome::Success) => ("success", None),
        Some(TransferOutcome::Failure(why)) => ("failure", Some(why)),
        None => (
            "timeout",
            Some(format!("not resolved within {TRANSFER_WAIT:?}")),
        ),
    };
    if let Some(e) = &error {
        tracing::warn!(agent = %s.agent.name(), %peer, rid = request_id, path = %req.path, outcome, error = %e, "debug transfer did not succeed");
    }
    Ok(TransferResponse {
        outcome: outcome.into(),
        error,
        peer,
        request_id,
        path: req.path,
        descriptors: n,
        bytes,
        latency_ms,
    })
}

async fn transfer(
    State(s): St,
    body: Result<Json<TransferRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return json_error(rejection_status(&e), e.body_text()),
    };
    match tokio::task::spawn_blocking(move || transfer_blocking(&s, req)).await {
        Ok(Ok(r)) => Json(r).into_response(),
        Ok(Err((code, e))) => json_error(code, e),
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// The status for a rejected JSON body: 413 when it is over the body
/// limit, 400 for anything else wrong with it (syntax, shape, type).
fn rejection_status(e: &axum::extract::rejection::JsonRejection) -> StatusCode {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        StatusCode::PAYLOAD_TOO_LARGE
    } else {
        StatusCode::BAD_REQUEST
    }
}

/// `POST /v1/debug/faults` (test-only, [`crate::runtime::faults`]): arms
/// the fault hooks; answers their state.
async fn arm_faults(
    body: Result<Json<crate::runtime::faults::FaultArm>, axum::extract::rejection::JsonRejection>,
) -> Response {
    match body {
        Ok(Json(a)) => match crate::runtime::faults::arm(a) {
            Ok(st) => Json(st).into_response(),
            Err(e) => (StatusCode::CONFLICT, e).into_response(),
        },
        Err(e) => (rejection_status(&e), e.body_text()).into_response(),
    }
}

/// The API's router over `state`: the read-only endpoints, plus
/// `/v1/debug/verify` and `/v1/debug/transfer` only when the state was
/// built with [`ServiceInit::debug_api`] (404 otherwise).
pub fn router(state: Arc<ServiceState>) -> Router {
    let mut r = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/peers", get(peers))
        .route("/v1/config", get(config))
        .route("/v1/report", get(report));
    if state.debug_api {
        r = r
            .route(
                "/v1/debug/verify",
                post(verify).layer(DefaultBodyLimit::max(VERIFY_BODY_LIMIT)),
            )
            .route(
                "/v1/debug/transfer",
                post(transfer).layer(DefaultBodyLimit::max(TRANSFER_BODY_LIMIT)),
            );
        if crate::runtime::faults::enabled() {
            r = r.route("/v1/debug/faults", post(arm_faults));
        }
    }
    r.with_state(state)
}

/// Serves the API on `listener` until `shutdown` resolves (then stops
/// accepting and finishes in-flight requests).
///
/// # Errors
/// An IO error from the listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<ServiceState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
