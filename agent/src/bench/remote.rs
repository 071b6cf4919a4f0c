//! Distributed mode of `kvfabric bench`: the bench drives two `kvfabric
//! agent` daemons through their engine API (gRPC on each agent's Unix
//! socket, `kvfabric agent --engine-socket PATH`), as serving engines do.
//! It needs neither etcd nor the agents' `--debug-api`.
//!
//! 1. [`BenchEngines::attach`] connects to both sockets (waiting at most
//!    `--wait` for them), creates one POSIX shm KV pool per side in this
//!    process (sized for the slice like embedded mode's pools), and
//!    attaches one engine per side — `bench-prefill-<pid>` to the prefill
//!    agent, `bench-decode-<pid>` to the decode agent — with the layout of
//!    the bench's model geometry ([`engine_layout`]), registering its pool.
//!    The bench process is the bench engine of both sides: it holds both
//!    sessions on one tokio runtime ([`Driver`]) and maps both pools.
//! 2. The replay ([`super::trace::replay_with`]) allocates blocks over the
//!    two pools as mapped here ([`super::trace::BlockPool`]; the pool
//!    layout of the engine API is the bench's tensor-major layout) and
//!    hands each request to [`BenchEngines`]: it fills the request's
//!    source blocks with the bench pattern, asks the prefill agent for the
//!    hand-off by block id (`Transfer`, the path forced to bounce or
//!    standard, the engine request id = the request's seed), awaits the
//!    arrival on the decode session (`AwaitArrival`) and checks every
//!    destination byte in its own mapping of the decode pool. The latency
//!    is the prefill agent's own: `submit_us + transfer_us` of its answer
//!    (call received → resolved; the standard path does its NIXL prepare
//!    and post inside the submit, so `transfer_us` alone would miss them).
//! 3. Before each phase, a one-block probe hand-off, retried for at most
//!    `--wait`, waits until the prefill agent resolves the decode engine
//!    (its record reaches the prefill agent through discovery) and the
//!    path is up (for bounce: the peer's handshake).
//!
//! The agents' etcd records and their HTTP API, as tests and tools read
//! them ([`lookup_agents`], [`RemoteAgent`], [`http_json`]), are here too.
//! HTTP is spoken with a minimal HTTP/1.0 client ([`http_json`]: one
//! request per connection, read to EOF), so there is no HTTP client
//! dependency.

use std::future::Future;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, GetOptions};
use kvfabric_client::{pb, ClientError, Session, ShmPool};
use kvfabric_core::model::KvLayout;
use serde_json::Value;

use super::pattern::{check_fast, fill_fast};
use super::trace::{BenchPath, HandOff, HandOffResult, RequestBlocks};
use crate::core::Descriptor;
use crate::service::discovery::etcd::agents_prefix;
use crate::service::discovery::{AgentRecord, BufferRegion};

/// Bound on connecting to an agent's HTTP API.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on an ordinary (non-transfer) HTTP call.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on one etcd read.
const ETCD_TIMEOUT: Duration = Duration::from_secs(5);

/// Bound on one hand-off (the `Transfer`'s `timeout_ms`), as embedded
/// mode's: 300 s.
const XFER_TIMEOUT_MS: u32 = 300_000;
/// Bound on a probe hand-off (one block) before a phase.
const PROBE_TIMEOUT_MS: u32 = 10_000;
/// Bound on `AwaitArrival` once the transfer has resolved.
const ARRIVAL_WAIT: Duration = Duration::from_secs(60);
/// Bound on the probe's `AwaitArrival` (retried until `--wait`).
const PROBE_ARRIVAL_WAIT: Duration = Duration::from_secs(2);
/// Engine request ids of the probe hand-offs: `PROBE_IDS + n`, apart from
/// the requests' (their seeds, below 2^48).
const PROBE_IDS: u64 = 1 << 63;

