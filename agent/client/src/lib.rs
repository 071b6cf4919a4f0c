//! # kvfabric-client — attach a serving engine to its node's kvfabric agent
//!
//! A serving engine (one per prefill or decode pod) talks to the kvfabric
//! agent on its node over gRPC on the agent's Unix socket
//! (`agent/proto/kvfabric/v1/engine.proto`, generated into [`pb`]):
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvfabric_client::ClientError> {
//! use kvfabric_client::{pb, Client, ShmPool};
//! let client = Client::connect("/run/kvfabric/engine.sock").await?;
//! let layout = pb::KvLayout {
//!     layers: 2, num_blocks: 64, block_bytes: 16 * 8 * 128 * 2, kv_split: true,
//!     dtype: "bf16".into(), tp_rank: 0, tp_size: 1, block_tokens: 16,
//!     kv_heads: 8, head_dim: 128, device: -1, device_uuid: String::new(),
//! };
//! let pool = ShmPool::create(&format!("/kvf-demo-{}", std::process::id()),
//!                            kvfabric_client::pool_bytes(&layout))?;
//! let session = client.attach("prefill-0", "", pb::Role::Prefill, layout).await?;
//! session.register_shm(&pool).await?;
//! let r = session.transfer_blocks(1, "decode-0", &[3, 4], &[10, 11]).await?;
//! assert_eq!(r.outcome(), pb::Outcome::Success);
//! # Ok(()) }
//! ```
//!
//! Every call is bounded ([`Client::with_timeout`]; transfers and arrival
//! waits by their own timeout plus the call bound). A [`Session`] keeps its
//! Attach stream open on a background task: dropping the session (or the
//! process dying) detaches it on the agent within a second.
//!
//! The crate also carries the generated server stubs
//! ([`pb::engine_api_server`]) that the agent implements.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// The generated engine API: messages, [`pb::engine_api_client`] and
/// [`pb::engine_api_server`].
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("kvfabric.v1");
}

/// Default bound on one unary call (5 s); transfers and arrival waits add
/// their own timeout to it.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The agent's socket could not be reached.
    #[error("cannot connect to the kvfabric agent at {path}: {reason}")]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The agent answered with an error status (bad request, unknown
    /// session, mismatched layouts...): `code` and the agent's message.
    #[error("{call}: {code:?}: {message}")]
    Rpc {
        /// The call.
        call: &'static str,
        /// The gRPC status code.
        code: tonic::Code,
        /// The agent's message.
        message: String,
    },
    /// The call did not complete within its bound.
    #[error("{call}: no answer within {within:?}")]
    Timeout {
        /// The call.
        call: &'static str,
        /// The bound.
        within: Duration,
    },
    /// The agent broke the protocol (e.g. the Attach stream did not start
    /// with `attached`).
    #[error("protocol: {0}")]
    Protocol(String),
    /// An argument was refused before anything was sent (named).
    #[error("{0}")]
    InvalidArgument(String),
    /// Shared memory could not be created or mapped.
    #[error("shared memory {name}: {reason}")]
    Shm {
        /// The shm object's name.
        name: String,
        /// The OS error.
        reason: String,
    },
}

