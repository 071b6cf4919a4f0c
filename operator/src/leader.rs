//! Leader election on a `coordination.k8s.io/v1` `Lease`, so that of several
//! operator replicas exactly one acts (issue 14, "operator hygiene").
//!
//! The rules are client-go's `leaderelection` (Kubernetes
//! `staging/src/k8s.io/client-go/tools/leaderelection`): a candidate takes the
//! lease only when it has no holder or its holder has not renewed it for
//! `leaseDurationSeconds`; the leader renews every retry period and stops
//! acting when it could not renew for the renew deadline (shorter than the
//! lease duration, so it has stopped before anyone else may take over).
//! Every write carries the `resourceVersion` that was read, so of two
//! candidates racing for an expired lease the apiserver lets one win (409
//! Conflict for the other). No Rust crate implementing this compiles against
//! kube 5 (kube-leader-election and kube-lease-manager pin older kube), hence
//! this module: [`decide`] is the pure rule, [`LeaderElector`] the IO.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use kube::Client;
use tokio::sync::watch;

/// What a lease says, in the units [`decide`] works in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseView {
    /// `spec.holderIdentity` (`None` or empty: released).
    pub holder: Option<String>,
    /// `spec.renewTime`, ms since the Unix epoch (`None`: never renewed).
    pub renew_ms: Option<i64>,
    /// `spec.leaseDurationSeconds` in ms.
    pub duration_ms: i64,
    /// `spec.leaseTransitions`.
    pub transitions: i32,
}

/// The next step of a candidate, from [`decide`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Take the lease (it is free, released or expired); `transitions` is
    /// the value to write (one more than before when the holder changes).
    Acquire {
        /// `spec.leaseTransitions` to write.
        transitions: i32,
    },
    /// We hold it: renew.
    Renew,
    /// Someone else holds it until `expires_ms` (ms since the epoch).
    Follow {
        /// The current holder.
        holder: String,
        /// When the lease expires unless renewed.
        expires_ms: i64,
    },
}

/// When this candidate first saw the lease's current record (holder and
/// renewTime), on its own clock: followers time a holder out from that,
/// never from the holder's `renewTime`, so clock skew between nodes does
/// not shorten or stretch a lease (client-go's observedTime).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    /// The holder seen.
    pub holder: Option<String>,
    /// Its renewTime, ms (the holder's clock; compared, never subtracted).
    pub renew_ms: Option<i64>,
    /// When it was first seen, ms on this candidate's clock.
    pub at_ms: i64,
}

/// Folds a read of `lease` at `local_now_ms` into `previous`: the same
/// record keeps its first sighting; a new holder or renewTime restarts the
/// clock. Pure.
pub fn observe(previous: Option<&Observed>, lease: &LeaseView, local_now_ms: i64) -> Observed {
    match previous {
        Some(p) if p.holder == lease.holder && p.renew_ms == lease.renew_ms => p.clone(),
        _ => Observed {
            holder: lease.holder.clone(),
            renew_ms: lease.renew_ms,
            at_ms: local_now_ms,
        },
    }
}

/// The candidate `me`'s step at `now_ms` (its own clock) given the lease
/// (`None`: it does not exist yet) and when its current record was first
/// seen (`observed_at_ms`, same clock; see [`observe`]). A lease whose
/// record has not changed for its duration is expired. Pure.
pub fn decide(lease: Option<&LeaseView>, observed_at_ms: i64, me: &str, now_ms: i64) -> Step {
    let Some(l) = lease else {
        return Step::Acquire { transitions: 0 };
    };
    let holder = l.holder.as_deref().unwrap_or("");
    if holder == me {
        return Step::Renew;
    }
    if holder.is_empty() {
        return Step::Acquire {
            transitions: l.transitions.saturating_add(1),
        };
    }
    let expires_ms = match l.renew_ms {
        None => i64::MIN,
        Some(_) => observed_at_ms.saturating_add(l.duration_ms),
    };
    if now_ms >= expires_ms {
        Step::Acquire {
            transitions: l.transitions.saturating_add(1),
        }
    } else {
        Step::Follow {
            holder: holder.to_string(),
            expires_ms,
        }
    }
}

