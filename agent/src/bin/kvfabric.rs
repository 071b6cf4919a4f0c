//! `kvfabric` — the kvfabric command line.
//!
//! * `kvfabric bench` — the main job: replay a request trace prefill →
//!   decode through bounce and the standard path. Embedded mode (default):
//!   both agents in this process, no etcd. Distributed mode (`--etcd`): the
//!   bench is a client of two `kvfabric agent` daemons found in etcd
//!   (`--prefill` / `--decode` logical ids), driving them over HTTP.
//! * `kvfabric dataplane-bench` — 64 MiB of 4/8/64 KiB random slots through
//!   the standard per-descriptor path, bounce and one descriptor, side by
//!   side in two processes, every transfer verified.
//! * `kvfabric agent` — the per-node agent daemon: KV pool + bounce engine,
//!   discovery (etcd or embedded), HTTP API (`/healthz`, `/readyz`,
//!   `/metrics`, `/v1/peers`, `/v1/config`, `/v1/debug/verify`,
//!   `/v1/debug/transfer`), graceful
//!   shutdown on SIGTERM/SIGINT.
//! * `kvfabric peer` — the receiver process the bench spawns (internal).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvfabric_agent::bench::dataplane::{self, DataplaneOptions};
use kvfabric_agent::core::config::{is_config_env, parse_byte_size, BounceConfig};

#[derive(Parser)]
#[command(
    name = "kvfabric",
    version,
    about = "KV-cache fabric for disaggregated LLM serving"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Replay a request trace prefill -> decode, bounce vs standard path, every byte verified.
    Bench(BenchArgs),
    /// Data-plane bench: standard path vs bounce vs one descriptor, two processes.
    DataplaneBench {
        /// Bytes per transfer (suffixes K/M/G accepted).
        #[arg(long, default_value = "64MiB", value_parser = byte_size)]
        total: u64,
        /// Descriptor sizes, comma-separated (suffixes accepted).
        #[arg(long, default_value = "4KiB,8KiB,64KiB", value_delimiter = ',', value_parser = byte_size)]
        sizes: Vec<u64>,
        /// Timed iterations per path and size (median reported).
        #[arg(long, default_value_t = 5)]
        iterations: usize,
        /// Untimed (still verified) warm-up iterations per path and size.
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        /// Bounce chunk size.
        #[arg(long, default_value = "4MiB", value_parser = byte_size)]
        chunk: u64,
        /// In-flight chunks per request (W).
        #[arg(long, default_value_t = 8)]
        inflight: u32,
        /// Arena size.
        #[arg(long, default_value = "64MiB", value_parser = byte_size)]
        arena: u64,
        /// Skip the (slow) standard per-descriptor path.
        #[arg(long)]
        skip_standard: bool,
        /// Write the JSON report here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Run the agent daemon (config: --config YAML, KVFABRIC_* env, flags; flags win).
    Agent(AgentArgs),
    /// Receiver process of the data-plane bench (spawned by it).
    #[command(hide = true)]
    Peer {
        /// Exchange directory.
        #[arg(long)]
        dir: PathBuf,
        /// Pool size in bytes.
        #[arg(long)]
        pool_bytes: u64,
    },
}