impl ClientError {
    /// The gRPC status code, for [`ClientError::Rpc`].
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            ClientError::Rpc { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// Where the chart mounts the agents' sockets (`agent.socket.hostPath`).
pub const DEFAULT_SOCKET_DIR: &str = "/run/kvfabric";

/// The agent socket an engine connects to (the Python client's
/// `kvfabric.engine_socket`, same rules): `$KVFABRIC_ENGINE_SOCKET` when
/// set (a `{gpu_uuid}` in it becomes `gpu_uuid`); otherwise, in `dir`
/// (default `$KVFABRIC_SOCKET_DIR` or [`DEFAULT_SOCKET_DIR`]), the socket
/// named after the engine's GPU, `<uuid>.sock` — served where a node runs
/// one agent per GPU (the chart's `agent.gpu.count` > 1) — when `gpu_uuid`
/// is given and that socket exists, else `engine.sock` (with a `gpu_uuid`,
/// only where it exists: which one is served is the node's choice, so
/// with neither there yet the caller retries). `gpu_uuid`: `cuDeviceGetUuid`'s UUID as text, any form
/// `kvfabric_core::layout::parse_gpu_uuid` takes, or "" (host engines);
/// send it in `KvLayout::device_uuid` too (ordinals are per process).
///
/// # Errors
/// [`ClientError::InvalidArgument`] for a malformed UUID, or a
/// `{gpu_uuid}` in the variable without one; [`ClientError::Connect`]
/// with a `gpu_uuid` while neither socket exists (the agent not up).
pub fn engine_socket(gpu_uuid: &str, dir: Option<&Path>) -> Result<PathBuf, ClientError> {
    let uuid = if gpu_uuid.is_empty() {
        None
    } else {
        let b = kvfabric_core::layout::parse_gpu_uuid(gpu_uuid)
            .map_err(ClientError::InvalidArgument)?;
        Some(kvfabric_core::layout::format_gpu_uuid(&b))
    };
    if let Some(explicit) = std::env::var_os("KVFABRIC_ENGINE_SOCKET").filter(|v| !v.is_empty()) {
        let text = explicit.to_string_lossy().into_owned();
        if !text.contains("{gpu_uuid}") {
            return Ok(PathBuf::from(explicit));
        }
        let Some(u) = &uuid else {
            return Err(ClientError::InvalidArgument(format!(
                "KVFABRIC_ENGINE_SOCKET {text:?} names {{gpu_uuid}}: give the engine's GPU UUID"
            )));
        };
        return Ok(PathBuf::from(text.replace("{gpu_uuid}", u)));
    }
    let dir = match dir {
        Some(d) => d.to_path_buf(),
        None => std::env::var_os("KVFABRIC_SOCKET_DIR")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET_DIR)),
    };
    let node = dir.join("engine.sock");
    let Some(u) = uuid else {
        return Ok(node);
    };
    let per_gpu = dir.join(format!("{u}.sock"));
    match (per_gpu.exists(), node.exists()) {
        (true, _) => Ok(per_gpu),
        (false, true) => Ok(node),
        (false, false) => Err(ClientError::Connect {
            path: dir,
            reason: format!(
                "no agent socket for GPU {u} yet (neither {u}.sock, one agent per GPU, nor engine.sock, one agent per node)"
            ),
        }),
    }
}

/// Bytes of a pool laid out as `layout` says:
/// `layers × planes × num_blocks × block_bytes` (planes = 2 with K/V split).
pub fn pool_bytes(layout: &pb::KvLayout) -> u64 {
    let planes = if layout.kv_split { 2 } else { 1 };
    u64::from(layout.layers)
        .saturating_mul(planes)
        .saturating_mul(u64::from(layout.num_blocks))
        .saturating_mul(layout.block_bytes)
}

async fn bounded<T>(
    call: &'static str,
    within: Duration,
    fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, ClientError> {
    match tokio::time::timeout(within, fut).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(ClientError::Rpc {
            call,
            code: s.code(),
            message: s.message().to_string(),
        }),
        Err(_) => Err(ClientError::Timeout { call, within }),
    }
}

/// A connection to the agent's engine API (cheap to clone; calls are
/// multiplexed over one HTTP/2 connection that reconnects by itself).
#[derive(Clone, Debug)]
pub struct Client {
    api: pb::engine_api_client::EngineApiClient<Channel>,
    timeout: Duration,
    path: PathBuf,
}

