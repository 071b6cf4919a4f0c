//! The `kvfabric agent` daemon (issue "agent daemon", items 1 and 4).
//!
//! * [`AgentConfig`] — one schema for YAML, environment and flags, the
//!   core's [`BounceConfig`] inside it (`bounce:`). Layering: defaults →
//!   YAML file → `KVFABRIC_*` environment → command-line flags
//!   ([`AgentConfig::load`]).
//! * [`Node`] — the services around one [`FabricAgent`]: metrics, the
//!   published [`AgentRecord`] (pool buffer included), [`PeerSync`] (peers
//!   loaded / forgotten from discovery events), the HTTP state, and the
//!   graceful shutdown sequence ([`Node::shutdown`]).
//! * [`run`] — the daemon: KV pool + arena registered at start-up (never on
//!   the request path), the NIXL agent named
//!   [`incarnation_name`]`(logical_id, Incarnation::generate())` so a restart
//!   is never served from stale metadata, discovery (etcd when endpoints are
//!   given, else an in-process registry), the HTTP API, and SIGTERM/SIGINT →
//!   readyz 503, in-flight transfers resolved within a bound, lease revoked,
//!   exit 0.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::discovery::{
    incarnation_name, validate_name, AgentRecord, BufferRegion, Discovery, EmbeddedRegistry,
    EngineRecord, EtcdDiscovery, EtcdOptions, EtcdTls, Incarnation, PeerSync,
};
use super::http::{ServiceInit, ServiceState, VerifyRegion};
use super::metrics::AgentMetrics;
use crate::core::config::{
    is_config_env, parse_byte_size, BounceConfig, ByteSize, ConfigWarning, EXPECTED_BYTE_SIZE,
};
use crate::runtime::arena::HostArena;
use crate::runtime::control::auth::{AuthMode, ControlAuth};
use crate::runtime::control::zmq::BindAddr;
use crate::runtime::engine::{MemDesc, MemKind};
use crate::runtime::fabric::{FabricAgent, FabricOptions};

/// Prefix of the daemon's own environment variables (`KVFABRIC_BOUNCE_*`
/// belong to [`BounceConfig`]).
pub const AGENT_ENV_PREFIX: &str = "KVFABRIC_";

/// Log output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (default).
    #[default]
    Text,
    /// One JSON object per event.
    Json,
}

/// The daemon's configuration: one schema for YAML (camelCase keys,
/// unknown keys rejected), `KVFABRIC_*` environment variables and flags.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct AgentConfig {
    /// HTTP listen address (`host:port`; port 0 = ephemeral). Default
    /// `0.0.0.0:9400`. Env `KVFABRIC_LISTEN`, flag `--listen`.
    pub listen: String,
    /// Fabric name: the discovery key prefix is `/kvfabric/<fabric>/agents/`.
    /// Default `default`. Env `KVFABRIC_FABRIC`, flag `--fabric`.
    pub fabric: String,
    /// Stable identity across restarts. Empty = `$POD_NAME`, else
    /// `$HOSTNAME`, else the host name. Env `KVFABRIC_LOGICAL_ID`, flag
    /// `--logical-id`.
    pub logical_id: String,
    /// UID of the pod the agent runs in (the chart sets it from the
    /// downward API): published in the record; the operator tombstones it
    /// when the pod dies, after which peers never load this incarnation
    /// again and the agent stops republishing. Empty (default) outside
    /// Kubernetes. Env `KVFABRIC_POD_UID`, flag `--pod-uid`.
    pub pod_uid: String,
    /// Role of this agent: `prefill`, `decode` or `both` (default).
    /// Env `KVFABRIC_ROLE`, flag `--role`.
    pub role: String,
    /// KV pool size, bytes (suffixes accepted). Registered once at start.
    /// Default 1 GiB. Env `KVFABRIC_POOL_SIZE_BYTES`, flag `--pool-size`.
    pub pool_size_bytes: ByteSize,
    /// etcd client URLs; empty = embedded (in-process) discovery.
    /// Env `KVFABRIC_ETCD_ENDPOINTS` (comma-separated), flag `--etcd`.
    pub etcd_endpoints: Vec<String>,
    /// Discovery lease TTL, seconds (≥ 1). Default 10.
    /// Env `KVFABRIC_LEASE_TTL_SECONDS`, flag `--lease-ttl`.
    pub lease_ttl_seconds: u64,
    /// Where the ZMQ control channel binds: `routable` (default), `loopback`,
    /// `interface:<nic>` or an IP address. Env `KVFABRIC_CONTROL_BIND`,
    /// flag `--control-bind`.
    pub control_bind: String,
    /// Bound on resolving in-flight transfers at shutdown, milliseconds.
    /// Default 10000. Env `KVFABRIC_SHUTDOWN_TIMEOUT_MS`.
    pub shutdown_timeout_ms: u64,
    /// Log format. Env `KVFABRIC_LOG_FORMAT`, flag `--log-format`
    /// (the filter is `KVFABRIC_LOG`, default `info`).
    pub log_format: LogFormat,
    /// CUDA device ordinal whose memory holds the bounce arena and the
    /// engines' pools (engines attach CUDA IPC handles of that GPU); unset
    /// (default) = host memory. Needs a build with the `cuda` feature.
    /// Env `KVFABRIC_GPU`, flag `--gpu`.
    pub gpu: Option<u32>,
    /// Unix socket of the engines' local API (gRPC; mode 0660; parent
    /// directories created). Empty (default) = not served. The chart sets
    /// `/run/kvfabric/engine.sock` on a hostPath the engine pods mount
    /// (`/run/kvfabric/{gpu_uuid}.sock` with one agent per GPU:
    /// `{gpu_uuid}` becomes the agent's GPU's UUID, GPU agents only).
    /// Env `KVFABRIC_ENGINE_SOCKET`, flag `--engine-socket`.
    pub engine_socket: String,
    /// Serve `POST /v1/debug/transfer` and `/v1/debug/verify` (fill and
    /// write this agent's KV pool on request; check a peer's). Default off;
    /// only allowed on a loopback `listen` address, since the endpoints are
    /// unauthenticated and can overwrite any part of a peer's KV pool.
    /// Env `KVFABRIC_DEBUG_API`, flag `--debug-api`.
    pub debug_api: bool,
    /// Refuse a GPU engine whose layout names no GPU UUID
    /// (`layout.device_uuid`) instead of matching it by ordinal: set where
    /// a node runs one agent per GPU (the chart does, with
    /// `agent.gpu.count` > 1), since an engine pod's ordinals are its own
    /// (device 0 for a pod with one GPU) and would match the wrong agent.
    /// GPU agents only. Env `KVFABRIC_REQUIRE_DEVICE_UUID`, flag
    /// `--require-device-uuid`.
    pub require_device_uuid: bool,
    /// OTLP/gRPC endpoint for traces of engine hand-offs
    /// (`http://collector:4317`; plain HTTP/2, no TLS in this build);
    /// empty (default) = no tracing pipeline.
    /// Env `KVFABRIC_OTLP_ENDPOINT`, flag `--otlp-endpoint`.
    pub otlp_endpoint: String,
    /// etcd client TLS: PEM file of the CA that signed etcd's serving
    /// certificate. With `etcdCertFile` and `etcdKeyFile` (all three or
    /// none) the agent speaks TLS with a client certificate, and every
    /// endpoint must be `https://`. Empty (default) = plain HTTP.
    /// Env `KVFABRIC_ETCD_CA_FILE`, flag `--etcd-ca-file`.
    pub etcd_ca_file: String,
    /// etcd client certificate (PEM). Env `KVFABRIC_ETCD_CERT_FILE`, flag
    /// `--etcd-cert-file`.
    pub etcd_cert_file: String,
    /// Its private key (PEM). Env `KVFABRIC_ETCD_KEY_FILE`, flag
    /// `--etcd-key-file`.
    pub etcd_key_file: String,
    /// File holding the fabric's control key (at least 32 bytes; trailing
    /// newlines ignored; the chart makes one in a Secret): the TCP control
    /// channel's hellos are signed with it, proving that a connection
    /// speaks for the agent it names (`controlTransport: tcp` only; see
    /// [`crate::runtime::control::auth`]). Empty (default) = names are not
    /// authenticated. Read at start-up. Env `KVFABRIC_CONTROL_KEY_FILE`,
    /// flag `--control-key-file`.
    pub control_key_file: String,
    /// `off`, `optional` (sign, check signed hellos, still take plain ones:
    /// the rollout step) or `required`; empty (default) = `required` with a
    /// `controlKeyFile`, else `off`. Env `KVFABRIC_CONTROL_AUTH`, flag
    /// `--control-auth`.
    pub control_auth: String,
    /// Fraction of hand-offs traced when the engine sends no sampled
    /// parent (`ParentBased(TraceIdRatioBased)`), 0 to 1. Default 0.01.
    /// Env `KVFABRIC_TRACE_SAMPLE_RATIO`, flag `--trace-sample-ratio`.
    pub trace_sample_ratio: SampleRatio,
    /// The bounce engine's configuration (core schema; env
    /// `KVFABRIC_BOUNCE_*`).
    pub bounce: BounceConfig,
    /// Environment problems that did not stop start-up (kept byte sizes,
    /// unknown or deprecated names), set by [`AgentConfig::load`]; logged
    /// at error level at start and served in `/v1/config` as `warnings`.
    #[serde(skip)]
    pub env_warnings: Vec<String>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:9400".into(),
            fabric: "default".into(),
            logical_id: String::new(),
            role: "both".into(),
            pod_uid: String::new(),
            pool_size_bytes: ByteSize(1 << 30),
            etcd_endpoints: Vec::new(),
            lease_ttl_seconds: 10,
            control_bind: "routable".into(),
            shutdown_timeout_ms: 10_000,
            log_format: LogFormat::Text,
            gpu: None,
            engine_socket: String::new(),
            debug_api: false,
            require_device_uuid: false,
            otlp_endpoint: String::new(),
            etcd_ca_file: String::new(),
            etcd_cert_file: String::new(),
            etcd_key_file: String::new(),
            control_key_file: String::new(),
            control_auth: String::new(),
            trace_sample_ratio: SampleRatio(super::traces::DEFAULT_SAMPLE_RATIO),
            bounce: BounceConfig::default(),
            env_warnings: Vec::new(),
        }
    }
}

