// kvfabric batched gather/scatter copy kernel (seed §4 GatherScatterKernel).
//
// Compiled at agent start-up by NVRTC for the device's own architecture to a
// cubin (agent/src/runtime/cuda.rs); it uses no headers, so NVRTC needs no
// include path.
//
// A plan is an array of scatter runs (kvf_run, 48 bytes, the layout of
// `GpuRun` in agent/src/runtime/cuda.rs): run r moves `count` segments of
// `segment_len` bytes; segment i lives at region offset
// `region_offset + i * region_stride` and at user address
// `addr + i * addr_stride`. Gather copies user -> region (to_region != 0),
// scatter copies region -> user. Coalesced runs are expanded here, on the
// device: the host never lists their segments.
//
// Work is split into tasks (kvf_task, 16 bytes, `GpuTask`), one warp per
// task; warp w of the grid takes tasks w, w + warps, ... (any grid size
// works):
//   * segment_len <= piece_bytes: a task is `seg_count` whole segments of one
//     run (as many as fit in piece_bytes);
//   * segment_len >  piece_bytes: a task is piece `piece` (piece_bytes long,
//     the last one shorter) of a single segment.
// When `tasks` is null every run is exactly one task (task t = run t, all of
// its segments, no pieces): the host omits the table in that common case.
//
// The plan (runs and tasks) is read either from mapped pinned host memory
// (zero-copy, the default) or from a device buffer; the kernel does not care.
//
// Copies use the widest access that source and destination allow together:
// 16-byte vectors when (src ^ dst) % 16 == 0, then 8, 4 and finally single
// bytes; head and tail bytes around the aligned middle are copied singly, so
// nothing outside [dst, dst + len) is ever written.

typedef unsigned long long kvf_u64;
typedef unsigned int kvf_u32;

struct kvf_run {
    kvf_u64 region_offset;
    kvf_u64 addr;
    kvf_u64 segment_len;
    kvf_u64 region_stride;
    kvf_u64 addr_stride;
    kvf_u32 count;
    kvf_u32 pad;
};

struct kvf_task {
    kvf_u32 run;
    kvf_u32 seg_begin;
    kvf_u32 seg_count;
    kvf_u32 piece;
};

// Copies len bytes with W-byte accesses of type V over the bytes that are
// W-aligned in both src and dst (caller guarantees (src ^ dst) % W == 0).
// Threads tid of nt cooperate; nt >= 16.
template <typename V, int W>
__device__ __forceinline__ void kvf_copy_w(unsigned char* dst, const unsigned char* src,
                                           kvf_u64 len, kvf_u32 tid, kvf_u32 nt) {
    kvf_u64 head = (kvf_u64)((W - ((kvf_u64)src & (W - 1))) & (W - 1));
    if (head > len) head = len;
    if (tid < head) dst[tid] = src[tid];
    src += head;
    dst += head;
    len -= head;
    const kvf_u64 n = len / W;
    const V* __restrict__ s = reinterpret_cast<const V*>(src);
    V* __restrict__ d = reinterpret_cast<V*>(dst);
    kvf_u64 i = tid;
    // Four independent loads in flight per thread before the first store.
    for (; i + 3ull * nt < n; i += 4ull * nt) {
        V a = s[i];
        V b = s[i + nt];
        V c = s[i + 2ull * nt];
        V e = s[i + 3ull * nt];
        d[i] = a;
        d[i + nt] = b;
        d[i + 2ull * nt] = c;
        d[i + 3ull * nt] = e;
    }
    for (; i < n; i += nt) d[i] = s[i];
    const kvf_u64 done = n * W;
    const kvf_u64 tail = len - done;
    if (tid < tail) dst[done + tid] = src[done + tid];
}

__device__ __forceinline__ void kvf_copy(unsigned char* dst, const unsigned char* src,
                                         kvf_u64 len, kvf_u32 tid, kvf_u32 nt) {
    if (len == 0) return;
    const kvf_u64 mis = (kvf_u64)dst ^ (kvf_u64)src;
    if ((mis & 15ull) == 0) {
        kvf_copy_w<uint4, 16>(dst, src, len, tid, nt);
    } else if ((mis & 7ull) == 0) {
        kvf_copy_w<uint2, 8>(dst, src, len, tid, nt);
    } else if ((mis & 3ull) == 0) {
        kvf_copy_w<unsigned int, 4>(dst, src, len, tid, nt);
    } else {
        for (kvf_u64 i = tid; i < len; i += nt) dst[i] = src[i];
    }
}