impl Client {
    /// Connects to the agent's Unix socket `path` (bounded by
    /// [`DEFAULT_CALL_TIMEOUT`]).
    ///
    /// # Errors
    /// [`ClientError::Connect`] when the socket is absent or refuses.
    pub async fn connect(path: impl AsRef<Path>) -> Result<Self, ClientError> {
        let path = path.as_ref().to_path_buf();
        let p = path.clone();
        let connect_err = |reason: String| ClientError::Connect {
            path: path.clone(),
            reason,
        };
        // The URI is a placeholder: the connector dials the socket.
        let endpoint = Endpoint::try_from("http://kvfabric.agent")
            .map_err(|e| connect_err(e.to_string()))?
            .connect_timeout(DEFAULT_CALL_TIMEOUT)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5));
        let channel = tokio::time::timeout(
            DEFAULT_CALL_TIMEOUT,
            endpoint.connect_with_connector(tower::service_fn(move |_: Uri| {
                let p = p.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(p).await?)) }
            })),
        )
        .await
        .map_err(|_| connect_err(format!("no connection within {DEFAULT_CALL_TIMEOUT:?}")))?
        .map_err(|e| connect_err(format!("{e}: {}", source_chain(&e))))?;
        Ok(Self {
            api: pb::engine_api_client::EngineApiClient::new(channel),
            timeout: DEFAULT_CALL_TIMEOUT,
            path,
        })
    }

    /// The same client with another per-call bound.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The socket this client dials.
    pub fn socket(&self) -> &Path {
        &self.path
    }

    /// Status of any session by id (e.g. to check that a session ended:
    /// `NotFound` once the agent detached it).
    ///
    /// # Errors
    /// [`ClientError::Rpc`] with `NotFound` for an unknown session.
    pub async fn status_of(&self, session: &str) -> Result<pb::StatusResponse, ClientError> {
        let mut api = self.api.clone();
        bounded(
            "Status",
            self.timeout,
            api.status(pb::StatusRequest {
                session: session.to_string(),
            }),
        )
        .await
    }

    /// Attaches engine `engine_id` (pod `pod_uid`, `role`, `layout`) and
    /// returns its session, whose Attach stream a background task keeps
    /// open until [`Session::detach`] or drop.
    ///
    /// # Errors
    /// [`ClientError::Rpc`] with `InvalidArgument` for a bad layout or id,
    /// `AlreadyExists` when the engine id is attached already.
    pub async fn attach(
        &self,
        engine_id: &str,
        pod_uid: &str,
        role: pb::Role,
        layout: pb::KvLayout,
    ) -> Result<Session, ClientError> {
        let mut api = self.api.clone();
        let mut stream = bounded(
            "Attach",
            self.timeout,
            api.attach(pb::AttachRequest {
                engine_id: engine_id.to_string(),
                pod_uid: pod_uid.to_string(),
                role: role as i32,
                layout: Some(layout),
            }),
        )
        .await?;
        let first = tokio::time::timeout(self.timeout, stream.message())
            .await
            .map_err(|_| ClientError::Timeout {
                call: "Attach",
                within: self.timeout,
            })?
            .map_err(|s| ClientError::Rpc {
                call: "Attach",
                code: s.code(),
                message: s.message().to_string(),
            })?;
        let attached = match first.and_then(|e| e.event) {
            Some(pb::session_event::Event::Attached(a)) => a,
            other => {
                return Err(ClientError::Protocol(format!(
                    "Attach stream began with {other:?}, not `attached`"
                )))
            }
        };
        let open = Arc::new(AtomicBool::new(true));
        let open2 = open.clone();
        // Keeps the stream (= the session) open; ends when the agent closes
        // it or the session is dropped (the task is aborted).
        let keeper = tokio::spawn(async move {
            while let Ok(Some(_)) = stream.message().await {}
            open2.store(false, Ordering::SeqCst);
        });
        Ok(Session {
            client: self.clone(),
            id: attached.session,
            agent: attached.agent,
            fingerprint: attached.layout_fingerprint,
            incarnation: attached.incarnation,
            engine_id: engine_id.to_string(),
            open,
            keeper: Some(keeper),
        })
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = Vec::new();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push(s.to_string());
        cur = s.source();
    }
    out.join(": ")
}

