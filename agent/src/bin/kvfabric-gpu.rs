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
//! * `kvfabric-gpu direct-bench` — the same-node direct path's block-copy
//!   kernels alone (CUDA events, ids already on the device) against a
//!   contiguous device-to-device memcpy of the same bytes, every result
//!   checked byte for byte (issue 19).
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

use clap::{Parser, Subcommand};
use kvfabric_agent::bench::cli::{
    bench_path, byte_size, concurrency, model_preset, nonzero_byte_size,
};
use kvfabric_agent::bench::direct;
use kvfabric_agent::bench::floor;
use kvfabric_agent::bench::gpu_kernel;
use kvfabric_agent::bench::gpu_trace::{self, GpuBenchArgs};
use kvfabric_agent::bench::trace::BenchPath;
use kvfabric_agent::bench::vram::{self, VramBenchArgs};
use kvfabric_agent::bench_args::ArrivalArgs;
use kvfabric_agent::core::model::ModelGeometry;
use kvfabric_agent::runtime::cuda::{self, CudaCopyConfig, CudaGpu};

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
        #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(i32).range(10..=999))]
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
        /// Launches per timed sample (at least 1).
        #[arg(long, default_value_t = 20, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
        iters: usize,
        /// Timed samples (the median is reported; at least 1).
        #[arg(long, default_value_t = 9, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
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
    /// The direct path's block-copy kernels alone vs a contiguous DtoD
    /// memcpy of the same bytes (CUDA events), checked byte for byte.
    DirectBench {
        /// Samples per row (p50/p90/min; as many again back to back).
        #[arg(long, default_value_t = 200, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
        reps: usize,
        /// Add a 1 GiB case (needs ≈ 5 GiB of GPU memory and 7 GiB of host memory).
        #[arg(long)]
        big: bool,
        /// RNG seed.
        #[arg(long, default_value_t = 19)]
        seed: u64,
        /// Write the JSON report here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// One GPU's floor for a bounce transfer: its three HBM passes
    /// (gather, staging copy, scatter) alone, serial and pipelined, beside
    /// one contiguous copy of the same bytes (CUDA events, no protocol),
    /// checked byte for byte.
    FloorBench {
        /// Bytes per transfer.
        #[arg(long, default_value = "64MiB", value_parser = nonzero_byte_size)]
        total: u64,
        /// Piece (descriptor) size.
        #[arg(long, default_value = "4KiB", value_parser = nonzero_byte_size)]
        block: u64,
        /// Chunk sizes of the pipelined rows, comma-separated.
        #[arg(long, default_value = "4MiB,16MiB", value_delimiter = ',', value_parser = nonzero_byte_size)]
        chunks: Vec<u64>,
        /// Samples per row.
        #[arg(long, default_value_t = 50, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000))]
        reps: usize,
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
        /// JSONL trace (Mooncake format); required unless --fixed-prompt.
        #[arg(long, required_unless_present = "fixed_prompt")]
        trace: Option<PathBuf>,
        /// First trace line (0-based).
        #[arg(long, default_value_t = 0)]
        start: usize,
        /// Requests to replay (at least 1; with --fixed-prompt: synthetic
        /// requests, at most 10,000,000).
        #[arg(long, default_value_t = 500, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        requests: usize,
        /// --fixed-prompt, --speed, --rate, --seed, --warmup (shared with `kvfabric bench`).
        #[command(flatten)]
        arrival: ArrivalArgs,
        /// Requests in flight (1 to 4096): closed loop, the number in
        /// flight; with --speed or --rate, the most in flight (a request
        /// due while all are busy waits, and its latency counts from its
        /// arrival).
        #[arg(long, default_value_t = 128, value_parser = concurrency)]
        concurrency: usize,
        /// Model preset (Llama-3.1-8B, Llama-3.1-70B, Qwen2.5-7B, gpt-oss-120b).
        #[arg(long, default_value = "Llama-3.1-8B", value_parser = model_preset)]
        model: ModelGeometry,
        /// Tensor-parallel degree (KV heads per rank = heads / tp).
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
        tp: u32,
        /// Tokens per KV block.
        #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
        block: u32,
        /// Bytes of each KV pool (suffixes accepted).
        #[arg(long, default_value = "32GiB", value_parser = nonzero_byte_size)]
        pool: u64,
        /// The decode agent's GPU (default: --device).
        #[arg(long)]
        peer_device: Option<usize>,
        /// Paths, comma-separated (bounce, standard).
        #[arg(long, default_value = "bounce,standard", value_delimiter = ',', value_parser = bench_path)]
        paths: Vec<BenchPath>,
        /// Fill and verify every Nth request (1 = all, the default). The
        /// fill and the byte check run on the GPUs beside the transfers
        /// and the checks go one at a time through the decode process, so
        /// at high rates they cap the closed loop; N > 1 measures the
        /// fabric with a sample verified (the others move whatever the
        /// source blocks hold).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        verify_every: u64,
        /// Write the JSON report here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Trace every bounce request's stages (gathered, write posted,
        /// DATA, ACK) and print where the time of the median and of the
        /// slowest 1 % went (also under "timeline" in the JSON report).
        #[arg(long)]
        timeline: bool,
    },
    /// The receiver process of `vram-bench` (internal).
    #[command(hide = true)]
    VramPeer {
        /// Directory for the descriptor file.
        #[arg(long)]
        dir: PathBuf,
        /// GPU pool size (bytes).
        #[arg(long, value_parser = nonzero_byte_size)]
        pool_bytes: u64,
    },
}

