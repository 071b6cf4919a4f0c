//! The rounds: load, one fault, the invariants at quiesce.
//!
//! Slots: agents 0, 1 are the prefill agents (pods `agent-p0`, `agent-p1`),
//! 2, 3 the decode agents (`agent-d0`, `agent-d1`); prefill engine slot i
//! attaches to agent i, decode engine slot j to agent 2 + j.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command as Cmd, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvfabric_client::{pb, Client, Session, ShmPool};
use tokio::sync::{oneshot, Semaphore};

use crate::engine::{corrupt_bytes, Answer, Command, EngineSpec, Geometry};
use crate::report::{
    histogram_quantile, Buckets, Latency, Outcomes, PathLatency, Report, RoundReport,
};
use crate::topo::{self, AgentConf, AgentProc, Etcd, Kube, Proc, Side};

/// The fault kinds implemented.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// Delete a prefill (engine) pod through the API, SIGKILL its engine
    /// process as the kubelet would; a new pod and engine replace it.
    DeletePrefillPod,
    /// SIGKILL a prefill engine process while it has hand-offs in flight;
    /// restarted in the same pod.
    KillPrefillEngine,
    /// SIGKILL a prefill agent (its pod stays: only the lease path can
    /// notice); restarted in the same pod after the peers forgot it.
    KillPrefillAgent,
    /// Delete a prefill agent's pod through the API and SIGKILL the agent
    /// (the operator path); a new pod and agent replace it.
    DeleteAgentPod,
    /// SIGSTOP an agent for requestTimeout + 1 s, then SIGCONT.
    StopAgent,
    /// SIGKILL a decode agent and start it again in the same pod (new
    /// incarnation); its decode engine re-attaches under the same id.
    RestartDecodeAgent,
    /// 300 hand-offs each cancelled right after submission, in a burst.
    CancelBurst,
    /// Hand-offs whose decode side never calls AwaitArrival.
    NeverAwait,
    /// SIGKILL the fabric's etcd and start it again within the lease TTL.
    RestartEtcd,
    /// SIGKILL the fabric's etcd and start it again after the lease TTL:
    /// every lease expired; the fabric must come back by itself.
    RestartEtcdBeyondTtl,
    /// Delete a decode agent's pod through the API, SIGKILL the agent, and
    /// replace it by a pod of the same name (new UID) whose agent listens
    /// on the same host:port (a StatefulSet's replacement).
    ReplaceDecodePod,
    /// Start a third decode agent (its own pod) and SIGKILL it 0–300 ms
    /// after it answers, while the others load it and handshake with it;
    /// its pod is then deleted.
    JoinerDies,
    /// The fake node's Ready condition goes Unknown for 2 s (a kubelet
    /// heartbeat blip), then True again; every pair must still carry
    /// traffic.
    NodeNotReadyBlip,
    /// Cut an agent's control connections (the bounce control channel:
    /// its own port, and its connections to the peers' ports) both ways
    /// with nftables for requestTimeout + 1 s, then heal. etcd and HTTP
    /// traffic keep flowing (the agent stays in discovery). On one host
    /// UCX moves data over cma (process_vm_writev), which no network rule
    /// cuts: the partition cuts the control path.
    PartitionAgent,
    /// Drop a random share (`Options::loss_percent`) of every agent's
    /// control packets (nftables `numgen random`) for 3 s under load,
    /// then remove the rule.
    ControlLoss,
    /// Cut one agent off from the fabric's etcd (nftables: what it sends
    /// to etcd's client port — its open connections by local port, new
    /// ones by its gid — and etcd's answers) for the lease TTL + 3 s,
    /// then heal: its lease expires on a live etcd, every peer must
    /// forget it (the lease path), and after the heal it must re-grant,
    /// republish, be loaded again and carry traffic. Its control and data
    /// paths stay up throughout.
    PartitionEtcd,
    /// A new decode agent dies in the middle of its handshake with the
    /// prefill agents: it starts, a decode engine attaches to it, every
    /// peer loads its record (the metadata half of the handshake), then it
    /// is frozen (SIGSTOP) and hand-offs to its engine are submitted — the
    /// first WANTs it would answer with its first GRANTs (the credit half)
    /// go unanswered — and it is SIGKILLed 0–requestTimeout ms later, its
    /// pods deleted. Every one of those hand-offs must resolve FAILURE
    /// within requestTimeout + slack, every peer must forget it.
    DiesMidHandshake,
}

impl FaultKind {
    /// Every kind.
    pub const ALL: [FaultKind; 17] = [
        FaultKind::DeletePrefillPod,
        FaultKind::KillPrefillEngine,
        FaultKind::KillPrefillAgent,
        FaultKind::DeleteAgentPod,
        FaultKind::StopAgent,
        FaultKind::RestartDecodeAgent,
        FaultKind::CancelBurst,
        FaultKind::NeverAwait,
        FaultKind::RestartEtcd,
        FaultKind::RestartEtcdBeyondTtl,
        FaultKind::ReplaceDecodePod,
        FaultKind::JoinerDies,
        FaultKind::NodeNotReadyBlip,
        FaultKind::PartitionAgent,
        FaultKind::ControlLoss,
        FaultKind::PartitionEtcd,
        FaultKind::DiesMidHandshake,
    ];

    /// Its name in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::DeletePrefillPod => "delete-prefill-pod",
            FaultKind::KillPrefillEngine => "kill-prefill-engine",
            FaultKind::KillPrefillAgent => "kill-prefill-agent",
            FaultKind::DeleteAgentPod => "delete-agent-pod",
            FaultKind::StopAgent => "stop-agent",
            FaultKind::RestartDecodeAgent => "restart-decode-agent",
            FaultKind::CancelBurst => "cancel-burst",
            FaultKind::NeverAwait => "never-await",
            FaultKind::RestartEtcd => "restart-etcd",
            FaultKind::RestartEtcdBeyondTtl => "restart-etcd-beyond-ttl",
            FaultKind::ReplaceDecodePod => "replace-decode-pod",
            FaultKind::JoinerDies => "joiner-dies",
            FaultKind::NodeNotReadyBlip => "node-not-ready-blip",
            FaultKind::PartitionAgent => "partition-agent",
            FaultKind::ControlLoss => "control-loss",
            FaultKind::PartitionEtcd => "partition-etcd",
            FaultKind::DiesMidHandshake => "dies-mid-handshake",
        }
    }

    /// Whether it needs nftables.
    pub fn needs_nft(self) -> bool {
        matches!(
            self,
            FaultKind::PartitionAgent | FaultKind::ControlLoss | FaultKind::PartitionEtcd
        )
    }

    /// The kind named `s` (the opt-in kinds included).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .chain(Self::OPT_IN)
            .find(|k| k.name() == s)
    }

    /// Kinds run only when asked for (`--faults`): none today
    /// (`node-not-ready-blip` was one until the operator's node grace,
    /// `partition-etcd` until its rules caught every packet).
    pub const OPT_IN: [FaultKind; 0] = [];
}

/// Fault kinds of issue 16 this version does not inject, and why.
pub const MISSING: &[&str] = &[];

/// Suite options.
#[derive(Clone, Debug)]
pub struct Options {
    /// Rounds (one fault each).
    pub rounds: usize,
    /// Seed of the fault order and the load.
    pub seed: u64,
    /// Concurrent hand-offs of the load.
    pub concurrency: usize,
    /// At least this many hand-offs per round.
    pub requests_per_round: usize,
    /// Agents' requestTimeoutMs.
    pub request_timeout_ms: u64,
    /// Slack over the request timeout before a request counts as a hang.
    pub slack_ms: u64,
    /// Lease TTL of the agents, s.
    pub lease_ttl_s: u64,
    /// Bound of "a surviving pair completes a new transfer after the fault".
    pub probe_bound_ms: u64,
    /// The Mooncake trace.
    pub trace: PathBuf,
    /// Cap on blocks per request.
    pub max_blocks: u32,
    /// `kvfabric` binary.
    pub kvfabric_bin: PathBuf,
    /// `kvfabric-operator` binary.
    pub operator_bin: PathBuf,
    /// The `kvfabric-chaos` binary (prefill engines are `engine` runs of it).
    pub engine_exe: PathBuf,
    /// Work dir (default: a fresh temp dir).
    pub work_dir: Option<PathBuf>,
    /// Keep the work dir (logs) afterwards.
    pub keep: bool,
    /// Only these kinds (default: all).
    pub faults: Vec<FaultKind>,
    /// KV geometry.
    pub geometry: Geometry,
    /// Print progress to stderr.
    pub verbose: bool,
    /// `control-loss`: % of control packets dropped (each direction).
    pub loss_percent: u32,
    /// Run every agent in a network namespace of its own, joined by veth
    /// to a bridge ([`crate::netns`]); where the machine does not allow it
    /// the suite falls back to loopback addresses and says why. False:
    /// loopback, by choice.
    pub netns: bool,
}

impl Options {
    /// Defaults with the binaries in `target_dir` (target/<profile>).
    pub fn with_target_dir(target_dir: &Path) -> Self {
        Self {
            rounds: 10,
            seed: 1,
            concurrency: 32,
            requests_per_round: 64,
            request_timeout_ms: 2000,
            slack_ms: 6000,
            lease_ttl_s: 5,
            probe_bound_ms: 1000,
            trace: topo::repo().join("../shared/data/traces/mooncake_conversation_trace.jsonl"),
            max_blocks: 128,
            kvfabric_bin: target_dir.join("kvfabric"),
            operator_bin: target_dir.join("kvfabric-operator"),
            engine_exe: target_dir.join("kvfabric-chaos"),
            work_dir: None,
            keep: false,
            faults: FaultKind::ALL.to_vec(),
            geometry: Geometry::default(),
            verbose: true,
            loss_percent: 10,
            netns: true,
        }
    }
}

/// Why the suite did not produce a report.
#[derive(Debug)]
pub enum RunError {
    /// A tool or binary is missing (SKIP, or a failure under
    /// `KVFABRIC_REQUIRE_SERVICES=1`).
    Skip(String),
    /// The topology could not be set up.
    Setup(String),
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::Skip(s) => write!(f, "SKIP: {s}"),
            RunError::Setup(s) => write!(f, "setup failed: {s}"),
        }
    }
}

/// The seeded generator ([`kvfabric_core::rng::SplitMix64`]).
pub type Rng = kvfabric_core::rng::SplitMix64;

/// The fault order: rounds cycle through `kinds`, each cycle in a seeded
/// random order.
pub fn schedule(kinds: &[FaultKind], rounds: usize, seed: u64) -> Vec<FaultKind> {
    let mut rng = Rng::new(seed ^ 0x5EED);
    let mut out = Vec::with_capacity(rounds);
    while out.len() < rounds && !kinds.is_empty() {
        let mut cycle = kinds.to_vec();
        rng.shuffle(&mut cycle);
        out.extend(cycle);
    }
    out.truncate(rounds);
    out
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Block allocator of one pool: blocks of failed requests are held until
/// the round's quiesce (late bytes of a failed request may still land).
struct Alloc {
    free: Vec<u32>,
    held: Vec<u32>,
}

impl Alloc {
    fn new(n: u32) -> Self {
        Self {
            free: (0..n).rev().collect(),
            held: Vec::new(),
        }
    }

    fn take(&mut self, k: usize) -> Option<Vec<u32>> {
        (self.free.len() >= k).then(|| self.free.split_off(self.free.len() - k))
    }

    fn give(&mut self, v: Vec<u32>) {
        self.free.extend(v);
    }

    fn hold(&mut self, v: Vec<u32>) {
        self.held.extend(v);
    }

    fn release_held(&mut self) {
        let h = std::mem::take(&mut self.held);
        self.free.extend(h);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A prefill engine process driven over its stdin/stdout.
struct Prefill {
    id: String,
    pod: String,
    uid: String,
    proc: Mutex<Proc>,
    stdin: Mutex<Option<ChildStdin>>,
    pending: Arc<Mutex<HashMap<u64, oneshot::Sender<Answer>>>>,
    dead: Arc<AtomicBool>,
    alloc: Mutex<Alloc>,
    next: AtomicU64,
}

impl Prefill {
    /// Starts `kvfabric-chaos engine` and waits (≤ 30 s) for it to attach.
    fn spawn(exe: &Path, spec: EngineSpec, pod: &str, log: &Path) -> Result<Self, String> {
        let json = serde_json::to_string(&spec).map_err(|e| e.to_string())?;
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| e.to_string())?;
        let mut child = Cmd::new(exe)
            .args(["engine", "--spec", &json])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(logf))
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", exe.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let stdin = child.stdin.take();
        let pending: Arc<Mutex<HashMap<u64, oneshot::Sender<Answer>>>> = Arc::default();
        let dead = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<String>();
        {
            let pending = pending.clone();
            let dead = dead.clone();
            std::thread::spawn(move || {
                let mut ready = Some(ready_tx);
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if let Some(tx) = ready.take() {
                        let _ = tx.send(line);
                        continue;
                    }
                    if let Ok(a) = serde_json::from_str::<Answer>(&line) {
                        if let Some(tx) = lock(&pending).remove(&a.id) {
                            let _ = tx.send(a);
                        }
                    }
                }
                dead.store(true, Ordering::SeqCst);
                lock(&pending).clear();
            });
        }
        let mut proc = Proc {
            child,
            what: format!("engine {}", spec.engine_id),
            log: log.to_path_buf(),
        };
        match ready_rx.recv_timeout(Duration::from_millis(spec.attach_timeout_ms + 5000)) {
            Ok(l) if l.contains("\"ready\":true") => {}
            other => {
                proc.kill();
                return Err(format!(
                    "engine {} did not attach ({other:?}):\n{}",
                    spec.engine_id,
                    proc.log_tail(2000)
                ));
            }
        }
        Ok(Self {
            id: spec.engine_id.clone(),
            pod: pod.to_string(),
            uid: spec.pod_uid.clone(),
            proc: Mutex::new(proc),
            stdin: Mutex::new(stdin),
            pending,
            dead,
            alloc: Mutex::new(Alloc::new(spec.num_blocks)),
            next: AtomicU64::new(1),
        })
    }

    fn submit(&self, cmd: Command) -> oneshot::Receiver<Answer> {
        let (tx, rx) = oneshot::channel();
        if self.dead.load(Ordering::SeqCst) {
            return rx;
        }
        let id = cmd.id;
        lock(&self.pending).insert(id, tx);
        let line = serde_json::to_string(&cmd).unwrap_or_default();
        let mut g = lock(&self.stdin);
        let ok = g
            .as_mut()
            .map(|s| writeln!(s, "{line}").and_then(|_| s.flush()).is_ok())
            .unwrap_or(false);
        if !ok {
            lock(&self.pending).remove(&id);
        }
        rx
    }

    fn in_flight(&self) -> usize {
        lock(&self.pending).len()
    }

    fn alive(&self) -> bool {
        !self.dead.load(Ordering::SeqCst)
    }

    fn kill(&self) {
        lock(&self.proc).kill();
        lock(&self.stdin).take();
        self.dead.store(true, Ordering::SeqCst);
    }
}

