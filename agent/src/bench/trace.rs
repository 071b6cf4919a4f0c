//! `kvfabric bench` — the main job: replay a production request trace as
//! prefill → decode KV hand-offs with a real model's KV geometry, through
//! bounce and through the standard per-descriptor path in the same run,
//! verifying every byte.
//!
//! Both sides keep a paged KV pool like a serving engine: a fixed number of
//! blocks; a block id addresses one `descriptor_bytes` slot in every
//! (layer, K/V) tensor; free lists start shuffled (an engine's free list is
//! fragmented after warm-up), so a request's blocks are scattered.
//! A request waits (FIFO) for free blocks on both sides, as an engine's
//! scheduler would. Latency is measured from submit (prefill done, blocks
//! held) to the transfer's resolution (the service time). Requests arrive
//! closed loop (a fixed number in flight) or open loop, by the trace's
//! timestamps or a Poisson process ([`super::arrivals`]); in open loop
//! each request's latency is also counted from its scheduled arrival
//! ([`ArrivalLatency`]), so the queueing for a worker and for blocks shows.
//!
//! The replay logic ([`replay_with`]) only allocates blocks ([`BlockPool`],
//! which addresses a pool by its base address and owns no memory) and
//! builds descriptors; a [`HandOff`] moves and verifies each request's KV.
//! Embedded mode ([`replay`]) uses [`LocalHandOff`] over two in-process
//! agents and their [`KvPool`]s; distributed mode
//! ([`super::remote`]) attaches two engines to two agent daemons through
//! their engine API and hands blocks off by id.
//!
//! A failed request is reported (log line, [`PathStats::failed_requests`],
//! the summary table) under the id the sending agent logs it under
//! ([`HandOffResult::request_id`], in the log field
//! [`HandOff::request_id_key`]: `rid` in embedded mode, the engine's
//! `request` in distributed mode), so it can be found in the agent's log;
//! requests with 0 prompt tokens move nothing and are skipped
//! ([`ReplayReport::skipped_empty_requests`]).

use std::io::IsTerminal as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvfabric_core::model::{KvLayout, TraceRecord};
use kvfabric_core::Descriptor;
use serde::Serialize;

use super::arrivals::{achieved_rate, Arrivals};
use super::pattern::{check_fast, fill_fast, permutation};
use crate::runtime::arena::HostArena;
use crate::runtime::fabric::FabricAgent;
use crate::runtime::transport::{TransferHandle, TransferOutcome};

/// Bound on one transfer.
const XFER_TIMEOUT: Duration = Duration::from_secs(300);
/// Bound on waiting for pool blocks.
const BLOCK_WAIT: Duration = Duration::from_secs(600);

/// The block allocator of a paged KV pool at some base address (local or
/// in another process — it never touches the memory): `num_blocks` block
/// ids over `tensors` (layer × K/V) regions of `num_blocks ×
/// descriptor_bytes` each, laid out from `base`.
pub struct BlockPool {
    base: u64,
    num_blocks: u32,
    desc_bytes: u64,
    state: Mutex<PoolState>,
    cv: Condvar,
}

/// A paged KV pool in one host buffer owned by this process (embedded
/// mode), with its [`BlockPool`].
pub struct KvPool {
    mem: HostArena,
    blocks: BlockPool,
}

struct PoolState {
    free: Vec<u32>,
    next_ticket: u64,
    serving: u64,
}

impl KvPool {
    /// Allocates a pool of `num_blocks` blocks for `layout` (per TP rank),
    /// its free list shuffled by `seed`.
    ///
    /// # Errors
    /// When the host allocation fails.
    pub fn new(layout: &KvLayout, num_blocks: u32, seed: u64) -> Result<Self, String> {
        let bytes = BlockPool::bytes_for(layout, num_blocks);
        let mem = HostArena::new_base_pages(bytes as usize).map_err(|e| e.to_string())?;
        let blocks = BlockPool::new(layout, num_blocks, mem.base_addr(), seed);
        Ok(Self { mem, blocks })
    }

    /// Base address and size in bytes (to register with the engine).
    pub fn region(&self) -> (u64, u64) {
        (self.mem.base_addr(), self.mem.len() as u64)
    }

    /// The block allocator over this pool's memory.
    pub fn blocks(&self) -> &BlockPool {
        &self.blocks
    }

    /// Address of block `block` of tensor `tensor`.
    pub fn addr(&self, tensor: u32, block: u32) -> u64 {
        self.blocks.addr(tensor, block)
    }

    /// Takes `n` blocks, waiting in FIFO order (bounded by 600 s).
    ///
    /// # Errors
    /// When `n` exceeds the pool or the wait times out.
    pub fn allocate(&self, n: u32) -> Result<Vec<u32>, String> {
        self.blocks.allocate(n)
    }

    /// Returns blocks to the free list.
    pub fn release(&self, blocks: Vec<u32>) {
        self.blocks.release(blocks)
    }
}

impl BlockPool {
    /// Bytes a pool of `num_blocks` blocks for `layout` spans.
    pub fn bytes_for(layout: &KvLayout, num_blocks: u32) -> u64 {
        let tensors = layout.model.layers * layout.tensors_per_layer();
        u64::from(num_blocks) * u64::from(tensors) * layout.descriptor_bytes()
    }

    /// The allocator of a pool of `num_blocks` blocks for `layout` (per TP
    /// rank) laid out from `base` (which must span
    /// [`bytes_for`](Self::bytes_for) bytes wherever it lives), its free
    /// list shuffled by `seed`.
    pub fn new(layout: &KvLayout, num_blocks: u32, base: u64, seed: u64) -> Self {
        let free = permutation(num_blocks as usize, seed)
            .into_iter()
            .map(|b| b as u32)
            .collect();
        Self {
            base,
            num_blocks,
            desc_bytes: layout.descriptor_bytes(),
            state: Mutex::new(PoolState {
                free,
                next_ticket: 0,
                serving: 0,
            }),
            cv: Condvar::new(),
        }
    }

    /// Base address of the pool.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Address of block `block` of tensor `tensor`.
    pub fn addr(&self, tensor: u32, block: u32) -> u64 {
        self.base
            + (u64::from(tensor) * u64::from(self.num_blocks) + u64::from(block)) * self.desc_bytes
    }

    /// Takes `n` blocks, waiting in FIFO order (bounded by 600 s).
    ///
    /// # Errors
    /// When `n` exceeds the pool or the wait times out.
    pub fn allocate(&self, n: u32) -> Result<Vec<u32>, String> {
        if n > self.num_blocks {
            return Err(format!(
                "request needs {n} blocks, the pool has {}",
                self.num_blocks
            ));
        }
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let ticket = s.next_ticket;
        s.next_ticket += 1;
        let deadline = Instant::now() + BLOCK_WAIT;
        while s.serving != ticket || (s.free.len() as u32) < n {
            let now = Instant::now();
            if now >= deadline {
                return Err("timed out waiting for free KV blocks".into());
            }
            s = self
                .cv
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let at = s.free.len() - n as usize;
        let blocks = s.free.split_off(at);
        s.serving += 1;
        self.cv.notify_all();
        Ok(blocks)
    }

    /// Takes `n` blocks at once if they are free and nobody is waiting
    /// for blocks (the FIFO order holds); `None` otherwise, without
    /// waiting.
    pub fn try_allocate(&self, n: u32) -> Option<Vec<u32>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.serving != s.next_ticket || (s.free.len() as u32) < n {
            return None;
        }
        let at = s.free.len() - n as usize;
        Some(s.free.split_off(at))
    }

    /// Returns blocks to the free list.
    pub fn release(&self, blocks: Vec<u32>) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.free.extend(blocks);
        self.cv.notify_all();
    }
}

/// Which path a phase uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchPath {
    /// Gather → chunked writes → scatter.
    Bounce,
    /// One NIXL descriptor per block.
    Standard,
    /// The routing gate picks per request (bounce with a compatible peer,
    /// else standard) — what serving engines ask for by default.
    Auto,
}

impl std::str::FromStr for BenchPath {
    type Err = String;

    /// `bounce`, `standard` or `auto` (surrounding spaces ignored).
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "bounce" => Ok(Self::Bounce),
            "standard" => Ok(Self::Standard),
            "auto" => Ok(Self::Auto),
            other => Err(format!("expected bounce, standard or auto, got {other:?}")),
        }
    }
}

/// Checks that `path` can run from `prefill` (bounce needs its transport).
///
/// # Errors
/// Why bounce is not running on the prefill agent.
pub fn check_prefill_path(prefill: &FabricAgent, path: BenchPath) -> Result<(), String> {
    if path == BenchPath::Bounce && prefill.transport().is_none() {
        return Err(format!(
            "bounce is not running on the prefill agent: {}",
            prefill.bounce_unavailable().unwrap_or_default()
        ));
    }
    Ok(())
}

/// Options of a replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// KV layout.
    pub layout: KvLayout,
    /// Concurrent requests (closed loop), or the most requests in flight
    /// (open loop: a request due while all workers are busy waits for
    /// one); at least 1 (0 is an error of [`replay_with`]). One worker
    /// thread each, at most one per replayed request.
    pub concurrency: usize,
    /// How requests arrive: closed loop, by the trace's timestamps / a
    /// speed factor, or a Poisson process at a rate (a speed or rate that
    /// is not finite and > 0 is an error of [`replay_with`]).
    pub arrivals: Arrivals,
    /// Blocks per pool.
    pub pool_blocks: u32,
    /// Paths in order.
    pub paths: Vec<BenchPath>,
    /// Progress bar on stderr (drawn only when stderr is a terminal).
    pub progress: bool,
    /// Requests handed off before each path's measured phase and left
    /// out of the report (`--warmup`; 0: none; at most [`MAX_WARMUP`]):
    /// the slice's requests from its first, cycled, closed loop at up to
    /// `concurrency` in flight, seeded with [`WARMUP_SEED_BIT`] set
    /// ([`is_warmup_seed`]: a [`HandOff`] that counts or traces requests
    /// leaves them out). A serving fabric is warm; a cold one pays its
    /// first transfers' setup (connections, first posts, lazily loaded
    /// kernels) in the first tens of ms of an open loop
    /// (docs/benchmarks.md, "Issue 18, twelfth session").
    pub warmup: usize,
}

