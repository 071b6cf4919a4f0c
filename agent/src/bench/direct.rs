//! `kvfabric-gpu direct-bench` (issue 19): the same-node direct path's
//! kernels alone, timed with CUDA events, side by side in one run with a
//! contiguous device-to-device memcpy of the same bytes.
//!
//! Every case copies whole blocks between two pools on one GPU from two
//! shuffled block-id lists (the engine API's layer-major layout: plane `q`
//! of a pool at `base + q * pool_blocks * block_bytes`). The ids are already
//! on the device for the kernel rows; only the kernel sits between the two
//! events. Rows per case:
//!
//! * `memcpy` — `cuMemcpyDtoDAsync` of the case's bytes, contiguous;
//! * `zero-copy ids` — `kvf_block_copy` reading its ids from mapped
//!   pinned host memory (the first version of the agent's direct path);
//! * `device ids` — the same kernel, ids in device memory (the agent's
//!   direct path now), one warp per block and plane, and with grids capped
//!   at 2 and 4 × the SM count (the kernel strides over the rest);
//! * `agent copy_blocks` — `CudaCopyEngine::copy_blocks`, the agent's
//!   call (host wall clock: ids to pinned memory, upload, launch, wait).
//!
//! Each row: `reps` single launches, each between its own two events (p50,
//! p90, min), and `reps` more back to back between one pair (mean); the
//! ratio memcpy p50 / kernel p50 (issue 19's target: ≥ 0.8). Every kernel
//! row's result is checked byte for byte once (untouched blocks zero).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys};
use serde_json::json;

use crate::runtime::cuda::{
    BlockCopy, CudaArena, CudaCopyConfig, CudaCopyEngine, CudaError, CudaGpu,
};

type AnyResult<T> = Result<T, String>;

fn e2s(e: CudaError) -> String {
    e.to_string()
}

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
    fn ids(&mut self, pool_blocks: u32, n: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (0..pool_blocks).collect();
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        v.truncate(n as usize);
        v
    }
}

struct Case {
    name: &'static str,
    npairs: u32,
    nplanes: u32,
    block_bytes: u64,
    /// Destination base offset from its allocation (1: misaligned).
    dst_misalign: u64,
}

fn cases(big: bool) -> Vec<Case> {
    let mut v = vec![
        Case {
            name: "16384 x 4 KiB, 1 plane (64 MiB)",
            npairs: 16_384,
            nplanes: 1,
            block_bytes: 4096,
            dst_misalign: 0,
        },
        Case {
            name: "256 pairs x 64 planes x 4 KiB (64 MiB, 32 layers K/V)",
            npairs: 256,
            nplanes: 64,
            block_bytes: 4096,
            dst_misalign: 0,
        },
        Case {
            name: "4096 x 16 KiB, 1 plane (64 MiB)",
            npairs: 4096,
            nplanes: 1,
            block_bytes: 16_384,
            dst_misalign: 0,
        },
        Case {
            name: "16384 x 4 KiB, 1 plane, destination 1 byte off (64 MiB)",
            npairs: 16_384,
            nplanes: 1,
            block_bytes: 4096,
            dst_misalign: 1,
        },
    ];
    if big {
        v.push(Case {
            name: "16384 x 64 KiB, 1 plane (1 GiB)",
            npairs: 16_384,
            nplanes: 1,
            block_bytes: 65_536,
            dst_misalign: 0,
        });
    }
    v
}

struct Events {
    a: sys::CUevent,
    b: sys::CUevent,
}

impl Events {
    fn new() -> AnyResult<Self> {
        let f = sys::CUevent_flags::CU_EVENT_DEFAULT;
        Ok(Self {
            a: result::event::create(f).map_err(|e| format!("cuEventCreate: {e}"))?,
            b: result::event::create(f).map_err(|e| format!("cuEventCreate: {e}"))?,
        })
    }
    /// Device µs of `n` enqueues of `work` on `stream`, between two events.
    fn time_us(
        &self,
        stream: sys::CUstream,
        n: usize,
        work: &mut dyn FnMut() -> AnyResult<()>,
    ) -> AnyResult<f64> {
        // SAFETY: live events and stream.
        unsafe {
            result::event::record(self.a, stream).map_err(|e| format!("cuEventRecord: {e}"))?;
            for _ in 0..n {
                work()?;
            }
            result::event::record(self.b, stream).map_err(|e| format!("cuEventRecord: {e}"))?;
            result::event::synchronize(self.b).map_err(|e| format!("cuEventSynchronize: {e}"))?;
            let ms = result::event::elapsed(self.a, self.b)
                .map_err(|e| format!("cuEventElapsedTime: {e}"))?;
            Ok(f64::from(ms) * 1e3)
        }
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        // SAFETY: created in new, destroyed once.
        unsafe {
            let _ = result::event::destroy(self.a);
            let _ = result::event::destroy(self.b);
        }
    }
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    s[((s.len() - 1) as f64 * p).round() as usize]
}

