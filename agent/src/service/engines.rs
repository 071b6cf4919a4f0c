//! The engines' local API (issue 12): serving engines (one per prefill or
//! decode pod) attach their paged KV pools to the agent on their node over
//! gRPC on a Unix socket (`agent/proto/kvfabric/v1/engine.proto`) and ask
//! for hand-offs by block id.
//!
//! * [`EngineHub`] holds the sessions: engine id, pod UID, role, layout,
//!   the mapped pool, the requests in flight. Sessions are tenants: a
//!   session reads only its own pool as a source and writes another
//!   engine's pool only as the named destination of its own transfer,
//!   inside that engine's published layout.
//! * A session lives as long as its Attach stream: the client dropping it
//!   (process exit, crash) ends the session at once (the stream's receiver
//!   goes away). Its requests are cancelled, it is withdrawn from the
//!   agent's discovery record, and its pool is unregistered and unmapped
//!   only once no scatter writes into it and no transfer reads it
//!   (seed 004, "freed while read").
//! * Hand-offs resolve through the destination engine's record: on this
//!   agent (a local copy between the two mapped pools), or on a peer agent
//!   found in discovery (bounce or the standard path through
//!   [`FabricAgent::submit_write`]). When the sender's transfer resolves it
//!   sends the destination agent a NOTICE ([`NOTICE_TOPIC_ARRIVAL`]) —
//!   after the last ACK, so after the last byte was scattered — which
//!   resolves the decode engine's `AwaitArrival`.
//!
//! Host pools are named POSIX shm objects mapped by the agent. CUDA IPC
//! pools are answered `Unimplemented` by this build (see
//! docs/architecture.md, "Engines").

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvfabric_client::pb;
use kvfabric_client::pb::engine_api_server::{EngineApi, EngineApiServer};
use kvfabric_core::layout::{
    block_descriptors, check_block_pairs, extent_descriptors, head_map, EngineLayout,
};
use kvfabric_core::text::LogSafe;
use kvfabric_core::wire::{Notice, NOTICE_TOPIC_ARRIVAL};
use kvfabric_core::Descriptor;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, Notify};
use tonic::{Request, Response, Status};

use super::discovery::{Discovery, EngineRecord};
use super::traces::{Traces, TransferTrace};
use crate::runtime::engine::{MemDesc, MemKind};
use crate::runtime::fabric::{FabricAgent, PathKind};
use crate::runtime::transport::{TransferHandle, TransferOutcome};

/// How long an arrival is kept for an `AwaitArrival` that has not come yet.
pub const ARRIVAL_TTL: Duration = Duration::from_secs(300);

/// Most arrivals kept waiting for their `AwaitArrival` (oldest dropped).
pub const MAX_PENDING_ARRIVALS: usize = 65_536;

/// Period of the Attach stream's heartbeat events.
pub const HEARTBEAT: Duration = Duration::from_secs(5);

/// Longest engine id accepted (bytes): it is a key in records and logs.
pub const MAX_ENGINE_ID_LEN: usize = 128;

/// Most block ids (or extents) one `Transfer` may name.
pub const MAX_BLOCKS_PER_TRANSFER: usize = 1 << 20;

/// The arrival NOTICE payload (JSON), sender agent → destination agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrivalNotice {
    /// The source engine.
    pub src_engine: String,
    /// The destination engine (attached to the receiving agent).
    pub dst_engine: String,
    /// The source engine's request id.
    pub request_id: u64,
    /// Payload bytes moved.
    pub bytes: u64,
    /// `success` or `failure`.
    pub outcome: String,
    /// Why, for a failure.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// W3C trace context of the sender's `kvfabric.transfer` span (traced
    /// hand-offs only): the receiver's `kvfabric.arrival` span is its child.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub traceparent: String,
}

/// A pool mapped into the agent: registered with NIXL and allowed as a
/// scatter destination while the owning session lives; unregistered and
/// unmapped when the last user (session, transfer) lets go.
struct MappedPool {
    addr: u64,
    len: u64,
    agent: Weak<FabricAgent>,
    /// A GPU pool: the CUDA IPC mapping (closed on drop); `None` = a host
    /// shm mapping registered with NIXL.
    #[cfg(feature = "cuda")]
    ipc: Option<crate::runtime::cuda::IpcMapping>,
    /// SIGBUS guard of a shm mapping (see [`crate::service::shm_guard`]):
    /// reports an engine truncating its object under the agent.
    guard: Option<Arc<crate::service::shm_guard::Guard>>,
}

impl MappedPool {
    /// Wraps a mapping (counted in [`POOL_BYTES`] until dropped).
    fn new(
        addr: u64,
        len: u64,
        agent: Weak<FabricAgent>,
        #[cfg(feature = "cuda")] ipc: Option<crate::runtime::cuda::IpcMapping>,
    ) -> Self {
        POOL_BYTES.fetch_add(len, Ordering::Relaxed);
        Self {
            addr,
            len,
            agent,
            #[cfg(feature = "cuda")]
            ipc,
            guard: None,
        }
    }

    /// Whether the engine truncated its shm object under the mapping
    /// (bytes copied from or into the pool since are not the engine's).
    fn truncated(&self) -> bool {
        self.guard.as_ref().is_some_and(|g| g.truncated())
    }

    fn kind(&self) -> MemKind {
        #[cfg(feature = "cuda")]
        if self.ipc.is_some() {
            return MemKind::Vram;
        }
        MemKind::Dram
    }
}

impl Drop for MappedPool {
    fn drop(&mut self) {
        POOL_BYTES.fetch_sub(self.len, Ordering::Relaxed);
        #[cfg(feature = "cuda")]
        if let Some(ipc) = self.ipc.take() {
            // Closes the CUDA IPC mapping (never registered with NIXL).
            drop(ipc);
            tracing::info!(
                addr = self.addr,
                bytes = self.len,
                "engine pool released (CUDA IPC mapping closed)"
            );
            return;
        }
        if let Some(a) = self.agent.upgrade() {
            a.engine().deregister_region(self.addr);
        }
        // SAFETY: `addr`/`len` is the mapping made in `map_shm`; nothing
        // uses it any more (this is the last reference, and scatters into
        // it were drained by `disallow_scatter_range` before the session
        // let go).
        unsafe {
            libc::munmap(self.addr as *mut libc::c_void, self.len as usize);
        }
        // Unguarded only once unmapped (a fault before that is still ours).
        drop(self.guard.take());
        tracing::info!(
            addr = self.addr,
            bytes = self.len,
            "engine pool released (NIXL registration dropped, unmapped)"
        );
    }
}

/// Maps shm object `name` (read-write, `len` bytes from offset 0).
/// The process on the other end of an engine API call, from the Unix
/// socket's SO_PEERCRED (kernel-provided, not claimed by the client).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller {
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
    /// Process id in the agent's pid namespace (`None` when the kernel
    /// did not report one, e.g. a pid namespace the agent cannot see).
    pub pid: Option<i32>,
}

/// The caller of `req` (`None` when the call did not come over a Unix
/// socket with credentials, e.g. an in-process test transport).
fn caller_of<T>(req: &Request<T>) -> Option<Caller> {
    req.extensions()
        .get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|i| i.peer_cred)
        .map(|c| Caller {
            uid: c.uid(),
            gid: c.gid(),
            pid: c.pid().filter(|&p| p > 0),
        })
}

/// Maps the POSIX shm object `name` (`len` bytes) read-write. When `owner`
/// is given (the calling engine's uid, not root), the object must be a
/// regular file owned by that uid: an engine registers only memory it owns,
/// never another engine's pool by name.
fn map_shm(name: &str, len: u64, owner: Option<u32>) -> Result<u64, String> {
    if !name.starts_with('/') || name.len() < 2 || name.len() > 251 || name[1..].contains('/') {
        return Err(format!(
            "shm name {:?}: want \"/name\" (1-250 characters, no other '/')",
            LogSafe(name)
        ));
    }
    let len_usize = usize::try_from(len).map_err(|_| "pool length overflows".to_string())?;
    let cname = std::ffi::CString::new(name).map_err(|_| "NUL in shm name".to_string())?;
    // SAFETY: FFI with a valid NUL-terminated name.
    let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
    if fd < 0 {
        return Err(format!(
            "shm_open({}): {}",
            LogSafe(name),
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: `st` is plain old data filled by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is valid; st is writable.
    let stat_ok = unsafe { libc::fstat(fd, &mut st) } == 0;
    let foreign = owner.filter(|&uid| uid != 0 && (!stat_ok || st.st_uid != uid));
    if let Some(uid) = foreign {
        // SAFETY: closing our own fd.
        unsafe { libc::close(fd) };
        return Err(format!(
            "shm object {} is owned by uid {}, not by the calling engine's uid {uid}: an engine registers only memory it owns",
            LogSafe(name),
            st.st_uid
        ));
    }
    if stat_ok && (st.st_mode & libc::S_IFMT) != libc::S_IFREG {
        // SAFETY: closing our own fd.
        unsafe { libc::close(fd) };
        return Err(format!(
            "shm object {} is not a regular file",
            LogSafe(name)
        ));
    }
    let size_ok = stat_ok && (st.st_size as u64) >= len;
    if !size_ok {
        // SAFETY: closing our own fd.
        unsafe { libc::close(fd) };
        return Err(format!(
            "shm object {} is {} bytes, smaller than the {len} the layout needs",
            LogSafe(name),
            st.st_size
        ));
    }
    // SAFETY: mapping `len` bytes of a shm object at least that large.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len_usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    // SAFETY: the mapping keeps its own reference.
    unsafe { libc::close(fd) };
    if ptr == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    Ok(ptr as u64)
}

/// One request in flight from a session.
struct InFlight {
    dst_engine: String,
    path: &'static str,
    bytes: u64,
    started: Instant,
    /// Transport request id and path, for cancellation.
    handle: Option<(PathKind, TransferHandle)>,
    /// A request to another agent's engine that can only move by bounce
    /// (path BOUNCE, or AUTO with a GPU pool on either side): a Cancel
    /// that finds it still being routed (`handle` not set yet) is accepted
    /// and carried out in the transport once it is submitted. Requests
    /// that may take the standard path (a write that cannot be recalled)
    /// are not.
    cancellable: bool,
    /// Cancel accepted while the request was being routed.
    cancel_requested: bool,
}

/// Longest a failed hand-off's arrival is held back waiting for scatters
/// into the destination pool to stop (ms). Scatters of a failed request
/// end within the receiver's flow reclaim (twice the request timeout:
/// 60 s with the default `requestTimeoutMs` of 30,000; docs/protocol.md):
/// past this the arrival is reported anyway, with a warning, rather than
/// never.
const ARRIVAL_QUIESCE_LIMIT: Duration = Duration::from_secs(120);

/// The session's quiesce worker: until no failed-hand-off arrival is held
/// back, takes those held, waits until no scatter writes into the
/// session's pool, and records them. The wait ends at the batch's oldest
/// arrival's hold time + [`ARRIVAL_QUIESCE_LIMIT`]: an arrival that came in
/// during the previous batch's wait is held at most the limit in all, not
/// the rest of that wait plus a whole limit of its own.
fn quiesce_then_record(agent: &FabricAgent, hub: &Weak<EngineHub>, s: &Session) {
    // If this panics, the next failure starts a worker again rather than
    // queueing behind one that is gone (the loop below ends its slot
    // itself otherwise).
    struct Done<'a>(&'a Session);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                let lost = self
                    .0
                    .held_arrivals
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take()
                    .map_or(0, |l| l.len());
                tracing::error!(engine = %LogSafe(&self.0.engine_id), dropped = lost, "the failed-hand-off arrival worker panicked; arrivals held back dropped");
            }
        }
    }
    let _done = Done(s);
    loop {
        let batch = {
            let mut held = s.held_arrivals.lock().unwrap_or_else(|p| p.into_inner());
            match held.as_mut() {
                Some(list) if !list.is_empty() => std::mem::take(list),
                _ => {
                    *held = None;
                    return;
                }
            }
        };
        if let (Some(p), Some(t)) = (s.pool(), agent.transport()) {
            let deadline = batch
                .iter()
                .map(|(_, held_at)| *held_at)
                .min()
                .unwrap_or_else(Instant::now)
                + ARRIVAL_QUIESCE_LIMIT;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if t.quiesce_scatter_range(p.addr, p.len, left.min(Duration::from_secs(5))) {
                    break;
                }
                if left <= Duration::from_secs(5) {
                    tracing::warn!(engine = %LogSafe(&s.engine_id), limit = ?ARRIVAL_QUIESCE_LIMIT, "failed hand-off: scatters into the pool still running at the limit; arrival reported anyway");
                    break;
                }
                tracing::warn!(engine = %LogSafe(&s.engine_id), "failed hand-off: scatters into the pool still running; arrival held back");
            }
        }
        let Some(h) = hub.upgrade() else { return };
        for (a, _) in batch {
            h.record_arrival(a);
        }
    }
}

