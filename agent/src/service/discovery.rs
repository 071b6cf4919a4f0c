//! Peer discovery (issue "agent daemon", item 2): every agent publishes an
//! [`AgentRecord`] (its NIXL metadata, bounce handshake, buffer addresses,
//! incarnation and config generation) and watches everyone else's.
//!
//! * [`Discovery`] is the synchronous facade the daemon uses; implementations
//!   run their own threads (and tokio runtimes) so request load cannot starve
//!   them.
//! * [`EtcdDiscovery`] publishes under a lease at
//!   `/kvfabric/<fabric>/agents/<name>`, keeps it alive on its own thread,
//!   re-grants and republishes on lease loss, and watches the prefix.
//! * [`EmbeddedDiscovery`] is an in-process registry so several agents in one
//!   process find each other without etcd (the default README run).
//! * [`IncarnationTracker`] turns raw key events into peer events in which a
//!   new incarnation of a logical agent always removes the old one first
//!   (seed 004 "stale metadata after a restart").
//! * [`PeerSync`] applies peer events to a [`FabricAgent`] (`load_peer` /
//!   `forget_peer`) on its own thread.
//!
//! The NIXL agent name carries the incarnation ([`incarnation_name`]), so a
//! restarted agent is a different key and a different NIXL peer: nobody is
//! ever served from its predecessor's metadata.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::runtime::fabric::{FabricAgent, PeerDescriptor};
use kvfabric_core::text::LogSafe;

pub mod embedded;
pub mod etcd;

pub use embedded::{EmbeddedDiscovery, EmbeddedRegistry};
pub use etcd::{EtcdDiscovery, EtcdOptions, EtcdTls};

/// Version of the [`AgentRecord`] JSON schema this build writes and reads.
pub const RECORD_VERSION: u32 = 1;

/// An identifier unique to one process start of an agent (128 random bits,
/// shown as 32 lowercase hex digits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Incarnation(pub u128);

impl Incarnation {
    /// A fresh random incarnation (std's per-process random hash keys mixed
    /// with the clock, the pid and a counter; no extra dependency).
    pub fn generate() -> Self {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let half = |salt: u64| {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(nanos);
            h.write_u32(std::process::id());
            h.write_u64(seq);
            h.write_u64(salt);
            h.finish()
        };
        Self(((half(1) as u128) << 64) | half(2) as u128)
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl FromStr for Incarnation {
    type Err = RecordError;
    /// Parses 1–32 hex digits.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() || s.len() > 32 {
            return Err(RecordError::Invalid(format!(
                "incarnation {s:?}: want 1-32 hex digits"
            )));
        }
        u128::from_str_radix(s, 16)
            .map(Self)
            .map_err(|e| RecordError::Invalid(format!("incarnation {s:?}: {e}")))
    }
}

impl Serialize for Incarnation {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Incarnation {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The NIXL agent name of `logical_id`'s incarnation `inc`:
/// `<logical_id>-<32 hex digits>`. Unique per process start, so a restarted
/// agent never reuses its predecessor's name (or metadata).
pub fn incarnation_name(logical_id: &str, inc: Incarnation) -> String {
    format!("{logical_id}-{inc}")
}

/// A memory region peers need to address (e.g. one KV pool).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferRegion {
    /// What it is (`"kv"`, `"kv-layer-3"`, ...).
    pub label: String,
    /// Memory kind (`"dram"` or `"vram"`).
    pub kind: String,
    /// Device id (0 for host memory).
    #[serde(default)]
    pub device: u32,
    /// Base virtual address, in the publisher's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A serving engine attached to an agent (issue 12), as published in the
/// agent's record so peers can resolve hand-offs to it and the operator can
/// invalidate it by pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineRecord {
    /// Engine id (unique per agent among live sessions).
    pub engine_id: String,
    /// The engine pod's UID (may be empty outside Kubernetes).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod_uid: String,
    /// `prefill`, `decode` or `both`.
    pub role: String,
    /// KV geometry.
    pub layout: kvfabric_core::layout::EngineLayout,
    /// [`EngineLayout::fingerprint`](kvfabric_core::layout::EngineLayout::fingerprint).
    pub fingerprint: String,
    /// Pool base address in the publishing agent's address space (0 until
    /// a pool is registered) and its length in bytes.
    pub pool_addr: u64,
    /// Pool length in bytes (0 until registered).
    pub pool_len: u64,
    /// Pool memory kind: `dram` or `vram`.
    pub pool_kind: String,
    /// The engine session's scope on the publishing agent (≥ 1): bounce
    /// WANTs into this engine carry it, and the agent serves them only
    /// while this session is attached (wire version 2). 0 in records of
    /// older agents.
    #[serde(default)]
    pub scope: u64,
    /// The attach's incarnation (random, non-zero; the engine's
    /// `Attached.incarnation`): a Transfer naming another one is refused
    /// (the engine re-attached since its block ids were allocated). 0 in
    /// records of older agents.
    #[serde(default)]
    pub incarnation: u64,
}

/// What one agent publishes (serialized as JSON; byte blobs in base64).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRecord {
    /// Schema version ([`RECORD_VERSION`]).
    pub version: u32,
    /// NIXL agent name, incarnation included; also the discovery key's last
    /// segment (no `/`, no whitespace).
    pub name: String,
    /// Stable identity across restarts (pod or node-local agent id); two
    /// records with the same `logical_id` are incarnations of one agent.
    pub logical_id: String,
    /// This process start's incarnation.
    pub incarnation: Incarnation,
    /// Node (or pod) the agent runs on, for humans.
    #[serde(default)]
    pub node: String,
    /// Serialized NIXL metadata (`getLocalMD`), base64 in JSON.
    #[serde(with = "b64")]
    pub nixl_metadata: Vec<u8>,
    /// Encoded bounce handshake, base64 in JSON; `None` when bounce is off.
    #[serde(with = "b64_opt", default)]
    pub handshake: Option<Vec<u8>>,
    /// Buffers peers need to address.
    #[serde(default)]
    pub buffers: Vec<BufferRegion>,
    /// Base URL of the agent's HTTP API (`http://ip:port`), so clients such
    /// as the distributed `kvfabric bench` can reach it; empty when not
    /// served (or written by an older build).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub http: String,
    /// UID of the pod the agent runs in (peer identity with the
    /// incarnation; the operator tombstones it when the pod dies, and a
    /// tombstoned UID is never loaded again); empty outside Kubernetes.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod_uid: String,
    /// Role the agent was started with (`prefill`, `decode` or `both`);
    /// empty when unknown.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub role: String,
    /// Config (rollout) generation in force (0: seeded, never rolled out).
    #[serde(default)]
    pub config_generation: u64,
    /// Draining for a reconfiguration (no handshake until the next
    /// generation's; peers hold bounce-only transfers meanwhile).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
    /// Fingerprint ([`kvfabric_core::rollout::fingerprint`]) of the bounce
    /// config in force; empty from older builds.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub config_fingerprint: String,
    /// Why the last assigned config document was refused, as
    /// `generation N: reason`; empty when none was.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub config_error: String,
    /// Serving engines attached to this agent (issue 12); republished on
    /// every attach, pool registration and detach.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub engines: Vec<EngineRecord>,
    /// When this incarnation started, ms since the Unix epoch; orders
    /// incarnations of one `logical_id` (later wins, then the larger name).
    pub started_at_ms: u64,
    /// When this record was (re)published, ms since the Unix epoch.
    pub published_at_ms: u64,
}