/// The [`LeaseView`] of a `Lease` object.
pub fn view(lease: &Lease) -> LeaseView {
    let spec = lease.spec.clone().unwrap_or_default();
    LeaseView {
        holder: spec.holder_identity,
        renew_ms: spec.renew_time.map(|t| t.0.as_millisecond()),
        duration_ms: i64::from(spec.lease_duration_seconds.unwrap_or(0)) * 1000,
        transitions: spec.lease_transitions.unwrap_or(0),
    }
}

/// Timing of the election. Invariant (checked by [`ElectionConfig::validate`]):
/// `retry < renew_deadline < lease_duration`.
#[derive(Clone, Debug)]
pub struct ElectionConfig {
    /// Namespace of the `Lease`.
    pub namespace: String,
    /// Name of the `Lease` (default `kvfabric-operator`).
    pub lease_name: String,
    /// This replica's identity (unique per process).
    pub identity: String,
    /// How long a lease is valid after its last renewal (client-go default 15 s).
    pub lease_duration: Duration,
    /// The leader stops acting when it could not renew for this long
    /// (client-go default 10 s).
    pub renew_deadline: Duration,
    /// Interval between attempts, for candidates and the leader (2 s).
    pub retry: Duration,
}

impl ElectionConfig {
    /// Checks the timing invariant.
    ///
    /// # Errors
    /// A message naming the settings when `retry < renew_deadline <
    /// lease_duration` does not hold or the lease duration is under 1 s.
    pub fn validate(&self) -> Result<(), String> {
        if self.lease_duration < Duration::from_secs(1) {
            return Err(format!(
                "--leader-election-lease-duration must be at least 1s, got {:?}",
                self.lease_duration
            ));
        }
        if !(self.retry < self.renew_deadline && self.renew_deadline < self.lease_duration) {
            return Err(format!(
                "leader election needs retry ({:?}) < renew deadline ({:?}) < lease duration ({:?})",
                self.retry, self.renew_deadline, self.lease_duration
            ));
        }
        if self.namespace.is_empty() || self.lease_name.is_empty() || self.identity.is_empty() {
            return Err("leader election needs a namespace, a lease name and an identity".into());
        }
        Ok(())
    }
}

/// Runs the election against the apiserver.
pub struct LeaderElector {
    api: Api<Lease>,
    cfg: ElectionConfig,
    /// The lease record last seen and when (this process's monotonic clock).
    observed: std::sync::Mutex<Option<Observed>>,
    /// Origin of that clock.
    epoch: std::time::Instant,
}

fn micro_now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

impl LeaderElector {
    /// An elector for `cfg` (validate it first).
    pub fn new(client: Client, cfg: ElectionConfig) -> Self {
        let api = Api::namespaced(client, &cfg.namespace);
        Self {
            api,
            cfg,
            observed: std::sync::Mutex::new(None),
            epoch: std::time::Instant::now(),
        }
    }

    /// One attempt: read the lease, decide, write. `Ok(true)` when this
    /// replica holds the lease afterwards. Every API call is bounded by the
    /// retry period.
    ///
    /// # Errors
    /// The API error (or a timeout) of the read or the write; a 409 from a
    /// racing candidate is `Ok(false)`, not an error.
    pub async fn try_acquire_or_renew(&self) -> Result<bool, String> {
        let bound = self.cfg.retry;
        let current = tokio::time::timeout(bound, self.api.get_opt(&self.cfg.lease_name))
            .await
            .map_err(|_| format!("reading lease timed out after {bound:?}"))?
            .map_err(|e| format!("reading lease: {e}"))?;
        let local_ms = i64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(i64::MAX);
        let lease_view = current.as_ref().map(view);
        let observed_at = match &lease_view {
            Some(v) => {
                let mut o = self.observed.lock().unwrap_or_else(|p| p.into_inner());
                let next = observe(o.as_ref(), v, local_ms);
                let at = next.at_ms;
                *o = Some(next);
                at
            }
            None => local_ms,
        };
        let step = decide(
            lease_view.as_ref(),
            observed_at,
            &self.cfg.identity,
            local_ms,
        );
        let secs = i32::try_from(self.cfg.lease_duration.as_secs()).unwrap_or(i32::MAX);
        let (mut lease, create) = match (&step, current) {
            (Step::Follow { .. }, _) => return Ok(false),
            (_, Some(l)) => (l, false),
            (_, None) => (
                Lease {
                    metadata: ObjectMeta {
                        name: Some(self.cfg.lease_name.clone()),
                        namespace: Some(self.cfg.namespace.clone()),
                        ..Default::default()
                    },
                    spec: None,
                },
                true,
            ),
        };
        let mut spec = lease.spec.take().unwrap_or_default();
        if let Step::Acquire { transitions } = step {
            spec = LeaseSpec {
                holder_identity: Some(self.cfg.identity.clone()),
                acquire_time: Some(micro_now()),
                lease_transitions: Some(transitions),
                ..spec
            };
        }
        spec.renew_time = Some(micro_now());
        spec.lease_duration_seconds = Some(secs);
        lease.spec = Some(spec);
        let write = async {
            if create {
                self.api.create(&PostParams::default(), &lease).await
            } else {
                // replace carries metadata.resourceVersion: optimistic concurrency.
                self.api
                    .replace(&self.cfg.lease_name, &PostParams::default(), &lease)
                    .await
            }
        };
        match tokio::time::timeout(bound, write).await {
            Err(_) => Err(format!("writing lease timed out after {bound:?}")),
            Ok(Ok(_)) => Ok(true),
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => Ok(false),
            Ok(Err(e)) => Err(format!("writing lease: {e}")),
        }
    }

