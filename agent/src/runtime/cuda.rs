//! GPU data plane (feature `cuda`; seed §4 `BounceArena`, `ExecPool`,
//! `GatherScatterKernel`): the gather/scatter kernel of
//! `kernels/gather_scatter.cu` compiled at start-up by NVRTC for the
//! device's own architecture to a cubin, a device-memory arena to register
//! with NIXL as VRAM, and [`CudaCopyEngine`], a [`CopyEngine`] over a pool of
//! {stream, event, pinned host plan buffer, device plan buffer} contexts.
//!
//! The CUDA driver and NVRTC are loaded at run time (cudarc
//! `dynamic-loading`): the build needs no CUDA, and [`probe`] says why the
//! GPU is unusable (no driver, no device, no NVRTC) instead of panicking.
//! Every CUDA error is logged with its error string and returned; none is
//! swallowed (seed §9).
//!
//! Comparison paths (selected by [`CopyPath`]): one `cuMemcpyDtoDAsync` per
//! segment, and the driver's batched memcpy (`cuMemcpyBatchAsync`, exported
//! by CUDA 13 drivers as `cuMemcpyBatchAsync_v2`, which cudarc 0.19.10
//! exposes in `driver::sys` for `cuda-13000`; looked up at run time).

use std::ffi::{c_void, CStr, CString};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, DriverError};
use cudarc::nvrtc::sys as nvrtc_sys;
use kvfabric_core::plan::BlockPlanes;
use kvfabric_core::{BlockScatter, Descriptor, ScatterRun, UniformScatter};

use super::engine::{
    EngineError, MemDesc, MemKind, PreparedList, TransferEngine, XferHandle, XferState,
};
use super::exec::{CopyEngine, CopyError, ExecPool, UniformGather};

pub mod pattern;

/// Source of the gather/scatter kernel (`kernels/gather_scatter.cu`),
/// embedded at build time and compiled by NVRTC at start-up.
pub const GATHER_SCATTER_SRC: &str = include_str!("../../../kernels/gather_scatter.cu");
/// Entry point of the gather/scatter kernel (registers capped at 64, blocks
/// of up to 1024 threads).
pub const GATHER_SCATTER_KERNEL: &str = "kvf_gather_scatter";
/// The same kernel built for full occupancy (registers capped at 32, blocks
/// of up to 256 threads).
pub const GATHER_SCATTER_KERNEL_OCC: &str = "kvf_gather_scatter_occ";

/// The same-node direct path's kernel: whole blocks from block ids.
pub const BLOCK_COPY_KERNEL: &str = "kvf_block_copy";

/// The uniform gather's kernel: a chunk of equal-length descriptors from
/// their source addresses (issue 18).
pub const GATHER_SRCS_KERNEL: &str = "kvf_gather_srcs";

/// The uniform scatter's kernel: a DATA_UNIFORM's pieces to their
/// destinations (issue 18 step 3).
pub const SCATTER_DSTS_KERNEL: &str = "kvf_scatter_dsts";

/// The block scatter's kernel: a DATA_BLOCKS' pieces to the destinations
/// it derives from the request's block destinations (issue 18 step 3).
pub const SCATTER_BLOCKS_KERNEL: &str = "kvf_scatter_blocks";

/// The block gather's kernel: a chunk's pieces from the sources it derives
/// from the request's source blocks (issue 18 step 3).
pub const GATHER_BLOCKS_KERNEL: &str = "kvf_gather_blocks";

/// Default bytes per kernel task (one warp each): longer segments are split
/// into pieces of this size, shorter ones grouped up to it.
pub const DEFAULT_PIECE_BYTES: u64 = 32 * 1024;

/// A CUDA failure, with the driver's or NVRTC's own error string.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// No usable driver, device or NVRTC library (the reason says which).
    #[error("CUDA unavailable: {0}")]
    Unavailable(String),
    /// A driver call failed.
    #[error("{op}: {msg}")]
    Driver {
        /// The driver call.
        op: &'static str,
        /// `cuGetErrorName (cuGetErrorString)`.
        msg: String,
    },
    /// NVRTC failed; `msg` carries the compile log when there is one.
    #[error("NVRTC {op}: {msg}")]
    Nvrtc {
        /// The NVRTC call.
        op: &'static str,
        /// The error string and compile log.
        msg: String,
    },
    /// A plan the kernel cannot run (too many tasks, bad launch shape).
    #[error("invalid copy plan: {0}")]
    Invalid(String),
}

impl From<CudaError> for CopyError {
    fn from(e: CudaError) -> Self {
        CopyError(e.to_string())
    }
}

/// `name (string)` of a driver error.
fn driver_msg(e: &DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("CUresult {}", e.0 as u32));
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{name} ({text})")
}

/// Maps a driver result, logging failures (never swallowed).
fn drv<T>(op: &'static str, r: Result<T, DriverError>) -> Result<T, CudaError> {
    r.map_err(|e| {
        let msg = driver_msg(&e);
        tracing::error!(op, error = %msg, "CUDA driver call failed");
        CudaError::Driver { op, msg }
    })
}

/// Maps a raw `CUresult`.
fn check(op: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    drv(op, r.result())
}

fn nvrtc_err(op: &'static str, e: nvrtc_sys::nvrtcResult, log: &str) -> CudaError {
    // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(nvrtc_sys::nvrtcGetErrorString(e)) }
        .to_string_lossy()
        .into_owned();
    let msg = if log.trim().is_empty() {
        text
    } else {
        format!("{text}\n{log}")
    };
    tracing::error!(op, error = %msg, "NVRTC call failed");
    CudaError::Nvrtc { op, msg }
}

/// Whether the CUDA driver library and NVRTC can be loaded and a device
/// exists. `Err` carries a printable skip reason ("no CUDA driver …").
pub fn probe() -> Result<(), String> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so not loadable)".into());
    }
    result::init().map_err(|e| format!("no CUDA driver (cuInit: {})", driver_msg(&e)))?;
    let n = result::device::get_count()
        .map_err(|e| format!("no CUDA device (cuDeviceGetCount: {})", driver_msg(&e)))?;
    if n == 0 {
        return Err("no CUDA device".into());
    }
    probe_nvrtc()
}

/// Whether NVRTC can be loaded (compiling needs no GPU).
pub fn probe_nvrtc() -> Result<(), String> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        return Err(
            "no NVRTC (libnvrtc.so not loadable; set LD_LIBRARY_PATH=/usr/local/cuda/lib64)".into(),
        );
    }
    Ok(())
}

/// NVRTC's version (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: out-pointers to locals.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("nvrtcVersion", r, ""));
    }
    Ok((major, minor))
}

/// Compiles CUDA C `src` with NVRTC for `sm_{major}{minor}` to a cubin
/// (machine code, not PTX: no JIT at load). Needs NVRTC, not a GPU.
pub fn compile_cubin(src: &str, name: &str, arch: (i32, i32)) -> Result<Vec<u8>, CudaError> {
    let csrc = CString::new(src).map_err(|_| CudaError::Invalid("NUL in kernel source".into()))?;
    let cname = CString::new(name).map_err(|_| CudaError::Invalid("NUL in kernel name".into()))?;
    let prog = cudarc::nvrtc::result::create_program(&csrc, Some(&cname))
        .map_err(|e| nvrtc_err("nvrtcCreateProgram", e.0, ""))?;
    let opts = [
        format!("--gpu-architecture=sm_{}{}", arch.0, arch.1),
        "--std=c++17".to_string(),
    ];
    // SAFETY: prog is live until destroy_program below.
    let out = unsafe {
        let compiled = cudarc::nvrtc::result::compile_program(prog, &opts);
        let log = cudarc::nvrtc::result::get_program_log(prog)
            .map(|l| {
                let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        match compiled {
            Err(e) => Err(nvrtc_err("nvrtcCompileProgram", e.0, &log)),
            Ok(()) => {
                if !log.trim().is_empty() {
                    tracing::warn!(kernel = name, log = %log, "NVRTC compile log");
                }
                let mut size = 0usize;
                let r = nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size);
                if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                    Err(nvrtc_err("nvrtcGetCUBINSize", r, ""))
                } else {
                    let mut cubin = vec![0u8; size];
                    let r = nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast());
                    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                        Err(nvrtc_err("nvrtcGetCUBIN", r, ""))
                    } else {
                        Ok(cubin)
                    }
                }
            }
        }
    };
    // SAFETY: created above, destroyed once.
    if let Err(e) = unsafe { cudarc::nvrtc::result::destroy_program(prog) } {
        tracing::warn!(error = ?e, "nvrtcDestroyProgram failed");
    }
    out
}

/// What [`CudaGpu::open`] found and did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Device name.
    pub name: String,
    /// `cuDeviceGetUuid`'s 16 bytes (`None` where the driver did not answer;
    /// text: `kvfabric_core::layout::format_gpu_uuid`). Engines name their
    /// GPU by it: ordinals are per process. Serialized as that text.
    #[serde(serialize_with = "uuid_text")]
    pub uuid: Option<[u8; 16]>,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Multiprocessors.
    pub sm_count: i32,
    /// Device memory (bytes).
    pub total_mem: usize,
    /// Driver API version (e.g. 13000).
    pub driver_version: i32,
    /// NVRTC version.
    pub nvrtc_version: (i32, i32),
    /// Time NVRTC took to compile the kernels (ms).
    pub compile_ms: f64,
    /// Size of the loaded cubin (bytes).
    pub cubin_bytes: usize,
    /// The loaded kernel builds.
    pub kernels: Vec<KernelInfo>,
}

/// [`GpuInfo::uuid`] as its canonical text (or null).
fn uuid_text<S: serde::Serializer>(u: &Option<[u8; 16]>, s: S) -> Result<S::Ok, S::Error> {
    match u {
        Some(b) => s.serialize_some(&kvfabric_core::layout::format_gpu_uuid(b)),
        None => s.serialize_none(),
    }
}

/// One loaded kernel entry point.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KernelInfo {
    /// Entry point.
    pub name: &'static str,
    /// Registers per thread.
    pub regs: i32,
    /// Local memory per thread (bytes; non-zero means spills).
    pub local_bytes: i32,
    /// Largest block it can be launched with.
    pub max_threads: i32,
    /// Resident blocks per multiprocessor for 32, 64, …, 1024 threads per
    /// block (occupancy calculator; caps the persistent grid).
    pub max_blocks_per_sm: Vec<i32>,
}

/// A kernel handle with its launch limits.
struct KernelFn {
    f: sys::CUfunction,
    info: KernelInfo,
}

impl KernelFn {
    fn load(module: sys::CUmodule, name: &'static str) -> Result<Self, CudaError> {
        // SAFETY: module is loaded.
        let f = drv("cuModuleGetFunction", unsafe {
            result::module::get_function(module, CString::new(name).unwrap())
        })?;
        let attr = |a| {
            // SAFETY: f is a live function handle.
            drv("cuFuncGetAttribute", unsafe {
                result::function::get_function_attribute(f, a)
            })
        };
        let regs = attr(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)?;
        let local_bytes = attr(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?;
        let max_threads = attr(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?;
        let mut max_blocks_per_sm = Vec::new();
        for threads in (32..=1024).step_by(32) {
            let n = if threads <= max_threads {
                // SAFETY: f is a live function handle.
                drv("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
                    result::occupancy::max_active_block_per_multiprocessor(f, threads, 0)
                })?
            } else {
                0
            };
            max_blocks_per_sm.push(n);
        }
        Ok(Self {
            f,
            info: KernelInfo {
                name,
                regs,
                local_bytes,
                max_threads,
                max_blocks_per_sm,
            },
        })
    }
}

/// One GPU: its primary context and the loaded gather/scatter module.
pub struct CudaGpu {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    kernel: KernelFn,
    kernel_occ: KernelFn,
    block_copy: KernelFn,
    gather_srcs: KernelFn,
    scatter_dsts: KernelFn,
    scatter_blocks: KernelFn,
    gather_blocks: KernelFn,
    info: GpuInfo,
}

// SAFETY: module and function handles are context-wide driver objects,
// usable from any thread that has the context current (every entry point
// binds it first).
unsafe impl Send for CudaGpu {}
unsafe impl Sync for CudaGpu {}

impl std::fmt::Debug for CudaGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGpu").field("info", &self.info).finish()
    }
}

