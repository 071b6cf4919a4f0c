//! Test-only fault hooks (issue 13: the real-model hand-off's in-flight
//! negative control and the prefill engine killed mid-hand-off; a Cancel
//! that finds its request still being routed).
//!
//! Off unless the agent starts with `KVFABRIC_TEST_FAULTS=1` **and** its
//! debug API (`--debug-api`, loopback only): an agent given the variable
//! without the debug API refuses to start (see `AgentConfig::validate`), so
//! a production agent never has them. Once enabled they are armed at run
//! time through `POST /v1/debug/faults` (JSON [`FaultArm`]); nothing fires
//! until armed. Two hooks on the copy workers of the bounce path
//! (`exec::run_job`) and one in the engine API:
//!
//! * `flip_scatter_bytes: N` — the next N scatters first flip (XOR 0xFF)
//!   the first byte of their first non-empty run in the arena, i.e. one
//!   byte of one block while it sits in the bounce arena between the
//!   sender's gather and this receiver's scatter;
//! * `gather_delay_ms: D, delayed_gathers: N` — the next N gathers each
//!   wait D ms before copying, so a hand-off stays in flight long enough to
//!   kill its prefill engine halfway;
//! * `route_delay_ms: D, delayed_routes: N` — the next N engine Transfers
//!   to another agent's engine each wait D ms after they are listed in
//!   flight and before they are submitted to a path (`Status` shows them
//!   with path `pending` meanwhile).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// The environment variable that asks for the hooks (with the debug API).
pub const ENV: &str = "KVFABRIC_TEST_FAULTS";

/// The hooks' state (one per process: [`HOOKS`]; tests build their own).
struct Hooks {
    enabled: AtomicBool,
    flips_armed: AtomicU32,
    flipped: AtomicU64,
    delay_ms: AtomicU64,
    delays_armed: AtomicU32,
    delayed: AtomicU64,
    route_delay_ms: AtomicU64,
    routes_armed: AtomicU32,
    routes_delayed: AtomicU64,
}

static HOOKS: Hooks = Hooks::new();

/// Whether the environment asks for the hooks (`KVFABRIC_TEST_FAULTS` set
/// to anything but empty, 0, false, off or no).
pub fn requested() -> bool {
    std::env::var(ENV).is_ok_and(|v| {
        !matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "" | "0" | "false" | "off" | "no"
        )
    })
}

/// Turns the hooks on for this process (the daemon, with the debug API).
pub fn enable() {
    HOOKS.enabled.store(true, Ordering::SeqCst);
}

/// Whether [`enable`] ran.
pub fn enabled() -> bool {
    HOOKS.enabled.load(Ordering::SeqCst)
}

/// What `POST /v1/debug/faults` arms (fields left out keep their value).
#[derive(Clone, Copy, Debug, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FaultArm {
    /// Scatters that flip one arena byte first.
    pub flip_scatter_bytes: Option<u32>,
    /// Delay of each delayed gather (ms, at most 60,000).
    pub gather_delay_ms: Option<u64>,
    /// Gathers to delay.
    pub delayed_gathers: Option<u32>,
    /// Delay of each delayed engine Transfer before it is routed (ms, at
    /// most 60,000).
    pub route_delay_ms: Option<u64>,
    /// Engine Transfers (to another agent's engine) to delay.
    pub delayed_routes: Option<u32>,
}

/// The hooks' state (armed counts left, and what fired so far).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct FaultState {
    /// Whether the hooks are enabled in this process.
    pub enabled: bool,
    /// Scatter flips still armed.
    pub flips_armed: u32,
    /// Bytes flipped so far.
    pub flipped: u64,
    /// Gather delay (ms).
    pub gather_delay_ms: u64,
    /// Delayed gathers still armed.
    pub delays_armed: u32,
    /// Gathers delayed so far.
    pub delayed: u64,
    /// Route delay (ms).
    pub route_delay_ms: u64,
    /// Delayed routes still armed.
    pub routes_armed: u32,
    /// Engine Transfers delayed before routing so far.
    pub routes_delayed: u64,
}

/// The current state.
pub fn state() -> FaultState {
    HOOKS.state()
}

/// Arms the hooks.
///
/// # Errors
/// The hooks are not enabled, or a delay over 60 s.
pub fn arm(a: FaultArm) -> Result<FaultState, String> {
    HOOKS.arm(a)
}

/// Before a gather: waits the armed delay if one is armed.
pub fn before_gather() {
    if let Some(ms) = HOOKS.take_delay() {
        tracing::warn!(ms, "TEST FAULT: gather delayed");
        std::thread::sleep(Duration::from_millis(ms));
    }
}

/// Before an engine Transfer to another agent's engine is routed: waits
/// the armed delay if one is armed.
pub fn before_route() {
    if let Some(ms) = HOOKS.take_route_delay() {
        tracing::warn!(ms, "TEST FAULT: engine transfer routing delayed");
        std::thread::sleep(Duration::from_millis(ms));
    }
}

/// Before a scatter: whether to flip one arena byte first (consumes one
/// armed flip).
pub fn take_scatter_flip() -> bool {
    HOOKS.take_flip()
}

