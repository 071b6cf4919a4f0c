//! Control-plane wire codec (seed §4 `BounceMessage`, §5 "Messages" and
//! "Capability handshake"): WANT / GRANT / DATA / ACK and the handshake blob.
//!
//! # Frame layout (all integers little-endian)
//!
//! ```text
//! offset size field
//!      0    4 magic        = b"KVFB"
//!      4    2 version      = WIRE_VERSION
//!      6    1 type         = MessageType code (1 WANT, 2 GRANT, 3 DATA, 4 ACK, 5 HANDSHAKE, 6 NOTICE, 7 REJECT, 8 DATA_UNIFORM, 9 DATA_BLOCKS)
//!      7    1 reserved     = 0
//!      8    4 entry count  (number of fixed-size entries)
//!     12    4 trailer len  (bytes of the variable trailer, e.g. the endpoint)
//!     16    F fixed fields of the type (F below)
//!   16+F  N×E entries      (E = entry size of the type)
//!  ...        trailer
//! ```
//!
//! | type | fixed fields (F bytes) | entry (E bytes) | trailer |
//! |---|---|---|---|
//! | WANT | request_id u64, scope u64 (16) | chunk bytes u64 (8) | sender's control endpoint |
//! | GRANT | request_id u64 (8) | chunk_index u32, device_id i32, region_handle u64, addr u64, len u64 (32) | none |
//! | DATA | request_id u64, region_handle u64, chunk_index u32, reserved u32 (24) | region_offset u64, addr u64, segment_len u64, region_stride u64, addr_stride u64, count u32, reserved u32 (48) | none |
//! | ACK | request_id u64, region_handle u64, chunk_index u32, reserved u32 (24) | none (count 0) | none |
//! | DATA_UNIFORM | request_id u64, region_handle u64, chunk_index u32, reserved u32, segment_len u64, region_stride u64 (40) | destination address u64 (8) | none |
//! | DATA_BLOCKS | request_id u64, region_handle u64, chunk_index u32, count u32, segment_len u64, region_stride u64, first u64, plane_stride u64 (56) | first plane's block destination u64 (8) | none |
//! | HANDSHAKE | wire_version u16, control_kind u8, reserved u8, capabilities u32, arena_usable_capacity_bytes u64, max_chunk_size_bytes u64, config_generation u64 (32) | none (count 0) | endpoint |
//! | NOTICE | topic u64 (8) | none (count 0) | payload (≤ [`MAX_ENDPOINT_LEN`]) |
//! | REJECT | request_id u64, reason u32, reserved u32 (16) | none (count 0) | none |
//!
//! Version 2 (issue 12, engine-scoped flows) added the WANT's `scope` — the
//! receiver-local id of the destination engine session the request writes
//! into, 0 for the agent's own pool — and REJECT, the receiver's answer to
//! a WANT it will not serve (or to a flow whose destination engine
//! detached), so the sender fails the request at once instead of waiting
//! for its timeout. Neither is in the seed.
//!
//! DATA_UNIFORM and the handshake's `capabilities` word (issue 18 step 3)
//! are kvfabric's own: a chunk of whole equal-length descriptors is
//! scattered from a list of destinations ([`UniformScatter`]: piece `i` at
//! region offset `i × region_stride`), which the sender does not plan and
//! which is 8 bytes a piece on the wire. A sender uses it only towards a
//! peer whose handshake advertises [`CAP_UNIFORM_DATA`]. The word was a
//! reserved zero before: an agent built before it refuses a handshake with
//! capability bits (strict decoding), so such a pair does not engage
//! bounce until both run a build that knows the word (or the new one is
//! configured with `uniformData: false`).
//!
//! DATA_BLOCKS (issue 18 step 3, [`CAP_BLOCK_DATA`]) is kvfabric's own too:
//! the same pieces named by block — the destinations of the request's
//! first plane and the stride between planes ([`BlockScatter`]) — for a
//! request whose destinations repeat plane after plane (a block hand-off
//! into a layer-major pool): 8 bytes a block, not a piece.
//!
//! NOTICE is kvfabric's own (not in the seed): an opaque, bounded payload
//! the service layer sends between agents on the control channel, e.g. "the
//! blocks of request R landed in engine E" ([`NOTICE_TOPIC_ARRIVAL`]), so a
//! decode engine learns its KV arrived. The protocol machine never reads
//! the payload.
//!
//! # Decoding is strict
//!
//! A frame decodes only if its length is **exactly** `16 + F + N×E + trailer`
//! (no truncation, no trailing bytes), magic / version / type are known, every
//! reserved field is zero, counts and trailer are within the caps below, and
//! the type matches the typed decoder used (a GRANT given to
//! [`decode_want`] is [`WireError::UnexpectedType`]). The expected length is
//! computed in `u64` from the header and compared with the real buffer length
//! **before** anything is allocated, so allocation is bounded by the input
//! size. Strictness makes the encoding canonical: for every accepted `buf`,
//! `decode(buf)?.encode() == buf`.
//!
//! Caps ([`MAX_ENTRIES`], [`MAX_ENDPOINT_LEN`]) bound what a peer can make us
//! allocate even with a huge, well-formed frame.
//!
//! All decoders return an error value on any malformed input; none panics,
//! and the module contains no `unsafe`.

use crate::types::{BlockScatter, ControlKind, ScatterRun, UniformScatter};
use std::fmt;
use thiserror::Error;

/// Frame magic, the first four bytes of every message.
pub const MAGIC: [u8; 4] = *b"KVFB";

/// Wire format version carried in every header (and advertised in the
/// handshake's `wire_version`). Frames of another version are rejected.
pub const WIRE_VERSION: u16 = 2;

/// Size of the common header in bytes.
pub const HEADER_LEN: usize = 16;

/// Largest entry count any message may carry (1,048,576). Covers an unmerged
/// DATA of any chunk (a chunk holds at most this many pieces,
/// [`crate::plan::MAX_CHUNK_PIECES`]; a 32 MiB chunk of 32-byte pieces, the
/// seed's §10 default, is exactly this many), a WANT of a million chunks,
/// or a GRANT of a million credits; larger counts are
/// [`WireError::TooManyEntries`].
pub const MAX_ENTRIES: u32 = 1 << 20;

/// Largest endpoint (WANT / handshake trailer) in bytes: 64 KiB. A ZMQ
/// endpoint is tens of bytes; serialized NIXL metadata (seed §5, NIXL
/// notification control channel) is a few KiB.
pub const MAX_ENDPOINT_LEN: u32 = 64 * 1024;