// One plan entry as a warp holds it after the broadcast.
struct kvf_work {
    kvf_u64 region_offset, addr, segment_len, region_stride, addr_stride;
    kvf_u32 count, seg_begin, seg_count, piece;
};

// Copies one task with the 32 lanes of a warp: `seg_count` whole segments
// from `seg_begin`, or piece `piece` of segment `seg_begin` when segments are
// longer than piece_bytes.
__device__ __forceinline__ void kvf_task_copy(const kvf_work& w, kvf_u64 region_base,
                                              int to_region, kvf_u64 piece_bytes,
                                              kvf_u32 lane) {
    const kvf_u64 seg_len = w.segment_len;
    kvf_u64 off = 0, len = seg_len;
    if (seg_len > piece_bytes) {
        off = (kvf_u64)w.piece * piece_bytes;
        if (off >= seg_len) return;
        len = seg_len - off;
        if (len > piece_bytes) len = piece_bytes;
    }
    for (kvf_u32 k = 0; k < w.seg_count; ++k) {
        const kvf_u64 s = (kvf_u64)w.seg_begin + k;
        unsigned char* region =
            (unsigned char*)(region_base + w.region_offset + s * w.region_stride + off);
        unsigned char* user = (unsigned char*)(w.addr + s * w.addr_stride + off);
        if (to_region) kvf_copy(region, user, len, lane, 32u);
        else kvf_copy(user, region, len, lane, 32u);
    }
}

// Lane-distributed plan words: lanes 0..5 hold the run's six 8-byte words,
// lanes 0..1 the task's two. Loads are issued one or two tasks ahead, so the
// (zero-copy) plan latency overlaps the copy of the current task.
__device__ __forceinline__ kvf_u64 kvf_load_run_word(const kvf_run* runs, kvf_u32 r,
                                                     kvf_u32 lane) {
    return lane < 6u ? reinterpret_cast<const kvf_u64*>(runs + r)[lane] : 0ull;
}

__device__ __forceinline__ kvf_u64 kvf_load_task_word(const kvf_task* tasks, kvf_u64 t,
                                                      kvf_u32 lane) {
    return lane < 2u ? reinterpret_cast<const kvf_u64*>(tasks + t)[lane] : 0ull;
}

__device__ __forceinline__ kvf_work kvf_broadcast(kvf_u64 run_w, kvf_u64 task_w, bool table) {
    const unsigned full = 0xffffffffu;
    kvf_work w;
    w.region_offset = __shfl_sync(full, run_w, 0);
    w.addr = __shfl_sync(full, run_w, 1);
    w.segment_len = __shfl_sync(full, run_w, 2);
    w.region_stride = __shfl_sync(full, run_w, 3);
    w.addr_stride = __shfl_sync(full, run_w, 4);
    w.count = (kvf_u32)__shfl_sync(full, run_w, 5);
    if (table) {
        const kvf_u64 t0 = __shfl_sync(full, task_w, 0);  // run | seg_begin << 32
        const kvf_u64 t1 = __shfl_sync(full, task_w, 1);  // seg_count | piece << 32
        w.seg_begin = (kvf_u32)(t0 >> 32);
        w.seg_count = (kvf_u32)t1;
        w.piece = (kvf_u32)(t1 >> 32);
    } else {
        w.seg_begin = 0u;
        w.seg_count = w.count;
        w.piece = 0u;
    }
    return w;
}