#[derive(clap::Args)]
struct BenchArgs {
    /// JSONL trace (default: the Mooncake conversation trace in ../shared/data/traces).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// First trace line to replay (0-based).
    #[arg(long, default_value_t = 0)]
    start: usize,
    /// Number of consecutive requests to replay.
    #[arg(long, default_value_t = 40)]
    requests: usize,
    /// Model preset: Llama-3.1-8B, Llama-3.1-70B, Qwen2.5-7B, gpt-oss-120b.
    #[arg(long, default_value = "Llama-3.1-8B")]
    model: String,
    /// Custom geometry instead of a preset: layers,kv_heads,head_dim,dtype_bytes.
    #[arg(long)]
    geometry: Option<String>,
    /// Tensor parallelism (divides the KV heads).
    #[arg(long, default_value_t = 4)]
    tp: u32,
    /// Tokens per paged block.
    #[arg(long, default_value_t = 16)]
    block: u32,
    /// K and V in one tensor (default: separate K and V tensors).
    #[arg(long)]
    no_kv_split: bool,
    /// Concurrent requests.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Replay by trace timestamps divided by this factor (default: fixed concurrency).
    #[arg(long)]
    speed: Option<f64>,
    /// KV pool size per side (prefill, decode); requests wait for free blocks.
    /// Default 4GiB; in distributed mode the agents' pools, capped by this.
    #[arg(long, value_parser = byte_size)]
    pool: Option<u64>,
    /// Paths to run, in order.
    #[arg(long, default_value = "bounce,standard", value_delimiter = ',')]
    paths: Vec<String>,
    /// Bounce config YAML (BounceConfig keys); KVFABRIC_BOUNCE_* env overrides it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// JSON report path.
    #[arg(long, default_value = "kvfabric-bench-report.json")]
    json: PathBuf,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Distributed mode: etcd endpoints (comma-separated). The bench then
    /// runs no agents itself: it drives the `kvfabric agent` daemons named
    /// by --prefill / --decode over their HTTP APIs.
    #[arg(long, value_delimiter = ',')]
    etcd: Option<Vec<String>>,
    /// Fabric name of the agents (distributed mode).
    #[arg(long, default_value = "default")]
    fabric: String,
    /// Logical id of the prefill (sending) agent (distributed mode).
    #[arg(long, default_value = "prefill")]
    prefill: String,
    /// Logical id of the decode (receiving) agent (distributed mode).
    #[arg(long, default_value = "decode")]
    decode: String,
    /// Seconds to wait for both agents to be registered, ready and loaded
    /// by each other (distributed mode).
    #[arg(long, default_value_t = 60)]
    wait: u64,
}

#[derive(clap::Args)]
struct AgentArgs {
    /// YAML config file (AgentConfig keys, camelCase; `bounce:` holds the BounceConfig).
    #[arg(long)]
    config: Option<PathBuf>,
    /// HTTP listen address host:port (port 0 = ephemeral; the bound address is printed).
    #[arg(long)]
    listen: Option<String>,
    /// Fabric name (discovery key prefix /kvfabric/FABRIC/agents/).
    #[arg(long)]
    fabric: Option<String>,
    /// Stable agent id (default: $POD_NAME, $HOSTNAME, or the host name).
    #[arg(long)]
    logical_id: Option<String>,
    /// Role: prefill, decode or both.
    #[arg(long)]
    role: Option<String>,
    /// KV pool size (suffixes accepted).
    #[arg(long, value_parser = byte_size)]
    pool_size: Option<u64>,
    /// etcd endpoints, comma-separated (none = embedded in-process discovery).
    #[arg(long, value_delimiter = ',')]
    etcd: Option<Vec<String>>,
    /// Discovery lease TTL in seconds.
    #[arg(long)]
    lease_ttl: Option<u64>,
    /// Control channel bind: routable, loopback, interface:NIC or an IP.
    #[arg(long)]
    control_bind: Option<String>,
    /// Log format: text or json.
    #[arg(long)]
    log_format: Option<String>,
    /// Print the effective config as YAML and exit.
    #[arg(long)]
    print_config: bool,
}

