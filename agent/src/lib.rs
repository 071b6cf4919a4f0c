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
pub mod bench_args;
pub mod pattern;
pub mod runtime;
pub mod service;

/// glibc `M_TRIM_THRESHOLD` set by [`tune_allocator`]: free heap memory up
/// to this many bytes (64 MiB) stays mapped instead of being returned.
pub const MALLOC_TRIM_THRESHOLD_BYTES: usize = 64 << 20;
/// glibc `M_MMAP_THRESHOLD` set by [`tune_allocator`] (32 MiB, glibc's
/// maximum on 64-bit): allocations below it come from the heap.
pub const MALLOC_MMAP_THRESHOLD_BYTES: usize = 32 << 20;

/// Keeps the request path's scratch memory warm. A 16,384-descriptor
/// request builds ≈1.5 MB of runs and encodes ≈0.8 MB of DATA; with glibc's
/// default (dynamic) thresholds that memory is returned to the kernel on
/// free (`brk` shrink / `munmap`) and page-faulted in again by the next
/// request — measured 1.0–1.5 ms instead of 0.2–0.5 ms per 16,384-descriptor
/// plan (`cargo bench -p kvfabric-core --bench plan_wire`, docs/benchmarks.md).
/// Sets [`MALLOC_TRIM_THRESHOLD_BYTES`] and [`MALLOC_MMAP_THRESHOLD_BYTES`];
/// call first in `main`, before threads start. A threshold the user set
/// through glibc's `MALLOC_TRIM_THRESHOLD_` / `MALLOC_MMAP_THRESHOLD_`
/// environment or `GLIBC_TUNABLES` (`glibc.malloc.trim_threshold`,
/// `glibc.malloc.mmap_threshold`) is left as set. If glibc refuses a value
/// its default stays (nothing else changes). No-op off glibc. Each glibc
/// arena (one per allocating thread, up to 8 per core) may keep up to
/// [`MALLOC_TRIM_THRESHOLD_BYTES`] free; the agent allocates on its IO and
/// copy threads only, a handful of arenas.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        let set = |env: &str, tunable: &str, param: libc::c_int, value: usize| {
            if std::env::var_os(env).is_none() && !tunables.contains(tunable) {
                let value = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
                // SAFETY: mallopt only adjusts allocator parameters; on
                // failure (returns 0) glibc keeps its default.
                let _ = unsafe { libc::mallopt(param, value) };
            }
        };
        set(
            "MALLOC_TRIM_THRESHOLD_",
            "glibc.malloc.trim_threshold",
            libc::M_TRIM_THRESHOLD,
            MALLOC_TRIM_THRESHOLD_BYTES,
        );
        set(
            "MALLOC_MMAP_THRESHOLD_",
            "glibc.malloc.mmap_threshold",
            libc::M_MMAP_THRESHOLD,
            MALLOC_MMAP_THRESHOLD_BYTES,
        );
    }
}

/// Human-readable logs on stderr for the CLI tools, filtered by
/// `KVFABRIC_LOG` (tracing `EnvFilter` syntax; default `warn`), coloured
/// only as [`use_color`] allows for stderr. Idempotent. (The agent daemon
/// configures its own structured logs.)
pub fn init_cli_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVFABRIC_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(use_color(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

/// Whether output written to `stream` may carry colour (ANSI escape
/// codes): only when it is a terminal and `NO_COLOR` is unset or empty
/// (<https://no-color.org>). Files and pipes get plain text.
pub fn use_color(stream: &impl std::io::IsTerminal) -> bool {
    color_allowed(
        stream.is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    )
}

/// The rule of [`use_color`]: a terminal, and `no_color` (the value of
/// `NO_COLOR`) absent or empty.
pub fn color_allowed(is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    is_terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::color_allowed;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(color_allowed(true, None));
        assert!(color_allowed(true, Some(OsStr::new(""))));
        assert!(!color_allowed(true, Some(OsStr::new("1"))));
        assert!(!color_allowed(false, None));
        assert!(!color_allowed(false, Some(OsStr::new(""))));
    }
}