impl CudaGpu {
    /// Opens device `ordinal`: checks [`probe`], retains its primary context,
    /// compiles `kernels/*.cu` with NVRTC for its architecture to a cubin and
    /// loads it.
    pub fn open(ordinal: usize) -> Result<Arc<Self>, CudaError> {
        probe().map_err(CudaError::Unavailable)?;
        let ctx = drv("cuDevicePrimaryCtxRetain", CudaContext::new(ordinal))?;
        let cc = drv("cuDeviceGetAttribute", ctx.compute_capability())?;
        let sm_count = drv(
            "cuDeviceGetAttribute",
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        )?;
        let name = drv("cuDeviceGetName", ctx.name())?;
        // cuDeviceGetUuid_v2 (the MIG instance's UUID in MIG mode, as torch).
        let uuid = match ctx.uuid() {
            // c_char is i8 on x86-64: the bytes as they are.
            Ok(u) => Some(u.bytes.map(|b| b as u8)),
            Err(e) => {
                tracing::warn!(ordinal, error = ?e, "cuDeviceGetUuid failed: engines are matched by ordinal");
                None
            }
        };
        let total_mem = drv("cuDeviceTotalMem", ctx.total_mem())?;
        let mut driver_version = 0;
        // SAFETY: out-pointer to a local.
        check("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&mut driver_version)
        })?;
        let nvrtc_version = nvrtc_version()?;
        let t0 = Instant::now();
        let cubin = compile_cubin(GATHER_SCATTER_SRC, "gather_scatter.cu", cc)?;
        let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
        // SAFETY: cubin is a complete image produced by NVRTC; context bound.
        let module = drv("cuModuleLoadData", unsafe {
            result::module::load_data(cubin.as_ptr().cast())
        })?;
        let kernel = KernelFn::load(module, GATHER_SCATTER_KERNEL)?;
        let kernel_occ = KernelFn::load(module, GATHER_SCATTER_KERNEL_OCC)?;
        let block_copy = KernelFn::load(module, BLOCK_COPY_KERNEL)?;
        let gather_srcs = KernelFn::load(module, GATHER_SRCS_KERNEL)?;
        let scatter_dsts = KernelFn::load(module, SCATTER_DSTS_KERNEL)?;
        let scatter_blocks = KernelFn::load(module, SCATTER_BLOCKS_KERNEL)?;
        let gather_blocks = KernelFn::load(module, GATHER_BLOCKS_KERNEL)?;
        let info = GpuInfo {
            ordinal,
            name,
            uuid,
            compute_capability: cc,
            sm_count,
            total_mem,
            driver_version,
            nvrtc_version,
            compile_ms,
            cubin_bytes: cubin.len(),
            kernels: vec![
                kernel.info.clone(),
                kernel_occ.info.clone(),
                block_copy.info.clone(),
                gather_srcs.info.clone(),
                scatter_dsts.info.clone(),
                scatter_blocks.info.clone(),
                gather_blocks.info.clone(),
            ],
        };
        tracing::info!(?info, "CUDA device ready, kernels compiled to cubin");
        Ok(Arc::new(Self {
            ctx,
            module,
            kernel,
            kernel_occ,
            block_copy,
            gather_srcs,
            scatter_dsts,
            scatter_blocks,
            gather_blocks,
            info,
        }))
    }

    /// What was found at open.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        drv("cuCtxSetCurrent", self.ctx.bind_to_thread())
    }

    /// The cudarc context (for callers that want cudarc's safe API).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// Enqueues one direct block copy ([`BlockCopy`]) on `stream`: one
    /// launch of `kvf_block_copy`, a warp per block of one plane (16-byte
    /// vectors where source and destination allow, the byte path
    /// otherwise). `grid` caps the grid (0: one warp per block and plane;
    /// the kernel strides over the rest). Returns the grid used. The
    /// context must be bound.
    ///
    /// # Safety
    /// `stream` is a live stream of this GPU; both id arrays hold
    /// `npairs` ids readable by the device until the launch completes;
    /// every id was range-checked against its pool's layout.
    ///
    /// # Errors
    /// The driver's launch error.
    pub unsafe fn launch_block_copy(
        &self,
        stream: sys::CUstream,
        a: &BlockCopy,
        grid: u32,
    ) -> Result<u32, CudaError> {
        let k = &self.block_copy;
        let threads = 256u32.min(k.info.max_threads.max(32) as u32) / 32 * 32;
        let warps = u64::from(threads / 32);
        let total = u64::from(a.npairs) * u64::from(a.nplanes);
        let mut g = total.div_ceil(warps).clamp(1, i32::MAX as u64) as u32;
        if grid != 0 {
            g = g.min(grid);
        }
        let (mut sb, mut db, mut sids, mut dids) = (a.src_base, a.dst_base, a.src_ids, a.dst_ids);
        let (mut npairs, mut np) = (a.npairs, a.nplanes);
        let (mut sps, mut dps, mut bb) = (a.src_plane_stride, a.dst_plane_stride, a.block_bytes);
        let mut params: [*mut c_void; 9] = [
            (&mut sb as *mut u64).cast(),
            (&mut db as *mut u64).cast(),
            (&mut sids as *mut u64).cast(),
            (&mut dids as *mut u64).cast(),
            (&mut npairs as *mut u32).cast(),
            (&mut np as *mut u32).cast(),
            (&mut sps as *mut u64).cast(),
            (&mut dps as *mut u64).cast(),
            (&mut bb as *mut u64).cast(),
        ];
        // SAFETY: the parameters match `kvf_block_copy`; the caller
        // guarantees the stream and the id arrays.
        drv("cuLaunchKernel", unsafe {
            result::launch_kernel(k.f, (g, 1, 1), (threads, 1, 1), 0, stream, &mut params)
        })?;
        Ok(g)
    }

    /// Enqueues `kvf_gather_srcs` on `stream`: `len` bytes from source
    /// `i` of the `n` addresses (u64) at device address `srcs` to `region
    /// + i * stride` (bytes), a warp per piece. The context must be bound.
    ///
    /// # Safety
    /// `stream` is a live stream of this GPU; `srcs` holds `n` addresses
    /// readable by the device until the launch completes, each readable
    /// for `len` bytes; the region holds `(n - 1) * stride + len` bytes.
    ///
    /// # Errors
    /// The driver's launch error.
    pub unsafe fn launch_gather_srcs(
        &self,
        stream: sys::CUstream,
        srcs: u64,
        n: u32,
        len: u64,
        stride: u64,
        region: u64,
    ) -> Result<(), CudaError> {
        // SAFETY: as this function's contract.
        unsafe { self.launch_pieces(&self.gather_srcs, stream, srcs, n, len, stride, region) }
    }

    /// Enqueues `kvf_scatter_dsts` on `stream`: `region + i * stride` to
    /// destination `i` of the `n` addresses (u64) at device address
    /// `dsts`, `len` bytes each, a warp per piece. The context must be
    /// bound.
    ///
    /// # Safety
    /// `stream` is a live stream of this GPU; `dsts` holds `n` addresses
    /// readable by the device until the launch completes, each writable
    /// for `len` bytes; the region holds `(n - 1) * stride + len` bytes.
    ///
    /// # Errors
    /// The driver's launch error.
    pub unsafe fn launch_scatter_dsts(
        &self,
        stream: sys::CUstream,
        dsts: u64,
        n: u32,
        len: u64,
        stride: u64,
        region: u64,
    ) -> Result<(), CudaError> {
        // SAFETY: as this function's contract.
        unsafe { self.launch_pieces(&self.scatter_dsts, stream, dsts, n, len, stride, region) }
    }

    /// Enqueues `kvf_scatter_blocks` (`dir` Scatter: piece `w < n` from
    /// `region + w * stride` to its derived address) or
    /// `kvf_gather_blocks` (Gather: from its derived address to `region +
    /// w * stride`) on `stream`, a warp a piece; the derived address of
    /// piece `w` is `(k / nblocks) * plane_stride + offsets[k % nblocks]`,
    /// `k = first + w` ([`BlockPieces`]).
    ///
    /// # Safety
    /// `p.offsets` must be a device-readable table of `p.nblocks ≥ 1` u64
    /// that stays valid until the launch completes; every derived address
    /// and every piece of the region must be valid device memory of this
    /// context for `p.len` bytes (a receiver validated its destinations; a
    /// sender's planes were found in its own descriptors).
    pub unsafe fn launch_blocks(
        &self,
        dir: Direction,
        stream: sys::CUstream,
        p: &BlockPieces,
    ) -> Result<(), CudaError> {
        let k = match dir {
            Direction::Gather => &self.gather_blocks,
            Direction::Scatter => &self.scatter_blocks,
        };
        let BlockPieces {
            offsets,
            nblocks,
            first,
            n,
            plane_stride,
            len,
            stride,
            region,
        } = *p;
        let threads = 256u32.min(k.info.max_threads.max(32) as u32) / 32 * 32;
        let g = u64::from(n)
            .div_ceil(u64::from(threads / 32))
            .clamp(1, i32::MAX as u64) as u32;
        let (mut o, mut nb, mut f, mut cnt, mut ps, mut l, mut st, mut r) = (
            offsets,
            nblocks,
            first,
            n,
            plane_stride,
            len,
            stride,
            region,
        );
        let mut params: [*mut c_void; 8] = [
            (&mut o as *mut u64).cast(),
            (&mut nb as *mut u32).cast(),
            (&mut f as *mut u64).cast(),
            (&mut cnt as *mut u32).cast(),
            (&mut ps as *mut u64).cast(),
            (&mut l as *mut u64).cast(),
            (&mut st as *mut u64).cast(),
            (&mut r as *mut u64).cast(),
        ];
        // SAFETY: the parameters match `kvf_scatter_blocks` and
        // `kvf_gather_blocks`; the caller guarantees the stream, the
        // table, the region and the derived addresses.
        drv("cuLaunchKernel", unsafe {
            result::launch_kernel(k.f, (g, 1, 1), (threads, 1, 1), 0, stream, &mut params)
        })?;
        Ok(())
    }

    /// Launches one of the piece kernels (`kvf_gather_srcs`,
    /// `kvf_scatter_dsts`: same parameters), a warp per piece.
    ///
    /// # Safety
    /// As [`CudaGpu::launch_gather_srcs`] / [`CudaGpu::launch_scatter_dsts`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_pieces(
        &self,
        k: &KernelFn,
        stream: sys::CUstream,
        table: u64,
        n: u32,
        len: u64,
        stride: u64,
        region: u64,
    ) -> Result<(), CudaError> {
        let descs = table;
        let threads = 256u32.min(k.info.max_threads.max(32) as u32) / 32 * 32;
        let g = u64::from(n)
            .div_ceil(u64::from(threads / 32))
            .clamp(1, i32::MAX as u64) as u32;
        let (mut d, mut n, mut l, mut st, mut r) = (descs, n, len, stride, region);
        let mut params: [*mut c_void; 5] = [
            (&mut d as *mut u64).cast(),
            (&mut n as *mut u32).cast(),
            (&mut l as *mut u64).cast(),
            (&mut st as *mut u64).cast(),
            (&mut r as *mut u64).cast(),
        ];
        // SAFETY: the parameters match `kvf_gather_srcs` and
        // `kvf_scatter_dsts`; the caller guarantees the stream, the table
        // and the region.
        drv("cuLaunchKernel", unsafe {
            result::launch_kernel(k.f, (g, 1, 1), (threads, 1, 1), 0, stream, &mut params)
        })?;
        Ok(())
    }
}

