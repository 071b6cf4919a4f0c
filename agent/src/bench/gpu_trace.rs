//! GPU trace replay (feature `cuda`; GPU issue: "the trace replay at 128
//! concurrent on two GPUs, p50/p99 per path"): the host replay of
//! [`super::trace`] with both KV pools and both bounce arenas in device
//! memory. The prefill agent runs in this process on `device`; the decode
//! agent is a `kvfabric-gpu vram-peer` child process on `peer_device` (two
//! processes, as in production: UCX moves GPU data between processes with
//! `cuda_ipc`; two agents in one process fell back to software emulation on
//! the H200 even with `UCX_CUDA_IPC_ENABLE_SAME_PROCESS=y` — the transport
//! report caught it at 0.1–0.15 GB/s). Each request's blocks come from
//! paged pools with shuffled free lists, as in the host replay; its source
//! blocks are filled on the prefill GPU and every destination byte is
//! checked on the decode GPU by the pattern kernels (`kernels/pattern.cu`,
//! the child's `CHECK` command), outside the timed window.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvfabric_core::config::BounceConfig;
use kvfabric_core::model::{parse_trace, KvLayout, ModelGeometry, TraceRecord};
use kvfabric_core::Descriptor;

use super::arrivals::{fixed_prompt_trace, Arrivals};
use super::dataplane::{read_descriptor, write_descs, PeerProcess};
use super::timeline::{BounceTimeline, TimelineSummary, TracedRequest};
use super::trace::{
    check_prefill_path, is_warmup_seed, logged_request_id, replay_with, BenchPath, BlockPool,
    HandOff, HandOffResult, ReplayOptions, ReplayReport, RequestBlocks, WARMUP_SEED_BIT,
};
use crate::runtime::control::zmq::BindAddr;
use crate::runtime::cuda::pattern::{PatDesc, PatternKernels};
use crate::runtime::cuda::{CudaArena, CudaCopyConfig, CudaGpu};
use crate::runtime::engine::MemKind;
use crate::runtime::fabric::{ArenaChoice, FabricAgent, FabricOptions, PeerMemory};
use crate::runtime::transport::TransferOutcome;

/// Bound on one transfer.
const XFER_TIMEOUT: Duration = Duration::from_secs(120);

/// Options of a GPU replay.
#[derive(Clone, Debug)]
pub struct GpuReplayOptions {
    /// KV layout (model, block tokens, TP, K/V split).
    pub layout: KvLayout,
    /// Requests in flight (closed loop), or the most in flight (open
    /// loop).
    pub concurrency: usize,
    /// How requests arrive (closed loop, trace timestamps / speed, or
    /// Poisson at a rate).
    pub arrivals: Arrivals,
    /// Warm-up requests before each path's measured phase
    /// ([`ReplayOptions::warmup`]).
    pub warmup: usize,
    /// Bytes of each KV pool (rounded down to whole blocks).
    pub pool_bytes: u64,
    /// The prefill agent's GPU.
    pub device: usize,
    /// The decode agent's GPU (its own process).
    pub peer_device: usize,
    /// Bounce config of both agents (enabled is forced on).
    pub config: BounceConfig,
    /// CUDA copy-engine settings of the prefill agent (the child uses the
    /// defaults).
    pub copy: CudaCopyConfig,
    /// Paths in order.
    pub paths: Vec<BenchPath>,
    /// Progress bar on stderr.
    pub progress: bool,
    /// Fill and verify the requests whose index is a multiple of this (1 =
    /// every request; at least 1).
    pub verify_every: u64,
    /// Trace every bounce request's stages and report where the time of
    /// the median and of the slowest requests went ([`TimelineSummary`]).
    pub timeline: bool,
}

