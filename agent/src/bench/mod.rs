//! Benchmarks and demos that run the engine for real: the data-plane
//! side-by-side bench (two processes) and its helpers.

pub mod cli;
pub mod dataplane;
#[cfg(feature = "cuda")]
pub mod gpu_trace;
pub mod pattern;
pub mod remote;
pub mod trace;
#[cfg(feature = "cuda")]
pub mod vram;
