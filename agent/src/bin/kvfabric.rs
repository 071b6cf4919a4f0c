//! `kvfabric` — the kvfabric command line.
//!
//! * `kvfabric bench` — the main job: replay a request trace prefill →
//!   decode through bounce and the standard path. Embedded mode (default):
//!   both agents in this process, no etcd. Distributed mode
//!   (`--prefill-socket` / `--decode-socket`): the bench attaches one
//!   engine to each of two `kvfabric agent` daemons through their engine
//!   API and hands blocks off by id, as serving engines do.
//! * `kvfabric dataplane-bench` — 64 MiB of 4/8/64 KiB random slots through
//!   the standard per-descriptor path, bounce and one descriptor, side by
//!   side in two processes, every transfer verified.
//! * `kvfabric agent` — the per-node agent daemon: KV pool + bounce engine,
//!   discovery (etcd or embedded), HTTP API (`/healthz`, `/readyz`,
//!   `/metrics`, `/v1/peers`, `/v1/config`; `/v1/debug/verify` and
//!   `/v1/debug/transfer` only with `--debug-api`), the engine API
//!   (`--engine-socket`), graceful shutdown on SIGTERM/SIGINT.
//! * `kvfabric peer` — the receiver process the bench spawns (internal).

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvfabric_agent::bench::arrivals::{fixed_prompt_trace, Arrivals};
use kvfabric_agent::bench::cli::{
    bench_path, concurrency, geometry, model_preset, non_empty, nonzero_byte_size, ReportFile,
    MAX_WAIT_S,
};
use kvfabric_agent::bench::dataplane::{self, DataplaneOptions};
use kvfabric_agent::bench::trace::{human_bytes, BenchPath, SliceDemand};
use kvfabric_agent::bench_args::ArrivalArgs;
use kvfabric_agent::core::config::{is_config_env, BounceConfig};
use kvfabric_agent::core::model::{KvLayout, ModelGeometry, TraceRecord};

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
    DataplaneBench(DataplaneArgs),
    /// Run the agent daemon (config: --config YAML, KVFABRIC_* env, flags; flags win).
    Agent(AgentArgs),
    /// Print a config rollout document (JSON) for a bounce config, to put at
    /// /kvfabric/<fabric>/config/agents/<logical id> in etcd when no
    /// operator manages the fabric; the agent applies it in process.
    ConfigDoc(ConfigDocArgs),
    /// Receiver process of the data-plane bench (spawned by it).
    #[command(hide = true)]
    Peer {
        /// Exchange directory.
        #[arg(long)]
        dir: PathBuf,
        /// Pool size in bytes.
        #[arg(long, value_parser = nonzero_byte_size)]
        pool_bytes: u64,
    },
}

#[derive(clap::Args)]
struct ConfigDocArgs {
    /// Rollout generation, at least 1 (higher than the agent's to apply).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    generation: u64,
    /// Bounce config YAML (BounceConfig keys; default: the defaults with
    /// bounce enabled); KVFABRIC_BOUNCE_* env overrides it.
    #[arg(long)]
    config: Option<PathBuf>,
}

/// Most descriptors per transfer `dataplane-bench` builds (`--total` /
/// the smallest of `--sizes`): 4 Mi.
const MAX_DATAPLANE_DESCRIPTORS: u64 = 1 << 22;