/// A sampling ratio in [0, 1] (`traceSampleRatio`); compared by its bits
/// so the config stays `Eq`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SampleRatio(pub f64);

impl PartialEq for SampleRatio {
    fn eq(&self, o: &Self) -> bool {
        self.0.to_bits() == o.0.to_bits()
    }
}

impl Eq for SampleRatio {}

/// Largest accepted discovery lease TTL: 3600 s (a dead agent stays a
/// peer for at most this long without the operator's help).
pub const MAX_LEASE_TTL_SECONDS: u64 = 3600;

/// What [`AgentConfig::apply_env_vars`] found wrong in the environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EnvReport {
    /// Values that do not parse: start-up fails, each names its variable
    /// and the accepted forms.
    pub errors: Vec<String>,
    /// Kept-previous-value byte sizes (seed §10), unknown
    /// `KVFABRIC_BOUNCE_*` names and deprecated names: the daemon logs them
    /// at error level and serves them in `/v1/config`.
    pub warnings: Vec<String>,
}

/// Command-line overrides (`None` = not given); they win over YAML and env.
#[derive(Clone, Debug, Default)]
pub struct AgentOverrides {
    /// `--listen`.
    pub listen: Option<String>,
    /// `--fabric`.
    pub fabric: Option<String>,
    /// `--logical-id`.
    pub logical_id: Option<String>,
    /// `--role`.
    pub role: Option<String>,
    /// `--pool-size` (bytes).
    pub pool_size_bytes: Option<u64>,
    /// `--etcd` (may be given several times / comma-separated).
    pub etcd_endpoints: Option<Vec<String>>,
    /// `--lease-ttl` (seconds).
    pub lease_ttl_seconds: Option<u64>,
    /// `--control-bind`.
    pub control_bind: Option<String>,
    /// `--log-format`.
    pub log_format: Option<LogFormat>,
    /// `--debug-api` (`Some(true)` when given).
    pub debug_api: Option<bool>,
    /// `--require-device-uuid` (`Some(true)` when given).
    pub require_device_uuid: Option<bool>,
    /// `--engine-socket`.
    pub engine_socket: Option<String>,
    /// `--gpu`.
    pub gpu: Option<u32>,
    /// `--pod-uid`.
    pub pod_uid: Option<String>,
    /// `--otlp-endpoint`.
    pub otlp_endpoint: Option<String>,
    /// `--etcd-ca-file`.
    pub etcd_ca_file: Option<String>,
    /// `--etcd-cert-file`.
    pub etcd_cert_file: Option<String>,
    /// `--etcd-key-file`.
    pub etcd_key_file: Option<String>,
    /// `--control-key-file`.
    pub control_key_file: Option<String>,
    /// `--control-auth`.
    pub control_auth: Option<String>,
    /// `--trace-sample-ratio`.
    pub trace_sample_ratio: Option<f64>,
}

fn split_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

impl AgentConfig {
    /// Parses a YAML document (empty or `null` = defaults).
    ///
    /// # Errors
    /// A message naming the offending key (serde_yaml's, with line/column).
    pub fn from_yaml_str(yaml: &str) -> Result<Self, String> {
        let v: serde_yaml::Value = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
        if v.is_null() {
            return Ok(Self::default());
        }
        serde_yaml::from_str(yaml).map_err(|e| e.to_string())
    }

