//! `kvfabric-gpu` — GPU data-plane tests and benchmarks (feature `cuda`).
//!
//! * `kvfabric-gpu info` — the device, driver, NVRTC and kernel build.
//! * `kvfabric-gpu compile` — compile `kernels/*.cu` with NVRTC only (no GPU
//!   needed) and report the cubin.
//! * `kvfabric-gpu kernel-test` — byte-exact gather/scatter tests of the
//!   kernel (both plan sources) and of the comparison paths: aligned and
//!   misaligned sources and destinations, zero-length descriptors, 1 B to
//!   1 MiB, 100,000 descriptors, coalesced runs with uniform strides; every
//!   byte of both buffers is checked, so a write outside a target fails.
//! * `kvfabric-gpu kernel-bench` — CUDA-event medians: 16,384 descriptors of
//!   4/8/16/64 KiB random slots and a 1 GiB memory-bound case, gather and
//!   scatter, against a contiguous device-to-device memcpy of the same
//!   bytes, per-descriptor memcpy and the driver's batched memcpy.
//!
//! * `kvfabric-gpu vram-bench` — bounce end to end with VRAM arenas and VRAM
//!   KV pools between two processes (this one and a `vram-peer` child, on
//!   the same GPU or on `--peer-device`): the standard per-descriptor path,
//!   bounce and one descriptor side by side, every transfer verified
//!   byte-exact, plus a UCX transport report (which transports the
//!   transfers used; a warning on software emulation or TCP).
//!
//! * `kvfabric-gpu bench` — the trace replay of `kvfabric bench` with both
//!   KV pools and arenas in GPU memory: a prefill agent on `--device`, a
//!   decode agent on `--peer-device`, bounce and standard path, every byte
//!   checked on the device, p50/p90/p99/max per path.
//!
//! Where there is no CUDA driver, device or NVRTC every subcommand prints
//! `SKIP: <reason>` and exits 0.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, Subcommand};
use cudarc::driver::{result, sys};
use kvfabric_agent::bench::vram::{self, VramOptions};
use kvfabric_agent::core::config::{parse_byte_size, BounceConfig, ByteSize};
use kvfabric_agent::core::ScatterRun;
use kvfabric_agent::runtime::cuda::{
    self, CopyPath, CudaArena, CudaCopyConfig, CudaCopyEngine, CudaError, CudaGpu, Direction,
    ExecCtx, PlanSource,
};
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "kvfabric-gpu",
    version,
    about = "kvfabric GPU kernel tests and benchmarks"
)]
struct Cli {
    /// GPU ordinal.
    #[arg(long, default_value_t = 0, global = true)]
    device: usize,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the device, driver, NVRTC version and kernel build.
    Info,
    /// Compile kernels/*.cu with NVRTC to a cubin (no GPU needed).
    Compile {
        /// Target compute capability, e.g. 90.
        #[arg(long, default_value_t = 90)]
        arch: i32,
        /// Write the cubin here.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Byte-exact kernel tests (both directions, both plan sources, comparison paths).
    KernelTest {
        /// RNG seed.
        #[arg(long, default_value_t = 0x6b76_6661_6272_6963)]
        seed: u64,
        /// Write a JSON report here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Kernel benchmark (CUDA events, medians).
    KernelBench {
        /// Launches per timed sample.
        #[arg(long, default_value_t = 20)]
        iters: usize,
        /// Timed samples (the median is reported).
        #[arg(long, default_value_t = 9)]
        reps: usize,
        /// Also sweep threads per block and persistent-grid sizes.
        #[arg(long)]
        sweep: bool,
        /// RNG seed.
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Write the JSON report here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// VRAM end to end: standard vs bounce vs one descriptor between two
    /// processes (GPU arenas and GPU pools, NIXL VRAM), verified byte-exact.
    VramBench(VramArgs),
    /// Trace replay prefill (GPU --device) → decode (GPU --peer-device) with
    /// VRAM pools and arenas: bounce vs standard path, p50/p90/p99/max.
    Bench {
        /// JSONL trace (Mooncake format).
        #[arg(long)]
        trace: PathBuf,
        /// First trace line (0-based).
        #[arg(long, default_value_t = 0)]
        start: usize,
        /// Requests to replay.
        #[arg(long, default_value_t = 500)]
        requests: usize,
        /// Requests in flight.
        #[arg(long, default_value_t = 128)]
        concurrency: usize,
        /// Model preset (Llama-3.1-8B, Llama-3.1-70B, Qwen2.5-7B, gpt-oss-120b).
        #[arg(long, default_value = "Llama-3.1-8B")]
        model: String,
        /// Tensor-parallel degree (KV heads per rank = heads / tp).
        #[arg(long, default_value_t = 4)]
        tp: u32,
        /// Tokens per KV block.
        #[arg(long, default_value_t = 16)]
        block: u32,
        /// Bytes of each KV pool (suffixes accepted).
        #[arg(long, default_value = "32GiB")]
        pool: String,
        /// The decode agent's GPU (default: --device).
        #[arg(long)]
        peer_device: Option<usize>,
        /// Paths, comma-separated (bounce, standard).
        #[arg(long, default_value = "bounce,standard", value_delimiter = ',')]
        paths: Vec<String>,
        /// Write the JSON report here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The receiver process of `vram-bench` (internal).
    #[command(hide = true)]
    VramPeer {
        /// Directory for the descriptor file.
        #[arg(long)]
        dir: PathBuf,
        /// GPU pool size (bytes).
        #[arg(long)]
        pool_bytes: u64,
    },
}

fn main() -> ExitCode {
    kvfabric_agent::tune_allocator();
    kvfabric_agent::init_cli_logs();
    let cli = Cli::parse();
    if let Cmd::Compile { arch, out } = &cli.cmd {
        return compile(*arch, out.as_ref());
    }
    if let Err(why) = cuda::probe() {
        println!("SKIP: {why}");
        return ExitCode::SUCCESS;
    }
    let gpu = match CudaGpu::open(cli.device) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: opening GPU {}: {e}", cli.device);
            return ExitCode::FAILURE;
        }
    };
    let out = match cli.cmd {
        Cmd::Info => {
            println!(
                "{}",
                serde_json::to_string_pretty(gpu.info()).unwrap_or_default()
            );
            println!(
                "batched memcpy (cuMemcpyBatchAsync_v2): {}",
                cuda::has_batched_memcpy()
            );
            Ok(())
        }
        Cmd::Compile { .. } => unreachable!(),
        Cmd::KernelTest { seed, json } => kernel_test(&gpu, seed, json),
        Cmd::KernelBench {
            iters,
            reps,
            sweep,
            seed,
            json,
        } => kernel_bench(&gpu, iters.max(1), reps.max(1), sweep, seed, json),
        Cmd::VramBench(args) => vram_bench(&gpu, cli.device, &args),
        Cmd::Bench {
            trace,
            start,
            requests,
            concurrency,
            model,
            tp,
            block,
            pool,
            peer_device,
            paths,
            json,
        } => {
            drop(gpu);
            gpu_bench(GpuBenchArgs {
                trace,
                start,
                requests,
                concurrency,
                model,
                tp,
                block,
                pool,
                device: cli.device,
                peer_device: peer_device.unwrap_or(cli.device),
                paths,
                json,
            })
        }
        Cmd::VramPeer { dir, pool_bytes } => {
            vram::run_peer(&gpu, &dir, pool_bytes, CudaCopyConfig::default())
        }
    };
    match out {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

struct GpuBenchArgs {
    trace: PathBuf,
    start: usize,
    requests: usize,
    concurrency: usize,
    model: String,
    tp: u32,
    block: u32,
    pool: String,
    device: usize,
    peer_device: usize,
    paths: Vec<String>,
    json: Option<PathBuf>,
}

fn gpu_bench(a: GpuBenchArgs) -> Result<(), String> {
    use kvfabric_agent::bench::gpu_trace::{self, GpuReplayOptions};
    use kvfabric_agent::bench::trace::BenchPath;
    use kvfabric_agent::core::model::{parse_trace, preset, KvLayout};

    let layout = KvLayout::new(preset(&a.model)?, a.block, a.tp, true)?;
    let pool_bytes = parse_byte_size(&a.pool).map_err(|e| format!("--pool: {e}"))?;
    let paths = a
        .paths
        .iter()
        .map(|p| p.parse::<BenchPath>())
        .collect::<Result<Vec<_>, _>>()?;
    let text = std::fs::read_to_string(&a.trace)
        .map_err(|e| format!("--trace {}: {e}", a.trace.display()))?;
    let trace = parse_trace(&text, a.start, a.requests)?;
    if trace.is_empty() {
        return Err(format!(
            "--trace {}: no requests at line {}",
            a.trace.display(),
            a.start
        ));
    }
    let (config, warnings) = BounceConfig::from_env();
    for w in warnings {
        eprintln!("warning: {w}");
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let report = gpu_trace::run(
        &exe,
        &trace,
        &GpuReplayOptions {
            layout,
            concurrency: a.concurrency.max(1),
            pool_bytes,
            device: a.device,
            peer_device: a.peer_device,
            config,
            copy: CudaCopyConfig::default(),
            paths,
            progress: false,
        },
    )?;
    print!("{}", report.table());
    if let Some(p) = &a.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
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

fn compile(arch: i32, out: Option<&PathBuf>) -> ExitCode {
    if let Err(why) = cuda::probe_nvrtc() {
        println!("SKIP: {why}");
        return ExitCode::SUCCESS;
    }
    let sources = [
        ("kernels/gather_scatter.cu", cuda::GATHER_SCATTER_SRC),
        ("kernels/pattern.cu", cuda::pattern::PATTERN_SRC),
    ];
    for (i, (name, src)) in sources.into_iter().enumerate() {
        let t0 = Instant::now();
        match cuda::compile_cubin(src, name, (arch / 10, arch % 10)) {
            Ok(cubin) => {
                println!(
                    "compiled {name} for sm_{arch}: {} byte cubin in {:.1} ms (NVRTC {:?})",
                    cubin.len(),
                    t0.elapsed().as_secs_f64() * 1e3,
                    cuda::nvrtc_version().ok()
                );
                // --out is the gather/scatter cubin (the one agents load).
                if let (0, Some(p)) = (i, out) {
                    if let Err(e) = std::fs::write(p, &cubin) {
                        eprintln!("error: writing {}: {e}", p.display());
                        return ExitCode::FAILURE;
                    }
                }
            }
            Err(e) => {
                eprintln!("error: {name}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

// ---------------------------------------------------------------- helpers

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in lo..=hi.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let v = self.next().to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&v[..n]);
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

type AnyResult<T> = Result<T, String>;

fn e2s(e: CudaError) -> String {
    e.to_string()
}

/// Applies `runs` on host copies (`user_off` = addresses relative to the
/// user buffer; region offsets relative to `region_off` in the region
/// buffer): the expected result of a gather or scatter.
fn host_apply(
    dir: Direction,
    runs: &[ScatterRun],
    user: &mut [u8],
    region: &mut [u8],
    region_off: u64,
) {
    for run in runs {
        for (off, addr, len) in run.segments() {
            if len == 0 {
                continue;
            }
            let r = (region_off + off) as usize;
            let u = addr as usize;
            let len = len as usize;
            match dir {
                Direction::Gather => region[r..r + len].copy_from_slice(&user[u..u + len]),
                Direction::Scatter => user[u..u + len].copy_from_slice(&region[r..r + len]),
            }
        }
    }
}

fn rebase(runs: &[ScatterRun], user_base: u64) -> Vec<ScatterRun> {
    runs.iter()
        .map(|r| ScatterRun {
            addr: r.addr + user_base,
            ..*r
        })
        .collect()
}

fn first_mismatch(got: &[u8], want: &[u8]) -> Option<usize> {
    got.iter().zip(want).position(|(a, b)| a != b)
}

// ------------------------------------------------------------ kernel-test

fn kernels_line(info: &cuda::GpuInfo) -> String {
    info.kernels
        .iter()
        .map(|k| format!("{} {} regs {} B local", k.name, k.regs, k.local_bytes))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A test case: runs with `addr` relative to the user buffer.
struct Case {
    name: String,
    runs: Vec<ScatterRun>,
    user_len: usize,
    region_len: usize,
    /// Region address passed to the engine = region buffer + this.
    region_off: u64,
}

/// Places segments in two buffers with random gaps (guard bytes) and the
/// requested alignment modulo 16.
struct Placer {
    rng: Rng,
    user: u64,
    region: u64,
    runs: Vec<ScatterRun>,
}

impl Placer {
    fn new(seed: u64) -> Self {
        Self {
            rng: Rng(seed),
            user: 0,
            region: 0,
            runs: Vec::new(),
        }
    }
    fn place(rng: &mut Rng, cursor: &mut u64, span: u64, mis: u64) -> u64 {
        *cursor += rng.range(1, 64);
        let at = (*cursor).div_ceil(16) * 16 + mis;
        *cursor = at + span;
        at
    }
    /// A single descriptor of `len` bytes (user % 16 == umis, region % 16 == rmis).
    fn desc(&mut self, len: u64, umis: u64, rmis: u64) {
        let u = Self::place(&mut self.rng, &mut self.user, len, umis);
        let r = Self::place(&mut self.rng, &mut self.region, len, rmis);
        self.runs.push(ScatterRun {
            region_offset: r,
            addr: u,
            segment_len: len,
            count: 1,
            region_stride: 0,
            addr_stride: 0,
        });
    }
    /// A coalesced run of `count` segments with uniform strides.
    #[allow(clippy::too_many_arguments)]
    fn coalesced(
        &mut self,
        len: u64,
        count: u32,
        ustride: u64,
        rstride: u64,
        umis: u64,
        rmis: u64,
    ) {
        let span = |stride: u64| stride * (u64::from(count) - 1) + len;
        let u = Self::place(&mut self.rng, &mut self.user, span(ustride), umis);
        let r = Self::place(&mut self.rng, &mut self.region, span(rstride), rmis);
        self.runs.push(ScatterRun {
            region_offset: r,
            addr: u,
            segment_len: len,
            count,
            region_stride: rstride,
            addr_stride: ustride,
        });
    }
    fn finish(self, name: &str, region_off: u64) -> Case {
        Case {
            name: name.to_string(),
            runs: self.runs,
            user_len: (self.user + 64) as usize,
            region_len: (self.region + region_off + 64) as usize,
            region_off,
        }
    }
}

const SIZES: &[u64] = &[
    1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 255, 256, 257, 511, 512, 513, 1000,
    4095, 4096, 4097, 8191, 8192, 65535, 65536, 65537, 100_000, 262_144, 524_289, 1_048_575,
    1_048_576,
];

fn test_cases(seed: u64) -> Vec<Case> {
    let mut cases = Vec::new();

    let mut p = Placer::new(seed);
    for &n in SIZES {
        p.desc(n, 0, 0);
    }
    cases.push(p.finish("aligned 1B..1MiB", 0));

    // (user % 16, region % 16): 16-, 8-, 4-byte and byte paths.
    for (i, &(um, rm)) in [(1, 1), (8, 0), (4, 12), (3, 7), (0, 5), (13, 2)]
        .iter()
        .enumerate()
    {
        let mut p = Placer::new(seed ^ (i as u64 + 1));
        for &n in SIZES {
            p.desc(n, um, rm);
        }
        cases.push(p.finish(&format!("misaligned user%16={um} region%16={rm}"), 0));
    }

    let mut p = Placer::new(seed ^ 0x100);
    for k in 0..64u64 {
        if k % 3 == 0 {
            p.runs.push(ScatterRun {
                region_offset: p.region + 8,
                addr: p.user + 8,
                segment_len: 0,
                count: 1,
                region_stride: 0,
                addr_stride: 0,
            });
            p.runs.push(ScatterRun {
                region_offset: p.region + 8,
                addr: p.user + 8,
                segment_len: 4096,
                count: 0,
                region_stride: 4096,
                addr_stride: 4096,
            });
        } else {
            let n = p.rng.range(1, 300);
            let (um, rm) = (p.rng.range(0, 15), p.rng.range(0, 15));
            p.desc(n, um, rm);
        }
    }
    cases.push(p.finish("zero-length mixed", 0));

    let mut p = Placer::new(seed ^ 0x200);
    p.runs.push(ScatterRun {
        region_offset: 0,
        addr: 0,
        segment_len: 0,
        count: 1,
        region_stride: 0,
        addr_stride: 0,
    });
    cases.push(p.finish("zero-length only", 0));

    let mut p = Placer::new(seed ^ 0x300);
    for _ in 0..100_000 {
        let n = p.rng.range(1, 8192);
        let aligned = p.rng.next() % 4 != 0;
        let (um, rm) = if aligned {
            (0, 0)
        } else {
            (p.rng.range(0, 15), p.rng.range(0, 15))
        };
        p.desc(n, um, rm);
    }
    // Order must not matter: shuffle the runs.
    p.rng.shuffle(&mut p.runs);
    cases.push(p.finish("100000 descriptors 1B..8KiB", 0));

    let mut p = Placer::new(seed ^ 0x400);
    // Dense both sides (stride == len), strided user side, strided both,
    // small segments (warp path), misaligned, and pieces (> 64 KiB).
    p.coalesced(4096, 4096, 4096, 4096, 0, 0);
    p.coalesced(4096, 2048, 3 * 4096, 4096, 0, 0);
    p.coalesced(8192, 1000, 40_960, 8192 + 256, 0, 0);
    p.coalesced(64, 10_000, 192, 64, 0, 0);
    p.coalesced(100, 5000, 333, 100, 3, 9);
    p.coalesced(1, 3000, 7, 1, 1, 0);
    p.coalesced(200 * 1024, 12, 300 * 1024, 200 * 1024 + 16, 0, 0);
    p.coalesced(70_001, 9, 80_000, 70_001, 5, 5);
    p.coalesced(512, 3333, 1024, 512, 8, 8);
    p.coalesced(513, 777, 2000, 520, 4, 12);
    for _ in 0..200 {
        let n = p.rng.range(1, 20_000);
        let (um, rm) = (p.rng.range(0, 15), p.rng.range(0, 15));
        p.desc(n, um, rm);
    }
    p.rng.shuffle(&mut p.runs);
    cases.push(p.finish("coalesced runs uniform stride + mixed", 0));

    // Region address not 16-aligned relative to the allocation (a region
    // carved at an odd offset of the arena).
    let mut p = Placer::new(seed ^ 0x500);
    for &n in SIZES.iter().take(24) {
        p.desc(n, 0, 0);
    }
    p.coalesced(4096, 64, 8192, 4096, 0, 0);
    cases.push(p.finish("region base +4099", 4099));

    cases
}

struct Variant {
    name: &'static str,
    cfg: CudaCopyConfig,
}

fn variants() -> Vec<Variant> {
    let k = CudaCopyConfig::default();
    let mut v = vec![
        Variant {
            name: "kernel/pinned-plan",
            cfg: k,
        },
        Variant {
            name: "kernel/device-plan",
            cfg: CudaCopyConfig {
                plan_source: PlanSource::Device,
                ..k
            },
        },
        Variant {
            name: "kernel/persistent,occ,4KiB-tasks",
            cfg: CudaCopyConfig {
                blocks_per_sm: 8,
                high_occupancy: true,
                piece_bytes: 4096,
                ..k
            },
        },
        Variant {
            name: "kernel/1024thr,256KiB-tasks",
            cfg: CudaCopyConfig {
                piece_bytes: 256 * 1024,
                threads_per_block: 1024,
                ..k
            },
        },
        Variant {
            name: "memcpy/per-segment",
            cfg: CudaCopyConfig {
                path: CopyPath::PerSegmentMemcpy,
                ..k
            },
        },
    ];
    if cuda::has_batched_memcpy() {
        v.push(Variant {
            name: "memcpy/batched",
            cfg: CudaCopyConfig {
                path: CopyPath::BatchedMemcpy,
                ..k
            },
        });
    } else {
        println!("note: driver has no cuMemcpyBatchAsync_v2; batched path not tested");
    }
    v
}

fn kernel_test(gpu: &Arc<CudaGpu>, seed: u64, json_path: Option<PathBuf>) -> AnyResult<()> {
    let info = gpu.info();
    println!(
        "GPU {} (sm_{}{}, {} SMs), driver {}, NVRTC {:?}, kernels compiled in {:.1} ms ({} B cubin): {}",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.sm_count,
        info.driver_version,
        info.nvrtc_version,
        info.compile_ms,
        info.cubin_bytes,
        kernels_line(info)
    );
    let engines: Vec<(&str, CudaCopyEngine)> = variants()
        .into_iter()
        .map(|v| CudaCopyEngine::new(gpu, v.cfg).map(|e| (v.name, e)))
        .collect::<Result<_, _>>()
        .map_err(e2s)?;
    let mut rng = Rng(seed ^ 0xfeed);
    let mut results = Vec::new();
    let mut failures = 0usize;
    let t_all = Instant::now();
    for case in test_cases(seed) {
        let user = CudaArena::new(gpu, case.user_len).map_err(e2s)?;
        let region = CudaArena::new(gpu, case.region_len).map_err(e2s)?;
        let runs = rebase(&case.runs, user.base_addr());
        let segs: u64 = case.runs.iter().map(|r| u64::from(r.count)).sum();
        let bytes: u64 = case.runs.iter().map(|r| r.total_bytes()).sum();
        let mut host_u = vec![0u8; case.user_len];
        let mut host_r = vec![0u8; case.region_len];
        let mut got_u = vec![0u8; case.user_len];
        let mut got_r = vec![0u8; case.region_len];
        for (vname, engine) in &engines {
            // The per-segment path on 100k descriptors is slow-ish but fine;
            // the batched path's limit on descriptors per call is the driver's.
            for dir in [Direction::Gather, Direction::Scatter] {
                rng.fill(&mut host_u);
                rng.fill(&mut host_r);
                user.upload(0, &host_u).map_err(e2s)?;
                region.upload(0, &host_r).map_err(e2s)?;
                host_apply(dir, &case.runs, &mut host_u, &mut host_r, case.region_off);
                let t0 = Instant::now();
                let r = engine.run(dir, region.base_addr() + case.region_off, &runs);
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                let mut status = match r {
                    Ok(()) => "ok".to_string(),
                    Err(e) => format!("error: {e}"),
                };
                if status == "ok" {
                    user.download(0, &mut got_u).map_err(e2s)?;
                    region.download(0, &mut got_r).map_err(e2s)?;
                    if let Some(i) = first_mismatch(&got_r, &host_r) {
                        status = format!(
                            "MISMATCH in region at byte {} (region_off {}): got {:#04x} want {:#04x}",
                            i, case.region_off, got_r[i], host_r[i]
                        );
                    } else if let Some(i) = first_mismatch(&got_u, &host_u) {
                        status = format!(
                            "MISMATCH in user buffer at byte {i}: got {:#04x} want {:#04x}",
                            got_u[i], host_u[i]
                        );
                    }
                }
                let pass = status == "ok";
                if !pass {
                    failures += 1;
                }
                println!(
                    "{:<5} {:<44} {:<8} {:<34} runs {:>6} segs {:>7} bytes {:>11} {:>9.2} ms",
                    if pass { "PASS" } else { "FAIL" },
                    case.name,
                    format!("{dir:?}"),
                    vname,
                    case.runs.len(),
                    segs,
                    bytes,
                    ms
                );
                if !pass {
                    println!("      {status}");
                }
                results.push(json!({
                    "case": case.name, "variant": vname, "direction": format!("{dir:?}"),
                    "runs": case.runs.len(), "segments": segs, "bytes": bytes,
                    "pass": pass, "status": status, "wall_ms": ms,
                }));
            }
        }
    }
    let total = results.len();
    println!(
        "kernel-test: {} of {} checks passed ({} failed) in {:.1} s; every byte of both buffers compared (guards included)",
        total - failures,
        total,
        failures,
        t_all.elapsed().as_secs_f64()
    );
    if let Some(p) = json_path {
        let doc = json!({ "gpu": gpu.info(), "seed": seed, "checks": results, "failed": failures });
        std::fs::write(&p, serde_json::to_string_pretty(&doc).unwrap_or_default())
            .map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    if failures > 0 {
        return Err(format!("{failures} kernel-test checks failed"));
    }
    Ok(())
}

// ----------------------------------------------------------- kernel-bench

struct Events {
    start: sys::CUevent,
    end: sys::CUevent,
}

impl Events {
    fn new() -> AnyResult<Self> {
        let f = sys::CUevent_flags::CU_EVENT_DEFAULT;
        Ok(Self {
            start: result::event::create(f).map_err(|e| format!("cuEventCreate: {e}"))?,
            end: result::event::create(f).map_err(|e| format!("cuEventCreate: {e}"))?,
        })
    }
    /// Device milliseconds of whatever `work` enqueues on `stream`.
    fn time(
        &self,
        stream: sys::CUstream,
        mut work: impl FnMut() -> Result<(), CudaError>,
    ) -> AnyResult<f64> {
        // SAFETY: live events and stream.
        unsafe {
            result::event::record(self.start, stream).map_err(|e| format!("cuEventRecord: {e}"))?;
            work().map_err(e2s)?;
            result::event::record(self.end, stream).map_err(|e| format!("cuEventRecord: {e}"))?;
            result::event::synchronize(self.end).map_err(|e| format!("cuEventSynchronize: {e}"))?;
            Ok(f64::from(
                result::event::elapsed(self.start, self.end)
                    .map_err(|e| format!("cuEventElapsedTime: {e}"))?,
            ))
        }
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        // SAFETY: created in new, destroyed once.
        unsafe {
            let _ = result::event::destroy(self.start);
            let _ = result::event::destroy(self.end);
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

/// Median per-launch device ms of `iters` back-to-back launches, `reps` samples.
fn time_repeated(
    ev: &Events,
    stream: sys::CUstream,
    iters: usize,
    reps: usize,
    mut once: impl FnMut() -> Result<(), CudaError>,
) -> AnyResult<f64> {
    once().map_err(e2s)?; // warm-up
    let mut samples = Vec::new();
    for _ in 0..reps {
        let ms = ev.time(stream, || {
            for _ in 0..iters {
                once()?;
            }
            Ok(())
        })?;
        samples.push(ms / iters as f64);
    }
    Ok(median(samples))
}

struct BenchCase {
    name: String,
    /// Runs with `addr` relative to the user pool, region offsets from 0.
    runs: Vec<ScatterRun>,
    bytes: u64,
    descriptors: u64,
}

fn random_slots(rng: &mut Rng, n: u64, slot: u64, pool_slots: u64) -> Vec<ScatterRun> {
    let mut slots: Vec<u64> = (0..pool_slots).collect();
    rng.shuffle(&mut slots);
    (0..n)
        .map(|i| ScatterRun {
            region_offset: i * slot,
            addr: slots[i as usize] * slot,
            segment_len: slot,
            count: 1,
            region_stride: 0,
            addr_stride: 0,
        })
        .collect()
}

fn bench_cases(rng: &mut Rng, pool_bytes: u64) -> Vec<BenchCase> {
    let mut v = Vec::new();
    for kib in [4u64, 8, 16, 64] {
        let slot = kib * 1024;
        let n = 16_384;
        v.push(BenchCase {
            name: format!("16384 x {kib} KiB random slots"),
            runs: random_slots(rng, n, slot, pool_bytes / slot),
            bytes: n * slot,
            descriptors: n,
        });
    }
    let slot = 1 << 20;
    v.push(BenchCase {
        name: "1 GiB: 1024 x 1 MiB random slots".into(),
        runs: random_slots(rng, 1024, slot, pool_bytes / slot),
        bytes: 1 << 30,
        descriptors: 1024,
    });
    // Coalesced: one run, expanded on the device (16,384 x 4 KiB, user
    // stride 8 KiB as in a K/V-interleaved pool).
    v.push(BenchCase {
        name: "coalesced run 16384 x 4 KiB stride 8 KiB".into(),
        runs: vec![ScatterRun {
            region_offset: 0,
            addr: 4096,
            segment_len: 4096,
            count: 16_384,
            region_stride: 4096,
            addr_stride: 8192,
        }],
        bytes: 16_384 * 4096,
        descriptors: 16_384,
    });
    v
}

fn gbps(bytes: u64, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
}

#[allow(clippy::too_many_lines)]
fn kernel_bench(
    gpu: &Arc<CudaGpu>,
    iters: usize,
    reps: usize,
    sweep: bool,
    seed: u64,
    json_path: Option<PathBuf>,
) -> AnyResult<()> {
    let info = gpu.info().clone();
    println!(
        "GPU {} (sm_{}{}, {} SMs), driver {}, NVRTC {:?}, {}; {} launches x {} samples, median",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.sm_count,
        info.driver_version,
        info.nvrtc_version,
        kernels_line(&info),
        iters,
        reps
    );
    let pool_bytes: u64 = 2 << 30;
    let user = CudaArena::new(gpu, pool_bytes as usize).map_err(e2s)?;
    let region = CudaArena::new(gpu, 1 << 30).map_err(e2s)?;
    // Random contents (never time on zeros).
    let mut rng = Rng(seed);
    let mut chunk = vec![0u8; 64 << 20];
    for off in (0..pool_bytes as usize).step_by(chunk.len()) {
        rng.fill(&mut chunk);
        user.upload(off, &chunk).map_err(e2s)?;
    }
    for off in (0..region.len()).step_by(chunk.len()) {
        rng.fill(&mut chunk);
        region.upload(off, &chunk).map_err(e2s)?;
    }
    drop(chunk);

    let base_cfg = CudaCopyConfig::default();
    let engine = CudaCopyEngine::new(gpu, base_cfg).map_err(e2s)?;
    let has_batch = cuda::has_batched_memcpy();
    let ev = Events::new()?;
    let mut ctx: ExecCtx = engine.acquire();
    let stream = ctx.stream();
    let mut rows = Vec::new();
    let mut table = Vec::new();
    let mut sweep_table = Vec::new();

    for case in bench_cases(&mut rng, pool_bytes) {
        let runs = rebase(&case.runs, user.base_addr());
        let rbase = region.base_addr();
        // Verify once that the kernel moves what we time (gather, pinned plan).
        {
            let plan = ctx
                .prepare(&base_cfg, Direction::Gather, rbase, &runs)
                .map_err(e2s)?;
            ctx.launch(&base_cfg, &plan).map_err(e2s)?;
            ctx.synchronize().map_err(e2s)?;
            let mut got = vec![0u8; case.bytes as usize];
            region.download(0, &mut got).map_err(e2s)?;
            let mut want = vec![0u8; case.bytes as usize];
            for r in &case.runs {
                for (off, addr, len) in r.segments() {
                    let (o, len) = (off as usize, len as usize);
                    user.download(addr as usize, &mut want[o..o + len])
                        .map_err(e2s)?;
                }
            }
            if got != want {
                return Err(format!(
                    "{}: gather result differs from the source",
                    case.name
                ));
            }
        }
        for dir in [Direction::Gather, Direction::Scatter] {
            // Contiguous DtoD memcpy of the same bytes (region <-> a
            // contiguous part of the pool).
            let (dst, src) = match dir {
                Direction::Gather => (rbase, user.base_addr()),
                Direction::Scatter => (user.base_addr(), rbase),
            };
            let memcpy_ms = time_repeated(&ev, stream, iters, reps, || {
                // SAFETY: both ranges lie inside their allocations.
                let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, case.bytes as usize, stream) };
                r.result().map_err(|e| CudaError::Driver {
                    op: "cuMemcpyDtoDAsync",
                    msg: format!("{e:?}"),
                })
            })?;

            let mut kernel = |cfg: CudaCopyConfig| -> AnyResult<(f64, u32)> {
                let plan = ctx.prepare(&cfg, dir, rbase, &runs).map_err(e2s)?;
                ctx.synchronize().map_err(e2s)?;
                let tasks = plan.tasks();
                let ms = time_repeated(&ev, stream, iters, reps, || ctx.launch(&cfg, &plan))?;
                Ok((ms, tasks))
            };
            let (k_pinned, tasks) = kernel(base_cfg)?;
            let (k_device, _) = kernel(CudaCopyConfig {
                plan_source: PlanSource::Device,
                ..base_cfg
            })?;
            let mut sweep_rows = Vec::new();
            if sweep {
                for occ in [false, true] {
                    for threads in [128u32, 256, 512] {
                        if occ && threads > 256 {
                            continue;
                        }
                        for bps in [0u32, 4, 16] {
                            for piece in [8u64 << 10, 32 << 10, 128 << 10] {
                                let cfg = CudaCopyConfig {
                                    threads_per_block: threads,
                                    blocks_per_sm: bps,
                                    piece_bytes: piece,
                                    high_occupancy: occ,
                                    ..base_cfg
                                };
                                match kernel(cfg) {
                                    Ok((ms, _)) => sweep_rows.push(json!({
                                        "occ": occ, "threads": threads, "blocks_per_sm": bps,
                                        "piece_bytes": piece, "ms": ms, "gbps": gbps(case.bytes, ms),
                                        "pct_of_memcpy": 100.0 * memcpy_ms / ms,
                                    })),
                                    Err(e) => sweep_rows.push(json!({
                                        "occ": occ, "threads": threads, "blocks_per_sm": bps,
                                        "piece_bytes": piece, "error": e,
                                    })),
                                }
                            }
                        }
                    }
                }
            }
            if let Some(best) =
                sweep_rows
                    .iter()
                    .filter(|r| r.get("ms").is_some())
                    .min_by(|a, b| {
                        a["ms"]
                            .as_f64()
                            .unwrap_or(f64::MAX)
                            .total_cmp(&b["ms"].as_f64().unwrap_or(f64::MAX))
                    })
            {
                sweep_table.push(format!(
                    "| {:<42} | {:<7} | {:<5} | {:>4} | {:>3} | {:>4} KiB | {:>8.1} | {:>5.1}% |",
                    case.name,
                    format!("{dir:?}"),
                    best["occ"],
                    best["threads"],
                    best["blocks_per_sm"],
                    best["piece_bytes"].as_u64().unwrap_or(0) / 1024,
                    best["gbps"].as_f64().unwrap_or(0.0),
                    best["pct_of_memcpy"].as_f64().unwrap_or(0.0),
                ));
            }
            // The engine call as the copy workers make it: plan build, plan
            // upload (none: zero-copy), launch, event, wait (host clock).
            let mut walls = Vec::new();
            for i in 0..(iters * reps).min(64) + 1 {
                let t0 = Instant::now();
                engine.run(dir, rbase, &runs).map_err(e2s)?;
                if i > 0 {
                    walls.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            let engine_wall = median(walls);
            // Per-descriptor memcpy (host-bound): one sample = one plan.
            let per_desc_reps = if case.descriptors > 2000 { 3 } else { reps };
            let mut pd = Vec::new();
            for _ in 0..per_desc_reps {
                pd.push(ev.time(stream, || ctx.memcpy_per_segment(dir, rbase, &runs))?);
            }
            let per_desc = median(pd);
            let batched = if has_batch {
                let mut b = Vec::new();
                let mut host = Vec::new();
                ctx.memcpy_batched(dir, rbase, &runs).map_err(e2s)?; // warm-up
                for _ in 0..reps {
                    let t0 = Instant::now();
                    b.push(ev.time(stream, || ctx.memcpy_batched(dir, rbase, &runs))?);
                    host.push(t0.elapsed().as_secs_f64() * 1e3);
                }
                Some((median(b), median(host)))
            } else {
                None
            };
            let pct = 100.0 * memcpy_ms / k_pinned;
            table.push(format!(
                "| {:<42} | {:<7} | {:>8.1} | {:>8.1} ({:>5.1}%) | {:>8.1} ({:>5.1}%) | {:>8.3} | {:>8.2} | {:>10} |",
                case.name,
                format!("{dir:?}"),
                gbps(case.bytes, memcpy_ms),
                gbps(case.bytes, k_pinned),
                pct,
                gbps(case.bytes, k_device),
                100.0 * memcpy_ms / k_device,
                engine_wall,
                per_desc,
                batched.map_or("n/a".to_string(), |(ms, _)| format!("{ms:.3}")),
            ));
            rows.push(json!({
                "case": case.name, "direction": format!("{dir:?}"), "bytes": case.bytes,
                "descriptors": case.descriptors, "runs": case.runs.len(), "kernel_tasks": tasks,
                "memcpy_contiguous_ms": memcpy_ms, "memcpy_contiguous_gbps": gbps(case.bytes, memcpy_ms),
                "kernel_pinned_plan_ms": k_pinned, "kernel_pinned_plan_gbps": gbps(case.bytes, k_pinned),
                "kernel_pinned_pct_of_memcpy": pct,
                "kernel_device_plan_ms": k_device, "kernel_device_plan_gbps": gbps(case.bytes, k_device),
                "kernel_device_pct_of_memcpy": 100.0 * memcpy_ms / k_device,
                "engine_call_wall_ms": engine_wall,
                "per_descriptor_memcpy_ms": per_desc, "per_descriptor_memcpy_gbps": gbps(case.bytes, per_desc),
                "batched_memcpy_ms": batched.map(|b| b.0), "batched_memcpy_host_ms": batched.map(|b| b.1),
                "batched_memcpy_gbps": batched.map(|b| gbps(case.bytes, b.0)),
                "kernel_speedup_vs_per_descriptor": per_desc / k_pinned,
                "kernel_speedup_vs_batched": batched.map(|b| b.0 / k_pinned),
                "sweep": sweep_rows,
            }));
        }
    }
    engine.release(ctx);
    println!();
    println!("GB/s = payload bytes / time (each byte read once and written once). Kernel: a warp per task, {} threads/block, blocks/SM {} (0 = not persistent), {} KiB tasks.", base_cfg.threads_per_block, base_cfg.blocks_per_sm, base_cfg.piece_bytes / 1024);
    println!("| case                                       | dir     | memcpy GB/s | kernel pinned-plan GB/s (% memcpy) | kernel device-plan GB/s (%) | engine call ms | per-desc memcpy ms | batched memcpy ms |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for t in &table {
        println!("{t}");
    }
    if !sweep_table.is_empty() {
        println!();
        println!("Best kernel configuration per case (sweep; occ = 32-register build; blocks/SM 0 = not persistent):");
        println!("| case                                       | dir     | occ | thr | b/SM | task | GB/s | % memcpy |");
        println!("|---|---|---|---:|---:|---:|---:|---:|");
        for t in &sweep_table {
            println!("{t}");
        }
    }
    if let Some(p) = json_path {
        let doc = json!({
            "gpu": info, "iters": iters, "reps": reps, "config": {
                "threads_per_block": base_cfg.threads_per_block, "blocks_per_sm": base_cfg.blocks_per_sm,
                "piece_bytes": base_cfg.piece_bytes,
            },
            "batched_memcpy_available": has_batch, "rows": rows,
        });
        std::fs::write(&p, serde_json::to_string_pretty(&doc).unwrap_or_default())
            .map_err(|e| format!("writing {}: {e}", p.display()))?;
        println!("wrote {}", p.display());
    }
    Ok(())
}

// ------------------------------------------------------------ vram-bench

/// `vram-bench` options.
#[derive(clap::Args)]
struct VramArgs {
    /// Bytes per transfer (e.g. 64M).
    #[arg(long, default_value = "64M")]
    total: String,
    /// Descriptor size (e.g. 4K).
    #[arg(long, default_value = "4K")]
    block: String,
    /// The receiver's GPU (default: the sender's).
    #[arg(long)]
    peer_device: Option<usize>,
    /// Bounce max chunk sizes to run, comma-separated (one receiver
    /// process each; the first also runs the other two paths).
    #[arg(long, default_value = "4M")]
    chunks: String,
    /// Bounce arena size of both agents [default: KVFABRIC_BOUNCE_ARENA_SIZE_BYTES, else 256M].
    #[arg(long)]
    arena: Option<String>,
    /// Per-request in-flight chunk cap W [default: KVFABRIC_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST, else 8].
    #[arg(long)]
    inflight: Option<u32>,
    /// Timed iterations per path (after one warm-up).
    #[arg(long, default_value_t = 7)]
    iterations: usize,
    /// Skip the standard per-descriptor path.
    #[arg(long)]
    skip_standard: bool,
    /// Send per-descriptor scatter runs (no run merging; in random slots
    /// the merge pass only finds strided pairs, ≈37% fewer runs, at about
    /// twice the planning cost). Also on with
    /// KVFABRIC_BOUNCE_DISABLE_SCATTER_RUN_MERGING.
    #[arg(long)]
    no_merge: bool,
    /// Copy worker threads per agent (seed `scatterWorkerCount`; the exec
    /// pool gets at least as many streams): chunks are planned and copied
    /// on these in parallel [default: KVFABRIC_BOUNCE_SCATTER_WORKER_COUNT, else 4].
    #[arg(long)]
    workers: Option<u32>,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn bytes_arg(what: &str, s: &str) -> AnyResult<u64> {
    parse_byte_size(s.trim()).map_err(|e| format!("--{what} {s:?}: {e}"))
}

fn vram_bench(gpu: &Arc<CudaGpu>, device: usize, a: &VramArgs) -> AnyResult<()> {
    let total = bytes_arg("total", &a.total)?;
    let block = bytes_arg("block", &a.block)?;
    let peer_device = a.peer_device.unwrap_or(device);
    // KVFABRIC_BOUNCE_* (e.g. CONTROL_TRANSPORT, IO_BUSY_POLL_US) under the
    // flags; the receiver process gets the result.
    let (base, warnings) = BounceConfig::from_env();
    for w in warnings {
        eprintln!("warning: {w}");
    }
    let arena = match &a.arena {
        Some(s) => ByteSize(bytes_arg("arena", s)?),
        None => base.arena_size_bytes,
    };
    let inflight = a.inflight.unwrap_or(base.max_inflight_chunks_per_request);
    let workers = a.workers.unwrap_or(base.scatter_worker_count);
    let mut configs = Vec::new();
    for c in a.chunks.split(',').filter(|c| !c.trim().is_empty()) {
        let chunk = bytes_arg("chunks", c)?;
        let cfg = BounceConfig {
            enabled: true,
            arena_size_bytes: arena,
            max_chunk_size_bytes: ByteSize(chunk),
            max_inflight_chunks_per_request: inflight,
            disable_scatter_run_merging: a.no_merge || base.disable_scatter_run_merging,
            scatter_worker_count: workers,
            copy_stream_count: workers.max(base.copy_stream_count),
            ..base.clone()
        };
        cfg.validate().map_err(|e| format!("chunk {c}: {e}"))?;
        configs.push(cfg);
    }
    if configs.is_empty() {
        return Err("--chunks names no size".into());
    }
    let mut p2p = None;
    if peer_device != device {
        let (mut can, mut back) = (0, 0);
        // SAFETY: out-pointers to locals; ordinals are device handles
        // (CUdevice is the ordinal).
        unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, device as i32, peer_device as i32);
            sys::cuDeviceCanAccessPeer(&mut back, peer_device as i32, device as i32);
        }
        println!(
            "peer access GPU {device} -> GPU {}: {}, back: {}",
            peer_device,
            can != 0,
            back != 0
        );
        p2p = Some(can != 0 && back != 0);
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // UCX prints the transports it picks at info level and its protocol
    // choices with PROTO_INFO; the tap reads them back (before any NIXL
    // agent exists, so UCX reads these settings).
    for (k, v) in [("UCX_LOG_LEVEL", "info"), ("UCX_PROTO_INFO", "y")] {
        if std::env::var_os(k).is_none() {
            std::env::set_var(k, v);
        }
    }
    let tap = match tap::OutputTap::start() {
        Ok(t) => Some(t),
        Err(e) => {
            eprintln!("warning: no transport report ({e})");
            None
        }
    };
    let opts = VramOptions {
        total_bytes: total,
        block_bytes: block,
        iterations: a.iterations,
        configs,
        device,
        peer_device,
        copy: CudaCopyConfig::default(),
        skip_standard: a.skip_standard,
    };
    let out = vram::run(&exe, gpu, &opts);
    let report_tp = tap.map(tap::OutputTap::finish);
    let report = out?;
    println!("{}", report.table());
    if let Some(t) = &report_tp {
        println!("{}", t.summary());
    }
    if let Some(p) = &a.json {
        let j = json!({
            "bench": "vram-bench",
            "report": report,
            "peer_access": p2p,
            "transport": report_tp,
        });
        std::fs::write(p, serde_json::to_string_pretty(&j).unwrap_or_default())
            .map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    Ok(())
}

/// Reads the process's own stdout/stderr back (and forwards it), to find
/// which UCX transports carried the transfers: the silent-fallback guard.
mod tap {
    use std::fs::File;
    use std::io::{BufRead, BufReader, Write};
    use std::os::fd::FromRawFd;
    use std::sync::{Arc, Mutex};
    use std::thread::JoinHandle;
    use std::time::Duration;

    /// What the tap saw: UCX's endpoint configurations (info log) and its
    /// protocol selections (`UCX_PROTO_INFO`), split into the data path
    /// (operations from GPU memory, what the transfers use) and the rest.
    #[derive(Clone, Debug, Default, serde::Serialize)]
    pub struct TransportReport {
        /// Protocol selections for operations from GPU memory:
        /// "operation: range description config" (deduplicated).
        pub data_path: Vec<String>,
        /// UCX endpoint configuration lines (`… cfg#N rma(…) am(…)`), first 20.
        pub endpoint_configs: Vec<String>,
        /// A GPU-sourced operation used `cuda_ipc`.
        pub cuda_ipc: bool,
        /// A GPU-sourced operation used software emulation (silent fallback).
        pub software_emulation: bool,
        /// A GPU-sourced operation used TCP.
        pub tcp: bool,
        /// Selections with software emulation for other operations (host
        /// memory sources, e.g. put from host to GPU: not used here).
        pub other_emulation: usize,
        /// Lines read in all.
        pub lines_seen: usize,
        /// The table header being read, per UCX line tag (`[host:pid:thread]`):
        /// tables of several processes and threads interleave in the pipe.
        #[serde(skip)]
        current: std::collections::HashMap<String, String>,
    }

    impl TransportReport {
        /// A short human summary with warnings.
        pub fn summary(&self) -> String {
            let mut s = format!(
                "transport report (GPU-sourced data path): cuda_ipc={} software_emulation={} tcp={}; other ops with software emulation: {}",
                self.cuda_ipc, self.software_emulation, self.tcp, self.other_emulation
            );
            for d in &self.data_path {
                s += &format!("\n  {d}");
            }
            if self.data_path.is_empty() {
                s += "\nWARNING: UCX reported no protocol for writes from GPU memory (set UCX_PROTO_INFO=y)";
            }
            if self.software_emulation {
                s += "\nWARNING: GPU writes used UCX software emulation (silent fallback)";
            }
            if self.tcp {
                s += "\nWARNING: GPU writes used TCP";
            }
            if !self.data_path.is_empty() && !self.cuda_ipc {
                s += "\nWARNING: GPU writes did not use cuda_ipc";
            }
            s
        }

        fn scan(&mut self, line: &str) {
            self.lines_seen += 1;
            let l = line.to_ascii_lowercase();
            if l.contains("ucx  info") && l.contains("cfg#") {
                if self.endpoint_configs.len() < 20 {
                    let at = line.find("UCX").unwrap_or(0);
                    self.endpoint_configs
                        .push(line[at..].trim_end().to_string());
                }
                return;
            }
            let Some(bar) = line.find('|') else {
                return;
            };
            let cells: Vec<&str> = line[bar..]
                .split('|')
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .collect();
            // `[timestamp] [host:pid :thread]   | … |`: the second bracket.
            let tag = line[..bar]
                .split(']')
                .nth(1)
                .map(|t| t.trim().to_string())
                .unwrap_or_default();
            if cells.len() == 1 && cells[0].contains(" by ucp_") {
                self.current.insert(tag, cells[0].to_string());
                return;
            }
            let Some(op) = self.current.get(&tag) else {
                return;
            };
            if cells.len() != 3 || !cells[0].contains("..") && cells[0].parse::<u64>().is_err() {
                return;
            }
            let (desc, cfg) = (cells[1].to_ascii_lowercase(), cells[2].to_ascii_lowercase());
            let emulation = desc.contains("emulation");
            if !op.contains("from cuda") {
                self.other_emulation += usize::from(emulation);
                return;
            }
            self.cuda_ipc |= cfg.contains("cuda_ipc");
            self.software_emulation |= emulation;
            self.tcp |= cfg.contains("tcp");
            let entry = format!("{op}: {} {} {}", cells[0], cells[1], cells[2]);
            if !self.data_path.contains(&entry) {
                self.data_path.push(entry);
            }
        }
    }

    /// fds 1 and 2 redirected into a pipe; a thread forwards every line to
    /// the original stdout and scans it.
    pub struct OutputTap {
        orig: i32,
        report: Arc<Mutex<TransportReport>>,
        thread: Option<JoinHandle<()>>,
    }

    impl OutputTap {
        /// Starts the tap (children spawned later inherit the pipe as
        /// their stderr).
        pub fn start() -> Result<Self, String> {
            let mut fds = [0i32; 2];
            // SAFETY: plain fd calls on fds this process owns.
            let orig = unsafe {
                if libc::pipe(fds.as_mut_ptr()) != 0 {
                    return Err(format!("pipe: {}", std::io::Error::last_os_error()));
                }
                let orig = libc::dup(1);
                if orig < 0 || libc::dup2(fds[1], 1) < 0 || libc::dup2(fds[1], 2) < 0 {
                    return Err(format!("dup2: {}", std::io::Error::last_os_error()));
                }
                libc::close(fds[1]);
                orig
            };
            // SAFETY: fds[0] is ours and moved into the File; orig stays
            // open until `finish` (this dup is closed by the File below).
            let (read, mut out) = unsafe {
                (
                    File::from_raw_fd(fds[0]),
                    File::from_raw_fd(libc::dup(orig)),
                )
            };
            let report = Arc::new(Mutex::new(TransportReport::default()));
            let r = report.clone();
            let thread = std::thread::Builder::new()
                .name("output-tap".into())
                .spawn(move || {
                    let mut reader = BufReader::new(read);
                    let mut buf = Vec::new();
                    while reader.read_until(b'\n', &mut buf).unwrap_or(0) > 0 {
                        let _ = out.write_all(&buf);
                        let line = String::from_utf8_lossy(&buf);
                        r.lock().unwrap_or_else(|p| p.into_inner()).scan(&line);
                        buf.clear();
                    }
                    let _ = out.flush();
                })
                .map_err(|e| e.to_string())?;
            Ok(Self {
                orig,
                report,
                thread: Some(thread),
            })
        }

        /// Restores stdout/stderr, drains the pipe (≤ 2 s) and returns what
        /// was seen.
        pub fn finish(mut self) -> TransportReport {
            let _ = std::io::stdout().flush();
            let _ = std::io::stderr().flush();
            // SAFETY: restoring fds 1 and 2 from the saved original closes
            // this process's write ends of the pipe.
            unsafe {
                libc::dup2(self.orig, 1);
                libc::dup2(self.orig, 2);
                libc::close(self.orig);
            }
            if let Some(t) = self.thread.take() {
                let deadline = std::time::Instant::now() + Duration::from_secs(2);
                while !t.is_finished() && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if t.is_finished() {
                    let _ = t.join();
                }
            }
            let r = self
                .report
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            r
        }
    }

    #[cfg(test)]
    mod tests {
        use super::TransportReport;

        #[test]
        fn scan_splits_gpu_data_path_from_other_ops() {
            // Lines as UCX 1.x printed them on the H200 (vram-bench run).
            let log = "\
[1.1] [vm:573  :0]      ucp_worker.c:1997 UCX  INFO    vram-bench-573-0 intra-node cfg#2 rma_am(tcp/lo)  device(cuda_ipc/cuda)  am(tcp/lo cma/memory cuda_ipc/cuda)  ka(tcp/lo)
[1.2] [vm:573  :0]   +--------+--------------------+-----------------------------------+
[1.2] [vm:573  :0]   | vram-bench-573-0 intra-node cfg#2                               |
[1.2] [vm:573  :0]   | remote memory write by ucp_put* from host memory to cuda/dev[2] |
[1.2] [vm:573  :0]   +--------+--------------------+-----------------------------------+
[1.2] [vm:573  :0]   | Range  |    Description     |              Config               |
[1.2] [vm:573  :0]   | 0..inf | software emulation | tcp/lo                            |
[1.3] [vm:573  :1]   | remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[2] |
[1.3] [vm:573  :1]   | Range  | Description |                    Config                     |
[1.3] [vm:584  :0]   | 0..8184 | short       | tcp/lo                                 |
[1.3] [vm:573  :1]   | 0..inf | zero-copy   | cuda_ipc/cuda                                 |
";
            let mut r = TransportReport::default();
            for l in log.lines() {
                r.scan(l);
            }
            assert_eq!(r.endpoint_configs.len(), 1);
            assert_eq!(r.other_emulation, 1);
            assert!(r.cuda_ipc && !r.software_emulation && !r.tcp);
            assert_eq!(
                r.data_path,
                vec!["remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[2]: 0..inf zero-copy cuda_ipc/cuda"]
            );
            let mut bad = TransportReport::default();
            for l in log
                .replace("zero-copy   | cuda_ipc/cuda", "software emulation | tcp/lo")
                .lines()
            {
                bad.scan(l);
            }
            assert!(bad.software_emulation && bad.tcp && !bad.cuda_ipc);
            assert!(bad
                .summary()
                .contains("WARNING: GPU writes used UCX software emulation"));
        }
    }
}