/// Why an [`AgentRecord`] could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Not JSON, or not the record schema.
    #[error("agent record is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// Written by an incompatible schema version.
    #[error("agent record version {found} is not supported (this build reads {RECORD_VERSION})")]
    Version {
        /// The version found.
        found: u32,
    },
    /// A field is out of range.
    #[error("invalid agent record: {0}")]
    Invalid(String),
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl AgentRecord {
    /// A record for `desc` (the agent's [`FabricAgent::local_descriptor`]),
    /// stamped with `started_at_ms` = `published_at_ms` = now. `desc.name`
    /// should be [`incarnation_name`]`(logical_id, incarnation)`.
    pub fn new(desc: &PeerDescriptor, logical_id: &str, incarnation: Incarnation) -> Self {
        let now = now_ms();
        Self {
            version: RECORD_VERSION,
            name: desc.name.clone(),
            logical_id: logical_id.to_string(),
            incarnation,
            node: String::new(),
            nixl_metadata: desc.nixl_metadata.clone(),
            handshake: desc.handshake.clone(),
            buffers: Vec::new(),
            http: String::new(),
            role: String::new(),
            config_generation: 0,
            draining: desc.draining,
            config_fingerprint: String::new(),
            config_error: String::new(),
            engines: Vec::new(),
            pod_uid: String::new(),
            started_at_ms: now,
            published_at_ms: now,
        }
    }

    /// What [`FabricAgent::load_peer`] needs.
    pub fn descriptor(&self) -> PeerDescriptor {
        PeerDescriptor {
            name: self.name.clone(),
            nixl_metadata: self.nixl_metadata.clone(),
            handshake: self.handshake.clone(),
            draining: self.draining,
        }
    }

    /// [`metadata_fingerprint`](crate::runtime::fabric::metadata_fingerprint)
    /// of its NIXL metadata: the memory it names is known to this agent's
    /// NIXL only once [`FabricAgent::peer_metadata`] of its name says the same.
    pub fn metadata_fingerprint(&self) -> u64 {
        crate::runtime::fabric::metadata_fingerprint(&self.nixl_metadata)
    }

    /// Whether loading `other` would give a peer the same endpoint as
    /// loading `self` (same name, NIXL metadata, handshake and buffers);
    /// a republish that only moves `published_at_ms` needs no reload.
    pub fn same_endpoint(&self, other: &AgentRecord) -> bool {
        self.name == other.name
            && self.nixl_metadata == other.nixl_metadata
            && self.handshake == other.handshake
            && self.buffers == other.buffers
    }

    /// Checks the fields discovery relies on.
    ///
    /// # Errors
    /// [`RecordError::Version`] for another schema version;
    /// [`RecordError::Invalid`] for an empty or key-unsafe name, an empty
    /// logical id or empty NIXL metadata.
    pub fn validate(&self) -> Result<(), RecordError> {
        if self.version != RECORD_VERSION {
            return Err(RecordError::Version {
                found: self.version,
            });
        }
        validate_name(&self.name)?;
        if self.logical_id.is_empty() {
            return Err(RecordError::Invalid(format!(
                "{}: empty logical_id",
                self.name
            )));
        }
        if self.nixl_metadata.is_empty() {
            return Err(RecordError::Invalid(format!(
                "{}: empty nixl_metadata",
                self.name
            )));
        }
        Ok(())
    }

    /// JSON bytes of the record.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("an AgentRecord always serializes")
    }

    /// Parses and [validates](Self::validate) JSON bytes.
    ///
    /// # Errors
    /// [`RecordError`] when the bytes are not a valid record of this version.
    pub fn decode(bytes: &[u8]) -> Result<Self, RecordError> {
        let rec: Self = serde_json::from_slice(bytes)?;
        rec.validate()?;
        Ok(rec)
    }

    /// Whether `self` supersedes `other` as the live incarnation of their
    /// common logical id: later `started_at_ms`, ties broken by name.
    pub fn newer_than(&self, other: &AgentRecord) -> bool {
        (self.started_at_ms, &self.name) > (other.started_at_ms, &other.name)
    }
}

/// An agent name must be a single, printable key segment.
pub(crate) fn validate_name(name: &str) -> Result<(), RecordError> {
    if name.is_empty()
        || name.len() > 255
        || name
            .chars()
            .any(|c| c == '/' || c.is_whitespace() || c.is_control())
    {
        return Err(RecordError::Invalid(format!(
            "agent name {name:?}: want 1-255 printable characters without '/' or spaces"
        )));
    }
    Ok(())
}

mod b64 {
    use super::*;
    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s.as_bytes())
            .map_err(serde::de::Error::custom)
    }
}

mod b64_opt {
    use super::*;
    pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => b64::serialize(v, s),
            None => s.serialize_none(),
        }
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| {
                base64::engine::general_purpose::STANDARD
                    .decode(s.as_bytes())
                    .map_err(serde::de::Error::custom)
            })
            .transpose()
    }
}

/// A change in the set of live peers.
// The record travels by value: a handful of events per peer change, so
// boxing it would only complicate every producer and consumer.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerEvent {
    /// A peer appeared or its record changed: load it.
    Upsert(AgentRecord),
    /// A peer is gone (deleted, lease expired, or superseded by a newer
    /// incarnation): forget it.
    Removed {
        /// Its NIXL agent name.
        name: String,
    },
    /// Sent just before the `Removed` of an invalidated peer: how its end
    /// was learnt and since when it is known dead, for
    /// `kvfabric_peer_invalidation_seconds{path}` (issue 14). Not an
    /// instruction by itself: consumers act on the `Removed` that follows.
    Invalidated {
        /// Its NIXL agent name.
        name: String,
        /// How the end was learnt.
        path: InvalidationPath,
        /// When the peer is known to have ended, ms since the Unix epoch:
        /// the operator's observation of the pod event (tombstone), or — on
        /// the lease path — the earliest moment the peer can have died
        /// (deletion time − lease TTL; [`PeerSync`] raises it to the last
        /// control message heard from the peer), an upper bound on the
        /// detection latency.
        since_ms: i64,
    },
}