/// Whether another agent's published engine record (from etcd, not
/// trusted) describes a pool that holds its layout: a valid layout whose
/// bytes fit in `pool_len`, and `pool_addr + pool_len` within the address
/// space (block and extent offsets are added to `pool_addr` unchecked
/// once this holds).
fn published_pool_holds_layout(record: &EngineRecord) -> bool {
    record.pool_addr.checked_add(record.pool_len).is_some()
        && record.layout.validate().is_ok()
        && record
            .layout
            .pool_bytes()
            .is_some_and(|need| record.pool_len >= need)
}

/// Whether a hand-off from a pool of `src_kind` into `record`'s engine
/// touches GPU memory on either side: it then moves by bounce only (an
/// engine's imported CUDA memory cannot be a NIXL write target).
fn gpu_hand_off(src_kind: MemKind, record: &EngineRecord) -> bool {
    src_kind == MemKind::Vram || record.layout.device >= 0
}

/// One attached engine.
struct Session {
    id: String,
    /// This session's engine scope on the agent's transport (≥ 1, unique
    /// per agent incarnation): WANTs into its pool carry it, and the
    /// receiver serves them only while this session is attached (issue 12,
    /// engine-scoped flows).
    scope: u64,
    /// This attach's incarnation (random, non-zero): published, and
    /// checked against a Transfer's `dst_incarnation`.
    incarnation: u64,
    /// The attaching process (SO_PEERCRED); later calls on the session
    /// must come from the same uid.
    caller: Option<Caller>,
    engine_id: String,
    pod_uid: String,
    role: String,
    layout: EngineLayout,
    fingerprint: String,
    pool: Mutex<Option<Arc<MappedPool>>>,
    in_flight: Mutex<HashMap<u64, InFlight>>,
    succeeded: AtomicU64,
    failed: AtomicU64,
    bytes_sent: AtomicU64,
    arrivals: AtomicU64,
    /// Set once the engine's shm pool was found truncated (its detach is
    /// under way).
    truncated: std::sync::atomic::AtomicBool,
    /// Closed by Detach or the hub's shutdown (ends the Attach stream).
    close: Notify,
    /// Why it was closed (sent in the stream's `closing` event).
    close_reason: Mutex<String>,
    /// Failed-hand-off arrivals held back until no scatter writes into the
    /// pool; `Some` while this session's one quiesce worker runs (see
    /// [`EngineHub::on_notice`]).
    /// Each with when it was held back.
    held_arrivals: Mutex<Option<Vec<(ArrivalNotice, Instant)>>>,
}

impl Session {
    fn pool(&self) -> Option<Arc<MappedPool>> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Key of an arrival: (destination engine, source engine, request id).
type ArrivalKey = (String, String, u64);

/// Arrivals recorded and not taken yet: expired after [`ARRIVAL_TTL`],
/// at most [`MAX_PENDING_ARRIVALS`] (the oldest evicted), both at O(1)
/// amortized per insert — `order` holds insertion stamps in time order; an
/// entry taken or replaced leaves its stamp behind, skipped when reached
/// (arrivals come from peers' NOTICEs: a flood must not cost a scan of
/// every entry per notice).
#[derive(Default)]
struct Arrivals {
    done: HashMap<ArrivalKey, (ArrivalNotice, Instant)>,
    order: VecDeque<(ArrivalKey, Instant)>,
}

impl Arrivals {
    /// Whether `order`'s stamp (`k`, `t`) is still the entry's.
    fn live(&self, k: &ArrivalKey, t: Instant) -> bool {
        self.done.get(k).is_some_and(|(_, at)| *at == t)
    }

    /// Records `a` at `now`, after expiring and evicting as above.
    fn insert(&mut self, a: ArrivalNotice, now: Instant) {
        while let Some((k, t)) = self.order.front() {
            let live = self.live(k, *t);
            let expired = now.saturating_duration_since(*t) >= ARRIVAL_TTL;
            if live && !expired && self.done.len() < MAX_PENDING_ARRIVALS {
                break;
            }
            let (k, _) = self.order.pop_front().expect("front exists");
            if live {
                self.done.remove(&k);
            }
        }
        let key = (a.dst_engine.clone(), a.src_engine.clone(), a.request_id);
        self.order.push_back((key.clone(), now));
        self.done.insert(key, (a, now));
        // Stamps of taken entries pile up between live ones: rebuild once
        // they outnumber the entries (amortized O(1)).
        if self.order.len() > 2 * self.done.len() + 1024 {
            let mut v: Vec<(ArrivalKey, Instant)> = self
                .done
                .iter()
                .map(|(k, (_, t))| (k.clone(), *t))
                .collect();
            v.sort_by_key(|(_, t)| *t);
            self.order = v.into();
        }
    }
}

/// Totals of an [`EngineHub`] (exported as metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineHubStats {
    /// Sessions attached now.
    pub sessions: u64,
    /// Bytes of engine pools mapped now (detached pools count until they
    /// are released).
    pub pool_bytes: u64,
    /// Hand-offs resolved SUCCESS.
    pub succeeded: u64,
    /// Hand-offs resolved otherwise.
    pub failed: u64,
    /// Arrivals delivered to engines attached here.
    pub arrivals: u64,
}

/// Pool bytes mapped by all hubs of this process now (a pool counts from
/// its registration to its release).
static POOL_BYTES: AtomicU64 = AtomicU64::new(0);

/// Sessions, arrivals and the glue to the agent (see the module docs).
pub struct EngineHub {
    agent: Arc<FabricAgent>,
    discovery: Option<Arc<dyn Discovery>>,
    /// Called with the engine list whenever it changes (republishes the
    /// agent's record).
    publish: Box<dyn Fn(Vec<EngineRecord>) + Send + Sync>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    arrivals: Mutex<Arrivals>,
    arrived: Notify,
    request_timeout: Duration,
    next_session: AtomicU64,
    succeeded: AtomicU64,
    failed: AtomicU64,
    arrived_total: AtomicU64,
    /// Set by [`EngineHub::shutdown`]: no new sessions.
    closing: std::sync::atomic::AtomicBool,
    /// GPU engines must name their GPU's UUID ([`EngineHub::require_device_uuid`]).
    require_device_uuid: std::sync::atomic::AtomicBool,
    /// This hub, weakly (for threads it spawns).
    me: std::sync::OnceLock<Weak<EngineHub>>,
    /// Where hand-offs to other agents are recorded (latency, fallbacks,
    /// timeouts, bytes per peer and engine), once set.
    metrics: std::sync::OnceLock<Arc<crate::service::metrics::AgentMetrics>>,
    /// The trace pipeline, when an OTLP endpoint is configured.
    traces: std::sync::OnceLock<Arc<Traces>>,
    /// Profiling switches of the direct path, read once at start:
    /// `KVFABRIC_DIRECT_KERNEL=runs` uses the run-table kernel for whole
    /// blocks too, `KVFABRIC_DIRECT_MERGE=1` merges strided runs.
    direct_kernel_runs: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    direct_merge: bool,
    /// Copy engine of the same-node direct path between GPU pools.
    #[cfg(feature = "cuda")]
    direct: std::sync::OnceLock<Arc<crate::runtime::cuda::CudaCopyEngine>>,
}

fn status_of(e: kvfabric_core::layout::LayoutError) -> Status {
    match e {
        kvfabric_core::layout::LayoutError::Invalid(m) => Status::invalid_argument(m),
        kvfabric_core::layout::LayoutError::OutOfRange(m) => Status::invalid_argument(m),
        m @ kvfabric_core::layout::LayoutError::Mismatch { .. } => {
            Status::failed_precondition(m.to_string())
        }
    }
}

fn role_name(r: i32) -> Result<&'static str, Status> {
    match pb::Role::try_from(r) {
        Ok(pb::Role::Prefill) => Ok("prefill"),
        Ok(pb::Role::Decode) => Ok("decode"),
        Ok(pb::Role::Both) => Ok("both"),
        _ => Err(Status::invalid_argument(
            "role: expected ROLE_PREFILL, ROLE_DECODE or ROLE_BOTH",
        )),
    }
}

/// The core layout of an engine API `KvLayout` (field by field).
pub fn layout_of(l: &pb::KvLayout) -> EngineLayout {
    EngineLayout {
        layers: l.layers,
        num_blocks: l.num_blocks,
        block_bytes: l.block_bytes,
        kv_split: l.kv_split,
        dtype: l.dtype.clone(),
        tp_rank: l.tp_rank,
        tp_size: l.tp_size,
        block_tokens: l.block_tokens,
        kv_heads: l.kv_heads,
        head_dim: l.head_dim,
        device: l.device,
        device_uuid: l.device_uuid.clone(),
    }
}

/// Where a hand-off goes.
enum Target {
    /// An engine attached to this agent.
    Local(Arc<Session>),
    /// An engine attached to peer agent `agent`.
    Remote {
        agent: String,
        record: Box<EngineRecord>,
    },
}

/// How a destination engine resolves against the discovery records (see
/// [`lookup_remote`]).
#[derive(Debug, PartialEq)]
enum RemoteLookup {
    /// Named by peer `agent`'s record, whose NIXL metadata is loaded.
    Found {
        agent: String,
        record: Box<EngineRecord>,
    },
    /// Named only by records whose NIXL metadata is not loaded (yet); the
    /// first such record's agent.
    NotLoaded { agent: String },
    /// Named by no peer's record.
    Absent,
}

