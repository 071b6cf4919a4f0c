//! When the agent's waiting threads spin (issue 18).
//!
//! Copy workers between jobs and callers of
//! [`TransferHandle::wait`](crate::runtime::transport::TransferHandle::wait)
//! poll for the busy-poll window (`ioBusyPollUs`, 2 ms on hosts with ≥ 8
//! CPUs) before they block, because a blocked thread takes 50–200 µs to run
//! again on the H200 host (docs/benchmarks.md). Under load that spinning
//! is paid for by the threads with work: on the H200 with 128 requests in
//! flight both agents' threads kept 11.8 of the host's 16 CPUs busy and
//! ≈ 16 threads runnable, against 5.4 CPUs without any spinning — and
//! without spinning the closed loop moved 13 % more requests a second,
//! at 8 in flight the same (docs/benchmarks.md, "Issue 18, eighth
//! session"). Two rules:
//!
//! * [`SpinHistory`] (on by default): a wait spins only while at least a
//!   quarter of the recent waits of its kind ended inside the window — a
//!   waiter whose request takes 50 ms (128 in flight) never catches it by
//!   spinning 2 ms, an isolated request's waiter (≈ 0.3–1 ms) does
//!   (weight 1/8 for the newest wait, so one wait does not decide). The
//!   adaptive spin-then-block idea of adaptive mutexes (glibc's
//!   `PTHREAD_MUTEX_ADAPTIVE_NP` bounds its spin by recent spin lengths).
//!   Used for the callers of `wait` (bounce and standard path).
//! * [`SpinSlots`]: at most `n` copy workers of a transport spin at once
//!   (primes wake no more than the free slots)
//!   (`KVFABRIC_SPIN_WORKERS`; no cap by default: a cap of 2 cost 8 in
//!   flight 10 % and an isolated request 15 % on the H200, because a
//!   request's gathers and scatters run on several workers at once).
//! * [`Relax`]: between two polls a spinning thread yields its CPU
//!   (`sched_yield`, default) instead of only hinting the core
//!   (`KVFABRIC_SPIN_YIELD=0`). With more runnable threads than CPUs a
//!   pure spin keeps its CPU for a whole scheduler slice: on the H200
//!   host, with 8 in flight, the slowest 1 % of requests were resolved
//!   ≈ 4 ms before their caller ran again (16 ms for the slowest), and a
//!   submitting thread took up to 13 ms to reach the transport
//!   (`kvfabric-gpu bench --timeline`, docs/benchmarks.md, "Issue 18,
//!   ninth session"). A yield returns at once when nothing else wants
//!   the CPU, so an idle host keeps the spin's latency.
//! * At most one caller of `wait` in the process spins at a time
//!   ([`MAX_SPINNING_WAITERS`](crate::runtime::transport::MAX_SPINNING_WAITERS),
//!   `KVFABRIC_SPIN_WAITERS`; was four): on a busy host each yield of a
//!   spinning caller is a context switch, and four of them made 54–124 k
//!   a second under the open loop, taking cores from the agents' threads
//!   (issue 18, thirteenth session).

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

/// Score of a history that has seen only waits inside the window (the
/// score is the recent share of such waits, in 1/256ths).
const FULL: u32 = 256;
/// Spin while the score is at least this: a quarter of recent waits.
const SPIN_AT: u32 = FULL / 4;
/// Weight of the newest wait: 1/8, below the threshold, so one wait
/// cannot decide alone (from a history of waits all inside the window,
/// eleven past it in a row stop the spinning; from one of waits all past
/// it, two or three inside it bring spinning back).
const SHIFT: u32 = 3;

/// The next score after one wait (pure): an exponentially weighted share
/// of waits that ended within the window, weight 1/8 for the newest
/// (the score stays in 7..=256 once there: `s >> 3` is 0 below 8).
pub fn next_score(score: u32, within: bool) -> u32 {
    let s = score.min(FULL);
    s - (s >> SHIFT) + if within { FULL >> SHIFT } else { 0 }
}

/// Recent waits of one kind (the callers of one transport's, or one
/// agent's standard-path, `wait`): whether they ended within the spin
/// window.
#[derive(Debug)]
pub struct SpinHistory {
    score: AtomicU32,
}

impl Default for SpinHistory {
    fn default() -> Self {
        Self::new()
    }
}