/// How a peer's end reached this agent (the `path` label of
/// `kvfabric_peer_invalidation_seconds`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InvalidationPath {
    /// The operator saw the pod die and tombstoned its UID.
    Operator,
    /// The record vanished without a tombstone: its lease expired (or the
    /// peer withdrew it on shutdown).
    Lease,
}

impl InvalidationPath {
    /// The metric label: `operator` or `lease`.
    pub fn label(self) -> &'static str {
        match self {
            InvalidationPath::Operator => "operator",
            InvalidationPath::Lease => "lease",
        }
    }
}

/// Milliseconds since the Unix epoch (0 before 1970).
pub(crate) fn epoch_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The state of this agent's own publication.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// Nothing published yet.
    Unpublished,
    /// Published; the lease was confirmed alive within its TTL.
    Ok,
    /// Keep-alives are failing, but the last confirmation is younger than
    /// the TTL: the lease is probably still alive (e.g. etcd restarting).
    Renewing,
    /// The store said the lease is gone (expired, revoked or data lost): a
    /// new lease is being granted and the record republished.
    Regranting,
    /// No confirmation for longer than the TTL and the store is unreachable;
    /// peers have likely forgotten us. Retrying with backoff.
    Lost,
    /// Revoked on purpose ([`Discovery::revoke`]).
    Revoked,
}

impl LeaseState {
    /// Lower-case name, for logs and `/v1` endpoints.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unpublished => "unpublished",
            Self::Ok => "ok",
            Self::Renewing => "renewing",
            Self::Regranting => "regranting",
            Self::Lost => "lost",
            Self::Revoked => "revoked",
        }
    }

    /// Numeric code for a metrics gauge: 0 unpublished, 1 ok, 2 renewing,
    /// 3 regranting, 4 lost, 5 revoked.
    pub fn code(self) -> u8 {
        match self {
            Self::Unpublished => 0,
            Self::Ok => 1,
            Self::Renewing => 2,
            Self::Regranting => 3,
            Self::Lost => 4,
            Self::Revoked => 5,
        }
    }

    pub(crate) fn from_code(c: u8) -> Self {
        match c {
            1 => Self::Ok,
            2 => Self::Renewing,
            3 => Self::Regranting,
            4 => Self::Lost,
            5 => Self::Revoked,
            _ => Self::Unpublished,
        }
    }
}

impl fmt::Display for LeaseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A discovery failure.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The store rejected or failed a request.
    #[error("discovery store: {0}")]
    Store(String),
    /// A bounded wait elapsed.
    #[error("discovery: {what} did not complete within {within:?}")]
    Timeout {
        /// The operation.
        what: &'static str,
        /// The bound.
        within: Duration,
    },
    /// The record is invalid.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// The discovery service has shut down.
    #[error("discovery is shut down")]
    Closed,
}

/// The discovery facade (synchronous; implementations own their threads).
pub trait Discovery: Send + Sync {
    /// Publishes (or replaces) this agent's record, bound to a lease where
    /// the store has leases. Kept published (renewed, re-granted after loss)
    /// until [`revoke`](Self::revoke).
    ///
    /// # Errors
    /// An invalid record; or the store could not confirm within its bound
    /// (the implementation keeps retrying in the background).
    fn publish(&self, record: AgentRecord) -> Result<(), DiscoveryError>;

    /// A new subscription: first an [`PeerEvent::Upsert`] per peer live now
    /// (this agent's own record included; consumers skip themselves), then
    /// every change, in order, with a superseded incarnation always
    /// [`PeerEvent::Removed`] before its successor's `Upsert`.
    fn events(&self) -> Receiver<PeerEvent>;

    /// Graceful withdrawal: deletes the record at once (revokes the lease) so
    /// peers forget this agent without waiting for a TTL. Publishing stops.
    ///
    /// # Errors
    /// When the store could not confirm within its bound (the lease then
    /// expires on its own after its TTL).
    fn revoke(&self) -> Result<(), DiscoveryError>;

    /// The own publication's state.
    fn lease_state(&self) -> LeaseState;

    /// The live peers as this instance sees them now (own record included).
    fn peers(&self) -> Vec<AgentRecord>;

    /// Full re-reads of the store after the first (each a lost and
    /// re-established watch); 0 for stores without a watch to lose.
    /// Pod UIDs the operator invalidated (tombstones), those known first
    /// then each new one; `None` for a store without tombstones.
    fn tombstones(&self) -> Option<Receiver<String>> {
        None
    }
    /// Whether the operator invalidated pod `uid` (a tombstone exists).
    fn is_tombstoned(&self, uid: &str) -> bool {
        let _ = uid;
        false
    }
    fn resyncs(&self) -> u64 {
        0
    }
    /// The values of this agent's rollout document
    /// (`config/agents/<logical id>`, [`kvfabric_core::rollout`]) as the
    /// store has them, the current one first, then each change; handed out
    /// once (later calls: `None`); `None` for a store without rollouts.
    fn assigned_config(&self) -> Option<Receiver<Vec<u8>>> {
        None
    }
    /// The fabric's desired rollout document as last read (`None`: none,
    /// or a store without rollouts).
    fn desired_config(&self) -> Option<Vec<u8>> {
        None
    }
    /// Waits at most `within` for the store's first full read (so the
    /// rollout documents above are known); true when it happened. Stores
    /// without one answer true at once.
    fn wait_first_read(&self, within: std::time::Duration) -> bool {
        let _ = within;
        true
    }
}

/// Turns raw per-key changes into [`PeerEvent`]s where each logical agent
/// has at most one *active* incarnation, while remembering every live record
/// of it.
///
/// * An `Upsert` whose `logical_id` has an active record with another name
///   yields `Removed(active)` then `Upsert(new)` when the new one is
///   [newer](AgentRecord::newer_than), and nothing when it is older (it is
///   kept as a live fallback).
/// * A `Removed` of the active record falls back to the newest remaining
///   live record of that logical id: `Removed(old)` then `Upsert(fallback)`.
///   So a short-lived duplicate started with the same logical id does not
///   hide the original for good (issue 11, item 3), and an ordinary restart
///   (the old record outliving its process until its lease expires) still
///   ends on the new incarnation: the old record's removal is not the active
///   one and yields nothing.
/// * A `Removed` of a name that is not live, or an `Upsert` identical to the
///   stored record, yields nothing.
///
/// Two live records with one logical id are logged at warn level when the
/// second appears.
#[derive(Debug, Default)]
pub struct IncarnationTracker {
    /// logical id → (name → record): every live record.
    by_logical: HashMap<String, BTreeMap<String, AgentRecord>>,
    /// logical id → name of the active record.
    active: HashMap<String, String>,
    /// name → logical id.
    by_name: HashMap<String, String>,
}