/// Entry size of a WANT (one `u64` chunk size), bytes.
pub const WANT_ENTRY_LEN: usize = 8;
/// Entry size of a GRANT credit, bytes.
pub const GRANT_ENTRY_LEN: usize = 32;
/// Entry size of a DATA scatter run, bytes.
pub const DATA_ENTRY_LEN: usize = 48;
/// Entry size of a DATA_UNIFORM destination, bytes.
pub const DATA_UNIFORM_ENTRY_LEN: usize = 8;

/// Handshake capability bit: the agent decodes and scatters DATA_UNIFORM
/// ([`DataUniform`]). kvfabric's own (issue 18 step 3).
pub const CAP_UNIFORM_DATA: u32 = 1;

/// Handshake capability bit: the agent decodes and scatters DATA_BLOCKS
/// ([`DataBlocks`]). kvfabric's own (issue 18 step 3).
pub const CAP_BLOCK_DATA: u32 = 2;

/// Handshake capability bit: the agent signs its TCP control hellos with
/// the fabric's control key (`controlAuth` optional or required; stop 42).
/// Not a data feature: it tells a peer that requires signed hellos that
/// this one's connections would be refused otherwise.
pub const CAP_CONTROL_SIGNED: u32 = 4;

/// Handshake capability bit: the agent accepts only signed control hellos
/// (`controlAuth: required`): a peer that does not sign cannot reach it.
pub const CAP_CONTROL_REQUIRED: u32 = 8;

/// Entry size of a DATA_BLOCKS block destination, bytes.
pub const DATA_BLOCKS_ENTRY_LEN: usize = 8;

/// Message type, the header's `type` byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MessageType {
    /// Sender → receiver: per-chunk byte sizes (empty = cancel) + endpoint.
    Want,
    /// Receiver → sender: credits.
    Grant,
    /// Sender → receiver: region handle + scatter runs, after poll==SUCCESS.
    Data,
    /// Receiver → sender: scatter done, region recyclable.
    Ack,
    /// Capability handshake blob carried in the agent metadata.
    Handshake,
    /// Service-layer notice between agents (kvfabric's own).
    Notice,
    /// Receiver → sender: the request is refused / its flow was dropped
    /// (kvfabric's own, wire version 2).
    Reject,
    /// Sender → receiver: like DATA, the scatter as equal-length pieces
    /// and their destinations (kvfabric's own, [`CAP_UNIFORM_DATA`]).
    DataUniform,
    /// Sender → receiver: like DATA_UNIFORM, the destinations by block
    /// and plane (kvfabric's own, [`CAP_BLOCK_DATA`]).
    DataBlocks,
}

impl MessageType {
    /// The header byte of this type.
    pub const fn code(self) -> u8 {
        match self {
            MessageType::Want => 1,
            MessageType::Grant => 2,
            MessageType::Data => 3,
            MessageType::Ack => 4,
            MessageType::Handshake => 5,
            MessageType::Notice => 6,
            MessageType::Reject => 7,
            MessageType::DataUniform => 8,
            MessageType::DataBlocks => 9,
        }
    }

    /// Inverse of [`MessageType::code`]; `None` for an unknown byte.
    pub const fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(MessageType::Want),
            2 => Some(MessageType::Grant),
            3 => Some(MessageType::Data),
            4 => Some(MessageType::Ack),
            5 => Some(MessageType::Handshake),
            6 => Some(MessageType::Notice),
            7 => Some(MessageType::Reject),
            8 => Some(MessageType::DataUniform),
            9 => Some(MessageType::DataBlocks),
            _ => None,
        }
    }

    /// Size in bytes of the type's fixed fields (after the header).
    pub const fn fixed_len(self) -> usize {
        match self {
            MessageType::Grant | MessageType::Notice => 8,
            MessageType::Want | MessageType::Reject => 16,
            MessageType::Data | MessageType::Ack => 24,
            MessageType::Handshake => 32,
            MessageType::DataUniform => 40,
            MessageType::DataBlocks => 56,
        }
    }

    /// Size in bytes of one entry (0: the type carries no entries).
    pub const fn entry_len(self) -> usize {
        match self {
            MessageType::Want => WANT_ENTRY_LEN,
            MessageType::Grant => GRANT_ENTRY_LEN,
            MessageType::Data => DATA_ENTRY_LEN,
            MessageType::DataUniform => DATA_UNIFORM_ENTRY_LEN,
            MessageType::DataBlocks => DATA_BLOCKS_ENTRY_LEN,
            MessageType::Ack
            | MessageType::Handshake
            | MessageType::Notice
            | MessageType::Reject => 0,
        }
    }

    /// Whether the type carries a trailer (the endpoint, or a notice's
    /// payload).
    pub const fn has_trailer(self) -> bool {
        matches!(
            self,
            MessageType::Want | MessageType::Handshake | MessageType::Notice
        )
    }
}

impl fmt::Display for MessageType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MessageType::Want => "WANT",
            MessageType::Grant => "GRANT",
            MessageType::Data => "DATA",
            MessageType::Ack => "ACK",
            MessageType::Handshake => "HANDSHAKE",
            MessageType::Notice => "NOTICE",
            MessageType::Reject => "REJECT",
            MessageType::DataUniform => "DATA_UNIFORM",
            MessageType::DataBlocks => "DATA_BLOCKS",
        })
    }
}

