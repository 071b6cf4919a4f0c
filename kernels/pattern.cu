// kvfabric verification patterns on the device (benches and GPU tests).
//
// The GPU trace replay fills every source descriptor of a request with a
// pattern distinct per request and per descriptor, moves the request, and
// checks every destination byte — all on the device, so a replay at high
// concurrency is not throttled by host <-> device copies of the payload.
//
// A descriptor table is an array of kvf_pat (24 bytes, `PatDesc` in
// agent/src/runtime/cuda.rs): device address, length in bytes and the
// descriptor's index k within its request. Byte j of descriptor k under
// `seed` is byte (j % 8) (little-endian) of kvf_mix(seed, k, j / 8): a
// function of position, so misplaced, shifted or stale bytes all differ.
//
// One block per descriptor (grid-stride over descriptors); threads stride
// over 8-byte words when address and length allow, bytes otherwise.
// Compiled by NVRTC at start-up like gather_scatter.cu; no headers.

typedef unsigned long long kvf_u64;
typedef unsigned int kvf_u32;

struct kvf_pat {
    kvf_u64 addr;
    kvf_u64 len;
    kvf_u64 k;
};

__device__ __forceinline__ kvf_u64 kvf_mix(kvf_u64 seed, kvf_u64 k, kvf_u64 w) {
    // splitmix64 of a position-dependent input.
    kvf_u64 z = seed ^ (k * 0x9E3779B97F4A7C15ULL) ^ (w * 0xD1B54A32D192ED03ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

__device__ __forceinline__ unsigned char kvf_byte(kvf_u64 seed, kvf_u64 k, kvf_u64 j) {
    return (unsigned char)(kvf_mix(seed, k, j >> 3) >> ((j & 7) * 8));
}

extern "C" __global__ void kvf_pattern_fill(const kvf_pat* descs, kvf_u32 n, kvf_u64 seed) {
    for (kvf_u32 i = blockIdx.x; i < n; i += gridDim.x) {
        const kvf_pat d = descs[i];
        if ((d.addr & 7) == 0 && (d.len & 7) == 0) {
            kvf_u64* p = (kvf_u64*)d.addr;
            for (kvf_u64 w = threadIdx.x; w < d.len / 8; w += blockDim.x) {
                p[w] = kvf_mix(seed, d.k, w);
            }
        } else {
            unsigned char* p = (unsigned char*)d.addr;
            for (kvf_u64 j = threadIdx.x; j < d.len; j += blockDim.x) {
                p[j] = kvf_byte(seed, d.k, j);
            }
        }
    }
}

// bad[0]: number of mismatching bytes (words count as 1 per differing word);
// bad[1]: smallest (descriptor index << 40 | byte offset) that differs.
extern "C" __global__ void kvf_pattern_check(const kvf_pat* descs, kvf_u32 n, kvf_u64 seed,
                                             kvf_u64* bad) {
    for (kvf_u32 i = blockIdx.x; i < n; i += gridDim.x) {
        const kvf_pat d = descs[i];
        if ((d.addr & 7) == 0 && (d.len & 7) == 0) {
            const kvf_u64* p = (const kvf_u64*)d.addr;
            for (kvf_u64 w = threadIdx.x; w < d.len / 8; w += blockDim.x) {
                kvf_u64 want = kvf_mix(seed, d.k, w);
                kvf_u64 got = p[w];
                if (got != want) {
                    kvf_u64 x = got ^ want;
                    kvf_u64 byte = (kvf_u64)(__ffsll((long long)x) - 1) / 8;
                    atomicAdd(&bad[0], 1ULL);
                    atomicMin(&bad[1], ((kvf_u64)i << 40) | (w * 8 + byte));
                }
            }
        } else {
            const unsigned char* p = (const unsigned char*)d.addr;
            for (kvf_u64 j = threadIdx.x; j < d.len; j += blockDim.x) {
                if (p[j] != kvf_byte(seed, d.k, j)) {
                    atomicAdd(&bad[0], 1ULL);
                    atomicMin(&bad[1], ((kvf_u64)i << 40) | j);
                }
            }
        }
    }
}
