//! The agent's side of the generation-isolated config rollout (issue 14,
//! item 4; documents and pacing in [`kvfabric_core::rollout`]).
//!
//! The operator writes this agent's document `config/agents/<logical id>`;
//! [`follow`] applies each newer generation in process, at a safe point,
//! without restarting and without detaching engines:
//!
//! 1. **check** the document (generation, fingerprint, the bounce rules of
//!    [`BounceConfig::validate`](kvfabric_core::config::BounceConfig::validate));
//!    a refused one is published as the record's `config_error` and the
//!    running config stays;
//! 2. **same config** (only the generation moved): the handshake's
//!    generation changes in place, nothing is rebuilt; without bounce
//!    running nothing can be in flight, so the new config is built at once;
//! 3. otherwise **drain**: no new bounce work here, and the record is
//!    republished without a handshake so peers send no new WANTs (they keep
//!    their in-flight flows); wait until the transport has been idle for
//!    [`QUIET`] and at least [`MIN_DRAIN`] has passed since the republish
//!    (peers' watches see it), at most `requestTimeoutMs` + [`DRAIN_SLACK`];
//! 4. **rebuild** the arena and transport ([`FabricAgent::reconfigure`];
//!    the previous config comes back when the new one cannot be built);
//! 5. **republish** with the new handshake, generation and fingerprint.
//!
//! New transfers meanwhile take the standard path (mixed generations never
//! bounce), so nothing accepted fails.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use kvfabric_core::config::EffectiveBounceConfig;
use kvfabric_core::rollout::{fingerprint, ConfigDoc};

use super::daemon::Node;
use crate::runtime::fabric::{FabricAgent, Reconfigured};

/// The transport must have been idle this long before the arena is rebuilt.
pub const QUIET: Duration = Duration::from_millis(300);
/// At least this long between the draining republish and the rebuild, so
/// peers' discovery watches have seen it (the operator path's budget is
/// 1 s end to end).
pub const MIN_DRAIN: Duration = Duration::from_millis(1000);
/// Added to `requestTimeoutMs` to bound the drain: every in-flight request
/// resolves within its timeout, so the drain ends by then.
pub const DRAIN_SLACK: Duration = Duration::from_secs(2);

/// A checked document, ready to apply.
#[derive(Clone, Debug)]
pub struct Accepted {
    /// The document's generation.
    pub generation: u64,
    /// Its fingerprint.
    pub fingerprint: String,
    /// The validated config.
    pub config: EffectiveBounceConfig,
}

/// Decodes and checks one document value (JSON) against the generation in
/// force: `Ok(None)` when it is not newer (nothing to do).
///
/// # Errors
/// A message naming what is wrong: not JSON of the document schema, a
/// fingerprint that does not match, generation 0, or a bounce config that
/// breaks a rule.
pub fn check(value: &[u8], running_generation: u64) -> Result<Option<Accepted>, String> {
    let doc: ConfigDoc = serde_json::from_slice(value).map_err(|e| {
        // Tagged with the generation when it can be read at all, so the
        // operator sees the refusal of that generation.
        let tag = serde_json::from_slice::<serde_json::Value>(value)
            .ok()
            .and_then(|v| v.get("generation").and_then(serde_json::Value::as_u64))
            .map(|g| format!("generation {g}: "))
            .unwrap_or_default();
        format!("{tag}rollout document is not valid JSON of the document schema: {e}")
    })?;
    doc.check()
        .map_err(|e| format!("generation {}: rollout document: {e}", doc.generation))?;
    if doc.generation <= running_generation {
        return Ok(None);
    }
    let config = doc
        .bounce
        .validate()
        .map_err(|e| format!("generation {}: bounce: {e}", doc.generation))?;
    Ok(Some(Accepted {
        generation: doc.generation,
        fingerprint: doc.fingerprint,
        config,
    }))
}

/// The config an agent starts with: its own document if the store has a
/// valid one, else the fabric's desired document, else `seed` (the mounted
/// config, generation 0). Returns `(config, generation, where from)`.
pub fn initial(
    own: Option<&[u8]>,
    desired: Option<&[u8]>,
    seed: EffectiveBounceConfig,
) -> (EffectiveBounceConfig, u64, &'static str) {
    for (value, from) in [(own, "own rollout document"), (desired, "desired document")] {
        let Some(v) = value else { continue };
        match check(v, 0) {
            Ok(Some(a)) => return (a.config, a.generation, from),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(error = %e, source = from, "rollout document refused at start-up")
            }
        }
    }
    (seed, 0, "mounted config")
}

