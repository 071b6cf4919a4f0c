//! The data-plane transfer engine (seed §4 `TransferEngine`): the only
//! data-plane operations the bounce engine needs — register a region, post a
//! write, poll it, release it — plus peer metadata and notifications.
//! [`NixlTransferEngine`] implements it over one NIXL agent (UCX backend).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NotificationMap, OptArgs,
    RegistrationHandle, XferDescList, XferDlistHandle, XferOp, XferRequest, XferStatus,
};

use super::nixl_runtime;

/// Where a memory region lives. Determines the NIXL memory type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Host memory (NIXL DRAM).
    Dram,
    /// GPU memory (NIXL VRAM); the descriptor's `device_id` is the GPU.
    Vram,
}

impl MemKind {
    fn nixl(self) -> MemType {
        match self {
            MemKind::Dram => MemType::Dram,
            MemKind::Vram => MemType::Vram,
        }
    }
}

/// One contiguous memory range: `len` bytes at `addr` on device
/// `device_id` (0 for host memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemDesc {
    /// Start address (bytes).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device id (GPU ordinal for VRAM, 0 for DRAM).
    pub device_id: u64,
}

impl MemDesc {
    /// Builds a host-memory descriptor.
    pub const fn host(addr: u64, len: u64) -> Self {
        Self {
            addr,
            len,
            device_id: 0,
        }
    }
}

/// Opaque id of one posted transfer. Every post gets a fresh id, so a handle
/// is never reposted while in flight (an engine may repost the NIXL request
/// behind a released handle: [`NixlTransferEngine`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct XferHandle(pub u64);

/// Opaque id of a prepared descriptor list (the standard path's "prepare
/// once, select by index", seed 004).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PreparedList(pub u64);

/// State of a posted transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XferState {
    /// Still moving.
    InProgress,
    /// Landed at the remote target (NIXL's UCX backend flushes the endpoint
    /// per transfer, so SUCCESS means visible remotely; seed §2).
    Success,
}

/// Errors of the transfer engine. Every variant names the operation.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The NIXL runtime libraries could not be loaded.
    #[error(transparent)]
    Runtime(#[from] nixl_runtime::NixlRuntimeError),
    /// A NIXL call failed.
    #[error("NIXL {op} failed: {source}")]
    Nixl {
        /// The operation (e.g. "post_xfer_req").
        op: &'static str,
        /// The NIXL error.
        source: nixl_sys::NixlError,
    },
    /// A handle or list id this engine does not know.
    #[error("unknown {what} id {id}")]
    Unknown {
        /// "transfer" or "prepared list".
        what: &'static str,
        /// The id.
        id: u64,
    },
    /// Injected or reported transfer failure.
    #[error("transfer failed: {0}")]
    Failed(String),
}

fn nixl(op: &'static str) -> impl FnOnce(nixl_sys::NixlError) -> EngineError {
    move |source| EngineError::Nixl { op, source }
}

