//! etcd discovery: the own [`AgentRecord`] lives at
//! `/kvfabric/<fabric>/agents/<name>`, attached to a lease.
//!
//! Two threads, each with its own current-thread tokio runtime and its own
//! etcd client, so neither request load nor the other can starve them:
//!
//! * **lease** (`kvfabric-etcd-lease`): grants the lease (TTL
//!   [`EtcdOptions::lease_ttl`]), puts the record, sends a keep-alive every
//!   [`EtcdOptions::keepalive_interval`] (TTL/3 by default). When etcd says
//!   the lease is gone (keep-alive TTL 0, "lease not found": expired,
//!   revoked, data lost) it grants a new lease and republishes at once,
//!   without restarting anything. While etcd is unreachable it retries with
//!   backoff ([`LeaseState::Renewing`], then [`LeaseState::Lost`] once the
//!   TTL has passed without confirmation); a lease that survived an etcd
//!   restart is simply kept.
//! * **watch** (`kvfabric-etcd-watch`): reads the prefix, diffs it against
//!   what it knew (so reconnecting never drops a live peer and never misses
//!   a removal), then watches from the read's revision + 1. Any stream
//!   error, cancel or compaction ⇒ backoff and read again. It also notices
//!   the own key disappearing while published and asks the lease thread to
//!   republish.
//!
//! Every etcd call is bounded by [`EtcdOptions::request_timeout`];
//! reconnects back off from [`EtcdOptions::backoff_initial`] to
//! [`EtcdOptions::backoff_max`].

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, Txn, TxnOp, WatchOptions,
};
use kvfabric_core::text::LogSafe;
use tokio::sync::{mpsc, watch};

use super::{
    now_ms, validate_name, AgentRecord, Discovery, DiscoveryError, Hub, LeaseState, PeerEvent,
};

/// How to reach etcd and how to keep the lease.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// Client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Fabric name: the key prefix is `/kvfabric/<fabric>/agents/`.
    pub fabric: String,
    /// Lease TTL (default 10 s; whole seconds, rounded up; etcd may raise
    /// very small values to its minimum).
    pub lease_ttl: Duration,
    /// Keep-alive period; `None` = TTL / 3.
    pub keepalive_interval: Option<Duration>,
    /// Bound on each etcd request (default 2 s).
    pub request_timeout: Duration,
    /// Bound on establishing a connection (default 2 s).
    pub connect_timeout: Duration,
    /// First reconnect delay (default 100 ms), doubled per failure...
    pub backoff_initial: Duration,
    /// ...up to this (default 2 s).
    pub backoff_max: Duration,
    /// Client TLS (CA + client certificate); `None` = plain HTTP.
    pub tls: Option<EtcdTls>,
    /// This agent's logical id: the watch follows its rollout document
    /// `<fabric prefix>config/agents/<logical id>`
    /// ([`kvfabric_core::rollout`]) and delivers it through
    /// [`Discovery::assigned_config`]. `None`: not followed.
    pub logical_id: Option<String>,
}

/// etcd client TLS material (PEM): the CA that signed etcd's serving
/// certificate, this client's certificate and key.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// CA certificate(s).
    pub ca_pem: Vec<u8>,
    /// Client certificate.
    pub cert_pem: Vec<u8>,
    /// Client private key.
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("EtcdTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("cert_pem_bytes", &self.cert_pem.len())
            .finish_non_exhaustive()
    }
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            fabric: "default".into(),
            lease_ttl: Duration::from_secs(10),
            keepalive_interval: None,
            request_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(2),
            tls: None,
            logical_id: None,
        }
    }
}

impl EtcdOptions {
    /// Options for `endpoints` and `fabric`, defaults otherwise.
    pub fn new(endpoints: Vec<String>, fabric: &str) -> Self {
        Self {
            endpoints,
            fabric: fabric.into(),
            ..Self::default()
        }
    }

    /// The TTL in whole seconds (≥ 1).
    pub fn ttl_secs(&self) -> i64 {
        (self.lease_ttl.as_millis().div_ceil(1000) as i64).max(1)
    }

    fn interval(&self) -> Duration {
        self.keepalive_interval
            .unwrap_or_else(|| Duration::from_secs(self.ttl_secs() as u64) / 3)
    }

    fn connect_options(&self) -> ConnectOptions {
        let o = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            .with_keep_alive(GRPC_KEEPALIVE_INTERVAL, GRPC_KEEPALIVE_TIMEOUT)
            .with_keep_alive_while_idle(true);
        match &self.tls {
            None => o,
            Some(t) => o.with_tls(
                etcd_client::TlsOptions::new()
                    .ca_certificate(etcd_client::Certificate::from_pem(&t.ca_pem))
                    .identity(etcd_client::Identity::from_pem(&t.cert_pem, &t.key_pem)),
            ),
        }
    }
}