#[derive(clap::Args)]
struct DataplaneArgs {
    /// Bytes per transfer (suffixes K/M/G accepted).
    #[arg(long, default_value = "64MiB", value_parser = nonzero_byte_size)]
    total: u64,
    /// Descriptor sizes, comma-separated (suffixes accepted), each at most
    /// --total.
    #[arg(long, default_value = "4KiB,8KiB,64KiB", value_delimiter = ',', value_parser = nonzero_byte_size)]
    sizes: Vec<u64>,
    /// Timed iterations per path and size (median reported; at least 1).
    #[arg(long, default_value_t = 5, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    iterations: usize,
    /// Untimed (still verified) warm-up iterations per path and size.
    #[arg(long, default_value_t = 2, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1_000_000))]
    warmup: usize,
    /// Bounce chunk size.
    #[arg(long, default_value = "4MiB", value_parser = nonzero_byte_size)]
    chunk: u64,
    /// In-flight chunks per request (W; at least 1).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    inflight: u32,
    /// Arena size.
    #[arg(long, default_value = "64MiB", value_parser = nonzero_byte_size)]
    arena: u64,
    /// Skip the (slow) standard per-descriptor path.
    #[arg(long)]
    skip_standard: bool,
    /// Write the JSON report here (checked for writing before the run).
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// JSONL trace (default: the Mooncake conversation trace in ../shared/data/traces).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// First trace line to replay (0-based).
    #[arg(long, default_value_t = 0)]
    start: usize,
    /// Number of consecutive requests to replay (at least 1; with
    /// --fixed-prompt: synthetic requests, at most 10,000,000).
    #[arg(long, default_value = "40")]
    requests: NonZeroUsize,
    /// --fixed-prompt, --speed, --rate, --seed, --warmup (shared with `kvfabric-gpu bench`).
    #[command(flatten)]
    arrival: ArrivalArgs,
    /// Model preset: Llama-3.1-8B, Llama-3.1-70B, Qwen2.5-7B, gpt-oss-120b.
    #[arg(long, default_value = "Llama-3.1-8B", value_parser = model_preset)]
    model: ModelGeometry,
    /// Custom geometry instead of a preset: layers,kv_heads,head_dim,dtype_bytes (each at least 1).
    #[arg(long, value_parser = geometry, conflicts_with = "model")]
    geometry: Option<ModelGeometry>,
    /// Tensor parallelism (divides the KV heads).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    tp: u32,
    /// Tokens per paged block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    block: u32,
    /// K and V in one tensor (default: separate K and V tensors).
    #[arg(long)]
    no_kv_split: bool,
    /// Concurrent requests (1 to 4096): closed loop, the number in flight;
    /// with --speed or --rate, the most in flight (a request due while all
    /// are busy waits, and its latency counts from its arrival).
    #[arg(long, default_value_t = 32, value_parser = concurrency)]
    concurrency: usize,
    /// KV pool size per side (prefill, decode); requests wait for free
    /// blocks. Default: what the slice's requests in flight hold at once,
    /// capped at 1GiB but at least its largest request (the memory is
    /// printed before the run). In distributed mode the pools are the
    /// bench engines' shm pools, sized the same way.
    #[arg(long, value_parser = nonzero_byte_size)]
    pool: Option<u64>,
    /// Paths to run, in order: bounce, standard, auto (the routing gate
    /// picks per request, as serving engines do by default).
    #[arg(long, default_value = "bounce,standard", value_delimiter = ',', value_parser = bench_path)]
    paths: Vec<BenchPath>,
    /// Bounce config YAML (BounceConfig keys); KVFABRIC_BOUNCE_* env
    /// overrides it (embedded mode only: agent daemons have their own).
    #[arg(long)]
    config: Option<PathBuf>,
    /// JSON report path (checked for writing before the run).
    #[arg(long, default_value = "kvfabric-bench-report.json")]
    json: PathBuf,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Distributed mode: the engine socket of the prefill (sending) agent
    /// (its --engine-socket). The bench then runs no agents itself: it
    /// attaches an engine to each agent and hands blocks off through them.
    #[arg(long, value_name = "PATH", requires = "decode_socket", value_parser = non_empty_path)]
    prefill_socket: Option<PathBuf>,
    /// Distributed mode: the engine socket of the decode (receiving) agent.
    #[arg(long, value_name = "PATH", requires = "prefill_socket", value_parser = non_empty_path)]
    decode_socket: Option<PathBuf>,
    /// Seconds to wait for the agents' sockets, and before each path's
    /// phase for the decode engine to be reachable from the prefill agent
    /// (distributed mode; at most 86400).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(0..=MAX_WAIT_S))]
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
    /// KV pool size (suffixes accepted; at least 1 byte).
    #[arg(long, value_parser = nonzero_byte_size)]
    pool_size: Option<u64>,
    /// etcd endpoints, comma-separated (none = embedded in-process discovery).
    #[arg(long, value_delimiter = ',')]
    etcd: Option<Vec<String>>,
    /// Discovery lease TTL in seconds (1 to 86400).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    lease_ttl: Option<u64>,
    /// Control channel bind: routable, loopback, interface:NIC or an IP.
    #[arg(long)]
    control_bind: Option<String>,
    /// Log format: text or json.
    #[arg(long)]
    log_format: Option<String>,
    /// Serve the engines' local API (gRPC) on this Unix socket (mode 0660).
    #[arg(long, value_name = "PATH")]
    engine_socket: Option<String>,
    /// UID of the pod this agent runs in (the operator invalidates by it).
    #[arg(long, value_name = "UID")]
    pod_uid: Option<String>,
    /// Put the bounce arena and the engines' pools on this CUDA device
    /// (builds with the `cuda` feature).
    #[arg(long, value_name = "ORDINAL")]
    gpu: Option<u32>,
    /// Serve the unauthenticated /v1/debug/transfer and /v1/debug/verify
    /// endpoints (tests and debugging); loopback --listen only.
    #[arg(long)]
    debug_api: bool,
    /// Refuse GPU engines that do not name their GPU's UUID (one agent per
    /// GPU on a node: an engine pod's ordinals are its own; env
    /// KVFABRIC_REQUIRE_DEVICE_UUID).
    #[arg(long)]
    require_device_uuid: bool,
    /// Export OpenTelemetry traces of engine hand-offs (a `kvfabric.transfer`
    /// span per sampled Transfer call, parented by the engine's
    /// traceparent, with submit/bounce stage spans and per-chunk events) to
    /// this OTLP/gRPC endpoint, e.g. http://collector:4317. Unset = no
    /// tracing (env KVFABRIC_OTLP_ENDPOINT).
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// Fraction of hand-offs traced when the engine's traceparent is absent
    /// (a sampled traceparent is always followed, an unsampled one never):
    /// 0 to 1, default 0.01 (env KVFABRIC_TRACE_SAMPLE_RATIO).
    #[arg(long, value_name = "RATIO", value_parser = sample_ratio)]
    trace_sample_ratio: Option<f64>,
    /// etcd client TLS: the CA (PEM) that signed etcd's serving certificate;
    /// with --etcd-cert-file and --etcd-key-file (all three or none), and
    /// https:// endpoints (env KVFABRIC_ETCD_CA_FILE).
    #[arg(long, value_name = "PEM")]
    etcd_ca_file: Option<String>,
    /// etcd client certificate (PEM; env KVFABRIC_ETCD_CERT_FILE).
    #[arg(long, value_name = "PEM")]
    etcd_cert_file: Option<String>,
    /// etcd client private key (PEM; env KVFABRIC_ETCD_KEY_FILE).
    #[arg(long, value_name = "PEM")]
    etcd_key_file: Option<String>,
    /// File holding the fabric's control key (at least 32 bytes): TCP
    /// control hellos are signed and checked with it (needs
    /// KVFABRIC_BOUNCE_CONTROL_TRANSPORT=tcp; env KVFABRIC_CONTROL_KEY_FILE).
    #[arg(long, value_name = "FILE")]
    control_key_file: Option<String>,
    /// off, optional (sign; still accept unsigned hellos: the rollout step)
    /// or required (default with a key file; env KVFABRIC_CONTROL_AUTH).
    #[arg(long, value_name = "MODE")]
    control_auth: Option<String>,
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
        debug_api: a.debug_api.then_some(true),
        require_device_uuid: a.require_device_uuid.then_some(true),
        engine_socket: a.engine_socket,
        gpu: a.gpu,
        pod_uid: a.pod_uid,
        otlp_endpoint: a.otlp_endpoint,
        trace_sample_ratio: a.trace_sample_ratio,
        etcd_ca_file: a.etcd_ca_file,
        etcd_cert_file: a.etcd_cert_file,
        etcd_key_file: a.etcd_key_file,
        control_key_file: a.control_key_file,
        control_auth: a.control_auth,
    };
    let (cfg, warnings) = AgentConfig::load(a.config.as_deref(), std::env::vars(), &overrides)?;
    daemon::init_logging(cfg.log_format);
    if a.print_config {
        // (daemon::run logs them otherwise.)
        for w in &warnings {
            tracing::error!("config: {w}");
        }
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

/// A ratio from 0 to 1.
fn sample_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("expected a ratio from 0 to 1, got {s:?}")),
    }
}

