//! Pure decisions: pod and node state → what happens to the pod's peer.
//!
//! No client, no clock: the caller passes the time (`now_ms`, milliseconds
//! since the Unix epoch) and what it remembers of the pod
//! ([`PodHistory`]). A pod is dead for the fabric (issue 14, item 3) when
//! its deletionTimestamp is set (act then, not when the object vanishes),
//! its phase is Failed or Succeeded, it was Ready and has been not Ready
//! longer than the grace, a container restarted (restart count up), or its
//! node is NotReady or gone.

use k8s_openapi::api::core::v1::{Node, Pod};

/// Why a peer is invalidated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// `metadata.deletionTimestamp` is set (graceful deletion started).
    Deleting,
    /// The pod object was deleted and no earlier event had invalidated it.
    Deleted,
    /// A resync (re-list) no longer lists the pod: its DELETE was missed.
    Vanished,
    /// `status.phase` is `Failed`.
    Failed,
    /// `status.phase` is `Succeeded`.
    Succeeded,
    /// The pod was Ready and has been not Ready for this long,
    /// milliseconds (longer than the grace).
    NotReady {
        /// Time since the Ready condition turned false, milliseconds.
        for_ms: u64,
    },
    /// A container restarted: the summed restart count went up.
    Restarted {
        /// Restart count last seen.
        from: u32,
        /// Restart count now.
        to: u32,
    },
    /// The pod's node reports Ready ≠ True.
    NodeNotReady(String),
    /// The pod's node object is gone.
    NodeDeleted(String),
}

impl Reason {
    /// Short machine-readable form (Event reasons, tombstones, logs).
    pub fn code(&self) -> &'static str {
        match self {
            Reason::Deleting => "PodDeleting",
            Reason::Deleted => "PodDeleted",
            Reason::Vanished => "PodVanished",
            Reason::Failed => "PodFailed",
            Reason::Succeeded => "PodSucceeded",
            Reason::NotReady { .. } => "PodNotReady",
            Reason::Restarted { .. } => "ContainerRestarted",
            Reason::NodeNotReady(_) => "NodeNotReady",
            Reason::NodeDeleted(_) => "NodeDeleted",
        }
    }

    /// Whether the pod UID itself is dead (tombstoned). A container restart
    /// is not: the pod lives on with a new agent incarnation, so only the
    /// incarnations that started before the restart are removed. Nor is a
    /// node NotReady past the grace: the node may come back (a kubelet or
    /// network blip), so its pods' current records are removed but their
    /// UIDs are not tombstoned — a surviving agent republishes (found by
    /// the chaos suite: a 2 s Unknown blip used to tombstone every pod of
    /// the node for good).
    pub fn is_terminal(&self) -> bool {
        !matches!(self, Reason::Restarted { .. } | Reason::NodeNotReady(_))
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::NotReady { for_ms } => write!(f, "PodNotReady for {for_ms} ms"),
            Reason::Restarted { from, to } => write!(f, "ContainerRestarted {from}→{to}"),
            Reason::NodeNotReady(n) => write!(f, "NodeNotReady {n}"),
            Reason::NodeDeleted(n) => write!(f, "NodeDeleted {n}"),
            other => f.write_str(other.code()),
        }
    }
}

/// What to do with a pod's peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerAction {
    /// Leave it.
    Keep,
    /// Remove its records (and, when [`Reason::is_terminal`], tombstone
    /// its UID).
    Invalidate(Reason),
}

/// What the caller remembers of a pod between events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodHistory {
    /// Summed container restart count last seen; `None` before the first
    /// observation.
    pub restarts: Option<u32>,
    /// Whether the pod has ever been seen Ready (a pod that never was is
    /// starting, not dead).
    pub was_ready: bool,
    /// The pod was invalidated for the current NotReady episode of its
    /// node (once per episode; cleared when the node is Ready again).
    pub node_invalidated: bool,
    /// Its node was last seen NotReady.
    pub node_was_not_ready: bool,
    /// When its node turned Ready again after a NotReady episode (ms since
    /// the Unix epoch): the pod's own NotReady grace starts no earlier.
    pub node_recovered_ms: Option<i64>,
}

