//! Execution resources (seed §4 `ExecPool`, `GatherScatterKernel`; §7 scatter
//! workers): a pool of copy contexts borrowed per copy, the copy engine that
//! executes a gather or scatter plan, and the worker threads that run copies
//! off the IO thread and report completion back to it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use kvfabric_core::plan::{BlockPlanes, ChunkBound, TransferPlan, UniformPieces};
use kvfabric_core::{BlockScatter, Descriptor, ScatterList, ScatterRun, UniformScatter};

use super::spin::SpinSlots;
use super::waker::Waker;

/// A pool of `copyStreamCount` execution contexts (seed §4 `ExecPool`):
/// [`ExecPool::try_acquire`] never blocks and returns `None` when all are
/// borrowed; [`ExecPool::release`] returns one. Thread-safe.
#[derive(Debug)]
pub struct ExecPool<T> {
    free: Mutex<Vec<T>>,
    capacity: usize,
}

impl<T> ExecPool<T> {
    /// A pool holding `contexts`.
    pub fn new(contexts: Vec<T>) -> Self {
        let capacity = contexts.len();
        Self {
            free: Mutex::new(contexts),
            capacity,
        }
    }

    /// Borrows a context, or `None` when every context is in use.
    pub fn try_acquire(&self) -> Option<T> {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }

    /// Returns a borrowed context.
    pub fn release(&self, ctx: T) {
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(ctx);
    }

