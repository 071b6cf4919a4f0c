//! `kvfabric-gpu floor-bench` (issue 18): what a bounce transfer costs on
//! one GPU with no protocol at all — its three HBM passes alone, timed with
//! CUDA events, beside the one-descriptor write's single pass.
//!
//! On one GPU the bounce path moves every byte three times through the
//! same HBM — gather (pool → send staging), the write (send staging →
//! receive staging) and scatter (receive staging → pool) — where the
//! one-descriptor write moves it once. This bench measures that floor, so
//! the isolated-request ratio (`vram-bench`'s "bounce / one-descriptor")
//! can be read against what the memory allows. Rows, for `total` bytes as
//! `total / block` pieces in shuffled slots of two pools:
//!
//! * `one copy` — one `cuMemcpyDtoDAsync` of `total` bytes pool → pool
//!   (the one-descriptor write's copy without NIXL);
//! * `gather`, `staging copy`, `scatter` — each pass alone (the piece
//!   kernels of the agent, address tables in device memory);
//! * `serial` — the three passes one after the other on one stream;
//! * `pipelined C` — chunks of `C` bytes on three streams (gather → copy →
//!   scatter, chained by events), as the agent overlaps a request's chunks;
//!   `gated`: enqueued while the GPU is held busy, so host-side launch
//!   cost is hidden (the device's floor); `ungated`: launched as the agent
//!   does, so one thread's driver-call cost shows (≈ 9 µs a call under
//!   MPS on the H200 host).
//!
//! Every multi-pass row's result is checked byte for byte once against
//! the pattern kernels (`kernels/pattern.cu`), with the destination pool
//! and both stagings zeroed before it (so no row passes on an earlier
//! row's bytes). A gated row counts the samples in which the gate had
//! already drained when the host finished enqueueing (`gate_missed`):
//! those samples include launch cost.

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{result, sys};
use serde_json::json;

use crate::runtime::cuda::pattern::{PatDesc, PatternKernels};
use crate::runtime::cuda::{CudaArena, CudaError, CudaGpu};

type AnyResult<T> = Result<T, String>;

fn e2s(e: CudaError) -> String {
    e.to_string()
}