/// Counts a flip that happened (at `addr`).
pub fn flipped(addr: u64) {
    HOOKS.flipped.fetch_add(1, Ordering::SeqCst);
    tracing::warn!(
        addr = format_args!("{addr:#x}"),
        "TEST FAULT: one arena byte flipped before scatter"
    );
}

fn take(c: &AtomicU32) -> bool {
    c.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

impl Hooks {
    const fn new() -> Self {
        Self {
            enabled: AtomicBool::new(false),
            flips_armed: AtomicU32::new(0),
            flipped: AtomicU64::new(0),
            delay_ms: AtomicU64::new(0),
            delays_armed: AtomicU32::new(0),
            delayed: AtomicU64::new(0),
            route_delay_ms: AtomicU64::new(0),
            routes_armed: AtomicU32::new(0),
            routes_delayed: AtomicU64::new(0),
        }
    }

    fn is_on(&self) -> bool {
        self.enabled.load(Ordering::SeqCst)
    }

    fn state(&self) -> FaultState {
        FaultState {
            enabled: self.is_on(),
            flips_armed: self.flips_armed.load(Ordering::SeqCst),
            flipped: self.flipped.load(Ordering::SeqCst),
            gather_delay_ms: self.delay_ms.load(Ordering::SeqCst),
            delays_armed: self.delays_armed.load(Ordering::SeqCst),
            delayed: self.delayed.load(Ordering::SeqCst),
            route_delay_ms: self.route_delay_ms.load(Ordering::SeqCst),
            routes_armed: self.routes_armed.load(Ordering::SeqCst),
            routes_delayed: self.routes_delayed.load(Ordering::SeqCst),
        }
    }

    fn arm(&self, a: FaultArm) -> Result<FaultState, String> {
        if !self.is_on() {
            return Err(format!("test faults are off ({ENV}=1 and --debug-api)"));
        }
        if a.gather_delay_ms.is_some_and(|d| d > 60_000) {
            return Err("gather_delay_ms: at most 60000".into());
        }
        if a.route_delay_ms.is_some_and(|d| d > 60_000) {
            return Err("route_delay_ms: at most 60000".into());
        }
        if let Some(n) = a.flip_scatter_bytes {
            self.flips_armed.store(n, Ordering::SeqCst);
        }
        if let Some(d) = a.gather_delay_ms {
            self.delay_ms.store(d, Ordering::SeqCst);
        }
        if let Some(n) = a.delayed_gathers {
            self.delays_armed.store(n, Ordering::SeqCst);
        }
        if let Some(d) = a.route_delay_ms {
            self.route_delay_ms.store(d, Ordering::SeqCst);
        }
        if let Some(n) = a.delayed_routes {
            self.routes_armed.store(n, Ordering::SeqCst);
        }
        tracing::warn!(?a, "TEST FAULTS armed");
        Ok(self.state())
    }

    /// The delay to wait before this gather, when one is armed.
    fn take_delay(&self) -> Option<u64> {
        if !self.is_on() || !take(&self.delays_armed) {
            return None;
        }
        self.delayed.fetch_add(1, Ordering::SeqCst);
        Some(self.delay_ms.load(Ordering::SeqCst))
    }

    /// The delay to wait before routing this engine Transfer, when one is
    /// armed.
    fn take_route_delay(&self) -> Option<u64> {
        if !self.is_on() || !take(&self.routes_armed) {
            return None;
        }
        self.routes_delayed.fetch_add(1, Ordering::SeqCst);
        Some(self.route_delay_ms.load(Ordering::SeqCst))
    }

    fn take_flip(&self) -> bool {
        self.is_on() && take(&self.flips_armed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_fires_until_enabled_and_armed() {
        // A private instance: the process-wide hooks stay off for the
        // other tests of this binary.
        let h = Hooks::new();
        assert!(!h.take_flip());
        let flip = FaultArm {
            flip_scatter_bytes: Some(1),
            ..FaultArm::default()
        };
        assert!(h.arm(flip).is_err(), "arming needs enable");
        h.enabled.store(true, Ordering::SeqCst);
        assert!(!h.take_flip(), "enabled but not armed");
        h.arm(FaultArm {
            flip_scatter_bytes: Some(2),
            gather_delay_ms: Some(7),
            delayed_gathers: Some(1),
            route_delay_ms: Some(9),
            delayed_routes: Some(1),
        })
        .unwrap();
        assert!(h.take_flip());
        assert!(h.take_flip());
        assert!(!h.take_flip());
        assert_eq!(h.take_delay(), Some(7));
        assert_eq!(h.take_delay(), None);
        assert_eq!(h.state().delayed, 1);
        assert_eq!(h.take_route_delay(), Some(9));
        assert_eq!(h.take_route_delay(), None);
        assert_eq!(h.state().routes_delayed, 1);
        assert!(h
            .arm(FaultArm {
                gather_delay_ms: Some(60_001),
                ..FaultArm::default()
            })
            .is_err());
        assert!(h
            .arm(FaultArm {
                route_delay_ms: Some(60_001),
                ..FaultArm::default()
            })
            .is_err());
        // The process-wide hooks were never enabled here.
        assert!(!enabled() && !take_scatter_flip());
    }
}
