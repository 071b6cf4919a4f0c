//! The `KvFabric` custom resource (`kvfabric.io/v1alpha1`, namespaced,
//! short name `kvf`).
//!
//! One `KvFabric` is one fabric: one etcd key prefix
//! (`/kvfabric/<fabric>/`), the agent pods that publish under it and the
//! prefill/decode engine pods it serves. The bounce config is the agent's
//! own serde type, [`BounceConfig`], embedded as is (one schema for env,
//! YAML and CRD); its OpenAPI schema is written here ([`bounce_schema`])
//! because the core crate stays free of schema dependencies. The CRD form
//! is a subset of what the agent accepts: byte sizes are plain integers
//! (the form they serialize to), so the apiserver can check them with
//! OpenAPI and CEL rules (positive, granularity a power of two ≥ 32, max
//! chunk ≤ arena).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use kvfabric_core::config::{
    BounceConfig, ByteSize, MAX_GRANT_SIZE_WEIGHT, REGION_ALIGNMENT_BYTES, SEED_ARENA_SIZE_BYTES,
    SEED_MAX_CHUNK_SIZE_BYTES,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// API group of the CRD.
pub const GROUP: &str = "kvfabric.io";
/// Default of [`KvFabricSpec::not_ready_grace_seconds`], seconds.
pub const DEFAULT_NOT_READY_GRACE_SECONDS: u32 = 10;
/// Largest accepted [`KvFabricSpec::not_ready_grace_seconds`], seconds (1 h).
pub const MAX_NOT_READY_GRACE_SECONDS: u32 = 3600;

/// Desired state of a kvfabric fabric.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "kvfabric.io",
    version = "v1alpha1",
    kind = "KvFabric",
    plural = "kvfabrics",
    singular = "kvfabric",
    shortname = "kvf",
    namespaced,
    status = "KvFabricStatus",
    derive = "PartialEq",
    doc = "A kvfabric KV-cache fabric: agents, engine pods, bounce config and etcd prefix.",
    printcolumn = r#"{"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name": "Prefill", "type": "integer", "jsonPath": ".status.prefillReady"}"#,
    printcolumn = r#"{"name": "Decode", "type": "integer", "jsonPath": ".status.decodeReady"}"#,
    printcolumn = r#"{"name": "Agents", "type": "integer", "jsonPath": ".status.agentsReady"}"#,
    printcolumn = r#"{"name": "Invalidated", "type": "integer", "jsonPath": ".status.peersInvalidated"}"#,
    printcolumn = r#"{"name": "Config-Gen", "type": "integer", "jsonPath": ".status.configGeneration"}"#,
    printcolumn = r#"{"name": "At-Gen", "type": "integer", "jsonPath": ".status.agentsAtDesiredGeneration", "priority": 1}"#,
    printcolumn = r#"{"name": "Last-Inval-ms", "type": "integer", "jsonPath": ".status.lastInvalidationLatencyMs", "priority": 1}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct KvFabricSpec {
    /// Fabric name, i.e. the etcd key prefix `/kvfabric/<fabricName>/` the
    /// agents were started with (`--fabric`). Defaults to the resource's
    /// `metadata.name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 128),
        regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    )]
    pub fabric_name: Option<String>,
    /// Prefill engine pods of this fabric (same namespace).
    pub prefill_selector: LabelSelector,
    /// Decode engine pods of this fabric (same namespace).
    pub decode_selector: LabelSelector,
    /// Agent pods (the DaemonSet) of this fabric (same namespace). An agent
    /// belongs to exactly one fabric; two fabrics never share an agent.
    pub agent_selector: LabelSelector,
    /// The agents' bounce config (the agent's `bounce:` YAML, camelCase);
    /// missing keys take the agent's defaults. Set, the operator manages
    /// it: etcd holds it with a generation and a fingerprint, and a change
    /// rolls out to the agents in process (`rollout`). Unset, every agent
    /// runs its own mounted config and nothing is rolled out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "bounce_schema")]
    pub bounce: Option<BounceConfig>,
    /// etcd the agents and the operator use.
    pub etcd: EtcdSpec,
    /// How long a pod that was Ready may stay not Ready before its peer is
    /// invalidated, seconds (0 = at once). Default 10.
    #[serde(default = "default_grace")]
    #[schemars(range(max = 3600))]
    pub not_ready_grace_seconds: u32,
    /// How a changed bounce config rolls out to the agents.
    #[serde(default)]
    pub rollout: RolloutSpec,
}

