//! Transfer plan: bin-pack scattered descriptors into chunks and coalesce the
//! per-chunk gather / scatter views into runs (seed §4 `BounceTransferPlan`,
//! §6 "Small control messages").
//!
//! # Packing rules
//!
//! Descriptors are packed **in order** (the plan never reorders) into chunks
//! of at most `max_chunk_size_bytes` packed bytes. Each chunk is moved by one
//! RDMA write into one arena region of exactly [`Chunk::packed_bytes`] bytes.
//!
//! * Every piece starts at a region offset that is a multiple of [`ALIGN`]
//!   (32 bytes), so the gather/scatter kernel can use vectorized copies.
//! * Zero-length descriptors are skipped (they produce no piece).
//! * A descriptor that fits in the current chunk's remaining space goes there.
//! * A descriptor that does not fit in the current chunk but **fits entirely
//!   in a fresh chunk** closes the current chunk and starts a new one (it is
//!   not split). This keeps every such descriptor in one piece, so the runs of
//!   the dense case stay regular (a split would break a strided run in two
//!   and cost an extra entry per chunk) at the price of at most one
//!   descriptor's worth of tail slack per chunk.
//! * A descriptor **larger than a whole chunk** is split: its first piece
//!   fills the current chunk's remaining space (or a fresh chunk if the
//!   current one is full), each further piece takes a whole fresh chunk, and
//!   the last piece starts the next chunk at offset 0.
//! * A chunk holds at most [`MAX_CHUNK_PIECES`] pieces (the wire's entry
//!   cap, so its unmerged DATA always fits): the next piece starts a fresh
//!   chunk even with region space left.
//!
//! # Runs
//!
//! For every chunk the plan keeps two coalesced views of the same pieces, in
//! the same (region-offset) order:
//!
//! * `scatter_runs`: region offset → receiver destination (`Descriptor::dst`),
//!   carried by DATA (seed §5) and used by the receiver's scatter kernel;
//! * `gather_runs`: sender source (`Descriptor::src`) → region offset, used by
//!   the sender's gather kernel.
//!
//! Pieces whose `(region_offset, addr)` both continue contiguously are fused
//! into one longer segment; runs of equal-length segments whose
//! `(region_offset, addr)` advance by a uniform forward stride collapse into
//! one [`ScatterRun`] with `count > 1`. With `merge_runs == false` (seed
//! `DISABLE_SCATTER_RUN_MERGING`, debugging only) every piece is its own run
//! (`count == 1`, strides 0).

use crate::types::{Descriptor, ScatterRun};
use thiserror::Error;

/// Alignment in bytes of every piece's in-region offset (seed §4: "32 B
/// aligned"). `max_chunk_size_bytes` must be a positive multiple of it.
pub const ALIGN: u64 = 32;

/// Largest number of chunks one plan may have: chunk indices travel as `u32`
/// in GRANT / DATA / ACK (see [`crate::wire`]).
pub const MAX_CHUNKS: u64 = u32::MAX as u64;

/// Most pieces in one chunk (1,048,576 = [`crate::wire::MAX_ENTRIES`]): a
/// chunk's unmerged DATA has a run a piece, and a DATA of more entries
/// would be refused by its receiver. A chunk closes at this many pieces
/// even with region space left; only pieces averaging under 64 bytes in a
/// 64 MiB chunk reach it.
pub const MAX_CHUNK_PIECES: u64 = crate::wire::MAX_ENTRIES as u64;

/// Why [`TransferPlan::build`] rejected its input. Each variant names the
/// offending value or descriptor index so the caller can report it.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PlanError {
    /// `max_chunk_size_bytes` is smaller than [`ALIGN`] (32 bytes).
    #[error(
        "max_chunk_size_bytes = {max_chunk_size_bytes} is smaller than the {ALIGN}-byte alignment"
    )]
    ChunkSizeTooSmall {
        /// The rejected chunk cap in bytes.
        max_chunk_size_bytes: u64,
    },
    /// `max_chunk_size_bytes` is not a multiple of [`ALIGN`] (32 bytes).
    #[error("max_chunk_size_bytes = {max_chunk_size_bytes} is not a multiple of {ALIGN}")]
    ChunkSizeMisaligned {
        /// The rejected chunk cap in bytes.
        max_chunk_size_bytes: u64,
    },
    /// `src + len` or `dst + len` of descriptor `index` overflows `u64`.
    #[error("descriptor #{index} {descriptor:?}: src+len or dst+len overflows u64")]
    AddressOverflow {
        /// Index of the descriptor in the input slice.
        index: usize,
        /// The offending descriptor.
        descriptor: Descriptor,
    },
    /// The sum of all descriptor lengths up to and including descriptor
    /// `index` overflows `u64`.
    #[error("total bytes overflow u64 at descriptor #{index}")]
    TotalBytesOverflow {
        /// Index of the descriptor whose length made the sum overflow.
        index: usize,
    },
    /// The plan needs more than [`MAX_CHUNKS`] chunks (chunk indices are
    /// `u32` on the wire); raise `max_chunk_size_bytes` or split the request.
    #[error("plan needs at least {needed} chunks of {max_chunk_size_bytes} bytes, more than the {MAX_CHUNKS} a u32 chunk index allows")]
    TooManyChunks {
        /// Chunks needed (a lower bound when detected up front).
        needed: u64,
        /// The chunk cap in bytes.
        max_chunk_size_bytes: u64,
    },
    /// A [`ChunkBound`] given to [`TransferPlan::build_chunk`] does not
    /// point at a byte of `descs` (it came from another descriptor list).
    #[error("chunk bound starts at descriptor #{first_desc} + {first_done} bytes, outside the {descriptors} descriptors given")]
    BoundOutOfRange {
        /// The bound's first descriptor.
        first_desc: usize,
        /// The bound's offset into it.
        first_done: u64,
        /// Descriptors given.
        descriptors: usize,
    },
    /// [`TransferPlan::build_chunk`] built a chunk whose (packed, payload,
    /// pieces) differ from its bound's: the bound came from another
    /// descriptor list or cap.
    #[error("chunk {chunk} built as (packed, payload, pieces) = {built:?} bytes/bytes/count, but its bound says {expected:?}")]
    BoundMismatch {
        /// The chunk index.
        chunk: u32,
        /// (packed bytes, payload bytes, pieces) from the bound.
        expected: (u64, u64, u64),
        /// The same, as built.
        built: (u64, u64, u64),
    },
    /// One chunk has more runs than a DATA message can count (`u32`).
    #[error("chunk {chunk} has {runs} runs, more than a u32 entry count allows")]
    TooManyRuns {
        /// Index of the chunk.
        chunk: u32,
        /// Number of runs it would carry.
        runs: usize,
    },
}

/// One chunk of a [`TransferPlan`]: the unit moved by one RDMA write into one
/// arena region (seed §3 "chunk").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Position of this chunk in the plan (0-based; the `chunk_index` of
    /// GRANT / DATA / ACK).
    pub index: u32,
    /// Region size this chunk needs, in bytes: one past the last byte of its
    /// last piece (pieces start 32-byte aligned, so this includes the
    /// alignment padding between pieces but not after the last one).
    /// Always `0 < packed_bytes <= max_chunk_size_bytes`. This is the value
    /// WANT carries for the chunk.
    pub packed_bytes: u64,
    /// Payload bytes in this chunk (sum of piece lengths, no padding).
    pub payload_bytes: u64,
    /// Number of descriptor pieces packed in this chunk.
    pub pieces: u64,
    /// Scatter view: `region_offset` → receiver `addr` (= `Descriptor::dst`).
    /// Carried by DATA.
    pub scatter_runs: Vec<ScatterRun>,
    /// Gather view: sender `addr` (= `Descriptor::src`) → `region_offset`.
    pub gather_runs: Vec<ScatterRun>,
}