fn run_agent(a: AgentArgs) -> Result<(), String> {
    use kvfabric_agent::service::daemon::{self, AgentConfig, AgentOverrides, LogFormat};
    use std::io::Write as _;
    let log_format = match a.log_format.as_deref() {
        None => None,
        Some("text") => Some(LogFormat::Text),
        Some("json") => Some(LogFormat::Json),
        Some(other) => {
            return Err(format!(
                "--log-format: expected text or json, got {other:?}"
            ))
        }
    };
    let overrides = AgentOverrides {
        listen: a.listen,
        fabric: a.fabric,
        logical_id: a.logical_id,
        role: a.role,
        pool_size_bytes: a.pool_size,
        etcd_endpoints: a.etcd,
        lease_ttl_seconds: a.lease_ttl,
        control_bind: a.control_bind,
        log_format,
    };
    let (cfg, warnings) = AgentConfig::load(a.config.as_deref(), std::env::vars(), &overrides)?;
    daemon::init_logging(cfg.log_format);
    for w in warnings {
        tracing::warn!("{w}");
    }
    if a.print_config {
        print!(
            "{}",
            serde_yaml::to_string(&cfg).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    daemon::run(cfg, |addr| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "kvfabric agent listening on http://{addr}");
        let _ = out.flush();
    })
}

fn default_trace() -> PathBuf {
    let rel = "shared/data/traces/mooncake_conversation_trace.jsonl";
    let candidates = [
        PathBuf::from("..").join(rel),
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(rel),
    ];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| candidates[0].clone())
}

fn run_bench(a: BenchArgs) -> Result<(), String> {
    use kvfabric_agent::bench::trace::BenchPath;
    use kvfabric_agent::core::model::{parse_trace, preset, KvLayout, ModelGeometry};

    let model = match &a.geometry {
        None => preset(&a.model)?,
        Some(g) => {
            let v: Vec<u32> = g
                .split(',')
                .map(|x| x.trim().parse::<u32>())
                .collect::<Result<_, _>>()
                .map_err(|_| format!("--geometry: expected layers,kv_heads,head_dim,dtype_bytes as integers, got {g:?}"))?;
            let [layers, kv_heads, head_dim, dtype_bytes] = v[..] else {
                return Err(format!("--geometry: expected 4 integers, got {g:?}"));
            };
            ModelGeometry {
                name: format!("custom({g})"),
                layers,
                kv_heads,
                head_dim,
                dtype_bytes,
            }
        }
    };
    let layout = KvLayout::new(model, a.block, a.tp, !a.no_kv_split)?;
    let paths = a
        .paths
        .iter()
        .map(|p| p.parse::<BenchPath>())
        .collect::<Result<Vec<_>, _>>()?;
    let trace_path = a.trace.clone().unwrap_or_else(default_trace);
    let text = std::fs::read_to_string(&trace_path)
        .map_err(|e| format!("trace {}: {e} (pass --trace PATH)", trace_path.display()))?;
    let trace = parse_trace(&text, a.start, a.requests)?;
    if trace.is_empty() {
        return Err(format!(
            "trace {}: no requests at line {}",
            trace_path.display(),
            a.start
        ));
    }
    let report = match &a.etcd {
        Some(endpoints) => run_distributed(&a, endpoints, layout, paths, &trace, &trace_path)?,
        None => run_embedded(&a, layout, paths, &trace, &trace_path)?,
    };
    print!("{}", report.table());
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    std::fs::write(&a.json, text).map_err(|e| format!("{}: {e}", a.json.display()))?;
    eprintln!("report written to {}", a.json.display());
    if report.failures() > 0 {
        return Err(format!(
            "{} requests failed or did not verify",
            report.failures()
        ));
    }
    Ok(())
}

