//! Benchmarks and demos that run the engine for real: the trace replay
//! (`kvfabric bench`), the data-plane side-by-side bench (two processes),
//! the GPU kernel tests and benchmarks and the VRAM benches of
//! `kvfabric-gpu` (feature `cuda`), and their helpers. The binaries only
//! parse arguments ([`cli`] holds the shared value parsers) and call in
//! here.

pub mod arrivals;
pub mod cli;
pub mod dataplane;
#[cfg(feature = "cuda")]
pub mod direct;
#[cfg(feature = "cuda")]
pub mod floor;
#[cfg(feature = "cuda")]
pub mod gpu_kernel;
#[cfg(feature = "cuda")]
pub mod gpu_trace;
/// The bench patterns (moved to the crate root so the HTTP service's debug
/// endpoints use them without depending on the bench layer).
pub use crate::pattern;
pub mod remote;
pub mod timeline;
pub mod trace;
pub mod ucx_tap;
#[cfg(feature = "cuda")]
pub mod vram;