impl Chunk {
    /// The scatter runs expanded to `(region_offset, dst, len)` segments,
    /// in region-offset order. See [`expand`].
    pub fn scatter_segments(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        expand(&self.scatter_runs)
    }

    /// The gather runs expanded to `(region_offset, src, len)` segments,
    /// in region-offset order. See [`expand`].
    pub fn gather_segments(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        expand(&self.gather_runs)
    }
}

/// Expands runs into `(region_offset, addr, len)` segments (bytes), in run
/// order. For a plan built with `merge_runs == false` every segment is exactly
/// one descriptor piece; with merging, contiguous pieces appear fused into one
/// longer segment.
pub fn expand(runs: &[ScatterRun]) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    runs.iter().flat_map(ScatterRun::segments)
}

/// A bin-packed transfer plan (seed §4 `BounceTransferPlan`): the chunks a
/// request is cut into, each with its packed region size and coalesced
/// gather / scatter runs. Built by [`TransferPlan::build`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferPlan {
    chunks: Vec<Chunk>,
    /// Total payload bytes over all descriptors (zero-length ones count 0).
    pub total_bytes: u64,
    /// The chunk cap the plan was built with, in bytes.
    pub max_chunk_size_bytes: u64,
    /// Whether runs were merged (`false` = seed `DISABLE_SCATTER_RUN_MERGING`).
    pub merged: bool,
}

/// Online run coalescer: an open contiguous segment plus the closed runs.
struct RunBuilder {
    merge: bool,
    runs: Vec<ScatterRun>,
    /// The last segment, still growable contiguously (count 1, strides 0).
    open: Option<ScatterRun>,
}

impl RunBuilder {
    /// `capacity`: runs to reserve up front (an estimate; growing a
    /// 16,384-run vector by doubling re-copies and re-faults it).
    fn new(merge: bool, capacity: usize) -> Self {
        Self {
            merge,
            runs: Vec::with_capacity(capacity),
            open: None,
        }
    }

    fn single(region_offset: u64, addr: u64, len: u64) -> ScatterRun {
        ScatterRun {
            region_offset,
            addr,
            segment_len: len,
            count: 1,
            region_stride: 0,
            addr_stride: 0,
        }
    }

    fn push(&mut self, region_offset: u64, addr: u64, len: u64) {
        if !self.merge {
            self.runs.push(Self::single(region_offset, addr, len));
            return;
        }
        if let Some(open) = &mut self.open {
            // Contiguous in both the region and user memory: grow the segment.
            // (Pieces are validated not to overflow, so the adds are exact.)
            if open.region_offset + open.segment_len == region_offset
                && open.addr.checked_add(open.segment_len) == Some(addr)
            {
                open.segment_len += len;
                return;
            }
        }
        self.close_open();
        self.open = Some(Self::single(region_offset, addr, len));
    }

    /// Folds the open segment into the last closed run when it continues
    /// that run's uniform stride with an equal segment length; else pushes it.
    fn close_open(&mut self) {
        let Some(seg) = self.open.take() else { return };
        if let Some(last) = self.runs.last_mut() {
            if Self::try_fold(last, &seg) {
                return;
            }
        }
        self.runs.push(seg);
    }

    fn try_fold(last: &mut ScatterRun, seg: &ScatterRun) -> bool {
        if last.segment_len != seg.segment_len || last.count == u32::MAX {
            return false;
        }
        if last.count == 1 {
            // Region offsets strictly increase within a chunk; only forward
            // user-memory strides are merged (keeps every run's address
            // arithmetic overflow-free and easy to validate).
            let (Some(rs), Some(as_)) = (
                seg.region_offset.checked_sub(last.region_offset),
                seg.addr.checked_sub(last.addr),
            ) else {
                return false;
            };
            last.region_stride = rs;
            last.addr_stride = as_;
            last.count = 2;
            return true;
        }
        let c = u64::from(last.count);
        let next_r = last
            .region_stride
            .checked_mul(c)
            .and_then(|x| x.checked_add(last.region_offset));
        let next_a = last
            .addr_stride
            .checked_mul(c)
            .and_then(|x| x.checked_add(last.addr));
        if next_r == Some(seg.region_offset) && next_a == Some(seg.addr) {
            last.count += 1;
            true
        } else {
            false
        }
    }

    fn finish(mut self) -> Vec<ScatterRun> {
        self.close_open();
        // Merged runs can be far fewer than the reserved estimate: give
        // the excess back (an in-place shrink, not a copy).
        if self.runs.capacity() > 2 * self.runs.len() + 64 {
            self.runs.shrink_to_fit();
        }
        self.runs
    }
}

/// State of the chunk being filled.
struct OpenChunk {
    /// Next free byte (unaligned) in the region.
    cursor: u64,
    payload: u64,
    pieces: u64,
    scatter: RunBuilder,
    gather: RunBuilder,
    /// Whether gather runs are built (false: scatter runs only).
    with_gather: bool,
}

impl OpenChunk {
    fn new(merge: bool, capacity: usize) -> Self {
        Self {
            cursor: 0,
            payload: 0,
            pieces: 0,
            scatter: RunBuilder::new(merge, capacity),
            gather: RunBuilder::new(merge, capacity),
            with_gather: true,
        }
    }

    fn scatter_only(merge: bool, capacity: usize) -> Self {
        Self {
            cursor: 0,
            payload: 0,
            pieces: 0,
            scatter: RunBuilder::new(merge, capacity),
            gather: RunBuilder::new(merge, 0),
            with_gather: false,
        }
    }

    fn place(&mut self, region_offset: u64, src: u64, dst: u64, len: u64) {
        self.scatter.push(region_offset, dst, len);
        if self.with_gather {
            self.gather.push(region_offset, src, len);
        }
        self.cursor = region_offset + len;
        self.payload += len;
        self.pieces += 1;
    }
}

fn check_chunk_size(max: u64) -> Result<(), PlanError> {
    if max < ALIGN {
        return Err(PlanError::ChunkSizeTooSmall {
            max_chunk_size_bytes: max,
        });
    }
    if max % ALIGN != 0 {
        return Err(PlanError::ChunkSizeMisaligned {
            max_chunk_size_bytes: max,
        });
    }
    Ok(())
}

/// Validation pass: overflow checks and a lower bound on the chunk count,
/// before any allocation proportional to the output. Returns the payload
/// total.
fn validate(descs: &[Descriptor], max: u64) -> Result<u64, PlanError> {
    validate_and_measure(descs, max).map(|(total, _)| total)
}

/// [`validate`], also returning the common length when every descriptor
/// has the same non-zero length (KV blocks usually do).
fn validate_and_measure(descs: &[Descriptor], max: u64) -> Result<(u64, Option<u64>), PlanError> {
    match measure_fast(descs) {
        Some((total, uniform)) => {
            check_chunk_count(total, max)?;
            Ok((total, uniform))
        }
        None => validate_and_measure_checked(descs, max),
    }
}