/// One launch of the block kernels ([`CudaGpu::launch_blocks`]): `n`
/// pieces of `len` bytes, piece `w` at `region + w * stride` and at the
/// derived address `(k / nblocks) * plane_stride + offsets[k % nblocks]`,
/// `k = first + w` (the request's piece index).
#[derive(Clone, Copy, Debug)]
pub struct BlockPieces {
    /// Device address of the `nblocks` first-plane addresses (u64 each).
    pub offsets: u64,
    /// Blocks a plane (≥ 1).
    pub nblocks: u32,
    /// The first piece's index in the request.
    pub first: u64,
    /// Pieces.
    pub n: u32,
    /// Bytes between planes.
    pub plane_stride: u64,
    /// Bytes a piece.
    pub len: u64,
    /// Region bytes between pieces (≥ `len`).
    pub stride: u64,
    /// Region address of piece 0.
    pub region: u64,
}

/// One direct block copy: block `src_ids[i]` → `dst_ids[i]` of every plane
/// (layer × K/V) between two pools. Plane `q` of a pool starts at
/// `base + q * plane_stride`; a block is `block_bytes`. The id arrays are
/// device addresses (device memory, or mapped pinned host memory).
#[derive(Clone, Copy, Debug)]
pub struct BlockCopy {
    /// Source pool base.
    pub src_base: u64,
    /// Destination pool base.
    pub dst_base: u64,
    /// Device address of `npairs` source block ids (u32).
    pub src_ids: u64,
    /// Device address of `npairs` destination block ids (u32).
    pub dst_ids: u64,
    /// Block pairs.
    pub npairs: u32,
    /// Planes.
    pub nplanes: u32,
    /// Bytes between source planes.
    pub src_plane_stride: u64,
    /// Bytes between destination planes.
    pub dst_plane_stride: u64,
    /// Bytes of one block of one plane.
    pub block_bytes: u64,
}

impl BlockCopy {
    /// Bytes the copy moves.
    pub fn bytes(&self) -> u64 {
        u64::from(self.npairs) * u64::from(self.nplanes) * self.block_bytes
    }
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // SAFETY: loaded in open, unloaded once.
            if let Err(e) = unsafe { result::module::unload(self.module) } {
                tracing::warn!(error = %driver_msg(&e), "cuModuleUnload failed");
            }
        }
    }
}

/// Device memory another process exported with `cudaIpcGetMemHandle`
/// (an engine's KV pool), opened in this process on `gpu`'s context
/// (issue 12). The mapping is closed on drop. Per DESIGN.md it cannot be
/// re-exported: NIXL/UCX `cuda_ipc` cannot write into it, only this
/// process's kernels read and write it (bounce's gather and scatter).
pub struct IpcMapping {
    gpu: Arc<CudaGpu>,
    base: u64,
    offset: u64,
    len: u64,
}

// SAFETY: a device address valid in the context; closed once, on drop,
// with the context bound.
unsafe impl Send for IpcMapping {}
unsafe impl Sync for IpcMapping {}

impl std::fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMapping")
            .field("base", &format_args!("{:#x}", self.base))
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl IpcMapping {
    /// Opens `handle` (64 bytes of `cudaIpcMemHandle_t`) on `gpu` and
    /// returns the mapping of `len` bytes from `offset` inside the exported
    /// allocation (`cuIpcOpenMemHandle`, lazy peer access).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a handle that is not 64 bytes, a zero
    /// length, a pool past the exported allocation, or memory on another
    /// GPU than `gpu` (it would be mapped through peer access: an engine on
    /// another GPU than the agent's, whatever UUID it named); the driver's
    /// error when the handle does not open (exporter gone, same process).
    pub fn open(
        gpu: &Arc<CudaGpu>,
        handle: &[u8],
        offset: u64,
        len: u64,
    ) -> Result<Self, CudaError> {
        if handle.len() != 64 {
            return Err(CudaError::Invalid(format!(
                "CUDA IPC handle of {} bytes: expected 64",
                handle.len()
            )));
        }
        if len == 0 {
            return Err(CudaError::Invalid("CUDA IPC pool of 0 bytes".into()));
        }
        gpu.bind()?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as std::ffi::c_char;
        }
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; context bound.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
        })?;
        // The engine names offset and length; the exported allocation's
        // real extent is asked from the driver, so a pool can never reach
        // past it (the kernels and scatters would write outside it).
        let mut range_base: sys::CUdeviceptr = 0;
        let mut range_len: usize = 0;
        // SAFETY: out-pointers to locals; `base` is a live mapping.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut range_base, &mut range_len, base) };
        let end = offset.checked_add(len);
        let fits = r == sys::CUresult::CUDA_SUCCESS
            && end.is_some_and(|e| range_base == base && e <= range_len as u64);
        if !fits {
            // SAFETY: opened above; closed once.
            unsafe { sys::cuIpcCloseMemHandle(base) };
            return Err(CudaError::Invalid(format!(
                "CUDA IPC pool of {len} bytes at offset {offset} does not fit the exported \
                 allocation of {range_len} bytes (driver: {r:?})"
            )));
        }
        // Which GPU the memory is on (in this process's ordinals): only
        // the agent's own; unknown (the query failed) is let through.
        let mut on: std::ffi::c_int = -1;
        // SAFETY: out-pointer to a local c_int, the size this attribute
        // writes; `base` is a live mapping.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&mut on as *mut std::ffi::c_int).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                base,
            )
        };
        if r == sys::CUresult::CUDA_SUCCESS && on >= 0 && on as usize != gpu.info.ordinal {
            // SAFETY: opened above; closed once.
            unsafe { sys::cuIpcCloseMemHandle(base) };
            return Err(CudaError::Invalid(format!(
                "the CUDA IPC pool is on CUDA device {on} of this agent's process, its arena on device {}: \
                 the engine runs on another GPU than this agent's (attach to the agent of that GPU)",
                gpu.info.ordinal
            )));
        }
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(driver = ?r, "cuPointerGetAttribute(DEVICE_ORDINAL) failed: the pool's GPU is not checked");
        }
        Ok(Self {
            gpu: gpu.clone(),
            base,
            offset,
            len,
        })
    }

    /// Device address of the pool's first byte (allocation base + offset).
    pub fn addr(&self) -> u64 {
        self.base + self.offset
    }

    /// Pool length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false (`open` refuses 0 bytes).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The GPU it is open on.
    pub fn gpu(&self) -> &Arc<CudaGpu> {
        &self.gpu
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: `base` came from cuIpcOpenMemHandle; closed once.
            let r = unsafe { sys::cuIpcCloseMemHandle(self.base) };
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(?r, "cuIpcCloseMemHandle failed");
            }
        }
    }
}

/// Device memory from `cuMemAlloc` (seed §4 `BounceArena` on the GPU):
/// allocated once at start-up and registered with the transfer engine as
/// [`MemKind::Vram`] ([`CudaArena::mem_desc`]); regions are byte offsets.
/// Also used for test/bench buffers.
pub struct CudaArena {
    gpu: Arc<CudaGpu>,
    ptr: u64,
    len: usize,
}

impl std::fmt::Debug for CudaArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaArena")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl CudaArena {
    /// Allocates `len` bytes of device memory (256-byte aligned by the
    /// driver), zero-filled.
    pub fn new(gpu: &Arc<CudaGpu>, len: usize) -> Result<Self, CudaError> {
        if len == 0 {
            return Err(CudaError::Invalid("arena size must be > 0".into()));
        }
        gpu.bind()?;
        // SAFETY: context bound; len > 0.
        let ptr = drv("cuMemAlloc", unsafe { result::malloc_sync(len) })?;
        let arena = Self {
            gpu: gpu.clone(),
            ptr,
            len,
        };
        // SAFETY: ptr..ptr+len was just allocated.
        drv("cuMemsetD8", unsafe { result::memset_d8_sync(ptr, 0, len) })?;
        Ok(arena)
    }

    /// Device address of the first byte.
    pub fn base_addr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: an arena has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Address of `offset`, or `None` past the end.
    pub fn at(&self, offset: u64) -> Option<u64> {
        (offset < self.len as u64).then(|| self.ptr + offset)
    }

    /// The memory kind to register it as (VRAM).
    pub fn kind(&self) -> MemKind {
        MemKind::Vram
    }

    /// The descriptor to register it with NIXL (VRAM on this GPU).
    pub fn mem_desc(&self) -> MemDesc {
        MemDesc {
            addr: self.ptr,
            len: self.len as u64,
            device_id: self.gpu.info.ordinal as u64,
        }
    }

    /// Copies host bytes to `offset` (synchronous; tests and benches).
    pub fn upload(&self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        self.range_check(offset, data.len())?;
        self.gpu.bind()?;
        // SAFETY: range checked against the allocation.
        drv("cuMemcpyHtoD", unsafe {
            result::memcpy_htod_sync(self.ptr + offset as u64, data)
        })
    }

    /// Copies bytes at `offset` to host memory (synchronous).
    pub fn download(&self, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        self.range_check(offset, out.len())?;
        self.gpu.bind()?;
        // SAFETY: range checked against the allocation.
        drv("cuMemcpyDtoH", unsafe {
            result::memcpy_dtoh_sync(out, self.ptr + offset as u64)
        })
    }

    /// Sets every byte to zero and waits for it (tests and benches).
    /// `cuMemsetD8` may return before the memset ran and is ordered only
    /// with the legacy stream, not with the non-blocking streams the
    /// kernels use, so the context is synchronized before returning.
    pub fn zero(&self) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: the whole allocation.
        drv("cuMemsetD8", unsafe {
            result::memset_d8_sync(self.ptr, 0, self.len)
        })?;
        drv("cuCtxSynchronize", result::ctx::synchronize())
    }

    /// The GPU it lives on.
    pub fn gpu(&self) -> &Arc<CudaGpu> {
        &self.gpu
    }

    fn range_check(&self, offset: usize, len: usize) -> Result<(), CudaError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(CudaError::Invalid(format!(
                "range {offset}+{len} outside arena of {} bytes",
                self.len
            )));
        }
        Ok(())
    }
}

impl Drop for CudaArena {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated in new, freed once.
            if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                tracing::warn!(error = %driver_msg(&e), "cuMemFree failed");
            }
        }
    }
}

/// One scatter run as the kernel reads it (`struct kvf_run` in
/// `kernels/gather_scatter.cu`; 48 bytes, `#[repr(C)]`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuRun {
    /// Offset of the first segment inside the region.
    pub region_offset: u64,
    /// User address of the first segment.
    pub addr: u64,
    /// Bytes per segment.
    pub segment_len: u64,
    /// Region distance between segments.
    pub region_stride: u64,
    /// User distance between segments.
    pub addr_stride: u64,
    /// Segments.
    pub count: u32,
    /// Zero.
    pub pad: u32,
}

impl From<&ScatterRun> for GpuRun {
    fn from(r: &ScatterRun) -> Self {
        Self {
            region_offset: r.region_offset,
            addr: r.addr,
            segment_len: r.segment_len,
            region_stride: r.region_stride,
            addr_stride: r.addr_stride,
            count: r.count,
            pad: 0,
        }
    }
}

/// One warp's share of a plan (`struct kvf_task`; 16 bytes): `seg_count`
/// whole segments of run `run` from `seg_begin`, or piece `piece` of
/// segment `seg_begin` when the run's segments exceed the piece size.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuTask {
    /// Index into the run array.
    pub run: u32,
    /// First segment.
    pub seg_begin: u32,
    /// Segments (1 for a piece).
    pub seg_count: u32,
    /// Piece of the segment (0 when whole segments).
    pub piece: u32,
}

const _: () = assert!(std::mem::size_of::<GpuRun>() == 48);
// `ScatterRun` is laid out like `GpuRun` (both `#[repr(C)]`), so a run list
// whose runs are one task each goes to the kernel as is (`prepare`).
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ScatterRun>() == size_of::<GpuRun>());
    assert!(offset_of!(ScatterRun, region_offset) == offset_of!(GpuRun, region_offset));
    assert!(offset_of!(ScatterRun, addr) == offset_of!(GpuRun, addr));
    assert!(offset_of!(ScatterRun, segment_len) == offset_of!(GpuRun, segment_len));
    assert!(offset_of!(ScatterRun, region_stride) == offset_of!(GpuRun, region_stride));
    assert!(offset_of!(ScatterRun, addr_stride) == offset_of!(GpuRun, addr_stride));
    assert!(offset_of!(ScatterRun, count) == offset_of!(GpuRun, count));
};