/// `vram-bench` options.
#[derive(clap::Args)]
struct VramArgs {
    /// Bytes per transfer (e.g. 64M).
    #[arg(long, default_value = "64M", value_parser = nonzero_byte_size)]
    total: u64,
    /// Descriptor size (e.g. 4K; at most --total).
    #[arg(long, default_value = "4K", value_parser = nonzero_byte_size)]
    block: u64,
    /// The receiver's GPU (default: the sender's).
    #[arg(long)]
    peer_device: Option<usize>,
    /// Bounce max chunk sizes to run, comma-separated (one receiver
    /// process each; the first also runs the other two paths)
    /// [default: KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES, else 64M: what an
    /// agent uses]. A lone request is cut into solo chunks when the size
    /// is larger than KVFABRIC_SOLO_CHUNK_BYTES (32 MiB by default): set
    /// that to 0 to measure the size named here.
    #[arg(long, value_delimiter = ',', value_parser = byte_size)]
    chunks: Vec<u64>,
    /// Bounce arena size of both agents [default: KVFABRIC_BOUNCE_ARENA_SIZE_BYTES, else 512M].
    #[arg(long, value_parser = nonzero_byte_size)]
    arena: Option<u64>,
    /// Per-request in-flight chunk cap W [default: KVFABRIC_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST, else 8].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    inflight: Option<u32>,
    /// Timed iterations per path (after one warm-up; at least 1).
    #[arg(long, default_value_t = 7, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    iterations: usize,
    /// Skip the standard per-descriptor path.
    #[arg(long)]
    skip_standard: bool,
    /// Lay the destinations out as this many planes of the same random
    /// blocks, as a block hand-off into a layer-major pool does (layers ×
    /// K/V; agents that both take DATA_BLOCKS then name a chunk's pieces
    /// by block); 1: random slots in one plane. Must divide the
    /// descriptor count (--total / --block).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    planes: usize,
    /// Send per-descriptor scatter runs (no run merging; in random slots
    /// the merge pass only finds strided pairs, ≈37% fewer runs, at about
    /// twice the planning cost). Also on with
    /// KVFABRIC_BOUNCE_DISABLE_SCATTER_RUN_MERGING.
    #[arg(long)]
    no_merge: bool,
    /// Copy worker threads per agent (seed `scatterWorkerCount`; the exec
    /// pool gets at least as many streams): chunks are planned and copied
    /// on these in parallel [default: KVFABRIC_BOUNCE_SCATTER_WORKER_COUNT, else 4].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    workers: Option<u32>,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Where each iteration's payload is written and checked: `host`
    /// (filled on the host and uploaded; the receiver downloads and
    /// compares its whole pool — this evicts the CPU caches between
    /// timed transfers) or `device` (pattern kernels on both GPUs; no
    /// payload crosses the host).
    #[arg(long, value_enum, default_value = "host")]
    fill: CliFill,
}

