//! # kvfabric-agent — the bounce engine runtime
//!
//! The pure logic lives in [`kvfabric_core`] (re-exported as [`core`]); this
//! crate adds IO, threads and memory (seed §4 "Device / IO / integration"):
//!
//! | module | seed | what |
//! |---|---|---|
//! | [`runtime::nixl_runtime`] | — | find and load the NIXL runtime libraries |
//! | [`runtime::engine`] | §4 | `TransferEngine` + `NixlTransferEngine` |
//! | [`runtime::arena`] | §4 | `HostArena`, registered once |
//! | [`runtime::exec`] | §4, §7 | `ExecPool` + host copy engine (gather / scatter workers) |
//! | [`runtime::control`] | §4, §5 | `ControlChannel`: ZMQ and NIXL notifications |
//! | [`runtime::transport`] | §5–§9 | `BounceTransport`: the reactor |
//! | [`runtime::fabric`] | §9, §10 | `FabricAgent`: routing gate, standard path, fallback |

pub use kvfabric_core as core;

pub mod bench;
pub mod runtime;
pub mod service;

/// Human-readable logs on stderr for the CLI tools, filtered by
/// `KVFABRIC_LOG` (tracing `EnvFilter` syntax; default `warn`). Idempotent.
/// (The agent daemon configures its own structured logs.)
pub fn init_cli_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVFABRIC_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