/// Embedded mode: both agents (and their pools) in this process.
fn run_embedded(
    a: &BenchArgs,
    layout: kvfabric_agent::core::model::KvLayout,
    paths: Vec<kvfabric_agent::bench::trace::BenchPath>,
    trace: &[kvfabric_agent::core::model::TraceRecord],
    trace_path: &std::path::Path,
) -> Result<kvfabric_agent::bench::trace::ReplayReport, String> {
    use kvfabric_agent::bench::trace::{replay, KvPool};
    use kvfabric_agent::runtime::control::zmq::BindAddr;
    use kvfabric_agent::runtime::engine::{MemDesc, MemKind};
    use kvfabric_agent::runtime::fabric::{FabricAgent, FabricOptions};

    let mut config = match &a.config {
        Some(p) => {
            let y = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
            BounceConfig::from_yaml_str(&y).map_err(|e| format!("{}: {e}", p.display()))?
        }
        None => BounceConfig {
            enabled: true,
            ..BounceConfig::default()
        },
    };
    for w in config.apply_env_vars(std::env::vars().filter(|(k, _)| is_config_env(k))) {
        eprintln!("warning: {w}");
    }
    config.enabled = true;
    let eff = config.validate().map_err(|e| e.to_string())?;
    let pool = a.pool.unwrap_or(DEFAULT_POOL);
    let pool_blocks = (pool / layout.bytes_per_block()).min(u64::from(u32::MAX)) as u32;
    let ppool = KvPool::new(&layout, pool_blocks, 1)?;
    let dpool = KvPool::new(&layout, pool_blocks, 2)?;
    let mk = |role: &str, pool: &KvPool| {
        let (base, len) = pool.region();
        FabricAgent::new(FabricOptions {
            name: format!(
                "{role}-{}-{:x}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0)
            ),
            config: eff.clone(),
            kv_regions: vec![(MemKind::Dram, MemDesc::host(base, len))],
            bind: BindAddr::Loopback,
            copy: None,
        })
        .map_err(|e| format!("{role} agent: {e}"))
    };
    let prefill = mk("prefill", &ppool)?;
    let decode = mk("decode", &dpool)?;
    // Embedded discovery: each agent loads the other's published descriptor.
    decode
        .load_peer(&prefill.local_descriptor().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let st = prefill
        .load_peer(&decode.local_descriptor().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    if let Err(why) = st.bounce {
        return Err(format!("decode agent is not bounce-capable: {why:?}"));
    }
    print_replay_banner(trace, trace_path, &layout, pool_blocks);
    replay(
        &prefill,
        &decode,
        &ppool,
        &dpool,
        trace,
        &a.replay_options(layout, pool_blocks, paths),
    )
}

/// Default `--pool` (embedded mode).
const DEFAULT_POOL: u64 = 4 << 30;

/// Distributed mode: the bench drives two agent daemons found in etcd.
fn run_distributed(
    a: &BenchArgs,
    endpoints: &[String],
    layout: kvfabric_agent::core::model::KvLayout,
    paths: Vec<kvfabric_agent::bench::trace::BenchPath>,
    trace: &[kvfabric_agent::core::model::TraceRecord],
    trace_path: &std::path::Path,
) -> Result<kvfabric_agent::bench::trace::ReplayReport, String> {
    use kvfabric_agent::bench::remote::{
        lookup_agents, wait_until_paired, RemoteAgent, RemoteHandOff,
    };
    use kvfabric_agent::bench::trace::{replay_with, BenchPath, BlockPool};
    use std::time::Duration;

    if a.config.is_some() {
        return Err(
            "--config applies to embedded mode; in distributed mode the agents use their own bounce config (KVFABRIC_BOUNCE_* / their --config)".into(),
        );
    }
    if a.prefill == a.decode {
        return Err("--prefill and --decode must name two different agents".into());
    }
    let wait = Duration::from_secs(a.wait);
    eprintln!(
        "distributed mode: looking up agents {:?} (prefill) and {:?} (decode) in fabric {:?} at {}",
        a.prefill,
        a.decode,
        a.fabric,
        endpoints.join(",")
    );
    let recs = lookup_agents(endpoints, &a.fabric, &[&a.prefill, &a.decode], wait)?;
    let mut recs = recs.into_iter();
    let (Some(p), Some(d)) = (recs.next(), recs.next()) else {
        return Err("agent lookup returned too few records".into());
    };
    let prefill = RemoteAgent::from_record(p)?;
    let decode = RemoteAgent::from_record(d)?;
    for (role, r) in [("prefill", &prefill), ("decode", &decode)] {
        eprintln!(
            "  {role}: {} at {} (role {}), pool {:#x} + {} B",
            r.name(),
            r.record.http,
            if r.record.role.is_empty() {
                "?"
            } else {
                &r.record.role
            },
            r.pool.addr,
            r.pool.len
        );
    }
    wait_until_paired(&prefill, &decode, paths.contains(&BenchPath::Bounce), wait)?;
    let pool = prefill
        .pool
        .len
        .min(decode.pool.len)
        .min(a.pool.unwrap_or(u64::MAX));
    let pool_blocks = (pool / layout.bytes_per_block()).min(u64::from(u32::MAX)) as u32;
    let ppool = BlockPool::new(&layout, pool_blocks, prefill.pool.addr, 1);
    let dpool = BlockPool::new(&layout, pool_blocks, decode.pool.addr, 2);
    print_replay_banner(trace, trace_path, &layout, pool_blocks);
    replay_with(
        &RemoteHandOff { prefill, decode },
        &ppool,
        &dpool,
        trace,
        &a.replay_options(layout, pool_blocks, paths),
    )
}

impl BenchArgs {
    /// The replay options these flags give, for either mode.
    fn replay_options(
        &self,
        layout: kvfabric_agent::core::model::KvLayout,
        pool_blocks: u32,
        paths: Vec<kvfabric_agent::bench::trace::BenchPath>,
    ) -> kvfabric_agent::bench::trace::ReplayOptions {
        kvfabric_agent::bench::trace::ReplayOptions {
            layout,
            concurrency: self.concurrency,
            speed: self.speed,
            pool_blocks,
            paths,
            progress: !self.quiet,
        }
    }
}

/// The one-line summary printed before a replay (embedded or distributed).
fn print_replay_banner(
    trace: &[kvfabric_agent::core::model::TraceRecord],
    trace_path: &std::path::Path,
    layout: &kvfabric_agent::core::model::KvLayout,
    pool_blocks: u32,
) {
    eprintln!(
        "replaying {} requests of {} ({} tokens max) with {} TP{} block {}: {} B descriptors, pool {} blocks/side",
        trace.len(),
        trace_path.display(),
        trace.iter().map(|r| r.input_length).max().unwrap_or(0),
        layout.model.name,
        layout.tp,
        layout.block_tokens,
        layout.descriptor_bytes(),
        pool_blocks
    );
}

fn byte_size(s: &str) -> Result<u64, String> {
    parse_byte_size(s).map_err(|e| format!("{s:?}: {e}"))
}

fn main() -> ExitCode {
    kvfabric_agent::tune_allocator();
    let cli = Cli::parse();
    if !matches!(cli.cmd, Cmd::Agent(_)) {
        kvfabric_agent::init_cli_logs();
    }
    let result = match cli.cmd {
        Cmd::Agent(a) => run_agent(a),
        Cmd::Bench(a) => run_bench(a),
        Cmd::Peer { dir, pool_bytes } => dataplane::run_peer(&dir, pool_bytes),
        Cmd::DataplaneBench {
            total,
            sizes,
            iterations,
            warmup,
            chunk,
            inflight,
            arena,
            skip_standard,
            json,
        } => (|| {
            // Other settings come from KVFABRIC_BOUNCE_* (e.g.
            // SCATTER_WORKER_COUNT); the flags win.
            let (mut config, warnings) = BounceConfig::from_env();
            for w in warnings {
                eprintln!("warning: {w}");
            }
            for w in config.apply_env_vars([
                ("KVFABRIC_BOUNCE_ENABLE", "1".to_string()),
                ("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", arena.to_string()),
                ("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", chunk.to_string()),
                (
                    "KVFABRIC_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST",
                    inflight.to_string(),
                ),
                ("KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT", "1".to_string()),
            ]) {
                eprintln!("warning: {w}");
            }
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            let report = dataplane::run(
                &exe,
                &DataplaneOptions {
                    total_bytes: total,
                    block_sizes: sizes,
                    iterations,
                    warmup,
                    config,
                    skip_standard,
                },
            )?;
            print!("{}", report.table());
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
                std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
            }
            Ok(())
        })(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