/// The state of the pod's node as the caller knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeState {
    /// Ready=True.
    Ready,
    /// Ready=False or Unknown, since `since_ms` (the condition's
    /// lastTransitionTime, or when the caller first saw it; ms since the
    /// Unix epoch).
    NotReady {
        /// Start of the NotReady episode.
        since_ms: Option<i64>,
    },
    /// Seen before, deleted since.
    Deleted,
    /// Not scheduled, or the node was never seen (no decision on it).
    Unknown,
}

/// [`NodeState`] of a node object: Ready condition True ⇒ Ready, False or
/// Unknown ⇒ NotReady (since its lastTransitionTime), no Ready condition at
/// all (a node that has not reported yet) ⇒ Unknown.
pub fn node_state(node: &Node) -> NodeState {
    let cond = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    match cond {
        Some(c) if c.status == "True" => NodeState::Ready,
        Some(c) => NodeState::NotReady {
            since_ms: c
                .last_transition_time
                .as_ref()
                .map(|t| t.0.as_millisecond()),
        },
        // A node that never reported (just registered): nothing runs on it
        // yet, so nothing to invalidate.
        None => NodeState::Unknown,
    }
}

/// Summed restart count of the pod's containers (init containers
/// included), saturating.
pub fn restart_count(pod: &Pod) -> u32 {
    let Some(st) = pod.status.as_ref() else {
        return 0;
    };
    st.container_statuses
        .iter()
        .flatten()
        .chain(st.init_container_statuses.iter().flatten())
        .map(|c| u32::try_from(c.restart_count).unwrap_or(0))
        .fold(0u32, u32::saturating_add)
}

/// Whether the pod's Ready condition is True, and since when (ms since the
/// Unix epoch, when the condition has a transition time).
pub fn ready(pod: &Pod) -> (bool, Option<i64>) {
    let cond = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    match cond {
        Some(c) => (
            c.status == "True",
            c.last_transition_time
                .as_ref()
                .map(|t| t.0.as_millisecond()),
        ),
        None => (false, None),
    }
}

/// The decision for `pod` on `node` at `now_ms` (ms since the Unix
/// epoch), with `grace_ms` the not-ready grace in milliseconds and
/// `history` what was seen before. Checks in order: deleting, terminal
/// phase, node, restart, not-ready past the grace.
pub fn decide(
    pod: &Pod,
    node: NodeState,
    now_ms: i64,
    grace_ms: u64,
    history: &PodHistory,
) -> PeerAction {
    if pod.metadata.deletion_timestamp.is_some() {
        return PeerAction::Invalidate(Reason::Deleting);
    }
    match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
        Some("Failed") => return PeerAction::Invalidate(Reason::Failed),
        Some("Succeeded") => return PeerAction::Invalidate(Reason::Succeeded),
        _ => {}
    }
    let node_name = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    match node {
        // Past the not-ready grace, once per episode (a blip shorter than
        // the grace changes nothing).
        NodeState::NotReady { since_ms } => {
            let for_ms = now_ms.saturating_sub(since_ms.unwrap_or(now_ms));
            if !history.node_invalidated && u64::try_from(for_ms).unwrap_or(0) > grace_ms {
                return PeerAction::Invalidate(Reason::NodeNotReady(node_name));
            }
            // While its node is NotReady the node rule alone decides: the
            // node lifecycle controller marks every pod of the node
            // Ready=False, which must not become a (terminal) PodNotReady.
            return PeerAction::Keep;
        }
        NodeState::Deleted => return PeerAction::Invalidate(Reason::NodeDeleted(node_name)),
        NodeState::Ready | NodeState::Unknown => {}
    }
    let now_restarts = restart_count(pod);
    if let Some(before) = history.restarts {
        if now_restarts > before {
            return PeerAction::Invalidate(Reason::Restarted {
                from: before,
                to: now_restarts,
            });
        }
    }
    let (is_ready, since) = ready(pod);
    if !is_ready && history.was_ready {
        // Without a transition time the condition's age is unknown: count
        // it as just turned (the next evaluation after the grace decides).
        // After a node NotReady episode the pod's NotReady counts from the
        // node's recovery (its kubelet has not re-marked it Ready yet).
        if let Some(since) = since.map(|s| s.max(history.node_recovered_ms.unwrap_or(i64::MIN))) {
            let for_ms = u64::try_from(now_ms.saturating_sub(since)).unwrap_or(0);
            if for_ms > grace_ms {
                return PeerAction::Invalidate(Reason::NotReady { for_ms });
            }
        }
    }
    PeerAction::Keep
}

