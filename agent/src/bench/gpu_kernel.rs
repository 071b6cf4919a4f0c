//! GPU kernel tests and benchmarks of `kvfabric-gpu` (feature `cuda`):
//!
//! * [`compile`] — compile `kernels/*.cu` with NVRTC only (no GPU needed)
//!   and report the cubin.
//! * [`print_info`] — the device, driver, NVRTC and kernel build.
//! * [`kernel_test`] — byte-exact gather/scatter tests of the kernel (both
//!   plan sources) and of the comparison paths: aligned and misaligned
//!   sources and destinations, zero-length descriptors, 1 B to 1 MiB,
//!   100,000 descriptors, coalesced runs with uniform strides; and the
//!   uniform gather / scatter (`CopyEngine::gather_uniform`,
//!   `scatter_uniform`: the `kvf_gather_srcs` / `kvf_scatter_dsts`
//!   kernels, or the run path they fall back to); every byte of both
//!   buffers is checked, so a write outside a target fails.
//! * [`kernel_bench`] — CUDA-event medians: 16,384 descriptors of
//!   4/8/16/64 KiB random slots and a 1 GiB memory-bound case, gather and
//!   scatter, against a contiguous device-to-device memcpy of the same
//!   bytes, per-descriptor memcpy and the driver's batched memcpy.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys};
use serde_json::json;

use crate::core::plan::BlockPlanes;
use crate::core::{BlockScatter, Descriptor, ScatterRun, UniformScatter};
use crate::runtime::cuda::{
    self, CopyPath, CudaArena, CudaCopyConfig, CudaCopyEngine, CudaError, CudaGpu, Direction,
    ExecCtx, PlanSource,
};
use crate::runtime::exec::{CopyEngine, CopyError, UniformGather};

/// `kvfabric-gpu compile`: compiles `kernels/gather_scatter.cu` and
/// `kernels/pattern.cu` with NVRTC for compute capability `arch` (e.g. 90)
/// and prints each cubin's size and compile time; `out` receives the
/// gather/scatter cubin (the one agents load). Needs no GPU. Without NVRTC
/// it prints `SKIP: <reason>` and succeeds.
///
/// # Errors
/// A kernel that does not compile, or `out` that cannot be written.
pub fn compile(arch: i32, out: Option<&Path>) -> AnyResult<()> {
    if let Err(why) = cuda::probe_nvrtc() {
        println!("SKIP: {why}");
        return Ok(());
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
                    std::fs::write(p, &cubin)
                        .map_err(|e| format!("writing {}: {e}", p.display()))?;
                }
            }
            Err(e) => return Err(format!("{name}: {e}")),
        }
    }
    Ok(())
}