/// A decode engine of this process.
struct Decode {
    id: String,
    session: Session,
    pool: ShmPool,
    alloc: Mutex<Alloc>,
    num_blocks: u32,
}

struct AgentSlot {
    logical: String,
    uid: String,
    side: Side,
    gen: u32,
    agent: AgentProc,
    /// Its HTTP port, kept across restarts (the same host:port).
    port: u16,
}

/// Fault → forgotten, measured from outside.
struct Forget {
    name: String,
    observers: Vec<SocketAddr>,
    path: &'static str,
}

#[derive(Default)]
struct FaultResult {
    target: String,
    outcomes: Outcomes,
    violations: Vec<String>,
    notes: Vec<String>,
    probe_ms: Option<f64>,
    forget_ms: Option<f64>,
    forget_path: Option<String>,
    rejoin_ms: Option<f64>,
    warnings: Vec<String>,
    partition: Option<crate::report::PartitionStats>,
    loss: Option<crate::report::LossStats>,
    /// The fault's window [start, end) and the victim agent slot, filled
    /// into `partition` / `loss` once the round's load has resolved.
    window: Option<(Instant, Instant, Option<usize>)>,
}

/// One resolved hand-off of the load (hangs are not sampled).
#[derive(Clone, Debug)]
struct Sample {
    submitted: Instant,
    /// Submit → both sides resolved.
    ms: f64,
    /// Submit → the prefill side (the engine's transfer) resolved.
    tx_ms: f64,
    success: bool,
    prefill: String,
    decode: String,
}

struct Suite {
    opts: Options,
    /// The agents' network namespaces (None: loopback); removed when the
    /// suite is dropped, after the agents were stopped.
    net: Option<crate::netns::Net>,
    kube: Kube,
    etcd: Mutex<Etcd>,
    operator: Mutex<Proc>,
    conf: AgentConf,
    agents: Mutex<Vec<AgentSlot>>,
    prefill: RwLock<Vec<Arc<Prefill>>>,
    decode: RwLock<Vec<Arc<Decode>>>,
    trace: Vec<u64>,
    trace_pos: AtomicU64,
    in_flight: AtomicU64,
    peak: AtomicU64,
    /// KV bytes of every SUCCESS verified on the decode side.
    verified_bytes: AtomicU64,
    seq: AtomicU64,
    /// Last histogram scrape of every agent incarnation: name → path → buckets.
    hist: Mutex<BTreeMap<String, BTreeMap<String, Buckets>>>,
    prefill_blocks: u32,
    decode_blocks: u32,
    logs: PathBuf,
    /// Notes of the current round (sides that disagreed), capped.
    round_notes: Mutex<Vec<String>>,
    /// UIDs of the decode engine pods (never replaced).
    decode_uids: Vec<String>,
    /// Resolved hand-offs of the current round.
    samples: Mutex<Vec<Sample>>,
}

const PREFILL_BLOCKS: u32 = 4096;
const DECODE_BLOCKS: u32 = 8192;
const FABRIC_LABEL: &str = "kvf-chaos-agent";

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f)
        .await
        .expect("blocking task panicked")
}

