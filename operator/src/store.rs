//! The fabric's etcd keys as the operator writes them.
//!
//! * agent records: `/kvfabric/<fabric>/agents/<name>` (written by the
//!   agents under their lease; JSON with `logical_id`, `started_at_ms` and,
//!   once agents carry it, `pod_uid`);
//! * tombstones: `/kvfabric/<fabric>/tombstones/<pod-uid>` (written here;
//!   a tombstoned UID is never loaded again);
//! * rollout documents: `/kvfabric/<fabric>/config/desired` and
//!   `/kvfabric/<fabric>/config/agents/<logical id>` (written here; see
//!   `kvfabric_core::rollout`).
//!
//! Which records an invalidation removes is decided by the pure
//! [`records_to_remove`]; [`FabricStore`] only does the IO (one etcd
//! transaction per invalidation: the deletes and the tombstone together).

use std::time::Duration;

use etcd_client::{Client, ConnectOptions, DeleteOptions, GetOptions, Txn, TxnOp};
use serde::{Deserialize, Serialize};

use crate::index::Invalidation;
use kvfabric_core::rollout::{AgentRollout, ConfigDoc, AGENTS_KEY_PREFIX, DESIRED_KEY};

/// `/kvfabric/<fabric>/agents/`.
pub fn agents_prefix(fabric: &str) -> String {
    format!("/kvfabric/{fabric}/agents/")
}

/// `/kvfabric/<fabric>/`: every key of the fabric (agents, engines,
/// tombstones); what the `KvFabric` finalizer deletes.
pub fn fabric_prefix(fabric: &str) -> String {
    format!("/kvfabric/{fabric}/")
}

/// `/kvfabric/<fabric>/tombstones/`.
pub fn tombstones_prefix(fabric: &str) -> String {
    format!("/kvfabric/{fabric}/tombstones/")
}

/// `/kvfabric/<fabric>/removals/`: a note per agent record the operator
/// removes without a tombstone (a restart, a node NotReady), put in the
/// removal's transaction and deleted right after, so agents label the
/// removal as the operator path with the pod event's time.
pub fn removals_prefix(fabric: &str) -> String {
    format!("/kvfabric/{fabric}/removals/")
}

/// The fields of an agent record the operator matches on (the agent's
/// `AgentRecord` has many more; unknown fields are ignored).
#[derive(Clone, Debug, Deserialize)]
struct RecordIdentity {
    logical_id: String,
    #[serde(default)]
    started_at_ms: u64,
    /// Pod UID, once agents publish it (issue 14 item 2).
    #[serde(default)]
    pod_uid: Option<String>,
}

/// The fields of an agent record the rollout reads.
#[derive(Clone, Debug, Deserialize)]
struct RecordConfig {
    logical_id: String,
    #[serde(default)]
    started_at_ms: u64,
    #[serde(default)]
    config_generation: u64,
    #[serde(default)]
    config_error: String,
}

/// The rollout's view of the agents (pure): one entry per logical id of
/// `records` (agent records, key and JSON value; the newest incarnation
/// wins), with the generation of its document among `documents`
/// (`config/agents/<logical id>` values keyed by logical id) and whether it
/// refused `desired` (its `config_error` names `generation <desired>:`).
/// Undecodable values are skipped.
pub fn rollout_inputs(
    records: &[(String, Vec<u8>)],
    documents: &[(String, Vec<u8>)],
    desired: u64,
) -> Vec<AgentRollout> {
    let newest = newest_records(records);
    let assigned: std::collections::BTreeMap<&str, u64> = documents
        .iter()
        .filter_map(|(id, v)| {
            serde_json::from_slice::<ConfigDoc>(v)
                .ok()
                .map(|d| (id.as_str(), d.generation))
        })
        .collect();
    let tag = format!("generation {desired}:");
    newest
        .into_values()
        .map(|r| AgentRollout {
            assigned_generation: assigned.get(r.logical_id.as_str()).copied(),
            refused: r.config_error.contains(&tag),
            running_generation: r.config_generation,
            logical_id: r.logical_id,
        })
        .collect()
}

/// The rollout's reads of one step.
#[derive(Clone, Debug, Default)]
pub struct RolloutRead {
    /// The desired document, when one was written.
    pub desired: Option<ConfigDoc>,
    /// Agent records (key, value).
    pub records: Vec<(String, Vec<u8>)>,
    /// Per-agent documents (logical id, value).
    pub documents: Vec<(String, Vec<u8>)>,
}

