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
//! held) to the transfer's resolution.
//!
//! The replay logic ([`replay_with`]) only allocates blocks ([`BlockPool`],
//! which addresses a pool by its base address and owns no memory) and
//! builds descriptors; a [`HandOff`] moves and verifies each request's KV.
//! Embedded mode ([`replay`]) uses [`LocalHandOff`] over two in-process
//! agents and their [`KvPool`]s; distributed mode
//! ([`super::remote`]) drives two agent daemons over HTTP.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvfabric_core::model::{KvLayout, TraceRecord};
use kvfabric_core::Descriptor;
use serde::Serialize;

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
}

impl std::str::FromStr for BenchPath {
    type Err = String;

    /// `bounce` or `standard` (surrounding spaces ignored).
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "bounce" => Ok(Self::Bounce),
            "standard" => Ok(Self::Standard),
            other => Err(format!(
                "--paths: expected bounce and/or standard, got {other:?}"
            )),
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
            prefill.bounce_unavailable.clone().unwrap_or_default()
        ));
    }
    Ok(())
}

/// Options of a replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// KV layout.
    pub layout: KvLayout,
    /// Concurrent requests (fixed-concurrency mode), or max in flight.
    pub concurrency: usize,
    /// Replay by timestamps divided by this factor; `None` = as fast as the
    /// concurrency allows.
    pub speed: Option<f64>,
    /// Blocks per pool.
    pub pool_blocks: u32,
    /// Paths in order.
    pub paths: Vec<BenchPath>,
    /// Progress bar on stderr.
    pub progress: bool,
}

/// Latency statistics of one path (ms).
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
    /// Median transfer latency (ms).
    pub p50_ms: f64,
    /// 90th percentile (ms).
    pub p90_ms: f64,
    /// 99th percentile (ms).
    pub p99_ms: f64,
    /// Maximum (ms).
    pub max_ms: f64,
    /// Mean (ms).
    pub mean_ms: f64,
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
    /// Requests replayed per path.
    pub requests: usize,
    /// Concurrency.
    pub concurrency: usize,
    /// Pool blocks per side.
    pub pool_blocks: u32,
    /// Per-path statistics.
    pub paths: Vec<PathStats>,
    /// p99(bounce) / p99(standard), when both ran.
    pub p99_ratio_bounce_over_standard: Option<f64>,
    /// p50(bounce) / p50(standard), when both ran.
    pub p50_ratio_bounce_over_standard: Option<f64>,
    /// Peak resident set size of this process (bytes, VmHWM).
    pub peak_rss_bytes: u64,
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

/// Moves one request's KV from the prefill side to the decode side and
/// verifies it: the seam between the replay logic and where the agents
/// run.
pub trait HandOff: Sync {
    /// Checks that `path` can run at all (before its phase starts).
    ///
    /// # Errors
    /// Why not (e.g. bounce is not running on the prefill agent).
    fn check_path(&self, path: BenchPath) -> Result<(), String>;

    /// Fills each source `k` of `descs` with [`fill_fast`]`(seed, k)`,
    /// writes `descs` (src on the prefill side, dst on the decode side)
    /// through `path`, waits for the outcome and verifies every destination
    /// byte. Returns the transfer latency in ms, submit → resolution.
    ///
    /// # Errors
    /// A failed or timed-out transfer, or a verification mismatch (named).
    fn hand_off(&self, path: BenchPath, seed: u64, descs: Vec<Descriptor>) -> Result<f64, String>;
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