/// One attached engine. Dropping it ends the Attach stream, which the agent
/// treats as a detach (its requests fail, its pool is unregistered once
/// nothing uses it).
#[derive(Debug)]
pub struct Session {
    client: Client,
    id: String,
    agent: String,
    fingerprint: String,
    incarnation: u64,
    engine_id: String,
    open: Arc<AtomicBool>,
    keeper: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(k) = self.keeper.take() {
            k.abort();
        }
    }
}

impl Session {
    /// The session id the agent gave.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The agent's NIXL name.
    pub fn agent(&self) -> &str {
        &self.agent
    }

    /// The engine id attached.
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    /// The layout fingerprint the agent published.
    pub fn layout_fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// This attach's incarnation (non-zero). A decode engine hands it,
    /// with the block ids it allocated, to the engine that will write
    /// them ([`Session::transfer_blocks_checked`]): once this engine
    /// re-attaches, such a transfer is refused instead of writing into
    /// blocks of another allocation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Whether the Attach stream is still open (false once the agent
    /// closed it: detach, shutdown, agent gone).
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::SeqCst)
    }

    /// Registers `pool` (shared host memory) as this engine's KV pool.
    ///
    /// # Errors
    /// `InvalidArgument` when it is smaller than the layout or cannot be
    /// mapped; `FailedPrecondition` when a pool is registered already.
    pub async fn register_shm(&self, pool: &ShmPool) -> Result<u64, ClientError> {
        self.register_shm_name(pool.name(), pool.len() as u64).await
    }

    /// Registers the POSIX shm object `name` (`len` bytes, created and
    /// mapped by the engine itself, e.g. by its own allocator) as this
    /// engine's KV pool. The object must be owned by the engine's uid.
    ///
    /// # Errors
    /// As [`Session::register_shm`]; `PermissionDenied` when the object is
    /// owned by another uid.
    pub async fn register_shm_name(&self, name: &str, len: u64) -> Result<u64, ClientError> {
        self.register(pb::register_pool_request::Memory::Shm(pb::ShmPool {
            name: name.to_string(),
            len,
        }))
        .await
    }

    /// Registers a CUDA IPC handle (64 bytes of `cudaIpcMemHandle_t`)
    /// covering `len` bytes from `offset` of an allocation on the layout's
    /// device.
    ///
    /// # Errors
    /// As [`Session::register_shm`]; `Unimplemented` on an agent built
    /// without GPU support.
    pub async fn register_cuda_ipc(
        &self,
        handle: Vec<u8>,
        offset: u64,
        len: u64,
    ) -> Result<u64, ClientError> {
        self.register(pb::register_pool_request::Memory::CudaIpc(
            pb::CudaIpcPool {
                handle,
                offset,
                len,
            },
        ))
        .await
    }

    async fn register(
        &self,
        memory: pb::register_pool_request::Memory,
    ) -> Result<u64, ClientError> {
        let mut api = self.client.api.clone();
        let r = bounded(
            "RegisterPool",
            self.client.timeout,
            api.register_pool(pb::RegisterPoolRequest {
                session: self.id.clone(),
                memory: Some(memory),
            }),
        )
        .await?;
        Ok(r.len)
    }

    /// Hands `src_blocks[i]` of this engine to `dst_blocks[i]` of engine
    /// `dst_engine`, every layer and plane (the agent's path choice, its
    /// request timeout). Resolves when the transfer does.
    ///
    /// # Errors
    /// `InvalidArgument` for block ids out of range or mismatched lists,
    /// `NotFound` for an unknown destination engine, `FailedPrecondition`
    /// for layouts that cannot be mapped onto each other (both named).
    pub async fn transfer_blocks(
        &self,
        request_id: u64,
        dst_engine: &str,
        src_blocks: &[u32],
        dst_blocks: &[u32],
    ) -> Result<pb::TransferResponse, ClientError> {
        self.transfer(pb::TransferRequest {
            request_id,
            dst_engine: dst_engine.to_string(),
            src_blocks: src_blocks.to_vec(),
            dst_blocks: dst_blocks.to_vec(),
            ..Default::default()
        })
        .await
    }

    /// [`Session::transfer_blocks`] into `dst_engine` as of incarnation
    /// `dst_incarnation` (the destination's [`Session::incarnation`] when
    /// it allocated `dst_blocks`).
    ///
    /// # Errors
    /// As [`Session::transfer_blocks`]; `FailedPrecondition` (nothing
    /// written) when the destination re-attached since.
    pub async fn transfer_blocks_checked(
        &self,
        request_id: u64,
        dst_engine: &str,
        dst_incarnation: u64,
        src_blocks: &[u32],
        dst_blocks: &[u32],
    ) -> Result<pb::TransferResponse, ClientError> {
        self.transfer(pb::TransferRequest {
            request_id,
            dst_engine: dst_engine.to_string(),
            dst_incarnation,
            src_blocks: src_blocks.to_vec(),
            dst_blocks: dst_blocks.to_vec(),
            ..Default::default()
        })
        .await
    }

    /// [`Session::transfer_blocks`] with every field of the request
    /// (extents instead of blocks, a forced path, a timeout, a W3C
    /// `traceparent`). The session field is filled in.
    ///
    /// # Errors
    /// As [`Session::transfer_blocks`].
    pub async fn transfer(
        &self,
        mut req: pb::TransferRequest,
    ) -> Result<pb::TransferResponse, ClientError> {
        req.session = self.id.clone();
        // The request's own bound (0 = the agent's requestTimeoutMs, taken
        // as at most 60 s here) plus the call bound.
        let request = if req.timeout_ms == 0 {
            Duration::from_secs(60)
        } else {
            Duration::from_millis(u64::from(req.timeout_ms))
        };
        let within = self.client.timeout + request;
        let mut api = self.client.api.clone();
        bounded("Transfer", within, api.transfer(req)).await
    }

    /// Decode side: waits until request `request_id` (from `src_engine`, or
    /// any source when empty) has landed in this engine's blocks, at most
    /// `timeout` (0 = the agent's request timeout).
    ///
    /// # Errors
    /// [`ClientError::Timeout`] when the agent did not answer within
    /// `timeout` plus the call bound.
    pub async fn await_arrival(
        &self,
        request_id: u64,
        src_engine: &str,
        timeout: Duration,
    ) -> Result<pb::AwaitArrivalResponse, ClientError> {
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        let within = self.client.timeout
            + if ms == 0 {
                Duration::from_secs(60)
            } else {
                timeout
            };
        let mut api = self.client.api.clone();
        bounded(
            "AwaitArrival",
            within,
            api.await_arrival(pb::AwaitArrivalRequest {
                session: self.id.clone(),
                request_id,
                src_engine: src_engine.to_string(),
                timeout_ms: ms,
            }),
        )
        .await
    }

    /// Cancels in-flight request `request_id`; `false` when none was, when
    /// it is on the standard path (a write that cannot be recalled) or a
    /// same-agent copy. A request still being routed ([`Session::status`]
    /// lists it with path `pending`) is accepted when it can only move by
    /// bounce (path BOUNCE, or AUTO with a GPU pool on either side) and
    /// cancelled once submitted: it resolves `CANCELLED`.
    ///
    /// # Errors
    /// [`ClientError::Rpc`] for an unknown session.
    pub async fn cancel(&self, request_id: u64) -> Result<bool, ClientError> {
        let mut api = self.client.api.clone();
        let r = bounded(
            "Cancel",
            self.client.timeout,
            api.cancel(pb::CancelRequest {
                session: self.id.clone(),
                request_id,
            }),
        )
        .await?;
        Ok(r.cancelled)
    }

    /// In-flight requests and counters of this session.
    ///
    /// # Errors
    /// [`ClientError::Rpc`] for an unknown session.
    pub async fn status(&self) -> Result<pb::StatusResponse, ClientError> {
        let mut api = self.client.api.clone();
        bounded(
            "Status",
            self.client.timeout,
            api.status(pb::StatusRequest {
                session: self.id.clone(),
            }),
        )
        .await
    }

    /// Ends the session explicitly.
    ///
    /// # Errors
    /// [`ClientError::Rpc`] for an unknown session.
    pub async fn detach(mut self) -> Result<(), ClientError> {
        let mut api = self.client.api.clone();
        let r = bounded(
            "Detach",
            self.client.timeout,
            api.detach(pb::DetachRequest {
                session: self.id.clone(),
            }),
        )
        .await;
        if let Some(k) = self.keeper.take() {
            k.abort();
        }
        r.map(|_| ())
    }
}

