//! Benchmarks and demos that run the engine for real: the data-plane
//! side-by-side bench (two processes) and its helpers.

pub mod dataplane;
pub mod pattern;
pub mod remote;
pub mod trace;
#[cfg(feature = "cuda")]
pub mod vram;