/// Rollout strategy of a bounce config change (issue 14, item 4; see
/// `kvfabric_core::rollout`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// Agents that may be moving to the new generation at once (each
    /// drains its bounce work and rebuilds its arena in process; its pairs
    /// use the standard path meanwhile). Default 1.
    #[serde(default = "default_max_unavailable")]
    #[schemars(range(min = 1, max = 10000))]
    pub max_unavailable: u32,
}

impl Default for RolloutSpec {
    fn default() -> Self {
        Self {
            max_unavailable: default_max_unavailable(),
        }
    }
}

fn default_max_unavailable() -> u32 {
    1
}

fn default_grace() -> u32 {
    DEFAULT_NOT_READY_GRACE_SECONDS
}

/// How to reach etcd.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdSpec {
    /// Client URLs, e.g. `http://etcd.kvfabric:2379`.
    #[schemars(length(min = 1, max = 16))]
    pub endpoints: Vec<String>,
    /// Name of a Secret in the fabric's namespace holding the etcd client
    /// TLS material: `ca.crt` (the CA that signed etcd's serving
    /// certificate), `tls.crt` and `tls.key` (this client's certificate and
    /// key, PEM; the `kubernetes.io/tls` type plus `ca.crt`). Endpoints must
    /// then be `https://`. Unset: plain `http://`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_secret_ref: Option<String>,
}

/// Observed state of a fabric.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KvFabricStatus {
    /// `metadata.generation` this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Progressing`, `Degraded`, `TransportDegraded`,
    /// `Transferring` (each with its observedGeneration and reason).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Prefill engine pods Ready now.
    #[serde(default)]
    pub prefill_ready: u32,
    /// Decode engine pods Ready now.
    #[serde(default)]
    pub decode_ready: u32,
    /// Agent pods Ready now.
    #[serde(default)]
    pub agents_ready: u32,
    /// Agent pods selected (any state).
    #[serde(default)]
    pub agents_total: u32,
    /// Peers invalidated by this operator since it started leading.
    #[serde(default)]
    pub peers_invalidated: u64,
    /// Latency of the last invalidation, pod event seen → record removed
    /// from etcd, milliseconds (rounded up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_invalidation_latency_ms: Option<u64>,
    /// `namespace/name (reason)` of the last invalidated pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_invalidated: Option<String>,
    /// Generation of the desired bounce config (etcd `config/desired`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_generation: Option<u64>,
    /// Fingerprint of the desired bounce config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_fingerprint: Option<String>,
    /// Agents running the desired generation (of `agentRecords`).
    #[serde(default)]
    pub agents_at_desired_generation: u32,
    /// Agents with a live discovery record (what the rollout counts).
    #[serde(default)]
    pub agent_records: u32,
}

/// Condition types of [`KvFabricStatus::conditions`].
pub mod condition {
    /// Prefill and decode pods ready, agents at the desired config, bounce
    /// traffic flowing.
    pub const READY: &str = "Ready";
    /// A config rollout is advancing.
    pub const PROGRESSING: &str = "Progressing";
    /// The spec cannot be applied (e.g. an invalid bounce config) or etcd
    /// cannot be reached.
    pub const DEGRADED: &str = "Degraded";
    /// An agent reports TCP or software emulation for a GPU path.
    pub const TRANSPORT_DEGRADED: &str = "TransportDegraded";
    /// Bounce traffic flows between selected prefill and decode pods.
    pub const TRANSFERRING: &str = "Transferring";
}

impl KvFabric {
    /// The fabric name (etcd prefix segment): `spec.fabricName`, else
    /// `metadata.name` (empty only for an object without a name).
    pub fn fabric_name(&self) -> String {
        self.spec
            .fabric_name
            .clone()
            .or_else(|| self.metadata.name.clone())
            .unwrap_or_default()
    }
}

