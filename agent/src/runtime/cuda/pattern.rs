//! Verification patterns on the device (`kernels/pattern.cu`): fill every
//! source descriptor of a transfer with a pattern distinct per seed and per
//! descriptor, check every destination byte — without moving the payload
//! through the host. Used by the GPU trace replay (`kvfabric-gpu bench`).

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys};

use super::{compile_cubin, drv, CudaError, CudaGpu, KernelFn};

/// Source of the pattern kernels, embedded at build time and compiled by
/// NVRTC for the device's architecture when [`PatternKernels::new`] runs.
pub const PATTERN_SRC: &str = include_str!("../../../../kernels/pattern.cu");

/// One descriptor of a pattern table (the layout of `kvf_pat`, 24 bytes):
/// device address, length (bytes) and index `k` within its transfer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PatDesc {
    /// Device address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Index of the descriptor within its transfer (part of the pattern).
    pub k: u64,
}

/// A failed check: how many words/bytes differ and the first one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PatternMismatch {
    /// Differing 8-byte words (aligned descriptors) or bytes (others).
    pub count: u64,
    /// Table index of the first differing descriptor.
    pub descriptor: usize,
    /// Byte offset of the first difference within it.
    pub offset: u64,
}

struct State {
    stream: sys::CUstream,
    table: sys::CUdeviceptr,
    table_cap: usize,
    bad: sys::CUdeviceptr,
}

/// The fill/check kernels loaded on one GPU with one stream and one device
/// table buffer; calls serialise on a mutex (each is a table upload, one
/// launch and a stream sync — sub-millisecond for a 445 MB request).
pub struct PatternKernels {
    gpu: Arc<CudaGpu>,
    module: sys::CUmodule,
    fill: KernelFn,
    check: KernelFn,
    state: Mutex<State>,
}

// SAFETY: module, function, stream and device pointers are context-wide
// driver objects; every use binds the context and holds the state mutex.
unsafe impl Send for PatternKernels {}
unsafe impl Sync for PatternKernels {}

impl std::fmt::Debug for PatternKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PatternKernels")
            .field("gpu", &self.gpu.info().ordinal)
            .finish()
    }
}

impl PatternKernels {
    /// Compiles `kernels/pattern.cu` for `gpu` and loads it.
    ///
    /// # Errors
    /// NVRTC or driver failures, with their error strings.
    pub fn new(gpu: &Arc<CudaGpu>) -> Result<Self, CudaError> {
        gpu.bind()?;
        let cubin = compile_cubin(PATTERN_SRC, "pattern.cu", gpu.info().compute_capability)?;
        // SAFETY: a complete cubin from NVRTC; context bound.
        let module = drv("cuModuleLoadData", unsafe {
            result::module::load_data(cubin.as_ptr().cast())
        })?;
        let fill = KernelFn::load(module, "kvf_pattern_fill")?;
        let check = KernelFn::load(module, "kvf_pattern_check")?;
        let stream = drv(
            "cuStreamCreate",
            result::stream::create(result::stream::StreamKind::NonBlocking),
        )?;
        // SAFETY: context bound; 16 bytes.
        let bad = drv("cuMemAlloc", unsafe { result::malloc_sync(16) })?;
        Ok(Self {
            gpu: gpu.clone(),
            module,
            fill,
            check,
            state: Mutex::new(State {
                stream,
                table: 0,
                table_cap: 0,
                bad,
            }),
        })
    }

    /// Fills every descriptor of `descs` with the pattern of `seed`
    /// (synchronous).
    ///
    /// # Errors
    /// Driver failures (e.g. an address outside device memory faults the
    /// kernel: `CUDA_ERROR_ILLEGAL_ADDRESS`).
    pub fn fill(&self, descs: &[PatDesc], seed: u64) -> Result<(), CudaError> {
        self.run(descs, seed, false).map(|_| ())
    }

    /// Checks every byte of `descs` against the pattern of `seed`
    /// (synchronous). `Ok(None)` when all match.
    ///
    /// # Errors
    /// As [`PatternKernels::fill`].
    pub fn check(
        &self,
        descs: &[PatDesc],
        seed: u64,
    ) -> Result<Option<PatternMismatch>, CudaError> {
        self.run(descs, seed, true)
    }

