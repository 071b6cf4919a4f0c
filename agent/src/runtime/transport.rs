//! The bounce reactor (seed §4 `BounceTransport`, §6–§9): one IO thread per
//! agent owns the protocol machine (the credit scheduler, the sender
//! request table and the receiver region table); copy workers run gathers
//! and scatters and report back. Both roles share one arena.
//!
//! The protocol itself — both roles' state and every transition — is
//! [`kvfabric_core::protocol::Machine`] (sans-IO, issue 17); the IO thread
//! is its reactor. Per tick (seed §7): drain commands (submit / add peer /
//! forget peer / scopes / shutdown); receive control messages; drain copy
//! completions; poll in-flight writes (live and orphaned); feed the
//! machine's timer when its next deadline passed. Each event becomes an
//! [`Input`]; the [`Action`]s the machine then emits are performed in order
//! (sends, gather / scatter jobs, write posts, resolutions, route drops,
//! quiesce answers), and its counters are added to [`TransportStats`]
//! before any action. Polling is adaptive:
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

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use kvfabric_core::plan::{BlockPlanes, ChunkBound, TransferPlan};
use kvfabric_core::protocol::{
    Action, ChunkStage, Config, Counters, Event, Input, Machine, Mutations, Nanos, Outcome, Route,
    Step,
};
use kvfabric_core::scheduler::GrantPolicy;
use kvfabric_core::wire::{self, Message, Notice};
use kvfabric_core::{Descriptor, ScatterList};

use super::control::{ControlChannel, ControlError};
use super::engine::{MemDesc, MemKind, TransferEngine, XferHandle, XferState};
use super::exec::{
    BatchedChunk, ChunkGather, CopyDone, CopyEngine, CopyJob, CopyKind, CopyPlan, CopyWorkers,
    WorkerPrimer,
};
use super::spin::{Relax, SpinHistory, SpinSlots};
use super::waker::Waker;

/// Settings of one transport (the subset of `BounceConfig` the reactor
/// uses, already validated).
#[derive(Clone, Debug)]
pub struct TransportSettings {
    /// Buddy minimum block (bytes, power of two).
    pub granularity_bytes: u64,
    /// Per-chunk cap (bytes, multiple of 32, ≤ max allocation).
    pub max_chunk_size_bytes: u64,
    /// Chunk cap (bytes) of a request submitted while this transport has
    /// no other request in flight; 0 (this struct's default): off, every
    /// request uses `max_chunk_size_bytes` (agents built from the config
    /// get [`DEFAULT_SOLO_CHUNK_SIZE_BYTES`] under a larger max chunk,
    /// [`parse_solo_chunk`]). A lone request pipelines more, smaller
    /// chunks; under load fewer, larger chunks cost less host time each
    /// (issue 18, fourteenth session). Sender-local: a receiver sizes its
    /// regions from the WANT, so peers need not agree. A multiple of 32
    /// bytes within [`granularity_bytes`](Self::granularity_bytes) ..=
    /// `max_chunk_size_bytes`; anything else is warned about at start and
    /// off. From `KVFABRIC_SOLO_CHUNK_BYTES` or its default
    /// ([`parse_solo_chunk`]).
    pub solo_chunk_size_bytes: u64,
    /// A batched gather of a block hand-off reads its sources from the
    /// request's source planes (issue 18 step 3). Experiment switch
    /// `KVFABRIC_BLOCK_GATHER` (`0` / `false` / `off` turns it off; on by
    /// default): sender-local, the wire is the same.
    pub block_gather: bool,
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
    /// Stage eager gathers in the receiver's expected grant order
    /// (`eagerGrantOrder`, [`Config::eager_grant_order`]).
    pub eager_grant_order: bool,
    /// Free staging when its write completed, not at the ACK
    /// (`releaseStagingOnWrite`, [`Config::release_staging_on_write`]).
    pub release_staging_on_write: bool,
    /// Which flow this receiver grants a free region to next.
    pub grant_policy: GrantPolicy,
    /// `grantSizeWeight`: the weight of a request's bytes in its rank
    /// under [`GrantPolicy::ShortestFirst`] (≥ 1).
    pub grant_size_weight: u64,
    /// Take DATA_UNIFORM from peers (config `uniformData`; what is sent
    /// follows the capabilities both handshakes advertise).
    pub uniform_data: bool,
    /// Take DATA_BLOCKS from peers (config `blockData`; what is sent
    /// follows the capabilities both handshakes advertise).
    pub block_data: bool,
    /// Coalesce scatter runs (false = seed DISABLE_SCATTER_RUN_MERGING).
    pub merge_runs: bool,
    /// Hand the gathers one input starts (a new request's first chunks)
    /// to one copy worker as one job, for a copy engine with a
    /// [`max_batched_piece_bytes`](CopyEngine::max_batched_piece_bytes) (config
    /// `batchGathers`; issue 18 step 3). Without it, or on other engines,
    /// one job a chunk.
    pub batch_gathers: bool,
    /// Busy-poll window: while the transport has work in flight (requests
    /// waiting for GRANT/ACK, granted regions waiting for DATA, copies),
    /// the IO thread keeps polling without blocking for up to this long
    /// after its last event; so do the copy workers after each job (and
    /// when primed by a submit or WANT) and up to the process's cap of
    /// spinning callers in [`TransferHandle::wait`]
    /// ([`MAX_SPINNING_WAITERS`] unless `KVFABRIC_SPIN_WAITERS` says
    /// otherwise). A
    /// blocked IO thread pays a wake-up per control message — measured
    /// 100–400 µs per ZMQ hop on the H200 host (docs/benchmarks.md) — which
    /// at GPU speeds costs more than the data.
    /// Takes a core while active. From the bounce config's `ioBusyPollUs`
    /// ([`kvfabric_core::config::BusyPoll`]).
    pub busy_poll: Duration,
    /// Callers of [`TransferHandle::wait`] (bounce and standard path)
    /// spin only while a quarter of the recent waits ended inside the
    /// busy-poll window
    /// ([`SpinHistory`]; issue 18). Off: every wait spins (up to the
    /// process's cap, [`spin_waiters_cap`], at once).
    pub spin_adaptive: bool,
    /// Most copy workers that spin between jobs at once
    /// ([`crate::runtime::spin::SpinSlots`]; issue 18).
    pub spinning_workers: usize,
    /// What spinning threads (copy workers, callers of `wait`, the IO
    /// thread in its busy-poll window) do between two polls
    /// ([`Relax`]; yield by default).
    pub spin_relax: Relax,
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
            solo_chunk_size_bytes: 0,
            block_gather: true,
            max_inflight_chunks: 8,
            copy_contexts: 8,
            copy_workers: 4,
            request_timeout: Duration::from_millis(30_000),
            eager_gather: true,
            eager_grant_order: true,
            release_staging_on_write: true,
            grant_policy: GrantPolicy::ShortestFirst,
            grant_size_weight: kvfabric_core::scheduler::DEFAULT_SIZE_WEIGHT,
            uniform_data: true,
            block_data: true,
            merge_runs: true,
            batch_gathers: true,
            busy_poll: Duration::ZERO,
            spin_adaptive: true,
            spinning_workers: DEFAULT_SPINNING_WORKERS,
            spin_relax: Relax::Yield,
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
    /// The transport's submit call began, on the caller's thread (chunk 0).
    Entered,
    /// The caller's sizing pass ([`TransferPlan::chunk_bounds`]) ended, on
    /// the caller's thread (chunk 0).
    Sized,
    /// The caller hands the request to the IO thread's command queue (and
    /// wakes it), on the caller's thread (chunk 0).
    Queued,
    /// The IO thread took the request off its command queue (chunk 0):
    /// submit → this is the caller's sizing plus the IO thread's wake-up.
    Received,
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
            Stage::Entered => "entered",
            Stage::Sized => "sized",
            Stage::Queued => "queued",
            Stage::Received => "received",
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
    /// Recent waits of the transport's callers: spin only while they pay
    /// (`None`: always spin).
    history: Option<Arc<SpinHistory>>,
    /// What a spinning waiter does between two polls.
    relax: Relax,
    /// Stage events, for a traced request only (`None`: one branch on the
    /// IO thread, nothing recorded).
    timeline: Option<Mutex<Timeline>>,
    /// The transport's count of requests in flight: taken one off when
    /// this resolves (or is dropped unresolved).
    live: LiveCount,
}

/// One request's place in its transport's count of requests in flight:
/// given back once, at [`LiveCount::release`] or when dropped.
#[derive(Default)]
struct LiveCount {
    count: Option<Arc<AtomicUsize>>,
    released: AtomicBool,
}

impl LiveCount {
    /// Counts one more request in `count`; returns the place and how many
    /// were in flight before it.
    fn take(count: &Arc<AtomicUsize>) -> (Self, usize) {
        let before = count.fetch_add(1, Ordering::AcqRel);
        (
            Self {
                count: Some(count.clone()),
                released: AtomicBool::new(false),
            },
            before,
        )
    }