/// The total bytes and the common length (as [`validate_and_measure`])
/// when one pass can vouch that no `addr + len` and no running total
/// overflows; `None` when it cannot (the checked loop then names the
/// descriptor).
fn measure_fast(descs: &[Descriptor]) -> Option<(u64, Option<u64>)> {
    // One branch-free pass first (the sizing pass is on every request's
    // critical path: 16,384 descriptors took 23–53 µs on the H200 host
    // with a branch per check, issue 18); the checking loop below runs
    // only when the pass cannot vouch for the input, to name the
    // descriptor. The pass is only ORs, XORs and wrapping adds (no
    // 128-bit sum, no compare per descriptor), which the compiler
    // vectorises.
    let first_len = descs.first().map_or(0, |d| d.len);
    let (mut addr_or, mut len_or, mut sum, mut diff) = (0u64, 0u64, 0u64, 0u64);
    for d in descs {
        addr_or |= d.src | d.dst;
        len_or |= d.len;
        sum = sum.wrapping_add(d.len);
        diff |= d.len ^ first_len;
    }
    // Every address and length below 2^63: no `addr + len` overflows.
    // `n` lengths each at most `len_or`, and `n * len_or` fits: the
    // wrapping sum is the exact total.
    const HIGH: u64 = 1 << 63;
    let fits = len_or.checked_mul(descs.len() as u64).is_some();
    (addr_or < HIGH && len_or < HIGH && fits)
        .then(|| (sum, (diff == 0 && first_len > 0).then_some(first_len)))
}

/// The chunk count `total` bytes need at `max` bytes a chunk, at most
/// [`MAX_CHUNKS`].
fn check_chunk_count(total: u64, max: u64) -> Result<(), PlanError> {
    let min_chunks = total.div_ceil(max);
    if min_chunks > MAX_CHUNKS {
        return Err(PlanError::TooManyChunks {
            needed: min_chunks,
            max_chunk_size_bytes: max,
        });
    }
    Ok(())
}

/// [`validate_and_measure`] descriptor by descriptor: the first overflow
/// is reported with its index.
fn validate_and_measure_checked(
    descs: &[Descriptor],
    max: u64,
) -> Result<(u64, Option<u64>), PlanError> {
    let mut total: u64 = 0;
    let first_len = descs.first().map_or(0, |d| d.len);
    let mut uniform = first_len > 0;
    for (index, d) in descs.iter().enumerate() {
        uniform &= d.len == first_len;
        if d.len == 0 {
            continue;
        }
        if d.src.checked_add(d.len).is_none() || d.dst.checked_add(d.len).is_none() {
            return Err(PlanError::AddressOverflow {
                index,
                descriptor: *d,
            });
        }
        total = total
            .checked_add(d.len)
            .ok_or(PlanError::TotalBytesOverflow { index })?;
    }
    check_chunk_count(total, max)?;
    Ok((total, uniform.then_some(first_len)))
}

/// [`TransferPlan::chunk_bounds`] in O(chunks) for `n` descriptors all of
/// length `len` (0 < `len` ≤ `max`): the packing rule then puts the same
/// number of whole descriptors, `k = min((max - len) / align_up(len) + 1,
/// MAX_CHUNK_PIECES)`, in every chunk but the last.
fn uniform_bounds(n: usize, len: u64, max: u64) -> Result<Vec<ChunkBound>, PlanError> {
    debug_assert!(len > 0 && len <= max);
    let stride = align_up(len);
    let k = ((max - len) / stride + 1).min(MAX_CHUNK_PIECES);
    let n = n as u64;
    let chunks = n.div_ceil(k);
    if chunks > u64::from(u32::MAX) + 1 {
        // Where the packer's sink would stop (a u32 chunk index).
        return Err(PlanError::TooManyChunks {
            needed: u64::from(u32::MAX) + 2,
            max_chunk_size_bytes: max,
        });
    }
    Ok((0..chunks)
        .map(|i| {
            let pieces = k.min(n - i * k);
            ChunkBound {
                index: i as u32,
                first_desc: (i * k) as usize,
                first_done: 0,
                packed_bytes: (pieces - 1) * stride + len,
                payload_bytes: pieces * len,
                pieces,
            }
        })
        .collect())
}

/// Receives the packer's decisions.
trait PackSink {
    /// A piece of `len` bytes at region offset `off` (from `src`, to `dst`),
    /// cut from descriptor `desc` starting `done` bytes into it.
    fn piece(&mut self, desc: usize, done: u64, off: u64, src: u64, dst: u64, len: u64);
    /// The current chunk is complete; `packed` is one past its last byte.
    /// `Ok(false)` stops the packer (a single-chunk build).
    fn close(&mut self, packed: u64) -> Result<bool, PlanError>;
}

/// The packing rule, shared by [`TransferPlan::build`],
/// [`TransferPlan::chunk_bounds`] and [`TransferPlan::build_chunk`] so they
/// can never disagree: pieces at 32-byte aligned offsets; a descriptor that
/// fits a fresh chunk is never split; a larger one is split at chunk
/// boundaries; zero-length ones are skipped; a chunk holds at most
/// [`MAX_CHUNK_PIECES`] pieces. Starts a fresh chunk at
/// descriptor `first_desc`, `first_done` bytes into it.
fn pack(
    descs: &[Descriptor],
    first_desc: usize,
    first_done: u64,
    max: u64,
    sink: &mut impl PackSink,
) -> Result<(), PlanError> {
    let mut cursor: u64 = 0;
    let mut pieces: u64 = 0;
    let mut done_first = first_done;
    for (k, d) in descs.iter().enumerate().skip(first_desc) {
        let mut done = std::mem::take(&mut done_first);
        if d.len == 0 {
            continue;
        }
        while done < d.len {
            let remaining = d.len - done;
            let mut off = align_up(cursor);
            if off >= max || pieces == MAX_CHUNK_PIECES {
                if !sink.close(cursor)? {
                    return Ok(());
                }
                (pieces, off) = (0, 0);
            }
            let space = max - off;
            if remaining > space && remaining <= max && off > 0 {
                // Fits whole in a fresh chunk: do not split it.
                if !sink.close(cursor)? {
                    return Ok(());
                }
                (pieces, off) = (0, 0);
            }
            let take = remaining.min(max - off);
            sink.piece(k, done, off, d.src + done, d.dst + done, take);
            cursor = off + take;
            pieces += 1;
            done += take;
        }
    }
    if pieces > 0 {
        sink.close(cursor)?;
    }
    Ok(())
}

/// A chunk of whole descriptors of one length
/// ([`TransferPlan::uniform_pieces`]): piece `i` is `descs[first_desc + i]`,
/// at region offset `i * stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UniformPieces {
    /// Index of the chunk's first descriptor.
    pub first_desc: usize,
    /// Descriptors (= pieces) in the chunk.
    pub count: usize,
    /// Length of every descriptor, bytes (≤ the chunk cap).
    pub len: u64,
    /// Region bytes between consecutive pieces: `len` rounded up to the
    /// 32-byte piece alignment.
    pub stride: u64,
}

/// A request's destinations (or sources) as planes of blocks (issue 18
/// step 3, DATA_BLOCKS): descriptor `k`'s address is
/// `(k / n) × plane_stride + offsets[k % n]` (`n = offsets.len()`), as a
/// block hand-off between layer-major pools lays them out
/// (`layout::block_descriptors`: the same block offsets in every layer ×
/// K/V plane). Found by [`BlockPlanes::of_dsts`] / [`BlockPlanes::of_srcs`];
/// a chunk's pieces are then described by [`BlockPlanes::scatter`] — the
/// `n` offsets, not one address a piece — and gathered from them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockPlanes {
    /// Bytes between one plane's addresses and the next's.
    pub plane_stride: u64,
    /// The first plane's addresses, one a block.
    pub offsets: Vec<u64>,
}