/// [`HandOff`] from a prefill agent on a GPU to a decode agent in a child
/// process: fill on the prefill GPU, transfer, `CHECK` on the decode GPU.
pub struct GpuHandOff<'a> {
    /// Sender.
    pub prefill: &'a FabricAgent,
    /// The decode agent's NIXL name (loaded as a peer by `prefill`).
    pub decode_name: String,
    /// Pattern kernels on the prefill GPU.
    pub fill: &'a PatternKernels,
    /// The decode process (commands serialise).
    pub decode: &'a Mutex<PeerProcess>,
    /// Directory for the per-request destination tables.
    pub dir: PathBuf,
    /// Fill and verify requests whose index is a multiple of this (≥ 1).
    pub verify_every: u64,
    /// Requests filled and verified byte for byte so far.
    pub verified: AtomicU64,
    /// `Some`: trace every bounce request and keep its stages here.
    pub timelines: Option<Mutex<Vec<TracedRequest>>>,
    /// Bounce requests submitted and not yet resolved.
    pub in_flight: AtomicUsize,
    /// Traced requests submitted so far ([`TracedRequest::seq`]).
    pub traced_seq: AtomicUsize,
}

impl HandOff for GpuHandOff<'_> {
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
        let mut request_id = None;
        let outcome = self.transfer_and_check(path, seed, descs, &mut request_id);
        HandOffResult {
            request_id,
            outcome,
        }
    }
}

impl GpuHandOff<'_> {
    /// [`HandOff::hand_off`]; `request_id` is set once the transfer is
    /// submitted.
    fn transfer_and_check(
        &self,
        path: BenchPath,
        seed: u64,
        descs: Vec<Descriptor>,
        request_id: &mut Option<u64>,
    ) -> Result<f64, String> {
        // `replay_with` seeds request i of path p with ((p + 1) << 40) + i,
        // its warm-up request k with ((p + 1) << 40) | WARMUP_SEED_BIT | k:
        // the bits below WARMUP_SEED_BIT are the position, so every path
        // (and its warm-up) verifies requests 0, N, 2N, …. Warm-up requests
        // are neither traced nor counted as verified (a failed check fails
        // the warm-up).
        let warmup = is_warmup_seed(seed);
        let verify = (seed & (WARMUP_SEED_BIT - 1)) % self.verify_every.max(1) == 0;
        if verify {
            let table: Vec<PatDesc> = descs
                .iter()
                .enumerate()
                .map(|(k, d)| PatDesc {
                    addr: d.src,
                    len: d.len,
                    k: k as u64,
                })
                .collect();
            self.fill
                .fill(&table, seed)
                .map_err(|e| format!("filling the source blocks: {e}"))?;
        }
        // The service time starts here: a verified request's copy below
        // counts in it, as it did for every request before.
        let t0 = Instant::now();
        // Only a verified request keeps a copy of its descriptors for the
        // check (36,900 of them, 885 KB, for the seed's shape: copying
        // them cost ≈ 0.1 ms of each request's service time).
        let kept = verify.then(|| descs.clone());
        let traced = self.timelines.is_some() && path == BenchPath::Bounce && !warmup;
        let in_flight = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        let seq = if traced {
            self.traced_seq.fetch_add(1, Ordering::Relaxed)
        } else {
            0
        };
        let handle = match path {
            BenchPath::Bounce => {
                let transport = self.prefill.transport();
                let Some(transport) = transport else {
                    self.in_flight.fetch_sub(1, Ordering::Relaxed);
                    return Err("bounce is not running on the prefill agent".into());
                };
                if traced {
                    transport.submit_traced(&self.decode_name, descs)
                } else {
                    transport.submit(&self.decode_name, descs)
                }
            }
            BenchPath::Standard => self.prefill.submit_standard(&self.decode_name, descs),
            BenchPath::Auto => self.prefill.submit_write(&self.decode_name, descs).1,
        };
        *request_id = logged_request_id(&handle);
        let outcome = handle.wait(XFER_TIMEOUT);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        match outcome {
            Some(TransferOutcome::Success) => {
                if let (true, Some(t)) = (traced, &self.timelines) {
                    let (events, dropped_events) = handle.take_timeline();
                    let stages = BounceTimeline::of(&events, t0, ms * 1e3);
                    t.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(TracedRequest {
                            seq,
                            ms,
                            in_flight,
                            stages,
                            dropped_events,
                        });
                }
            }
            None => {
                return Err(format!(
                    "transfer not resolved within {} s",
                    XFER_TIMEOUT.as_secs()
                ))
            }
            other => return Err(format!("transfer failed: {other:?}")),
        }
        let Some(descs) = kept else {
            return Ok(ms);
        };
        let file = self.dir.join(format!("check-{seed}.bin"));
        write_descs(&file, &descs).map_err(|e| format!("{}: {e}", file.display()))?;
        let r = self
            .decode
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .command(&format!("CHECK {seed} {}", file.display()));
        let _ = std::fs::remove_file(&file);
        r.map_err(|e| format!("verification on the decode GPU: {e}"))?;
        if !warmup {
            self.verified.fetch_add(1, Ordering::Relaxed);
        }
        Ok(ms)
    }
}

