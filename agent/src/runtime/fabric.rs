//! The fabric agent (seed §4 "NixlTransferAgent integration", §9, §10): one
//! NIXL agent with registered KV memory, the bounce transport when it can be
//! built (any init failure warns and falls back to the standard path, never
//! fails construction), the capability handshake per peer, the routing gate
//! (`should_use_bounce`) and the standard per-descriptor NIXL path.
//!
//! The arena is host memory by default ([`ArenaChoice::Host`]); with the
//! `cuda` feature, [`ArenaChoice::Cuda`] puts it in device memory
//! (registered with NIXL as VRAM) and gathers/scatters with the CUDA copy
//! engine. The bounce path serves transfers whose memory kinds equal the
//! arena's; the standard path uses the kind of the KV regions.
//!
//! Remote memory kind: the handshake carries none, so a peer's arena is
//! assumed to be of the same kind as ours (a VRAM agent bounces to VRAM
//! agents); the GRANTs carry the peer's device id. A peer's KV memory for
//! the standard path defaults to our own KV kind and device and can be set
//! per peer with [`FabricAgent::set_peer_memory`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use kvfabric_core::config::EffectiveBounceConfig;
use kvfabric_core::text::LogSafe;
use kvfabric_core::wire::{
    self, Handshake, Notice, CAP_BLOCK_DATA, CAP_UNIFORM_DATA, WIRE_VERSION,
};
use kvfabric_core::{ControlKind, Descriptor};

use super::arena::HostArena;
use super::control::notif::NixlNotifControlChannel;
use super::control::zmq::{BindAddr, ZmqControlChannel};
use super::control::ControlChannel;
#[cfg(feature = "cuda")]
use super::cuda::{CudaArena, CudaBoundEngine, CudaCopyConfig, CudaCopyEngine, CudaGpu};
use super::engine::{EngineError, MemDesc, MemKind, NixlTransferEngine, TransferEngine, XferState};
use super::exec::{CopyEngine, HostCopyEngine};
use super::transport::{
    ArenaSpec, BounceTransport, Completion, TransferHandle, TransferOutcome, TransportSettings,
};

/// What a peer publishes so others can write to it: its NIXL metadata and
/// (when bounce is up) its handshake blob. Serialized into discovery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerDescriptor {
    /// NIXL agent name (carries the incarnation).
    pub name: String,
    /// Serialized NIXL metadata (`getLocalMD`).
    pub nixl_metadata: Vec<u8>,
    /// Encoded [`Handshake`], or `None` when bounce is off/unavailable.
    pub handshake: Option<Vec<u8>>,
    /// The agent is draining for a reconfiguration (no handshake meanwhile;
    /// bounce comes back with the next generation's).
    pub draining: bool,
}

/// Which path a transfer took.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PathKind {
    /// Gather → one write per chunk → scatter.
    Bounce,
    /// One NIXL descriptor per block.
    Standard,
}

/// Why a peer is not bounce-capable (seed §9 "peer incompatible").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Incompatibility {
    /// We run without bounce.
    LocalBounceOff,
    /// The peer advertises no handshake.
    NoHandshake,
    /// Undecodable handshake.
    Malformed(String),
    /// Wire version differs.
    WireVersion {
        /// Ours.
        local: u16,
        /// Theirs.
        peer: u16,
    },
    /// Control kind differs.
    ControlKind {
        /// Ours.
        local: ControlKind,
        /// Theirs.
        peer: ControlKind,
    },
    /// Max chunk size differs.
    MaxChunk {
        /// Ours (bytes).
        local: u64,
        /// Theirs (bytes).
        peer: u64,
    },
    /// The peer's control endpoint could not be registered.
    Endpoint(String),
    /// This agent or the peer is draining for a reconfiguration (bounce
    /// comes back with the next generation's handshake).
    Draining,
    /// Config (rollout) generations differ (issue 14: bounce runs only
    /// between agents of the same generation; mixed pairs use the standard
    /// path while a rollout advances).
    ConfigGeneration {
        /// Ours.
        local: u64,
        /// Theirs.
        peer: u64,
    },
    /// One side requires signed control hellos and the other does not sign
    /// (`controlAuth` required vs off): their control connections would be
    /// refused (handshake bits [`wire::CAP_CONTROL_SIGNED`],
    /// [`wire::CAP_CONTROL_REQUIRED`]).
    ControlAuth {
        /// We require signed hellos (else: the peer does, and we do not
        /// sign).
        local_requires: bool,
    },
}

/// The handshake bits of a control-key mode: `optional` signs, `required`
/// signs and requires.
fn control_auth_bits(mode: crate::runtime::control::auth::AuthMode) -> u32 {
    use crate::runtime::control::auth::AuthMode;
    match mode {
        AuthMode::Off => 0,
        AuthMode::Optional => wire::CAP_CONTROL_SIGNED,
        AuthMode::Required => wire::CAP_CONTROL_SIGNED | wire::CAP_CONTROL_REQUIRED,
    }
}

/// What we know of a loaded peer.
#[derive(Clone, Debug)]
pub struct PeerState {
    /// `Ok(handshake)` when bounce-capable, else why not.
    pub bounce: Result<Handshake, Incompatibility>,
    /// The peer's handshake blob as published (re-evaluated when our own
    /// config generation changes).
    pub handshake_blob: Option<Vec<u8>>,
    /// The peer said it is draining for a reconfiguration.
    pub draining: bool,
    /// The peer's KV memory (the standard path's remote kind and device).
    pub memory: PeerMemory,
    /// [`metadata_fingerprint`] of the NIXL metadata loaded for it (which
    /// memory registrations of the peer NIXL knows).
    pub metadata: u64,
}

/// A fingerprint of a peer's NIXL metadata blob (64-bit SipHash with fixed
/// keys: equal blobs, equal fingerprints, in every process): tells whether
/// the metadata NIXL has loaded for a peer is the one a discovery record
/// carries.
pub fn metadata_fingerprint(blob: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    blob.hash(&mut h);
    h.finish()
}

/// Kind and device of a peer's KV memory, as the standard path names its
/// remote descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerMemory {
    /// NIXL memory kind.
    pub kind: MemKind,
    /// Device id (GPU ordinal for VRAM, 0 for DRAM).
    pub device_id: u64,
}

/// Where the bounce arena lives.
#[derive(Clone, Default)]
pub enum ArenaChoice {
    /// Host memory (NIXL DRAM) with the host `memcpy` copy engine.
    #[default]
    Host,
    /// Device memory of `gpu` (NIXL VRAM, device id = its ordinal) with the
    /// CUDA gather/scatter copy engine built from `copy` (its stream count is
    /// raised to the config's copy stream / scatter worker counts). Every
    /// NIXL call of the agent runs with the GPU's context current.
    #[cfg(feature = "cuda")]
    Cuda {
        /// The GPU (kernels compiled).
        gpu: Arc<CudaGpu>,
        /// Copy engine settings.
        copy: CudaCopyConfig,
    },
}

impl std::fmt::Debug for ArenaChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ArenaChoice::Host => f.write_str("Host"),
            #[cfg(feature = "cuda")]
            ArenaChoice::Cuda { gpu, copy } => f
                .debug_struct("Cuda")
                .field("device", &gpu.info().ordinal)
                .field("copy", copy)
                .finish(),
        }
    }
}