/// Whether `bounce` is what an earlier CRD stored for an unset
/// `spec.bounce`: the agents' defaults of that time, bounce disabled. Such
/// a value is not a request to manage the fleet's config (rolling it out
/// would switch bounce off fleet-wide on upgrade). `grantPolicy` is
/// ignored: its default was `roundRobin`, then `oldestFirst` for a few
/// commits of issue 18's ninth session, now `shortestFirst`, so any value
/// may be stored. The arena and chunk sizes may be today's defaults or the
/// seed's pair (256 MiB, 32 MiB; the defaults before issue 18's fourteenth
/// session), not a mix. Pure.
pub fn is_stored_default(bounce: &BounceConfig) -> bool {
    let today = BounceConfig::default();
    let sizes = (bounce.arena_size_bytes, bounce.max_chunk_size_bytes);
    let seed = (
        ByteSize(SEED_ARENA_SIZE_BYTES),
        ByteSize(SEED_MAX_CHUNK_SIZE_BYTES),
    );
    if sizes != (today.arena_size_bytes, today.max_chunk_size_bytes) && sizes != seed {
        return false;
    }
    let defaults = BounceConfig {
        grant_policy: bounce.grant_policy,
        arena_size_bytes: bounce.arena_size_bytes,
        max_chunk_size_bytes: bounce.max_chunk_size_bytes,
        ..today
    };
    *bounce == defaults
}

/// Powers of two from [`REGION_ALIGNMENT_BYTES`] to 2^62, as a CEL list
/// literal (Kubernetes CEL has no bit operations).
fn cel_powers_of_two() -> String {
    let first = REGION_ALIGNMENT_BYTES.trailing_zeros();
    let items: Vec<String> = (first..=62).map(|s| (1u64 << s).to_string()).collect();
    format!("[{}]", items.join(", "))
}

