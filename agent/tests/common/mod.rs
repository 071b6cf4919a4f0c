//! Shared fixtures for the agent's end-to-end tests: fabric agents over
//! real NIXL (loopback) with host KV pools, pattern fill and verification.
#![allow(dead_code)]

pub mod etcd;
pub mod proc;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvfabric_agent::core::config::BounceConfig;
use kvfabric_agent::core::Descriptor;
use kvfabric_agent::runtime::control::zmq::BindAddr;
use kvfabric_agent::runtime::engine::{EngineError, MemDesc, MemKind};
use kvfabric_agent::runtime::fabric::{FabricAgent, FabricOptions};
use kvfabric_agent::runtime::transport::TransportStats;

/// A page-aligned host buffer used as a KV pool.
pub struct Pool {
    pub buf: Vec<u8>,
}

impl Pool {
    pub fn new(len: usize) -> Self {
        Self {
            buf: vec![0u8; len],
        }
    }
    pub fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }
    pub fn desc(&self) -> (MemKind, MemDesc) {
        (
            MemKind::Dram,
            MemDesc::host(self.addr(), self.buf.len() as u64),
        )
    }
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A unique agent name (pid + counter + label).
pub fn unique(label: &str) -> String {
    format!(
        "{label}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// A test config: small arena, min descriptor count 1.
pub fn test_config(arena: &str, max_chunk: &str, w: u32) -> BounceConfig {
    let mut c = BounceConfig::default();
    c.apply_env_vars([
        ("KVFABRIC_BOUNCE_ENABLE", "1"),
        ("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", arena),
        (
            "KVFABRIC_BOUNCE_ARENA_ALLOCATION_GRANULARITY_BYTES",
            "64KiB",
        ),
        ("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", max_chunk),
        (
            "KVFABRIC_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST",
            &w.to_string(),
        ),
        ("KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT", "1"),
        ("KVFABRIC_BOUNCE_REQUEST_TIMEOUT_MS", "5000"),
        ("KVFABRIC_BOUNCE_SCATTER_WORKER_COUNT", "2"),
    ]);
    c
}

/// Builds an agent over `pools`, or `None` (with a printed reason) when the
/// NIXL runtime is not installed.
pub fn agent(label: &str, cfg: &BounceConfig, pools: &[&Pool]) -> Option<FabricAgent> {
    agent_with_auth(label, cfg, pools, Default::default())
}

/// [`agent`] with a control key (`controlAuth`).
#[allow(dead_code)]
pub fn agent_with_auth(
    label: &str,
    cfg: &BounceConfig,
    pools: &[&Pool],
    control_auth: kvfabric_agent::runtime::control::auth::ControlAuth,
) -> Option<FabricAgent> {
    let eff = cfg.validate().expect("valid test config");
    match FabricAgent::new(FabricOptions {
        name: unique(label),
        config: eff,
        kv_regions: pools.iter().map(|p| p.desc()).collect(),
        bind: BindAddr::Loopback,
        copy: None,
        control_auth,
    }) {
        Ok(a) => Some(a),
        Err(EngineError::Runtime(e)) => {
            skip(&format!("NIXL runtime not available: {e}"));
            None
        }
        Err(e) => panic!("creating fabric agent: {e}"),
    }
}

/// Set by `.ci/run`: a missing service or runtime (etcd, NIXL) fails the
/// test instead of skipping it — CI installs them, so a skip there would
/// hide a broken install step.
pub const REQUIRE_ENV: &str = "KVFABRIC_REQUIRE_SERVICES";

/// Prints `SKIP: why` (the caller then returns), or panics when
/// [`REQUIRE_ENV`] is set.
pub fn skip(why: &str) {
    if std::env::var_os(REQUIRE_ENV).is_some() {
        panic!("{why} (required here: {REQUIRE_ENV} is set)");
    }
    eprintln!("SKIP: {why}");
}

/// Loads each agent into the other.
pub fn connect(a: &FabricAgent, b: &FabricAgent) {
    a.load_peer(&b.local_descriptor().unwrap()).unwrap();
    b.load_peer(&a.local_descriptor().unwrap()).unwrap();
}

/// Deterministic byte for (seed, index): distinct per transfer.
pub fn pattern(seed: u64, i: u64) -> u8 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    (x ^ (x >> 29)) as u8
}

/// A permutation of `n` slots (the bench's, deterministic per seed).
#[allow(unused_imports)] // not every test crate uses it
pub use kvfabric_agent::bench::pattern::permutation;

/// `count` blocks of `block` bytes: src slot `src_base + i` → dst slot
/// `perm[i]` (both in block units, random scatter on the receiver).
pub fn block_descs(
    src: &Pool,
    src_first_slot: usize,
    dst: &Pool,
    dst_slots: &[usize],
    block: usize,
) -> Vec<Descriptor> {
    dst_slots
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            Descriptor::new(
                src.addr() + ((src_first_slot + i) * block) as u64,
                dst.addr() + (d * block) as u64,
                block as u64,
            )
        })
        .collect()
}