/// The newest incarnation's record per logical id (undecodable skipped).
fn newest_records(
    records: &[(String, Vec<u8>)],
) -> std::collections::BTreeMap<String, RecordConfig> {
    let mut newest: std::collections::BTreeMap<String, RecordConfig> = Default::default();
    for (_, v) in records {
        let Ok(r) = serde_json::from_slice::<RecordConfig>(v) else {
            continue;
        };
        match newest.get(&r.logical_id) {
            Some(p) if p.started_at_ms > r.started_at_ms => {}
            _ => {
                newest.insert(r.logical_id.clone(), r);
            }
        }
    }
    newest
}

/// `logical id: config_error` of the agents (newest incarnation each) that
/// refused generation `desired` (pure; sorted).
pub fn refusals(records: &[(String, Vec<u8>)], desired: u64) -> Vec<String> {
    let tag = format!("generation {desired}:");
    newest_records(records)
        .into_values()
        .filter(|r| r.config_error.contains(&tag))
        .map(|r| format!("{}: {}", r.logical_id, r.config_error))
        .collect()
}

/// The highest config generation any agent record says it runs (pure).
pub fn highest_running_generation(records: &[(String, Vec<u8>)]) -> u64 {
    newest_records(records)
        .values()
        .map(|r| r.config_generation)
        .max()
        .unwrap_or(0)
}

/// A tombstone's value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Tombstone {
    /// The dead pod's UID.
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub pod: String,
    /// [`crate::decide::Reason::code`].
    pub reason: String,
    /// When the operator saw the event, ms since the Unix epoch.
    pub observed_at_ms: i64,
}

/// The keys among `records` (key, JSON value) that `inv` removes: records
/// whose `pod_uid` is the pod's UID, or — for records without one — whose
/// `logical_id` is the pod's name; for a restart only incarnations that
/// started before [`Invalidation::started_before_ms`]. Undecodable values
/// are left alone.
pub fn records_to_remove(records: &[(String, Vec<u8>)], inv: &Invalidation) -> Vec<String> {
    records
        .iter()
        .filter_map(|(key, value)| {
            let rec: RecordIdentity = serde_json::from_slice(value).ok()?;
            let same_pod = match rec.pod_uid.as_deref() {
                Some(u) if !u.is_empty() => u == inv.uid,
                _ => !inv.name.is_empty() && rec.logical_id == inv.name,
            };
            let in_scope = match inv.started_before_ms {
                None => true,
                Some(cut) => i64::try_from(rec.started_at_ms).unwrap_or(i64::MAX) < cut,
            };
            (same_pod && in_scope).then(|| key.clone())
        })
        .collect()
}

/// Client TLS material for etcd (PEM), from the Secret named by
/// `spec.etcd.tlsSecretRef`.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// CA certificate(s) that signed etcd's serving certificate.
    pub ca_pem: Vec<u8>,
    /// This client's certificate.
    pub cert_pem: Vec<u8>,
    /// Its private key.
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("EtcdTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("cert_pem_bytes", &self.cert_pem.len())
            .finish_non_exhaustive()
    }
}

/// The keys of a TLS Secret [`EtcdTls::from_secret_data`] reads.
pub const TLS_SECRET_KEYS: [&str; 3] = ["ca.crt", "tls.crt", "tls.key"];

impl EtcdTls {
    /// Reads `ca.crt`, `tls.crt` and `tls.key` from a Secret's `data`.
    /// Pure.
    ///
    /// # Errors
    /// A message naming the Secret and every missing, empty or non-PEM key.
    pub fn from_secret_data(
        secret: &str,
        data: &std::collections::BTreeMap<String, Vec<u8>>,
    ) -> Result<Self, String> {
        let mut bad = Vec::new();
        let mut get = |k: &str| match data.get(k) {
            Some(v) if v.windows(11).any(|w| w == b"-----BEGIN ") => v.clone(),
            Some(_) => {
                bad.push(format!("{k} (not PEM)"));
                Vec::new()
            }
            None => {
                bad.push(format!("{k} (missing)"));
                Vec::new()
            }
        };
        let (ca_pem, cert_pem, key_pem) = (get("ca.crt"), get("tls.crt"), get("tls.key"));
        if !bad.is_empty() {
            return Err(format!(
                "etcd TLS Secret {secret}: {} (want PEM ca.crt, tls.crt, tls.key)",
                bad.join(", ")
            ));
        }
        Ok(Self {
            ca_pem,
            cert_pem,
            key_pem,
        })
    }
}

