//! Generation-isolated config rollout (issue 14, item 4): the documents the
//! operator writes to etcd, the config fingerprint, and the pure pacing
//! decision (which agents may move to the desired generation now).
//!
//! etcd is the source of truth (keys under the fabric prefix
//! `/kvfabric/<fabric>/`):
//!
//! | key | value | writer |
//! |---|---|---|
//! | `config/desired` | [`ConfigDoc`]: the fabric's desired config, its generation and fingerprint | operator |
//! | `config/agents/<logical id>` | [`ConfigDoc`]: the config this agent is allowed to run now | operator (paced by [`plan`]) |
//!
//! An agent applies its `config/agents/<logical id>` document in process at
//! a safe point (stop taking new bounce work, drain, rebuild the arena,
//! republish with the new generation) and publishes the generation and
//! fingerprint it runs in its discovery record; the operator reads those
//! back. Bounce runs only between agents of the same generation; mixed
//! pairs use the standard path, so a rollout that advances `maxUnavailable`
//! agents at a time fails nothing. A mounted config only seeds an agent
//! that starts before the operator has written a document for it.

use serde::{Deserialize, Serialize};

use crate::config::BounceConfig;

/// Key of the desired document, relative to the fabric prefix.
pub const DESIRED_KEY: &str = "config/desired";
/// Prefix of the per-agent documents, relative to the fabric prefix.
pub const AGENTS_KEY_PREFIX: &str = "config/agents/";

/// One config document (JSON in etcd, camelCase).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigDoc {
    /// Rollout generation, ≥ 1 (0 is "never rolled out": a seeded agent).
    pub generation: u64,
    /// [`fingerprint`] of `bounce`.
    pub fingerprint: String,
    /// The bounce config (the agent's own schema).
    pub bounce: BounceConfig,
}

impl ConfigDoc {
    /// A document for `bounce` at `generation` (fingerprint computed).
    pub fn new(generation: u64, bounce: BounceConfig) -> Self {
        Self {
            generation,
            fingerprint: fingerprint(&bounce),
            bounce,
        }
    }

    /// Checks the document: generation ≥ 1 and the fingerprint matching
    /// the config (a document edited by hand, or corrupted, is refused).
    ///
    /// # Errors
    /// A message naming the field that is wrong.
    pub fn check(&self) -> Result<(), String> {
        if self.generation == 0 {
            return Err("generation must be >= 1".into());
        }
        let fp = fingerprint(&self.bounce);
        if fp != self.fingerprint {
            return Err(format!(
                "fingerprint {:?} does not match the config (computed {fp:?})",
                self.fingerprint
            ));
        }
        Ok(())
    }
}

/// A stable 64-bit fingerprint of a bounce config, 16 lowercase hex digits:
/// FNV-1a over its canonical YAML form (fields in declaration order, byte
/// sizes as integers), so two configs that serialize alike have the same
/// fingerprint whatever form (env, YAML, CRD) they came from.
pub fn fingerprint(config: &BounceConfig) -> String {
    let text = serde_yaml::to_string(config).unwrap_or_default();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The next desired document: `previous` when its fingerprint matches
/// `bounce` (no new generation), else `bounce` at a generation above both
/// `previous`'s and `running_floor` — the highest generation any agent
/// runs — so a fabric whose documents were lost (its `KvFabric` deleted
/// and created again while agents kept running) still moves every agent
/// (agents apply only newer generations).
pub fn next_desired(
    previous: Option<&ConfigDoc>,
    bounce: &BounceConfig,
    running_floor: u64,
) -> ConfigDoc {
    let fp = fingerprint(bounce);
    match previous {
        Some(p) if p.fingerprint == fp && p.generation >= running_floor => p.clone(),
        _ => {
            let base = previous.map_or(0, |p| p.generation).max(running_floor);
            ConfigDoc::new(base.saturating_add(1), bounce.clone())
        }
    }
}

/// What the operator knows of one agent for pacing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentRollout {
    /// The agent's logical id (its `config/agents/` key).
    pub logical_id: String,
    /// Generation its discovery record says it runs (0 = seeded).
    pub running_generation: u64,
    /// Generation of its `config/agents/` document, if any.
    pub assigned_generation: Option<u64>,
    /// The agent refused its assigned document (`config_error` in its
    /// record is non-empty for that generation).
    pub refused: bool,
}

/// The pacing decision of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RolloutPlan {
    /// Logical ids to assign the desired document to now (sorted).
    pub assign: Vec<String>,
    /// Agents running the desired generation.
    pub at_desired: u32,
    /// Agents considered (those with a live record).
    pub total: u32,
    /// Agents assigned the desired generation but not running it yet
    /// (the rollout's unavailable budget in use).
    pub in_progress: u32,
    /// Agents that refused the desired document (the rollout halts:
    /// nothing new is assigned while any refuses).
    pub refused: Vec<String>,
}

impl RolloutPlan {
    /// Every agent runs the desired generation.
    pub fn complete(&self) -> bool {
        self.at_desired == self.total
    }
}