impl BlockPlanes {
    /// Most blocks a plane may have: a DATA_BLOCKS entry each, within the
    /// decoder's cap.
    pub const MAX_BLOCKS: usize = crate::wire::MAX_ENTRIES as usize;

    /// The smallest period `n` of the destinations (a divisor of
    /// `descs.len()`, at most half of it, so there are at least two
    /// planes): `descs[k + n].dst == descs[k].dst + plane_stride` for every
    /// `k`, `plane_stride = descs[n].dst - descs[0].dst` (no wrap-around).
    /// `None` when there is none (fewer than two descriptors, destinations
    /// with no such period, or a period above [`BlockPlanes::MAX_BLOCKS`]).
    ///
    /// Cost: a few samples per divisor of the count, then one pass over
    /// the descriptors for the period that passes them (≈ 10–25 µs for
    /// 16,384 cold descriptors on the H200 host: run it off the submit
    /// path, or right after a pass that brought them into cache).
    pub fn of_dsts(descs: &[Descriptor]) -> Option<BlockPlanes> {
        Self::of_addrs(descs.len(), |k| descs[k].dst)
    }

    /// [`BlockPlanes::of_dsts`] of the sources: the sender gathers a chunk
    /// of a block hand-off from these (`n` addresses instead of one a
    /// piece).
    pub fn of_srcs(descs: &[Descriptor]) -> Option<BlockPlanes> {
        Self::of_addrs(descs.len(), |k| descs[k].src)
    }

    fn of_addrs(total: usize, addr: impl Fn(usize) -> u64) -> Option<BlockPlanes> {
        if total < 2 {
            return None;
        }
        let mut divisors = Vec::new();
        let mut i = 1usize;
        while i * i <= total {
            if total % i == 0 {
                divisors.push(i);
                divisors.push(total / i);
            }
            i += 1;
        }
        divisors.sort_unstable();
        divisors.dedup();
        let repeats =
            |k: usize, n: usize, stride: u64| addr(k).checked_add(stride) == Some(addr(k + n));
        for n in divisors {
            if n > total / 2 || n > Self::MAX_BLOCKS {
                break;
            }
            let Some(stride) = addr(n).checked_sub(addr(0)) else {
                continue;
            };
            // Cheap samples first (most periods fail at once), then all.
            let last = total - n - 1;
            let samples = [1.min(last), n - 1, last / 2, last];
            if !samples.iter().all(|&k| repeats(k, n, stride)) {
                continue;
            }
            if (0..total - n).all(|k| repeats(k, n, stride)) {
                return Some(BlockPlanes {
                    plane_stride: stride,
                    offsets: (0..n).map(&addr).collect(),
                });
            }
        }
        None
    }

    /// The address of piece `k` of the request (`None` past the offsets'
    /// arithmetic range).
    pub fn addr(&self, k: u64) -> Option<u64> {
        crate::types::plane_addr(&self.offsets, self.plane_stride, k)
    }

    /// The block form of uniform chunk `u` of the request these planes
    /// were found in ([`TransferPlan::uniform_pieces`]): its pieces from
    /// descriptor `u.first_desc`, `u.len` bytes each at region stride
    /// `u.stride`. `None` when the block form would not be smaller than a
    /// destination a piece (the chunk has no more pieces than a plane has
    /// blocks) or the count exceeds `u32`.
    pub fn scatter(&self, u: &UniformPieces) -> Option<crate::types::BlockScatter> {
        if u.count <= self.offsets.len() {
            return None;
        }
        Some(crate::types::BlockScatter {
            segment_len: u.len,
            region_stride: u.stride,
            first: u.first_desc as u64,
            count: u32::try_from(u.count).ok()?,
            plane_stride: self.plane_stride,
            offsets: self.offsets.clone(),
        })
    }
}

/// Where one chunk of a plan starts in the descriptor list and what it
/// holds, from [`TransferPlan::chunk_bounds`] (no runs built). Enough to
/// size its region and WANT, and to build its runs alone later with
/// [`TransferPlan::build_chunk`] (e.g. on a copy worker, in parallel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkBound {
    /// Position of the chunk in the plan (its `chunk_index`).
    pub index: u32,
    /// Index of the descriptor holding the chunk's first piece.
    pub first_desc: usize,
    /// Bytes into that descriptor where the first piece starts (non-zero
    /// only when a descriptor larger than a chunk was split).
    pub first_done: u64,
    /// As [`Chunk::packed_bytes`].
    pub packed_bytes: u64,
    /// As [`Chunk::payload_bytes`].
    pub payload_bytes: u64,
    /// As [`Chunk::pieces`].
    pub pieces: u64,
}

struct BuildSink {
    chunks: Vec<Chunk>,
    cur: OpenChunk,
    merge: bool,
    max: u64,
    /// Stop after the first chunk ([`TransferPlan::build_chunk`]).
    single: bool,
}

impl PackSink for BuildSink {
    fn piece(&mut self, _desc: usize, _done: u64, off: u64, src: u64, dst: u64, len: u64) {
        self.cur.place(off, src, dst, len);
    }
    fn close(&mut self, packed: u64) -> Result<bool, PlanError> {
        debug_assert_eq!(packed, self.cur.cursor);
        // A single-chunk build never fills another chunk: reserve nothing.
        let next_capacity = if self.single {
            0
        } else {
            self.cur.pieces.min(1 << 20) as usize
        };
        TransferPlan::close(
            &mut self.chunks,
            &mut self.cur,
            self.merge,
            self.max,
            next_capacity,
        )?;
        Ok(!self.single)
    }
}

/// Records each chunk's start and totals (no runs).
struct BoundSink {
    bounds: Vec<ChunkBound>,
    /// The open chunk (`packed_bytes` set at close).
    cur: Option<ChunkBound>,
    max: u64,
}

impl PackSink for BoundSink {
    fn piece(&mut self, desc: usize, done: u64, _off: u64, _src: u64, _dst: u64, len: u64) {
        let index = self.bounds.len() as u32;
        let b = self.cur.get_or_insert(ChunkBound {
            index,
            first_desc: desc,
            first_done: done,
            packed_bytes: 0,
            payload_bytes: 0,
            pieces: 0,
        });
        b.payload_bytes += len;
        b.pieces += 1;
    }
    fn close(&mut self, packed: u64) -> Result<bool, PlanError> {
        if let Some(mut b) = self.cur.take() {
            if u32::try_from(self.bounds.len()).is_err() {
                return Err(PlanError::TooManyChunks {
                    needed: self.bounds.len() as u64 + 1,
                    max_chunk_size_bytes: self.max,
                });
            }
            b.packed_bytes = packed;
            self.bounds.push(b);
        }
        Ok(true)
    }
}

const fn align_up(x: u64) -> u64 {
    // Callers guarantee x <= max_chunk (a multiple of ALIGN), so no overflow.
    (x + (ALIGN - 1)) & !(ALIGN - 1)
}