/// The resolution rule of a remote destination: `engine` is known on a peer
/// only through a record (other than `me`'s) whose NIXL metadata the
/// fabric has loaded — `loaded(name)` is the fingerprint loaded for peer
/// `name` ([`FabricAgent::peer_metadata`]), and it must equal the record's
/// ([`AgentRecord::metadata_fingerprint`]). Discovery shows a peer's new
/// record (naming an engine whose pool was registered a moment ago) before
/// the peer sync has loaded it; until then NIXL does not know that pool,
/// and a write into it fails (`prepare_xfer_dlist failed: Not found`).
///
/// [`AgentRecord::metadata_fingerprint`]: super::discovery::AgentRecord::metadata_fingerprint
fn lookup_remote(
    records: &[super::discovery::AgentRecord],
    me: &str,
    engine: &str,
    loaded: impl Fn(&str) -> Option<u64>,
) -> RemoteLookup {
    let mut pending = None;
    for rec in records.iter().filter(|r| r.name != me) {
        let Some(e) = rec.engines.iter().find(|e| e.engine_id == engine) else {
            continue;
        };
        if loaded(&rec.name) == Some(rec.metadata_fingerprint()) {
            return RemoteLookup::Found {
                agent: rec.name.clone(),
                record: Box::new(e.clone()),
            };
        }
        pending.get_or_insert_with(|| rec.name.clone());
    }
    match pending {
        Some(agent) => RemoteLookup::NotLoaded { agent },
        None => RemoteLookup::Absent,
    }
}

