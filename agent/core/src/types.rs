//! Shared vocabulary of the engine (seed §3 "Terminology").

use serde::{Deserialize, Serialize};
use std::fmt;

/// One (src, dst, len) copy the caller asked for: `len` bytes from address
/// `src` (sender memory) to address `dst` (receiver memory). Addresses are
/// plain 64-bit device or host virtual addresses; `len` is in bytes.
/// No kernel reads this struct's memory (the uniform gather uploads the
/// source addresses alone, issue 18).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Descriptor {
    /// Source address on the sender (bytes).
    pub src: u64,
    /// Destination address on the receiver (bytes).
    pub dst: u64,
    /// Length in bytes; zero-length descriptors are skipped by the plan.
    pub len: u64,
}

impl Descriptor {
    /// Builds a descriptor of `len` bytes from `src` to `dst`.
    pub const fn new(src: u64, dst: u64, len: u64) -> Self {
        Self { src, dst, len }
    }
}

/// A coalesced scatter (or gather) plan entry (seed §3 "scatter run",
/// `BounceScatterRun`): `count` segments of `segment_len` bytes each;
/// segment `i` lives at region offset `region_offset + i * region_stride`
/// (bytes from the start of the chunk's region) and is copied to address
/// `addr + i * addr_stride`.
///
/// A single descriptor is a run with `count == 1` (strides are then 0).
/// A run with `region_stride == addr_stride == segment_len` is fully
/// contiguous and could equally be written as one segment of
/// `count * segment_len` bytes; the plan emits that form.
///
/// `#[repr(C)]`, 48 bytes, in the field order of the copy kernel's
/// `struct kvf_run` (kernels/gather_scatter.cu; 4 padding bytes at the
/// end), so a GPU copy engine can hand a run list to the kernel as is.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ScatterRun {
    /// Offset of the first segment inside the chunk's region (bytes).
    pub region_offset: u64,
    /// Address of the first segment's destination (scatter) or source
    /// (gather) in user memory.
    pub addr: u64,
    /// Bytes per segment (> 0).
    pub segment_len: u64,
    /// Distance between consecutive segments inside the region (bytes).
    pub region_stride: u64,
    /// Distance between consecutive segments in user memory (bytes).
    pub addr_stride: u64,
    /// Number of segments (≥ 1).
    pub count: u32,
}

const _: () = assert!(std::mem::size_of::<ScatterRun>() == 48);

impl ScatterRun {
    /// Total bytes this run moves: `segment_len * count`. Saturates instead
    /// of overflowing (decoded runs are untrusted).
    pub fn total_bytes(&self) -> u64 {
        self.segment_len.saturating_mul(u64::from(self.count))
    }

    /// Iterates the segments as `(region_offset, addr, len)` triples.
    pub fn segments(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        (0..u64::from(self.count)).map(move |i| {
            (
                self.region_offset
                    .wrapping_add(i.wrapping_mul(self.region_stride)),
                self.addr.wrapping_add(i.wrapping_mul(self.addr_stride)),
                self.segment_len,
            )
        })
    }

    /// One past the last region byte this run touches, or `None` on
    /// arithmetic overflow (a malformed run). Used to validate a peer's DATA
    /// against the granted region (seed §9 "scatter input validation").
    pub fn region_end(&self) -> Option<u64> {
        if self.count == 0 {
            return Some(self.region_offset);
        }
        let last = u64::from(self.count - 1);
        self.region_stride
            .checked_mul(last)?
            .checked_add(self.region_offset)?
            .checked_add(self.segment_len)
    }
}

/// A uniform chunk's scatter (issue 18 step 3, kvfabric's own): piece `i`
/// of `segment_len` bytes, at region offset `i * region_stride`, goes to
/// address `dsts[i]`. A chunk of whole equal-length descriptors
/// ([`crate::plan::TransferPlan::uniform_pieces`]) is described by its
/// descriptors' destinations alone: no runs are planned on the sender
/// (≈ 100–200 µs a 16 MiB chunk of 4 KiB blocks on the H200 host), and a
/// DATA carries 8 bytes a piece instead of 48 a run.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct UniformScatter {
    /// Bytes of every piece (> 0 in a valid list).
    pub segment_len: u64,
    /// Region bytes between consecutive pieces (≥ `segment_len` in a
    /// valid list).
    pub region_stride: u64,
    /// Destination address of each piece, in region order.
    pub dsts: Vec<u64>,
}

impl UniformScatter {
    /// Total bytes moved: `segment_len * dsts.len()`, saturating (decoded
    /// lists are untrusted).
    pub fn total_bytes(&self) -> u64 {
        self.segment_len.saturating_mul(self.dsts.len() as u64)
    }

    /// One past the last region byte a piece touches (0 for no pieces),
    /// or `None` on arithmetic overflow.
    pub fn region_end(&self) -> Option<u64> {
        match self.dsts.len() {
            0 => Some(0),
            n => self
                .region_stride
                .checked_mul(n as u64 - 1)?
                .checked_add(self.segment_len),
        }
    }

