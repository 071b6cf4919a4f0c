//! The controller: `KvFabric` objects → one fabric task each; a fabric task
//! watches the selected pods (agent, prefill, decode) and all nodes, feeds
//! the pure [`PeerIndex`]es, and carries out their invalidations in etcd
//! ([`FabricStore`]), then reports counts and the last latency in the
//! fabric's status.
//!
//! Each `KvFabric` carries the finalizer [`FINALIZER`]: on delete, the
//! fabric task stops and its etcd keys (`/kvfabric/<fabric>/`) are removed
//! before the object may go. Invalidations and configuration problems are
//! recorded as Kubernetes Events on the `KvFabric` (events.k8s.io/v1).
//! Not yet: config rollout by generation (see operator/README.md).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::{stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use crate::crd::{condition, KvFabric, KvFabricSpec, KvFabricStatus};
use crate::index::{Invalidation, PeerIndex};
use crate::metrics::Metrics;
use crate::store::{check_endpoints, EtcdTls, FabricStore};

/// Bound on each etcd request of the operator.
pub const ETCD_TIMEOUT: Duration = Duration::from_secs(2);
/// First retry delay after an etcd failure; doubled up to
/// [`RETRY_MAX`].
pub const RETRY_INITIAL: Duration = Duration::from_millis(50);
/// Longest retry delay.
pub const RETRY_MAX: Duration = Duration::from_secs(5);
/// How long the finalizer tries to delete a deleted fabric's etcd keys
/// before it gives up (Warning Event `EtcdCleanupAbandoned`) and lets the
/// object go.
pub const CLEANUP_GIVE_UP: Duration = Duration::from_secs(300);

/// The finalizer on every `KvFabric`: its etcd keys are deleted before the
/// object goes.
pub const FINALIZER: &str = "kvfabric.io/etcd-cleanup";

/// What to do about [`FINALIZER`] on a `KvFabric` seen by the watch. Pure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinalizerStep {
    /// Live object without the finalizer: add it (before anything is
    /// written to etcd for it, so a delete cannot leak keys).
    Add,
    /// Being deleted and still carries the finalizer: stop the fabric,
    /// delete its etcd keys, then remove the finalizer.
    Cleanup,
    /// Live with the finalizer: run the fabric.
    Run,
    /// Being deleted without our finalizer: nothing left to do.
    Gone,
}

/// [`FinalizerStep`] for an object's `deletionTimestamp` and finalizers.
pub fn finalizer_step(deleting: bool, finalizers: &[String]) -> FinalizerStep {
    let ours = finalizers.iter().any(|f| f == FINALIZER);
    match (deleting, ours) {
        (false, false) => FinalizerStep::Add,
        (false, true) => FinalizerStep::Run,
        (true, true) => FinalizerStep::Cleanup,
        (true, false) => FinalizerStep::Gone,
    }
}

/// Milliseconds since the Unix epoch now (0 if the clock is before 1970).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The label-selector string (`a=b,c in (d,e),!f`) of `sel`; `None` when
/// an operator is unknown (bad input: the selector selects nothing).
pub fn selector_string(sel: &LabelSelector) -> Option<String> {
    let mut parts: Vec<String> = sel
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in sel.match_expressions.iter().flatten() {
        let vals = e.values.clone().unwrap_or_default().join(",");
        parts.push(match e.operator.as_str() {
            "In" => format!("{} in ({vals})", e.key),
            "NotIn" => format!("{} notin ({vals})", e.key),
            "Exists" => e.key.clone(),
            "DoesNotExist" => format!("!{}", e.key),
            _ => return None,
        });
    }
    Some(parts.join(","))
}

/// Which selector a pod came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// `spec.agentSelector`.
    Agent,
    /// `spec.prefillSelector`.
    Prefill,
    /// `spec.decodeSelector`.
    Decode,
}

impl Role {
    const ALL: [Role; 3] = [Role::Agent, Role::Prefill, Role::Decode];

    fn selector(self, spec: &KvFabricSpec) -> &LabelSelector {
        match self {
            Role::Agent => &spec.agent_selector,
            Role::Prefill => &spec.prefill_selector,
            Role::Decode => &spec.decode_selector,
        }
    }
}

/// The conditions for `status` given what the fabric task knows: whether
/// the bounce config validates (`config_error`) and whether etcd answers.
/// Transition times are kept from `previous` when a status is unchanged.
/// Pure.
/// How long after the last bounce traffic seen a fabric stays
/// `Transferring` (ms): a few polls, so a pause between requests does not
/// flap the condition.
pub const TRANSFERRING_WINDOW_MS: i64 = 60_000;

/// What a fabric task knows of its agents from their reports
/// ([`crate::reports`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetStatus {
    /// Some agent has answered a poll.
    pub observed: bool,
    /// Bounce traffic was seen within [`TRANSFERRING_WINDOW_MS`].
    pub transferring: bool,
    /// `agent → peer` pairs whose transport is suspected of a silent
    /// TCP/emulation fallback.
    pub degraded: Vec<String>,
}

/// Where the config rollout stands (from the last rollout step).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RolloutStatus {
    /// `spec.bounce` is unset: the agents run their mounted configs and
    /// nothing rolls out.
    pub unmanaged: bool,
    /// A rollout step has read etcd.
    pub known: bool,
    /// Desired generation.
    pub generation: u64,
    /// Desired fingerprint.
    pub fingerprint: String,
    /// Agents running the desired generation.
    pub at_desired: u32,
    /// Agents with a live record.
    pub total: u32,
    /// `logical id: reason` of agents that refused the desired generation
    /// (the rollout halts).
    pub refused: Vec<String>,
}