impl EngineHub {
    /// A hub serving `agent`; `discovery` resolves engines on other agents
    /// (none: local hand-offs only); `publish` is called with the engine
    /// list on every change; `request_timeout` bounds a transfer without its
    /// own timeout (the config's `requestTimeoutMs`).
    pub fn new(
        agent: Arc<FabricAgent>,
        discovery: Option<Arc<dyn Discovery>>,
        publish: Box<dyn Fn(Vec<EngineRecord>) + Send + Sync>,
        request_timeout: Duration,
    ) -> Arc<Self> {
        let hub = Arc::new(Self {
            agent,
            discovery,
            publish,
            sessions: Mutex::new(HashMap::new()),
            arrivals: Mutex::new(Arrivals::default()),
            arrived: Notify::new(),
            request_timeout,
            next_session: AtomicU64::new(1),
            succeeded: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            arrived_total: AtomicU64::new(0),
            closing: std::sync::atomic::AtomicBool::new(false),
            require_device_uuid: std::sync::atomic::AtomicBool::new(false),
            me: std::sync::OnceLock::new(),
            metrics: std::sync::OnceLock::new(),
            traces: std::sync::OnceLock::new(),
            direct_kernel_runs: std::env::var("KVFABRIC_DIRECT_KERNEL").as_deref() == Ok("runs"),
            direct_merge: std::env::var("KVFABRIC_DIRECT_MERGE").as_deref() == Ok("1"),
            #[cfg(feature = "cuda")]
            direct: std::sync::OnceLock::new(),
        });
        let _ = hub.me.set(Arc::downgrade(&hub));
        {
            // Set on the agent (not its transport): a reconfiguration's
            // rebuilt transport gets it too.
            let (tx, rx) = crossbeam_channel::bounded::<(String, Notice)>(4096);
            hub.agent.set_notice_sink(tx);
            let weak = Arc::downgrade(&hub);
            let _ = std::thread::Builder::new()
                .name("kvfabric-notices".into())
                .spawn(move || {
                    while let Ok((peer, n)) = rx.recv() {
                        let Some(hub) = weak.upgrade() else { return };
                        hub.on_notice(&peer, n);
                    }
                });
        }
        hub
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn session(&self, id: &str) -> Result<Arc<Session>, Status> {
        self.lock_sessions().get(id).cloned().ok_or_else(|| {
            Status::not_found(format!(
                "no session {} (detached or never attached)",
                LogSafe(id)
            ))
        })
    }

    /// Session `id`, for a call by `caller`: a session is used only by a
    /// process of the uid that attached it (PermissionDenied otherwise).
    fn session_for(&self, id: &str, caller: Option<Caller>) -> Result<Arc<Session>, Status> {
        let s = self.session(id)?;
        if let (Some(owner), Some(c)) = (s.caller, caller) {
            if owner.uid != c.uid && c.uid != 0 {
                return Err(Status::permission_denied(format!(
                    "session {} was attached by uid {}; this call came from uid {}",
                    LogSafe(id),
                    owner.uid,
                    c.uid
                )));
            }
        }
        Ok(s)
    }

    /// The engine records this agent publishes.
    pub fn records(&self) -> Vec<EngineRecord> {
        let mut v: Vec<EngineRecord> = self
            .lock_sessions()
            .values()
            // An engine is published once its pool is registered: a peer
            // that finds it can hand blocks to it (before that, NotFound —
            // retryable — rather than a refusal).
            .filter(|s| s.pool().is_some())
            .map(|s| {
                let pool = s.pool();
                EngineRecord {
                    engine_id: s.engine_id.clone(),
                    pod_uid: s.pod_uid.clone(),
                    role: s.role.clone(),
                    layout: s.layout.clone(),
                    fingerprint: s.fingerprint.clone(),
                    pool_addr: pool.as_ref().map_or(0, |p| p.addr),
                    pool_len: pool.as_ref().map_or(0, |p| p.len),
                    pool_kind: if s.layout.device >= 0 { "vram" } else { "dram" }.into(),
                    scope: s.scope,
                    incarnation: s.incarnation,
                }
            })
            .collect();
        v.sort_by(|a, b| a.engine_id.cmp(&b.engine_id));
        v
    }

    fn republish(&self) {
        (self.publish)(self.records());
    }

    /// Live sessions (for status and tests).
    pub fn session_count(&self) -> usize {
        self.lock_sessions().len()
    }

    /// Current totals. `pool_bytes` is process-wide (the pools every hub
    /// of this process holds; one hub per agent process).
    pub fn stats(&self) -> EngineHubStats {
        EngineHubStats {
            sessions: self.lock_sessions().len() as u64,
            pool_bytes: POOL_BYTES.load(Ordering::Relaxed),
            succeeded: self.succeeded.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            arrivals: self.arrived_total.load(Ordering::Relaxed),
        }
    }

    /// Records this hub's hand-offs to other agents in `metrics` (first
    /// call wins).
    pub fn set_metrics(&self, metrics: Arc<crate::service::metrics::AgentMetrics>) {
        let _ = self.metrics.set(metrics);
    }

    /// Traces hand-offs through `traces` (see [`crate::service::traces`]).
    pub fn set_traces(&self, traces: Arc<Traces>) {
        let _ = self.traces.set(traces);
    }

    /// With `on`, a GPU engine whose layout names no GPU UUID is refused at
    /// `Attach` where this agent knows its own (the config's
    /// `requireDeviceUuid`; `kvfabric_core::layout::check_device`).
    pub fn require_device_uuid(&self, on: bool) {
        self.require_device_uuid.store(on, Ordering::Relaxed);
    }

    /// Ids of the engines attached now.
    pub fn engine_ids(&self) -> Vec<String> {
        self.lock_sessions()
            .values()
            .map(|s| s.engine_id.clone())
            .collect()
    }

    /// Attaches an engine.
    fn attach(
        &self,
        req: &pb::AttachRequest,
        caller: Option<Caller>,
    ) -> Result<Arc<Session>, Status> {
        if self.closing.load(Ordering::SeqCst) {
            return Err(Status::unavailable("the agent is shutting down"));
        }
        let id = req.engine_id.as_str();
        if id.is_empty()
            || id.len() > MAX_ENGINE_ID_LEN
            || id
                .chars()
                .any(|c| c == '/' || c.is_whitespace() || c.is_control())
        {
            return Err(Status::invalid_argument(format!(
                "engine_id {}: want 1-{MAX_ENGINE_ID_LEN} printable characters without '/' or spaces",
                LogSafe(id)
            )));
        }
        if req.pod_uid.len() > MAX_ENGINE_ID_LEN || req.pod_uid.chars().any(char::is_control) {
            return Err(Status::invalid_argument(
                "pod_uid: too long or not printable",
            ));
        }
        if !req.pod_uid.is_empty()
            && self
                .discovery
                .as_ref()
                .is_some_and(|d| d.is_tombstoned(&req.pod_uid))
        {
            return Err(Status::failed_precondition(format!(
                "pod_uid {}: the operator invalidated this pod (tombstone); a new pod has a new UID",
                LogSafe(&req.pod_uid)
            )));
        }
        let role = role_name(req.role)?;
        let mut layout = layout_of(
            req.layout
                .as_ref()
                .ok_or_else(|| Status::invalid_argument("layout: missing"))?,
        );
        layout.validate().map_err(status_of)?;
        kvfabric_core::layout::check_device(
            &layout,
            self.arena_device(),
            self.require_device_uuid.load(Ordering::Relaxed),
        )
        .map_err(Status::failed_precondition)?;
        // Published and shown in one form, whatever form the engine sent.
        if let Ok(u) = kvfabric_core::layout::parse_gpu_uuid(&layout.device_uuid) {
            layout.device_uuid = kvfabric_core::layout::format_gpu_uuid(&u);
        }
        let s = {
            let mut g = self.lock_sessions();
            if g.values().any(|s| s.engine_id == id) {
                return Err(Status::already_exists(format!(
                    "engine {} is attached already (one session per engine id)",
                    LogSafe(id)
                )));
            }
            let scope = self.next_session.fetch_add(1, Ordering::Relaxed).max(1);
            let sid = format!(
                "{scope}-{}",
                crate::service::discovery::Incarnation::generate()
            );
            let s = Arc::new(Session {
                id: sid.clone(),
                scope,
                incarnation: (crate::service::discovery::Incarnation::generate().0 as u64).max(1),
                caller,
                engine_id: id.to_string(),
                pod_uid: req.pod_uid.clone(),
                role: role.to_string(),
                fingerprint: layout.fingerprint(),
                layout,
                pool: Mutex::new(None),
                in_flight: Mutex::new(HashMap::new()),
                succeeded: AtomicU64::new(0),
                failed: AtomicU64::new(0),
                bytes_sent: AtomicU64::new(0),
                arrivals: AtomicU64::new(0),
                truncated: std::sync::atomic::AtomicBool::new(false),
                close: Notify::new(),
                close_reason: Mutex::new(String::new()),
                held_arrivals: Mutex::new(None),
            });
            g.insert(sid, s.clone());
            s
        };
        // A tombstone that arrived between the check above and the insert
        // found no session to detach: check again now that it is visible.
        if !s.pod_uid.is_empty()
            && self
                .discovery
                .as_ref()
                .is_some_and(|d| d.is_tombstoned(&s.pod_uid))
        {
            self.detach(&s.id, "pod invalidated by the operator (tombstone)");
            return Err(Status::failed_precondition(format!(
                "pod_uid {}: the operator invalidated this pod (tombstone); a new pod has a new UID",
                LogSafe(&s.pod_uid)
            )));
        }
        tracing::info!(agent = %self.agent.name(), engine = %LogSafe(id), session = %s.id, role, layout = %s.layout, uid = ?s.caller.map(|c| c.uid), pid = ?s.caller.and_then(|c| c.pid), "engine attached");

        self.republish();
        Ok(s)
    }

    /// Detaches every session of pod `pod_uid` (the operator invalidated
    /// the pod: issue 14, "the engine's flows failed and reclaimed"), as
    /// [`EngineHub::detach`] does. Returns how many. An empty UID matches
    /// nothing.
    pub fn detach_pod(&self, pod_uid: &str, why: &str) -> usize {
        if pod_uid.is_empty() {
            return 0;
        }
        let doomed: Vec<String> = self
            .lock_sessions()
            .values()
            .filter(|s| s.pod_uid == pod_uid)
            .map(|s| s.id.clone())
            .collect();
        for sid in &doomed {
            self.detach(sid, why);
        }
        doomed.len()
    }

    /// Detaches the sessions of each pod `discovery` reports tombstoned,
    /// on a thread of its own that ends when this hub is dropped (checked
    /// every 200 ms).
    pub fn follow_tombstones(self: &Arc<Self>) {
        let Some(rx) = self.discovery.as_ref().and_then(|d| d.tombstones()) else {
            return;
        };
        let weak = Arc::downgrade(self);
        let _ = std::thread::Builder::new()
            .name("kvfabric-engine-tombstones".into())
            .spawn(move || loop {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(uid) => {
                        let Some(hub) = weak.upgrade() else { return };
                        let n = hub.detach_pod(&uid, "pod invalidated by the operator (tombstone)");
                        if n > 0 {
                            tracing::info!(pod_uid = %LogSafe(&uid), sessions = n, "engine sessions of an invalidated pod detached");
                        }
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                        if weak.strong_count() == 0 {
                            return;
                        }
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
                }
            });
    }

    /// Ends a session: fails its requests, withdraws it, and lets its pool
    /// go once no scatter writes into it. Idempotent.
    pub fn detach(&self, session: &str, why: &str) {
        let Some(s) = self.lock_sessions().remove(session) else {
            return;
        };
        tracing::info!(agent = %self.agent.name(), engine = %LogSafe(&s.engine_id), session, reason = why, "engine detached");
        // Arrivals for it are void now (an engine re-attached under the same
        // id must not collect them). Arrivals *from* it stay: their bytes
        // landed, and the decode engine may not have asked yet.
        self.purge_arrivals_to(&s.engine_id);
        *s.close_reason.lock().unwrap_or_else(|p| p.into_inner()) = why.to_string();
        s.close.notify_waiters();
        s.close.notify_one();
        // Pending AwaitArrival calls of this session re-check and end.
        self.arrived.notify_waiters();
        let inflight: Vec<(u64, Option<(PathKind, TransferHandle)>)> = s
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(r, f)| (*r, f.handle.clone()))
            .collect();
        for (rid, h) in inflight {
            if let (Some((PathKind::Bounce, h)), Some(t)) = (h, self.agent.transport()) {
                if t.cancel(h.request_id, &format!("engine detached: {why}")) {
                    tracing::info!(engine = %LogSafe(&s.engine_id), request = rid, "in-flight request cancelled");
                }
            }
        }
        self.republish();
        // Flows into its pool end now, their senders told (REJECT): a
        // hand-off to a detached engine fails at once, and no later DATA
        // can land in memory another engine may map here next.
        let reclaimed = self.agent.forget_scope(s.scope);
        if reclaimed > 0 {
            tracing::info!(engine = %LogSafe(&s.engine_id), flows = reclaimed, "incoming hand-offs of the detached engine refused (their senders told)");
        }
        let pool = s.pool.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(pool) = pool {
            // Drain scatters into the pool before letting it go (a reaper
            // thread: never block the caller).
            let agent = self.agent.clone();
            let _ = std::thread::Builder::new()
                .name("kvfabric-pool-reaper".into())
                .spawn(move || {
                    while !agent.disallow_scatter_range(pool.addr, pool.len, Duration::from_secs(5)) {
                        tracing::warn!(addr = pool.addr, "a detached engine's pool still has scatters in flight; keeping it mapped");
                    }
                    // A cancelled request's gather (an orphan gather) and a
                    // standard-path write may still read the pool after the
                    // request resolved: wait until the transport has no
                    // orphan work and no standard write is in flight.
                    // Conservative (it counts every engine's), never
                    // unmapping under a reader.
                    let mut warned = false;
                    loop {
                        let orphans = agent
                            .transport()
                            .and_then(|t| t.snapshot())
                            .map_or(0, |s| s.send_orphans);
                        let standard = agent.stats().standard_in_flight.load(Ordering::Relaxed);
                        if orphans == 0 && standard == 0 {
                            break;
                        }
                        if !warned {
                            tracing::info!(addr = pool.addr, orphans, standard, "a detached engine's pool waits for in-flight reads before it is released");
                            warned = true;
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    drop(pool);
                });
        }
    }

    /// Detaches every session (agent shutdown).
    pub fn shutdown(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let ids: Vec<String> = self.lock_sessions().keys().cloned().collect();
        for id in ids {
            self.detach(&id, "agent shutting down");
        }
    }

    /// The direct path's copy engine (built on first use on the agent's GPU).
    #[cfg(feature = "cuda")]
    fn direct_engine(&self) -> Result<Arc<crate::runtime::cuda::CudaCopyEngine>, Status> {
        if let Some(e) = self.direct.get() {
            return Ok(e.clone());
        }
        let gpu = self
            .agent
            .gpu()
            .ok_or_else(|| Status::internal("GPU pools without a GPU arena"))?;
        let mut cfg = crate::runtime::cuda::CudaCopyConfig::default();
        // Where the kernel reads its run table from: mapped pinned host
        // memory (default) or a device copy made on the stream first.
        if std::env::var("KVFABRIC_DIRECT_PLAN_SOURCE").as_deref() == Ok("device") {
            cfg.plan_source = crate::runtime::cuda::PlanSource::Device;
        }
        let e = Arc::new(
            crate::runtime::cuda::CudaCopyEngine::new(gpu, cfg)
                .map_err(|e| Status::internal(format!("direct copy engine: {e}")))?,
        );
        Ok(self.direct.get_or_init(|| e).clone())
    }

    /// Where the agent's arena lives (engines are matched to it).
    fn arena_device(&self) -> kvfabric_core::layout::ArenaDevice {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.agent.gpu() {
            return kvfabric_core::layout::ArenaDevice::Gpu {
                ordinal: g.info().ordinal as i32,
                uuid: g.info().uuid,
            };
        }
        kvfabric_core::layout::ArenaDevice::Host
    }

    /// Registers a GPU pool given as a CUDA IPC handle.
    #[cfg(feature = "cuda")]
    fn register_cuda_ipc(&self, s: &Arc<Session>, pool: &pb::CudaIpcPool) -> Result<u64, Status> {
        let need = s.layout.pool_bytes().unwrap_or(u64::MAX);
        if s.layout.device < 0 {
            return Err(Status::invalid_argument(
                "a CUDA IPC pool needs layout.device >= 0 (the engine's GPU)",
            ));
        }
        if pool.len < need {
            return Err(Status::invalid_argument(format!(
                "pool of {} bytes is smaller than the layout's {need} bytes",
                pool.len
            )));
        }
        let gpu = self
            .agent
            .gpu()
            .ok_or_else(|| Status::failed_precondition("this agent has no GPU arena"))?;
        if s.pool().is_some() {
            return Err(Status::failed_precondition(
                "a pool is registered already (one pool per session)",
            ));
        }
        let ipc = crate::runtime::cuda::IpcMapping::open(gpu, &pool.handle, pool.offset, need)
            .map_err(|e| Status::invalid_argument(format!("opening the CUDA IPC handle: {e}")))?;
        let addr = ipc.addr();
        self.install_pool(
            s,
            Arc::new(MappedPool::new(
                addr,
                need,
                Arc::downgrade(&self.agent),
                Some(ipc),
            )),
        )?;
        tracing::info!(engine = %LogSafe(&s.engine_id), bytes = need, device = s.layout.device, "GPU pool registered (CUDA IPC)");
        self.republish();
        Ok(need)
    }

    /// Installs a mapped pool as `s`'s, then allows scatters into it —
    /// unless `s` was detached meanwhile or got a pool from a concurrent
    /// call (the pool is then dropped: unregistered, unmapped, unused).
    fn install_pool(&self, s: &Arc<Session>, pool: Arc<MappedPool>) -> Result<(), Status> {
        let sessions = self.lock_sessions();
        if !sessions.contains_key(&s.id) {
            return Err(Status::not_found(
                "the session detached while its pool was registered",
            ));
        }
        let mut slot = s.pool.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_some() {
            return Err(Status::failed_precondition(
                "a pool is registered already (one pool per session)",
            ));
        }
        self.agent.allow_scope(s.scope, pool.addr, pool.len);
        *slot = Some(pool);
        Ok(())
    }

    fn register_shm(&self, s: &Arc<Session>, name: &str, len: u64) -> Result<u64, Status> {
        if s.layout.device >= 0 {
            return Err(Status::invalid_argument(
                "layout.device >= 0 (a GPU engine): register the pool as cuda_ipc, not shm",
            ));
        }
        let need = s.layout.pool_bytes().unwrap_or(u64::MAX);
        if len < need {
            return Err(Status::invalid_argument(format!(
                "pool of {len} bytes is smaller than the layout's {need} bytes"
            )));
        }
        if s.pool().is_some() {
            return Err(Status::failed_precondition(
                "a pool is registered already (one pool per session)",
            ));
        }
        // Mapped and registered without holding the session's locks (NIXL
        // registration can take a while); installed only if the session is
        // still attached and still has no pool — else dropped (unregistered,
        // unmapped) before anything could use it.
        let owner = s.caller.map(|c| c.uid);
        let addr = map_shm(name, need, owner).map_err(|e| {
            if e.contains("owned by uid") {
                Status::permission_denied(e)
            } else {
                Status::invalid_argument(e)
            }
        })?;
        let mut pool = MappedPool::new(
            addr,
            need,
            Arc::downgrade(&self.agent),
            #[cfg(feature = "cuda")]
            None,
        );
        pool.guard = crate::service::shm_guard::guard(addr, need);
        let pool = Arc::new(pool);
        self.agent
            .engine()
            .register_region(MemKind::Dram, MemDesc::host(addr, need))
            .map_err(|e| Status::internal(format!("NIXL registration of the pool: {e}")))?;
        self.install_pool(s, pool)?;
        tracing::info!(engine = %LogSafe(&s.engine_id), shm = %LogSafe(name), bytes = need, "pool registered");
        self.republish();
        Ok(need)
    }

    /// Finds `engine` on this agent or on a peer ([`lookup_remote`]: only
    /// through a record whose NIXL metadata is loaded). An engine named only
    /// by a record not loaded yet is waited for, at most `within` (5 ms
    /// steps), then not found.
    fn resolve(&self, engine: &str, within: Duration) -> Result<Target, Status> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = self
                .lock_sessions()
                .values()
                .find(|s| s.engine_id == engine)
                .cloned()
            {
                return Ok(Target::Local(s));
            }
            let Some(d) = &self.discovery else {
                break;
            };
            match lookup_remote(&d.peers(), self.agent.name(), engine, |p| {
                self.agent.peer_metadata(p)
            }) {
                RemoteLookup::Found { agent, record } => {
                    return Ok(Target::Remote { agent, record })
                }
                RemoteLookup::NotLoaded { .. } if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                RemoteLookup::NotLoaded { agent } => {
                    return Err(Status::not_found(format!(
                        "destination engine {} is named by the record of agent {}, whose NIXL metadata this agent has not loaded yet",
                        LogSafe(engine),
                        LogSafe(&agent)
                    )));
                }
                RemoteLookup::Absent => break,
            }
        }
        Err(Status::not_found(format!(
            "destination engine {} is not attached to this agent or any agent in discovery",
            LogSafe(engine)
        )))
    }