/// When every run of `runs` is exactly one kernel task (non-empty, whole
/// segments of at most `piece_bytes`, all of them in one task) — the usual
/// case for KV blocks of a few KiB — the bytes the plan moves; else `None`
/// (the plan needs [`build_plan`]).
pub fn one_task_per_run(runs: &[ScatterRun], piece_bytes: u64) -> Option<u64> {
    if u32::try_from(runs.len()).is_err() {
        return None;
    }
    let piece_bytes = piece_bytes.max(1);
    let mut bytes = 0u64;
    for r in runs {
        if r.count == 0
            || r.segment_len == 0
            || r.segment_len > piece_bytes
            || u64::from(r.count) > piece_bytes / r.segment_len
        {
            return None;
        }
        bytes = bytes.saturating_add(r.total_bytes());
    }
    Some(bytes)
}

/// The run list a plan is written from.
enum PlanRuns<'a> {
    /// Built by [`build_plan`].
    Built(&'a [GpuRun]),
    /// The caller's runs, one task each (same layout as [`GpuRun`]).
    AsIs(&'a [ScatterRun]),
}
const _: () = assert!(std::mem::size_of::<GpuTask>() == 16);

/// Splits `runs` (zero-length ones dropped) into kernel tasks of about
/// `piece_bytes`; pushes the kept runs to `out_runs` and the tasks to
/// `out_tasks`. Returns the bytes the plan moves.
pub fn build_plan(
    runs: &[ScatterRun],
    piece_bytes: u64,
    out_runs: &mut Vec<GpuRun>,
    out_tasks: &mut Vec<GpuTask>,
) -> Result<u64, CudaError> {
    let piece_bytes = piece_bytes.max(1);
    let mut bytes = 0u64;
    for r in runs {
        if r.count == 0 || r.segment_len == 0 {
            continue;
        }
        let ri = u32::try_from(out_runs.len())
            .map_err(|_| CudaError::Invalid("more than 2^32 runs".into()))?;
        out_runs.push(GpuRun::from(r));
        bytes = bytes.saturating_add(r.total_bytes());
        if r.segment_len > piece_bytes {
            let pieces = r.segment_len.div_ceil(piece_bytes);
            let pieces = u32::try_from(pieces)
                .map_err(|_| CudaError::Invalid("segment of more than 2^32 pieces".into()))?;
            for s in 0..r.count {
                for p in 0..pieces {
                    out_tasks.push(GpuTask {
                        run: ri,
                        seg_begin: s,
                        seg_count: 1,
                        piece: p,
                    });
                }
            }
        } else {
            let per = u32::try_from((piece_bytes / r.segment_len).max(1)).unwrap_or(u32::MAX);
            let mut s = 0u32;
            while s < r.count {
                let n = per.min(r.count - s);
                out_tasks.push(GpuTask {
                    run: ri,
                    seg_begin: s,
                    seg_count: n,
                    piece: 0,
                });
                s += n;
            }
        }
    }
    if u32::try_from(out_tasks.len()).is_err() {
        return Err(CudaError::Invalid("more than 2^32 kernel tasks".into()));
    }
    Ok(bytes)
}

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// User memory → region.
    Gather,
    /// Region → user memory.
    Scatter,
}

/// Where the kernel reads its plan from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanSource {
    /// Mapped pinned host memory, read by the kernel over the bus
    /// (zero-copy; the default: no upload before the launch).
    PinnedHost,
    /// A device buffer the plan is copied into on the same stream first.
    Device,
}

/// How a plan is executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyPath {
    /// The batched gather/scatter kernel (production).
    Kernel,
    /// One `cuMemcpyDtoDAsync` per segment (comparison).
    PerSegmentMemcpy,
    /// The driver's batched memcpy, `cuMemcpyBatchAsync` (comparison).
    BatchedMemcpy,
}

/// [`CudaCopyEngine`] settings.
#[derive(Clone, Copy, Debug)]
pub struct CudaCopyConfig {
    /// Execution contexts (streams) in the pool; size it ≥ copy workers.
    pub streams: usize,
    /// Threads per block (a multiple of 32, 32..=1024; ≤ 256 with
    /// `high_occupancy`). Each warp copies one task at a time.
    pub threads_per_block: u32,
    /// Use the kernel build capped at 32 registers (full occupancy).
    pub high_occupancy: bool,
    /// Bytes per task (see [`DEFAULT_PIECE_BYTES`]).
    pub piece_bytes: u64,
    /// Blocks per multiprocessor of the persistent grid, capped at what is
    /// resident (0: one warp per task, no persistence).
    pub blocks_per_sm: u32,
    /// Where the kernel reads its plan.
    pub plan_source: PlanSource,
    /// Which path executes a plan.
    pub path: CopyPath,
}

impl Default for CudaCopyConfig {
    fn default() -> Self {
        Self {
            streams: 4,
            threads_per_block: 256,
            high_occupancy: false,
            piece_bytes: DEFAULT_PIECE_BYTES,
            blocks_per_sm: 0,
            plan_source: PlanSource::PinnedHost,
            path: CopyPath::Kernel,
        }
    }
}

type BatchFn = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;

/// Looks up `cuMemcpyBatchAsync_v2` in the loaded driver (CUDA 13 drivers).
fn batch_fn() -> Option<BatchFn> {
    // SAFETY: the driver library is loaded (probe passed); the symbol's
    // signature is the CUDA 13 `cuMemcpyBatchAsync` one.
    unsafe {
        sys::culib()
            .get::<BatchFn>(b"cuMemcpyBatchAsync_v2")
            .ok()
            .map(|s| *s)
    }
}

/// A plan written into an [`ExecCtx`], ready to launch (possibly many
/// times, e.g. in a benchmark).
#[derive(Clone, Copy, Debug)]
pub struct PreparedPlan {
    runs_ptr: u64,
    tasks_ptr: u64,
    ntasks: u32,
    nruns: u32,
    region_base: u64,
    to_region: i32,
    /// Bytes the plan moves.
    pub bytes: u64,
}

impl PreparedPlan {
    /// Kernel tasks (0: nothing to copy).
    pub fn tasks(&self) -> u32 {
        self.ntasks
    }
    /// Runs after dropping zero-length ones.
    pub fn runs(&self) -> u32 {
        self.nruns
    }
    /// Whether the kernel reads a task table (false: one task per run).
    pub fn has_task_table(&self) -> bool {
        self.tasks_ptr != 0
    }
}

/// One execution context (seed §4 `ExecCtx`): a non-blocking stream, a
/// completion event, a mapped pinned host plan buffer and a device plan
/// buffer (both grown on demand). Borrowed from the pool for one copy.
pub struct ExecCtx {
    gpu: Arc<CudaGpu>,
    stream: sys::CUstream,
    done: sys::CUevent,
    pinned: *mut u8,
    pinned_dev: u64,
    pinned_cap: usize,
    dplan: u64,
    dplan_cap: usize,
    /// The plan buffers may still be read by earlier work on the stream.
    busy: bool,
    /// The two completion marks of a batched gather (after its first and
    /// after its last item: [`CudaCopyEngine::run_gather_batch`]),
    /// created on first use.
    marks: Vec<sys::CUevent>,
    runs: Vec<GpuRun>,
    tasks: Vec<GpuTask>,
}

// SAFETY: the raw handles are owned by this context and only used by the
// thread that currently borrows it from the pool.
unsafe impl Send for ExecCtx {}

impl std::fmt::Debug for ExecCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecCtx")
            .field("pinned_cap", &self.pinned_cap)
            .field("dplan_cap", &self.dplan_cap)
            .finish()
    }
}

const CU_MEMHOSTALLOC_PORTABLE: u32 = 0x01;
const CU_MEMHOSTALLOC_DEVICEMAP: u32 = 0x02;
const CU_MEMHOSTALLOC_WRITECOMBINED: u32 = 0x04;