    /// Applies `KVFABRIC_*` variables from `vars` (pure): the daemon's own
    /// (`KVFABRIC_LISTEN`, `_FABRIC`, `_LOGICAL_ID`, `_ROLE`,
    /// `_POOL_SIZE_BYTES`, `_ETCD_ENDPOINTS`, `_LEASE_TTL_SECONDS`,
    /// `_CONTROL_BIND`, `_SHUTDOWN_TIMEOUT_MS`, `_LOG_FORMAT`) and
    /// `KVFABRIC_BOUNCE_*` (through [`BounceConfig::apply_env_vars`]). Other
    /// `KVFABRIC_*` variables (e.g. `KVFABRIC_LOG`) are left alone.
    ///
    /// An unparsable value is an [`EnvReport::errors`] entry naming the
    /// variable and the accepted forms — a daemon must not start on a
    /// setting it silently replaced (issue 11, item 6) — except for the
    /// bounce byte sizes, which the seed (§10) keeps at their previous value
    /// with a diagnostic: those, unknown `KVFABRIC_BOUNCE_*` names and
    /// deprecated names are [`EnvReport::warnings`].
    pub fn apply_env_vars<I, K, V>(&mut self, vars: I) -> EnvReport
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut report = EnvReport::default();
        let mut bounce = Vec::new();
        for (k, v) in vars {
            let (k, v) = (k.as_ref(), v.as_ref().trim());
            let Some(suffix) = k.strip_prefix(AGENT_ENV_PREFIX) else {
                continue;
            };
            let mut bad = |expected: &str| {
                report
                    .errors
                    .push(format!("{k}={v:?} is invalid: expected {expected}"))
            };
            match suffix {
                "LISTEN" => self.listen = v.to_string(),
                "FABRIC" => self.fabric = v.to_string(),
                "LOGICAL_ID" => self.logical_id = v.to_string(),
                "ROLE" => self.role = v.to_string(),
                "POOL_SIZE_BYTES" => match parse_byte_size(v) {
                    Ok(n) => self.pool_size_bytes = ByteSize(n),
                    Err(_) => bad("a byte size like 1073741824 or \"1GiB\""),
                },
                "ETCD_ENDPOINTS" => self.etcd_endpoints = split_list(v),
                "LEASE_TTL_SECONDS" => match v.parse() {
                    Ok(n) => self.lease_ttl_seconds = n,
                    Err(_) => bad("a whole number of seconds"),
                },
                "CONTROL_BIND" => self.control_bind = v.to_string(),
                "ENGINE_SOCKET" => self.engine_socket = v.to_string(),
                "POD_UID" => self.pod_uid = v.to_string(),
                "OTLP_ENDPOINT" => self.otlp_endpoint = v.to_string(),
                "ETCD_CA_FILE" => self.etcd_ca_file = v.to_string(),
                "ETCD_CERT_FILE" => self.etcd_cert_file = v.to_string(),
                "ETCD_KEY_FILE" => self.etcd_key_file = v.to_string(),
                "CONTROL_KEY_FILE" => self.control_key_file = v.to_string(),
                "CONTROL_AUTH" => self.control_auth = v.to_string(),
                "TRACE_SAMPLE_RATIO" => match v.parse::<f64>() {
                    Ok(r) if (0.0..=1.0).contains(&r) => self.trace_sample_ratio = SampleRatio(r),
                    _ => bad("a ratio from 0 to 1 (0.01 = one request in a hundred)"),
                },
                "GPU" => match v.parse() {
                    Ok(n) => self.gpu = Some(n),
                    Err(_) => bad("a CUDA device ordinal (0, 1, ...)"),
                },
                "SHUTDOWN_TIMEOUT_MS" => match v.parse() {
                    Ok(n) => self.shutdown_timeout_ms = n,
                    Err(_) => bad("a whole number of milliseconds"),
                },
                "LOG_FORMAT" => match v.to_ascii_lowercase().as_str() {
                    "text" => self.log_format = LogFormat::Text,
                    "json" => self.log_format = LogFormat::Json,
                    _ => bad("text or json"),
                },
                "DEBUG_API" => match parse_switch(v) {
                    Some(on) => self.debug_api = on,
                    None => bad(SWITCH_VALUES),
                },
                "REQUIRE_DEVICE_UUID" => match parse_switch(v) {
                    Some(on) => self.require_device_uuid = on,
                    None => bad(SWITCH_VALUES),
                },
                // KVFABRIC_BOUNCE_* and the deprecated names of two of them.
                _ if is_config_env(k) => bounce.push((k.to_string(), v.to_string())),
                _ => {}
            }
        }
        for w in self.bounce.apply_env_vars(bounce) {
            match &w {
                ConfigWarning::InvalidValue { expected, .. } if *expected != EXPECTED_BYTE_SIZE => {
                    report.errors.push(w.to_string())
                }
                _ => report.warnings.push(w.to_string()),
            }
        }
        report
    }

    /// Applies command-line overrides.
    pub fn apply_overrides(&mut self, o: &AgentOverrides) {
        let o = o.clone();
        if let Some(v) = o.listen {
            self.listen = v;
        }
        if let Some(v) = o.fabric {
            self.fabric = v;
        }
        if let Some(v) = o.logical_id {
            self.logical_id = v;
        }
        if let Some(v) = o.role {
            self.role = v;
        }
        if let Some(v) = o.pool_size_bytes {
            self.pool_size_bytes = ByteSize(v);
        }
        if let Some(v) = o.etcd_endpoints {
            self.etcd_endpoints = v.iter().flat_map(|s| split_list(s)).collect();
        }
        if let Some(v) = o.lease_ttl_seconds {
            self.lease_ttl_seconds = v;
        }
        if let Some(v) = o.control_bind {
            self.control_bind = v;
        }
        if let Some(v) = o.log_format {
            self.log_format = v;
        }
        if let Some(v) = o.debug_api {
            self.debug_api = v;
        }
        if let Some(v) = o.require_device_uuid {
            self.require_device_uuid = v;
        }
        if let Some(v) = o.engine_socket {
            self.engine_socket = v;
        }
        if let Some(v) = o.gpu {
            self.gpu = Some(v);
        }
        if let Some(v) = o.pod_uid {
            self.pod_uid = v;
        }
        if let Some(v) = o.otlp_endpoint {
            self.otlp_endpoint = v;
        }
        if let Some(v) = o.etcd_ca_file.clone() {
            self.etcd_ca_file = v;
        }
        if let Some(v) = o.etcd_cert_file.clone() {
            self.etcd_cert_file = v;
        }
        if let Some(v) = o.etcd_key_file.clone() {
            self.etcd_key_file = v;
        }
        if let Some(v) = o.trace_sample_ratio {
            self.trace_sample_ratio = SampleRatio(v);
        }
        if let Some(v) = o.control_key_file.clone() {
            self.control_key_file = v;
        }
        if let Some(v) = o.control_auth.clone() {
            self.control_auth = v;
        }
    }

    /// The control key and mode from `controlKeyFile` and `controlAuth`,
    /// the key read now.
    ///
    /// # Errors
    /// A message naming the setting: an unknown mode, a mode that needs a
    /// key without one (or a key with `off`), an unreadable or short key
    /// file, a key with a control transport other than `tcp`.
    pub fn control_auth(&self) -> Result<ControlAuth, String> {
        let mode = match self.control_auth.trim() {
            "" if self.control_key_file.is_empty() => AuthMode::Off,
            "" => AuthMode::Required,
            m => AuthMode::parse(m).map_err(|e| format!("controlAuth: {e}"))?,
        };
        if mode == AuthMode::Off {
            if !self.control_key_file.is_empty() {
                return Err("controlAuth: off with a controlKeyFile: set optional or required, or drop the key".into());
            }
            return Ok(ControlAuth::off());
        }
        if self.control_key_file.is_empty() {
            return Err(format!(
                "controlAuth: {} needs controlKeyFile (a file of at least 32 bytes)",
                self.control_auth.trim()
            ));
        }
        let tcp = !self.bounce.use_nixl_notifications
            && self.bounce.control_transport == kvfabric_core::config::ControlTransport::Tcp;
        if !tcp {
            return Err(
                "controlKeyFile: the control key authenticates the TCP control channel; set bounce controlTransport: tcp (KVFABRIC_BOUNCE_CONTROL_TRANSPORT=tcp)"
                    .into(),
            );
        }
        ControlAuth::from_file(mode, std::path::Path::new(&self.control_key_file))
            .map_err(|e| format!("controlKeyFile: {e}"))
    }

    /// The full pipeline: defaults → `yaml` file (if given) → `env`
    /// (`KVFABRIC_*`) → `overrides`, then [`resolve`](Self::resolve) and
    /// [`validate`](Self::validate). Returns the config and the env
    /// warnings (kept byte sizes, unknown or deprecated names).
    ///
    /// # Errors
    /// An unreadable or invalid YAML file, any unparsable environment value
    /// ([`EnvReport::errors`], all listed), or a failed validation.
    pub fn load<I, K, V>(
        yaml: Option<&Path>,
        env: I,
        overrides: &AgentOverrides,
    ) -> Result<(Self, Vec<String>), String>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut cfg = match yaml {
            Some(p) => {
                let text =
                    std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
                Self::from_yaml_str(&text).map_err(|e| format!("{}: {e}", p.display()))?
            }
            None => Self::default(),
        };
        let report = cfg.apply_env_vars(env);
        if !report.errors.is_empty() {
            return Err(format!(
                "invalid environment:\n  {}",
                report.errors.join("\n  ")
            ));
        }
        cfg.apply_overrides(overrides);
        cfg.resolve();
        cfg.validate()?;
        cfg.env_warnings = report.warnings.clone();
        Ok((cfg, report.warnings))
    }

    /// Fills in the logical id when empty: `$POD_NAME`, else `$HOSTNAME`,
    /// else the host name, else `kvfabric-agent`.
    pub fn resolve(&mut self) {
        if self.logical_id.trim().is_empty() {
            self.logical_id = default_logical_id();
        }
    }

    /// The etcd client TLS material from `etcdCaFile`, `etcdCertFile` and
    /// `etcdKeyFile`, read now; `None` when they are unset.
    ///
    /// # Errors
    /// A message naming the setting whose file cannot be read or holds no
    /// PEM block.
    pub fn etcd_tls(&self) -> Result<Option<EtcdTls>, String> {
        if self.etcd_ca_file.is_empty() {
            return Ok(None);
        }
        let read = |what: &str, path: &str| -> Result<Vec<u8>, String> {
            let b = std::fs::read(path).map_err(|e| format!("{what} {path:?}: {e}"))?;
            if !b.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(format!("{what} {path:?}: expected a PEM file"));
            }
            Ok(b)
        };
        Ok(Some(EtcdTls {
            ca_pem: read("etcdCaFile", &self.etcd_ca_file)?,
            cert_pem: read("etcdCertFile", &self.etcd_cert_file)?,
            key_pem: read("etcdKeyFile", &self.etcd_key_file)?,
        }))
    }

    /// Checks every field; all problems are reported at once.
    ///
    /// # Errors
    /// A message listing each invalid field (camelCase) and what it expects.
    pub fn validate(&self) -> Result<(), String> {
        let mut errs = Vec::new();
        if self.listen.parse::<std::net::SocketAddr>().is_err()
            && !self
                .listen
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
        {
            errs.push(format!("listen: expected host:port, got {:?}", self.listen));
        }
        if let Err(e) = validate_name(&self.fabric) {
            errs.push(format!("fabric: {e}"));
        }
        if let Err(e) = validate_name(&self.logical_id) {
            errs.push(format!("logicalId: {e}"));
        }
        if !self.pod_uid.is_empty() {
            if let Err(e) = validate_name(&self.pod_uid) {
                errs.push(format!("podUid: {e}"));
            }
        }
        if !matches!(self.role.as_str(), "prefill" | "decode" | "both") {
            errs.push(format!(
                "role: expected prefill, decode or both, got {:?}",
                self.role
            ));
        }
        if self.pool_size_bytes.get() == 0 {
            errs.push("poolSizeBytes: expected a byte size greater than 0".into());
        }
        if !(1..=MAX_LEASE_TTL_SECONDS).contains(&self.lease_ttl_seconds) {
            errs.push(format!(
                "leaseTtlSeconds: expected 1-{MAX_LEASE_TTL_SECONDS} seconds, got {}",
                self.lease_ttl_seconds
            ));
        }
        if let Err(e) = self.bind_addr() {
            errs.push(e);
        }
        if self.gpu.is_some() && !cfg!(feature = "cuda") {
            errs.push(
                "gpu: this build has no GPU support; build with `--features cuda` \
                 (cargo build --release -p kvfabric-agent --features cuda --bin kvfabric)"
                    .into(),
            );
        }
        // The path's rules, checked with a stand-in for the GPU's UUID
        // (known only once the GPU is open).
        let stand_in = self.gpu.map(|_| "00000000-0000-0000-0000-000000000000");
        if let Err(e) = super::engines::socket_path(&self.engine_socket, stand_in) {
            errs.push(e);
        }
        if self.require_device_uuid && self.gpu.is_none() {
            errs.push(
                "requireDeviceUuid: GPU engines' UUIDs are checked by a GPU agent; set gpu \
                 (a host-memory agent serves host pools only)"
                    .into(),
            );
        }
        if self.debug_api && !listen_is_loopback(&self.listen) {
            errs.push(format!(
                "debugApi: the debug endpoints are unauthenticated and write KV memory; \
                 they need a loopback listen address (127.0.0.1:PORT or [::1]:PORT), got {:?}",
                self.listen
            ));
        }
        if !(0.0..=1.0).contains(&self.trace_sample_ratio.0) {
            errs.push(format!(
                "traceSampleRatio: expected 0 to 1, got {}",
                self.trace_sample_ratio.0
            ));
        }
        let otlp = &self.otlp_endpoint;
        if !(otlp.is_empty() || otlp.starts_with("http://")) {
            errs.push(format!(
                "otlpEndpoint: expected an http:// URL (the OTLP/gRPC port, e.g. http://collector:4317; this build has no TLS for OTLP: use a collector on the node), got {:?}",
                self.otlp_endpoint
            ));
        }
        let tls_files = [
            &self.etcd_ca_file,
            &self.etcd_cert_file,
            &self.etcd_key_file,
        ];
        let tls_set = tls_files.iter().filter(|f| !f.is_empty()).count();
        if tls_set != 0 && tls_set != 3 {
            errs.push(
                "etcdCaFile, etcdCertFile, etcdKeyFile: give all three (TLS with a client certificate) or none"
                    .into(),
            );
        }
        let tls = tls_set == 3;
        if let Some(e) = self
            .etcd_endpoints
            .iter()
            .find(|e| e.starts_with("https://") != tls)
        {
            errs.push(format!(
                "etcdEndpoints: {e:?}: {}",
                if tls {
                    "expected https:// (the etcd TLS files are set)"
                } else {
                    "https:// needs etcdCaFile, etcdCertFile and etcdKeyFile"
                }
            ));
        }
        if let Err(e) = self.bounce.validate() {
            errs.push(format!("bounce: {e}"));
        }
        if let Err(e) = self.control_auth() {
            errs.push(e);
        }
        if crate::runtime::faults::requested() && !self.debug_api {
            errs.push(format!(
                "{}: the test-only fault hooks corrupt and delay hand-offs on purpose; \
                 a production agent refuses them (they need debugApi, loopback only)",
                crate::runtime::faults::ENV
            ));
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(format!("invalid agent config: {}", errs.join("; ")))
        }
    }

    /// The control channel bind address.
    ///
    /// # Errors
    /// When `controlBind` is none of the accepted forms.
    pub fn bind_addr(&self) -> Result<BindAddr, String> {
        let v = self.control_bind.trim();
        match v {
            "routable" => Ok(BindAddr::Routable),
            "loopback" => Ok(BindAddr::Loopback),
            _ => {
                if let Some(nic) = v.strip_prefix("interface:") {
                    let bind = BindAddr::Interface(nic.to_string());
                    // Resolved here, at start-up: an interface that does
                    // not exist (or has no address) is a settings error,
                    // not a reason to run without bounce.
                    return bind.resolve().map(|_| bind).map_err(|e| {
                        format!(
                            "controlBind: interface {nic:?} has no usable address ({e}); \
                             expected interface:<nic> naming an interface of this host \
                             (see `ip addr`)"
                        )
                    });
                }
                v.parse().map(BindAddr::Ip).map_err(|_| {
                    format!(
                        "controlBind: expected routable, loopback, interface:<nic> or an IP address, got {v:?}"
                    )
                })
            }
        }
    }
}