    /// Campaigns and then leads: sends `true` on `leading` once the lease is
    /// held, and `false` (then returns) at the renew deadline — measured
    /// from the moment before the last successful renewal was stamped, so
    /// it falls before any follower may take over (a follower waits a lease
    /// duration from when it saw the last renewal, on its own monotonic
    /// clock — clock skew between nodes does not matter, only the watch
    /// delay, which lease duration − renew deadline covers). Every attempt
    /// is bounded by the time left to the deadline. Candidates retry every retry period forever.
    pub async fn run(&self, leading: watch::Sender<bool>) {
        let mut deadline: Option<tokio::time::Instant> = None;
        loop {
            let started = tokio::time::Instant::now();
            let bound = match deadline {
                Some(d) => self.cfg.retry.min(d.saturating_duration_since(started)),
                None => self.cfg.retry,
            }
            .max(std::time::Duration::from_millis(1));
            match tokio::time::timeout(bound, self.try_acquire_or_renew()).await {
                Ok(Ok(true)) => {
                    if deadline.is_none() {
                        tracing::info!(identity = %self.cfg.identity, lease = %self.cfg.lease_name, "became leader");
                        let _ = leading.send(true);
                    }
                    deadline = Some(started + self.cfg.renew_deadline);
                }
                Ok(Ok(false)) => {
                    if deadline.is_some() {
                        tracing::error!(identity = %self.cfg.identity, "lease taken by another replica; stepping down");
                        let _ = leading.send(false);
                        return;
                    }
                }
                Ok(Err(e)) => {
                    tracing::warn!(identity = %self.cfg.identity, error = %e, "leader election attempt failed")
                }
                Err(_) => {
                    tracing::warn!(identity = %self.cfg.identity, "leader election attempt timed out")
                }
            }
            let now = tokio::time::Instant::now();
            let pause = match deadline {
                Some(d) if now >= d => {
                    tracing::error!(identity = %self.cfg.identity, "could not renew the lease within the renew deadline; stepping down");
                    let _ = leading.send(false);
                    return;
                }
                Some(d) => self.cfg.retry.min(d - now),
                None => self.cfg.retry,
            };
            tokio::time::sleep(pause).await;
        }
    }