impl TransferPlan {
    /// Bin-packs `descs` (in order) into chunks of at most
    /// `max_chunk_size_bytes` packed bytes and coalesces their runs (see the
    /// module docs for the exact rules). `merge_runs == false` emits one run
    /// per descriptor piece (seed `DISABLE_SCATTER_RUN_MERGING`).
    ///
    /// An input with no bytes (empty, or only zero-length descriptors) gives
    /// a plan with zero chunks.
    ///
    /// # Errors
    ///
    /// * [`PlanError::ChunkSizeTooSmall`] / [`PlanError::ChunkSizeMisaligned`]
    ///   if `max_chunk_size_bytes` is not a positive multiple of [`ALIGN`];
    /// * [`PlanError::AddressOverflow`] if a descriptor's `src + len` or
    ///   `dst + len` overflows `u64`;
    /// * [`PlanError::TotalBytesOverflow`] if the lengths sum past `u64`;
    /// * [`PlanError::TooManyChunks`] if more than [`MAX_CHUNKS`] chunks would
    ///   be needed (checked up front from the byte total, so no unbounded
    ///   allocation happens first);
    /// * [`PlanError::TooManyRuns`] if a chunk would carry more than
    ///   `u32::MAX` runs.
    pub fn build(
        descs: &[Descriptor],
        max_chunk_size_bytes: u64,
        merge_runs: bool,
    ) -> Result<TransferPlan, PlanError> {
        let max = max_chunk_size_bytes;
        check_chunk_size(max)?;

        let total = validate(descs, max)?;
        let min_chunks = total.div_ceil(max);
        // Capacity hint: the lower bound, capped so a huge-but-legal request
        // does not pre-allocate absurdly.
        // Runs per chunk, estimated from the mean descriptor length (the
        // next chunks reuse the previous chunk's piece count).
        let mean_len = (total / descs.len().max(1) as u64).max(1);
        let first = (max / mean_len + 1).min(descs.len() as u64).min(1 << 20) as usize;
        let mut sink = BuildSink {
            chunks: Vec::with_capacity(min_chunks.min(1 << 16) as usize),
            cur: OpenChunk::new(merge_runs, first),
            merge: merge_runs,
            max,
            single: false,
        };
        pack(descs, 0, 0, max, &mut sink)?;
        Ok(TransferPlan {
            chunks: sink.chunks,
            total_bytes: total,
            max_chunk_size_bytes: max,
            merged: merge_runs,
        })
    }

    /// The packed region size of every chunk [`TransferPlan::build`] would
    /// make for `descs` (exactly its [`TransferPlan::chunk_bytes`], i.e. the
    /// WANT's `chunk_bytes`), without building any run. See
    /// [`TransferPlan::chunk_bounds`].
    ///
    /// # Errors
    /// As [`TransferPlan::build`], except [`PlanError::TooManyRuns`].
    pub fn chunk_sizes(
        descs: &[Descriptor],
        max_chunk_size_bytes: u64,
    ) -> Result<Vec<u64>, PlanError> {
        Ok(Self::chunk_bounds(descs, max_chunk_size_bytes)?
            .iter()
            .map(|b| b.packed_bytes)
            .collect())
    }

    /// Every chunk [`TransferPlan::build`] would make for `descs`, as
    /// [`ChunkBound`]s: where it starts in `descs`, its packed region size
    /// (the WANT's `chunk_bytes`), payload and piece count — without
    /// building any run (packing depends on descriptor lengths only). Lets
    /// a sender send its WANT first and build each chunk's runs with
    /// [`TransferPlan::build_chunk`] where and when it is gathered. Cost:
    /// one pass over `descs` (validation) when all descriptors have the same
    /// length of at most a chunk — the bounds then follow in O(chunks) —
    /// else two; no allocation but the result (one [`ChunkBound`], 48
    /// bytes, per chunk).
    ///
    /// # Errors
    /// As [`TransferPlan::build`], except [`PlanError::TooManyRuns`].
    pub fn chunk_bounds(
        descs: &[Descriptor],
        max_chunk_size_bytes: u64,
    ) -> Result<Vec<ChunkBound>, PlanError> {
        Self::chunk_bounds_measured(descs, max_chunk_size_bytes).map(|(bounds, _)| bounds)
    }

    /// [`TransferPlan::chunk_bounds`], also returning the length (bytes)
    /// every descriptor has when all have one non-zero length — measured
    /// in the same pass, so a sender that keeps it can find its uniform
    /// chunks with [`TransferPlan::uniform_pieces_of_len`] in O(1) instead
    /// of another pass over each chunk's descriptors (issue 18: a pass over
    /// 16,384 descriptors costs ≈ 10–25 µs on the H200 host, on the first
    /// gather's path). Same cost and errors as `chunk_bounds`.
    ///
    /// # Errors
    /// As [`TransferPlan::chunk_bounds`].
    pub fn chunk_bounds_measured(
        descs: &[Descriptor],
        max_chunk_size_bytes: u64,
    ) -> Result<(Vec<ChunkBound>, Option<u64>), PlanError> {
        let max = max_chunk_size_bytes;
        check_chunk_size(max)?;
        let (total, uniform) = validate_and_measure(descs, max)?;
        if let Some(len) = uniform.filter(|&l| l <= max) {
            return uniform_bounds(descs.len(), len, max).map(|b| (b, uniform));
        }
        let mut sink = BoundSink {
            bounds: Vec::with_capacity(total.div_ceil(max).min(1 << 16) as usize),
            cur: None,
            max,
        };
        pack(descs, 0, 0, max, &mut sink)?;
        Ok((sink.bounds, uniform))
    }

    /// Builds the one chunk `bound` describes: exactly the chunk
    /// `TransferPlan::build(descs, max_chunk_size_bytes, merge_runs)` has
    /// at `bound.index` (property-tested), in time proportional to the
    /// descriptors the chunk spans. `bound` must come from
    /// [`TransferPlan::chunk_bounds`] over the same `descs` and cap (the
    /// input was validated there); the built chunk is checked against the
    /// bound's sizes, so a bound from another list is an error, never a
    /// chunk larger than the region sized from it.
    ///
    /// # Errors
    /// [`PlanError::ChunkSizeTooSmall`] / [`PlanError::ChunkSizeMisaligned`]
    /// for a bad cap; [`PlanError::TooManyRuns`] as in
    /// [`TransferPlan::build`]; [`PlanError::BoundOutOfRange`] if `bound`
    /// does not point into `descs`; [`PlanError::BoundMismatch`] if the
    /// chunk built there does not have the bound's sizes.
    pub fn build_chunk(
        descs: &[Descriptor],
        bound: &ChunkBound,
        max_chunk_size_bytes: u64,
        merge_runs: bool,
    ) -> Result<Chunk, PlanError> {
        Self::build_chunk_with(descs, bound, max_chunk_size_bytes, merge_runs, true)
    }

    /// [`TransferPlan::build_chunk`] without its gather runs
    /// (`gather_runs` empty; everything else identical, property-tested):
    /// for a sender that gathers a [`UniformPieces`] chunk straight from
    /// its descriptors and needs the runs only for the DATA. Half the
    /// planning work (issue 18: planning a 16 MiB chunk of 4,096 random
    /// 4 KiB blocks took ≈ 200 µs on the H200 host, on the write's path).
    ///
    /// # Errors
    /// As [`TransferPlan::build_chunk`].
    pub fn build_chunk_scatter_runs(
        descs: &[Descriptor],
        bound: &ChunkBound,
        max_chunk_size_bytes: u64,
        merge_runs: bool,
    ) -> Result<Chunk, PlanError> {
        Self::build_chunk_with(descs, bound, max_chunk_size_bytes, merge_runs, false)
    }

    /// Whether `bound`'s chunk is whole descriptors of one length: then
    /// piece `i` is descriptor `first_desc + i`, at region offset
    /// `i × stride` (the packing rule's 32-byte alignment), and a gather
    /// needs no runs. `None` for a chunk that starts inside a split
    /// descriptor, mixes lengths or skips empty descriptors, or a bound
    /// that does not point into `descs`. O(pieces) length comparisons.
    pub fn uniform_pieces(
        descs: &[Descriptor],
        bound: &ChunkBound,
        max_chunk_size_bytes: u64,
    ) -> Option<UniformPieces> {
        Self::uniform_layout(descs, bound, max_chunk_size_bytes, None)
    }