/// Makes NIXL's UCX backend use the network device the control channel
/// binds (issue 11, item 10): `UCX_NET_DEVICES=lo` for `loopback`, the NIC
/// for `interface:<nic>`, so an agent on loopback does not listen on the
/// routable address through UCX either. Shared-memory and CUDA transports
/// (cma, cuda_ipc) are not network devices and stay available. A
/// `UCX_NET_DEVICES` already set wins. (NIXL's own `device_list` backend
/// param also filters those other transports and breaks endpoint creation,
/// hence the environment.) Called by [`run`] before any thread exists.
fn limit_ucx_net_devices(bind: &BindAddr) {
    const VAR: &str = "UCX_NET_DEVICES";
    let dev = match bind {
        BindAddr::Loopback => "lo".to_string(),
        BindAddr::Interface(nic) => nic.clone(),
        BindAddr::Routable | BindAddr::Ip(_) => return,
    };
    match std::env::var(VAR) {
        Ok(v) => tracing::info!(%v, "{VAR} set by the environment; kept"),
        Err(_) => {
            tracing::info!(device = %dev, "UCX network devices limited to the control bind");
            // Single-threaded here: run() calls this before starting NIXL,
            // discovery or the HTTP runtime.
            std::env::set_var(VAR, dev);
        }
    }
}