    /// The same scatter as runs of one segment each (the seed's DATA, for
    /// a peer that does not take the uniform form, and for copy engines
    /// without a uniform path).
    pub fn to_runs(&self) -> Vec<ScatterRun> {
        self.dsts
            .iter()
            .enumerate()
            .map(|(i, &addr)| ScatterRun {
                region_offset: (i as u64).wrapping_mul(self.region_stride),
                addr,
                segment_len: self.segment_len,
                region_stride: 0,
                addr_stride: 0,
                count: 1,
            })
            .collect()
    }
}

/// Address of piece `k` of a request whose addresses repeat plane after
/// plane: `(k / n) × plane_stride + offsets[k % n]` (`n = offsets.len()`);
/// `None` for no offsets or on overflow. The one formula of
/// [`BlockScatter`] and `plan::BlockPlanes` (and of the block kernels).
pub fn plane_addr(offsets: &[u64], plane_stride: u64, k: u64) -> Option<u64> {
    let n = offsets.len() as u64;
    if n == 0 {
        return None;
    }
    (k / n)
        .checked_mul(plane_stride)?
        .checked_add(offsets[(k % n) as usize])
}

/// A chunk's scatter named by block, not by piece (issue 18 step 3, the
/// receiver-derived scatter; kvfabric's own, DATA_BLOCKS): the request's
/// destinations repeat with a period — a hand-off of `n` blocks into a
/// layer-major pool writes the same `n` block offsets in every plane
/// (layer × K/V), one plane `plane_stride` bytes after the other
/// (`layout::block_descriptors`, the engine API's pool layout) — so the
/// chunk is described by the `n` addresses of the first plane and the
/// stride, not by one address a piece (a 32 MiB chunk of 4 KiB blocks of a
/// 512-block request: 512 entries, not 8,192).
///
/// Piece `j` (`0 ≤ j < count`) of `segment_len` bytes, at region offset
/// `j × region_stride`, goes to
///
/// ```text
/// k = first + j
/// dst(j) = (k / n) × plane_stride + offsets[k % n]     (n = offsets.len())
/// ```
///
/// (`k` is the piece's index in the whole request: a chunk may start and
/// end inside a plane).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct BlockScatter {
    /// Bytes of every piece (> 0 in a valid scatter).
    pub segment_len: u64,
    /// Region bytes between consecutive pieces (≥ `segment_len` in a
    /// valid scatter).
    pub region_stride: u64,
    /// Index of the chunk's first piece in the request's piece order.
    pub first: u64,
    /// Pieces in the chunk (≥ 1 in a valid scatter).
    pub count: u32,
    /// Bytes between one plane's destinations and the next's.
    pub plane_stride: u64,
    /// Destination address of each block in the first plane (≥ 1 entry in
    /// a valid scatter), in the request's piece order.
    pub offsets: Vec<u64>,
}

impl BlockScatter {
    /// Total bytes moved: `segment_len × count`, saturating (decoded
    /// scatters are untrusted).
    pub fn total_bytes(&self) -> u64 {
        self.segment_len.saturating_mul(u64::from(self.count))
    }

    /// One past the last region byte a piece touches (0 for no pieces), or
    /// `None` on arithmetic overflow.
    pub fn region_end(&self) -> Option<u64> {
        match self.count {
            0 => Some(0),
            n => self
                .region_stride
                .checked_mul(u64::from(n) - 1)?
                .checked_add(self.segment_len),
        }
    }

    /// The plane (`k / n`) of the first and of the last piece, or `None`
    /// for no offsets, no pieces or an index that overflows.
    fn planes(&self) -> Option<(u64, u64)> {
        let n = self.offsets.len() as u64;
        if n == 0 || self.count == 0 {
            return None;
        }
        let last = self.first.checked_add(u64::from(self.count) - 1)?;
        Some((self.first / n, last / n))
    }

    /// `[lowest destination, highest destination + segment_len)`: every
    /// piece lies inside it (the planes' bases grow with `k`, and every
    /// offset is between the lowest and the highest). `None` for an empty
    /// scatter or on arithmetic overflow anywhere in the scatter (then
    /// [`BlockScatter::to_uniform`] is `None` too, or names the piece).
    pub fn dst_bounds(&self) -> Option<(u64, u64)> {
        let (q0, q1) = self.planes()?;
        let (lo, hi) = self
            .offsets
            .iter()
            .fold((u64::MAX, 0u64), |(lo, hi), &a| (lo.min(a), hi.max(a)));
        let start = q0.checked_mul(self.plane_stride)?.checked_add(lo)?;
        let end = q1
            .checked_mul(self.plane_stride)?
            .checked_add(hi)?
            .checked_add(self.segment_len)?;
        Some((start, end))
    }