/// The engine-API layout of a bench pool of `num_blocks` blocks of
/// `layout` (TP rank 0 of `layout.tp`, host memory).
///
/// The engine API's pool is layer-major, `((layer × planes + plane) ×
/// num_blocks + block) × block_bytes` — the bench pool's tensor-major
/// layout (tensor = layer × planes + plane) with `block_bytes` = the
/// bench's descriptor bytes, so a block id means the same bytes to the
/// bench and to the agent. Two spellings make the byte counts agree where
/// the engine API has no word for the bench's geometry:
/// * K and V in one tensor (`--no-kv-split`, one descriptor of K+V per
///   layer and block): one plane of twice this rank's KV heads;
/// * a `dtype_bytes` other than 1 (`fp8`), 2 (`bf16`) or 4 (`fp32`):
///   `u8` elements with `head_dim × dtype_bytes` per head.
///
/// Both sides use the same layout, so whole blocks move either way.
///
/// # Errors
/// A field that overflows `u32` in those spellings.
pub fn engine_layout(layout: &KvLayout, num_blocks: u32) -> Result<pb::KvLayout, String> {
    let m = &layout.model;
    let (dtype, head_dim) = match m.dtype_bytes {
        1 => ("fp8", Some(m.head_dim)),
        2 => ("bf16", Some(m.head_dim)),
        4 => ("fp32", Some(m.head_dim)),
        n => ("u8", m.head_dim.checked_mul(n)),
    };
    let head_dim = head_dim.ok_or_else(|| {
        format!(
            "geometry of {}: head_dim {} x dtype_bytes {} overflows the engine API's head_dim",
            m.name, m.head_dim, m.dtype_bytes
        )
    })?;
    let rank_heads = m.kv_heads / layout.tp;
    let kv_heads = if layout.kv_split {
        Some(rank_heads)
    } else {
        rank_heads.checked_mul(2)
    }
    .ok_or_else(|| format!("geometry of {}: too many KV heads", m.name))?;
    Ok(pb::KvLayout {
        layers: m.layers,
        num_blocks,
        block_bytes: layout.descriptor_bytes(),
        kv_split: layout.kv_split,
        dtype: dtype.into(),
        tp_rank: 0,
        tp_size: layout.tp,
        block_tokens: layout.block_tokens,
        kv_heads,
        head_dim,
        device: -1,
        device_uuid: String::new(),
    })
}