/// OpenAPI v3 (structural) schema of [`BounceConfig`] as the CRD accepts
/// it, with the agent's defaults and the cheap rules as CEL.
pub fn bounce_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let d = serde_json::to_value(BounceConfig::default()).unwrap_or(Value::Null);
    let def = |k: &str| d.get(k).cloned().unwrap_or(Value::Null);
    let bytes = |k: &str, desc: &str, min: u64| {
        json!({"type": "integer", "format": "int64", "minimum": min, "default": def(k),
               "description": format!("{desc}, bytes (an integer).")})
    };
    let count = |k: &str, desc: &str, min: u64| {
        json!({"type": "integer", "format": "int64", "minimum": min, "default": def(k),
               "description": desc})
    };
    let flag =
        |k: &str, desc: &str| json!({"type": "boolean", "default": def(k), "description": desc});
    let schema = json!({
        "type": "object",
        "description": "The agents' bounce config (kvfabric_core::config::BounceConfig, camelCase keys; missing keys take the defaults shown).",
        "properties": {
            "enabled": flag("enabled", "Master switch of the bounce path."),
            "arenaSizeBytes": bytes("arenaSizeBytes", "Size of the region arena", 1),
            "arenaAllocationGranularityBytes": bytes("arenaAllocationGranularityBytes", "Buddy allocator minimum block, a power of two ≥ 32", REGION_ALIGNMENT_BYTES),
            "maxChunkSizeBytes": bytes("maxChunkSizeBytes", "Per-chunk cap (≤ arenaSizeBytes)", 1),
            "maxInflightChunksPerRequest": count("maxInflightChunksPerRequest", "Per-flow in-flight regions (pipeline depth), chunks.", 1),
            "copyStreamCount": count("copyStreamCount", "Copy-kernel concurrency (ExecPool contexts).", 1),
            "scatterWorkerCount": count("scatterWorkerCount", "Scatter worker threads.", 1),
            "minDescriptorCount": count("minDescriptorCount", "Routing gate: minimum descriptors for the bounce path.", 0),
            "maxAverageDescriptorSizeBytes": bytes("maxAverageDescriptorSizeBytes", "Routing gate: maximum average descriptor length", 1),
            "requestTimeoutMs": count("requestTimeoutMs", "No-progress timeout of a request, milliseconds.", 1),
            "disableFabricMemory": flag("disableFabricMemory", "Plain cudaMalloc arena instead of MNNVL fabric memory."),
            "enableEagerGather": flag("enableEagerGather", "Gather at submit, before the GRANT."),
            "useNixlNotifications": flag("useNixlNotifications", "Control plane over NIXL notifications."),
            "useZeroCopyArguments": flag("useZeroCopyArguments", "Copy kernel reads its plan from pinned host memory."),
            "useCubCopy": flag("useCubCopy", "Accepted for schema compatibility; ignored."),
            "disableScatterRunMerging": flag("disableScatterRunMerging", "DEBUG ONLY: per-descriptor DATA plans."),
            "controlTransport": {"type": "string", "enum": ["zmq", "tcp"], "default": def("controlTransport"),
                                  "description": "Socket control transport (when not over NIXL notifications)."},
            "ioBusyPollUs": {"x-kubernetes-int-or-string": true, "default": def("ioBusyPollUs"),
                             "description": "Busy-poll window: \"auto\" or microseconds (≤ 100000).",
                             "x-kubernetes-validations": [{
                                 "rule": "type(self) == int ? (self >= 0 && self <= 100000) : self == 'auto'",
                                 "message": "ioBusyPollUs must be \"auto\" or 0..100000 microseconds"}]},
            "grantPolicy": {"type": "string", "enum": ["roundRobin", "oldestFirst", "shortestFirst"], "default": def("grantPolicy"),
                            "description": "Which flow the receiver grants a free region to next: the seed's roundRobin, oldestFirst (requests in arrival order, W each) or shortestFirst (smaller requests first, aged: arrival order for equal sizes)."},
            "uniformData": flag("uniformData", "Uniform chunks described by their blocks' destinations (DATA_UNIFORM; advertised in the handshake, used only when both agents advertise it, else the seed's DATA)."),
            "batchGathers": flag("batchGathers", "The gathers started together (a request's first chunks) go to the GPU as one submission (CUDA kernel path; sender-local)."),
            "eagerGrantOrder": flag("eagerGrantOrder", "Eager gathers staged in the order the receiver (grantPolicy) is expected to grant them, none while a granted chunk waits for staging; false: the seed's submit order (sender-local)."),
            "releaseStagingOnWrite": flag("releaseStagingOnWrite", "A chunk's staging region is freed when its write completed, not at its ACK (the seed's rule when false; sender-local)."),
            "grantSizeWeight": {"type": "integer", "format": "int64", "minimum": 1, "maximum": MAX_GRANT_SIZE_WEIGHT, "default": def("grantSizeWeight"),
                                "description": "shortestFirst only: a request ranks at the receiver's byte clock plus this many times its bytes, so a larger one is passed only by requests arriving before the clock (bytes granted) has moved this many times its size (higher favours small requests longer; 1..1024)."},
            "blockData": flag("blockData", "Uniform chunks of a block hand-off described by their blocks (the first plane's destinations and the stride between planes: DATA_BLOCKS, 8 bytes a block; advertised in the handshake, used only when both agents advertise it, else DATA_UNIFORM or the seed's DATA).")
        },
        "x-kubernetes-validations": [
            {"rule": format!("!has(self.arenaAllocationGranularityBytes) || self.arenaAllocationGranularityBytes in {}", cel_powers_of_two()),
             "message": "arenaAllocationGranularityBytes must be a power of two, at least 32",
             "fieldPath": ".arenaAllocationGranularityBytes"},
            {"rule": "!has(self.maxChunkSizeBytes) || !has(self.arenaSizeBytes) || self.maxChunkSizeBytes <= self.arenaSizeBytes",
             "message": "maxChunkSizeBytes must not exceed arenaSizeBytes",
             "fieldPath": ".maxChunkSizeBytes"},
            {"rule": "!has(self.arenaAllocationGranularityBytes) || !has(self.arenaSizeBytes) || self.arenaAllocationGranularityBytes <= self.arenaSizeBytes",
             "message": "arenaAllocationGranularityBytes must not exceed arenaSizeBytes",
             "fieldPath": ".arenaAllocationGranularityBytes"}
        ]
    });
    schemars::Schema::try_from(schema).unwrap_or_default()
}

