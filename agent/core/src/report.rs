//! What an agent reports about itself to the operator (`GET /v1/report` on
//! its HTTP API), and the operator's pure reading of a fleet of reports
//! into the `Transferring` and `TransportDegraded` conditions (issue 14,
//! item 1: "a fabric that is healthy but moves nothing is not Ready"; "an
//! agent reports TCP or software emulation for a GPU path").

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One agent's report. Counters are cumulative since the agent started
/// (they restart at 0 with a new incarnation).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentReport {
    /// NIXL agent name (`<logical id>-<incarnation>`).
    pub agent: String,
    /// Config generation of the bounce config in force.
    #[serde(default)]
    pub config_generation: u64,
    /// Whether the bounce transport runs on this agent.
    #[serde(default)]
    pub bounce_active: bool,
    /// Bounce requests this agent sent that succeeded.
    #[serde(default)]
    pub bounce_succeeded_total: u64,
    /// Payload bytes of those, bytes.
    #[serde(default)]
    pub bounce_sent_bytes_total: u64,
    /// Chunks this agent received and scattered as a bounce receiver.
    #[serde(default)]
    pub bounce_chunks_scattered_total: u64,
    /// Peers whose transport probe judged the writes a likely silent
    /// fallback (TCP or software emulation on a GPU path), sorted.
    #[serde(default)]
    pub degraded_peers: Vec<String>,
}

impl AgentReport {
    /// The bounce activity counter compared between polls: requests sent
    /// plus chunks received (either moving means bounce traffic flows).
    pub fn activity(&self) -> u64 {
        self.bounce_succeeded_total
            .saturating_add(self.bounce_chunks_scattered_total)
    }
}

/// What the operator concludes from one poll of its agents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetView {
    /// Bounce traffic moved since the previous poll (some agent's
    /// [`AgentReport::activity`] grew under the same agent name).
    pub moved: bool,
    /// `agent → peer` pairs reported degraded, sorted.
    pub degraded: Vec<String>,
    /// Agents that answered.
    pub answered: usize,
}

/// Compares `now` (this poll's reports by agent name) with `before` (the
/// previous poll's). An agent seen for the first time (or a new
/// incarnation: a new name) does not count as movement: its counters have
/// no baseline. Pure.
pub fn fleet_view(
    before: &BTreeMap<String, AgentReport>,
    now: &BTreeMap<String, AgentReport>,
) -> FleetView {
    let moved = now.iter().any(|(name, r)| {
        before
            .get(name)
            .is_some_and(|b| r.activity() > b.activity())
    });
    let mut degraded: Vec<String> = now
        .values()
        .flat_map(|r| {
            r.degraded_peers
                .iter()
                .map(move |p| format!("{} → {p}", r.agent))
        })
        .collect();
    degraded.sort();
    FleetView {
        moved,
        degraded,
        answered: now.len(),
    }
}

/// The reports to keep after a poll: `fresh` (the agents that answered)
/// over `last`, where an agent that did not answer keeps its previous
/// report while it still has a record (`alive`: the agents listed this
/// poll; `None` when the list could not be read — nothing is dropped). So
/// one missed poll neither loses an agent's baseline nor makes its
/// degraded pairs flap. Pure.
pub fn carry_forward(
    last: &BTreeMap<String, AgentReport>,
    alive: Option<&[String]>,
    fresh: &BTreeMap<String, AgentReport>,
) -> BTreeMap<String, AgentReport> {
    let mut out: BTreeMap<String, AgentReport> = last
        .iter()
        .filter(|(k, _)| alive.is_none_or(|a| a.iter().any(|n| n == *k)))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    out.extend(fresh.iter().map(|(k, v)| (k.clone(), v.clone())));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rep(name: &str, sent: u64, scattered: u64, degraded: &[&str]) -> (String, AgentReport) {
        (
            name.to_string(),
            AgentReport {
                agent: name.into(),
                bounce_succeeded_total: sent,
                bounce_chunks_scattered_total: scattered,
                degraded_peers: degraded.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            },
        )
    }

    #[test]
    fn movement_needs_a_baseline_and_growth() {
        let before: BTreeMap<_, _> = [rep("p-1", 10, 0, &[]), rep("d-1", 0, 40, &[])].into();
        let same = before.clone();
        assert!(!fleet_view(&before, &same).moved);
        let grown: BTreeMap<_, _> = [rep("p-1", 10, 0, &[]), rep("d-1", 0, 41, &[])].into();
        assert!(fleet_view(&before, &grown).moved);
        // A new incarnation (new name) with large counters is no movement.
        let restarted: BTreeMap<_, _> = [rep("p-2", 99, 0, &[]), rep("d-1", 0, 40, &[])].into();
        assert!(!fleet_view(&before, &restarted).moved);
        assert!(!fleet_view(&BTreeMap::new(), &grown).moved);
    }

    #[test]
    fn degraded_pairs_are_listed() {
        let now: BTreeMap<_, _> = [rep("p-1", 0, 0, &["d-1", "d-2"]), rep("d-1", 0, 0, &[])].into();
        let v = fleet_view(&BTreeMap::new(), &now);
        assert_eq!(v.degraded, ["p-1 → d-1", "p-1 → d-2"]);
        assert_eq!(v.answered, 2);
    }

    #[test]
    fn a_missed_poll_keeps_the_baseline_and_the_degraded_pairs() {
        let last: BTreeMap<_, _> = [rep("p-1", 10, 0, &["d-1"]), rep("d-1", 0, 40, &[])].into();
        // p-1 did not answer this poll but is still listed.
        let fresh: BTreeMap<_, _> = [rep("d-1", 0, 40, &[])].into();
        let alive = ["p-1".to_string(), "d-1".to_string()];
        let kept = carry_forward(&last, Some(&alive), &fresh);
        assert_eq!(kept.len(), 2);
        assert_eq!(fleet_view(&BTreeMap::new(), &kept).degraded, ["p-1 → d-1"]);
        // It answers again, having moved: movement against the old baseline.
        let again: BTreeMap<_, _> = [rep("p-1", 12, 0, &["d-1"])].into();
        assert!(fleet_view(&kept, &again).moved);
        // Its record is gone: dropped. The list unreadable: nothing dropped.
        let gone = carry_forward(&last, Some(&["d-1".to_string()]), &fresh);
        assert_eq!(gone.keys().collect::<Vec<_>>(), ["d-1"]);
        assert_eq!(carry_forward(&last, None, &BTreeMap::new()), last);
    }

    #[test]
    fn report_json_tolerates_missing_fields() {
        let r: AgentReport = serde_yaml::from_str(r#"{"agent":"a-1"}"#).unwrap();
        assert_eq!(r.agent, "a-1");
        assert_eq!(r.activity(), 0);
    }
}