/// Why a frame was rejected (or, for [`Message::check_limits`], cannot be
/// encoded decodably).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum WireError {
    /// The buffer is shorter than the header, or than the length the header
    /// announces.
    #[error("truncated frame: need {needed} bytes, have {available}")]
    Truncated {
        /// Bytes the frame needs (header, or header-announced total).
        needed: u64,
        /// Bytes actually present.
        available: usize,
    },
    /// The buffer is longer than the length the header announces.
    #[error("{extra} trailing bytes after a {expected}-byte frame")]
    TrailingBytes {
        /// Bytes the frame should have.
        expected: u64,
        /// Bytes beyond that.
        extra: u64,
    },
    /// The first four bytes are not [`MAGIC`].
    #[error("bad magic {found:02x?}")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// The header version is not [`WIRE_VERSION`].
    #[error("unsupported wire version {found} (expected {expected})")]
    UnsupportedVersion {
        /// Version in the frame.
        found: u16,
        /// Version this build speaks.
        expected: u16,
    },
    /// The header type byte is not a known [`MessageType`].
    #[error("unknown message type {code}")]
    UnknownType {
        /// The type byte.
        code: u8,
    },
    /// A typed decoder got a frame of another type (cross-type confusion).
    #[error("expected a {expected} frame, got {found}")]
    UnexpectedType {
        /// Type the decoder handles.
        expected: MessageType,
        /// Type in the frame.
        found: MessageType,
    },
    /// A reserved field is not zero.
    #[error("reserved field `{field}` is {value}, must be 0")]
    NonZeroReserved {
        /// Which reserved field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// The entry count exceeds the cap ([`MAX_ENTRIES`]) or the type takes no
    /// entries at all.
    #[error("{ty} frame with {count} entries (max {max})")]
    TooManyEntries {
        /// Message type.
        ty: MessageType,
        /// Count in the header.
        count: u64,
        /// The allowed maximum for this type.
        max: u32,
    },
    /// The trailer exceeds the cap ([`MAX_ENDPOINT_LEN`]) or the type takes no
    /// trailer at all.
    #[error("{ty} frame with a {len}-byte trailer (max {max})")]
    TrailerTooLong {
        /// Message type.
        ty: MessageType,
        /// Trailer length.
        len: u64,
        /// The allowed maximum for this type.
        max: u32,
    },
    /// A DATA run is structurally invalid (zero segment length or count).
    #[error("DATA run #{index} is invalid: {reason}")]
    InvalidRun {
        /// Index of the run in the frame.
        index: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The handshake's control-kind byte is unknown.
    #[error("unknown control kind code {code}")]
    UnknownControlKind {
        /// The byte found.
        code: u8,
    },
    /// A REJECT's reason code is unknown.
    #[error("unknown reject reason code {code}")]
    UnknownRejectReason {
        /// The code found.
        code: u32,
    },
}

/// WANT (sender → receiver, seed §5): the per-chunk packed byte sizes of
/// request `request_id` (empty = cancel, see [`encode_cancel`]) and the
/// sender's own control endpoint, which the receiver registers to bootstrap
/// the reverse path.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Want {
    /// The sender's request id (monotonic per sender incarnation).
    pub request_id: u64,
    /// The destination scope: the receiver-local id of the engine session
    /// whose pool the request writes into (published in the receiver's
    /// engine record), or 0 for the receiver agent's own pool. The receiver
    /// serves the flow only while that session is attached and scatters
    /// only into that session's pool (issue 12, "engine-scoped flows").
    /// Cancels carry 0.
    pub scope: u64,
    /// Packed bytes of each chunk, in chunk order
    /// ([`crate::plan::TransferPlan::chunk_bytes`]); empty = cancel.
    pub chunk_bytes: Vec<u64>,
    /// The sender's control endpoint: a `tcp://ip:port` string (ZMQ) or
    /// serialized NIXL metadata; at most [`MAX_ENDPOINT_LEN`] bytes.
    pub endpoint: Vec<u8>,
}

impl Want {
    /// Whether this WANT is a cancel (no chunks).
    pub fn is_cancel(&self) -> bool {
        self.chunk_bytes.is_empty()
    }

    /// The endpoint as UTF-8 (ZMQ endpoints are text), if it is valid UTF-8.
    pub fn endpoint_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.endpoint).ok()
    }
}

/// One credit of a GRANT (seed §3 "credit"): exclusive permission for the
/// sender to write chunk `chunk_index` into the receiver's region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Credit {
    /// Which chunk of the request this credit is for.
    pub chunk_index: u32,
    /// Region handle = byte offset of the region inside the receiver arena.
    pub region_handle: u64,
    /// Remote address of the region (arena base + handle).
    pub addr: u64,
    /// Region length in bytes.
    pub len: u64,
    /// The receiver's device id (for the RDMA descriptor).
    pub device_id: i32,
}

/// GRANT (receiver → sender, seed §5): one or more credits for request
/// `request_id` (one GRANT may batch several, seed §6).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Grant {
    /// The sender's request id this grant answers.
    pub request_id: u64,
    /// The credits, in grant order.
    pub credits: Vec<Credit>,
}

/// DATA (sender → receiver, seed §5): chunk `chunk_index` of `request_id`
/// has landed in region `region_handle`; scatter it with `runs`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Data {
    /// The sender's request id.
    pub request_id: u64,
    /// Chunk index within the request.
    pub chunk_index: u32,
    /// The granted region the chunk was written to.
    pub region_handle: u64,
    /// Scatter runs (region offset → destination); each has
    /// `segment_len > 0` and `count >= 1`. Bounds against the region are the
    /// receiver's job (seed §9 "scatter input validation").
    pub runs: Vec<ScatterRun>,
}

/// DATA_UNIFORM (sender → receiver, kvfabric's own, issue 18 step 3): as
/// [`Data`], with the scatter as equal-length pieces
/// ([`UniformScatter`]). Sent only to a peer advertising
/// [`CAP_UNIFORM_DATA`].
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct DataUniform {
    /// The sender's request id.
    pub request_id: u64,
    /// Chunk index within the request.
    pub chunk_index: u32,
    /// The granted region the chunk was written to.
    pub region_handle: u64,
    /// The pieces: `segment_len > 0`, `region_stride >= segment_len`, at
    /// least one destination. Bounds against the region and the
    /// destination's memory are the receiver's job, as for runs.
    pub scatter: UniformScatter,
}

/// DATA_BLOCKS (sender → receiver, kvfabric's own, issue 18 step 3): as
/// [`DataUniform`], the destinations by block and plane
/// ([`BlockScatter`]). Sent only to a peer advertising [`CAP_BLOCK_DATA`].
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct DataBlocks {
    /// The sender's request id.
    pub request_id: u64,
    /// Chunk index within the request.
    pub chunk_index: u32,
    /// The granted region the chunk was written to.
    pub region_handle: u64,
    /// The pieces: `segment_len > 0`, `region_stride >= segment_len`, at
    /// least one piece and one block. Bounds against the region and the
    /// destination's memory are the receiver's job, as for runs.
    pub scatter: BlockScatter,
}

/// ACK (receiver → sender, seed §5): chunk scattered, region recyclable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Ack {
    /// The sender's request id.
    pub request_id: u64,
    /// Chunk index within the request.
    pub chunk_index: u32,
    /// The region that was scattered.
    pub region_handle: u64,
}

/// The capability handshake blob each agent advertises in its metadata
/// (seed §5 "Capability handshake"). Peers engage bounce only when the
/// version, control kind and max chunk size match (checked by the caller).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handshake {
    /// Protocol version the agent speaks (normally [`WIRE_VERSION`]).
    pub wire_version: u16,
    /// Control channel kind; must match the peer's.
    pub control_kind: ControlKind,
    /// Usable arena capacity in bytes.
    pub arena_usable_capacity_bytes: u64,
    /// Per-chunk byte cap; must match the peer's.
    pub max_chunk_size_bytes: u64,
    /// The agent's control endpoint (ZMQ `tcp://…` or serialized NIXL
    /// metadata), at most [`MAX_ENDPOINT_LEN`] bytes.
    pub endpoint: Vec<u8>,
    /// Generation of the config that produced this blob (bumped on reload).
    pub config_generation: u64,
    /// Capability bits ([`CAP_UNIFORM_DATA`]; kvfabric's own, issue 18).
    /// A feature is used between two agents only when both advertise it;
    /// unknown bits are ignored.
    pub capabilities: u32,
}