/// Whether `listen` (`host:port`) names a loopback address
/// (`127.0.0.0/8`, `::1` or `localhost`).
pub fn listen_is_loopback(listen: &str) -> bool {
    if let Ok(a) = listen.parse::<std::net::SocketAddr>() {
        return a.ip().is_loopback();
    }
    listen
        .rsplit_once(':')
        .is_some_and(|(h, _)| h.eq_ignore_ascii_case("localhost"))
}

/// `$POD_NAME`, else `$HOSTNAME`, else the host name, else
/// `kvfabric-agent` (always a valid key segment).
pub fn default_logical_id() -> String {
    let env = |k: &str| {
        std::env::var(k)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| validate_name(s).is_ok())
    };
    env("POD_NAME")
        .or_else(|| env("HOSTNAME"))
        .or_else(|| host_name().filter(|s| validate_name(s).is_ok()))
        .unwrap_or_else(|| "kvfabric-agent".into())
}

/// The host name (`gethostname`), if any.
pub fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its full length minus the terminator
    // we keep.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let s = String::from_utf8_lossy(&buf[..end]).trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// What [`Node::start`] needs besides the agent and discovery.
pub struct NodeOptions {
    /// Stable identity (the record's `logical_id`).
    pub logical_id: String,
    /// This process start's incarnation (the agent's name should be
    /// [`incarnation_name`]`(logical_id, incarnation)`).
    pub incarnation: Incarnation,
    /// Node name for humans (host name).
    pub node: String,
    /// Buffers published in the record (the KV pool).
    pub buffers: Vec<BufferRegion>,
    /// Base URL of the HTTP API published in the record (`http://ip:port`;
    /// empty = not published).
    pub http: String,
    /// Role published in the record (`prefill`, `decode`, `both`; may be
    /// empty).
    pub role: String,
    /// Pod UID published in the record (empty outside Kubernetes).
    pub pod_uid: String,
    /// Ranges `/v1/debug/verify` may read (normally the same pool).
    pub verify_regions: Vec<VerifyRegion>,
    /// The effective configuration document (served by `/v1/config`).
    pub config: serde_json::Value,
    /// Whether bounce was requested (readiness needs the arena then).
    pub bounce_requested: bool,
    /// Serve the `/v1/debug/*` endpoints (see [`AgentConfig::debug_api`]).
    pub debug_api: bool,
}

/// How a [`Node::shutdown`] went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// In-flight bounce work drained before the bound.
    pub drained: bool,
    /// Time spent waiting for in-flight work.
    pub waited: Duration,
    /// The lease revocation error, if it failed.
    pub revoke_error: Option<String>,
}

/// The services around one agent: metrics, published record, peer sync and
/// HTTP state.
pub struct Node {
    agent: Arc<FabricAgent>,
    discovery: Arc<dyn Discovery>,
    sync: Mutex<Option<PeerSync>>,
    state: Arc<ServiceState>,
    record: Mutex<AgentRecord>,
}

impl Node {
    /// Starts the services: metrics watching `agent` and `discovery`; a
    /// [`PeerSync`] loading/forgetting peers from `discovery`'s events
    /// (other incarnations of our own logical id skipped); then publishes
    /// the agent's record. A publish the store did not confirm is logged
    /// and retried in the background by the discovery (readiness reports
    /// it).
    ///
    /// # Errors
    /// When the metrics cannot be built, NIXL cannot serialize the agent's
    /// metadata, or the record is invalid.
    pub fn start(
        agent: Arc<FabricAgent>,
        discovery: Arc<dyn Discovery>,
        opts: NodeOptions,
    ) -> Result<Self, String> {
        let metrics = Arc::new(AgentMetrics::new()?);
        metrics.watch_agent(&agent);
        metrics.watch_discovery(agent.name(), &discovery);
        let desc = agent
            .local_descriptor()
            .map_err(|e| format!("NIXL metadata: {e}"))?;
        let mut record = AgentRecord::new(&desc, &opts.logical_id, opts.incarnation);
        record.node = opts.node;
        record.buffers = opts.buffers;
        record.http = opts.http;
        record.role = opts.role;
        record.pod_uid = opts.pod_uid;
        record.config_generation = agent.config_generation();
        record.config_fingerprint = super::rollout::running_fingerprint(&agent);
        record.validate().map_err(|e| e.to_string())?;
        let observer: super::discovery::InvalidationObserver = {
            let (m, name) = (metrics.clone(), agent.name().to_string());
            Arc::new(move |path, latency| m.observe_invalidation(&name, path.label(), latency))
        };
        let sync = PeerSync::spawn_observed(
            agent.clone(),
            discovery.events(),
            Some(opts.logical_id.clone()),
            Some(observer),
        );
        match discovery.publish(record.clone()) {
            Ok(()) => {
                tracing::info!(agent = %record.name, logical = %record.logical_id, "published to discovery")
            }
            Err(e @ super::discovery::DiscoveryError::Record(_)) => return Err(e.to_string()),
            Err(e) => {
                tracing::warn!(agent = %record.name, error = %e, "publish not confirmed yet; retrying in the background")
            }
        }
        if opts.debug_api && crate::runtime::faults::requested() {
            crate::runtime::faults::enable();
            tracing::warn!(
                "TEST FAULT HOOKS ENABLED ({}): POST /v1/debug/faults arms them",
                crate::runtime::faults::ENV
            );
        }
        let state = ServiceState::new(ServiceInit {
            agent: agent.clone(),
            discovery: Some(discovery.clone()),
            metrics,
            config: opts.config,
            bounce_requested: opts.bounce_requested,
            logical_id: opts.logical_id,
            incarnation: Some(opts.incarnation),
            verify_regions: opts.verify_regions,
            debug_api: opts.debug_api,
        });
        Ok(Self {
            agent,
            discovery,
            sync: Mutex::new(Some(sync)),
            state,
            record: Mutex::new(record),
        })
    }

    /// The HTTP state.
    pub fn state(&self) -> &Arc<ServiceState> {
        &self.state
    }

    /// The agent.
    pub fn agent(&self) -> &Arc<FabricAgent> {
        &self.agent
    }

    /// The discovery.
    pub fn discovery(&self) -> &Arc<dyn Discovery> {
        &self.discovery
    }