impl ArenaChoice {
    /// The memory kind of the arena (and of transfers bounce serves).
    pub fn kind(&self) -> MemKind {
        match self {
            ArenaChoice::Host => MemKind::Dram,
            #[cfg(feature = "cuda")]
            ArenaChoice::Cuda { .. } => MemKind::Vram,
        }
    }
}

/// Base address of an arena (the address it was registered with).
fn arena_base(a: &ArenaMem) -> u64 {
    match a {
        ArenaMem::Host(h) => h.base_addr(),
        #[cfg(feature = "cuda")]
        ArenaMem::Cuda(c) => c.mem_desc().addr,
    }
}

/// The arena memory the agent owns (kept alive while the transport runs).
enum ArenaMem {
    Host(HostArena),
    #[cfg(feature = "cuda")]
    Cuda(CudaArena),
}

/// Counters of the fabric agent (exported by the agent service).
#[derive(Debug, Default)]
pub struct FabricStats {
    /// Submissions routed to bounce.
    pub submit_bounce: AtomicU64,
    /// Submissions routed to the standard path.
    pub submit_standard: AtomicU64,
    /// Payload bytes submitted to bounce.
    pub bytes_bounce: AtomicU64,
    /// Payload bytes submitted to the standard path.
    pub bytes_standard: AtomicU64,
    /// Bounce initialisations that failed (fell back to standard).
    pub fallbacks: AtomicU64,
    /// Standard-path transfers that failed.
    pub standard_failed: AtomicU64,
    /// Standard-path transfers posted and not yet resolved (a gauge).
    pub standard_in_flight: AtomicU64,
    /// Peers loaded.
    pub peers_loaded: AtomicU64,
    /// Peers forgotten.
    pub peers_forgotten: AtomicU64,
}

/// Construction options of a [`FabricAgent`].
pub struct FabricOptions {
    /// NIXL agent name (unique per process start).
    pub name: String,
    /// The validated bounce config.
    pub config: EffectiveBounceConfig,
    /// Memory the agent moves KV from/to; registered once here and allowed
    /// as a scatter destination.
    pub kv_regions: Vec<(MemKind, MemDesc)>,
    /// Where the ZMQ control channel binds.
    pub bind: BindAddr,
    /// Copy engine for gathers/scatters (host by default).
    pub copy: Option<Arc<dyn CopyEngine>>,
    /// The fabric's control key (`controlKeyFile` / `controlAuth`; off by
    /// default): signs and checks the TCP control channel's hellos. A key
    /// with another control transport fails the bounce set-up.
    pub control_auth: crate::runtime::control::auth::ControlAuth,
}

struct StdXfer {
    /// Request id (from [`STD_RID_BASE`] up), logged on failure.
    rid: u64,
    /// The destination agent (named in failure reasons).
    peer: String,
    /// Posted at; the transfer fails when it has not completed by
    /// `posted + timeout` (`requestTimeoutMs`, seed R5).
    deadline: Instant,
    handle: super::engine::XferHandle,
    lists: (super::engine::PreparedList, super::engine::PreparedList),
    completion: Arc<Completion>,
}

/// The agent: engine + optional bounce transport + peers + standard path.
pub struct FabricAgent {
    name: String,
    engine: Arc<dyn TransferEngine>,
    /// The bounce side, replaced whole by [`FabricAgent::reconfigure`].
    bounce: RwLock<BounceSide>,
    /// Set while a reconfiguration drains: no new bounce submissions
    /// ([`Incompatibility::Draining`] for bounce-only transfers).
    draining: AtomicBool,
    /// Set while a reconfiguration has taken the old side out (its
    /// transport stopping, the new one building): a withdrawn scatter range
    /// is safe only once that ended.
    rebuilding: AtomicBool,
    /// Whether the standard poller drives NIXL progress (true while no
    /// transport's IO thread does).
    std_progress: Arc<AtomicBool>,
    arena_choice: ArenaChoice,
    bind: BindAddr,
    control_auth: crate::runtime::control::auth::ControlAuth,
    copy: Option<Arc<dyn CopyEngine>>,
    kv_regions: Vec<(MemKind, MemDesc)>,
    /// Scatter destinations allowed beyond the KV regions (engine pools),
    /// `(scope, addr, len)` (scope 0: unscoped, else the engine session's
    /// scope); re-allowed on every rebuilt transport.
    scatter_ranges: Mutex<Vec<(u64, u64, u64)>>,
    /// Where NOTICEs go; set on every rebuilt transport.
    notice_sink: Mutex<Option<Sender<(String, Notice)>>>,
    arena_kind: MemKind,
    kv_memory: PeerMemory,
    peers: Mutex<HashMap<String, PeerState>>,
    stats: Arc<FabricStats>,
    std_tx: Option<Sender<StdXfer>>,
    std_thread: Option<JoinHandle<()>>,
    /// How long a standard-path handle's wait polls before blocking (the
    /// busy-poll window, as for bounce handles).
    wait_spin: Duration,
    /// Recent standard-path waits: their callers spin only while those
    /// paid (`KVFABRIC_SPIN_ADAPTIVE`, [`crate::runtime::spin::SpinHistory`]).
    std_wait_history: Option<Arc<crate::runtime::spin::SpinHistory>>,
    /// The spin switches (`KVFABRIC_SPIN_*`), read once at start-up: the
    /// standard path's waiters and every bounce transport built use them
    /// (`KVFABRIC_SPIN_WAITERS` once per process: the cap is process-wide).
    spin_env: crate::runtime::spin::SpinEnv,
    /// Next standard-path request id.
    std_next_rid: AtomicU64,
    /// Bound on one standard-path transfer: the config's
    /// `requestTimeoutMs` (seed R5: every path resolves within it).
    std_timeout: Duration,
}

/// The bounce side of a [`FabricAgent`]: one config, its arena, transport
/// and handshake. A reconfiguration replaces it whole.
struct BounceSide {
    config: EffectiveBounceConfig,
    /// Config (rollout) generation in force, whether or not bounce runs
    /// (the handshake carries it too when it does).
    generation: u64,
    transport: Option<Arc<BounceTransport>>,
    arena: Option<ArenaMem>,
    handshake: Option<Handshake>,
    /// Why bounce is off, if it is.
    unavailable: Option<String>,
}

/// Why a bounce side could not be built, and the kept control channel
/// when the build failed before using it.
type BuildFailure = (String, Option<Box<dyn ControlChannel>>);

/// What a new transport starts with (see [`TransportSettings`]).
struct TransportInit {
    allowed: Vec<(u64, u64)>,
    scoped: Vec<(u64, u64, u64)>,
    notice_sink: Option<Sender<(String, Notice)>>,
    first_request_id: u64,
    stats: Option<Arc<super::transport::TransportStats>>,
}

/// How a [`FabricAgent::reconfigure`] went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reconfigured {
    /// The new config runs (arena rebuilt, or only the generation changed
    /// when the config was the same).
    Applied {
        /// The arena was rebuilt (false: same config, generation only).
        rebuilt: bool,
    },
    /// The new config could not be built; the previous config was rebuilt
    /// and runs again (`why` names what failed).
    RolledBack {
        /// Why the new config was refused.
        why: String,
    },
    /// Neither the new nor the previous config could be built: the agent
    /// runs the standard path only.
    BounceLost {
        /// What failed.
        why: String,
    },
}