/// Why a receiver refused a request ([`Reject`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The WANT named a destination scope (engine session) that is not
    /// attached to the receiver: detached, never attached, or the receiver
    /// restarted.
    UnknownScope,
    /// The destination engine detached while the flow was in progress: no
    /// more of its DATA is scattered (the sender's cancel frees the
    /// regions).
    ScopeDetached,
    /// The WANT itself was refused (its chunk sizes cannot be served by
    /// this receiver's arena).
    Refused,
    /// A DATA of the request named scatter destinations outside the
    /// destination engine's pool (or the agent's registered memory): none
    /// of it was scattered.
    InvalidRuns,
}

impl RejectReason {
    /// The wire code.
    pub const fn code(self) -> u32 {
        match self {
            RejectReason::UnknownScope => 1,
            RejectReason::ScopeDetached => 2,
            RejectReason::Refused => 3,
            RejectReason::InvalidRuns => 4,
        }
    }

    /// Inverse of [`RejectReason::code`]; `None` for an unknown code.
    pub const fn from_code(code: u32) -> Option<Self> {
        match code {
            1 => Some(RejectReason::UnknownScope),
            2 => Some(RejectReason::ScopeDetached),
            3 => Some(RejectReason::Refused),
            4 => Some(RejectReason::InvalidRuns),
            _ => None,
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RejectReason::UnknownScope => "the destination engine is not attached to the receiver",
            RejectReason::ScopeDetached => "the destination engine detached from the receiver",
            RejectReason::Refused => "the receiver refused the request",
            RejectReason::InvalidRuns => {
                "a DATA named scatter destinations outside the destination's memory; nothing of it was scattered"
            }
        })
    }
}

/// REJECT (receiver → sender, kvfabric's own, wire version 2): request
/// `request_id` will not be served; the sender fails it with `reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Reject {
    /// The sender's request id.
    pub request_id: u64,
    /// Why.
    pub reason: RejectReason,
}

/// Topic of an arrival notice: the payload says which engine's request
/// landed (the service layer's JSON; see `service::engines`).
pub const NOTICE_TOPIC_ARRIVAL: u64 = 1;

/// NOTICE: an opaque service-layer payload between agents (kvfabric's own,
/// not in the seed). At most [`MAX_ENDPOINT_LEN`] bytes of payload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Notice {
    /// What the payload is ([`NOTICE_TOPIC_ARRIVAL`], ...); receivers drop
    /// topics they do not know.
    pub topic: u64,
    /// The payload bytes.
    pub payload: Vec<u8>,
}

/// Any control-plane message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// See [`Want`].
    Want(Want),
    /// See [`Grant`].
    Grant(Grant),
    /// See [`Data`].
    Data(Data),
    /// See [`Ack`].
    Ack(Ack),
    /// See [`Handshake`].
    Handshake(Handshake),
    /// See [`Notice`].
    Notice(Notice),
    /// See [`Reject`].
    Reject(Reject),
    /// See [`DataUniform`].
    DataUniform(DataUniform),
    /// See [`DataBlocks`].
    DataBlocks(DataBlocks),
}

// ---------------------------------------------------------------- encoding

/// One DATA entry: the run's fields little-endian, then 4 reserved zero
/// bytes (layout in the module docs). Built whole so the encoder does one
/// bounds check per run, not six.
fn run_entry(r: &ScatterRun) -> [u8; DATA_ENTRY_LEN] {
    let mut e = [0u8; DATA_ENTRY_LEN];
    e[0..8].copy_from_slice(&r.region_offset.to_le_bytes());
    e[8..16].copy_from_slice(&r.addr.to_le_bytes());
    e[16..24].copy_from_slice(&r.segment_len.to_le_bytes());
    e[24..32].copy_from_slice(&r.region_stride.to_le_bytes());
    e[32..40].copy_from_slice(&r.addr_stride.to_le_bytes());
    e[40..44].copy_from_slice(&r.count.to_le_bytes());
    e
}