/// Bytes free for new shm objects (`/dev/shm`), if known: more than that
/// in shm pools faults (SIGBUS) when the pages are first written.
pub fn shm_available() -> Option<u64> {
    let path = std::ffi::CString::new("/dev/shm").ok()?;
    // SAFETY: statvfs(3) on a NUL-terminated path into a zeroed struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// A current-thread tokio runtime driven by a thread of its own: the bench
/// engines' sessions live on it (their Attach streams, the gRPC
/// connections) while the replay's worker threads hand it calls
/// ([`Driver::run`]).
pub struct Driver {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Driver {
    /// Starts the runtime and its thread.
    ///
    /// # Errors
    /// When the runtime or the thread cannot be created.
    pub fn start() -> Result<Self, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("tokio runtime: {e}"))?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("bench-engines".into())
            .spawn(move || {
                let _ = rt.block_on(stopped);
            })
            .map_err(|e| format!("bench engine thread: {e}"))?;
        Ok(Self {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Runs `f` on the runtime and waits for its output (call from any
    /// thread but the runtime's own).
    ///
    /// # Errors
    /// When the runtime stopped before `f` finished.
    pub fn run<T, F>(&self, f: F) -> Result<T, String>
    where
        F: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let _ = tx.send(f.await);
        });
        rx.recv()
            .map_err(|_| "the bench engines' runtime stopped".to_string())
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Where the bench engines attach (distributed mode).
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// The prefill agent's engine socket (`--prefill-socket`).
    pub prefill_socket: PathBuf,
    /// The decode agent's engine socket (`--decode-socket`).
    pub decode_socket: PathBuf,
    /// Bound on waiting for the sockets, and before each phase for the
    /// decode engine to be reachable from the prefill agent (`--wait`).
    pub wait: Duration,
}

/// One side's bench engine: its session and its pool as mapped here.
struct Side {
    session: Option<Arc<Session>>,
    engine_id: String,
    agent: String,
    base: u64,
    pool: ShmPool,
}

impl Side {
    /// Connects to `socket` (waiting until `deadline`), creates the shm
    /// pool, attaches engine `bench-<role>-<pid>` with `layout` and
    /// registers the pool. `flag` names the socket's option in errors.
    fn attach(
        driver: &Driver,
        flag: &str,
        socket: &Path,
        role: pb::Role,
        layout: &pb::KvLayout,
        deadline: Instant,
    ) -> Result<Self, String> {
        let name = match role {
            pb::Role::Decode => "decode",
            _ => "prefill",
        };
        let pid = std::process::id();
        let engine_id = format!("bench-{name}-{pid}");
        let mut pool = ShmPool::create(
            &format!("/kvfabric-bench-{pid}-{name}"),
            kvfabric_client::pool_bytes(layout),
        )
        .map_err(|e| format!("{name} KV pool: {e}"))?;
        let base = pool.as_mut_slice().as_mut_ptr() as u64;
        let (sock, id, l) = (socket.to_path_buf(), engine_id.clone(), layout.clone());
        let attached = driver.run(async move {
            let client = loop {
                match kvfabric_client::Client::connect(&sock).await {
                    Ok(c) => break c,
                    Err(e) if Instant::now() >= deadline => return (Err(e), pool),
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            };
            let s = match client.attach(&id, "", role, l).await {
                Ok(s) => s,
                Err(e) => return (Err(e), pool),
            };
            let r = s.register_shm(&pool).await.map(|_| s);
            (r, pool)
        })?;
        let (session, pool) = attached;
        let session = session.map_err(|e| format!("{flag} {}: {e}", socket.display()))?;
        Ok(Self {
            agent: session.agent().to_string(),
            session: Some(Arc::new(session)),
            engine_id,
            base,
            pool,
        })
    }

    fn session(&self) -> Result<Arc<Session>, String> {
        self.session
            .clone()
            .ok_or_else(|| format!("engine {} is detached", self.engine_id))
    }
}

/// The bench engines of distributed mode, one per side, held by this
/// process; the [`HandOff`] of the distributed replay.
pub struct BenchEngines {
    prefill: Side,
    decode: Side,
    wait: Duration,
    probes: AtomicU64,
    // Last: the sessions (in the sides) go before the runtime stops.
    driver: Driver,
}

/// The engine API's path for a bench path.
fn pb_path(path: BenchPath) -> pb::Path {
    match path {
        BenchPath::Bounce => pb::Path::Bounce,
        BenchPath::Standard => pb::Path::Standard,
        BenchPath::Auto => pb::Path::Auto,
    }
}

/// The name an agent reports a path under (`TransferResponse.path`).
fn path_name(path: BenchPath) -> &'static str {
    match path {
        BenchPath::Bounce => "bounce",
        BenchPath::Standard => "standard",
        BenchPath::Auto => "auto",
    }
}

fn outcome_name(o: pb::Outcome) -> &'static str {
    match o {
        pb::Outcome::Success => "success",
        pb::Outcome::Failure => "failure",
        pb::Outcome::Timeout => "timeout",
        pb::Outcome::Cancelled => "cancelled",
        pb::Outcome::Unspecified => "unspecified outcome",
    }
}

impl BenchEngines {
    /// Attaches the two bench engines (see the module docs) with pools of
    /// `num_blocks` blocks of `layout`.
    ///
    /// # Errors
    /// A socket that does not answer within `opts.wait`, a refused attach
    /// or pool (the agent's reason), both sockets reaching the same agent.
    pub fn attach(
        opts: &EngineOptions,
        layout: &KvLayout,
        num_blocks: u32,
    ) -> Result<Self, String> {
        let l = engine_layout(layout, num_blocks)?;
        let driver = Driver::start()?;
        let deadline = Instant::now() + opts.wait;
        let prefill = Side::attach(
            &driver,
            "--prefill-socket",
            &opts.prefill_socket,
            pb::Role::Prefill,
            &l,
            deadline,
        )?;
        let decode = Side::attach(
            &driver,
            "--decode-socket",
            &opts.decode_socket,
            pb::Role::Decode,
            &l,
            deadline,
        )?;
        let engines = Self {
            prefill,
            decode,
            wait: opts.wait,
            probes: AtomicU64::new(0),
            driver,
        };
        if engines.prefill.agent == engines.decode.agent {
            let agent = engines.prefill.agent.clone();
            let _ = engines.close();
            return Err(format!(
                "--prefill-socket and --decode-socket reach the same agent ({agent}): its hand-offs would be same-agent copies, not bounce or the standard path; give the sockets of two agents"
            ));
        }
        Ok(engines)
    }

    /// Base address of the prefill pool in this process.
    pub fn prefill_base(&self) -> u64 {
        self.prefill.base
    }

    /// Base address of the decode pool in this process.
    pub fn decode_base(&self) -> u64 {
        self.decode.base
    }

    /// (engine id, agent name) of the prefill side.
    pub fn prefill(&self) -> (&str, &str) {
        (&self.prefill.engine_id, &self.prefill.agent)
    }

    /// (engine id, agent name) of the decode side.
    pub fn decode(&self) -> (&str, &str) {
        (&self.decode.engine_id, &self.decode.agent)
    }

    /// Bytes of each side's shm pool.
    pub fn pool_bytes(&self) -> u64 {
        self.prefill.pool.len() as u64
    }

    /// Detaches both engines (the agents release the pools) and removes the
    /// shm objects.
    ///
    /// # Errors
    /// The first detach that failed (both are tried).
    pub fn close(mut self) -> Result<(), String> {
        let mut first = None;
        for side in [&mut self.prefill, &mut self.decode] {
            let Some(s) = side.session.take() else {
                continue;
            };
            // Calls hand their clone back before they answer
            // (`transfer`, `await_arrival`), so this is the last one.
            match Arc::try_unwrap(s) {
                Ok(s) => {
                    let id = side.engine_id.clone();
                    if let Err(e) = self
                        .driver
                        .run(s.detach())
                        .and_then(|r| r.map_err(|e| e.to_string()))
                    {
                        first.get_or_insert(format!("detaching engine {id}: {e}"));
                    }
                }
                // Still shared: dropping it ends its Attach stream, which
                // the agent takes as a detach.
                Err(s) => drop(s),
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// `Transfer` of `src` → `dst` through `path` on the prefill session.
    fn transfer(
        &self,
        request_id: u64,
        path: BenchPath,
        src: &[u32],
        dst: &[u32],
        timeout_ms: u32,
    ) -> Result<Result<pb::TransferResponse, ClientError>, String> {
        let s = self.prefill.session()?;
        let req = pb::TransferRequest {
            request_id,
            dst_engine: self.decode.engine_id.clone(),
            src_blocks: src.to_vec(),
            dst_blocks: dst.to_vec(),
            path: pb_path(path) as i32,
            timeout_ms,
            ..Default::default()
        };
        self.driver.run(async move {
            let r = s.transfer(req).await;
            drop(s);
            r
        })
    }

    /// `AwaitArrival` of `request_id` from the prefill engine on the
    /// decode session.
    fn await_arrival(
        &self,
        request_id: u64,
        within: Duration,
    ) -> Result<pb::AwaitArrivalResponse, String> {
        let s = self.decode.session()?;
        let src = self.prefill.engine_id.clone();
        self.driver
            .run(async move {
                let r = s.await_arrival(request_id, &src, within).await;
                drop(s);
                r
            })?
            .map_err(|e| format!("await arrival: {e}"))
    }

    /// What the agents said about one hand-off: `Ok` with the latency in
    /// ms once every byte of `descs` verified.
    fn transfer_and_verify(
        &self,
        path: BenchPath,
        request_id: u64,
        seed: u64,
        blocks: RequestBlocks<'_>,
        descs: &[Descriptor],
    ) -> Result<f64, String> {
        let r = self
            .transfer(request_id, path, blocks.src, blocks.dst, XFER_TIMEOUT_MS)?
            .map_err(|e| format!("transfer: {e}"))?;
        if r.outcome() != pb::Outcome::Success {
            return Err(format!(
                "transfer {}: {}",
                outcome_name(r.outcome()),
                r.reason
            ));
        }
        if path != BenchPath::Auto && r.path != path_name(path) {
            return Err(format!(
                "the agent moved the request through {:?}, not {}",
                r.path,
                path_name(path)
            ));
        }
        let want: u64 = descs.iter().map(|d| d.len).sum();
        let a = self.await_arrival(request_id, ARRIVAL_WAIT)?;
        if a.outcome() != pb::Outcome::Success {
            return Err(format!(
                "arrival {}: {}",
                outcome_name(a.outcome()),
                a.reason
            ));
        }
        if r.bytes != want || a.bytes != want {
            return Err(format!(
                "the agents moved {} bytes (arrival: {}), the request holds {want}",
                r.bytes, a.bytes
            ));
        }
        descs
            .iter()
            .enumerate()
            // SAFETY: dst lies in the decode pool's blocks the caller holds;
            // the pool stays mapped while `self` lives.
            .find_map(|(k, d)| {
                unsafe { check_fast(d.dst, d.len, seed, k as u64) }
                    .err()
                    .map(|off| (k, off))
            })
            // The agent's latency, call received → resolved: `submit_us`
            // counts too, since the standard path posts the whole write
            // inside its submit (NIXL prepare + post), which `transfer_us`
            // (submitted → resolved) alone would leave out.
            .map_or(
                Ok((r.submit_us + r.transfer_us) as f64 / 1e3),
                |(k, off)| Err(format!("verification failed: descriptor {k}, byte {off}")),
            )
    }
}

impl HandOff for BenchEngines {
    /// A one-block probe hand-off (block 0 → block 0) through `path`,
    /// retried for at most `--wait` while the decode engine is not yet
    /// resolvable or the path not yet up; its arrival is awaited too.
    fn check_path(&self, path: BenchPath) -> Result<(), String> {
        let deadline = Instant::now() + self.wait;
        let mut announced = false;
        let what = format!(
            "a {} hand-off from engine {} (agent {}) to engine {} (agent {})",
            path_name(path),
            self.prefill.engine_id,
            self.prefill.agent,
            self.decode.engine_id,
            self.decode.agent
        );
        loop {
            let rid = PROBE_IDS + self.probes.fetch_add(1, Ordering::Relaxed);
            let why = match self.transfer(rid, path, &[0], &[0], PROBE_TIMEOUT_MS)? {
                Ok(r) if r.outcome() == pb::Outcome::Success => {
                    // AUTO: the agent's routing gate picks either path.
                    if path != BenchPath::Auto && r.path != path_name(path) {
                        return Err(format!("{what}: the agent moved it through {:?}", r.path));
                    }
                    let a = self.await_arrival(rid, PROBE_ARRIVAL_WAIT)?;
                    if a.outcome() == pb::Outcome::Success {
                        return Ok(());
                    }
                    // Arrival notices travel over the agents' bounce
                    // control channel (not up yet, or not running).
                    format!(
                        "the transfer succeeded but the decode engine saw no arrival ({}: {})",
                        outcome_name(a.outcome()),
                        a.reason
                    )
                }
                Ok(r) => format!("{}: {}", outcome_name(r.outcome()), r.reason),
                // NotFound: the decode engine's record has not reached the
                // prefill agent yet; FailedPrecondition: the peer is not
                // loaded / bounce-compatible yet.
                Err(e)
                    if matches!(
                        e.code(),
                        Some(
                            tonic::Code::NotFound
                                | tonic::Code::FailedPrecondition
                                | tonic::Code::Unavailable
                        )
                    ) || matches!(e, ClientError::Timeout { .. }) =>
                {
                    e.to_string()
                }
                Err(e) => return Err(format!("{what}: {e}")),
            };
            if Instant::now() >= deadline {
                let hint = if why.contains("bounce") || why.contains("no arrival") {
                    " (bounce must run on both agents, bounce-compatible: it carries the bounce path and the arrival notices; start them with KVFABRIC_BOUNCE_ENABLE=1 and the same KVFABRIC_BOUNCE_* settings; the prefill agent's /v1/peers gives the reason)"
                } else {
                    ""
                };
                return Err(format!(
                    "{what} still fails after --wait {}s: {why}{hint}",
                    self.wait.as_secs()
                ));
            }
            if !announced {
                eprintln!(
                    "waiting (at most --wait {}s) for {what}: {why}",
                    self.wait.as_secs()
                );
                announced = true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn sender(&self) -> String {
        self.prefill.engine_id.clone()
    }

    fn request_id_key(&self) -> &'static str {
        "request"
    }

    /// Fills the sources, hands the blocks off by id (engine request id =
    /// `seed`), awaits the arrival and verifies every destination byte.
    fn hand_off(
        &self,
        path: BenchPath,
        seed: u64,
        blocks: RequestBlocks<'_>,
        descs: Vec<Descriptor>,
    ) -> HandOffResult {
        // The prefill engine "computes" this request's KV: its own pattern.
        for (k, d) in descs.iter().enumerate() {
            // SAFETY: src lies in the prefill pool's blocks the caller
            // holds; the pool stays mapped while `self` lives.
            unsafe { fill_fast(d.src, d.len, seed, k as u64) };
        }
        HandOffResult {
            request_id: Some(seed),
            outcome: self.transfer_and_verify(path, seed, seed, blocks, &descs),
        }
    }
}

// ---------------------------------------------------------------------------
// The agents' etcd records and HTTP API, as tests and tools read them.

/// Sends one HTTP/1.0 request to `base` (`http://host:port`) and parses the
/// JSON answer; `timeout` bounds each read and write.
///
/// # Errors
/// Connection, IO or protocol errors, or a body that is not JSON.
pub fn http_json(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<(u16, Value), String> {
    let hostport = base
        .strip_prefix("http://")
        .ok_or_else(|| format!("{base}: only http:// URLs are supported"))?
        .trim_end_matches('/');
    let addr = hostport
        .to_socket_addrs()
        .map_err(|e| format!("{base}: {e}"))?
        .next()
        .ok_or_else(|| format!("{base}: no address"))?;
    let url = format!("{base}{path}");
    let mut s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|e| format!("{method} {url}: connect: {e}"))?;
    s.set_read_timeout(Some(timeout))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .map_err(|e| format!("{method} {url}: {e}"))?;
    let body = body.unwrap_or("");
    let head = format!(
        "{method} {path} HTTP/1.0\r\nHost: {hostport}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())
        .and_then(|()| s.write_all(body.as_bytes()))
        .map_err(|e| format!("{method} {url}: send: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|e| format!("{method} {url}: read: {e}"))?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("{method} {url}: truncated response"))?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| format!("{method} {url}: bad status line in {head:?}"))?;
    if head
        .lines()
        .any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding:"))
    {
        return Err(format!(
            "{method} {url}: chunked responses are not supported"
        ));
    }
    let body = &raw[split + 4..];
    let v = serde_json::from_slice(body).map_err(|e| {
        format!(
            "{method} {url}: HTTP {status}, body is not JSON ({e}): {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        )
    })?;
    Ok((status, v))
}

/// Reads every valid record under the fabric's prefix (one bounded etcd
/// read).
///
/// # Errors
/// When etcd cannot be reached or read within the bound.
pub fn read_records(endpoints: &[String], fabric: &str) -> Result<Vec<AgentRecord>, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let prefix = agents_prefix(fabric);
    rt.block_on(async {
        tokio::time::timeout(ETCD_TIMEOUT, async {
            let mut c = Client::connect(
                endpoints,
                Some(ConnectOptions::new().with_connect_timeout(ETCD_TIMEOUT)),
            )
            .await?;
            c.get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
                .await
        })
        .await
        .map_err(|_| format!("etcd {endpoints:?}: no answer within {ETCD_TIMEOUT:?}"))?
        .map_err(|e| format!("etcd {endpoints:?}: {e}"))
    })
    .map(|resp| {
        resp.kvs()
            .iter()
            .filter_map(|kv| match AgentRecord::decode(kv.value()) {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::warn!(key = %String::from_utf8_lossy(kv.key()), error = %e, "skipping an unreadable agent record");
                    None
                }
            })
            .collect()
    })
}

/// The live (newest) record of each of `logical_ids` in `fabric`, waiting
/// at most `wait` for all of them to be published (etcd errors are retried
/// until then).
///
/// # Errors
/// The ids still missing (and the last etcd error) when `wait` runs out.
pub fn lookup_agents(
    endpoints: &[String],
    fabric: &str,
    logical_ids: &[&str],
    wait: Duration,
) -> Result<Vec<AgentRecord>, String> {
    let deadline = Instant::now() + wait;
    loop {
        let (found, why) = match read_records(endpoints, fabric) {
            Ok(records) => {
                let found: Vec<Option<AgentRecord>> = logical_ids
                    .iter()
                    .map(|id| {
                        records
                            .iter()
                            .filter(|r| r.logical_id == *id)
                            .cloned()
                            .reduce(|a, b| if b.newer_than(&a) { b } else { a })
                    })
                    .collect();
                let missing: Vec<&str> = logical_ids
                    .iter()
                    .zip(&found)
                    .filter(|(_, r)| r.is_none())
                    .map(|(id, _)| *id)
                    .collect();
                let seen: Vec<&str> = records.iter().map(|r| r.logical_id.as_str()).collect();
                (
                    found,
                    format!(
                        "agents {missing:?} not registered under {} (registered: {seen:?})",
                        agents_prefix(fabric)
                    ),
                )
            }
            Err(e) => (vec![None], e),
        };
        if found.iter().all(Option::is_some) && found.len() == logical_ids.len() {
            return Ok(found.into_iter().flatten().collect());
        }
        if Instant::now() >= deadline {
            return Err(format!("after {wait:?}: {why}"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// An agent daemon as its etcd record shows it: its record, HTTP URL and
/// KV pool.
#[derive(Clone, Debug)]
pub struct RemoteAgent {
    /// The record it published.
    pub record: AgentRecord,
    /// The KV pool it published (label `kv`, else its first buffer).
    pub pool: BufferRegion,
}

impl RemoteAgent {
    /// From a published record.
    ///
    /// # Errors
    /// When the record carries no HTTP URL or no buffer.
    pub fn from_record(record: AgentRecord) -> Result<Self, String> {
        if record.http.is_empty() {
            return Err(format!(
                "agent {} publishes no HTTP address (an older kvfabric agent?)",
                record.name
            ));
        }
        let pool = record
            .buffers
            .iter()
            .find(|b| b.label == "kv")
            .or_else(|| record.buffers.first())
            .cloned()
            .ok_or_else(|| format!("agent {} publishes no KV pool buffer", record.name))?;
        Ok(Self { record, pool })
    }

    /// The agent's NIXL name (incarnation included).
    pub fn name(&self) -> &str {
        &self.record.name
    }

    /// `GET path` → (status, JSON).
    ///
    /// # Errors
    /// As [`http_json`].
    pub fn get(&self, path: &str) -> Result<(u16, Value), String> {
        http_json(&self.record.http, "GET", path, None, CALL_TIMEOUT)
    }

    /// `POST path` with a JSON `body` → (status, JSON).
    ///
    /// # Errors
    /// As [`http_json`].
    pub fn post(&self, path: &str, body: &str, timeout: Duration) -> Result<(u16, Value), String> {
        http_json(&self.record.http, "POST", path, Some(body), timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfabric_core::layout::EngineLayout;
    use kvfabric_core::model::{preset, presets, ModelGeometry};

    fn core_layout(l: &pb::KvLayout) -> EngineLayout {
        crate::service::engines::layout_of(l)
    }

    /// For every preset, TP and K/V split (and odd element sizes), the
    /// engine layout is valid for the agent and addresses every (tensor,
    /// block) where the bench's block pool does.
    #[test]
    fn engine_layout_matches_the_bench_pool_byte_for_byte() {
        let mut models = presets();
        for dtype_bytes in [1, 3, 4, 8] {
            models.push(ModelGeometry {
                name: format!("odd{dtype_bytes}"),
                dtype_bytes,
                ..preset("Qwen2.5-7B").unwrap()
            });
        }
        for m in models {
            for tp in [1, 2, 4] {
                for split in [true, false] {
                    let layout = KvLayout::new(m.clone(), 16, tp, split).unwrap();
                    let blocks = 37;
                    let pl = engine_layout(&layout, blocks).unwrap();
                    let el = core_layout(&pl);
                    el.validate()
                        .unwrap_or_else(|e| panic!("{} tp {tp} split {split}: {e}", m.name));
                    assert_eq!(
                        kvfabric_client::pool_bytes(&pl),
                        super::super::trace::BlockPool::bytes_for(&layout, blocks)
                    );
                    let bench = super::super::trace::BlockPool::new(&layout, blocks, 4096, 1);
                    let planes = layout.tensors_per_layer();
                    for layer in [0, m.layers - 1] {
                        for plane in 0..planes {
                            for b in [0, 5, blocks - 1] {
                                assert_eq!(
                                    4096 + el.block_offset(layer, u64::from(plane), b),
                                    bench.addr(layer * planes + plane, b)
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
