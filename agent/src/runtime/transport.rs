//! The bounce reactor (seed §4 `BounceTransport`, §6–§9): one IO thread per
//! agent owns the credit scheduler, the sender request table and the
//! receiver region table; copy workers run gathers and scatters and report
//! back. Both roles share one arena.
//!
//! Per tick (seed §7): drain commands (submit / add peer / forget peer /
//! shutdown); receive control messages and dispatch them; drain copy
//! completions (gather ready → post write; scatter done → ACK + free +
//! reschedule); poll in-flight writes (SUCCESS → DATA); retry parked work;
//! drain send-side orphans; check no-progress timeouts. Polling is adaptive:
//! while writes are in flight the thread polls the engine (spinning briefly,
//! then yielding); otherwise it blocks in the control channel's receive for
//! at most 1 ms, and a control message, a copy completion (workers signal
//! the IO thread's [`Waker`]) or a command wakes it at once — so waiting on
//! copies or peers never burns a core the copy workers need. With a
//! busy-poll window (`ioBusyPollUs`, on by default only with ≥ 8 CPUs) the
//! IO thread, the copy workers and a few waiting callers poll for that long
//! after their last event instead, trading cores for wake-ups.
//!
//! Deviation from the seed, on purpose: `submit()` hands the request to the
//! IO thread, which performs the eager gather staging itself, so the
//! scheduler has exactly one owner and no lock (the seed lets app threads
//! call `acquireLocal` directly).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use kvfabric_core::plan::{ChunkBound, TransferPlan};
use kvfabric_core::scheduler::CreditScheduler;
use kvfabric_core::wire::{
    self, Ack, Credit, Data, Grant, Message, Notice, Reject, RejectReason, Want,
};
use kvfabric_core::{Descriptor, FlowKey, ScatterRun};

use super::control::{ControlChannel, ControlError};
use super::engine::{MemDesc, MemKind, TransferEngine, XferHandle, XferState};
use super::exec::{
    CopyDone, CopyEngine, CopyJob, CopyKind, CopyPlan, CopyWorkers, ExecPool, WorkerPrimer,
};
use super::waker::Waker;

/// Settings of one transport (the subset of `BounceConfig` the reactor
/// uses, already validated).
#[derive(Clone, Debug)]
pub struct TransportSettings {
    /// Buddy minimum block (bytes, power of two).
    pub granularity_bytes: u64,
    /// Per-chunk cap (bytes, multiple of 32, ≤ max allocation).
    pub max_chunk_size_bytes: u64,
    /// Per-flow in-flight cap W.
    pub max_inflight_chunks: usize,
    /// Exec contexts (concurrent copies).
    pub copy_contexts: usize,
    /// Copy worker threads.
    pub copy_workers: usize,
    /// No-progress timeout.
    pub request_timeout: Duration,
    /// Stage gathers before the GRANT arrives (seed §2).
    pub eager_gather: bool,
    /// Coalesce scatter runs (false = seed DISABLE_SCATTER_RUN_MERGING).
    pub merge_runs: bool,
    /// Busy-poll window: while the transport has work in flight (requests
    /// waiting for GRANT/ACK, granted regions waiting for DATA, copies),
    /// the IO thread keeps polling without blocking for up to this long
    /// after its last event; so do the copy workers after each job (and
    /// when primed by a submit or WANT) and up to
    /// [`MAX_SPINNING_WAITERS`] callers in [`TransferHandle::wait`]. A
    /// blocked IO thread pays a wake-up per control message — measured
    /// 100–400 µs per ZMQ hop on the H200 host (docs/benchmarks.md) — which
    /// at GPU speeds costs more than the data.
    /// Takes a core while active. From the bounce config's `ioBusyPollUs`
    /// ([`kvfabric_core::config::BusyPoll`]).
    pub busy_poll: Duration,
    /// Scatter destinations allowed from the start, `(addr, len)` bytes
    /// (more with [`BounceTransport::allow_scatter_range`]).
    pub allowed_scatter_ranges: Vec<(u64, u64)>,
    /// Engine scopes allowed from the start, `(scope, addr, len)`: the
    /// pool of the engine session `scope` (more with
    /// [`BounceTransport::allow_scope`]). A rebuilt transport gets the
    /// scopes attached now.
    pub scoped_ranges: Vec<(u64, u64, u64)>,
    /// Where NOTICEs go from the start (a rebuilt transport reads a kept
    /// control channel's backlog at once: a later sink would miss them).
    pub notice_sink: Option<Sender<(String, Notice)>>,
    /// The first request id (≥ 1): a rebuilt transport continues its
    /// predecessor's ids, so a cancel by id never hits another request and
    /// receivers' flows keyed by request id never collide.
    pub first_request_id: u64,
    /// Counters to continue (a rebuilt transport keeps its predecessor's,
    /// so exported `_total` counters never go backwards); `None`: fresh.
    /// The in-doubt flag is cleared: it described the old arena.
    pub stats: Option<Arc<TransportStats>>,
}

impl Default for TransportSettings {
    fn default() -> Self {
        Self {
            granularity_bytes: 1 << 20,
            max_chunk_size_bytes: 32 << 20,
            max_inflight_chunks: 8,
            copy_contexts: 8,
            copy_workers: 4,
            request_timeout: Duration::from_millis(30_000),
            eager_gather: true,
            merge_runs: true,
            busy_poll: Duration::ZERO,
            allowed_scatter_ranges: Vec::new(),
            scoped_ranges: Vec::new(),
            notice_sink: None,
            first_request_id: 1,
            stats: None,
        }
    }
}

/// The arena the transport slices: `len` bytes at `base` of memory `kind`
/// on `device_id`, already registered with the engine.
#[derive(Clone, Copy, Debug)]
pub struct ArenaSpec {
    /// Base address.
    pub base: u64,
    /// Size in bytes.
    pub len: u64,
    /// Memory kind.
    pub kind: MemKind,
    /// Device id (0 for host).
    pub device_id: u64,
}

/// How a transfer ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferOutcome {
    /// Every chunk landed and was scattered (all ACKed).
    Success,
    /// The transfer failed; the reason names the cause.
    Failure(String),
}

#[derive(Default)]
struct CompletionState {
    outcome: Option<TransferOutcome>,
}

/// A stage of a bounce request as its sending IO thread saw it: the seed's
/// NVTX ranges, recorded only for traced requests
/// ([`BounceTransport::submit_traced`]; issue 15, OpenTelemetry traces).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// WANT sent to the receiver (chunk 0; the request is planned).
    Want,
    /// The chunk was gathered into its staging region.
    Gathered,
    /// Its NIXL write into the granted region was posted.
    WritePosted,
    /// The write landed and its DATA was sent (the receiver may scatter).
    DataSent,
    /// Its ACK came back: the receiver scattered the chunk.
    Acked,
}

impl Stage {
    /// The span event's name.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Want => "want",
            Stage::Gathered => "gather",
            Stage::WritePosted => "write",
            Stage::DataSent => "data",
            Stage::Acked => "ack",
        }
    }
}

/// One [`Stage`] of one chunk, timed by the IO thread.
#[derive(Clone, Copy, Debug)]
pub struct StageEvent {
    /// Which stage.
    pub stage: Stage,
    /// The chunk's index in its request.
    pub chunk: u32,
    /// When the IO thread saw it (an instant it takes anyway).
    pub at: Instant,
}

/// Most stage events kept per traced request (later ones are counted, not
/// kept: a span's events stay bounded).
pub const MAX_STAGE_EVENTS: usize = 1024;

/// The stage events of a traced request (see [`Completion::note`]).
#[derive(Default)]
struct Timeline {
    events: Vec<StageEvent>,
    dropped: u32,
}

/// Shared completion cell of one request (the seed's promise/future).
#[derive(Default)]
pub struct Completion {
    state: Mutex<CompletionState>,
    cv: Condvar,
    /// Set (release) once `state.outcome` is: lets a waiter poll without
    /// the lock.
    resolved: AtomicBool,
    /// How long [`TransferHandle::wait`] polls before it blocks.
    spin: Duration,
    /// Stage events, for a traced request only (`None`: one branch on the
    /// IO thread, nothing recorded).
    timeline: Option<Mutex<Timeline>>,
}

impl Completion {
    /// A cell whose waiters poll for up to `spin` before blocking on the
    /// condition variable (the transport's busy-poll window: a blocked
    /// waiter pays a wake-up, 50–200 µs on the H200 host, after the
    /// transfer is already done). Zero blocks at once.
    pub(crate) fn with_spin(spin: Duration) -> Self {
        Self {
            spin,
            ..Self::default()
        }
    }

    /// Resolves once; later calls are ignored. Returns whether this call
    /// resolved it.
    pub(crate) fn resolve(&self, outcome: TransferOutcome) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.outcome.is_some() {
            return false;
        }
        s.outcome = Some(outcome);
        self.resolved.store(true, Ordering::Release);
        self.cv.notify_all();
        true
    }

    /// Records `stage` of `chunk` at `at` if the request is traced; the IO
    /// thread passes an instant it took anyway, so an untraced request
    /// costs one branch.
    #[inline]
    pub(crate) fn note(&self, stage: Stage, chunk: usize, at: Instant) {
        if let Some(t) = &self.timeline {
            let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
            if t.events.len() < MAX_STAGE_EVENTS {
                t.events.push(StageEvent {
                    stage,
                    chunk: chunk as u32,
                    at,
                });
            } else {
                t.dropped = t.dropped.saturating_add(1);
            }
        }
    }
}

/// Callers of [`TransferHandle::wait`] spinning now (process-wide).
static SPINNING_WAITERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Most callers that spin in [`TransferHandle::wait`] at once; the rest
/// block at once.
pub const MAX_SPINNING_WAITERS: usize = 4;

/// Handle of a submitted transfer; resolves SUCCESS or FAILURE (seed R5).
#[derive(Clone)]
pub struct TransferHandle {
    completion: Arc<Completion>,
    /// Request id (unique per transport).
    pub request_id: u64,
}

impl TransferHandle {
    /// A handle that is already resolved (e.g. rejected at submit).
    pub fn resolved(outcome: TransferOutcome) -> Self {
        let c = Arc::new(Completion::default());
        c.resolve(outcome);
        Self {
            completion: c,
            request_id: 0,
        }
    }

    /// A handle over an existing completion cell.
    pub(crate) fn from_completion(completion: Arc<Completion>) -> Self {
        Self {
            completion,
            request_id: 0,
        }
    }