// A warp per task, grid-stride over tasks (any grid size works: one block
// per few tasks, or a persistent grid).
__device__ __forceinline__ void kvf_body(const kvf_run* __restrict__ runs,
                                         const kvf_task* __restrict__ tasks, kvf_u32 ntasks,
                                         kvf_u64 region_base, int to_region,
                                         kvf_u64 piece_bytes) {
    const unsigned full = 0xffffffffu;
    const kvf_u32 lane = threadIdx.x & 31u;
    const kvf_u64 stride = (kvf_u64)gridDim.x * (blockDim.x / 32u);
    kvf_u64 t = (kvf_u64)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    if (t >= ntasks) return;
    const bool table = tasks != 0;

    kvf_u64 task_w = 0, ntask_w = 0, run_w;
    kvf_u64 tn = t + stride;
    if (table) {
        task_w = kvf_load_task_word(tasks, t, lane);
        const kvf_u32 r = (kvf_u32)__shfl_sync(full, task_w, 0);
        run_w = kvf_load_run_word(runs, r, lane);
        if (tn < ntasks) ntask_w = kvf_load_task_word(tasks, tn, lane);
    } else {
        run_w = kvf_load_run_word(runs, (kvf_u32)t, lane);
    }
    for (;;) {
        const bool more = tn < ntasks;
        kvf_u64 nrun_w = 0, nntask_w = 0;
        const kvf_u64 tnn = tn + stride;
        if (more) {
            if (table) {
                const kvf_u32 nr = (kvf_u32)__shfl_sync(full, ntask_w, 0);
                nrun_w = kvf_load_run_word(runs, nr, lane);
                if (tnn < ntasks) nntask_w = kvf_load_task_word(tasks, tnn, lane);
            } else {
                nrun_w = kvf_load_run_word(runs, (kvf_u32)tn, lane);
            }
        }
        const kvf_work w = kvf_broadcast(run_w, task_w, table);
        kvf_task_copy(w, region_base, to_region, piece_bytes, lane);
        if (!more) break;
        run_w = nrun_w;
        task_w = ntask_w;
        ntask_w = nntask_w;
        tn = tnn;
    }
}

// Two builds of one body: registers capped at 64 (any block size up to
// 1024) and at 32 for full occupancy (blocks of up to 256 threads, 8 per
// multiprocessor).
extern "C" __global__ void __launch_bounds__(1024)
    kvf_gather_scatter(const kvf_run* __restrict__ runs, const kvf_task* __restrict__ tasks,
                       kvf_u32 ntasks, kvf_u64 region_base, int to_region,
                       kvf_u64 piece_bytes) {
    kvf_body(runs, tasks, ntasks, region_base, to_region, piece_bytes);
}

extern "C" __global__ void __launch_bounds__(256, 8)
    kvf_gather_scatter_occ(const kvf_run* __restrict__ runs, const kvf_task* __restrict__ tasks,
                           kvf_u32 ntasks, kvf_u64 region_base, int to_region,
                           kvf_u64 piece_bytes) {
    kvf_body(runs, tasks, ntasks, region_base, to_region, piece_bytes);
}

// Uniform gather (issue 18): a chunk of whole descriptors of one length
// `len`, from the descriptors' source addresses (8 bytes each), no run
// table: warp w copies srcs[w] -> region_base + w * stride. The host
// checked that every descriptor has length `len` and that the region holds
// (n - 1) * stride + len bytes.
extern "C" __global__ void __launch_bounds__(256)
    kvf_gather_srcs(const kvf_u64* __restrict__ srcs, kvf_u32 n, kvf_u64 len,
                    kvf_u64 stride, kvf_u64 region_base) {
    const kvf_u32 lane = threadIdx.x & 31u;
    const kvf_u64 warps_per_block = blockDim.x >> 5;
    for (kvf_u64 w = (kvf_u64)blockIdx.x * warps_per_block + (threadIdx.x >> 5); w < n;
         w += (kvf_u64)gridDim.x * warps_per_block) {
        const unsigned char* s = (const unsigned char*)srcs[w];
        unsigned char* d = (unsigned char*)(region_base + w * stride);
        kvf_copy(d, s, len, lane, 32u);
    }
}

// Uniform scatter (issue 18 step 3, DATA_UNIFORM): the receiver's side of
// the uniform gather. Warp w copies region_base + w * stride -> dsts[w],
// `len` bytes each. The host validated every destination against the
// destination's memory and the pieces against the granted region.
extern "C" __global__ void __launch_bounds__(256)
    kvf_scatter_dsts(const kvf_u64* __restrict__ dsts, kvf_u32 n, kvf_u64 len,
                     kvf_u64 stride, kvf_u64 region_base) {
    const kvf_u32 lane = threadIdx.x & 31u;
    const kvf_u64 warps_per_block = blockDim.x >> 5;
    for (kvf_u64 w = (kvf_u64)blockIdx.x * warps_per_block + (threadIdx.x >> 5); w < n;
         w += (kvf_u64)gridDim.x * warps_per_block) {
        const unsigned char* s = (const unsigned char*)(region_base + w * stride);
        unsigned char* d = (unsigned char*)dsts[w];
        kvf_copy(d, s, len, lane, 32u);
    }
}