/// HTTP/2 keep-alive ping period of the etcd connections: 10 s. A stock
/// etcd enforces `--grpc-keepalive-min-time` = 5 s and closes a connection
/// that pings more often ("too_many_pings", issue 11 item 4: a 2 s ping
/// broke the watch every ~8 s and the lease renewal with it).
pub const GRPC_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// How long a keep-alive ping may go unanswered before the connection is
/// considered dead: 5 s (requests are bounded separately by
/// [`EtcdOptions::request_timeout`]).
pub const GRPC_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The key prefix of `fabric`: `/kvfabric/<fabric>/agents/`.
pub fn agents_prefix(fabric: &str) -> String {
    format!("/kvfabric/{fabric}/agents/")
}

enum Cmd {
    Publish(
        Box<AgentRecord>,
        std::sync::mpsc::SyncSender<Result<(), DiscoveryError>>,
    ),
    Revoke(std::sync::mpsc::SyncSender<Result<(), DiscoveryError>>),
    /// The own key vanished (seen by the watcher): put it again.
    Republish,
}

struct Shared {
    hub: Hub,
    state: AtomicU8,
    lease_id: AtomicI64,
    grants: AtomicU64,
    keepalives: AtomicU64,
    /// Full re-reads of the prefix after the first (each watch loss).
    resyncs: AtomicU64,
    watching: AtomicBool,
    own_name: Mutex<Option<String>>,
    /// The own record's pod UID (empty outside Kubernetes).
    own_pod_uid: Mutex<String>,
    /// Set once the own pod UID was seen tombstoned: the record is not
    /// put back any more.
    invalidated: AtomicBool,
    /// etcd revision of the own record's last confirmed put (0: none).
    published_rev: AtomicI64,
    /// Values of the own rollout document, in order (sender side).
    config_tx: crossbeam_channel::Sender<Vec<u8>>,
    /// Receiver side, handed out once by `assigned_config`.
    config_rx: Mutex<Option<Receiver<Vec<u8>>>>,
    /// Latest value of the fabric's `config/desired` document.
    desired: Mutex<Option<Vec<u8>>>,
}

impl Shared {
    fn set_state(&self, s: LeaseState) {
        let prev = LeaseState::from_code(self.state.swap(s.code(), Ordering::SeqCst));
        if prev != s {
            tracing::info!(from = %prev, to = %s, "etcd lease state");
        }
    }
    /// Records (and logs once) that the operator invalidated this agent's
    /// pod: its record is not put back any more.
    fn mark_invalidated(&self, uid: &str) {
        if !self.invalidated.swap(true, Ordering::SeqCst) {
            tracing::error!(pod_uid = %LogSafe(uid), "this agent's pod was invalidated by the operator (tombstone); its record stays withdrawn");
        }
    }

    /// Whether this agent's pod UID is tombstoned (marked invalidated
    /// then).
    fn own_pod_tombstoned(&self) -> bool {
        let uid = self
            .own_pod_uid
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let dead = self.hub.is_tombstoned(&uid);
        if dead {
            self.mark_invalidated(&uid);
        }
        dead
    }