    /// Gives the place back (once; later calls do nothing).
    fn release(&self) {
        if let Some(c) = &self.count {
            if !self.released.swap(true, Ordering::AcqRel) {
                c.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

impl Drop for LiveCount {
    fn drop(&mut self) {
        self.release();
    }
}

impl Completion {
    /// A cell whose waiters poll for up to `spin` before blocking on the
    /// condition variable (the transport's busy-poll window: a blocked
    /// waiter pays a wake-up, 50–200 µs on the H200 host, after the
    /// transfer is already done). Zero blocks at once.
    ///
    /// With `history`, waiters spin only while it says recent waits paid
    /// (`None`: always); between two polls they pause with `relax`.
    pub(crate) fn with_spin_history(
        spin: Duration,
        history: Option<Arc<SpinHistory>>,
        relax: Relax,
    ) -> Self {
        Self {
            spin,
            history,
            relax,
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
        // Before the waiter can see it: its next submit counts this one
        // gone.
        self.live.release();
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

/// Most callers that spin in [`TransferHandle::wait`] at once (process-
/// wide); the rest block at once. One (issue 18, thirteenth session; was
/// 4): on the H200 host under the open loop, with four, the host ran
/// 88–162 k context switches a second, 54–124 k of them the waiting
/// callers' yields (against 9–13 k in all with one), and their cores
/// were taken from the agents' threads; with one, p99 from arrival was
/// lower in 7 of 8 paired runs (2,100–3,200 req/s) and no run collapsed
/// (2 of 8 with four), while an isolated request (one caller: it still
/// spins) and the closed loop stayed within the noise
/// (docs/benchmarks.md, "Issue 18, thirteenth session").
/// `KVFABRIC_SPIN_WAITERS` overrides it for the process
/// ([`spin_waiters_cap`]).
pub const MAX_SPINNING_WAITERS: usize = 1;

/// Solo chunk size used when `KVFABRIC_SOLO_CHUNK_BYTES` is unset and
/// the max chunk is larger, bytes (32 MiB). On the H200 (MPS, seed shape,
/// 64 MiB max chunk; docs/benchmarks.md, "Issue 18, sixteenth session"),
/// one request at a time: 1,366 / 1,328 req/s with 32 MiB against
/// 1,286 / 1,299 off and 1,248 / 1,143 with 16 MiB (a chunk costs the host
/// ≈ 50–150 µs, so 16 MiB pieces of a 151 MB request cost more than they
/// pipeline); an isolated 64 MiB request 0.339 / 0.340 ms against 0.386 /
/// 0.425 off and 0.370 / 0.369 with 16 MiB. On the 2-core dev machine
/// 16 MiB first cut the README main job's bounce p99 (= max of 40) from a
/// median of 1,890 to 1,156 ms ("fifteenth session").
pub const DEFAULT_SOLO_CHUNK_SIZE_BYTES: u64 = 32 << 20;

/// Whether `bytes` can cut chunks as a solo size: a multiple of 32 bytes
/// within `granularity_bytes ..= max_chunk_size_bytes`.
fn valid_solo_chunk(bytes: u64, max_chunk_size_bytes: u64, granularity_bytes: u64) -> bool {
    bytes % kvfabric_core::plan::ALIGN == 0
        && bytes >= granularity_bytes
        && bytes <= max_chunk_size_bytes
}

/// An experiment switch that is on by default — `KVFABRIC_BLOCK_GATHER`
/// ([`TransportSettings::block_gather`]), `KVFABRIC_NIXL_REPOST`
/// ([`crate::runtime::engine::NixlTransferEngine::new`]): off for `0`,
/// `false` or `off` (any case, surrounding blanks ignored), on otherwise and
/// when unset.
pub fn parse_on_switch(value: Option<&str>) -> bool {
    !value.is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "false" | "off"
        )
    })
}

/// The switch `KVFABRIC_SOLO_CHUNK_BYTES` (issue 18): the chunk cap of a
/// request submitted while its transport has no other in flight
/// ([`TransportSettings::solo_chunk_size_bytes`]), in bytes with an
/// optional suffix (`32MiB`). Unset (`None`): [`DEFAULT_SOLO_CHUNK_SIZE_BYTES`]
/// when `max_chunk_size_bytes` is larger, else off (a lone request then
/// uses the max chunk, as every other). `0`: off. A value that does not
/// parse, is not a multiple of 32 bytes, or lies outside
/// `granularity_bytes ..= max_chunk_size_bytes` is warned about (naming
/// the variable) and leaves it off; so does the default under a
/// granularity above it (silently: nothing was set).
pub fn parse_solo_chunk(
    value: Option<&str>,
    max_chunk_size_bytes: u64,
    granularity_bytes: u64,
) -> u64 {
    let Some(v) = value.map(str::trim) else {
        return if max_chunk_size_bytes > DEFAULT_SOLO_CHUNK_SIZE_BYTES
            && valid_solo_chunk(
                DEFAULT_SOLO_CHUNK_SIZE_BYTES,
                max_chunk_size_bytes,
                granularity_bytes,
            ) {
            DEFAULT_SOLO_CHUNK_SIZE_BYTES
        } else {
            0
        };
    };
    match kvfabric_core::config::parse_byte_size(v) {
        Ok(0) => 0,
        Ok(n) if valid_solo_chunk(n, max_chunk_size_bytes, granularity_bytes) => n,
        Ok(n) => {
            tracing::warn!(
                value = v,
                bytes = n,
                max_chunk_size_bytes,
                granularity_bytes,
                "KVFABRIC_SOLO_CHUNK_BYTES: expected a multiple of 32 bytes from the allocation granularity to the max chunk size; off"
            );
            0
        }
        Err(e) => {
            tracing::warn!(
                value = v,
                error = %e,
                "KVFABRIC_SOLO_CHUNK_BYTES: expected a byte size (e.g. 32MiB); off"
            );
            0
        }
    }
}

/// This process's cap on callers spinning at once in
/// [`TransferHandle::wait`]: `KVFABRIC_SPIN_WAITERS`
/// ([`crate::runtime::spin::parse_spin_waiters`]), else
/// [`MAX_SPINNING_WAITERS`]. Read once, when the first agent of the
/// process starts ([`crate::runtime::spin::SpinEnv::read`]) — a bad value
/// is warned about then.
pub fn spin_waiters_cap() -> usize {
    static CAP: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        crate::runtime::spin::parse_spin_waiters(
            std::env::var("KVFABRIC_SPIN_WAITERS").ok().as_deref(),
        )
    })
}

/// Default of [`TransportSettings::spinning_workers`]: no cap (every
/// worker may spin). A cap of 2 measured on the H200 (issue 18, eighth
/// session): 128 in flight about the same, 8 in flight 10 % fewer
/// requests a second and an isolated request 15 % slower — a request's
/// gathers and scatters run on several workers at once, and each blocked
/// one takes 50–200 µs to wake.
pub const DEFAULT_SPINNING_WORKERS: usize = usize::MAX;

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
    /// before it blocks — if fewer than the process's cap
    /// ([`spin_waiters_cap`]) of callers are spinning already.
    ///
    /// Under [`TransportSettings::spin_adaptive`] the caller spins only
    /// while at least a quarter of the transport's recent waits ended
    /// inside the window ([`SpinHistory`]): with many requests in flight a
    /// wait takes tens of ms and spinning only takes a core from the
    /// threads that move the bytes.
    pub fn wait(&self, timeout: Duration) -> Option<TransferOutcome> {
        let start = Instant::now();
        let history = self.completion.history.as_deref();
        let spin = if history.is_some_and(|h| !h.should_spin()) {
            Duration::ZERO
        } else {
            self.completion.spin.min(timeout)
        };
        let outcome = self.wait_spinning(start, spin, timeout);
        if let Some(h) = history {
            let window = self.completion.spin;
            match &outcome {
                _ if window.is_zero() => {}
                // Resolved: this wait took this long.
                Some(_) => h.record(start.elapsed(), window),
                // Timed out after at least a window: past it. A shorter
                // poll (`wait(0)`, 1 ms polls) says nothing about it.
                None if timeout >= window => h.record(Duration::MAX, window),
                None => {}
            }
        }
        outcome
    }

    /// [`wait`](Self::wait) with a spin window of `spin`.
    fn wait_spinning(
        &self,
        start: Instant,
        spin: Duration,
        timeout: Duration,
    ) -> Option<TransferOutcome> {
        // A timeout past Instant's range waits without a deadline.
        let deadline = start.checked_add(timeout);
        // At most MAX_SPINNING_WAITERS callers of the process spin at once
        // (a replay with 128 waiting threads must not take 128 cores); the
        // others block at once.
        let cap = spin_waiters_cap();
        if !spin.is_zero()
            && !self.completion.resolved.load(Ordering::Acquire)
            && SPINNING_WAITERS
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < cap).then_some(n + 1)
                })
                .is_ok()
        {
            while !self.completion.resolved.load(Ordering::Acquire) && start.elapsed() < spin {
                self.completion.relax.pause();
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
            s = match deadline {
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return None;
                    }
                    self.completion
                        .cv
                        .wait_timeout(s, deadline - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
                None => self
                    .completion
                    .cv
                    .wait(s)
                    .unwrap_or_else(|p| p.into_inner()),
            };
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
    /// DATA_UNIFORM messages sent (to peers advertising
    /// [`wire::CAP_UNIFORM_DATA`]).
    pub data_uniform: AtomicU64,
    /// DATA_BLOCKS messages sent (to peers advertising
    /// [`wire::CAP_BLOCK_DATA`]).
    pub data_blocks: AtomicU64,
    /// Encoded bytes of all DATA, DATA_UNIFORM and DATA_BLOCKS messages
    /// sent (the control-plane cost of describing scatters).
    pub data_wire_bytes: AtomicU64,
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
    /// (gauge: gathering, gathered, writing or DATA sent; stored when the
    /// IO loop goes idle, at least every millisecond while it is busy).
    pub chunks_in_flight: AtomicU64,
    /// Live flows of this agent's receiver role: incoming requests the
    /// credit scheduler tracks, from their WANT until their last ACK or
    /// reclaim (gauge, a count; stored by the IO thread each tick).
    pub recv_flows: AtomicU64,
    /// Live flows of this agent's sender role: bounce requests in the IO
    /// thread's request table, from their submit command until resolution
    /// (gauge, a count; stored by the IO thread each tick).
    pub send_flows: AtomicU64,
    /// Reverse routes (seed §5: routes from WANTs of peers not loaded)
    /// replaced at [`MAX_REVERSE_ROUTES`] by a WANT from a new name
    /// ([`ReverseRoutes::admit`]).
    pub reverse_routes_replaced: AtomicU64,
    /// Control connections closed because their hello did not pass the
    /// control key (`controlAuth`: unsigned where required, another key,
    /// made for another agent, replayed, clock off by more than 60 s).
    pub control_hellos_refused: AtomicU64,
    /// Unsigned control hellos accepted in `controlAuth: optional` (while
    /// it grows, some agent does not sign yet: `required` would refuse it).
    pub control_hellos_unsigned: AtomicU64,
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

/// The IO thread is gone: a command was not queued.
#[derive(Debug)]
struct TransportClosed;

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
        /// The chunk cap `chunks` were cut with (bytes).
        chunk_cap: u64,
        /// Every descriptor's length when all have one (bytes), measured
        /// with `chunks` (`TransferPlan::chunk_bounds_measured`).
        uniform_len: Option<u64>,
        /// The request's source planes (`BlockPlanes::of_srcs`), found
        /// with `chunks` when the engine batches gathers of that length.
        src_planes: Option<Arc<OnceLock<Option<BlockPlanes>>>>,
        completion: Arc<Completion>,
    },
    AddPeer {
        peer: String,
        endpoint: Vec<u8>,
        kind: MemKind,
        capabilities: u32,
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
    /// Recent waits of this transport's callers
    /// ([`TransportSettings::spin_adaptive`]; `None`: always spin).
    wait_history: Option<Arc<SpinHistory>>,
    /// What the handles' waiters do between two polls.
    spin_relax: Relax,
    /// The plan's chunk cap, bytes (for the sizing pass in `submit`).
    max_chunk_size_bytes: u64,
    /// [`TransportSettings::solo_chunk_size_bytes`] (0: off).
    solo_chunk_size_bytes: u64,
    /// `TransportSettings::block_gather`.
    block_gather: bool,
    /// Requests submitted and not resolved yet (counted only while solo
    /// chunks are on).
    live: Arc<AtomicUsize>,
    /// Wakes idle copy workers when a request is submitted.
    primer: WorkerPrimer,
    /// The per-request in-flight cap `W`, chunks.
    max_inflight: usize,
    /// Requests whose descriptors are at most this long (bytes) have their
    /// first gathers batched into one job (`TransportSettings::batch_gathers`;
    /// 0 when not batching): a submit then wakes one copy worker, not `W`.
    batched_piece_max: u64,
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

/// Routes kept at most to peers this agent was not told of (added from a
/// WANT's endpoint: seed §5's reverse-path bootstrap). At the cap, a WANT
/// from yet another unknown name takes the place of the reverse route
/// heard from least recently among those with no live flow here, else it
/// is rejected: names on the control channel are not authenticated, each
/// such route holds a socket and a send queue, and made-up names must not
/// lock the reverse path out for good (a name's flows end within twice
/// the request timeout of its last message: the machine's silence sweep).
/// Peers loaded from discovery do not count.
pub const MAX_REVERSE_ROUTES: usize = 1024;

/// A reverse route is replaced only once nothing was received from or
/// sent to its peer for this long (a flow's last ACK counts when it is
/// handed to the channel).
pub const REVERSE_ROUTE_MIN_IDLE: Duration = Duration::from_secs(1);

/// What [`ReverseRoutes::admission`] decides for a peer with no route yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// The peer is loaded, or its reverse route is already held.
    Held,
    /// A new reverse route, under the cap.
    Added,
    /// A new reverse route in the place of this one (at the cap: the least
    /// recently used without a live flow, unused for at least
    /// [`REVERSE_ROUTE_MIN_IDLE`]), whose route goes once the new one is
    /// added.
    Replaced(String),
    /// At the cap, every reverse route's peer has a live flow or was used
    /// within [`REVERSE_ROUTE_MIN_IDLE`].
    Refused,
}

/// Which routes exist only because a peer's WANT named its endpoint
/// (seed §5 reverse path), when each was last used (a message received
/// from or sent to its peer), and the cap on them ([`MAX_REVERSE_ROUTES`]).
/// Pure bookkeeping: the IO thread decides with [`Self::admission`], adds
/// the route, then [`Self::commit`]s; it passes the time in.
#[derive(Debug)]
pub struct ReverseRoutes {
    cap: usize,
    loaded: HashSet<String>,
    /// Reverse route → when it was last used (or admitted).
    reverse: HashMap<String, Instant>,
    replaced: u64,
}

impl ReverseRoutes {
    /// Empty, with room for `cap` reverse routes.
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            loaded: HashSet::new(),
            reverse: HashMap::new(),
            replaced: 0,
        }
    }

    /// `peer` was loaded (discovery's add_peer): its route is no longer a
    /// reverse one.
    pub fn loaded(&mut self, peer: &str) {
        self.reverse.remove(peer);
        self.loaded.insert(peer.to_string());
    }

    /// `peer` was forgotten: neither loaded nor reverse any more.
    pub fn forgotten(&mut self, peer: &str) {
        self.reverse.remove(peer);
        self.loaded.remove(peer);
    }

    /// A message from or to `peer` passed at `now` (kept for reverse
    /// routes).
    pub fn used(&mut self, peer: &str, now: Instant) {
        if let Some(t) = self.reverse.get_mut(peer) {
            *t = now;
        }
    }

    /// Whether `count() >= cap` (only then does [`Self::admission`] ask
    /// which peers are busy).
    pub fn at_cap(&self) -> bool {
        self.reverse.len() >= self.cap
    }

    /// Whether a reverse route to `peer` may be held, at `now`. Changes
    /// nothing: [`Self::commit`] records it once the route exists. At the
    /// cap the route of the least recently used reverse peer that `busy`
    /// says has no live flow and that was unused for
    /// [`REVERSE_ROUTE_MIN_IDLE`] makes room (ties: the smaller name), else
    /// `peer` is refused. O(routes) at the cap.
    pub fn admission(&self, peer: &str, now: Instant, busy: impl Fn(&str) -> bool) -> Admission {
        if self.loaded.contains(peer) || self.reverse.contains_key(peer) {
            return Admission::Held;
        }
        if !self.at_cap() {
            return Admission::Added;
        }
        self.reverse
            .iter()
            .filter(|(p, t)| {
                now.saturating_duration_since(**t) >= REVERSE_ROUTE_MIN_IDLE && !busy(p)
            })
            .min_by(|a, b| a.1.cmp(b.1).then_with(|| a.0.cmp(b.0)))
            .map_or(Admission::Refused, |(p, _)| Admission::Replaced(p.clone()))
    }

    /// Records what [`Self::admission`] decided for `peer` once its route
    /// was added (used at `now`): a new reverse route, the replaced one
    /// gone. `Held` and `Refused` change nothing.
    pub fn commit(&mut self, peer: &str, now: Instant, admission: &Admission) {
        match admission {
            Admission::Held | Admission::Refused => return,
            Admission::Replaced(old) => {
                self.reverse.remove(old);
                self.replaced += 1;
            }
            Admission::Added => {}
        }
        self.reverse.insert(peer.to_string(), now);
    }

    /// Reverse routes held.
    pub fn count(&self) -> usize {
        self.reverse.len()
    }

    /// Reverse routes replaced at the cap so far.
    pub fn replaced(&self) -> u64 {
        self.replaced
    }
}