/// The only data-plane operations the bounce engine uses (seed §4).
/// Implementations are `Send + Sync`; calls may come from any thread.
pub trait TransferEngine: Send + Sync {
    /// This engine's agent name (unique per process start: it carries the
    /// incarnation).
    fn agent_name(&self) -> &str;
    /// Serialized metadata a peer must load to write into our memory.
    fn local_metadata(&self) -> Result<Vec<u8>, EngineError>;
    /// Loads a peer's metadata; returns the peer's agent name.
    fn load_peer(&self, metadata: &[u8]) -> Result<String, EngineError>;
    /// Forgets a peer's metadata (NIXL invalidateRemoteMD).
    fn forget_peer(&self, peer: &str) -> Result<(), EngineError>;
    /// Registers `desc` (once, at start-up or when an engine attaches a
    /// pool; never on the request path).
    fn register_region(&self, kind: MemKind, desc: MemDesc) -> Result<(), EngineError>;
    /// Deregisters the region registered at `addr` (an engine's pool going
    /// away, once nothing reads or writes it). `false` when none was.
    fn deregister_region(&self, addr: u64) -> bool;
    /// Posts one WRITE of `local[i]` → `remote[i]` on `peer` (lists of equal
    /// length and per-pair equal sizes).
    fn post_write(
        &self,
        peer: &str,
        local_kind: MemKind,
        local: &[MemDesc],
        remote_kind: MemKind,
        remote: &[MemDesc],
    ) -> Result<XferHandle, EngineError>;
    /// Prepares a local descriptor list for index-based requests.
    fn prepare_local(&self, kind: MemKind, descs: &[MemDesc]) -> Result<PreparedList, EngineError>;
    /// Prepares a remote descriptor list on `peer` for index-based requests.
    fn prepare_remote(
        &self,
        peer: &str,
        kind: MemKind,
        descs: &[MemDesc],
    ) -> Result<PreparedList, EngineError>;
    /// Posts a WRITE of prepared `local[local_idx[i]]` → `remote[remote_idx[i]]`.
    fn post_indexed(
        &self,
        local: PreparedList,
        local_idx: &[i32],
        remote: PreparedList,
        remote_idx: &[i32],
    ) -> Result<XferHandle, EngineError>;
    /// Frees a prepared list.
    fn release_prepared(&self, list: PreparedList);
    /// Polls a posted transfer. An error means the transfer FAILED.
    fn poll(&self, handle: XferHandle) -> Result<XferState, EngineError>;
    /// Releases a transfer handle (after a terminal poll).
    fn release(&self, handle: XferHandle);
    /// Progresses the engine and drains received notifications as
    /// `(peer agent name, message)`. Must be called regularly: with NIXL's
    /// progress thread off, an un-progressed agent can stall writes.
    fn progress(&self) -> Result<Vec<(String, Vec<u8>)>, EngineError>;
    /// Sends a notification (a small control message) to `peer`.
    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), EngineError>;
}

/// A raw registered range handed to NIXL's registration API.
#[derive(Debug)]
struct RawRegion {
    kind: MemKind,
    desc: MemDesc,
}

impl MemoryRegion for RawRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.desc.addr as usize as *const u8
    }
    fn size(&self) -> usize {
        self.desc.len as usize
    }
}

impl NixlDescriptor for RawRegion {
    fn mem_type(&self) -> MemType {
        self.kind.nixl()
    }
    fn device_id(&self) -> u64 {
        self.desc.device_id
    }
}

/// The most landed single-descriptor write requests kept for reposting
/// (each holds a few hundred bytes of NIXL/UCX state). Past it a released
/// request replaces an arbitrary idle one.
pub const MAX_IDLE_WRITES: usize = 512;

/// What identifies a single-descriptor WRITE whose NIXL request can be
/// posted again: the peer, and both sides' kind, address, length and device.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct WriteKey {
    peer: String,
    local_kind: MemKind,
    local: MemDesc,
    remote_kind: MemKind,
    remote: MemDesc,
}

/// One posted transfer.
struct Xfer {
    req: XferRequest,
    /// Set for a single-descriptor write that may be reposted once landed;
    /// cleared when its peer is forgotten or reloaded, or a region goes.
    key: Option<WriteKey>,
    /// A poll saw it land (only a landed request is reposted).
    landed: bool,
}

/// Counts of [`NixlTransferEngine`]'s request reuse.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RepostStats {
    /// Writes posted by reposting a landed request (no `create_xfer_req`).
    pub reposted: u64,
    /// Writes posted through a new request.
    pub created: u64,
    /// Landed requests kept for reposting now.
    pub idle: usize,
}

struct Inner {
    agent: Agent,
    backend: Backend,
    /// The backend selection every request is made with (built once).
    args: OptArgs,
    /// Registrations by base address (dropping a handle deregisters).
    regs: Vec<(u64, RegistrationHandle)>,
    xfers: HashMap<u64, Xfer>,
    prepared: HashMap<u64, XferDlistHandle>,
    /// Landed single-descriptor writes, by what they write (`None`: reuse
    /// off, `KVFABRIC_NIXL_REPOST=0`).
    idle: Option<HashMap<WriteKey, XferRequest>>,
    stats: RepostStats,
}

impl Drop for Inner {
    /// Requests go before the registrations they use (fields drop in
    /// declaration order, `regs` first).
    fn drop(&mut self) {
        self.idle = None;
        self.xfers.clear();
        self.prepared.clear();
    }
}

