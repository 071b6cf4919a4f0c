//! How the requests of a replay arrive (issue 18): closed loop (a fixed
//! number of requests in flight, each worker starting its next request
//! when its last one is done) or open loop — by the trace's timestamps
//! divided by a speed factor, or by a Poisson process at a fixed rate
//! (exponential inter-arrival times from a seeded generator, so a run is
//! reproducible). In the open-loop modes every request has a scheduled
//! arrival time, and its latency is counted from it, so queueing shows.
//!
//! Also the synthetic workload of `--fixed-prompt`: every request the same
//! number of prompt tokens, no trace file needed.

use kvfabric_core::model::TraceRecord;
use serde::Serialize;

/// Default seed of the Poisson generator (`--seed`).
pub const DEFAULT_SEED: u64 = 18;

/// Most synthetic requests `--fixed-prompt` builds (`--requests`).
pub const MAX_SYNTHETIC_REQUESTS: usize = 10_000_000;

/// How the requests of a replay arrive.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum Arrivals {
    /// Closed loop: `concurrency` requests in flight; each worker starts
    /// its next request as soon as its last one is done. No arrival
    /// times: latency is the service time (submit → done).
    Closed,
    /// Open loop by the trace's timestamps (ms, relative to the slice's
    /// earliest request) divided by `speed` (finite, > 0; 2 = twice as
    /// fast as recorded).
    Trace {
        /// Speed factor (finite, > 0).
        speed: f64,
    },
    /// Open loop, a Poisson process: the first request at 0, then
    /// exponential inter-arrival times of mean 1 / `rate_per_s` seconds,
    /// drawn from a generator seeded by `seed`.
    Poisson {
        /// Arrival rate (requests/s; finite, > 0).
        rate_per_s: f64,
        /// Seed of the generator (same seed, same schedule).
        seed: u64,
    },
}

impl Arrivals {
    /// Whether requests have scheduled arrival times (the open-loop modes).
    pub fn is_open_loop(&self) -> bool {
        !matches!(self, Self::Closed)
    }

    /// Checks the mode's parameters.
    ///
    /// # Errors
    /// A speed or rate that is not finite and > 0, naming its flag
    /// (`--speed`, `--rate`).
    pub fn check(&self) -> Result<(), String> {
        match *self {
            Self::Closed => Ok(()),
            Self::Trace { speed } => check_positive("--speed", "factor", speed),
            Self::Poisson { rate_per_s, .. } => {
                check_positive("--rate", "rate in requests/s", rate_per_s)
            }
        }
    }

    /// The scheduled arrival of each of `records`, in seconds from the
    /// start of a phase (same order as `records`); `None` in closed loop.
    /// By timestamps: (timestamp − the earliest timestamp) / 1000 / speed.
    /// Poisson: [`poisson_schedule`]. Not checked: see [`Self::check`].
    pub fn schedule(&self, records: &[&TraceRecord]) -> Option<Vec<f64>> {
        match *self {
            Self::Closed => None,
            Self::Trace { speed } => {
                let base = records.iter().map(|r| r.timestamp).min().unwrap_or(0);
                Some(
                    records
                        .iter()
                        .map(|r| (r.timestamp - base) as f64 / 1e3 / speed)
                        .collect(),
                )
            }
            Self::Poisson { rate_per_s, seed } => {
                Some(poisson_schedule(records.len(), rate_per_s, seed))
            }
        }
    }

    /// A short description: `closed loop`, `trace timestamps / 2`,
    /// `Poisson 13 req/s (seed 18)`.
    pub fn describe(&self) -> String {
        match *self {
            Self::Closed => "closed loop".into(),
            Self::Trace { speed } => format!("trace timestamps / {speed}"),
            Self::Poisson { rate_per_s, seed } => {
                format!("Poisson {rate_per_s} req/s (seed {seed})")
            }
        }
    }
}

fn check_positive(flag: &str, what: &str, v: f64) -> Result<(), String> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(format!("{flag}: expected a finite {what} > 0, got {v}"))
    }
}

pub use kvfabric_core::rng::SplitMix64;

/// Arrival times (s) of `n` requests of a Poisson process at `rate_per_s`
/// requests/s: the first at 0, then exponential inter-arrival times of
/// mean `1 / rate_per_s` s from [`SplitMix64`] seeded by `seed`. Same
/// arguments, same schedule; non-decreasing.
pub fn poisson_schedule(n: usize, rate_per_s: f64, seed: u64) -> Vec<f64> {
    let mut rng = SplitMix64::new(seed);
    let mut t = 0.0;
    (0..n)
        .map(|k| {
            if k > 0 {
                t += rng.next_exp(rate_per_s);
            }
            t
        })
        .collect()
}

/// The arrival rate a schedule achieved (requests/s): (n − 1) / (last −
/// first arrival); `None` with fewer than two arrivals or all at once.
pub fn achieved_rate(schedule: &[f64]) -> Option<f64> {
    let (first, last) = (schedule.first()?, schedule.last()?);
    let span = last - first;
    (schedule.len() >= 2 && span > 0.0).then(|| (schedule.len() - 1) as f64 / span)
}