/// A request of a phase that failed or did not verify.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FailedRequest {
    /// The id the sending agent logs the transfer under (the log field
    /// [`ReplayReport::request_id_key`]: `rid`, the bounce transport's id,
    /// in embedded mode; `request`, the engine's request id, in distributed
    /// mode); `None` when it has none (the standard path in embedded mode,
    /// a request that failed before its submit).
    pub request_id: Option<u64>,
    /// The request's position in the replayed slice (0-based; line
    /// `--start` + this of a trace without blank lines).
    pub index: usize,
    /// Why it failed.
    pub error: String,
}

/// Latency statistics of one path (ms). `p50_ms` … `mean_ms` are the
/// service time, submit → transfer resolution, in every arrival mode; in
/// open loop [`PathStats::from_arrival`] adds the latency from each
/// request's scheduled arrival.
#[derive(Clone, Debug, Serialize)]
pub struct PathStats {
    /// The path.
    pub path: BenchPath,
    /// Requests completed (all verified).
    pub requests: usize,
    /// Requests that failed.
    pub failures: usize,
    /// Payload bytes moved.
    pub bytes: u64,
    /// Descriptors moved.
    pub descriptors: u64,
    /// Phase wall time (s).
    pub wall_s: f64,
    /// Aggregate GB/s over the phase.
    pub gbps: f64,
    /// Median service time, submit → transfer resolution (ms).
    pub p50_ms: f64,
    /// 90th percentile (ms).
    pub p90_ms: f64,
    /// 99th percentile (ms).
    pub p99_ms: f64,
    /// Maximum (ms).
    pub max_ms: f64,
    /// Mean (ms).
    pub mean_ms: f64,
    /// Requests completed (verified) per second of the phase's wall time
    /// (req/s).
    pub requests_per_s: f64,
    /// Open loop only (`None` in closed loop): latency from the requests'
    /// scheduled arrivals, queueing included.
    pub from_arrival: Option<ArrivalLatency>,
    /// Open loop, prompts of different lengths only: the same latency of
    /// the smallest quarter of the completed requests by prompt tokens (by
    /// rank; ties in completion order), the tail a grant policy that
    /// favours large or old requests would hurt. `None` in closed loop,
    /// with fewer than 4 completed requests or all prompts equal.
    pub from_arrival_small: Option<ArrivalLatency>,
    /// The requests that failed, in completion order.
    pub failed_requests: Vec<FailedRequest>,
}

/// Open-loop latency of one path's completed requests (ms), counted from
/// each request's scheduled arrival: the wait for a free worker (all
/// `concurrency` busy) and for free KV blocks, plus the service time
/// (submit → transfer resolution). A worker free before the arrival
/// prepares the request's blocks and descriptors in the last
/// [`PREPARE_LEAD`] before it (a prefill engine's block table exists
/// before it asks for the hand-off); a late worker's preparation, and a
/// preparation that outlasts the lead, count in the queueing. The bench's own fill of
/// the source blocks (standing in for prefill) and the verification after
/// the transfer are in neither, as in closed loop.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ArrivalLatency {
    /// Median latency from the scheduled arrival (ms).
    pub p50_ms: f64,
    /// 90th percentile (ms).
    pub p90_ms: f64,
    /// 99th percentile (ms).
    pub p99_ms: f64,
    /// Maximum (ms).
    pub max_ms: f64,
    /// Mean (ms).
    pub mean_ms: f64,
    /// Median queueing delay, scheduled arrival → submit (ms).
    pub queue_p50_ms: f64,
    /// 99th percentile queueing delay (ms).
    pub queue_p99_ms: f64,
    /// Largest queueing delay (ms).
    pub queue_max_ms: f64,
    /// Median lateness of the worker, scheduled arrival → a worker took
    /// the request (ms; 0 when one was free before the arrival). The rest
    /// of the queueing delay is the wait for free KV blocks, a
    /// preparation that ran past the arrival, and the wake-up of a worker
    /// that slept until it.
    pub late_p50_ms: f64,
    /// 99th percentile lateness of the worker (ms).
    pub late_p99_ms: f64,
    /// The run cut by scheduled arrival into [`ARRIVAL_WINDOW_MS`]
    /// windows, in time order (all requests only; empty for the smallest
    /// quarter): whether the tail came from a few stretches of the run —
    /// a stall and the backlog it left — or from everywhere.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub windows: Vec<ArrivalWindow>,
}

/// Most warm-up requests (`--warmup`): 10,000,000, as `--requests`.
pub const MAX_WARMUP: usize = 10_000_000;

/// Set in the seed of every warm-up request (below it: the request's
/// position in the warm-up; above it: the path, as for measured requests,
/// whose seeds never have it: a slice's index stays below 2^39).
pub const WARMUP_SEED_BIT: u64 = 1 << 39;

/// Whether `seed` ([`HandOff::hand_off`]'s) is a warm-up request's.
pub fn is_warmup_seed(seed: u64) -> bool {
    seed & WARMUP_SEED_BIT != 0
}

/// Width of an [`ArrivalWindow`], ms of scheduled arrivals.
pub const ARRIVAL_WINDOW_MS: f64 = 50.0;

/// Open loop: a free worker builds its next request (takes its blocks,
/// builds its descriptors) at most this long before the request's
/// scheduled arrival: 2 ms, so that the workers do not all build at once
/// when a run starts (issue 18, thirteenth session). A building that
/// takes longer (the seed's shape: 36,900 descriptors, 885 KB in all;
/// not timed separately) delays the hand-off past the arrival, and that
/// delay counts in the latency from arrival, as a late worker's does.
pub const PREPARE_LEAD: Duration = Duration::from_millis(2);

/// The requests of one open-loop run scheduled to arrive in one
/// [`ARRIVAL_WINDOW_MS`] window.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ArrivalWindow {
    /// Window start, ms after the run's start.
    pub start_ms: f64,
    /// Completed requests scheduled in the window.
    pub requests: usize,
    /// Their median latency from arrival (ms).
    pub p50_ms: f64,
    /// Their largest latency from arrival (ms).
    pub max_ms: f64,
    /// Completed requests of the whole run scheduled to arrive before the
    /// window's end and resolved after it (scheduled arrival + queueing +
    /// service time as the hand-off measured it): the backlog the window
    /// leaves behind.
    pub backlog_at_end: usize,
}

impl ArrivalWindow {
    /// The windows of `samples` (any order), from the first arrival's
    /// window to the last's; windows without arrivals are left out.
    /// O(n log n) in the samples.
    pub fn of(samples: &[ArrivalSample]) -> Vec<ArrivalWindow> {
        // A request resolves at or after its arrival, so the backlog at t
        // is (arrived before t) − (resolved before t).
        let sorted = |f: fn(&ArrivalSample) -> f64| {
            let mut v: Vec<f64> = samples.iter().map(f).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            v
        };
        let arrived = sorted(|s| s.arrival_ms);
        let resolved = sorted(|s| s.arrival_ms + s.queue_ms + s.service_ms);
        let before = |v: &[f64], t: f64| v.partition_point(|&x| x < t);
        let mut by_window: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
        for s in samples {
            let w = (s.arrival_ms.max(0.0) / ARRIVAL_WINDOW_MS) as u64;
            by_window
                .entry(w)
                .or_default()
                .push(s.queue_ms + s.service_ms);
        }
        by_window
            .into_iter()
            .map(|(w, mut lat)| {
                lat.sort_by(|a, b| a.total_cmp(b));
                let end = (w + 1) as f64 * ARRIVAL_WINDOW_MS;
                ArrivalWindow {
                    start_ms: w as f64 * ARRIVAL_WINDOW_MS,
                    requests: lat.len(),
                    p50_ms: percentile(&lat, 50.0),
                    max_ms: lat.last().copied().unwrap_or(0.0),
                    backlog_at_end: before(&arrived, end) - before(&resolved, end),
                }
            })
            .collect()
    }
}

/// One completed open-loop request's times, ms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ArrivalSample {
    /// Scheduled arrival, ms after the run's start.
    pub arrival_ms: f64,
    /// Scheduled arrival → a worker took it (0 if before the arrival).
    pub late_ms: f64,
    /// Scheduled arrival → submit (`late_ms`, plus a late request's
    /// preparation and any wait for free blocks).
    pub queue_ms: f64,
    /// Submit → transfer resolution.
    pub service_ms: f64,
    /// The request's prompt (tokens).
    pub prompt_tokens: u64,
}

impl ArrivalLatency {
    /// The statistics of `samples`, one per completed request; `None`
    /// when there are none.
    pub fn of(samples: &[ArrivalSample]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        let sorted = |f: fn(&ArrivalSample) -> f64| {
            let mut v: Vec<f64> = samples.iter().map(f).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            v
        };
        let lat = sorted(|s| s.queue_ms + s.service_ms);
        let queue = sorted(|s| s.queue_ms);
        let late = sorted(|s| s.late_ms);
        Some(Self {
            p50_ms: percentile(&lat, 50.0),
            p90_ms: percentile(&lat, 90.0),
            p99_ms: percentile(&lat, 99.0),
            max_ms: lat.last().copied().unwrap_or(0.0),
            mean_ms: lat.iter().sum::<f64>() / lat.len() as f64,
            queue_p50_ms: percentile(&queue, 50.0),
            queue_p99_ms: percentile(&queue, 99.0),
            queue_max_ms: queue.last().copied().unwrap_or(0.0),
            late_p50_ms: percentile(&late, 50.0),
            late_p99_ms: percentile(&late, 99.0),
            windows: Vec::new(),
        })
    }

    /// [`ArrivalLatency::of`] with its [`ArrivalWindow`]s.
    pub fn with_windows(samples: &[ArrivalSample]) -> Option<Self> {
        Self::of(samples).map(|a| Self {
            windows: ArrivalWindow::of(samples),
            ..a
        })
    }