    /// The published record (as last published).
    pub fn record(&self) -> AgentRecord {
        self.record
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Republishes the record with `engines` attached (issue 12) and the
    /// agent's current NIXL metadata (an engine's pool registration adds
    /// memory sections peers need for the standard path). A publish the
    /// store did not confirm is retried in the background by the discovery.
    pub fn publish_engines(&self, engines: Vec<EngineRecord>) {
        self.republish_with(|rec| rec.engines = engines);
    }

    /// Republishes the record after a rollout step: the agent's current
    /// NIXL metadata and handshake (none while it drains), its config
    /// generation, `fingerprint` and `config_error` (empty: none).
    pub fn republish_config(&self, fingerprint: &str, config_error: &str) {
        self.republish_with(|rec| {
            rec.config_fingerprint = fingerprint.to_string();
            rec.config_error = config_error.to_string();
        });
    }

    /// Refreshes the record from the agent (NIXL metadata, handshake,
    /// config generation), applies `f` and publishes it; a publish the
    /// store did not confirm is retried in the background by the discovery.
    fn republish_with(&self, f: impl FnOnce(&mut AgentRecord)) {
        if self.state.is_shutting_down() {
            // The lease is (being) revoked: a put now would bring the
            // record back under a new lease.
            return;
        }
        let mut rec = self.record.lock().unwrap_or_else(|p| p.into_inner());
        match self.agent.local_descriptor() {
            Ok(d) => {
                rec.nixl_metadata = d.nixl_metadata;
                rec.handshake = d.handshake;
                rec.draining = d.draining;
            }
            Err(e) => {
                tracing::warn!(agent = %self.agent.name(), error = %e, "NIXL metadata not refreshed")
            }
        }
        rec.config_generation = self.agent.config_generation();
        f(&mut rec);
        rec.published_at_ms = super::discovery::now_ms();
        if let Err(e) = self.discovery.publish(rec.clone()) {
            tracing::warn!(agent = %self.agent.name(), error = %e, "record not published yet; retrying in the background");
        }
    }

    /// Names of the peers loaded through discovery.
    pub fn loaded_peers(&self) -> Vec<String> {
        self.sync
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(PeerSync::loaded)
            .unwrap_or_default()
    }

    /// Graceful shutdown (blocking; idempotent): readiness → 503; waits at
    /// most `bound` for in-flight bounce work (send requests and granted
    /// flows) to resolve; revokes the discovery lease so peers forget this
    /// agent at once; stops the peer sync; stops the transport (anything
    /// still in flight resolves FAILURE). The standard-path poller stops
    /// when the agent is dropped.
    pub fn shutdown(&self, bound: Duration) -> ShutdownReport {
        self.state.begin_shutdown();
        let t0 = Instant::now();
        let mut drained = true;
        if let Some(t) = self.agent.transport() {
            drained = false;
            while t0.elapsed() < bound {
                match t.snapshot() {
                    Some(s) if s.send_requests == 0 && s.flows == 0 => {
                        drained = true;
                        break;
                    }
                    Some(_) => std::thread::sleep(Duration::from_millis(10)),
                    None => {
                        drained = true;
                        break;
                    }
                }
            }
            if !drained {
                tracing::warn!(agent = %self.agent.name(), ?bound, snapshot = ?t.snapshot(), "in-flight transfers did not drain; failing them");
            }
        }
        let waited = t0.elapsed();
        let revoke_error = match self.discovery.revoke() {
            Ok(()) => None,
            Err(e) => {
                tracing::warn!(agent = %self.agent.name(), error = %e, "revoking the discovery lease failed; it expires with its TTL");
                Some(e.to_string())
            }
        };
        if let Some(mut s) = self.sync.lock().unwrap_or_else(|p| p.into_inner()).take() {
            s.stop();
        }
        if let Some(t) = self.agent.transport() {
            t.shutdown();
        }
        tracing::info!(agent = %self.agent.name(), drained, ?waited, "agent stopped");
        ShutdownReport {
            drained,
            waited,
            revoke_error,
        }
    }
}

/// Initialises `tracing` output on stderr in `format`, filtered by
/// `$KVFABRIC_LOG` (default `info`); text is coloured only on a terminal
/// without `NO_COLOR` ([`crate::use_color`]). Idempotent (later calls are
/// no-ops).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVFABRIC_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(crate::use_color(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b.json().try_init(),
    };
}

/// Resolves when SIGTERM or SIGINT arrives; returns the signal's name.
async fn termination_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = tokio::signal::ctrl_c() => "SIGINT",
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; only SIGINT stops the agent");
            let _ = tokio::signal::ctrl_c().await;
            "SIGINT"
        }
    }
}

/// The HTTP API's URL as published in the record: the bound address, with
/// an unspecified IP (`0.0.0.0`, `::`) replaced by the host's routable IP
/// (the control channel's choice), else loopback.
pub fn advertised_http_url(bound: std::net::SocketAddr) -> String {
    let ip = if bound.ip().is_unspecified() {
        crate::runtime::control::zmq::local_routable_ip(None).unwrap_or(if bound.is_ipv4() {
            std::net::IpAddr::from([127, 0, 0, 1])
        } else {
            std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
        })
    } else {
        bound.ip()
    };
    format!("http://{}", std::net::SocketAddr::new(ip, bound.port()))
}

/// Bound on finishing open HTTP requests after the lease is revoked.
const HTTP_DRAIN: Duration = Duration::from_secs(5);

/// How long a starting agent waits for etcd's first read to learn its
/// rollout document before it builds its arena from the mounted config.
pub const STARTUP_CONFIG_WAIT: Duration = Duration::from_secs(3);