    fn hand_off(&self, path: BenchPath, seed: u64, descs: Vec<Descriptor>) -> Result<f64, String> {
        // "Prefill": write this request's KV with its own pattern.
        for (k, d) in descs.iter().enumerate() {
            // SAFETY: src lies in the prefill pool's blocks the caller holds.
            unsafe { fill_fast(d.src, d.len, seed, k as u64) };
        }
        let decode_name = self.decode.name();
        let t0 = Instant::now();
        let handle: TransferHandle = match path {
            BenchPath::Bounce => self
                .prefill
                .transport()
                .ok_or("bounce is not running on the prefill agent")?
                .submit(decode_name, descs.clone()),
            BenchPath::Standard => self.prefill.submit_standard(decode_name, descs.clone()),
        };
        let outcome = handle.wait(XFER_TIMEOUT);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        match outcome {
            Some(TransferOutcome::Success) => {}
            other => return Err(format!("transfer failed: {other:?}")),
        }
        for (k, d) in descs.iter().enumerate() {
            // SAFETY: dst lies in the decode pool's blocks the caller holds.
            if let Err(off) = unsafe { check_fast(d.dst, d.len, seed, k as u64) } {
                return Err(format!("verification failed: descriptor {k}, byte {off}"));
            }
        }
        Ok(ms)
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
/// wherever their memory lives), once per path.
///
/// # Errors
/// Setup failures (a request larger than the pool, a path that cannot run).
/// Transfer failures and verification mismatches are counted per path and
/// make the caller's exit status non-zero.
pub fn replay_with(
    hand_off: &dyn HandOff,
    prefill_pool: &BlockPool,
    decode_pool: &BlockPool,
    trace: &[TraceRecord],
    opts: &ReplayOptions,
) -> Result<ReplayReport, String> {
    let layout = &opts.layout;
    for (i, r) in trace.iter().enumerate() {
        let b = layout.blocks_for(r.input_length);
        if b > u64::from(opts.pool_blocks) {
            return Err(format!(
                "trace request {i} needs {b} blocks ({} tokens); --pool-blocks is {}",
                r.input_length, opts.pool_blocks
            ));
        }
    }
    let mut stats = Vec::new();
    for (pi, &path) in opts.paths.iter().enumerate() {
        hand_off.check_path(path)?;
        stats.push(run_phase(
            hand_off,
            prefill_pool,
            decode_pool,
            trace,
            opts,
            path,
            (pi as u64 + 1) << 40,
        ));
    }
    let find = |p: BenchPath| stats.iter().find(|s| s.path == p);
    let ratio =
        |f: fn(&PathStats) -> f64| match (find(BenchPath::Bounce), find(BenchPath::Standard)) {
            (Some(b), Some(s)) if f(s) > 0.0 => Some(f(b) / f(s)),
            _ => None,
        };
    Ok(ReplayReport {
        model: layout.model.name.clone(),
        block_tokens: layout.block_tokens,
        tp: layout.tp,
        kv_split: layout.kv_split,
        descriptor_bytes: layout.descriptor_bytes(),
        requests: trace.len(),
        concurrency: opts.concurrency,
        pool_blocks: opts.pool_blocks,
        p99_ratio_bounce_over_standard: ratio(|s| s.p99_ms),
        p50_ratio_bounce_over_standard: ratio(|s| s.p50_ms),
        paths: stats,
        peak_rss_bytes: peak_rss_bytes(),
    })
}

fn run_phase(
    hand_off: &dyn HandOff,
    ppool: &BlockPool,
    dpool: &BlockPool,
    trace: &[TraceRecord],
    opts: &ReplayOptions,
    path: BenchPath,
    seed_base: u64,
) -> PathStats {
    let layout = &opts.layout;
    let tensors = layout.model.layers * layout.tensors_per_layer();
    let desc_bytes = layout.descriptor_bytes();
    let next = AtomicUsize::new(0);
    let failures = AtomicUsize::new(0);
    let bytes = AtomicU64::new(0);
    let descs_total = AtomicU64::new(0);
    let latencies = Mutex::new(Vec::with_capacity(trace.len()));
    let bar = if opts.progress {
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
    let start = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..opts.concurrency.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(rec) = trace.get(i) else { break };
                if let Some(speed) = opts.speed {
                    let due = Duration::from_secs_f64(rec.timestamp as f64 / 1e3 / speed);
                    let now = start.elapsed();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                }
                let nblocks = layout.blocks_for(rec.input_length) as u32;
                let (pb, db) = match (ppool.allocate(nblocks), dpool.allocate(nblocks)) {
                    (Ok(p), Ok(d)) => (p, d),
                    (p, d) => {
                        tracing::warn!(request = i, "KV block allocation failed");
                        if let Ok(p) = p {
                            ppool.release(p);
                        }
                        if let Ok(d) = d {
                            dpool.release(d);
                        }
                        failures.fetch_add(1, Ordering::Relaxed);
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
                let result = hand_off.hand_off(path, seed, descs);
                ppool.release(pb);
                dpool.release(db);
                if let Err(e) = &result {
                    tracing::error!(request = i, error = %e, "hand-off failed");
                }
                if let Ok(ms) = result {
                    latencies.lock().unwrap_or_else(|p| p.into_inner()).push(ms);
                    bytes.fetch_add(n * desc_bytes, Ordering::Relaxed);
                    descs_total.fetch_add(n, Ordering::Relaxed);
                } else {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                bar.inc(1);
                let gb = bytes.load(Ordering::Relaxed) as f64 / 1e9;
                bar.set_message(format!(
                    "{:.1} GB, {:.2} GB/s",
                    gb,
                    gb / start.elapsed().as_secs_f64().max(1e-9)
                ));
            });
        }
    });
    bar.finish();
    let wall = start.elapsed().as_secs_f64();
    let mut l = latencies.into_inner().unwrap_or_else(|p| p.into_inner());
    l.sort_by(|a, b| a.total_cmp(b));
    let total = bytes.load(Ordering::Relaxed);
    PathStats {
        path,
        requests: l.len(),
        failures: failures.load(Ordering::Relaxed),
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
    }
}

impl ReplayReport {
    /// A plain-text summary table.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{} TP{} block {} {} ({} B descriptors), {} requests, concurrency {}, pool {} blocks\n",
            self.model,
            self.tp,
            self.block_tokens,
            if self.kv_split { "K/V split" } else { "K+V" },
            self.descriptor_bytes,
            self.requests,
            self.concurrency,
            self.pool_blocks
        );
        s += &format!(
            "{:>9} {:>5} {:>5} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9}\n",
            "path", "ok", "fail", "GB", "GB/s", "p50 ms", "p90 ms", "p99 ms", "max ms"
        );
        for p in &self.paths {
            s += &format!(
                "{:>9} {:>5} {:>5} {:>9.2} {:>7.2} {:>9.1} {:>9.1} {:>9.1} {:>9.1}\n",
                format!("{:?}", p.path).to_lowercase(),
                p.requests,
                p.failures,
                p.bytes as f64 / 1e9,
                p.gbps,
                p.p50_ms,
                p.p90_ms,
                p.p99_ms,
                p.max_ms
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
        let e = "both".parse::<BenchPath>().unwrap_err();
        assert!(e.contains("--paths") && e.contains("\"both\""), "{e}");
    }
}