    fn on_notice(&self, peer: &str, n: Notice) {
        if n.topic != NOTICE_TOPIC_ARRIVAL {
            tracing::debug!(peer = %LogSafe(peer), topic = n.topic, "notice of an unknown topic dropped");
            return;
        }
        let Ok(mut a) = serde_json::from_slice::<ArrivalNotice>(&n.payload) else {
            tracing::warn!(peer = %LogSafe(peer), "undecodable arrival notice dropped");
            return;
        };
        let traceparent = std::mem::take(&mut a.traceparent);
        if let (Some(t), false) = (self.traces.get(), traceparent.is_empty()) {
            t.arrival(
                &traceparent,
                vec![
                    opentelemetry::KeyValue::new("kvfabric.request_id", a.request_id as i64),
                    opentelemetry::KeyValue::new("kvfabric.engine", a.src_engine.clone()),
                    opentelemetry::KeyValue::new("kvfabric.dst_engine", a.dst_engine.clone()),
                    opentelemetry::KeyValue::new("kvfabric.peer", peer.to_string()),
                    opentelemetry::KeyValue::new("kvfabric.bytes", a.bytes as i64),
                    opentelemetry::KeyValue::new("kvfabric.outcome", a.outcome.clone()),
                ],
                a.outcome == "success",
            );
        }
        let known = self
            .lock_sessions()
            .values()
            .find(|s| s.engine_id == a.dst_engine)
            .cloned();
        match known {
            Some(s) if a.outcome != "success" => {
                // A failed hand-off: DATA received before the failure may
                // still be scattering into the pool. Report it once no
                // scatter writes there, off the notice thread: one worker
                // per session takes every failure held back so far (a
                // peer's burst of failure notices costs one thread, not
                // one each).
                s.arrivals.fetch_add(1, Ordering::Relaxed);
                {
                    let mut held = s.held_arrivals.lock().unwrap_or_else(|p| p.into_inner());
                    if let Some(list) = held.as_mut() {
                        if list.len() < MAX_PENDING_ARRIVALS {
                            list.push((a, Instant::now()));
                        } else {
                            tracing::warn!(engine = %LogSafe(&a.dst_engine), "too many failed-hand-off arrivals held back; dropped");
                        }
                        return;
                    }
                    *held = Some(vec![(a, Instant::now())]);
                }
                let (agent, hub, s2) = (self.agent.clone(), self.weak_self(), s.clone());
                let spawned = std::thread::Builder::new()
                    .name("kvfabric-arrival-quiesce".into())
                    .spawn(move || quiesce_then_record(&agent, &hub, &s2));
                if let Err(e) = spawned {
                    // No thread: the failures cannot be reported safely
                    // (scatters may still write the pool); the engines'
                    // AwaitArrival time out instead.
                    let taken = s
                        .held_arrivals
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .take();
                    tracing::error!(error = %e, dropped = taken.map_or(0, |l| l.len()), "no thread to hold failed-hand-off arrivals back; dropped");
                }
            }
            Some(s) => {
                s.arrivals.fetch_add(1, Ordering::Relaxed);
                self.record_arrival(a);
            }
            None => {
                tracing::debug!(peer = %LogSafe(peer), engine = %LogSafe(&a.dst_engine), "arrival for an engine not attached here dropped")
            }
        }
    }

    fn weak_self(&self) -> Weak<EngineHub> {
        self.me.get().cloned().unwrap_or_default()
    }

    /// `Some(reason)` when `s`'s shm pool was truncated by the engine after
    /// it was registered (the agent survived the SIGBUS by mapping zero
    /// pages, see [`crate::service::shm_guard`]); the session is detached
    /// then (once, off this thread).
    fn pool_truncated(&self, s: &Arc<Session>) -> Option<String> {
        if !s.pool().is_some_and(|p| p.truncated()) {
            return None;
        }
        let why = format!(
            "engine {}'s shm pool was truncated after it was registered: its bytes are gone; the session is detached",
            LogSafe(&s.engine_id)
        );
        if !s.truncated.swap(true, Ordering::SeqCst) {
            tracing::error!(engine = %LogSafe(&s.engine_id), "shm pool truncated under the agent; detaching the engine");
            let (hub, id, reason) = (self.weak_self(), s.id.clone(), why.clone());
            let _ = std::thread::Builder::new()
                .name("kvfabric-truncated".into())
                .spawn(move || {
                    if let Some(h) = hub.upgrade() {
                        h.detach(&id, &reason);
                    }
                });
        }
        Some(why)
    }

    /// Drops every pending arrival to `engine`.
    fn purge_arrivals_to(&self, engine: &str) {
        self.arrivals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .done
            .retain(|(d, _, _), _| d != engine);
    }

    fn record_arrival(&self, mut a: ArrivalNotice) {
        if a.outcome == "success" {
            let dst = self
                .lock_sessions()
                .values()
                .find(|s| s.engine_id == a.dst_engine)
                .cloned();
            if let Some(why) = dst.and_then(|d| self.pool_truncated(&d)) {
                a.outcome = "failure".into();
                a.reason = why;
            }
        }
        self.arrived_total.fetch_add(1, Ordering::Relaxed);
        self.arrivals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(a, Instant::now());
        self.arrived.notify_waiters();
    }

    /// Takes the arrival of (`dst`, `src` or any, `rid`), if there.
    fn take_arrival(
        &self,
        dst: &str,
        src: &str,
        rid: u64,
    ) -> Result<Option<ArrivalNotice>, Status> {
        let mut g = self.arrivals.lock().unwrap_or_else(|p| p.into_inner());
        if !src.is_empty() {
            return Ok(g
                .done
                .remove(&(dst.to_string(), src.to_string(), rid))
                .map(|(a, _)| a));
        }
        let keys: Vec<ArrivalKey> = g
            .done
            .keys()
            .filter(|(d, _, r)| d == dst && *r == rid)
            .cloned()
            .collect();
        match keys.len() {
            0 => Ok(None),
            1 => Ok(g.done.remove(&keys[0]).map(|(a, _)| a)),
            _ => Err(Status::failed_precondition(format!(
                "request {rid} arrived from {} source engines; name src_engine",
                keys.len()
            ))),
        }
    }

    /// Runs one hand-off to its end (blocking; call off the async runtime);
    /// ends its trace, if sampled.
    fn transfer_blocking(
        self: &Arc<Self>,
        s: &Arc<Session>,
        req: pb::TransferRequest,
        received: Instant,
        mut trace: Option<TransferTrace>,
    ) -> Result<pb::TransferResponse, Status> {
        let mut r = self.transfer_inner(s, req, received, &mut trace);
        if let Ok(resp) = &mut r {
            if resp.outcome() == pb::Outcome::Success {
                if let Some(why) = self.pool_truncated(s) {
                    resp.outcome = pb::Outcome::Failure as i32;
                    resp.reason = why;
                }
            }
        }
        if let Some(t) = trace {
            let end = Instant::now();
            match &r {
                Ok(r) => t.finish(
                    match r.outcome() {
                        pb::Outcome::Success => "success",
                        pb::Outcome::Timeout => "timeout",
                        pb::Outcome::Cancelled => "cancelled",
                        _ => "failure",
                    },
                    &r.reason,
                    &r.path,
                    r.bytes,
                    r.descriptors,
                    Some(r.submit_us),
                    Some(r.transfer_us),
                    end,
                ),
                Err(st) => t.finish("rejected", st.message(), "", 0, 0, None, None, end),
            }
        }
        r
    }

    fn transfer_inner(
        self: &Arc<Self>,
        s: &Arc<Session>,
        req: pb::TransferRequest,
        received: Instant,
        trace: &mut Option<TransferTrace>,
    ) -> Result<pb::TransferResponse, Status> {
        let src_pool = s
            .pool()
            .ok_or_else(|| Status::failed_precondition("no pool registered on this session"))?;
        if let Some(why) = self.pool_truncated(s) {
            return Err(Status::failed_precondition(why));
        }
        if req.src_blocks.len() > MAX_BLOCKS_PER_TRANSFER
            || req.dst_blocks.len() > MAX_BLOCKS_PER_TRANSFER
            || req
                .extents
                .as_ref()
                .is_some_and(|e| e.extents.len() > MAX_BLOCKS_PER_TRANSFER)
        {
            return Err(Status::invalid_argument(format!(
                "more than {MAX_BLOCKS_PER_TRANSFER} blocks or extents in one transfer"
            )));
        }
        if req.dst_engine == s.engine_id {
            return Err(Status::invalid_argument(
                "dst_engine is this session's own engine (a hand-off goes to another engine)",
            ));
        }
        {
            // A destination block named twice would be written by two
            // copies at once (nondeterministic bytes): refused.
            let mut seen = std::collections::HashSet::with_capacity(req.dst_blocks.len());
            if let Some(d) = req.dst_blocks.iter().find(|d| !seen.insert(**d)) {
                return Err(Status::invalid_argument(format!(
                    "dst_blocks names block {d} more than once"
                )));
            }
        }
        let timeout = if req.timeout_ms == 0 {
            self.request_timeout
        } else {
            Duration::from_millis(u64::from(req.timeout_ms))
        };
        // A quarter of the request's time for a peer's record naming the
        // destination to be loaded (see `resolve`).
        let target = self.resolve(&req.dst_engine, timeout / 4)?;
        if let Some(t) = trace {
            t.peer = Some(match &target {
                Target::Local(_) => self.agent.name().to_string(),
                Target::Remote { agent, .. } => agent.clone(),
            });
        }
        // Layouts first: a pair that can never be mapped is refused as such.
        let dst_layout_first = match &target {
            Target::Local(d) => d.layout.clone(),
            Target::Remote { record, .. } => record.layout.clone(),
        };
        head_map(&s.layout, &dst_layout_first).map_err(status_of)?;
        if req.dst_incarnation != 0 {
            let now = match &target {
                Target::Local(d) => d.incarnation,
                Target::Remote { record, .. } => record.incarnation,
            };
            if now != req.dst_incarnation {
                return Err(Status::failed_precondition(format!(
                    "destination engine {} re-attached since its blocks were allocated (incarnation {now:#x} now, the request names {:#x}): nothing written",
                    LogSafe(&req.dst_engine),
                    req.dst_incarnation
                )));
            }
        }
        let (dst_layout, dst_base, dst_len) = match &target {
            Target::Local(d) => {
                let p = d.pool().ok_or_else(|| {
                    Status::failed_precondition(format!(
                        "destination engine {} has no pool registered",
                        LogSafe(&d.engine_id)
                    ))
                })?;
                (d.layout.clone(), p.addr, p.len)
            }
            Target::Remote { record, .. } => {
                if record.pool_len == 0 {
                    return Err(Status::failed_precondition(format!(
                        "destination engine {} has no pool registered",
                        LogSafe(&record.engine_id)
                    )));
                }
                // Another agent's record (etcd) is not trusted: its pool
                // must hold its layout without wrapping the address space.
                if !published_pool_holds_layout(record) {
                    return Err(Status::failed_precondition(format!(
                        "destination engine {}'s published pool (address {:#x}, {} bytes) does not hold its layout",
                        LogSafe(&record.engine_id),
                        record.pool_addr,
                        record.pool_len
                    )));
                }
                (record.layout.clone(), record.pool_addr, record.pool_len)
            }
        };
        // Whole blocks between two GPU pools of this agent go to the
        // block-id kernel: ids are checked, no descriptor is built.
        let uses_blocks = req.extents.as_ref().is_none_or(|e| e.extents.is_empty());
        let block_kernel = match &target {
            Target::Local(d) => {
                uses_blocks
                    && !self.direct_kernel_runs
                    && src_pool.kind() == MemKind::Vram
                    && d.pool().is_some_and(|p| p.kind() == MemKind::Vram)
                    && s.layout.block_bytes == d.layout.block_bytes
                    && s.layout.kv_split == d.layout.kv_split
            }
            Target::Remote { .. } => false,
        };
        let descs: Vec<Descriptor> = match &req.extents {
            _ if block_kernel => {
                if req.src_blocks.is_empty() {
                    return Err(Status::invalid_argument("no blocks to transfer"));
                }
                check_block_pairs(&s.layout, &dst_layout, &req.src_blocks, &req.dst_blocks)
                    .map_err(status_of)?;
                Vec::new()
            }
            Some(ex) if !ex.extents.is_empty() => {
                if !req.src_blocks.is_empty() || !req.dst_blocks.is_empty() {
                    return Err(Status::invalid_argument("give blocks or extents, not both"));
                }
                let v: Vec<(u64, u64, u64)> = ex
                    .extents
                    .iter()
                    .map(|e| (e.src_offset, e.dst_offset, e.len))
                    .collect();
                head_map(&s.layout, &dst_layout).map_err(status_of)?;
                extent_descriptors(src_pool.addr, src_pool.len, dst_base, dst_len, &v)
                    .map_err(status_of)?
            }
            _ => {
                if req.src_blocks.is_empty() {
                    return Err(Status::invalid_argument("no blocks to transfer"));
                }
                block_descriptors(
                    &s.layout,
                    src_pool.addr,
                    &dst_layout,
                    dst_base,
                    &req.src_blocks,
                    &req.dst_blocks,
                )
                .map_err(status_of)?
            }
        };
        let bytes: u64 = if block_kernel {
            req.src_blocks.len() as u64
                * u64::from(s.layout.layers)
                * s.layout.planes()
                * s.layout.block_bytes
        } else {
            descs.iter().map(|d| d.len).sum()
        };
        {
            let mut inf = s.in_flight.lock().unwrap_or_else(|p| p.into_inner());
            if inf.contains_key(&req.request_id) {
                return Err(Status::already_exists(format!(
                    "request {} is in flight already on this session",
                    req.request_id
                )));
            }
            inf.insert(
                req.request_id,
                InFlight {
                    dst_engine: req.dst_engine.clone(),
                    path: "pending",
                    bytes,
                    started: Instant::now(),
                    handle: None,
                    cancellable: match &target {
                        Target::Remote { record, .. } => {
                            req.path == pb::Path::Bounce as i32
                                || (req.path == pb::Path::Auto as i32
                                    && gpu_hand_off(src_pool.kind(), record))
                        }
                        Target::Local(_) => false,
                    },
                    cancel_requested: false,
                },
            );
        }
        if matches!(target, Target::Remote { .. }) {
            crate::runtime::faults::before_route();
        }
        let result = match target {
            #[cfg(feature = "cuda")]
            Target::Local(dst) if block_kernel => {
                self.local_blocks_gpu(s, req.request_id, &src_pool, &dst, &req, bytes, received)
            }
            Target::Local(dst) => {
                self.local_copy(s, req.request_id, &src_pool, &dst, &descs, received)
            }
            Target::Remote { agent, record } => {
                self.remote_write(s, &req, &agent, &record, descs, timeout, received, trace)
            }
        };
        s.in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&req.request_id);
        let mut r = result?;
        r.bytes = bytes;
        if r.outcome == pb::Outcome::Success as i32 {
            s.succeeded.fetch_add(1, Ordering::Relaxed);
            self.succeeded.fetch_add(1, Ordering::Relaxed);
            s.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        } else {
            s.failed.fetch_add(1, Ordering::Relaxed);
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(r)
    }