/// Runs the daemon until SIGTERM/SIGINT: starts discovery (etcd or
/// embedded) and takes the bounce config from this agent's rollout
/// document in etcd when there is one (else the mounted config), allocates
/// and registers the KV pool and arena, builds the NIXL agent
/// (incarnation-named), the [`Node`], the rollout follower
/// ([`super::rollout::follow`]) and the HTTP server (its bound address is
/// passed to `announce` once listening), then shuts down gracefully.
///
/// # Errors
/// A start-up failure (invalid config, pool allocation, NIXL agent,
/// discovery, listener) or an HTTP server error.
pub fn run(
    cfg: AgentConfig,
    announce: impl FnOnce(std::net::SocketAddr) + Send,
) -> Result<(), String> {
    cfg.validate()?;
    for w in &cfg.env_warnings {
        tracing::error!("config: {w}");
    }
    let seed = cfg.bounce.validate().map_err(|e| format!("bounce: {e}"))?;
    let mounted = seed.clone();
    limit_ucx_net_devices(&cfg.bind_addr()?);
    // Discovery first: etcd's rollout documents, when the operator wrote
    // them, win over the mounted config (which only seeds an agent that
    // starts before the operator has written one).
    let discovery: Arc<dyn Discovery> = if cfg.etcd_endpoints.is_empty() {
        tracing::info!("no etcd endpoints: embedded (in-process) discovery");
        Arc::new(EmbeddedRegistry::new().handle())
    } else {
        tracing::info!(endpoints = ?cfg.etcd_endpoints, fabric = %cfg.fabric, "connecting to etcd (discovery)");
        let mut o = EtcdOptions::new(cfg.etcd_endpoints.clone(), &cfg.fabric);
        o.lease_ttl = Duration::from_secs(cfg.lease_ttl_seconds);
        o.tls = cfg.etcd_tls()?;
        o.logical_id = Some(cfg.logical_id.clone());
        Arc::new(EtcdDiscovery::start(o).map_err(|e| e.to_string())?)
    };
    let assigned = discovery.assigned_config();
    let (eff, generation, chosen) = match &assigned {
        Some(rx) => {
            if !discovery.wait_first_read(STARTUP_CONFIG_WAIT) {
                tracing::warn!(wait = ?STARTUP_CONFIG_WAIT, "etcd not read yet: starting with the mounted config; a rollout document is applied when it arrives");
            }
            let own = rx.try_iter().last();
            let desired = discovery.desired_config();
            let (eff, generation, from) =
                super::rollout::initial(own.as_deref(), desired.as_deref(), seed);
            tracing::info!(generation, source = from, "bounce config chosen");
            let chosen = match from {
                "own rollout document" => own,
                "desired document" => desired,
                _ => None,
            };
            (eff, generation, chosen)
        }
        None => (seed, 0, None),
    };
    for n in eff.notes() {
        tracing::info!("bounce config: {n}");
    }
    let incarnation = Incarnation::generate();
    let name = incarnation_name(&cfg.logical_id, incarnation);
    let pool_len = cfg.pool_size_bytes.get();
    let pool = Arc::new(
        HostArena::new_base_pages(pool_len as usize).map_err(|e| format!("KV pool: {e}"))?,
    );
    let pool_addr = pool.base_addr();
    let opts = FabricOptions {
        name: name.clone(),
        config: eff,
        kv_regions: vec![(MemKind::Dram, MemDesc::host(pool_addr, pool_len))],
        bind: cfg.bind_addr()?,
        copy: None,
        control_auth: cfg.control_auth()?,
    };
    // The UUID of the agent's GPU (the engine socket's path may name it).
    #[allow(unused_mut)]
    let mut gpu_uuid: Option<String> = None;
    let agent = Arc::new(match cfg.gpu {
        None => FabricAgent::new(opts),
        #[cfg(feature = "cuda")]
        Some(ordinal) => {
            let gpu = crate::runtime::cuda::CudaGpu::open(ordinal as usize)
                .map_err(|e| format!("gpu {ordinal}: {e}"))?;
            gpu_uuid = gpu.info().uuid.map(|u| kvfabric_core::layout::format_gpu_uuid(&u));
            tracing::info!(gpu = ordinal, name = %gpu.info().name, "bounce arena and engine pools on the GPU");
            FabricAgent::with_arena(
                opts,
                crate::runtime::fabric::ArenaChoice::Cuda {
                    gpu,
                    copy: crate::runtime::cuda::CudaCopyConfig::default(),
                },
            )
        }
        #[cfg(not(feature = "cuda"))]
        Some(_) => Err(crate::runtime::engine::EngineError::Failed(
            "gpu: this build has no GPU support (the cuda feature)".into(),
        )),
    }
    .map_err(|e| format!("NIXL agent {name}: {e}"))?);
    let engine_socket = super::engines::socket_path(&cfg.engine_socket, gpu_uuid.as_deref())?;
    if let Some(u) = &gpu_uuid {
        tracing::info!(gpu_uuid = %u, "engines on this GPU attach by its UUID (layout.device_uuid)");
    }
    if let Some(why) = &agent.bounce_unavailable() {
        tracing::warn!(agent = %name, reason = %why, "bounce is not running; standard path only");
    }
    // A document from etcd that cannot be built here (an arena this node
    // cannot hold, say) falls back to the mounted config, and the refusal
    // is published with the record (the operator halts on it).
    let mut startup_refusal = None;
    if generation > 0 {
        agent.set_config_generation(generation);
        if let (true, Some(why)) = (agent.bounce_config().enabled(), agent.bounce_unavailable()) {
            tracing::error!(generation, reason = %why, "the rollout document's bounce config cannot be built here; starting with the mounted config");
            agent.reconfigure(mounted, 0);
            startup_refusal = Some(format!("generation {generation}: {why}"));
        }
    }
    // Bind the HTTP listener before publishing, so the record carries the
    // API's address (clients such as the distributed bench find it there).
    let std_listener = std::net::TcpListener::bind(&cfg.listen)
        .map_err(|e| format!("listening on {}: {e}", cfg.listen))?;
    std_listener
        .set_nonblocking(true)
        .map_err(|e| format!("listening on {}: {e}", cfg.listen))?;
    let addr = std_listener.local_addr().map_err(|e| e.to_string())?;
    let keep: Arc<dyn std::any::Any + Send + Sync> = pool.clone();
    let node = Arc::new(Node::start(
        agent.clone(),
        discovery.clone(),
        NodeOptions {
            logical_id: cfg.logical_id.clone(),
            incarnation,
            node: host_name().unwrap_or_default(),
            buffers: vec![BufferRegion {
                label: "kv".into(),
                kind: "dram".into(),
                device: 0,
                addr: pool_addr,
                len: pool_len,
            }],
            http: advertised_http_url(addr),
            role: cfg.role.clone(),
            pod_uid: cfg.pod_uid.clone(),
            // SAFETY: the pool is kept alive by the region (`keep`); this
            // process owns it, and `/v1/debug/transfer` writes only the
            // sources a client names (the bench's own blocks).
            verify_regions: vec![unsafe {
                VerifyRegion::new_writable(pool_addr, pool_len, Some(keep))
            }],
            config: {
                let mut v = serde_json::to_value(&cfg).map_err(|e| e.to_string())?;
                v["warnings"] = serde_json::json!(cfg.env_warnings);
                v
            },
            bounce_requested: cfg.bounce.enabled,
            debug_api: cfg.debug_api,
        },
    )?);
    drop(agent);
    if let Some(e) = &startup_refusal {
        node.republish_config(&super::rollout::running_fingerprint(node.agent()), e);
    }
    let refused_at_start = startup_refusal.is_some().then_some(chosen).flatten();
    let _rollout = match assigned {
        Some(rx) => Some(
            super::rollout::follow(Arc::downgrade(&node), rx, refused_at_start)
                .map_err(|e| format!("spawning the rollout thread: {e}"))?,
        ),
        None => None,
    };
    tracing::info!(
        agent = %name, logical = %cfg.logical_id, incarnation = %incarnation, role = %cfg.role,
        pool_bytes = pool_len, bounce = node.agent().transport().is_some(), "agent started"
    );

    // Traces of engine hand-offs: only with an endpoint (otherwise the
    // engine API checks an empty cell per request).
    let traces = if cfg.otlp_endpoint.is_empty() {
        None
    } else {
        let t = super::traces::Traces::start(
            &cfg.otlp_endpoint,
            cfg.trace_sample_ratio.0,
            node.agent().name(),
        )?;
        tracing::info!(endpoint = %cfg.otlp_endpoint, sample_ratio = cfg.trace_sample_ratio.0, "OTLP traces of engine hand-offs");
        Some(Arc::new(t))
    };
    let hub = engine_socket.as_ref().map(|_| {
        let weak = Arc::downgrade(&node);
        let hub = super::engines::EngineHub::new(
            node.agent().clone(),
            Some(discovery.clone()),
            Box::new(move |engines| {
                if let Some(n) = weak.upgrade() {
                    n.publish_engines(engines);
                }
            }),
            Duration::from_millis(cfg.bounce.request_timeout_ms),
        );
        hub.require_device_uuid(cfg.require_device_uuid);
        node.state()
            .metrics()
            .watch_engines(node.agent().name(), &hub);
        hub.set_metrics(node.state().metrics().clone());
        hub.follow_tombstones();
        if let Some(t) = &traces {
            hub.set_traces(t.clone());
        }
        hub
    });

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let bound = Duration::from_millis(cfg.shutdown_timeout_ms);
    let result = rt.block_on(async {
        let listener = tokio::net::TcpListener::from_std(std_listener)
            .map_err(|e| format!("listening on {}: {e}", cfg.listen))?;
        let (engine_stop_tx, engine_stop_rx) = tokio::sync::oneshot::channel::<()>();
        let engine_server = match (&engine_socket, &hub) {
            (Some(path), Some(hub)) => {
                let l = super::engines::bind_socket(path)?;
                tracing::info!(socket = %path.display(), "engine API listening");
                Some(tokio::spawn(super::engines::serve(l, hub.clone(), async move {
                    let _ = engine_stop_rx.await;
                })))
            }
            _ => None,
        };
        tracing::info!(%addr, url = %node.record().http, "HTTP API listening");
        announce(addr);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let mut server = tokio::spawn(super::http::serve(
            listener,
            node.state().clone(),
            async move {
                let _ = stop_rx.await;
            },
        ));
        tokio::select! {
            sig = termination_signal() => tracing::info!(signal = sig, "shutting down"),
            r = &mut server => {
                return Err(match r {
                    Ok(Ok(())) => "HTTP server stopped unexpectedly".to_string(),
                    Ok(Err(e)) => format!("HTTP server: {e}"),
                    Err(e) => format!("HTTP server task: {e}"),
                });
            }
        }
        // A second signal while draining exits at once.
        tokio::spawn(async {
            let sig = termination_signal().await;
            tracing::warn!(signal = sig, "second signal: exiting without draining");
            std::process::exit(1);
        });
        if let Some(hub) = &hub {
            // Engines first: their requests fail, their pools are let go.
            let hub = hub.clone();
            let _ = tokio::task::spawn_blocking(move || hub.shutdown()).await;
        }
        let _ = engine_stop_tx.send(());
        if let Some(s) = engine_server {
            if tokio::time::timeout(HTTP_DRAIN, s).await.is_err() {
                tracing::warn!("engine API connections still open after {HTTP_DRAIN:?}; closing");
            }
        }
        if let Some(path) = &engine_socket {
            let _ = std::fs::remove_file(path);
        }
        let n = node.clone();
        let report = tokio::task::spawn_blocking(move || n.shutdown(bound))
            .await
            .map_err(|e| format!("shutdown task: {e}"))?;
        tracing::info!(drained = report.drained, waited_ms = report.waited.as_millis() as u64, revoke_error = ?report.revoke_error, "drained");
        let _ = stop_tx.send(());
        match tokio::time::timeout(HTTP_DRAIN, server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "HTTP server error during shutdown"),
            Ok(Err(e)) => tracing::warn!(error = %e, "HTTP server task failed"),
            Err(_) => tracing::warn!("HTTP connections still open after {HTTP_DRAIN:?}; closing"),
        }
        Ok(())
    });
    // Drops the runtime (and any connection tasks) before the agent and
    // the pool it registered.
    drop(rt);
    drop(hub);
    if let Some(t) = &traces {
        // The hand-offs' last spans, flushed (bounded).
        t.shutdown();
    }
    drop(node);
    drop(discovery);
    drop(pool);
    if result.is_ok() {
        tracing::info!("exit");
    }
    result
}