    /// The statistics of the smallest quarter of `samples` by
    /// [`ArrivalSample::prompt_tokens`] (⌈n/4⌉ requests by rank, ties in
    /// the order given); `None` with fewer than 4 samples or when every
    /// prompt has the same length (the quarter would be arbitrary).
    pub fn of_smallest_quarter(samples: &[ArrivalSample]) -> Option<Self> {
        let lo = samples.iter().map(|s| s.prompt_tokens).min()?;
        let hi = samples.iter().map(|s| s.prompt_tokens).max()?;
        if samples.len() < 4 || lo == hi {
            return None;
        }
        let mut by_size: Vec<&ArrivalSample> = samples.iter().collect();
        by_size.sort_by_key(|s| s.prompt_tokens);
        let quarter: Vec<ArrivalSample> = by_size[..samples.len().div_ceil(4)]
            .iter()
            .map(|&&s| s)
            .collect();
        Self::of(&quarter)
    }
}

/// The replay report.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    /// Model.
    pub model: String,
    /// Block tokens.
    pub block_tokens: u32,
    /// TP.
    pub tp: u32,
    /// K/V split.
    pub kv_split: bool,
    /// Descriptor bytes.
    pub descriptor_bytes: u64,
    /// Requests replayed per path (those of the slice with at least one
    /// prompt token).
    pub requests: usize,
    /// Requests of the slice with 0 prompt tokens: nothing to move, not
    /// replayed.
    pub skipped_empty_requests: usize,
    /// Concurrency (closed loop) or the most requests in flight (open
    /// loop).
    pub concurrency: usize,
    /// How requests arrived: `{"mode": "closed"}`, `{"mode": "trace",
    /// "speed": F}` or `{"mode": "poisson", "rate_per_s": R, "seed": S}`.
    pub arrivals: Arrivals,
    /// Open loop: the arrival rate the schedule achieved (req/s, the same
    /// for every path): (n − 1) / (last − first scheduled arrival); `None`
    /// in closed loop, or with fewer than two requests or all at once.
    pub arrival_rate_per_s: Option<f64>,
    /// Every request this many prompt tokens (`--fixed-prompt`: a
    /// synthetic workload, no trace); `None` for a trace. Set by the
    /// binaries, not by [`replay_with`].
    pub fixed_prompt_tokens: Option<u64>,
    /// Pool blocks per side.
    pub pool_blocks: u32,
    /// Warm-up requests handed off before each path's measured phase
    /// (`--warmup`; not in any number of the report).
    pub warmup: usize,
    /// Per-path statistics.
    pub paths: Vec<PathStats>,
    /// p99(bounce) / p99(standard), when both ran and completed requests.
    pub p99_ratio_bounce_over_standard: Option<f64>,
    /// p50(bounce) / p50(standard), when both ran and completed requests.
    pub p50_ratio_bounce_over_standard: Option<f64>,
    /// Peak resident set size of this process (bytes, VmHWM).
    pub peak_rss_bytes: u64,
    /// The sending agent's log field that carries
    /// [`FailedRequest::request_id`]: `rid` (embedded mode) or `request`
    /// (distributed mode: the engine's request id, beside `engine`).
    pub request_id_key: &'static str,
}

/// The three windows of `a` with the slowest requests, as one table
/// line; `None` without windows.
fn slowest_windows(a: &ArrivalLatency) -> Option<String> {
    if a.windows.is_empty() {
        return None;
    }
    let mut w: Vec<&ArrivalWindow> = a.windows.iter().collect();
    w.sort_by(|x, y| y.max_ms.total_cmp(&x.max_ms));
    let parts: Vec<String> = w
        .iter()
        .take(3)
        .map(|w| {
            format!(
                "{:.0}-{:.0} ms: {} request{}, p50 {:.1} max {:.1} ms, backlog {}",
                w.start_ms,
                w.start_ms + ARRIVAL_WINDOW_MS,
                w.requests,
                if w.requests == 1 { "" } else { "s" },
                w.p50_ms,
                w.max_ms,
                w.backlog_at_end
            )
        })
        .collect();
    Some(format!(
        "slowest {:.0} ms windows of arrivals: {}",
        ARRIVAL_WINDOW_MS,
        parts.join("; ")
    ))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Peak RSS of this process in bytes (Linux `VmHWM`), 0 if unknown.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// What one [`HandOff::hand_off`] gives back.
#[derive(Clone, Debug, PartialEq)]
pub struct HandOffResult {
    /// The id the sending agent logs the transfer under (its log field
    /// [`HandOff::request_id_key`]): the bounce transport's request id
    /// (`rid`), or the engine's request id (`request`). `None` where there
    /// is none (the standard path in embedded mode, a request rejected
    /// before its submit).
    pub request_id: Option<u64>,
    /// The transfer latency in ms (submit → resolution), or why the
    /// request failed or did not verify.
    pub outcome: Result<f64, String>,
}

impl HandOffResult {
    /// A request that failed before the agent gave it an id.
    pub fn failed(why: impl Into<String>) -> Self {
        Self {
            request_id: None,
            outcome: Err(why.into()),
        }
    }
}

/// The request id a [`TransferHandle`] carries, as the agent logs it: the
/// bounce transport numbers its requests from 1; 0 marks a handle no
/// bounce transport issued (the standard path's).
pub fn logged_request_id(handle: &TransferHandle) -> Option<u64> {
    (handle.request_id != 0).then_some(handle.request_id)
}

/// The paged blocks one request holds on each side: `src[i]` (prefill
/// pool) goes to `dst[i]` (decode pool), every layer and K/V tensor.
#[derive(Clone, Copy, Debug)]
pub struct RequestBlocks<'a> {
    /// Block ids in the prefill pool.
    pub src: &'a [u32],
    /// Block ids in the decode pool (as many).
    pub dst: &'a [u32],
}

/// Moves one request's KV from the prefill side to the decode side and
/// verifies it: the seam between the replay logic and where the agents
/// run.
pub trait HandOff: Sync {
    /// Checks that `path` can run at all (before its phase starts).
    ///
    /// # Errors
    /// Why not (e.g. bounce is not running on the prefill agent).
    fn check_path(&self, path: BenchPath) -> Result<(), String>;

    /// Who sends, as the sending agent's log lines name it: its `agent`
    /// name (embedded mode) or the sending `engine` (distributed mode).
    fn sender(&self) -> String;

    /// The sending agent's log field that carries
    /// [`HandOffResult::request_id`]: `rid` (the bounce transport's id, the
    /// default) or `request` (an engine's request id, logged beside
    /// `engine`).
    fn request_id_key(&self) -> &'static str {
        "rid"
    }

    /// Fills each source `k` of `descs` with [`fill_fast`]`(seed, k)`,
    /// writes `descs` (src on the prefill side, dst on the decode side;
    /// they are `blocks.src` → `blocks.dst`, every layer and K/V tensor,
    /// tensor-major) through `path`, waits for the outcome and verifies
    /// every destination byte. The result carries the transfer latency in
    /// ms, submit → resolution, or the failure: a failed or timed-out
    /// transfer, or a verification mismatch (named); and the agent's id of
    /// the request.
    fn hand_off(
        &self,
        path: BenchPath,
        seed: u64,
        blocks: RequestBlocks<'_>,
        descs: Vec<Descriptor>,
    ) -> HandOffResult;
}

/// [`HandOff`] between two agents in this process (embedded mode).
pub struct LocalHandOff<'a> {
    /// The sending agent.
    pub prefill: &'a FabricAgent,
    /// The receiving agent (loaded as a peer by `prefill`).
    pub decode: &'a FabricAgent,
}

impl HandOff for LocalHandOff<'_> {
    fn check_path(&self, path: BenchPath) -> Result<(), String> {
        check_prefill_path(self.prefill, path)
    }

    fn sender(&self) -> String {
        self.prefill.name().to_string()
    }

    fn hand_off(
        &self,
        path: BenchPath,
        seed: u64,
        _blocks: RequestBlocks<'_>,
        descs: Vec<Descriptor>,
    ) -> HandOffResult {
        // "Prefill": write this request's KV with its own pattern.
        for (k, d) in descs.iter().enumerate() {
            // SAFETY: src lies in the prefill pool's blocks the caller holds.
            unsafe { fill_fast(d.src, d.len, seed, k as u64) };
        }
        let decode_name = self.decode.name();
        let t0 = Instant::now();
        let handle: TransferHandle = match path {
            BenchPath::Bounce => match self.prefill.transport() {
                Some(t) => t.submit(decode_name, descs.clone()),
                None => return HandOffResult::failed("bounce is not running on the prefill agent"),
            },
            BenchPath::Standard => self.prefill.submit_standard(decode_name, descs.clone()),
            BenchPath::Auto => self.prefill.submit_write(decode_name, descs.clone()).1,
        };
        let request_id = logged_request_id(&handle);
        let outcome = handle.wait(XFER_TIMEOUT);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let outcome = match outcome {
            Some(TransferOutcome::Success) => descs
                .iter()
                .enumerate()
                // SAFETY: dst lies in the decode pool's blocks the caller holds.
                .find_map(|(k, d)| {
                    unsafe { check_fast(d.dst, d.len, seed, k as u64) }
                        .err()
                        .map(|off| (k, off))
                })
                .map_or(Ok(ms), |(k, off)| {
                    Err(format!("verification failed: descriptor {k}, byte {off}"))
                }),
            Some(TransferOutcome::Failure(why)) => Err(format!("transfer failed: {why}")),
            None => Err(format!(
                "transfer not resolved within {} s",
                XFER_TIMEOUT.as_secs()
            )),
        };
        HandOffResult {
            request_id,
            outcome,
        }
    }
}