    fn run(
        &self,
        descs: &[PatDesc],
        seed: u64,
        check: bool,
    ) -> Result<Option<PatternMismatch>, CudaError> {
        if descs.is_empty() {
            return Ok(None);
        }
        let n = u32::try_from(descs.len())
            .map_err(|_| CudaError::Invalid(format!("{} descriptors (max u32)", descs.len())))?;
        self.gpu.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = std::mem::size_of_val(descs);
        if bytes > st.table_cap {
            if st.table != 0 {
                // SAFETY: allocated below earlier; no work in flight (synced).
                let _ = unsafe { result::free_sync(st.table) };
                st.table = 0;
            }
            let cap = bytes.next_power_of_two();
            // SAFETY: context bound.
            st.table = drv("cuMemAlloc", unsafe { result::malloc_sync(cap) })?;
            st.table_cap = cap;
        }
        // SAFETY: PatDesc is repr(C) plain data; the slice covers `bytes`.
        let raw = unsafe { std::slice::from_raw_parts(descs.as_ptr().cast::<u8>(), bytes) };
        // Uploads are ordered on our own stream, before the kernel: a
        // synchronous cuMemcpyHtoD from pageable memory runs on the legacy
        // stream and may return before the data reached the device, which a
        // non-blocking stream would not wait for. `raw` and `init` outlive
        // the stream sync below.
        let init: [u64; 2] = [0, u64::MAX];
        // SAFETY: table holds at least `bytes`; the source stays alive until
        // the stream is synchronised.
        drv("cuMemcpyHtoDAsync", unsafe {
            result::memcpy_htod_async(st.table, raw, st.stream)
        })?;
        if check {
            // SAFETY: bad holds 16 bytes; `init` lives until the sync.
            drv("cuMemcpyHtoDAsync", unsafe {
                result::memcpy_htod_async(st.bad, &init[..], st.stream)
            })?;
        }
        let k = if check { &self.check } else { &self.fill };
        let grid = n.min((self.gpu.info().sm_count.max(1) as u32).saturating_mul(16));
        let threads = 256u32.min(k.info.max_threads.max(32) as u32);
        let mut table = st.table;
        let mut count = n;
        let mut seed = seed;
        let mut bad = st.bad;
        let mut params: Vec<*mut c_void> = vec![
            (&mut table as *mut u64).cast(),
            (&mut count as *mut u32).cast(),
            (&mut seed as *mut u64).cast(),
        ];
        if check {
            params.push((&mut bad as *mut u64).cast());
        }
        // SAFETY: parameters match kvf_pattern_fill / kvf_pattern_check; the
        // table stays allocated until the sync below.
        drv("cuLaunchKernel", unsafe {
            result::launch_kernel(
                k.f,
                (grid, 1, 1),
                (threads, 1, 1),
                0,
                st.stream,
                &mut params,
            )
        })?;
        // SAFETY: live stream.
        drv("cuStreamSynchronize", unsafe {
            result::stream::synchronize(st.stream)
        })?;
        if !check {
            return Ok(None);
        }
        let mut out = [0u64; 2];
        // SAFETY: bad holds 16 bytes; the kernel finished (stream synced);
        // device → pageable host copies return once the data is there.
        drv("cuMemcpyDtoH", unsafe {
            result::memcpy_dtoh_sync(&mut out[..], st.bad)
        })?;
        Ok((out[0] > 0).then(|| PatternMismatch {
            count: out[0],
            descriptor: (out[1] >> 40) as usize,
            offset: out[1] & ((1 << 40) - 1),
        }))
    }
}

impl Drop for PatternKernels {
    fn drop(&mut self) {
        if self.gpu.bind().is_err() {
            return;
        }
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        // SAFETY: objects created in `new`/`run`, released once; nothing in
        // flight (every call syncs its stream).
        unsafe {
            if st.table != 0 {
                let _ = result::free_sync(st.table);
            }
            let _ = result::free_sync(st.bad);
            let _ = result::stream::destroy(st.stream);
            let _ = result::module::unload(self.module);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{probe, probe_nvrtc, CudaArena};
    use super::*;

    #[test]
    fn pattern_kernels_compile_or_skip() {
        if let Err(why) = probe_nvrtc() {
            eprintln!("SKIP: {why}");
            return;
        }
        let cubin = compile_cubin(PATTERN_SRC, "pattern.cu", (9, 0)).unwrap();
        assert!(cubin.starts_with(b"\x7fELF"));
    }

    #[test]
    fn fill_then_check_finds_exactly_the_corrupted_byte() {
        if let Err(why) = probe() {
            eprintln!("SKIP: {why}");
            return;
        }
        let gpu = CudaGpu::open(0).unwrap();
        let pk = PatternKernels::new(&gpu).unwrap();
        let buf = CudaArena::new(&gpu, 1 << 20).unwrap();
        let b = buf.base_addr();
        // Aligned words, an odd address and an odd length (byte path), and
        // a zero-length descriptor.
        let descs = [
            PatDesc {
                addr: b,
                len: 8192,
                k: 0,
            },
            PatDesc {
                addr: b + 10_001,
                len: 777,
                k: 1,
            },
            PatDesc {
                addr: b + 20_000,
                len: 0,
                k: 2,
            },
            PatDesc {
                addr: b + 65_536,
                len: 65_536,
                k: 3,
            },
        ];
        pk.fill(&descs, 42).unwrap();
        assert_eq!(pk.check(&descs, 42).unwrap(), None);
        // Another seed or another index order does not match.
        assert!(pk.check(&descs, 43).unwrap().is_some());
        let swapped = [descs[3], descs[0]].map(|d| PatDesc { k: 3 - d.k, ..d });
        assert!(pk.check(&swapped, 42).unwrap().is_some());
        // Nothing outside the descriptors was written.
        let mut host = vec![0u8; 1 << 20];
        buf.download(0, &mut host).unwrap();
        assert!(host[8192..10_001].iter().all(|&x| x == 0));
        assert!(host[10_778..65_536].iter().all(|&x| x == 0));
        assert!(host[131_072..].iter().all(|&x| x == 0));
        // One flipped byte is found, with its descriptor and offset.
        let at = 65_536 + 4_099;
        buf.upload(at, &[host[at] ^ 0x40]).unwrap();
        let m = pk.check(&descs, 42).unwrap().expect("mismatch");
        assert_eq!((m.count, m.descriptor, m.offset), (1, 3, 4_099));
        let at = 10_001 + 5;
        buf.upload(at, &[host[at] ^ 1]).unwrap();
        let m = pk.check(&descs, 42).unwrap().expect("mismatch");
        assert_eq!((m.count, m.descriptor, m.offset), (2, 1, 5));
    }
}