fn drv<T>(what: &str, r: Result<T, result::DriverError>) -> AnyResult<T> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// A permutation of `0..n` from `seed` (Fisher–Yates over splitmix64).
fn shuffled(n: usize, seed: u64) -> Vec<u64> {
    let mut s = seed;
    let mut next = move || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut v: Vec<u64> = (0..n as u64).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

fn p(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(((s.len().max(1) - 1) as f64 * q).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

/// A chunk size as a label: `16 MiB`, `4 KiB`, `1000 B`.
fn size_label(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes % (1 << 10) == 0 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// Pieces a chunk of `chunk` bytes holds, for `block`-byte pieces and
/// `pieces` in all: at least 1, at most `pieces` (so the pipelined loop
/// always advances, whatever the chunk).
fn pieces_per_chunk(chunk: u64, block: u64, pieces: u32) -> u32 {
    let per = (chunk / block.max(1)).clamp(1, u64::from(pieces.max(1)));
    u32::try_from(per).unwrap_or(u32::MAX)
}

/// The streams, events and buffers of one run. Handles start null and are
/// filled in one by one, so `Drop` frees whatever was made if `new` fails
/// half way.
struct Rig {
    gpu: Arc<CudaGpu>,
    streams: [sys::CUstream; 3],
    start: sys::CUevent,
    end: sys::CUevent,
    /// Joins streams 0 and 1 into stream 2 at the end of a timed run.
    joins: [sys::CUevent; 2],
    links: Vec<sys::CUevent>,
    /// Scratch the gate's memset writes (holds the GPU busy while the
    /// host enqueues a gated row); only when a gated row runs.
    gate: Option<CudaArena>,
    /// Gated samples whose gate had drained before the enqueue ended.
    gate_missed: usize,
    src: CudaArena,
    dst: CudaArena,
    send: CudaArena,
    recv: CudaArena,
    srcs: CudaArena,
    dsts: CudaArena,
    pieces: u32,
    block: u64,
    total: u64,
}

impl Rig {
    fn new(gpu: &Arc<CudaGpu>, total: u64, block: u64, seed: u64, gated: bool) -> AnyResult<Self> {
        gpu.bind().map_err(e2s)?;
        let n = (total / block) as usize;
        let arena = |len: u64| CudaArena::new(gpu, len as usize).map_err(e2s);
        let (src, dst, send, recv) = (arena(total)?, arena(total)?, arena(total)?, arena(total)?);
        let table = |base: u64, slots: &[u64]| -> AnyResult<CudaArena> {
            let t = arena(8 * slots.len() as u64)?;
            let bytes: Vec<u8> = slots
                .iter()
                .flat_map(|s| (base + s * block).to_le_bytes())
                .collect();
            t.upload(0, &bytes).map_err(e2s)?;
            Ok(t)
        };
        let srcs = table(src.base_addr(), &shuffled(n, seed))?;
        let dsts = table(dst.base_addr(), &shuffled(n, seed ^ 0x5eed))?;
        let gate = if gated { Some(arena(4 << 30)?) } else { None };
        let mut rig = Self {
            gpu: gpu.clone(),
            streams: [std::ptr::null_mut(); 3],
            start: std::ptr::null_mut(),
            end: std::ptr::null_mut(),
            joins: [std::ptr::null_mut(); 2],
            links: Vec::new(),
            gate,
            gate_missed: 0,
            src,
            dst,
            send,
            recv,
            srcs,
            dsts,
            pieces: n as u32,
            block,
            total,
        };
        for i in 0..3 {
            rig.streams[i] = drv(
                "cuStreamCreate",
                result::stream::create(result::stream::StreamKind::NonBlocking),
            )?;
        }
        let timing = sys::CUevent_flags::CU_EVENT_DEFAULT;
        rig.start = drv("cuEventCreate", result::event::create(timing))?;
        rig.end = drv("cuEventCreate", result::event::create(timing))?;
        let untimed = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        for i in 0..2 {
            rig.joins[i] = drv("cuEventCreate", result::event::create(untimed))?;
        }
        Ok(rig)
    }

    fn link(&mut self, i: usize) -> AnyResult<sys::CUevent> {
        while self.links.len() <= i {
            let f = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
            self.links
                .push(drv("cuEventCreate", result::event::create(f))?);
        }
        Ok(self.links[i])
    }

    fn copy(&self, stream: sys::CUstream, dst: u64, src: u64, len: u64) -> AnyResult<()> {
        // SAFETY: both ranges lie in this rig's allocations; live stream.
        let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len as usize, stream) };
        drv("cuMemcpyDtoDAsync", r.result())
    }

    /// Gathers pieces `first..first + n` into the send staging at
    /// `first * block`.
    fn gather(&self, stream: sys::CUstream, first: u32, n: u32) -> AnyResult<()> {
        let region = self.send.base_addr() + u64::from(first) * self.block;
        let table = self.srcs.base_addr() + 8 * u64::from(first);
        // SAFETY: the table holds `pieces` source addresses in the source
        // pool, each `block` bytes; the region holds n * block bytes.
        unsafe {
            self.gpu
                .launch_gather_srcs(stream, table, n, self.block, self.block, region)
        }
        .map_err(e2s)
    }

    /// Scatters the receive staging's pieces `first..first + n`.
    fn scatter(&self, stream: sys::CUstream, first: u32, n: u32) -> AnyResult<()> {
        let region = self.recv.base_addr() + u64::from(first) * self.block;
        let table = self.dsts.base_addr() + 8 * u64::from(first);
        // SAFETY: as gather, into the destination pool.
        unsafe {
            self.gpu
                .launch_scatter_dsts(stream, table, n, self.block, self.block, region)
        }
        .map_err(e2s)
    }

    /// Device µs of `work` between a start event on stream 0 (streams 1
    /// and 2 wait for it) and an end event after all three streams.
    /// `gated`: a memset of the 4 GiB scratch runs first on stream 0, so
    /// the host enqueues `work` while the GPU is busy; if the start event
    /// has already completed once `work` is enqueued, the gate drained
    /// too early and `gate_missed` counts the sample.
    fn time(
        &mut self,
        gated: bool,
        work: &mut dyn FnMut(&mut Self) -> AnyResult<()>,
    ) -> AnyResult<f64> {
        let [s0, s1, s2] = self.streams;
        // SAFETY: live events, streams and scratch allocation.
        unsafe {
            if gated {
                let gate = self
                    .gate
                    .as_ref()
                    .ok_or("a gated row on a rig made without a gate")?;
                let r = sys::cuMemsetD8Async(gate.base_addr(), 0, gate.len(), s0);
                drv("cuMemsetD8Async", r.result())?;
            }
            drv("cuEventRecord", result::event::record(self.start, s0))?;
            for s in [s1, s2] {
                drv(
                    "cuStreamWaitEvent",
                    result::stream::wait_event(
                        s,
                        self.start,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    ),
                )?;
            }
            work(self)?;
            if gated && sys::cuEventQuery(self.start) == sys::CUresult::CUDA_SUCCESS {
                self.gate_missed += 1;
            }
            // Join streams 0 and 1 into 2, then end there.
            for (e, s) in self.joins.into_iter().zip([s0, s1]) {
                drv("cuEventRecord", result::event::record(e, s))?;
                drv(
                    "cuStreamWaitEvent",
                    result::stream::wait_event(
                        s2,
                        e,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    ),
                )?;
            }
            drv("cuEventRecord", result::event::record(self.end, s2))?;
            drv("cuEventSynchronize", result::event::synchronize(self.end))?;
            let ms = drv(
                "cuEventElapsedTime",
                result::event::elapsed(self.start, self.end),
            )?;
            Ok(f64::from(ms) * 1e3)
        }
    }

    /// The pipelined bounce: `chunk` bytes a chunk, gather on stream 0 →
    /// staging copy on stream 1 → scatter on stream 2, chained per chunk.
    fn pipelined(&mut self, chunk: u64) -> AnyResult<()> {
        let [s0, s1, s2] = self.streams;
        let per = pieces_per_chunk(chunk, self.block, self.pieces);
        let mut first = 0u32;
        let mut c = 0usize;
        while first < self.pieces {
            let n = per.min(self.pieces - first);
            let off = u64::from(first) * self.block;
            let len = u64::from(n) * self.block;
            self.gather(s0, first, n)?;
            let gathered = self.link(2 * c)?;
            let written = self.link(2 * c + 1)?;
            // SAFETY: live events and streams.
            unsafe {
                drv("cuEventRecord", result::event::record(gathered, s0))?;
                drv(
                    "cuStreamWaitEvent",
                    result::stream::wait_event(
                        s1,
                        gathered,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    ),
                )?;
            }
            self.copy(
                s1,
                self.recv.base_addr() + off,
                self.send.base_addr() + off,
                len,
            )?;
            // SAFETY: as above.
            unsafe {
                drv("cuEventRecord", result::event::record(written, s1))?;
                drv(
                    "cuStreamWaitEvent",
                    result::stream::wait_event(
                        s2,
                        written,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    ),
                )?;
            }
            self.scatter(s2, first, n)?;
            first += n;
            c += 1;
        }
        Ok(())
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // SAFETY: created in new / link, destroyed once, after a sync.
        unsafe {
            let _ = self.gpu.bind();
            for s in self.streams.into_iter().filter(|s| !s.is_null()) {
                let _ = result::stream::synchronize(s);
                let _ = result::stream::destroy(s);
            }
            let events = self.links.iter().chain(&self.joins);
            for e in events.chain([&self.start, &self.end]) {
                if !e.is_null() {
                    let _ = result::event::destroy(*e);
                }
            }
        }
    }
}

/// `kvfabric-gpu floor-bench`: see the module docs. `total` bytes as
/// `total / block` pieces (`block` divides `total`, both > 0), `chunks`
/// the pipelined rows' chunk sizes (bytes, multiples of `block`, at most
/// `total`), `reps` (≥ 1) samples a row (p50, min reported). Prints a Markdown table; writes a JSON report to `json`.
///
/// # Errors
/// Bad sizes (named), a CUDA failure, a result that is not byte-exact, a
/// report that cannot be written.
pub fn floor_bench(
    gpu: &Arc<CudaGpu>,
    total: u64,
    block: u64,
    chunks: &[u64],
    reps: usize,
    json_path: Option<&Path>,
) -> AnyResult<()> {
    if block == 0 || total == 0 || total % block != 0 || total / block > u64::from(u32::MAX) {
        return Err(format!(
            "--total {total} must be a nonzero multiple of --block {block} (at most 2^32 pieces)"
        ));
    }
    if let Some(c) = chunks
        .iter()
        .find(|&&c| c < block || c % block != 0 || c > total)
    {
        return Err(format!(
            "--chunks: {c} is not a multiple of the block {block} between {block} and --total {total}"
        ));
    }
    if reps == 0 {
        return Err("--reps must be at least 1".into());
    }
    let mut rig = Rig::new(gpu, total, block, 18, !chunks.is_empty())?;
    let pattern = PatternKernels::new(gpu).map_err(e2s)?;
    let table = |base: u64, table: &CudaArena| -> AnyResult<Vec<PatDesc>> {
        let mut bytes = vec![0u8; table.len()];
        table.download(0, &mut bytes).map_err(e2s)?;
        Ok(bytes
            .chunks_exact(8)
            .enumerate()
            .map(|(k, b)| PatDesc {
                addr: u64::from_le_bytes(b.try_into().unwrap_or_default()),
                len: block,
                k: k as u64,
            })
            .inspect(|d| debug_assert!(d.addr >= base))
            .collect())
    };
    let src_pat = table(rig.src.base_addr(), &rig.srcs)?;
    let dst_pat = table(rig.dst.base_addr(), &rig.dsts)?;
    pattern.fill(&src_pat, 18).map_err(e2s)?;
    println!(
        "floor-bench: {} bytes as {} × {} B on {}, {} samples a row (device µs between CUDA events)",
        total,
        rig.pieces,
        block,
        gpu.info().name,
        reps
    );
    println!(
        "| row | p50 µs | min µs | GB/s (p50, bytes moved once) | one copy / row (p50) | exact |"
    );
    println!("|---|---:|---:|---:|---:|---|");
    type Work = Box<dyn FnMut(&mut Rig) -> AnyResult<()>>;
    let n = rig.pieces;
    let mut rows: Vec<(String, bool, bool, Work)> = vec![
        (
            "one copy".into(),
            false,
            false,
            Box::new(|r: &mut Rig| {
                r.copy(r.streams[0], r.dst.base_addr(), r.src.base_addr(), r.total)
            }),
        ),
        (
            "gather".into(),
            false,
            false,
            Box::new(move |r: &mut Rig| r.gather(r.streams[0], 0, n)),
        ),
        (
            "staging copy".into(),
            false,
            false,
            Box::new(|r: &mut Rig| {
                r.copy(
                    r.streams[0],
                    r.recv.base_addr(),
                    r.send.base_addr(),
                    r.total,
                )
            }),
        ),
        (
            "scatter".into(),
            false,
            false,
            Box::new(move |r: &mut Rig| r.scatter(r.streams[0], 0, n)),
        ),
        (
            "serial (gather, copy, scatter)".into(),
            false,
            true,
            Box::new(move |r: &mut Rig| {
                let s = r.streams[0];
                r.gather(s, 0, n)?;
                r.copy(s, r.recv.base_addr(), r.send.base_addr(), r.total)?;
                r.scatter(s, 0, n)
            }),
        ),
    ];
    for &c in chunks {
        for gated in [true, false] {
            rows.push((
                format!(
                    "pipelined {} chunks, {}",
                    size_label(c),
                    if gated { "gated" } else { "ungated" }
                ),
                gated,
                true,
                Box::new(move |r: &mut Rig| r.pipelined(c)),
            ));
        }
    }
    let mut one_copy = f64::NAN;
    let mut out = Vec::new();
    for (name, gated, check, mut work) in rows {
        let exact = if check {
            for a in [&rig.dst, &rig.send, &rig.recv] {
                a.zero().map_err(e2s)?;
            }
            rig.time(gated, &mut *work)?;
            match pattern.check(&dst_pat, 18).map_err(e2s)? {
                None => Some(true),
                Some(m) => {
                    return Err(format!(
                        "{name}: {} words differ, first at piece {} byte {}",
                        m.count, m.descriptor, m.offset
                    ))
                }
            }
        } else {
            None
        };
        for _ in 0..3 {
            rig.time(gated, &mut *work)?;
        }
        rig.gate_missed = 0;
        let mut v = Vec::with_capacity(reps);
        for _ in 0..reps {
            v.push(rig.time(gated, &mut *work)?);
        }
        let (p50, min) = (p(&v, 0.5), p(&v, 0.0));
        if name == "one copy" {
            one_copy = p50;
        }
        let gbps = total as f64 / (p50 * 1e-6) / 1e9;
        println!(
            "| {name} | {p50:.1} | {min:.1} | {gbps:.0} | {:.2} | {} |",
            one_copy / p50,
            exact.map_or("–", |_| "yes")
        );
        if gated && rig.gate_missed > 0 {
            println!(
                "  ({name}: the gate drained before the enqueue ended in {} of {reps} samples; those include launch cost)",
                rig.gate_missed
            );
        }
        out.push(json!({
            "row": name, "gated": gated, "p50_us": p50, "min_us": min, "gbps": gbps,
            "one_copy_over_row": one_copy / p50, "byte_exact": exact,
            "gate_missed": if gated { Some(rig.gate_missed) } else { None },
        }));
    }
    if let Some(path) = json_path {
        let j = json!({
            "bench": "floor-bench",
            "device": gpu.info().name,
            "total_bytes": total,
            "block_bytes": block,
            "reps": reps,
            "rows": out,
        });
        std::fs::write(path, serde_json::to_string_pretty(&j).unwrap_or_default())
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffled_is_a_permutation() {
        let v = shuffled(1000, 7);
        let mut s = v.clone();
        s.sort_unstable();
        assert_eq!(s, (0..1000).collect::<Vec<u64>>());
        assert_ne!(v, s, "a shuffle of 1000 left everything in place");
    }

    #[test]
    fn chunk_pieces_never_zero_nor_past_the_total() {
        assert_eq!(pieces_per_chunk(16 << 20, 4096, 16_384), 4096);
        assert_eq!(pieces_per_chunk(4096, 4096, 16_384), 1);
        assert_eq!(pieces_per_chunk(1 << 50, 4096, 16_384), 16_384);
        assert_eq!(pieces_per_chunk(1, 4096, 16_384), 1);
        assert_eq!(size_label(16 << 20), "16 MiB");
        assert_eq!(size_label(4096), "4 KiB");
        assert_eq!(size_label(1000), "1000 B");
    }

    #[test]
    fn percentiles_pick_ranked_samples() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(p(&v, 0.0), 1.0);
        assert_eq!(p(&v, 0.5), 3.0);
        assert_eq!(p(&v, 1.0), 5.0);
        assert!(p(&[], 0.5).is_nan());
    }
}