/// Checks that every endpoint's scheme matches the TLS setting: `https://`
/// with TLS, `http://` without. Pure.
///
/// # Errors
/// A message naming the first endpoint that does not.
pub fn check_endpoints(endpoints: &[String], tls: bool) -> Result<(), String> {
    let want = if tls { "https://" } else { "http://" };
    match endpoints.iter().find(|e| !e.starts_with(want)) {
        None => Ok(()),
        Some(e) => Err(format!(
            "etcd endpoint {e}: want {want}… ({})",
            if tls {
                "tlsSecretRef is set"
            } else {
                "set spec.etcd.tlsSecretRef for https"
            }
        )),
    }
}

/// Why an etcd step failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The etcd client failed (connect, request, timeout).
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// A request took longer than the bound.
    #[error("etcd request timed out after {0:?}")]
    Timeout(Duration),
}

/// The operator's etcd client for one fabric.
#[derive(Clone)]
pub struct FabricStore {
    client: Client,
    fabric: String,
    timeout: Duration,
}

impl FabricStore {
    /// Connects to `endpoints` for `fabric` (over TLS with client
    /// certificates when `tls` is given); every request is bounded by
    /// `timeout`.
    pub async fn connect(
        endpoints: &[String],
        fabric: &str,
        timeout: Duration,
        tls: Option<&EtcdTls>,
    ) -> Result<Self, StoreError> {
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        if let Some(t) = tls {
            opts = opts.with_tls(
                etcd_client::TlsOptions::new()
                    .ca_certificate(etcd_client::Certificate::from_pem(&t.ca_pem))
                    .identity(etcd_client::Identity::from_pem(&t.cert_pem, &t.key_pem)),
            );
        }
        let client = tokio::time::timeout(timeout, Client::connect(endpoints, Some(opts)))
            .await
            .map_err(|_| StoreError::Timeout(timeout))??;
        Ok(Self {
            client,
            fabric: fabric.to_string(),
            timeout,
        })
    }