/// Replays `trace` prefill (this process, GPU `device`) → decode (a
/// `vram-peer` child of `exe`, GPU `peer_device`), once per path, every
/// byte checked on the decode GPU (a sample with `verify_every` > 1),
/// with the [`TimelineSummary`] of its bounce requests when
/// `opts.timeline` is set.
///
/// # Errors
/// Setup failures (no GPU, pools that do not fit, an agent or the child
/// that cannot start, bounce unavailable). Transfer failures and mismatches
/// are counted in the report.
pub fn run(
    exe: &Path,
    trace: &[TraceRecord],
    opts: &GpuReplayOptions,
) -> Result<(ReplayReport, Option<TimelineSummary>), String> {
    let dir = std::env::temp_dir().join(format!("kvfabric-gpu-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let out = run_in(exe, &dir, trace, opts);
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn run_in(
    exe: &Path,
    dir: &Path,
    trace: &[TraceRecord],
    opts: &GpuReplayOptions,
) -> Result<(ReplayReport, Option<TimelineSummary>), String> {
    let layout = &opts.layout;
    let gpu = CudaGpu::open(opts.device).map_err(|e| format!("GPU {}: {e}", opts.device))?;
    let pool_blocks = (opts.pool_bytes / layout.bytes_per_block()).min(u64::from(u32::MAX)) as u32;
    if pool_blocks == 0 {
        return Err(format!(
            "--pool {} bytes holds no block of {} bytes",
            opts.pool_bytes,
            layout.bytes_per_block()
        ));
    }
    let bytes = BlockPool::bytes_for(layout, pool_blocks);
    let mut config = opts.config.clone();
    config.enabled = true;
    let eff = config.validate().map_err(|e| e.to_string())?;
    let args = super::vram::peer_args(opts.peer_device, dir, bytes);
    let peer = PeerProcess::spawn_args(exe, &args, &config.to_env_vars())?;
    let (rdesc, rpool, rlen) = read_descriptor(&peer.descriptor)?;
    if rlen < bytes {
        return Err(format!("decode pool is {rlen} bytes, expected {bytes}"));
    }
    let ppool =
        CudaArena::new(&gpu, bytes as usize).map_err(|e| format!("prefill KV pool: {e}"))?;
    let pblocks = BlockPool::new(layout, pool_blocks, ppool.base_addr(), 1);
    let dblocks = BlockPool::new(layout, pool_blocks, rpool, 2);
    let prefill = FabricAgent::with_arena(
        FabricOptions {
            name: format!("prefill-gpu{}-{}", opts.device, std::process::id()),
            config: eff,
            kv_regions: vec![(MemKind::Vram, ppool.mem_desc())],
            bind: BindAddr::Loopback,
            copy: None,
            control_auth: Default::default(),
        },
        ArenaChoice::Cuda {
            gpu: gpu.clone(),
            copy: opts.copy,
        },
    )
    .map_err(|e| format!("prefill agent: {e}"))?;
    if let Some(w) = &prefill.bounce_unavailable() {
        return Err(format!("prefill agent: bounce unavailable: {w}"));
    }
    let st = prefill.load_peer(&rdesc).map_err(|e| e.to_string())?;
    if let Err(why) = st.bounce {
        return Err(format!("decode agent is not bounce-capable: {why:?}"));
    }
    prefill.set_peer_memory(
        &rdesc.name,
        PeerMemory {
            kind: MemKind::Vram,
            device_id: opts.peer_device as u64,
        },
    );
    let fill = PatternKernels::new(&gpu).map_err(|e| format!("pattern kernels: {e}"))?;
    eprintln!(
        "GPU replay: {} requests, prefill GPU {} → decode GPU {} (own process), {} B descriptors, \
         {pool_blocks} blocks ({:.1} GiB) per pool, {}, at most {} in flight",
        trace.len(),
        opts.device,
        opts.peer_device,
        layout.descriptor_bytes(),
        bytes as f64 / (1u64 << 30) as f64,
        opts.arrivals.describe(),
        opts.concurrency
    );
    let decode = Mutex::new(peer);
    let hand_off = GpuHandOff {
        prefill: &prefill,
        decode_name: rdesc.name.clone(),
        fill: &fill,
        decode: &decode,
        dir: dir.to_path_buf(),
        verify_every: opts.verify_every.max(1),
        verified: AtomicU64::new(0),
        timelines: opts.timeline.then(|| Mutex::new(Vec::new())),
        in_flight: AtomicUsize::new(0),
        traced_seq: AtomicUsize::new(0),
    };
    let report = replay_with(
        &hand_off,
        &pblocks,
        &dblocks,
        trace,
        &ReplayOptions {
            layout: layout.clone(),
            concurrency: opts.concurrency,
            arrivals: opts.arrivals,
            pool_blocks,
            paths: opts.paths.clone(),
            progress: opts.progress,
            warmup: opts.warmup,
        },
    );
    println!(
        "verified byte for byte on the decode GPU: {} of {} hand-offs (--verify-every {})",
        hand_off.verified.load(Ordering::Relaxed),
        trace.len() * opts.paths.len(),
        opts.verify_every.max(1)
    );
    if let Some(r) = prefill
        .transport()
        .and_then(|t| t.transport_report(&rdesc.name))
    {
        eprintln!(
            "transport report: fastest of the first {} chunk writes {:.2} GB/s ({} bytes){}",
            r.chunks,
            r.best_chunk_mbps as f64 / 1e3,
            r.best_chunk_bytes,
            if r.suspect_fallback {
                " — SUSPECT: software emulation or TCP"
            } else {
                ""
            }
        );
    }
    let timeline = hand_off.timelines.as_ref().map(|t| {
        TimelineSummary::of(std::mem::take(
            &mut *t.lock().unwrap_or_else(|p| p.into_inner()),
        ))
    });
    drop(prefill);
    drop(decode);
    report.map(|r| (r, timeline))
}

/// The flags of `kvfabric-gpu bench`.
#[derive(Clone, Debug)]
pub struct GpuBenchArgs {
    /// JSONL trace (Mooncake format); `None` with `fixed_prompt`.
    pub trace: Option<PathBuf>,
    /// First trace line (0-based).
    pub start: usize,
    /// Requests to replay (at least 1): of the trace, or synthetic ones
    /// with `fixed_prompt`.
    pub requests: usize,
    /// Synthetic workload: every request this many prompt tokens
    /// (`--fixed-prompt`; no trace read).
    pub fixed_prompt: Option<u64>,
    /// Requests in flight (0 counts as 1): closed loop, the number in
    /// flight; open loop, the most in flight.
    pub concurrency: usize,
    /// How requests arrive (`--speed`, `--rate`/`--seed`, else closed
    /// loop).
    pub arrivals: Arrivals,
    /// `--warmup`: requests before each path's measured phase.
    pub warmup: usize,
    /// Model geometry (a preset).
    pub model: ModelGeometry,
    /// Tensor-parallel degree (KV heads per rank = heads / tp).
    pub tp: u32,
    /// Tokens per KV block.
    pub block: u32,
    /// Bytes of each KV pool.
    pub pool_bytes: u64,
    /// The prefill agent's GPU.
    pub device: usize,
    /// The decode agent's GPU.
    pub peer_device: usize,
    /// Paths, in order.
    pub paths: Vec<BenchPath>,
    /// Fill and verify every Nth request (`--verify-every`, ≥ 1).
    pub verify_every: u64,
    /// Write the JSON report here.
    pub json: Option<PathBuf>,
    /// Trace every bounce request (`--timeline`): print and report where
    /// the time of the median and the slowest requests went.
    pub timeline: bool,
}

/// `kvfabric-gpu bench`: reads the trace slice (or builds the
/// `--fixed-prompt` requests), replays it with [`run`] (`exe` = this
/// executable, bounce config from `KVFABRIC_BOUNCE_*`), prints the table
/// and writes the JSON report.
///
/// # Errors
/// A layout the flags make invalid, an arrival mode with a bad speed or
/// rate, a trace that cannot be read or has no request at `start` (or
/// neither a trace nor a fixed prompt), any setup failure of [`run`], a
/// report that cannot be written, or failed requests (counted).
pub fn run_cli(a: &GpuBenchArgs) -> Result<(), String> {
    let layout = KvLayout::new(a.model.clone(), a.block, a.tp, true)?;
    a.arrivals.check()?;
    let trace = bench_trace(a)?;
    let (config, warnings) = BounceConfig::from_env();
    for w in warnings {
        eprintln!("warning: {w}");
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let (mut report, timeline) = run(
        &exe,
        &trace,
        &GpuReplayOptions {
            layout,
            concurrency: a.concurrency.max(1),
            arrivals: a.arrivals,
            warmup: a.warmup,
            pool_bytes: a.pool_bytes,
            device: a.device,
            peer_device: a.peer_device,
            config,
            copy: CudaCopyConfig::default(),
            paths: a.paths.clone(),
            progress: false,
            verify_every: a.verify_every,
            timeline: a.timeline,
        },
    )?;
    report.fixed_prompt_tokens = a.fixed_prompt;
    print!("{}", report.table());
    if let Some(t) = &timeline {
        print!("{}", t.lines());
    }
    if let Some(p) = &a.json {
        let mut json = serde_json::to_value(&report).map_err(|e| e.to_string())?;
        if let (Some(t), Some(obj)) = (&timeline, json.as_object_mut()) {
            obj.insert(
                "timeline".into(),
                serde_json::to_value(t).map_err(|e| e.to_string())?,
            );
        }
        let text = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
        std::fs::write(p, text).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if report.failures() > 0 {
        return Err(format!(
            "{} requests failed or did not verify",
            report.failures()
        ));
    }
    Ok(())
}

/// The requests of `kvfabric-gpu bench`: `--fixed-prompt` synthetic ones,
/// or the slice of `--trace`.
fn bench_trace(a: &GpuBenchArgs) -> Result<Vec<TraceRecord>, String> {
    if let Some(tokens) = a.fixed_prompt {
        return fixed_prompt_trace(tokens, a.requests);
    }
    let path = a
        .trace
        .as_deref()
        .ok_or("--trace: a trace is required unless --fixed-prompt is given")?;
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("--trace {}: {e}", path.display()))?;
    let trace = parse_trace(&text, a.start, a.requests)?;
    if trace.is_empty() {
        return Err(format!(
            "--trace {}: no requests at line {}",
            path.display(),
            a.start
        ));
    }
    Ok(trace)
}