/// `kvfabric-gpu info`: prints the device, driver, NVRTC version and
/// kernel build of `gpu` (JSON), and whether the driver has the batched
/// memcpy.
pub fn print_info(gpu: &CudaGpu) {
    println!(
        "{}",
        serde_json::to_string_pretty(gpu.info()).unwrap_or_default()
    );
    println!(
        "batched memcpy (cuMemcpyBatchAsync_v2): {}",
        cuda::has_batched_memcpy()
    );
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

/// Results of this module: errors are text for the user.
pub type AnyResult<T> = Result<T, String>;

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

/// `kvfabric-gpu kernel-test`: byte-exact gather and scatter checks of
/// every copy variant (kernel with pinned and device plans, persistent
/// grid, large tasks, per-segment memcpy, batched memcpy where the driver
/// has it) over generated cases (aligned and misaligned, zero-length,
/// 1 B to 1 MiB, 100,000 descriptors, coalesced runs), every byte of both
/// buffers compared; one line per check on stdout, a JSON report to
/// `json_path`. `seed` picks the cases and contents.
///
/// # Errors
/// A CUDA failure setting up, a report that cannot be written, or any
/// failed check (counted).
pub fn kernel_test(gpu: &Arc<CudaGpu>, seed: u64, json_path: Option<&Path>) -> AnyResult<()> {
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
                    let note = format!(" (region_off {})", case.region_off);
                    let (want, got) = ((&host_u[..], &host_r[..]), (&mut got_u, &mut got_r));
                    if let Some(m) = compare_buffers(&user, &region, want, got, &note)? {
                        status = m;
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
    failures += uniform_checks(gpu, &engines, &mut rng, &mut results)?;
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
        std::fs::write(p, serde_json::to_string_pretty(&doc).unwrap_or_default())
            .map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    if failures > 0 {
        return Err(format!("{failures} kernel-test checks failed"));
    }
    Ok(())
}

/// Downloads both device buffers into `got` (user, region) and compares
/// them with the host model `want` (user, region): `None` when every byte
/// matches, else the first mismatch, the region's first (`region_note` is
/// appended to a region mismatch's position).
///
/// # Errors
/// A failed download.
fn compare_buffers(
    user: &CudaArena,
    region: &CudaArena,
    want: (&[u8], &[u8]),
    got: (&mut Vec<u8>, &mut Vec<u8>),
    region_note: &str,
) -> AnyResult<Option<String>> {
    user.download(0, got.0).map_err(e2s)?;
    region.download(0, got.1).map_err(e2s)?;
    if let Some(i) = first_mismatch(got.1, want.1) {
        return Ok(Some(format!(
            "MISMATCH in region at byte {i}{region_note}: got {:#04x} want {:#04x}",
            got.1[i], want.1[i]
        )));
    }
    Ok(first_mismatch(got.0, want.0).map(|i| {
        format!(
            "MISMATCH in user buffer at byte {i}: got {:#04x} want {:#04x}",
            got.0[i], want.0[i]
        )
    }))
}

/// The uniform forms (issue 18): `n` pieces of `len` bytes each, region
/// pieces `stride` bytes apart from `region_off`, user pieces in shuffled
/// slots `slot` bytes apart (a `slot` that is not a multiple of 16
/// misaligns them) — gathered with [`CopyEngine::gather_uniform`] and
/// scattered with [`CopyEngine::scatter_uniform`] on every variant (and
/// gathered again as three chunks with [`CopyEngine::gather_uniform_batch`],
/// each reported once, in order), each
/// compared byte for byte with a host model over both whole buffers;
/// `meanwhile` must run exactly once. Returns the number of failed checks
/// (each also printed and pushed to `results`).
///
/// # Errors
/// A device allocation or copy that fails outside the engines.
fn uniform_checks(
    gpu: &Arc<CudaGpu>,
    engines: &[(&str, CudaCopyEngine)],
    rng: &mut Rng,
    results: &mut Vec<serde_json::Value>,
) -> AnyResult<usize> {
    // (name, len, n, stride, slot, region_off)
    let cases: [(&str, u64, usize, u64, u64, u64); 5] = [
        ("uniform 4 KiB x 4096", 4096, 4096, 4096, 4096, 0),
        ("uniform 100 B x 1000 misaligned", 100, 1000, 128, 103, 32),
        (
            "uniform 16 KiB x 64 strided",
            16384,
            64,
            16384 + 32,
            16384 + 16,
            64,
        ),
        ("uniform 1 B x 33", 1, 33, 32, 1, 0),
        (
            "uniform 64 KiB x 16 (run-path fallback)",
            65536,
            16,
            65536,
            65536,
            0,
        ),
    ];
    let mut failures = 0;
    for (name, len, n, stride, slot, region_off) in cases {
        let user_len = (2 * n as u64 * slot + 256) as usize;
        let region_len = (region_off + (n as u64 - 1) * stride + len + 256) as usize;
        let user = CudaArena::new(gpu, user_len).map_err(e2s)?;
        let region = CudaArena::new(gpu, region_len).map_err(e2s)?;
        // Piece i's user slot: a shuffled pick of 2n slots (every slot at
        // most once, so scatters never overlap).
        let mut slots: Vec<u64> = (0..2 * n as u64).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, rng.range(0, i as u64) as usize);
        }
        let offs: Vec<u64> = slots[..n].iter().map(|s| s * slot).collect();
        let mut host_u = vec![0u8; user_len];
        let mut host_r = vec![0u8; region_len];
        let mut got_u = vec![0u8; user_len];
        let mut got_r = vec![0u8; region_len];
        for (vname, engine) in engines {
            // The batched gather (`batchGathers`) splits the pieces into
            // three chunks whose regions follow each other, so its host
            // model is the lone gather's.
            for (dir, batch) in [
                (Direction::Gather, false),
                (Direction::Scatter, false),
                (Direction::Gather, true),
            ] {
                rng.fill(&mut host_u);
                rng.fill(&mut host_r);
                user.upload(0, &host_u).map_err(e2s)?;
                region.upload(0, &host_r).map_err(e2s)?;
                for (i, &u) in offs.iter().enumerate() {
                    let (u, r) = (u as usize, (region_off + i as u64 * stride) as usize);
                    let l = len as usize;
                    match dir {
                        Direction::Gather => host_r[r..r + l].copy_from_slice(&host_u[u..u + l]),
                        Direction::Scatter => host_u[u..u + l].copy_from_slice(&host_r[r..r + l]),
                    }
                }
                let base = region.base_addr() + region_off;
                let addrs = offs.iter().map(|o| user.base_addr() + o);
                let mut called = 0u32;
                let t0 = Instant::now();
                let r = match dir {
                    Direction::Gather if batch => {
                        let descs: Vec<Descriptor> =
                            addrs.map(|a| Descriptor::new(a, 0, len)).collect();
                        let cuts = [0, n / 3, 2 * n / 3, n];
                        let items: Vec<UniformGather<'_>> = cuts
                            .windows(2)
                            .map(|w| UniformGather {
                                region_addr: base + w[0] as u64 * stride,
                                descs: &descs[w[0]..w[1]],
                                stride,
                                src_planes: None,
                            })
                            .collect();
                        let mut reports = Vec::new();
                        engine.gather_uniform_batch(&items, &mut || called += 1, &mut |i, r| {
                            reports.push((i, r))
                        });
                        let order: Vec<usize> = reports.iter().map(|r| r.0).collect();
                        if order != [0, 1, 2] {
                            Err(CopyError(format!(
                                "items reported as {order:?}, expected [0, 1, 2]"
                            )))
                        } else {
                            reports.into_iter().try_for_each(|r| r.1)
                        }
                    }
                    Direction::Gather => {
                        let descs: Vec<Descriptor> =
                            addrs.map(|a| Descriptor::new(a, 0, len)).collect();
                        engine.gather_uniform(base, &descs, stride, &mut || called += 1)
                    }
                    Direction::Scatter => {
                        called = 1;
                        let u = UniformScatter {
                            segment_len: len,
                            region_stride: stride,
                            dsts: addrs.collect(),
                        };
                        engine.scatter_uniform(base, &u)
                    }
                };
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                let mut status = match r {
                    Ok(()) if called == 1 => "ok".to_string(),
                    Ok(()) => format!("meanwhile ran {called} times, expected once"),
                    Err(e) => format!("error: {e}"),
                };
                if status == "ok" {
                    let (want, got) = ((&host_u[..], &host_r[..]), (&mut got_u, &mut got_r));
                    if let Some(m) = compare_buffers(&user, &region, want, got, "")? {
                        status = m;
                    }
                }
                let pass = status == "ok";
                if !pass {
                    failures += 1;
                }
                println!(
                    "{:<5} {:<44} {:<8} {:<34} pieces {:>6} bytes {:>11} {:>9.2} ms",
                    if pass { "PASS" } else { "FAIL" },
                    name,
                    if batch {
                        "Batch".to_string()
                    } else {
                        format!("{dir:?}")
                    },
                    vname,
                    n,
                    n as u64 * len,
                    ms
                );
                if !pass {
                    println!("      {status}");
                }
                results.push(json!({
                    "case": name, "variant": vname,
                    "direction": if batch { "Batch".to_string() } else { format!("{dir:?}") },
                    "pieces": n, "bytes": n as u64 * len, "pass": pass, "status": status,
                    "wall_ms": ms,
                }));
            }
        }
    }
    failures += odd_batch_check(gpu, engines, results)?;
    failures += block_scatter_checks(gpu, engines, rng, results)?;
    Ok(failures)
}