impl SpinHistory {
    /// A history that spins (as if every past wait had ended in time).
    pub fn new() -> Self {
        Self {
            score: AtomicU32::new(FULL),
        }
    }

    /// Whether the next wait should spin (at least a quarter of the recent
    /// waits ended within the window).
    pub fn should_spin(&self) -> bool {
        self.score.load(Ordering::Relaxed) >= SPIN_AT
    }

    /// Records one wait that took `waited` against the window `window`
    /// (whether it spun or blocked; a wait that timed out counts as past
    /// the window).
    pub fn record(&self, waited: Duration, window: Duration) {
        let within = waited <= window;
        // Lost updates between racing threads only blur the average.
        let _ = self
            .score
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                Some(next_score(s, within))
            });
    }
}

/// What a spinning thread does between two polls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Relax {
    /// Give the CPU to another runnable thread, if any
    /// (`std::thread::yield_now`, `sched_yield(2)`; the default).
    #[default]
    Yield,
    /// Keep the CPU (`std::hint::spin_loop`; the rule before issue 18's
    /// ninth session).
    Spin,
}

impl Relax {
    /// One pause between two polls.
    #[inline]
    pub fn pause(self) {
        match self {
            Relax::Yield => std::thread::yield_now(),
            Relax::Spin => std::hint::spin_loop(),
        }
    }
}

/// At most `max` holders at once (spinning threads of a pool);
/// `usize::MAX` is no cap and counts nothing. Holders pause between
/// polls as [`SpinSlots::relax`] says.
#[derive(Debug)]
pub struct SpinSlots {
    taken: AtomicUsize,
    max: usize,
    relax: Relax,
}

/// A taken [`SpinSlots`] slot, given back on drop (`None` inside: an
/// uncapped pool's, not counted).
#[derive(Debug)]
pub struct SpinSlot<'a>(Option<&'a SpinSlots>);

impl Drop for SpinSlot<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.0 {
            s.taken.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl SpinSlots {
    /// Room for `max` spinners (0: none ever spins), pausing with
    /// [`Relax::Yield`].
    pub fn new(max: usize) -> Self {
        Self::with_relax(max, Relax::Yield)
    }

    /// Room for `max` spinners that pause between polls with `relax`.
    pub fn with_relax(max: usize, relax: Relax) -> Self {
        Self {
            taken: AtomicUsize::new(0),
            max,
            relax,
        }
    }

    /// How holders pause between two polls.
    pub fn relax(&self) -> Relax {
        self.relax
    }

    /// A slot if fewer than `max` are taken (always, uncounted, without
    /// a cap).
    pub fn try_take(&self) -> Option<SpinSlot<'_>> {
        if self.max == usize::MAX {
            return Some(SpinSlot(None));
        }
        self.taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| SpinSlot(Some(self)))
    }

    /// Slots taken now (0 without a cap).
    pub fn taken(&self) -> usize {
        self.taken.load(Ordering::Acquire)
    }

    /// Slots free now (`usize::MAX` without a cap).
    pub fn free(&self) -> usize {
        self.max.saturating_sub(self.taken())
    }
}

/// The spin rules' experiment switches (issue 18), read from the
/// environment once when an agent starts: `KVFABRIC_SPIN_ADAPTIVE` (`1` by
/// default, `0`: every wait spins, the rule before issue 18's eighth
/// session), `KVFABRIC_SPIN_YIELD` ([`Relax`]: `1` yield, the default;
/// `0` spin) and `KVFABRIC_SPIN_WORKERS` (most copy workers of a transport
/// spinning at once, default
/// [`DEFAULT_SPINNING_WORKERS`](crate::runtime::transport::DEFAULT_SPINNING_WORKERS);
/// `all`: no cap). A value that does not parse is warned about and the
/// default used. `KVFABRIC_SPIN_WAITERS` ([`parse_spin_waiters`]) is
/// process-wide: [`SpinEnv::waiters`] reports the cap the first agent of
/// the process read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinEnv {
    /// [`TransportSettings::spin_adaptive`](crate::runtime::transport::TransportSettings::spin_adaptive).
    pub adaptive: bool,
    /// [`TransportSettings::spinning_workers`](crate::runtime::transport::TransportSettings::spinning_workers).
    pub workers: usize,
    /// [`TransportSettings::spin_relax`](crate::runtime::transport::TransportSettings::spin_relax)
    /// (`KVFABRIC_SPIN_YIELD`: 1 yield, the default; 0 spin).
    pub relax: Relax,
    /// Most callers of `wait` spinning at once in the process
    /// ([`spin_waiters_cap`](crate::runtime::transport::spin_waiters_cap):
    /// `KVFABRIC_SPIN_WAITERS`, read once per process).
    pub waiters: usize,
}