impl RolloutStatus {
    /// Every agent runs the desired generation.
    pub fn complete(&self) -> bool {
        self.known && self.at_desired == self.total
    }
}

/// The conditions for `status` given what the fabric task knows: whether
/// the bounce config validates (`config_error`), whether etcd answers, the
/// config rollout (`rollout`) and the agents' reports (`fleet`).
/// Ready = not Degraded, not rolling out, and Transferring (a healthy
/// fabric that moves nothing is not Ready). An agent refusing the desired
/// config is Degraded (`ConfigRefused`) and halts the rollout.
/// Transition times are kept from `previous` when a status is unchanged.
/// Pure.
pub fn conditions(
    generation: i64,
    config_error: Option<&str>,
    etcd_error: Option<&str>,
    rollout: &RolloutStatus,
    fleet: &FleetStatus,
    previous: &[Condition],
    now: &Time,
) -> Vec<Condition> {
    let mk = |type_: &str, status: &str, reason: &str, message: String| {
        let last = previous
            .iter()
            .find(|c| c.type_ == type_ && c.status == status)
            .map(|c| c.last_transition_time.clone())
            .unwrap_or_else(|| now.clone());
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message,
            observed_generation: Some(generation),
            last_transition_time: last,
        }
    };
    let degraded = match (config_error, etcd_error) {
        (Some(e), _) => mk(
            condition::DEGRADED,
            "True",
            "InvalidBounceConfig",
            format!("{e} (the running config stays)"),
        ),
        (None, Some(e)) => mk(
            condition::DEGRADED,
            "True",
            "EtcdUnreachable",
            e.to_string(),
        ),
        (None, None) if !rollout.refused.is_empty() => mk(
            condition::DEGRADED,
            "True",
            "ConfigRefused",
            format!(
                "generation {} refused (the rollout halts; those agents keep their running config): {}",
                rollout.generation,
                rollout.refused.join("; ")
            ),
        ),
        (None, None) => mk(condition::DEGRADED, "False", "AsExpected", String::new()),
    };
    let progressing = if config_error.is_some() {
        mk(
            condition::PROGRESSING,
            "False",
            "InvalidBounceConfig",
            "the spec's bounce config is refused; nothing rolls out".into(),
        )
    } else if rollout.unmanaged {
        mk(
            condition::PROGRESSING,
            "False",
            "ConfigNotManaged",
            "spec.bounce is unset: each agent runs its mounted bounce config; nothing rolls out"
                .into(),
        )
    } else if !rollout.known {
        mk(
            condition::PROGRESSING,
            "Unknown",
            "RolloutNotRead",
            "the rollout documents have not been read from etcd yet".into(),
        )
    } else if !rollout.refused.is_empty() {
        mk(
            condition::PROGRESSING,
            "False",
            "RolloutHalted",
            format!(
                "{}/{} agents at generation {}; halted on a refusal",
                rollout.at_desired, rollout.total, rollout.generation
            ),
        )
    } else if !rollout.complete() {
        mk(
            condition::PROGRESSING,
            "True",
            "RollingOut",
            format!(
                "{}/{} agents at generation {} (fingerprint {})",
                rollout.at_desired, rollout.total, rollout.generation, rollout.fingerprint
            ),
        )
    } else {
        mk(
            condition::PROGRESSING,
            "False",
            "RolloutComplete",
            format!(
                "{} agents at generation {} (fingerprint {})",
                rollout.total, rollout.generation, rollout.fingerprint
            ),
        )
    };
    let transferring = match (fleet.observed, fleet.transferring) {
        (false, _) => mk(
            condition::TRANSFERRING,
            "Unknown",
            "NoAgentReport",
            "no agent of the fabric has answered GET /v1/report yet".into(),
        ),
        (true, true) => mk(
            condition::TRANSFERRING,
            "True",
            "BounceTrafficObserved",
            format!(
                "bounce traffic seen within the last {} s",
                TRANSFERRING_WINDOW_MS / 1000
            ),
        ),
        (true, false) => mk(
            condition::TRANSFERRING,
            "False",
            "NoBounceTraffic",
            format!(
                "no bounce request sent or chunk scattered by any agent within {} s",
                TRANSFERRING_WINDOW_MS / 1000
            ),
        ),
    };
    let transport = match (fleet.observed, fleet.degraded.is_empty()) {
        (false, _) => mk(
            condition::TRANSPORT_DEGRADED,
            "Unknown",
            "NoAgentReport",
            String::new(),
        ),
        (true, true) => mk(
            condition::TRANSPORT_DEGRADED,
            "False",
            "AsExpected",
            String::new(),
        ),
        (true, false) => mk(
            condition::TRANSPORT_DEGRADED,
            "True",
            "SuspectTransportFallback",
            format!(
                "GPU-to-GPU writes far below cuda_ipc/RDMA rates (TCP or software emulation?): {}",
                fleet.degraded.join(", ")
            ),
        ),
    };
    let ready = if degraded.status == "True" {
        mk(
            condition::READY,
            "False",
            "Degraded",
            degraded.message.clone(),
        )
    } else if progressing.status == "True" {
        mk(
            condition::READY,
            "False",
            "RollingOut",
            progressing.message.clone(),
        )
    } else if transferring.status != "True" {
        mk(
            condition::READY,
            "False",
            &transferring.reason,
            transferring.message.clone(),
        )
    } else {
        mk(condition::READY, "True", "AsExpected", String::new())
    };
    vec![ready, progressing, degraded, transport, transferring]
}

