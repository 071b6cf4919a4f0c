//! `kvfabric-chaos`: the chaos suite of issue 16 (see the crate docs), or,
//! as `kvfabric-chaos engine --spec JSON`, one prefill engine process of it.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use kvfabric_chaos::engine::{run_engine, EngineSpec};
use kvfabric_chaos::{run, FaultKind, Options, RunError};

#[derive(Parser)]
#[command(
    name = "kvfabric-chaos",
    about = "kvfabric chaos suite: faults under trace load; zero hangs, leaks and corrupt bytes; invalidation latency"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Sub>,
    /// Rounds (one fault each; kinds cycle in a seeded random order).
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Seed of the fault order and the load.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the JSON report here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Concurrent hand-offs.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// At least this many hand-offs per round.
    #[arg(long, default_value_t = 64)]
    requests_per_round: usize,
    /// The agents' requestTimeoutMs.
    #[arg(long, default_value_t = 2000)]
    request_timeout_ms: u64,
    /// Slack over the request timeout before a request is a hang.
    #[arg(long, default_value_t = 6000)]
    slack_ms: u64,
    /// The agents' lease TTL, s.
    #[arg(long, default_value_t = 5)]
    lease_ttl: u64,
    /// Bound on a surviving pair's new transfer after a fault, ms.
    #[arg(long, default_value_t = 1000)]
    probe_bound_ms: u64,
    /// control-loss: % of control packets dropped (each direction).
    #[arg(long, default_value_t = 10)]
    loss_percent: u32,
    /// Run the agents on loopback addresses instead of a network namespace
    /// each (joined by veth to a bridge; the default where the machine
    /// allows it).
    #[arg(long)]
    no_netns: bool,
    /// Only these fault kinds (comma-separated names).
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// Directory of the kvfabric, kvfabric-operator binaries (default: this binary's).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// The Mooncake trace (default ../shared/data/traces/mooncake_conversation_trace.jsonl).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Work dir (kept: logs of every process).
    #[arg(long)]
    work_dir: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Sub {
    /// One prefill engine process (started by the suite).
    Engine {
        /// The engine spec (JSON).
        #[arg(long)]
        spec: String,
    },
}

fn main() {
    let cli = Cli::parse();
    if let Some(Sub::Engine { spec }) = cli.cmd {
        let spec: EngineSpec = match serde_json::from_str(&spec) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("engine: bad --spec: {e}");
                std::process::exit(2);
            }
        };
        if let Err(e) = run_engine(spec) {
            eprintln!("engine: {e}");
            std::process::exit(1);
        }
        return;
    }
    let exe = std::env::current_exe().expect("current exe");
    let dir = cli
        .bin_dir
        .clone()
        .unwrap_or_else(|| exe.parent().expect("exe dir").to_path_buf());
    let mut opts = Options::with_target_dir(&dir);
    opts.engine_exe = exe;
    opts.rounds = cli.rounds;
    opts.seed = cli.seed;
    opts.concurrency = cli.concurrency;
    opts.requests_per_round = cli.requests_per_round;
    opts.request_timeout_ms = cli.request_timeout_ms;
    opts.slack_ms = cli.slack_ms;
    opts.lease_ttl_s = cli.lease_ttl;
    opts.probe_bound_ms = cli.probe_bound_ms;
    opts.loss_percent = cli.loss_percent;
    opts.netns = !cli.no_netns;
    if let Some(t) = cli.trace {
        opts.trace = t;
    }
    if cli.work_dir.is_some() {
        opts.keep = true;
    }
    opts.work_dir = cli.work_dir;
    if !cli.faults.is_empty() {
        opts.faults = cli
            .faults
            .iter()
            .map(|f| {
                FaultKind::parse(f).unwrap_or_else(|| {
                    let names: Vec<&str> = FaultKind::ALL.iter().map(|k| k.name()).collect();
                    eprintln!("unknown fault {f:?}; known: {}", names.join(", "));
                    std::process::exit(2)
                })
            })
            .collect();
    }
    match run(opts) {
        Ok(report) => {
            println!("{}", report.table());
            if let Some(p) = cli.report {
                let json = serde_json::to_string_pretty(&report).expect("report JSON");
                if let Err(e) = std::fs::write(&p, json) {
                    eprintln!("{}: {e}", p.display());
                    std::process::exit(2);
                }
                eprintln!("report written to {}", p.display());
            }
            std::process::exit(if report.passed() { 0 } else { 1 });
        }
        Err(RunError::Skip(s)) => {
            eprintln!("SKIP: {s}");
            std::process::exit(
                if std::env::var("KVFABRIC_REQUIRE_SERVICES").as_deref() == Ok("1") {
                    1
                } else {
                    0
                },
            );
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    }
}
