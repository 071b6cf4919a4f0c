//! Engine KV layouts (issue 12): what a serving engine's paged KV pool looks
//! like, whether two engines' layouts can be mapped onto each other, and the
//! (src, dst, len) descriptors a hand-off of blocks becomes.
//!
//! A pool is layer-major:
//!
//! ```text
//! offset(layer, plane, block) = ((layer * planes + plane) * num_blocks + block) * block_bytes
//! ```
//!
//! with `planes` = 2 when K and V are split (K then V), else 1. Inside a
//! block the bytes are `[block_tokens][kv_heads][head_dim]` of the dtype, so
//! `block_bytes = block_tokens * kv_heads * head_dim * dtype_bytes`.
//!
//! Heterogeneous tensor parallelism (the seed's own configuration is a
//! context TP 1 → generation TP 4): a source engine with TP `p` hands off to
//! destination engines with TP `d`, `d` a multiple of `p`. Source rank `r`
//! holds the heads of destination ranks `r*q .. r*q + q` (`q = d / p`);
//! destination rank `j` receives, for every token of every block, the
//! contiguous slice of `kv_heads_dst` heads starting at head
//! `(j - r*q) * kv_heads_dst` of the source rank — a strided descriptor per
//! token, which the planner merges into uniform-stride runs.
//!
//! Everything here is pure: no memory is touched, only offsets computed.

use std::fmt;

use crate::types::Descriptor;

/// Bytes of one element of `dtype` (`bf16`, `fp16`, `fp8`, `fp32`, `u8`).
pub fn dtype_bytes(dtype: &str) -> Option<u64> {
    match dtype {
        "bf16" | "fp16" | "f16" => Some(2),
        "fp8" | "u8" | "int8" => Some(1),
        "fp32" | "f32" => Some(4),
        _ => None,
    }
}

/// An engine's KV geometry (the engine API's `KvLayout`; serialized with
/// these field names in the agents' discovery records).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct EngineLayout {
    /// Transformer layers in the pool.
    pub layers: u32,
    /// Blocks per layer and plane.
    pub num_blocks: u32,
    /// Bytes of one block of one layer and plane.
    pub block_bytes: u64,
    /// K and V in separate planes.
    pub kv_split: bool,
    /// Element type (see [`dtype_bytes`]).
    pub dtype: String,
    /// This engine's tensor-parallel rank.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// KV heads held by this rank.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// CUDA device ordinal; -1 = host memory.
    pub device: i32,
    /// UUID of the engine's GPU as CUDA reports it (`cuDeviceGetUuid`,
    /// torch's `get_device_properties(i).uuid`); empty = not given. Text:
    /// 32 hex digits, hyphenated 8-4-4-4-12 or not, optionally prefixed
    /// `GPU-` or `MIG-` as `nvidia-smi -L` prints it ([`parse_gpu_uuid`]).
    /// An ordinal is per process (`CUDA_VISIBLE_DEVICES`, a pod's
    /// `NVIDIA_VISIBLE_DEVICES`: an engine pod with one GPU sees it as
    /// device 0 whatever the node calls it), so an agent matches engines
    /// to its GPU by this UUID where it is given, by `device` otherwise.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub device_uuid: String,
}

/// The 16 bytes of a GPU UUID written as `nvidia-smi -L` (`GPU-` or `MIG-`
/// prefix), as torch prints it (bare, hyphenated 8-4-4-4-12) or as 32
/// plain hex digits; case-insensitive.
///
/// # Errors
/// A message naming the text and the expected form.
pub fn parse_gpu_uuid(text: &str) -> Result<[u8; 16], String> {
    let bare = text
        .strip_prefix("GPU-")
        .or_else(|| text.strip_prefix("MIG-"))
        .unwrap_or(text);
    // Only the two forms CUDA tools print (not uuid's braced or URN forms).
    let hyphens = bare.bytes().filter(|&b| b == b'-').count();
    let shape_ok = (bare.len() == 36 && hyphens == 4) || (bare.len() == 32 && hyphens == 0);
    match uuid::Uuid::try_parse(bare) {
        Ok(u) if shape_ok => Ok(*u.as_bytes()),
        _ => Err(format!(
            "GPU UUID {text:?}: expected 32 hex digits as 8-4-4-4-12 (optionally prefixed GPU- or MIG-, \
             as `nvidia-smi -L` prints it)"
        )),
    }
}

/// The canonical text of a GPU UUID: lowercase, hyphenated 8-4-4-4-12, no
/// prefix (what torch's `get_device_properties(i).uuid` prints).
pub fn format_gpu_uuid(bytes: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*bytes).hyphenated().to_string()
}

