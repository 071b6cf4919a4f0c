//! The peer index: pure state fed by watch events (linkerd's policy
//! controller style), yielding the pods whose peers must be invalidated.
//!
//! Watch semantics are explicit ([`kube::runtime::watcher::Event`]):
//! `Init` starts a re-list, `InitApply` carries each listed object,
//! `InitDone` ends it — and every pod known before but not re-listed is
//! treated as deleted ([`Reason::Vanished`]), so a DELETE missed while the
//! watch was down cannot keep a dead pod a peer. Nodes follow the same
//! rules; a node missing from a re-list is deleted.
//!
//! Time is an argument (`now_ms`, ms since the Unix epoch); the not-ready
//! grace is re-evaluated by [`PeerIndex::tick`], whose next useful call is
//! [`PeerIndex::next_deadline`].

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::watcher::Event;

use crate::decide::{self, NodeState, PeerAction, PodHistory, Reason};

/// One peer to invalidate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalidation {
    /// Pod UID (the peer identity).
    pub uid: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name (the agent's logical id).
    pub name: String,
    /// Why.
    pub reason: Reason,
    /// For a non-terminal reason (restart): only agent incarnations that
    /// started before this time (ms since the Unix epoch) are removed;
    /// `None` removes all of the pod's records.
    pub started_before_ms: Option<i64>,
    /// When the event that caused it was fed in (ms since the Unix epoch).
    pub observed_at_ms: i64,
}

#[derive(Clone, Debug)]
struct PodEntry {
    pod: Pod,
    history: PodHistory,
    /// Terminally invalidated: never yielded again.
    invalidated: bool,
}

/// Pods (by UID) and nodes (by name) of one selector, with the decisions
/// already taken.
#[derive(Clone, Debug, Default)]
pub struct PeerIndex {
    grace_ms: u64,
    pods: BTreeMap<String, PodEntry>,
    pod_relist: Option<BTreeSet<String>>,
    nodes: BTreeMap<String, NodeState>,
    node_relist: Option<BTreeSet<String>>,
}