/// The rollout document (JSON) for `bounce` at `generation` — what the
/// operator writes to `config/agents/<logical id>`; `kvfabric config-doc`
/// prints it for fabrics run without the operator (`etcdctl put`).
///
/// # Errors
/// Generation 0 (reserved for mounted configs), or a bounce config that
/// breaks a rule (the message names the field).
pub fn document(
    generation: u64,
    bounce: kvfabric_core::config::BounceConfig,
) -> Result<String, String> {
    if generation == 0 {
        return Err("--generation must be at least 1 (0 means a mounted config)".into());
    }
    bounce.validate().map_err(|e| format!("bounce: {e}"))?;
    serde_json::to_string(&ConfigDoc::new(generation, bounce)).map_err(|e| e.to_string())
}

/// Fingerprint of the config `agent` runs.
pub fn running_fingerprint(agent: &FabricAgent) -> String {
    fingerprint(agent.bounce_config().config())
}

/// Applies one checked document to `node` (steps 2–5 of the module docs).
/// Blocking; bounded by `requestTimeoutMs` + [`DRAIN_SLACK`] + the rebuild.
/// `None` when a graceful shutdown began meanwhile (nothing is rebuilt or
/// republished then: the agent is leaving).
pub fn apply(node: &Node, doc: &Accepted) -> Option<Reconfigured> {
    let agent = node.agent();
    // Same config (only the generation moves), or no bounce running (no
    // bounce work can be in flight): no drain needed.
    if agent.bounce_config() == doc.config || agent.transport().is_none() {
        if node.state().is_shutting_down() {
            return None;
        }
        let r = agent.reconfigure(doc.config.clone(), doc.generation);
        publish_outcome(node, doc.generation, &r);
        return Some(r);
    }
    let t0 = Instant::now();
    agent.begin_drain();
    node.republish_config(&running_fingerprint(agent), "");
    let bound = Duration::from_millis(agent.bounce_config().request_timeout_ms()) + DRAIN_SLACK;
    let mut idle_since: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if agent.bounce_idle() {
            let since = *idle_since.get_or_insert(now);
            if now.duration_since(since) >= QUIET && now.duration_since(t0) >= MIN_DRAIN {
                break;
            }
        } else {
            idle_since = None;
        }
        if now.duration_since(t0) >= bound {
            tracing::warn!(agent = %agent.name(), ?bound, "in-flight bounce work did not drain before the rebuild; it resolves FAILURE");
            break;
        }
        if node.state().is_shutting_down() {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if node.state().is_shutting_down() {
        return None;
    }
    let drained = t0.elapsed();
    let r = agent.reconfigure(doc.config.clone(), doc.generation);
    publish_outcome(node, doc.generation, &r);
    tracing::info!(agent = %agent.name(), generation = doc.generation, drained_ms = drained.as_millis() as u64, result = ?r, "config rollout step applied");
    Some(r)
}

/// Republishes the record after a reconfiguration to `generation`: the
/// running fingerprint, and `config_error` naming the generation when it
/// was refused (rolled back, or bounce lost).
fn publish_outcome(node: &Node, generation: u64, r: &Reconfigured) {
    let error = match r {
        Reconfigured::Applied { .. } => String::new(),
        Reconfigured::RolledBack { why } | Reconfigured::BounceLost { why } => {
            format!("generation {generation}: {why}")
        }
    };
    node.republish_config(&running_fingerprint(node.agent()), &error);
}

/// Follows this agent's rollout document on a thread of its own: each
/// value newer than the generation in force is checked and applied; a
/// refused one is published as `config_error`. Ends when `rx` closes
/// (discovery stopped) or `node` is dropped.
///
/// `refused`: a document value refused already (at start-up); it is not
/// tried again.
pub fn follow(
    node: std::sync::Weak<Node>,
    rx: Receiver<Vec<u8>>,
    refused: Option<Vec<u8>>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("kvfabric-rollout".into())
        .spawn(move || {
            // A document refused once is not tried again when the store
            // resends it (every etcd resync does): its exact value is kept.
            let mut refused = refused;
            while let Ok(mut value) = rx.recv() {
                // Only the latest value matters.
                while let Ok(v) = rx.try_recv() {
                    value = v;
                }
                let Some(node) = node.upgrade() else { return };
                if node.state().is_shutting_down() {
                    return;
                }
                if refused.as_deref() == Some(value.as_slice()) {
                    continue;
                }
                let running = node.agent().config_generation();
                match check(&value, running) {
                    Ok(None) => {}
                    Ok(Some(doc)) => match apply(&node, &doc) {
                        Some(Reconfigured::Applied { .. }) | None => {}
                        Some(_) => refused = Some(value),
                    },
                    Err(e) => {
                        tracing::error!(agent = %node.agent().name(), error = %e, "rollout document refused; the running config stays");
                        node.republish_config(&running_fingerprint(node.agent()), &e);
                        refused = Some(value);
                    }
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfabric_core::config::BounceConfig;

    fn doc(generation: u64, f: impl FnOnce(&mut BounceConfig)) -> Vec<u8> {
        let mut b = BounceConfig {
            enabled: true,
            ..BounceConfig::default()
        };
        f(&mut b);
        serde_json::to_vec(&ConfigDoc::new(generation, b)).unwrap()
    }

    #[test]
    fn documents_are_checked_before_anything_is_applied() {
        assert!(check(&doc(2, |_| {}), 1).unwrap().is_some());
        assert!(check(&doc(2, |_| {}), 2).unwrap().is_none(), "not newer");
        let e = check(b"{", 0).unwrap_err();
        assert!(e.contains("not valid JSON"), "{e}");
        // Unreadable as a document but with a generation: tagged with it
        // (the operator matches `generation N:`).
        let e = check(br#"{"generation": 7, "bounce": {"noSuchKey": 1}}"#, 0).unwrap_err();
        assert!(e.starts_with("generation 7: "), "{e}");
        let mut tampered: serde_json::Value = serde_json::from_slice(&doc(3, |_| {})).unwrap();
        tampered["bounce"]["requestTimeoutMs"] = serde_json::json!(1234);
        let e = check(&serde_json::to_vec(&tampered).unwrap(), 0).unwrap_err();
        assert!(
            e.contains("fingerprint") && e.starts_with("generation 3: "),
            "{e}"
        );
        let e = check(&doc(4, |b| b.request_timeout_ms = 0), 0).unwrap_err();
        assert!(e.starts_with("generation 4: bounce:"), "{e}");
    }

    #[test]
    fn documents_printed_for_etcdctl_are_accepted_by_agents() {
        let b = BounceConfig {
            enabled: true,
            request_timeout_ms: 4321,
            ..BounceConfig::default()
        };
        let d = document(3, b).unwrap();
        let a = check(d.as_bytes(), 2).unwrap().expect("newer");
        assert_eq!((a.generation, a.config.request_timeout_ms()), (3, 4321));
        assert!(document(0, BounceConfig::default())
            .unwrap_err()
            .contains("--generation"));
        let bad = BounceConfig {
            request_timeout_ms: 0,
            ..BounceConfig::default()
        };
        assert!(document(1, bad).unwrap_err().contains("requestTimeoutMs"));
    }

    #[test]
    fn start_up_prefers_the_own_document_then_the_desired_one() {
        let seed = BounceConfig::default().validate().unwrap();
        let own = doc(5, |b| b.request_timeout_ms = 7000);
        let desired = doc(6, |b| b.request_timeout_ms = 8000);
        let (c, g, from) = initial(Some(&own), Some(&desired), seed.clone());
        assert_eq!((g, from), (5, "own rollout document"));
        assert_eq!(c.request_timeout_ms(), 7000);
        let (_, g, _) = initial(None, Some(&desired), seed.clone());
        assert_eq!(g, 6);
        let (c, g, from) = initial(Some(b"garbage"), None, seed.clone());
        assert_eq!((g, from), (0, "mounted config"));
        assert_eq!(c, seed);
    }
}