    /// Releases the lease if this replica holds it (holder cleared), so a
    /// successor takes over at once instead of after the lease duration.
    /// Best effort, bounded by the retry period.
    pub async fn release(&self) {
        let bound = self.cfg.retry;
        let Ok(Ok(Some(mut lease))) =
            tokio::time::timeout(bound, self.api.get_opt(&self.cfg.lease_name)).await
        else {
            return;
        };
        let mut spec = lease.spec.take().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.renew_time = Some(micro_now());
        lease.spec = Some(spec);
        match tokio::time::timeout(
            bound,
            self.api
                .replace(&self.cfg.lease_name, &PostParams::default(), &lease),
        )
        .await
        {
            Ok(Ok(_)) => tracing::info!(identity = %self.cfg.identity, "lease released"),
            Ok(Err(e)) => tracing::warn!(error = %e, "releasing the lease failed"),
            Err(_) => tracing::warn!("releasing the lease timed out"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(holder: &str, renew_ms: i64) -> LeaseView {
        LeaseView {
            holder: Some(holder.into()),
            renew_ms: Some(renew_ms),
            duration_ms: 15_000,
            transitions: 3,
        }
    }

    #[test]
    fn absent_lease_is_acquired() {
        assert_eq!(decide(None, 0, "a", 0), Step::Acquire { transitions: 0 });
    }

    #[test]
    fn own_lease_is_renewed_even_when_expired() {
        assert_eq!(decide(Some(&held("a", 0)), 0, "a", 1_000_000), Step::Renew);
    }

    #[test]
    fn live_lease_of_another_is_followed_until_it_expires() {
        let l = held("b", 10_000);
        assert_eq!(
            decide(Some(&l), 10_000, "a", 24_999),
            Step::Follow {
                holder: "b".into(),
                expires_ms: 25_000
            }
        );
        assert_eq!(
            decide(Some(&l), 10_000, "a", 25_000),
            Step::Acquire { transitions: 4 }
        );
    }

    #[test]
    fn followers_time_a_holder_out_on_their_own_clock() {
        // The holder's clock is an hour behind ours: its renewTime looks
        // stale, but we just saw it change — follow for a full duration.
        let l = held("b", 0);
        let o = observe(None, &l, 3_600_000);
        assert_eq!(o.at_ms, 3_600_000);
        assert!(matches!(
            decide(Some(&l), o.at_ms, "a", 3_600_001),
            Step::Follow { .. }
        ));
        // Renewed (renewTime moved): the clock restarts.
        let l2 = held("b", 2_000);
        let o2 = observe(Some(&o), &l2, 3_610_000);
        assert_eq!(o2.at_ms, 3_610_000);
        assert!(matches!(
            decide(Some(&l2), o2.at_ms, "a", 3_624_999),
            Step::Follow { .. }
        ));
        // Unchanged for the lease duration on our clock: expired.
        let o3 = observe(Some(&o2), &l2, 3_620_000);
        assert_eq!(o3.at_ms, 3_610_000, "same record keeps its first sighting");
        assert_eq!(
            decide(Some(&l2), o3.at_ms, "a", 3_625_000),
            Step::Acquire { transitions: 4 }
        );
        // The holder's clock an hour ahead of ours: its renewTime (in our
        // future) does not keep a dead holder's lease for an hour.
        let ahead = held("b", 3_600_000 + 3_600_000);
        let oa = observe(None, &ahead, 3_600_000);
        assert!(matches!(
            decide(Some(&ahead), oa.at_ms, "a", 3_614_999),
            Step::Follow { .. }
        ));
        assert_eq!(
            decide(Some(&ahead), oa.at_ms, "a", 3_615_000),
            Step::Acquire { transitions: 4 }
        );
    }

    #[test]
    fn released_lease_is_taken_at_once() {
        let mut l = held("b", 10_000);
        l.holder = None;
        assert_eq!(
            decide(Some(&l), 10_000, "a", 10_001),
            Step::Acquire { transitions: 4 }
        );
        l.holder = Some(String::new());
        assert_eq!(
            decide(Some(&l), 10_000, "a", 10_001),
            Step::Acquire { transitions: 4 }
        );
    }

    #[test]
    fn never_renewed_lease_is_expired() {
        let mut l = held("b", 0);
        l.renew_ms = None;
        assert!(matches!(decide(Some(&l), 0, "a", 0), Step::Acquire { .. }));
    }

    #[test]
    fn timing_invariant_is_checked() {
        let mut c = ElectionConfig {
            namespace: "ns".into(),
            lease_name: "l".into(),
            identity: "me".into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry: Duration::from_secs(2),
        };
        assert!(c.validate().is_ok());
        c.renew_deadline = Duration::from_secs(15);
        assert!(c.validate().unwrap_err().contains("renew deadline"));
        c.renew_deadline = Duration::from_secs(10);
        c.retry = Duration::from_secs(10);
        assert!(c.validate().is_err());
    }
}