/// `requests` synthetic requests of `tokens` prompt tokens each
/// (`--fixed-prompt`): timestamps 0 (nothing to replay by), one output
/// token, no prefix hashes.
///
/// # Errors
/// 0 tokens (`--fixed-prompt`), 0 requests or more than
/// [`MAX_SYNTHETIC_REQUESTS`] (`--requests`).
pub fn fixed_prompt_trace(tokens: u64, requests: usize) -> Result<Vec<TraceRecord>, String> {
    if tokens == 0 {
        return Err("--fixed-prompt: expected at least 1 token, got 0".into());
    }
    if !(1..=MAX_SYNTHETIC_REQUESTS).contains(&requests) {
        return Err(format!(
            "--requests: with --fixed-prompt expected 1 to {MAX_SYNTHETIC_REQUESTS} requests, got {requests}"
        ));
    }
    Ok((0..requests)
        .map(|_| TraceRecord {
            timestamp: 0,
            input_length: tokens,
            output_length: 1,
            hash_ids: Vec::new(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_schedule_is_reproducible_by_seed() {
        let a = poisson_schedule(1000, 13.0, 7);
        assert_eq!(a, poisson_schedule(1000, 13.0, 7), "same seed");
        assert_ne!(a, poisson_schedule(1000, 13.0, 8), "another seed");
        assert_eq!(a[0], 0.0, "the first request arrives at once");
        assert!(a.windows(2).all(|w| w[0] <= w[1]), "non-decreasing");
        assert!(a.iter().all(|t| t.is_finite()));
        // A prefix of a longer schedule is the shorter one.
        assert_eq!(&poisson_schedule(2000, 13.0, 7)[..1000], &a[..]);
    }

    #[test]
    fn poisson_mean_inter_arrival_is_one_over_the_rate() {
        // 10,000 draws: the sample mean's standard deviation is 1% of the
        // mean; 3% is a 3-sigma bound, and with fixed seeds it is the same
        // draw every run (no flakes). Several seeds and rates.
        for (rate, seed) in [(13.0, DEFAULT_SEED), (1000.0, 1), (0.5, 2026)] {
            let s = poisson_schedule(10_001, rate, seed);
            let gaps: Vec<f64> = s.windows(2).map(|w| w[1] - w[0]).collect();
            assert_eq!(gaps.len(), 10_000);
            let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
            let want = 1.0 / rate;
            assert!(
                (mean - want).abs() <= 0.03 * want,
                "rate {rate} seed {seed}: mean gap {mean}, want {want}"
            );
            // Exponential: the standard deviation equals the mean (a loose
            // bound), and the achieved rate is close to the asked one.
            let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
            assert!((var.sqrt() / mean - 1.0).abs() < 0.1, "rate {rate}");
            let r = achieved_rate(&s).unwrap();
            assert!((r / rate - 1.0).abs() < 0.03, "achieved {r} of {rate}");
        }
    }

    #[test]
    fn schedules_by_mode() {
        let rec = |ts| TraceRecord {
            timestamp: ts,
            input_length: 16,
            output_length: 1,
            hash_ids: Vec::new(),
        };
        let recs = [rec(1000), rec(1500), rec(3000)];
        let refs: Vec<&TraceRecord> = recs.iter().collect();
        assert_eq!(Arrivals::Closed.schedule(&refs), None);
        // Relative to the slice's earliest request, divided by the speed.
        assert_eq!(
            Arrivals::Trace { speed: 2.0 }.schedule(&refs),
            Some(vec![0.0, 0.25, 1.0])
        );
        let p = Arrivals::Poisson {
            rate_per_s: 5.0,
            seed: 3,
        };
        assert_eq!(p.schedule(&refs), Some(poisson_schedule(3, 5.0, 3)));
        assert!(p.is_open_loop() && !Arrivals::Closed.is_open_loop());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = Arrivals::Trace { speed: bad }.check().unwrap_err();
            assert!(e.starts_with("--speed"), "{e}");
            let e = Arrivals::Poisson {
                rate_per_s: bad,
                seed: 1,
            }
            .check()
            .unwrap_err();
            assert!(e.starts_with("--rate"), "{e}");
        }
        assert_eq!(achieved_rate(&[0.0]), None);
        assert_eq!(achieved_rate(&[1.0, 1.0]), None);
        assert_eq!(achieved_rate(&[0.0, 0.5, 1.0]), Some(2.0));
        // The report names the mode and its parameters.
        let j = serde_json::to_value(p).unwrap();
        assert_eq!(
            j,
            serde_json::json!({"mode": "poisson", "rate_per_s": 5.0, "seed": 3})
        );
        let j = serde_json::to_value(Arrivals::Closed).unwrap();
        assert_eq!(j, serde_json::json!({"mode": "closed"}));
    }

    #[test]
    fn fixed_prompt_builds_n_records_of_that_length() {
        let t = fixed_prompt_trace(8192, 500).unwrap();
        assert_eq!(t.len(), 500);
        assert!(t.iter().all(|r| r.input_length == 8192 && r.timestamp == 0));
        assert!(fixed_prompt_trace(0, 5)
            .unwrap_err()
            .starts_with("--fixed-prompt"));
        assert!(fixed_prompt_trace(16, 0)
            .unwrap_err()
            .starts_with("--requests"));
        assert!(fixed_prompt_trace(16, MAX_SYNTHETIC_REQUESTS + 1)
            .unwrap_err()
            .starts_with("--requests"));
    }
}