    /// Waits at most `timeout` for the outcome; `None` if still running.
    ///
    /// With a busy-poll window (see [`TransportSettings::busy_poll`]) the
    /// caller's thread polls for up to that long (never past `timeout`)
    /// before it blocks — if fewer than [`MAX_SPINNING_WAITERS`] callers
    /// are spinning already.
    pub fn wait(&self, timeout: Duration) -> Option<TransferOutcome> {
        let start = Instant::now();
        let deadline = start + timeout;
        let spin = self.completion.spin.min(timeout);
        // At most MAX_SPINNING_WAITERS callers of the process spin at once
        // (a replay with 128 waiting threads must not take 128 cores); the
        // others block at once.
        if !spin.is_zero()
            && !self.completion.resolved.load(Ordering::Acquire)
            && SPINNING_WAITERS
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < MAX_SPINNING_WAITERS).then_some(n + 1)
                })
                .is_ok()
        {
            while !self.completion.resolved.load(Ordering::Acquire) && start.elapsed() < spin {
                std::hint::spin_loop();
            }
            SPINNING_WAITERS.fetch_sub(1, Ordering::AcqRel);
        }
        let mut s = self
            .completion
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(o) = &s.outcome {
                return Some(o.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s = self
                .completion
                .cv
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Takes the stage events recorded so far (traced requests only; empty
    /// otherwise) and how many were dropped past [`MAX_STAGE_EVENTS`].
    pub fn take_timeline(&self) -> (Vec<StageEvent>, u32) {
        match &self.completion.timeline {
            Some(t) => {
                let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
                (
                    std::mem::take(&mut t.events),
                    std::mem::take(&mut t.dropped),
                )
            }
            None => (Vec::new(), 0),
        }
    }

    /// The outcome if already resolved.
    pub fn try_outcome(&self) -> Option<TransferOutcome> {
        self.completion
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .outcome
            .clone()
    }
}

/// Counters of one transport (monotonic; read with [`BounceTransport::stats`]).
#[derive(Debug, Default)]
pub struct TransportStats {
    /// Requests submitted to bounce.
    pub submitted: AtomicU64,
    /// Requests resolved SUCCESS.
    pub succeeded: AtomicU64,
    /// Requests resolved FAILURE.
    pub failed: AtomicU64,
    /// Of which by no-progress timeout.
    pub timeouts: AtomicU64,
    /// Payload bytes of successful requests.
    pub bytes_sent: AtomicU64,
    /// Chunks written (RDMA writes that reached SUCCESS).
    pub chunks_written: AtomicU64,
    /// Credits granted by this agent's receiver role (GRANTs actually sent).
    pub grants: AtomicU64,
    /// Chunks scattered and ACKed by the receiver role.
    pub chunks_scattered: AtomicU64,
    /// DATA dropped (late after cancel, or invalid runs).
    pub data_rejected: AtomicU64,
    /// WANTs rejected (bad endpoint, bad chunk sizes).
    pub wants_rejected: AtomicU64,
    /// Cancels (empty WANT) received.
    pub cancels_received: AtomicU64,
    /// WANTs dropped as replays: their flow is live or ended less than
    /// 2 × the request timeout ago.
    pub wants_stale: AtomicU64,
    /// Ended flows forgotten early because [`MAX_TOMBSTONES`] were kept.
    pub tombstones_evicted: AtomicU64,
    /// REJECTs received for our requests (the receiver refused them, or
    /// their destination engine detached).
    pub rejects_received: AtomicU64,
    /// Control messages dropped on a full queue.
    pub control_dropped: AtomicU64,
    /// Sum of credit wait (submit → first GRANT), microseconds.
    pub credit_wait_us: AtomicU64,
    /// Arena bytes in use (gauge, updated each tick).
    pub arena_bytes_in_use: AtomicU64,
    /// 1 while the scheduler is in drain mode (gauge).
    pub drain_mode: AtomicU64,
    /// Times the scheduler entered drain mode (counter; drain mode often
    /// lasts less than a scrape interval, so the gauge alone can miss it).
    pub drain_entries: AtomicU64,
    /// Chunks of this agent's bounce requests staged and not yet ACKed
    /// (gauge: gathering, gathered, writing or DATA sent; stored each tick).
    pub chunks_in_flight: AtomicU64,
    /// Live flows of this agent's receiver role: incoming requests the
    /// credit scheduler tracks, from their WANT until their last ACK or
    /// reclaim (gauge, a count; stored by the IO thread each tick).
    pub recv_flows: AtomicU64,
    /// Live flows of this agent's sender role: bounce requests in the IO
    /// thread's request table, from their submit command until resolution
    /// (gauge, a count; stored by the IO thread each tick).
    pub send_flows: AtomicU64,
    /// Set at shutdown when writes that read the arena were still in flight
    /// at its 5 s bound: the arena's owner must not free or reuse the
    /// memory (the NIC may still read it). [`crate::runtime::fabric::FabricAgent`]
    /// then leaks it.
    pub arena_in_doubt: AtomicBool,
    /// Transport report per peer, once [`PROBE_CHUNKS`] chunk writes to it
    /// landed (see [`TransportReport`]).
    pub transport_reports: Mutex<HashMap<String, TransportReport>>,
}

/// What the first chunk writes to a peer showed about the transport UCX
/// picked, logged once per peer (seed 004, "silent fallback": UCX may
/// quietly move GPU data by software emulation or TCP, ~2000x slower than
/// `cuda_ipc` or RDMA, and nothing else reports it). The fastest of the
/// first [`PROBE_CHUNKS`] writes is judged, so a cold first write (memory
/// handle opening) or writes queued behind each other under load do not
/// raise a false alarm.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransportReport {
    /// Chunk writes measured.
    pub chunks: u32,
    /// Bytes they moved (packed region sizes, padding included).
    pub bytes: u64,
    /// Fastest single chunk write, post to engine SUCCESS, in MB/s (1e6 B/s).
    pub best_chunk_mbps: u64,
    /// Bytes of that fastest chunk.
    pub best_chunk_bytes: u64,
    /// This agent's arena memory (`Dram` / `Vram`).
    pub local_kind: String,
    /// The peer's arena memory.
    pub remote_kind: String,
    /// GPU to GPU and even the fastest write of at least
    /// [`SLOW_GPU_MIN_BYTES`] ran below [`SLOW_GPU_GBPS`]: the writes most
    /// likely did not use `cuda_ipc`/RDMA (a warning is logged).
    pub suspect_fallback: bool,
}

/// Chunk writes to a peer measured before its [`TransportReport`] is made.
pub const PROBE_CHUNKS: u32 = 4;
/// GPU to GPU chunk writes below this rate (GB/s) are reported as a likely
/// silent transport fallback: `cuda_ipc` over NVLink/PCIe and GPUDirect RDMA
/// move tens to hundreds of GB/s, UCX software emulation and TCP at most a
/// few (measured on the H200: 0.1-0.3 GB/s with emulation, 250 GB/s with
/// `cuda_ipc` between two GPUs).
pub const SLOW_GPU_GBPS: f64 = 5.0;
/// Only a fastest chunk of at least this many bytes is judged (smaller
/// writes are latency-bound).
pub const SLOW_GPU_MIN_BYTES: u64 = 1 << 20;

/// The transport report's verdict: GPU to GPU (`gpu`), a fastest chunk of
/// at least [`SLOW_GPU_MIN_BYTES`] and still below [`SLOW_GPU_GBPS`].
pub fn suspect_fallback(gpu: bool, best_chunk_bytes: u64, best_chunk_mbps: u64) -> bool {
    gpu && best_chunk_bytes >= SLOW_GPU_MIN_BYTES && (best_chunk_mbps as f64) < SLOW_GPU_GBPS * 1e3
}

/// A snapshot of the arena accounting (for tests and `/v1` endpoints).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaSnapshot {
    /// Usable capacity (bytes).
    pub capacity: u64,
    /// Free bytes.
    pub free_bytes: u64,
    /// Bytes held by remote flows.
    pub held_bytes: u64,
    /// Bytes of local gather staging.
    pub local_held_bytes: u64,
    /// Bytes of orphaned regions awaiting their scatter.
    pub orphaned_bytes: u64,
    /// Live flows in the scheduler.
    pub flows: usize,
    /// Sender requests in the table.
    pub send_requests: usize,
    /// Send-side orphans (writes/gathers of failed requests) outstanding.
    pub send_orphans: usize,
    /// Result of the conservation check.
    pub conservation: Result<(), String>,
}

/// A failure injected by tests into the next posted writes.
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    /// Fail the poll of every write (engine reports failure).
    pub fail_writes: bool,
    /// Never answer WANTs (a receiver that never GRANTs).
    pub ignore_wants: bool,
    /// Report every write as still in flight forever (a NIC that never
    /// completes).
    pub hang_writes: bool,
}

enum Command {
    /// A request follows: stay hot (a command restarts the idle spin).
    Prime,
    Submit {
        rid: u64,
        peer: String,
        /// The destination scope carried in the WANT (0: the peer's own pool).
        scope: u64,
        descs: Vec<Descriptor>,
        /// From `TransferPlan::chunk_bounds`, run by the submitting thread.
        chunks: Vec<ChunkBound>,
        completion: Arc<Completion>,
    },
    AddPeer {
        peer: String,
        endpoint: Vec<u8>,
        kind: MemKind,
        reply: Sender<Result<(), ControlError>>,
    },
    ForgetPeer {
        peer: String,
        reply: Sender<()>,
    },
    AllowScatter {
        addr: u64,
        len: u64,
    },
    AllowScope {
        scope: u64,
        addr: u64,
        len: u64,
    },
    ForgetScope {
        scope: u64,
        reply: Sender<usize>,
    },
    DisallowScatter {
        addr: u64,
        len: u64,
        reply: Sender<()>,
    },
    /// Like DisallowScatter, without taking the range out of `allowed`.
    Quiesce {
        addr: u64,
        len: u64,
        reply: Sender<()>,
    },
    Cancel {
        rid: u64,
        why: String,
        reply: Sender<bool>,
    },
    Notice {
        peer: String,
        notice: Notice,
    },
    NoticeSink(Sender<(String, Notice)>),
    Snapshot {
        reply: Sender<ArenaSnapshot>,
    },
    Faults(FaultPlan),
    SendRaw {
        peer: String,
        bytes: Vec<u8>,
    },
    Shutdown,
}

/// Destination bounds [start, end) of validated scatter runs (start =
/// lowest run address, end = highest run end); (0, 0) for none.
fn scatter_bounds(runs: &[ScatterRun]) -> (u64, u64) {
    let mut lo = u64::MAX;
    let mut hi = 0u64;
    for r in runs {
        let end = u64::from(r.count.saturating_sub(1))
            .saturating_mul(r.addr_stride)
            .saturating_add(r.addr)
            .saturating_add(r.segment_len);
        lo = lo.min(r.addr);
        hi = hi.max(end);
    }
    if runs.is_empty() {
        (0, 0)
    } else {
        (lo, hi)
    }
}

/// The bounce transport: a handle to the IO thread. `Send + Sync`; every
/// method is safe from any thread and never blocks longer than its stated
/// bound.
pub struct BounceTransport {
    name: String,
    endpoint: Vec<u8>,
    cmd: Sender<Command>,
    /// Signalled after every command, so a waiting IO thread wakes at once.
    waker: Arc<Waker>,
    /// The IO thread; it hands the control channel back when it ends
    /// ([`BounceTransport::shutdown_keep_channel`]).
    io: Mutex<Option<JoinHandle<Box<dyn ControlChannel>>>>,
    next_rid: AtomicU64,
    stats: Arc<TransportStats>,
    /// The busy-poll window, also the handles' wait spin.
    busy_poll: Duration,
    /// The plan's chunk cap, bytes (for the sizing pass in `submit`).
    max_chunk_size_bytes: u64,
    /// Wakes idle copy workers when a request is submitted.
    primer: WorkerPrimer,
    /// The per-request in-flight cap `W`, chunks.
    max_inflight: usize,
    /// Set by the IO thread before its last drain of commands: a submit
    /// that sees it after queuing resolves its own handle (the drain may
    /// have missed it).
    closed: Arc<AtomicBool>,
    /// Set by the IO thread while it blocks in its channel's receive.
    io_blocked: Arc<AtomicBool>,
    /// Peer name → when a control message from it was last received, ms
    /// since the Unix epoch (to [`HEARD_GRANULARITY`]); see
    /// [`BounceTransport::last_heard_ms`].
    heard: Arc<Mutex<HashMap<String, i64>>>,
}

/// Granularity of [`BounceTransport::last_heard_ms`]: the IO thread
/// publishes a peer's time at most this often.
const HEARD_GRANULARITY: Duration = Duration::from_millis(50);

/// Ticks without any event before the IO thread yields between engine
/// polls (writes in flight) or blocks in the channel's receive (otherwise).
const SPIN_BEFORE_BACKOFF: u32 = 64;
/// Longest blocking wait of an IO thread with no write in flight (bytes
/// never wait on it: messages, copy completions and commands wake the
/// thread at once; it bounds timeout checks and engine progress for
/// targets of AM-emulated RMA).
const IDLE_WAIT: Duration = Duration::from_millis(1);

/// Most ended receiver flows remembered at once (≈ 250 bytes each: at most
/// ≈ 64 MB). Past it the oldest are forgotten first (counted in
/// [`TransportStats::tombstones_evicted`]): the replay guard then covers
/// less than 2 × the request timeout (only above ~2,200 flows/s ending
/// with the default 30 s timeout).
pub const MAX_TOMBSTONES: usize = 262_144;

/// Bound on synchronous commands (add/forget peer, snapshot).
const SYNC_TIMEOUT: Duration = Duration::from_secs(5);