impl FabricAgent {
    /// Creates the NIXL agent, registers the KV memory and, when the config
    /// enables bounce, builds arena + control channel + transport. A bounce
    /// failure is logged and counted as a fallback; the agent then uses the
    /// standard path only.
    ///
    /// # Errors
    /// Only when the NIXL agent itself cannot be created or KV memory cannot
    /// be registered.
    pub fn new(opts: FabricOptions) -> Result<Self, EngineError> {
        Self::with_arena(opts, ArenaChoice::Host)
    }

    /// [`FabricAgent::new`] with the arena in `arena` (host or, with the
    /// `cuda` feature, GPU memory). The standard path uses the kind and
    /// device of the first KV region (the arena's kind when there is none).
    ///
    /// # Errors
    /// As [`FabricAgent::new`].
    pub fn with_arena(opts: FabricOptions, arena: ArenaChoice) -> Result<Self, EngineError> {
        let nixl: Arc<dyn TransferEngine> = Arc::new(NixlTransferEngine::new(&opts.name)?);
        let engine: Arc<dyn TransferEngine> = match &arena {
            ArenaChoice::Host => nixl,
            #[cfg(feature = "cuda")]
            ArenaChoice::Cuda { gpu, .. } => Arc::new(CudaBoundEngine::new(nixl, gpu.clone())),
        };
        let arena_kind = arena.kind();
        let kv_memory = opts
            .kv_regions
            .first()
            .map(|(kind, d)| PeerMemory {
                kind: *kind,
                device_id: d.device_id,
            })
            .unwrap_or(PeerMemory {
                kind: arena_kind,
                device_id: 0,
            });
        for (kind, desc) in &opts.kv_regions {
            engine.register_region(*kind, *desc)?;
        }
        let stats = Arc::new(FabricStats::default());
        let spin_env = crate::runtime::spin::SpinEnv::read();
        let mut agent = Self {
            name: opts.name.clone(),
            engine: engine.clone(),
            bounce: RwLock::new(BounceSide {
                config: opts.config.clone(),
                generation: 0,
                transport: None,
                arena: None,
                handshake: None,
                unavailable: None,
            }),
            draining: AtomicBool::new(false),
            rebuilding: AtomicBool::new(false),
            std_progress: Arc::new(AtomicBool::new(true)),
            arena_choice: arena.clone(),
            bind: opts.bind.clone(),
            control_auth: opts.control_auth.clone(),
            copy: opts.copy.clone(),
            kv_regions: opts.kv_regions.clone(),
            scatter_ranges: Mutex::new(Vec::new()),
            notice_sink: Mutex::new(None),
            arena_kind,
            kv_memory,
            peers: Mutex::new(HashMap::new()),
            stats: stats.clone(),
            std_tx: None,
            std_thread: None,
            // Only agents that run bounce spin (the window is a bounce
            // setting).
            wait_spin: if opts.config.enabled() {
                opts.config.busy_poll(host_cpus())
            } else {
                Duration::ZERO
            },
            std_wait_history: spin_env
                .adaptive
                .then(|| Arc::new(crate::runtime::spin::SpinHistory::new())),
            spin_env,
            std_timeout: Duration::from_millis(opts.config.request_timeout_ms()),
            std_next_rid: AtomicU64::new(STD_RID_BASE),
        };
        let (side, _) = agent.build_side(opts.config.clone(), 0, None, None, &[]);
        if let Some(why) = &side.unavailable {
            if opts.config.enabled() {
                tracing::warn!(agent = %opts.name, reason = %why, "bounce initialisation failed; using the standard NIXL path");
            }
        }
        agent.std_progress = Arc::new(AtomicBool::new(side.transport.is_none()));
        *agent.bounce.get_mut().unwrap_or_else(|p| p.into_inner()) = side;
        let (tx, rx) = crossbeam_channel::unbounded();
        let eng = engine.clone();
        let st = stats.clone();
        let progress = agent.std_progress.clone();
        agent.std_thread = Some(
            std::thread::Builder::new()
                .name(format!("{}-std", opts.name))
                .spawn(move || standard_poller(eng, rx, st, progress))
                .expect("spawn standard-path poller"),
        );
        agent.std_tx = Some(tx);
        Ok(agent)
    }

    /// Allocates the arena of `choice`, registers it and returns it with
    /// its spec and the default copy engine for it.
    fn make_arena(
        engine: &Arc<dyn TransferEngine>,
        cfg: &EffectiveBounceConfig,
        choice: &ArenaChoice,
    ) -> Result<(ArenaMem, ArenaSpec, Arc<dyn CopyEngine>), String> {
        match choice {
            ArenaChoice::Host => {
                let arena =
                    HostArena::new(cfg.arena_size_bytes() as usize).map_err(|e| e.to_string())?;
                let desc = MemDesc::host(arena.base_addr(), arena.len() as u64);
                engine
                    .register_region(MemKind::Dram, desc)
                    .map_err(|e| format!("registering the arena: {e}"))?;
                let spec = ArenaSpec {
                    base: desc.addr,
                    len: desc.len,
                    kind: MemKind::Dram,
                    device_id: 0,
                };
                Ok((ArenaMem::Host(arena), spec, Arc::new(HostCopyEngine)))
            }
            #[cfg(feature = "cuda")]
            ArenaChoice::Cuda { gpu, copy } => {
                let arena = CudaArena::new(gpu, cfg.arena_size_bytes() as usize)
                    .map_err(|e| format!("allocating the GPU arena: {e}"))?;
                let desc = arena.mem_desc();
                engine
                    .register_region(MemKind::Vram, desc)
                    .map_err(|e| format!("registering the GPU arena as VRAM: {e}"))?;
                let mut copy = *copy;
                copy.streams = copy
                    .streams
                    .max(cfg.copy_stream_count() as usize)
                    .max(cfg.scatter_worker_count() as usize);
                let engine = CudaCopyEngine::new(gpu, copy)
                    .map_err(|e| format!("building the CUDA copy engine: {e}"))?;
                let spec = ArenaSpec {
                    base: desc.addr,
                    len: desc.len,
                    kind: MemKind::Vram,
                    device_id: desc.device_id,
                };
                Ok((ArenaMem::Cuda(arena), spec, Arc::new(engine)))
            }
        }
    }

    /// Builds a bounce side for `config` at `generation` (transport,
    /// arena, handshake), the KV regions and engine pools allowed as
    /// scatter destinations and the notice sink set. Never fails: a side
    /// that cannot be built says why in `unavailable` (a fallback counted).
    /// `reuse`: the previous transport's control channel, kept when its
    /// kind is the new config's (the endpoint then stays the same); it
    /// comes back when the build failed before using it (the arena could
    /// not be had). `carried`: the predecessor's next request id and
    /// counters, continued.
    fn build_side(
        &self,
        config: EffectiveBounceConfig,
        generation: u64,
        reuse: Option<Box<dyn ControlChannel>>,
        carried: Option<(u64, Arc<super::transport::TransportStats>)>,
        engine_ranges: &[(u64, u64, u64)],
    ) -> (BounceSide, Option<Box<dyn ControlChannel>>) {
        let off = |config, unavailable| BounceSide {
            config,
            generation,
            transport: None,
            arena: None,
            handshake: None,
            unavailable: Some(unavailable),
        };
        if !config.enabled() {
            return (off(config, "bounce disabled by config".into()), reuse);
        }
        let mut allowed: Vec<(u64, u64)> = self
            .kv_regions
            .iter()
            .map(|(_, d)| (d.addr, d.len))
            .collect();
        allowed.extend(
            engine_ranges
                .iter()
                .filter(|r| r.0 == 0)
                .map(|&(_, a, l)| (a, l)),
        );
        let init = TransportInit {
            allowed,
            scoped: engine_ranges.iter().filter(|r| r.0 != 0).copied().collect(),
            notice_sink: self
                .notice_sink
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            first_request_id: carried.as_ref().map_or(1, |c| c.0),
            stats: carried.map(|c| c.1),
        };
        match self.init_bounce(&config, reuse, init) {
            Ok((transport, arena, mut hs)) => {
                hs.config_generation = generation;
                let side = BounceSide {
                    config,
                    generation,
                    transport: Some(Arc::new(transport)),
                    arena: Some(arena),
                    handshake: Some(hs),
                    unavailable: None,
                };
                (side, None)
            }
            Err((why, back)) => {
                self.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
                (off(config, why), back)
            }
        }
    }