    /// [`TransferPlan::uniform_pieces`] for a list whose descriptors all
    /// have length `len` (bytes), as [`TransferPlan::chunk_bounds_measured`]
    /// measured over the same list: O(1), the chunk's descriptors are not
    /// compared one by one (the bound, its first descriptor and the
    /// layout's sizes still are, so a bound of another list gives `None`).
    /// A copy engine that reads the pieces checks their lengths itself.
    pub fn uniform_pieces_of_len(
        descs: &[Descriptor],
        bound: &ChunkBound,
        max_chunk_size_bytes: u64,
        len: u64,
    ) -> Option<UniformPieces> {
        Self::uniform_layout(descs, bound, max_chunk_size_bytes, Some(len))
    }

    fn uniform_layout(
        descs: &[Descriptor],
        bound: &ChunkBound,
        max_chunk_size_bytes: u64,
        known_len: Option<u64>,
    ) -> Option<UniformPieces> {
        check_chunk_size(max_chunk_size_bytes).ok()?;
        if bound.first_done != 0 || bound.pieces == 0 {
            return None;
        }
        let count = usize::try_from(bound.pieces).ok()?;
        let slice = descs.get(bound.first_desc..bound.first_desc.checked_add(count)?)?;
        let len = slice[0].len;
        let same = match known_len {
            Some(known) => known == len && slice[count - 1].len == len,
            None => slice.iter().all(|d| d.len == len),
        };
        if len == 0 || len > max_chunk_size_bytes || !same {
            return None;
        }
        let stride = align_up(len);
        // The bound's own sizes must be those of this layout.
        let packed = (bound.pieces - 1).checked_mul(stride)?.checked_add(len)?;
        if bound.packed_bytes != packed || bound.payload_bytes != bound.pieces.checked_mul(len)? {
            return None;
        }
        Some(UniformPieces {
            first_desc: bound.first_desc,
            count,
            len,
            stride,
        })
    }

    fn build_chunk_with(
        descs: &[Descriptor],
        bound: &ChunkBound,
        max_chunk_size_bytes: u64,
        merge_runs: bool,
        with_gather: bool,
    ) -> Result<Chunk, PlanError> {
        let max = max_chunk_size_bytes;
        check_chunk_size(max)?;
        if descs
            .get(bound.first_desc)
            .is_none_or(|d| bound.first_done >= d.len)
        {
            return Err(PlanError::BoundOutOfRange {
                first_desc: bound.first_desc,
                first_done: bound.first_done,
                descriptors: descs.len(),
            });
        }
        let capacity = bound.pieces.min(1 << 20) as usize;
        let mut sink = BuildSink {
            chunks: Vec::with_capacity(1),
            cur: if with_gather {
                OpenChunk::new(merge_runs, capacity)
            } else {
                OpenChunk::scatter_only(merge_runs, capacity)
            },
            merge: merge_runs,
            max,
            single: true,
        };
        pack(descs, bound.first_desc, bound.first_done, max, &mut sink).map_err(|e| match e {
            PlanError::TooManyRuns { runs, .. } => PlanError::TooManyRuns {
                chunk: bound.index,
                runs,
            },
            other => other,
        })?;
        let mut chunk = sink.chunks.pop().ok_or(PlanError::BoundOutOfRange {
            first_desc: bound.first_desc,
            first_done: bound.first_done,
            descriptors: descs.len(),
        })?;
        chunk.index = bound.index;
        if (chunk.packed_bytes, chunk.payload_bytes, chunk.pieces)
            != (bound.packed_bytes, bound.payload_bytes, bound.pieces)
        {
            return Err(PlanError::BoundMismatch {
                chunk: bound.index,
                expected: (bound.packed_bytes, bound.payload_bytes, bound.pieces),
                built: (chunk.packed_bytes, chunk.payload_bytes, chunk.pieces),
            });
        }
        Ok(chunk)
    }

    fn close(
        chunks: &mut Vec<Chunk>,
        cur: &mut OpenChunk,
        merge: bool,
        max: u64,
        next_capacity: usize,
    ) -> Result<(), PlanError> {
        let open = std::mem::replace(cur, OpenChunk::new(merge, next_capacity));
        let index = u32::try_from(chunks.len()).map_err(|_| PlanError::TooManyChunks {
            needed: chunks.len() as u64 + 1,
            max_chunk_size_bytes: max,
        })?;
        let scatter_runs = open.scatter.finish();
        let gather_runs = open.gather.finish();
        let runs = scatter_runs.len().max(gather_runs.len());
        if u32::try_from(runs).is_err() {
            return Err(PlanError::TooManyRuns { chunk: index, runs });
        }
        chunks.push(Chunk {
            index,
            packed_bytes: open.cursor,
            payload_bytes: open.payload,
            pieces: open.pieces,
            scatter_runs,
            gather_runs,
        });
        Ok(())
    }

    /// The chunks, in order (`chunks()[i].index == i`).
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// Number of chunks.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// Per-chunk packed region sizes in bytes, in chunk order: exactly the
    /// `chunk_bytes` list a WANT carries (seed §5).
    pub fn chunk_bytes(&self) -> Vec<u64> {
        self.chunks.iter().map(|c| c.packed_bytes).collect()
    }

    /// Total scatter runs over all chunks (the DATA entries of the request).
    pub fn scatter_run_count(&self) -> usize {
        self.chunks.iter().map(|c| c.scatter_runs.len()).sum()
    }

    /// Total gather runs over all chunks.
    pub fn gather_run_count(&self) -> usize {
        self.chunks.iter().map(|c| c.gather_runs.len()).sum()
    }