/// Ticks without any event before the IO thread yields between engine
/// polls (writes in flight) or blocks in the channel's receive (otherwise).
const SPIN_BEFORE_BACKOFF: u32 = 64;
/// Longest blocking wait of an IO thread with no write in flight (bytes
/// never wait on it: messages, copy completions and commands wake the
/// thread at once; it bounds timeout checks and engine progress for
/// targets of AM-emulated RMA).
const IDLE_WAIT: Duration = Duration::from_millis(1);

/// How stale the chunks-in-flight gauge may get while the IO thread is
/// busy (it is stored at once when the thread goes idle).
const GAUGE_PERIOD: Duration = Duration::from_millis(1);

/// Most ended receiver flows remembered at once (≈ 250 bytes each: at most
/// ≈ 64 MB). Past it the oldest are forgotten first (counted in
/// [`TransportStats::tombstones_evicted`]): the replay guard then covers
/// less than 2 × the request timeout (only above ~2,200 flows/s ending
/// with the default 30 s timeout).
pub const MAX_TOMBSTONES: usize = 262_144;

/// Bound on synchronous commands (add/forget peer, snapshot).
const SYNC_TIMEOUT: Duration = Duration::from_secs(5);

/// Most chunks in one batched gather job (`TransportSettings::batch_gathers`):
/// a request's first chunks (W = 8 by default) go as one submission; a
/// longer run of started gathers is split so that other workers take part.
pub const MAX_GATHER_BATCH: usize = 8;

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
        let endpoint = channel.local_endpoint();
        // The protocol: both roles over one credit scheduler of the arena
        // (it keeps one max-size block back for credit-backed local
        // staging while this agent sends: the bidirectional reserve).
        let mut m = Machine::new(Config {
            arena_bytes: arena.len,
            granularity_bytes: settings.granularity_bytes,
            max_chunk_size_bytes: settings.max_chunk_size_bytes,
            max_inflight_chunks: settings.max_inflight_chunks,
            copy_contexts: settings.copy_contexts.max(1),
            request_timeout: u64::try_from(settings.request_timeout.as_nanos()).unwrap_or(u64::MAX),
            eager_gather: settings.eager_gather,
            eager_grant_order: settings.eager_grant_order,
            release_staging_on_write: settings.release_staging_on_write,
            grant_policy: settings.grant_policy,
            grant_size_weight: settings.grant_size_weight,
            uniform_data: settings.uniform_data,
            block_data: settings.block_data,
            arena_base: arena.base,
            device_id: arena.device_id as i32,
            endpoint: endpoint.clone(),
            mutations: Mutations::default(),
        })?;
        // Over in-order channels a cancel never precedes its WANT: no
        // tombstone for an unknown flow (any peer could make it hold
        // memory), and at most MAX_TOMBSTONES.
        m.set_tombstone_policy(MAX_TOMBSTONES, false);
        m.set_log_name(&name);
        for &(addr, len) in &settings.allowed_scatter_ranges {
            m.handle(0, Input::AllowScatter { addr, len });
        }
        for &(scope, addr, len) in &settings.scoped_ranges {
            m.handle(0, Input::AllowScope { scope, addr, len });
        }
        while m.poll().is_some() {}
        let busy_poll = settings.busy_poll;
        let max_chunk_size_bytes = settings.max_chunk_size_bytes;
        // The solo chunk cap, checked here too (a public setting): a
        // multiple of 32 bytes within [granularity, max chunk], else off.
        let settings_block_gather = settings.block_gather;
        let settings_solo_chunk = match settings.solo_chunk_size_bytes {
            0 => 0,
            s if valid_solo_chunk(s, max_chunk_size_bytes, settings.granularity_bytes) => {
                tracing::info!(
                    agent = %name,
                    solo_chunk_size_bytes = s,
                    max_chunk_size_bytes,
                    "a request submitted alone is cut into solo chunks (KVFABRIC_SOLO_CHUNK_BYTES)"
                );
                s
            }
            s => {
                tracing::warn!(
                    agent = %name,
                    solo_chunk_size_bytes = s,
                    granularity_bytes = settings.granularity_bytes,
                    max_chunk_size_bytes,
                    "solo chunk size not a multiple of 32 bytes within [granularity, max chunk]: off"
                );
                0
            }
        };
        let max_inflight = settings.max_inflight_chunks.max(1);
        let first_request_id = settings.first_request_id.max(1);
        let initial_sink = settings.notice_sink.clone();
        let closed = Arc::new(AtomicBool::new(false));
        let io_blocked = Arc::new(AtomicBool::new(false));
        let waker = Arc::new(Waker::new().map_err(|e| format!("IO thread waker (eventfd): {e}"))?);
        channel.set_waker(waker.clone());
        let (cmd_tx, cmd_rx) = crossbeam_channel::unbounded();
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        // The longest piece batched (0: no batching).
        let batched_piece_max = if settings.batch_gathers {
            copy.max_batched_piece_bytes()
        } else {
            0
        };
        let workers = CopyWorkers::start(
            &name,
            settings.copy_workers,
            copy,
            done_tx,
            Some(waker.clone()),
            settings.busy_poll,
            SpinSlots::with_relax(settings.spinning_workers, settings.spin_relax),
        )
        .map_err(|e| format!("spawning copy workers: {e}"))?;
        let spin_relax = settings.spin_relax;
        let wait_history = settings.spin_adaptive.then(|| Arc::new(SpinHistory::new()));
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
            reverse_routes: ReverseRoutes::new(MAX_REVERSE_ROUTES),
            name: name.clone(),
            engine,
            channel,
            arena,
            settings,
            m,
            origin: Instant::now(),
            last_counters: Counters::default(),
            deadline: None,
            deadline_stale: true,
            gauges_dirty: true,
            gauges_at: Instant::now(),
            workers: Some(workers),
            gather_batch: Vec::new(),
            batched_piece_max,
            done_rx,
            cmd_rx,
            stats: stats.clone(),
            closed: closed.clone(),
            io_blocked: io_blocked.clone(),
            peer_kinds: HashMap::new(),
            peer_caps: HashMap::new(),
            probes: HashMap::new(),
            reqs: HashMap::new(),
            writes: Vec::new(),
            landed: Vec::new(),
            queues: Vec::new(),
            quiesce: HashMap::new(),
            next_quiesce: 1,
            notice_sink: initial_sink,
            faults: FaultPlan::default(),
            tx_buf: Vec::new(),
        };
        let handle = std::thread::Builder::new()
            // The role first: Linux keeps 15 bytes of a thread's name.
            .name(format!("io:{name}"))
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
            wait_history,
            spin_relax,
            max_chunk_size_bytes,
            solo_chunk_size_bytes: settings_solo_chunk,
            block_gather: settings_block_gather,
            live: Arc::new(AtomicUsize::new(0)),
            primer,
            max_inflight,
            batched_piece_max,
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

    /// Queues `cmd` for the IO thread and wakes it; `Err` when the IO
    /// thread is gone (the command is dropped).
    fn send_cmd(&self, cmd: Command) -> Result<(), TransportClosed> {
        let r = self.cmd.send(cmd).map_err(|_| TransportClosed);
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

    /// Registers a receiver peer: its control endpoint, the memory kind
    /// of its arena and the capabilities its handshake advertised
    /// ([`wire::Handshake::capabilities`], those both agents advertise:
    /// uniform chunks are described to it as DATA_UNIFORM when it has
    /// [`wire::CAP_UNIFORM_DATA`]). Waits at most 5 s for the IO thread.
    ///
    /// # Errors
    /// [`ControlError::InvalidEndpoint`] for a malformed endpoint;
    /// [`ControlError::Transport`] if the IO thread is gone or slow.
    pub fn add_peer(
        &self,
        peer: &str,
        endpoint: &[u8],
        kind: MemKind,
        capabilities: u32,
    ) -> Result<(), ControlError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send_cmd(Command::AddPeer {
            peer: peer.to_string(),
            endpoint: endpoint.to_vec(),
            kind,
            capabilities,
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
        let mut completion = Completion::with_spin_history(
            self.busy_poll,
            self.wait_history.clone(),
            self.spin_relax,
        );
        if traced {
            completion.timeline = Some(Mutex::new(Timeline::default()));
        }
        // With solo chunks on, counted in flight until its completion
        // resolves (or is dropped); off, nothing is counted.
        let chunk_cap = if self.solo_chunk_size_bytes == 0 {
            self.max_chunk_size_bytes
        } else {
            let (live, others) = LiveCount::take(&self.live);
            completion.live = live;
            if others == 0 {
                self.solo_chunk_size_bytes
            } else {
                self.max_chunk_size_bytes
            }
        };
        let completion = Arc::new(completion);
        completion.note(Stage::Entered, 0, Instant::now());
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
                .div_ceil(chunk_cap)
                .clamp(1, self.max_inflight as u64);
            // One job takes a batched request's first gathers.
            let wanted = if descs[0].len <= self.batched_piece_max {
                1
            } else {
                estimate as usize
            };
            self.primer.prime(wanted);
        }
        let t_size = Instant::now();
        let (chunks, uniform_len) = match TransferPlan::chunk_bounds_measured(&descs, chunk_cap) {
            Ok(b) => b,
            Err(e) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                completion.resolve(TransferOutcome::Failure(format!("planning: {e}")));
                return handle;
            }
        };
        // A batched gather of a block hand-off reads its sources from the
        // planes (a table of a block a plane, not a piece: staging 16,384
        // addresses took 43–62 µs of the first gather's 79–122 µs enqueue
        // on the H200 host). Found by the copy worker that stages the
        // first batch (here it cost the submit 20–30 µs of sizing).
        let src_planes = match uniform_len {
            Some(len) if self.block_gather && len <= self.batched_piece_max && chunks.len() > 1 => {
                Some(Arc::new(OnceLock::new()))
            }
            _ => None,
        };
        completion.note(Stage::Sized, 0, Instant::now());
        tracing::trace!(
            rid,
            chunks = chunks.len(),
            sizing_us = t_size.elapsed().as_micros() as u64,
            "sized"
        );
        completion.note(Stage::Queued, 0, Instant::now());
        let sent = self
            .send_cmd(Command::Submit {
                rid,
                peer: peer.to_string(),
                scope,
                descs,
                chunks,
                chunk_cap,
                uniform_len,
                src_planes,
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
// IO thread: the reactor around the protocol machine
// ---------------------------------------------------------------------------

/// A sender request as the reactor knows it: what the machine's actions
/// need besides protocol state (the machine owns every transition).
struct ReqIo {
    completion: Arc<Completion>,
    /// The request's descriptors, shared with its chunks' gather jobs
    /// (each plans its chunk on the worker).
    descs: Arc<Vec<Descriptor>>,
    /// The peer's arena memory, from its registration at submit.
    remote_kind: MemKind,
    /// The peer took DATA_UNIFORM at submit: uniform chunks are described
    /// by their destinations, not planned runs.
    uniform_data: bool,
    /// The chunk cap the request was cut with (bytes; its chunks are
    /// planned with it).
    chunk_cap: u64,
    /// Every descriptor's length when all have one (bytes; from sizing).
    uniform_len: Option<u64>,
    /// The peer took DATA_BLOCKS at submit: the request's destination
    /// planes, found by its first chunk's gather job and shared by all
    /// (`ChunkGather::block_planes`).
    block_planes: Option<Arc<OnceLock<Option<BlockPlanes>>>>,
    /// The request's source planes, from sizing (`ChunkGather::src_planes`).
    src_planes: Option<Arc<OnceLock<Option<BlockPlanes>>>>,
}

/// A posted write (of a live request, or orphaned: its request resolved).
struct WriteIo {
    /// The machine's write id.
    id: u64,
    handle: XferHandle,
    rid: u64,
    chunk: u32,
    peer: String,
    /// Taken before the post (transport probe; an engine may copy inside it).
    posted_at: Instant,
}

/// A peer's transport probe in progress (see [`TransportReport`]).
#[derive(Default)]
struct WriteProbe {
    chunks: u32,
    bytes: u64,
    best_mbps: u64,
    best_bytes: u64,
}

/// The IO thread's state. Every protocol decision — the sender's request
/// and chunk table, credits, staging, the receiver's grants, regions,
/// DATA validation, scatter queue, orphans, deferred cancels, timeouts,
/// flow silence, tombstones, engine scopes — is the [`Machine`]'s; `Io`
/// turns commands, control messages, copy completions, engine polls and
/// the clock into [`Input`]s and performs the [`Action`]s the machine
/// emits.
struct Io {
    name: String,
    /// See [`BounceTransport::closed`].
    closed: Arc<AtomicBool>,
    /// See [`BounceTransport::io_blocked`].
    io_blocked: Arc<AtomicBool>,
    engine: Arc<dyn TransferEngine>,
    channel: Box<dyn ControlChannel>,
    /// Reused encode buffer for outgoing control messages.
    tx_buf: Vec<u8>,
    arena: ArenaSpec,
    settings: TransportSettings,
    /// The protocol (both roles).
    m: Machine,
    /// The machine's time origin (its `now` is ns since this instant).
    origin: Instant,
    /// The machine's counters as last added to `stats`.
    last_counters: Counters,
    /// The machine's next deadline, kept until it passes (`check_deadline`).
    deadline: Option<Nanos>,
    deadline_stale: bool,
    /// An input changed the machine since `chunks_in_flight` was stored.
    gauges_dirty: bool,
    /// When `chunks_in_flight` was last stored.
    gauges_at: Instant,
    workers: Option<CopyWorkers>,
    done_rx: Receiver<CopyDone>,
    cmd_rx: Receiver<Command>,
    stats: Arc<TransportStats>,
    /// Registered bounce peers and their arena memory.
    peer_kinds: HashMap<String, MemKind>,
    /// Each peer's advertised capabilities ([`wire::Handshake::capabilities`]).
    peer_caps: HashMap<String, u32>,
    /// Transport probes of peers whose report is not made yet.
    probes: HashMap<String, WriteProbe>,
    /// Requests in flight (exactly those in the machine's table).
    reqs: HashMap<u64, ReqIo>,
    /// Posted writes not yet terminal.
    writes: Vec<WriteIo>,
    /// Reused buffer of writes found terminal by one poll pass.
    landed: Vec<(WriteIo, Result<(), String>, Duration)>,
    /// Gathers started by the actions performed so far, held to go as one
    /// job (only when batching: `batched_piece_max` > 0); flushed before
    /// any other action and at the end of each `perform_all`, at most
    /// [`MAX_GATHER_BATCH`].
    gather_batch: Vec<BatchedChunk>,
    /// Chunks of pieces at most this long (bytes) are held for a batch:
    /// the engine's [`CopyEngine::max_batched_piece_bytes`] when
    /// `TransportSettings::batch_gathers`, else 0 (nothing held).
    batched_piece_max: u64,
    /// Reused action queues (one per nesting level of `perform_all`).
    queues: Vec<VecDeque<Step>>,
    /// Disallow / quiesce requests waiting for the machine's answer.
    quiesce: HashMap<u64, Sender<()>>,
    next_quiesce: u64,
    /// Where NOTICE messages go (the service layer), if anywhere.
    notice_sink: Option<Sender<(String, Notice)>>,
    faults: FaultPlan,
    /// See [`BounceTransport::heard`].
    heard: Arc<Mutex<HashMap<String, i64>>>,
    /// When `heard` was last updated per peer (throttle).
    heard_at: HashMap<String, Instant>,
    /// Routes added from WANTs of peers not loaded (capped).
    reverse_routes: ReverseRoutes,
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
            let must_poll = !self.writes.is_empty();
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
            // µs; a wake-up from poll(2) costs about as much). Without a
            // busy-poll window (the default below 8 CPUs) a request waiting
            // for arena space or a copy slot thus never spins a core the
            // copies need; with one, the IO thread keeps a core for up to
            // `busy_poll` after each event.
            let busy = !self.settings.busy_poll.is_zero()
                && self.m.is_busy()
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
                        self.on_message(peer, &bytes);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(agent = %self.name, error = %e, "control recv failed");
                        break;
                    }
                }
            }
            let done = self.drain_copies();
            let polled = self.poll_writes();
            self.check_deadline();
            let idle = got == 0 && done == 0 && polled == 0;
            self.update_gauges(idle);
            if idle {
                // Adaptive poll (seed §7): with writes in flight spin
                // briefly for latency, then yield (the engine needs progress
                // calls for them to complete); inside the busy-poll window
                // yield from the first idle tick (`Relax::Yield`);
                // otherwise the next tick blocks in the channel's receive
                // until an event.
                idle_spins = idle_spins.saturating_add(1);
                if must_poll && idle_spins > SPIN_BEFORE_BACKOFF {
                    std::thread::yield_now();
                } else if busy && self.settings.spin_relax == Relax::Yield {
                    // Busy-poll window: keep polling, but let a runnable
                    // thread of the host (a caller, a copy worker) have
                    // this CPU first.
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

    /// The machine's clock: ns since `origin`.
    fn now(&self) -> Nanos {
        self.origin.elapsed().as_nanos() as Nanos
    }

    /// Feeds `input` to the machine and performs what it asks for.
    fn feed(&mut self, input: Input) {
        let now = self.now();
        let t = tracing::enabled!(tracing::Level::TRACE).then(Instant::now);
        self.m.handle(now, input);
        if let Some(us) = t.map(|t| t.elapsed().as_micros() as u64) {
            if us >= 10 {
                tracing::trace!(us, "machine input slow");
            }
        }
        self.after_input();
    }

    /// After an input: counters to `stats` (before any action: a peer may
    /// act on a GRANT, a waiter on a resolution, before this thread runs
    /// again), then the actions.
    fn after_input(&mut self) {
        self.sync_stats();
        self.deadline_stale = true;
        self.gauges_dirty = true;
        self.perform_all();
    }

    /// Adds what the machine's counters gained since the last call to the
    /// shared `stats` (a rebuilt transport's start from its predecessor's).
    fn sync_stats(&mut self) {
        let c = self.m.counters();
        let last = &mut self.last_counters;
        let stats = &self.stats;
        macro_rules! sync {
            ($($f:ident),*) => {$(
                if c.$f != last.$f {
                    // Wrapping: a GRANT that did not leave is taken back.
                    stats.$f.fetch_add(c.$f.wrapping_sub(last.$f), Ordering::Relaxed);
                    last.$f = c.$f;
                }
            )*};
        }
        sync!(
            succeeded,
            failed,
            timeouts,
            bytes_sent,
            chunks_written,
            grants,
            chunks_scattered,
            data_rejected,
            wants_rejected,
            cancels_received,
            wants_stale,
            tombstones_evicted,
            rejects_received,
            credit_wait_us
        );
    }

    /// Performs the machine's queued actions in order. An action whose
    /// performing feeds an input (a send that failed, a write found
    /// terminal between posts) performs that input's actions first, as
    /// `Io` did inline.
    fn perform_all(&mut self) {
        let mut q = self.queues.pop().unwrap_or_default();
        while let Some(s) = self.m.poll() {
            q.push_back(s);
        }
        while let Some(step) = q.pop_front() {
            match step {
                Step::Event(e) => self.on_event(e),
                Step::Action(a) => {
                    if !matches!(a, Action::StartGather { .. }) {
                        self.flush_gathers();
                    }
                    let post = matches!(a, Action::PostWrite { .. });
                    self.perform(a);
                    // A post can take a while (the engine may copy
                    // synchronously): send DATA for writes that landed
                    // meanwhile — before posting the next, so the
                    // receiver's scatters overlap our writes, and after a
                    // lone post (the steady state: ACK, one-credit GRANT,
                    // one post), so its DATA does not wait for the rest of
                    // the loop pass.
                    if post {
                        self.poll_writes();
                    }
                }
            }
        }
        self.flush_gathers();
        self.queues.push(q);
    }

    /// Queues the held gathers for the copy workers: a lone chunk as a
    /// [`CopyPlan::Chunk`], several as one [`CopyPlan::Batch`].
    fn flush_gathers(&mut self) {
        let (Some(w), Some(first)) = (&self.workers, self.gather_batch.first()) else {
            return;
        };
        let (token, region_addr) = (first.token, first.region_addr);
        let job = if self.gather_batch.len() == 1 {
            self.gather_batch.pop().map(BatchedChunk::into_job)
        } else {
            Some(CopyJob {
                token,
                kind: CopyKind::Gather,
                region_addr,
                plan: CopyPlan::Batch(std::mem::take(&mut self.gather_batch)),
            })
        };
        if let Some(job) = job {
            w.submit(job);
        }
    }

    fn on_event(&mut self, e: Event) {
        match e {
            Event::Stage { rid, chunk, stage } => {
                if let Some(r) = self.reqs.get(&rid) {
                    let stage = match stage {
                        ChunkStage::Gathered => Stage::Gathered,
                        ChunkStage::DataSent => Stage::DataSent,
                        ChunkStage::Acked => Stage::Acked,
                    };
                    r.completion.note(stage, chunk as usize, Instant::now());
                }
            }
            Event::FlowAccepted { chunks } => {
                // DATA for this flow follows within a control round trip:
                // wake as many idle scatter workers as it can use now
                // (after the GRANT went out) rather than on the first DATA.
                if let Some(w) = &self.workers {
                    w.prime(chunks);
                }
            }
        }
    }

    fn perform(&mut self, a: Action) {
        match a {
            Action::Send { to, msg } => self.perform_send(to, msg),
            Action::StartGather {
                job,
                rid,
                chunk,
                local,
                bound,
            } => {
                let Some(r) = self.reqs.get(&rid) else {
                    // Resolved before its gather started: nothing to copy.
                    return self.feed(Input::GatherDone {
                        job,
                        result: Err("request resolved".into()),
                    });
                };
                tracing::trace!(rid, chunk, "gather");
                let gather = BatchedChunk {
                    token: job,
                    region_addr: self.arena.base + local,
                    chunk: ChunkGather {
                        descs: r.descs.clone(),
                        bound,
                        max_chunk_size_bytes: r.chunk_cap,
                        merge_runs: self.settings.merge_runs,
                        uniform_data: r.uniform_data,
                        uniform_len: r.uniform_len,
                        block_planes: r.block_planes.clone(),
                        src_planes: r.src_planes.clone(),
                    },
                };
                // Only chunks the engine submits at once are held: whole
                // descriptors (the first one's length is checked here, in
                // O(1); a chunk of mixed lengths still reaches the batch
                // and is gathered on its own there).
                let batchable = bound.first_done == 0
                    && r.descs
                        .get(bound.first_desc)
                        .is_some_and(|d| d.len > 0 && d.len <= self.batched_piece_max);
                if batchable {
                    // Gathers started together go as one job (flushed
                    // before the next other action, so nothing waits).
                    self.gather_batch.push(gather);
                    if self.gather_batch.len() >= MAX_GATHER_BATCH {
                        self.flush_gathers();
                    }
                } else if let Some(w) = &self.workers {
                    w.submit(gather.into_job());
                }
            }
            Action::PostWrite {
                write,
                peer,
                rid,
                chunk,
                local,
                bytes,
                credit,
            } => self.post_write(write, peer, rid, chunk, local, bytes, credit),
            Action::StartScatter {
                job,
                flow,
                region,
                chunk: _,
                runs,
            } => {
                if let Some(w) = &self.workers {
                    w.submit(CopyJob {
                        token: job,
                        kind: CopyKind::Scatter,
                        region_addr: self.arena.base + region,
                        plan: match runs {
                            ScatterList::Runs(runs) => CopyPlan::Runs(runs),
                            ScatterList::Uniform(u) => CopyPlan::Uniform(u),
                            ScatterList::Blocks(b) => CopyPlan::Blocks(b),
                        },
                    });
                }
                self.m.recycle(flow.peer);
            }
            Action::ReleaseStaging { .. } => {}
            Action::Resolve { rid, outcome, .. } => {
                if let Some(r) = self.reqs.remove(&rid) {
                    r.completion.resolve(match outcome {
                        Outcome::Success => TransferOutcome::Success,
                        Outcome::Failure(why) => TransferOutcome::Failure(why),
                    });
                }
            }
            Action::ForgetRoute { peer } => {
                self.channel.remove_peer(&peer);
                self.peer_kinds.remove(&peer);
                self.peer_caps.remove(&peer);
                let _ = self.engine.forget_peer(&peer);
            }
            Action::Quiesced { id } => {
                if let Some(reply) = self.quiesce.remove(&id) {
                    let _ = reply.send(());
                }
            }
            Action::ArenaInDoubt { writes } => {
                // Anything left may still read the arena: tell the arena's
                // owner not to free or reuse the memory.
                tracing::error!(
                    agent = %self.name, writes,
                    "writes still in flight at shutdown after 5 s; the arena must not be freed"
                );
                self.stats.arena_in_doubt.store(true, Ordering::SeqCst);
            }
        }
    }

    /// Whether DATA to `peer` may be DATA_UNIFORM (both agents advertise
    /// [`wire::CAP_UNIFORM_DATA`]).
    fn peer_takes_uniform(&self, peer: &str) -> bool {
        self.peer_caps
            .get(peer)
            .is_some_and(|c| c & wire::CAP_UNIFORM_DATA != 0)
    }

    /// Whether DATA to `peer` may be DATA_BLOCKS (both agents advertise
    /// [`wire::CAP_BLOCK_DATA`]).
    fn peer_takes_blocks(&self, peer: &str) -> bool {
        self.peer_caps
            .get(peer)
            .is_some_and(|c| c & wire::CAP_BLOCK_DATA != 0)
    }

    /// Sends `msg` to `to`; a WANT or DATA that does not leave goes back to
    /// the machine ([`Input::SendFailed`]), as does a GRANT (its credits
    /// were counted before it left). A cancel goes only where a route is.
    fn perform_send(&mut self, to: String, msg: Message) {
        let (cancel, want_rid) = match &msg {
            Message::Want(w) => (w.is_cancel(), Some(w.request_id)),
            _ => (false, None),
        };
        if cancel && !self.channel.has_peer(&to) {
            return self.m.recycle(to);
        }
        // A uniform scatter for a peer that does not take DATA_UNIFORM
        // (its capabilities changed after the gather was planned): the
        // same scatter as runs, one a piece.
        let msg = match msg {
            // A block scatter for a peer that no longer takes it: the
            // same pieces one destination each (or as runs, below).
            Message::DataBlocks(d) if !self.peer_takes_blocks(&to) => {
                match d.scatter.to_uniform() {
                    Some(scatter) => Message::DataUniform(wire::DataUniform {
                        request_id: d.request_id,
                        chunk_index: d.chunk_index,
                        region_handle: d.region_handle,
                        scatter,
                    }),
                    // Never for a scatter built from descriptors; the
                    // receiver refuses it like any bad DATA.
                    None => Message::DataBlocks(d),
                }
            }
            other => other,
        };
        let msg = match msg {
            Message::DataUniform(d) if !self.peer_takes_uniform(&to) => Message::Data(wire::Data {
                request_id: d.request_id,
                chunk_index: d.chunk_index,
                region_handle: d.region_handle,
                runs: d.scatter.to_runs(),
            }),
            other => other,
        };
        // One warm encode buffer (a 16,384-run DATA is 786 KB).
        let mut bytes = std::mem::take(&mut self.tx_buf);
        bytes.clear();
        // Timed only for the trace timeline.
        let t = tracing::enabled!(tracing::Level::TRACE).then(Instant::now);
        msg.encode_into(&mut bytes);
        let encoded = t.map(|t| t.elapsed());
        let sent = self.channel.send_to(&to, &bytes);
        if sent.is_ok() && self.reverse_routes.count() > 0 {
            self.reverse_routes.used(&to, Instant::now());
        }
        if sent.is_ok()
            && matches!(
                msg,
                Message::Data(_) | Message::DataUniform(_) | Message::DataBlocks(_)
            )
        {
            match msg {
                Message::DataUniform(_) => {
                    self.stats.data_uniform.fetch_add(1, Ordering::Relaxed);
                }
                Message::DataBlocks(_) => {
                    self.stats.data_blocks.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
            self.stats
                .data_wire_bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        if let (Some(t), Some(encoded)) = (t, encoded) {
            tracing::trace!(
                ty = %msg.message_type(),
                bytes = bytes.len(),
                encode_us = encoded.as_micros() as u64,
                send_us = (t.elapsed() - encoded).as_micros() as u64,
                "message out"
            );
        }
        self.tx_buf = bytes;
        match sent {
            Ok(()) => {
                if let (false, Some(rid)) = (cancel, want_rid) {
                    if let Some(r) = self.reqs.get(&rid) {
                        r.completion.note(Stage::Want, 0, Instant::now());
                    }
                }
                self.m.recycle(to);
            }
            Err(e) => {
                if matches!(e, ControlError::Dropped(_)) {
                    self.stats.control_dropped.fetch_add(1, Ordering::Relaxed);
                }
                tracing::warn!(agent = %self.name, peer = %to, error = %e, msg = ?msg.message_type(), "control send failed");
                if !cancel {
                    self.feed(Input::SendFailed { to, msg });
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn post_write(
        &mut self,
        write: u64,
        peer: String,
        rid: u64,
        chunk: u32,
        local: u64,
        bytes: u64,
        credit: wire::Credit,
    ) {
        let Some(r) = self.reqs.get(&rid) else {
            // Resolved before its write was posted: nothing reads staging.
            self.m.recycle(peer);
            return self.feed(Input::PostFailed {
                write,
                why: "request resolved".into(),
            });
        };
        tracing::trace!(rid, chunk, "post write");
        // Timed from before the post: an engine may copy inside it.
        let posted_at = Instant::now();
        let posted = self.engine.post_write(
            &peer,
            self.arena.kind,
            &[MemDesc {
                addr: self.arena.base + local,
                len: bytes,
                device_id: self.arena.device_id,
            }],
            r.remote_kind,
            &[MemDesc {
                addr: credit.addr,
                len: bytes,
                device_id: credit.device_id.max(0) as u64,
            }],
        );
        tracing::trace!(
            rid,
            chunk,
            post_us = posted_at.elapsed().as_micros() as u64,
            "write post returned"
        );
        match posted {
            Ok(handle) => {
                r.completion
                    .note(Stage::WritePosted, chunk as usize, posted_at);
                self.writes.push(WriteIo {
                    id: write,
                    handle,
                    rid,
                    chunk,
                    peer,
                    posted_at,
                });
            }
            Err(e) => {
                self.m.recycle(peer);
                self.feed(Input::PostFailed {
                    write,
                    why: format!("posting write of chunk {chunk}: {e}"),
                });
            }
        }
    }

    /// Polls every posted write; terminal ones (handle released) go to the
    /// machine. Returns how many were terminal.
    fn poll_writes(&mut self) -> usize {
        if self.writes.is_empty() {
            return 0;
        }
        let mut landed = std::mem::take(&mut self.landed);
        let mut k = 0;
        while k < self.writes.len() {
            let w = &self.writes[k];
            let live = self.reqs.contains_key(&w.rid);
            let polled = if live && self.faults.fail_writes {
                Err("injected engine failure".to_string())
            } else if self.faults.hang_writes {
                Ok(XferState::InProgress)
            } else {
                self.engine.poll(w.handle).map_err(|e| e.to_string())
            };
            match polled {
                Ok(XferState::InProgress) => k += 1,
                Ok(XferState::Success) => {
                    let w = self.writes.swap_remove(k);
                    self.engine.release(w.handle);
                    let took = w.posted_at.elapsed();
                    landed.push((w, Ok(()), took));
                }
                Err(e) => {
                    // The handle is terminal (failed): release it; the
                    // staging region is no longer read by the NIC.
                    let w = self.writes.swap_remove(k);
                    self.engine.release(w.handle);
                    landed.push((w, Err(e), Duration::ZERO));
                }
            }
        }
        let n = landed.len();
        for (w, result, took) in landed.drain(..) {
            if result.is_ok() {
                tracing::trace!(rid = w.rid, chunk = w.chunk, "write landed");
                // A live request's write feeds its peer's transport probe.
                if let Some(kind) = self.reqs.get(&w.rid).map(|r| r.remote_kind) {
                    let payload = self.m.chunk_bound(w.rid, w.chunk).map(|b| b.payload_bytes);
                    if let Some(payload) = payload {
                        self.probe_write(&w.peer, kind, payload, took);
                    }
                }
            }
            self.feed(Input::WriteDone {
                write: w.id,
                result,
            });
            self.m.recycle(w.peer);
        }
        self.landed = landed;
        n
    }

    fn drain_copies(&mut self) -> usize {
        let mut n = 0;
        while let Ok(done) = self.done_rx.try_recv() {
            n += 1;
            let result = done.result.map_err(|e| e.to_string());
            match done.kind {
                CopyKind::Gather => self.feed(Input::GatherDone {
                    job: done.token,
                    result: result.map(|()| done.scatter),
                }),
                CopyKind::Scatter => self.feed(Input::ScatterDone {
                    job: done.token,
                    result,
                }),
            }
        }
        n
    }

    /// Feeds [`Input::Tick`] once the machine's next deadline passed. The
    /// deadline is kept until it passes ([`Machine::keepable_deadline`]):
    /// the O(requests + flows) scan runs when none is kept or the kept one
    /// passed, not after every input (issue 18: 128 requests in flight).
    fn check_deadline(&mut self) {
        if self.deadline_stale && self.deadline.is_none() {
            self.deadline = self.m.keepable_deadline();
            self.deadline_stale = false;
        }
        let Some(d) = self.deadline else { return };
        if self.now() >= d {
            self.feed(Input::Tick);
            self.deadline = self.m.keepable_deadline();
            self.deadline_stale = false;
        }
    }

    /// Stores the gauges. `chunks_in_flight` costs O(requests): it is
    /// stored once the loop goes `idle`, or every [`GAUGE_PERIOD`] under
    /// load, not on every spin (issue 18: 128 requests in flight); the
    /// O(1) ones every call (drain-mode entries are counted from them).
    fn update_gauges(&mut self, idle: bool) {
        if self.gauges_dirty && (idle || self.gauges_at.elapsed() >= GAUGE_PERIOD) {
            self.gauges_dirty = false;
            self.gauges_at = Instant::now();
            self.stats
                .chunks_in_flight
                .store(self.m.chunks_in_flight() as u64, Ordering::Relaxed);
        }
        let s = self.m.scheduler();
        let cap = s.capacity();
        self.stats
            .arena_bytes_in_use
            .store(cap - s.free_bytes(), Ordering::Relaxed);
        let drain = u64::from(s.in_drain_mode());
        if self.stats.drain_mode.swap(drain, Ordering::Relaxed) < drain {
            self.stats.drain_entries.fetch_add(1, Ordering::Relaxed);
        }
        self.stats
            .recv_flows
            .store(s.flow_count() as u64, Ordering::Relaxed);
        self.stats
            .send_flows
            .store(self.m.request_count() as u64, Ordering::Relaxed);
        self.stats
            .control_hellos_refused
            .store(self.channel.refused_hellos(), Ordering::Relaxed);
        self.stats
            .control_hellos_unsigned
            .store(self.channel.unsigned_hellos(), Ordering::Relaxed);
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
                chunk_cap,
                uniform_len,
                src_planes,
                completion,
            } => {
                tracing::trace!(rid, scope, descriptors = descs.len(), chunk_cap, "submit");
                let traced = completion.timeline.is_some();
                if traced {
                    completion.note(Stage::Received, 0, Instant::now());
                }
                let remote_kind = self.peer_kinds.get(&peer).copied().unwrap_or(MemKind::Dram);
                let uniform_data = self.peer_takes_uniform(&peer);
                let block_planes = self
                    .peer_takes_blocks(&peer)
                    .then(|| Arc::new(OnceLock::new()));
                self.reqs.insert(
                    rid,
                    ReqIo {
                        completion,
                        descs: Arc::new(descs),
                        remote_kind,
                        uniform_data,
                        chunk_cap,
                        uniform_len,
                        block_planes,
                        src_planes,
                    },
                );
                let now = self.now();
                self.m.handle(
                    now,
                    Input::Submit {
                        rid,
                        peer,
                        scope,
                        chunks,
                    },
                );
                if traced {
                    self.m.set_traced(rid);
                }
                self.after_input();
            }
            Command::AddPeer {
                peer,
                endpoint,
                kind,
                capabilities,
                reply,
            } => {
                let r = self.channel.add_peer(&peer, &endpoint);
                if r.is_ok() {
                    self.reverse_routes.loaded(&peer);
                    // A (re)added peer may sit behind another transport now:
                    // probe it afresh.
                    self.drop_transport_report(&peer);
                    self.peer_kinds.insert(peer.clone(), kind);
                    self.peer_caps.insert(peer.clone(), capabilities);
                    self.feed(Input::PeerAdded { peer });
                }
                let _ = reply.send(r);
            }
            Command::ForgetPeer { peer, reply } => {
                self.reverse_routes.forgotten(&peer);
                self.forget_heard(&peer);
                self.feed(Input::PeerForgotten { peer: peer.clone() });
                self.drop_transport_report(&peer);
                let _ = reply.send(());
            }
            Command::AllowScatter { addr, len } => self.feed(Input::AllowScatter { addr, len }),
            Command::AllowScope { scope, addr, len } => {
                self.feed(Input::AllowScope { scope, addr, len })
            }
            Command::ForgetScope { scope, reply } => {
                let n = self.m.flows_in_scope(scope);
                if n > 0 {
                    tracing::info!(agent = %self.name, scope, flows = n, "destination engine detached; senders told");
                }
                self.feed(Input::ForgetScope { scope });
                let _ = reply.send(n);
            }
            Command::DisallowScatter { addr, len, reply } => {
                let id = self.next_quiesce;
                self.next_quiesce += 1;
                self.quiesce.insert(id, reply);
                self.feed(Input::DisallowScatter { id, addr, len });
            }
            Command::Quiesce { addr, len, reply } => {
                let id = self.next_quiesce;
                self.next_quiesce += 1;
                self.quiesce.insert(id, reply);
                self.feed(Input::QuiesceScatter { id, addr, len });
            }
            Command::Cancel { rid, why, reply } => {
                let known = self.m.has_request(rid);
                if known {
                    self.feed(Input::Cancel { rid, why });
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
        let s = self.m.scheduler();
        ArenaSnapshot {
            capacity: s.capacity(),
            free_bytes: s.free_bytes(),
            held_bytes: s.held_bytes(),
            local_held_bytes: s.local_held_bytes(),
            orphaned_bytes: s.orphaned_bytes(),
            flows: s.flow_count(),
            send_requests: self.m.request_count(),
            send_orphans: self.m.snapshot().send_orphans,
            conservation: s.check_conservation(),
        }
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
        if self
            .probes
            .get(peer)
            .is_some_and(|p| p.chunks >= PROBE_CHUNKS)
        {
            return;
        }
        let p = self.probes.entry(peer.to_string()).or_default();
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
        // Only peers with a route (loaded, or a capped reverse route):
        // names are not authenticated, and any could otherwise add one.
        if !self.heard_at.contains_key(peer) && !self.channel.has_peer(peer) {
            return;
        }
        self.heard_at.insert(peer.to_string(), now);
        self.reverse_routes.used(peer, now);
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        self.heard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer.to_string(), ms);
    }

    /// Drops `peer`'s last-heard time (its route is gone).
    fn forget_heard(&mut self, peer: &str) {
        self.heard_at.remove(peer);
        self.heard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(peer);
    }

    /// Adds a reverse route to `peer` at `endpoint` (its WANT's; seed §5)
    /// when [`ReverseRoutes`] admits it. At the cap the route it replaces
    /// is removed only once the new one was added (its peer had no live
    /// flow; a later WANT of it adds it again).
    fn add_reverse_route(&mut self, peer: &str, endpoint: &[u8]) -> Route {
        let now = Instant::now();
        // The busy peers are gathered only at the cap (O(flows)).
        let admission = if self.reverse_routes.at_cap() {
            let flows = self.m.flow_peers();
            self.reverse_routes
                .admission(peer, now, |p| flows.contains(p))
        } else {
            self.reverse_routes.admission(peer, now, |_| false)
        };
        if admission == Admission::Refused {
            tracing::warn!(agent = %self.name, %peer, max = MAX_REVERSE_ROUTES,
                "WANT from a peer not loaded, with the reverse routes at their cap, each with a live flow or used within a second");
            return Route::Unusable;
        }
        if let Err(e) = self.channel.add_peer(peer, endpoint) {
            tracing::warn!(agent = %self.name, %peer, error = %e, "WANT with an unusable endpoint");
            return Route::Unusable;
        }
        self.reverse_routes.commit(peer, now, &admission);
        if let Admission::Replaced(old) = admission {
            tracing::info!(agent = %self.name, %peer, replaced = %old, max = MAX_REVERSE_ROUTES,
                "reverse routes at their cap: the least recently used without a flow made room");
            self.channel.remove_peer(&old);
            self.forget_heard(&old);
            self.stats
                .reverse_routes_replaced
                .store(self.reverse_routes.replaced(), Ordering::Relaxed);
        }
        Route::Usable
    }

    fn on_message(&mut self, peer: String, bytes: &[u8]) {
        tracing::trace!(bytes = bytes.len(), "message in");
        self.note_heard(&peer);
        let t = tracing::enabled!(tracing::Level::TRACE).then(Instant::now);
        let decoded = Message::decode(bytes);
        if let Some(t) = t {
            tracing::trace!(
                decode_us = t.elapsed().as_micros() as u64,
                "message decoded"
            );
        }
        let msg = match decoded {
            Ok(Message::Handshake(_)) => {
                return tracing::warn!(agent = %self.name, %peer, "handshake on the control channel; ignored");
            }
            Ok(Message::Notice(n)) => {
                match &self.notice_sink {
                    Some(tx) => {
                        if tx.try_send((peer.clone(), n)).is_err() {
                            tracing::warn!(agent = %self.name, %peer, "notice queue full or closed; notice dropped");
                        }
                    }
                    None => {
                        tracing::debug!(agent = %self.name, %peer, "notice without a sink; dropped")
                    }
                }
                return;
            }
            Ok(msg) => msg,
            Err(e) => {
                return tracing::warn!(agent = %self.name, %peer, error = %e, "undecodable control message; dropped");
            }
        };
        let route = match &msg {
            Message::Want(w) => {
                if self.faults.ignore_wants {
                    return;
                }
                // Reverse-path bootstrap (seed §5): route to the sender's
                // endpoint.
                if self.channel.has_peer(&peer) {
                    Route::Usable
                } else {
                    self.add_reverse_route(&peer, &w.endpoint)
                }
            }
            _ => Route::Usable,
        };
        self.feed(Input::Message {
            from: peer,
            msg,
            route,
        });
    }

    fn shutdown(&mut self) {
        // Every request fails; copies and writes still complete.
        self.feed(Input::Shutdown);
        // Finish copies already queued (bounded), then join workers.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.m.snapshot().jobs > 0 && Instant::now() < deadline {
            if self.drain_copies() == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.workers.take();
        // Orphaned writes get their own bound, and at least one poll.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let _ = self.engine.progress();
            self.poll_writes();
            if self.writes.is_empty() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // Anything left may still read the arena: the machine gives the
        // writes up (the arena is marked in doubt), the handles are
        // released.
        if !self.writes.is_empty() {
            let left = std::mem::take(&mut self.writes);
            self.feed(Input::AbandonInFlight);
            for w in left {
                self.engine.release(w.handle);
            }
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
        self.update_gauges(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Routes from WANTs of peers not loaded are capped; loaded peers do
    /// not count, and forgetting or loading one frees its place.
    /// Decides and commits, as the IO thread does when the route is added.
    fn admit(
        r: &mut ReverseRoutes,
        p: &str,
        now: Instant,
        busy: impl Fn(&str) -> bool,
    ) -> Admission {
        let a = r.admission(p, now, busy);
        r.commit(p, now, &a);
        a
    }

    #[test]
    fn reverse_routes_are_capped_and_loaded_peers_do_not_count() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let idle = |_: &str| false;
        let mut r = ReverseRoutes::new(2);
        r.loaded("known");
        assert_eq!(admit(&mut r, "known", at(0), idle), Admission::Held);
        assert_eq!(r.count(), 0);
        assert_eq!(admit(&mut r, "x1", at(1), idle), Admission::Added);
        assert_eq!(admit(&mut r, "x2", at(2), idle), Admission::Added);
        assert_eq!(
            admit(&mut r, "x1", at(3), idle),
            Admission::Held,
            "one already held is admitted again"
        );
        assert_eq!(r.count(), 2);
        // Loaded after all: no longer a reverse route.
        r.loaded("x1");
        assert_eq!(r.count(), 1);
        assert_eq!(admit(&mut r, "x3", at(4), idle), Admission::Added);
        r.forgotten("x2");
        // Decided but not committed (its route could not be added):
        // nothing changes.
        assert_eq!(r.admission("x4", at(5), idle), Admission::Added);
        assert_eq!(r.count(), 1);
        assert_eq!(admit(&mut r, "x4", at(5), idle), Admission::Added);
        r.forgotten("x4");
        assert_eq!(r.count(), 1);
        // A loaded peer stays admitted whatever the count.
        assert_eq!(admit(&mut r, "x5", at(6), idle), Admission::Added);
        assert_eq!(admit(&mut r, "known", at(7), idle), Admission::Held);
        assert_eq!(r.count(), 2);
        assert_eq!(r.replaced(), 0);
    }

    #[test]
    fn reverse_routes_at_the_cap_make_room_from_the_least_recently_used_idle_one() {
        let t0 = Instant::now();
        // Seconds: a victim must have been silent REVERSE_ROUTE_MIN_IDLE.
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        let mut r = ReverseRoutes::new(3);
        for (k, p) in ["a", "b", "c"].into_iter().enumerate() {
            assert_eq!(admit(&mut r, p, at(k as u64), |_| false), Admission::Added);
        }
        // "a" was admitted first but used last: "b" is the oldest now.
        r.used("a", at(10));
        r.used("loaded-or-unknown", at(11));
        assert_eq!(
            admit(&mut r, "d", at(12), |_| false),
            Admission::Replaced("b".into())
        );
        assert_eq!(r.count(), 3);
        // Peers with a live flow are never replaced: "c" is older, but busy.
        assert_eq!(
            admit(&mut r, "e", at(13), |p| p == "c"),
            Admission::Replaced("a".into())
        );
        // A replacement decided but not committed changes nothing.
        assert_eq!(
            r.admission("g", at(14), |_| false),
            Admission::Replaced("c".into())
        );
        assert_eq!(r.count(), 3);
        // All busy: refused, nothing changes.
        assert_eq!(admit(&mut r, "f", at(14), |_| true), Admission::Refused);
        assert_eq!(r.count(), 3);
        assert_eq!(admit(&mut r, "c", at(15), |_| true), Admission::Held);
        // Heard within REVERSE_ROUTE_MIN_IDLE: not replaced yet.
        let mut q = ReverseRoutes::new(1);
        admit(&mut q, "fresh", at(100), |_| false);
        let just = at(100) + REVERSE_ROUTE_MIN_IDLE - Duration::from_millis(1);
        assert_eq!(admit(&mut q, "new", just, |_| false), Admission::Refused);
        assert_eq!(
            admit(&mut q, "new", at(100) + REVERSE_ROUTE_MIN_IDLE, |_| false),
            Admission::Replaced("fresh".into())
        );
        // Same time: the smaller name goes (deterministic).
        let mut s = ReverseRoutes::new(2);
        admit(&mut s, "q", at(0), |_| false);
        admit(&mut s, "p", at(0), |_| false);
        assert_eq!(
            admit(&mut s, "z", at(1), |_| false),
            Admission::Replaced("p".into())
        );
        assert_eq!(r.replaced() + s.replaced() + q.replaced(), 4);
        // A replaced name comes back as a new route (and makes room again).
        assert_eq!(
            admit(&mut r, "b", at(16), |_| false),
            Admission::Replaced("c".into())
        );
    }

    #[test]
    fn on_switches_are_on_unless_turned_off() {
        for (v, on) in [
            (None, true),
            (Some("1"), true),
            (Some("yes"), true),
            (Some("0"), false),
            (Some(" OFF "), false),
            (Some("False"), false),
        ] {
            assert_eq!(parse_on_switch(v), on, "{v:?}");
        }
    }

    #[test]
    fn solo_chunk_switch_parses_sizes_and_refuses_what_cannot_cut_chunks() {
        let max = 64 << 20;
        // Unset: 32 MiB under a larger max chunk, else off.
        let parse = |v, max| parse_solo_chunk(v, max, 4096);
        assert_eq!(parse(None, max), 32 << 20);
        assert_eq!(parse(None, 32 << 20), 0);
        assert_eq!(parse(None, 4 << 20), 0);
        // A granularity above the solo size: off, set or not.
        assert_eq!(parse_solo_chunk(None, max, 64 << 20), 0);
        assert_eq!(parse_solo_chunk(Some("1MiB"), max, 2 << 20), 0);
        assert_eq!(parse(Some("0"), max), 0);
        assert_eq!(parse(Some(" 32MiB "), max), 32 << 20);
        assert_eq!(parse(Some("65536"), max), 65536);
        assert_eq!(parse(Some("64MiB"), max), max);
        // Over the cap, not a multiple of 32, not a size: off.
        assert_eq!(parse(Some("128MiB"), max), 0);
        assert_eq!(parse(Some("1000"), max), 0);
        assert_eq!(parse(Some("lots"), max), 0);
    }

    #[test]
    fn a_live_count_is_given_back_once_resolved_or_dropped() {
        let count = Arc::new(AtomicUsize::new(0));
        let (a, before) = LiveCount::take(&count);
        assert_eq!(before, 0);
        let (b, before) = LiveCount::take(&count);
        assert_eq!(before, 1);
        a.release();
        a.release();
        assert_eq!(count.load(Ordering::SeqCst), 1, "released once");
        drop(a);
        assert_eq!(
            count.load(Ordering::SeqCst),
            1,
            "a released place is not given back again"
        );
        drop(b);
        assert_eq!(
            count.load(Ordering::SeqCst),
            0,
            "dropped unreleased: given back"
        );
        let c = Completion {
            live: LiveCount::take(&count).0,
            ..Completion::default()
        };
        assert_eq!(count.load(Ordering::SeqCst), 1);
        assert!(c.resolve(TransferOutcome::Success));
        assert_eq!(count.load(Ordering::SeqCst), 0, "resolved: given back");
        assert!(!c.resolve(TransferOutcome::Success));
        drop(c);
        assert_eq!(count.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_spinning_wait_sees_the_outcome_and_honours_its_timeout() {
        for (spin, relax) in [
            (Duration::ZERO, Relax::Yield),
            (Duration::from_millis(20), Relax::Yield),
            (Duration::from_millis(20), Relax::Spin),
            (Duration::from_secs(5), Relax::Yield),
            (Duration::from_secs(5), Relax::Spin),
        ] {
            // Resolved while the waiter spins (or blocks).
            let c = Arc::new(Completion::with_spin_history(spin, None, relax));
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
            let h = TransferHandle::from_completion(Arc::new(Completion::with_spin_history(
                spin, None, relax,
            )));
            let t0 = Instant::now();
            assert_eq!(h.wait(Duration::from_millis(30)), None);
            let waited = t0.elapsed();
            assert!(
                waited >= Duration::from_millis(30) && waited < Duration::from_secs(2),
                "spin {spin:?}: waited {waited:?} for a 30 ms timeout"
            );
        }
    }

    /// Issue 18: with the adaptive rule, waits that end past the spin
    /// window (here: time out at it) stop the next waits from spinning;
    /// waits that end inside it bring spinning back; polls shorter than the
    /// window count for nothing; outcomes are seen either way.
    #[test]
    fn waits_past_the_window_stop_the_spinning_and_a_short_one_restarts_it() {
        let window = Duration::from_millis(20);
        let history = Arc::new(SpinHistory::new());
        let handle = |resolved: bool| {
            let c = Arc::new(Completion::with_spin_history(
                window,
                Some(history.clone()),
                Relax::Yield,
            ));
            if resolved {
                c.resolve(TransferOutcome::Success);
            }
            TransferHandle::from_completion(c)
        };
        assert!(history.should_spin());
        // Polls shorter than the window say nothing.
        for _ in 0..20 {
            assert!(handle(false).wait(Duration::from_millis(1)).is_none());
        }
        assert!(history.should_spin(), "short polls stopped the spinning");
        for i in 1..=11 {
            // Unresolved, timing out at the window: a miss each.
            assert!(handle(false).wait(window).is_none());
            assert_eq!(history.should_spin(), i < 11, "after {i} timed-out waits");
        }
        // Not spinning now: a 30 ms wait for an outcome that never comes
        // blocks (no spin window) and still honours its timeout.
        let t0 = Instant::now();
        assert!(handle(false).wait(Duration::from_millis(30)).is_none());
        assert!(t0.elapsed() >= Duration::from_millis(30));
        // Outcomes already there: seen at once, and hits; a few restart
        // the spinning.
        for _ in 0..3 {
            assert!(matches!(
                handle(true).wait(Duration::from_secs(1)),
                Some(TransferOutcome::Success)
            ));
        }
        assert!(
            history.should_spin(),
            "waits inside the window did not restart spinning"
        );
        // A timeout past Instant's range is no deadline (no panic).
        assert!(matches!(
            handle(true).wait(Duration::MAX),
            Some(TransferOutcome::Success)
        ));
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
