//! Command-line flags shared by the trace-replay benches, `kvfabric bench`
//! and `kvfabric-gpu bench`: the workload's arrivals ([`ArrivalArgs`]),
//! flattened into both (one definition of the flags, their help, defaults,
//! value checks and conflicts).
//!
//! The host command must define `--trace` and `--start` too:
//! `--fixed-prompt` conflicts with both.

use crate::bench::arrivals::{Arrivals, DEFAULT_SEED};
use crate::bench::cli::positive_finite;

/// `--fixed-prompt`, `--speed`, `--rate`, `--seed` and `--warmup`.
#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct ArrivalArgs {
    /// Synthetic workload instead of a trace: every request TOKENS prompt
    /// tokens (at least 1), --requests of them; no trace file read.
    #[arg(long, value_name = "TOKENS", value_parser = clap::value_parser!(u64).range(1..), conflicts_with_all = ["trace", "start", "speed"])]
    pub fixed_prompt: Option<u64>,
    /// Open loop: replay by the trace's timestamps (ms) divided by this
    /// factor (finite, > 0; 2 = twice as fast as recorded). Default:
    /// closed loop at --concurrency.
    #[arg(long, value_name = "FACTOR", value_parser = positive_finite, conflicts_with = "rate")]
    pub speed: Option<f64>,
    /// Open loop: Poisson arrivals at this rate (requests/s; finite, > 0),
    /// exponential inter-arrival times from a generator seeded by --seed.
    #[arg(long, value_name = "REQ/S", value_parser = positive_finite)]
    pub rate: Option<f64>,
    /// Seed of --rate's Poisson arrivals (same seed, same schedule).
    #[arg(long, default_value_t = DEFAULT_SEED, requires = "rate")]
    pub seed: u64,
    /// Hand off N requests (the slice's first, cycled; closed loop at up
    /// to --concurrency) before each path's measured phase, left out of
    /// the report: the numbers of a warm fabric, as a serving one is.
    /// At most 10,000,000.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = warmup_count)]
    pub warmup: usize,
}

/// Parses `--warmup`: a whole number of requests up to
/// [`MAX_WARMUP`](crate::bench::trace::MAX_WARMUP).
fn warmup_count(v: &str) -> Result<usize, String> {
    let max = crate::bench::trace::MAX_WARMUP;
    match v.parse::<usize>() {
        Ok(n) if n <= max => Ok(n),
        _ => Err(format!(
            "expected a whole number of requests from 0 to {max}, got {v:?}"
        )),
    }
}

impl ArrivalArgs {
    /// The arrival mode of --speed / --rate (clap keeps them exclusive)
    /// and --seed.
    pub fn arrivals(&self) -> Arrivals {
        match (self.speed, self.rate) {
            (Some(speed), _) => Arrivals::Trace { speed },
            (None, Some(rate_per_s)) => Arrivals::Poisson {
                rate_per_s,
                seed: self.seed,
            },
            (None, None) => Arrivals::Closed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory as _, Parser};

    /// A minimal host: the two flags `--fixed-prompt` conflicts with.
    #[derive(Parser, Debug)]
    struct Host {
        #[arg(long)]
        trace: Option<String>,
        #[arg(long, default_value_t = 0)]
        start: usize,
        #[command(flatten)]
        arrival: ArrivalArgs,
    }

    fn parse(args: &[&str]) -> Result<ArrivalArgs, clap::Error> {
        Host::try_parse_from(std::iter::once("host").chain(args.iter().copied())).map(|h| h.arrival)
    }

    #[test]
    fn definition_is_consistent() {
        Host::command().debug_assert();
    }

    #[test]
    fn warmup_is_a_bounded_count() {
        assert_eq!(parse(&[]).unwrap().warmup, 0);
        assert_eq!(parse(&["--warmup", "256"]).unwrap().warmup, 256);
        assert!(parse(&["--warmup", "10000000"]).is_ok());
        for bad in ["10000001", "many"] {
            let e = parse(&["--warmup", bad]).unwrap_err().to_string();
            assert!(
                e.contains("--warmup") && e.contains("from 0 to 10000000"),
                "{e}"
            );
        }
    }

    #[test]
    fn flags_give_the_arrival_mode() {
        assert_eq!(parse(&[]).unwrap().arrivals(), Arrivals::Closed);
        assert_eq!(
            parse(&["--speed", "2"]).unwrap().arrivals(),
            Arrivals::Trace { speed: 2.0 }
        );
        assert_eq!(
            parse(&["--rate", "13"]).unwrap().arrivals(),
            Arrivals::Poisson {
                rate_per_s: 13.0,
                seed: DEFAULT_SEED
            }
        );
        let a = parse(&["--fixed-prompt", "8192", "--rate", "13", "--seed", "7"]).unwrap();
        assert_eq!(a.fixed_prompt, Some(8192));
        assert_eq!(
            a.arrivals(),
            Arrivals::Poisson {
                rate_per_s: 13.0,
                seed: 7
            }
        );
    }

    #[test]
    fn bad_values_and_conflicts_are_usage_errors_naming_the_flag() {
        for (args, flag) in [
            (&["--speed", "0"][..], "--speed"),
            (&["--speed", "nan"], "--speed"),
            (&["--rate=-1"], "--rate"),
            (&["--rate", "inf"], "--rate"),
            (&["--rate", "13", "--speed", "2"], "--speed"),
            (&["--seed", "5"], "--rate"),
            (&["--fixed-prompt", "0"], "--fixed-prompt"),
            (&["--fixed-prompt", "8192", "--speed", "2"], "--speed"),
            (&["--fixed-prompt", "8192", "--trace", "t"], "--trace"),
            (&["--fixed-prompt", "8192", "--start", "3"], "--start"),
        ] {
            let e = parse(args).expect_err(&format!("{args:?} accepted"));
            assert_eq!(e.exit_code(), 2, "{e}");
            assert!(e.to_string().contains(flag), "{args:?}: {e}");
        }
    }
}