/// The block scatter (issue 18 step 3, DATA_BLOCKS): `count` pieces of
/// `len` bytes from piece `first` of a request of `planes` planes of
/// `blocks` shuffled block slots (`slot` bytes apart; a plane spans
/// `2 × blocks` slots), scattered with [`CopyEngine::scatter_blocks`] on
/// every variant and compared byte for byte with a host model over both
/// whole buffers (nothing outside the derived destinations written).
/// Returns the failures (each printed and pushed to `results`).
///
/// # Errors
/// A device allocation or copy that fails outside the engines.
fn block_scatter_checks(
    gpu: &Arc<CudaGpu>,
    engines: &[(&str, CudaCopyEngine)],
    rng: &mut Rng,
    results: &mut Vec<serde_json::Value>,
) -> AnyResult<usize> {
    // (name, len, blocks, planes, first, count, slot)
    let cases: [(&str, u64, u64, u64, u64, u32, u64); 3] = [
        (
            "blocks 4 KiB, 512 a plane, from inside one",
            4096,
            512,
            16,
            100,
            4096 + 37,
            4096,
        ),
        (
            "blocks 100 B misaligned, 33 a plane",
            100,
            33,
            5,
            7,
            120,
            103,
        ),
        (
            "blocks 64 KiB (run-path fallback)",
            65536,
            4,
            3,
            1,
            9,
            65536,
        ),
    ];
    let mut failures = 0;
    for (name, len, blocks, planes, first, count, slot) in cases {
        let plane = 2 * blocks * slot;
        let user_len = (planes * plane + 256) as usize;
        let stride = len.div_ceil(32) * 32;
        let region_len = (u64::from(count) * stride + 256) as usize;
        let user = CudaArena::new(gpu, user_len).map_err(e2s)?;
        let region = CudaArena::new(gpu, region_len).map_err(e2s)?;
        let mut slots: Vec<u64> = (0..2 * blocks).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, rng.range(0, i as u64) as usize);
        }
        let offs: Vec<u64> = slots[..blocks as usize].iter().map(|s| s * slot).collect();
        let b = BlockScatter {
            segment_len: len,
            region_stride: stride,
            first,
            count,
            plane_stride: plane,
            offsets: offs.iter().map(|o| user.base_addr() + o).collect(),
        };
        let mut host_u = vec![0u8; user_len];
        let mut host_r = vec![0u8; region_len];
        let (mut got_u, mut got_r) = (vec![0u8; user_len], vec![0u8; region_len]);
        for (vname, engine) in engines {
            rng.fill(&mut host_u);
            rng.fill(&mut host_r);
            user.upload(0, &host_u).map_err(e2s)?;
            region.upload(0, &host_r).map_err(e2s)?;
            for j in 0..u64::from(count) {
                let k = first + j;
                let u = ((k / blocks) * plane + offs[(k % blocks) as usize]) as usize;
                let r = (j * stride) as usize;
                let l = len as usize;
                host_u[u..u + l].copy_from_slice(&host_r[r..r + l]);
            }
            let t0 = Instant::now();
            let r = engine.scatter_blocks(region.base_addr(), &b);
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            let status = match r {
                Ok(()) => "ok".to_string(),
                Err(e) => format!("error: {e}"),
            };
            let status = match status.as_str() {
                "ok" => {
                    let (want, got) = ((&host_u[..], &host_r[..]), (&mut got_u, &mut got_r));
                    compare_buffers(&user, &region, want, got, "")?.unwrap_or(status)
                }
                _ => status,
            };
            let bytes = u64::from(count) * len;
            if !report_check(
                results,
                (name, "Blocks", "Blocks", vname),
                (count, bytes, ms),
                status,
            ) {
                failures += 1;
            }
            // The same pieces gathered from the planes as a batch of two
            // items (the sender's side): region piece j = the derived
            // source of piece first + j.
            rng.fill(&mut host_u);
            rng.fill(&mut host_r);
            user.upload(0, &host_u).map_err(e2s)?;
            region.upload(0, &host_r).map_err(e2s)?;
            let planes = BlockPlanes {
                plane_stride: plane,
                offsets: b.offsets.clone(),
            };
            let descs: Vec<Descriptor> = (0..u64::from(count))
                .map(|j| Descriptor::new(planes.addr(first + j).unwrap_or(0), 0, len))
                .collect();
            for (j, d) in descs.iter().enumerate() {
                let (u, r) = ((d.src - user.base_addr()) as usize, j * stride as usize);
                host_r[r..r + len as usize].copy_from_slice(&host_u[u..u + len as usize]);
            }
            let mid = descs.len() / 2;
            let items: Vec<UniformGather<'_>> = [(0, mid), (mid, descs.len())]
                .iter()
                .map(|&(a, e)| UniformGather {
                    region_addr: region.base_addr() + a as u64 * stride,
                    descs: &descs[a..e],
                    stride,
                    src_planes: Some((&planes, first + a as u64)),
                })
                .collect();
            let (mut called, mut reports) = (0u32, Vec::new());
            let t0 = Instant::now();
            engine.gather_uniform_batch(&items, &mut || called += 1, &mut |i, r| {
                reports.push((i, r))
            });
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            let order: Vec<usize> = reports.iter().map(|r| r.0).collect();
            let status = if order != [0, 1] {
                format!("items reported as {order:?}, expected [0, 1]")
            } else if called != 1 {
                format!("meanwhile ran {called} times, expected once")
            } else {
                match reports.into_iter().try_for_each(|r| r.1) {
                    Ok(()) => "ok".to_string(),
                    Err(e) => format!("error: {e}"),
                }
            };
            let status = match status.as_str() {
                "ok" => {
                    let (want, got) = ((&host_u[..], &host_r[..]), (&mut got_u, &mut got_r));
                    compare_buffers(&user, &region, want, got, "")?.unwrap_or(status)
                }
                _ => status,
            };
            let bytes = u64::from(count) * len;
            if !report_check(
                results,
                (name, "BatchPl", "BatchPlanes", vname),
                (count, bytes, ms),
                status,
            ) {
                failures += 1;
            }
        }
    }
    Ok(failures)
}