/// Why a layout, or a pair of layouts, was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// One layout is invalid on its own (field named).
    #[error("invalid KV layout: {0}")]
    Invalid(String),
    /// The two layouts cannot be mapped onto each other (both shown).
    #[error("layouts cannot be mapped: {reason} (source {src}; destination {dst})")]
    Mismatch {
        /// What differs.
        reason: String,
        /// The source layout.
        src: String,
        /// The destination layout.
        dst: String,
    },
    /// A block id or extent is outside a pool (named).
    #[error("{0}")]
    OutOfRange(String),
}

impl fmt::Display for EngineLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "layers={} blocks={} block_bytes={} kv_split={} dtype={} tp={}/{} block_tokens={} kv_heads={} head_dim={} device={}",
            self.layers,
            self.num_blocks,
            self.block_bytes,
            self.kv_split,
            self.dtype,
            self.tp_rank,
            self.tp_size,
            self.block_tokens,
            self.kv_heads,
            self.head_dim,
            self.device
        )?;
        if !self.device_uuid.is_empty() {
            write!(f, " device_uuid={}", self.device_uuid)?;
        }
        Ok(())
    }
}

impl EngineLayout {
    /// Checks the layout on its own: every count ≥ 1, a known dtype,
    /// `tp_rank < tp_size`, `block_bytes` equal to
    /// `block_tokens × kv_heads × head_dim × dtype bytes`, and a pool size
    /// that fits in 64 bits.
    ///
    /// # Errors
    /// [`LayoutError::Invalid`] naming the first bad field.
    pub fn validate(&self) -> Result<(), LayoutError> {
        let bad = |m: String| Err(LayoutError::Invalid(m));
        for (name, v) in [
            ("layers", self.layers),
            ("num_blocks", self.num_blocks),
            ("tp_size", self.tp_size),
            ("block_tokens", self.block_tokens),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        let Some(dt) = dtype_bytes(&self.dtype) else {
            return bad(format!(
                "dtype {:?}: expected bf16, fp16, fp8, fp32 or u8",
                self.dtype
            ));
        };
        if self.tp_rank >= self.tp_size {
            return bad(format!(
                "tp_rank {} must be below tp_size {}",
                self.tp_rank, self.tp_size
            ));
        }
        if self.device < -1 {
            return bad(format!(
                "device {}: expected -1 (host) or a CUDA ordinal",
                self.device
            ));
        }
        if !self.device_uuid.is_empty() {
            if self.device < 0 {
                return bad(format!(
                    "device_uuid {:?} given for a host pool (device -1): a GPU UUID names the engine's CUDA device",
                    self.device_uuid
                ));
            }
            parse_gpu_uuid(&self.device_uuid).map_err(LayoutError::Invalid)?;
        }
        let want = u64::from(self.block_tokens)
            .checked_mul(u64::from(self.kv_heads))
            .and_then(|x| x.checked_mul(u64::from(self.head_dim)))
            .and_then(|x| x.checked_mul(dt));
        if want != Some(self.block_bytes) {
            return bad(format!(
                "block_bytes {} != block_tokens {} × kv_heads {} × head_dim {} × {} bytes ({})",
                self.block_bytes, self.block_tokens, self.kv_heads, self.head_dim, dt, self.dtype
            ));
        }
        if self.pool_bytes().is_none() {
            return bad("pool size overflows 64 bits".into());
        }
        Ok(())
    }

    /// K/V planes: 2 with `kv_split`, else 1.
    pub fn planes(&self) -> u64 {
        if self.kv_split {
            2
        } else {
            1
        }
    }

    /// Pool size in bytes, `None` on overflow.
    pub fn pool_bytes(&self) -> Option<u64> {
        u64::from(self.layers)
            .checked_mul(self.planes())
            .and_then(|x| x.checked_mul(u64::from(self.num_blocks)))
            .and_then(|x| x.checked_mul(self.block_bytes))
    }

    /// Byte offset of `(layer, plane, block)` in the pool (no range check).
    pub fn block_offset(&self, layer: u32, plane: u64, block: u32) -> u64 {
        ((u64::from(layer) * self.planes() + plane) * u64::from(self.num_blocks) + u64::from(block))
            * self.block_bytes
    }

    /// A stable 64-bit fingerprint of the fields two engines must agree on
    /// to exchange KV (everything but `num_blocks`, `tp_rank`, `kv_heads`,
    /// `block_bytes` and `device`, which may differ per rank / pool), as 16
    /// hex digits. FNV-1a over the canonical text.
    pub fn fingerprint(&self) -> String {
        let canon = format!(
            "v1 layers={} kv_split={} dtype={} block_tokens={} head_dim={} heads_total={}",
            self.layers,
            self.kv_split,
            self.dtype,
            self.block_tokens,
            self.head_dim,
            u64::from(self.kv_heads) * u64::from(self.tp_size)
        );
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in canon.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{h:016x}")
    }
}

/// Where an agent's arena (and so the engines it can serve) lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArenaDevice {
    /// Host memory: engines with host pools (`device` -1).
    Host,
    /// A GPU of the agent's process: its ordinal there and its UUID
    /// (`None` where the driver did not report one).
    Gpu {
        /// CUDA ordinal in the agent's process.
        ordinal: i32,
        /// `cuDeviceGetUuid`'s 16 bytes.
        uuid: Option<[u8; 16]>,
    },
}