/// A path that is not empty.
fn non_empty_path(s: &str) -> Result<PathBuf, String> {
    non_empty(s).map(|_| PathBuf::from(s))
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

/// The KV layout the flags give (preset or `--geometry`, `--tp`,
/// `--block`, `--no-kv-split`).
fn bench_layout(a: &BenchArgs) -> Result<KvLayout, String> {
    let model = a.geometry.clone().unwrap_or_else(|| a.model.clone());
    KvLayout::new(model, a.block, a.tp, !a.no_kv_split)
        .map_err(|e| format!("--model/--geometry, --tp, --block: {e}"))
}

/// Reads `requests` records from line `start` of the trace at `path`.
fn load_trace(
    path: &std::path::Path,
    start: usize,
    requests: usize,
) -> Result<Vec<TraceRecord>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--trace {}: {e} (pass --trace PATH)", path.display()))?;
    let trace = kvfabric_agent::core::model::parse_trace(&text, start, requests)
        .map_err(|e| format!("--trace {}: {e}", path.display()))?;
    if trace.is_empty() {
        return Err(format!(
            "--start {start}: trace {} has no requests from line {start} on ({} lines)",
            path.display(),
            text.lines().count()
        ));
    }
    Ok(trace)
}

/// The requests to replay and where they came from (for the banner):
/// `--fixed-prompt` synthetic requests, or the slice of the trace file.
fn bench_trace(a: &BenchArgs) -> Result<(PathBuf, Vec<TraceRecord>), String> {
    match a.arrival.fixed_prompt {
        Some(tokens) => Ok((
            PathBuf::from(format!("--fixed-prompt {tokens}")),
            fixed_prompt_trace(tokens, a.requests.get())?,
        )),
        None => {
            let path = a.trace.clone().unwrap_or_else(default_trace);
            let trace = load_trace(&path, a.start, a.requests.get())?;
            Ok((path, trace))
        }
    }
}