    fn own_name(&self) -> Option<String> {
        self.own_name
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Discovery over etcd (see the module docs). Dropping it stops its threads
/// *without* revoking: the record then disappears when the lease expires;
/// call [`Discovery::revoke`] first for a graceful exit.
pub struct EtcdDiscovery {
    opts: EtcdOptions,
    prefix: String,
    shared: Arc<Shared>,
    cmd_tx: mpsc::UnboundedSender<Cmd>,
    stop_tx: watch::Sender<bool>,
    threads: Vec<JoinHandle<()>>,
}

impl EtcdDiscovery {
    /// Starts the lease and watch threads. Does not wait for etcd: while it
    /// is unreachable the threads retry with backoff ([`is_watching`]
    /// tells when the watch is up).
    ///
    /// # Errors
    /// [`DiscoveryError::Store`] for no endpoints or a fabric name that is
    /// not a single key segment.
    ///
    /// [`is_watching`]: Self::is_watching
    pub fn start(opts: EtcdOptions) -> Result<Self, DiscoveryError> {
        if opts.endpoints.is_empty() {
            return Err(DiscoveryError::Store("no etcd endpoints".into()));
        }
        validate_name(&opts.fabric)
            .map_err(|e| DiscoveryError::Store(format!("fabric name: {e}")))?;
        let prefix = agents_prefix(&opts.fabric);
        let (config_tx, config_rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(Shared {
            config_tx,
            config_rx: Mutex::new(Some(config_rx)),
            desired: Mutex::new(None),
            hub: Hub::default(),
            state: AtomicU8::new(LeaseState::Unpublished.code()),
            lease_id: AtomicI64::new(0),
            grants: AtomicU64::new(0),
            keepalives: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            watching: AtomicBool::new(false),
            own_name: Mutex::new(None),
            own_pod_uid: Mutex::new(String::new()),
            invalidated: AtomicBool::new(false),
            published_rev: AtomicI64::new(0),
        });
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = watch::channel(false);

        let lease = LeaseTask {
            opts: opts.clone(),
            prefix: prefix.clone(),
            tomb_prefix: format!("/kvfabric/{}/tombstones/", opts.fabric),
            shared: shared.clone(),
            client: None,
            desired: None,
            lease: None,
            keeper: None,
            last_ok: Instant::now(),
            backoff: Backoff::new(&opts),
            next: Instant::now(),
        };
        let stop_lease = stop_rx.clone();
        let t_lease = spawn_runtime_thread("kvfabric-etcd-lease", async move {
            lease.run(cmd_rx, stop_lease).await
        })?;
        let watcher = WatchTask {
            opts: opts.clone(),
            prefix: prefix.clone(),
            shared: shared.clone(),
            cmd_tx: cmd_tx.clone(),
            client: None,
            reads: 0,
            fabric_prefix: format!("/kvfabric/{}/", opts.fabric),
            tomb_prefix: format!("/kvfabric/{}/tombstones/", opts.fabric),
            removals_prefix: format!("/kvfabric/{}/removals/", opts.fabric),
            own_config_key: opts.logical_id.as_ref().map(|l| {
                format!(
                    "/kvfabric/{}/{}{l}",
                    opts.fabric,
                    kvfabric_core::rollout::AGENTS_KEY_PREFIX
                )
            }),
            desired_key: format!(
                "/kvfabric/{}/{}",
                opts.fabric,
                kvfabric_core::rollout::DESIRED_KEY
            ),
        };
        let t_watch =
            spawn_runtime_thread(
                "kvfabric-etcd-watch",
                async move { watcher.run(stop_rx).await },
            )?;
        Ok(Self {
            opts,
            prefix,
            shared,
            cmd_tx,
            stop_tx,
            threads: vec![t_lease, t_watch],
        })
    }

    /// `/kvfabric/<fabric>/agents/`.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The key of agent `name`.
    pub fn key_of(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The current lease id, if one is held.
    pub fn lease_id(&self) -> Option<i64> {
        match self.shared.lease_id.load(Ordering::SeqCst) {
            0 => None,
            id => Some(id),
        }
    }

    /// Leases granted so far (1 after the first publish; each re-grant after
    /// a loss adds one).
    pub fn lease_grants(&self) -> u64 {
        self.shared.grants.load(Ordering::SeqCst)
    }

    /// Keep-alives confirmed by etcd so far.
    pub fn keepalives(&self) -> u64 {
        self.shared.keepalives.load(Ordering::SeqCst)
    }

    /// Full re-reads of the prefix after the first one: each is a watch
    /// that was lost (stream error, cancel, compaction, connection closed)
    /// and re-established. Stays 0 on a healthy connection.
    pub fn resyncs(&self) -> u64 {
        self.shared.resyncs.load(Ordering::SeqCst)
    }

    /// Whether the prefix watch is established now (for readiness).
    pub fn is_watching(&self) -> bool {
        self.shared.watching.load(Ordering::SeqCst)
    }

    /// The options in use.
    pub fn options(&self) -> &EtcdOptions {
        &self.opts
    }

    /// How long a synchronous call waits for the lease thread.
    fn call_bound(&self) -> Duration {
        self.opts.connect_timeout + self.opts.request_timeout * 4
    }

    fn call(
        &self,
        what: &'static str,
        make: impl FnOnce(std::sync::mpsc::SyncSender<Result<(), DiscoveryError>>) -> Cmd,
    ) -> Result<(), DiscoveryError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.cmd_tx
            .send(make(tx))
            .map_err(|_| DiscoveryError::Closed)?;
        let within = self.call_bound();
        match rx.recv_timeout(within) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                Err(DiscoveryError::Timeout { what, within })
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(DiscoveryError::Closed),
        }
    }

    /// Stops both threads without revoking (bounded by one request timeout).
    /// Idempotent; also done on drop.
    pub fn shutdown(&mut self) {
        let _ = self.stop_tx.send(true);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for EtcdDiscovery {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Discovery for EtcdDiscovery {
    fn tombstones(&self) -> Option<Receiver<String>> {
        Some(self.shared.hub.subscribe_tombstones())
    }

    fn is_tombstoned(&self, uid: &str) -> bool {
        self.shared.hub.is_tombstoned(uid)
    }

    /// Grants a lease if none is held, then puts the record under it.
    /// Returns once etcd confirmed the put.
    ///
    /// # Errors
    /// [`DiscoveryError::Record`] for an invalid record;
    /// [`DiscoveryError::Store`] / [`DiscoveryError::Timeout`] when etcd did
    /// not confirm (the lease thread keeps retrying in the background).
    fn publish(&self, record: AgentRecord) -> Result<(), DiscoveryError> {
        record.validate()?;
        self.call("publish", |tx| Cmd::Publish(Box::new(record), tx))
    }

    fn events(&self) -> Receiver<PeerEvent> {
        self.shared.hub.subscribe()
    }

    /// Revokes the lease (etcd deletes the key at once; watchers see it go).
    ///
    /// # Errors
    /// When etcd did not confirm within the bound; publishing stops anyway
    /// and the key then expires with its TTL.
    fn revoke(&self) -> Result<(), DiscoveryError> {
        self.call("revoke", Cmd::Revoke)
    }

    fn lease_state(&self) -> LeaseState {
        LeaseState::from_code(self.shared.state.load(Ordering::SeqCst))
    }

    fn peers(&self) -> Vec<AgentRecord> {
        self.shared.hub.live()
    }

    fn resyncs(&self) -> u64 {
        EtcdDiscovery::resyncs(self)
    }

    fn assigned_config(&self) -> Option<Receiver<Vec<u8>>> {
        self.shared
            .config_rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    fn desired_config(&self) -> Option<Vec<u8>> {
        self.shared
            .desired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn wait_first_read(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while !self.is_watching() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }
}

fn spawn_runtime_thread(
    name: &str,
    fut: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<JoinHandle<()>, DiscoveryError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| DiscoveryError::Store(format!("tokio runtime: {e}")))?;
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || rt.block_on(fut))
        .map_err(|e| DiscoveryError::Store(format!("spawning {name}: {e}")))
}

struct Backoff {
    initial: Duration,
    max: Duration,
    cur: Duration,
}

impl Backoff {
    fn new(o: &EtcdOptions) -> Self {
        Self {
            initial: o.backoff_initial,
            max: o.backoff_max,
            cur: o.backoff_initial,
        }
    }
    fn next(&mut self) -> Duration {
        let d = self.cur;
        self.cur = (self.cur * 2).min(self.max);
        d
    }
    fn reset(&mut self) {
        self.cur = self.initial;
    }
}

async fn connect(opts: &EtcdOptions) -> Result<Client, String> {
    match tokio::time::timeout(
        opts.connect_timeout,
        Client::connect(&opts.endpoints, Some(opts.connect_options())),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(format!("connect: {e}")),
        Err(_) => Err(format!(
            "connect: no answer within {:?}",
            opts.connect_timeout
        )),
    }
}

/// Runs `fut` under `bound`, flattening both failures into a message.
async fn bounded<T>(
    bound: Duration,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(bound, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) if is_lease_gone(&e) => Err(Failure::LeaseGone),
        Ok(Err(e)) => Err(Failure::Other(format!("{what}: {e}"))),
        Err(_) => Err(Failure::Other(format!(
            "{what}: no answer within {bound:?}"
        ))),
    }
}

#[derive(Debug)]
enum Failure {
    /// etcd says the lease does not exist (expired, revoked, data lost).
    LeaseGone,
    Other(String),
}

fn is_lease_gone(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

struct LeaseTask {
    opts: EtcdOptions,
    prefix: String,
    /// `/kvfabric/<fabric>/tombstones/` (a put is conditional on the own
    /// pod's tombstone being absent).
    tomb_prefix: String,
    shared: Arc<Shared>,
    client: Option<Client>,
    desired: Option<AgentRecord>,
    lease: Option<i64>,
    keeper: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    /// Last time etcd confirmed the lease alive.
    last_ok: Instant,
    backoff: Backoff,
    /// When the next keep-alive (or retry) is due.
    next: Instant,
}

impl LeaseTask {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>, mut stop: watch::Receiver<bool>) {
        loop {
            if *stop.borrow() {
                return;
            }
            let due = tokio::time::sleep_until(self.next.into());
            tokio::select! {
                _ = stop.changed() => return,
                cmd = rx.recv() => match cmd {
                    None => return,
                    Some(cmd) => self.handle(cmd).await,
                },
                _ = due, if self.desired.is_some() => self.tick().await,
            }
        }
    }

    async fn client(&mut self) -> Result<Client, Failure> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let c = connect(&self.opts).await.map_err(Failure::Other)?;
        self.client = Some(c.clone());
        Ok(c)
    }

    /// A transport-level failure: start from a fresh client and stream.
    fn drop_connection(&mut self) {
        self.client = None;
        self.keeper = None;
    }

    fn lost_or(&self, within_ttl: LeaseState) -> LeaseState {
        if self.last_ok.elapsed() > Duration::from_secs(self.opts.ttl_secs() as u64) {
            LeaseState::Lost
        } else {
            within_ttl
        }
    }

    fn schedule_retry(&mut self) {
        self.next = Instant::now() + self.backoff.next();
    }

    async fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Publish(rec, reply) => {
                let rec = *rec;
                if let Some(prev) = &self.desired {
                    if prev.name != rec.name {
                        self.shared.published_rev.store(0, Ordering::SeqCst);
                        self.delete_key(&prev.name.clone()).await;
                    }
                }
                *self
                    .shared
                    .own_name
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(rec.name.clone());
                *self
                    .shared
                    .own_pod_uid
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = rec.pod_uid.clone();
                self.desired = Some(rec);
                let r = self.publish_now().await;
                let _ = reply.send(r.map_err(|e| match e {
                    Failure::LeaseGone => DiscoveryError::Store("lease not found".into()),
                    Failure::Other(m) => DiscoveryError::Store(m),
                }));
            }
            Cmd::Revoke(reply) => {
                let _ = reply.send(self.revoke().await);
            }
            Cmd::Republish => {
                if self.desired.is_some() {
                    tracing::warn!("own discovery key vanished; republishing");
                    let _ = self.publish_now().await;
                }
            }
        }
    }

    /// Grants a lease if none is held and puts the desired record under it;
    /// re-grants once if etcd no longer knows the lease. On failure the
    /// retry is scheduled with backoff.
    async fn publish_now(&mut self) -> Result<(), Failure> {
        // A republish queued before the operator tombstoned this agent's
        // pod (a watch DELETE, then a resync) must not resurrect the
        // record: checked here, when the put would happen.
        if self.shared.own_pod_tombstoned() {
            return Ok(());
        }
        let mut last = Failure::Other("not attempted".into());
        for _ in 0..2 {
            match self.try_publish().await {
                Ok(()) => {
                    self.last_ok = Instant::now();
                    self.backoff.reset();
                    // A put does not renew the lease: never push the next
                    // keep-alive back (republishing more often than the
                    // keep-alive interval — engines attaching, rollout
                    // steps — would otherwise let the lease expire).
                    self.next = self.next.min(Instant::now() + self.opts.interval());
                    self.shared.set_state(LeaseState::Ok);
                    return Ok(());
                }
                Err(Failure::LeaseGone) => {
                    tracing::warn!(lease = ?self.lease, "etcd lease gone; granting a new one");
                    self.lease = None;
                    self.keeper = None;
                    self.shared.lease_id.store(0, Ordering::SeqCst);
                    self.shared.set_state(LeaseState::Regranting);
                    last = Failure::LeaseGone;
                }
                Err(e) => {
                    tracing::warn!(error = ?e, "publishing to etcd failed; will retry");
                    self.drop_connection();
                    last = e;
                    break;
                }
            }
        }
        let state = self.lost_or(if self.lease.is_some() {
            LeaseState::Renewing
        } else {
            LeaseState::Regranting
        });
        self.shared.set_state(state);
        self.schedule_retry();
        Err(last)
    }

    async fn try_publish(&mut self) -> Result<(), Failure> {
        let Some(rec) = self.desired.as_mut() else {
            return Ok(());
        };
        rec.published_at_ms = now_ms();
        let key = format!("{}{}", self.prefix, rec.name);
        let value = rec.encode();
        let pod_uid = rec.pod_uid.clone();
        let mut client = self.client().await?;
        let rt = self.opts.request_timeout;
        let id = match self.lease {
            Some(id) => id,
            None => {
                let ttl = self.opts.ttl_secs();
                let resp = bounded(rt, "lease grant", client.lease_grant(ttl, None)).await?;
                let id = resp.id();
                let n = self.shared.grants.fetch_add(1, Ordering::SeqCst) + 1;
                tracing::info!(
                    lease = id,
                    ttl = resp.ttl(),
                    grants = n,
                    "etcd lease granted"
                );
                self.lease = Some(id);
                self.keeper = None;
                self.shared.lease_id.store(id, Ordering::SeqCst);
                id
            }
        };
        let opts = Some(PutOptions::new().with_lease(id));
        let rev = if pod_uid.is_empty() {
            let put = bounded(rt, "put", client.put(key, value, opts)).await?;
            put.header().map(|h| h.revision()).unwrap_or(0)
        } else {
            // Put only while the pod has no tombstone, atomically: a
            // republish racing the operator's invalidation (queued before
            // this agent's watch saw the tombstone) cannot bring a dead
            // pod's record back.
            let tomb = format!("{}{}", self.tomb_prefix, pod_uid);
            let txn = Txn::new()
                .when([Compare::version(tomb, CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key, value, opts)]);
            let resp = bounded(rt, "put", client.txn(txn)).await?;
            if !resp.succeeded() {
                self.shared.mark_invalidated(&pod_uid);
                return Ok(());
            }
            resp.header().map(|h| h.revision()).unwrap_or(0)
        };
        self.shared.published_rev.store(rev, Ordering::SeqCst);
        Ok(())
    }

    async fn delete_key(&mut self, name: &str) {
        let key = format!("{}{name}", self.prefix);
        if let Ok(mut c) = self.client().await {
            if let Err(e) = bounded(self.opts.request_timeout, "delete", c.delete(key, None)).await
            {
                tracing::warn!(error = ?e, "deleting the previous discovery key failed");
            }
        }
    }

    async fn revoke(&mut self) -> Result<(), DiscoveryError> {
        self.desired = None;
        self.shared.published_rev.store(0, Ordering::SeqCst);
        *self
            .shared
            .own_name
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
        self.keeper = None;
        self.shared.set_state(LeaseState::Revoked);
        let Some(id) = self.lease.take() else {
            return Ok(());
        };
        self.shared.lease_id.store(0, Ordering::SeqCst);
        let mut client = self.client().await.map_err(|e| match e {
            Failure::LeaseGone => DiscoveryError::Store("lease not found".into()),
            Failure::Other(m) => DiscoveryError::Store(m),
        })?;
        match bounded(
            self.opts.request_timeout,
            "lease revoke",
            client.lease_revoke(id),
        )
        .await
        {
            Ok(_) | Err(Failure::LeaseGone) => {
                tracing::info!(lease = id, "etcd lease revoked");
                Ok(())
            }
            Err(Failure::Other(m)) => {
                self.drop_connection();
                Err(DiscoveryError::Store(m))
            }
        }
    }

    /// One keep-alive round (or a publish retry when no lease is held).
    async fn tick(&mut self) {
        if self.desired.is_none() {
            return;
        }
        if self.lease.is_none() {
            let _ = self.publish_now().await;
            return;
        }
        match self.keep_alive().await {
            Ok(()) => {
                self.shared.keepalives.fetch_add(1, Ordering::Relaxed);
                self.last_ok = Instant::now();
                self.backoff.reset();
                self.next = Instant::now() + self.opts.interval();
                self.shared.set_state(LeaseState::Ok);
            }
            Err(Failure::LeaseGone) => {
                tracing::warn!(lease = ?self.lease, "etcd reports the lease gone; re-granting and republishing");
                self.lease = None;
                self.keeper = None;
                self.shared.lease_id.store(0, Ordering::SeqCst);
                self.shared.set_state(LeaseState::Regranting);
                let _ = self.publish_now().await;
            }
            Err(Failure::Other(m)) => {
                self.drop_connection();
                let state = self.lost_or(LeaseState::Renewing);
                tracing::warn!(error = %m, state = %state, "etcd keep-alive failed; retrying");
                self.shared.set_state(state);
                let retry = self.backoff.next().min(self.opts.interval());
                self.next = Instant::now() + retry;
            }
        }
    }

    async fn keep_alive(&mut self) -> Result<(), Failure> {
        let id = self.lease.expect("lease held");
        let rt = self.opts.request_timeout;
        if self.keeper.is_none() {
            let mut client = self.client().await?;
            // Opening the stream sends one keep-alive and reads its answer
            // (an error "lease not found" when the TTL came back 0).
            let kp = bounded(rt, "keep-alive open", client.lease_keep_alive(id)).await?;
            self.keeper = Some(kp);
            return Ok(());
        }
        let (keeper, stream) = self.keeper.as_mut().expect("keeper");
        bounded(rt, "keep-alive send", keeper.keep_alive()).await?;
        match bounded(rt, "keep-alive", stream.message()).await? {
            Some(resp) if resp.ttl() > 0 => Ok(()),
            Some(_) => Err(Failure::LeaseGone),
            None => Err(Failure::Other("keep-alive stream closed".into())),
        }
    }
}

struct WatchTask {
    opts: EtcdOptions,
    prefix: String,
    shared: Arc<Shared>,
    cmd_tx: mpsc::UnboundedSender<Cmd>,
    client: Option<Client>,
    /// Full reads of the prefix done so far.
    reads: u64,
    /// `/kvfabric/<fabric>/`: agents and tombstones are read and watched
    /// together (one revision for both).
    fabric_prefix: String,
    /// `/kvfabric/<fabric>/tombstones/`: pod UIDs the operator invalidated.
    tomb_prefix: String,
    /// `/kvfabric/<fabric>/removals/`: the operator's note that it removes
    /// a record without a tombstone (a restart, a node NotReady).
    removals_prefix: String,
    /// `<fabric prefix>config/agents/<logical id>`, when followed.
    own_config_key: Option<String>,
    /// `<fabric prefix>config/desired`.
    desired_key: String,
}

impl WatchTask {
    /// Passes rollout documents on: the own one to `assigned_config`'s
    /// channel, the desired one to `desired`.
    fn config_kv(&self, key: &[u8], value: &[u8]) {
        if self.own_config_key.as_deref().map(str::as_bytes) == Some(key) {
            let _ = self.shared.config_tx.send(value.to_vec());
        } else if key == self.desired_key.as_bytes() {
            *self
                .shared
                .desired
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(value.to_vec());
        }
    }

    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(&self.opts);
        loop {
            if *stop.borrow() {
                return;
            }
            match self.watch_once(&mut stop, &mut backoff).await {
                Ok(()) => return,
                Err(e) => {
                    self.shared.watching.store(false, Ordering::SeqCst);
                    self.client = None;
                    let wait = backoff.next();
                    if self.reads == 0 {
                        // Never connected yet: say what the agent waits for
                        // (readiness stays 503 until then).
                        tracing::warn!(
                            endpoints = ?self.opts.endpoints, error = %e, retry_in = ?wait,
                            "waiting for etcd: cannot read the discovery prefix yet; \
                             /readyz answers 503 until it can (is etcd running at these endpoints?)"
                        );
                    } else {
                        tracing::warn!(error = %e, retry_in = ?wait, "etcd watch interrupted; will resync");
                    }
                    tokio::select! {
                        _ = stop.changed() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    fn name_of<'k>(&self, key: &'k [u8]) -> Option<&'k str> {
        std::str::from_utf8(key)
            .ok()?
            .strip_prefix(self.prefix.as_str())
    }

    /// Decodes a key-value; `None` (with a warning) when it is not a valid
    /// record for its key.
    fn decode(&self, name: &str, value: &[u8]) -> Option<AgentRecord> {
        match AgentRecord::decode(value) {
            Ok(rec) if rec.name == name => Some(rec),
            Ok(rec) => {
                tracing::warn!(key = %LogSafe(name), record = %LogSafe(&rec.name), "discovery record names another agent; ignored");
                None
            }
            Err(e) => {
                tracing::warn!(key = %LogSafe(name), error = %e, "undecodable discovery record; ignored");
                None
            }
        }
    }

    /// The own key was seen absent (deleted at `rev`, or missing from a
    /// read at `rev`): republish, unless our latest put is newer than that.
    fn own_key_gone(&self, name: &str, rev: i64) {
        let published = self.shared.published_rev.load(Ordering::SeqCst);
        if self.shared.own_name().as_deref() == Some(name) && published > 0 && rev >= published {
            if self.shared.own_pod_tombstoned() {
                // The operator invalidated this agent's pod: putting the
                // record back would resurrect a dead peer.
                return;
            }
            let _ = self.cmd_tx.send(Cmd::Republish);
        }
    }

    /// The pod UID of a tombstone key (`<fabric prefix>tombstones/<uid>`).
    fn tomb_of<'k>(&self, key: &'k [u8]) -> Option<&'k str> {
        std::str::from_utf8(key)
            .ok()?
            .strip_prefix(self.tomb_prefix.as_str())
            .filter(|u| !u.is_empty())
    }