    fn init_bounce(
        &self,
        cfg: &EffectiveBounceConfig,
        reuse: Option<Box<dyn ControlChannel>>,
        init: TransportInit,
    ) -> Result<(BounceTransport, ArenaMem, Handshake), BuildFailure> {
        let (engine, name, bind) = (&self.engine, self.name.as_str(), &self.bind);
        let (copy, choice) = (self.copy.clone(), &self.arena_choice);
        let (arena, spec, default_copy) = match Self::make_arena(engine, cfg, choice) {
            Ok(a) => a,
            Err(e) => return Err((e, reuse)),
        };
        // Past this point a failure deregisters the arena before it is
        // freed (dropped with the error).
        let arena_base = spec.base;
        let fail = |e: String| {
            engine.deregister_region(arena_base);
            Err((e, None))
        };
        // NIXL notifications, else the `controlTransport` socket kind.
        let control_kind = cfg.control_kind();
        let auth = &self.control_auth;
        if auth.mode() != crate::runtime::control::auth::AuthMode::Off
            && control_kind != ControlKind::Tcp
        {
            return fail(format!(
                "the control key (controlAuth {:?}) authenticates only the TCP control channel; this config asks for {control_kind:?} (set controlTransport: tcp)",
                auth.mode()
            ));
        }
        let channel: Box<dyn ControlChannel> = match (reuse, control_kind) {
            (Some(c), _) => c,
            (None, ControlKind::Zmq) => match ZmqControlChannel::bind(name, bind.clone()) {
                Ok(c) => Box::new(c),
                Err(e) => return fail(format!("binding the ZMQ control channel: {e}")),
            },
            (None, ControlKind::Tcp) => {
                match crate::runtime::control::tcp::TcpControlChannel::bind_with_auth(
                    name,
                    bind.clone(),
                    auth.clone(),
                ) {
                    Ok(c) => Box::new(c),
                    Err(e) => return fail(format!("binding the TCP control channel: {e}")),
                }
            }
            (None, ControlKind::NixlNotif) => {
                Box::new(NixlNotifControlChannel::new(engine.clone()))
            }
        };
        let spin_env = self.spin_env;
        let settings = TransportSettings {
            granularity_bytes: cfg.granularity_bytes(),
            max_chunk_size_bytes: cfg.max_chunk_size_bytes(),
            solo_chunk_size_bytes: crate::runtime::transport::parse_solo_chunk(
                std::env::var("KVFABRIC_SOLO_CHUNK_BYTES").ok().as_deref(),
                cfg.max_chunk_size_bytes(),
                cfg.granularity_bytes(),
            ),
            block_gather: crate::runtime::transport::parse_on_switch(
                std::env::var("KVFABRIC_BLOCK_GATHER").ok().as_deref(),
            ),
            max_inflight_chunks: cfg.max_inflight_chunks_per_request() as usize,
            copy_contexts: cfg.copy_stream_count() as usize,
            copy_workers: cfg.scatter_worker_count() as usize,
            request_timeout: Duration::from_millis(cfg.request_timeout_ms()),
            eager_gather: cfg.config().enable_eager_gather,
            eager_grant_order: cfg.eager_grant_order(),
            release_staging_on_write: cfg.release_staging_on_write(),
            grant_policy: cfg.grant_policy(),
            grant_size_weight: cfg.grant_size_weight(),
            uniform_data: cfg.uniform_data(),
            block_data: cfg.block_data(),
            merge_runs: !cfg.config().disable_scatter_run_merging,
            batch_gathers: cfg.batch_gathers(),
            busy_poll: cfg.busy_poll(host_cpus()),
            spin_adaptive: spin_env.adaptive,
            spinning_workers: spin_env.workers,
            spin_relax: spin_env.relax,
            allowed_scatter_ranges: init.allowed,
            scoped_ranges: init.scoped,
            notice_sink: init.notice_sink,
            first_request_id: init.first_request_id,
            stats: init.stats,
        };
        let copy = copy.unwrap_or(default_copy);
        let transport = match BounceTransport::start(engine.clone(), channel, copy, spec, settings)
        {
            Ok(t) => t,
            Err(e) => return fail(e),
        };
        let hs = Handshake {
            wire_version: WIRE_VERSION,
            control_kind,
            arena_usable_capacity_bytes: cfg.arena_usable_capacity_bytes(),
            max_chunk_size_bytes: cfg.max_chunk_size_bytes(),
            endpoint: transport.local_endpoint().to_vec(),
            config_generation: 0,
            capabilities: if cfg.uniform_data() {
                CAP_UNIFORM_DATA
            } else {
                0
            } | if cfg.block_data() { CAP_BLOCK_DATA } else { 0 }
                | control_auth_bits(self.control_auth.mode()),
        };
        Ok((transport, arena, hs))
    }

    /// This agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The control-key mode its TCP control channel runs with
    /// (`controlAuth`; [`crate::runtime::control::auth`]).
    pub fn control_auth_mode(&self) -> crate::runtime::control::auth::AuthMode {
        self.control_auth.mode()
    }

    /// The engine (for tests and the agent service).
    pub fn engine(&self) -> &Arc<dyn TransferEngine> {
        &self.engine
    }