impl IncarnationTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one raw change; returns the peer events it implies.
    pub fn apply(&mut self, event: PeerEvent) -> Vec<PeerEvent> {
        match event {
            PeerEvent::Upsert(rec) => self.upsert(rec),
            PeerEvent::Removed { name } => self.remove(name),
            // Not a change of the record set; passed through.
            ev @ PeerEvent::Invalidated { .. } => vec![ev],
        }
    }

    fn upsert(&mut self, rec: AgentRecord) -> Vec<PeerEvent> {
        let logical = rec.logical_id.clone();
        // A record never changes its logical id under one name; if a store
        // says otherwise, treat it as a removal of the old one first.
        let mut out = Vec::new();
        if let Some(prev) = self.by_name.get(&rec.name) {
            if *prev != logical {
                out = self.remove(rec.name.clone());
            }
        }
        let live = self.by_logical.entry(logical.clone()).or_default();
        if live.get(&rec.name) == Some(&rec) {
            return out;
        }
        if !live.contains_key(&rec.name) && !live.is_empty() {
            let others: Vec<&str> = live.keys().map(String::as_str).collect();
            tracing::warn!(
                logical_id = %kvfabric_core::text::LogSafe(&logical),
                new = %kvfabric_core::text::LogSafe(&rec.name),
                live = ?others,
                "two live records share one logical id; the newest incarnation is used \
                 (an agent restart, or a second agent started with the same --logical-id)"
            );
        }
        live.insert(rec.name.clone(), rec.clone());
        self.by_name.insert(rec.name.clone(), logical.clone());
        match self.active.get(&logical).cloned() {
            None => {
                self.active.insert(logical, rec.name.clone());
                out.push(PeerEvent::Upsert(rec));
            }
            Some(cur) if cur == rec.name => out.push(PeerEvent::Upsert(rec)),
            Some(cur) => {
                let cur_rec = &live[&cur];
                if rec.newer_than(cur_rec) {
                    self.active.insert(logical, rec.name.clone());
                    out.push(PeerEvent::Removed { name: cur });
                    out.push(PeerEvent::Upsert(rec));
                }
            }
        }
        out
    }

    fn remove(&mut self, name: String) -> Vec<PeerEvent> {
        let Some(logical) = self.by_name.remove(&name) else {
            return Vec::new();
        };
        let Some(live) = self.by_logical.get_mut(&logical) else {
            return Vec::new();
        };
        live.remove(&name);
        if self.active.get(&logical) != Some(&name) {
            return Vec::new();
        }
        let mut out = vec![PeerEvent::Removed { name }];
        let fallback = live
            .values()
            .reduce(|a, b| if b.newer_than(a) { b } else { a })
            .cloned();
        match fallback {
            Some(rec) => {
                self.active.insert(logical, rec.name.clone());
                out.push(PeerEvent::Upsert(rec));
            }
            None => {
                self.active.remove(&logical);
                self.by_logical.remove(&logical);
            }
        }
        out
    }

    /// The active records (one per logical id), sorted by name.
    pub fn live(&self) -> Vec<AgentRecord> {
        let mut v: Vec<_> = self
            .active
            .iter()
            .filter_map(|(l, n)| self.by_logical.get(l).and_then(|m| m.get(n)))
            .cloned()
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }
}

/// Raw store contents + incarnation tracking + subscriber fan-out, shared by
/// both implementations.
#[derive(Default)]
pub(crate) struct Hub {
    inner: Mutex<HubInner>,
}

#[derive(Default)]
struct HubInner {
    raw: BTreeMap<String, AgentRecord>,
    /// Pod UIDs the operator invalidated: records carrying one are never
    /// loaded (issue 14, "tombstones").
    tombstones: std::collections::HashSet<String>,
    tracker: IncarnationTracker,
    subs: Vec<Sender<PeerEvent>>,
    /// Subscribers of tombstoned pod UIDs ([`Hub::subscribe_tombstones`]).
    tomb_subs: Vec<Sender<String>>,
}

impl HubInner {
    fn fan_out(&mut self, events: Vec<PeerEvent>) {
        for ev in events {
            tracing::debug!(?ev, "discovery event");
            self.subs.retain(|s| s.send(ev.clone()).is_ok());
        }
    }

    fn tombstoned(&self, rec: &AgentRecord) -> bool {
        !rec.pod_uid.is_empty() && self.tombstones.contains(&rec.pod_uid)
    }

    fn upsert(&mut self, rec: AgentRecord) {
        if self.tombstoned(&rec) {
            tracing::info!(agent = %LogSafe(&rec.name), pod_uid = %LogSafe(&rec.pod_uid), "record of an invalidated pod ignored (tombstone)");
            if self.raw.contains_key(&rec.name) {
                self.remove(&rec.name);
            }
            return;
        }
        self.raw.insert(rec.name.clone(), rec.clone());
        let out = self.tracker.apply(PeerEvent::Upsert(rec));
        self.fan_out(out);
    }

