//! Runtime modules: memory, NIXL, control channels, the reactor.

pub mod arena;
pub mod control;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod engine;
pub mod exec;
pub mod fabric;
pub mod faults;
pub mod nixl_runtime;
pub mod spin;
pub mod transport;
pub mod waker;