    fn side(&self) -> std::sync::RwLockReadGuard<'_, BounceSide> {
        self.bounce.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The bounce transport, when running (a reconfiguration replaces it;
    /// a clone held across one stays valid and resolves its requests).
    pub fn transport(&self) -> Option<Arc<BounceTransport>> {
        self.side().transport.clone()
    }

    /// Why bounce is off, if it is (disabled by config, or its
    /// initialisation failed).
    pub fn bounce_unavailable(&self) -> Option<String> {
        self.side().unavailable.clone()
    }

    /// The bounce config in force.
    pub fn bounce_config(&self) -> EffectiveBounceConfig {
        self.side().config.clone()
    }

    /// Config (rollout) generation in force (0 before any rollout), with
    /// or without bounce running.
    pub fn config_generation(&self) -> u64 {
        self.side().generation
    }

    /// Whether a reconfiguration is draining (no new bounce work).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Starts draining for a reconfiguration: from now on the routing gate
    /// sends nothing new through bounce (in-flight work continues), and
    /// [`FabricAgent::local_descriptor`] advertises no handshake, so peers
    /// stop sending WANTs. [`FabricAgent::reconfigure`] ends it.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether the bounce transport has no in-flight work (no send request,
    /// no granted flow); true without a transport.
    pub fn bounce_idle(&self) -> bool {
        match self.transport() {
            None => true,
            // A snapshot that does not answer (busy IO thread) is not idle.
            Some(t) => t
                .snapshot()
                .is_some_and(|s| s.send_requests == 0 && s.flows == 0),
        }
    }

    /// Replaces the bounce side with one built from `config` at
    /// `generation` (issue 14's in-process rollout; call after
    /// [`FabricAgent::begin_drain`] and a drain): the old transport is
    /// shut down (anything still in flight resolves FAILURE), its arena
    /// deregistered and freed (leaked when writes were in doubt), the new
    /// arena registered and its transport started with the KV regions and
    /// engine pools allowed and the notice sink set; every loaded peer's
    /// handshake is re-evaluated against the new one. Engine sessions and
    /// registered pools are untouched. When `config` equals the running
    /// config only the generation changes (no rebuild). When the new side
    /// cannot be built the previous config is rebuilt
    /// ([`Reconfigured::RolledBack`]). Ends the drain.
    pub fn reconfigure(&self, config: EffectiveBounceConfig, generation: u64) -> Reconfigured {
        // No new bounce work until the peers are re-evaluated against the
        // new side (a fresh transport has no routes before that).
        self.draining.store(true, Ordering::SeqCst);
        let result = self.replace_side(config, generation);
        self.reevaluate_peers();
        self.draining.store(false, Ordering::SeqCst);
        tracing::info!(agent = %self.name, generation = self.config_generation(), ?result, "bounce reconfigured");
        result
    }

    /// [`FabricAgent::reconfigure`]'s work. The lock is held only to swap
    /// sides: the old transport stops and the new arena is built outside
    /// it, while readers see a placeholder (no transport: the standard
    /// path; the old config and generation).
    fn replace_side(&self, config: EffectiveBounceConfig, generation: u64) -> Reconfigured {
        let mut old = {
            let mut side = self.bounce.write().unwrap_or_else(|p| p.into_inner());
            if side.config == config && (side.transport.is_some() || !config.enabled()) {
                side.generation = generation;
                if let Some(h) = &mut side.handshake {
                    h.config_generation = generation;
                }
                return Reconfigured::Applied { rebuilt: false };
            }
            let placeholder = BounceSide {
                config: side.config.clone(),
                generation: side.generation,
                transport: None,
                arena: None,
                handshake: None,
                unavailable: Some("reconfiguring".into()),
            };
            self.rebuilding.store(true, Ordering::SeqCst);
            std::mem::replace(&mut *side, placeholder)
        };
        let previous = old.config.clone();
        let previous_generation = old.generation;
        let previous_kind = previous.control_kind();
        let old_transport = old.transport.clone();
        let channel = self.retire_side(&mut old);
        // Request ids and counters continue on the next transport — read
        // once the old IO thread has stopped: a submit racing the retire
        // takes its id before that (and its WANT went out, or never will),
        // so no id is used twice towards a peer (receivers tombstone ended
        // flows by id).
        let carried = old_transport.map(|t| (t.next_request_id(), t.shared_stats()));
        // The control endpoint survives when the kind does: peers' routes
        // (and what they send meanwhile) stay valid.
        let (reuse, spare) = if config.control_kind() == previous_kind {
            (channel, None)
        } else {
            (None, channel)
        };
        // Engines' pools allowed or withdrawn meanwhile wait for the swap:
        // the new transport starts with exactly the ranges allowed now.
        let ranges = self
            .scatter_ranges
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (next, back_channel) =
            self.build_side(config.clone(), generation, reuse, carried.clone(), &ranges);
        let (side, result) = match (&next.unavailable, config.enabled()) {
            (Some(why), true) => {
                tracing::error!(agent = %self.name, generation, reason = %why, "the new bounce config cannot be built; rebuilding the previous one");
                // The channel comes back from a build that failed before
                // using it (else the previous kind's spare, if any).
                let (back, _) = self.build_side(
                    previous,
                    previous_generation,
                    back_channel.or(spare),
                    carried,
                    &ranges,
                );
                let r = match &back.unavailable {
                    None => Reconfigured::RolledBack { why: why.clone() },
                    Some(w2) => Reconfigured::BounceLost {
                        why: format!("{why}; the previous config failed too: {w2}"),
                    },
                };
                (back, r)
            }
            _ => (next, Reconfigured::Applied { rebuilt: true }),
        };
        let no_transport = side.transport.is_none();
        *self.bounce.write().unwrap_or_else(|p| p.into_inner()) = side;
        self.rebuilding.store(false, Ordering::SeqCst);
        drop(ranges);
        self.std_progress.store(no_transport, Ordering::SeqCst);
        result
    }

    /// Shuts the side's transport down and lets its arena go (leaked when
    /// writes were still in doubt at the transport's shutdown bound).
    /// Returns the transport's control channel (for the next side).
    fn retire_side(&self, side: &mut BounceSide) -> Option<Box<dyn ControlChannel>> {
        let t = side.transport.take()?;
        let channel = t.shutdown_keep_channel();
        let in_doubt = t.stats().arena_in_doubt.load(Ordering::SeqCst);
        side.handshake = None;
        if let Some(arena) = side.arena.take() {
            if in_doubt {
                tracing::error!(agent = %self.name, "leaking the old bounce arena: writes were still in flight at its shutdown");
                std::mem::forget(arena);
            } else {
                self.engine.deregister_region(arena_base(&arena));
                drop(arena);
            }
        }
        channel
    }

    /// Re-checks every loaded peer's stored handshake against ours (after
    /// our generation or transport changed). A peer reloaded or forgotten
    /// meanwhile keeps what that did.
    fn reevaluate_peers(&self) {
        let blobs: Vec<(String, Option<Vec<u8>>)> = self
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.handshake_blob.clone()))
            .collect();
        for (peer, blob) in blobs {
            let bounce = self.register_peer_handshake(&peer, blob.as_deref());
            if let Some(p) = self
                .peers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_mut(&peer)
            {
                if p.handshake_blob == blob {
                    p.bounce = bounce;
                }
            }
        }
    }

    /// The transport for a transfer to `peer` that must bounce (GPU pools
    /// have no other path; or the caller asked for bounce), riding out a
    /// config rollout instead of failing: while this agent drains, or the
    /// peer drains (it advertises no handshake meanwhile), it waits — at
    /// most `within` — and a peer at another config generation whose wire
    /// fields match (version, control kind, max chunk) is served anyway:
    /// generation isolation (issue 14) yields where the standard path
    /// cannot take the transfer.
    ///
    /// # Errors
    /// Why bounce to `peer` is not available (bounce off here, the peer
    /// unknown or incompatible, or still draining at the bound).
    pub fn bounce_transport_for(
        &self,
        peer: &str,
        within: Duration,
    ) -> Result<Arc<BounceTransport>, Incompatibility> {
        let deadline = Instant::now() + within;
        loop {
            let t = match (self.is_draining(), self.transport()) {
                (false, None) => return Err(Incompatibility::LocalBounceOff),
                (_, t) => t,
            };
            let state = self
                .peers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(peer)
                .map(|p| (p.bounce.clone(), p.draining));
            // Serve, refuse, or wait (draining here or there).
            match (self.is_draining(), state) {
                (_, None) => return Err(Incompatibility::NoHandshake),
                (true, _) | (false, Some((Err(Incompatibility::NoHandshake), true))) => {}
                (false, Some((Ok(_), _)))
                | (false, Some((Err(Incompatibility::ConfigGeneration { .. }), _))) => {
                    if let Some(t) = t {
                        return Ok(t);
                    }
                }
                (false, Some((Err(e), _))) => return Err(e),
            }
            if Instant::now() >= deadline {
                return Err(Incompatibility::Draining);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Allows `[addr, addr + len)` as an unscoped scatter destination
    /// (WANTs with scope 0) on this and every later transport.
    pub fn allow_scatter_range(&self, addr: u64, len: u64) {
        self.allow_scope(0, addr, len);
    }

    /// Opens engine scope `scope` with its pool `[addr, addr + len)` on
    /// this and every later transport (see [`BounceTransport::allow_scope`];
    /// scope 0 = [`allow_scatter_range`](Self::allow_scatter_range)).
    pub fn allow_scope(&self, scope: u64, addr: u64, len: u64) {
        // Held across the transport call: a rebuild swaps transports under
        // this lock, so the range reaches the old or the new one.
        let mut ranges = self
            .scatter_ranges
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        ranges.push((scope, addr, len));
        if let Some(t) = self.transport() {
            t.allow_scope(scope, addr, len);
        }
    }

    /// Closes engine scope `scope` (≥ 1) on this and every later transport:
    /// its receiver flows' senders are REJECTed at once, their queued
    /// scatters dropped, and their regions freed by the senders' cancels
    /// (see [`BounceTransport::forget_scope`]). Returns the flows told.
    /// Running scatters still finish: wait with
    /// [`disallow_scatter_range`](Self::disallow_scatter_range) before
    /// unmapping the pool.
    pub fn forget_scope(&self, scope: u64) -> usize {
        if scope == 0 {
            return 0;
        }
        // Out of the ranges under the lock (a rebuild then starts without
        // the scope); the IO thread is waited for without it.
        self.scatter_ranges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|r| r.0 != scope);
        self.transport().map_or(0, |t| t.forget_scope(scope))
    }

    /// Withdraws a range given to [`FabricAgent::allow_scatter_range`]
    /// (see [`BounceTransport::disallow_scatter_range`]; true without a
    /// transport).
    pub fn disallow_scatter_range(&self, addr: u64, len: u64, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        self.scatter_ranges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|r| (r.1, r.2) != (addr, len));
        // A transport being retired may still scatter into the range, and
        // the one being built may have been given it: wait for the swap.
        while self.rebuilding.load(Ordering::SeqCst) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ranges = self
            .scatter_ranges
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let left = deadline.saturating_duration_since(Instant::now());
        self.transport()
            .is_none_or(|t| t.disallow_scatter_range(addr, len, left))
    }

    /// Where NOTICEs from peers go, on this and every later transport.
    pub fn set_notice_sink(&self, tx: Sender<(String, Notice)>) {
        *self.notice_sink.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx.clone());
        if let Some(t) = self.transport() {
            t.set_notice_sink(tx);
        }
    }

    /// The memory kind of the bounce arena (bounce serves only transfers
    /// whose source and destination are of this kind).
    pub fn arena_kind(&self) -> MemKind {
        self.arena_kind
    }

    /// Kind and device of our KV memory (the standard path's local side).
    pub fn kv_memory(&self) -> PeerMemory {
        self.kv_memory
    }

    /// Sets the kind and device of `peer`'s KV memory for the standard path
    /// (default: the same as ours). Returns false when `peer` is not loaded.
    pub fn set_peer_memory(&self, peer: &str, memory: PeerMemory) -> bool {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        match peers.get_mut(peer) {
            Some(p) => {
                p.memory = memory;
                true
            }
            None => false,
        }
    }

    /// [`metadata_fingerprint`] of the NIXL metadata loaded for `peer`
    /// (`None`: not loaded). A discovery record whose blob has another
    /// fingerprint names memory NIXL does not know yet (e.g. an engine's
    /// pool registered a moment ago, before the peer sync reloaded it).
    pub fn peer_metadata(&self, peer: &str) -> Option<u64> {
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(peer)
            .map(|p| p.metadata)
    }

    fn peer_memory(&self, peer: &str) -> PeerMemory {
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(peer)
            .map_or(self.kv_memory, |p| p.memory)
    }

    /// Counters.
    pub fn stats(&self) -> &FabricStats {
        &self.stats
    }

    /// The local handshake, when bounce is up.
    pub fn handshake(&self) -> Option<Handshake> {
        self.side().handshake.clone()
    }

    /// Overrides the handshake's config generation (the operator's rollout
    /// generation) without rebuilding anything; loaded peers are
    /// re-evaluated.
    pub fn set_config_generation(&self, generation: u64) {
        {
            let mut side = self.bounce.write().unwrap_or_else(|p| p.into_inner());
            side.generation = generation;
            if let Some(h) = &mut side.handshake {
                h.config_generation = generation;
            }
        }
        self.reevaluate_peers();
    }

    /// What peers need to load us.
    ///
    /// # Errors
    /// When NIXL cannot serialize its metadata.
    pub fn local_descriptor(&self) -> Result<PeerDescriptor, EngineError> {
        Ok(PeerDescriptor {
            name: self.name.clone(),
            nixl_metadata: self.engine.local_metadata()?,
            // Draining: advertise none, so peers send no new WANTs.
            handshake: if self.is_draining() {
                None
            } else {
                self.side().handshake.as_ref().map(wire::encode_handshake)
            },
            draining: self.is_draining(),
        })
    }

    /// Loads a peer (seed `loadRemoteAgent` → `registerPeerHandshake`): its
    /// NIXL metadata, then its handshake, validated against ours (version,
    /// control kind, max chunk size) and its endpoint registered. Returns
    /// the peer's state; an incompatible peer silently uses the standard
    /// path (no WANT is ever sent to it).
    ///
    /// # Errors
    /// When NIXL rejects the metadata, or it names a different agent.
    pub fn load_peer(&self, peer: &PeerDescriptor) -> Result<PeerState, EngineError> {
        let loaded = self.engine.load_peer(&peer.nixl_metadata)?;
        if loaded != peer.name {
            return Err(EngineError::Failed(format!(
                "metadata of {:?} names agent {loaded:?}",
                peer.name
            )));
        }
        let bounce = self.register_peer_handshake(&peer.name, peer.handshake.as_deref());
        if let Err(why) = &bounce {
            tracing::info!(agent = %self.name, peer = %peer.name, reason = ?why, "peer is not bounce-capable; standard path");
        }
        let memory = self
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&peer.name)
            .map_or(self.kv_memory, |p| p.memory);
        let state = PeerState {
            bounce,
            handshake_blob: peer.handshake.clone(),
            draining: peer.draining,
            memory,
            metadata: metadata_fingerprint(&peer.nixl_metadata),
        };
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer.name.clone(), state.clone());
        self.stats.peers_loaded.fetch_add(1, Ordering::Relaxed);
        Ok(state)
    }

    fn register_peer_handshake(
        &self,
        peer: &str,
        blob: Option<&[u8]>,
    ) -> Result<Handshake, Incompatibility> {
        let (local, transport) = {
            let side = self.side();
            match (&side.handshake, &side.transport) {
                (Some(h), Some(t)) => (h.clone(), t.clone()),
                _ => return Err(Incompatibility::LocalBounceOff),
            }
        };
        let blob = blob.ok_or(Incompatibility::NoHandshake)?;
        let hs =
            wire::decode_handshake(blob).map_err(|e| Incompatibility::Malformed(e.to_string()))?;
        if hs.wire_version != local.wire_version {
            return Err(Incompatibility::WireVersion {
                local: local.wire_version,
                peer: hs.wire_version,
            });
        }
        if hs.control_kind != local.control_kind {
            return Err(Incompatibility::ControlKind {
                local: local.control_kind,
                peer: hs.control_kind,
            });
        }
        // No route where the control key forbids one: the peer's (or our)
        // connections would be refused — NOTICEs could not flow either.
        let (signs, requires) = (wire::CAP_CONTROL_SIGNED, wire::CAP_CONTROL_REQUIRED);
        if local.capabilities & requires != 0 && hs.capabilities & signs == 0 {
            return Err(Incompatibility::ControlAuth {
                local_requires: true,
            });
        }
        if hs.capabilities & requires != 0 && local.capabilities & signs == 0 {
            return Err(Incompatibility::ControlAuth {
                local_requires: false,
            });
        }
        // The route first: NOTICEs (arrival notices of standard-path
        // hand-offs) flow between agents of any config generation.
        transport
            // The handshake carries no memory kind: the peer's arena is
            // assumed to be of our arena's kind (see the module docs).
            // Features both ends advertise (uniform DATA: both decode it).
            .add_peer(
                peer,
                &hs.endpoint,
                self.arena_kind,
                hs.capabilities & local.capabilities,
            )
            .map_err(|e| Incompatibility::Endpoint(e.to_string()))?;
        if hs.max_chunk_size_bytes != local.max_chunk_size_bytes {
            return Err(Incompatibility::MaxChunk {
                local: local.max_chunk_size_bytes,
                peer: hs.max_chunk_size_bytes,
            });
        }
        if hs.config_generation != local.config_generation {
            return Err(Incompatibility::ConfigGeneration {
                local: local.config_generation,
                peer: hs.config_generation,
            });
        }
        Ok(hs)
    }

    /// Whether `peer` passed the handshake (false for every peer while we
    /// drain for a reconfiguration).
    pub fn has_peer_handshake(&self, peer: &str) -> bool {
        !self.is_draining()
            && self
                .peers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(peer)
                .is_some_and(|p| p.bounce.is_ok())
    }

    /// Loaded peers and their state.
    pub fn peers(&self) -> Vec<(String, PeerState)> {
        let mut v: Vec<_> = self
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// When a control message from `peer` was last received, ms since the
    /// Unix epoch (bounce transport only; `None` otherwise or never).
    pub fn last_heard_ms(&self, peer: &str) -> Option<i64> {
        self.transport().and_then(|t| t.last_heard_ms(peer))
    }

    /// Forgets a peer everywhere (seed `invalidateRemoteAgent` →
    /// `forgetPeer`): the transport reclaims its flows and fails its
    /// requests synchronously; NIXL drops its metadata.
    pub fn forget_peer(&self, peer: &str) {
        let known = self
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(peer)
            .is_some();
        if let Some(t) = self.transport() {
            t.forget_peer(peer);
        } else {
            let _ = self.engine.forget_peer(peer);
        }
        if known {
            self.stats.peers_forgotten.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The routing gate (seed §10 `shouldUseBounce`): WRITE (the only op
    /// here), bounce up, peer handshake OK, `descs.len() ≥
    /// minDescriptorCount`, average size ≤ `maxAverageDescriptorSizeBytes`,
    /// memory kinds equal to the arena's, and uniform devices per side.
    pub fn should_use_bounce(
        &self,
        peer: &str,
        descs: &[Descriptor],
        src_kind: MemKind,
        dst_kind: MemKind,
    ) -> bool {
        let bytes = descs.iter().fold(0u64, |a, d| a.saturating_add(d.len));
        self.bounce_route(peer, descs.len(), bytes, src_kind, dst_kind)
            .is_some()
    }

    /// [`FabricAgent::should_use_bounce`], returning the transport to use
    /// (taken once, so a concurrent reconfiguration cannot swap it between
    /// the check and the submit).
    fn bounce_route(
        &self,
        peer: &str,
        count: usize,
        bytes: u64,
        src_kind: MemKind,
        dst_kind: MemKind,
    ) -> Option<Arc<BounceTransport>> {
        if src_kind != self.arena_kind || dst_kind != self.arena_kind {
            return None;
        }
        let (t, min_n, max_avg) = {
            let side = self.side();
            (
                side.transport.clone()?,
                side.config.min_descriptor_count(),
                side.config.max_average_descriptor_size_bytes(),
            )
        };
        if !self.has_peer_handshake(peer) {
            return None;
        }
        let n = count as u64;
        if n == 0 || n < min_n {
            return None;
        }
        (bytes / n <= max_avg).then_some(t)
    }

    /// The GPU of the bounce arena, when it lives in device memory.
    #[cfg(feature = "cuda")]
    pub fn gpu(&self) -> Option<&Arc<CudaGpu>> {
        match &self.arena_choice {
            ArenaChoice::Cuda { gpu, .. } if self.owns_arena() => Some(gpu),
            _ => None,
        }
    }

    /// Submits a WRITE of `descs` (src local, dst on `peer`) through the
    /// path the gate picks. Never blocks; the handle always resolves.
    pub fn submit_write(&self, peer: &str, descs: Vec<Descriptor>) -> (PathKind, TransferHandle) {
        let remote = self.peer_memory(peer);
        self.submit_write_kinds(peer, descs, self.kv_memory.kind, remote.kind)
    }

    /// [`FabricAgent::submit_write`] for memory of the given kinds (an
    /// engine's pool rather than the agent's own): the routing gate sees
    /// `src_kind` / `dst_kind`. Never blocks; the handle always resolves.
    pub fn submit_write_kinds(
        &self,
        peer: &str,
        descs: Vec<Descriptor>,
        src_kind: MemKind,
        dst_kind: MemKind,
    ) -> (PathKind, TransferHandle) {
        self.submit_write_kinds_traced(peer, descs, src_kind, dst_kind, false)
    }

    /// [`submit_write_kinds`](Self::submit_write_kinds); `traced` makes a
    /// bounce request record its stages
    /// ([`BounceTransport::submit_traced`]).
    pub fn submit_write_kinds_traced(
        &self,
        peer: &str,
        descs: Vec<Descriptor>,
        src_kind: MemKind,
        dst_kind: MemKind,
        traced: bool,
    ) -> (PathKind, TransferHandle) {
        self.submit_write_scoped(peer, descs, src_kind, dst_kind, 0, traced)
    }

    /// [`submit_write_kinds_traced`](Self::submit_write_kinds_traced) into
    /// destination engine scope `scope` on `peer` (from the destination
    /// engine's record; 0 = the peer's own pool). A bounce request to a
    /// scope the peer no longer has fails at once (REJECT); the standard
    /// path writes without a receiver's say and ignores it.
    pub fn submit_write_scoped(
        &self,
        peer: &str,
        descs: Vec<Descriptor>,
        src_kind: MemKind,
        dst_kind: MemKind,
        scope: u64,
        traced: bool,
    ) -> (PathKind, TransferHandle) {
        // One pass over the descriptors for the gate and the counters
        // (saturating: an overflowing list averages past the gate and goes
        // to the standard path, which fails it — no registered memory
        // covers a descriptor whose end overflows).
        let bytes = descs.iter().fold(0u64, |a, d| a.saturating_add(d.len));
        if let Some(t) = self.bounce_route(peer, descs.len(), bytes, src_kind, dst_kind) {
            self.stats.submit_bounce.fetch_add(1, Ordering::Relaxed);
            self.stats.bytes_bounce.fetch_add(bytes, Ordering::Relaxed);
            (
                PathKind::Bounce,
                t.submit_scoped(peer, descs, scope, traced),
            )
        } else {
            (PathKind::Standard, self.submit_standard(peer, descs))
        }
    }

    /// Submits through the standard per-descriptor path regardless of the
    /// gate (the bench's side-by-side comparison).
    pub fn submit_standard(&self, peer: &str, descs: Vec<Descriptor>) -> TransferHandle {
        let bytes = descs.iter().fold(0u64, |a, d| a.saturating_add(d.len));
        self.stats.submit_standard.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes_standard
            .fetch_add(bytes, Ordering::Relaxed);
        let descs: Vec<Descriptor> = descs.into_iter().filter(|d| d.len > 0).collect();
        if descs.is_empty() {
            return TransferHandle::resolved(TransferOutcome::Success);
        }
        let fail = |why: String| {
            self.stats.standard_failed.fetch_add(1, Ordering::Relaxed);
            TransferHandle::resolved(TransferOutcome::Failure(why))
        };
        if self.std_tx.is_none() {
            // Shut down: no poller would ever resolve the handle.
            return fail("standard path: agent shut down".into());
        }
        let (lm, rm) = (self.kv_memory, self.peer_memory(peer));
        let local: Vec<MemDesc> = descs
            .iter()
            .map(|d| MemDesc {
                addr: d.src,
                len: d.len,
                device_id: lm.device_id,
            })
            .collect();
        let remote: Vec<MemDesc> = descs
            .iter()
            .map(|d| MemDesc {
                addr: d.dst,
                len: d.len,
                device_id: rm.device_id,
            })
            .collect();
        let l = match self.engine.prepare_local(lm.kind, &local) {
            Ok(l) => l,
            Err(e) => return fail(format!("standard path to peer {}: {e}", LogSafe(peer))),
        };
        let r = match self.engine.prepare_remote(peer, rm.kind, &remote) {
            Ok(r) => r,
            Err(e) => {
                self.engine.release_prepared(l);
                return fail(format!("standard path to peer {}: {e}", LogSafe(peer)));
            }
        };
        let idx: Vec<i32> = (0..descs.len() as i32).collect();
        let h = match self.engine.post_indexed(l, &idx, r, &idx) {
            Ok(h) => h,
            Err(e) => {
                self.engine.release_prepared(l);
                self.engine.release_prepared(r);
                return fail(format!("standard path to peer {}: {e}", LogSafe(peer)));
            }
        };
        let completion = Arc::new(Completion::with_spin_history(
            self.wait_spin,
            self.std_wait_history.clone(),
            self.spin_env.relax,
        ));
        let rid = self.std_next_rid.fetch_add(1, Ordering::Relaxed);
        let mut handle = TransferHandle::from_completion(completion.clone());
        handle.request_id = rid;
        self.stats
            .standard_in_flight
            .fetch_add(1, Ordering::Relaxed);
        let x = StdXfer {
            rid,
            peer: peer.to_string(),
            deadline: Instant::now() + self.std_timeout,
            handle: h,
            lists: (l, r),
            completion,
        };
        let sent = match &self.std_tx {
            Some(tx) => tx.send(x).map_err(|e| e.0),
            None => Err(x),
        };
        if let Err(x) = sent {
            // The poller is gone (a shutdown raced this submit).
            self.stats
                .standard_in_flight
                .fetch_sub(1, Ordering::Relaxed);
            self.engine.release(x.handle);
            self.engine.release_prepared(x.lists.0);
            self.engine.release_prepared(x.lists.1);
            self.stats.standard_failed.fetch_add(1, Ordering::Relaxed);
            x.completion
                .resolve(TransferOutcome::Failure("agent shut down".into()));
        }
        handle
    }

    /// Whether the agent still owns its bounce arena memory (false without
    /// bounce, or after a shutdown that had to leak it).
    pub fn owns_arena(&self) -> bool {
        self.side().arena.is_some()
    }

    /// Stops the transport (all bounce requests resolve) and the standard
    /// poller. Idempotent. When writes were still in flight at the
    /// transport's 5 s shutdown bound the bounce arena is leaked, not freed
    /// (the NIC may still read it; [`FabricAgent::owns_arena`] turns false).
    pub fn shutdown(&mut self) {
        let side = self.bounce.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = &side.transport {
            t.shutdown();
            if t.stats().arena_in_doubt.load(Ordering::SeqCst) {
                if let Some(arena) = side.arena.take() {
                    // Freeing memory a NIC may still read (or a peer's
                    // write may still land in) is worse than leaking it.
                    tracing::error!(
                        agent = %self.name,
                        "leaking the bounce arena: writes were still in flight at shutdown"
                    );
                    std::mem::forget(arena);
                }
            }
        }
        self.std_tx.take();
        if let Some(h) = self.std_thread.take() {
            let _ = h.join();
        }
    }
}

impl Drop for FabricAgent {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// First request id of the standard path (2^63): standard and bounce ids
/// (bounce counts from 1) never collide, so a request id in a log or a
/// bench report names one request of one agent.
pub const STD_RID_BASE: u64 = 1 << 63;

/// CPUs available to this process (1 when unknown).
fn host_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn standard_poller(
    engine: Arc<dyn TransferEngine>,
    rx: Receiver<StdXfer>,
    stats: Arc<FabricStats>,
    progress: Arc<AtomicBool>,
) {
    let mut live: Vec<StdXfer> = Vec::new();
    loop {
        let incoming = if live.is_empty() {
            match rx.recv_timeout(Duration::from_millis(5)) {
                Ok(x) => Some(x),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    if progress.load(Ordering::Relaxed) {
                        let _ = engine.progress();
                    }
                    continue;
                }
                Err(_) => break,
            }
        } else {
            rx.try_recv().ok()
        };
        if let Some(x) = incoming {
            live.push(x);
        }
        if progress.load(Ordering::Relaxed) {
            let _ = engine.progress();
        }
        let mut k = 0;
        while k < live.len() {
            let x = &live[k];
            let peer = LogSafe(&x.peer);
            let done = match engine.poll(x.handle) {
                Ok(XferState::InProgress) if Instant::now() < x.deadline => None,
                Ok(XferState::InProgress) => Some(TransferOutcome::Failure(format!(
                    "standard path to peer {peer}: no completion within the request timeout \
                     (peer unresponsive or gone)"
                ))),
                Ok(XferState::Success) => Some(TransferOutcome::Success),
                Err(e) => Some(TransferOutcome::Failure(format!(
                    "standard path to peer {peer}: {e} (peer forgotten or failed)"
                ))),
            };
            if let Some(outcome) = done {
                let x = live.swap_remove(k);
                engine.release(x.handle);
                engine.release_prepared(x.lists.0);
                engine.release_prepared(x.lists.1);
                if let TransferOutcome::Failure(why) = &outcome {
                    stats.standard_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(agent = %engine.agent_name(), peer = %LogSafe(&x.peer), rid = x.rid, reason = %why, "standard transfer failed");
                }
                stats.standard_in_flight.fetch_sub(1, Ordering::Relaxed);
                x.completion.resolve(outcome);
            } else {
                k += 1;
            }
        }
        if !live.is_empty() {
            std::thread::yield_now();
        }
    }
    for x in live {
        stats.standard_in_flight.fetch_sub(1, Ordering::Relaxed);
        engine.release(x.handle);
        x.completion
            .resolve(TransferOutcome::Failure("agent shut down".into()));
    }
}