    fn remove(&mut self, name: &str) {
        self.raw.remove(name);
        let out = self.tracker.apply(PeerEvent::Removed {
            name: name.to_string(),
        });
        self.fan_out(out);
    }
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, HubInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn subscribe(&self) -> Receiver<PeerEvent> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut g = self.lock();
        for rec in g.tracker.live() {
            let _ = tx.send(PeerEvent::Upsert(rec));
        }
        g.subs.push(tx);
        rx
    }

    pub(crate) fn upsert(&self, rec: AgentRecord) {
        self.lock().upsert(rec);
    }

    /// Adds a tombstone: records of pod `uid` are removed now and never
    /// loaded again. `observed_at_ms` (the operator's observation of the
    /// pod event, from the tombstone's value) announces each removal as an
    /// [`PeerEvent::Invalidated`] on the operator path.
    pub(crate) fn add_tombstone(&self, uid: &str, observed_at_ms: Option<i64>) {
        let mut g = self.lock();
        if !g.tombstones.insert(uid.to_string()) {
            return;
        }
        g.tomb_subs.retain(|t| t.send(uid.to_string()).is_ok());
        let doomed: Vec<String> = g
            .raw
            .values()
            .filter(|r| r.pod_uid == uid)
            .map(|r| r.name.clone())
            .collect();
        for name in doomed {
            if let Some(since_ms) = observed_at_ms {
                g.fan_out(vec![PeerEvent::Invalidated {
                    name: name.clone(),
                    path: InvalidationPath::Operator,
                    since_ms,
                }]);
            }
            g.remove(&name);
        }
    }

    /// Removes record `name` that the operator removes without a
    /// tombstone (a removal note: the pod restarted, its node went
    /// NotReady), announcing it on the operator path with `since_ms` = the
    /// operator's observation of the pod event. No-op for an unknown name
    /// (the record's own DELETE, in the same revision, is then a no-op).
    pub(crate) fn remove_noted(&self, name: &str, since_ms: i64) {
        let mut g = self.lock();
        if !g.raw.contains_key(name) {
            return;
        }
        g.fan_out(vec![PeerEvent::Invalidated {
            name: name.to_string(),
            path: InvalidationPath::Operator,
            since_ms,
        }]);
        g.remove(name);
    }

    /// Removes record `name` whose key vanished from the store without a
    /// tombstone (lease expiry or withdrawal), announcing it on the lease
    /// path with `since_ms` = the earliest moment the peer can have died.
    /// No-op for an unknown name.
    pub(crate) fn remove_expired(&self, name: &str, since_ms: i64) {
        let mut g = self.lock();
        if !g.raw.contains_key(name) {
            return;
        }
        g.fan_out(vec![PeerEvent::Invalidated {
            name: name.to_string(),
            path: InvalidationPath::Lease,
            since_ms,
        }]);
        g.remove(name);
    }

    /// Every pod UID tombstoned from now on (and those already known, sent
    /// first): engine sessions of an invalidated pod are detached.
    pub(crate) fn subscribe_tombstones(&self) -> Receiver<String> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut g = self.lock();
        for uid in &g.tombstones {
            let _ = tx.send(uid.clone());
        }
        g.tomb_subs.push(tx);
        rx
    }

    /// Whether pod `uid` is tombstoned.
    pub(crate) fn is_tombstoned(&self, uid: &str) -> bool {
        !uid.is_empty() && self.lock().tombstones.contains(uid)
    }

    pub(crate) fn remove(&self, name: &str) {
        self.lock().remove(name);
    }

    /// Replaces the raw contents with `snapshot` (a fresh full read of the
    /// store): keys gone are removed, new or changed ones upserted.
    pub(crate) fn resync(&self, snapshot: Vec<AgentRecord>) {
        let mut g = self.lock();
        let fresh: BTreeMap<String, AgentRecord> = snapshot
            .into_iter()
            .filter(|r| !g.tombstoned(r))
            .map(|r| (r.name.clone(), r))
            .collect();
        let gone: Vec<String> = g
            .raw
            .keys()
            .filter(|k| !fresh.contains_key(*k))
            .cloned()
            .collect();
        for name in gone {
            g.remove(&name);
        }
        for (name, rec) in fresh {
            if g.raw.get(&name) != Some(&rec) {
                g.upsert(rec);
            }
        }
    }

    pub(crate) fn live(&self) -> Vec<AgentRecord> {
        self.lock().tracker.live()
    }
}

/// What [`PeerSync`] drives: a [`FabricAgent`], or a fake in tests.
pub trait PeerSink: Send + Sync {
    /// The local NIXL agent name (events about it are skipped).
    fn local_name(&self) -> &str;
    /// Loads (or reloads) a peer.
    ///
    /// # Errors
    /// A human-readable reason when the peer cannot be loaded.
    fn load(&self, peer: &PeerDescriptor) -> Result<(), String>;
    /// Forgets a peer (idempotent).
    fn forget(&self, name: &str);
    /// When this agent last received a control message from peer `name`,
    /// ms since the Unix epoch (`None`: never, or not tracked).
    fn last_heard_ms(&self, name: &str) -> Option<i64> {
        let _ = name;
        None
    }
}

impl PeerSink for FabricAgent {
    fn local_name(&self) -> &str {
        self.name()
    }
    fn load(&self, peer: &PeerDescriptor) -> Result<(), String> {
        self.load_peer(peer).map(|_| ()).map_err(|e| e.to_string())
    }
    fn forget(&self, name: &str) {
        self.forget_peer(name)
    }
    fn last_heard_ms(&self, name: &str) -> Option<i64> {
        FabricAgent::last_heard_ms(self, name)
    }
}

/// Called with the path and the fault → forgotten latency of each
/// invalidated peer a [`PeerSync`] forgot (see [`PeerSync::spawn_observed`]).
pub type InvalidationObserver = Arc<dyn Fn(InvalidationPath, Duration) + Send + Sync>;

/// How long a [`PeerEvent::Invalidated`] waits for its `Removed` before it
/// is dropped (a removal of a peer that was never loaded sends none).
const INVALIDATION_PENDING_MAX: Duration = Duration::from_secs(10);

/// Counters of a [`PeerSync`].
#[derive(Debug, Default)]
pub struct PeerSyncStats {
    /// Peers loaded (first load of a name).
    pub loaded: AtomicU64,
    /// Peers reloaded because their endpoint changed under the same name.
    pub reloaded: AtomicU64,
    /// Peers forgotten (removed, expired or superseded).
    pub forgotten: AtomicU64,
    /// Loads that failed (each attempt, retries included).
    pub load_failed: AtomicU64,
    /// Retries of failed loads (bounded backoff, [`LOAD_RETRIES`] per record).
    pub load_retries: AtomicU64,
}

/// Applies a subscription's [`PeerEvent`]s to a [`PeerSink`] on its own
/// thread: `Upsert` → load (skipping the local agent and, when given, other
/// incarnations of the local logical id; a republish with an unchanged
/// endpoint is a no-op; a changed endpoint under the same name is forgotten
/// then reloaded; a failed load is retried with jittered exponential
/// backoff, 100 ms to 10 s (up to twice that with jitter), at most
/// [`LOAD_RETRIES`] times, and a newer
/// record or a removal cancels the retries); `Removed` → forget.
pub struct PeerSync {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<PeerSyncStats>,
    loaded: Arc<Mutex<BTreeMap<String, AgentRecord>>>,
}

/// How often the [`PeerSync`] thread checks for shutdown while idle.
const SYNC_POLL: Duration = Duration::from_millis(50);