// Block scatter (issue 18 step 3, DATA_BLOCKS): a uniform scatter whose
// destinations are derived here from the request's block destinations.
// Piece w of the chunk is piece k = first + w of the request and goes to
//   (k / nblocks) * plane_stride + offsets[k % nblocks]
// (nblocks destinations of the first plane, plane after plane); warp w
// copies region_base + w * stride there, `len` bytes. The host validated
// every derived destination and the pieces against the granted region.
extern "C" __global__ void __launch_bounds__(256)
    kvf_scatter_blocks(const kvf_u64* __restrict__ offsets, kvf_u32 nblocks, kvf_u64 first,
                       kvf_u32 n, kvf_u64 plane_stride, kvf_u64 len, kvf_u64 stride,
                       kvf_u64 region_base) {
    const kvf_u32 lane = threadIdx.x & 31u;
    const kvf_u64 warps_per_block = blockDim.x >> 5;
    for (kvf_u64 w = (kvf_u64)blockIdx.x * warps_per_block + (threadIdx.x >> 5); w < n;
         w += (kvf_u64)gridDim.x * warps_per_block) {
        const kvf_u64 k = first + w;
        const kvf_u64 q = k / nblocks;
        const kvf_u64 i = k - q * nblocks;
        const unsigned char* s = (const unsigned char*)(region_base + w * stride);
        unsigned char* d = (unsigned char*)(q * plane_stride + offsets[i]);
        kvf_copy(d, s, len, lane, 32u);
    }
}

// Block gather (issue 18 step 3): the sender's side of the block scatter.
// Piece w of the chunk is piece k = first + w of the request and is read
// from (k / nblocks) * plane_stride + offsets[k % nblocks] (the request's
// source blocks of its first plane, plane after plane); warp w copies it
// to region_base + w * stride, `len` bytes. The host found the planes in
// the request's descriptors and checked their lengths.
extern "C" __global__ void __launch_bounds__(256)
    kvf_gather_blocks(const kvf_u64* __restrict__ offsets, kvf_u32 nblocks, kvf_u64 first,
                      kvf_u32 n, kvf_u64 plane_stride, kvf_u64 len, kvf_u64 stride,
                      kvf_u64 region_base) {
    const kvf_u32 lane = threadIdx.x & 31u;
    const kvf_u64 warps_per_block = blockDim.x >> 5;
    for (kvf_u64 w = (kvf_u64)blockIdx.x * warps_per_block + (threadIdx.x >> 5); w < n;
         w += (kvf_u64)gridDim.x * warps_per_block) {
        const kvf_u64 k = first + w;
        const kvf_u64 q = k / nblocks;
        const kvf_u64 i = k - q * nblocks;
        const unsigned char* s = (const unsigned char*)(q * plane_stride + offsets[i]);
        unsigned char* d = (unsigned char*)(region_base + w * stride);
        kvf_copy(d, s, len, lane, 32u);
    }
}

// Same-node direct path (issue 19): copies whole KV blocks between two pools
// straight from their block ids, no run table. Warp w copies block pair
// p = w % npairs of plane (layer x K/V) q = w / npairs:
//   src_base + q * src_plane + src_ids[p] * block_bytes
//   -> dst_base + q * dst_plane + dst_ids[p] * block_bytes
// (the layer-major pool layout of the engine API). Ids were range-checked
// on the host against both layouts.
extern "C" __global__ void __launch_bounds__(256)
    kvf_block_copy(kvf_u64 src_base, kvf_u64 dst_base, const kvf_u32* __restrict__ src_ids,
                   const kvf_u32* __restrict__ dst_ids, kvf_u32 npairs, kvf_u32 nplanes,
                   kvf_u64 src_plane, kvf_u64 dst_plane, kvf_u64 block_bytes) {
    const kvf_u32 lane = threadIdx.x & 31u;
    const kvf_u64 warps_per_block = blockDim.x >> 5;
    const kvf_u64 total = (kvf_u64)npairs * nplanes;
    for (kvf_u64 w = (kvf_u64)blockIdx.x * warps_per_block + (threadIdx.x >> 5); w < total;
         w += (kvf_u64)gridDim.x * warps_per_block) {
        const kvf_u64 q = w / npairs;
        const kvf_u64 p = w - q * npairs;
        const unsigned char* s =
            (const unsigned char*)(src_base + q * src_plane + (kvf_u64)src_ids[p] * block_bytes);
        unsigned char* d = (unsigned char*)(dst_base + q * dst_plane + (kvf_u64)dst_ids[p] * block_bytes);
        kvf_copy(d, s, block_bytes, lane, 32u);
    }
}