    /// The destination of piece `j`, or `None` when `j ≥ count` or the
    /// address overflows.
    pub fn dst(&self, j: u32) -> Option<u64> {
        if j >= self.count {
            return None;
        }
        plane_addr(
            &self.offsets,
            self.plane_stride,
            self.first.checked_add(u64::from(j))?,
        )
    }

    /// The same scatter with one destination a piece (DATA_UNIFORM's
    /// form: for a peer that does not take blocks, for copy engines without
    /// a block path, and to name the first piece outside memory). `None`
    /// when a destination overflows (no valid scatter does).
    pub fn to_uniform(&self) -> Option<UniformScatter> {
        let n = self.offsets.len() as u64;
        if n == 0 {
            return (self.count == 0).then(|| UniformScatter {
                segment_len: self.segment_len,
                region_stride: self.region_stride,
                dsts: Vec::new(),
            });
        }
        let mut dsts = Vec::with_capacity(self.count as usize);
        let (mut q, mut i) = (self.first / n, (self.first % n) as usize);
        let mut base = q.checked_mul(self.plane_stride)?;
        for _ in 0..self.count {
            if i == self.offsets.len() {
                // The next plane's base, only when a piece is in it (the
                // plane after the last piece may lie past u64).
                i = 0;
                q += 1;
                base = q.checked_mul(self.plane_stride)?;
            }
            dsts.push(base.checked_add(self.offsets[i])?);
            i += 1;
        }
        Some(UniformScatter {
            segment_len: self.segment_len,
            region_stride: self.region_stride,
            dsts,
        })
    }
}

/// How one chunk's region is scattered: the seed's run list, the uniform
/// form ([`UniformScatter`]) or the block form ([`BlockScatter`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ScatterList {
    /// Scatter runs (seed §4).
    Runs(Vec<ScatterRun>),
    /// Equal-length pieces, one destination each.
    Uniform(UniformScatter),
    /// Equal-length pieces, destinations by block and plane.
    Blocks(BlockScatter),
}

impl Default for ScatterList {
    fn default() -> Self {
        ScatterList::Runs(Vec::new())
    }
}

impl ScatterList {
    /// Total bytes moved (saturating).
    pub fn total_bytes(&self) -> u64 {
        match self {
            ScatterList::Runs(runs) => runs
                .iter()
                .map(ScatterRun::total_bytes)
                .fold(0, u64::saturating_add),
            ScatterList::Uniform(u) => u.total_bytes(),
            ScatterList::Blocks(b) => b.total_bytes(),
        }
    }

    /// Entries: runs, or pieces of the uniform and block forms.
    pub fn len(&self) -> usize {
        match self {
            ScatterList::Runs(runs) => runs.len(),
            ScatterList::Uniform(u) => u.dsts.len(),
            ScatterList::Blocks(b) => b.count as usize,
        }
    }

    /// Whether there is nothing to scatter.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The list as runs (the uniform and block forms one run a piece; a
    /// block form whose destinations overflow — never a valid one — gives
    /// no runs).
    pub fn into_runs(self) -> Vec<ScatterRun> {
        match self {
            ScatterList::Runs(runs) => runs,
            ScatterList::Uniform(u) => u.to_runs(),
            ScatterList::Blocks(b) => b.to_uniform().map(|u| u.to_runs()).unwrap_or_default(),
        }
    }
}

/// Which control channel carries WANT/GRANT/DATA/ACK (seed §5). Peers must
/// use the same kind; the capability handshake enforces it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum ControlKind {
    /// ZMQ over TCP: ROUTER to receive, a DEALER per peer to send (default).
    #[default]
    Zmq,
    /// Control messages ride NIXL notifications on the data fabric.
    NixlNotif,
    /// Length-prefixed frames on a plain TCP socket per peer, written and
    /// read by the IO threads themselves (no library threads in between).
    Tcp,
}

impl ControlKind {
    /// Wire code of this kind (handshake byte).
    pub const fn code(self) -> u8 {
        match self {
            ControlKind::Zmq => 1,
            ControlKind::NixlNotif => 2,
            ControlKind::Tcp => 3,
        }
    }

    /// Inverse of [`ControlKind::code`]; `None` for an unknown code.
    pub const fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(ControlKind::Zmq),
            2 => Some(ControlKind::NixlNotif),
            3 => Some(ControlKind::Tcp),
            _ => None,
        }
    }
}

/// Key of one flow: one independent request stream from one peer (seed §3:
/// key = "peer\x1f rid"; concurrent requests from the same peer are distinct
/// flows). `rid` is monotonic and never reused by a sender incarnation, so a
/// finished flow can be erased at once.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    /// The sending peer's name (its NIXL agent name, incarnation included).
    pub peer: String,
    /// The sender's request id.
    pub rid: u64,
}

impl FlowKey {
    /// Builds the key of request `rid` from `peer`.
    pub fn new(peer: impl Into<String>, rid: u64) -> Self {
        Self {
            peer: peer.into(),
            rid,
        }
    }
}

impl fmt::Display for FlowKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}\u{1f}{}", self.peer, self.rid)
    }
}