/// Prints one check's line (and its status when it failed) and pushes its
/// JSON record: `what` = (case, direction as printed, direction in the
/// JSON, variant), `size` = (pieces, bytes, wall ms). Returns whether it
/// passed (`status` "ok").
fn report_check(
    results: &mut Vec<serde_json::Value>,
    what: (&str, &str, &str, &str),
    size: (u32, u64, f64),
    status: String,
) -> bool {
    let ((name, shown, dir, vname), (pieces, bytes, ms)) = (what, size);
    let pass = status == "ok";
    println!(
        "{:<5} {:<44} {:<8} {:<34} pieces {:>6} bytes {:>11} {:>9.2} ms",
        if pass { "PASS" } else { "FAIL" },
        name,
        shown,
        vname,
        pieces,
        bytes,
        ms
    );
    if !pass {
        println!("      {status}");
    }
    results.push(json!({
        "case": name, "variant": vname, "direction": dir,
        "pieces": pieces, "bytes": bytes, "pass": pass,
        "status": status, "wall_ms": ms,
    }));
    pass
}

/// A batch of three uniform items whose middle one holds a descriptor
/// 32 bytes shorter than the rest (the CUDA batch finds it in the pass
/// that stages its piece table): the middle item must fail alone and
/// leave its region untouched, the other two land byte for byte, every
/// item reported once, in order, `meanwhile` once. Returns the failures.
///
/// # Errors
/// A device allocation or copy that fails outside the engines.
fn odd_batch_check(
    gpu: &Arc<CudaGpu>,
    engines: &[(&str, CudaCopyEngine)],
    results: &mut Vec<serde_json::Value>,
) -> AnyResult<usize> {
    let (len, n) = (4096u64, 3 * 512usize);
    let user = CudaArena::new(gpu, n * len as usize).map_err(e2s)?;
    let region = CudaArena::new(gpu, n * len as usize).map_err(e2s)?;
    let host_u: Vec<u8> = (0..n * len as usize)
        .map(|i| (i * 7 + i / 4096) as u8)
        .collect();
    let mut failures = 0;
    for (vname, engine) in engines {
        user.upload(0, &host_u).map_err(e2s)?;
        region.zero().map_err(e2s)?;
        let mut descs: Vec<Descriptor> = (0..n as u64)
            .map(|i| Descriptor::new(user.base_addr() + i * len, 0, len))
            .collect();
        descs[n / 2].len = len - 32;
        let items: Vec<UniformGather<'_>> = (0..3)
            .map(|k| UniformGather {
                region_addr: region.base_addr() + (k * 512) as u64 * len,
                descs: &descs[k * 512..(k + 1) * 512],
                stride: len,
                src_planes: None,
            })
            .collect();
        let (mut called, mut reports) = (0u32, Vec::new());
        engine.gather_uniform_batch(&items, &mut || called += 1, &mut |i, r| {
            reports.push((i, r.is_ok()))
        });
        let mut got = vec![0u8; n * len as usize];
        region.download(0, &mut got).map_err(e2s)?;
        let item = 512 * len as usize;
        let status = if reports != [(0, true), (1, false), (2, true)] {
            format!("reports {reports:?}, expected item 1 alone failed, in order")
        } else if called != 1 {
            format!("meanwhile ran {called} times, expected once")
        } else if got[..item] != host_u[..item] || got[2 * item..] != host_u[2 * item..] {
            "the uniform items did not land byte for byte".to_string()
        } else if got[item..2 * item].iter().any(|&b| b != 0) {
            "the failed item wrote its region".to_string()
        } else {
            "ok".to_string()
        };
        let pass = status == "ok";
        if !pass {
            failures += 1;
        }
        println!(
            "{:<5} {:<44} {:<8} {:<34}",
            if pass { "PASS" } else { "FAIL" },
            "batch with one odd descriptor",
            "Batch",
            vname
        );
        if !pass {
            println!("      {status}");
        }
        results.push(json!({
            "case": "batch with one odd descriptor", "variant": vname,
            "direction": "Batch", "pieces": n, "pass": pass, "status": status,
        }));
    }
    Ok(failures)
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

/// `kvfabric-gpu kernel-bench`: CUDA-event medians (`reps` samples of
/// `iters` back-to-back launches, each at least 1) of gather and scatter
/// over 16,384 descriptors of 4/8/16/64 KiB random slots, a 1 GiB
/// memory-bound case and a coalesced run, against a contiguous
/// device-to-device memcpy of the same bytes, per-descriptor memcpy and
/// the driver's batched memcpy; with `sweep`, threads per block,
/// persistent-grid sizes and task sizes too. Prints Markdown tables; a
/// JSON report to `json_path`. Needs 3 GiB of GPU memory.
///
/// # Errors
/// A CUDA failure, a kernel result that differs from its source, or a
/// report that cannot be written.
#[allow(clippy::too_many_lines)]
pub fn kernel_bench(
    gpu: &Arc<CudaGpu>,
    iters: usize,
    reps: usize,
    sweep: bool,
    seed: u64,
    json_path: Option<&Path>,
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
        std::fs::write(p, serde_json::to_string_pretty(&doc).unwrap_or_default())
            .map_err(|e| format!("writing {}: {e}", p.display()))?;
        println!("wrote {}", p.display());
    }
    Ok(())
}