/// When `decide` would next change its answer for a pod that is kept now
/// only because a not-ready grace (its own, or its node's) has not run
/// out: the deadline in ms since the Unix epoch, else `None`.
pub fn grace_deadline(
    pod: &Pod,
    node: NodeState,
    grace_ms: u64,
    history: &PodHistory,
) -> Option<i64> {
    let grace = i64::try_from(grace_ms).unwrap_or(i64::MAX);
    let node_deadline = match node {
        NodeState::NotReady {
            since_ms: Some(since),
        } if !history.node_invalidated => Some(since.saturating_add(grace).saturating_add(1)),
        _ => None,
    };
    let (is_ready, since) = ready(pod);
    let pod_deadline =
        if is_ready || !history.was_ready || matches!(node, NodeState::NotReady { .. }) {
            None
        } else {
            since
                .map(|s| s.max(history.node_recovered_ms.unwrap_or(i64::MIN)))
                .map(|s| s.saturating_add(grace).saturating_add(1))
        };
    node_deadline.into_iter().chain(pod_deadline).min()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ContainerStatus, NodeCondition, NodeStatus, PodCondition, PodSpec, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use k8s_openapi::jiff::Timestamp;

    pub(crate) fn time(ms: i64) -> Time {
        Time(Timestamp::from_millisecond(ms).expect("valid ms"))
    }

    /// A Running pod `name` (UID `uid-<name>`) on `node`, Ready as given
    /// (transition at `since_ms`), with `restarts`.
    pub(crate) fn pod(name: &str, node: &str, ready: bool, since_ms: i64, restarts: i32) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(format!("uid-{name}")),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    last_transition_time: Some(time(since_ms)),
                    ..Default::default()
                }]),
                container_statuses: Some(vec![ContainerStatus {
                    name: "agent".into(),
                    restart_count: restarts,
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        }
    }

    pub(crate) fn node(name: &str, ready: &str) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            status: Some(NodeStatus {
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: ready.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    const SEEN: PodHistory = PodHistory {
        restarts: Some(0),
        was_ready: true,
        node_invalidated: false,
        node_was_not_ready: false,
        node_recovered_ms: None,
    };

    #[test]
    fn healthy_pod_is_kept() {
        let p = pod("a", "n1", true, 0, 0);
        assert_eq!(
            decide(&p, NodeState::Ready, 1_000, 10_000, &SEEN),
            PeerAction::Keep
        );
        assert_eq!(
            decide(
                &p,
                NodeState::Unknown,
                1_000,
                10_000,
                &PodHistory::default()
            ),
            PeerAction::Keep
        );
    }

    #[test]
    fn deletion_timestamp_invalidates_at_once() {
        let mut p = pod("a", "n1", true, 0, 0);
        p.metadata.deletion_timestamp = Some(time(5));
        assert_eq!(
            decide(&p, NodeState::Ready, 6, 10_000, &SEEN),
            PeerAction::Invalidate(Reason::Deleting)
        );
    }

    #[test]
    fn terminal_phases_invalidate() {
        for (phase, reason) in [("Failed", Reason::Failed), ("Succeeded", Reason::Succeeded)] {
            let mut p = pod("a", "n1", true, 0, 0);
            p.status.as_mut().unwrap().phase = Some(phase.into());
            assert_eq!(
                decide(&p, NodeState::Ready, 1, 0, &SEEN),
                PeerAction::Invalidate(reason)
            );
        }
    }

    #[test]
    fn not_ready_only_past_the_grace_and_only_after_ready() {
        let p = pod("a", "n1", false, 1_000, 0);
        assert_eq!(
            decide(&p, NodeState::Ready, 11_000, 10_000, &SEEN),
            PeerAction::Keep
        );
        assert_eq!(
            decide(&p, NodeState::Ready, 11_001, 10_000, &SEEN),
            PeerAction::Invalidate(Reason::NotReady { for_ms: 10_001 })
        );
        assert_eq!(
            grace_deadline(&p, NodeState::Ready, 10_000, &SEEN),
            Some(11_001)
        );
        // Never Ready: starting, not dead.
        let starting = PodHistory {
            restarts: Some(0),
            was_ready: false,
            node_invalidated: false,
            node_was_not_ready: false,
            node_recovered_ms: None,
        };
        assert_eq!(
            decide(&p, NodeState::Ready, 99_000, 10_000, &starting),
            PeerAction::Keep
        );
        assert_eq!(
            grace_deadline(&p, NodeState::Ready, 10_000, &starting),
            None
        );
        // A clock behind the transition time never underflows.
        assert_eq!(decide(&p, NodeState::Ready, 0, 0, &SEEN), PeerAction::Keep);
    }

    #[test]
    fn restart_count_up_invalidates_incarnations_only() {
        let p = pod("a", "n1", true, 0, 2);
        let a = decide(
            &p,
            NodeState::Ready,
            1,
            0,
            &PodHistory {
                restarts: Some(1),
                was_ready: true,
                node_invalidated: false,
                node_was_not_ready: false,
                node_recovered_ms: None,
            },
        );
        assert_eq!(
            a,
            PeerAction::Invalidate(Reason::Restarted { from: 1, to: 2 })
        );
        if let PeerAction::Invalidate(r) = a {
            assert!(!r.is_terminal());
        }
        // First observation: nothing to compare with.
        assert_eq!(
            decide(&p, NodeState::Ready, 1, 0, &PodHistory::default()),
            PeerAction::Keep
        );
        // A negative count (bad input) counts as 0.
        let neg = pod("a", "n1", true, 0, -5);
        assert_eq!(restart_count(&neg), 0);
    }

    #[test]
    fn node_not_ready_or_deleted_invalidates() {
        let p = pod("a", "n1", true, 0, 0);
        assert_eq!(
            node_state(&node("n1", "Unknown")),
            NodeState::NotReady { since_ms: None }
        );
        assert_eq!(node_state(&node("n1", "True")), NodeState::Ready);
        assert_eq!(node_state(&Node::default()), NodeState::Unknown);
        let down = NodeState::NotReady {
            since_ms: Some(1_000),
        };
        // Within the grace (5 s): kept, with the node's deadline.
        assert_eq!(decide(&p, down, 6_000, 5_000, &SEEN), PeerAction::Keep);
        assert_eq!(grace_deadline(&p, down, 5_000, &SEEN), Some(6_001));
        // Past it: invalidated, not terminally (the node may come back).
        let r = decide(&p, down, 6_001, 5_000, &SEEN);
        assert_eq!(r, PeerAction::Invalidate(Reason::NodeNotReady("n1".into())));
        assert!(!Reason::NodeNotReady("n1".into()).is_terminal());
        // Once per episode.
        let done = PodHistory {
            node_invalidated: true,
            ..SEEN
        };
        assert_eq!(decide(&p, down, 60_000, 5_000, &done), PeerAction::Keep);
        assert_eq!(grace_deadline(&p, down, 5_000, &done), None);
        // The node lifecycle controller marks the pods Ready=False too:
        // while the node is NotReady that is no (terminal) PodNotReady.
        let marked = pod("a", "n1", false, 1_000, 0);
        assert_eq!(
            decide(&marked, down, 60_000, 5_000, &done),
            PeerAction::Keep
        );
        assert_eq!(grace_deadline(&marked, down, 5_000, &done), None);
        // Node Ready again at 60 s: the pod's grace starts then.
        let back = PodHistory {
            node_recovered_ms: Some(60_000),
            ..SEEN
        };
        assert_eq!(
            decide(&marked, NodeState::Ready, 64_000, 5_000, &back),
            PeerAction::Keep
        );
        assert_eq!(
            grace_deadline(&marked, NodeState::Ready, 5_000, &back),
            Some(65_001)
        );
        assert!(matches!(
            decide(&marked, NodeState::Ready, 65_001, 5_000, &back),
            PeerAction::Invalidate(Reason::NotReady { .. })
        ));
        assert_eq!(
            decide(&p, NodeState::Deleted, 1, 0, &SEEN),
            PeerAction::Invalidate(Reason::NodeDeleted("n1".into()))
        );
    }

    #[test]
    fn empty_pod_is_kept_without_panicking() {
        assert_eq!(
            decide(
                &Pod::default(),
                NodeState::Unknown,
                0,
                0,
                &PodHistory::default()
            ),
            PeerAction::Keep
        );
    }
}