/// A named POSIX shared-memory object mapped read-write in this process:
/// the host-memory KV pool an engine registers with
/// [`Session::register_shm`]. Unlinked and unmapped on drop (the agent's
/// own mapping keeps the memory alive until it lets go).
#[derive(Debug)]
pub struct ShmPool {
    name: String,
    ptr: *mut u8,
    len: usize,
    /// Whether the name is still in /dev/shm (see [`ShmPool::unlink`]).
    linked: bool,
}

// SAFETY: the mapping is plain shared memory owned by this value; access
// through `as_slice`/`as_mut_slice` follows Rust's borrow rules.
unsafe impl Send for ShmPool {}
// SAFETY: as above; `&ShmPool` only hands out shared slices.
unsafe impl Sync for ShmPool {}

impl ShmPool {
    /// Creates (exclusively) and maps `len` bytes of shm object `name`
    /// (`/` followed by 1–250 characters without `/`), zero-filled.
    ///
    /// # Errors
    /// [`ClientError::Shm`] for a bad name, an existing object, or an OS
    /// failure (named).
    pub fn create(name: &str, len: u64) -> Result<Self, ClientError> {
        let err = |reason: String| ClientError::Shm {
            name: name.to_string(),
            reason,
        };
        if !name.starts_with('/') || name.len() < 2 || name.len() > 251 || name[1..].contains('/') {
            return Err(err("want \"/name\" (1-250 characters, no other '/')".into()));
        }
        let len_usize = usize::try_from(len).map_err(|_| err("length overflows".into()))?;
        if len_usize == 0 {
            return Err(err("length 0".into()));
        }
        let cname = std::ffi::CString::new(name).map_err(|_| err("NUL in name".into()))?;
        // SAFETY: FFI with a valid NUL-terminated name.
        let fd = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            return Err(err(format!(
                "shm_open: {}",
                std::io::Error::last_os_error()
            )));
        }
        let fail = |what: &str| {
            let e = std::io::Error::last_os_error();
            // SAFETY: fd is ours; the name was created above.
            unsafe {
                libc::close(fd);
                libc::shm_unlink(cname.as_ptr());
            }
            err(format!("{what}: {e}"))
        };
        // SAFETY: fd is a valid shm descriptor.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(fail("ftruncate"));
        }
        // SAFETY: mapping a fresh shared object of `len` bytes.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(fail("mmap"));
        }
        // SAFETY: the mapping holds its own reference to the object.
        unsafe { libc::close(fd) };
        Ok(Self {
            name: name.to_string(),
            ptr: ptr.cast(),
            len: len_usize,
            linked: true,
        })
    }

    /// Removes the object's name from /dev/shm and keeps its memory: this
    /// pool's mapping and every mapping already made of it (the agent's, once
    /// [`Session::register_shm`] returned) stay valid; the kernel frees the
    /// memory when the last mapping goes. Call it after registering, so an
    /// engine killed with SIGKILL leaves nothing behind in /dev/shm (a pod's
    /// killed engine otherwise leaks its whole pool in the node's RAM until
    /// someone unlinks it). A pool whose name is removed cannot be
    /// registered again (the agent opens it by name): a re-attach needs a
    /// new pool. Idempotent.
    ///
    /// # Errors
    /// [`ClientError::Shm`] when `shm_unlink` fails other than with ENOENT.
    pub fn unlink(&mut self) -> Result<(), ClientError> {
        if !self.linked {
            return Ok(());
        }
        let cname = std::ffi::CString::new(self.name.as_str()).map_err(|_| ClientError::Shm {
            name: self.name.clone(),
            reason: "NUL in name".into(),
        })?;
        // SAFETY: FFI with a valid NUL-terminated name.
        if unsafe { libc::shm_unlink(cname.as_ptr()) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOENT) {
                return Err(ClientError::Shm {
                    name: self.name.clone(),
                    reason: format!("shm_unlink: {e}"),
                });
            }
        }
        self.linked = false;
        Ok(())
    }

    /// Whether the name is still in /dev/shm (false after [`ShmPool::unlink`]).
    pub fn is_linked(&self) -> bool {
        self.linked
    }

    /// The shm object's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the pool is empty (never: `create` refuses 0 bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pool's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The pool's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` maps `len` writable bytes; `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for ShmPool {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; unlinking our own name (unless
        // `unlink` already did: the name may have been re-created since).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
            if self.linked {
                if let Ok(c) = std::ffi::CString::new(self.name.as_str()) {
                    libc::shm_unlink(c.as_ptr());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ShmPool;

    /// The socket by GPU UUID (the variables unset, as in CI).
    #[test]
    fn engine_socket_by_gpu_uuid() {
        if std::env::var_os("KVFABRIC_ENGINE_SOCKET").is_some() {
            println!("SKIP: KVFABRIC_ENGINE_SOCKET is set");
            return;
        }
        let dir = std::env::temp_dir().join(format!("kvf-client-sock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let u = "5a2b1c3d-0e4f-4a1b-9c8d-7e6f5a4b3c2d";
        let sock = |uuid: &str| super::engine_socket(uuid, Some(&dir)).unwrap();
        // No agent up yet: no guess for a GPU engine.
        let e = super::engine_socket(u, Some(&dir)).unwrap_err();
        assert!(
            matches!(e, super::ClientError::Connect { .. }) && e.to_string().contains("neither"),
            "{e}"
        );
        assert_eq!(sock(""), dir.join("engine.sock"));
        // One agent per node.
        std::fs::write(dir.join("engine.sock"), b"").unwrap();
        assert_eq!(sock(u), dir.join("engine.sock"));
        // One agent per GPU.
        std::fs::write(dir.join(format!("{u}.sock")), b"").unwrap();
        assert_eq!(sock(&u.replace('-', "")), dir.join(format!("{u}.sock")));
        assert_eq!(
            sock(&format!("GPU-{}", u.to_uppercase())),
            dir.join(format!("{u}.sock"))
        );
        let e = super::engine_socket("GPU-12", Some(&dir)).unwrap_err();
        assert!(
            matches!(e, super::ClientError::InvalidArgument(_)) && e.to_string().contains("GPU-12"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unlink_removes_the_name_and_keeps_the_memory() {
        let name = format!("/kvf-client-unit-{}", std::process::id());
        let path = std::path::Path::new("/dev/shm").join(&name[1..]);
        let mut pool = ShmPool::create(&name, 8192).expect("create");
        assert!(path.exists(), "{path:?} after create");
        pool.as_mut_slice()[8191] = 7;
        pool.unlink().expect("unlink");
        assert!(!path.exists(), "{path:?} still there after unlink");
        assert!(!pool.is_linked());
        pool.unlink().expect("a second unlink is a no-op");
        // The memory is still mapped and ours.
        assert_eq!(pool.as_slice()[8191], 7);
        pool.as_mut_slice()[0] = 1;
        // A new object under the same name is not removed by the old pool's drop.
        let again = ShmPool::create(&name, 4096).expect("the name is free again");
        drop(pool);
        assert!(path.exists(), "the old pool's drop removed the new object");
        drop(again);
        assert!(!path.exists(), "{path:?} left after the new pool's drop");
    }
}
