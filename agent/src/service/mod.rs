//! Agent services around the runtime: peer discovery (and, later, the HTTP
//! API and metrics).

pub mod discovery;