impl ExecCtx {
    /// Creates a stream, an event and plan buffers of `plan_bytes`.
    pub fn new(gpu: &Arc<CudaGpu>, plan_bytes: usize) -> Result<Self, CudaError> {
        gpu.bind()?;
        let stream = drv(
            "cuStreamCreate",
            result::stream::create(result::stream::StreamKind::NonBlocking),
        )?;
        let done = match drv(
            "cuEventCreate",
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING),
        ) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: created above.
                let _ = unsafe { result::stream::destroy(stream) };
                return Err(e);
            }
        };
        let mut ctx = Self {
            gpu: gpu.clone(),
            stream,
            done,
            pinned: std::ptr::null_mut(),
            pinned_dev: 0,
            pinned_cap: 0,
            dplan: 0,
            dplan_cap: 0,
            busy: false,
            marks: Vec::new(),
            runs: Vec::new(),
            tasks: Vec::new(),
        };
        ctx.ensure_capacity(plan_bytes.max(4096))?;
        Ok(ctx)
    }

    /// The stream (for events around work in benchmarks).
    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    /// Waits for earlier work on this context's stream.
    pub fn synchronize(&mut self) -> Result<(), CudaError> {
        // SAFETY: live stream.
        drv("cuStreamSynchronize", unsafe {
            result::stream::synchronize(self.stream)
        })?;
        self.busy = false;
        Ok(())
    }

    /// Records the completion event after the work enqueued so far.
    pub fn record_done(&mut self) -> Result<(), CudaError> {
        // SAFETY: live event and stream.
        drv("cuEventRecord", unsafe {
            result::event::record(self.done, self.stream)
        })
    }

    /// Makes sure at least `n` mark events exist (created without timing).
    fn ensure_marks(&mut self, n: usize) -> Result<(), CudaError> {
        while self.marks.len() < n {
            let e = drv(
                "cuEventCreate",
                result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING),
            )?;
            self.marks.push(e);
        }
        Ok(())
    }

    /// Records mark `i` (< the marks made by `ensure_marks`) after the
    /// work enqueued so far.
    fn record_mark(&mut self, i: usize) -> Result<(), CudaError> {
        // SAFETY: live event (i checked by indexing) and stream.
        drv("cuEventRecord", unsafe {
            result::event::record(self.marks[i], self.stream)
        })
    }

    /// Blocks until the work before mark `i` finished.
    fn wait_mark(&self, i: usize) -> Result<(), CudaError> {
        // SAFETY: live event.
        drv("cuEventSynchronize", unsafe {
            result::event::synchronize(self.marks[i])
        })
    }

    /// Whether the work before the last [`ExecCtx::record_done`] finished
    /// (never blocks: for the reactor's completion polling).
    pub fn query_done(&self) -> Result<bool, CudaError> {
        // SAFETY: live event.
        let r = unsafe { sys::cuEventQuery(self.done) };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|()| false),
        }
    }

    /// Blocks until the work before the last [`ExecCtx::record_done`]
    /// finished.
    pub fn wait_done(&mut self) -> Result<(), CudaError> {
        // SAFETY: live event.
        drv("cuEventSynchronize", unsafe {
            result::event::synchronize(self.done)
        })?;
        self.busy = false;
        Ok(())
    }

    fn ensure_capacity(&mut self, bytes: usize) -> Result<(), CudaError> {
        if bytes <= self.pinned_cap && bytes <= self.dplan_cap {
            return Ok(());
        }
        if self.busy {
            self.synchronize()?;
        }
        let cap = bytes.next_power_of_two();
        if cap > self.pinned_cap {
            self.free_pinned();
            // SAFETY: context bound by the caller chain; cap > 0.
            let p = drv("cuMemHostAlloc", unsafe {
                result::malloc_host(
                    cap,
                    CU_MEMHOSTALLOC_PORTABLE
                        | CU_MEMHOSTALLOC_DEVICEMAP
                        | CU_MEMHOSTALLOC_WRITECOMBINED,
                )
            })?;
            let mut dev: sys::CUdeviceptr = 0;
            // SAFETY: p is a mapped pinned allocation.
            if let Err(e) = check("cuMemHostGetDevicePointer", unsafe {
                sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0)
            }) {
                // SAFETY: allocated above.
                let _ = unsafe { result::free_host(p) };
                return Err(e);
            }
            self.pinned = p.cast();
            self.pinned_dev = dev;
            self.pinned_cap = cap;
        }
        if cap > self.dplan_cap {
            self.free_dplan();
            // SAFETY: context bound; cap > 0.
            self.dplan = drv("cuMemAlloc", unsafe { result::malloc_sync(cap) })?;
            self.dplan_cap = cap;
        }
        Ok(())
    }

    fn free_pinned(&mut self) {
        if !self.pinned.is_null() {
            // SAFETY: allocated by malloc_host, freed once.
            if let Err(e) = unsafe { result::free_host(self.pinned.cast()) } {
                tracing::warn!(error = %driver_msg(&e), "cuMemFreeHost failed");
            }
            self.pinned = std::ptr::null_mut();
            self.pinned_cap = 0;
        }
    }

    fn free_dplan(&mut self) {
        if self.dplan != 0 {
            // SAFETY: allocated by malloc_sync, freed once.
            if let Err(e) = unsafe { result::free_sync(self.dplan) } {
                tracing::warn!(error = %driver_msg(&e), "cuMemFree failed");
            }
            self.dplan = 0;
            self.dplan_cap = 0;
        }
    }

    /// Writes the kernel plan for `runs` into the pinned buffer (and, for
    /// [`PlanSource::Device`], enqueues its upload). Waits first for any
    /// earlier work that may still read the buffers.
    pub fn prepare(
        &mut self,
        cfg: &CudaCopyConfig,
        dir: Direction,
        region_addr: u64,
        runs: &[ScatterRun],
    ) -> Result<PreparedPlan, CudaError> {
        self.gpu.bind()?;
        if self.busy {
            self.synchronize()?;
        }
        if let Some(bytes) = one_task_per_run(runs, cfg.piece_bytes) {
            // No plan to build: the kernel reads the runs as they are.
            return self.write_plan(cfg, dir, region_addr, PlanRuns::AsIs(runs), &[], bytes);
        }
        let mut r = std::mem::take(&mut self.runs);
        let mut t = std::mem::take(&mut self.tasks);
        r.clear();
        t.clear();
        let built = build_plan(runs, cfg.piece_bytes, &mut r, &mut t);
        let out = built.and_then(|bytes| {
            self.write_plan(cfg, dir, region_addr, PlanRuns::Built(&r), &t, bytes)
        });
        self.runs = r;
        self.tasks = t;
        out
    }

    fn write_plan(
        &mut self,
        cfg: &CudaCopyConfig,
        dir: Direction,
        region_addr: u64,
        runs: PlanRuns<'_>,
        tasks: &[GpuTask],
        bytes: u64,
    ) -> Result<PreparedPlan, CudaError> {
        let nruns = match runs {
            PlanRuns::Built(r) => r.len(),
            PlanRuns::AsIs(r) => r.len(),
        };
        // One task per run: the kernel needs no task table.
        let identity = match runs {
            PlanRuns::Built(_) => tasks.len() == nruns,
            PlanRuns::AsIs(_) => true,
        };
        let runs_bytes = nruns * std::mem::size_of::<GpuRun>();
        let tasks_bytes = if identity {
            0
        } else {
            std::mem::size_of_val(tasks)
        };
        let total = runs_bytes + tasks_bytes;
        self.ensure_capacity(total)?;
        // SAFETY: the buffer holds `total` bytes, is not read by any pending
        // work (synchronised above), and runs/tasks are plain repr(C) data.
        unsafe {
            match runs {
                PlanRuns::Built(r) => {
                    std::ptr::copy_nonoverlapping(r.as_ptr(), self.pinned.cast::<GpuRun>(), nruns)
                }
                // Same layout as GpuRun (asserted above); the copy is
                // untyped, so the padding word goes along as it is (the
                // kernel loads it with `count` and ignores it). The buffer
                // is page-aligned.
                PlanRuns::AsIs(r) => std::ptr::copy_nonoverlapping(
                    r.as_ptr(),
                    self.pinned.cast::<ScatterRun>(),
                    nruns,
                ),
            }
            if !identity {
                std::ptr::copy_nonoverlapping(
                    tasks.as_ptr().cast::<u8>(),
                    self.pinned.add(runs_bytes),
                    tasks_bytes,
                );
            }
        }
        let base = match cfg.plan_source {
            PlanSource::PinnedHost => self.pinned_dev,
            PlanSource::Device => {
                if total > 0 {
                    // SAFETY: both buffers hold `total` bytes.
                    check("cuMemcpyHtoDAsync", unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            self.dplan,
                            self.pinned as *const c_void,
                            total,
                            self.stream,
                        )
                    })?;
                    self.busy = true;
                }
                self.dplan
            }
        };
        Ok(PreparedPlan {
            runs_ptr: base,
            tasks_ptr: if identity {
                0
            } else {
                base + runs_bytes as u64
            },
            ntasks: if identity {
                nruns as u32
            } else {
                tasks.len() as u32
            },
            nruns: nruns as u32,
            region_base: region_addr,
            to_region: i32::from(dir == Direction::Gather),
            bytes,
        })
    }

    /// Enqueues the kernel for a prepared plan on this context's stream.
    pub fn launch(&mut self, cfg: &CudaCopyConfig, plan: &PreparedPlan) -> Result<(), CudaError> {
        if plan.ntasks == 0 {
            return Ok(());
        }
        let threads = cfg.threads_per_block;
        let k = if cfg.high_occupancy {
            &self.gpu.kernel_occ
        } else {
            &self.gpu.kernel
        };
        if !(32..=1024).contains(&threads)
            || threads % 32 != 0
            || threads > k.info.max_threads.max(0) as u32
        {
            return Err(CudaError::Invalid(format!(
                "threads_per_block {threads} is not a multiple of 32 in 32..={} for {}",
                k.info.max_threads, k.info.name
            )));
        }
        // One warp per task.
        let warps = threads / 32;
        let mut grid = plan.ntasks.div_ceil(warps);
        if cfg.blocks_per_sm > 0 {
            // A persistent grid: no more blocks than can be resident.
            let resident = k
                .info
                .max_blocks_per_sm
                .get((warps - 1) as usize)
                .copied()
                .unwrap_or(1)
                .max(1) as u32;
            let per_sm = cfg.blocks_per_sm.min(resident);
            let cap = (self.gpu.info.sm_count.max(1) as u32).saturating_mul(per_sm);
            grid = grid.min(cap);
        }
        let grid = grid.min(i32::MAX as u32);
        let mut runs_ptr = plan.runs_ptr;
        let mut tasks_ptr = plan.tasks_ptr;
        let mut ntasks = plan.ntasks;
        let mut region_base = plan.region_base;
        let mut to_region = plan.to_region;
        let mut piece_bytes = cfg.piece_bytes.max(1);
        let mut params: [*mut c_void; 6] = [
            (&mut runs_ptr as *mut u64).cast(),
            (&mut tasks_ptr as *mut u64).cast(),
            (&mut ntasks as *mut u32).cast(),
            (&mut region_base as *mut u64).cast(),
            (&mut to_region as *mut i32).cast(),
            (&mut piece_bytes as *mut u64).cast(),
        ];
        // SAFETY: the kernel's parameters match `kvf_gather_scatter`; plan
        // buffers stay valid until the context is synchronised (`busy`).
        drv("cuLaunchKernel", unsafe {
            result::launch_kernel(
                k.f,
                (grid, 1, 1),
                (threads, 1, 1),
                0,
                self.stream,
                &mut params,
            )
        })?;
        self.busy = true;
        Ok(())
    }

    /// Enqueues one `cuMemcpyDtoDAsync` per segment (comparison path).
    pub fn memcpy_per_segment(
        &mut self,
        dir: Direction,
        region_addr: u64,
        runs: &[ScatterRun],
    ) -> Result<(), CudaError> {
        self.gpu.bind()?;
        for run in runs {
            for (off, addr, len) in run.segments() {
                if len == 0 {
                    continue;
                }
                let region = region_addr + off;
                let (dst, src) = match dir {
                    Direction::Gather => (region, addr),
                    Direction::Scatter => (addr, region),
                };
                // SAFETY: addresses validated by the caller.
                check("cuMemcpyDtoDAsync", unsafe {
                    sys::cuMemcpyDtoDAsync_v2(dst, src, len as usize, self.stream)
                })?;
            }
        }
        Ok(())
    }

    /// Enqueues the driver's batched memcpy over every segment (comparison
    /// path). `Unavailable` when the driver lacks `cuMemcpyBatchAsync_v2`.
    pub fn memcpy_batched(
        &mut self,
        dir: Direction,
        region_addr: u64,
        runs: &[ScatterRun],
    ) -> Result<(), CudaError> {
        let f = batch_fn().ok_or_else(|| {
            CudaError::Unavailable("the driver has no cuMemcpyBatchAsync_v2".into())
        })?;
        self.gpu.bind()?;
        let mut dsts = Vec::new();
        let mut srcs = Vec::new();
        let mut sizes = Vec::new();
        for run in runs {
            for (off, addr, len) in run.segments() {
                if len == 0 {
                    continue;
                }
                let region = region_addr + off;
                let (dst, src) = match dir {
                    Direction::Gather => (region, addr),
                    Direction::Scatter => (addr, region),
                };
                dsts.push(dst);
                srcs.push(src);
                sizes.push(len as usize);
            }
        }
        if sizes.is_empty() {
            return Ok(());
        }
        let dev = self.gpu.info.ordinal as i32;
        // SAFETY: all-zero is a valid bit pattern for this plain C struct.
        let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        attr.srcLocHint.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        attr.srcLocHint.id = dev;
        attr.dstLocHint.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        attr.dstLocHint.id = dev;
        let mut attr_idx = [0usize];
        // SAFETY: arrays of equal length `sizes.len()`; one attribute applies
        // from index 0; addresses validated by the caller.
        check("cuMemcpyBatchAsync", unsafe {
            f(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                sizes.len(),
                &mut attr,
                attr_idx.as_mut_ptr(),
                1,
                self.stream,
            )
        })
    }
}

impl Drop for ExecCtx {
    fn drop(&mut self) {
        if self.gpu.bind().is_err() {
            return;
        }
        // SAFETY: handles created in new, destroyed once, after the stream
        // drained.
        unsafe {
            if let Err(e) = result::stream::synchronize(self.stream) {
                tracing::warn!(error = %driver_msg(&e), "cuStreamSynchronize failed at drop");
            }
            let _ = result::event::destroy(self.done);
            for &m in &self.marks {
                let _ = result::event::destroy(m);
            }
            let _ = result::stream::destroy(self.stream);
        }
        self.free_pinned();
        self.free_dplan();
    }
}

/// The device address the piece kernels read a table of `bytes` (already
/// written to `ctx`'s pinned buffer) from: the pinned buffer itself, mapped
/// (`PlanSource::PinnedHost`, config `useZeroCopyArguments`: no driver call),
/// or its copy in device memory, enqueued here on `ctx`'s stream
/// (`PlanSource::Device`).
///
/// # Errors
/// The driver's error from the copy.
fn piece_table(cfg: &CudaCopyConfig, ctx: &ExecCtx, bytes: usize) -> Result<u64, CudaError> {
    match cfg.plan_source {
        PlanSource::PinnedHost => Ok(ctx.pinned_dev),
        PlanSource::Device => {
            // SAFETY: both buffers hold `bytes` (ensure_capacity).
            check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(ctx.dplan, ctx.pinned.cast(), bytes, ctx.stream)
            })?;
            Ok(ctx.dplan)
        }
    }
}

/// Whether the driver exports the batched memcpy (`cuMemcpyBatchAsync_v2`).
pub fn has_batched_memcpy() -> bool {
    // SAFETY: only tries to dlopen the driver library.
    let present = unsafe { sys::is_culib_present() };
    present && batch_fn().is_some()
}