impl BounceTransport {
    /// Starts the IO thread and copy workers over `engine`, `channel`,
    /// `copy` and the registered `arena`.
    ///
    /// # Errors
    /// A text error naming the arena/scheduler problem or the thread spawn
    /// failure.
    pub fn start(
        engine: Arc<dyn TransferEngine>,
        mut channel: Box<dyn ControlChannel>,
        copy: Arc<dyn CopyEngine>,
        arena: ArenaSpec,
        settings: TransportSettings,
    ) -> Result<Self, String> {
        let name = engine.agent_name().to_string();
        let scheduler = CreditScheduler::new(
            arena.len,
            settings.granularity_bytes,
            settings.max_inflight_chunks,
        )
        .map_err(|e| format!("bounce arena of {} bytes: {e}", arena.len))?;
        if settings.max_chunk_size_bytes > scheduler.max_allocation() {
            return Err(format!(
                "max chunk size {} bytes exceeds the arena's max allocation {} bytes",
                settings.max_chunk_size_bytes,
                scheduler.max_allocation()
            ));
        }
        // One max-size block kept back for credit-backed local staging (see
        // `Io::reserve_block`); only when the arena holds at least two.
        let reserve_block = scheduler
            .arena()
            .block_size(settings.max_chunk_size_bytes)
            .filter(|&b| scheduler.capacity() >= 2 * b);
        let endpoint = channel.local_endpoint();
        let busy_poll = settings.busy_poll;
        let max_chunk_size_bytes = settings.max_chunk_size_bytes;
        let max_inflight = settings.max_inflight_chunks.max(1);
        let first_request_id = settings.first_request_id.max(1);
        let initial_allowed = settings.allowed_scatter_ranges.clone();
        let mut initial_scopes: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
        for &(scope, addr, len) in &settings.scoped_ranges {
            initial_scopes.entry(scope).or_default().push((addr, len));
        }
        let initial_sink = settings.notice_sink.clone();
        let closed = Arc::new(AtomicBool::new(false));
        let io_blocked = Arc::new(AtomicBool::new(false));
        let waker = Arc::new(Waker::new().map_err(|e| format!("IO thread waker (eventfd): {e}"))?);
        channel.set_waker(waker.clone());
        let (cmd_tx, cmd_rx) = crossbeam_channel::unbounded();
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let workers = CopyWorkers::start(
            &name,
            settings.copy_workers,
            copy,
            done_tx,
            Some(waker.clone()),
            settings.busy_poll,
        )
        .map_err(|e| format!("spawning copy workers: {e}"))?;
        let primer = workers.primer();
        let stats = match &settings.stats {
            Some(s) => {
                s.arena_in_doubt.store(false, Ordering::SeqCst);
                s.clone()
            }
            None => Arc::new(TransportStats::default()),
        };
        let heard = Arc::new(Mutex::new(HashMap::new()));
        let mut io = Io {
            heard: heard.clone(),
            heard_at: HashMap::new(),
            name: name.clone(),
            engine,
            channel,
            endpoint: endpoint.clone(),
            arena,
            exec: ExecPool::new(vec![(); settings.copy_contexts.max(1)]),
            settings,
            scheduler,
            workers: Some(workers),
            done_rx,
            cmd_rx,
            stats: stats.clone(),
            closed: closed.clone(),
            io_blocked: io_blocked.clone(),
            peers: HashMap::new(),
            probes: HashMap::new(),
            requests: HashMap::new(),
            writes: Vec::new(),
            jobs: HashMap::new(),
            next_token: 1,
            regions: HashMap::new(),
            grant_index: HashMap::new(),
            flow_seen: HashMap::new(),
            scatter_queue: VecDeque::new(),
            orphan_writes: Vec::new(),
            deferred_cancels: HashMap::new(),
            allowed: initial_allowed,
            scopes: initial_scopes,
            flow_scope: HashMap::new(),
            ended: std::collections::HashSet::new(),
            ended_order: VecDeque::new(),
            disallowed: Vec::new(),
            notice_sink: initial_sink,
            faults: FaultPlan::default(),
            parked: false,
            reserve_block,
            tx_buf: Vec::new(),
        };
        let handle = std::thread::Builder::new()
            .name(format!("{name}-io"))
            .spawn(move || {
                io.run();
                io.channel
            })
            .map_err(|e| format!("spawning IO thread: {e}"))?;
        Ok(Self {
            name,
            endpoint,
            cmd: cmd_tx,
            waker,
            io: Mutex::new(Some(handle)),
            next_rid: AtomicU64::new(first_request_id),
            stats,
            busy_poll,
            max_chunk_size_bytes,
            primer,
            max_inflight,
            closed,
            io_blocked,
            heard,
        })
    }

    /// When a control message from `peer` was last received, ms since the
    /// Unix epoch (within 50 ms); `None` if never since it was loaded.
    /// Bounds the lease-path invalidation latency (issue 14).
    pub fn last_heard_ms(&self, peer: &str) -> Option<i64> {
        self.heard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(peer)
            .copied()
    }

    /// Queues `cmd` for the IO thread and wakes it.
    fn send_cmd(&self, cmd: Command) -> Result<(), crossbeam_channel::SendError<Command>> {
        let r = self.cmd.send(cmd);
        self.waker.wake();
        r
    }

    /// This agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This agent's control endpoint (advertised in the handshake / WANT).
    pub fn local_endpoint(&self) -> &[u8] {
        &self.endpoint
    }

    /// Counters.
    pub fn stats(&self) -> &TransportStats {
        &self.stats
    }

    /// The id the next submitted request gets (what a rebuilt transport
    /// starts from: [`TransportSettings::first_request_id`]).
    pub fn next_request_id(&self) -> u64 {
        self.next_rid.load(Ordering::Relaxed)
    }

    /// The counters, shared (they outlive a borrow of the transport, e.g.
    /// one taken from [`FabricAgent::transport`](super::fabric::FabricAgent::transport)).
    pub fn shared_stats(&self) -> Arc<TransportStats> {
        self.stats.clone()
    }

    /// The transport report for `peer`, once [`PROBE_CHUNKS`] chunk writes
    /// to it landed.
    pub fn transport_report(&self, peer: &str) -> Option<TransportReport> {
        self.stats
            .transport_reports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(peer)
            .cloned()
    }

    /// Registers a receiver peer: its control endpoint and the memory kind
    /// of its arena. Waits at most 5 s for the IO thread.
    ///
    /// # Errors
    /// [`ControlError::InvalidEndpoint`] for a malformed endpoint;
    /// [`ControlError::Transport`] if the IO thread is gone or slow.
    pub fn add_peer(&self, peer: &str, endpoint: &[u8], kind: MemKind) -> Result<(), ControlError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send_cmd(Command::AddPeer {
            peer: peer.to_string(),
            endpoint: endpoint.to_vec(),
            kind,
            reply: tx,
        })
        .map_err(|_| ControlError::Transport("transport is shut down".into()))?;
        rx.recv_timeout(SYNC_TIMEOUT)
            .map_err(|_| ControlError::Transport("IO thread did not answer add_peer".into()))?
    }

    /// Forgets `peer` synchronously (seed §9 "peer loss"): drops its route,
    /// reclaims all its flows (scattering regions deferred as orphans) and
    /// fails its in-flight requests. Returns once the IO thread has done it
    /// (at most 5 s).
    pub fn forget_peer(&self, peer: &str) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self
            .send_cmd(Command::ForgetPeer {
                peer: peer.to_string(),
                reply: tx,
            })
            .is_ok()
        {
            let _ = rx.recv_timeout(SYNC_TIMEOUT);
        }
    }

    /// Allows scatters into `[addr, addr + len)` (the registered KV memory).
    /// Scatter runs from a peer outside every allowed range are rejected
    /// (seed §9 "scatter input validation").
    pub fn allow_scatter_range(&self, addr: u64, len: u64) {
        let _ = self.send_cmd(Command::AllowScatter { addr, len });
    }

    /// Opens engine scope `scope` (≥ 1, unique per agent incarnation; an
    /// attached engine session) with its pool `[addr, addr + len)`: WANTs
    /// naming `scope` are served, and their DATA may scatter only into this
    /// range — not into another engine's pool, even one mapped where this
    /// engine's used to be (issue 12, engine-scoped flows). `scope` 0 is
    /// the agent's own memory ([`allow_scatter_range`](Self::allow_scatter_range)).
    pub fn allow_scope(&self, scope: u64, addr: u64, len: u64) {
        if scope == 0 {
            return self.allow_scatter_range(addr, len);
        }
        let _ = self.send_cmd(Command::AllowScope { scope, addr, len });
    }

    /// Closes engine scope `scope` (its engine detached): DATA of its
    /// flows no longer scatters — DATA already queued for a copy context
    /// is dropped too (the protocol simulator's bug 8) —, and each flow's
    /// sender gets a REJECT, so
    /// the request fails now rather than at its timeout; later WANTs naming
    /// `scope` are rejected. The flows' regions are freed by the sender's
    /// cancel, which it sends once its writes are terminal (seed §9: a
    /// region freed under a live write could be re-granted and
    /// overwritten), or by the silence timeout. Scatters already running
    /// finish (wait for them with
    /// [`disallow_scatter_range`](Self::disallow_scatter_range) before
    /// unmapping). Returns the number of flows told; 0 when the IO thread
    /// did not answer within 5 s.
    pub fn forget_scope(&self, scope: u64) -> usize {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self
            .send_cmd(Command::ForgetScope { scope, reply: tx })
            .is_err()
        {
            return 0;
        }
        rx.recv_timeout(SYNC_TIMEOUT).unwrap_or(0)
    }

    /// Takes `[addr, addr + len)` out of the allowed scatter destinations
    /// (an engine's pool going away) and waits at most `within` until no
    /// queued or running scatter writes into it any more. Returns `true`
    /// once that holds — only then may the memory be unmapped — and
    /// `false` past the bound (keep the memory; try again later). DATA for
    /// the range arriving after this call is rejected (seed §9 "scatter
    /// input validation").
    pub fn disallow_scatter_range(&self, addr: u64, len: u64, within: Duration) -> bool {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self
            .send_cmd(Command::DisallowScatter {
                addr,
                len,
                reply: tx,
            })
            .is_err()
        {
            // The IO thread is gone: nothing scatters any more.
            return self.closed.load(Ordering::SeqCst);
        }
        rx.recv_timeout(within).is_ok()
    }

    /// Waits at most `within` until no queued or running scatter writes
    /// into `[addr, addr + len)` (the range stays allowed): `true` once
    /// that held. A failed hand-off's arrival is reported only after this,
    /// so the decode engine never reuses blocks a late scatter still
    /// writes.
    pub fn quiesce_scatter_range(&self, addr: u64, len: u64, within: Duration) -> bool {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self
            .send_cmd(Command::Quiesce {
                addr,
                len,
                reply: tx,
            })
            .is_err()
        {
            return self.closed.load(Ordering::SeqCst);
        }
        rx.recv_timeout(within).is_ok()
    }

    /// Fails request `request_id` ("cancelled": its receiver reclaims the
    /// flow; staging is released once no gather or write uses it, seed §9).
    /// `false` when it was not in flight (already resolved, or unknown).
    /// Waits at most 5 s for the IO thread.
    pub fn cancel(&self, request_id: u64, why: &str) -> bool {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self
            .send_cmd(Command::Cancel {
                rid: request_id,
                why: why.to_string(),
                reply: tx,
            })
            .is_err()
        {
            return false;
        }
        rx.recv_timeout(SYNC_TIMEOUT).unwrap_or(false)
    }

    /// Sends a NOTICE (`topic`, `payload` of at most
    /// [`wire::MAX_ENDPOINT_LEN`] bytes) to `peer` on the control channel,
    /// in order after every message sent before it. Best effort: a full
    /// queue or an unknown peer drops it (logged).
    pub fn send_notice(&self, peer: &str, topic: u64, payload: Vec<u8>) {
        let _ = self.send_cmd(Command::Notice {
            peer: peer.to_string(),
            notice: Notice { topic, payload },
        });
    }

    /// Where NOTICE messages from peers go: `(peer name, notice)` on `tx`
    /// (dropped with a warning when `tx` is full). Replaces an earlier
    /// sink.
    pub fn set_notice_sink(&self, tx: Sender<(String, Notice)>) {
        let _ = self.send_cmd(Command::NoticeSink(tx));
    }

    /// Submits a WRITE of `descs` to `peer` through bounce. Never blocks;
    /// the handle resolves SUCCESS or FAILURE (at the latest after the
    /// request timeout without progress).
    ///
    /// The sizing pass ([`TransferPlan::chunk_bounds`]: validation and
    /// where each chunk starts, O(descriptors), ≈25 µs for 16,384 on a
    /// 2-core host) runs here on the caller's thread, whose cache holds
    /// the descriptors it just built, not on the IO thread that every
    /// request shares. Invalid descriptors (address or size overflow, too
    /// many chunks) resolve the handle FAILURE at once, with a message
    /// naming the descriptor.
    pub fn submit(&self, peer: &str, descs: Vec<Descriptor>) -> TransferHandle {
        self.submit_scoped(peer, descs, 0, false)
    }

    /// [`submit`](Self::submit) for a traced request: the IO thread records
    /// each chunk's [`Stage`]s (read with [`TransferHandle::take_timeline`])
    /// from instants it takes anyway.
    pub fn submit_traced(&self, peer: &str, descs: Vec<Descriptor>) -> TransferHandle {
        self.submit_scoped(peer, descs, 0, true)
    }

    /// [`submit`](Self::submit) into destination scope `scope` on `peer`:
    /// the engine session whose pool the descriptors' destinations lie in
    /// (from the peer's engine record; 0 = the peer agent's own pool). The
    /// receiver refuses a scope that is not attached, or that detaches
    /// mid-flow, with a REJECT: the handle resolves FAILURE at once, naming
    /// the reason. `traced` as in [`submit_traced`](Self::submit_traced).
    pub fn submit_scoped(
        &self,
        peer: &str,
        descs: Vec<Descriptor>,
        scope: u64,
        traced: bool,
    ) -> TransferHandle {
        let rid = self.next_rid.fetch_add(1, Ordering::Relaxed);
        let mut completion = Completion::with_spin(self.busy_poll);
        if traced {
            completion.timeline = Some(Mutex::new(Timeline::default()));
        }
        let completion = Arc::new(completion);
        let handle = TransferHandle {
            completion: completion.clone(),
            request_id: rid,
        };
        self.stats.submitted.fetch_add(1, Ordering::Relaxed);
        if !self.busy_poll.is_zero() && !descs.is_empty() {
            // Start the wake-ups of a blocked IO thread and of the idle copy
            // workers the request can use now, so they overlap the sizing
            // pass instead of following it. The chunk count is estimated
            // from the first descriptor (exact when all have its length).
            if self.io_blocked.load(Ordering::Acquire) {
                let _ = self.send_cmd(Command::Prime);
            }
            let estimate = (descs.len() as u64)
                .saturating_mul(descs[0].len)
                .div_ceil(self.max_chunk_size_bytes)
                .clamp(1, self.max_inflight as u64);
            self.primer.prime(estimate as usize);
        }
        let t_size = Instant::now();
        let chunks = match TransferPlan::chunk_bounds(&descs, self.max_chunk_size_bytes) {
            Ok(b) => b,
            Err(e) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                completion.resolve(TransferOutcome::Failure(format!("planning: {e}")));
                return handle;
            }
        };
        tracing::trace!(
            rid,
            chunks = chunks.len(),
            sizing_us = t_size.elapsed().as_micros() as u64,
            "sized"
        );
        let sent = self
            .send_cmd(Command::Submit {
                rid,
                peer: peer.to_string(),
                scope,
                descs,
                chunks,
                completion,
            })
            .is_ok();
        // Not sent, or sent after the IO thread's last drain (its queue is
        // then dropped unread): resolve here, once.
        if (!sent || self.closed.load(Ordering::SeqCst))
            && handle
                .completion
                .resolve(TransferOutcome::Failure("transport is shut down".into()))
        {
            self.stats.failed.fetch_add(1, Ordering::Relaxed);
        }
        handle
    }

    /// Arena accounting as seen by the IO thread (at most 5 s wait).
    pub fn snapshot(&self) -> Option<ArenaSnapshot> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send_cmd(Command::Snapshot { reply: tx }).ok()?;
        rx.recv_timeout(SYNC_TIMEOUT).ok()
    }

    /// Test hook: inject failures.
    pub fn set_faults(&self, faults: FaultPlan) {
        let _ = self.send_cmd(Command::Faults(faults));
    }

    /// Test hook: send raw control bytes to a peer from the IO thread.
    pub fn send_raw(&self, peer: &str, bytes: Vec<u8>) {
        let _ = self.send_cmd(Command::SendRaw {
            peer: peer.to_string(),
            bytes,
        });
    }

    /// Stops the IO thread: every in-flight request resolves FAILURE
    /// ("shutdown"), copy workers are joined, orphaned writes are drained
    /// (bounded). Idempotent.
    pub fn shutdown(&self) {
        drop(self.shutdown_keep_channel());
    }

    /// [`BounceTransport::shutdown`], handing the control channel back
    /// (bound socket, routes and connections intact) so a transport built
    /// next — a reconfiguration's — keeps this agent's control endpoint:
    /// peers' routes stay valid and nothing they send in between is lost.
    /// `None` when the transport was already shut down.
    pub fn shutdown_keep_channel(&self) -> Option<Box<dyn ControlChannel>> {
        let _ = self.send_cmd(Command::Shutdown);
        let handle = self.io.lock().unwrap_or_else(|p| p.into_inner()).take();
        handle.and_then(|h| h.join().ok())
    }
}