    /// The same-node direct path between two GPU pools, whole blocks: one
    /// launch of the block-id kernel (issue 19), then the arrival.
    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments)]
    fn local_blocks_gpu(
        &self,
        s: &Arc<Session>,
        request_id: u64,
        src: &Arc<MappedPool>,
        dst: &Arc<Session>,
        req: &pb::TransferRequest,
        bytes: u64,
        received: Instant,
    ) -> Result<pb::TransferResponse, Status> {
        let dst_pool = dst
            .pool()
            .ok_or_else(|| Status::failed_precondition("destination pool went away"))?;
        let submit_us = received.elapsed().as_micros() as u64;
        let t0 = Instant::now();
        let engine = self.direct_engine()?;
        let (sl, dl) = (&s.layout, &dst.layout);
        let nplanes = sl.layers * sl.planes() as u32;
        engine
            .copy_blocks(
                src.addr,
                dst_pool.addr,
                &req.src_blocks,
                &req.dst_blocks,
                nplanes,
                u64::from(sl.num_blocks) * sl.block_bytes,
                u64::from(dl.num_blocks) * dl.block_bytes,
                sl.block_bytes,
            )
            .map_err(|e| Status::internal(format!("direct copy kernel: {e}")))?;
        let transfer_us = t0.elapsed().as_micros() as u64;
        tracing::debug!(
            blocks = req.src_blocks.len(),
            planes = nplanes,
            transfer_us,
            "direct block copy"
        );
        drop(dst_pool);
        let descriptors = (req.src_blocks.len() as u64 * u64::from(nplanes)) as u32;
        Ok(self.direct_done(
            s,
            dst,
            request_id,
            bytes,
            descriptors,
            submit_us,
            transfer_us,
        ))
    }

    /// A same-agent hand-off finished: the destination's arrival is
    /// recorded (its `AwaitArrival` resolves) and the answer built.
    #[allow(clippy::too_many_arguments)]
    fn direct_done(
        &self,
        s: &Session,
        dst: &Session,
        request_id: u64,
        bytes: u64,
        descriptors: u32,
        submit_us: u64,
        transfer_us: u64,
    ) -> pb::TransferResponse {
        dst.arrivals.fetch_add(1, Ordering::Relaxed);
        self.record_arrival(ArrivalNotice {
            src_engine: s.engine_id.clone(),
            dst_engine: dst.engine_id.clone(),
            request_id,
            bytes,
            outcome: "success".into(),
            reason: String::new(),
            traceparent: String::new(),
        });
        pb::TransferResponse {
            outcome: pb::Outcome::Success as i32,
            reason: String::new(),
            path: "direct".into(),
            bytes,
            descriptors,
            submit_us,
            transfer_us,
        }
    }

    /// Both engines on this agent: copy between the two mapped pools.
    fn local_copy(
        &self,
        s: &Arc<Session>,
        request_id: u64,
        src: &Arc<MappedPool>,
        dst: &Arc<Session>,
        descs: &[Descriptor],
        received: Instant,
    ) -> Result<pb::TransferResponse, Status> {
        let dst_pool = dst
            .pool()
            .ok_or_else(|| Status::failed_precondition("destination pool went away"))?;
        let submit_us = received.elapsed().as_micros() as u64;
        let t0 = Instant::now();
        match (src.kind(), dst_pool.kind()) {
            (MemKind::Dram, MemKind::Dram) => {
                for d in descs {
                    // SAFETY: every descriptor was range-checked against
                    // both pools' layouts (block ids / extents), and both
                    // mappings are held alive (`src`, `dst_pool`) for the
                    // copy.
                    unsafe {
                        std::ptr::copy(d.src as *const u8, d.dst as *mut u8, d.len as usize);
                    }
                }
            }
            #[cfg(feature = "cuda")]
            (MemKind::Vram, MemKind::Vram) => {
                // The same-node direct path (issue 19): one launch of the
                // gather/scatter kernel copies (src, dst, len) pairs
                // straight between the two pools (region base 0, so a
                // run's "region offset" is the absolute source), then the
                // copy's event is waited on.
                let engine = self.direct_engine()?;
                let t_runs = Instant::now();
                // Unmerged by default (one task per block); the merge is
                // kept for dense block lists (`KVFABRIC_DIRECT_MERGE=1`).
                let runs = kvfabric_core::layout::direct_runs(descs, self.direct_merge);
                let runs_us = t_runs.elapsed().as_micros() as u64;
                engine
                    .run(crate::runtime::cuda::Direction::Scatter, 0, &runs)
                    .map_err(|e| Status::internal(format!("direct copy kernel: {e}")))?;
                tracing::debug!(
                    descriptors = descs.len(),
                    runs = runs.len(),
                    runs_us,
                    total_us = t_runs.elapsed().as_micros() as u64,
                    "direct copy"
                );
            }
            (a, b) => {
                return Err(Status::unimplemented(format!(
                    "same-agent hand-off between a {a:?} pool and a {b:?} pool"
                )))
            }
        }
        let transfer_us = t0.elapsed().as_micros() as u64;
        drop(dst_pool);
        let _ = src;
        let bytes = descs.iter().map(|d| d.len).sum();
        Ok(self.direct_done(
            s,
            dst,
            request_id,
            bytes,
            descs.len() as u32,
            submit_us,
            transfer_us,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn remote_write(
        &self,
        s: &Arc<Session>,
        req: &pb::TransferRequest,
        agent: &str,
        record: &EngineRecord,
        descs: Vec<Descriptor>,
        timeout: Duration,
        received: Instant,
        trace: &mut Option<TransferTrace>,
    ) -> Result<pb::TransferResponse, Status> {
        let n = descs.len() as u32;
        let traced = trace.is_some();
        let bytes: u64 = descs.iter().map(|d| d.len).sum();
        let src_kind = s.pool().map_or(MemKind::Dram, |p| p.kind());
        let dst_kind = if record.layout.device >= 0 {
            MemKind::Vram
        } else {
            MemKind::Dram
        };
        let gpu_pools = gpu_hand_off(src_kind, record);
        // Bounce submitted here, past the routing gate: counted as the
        // gate counts its own (kvfabric_submissions_total and _bytes).
        let bounce = |t: &crate::runtime::transport::BounceTransport, descs| {
            let st = self.agent.stats();
            st.submit_bounce.fetch_add(1, Ordering::Relaxed);
            st.bytes_bounce.fetch_add(bytes, Ordering::Relaxed);
            t.submit_scoped(agent, descs, record.scope, traced)
        };
        let mut fallback = None;
        // Handed to the path from here (a traced bounce request's WANT can
        // go out before submit() returns).
        let handing = Instant::now();
        let (path, handle) = match pb::Path::try_from(req.path).unwrap_or(pb::Path::Auto) {
            pb::Path::Standard if gpu_pools => {
                return Err(Status::failed_precondition(
                    "path STANDARD is not available for GPU pools: an engine's CUDA IPC memory imported by the agent cannot be re-exported as a NIXL/UCX cuda_ipc write target (DESIGN.md); use AUTO or BOUNCE",
                ))
            }
            pb::Path::Auto if gpu_pools => {
                // CUDA IPC memory imported by an agent cannot be re-exported
                // to UCX cuda_ipc (DESIGN.md, H200 2026-12-01): NIXL can
                // write only agent-owned arenas, so GPU pools move through
                // bounce alone.
                // A rollout in progress is ridden out (bounded), not failed.
                match self.agent.bounce_transport_for(agent, timeout / 2) {
                    Ok(t) => (PathKind::Bounce, bounce(&t, descs)),
                    Err(why) => {
                        return Err(Status::failed_precondition(format!(
                            "GPU pools move through bounce only (an engine's imported CUDA memory cannot be a NIXL write target), and bounce to agent {} is not available: {}",
                            LogSafe(agent),
                            crate::service::http::describe_incompatibility(&why)
                        )))
                    }
                }
            }
            pb::Path::Auto => {
                let r = self.agent.submit_write_scoped(
                    agent,
                    descs,
                    src_kind,
                    dst_kind,
                    record.scope,
                    traced,
                );
                if r.0 == PathKind::Standard && self.agent.transport().is_some() {
                    fallback = Some(if self.agent.has_peer_handshake(agent) {
                        "routing_gate"
                    } else {
                        "peer_incompatible"
                    });
                }
                r
            }
            pb::Path::Standard => (PathKind::Standard, self.agent.submit_standard(agent, descs)),
            pb::Path::Bounce => match self.agent.bounce_transport_for(agent, timeout / 2) {
                Ok(t) => (PathKind::Bounce, bounce(&t, descs)),
                Err(why) => {
                    return Err(Status::failed_precondition(format!(
                        "bounce is not available to agent {}: {}",
                        LogSafe(agent),
                        crate::service::http::describe_incompatibility(&why)
                    )))
                }
            },
        };
        let submitted = Instant::now();
        let submit_us = submitted.duration_since(received).as_micros() as u64;
        let path_name = crate::service::metrics::path_label(path);
        let cancel_requested = s
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&req.request_id)
            .is_some_and(|f| {
                f.path = path_name;
                f.handle = Some((path, handle.clone()));
                f.cancel_requested
            });
        // A Cancel that came while the request was being routed (only
        // requests that move by bounce accept one): carried out now, the
        // receiver reclaims the flow.
        if cancel_requested && path == PathKind::Bounce {
            if let Some(t) = self.agent.transport() {
                t.cancel(handle.request_id, "cancelled by the engine");
            }
        }
        let t0 = Instant::now();
        let (outcome, reason) = match handle.wait(timeout) {
            Some(TransferOutcome::Success) => (pb::Outcome::Success, String::new()),
            Some(TransferOutcome::Failure(why)) => {
                let cancelled = why.contains("cancelled") || why.contains("engine detached");
                (
                    if cancelled {
                        pb::Outcome::Cancelled
                    } else {
                        pb::Outcome::Failure
                    },
                    why,
                )
            }
            None => {
                if let (PathKind::Bounce, Some(t)) = (path, self.agent.transport()) {
                    t.cancel(handle.request_id, "engine request timeout");
                }
                (
                    pb::Outcome::Timeout,
                    format!("not resolved within {timeout:?}"),
                )
            }
        };
        // The source pool truncated under the gather: what left was zeros,
        // not the engine's KV — a failure, on both sides.
        let (outcome, reason) = match (outcome, self.pool_truncated(s)) {
            (pb::Outcome::Success, Some(why)) => (pb::Outcome::Failure, why),
            // The cancel reached the transport after the last ACK: the
            // engine was told it was cancelled, so it is.
            (pb::Outcome::Success, None) if cancel_requested => (
                pb::Outcome::Cancelled,
                "cancelled by the engine while the request was being routed; it completed before the cancel took effect (its bytes landed)".into(),
            ),
            (o, _) => (o, reason),
        };
        let resolved = Instant::now();
        let transfer_us = resolved.duration_since(t0).as_micros() as u64;
        if let Some(t) = trace.as_mut() {
            t.path = Some((
                if path == PathKind::Bounce {
                    "kvfabric.bounce"
                } else {
                    "kvfabric.standard"
                },
                handing,
                resolved,
            ));
            (t.timeline, t.dropped) = handle.take_timeline();
            if let Some(f) = fallback {
                t.set(opentelemetry::KeyValue::new("kvfabric.fallback", f));
            }
            t.set(opentelemetry::KeyValue::new(
                "kvfabric.bounce_rid",
                handle.request_id as i64,
            ));
        }
        if let Some(m) = self.metrics.get() {
            m.observe_engine_transfer(&crate::service::metrics::EngineTransfer {
                agent: self.agent.name(),
                engine: &s.engine_id,
                peer: agent,
                path,
                fallback,
                ok: outcome == pb::Outcome::Success,
                timed_out: outcome == pb::Outcome::Timeout,
                bytes,
                elapsed: received.elapsed(),
            });
        }
        // Tell the destination agent (after the last ACK for bounce, after
        // NIXL completion for the standard path).
        if let Some(t) = self.agent.transport() {
            let notice = ArrivalNotice {
                src_engine: s.engine_id.clone(),
                dst_engine: record.engine_id.clone(),
                request_id: req.request_id,
                bytes,
                outcome: if outcome == pb::Outcome::Success {
                    "success".into()
                } else {
                    "failure".into()
                },
                reason: reason.clone(),
                traceparent: trace
                    .as_ref()
                    .map(TransferTrace::traceparent)
                    .unwrap_or_default(),
            };
            if let Ok(payload) = serde_json::to_vec(&notice) {
                t.send_notice(agent, NOTICE_TOPIC_ARRIVAL, payload);
                if let Some(tr) = trace.as_mut() {
                    tr.arrival_sent = Some(Instant::now());
                }
            }
        }
        if outcome != pb::Outcome::Success {
            tracing::warn!(engine = %LogSafe(&s.engine_id), request = req.request_id, rid = handle.request_id, dst = %LogSafe(&record.engine_id), path = path_name, reason = %reason, "engine transfer did not succeed");
        }
        Ok(pb::TransferResponse {
            outcome: outcome as i32,
            reason,
            path: path_name.into(),
            bytes,
            descriptors: n,
            submit_us,
            transfer_us,
        })
    }
}

/// The gRPC service over an [`EngineHub`].
#[derive(Clone)]
pub struct EngineService {
    hub: Arc<EngineHub>,
}

impl EngineService {
    /// The service for `hub`.
    pub fn new(hub: Arc<EngineHub>) -> Self {
        Self { hub }
    }
}

type EventStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::SessionEvent, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl EngineApi for EngineService {
    type AttachStream = EventStream;

    async fn attach(
        &self,
        req: Request<pb::AttachRequest>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let hub = self.hub.clone();
        let caller = caller_of(&req);
        let req = req.into_inner();
        // attach() republishes the agent's record (a bounded, blocking
        // store call): off the async threads.
        let s = tokio::task::spawn_blocking(move || hub.attach(&req, caller))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        let (tx, rx) = mpsc::channel::<Result<pb::SessionEvent, Status>>(4);
        let attached = pb::SessionEvent {
            event: Some(pb::session_event::Event::Attached(pb::Attached {
                session: s.id.clone(),
                agent: self.hub.agent.name().to_string(),
                layout_fingerprint: s.fingerprint.clone(),
                incarnation: s.incarnation,
            })),
        };
        let _ = tx.send(Ok(attached)).await;
        let hub = self.hub.clone();
        tokio::spawn(async move {
            let mut beat = tokio::time::interval(HEARTBEAT);
            beat.tick().await;
            let why = loop {
                tokio::select! {
                    _ = tx.closed() => break "client gone (Attach stream closed)",
                    _ = s.close.notified() => {
                        let reason = s.close_reason.lock().unwrap_or_else(|p| p.into_inner()).clone();
                        let _ = tx
                            .send(Ok(pb::SessionEvent {
                                event: Some(pb::session_event::Event::Closing(pb::Closing { reason })),
                            }))
                            .await;
                        break "detached";
                    }
                    _ = beat.tick() => {
                        let hb = pb::SessionEvent { event: Some(pb::session_event::Event::Heartbeat(pb::Heartbeat {})) };
                        // Never block on a client that stopped reading: a
                        // full stream just skips the heartbeat.
                        if let Err(mpsc::error::TrySendError::Closed(_)) = tx.try_send(Ok(hb)) {
                            break "client gone (heartbeat failed)";
                        }
                    }
                }
            };
            let id = s.id.clone();
            drop(s);
            let _ = tokio::task::spawn_blocking(move || hub.detach(&id, why)).await;
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn register_pool(
        &self,
        req: Request<pb::RegisterPoolRequest>,
    ) -> Result<Response<pb::RegisterPoolResponse>, Status> {
        let caller = caller_of(&req);
        let req = req.into_inner();
        let s = self.hub.session_for(&req.session, caller)?;
        match req.memory {
            Some(pb::register_pool_request::Memory::Shm(shm)) => {
                let hub = self.hub.clone();
                let len =
                    tokio::task::spawn_blocking(move || hub.register_shm(&s, &shm.name, shm.len))
                        .await
                        .map_err(|e| Status::internal(e.to_string()))??;
                Ok(Response::new(pb::RegisterPoolResponse { len }))
            }
            #[cfg(feature = "cuda")]
            Some(pb::register_pool_request::Memory::CudaIpc(ipc)) => {
                let hub = self.hub.clone();
                let len = tokio::task::spawn_blocking(move || hub.register_cuda_ipc(&s, &ipc))
                    .await
                    .map_err(|e| Status::internal(e.to_string()))??;
                Ok(Response::new(pb::RegisterPoolResponse { len }))
            }
            #[cfg(not(feature = "cuda"))]
            Some(pb::register_pool_request::Memory::CudaIpc(_)) => Err(Status::unimplemented(
                "CUDA IPC pools need an agent built with the `cuda` feature (kvfabric-gpu agent)",
            )),
            None => Err(Status::invalid_argument(
                "memory: missing (shm or cuda_ipc)",
            )),
        }
    }

    async fn transfer(
        &self,
        req: Request<pb::TransferRequest>,
    ) -> Result<Response<pb::TransferResponse>, Status> {
        let received = Instant::now();
        let caller = caller_of(&req);
        let req = req.into_inner();
        let s = self.hub.session_for(&req.session, caller)?;
        // Untraced agents: one empty OnceLock checked.
        let trace = self.hub.traces.get().and_then(|t| {
            t.begin_transfer(&req.traceparent, received, || {
                vec![
                    opentelemetry::KeyValue::new("kvfabric.request_id", req.request_id as i64),
                    opentelemetry::KeyValue::new("kvfabric.engine", s.engine_id.clone()),
                    opentelemetry::KeyValue::new("kvfabric.dst_engine", req.dst_engine.clone()),
                    opentelemetry::KeyValue::new(
                        "kvfabric.agent",
                        self.hub.agent.name().to_string(),
                    ),
                ]
            })
        });
        let hub = self.hub.clone();
        let r =
            tokio::task::spawn_blocking(move || hub.transfer_blocking(&s, req, received, trace))
                .await
                .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(r))
    }

    async fn await_arrival(
        &self,
        req: Request<pb::AwaitArrivalRequest>,
    ) -> Result<Response<pb::AwaitArrivalResponse>, Status> {
        let caller = caller_of(&req);
        let req = req.into_inner();
        let s = self.hub.session_for(&req.session, caller)?;
        let timeout = if req.timeout_ms == 0 {
            self.hub.request_timeout
        } else {
            Duration::from_millis(u64::from(req.timeout_ms))
        };
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.hub.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(a) = self
                .hub
                .take_arrival(&s.engine_id, &req.src_engine, req.request_id)?
            {
                let ok = a.outcome == "success";
                return Ok(Response::new(pb::AwaitArrivalResponse {
                    outcome: if ok {
                        pb::Outcome::Success
                    } else {
                        pb::Outcome::Failure
                    } as i32,
                    reason: a.reason,
                    src_engine: a.src_engine,
                    bytes: a.bytes,
                }));
            }
            if self.hub.session_for(&req.session, caller).is_err() {
                return Err(Status::not_found("session detached while waiting"));
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Ok(Response::new(pb::AwaitArrivalResponse {
                    outcome: pb::Outcome::Timeout as i32,
                    reason: format!(
                        "request {} did not arrive within {timeout:?}",
                        req.request_id
                    ),
                    src_engine: req.src_engine,
                    bytes: 0,
                }));
            }
        }
    }

    async fn cancel(
        &self,
        req: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::CancelResponse>, Status> {
        let caller = caller_of(&req);
        let req = req.into_inner();
        let s = self.hub.session_for(&req.session, caller)?;
        let h = {
            let mut inf = s.in_flight.lock().unwrap_or_else(|p| p.into_inner());
            match inf.get_mut(&req.request_id) {
                // Still being routed (listed in flight, not submitted yet):
                // accepted, carried out by the transfer once submitted.
                Some(f) if f.handle.is_none() && f.cancellable => {
                    f.cancel_requested = true;
                    return Ok(Response::new(pb::CancelResponse { cancelled: true }));
                }
                f => f.and_then(|f| f.handle.clone()),
            }
        };
        // Bounce requests are cancelled in the transport (the receiver
        // reclaims the flow); a standard-path write cannot be recalled and
        // resolves by itself within the request timeout.
        let cancelled = match h {
            Some((PathKind::Bounce, h)) => {
                let t_req = h.request_id;
                let agent = self.hub.agent.clone();
                tokio::task::spawn_blocking(move || {
                    agent
                        .transport()
                        .is_some_and(|t| t.cancel(t_req, "cancelled by the engine"))
                })
                .await
                .unwrap_or(false)
            }
            _ => false,
        };
        Ok(Response::new(pb::CancelResponse { cancelled }))
    }

    async fn status(
        &self,
        req: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let s = self
            .hub
            .session_for(&req.get_ref().session, caller_of(&req))?;
        let in_flight = s
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(rid, f)| pb::InFlight {
                request_id: *rid,
                dst_engine: f.dst_engine.clone(),
                path: f.path.into(),
                bytes: f.bytes,
                age_us: f.started.elapsed().as_micros() as u64,
            })
            .collect();
        Ok(Response::new(pb::StatusResponse {
            engine_id: s.engine_id.clone(),
            in_flight,
            transfers_succeeded: s.succeeded.load(Ordering::Relaxed),
            transfers_failed: s.failed.load(Ordering::Relaxed),
            bytes_sent: s.bytes_sent.load(Ordering::Relaxed),
            arrivals: s.arrivals.load(Ordering::Relaxed),
            pool_len: s.pool().map_or(0, |p| p.len),
        }))
    }

    async fn detach(
        &self,
        req: Request<pb::DetachRequest>,
    ) -> Result<Response<pb::DetachResponse>, Status> {
        let caller = caller_of(&req);
        let id = req.into_inner().session;
        self.hub.session_for(&id, caller)?;
        let hub = self.hub.clone();
        let _ = tokio::task::spawn_blocking(move || hub.detach(&id, "Detach")).await;
        Ok(Response::new(pb::DetachResponse {}))
    }
}

/// Binds the engine API socket at `path` (mode 0660; parent directories
/// created; a stale socket file left by a dead agent replaced).
///
/// # Errors
/// A message naming the path when it exists and is not a socket, is served
/// by a live process, or cannot be bound.
pub fn bind_socket(path: &Path) -> Result<tokio::net::UnixListener, String> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let shown = path.display();
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("engineSocket {shown}: creating {}: {e}", dir.display()))?;
        }
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(format!("engineSocket {shown}: exists and is not a socket"));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!("engineSocket {shown}: another agent is serving it"));
        }
        std::fs::remove_file(path)
            .map_err(|e| format!("engineSocket {shown}: removing the stale socket: {e}"))?;
    }
    let l =
        tokio::net::UnixListener::bind(path).map_err(|e| format!("engineSocket {shown}: {e}"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| format!("engineSocket {shown}: chmod 0660: {e}"))?;
    Ok(l)
}