fn run_bench(a: BenchArgs) -> Result<(), String> {
    // Every flag is checked (here and by its value parser) before any
    // memory is allocated or agent started.
    let layout = bench_layout(&a)?;
    let distributed = match (&a.prefill_socket, &a.decode_socket) {
        (Some(p), Some(d)) => Some((p.clone(), d.clone())),
        _ => None,
    };
    if distributed.is_some() && a.config.is_some() {
        return Err(
            "--config applies to embedded mode; in distributed mode the agents use their own bounce config (KVFABRIC_BOUNCE_* / their --config)".into(),
        );
    }
    if distributed.as_ref().is_some_and(|(p, d)| p == d) {
        return Err(
            "--prefill-socket and --decode-socket must be the sockets of two different agents"
                .into(),
        );
    }
    let report_file = ReportFile::open("--json", &a.json)?;
    let (trace_path, trace) = bench_trace(&a)?;
    let demand = SliceDemand::of(&layout, &trace, a.concurrency);
    if demand.requests == 0 {
        return Err(format!(
            "--start {} --requests {}: none of the {} requests of the slice has prompt tokens; nothing to move",
            a.start,
            a.requests,
            trace.len()
        ));
    }
    let mut report = match distributed {
        Some((p, d)) => run_distributed(&a, p, d, layout, &demand, &trace, &trace_path)?,
        None => run_embedded(&a, layout, &demand, &trace, &trace_path)?,
    };
    report.fixed_prompt_tokens = a.arrival.fixed_prompt;
    print!("{}", report.table());
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    let written = report_file.path().display().to_string();
    report_file.write(&text)?;
    eprintln!("report written to {written}");
    if report.failures() > 0 {
        return Err(format!(
            "{} requests failed or did not verify",
            report.failures()
        ));
    }
    Ok(())
}

/// The bench's KV pool per side in blocks (either mode), and where its
/// size came from: `--pool`, or [`SliceDemand::default_pool_bytes`]
/// capped at
/// [`DEFAULT_POOL_CAP_BYTES`](kvfabric_agent::bench::trace::DEFAULT_POOL_CAP_BYTES).
fn slice_pool(
    a: &BenchArgs,
    layout: &KvLayout,
    demand: &SliceDemand,
) -> Result<(u32, String), String> {
    use kvfabric_agent::bench::trace::{check_pool, pool_blocks_for, DEFAULT_POOL_CAP_BYTES};
    let per_block = layout.bytes_per_block();
    let (bytes, how) = match a.pool {
        Some(p) => (p, "--pool".to_string()),
        None => {
            let in_flight = demand.in_flight_blocks.saturating_mul(per_block);
            let largest = demand
                .largest
                .map_or(0, |(_, b)| b.saturating_mul(per_block));
            (
                demand.default_pool_bytes(layout, DEFAULT_POOL_CAP_BYTES),
                format!(
                    "sized from the slice: up to {} in flight at once, capped at {}, its largest request {}; --pool sets it",
                    human_bytes(in_flight),
                    human_bytes(DEFAULT_POOL_CAP_BYTES),
                    human_bytes(largest)
                ),
            )
        }
    };
    let blocks = pool_blocks_for(layout, bytes);
    if blocks == 0 {
        return Err(format!(
            "--pool {bytes}: less than one KV block ({} with this model, --tp and --block)",
            human_bytes(per_block)
        ));
    }
    check_pool(layout, demand, blocks)?;
    Ok((blocks, how))
}

/// Bytes of memory available to new allocations (Linux `MemAvailable`),
/// if known.
fn mem_available() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))?
        .split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()
        .map(|kb| kb.saturating_mul(1024))
}

/// Embedded mode: both agents (and their pools) in this process.
fn run_embedded(
    a: &BenchArgs,
    layout: KvLayout,
    demand: &SliceDemand,
    trace: &[TraceRecord],
    trace_path: &std::path::Path,
) -> Result<kvfabric_agent::bench::trace::ReplayReport, String> {
    use kvfabric_agent::bench::trace::{replay, BlockPool, KvPool};
    use kvfabric_agent::runtime::control::zmq::BindAddr;
    use kvfabric_agent::runtime::engine::{MemDesc, MemKind};
    use kvfabric_agent::runtime::fabric::{FabricAgent, FabricOptions};

    let mut config = bounce_config_arg(a.config.as_deref())?;
    config.enabled = true;
    let eff = config.validate().map_err(|e| e.to_string())?;
    let (pool_blocks, how) = slice_pool(a, &layout, demand)?;
    let pool_bytes = BlockPool::bytes_for(&layout, pool_blocks);
    let arena = eff.arena_size_bytes();
    let total = pool_bytes
        .saturating_mul(2)
        .saturating_add(arena.saturating_mul(2));
    let available = mem_available();
    eprintln!(
        "memory: 2 KV pools x {} ({how}) + 2 bounce arenas x {} = {}{}",
        human_bytes(pool_bytes),
        human_bytes(arena),
        human_bytes(total),
        available.map_or(String::new(), |m| format!(
            " of {} available",
            human_bytes(m)
        ))
    );
    if available.is_some_and(|m| total > m) {
        eprintln!(
            "warning: that is more memory than is available; pass a smaller --pool (requests then wait for blocks) or fewer --requests"
        );
    }
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
            control_auth: Default::default(),
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
    eprintln!(
        "failed requests are reported by the sending agent's request id (rid), as agent {} logs them",
        prefill.name()
    );
    replay(
        &prefill,
        &decode,
        &ppool,
        &dpool,
        trace,
        &a.replay_options(layout, pool_blocks),
    )
}