/// Whether an engine with `layout` (already [`EngineLayout::validate`]d)
/// runs on the agent's arena device: host pools on a host agent; GPU pools
/// on a GPU agent, matched by `device_uuid` where both sides know it (the
/// ordinals may then differ: they are per process), by ordinal otherwise.
/// With `require_uuid` (the agent's `requireDeviceUuid`, set where a node
/// runs one agent per GPU) a GPU engine without a UUID is refused where
/// the agent knows its own, since ordinals would match the wrong GPU.
///
/// # Errors
/// A message naming the engine's device and the agent's, and what to do.
pub fn check_device(
    layout: &EngineLayout,
    arena: ArenaDevice,
    require_uuid: bool,
) -> Result<(), String> {
    let (ordinal, uuid) = match arena {
        ArenaDevice::Host if layout.device < 0 => return Ok(()),
        ArenaDevice::Host => {
            return Err(format!(
                "layout.device {}: this agent's arena is in host memory (a GPU engine attaches to an agent started with --gpu)",
                layout.device
            ))
        }
        ArenaDevice::Gpu { .. } if layout.device < 0 => {
            return Err(
                "layout.device -1 (host pool): this agent's arena and copy engine are on a GPU; \
                 attach host-memory engines to an agent started without --gpu"
                    .into(),
            )
        }
        ArenaDevice::Gpu { ordinal, uuid } => (ordinal, uuid),
    };
    let here = match uuid {
        Some(u) => format!("GPU {} (ordinal {ordinal} here)", format_gpu_uuid(&u)),
        None => format!("GPU {ordinal}"),
    };
    let given = if layout.device_uuid.is_empty() {
        None
    } else {
        Some(parse_gpu_uuid(&layout.device_uuid)?)
    };
    match (given, uuid) {
        (Some(g), Some(u)) if g == u => Ok(()),
        (Some(g), Some(_)) => Err(format!(
            "layout.device_uuid {g} (device {} in the engine's process): this agent's arena is on \
             {here}; attach to the agent of GPU {g} (with the chart, the socket named after that \
             UUID: kvfabric.engine_socket)",
            layout.device,
            g = format_gpu_uuid(&g),
        )),
        (None, Some(u)) if require_uuid => Err(format!(
            "layout.device_uuid missing: this agent (GPU {}, one agent per GPU) matches GPU engines \
             by UUID, since ordinals are per process; send the UUID of the engine's GPU (the Python \
             client does where torch is installed)",
            format_gpu_uuid(&u)
        )),
        (_, _) if layout.device == ordinal => Ok(()),
        (Some(_), None) => Err(format!(
            "layout.device {}: this agent's driver reported no GPU UUID, so engines are matched by \
             ordinal, and its arena is on {here}",
            layout.device
        )),
        (None, _) => Err(format!(
            "layout.device {}: this agent's arena is on {here} (one agent serves one GPU; ordinals \
             are per process, so send layout.device_uuid and attach to the agent of your GPU)",
            layout.device
        )),
    }
}

/// How a source engine's blocks map onto a destination engine's:
/// `q = dst.tp_size / src.tp_size` destination ranks per source rank, and
/// the head offset of the destination rank's slice in a source block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadMap {
    /// Bytes of one token of the source block (`kv_heads_src × head_dim × dt`).
    pub src_token_bytes: u64,
    /// Bytes of one token of the destination block.
    pub dst_token_bytes: u64,
    /// Offset of the destination's slice inside a source token, bytes.
    pub slice_offset: u64,
}

