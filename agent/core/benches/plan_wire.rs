//! Criterion benchmarks of the transfer plan and the wire codec (issue 2
//! "Must show"): planning 16,384 descriptors (4 KiB each, random-ish slots and
//! dense), and encode/decode throughput of a 16,384-descriptor DATA with
//! merged runs vs per-descriptor entries. Also prints the encoded sizes.
//!
//! Run: `cargo bench -p kvfabric-core --bench plan_wire`. The agent
//! binaries keep freed heap memory mapped (`kvfabric_agent::tune_allocator`);
//! to measure the planner the same way, run with
//! `MALLOC_TRIM_THRESHOLD_=67108864 MALLOC_MMAP_THRESHOLD_=33554432`
//! (glibc's default thresholds make it page-fault fresh memory per plan).

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvfabric_core::plan::{BlockPlanes, TransferPlan};
use kvfabric_core::wire::{decode_data, Data, DataBlocks, DataUniform, Message};
use kvfabric_core::{BlockScatter, Descriptor, UniformScatter};
use std::time::Duration;

const N: u64 = 16_384;
const DESC_LEN: u64 = 4096;
/// Seed §10 default `maxChunkSizeBytes`.
const MAX_CHUNK: u64 = 32 << 20;
/// A chunk cap holding all 16,384 × 4 KiB descriptors (one DATA message).
const ONE_CHUNK: u64 = N * DESC_LEN;

/// Dense: src and dst both contiguous (e.g. ctx tp1 → gen tp4 of one layer).
fn dense() -> Vec<Descriptor> {
    (0..N)
        .map(|i| {
            Descriptor::new(
                0x7f00_0000_0000 + i * DESC_LEN,
                0x7e00_0000_0000 + i * DESC_LEN,
                DESC_LEN,
            )
        })
        .collect()
}

/// Random-ish: KV blocks at pseudo-random slots of a 1M-block pool on both
/// sides (a paged cache after churn): nothing merges.
fn scattered() -> Vec<Descriptor> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        // xorshift64*
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D) % (1 << 20)
    };
    (0..N)
        .map(|_| {
            Descriptor::new(
                0x7f00_0000_0000 + next() * DESC_LEN,
                0x7e00_0000_0000 + next() * DESC_LEN,
                DESC_LEN,
            )
        })
        .collect()
}

/// Strided: dst advances by a uniform stride (one layer of an interleaved
/// cache), src dense.
fn strided() -> Vec<Descriptor> {
    (0..N)
        .map(|i| {
            Descriptor::new(
                0x7f00_0000_0000 + i * DESC_LEN,
                0x7e00_0000_0000 + i * 8 * DESC_LEN,
                DESC_LEN,
            )
        })
        .collect()
}

fn bench_plan(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_16384x4KiB");
    g.throughput(Throughput::Elements(N));
    for (name, descs) in [
        ("dense", dense()),
        ("strided", strided()),
        ("scattered", scattered()),
    ] {
        for merge in [true, false] {
            let id = BenchmarkId::new(name, if merge { "merged" } else { "unmerged" });
            g.bench_with_input(id, &descs, |b, d| {
                b.iter(|| TransferPlan::build(black_box(d), MAX_CHUNK, merge).unwrap())
            });
        }
        // The sizing pass the IO thread runs (the chunks are then built
        // on the copy workers, one `build_chunk` each).
        g.bench_with_input(BenchmarkId::new(name, "chunk_bounds"), &descs, |b, d| {
            b.iter(|| TransferPlan::chunk_bounds(black_box(d), MAX_CHUNK).unwrap())
        });
    }
    g.finish();
}

fn data_for(descs: &[Descriptor], merge: bool) -> Data {
    let plan = TransferPlan::build(descs, ONE_CHUNK, merge).unwrap();
    assert_eq!(plan.chunk_count(), 1);
    Data {
        request_id: 1,
        chunk_index: 0,
        region_handle: 0,
        runs: plan.into_chunks().remove(0).scatter_runs,
    }
}

fn bench_data(c: &mut Criterion) {
    let mut g = c.benchmark_group("data_16384");
    for (name, descs) in [("strided", strided()), ("scattered", scattered())] {
        for merge in [true, false] {
            let data = Message::from(data_for(&descs, merge));
            let enc = data.encode();
            let label = format!("{name}/{}", if merge { "merged" } else { "unmerged" });
            println!(
                "DATA {label}: {} runs, {} bytes encoded",
                match &data {
                    Message::Data(d) => d.runs.len(),
                    _ => unreachable!(),
                },
                enc.len()
            );
            g.throughput(Throughput::Elements(N));
            let mut buf = Vec::with_capacity(enc.len());
            g.bench_function(BenchmarkId::new("encode", &label), |b| {
                b.iter(|| {
                    buf.clear();
                    black_box(&data).encode_into(&mut buf);
                    black_box(buf.len())
                })
            });
            g.bench_function(BenchmarkId::new("decode", &label), |b| {
                b.iter(|| decode_data(black_box(&enc)).unwrap())
            });
        }
    }
    g.finish();
}