/// Fills the source bytes of `descs` with the transfer's pattern.
pub fn fill(src: &mut Pool, descs: &[Descriptor], seed: u64) {
    let base = src.addr();
    for (k, d) in descs.iter().enumerate() {
        let off = (d.src - base) as usize;
        for j in 0..d.len as usize {
            src.buf[off + j] = pattern(seed, (k as u64) << 32 | j as u64);
        }
    }
}

/// Checks every destination byte of `descs`; returns the first mismatch.
pub fn verify(dst: &Pool, descs: &[Descriptor], seed: u64) -> Result<(), String> {
    let base = dst.addr();
    for (k, d) in descs.iter().enumerate() {
        let off = (d.dst - base) as usize;
        for j in 0..d.len as usize {
            let want = pattern(seed, (k as u64) << 32 | j as u64);
            let got = dst.buf[off + j];
            if got != want {
                return Err(format!(
                    "descriptor {k} byte {j}: got {got:#04x}, want {want:#04x}"
                ));
            }
        }
    }
    Ok(())
}

/// [`test_config`] with extra `KVFABRIC_BOUNCE_*` overrides; panics on a
/// variable that does not apply (a typo would silently test the default).
pub fn config_with(arena: &str, max_chunk: &str, w: u32, extra: &[(&str, &str)]) -> BounceConfig {
    let mut c = test_config(arena, max_chunk, w);
    let warnings = c.apply_env_vars(extra.iter().copied());
    assert!(
        warnings.is_empty(),
        "config overrides {extra:?}: {warnings:?}"
    );
    c
}

/// Polls `cond` every millisecond until it holds or `within` elapses;
/// returns whether it held.
pub fn wait_for(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The bounce transport's counters of `agent` (bounce must be up).
pub fn tstats(agent: &FabricAgent) -> std::sync::Arc<TransportStats> {
    agent.transport().expect("bounce up").shared_stats()
}

/// Reads a counter.
pub fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::SeqCst)
}

/// Waits (at most `within`) until `agent`'s transport is quiesced: every
/// arena byte free, no flows, no send requests, no send-side orphans; the
/// conservation check must hold at every sample. Panics with the last
/// snapshot otherwise.
pub fn assert_quiesced(agent: &FabricAgent, within: Duration) {
    let t = agent.transport().expect("bounce up");
    let deadline = Instant::now() + within;
    loop {
        let s = t.snapshot().expect("snapshot");
        assert_eq!(s.conservation, Ok(()), "conservation on {}", agent.name());
        if s.free_bytes == s.capacity
            && s.flows == 0
            && s.send_requests == 0
            && s.send_orphans == 0
            && s.orphaned_bytes == 0
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{}: not quiesced within {within:?}: {s:?}",
            agent.name()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Routes the agent's `tracing` output to the test's captured output,
/// filtered by `RUST_LOG` (off when unset). Idempotent.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}