/// Serves the engine API on `listener` until `shutdown` resolves.
///
/// # Errors
/// The transport error tonic reports.
pub async fn serve(
    listener: tokio::net::UnixListener,
    hub: Arc<EngineHub>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .add_service(EngineApiServer::new(EngineService::new(hub)))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            shutdown,
        )
        .await
        .map_err(|e| format!("engine API: {e}"))
}

/// The socket path as configured, or `None` for "off".
pub fn socket_path(configured: &str, gpu_uuid: Option<&str>) -> Result<Option<PathBuf>, String> {
    let t = configured.trim();
    if t.is_empty() {
        return Ok(None);
    }
    let path = if t.contains(GPU_UUID_PLACEHOLDER) {
        let Some(u) = gpu_uuid else {
            return Err(format!(
                "engineSocket {t:?}: {GPU_UUID_PLACEHOLDER} needs the UUID of the agent's GPU (set gpu; the driver must report it)"
            ));
        };
        t.replace(GPU_UUID_PLACEHOLDER, u)
    } else {
        t.to_string()
    };
    if path.contains(['{', '}']) {
        return Err(format!(
            "engineSocket {t:?}: the only placeholder is {GPU_UUID_PLACEHOLDER}"
        ));
    }
    Ok(Some(PathBuf::from(path)))
}