/// Checks that `src` can hand blocks to `dst` and returns the head mapping.
///
/// Requirements: both valid; equal layers, K/V split, dtype, block tokens
/// and head dim; `dst.tp_size` a multiple of `src.tp_size` with the same
/// total KV heads; and `dst.tp_rank` one of the ranks `src.tp_rank` feeds.
///
/// # Errors
/// [`LayoutError::Mismatch`] naming what differs and showing both layouts
/// (or [`LayoutError::Invalid`] for a layout bad on its own).
pub fn head_map(src: &EngineLayout, dst: &EngineLayout) -> Result<HeadMap, LayoutError> {
    src.validate()?;
    dst.validate()?;
    let mismatch = |reason: String| LayoutError::Mismatch {
        reason,
        src: src.to_string(),
        dst: dst.to_string(),
    };
    let same = [
        ("layers", src.layers == dst.layers),
        ("kv_split", src.kv_split == dst.kv_split),
        ("dtype", src.dtype == dst.dtype),
        ("block_tokens", src.block_tokens == dst.block_tokens),
        ("head_dim", src.head_dim == dst.head_dim),
    ];
    if let Some((field, _)) = same.iter().find(|(_, ok)| !ok) {
        return Err(mismatch(format!("{field} differs")));
    }
    if dst.tp_size % src.tp_size != 0 {
        return Err(mismatch(format!(
            "destination TP {} is not a multiple of source TP {}",
            dst.tp_size, src.tp_size
        )));
    }
    let q = dst.tp_size / src.tp_size;
    if u64::from(src.kv_heads) * u64::from(src.tp_size)
        != u64::from(dst.kv_heads) * u64::from(dst.tp_size)
    {
        return Err(mismatch(format!(
            "total KV heads differ ({} × TP {} vs {} × TP {})",
            src.kv_heads, src.tp_size, dst.kv_heads, dst.tp_size
        )));
    }
    if dst.tp_rank / q != src.tp_rank {
        return Err(mismatch(format!(
            "destination rank {} is fed by source rank {}, not {}",
            dst.tp_rank,
            dst.tp_rank / q,
            src.tp_rank
        )));
    }
    let dt = dtype_bytes(&src.dtype).unwrap_or(1);
    let hd = u64::from(src.head_dim) * dt;
    Ok(HeadMap {
        src_token_bytes: u64::from(src.kv_heads) * hd,
        dst_token_bytes: u64::from(dst.kv_heads) * hd,
        slice_offset: u64::from(dst.tp_rank % q) * u64::from(dst.kv_heads) * hd,
    })
}

/// Most descriptors one hand-off may expand to (16,777,216): bounds what
/// an engine's request makes the agent allocate (a layout with many layers
/// and a long block list would otherwise ask for gigabytes).
pub const MAX_TRANSFER_DESCRIPTORS: u64 = 1 << 24;

/// The descriptors that move `src_blocks[i]` → `dst_blocks[i]` for every
/// layer and plane, with the pools at `src_base` / `dst_base` (addresses in
/// the sender's and the receiver's address space). With equal TP one
/// descriptor per (layer, plane, block pair); with a head split one per
/// token (`HeadMap`). Descriptors come out ordered by layer, plane, block,
/// token.
///
/// # Errors
/// [`LayoutError::OutOfRange`] for lists of different lengths or a block id
/// at or beyond a pool's `num_blocks` (the index and id named); the
/// layout errors of [`head_map`].
pub fn block_descriptors(
    src: &EngineLayout,
    src_base: u64,
    dst: &EngineLayout,
    dst_base: u64,
    src_blocks: &[u32],
    dst_blocks: &[u32],
) -> Result<Vec<Descriptor>, LayoutError> {
    let map = check_block_pairs(src, dst, src_blocks, dst_blocks)?;
    build_block_descriptors(src, src_base, dst, dst_base, src_blocks, dst_blocks, map)
}