    /// Every key under `prefix` (one bounded read).
    async fn get_prefix(&self, prefix: &str) -> Result<etcd_client::GetResponse, StoreError> {
        let mut kv = self.client.kv_client();
        Ok(tokio::time::timeout(
            self.timeout,
            kv.get(prefix, Some(GetOptions::new().with_prefix())),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout))??)
    }

    /// Deletes every key under `prefix` (bounded); how many went.
    async fn delete_prefix(&self, prefix: &str) -> Result<i64, StoreError> {
        let mut kv = self.client.kv_client();
        let resp = tokio::time::timeout(
            self.timeout,
            kv.delete(prefix, Some(DeleteOptions::new().with_prefix())),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout))??;
        Ok(resp.deleted())
    }

    /// `(agent name, HTTP base URL)` of every agent record of the fabric
    /// that publishes one (records that do not decode are skipped).
    pub async fn agent_http_urls(&self) -> Result<Vec<(String, String)>, StoreError> {
        #[derive(Deserialize)]
        struct Http {
            name: String,
            #[serde(default)]
            http: String,
        }
        let prefix = agents_prefix(&self.fabric);
        let resp = self.get_prefix(&prefix).await?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| serde_json::from_slice::<Http>(kv.value()).ok())
            .filter(|h| h.http.starts_with("http://") || h.http.starts_with("https://"))
            .map(|h| (h.name, h.http))
            .collect())
    }

    /// Deletes every key under [`fabric_prefix`] (the finalizer's cleanup).
    /// Returns how many keys were deleted.
    pub async fn delete_fabric(&self) -> Result<i64, StoreError> {
        let prefix = fabric_prefix(&self.fabric);
        self.delete_prefix(&prefix).await
    }

    /// Removes `inv`'s agent records and, for a terminal reason, writes its
    /// tombstone, in one transaction. Returns the removed keys.
    pub async fn invalidate(&self, inv: &Invalidation) -> Result<Vec<String>, StoreError> {
        let mut kv = self.client.kv_client();
        let prefix = agents_prefix(&self.fabric);
        let resp = self.get_prefix(&prefix).await?;
        let records: Vec<(String, Vec<u8>)> = resp
            .kvs()
            .iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.value().to_vec(),
                )
            })
            .collect();
        let keys = records_to_remove(&records, inv);
        let mut ops: Vec<TxnOp> = keys
            .iter()
            .map(|k| TxnOp::delete(k.as_str(), None))
            .collect();
        let noted: Vec<String> = if inv.reason.is_terminal() && !inv.uid.is_empty() {
            Vec::new()
        } else {
            // No tombstone (the pod lives on): a removal note per record,
            // first in the transaction like a tombstone.
            let agents = agents_prefix(&self.fabric);
            let note = serde_json::to_vec(&serde_json::json!({
                "observedAtMs": inv.observed_at_ms,
                "reason": inv.reason.code(),
            }))
            .unwrap_or_default();
            let notes: Vec<String> = keys
                .iter()
                .filter_map(|k| k.strip_prefix(agents.as_str()))
                .map(|name| format!("{}{name}", removals_prefix(&self.fabric)))
                .collect();
            for (i, n) in notes.iter().enumerate() {
                ops.insert(i, TxnOp::put(n.as_str(), note.clone(), None));
            }
            notes
        };
        if inv.reason.is_terminal() && !inv.uid.is_empty() {
            let t = Tombstone {
                uid: inv.uid.clone(),
                namespace: inv.namespace.clone(),
                pod: inv.name.clone(),
                reason: inv.reason.code().to_string(),
                observed_at_ms: inv.observed_at_ms,
            };
            let value = serde_json::to_vec(&t).unwrap_or_default();
            let key = format!("{}{}", tombstones_prefix(&self.fabric), inv.uid);
            // First in the transaction: agents read a removal that follows
            // its tombstone (same revision) as the operator path.
            ops.insert(0, TxnOp::put(key, value, None));
        }
        if !ops.is_empty() {
            tokio::time::timeout(self.timeout, kv.txn(Txn::new().and_then(ops)))
                .await
                .map_err(|_| StoreError::Timeout(self.timeout))??;
        }
        if !noted.is_empty() {
            // Watchers saw the notes with the removal (one revision); they
            // are not state. Best effort: the finalizer removes leftovers.
            let dels: Vec<TxnOp> = noted
                .iter()
                .map(|n| TxnOp::delete(n.as_str(), None))
                .collect();
            let _ = tokio::time::timeout(self.timeout, kv.txn(Txn::new().and_then(dels))).await;
        }
        Ok(keys)
    }

    /// Reads what a rollout step needs: the desired document, the agent
    /// records and the per-agent documents (one prefix read).
    pub async fn read_rollout(&self) -> Result<RolloutRead, StoreError> {
        let prefix = fabric_prefix(&self.fabric);
        let resp = self.get_prefix(&prefix).await?;
        let agents = agents_prefix(&self.fabric);
        let docs = format!("{prefix}{AGENTS_KEY_PREFIX}");
        let desired_key = format!("{prefix}{DESIRED_KEY}");
        let mut out = RolloutRead::default();
        for e in resp.kvs() {
            let key = String::from_utf8_lossy(e.key()).into_owned();
            if key == desired_key {
                out.desired = serde_json::from_slice(e.value()).ok();
            } else if key.starts_with(&agents) {
                out.records.push((key, e.value().to_vec()));
            } else if let Some(id) = key.strip_prefix(&docs) {
                out.documents.push((id.to_string(), e.value().to_vec()));
            }
        }
        Ok(out)
    }

    /// Writes the desired document.
    pub async fn put_desired(&self, doc: &ConfigDoc) -> Result<(), StoreError> {
        let key = format!("{}{DESIRED_KEY}", fabric_prefix(&self.fabric));
        self.put_json(key, doc).await
    }

    /// Deletes every rollout document (`config/`): a fabric whose
    /// `spec.bounce` is unset leaves the agents on their mounted configs,
    /// also when they restart. Returns how many keys went.
    pub async fn delete_config_docs(&self) -> Result<i64, StoreError> {
        let prefix = format!("{}config/", fabric_prefix(&self.fabric));
        self.delete_prefix(&prefix).await
    }

    /// Writes `logical_id`'s document (the agent applies it).
    pub async fn assign(&self, logical_id: &str, doc: &ConfigDoc) -> Result<(), StoreError> {
        let key = format!(
            "{}{AGENTS_KEY_PREFIX}{logical_id}",
            fabric_prefix(&self.fabric)
        );
        self.put_json(key, doc).await
    }

    async fn put_json(&self, key: String, doc: &ConfigDoc) -> Result<(), StoreError> {
        let value = serde_json::to_vec(doc).unwrap_or_default();
        let mut kv = self.client.kv_client();
        tokio::time::timeout(self.timeout, kv.put(key, value, None))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))??;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::Reason;

    fn inv(name: &str, uid: &str, before: Option<i64>) -> Invalidation {
        Invalidation {
            uid: uid.into(),
            namespace: "ns".into(),
            name: name.into(),
            reason: if before.is_some() {
                Reason::Restarted { from: 0, to: 1 }
            } else {
                Reason::Deleting
            },
            started_before_ms: before,
            observed_at_ms: 0,
        }
    }

    fn rec(key: &str, logical: &str, started: u64, uid: Option<&str>) -> (String, Vec<u8>) {
        let mut v =
            serde_json::json!({"logical_id": logical, "started_at_ms": started, "name": key});
        if let Some(u) = uid {
            v["pod_uid"] = u.into();
        }
        (key.to_string(), serde_json::to_vec(&v).unwrap())
    }

    #[test]
    fn rollout_inputs_take_the_newest_incarnation_and_the_documents() {
        let rec = |logical: &str, started: u64, gen: u64, err: &str| {
            (
                format!("/kvfabric/f/agents/{logical}-{started}"),
                serde_json::to_vec(&serde_json::json!({
                    "logical_id": logical, "started_at_ms": started,
                    "config_generation": gen, "config_error": err,
                }))
                .unwrap(),
            )
        };
        let doc = |g| serde_json::to_vec(&ConfigDoc::new(g, Default::default())).unwrap();
        let records = vec![
            rec("a", 1, 1, ""),
            rec("a", 2, 2, ""),
            rec("b", 1, 1, "generation 2: arena: out of memory"),
            rec("c", 1, 1, "generation 1: old news"),
            ("/kvfabric/f/agents/x".into(), b"garbage".to_vec()),
        ];
        let documents = vec![("a".to_string(), doc(2)), ("b".to_string(), doc(2))];
        let v = rollout_inputs(&records, &documents, 2);
        assert_eq!(
            v,
            vec![
                AgentRollout {
                    logical_id: "a".into(),
                    running_generation: 2,
                    assigned_generation: Some(2),
                    refused: false
                },
                AgentRollout {
                    logical_id: "b".into(),
                    running_generation: 1,
                    assigned_generation: Some(2),
                    refused: true
                },
                AgentRollout {
                    logical_id: "c".into(),
                    running_generation: 1,
                    assigned_generation: None,
                    refused: false
                },
            ]
        );
    }

    #[test]
    fn tls_secret_keys_and_endpoint_schemes() {
        let pem = b"-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n".to_vec();
        let mut data = std::collections::BTreeMap::new();
        data.insert("ca.crt".to_string(), pem.clone());
        data.insert("tls.crt".to_string(), pem.clone());
        let e = EtcdTls::from_secret_data("etcd-client", &data).unwrap_err();
        assert!(
            e.contains("etcd-client") && e.contains("tls.key (missing)"),
            "{e}"
        );
        data.insert("tls.key".to_string(), b"not pem".to_vec());
        let e = EtcdTls::from_secret_data("etcd-client", &data).unwrap_err();
        assert!(e.contains("tls.key (not PEM)"), "{e}");
        data.insert("tls.key".to_string(), pem.clone());
        let t = EtcdTls::from_secret_data("etcd-client", &data).unwrap();
        assert!(!format!("{t:?}").contains("BEGIN"), "key material printed");
        assert!(check_endpoints(&["https://e:2379".into()], true).is_ok());
        assert!(check_endpoints(&["http://e:2379".into()], true)
            .unwrap_err()
            .contains("http://e:2379"));
        assert!(check_endpoints(&["https://e:2379".into()], false).is_err());
    }

    #[test]
    fn matches_by_uid_then_logical_id() {
        let recs = vec![
            rec("a-1", "a", 1, None),
            rec("a-2", "a", 2, Some("uid-old")),
            rec("a-3", "a", 3, Some("uid-a")),
            rec("b-1", "b", 1, None),
            ("junk".into(), b"not json".to_vec()),
        ];
        assert_eq!(
            records_to_remove(&recs, &inv("a", "uid-a", None)),
            ["a-1", "a-3"]
        );
        assert!(records_to_remove(&recs, &inv("", "uid-x", None)).is_empty());
    }

    #[test]
    fn restart_scope_keeps_newer_incarnations() {
        let recs = vec![rec("a-1", "a", 1_000, None), rec("a-2", "a", 9_500, None)];
        assert_eq!(
            records_to_remove(&recs, &inv("a", "uid-a", Some(9_000))),
            ["a-1"]
        );
    }
}