/// Runs the suite; the report (check [`Report::passed`]).
///
/// # Errors
/// [`RunError::Skip`] when a tool or binary is missing,
/// [`RunError::Setup`] when the topology did not come up.
pub fn run(opts: Options) -> Result<Report, RunError> {
    for (what, p) in [
        (
            "kvfabric (cargo build -p kvfabric-agent)",
            &opts.kvfabric_bin,
        ),
        (
            "kvfabric-operator (cargo build -p kvfabric-operator)",
            &opts.operator_bin,
        ),
        (
            "kvfabric-chaos (cargo build -p kvfabric-chaos)",
            &opts.engine_exe,
        ),
    ] {
        if !p.is_file() {
            return Err(RunError::Skip(format!("{} not built: {what}", p.display())));
        }
    }
    if !topo::repo().join("e2e/kube/up.sh").is_file() || !Kube::tools_installed() {
        return Err(RunError::Skip(
            "control-plane tools not installed (run e2e/kube/install.sh)".into(),
        ));
    }
    if !opts.trace.is_file() {
        return Err(RunError::Skip(format!(
            "trace {} not present",
            opts.trace.display()
        )));
    }
    let mut opts = opts;
    let mut nft_skipped = BTreeMap::new();
    if opts.faults.iter().any(|k| k.needs_nft()) {
        for t in crate::nft::remove_stale() {
            eprintln!("[chaos] removed nft table {t} left by a suite that no longer runs");
        }
        if let Err(why) = crate::nft::usable() {
            let why = format!("nftables unusable here: {why}");
            if std::env::var("KVFABRIC_REQUIRE_SERVICES").as_deref() == Ok("1") {
                return Err(RunError::Skip(why));
            }
            for k in opts.faults.iter().filter(|k| k.needs_nft()) {
                eprintln!("SKIP: fault {}: {why}", k.name());
                nft_skipped.insert(k.name().to_string(), why.clone());
            }
            opts.faults.retain(|k| !k.needs_nft());
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| RunError::Setup(e.to_string()))?;
    let r = rt.block_on(run_async(opts)).map(|mut r| {
        r.faults_skipped = nft_skipped;
        r
    });
    // Every table of this process gone (the guards delete them; this
    // catches one that survived its guard).
    let left = crate::nft::own_tables();
    match r {
        Ok(mut rep) if !left.is_empty() => {
            rep.violations
                .push(format!("nft tables left behind after the run: {left:?}"));
            for t in left {
                let _ = nft_delete_table(&t);
            }
            Ok(rep)
        }
        other => other,
    }
}

fn nft_delete_table(table: &str) -> std::io::Result<std::process::ExitStatus> {
    Cmd::new("nft")
        .args(["delete", "table", "inet", table])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
}

fn say(opts: &Options, msg: impl AsRef<str>) {
    if opts.verbose {
        eprintln!("[chaos] {}", msg.as_ref());
    }
}

async fn run_async(opts: Options) -> Result<Report, RunError> {
    let t_run = Instant::now();
    let setup = |e: String| RunError::Setup(e);
    let work = opts
        .work_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("kvf-chaos-{}", std::process::id())));
    let logs = work.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| setup(e.to_string()))?;
    let mut topology = vec![format!("work dir {}", work.display())];
    // Network namespaces + veth, one per agent, where the machine allows
    // it. Engines stay in the root namespace (they reach their agent by its
    // Unix socket) and so do etcd (on the bridge's address), the apiserver
    // and the operator.
    for t in crate::netns::remove_stale() {
        eprintln!("[chaos] removed {t} left by a suite that no longer runs");
    }
    let net = if opts.netns {
        // Slot 4: the agents that join mid-run (joiner-dies,
        // dies-mid-handshake), one at a time.
        match crate::netns::Net::create(5) {
            Ok(n) => Some(n),
            Err(why) => {
                let why = format!(
                    "loopback addresses: network namespaces + veth unavailable here ({why})"
                );
                eprintln!("[chaos] topology: {why}");
                topology.push(why);
                None
            }
        }
    } else {
        topology.push("loopback addresses (--no-netns)".into());
        None
    };
    if let Some(n) = &net {
        let line = format!(
            "network namespaces: each agent in its own (kvfchaos-{}-0..3, eth0 {}..{}), veth to bridge {} ({}); engines, etcd, apiserver and operator in the root namespace",
            std::process::id(),
            n.slot(0).map(|s| s.ip.to_string()).unwrap_or_default(),
            n.slot(3).map(|s| s.ip.to_string()).unwrap_or_default(),
            n.bridge(),
            n.host_ip()
        );
        say(&opts, format!("topology: {line}"));
        topology.push(line);
    }

    say(&opts, "starting the control plane (e2e/kube/up.sh)");
    let kdir = work.join("kube");
    let keep = opts.keep;
    let kube = blocking(move || Kube::up(&kdir, keep))
        .await
        .map_err(setup)?;
    let etcd_bin = kube.tool("etcd-3.6.16");
    let edir = work.join("fabric-etcd");
    let etcd_host = net
        .as_ref()
        .map_or(std::net::Ipv4Addr::LOCALHOST, |n| n.host_ip());
    let etcd = blocking(move || Etcd::start(&etcd_bin, &edir, etcd_host))
        .await
        .map_err(setup)?;
    let fabric = format!("chaos{}", std::process::id());
    topology.push(format!(
        "fabric etcd {} (separate from the apiserver's), kube {}",
        etcd.endpoint(),
        kube.dir.display()
    ));

    // CRD, KvFabric, operator.
    let crd = topo::repo().join("crds/kvfabric.io_kvfabrics.yaml");
    let crd = crd.to_string_lossy().into_owned();
    kube.kubectl(&["apply", "--server-side", "-f", &crd], None)
        .map_err(setup)?;
    // `kubectl wait` right after the apply can fail at once with
    // ".status.conditions accessor error: <nil>" (the CRD has no status
    // yet): retried for up to 30 s.
    let t_crd = Instant::now();
    loop {
        match kube.kubectl(
            &[
                "wait",
                "--for=condition=Established",
                "crd/kvfabrics.kvfabric.io",
                "--timeout=30s",
            ],
            None,
        ) {
            Ok(_) => break,
            Err(e) if e.contains("accessor error") && t_crd.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(setup(e)),
        }
    }
    let kvf = serde_json::json!({
        "apiVersion": "kvfabric.io/v1alpha1", "kind": "KvFabric",
        "metadata": {"name": fabric, "namespace": "default"},
        "spec": {
            "agentSelector": {"matchLabels": {"app": FABRIC_LABEL}},
            "prefillSelector": {"matchLabels": {"role": "kvf-chaos-prefill"}},
            "decodeSelector": {"matchLabels": {"role": "kvf-chaos-decode"}},
            "etcd": {"endpoints": [etcd.endpoint()]},
            "notReadyGraceSeconds": 5
        }
    });
    kube.kubectl(&["create", "-f", "-"], Some(&kvf.to_string()))
        .map_err(setup)?;
    let oplog = logs.join("operator.log");
    let oplogf = std::fs::File::create(&oplog).map_err(|e| setup(e.to_string()))?;
    let opchild = Cmd::new(&opts.operator_bin)
        .arg("--kubeconfig")
        .arg(kube.dir.join("kubeconfig"))
        .args(["--metrics-listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::from(
            oplogf.try_clone().map_err(|e| setup(e.to_string()))?,
        ))
        .stderr(Stdio::from(oplogf))
        .spawn()
        .map_err(|e| setup(format!("operator: {e}")))?;
    let operator = Proc {
        child: opchild,
        what: "operator".into(),
        log: oplog,
    };
    let t0 = Instant::now();
    loop {
        let f = kube
            .kubectl(
                &[
                    "get",
                    "kvfabric",
                    &fabric,
                    "-o",
                    "jsonpath={.metadata.finalizers}",
                ],
                None,
            )
            .unwrap_or_default();
        if f.contains("etcd-cleanup") {
            break;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            return Err(setup(format!(
                "the operator did not take the KvFabric within 30 s:\n{}",
                operator.log_tail(3000)
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    topology.push(format!(
        "operator binary {} (pid {})",
        opts.operator_bin.display(),
        operator.pid()
    ));

    // Pods.
    let mut uids = BTreeMap::new();
    for (name, labels) in [
        ("agent-p0", [("app", FABRIC_LABEL)]),
        ("agent-p1", [("app", FABRIC_LABEL)]),
        ("agent-d0", [("app", FABRIC_LABEL)]),
        ("agent-d1", [("app", FABRIC_LABEL)]),
        ("prefill-0", [("role", "kvf-chaos-prefill")]),
        ("prefill-1", [("role", "kvf-chaos-prefill")]),
        ("decode-0", [("role", "kvf-chaos-decode")]),
        ("decode-1", [("role", "kvf-chaos-decode")]),
    ] {
        let uid = kube.create_pod(name, &labels).map_err(setup)?;
        uids.insert(name.to_string(), uid);
    }
    let conf = AgentConf {
        bin: opts.kvfabric_bin.clone(),
        etcd: etcd.endpoint(),
        fabric: fabric.clone(),
        lease_ttl_s: opts.lease_ttl_s,
        request_timeout_ms: opts.request_timeout_ms,
        dir: logs.clone(),
    };
    say(&opts, "starting 4 agents");
    let mut agents = Vec::new();
    for (i, name) in ["agent-p0", "agent-p1", "agent-d0", "agent-d1"]
        .into_iter()
        .enumerate()
    {
        let side = if i < 2 { Side::Prefill } else { Side::Decode };
        let (c, n, u) = (conf.clone(), name.to_string(), uids[name].clone());
        let ns = net.as_ref().and_then(|n| n.slot(i)).cloned();
        let agent = match blocking(move || AgentProc::spawn(&c, &n, &u, side, 0, 0, ns)).await {
            Ok(a) => a,
            Err(e) if e.contains("NIXL runtime") => {
                return Err(RunError::Skip(format!("NIXL runtime not available: {e}")))
            }
            Err(e) => return Err(setup(e)),
        };
        agents.push(AgentSlot {
            logical: name.to_string(),
            uid: uids[name].clone(),
            side,
            gen: 0,
            port: agent.http.port(),
            agent,
        });
    }
    let text = std::fs::read_to_string(&opts.trace).map_err(|e| setup(e.to_string()))?;
    let trace: Vec<u64> = kvfabric_core::model::parse_trace(&text, 0, usize::MAX)
        .map_err(setup)?
        .into_iter()
        .map(|r| r.input_length)
        .collect();
    if trace.is_empty() {
        return Err(setup("empty trace".into()));
    }
    let suite = Arc::new(Suite {
        opts: opts.clone(),
        net,
        kube,
        etcd: Mutex::new(etcd),
        operator: Mutex::new(operator),
        conf,
        agents: Mutex::new(agents),
        prefill: RwLock::new(Vec::new()),
        decode: RwLock::new(Vec::new()),
        trace,
        trace_pos: AtomicU64::new(opts.seed.wrapping_mul(7919) % 10_000),
        in_flight: AtomicU64::new(0),
        peak: AtomicU64::new(0),
        verified_bytes: AtomicU64::new(0),
        seq: AtomicU64::new(1),
        hist: Mutex::new(BTreeMap::new()),
        prefill_blocks: PREFILL_BLOCKS,
        decode_blocks: DECODE_BLOCKS,
        logs,
        round_notes: Mutex::new(Vec::new()),
        decode_uids: vec![uids["decode-0"].clone(), uids["decode-1"].clone()],
        samples: Mutex::new(Vec::new()),
    });
    for j in 0..2 {
        let d = suite
            .attach_decode(j, &uids[&format!("decode-{j}")])
            .await
            .map_err(setup)?;
        lock_w(&suite.decode).push(Arc::new(d));
    }
    for i in 0..2 {
        let s2 = suite.clone();
        let (pod, uid) = (
            format!("prefill-{i}"),
            uids[&format!("prefill-{i}")].clone(),
        );
        let p = blocking(move || s2.spawn_prefill(i, &pod, &uid))
            .await
            .map_err(setup)?;
        lock_w(&suite.prefill).push(Arc::new(p));
    }
    say(&suite.opts, "warming up: every prefill → decode pair");
    for i in 0..2 {
        for j in 0..2 {
            suite
                .pair_probe(i, j, Instant::now(), Duration::from_secs(30))
                .await
                .map_err(|e| setup(format!("warm-up prefill {i} → decode {j}: {e}")))?;
        }
    }
    let leaks = suite.quiesce().await;
    if !leaks.is_empty() {
        return Err(setup(format!("not quiet after warm-up: {leaks:?}")));
    }

    let mut report = Report {
        seed: opts.seed,
        rounds: opts.rounds,
        topology,
        faults_missing: MISSING.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let g = opts.geometry;
    for (k, v) in [
        ("request_timeout_ms", opts.request_timeout_ms.to_string()),
        ("hang_bound_ms", (opts.request_timeout_ms + opts.slack_ms).to_string()),
        ("slack_ms", opts.slack_ms.to_string()),
        ("lease_ttl_s", opts.lease_ttl_s.to_string()),
        ("probe_bound_ms", opts.probe_bound_ms.to_string()),
        ("concurrency", opts.concurrency.to_string()),
        ("requests_per_round_min", opts.requests_per_round.to_string()),
        ("trace", opts.trace.display().to_string()),
        (
            "geometry",
            format!(
                "{} layers, K/V split, {} tokens/block, {} B/block/plane; blocks = ceil(input_length / {}) capped at {}",
                g.layers,
                g.block_tokens,
                g.block_bytes(),
                g.block_tokens,
                opts.max_blocks
            ),
        ),
        ("pools", format!("prefill {PREFILL_BLOCKS} blocks, decode {DECODE_BLOCKS} blocks")),
    ] {
        report.settings.insert(k.into(), v);
    }

    let order = schedule(&opts.faults, opts.rounds, opts.seed);
    let mut rng = Rng::new(opts.seed);
    let mut probes = Vec::new();
    let mut external: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (round, kind) in order.into_iter().enumerate() {
        let t_round = Instant::now();
        say(&suite.opts, format!("round {round}: {}", kind.name()));
        suite.peak.store(0, Ordering::SeqCst);
        lock(&suite.samples).clear();
        let stop = Arc::new(AtomicBool::new(false));
        let load = tokio::spawn(suite.clone().load(rng.next_u64(), stop.clone()));
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut fr = suite.clone().inject(kind, &mut rng).await;
        stop.store(true, Ordering::SeqCst);
        let (load_out, load_viol) = load.await.unwrap_or_default();
        suite.fill_window(&mut fr);
        let leaks = suite.quiesce().await;
        for d in lock_r(&suite.decode).iter() {
            lock(&d.alloc).release_held();
        }
        for p in lock_r(&suite.prefill).iter() {
            lock(&p.alloc).release_held();
        }
        let mut rr = RoundReport {
            round,
            fault: kind.name().into(),
            target: fr.target.clone(),
            peak_in_flight: suite.peak.load(Ordering::SeqCst),
            probe_ms: fr.probe_ms,
            forget_ms: fr.forget_ms,
            forget_path: fr.forget_path.clone(),
            rejoin_ms: fr.rejoin_ms,
            notes: fr.notes.clone(),
            partition: fr.partition.clone(),
            loss: fr.loss.clone(),
            ..Default::default()
        };
        rr.notes.append(&mut lock(&suite.round_notes));
        rr.outcomes.add(&load_out);
        rr.outcomes.add(&fr.outcomes);
        let prefix = format!("round {round} ({} on {})", kind.name(), fr.target);
        for v in load_viol.iter().chain(&fr.violations) {
            rr.violations.push(format!("{prefix}: {v}"));
        }
        for l in &leaks {
            rr.violations
                .push(format!("{prefix}: leak at quiesce: {l}"));
        }
        for w in &fr.warnings {
            rr.warnings.push(format!("{prefix}: {w}"));
        }
        rr.leaks = leaks;
        if rr.peak_in_flight < opts.concurrency as u64 {
            rr.notes.push(format!(
                "peak in flight {} below the concurrency {}",
                rr.peak_in_flight, opts.concurrency
            ));
        }
        if let Some(p) = rr.probe_ms {
            probes.push(p);
        }
        if let (Some(f), Some(path)) = (rr.forget_ms, rr.forget_path.clone()) {
            external.entry(path).or_default().push(f);
        }
        rr.wall_s = t_round.elapsed().as_secs_f64();
        say(
            &suite.opts,
            format!(
                "round {round}: {} ok {} fail {} hang {} corrupt {} peak {} probe {:?} forget {:?} rejoin {:?} leaks {} violations {} ({:.1} s)",
                kind.name(),
                rr.outcomes.success,
                rr.outcomes.failure,
                rr.outcomes.hang,
                rr.outcomes.corrupt_bytes,
                rr.peak_in_flight,
                rr.probe_ms.map(|x| x.round()),
                rr.forget_ms.map(|x| x.round()),
                rr.rejoin_ms.map(|x| x.round()),
                rr.leaks.len(),
                rr.violations.len(),
                rr.wall_s
            ),
        );
        for v in &rr.violations {
            say(&suite.opts, format!("VIOLATION {v}"));
        }
        for w in &rr.warnings {
            say(&suite.opts, format!("warning {w}"));
        }
        report.warnings.extend(rr.warnings.clone());
        *report.faults.entry(kind.name().into()).or_default() += 1;
        report.outcomes.add(&rr.outcomes);
        report.leaks += rr.leaks.len() as u64;
        report.violations.extend(rr.violations.clone());
        report.round_reports.push(rr);
    }
    // Detection latency per path: every incarnation's last histogram.
    let _ = suite.quiesce().await;
    let mut sums: BTreeMap<String, Buckets> = BTreeMap::new();
    for per_path in lock(&suite.hist).values() {
        for (path, b) in per_path {
            let s = sums.entry(path.clone()).or_default();
            for (le, c) in b {
                *s.entry(le.clone()).or_default() += c;
            }
        }
    }
    for path in ["operator", "lease"] {
        let b = sums.get(path).cloned().unwrap_or_default();
        let count = b.get("+Inf").copied().unwrap_or(0.0) as u64;
        let get = |k: &str| {
            sums.get(&format!("{path}{k}"))
                .and_then(|m| m.get(""))
                .copied()
                .unwrap_or(0.0)
        };
        let mean_ms = (get("#count") > 0.0).then(|| get("#sum") / get("#count") * 1e3);
        report.detection.insert(
            path.into(),
            PathLatency {
                histogram: Latency {
                    count,
                    p50_ms: histogram_quantile(&b, 0.5),
                    p99_ms: histogram_quantile(&b, 0.99),
                    max_ms: None,
                    mean_ms,
                },
                external: Latency::of(external.remove(path).unwrap_or_default()),
            },
        );
    }
    report.probe = Latency::of(probes);
    if let Some(net) = &suite.net {
        // Which way the KV went: bytes over the veths against the KV bytes
        // verified on the decode side (the control channel, etcd and HTTP
        // cross the veths in any case: a DATA message names every run).
        let (sent, received) = net.veth_bytes();
        let kv = suite.verified_bytes.load(Ordering::Relaxed) as f64;
        let way = if (sent as f64) < kv {
            "less than the KV itself: UCX carried the KV between the namespaces over shared memory / cma, not the network (the control channel, etcd and HTTP crossed the veths)"
        } else {
            "at least the KV's size: the KV may have crossed the veths (UCX over TCP)"
        };
        report.topology.push(format!(
            "data path: the agents sent {:.1} MB and received {:.1} MB over their veths while {:.1} MB of KV were verified landed: {way}",
            sent as f64 / 1e6,
            received as f64 / 1e6,
            kv / 1e6
        ));
    }
    report.wall_s = t_run.elapsed().as_secs_f64();
    // Tear down: engines first (sessions), then agents, operator, etcd, kube.
    for p in lock_r(&suite.prefill).iter() {
        p.kill();
    }
    lock_w(&suite.decode).clear();
    lock_w(&suite.prefill).clear();
    {
        let mut a = lock(&suite.agents);
        for s in a.iter_mut() {
            s.agent.proc.terminate(Duration::from_secs(5));
        }
    }
    lock(&suite.operator).terminate(Duration::from_secs(5));
    if !opts.keep && opts.work_dir.is_none() {
        let w = work.clone();
        drop(suite);
        let _ = std::fs::remove_dir_all(w);
    }
    Ok(report)
}

fn lock_r<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn lock_w<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

impl Suite {
    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst)
    }

    /// The agents as the network faults' rules see them
    /// ([`crate::cuts::Agents`]), with their control `ports` by slot.
    fn cut_view(&self, ports: &[u16]) -> crate::cuts::Agents {
        let a = lock(&self.agents);
        let slots: Option<Vec<_>> = a.iter().map(|s| s.agent.netns.clone()).collect();
        crate::cuts::Agents {
            ports: ports.to_vec(),
            gids: a.iter().map(|s| s.agent.gid).collect(),
            netns: slots.zip(self.net.as_ref().map(|n| n.host_ip())),
        }
    }

    /// The network namespace of an agent that joins mid-run (slot 4), when
    /// the agents have namespaces.
    fn joiner_netns(&self) -> Option<crate::netns::Slot> {
        self.net.as_ref().and_then(|n| n.slot(4)).cloned()
    }

    fn agent_http(&self, slot: usize) -> SocketAddr {
        lock(&self.agents)[slot].agent.http
    }

    fn agent_name(&self, slot: usize) -> String {
        lock(&self.agents)[slot].agent.name.clone()
    }

    fn socket(&self, slot: usize) -> PathBuf {
        lock(&self.agents)[slot].agent.socket.clone()
    }

    /// Starts prefill engine process of slot `i` bound to pod `pod`/`uid`
    /// (blocking).
    fn spawn_prefill(&self, i: usize, pod: &str, uid: &str) -> Result<Prefill, String> {
        let n = self.next_seq();
        let spec = EngineSpec {
            socket: self.socket(i).to_string_lossy().into_owned(),
            engine_id: format!("prefill-{i}-{n}"),
            pod_uid: uid.to_string(),
            num_blocks: self.prefill_blocks,
            geometry: self.opts.geometry,
            attach_timeout_ms: 30_000,
        };
        let log = self.logs.join(format!("engine-prefill-{i}-{n}.log"));
        Prefill::spawn(&self.opts.engine_exe, spec, pod, &log)
    }

    /// Attaches decode engine `decode-<j>` (pod UID `uid`) to agent 2 + j.
    async fn attach_decode(&self, j: usize, uid: &str) -> Result<Decode, String> {
        self.attach_decode_at(&self.socket(2 + j), &format!("decode-{j}"), uid)
            .await
    }

    /// Attaches decode engine `id` (pod UID `uid`) to the agent of engine
    /// socket `socket`.
    async fn attach_decode_at(&self, socket: &Path, id: &str, uid: &str) -> Result<Decode, String> {
        let id = id.to_string();
        let layout = self.opts.geometry.layout(self.decode_blocks);
        let deadline = Instant::now() + Duration::from_secs(30);
        let client = loop {
            match Client::connect(&socket).await {
                Ok(c) => break c,
                Err(e) if Instant::now() >= deadline => return Err(e.to_string()),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        let pool = ShmPool::create(
            &format!("/kvf-chaos-{}-{id}-{}", std::process::id(), self.next_seq()),
            kvfabric_client::pool_bytes(&layout),
        )
        .map_err(|e| e.to_string())?;
        let session = loop {
            match client
                .attach(&id, uid, pb::Role::Decode, layout.clone())
                .await
            {
                Ok(s) => break s,
                Err(e)
                    if e.code() == Some(tonic::Code::AlreadyExists)
                        && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) => return Err(format!("attach {id}: {e}")),
            }
        };
        session
            .register_shm(&pool)
            .await
            .map_err(|e| format!("register {id}: {e}"))?;
        Ok(Decode {
            id,
            session,
            pool,
            alloc: Mutex::new(Alloc::new(self.decode_blocks)),
            num_blocks: self.decode_blocks,
        })
    }

    fn next_blocks(&self) -> u32 {
        let i = self.trace_pos.fetch_add(1, Ordering::SeqCst) as usize % self.trace.len();
        let t = self.trace[i];
        let b = t.div_ceil(u64::from(self.opts.geometry.block_tokens));
        b.clamp(1, u64::from(self.opts.max_blocks)) as u32
    }

    /// One hand-off p → d of `n` blocks: the prefill engine fills its
    /// source blocks and asks its agent; this process awaits the arrival
    /// (unless `await_arrival` is false) and verifies every byte of a
    /// SUCCESS. Returns the outcome and the violation, if any.
    async fn hand_off(
        self: &Arc<Self>,
        p: Arc<Prefill>,
        d: Arc<Decode>,
        n: u32,
        await_arrival: bool,
        cancel_after_us: Option<u64>,
    ) -> (Outcomes, Option<String>) {
        let mut o = Outcomes::default();
        let t_alloc = Instant::now();
        let (src, dst) = loop {
            let src = lock(&p.alloc).take(n as usize);
            let dst = src.as_ref().and_then(|_| lock(&d.alloc).take(n as usize));
            match (src, dst) {
                (Some(s), Some(d)) => break (s, d),
                (s, _) => {
                    if let Some(s) = s {
                        lock(&p.alloc).give(s);
                    }
                    if t_alloc.elapsed() > Duration::from_secs(2) {
                        o.skipped += 1;
                        return (o, None);
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        };
        let id = p.next.fetch_add(1, Ordering::SeqCst);
        let seed = self.next_seq().wrapping_mul(0x2545_F491_4F6C_DD1D) ^ id;
        let name = format!(
            "request {}#{id} → {} ({n} blocks{}{})",
            p.id,
            d.id,
            if await_arrival { "" } else { ", never awaited" },
            if cancel_after_us.is_some() {
                ", cancelled"
            } else {
                ""
            }
        );
        let ranges = self.opts.geometry.ranges(d.num_blocks, &dst);
        let timeout_ms = self.opts.request_timeout_ms;
        let cmd = Command {
            id,
            dst: d.id.clone(),
            src: src.clone(),
            dst_blocks: dst.clone(),
            // The decode engine's allocation belongs to this attach: a
            // re-attached decode-0 (its agent restarted) must not receive
            // it (found by seed 2026, round 99: SUCCESS into the new
            // attach's pool).
            dst_incarnation: d.session.incarnation(),
            seed,
            timeout_ms: timeout_ms as u32,
            cancel_after_us,
        };
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        let t0 = Instant::now();
        let rx = p.submit(cmd);
        let tx = async {
            let a = rx.await;
            (a, t0.elapsed())
        };
        let arrival = async {
            if await_arrival {
                Some(
                    d.session
                        .await_arrival(id, &p.id, Duration::from_millis(timeout_ms + 1000))
                        .await,
                )
            } else {
                None
            }
        };
        let bound = Duration::from_millis(timeout_ms + self.opts.slack_ms);
        let r = tokio::time::timeout(bound, async { tokio::join!(tx, arrival) }).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        let Ok(((tx, tx_elapsed), arr)) = r else {
            o.hang += 1;
            lock(&d.alloc).hold(dst);
            lock(&p.alloc).hold(src);
            return (
                o,
                Some(format!(
                    "{name}: HANG, not resolved within {bound:?} (requestTimeout {timeout_ms} ms + slack {} ms)",
                    self.opts.slack_ms
                )),
            );
        };
        let elapsed = t0.elapsed();
        let tx_ok = matches!(&tx, Ok(a) if a.outcome == "success");
        let arr_ok = matches!(&arr, Some(Ok(a)) if a.outcome() == pb::Outcome::Success);
        lock(&self.samples).push(Sample {
            submitted: t0,
            ms: ms(elapsed),
            tx_ms: ms(tx_elapsed),
            success: tx_ok || arr_ok,
            prefill: p.id.clone(),
            decode: d.id.clone(),
        });
        let describe = || {
            let t = match &tx {
                Ok(a) => format!("{} {}", a.outcome, a.reason),
                Err(_) => "engine gone".to_string(),
            };
            let a = match &arr {
                None => "not awaited".to_string(),
                Some(Ok(a)) => format!("{} {}", crate::engine::outcome_name(a.outcome()), a.reason),
                Some(Err(e)) => format!("error {e}"),
            };
            format!("transfer: {t}; arrival: {a}; after {:.0} ms", ms(elapsed))
        };
        let mut violation = None;
        if tx_ok || arr_ok {
            let bad = corrupt_bytes(d.pool.as_slice(), &ranges, seed);
            if bad > 0 {
                o.failure += 1;
                o.corrupt_requests += 1;
                o.corrupt_bytes += bad;
                violation = Some(format!(
                    "{name}: SUCCESS with {bad} corrupt bytes ({})",
                    describe()
                ));
                lock(&d.alloc).hold(dst);
            } else {
                o.success += 1;
                let n: usize = ranges.iter().map(|r| r.1).sum();
                self.verified_bytes.fetch_add(n as u64, Ordering::Relaxed);
                lock(&d.alloc).give(dst);
            }
            if await_arrival && tx_ok != arr_ok {
                o.sides_disagree += 1;
                let mut n = lock(&self.round_notes);
                if n.len() < 5 {
                    n.push(format!(
                        "sides disagree, bytes verified: {name}: {}",
                        describe()
                    ));
                }
            }
        } else {
            o.failure += 1;
            lock(&d.alloc).hold(dst);
        }
        if tx.is_ok() {
            lock(&p.alloc).give(src);
        }
        (o, violation)
    }

    /// The load of one round: trace-sized hand-offs, `concurrency` at a
    /// time, until `stop` and at least `requests_per_round`.
    async fn load(self: Arc<Self>, seed: u64, stop: Arc<AtomicBool>) -> (Outcomes, Vec<String>) {
        let mut rng = Rng::new(seed);
        let sem = Arc::new(Semaphore::new(self.opts.concurrency));
        let mut tasks = tokio::task::JoinSet::new();
        let mut i = 0usize;
        let t0 = Instant::now();
        let cap = Duration::from_secs(180);
        while (i < self.opts.requests_per_round || !stop.load(Ordering::SeqCst))
            && t0.elapsed() < cap
        {
            let Ok(permit) = sem.clone().acquire_owned().await else {
                break;
            };
            let ps: Vec<Arc<Prefill>> = lock_r(&self.prefill)
                .iter()
                .filter(|p| p.alive())
                .cloned()
                .collect();
            let ds: Vec<Arc<Decode>> = lock_r(&self.decode)
                .iter()
                .filter(|d| d.session.is_open())
                .cloned()
                .collect();
            if ps.is_empty() || ds.is_empty() {
                drop(permit);
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            let p = ps[i % ps.len()].clone();
            let d = ds[rng.below(ds.len() as u64) as usize].clone();
            let n = self.next_blocks();
            let s = self.clone();
            tasks.spawn(async move {
                let r = s.hand_off(p, d, n, true, None).await;
                drop(permit);
                r
            });
            i += 1;
        }
        let mut o = Outcomes::default();
        let mut v = Vec::new();
        while let Some(r) = tasks.join_next().await {
            if let Ok((oo, vv)) = r {
                o.add(&oo);
                v.extend(vv);
            }
        }
        (o, v)
    }

    /// A one-block hand-off from prefill slot `i` to decode slot `j`,
    /// retried until it resolves SUCCESS (verified); ms since `since`.
    async fn pair_probe(
        self: &Arc<Self>,
        i: usize,
        j: usize,
        since: Instant,
        within: Duration,
    ) -> Result<f64, String> {
        let deadline = Instant::now() + within;
        let mut last = String::from("no attempt");
        while Instant::now() < deadline {
            let p = lock_r(&self.prefill).get(i).cloned();
            let d = lock_r(&self.decode).get(j).cloned();
            if let (Some(p), Some(d)) = (p, d) {
                if p.alive() && d.session.is_open() {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match tokio::time::timeout(left, self.hand_off(p, d, 1, true, None)).await {
                        Ok((o, None)) if o.success == 1 => return Ok(ms(since.elapsed())),
                        Ok((_, Some(v))) => return Err(v),
                        Ok(_) => last = "hand-off failed".into(),
                        Err(_) => last = "hand-off unresolved at the deadline".into(),
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!("no verified transfer within {within:?} ({last})"))
    }

    /// A probe over any live pair whose agents are not in `exclude`
    /// (agent slots); ms since `since`.
    async fn survivor_probe(
        self: &Arc<Self>,
        exclude: Vec<usize>,
        since: Instant,
    ) -> Result<f64, String> {
        let pick = |v: Vec<usize>| v.into_iter().find(|s| !exclude.contains(s));
        let i = pick(vec![0, 1]).ok_or("no surviving prefill agent")?;
        let j = pick(vec![2, 3]).ok_or("no surviving decode agent")? - 2;
        self.pair_probe(i, j, since, Duration::from_secs(10)).await
    }

    /// Scrapes every agent until it is quiet (no flows, arena free, no
    /// requests in flight, exactly its live engines and their pools);
    /// what is still not, after 10 s. Records the histograms.
    async fn quiesce(self: &Arc<Self>) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut bad = Vec::new();
            for s in lock(&self.agents).iter_mut() {
                if !s.agent.proc.alive() {
                    bad.push(format!(
                        "agent {} exited unexpectedly: {}",
                        s.agent.name,
                        s.agent.proc.log_tail(600)
                    ));
                }
            }
            if !lock(&self.operator).alive() {
                bad.push("the operator exited".into());
            }
            let targets: Vec<(usize, String, SocketAddr)> = lock(&self.agents)
                .iter()
                .enumerate()
                .map(|(i, s)| (i, s.agent.name.clone(), s.agent.http))
                .collect();
            let prefill_live: Vec<bool> = lock_r(&self.prefill).iter().map(|p| p.alive()).collect();
            let decode_live: Vec<bool> = lock_r(&self.decode)
                .iter()
                .map(|d| d.session.is_open())
                .collect();
            let g = self.opts.geometry;
            let ppool = kvfabric_client::pool_bytes(&g.layout(self.prefill_blocks)) as f64;
            let dpool = kvfabric_client::pool_bytes(&g.layout(self.decode_blocks)) as f64;
            for (slot, name, http) in targets {
                let text = match blocking(move || topo::http_get(http, "/metrics")).await {
                    Ok((_, t)) => t,
                    Err(e) => {
                        bad.push(format!("agent {name}: /metrics: {e}"));
                        continue;
                    }
                };
                self.record_hist(&name, &text);
                let live = if slot < 2 {
                    prefill_live.get(slot).copied().unwrap_or(false)
                } else {
                    decode_live.get(slot - 2).copied().unwrap_or(false)
                };
                let pool = if slot < 2 { ppool } else { dpool };
                let want_engines = if live { 1.0 } else { 0.0 };
                for (metric, want) in [
                    ("kvfabric_flows", 0.0),
                    ("kvfabric_arena_in_use_bytes", 0.0),
                    ("kvfabric_requests_in_flight", 0.0),
                    ("kvfabric_chunks_in_flight", 0.0),
                    ("kvfabric_engines", want_engines),
                    ("kvfabric_engine_pool_bytes", want_engines * pool),
                ] {
                    let v = topo::metric(&text, metric, &[]);
                    if (v - want).abs() > 0.5 {
                        bad.push(format!("agent {name}: {metric} = {v} (want {want})"));
                    }
                }
            }
            if bad.is_empty() || Instant::now() >= deadline {
                return bad;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn record_hist(&self, agent: &str, text: &str) {
        let name = "kvfabric_peer_invalidation_seconds_bucket";
        let mut per: BTreeMap<String, Buckets> = BTreeMap::new();
        for (suffix, key) in [("_sum", "#sum"), ("_count", "#count")] {
            let n = format!("kvfabric_peer_invalidation_seconds{suffix}");
            for l in text.lines().filter(|l| l.starts_with(&n)) {
                let path = l
                    .split("path=\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .unwrap_or("");
                if let Some(v) = l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()) {
                    *per.entry(format!("{path}{key}"))
                        .or_default()
                        .entry(String::new())
                        .or_default() += v;
                }
            }
        }
        for l in text.lines().filter(|l| l.starts_with(name)) {
            let label = |k: &str| {
                l.split(&format!("{k}=\""))
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .map(String::from)
            };
            let (Some(path), Some(le)) = (label("path"), label("le")) else {
                continue;
            };
            let Some(v) = l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()) else {
                continue;
            };
            *per.entry(path).or_default().entry(le).or_default() += v;
        }
        lock(&self.hist).insert(agent.to_string(), per);
    }

    /// Scrapes agent `slot` once (its histogram), best effort.
    async fn scrape_hist(self: &Arc<Self>, slot: usize) {
        let (name, http) = (self.agent_name(slot), self.agent_http(slot));
        if let Ok(Ok((_, t))) = tokio::time::timeout(
            Duration::from_secs(3),
            blocking(move || topo::http_get(http, "/metrics")),
        )
        .await
        {
            self.record_hist(&name, &t);
        }
    }

    /// Polls `f.observers` until none lists `f.name`; ms since `t0`.
    async fn wait_forgotten(f: Forget, t0: Instant, within: Duration) -> Option<f64> {
        let deadline = t0 + within;
        while Instant::now() < deadline {
            let (obs, name) = (f.observers.clone(), f.name.clone());
            let listed = blocking(move || {
                obs.iter().any(|a| {
                    topo::http_get(*a, "/v1/peers")
                        .map(|(_, b)| b.contains(&format!("\"{name}\"")))
                        .unwrap_or(true)
                })
            })
            .await;
            if !listed {
                return Some(ms(t0.elapsed()));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        None
    }

    /// Restarts agent `slot` (generation + 1), in a new pod when `pod`
    /// is given; (old name, new name).
    async fn restart_agent(
        self: &Arc<Self>,
        slot: usize,
        pod: Option<(String, String)>,
    ) -> Result<(String, String), String> {
        let (conf, logical, uid, side, gen, old, port) = {
            let mut a = lock(&self.agents);
            let s = &mut a[slot];
            s.agent.proc.kill();
            if let Some((p, u)) = pod {
                s.logical = p;
                s.uid = u;
            }
            (
                self.conf.clone(),
                s.logical.clone(),
                s.uid.clone(),
                s.side,
                s.gen + 1,
                s.agent.name.clone(),
                s.port,
            )
        };
        // The slot's namespace: a restarted agent (or its replacement pod)
        // keeps its slot's address.
        let ns = self.net.as_ref().and_then(|n| n.slot(slot)).cloned();
        let new =
            blocking(move || AgentProc::spawn(&conf, &logical, &uid, side, gen, port, ns)).await?;
        let name = new.name.clone();
        {
            let mut a = lock(&self.agents);
            a[slot].agent = new;
            a[slot].gen = gen;
        }
        Ok((old, name))
    }

    /// Replaces prefill engine `i` by a new process (new engine id), in
    /// pod `pod` (default: its current pod).
    async fn restart_prefill(
        self: &Arc<Self>,
        i: usize,
        pod: Option<(String, String)>,
    ) -> Result<(), String> {
        let old = lock_r(&self.prefill)[i].clone();
        old.kill();
        let (pod, uid) = pod.unwrap_or_else(|| (old.pod.clone(), old.uid.clone()));
        let s = self.clone();
        let p = blocking(move || s.spawn_prefill(i, &pod, &uid)).await?;
        lock_w(&self.prefill)[i] = Arc::new(p);
        Ok(())
    }

    /// Injects one fault under the running load, recovers, and measures.
    async fn inject(self: Arc<Self>, kind: FaultKind, rng: &mut Rng) -> FaultResult {
        let mut r = FaultResult::default();
        let probe_bound = Duration::from_millis(self.opts.probe_bound_ms);
        let gen = self.next_seq();
        // The probe of a surviving pair, started at the fault.
        let start_probe = |s: &Arc<Self>, exclude: Vec<usize>, t: Instant| {
            let s = s.clone();
            tokio::spawn(async move { s.survivor_probe(exclude, t).await })
        };
        let probe;
        match kind {
            FaultKind::DeletePrefillPod => {
                let i = rng.below(2) as usize;
                let p = lock_r(&self.prefill)[i].clone();
                r.target = format!("pod {} (engine {})", p.pod, p.id);
                let (k, pod) = (self.clone(), p.pod.clone());
                let del = blocking(move || k.kube.delete_pod(&pod)).await;
                let t_f = Instant::now();
                p.kill(); // the kubelet kills the pod's processes
                probe = Some(start_probe(&self, vec![i], t_f));
                if let Err(e) = del {
                    r.violations.push(format!("delete pod: {e}"));
                }
                let new_pod = format!("prefill-{i}-g{gen}");
                let (k, np) = (self.clone(), new_pod.clone());
                match blocking(move || k.kube.create_pod(&np, &[("role", "kvf-chaos-prefill")]))
                    .await
                {
                    Ok(uid) => {
                        if let Err(e) = self.restart_prefill(i, Some((new_pod, uid))).await {
                            r.violations.push(format!("replacement engine: {e}"));
                        }
                    }
                    Err(e) => r.violations.push(format!("replacement pod: {e}")),
                }
            }
            FaultKind::KillPrefillEngine => {
                let i = rng.below(2) as usize;
                let p = lock_r(&self.prefill)[i].clone();
                // Mid-transfer: wait (≤ 2 s) until it has hand-offs in flight.
                let t = Instant::now();
                while p.in_flight() == 0 && t.elapsed() < Duration::from_secs(2) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let inflight = p.in_flight();
                r.target = format!("engine {} ({inflight} in flight)", p.id);
                let t_f = Instant::now();
                crate::topo::signal(lock(&p.proc).pid(), libc::SIGKILL);
                p.kill();
                probe = Some(start_probe(&self, vec![i], t_f));
                if inflight == 0 {
                    r.notes.push("no hand-off in flight at the kill".into());
                }
                if let Err(e) = self.restart_prefill(i, None).await {
                    r.violations.push(format!("restarted engine: {e}"));
                }
            }
            FaultKind::KillPrefillAgent | FaultKind::DeleteAgentPod => {
                let i = rng.below(2) as usize;
                self.scrape_hist(i).await;
                let (old, logical) = {
                    let a = lock(&self.agents);
                    (a[i].agent.name.clone(), a[i].logical.clone())
                };
                let observers = vec![self.agent_http(2), self.agent_http(3)];
                r.target = format!("agent {logical} ({old})");
                if kind == FaultKind::DeleteAgentPod {
                    let (k, pod) = (self.clone(), logical.clone());
                    if let Err(e) = blocking(move || k.kube.delete_pod(&pod)).await {
                        r.violations.push(format!("delete pod: {e}"));
                    }
                }
                // The fault: the pod deletion accepted by the API (then the
                // kubelet kills the agent), or the SIGKILL.
                let t_f = Instant::now();
                {
                    let mut a = lock(&self.agents);
                    crate::topo::signal(a[i].agent.proc.pid(), libc::SIGKILL);
                    a[i].agent.proc.kill();
                }
                // Its engine loses its session (and exits); the kubelet
                // would restart it: killed here, restarted below.
                lock_r(&self.prefill)[i].kill();
                probe = Some(start_probe(&self, vec![i], t_f));
                // Polled from the fault on, while the replacement comes.
                let f = Forget {
                    name: old.clone(),
                    observers,
                    path: if kind == FaultKind::DeleteAgentPod {
                        "operator"
                    } else {
                        "lease"
                    },
                };
                let within = Duration::from_secs(self.opts.lease_ttl_s + 10);
                r.forget_path = Some(f.path.into());
                let forget = tokio::spawn(Self::wait_forgotten(f, t_f, within));
                let mut new_pod = None;
                if kind == FaultKind::DeleteAgentPod {
                    let np = format!("agent-p{i}-g{gen}");
                    let (k, np2) = (self.clone(), np.clone());
                    match blocking(move || k.kube.create_pod(&np2, &[("app", FABRIC_LABEL)])).await
                    {
                        Ok(uid) => new_pod = Some((np, uid)),
                        Err(e) => r.violations.push(format!("replacement pod: {e}")),
                    }
                }
                r.forget_ms = forget.await.ok().flatten();
                if r.forget_ms.is_none() {
                    r.violations.push(format!(
                        "decode agents still list {old} {within:?} after the fault"
                    ));
                }
                if kind == FaultKind::DeleteAgentPod {
                    if let Some(ms) = r.forget_ms {
                        if ms > 1000.0 {
                            r.notes.push(format!(
                                "operator path took {ms:.0} ms (> 1 s): the lease may have won"
                            ));
                        }
                    }
                }
                let t_r = Instant::now();
                match self.restart_agent(i, new_pod).await {
                    Ok((old, new)) => {
                        if old == new {
                            r.violations.push(format!(
                                "restarted agent kept its name {new} (no new incarnation)"
                            ));
                        }
                        r.notes.push(format!("rejoined as {new}"));
                        match self.restart_prefill(i, None).await {
                            Ok(()) => {
                                let j = rng.below(2) as usize;
                                match self.pair_probe(i, j, t_r, Duration::from_secs(20)).await {
                                    Ok(ms) => r.rejoin_ms = Some(ms),
                                    Err(e) => r.violations.push(format!(
                                        "restarted agent {new} carries no traffic: {e}"
                                    )),
                                }
                            }
                            Err(e) => r
                                .violations
                                .push(format!("engine on the restarted agent: {e}")),
                        }
                    }
                    Err(e) => r.violations.push(format!("agent restart: {e}")),
                }
            }
            FaultKind::StopAgent => {
                let k = rng.below(4) as usize;
                let (pid, name) = {
                    let a = lock(&self.agents);
                    (a[k].agent.proc.pid(), a[k].agent.name.clone())
                };
                let hold = Duration::from_millis(self.opts.request_timeout_ms + 1000);
                r.target = format!("agent {name} for {} ms", hold.as_millis());
                let t_f = Instant::now();
                crate::topo::signal(pid, libc::SIGSTOP);
                probe = Some(start_probe(&self, vec![k], t_f));
                tokio::time::sleep(hold).await;
                crate::topo::signal(pid, libc::SIGCONT);
                // It must carry traffic again (bounded).
                let t_c = Instant::now();
                let (i, j) = if k < 2 {
                    (k, rng.below(2) as usize)
                } else {
                    (rng.below(2) as usize, k - 2)
                };
                match self.pair_probe(i, j, t_c, Duration::from_secs(15)).await {
                    Ok(ms) => r.rejoin_ms = Some(ms),
                    Err(e) => r.violations.push(format!(
                        "agent {name} carries no traffic after SIGCONT: {e}"
                    )),
                }
            }
            FaultKind::RestartDecodeAgent => {
                let j = rng.below(2) as usize;
                let slot = 2 + j;
                self.scrape_hist(slot).await;
                let old = self.agent_name(slot);
                r.target = format!("agent {} ({old})", lock(&self.agents)[slot].logical);
                let observers = vec![self.agent_http(0), self.agent_http(1)];
                let t_f = Instant::now();
                lock(&self.agents)[slot].agent.proc.kill();
                probe = Some(start_probe(&self, vec![slot], t_f));
                let f = Forget {
                    name: old.clone(),
                    observers,
                    path: "incarnation",
                };
                r.forget_path = Some(f.path.into());
                let forget = tokio::spawn(Self::wait_forgotten(
                    f,
                    t_f,
                    Duration::from_secs(self.opts.lease_ttl_s + 10),
                ));
                let restarted = self.restart_agent(slot, None).await;
                match restarted {
                    Ok((old, new)) => {
                        if old == new {
                            r.violations
                                .push(format!("restarted agent kept its name {new}"));
                        }
                        r.notes.push(format!("new incarnation {new}"));
                        // The decode engine (its pod unchanged) re-attaches.
                        let duid = self.decode_uids[j].clone();
                        match self.attach_decode(j, &duid).await {
                            Ok(d) => lock_w(&self.decode)[j] = Arc::new(d),
                            Err(e) => r.violations.push(format!("decode engine re-attach: {e}")),
                        }
                        r.forget_ms = forget.await.ok().flatten();
                        if r.forget_ms.is_none() {
                            r.violations.push(format!(
                                "prefill agents still list the old incarnation {old}"
                            ));
                        }
                        let t_r = Instant::now();
                        let i = rng.below(2) as usize;
                        match self.pair_probe(i, j, t_r, Duration::from_secs(20)).await {
                            Ok(ms) => r.rejoin_ms = Some(ms),
                            Err(e) => r
                                .violations
                                .push(format!("restarted agent {new} carries no traffic: {e}")),
                        }
                    }
                    Err(e) => r.violations.push(format!("agent restart: {e}")),
                }
            }
            FaultKind::CancelBurst | FaultKind::NeverAwait => {
                let i = rng.below(2) as usize;
                let j = rng.below(2) as usize;
                let p = lock_r(&self.prefill)[i].clone();
                let d = lock_r(&self.decode)[j].clone();
                let (count, cancel) = if kind == FaultKind::CancelBurst {
                    (300, true)
                } else {
                    (32, false)
                };
                r.target = format!("{count} × {} → {}", p.id, d.id);
                let t_f = Instant::now();
                probe = Some(start_probe(&self, vec![], t_f));
                let mut set = tokio::task::JoinSet::new();
                let mut brng = Rng::new(rng.next_u64());
                for _ in 0..count {
                    let (s, p, d) = (self.clone(), p.clone(), d.clone());
                    let n = if cancel {
                        1 + brng.below(2) as u32
                    } else {
                        self.next_blocks()
                    };
                    let after = cancel.then(|| brng.below(500));
                    set.spawn(async move { s.hand_off(p, d, n, false, after).await });
                }
                while let Some(x) = set.join_next().await {
                    if let Ok((o, v)) = x {
                        r.outcomes.add(&o);
                        r.violations.extend(v);
                    }
                }
                r.notes.push(format!(
                    "{} success, {} failure/cancelled",
                    r.outcomes.success, r.outcomes.failure
                ));
            }
            FaultKind::ReplaceDecodePod => {
                let j = rng.below(2) as usize;
                let slot = 2 + j;
                self.scrape_hist(slot).await;
                let (old, logical, http) = {
                    let a = lock(&self.agents);
                    (
                        a[slot].agent.name.clone(),
                        a[slot].logical.clone(),
                        a[slot].agent.http,
                    )
                };
                r.target = format!("pod {logical} ({old}) on {http}");
                let observers = vec![self.agent_http(0), self.agent_http(1)];
                let (k, pod) = (self.clone(), logical.clone());
                if let Err(e) = blocking(move || k.kube.delete_pod(&pod)).await {
                    r.violations.push(format!("delete pod: {e}"));
                }
                let t_f = Instant::now();
                lock(&self.agents)[slot].agent.proc.kill();
                probe = Some(start_probe(&self, vec![slot], t_f));
                let f = Forget {
                    name: old.clone(),
                    observers,
                    path: "operator",
                };
                r.forget_path = Some(f.path.into());
                let forget = tokio::spawn(Self::wait_forgotten(
                    f,
                    t_f,
                    Duration::from_secs(self.opts.lease_ttl_s + 10),
                ));
                // The same pod name again once the old pod is gone (≤ 20 s).
                let (k, pod) = (self.clone(), logical.clone());
                let uid = blocking(move || {
                    let t = Instant::now();
                    loop {
                        match k.kube.create_pod(&pod, &[("app", FABRIC_LABEL)]) {
                            Ok(u) => return Ok(u),
                            Err(e) if t.elapsed() > Duration::from_secs(20) => return Err(e),
                            Err(_) => std::thread::sleep(Duration::from_millis(100)),
                        }
                    }
                })
                .await;
                match uid {
                    Ok(uid) => match self.restart_agent(slot, Some((logical.clone(), uid))).await {
                        Ok((old, new)) => {
                            let now = self.agent_http(slot);
                            if now != http {
                                r.violations
                                    .push(format!("replacement listens on {now}, not {http}"));
                            }
                            if old == new {
                                r.violations
                                    .push(format!("replacement kept the name {new}"));
                            }
                            r.notes.push(format!("replaced by {new} on {now}"));
                            let duid = self.decode_uids[j].clone();
                            match self.attach_decode(j, &duid).await {
                                Ok(d) => lock_w(&self.decode)[j] = Arc::new(d),
                                Err(e) => {
                                    r.violations.push(format!("decode engine re-attach: {e}"))
                                }
                            }
                            r.forget_ms = forget.await.ok().flatten();
                            if r.forget_ms.is_none() {
                                r.violations
                                    .push(format!("prefill agents still list the replaced {old}"));
                            }
                            let t_r = Instant::now();
                            let i = rng.below(2) as usize;
                            match self.pair_probe(i, j, t_r, Duration::from_secs(20)).await {
                                Ok(ms) => r.rejoin_ms = Some(ms),
                                Err(e) => r
                                    .violations
                                    .push(format!("replacement {new} carries no traffic: {e}")),
                            }
                        }
                        Err(e) => r.violations.push(format!("replacement agent: {e}")),
                    },
                    Err(e) => r.violations.push(format!("replacement pod {logical}: {e}")),
                }
            }
            FaultKind::RestartEtcdBeyondTtl => {
                let before: Vec<u32> = lock(&self.agents)
                    .iter()
                    .map(|a| a.agent.proc.pid())
                    .collect();
                let away = Duration::from_secs(self.opts.lease_ttl_s + 2);
                r.target = format!("fabric etcd, away {} s", away.as_secs());
                let forgotten_before = self.sum_metric("kvfabric_peers_forgotten_total").await;
                let t_f = Instant::now();
                if let Some(mut p) = lock(&self.etcd).proc.take() {
                    p.kill();
                }
                // The data path needs no etcd: a pair keeps working.
                probe = Some(start_probe(&self, vec![], t_f));
                tokio::time::sleep(away).await;
                let s = self.clone();
                if let Err(e) = blocking(move || lock(&s.etcd).restart()).await {
                    r.violations.push(format!("etcd restart: {e}"));
                }
                // Every lease expired: the fabric must come back by itself,
                // every pair carrying a verified hand-off (≤ 30 s).
                let t_back = Instant::now();
                let mut worst: f64 = 0.0;
                for i in 0..2 {
                    for j in 0..2 {
                        match self.pair_probe(i, j, t_back, Duration::from_secs(30)).await {
                            Ok(ms) => worst = worst.max(ms),
                            Err(e) => r.violations.push(format!(
                                "after etcd came back, prefill {i} → decode {j}: {e}"
                            )),
                        }
                    }
                }
                r.rejoin_ms = Some(worst);
                let after: Vec<u32> = lock(&self.agents)
                    .iter()
                    .map(|a| a.agent.proc.pid())
                    .collect();
                let alive: Vec<bool> = lock(&self.agents)
                    .iter_mut()
                    .map(|a| a.agent.proc.alive())
                    .collect();
                if before != after || alive.iter().any(|a| !a) {
                    r.violations.push(format!("agents restarted or exited across the etcd outage: {before:?} → {after:?}, alive {alive:?}"));
                }
                // etcd refreshes every lease when its member comes back
                // (lessor promote), so no lease expires: nobody may be
                // forgotten either.
                let forgotten_after = self.sum_metric("kvfabric_peers_forgotten_total").await;
                if forgotten_after > forgotten_before {
                    r.notes.push(format!(
                        "peers forgotten across the outage: {forgotten_before} → {forgotten_after}"
                    ));
                }
            }
            FaultKind::JoinerDies => {
                let pod = format!("agent-dx-g{gen}");
                let (k, p2) = (self.clone(), pod.clone());
                let uid = blocking(move || k.kube.create_pod(&p2, &[("app", FABRIC_LABEL)])).await;
                let delay = Duration::from_millis(rng.below(300));
                r.target = format!(
                    "new agent {pod}, killed {} ms after it answered",
                    delay.as_millis()
                );
                match uid {
                    Ok(uid) => {
                        let (c, p2, ns) = (self.conf.clone(), pod.clone(), self.joiner_netns());
                        match blocking(move || {
                            AgentProc::spawn(&c, &p2, &uid, Side::Decode, 0, 0, ns)
                        })
                        .await
                        {
                            Ok(mut joiner) => {
                                tokio::time::sleep(delay).await;
                                let t_f = Instant::now();
                                joiner.proc.kill();
                                probe = Some(start_probe(&self, vec![], t_f));
                                let (k, p2) = (self.clone(), pod.clone());
                                if let Err(e) = blocking(move || k.kube.delete_pod(&p2)).await {
                                    r.violations.push(format!("delete pod: {e}"));
                                }
                                self.joiner_forgotten(&joiner.name, t_f, &mut r).await;
                            }
                            Err(e) => {
                                probe = Some(start_probe(&self, vec![], Instant::now()));
                                r.violations.push(format!("joiner did not start: {e}"));
                            }
                        }
                    }
                    Err(e) => {
                        probe = Some(start_probe(&self, vec![], Instant::now()));
                        r.violations.push(format!("joiner pod: {e}"));
                    }
                }
            }
            FaultKind::DiesMidHandshake => {
                probe = self.clone().dies_mid_handshake(gen, rng, &mut r).await;
            }
            FaultKind::NodeNotReadyBlip => {
                let node = self.kube.node();
                r.target = format!("node {node} Ready=Unknown for 2 s");
                let cond = |status: &str, reason: &str| {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_secs())
                        .unwrap_or(0);
                    let t = format_rfc3339(now);
                    serde_json::json!({"status": {"conditions": [{
                        "type": "Ready", "status": status, "reason": reason,
                        "message": "kvfabric-chaos: heartbeat blip",
                        "lastHeartbeatTime": t, "lastTransitionTime": t
                    }]}})
                    .to_string()
                };
                let patch = |body: String| {
                    let (k, n) = (self.clone(), node.clone());
                    blocking(move || {
                        k.kube.kubectl(
                            &[
                                "patch",
                                "node",
                                &n,
                                "--subresource=status",
                                "--type=strategic",
                                "-p",
                                &body,
                            ],
                            None,
                        )
                    })
                };
                let t_f = Instant::now();
                if let Err(e) = patch(cond("Unknown", "NodeStatusUnknown")).await {
                    r.violations.push(format!("patch node: {e}"));
                }
                probe = Some(start_probe(&self, vec![], t_f));
                tokio::time::sleep(Duration::from_secs(2)).await;
                if let Err(e) = patch(cond("True", "KubeletReady")).await {
                    r.violations.push(format!("patch node back: {e}"));
                }
                let t_back = Instant::now();
                for i in 0..2 {
                    for j in 0..2 {
                        if let Err(e) = self.pair_probe(i, j, t_back, Duration::from_secs(15)).await
                        {
                            r.violations.push(format!(
                                "after a 2 s node heartbeat blip, prefill {i} → decode {j}: {e}"
                            ));
                        }
                    }
                }
            }
            FaultKind::PartitionAgent => {
                let k = rng.below(4) as usize;
                let name = self.agent_name(k);
                let hold = Duration::from_millis(self.opts.request_timeout_ms + 1000);
                r.target = format!("agent {name}, control cut {} ms", hold.as_millis());
                match self.control_ports().await {
                    Err(e) => {
                        r.violations.push(format!("control ports: {e}"));
                        probe = None;
                    }
                    Ok(ports) => {
                        let mine = ports[k];
                        let (specs, probe_addr) = crate::cuts::partition_agent(
                            &self.cut_view(&ports),
                            k,
                            crate::nft::next_mark(),
                        );
                        let made = blocking(move || crate::nft::Tables::create(&specs)).await;
                        // The cut starts once nft has returned (the rules
                        // are in the kernel): `nft -f` can take a while on a
                        // loaded machine, and requests submitted before it
                        // returned may still get through.
                        let t_f = Instant::now();
                        match made {
                            Err(e) => {
                                r.violations.push(format!("nft partition: {e}"));
                                probe = Some(start_probe(&self, vec![], t_f));
                            }
                            Ok(table) => {
                                probe = Some(start_probe(&self, vec![k], t_f));
                                // A connection from here to the victim's
                                // control port must time out (its SYN
                                // dropped, counted as "probe"; see
                                // `cuts::partition_agent` for the address).
                                tokio::time::sleep(Duration::from_millis(200)).await;
                                let addr = probe_addr;
                                let got = blocking(move || {
                                    match std::net::TcpStream::connect_timeout(
                                        &addr,
                                        Duration::from_millis(500),
                                    ) {
                                        Ok(_) => Some("connected".to_string()),
                                        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => None,
                                        Err(e) => Some(e.to_string()),
                                    }
                                })
                                .await;
                                if let Some(how) = got {
                                    r.violations.push(format!(
                                        "a connection to {name}'s control port {mine} got through the partition ({how})"
                                    ));
                                }
                                tokio::time::sleep(hold.saturating_sub(Duration::from_millis(700)))
                                    .await;
                                // etcd was not cut: every other agent still
                                // lists the victim.
                                let observers: Vec<SocketAddr> = (0..4)
                                    .filter(|i| *i != k)
                                    .map(|i| self.agent_http(i))
                                    .collect();
                                let n2 = format!("\"{name}\"");
                                let listed = blocking(move || {
                                    observers.iter().all(|a| {
                                        topo::http_get(*a, "/v1/peers")
                                            .map(|(_, b)| b.contains(&n2))
                                            .unwrap_or(false)
                                    })
                                })
                                .await;
                                let (listing, deleted) = blocking(move || table.heal()).await;
                                let t_heal = Instant::now();
                                if let Err(e) = deleted {
                                    r.violations.push(format!("heal (nft delete): {e}"));
                                }
                                let listing = listing.unwrap_or_else(|e| {
                                    r.violations.push(format!("nft list: {e}"));
                                    String::new()
                                });
                                let to = crate::nft::Table::counter(&listing, "to_victim");
                                let from = crate::nft::Table::counter(&listing, "from_victim");
                                let syn = crate::nft::Table::counter(&listing, "probe");
                                // The direction the victim's role starts
                                // exchanges in always has traffic under load
                                // (a prefill sends WANTs, a decode receives
                                // them); the other only when messages were
                                // in flight at the cut (reported).
                                let initiated = if k < 2 { from } else { to };
                                if initiated == 0 {
                                    r.violations.push(format!(
                                        "the partition of {name} dropped {to} packets to it and {from} from it: its {} traffic was not cut",
                                        if k < 2 { "outgoing" } else { "incoming" }
                                    ));
                                }
                                if !listed {
                                    r.violations.push(format!(
                                        "an agent no longer listed {name} after {} ms of control partition (etcd was not cut: it must stay in discovery)",
                                        hold.as_millis()
                                    ));
                                }
                                // After the heal the victim carries traffic.
                                let t_c = Instant::now();
                                let (i, j) = if k < 2 {
                                    (k, rng.below(2) as usize)
                                } else {
                                    (rng.below(2) as usize, k - 2)
                                };
                                let recovery =
                                    match self.pair_probe(i, j, t_c, Duration::from_secs(20)).await
                                    {
                                        Ok(ms) => Some(ms),
                                        Err(e) => {
                                            r.violations.push(format!(
                                            "agent {name} carries no traffic after the heal: {e}"
                                        ));
                                            None
                                        }
                                    };
                                r.rejoin_ms = recovery;
                                r.notes.push(format!(
                                    "nft dropped {to} control packets to {name} and {from} from it"
                                ));
                                r.partition = Some(crate::report::PartitionStats {
                                    victim: name.clone(),
                                    control_ports: ports.clone(),
                                    cut_ms: ms(t_heal - t_f),
                                    dropped_to_victim: to,
                                    dropped_from_victim: from,
                                    dropped_probe: syn,
                                    in_discovery_at_heal: listed,
                                    recovery_ms: recovery,
                                    ..Default::default()
                                });
                                r.window = Some((t_f, t_heal, Some(k)));
                            }
                        }
                    }
                }
            }
            FaultKind::ControlLoss => {
                let pct = self.opts.loss_percent.min(100);
                let dur = Duration::from_secs(3);
                r.target = format!("{pct}% control loss, all agents, {} ms", dur.as_millis());
                match self.control_ports().await {
                    Err(e) => {
                        r.violations.push(format!("control ports: {e}"));
                        probe = None;
                    }
                    Ok(ports) => {
                        // The load's latency before the loss: 1.5 s more.
                        tokio::time::sleep(Duration::from_millis(1500)).await;
                        let specs = crate::cuts::control_loss(&self.cut_view(&ports), pct);
                        let made = blocking(move || crate::nft::Tables::create(&specs)).await;
                        let t_l = Instant::now();
                        match made {
                            Err(e) => {
                                r.violations.push(format!("nft loss: {e}"));
                                probe = Some(start_probe(&self, vec![], t_l));
                            }
                            Ok(table) => {
                                probe = Some(start_probe(&self, vec![], t_l));
                                tokio::time::sleep(dur).await;
                                let (listing, deleted) = blocking(move || table.heal()).await;
                                let t_end = Instant::now();
                                if let Err(e) = deleted {
                                    r.violations.push(format!("nft delete: {e}"));
                                }
                                let listing = listing.unwrap_or_default();
                                let seen = crate::nft::Table::counter(&listing, "seen");
                                let dropped = crate::nft::Table::counter(&listing, "dropped");
                                if dropped == 0 && pct > 0 {
                                    r.violations.push(format!(
                                        "control loss {pct}%: no packet dropped of {seen}"
                                    ));
                                }
                                r.notes.push(format!(
                                    "{dropped} of {seen} control packets dropped ({:.1}%)",
                                    100.0 * dropped as f64 / seen.max(1) as f64
                                ));
                                r.loss = Some(crate::report::LossStats {
                                    percent: pct,
                                    loss_ms: ms(t_end - t_l),
                                    packets: seen,
                                    dropped,
                                    ..Default::default()
                                });
                                r.window = Some((t_l, t_end, None));
                            }
                        }
                    }
                }
            }
            FaultKind::PartitionEtcd => {
                let k = rng.below(4) as usize;
                let (name, gid, pid) = {
                    let a = lock(&self.agents);
                    (
                        a[k].agent.name.clone(),
                        a[k].agent.gid,
                        a[k].agent.proc.pid(),
                    )
                };
                let etcd_port: u16 = self
                    .conf
                    .etcd
                    .trim_end_matches('/')
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(0);
                let hold = Duration::from_secs(self.opts.lease_ttl_s + 3);
                r.target = format!(
                    "agent {name} cut from etcd :{etcd_port} for {} s",
                    hold.as_secs()
                );
                // The victim's connections to etcd open now, by local port
                // (the loopback rules need them: see `cuts::partition_etcd`).
                let ports = blocking(move || topo::tcp_local_ports(pid, etcd_port)).await;
                let specs = match self.control_ports().await {
                    Ok(cp) => Ok(crate::cuts::partition_etcd(
                        &self.cut_view(&cp),
                        k,
                        etcd_port,
                        &ports,
                        crate::nft::next_mark(),
                    )),
                    Err(e) => Err(format!("control ports: {e}")),
                };
                r.notes.push(format!(
                    "{name}'s open etcd connections: local ports {ports:?}"
                ));
                let made = match specs {
                    Ok(specs) => blocking(move || crate::nft::Tables::create(&specs)).await,
                    Err(e) => Err(e),
                };
                let t_f = Instant::now();
                match made {
                    Err(e) => {
                        r.violations.push(format!("nft etcd partition: {e}"));
                        probe = Some(start_probe(&self, vec![], t_f));
                    }
                    Ok(table) => {
                        probe = Some(start_probe(&self, vec![k], t_f));
                        let observers: Vec<SocketAddr> = (0..4)
                            .filter(|i| *i != k)
                            .map(|i| self.agent_http(i))
                            .collect();
                        let f = Forget {
                            name: name.clone(),
                            observers: observers.clone(),
                            path: "lease",
                        };
                        r.forget_path = Some(f.path.into());
                        r.forget_ms = Self::wait_forgotten(f, t_f, hold).await;
                        if r.forget_ms.is_none() {
                            r.violations.push(format!(
                                "peers still list {name} {} s after it was cut from etcd (its lease, TTL {} s, must expire)",
                                hold.as_secs(),
                                self.opts.lease_ttl_s
                            ));
                        }
                        if let Some(left) = hold.checked_sub(t_f.elapsed()) {
                            tokio::time::sleep(left).await;
                        }
                        let (listing, deleted) = blocking(move || table.heal()).await;
                        let t_heal = Instant::now();
                        if let Err(e) = deleted {
                            r.violations.push(format!("heal (nft delete): {e}"));
                        }
                        let listing = listing.unwrap_or_default();
                        let to = crate::nft::Table::counter(&listing, "to_victim");
                        let from = crate::nft::Table::counter(&listing, "from_victim");
                        if from == 0 {
                            r.violations.push(format!(
                                "the etcd partition of {name} dropped nothing it sent ({to} packets to it); gid {gid}; table: {}",
                                listing.replace('\n', " ")
                            ));
                        }
                        r.notes.push(format!(
                            "nft dropped {from} packets from {name} to etcd and {to} back"
                        ));
                        // After the heal: re-granted, republished, loaded by
                        // every peer again ...
                        let n2 = format!("\"{name}\"");
                        let deadline = t_heal + Duration::from_secs(30);
                        let mut back = None;
                        while Instant::now() < deadline {
                            let (obs, n3) = (observers.clone(), n2.clone());
                            let listed = blocking(move || {
                                obs.iter().all(|a| {
                                    topo::http_get(*a, "/v1/peers")
                                        .map(|(_, b)| b.contains(&n3))
                                        .unwrap_or(false)
                                })
                            })
                            .await;
                            if listed {
                                back = Some(ms(t_heal.elapsed()));
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        match back {
                            Some(ms) => r.notes.push(format!(
                                "every peer loaded {name} again {ms:.0} ms after the heal"
                            )),
                            None => r.violations.push(format!(
                                "{name} was not loaded again by every peer within 30 s of the heal"
                            )),
                        }
                        // ... and carrying traffic.
                        let t_c = Instant::now();
                        let (i, j) = if k < 2 {
                            (k, rng.below(2) as usize)
                        } else {
                            (rng.below(2) as usize, k - 2)
                        };
                        match self.pair_probe(i, j, t_c, Duration::from_secs(20)).await {
                            Ok(ms) => r.rejoin_ms = Some(ms),
                            Err(e) => r.violations.push(format!(
                                "agent {name} carries no traffic after the etcd heal: {e}"
                            )),
                        }
                    }
                }
            }
            FaultKind::RestartEtcd => {
                let before: Vec<(u32, String)> = lock(&self.agents)
                    .iter()
                    .map(|a| (a.agent.proc.pid(), a.agent.name.clone()))
                    .collect();
                let forgotten_before = self.sum_metric("kvfabric_peers_forgotten_total").await;
                r.target = "fabric etcd".into();
                let t_f = Instant::now();
                if let Some(mut p) = lock(&self.etcd).proc.take() {
                    p.kill();
                }
                probe = Some(start_probe(&self, vec![], t_f));
                let s = self.clone();
                let down = blocking(move || lock(&s.etcd).restart()).await;
                match down {
                    Ok(d) => r.notes.push(format!("etcd away {:.0} ms", ms(d))),
                    Err(e) => r.violations.push(format!("etcd restart: {e}")),
                }
                // Past the lease TTL: nobody lost its lease, restarted or
                // forgot a peer.
                tokio::time::sleep(Duration::from_secs(self.opts.lease_ttl_s + 1)).await;
                let after: Vec<(u32, String)> = lock(&self.agents)
                    .iter()
                    .map(|a| (a.agent.proc.pid(), a.agent.name.clone()))
                    .collect();
                if before != after {
                    r.violations.push(format!(
                        "agents changed across the etcd restart: {before:?} → {after:?}"
                    ));
                }
                let alive: Vec<bool> = lock(&self.agents)
                    .iter_mut()
                    .map(|a| a.agent.proc.alive())
                    .collect();
                if alive.iter().any(|a| !a) {
                    r.violations.push(format!(
                        "an agent exited across the etcd restart: {alive:?}"
                    ));
                }
                let forgotten_after = self.sum_metric("kvfabric_peers_forgotten_total").await;
                if forgotten_after > forgotten_before {
                    r.violations.push(format!(
                        "peers forgotten across an etcd restart within the lease TTL: {forgotten_before} → {forgotten_after}"
                    ));
                }
            }
        }
        if let Some(pr) = probe {
            match pr.await {
                Ok(Ok(ms)) => {
                    r.probe_ms = Some(ms);
                    if ms > probe_bound.as_secs_f64() * 1e3 {
                        r.warnings.push(format!(
                            "surviving pair's new transfer resolved {ms:.0} ms after the fault (> {} ms)",
                            probe_bound.as_millis()
                        ));
                    }
                }
                Ok(Err(e)) => r.violations.push(format!("surviving pair: {e}")),
                Err(e) => r.violations.push(format!("surviving pair probe: {e}")),
            }
        }
        r
    }

    /// The control-channel port of every agent slot (from its etcd
    /// record's handshake).
    /// Waits (≤ lease TTL + 10 s from `t0`) until the four agents no longer
    /// list the dead joiner `name` (its pod deleted: the operator path);
    /// the time, or a violation.
    async fn joiner_forgotten(&self, name: &str, t0: Instant, r: &mut FaultResult) {
        let f = Forget {
            name: name.to_string(),
            observers: (0..4).map(|s| self.agent_http(s)).collect(),
            path: "operator",
        };
        r.forget_path = Some(f.path.into());
        r.forget_ms =
            Self::wait_forgotten(f, t0, Duration::from_secs(self.opts.lease_ttl_s + 10)).await;
        if r.forget_ms.is_none() {
            r.violations
                .push(format!("agents still list the dead joiner {name}"));
        }
    }

    /// [`FaultKind::DiesMidHandshake`]; the survivors' probe, started at
    /// the freeze.
    async fn dies_mid_handshake(
        self: Arc<Self>,
        gen: u64,
        rng: &mut Rng,
        r: &mut FaultResult,
    ) -> Option<tokio::task::JoinHandle<Result<f64, String>>> {
        let start_probe = |s: &Arc<Self>, t: Instant| {
            let s = s.clone();
            Some(tokio::spawn(
                async move { s.survivor_probe(vec![], t).await },
            ))
        };
        let pod = format!("agent-dh-g{gen}");
        let dpod = format!("decode-h-g{gen}");
        let kill_after = Duration::from_millis(rng.below(self.opts.request_timeout_ms));
        r.target = format!(
            "new agent {pod}, frozen before its first GRANT, killed {} ms later",
            kill_after.as_millis()
        );
        let (k, p2, d2) = (self.clone(), pod.clone(), dpod.clone());
        let uids = blocking(move || {
            let a = k.kube.create_pod(&p2, &[("app", FABRIC_LABEL)])?;
            let d = k.kube.create_pod(&d2, &[("role", "kvf-chaos-decode")])?;
            Ok::<_, String>((a, d))
        })
        .await;
        let delete_pods = |s: &Arc<Self>| {
            let (k, p2, d2) = (s.clone(), pod.clone(), dpod.clone());
            blocking(move || {
                let a = k.kube.delete_pod(&p2);
                let d = k.kube.delete_pod(&d2);
                a.and(d)
            })
        };
        let (auid, duid) = match uids {
            Ok(u) => u,
            Err(e) => {
                r.violations.push(format!("joiner pods: {e}"));
                return start_probe(&self, Instant::now());
            }
        };
        let (c, p2, ns) = (self.conf.clone(), pod.clone(), self.joiner_netns());
        let mut joiner = match blocking(move || {
            AgentProc::spawn(&c, &p2, &auid, Side::Decode, 0, 0, ns)
        })
        .await
        {
            Ok(j) => j,
            Err(e) => {
                r.violations.push(format!("joiner did not start: {e}"));
                let _ = delete_pods(&self).await;
                return start_probe(&self, Instant::now());
            }
        };
        let engine = format!("decode-h{gen}");
        let d = match self.attach_decode_at(&joiner.socket, &engine, &duid).await {
            Ok(d) => Arc::new(d),
            Err(e) => {
                r.violations
                    .push(format!("decode engine on the joiner: {e}"));
                joiner.proc.kill();
                let _ = delete_pods(&self).await;
                return start_probe(&self, Instant::now());
            }
        };
        // The metadata half: the joiner's record (with its engine) is in
        // etcd and both prefill agents have loaded it.
        let (etcd, fabric, jname) = (
            self.conf.etcd.clone(),
            self.conf.fabric.clone(),
            joiner.name.clone(),
        );
        let prefills = [self.agent_http(0), self.agent_http(1)];
        let e2 = engine.clone();
        let loaded = blocking(move || {
            let t0 = Instant::now();
            let quoted = format!("\"{jname}\"");
            while t0.elapsed() < Duration::from_secs(15) {
                let published = topo::agent_record(&etcd, &fabric, &jname)
                    .map(|v| v["engines"].to_string().contains(&e2))
                    .unwrap_or(false);
                let listed = prefills.iter().all(|a| {
                    topo::http_get(*a, "/v1/peers")
                        .map(|(_, b)| b.contains(&quoted))
                        .unwrap_or(false)
                });
                if published && listed {
                    return Some(ms(t0.elapsed()));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            None
        })
        .await;
        match loaded {
            Some(t) => r.notes.push(format!(
                "{} published with engine {engine} and loaded by both prefill agents {t:.0} ms after its engine attached",
                joiner.name
            )),
            None => r.violations.push(format!(
                "{} (engine {engine}) not published or not loaded by the prefill agents within 15 s",
                joiner.name
            )),
        }
        // Their records reach the prefill agents' engine lookup through the
        // same watch: a moment more.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t_f = Instant::now();
        topo::signal(joiner.proc.pid(), libc::SIGSTOP);
        let probe = start_probe(&self, t_f);
        // The credit half: hand-offs to its engine, whose WANTs it never
        // answers.
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..4 {
            let (s, p, d) = (
                self.clone(),
                lock_r(&self.prefill)[i % 2].clone(),
                d.clone(),
            );
            tasks.spawn(async move {
                let t0 = Instant::now();
                let (o, v) = s.hand_off(p, d, 8, false, None).await;
                (o, v, ms(t0.elapsed()))
            });
        }
        tokio::time::sleep(kill_after).await;
        joiner.proc.kill();
        let t_kill = Instant::now();
        if let Err(e) = delete_pods(&self).await {
            r.violations.push(format!("delete pods: {e}"));
        }
        let mut took = Vec::new();
        while let Some(j) = tasks.join_next().await {
            let Ok((o, v, t)) = j else {
                r.violations.push("a hand-off task panicked".into());
                continue;
            };
            if o.success > 0 {
                r.violations.push(format!(
                    "a hand-off to the frozen joiner's engine {engine} resolved SUCCESS"
                ));
            }
            if let Some(v) = v {
                r.violations.push(v);
            }
            r.outcomes.add(&o);
            took.push(t);
        }
        took.sort_by(f64::total_cmp);
        r.notes.push(format!(
            "{} hand-offs to {engine} resolved (outcomes above) after {:.0}..{:.0} ms (requestTimeout {} ms; killed {:.0} ms after the freeze)",
            took.len(),
            took.first().copied().unwrap_or(0.0),
            took.last().copied().unwrap_or(0.0),
            self.opts.request_timeout_ms,
            ms(t_kill - t_f)
        ));
        self.joiner_forgotten(&joiner.name, t_kill, r).await;
        drop(d);
        probe
    }

    async fn control_ports(self: &Arc<Self>) -> Result<Vec<u16>, String> {
        let names: Vec<String> = (0..4).map(|i| self.agent_name(i)).collect();
        let (etcd, fabric) = (self.conf.etcd.clone(), self.conf.fabric.clone());
        blocking(move || {
            names
                .iter()
                .map(|n| topo::control_port(&etcd, &fabric, n))
                .collect()
        })
        .await
    }

    /// Fills the request figures of a partition or loss round from the
    /// round's samples (every load request resolved by now).
    fn fill_window(&self, fr: &mut FaultResult) {
        let Some((t0, t1, victim)) = fr.window else {
            return;
        };
        let samples = lock(&self.samples).clone();
        let during = |s: &&Sample| s.submitted >= t0 && s.submitted < t1;
        if let Some(p) = fr.partition.as_mut() {
            let k = victim.unwrap_or(usize::MAX);
            let involves = |s: &Sample| {
                if k < 2 {
                    s.prefill.starts_with(&format!("prefill-{k}-"))
                } else {
                    s.decode == format!("decode-{}", k.wrapping_sub(2))
                }
            };
            let (mut fail_ms, mut fail_tx_ms) = (Vec::new(), Vec::new());
            for s in samples.iter().filter(during) {
                match (involves(s), s.success) {
                    (true, true) => {
                        p.victim_success += 1;
                        if s.submitted + Duration::from_secs_f64(s.ms / 1e3) < t1 {
                            p.victim_success_during_cut += 1;
                        }
                    }
                    (true, false) => {
                        p.victim_failure += 1;
                        fail_ms.push(s.ms);
                        fail_tx_ms.push(s.tx_ms);
                    }
                    (false, true) => p.others_success += 1,
                    (false, false) => p.others_failure += 1,
                }
            }
            p.victim_failure_ms = Latency::of(fail_ms);
            p.victim_failure_prefill_ms = Latency::of(fail_tx_ms);
        }
        if let Some(l) = fr.loss.as_mut() {
            // Before: submitted in the 1.5 s before the loss and resolved
            // before it (requests still in flight at the start are left
            // out of both sets).
            let before: Vec<&Sample> = samples
                .iter()
                .filter(|s| {
                    s.submitted + Duration::from_millis(1500) >= t0
                        && s.submitted + Duration::from_secs_f64(s.ms / 1e3) < t0
                })
                .collect();
            let dur: Vec<&Sample> = samples.iter().filter(during).collect();
            l.before = Latency::of(before.iter().filter(|s| s.success).map(|s| s.ms).collect());
            l.failures_before = before.iter().filter(|s| !s.success).count() as u64;
            l.during = Latency::of(dur.iter().filter(|s| s.success).map(|s| s.ms).collect());
            l.failures_during = dur.iter().filter(|s| !s.success).count() as u64;
        }
    }

    async fn sum_metric(self: &Arc<Self>, name: &'static str) -> f64 {
        let addrs: Vec<SocketAddr> = lock(&self.agents).iter().map(|a| a.agent.http).collect();
        blocking(move || {
            addrs
                .iter()
                .filter_map(|a| topo::http_get(*a, "/metrics").ok())
                .map(|(_, t)| topo::metric(&t, name, &[]))
                .sum()
        })
        .await
    }
}

/// `secs` since the Unix epoch as RFC 3339 UTC (`2026-12-01T17:00:00Z`).
fn format_rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil from days (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_of_known_instants() {
        assert_eq!(format_rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_rfc3339(1_795_000_000), "2026-11-18T11:06:40Z");
        assert_eq!(format_rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn schedule_cycles_every_kind_in_a_seeded_order() {
        let n = FaultKind::ALL.len();
        let s = schedule(&FaultKind::ALL, n + 1, 7);
        assert_eq!(s.len(), n + 1);
        for k in FaultKind::ALL {
            assert!(s[..n].contains(&k), "{k:?} missing from the first cycle");
        }
        assert_eq!(s, schedule(&FaultKind::ALL, n + 1, 7));
        assert_ne!(s, schedule(&FaultKind::ALL, n + 1, 8));
        for k in FaultKind::ALL {
            assert_eq!(FaultKind::parse(k.name()), Some(k));
        }
    }

    #[test]
    fn alloc_holds_failed_blocks_until_released() {
        let mut a = Alloc::new(4);
        let x = a.take(3).unwrap();
        assert!(a.take(2).is_none());
        a.hold(x);
        assert!(a.take(2).is_none());
        a.release_held();
        assert_eq!(a.take(4).map(|v| v.len()), Some(4));
    }
}