    /// Contexts currently free.
    pub fn available(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Total contexts.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// A copy failed (e.g. a CUDA error string); never swallowed (seed §9).
#[derive(Debug, Clone, thiserror::Error)]
#[error("copy failed: {0}")]
pub struct CopyError(pub String);

/// Executes a batched copy plan between user memory and an arena region
/// (seed §4 `GatherScatterKernel`). Runs are [`ScatterRun`]s whose
/// `region_offset` is relative to `region_addr` and whose `addr` is user
/// memory (source for gather, destination for scatter).
pub trait CopyEngine: Send + Sync {
    /// Copies every run's segments from user memory into the region.
    fn gather(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError>;
    /// Copies every run's segments from the region to user memory.
    fn scatter(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError>;
    /// Gathers a uniform chunk ([`kvfabric_core::plan::UniformPieces`])
    /// straight from its descriptors: `descs[i].len` (all equal) bytes from
    /// `descs[i].src` to `region_addr + i * stride` (`stride` in bytes, ≥
    /// the length) — no runs planned (issue 18). Calls `meanwhile` exactly
    /// once, also on an error; engines that can overlap call it while the
    /// copy runs (the CUDA engine: between launch and wait), so the caller
    /// plans the chunk's scatter runs meanwhile. The default is
    /// [`gather_uniform_by_runs`].
    ///
    /// # Errors
    /// [`check_uniform`]'s for descriptors of different lengths or a
    /// stride below their length; the engine's copy error otherwise.
    fn gather_uniform(
        &self,
        region_addr: u64,
        descs: &[Descriptor],
        stride: u64,
        meanwhile: &mut dyn FnMut(),
    ) -> Result<(), CopyError> {
        gather_uniform_by_runs(self, region_addr, descs, stride, meanwhile)
    }
    /// Scatters a DATA_UNIFORM's pieces (issue 18 step 3): piece `i` of
    /// `u.segment_len` bytes from `region_addr + i * u.region_stride` to
    /// `u.dsts[i]`. The receiver validated every destination and the
    /// region bounds. The default copies them as runs, one a piece
    /// ([`UniformScatter::to_runs`]).
    ///
    /// # Errors
    /// The engine's copy error.
    fn scatter_uniform(&self, region_addr: u64, u: &UniformScatter) -> Result<(), CopyError> {
        self.scatter(region_addr, &u.to_runs())
    }
    /// Scatters a DATA_BLOCKS' pieces (issue 18 step 3): piece `j` of
    /// `b.segment_len` bytes from `region_addr + j * b.region_stride` to
    /// [`BlockScatter::dst`]`(j)`. The receiver validated every
    /// destination and the region bounds. The default lists the
    /// destinations ([`BlockScatter::to_uniform`]) and scatters them as
    /// [`CopyEngine::scatter_uniform`] does.
    ///
    /// # Errors
    /// A destination that overflows (never a validated scatter's); the
    /// engine's copy error.
    fn scatter_blocks(&self, region_addr: u64, b: &BlockScatter) -> Result<(), CopyError> {
        let u = b
            .to_uniform()
            .ok_or_else(|| CopyError("block scatter destination overflows".into()))?;
        self.scatter_uniform(region_addr, &u)
    }
    /// Gathers several uniform chunks ([`UniformGather`]) as one
    /// submission (issue 18 step 3: one driver submission for a request's
    /// chunks instead of one per chunk, whose concurrent enqueues contend
    /// in the driver). Calls `meanwhile` exactly once, before the first
    /// wait (the CUDA engine: after everything is enqueued; the default:
    /// after the first item is), then `done(i, result)` exactly once for
    /// every item `i`, in order, each once that item's bytes are in its
    /// region (the CUDA engine reports the first item at its own event and
    /// the others together at the last). The default is
    /// [`gather_uniform_each`] (one [`CopyEngine::gather_uniform`] after
    /// the other).
    fn gather_uniform_batch(
        &self,
        items: &[UniformGather<'_>],
        meanwhile: &mut dyn FnMut(),
        done: &mut dyn FnMut(usize, Result<(), CopyError>),
    ) {
        gather_uniform_each(self, items, meanwhile, done);
    }
    /// The longest piece (bytes) whose chunks the transport should hand
    /// this engine together as one [`CopyPlan::Batch`] — engines whose
    /// [`CopyEngine::gather_uniform_batch`] is one submission for uniform
    /// chunks of pieces up to this long. Default 0: no batching, one job a
    /// chunk, run in parallel by the copy workers (a batch the engine
    /// cannot submit at once would run its chunks one after another).
    fn max_batched_piece_bytes(&self) -> u64 {
        0
    }
    /// Short name for logs and metrics ("host", "cuda").
    fn name(&self) -> &'static str;
    /// Test-only fault hook ([`super::faults`]): flips (XOR 0xFF) the byte
    /// at `addr` in an arena region. Engines that cannot refuse.
    fn flip_byte(&self, addr: u64) -> Result<(), CopyError> {
        let _ = addr;
        Err(CopyError(format!("{}: no fault hook", self.name())))
    }
}

/// Checks a uniform gather's input ([`CopyEngine::gather_uniform`]):
/// every descriptor of one length, `stride` (bytes) at least that length,
/// at most `u32::MAX` descriptors. Returns the length (0 for no
/// descriptors).
///
/// # Errors
/// A [`CopyError`] naming what is wrong.
pub fn check_uniform(descs: &[Descriptor], stride: u64) -> Result<u64, CopyError> {
    let len = descs.first().map_or(0, |d| d.len);
    if u32::try_from(descs.len()).is_err() {
        return Err(CopyError(format!(
            "uniform gather of {} descriptors (at most {})",
            descs.len(),
            u32::MAX
        )));
    }
    if let Some((i, d)) = descs.iter().enumerate().find(|(_, d)| d.len != len) {
        return Err(CopyError(format!(
            "uniform gather: descriptor {i} is {} bytes, the first {len}",
            d.len
        )));
    }
    if stride < len {
        return Err(CopyError(format!(
            "uniform gather: stride {stride} bytes is below the descriptor length {len}"
        )));
    }
    Ok(len)
}

/// [`CopyEngine::gather_uniform`] through the run path: checks the input,
/// builds one run per descriptor, calls `meanwhile`, then
/// [`CopyEngine::gather`] (no overlap). Also the CUDA engine's fallback for
/// what its uniform kernel does not serve.
///
/// # Errors
/// As [`CopyEngine::gather_uniform`].
pub fn gather_uniform_by_runs<E: CopyEngine + ?Sized>(
    engine: &E,
    region_addr: u64,
    descs: &[Descriptor],
    stride: u64,
    meanwhile: &mut dyn FnMut(),
) -> Result<(), CopyError> {
    if let Err(e) = check_uniform(descs, stride) {
        meanwhile();
        return Err(e);
    }
    let runs: Vec<ScatterRun> = descs
        .iter()
        .enumerate()
        .map(|(i, d)| ScatterRun {
            region_offset: i as u64 * stride,
            addr: d.src,
            segment_len: d.len,
            region_stride: 0,
            addr_stride: 0,
            count: 1,
        })
        .collect();
    meanwhile();
    engine.gather(region_addr, &runs)
}

/// One chunk of a [`CopyEngine::gather_uniform_batch`]: `descs[i].len`
/// (all equal) bytes from `descs[i].src` to `region_addr + i * stride`
/// (bytes), as [`CopyEngine::gather_uniform`].
#[derive(Clone, Copy, Debug)]
pub struct UniformGather<'a> {
    /// Absolute address of the chunk's staging region.
    pub region_addr: u64,
    /// The chunk's descriptors, all of one length.
    pub descs: &'a [Descriptor],
    /// Bytes between consecutive pieces in the region (≥ their length).
    pub stride: u64,
    /// The request's source planes ([`BlockPlanes::of_srcs`]) and the
    /// index of `descs[0]` in the request, when the sender found them: an
    /// engine may read piece `i`'s source as the planes' address of piece
    /// `first + i` (`n` block addresses staged instead of one a piece;
    /// every length was measured at sizing). `None`: from `descs`.
    pub src_planes: Option<(&'a BlockPlanes, u64)>,
}

/// [`CopyEngine::gather_uniform_batch`] one item after the other through
/// [`CopyEngine::gather_uniform`]: `meanwhile` runs inside the first
/// item's gather (or at once, for no items), each item reports as it ends.
/// The default, and the CUDA engine's fallback for what its batch does not
/// serve.
pub fn gather_uniform_each<E: CopyEngine + ?Sized>(
    engine: &E,
    items: &[UniformGather<'_>],
    meanwhile: &mut dyn FnMut(),
    done: &mut dyn FnMut(usize, Result<(), CopyError>),
) {
    let mut meanwhile = Some(meanwhile);
    for (i, g) in items.iter().enumerate() {
        let r = match meanwhile.take() {
            Some(m) => engine.gather_uniform(g.region_addr, g.descs, g.stride, m),
            None => engine.gather_uniform(g.region_addr, g.descs, g.stride, &mut || {}),
        };
        done(i, r);
    }
    if let Some(m) = meanwhile {
        m();
    }
}

/// Host-memory copy engine: `memcpy` per segment (contiguous runs are one
/// segment, so a dense plan is a few large copies).
///
/// Callers guarantee every address range was validated against registered
/// memory (the transport validates peer-supplied runs before scatter).
#[derive(Debug, Default, Clone, Copy)]
pub struct HostCopyEngine;

impl HostCopyEngine {
    fn copy(region_addr: u64, runs: &[ScatterRun], to_region: bool) {
        for run in runs {
            for (off, addr, len) in run.segments() {
                let region = (region_addr + off) as usize as *mut u8;
                let user = addr as usize as *mut u8;
                // SAFETY: ranges validated by the caller; region and user
                // memory never overlap (arena vs KV pool).
                unsafe {
                    if to_region {
                        std::ptr::copy_nonoverlapping(user, region, len as usize);
                    } else {
                        std::ptr::copy_nonoverlapping(region, user, len as usize);
                    }
                }
            }
        }
    }
}

impl CopyEngine for HostCopyEngine {
    fn gather(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError> {
        Self::copy(region_addr, runs, true);
        Ok(())
    }
    fn gather_uniform(
        &self,
        region_addr: u64,
        descs: &[Descriptor],
        stride: u64,
        meanwhile: &mut dyn FnMut(),
    ) -> Result<(), CopyError> {
        if let Err(e) = check_uniform(descs, stride) {
            meanwhile();
            return Err(e);
        }
        for (i, d) in descs.iter().enumerate() {
            let region = (region_addr + i as u64 * stride) as usize as *mut u8;
            // SAFETY: as for `copy`: sources were validated, the region
            // holds the chunk's packed bytes (`(n - 1) * stride + len`).
            unsafe {
                std::ptr::copy_nonoverlapping(d.src as usize as *const u8, region, d.len as usize)
            };
        }
        meanwhile();
        Ok(())
    }
    fn scatter(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError> {
        Self::copy(region_addr, runs, false);
        Ok(())
    }
    fn scatter_uniform(&self, region_addr: u64, u: &UniformScatter) -> Result<(), CopyError> {
        for (i, &dst) in u.dsts.iter().enumerate() {
            let region = (region_addr + i as u64 * u.region_stride) as usize as *const u8;
            // SAFETY: as for `copy`: destinations and region bounds were
            // validated by the receiver before the scatter started.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    region,
                    dst as usize as *mut u8,
                    u.segment_len as usize,
                )
            };
        }
        Ok(())
    }
    fn name(&self) -> &'static str {
        "host"
    }
    fn flip_byte(&self, addr: u64) -> Result<(), CopyError> {
        // SAFETY: test-only hook; `addr` is inside a live arena region of
        // the scatter about to run (exec::run_job).
        unsafe { *(addr as usize as *mut u8) ^= 0xff };
        Ok(())
    }
}

/// Which way a copy job goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKind {
    /// User memory → arena region (sender).
    Gather,
    /// Arena region → user memory (receiver).
    Scatter,
}

/// What a copy job copies.
#[derive(Debug)]
pub enum CopyPlan {
    /// Runs ready to copy (a receiver's scatter: the DATA's runs; moved
    /// in, never copied — a 16,384-descriptor chunk is 786 KB of runs).
    Runs(Vec<ScatterRun>),
    /// A receiver's scatter of a DATA_UNIFORM ([`CopyEngine::scatter_uniform`];
    /// only valid with [`CopyKind::Scatter`]).
    Uniform(UniformScatter),
    /// A receiver's scatter of a DATA_BLOCKS ([`CopyEngine::scatter_blocks`];
    /// only valid with [`CopyKind::Scatter`]).
    Blocks(BlockScatter),
    /// A sender's chunk, planned on the worker: build the chunk's runs from
    /// the request's descriptors ([`TransferPlan::build_chunk`]), gather
    /// them, and hand the scatter back in [`CopyDone::scatter`]
    /// for the chunk's DATA. Only the sizing pass
    /// ([`TransferPlan::chunk_bounds`]) runs before, on the submitting
    /// thread, so a request's chunks are planned
    /// in parallel on the workers, each just before its gather, instead of
    /// the whole plan (≈0.7–0.9 ms for 16,384 descriptors on the H200
    /// host) serially before the first gather. A chunk of whole
    /// equal-length descriptors ([`TransferPlan::uniform_pieces`]) is
    /// gathered straight from them ([`CopyEngine::gather_uniform`]) and
    /// only its scatter runs are planned, while the copy runs. Only valid
    /// with [`CopyKind::Gather`].
    Chunk(ChunkGather),
    /// Several sender chunks (of one or more requests) started together,
    /// for an engine with a [`max_batched_piece_bytes`](CopyEngine::max_batched_piece_bytes):
    /// when every one is uniform, gathered as one submission
    /// ([`CopyEngine::gather_uniform_batch`]), else one after the other as
    /// [`CopyPlan::Chunk`]s. Each reports its own [`CopyDone`] (its own
    /// token) once its bytes are in its region; the job's `token` and
    /// `region_addr` are unused. Only valid with [`CopyKind::Gather`]
    /// (with another kind every chunk fails).
    Batch(Vec<BatchedChunk>),
}

/// A sender's chunk to gather ([`CopyPlan::Chunk`]).
#[derive(Debug)]
pub struct ChunkGather {
    /// The request's descriptors (shared by all its chunk jobs).
    pub descs: Arc<Vec<Descriptor>>,
    /// The chunk, from `chunk_bounds` over `descs`.
    pub bound: ChunkBound,
    /// The plan's chunk cap, bytes.
    pub max_chunk_size_bytes: u64,
    /// Merge runs (seed `DISABLE_SCATTER_RUN_MERGING` off).
    pub merge_runs: bool,
    /// The peer takes DATA_UNIFORM: a uniform chunk hands back its
    /// pieces' destinations ([`ScatterList::Uniform`]) instead of
    /// planned runs (issue 18 step 3).
    pub uniform_data: bool,
    /// The length (bytes) of every descriptor of `descs`, when they all
    /// have one, as measured by `TransferPlan::chunk_bounds_measured`
    /// over them: a uniform chunk is then found without another pass over
    /// its descriptors (`None`: found by comparing them).
    pub uniform_len: Option<u64>,
    /// The peer takes DATA_BLOCKS: the request's destination planes
    /// ([`BlockPlanes::of`]), found once by the first of its chunks to
    /// describe its scatter (while its gather runs) and shared by all;
    /// a uniform chunk larger than a plane is then described by its
    /// blocks ([`ScatterList::Blocks`]). `None`: the peer does not take
    /// them.
    pub block_planes: Option<Arc<OnceLock<Option<BlockPlanes>>>>,
    /// The request's source planes ([`BlockPlanes::of_srcs`]), found once
    /// by the first batch of its chunks (on the copy worker, before it
    /// stages) and shared by all; `Some` only when its descriptors all
    /// have one length and the engine batches gathers: a batched gather
    /// then reads the sources from them.
    pub src_planes: Option<Arc<OnceLock<Option<BlockPlanes>>>>,
}

/// The chunk's uniform layout ([`TransferPlan::uniform_pieces`]), in O(1)
/// when the request's common length is known.
fn chunk_uniform_pieces(c: &ChunkGather) -> Option<UniformPieces> {
    match c.uniform_len {
        Some(len) => {
            TransferPlan::uniform_pieces_of_len(&c.descs, &c.bound, c.max_chunk_size_bytes, len)
        }
        None => TransferPlan::uniform_pieces(&c.descs, &c.bound, c.max_chunk_size_bytes),
    }
}

/// One chunk of a [`CopyPlan::Batch`]: what a lone [`CopyJob`] of it
/// would carry.
#[derive(Debug)]
pub struct BatchedChunk {
    /// Its token, echoed in its own [`CopyDone`].
    pub token: u64,
    /// Absolute address of its staging region.
    pub region_addr: u64,
    /// The chunk.
    pub chunk: ChunkGather,
}

impl BatchedChunk {
    /// The lone gather job of this chunk ([`CopyPlan::Chunk`]).
    pub fn into_job(self) -> CopyJob {
        CopyJob {
            token: self.token,
            kind: CopyKind::Gather,
            region_addr: self.region_addr,
            plan: CopyPlan::Chunk(self.chunk),
        }
    }
}

impl CopyPlan {
    /// Runs (for [`CopyPlan::Runs`]) or pieces (for the other plans),
    /// for logs.
    pub fn len(&self) -> usize {
        match self {
            CopyPlan::Runs(r) => r.len(),
            CopyPlan::Uniform(u) => u.dsts.len(),
            CopyPlan::Blocks(b) => b.count as usize,
            CopyPlan::Chunk(c) => c.bound.pieces as usize,
            CopyPlan::Batch(b) => b.iter().map(|c| c.chunk.bound.pieces as usize).sum(),
        }
    }

    /// Whether there is nothing to copy.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One copy job for the workers.
#[derive(Debug)]
pub struct CopyJob {
    /// Caller's token, echoed in the completion.
    pub token: u64,
    /// Direction.
    pub kind: CopyKind,
    /// Absolute address of the region (arena base + offset).
    pub region_addr: u64,
    /// The plan.
    pub plan: CopyPlan,
}

/// A finished copy job: its token, direction and outcome.
#[derive(Debug)]
pub struct CopyDone {
    /// The job's token.
    pub token: u64,
    /// The job's direction.
    pub kind: CopyKind,
    /// Outcome.
    pub result: Result<(), CopyError>,
    /// For a [`CopyPlan::Chunk`] gather that succeeded: the chunk's scatter
    /// (its DATA: runs, or the uniform form). Empty runs otherwise.
    pub scatter: ScatterList,
}

/// The test-only in-flight fault ([`super::faults`]): when a flip is
/// armed, one byte of the first non-empty run's arena bytes is flipped
/// before the scatter reads it.
fn flip_if_armed(
    engine: &dyn CopyEngine,
    region_addr: u64,
    runs: &[ScatterRun],
) -> Result<(), CopyError> {
    if !super::faults::enabled() {
        return Ok(());
    }
    if let Some(r) = runs.iter().find(|r| r.segment_len > 0 && r.count > 0) {
        if super::faults::take_scatter_flip() {
            let addr = region_addr + r.region_offset;
            engine.flip_byte(addr)?;
            super::faults::flipped(addr);
        }
    }
    Ok(())
}

/// Runs one job on `engine`: a [`CopyPlan::Chunk`] is planned first (or,
/// when uniform, gathered from its descriptors while its scatter is
/// described: the pieces' destinations for a peer that takes DATA_UNIFORM,
/// else planned runs). Returns the outcome and, for a chunk, its scatter.
fn run_job(
    engine: &dyn CopyEngine,
    kind: CopyKind,
    region_addr: u64,
    plan: CopyPlan,
) -> (Result<(), CopyError>, ScatterList) {
    let none = ScatterList::default;
    match plan {
        CopyPlan::Runs(runs) => {
            let r = match kind {
                CopyKind::Gather => {
                    super::faults::before_gather();
                    engine.gather(region_addr, &runs)
                }
                CopyKind::Scatter => flip_if_armed(engine, region_addr, &runs)
                    .and_then(|()| engine.scatter(region_addr, &runs)),
            };
            (r, none())
        }
        CopyPlan::Uniform(u) => {
            if kind != CopyKind::Scatter {
                return (
                    Err(CopyError("a uniform scatter can only be scattered".into())),
                    none(),
                );
            }
            let first = u.dsts.first().map(|&addr| ScatterRun {
                region_offset: 0,
                addr,
                segment_len: u.segment_len,
                region_stride: 0,
                addr_stride: 0,
                count: 1,
            });
            let r = flip_if_armed(engine, region_addr, first.as_slice())
                .and_then(|()| engine.scatter_uniform(region_addr, &u));
            (r, none())
        }
        CopyPlan::Blocks(b) => {
            if kind != CopyKind::Scatter {
                return (
                    Err(CopyError("a block scatter can only be scattered".into())),
                    none(),
                );
            }
            let first = b.dst(0).map(|addr| ScatterRun {
                region_offset: 0,
                addr,
                segment_len: b.segment_len,
                region_stride: 0,
                addr_stride: 0,
                count: 1,
            });
            let r = flip_if_armed(engine, region_addr, first.as_slice())
                .and_then(|()| engine.scatter_blocks(region_addr, &b));
            (r, none())
        }
        CopyPlan::Chunk(c) => {
            if kind != CopyKind::Gather {
                return (
                    Err(CopyError("a chunk plan can only be gathered".into())),
                    none(),
                );
            }
            gather_one_chunk(engine, region_addr, &c)
        }
        CopyPlan::Batch(_) => (
            Err(CopyError(
                "a batch reports one completion per chunk: run it with run_batch".into(),
            )),
            none(),
        ),
    }
}

/// The scatter of uniform chunk `c` (pieces `u`) for its DATA: the
/// pieces' destinations (DATA_UNIFORM) when the peer takes them and they
/// fit one message, else the seed's (merged) runs.
fn describe_uniform_scatter(
    c: &ChunkGather,
    u: &kvfabric_core::plan::UniformPieces,
) -> Result<ScatterList, kvfabric_core::plan::PlanError> {
    // A DATA_UNIFORM carries an entry a piece: within the decoder's cap
    // (always, now that a chunk holds at most `plan::MAX_CHUNK_PIECES`;
    // kept as the guard), or the seed's (merged) runs.
    let fits = u.count <= kvfabric_core::wire::MAX_ENTRIES as usize;
    if let Some(cell) = &c.block_planes {
        // DATA_BLOCKS: the request's planes (found once, by the first
        // chunk here), a chunk's pieces named by their blocks.
        let planes = cell.get_or_init(|| BlockPlanes::of_dsts(&c.descs));
        if let Some(b) = planes.as_ref().and_then(|p| p.scatter(u)) {
            return Ok(ScatterList::Blocks(b));
        }
    }
    if c.uniform_data && fits {
        // DATA_UNIFORM: the destinations, nothing planned.
        Ok(ScatterList::Uniform(UniformScatter {
            segment_len: u.len,
            region_stride: u.stride,
            dsts: c.descs[u.first_desc..u.first_desc + u.count]
                .iter()
                .map(|d| d.dst)
                .collect(),
        }))
    } else {
        TransferPlan::build_chunk_scatter_runs(
            &c.descs,
            &c.bound,
            c.max_chunk_size_bytes,
            c.merge_runs,
        )
        .map(|p| ScatterList::Runs(p.scatter_runs))
    }
}

/// A uniform chunk's outcome from its gather and its scatter description
/// (`None`: the engine never called `meanwhile`).
fn finish_uniform(
    index: u32,
    gathered: Result<(), CopyError>,
    planned: Option<Result<ScatterList, kvfabric_core::plan::PlanError>>,
) -> (Result<(), CopyError>, ScatterList) {
    match (gathered, planned) {
        (Ok(()), Some(Ok(list))) => (Ok(()), list),
        (Err(e), _) => (Err(e), ScatterList::default()),
        (Ok(()), Some(Err(e))) => (
            Err(CopyError(format!("planning chunk {index}: {e}"))),
            ScatterList::default(),
        ),
        (Ok(()), None) => (
            Err(CopyError(format!(
                "chunk {index}: the copy engine did not plan the scatter runs"
            ))),
            ScatterList::default(),
        ),
    }
}

/// Gathers one sender chunk into the region at `region_addr`: a uniform
/// chunk straight from its descriptors while its scatter is described,
/// any other planned first. Returns the outcome and the chunk's scatter.
fn gather_one_chunk(
    engine: &dyn CopyEngine,
    region_addr: u64,
    c: &ChunkGather,
) -> (Result<(), CopyError>, ScatterList) {
    let bound = &c.bound;
    if let Some(u) = chunk_uniform_pieces(c) {
        // Whole descriptors of one length: gather straight from them and
        // describe the scatter while the copy runs.
        super::faults::before_gather();
        let pieces = &c.descs[u.first_desc..u.first_desc + u.count];
        let mut planned = None;
        let gathered = engine.gather_uniform(region_addr, pieces, u.stride, &mut || {
            planned = Some(describe_uniform_scatter(c, &u));
        });
        tracing::trace!(
            chunk = bound.index,
            pieces = u.count,
            uniform_data = c.uniform_data,
            "uniform chunk gathered"
        );
        return finish_uniform(bound.index, gathered, planned);
    }
    let chunk =
        match TransferPlan::build_chunk(&c.descs, bound, c.max_chunk_size_bytes, c.merge_runs) {
            Ok(p) => p,
            Err(e) => {
                return (
                    Err(CopyError(format!("planning chunk {}: {e}", bound.index))),
                    ScatterList::default(),
                )
            }
        };
    tracing::trace!(
        chunk = bound.index,
        runs = chunk.gather_runs.len(),
        "chunk planned"
    );
    super::faults::before_gather();
    match engine.gather(region_addr, &chunk.gather_runs) {
        Ok(()) => (Ok(()), ScatterList::Runs(chunk.scatter_runs)),
        Err(e) => (Err(e), ScatterList::default()),
    }
}

/// Runs a [`CopyPlan::Batch`] on `engine`, calling `report(token, result,
/// scatter)` exactly once per chunk, in order, each once its gather ended
/// (as the engine's [`CopyEngine::gather_uniform_batch`] reports it). When every chunk is uniform (and there are two or more) they go
/// to [`CopyEngine::gather_uniform_batch`] as one submission, their
/// scatters described while it runs; otherwise each is gathered in turn
/// as a lone [`CopyPlan::Chunk`] would be.
pub fn run_batch(
    engine: &dyn CopyEngine,
    items: Vec<BatchedChunk>,
    report: &mut dyn FnMut(u64, Result<(), CopyError>, ScatterList),
) {
    let pieces: Option<Vec<_>> = items
        .iter()
        .map(|b| chunk_uniform_pieces(&b.chunk))
        .collect();
    let pieces = match pieces {
        Some(p) if items.len() > 1 => p,
        _ => {
            for b in items {
                let (r, scatter) = gather_one_chunk(engine, b.region_addr, &b.chunk);
                report(b.token, r, scatter);
            }
            return;
        }
    };
    for _ in &items {
        super::faults::before_gather();
    }
    let gathers: Vec<UniformGather<'_>> = items
        .iter()
        .zip(&pieces)
        .map(|(b, u)| UniformGather {
            region_addr: b.region_addr,
            descs: &b.chunk.descs[u.first_desc..u.first_desc + u.count],
            stride: u.stride,
            src_planes: b
                .chunk
                .src_planes
                .as_deref()
                .and_then(|cell| {
                    cell.get_or_init(|| BlockPlanes::of_srcs(&b.chunk.descs))
                        .as_ref()
                })
                .map(|p| (p, u.first_desc as u64)),
        })
        .collect();
    let planned: std::cell::RefCell<Vec<Option<_>>> =
        std::cell::RefCell::new((0..items.len()).map(|_| None).collect());
    let mut reported = vec![false; items.len()];
    engine.gather_uniform_batch(
        &gathers,
        &mut || {
            let mut planned = planned.borrow_mut();
            for (k, (b, u)) in items.iter().zip(&pieces).enumerate() {
                planned[k] = Some(describe_uniform_scatter(&b.chunk, u));
            }
        },
        &mut |i, gathered| {
            let Some(b) = items.get(i) else { return };
            if std::mem::replace(&mut reported[i], true) {
                return;
            }
            let list = planned.borrow_mut()[i].take();
            let (r, scatter) = finish_uniform(b.chunk.bound.index, gathered, list);
            report(b.token, r, scatter);
        },
    );
    tracing::trace!(chunks = items.len(), "uniform chunks gathered as one batch");
    // An engine that broke its contract: no chunk is left unanswered.
    for (b, done) in items.iter().zip(reported) {
        if !done {
            report(
                b.token,
                Err(CopyError(format!(
                    "chunk {}: the copy engine did not report its batched gather",
                    b.chunk.bound.index
                ))),
                ScatterList::default(),
            );
        }
    }
}

/// What the copy workers' queue carries.
#[derive(Debug)]
enum WorkerMsg {
    /// A copy to run.
    Job(CopyJob),
    /// The worker's wake line fired ([`WorkerPrimer::prime`]; never sent on
    /// the job queue): start a fresh spin window.
    Prime,
    /// Exit (sent once per worker when the pool is dropped, after every
    /// job already queued).
    Exit,
}

/// One worker's wake-up line: whether it is blocked now, and a
/// one-slot channel that wakes it.
#[derive(Debug)]
struct WakeLine {
    blocked: AtomicBool,
    tx: Sender<()>,
}

/// The next message from `rx`: polls for up to `spin` first, then blocks
/// (flagged in `line` while blocked) until a message or a prime on
/// `prime`. `None` once the queue is closed and empty.
fn next_msg(
    rx: &Receiver<WorkerMsg>,
    spin: Duration,
    line: &WakeLine,
    prime: &Receiver<()>,
    slots: &SpinSlots,
) -> Option<WorkerMsg> {
    // Only `slots`' worth of the pool spin at once (issue 18: one spinning
    // worker takes the next job at once; more took the cores of threads
    // with work); the others block at once.
    let slot = if spin.is_zero() {
        None
    } else {
        slots.try_take()
    };
    if slot.is_some() {
        let start = Instant::now();
        loop {
            match rx.try_recv() {
                Ok(m) => return Some(m),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) if start.elapsed() >= spin => break,
                Err(TryRecvError::Empty) => slots.relax().pause(),
            }
        }
    }
    drop(slot);
    // A prime sent while spinning is stale: the window it asks for is
    // the one just spent.
    while prime.try_recv().is_ok() {}
    line.blocked.store(true, Ordering::Release);
    let m = crossbeam_channel::select! {
        recv(rx) -> m => m.ok(),
        recv(prime) -> _ => Some(WorkerMsg::Prime),
    };
    line.blocked.store(false, Ordering::Release);
    m
}

/// Wakes blocked copy workers ahead of work they are about to get, so
/// their wake-up (50–200 µs on the H200 host) overlaps the work before it
/// — the sender's sizing pass and WANT, the receiver's wait for DATA —
/// instead of delaying the first gather or scatter. Cheap to clone; a
/// no-op without a busy-poll window.
#[derive(Clone, Debug)]
pub struct WorkerPrimer {
    tx: Sender<WorkerMsg>,
    lines: Arc<[WakeLine]>,
    spin: Duration,
    /// The pool's spin slots: a woken worker without one blocks again.
    slots: Arc<SpinSlots>,
}

impl WorkerPrimer {
    /// Starts a spin window on up to `n` of the workers blocked now, as
    /// many as the coming work can use (a hint: a worker that blocks just
    /// after this is not woken, and a woken one that finds nothing goes
    /// back to sleep after its window).
    pub fn prime(&self, n: usize) {
        // No more than can spin: a worker woken without a free spin slot
        // would only block again.
        let mut left = n.min(self.slots.free());
        if self.spin.is_zero() || left == 0 {
            return;
        }
        for line in self.lines.iter() {
            if left == 0 {
                break;
            }
            if line.blocked.load(Ordering::Acquire) && line.tx.try_send(()).is_ok() {
                left -= 1;
            }
        }
    }

    /// Workers blocked in their queue now.
    pub fn idle(&self) -> usize {
        self.lines
            .iter()
            .filter(|l| l.blocked.load(Ordering::Acquire))
            .count()
    }
}

/// `M` worker threads that run copy jobs and report [`CopyDone`] on a
/// channel the IO thread drains (seed §7). Dropping joins them.
pub struct CopyWorkers {
    /// Holds the queue's sender.
    primer: WorkerPrimer,
    threads: Vec<JoinHandle<()>>,
}

impl CopyWorkers {
    /// Starts `count` workers (at least 1) over `engine`, reporting to
    /// `done` and then signalling `waker` (when given) so a waiting IO
    /// thread wakes at once. Threads are named `cp{i}:{name}` (the role
    /// first: Linux keeps 15 bytes of a thread's name).
    ///
    /// `spin`: after each job a worker keeps polling the job queue for up
    /// to this long before it blocks (the transport's busy-poll window;
    /// zero blocks at once). A blocked worker pays a wake-up per job —
    /// 50–200 µs measured on the H200 host between the IO thread queuing a
    /// gather and a worker starting it (docs/benchmarks.md) — which is
    /// longer than the GPU copy itself. At most `spinners`' cap of workers
    /// spin at once, pausing between polls as it says ([`SpinSlots`]).
    pub fn start(
        name: &str,
        count: usize,
        engine: Arc<dyn CopyEngine>,
        done: Sender<CopyDone>,
        waker: Option<Arc<Waker>>,
        spin: Duration,
        spinners: SpinSlots,
    ) -> std::io::Result<Self> {
        let slots = Arc::new(spinners);
        let (tx, rx): (Sender<WorkerMsg>, Receiver<WorkerMsg>) = crossbeam_channel::unbounded();
        let count = count.max(1);
        let (lines, primes): (Vec<WakeLine>, Vec<Receiver<()>>) = (0..count)
            .map(|_| {
                let (tx, rx) = crossbeam_channel::bounded(1);
                (
                    WakeLine {
                        blocked: AtomicBool::new(false),
                        tx,
                    },
                    rx,
                )
            })
            .unzip();
        let lines: Arc<[WakeLine]> = lines.into();
        let mut threads = Vec::new();
        for (i, prime) in primes.into_iter().enumerate() {
            let rx = rx.clone();
            let lines = lines.clone();
            let done = done.clone();
            let engine = engine.clone();
            let waker = waker.clone();
            let slots = slots.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("cp{i}:{name}"))
                    .spawn(move || {
                        while let Some(msg) = next_msg(&rx, spin, &lines[i], &prime, &slots) {
                            let job = match msg {
                                WorkerMsg::Job(job) => job,
                                WorkerMsg::Prime => continue,
                                WorkerMsg::Exit => break,
                            };
                            tracing::trace!(token = job.token, kind = ?job.kind, items = job.plan.len(), "copy start");
                            let kind = job.kind;
                            let mut open = true;
                            let mut report = |token: u64, result: Result<(), CopyError>, scatter| {
                                if let Err(e) = &result {
                                    tracing::warn!(token, ?kind, error = %e, "copy job failed");
                                }
                                tracing::trace!(token, "copy end");
                                open &= done
                                    .send(CopyDone {
                                        token,
                                        kind,
                                        result,
                                        scatter,
                                    })
                                    .is_ok();
                                if let Some(w) = &waker {
                                    w.wake();
                                }
                            };
                            match job.plan {
                                CopyPlan::Batch(items) if kind == CopyKind::Gather => {
                                    run_batch(&*engine, items, &mut report)
                                }
                                CopyPlan::Batch(items) => {
                                    for b in items {
                                        report(
                                            b.token,
                                            Err(CopyError("a batch can only be gathered".into())),
                                            ScatterList::default(),
                                        );
                                    }
                                }
                                plan => {
                                    let (result, scatter) =
                                        run_job(&*engine, kind, job.region_addr, plan);
                                    report(job.token, result, scatter);
                                }
                            }
                            if !open {
                                break;
                            }
                        }
                    })?,
            );
        }
        Ok(Self {
            primer: WorkerPrimer {
                tx,
                lines,
                spin,
                slots,
            },
            threads,
        })
    }

    /// A handle that wakes idle workers ahead of work (see
    /// [`WorkerPrimer`]).
    pub fn primer(&self) -> WorkerPrimer {
        self.primer.clone()
    }

    /// [`WorkerPrimer::prime`].
    pub fn prime(&self, n: usize) {
        self.primer.prime(n);
    }

    /// Queues a job (never blocks: the queue is unbounded, and the number
    /// of jobs in flight is bounded by arena regions).
    pub fn submit(&self, job: CopyJob) {
        let _ = self.primer.tx.send(WorkerMsg::Job(job));
    }
}

impl Drop for CopyWorkers {
    fn drop(&mut self) {
        // After every job already queued; a primer's sender clone may keep
        // the queue open, so exit is a message, not the queue closing.
        for _ in 0..self.threads.len() {
            let _ = self.primer.tx.send(WorkerMsg::Exit);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::spin::Relax;

    /// Guard bytes after a chunk's packed bytes in the test regions.
    const GUARD: usize = 64;

    /// Chunk `index` of `descs` gathered by `run_job` on `engine` into a
    /// region of the chunk's packed bytes plus [`GUARD`] bytes of 0xA5:
    /// the region's bytes and the returned scatter (DATA_UNIFORM's form
    /// for a uniform chunk when `uniform_data`).
    fn gather_chunk_as(
        engine: &dyn CopyEngine,
        descs: &Arc<Vec<Descriptor>>,
        max: u64,
        index: usize,
        uniform_data: bool,
    ) -> (Vec<u8>, Result<ScatterList, CopyError>) {
        let (bounds, uniform_len) = TransferPlan::chunk_bounds_measured(descs, max).unwrap();
        let mut region = vec![0xA5u8; bounds[index].packed_bytes as usize + GUARD];
        let (r, runs) = run_job(
            engine,
            CopyKind::Gather,
            region.as_mut_ptr() as u64,
            CopyPlan::Chunk(ChunkGather {
                descs: descs.clone(),
                bound: bounds[index],
                max_chunk_size_bytes: max,
                merge_runs: true,
                uniform_data,
                uniform_len,
                block_planes: None,
                src_planes: None,
            }),
        );
        (region, r.map(|()| runs))
    }

    /// DATA_BLOCKS end to end on the host (issue 18 step 3): a block
    /// hand-off (3 planes of 24 blocks, 4 KiB each, shuffled ids) gathered
    /// for a peer that takes blocks hands back each uniform chunk's block
    /// form — the plane's 24 destinations, not one a piece, also for the
    /// chunks starting inside a plane — and scattering it (the host
    /// engine through the trait's default) lands exactly the bytes of the
    /// planned runs, nothing else in the pool; a chunk no larger than a
    /// plane keeps the uniform form.
    #[test]
    fn block_data_scatters_like_the_planned_runs() {
        let (blocks, planes, len) = (24usize, 3usize, 4096usize);
        let n = blocks * planes;
        let src: Vec<u8> = (0..n * len).map(|i| (i * 31 + i / 4096) as u8).collect();
        let pool_len = planes * 2 * blocks * len;
        let mut dst_a = vec![0x5Au8; pool_len];
        let mut dst_ref = vec![0x5Au8; pool_len];
        let descs_for = |pool: &mut Vec<u8>| -> Arc<Vec<Descriptor>> {
            let (s, d) = (src.as_ptr() as u64, pool.as_mut_ptr() as u64);
            Arc::new(
                (0..n)
                    .map(|k| {
                        let (q, i) = (k / blocks, k % blocks);
                        let id = (i * 7 + 3) % (2 * blocks);
                        let dst = d + ((q * 2 * blocks + id) * len) as u64;
                        Descriptor::new(s + (k * len) as u64, dst, len as u64)
                    })
                    .collect(),
            )
        };
        let (a, r) = (descs_for(&mut dst_a), descs_for(&mut dst_ref));
        for (max, want_blocks) in [(40 * 4096u64, true), (16 * 4096, false)] {
            let (bounds, uniform_len) = TransferPlan::chunk_bounds_measured(&a, max).unwrap();
            let cell = Arc::new(OnceLock::new());
            for (index, bound) in bounds.iter().enumerate() {
                let mut region = vec![0xA5u8; bound.packed_bytes as usize + GUARD];
                let (res, list) = run_job(
                    &HostCopyEngine,
                    CopyKind::Gather,
                    region.as_mut_ptr() as u64,
                    CopyPlan::Chunk(ChunkGather {
                        descs: a.clone(),
                        bound: *bound,
                        max_chunk_size_bytes: max,
                        merge_runs: true,
                        uniform_data: true,
                        uniform_len,
                        block_planes: Some(cell.clone()),
                        src_planes: None,
                    }),
                );
                res.unwrap();
                let (rr, runs) = gather_chunk(&HostCopyEngine, &r, max, index);
                assert_eq!(region, rr);
                match list {
                    ScatterList::Blocks(b) => {
                        assert!(want_blocks, "chunk {index}: blocks for a small chunk");
                        assert_eq!(b.offsets.len(), blocks);
                        assert_eq!(b.first, bound.first_desc as u64);
                        let (res, _) = run_job(
                            &HostCopyEngine,
                            CopyKind::Scatter,
                            region.as_ptr() as u64,
                            CopyPlan::Blocks(b),
                        );
                        res.unwrap();
                    }
                    ScatterList::Uniform(u) if !want_blocks || bound.pieces <= 24 => {
                        HostCopyEngine
                            .scatter_uniform(region.as_ptr() as u64, &u)
                            .unwrap();
                    }
                    other => panic!("chunk {index}: {other:?}"),
                }
                HostCopyEngine
                    .scatter(rr.as_ptr() as u64, &runs.unwrap())
                    .unwrap();
            }
            assert_eq!(dst_a, dst_ref);
            assert!(dst_ref.iter().any(|&x| x != 0x5A) && dst_ref.contains(&0x5A));
        }
    }

    /// [`gather_chunk_as`] with runs (a peer without DATA_UNIFORM).
    fn gather_chunk(
        engine: &dyn CopyEngine,
        descs: &Arc<Vec<Descriptor>>,
        max: u64,
        index: usize,
    ) -> (Vec<u8>, Result<Vec<ScatterRun>, CopyError>) {
        let (region, r) = gather_chunk_as(engine, descs, max, index, false);
        let runs = r.map(|l| match l {
            ScatterList::Runs(runs) => runs,
            other => panic!("runs expected, got {other:?}"),
        });
        (region, runs)
    }

    /// The reference: the full plan's chunk gathered through its gather
    /// runs, and its scatter runs.
    fn planned_chunk(descs: &[Descriptor], max: u64, index: usize) -> (Vec<u8>, Vec<ScatterRun>) {
        let plan = TransferPlan::build(descs, max, true).unwrap();
        let c = &plan.chunks()[index];
        let mut region = vec![0xA5u8; c.packed_bytes as usize + GUARD];
        HostCopyEngine
            .gather(region.as_mut_ptr() as u64, &c.gather_runs)
            .unwrap();
        (region, c.scatter_runs.clone())
    }

    /// Only the trait's default uniform gather (through runs).
    struct RunsOnly;
    impl CopyEngine for RunsOnly {
        fn gather(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError> {
            HostCopyEngine.gather(region_addr, runs)
        }
        fn scatter(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError> {
            HostCopyEngine.scatter(region_addr, runs)
        }
        fn name(&self) -> &'static str {
            "runs-only"
        }
    }

    /// A chunk of equal-length descriptors (the uniform gather, issue 18)
    /// lands exactly the bytes the full plan's gather runs land — padding
    /// between pieces untouched, nothing past the chunk — and hands back
    /// the full plan's scatter runs, on the host engine and the trait's
    /// default; a chunk of mixed lengths is planned as before; bad uniform
    /// input is an error, with `meanwhile` still called once.
    #[test]
    fn uniform_chunks_gather_like_the_full_plan() {
        let len = 4090usize; // stride 4096: 6 padding bytes a piece
        let n = 64usize;
        let src: Vec<u8> = (0..n * 4096).map(|i| (i * 7 + i / 4096) as u8).collect();
        let base = src.as_ptr() as u64;
        let order: Vec<usize> = (0..n).map(|i| (i * 37 + 11) % n).collect();
        let descs: Vec<Descriptor> = order
            .iter()
            .enumerate()
            .map(|(k, &s)| {
                Descriptor::new(
                    base + (s * 4096) as u64,
                    0x10_0000 + (k * 3 * 4096) as u64,
                    len as u64,
                )
            })
            .collect();
        let max = 16 * 4096u64;
        let uniform = Arc::new(descs);
        let bounds = TransferPlan::chunk_bounds(&uniform, max).unwrap();
        assert_eq!(bounds.len(), 4);
        for (index, bound) in bounds.iter().enumerate() {
            assert!(TransferPlan::uniform_pieces(&uniform, bound, max).is_some());
            let want = planned_chunk(&uniform, max, index);
            for engine in [&HostCopyEngine as &dyn CopyEngine, &RunsOnly] {
                let (region, runs) = gather_chunk(engine, &uniform, max, index);
                assert_eq!(region, want.0, "chunk {index} bytes ({})", engine.name());
                assert_eq!(
                    runs.unwrap(),
                    want.1,
                    "chunk {index} runs ({})",
                    engine.name()
                );
            }
            assert!(want.0[want.0.len() - GUARD..].iter().all(|&b| b == 0xA5));
            assert_eq!(want.0[len], 0xA5, "padding after piece 0");
        }
        // One shorter descriptor: not uniform, planned runs.
        let mut mixed = (*uniform).clone();
        mixed[3].len = 100;
        let mixed = Arc::new(mixed);
        let b0 = TransferPlan::chunk_bounds(&mixed, max).unwrap()[0];
        assert!(TransferPlan::uniform_pieces(&mixed, &b0, max).is_none());
        let (region, runs) = gather_chunk(&HostCopyEngine, &mixed, max, 0);
        assert_eq!((region, runs.unwrap()), planned_chunk(&mixed, max, 0));
        // Bad uniform input: an error, `meanwhile` called once.
        for (ds, stride) in [(&uniform[..2], 4000u64), (&mixed[..8], 4096)] {
            let mut calls = 0;
            let mut region = vec![0u8; 16 * 4096];
            for engine in [&HostCopyEngine as &dyn CopyEngine, &RunsOnly] {
                let r = engine
                    .gather_uniform(region.as_mut_ptr() as u64, ds, stride, &mut || calls += 1);
                assert!(r.is_err(), "{} accepted stride {stride}", engine.name());
            }
            assert_eq!(calls, 2);
            assert!(region.iter().all(|&b| b == 0));
        }
    }

    /// DATA_UNIFORM end to end on the host (issue 18 step 3): a uniform
    /// chunk gathered for a peer that takes it hands back its pieces'
    /// destinations and stride — no runs — and scattering that list
    /// (host engine, and the trait's default through runs) lands exactly
    /// the bytes of scattering the full plan's runs, nothing else in the
    /// destination pool; a mixed chunk still hands back runs.
    #[test]
    fn uniform_data_scatters_like_the_planned_runs() {
        let len = 4090usize;
        let n = 48usize;
        let src: Vec<u8> = (0..n * 4096).map(|i| (i * 13 + i / 4096) as u8).collect();
        let pool_len = n * 2 * 4096;
        let mut dst_a = vec![0x5Au8; pool_len];
        let mut dst_b = vec![0x5Au8; pool_len];
        let mut dst_ref = vec![0x5Au8; pool_len];
        let descs_for = |pool: &mut Vec<u8>| -> Arc<Vec<Descriptor>> {
            let (s, d) = (src.as_ptr() as u64, pool.as_mut_ptr() as u64);
            Arc::new(
                (0..n)
                    .map(|k| {
                        let slot = (k * 29 + 5) % (2 * n);
                        Descriptor::new(s + (k * 4096) as u64, d + (slot * 4096) as u64, len as u64)
                    })
                    .collect(),
            )
        };
        let max = 16 * 4096u64;
        let (a, b, r) = (
            descs_for(&mut dst_a),
            descs_for(&mut dst_b),
            descs_for(&mut dst_ref),
        );
        for index in 0..3 {
            let (ra, la) = gather_chunk_as(&HostCopyEngine, &a, max, index, true);
            let ScatterList::Uniform(u) = la.unwrap() else {
                panic!("uniform list expected")
            };
            assert_eq!(
                (u.segment_len, u.region_stride, u.dsts.len()),
                (len as u64, 4096, 16)
            );
            let first = index * 16;
            assert!(u
                .dsts
                .iter()
                .enumerate()
                .all(|(i, &d)| d == a[first + i].dst));
            let (rb, lb) = gather_chunk_as(&RunsOnly, &b, max, index, true);
            let ScatterList::Uniform(ub) = lb.unwrap() else {
                panic!("uniform list expected")
            };
            let (rr, runs) = gather_chunk(&HostCopyEngine, &r, max, index);
            assert_eq!(ra, rr);
            assert_eq!(rb, rr);
            HostCopyEngine
                .scatter_uniform(ra.as_ptr() as u64, &u)
                .unwrap();
            RunsOnly.scatter_uniform(rb.as_ptr() as u64, &ub).unwrap();
            HostCopyEngine
                .scatter(rr.as_ptr() as u64, &runs.unwrap())
                .unwrap();
        }
        assert_eq!(dst_a, dst_ref);
        assert_eq!(dst_b, dst_ref);
        assert!(dst_ref.iter().any(|&x| x != 0x5A) && dst_ref.contains(&0x5A));
        // A chunk of mixed lengths: runs even for a peer that takes
        // DATA_UNIFORM.
        let mut mixed = (*a).clone();
        mixed[2].len = 100;
        let mixed = Arc::new(mixed);
        let (_, l) = gather_chunk_as(&HostCopyEngine, &mixed, max, 0, true);
        assert!(matches!(l.unwrap(), ScatterList::Runs(_)));
    }

    /// A host engine whose batch is one call (as the CUDA engine's):
    /// copies every item, runs `meanwhile`, then reports them in order;
    /// counts its batch calls.
    #[derive(Default)]
    struct OneSubmission {
        batches: std::sync::atomic::AtomicUsize,
        /// Report nothing (an engine that breaks its contract).
        silent: bool,
    }
    impl CopyEngine for OneSubmission {
        fn gather(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError> {
            HostCopyEngine.gather(region_addr, runs)
        }
        fn scatter(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError> {
            HostCopyEngine.scatter(region_addr, runs)
        }
        fn gather_uniform_batch(
            &self,
            items: &[UniformGather<'_>],
            meanwhile: &mut dyn FnMut(),
            done: &mut dyn FnMut(usize, Result<(), CopyError>),
        ) {
            self.batches.fetch_add(1, Ordering::SeqCst);
            let rs: Vec<_> = items
                .iter()
                .map(|g| {
                    HostCopyEngine.gather_uniform(g.region_addr, g.descs, g.stride, &mut || {})
                })
                .collect();
            meanwhile();
            if self.silent {
                return;
            }
            for (i, r) in rs.into_iter().enumerate() {
                done(i, r);
            }
        }
        fn max_batched_piece_bytes(&self) -> u64 {
            u64::MAX
        }
        fn name(&self) -> &'static str {
            "one-submission"
        }
    }

    /// A host engine whose batch gathers from the items' source planes
    /// when they come with them (as the CUDA engine's block gather), from
    /// the descriptors otherwise; counts the items that came with planes.
    #[derive(Default)]
    struct FromPlanes {
        with_planes: std::sync::atomic::AtomicUsize,
    }
    impl CopyEngine for FromPlanes {
        fn gather(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError> {
            HostCopyEngine.gather(region_addr, runs)
        }
        fn scatter(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError> {
            HostCopyEngine.scatter(region_addr, runs)
        }
        fn gather_uniform_batch(
            &self,
            items: &[UniformGather<'_>],
            meanwhile: &mut dyn FnMut(),
            done: &mut dyn FnMut(usize, Result<(), CopyError>),
        ) {
            for g in items {
                let Some((planes, first)) = g.src_planes else {
                    let r =
                        HostCopyEngine.gather_uniform(g.region_addr, g.descs, g.stride, &mut || {});
                    assert!(r.is_ok());
                    continue;
                };
                self.with_planes.fetch_add(1, Ordering::SeqCst);
                for (i, d) in g.descs.iter().enumerate() {
                    let src = planes.addr(first + i as u64).expect("in range");
                    let to = g.region_addr + i as u64 * g.stride;
                    // SAFETY: test buffers; the derived source is a
                    // descriptor's source (the planes were found in them).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src as usize as *const u8,
                            to as usize as *mut u8,
                            d.len as usize,
                        )
                    };
                }
            }
            meanwhile();
            for i in 0..items.len() {
                done(i, Ok(()));
            }
        }
        fn max_batched_piece_bytes(&self) -> u64 {
            u64::MAX
        }
        fn name(&self) -> &'static str {
            "from-planes"
        }
    }

    /// The block gather's wiring (issue 18 step 3): a batch of a block
    /// hand-off's chunks (3 planes of 32 blocks, shuffled in each pool)
    /// hands the engine the request's source planes — found once, by the
    /// batch — and the chunk's first piece index, and gathering from them
    /// lands exactly what the descriptors name; sources without planes
    /// (random slots) reach the engine without.
    #[test]
    fn a_block_hand_off_batch_gathers_from_its_source_planes() {
        let (blocks, planes, len) = (32usize, 3usize, 256usize);
        let n = blocks * planes;
        let src: Vec<u8> = (0..2 * n * len).map(|i| (i * 7 + i / 256) as u8).collect();
        let base = src.as_ptr() as u64;
        for (planar, want_planes) in [(true, 3usize), (false, 0)] {
            let descs: Vec<Descriptor> = (0..n)
                .map(|k| {
                    let (q, i) = (k / blocks, k % blocks);
                    let slot = if planar {
                        q * 2 * blocks + (i * 5 + 3) % (2 * blocks)
                    } else {
                        (k * 37 + 11) % (2 * n)
                    };
                    Descriptor::new(base + (slot * len) as u64, 0, len as u64)
                })
                .collect();
            let ds = Arc::new(descs);
            let max = 40 * len as u64;
            let bounds = TransferPlan::chunk_bounds(&ds, max).unwrap();
            let mut regions: Vec<Vec<u8>> = bounds
                .iter()
                .map(|b| vec![0u8; b.packed_bytes as usize])
                .collect();
            let mut items = batch_items(&mut regions, &bounds, &ds, max, true, 1);
            let cell = Arc::new(OnceLock::new());
            for it in &mut items {
                it.chunk.src_planes = Some(cell.clone());
            }
            let engine = FromPlanes::default();
            let mut reported = 0;
            run_batch(&engine, items, &mut |_, r, _| {
                assert!(r.is_ok());
                reported += 1;
            });
            assert_eq!(reported, bounds.len());
            assert_eq!(engine.with_planes.load(Ordering::SeqCst), want_planes);
            assert_eq!(cell.get().map(Option::is_some), Some(planar));
            for (b, region) in bounds.iter().zip(&regions) {
                for j in 0..b.pieces as usize {
                    let d = ds[b.first_desc + j];
                    // SAFETY: `d.src` lies in `src`.
                    let want =
                        unsafe { std::slice::from_raw_parts(d.src as usize as *const u8, len) };
                    assert_eq!(&region[j * len..(j + 1) * len], want, "piece {j}");
                }
            }
        }
    }

    /// One [`BatchedChunk`] per bound of `ds`, gathered into `regions`
    /// (one a bound), tokens from `first_token`.
    fn batch_items(
        regions: &mut [Vec<u8>],
        bounds: &[ChunkBound],
        ds: &Arc<Vec<Descriptor>>,
        max: u64,
        uniform_data: bool,
        first_token: u64,
    ) -> Vec<BatchedChunk> {
        // As the transport keeps it from sizing.
        let uniform_len = TransferPlan::chunk_bounds_measured(ds, max).unwrap().1;
        regions
            .iter_mut()
            .zip(bounds)
            .enumerate()
            .map(|(i, (r, b))| BatchedChunk {
                token: first_token + i as u64,
                region_addr: r.as_mut_ptr() as u64,
                chunk: ChunkGather {
                    descs: ds.clone(),
                    bound: *b,
                    max_chunk_size_bytes: max,
                    merge_runs: true,
                    uniform_data,
                    uniform_len,
                    block_planes: None,
                    src_planes: None,
                },
            })
            .collect()
    }

    /// A batch of a request's chunks (issue 18 step 3, `batchGathers`)
    /// lands in every chunk's region exactly the bytes a lone chunk job
    /// lands, with the same scatter (DATA_UNIFORM and runs), each reported
    /// once under its own token, in order — through one batch call on an
    /// engine that batches, one chunk after the other on the default; a
    /// batch holding a chunk of mixed lengths is gathered chunk by chunk;
    /// an engine that reports nothing leaves no chunk unanswered.
    #[test]
    fn batched_gathers_land_like_lone_chunks() {
        let len = 4096usize;
        let n = 96usize;
        let src: Vec<u8> = (0..n * len).map(|i| (i * 13 + i / 4096) as u8).collect();
        let base = src.as_ptr() as u64;
        let descs: Vec<Descriptor> = (0..n)
            .map(|k| {
                let s = (k * 53 + 7) % n;
                Descriptor::new(
                    base + (s * len) as u64,
                    0x20_0000 + (k * 2 * len) as u64,
                    len as u64,
                )
            })
            .collect();
        let max = 32 * len as u64;
        let mut mixed = descs.clone();
        mixed[40].len = 100;
        for (ds, uniform_data, expect_batch) in [
            (Arc::new(descs.clone()), true, true),
            (Arc::new(descs), false, true),
            (Arc::new(mixed), true, false),
        ] {
            let bounds = TransferPlan::chunk_bounds(&ds, max).unwrap();
            assert_eq!(bounds.len(), 3);
            let want: Vec<_> = (0..3)
                .map(|i| {
                    let (region, list) =
                        gather_chunk_as(&HostCopyEngine, &ds, max, i, uniform_data);
                    (region, list.unwrap())
                })
                .collect();
            let one = OneSubmission::default();
            let engines: [(&dyn CopyEngine, Option<&OneSubmission>); 2] =
                [(&HostCopyEngine, None), (&one, Some(&one))];
            for (engine, counted) in engines {
                let mut regions: Vec<Vec<u8>> =
                    want.iter().map(|(r, _)| vec![0xA5u8; r.len()]).collect();
                let items = batch_items(&mut regions, &bounds, &ds, max, uniform_data, 100);
                let mut got = Vec::new();
                run_batch(engine, items, &mut |token, r, list| {
                    got.push((token, r.map(|()| list)))
                });
                assert_eq!(
                    got.iter().map(|g| g.0).collect::<Vec<_>>(),
                    vec![100, 101, 102],
                    "{}",
                    engine.name()
                );
                for (i, (_, r)) in got.into_iter().enumerate() {
                    assert_eq!(
                        r.unwrap(),
                        want[i].1,
                        "chunk {i} scatter ({})",
                        engine.name()
                    );
                    assert_eq!(regions[i], want[i].0, "chunk {i} bytes ({})", engine.name());
                }
                if let Some(c) = counted {
                    let batches = c.batches.load(Ordering::SeqCst);
                    assert_eq!(batches, usize::from(expect_batch), "batch calls");
                }
            }
        }
        // Nothing reported by the engine: every chunk fails, once.
        let silent = OneSubmission {
            silent: true,
            ..Default::default()
        };
        let ds = Arc::new(
            (0..64)
                .map(|k| Descriptor::new(base + (k * len) as u64, 0x20_0000, len as u64))
                .collect::<Vec<_>>(),
        );
        let bounds = TransferPlan::chunk_bounds(&ds, max).unwrap();
        let mut regions = vec![vec![0u8; max as usize]; 2];
        let items = batch_items(&mut regions, &bounds, &ds, max, true, 0);
        let mut got = Vec::new();
        run_batch(&silent, items, &mut |token, r, _| got.push((token, r)));
        assert_eq!(got.len(), 2);
        for (i, (token, r)) in got.into_iter().enumerate() {
            assert_eq!(token, i as u64);
            assert!(r.unwrap_err().0.contains("did not report"));
        }
    }

    fn job(token: u64) -> WorkerMsg {
        WorkerMsg::Job(CopyJob {
            token,
            kind: CopyKind::Scatter,
            region_addr: 0,
            plan: CopyPlan::Runs(Vec::new()),
        })
    }

    fn token(m: Option<WorkerMsg>) -> Option<u64> {
        match m {
            Some(WorkerMsg::Job(j)) => Some(j.token),
            _ => None,
        }
    }

    #[test]
    fn next_msg_takes_a_job_queued_during_the_spin_or_after_it() {
        for (spin, relax) in [
            (Duration::ZERO, Relax::Yield),
            (Duration::from_millis(50), Relax::Yield),
            (Duration::from_millis(50), Relax::Spin),
        ] {
            let slots = SpinSlots::with_relax(1, relax);
            let (ptx, prx) = crossbeam_channel::bounded(1);
            let line = WakeLine {
                blocked: AtomicBool::new(false),
                tx: ptx,
            };
            let (tx, rx) = crossbeam_channel::unbounded();
            let sender = std::thread::spawn(move || {
                // One job inside the spin window, one after it.
                std::thread::sleep(Duration::from_millis(5));
                tx.send(job(1)).unwrap();
                std::thread::sleep(Duration::from_millis(80));
                tx.send(job(2)).unwrap();
                // Dropping `tx` closes the queue.
            });
            assert_eq!(
                token(next_msg(&rx, spin, &line, &prx, &slots)),
                Some(1),
                "spin {spin:?}"
            );
            assert_eq!(
                token(next_msg(&rx, spin, &line, &prx, &slots)),
                Some(2),
                "spin {spin:?}"
            );
            sender.join().unwrap();
            assert!(
                next_msg(&rx, spin, &line, &prx, &slots).is_none(),
                "a closed queue ends the worker"
            );
            assert!(!line.blocked.load(Ordering::Acquire));
        }
    }

    /// A copy engine that counts its copies.
    #[derive(Default)]
    struct Counting(std::sync::atomic::AtomicUsize);

    impl CopyEngine for Counting {
        fn gather(&self, _: u64, _: &[ScatterRun]) -> Result<(), CopyError> {
            self.0.fetch_add(1, Ordering::AcqRel);
            Ok(())
        }
        fn scatter(&self, _: u64, _: &[ScatterRun]) -> Result<(), CopyError> {
            self.0.fetch_add(1, Ordering::AcqRel);
            Ok(())
        }
        fn name(&self) -> &'static str {
            "counting"
        }
    }

    /// Polls `cond` (yielding) until it holds; fails with `what` after 5 s.
    fn until(cond: impl Fn() -> bool, what: &str) {
        let t0 = Instant::now();
        while !cond() {
            assert!(t0.elapsed() < Duration::from_secs(5), "{what}");
            std::thread::yield_now();
        }
    }

    /// A worker runs a batch job as one engine call and reports one
    /// completion per chunk, each with its own token and scatter, in order.
    #[test]
    fn a_batch_job_reports_every_chunk_under_its_own_token() {
        let engine = Arc::new(OneSubmission::default());
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let workers = CopyWorkers::start(
            "batch",
            2,
            engine.clone(),
            done_tx,
            None,
            Duration::ZERO,
            SpinSlots::new(0),
        )
        .unwrap();
        let len = 4096usize;
        let src: Vec<u8> = (0..48 * len).map(|i| (i % 251) as u8).collect();
        let ds = Arc::new(
            (0..48)
                .map(|k| {
                    Descriptor::new(src.as_ptr() as u64 + (k * len) as u64, 0x1000, len as u64)
                })
                .collect::<Vec<_>>(),
        );
        let max = 16 * len as u64;
        let bounds = TransferPlan::chunk_bounds(&ds, max).unwrap();
        let mut regions = vec![vec![0u8; max as usize]; bounds.len()];
        let items = batch_items(&mut regions, &bounds, &ds, max, true, 7);
        workers.submit(CopyJob {
            token: 7,
            kind: CopyKind::Gather,
            region_addr: 0,
            plan: CopyPlan::Batch(items),
        });
        for (i, region) in regions.iter().enumerate() {
            let d = done_rx.recv_timeout(Duration::from_secs(5)).unwrap();
            assert_eq!(d.token, 7 + i as u64);
            assert!(d.result.is_ok(), "{:?}", d.result);
            let ScatterList::Uniform(u) = d.scatter else {
                panic!("chunk {i}: a uniform scatter expected")
            };
            assert_eq!(u.dsts.len(), 16);
            assert_eq!(&region[..], &src[i * 16 * len..(i + 1) * 16 * len]);
        }
        // A batch sent as a scatter: every chunk fails, once, by token.
        let mut regions = vec![vec![0u8; max as usize]; bounds.len()];
        let items = batch_items(&mut regions, &bounds, &ds, max, true, 20);
        workers.submit(CopyJob {
            token: 20,
            kind: CopyKind::Scatter,
            region_addr: 0,
            plan: CopyPlan::Batch(items),
        });
        for i in 0..bounds.len() as u64 {
            let d = done_rx.recv_timeout(Duration::from_secs(5)).unwrap();
            assert_eq!(d.token, 20 + i);
            assert!(d.result.unwrap_err().0.contains("only be gathered"));
        }
        drop(workers);
        assert!(done_rx.try_recv().is_err(), "one completion per chunk");
        assert_eq!(engine.batches.load(Ordering::SeqCst), 1);
    }

    /// Submits `n` empty gathers (tokens 0..n) to `workers` and checks
    /// that each completes once (≤ 5 s each).
    fn run_empty_gathers(workers: &CopyWorkers, done_rx: &Receiver<CopyDone>, n: u64) {
        for t in 0..n {
            workers.submit(CopyJob {
                token: t,
                kind: CopyKind::Gather,
                region_addr: 0,
                plan: CopyPlan::Runs(Vec::new()),
            });
        }
        let mut tokens: Vec<u64> = (0..n)
            .map(|_| done_rx.recv_timeout(Duration::from_secs(5)).unwrap().token)
            .collect();
        tokens.sort_unstable();
        assert_eq!(tokens, (0..n).collect::<Vec<_>>());
    }

    /// Issue 18: with a cap of one spinning worker, the other two block at
    /// once instead of spinning their window (here 2 s) after starting;
    /// jobs still all run.
    #[test]
    fn only_the_capped_number_of_workers_spin() {
        let engine = Arc::new(Counting::default());
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let t0 = Instant::now();
        let workers = CopyWorkers::start(
            "cap",
            3,
            engine.clone(),
            done_tx,
            None,
            Duration::from_secs(2),
            SpinSlots::new(1),
        )
        .unwrap();
        let primer = workers.primer();
        until(|| primer.idle() >= 2, "two workers never blocked");
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "uncapped workers spun their window: {:?}",
            t0.elapsed()
        );
        // A prime finds no free slot: wakes nobody.
        primer.prime(3);
        assert!(primer.idle() >= 2);
        run_empty_gathers(&workers, &done_rx, 6);
    }

    #[test]
    fn primed_workers_still_run_every_job_and_drop_joins_despite_a_live_primer() {
        let engine = Arc::new(Counting::default());
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        let workers = CopyWorkers::start(
            "prime",
            3,
            engine.clone(),
            done_tx,
            None,
            // Long enough that all three are seen spinning at once after
            // the prime, even on a 2-core host.
            Duration::from_millis(300),
            SpinSlots::new(3),
        )
        .unwrap();
        let primer = workers.primer();
        // All three block once their first spin window ends.
        until(|| primer.idle() == 3, "workers never went idle");
        // A prime for one wakes one.
        primer.prime(1);
        until(
            || primer.idle() == 2,
            "prime(1) did not wake exactly one worker",
        );
        // Its window ends: all three block again.
        until(
            || primer.idle() == 3,
            "a primed worker never went idle again",
        );
        primer.prime(3);
        // Primed: all three spin again.
        until(|| primer.idle() == 0, "prime woke no worker");
        run_empty_gathers(&workers, &done_rx, 10);
        // Dropping joins the workers although `primer` keeps the queue open
        // (on another thread, so a hang fails the test instead of stalling it).
        let (joined_tx, joined_rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            drop(workers);
            let _ = joined_tx.send(());
        });
        assert!(
            joined_rx.recv_timeout(Duration::from_secs(5)).is_ok(),
            "dropping the pool did not join its workers"
        );
        assert_eq!(engine.0.load(Ordering::Acquire), 10);
        primer.prime(3); // harmless after the workers are gone
    }
}