/// The checks of [`block_descriptors`] without building anything: the two
/// layouts map ([`head_map`], returned), the lists have equal lengths and
/// every id is inside its pool. A caller that moves whole blocks by id
/// (the direct path's block kernel) needs only this.
///
/// # Errors
/// As [`block_descriptors`].
pub fn check_block_pairs(
    src: &EngineLayout,
    dst: &EngineLayout,
    src_blocks: &[u32],
    dst_blocks: &[u32],
) -> Result<HeadMap, LayoutError> {
    let map = head_map(src, dst)?;
    if src_blocks.len() != dst_blocks.len() {
        return Err(LayoutError::OutOfRange(format!(
            "{} source blocks but {} destination blocks",
            src_blocks.len(),
            dst_blocks.len()
        )));
    }
    for (i, (&s, &d)) in src_blocks.iter().zip(dst_blocks).enumerate() {
        if s >= src.num_blocks {
            return Err(LayoutError::OutOfRange(format!(
                "src_blocks[{i}] = {s} is out of range (the source pool has {} blocks)",
                src.num_blocks
            )));
        }
        if d >= dst.num_blocks {
            return Err(LayoutError::OutOfRange(format!(
                "dst_blocks[{i}] = {d} is out of range (the destination pool has {} blocks)",
                dst.num_blocks
            )));
        }
    }
    Ok(map)
}