impl SpinEnv {
    /// From the process environment (the spinning-callers cap is read
    /// here the first time in the process, so a bad value is warned about
    /// when the first agent starts).
    pub fn read() -> Self {
        let mut env = Self::parse(
            std::env::var("KVFABRIC_SPIN_ADAPTIVE").ok().as_deref(),
            std::env::var("KVFABRIC_SPIN_WORKERS").ok().as_deref(),
        )
        .with_yield(std::env::var("KVFABRIC_SPIN_YIELD").ok().as_deref());
        env.waiters = crate::runtime::transport::spin_waiters_cap();
        env
    }

    /// From the first two variables' values (`None`: unset; pausing with
    /// [`Relax::Yield`]).
    pub fn parse(adaptive: Option<&str>, workers: Option<&str>) -> Self {
        let mut out = Self {
            adaptive: true,
            workers: crate::runtime::transport::DEFAULT_SPINNING_WORKERS,
            relax: Relax::Yield,
            waiters: crate::runtime::transport::MAX_SPINNING_WAITERS,
        };
        match adaptive.map(str::trim) {
            None => {}
            Some("1" | "true") => out.adaptive = true,
            Some("0" | "false") => out.adaptive = false,
            Some(v) => tracing::warn!(
                value = v,
                "KVFABRIC_SPIN_ADAPTIVE: expected 0 or 1; using 1"
            ),
        }
        match workers.map(str::trim) {
            None => {}
            Some("all") => out.workers = usize::MAX,
            Some(v) => match v.parse::<usize>() {
                Ok(n) => out.workers = n,
                Err(_) => tracing::warn!(
                    value = v,
                    default = out.workers,
                    "KVFABRIC_SPIN_WORKERS: expected a count or `all`; using the default"
                ),
            },
        }
        out
    }

    /// `self` with `KVFABRIC_SPIN_YIELD`'s value (`None`: unset, yield;
    /// anything but 0/1/true/false is warned about and yields).
    pub fn with_yield(mut self, value: Option<&str>) -> Self {
        self.relax = match value.map(str::trim) {
            None | Some("1" | "true") => Relax::Yield,
            Some("0" | "false") => Relax::Spin,
            Some(v) => {
                tracing::warn!(value = v, "KVFABRIC_SPIN_YIELD: expected 0 or 1; using 1");
                Relax::Yield
            }
        };
        self
    }
}