/// The GPU [`CopyEngine`] (seed §4 `GatherScatterKernel` + `ExecPool`):
/// each call borrows an [`ExecCtx`], enqueues the configured [`CopyPath`]
/// on its stream, records its event and waits for it in the calling worker
/// thread. Errors are logged with the CUDA error string and returned.
pub struct CudaCopyEngine {
    gpu: Arc<CudaGpu>,
    pool: ExecPool<ExecCtx>,
    cfg: CudaCopyConfig,
}

impl std::fmt::Debug for CudaCopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopyEngine")
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl CudaCopyEngine {
    /// Builds `cfg.streams` contexts (at least one).
    pub fn new(gpu: &Arc<CudaGpu>, cfg: CudaCopyConfig) -> Result<Self, CudaError> {
        if cfg.path == CopyPath::BatchedMemcpy && batch_fn().is_none() {
            return Err(CudaError::Unavailable(
                "the driver has no cuMemcpyBatchAsync_v2".into(),
            ));
        }
        let mut ctxs = Vec::new();
        for _ in 0..cfg.streams.max(1) {
            ctxs.push(ExecCtx::new(gpu, 64 * 1024)?);
        }
        Ok(Self {
            gpu: gpu.clone(),
            pool: ExecPool::new(ctxs),
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CudaCopyConfig {
        &self.cfg
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<CudaGpu> {
        &self.gpu
    }

    /// Borrows a context, waiting while all are in use (the pool should be
    /// at least as large as the number of copy workers).
    pub fn acquire(&self) -> ExecCtx {
        let mut spins = 0u32;
        loop {
            if let Some(c) = self.pool.try_acquire() {
                return c;
            }
            spins += 1;
            if spins == 1000 {
                tracing::warn!(
                    streams = self.pool.capacity(),
                    "CUDA exec pool exhausted; size it to at least the copy workers"
                );
            }
            if spins < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Returns a borrowed context.
    pub fn release(&self, ctx: ExecCtx) {
        self.pool.release(ctx);
    }

    /// Enqueues the configured path for `runs` on `ctx` without waiting.
    pub fn enqueue(
        &self,
        ctx: &mut ExecCtx,
        dir: Direction,
        region_addr: u64,
        runs: &[ScatterRun],
    ) -> Result<(), CudaError> {
        match self.cfg.path {
            CopyPath::Kernel => {
                let plan = ctx.prepare(&self.cfg, dir, region_addr, runs)?;
                ctx.launch(&self.cfg, &plan)
            }
            CopyPath::PerSegmentMemcpy => ctx.memcpy_per_segment(dir, region_addr, runs),
            CopyPath::BatchedMemcpy => ctx.memcpy_batched(dir, region_addr, runs),
        }
    }

    /// The same-node direct path (issue 19): copies whole blocks
    /// `src_ids[i]` → `dst_ids[i]` of every plane (layer × K/V) between two
    /// pools with one launch of `kvf_block_copy` straight from the block
    /// ids, and waits for its completion event. Only the two u32 id arrays
    /// go to the GPU: written to the pinned buffer and uploaded to device
    /// memory on the stream before the launch (the first version read them
    /// zero-copy from pinned memory, once per plane: 0.85–0.92 of a
    /// contiguous memcpy on the H200 against 0.89–0.93 with device ids,
    /// `kvfabric-gpu direct-bench`). Plane `q` of a pool starts at
    /// `base + q * plane_stride`; a block is `block_bytes`.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for id lists of different lengths or over
    /// `u32::MAX` pairs; the driver's error otherwise. The caller has
    /// range-checked every id against both layouts.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_blocks(
        &self,
        src_base: u64,
        dst_base: u64,
        src_ids: &[u32],
        dst_ids: &[u32],
        nplanes: u32,
        src_plane_stride: u64,
        dst_plane_stride: u64,
        block_bytes: u64,
    ) -> Result<(), CudaError> {
        if src_ids.len() != dst_ids.len() || u32::try_from(src_ids.len()).is_err() {
            return Err(CudaError::Invalid(format!(
                "block id lists of {} and {} entries",
                src_ids.len(),
                dst_ids.len()
            )));
        }
        if src_ids.is_empty() || nplanes == 0 || block_bytes == 0 {
            return Ok(());
        }
        let t0 = Instant::now();
        let mut ctx = self.acquire();
        let t_acquired = t0.elapsed();
        let (mut t_staged, mut t_enqueued) = (Duration::ZERO, Duration::ZERO);
        let mut kernel_us = f64::NAN;
        let out = self.gpu.bind().and_then(|()| {
            let n = src_ids.len();
            let id_bytes = std::mem::size_of_val(src_ids);
            let bytes = 2 * id_bytes;
            ctx.ensure_capacity(bytes)?;
            // SAFETY: the pinned buffer holds `bytes`; no pending work reads
            // it (ensure_capacity synchronised a busy context).
            unsafe {
                std::ptr::copy_nonoverlapping(src_ids.as_ptr(), ctx.pinned.cast::<u32>(), n);
                std::ptr::copy_nonoverlapping(dst_ids.as_ptr(), ctx.pinned.cast::<u32>().add(n), n);
            }
            t_staged = t0.elapsed();
            ctx.busy = true;
            // SAFETY: dplan holds `bytes` (ensure_capacity); the pinned
            // source stays untouched until the completion event.
            check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(ctx.dplan, ctx.pinned.cast(), bytes, ctx.stream)
            })?;
            let a = BlockCopy {
                src_base,
                dst_base,
                src_ids: ctx.dplan,
                dst_ids: ctx.dplan + id_bytes as u64,
                npairs: n as u32,
                nplanes,
                src_plane_stride,
                dst_plane_stride,
                block_bytes,
            };
            // At trace level, the kernel alone between two timing events.
            let events = if tracing::enabled!(tracing::Level::TRACE) {
                let f = sys::CUevent_flags::CU_EVENT_DEFAULT;
                result::event::create(f)
                    .and_then(|a| result::event::create(f).map(|b| (a, b)))
                    .ok()
            } else {
                None
            };
            if let Some((ev0, _)) = events {
                // SAFETY: live event and stream.
                let _ = unsafe { result::event::record(ev0, ctx.stream) };
            }
            // SAFETY: the stream is this context's; the id arrays stay valid
            // until the completion event (waited on below); the caller
            // range-checked every id.
            unsafe { self.gpu.launch_block_copy(ctx.stream, &a, 0) }?;
            if let Some((_, ev1)) = events {
                // SAFETY: live event and stream.
                let _ = unsafe { result::event::record(ev1, ctx.stream) };
            }
            ctx.record_done()?;
            t_enqueued = t0.elapsed();
            let r = ctx.wait_done();
            if let Some((ev0, ev1)) = events {
                // SAFETY: both recorded before the completion event waited
                // on above; destroyed once.
                unsafe {
                    kernel_us = result::event::elapsed(ev0, ev1)
                        .map(|ms| f64::from(ms) * 1e3)
                        .unwrap_or(f64::NAN);
                    let _ = result::event::destroy(ev0);
                    let _ = result::event::destroy(ev1);
                }
            }
            r
        });
        // Host-side cost breakdown (µs since the call began).
        tracing::trace!(
            pairs = src_ids.len(),
            planes = nplanes,
            acquired_us = t_acquired.as_micros() as u64,
            staged_us = t_staged.as_micros() as u64,
            enqueued_us = t_enqueued.as_micros() as u64,
            done_us = t0.elapsed().as_micros() as u64,
            kernel_us,
            "cuda block copy"
        );
        if out.is_err() {
            let _ = ctx.synchronize();
        }
        self.release(ctx);
        out
    }

    /// The uniform gather ([`CopyEngine::gather_uniform`]): the
    /// descriptors' source addresses (8 bytes each) are written to the
    /// context's pinned buffer, uploaded on its stream and read by one
    /// `kvf_gather_srcs` launch; `meanwhile` runs between the enqueue and
    /// the wait (also after a failed enqueue, so its work is never lost).
    ///
    /// `stride` is in bytes. The caller
    /// ([`CopyEngine::gather_uniform`]) keeps descriptors longer than a
    /// kernel piece off this path (one warp copies a descriptor).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] with [`super::exec::check_uniform`]'s
    /// message; the driver's error otherwise.
    pub fn run_uniform(
        &self,
        region_addr: u64,
        descs: &[Descriptor],
        stride: u64,
        meanwhile: &mut dyn FnMut(),
    ) -> Result<(), CudaError> {
        let checked =
            super::exec::check_uniform(descs, stride).map_err(|e| CudaError::Invalid(e.0));
        let (n, len) = match checked {
            Ok(len) if len > 0 && !descs.is_empty() => (descs.len() as u32, len),
            other => {
                meanwhile();
                return other.map(|_| ());
            }
        };
        self.run_pieces(
            Direction::Gather,
            region_addr,
            descs.iter().map(|d| d.src),
            n,
            len,
            stride,
            meanwhile,
        )
    }

    /// The uniform scatter ([`CopyEngine::scatter_uniform`], DATA_UNIFORM):
    /// the destinations (8 bytes each) are written to the context's pinned
    /// buffer and read by one `kvf_scatter_dsts` launch (there, or from
    /// their copy in device memory: [`CudaCopyConfig::plan_source`]).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for more than `u32::MAX` pieces or a stride
    /// below the piece length; the driver's error otherwise.
    pub fn run_scatter_uniform(
        &self,
        region_addr: u64,
        u: &UniformScatter,
    ) -> Result<(), CudaError> {
        let n = u32::try_from(u.dsts.len())
            .map_err(|_| CudaError::Invalid(format!("{} pieces in one scatter", u.dsts.len())))?;
        if u.region_stride < u.segment_len {
            return Err(CudaError::Invalid(format!(
                "uniform scatter stride {} below its piece length {}",
                u.region_stride, u.segment_len
            )));
        }
        if n == 0 || u.segment_len == 0 {
            return Ok(());
        }
        self.run_pieces(
            Direction::Scatter,
            region_addr,
            u.dsts.iter().copied(),
            n,
            u.segment_len,
            u.region_stride,
            &mut || {},
        )
    }

    /// The block scatter ([`CopyEngine::scatter_blocks`], DATA_BLOCKS): the
    /// plane's block destinations (8 bytes a block, not a piece) are
    /// written to the context's pinned buffer (read there, or uploaded:
    /// [`CudaCopyConfig::plan_source`]) and one `kvf_scatter_blocks`
    /// launch derives every piece's destination.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for more than `u32::MAX` blocks, no blocks,
    /// a stride below the piece length or a last piece index that
    /// overflows; the driver's error otherwise.
    pub fn run_scatter_blocks(&self, region_addr: u64, b: &BlockScatter) -> Result<(), CudaError> {
        let nblocks = u32::try_from(b.offsets.len()).map_err(|_| {
            CudaError::Invalid(format!("{} blocks in one scatter", b.offsets.len()))
        })?;
        if b.region_stride < b.segment_len {
            return Err(CudaError::Invalid(format!(
                "block scatter stride {} below its piece length {}",
                b.region_stride, b.segment_len
            )));
        }
        if b.count == 0 || b.segment_len == 0 {
            return Ok(());
        }
        if nblocks == 0 || b.first.checked_add(u64::from(b.count)).is_none() {
            return Err(CudaError::Invalid(
                "block scatter without blocks, or its last piece index overflows".into(),
            ));
        }
        let t0 = Instant::now();
        let mut ctx = self.acquire();
        let enqueued = self.gpu.bind().and_then(|()| {
            let table =
                self.stage_piece_table(&mut ctx, b.offsets.iter().copied(), b.offsets.len())?;
            // SAFETY: the stream is this context's; the table stays valid
            // until the completion event; the receiver validated the
            // region and every derived destination.
            unsafe {
                self.gpu.launch_blocks(
                    Direction::Scatter,
                    ctx.stream,
                    &BlockPieces {
                        offsets: table,
                        nblocks,
                        first: b.first,
                        n: b.count,
                        plane_stride: b.plane_stride,
                        len: b.segment_len,
                        stride: b.region_stride,
                        region: region_addr,
                    },
                )
            }?;
            ctx.record_done()
        });
        let t_enqueued = t0.elapsed();
        let out = enqueued.and_then(|()| ctx.wait_done());
        tracing::trace!(
            pieces = b.count,
            blocks = nblocks,
            enqueued_us = t_enqueued.as_micros() as u64,
            done_us = t0.elapsed().as_micros() as u64,
            "cuda block scatter"
        );
        if out.is_err() {
            let _ = ctx.synchronize();
        }
        self.release(ctx);
        if let Err(e) = &out {
            tracing::error!(error = %e, "CUDA block scatter failed");
        }
        out
    }

    /// The batched uniform gather ([`CopyEngine::gather_uniform_batch`]):
    /// every item's source addresses (8 bytes a piece) written once to the
    /// context's pinned buffer (read there by the kernels, or uploaded with
    /// one copy: [`CudaCopyConfig::plan_source`]), then one
    /// `kvf_gather_srcs` launch per item on one stream, a mark event after
    /// the first and after the last; `meanwhile` runs after the enqueue,
    /// then `done(0, _)` at the first mark and the others, in order, at
    /// the second. Items must be checked uniform with pieces no
    /// longer than a kernel piece (the caller's
    /// [`CopyEngine::gather_uniform_batch`] falls back otherwise). On an
    /// enqueue or driver error every item not yet reported gets it (after
    /// the stream drained: nothing still writes their regions).
    pub fn run_gather_batch(
        &self,
        items: &[UniformGather<'_>],
        lens: &[u64],
        meanwhile: &mut dyn FnMut(),
        done: &mut dyn FnMut(usize, Result<(), CopyError>),
    ) {
        let t0 = Instant::now();
        let total: usize = items.iter().map(|g| g.descs.len()).sum();
        let mut ctx = self.acquire();
        // Any descriptor whose length differs from its item's (`lens`,
        // the first descriptor's): OR of the XORs, taken in the pass that
        // stages the table (a separate pass over 16,384 descriptors cost
        // ≈ 10–25 µs on the H200 host, on the first gather's path).
        let odd = std::cell::Cell::new(0u64);
        // Trace-only split of the enqueue (µs since t0): context acquired
        // and bound, table staged, table uploaded (device plan source).
        let t_acquired = t0.elapsed();
        let (mut t_staged, mut t_table) = (Duration::ZERO, Duration::ZERO);
        // Every item from source planes (a block hand-off; its lengths
        // measured at sizing): a table of each item's plane (`n` block
        // addresses) instead of one address a piece, and the block kernel.
        let planes: Option<Vec<(&BlockPlanes, u64)>> = items.iter().map(|g| g.src_planes).collect();
        let enqueued = self.gpu.bind().and_then(|()| {
            ctx.ensure_marks(2)?;
            if let Some(planes) = &planes {
                let entries: usize = planes.iter().map(|(p, _)| p.offsets.len()).sum();
                let offsets = planes.iter().flat_map(|(p, _)| p.offsets.iter().copied());
                let bytes = Self::write_piece_table(&mut ctx, offsets, entries)?;
                t_staged = t0.elapsed();
                let table = piece_table(&self.cfg, &ctx, bytes)?;
                t_table = t0.elapsed();
                let mut at = 0u64;
                for (i, ((g, &len), (p, first))) in items.iter().zip(lens).zip(planes).enumerate() {
                    let nblocks = u32::try_from(p.offsets.len()).map_err(|_| {
                        CudaError::Invalid("a plane of more than u32::MAX blocks".into())
                    })?;
                    let n = g.descs.len() as u32;
                    // SAFETY: the stream is this context's; the table stays
                    // valid until the marks complete; the planes were found
                    // in the request's descriptors (every derived source is
                    // one of theirs, of length `len`), the region holds
                    // (n - 1) * stride + len bytes.
                    unsafe {
                        self.gpu.launch_blocks(
                            Direction::Gather,
                            ctx.stream,
                            &BlockPieces {
                                offsets: table + at * 8,
                                nblocks,
                                first: *first,
                                n,
                                plane_stride: p.plane_stride,
                                len,
                                stride: g.stride,
                                region: g.region_addr,
                            },
                        )
                    }?;
                    if i == 0 || i + 1 == items.len() {
                        ctx.record_mark(usize::from(i != 0))?;
                    }
                    at += u64::from(nblocks);
                }
                return Ok(true);
            }
            let odd = &odd;
            let srcs = items.iter().zip(lens).flat_map(|(g, &len)| {
                g.descs.iter().map(move |d| {
                    odd.set(odd.get() | (d.len ^ len));
                    d.src
                })
            });
            let bytes = Self::write_piece_table(&mut ctx, srcs, total)?;
            t_staged = t0.elapsed();
            if odd.get() != 0 {
                // Nothing enqueued (not even the table's upload): the
                // pinned buffer is free again.
                ctx.busy = false;
                return Ok(false);
            }
            let table = piece_table(&self.cfg, &ctx, bytes)?;
            t_table = t0.elapsed();
            let mut first = 0u64;
            for (i, (g, &len)) in items.iter().zip(lens).enumerate() {
                let n = g.descs.len() as u32;
                // SAFETY: the stream is this context's; the table stays
                // valid until the marks complete; the caller checked
                // lengths and strides, the regions hold
                // (n - 1) * stride + len bytes.
                unsafe {
                    self.gpu.launch_gather_srcs(
                        ctx.stream,
                        table + first * 8,
                        n,
                        len,
                        g.stride,
                        g.region_addr,
                    )
                }?;
                // Marks after the first item (its write can start while
                // the rest gather) and after the last: each driver call
                // costs ≈ 9 µs under MPS on the H200 host, a per-item mark
                // would delay the later launches more than it gains.
                if i == 0 || i + 1 == items.len() {
                    ctx.record_mark(usize::from(i != 0))?;
                }
                first += u64::from(n);
            }
            Ok(true)
        });
        if let Ok(false) = enqueued {
            // Not uniform after all: item by item, each checked (and
            // failed) on its own.
            self.release(ctx);
            return super::exec::gather_uniform_each(self, items, meanwhile, done);
        }
        let t_enqueued = t0.elapsed();
        meanwhile();
        let mut next = 0;
        let mut failed = enqueued.err();
        if failed.is_none() {
            // Mark 0: the first item; mark 1 (recorded only for two or
            // more): all of them.
            let marks = if items.len() > 1 { 2 } else { 1 };
            for (mark, upto) in [(0, 1), (1, items.len())].into_iter().take(marks) {
                if let Err(e) = ctx.wait_mark(mark) {
                    failed = Some(e);
                    break;
                }
                while next < upto {
                    done(next, Ok(()));
                    next += 1;
                }
            }
        }
        match &failed {
            None => ctx.busy = false,
            Some(e) => {
                tracing::error!(error = %e, chunks = items.len(), "CUDA batched gather failed");
                let _ = ctx.synchronize();
            }
        }
        tracing::trace!(
            chunks = items.len(),
            pieces = total,
            planes = planes.is_some(),
            acquired_us = t_acquired.as_micros() as u64,
            staged_us = t_staged.as_micros() as u64,
            table_us = t_table.as_micros() as u64,
            enqueued_us = t_enqueued.as_micros() as u64,
            done_us = t0.elapsed().as_micros() as u64,
            "cuda batched gather"
        );
        self.release(ctx);
        if let Some(e) = failed {
            let e = CopyError::from(e);
            for i in next..items.len() {
                done(i, Err(e.clone()));
            }
        }
    }

    /// Writes the first `n` addresses of `addrs` (u64 each) into `ctx`'s
    /// pinned buffer — after waiting for work still reading it, growing it
    /// to 8 `n` bytes — marks the context busy and returns the table's
    /// device address for the piece kernels ([`piece_table`]). Shared by
    /// [`CudaCopyEngine::run_pieces`] and
    /// [`CudaCopyEngine::run_gather_batch`]. The context must be bound.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] if `addrs` ends before `n` addresses; the
    /// driver's errors from synchronising, allocating or uploading.
    fn stage_piece_table(
        &self,
        ctx: &mut ExecCtx,
        addrs: impl Iterator<Item = u64>,
        n: usize,
    ) -> Result<u64, CudaError> {
        let bytes = Self::write_piece_table(ctx, addrs, n)?;
        piece_table(&self.cfg, ctx, bytes)
    }

    /// The first half of [`CudaCopyEngine::stage_piece_table`]: the
    /// addresses written to `ctx`'s pinned buffer (after waiting for work
    /// still reading it), the context marked busy, nothing enqueued yet
    /// (the upload, for [`PlanSource::Device`], is [`piece_table`]'s).
    /// Returns the table's size in bytes.
    ///
    /// # Errors
    /// As [`CudaCopyEngine::stage_piece_table`], but no upload error.
    fn write_piece_table(
        ctx: &mut ExecCtx,
        addrs: impl Iterator<Item = u64>,
        n: usize,
    ) -> Result<usize, CudaError> {
        let bytes = n * 8;
        if ctx.busy {
            ctx.synchronize()?;
        }
        ctx.ensure_capacity(bytes)?;
        let mut written = 0usize;
        let base = ctx.pinned;
        // Internal iteration (`for_each`): a chained or flattened iterator
        // then runs as plain nested loops.
        addrs.take(n).for_each(|a| {
            // SAFETY: the pinned buffer holds `bytes` = 8 n and no pending
            // work reads it (synchronised above); written < n (`take`).
            unsafe { std::ptr::write_unaligned(base.add(written * 8).cast::<u64>(), a) };
            written += 1;
        });
        if written != n {
            return Err(CudaError::Invalid(format!(
                "{written} piece addresses for {n} pieces"
            )));
        }
        ctx.busy = true;
        Ok(bytes)
    }

    /// One launch of a piece kernel (`dir` Gather: `kvf_gather_srcs`;
    /// Scatter: `kvf_scatter_dsts`) over a table of `n` piece addresses
    /// (u64, from `addrs`; at most `n` are taken): written straight to the
    /// context's pinned buffer and read by the launch there (mapped), or
    /// uploaded on its stream first ([`CudaCopyConfig::plan_source`]);
    /// `meanwhile` runs between the enqueue and the wait (also
    /// after a failed enqueue).
    #[allow(clippy::too_many_arguments)]
    fn run_pieces(
        &self,
        dir: Direction,
        region_addr: u64,
        addrs: impl Iterator<Item = u64>,
        n: u32,
        len: u64,
        stride: u64,
        meanwhile: &mut dyn FnMut(),
    ) -> Result<(), CudaError> {
        let t0 = Instant::now();
        let mut ctx = self.acquire();
        let enqueued = self.gpu.bind().and_then(|()| {
            let table = self.stage_piece_table(&mut ctx, addrs, n as usize)?;
            // SAFETY: the stream is this context's; the table stays valid
            // until the completion event; the callers checked lengths,
            // strides, the region and (scatter) the destinations.
            unsafe {
                match dir {
                    Direction::Gather => {
                        self.gpu
                            .launch_gather_srcs(ctx.stream, table, n, len, stride, region_addr)
                    }
                    Direction::Scatter => {
                        self.gpu
                            .launch_scatter_dsts(ctx.stream, table, n, len, stride, region_addr)
                    }
                }
            }?;
            ctx.record_done()
        });
        let t_enqueued = t0.elapsed();
        meanwhile();
        let out = enqueued.and_then(|()| ctx.wait_done());
        tracing::trace!(
            ?dir,
            pieces = n,
            enqueued_us = t_enqueued.as_micros() as u64,
            done_us = t0.elapsed().as_micros() as u64,
            "cuda uniform copy"
        );
        if out.is_err() {
            let _ = ctx.synchronize();
        }
        self.release(ctx);
        if let Err(e) = &out {
            tracing::error!(?dir, error = %e, "CUDA uniform copy failed");
        }
        out
    }

    /// Runs one copy to completion: borrow, enqueue, record, wait, return.
    pub fn run(
        &self,
        dir: Direction,
        region_addr: u64,
        runs: &[ScatterRun],
    ) -> Result<(), CudaError> {
        let t0 = Instant::now();
        let mut ctx = self.acquire();
        let t_acquired = t0.elapsed();
        let mut t_enqueued = Duration::ZERO;
        let out = self
            .gpu
            .bind()
            .and_then(|()| self.enqueue(&mut ctx, dir, region_addr, runs))
            .and_then(|()| {
                t_enqueued = t0.elapsed();
                ctx.record_done()
            })
            .and_then(|()| ctx.wait_done());
        // Host-side cost breakdown for the per-chunk timeline (µs since
        // the call began).
        tracing::trace!(
            ?dir,
            runs = runs.len(),
            acquired_us = t_acquired.as_micros() as u64,
            enqueued_us = t_enqueued.as_micros() as u64,
            done_us = t0.elapsed().as_micros() as u64,
            "cuda copy"
        );
        if out.is_err() {
            // Drain whatever was enqueued before the failure so the plan
            // buffers are free for the next borrower.
            let _ = ctx.synchronize();
        }
        self.release(ctx);
        if let Err(e) = &out {
            tracing::error!(?dir, error = %e, "CUDA copy failed");
        }
        out
    }
}

impl CopyEngine for CudaCopyEngine {
    fn gather(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError> {
        self.run(Direction::Gather, region_addr, runs)
            .map_err(CopyError::from)
    }
    fn gather_uniform(
        &self,
        region_addr: u64,
        descs: &[Descriptor],
        stride: u64,
        meanwhile: &mut dyn FnMut(),
    ) -> Result<(), CopyError> {
        // The uniform kernel copies a descriptor with one warp: for
        // descriptors longer than a kernel piece, and for the memcpy
        // paths, the run path (which splits pieces) serves them.
        let len = descs.first().map_or(0, |d| d.len);
        if self.cfg.path != CopyPath::Kernel || len > self.cfg.piece_bytes {
            return super::exec::gather_uniform_by_runs(
                self,
                region_addr,
                descs,
                stride,
                meanwhile,
            );
        }
        self.run_uniform(region_addr, descs, stride, meanwhile)
            .map_err(CopyError::from)
    }
    fn gather_uniform_batch(
        &self,
        items: &[UniformGather<'_>],
        meanwhile: &mut dyn FnMut(),
        done: &mut dyn FnMut(usize, Result<(), CopyError>),
    ) {
        // One submission for uniform items the kernel serves (a warp a
        // piece); anything else, one after the other. Each item's length
        // is its first descriptor's here (O(1)); `run_gather_batch`
        // compares every descriptor's in the pass that stages the piece
        // table, before anything is launched.
        let lens: Option<Vec<u64>> = items
            .iter()
            .map(|g| {
                let len = g.descs.first()?.len;
                (len > 0
                    && len <= self.cfg.piece_bytes
                    && g.stride >= len
                    && u32::try_from(g.descs.len()).is_ok())
                .then_some(len)
            })
            .collect();
        match lens {
            Some(lens) if self.cfg.path == CopyPath::Kernel && items.len() > 1 => {
                self.run_gather_batch(items, &lens, meanwhile, done)
            }
            _ => super::exec::gather_uniform_each(self, items, meanwhile, done),
        }
    }
    fn max_batched_piece_bytes(&self) -> u64 {
        // What `gather_uniform_batch` submits at once (a warp a piece).
        if self.cfg.path == CopyPath::Kernel {
            self.cfg.piece_bytes
        } else {
            0
        }
    }
    fn scatter(&self, region_addr: u64, runs: &[ScatterRun]) -> Result<(), CopyError> {
        self.run(Direction::Scatter, region_addr, runs)
            .map_err(CopyError::from)
    }
    fn scatter_uniform(&self, region_addr: u64, u: &UniformScatter) -> Result<(), CopyError> {
        // As the uniform gather: a warp a piece, so pieces longer than a
        // kernel piece and the memcpy paths take the run path.
        if self.cfg.path != CopyPath::Kernel || u.segment_len > self.cfg.piece_bytes {
            return self.scatter(region_addr, &u.to_runs());
        }
        self.run_scatter_uniform(region_addr, u)
            .map_err(CopyError::from)
    }
    fn scatter_blocks(&self, region_addr: u64, b: &BlockScatter) -> Result<(), CopyError> {
        // As the uniform scatter: a warp a piece on the kernel path; the
        // others take the destinations listed.
        if self.cfg.path != CopyPath::Kernel || b.segment_len > self.cfg.piece_bytes {
            let u = b
                .to_uniform()
                .ok_or_else(|| CopyError("block scatter destination overflows".into()))?;
            return self.scatter(region_addr, &u.to_runs());
        }
        self.run_scatter_blocks(region_addr, b)
            .map_err(CopyError::from)
    }
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn flip_byte(&self, addr: u64) -> Result<(), CopyError> {
        // Test-only (runtime::faults): one byte of device memory, read,
        // flipped and written back synchronously.
        let mut b = [0u8; 1];
        self.gpu
            .bind()
            .and_then(|()| {
                // SAFETY: `addr` is inside a live arena region (the scatter
                // about to run); one byte each way, synchronous.
                check("cuMemcpyDtoH", unsafe {
                    sys::cuMemcpyDtoH_v2(b.as_mut_ptr().cast(), addr, 1)
                })?;
                b[0] ^= 0xff;
                // SAFETY: as above.
                check("cuMemcpyHtoD", unsafe {
                    sys::cuMemcpyHtoD_v2(addr, b.as_ptr().cast(), 1)
                })
            })
            .map_err(|e| CopyError(e.to_string()))
    }
}

/// A [`TransferEngine`] that makes `gpu`'s context current on the calling
/// thread before every call of the wrapped engine, so NIXL/UCX find a CUDA
/// context on whichever thread (IO thread, standard-path poller, caller)
/// registers VRAM or posts a VRAM write. A failed bind is logged and the
/// call still goes through (UCX may manage its own context).
pub struct CudaBoundEngine {
    inner: Arc<dyn TransferEngine>,
    gpu: Arc<CudaGpu>,
}

impl CudaBoundEngine {
    /// Wraps `inner`, binding `gpu`'s context around each call.
    pub fn new(inner: Arc<dyn TransferEngine>, gpu: Arc<CudaGpu>) -> Self {
        Self { inner, gpu }
    }

    fn bind(&self) {
        // The error is already logged by `drv`.
        let _ = self.gpu.bind();
    }
}

impl TransferEngine for CudaBoundEngine {
    fn agent_name(&self) -> &str {
        self.inner.agent_name()
    }
    fn local_metadata(&self) -> Result<Vec<u8>, EngineError> {
        self.bind();
        self.inner.local_metadata()
    }
    fn load_peer(&self, metadata: &[u8]) -> Result<String, EngineError> {
        self.bind();
        self.inner.load_peer(metadata)
    }
    fn forget_peer(&self, peer: &str) -> Result<(), EngineError> {
        self.bind();
        self.inner.forget_peer(peer)
    }
    fn deregister_region(&self, addr: u64) -> bool {
        self.inner.deregister_region(addr)
    }
    fn register_region(&self, kind: MemKind, desc: MemDesc) -> Result<(), EngineError> {
        self.bind();
        self.inner.register_region(kind, desc)
    }
    fn post_write(
        &self,
        peer: &str,
        local_kind: MemKind,
        local: &[MemDesc],
        remote_kind: MemKind,
        remote: &[MemDesc],
    ) -> Result<XferHandle, EngineError> {
        self.bind();
        self.inner
            .post_write(peer, local_kind, local, remote_kind, remote)
    }
    fn prepare_local(&self, kind: MemKind, descs: &[MemDesc]) -> Result<PreparedList, EngineError> {
        self.bind();
        self.inner.prepare_local(kind, descs)
    }
    fn prepare_remote(
        &self,
        peer: &str,
        kind: MemKind,
        descs: &[MemDesc],
    ) -> Result<PreparedList, EngineError> {
        self.bind();
        self.inner.prepare_remote(peer, kind, descs)
    }
    fn post_indexed(
        &self,
        local: PreparedList,
        local_idx: &[i32],
        remote: PreparedList,
        remote_idx: &[i32],
    ) -> Result<XferHandle, EngineError> {
        self.bind();
        self.inner
            .post_indexed(local, local_idx, remote, remote_idx)
    }
    fn release_prepared(&self, list: PreparedList) {
        self.bind();
        self.inner.release_prepared(list)
    }
    fn poll(&self, handle: XferHandle) -> Result<XferState, EngineError> {
        self.bind();
        self.inner.poll(handle)
    }
    fn release(&self, handle: XferHandle) {
        self.bind();
        self.inner.release(handle)
    }
    fn progress(&self) -> Result<Vec<(String, Vec<u8>)>, EngineError> {
        self.bind();
        self.inner.progress()
    }
    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), EngineError> {
        self.bind();
        self.inner.send_notification(peer, msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(off: u64, addr: u64, len: u64, count: u32, rs: u64, us: u64) -> ScatterRun {
        ScatterRun {
            region_offset: off,
            addr,
            segment_len: len,
            count,
            region_stride: rs,
            addr_stride: us,
        }
    }

    #[test]
    fn runs_of_one_task_each_go_to_the_kernel_as_is() {
        let piece = 32 * 1024;
        // 4 KiB blocks, singles and a strided pair: one task each.
        let runs = [
            run(0, 0x1000, 4096, 1, 0, 0),
            run(4096, 0x9000, 4096, 2, 4096, 0x10000),
        ];
        assert_eq!(one_task_per_run(&runs, piece), Some(3 * 4096));
        assert_eq!(one_task_per_run(&[], piece), Some(0));
        // Nine 4 KiB segments exceed a 32 KiB task; a 64 KiB segment is cut
        // in pieces; empty runs are dropped by build_plan: all need a plan.
        assert_eq!(
            one_task_per_run(&[run(0, 0, 4096, 9, 4096, 4096)], piece),
            None
        );
        assert_eq!(one_task_per_run(&[run(0, 0, 65536, 1, 0, 0)], piece), None);
        assert_eq!(one_task_per_run(&[run(0, 0, 0, 1, 0, 0)], piece), None);
        assert_eq!(one_task_per_run(&[run(0, 0, 64, 0, 0, 0)], piece), None);
        // Where the fast path applies, build_plan makes one task per run too.
        let (mut r, mut t) = (Vec::new(), Vec::new());
        build_plan(&runs, piece, &mut r, &mut t).unwrap();
        assert_eq!(t.len(), runs.len());
        assert_eq!(r, runs.iter().map(GpuRun::from).collect::<Vec<_>>());
    }

    #[test]
    fn plan_splits_groups_and_skips_empty() {
        let runs = [
            run(0, 0x1000, 4096, 1, 0, 0),
            run(4096, 0x9000, 0, 1, 0, 0),
            run(8192, 0x20000, 200 * 1024, 2, 200 * 1024, 300 * 1024),
            run(0, 0x50000, 1024, 200, 1024, 4096),
        ];
        let (mut r, mut t) = (Vec::new(), Vec::new());
        let bytes = build_plan(&runs, 64 * 1024, &mut r, &mut t).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(bytes, 4096 + 2 * 200 * 1024 + 200 * 1024);
        // run 0: one task; run 1: 2 segments × 4 pieces; run 2: 200 / 64 → 4 tasks.
        assert_eq!(t.len(), 1 + 8 + 4);
        assert_eq!(
            t[1],
            GpuTask {
                run: 1,
                seg_begin: 0,
                seg_count: 1,
                piece: 0
            }
        );
        assert_eq!(t[8].piece, 3);
        assert_eq!(t[12].seg_begin, 192);
        assert_eq!(t[12].seg_count, 8);
        let covered: u32 = t[9..].iter().map(|x| x.seg_count).sum();
        assert_eq!(covered, 200);
    }

    #[test]
    fn kernel_compiles_or_skips() {
        // Compiling needs NVRTC, not a GPU.
        if let Err(why) = probe_nvrtc() {
            eprintln!("SKIP: {why}");
            return;
        }
        let cubin = compile_cubin(GATHER_SCATTER_SRC, "gather_scatter.cu", (9, 0)).unwrap();
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "NVRTC output is a cubin (ELF)"
        );
    }
}