/// What an on/off environment variable accepts.
const SWITCH_VALUES: &str = "1/0/true/false/on/off/yes/no";

/// An on/off environment value ([`SWITCH_VALUES`], any case); `None`
/// for anything else.
fn parse_switch(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_settings_from_env_and_flags() {
        let mut c = AgentConfig::default();
        assert_eq!(c.otlp_endpoint, "");
        assert_eq!(c.trace_sample_ratio, SampleRatio(0.01));
        let r = c.apply_env_vars([
            ("KVFABRIC_OTLP_ENDPOINT", "http://collector:4317"),
            ("KVFABRIC_TRACE_SAMPLE_RATIO", "0.25"),
        ]);
        assert!(r.errors.is_empty(), "{r:?}");
        assert_eq!(c.otlp_endpoint, "http://collector:4317");
        assert_eq!(c.trace_sample_ratio, SampleRatio(0.25));
        for bad in ["1.5", "-0.1", "often", "NaN"] {
            let r = AgentConfig::default().apply_env_vars([("KVFABRIC_TRACE_SAMPLE_RATIO", bad)]);
            assert!(
                r.errors.len() == 1 && r.errors[0].contains("KVFABRIC_TRACE_SAMPLE_RATIO"),
                "{bad}: {r:?}"
            );
        }
        c.apply_overrides(&AgentOverrides {
            trace_sample_ratio: Some(1.0),
            ..AgentOverrides::default()
        });
        assert_eq!(c.trace_sample_ratio, SampleRatio(1.0));
        // YAML keys round-trip.
        let y = serde_yaml::to_string(&c).unwrap();
        assert!(y.contains("otlpEndpoint: http://collector:4317"), "{y}");
        assert_eq!(AgentConfig::from_yaml_str(&y).unwrap(), c);
        c.otlp_endpoint = "collector:4317".into();
        c.logical_id = "x".into();
        let e = c.validate().unwrap_err();
        assert!(e.contains("otlpEndpoint"), "{e}");
    }

    #[test]
    fn engine_socket_placeholder_needs_a_gpu() {
        let mut c = AgentConfig {
            logical_id: "x".into(),
            engine_socket: "/run/kvfabric/{gpu_uuid}.sock".into(),
            ..AgentConfig::default()
        };
        let e = c.validate().unwrap_err();
        assert!(e.contains("engineSocket") && e.contains("set gpu"), "{e}");
        c.engine_socket = "/run/kvfabric/{gpu}.sock".into();
        let e = c.validate().unwrap_err();
        assert!(e.contains("the only placeholder is {gpu_uuid}"), "{e}");
        c.engine_socket = "/run/kvfabric/engine.sock".into();
        assert_eq!(c.validate(), Ok(()));
        // requireDeviceUuid: env and flag; GPU agents only.
        let r = c.apply_env_vars([("KVFABRIC_REQUIRE_DEVICE_UUID", "maybe")]);
        assert!(
            r.errors.len() == 1 && r.errors[0].contains("KVFABRIC_REQUIRE_DEVICE_UUID"),
            "{r:?}"
        );
        c.apply_env_vars([("KVFABRIC_REQUIRE_DEVICE_UUID", "1")]);
        assert!(c.require_device_uuid);
        let e = c.validate().unwrap_err();
        assert!(
            e.contains("requireDeviceUuid") && e.contains("set gpu"),
            "{e}"
        );
        c.apply_overrides(&AgentOverrides {
            require_device_uuid: Some(false),
            ..AgentOverrides::default()
        });
        assert_eq!(c.validate(), Ok(()));
        let y = serde_yaml::to_string(&c).unwrap();
        assert!(y.contains("requireDeviceUuid: false"), "{y}");
        // The path the agent serves.
        use crate::service::engines::socket_path;
        let u = "5a2b1c3d-0e4f-4a1b-9c8d-7e6f5a4b3c2d";
        assert_eq!(socket_path(" ", None), Ok(None));
        assert_eq!(
            socket_path("/run/k/{gpu_uuid}.sock", Some(u)),
            Ok(Some(std::path::PathBuf::from(format!("/run/k/{u}.sock"))))
        );
        assert!(socket_path("/run/k/{gpu_uuid}.sock", None)
            .unwrap_err()
            .contains("set gpu"));
        assert!(socket_path("/run/k/{x}.sock", Some(u))
            .unwrap_err()
            .contains("only placeholder"));
    }

    #[test]
    fn control_key_settings_are_checked_at_start_up_naming_the_setting() {
        let dir = std::env::temp_dir().join(format!("kvf-ckey-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("control.key");
        std::fs::write(&key, "k".repeat(64) + "\n").unwrap();
        let base = || AgentConfig {
            logical_id: "x".into(),
            ..AgentConfig::default()
        };
        // Neither set: off.
        assert_eq!(base().control_auth().unwrap().mode(), AuthMode::Off);
        // A key with the default (ZMQ) transport: refused, naming the fix.
        let mut c = base();
        c.apply_env_vars([("KVFABRIC_CONTROL_KEY_FILE", key.to_str().unwrap())]);
        let e = c.validate().unwrap_err();
        assert!(e.contains("controlTransport: tcp"), "{e}");
        // With tcp: required by default; optional when asked.
        c.apply_env_vars([("KVFABRIC_BOUNCE_CONTROL_TRANSPORT", "tcp")]);
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.control_auth().unwrap().mode(), AuthMode::Required);
        c.apply_overrides(&AgentOverrides {
            control_auth: Some("optional".into()),
            ..AgentOverrides::default()
        });
        assert_eq!(c.control_auth().unwrap().mode(), AuthMode::Optional);
        // Unknown mode, off with a key, a mode without a key, a missing or
        // short file: each named.
        c.control_auth = "sometimes".into();
        assert!(c.validate().unwrap_err().contains("controlAuth"));
        c.control_auth = "off".into();
        assert!(c.validate().unwrap_err().contains("drop the key"));
        let mut n = base();
        n.control_auth = "required".into();
        assert!(n.validate().unwrap_err().contains("needs controlKeyFile"));
        c.control_auth = String::new();
        c.control_key_file = dir.join("missing").to_str().unwrap().into();
        let e = c.validate().unwrap_err();
        assert!(e.contains("controlKeyFile") && e.contains("missing"), "{e}");
        std::fs::write(&key, "short\n").unwrap();
        c.control_key_file = key.to_str().unwrap().into();
        let e = c.validate().unwrap_err();
        assert!(e.contains("at least 32"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn etcd_tls_settings_are_all_or_none_and_match_the_scheme() {
        let mut c = AgentConfig {
            logical_id: "x".into(),
            etcd_endpoints: vec!["https://e:2379".into()],
            ..AgentConfig::default()
        };
        let e = c.validate().unwrap_err();
        assert!(e.contains("https:// needs etcdCaFile"), "{e}");
        c.apply_env_vars([("KVFABRIC_ETCD_CA_FILE", "/ca.pem")]);
        let e = c.validate().unwrap_err();
        assert!(e.contains("all three"), "{e}");
        c.apply_overrides(&AgentOverrides {
            etcd_cert_file: Some("/c.pem".into()),
            etcd_key_file: Some("/k.pem".into()),
            ..AgentOverrides::default()
        });
        assert_eq!(c.validate(), Ok(()));
        c.etcd_endpoints = vec!["http://e:2379".into()];
        let e = c.validate().unwrap_err();
        assert!(e.contains("expected https://"), "{e}");
        // Unreadable files are named at start-up.
        c.etcd_endpoints = vec!["https://e:2379".into()];
        let e = c.etcd_tls().unwrap_err();
        assert!(e.contains("etcdCaFile \"/ca.pem\""), "{e}");
    }
}