/// Inverse of [`run_entry`]; also returns the reserved word.
fn parse_run_entry(e: &[u8; DATA_ENTRY_LEN]) -> (ScatterRun, u32) {
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&e[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let u32_at = |i: usize| {
        let mut b = [0u8; 4];
        b.copy_from_slice(&e[i..i + 4]);
        u32::from_le_bytes(b)
    };
    let run = ScatterRun {
        region_offset: u64_at(0),
        addr: u64_at(8),
        segment_len: u64_at(16),
        region_stride: u64_at(24),
        addr_stride: u64_at(32),
        count: u32_at(40),
    };
    (run, u32_at(44))
}

fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Saturating `usize → u32` for header fields; a saturated value never
/// matches the real length, so such a frame fails to decode instead of
/// decoding as something else.
fn sat_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn put_header(out: &mut Vec<u8>, ty: MessageType, count: usize, trailer: usize) {
    out.extend_from_slice(&MAGIC);
    put_u16(out, WIRE_VERSION);
    out.push(ty.code());
    out.push(0);
    put_u32(out, sat_u32(count));
    put_u32(out, sat_u32(trailer));
}

impl Message {
    /// The type of this message.
    pub fn message_type(&self) -> MessageType {
        match self {
            Message::Want(_) => MessageType::Want,
            Message::Grant(_) => MessageType::Grant,
            Message::Data(_) => MessageType::Data,
            Message::Ack(_) => MessageType::Ack,
            Message::Handshake(_) => MessageType::Handshake,
            Message::Notice(_) => MessageType::Notice,
            Message::Reject(_) => MessageType::Reject,
            Message::DataUniform(_) => MessageType::DataUniform,
            Message::DataBlocks(_) => MessageType::DataBlocks,
        }
    }

    fn counts(&self) -> (usize, usize) {
        match self {
            Message::Want(w) => (w.chunk_bytes.len(), w.endpoint.len()),
            Message::Grant(g) => (g.credits.len(), 0),
            Message::Data(d) => (d.runs.len(), 0),
            Message::DataUniform(d) => (d.scatter.dsts.len(), 0),
            Message::DataBlocks(d) => (d.scatter.offsets.len(), 0),
            Message::Ack(_) | Message::Reject(_) => (0, 0),
            Message::Handshake(h) => (0, h.endpoint.len()),
            Message::Notice(n) => (0, n.payload.len()),
        }
    }

    /// Exact encoded size in bytes.
    pub fn encoded_len(&self) -> usize {
        let ty = self.message_type();
        let (n, t) = self.counts();
        HEADER_LEN + ty.fixed_len() + n * ty.entry_len() + t
    }

    /// Checks that the message is within the decoder's caps
    /// ([`MAX_ENTRIES`], [`MAX_ENDPOINT_LEN`]) and structurally valid (DATA
    /// runs have `segment_len > 0`, `count >= 1`), i.e. that its encoding
    /// will decode.
    ///
    /// # Errors
    ///
    /// [`WireError::TooManyEntries`], [`WireError::TrailerTooLong`] or
    /// [`WireError::InvalidRun`], as the decoder would report them.
    pub fn check_limits(&self) -> Result<(), WireError> {
        let ty = self.message_type();
        let (n, t) = self.counts();
        if n > MAX_ENTRIES as usize {
            return Err(WireError::TooManyEntries {
                ty,
                count: n as u64,
                max: MAX_ENTRIES,
            });
        }
        if t > MAX_ENDPOINT_LEN as usize {
            return Err(WireError::TrailerTooLong {
                ty,
                len: t as u64,
                max: MAX_ENDPOINT_LEN,
            });
        }
        if let Message::Data(d) = self {
            for (index, r) in d.runs.iter().enumerate() {
                check_run(index, r)?;
            }
        }
        if let Message::DataUniform(d) = self {
            check_uniform(&d.scatter)?;
        }
        if let Message::DataBlocks(d) = self {
            check_blocks(&d.scatter)?;
        }
        Ok(())
    }

    /// Encodes the message into a fresh buffer of exactly
    /// [`Message::encoded_len`] bytes. Infallible; if the message violates
    /// [`Message::check_limits`] the bytes are produced anyway and will be
    /// rejected by the decoder (never mis-decoded). Use
    /// [`Message::try_encode`] to check first.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut out);
        out
    }

    /// Like [`Message::encode`] but first runs [`Message::check_limits`].
    ///
    /// # Errors
    ///
    /// Whatever [`Message::check_limits`] reports.
    pub fn try_encode(&self) -> Result<Vec<u8>, WireError> {
        self.check_limits()?;
        Ok(self.encode())
    }

    /// Appends the encoding to `out` (reusing its allocation). Same contract
    /// as [`Message::encode`].
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.reserve(self.encoded_len());
        let ty = self.message_type();
        let (n, t) = self.counts();
        put_header(out, ty, n, t);
        match self {
            Message::Want(w) => {
                put_u64(out, w.request_id);
                put_u64(out, w.scope);
                for &b in &w.chunk_bytes {
                    put_u64(out, b);
                }
                out.extend_from_slice(&w.endpoint);
            }
            Message::Grant(g) => {
                put_u64(out, g.request_id);
                for c in &g.credits {
                    put_u32(out, c.chunk_index);
                    out.extend_from_slice(&c.device_id.to_le_bytes());
                    put_u64(out, c.region_handle);
                    put_u64(out, c.addr);
                    put_u64(out, c.len);
                }
            }
            Message::Data(d) => {
                put_u64(out, d.request_id);
                put_u64(out, d.region_handle);
                put_u32(out, d.chunk_index);
                put_u32(out, 0);
                for r in &d.runs {
                    out.extend_from_slice(&run_entry(r));
                }
            }
            Message::Ack(a) => {
                put_u64(out, a.request_id);
                put_u64(out, a.region_handle);
                put_u32(out, a.chunk_index);
                put_u32(out, 0);
            }
            Message::Handshake(h) => put_handshake_body(out, h),
            Message::Notice(n) => {
                put_u64(out, n.topic);
                out.extend_from_slice(&n.payload);
            }
            Message::Reject(r) => {
                put_u64(out, r.request_id);
                put_u32(out, r.reason.code());
                put_u32(out, 0);
            }
            Message::DataUniform(d) => {
                put_u64(out, d.request_id);
                put_u64(out, d.region_handle);
                put_u32(out, d.chunk_index);
                put_u32(out, 0);
                put_u64(out, d.scatter.segment_len);
                put_u64(out, d.scatter.region_stride);
                for &a in &d.scatter.dsts {
                    put_u64(out, a);
                }
            }
            Message::DataBlocks(d) => {
                put_u64(out, d.request_id);
                put_u64(out, d.region_handle);
                put_u32(out, d.chunk_index);
                put_u32(out, d.scatter.count);
                put_u64(out, d.scatter.segment_len);
                put_u64(out, d.scatter.region_stride);
                put_u64(out, d.scatter.first);
                put_u64(out, d.scatter.plane_stride);
                for &a in &d.scatter.offsets {
                    put_u64(out, a);
                }
            }
        }
    }

    /// Decodes any message (strict; see the module docs).
    ///
    /// # Errors
    ///
    /// Any [`WireError`] except [`WireError::UnexpectedType`].
    pub fn decode(buf: &[u8]) -> Result<Message, WireError> {
        let frame = Frame::parse(buf, None)?;
        match frame.ty {
            MessageType::Want => frame.want().map(Message::Want),
            MessageType::Grant => frame.grant().map(Message::Grant),
            MessageType::Data => frame.data().map(Message::Data),
            MessageType::Ack => frame.ack().map(Message::Ack),
            MessageType::Handshake => frame.handshake().map(Message::Handshake),
            MessageType::Notice => frame.notice().map(Message::Notice),
            MessageType::Reject => frame.reject().map(Message::Reject),
            MessageType::DataUniform => frame.data_uniform().map(Message::DataUniform),
            MessageType::DataBlocks => frame.data_blocks().map(Message::DataBlocks),
        }
    }
}

impl From<Want> for Message {
    fn from(m: Want) -> Self {
        Message::Want(m)
    }
}
impl From<Grant> for Message {
    fn from(m: Grant) -> Self {
        Message::Grant(m)
    }
}
impl From<Data> for Message {
    fn from(m: Data) -> Self {
        Message::Data(m)
    }
}
impl From<DataBlocks> for Message {
    fn from(m: DataBlocks) -> Self {
        Message::DataBlocks(m)
    }
}

impl From<DataUniform> for Message {
    fn from(m: DataUniform) -> Self {
        Message::DataUniform(m)
    }
}
impl From<Ack> for Message {
    fn from(m: Ack) -> Self {
        Message::Ack(m)
    }
}
impl From<Handshake> for Message {
    fn from(m: Handshake) -> Self {
        Message::Handshake(m)
    }
}
impl From<Reject> for Message {
    fn from(m: Reject) -> Self {
        Message::Reject(m)
    }
}

impl From<Notice> for Message {
    fn from(m: Notice) -> Self {
        Message::Notice(m)
    }
}