/// Runs the operator until the `KvFabric` watch ends (it does not on its
/// own: the watcher retries with backoff).
pub async fn run(client: Client, metrics: Arc<Metrics>) {
    let api: Api<KvFabric> = Api::all(client.clone());
    // Aborted when dropped: a dropped `run` (leadership released or lost)
    // leaves no fabric or cleanup task acting.
    let mut tasks: HashMap<String, (KvFabricSpec, AbortOnDrop)> = HashMap::new();
    let mut relist: Option<Vec<String>> = None;
    let mut cleaning: HashMap<String, AbortOnDrop> = HashMap::new();
    let (cleaned_tx, mut cleaned_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let mut events = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    loop {
        let ev = tokio::select! {
            ev = events.next() => match ev {
                Some(ev) => ev,
                None => break,
            },
            Some(done) = cleaned_rx.recv() => {
                cleaning.remove(&done);
                continue;
            }
        };
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                metrics.errors.with_label_values(&["watch"]).inc();
                tracing::warn!(error = %e, "KvFabric watch error; retrying");
                continue;
            }
        };
        match ev {
            Event::Init => relist = Some(Vec::new()),
            Event::InitApply(f) | Event::Apply(f) => {
                let key = format!("{}/{}", f.namespace().unwrap_or_default(), f.name_any());
                if let Some(r) = relist.as_mut() {
                    r.push(key.clone());
                }
                let step = finalizer_step(
                    f.metadata.deletion_timestamp.is_some(),
                    f.metadata.finalizers.as_deref().unwrap_or(&[]),
                );
                match step {
                    FinalizerStep::Run => {}
                    FinalizerStep::Add => {
                        if let Err(e) = add_finalizer(&client, &f).await {
                            metrics.errors.with_label_values(&["kube"]).inc();
                            tracing::warn!(fabric = %key, error = %e, "adding the finalizer failed; retried on the next event");
                        }
                        // The update comes back as an Apply event.
                        continue;
                    }
                    FinalizerStep::Cleanup | FinalizerStep::Gone => {
                        let running = tasks.remove(&key).map(|(_, h)| h);
                        if running.is_some() {
                            tracing::info!(fabric = %key, "fabric deleted; stopping its task");
                        }
                        if step == FinalizerStep::Cleanup && !cleaning.contains_key(&key) {
                            let (c, m, done, k) = (
                                client.clone(),
                                metrics.clone(),
                                cleaned_tx.clone(),
                                key.clone(),
                            );
                            let h = tokio::spawn(async move {
                                // The fabric task ends before the keys go, so
                                // none of its writes lands after the delete.
                                if let Some(h) = running {
                                    h.stop().await;
                                }
                                cleanup(c, f, &m).await;
                                let _ = done.send(k);
                            });
                            cleaning.insert(key, AbortOnDrop(h));
                        }
                        continue;
                    }
                }
                let same = tasks.get(&key).is_some_and(|(spec, _)| *spec == f.spec);
                if !same {
                    // Dropping the old task's handle aborts it.
                    tasks.remove(&key);
                    tracing::info!(fabric = %key, "starting fabric task");
                    let h = tokio::spawn(fabric_task(client.clone(), f.clone(), metrics.clone()));
                    tasks.insert(key, (f.spec.clone(), AbortOnDrop(h)));
                }
            }
            Event::InitDone => {
                if let Some(keep) = relist.take() {
                    tasks.retain(|k, _| keep.contains(k));
                }
            }
            Event::Delete(f) => {
                let key = format!("{}/{}", f.namespace().unwrap_or_default(), f.name_any());
                if tasks.remove(&key).is_some() {
                    tracing::info!(fabric = %key, "stopping fabric task");
                }
            }
        }
    }
}