/// DATA_UNIFORM of a 32 MiB chunk of 4 KiB blocks (8,192 destinations,
/// the default solo chunk): encode into a fresh buffer (as the transport
/// does for every chunk) and decode.
fn bench_data_uniform(c: &mut Criterion) {
    let mut g = c.benchmark_group("data_uniform_8192");
    let dsts: Vec<u64> = scattered().iter().take(8192).map(|d| d.dst).collect();
    let msg = Message::DataUniform(DataUniform {
        request_id: 1,
        chunk_index: 0,
        region_handle: 0,
        scatter: UniformScatter {
            segment_len: DESC_LEN,
            region_stride: DESC_LEN,
            dsts,
        },
    });
    let enc = msg.encode();
    g.throughput(Throughput::Elements(8192));
    g.bench_function("encode", |b| b.iter(|| black_box(&msg).encode().len()));
    g.bench_function("decode", |b| {
        b.iter(|| Message::decode(black_box(&enc)).unwrap())
    });
    g.finish();
}

/// The seed shape's hand-off as `layout::block_descriptors` lists it:
/// 72 planes (36 layers × K/V) of the same 512 shuffled blocks (8,192
/// tokens of 16), 36,864 × 4 KiB, in pools of 4,096 blocks a plane.
fn seed_handoff() -> Vec<Descriptor> {
    let (planes, blocks, pool) = (72u64, 512u64, 4096u64);
    let id = |i: u64, salt: u64| (i * 2_654_435_761 + salt) % pool;
    (0..planes)
        .flat_map(|q| {
            (0..blocks).map(move |i| {
                Descriptor::new(
                    0x7f00_0000_0000 + (q * pool + id(i, 7)) * DESC_LEN,
                    0x7e00_0000_0000 + (q * pool + id(i, 11)) * DESC_LEN,
                    DESC_LEN,
                )
            })
        })
        .collect()
}

/// DATA_BLOCKS (issue 18 step 3): the same 32 MiB chunk described by the
/// 512 block destinations of a plane (the seed shape) instead of 8,192
/// piece destinations — encode and decode; and the sender's one search
/// for a request's planes (`BlockPlanes::of_dsts`) over the seed shape's
/// 36,864 descriptors, and over 16,384 random slots (no planes: the
/// cost of finding none).
fn bench_data_blocks(c: &mut Criterion) {
    let mut g = c.benchmark_group("data_blocks_8192");
    let descs = seed_handoff();
    let planes = BlockPlanes::of_dsts(&descs).expect("the seed shape has planes");
    assert_eq!(planes.offsets.len(), 512);
    let msg = Message::DataBlocks(DataBlocks {
        request_id: 1,
        chunk_index: 1,
        region_handle: 0,
        scatter: BlockScatter {
            segment_len: DESC_LEN,
            region_stride: DESC_LEN,
            first: 8192,
            count: 8192,
            plane_stride: planes.plane_stride,
            offsets: planes.offsets.clone(),
        },
    });
    let enc = msg.encode();
    println!(
        "DATA_BLOCKS of 8,192 pieces: {} bytes (DATA_UNIFORM: {} bytes)",
        enc.len(),
        16 + 40 + 8192 * 8
    );
    g.throughput(Throughput::Elements(8192));
    g.bench_function("encode", |b| b.iter(|| black_box(&msg).encode().len()));
    g.bench_function("decode", |b| {
        b.iter(|| Message::decode(black_box(&enc)).unwrap())
    });
    g.finish();
    let mut g = c.benchmark_group("block_planes");
    g.bench_function("of_dsts_seed_36864", |b| {
        b.iter(|| BlockPlanes::of_dsts(black_box(&descs)).map(|p| p.offsets.len()))
    });
    let random = scattered();
    g.bench_function("of_dsts_random_16384", |b| {
        b.iter(|| BlockPlanes::of_dsts(black_box(&random)).is_none())
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = bench_plan, bench_data, bench_data_uniform, bench_data_blocks
}
criterion_main!(benches);