fn check_run(index: usize, r: &ScatterRun) -> Result<(), WireError> {
    if r.segment_len == 0 {
        return Err(WireError::InvalidRun {
            index,
            reason: "segment_len is 0",
        });
    }
    if r.count == 0 {
        return Err(WireError::InvalidRun {
            index,
            reason: "count is 0",
        });
    }
    Ok(())
}

/// Structural checks of a uniform scatter (as [`check_run`] for runs):
/// at least one piece, `segment_len > 0`, `region_stride >= segment_len`.
fn check_uniform(u: &UniformScatter) -> Result<(), WireError> {
    let reason = if u.dsts.is_empty() {
        "no destinations"
    } else if u.segment_len == 0 {
        "segment_len is 0"
    } else if u.region_stride < u.segment_len {
        "region_stride is below segment_len"
    } else {
        return Ok(());
    };
    Err(WireError::InvalidRun { index: 0, reason })
}

/// A DATA_BLOCKS' structure: pieces and blocks present, at most
/// [`MAX_ENTRIES`] pieces (a sender's chunk has at most
/// `plan::MAX_CHUNK_PIECES`; the bound a DATA_UNIFORM of the same chunk
/// has by its size, so an 80-byte message cannot make a receiver list
/// 64 M pieces), `segment_len > 0`, `region_stride >= segment_len`, and
/// the last piece's index (`first + count - 1`) representable.
fn check_blocks(b: &BlockScatter) -> Result<(), WireError> {
    let reason = if b.offsets.is_empty() {
        "no block destinations"
    } else if b.count == 0 {
        "no pieces"
    } else if b.count > MAX_ENTRIES {
        "more pieces than MAX_ENTRIES"
    } else if b.segment_len == 0 {
        "segment_len is 0"
    } else if b.region_stride < b.segment_len {
        "region_stride is below segment_len"
    } else if b.first.checked_add(u64::from(b.count)).is_none() {
        "first + count overflows"
    } else {
        return Ok(());
    };
    Err(WireError::InvalidRun { index: 0, reason })
}

/// Encodes a cancel: a WANT with no chunks for `request_id`, still carrying
/// the sender's `endpoint` (seed §5: "Cancel/abort uses an empty WANT (still
/// carrying the endpoint)").
pub fn encode_cancel(request_id: u64, endpoint: &[u8]) -> Vec<u8> {
    Message::Want(Want {
        request_id,
        scope: 0,
        chunk_bytes: Vec::new(),
        endpoint: endpoint.to_vec(),
    })
    .encode()
}

/// Whether `buf` is a well-formed cancel (a valid WANT with zero chunks).
/// Looks only at the header and validates the frame without allocating.
pub fn is_cancel_want(buf: &[u8]) -> bool {
    matches!(Frame::parse(buf, Some(MessageType::Want)), Ok(f) if f.count == 0)
}

/// Reads the type of a frame after validating its header and length (for
/// routing without a full decode).
///
/// # Errors
///
/// Header / length errors as in [`Message::decode`].
pub fn peek_type(buf: &[u8]) -> Result<MessageType, WireError> {
    Frame::parse(buf, None).map(|f| f.ty)
}

/// Decodes a WANT, rejecting any other type.
///
/// # Errors
///
/// Any [`WireError`]; [`WireError::UnexpectedType`] for another type.
pub fn decode_want(buf: &[u8]) -> Result<Want, WireError> {
    Frame::parse(buf, Some(MessageType::Want))?.want()
}

/// Decodes a GRANT, rejecting any other type.
///
/// # Errors
///
/// Any [`WireError`]; [`WireError::UnexpectedType`] for another type.
pub fn decode_grant(buf: &[u8]) -> Result<Grant, WireError> {
    Frame::parse(buf, Some(MessageType::Grant))?.grant()
}

/// Decodes a DATA, rejecting any other type.
///
/// # Errors
///
/// Any [`WireError`]; [`WireError::UnexpectedType`] for another type,
/// [`WireError::InvalidRun`] for a zero-length or zero-count run.
pub fn decode_data(buf: &[u8]) -> Result<Data, WireError> {
    Frame::parse(buf, Some(MessageType::Data))?.data()
}

/// Decodes an ACK, rejecting any other type.
///
/// # Errors
///
/// Any [`WireError`]; [`WireError::UnexpectedType`] for another type.
pub fn decode_ack(buf: &[u8]) -> Result<Ack, WireError> {
    Frame::parse(buf, Some(MessageType::Ack))?.ack()
}

fn put_handshake_body(out: &mut Vec<u8>, h: &Handshake) {
    put_u16(out, h.wire_version);
    out.push(h.control_kind.code());
    out.push(0);
    put_u32(out, h.capabilities);
    put_u64(out, h.arena_usable_capacity_bytes);
    put_u64(out, h.max_chunk_size_bytes);
    put_u64(out, h.config_generation);
    out.extend_from_slice(&h.endpoint);
}

/// Encodes a handshake blob: the same bytes as
/// `Message::Handshake(h.clone()).encode()`, without the clone.
pub fn encode_handshake(h: &Handshake) -> Vec<u8> {
    let ty = MessageType::Handshake;
    let mut out = Vec::with_capacity(HEADER_LEN + ty.fixed_len() + h.endpoint.len());
    put_header(&mut out, ty, 0, h.endpoint.len());
    put_handshake_body(&mut out, h);
    out
}

/// Decodes a handshake blob, rejecting any other type.
///
/// # Errors
///
/// Any [`WireError`]; [`WireError::UnexpectedType`] for another type,
/// [`WireError::UnknownControlKind`] for an unknown control kind.
pub fn decode_handshake(buf: &[u8]) -> Result<Handshake, WireError> {
    Frame::parse(buf, Some(MessageType::Handshake))?.handshake()
}

// ---------------------------------------------------------------- decoding

/// Little-endian cursor. Every read is bounds-checked and returns an error
/// rather than panicking (the frame length is validated up front, so these
/// errors are unreachable in practice, but the reader never trusts that).
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let end = self.pos.checked_add(N);
        let bytes = end
            .and_then(|e| self.buf.get(self.pos..e))
            .ok_or(WireError::Truncated {
                needed: (self.pos as u64).saturating_add(N as u64),
                available: self.buf.len(),
            })?;
        let mut a = [0u8; N];
        a.copy_from_slice(bytes);
        self.pos += N;
        Ok(a)
    }
    fn take_slice(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let bytes = self
            .pos
            .checked_add(n)
            .and_then(|e| self.buf.get(self.pos..e))
            .ok_or(WireError::Truncated {
                needed: (self.pos as u64).saturating_add(n as u64),
                available: self.buf.len(),
            })?;
        self.pos += n;
        Ok(bytes)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        self.take().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        self.take().map(u32::from_le_bytes)
    }
    fn i32(&mut self) -> Result<i32, WireError> {
        self.take().map(i32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        self.take().map(u64::from_le_bytes)
    }
    fn rest(&self) -> &'a [u8] {
        self.buf.get(self.pos..).unwrap_or(&[])
    }
}