/// The CRD as YAML, exactly as `crdgen` writes it to
/// `crds/kvfabric.io_kvfabrics.yaml`.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    use kube::CustomResourceExt;
    let body = serde_yaml::to_string(&KvFabric::crd())?;
    Ok(format!(
        "# Generated by `cargo run -p kvfabric-operator --bin crdgen`; do not edit.\n{body}"
    ))
}

/// Path of the generated CRD relative to the repository root.
pub const CRD_PATH: &str = "crds/kvfabric.io_kvfabrics.yaml";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn powers_of_two_list_starts_at_alignment() {
        let l = cel_powers_of_two();
        assert!(l.starts_with("[32, 64, "), "{l}");
        assert!(l.ends_with(&format!("{}]", 1u64 << 62)), "{l}");
    }

    #[test]
    fn stored_defaults_with_any_grant_policy_are_not_managed() {
        use kvfabric_core::scheduler::GrantPolicy;
        let mut b = BounceConfig::default();
        assert!(is_stored_default(&b));
        // What the CRD defaulted while roundRobin or oldestFirst was the
        // default.
        b.grant_policy = GrantPolicy::OldestFirst;
        assert!(is_stored_default(&b));
        b.grant_policy = GrantPolicy::RoundRobin;
        assert!(is_stored_default(&b));
        // Anything else set is a request to manage.
        b.enabled = true;
        assert!(!is_stored_default(&b));
        let b = BounceConfig {
            arena_size_bytes: kvfabric_core::config::ByteSize(32 << 20),
            ..BounceConfig::default()
        };
        assert!(!is_stored_default(&b));
    }

    /// Issue 18, fourteenth session: the arena and chunk defaults moved
    /// from the seed's 256 / 32 MiB to 512 / 64 MiB. What the earlier CRD
    /// stored for an unset `spec.bounce` is still no request to manage
    /// (else upgrading would roll out `enabled: false` fleet-wide); a mix
    /// of the two pairs was never a default and is one.
    #[test]
    fn stored_defaults_with_the_seeds_sizes_are_not_managed() {
        let old = BounceConfig {
            arena_size_bytes: ByteSize(256 << 20),
            max_chunk_size_bytes: ByteSize(32 << 20),
            ..BounceConfig::default()
        };
        assert!(is_stored_default(&old));
        assert!(is_stored_default(&BounceConfig::default()));
        for (arena, chunk) in [(256u64 << 20, 64u64 << 20), (512 << 20, 32 << 20)] {
            let mixed = BounceConfig {
                arena_size_bytes: ByteSize(arena),
                max_chunk_size_bytes: ByteSize(chunk),
                ..BounceConfig::default()
            };
            assert!(!is_stored_default(&mixed), "{arena} / {chunk}");
        }
        let enabled_old = BounceConfig {
            enabled: true,
            ..old
        };
        assert!(!is_stored_default(&enabled_old));
    }

    #[test]
    fn spec_round_trips_with_bounce_defaults() {
        let y = r#"
prefillSelector: {matchLabels: {role: prefill}}
decodeSelector: {matchLabels: {role: decode}}
agentSelector: {matchLabels: {app: kvfabric-agent}}
etcd: {endpoints: ["http://127.0.0.1:2379"]}
bounce: {enabled: true, arenaSizeBytes: 16777216}
"#;
        let s: KvFabricSpec = serde_yaml::from_str(y).expect("spec parses");
        let b = s.bounce.clone().expect("bounce set");
        assert!(b.enabled);
        assert_eq!(b.arena_size_bytes.get(), 16 << 20);
        assert_eq!(s.not_ready_grace_seconds, DEFAULT_NOT_READY_GRACE_SECONDS);
        assert!(b.validate().is_ok());
    }

    #[test]
    fn crd_has_names_columns_and_cel() {
        let y = crd_yaml().expect("crd serializes");
        for needle in [
            "group: kvfabric.io",
            "- kvf",
            "name: v1alpha1",
            "x-kubernetes-validations",
            "Invalidated",
            "status: {}",
        ] {
            assert!(y.contains(needle), "missing {needle:?}");
        }
    }
}