impl PeerSync {
    /// Starts the thread. `local_logical_id` (the local agent's own logical
    /// id) makes it skip stale records of the local agent's predecessors.
    pub fn spawn<S: PeerSink + ?Sized + 'static>(
        sink: Arc<S>,
        events: Receiver<PeerEvent>,
        local_logical_id: Option<String>,
    ) -> Self {
        Self::spawn_observed(sink, events, local_logical_id, None)
    }

    /// [`PeerSync::spawn`], calling `observer(path, latency)` each time an
    /// invalidated peer ([`PeerEvent::Invalidated`]) has been forgotten:
    /// `latency` runs from its `since_ms` — on the lease path raised to the
    /// last control message this agent heard from the peer
    /// ([`PeerSink::last_heard_ms`]) — to the end of `forget`.
    pub fn spawn_observed<S: PeerSink + ?Sized + 'static>(
        sink: Arc<S>,
        events: Receiver<PeerEvent>,
        local_logical_id: Option<String>,
        observer: Option<InvalidationObserver>,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(PeerSyncStats::default());
        let loaded = Arc::new(Mutex::new(BTreeMap::new()));
        let (stop2, stats2, loaded2) = (stop.clone(), stats.clone(), loaded.clone());
        let thread = std::thread::Builder::new()
            .name("kvfabric-peersync".into())
            .spawn(move || {
                sync_loop(
                    &*sink,
                    &events,
                    local_logical_id,
                    &stop2,
                    &stats2,
                    &loaded2,
                    observer,
                )
            })
            .expect("spawning the peer-sync thread");
        Self {
            stop,
            thread: Some(thread),
            stats,
            loaded,
        }
    }

    /// Counters.
    pub fn stats(&self) -> &PeerSyncStats {
        &self.stats
    }

    /// Names of the peers currently loaded through this sync, sorted.
    pub fn loaded(&self) -> Vec<String> {
        self.loaded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    /// Stops the thread (within 50 ms plus one in-progress load).
    /// Loaded peers stay loaded. Idempotent.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for PeerSync {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Retry schedule of a failed peer load: 100 ms doubling to 10 s, plus up
/// to as much again of jitter, at most [`LOAD_RETRIES`] retries (then the peer waits for its next
/// update, as before). A transient failure (the peer's listener not up yet,
/// NIXL busy) must not leave a live peer unloaded until it republishes.
fn load_retry_schedule() -> backon::ExponentialBackoff {
    use backon::BackoffBuilder as _;
    backon::ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(10))
        .with_max_times(LOAD_RETRIES)
        .with_jitter()
        .build()
}

/// Retries of a failed peer load before giving up until its next update.
pub const LOAD_RETRIES: usize = 8;

/// A failed load waiting for its next attempt.
struct PendingLoad {
    rec: AgentRecord,
    at: std::time::Instant,
    schedule: backon::ExponentialBackoff,
}