impl Inner {
    /// Drops the idle requests for which `stale` holds and stops the posted
    /// ones it holds for from being kept (before NIXL forgets or reloads a
    /// peer, or a region is deregistered).
    fn forget_writes(&mut self, stale: impl Fn(&WriteKey) -> bool) {
        if let Some(idle) = self.idle.as_mut() {
            idle.retain(|k, _| !stale(k));
        }
        for x in self.xfers.values_mut() {
            if x.key.as_ref().is_some_and(&stale) {
                x.key = None;
            }
        }
    }
}

// SAFETY: every NIXL object here is only touched under the engine's mutex;
// the nixl-sys handles are raw pointers to thread-agnostic C++ objects.
unsafe impl Send for Inner {}

/// [`TransferEngine`] over one NIXL agent with the UCX backend; NIXL's
/// progress thread is off (it busy-spins a core; DESIGN.md), so the owner
/// calls [`TransferEngine::progress`] in its poll loop. All NIXL calls are
/// serialized by one mutex (NIXL runs with thread sync off).
///
/// A single-descriptor write that landed is kept when released (up to
/// [`MAX_IDLE_WRITES`]) and posted again for the next write of the same
/// bytes to the same place — a bounce write is one arena region into one
/// granted region, so the pairs recur — saving NIXL's `create_xfer_req`
/// (issue 18: 31–42 µs for a request's first write on the H200; on the dev
/// machine's host memory 34–37 µs for a request's first write and 18–35 µs
/// a write on average, against 2–3 µs reposted). Kept requests of a peer are dropped
/// before it is forgotten or reloaded, all of them before a region is
/// deregistered.
pub struct NixlTransferEngine {
    name: String,
    inner: Mutex<Inner>,
    next_id: AtomicU64,
}