fn uid(pod: &Pod) -> Option<&str> {
    pod.metadata.uid.as_deref().filter(|u| !u.is_empty())
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

/// Latest `state.running.startedAt` of the pod's containers, ms since the
/// Unix epoch.
fn running_since_ms(pod: &Pod) -> Option<i64> {
    pod.status
        .as_ref()?
        .container_statuses
        .iter()
        .flatten()
        .filter_map(|c| c.state.as_ref()?.running.as_ref()?.started_at.as_ref())
        // `startedAt` has whole-second precision on the wire: take the end
        // of that second, so an incarnation that started earlier in the
        // same second is not kept. (One started later in that second and
        // removed too republishes its record: its key vanished.)
        .map(|t| t.0.as_millisecond() - t.0.as_millisecond().rem_euclid(1000) + 999)
        .max()
}

impl PeerIndex {
    /// An empty index with the not-ready grace `grace_ms` (milliseconds).
    pub fn new(grace_ms: u64) -> Self {
        Self {
            grace_ms,
            ..Self::default()
        }
    }

    /// Changes the not-ready grace (milliseconds); takes effect at the next
    /// event or [`PeerIndex::tick`].
    pub fn set_grace_ms(&mut self, grace_ms: u64) {
        self.grace_ms = grace_ms;
    }

    /// Feeds one pod watch event observed at `now_ms`.
    pub fn pod_event(&mut self, ev: Event<Pod>, now_ms: i64) -> Vec<Invalidation> {
        let mut out = Vec::new();
        match ev {
            Event::Init => self.pod_relist = Some(BTreeSet::new()),
            Event::InitApply(pod) => {
                if let (Some(seen), Some(u)) = (self.pod_relist.as_mut(), uid(&pod)) {
                    seen.insert(u.to_string());
                }
                out.extend(self.upsert(pod, now_ms));
            }
            Event::InitDone => {
                if let Some(seen) = self.pod_relist.take() {
                    let gone: Vec<String> = self
                        .pods
                        .keys()
                        .filter(|u| !seen.contains(*u))
                        .cloned()
                        .collect();
                    for u in gone {
                        out.extend(self.remove(&u, Reason::Vanished, now_ms));
                    }
                }
            }
            Event::Apply(pod) => out.extend(self.upsert(pod, now_ms)),
            Event::Delete(pod) => {
                if let Some(u) = uid(&pod).map(str::to_string) {
                    out.extend(self.remove(&u, Reason::Deleted, now_ms));
                }
            }
        }
        out
    }

    /// Feeds one node watch event observed at `now_ms`; pods on a node that
    /// turned NotReady or disappeared are invalidated.
    pub fn node_event(&mut self, ev: Event<Node>, now_ms: i64) -> Vec<Invalidation> {
        let mut changed = Vec::new();
        match ev {
            Event::Init => self.node_relist = Some(BTreeSet::new()),
            Event::InitApply(node) | Event::Apply(node) => {
                if let Some(name) = node.metadata.name.clone() {
                    if let Some(seen) = self.node_relist.as_mut() {
                        seen.insert(name.clone());
                    }
                    let mut st = decide::node_state(&node);
                    // A NotReady episode starts at the condition's
                    // transition time, else when first seen, and keeps its
                    // start across updates.
                    if let NodeState::NotReady { since_ms } = &mut st {
                        let before = match self.nodes.get(&name) {
                            Some(NodeState::NotReady { since_ms }) => *since_ms,
                            _ => None,
                        };
                        *since_ms = before.or(*since_ms).or(Some(now_ms));
                    }
                    self.nodes.insert(name.clone(), st);
                    changed.push(name);
                }
            }
            Event::InitDone => {
                if let Some(seen) = self.node_relist.take() {
                    for (name, st) in self.nodes.iter_mut() {
                        if !seen.contains(name) && *st != NodeState::Deleted {
                            *st = NodeState::Deleted;
                            changed.push(name.clone());
                        }
                    }
                }
            }
            Event::Delete(node) => {
                if let Some(name) = node.metadata.name.clone() {
                    self.nodes.insert(name.clone(), NodeState::Deleted);
                    changed.push(name);
                }
            }
        }
        let affected: Vec<Pod> = self
            .pods
            .values()
            .filter(|e| !e.invalidated)
            .filter(|e| node_of(&e.pod).is_some_and(|n| changed.iter().any(|c| c == n)))
            .map(|e| e.pod.clone())
            .collect();
        affected
            .into_iter()
            .filter_map(|p| self.upsert(p, now_ms))
            .collect()
    }

    /// Re-evaluates every live pod at `now_ms` (the not-ready grace).
    pub fn tick(&mut self, now_ms: i64) -> Vec<Invalidation> {
        let live: Vec<Pod> = self
            .pods
            .values()
            .filter(|e| !e.invalidated)
            .map(|e| e.pod.clone())
            .collect();
        live.into_iter()
            .filter_map(|p| self.upsert(p, now_ms))
            .collect()
    }

    /// The earliest time (ms since the Unix epoch) at which
    /// [`PeerIndex::tick`] can yield something, if any.
    pub fn next_deadline(&self) -> Option<i64> {
        self.pods
            .values()
            .filter(|e| !e.invalidated)
            .filter_map(|e| {
                let node = node_of(&e.pod)
                    .and_then(|n| self.nodes.get(n).copied())
                    .unwrap_or(NodeState::Unknown);
                decide::grace_deadline(&e.pod, node, self.grace_ms, &e.history)
            })
            .min()
    }

    /// Live (not invalidated) pods whose Ready condition is True.
    pub fn ready_count(&self) -> usize {
        self.pods
            .values()
            .filter(|e| !e.invalidated && decide::ready(&e.pod).0)
            .count()
    }

    /// Pods known (invalidated ones that still exist included).
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    /// Whether no pod is known.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Whether `uid` was terminally invalidated and is still known.
    pub fn is_invalidated(&self, uid: &str) -> bool {
        self.pods.get(uid).is_some_and(|e| e.invalidated)
    }

    fn invalidation(pod: &Pod, reason: Reason, now_ms: i64) -> Invalidation {
        let started_before_ms = match &reason {
            r if r.is_terminal() => None,
            // Every incarnation running now (the pod's agent republishes
            // if it is alive).
            Reason::NodeNotReady(_) => Some(now_ms),
            _ => running_since_ms(pod),
        };
        Invalidation {
            uid: uid(pod).unwrap_or_default().to_string(),
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            reason,
            started_before_ms,
            observed_at_ms: now_ms,
        }
    }

    /// Stores `pod` and decides on it; a pod without a UID is ignored.
    fn upsert(&mut self, pod: Pod, now_ms: i64) -> Option<Invalidation> {
        let u = uid(&pod)?.to_string();
        let node = match node_of(&pod) {
            Some(n) => self.nodes.get(n).copied().unwrap_or(NodeState::Unknown),
            None => NodeState::Unknown,
        };
        let entry = self.pods.entry(u).or_insert_with(|| PodEntry {
            pod: pod.clone(),
            history: PodHistory::default(),
            invalidated: false,
        });
        if entry.invalidated {
            entry.pod = pod;
            return None;
        }
        // The node's episode first: a recovery moves the pod's own grace.
        match node {
            NodeState::Ready => {
                entry.history.node_invalidated = false;
                if entry.history.node_was_not_ready {
                    entry.history.node_recovered_ms = Some(now_ms);
                }
                entry.history.node_was_not_ready = false;
            }
            NodeState::NotReady { .. } => entry.history.node_was_not_ready = true,
            NodeState::Deleted | NodeState::Unknown => {}
        }
        let action = decide::decide(&pod, node, now_ms, self.grace_ms, &entry.history);
        entry.history.restarts = Some(decide::restart_count(&pod));
        entry.history.was_ready |= decide::ready(&pod).0;
        let out = match action {
            PeerAction::Keep => None,
            PeerAction::Invalidate(reason) => {
                entry.invalidated = reason.is_terminal();
                if matches!(reason, Reason::NodeNotReady(_)) {
                    entry.history.node_invalidated = true;
                }
                Some(Self::invalidation(&pod, reason, now_ms))
            }
        };
        entry.pod = pod;
        out
    }

    /// Forgets pod `u`; yields an invalidation unless one was yielded
    /// before.
    fn remove(&mut self, u: &str, reason: Reason, now_ms: i64) -> Option<Invalidation> {
        let e = self.pods.remove(u)?;
        (!e.invalidated).then(|| Self::invalidation(&e.pod, reason, now_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::tests::{node, pod, time};

    fn uids(v: &[Invalidation]) -> Vec<(&str, &str)> {
        v.iter()
            .map(|i| (i.uid.as_str(), i.reason.code()))
            .collect()
    }

    fn listed(idx: &mut PeerIndex, pods: Vec<Pod>, now: i64) -> Vec<Invalidation> {
        let mut out = idx.pod_event(Event::Init, now);
        for p in pods {
            out.extend(idx.pod_event(Event::InitApply(p), now));
        }
        out.extend(idx.pod_event(Event::InitDone, now));
        out
    }

    #[test]
    fn delete_event_invalidates_once() {
        let mut idx = PeerIndex::new(10_000);
        assert!(listed(&mut idx, vec![pod("a", "n1", true, 0, 0)], 1).is_empty());
        let mut deleting = pod("a", "n1", true, 0, 0);
        deleting.metadata.deletion_timestamp = Some(time(2));
        assert_eq!(
            uids(&idx.pod_event(Event::Apply(deleting.clone()), 2)),
            [("uid-a", "PodDeleting")]
        );
        assert!(idx.is_invalidated("uid-a"));
        // Further updates and the final DELETE yield nothing more.
        assert!(idx.pod_event(Event::Apply(deleting.clone()), 3).is_empty());
        assert!(idx.pod_event(Event::Delete(deleting), 4).is_empty());
        assert!(idx.is_empty());
    }

    #[test]
    fn delete_without_prior_event_invalidates() {
        let mut idx = PeerIndex::new(0);
        idx.pod_event(Event::Apply(pod("a", "n1", true, 0, 0)), 1);
        let out = idx.pod_event(Event::Delete(pod("a", "n1", true, 0, 0)), 7);
        assert_eq!(uids(&out), [("uid-a", "PodDeleted")]);
        assert_eq!(out[0].observed_at_ms, 7);
        assert_eq!(out[0].name, "a");
        assert_eq!(out[0].namespace, "ns");
    }

    #[test]
    fn missed_delete_across_a_resync_is_caught() {
        let mut idx = PeerIndex::new(10_000);
        listed(
            &mut idx,
            vec![pod("a", "n1", true, 0, 0), pod("b", "n1", true, 0, 0)],
            1,
        );
        // The watch drops; "a" is deleted meanwhile (DELETE never seen);
        // a new pod "c" appears. The re-list shows b and c.
        let mut out = idx.pod_event(Event::Init, 5);
        out.extend(idx.pod_event(Event::InitApply(pod("b", "n1", true, 0, 0)), 5));
        out.extend(idx.pod_event(Event::InitApply(pod("c", "n1", true, 0, 0)), 5));
        // Nothing is decided on absence before the list is complete.
        assert!(out.is_empty());
        out.extend(idx.pod_event(Event::InitDone, 6));
        assert_eq!(uids(&out), [("uid-a", "PodVanished")]);
        assert_eq!(idx.len(), 2);
        // A second resync with everything present yields nothing.
        assert!(listed(
            &mut idx,
            vec![pod("b", "n1", true, 0, 0), pod("c", "n1", true, 0, 0)],
            7
        )
        .is_empty());
    }

    #[test]
    fn same_name_new_uid_is_a_new_peer() {
        let mut idx = PeerIndex::new(0);
        listed(&mut idx, vec![pod("a", "n1", true, 0, 0)], 1);
        let mut reborn = pod("a", "n1", true, 0, 0);
        reborn.metadata.uid = Some("uid-a2".into());
        // Re-list shows only the new incarnation of the name.
        let out = listed(&mut idx, vec![reborn], 2);
        assert_eq!(uids(&out), [("uid-a", "PodVanished")]);
        assert!(!idx.is_invalidated("uid-a2"));
        assert_eq!(idx.ready_count(), 1);
    }

    #[test]
    fn restart_yields_incarnation_scoped_invalidation_each_time() {
        let mut idx = PeerIndex::new(0);
        idx.pod_event(Event::Apply(pod("a", "n1", true, 0, 0)), 1);
        let mut restarted = pod("a", "n1", true, 0, 1);
        restarted
            .status
            .as_mut()
            .unwrap()
            .container_statuses
            .as_mut()
            .unwrap()[0]
            .state = Some(k8s_openapi::api::core::v1::ContainerState {
            running: Some(k8s_openapi::api::core::v1::ContainerStateRunning {
                started_at: Some(time(9_000)),
            }),
            ..Default::default()
        });
        let out = idx.pod_event(Event::Apply(restarted.clone()), 10);
        assert_eq!(uids(&out), [("uid-a", "ContainerRestarted")]);
        assert_eq!(out[0].started_before_ms, Some(9_999));
        assert!(!idx.is_invalidated("uid-a"));
        assert!(idx.pod_event(Event::Apply(restarted), 11).is_empty());
        assert_eq!(
            uids(&idx.pod_event(Event::Apply(pod("a", "n1", true, 0, 2)), 12)),
            [("uid-a", "ContainerRestarted")]
        );
    }

    #[test]
    fn grace_runs_out_on_tick() {
        let mut idx = PeerIndex::new(1_000);
        idx.pod_event(Event::Apply(pod("a", "n1", true, 0, 0)), 1);
        assert!(idx
            .pod_event(Event::Apply(pod("a", "n1", false, 100, 0)), 150)
            .is_empty());
        assert_eq!(idx.next_deadline(), Some(1_101));
        assert!(idx.tick(1_100).is_empty());
        assert_eq!(uids(&idx.tick(1_101)), [("uid-a", "PodNotReady")]);
        assert_eq!(idx.next_deadline(), None);
        assert!(idx.tick(5_000).is_empty());
    }

    #[test]
    fn node_not_ready_delete_and_missing_from_relist() {
        let mut idx = PeerIndex::new(0);
        idx.node_event(Event::Apply(node("n1", "True")), 0);
        idx.node_event(Event::Apply(node("n2", "True")), 0);
        idx.node_event(Event::Apply(node("n3", "True")), 0);
        for (p, n) in [("a", "n1"), ("b", "n2"), ("c", "n3"), ("d", "n3")] {
            idx.pod_event(Event::Apply(pod(p, n, true, 0, 0)), 1);
        }
        // Unknown (no transition time): the episode starts when seen (2);
        // within the grace (0 here: any later moment is past it).
        assert!(idx
            .node_event(Event::Apply(node("n1", "Unknown")), 2)
            .is_empty());
        assert_eq!(idx.next_deadline(), Some(3));
        let out = idx.tick(3);
        assert_eq!(uids(&out), [("uid-a", "NodeNotReady")]);
        assert_eq!(out[0].started_before_ms, Some(3));
        // Once per episode; a new episode after Ready again.
        assert!(idx.tick(4).is_empty());
        assert!(idx
            .node_event(Event::Apply(node("n1", "True")), 5)
            .is_empty());
        assert!(idx
            .node_event(Event::Apply(node("n1", "False")), 6)
            .is_empty());
        assert_eq!(uids(&idx.tick(7)), [("uid-a", "NodeNotReady")]);
        // The node lifecycle controller had marked the pod NotReady (at 6);
        // the node recovers at 8: the pod's grace (0 here) starts at 8, so
        // nothing at 8 itself, PodNotReady only if it stays so after it.
        assert!(idx
            .pod_event(Event::Apply(pod("a", "n1", false, 6, 0)), 7)
            .is_empty());
        assert!(idx
            .node_event(Event::Apply(node("n1", "True")), 8)
            .is_empty());
        assert!(idx
            .pod_event(Event::Apply(pod("a", "n1", true, 8, 0)), 8)
            .is_empty());
        assert_eq!(
            uids(&idx.node_event(Event::Delete(node("n2", "True")), 3)),
            [("uid-b", "NodeDeleted")]
        );
        // n3 missing from a node re-list: deleted.
        let mut out = idx.node_event(Event::Init, 4);
        out.extend(idx.node_event(Event::InitApply(node("n1", "True")), 4));
        out.extend(idx.node_event(Event::InitDone, 4));
        assert_eq!(
            uids(&out),
            [("uid-c", "NodeDeleted"), ("uid-d", "NodeDeleted")]
        );
        // A pod arriving on a known-dead node is invalidated at once.
        assert_eq!(
            uids(&idx.pod_event(Event::Apply(pod("e", "n2", true, 0, 0)), 5)),
            [("uid-e", "NodeDeleted")]
        );
    }

    #[test]
    fn pods_without_uid_are_ignored() {
        let mut idx = PeerIndex::new(0);
        let mut p = pod("a", "n1", true, 0, 0);
        p.metadata.uid = None;
        assert!(idx.pod_event(Event::Apply(p.clone()), 1).is_empty());
        assert!(idx.pod_event(Event::Delete(p), 2).is_empty());
        assert!(idx.is_empty());
    }
}
