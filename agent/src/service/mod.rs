//! Agent services around the runtime: peer discovery, the HTTP API, metrics
//! and the `kvfabric agent` daemon.

pub mod daemon;
pub mod discovery;
pub mod http;
pub mod metrics;