    /// Consumes the plan, returning its chunks.
    pub fn into_chunks(self) -> Vec<Chunk> {
        self.chunks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;

    /// A chunk closes at [`MAX_CHUNK_PIECES`] pieces even with region space
    /// left (64 MiB chunks of 32-byte pieces would hold 2,097,152, more
    /// entries than an unmerged DATA may carry), in the uniform sizing
    /// pass, the packer and the full build alike; every chunk's unmerged
    /// DATA then fits the wire.
    #[test]
    fn a_chunk_holds_at_most_max_chunk_pieces() {
        let max = 64 * 1024 * KIB;
        let n = MAX_CHUNK_PIECES + 3;
        // Scattered destinations: nothing merges.
        let uniform: Vec<Descriptor> = (0..n)
            .map(|i| Descriptor::new(i * 32, i * 64, 32))
            .collect();
        // Not one length (16 and 32 bytes): the packer's path.
        let mixed: Vec<Descriptor> = (0..n)
            .map(|i| Descriptor::new(i * 32, i * 64, 16 + 16 * (i % 2)))
            .collect();
        for descs in [&uniform, &mixed] {
            let bounds = TransferPlan::chunk_bounds(descs, max).unwrap();
            assert_eq!(bounds.len(), 2, "{:?}", &bounds[..bounds.len().min(3)]);
            assert_eq!(bounds[0].pieces, MAX_CHUNK_PIECES);
            assert_eq!(bounds[1].pieces, 3);
            assert_eq!(bounds[1].first_desc as u64, MAX_CHUNK_PIECES);
            let plan = TransferPlan::build(descs, max, false).unwrap();
            assert_eq!(plan.chunk_count(), 2);
            for (c, b) in plan.chunks().iter().zip(&bounds) {
                assert!(c.scatter_runs.len() as u64 <= MAX_CHUNK_PIECES);
                let one = TransferPlan::build_chunk(descs, b, max, false).unwrap();
                assert_eq!(&one, c);
            }
        }
    }

    fn dense(n: u64, len: u64) -> Vec<Descriptor> {
        (0..n)
            .map(|i| Descriptor::new(0x1000_0000 + i * len, 0x9000_0000 + i * len, len))
            .collect()
    }

    fn segs(runs: &[ScatterRun]) -> Vec<(u64, u64, u64)> {
        expand(runs).collect()
    }

    #[test]
    fn chunk_sizes_validate_like_build() {
        assert!(matches!(
            TransferPlan::chunk_sizes(&dense(4, 64), 16),
            Err(PlanError::ChunkSizeTooSmall { .. })
        ));
        assert!(matches!(
            TransferPlan::chunk_sizes(&dense(4, 64), 100),
            Err(PlanError::ChunkSizeMisaligned { .. })
        ));
        assert!(matches!(
            TransferPlan::chunk_sizes(&[Descriptor::new(u64::MAX, 0, 2)], 4096),
            Err(PlanError::AddressOverflow { index: 0, .. })
        ));
        assert_eq!(
            TransferPlan::chunk_sizes(&[], 4096).unwrap(),
            Vec::<u64>::new()
        );
        // 3 × 4 KiB into 8 KiB chunks: two whole descriptors, then one.
        assert_eq!(
            TransferPlan::chunk_sizes(&dense(3, 4 * KIB), 8 * KIB).unwrap(),
            vec![8 * KIB, 4 * KIB]
        );
    }

    #[test]
    fn build_chunk_rejects_a_bound_from_another_list() {
        let d = dense(8, 4 * KIB);
        let bounds = TransferPlan::chunk_bounds(&d, 8 * KIB).unwrap();
        assert_eq!(bounds.len(), 4);
        assert_eq!((bounds[3].first_desc, bounds[3].first_done), (6, 0));
        let err = TransferPlan::build_chunk(&d[..4], &bounds[3], 8 * KIB, true).unwrap_err();
        assert_eq!(
            err,
            PlanError::BoundOutOfRange {
                first_desc: 6,
                first_done: 0,
                descriptors: 4
            }
        );
        assert!(err.to_string().contains("outside the 4 descriptors"));
        // A bound that points inside another list of other lengths.
        let other = dense(8, 2 * KIB);
        let err = TransferPlan::build_chunk(&other, &bounds[1], 8 * KIB, true).unwrap_err();
        assert!(
            matches!(
                err,
                PlanError::BoundMismatch {
                    chunk: 1,
                    expected: (8192, 8192, 2),
                    built: (8192, 8192, 4)
                }
            ),
            "{err:?}"
        );
        // A split descriptor: 20 KiB into 8 KiB chunks starts chunks at
        // 0, 8 and 16 KiB into it.
        let big = [Descriptor::new(0x1000, 0x9000, 20 * KIB)];
        let b = TransferPlan::chunk_bounds(&big, 8 * KIB).unwrap();
        let starts: Vec<_> = b.iter().map(|b| (b.first_desc, b.first_done)).collect();
        assert_eq!(starts, vec![(0, 0), (0, 8 * KIB), (0, 16 * KIB)]);
        let last = TransferPlan::build_chunk(&big, &b[2], 8 * KIB, true).unwrap();
        assert_eq!(last.index, 2);
        assert_eq!(
            segs(&last.gather_runs),
            vec![(0, 0x1000 + 16 * KIB, 4 * KIB)]
        );
    }

    #[test]
    fn rejects_bad_chunk_size() {
        let d = dense(1, 64);
        assert_eq!(
            TransferPlan::build(&d, 16, true),
            Err(PlanError::ChunkSizeTooSmall {
                max_chunk_size_bytes: 16
            })
        );
        assert_eq!(
            TransferPlan::build(&d, 0, true),
            Err(PlanError::ChunkSizeTooSmall {
                max_chunk_size_bytes: 0
            })
        );
        assert_eq!(
            TransferPlan::build(&d, 48, true),
            Err(PlanError::ChunkSizeMisaligned {
                max_chunk_size_bytes: 48
            })
        );
    }

    #[test]
    fn rejects_address_overflow() {
        let d = [
            Descriptor::new(0, 0, 8),
            Descriptor::new(u64::MAX - 3, 0, 8),
        ];
        assert_eq!(
            TransferPlan::build(&d, 64, true),
            Err(PlanError::AddressOverflow {
                index: 1,
                descriptor: d[1]
            })
        );
        let d = [Descriptor::new(0, u64::MAX, 1)];
        assert!(matches!(
            TransferPlan::build(&d, 64, true),
            Err(PlanError::AddressOverflow { index: 0, .. })
        ));
        // Zero-length descriptors are skipped, even at the very top.
        let d = [Descriptor::new(u64::MAX, u64::MAX, 0)];
        assert_eq!(TransferPlan::build(&d, 64, true).unwrap().chunk_count(), 0);
    }

    #[test]
    fn fast_sizing_pass_agrees_with_the_checked_loop() {
        // Values from small to the top of u64, where the fast pass must
        // hand over to the checked loop (which names the descriptor).
        let mut rng = crate::rng::SplitMix64::new(18);
        let value = |rng: &mut crate::rng::SplitMix64| match rng.below(6) {
            0 => 0,
            1 => rng.below(1 << 20),
            2 => (1 << 62) + rng.below(1 << 20),
            3 => (1 << 63) - rng.below(64),
            4 => u64::MAX - rng.below(64),
            _ => rng.next_u64(),
        };
        let mut fast_paths = 0;
        for case in 0..20_000 {
            let n = rng.below(6) as usize;
            let uniform = rng.chance(300);
            let len0 = value(&mut rng);
            let descs: Vec<Descriptor> = (0..n)
                .map(|_| {
                    let len = if uniform { len0 } else { value(&mut rng) };
                    Descriptor::new(value(&mut rng), value(&mut rng), len)
                })
                .collect();
            for max in [64, 1 << 20] {
                let checked = validate_and_measure_checked(&descs, max);
                assert_eq!(
                    validate_and_measure(&descs, max),
                    checked,
                    "case {case}: {descs:?}"
                );
                // The fast pass must vouch for the ordinary cases (not
                // only defer to the checked loop).
                fast_paths += usize::from(measure_fast(&descs).is_some());
            }
        }
        assert!(
            fast_paths > 1000,
            "the fast pass ran in only {fast_paths} cases"
        );
        let kv: Vec<Descriptor> = (0..16_384u64)
            .map(|i| Descriptor::new(i << 12, (i ^ 0x55) << 12, 4096))
            .collect();
        assert_eq!(measure_fast(&kv), Some((64 << 20, Some(4096))));
    }

    #[test]
    fn rejects_total_overflow_and_too_many_chunks() {
        let d = [
            Descriptor::new(0, 0, u64::MAX / 2 + 1),
            Descriptor::new(0, 0, u64::MAX / 2 + 1),
        ];
        assert_eq!(
            TransferPlan::build(&d, 64, true),
            Err(PlanError::TotalBytesOverflow { index: 1 })
        );
        let d = [Descriptor::new(0, 0, 1 << 40)];
        assert!(matches!(
            TransferPlan::build(&d, 32, true),
            Err(PlanError::TooManyChunks { needed, max_chunk_size_bytes: 32 }) if needed == 1 << 35
        ));
    }

    #[test]
    fn empty_and_zero_length() {
        let p = TransferPlan::build(&[], 1024, true).unwrap();
        assert_eq!(p.chunk_count(), 0);
        assert_eq!(p.total_bytes, 0);
        assert!(p.chunk_bytes().is_empty());
        let d = [
            Descriptor::new(1, 2, 0),
            Descriptor::new(100, 200, 10),
            Descriptor::new(3, 4, 0),
        ];
        let p = TransferPlan::build(&d, 1024, true).unwrap();
        assert_eq!(p.chunk_bytes(), vec![10]);
        assert_eq!(segs(&p.chunks()[0].scatter_runs), vec![(0, 200, 10)]);
        assert_eq!(segs(&p.chunks()[0].gather_runs), vec![(0, 100, 10)]);
    }

    #[test]
    fn offsets_are_aligned_and_packed_bytes_exact() {
        let d = [
            Descriptor::new(0, 1000, 10),
            Descriptor::new(100, 2000, 33),
            Descriptor::new(200, 3000, 1),
        ];
        let p = TransferPlan::build(&d, 1024, false).unwrap();
        let c = &p.chunks()[0];
        assert_eq!(
            segs(&c.scatter_runs),
            vec![(0, 1000, 10), (32, 2000, 33), (96, 3000, 1)]
        );
        assert_eq!(c.packed_bytes, 97);
        assert_eq!(c.payload_bytes, 44);
        assert_eq!(c.pieces, 3);
    }

    #[test]
    fn boundary_exact_fit_and_move_to_fresh_chunk() {
        // 4 × 256 B exactly fill a 1 KiB chunk; the 5th starts a new chunk.
        let p = TransferPlan::build(&dense(5, 256), 1024, true).unwrap();
        assert_eq!(p.chunk_bytes(), vec![1024, 256]);
        // A 600-byte descriptor after 500 bytes: fits a fresh chunk → moved, not split.
        let d = [Descriptor::new(0, 0, 500), Descriptor::new(1000, 1000, 600)];
        let p = TransferPlan::build(&d, 1024, true).unwrap();
        assert_eq!(p.chunk_bytes(), vec![500, 600]);
        assert_eq!(segs(&p.chunks()[1].scatter_runs), vec![(0, 1000, 600)]);
    }

    #[test]
    fn oversized_descriptor_is_split() {
        // 100 bytes, then a 2500-byte descriptor with 1 KiB chunks: it fills
        // the tail of chunk 0 (from offset 128), one full chunk, then the rest.
        let d = [
            Descriptor::new(0, 0, 100),
            Descriptor::new(10_000, 50_000, 2500),
        ];
        let p = TransferPlan::build(&d, 1024, true).unwrap();
        assert_eq!(p.chunk_bytes(), vec![1024, 1024, 580]);
        assert_eq!(
            segs(&p.chunks()[0].scatter_runs),
            vec![(0, 0, 100), (128, 50_000, 896)]
        );
        assert_eq!(segs(&p.chunks()[1].scatter_runs), vec![(0, 50_896, 1024)]);
        assert_eq!(segs(&p.chunks()[2].gather_runs), vec![(0, 11_920, 580)]);
        assert_eq!(p.total_bytes, 2600);
    }

    #[test]
    fn split_starts_fresh_when_current_chunk_full() {
        let d = [Descriptor::new(0, 0, 1024), Descriptor::new(0, 4096, 1500)];
        let p = TransferPlan::build(&d, 1024, true).unwrap();
        assert_eq!(p.chunk_bytes(), vec![1024, 1024, 476]);
    }

    #[test]
    fn dense_contiguous_collapses_to_one_run_per_chunk() {
        let d = dense(16_384, 4 * KIB);
        let p = TransferPlan::build(&d, 32 * KIB * KIB, true).unwrap();
        assert_eq!(p.chunk_count(), 2);
        for c in p.chunks() {
            assert_eq!(c.scatter_runs.len(), 1);
            assert_eq!(c.gather_runs.len(), 1);
            assert_eq!(c.scatter_runs[0].segment_len, 32 * KIB * KIB);
        }
        let u = TransferPlan::build(&d, 32 * KIB * KIB, false).unwrap();
        assert_eq!(u.scatter_run_count(), 16_384);
    }

    #[test]
    fn uniform_stride_collapses() {
        // dst strided by 16 KiB (e.g. one layer of an interleaved KV cache),
        // src strided by 8 KiB.
        let d: Vec<_> = (0..4096u64)
            .map(|i| Descriptor::new(i * 8192, 1 << 40 | (i * 16_384), 4096))
            .collect();
        let p = TransferPlan::build(&d, 32 * KIB * KIB, true).unwrap();
        assert_eq!(p.chunk_count(), 1);
        let c = &p.chunks()[0];
        assert_eq!(
            c.scatter_runs,
            vec![ScatterRun {
                region_offset: 0,
                addr: 1 << 40,
                segment_len: 4096,
                count: 4096,
                region_stride: 4096,
                addr_stride: 16_384,
            }]
        );
        assert_eq!(c.gather_runs.len(), 1);
        assert_eq!(c.gather_runs[0].addr_stride, 8192);
    }

    #[test]
    fn stride_of_fused_pairs() {
        // Pairs of contiguous 4 KiB blocks, pairs 16 KiB apart → one run of
        // 8 KiB segments.
        let d: Vec<_> = (0..64u64)
            .map(|i| Descriptor::new(i * 4096, (i / 2) * 16_384 + (i % 2) * 4096, 4096))
            .collect();
        let p = TransferPlan::build(&d, 1 << 20, true).unwrap();
        let c = &p.chunks()[0];
        assert_eq!(c.scatter_runs.len(), 1);
        assert_eq!(c.scatter_runs[0].segment_len, 8192);
        assert_eq!(c.scatter_runs[0].count, 32);
        assert_eq!(c.gather_runs.len(), 1);
        assert_eq!(c.gather_runs[0].segment_len, 64 * 4096);
    }

    #[test]
    fn backwards_addresses_do_not_merge_into_negative_stride() {
        let d: Vec<_> = (0..8u64)
            .map(|i| Descriptor::new(0, 1_000_000 - i * 100, 64))
            .collect();
        let p = TransferPlan::build(&d, 4096, true).unwrap();
        let merged: Vec<_> = segs(&p.chunks()[0].scatter_runs);
        let plain: Vec<_> =
            segs(&TransferPlan::build(&d, 4096, false).unwrap().chunks()[0].scatter_runs);
        assert_eq!(merged, plain);
        // src all equal (stride 0, forward) merges.
        assert_eq!(p.chunks()[0].gather_runs.len(), 1);
        assert_eq!(p.chunks()[0].gather_runs[0].addr_stride, 0);
    }

    #[test]
    fn chunk_bytes_matches_packed_and_indices() {
        let d = dense(100, 1000);
        let p = TransferPlan::build(&d, 4096, true).unwrap();
        for (i, c) in p.chunks().iter().enumerate() {
            assert_eq!(c.index as usize, i);
            assert!(c.packed_bytes <= 4096 && c.packed_bytes > 0);
        }
        assert_eq!(
            p.chunk_bytes(),
            p.chunks()
                .iter()
                .map(|c| c.packed_bytes)
                .collect::<Vec<_>>()
        );
        assert_eq!(
            p.chunks().iter().map(|c| c.payload_bytes).sum::<u64>(),
            p.total_bytes
        );
    }
}