/// Adds [`FINALIZER`] (JSON patch: append, or create the list).
async fn add_finalizer(client: &Client, f: &KvFabric) -> kube::Result<()> {
    let api: Api<KvFabric> = Api::namespaced(client.clone(), &f.namespace().unwrap_or_default());
    let patch = if f
        .metadata
        .finalizers
        .as_ref()
        .is_some_and(|v| !v.is_empty())
    {
        json!([{"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER}])
    } else {
        json!([{"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]}])
    };
    let patch: json_patch::Patch =
        serde_json::from_value(patch).map_err(kube::Error::SerdeError)?;
    api.patch(
        &f.name_any(),
        &PatchParams::default(),
        &Patch::Json::<()>(patch),
    )
    .await
    .map(|_| ())
}

/// The finalizer's work: deletes the fabric's etcd keys (retrying with
/// backoff until etcd answers), records an Event, then removes
/// [`FINALIZER`] (a JSON patch that tests the entry it removes, so a
/// concurrent change of the list makes it fail and retry).
async fn cleanup(client: Client, f: KvFabric, metrics: &Metrics) {
    let name = f.name_any();
    let ns = f.namespace().unwrap_or_default();
    let fabric = f.fabric_name();
    let delete = async {
        let store = connect_store(&client, &f, metrics).await;
        let mut delay = RETRY_INITIAL;
        loop {
            match store.delete_fabric().await {
                Ok(n) => break n,
                Err(e) => {
                    metrics.errors.with_label_values(&["etcd"]).inc();
                    tracing::warn!(fabric = %name, error = %e, "deleting the fabric's etcd keys failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX);
                }
            }
        }
    };
    // Bounded: an etcd (or TLS Secret) gone for good, e.g. deleted with the
    // namespace, must not keep the KvFabric (and its namespace) Terminating.
    match tokio::time::timeout(CLEANUP_GIVE_UP, delete).await {
        Ok(deleted) => {
            tracing::info!(fabric = %name, keys = deleted, "fabric's etcd keys deleted");
            publish_event(
                &client,
                &f,
                EventType::Normal,
                "EtcdKeysDeleted",
                "Finalize",
                format!("deleted {deleted} keys under /kvfabric/{fabric}/"),
            )
            .await;
        }
        Err(_) => {
            tracing::error!(fabric = %name, "etcd unreachable for the whole cleanup bound; removing the finalizer, keys left");
            publish_event(
                &client,
                &f,
                EventType::Warning,
                "EtcdCleanupAbandoned",
                "Finalize",
                format!(
                    "etcd unreachable for {} s: keys under /kvfabric/{fabric}/ left in place (tombstones have no lease)",
                    CLEANUP_GIVE_UP.as_secs()
                ),
            )
            .await;
        }
    }
    let api: Api<KvFabric> = Api::namespaced(client, &ns);
    let mut delay = RETRY_INITIAL;
    loop {
        let current = match api.get_opt(&name).await {
            Ok(Some(c)) => c,
            Ok(None) => return,
            Err(e) => {
                metrics.errors.with_label_values(&["kube"]).inc();
                tracing::warn!(fabric = %name, error = %e, "reading the fabric failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RETRY_MAX);
                continue;
            }
        };
        let list = current.metadata.finalizers.clone().unwrap_or_default();
        let Some(i) = list.iter().position(|x| x == FINALIZER) else {
            return;
        };
        let patch: json_patch::Patch = match serde_json::from_value(json!([
            {"op": "test", "path": format!("/metadata/finalizers/{i}"), "value": FINALIZER},
            {"op": "remove", "path": format!("/metadata/finalizers/{i}")}
        ])) {
            Ok(p) => p,
            Err(_) => return,
        };
        match api
            .patch(&name, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
        {
            Ok(_) => {
                tracing::info!(fabric = %name, "finalizer removed");
                return;
            }
            Err(kube::Error::Api(e)) if e.code == 404 => return,
            Err(e) => {
                metrics.errors.with_label_values(&["kube"]).inc();
                tracing::warn!(fabric = %name, error = %e, "removing the finalizer failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RETRY_MAX);
            }
        }
    }
}

/// Records a Kubernetes Event on the `KvFabric` (events.k8s.io/v1),
/// bounded to 2 s; a failure is logged, never fatal.
async fn publish_event(
    client: &Client,
    f: &KvFabric,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    let reporter = Reporter {
        controller: "kvfabric-operator".into(),
        instance: std::env::var("POD_NAME").ok(),
    };
    let recorder = Recorder::new(client.clone(), reporter);
    let ev = KubeEvent {
        type_,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: action.into(),
        secondary: None,
    };
    let reference = f.object_ref(&());
    match tokio::time::timeout(Duration::from_secs(2), recorder.publish(&ev, &reference)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, reason, "publishing an Event failed"),
        Err(_) => tracing::warn!(reason, "publishing an Event timed out"),
    }
}

enum Msg {
    Reports(crate::reports::Poll),
    Pod(Role, Box<Event<Pod>>),
    Node(Box<Event<Node>>),
    Error(String),
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl AbortOnDrop {
    /// Aborts the task and waits until it has ended.
    async fn stop(mut self) {
        self.0.abort();
        let _ = (&mut self.0).await;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The etcd client TLS material of `f` (its `spec.etcd.tlsSecretRef`
/// Secret, read now), `None` without one.
///
/// # Errors
/// The Secret cannot be read, or lacks PEM `ca.crt`/`tls.crt`/`tls.key`.
async fn etcd_tls(client: &Client, f: &KvFabric) -> Result<Option<EtcdTls>, String> {
    let Some(name) = &f.spec.etcd.tls_secret_ref else {
        return Ok(None);
    };
    let ns = f.namespace().unwrap_or_default();
    let api: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let secret = tokio::time::timeout(ETCD_TIMEOUT, api.get(name))
        .await
        .map_err(|_| format!("etcd TLS Secret {ns}/{name}: read timed out"))?
        .map_err(|e| format!("etcd TLS Secret {ns}/{name}: {e}"))?;
    let data = secret
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect();
    EtcdTls::from_secret_data(&format!("{ns}/{name}"), &data).map(Some)
}

/// Connects to etcd for `f` (TLS from its Secret when it names one),
/// retrying with backoff until it answers; the first failure of each
/// attempt series is recorded as a Warning Event on the fabric.
async fn connect_store(client: &Client, f: &KvFabric, metrics: &Metrics) -> FabricStore {
    let fabric = f.fabric_name();
    let mut delay = RETRY_INITIAL;
    let mut warned = false;
    loop {
        let attempt = async {
            let tls = etcd_tls(client, f).await?;
            check_endpoints(&f.spec.etcd.endpoints, tls.is_some())?;
            FabricStore::connect(&f.spec.etcd.endpoints, &fabric, ETCD_TIMEOUT, tls.as_ref())
                .await
                .map_err(|e| e.to_string())
        };
        match attempt.await {
            Ok(s) => return s,
            Err(e) => {
                metrics.errors.with_label_values(&["etcd"]).inc();
                tracing::warn!(fabric, error = %e, "cannot connect to etcd; retrying");
                if !warned {
                    warned = true;
                    publish_event(
                        client,
                        f,
                        EventType::Warning,
                        "EtcdUnavailable",
                        "Connect",
                        e,
                    )
                    .await;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RETRY_MAX);
            }
        }
    }
}

/// One fabric: watches, decides, invalidates, reports.
async fn fabric_task(client: Client, fabric: KvFabric, metrics: Arc<Metrics>) {
    let ns = fabric.namespace().unwrap_or_default();
    let name = fabric.name_any();
    let fabric_name = fabric.fabric_name();
    let generation = fabric.metadata.generation.unwrap_or(0);
    let grace_ms = u64::from(fabric.spec.not_ready_grace_seconds) * 1000;
    let config_error = fabric
        .spec
        .bounce
        .as_ref()
        .and_then(|b| b.validate().err())
        .map(|e| e.to_string());
    // Unset: the agents' mounted configs rule; nothing rolls out. The
    // previous CRD defaulted the whole object to the agent's defaults (bounce
    // off) in every stored KvFabric: that exact value is not taken as a
    // request to manage (it would switch bounce off fleet-wide on upgrade).
    let stored_default = fabric
        .spec
        .bounce
        .as_ref()
        .is_some_and(crate::crd::is_stored_default);
    let managed = fabric.spec.bounce.is_some() && !stored_default;
    if stored_default {
        publish_event(
            &client,
            &fabric,
            EventType::Warning,
            "BounceConfigNotManaged",
            "Validate",
            "spec.bounce equals the agent defaults with bounce disabled (what the previous CRD stored for an unset field; either default arena/chunk pair, the seed's 256/32 MiB or today's 512/64 MiB, counts as default): not rolled out; set enabled: true (or any other key but grantPolicy to a non-default value) to have the operator manage it, or remove spec.bounce".into(),
        )
        .await;
    }
    if let Some(e) = &config_error {
        publish_event(
            &client,
            &fabric,
            EventType::Warning,
            "InvalidBounceConfig",
            "Validate",
            format!("bounce config refused: {e}"),
        )
        .await;
    }
    let fabric_api: Api<KvFabric> = Api::namespaced(client.clone(), &ns);

    let mut streams = Vec::new();
    for role in Role::ALL {
        let Some(sel) = selector_string(role.selector(&fabric.spec)) else {
            tracing::error!(fabric = %name, ?role, "unsupported selector operator; role not watched");
            continue;
        };
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let s = watcher::watcher(pods, watcher::Config::default().labels(&sel))
            .default_backoff()
            .map(move |r| match r {
                Ok(ev) => Msg::Pod(role, Box::new(ev)),
                Err(e) => Msg::Error(e.to_string()),
            })
            .boxed();
        streams.push(s);
    }
    let nodes: Api<Node> = Api::all(client.clone());
    streams.push(
        watcher::watcher(nodes, watcher::Config::default())
            .default_backoff()
            .map(|r| match r {
                Ok(ev) => Msg::Node(Box::new(ev)),
                Err(e) => Msg::Error(e.to_string()),
            })
            .boxed(),
    );
    let mut events = stream::select_all(streams);

    let store = connect_store(&client, &fabric, &metrics).await;
    if !managed {
        // Documents of an earlier managed spec would still win over the
        // mounted configs when agents restart.
        match store.delete_config_docs().await {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(fabric = %name, keys = n, "spec.bounce unset: rollout documents removed")
            }
            Err(e) => {
                tracing::warn!(fabric = %name, error = %e, "removing rollout documents failed")
            }
        }
    }
    // Agent reports, polled on a task of their own (a slow agent never
    // delays an invalidation); aborted with this task.
    let (report_tx, mut report_rx) = tokio::sync::mpsc::channel(1);
    let poller = {
        let store = store.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(crate::reports::POLL_INTERVAL).await;
                // Sent even when the agents could not be listed: the
                // Transferring window is re-evaluated at every poll.
                if report_tx
                    .send(crate::reports::poll(&store).await)
                    .await
                    .is_err()
                {
                    return;
                }
            }
        })
    };
    let _poller = AbortOnDrop(poller);
    let mut fleet = FleetStatus::default();
    let mut last_reports = BTreeMap::new();
    let mut last_moved_ms: Option<i64> = None;
    let mut indices: BTreeMap<Role, PeerIndex> = Role::ALL
        .iter()
        .map(|r| (*r, PeerIndex::new(grace_ms)))
        .collect();
    let mut pending: Vec<(Invalidation, Instant)> = Vec::new();
    let mut status = fabric.status.clone().unwrap_or_default();
    let mut etcd_error: Option<String> = None;
    let mut status_dirty = true;
    let mut retry_delay = RETRY_INITIAL;
    let mut rollout = RolloutStatus {
        unmanaged: !managed,
        ..RolloutStatus::default()
    };
    let mut next_rollout = Instant::now();

    loop {
        // Wake for the next event, the earliest grace deadline, or a retry.
        let next_deadline = indices.values().filter_map(PeerIndex::next_deadline).min();
        let mut wait = next_deadline
            .map(|d| Duration::from_millis(u64::try_from(d.saturating_sub(now_ms())).unwrap_or(0)))
            .unwrap_or(Duration::from_secs(30));
        if !pending.is_empty() {
            wait = wait.min(retry_delay);
        }
        if managed && config_error.is_none() {
            wait = wait.min(next_rollout.saturating_duration_since(Instant::now()));
        }
        if status_dirty {
            wait = Duration::ZERO;
        }
        let msg = tokio::select! {
            m = events.next() => match m {
                Some(m) => Some(m),
                None => return,
            },
            Some(r) = report_rx.recv() => Some(Msg::Reports(r)),
            _ = tokio::time::sleep(wait) => None,
        };
        let now = now_ms();
        let seen = Instant::now();
        let mut fresh = Vec::new();
        match msg {
            Some(Msg::Pod(role, ev)) => {
                if let Some(idx) = indices.get_mut(&role) {
                    fresh.extend(idx.pod_event(*ev, now));
                }
                status_dirty = true;
            }
            Some(Msg::Node(ev)) => {
                for idx in indices.values_mut() {
                    fresh.extend(idx.node_event((*ev).clone(), now));
                }
            }
            Some(Msg::Reports(poll)) => {
                use kvfabric_core::report::{carry_forward, fleet_view};
                let view = fleet_view(&last_reports, &poll.reports);
                if view.moved {
                    last_moved_ms = Some(now);
                }
                last_reports = carry_forward(&last_reports, poll.agents.as_deref(), &poll.reports);
                let next = FleetStatus {
                    observed: fleet.observed || view.answered > 0,
                    transferring: last_moved_ms
                        .is_some_and(|t| now.saturating_sub(t) <= TRANSFERRING_WINDOW_MS),
                    degraded: fleet_view(&BTreeMap::new(), &last_reports).degraded,
                };
                if next != fleet {
                    fleet = next;
                    status_dirty = true;
                }
            }
            Some(Msg::Error(e)) => {
                metrics.errors.with_label_values(&["watch"]).inc();
                tracing::warn!(fabric = %name, error = %e, "watch error; retrying");
            }
            None => {
                for idx in indices.values_mut() {
                    fresh.extend(idx.tick(now));
                }
            }
        }
        pending.extend(fresh.into_iter().map(|i| (i, seen)));
        metrics
            .reconciles
            .with_label_values(&[fabric_name.as_str()])
            .inc();

        // Carry out invalidations (oldest first); keep failures for retry.
        let mut failed = Vec::new();
        for (inv, seen) in pending.drain(..) {
            if !failed.is_empty() {
                failed.push((inv, seen));
                continue;
            }
            match store.invalidate(&inv).await {
                Ok(keys) => {
                    let dt = seen.elapsed();
                    let code = inv.reason.code();
                    metrics
                        .invalidation_seconds
                        .with_label_values(&[code])
                        .observe(dt.as_secs_f64());
                    metrics.invalidations.with_label_values(&[code]).inc();
                    metrics
                        .records_removed
                        .with_label_values(&[fabric_name.as_str()])
                        .inc_by(keys.len() as u64);
                    tracing::info!(
                        fabric = %name, pod = %inv.name, uid = %inv.uid, reason = %inv.reason,
                        removed = keys.len(), latency_ms = dt.as_secs_f64() * 1e3,
                        "peer invalidated"
                    );
                    {
                        let (c, f) = (client.clone(), fabric.clone());
                        let note = format!(
                            "pod {}/{} (uid {}) {}: {} record(s) removed in {:.1} ms",
                            inv.namespace,
                            inv.name,
                            inv.uid,
                            inv.reason,
                            keys.len(),
                            dt.as_secs_f64() * 1e3
                        );
                        tokio::spawn(async move {
                            publish_event(
                                &c,
                                &f,
                                EventType::Normal,
                                "PeerInvalidated",
                                "Invalidate",
                                note,
                            )
                            .await
                        });
                    }
                    status.peers_invalidated = status.peers_invalidated.saturating_add(1);
                    status.last_invalidation_latency_ms =
                        Some(u64::try_from(dt.as_micros().div_ceil(1000)).unwrap_or(u64::MAX));
                    status.last_invalidated = Some(format!(
                        "{}/{} ({})",
                        inv.namespace,
                        inv.name,
                        inv.reason.code()
                    ));
                    etcd_error = None;
                    retry_delay = RETRY_INITIAL;
                    status_dirty = true;
                }
                Err(e) => {
                    metrics.errors.with_label_values(&["etcd"]).inc();
                    tracing::warn!(fabric = %name, pod = %inv.name, error = %e, "invalidation failed; retrying");
                    if etcd_error.is_none() {
                        status_dirty = true;
                    }
                    etcd_error = Some(e.to_string());
                    retry_delay = (retry_delay * 2).min(RETRY_MAX);
                    failed.push((inv, seen));
                }
            }
        }
        pending = failed;

        // Config rollout: one step per tick (fast while it advances).
        if managed && config_error.is_none() && Instant::now() >= next_rollout {
            match rollout_step(&store, &client, &fabric, &rollout).await {
                Ok(next) => {
                    if next != rollout {
                        rollout = next;
                        status_dirty = true;
                    }
                    if etcd_error.take().is_some() {
                        status_dirty = true;
                    }
                }
                Err(e) => {
                    metrics.errors.with_label_values(&["etcd"]).inc();
                    tracing::warn!(fabric = %name, error = %e, "rollout step failed; retrying");
                    if etcd_error.is_none() {
                        status_dirty = true;
                    }
                    etcd_error = Some(e.to_string());
                }
            }
            next_rollout = Instant::now()
                + if rollout.complete() {
                    ROLLOUT_IDLE_PERIOD
                } else {
                    ROLLOUT_STEP_PERIOD
                };
        }

        if status_dirty {
            status_dirty = false;
            let count = |r: Role| {
                indices
                    .get(&r)
                    .map(|i| u32::try_from(i.ready_count()).unwrap_or(u32::MAX))
                    .unwrap_or(0)
            };
            status.prefill_ready = count(Role::Prefill);
            status.decode_ready = count(Role::Decode);
            status.agents_ready = count(Role::Agent);
            status.agents_total = indices
                .get(&Role::Agent)
                .map(|i| u32::try_from(i.len()).unwrap_or(u32::MAX))
                .unwrap_or(0);
            status.observed_generation = Some(generation);
            if rollout.known {
                status.config_generation = Some(rollout.generation);
                status.config_fingerprint = Some(rollout.fingerprint.clone());
                status.agents_at_desired_generation = rollout.at_desired;
                status.agent_records = rollout.total;
            }
            let t = Time(k8s_openapi::jiff::Timestamp::now());
            status.conditions = conditions(
                generation,
                config_error.as_deref(),
                etcd_error.as_deref(),
                &rollout,
                &fleet,
                &status.conditions,
                &t,
            );
            if let Err(e) = patch_status(&fabric_api, &name, &status).await {
                metrics.errors.with_label_values(&["kube"]).inc();
                tracing::warn!(fabric = %name, error = %e, "status update failed");
            }
        }
        metrics
            .reconcile_seconds
            .with_label_values(&[fabric_name.as_str()])
            .observe(seen.elapsed().as_secs_f64());
    }
}

/// Rollout step period while agents are moving to a new generation.
pub const ROLLOUT_STEP_PERIOD: Duration = Duration::from_millis(500);
/// Rollout step period once every agent runs the desired generation (new
/// agents get their document within it).
pub const ROLLOUT_IDLE_PERIOD: Duration = Duration::from_secs(2);

/// One rollout step (issue 14, item 4): writes the desired document when
/// the spec's config changed (a new generation; Event `RolloutStarted`),
/// assigns the desired document to the agents [`kvfabric_core::rollout::plan`]
/// lets move now (Event `RolloutStep` per agent that changes), and returns
/// where the rollout stands (Event `RolloutComplete` when it just ended).
async fn rollout_step(
    store: &FabricStore,
    client: &Client,
    fabric: &KvFabric,
    previous: &RolloutStatus,
) -> Result<RolloutStatus, crate::store::StoreError> {
    use kvfabric_core::rollout::{next_desired, plan};
    let read = store.read_rollout().await?;
    let Some(bounce) = &fabric.spec.bounce else {
        return Ok(previous.clone());
    };
    let floor = crate::store::highest_running_generation(&read.records);
    let desired = next_desired(read.desired.as_ref(), bounce, floor);
    if read.desired.as_ref() != Some(&desired) {
        store.put_desired(&desired).await?;
        tracing::info!(fabric = %fabric.name_any(), generation = desired.generation, fingerprint = %desired.fingerprint, "config rollout started");
        publish_event(
            client,
            fabric,
            EventType::Normal,
            "RolloutStarted",
            "Rollout",
            format!(
                "bounce config generation {} (fingerprint {}), {} agent(s) at a time",
                desired.generation, desired.fingerprint, fabric.spec.rollout.max_unavailable
            ),
        )
        .await;
    }
    let inputs = crate::store::rollout_inputs(&read.records, &read.documents, desired.generation);
    let p = plan(
        desired.generation,
        &inputs,
        fabric.spec.rollout.max_unavailable,
    );
    for id in &p.assign {
        store.assign(id, &desired).await?;
        let moving = inputs
            .iter()
            .any(|a| &a.logical_id == id && a.running_generation != desired.generation);
        if moving {
            tracing::info!(fabric = %fabric.name_any(), agent = %id, generation = desired.generation, "rollout: agent assigned the new generation");
            publish_event(
                client,
                fabric,
                EventType::Normal,
                "RolloutStep",
                "Rollout",
                format!(
                    "agent {id} → bounce config generation {}",
                    desired.generation
                ),
            )
            .await;
        }
    }
    let next = RolloutStatus {
        unmanaged: false,
        known: true,
        generation: desired.generation,
        fingerprint: desired.fingerprint.clone(),
        at_desired: p.at_desired,
        total: p.total,
        refused: crate::store::refusals(&read.records, desired.generation),
    };
    let was_complete = previous.complete() && previous.generation == next.generation;
    if next.complete() && !was_complete && next.total > 0 {
        publish_event(
            client,
            fabric,
            EventType::Normal,
            "RolloutComplete",
            "Rollout",
            format!(
                "{} agent(s) run bounce config generation {}",
                next.total, next.generation
            ),
        )
        .await;
    }
    Ok(next)
}

async fn patch_status(
    api: &Api<KvFabric>,
    name: &str,
    status: &KvFabricStatus,
) -> kube::Result<()> {
    let patch = json!({"status": status});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    #[test]
    fn selector_strings() {
        let sel = LabelSelector {
            match_labels: Some([("app".to_string(), "agent".to_string())].into()),
            match_expressions: Some(vec![
                LabelSelectorRequirement {
                    key: "tier".into(),
                    operator: "In".into(),
                    values: Some(vec!["a".into(), "b".into()]),
                },
                LabelSelectorRequirement {
                    key: "x".into(),
                    operator: "DoesNotExist".into(),
                    values: None,
                },
            ]),
        };
        assert_eq!(
            selector_string(&sel).as_deref(),
            Some("app=agent,tier in (a,b),!x")
        );
        assert_eq!(
            selector_string(&LabelSelector::default()).as_deref(),
            Some("")
        );
        let bad = LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "k".into(),
                operator: "Near".into(),
                values: None,
            }]),
            ..Default::default()
        };
        assert_eq!(selector_string(&bad), None);
    }

    #[test]
    fn ready_needs_traffic_and_transport_degraded_follows_reports() {
        let t = Time(k8s_openapi::jiff::Timestamp::from_second(100).unwrap());
        let get = |cs: &[Condition], ty: &str| {
            let c = cs.iter().find(|c| c.type_ == ty).unwrap();
            (c.status.clone(), c.reason.clone())
        };
        let unknown = conditions(
            1,
            None,
            None,
            &RolloutStatus::default(),
            &FleetStatus::default(),
            &[],
            &t,
        );
        assert_eq!(get(&unknown, "Transferring").0, "Unknown");
        assert_eq!(get(&unknown, "Ready").0, "False");
        let idle = FleetStatus {
            observed: true,
            ..Default::default()
        };
        let c = conditions(1, None, None, &RolloutStatus::default(), &idle, &[], &t);
        assert_eq!(
            get(&c, "Transferring"),
            ("False".into(), "NoBounceTraffic".into())
        );
        assert_eq!(get(&c, "Ready"), ("False".into(), "NoBounceTraffic".into()));
        assert_eq!(get(&c, "TransportDegraded").0, "False");
        let busy = FleetStatus {
            observed: true,
            transferring: true,
            degraded: vec![],
        };
        let c = conditions(1, None, None, &RolloutStatus::default(), &busy, &[], &t);
        assert_eq!(get(&c, "Ready"), ("True".into(), "AsExpected".into()));
        let slow = FleetStatus {
            degraded: vec!["p-1 → d-1".into()],
            ..busy.clone()
        };
        let c = conditions(1, None, None, &RolloutStatus::default(), &slow, &[], &t);
        assert_eq!(
            get(&c, "TransportDegraded"),
            ("True".into(), "SuspectTransportFallback".into())
        );
        let c = conditions(
            1,
            Some("bad"),
            None,
            &RolloutStatus::default(),
            &busy,
            &[],
            &t,
        );
        assert_eq!(get(&c, "Ready"), ("False".into(), "Degraded".into()));
    }

    #[test]
    fn rollout_states_drive_progressing_ready_and_degraded() {
        let t = Time(k8s_openapi::jiff::Timestamp::from_second(100).unwrap());
        let get = |cs: &[Condition], ty: &str| {
            let c = cs.iter().find(|c| c.type_ == ty).unwrap();
            (c.status.clone(), c.reason.clone())
        };
        let busy = FleetStatus {
            observed: true,
            transferring: true,
            degraded: vec![],
        };
        let run = |r: &RolloutStatus| conditions(1, None, None, r, &busy, &[], &t);
        let unmanaged = RolloutStatus {
            unmanaged: true,
            ..Default::default()
        };
        let c = run(&unmanaged);
        assert_eq!(
            get(&c, "Progressing"),
            ("False".into(), "ConfigNotManaged".into())
        );
        assert_eq!(get(&c, "Ready").0, "True");
        let rolling = RolloutStatus {
            known: true,
            generation: 3,
            fingerprint: "f".into(),
            at_desired: 1,
            total: 3,
            ..Default::default()
        };
        let c = run(&rolling);
        assert_eq!(get(&c, "Progressing"), ("True".into(), "RollingOut".into()));
        assert_eq!(get(&c, "Ready"), ("False".into(), "RollingOut".into()));
        assert!(c
            .iter()
            .any(|x| x.message.contains("1/3 agents at generation 3")));
        let refused = RolloutStatus {
            refused: vec!["a: generation 3: arena: out of memory".into()],
            ..rolling.clone()
        };
        let c = run(&refused);
        assert_eq!(get(&c, "Degraded"), ("True".into(), "ConfigRefused".into()));
        assert_eq!(
            get(&c, "Progressing"),
            ("False".into(), "RolloutHalted".into())
        );
        assert_eq!(get(&c, "Ready"), ("False".into(), "Degraded".into()));
        let done = RolloutStatus {
            at_desired: 3,
            ..rolling
        };
        let c = run(&done);
        assert_eq!(
            get(&c, "Progressing"),
            ("False".into(), "RolloutComplete".into())
        );
        assert_eq!(get(&c, "Ready"), ("True".into(), "AsExpected".into()));
    }

    #[test]
    fn finalizer_steps() {
        let ours = vec![FINALIZER.to_string()];
        let other = vec!["example.com/x".to_string()];
        assert_eq!(finalizer_step(false, &[]), FinalizerStep::Add);
        assert_eq!(finalizer_step(false, &other), FinalizerStep::Add);
        assert_eq!(finalizer_step(false, &ours), FinalizerStep::Run);
        assert_eq!(finalizer_step(true, &ours), FinalizerStep::Cleanup);
        assert_eq!(finalizer_step(true, &other), FinalizerStep::Gone);
    }

    #[test]
    fn conditions_keep_transition_times() {
        let t0 = Time(k8s_openapi::jiff::Timestamp::from_second(100).unwrap());
        let t1 = Time(k8s_openapi::jiff::Timestamp::from_second(200).unwrap());
        let f = FleetStatus::default();
        let c0 = conditions(1, None, None, &RolloutStatus::default(), &f, &[], &t0);
        assert_eq!(c0.len(), 5);
        let c1 = conditions(2, None, None, &RolloutStatus::default(), &f, &c0, &t1);
        assert!(c1.iter().all(|c| c.last_transition_time == t0));
        assert!(c1.iter().all(|c| c.observed_generation == Some(2)));
        let c2 = conditions(
            2,
            Some("arena too small"),
            None,
            &RolloutStatus::default(),
            &f,
            &c1,
            &t1,
        );
        let deg = c2.iter().find(|c| c.type_ == "Degraded").unwrap();
        assert_eq!(
            (deg.status.as_str(), deg.reason.as_str()),
            ("True", "InvalidBounceConfig")
        );
        assert_eq!(deg.last_transition_time, t1);
    }
}

#[cfg(test)]
#[path = "controller_scenarios.rs"]
mod scenarios;