impl NixlTransferEngine {
    /// Creates agent `name` with a UCX backend. Extra UCX backend params come
    /// from `KVFABRIC_UCX_PARAMS` (`k=v,k=v`), e.g.
    /// `ucx_error_handling_mode=none` when TCP is excluded from `UCX_TLS`.
    /// `KVFABRIC_NIXL_REPOST=0` turns the reposting of landed writes off
    /// (an experiment switch: [`crate::runtime::transport::parse_on_switch`]).
    ///
    /// # Errors
    /// [`EngineError::Runtime`] when the NIXL libraries are missing (names
    /// `e2e/install-nixl.sh`); [`EngineError::Nixl`] when the agent or
    /// backend cannot be created.
    pub fn new(name: &str) -> Result<Self, EngineError> {
        nixl_runtime::ensure_loaded()?;
        let cfg = AgentConfig {
            enable_prog_thread: false,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(name, &cfg).map_err(nixl("create agent"))?;
        let (_mems, mut params) = agent
            .get_plugin_params("UCX")
            .map_err(nixl("get UCX plugin params"))?;
        if let Ok(extra) = std::env::var("KVFABRIC_UCX_PARAMS") {
            for kv in extra.split(',').filter(|s| !s.is_empty()) {
                if let Some((k, v)) = kv.split_once('=') {
                    params
                        .set(k.trim(), v.trim())
                        .map_err(nixl("set UCX param"))?;
                }
            }
        }
        let backend = agent
            .create_backend("UCX", &params)
            .map_err(nixl("create UCX backend"))?;
        let mut args = OptArgs::new().map_err(nixl("opt args"))?;
        args.add_backend(&backend)
            .map_err(nixl("opt args backend"))?;
        let repost = super::transport::parse_on_switch(
            std::env::var("KVFABRIC_NIXL_REPOST").ok().as_deref(),
        );
        Ok(Self {
            name: name.to_string(),
            inner: Mutex::new(Inner {
                agent,
                backend,
                args,
                regs: Vec::new(),
                xfers: HashMap::new(),
                prepared: HashMap::new(),
                idle: repost.then(HashMap::new),
                stats: RepostStats::default(),
            }),
            next_id: AtomicU64::new(1),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The reuse counts so far (tests, benches).
    pub fn repost_stats(&self) -> RepostStats {
        let inner = self.lock();
        RepostStats {
            idle: inner.idle.as_ref().map_or(0, HashMap::len),
            ..inner.stats
        }
    }

    fn dlist(kind: MemKind, descs: &[MemDesc]) -> Result<XferDescList<'static>, EngineError> {
        let mut list = XferDescList::new(kind.nixl()).map_err(nixl("descriptor list"))?;
        for d in descs {
            list.add_desc(d.addr as usize, d.len as usize, d.device_id);
        }
        Ok(list)
    }

    fn insert_xfer(
        &self,
        inner: &mut Inner,
        req: XferRequest,
        key: Option<WriteKey>,
    ) -> XferHandle {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        inner.xfers.insert(
            id,
            Xfer {
                req,
                key,
                landed: false,
            },
        );
        XferHandle(id)
    }

    fn post(inner: &Inner, req: &XferRequest) -> Result<(), EngineError> {
        inner
            .agent
            .post_xfer_req(req, None)
            .map(|_| ())
            .map_err(nixl("post_xfer_req"))
    }
}

impl TransferEngine for NixlTransferEngine {
    fn agent_name(&self) -> &str {
        &self.name
    }

    fn local_metadata(&self) -> Result<Vec<u8>, EngineError> {
        self.lock()
            .agent
            .get_local_md()
            .map_err(nixl("get_local_md"))
    }

    fn load_peer(&self, metadata: &[u8]) -> Result<String, EngineError> {
        let mut inner = self.lock();
        // The peer's name is known only once loaded: no idle request may
        // outlive the metadata it was made against, so all go first (loads
        // are rare: a handshake or a republished pool).
        if let Some(idle) = inner.idle.as_mut() {
            idle.clear();
        }
        let peer = inner
            .agent
            .load_remote_md(metadata)
            .map_err(nixl("load_remote_md"))?;
        inner.forget_writes(|k| k.peer == peer);
        Ok(peer)
    }

    fn forget_peer(&self, peer: &str) -> Result<(), EngineError> {
        let mut inner = self.lock();
        inner.forget_writes(|k| k.peer == peer);
        inner
            .agent
            .invalidate_remote_md(peer)
            .map_err(nixl("invalidate_remote_md"))
    }

    fn register_region(&self, kind: MemKind, desc: MemDesc) -> Result<(), EngineError> {
        let mut inner = self.lock();
        let handle = inner
            .agent
            .register_memory(&RawRegion { kind, desc }, Some(&inner.args))
            .map_err(nixl("register_memory"))?;
        inner.regs.push((desc.addr, handle));
        Ok(())
    }

    fn deregister_region(&self, addr: u64) -> bool {
        let mut inner = self.lock();
        match inner.regs.iter().position(|(a, _)| *a == addr) {
            Some(k) => {
                inner.forget_writes(|_| true);
                let (_, handle) = inner.regs.swap_remove(k);
                drop(handle);
                true
            }
            None => false,
        }
    }

    fn post_write(
        &self,
        peer: &str,
        local_kind: MemKind,
        local: &[MemDesc],
        remote_kind: MemKind,
        remote: &[MemDesc],
    ) -> Result<XferHandle, EngineError> {
        // Timed only for the trace (issue 18: on the H200 a request's first
        // write took create 31–42 + post 64–68 µs, the next 3–7 + 14–19).
        let t0 = tracing::enabled!(tracing::Level::TRACE).then(std::time::Instant::now);
        let mut inner = self.lock();
        let locked = t0.map(|t| t.elapsed());
        let key = match (local, remote, inner.idle.is_some()) {
            ([l], [r], true) => Some(WriteKey {
                peer: peer.to_string(),
                local_kind,
                local: *l,
                remote_kind,
                remote: *r,
            }),
            _ => None,
        };
        let kept = key
            .as_ref()
            .and_then(|k| inner.idle.as_mut().and_then(|idle| idle.remove(k)));
        let reposted = kept.is_some();
        let req = match kept {
            Some(req) => req,
            None => {
                let local_list = Self::dlist(local_kind, local)?;
                let remote_list = Self::dlist(remote_kind, remote)?;
                inner
                    .agent
                    .create_xfer_req(
                        XferOp::Write,
                        &local_list,
                        &remote_list,
                        peer,
                        Some(&inner.args),
                    )
                    .map_err(nixl("create_xfer_req"))?
            }
        };
        let created = t0.map(|t| t.elapsed());
        Self::post(&inner, &req)?;
        if reposted {
            inner.stats.reposted += 1;
        } else {
            inner.stats.created += 1;
        }
        if let (Some(t0), Some(l), Some(c)) = (t0, locked, created) {
            tracing::trace!(
                locked_us = l.as_micros() as u64,
                create_us = (c - l).as_micros() as u64,
                post_us = (t0.elapsed() - c).as_micros() as u64,
                reposted,
                "nixl write posted"
            );
        }
        Ok(self.insert_xfer(&mut inner, req, key))
    }

    fn prepare_local(&self, kind: MemKind, descs: &[MemDesc]) -> Result<PreparedList, EngineError> {
        self.prepare_remote("", kind, descs)
    }

    fn prepare_remote(
        &self,
        peer: &str,
        kind: MemKind,
        descs: &[MemDesc],
    ) -> Result<PreparedList, EngineError> {
        let list = Self::dlist(kind, descs)?;
        let mut inner = self.lock();
        let handle = inner
            .agent
            .prepare_xfer_dlist(peer, &list, Some(&inner.args))
            .map_err(nixl("prepare_xfer_dlist"))?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        inner.prepared.insert(id, handle);
        Ok(PreparedList(id))
    }

    fn post_indexed(
        &self,
        local: PreparedList,
        local_idx: &[i32],
        remote: PreparedList,
        remote_idx: &[i32],
    ) -> Result<XferHandle, EngineError> {
        let mut inner = self.lock();
        let l = inner.prepared.get(&local.0).ok_or(EngineError::Unknown {
            what: "prepared list",
            id: local.0,
        })?;
        let r = inner.prepared.get(&remote.0).ok_or(EngineError::Unknown {
            what: "prepared list",
            id: remote.0,
        })?;
        let req = inner
            .agent
            .make_xfer_req(
                XferOp::Write,
                l,
                local_idx,
                r,
                remote_idx,
                Some(&inner.args),
            )
            .map_err(nixl("make_xfer_req"))?;
        Self::post(&inner, &req)?;
        Ok(self.insert_xfer(&mut inner, req, None))
    }

    fn release_prepared(&self, list: PreparedList) {
        self.lock().prepared.remove(&list.0);
    }

    fn poll(&self, handle: XferHandle) -> Result<XferState, EngineError> {
        let mut inner = self.lock();
        let Inner { agent, xfers, .. } = &mut *inner;
        let x = xfers.get_mut(&handle.0).ok_or(EngineError::Unknown {
            what: "transfer",
            id: handle.0,
        })?;
        match agent
            .get_xfer_status(&x.req)
            .map_err(nixl("get_xfer_status"))?
        {
            XferStatus::Success => {
                x.landed = true;
                Ok(XferState::Success)
            }
            XferStatus::InProgress => Ok(XferState::InProgress),
        }
    }

    fn release(&self, handle: XferHandle) {
        let mut inner = self.lock();
        let Some(x) = inner.xfers.remove(&handle.0) else {
            return;
        };
        // Only a request seen landed is kept: one still moving or failed is
        // released to NIXL (which cancels a moving one).
        if let (Some(key), true, Some(idle)) = (x.key, x.landed, inner.idle.as_mut()) {
            if idle.len() >= MAX_IDLE_WRITES && !idle.contains_key(&key) {
                if let Some(evict) = idle.keys().next().cloned() {
                    idle.remove(&evict);
                }
            }
            idle.insert(key, x.req);
        }
    }

    fn progress(&self) -> Result<Vec<(String, Vec<u8>)>, EngineError> {
        let inner = self.lock();
        let mut map = NotificationMap::new().map_err(nixl("notification map"))?;
        inner
            .agent
            .get_notifications(&mut map, None)
            .map_err(nixl("get_notifications"))?;
        let mut out = Vec::new();
        if map.is_empty().unwrap_or(true) {
            return Ok(out);
        }
        let agents: Vec<String> = map
            .agents()
            .filter_map(|a| a.ok().map(str::to_string))
            .collect();
        for agent in agents {
            let n = map
                .get_notifications_size(&agent)
                .map_err(nixl("notifications"))?;
            for i in 0..n {
                let bytes = map
                    .get_notification_bytes(&agent, i)
                    .map_err(nixl("notification bytes"))?;
                out.push((agent.clone(), bytes));
            }
        }
        Ok(out)
    }

    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), EngineError> {
        let inner = self.lock();
        inner
            .agent
            .send_notification(peer, msg, Some(&inner.backend))
            .map_err(nixl("send_notification"))
    }
}