/// Replays `trace` from `prefill` to `decode` over `prefill_pool` /
/// `decode_pool` (registered with their agents), once per path (embedded
/// mode: [`replay_with`] over a [`LocalHandOff`]).
///
/// # Errors
/// Setup failures (a request larger than the pool, no bounce transport).
/// Transfer failures and verification mismatches are counted per path and
/// make the caller's exit status non-zero.
pub fn replay(
    prefill: &FabricAgent,
    decode: &FabricAgent,
    prefill_pool: &KvPool,
    decode_pool: &KvPool,
    trace: &[TraceRecord],
    opts: &ReplayOptions,
) -> Result<ReplayReport, String> {
    replay_with(
        &LocalHandOff { prefill, decode },
        prefill_pool.blocks(),
        decode_pool.blocks(),
        trace,
        opts,
    )
}

/// Replays `trace` through `hand_off` with blocks allocated from
/// `prefill_pool` / `decode_pool` (pools of `opts.pool_blocks` blocks,
/// wherever their memory lives), once per path. Requests with 0 prompt
/// tokens are skipped (counted in the report).
///
/// # Errors
/// Setup failures: invalid options (`concurrency` 0, a speed or rate that
/// is not finite and positive, no path, `warmup` above [`MAX_WARMUP`]), a
/// failed warm-up request (no report: the paths measured before it are
/// lost too), a slice without a request that has prompt tokens, a request larger than the pool ([`check_pool`]), a path
/// that cannot run, no worker thread could start. Transfer failures and
/// verification mismatches are counted per path (and listed in
/// [`PathStats::failed_requests`]) and make the caller's exit status
/// non-zero.
pub fn replay_with(
    hand_off: &dyn HandOff,
    prefill_pool: &BlockPool,
    decode_pool: &BlockPool,
    trace: &[TraceRecord],
    opts: &ReplayOptions,
) -> Result<ReplayReport, String> {
    let layout = &opts.layout;
    if opts.concurrency == 0 {
        return Err("concurrency: expected at least 1 request in flight, got 0".into());
    }
    opts.arrivals.check()?;
    if opts.paths.is_empty() {
        return Err("paths: expected at least one of bounce, standard".into());
    }
    let demand = SliceDemand::of(layout, trace, opts.concurrency);
    if demand.requests == 0 {
        return Err(format!(
            "none of the {} requests of the slice has prompt tokens: nothing to move",
            trace.len()
        ));
    }
    check_pool(layout, &demand, opts.pool_blocks)?;
    // (index in the slice, record) of the requests that move something.
    let mut replayed: Vec<(usize, &TraceRecord)> = trace
        .iter()
        .enumerate()
        .filter(|(_, r)| layout.blocks_for(r.input_length) > 0)
        .collect();
    // Open loop: each request's scheduled arrival (s from the phase's
    // start, the same for every path), the requests in arrival order
    // (stable: a trace's equal timestamps keep their order).
    let schedule = opts
        .arrivals
        .schedule(&replayed.iter().map(|&(_, r)| r).collect::<Vec<_>>());
    let schedule = schedule.map(|due| {
        let mut order: Vec<usize> = (0..replayed.len()).collect();
        order.sort_by(|&a, &b| due[a].total_cmp(&due[b]));
        replayed = order.iter().map(|&k| replayed[k]).collect();
        order.iter().map(|&k| due[k]).collect::<Vec<f64>>()
    });
    let requests: Vec<Request<'_>> = replayed
        .iter()
        .enumerate()
        .map(|(k, &(index, record))| Request {
            index,
            record,
            arrival_s: schedule.as_ref().map(|s| s[k]),
        })
        .collect();
    let mut stats = Vec::new();
    for (pi, &path) in opts.paths.iter().enumerate() {
        hand_off.check_path(path)?;
        warm_up(
            hand_off,
            prefill_pool,
            decode_pool,
            &requests,
            opts,
            path,
            (pi as u64 + 1) << 40 | WARMUP_SEED_BIT,
        )?;
        stats.push(run_phase(
            hand_off,
            prefill_pool,
            decode_pool,
            &requests,
            opts,
            path,
            (pi as u64 + 1) << 40,
        )?);
    }
    let find = |p: BenchPath| stats.iter().find(|s| s.path == p);
    let ratio =
        |f: fn(&PathStats) -> f64| match (find(BenchPath::Bounce), find(BenchPath::Standard)) {
            (Some(b), Some(s)) if b.requests > 0 && s.requests > 0 && f(s) > 0.0 => {
                Some(f(b) / f(s))
            }
            _ => None,
        };
    Ok(ReplayReport {
        model: layout.model.name.clone(),
        block_tokens: layout.block_tokens,
        tp: layout.tp,
        kv_split: layout.kv_split,
        descriptor_bytes: layout.descriptor_bytes(),
        requests: replayed.len(),
        skipped_empty_requests: trace.len() - replayed.len(),
        concurrency: opts.concurrency,
        arrivals: opts.arrivals,
        arrival_rate_per_s: schedule.as_deref().and_then(achieved_rate),
        fixed_prompt_tokens: None,
        pool_blocks: opts.pool_blocks,
        warmup: opts.warmup,
        p99_ratio_bounce_over_standard: ratio(|s| s.p99_ms),
        p50_ratio_bounce_over_standard: ratio(|s| s.p50_ms),
        paths: stats,
        peak_rss_bytes: peak_rss_bytes(),
        request_id_key: hand_off.request_id_key(),
    })
}

/// Checks a `--speed` factor: finite and > 0.
///
/// # Errors
/// Names the flag and the value otherwise.
pub fn check_speed(speed: f64) -> Result<(), String> {
    Arrivals::Trace { speed }.check()
}

/// What a slice of a trace asks of the KV pools, in blocks of a layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceDemand {
    /// Requests with at least one prompt token (the others are skipped).
    pub requests: usize,
    /// The largest request: its index in the slice and its blocks.
    pub largest: Option<(usize, u64)>,
    /// Blocks the `concurrency` largest requests hold together: no set of
    /// requests in flight at once holds more, so a pool of this many
    /// blocks never makes a request wait (saturates at `u64::MAX`).
    pub in_flight_blocks: u64,
}

/// Cap on the embedded bench's default KV pool per side: 1 GiB (bytes).
/// A slice whose largest request is larger gets a pool of that request's
/// size instead (rounded up to [`POOL_ROUND_BYTES`]).
pub const DEFAULT_POOL_CAP_BYTES: u64 = 1 << 30;

/// Default KV pool sizes are rounded up to a multiple of this: 64 MiB
/// (bytes).
pub const POOL_ROUND_BYTES: u64 = 64 << 20;

impl SliceDemand {
    /// The demand of `trace` replayed with at most `concurrency` requests
    /// in flight (0 counts as 1).
    pub fn of(layout: &KvLayout, trace: &[TraceRecord], concurrency: usize) -> Self {
        let mut blocks: Vec<(usize, u64)> = trace
            .iter()
            .enumerate()
            .map(|(i, r)| (i, layout.blocks_for(r.input_length)))
            .filter(|&(_, b)| b > 0)
            .collect();
        let requests = blocks.len();
        // Largest first; the earliest of equal ones.
        blocks.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let in_flight_blocks = blocks
            .iter()
            .take(concurrency.max(1))
            .fold(0u64, |acc, &(_, b)| acc.saturating_add(b));
        Self {
            requests,
            largest: blocks.first().copied(),
            in_flight_blocks,
        }
    }

    /// The default KV pool per side for this slice, bytes: what the
    /// requests in flight hold at once ([`Self::in_flight_blocks`]),
    /// capped at `cap_bytes` but never below the largest request, rounded
    /// up to a multiple of [`POOL_ROUND_BYTES`] (at least one block;
    /// saturates at `u64::MAX`).
    pub fn default_pool_bytes(&self, layout: &KvLayout, cap_bytes: u64) -> u64 {
        let per_block = layout.bytes_per_block();
        let in_flight = self.in_flight_blocks.saturating_mul(per_block);
        let largest = self.largest.map_or(0, |(_, b)| b.saturating_mul(per_block));
        let bytes = in_flight.min(cap_bytes).max(largest).max(per_block);
        bytes
            .checked_next_multiple_of(POOL_ROUND_BYTES)
            .unwrap_or(u64::MAX)
    }
}

/// Blocks of `layout` a pool of `pool_bytes` holds (rounded down; capped
/// at `u32::MAX`, the block ids' range).
pub fn pool_blocks_for(layout: &KvLayout, pool_bytes: u64) -> u32 {
    u32::try_from(pool_bytes / layout.bytes_per_block()).unwrap_or(u32::MAX)
}

/// Checks that a pool of `pool_blocks` blocks per side holds the slice's
/// largest request.
///
/// # Errors
/// Names the request, the blocks and bytes it needs and the pool's, and
/// `--pool` (the flag that sizes it).
pub fn check_pool(layout: &KvLayout, demand: &SliceDemand, pool_blocks: u32) -> Result<(), String> {
    let per_block = layout.bytes_per_block();
    match demand.largest {
        Some((i, b)) if b > u64::from(pool_blocks) => Err(format!(
            "--pool: request {i} of the slice needs {b} KV blocks ({}) per side, the pool holds {pool_blocks} blocks ({}); pass --pool {}MiB or more",
            human_bytes(b.saturating_mul(per_block)),
            human_bytes(u64::from(pool_blocks) * per_block),
            b.saturating_mul(per_block).div_ceil(1 << 20)
        )),
        _ => Ok(()),
    }
}

/// `bytes` for people: `512 B`, `3.5 KiB`, `64 MiB`, `2.66 GiB` (binary
/// units; up to three significant digits, whole numbers without decimals).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else if v < 10.0 {
        format!("{v:.2} {}", UNITS[u])
    } else if v < 100.0 {
        format!("{v:.1} {}", UNITS[u])
    } else {
        format!("{v:.0} {}", UNITS[u])
    }
}

/// One request of a phase, in arrival order.
#[derive(Clone, Copy)]
struct Request<'a> {
    /// Its position in the replayed slice (as reported).
    index: usize,
    /// The record.
    record: &'a TraceRecord,
    /// Open loop: its scheduled arrival, s from the phase's start.
    arrival_s: Option<f64>,
}

/// Most failed requests the summary table lists (the report has all).
const TABLE_FAILURES: usize = 10;