/// Distributed mode: the bench attaches one engine to each of two agent
/// daemons through their engine API (this process is both bench engines)
/// and replays the trace through them.
fn run_distributed(
    a: &BenchArgs,
    prefill_socket: PathBuf,
    decode_socket: PathBuf,
    layout: KvLayout,
    demand: &SliceDemand,
    trace: &[TraceRecord],
    trace_path: &std::path::Path,
) -> Result<kvfabric_agent::bench::trace::ReplayReport, String> {
    use kvfabric_agent::bench::remote::{shm_available, BenchEngines, EngineOptions};
    use kvfabric_agent::bench::trace::{replay_with, BlockPool};
    use std::time::Duration;

    let (pool_blocks, how) = slice_pool(a, &layout, demand)?;
    let pool_bytes = BlockPool::bytes_for(&layout, pool_blocks);
    let total = pool_bytes.saturating_mul(2);
    let shm = shm_available();
    eprintln!(
        "memory: 2 KV pools x {} ({how}) in shared memory = {}{}",
        human_bytes(pool_bytes),
        human_bytes(total),
        shm.map_or(String::new(), |m| format!(
            " of {} free in /dev/shm",
            human_bytes(m)
        ))
    );
    if shm.is_some_and(|m| total > m) {
        return Err(format!(
            "--pool: 2 shm pools of {} do not fit in the {} free in /dev/shm; pass a smaller --pool (requests then wait for blocks) or fewer --requests",
            human_bytes(pool_bytes),
            human_bytes(shm.unwrap_or(0))
        ));
    }
    eprintln!(
        "distributed mode: attaching the bench engines to the agents at {} (prefill) and {} (decode)",
        prefill_socket.display(),
        decode_socket.display()
    );
    let engines = BenchEngines::attach(
        &EngineOptions {
            prefill_socket,
            decode_socket,
            wait: Duration::from_secs(a.wait),
        },
        &layout,
        pool_blocks,
    )?;
    for (role, (engine, agent)) in [("prefill", engines.prefill()), ("decode", engines.decode())] {
        eprintln!("  {role}: engine {engine} on agent {agent}");
    }
    let ppool = BlockPool::new(&layout, pool_blocks, engines.prefill_base(), 1);
    let dpool = BlockPool::new(&layout, pool_blocks, engines.decode_base(), 2);
    print_replay_banner(trace, trace_path, &layout, pool_blocks);
    eprintln!(
        "failed requests are reported by their engine request id (request), as agent {} logs them for engine {}",
        engines.prefill().1,
        engines.prefill().0
    );
    let report = replay_with(
        &engines,
        &ppool,
        &dpool,
        trace,
        &a.replay_options(layout, pool_blocks),
    );
    if let Err(e) = engines.close() {
        eprintln!("warning: {e}");
    }
    report
}

impl BenchArgs {
    /// The arrival mode of --speed / --rate / --seed.
    fn arrivals(&self) -> Arrivals {
        self.arrival.arrivals()
    }

    /// The replay options these flags give, for either mode.
    fn replay_options(
        &self,
        layout: KvLayout,
        pool_blocks: u32,
    ) -> kvfabric_agent::bench::trace::ReplayOptions {
        kvfabric_agent::bench::trace::ReplayOptions {
            layout,
            concurrency: self.concurrency,
            arrivals: self.arrivals(),
            pool_blocks,
            paths: self.paths.clone(),
            progress: !self.quiet,
            warmup: self.arrival.warmup,
        }
    }
}