/// Pacing (pure): agents at `desired` count as done; agents assigned
/// `desired` but not running it are in progress and use the budget;
/// `max_unavailable` (≥ 1; 0 is taken as 1) bounds how many are in
/// progress at once. Candidates are taken in logical-id order. Nothing new
/// is assigned while an agent refuses the desired document (its reason is
/// surfaced as Degraded by the caller) — the rest keeps the running config.
pub fn plan(desired: u64, agents: &[AgentRollout], max_unavailable: u32) -> RolloutPlan {
    let mut p = RolloutPlan {
        total: u32::try_from(agents.len()).unwrap_or(u32::MAX),
        ..RolloutPlan::default()
    };
    let mut candidates = Vec::new();
    for a in agents {
        if a.running_generation == desired {
            p.at_desired += 1;
        } else if a.assigned_generation == Some(desired) {
            if a.refused {
                p.refused.push(a.logical_id.clone());
            } else {
                p.in_progress += 1;
            }
        } else {
            candidates.push(a.logical_id.clone());
        }
    }
    // An agent running `desired` whose document is older (it started from
    // the desired key) needs its own document written, at no cost.
    let mut free: Vec<String> = agents
        .iter()
        .filter(|a| a.running_generation == desired && a.assigned_generation != Some(desired))
        .map(|a| a.logical_id.clone())
        .collect();
    if p.refused.is_empty() {
        candidates.sort();
        let budget = max_unavailable.max(1).saturating_sub(p.in_progress) as usize;
        free.extend(candidates.into_iter().take(budget));
    }
    free.sort();
    p.refused.sort();
    p.assign = free;
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(id: &str, running: u64, assigned: Option<u64>) -> AgentRollout {
        AgentRollout {
            logical_id: id.into(),
            running_generation: running,
            assigned_generation: assigned,
            refused: false,
        }
    }

    #[test]
    fn fingerprint_is_stable_and_sensitive() {
        let a = BounceConfig::default();
        let mut b = a.clone();
        assert_eq!(fingerprint(&a), fingerprint(&a.clone()));
        assert_eq!(fingerprint(&a).len(), 16);
        b.request_timeout_ms += 1;
        assert_ne!(fingerprint(&a), fingerprint(&b));
    }

    #[test]
    fn desired_generation_moves_only_with_the_config() {
        let a = BounceConfig::default();
        let d1 = next_desired(None, &a, 0);
        assert_eq!(d1.generation, 1);
        assert_eq!(next_desired(Some(&d1), &a, 1), d1);
        let mut b = a.clone();
        b.request_timeout_ms += 1;
        let d2 = next_desired(Some(&d1), &b, 1);
        assert_eq!(d2.generation, 2);
        // Documents lost while agents run generation 7: the next is 8.
        assert_eq!(next_desired(None, &a, 7).generation, 8);
        assert_eq!(next_desired(Some(&d1), &a, 7).generation, 8);
        assert!(d2.check().is_ok());
        let mut bad = d2.clone();
        bad.bounce.request_timeout_ms += 1;
        assert!(bad.check().unwrap_err().contains("fingerprint"));
        bad = d2.clone();
        bad.generation = 0;
        assert!(bad.check().is_err());
    }

    #[test]
    fn pacing_keeps_at_most_max_unavailable_in_progress() {
        let agents = vec![
            agent("c", 1, Some(1)),
            agent("a", 1, Some(1)),
            agent("b", 1, Some(1)),
        ];
        let p = plan(2, &agents, 1);
        assert_eq!(p.assign, vec!["a"]);
        assert!(!p.complete());
        // a assigned, not there yet: nothing more.
        let agents = vec![
            agent("a", 1, Some(2)),
            agent("b", 1, Some(1)),
            agent("c", 1, Some(1)),
        ];
        let p = plan(2, &agents, 1);
        assert!(p.assign.is_empty());
        assert_eq!(p.in_progress, 1);
        // a done: next one.
        let agents = vec![
            agent("a", 2, Some(2)),
            agent("b", 1, Some(1)),
            agent("c", 1, Some(1)),
        ];
        let p = plan(2, &agents, 1);
        assert_eq!(p.assign, vec!["b"]);
        assert_eq!(p.at_desired, 1);
        // budget 2
        let p = plan(2, &agents, 2);
        assert_eq!(p.assign, vec!["b", "c"]);
        // 0 is taken as 1
        assert_eq!(plan(2, &agents, 0).assign, vec!["b"]);
        let done = vec![agent("a", 2, Some(2)), agent("b", 2, Some(2))];
        let p = plan(2, &done, 1);
        assert!(p.complete() && p.assign.is_empty());
    }

    #[test]
    fn an_agent_already_at_desired_gets_its_document_for_free() {
        let agents = vec![agent("new", 3, None), agent("old", 2, Some(2))];
        let p = plan(3, &agents, 1);
        assert_eq!(p.assign, vec!["new", "old"]);
    }

    #[test]
    fn a_refusal_halts_the_rollout() {
        let mut a = agent("a", 1, Some(2));
        a.refused = true;
        let agents = vec![a, agent("b", 1, Some(1))];
        let p = plan(2, &agents, 3);
        assert!(p.assign.is_empty());
        assert_eq!(p.refused, vec!["a"]);
        assert_eq!(p.in_progress, 0);
    }

    #[test]
    fn documents_round_trip_as_camel_case_json_shapes() {
        let d = ConfigDoc::new(4, BounceConfig::default());
        let y = serde_yaml::to_string(&d).unwrap();
        assert!(y.contains("generation: 4") && y.contains("fingerprint:"));
        let back: ConfigDoc = serde_yaml::from_str(&y).unwrap();
        assert_eq!(back, d);
    }
}