    /// Reads the prefix, resyncs, then follows the watch until it fails
    /// (`Err`) or `stop` fires (`Ok`).
    async fn watch_once(
        &mut self,
        stop: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
    ) -> Result<(), String> {
        let rt = self.opts.request_timeout;
        let mut client = match &self.client {
            Some(c) => c.clone(),
            None => {
                let c = connect(&self.opts).await?;
                self.client = Some(c.clone());
                c
            }
        };
        let resp = bounded(
            rt,
            "get",
            client.get(
                self.fabric_prefix.as_str(),
                Some(GetOptions::new().with_prefix()),
            ),
        )
        .await
        .map_err(|e| format!("{e:?}"))?;
        let rev = resp.header().map(|h| h.revision()).unwrap_or(0);
        if self.reads > 0 {
            self.shared.resyncs.fetch_add(1, Ordering::Relaxed);
        }
        self.reads += 1;
        let mut snapshot = Vec::new();
        for kv in resp.kvs() {
            if let Some(uid) = self.tomb_of(kv.key()) {
                self.shared.hub.add_tombstone(uid, None);
            }
            self.config_kv(kv.key(), kv.value());
        }
        for kv in resp.kvs() {
            if let Some(name) = self.name_of(kv.key()) {
                if let Some(rec) = self.decode(name, kv.value()) {
                    snapshot.push(rec);
                }
            }
        }
        if let Some(own) = self.shared.own_name() {
            if !snapshot.iter().any(|r| r.name == own) {
                self.own_key_gone(&own, rev);
            }
        }
        self.shared.hub.resync(snapshot);
        let mut stream = bounded(
            rt,
            "watch",
            client.watch(
                self.fabric_prefix.as_str(),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(rev + 1),
                ),
            ),
        )
        .await
        .map_err(|e| format!("{e:?}"))?;
        self.shared.watching.store(true, Ordering::SeqCst);
        backoff.reset();
        if self.reads == 1 {
            tracing::info!(endpoints = ?self.opts.endpoints, prefix = %self.prefix, revision = rev, "etcd connected; watching peers");
        } else {
            tracing::debug!(prefix = %self.prefix, revision = rev, "etcd watch established");
        }
        loop {
            let msg = tokio::select! {
                _ = stop.changed() => return Ok(()),
                m = stream.message() => m,
            };
            let resp = match msg {
                Ok(Some(r)) => r,
                Ok(None) => return Err("watch stream ended".into()),
                Err(e) => return Err(format!("watch stream: {e}")),
            };
            if resp.canceled() || resp.compact_revision() > 0 {
                return Err(format!(
                    "watch canceled (compacted at {}): {}",
                    resp.compact_revision(),
                    resp.cancel_reason()
                ));
            }
            // Tombstones and removal notes first: the operator removes a
            // dead pod's records and tombstones its UID (or, for a pod that
            // lives on, notes the removal) in one transaction (one
            // revision), and such a removal is the operator path.
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                if ev.event_type() == EventType::Put {
                    if let Some(name) = std::str::from_utf8(kv.key())
                        .ok()
                        .and_then(|k| k.strip_prefix(self.removals_prefix.as_str()))
                    {
                        if let Some(observed) = tombstone_observed_at_ms(kv.value()) {
                            self.shared.hub.remove_noted(name, observed);
                        }
                        continue;
                    }
                }
                if let Some(uid) = self.tomb_of(kv.key()) {
                    if ev.event_type() == EventType::Put {
                        tracing::info!(pod_uid = %LogSafe(uid), "pod invalidated by the operator (tombstone)");
                        let observed = tombstone_observed_at_ms(kv.value());
                        self.shared.hub.add_tombstone(uid, observed);
                    }
                }
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                if self.tomb_of(kv.key()).is_some() {
                    continue;
                }
                if ev.event_type() == EventType::Put {
                    self.config_kv(kv.key(), kv.value());
                }
                let Some(name) = self.name_of(kv.key()) else {
                    continue;
                };
                match ev.event_type() {
                    EventType::Put => match self.decode(name, kv.value()) {
                        Some(rec) => self.shared.hub.upsert(rec),
                        None => self.shared.hub.remove(name),
                    },
                    EventType::Delete => {
                        let ttl_ms =
                            i64::try_from(self.opts.lease_ttl.as_millis()).unwrap_or(i64::MAX);
                        self.shared
                            .hub
                            .remove_expired(name, super::epoch_ms().saturating_sub(ttl_ms));
                        self.own_key_gone(name, kv.mod_revision());
                    }
                }
            }
        }
    }
}

/// `observedAtMs` of a tombstone's JSON value (the operator's
/// `store::Tombstone`); `None` when absent or not JSON.
fn tombstone_observed_at_ms(value: &[u8]) -> Option<i64> {
    let v: serde_json::Value = serde_json::from_slice(value).ok()?;
    v.get("observedAtMs")?.as_i64()
}
