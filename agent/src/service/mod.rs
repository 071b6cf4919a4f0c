//! Agent services around the runtime: peer discovery, the engines' local
//! API, the HTTP API, metrics, traces and the `kvfabric agent` daemon.

pub mod daemon;
pub mod discovery;
pub mod engines;
pub mod http;
pub mod metrics;
pub mod rollout;
pub mod shm_guard;
pub mod traces;