/// The placeholder an `engineSocket` path may hold for the UUID of the
/// agent's GPU (canonical text, `kvfabric_core::layout::format_gpu_uuid`):
/// with one agent per GPU on a node (the chart's `agent.gpu.count`), each
/// serves `<dir>/<its GPU's UUID>.sock`, and an engine finds its agent from
/// its own GPU's UUID (Python: `kvfabric.engine_socket`) — ordinals are
/// per process and do not name a GPU across pods.
pub const GPU_UUID_PLACEHOLDER: &str = "{gpu_uuid}";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::fabric::{metadata_fingerprint, PeerDescriptor};
    use crate::service::discovery::{AgentRecord, Incarnation};

    fn engine(id: &str, pool_addr: u64) -> EngineRecord {
        EngineRecord {
            engine_id: id.into(),
            pod_uid: String::new(),
            role: "decode".into(),
            layout: EngineLayout {
                layers: 1,
                num_blocks: 4,
                block_bytes: 64,
                kv_split: false,
                dtype: "u8".into(),
                tp_rank: 0,
                tp_size: 1,
                block_tokens: 1,
                kv_heads: 1,
                head_dim: 64,
                device: -1,
                device_uuid: String::new(),
            },
            fingerprint: String::new(),
            pool_addr,
            pool_len: 256,
            pool_kind: "dram".into(),
            scope: 1,
            incarnation: 7,
        }
    }

    fn record(name: &str, metadata: &[u8], engines: Vec<EngineRecord>) -> AgentRecord {
        let desc = PeerDescriptor {
            name: name.into(),
            nixl_metadata: metadata.to_vec(),
            handshake: None,
            draining: false,
        };
        let mut r = AgentRecord::new(&desc, name, Incarnation(1));
        r.engines = engines;
        r
    }

    fn arrival(rid: u64) -> ArrivalNotice {
        ArrivalNotice {
            src_engine: "p".into(),
            dst_engine: "d".into(),
            request_id: rid,
            bytes: 1,
            outcome: "success".into(),
            reason: String::new(),
            traceparent: String::new(),
        }
    }

    /// Pending arrivals expire after the TTL, are capped (oldest evicted),
    /// and the stamps of arrivals already taken do not pile up.
    #[test]
    fn pending_arrivals_expire_are_capped_and_stay_compact() {
        let t0 = Instant::now();
        let mut g = Arrivals::default();
        let n = MAX_PENDING_ARRIVALS as u64;
        for rid in 0..n + 10 {
            g.insert(arrival(rid), t0 + Duration::from_micros(rid));
        }
        assert_eq!(g.done.len(), MAX_PENDING_ARRIVALS);
        assert!(
            !g.done.contains_key(&("d".into(), "p".into(), 9)),
            "oldest kept"
        );
        assert!(g.done.contains_key(&("d".into(), "p".into(), 10)));
        // Past the TTL, one insert clears every expired entry.
        g.insert(arrival(u64::MAX), t0 + ARRIVAL_TTL + Duration::from_secs(1));
        assert_eq!(g.done.len(), 1);
        // One arrival waits while others are taken as they come: the
        // stale stamps behind it are compacted away, it stays.
        let mut g = Arrivals::default();
        g.insert(arrival(0), t0);
        for rid in 1..200_000u64 {
            g.insert(arrival(rid), t0 + Duration::from_micros(rid));
            g.done.remove(&("d".into(), "p".into(), rid));
        }
        assert_eq!(g.done.len(), 1);
        assert!(g.done.contains_key(&("d".into(), "p".into(), 0)));
        assert!(g.order.len() <= 1027, "{} stamps left", g.order.len());
    }

    /// A peer's published pool is trusted only when it holds its layout
    /// without wrapping the address space (else a Transfer into it would
    /// overflow computing block addresses).
    #[test]
    fn a_published_pool_must_hold_its_layout_within_the_address_space() {
        let good = engine("d", 0x1000);
        assert!(published_pool_holds_layout(&good));
        // Address + length past u64::MAX.
        assert!(!published_pool_holds_layout(&engine("d", u64::MAX - 100)));
        // Shorter than the layout (4 blocks × 64 bytes = 256).
        let mut short = engine("d", 0x1000);
        short.pool_len = 255;
        assert!(!published_pool_holds_layout(&short));
        // A layout that does not validate.
        let mut bad = engine("d", 0x1000);
        bad.layout.block_bytes = 0;
        assert!(!published_pool_holds_layout(&bad));
    }

    /// The race of a CI run of 781a503: the peer's record already names
    /// the engine (its pool registered, metadata "md-2") while the fabric
    /// still has the peer's previous metadata ("md-1") loaded — the engine
    /// is not known yet, and becomes known once "md-2" is loaded.
    #[test]
    fn a_record_whose_metadata_is_not_loaded_does_not_resolve() {
        let recs = vec![record("b", b"md-2", vec![engine("decode-0", 0x1000)])];
        let mut loaded = Some(metadata_fingerprint(b"md-1"));
        let lookup = |loaded: Option<u64>| {
            lookup_remote(&recs, "a", "decode-0", |p| loaded.filter(|_| p == "b"))
        };
        assert_eq!(
            lookup(loaded),
            RemoteLookup::NotLoaded { agent: "b".into() }
        );
        assert_eq!(
            lookup(None),
            RemoteLookup::NotLoaded { agent: "b".into() },
            "a peer not loaded at all"
        );
        loaded = Some(metadata_fingerprint(b"md-2"));
        assert_eq!(
            lookup(loaded),
            RemoteLookup::Found {
                agent: "b".into(),
                record: Box::new(engine("decode-0", 0x1000)),
            }
        );
        assert_eq!(
            lookup_remote(&recs, "a", "decode-1", |_| loaded),
            RemoteLookup::Absent
        );
    }

    /// A loaded record naming the engine wins over one not loaded, in any
    /// order; the own record is never a remote destination.
    #[test]
    fn only_loaded_records_of_other_agents_resolve() {
        let stale = record("c", b"md-c", vec![engine("decode-0", 0x2000)]);
        let live = record("b", b"md-b", vec![engine("decode-0", 0x1000)]);
        let loaded = |p: &str| (p == "b").then(|| metadata_fingerprint(b"md-b"));
        for recs in [
            vec![stale.clone(), live.clone()],
            vec![live.clone(), stale.clone()],
        ] {
            assert_eq!(
                lookup_remote(&recs, "a", "decode-0", loaded),
                RemoteLookup::Found {
                    agent: "b".into(),
                    record: Box::new(engine("decode-0", 0x1000)),
                }
            );
        }
        assert_eq!(
            lookup_remote(&[live], "b", "decode-0", loaded),
            RemoteLookup::Absent
        );
    }
}