/// The one-line summary printed before a replay (embedded or distributed).
fn print_replay_banner(
    trace: &[TraceRecord],
    trace_path: &std::path::Path,
    layout: &KvLayout,
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

fn run_dataplane(a: DataplaneArgs) -> Result<(), String> {
    for &size in &a.sizes {
        if size > a.total {
            return Err(format!(
                "--sizes: {size} bytes is more than --total ({} bytes)",
                a.total
            ));
        }
        if a.total / size > MAX_DATAPLANE_DESCRIPTORS {
            return Err(format!(
                "--sizes {size} with --total {}: {} descriptors per transfer, at most {MAX_DATAPLANE_DESCRIPTORS} supported",
                a.total,
                a.total / size
            ));
        }
    }
    let report_file = a
        .json
        .as_deref()
        .map(|p| ReportFile::open("--json", p))
        .transpose()?;
    // Other settings come from KVFABRIC_BOUNCE_* (e.g.
    // SCATTER_WORKER_COUNT); the flags win.
    let (mut config, warnings) = BounceConfig::from_env();
    for w in warnings {
        eprintln!("warning: {w}");
    }
    for w in config.apply_env_vars([
        ("KVFABRIC_BOUNCE_ENABLE", "1".to_string()),
        ("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", a.arena.to_string()),
        ("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", a.chunk.to_string()),
        (
            "KVFABRIC_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST",
            a.inflight.to_string(),
        ),
        ("KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT", "1".to_string()),
    ]) {
        eprintln!("warning: {w}");
    }
    config
        .validate()
        .map_err(|e| format!("--chunk, --inflight, --arena: {e}"))?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let report = dataplane::run(
        &exe,
        &DataplaneOptions {
            total_bytes: a.total,
            block_sizes: a.sizes,
            iterations: a.iterations,
            warmup: a.warmup,
            config,
            skip_standard: a.skip_standard,
        },
    )?;
    print!("{}", report.table());
    if let Some(f) = report_file {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        f.write(&text)?;
    }
    Ok(())
}

/// The bounce config of `--config` (BounceConfig keys; default: the
/// defaults with bounce enabled) with KVFABRIC_BOUNCE_* env applied (its
/// warnings printed).
fn bounce_config_arg(path: Option<&std::path::Path>) -> Result<BounceConfig, String> {
    let mut config = match path {
        Some(p) => {
            let y =
                std::fs::read_to_string(p).map_err(|e| format!("--config {}: {e}", p.display()))?;
            BounceConfig::from_yaml_str(&y).map_err(|e| format!("--config {}: {e}", p.display()))?
        }
        None => BounceConfig {
            enabled: true,
            ..BounceConfig::default()
        },
    };
    for w in config.apply_env_vars(std::env::vars().filter(|(k, _)| is_config_env(k))) {
        eprintln!("warning: {w}");
    }
    Ok(config)
}

fn run_config_doc(a: ConfigDocArgs) -> Result<(), String> {
    let config = bounce_config_arg(a.config.as_deref())?;
    println!(
        "{}",
        kvfabric_agent::service::rollout::document(a.generation, config)?
    );
    Ok(())
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
        Cmd::DataplaneBench(a) => run_dataplane(a),
        Cmd::ConfigDoc(a) => run_config_doc(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    //! The argument space of `kvfabric bench` and `dataplane-bench`:
    //! whatever the flags, parsing and every check made before the run
    //! return a value or an error, never a panic.

    use super::*;
    use clap::CommandFactory as _;
    use kvfabric_agent::bench::arrivals::DEFAULT_SEED;
    use proptest::prelude::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("kvfabric").chain(args.iter().copied()))
    }

    fn bench(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        let mut v = vec!["bench"];
        v.extend_from_slice(args);
        match parse(&v)?.cmd {
            Cmd::Bench(b) => Ok(b),
            _ => unreachable!("bench parses to Cmd::Bench"),
        }
    }

    /// The error clap reports for `args`: its kind and rendered text.
    fn rejected(args: &[&str]) -> String {
        match bench(args) {
            Ok(_) => panic!("{args:?} was accepted"),
            Err(e) => {
                assert_eq!(e.exit_code(), 2, "{e}");
                e.to_string()
            }
        }
    }

    #[test]
    fn inputs_that_used_to_panic_are_usage_errors_naming_the_flag() {
        for (args, flag) in [
            (&["--speed", "0"][..], "--speed"),
            (&["--speed", "nan"], "--speed"),
            (&["--speed=-1"], "--speed"),
            (&["--speed", "inf"], "--speed"),
            (&["--rate", "0"], "--rate"),
            (&["--rate", "nan"], "--rate"),
            (&["--rate=-1"], "--rate"),
            (&["--rate", "inf"], "--rate"),
            (&["--rate", "x"], "--rate"),
            (&["--rate", "13", "--speed", "2"], "--speed"),
            (&["--speed", "2", "--rate", "13"], "--rate"),
            (&["--seed", "5"], "--rate"),
            (&["--rate", "13", "--seed=-1"], "--seed"),
            (&["--fixed-prompt", "0"], "--fixed-prompt"),
            (&["--fixed-prompt=-5"], "--fixed-prompt"),
            (&["--fixed-prompt", "x"], "--fixed-prompt"),
            (&["--fixed-prompt", "8192", "--speed", "2"], "--speed"),
            (
                &["--speed", "2", "--fixed-prompt", "8192"],
                "--fixed-prompt",
            ),
            (&["--fixed-prompt", "8192", "--trace", "t.jsonl"], "--trace"),
            (&["--fixed-prompt", "8192", "--start", "3"], "--start"),
            (&["--geometry", "0,0,0,0"], "--geometry"),
            (&["--concurrency", "0"], "--concurrency"),
            (&["--concurrency", "100000000"], "--concurrency"),
            (&["--requests", "0"], "--requests"),
            (&["--tp", "0"], "--tp"),
            (&["--block", "0"], "--block"),
            (&["--pool", "0"], "--pool"),
            (&["--paths", "both"], "--paths"),
            (&["--model", "gpt-5"], "--model"),
            (&["--wait", "18446744073709551615"], "--wait"),
            (&["--prefill-socket", ""], "--prefill-socket"),
            (&["--prefill-socket", "a.sock"], "--decode-socket"),
            (&["--decode-socket", "b.sock"], "--prefill-socket"),
        ] {
            let e = rejected(args);
            assert!(e.contains(flag), "{args:?}: {e}");
        }
        let e = rejected(&["--model", "Qwen2.5-7B", "--geometry", "1,1,1,1"]);
        assert!(e.contains("--geometry") && e.contains("--model"), "{e}");
    }

    #[test]
    fn arrival_flags_give_the_arrival_mode_and_fixed_prompt_needs_no_trace() {
        let closed = bench(&[]).unwrap();
        assert_eq!(closed.arrivals(), Arrivals::Closed);
        assert_eq!(
            bench(&["--speed", "2"]).unwrap().arrivals(),
            Arrivals::Trace { speed: 2.0 }
        );
        assert_eq!(
            bench(&["--rate", "13"]).unwrap().arrivals(),
            Arrivals::Poisson {
                rate_per_s: 13.0,
                seed: DEFAULT_SEED
            }
        );
        let a = bench(&[
            "--fixed-prompt",
            "8192",
            "--requests",
            "500",
            "--rate",
            "13",
            "--seed",
            "7",
        ])
        .unwrap();
        assert_eq!(
            a.arrivals(),
            Arrivals::Poisson {
                rate_per_s: 13.0,
                seed: 7
            }
        );
        // No trace file is read (there is none at this path).
        let (label, trace) = bench_trace(&a).unwrap();
        assert_eq!(label.display().to_string(), "--fixed-prompt 8192");
        assert_eq!(trace.len(), 500);
        assert!(trace.iter().all(|r| r.input_length == 8192));
        // Closed loop works with a fixed prompt too.
        let a = bench(&["--fixed-prompt", "16", "--requests", "3"]).unwrap();
        assert_eq!(bench_trace(&a).unwrap().1.len(), 3);
        let a = bench(&["--fixed-prompt", "16", "--requests", "10000001"]).unwrap();
        assert!(bench_trace(&a).unwrap_err().starts_with("--requests"));
        let a = bench(&["--trace", "/nonexistent/t.jsonl"]).unwrap();
        assert!(bench_trace(&a).unwrap_err().starts_with("--trace"));
    }

    #[test]
    fn defaults_parse_and_a_custom_geometry_replaces_the_preset() {
        let a = bench(&[]).unwrap();
        assert_eq!(
            (a.requests.get(), a.concurrency, a.tp, a.block),
            (40, 32, 4, 16)
        );
        assert_eq!(a.paths, [BenchPath::Bounce, BenchPath::Standard]);
        assert_eq!(bench_layout(&a).unwrap().model.name, "Llama-3.1-8B");
        let a = bench(&["--geometry", "2,2,64,2", "--tp", "2"]).unwrap();
        assert_eq!(bench_layout(&a).unwrap().descriptor_bytes(), 16 * 64 * 2);
        let e = bench_layout(&bench(&["--tp", "3"]).unwrap()).unwrap_err();
        assert!(e.contains("--tp"), "{e}");
    }

    #[test]
    fn a_pool_too_small_for_the_slice_names_pool() {
        let a = bench(&["--pool", "1MiB"]).unwrap();
        let layout = bench_layout(&a).unwrap();
        let trace: Vec<TraceRecord> = [100u64, 5000]
            .iter()
            .map(|&t| TraceRecord {
                timestamp: 0,
                input_length: t,
                output_length: 1,
                hash_ids: vec![],
            })
            .collect();
        let demand = SliceDemand::of(&layout, &trace, a.concurrency);
        let e = slice_pool(&a, &layout, &demand).unwrap_err();
        assert!(
            e.starts_with("--pool") && !e.contains("--pool-blocks"),
            "{e}"
        );
        let a = bench(&["--pool", "1KiB"]).unwrap();
        let e = slice_pool(&a, &layout, &demand).unwrap_err();
        assert!(e.contains("less than one KV block"), "{e}");
        // The default fits: 2 requests in flight, 5000 + 100 tokens.
        let a = bench(&[]).unwrap();
        let (blocks, how) = slice_pool(&a, &layout, &demand).unwrap();
        assert_eq!(blocks, 384, "{how}"); // 192 MiB of 512 KiB blocks
        assert!(how.contains("sized from the slice"), "{how}");
    }

    #[test]
    fn dataplane_flags_are_checked() {
        for (args, flag) in [
            (&["--sizes", "0"][..], "--sizes"),
            (&["--total", "0"], "--total"),
            (&["--iterations", "0"], "--iterations"),
            (&["--inflight", "0"], "--inflight"),
            (&["--chunk", "0"], "--chunk"),
            (&["--arena", "0"], "--arena"),
        ] {
            let mut v = vec!["dataplane-bench"];
            v.extend_from_slice(args);
            let e = parse(&v)
                .err()
                .unwrap_or_else(|| panic!("{args:?} accepted"));
            assert!(e.to_string().contains(flag), "{args:?}: {e}");
        }
        let Cmd::DataplaneBench(a) =
            parse(&["dataplane-bench", "--sizes", "1MiB", "--total", "4KiB"])
                .unwrap()
                .cmd
        else {
            unreachable!()
        };
        let e = run_dataplane(a).unwrap_err();
        assert!(e.starts_with("--sizes"), "{e}");
    }

    /// A flag of `kvfabric bench` with a value: mostly plausible, some
    /// arbitrary text.
    fn bench_flag() -> impl Strategy<Value = (String, String)> {
        let num = prop_oneof![
            Just("0".to_string()),
            Just("-1".to_string()),
            Just("nan".to_string()),
            Just("inf".to_string()),
            Just("1e308".to_string()),
            Just("18446744073709551616".to_string()),
            (0u64..5000).prop_map(|n| n.to_string()),
            any::<u64>().prop_map(|n| n.to_string()),
            any::<f64>().prop_map(|n| n.to_string()),
            ".{0,12}",
        ];
        let geometry = prop_oneof![
            proptest::collection::vec(0u64..300, 0..6).prop_map(|v| v
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(",")),
            proptest::collection::vec(any::<u32>(), 4).prop_map(|v| v
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")),
            ".{0,16}",
        ];
        let size = prop_oneof![
            (0u64..5000).prop_map(|n| format!("{n}MiB")),
            any::<u64>().prop_map(|n| n.to_string()),
            Just("99999999999999GiB".to_string()),
            ".{0,8}",
        ];
        let flag = prop_oneof![
            Just("--start"),
            Just("--requests"),
            Just("--tp"),
            Just("--block"),
            Just("--concurrency"),
            Just("--speed"),
            Just("--rate"),
            Just("--seed"),
            Just("--fixed-prompt"),
            Just("--wait"),
        ];
        prop_oneof![
            (flag, num).prop_map(|(f, v)| (f.to_string(), v)),
            geometry.prop_map(|v| ("--geometry".to_string(), v)),
            size.prop_map(|v| ("--pool".to_string(), v)),
            prop_oneof![Just("Qwen2.5-7B".to_string()), ".{0,12}"]
                .prop_map(|v| ("--model".to_string(), v)),
            prop_oneof![
                Just("bounce,standard".to_string()),
                Just("standard".to_string()),
                ".{0,12}"
            ]
            .prop_map(|v| ("--paths".to_string(), v)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Parsing, the layout, the slice's demand and the pool sizing
        /// never panic, and what parses holds the parsers' promises.
        #[test]
        fn bench_argument_space_has_no_panics(
            flags in proptest::collection::vec(bench_flag(), 0..6),
            tokens in proptest::collection::vec(
                prop_oneof![0u64..200_000, any::<u64>()], 1..20),
        ) {
            let mut args = Vec::new();
            for (f, v) in &flags {
                args.push(format!("{f}={v}"));
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let Ok(a) = bench(&args) else { return Ok(()) };
            prop_assert!(a.arrival.speed.is_none_or(|s| s.is_finite() && s > 0.0));
            prop_assert!(a.arrival.rate.is_none_or(|r| r.is_finite() && r > 0.0));
            prop_assert!(a.arrival.speed.is_none() || a.arrival.rate.is_none());
            prop_assert!(a.arrival.fixed_prompt.is_none_or(|t| t > 0) && (a.arrival.fixed_prompt.is_none() || a.arrival.speed.is_none()));
            prop_assert!(a.arrivals().check().is_ok());
            prop_assert!((1..=kvfabric_agent::bench::cli::MAX_CONCURRENCY).contains(&a.concurrency));
            prop_assert!(a.tp > 0 && a.block > 0 && a.pool != Some(0) && !a.paths.is_empty());
            let Ok(layout) = bench_layout(&a) else { return Ok(()) };
            let trace: Vec<TraceRecord> = tokens
                .iter()
                .map(|&t| TraceRecord { timestamp: t, input_length: t, output_length: 1, hash_ids: vec![] })
                .collect();
            let demand = SliceDemand::of(&layout, &trace, a.concurrency);
            if let Ok((blocks, _)) = slice_pool(&a, &layout, &demand) {
                prop_assert!(blocks > 0);
                prop_assert!(demand.largest.is_none_or(|(_, b)| b <= u64::from(blocks)));
            }
        }
    }
}