/// Hands off `opts.warmup` requests through `path` before its measured
/// phase: `requests` from the first, cycled, each at its position in the
/// warm-up (`seed_base` + position: no two in flight share a seed); closed
/// loop, at most `opts.concurrency` in flight.
///
/// # Errors
/// `--warmup` above [`MAX_WARMUP`]; a warm-up request that failed (the
/// first failure, with how many): the measured phase would start on a
/// broken path.
fn warm_up(
    hand_off: &dyn HandOff,
    ppool: &BlockPool,
    dpool: &BlockPool,
    requests: &[Request<'_>],
    opts: &ReplayOptions,
    path: BenchPath,
    seed_base: u64,
) -> Result<(), String> {
    if opts.warmup == 0 || requests.is_empty() {
        return Ok(());
    }
    if opts.warmup > MAX_WARMUP {
        return Err(format!(
            "--warmup: expected at most {MAX_WARMUP} requests, got {}",
            opts.warmup
        ));
    }
    let warm: Vec<Request<'_>> = requests
        .iter()
        .cycle()
        .take(opts.warmup)
        .enumerate()
        .map(|(k, r)| Request {
            index: k,
            arrival_s: None,
            ..*r
        })
        .collect();
    eprintln!(
        "warm-up: {} requests through the {} path (not reported)",
        opts.warmup,
        format!("{path:?}").to_lowercase()
    );
    let closed = ReplayOptions {
        concurrency: opts.concurrency.min(opts.warmup),
        arrivals: Arrivals::Closed,
        progress: false,
        ..opts.clone()
    };
    let stats = run_phase(hand_off, ppool, dpool, &warm, &closed, path, seed_base)?;
    if let Some(f) = stats.failed_requests.first() {
        return Err(format!(
            "--warmup: {} of {} warm-up requests failed on the {path:?} path; the first: {}",
            stats.failed_requests.len(),
            opts.warmup,
            f.error
        ));
    }
    Ok(())
}

fn run_phase(
    hand_off: &dyn HandOff,
    ppool: &BlockPool,
    dpool: &BlockPool,
    trace: &[Request<'_>],
    opts: &ReplayOptions,
    path: BenchPath,
    seed_base: u64,
) -> Result<PathStats, String> {
    let layout = &opts.layout;
    let tensors = layout.model.layers * layout.tensors_per_layer();
    let desc_bytes = layout.descriptor_bytes();
    let sender = hand_off.sender();
    let engine_ids = hand_off.request_id_key() == "request";
    let next = AtomicUsize::new(0);
    let bytes = AtomicU64::new(0);
    let descs_total = AtomicU64::new(0);
    let latencies = Mutex::new(Vec::with_capacity(trace.len()));
    // Open loop: the times of each completed request.
    let open_loop = Mutex::new(Vec::new());
    let failed = Mutex::new(Vec::new());
    let fail = |index: usize, request_id: Option<u64>, error: String| {
        // The agent logs the request as `rid` (with its `agent` name), or
        // an engine's as `request` (with its `engine` id); the same fields
        // here find it there.
        if engine_ids {
            tracing::error!(
                path = ?path,
                engine = %sender,
                request = request_id,
                index,
                error = %error,
                "request failed"
            );
        } else {
            tracing::error!(
                path = ?path,
                agent = %sender,
                rid = request_id,
                request = index,
                error = %error,
                "request failed"
            );
        }
        failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(FailedRequest {
                request_id,
                index,
                error,
            });
    };
    let bar = if opts.progress && std::io::stderr().is_terminal() {
        let b = indicatif::ProgressBar::new(trace.len() as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{prefix:>9} [{bar:30}] {pos}/{len} requests {elapsed} {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b.set_prefix(format!("{path:?}").to_lowercase());
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let workers = opts.concurrency.clamp(1, trace.len().max(1));
    let start = Instant::now();
    let started = std::thread::scope(|scope| {
        let worker = || loop {
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some(&Request {
                index: i,
                record: rec,
                arrival_s: arrival,
            }) = trace.get(k)
            else {
                break;
            };
            // Open loop: the worker took the request this late (0 when it
            // was idle before the arrival).
            let late_ms = arrival.map(|at| (start.elapsed().as_secs_f64() - at).max(0.0) * 1e3);
            let nblocks = u32::try_from(layout.blocks_for(rec.input_length)).unwrap_or(u32::MAX);
            // Open loop: the request's blocks and descriptors are ready
            // before its scheduled arrival when a worker is free and the
            // blocks are free now (as a prefill engine's block table is
            // before it asks for the hand-off); then it waits for the
            // arrival. Blocks that are not free now are waited for after
            // the arrival, in the pools' FIFO order, as before. A request
            // due while every worker was busy starts late, its preparation
            // included (the lateness is its queueing).
            // A due time past Duration's range is "never": the wait is as
            // long as the user asked for.
            let due = arrival.map(|at| Duration::try_from_secs_f64(at).unwrap_or(Duration::MAX));
            let wait_for_arrival = || {
                if let Some(due) = due {
                    let now = start.elapsed();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                }
            };
            // Not earlier than PREPARE_LEAD before the arrival: at the
            // start every worker is free, and all of them building their
            // first request at once (the seed's shape: 36,900 descriptors,
            // 885 KB in all) was part of a start with ≈ 20 runnable
            // threads for the H200 host's 16 CPUs.
            if let Some(due) = due {
                let now = start.elapsed();
                if due > now + PREPARE_LEAD {
                    std::thread::sleep(due - PREPARE_LEAD - now);
                }
            }
            let early = due.is_some_and(|d| d > start.elapsed());
            let ready = if early {
                match (ppool.try_allocate(nblocks), dpool.try_allocate(nblocks)) {
                    (Some(p), Some(d)) => Some((p, d)),
                    (p, d) => {
                        p.into_iter().for_each(|b| ppool.release(b));
                        d.into_iter().for_each(|b| dpool.release(b));
                        wait_for_arrival();
                        None
                    }
                }
            } else {
                None
            };
            let allocated = match ready {
                Some((p, d)) => (Ok(p), Ok(d)),
                None => (ppool.allocate(nblocks), dpool.allocate(nblocks)),
            };
            let (pb, db) = match allocated {
                (Ok(p), Ok(d)) => (p, d),
                (p, d) => {
                    let why = [&p, &d]
                        .into_iter()
                        .find_map(|r| r.as_ref().err().cloned())
                        .unwrap_or_default();
                    if let Ok(p) = p {
                        ppool.release(p);
                    }
                    if let Ok(d) = d {
                        dpool.release(d);
                    }
                    fail(i, None, format!("KV block allocation failed: {why}"));
                    bar.inc(1);
                    continue;
                }
            };
            let seed = seed_base + i as u64;
            let mut descs = Vec::with_capacity(nblocks as usize * tensors as usize);
            for t in 0..tensors {
                for (b, &p) in pb.iter().enumerate() {
                    descs.push(Descriptor::new(
                        ppool.addr(t, p),
                        dpool.addr(t, db[b]),
                        desc_bytes,
                    ));
                }
            }
            let n = descs.len() as u64;
            let blocks = RequestBlocks { src: &pb, dst: &db };
            wait_for_arrival();
            // Scheduled arrival → hand-off (waits for a worker and for
            // blocks), open loop only: closed loop stays as it was.
            let queue_ms = arrival.map(|at| (start.elapsed().as_secs_f64() - at).max(0.0) * 1e3);
            let result = hand_off.hand_off(path, seed, blocks, descs);
            ppool.release(pb);
            dpool.release(db);
            match result.outcome {
                Ok(ms) => {
                    latencies.lock().unwrap_or_else(|p| p.into_inner()).push(ms);
                    if let (Some(q), Some(l)) = (queue_ms, late_ms) {
                        open_loop
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(ArrivalSample {
                                arrival_ms: arrival.unwrap_or(0.0) * 1e3,
                                late_ms: l,
                                queue_ms: q,
                                service_ms: ms,
                                prompt_tokens: rec.input_length,
                            });
                    }
                    bytes.fetch_add(n * desc_bytes, Ordering::Relaxed);
                    descs_total.fetch_add(n, Ordering::Relaxed);
                }
                Err(e) => fail(i, result.request_id, e),
            }
            bar.inc(1);
            let gb = bytes.load(Ordering::Relaxed) as f64 / 1e9;
            bar.set_message(format!(
                "{:.1} GB, {:.2} GB/s",
                gb,
                gb / start.elapsed().as_secs_f64().max(1e-9)
            ));
        };
        let mut started = 0usize;
        for w in 0..workers {
            match std::thread::Builder::new()
                .name(format!("replay-{w}"))
                .spawn_scoped(scope, worker)
            {
                Ok(_) => started += 1,
                Err(e) => {
                    // Fewer workers than asked: the replay still runs, at
                    // a lower concurrency (reported).
                    tracing::warn!(error = %e, started, wanted = workers, "cannot start another replay worker");
                    break;
                }
            }
        }
        started
    });
    bar.finish();
    if started == 0 {
        return Err("could not start a replay worker thread".into());
    }
    if started < workers {
        eprintln!(
            "warning: {path:?} phase ran with {started} of {workers} worker threads (the others could not start)"
        );
    }
    let wall = start.elapsed().as_secs_f64();
    let mut l = latencies.into_inner().unwrap_or_else(|p| p.into_inner());
    l.sort_by(|a, b| a.total_cmp(b));
    let total = bytes.load(Ordering::Relaxed);
    let failed_requests = failed.into_inner().unwrap_or_else(|p| p.into_inner());
    let samples = open_loop.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok(PathStats {
        path,
        requests: l.len(),
        failures: failed_requests.len(),
        bytes: total,
        descriptors: descs_total.load(Ordering::Relaxed),
        wall_s: wall,
        gbps: total as f64 / wall / 1e9,
        p50_ms: percentile(&l, 50.0),
        p90_ms: percentile(&l, 90.0),
        p99_ms: percentile(&l, 99.0),
        max_ms: l.last().copied().unwrap_or(0.0),
        mean_ms: if l.is_empty() {
            0.0
        } else {
            l.iter().sum::<f64>() / l.len() as f64
        },
        requests_per_s: l.len() as f64 / wall,
        from_arrival: ArrivalLatency::with_windows(&samples),
        from_arrival_small: ArrivalLatency::of_smallest_quarter(&samples),
        failed_requests,
    })
}

impl ReplayReport {
    /// A plain-text summary table.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{} TP{} block {} {} ({} B descriptors), {} requests{}, {}, {}, pool {} blocks\n",
            self.model,
            self.tp,
            self.block_tokens,
            if self.kv_split { "K/V split" } else { "K+V" },
            self.descriptor_bytes,
            self.requests,
            self.fixed_prompt_tokens
                .map_or(String::new(), |t| format!(" of {t} tokens")),
            self.arrivals.describe(),
            if self.arrivals.is_open_loop() {
                format!("at most {} in flight", self.concurrency)
            } else {
                format!("concurrency {}", self.concurrency)
            },
            self.pool_blocks
        );
        if let Some(r) = self.arrival_rate_per_s {
            s += &format!("arrival rate achieved by the schedule: {r:.2} req/s\n");
        }
        if self.warmup > 0 {
            s += &format!(
                "after {} warm-up requests per path (not counted below)\n",
                self.warmup
            );
        }
        let open = self.arrivals.is_open_loop();
        s += &format!(
            "{:>9} {:>5} {:>5} {:>9} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9}\n",
            "path", "ok", "fail", "GB", "GB/s", "req/s", "p50 ms", "p90 ms", "p99 ms", "max ms"
        );
        for p in &self.paths {
            s += &format!(
                "{:>9} {:>5} {:>5} {:>9.2} {:>7.2} {:>7.2} {:>9.1} {:>9.1} {:>9.1} {:>9.1}\n",
                format!("{:?}", p.path).to_lowercase(),
                p.requests,
                p.failures,
                p.bytes as f64 / 1e9,
                p.gbps,
                p.requests_per_s,
                p.p50_ms,
                p.p90_ms,
                p.p99_ms,
                p.max_ms
            );
        }
        if open {
            s += "(p50..max above: service time, submit -> done; below: from the scheduled arrival, queueing included)\n";
            s += &format!(
                "{:>9} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12} {:>12}\n",
                "path",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "max ms",
                "queue p50",
                "queue p99",
                "late p50/99"
            );
            // Path, p50 / p90 / p99 / max from arrival, queue p50 / p99 (ms).
            let row = |name: &str, a: &ArrivalLatency| {
                format!(
                    "{:>9} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>12.1} {:>12.1}",
                    name, a.p50_ms, a.p90_ms, a.p99_ms, a.max_ms, a.queue_p50_ms, a.queue_p99_ms
                )
            };
            for p in &self.paths {
                let name = format!("{:?}", p.path).to_lowercase();
                match &p.from_arrival {
                    Some(a) => {
                        s += &format!(
                            "{} {:>5.2}/{:<6.2}\n",
                            row(&name, a),
                            a.late_p50_ms,
                            a.late_p99_ms
                        );
                    }
                    None => s += &format!("{name:>9} (no completed request)\n"),
                }
            }
            for p in &self.paths {
                if let Some(line) = p.from_arrival.as_ref().and_then(slowest_windows) {
                    s += &format!("{:>9} {line}\n", format!("{:?}", p.path).to_lowercase());
                }
            }
            for p in &self.paths {
                if let Some(a) = &p.from_arrival_small {
                    let name = format!("{:?}", p.path).to_lowercase();
                    s += &format!("{}  (the smallest quarter of prompts)\n", row(&name, a));
                }
            }
        }
        for p in &self.paths {
            for f in p.failed_requests.iter().take(TABLE_FAILURES) {
                s += &format!(
                    "{:>9} request {} (#{} of the slice) failed: {}\n",
                    format!("{:?}", p.path).to_lowercase(),
                    match (f.request_id, self.request_id_key) {
                        (None, _) => "without an agent id".to_string(),
                        (Some(r), "rid") => format!("rid {r}"),
                        (Some(r), _) => r.to_string(),
                    },
                    f.index,
                    f.error
                );
            }
            if p.failed_requests.len() > TABLE_FAILURES {
                s += &format!(
                    "{:>9} ... {} more failed requests in the JSON report\n",
                    "",
                    p.failed_requests.len() - TABLE_FAILURES
                );
            }
        }
        if self.skipped_empty_requests > 0 {
            s += &format!(
                "skipped {} requests with 0 prompt tokens (nothing to move)\n",
                self.skipped_empty_requests
            );
        }
        if let (Some(r99), Some(r50)) = (
            self.p99_ratio_bounce_over_standard,
            self.p50_ratio_bounce_over_standard,
        ) {
            s += &format!(
                "bounce / standard: p50 {}x, p99 {}x (lower is better)\n",
                ratio(r50),
                ratio(r99)
            );
        }
        s += &format!(
            "peak RSS {:.1} MiB\n",
            self.peak_rss_bytes as f64 / 1048576.0
        );
        s
    }

    /// Total failures over all paths.
    pub fn failures(&self) -> usize {
        self.paths.iter().map(|p| p.failures).sum()
    }
}

/// Shared handle type for the CLI.
pub type SharedPool = Arc<KvPool>;

/// A ratio for the summary: two decimals, or three significant digits
/// below 0.1 (GPU runs give p99 ratios like 0.0038, which "0.00" hides).
fn ratio(r: f64) -> String {
    if r != 0.0 && r.abs() < 0.1 {
        let mut decimals = (2.0 - r.abs().log10().floor()) as usize;
        // Rounding up to the next power of ten (0.09999 → 0.1000) would
        // show a fourth digit.
        if (r.abs() * 10f64.powi(decimals as i32)).round() >= 1000.0 {
            decimals -= 1;
        }
        format!("{r:.decimals$}")
    } else {
        format!("{r:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_keep_three_significant_digits_below_a_tenth() {
        assert_eq!(ratio(0.79), "0.79");
        assert_eq!(ratio(1.5), "1.50");
        assert_eq!(ratio(0.0038), "0.00380");
        assert_eq!(ratio(0.0561), "0.0561");
        assert_eq!(ratio(0.0), "0.00");
        assert_eq!(ratio(0.09999), "0.100");
        assert_eq!(ratio(0.009999), "0.0100");
    }

    #[test]
    fn bench_paths_parse_by_name() {
        assert_eq!(" bounce".parse::<BenchPath>(), Ok(BenchPath::Bounce));
        assert_eq!("standard".parse::<BenchPath>(), Ok(BenchPath::Standard));
        assert_eq!("auto ".parse::<BenchPath>(), Ok(BenchPath::Auto));
        let e = "both".parse::<BenchPath>().unwrap_err();
        assert!(
            e.contains("bounce, standard or auto") && e.contains("\"both\""),
            "{e}"
        );
    }

    fn llama8b() -> KvLayout {
        KvLayout::new(
            kvfabric_core::model::preset("Llama-3.1-8B").unwrap(),
            16,
            4,
            true,
        )
        .unwrap()
    }

    fn rec(tokens: u64) -> TraceRecord {
        TraceRecord {
            timestamp: 0,
            input_length: tokens,
            output_length: 1,
            hash_ids: Vec::new(),
        }
    }

    /// A hand-off that moves nothing: requests whose seed (index, or
    /// warm-up position) is in `fail` fail with an agent id of 100 +
    /// index; the rest succeed. `seen` records the indices, `seeds` the
    /// whole seeds, in the order given.
    #[derive(Default)]
    struct FakeHandOff {
        fail: Vec<u64>,
        seen: Mutex<Vec<u64>>,
        seeds: Mutex<Vec<u64>>,
    }

    impl HandOff for FakeHandOff {
        fn check_path(&self, _: BenchPath) -> Result<(), String> {
            Ok(())
        }
        fn sender(&self) -> String {
            "fake-prefill".into()
        }
        fn hand_off(
            &self,
            _: BenchPath,
            seed: u64,
            blocks: RequestBlocks<'_>,
            descs: Vec<Descriptor>,
        ) -> HandOffResult {
            let i = seed & 0xff_ffff;
            assert_eq!(blocks.src.len(), blocks.dst.len());
            assert_eq!(descs.len() % blocks.src.len(), 0);
            self.seen.lock().unwrap().push(i);
            self.seeds.lock().unwrap().push(seed);
            assert!(!descs.is_empty());
            HandOffResult {
                request_id: Some(100 + i),
                outcome: if self.fail.contains(&i) {
                    Err("transfer failed: injected".into())
                } else {
                    Ok(1.0 + i as f64)
                },
            }
        }
    }

    /// A prefill and a decode pool of 64 blocks (at 1 GiB and 2 GiB of
    /// a pretend address space), ids 1 and 2.
    fn pools(layout: &KvLayout) -> (BlockPool, BlockPool) {
        (
            BlockPool::new(layout, 64, 1 << 30, 1),
            BlockPool::new(layout, 64, 2 << 30, 2),
        )
    }

    fn opts(layout: &KvLayout, pool_blocks: u32) -> ReplayOptions {
        ReplayOptions {
            layout: layout.clone(),
            concurrency: 3,
            arrivals: Arrivals::Closed,
            pool_blocks,
            paths: vec![BenchPath::Bounce, BenchPath::Standard],
            progress: false,
            warmup: 0,
        }
    }

    #[test]
    fn warmup_requests_run_before_each_phase_with_their_own_seeds() {
        let layout = llama8b();
        let trace = [rec(100), rec(33)];
        let (p, d) = pools(&layout);
        let o = ReplayOptions {
            warmup: 5,
            arrivals: Arrivals::Poisson {
                rate_per_s: 1000.0,
                seed: 1,
            },
            ..opts(&layout, 64)
        };
        let h = FakeHandOff::default();
        let r = replay_with(&h, &p, &d, &trace, &o).unwrap();
        let seeds = h.seeds.into_inner().unwrap();
        assert_eq!(seeds.len(), 2 * (5 + 2));
        for (pi, phase) in seeds.chunks(7).enumerate() {
            let base = (pi as u64 + 1) << 40;
            // The warm-up first, all five before any measured request,
            // each at its own position (no two in flight share a seed).
            let mut warm: Vec<u64> = phase[..5].to_vec();
            warm.sort_unstable();
            let want: Vec<u64> = (0..5).map(|k| base | WARMUP_SEED_BIT | k).collect();
            assert_eq!(warm, want, "path {pi}: {phase:?}");
            let mut measured: Vec<u64> = phase[5..].to_vec();
            measured.sort_unstable();
            assert_eq!(measured, [base, base + 1], "path {pi}: {phase:?}");
            assert!(measured.iter().all(|&s| !is_warmup_seed(s)));
        }
        assert_eq!(r.warmup, 5);
        for p in &r.paths {
            assert_eq!((p.requests, p.failures), (2, 0));
            assert_eq!(p.from_arrival.as_ref().unwrap().windows[0].requests, 2);
        }
        let t = r.table();
        assert!(t.contains("after 5 warm-up requests per path"), "{t}");
        // A failed warm-up request ends the replay, naming the flag, before
        // any measured request.
        let h = FakeHandOff {
            fail: vec![3],
            ..Default::default()
        };
        let e = replay_with(&h, &p, &d, &trace, &o).unwrap_err();
        assert!(
            e.starts_with("--warmup: 1 of 5 warm-up requests failed"),
            "{e}"
        );
        assert!(h
            .seeds
            .into_inner()
            .unwrap()
            .iter()
            .all(|&s| is_warmup_seed(s)));
        let too_many = ReplayOptions {
            warmup: MAX_WARMUP + 1,
            ..o.clone()
        };
        let e = replay_with(&FakeHandOff::default(), &p, &d, &trace, &too_many).unwrap_err();
        assert!(e.starts_with("--warmup: expected at most"), "{e}");
    }

    #[test]
    fn failed_requests_carry_the_agents_request_id_and_empty_ones_are_skipped() {
        let layout = llama8b();
        let trace = [rec(100), rec(0), rec(33), rec(16), rec(0)];
        let (p, d) = pools(&layout);
        let h = FakeHandOff {
            fail: vec![2],
            ..Default::default()
        };
        let r = replay_with(&h, &p, &d, &trace, &opts(&layout, 64)).unwrap();
        let mut seen = h.seen.into_inner().unwrap();
        seen.sort_unstable();
        assert_eq!(
            seen,
            [0, 0, 2, 2, 3, 3],
            "0-token requests are not handed off"
        );
        assert_eq!((r.requests, r.skipped_empty_requests), (3, 2));
        for p in &r.paths {
            assert_eq!((p.requests, p.failures), (2, 1));
            assert_eq!(
                p.failed_requests,
                [FailedRequest {
                    request_id: Some(102),
                    index: 2,
                    error: "transfer failed: injected".into()
                }]
            );
        }
        let t = r.table();
        assert!(
            t.contains("request rid 102 (#2 of the slice) failed"),
            "{t}"
        );
        assert!(t.contains("skipped 2 requests with 0 prompt tokens"), "{t}");
        // Distributed mode names the engine's request id, without "rid".
        let engine = ReplayReport {
            request_id_key: "request",
            ..r.clone()
        };
        let t = engine.table();
        assert!(t.contains("request 102 (#2 of the slice) failed"), "{t}");
        assert_eq!(r.failures(), 2);
    }

    #[test]
    fn bad_options_and_small_pools_are_errors_naming_the_flag() {
        let layout = llama8b();
        let trace = [rec(100), rec(1000)];
        let p = BlockPool::new(&layout, 8, 0, 1);
        let d = BlockPool::new(&layout, 8, 1 << 30, 2);
        let h = FakeHandOff {
            fail: vec![],
            ..Default::default()
        };
        let run = |o: &ReplayOptions, t: &[TraceRecord]| replay_with(&h, &p, &d, t, o);
        let e = run(&opts(&layout, 8), &trace).unwrap_err();
        assert!(
            e.starts_with("--pool:") && !e.contains("--pool-blocks"),
            "{e}"
        );
        assert!(
            e.contains("request 1 ") && e.contains("63 KV blocks"),
            "{e}"
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let o = ReplayOptions {
                arrivals: Arrivals::Trace { speed: bad },
                ..opts(&layout, 8)
            };
            let e = run(&o, &trace[..1]).unwrap_err();
            assert!(e.starts_with("--speed"), "{e}");
            let o = ReplayOptions {
                arrivals: Arrivals::Poisson {
                    rate_per_s: bad,
                    seed: 1,
                },
                ..opts(&layout, 8)
            };
            let e = run(&o, &trace[..1]).unwrap_err();
            assert!(e.starts_with("--rate"), "{e}");
        }
        let o = ReplayOptions {
            concurrency: 0,
            ..opts(&layout, 8)
        };
        assert!(run(&o, &trace[..1]).unwrap_err().contains("concurrency"));
        let e = run(&opts(&layout, 8), &[rec(0)]).unwrap_err();
        assert!(e.contains("prompt tokens"), "{e}");
        // A tiny positive speed waits "forever" for a late request, never
        // panics: only the due time of timestamp 0 is reached here.
        let o = ReplayOptions {
            arrivals: Arrivals::Trace {
                speed: f64::MIN_POSITIVE,
            },
            ..opts(&layout, 8)
        };
        assert!(run(&o, &trace[..1]).is_ok());
        // The same for a tiny Poisson rate: the first request arrives at 0.
        let o = ReplayOptions {
            arrivals: Arrivals::Poisson {
                rate_per_s: f64::MIN_POSITIVE,
                seed: 1,
            },
            ..opts(&layout, 8)
        };
        assert!(run(&o, &trace[..1]).is_ok());
    }

    /// A hand-off that takes `ms` milliseconds (a sleep: never shorter)
    /// and reports the time it took as the service time.
    struct SlowHandOff {
        ms: u64,
    }

    impl HandOff for SlowHandOff {
        fn check_path(&self, _: BenchPath) -> Result<(), String> {
            Ok(())
        }
        fn sender(&self) -> String {
            "slow-prefill".into()
        }
        fn hand_off(
            &self,
            _: BenchPath,
            _: u64,
            _: RequestBlocks<'_>,
            _: Vec<Descriptor>,
        ) -> HandOffResult {
            let t0 = Instant::now();
            std::thread::sleep(Duration::from_millis(self.ms));
            HandOffResult {
                request_id: None,
                outcome: Ok(t0.elapsed().as_secs_f64() * 1e3),
            }
        }
    }

    #[test]
    fn a_free_worker_prepares_the_request_before_its_arrival() {
        // 12 requests at 40/s into 8 workers that take 1 ms each: every
        // worker is free before its request arrives, so the median one is
        // not late at all and its blocks are taken before the arrival.
        let layout = llama8b();
        let trace: Vec<TraceRecord> = (0..12).map(|_| rec(16)).collect();
        let (p, d) = pools(&layout);
        let o = ReplayOptions {
            concurrency: 8,
            arrivals: Arrivals::Poisson {
                rate_per_s: 40.0,
                seed: 9,
            },
            paths: vec![BenchPath::Bounce],
            ..opts(&layout, 64)
        };
        let r = replay_with(&SlowHandOff { ms: 1 }, &p, &d, &trace, &o).unwrap();
        let ps = &r.paths[0];
        assert_eq!((ps.requests, ps.failures), (12, 0));
        let a = ps.from_arrival.as_ref().unwrap();
        // (The first arrivals may come before the workers start.)
        assert_eq!(a.late_p50_ms, 0.0, "{a:?}");
        // Every block is back in both pools.
        assert_eq!(p.try_allocate(64).map(|b| b.len()), Some(64));
        assert_eq!(d.try_allocate(64).map(|b| b.len()), Some(64));
    }

    #[test]
    fn a_request_is_prepared_no_earlier_than_its_lead_before_arrival() {
        // Two requests, at 0 and 300 ms, two workers: the second worker is
        // free from the start but takes its request's blocks only
        // PREPARE_LEAD before 300 ms, so at 150 ms every block is free.
        let layout = llama8b();
        let mut late = rec(16);
        late.timestamp = 300;
        let trace = vec![rec(16), late];
        let (p, d) = pools(&layout);
        let o = ReplayOptions {
            concurrency: 2,
            arrivals: Arrivals::Trace { speed: 1.0 },
            paths: vec![BenchPath::Bounce],
            ..opts(&layout, 64)
        };
        let free_at_150ms = std::thread::scope(|s| {
            let probe = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(150));
                let got = p.try_allocate(64);
                let all = got.as_ref().map(|b| b.len());
                if let Some(b) = got {
                    p.release(b);
                }
                all
            });
            let r = replay_with(&SlowHandOff { ms: 1 }, &p, &d, &trace, &o).unwrap();
            assert_eq!((r.paths[0].requests, r.paths[0].failures), (2, 0));
            probe.join().unwrap()
        });
        assert_eq!(
            free_at_150ms,
            Some(64),
            "blocks taken long before the arrival"
        );
    }

    #[test]
    fn try_allocate_takes_free_blocks_and_never_jumps_the_queue() {
        let layout = llama8b();
        let p = BlockPool::new(&layout, 8, 1 << 30, 1);
        let a = p.try_allocate(6).expect("6 of 8 free");
        assert!(p.try_allocate(3).is_none(), "only 2 left");
        assert!(p.try_allocate(9).is_none(), "more than the pool");
        std::thread::scope(|s| {
            // A waiter for 4 blocks holds the head of the line: a request
            // for the 2 free ones must not take them first.
            let waiter = s.spawn(|| p.allocate(4));
            let t0 = Instant::now();
            while p.state.lock().unwrap().next_ticket == 0 {
                assert!(t0.elapsed() < Duration::from_secs(5));
                std::thread::yield_now();
            }
            assert!(p.try_allocate(2).is_none(), "jumped the FIFO line");
            p.release(a);
            assert_eq!(waiter.join().unwrap().unwrap().len(), 4);
        });
        assert_eq!(p.try_allocate(4).map(|b| b.len()), Some(4));
    }

    #[test]
    fn open_loop_latency_counts_the_queueing_from_the_scheduled_arrival() {
        // 20 requests arriving at 1000/s (all within ≈ 20 ms) into one
        // worker that takes ≥ 20 ms each: request k cannot finish before
        // (k + 1) × 20 ms, so its latency from arrival grows along the run
        // while its service time stays one hand-off. Only lower bounds on
        // time (a sleep is never shorter) and ratios that a loaded machine
        // only widens.
        let layout = llama8b();
        let trace: Vec<TraceRecord> = (0..20).map(|_| rec(16)).collect();
        let p = BlockPool::new(&layout, 8, 1 << 30, 1);
        let d = BlockPool::new(&layout, 8, 2 << 30, 2);
        let arrivals = Arrivals::Poisson {
            rate_per_s: 1000.0,
            seed: 5,
        };
        let o = ReplayOptions {
            concurrency: 1,
            arrivals,
            paths: vec![BenchPath::Bounce],
            ..opts(&layout, 8)
        };
        let r = replay_with(&SlowHandOff { ms: 20 }, &p, &d, &trace, &o).unwrap();
        assert_eq!(r.arrivals, arrivals);
        let rate = r.arrival_rate_per_s.unwrap();
        assert!((200.0..5000.0).contains(&rate), "{rate}");
        let ps = &r.paths[0];
        assert_eq!((ps.requests, ps.failures), (20, 0));
        assert!(ps.p50_ms >= 20.0, "service {}", ps.p50_ms);
        let a = ps.from_arrival.as_ref().unwrap();
        // The last request waited for the 19 before it.
        let span_ms = 1e3 * poisson_span(20, 1000.0, 5);
        assert!(a.max_ms >= 400.0 - span_ms, "{a:?}");
        assert!(a.queue_max_ms >= 380.0 - span_ms, "{a:?}");
        // The median request queued behind ≈ 10 others.
        assert!(
            a.p50_ms >= 5.0 * ps.p50_ms,
            "{a:?} vs service {}",
            ps.p50_ms
        );
        assert!(a.p99_ms >= a.p50_ms && a.max_ms >= a.p99_ms);
        assert!(a.p50_ms >= a.queue_p50_ms);
        // The queueing here is the busy worker's lateness (plus a
        // preparation of a few descriptors).
        assert!(a.late_p99_ms >= 0.9 * a.queue_p99_ms, "{a:?}");
        let t = r.table();
        assert!(
            t.contains("Poisson 1000 req/s (seed 5), at most 1 in flight"),
            "{t}"
        );
        assert!(t.contains("from the scheduled arrival"), "{t}");
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["arrivals"]["mode"], "poisson");
        assert!(j["paths"][0]["from_arrival"]["p99_ms"].as_f64().unwrap() > 0.0);

        // Closed loop: no arrival times, no latency from arrival.
        let o = ReplayOptions {
            concurrency: 2,
            arrivals: Arrivals::Closed,
            ..o
        };
        let r = replay_with(&SlowHandOff { ms: 1 }, &p, &d, &trace[..4], &o).unwrap();
        assert_eq!(
            (r.arrival_rate_per_s, &r.paths[0].from_arrival),
            (None, &None)
        );
        assert!(r.paths[0].requests_per_s > 0.0);
        assert!(!r.table().contains("scheduled arrival"));
    }

    fn poisson_span(n: usize, rate: f64, seed: u64) -> f64 {
        *crate::bench::arrivals::poisson_schedule(n, rate, seed)
            .last()
            .unwrap()
    }

    #[test]
    fn default_pool_covers_the_requests_in_flight_capped_but_never_below_the_largest() {
        let layout = llama8b(); // 512 KiB per block
        let mib = 1u64 << 20;
        // 10 requests of 100 blocks (50 MiB), concurrency 4: 200 MiB in
        // flight, rounded up to 256 MiB.
        let trace: Vec<TraceRecord> = (0..10).map(|_| rec(1600)).collect();
        let d = SliceDemand::of(&layout, &trace, 4);
        assert_eq!(d.in_flight_blocks, 400);
        assert_eq!(d.default_pool_bytes(&layout, 1 << 30), 256 * mib);
        // Capped at 128 MiB.
        assert_eq!(d.default_pool_bytes(&layout, 128 * mib), 128 * mib);
        // One request of 3000 blocks (1500 MiB) beats the cap.
        let mut big = trace.clone();
        big[7] = rec(48_000);
        let d = SliceDemand::of(&layout, &big, 4);
        assert_eq!(d.largest, Some((7, 3000)));
        assert_eq!(d.default_pool_bytes(&layout, 1 << 30), 1536 * mib);
        assert!(check_pool(&layout, &d, pool_blocks_for(&layout, 1536 * mib)).is_ok());
        // Empty slices still get one block's worth (rounded).
        let d = SliceDemand::of(&layout, &[rec(0)], 4);
        assert_eq!((d.requests, d.largest), (0, None));
        assert_eq!(d.default_pool_bytes(&layout, 1 << 30), 64 * mib);
    }

    #[test]
    fn arrival_windows_show_where_the_tail_came_from() {
        let at = |arrival_ms, service_ms| ArrivalSample {
            arrival_ms,
            late_ms: 0.0,
            queue_ms: 0.0,
            service_ms,
            prompt_tokens: 8192,
        };
        // Window 0-50: two quick requests; 50-100: a stall (one request
        // resolved at 130 ms, one at 101); 100-150 none; 150-200: one.
        let v = [
            at(60.0, 70.0),
            at(1.0, 2.0),
            at(160.0, 1.0),
            at(10.0, 3.0),
            at(70.0, 31.0),
        ];
        let w = ArrivalWindow::of(&v);
        let starts: Vec<f64> = w.iter().map(|w| w.start_ms).collect();
        assert_eq!(starts, [0.0, 50.0, 150.0]);
        assert_eq!(
            (w[0].requests, w[0].max_ms, w[0].backlog_at_end),
            (2, 3.0, 0)
        );
        // Both arrived before 100 and resolve at 101 and 130.
        assert_eq!(
            (w[1].requests, w[1].max_ms, w[1].backlog_at_end),
            (2, 70.0, 2)
        );
        assert_eq!((w[2].requests, w[2].backlog_at_end), (1, 0));
        let a = ArrivalLatency::with_windows(&v).unwrap();
        assert_eq!(a.windows, w);
        let line = slowest_windows(&a).unwrap();
        assert!(
            line.contains("50-100 ms: 2 requests, p50 70.0 max 70.0 ms, backlog 2"),
            "{line}"
        );
    }

    #[test]
    fn smallest_quarter_of_arrivals_is_by_prompt_rank() {
        let at = |prompt_tokens, service_ms| ArrivalSample {
            arrival_ms: 0.0,
            late_ms: 0.0,
            queue_ms: 0.5,
            service_ms,
            prompt_tokens,
        };
        // The two smallest of eight prompts (100 and 200 tokens) took 1
        // and 2 ms (+ 0.5 queueing); the rest 14-19 ms.
        let v = [
            at(900, 19.0),
            at(100, 1.0),
            at(800, 18.0),
            at(200, 2.0),
            at(700, 17.0),
            at(600, 16.0),
            at(500, 15.0),
            at(400, 14.0),
        ];
        let q = ArrivalLatency::of_smallest_quarter(&v).unwrap();
        assert_eq!((q.max_ms, q.mean_ms), (2.5, 2.0));
        assert_eq!(ArrivalLatency::of(&v).unwrap().max_ms, 19.5);
        // Nine requests: the quarter rounds up to three.
        let mut nine = v.to_vec();
        nine.push(at(300, 3.0));
        let q = ArrivalLatency::of_smallest_quarter(&nine).unwrap();
        assert_eq!((q.max_ms, q.mean_ms), (3.5, 2.5));
        // Equal prompts or fewer than four requests: no quarter.
        let same: Vec<ArrivalSample> = (0..8).map(|i| at(8192, i as f64)).collect();
        assert!(ArrivalLatency::of_smallest_quarter(&same).is_none());
        assert!(ArrivalLatency::of_smallest_quarter(&v[..3]).is_none());
        assert!(ArrivalLatency::of_smallest_quarter(&[]).is_none());
    }

    #[test]
    fn human_bytes_reads_well() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(64 << 20), "64 MiB");
        assert_eq!(human_bytes(2_856_321_024), "2.66 GiB");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
        assert_eq!(human_bytes(u64::MAX), "16 EiB");
    }

    proptest::proptest! {
        /// For any slice, the default pool holds its largest request, never
        /// exceeds max(cap, largest) by more than the rounding, and the
        /// pool check accepts it.
        #[test]
        fn default_pool_always_fits_the_slice(
            tokens in proptest::collection::vec(
                proptest::prop_oneof![0u64..100_000, proptest::num::u64::ANY], 0..50),
            concurrency in 0usize..200,
            cap in proptest::prop_oneof![0u64..(8 << 30), proptest::num::u64::ANY],
        ) {
            let layout = llama8b();
            let trace: Vec<TraceRecord> = tokens.iter().map(|&t| rec(t)).collect();
            let d = SliceDemand::of(&layout, &trace, concurrency);
            let bytes = d.default_pool_bytes(&layout, cap);
            let per_block = layout.bytes_per_block();
            let largest = d.largest.map_or(0, |(_, b)| b.saturating_mul(per_block));
            proptest::prop_assert!(bytes >= largest.min(u64::MAX - POOL_ROUND_BYTES));
            proptest::prop_assert!(bytes >= per_block);
            let bound = cap.max(largest).max(per_block);
            proptest::prop_assert!(bytes <= bound.saturating_add(POOL_ROUND_BYTES));
            let blocks = pool_blocks_for(&layout, bytes);
            if d.largest.is_some_and(|(_, b)| b <= u64::from(u32::MAX)) {
                proptest::prop_assert!(check_pool(&layout, &d, blocks).is_ok());
            }
        }
    }
}