fn sync_loop<S: PeerSink + ?Sized>(
    sink: &S,
    events: &Receiver<PeerEvent>,
    local_logical_id: Option<String>,
    stop: &AtomicBool,
    stats: &PeerSyncStats,
    loaded: &Mutex<BTreeMap<String, AgentRecord>>,
    observer: Option<InvalidationObserver>,
) {
    let me = sink.local_name().to_string();
    let mut retry: HashMap<String, PendingLoad> = HashMap::new();
    let mut invalidated: HashMap<String, (InvalidationPath, i64, std::time::Instant)> =
        HashMap::new();
    while !stop.load(Ordering::SeqCst) {
        let now = std::time::Instant::now();
        invalidated.retain(|_, (_, _, at)| now.duration_since(*at) < INVALIDATION_PENDING_MAX);
        let wait = retry
            .values()
            .map(|p| p.at.saturating_duration_since(now))
            .min()
            .map_or(SYNC_POLL, |d| d.min(SYNC_POLL));
        match events.recv_timeout(wait) {
            Ok(PeerEvent::Upsert(rec)) => {
                if rec.name == me || local_logical_id.as_deref() == Some(rec.logical_id.as_str()) {
                    continue;
                }
                // A new record supersedes any retry of the old one.
                retry.remove(&rec.name);
                if !upsert(sink, &me, stats, loaded, &rec) {
                    let mut schedule = load_retry_schedule();
                    if let Some(d) = schedule.next() {
                        retry.insert(
                            rec.name.clone(),
                            PendingLoad {
                                rec,
                                at: std::time::Instant::now() + d,
                                schedule,
                            },
                        );
                    }
                }
            }
            Ok(PeerEvent::Invalidated {
                name,
                path,
                since_ms,
            }) => {
                let since_ms = match path {
                    InvalidationPath::Lease => sink
                        .last_heard_ms(&name)
                        .map_or(since_ms, |h| h.max(since_ms)),
                    InvalidationPath::Operator => since_ms,
                };
                invalidated.insert(name, (path, since_ms, now));
            }
            Ok(PeerEvent::Removed { name }) => {
                retry.remove(&name);
                let origin = invalidated.remove(&name);
                let known = loaded
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .contains_key(&name);
                if known {
                    // Forgotten and counted before it leaves `loaded`: a
                    // reader that sees it gone sees the count too.
                    sink.forget(&name);
                    stats.forgotten.fetch_add(1, Ordering::Relaxed);
                    loaded
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&name);
                    if let (Some((path, since_ms, _)), Some(obs)) = (origin, observer.as_ref()) {
                        let ms = epoch_ms().saturating_sub(since_ms).max(0);
                        let latency = Duration::from_millis(u64::try_from(ms).unwrap_or(0));
                        obs(path, latency);
                        tracing::info!(agent = %me, peer = %name, path = path.label(), latency_ms = ms, "invalidated peer forgotten");
                    }
                    tracing::info!(agent = %me, peer = %name, "peer forgotten");
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        // Retries that are due.
        let now = std::time::Instant::now();
        let due: Vec<String> = retry
            .iter()
            .filter(|(_, p)| p.at <= now)
            .map(|(n, _)| n.clone())
            .collect();
        for name in due {
            // A load can block (bounded, 5 s): stop between retries, and let
            // newer events (a removal) come first.
            if stop.load(Ordering::SeqCst) || !events.is_empty() {
                break;
            }
            let Some(mut p) = retry.remove(&name) else {
                continue;
            };
            stats.load_retries.fetch_add(1, Ordering::Relaxed);
            if upsert(sink, &me, stats, loaded, &p.rec) {
                continue;
            }
            match p.schedule.next() {
                Some(d) => {
                    p.at = std::time::Instant::now() + d;
                    retry.insert(name, p);
                }
                None => tracing::warn!(
                    agent = %me, peer = %name, retries = LOAD_RETRIES,
                    "giving up loading peer until its record changes"
                ),
            }
        }
    }
}

/// Applies one `Upsert`: load, reload on a changed endpoint, or no-op on an
/// unchanged one. Returns false when the load failed (the peer is then not
/// loaded).
fn upsert<S: PeerSink + ?Sized>(
    sink: &S,
    me: &str,
    stats: &PeerSyncStats,
    loaded: &Mutex<BTreeMap<String, AgentRecord>>,
    rec: &AgentRecord,
) -> bool {
    let prev = loaded
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&rec.name)
        .cloned();
    let reload = match &prev {
        Some(p) if p.same_endpoint(rec) => {
            loaded
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(rec.name.clone(), rec.clone());
            return true;
        }
        Some(p) if p.name == rec.name && p.buffers == rec.buffers => {
            // The same incarnation republished new NIXL metadata (an
            // engine registered a pool on the peer, or a reconfiguration
            // rebuilt its arena) and/or a new handshake (a rollout: none
            // while it drains, then the new generation's): load it over
            // the loaded one, without forgetting the peer — its flows and
            // in-flight requests stay (the handshake is re-evaluated; an
            // incompatible one only stops new bounce work). NIXL merges
            // the new memory sections; if it refuses, forget and reload.
            match sink.load(&rec.descriptor()) {
                Ok(()) => {
                    stats.reloaded.fetch_add(1, Ordering::Relaxed);
                    loaded
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(rec.name.clone(), rec.clone());
                    tracing::debug!(agent = %me, peer = %rec.name, "peer metadata refreshed");
                    return true;
                }
                Err(e) => {
                    tracing::info!(agent = %me, peer = %rec.name, error = %e, "metadata refresh refused; reloading the peer");
                    sink.forget(&rec.name);
                    true
                }
            }
        }
        Some(_) => {
            sink.forget(&rec.name);
            true
        }
        None => false,
    };
    match sink.load(&rec.descriptor()) {
        Ok(()) => {
            tracing::info!(agent = %me, peer = %rec.name, logical = %rec.logical_id, reload, "peer loaded");
            let c = if reload {
                &stats.reloaded
            } else {
                &stats.loaded
            };
            c.fetch_add(1, Ordering::Relaxed);
            loaded
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(rec.name.clone(), rec.clone());
            true
        }
        Err(e) => {
            tracing::warn!(agent = %me, peer = %rec.name, error = %e, "loading peer failed");
            stats.load_failed.fetch_add(1, Ordering::Relaxed);
            if loaded
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&rec.name)
                .is_some()
            {
                stats.forgotten.fetch_add(1, Ordering::Relaxed);
            }
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(name: &str, logical: &str, started: u64) -> AgentRecord {
        AgentRecord {
            version: RECORD_VERSION,
            name: name.into(),
            logical_id: logical.into(),
            incarnation: Incarnation(started as u128),
            node: "n".into(),
            nixl_metadata: vec![1, 2, 3],
            handshake: Some(vec![9]),
            buffers: vec![BufferRegion {
                label: "kv".into(),
                kind: "dram".into(),
                device: 0,
                addr: 0x1000,
                len: 4096,
            }],
            http: String::new(),
            role: String::new(),
            config_generation: 7,
            draining: false,
            config_fingerprint: String::new(),
            config_error: String::new(),
            engines: Vec::new(),
            pod_uid: String::new(),
            started_at_ms: started,
            published_at_ms: started,
        }
    }

    #[test]
    fn record_round_trips_and_rejects_garbage() {
        let r = rec("a-1", "a", 5);
        let bytes = r.encode();
        assert_eq!(AgentRecord::decode(&bytes).unwrap(), r);
        assert!(matches!(
            AgentRecord::decode(b"{"),
            Err(RecordError::Json(_))
        ));
        let mut v = r.clone();
        v.version = 99;
        assert!(matches!(
            AgentRecord::decode(&v.encode()),
            Err(RecordError::Version { found: 99 })
        ));
        let mut bad = r.clone();
        bad.name = "a/b".into();
        assert!(matches!(
            AgentRecord::decode(&bad.encode()),
            Err(RecordError::Invalid(_))
        ));
        let mut no_hs = r;
        no_hs.handshake = None;
        assert_eq!(AgentRecord::decode(&no_hs.encode()).unwrap(), no_hs);
    }

    #[test]
    fn incarnations_are_unique_and_parse() {
        let a = Incarnation::generate();
        let b = Incarnation::generate();
        assert_ne!(a, b);
        assert_eq!(a.to_string().len(), 32);
        assert_eq!(a.to_string().parse::<Incarnation>().unwrap(), a);
        assert!("xyz".parse::<Incarnation>().is_err());
        assert_eq!(
            incarnation_name("p", Incarnation(255)),
            format!("p-{:032x}", 255)
        );
    }

    #[test]
    fn tracker_replaces_old_incarnation_first() {
        let mut t = IncarnationTracker::new();
        let old = rec("d-1", "d", 10);
        let new = rec("d-2", "d", 20);
        assert_eq!(
            t.apply(PeerEvent::Upsert(old.clone())),
            vec![PeerEvent::Upsert(old.clone())]
        );
        assert_eq!(t.apply(PeerEvent::Upsert(old.clone())), vec![]);
        assert_eq!(
            t.apply(PeerEvent::Upsert(new.clone())),
            vec![
                PeerEvent::Removed { name: "d-1".into() },
                PeerEvent::Upsert(new.clone())
            ]
        );
        // The old key expiring later, or a stale update of it: nothing.
        assert_eq!(t.apply(PeerEvent::Upsert(old)), vec![]);
        assert_eq!(t.apply(PeerEvent::Removed { name: "d-1".into() }), vec![]);
        assert_eq!(t.live(), vec![new]);
        assert_eq!(
            t.apply(PeerEvent::Removed { name: "d-2".into() }),
            vec![PeerEvent::Removed { name: "d-2".into() }]
        );
        assert!(t.live().is_empty());
    }

    /// Issue 11 item 3: a short-lived second agent with the same logical id
    /// must not hide the live original once it is gone.
    #[test]
    fn tracker_falls_back_to_the_remaining_live_incarnation() {
        let mut t = IncarnationTracker::new();
        let orig = rec("p-1", "p", 10);
        let dup = rec("p-2", "p", 20);
        t.apply(PeerEvent::Upsert(orig.clone()));
        assert_eq!(
            t.apply(PeerEvent::Upsert(dup.clone())),
            vec![
                PeerEvent::Removed { name: "p-1".into() },
                PeerEvent::Upsert(dup.clone())
            ],
            "the newest live incarnation wins"
        );
        assert_eq!(t.live(), vec![dup]);
        // The original keeps renewing its record: still the fallback only.
        let mut orig2 = orig.clone();
        orig2.published_at_ms = 77;
        assert_eq!(t.apply(PeerEvent::Upsert(orig2.clone())), vec![]);
        // The duplicate exits: back to the original, which is still live.
        assert_eq!(
            t.apply(PeerEvent::Removed { name: "p-2".into() }),
            vec![
                PeerEvent::Removed { name: "p-2".into() },
                PeerEvent::Upsert(orig2.clone())
            ]
        );
        assert_eq!(t.live(), vec![orig2]);
        // Three live records: removal of the active one falls back to the
        // newest of the rest, not the oldest.
        let mut t = IncarnationTracker::new();
        for (n, at) in [("q-1", 1), ("q-3", 3), ("q-2", 2)] {
            t.apply(PeerEvent::Upsert(rec(n, "q", at)));
        }
        assert_eq!(t.live(), vec![rec("q-3", "q", 3)]);
        assert_eq!(
            t.apply(PeerEvent::Removed { name: "q-3".into() }),
            vec![
                PeerEvent::Removed { name: "q-3".into() },
                PeerEvent::Upsert(rec("q-2", "q", 2))
            ]
        );
        assert_eq!(t.apply(PeerEvent::Removed { name: "q-1".into() }), vec![]);
        assert_eq!(
            t.apply(PeerEvent::Removed { name: "q-2".into() }),
            vec![PeerEvent::Removed { name: "q-2".into() }]
        );
        assert!(t.live().is_empty());
    }

    #[test]
    fn hub_resync_diffs() {
        let hub = Hub::default();
        hub.upsert(rec("a-1", "a", 1));
        hub.upsert(rec("b-1", "b", 1));
        let rx = hub.subscribe();
        assert_eq!(rx.try_iter().count(), 2);
        let mut b2 = rec("b-1", "b", 1);
        b2.published_at_ms = 99;
        hub.resync(vec![b2.clone(), rec("c-1", "c", 1)]);
        let evs: Vec<_> = rx.try_iter().collect();
        assert_eq!(
            evs,
            vec![
                PeerEvent::Removed { name: "a-1".into() },
                PeerEvent::Upsert(b2),
                PeerEvent::Upsert(rec("c-1", "c", 1)),
            ]
        );
    }

    struct FakeSink {
        log: Mutex<Vec<String>>,
        /// Loads that fail before one succeeds (u64::MAX: all fail).
        fail_first: AtomicU64,
    }
    impl FakeSink {
        fn new(fail_first: u64) -> Arc<Self> {
            Arc::new(Self {
                log: Mutex::new(Vec::new()),
                fail_first: AtomicU64::new(fail_first),
            })
        }
        fn loads(&self) -> usize {
            self.log
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.starts_with("load"))
                .count()
        }
    }
    impl PeerSink for FakeSink {
        fn local_name(&self) -> &str {
            "me-1"
        }
        fn load(&self, peer: &PeerDescriptor) -> Result<(), String> {
            self.log.lock().unwrap().push(format!("load {}", peer.name));
            let left = self.fail_first.load(Ordering::SeqCst);
            if left > 0 {
                if left != u64::MAX {
                    self.fail_first.store(left - 1, Ordering::SeqCst);
                }
                return Err("listener not up yet".into());
            }
            Ok(())
        }
        fn forget(&self, name: &str) {
            self.log.lock().unwrap().push(format!("forget {name}"));
        }
    }

    #[test]
    fn peer_sync_applies_events() {
        let sink = FakeSink::new(0);
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut sync = PeerSync::spawn(sink.clone(), rx, Some("me".into()));
        tx.send(PeerEvent::Upsert(rec("me-1", "me", 1))).unwrap();
        tx.send(PeerEvent::Upsert(rec("me-0", "me", 0))).unwrap();
        tx.send(PeerEvent::Upsert(rec("p-1", "p", 1))).unwrap();
        let mut same = rec("p-1", "p", 1);
        same.published_at_ms = 50;
        tx.send(PeerEvent::Upsert(same)).unwrap();
        // Only the NIXL metadata grew (an engine registered a pool on the
        // peer): loaded over the loaded one, not forgotten.
        let mut changed = rec("p-1", "p", 1);
        changed.nixl_metadata = vec![4];
        tx.send(PeerEvent::Upsert(changed.clone())).unwrap();
        // A new handshake of the same incarnation (a rollout): loaded over
        // too, its flows kept.
        changed.handshake = Some(vec![8]);
        tx.send(PeerEvent::Upsert(changed.clone())).unwrap();
        // New buffers: forgotten, then loaded afresh.
        changed.buffers[0].len *= 2;
        tx.send(PeerEvent::Upsert(changed)).unwrap();
        tx.send(PeerEvent::Removed { name: "p-1".into() }).unwrap();
        tx.send(PeerEvent::Removed { name: "zz".into() }).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while sync.stats().forgotten.load(Ordering::SeqCst) < 1 {
            assert!(std::time::Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(2));
        }
        sync.stop();
        assert_eq!(
            *sink.log.lock().unwrap(),
            vec![
                "load p-1",
                "load p-1",
                "load p-1",
                "forget p-1",
                "load p-1",
                "forget p-1"
            ]
        );
        assert_eq!(sync.stats().reloaded.load(Ordering::SeqCst), 3);
        assert!(sync.loaded().is_empty());
    }

    #[test]
    fn failed_load_is_retried_until_it_succeeds() {
        let sink = FakeSink::new(2);
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut sync = PeerSync::spawn(sink.clone(), rx, None);
        tx.send(PeerEvent::Upsert(rec("p-1", "p", 1))).unwrap();
        // Two failures, then the retries (≈100 ms, ≈200 ms, jittered) load it.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while sync.stats().loaded.load(Ordering::SeqCst) < 1 {
            assert!(std::time::Instant::now() < deadline, "never loaded");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(sink.loads(), 3);
        assert_eq!(sync.stats().load_failed.load(Ordering::SeqCst), 2);
        assert_eq!(sync.stats().load_retries.load(Ordering::SeqCst), 2);
        assert_eq!(sync.loaded(), vec!["p-1".to_string()]);
        // Loaded: no further attempts.
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(sink.loads(), 3);
        sync.stop();
    }

    #[test]
    fn removal_cancels_the_retries_of_a_failing_peer() {
        let sink = FakeSink::new(u64::MAX);
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut sync = PeerSync::spawn(sink.clone(), rx, None);
        tx.send(PeerEvent::Upsert(rec("p-1", "p", 1))).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while sync.stats().load_retries.load(Ordering::SeqCst) < 1 {
            assert!(std::time::Instant::now() < deadline, "no retry");
            std::thread::sleep(Duration::from_millis(5));
        }
        tx.send(PeerEvent::Removed { name: "p-1".into() }).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let n = sink.loads();
        // The next retries would have come within ≈1.5 s.
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(sink.loads(), n, "retried after removal");
        assert!(sync.loaded().is_empty());
        sync.stop();
    }
}