impl Drop for BounceTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

// ---------------------------------------------------------------------------
// IO thread state
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// Not staged yet.
    Pending,
    /// Gather job running.
    Gathering,
    /// Gathered, waiting for a credit.
    Gathered,
    /// RDMA write in flight.
    Writing(XferHandle),
    /// Write landed, DATA sent, waiting for ACK.
    DataSent,
    /// ACKed.
    Acked,
}

struct SendChunk {
    state: ChunkState,
    /// Local staging region offset.
    local: Option<u64>,
    /// Still counted against the eager budget.
    eager: bool,
    credit: Option<Credit>,
    /// When its credit's GRANT arrived: a credit older than the request
    /// timeout is not written (the protocol simulator's bug 5).
    credit_at: Option<Instant>,
    /// When its write was posted (transport probe).
    posted_at: Option<Instant>,
    /// The chunk's scatter runs, from its gather job (planned on the
    /// worker); moved into its DATA.
    scatter_runs: Vec<ScatterRun>,
}

/// A peer's transport probe in progress (see [`TransportReport`]).
#[derive(Default)]
struct WriteProbe {
    chunks: u32,
    bytes: u64,
    best_mbps: u64,
    best_bytes: u64,
}

struct SendRequest {
    peer: String,
    /// Destination scope named in the WANT (see [`BounceTransport::submit_scoped`]).
    scope: u64,
    remote_kind: MemKind,
    /// The request's descriptors, shared with its chunks' gather jobs
    /// (each plans its chunk on the worker).
    descs: Arc<Vec<Descriptor>>,
    /// The chunks from the sizing pass (no runs).
    chunks: Vec<ChunkBound>,
    state: Vec<SendChunk>,
    /// Credits received and not yet attached, by chunk index (a credit
    /// names its chunk: a duplicated or replayed GRANT cannot hand chunk
    /// i's region to chunk i+1 — the protocol simulator's bug 1).
    credits: std::collections::BTreeMap<u32, (Credit, Instant)>,
    next_attach: usize,
    next_stage: usize,
    acked: usize,
    total_bytes: u64,
    submitted_at: Instant,
    first_grant: bool,
    last_progress: Instant,
    completion: Arc<Completion>,
}

impl SendRequest {
    fn staged_unacked(&self) -> usize {
        self.state
            .iter()
            .filter(|c| {
                matches!(
                    c.state,
                    ChunkState::Gathering
                        | ChunkState::Gathered
                        | ChunkState::Writing(_)
                        | ChunkState::DataSent
                )
            })
            .count()
    }
}

enum JobRef {
    Gather {
        rid: u64,
        chunk: usize,
        local: u64,
    },
    /// Gather of a request that failed meanwhile: free its staging on done.
    OrphanGather {
        local: u64,
    },
    Scatter {
        flow: FlowKey,
        offset: u64,
        chunk: u32,
        /// Destination bounds [start, end) of the runs.
        dst: (u64, u64),
    },
}

/// A write of a failed request still in flight (send-side orphan, seed §9):
/// its staging region is freed, and the request's cancel sent, only once
/// the write is terminal — otherwise the receiver could re-grant the target
/// region while our write still lands in it.
struct OrphanWrite {
    handle: XferHandle,
    local: u64,
    rid: u64,
    since: Instant,
}

struct RecvRegion {
    flow: FlowKey,
    len: u64,
    /// The chunk the region was granted for (DATA must name it — the
    /// protocol simulator's bug 2).
    chunk: u32,
}

struct PendingScatter {
    flow: FlowKey,
    offset: u64,
    chunk: u32,
    runs: Vec<ScatterRun>,
    /// Destination bounds [start, end) of the runs.
    dst: (u64, u64),
}

struct PeerRoute {
    kind: MemKind,
}

struct Io {
    name: String,
    /// See [`BounceTransport::closed`].
    closed: Arc<AtomicBool>,
    /// See [`BounceTransport::io_blocked`].
    io_blocked: Arc<AtomicBool>,
    engine: Arc<dyn TransferEngine>,
    channel: Box<dyn ControlChannel>,
    endpoint: Vec<u8>,
    /// Reused encode buffer for outgoing control messages.
    tx_buf: Vec<u8>,
    arena: ArenaSpec,
    exec: ExecPool<()>,
    settings: TransportSettings,
    scheduler: CreditScheduler,
    workers: Option<CopyWorkers>,
    done_rx: Receiver<CopyDone>,
    cmd_rx: Receiver<Command>,
    stats: Arc<TransportStats>,
    peers: HashMap<String, PeerRoute>,
    /// Transport probes of peers whose report is not made yet.
    probes: HashMap<String, WriteProbe>,
    requests: HashMap<u64, SendRequest>,
    /// In-flight writes: (rid, chunk).
    writes: Vec<(u64, usize)>,
    jobs: HashMap<u64, JobRef>,
    next_token: u64,
    /// Receiver regions granted: offset → owner.
    regions: HashMap<u64, RecvRegion>,
    /// Next chunk index to grant per flow.
    grant_index: HashMap<FlowKey, u32>,
    /// Receiver side: last WANT / DATA / scatter of each live flow. A flow
    /// silent for twice the request timeout is reclaimed (its sender
    /// vanished or its cancel was lost; the reverse-path bootstrap means we
    /// may never be told to forget that sender).
    flow_seen: HashMap<FlowKey, Instant>,
    scatter_queue: VecDeque<PendingScatter>,
    /// Send-side orphans: writes of failed requests still in flight
    /// (handle, local staging offset).
    orphan_writes: Vec<OrphanWrite>,
    /// Cancels held back until the failed request's writes are terminal:
    /// rid → (peer, orphan writes outstanding).
    deferred_cancels: HashMap<u64, (String, usize)>,
    /// Ranges scatters of scope-0 flows (the agent's own memory) may write to.
    allowed: Vec<(u64, u64)>,
    /// Engine scopes: scope → the ranges its flows may scatter into.
    scopes: HashMap<u64, Vec<(u64, u64)>>,
    /// Receiver side: the destination scope of each live flow (from its WANT).
    flow_scope: HashMap<FlowKey, u64>,
    /// Receiver flows that ended (finished, cancelled — even before their
    /// WANT —, reclaimed, forgotten), kept for 2 × the request timeout: a
    /// replayed or late WANT must not bring one back (the protocol
    /// simulator's bug 6, docs/protocol.md).
    ended: std::collections::HashSet<FlowKey>,
    ended_order: VecDeque<(Instant, FlowKey)>,
    /// Ranges taken out of `allowed`, each answered once no queued or
    /// running scatter writes into it (then its memory may be unmapped).
    disallowed: Vec<(u64, u64, Sender<()>)>,
    /// Where NOTICE messages go (the service layer), if anywhere.
    notice_sink: Option<Sender<(String, Notice)>>,
    faults: FaultPlan,
    /// Some request could not stage (arena / exec full): retry each tick.
    parked: bool,
    /// Bidirectional deadlock guard. Both roles share the arena, so a
    /// receiver that grants all of it to a remote peer's flows leaves its own
    /// credited chunks nowhere to stage; with the peer doing the same, each
    /// side's grants wait on the other's staging forever. While this agent
    /// has send requests, one block of this size (a max-size chunk) stays
    /// free of remote grants and of eager staging, so a credit-backed
    /// chunk can always stage, and every credit-backed chunk completes
    /// without further arena space. `None` when the arena holds fewer than
    /// two such blocks.
    reserve_block: Option<u64>,
    /// See [`BounceTransport::heard`].
    heard: Arc<Mutex<HashMap<String, i64>>>,
    /// When `heard` was last updated per peer (throttle).
    heard_at: HashMap<String, Instant>,
}

impl Io {
    fn run(&mut self) {
        let mut idle_spins: u32 = 0;
        let mut last_event = Instant::now();
        loop {
            // Commands.
            let mut shutdown = false;
            while let Ok(cmd) = self.cmd_rx.try_recv() {
                // A command is an event: spin briefly again before blocking.
                idle_spins = 0;
                last_event = Instant::now();
                if self.handle_command(cmd) {
                    shutdown = true;
                    break;
                }
            }
            if shutdown {
                break;
            }
            // Posted writes (ours, or orphans) need engine polls to
            // complete: the only state that polls without an event.
            // Everything else — control messages, copy completions,
            // commands — wakes the blocking receive (the channel waits on
            // the IO thread's waker too), so waiting never takes CPU from
            // the copy workers.
            let must_poll = !self.writes.is_empty() || !self.orphan_writes.is_empty();
            // Progress the engine (with the notification channel, its recv
            // does that and owns the notifications).
            if !self.channel.progresses_engine() {
                // Timed only for the trace timeline (two clock reads a tick
                // otherwise).
                let t = tracing::enabled!(tracing::Level::TRACE).then(Instant::now);
                if let Err(e) = self.engine.progress() {
                    tracing::warn!(agent = %self.name, error = %e, "engine progress failed");
                }
                if let Some(us) = t.map(|t| t.elapsed().as_micros() as u64) {
                    if us >= 20 {
                        tracing::trace!(us, "engine progress slow");
                    }
                }
            }
            // Control messages: up to a batch per tick. Block (bounded:
            // timeouts are checked at least every IDLE_WAIT) only after a
            // short spin without events (a GPU chunk completes in tens of
            // µs; a wake-up from poll(2) costs about as much).
            // A parked request is retried every tick while spinning; after
            // that only events (which wake the receive) or the 1 ms bound
            // retry it. Without a busy-poll window (the default below 8
            // CPUs) a request waiting for arena space or a copy slot thus
            // never spins a core the copies need; with one, the IO thread
            // keeps a core for up to `busy_poll` after each event.
            let busy = !self.settings.busy_poll.is_zero()
                && (!self.requests.is_empty()
                    || !self.regions.is_empty()
                    || !self.jobs.is_empty()
                    || !self.scatter_queue.is_empty())
                && last_event.elapsed() < self.settings.busy_poll;
            let timeout = if must_poll || busy || idle_spins <= SPIN_BEFORE_BACKOFF {
                Duration::ZERO
            } else {
                IDLE_WAIT
            };
            let mut got = 0;
            for i in 0..64 {
                // Flag a blocking receive, so that only a submit that finds
                // this thread asleep sends it a wake-up ahead of the work.
                let blocking = i == 0 && !timeout.is_zero();
                if blocking {
                    self.io_blocked.store(true, Ordering::Release);
                }
                let received = self
                    .channel
                    .recv(if i == 0 { timeout } else { Duration::ZERO });
                if blocking {
                    self.io_blocked.store(false, Ordering::Release);
                }
                match received {
                    Ok(Some((peer, bytes))) => {
                        got += 1;
                        self.on_message(&peer, &bytes);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(agent = %self.name, error = %e, "control recv failed");
                        break;
                    }
                }
            }
            let done = self.drain_copies();
            self.answer_disallowed();
            let polled = self.poll_writes();
            self.drain_scatter_queue();
            if self.parked {
                self.parked = false;
                let rids: Vec<u64> = self.requests.keys().copied().collect();
                for rid in rids {
                    self.pump(rid);
                }
            }
            self.drain_orphan_writes();
            self.check_timeouts();
            self.update_gauges();
            if got == 0 && done == 0 && polled == 0 {
                // Adaptive poll (seed §7): with writes in flight spin
                // briefly for latency, then yield (the engine needs progress
                // calls for them to complete); otherwise the next tick
                // blocks in the channel's receive until an event.
                idle_spins = idle_spins.saturating_add(1);
                if must_poll && idle_spins > SPIN_BEFORE_BACKOFF {
                    std::thread::yield_now();
                }
            } else {
                idle_spins = 0;
                if !self.settings.busy_poll.is_zero() {
                    last_event = Instant::now();
                }
            }
        }
        self.shutdown();
    }

