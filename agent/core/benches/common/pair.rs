//! Shared by the benches that run a sender and a receiver protocol
//! [`Machine`](kvfabric_core::protocol::Machine) against each other
//! (`protocol_pair`, `policy_model`): the seed-shaped machine config and
//! a request's chunk bounds.

use kvfabric_core::plan::ChunkBound;
use kvfabric_core::protocol::{Config, Mutations};
use kvfabric_core::scheduler::GrantPolicy;

pub const MIB: u64 = 1024 * 1024;
/// Descriptor (piece) size, bytes.
pub const PIECE: u64 = 4096;
/// Chunk cap, bytes.
pub const CHUNK: u64 = 32 * MIB;

/// A machine of the GPU bench's seed-shaped load with the seed's sizes
/// (the agent defaults before issue 18's fourteenth session; kept so the
/// model's numbers stay comparable): arena 256 MiB with 1 MiB
/// granularity, 32 MiB chunks, W = 8, 8 copy contexts, uniform
/// DATA, eager gathers in grant order; `timeout_ns` the request timeout.
pub fn config(name: &str, policy: GrantPolicy, timeout_ns: u64) -> Config {
    Config {
        arena_bytes: 256 * MIB,
        granularity_bytes: MIB,
        max_chunk_size_bytes: CHUNK,
        max_inflight_chunks: 8,
        copy_contexts: 8,
        request_timeout: timeout_ns,
        eager_gather: true,
        eager_grant_order: true,
        release_staging_on_write: true,
        grant_policy: policy,
        grant_size_weight: kvfabric_core::scheduler::DEFAULT_SIZE_WEIGHT,
        uniform_data: true,
        block_data: true,
        arena_base: 0x7000_0000_0000,
        device_id: 0,
        endpoint: name.as_bytes().to_vec(),
        mutations: Mutations::default(),
    }
}

/// A request's chunk bounds: `pieces` pieces of 4 KiB in 32 MiB chunks.
pub fn bounds(pieces: u64) -> Vec<ChunkBound> {
    let per_chunk = CHUNK / PIECE;
    let mut out = Vec::new();
    let mut first = 0;
    while first < pieces {
        let n = per_chunk.min(pieces - first);
        out.push(ChunkBound {
            index: out.len() as u32,
            first_desc: first as usize,
            first_done: 0,
            packed_bytes: n * PIECE,
            payload_bytes: n * PIECE,
            pieces: n,
        });
        first += n;
    }
    out
}