struct Timing {
    p50: f64,
    p90: f64,
    min: f64,
    mean_back_to_back: f64,
}

fn time_row(
    ev: &Events,
    stream: sys::CUstream,
    reps: usize,
    work: &mut dyn FnMut() -> AnyResult<()>,
) -> AnyResult<Timing> {
    for _ in 0..3 {
        ev.time_us(stream, 1, work)?; // warm-up
    }
    let mut one = Vec::with_capacity(reps);
    for _ in 0..reps {
        one.push(ev.time_us(stream, 1, work)?);
    }
    let b2b = ev.time_us(stream, reps, work)? / reps as f64;
    Ok(Timing {
        p50: pct(&one, 0.5),
        p90: pct(&one, 0.9),
        min: pct(&one, 0.0),
        mean_back_to_back: b2b,
    })
}

/// Mapped pinned host memory holding `ids` (for the zero-copy row).
struct Pinned {
    host: *mut std::ffi::c_void,
    dev: u64,
}

impl Pinned {
    fn new(ids: &[u32]) -> AnyResult<Self> {
        let bytes = std::mem::size_of_val(ids).max(4);
        // SAFETY: the context is bound; bytes > 0. Flags: portable,
        // device-mapped, write-combined (as the agent's plan buffers).
        let host = unsafe { result::malloc_host(bytes, 0x01 | 0x02 | 0x04) }
            .map_err(|e| format!("cuMemHostAlloc: {e}"))?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: host is a mapped pinned allocation of `bytes`.
        unsafe {
            std::ptr::copy_nonoverlapping(ids.as_ptr(), host.cast::<u32>(), ids.len());
            sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0)
                .result()
                .map_err(|e| format!("cuMemHostGetDevicePointer: {e:?}"))?;
        }
        Ok(Self { host, dev })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated in new, freed once.
        let _ = unsafe { result::free_host(self.host) };
    }
}