    fn update_gauges(&self) {
        let cap = self.scheduler.capacity();
        self.stats
            .arena_bytes_in_use
            .store(cap - self.scheduler.free_bytes(), Ordering::Relaxed);
        let drain = u64::from(self.scheduler.in_drain_mode());
        if self.stats.drain_mode.swap(drain, Ordering::Relaxed) < drain {
            self.stats.drain_entries.fetch_add(1, Ordering::Relaxed);
        }
        let chunks: usize = self
            .requests
            .values()
            .map(|r| r.next_stage.saturating_sub(r.acked))
            .sum();
        self.stats
            .chunks_in_flight
            .store(chunks as u64, Ordering::Relaxed);
        self.stats
            .recv_flows
            .store(self.scheduler.flow_count() as u64, Ordering::Relaxed);
        self.stats
            .send_flows
            .store(self.requests.len() as u64, Ordering::Relaxed);
    }

    fn handle_command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Prime => {}
            Command::Submit {
                rid,
                peer,
                scope,
                descs,
                chunks,
                completion,
            } => self.on_submit(rid, peer, scope, descs, chunks, completion),
            Command::AddPeer {
                peer,
                endpoint,
                kind,
                reply,
            } => {
                let r = self.channel.add_peer(&peer, &endpoint);
                if r.is_ok() {
                    // A (re)added peer may sit behind another transport now:
                    // probe it afresh.
                    self.drop_transport_report(&peer);
                    self.peers.insert(peer, PeerRoute { kind });
                }
                let _ = reply.send(r);
            }
            Command::ForgetPeer { peer, reply } => {
                self.heard_at.remove(&peer);
                self.heard
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&peer);
                self.forget_peer(&peer);
                self.drop_transport_report(&peer);
                let _ = reply.send(());
            }
            Command::AllowScatter { addr, len } => self.allowed.push((addr, len)),
            Command::AllowScope { scope, addr, len } => {
                self.scopes.entry(scope).or_default().push((addr, len));
            }
            Command::ForgetScope { scope, reply } => {
                let n = self.forget_scope(scope);
                let _ = reply.send(n);
            }
            Command::DisallowScatter { addr, len, reply } => {
                let end = addr.saturating_add(len);
                let apart = |&(a, l): &(u64, u64)| a.saturating_add(l) <= addr || a >= end;
                self.allowed.retain(apart);
                for ranges in self.scopes.values_mut() {
                    ranges.retain(apart);
                }
                self.disallowed.push((addr, end, reply));
                self.answer_disallowed();
            }
            Command::Quiesce { addr, len, reply } => {
                self.disallowed
                    .push((addr, addr.saturating_add(len), reply));
                self.answer_disallowed();
            }
            Command::Cancel { rid, why, reply } => {
                let known = self.requests.contains_key(&rid);
                if known {
                    self.fail_request(rid, why);
                }
                let _ = reply.send(known);
            }
            Command::Notice { peer, notice } => {
                if let Err(e) = self
                    .channel
                    .send_to(&peer, &Message::Notice(notice).encode())
                {
                    tracing::warn!(agent = %self.name, %peer, error = %e, "notice not sent");
                }
            }
            Command::NoticeSink(tx) => self.notice_sink = Some(tx),
            Command::Snapshot { reply } => {
                let _ = reply.send(self.snapshot());
            }
            Command::Faults(f) => self.faults = f,
            Command::SendRaw { peer, bytes } => {
                let _ = self.channel.send_to(&peer, &bytes);
            }
            Command::Shutdown => return true,
        }
        false
    }

    fn snapshot(&self) -> ArenaSnapshot {
        ArenaSnapshot {
            capacity: self.scheduler.capacity(),
            free_bytes: self.scheduler.free_bytes(),
            held_bytes: self.scheduler.held_bytes(),
            local_held_bytes: self.scheduler.local_held_bytes(),
            orphaned_bytes: self.scheduler.orphaned_bytes(),
            flows: self.scheduler.flow_count(),
            send_requests: self.requests.len(),
            send_orphans: self.orphan_writes.len()
                + self
                    .jobs
                    .values()
                    .filter(|j| matches!(j, JobRef::OrphanGather { .. }))
                    .count(),
            conservation: self.scheduler.check_conservation(),
        }
    }

    fn send(&mut self, peer: &str, msg: &Message) -> bool {
        // One warm encode buffer (a 16,384-run DATA is 786 KB).
        let mut bytes = std::mem::take(&mut self.tx_buf);
        bytes.clear();
        msg.encode_into(&mut bytes);
        let sent = self.channel.send_to(peer, &bytes);
        self.tx_buf = bytes;
        match sent {
            Ok(()) => true,
            Err(e) => {
                if matches!(e, ControlError::Dropped(_)) {
                    self.stats.control_dropped.fetch_add(1, Ordering::Relaxed);
                }
                tracing::warn!(agent = %self.name, peer, error = %e, msg = ?msg.message_type(), "control send failed");
                false
            }
        }
    }

    fn token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    // ---------------- sender role ----------------

    fn on_submit(
        &mut self,
        rid: u64,
        peer: String,
        scope: u64,
        descs: Vec<Descriptor>,
        chunks: Vec<ChunkBound>,
        completion: Arc<Completion>,
    ) {
        tracing::trace!(rid, scope, descriptors = descs.len(), "submit");
        let fail = |c: &Arc<Completion>, stats: &TransportStats, why: String| {
            stats.failed.fetch_add(1, Ordering::Relaxed);
            c.resolve(TransferOutcome::Failure(why));
        };
        let Some(route) = self.peers.get(&peer) else {
            return fail(
                &completion,
                &self.stats,
                format!("peer {peer:?} is not a registered bounce peer"),
            );
        };
        let remote_kind = route.kind;
        let t_plan = Instant::now();
        // The submitting thread ran the sizing pass (chunk sizes for the
        // WANT and where each chunk starts); each chunk's runs are built
        // on a copy worker right before its gather (`CopyPlan::Chunk`).
        if chunks.is_empty() {
            self.stats.succeeded.fetch_add(1, Ordering::Relaxed);
            completion.resolve(TransferOutcome::Success);
            return;
        }
        let total_bytes = chunks.iter().map(|c| c.payload_bytes).sum();
        let want = Message::Want(Want {
            request_id: rid,
            scope,
            chunk_bytes: chunks.iter().map(|c| c.packed_bytes).collect(),
            endpoint: self.endpoint.clone(),
        });
        if !self.send(&peer, &want) {
            return fail(&completion, &self.stats, "could not send WANT".into());
        }
        tracing::trace!(
            rid,
            chunks = chunks.len(),
            plan_us = t_plan.elapsed().as_micros() as u64,
            "planned"
        );
        let now = Instant::now();
        completion.note(Stage::Want, 0, now);
        let state = chunks
            .iter()
            .map(|_| SendChunk {
                credit_at: None,
                state: ChunkState::Pending,
                local: None,
                eager: false,
                credit: None,
                posted_at: None,
                scatter_runs: Vec::new(),
            })
            .collect();
        self.requests.insert(
            rid,
            SendRequest {
                peer: peer.clone(),
                scope,
                remote_kind,
                descs: Arc::new(descs),
                chunks,
                state,
                credits: std::collections::BTreeMap::new(),
                next_attach: 0,
                next_stage: 0,
                acked: 0,
                total_bytes,
                submitted_at: t_plan,
                first_grant: false,
                last_progress: now,
                completion,
            },
        );
        self.pump(rid);
    }

    /// Attach credits in chunk order, stage gathers within the window,
    /// post writes for gathered chunks holding a credit.
    fn pump(&mut self, rid: u64) {
        let w = self.settings.max_inflight_chunks;
        let eager_ok = self.settings.eager_gather;
        let Some(req) = self.requests.get_mut(&rid) else {
            return;
        };
        // 1. Attach credits (strict chunk order).
        while req.next_attach < req.chunks.len() {
            let Some((credit, at)) = req.credits.remove(&(req.next_attach as u32)) else {
                break;
            };
            let c = &mut req.state[req.next_attach];
            c.credit = Some(credit);
            c.credit_at = Some(at);
            if c.eager {
                if let Some(off) = c.local {
                    let _ = self.scheduler.promote_local(off);
                }
                c.eager = false;
            }
            req.next_attach += 1;
        }
        // 2. Stage gathers within the window.
        let mut parked = false;
        while req.next_stage < req.chunks.len() && req.staged_unacked() < w {
            let i = req.next_stage;
            let credited = req.state[i].credit.is_some();
            if !credited && !eager_ok {
                break;
            }
            let bytes = req.chunks[i].packed_bytes;
            let Some(local) = self.scheduler.acquire_local(bytes, !credited) else {
                parked = credited;
                break;
            };
            if let (false, Some(b)) = (credited, self.reserve_block) {
                // Eager staging never takes the block kept for credited
                // chunks, nor the last block a peer's flow could be granted
                // beside it: two agents sending to each other over small
                // arenas would otherwise each hold all but the reserve and
                // grant nothing until the timeout (the protocol
                // simulator's bug 3, docs/protocol.md).
                let room = match self.scheduler.acquire_local(b, false) {
                    Some(hold) => {
                        let ok = self.scheduler.arena().largest_free_block() >= b;
                        let _ = self.scheduler.release_local(hold);
                        ok
                    }
                    None => false,
                };
                if !room {
                    let _ = self.scheduler.release_local(local);
                    break;
                }
            }
            let Some(()) = self.exec.try_acquire() else {
                let _ = self.scheduler.release_local(local);
                parked = true;
                break;
            };
            let token = self.next_token;
            self.next_token += 1;
            self.jobs.insert(
                token,
                JobRef::Gather {
                    rid,
                    chunk: i,
                    local,
                },
            );
            let c = &mut req.state[i];
            c.state = ChunkState::Gathering;
            c.local = Some(local);
            c.eager = !credited;
            if let Some(w) = &self.workers {
                w.submit(CopyJob {
                    token,
                    kind: CopyKind::Gather,
                    region_addr: self.arena.base + local,
                    plan: CopyPlan::Chunk {
                        descs: req.descs.clone(),
                        bound: req.chunks[i],
                        max_chunk_size_bytes: self.settings.max_chunk_size_bytes,
                        merge_runs: self.settings.merge_runs,
                    },
                });
            }
            req.next_stage += 1;
        }
        if parked {
            self.parked = true;
        }
        // 3. Post writes for gathered + credited chunks.
        let ready: Vec<usize> = (0..req.next_attach)
            .filter(|&i| req.state[i].state == ChunkState::Gathered)
            .collect();
        for i in ready {
            if let Err(why) = self.post_chunk(rid, i) {
                self.fail_request(rid, why);
                return;
            }
            // A post can take a while (the engine may copy synchronously):
            // send DATA for writes that landed meanwhile before posting the
            // next, so the receiver's scatters overlap our writes.
            self.poll_writes();
            if !self.requests.contains_key(&rid) {
                return;
            }
        }
    }

    fn post_chunk(&mut self, rid: u64, i: usize) -> Result<(), String> {
        tracing::trace!(rid, chunk = i, "post write");
        let req = self.requests.get_mut(&rid).expect("request exists");
        let c = &req.state[i];
        let credit = c.credit.expect("credited");
        let local = c.local.expect("staged");
        let bytes = req.chunks[i].packed_bytes;
        if credit.len < bytes {
            return Err(format!(
                "GRANT for chunk {i} is {} bytes, chunk needs {bytes}",
                credit.len
            ));
        }
        // The receiver reclaims a flow silent for 2 × the timeout since its
        // last GRANT: a write posted past one timeout after the GRANT could
        // land after that, in a freed or re-granted region (the protocol
        // simulator's bug 5, docs/protocol.md).
        let age = c.credit_at.map_or(Duration::ZERO, |t| t.elapsed());
        if age > self.settings.request_timeout {
            return Err(format!(
                "the GRANT for chunk {i} is {} ms old, past the request timeout",
                age.as_millis()
            ));
        }
        // Timed from before the post: an engine may copy inside it.
        let posted_at = Instant::now();
        let h = self
            .engine
            .post_write(
                &req.peer,
                self.arena.kind,
                &[MemDesc {
                    addr: self.arena.base + local,
                    len: bytes,
                    device_id: self.arena.device_id,
                }],
                req.remote_kind,
                &[MemDesc {
                    addr: credit.addr,
                    len: bytes,
                    device_id: credit.device_id.max(0) as u64,
                }],
            )
            .map_err(|e| format!("posting write of chunk {i}: {e}"))?;
        req.state[i].state = ChunkState::Writing(h);
        req.state[i].posted_at = Some(posted_at);
        req.completion.note(Stage::WritePosted, i, posted_at);
        self.writes.push((rid, i));
        Ok(())
    }

    fn poll_writes(&mut self) -> usize {
        let mut progressed = 0;
        let mut k = 0;
        while k < self.writes.len() {
            let (rid, i) = self.writes[k];
            let Some(req) = self.requests.get(&rid) else {
                self.writes.swap_remove(k);
                continue;
            };
            let ChunkState::Writing(h) = req.state[i].state else {
                self.writes.swap_remove(k);
                continue;
            };
            let polled = if self.faults.fail_writes {
                Err("injected engine failure".to_string())
            } else if self.faults.hang_writes {
                Ok(XferState::InProgress)
            } else {
                self.engine.poll(h).map_err(|e| e.to_string())
            };
            match polled {
                Ok(XferState::InProgress) => k += 1,
                Ok(XferState::Success) => {
                    tracing::trace!(rid, chunk = i, "write landed");
                    self.writes.swap_remove(k);
                    self.engine.release(h);
                    progressed += 1;
                    self.stats.chunks_written.fetch_add(1, Ordering::Relaxed);
                    let req = self.requests.get_mut(&rid).expect("checked");
                    req.state[i].state = ChunkState::DataSent;
                    let now = Instant::now();
                    req.last_progress = now;
                    req.completion.note(Stage::DataSent, i, now);
                    if let Some(t) = req.state[i].posted_at.take() {
                        let (peer, kind, bytes) = (
                            req.peer.clone(),
                            req.remote_kind,
                            req.chunks[i].payload_bytes,
                        );
                        self.probe_write(&peer, kind, bytes, t.elapsed());
                    }
                    let req = self.requests.get_mut(&rid).expect("checked");
                    let credit = req.state[i].credit.expect("credited");
                    let data = Message::Data(Data {
                        request_id: rid,
                        chunk_index: i as u32,
                        region_handle: credit.region_handle,
                        runs: std::mem::take(&mut req.state[i].scatter_runs),
                    });
                    let peer = req.peer.clone();
                    if !self.send(&peer, &data) {
                        self.fail_request(rid, format!("could not send DATA for chunk {i}"));
                    }
                }
                Err(e) => {
                    self.writes.swap_remove(k);
                    progressed += 1;
                    // The handle is terminal (failed): release it; the
                    // staging region is no longer read by the NIC.
                    self.engine.release(h);
                    if let Some(req) = self.requests.get_mut(&rid) {
                        req.state[i].state = ChunkState::Gathered;
                    }
                    self.fail_request(rid, format!("write of chunk {i} failed: {e}"));
                }
            }
        }
        progressed
    }

    fn on_grant(&mut self, peer: &str, g: Grant) {
        tracing::trace!(rid = g.request_id, credits = g.credits.len(), "grant");
        let Some(req) = self.requests.get_mut(&g.request_id) else {
            tracing::debug!(agent = %self.name, peer, rid = g.request_id, "GRANT for unknown request (late); ignored");
            return;
        };
        if req.peer != peer {
            tracing::warn!(agent = %self.name, peer, rid = g.request_id, "GRANT from the wrong peer; ignored");
            return;
        }
        if !req.first_grant {
            req.first_grant = true;
            self.stats.credit_wait_us.fetch_add(
                req.submitted_at.elapsed().as_micros() as u64,
                Ordering::Relaxed,
            );
        }
        let now = Instant::now();
        req.last_progress = now;
        for c in g.credits {
            let i = c.chunk_index as usize;
            // A chunk already credited, or past the request: dropped.
            if i < req.next_attach
                || i >= req.chunks.len()
                || req.credits.contains_key(&c.chunk_index)
            {
                tracing::warn!(agent = %self.name, peer, rid = g.request_id, chunk = c.chunk_index, "duplicate or out-of-range credit; dropped");
                continue;
            }
            req.credits.insert(c.chunk_index, (c, now));
        }
        self.pump(g.request_id);
    }

    fn on_ack(&mut self, peer: &str, a: Ack) {
        let rid = a.request_id;
        let Some(req) = self.requests.get_mut(&rid) else {
            return;
        };
        let i = a.chunk_index as usize;
        if req.peer != peer || i >= req.state.len() {
            tracing::warn!(agent = %self.name, peer, rid, chunk = i, "ACK does not match a request; ignored");
            return;
        }
        let c = &mut req.state[i];
        if c.state != ChunkState::DataSent
            || c.credit.map(|cr| cr.region_handle) != Some(a.region_handle)
        {
            tracing::warn!(agent = %self.name, peer, rid, chunk = i, "unexpected ACK; ignored");
            return;
        }
        c.state = ChunkState::Acked;
        tracing::trace!(rid, chunk = i, "ack");
        if let Some(local) = c.local.take() {
            let _ = self.scheduler.release_local(local);
        }
        req.acked += 1;
        let now = Instant::now();
        req.last_progress = now;
        req.completion.note(Stage::Acked, i, now);
        if req.acked == req.chunks.len() {
            let req = self.requests.remove(&rid).expect("exists");
            self.stats.succeeded.fetch_add(1, Ordering::Relaxed);
            self.stats
                .bytes_sent
                .fetch_add(req.total_bytes, Ordering::Relaxed);
            req.completion.resolve(TransferOutcome::Success);
            // Freed staging may unblock a parked request.
            self.parked = true;
        } else {
            self.pump(rid);
        }
        self.schedule_and_send();
    }

    /// Forgets `peer`'s transport probe and report.
    fn drop_transport_report(&mut self, peer: &str) {
        self.probes.remove(peer);
        self.stats
            .transport_reports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(peer);
    }

    /// Feeds one landed chunk write to `peer`'s transport probe; after
    /// [`PROBE_CHUNKS`] writes, records and logs its [`TransportReport`]
    /// (once per peer) and warns on a likely silent fallback.
    fn probe_write(&mut self, peer: &str, remote_kind: MemKind, bytes: u64, took: Duration) {
        let p = self.probes.entry(peer.to_string()).or_default();
        if p.chunks >= PROBE_CHUNKS {
            return;
        }
        let mbps = (bytes as f64 / took.as_secs_f64().max(1e-9) / 1e6) as u64;
        p.chunks += 1;
        p.bytes += bytes;
        if mbps > p.best_mbps {
            p.best_mbps = mbps;
            p.best_bytes = bytes;
        }
        if p.chunks < PROBE_CHUNKS {
            return;
        }
        let gpu = self.arena.kind == MemKind::Vram && remote_kind == MemKind::Vram;
        let r = TransportReport {
            chunks: p.chunks,
            bytes: p.bytes,
            best_chunk_mbps: p.best_mbps,
            best_chunk_bytes: p.best_bytes,
            local_kind: format!("{:?}", self.arena.kind),
            remote_kind: format!("{remote_kind:?}"),
            suspect_fallback: suspect_fallback(gpu, p.best_bytes, p.best_mbps),
        };
        let gbps = r.best_chunk_mbps as f64 / 1e3;
        if r.suspect_fallback {
            tracing::warn!(
                agent = %self.name, peer, chunks = r.chunks, best_chunk_bytes = r.best_chunk_bytes,
                "GPU→GPU bounce writes to this peer ran at {gbps:.2} GB/s at best: UCX is most \
                 likely using software emulation or TCP instead of cuda_ipc/RDMA (check UCX_TLS; \
                 two agents in one process need UCX_CUDA_IPC_ENABLE_SAME_PROCESS=y)"
            );
        } else {
            tracing::info!(
                agent = %self.name, peer, chunks = r.chunks, best_chunk_bytes = r.best_chunk_bytes,
                local = %r.local_kind, remote = %r.remote_kind,
                "transport report: fastest of the first chunk writes {gbps:.2} GB/s"
            );
        }
        self.stats
            .transport_reports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer.to_string(), r);
    }

    /// Resolves `rid` FAILURE now and cleans up: cancel (empty WANT) to the
    /// receiver, staging freed at once where no copy/NIC still uses it,
    /// deferred (send-side orphans) where one does (seed §9).
    fn fail_request(&mut self, rid: u64, why: String) {
        let Some(req) = self.requests.remove(&rid) else {
            return;
        };
        tracing::warn!(agent = %self.name, peer = %req.peer, rid, reason = %why, "bounce request failed");
        self.stats.failed.fetch_add(1, Ordering::Relaxed);
        let in_flight = req
            .state
            .iter()
            .filter(|c| matches!(c.state, ChunkState::Writing(_)))
            .count();
        if in_flight == 0 {
            self.send_cancel(&req.peer, rid);
        } else {
            self.deferred_cancels
                .insert(rid, (req.peer.clone(), in_flight));
        }
        let now = Instant::now();
        for (i, c) in req.state.iter().enumerate() {
            match c.state {
                ChunkState::Gathering => {
                    // The gather job still writes the staging region: free on done.
                    if let Some((_, job)) = self.jobs.iter_mut().find(|(_, j)| {
                        matches!(j, JobRef::Gather { rid: r, chunk, .. } if *r == rid && *chunk == i)
                    }) {
                        *job = JobRef::OrphanGather {
                            local: c.local.expect("staged"),
                        };
                    }
                }
                ChunkState::Writing(h) => {
                    self.orphan_writes.push(OrphanWrite {
                        handle: h,
                        local: c.local.expect("staged"),
                        rid,
                        since: now,
                    });
                }
                ChunkState::Gathered | ChunkState::DataSent => {
                    if let Some(local) = c.local {
                        let _ = self.scheduler.release_local(local);
                    }
                }
                ChunkState::Pending | ChunkState::Acked => {}
            }
        }
        self.writes.retain(|(r, _)| *r != rid);
        req.completion.resolve(TransferOutcome::Failure(why));
        self.parked = true;
        self.schedule_and_send();
    }

    /// Sends the empty WANT that lets the receiver reclaim flow `rid`.
    fn send_cancel(&mut self, peer: &str, rid: u64) {
        if self.channel.has_peer(peer) {
            let cancel = wire::encode_cancel(rid, &self.endpoint);
            if let Err(e) = self.channel.send_to(peer, &cancel) {
                if matches!(e, ControlError::Dropped(_)) {
                    self.stats.control_dropped.fetch_add(1, Ordering::Relaxed);
                }
                tracing::warn!(agent = %self.name, peer, rid, error = %e, "cancel not sent");
            }
        }
    }

    /// One orphan write of `rid` is terminal (or overdue): send the deferred
    /// cancel once none is left.
    fn orphan_write_settled(&mut self, rid: u64) {
        if let Some((peer, left)) = self.deferred_cancels.get_mut(&rid) {
            *left -= 1;
            if *left == 0 {
                let peer = peer.clone();
                self.deferred_cancels.remove(&rid);
                self.send_cancel(&peer, rid);
            }
        }
    }

    fn drain_orphan_writes(&mut self) {
        let mut freed = false;
        let mut k = 0;
        let overdue = self.settings.request_timeout;
        while k < self.orphan_writes.len() {
            let o = &self.orphan_writes[k];
            let (h, local, rid) = (o.handle, o.local, o.rid);
            let polled = if self.faults.hang_writes {
                Ok(XferState::InProgress)
            } else {
                self.engine.poll(h)
            };
            match polled {
                Ok(XferState::InProgress) => {
                    // A write that never finishes must not hold the receiver's
                    // flow forever: cancel after the request timeout (staging
                    // stays held while the NIC may still read it).
                    if o.since.elapsed() > overdue && self.deferred_cancels.contains_key(&rid) {
                        tracing::warn!(agent = %self.name, rid, "orphaned write still in flight after the request timeout; cancelling anyway");
                        if let Some((peer, _)) = self.deferred_cancels.remove(&rid) {
                            self.send_cancel(&peer, rid);
                        }
                    }
                    k += 1;
                }
                _ => {
                    self.engine.release(h);
                    let _ = self.scheduler.release_local(local);
                    self.orphan_writes.swap_remove(k);
                    self.orphan_write_settled(rid);
                    self.parked = true;
                    freed = true;
                }
            }
        }
        if freed {
            // Freed bytes may go to a waiting flow.
            self.schedule_and_send();
        }
    }

    fn check_timeouts(&mut self) {
        let timeout = self.settings.request_timeout;
        let now = Instant::now();
        let expired: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| now.duration_since(r.last_progress) > timeout)
            .map(|(rid, _)| *rid)
            .collect();
        for rid in expired {
            self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
            self.fail_request(
                rid,
                format!("no progress within the request timeout of {timeout:?}"),
            );
        }
        // Receiver side: drop records of finished flows, reclaim silent ones.
        let sched = &self.scheduler;
        self.flow_seen.retain(|f, _| sched.contains_flow(f));
        self.flow_scope.retain(|f, _| sched.contains_flow(f));
        let silent: Vec<FlowKey> = self
            .flow_seen
            .iter()
            .filter(|(_, t)| now.duration_since(**t) > 2 * timeout)
            .map(|(f, _)| f.clone())
            .collect();
        for flow in silent {
            // Reclaiming one flow frees regions the next schedule grants,
            // perhaps to another flow of this list (restarting its clock):
            // re-check, or its fresh GRANT would point at a region freed
            // right after (the protocol simulator's bug 7).
            let still = self
                .flow_seen
                .get(&flow)
                .is_some_and(|t| now.duration_since(*t) > 2 * timeout);
            if !still {
                continue;
            }
            tracing::warn!(agent = %self.name, flow = %flow, "flow silent for twice the request timeout; reclaiming its regions");
            self.flow_seen.remove(&flow);
            self.reclaim_flow(&flow);
        }
    }

    // ---------------- receiver role ----------------

    fn on_want(&mut self, peer: &str, w: Want) {
        if self.faults.ignore_wants {
            return;
        }
        let flow = FlowKey::new(peer, w.request_id);
        // Reverse-path bootstrap (seed §5): route to the sender's endpoint.
        if !self.channel.has_peer(peer) {
            if let Err(e) = self.channel.add_peer(peer, &w.endpoint) {
                tracing::warn!(agent = %self.name, peer, error = %e, "WANT with an unusable endpoint; rejected");
                if w.is_cancel() {
                    // A cancel is honoured anyway (reclaims earlier state).
                    self.stats.cancels_received.fetch_add(1, Ordering::Relaxed);
                    self.reclaim_flow(&flow);
                } else {
                    self.stats.wants_rejected.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
        }
        if w.is_cancel() {
            self.stats.cancels_received.fetch_add(1, Ordering::Relaxed);
            self.reclaim_flow(&flow);
            return;
        }
        // First (as the protocol machine): a replay naming a bogus scope
        // must not REJECT — and so fail — the live request.
        // A sender sends one WANT per request: another for a live or a
        // recently ended flow is a replay (it would re-create a reclaimed
        // flow and re-grant regions a stale DATA could then match).
        self.prune_tombstones();
        if self.ended.contains(&flow) || self.scheduler.contains_flow(&flow) {
            tracing::warn!(agent = %self.name, peer, rid = w.request_id, "WANT for a live or recently ended flow; dropped as a replay");
            self.stats.wants_stale.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if w.scope != 0 && !self.scopes.contains_key(&w.scope) {
            // The destination engine is not attached (detached, never
            // attached here, or this agent restarted): refuse at once.
            tracing::warn!(agent = %self.name, peer, rid = w.request_id, scope = w.scope, "WANT for an engine scope that is not attached; rejected");
            self.stats.wants_rejected.fetch_add(1, Ordering::Relaxed);
            self.send_reject(peer, w.request_id, RejectReason::UnknownScope);
            return;
        }
        if let Err(e) = self.scheduler.on_want(flow.clone(), &w.chunk_bytes) {
            tracing::warn!(agent = %self.name, peer, rid = w.request_id, error = %e, "WANT rejected");
            self.stats.wants_rejected.fetch_add(1, Ordering::Relaxed);
            // Fail the sender now, not at its timeout.
            self.send_reject(peer, w.request_id, RejectReason::Refused);
            return;
        }
        self.flow_seen.insert(flow.clone(), Instant::now());
        self.flow_scope.insert(flow, w.scope);
        self.schedule_and_send();
        // DATA for this flow follows within a control round trip: wake as
        // many idle scatter workers as it can use now (after the GRANT went
        // out) rather than on the first DATA.
        if let Some(workers) = &self.workers {
            workers.prime(w.chunk_bytes.len().min(self.settings.max_inflight_chunks));
        }
    }

    fn reclaim_flow(&mut self, flow: &FlowKey) {
        // Only a flow that existed: a cancel naming an unknown flow (any
        // peer can send one) must not cost memory.
        if self.scheduler.contains_flow(flow) {
            self.tombstone(flow.clone());
        }
        self.flow_scope.remove(flow);
        self.scheduler.reclaim_flow(flow);
        self.forget_regions(|f| f == flow);
        self.grant_index.remove(flow);
        self.schedule_and_send();
    }

    /// Remembers that `flow` ended (see `ended`). At most
    /// [`MAX_TOMBSTONES`] are kept: past that the oldest goes first.
    fn tombstone(&mut self, flow: FlowKey) {
        self.prune_tombstones();
        if self.ended.insert(flow.clone()) {
            self.ended_order.push_back((Instant::now(), flow));
        }
        while self.ended_order.len() > MAX_TOMBSTONES {
            if let Some((_, f)) = self.ended_order.pop_front() {
                self.ended.remove(&f);
                self.stats
                    .tombstones_evicted
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Forgets flows that ended more than 2 × the request timeout ago.
    fn prune_tombstones(&mut self) {
        let keep = self.settings.request_timeout * 2;
        while let Some((t, _)) = self.ended_order.front() {
            if t.elapsed() <= keep {
                break;
            }
            if let Some((_, f)) = self.ended_order.pop_front() {
                self.ended.remove(&f);
            }
        }
    }

    /// Closes engine scope `scope`: its flows' DATA stops scattering, their
    /// senders get a REJECT (see [`BounceTransport::forget_scope`]).
    /// Returns the number of flows.
    fn forget_scope(&mut self, scope: u64) -> usize {
        self.scopes.remove(&scope);
        let flows: Vec<FlowKey> = self
            .flow_scope
            .iter()
            .filter(|(f, s)| **s == scope && self.scheduler.contains_flow(f))
            .map(|(f, _)| f.clone())
            .collect();
        // The flows are not reclaimed here: their senders may still have
        // writes in flight into the granted regions, so a region freed now
        // could be re-granted and overwritten by a late write. The scope's
        // ranges are gone, so their DATA no longer scatters; the sender,
        // told by the REJECT, fails the request and cancels once its
        // writes are terminal (seed §9), which frees the regions — or the
        // silence timeout does.
        for flow in &flows {
            tracing::info!(agent = %self.name, flow = %flow, scope, "destination engine detached; sender told");
            self.send_reject(&flow.peer, flow.rid, RejectReason::ScopeDetached);
        }
        // Their DATA already queued (validated, not yet started) would
        // scatter into the detached engine's pool after the detach — and be
        // ACKed: dropped, its region freed (the write into it is done).
        let mut dropped = Vec::new();
        self.scatter_queue.retain(|q| {
            let keep = !flows.contains(&q.flow);
            if !keep {
                dropped.push((q.flow.clone(), q.offset));
            }
            keep
        });
        for (flow, offset) in dropped {
            let _ = self.scheduler.scatter_done(offset);
            if self.regions.get(&offset).is_some_and(|r| r.flow == flow) {
                self.regions.remove(&offset);
            }
            if !self.scheduler.contains_flow(&flow) {
                self.grant_index.remove(&flow);
                self.tombstone(flow);
            }
        }
        self.schedule_and_send();
        flows.len()
    }

    /// Tells `peer` its request `rid` will not be served (best effort).
    fn send_reject(&mut self, peer: &str, rid: u64, reason: RejectReason) {
        let msg = Message::Reject(Reject {
            request_id: rid,
            reason,
        });
        self.send(peer, &msg);
    }

    /// Drops region records whose flow matches and which are no longer held
    /// (reclaimed); scattering ones stay until their scatter completes.
    fn forget_regions(&mut self, pred: impl Fn(&FlowKey) -> bool) {
        let sched = &self.scheduler;
        self.regions
            .retain(|off, r| !pred(&r.flow) || sched.held_by_flow(&r.flow, *off));
        // A queued (not yet started) scatter of a reclaimed flow will never
        // run: its region is an orphan now, free it here or it leaks.
        let mut dropped = Vec::new();
        self.scatter_queue.retain(|s| {
            let keep = !pred(&s.flow) || sched.held_by_flow(&s.flow, s.offset);
            if !keep {
                dropped.push(s.offset);
            }
            keep
        });
        for offset in dropped {
            let _ = self.scheduler.scatter_done(offset);
        }
    }

    fn schedule_and_send(&mut self) {
        // Keep `reserve_block` out of the grants while we send; if it is not
        // free right now, grant nothing (every free reschedules).
        let hold = match self.reserve_block {
            Some(b) if !self.requests.is_empty() => match self.scheduler.acquire_local(b, false) {
                Some(off) => Some(off),
                None => return,
            },
            _ => None,
        };
        let grants = self.scheduler.schedule();
        if let Some(off) = hold {
            let _ = self.scheduler.release_local(off);
        }
        if grants.is_empty() {
            return;
        }
        // Group per flow, preserving grant order.
        let mut batches: Vec<(FlowKey, Vec<Credit>)> = Vec::new();
        for g in grants {
            let idx = self.grant_index.entry(g.flow.clone()).or_insert(0);
            let credit = Credit {
                chunk_index: *idx,
                region_handle: g.region_offset,
                addr: self.arena.base + g.region_offset,
                len: g.len,
                device_id: self.arena.device_id as i32,
            };
            *idx += 1;
            self.regions.insert(
                g.region_offset,
                RecvRegion {
                    flow: g.flow.clone(),
                    len: g.len,
                    chunk: credit.chunk_index,
                },
            );
            match batches.iter_mut().find(|(f, _)| *f == g.flow) {
                Some((_, v)) => v.push(credit),
                None => batches.push((g.flow, vec![credit])),
            }
        }
        for (flow, credits) in batches {
            let n = credits.len() as u64;
            let msg = Message::Grant(Grant {
                request_id: flow.rid,
                credits,
            });
            // Count only credits that left: a GRANT dropped on a full queue
            // (or to a vanished route) is reclaimed with its flow by the
            // silence timeout, it was never granted to the sender.
            // Counted before it leaves (taken back if it does not): the
            // peer may act on it before this thread runs again.
            self.stats.grants.fetch_add(n, Ordering::Relaxed);
            if !self.send(&flow.peer, &msg) {
                self.stats.grants.fetch_sub(n, Ordering::Relaxed);
            } else {
                // A GRANT restarts the sender's no-progress clock, so it
                // restarts the flow's silence clock too: a flow granted
                // late under backpressure is not reclaimed while its
                // sender writes into it (the simulator's bug 4).
                if let Some(t) = self.flow_seen.get_mut(&flow) {
                    *t = Instant::now();
                }
            }
        }
    }

    fn validate_runs(
        &self,
        scope: u64,
        region_len: u64,
        runs: &[ScatterRun],
    ) -> Result<(), String> {
        let allowed: &[(u64, u64)] = if scope == 0 {
            &self.allowed
        } else {
            self.scopes.get(&scope).map_or(&[], Vec::as_slice)
        };
        let mut total: u64 = 0;
        for (k, r) in runs.iter().enumerate() {
            if r.segment_len == 0 || r.count == 0 {
                return Err(format!("run {k} is empty"));
            }
            let end = r.region_end().ok_or_else(|| format!("run {k} overflows"))?;
            if end > region_len {
                return Err(format!(
                    "run {k} ends at region byte {end}, beyond the granted {region_len} bytes"
                ));
            }
            let dst_end = u64::from(r.count - 1)
                .checked_mul(r.addr_stride)
                .and_then(|x| x.checked_add(r.addr))
                .and_then(|x| x.checked_add(r.segment_len))
                .ok_or_else(|| format!("run {k} destination overflows"))?;
            let inside = allowed
                .iter()
                .any(|&(a, l)| r.addr >= a && dst_end <= a + l);
            if !inside {
                return Err(if scope == 0 {
                    format!(
                        "run {k} destination [{:#x}, {dst_end:#x}) is outside registered memory",
                        r.addr
                    )
                } else {
                    format!(
                        "run {k} destination [{:#x}, {dst_end:#x}) is outside the pool of destination engine scope {scope}",
                        r.addr
                    )
                });
            }
            total = total.saturating_add(r.total_bytes());
        }
        if total > region_len {
            return Err(format!(
                "runs move {total} bytes, more than the granted {region_len}"
            ));
        }
        Ok(())
    }

    fn on_data(&mut self, peer: &str, d: Data) {
        tracing::trace!(
            rid = d.request_id,
            chunk = d.chunk_index,
            runs = d.runs.len(),
            "data"
        );
        let flow = FlowKey::new(peer, d.request_id);
        if !self.scheduler.held_by_flow(&flow, d.region_handle) {
            // Late DATA after a cancel / forget: never scatter (seed §9).
            tracing::warn!(agent = %self.name, peer, rid = d.request_id, region = d.region_handle, "DATA for a region the flow does not hold; dropped");
            self.stats.data_rejected.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let (len, chunk) = self
            .regions
            .get(&d.region_handle)
            .map_or((0, None), |r| (r.len, Some(r.chunk)));
        if chunk != Some(d.chunk_index) {
            // A replayed DATA of an earlier chunk whose region was granted
            // again to this flow: scattering it would race the write that
            // fills the region now.
            tracing::warn!(agent = %self.name, peer, rid = d.request_id, chunk = d.chunk_index, granted_for = ?chunk, "DATA names another chunk than its region was granted for; dropped");
            self.stats.data_rejected.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // A live flow always has its WANT's scope; none: fail closed.
        let scope = self.flow_scope.get(&flow).copied().unwrap_or(u64::MAX);
        if scope != 0 && !self.scopes.contains_key(&scope) {
            tracing::debug!(agent = %self.name, peer, rid = d.request_id, scope, "DATA for a closed engine scope; not scattered");
            self.stats.data_rejected.fetch_add(1, Ordering::Relaxed);
            self.send_reject(peer, d.request_id, RejectReason::ScopeDetached);
            return;
        }
        if let Err(why) = self.validate_runs(scope, len, &d.runs) {
            tracing::warn!(agent = %self.name, peer, rid = d.request_id, reason = %why, "DATA with invalid scatter runs; no scatter, no ACK");
            self.stats.data_rejected.fetch_add(1, Ordering::Relaxed);
            // The sender fails the request now (its cancel, sent once its
            // writes are terminal, frees the flow's regions).
            self.send_reject(peer, d.request_id, RejectReason::InvalidRuns);
            return;
        }
        if let Err(e) = self.scheduler.begin_scatter(&flow, d.region_handle) {
            tracing::warn!(agent = %self.name, peer, error = %e, "DATA rejected");
            self.stats.data_rejected.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.flow_seen.insert(flow.clone(), Instant::now());
        let dst = scatter_bounds(&d.runs);
        self.scatter_queue.push_back(PendingScatter {
            flow,
            offset: d.region_handle,
            chunk: d.chunk_index,
            runs: d.runs,
            dst,
        });
        self.drain_scatter_queue();
    }

    fn drain_scatter_queue(&mut self) {
        while !self.scatter_queue.is_empty() {
            let Some(()) = self.exec.try_acquire() else {
                return;
            };
            let s = self.scatter_queue.pop_front().expect("non-empty");
            let token = self.token();
            let region_addr = self.arena.base + s.offset;
            self.jobs.insert(
                token,
                JobRef::Scatter {
                    flow: s.flow,
                    offset: s.offset,
                    chunk: s.chunk,
                    dst: s.dst,
                },
            );
            if let Some(w) = &self.workers {
                w.submit(CopyJob {
                    token,
                    kind: CopyKind::Scatter,
                    region_addr,
                    plan: CopyPlan::Runs(s.runs),
                });
            }
        }
    }

    /// Answers every [`Command::DisallowScatter`] whose range no queued or
    /// running scatter writes into any more.
    fn answer_disallowed(&mut self) {
        if self.disallowed.is_empty() {
            return;
        }
        let busy = |a: u64, e: u64, (s0, s1): (u64, u64)| s0 < e && a < s1;
        let mut k = 0;
        while k < self.disallowed.len() {
            let (a, e, _) = self.disallowed[k];
            let in_use = self.scatter_queue.iter().any(|p| busy(a, e, p.dst))
                || self.jobs.values().any(|j| match j {
                    JobRef::Scatter { dst, .. } => busy(a, e, *dst),
                    _ => false,
                });
            if in_use {
                k += 1;
            } else {
                let (_, _, reply) = self.disallowed.swap_remove(k);
                let _ = reply.send(());
            }
        }
    }

    fn drain_copies(&mut self) -> usize {
        let mut n = 0;
        while let Ok(done) = self.done_rx.try_recv() {
            n += 1;
            self.exec.release(());
            match self.jobs.remove(&done.token) {
                Some(JobRef::Gather { rid, chunk, local }) => {
                    match done.result {
                        Ok(()) => {
                            if let Some(req) = self.requests.get_mut(&rid) {
                                tracing::trace!(rid, chunk, "gathered");
                                req.state[chunk].state = ChunkState::Gathered;
                                req.state[chunk].scatter_runs = done.scatter_runs;
                                let now = Instant::now();
                                req.last_progress = now;
                                req.completion.note(Stage::Gathered, chunk, now);
                                self.pump(rid);
                            } else {
                                let _ = self.scheduler.release_local(local);
                            }
                        }
                        Err(e) => {
                            if let Some(req) = self.requests.get_mut(&rid) {
                                // Region is no longer written: free it with the request.
                                req.state[chunk].state = ChunkState::Gathered;
                            }
                            self.fail_request(rid, format!("gather of chunk {chunk}: {e}"));
                        }
                    }
                }
                Some(JobRef::OrphanGather { local }) => {
                    let _ = self.scheduler.release_local(local);
                    self.parked = true;
                    self.schedule_and_send();
                }
                Some(JobRef::Scatter {
                    flow,
                    offset,
                    chunk,
                    dst: _,
                }) => {
                    let live = self.scheduler.held_by_flow(&flow, offset);
                    let _ = self.scheduler.scatter_done(offset);
                    self.regions.remove(&offset);
                    if !self.scheduler.contains_flow(&flow) {
                        self.grant_index.remove(&flow);
                        if live {
                            // Its last chunk: the flow finished.
                            self.tombstone(flow.clone());
                        }
                    }
                    match (live, done.result) {
                        (true, Ok(())) => {
                            tracing::trace!(rid = flow.rid, chunk, "scattered");
                            self.stats.chunks_scattered.fetch_add(1, Ordering::Relaxed);
                            let ack = Message::Ack(Ack {
                                request_id: flow.rid,
                                chunk_index: chunk,
                                region_handle: offset,
                            });
                            self.send(&flow.peer, &ack);
                            // Our ACK restarts the sender's no-progress
                            // clock: the flow is not silent (the protocol
                            // simulator's bug 4, docs/protocol.md).
                            if let Some(t) = self.flow_seen.get_mut(&flow) {
                                *t = Instant::now();
                            }
                        }
                        (true, Err(e)) => {
                            // Never report landed on a failed scatter (seed §9).
                            tracing::warn!(agent = %self.name, flow = %flow, error = %e, "scatter failed; no ACK");
                        }
                        (false, _) => {} // orphan: freed, nothing to ACK
                    }
                    self.schedule_and_send();
                }
                None => {}
            }
        }
        n
    }

    /// Records that `peer` was heard now (at most every
    /// [`HEARD_GRANULARITY`] per peer: no lock or allocation otherwise).
    fn note_heard(&mut self, peer: &str) {
        let now = Instant::now();
        if self
            .heard_at
            .get(peer)
            .is_some_and(|t| now.duration_since(*t) < HEARD_GRANULARITY)
        {
            return;
        }
        self.heard_at.insert(peer.to_string(), now);
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        self.heard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer.to_string(), ms);
    }

    fn on_message(&mut self, peer: &str, bytes: &[u8]) {
        tracing::trace!(bytes = bytes.len(), "message in");
        self.note_heard(peer);
        match Message::decode(bytes) {
            Ok(Message::Want(w)) => self.on_want(peer, w),
            Ok(Message::Grant(g)) => self.on_grant(peer, g),
            Ok(Message::Data(d)) => self.on_data(peer, d),
            Ok(Message::Ack(a)) => self.on_ack(peer, a),
            Ok(Message::Reject(r)) => self.on_reject(peer, r),
            Ok(Message::Handshake(_)) => {
                tracing::warn!(agent = %self.name, peer, "handshake on the control channel; ignored")
            }
            Ok(Message::Notice(n)) => match &self.notice_sink {
                Some(tx) => {
                    if tx.try_send((peer.to_string(), n)).is_err() {
                        tracing::warn!(agent = %self.name, peer, "notice queue full or closed; notice dropped");
                    }
                }
                None => tracing::debug!(agent = %self.name, peer, "notice without a sink; dropped"),
            },
            Err(e) => {
                tracing::warn!(agent = %self.name, peer, error = %e, "undecodable control message; dropped")
            }
        }
    }

    /// The receiver refused request `r.request_id`: fail it now (only if
    /// it is ours to `peer` — a REJECT names no other peer's request).
    fn on_reject(&mut self, peer: &str, r: Reject) {
        let ours = self
            .requests
            .get(&r.request_id)
            .is_some_and(|q| q.peer == peer);
        if !ours {
            tracing::debug!(agent = %self.name, peer, rid = r.request_id, "REJECT for no request of ours to that peer; ignored");
            return;
        }
        self.stats.rejects_received.fetch_add(1, Ordering::Relaxed);
        let scope = self.requests.get(&r.request_id).map_or(0, |q| q.scope);
        self.fail_request(
            r.request_id,
            format!(
                "receiver {peer:?} refused the request (destination scope {scope}): {}",
                r.reason
            ),
        );
    }

    // ---------------- lifecycle ----------------

    fn forget_peer(&mut self, peer: &str) {
        // Fail our requests first, while the route still exists, so their
        // cancels reach a receiver that is alive (it never forgets us).
        let rids: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| r.peer == peer)
            .map(|(rid, _)| *rid)
            .collect();
        for rid in rids {
            self.fail_request(rid, format!("peer {peer:?} was forgotten"));
        }
        self.channel.remove_peer(peer);
        self.peers.remove(peer);
        let _ = self.engine.forget_peer(peer);
        for flow in self.scheduler.reclaim_by_prefix(peer).flows {
            self.tombstone(flow);
        }
        self.forget_regions(|f| f.peer == peer);
        self.grant_index.retain(|f, _| f.peer != peer);
        self.schedule_and_send();
    }

    fn shutdown(&mut self) {
        let rids: Vec<u64> = self.requests.keys().copied().collect();
        for rid in rids {
            self.fail_request(rid, "transport shut down".into());
        }
        // Finish copies already queued (bounded), then join workers.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.jobs.is_empty() && Instant::now() < deadline {
            if self.drain_copies() == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.workers.take();
        // Orphaned writes get their own bound, and at least one poll.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let _ = self.engine.progress();
            self.drain_orphan_writes();
            if self.orphan_writes.is_empty() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // Anything left may still read the arena: release the handles, but
        // tell the arena's owner not to free or reuse the memory.
        if !self.orphan_writes.is_empty() {
            tracing::error!(
                agent = %self.name, writes = self.orphan_writes.len(),
                "writes still in flight at shutdown after 5 s; the arena must not be freed"
            );
            self.stats.arena_in_doubt.store(true, Ordering::SeqCst);
        }
        for o in std::mem::take(&mut self.orphan_writes) {
            self.engine.release(o.handle);
            self.orphan_write_settled(o.rid);
        }
        // Resolve commands that raced with shutdown. A submit queued after
        // this drain sees `closed` and resolves its own handle.
        self.closed.store(true, Ordering::SeqCst);
        while let Ok(cmd) = self.cmd_rx.try_recv() {
            match cmd {
                Command::Submit { completion, .. }
                    if completion
                        .resolve(TransferOutcome::Failure("transport shut down".into())) =>
                {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                }
                Command::ForgetPeer { reply, .. } => {
                    let _ = reply.send(());
                }
                Command::AddPeer { reply, .. } => {
                    let _ = reply.send(Err(ControlError::Transport("shut down".into())));
                }
                _ => {}
            }
        }
        // The gauges' last values: read after shutdown, they are not stale.
        self.update_gauges();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spinning_wait_sees_the_outcome_and_honours_its_timeout() {
        for spin in [
            Duration::ZERO,
            Duration::from_millis(20),
            Duration::from_secs(5),
        ] {
            // Resolved while the waiter spins (or blocks).
            let c = Arc::new(Completion::with_spin(spin));
            let h = TransferHandle::from_completion(c.clone());
            let resolver = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(5));
                c.resolve(TransferOutcome::Failure("boom".into()));
            });
            let t0 = Instant::now();
            assert_eq!(
                h.wait(Duration::from_secs(10)),
                Some(TransferOutcome::Failure("boom".into())),
                "spin {spin:?}"
            );
            // Seen when it resolves, not at the end of a 5 s spin.
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "spin {spin:?}: {:?}",
                t0.elapsed()
            );
            resolver.join().unwrap();
            // Never resolved: the wait ends at its timeout even when the
            // spin window is longer.
            let h = TransferHandle::from_completion(Arc::new(Completion::with_spin(spin)));
            let t0 = Instant::now();
            assert_eq!(h.wait(Duration::from_millis(30)), None);
            let waited = t0.elapsed();
            assert!(
                waited >= Duration::from_millis(30) && waited < Duration::from_secs(2),
                "spin {spin:?}: waited {waited:?} for a 30 ms timeout"
            );
        }
    }

    #[test]
    fn transport_verdict_flags_only_slow_large_gpu_writes() {
        let mib = 1 << 20;
        // Emulation-like rates between GPUs (H200: 0.1–0.3 GB/s) are flagged.
        assert!(suspect_fallback(true, 32 * mib, 150));
        assert!(suspect_fallback(true, mib, 4_999));
        // cuda_ipc / RDMA rates are not; nor is the threshold itself.
        assert!(!suspect_fallback(true, 32 * mib, 250_000));
        assert!(!suspect_fallback(true, 32 * mib, 5_000));
        // Small writes are latency-bound: not judged.
        assert!(!suspect_fallback(true, mib - 1, 10));
        // Host memory is never judged (2 GB/s loopback is normal).
        assert!(!suspect_fallback(false, 32 * mib, 10));
    }
}