/// `KVFABRIC_SPIN_WAITERS` (an experiment switch, issue 18): the most
/// callers of [`TransferHandle::wait`](crate::runtime::transport::TransferHandle::wait)
/// in the process that spin at once (the others block at once). `None`
/// (unset): [`MAX_SPINNING_WAITERS`](crate::runtime::transport::MAX_SPINNING_WAITERS);
/// `all`: no cap; `0`: no caller spins. Anything else is warned about and
/// the default used.
pub fn parse_spin_waiters(value: Option<&str>) -> usize {
    let default = crate::runtime::transport::MAX_SPINNING_WAITERS;
    match value.map(str::trim) {
        None => default,
        Some("all") => usize::MAX,
        Some(v) => v.parse::<usize>().unwrap_or_else(|_| {
            tracing::warn!(
                value = v,
                default,
                "KVFABRIC_SPIN_WAITERS: expected a count or `all`; using the default"
            );
            default
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spin_waiters_parse_counts_all_and_fall_back_on_nonsense() {
        let default = crate::runtime::transport::MAX_SPINNING_WAITERS;
        assert_eq!(parse_spin_waiters(None), default);
        assert_eq!(parse_spin_waiters(Some("0")), 0);
        assert_eq!(parse_spin_waiters(Some(" 2 ")), 2);
        assert_eq!(parse_spin_waiters(Some("all")), usize::MAX);
        assert_eq!(parse_spin_waiters(Some("-1")), default);
        assert_eq!(parse_spin_waiters(Some("many")), default);
    }

    #[test]
    fn eleven_waits_past_the_window_stop_spinning_and_two_inside_restart_it() {
        let h = SpinHistory::new();
        let w = Duration::from_millis(2);
        assert!(h.should_spin());
        for i in 1..=11 {
            h.record(Duration::from_millis(50), w);
            assert_eq!(h.should_spin(), i < 11, "after {i} long waits");
        }
        // Many more misses: the score settles at its floor.
        for _ in 0..100 {
            h.record(Duration::from_millis(50), w);
        }
        assert!(!h.should_spin());
        // One wait inside the window is not enough, two are.
        h.record(Duration::from_micros(300), w);
        assert!(!h.should_spin(), "one short wait decided alone");
        h.record(Duration::from_micros(300), w);
        assert!(h.should_spin());
    }

    /// Records `cycles` cycles of one wait inside the 2 ms window (1 ms)
    /// then `period - 1` past it (5 ms); with `check: Some(spins)`, asserts
    /// after each wait that `should_spin` is `spins`.
    fn cycle(h: &SpinHistory, period: u32, cycles: u32, check: Option<bool>) {
        for i in 0..period * cycles {
            let waited = if i % period == 0 { 1 } else { 5 };
            h.record(Duration::from_millis(waited), Duration::from_millis(2));
            if let Some(spins) = check {
                assert_eq!(h.should_spin(), spins, "1 in {period} in time, phase {i}");
            }
        }
    }

    #[test]
    fn a_mix_with_a_quarter_of_waits_in_time_keeps_spinning() {
        let h = SpinHistory::new();
        // One in three in time: the score settles near a third (> 1/4);
        // then every phase of the cycle spins.
        cycle(&h, 3, 100, None);
        cycle(&h, 3, 1, Some(true));
        // One in ten: no phase spins, not even right after a hit.
        cycle(&h, 10, 30, None);
        cycle(&h, 10, 1, Some(false));
    }

    #[test]
    fn scores_stay_in_range() {
        let mut s = FULL;
        for i in 0..1000u32 {
            s = next_score(s, i % 7 == 0);
            assert!(s <= FULL);
        }
        assert_eq!(next_score(FULL, true), FULL);
        assert_eq!(next_score(0, false), 0);
        assert_eq!(next_score(u32::MAX, true), FULL);
    }

    #[test]
    fn the_environment_switches_parse_and_bad_values_keep_the_defaults() {
        let d = SpinEnv::parse(None, None);
        assert_eq!(
            d,
            SpinEnv {
                adaptive: true,
                workers: crate::runtime::transport::DEFAULT_SPINNING_WORKERS,
                relax: Relax::Yield,
                waiters: crate::runtime::transport::MAX_SPINNING_WAITERS,
            }
        );
        assert_eq!(
            SpinEnv::parse(Some("0"), Some("all")),
            SpinEnv {
                adaptive: false,
                workers: usize::MAX,
                relax: Relax::Yield,
                waiters: crate::runtime::transport::MAX_SPINNING_WAITERS,
            }
        );
        assert_eq!(SpinEnv::parse(Some(" 1 "), Some("3")).workers, 3);
        assert_eq!(SpinEnv::parse(Some("yes"), Some("-1")), d);
        assert_eq!(d.with_yield(Some("0")).relax, Relax::Spin);
        assert_eq!(d.with_yield(Some(" false ")).relax, Relax::Spin);
        assert_eq!(d.with_yield(Some("1")).relax, Relax::Yield);
        assert_eq!(d.with_yield(Some("maybe")).relax, Relax::Yield);
        assert_eq!(d.with_yield(None), d);
    }

    #[test]
    fn slots_bound_the_holders_and_come_back_on_drop() {
        let s = SpinSlots::new(2);
        let a = s.try_take().expect("first");
        let b = s.try_take().expect("second");
        assert!(s.try_take().is_none());
        assert_eq!(s.taken(), 2);
        drop(a);
        let c = s.try_take().expect("after a drop");
        drop((b, c));
        assert_eq!(s.taken(), 0);
        assert!(SpinSlots::new(0).try_take().is_none());
        assert_eq!(s.free(), 2);
        // Without a cap: always a slot, nothing counted.
        let all = SpinSlots::new(usize::MAX);
        let held: Vec<_> = (0..100).map(|_| all.try_take().unwrap()).collect();
        assert_eq!((all.taken(), all.free()), (0, usize::MAX));
        drop(held);
        assert_eq!(all.taken(), 0);
    }
}