/// `kvfabric-gpu direct-bench`: see the module docs. `reps` samples per
/// row; `big` adds a 1 GiB case; `grids` are extra grid sizes for the fast
/// kernel (0 = resident, the agent's choice). Prints a Markdown table and
/// writes a JSON report to `json_path`.
///
/// # Errors
/// A CUDA failure, a kernel result that is not byte-exact, or a report
/// that cannot be written.
#[allow(clippy::too_many_lines)]
pub fn direct_bench(
    gpu: &Arc<CudaGpu>,
    reps: usize,
    big: bool,
    seed: u64,
    json_path: Option<&Path>,
) -> AnyResult<()> {
    let info = gpu.info().clone();
    println!(
        "GPU {} (sm_{}{}, {} SMs), driver {}; {} samples per row (single launches between two events), \
         then {} back to back",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.sm_count,
        info.driver_version,
        reps,
        reps
    );
    for k in &info.kernels {
        if k.name.starts_with("kvf_block_copy") {
            println!(
                "  {}: {} registers, {} B local, {} blocks of 256 threads per SM",
                k.name,
                k.regs,
                k.local_bytes,
                k.max_blocks_per_sm.get(7).copied().unwrap_or(0)
            );
        }
    }
    gpu.bind().map_err(e2s)?;
    let engine = CudaCopyEngine::new(gpu, CudaCopyConfig::default()).map_err(e2s)?;
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
        .map_err(|e| format!("cuStreamCreate: {e}"))?;
    let ev = Events::new()?;
    let sms = info.sm_count.max(1) as u32;
    let mut rng = Rng(seed);
    let mut rows_json = Vec::new();
    let mut failures = 0usize;
    println!();
    println!("| case | row | kernel | grid | p50 µs | p90 µs | min µs | back-to-back µs | GB/s (p50) | memcpy/kernel (p50) | exact |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for case in cases(big) {
        let pool_blocks = case.npairs * 2;
        let plane = u64::from(pool_blocks) * case.block_bytes;
        let pool_len = plane * u64::from(case.nplanes);
        let bytes = u64::from(case.npairs) * u64::from(case.nplanes) * case.block_bytes;
        let src = CudaArena::new(gpu, pool_len as usize).map_err(e2s)?;
        let dst = CudaArena::new(gpu, (pool_len + 64) as usize).map_err(e2s)?;
        let sids = rng.ids(pool_blocks, case.npairs);
        let dids = rng.ids(pool_blocks, case.npairs);
        // Source bytes: random; device ids; pinned ids.
        let mut host_src = vec![0u8; pool_len as usize];
        for c in host_src.chunks_mut(8) {
            let v = rng.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
        src.upload(0, &host_src).map_err(e2s)?;
        let ids_dev = CudaArena::new(gpu, 8 * case.npairs as usize).map_err(e2s)?;
        let mut idb = Vec::with_capacity(8 * case.npairs as usize);
        for id in sids.iter().chain(dids.iter()) {
            idb.extend_from_slice(&id.to_le_bytes());
        }
        ids_dev.upload(0, &idb).map_err(e2s)?;
        let mut all = sids.clone();
        all.extend_from_slice(&dids);
        let pinned = Pinned::new(&all)?;
        let dst_base = dst.base_addr() + case.dst_misalign;
        let base = BlockCopy {
            src_base: src.base_addr(),
            dst_base,
            src_ids: ids_dev.base_addr(),
            dst_ids: ids_dev.base_addr() + 4 * u64::from(case.npairs),
            npairs: case.npairs,
            nplanes: case.nplanes,
            src_plane_stride: plane,
            dst_plane_stride: plane,
            block_bytes: case.block_bytes,
        };
        // The expected destination allocation.
        let mut want = vec![0u8; (pool_len + 64) as usize];
        for q in 0..u64::from(case.nplanes) {
            for (s, d) in sids.iter().zip(&dids) {
                let so = (q * plane + u64::from(*s) * case.block_bytes) as usize;
                let doff =
                    (case.dst_misalign + q * plane + u64::from(*d) * case.block_bytes) as usize;
                want[doff..doff + case.block_bytes as usize]
                    .copy_from_slice(&host_src[so..so + case.block_bytes as usize]);
            }
        }
        let mut got = vec![0u8; want.len()];
        let mut check = |what: &str| -> AnyResult<bool> {
            // SAFETY: live stream.
            unsafe { result::stream::synchronize(stream) }
                .map_err(|e| format!("cuStreamSynchronize: {e}"))?;
            dst.download(0, &mut got).map_err(e2s)?;
            let ok = got == want;
            if !ok {
                let i = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                eprintln!("MISMATCH {}: {what}: first differing byte {i}", case.name);
            }
            dst.zero().map_err(e2s)?;
            Ok(ok)
        };
        let mut rows: Vec<(String, String, u32, Timing, Option<bool>)> = Vec::new();
        // memcpy of the same bytes, contiguous.
        let (mdst, msrc) = (dst.base_addr(), src.base_addr());
        let t = time_row(&ev, stream, reps, &mut || {
            // SAFETY: both ranges lie inside their allocations.
            unsafe { sys::cuMemcpyDtoDAsync_v2(mdst, msrc, bytes as usize, stream) }
                .result()
                .map_err(|e| format!("cuMemcpyDtoDAsync: {e:?}"))
        })?;
        dst.zero().map_err(e2s)?;
        let memcpy_p50 = t.p50;
        rows.push(("memcpy".into(), "cuMemcpyDtoDAsync".into(), 0, t, None));
        let variants: Vec<(String, BlockCopy, u32)> = vec![
            (
                "zero-copy ids (first version)".into(),
                BlockCopy {
                    src_ids: pinned.dev,
                    dst_ids: pinned.dev + 4 * u64::from(case.npairs),
                    ..base
                },
                0,
            ),
            ("device ids (agent)".into(), base, 0),
            ("device ids, grid 2 x SMs".into(), base, 2 * sms),
            ("device ids, grid 4 x SMs".into(), base, 4 * sms),
        ];
        for (row, a, grid) in variants {
            let mut used = 0u32;
            // SAFETY: stream live; id arrays and pools live for the row;
            // ids drawn from 0..pool_blocks.
            let mut launch = || -> AnyResult<()> {
                used = unsafe { gpu.launch_block_copy(stream, &a, grid) }.map_err(e2s)?;
                Ok(())
            };
            launch()?;
            let exact = check(&row)?;
            let t = time_row(&ev, stream, reps, &mut launch)?;
            dst.zero().map_err(e2s)?;
            failures += usize::from(!exact);
            rows.push((row, "kvf_block_copy".into(), used, t, Some(exact)));
        }
        // The agent's kernel after the GPU sat idle for 20 ms (as between
        // two hand-offs in the engine bench): first case only.
        if case.npairs == 16_384 && case.block_bytes == 4096 && case.dst_misalign == 0 {
            let mut idle = Vec::new();
            for _ in 0..reps.min(50) {
                std::thread::sleep(std::time::Duration::from_millis(20));
                idle.push(ev.time_us(stream, 1, &mut || {
                    // SAFETY: as the rows above.
                    unsafe { gpu.launch_block_copy(stream, &base, 0) }
                        .map(|_| ())
                        .map_err(e2s)
                })?);
            }
            dst.zero().map_err(e2s)?;
            rows.push((
                "device ids, after 20 ms idle".into(),
                "kvf_block_copy".into(),
                0,
                Timing {
                    p50: pct(&idle, 0.5),
                    p90: pct(&idle, 0.9),
                    min: pct(&idle, 0.0),
                    mean_back_to_back: f64::NAN,
                },
                None,
            ));
        }
        // The agent's call, host wall clock.
        {
            let mut host = Vec::with_capacity(reps);
            let run = || {
                engine.copy_blocks(
                    src.base_addr(),
                    dst_base,
                    &sids,
                    &dids,
                    case.nplanes,
                    plane,
                    plane,
                    case.block_bytes,
                )
            };
            run().map_err(e2s)?;
            let exact = check("agent copy_blocks")?;
            failures += usize::from(!exact);
            for _ in 0..3 {
                run().map_err(e2s)?;
            }
            for _ in 0..reps {
                let t0 = Instant::now();
                run().map_err(e2s)?;
                host.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            dst.zero().map_err(e2s)?;
            rows.push((
                "agent copy_blocks (host wall clock)".into(),
                "upload ids + kvf_block_copy".into(),
                0,
                Timing {
                    p50: pct(&host, 0.5),
                    p90: pct(&host, 0.9),
                    min: pct(&host, 0.0),
                    mean_back_to_back: f64::NAN,
                },
                Some(exact),
            ));
        }
        let mut case_rows = Vec::new();
        for (row, kernel, grid, t, exact) in &rows {
            let gbps = bytes as f64 / (t.p50 * 1e-6) / 1e9;
            let ratio = memcpy_p50 / t.p50;
            println!(
                "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.2} | {} |",
                case.name,
                row,
                kernel,
                grid,
                t.p50,
                t.p90,
                t.min,
                t.mean_back_to_back,
                gbps,
                ratio,
                exact.map_or("-".to_string(), |e| e.to_string())
            );
            case_rows.push(json!({
                "row": row, "kernel": kernel, "grid": grid, "p50_us": t.p50, "p90_us": t.p90,
                "min_us": t.min,
                "back_to_back_mean_us": if t.mean_back_to_back.is_nan() { None } else { Some(t.mean_back_to_back) },
                "gbps_p50": gbps, "memcpy_over_row_p50": ratio, "byte_exact": exact,
            }));
        }
        rows_json.push(json!({
            "case": case.name, "pairs": case.npairs, "planes": case.nplanes,
            "block_bytes": case.block_bytes, "bytes": bytes, "dst_misaligned_by": case.dst_misalign,
            "memcpy_p50_us": memcpy_p50, "rows": case_rows,
        }));
    }
    // SAFETY: created above; no work pending (every row synchronised).
    let _ = unsafe { result::stream::destroy(stream) };
    let report = json!({
        "bench": "direct-bench", "gpu": info.name, "sm_count": info.sm_count,
        "driver_version": info.driver_version, "reps": reps, "seed": seed,
        "kernels": info.kernels.iter().filter(|k| k.name.starts_with("kvf_block_copy")).collect::<Vec<_>>(),
        "timing": "CUDA events around single launches (p50/p90/min) and around reps launches back to back (mean); ids already on the device except the zero-copy row; the agent row is the host wall clock of CudaCopyEngine::copy_blocks",
        "cases": rows_json, "byte_exact_failures": failures,
    });
    if let Some(p) = json_path {
        std::fs::write(
            p,
            serde_json::to_vec_pretty(&report).map_err(|e| e.to_string())?,
        )
        .map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    if failures > 0 {
        return Err(format!(
            "{failures} direct-bench results were not byte-exact"
        ));
    }
    Ok(())
}