fn build_block_descriptors(
    src: &EngineLayout,
    src_base: u64,
    dst: &EngineLayout,
    dst_base: u64,
    src_blocks: &[u32],
    dst_blocks: &[u32],
    map: HeadMap,
) -> Result<Vec<Descriptor>, LayoutError> {
    let whole = map.src_token_bytes == map.dst_token_bytes;
    let per_pair = if whole {
        1
    } else {
        u64::from(src.block_tokens)
    };
    let count = u64::from(src.layers)
        .checked_mul(src.planes())
        .and_then(|x| x.checked_mul(src_blocks.len() as u64))
        .and_then(|x| x.checked_mul(per_pair))
        .filter(|&n| n <= MAX_TRANSFER_DESCRIPTORS)
        .ok_or_else(|| {
            LayoutError::OutOfRange(format!(
                "{} block pairs x {} layers x {} planes x {per_pair} pieces exceed \
                 {MAX_TRANSFER_DESCRIPTORS} descriptors per hand-off",
                src_blocks.len(),
                src.layers,
                src.planes(),
            ))
        })?;
    let mut out = Vec::with_capacity(count as usize);
    for layer in 0..src.layers {
        for plane in 0..src.planes() {
            for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
                let so = src_base + src.block_offset(layer, plane, s);
                let doff = dst_base + dst.block_offset(layer, plane, d);
                if whole {
                    out.push(Descriptor::new(so, doff, src.block_bytes));
                } else {
                    for t in 0..u64::from(src.block_tokens) {
                        out.push(Descriptor::new(
                            so + t * map.src_token_bytes + map.slice_offset,
                            doff + t * map.dst_token_bytes,
                            map.dst_token_bytes,
                        ));
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Descriptors for the non-paged form: `(src_offset, dst_offset, len)`
/// extents inside pools of `src_len` / `dst_len` bytes at the two bases.
///
/// # Errors
/// [`LayoutError::OutOfRange`] naming the first extent that is empty,
/// overflows or leaves its pool.
pub fn extent_descriptors(
    src_base: u64,
    src_len: u64,
    dst_base: u64,
    dst_len: u64,
    extents: &[(u64, u64, u64)],
) -> Result<Vec<Descriptor>, LayoutError> {
    let mut out = Vec::with_capacity(extents.len());
    for (i, &(so, doff, len)) in extents.iter().enumerate() {
        let fits = |off: u64, pool: u64| off.checked_add(len).is_some_and(|e| e <= pool);
        if len == 0 || !fits(so, src_len) || !fits(doff, dst_len) {
            return Err(LayoutError::OutOfRange(format!(
                "extent {i} (src_offset {so}, dst_offset {doff}, len {len}) is empty or outside \
                 the pools ({src_len} / {dst_len} bytes)"
            )));
        }
        out.push(Descriptor::new(src_base + so, dst_base + doff, len));
    }
    Ok(out)
}

/// The runs of a direct copy (issue 19: both pools mapped by one agent, no
/// intermediate region): each run copies `count` segments of
/// `segment_len` bytes from absolute source `region_offset + k *
/// region_stride` to `addr + k * addr_stride` — the kernel's scatter form
/// with a region base of 0. Consecutive descriptors of equal length whose
/// sources and destinations advance by constant strides merge into one run
/// (a dense block list becomes a few runs) when `merge` is set; without it
/// every descriptor is its own run (one kernel task each: the widest
/// parallelism, and the cheapest build — for random block lists merging
/// saves little and costs ≈ 13 ns a descriptor, measured on the H200
/// host). Zero-length descriptors are dropped. Pure; O(descriptors).
pub fn direct_runs(descs: &[Descriptor], merge: bool) -> Vec<crate::types::ScatterRun> {
    use crate::types::ScatterRun;
    if !merge {
        return descs
            .iter()
            .filter(|d| d.len > 0)
            .map(|d| ScatterRun {
                region_offset: d.src,
                addr: d.dst,
                segment_len: d.len,
                region_stride: 0,
                addr_stride: 0,
                count: 1,
            })
            .collect();
    }
    let mut out: Vec<ScatterRun> = Vec::new();
    for d in descs.iter().filter(|d| d.len > 0) {
        if let Some(r) = out.last_mut() {
            if r.segment_len == d.len && r.count < u32::MAX {
                let last_src = r.region_offset + u64::from(r.count - 1) * r.region_stride;
                let last_dst = r.addr + u64::from(r.count - 1) * r.addr_stride;
                let (ds, dd) = (d.src.wrapping_sub(last_src), d.dst.wrapping_sub(last_dst));
                let fits = if r.count == 1 {
                    // The second segment fixes the strides (forward only).
                    d.src > last_src && d.dst > last_dst
                } else {
                    ds == r.region_stride
                        && dd == r.addr_stride
                        && d.src > last_src
                        && d.dst > last_dst
                };
                if fits {
                    if r.count == 1 {
                        r.region_stride = ds;
                        r.addr_stride = dd;
                    }
                    r.count += 1;
                    continue;
                }
            }
        }
        out.push(ScatterRun {
            region_offset: d.src,
            addr: d.dst,
            segment_len: d.len,
            region_stride: 0,
            addr_stride: 0,
            count: 1,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(tp_rank: u32, tp_size: u32, total_heads: u32) -> EngineLayout {
        let kv_heads = total_heads / tp_size;
        EngineLayout {
            layers: 2,
            num_blocks: 8,
            block_bytes: 16 * u64::from(kv_heads) * 4 * 2,
            kv_split: true,
            dtype: "bf16".into(),
            tp_rank,
            tp_size,
            block_tokens: 16,
            kv_heads,
            head_dim: 4,
            device: -1,
            device_uuid: String::new(),
        }
    }

    const UUID_A: &str = "5a2b1c3d-0e4f-4a1b-9c8d-7e6f5a4b3c2d";
    const UUID_B: &str = "GPU-0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9";

    #[test]
    fn gpu_uuid_forms_and_refusals() {
        let a = parse_gpu_uuid(UUID_A).unwrap();
        assert_eq!(format_gpu_uuid(&a), UUID_A);
        assert_eq!(
            parse_gpu_uuid(&format!("GPU-{}", UUID_A.to_uppercase())),
            Ok(a)
        );
        assert_eq!(parse_gpu_uuid(&format!("MIG-{UUID_A}")), Ok(a));
        assert_eq!(parse_gpu_uuid(&UUID_A.replace('-', "")), Ok(a));
        for bad in [
            "",
            "GPU-",
            "0",
            "{5a2b1c3d-0e4f-4a1b-9c8d-7e6f5a4b3c2d}",
            "urn:uuid:5a2b1c3d-0e4f-4a1b-9c8d-7e6f5a4b3c2d",
            "5a2b1c3d-0e4f-4a1b-9c8d-7e6f5a4b3c2x",
            "NVD-5a2b1c3d-0e4f-4a1b-9c8d-7e6f5a4b3c2d",
        ] {
            let e = parse_gpu_uuid(bad).unwrap_err();
            assert!(
                e.contains(&format!("{bad:?}")) && e.contains("8-4-4-4-12"),
                "{e}"
            );
        }
    }

    #[test]
    fn layout_validates_device_uuid() {
        let mut l = layout(0, 1, 8);
        l.device_uuid = UUID_A.into();
        let e = l.validate().unwrap_err().to_string();
        assert!(e.contains("host pool") && e.contains(UUID_A), "{e}");
        l.device = 0;
        assert!(l.validate().is_ok());
        assert!(l
            .to_string()
            .ends_with(&format!("device=0 device_uuid={UUID_A}")));
        l.device_uuid = "GPU-zz".into();
        assert!(l.validate().unwrap_err().to_string().contains("GPU-zz"));
        // A record without the field (older agents) still decodes.
        let mut plain = layout(0, 1, 8);
        let text = serde_yaml::to_string(&plain).unwrap();
        assert!(!text.contains("device_uuid"));
        assert_eq!(serde_yaml::from_str::<EngineLayout>(&text).unwrap(), plain);
        plain.device = 0;
        plain.device_uuid = UUID_A.into();
        let back: EngineLayout =
            serde_yaml::from_str(&serde_yaml::to_string(&plain).unwrap()).unwrap();
        assert_eq!(back, plain);
    }

    #[test]
    fn engines_match_the_arena_by_uuid_then_ordinal() {
        let a = parse_gpu_uuid(UUID_A).unwrap();
        let host = layout(0, 1, 8);
        let mut gpu = layout(0, 1, 8);
        gpu.device = 0;
        let arena = |ordinal, uuid| ArenaDevice::Gpu { ordinal, uuid };
        assert_eq!(check_device(&host, ArenaDevice::Host, false), Ok(()));
        assert!(check_device(&host, arena(0, Some(a)), false)
            .unwrap_err()
            .contains("host pool"));
        assert!(check_device(&gpu, ArenaDevice::Host, false)
            .unwrap_err()
            .contains("host memory"));
        // No UUID: the ordinals must agree.
        assert_eq!(check_device(&gpu, arena(0, Some(a)), false), Ok(()));
        let e = check_device(&gpu, arena(3, Some(a)), false).unwrap_err();
        assert!(
            e.contains("layout.device 0") && e.contains(UUID_A) && e.contains("ordinal 3"),
            "{e}"
        );
        // A pod that sees its GPU as device 0 on an agent where it is 3.
        gpu.device_uuid = UUID_A.to_uppercase();
        assert_eq!(check_device(&gpu, arena(3, Some(a)), false), Ok(()));
        // Another GPU's engine, even with the agent's ordinal: refused,
        // both UUIDs named.
        gpu.device_uuid = UUID_B.into();
        let e = check_device(&gpu, arena(0, Some(a)), false).unwrap_err();
        assert!(
            e.contains(UUID_A) && e.contains(&UUID_B[4..]) && e.contains("attach to the agent"),
            "{e}"
        );
        // The agent knows no UUID: back to the ordinal.
        assert_eq!(check_device(&gpu, arena(0, None), false), Ok(()));
        let e = check_device(&gpu, arena(1, None), false).unwrap_err();
        assert!(
            e.contains("reported no GPU UUID") && e.contains("GPU 1"),
            "{e}"
        );
        // requireDeviceUuid: no UUID, no match by ordinal.
        gpu.device_uuid.clear();
        assert_eq!(check_device(&gpu, arena(0, Some(a)), false), Ok(()));
        let e = check_device(&gpu, arena(0, Some(a)), true).unwrap_err();
        assert!(
            e.contains("device_uuid missing") && e.contains(UUID_A),
            "{e}"
        );
        // ... unless the agent has none to compare with.
        assert_eq!(check_device(&gpu, arena(0, None), true), Ok(()));
        gpu.device_uuid = UUID_A.into();
        assert_eq!(check_device(&gpu, arena(5, Some(a)), true), Ok(()));
    }

    #[test]
    fn validation_names_the_field() {
        let mut l = layout(0, 1, 8);
        assert!(l.validate().is_ok());
        l.block_bytes += 1;
        assert!(l
            .validate()
            .unwrap_err()
            .to_string()
            .contains("block_bytes"));
        let mut l = layout(0, 1, 8);
        l.dtype = "q4".into();
        assert!(l.validate().unwrap_err().to_string().contains("dtype"));
        let mut l = layout(0, 1, 8);
        l.tp_rank = 1;
        assert!(l.validate().unwrap_err().to_string().contains("tp_rank"));
        let mut l = layout(0, 1, 8);
        l.layers = 0;
        assert!(l.validate().unwrap_err().to_string().contains("layers"));
    }

    #[test]
    fn mismatches_are_refused_naming_both_layouts() {
        let src = layout(0, 1, 8);
        let mut dst = layout(0, 1, 8);
        dst.block_tokens = 32;
        dst.block_bytes *= 2;
        let e = head_map(&src, &dst).unwrap_err().to_string();
        assert!(
            e.contains("block_tokens differs") && e.contains("source") && e.contains("destination"),
            "{e}"
        );
        let e = head_map(&layout(0, 2, 8), &layout(0, 3, 9))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a multiple"), "{e}");
        assert!(head_map(&layout(0, 1, 8), &layout(2, 4, 8)).is_ok());
        let e = head_map(&layout(1, 2, 8), &layout(0, 4, 8))
            .unwrap_err()
            .to_string();
        assert!(e.contains("fed by source rank 0"), "{e}");
        assert_ne!(
            layout(0, 1, 8).fingerprint(),
            layout(0, 1, 16).fingerprint()
        );
        assert_eq!(layout(0, 1, 8).fingerprint(), layout(3, 4, 8).fingerprint());
    }

    /// A TP 1 → TP 4 hand-off: each destination rank gets exactly its
    /// heads of every token, byte for byte (checked by simulating the copy).
    #[test]
    fn tp1_to_tp4_moves_each_head_slice() {
        let src = layout(0, 1, 8);
        let mut src_pool: Vec<u8> = (0..src.pool_bytes().unwrap())
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        src_pool[0] = 1;
        for rank in 0..4 {
            let dst = layout(rank, 4, 8);
            let mut dst_pool = vec![0u8; dst.pool_bytes().unwrap() as usize];
            let descs = block_descriptors(&src, 0, &dst, 0, &[5, 1], &[2, 7]).unwrap();
            for d in &descs {
                dst_pool[d.dst as usize..(d.dst + d.len) as usize]
                    .copy_from_slice(&src_pool[d.src as usize..(d.src + d.len) as usize]);
            }
            let hb = 4 * 2; // head_dim × bf16
            for layer in 0..2 {
                for plane in 0..2 {
                    for (s, d) in [(5u32, 2u32), (1, 7)] {
                        for t in 0..16u64 {
                            for h in 0..2u64 {
                                let so = src.block_offset(layer, plane, s)
                                    + t * 8 * hb
                                    + (u64::from(rank) * 2 + h) * hb;
                                let doff = dst.block_offset(layer, plane, d) + t * 2 * hb + h * hb;
                                assert_eq!(
                                    &dst_pool[doff as usize..(doff + hb) as usize],
                                    &src_pool[so as usize..(so + hb) as usize],
                                    "rank {rank} layer {layer} plane {plane} token {t} head {h}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Direct runs move exactly the descriptors' bytes: simulated copy.
    #[test]
    fn direct_runs_cover_every_descriptor_and_merge_strides() {
        let descs: Vec<Descriptor> = (0..10u64)
            .map(|k| Descriptor::new(1000 + k * 64, 50_000 + k * 128, 32))
            .chain([Descriptor::new(9_000, 40_000, 16), Descriptor::new(1, 2, 0)])
            .chain((0..3u64).map(|k| Descriptor::new(20_000 - k * 100, 30_000 + k * 32, 32)))
            .collect();
        let unmerged = direct_runs(&descs, false);
        assert_eq!(unmerged.len(), 14);
        assert!(unmerged.iter().all(|r| r.count == 1));
        let runs = direct_runs(&descs, true);
        assert_eq!(runs[0].count, 10);
        assert_eq!((runs[0].region_stride, runs[0].addr_stride), (64, 128));
        let mut got = Vec::new();
        let mut got_unmerged = Vec::new();
        for r in &unmerged {
            got_unmerged.push(Descriptor::new(r.region_offset, r.addr, r.segment_len));
        }
        for r in &runs {
            for k in 0..u64::from(r.count) {
                got.push(Descriptor::new(
                    r.region_offset + k * r.region_stride,
                    r.addr + k * r.addr_stride,
                    r.segment_len,
                ));
            }
        }
        let want: Vec<Descriptor> = descs.into_iter().filter(|d| d.len > 0).collect();
        assert_eq!(got, want);
        assert_eq!(got_unmerged, want);
    }

    #[test]
    fn block_ids_and_extents_are_range_checked() {
        let l = layout(0, 1, 8);
        let e = block_descriptors(&l, 0, &l, 0, &[8], &[0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("src_blocks[0] = 8"), "{e}");
        let e = block_descriptors(&l, 0, &l, 0, &[0], &[9])
            .unwrap_err()
            .to_string();
        assert!(e.contains("dst_blocks[0] = 9"), "{e}");
        assert!(block_descriptors(&l, 0, &l, 0, &[0, 1], &[0]).is_err());
        let d = block_descriptors(&l, 100, &l, 1000, &[1], &[2]).unwrap();
        assert_eq!(d.len(), 4);
        assert_eq!(
            d[0],
            Descriptor::new(100 + l.block_bytes, 1000 + 2 * l.block_bytes, l.block_bytes)
        );
        assert!(extent_descriptors(0, 10, 0, 10, &[(5, 0, 6)]).is_err());
        assert!(extent_descriptors(0, 10, 0, 10, &[(0, 0, 0)]).is_err());
        assert!(extent_descriptors(0, 10, 0, 10, &[(u64::MAX, 0, 2)]).is_err());
        assert_eq!(
            extent_descriptors(1, 10, 2, 10, &[(4, 5, 5)]).unwrap(),
            vec![Descriptor::new(5, 7, 5)]
        );
    }
}