fn reserved_zero(field: &'static str, value: u64) -> Result<(), WireError> {
    if value == 0 {
        Ok(())
    } else {
        Err(WireError::NonZeroReserved { field, value })
    }
}

/// A frame whose header and total length have been validated.
struct Frame<'a> {
    ty: MessageType,
    /// Entry count (≤ cap, and count × entry size fits in the buffer).
    count: usize,
    /// Reader positioned at the fixed fields.
    body: Reader<'a>,
}

impl<'a> Frame<'a> {
    fn parse(buf: &'a [u8], want: Option<MessageType>) -> Result<Frame<'a>, WireError> {
        let mut r = Reader { buf, pos: 0 };
        if buf.len() < HEADER_LEN {
            // Report bad magic early when enough bytes are there to tell.
            if let Some(m) = buf.get(..4) {
                if m != MAGIC {
                    let mut found = [0u8; 4];
                    found.copy_from_slice(m);
                    return Err(WireError::BadMagic { found });
                }
            }
            return Err(WireError::Truncated {
                needed: HEADER_LEN as u64,
                available: buf.len(),
            });
        }
        let magic = r.take::<4>()?;
        if magic != MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        let version = r.u16()?;
        if version != WIRE_VERSION {
            return Err(WireError::UnsupportedVersion {
                found: version,
                expected: WIRE_VERSION,
            });
        }
        let code = r.u8()?;
        let ty = MessageType::from_code(code).ok_or(WireError::UnknownType { code })?;
        if let Some(expected) = want {
            if expected != ty {
                return Err(WireError::UnexpectedType {
                    expected,
                    found: ty,
                });
            }
        }
        reserved_zero("header.reserved", u64::from(r.u8()?))?;
        let count = r.u32()?;
        let trailer = r.u32()?;

        let max_entries = if ty.entry_len() == 0 { 0 } else { MAX_ENTRIES };
        if count > max_entries {
            return Err(WireError::TooManyEntries {
                ty,
                count: u64::from(count),
                max: max_entries,
            });
        }
        let max_trailer = if ty.has_trailer() {
            MAX_ENDPOINT_LEN
        } else {
            0
        };
        if trailer > max_trailer {
            return Err(WireError::TrailerTooLong {
                ty,
                len: u64::from(trailer),
                max: max_trailer,
            });
        }
        // In u64: cannot overflow (count ≤ 2^20, entry ≤ 48, trailer ≤ 2^32).
        let expected = HEADER_LEN as u64
            + ty.fixed_len() as u64
            + u64::from(count) * ty.entry_len() as u64
            + u64::from(trailer);
        let actual = buf.len() as u64;
        if actual < expected {
            return Err(WireError::Truncated {
                needed: expected,
                available: buf.len(),
            });
        }
        if actual > expected {
            return Err(WireError::TrailingBytes {
                expected,
                extra: actual - expected,
            });
        }
        Ok(Frame {
            ty,
            count: count as usize,
            body: r,
        })
    }

    fn want(mut self) -> Result<Want, WireError> {
        let request_id = self.body.u64()?;
        let scope = self.body.u64()?;
        let mut chunk_bytes = Vec::with_capacity(self.count);
        for _ in 0..self.count {
            chunk_bytes.push(self.body.u64()?);
        }
        Ok(Want {
            request_id,
            scope,
            chunk_bytes,
            endpoint: self.body.rest().to_vec(),
        })
    }

    fn grant(mut self) -> Result<Grant, WireError> {
        let request_id = self.body.u64()?;
        let mut credits = Vec::with_capacity(self.count);
        for _ in 0..self.count {
            let chunk_index = self.body.u32()?;
            let device_id = self.body.i32()?;
            credits.push(Credit {
                chunk_index,
                device_id,
                region_handle: self.body.u64()?,
                addr: self.body.u64()?,
                len: self.body.u64()?,
            });
        }
        Ok(Grant {
            request_id,
            credits,
        })
    }

    fn data(mut self) -> Result<Data, WireError> {
        let request_id = self.body.u64()?;
        let region_handle = self.body.u64()?;
        let chunk_index = self.body.u32()?;
        reserved_zero("data.reserved", u64::from(self.body.u32()?))?;
        // `parse` checked that exactly `count` entries follow.
        let entries = self.body.take_slice(self.count * DATA_ENTRY_LEN)?;
        let mut runs = Vec::with_capacity(self.count);
        for (index, e) in entries.chunks_exact(DATA_ENTRY_LEN).enumerate() {
            let e: &[u8; DATA_ENTRY_LEN] = e.try_into().expect("chunks_exact");
            let (run, reserved) = parse_run_entry(e);
            reserved_zero("run.reserved", u64::from(reserved))?;
            check_run(index, &run)?;
            runs.push(run);
        }
        Ok(Data {
            request_id,
            chunk_index,
            region_handle,
            runs,
        })
    }

    fn ack(mut self) -> Result<Ack, WireError> {
        let request_id = self.body.u64()?;
        let region_handle = self.body.u64()?;
        let chunk_index = self.body.u32()?;
        reserved_zero("ack.reserved", u64::from(self.body.u32()?))?;
        Ok(Ack {
            request_id,
            chunk_index,
            region_handle,
        })
    }

    fn reject(mut self) -> Result<Reject, WireError> {
        let request_id = self.body.u64()?;
        let code = self.body.u32()?;
        let reason =
            RejectReason::from_code(code).ok_or(WireError::UnknownRejectReason { code })?;
        reserved_zero("reject.reserved", u64::from(self.body.u32()?))?;
        Ok(Reject { request_id, reason })
    }

    fn notice(mut self) -> Result<Notice, WireError> {
        let topic = self.body.u64()?;
        Ok(Notice {
            topic,
            payload: self.body.rest().to_vec(),
        })
    }

    fn handshake(mut self) -> Result<Handshake, WireError> {
        let wire_version = self.body.u16()?;
        let code = self.body.u8()?;
        let control_kind =
            ControlKind::from_code(code).ok_or(WireError::UnknownControlKind { code })?;
        reserved_zero("handshake.reserved8", u64::from(self.body.u8()?))?;
        let capabilities = self.body.u32()?;
        let arena_usable_capacity_bytes = self.body.u64()?;
        let max_chunk_size_bytes = self.body.u64()?;
        let config_generation = self.body.u64()?;
        Ok(Handshake {
            wire_version,
            control_kind,
            arena_usable_capacity_bytes,
            max_chunk_size_bytes,
            endpoint: self.body.rest().to_vec(),
            config_generation,
            capabilities,
        })
    }

    fn data_uniform(mut self) -> Result<DataUniform, WireError> {
        let request_id = self.body.u64()?;
        let region_handle = self.body.u64()?;
        let chunk_index = self.body.u32()?;
        reserved_zero("data_uniform.reserved", u64::from(self.body.u32()?))?;
        let segment_len = self.body.u64()?;
        let region_stride = self.body.u64()?;
        // `parse` checked that exactly `count` entries follow.
        let entries = self.body.take_slice(self.count * DATA_UNIFORM_ENTRY_LEN)?;
        let dsts = entries
            .chunks_exact(DATA_UNIFORM_ENTRY_LEN)
            .map(|e| u64::from_le_bytes(e.try_into().expect("chunks_exact")))
            .collect();
        let scatter = UniformScatter {
            segment_len,
            region_stride,
            dsts,
        };
        check_uniform(&scatter)?;
        Ok(DataUniform {
            request_id,
            chunk_index,
            region_handle,
            scatter,
        })
    }
}

impl Frame<'_> {
    fn data_blocks(mut self) -> Result<DataBlocks, WireError> {
        let request_id = self.body.u64()?;
        let region_handle = self.body.u64()?;
        let chunk_index = self.body.u32()?;
        let count = self.body.u32()?;
        let segment_len = self.body.u64()?;
        let region_stride = self.body.u64()?;
        let first = self.body.u64()?;
        let plane_stride = self.body.u64()?;
        // `parse` checked that exactly `count` (entry count) entries follow.
        let entries = self.body.take_slice(self.count * DATA_BLOCKS_ENTRY_LEN)?;
        let offsets = entries
            .chunks_exact(DATA_BLOCKS_ENTRY_LEN)
            .map(|e| u64::from_le_bytes(e.try_into().expect("chunks_exact")))
            .collect();
        let scatter = BlockScatter {
            segment_len,
            region_stride,
            first,
            count,
            plane_stride,
            offsets,
        };
        check_blocks(&scatter)?;
        Ok(DataBlocks {
            request_id,
            chunk_index,
            region_handle,
            scatter,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Message> {
        vec![
            Message::Notice(Notice {
                topic: NOTICE_TOPIC_ARRIVAL,
                payload: br#"{"request_id":7}"#.to_vec(),
            }),
            Message::Notice(Notice::default()),
            Message::Reject(Reject {
                request_id: u64::MAX,
                reason: RejectReason::UnknownScope,
            }),
            Message::Want(Want {
                request_id: 7,
                scope: 0,
                chunk_bytes: vec![4096, 1 << 25, 33],
                endpoint: b"tcp://10.0.0.1:5555".to_vec(),
            }),
            Message::Want(Want {
                request_id: u64::MAX,
                scope: 0,
                chunk_bytes: vec![],
                endpoint: vec![],
            }),
            Message::Grant(Grant {
                request_id: 9,
                credits: vec![
                    Credit {
                        chunk_index: 0,
                        region_handle: 0,
                        addr: 0x7f00_0000_0000,
                        len: 4096,
                        device_id: 0,
                    },
                    Credit {
                        chunk_index: u32::MAX,
                        region_handle: u64::MAX,
                        addr: u64::MAX,
                        len: u64::MAX,
                        device_id: -1,
                    },
                ],
            }),
            Message::Grant(Grant::default()),
            Message::Data(Data {
                request_id: 1,
                chunk_index: 3,
                region_handle: 1 << 20,
                runs: vec![ScatterRun {
                    region_offset: 0,
                    addr: 0xdead_0000,
                    segment_len: 4096,
                    count: 16_384,
                    region_stride: 4096,
                    addr_stride: 65_536,
                }],
            }),
            Message::Data(Data::default()),
            Message::Ack(Ack {
                request_id: 5,
                chunk_index: 2,
                region_handle: 12_345,
            }),
            Message::Handshake(Handshake {
                wire_version: WIRE_VERSION,
                control_kind: ControlKind::NixlNotif,
                arena_usable_capacity_bytes: 1 << 30,
                max_chunk_size_bytes: 32 << 20,
                endpoint: vec![0xAB; 5000],
                config_generation: 42,
                capabilities: CAP_UNIFORM_DATA | 0x8000_0000,
            }),
            Message::DataUniform(DataUniform {
                request_id: 6,
                chunk_index: 1,
                region_handle: 4096,
                scatter: UniformScatter {
                    segment_len: 4000,
                    region_stride: 4000,
                    dsts: vec![0x1000, 0x9000, 0x5000],
                },
            }),
        ]
    }

    #[test]
    fn round_trip_every_message_and_canonical() {
        for m in samples() {
            let b = m.encode();
            assert_eq!(b.len(), m.encoded_len(), "{m:?}");
            assert_eq!(Message::decode(&b).unwrap(), m);
            assert_eq!(Message::decode(&b).unwrap().encode(), b);
            assert_eq!(peek_type(&b).unwrap(), m.message_type());
            let mut buf = vec![1, 2, 3];
            m.encode_into(&mut buf);
            assert_eq!(&buf[3..], &b[..]);
            assert_eq!(m.try_encode().unwrap(), b);
        }
    }

    #[test]
    fn typed_decoders_reject_cross_type() {
        for m in samples() {
            let b = m.encode();
            let ty = m.message_type();
            let results = [
                (MessageType::Want, decode_want(&b).err()),
                (MessageType::Grant, decode_grant(&b).err()),
                (MessageType::Data, decode_data(&b).err()),
                (MessageType::Ack, decode_ack(&b).err()),
                (MessageType::Handshake, decode_handshake(&b).err()),
            ];
            for (expected, err) in results {
                if expected == ty {
                    assert_eq!(err, None);
                } else {
                    assert_eq!(
                        err,
                        Some(WireError::UnexpectedType {
                            expected,
                            found: ty
                        })
                    );
                }
            }
        }
    }

    #[test]
    fn cancel() {
        let b = encode_cancel(11, b"tcp://h:1");
        assert!(is_cancel_want(&b));
        let w = decode_want(&b).unwrap();
        assert!(w.is_cancel());
        assert_eq!(w.endpoint_str(), Some("tcp://h:1"));
        let not = Message::Want(Want {
            request_id: 11,
            scope: 0,
            chunk_bytes: vec![1],
            endpoint: vec![],
        })
        .encode();
        assert!(!is_cancel_want(&not));
        assert!(!is_cancel_want(&Message::Ack(Ack::default()).encode()));
        assert!(!is_cancel_want(&b[..b.len() - 1]));
    }
}