/// `vram-bench --fill`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum CliFill {
    Host,
    Device,
}

fn main() -> ExitCode {
    kvfabric_agent::tune_allocator();
    kvfabric_agent::init_cli_logs();
    let cli = Cli::parse();
    let out = match cli.cmd {
        Cmd::Compile { arch, out } => gpu_kernel::compile(arch, out.as_deref()),
        cmd => run_on_gpu(cli.device, cmd),
    };
    match out {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The subcommands that need a GPU: without a CUDA driver or device they
/// print `SKIP: <reason>` and succeed.
fn run_on_gpu(device: usize, cmd: Cmd) -> Result<(), String> {
    if let Err(why) = cuda::probe() {
        println!("SKIP: {why}");
        return Ok(());
    }
    let gpu = CudaGpu::open(device).map_err(|e| format!("opening GPU {device}: {e}"))?;
    match cmd {
        Cmd::Info => {
            gpu_kernel::print_info(&gpu);
            Ok(())
        }
        Cmd::Compile { arch, out } => gpu_kernel::compile(arch, out.as_deref()),
        Cmd::KernelTest { seed, json } => gpu_kernel::kernel_test(&gpu, seed, json.as_deref()),
        Cmd::KernelBench {
            iters,
            reps,
            sweep,
            seed,
            json,
        } => gpu_kernel::kernel_bench(&gpu, iters, reps, sweep, seed, json.as_deref()),
        Cmd::DirectBench {
            reps,
            big,
            seed,
            json,
        } => direct::direct_bench(&gpu, reps, big, seed, json.as_deref()),
        Cmd::FloorBench {
            total,
            block,
            chunks,
            reps,
            json,
        } => floor::floor_bench(&gpu, total, block, &chunks, reps, json.as_deref()),
        Cmd::VramBench(a) => vram::run_cli(
            &gpu,
            device,
            &VramBenchArgs {
                total: a.total,
                block: a.block,
                peer_device: a.peer_device,
                chunks: a.chunks,
                arena: a.arena,
                inflight: a.inflight,
                iterations: a.iterations,
                skip_standard: a.skip_standard,
                planes: a.planes,
                no_merge: a.no_merge,
                workers: a.workers,
                json: a.json,
                fill: match a.fill {
                    CliFill::Host => vram::FillMode::Host,
                    CliFill::Device => vram::FillMode::Device,
                },
            },
        ),
        Cmd::Bench {
            trace,
            start,
            requests,
            arrival,
            concurrency,
            model,
            tp,
            block,
            pool,
            peer_device,
            paths,
            verify_every,
            json,
            timeline,
        } => {
            // The replay opens its GPUs itself.
            drop(gpu);
            gpu_trace::run_cli(&GpuBenchArgs {
                trace,
                start,
                requests,
                fixed_prompt: arrival.fixed_prompt,
                concurrency,
                arrivals: arrival.arrivals(),
                warmup: arrival.warmup,
                model,
                tp,
                block,
                pool_bytes: pool,
                device,
                peer_device: peer_device.unwrap_or(device),
                paths,
                verify_every,
                json,
                timeline,
            })
        }
        Cmd::VramPeer { dir, pool_bytes } => {
            vram::run_peer(&gpu, &dir, pool_bytes, CudaCopyConfig::default())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;
    use kvfabric_agent::bench::arrivals::{Arrivals, DEFAULT_SEED};

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn bad_values_are_usage_errors_naming_the_flag() {
        for (args, flag) in [
            (
                &["bench", "--trace", "t", "--requests", "0"][..],
                "--requests",
            ),
            (
                &["bench", "--trace", "t", "--concurrency", "0"],
                "--concurrency",
            ),
            (&["bench", "--trace", "t", "--pool", "0"], "--pool"),
            (&["bench", "--trace", "t", "--tp", "0"], "--tp"),
            (&["bench", "--trace", "t", "--model", "x"], "--model"),
            (&["bench", "--trace", "t", "--paths", "both"], "--paths"),
            (&["bench", "--trace", "t", "--speed", "0"], "--speed"),
            (&["bench", "--trace", "t", "--speed", "nan"], "--speed"),
            (&["bench", "--trace", "t", "--rate", "0"], "--rate"),
            (&["bench", "--trace", "t", "--rate=-2"], "--rate"),
            (&["bench", "--trace", "t", "--rate", "inf"], "--rate"),
            (
                &["bench", "--trace", "t", "--rate", "1", "--speed", "1"],
                "--speed",
            ),
            (&["bench", "--trace", "t", "--seed", "3"], "--rate"),
            (&["bench", "--fixed-prompt", "0"], "--fixed-prompt"),
            (
                &["bench", "--fixed-prompt", "8192", "--speed", "2"],
                "--speed",
            ),
            (
                &["bench", "--fixed-prompt", "8192", "--trace", "t"],
                "--trace",
            ),
            (&["bench", "--requests", "5"], "--trace"),
            (&["kernel-bench", "--iters", "0"], "--iters"),
            (&["vram-bench", "--block", "0"], "--block"),
            (&["vram-bench", "--chunks", "x"], "--chunks"),
            (&["vram-bench", "--iterations", "0"], "--iterations"),
        ] {
            let e =
                Cli::try_parse_from(std::iter::once("kvfabric-gpu").chain(args.iter().copied()))
                    .err()
                    .unwrap_or_else(|| panic!("{args:?} accepted"));
            assert_eq!(e.exit_code(), 2, "{e}");
            assert!(e.to_string().contains(flag), "{args:?}: {e}");
        }
    }

    fn bench(args: &[&str]) -> Cmd {
        Cli::try_parse_from(
            ["kvfabric-gpu", "bench"]
                .into_iter()
                .chain(args.iter().copied()),
        )
        .unwrap()
        .cmd
    }

    #[test]
    fn the_seed_shaped_open_loop_run_parses() {
        let Cmd::Bench {
            trace,
            arrival,
            requests,
            paths,
            ..
        } = bench(&[
            "--fixed-prompt",
            "8192",
            "--model",
            "gpt-oss-120b",
            "--tp",
            "4",
            "--rate",
            "13",
            "--requests",
            "500",
            "--paths",
            "bounce,standard",
        ])
        else {
            unreachable!()
        };
        assert_eq!(
            (trace, arrival.fixed_prompt, requests),
            (None, Some(8192), 500)
        );
        assert_eq!(
            arrival.arrivals(),
            Arrivals::Poisson {
                rate_per_s: 13.0,
                seed: DEFAULT_SEED
            }
        );
        assert_eq!(paths, [BenchPath::Bounce, BenchPath::Standard]);
        let Cmd::Bench { arrival, .. } = bench(&["--trace", "t", "--speed", "4"]) else {
            unreachable!()
        };
        assert_eq!(arrival.arrivals(), Arrivals::Trace { speed: 4.0 });
        let Cmd::Bench { arrival, .. } = bench(&["--trace", "t"]) else {
            unreachable!()
        };
        assert_eq!(arrival.arrivals(), Arrivals::Closed);
    }
}
