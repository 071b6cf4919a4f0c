//! Direct TCP control channel ([`ControlKind::Tcp`](kvfabric_core::ControlKind)):
//! the IO thread writes length-prefixed frames straight to a non-blocking
//! socket per peer and reads its accepted sockets itself. No library
//! threads sit between the two IO threads, so a message costs one kernel
//! loopback/NIC hop — and, with the reactor's busy-poll window, no thread
//! wake-up at all. With ZMQ each hop crosses the sender's and the
//! receiver's ZMQ I/O threads; after an idle gap each of those wake-ups
//! costs ≈60 µs or more on the H200 host (docs/benchmarks.md, "Control
//! hops"), which dominated a single 64 MiB GPU transfer.
//!
//! Wire (per connection, both directions independent): the connecting side
//! first sends a hello frame — [`HELLO_MAGIC`] followed by its name
//! (1..=[`MAX_NAME_LEN`] bytes, UTF-8), or with a control key the
//! authenticated hello of [`super::auth`] (`controlAuth`: the name proven
//! with the fabric's key, bound to the destination, the time and a nonce)
//! — then message frames. Every frame is
//! a little-endian `u32` payload length and the payload (at most
//! [`MAX_FRAME_BYTES`]). Endpoints are `tcp://IP:PORT` with an IP literal
//! (bracketed for IPv6): resolving names would block the IO thread.
//!
//! Sends never block: frames queue per peer (at most
//! [`SEND_QUEUE_BYTES`]; beyond that a message is dropped with a warning,
//! like ZMQ's high-water mark) and are written whenever the socket takes
//! them — at once in the common case. The connection to a peer is opened
//! when its route is added (as ZMQ's DEALER connects at `add_peer`), so
//! the first message to a newly loaded peer does not wait for the connect
//! and hello. (On the H200 the first hand-off's WANT left 0.27–0.34 ms
//! after submit against 0.05–0.13 ms later; connecting early did not
//! change that measurably — docs/benchmarks.md, "Issue 18, fourteenth
//! session": the first request's extra time is elsewhere.) A connection
//! that fails is retried after
//! [`RECONNECT_BACKOFF`] once something is queued for the peer; a connect
//! that has not completed within [`CONNECT_TIMEOUT`] (a peer address that
//! drops SYNs: a dead pod's IP, a full accept queue) counts as failed
//! rather than waiting out the kernel's SYN retries (≈2 min); a frame
//! cut by a broken connection is lost (counted as dropped; its request
//! times out, as with any lost message).

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::auth::{AuthMode, ControlAuth, HelloVerifier, AUTH_HELLO_HEADER};
use super::zmq::{tcp_endpoint, validate_endpoint, BindAddr, MAX_NAME_LEN};
use super::{ControlChannel, ControlError, Inbound};
use crate::runtime::waker::Waker;

/// First bytes of the hello frame that opens every connection.
pub const HELLO_MAGIC: &[u8; 4] = b"KVFT";
/// Largest accepted frame payload, bytes (a DATA of 2^20 runs is 48 MiB).
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// Per-peer send queue bound, bytes; a message beyond it is dropped.
pub const SEND_QUEUE_BYTES: usize = 128 << 20;
/// Wait before reconnecting to a peer whose connection failed.
pub const RECONNECT_BACKOFF: Duration = Duration::from_millis(100);
/// Longest a connect (and its hello) may take before it is abandoned and
/// retried after [`RECONNECT_BACKOFF`]: long enough for one lost SYN's
/// retransmit (Linux resends after 1 s), short of the second (3 s).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bytes read from one connection per receive call, so a peer streaming
/// a backlog cannot hold the IO thread (the rest is read next tick).
pub const READ_BUDGET_BYTES: usize = 4 << 20;
/// Most bytes of unfinished frames all accepted connections together may
/// buffer (1 GiB: sixteen frames of [`MAX_FRAME_BYTES`] at once; a
/// control frame in use is at most ≈ 1 MB). Past it the connection holding
/// the most is closed (its peer reconnects; a message it was sending is
/// lost, and its request fails or times out), so many connections each
/// trickling a large frame cannot exhaust memory.
pub const MAX_PARTIAL_BYTES: usize = 1 << 30;
/// Accepted connections kept at most; at the cap a new connection takes
/// the place of the oldest one that has not sent its hello, else of the
/// newest of a name that has more than one connection (a peer has one
/// live connection; the oldest of a name is kept), else of the oldest
/// whose hello named a peer this channel has no route to. Names are not
/// authenticated without a control key ([`super::auth`]): hellos with
/// made-up names, or many with one name, must not lock out the peers
/// discovery loaded. With none of these, accepting
/// pauses (only ≥ 4,096 distinct routed names can do that; reverse routes
/// are capped at 1,024). A newcomer counts as hello-less until its hello
/// is read.
pub const MAX_CONNECTIONS: usize = 4096;
/// Longest data written to a peer may stay unacknowledged before the
/// kernel fails the connection (`TCP_USER_TIMEOUT` on every outbound
/// connection); it is then reconnected like any broken one. Without it a
/// connection open through a network partition keeps retransmitting with a
/// doubling timeout, so after the partition heals it can sit idle for tens
/// of seconds more; with it, a partition longer than this ends the
/// connection and the reconnects (each bounded by [`CONNECT_TIMEOUT`])
/// find the peer within ≈ 2 s of the heal. (Linux also counts a peer that
/// keeps its receive window closed that long — an IO thread stalled 10 s
/// — as failed: the connection is remade and the frame cut is dropped.)
pub const UNACKED_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest an accepted connection may go without its hello before it is
/// closed (a peer writes its hello as soon as its connect completes; this
/// leaves room for a lost hello segment's retransmits): a peer that opens
/// connections and sends nothing cannot hold them.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// One peer's outbound connection and queue.
struct Route {
    endpoint: String,
    addr: SocketAddr,
    stream: Option<TcpStream>,
    /// Hello bytes still to write on the current connection.
    hello: Vec<u8>,
    /// Whole frames (length prefix included) not yet fully written.
    frames: VecDeque<Vec<u8>>,
    /// Bytes of `frames[0]` already written.
    head_written: usize,
    queued_bytes: usize,
    retry_at: Option<Instant>,
    /// When the current connection's connect began, until its hello is
    /// written (it is connected then); see [`CONNECT_TIMEOUT`].
    connect_started: Option<Instant>,
    drop_streak: u64,
}

/// One accepted connection.
struct Conn {
    stream: TcpStream,
    /// When it was accepted (see [`HELLO_TIMEOUT`]).
    accepted: Instant,
    peer: Option<String>,
    buf: Vec<u8>,
}

/// The direct TCP control channel. See the module docs.
pub struct TcpControlChannel {
    own_name: String,
    listener: TcpListener,
    endpoint: String,
    routes: HashMap<String, Route>,
    conns: Vec<Conn>,
    inbox: VecDeque<Inbound>,
    waker: Option<Arc<Waker>>,
    dropped: u64,
    /// Connects abandoned after [`CONNECT_TIMEOUT`].
    connect_timeouts: u64,
    /// Accepted connections closed for sending no hello (timed out, or
    /// evicted at the connection cap).
    hello_timeouts: u64,
    /// Accepted connections that had sent their hello, closed at the
    /// connection cap (a name's newer duplicate, or a name without a
    /// route).
    cap_evictions: u64,
    /// [`MAX_CONNECTIONS`] (lower in tests).
    max_connections: usize,
    /// [`MAX_PARTIAL_BYTES`] (lower in tests).
    max_partial_bytes: usize,
    /// Connections closed for holding the most unfinished-frame bytes
    /// when all of them together passed [`MAX_PARTIAL_BYTES`].
    partial_evictions: u64,
    /// [`HELLO_TIMEOUT`] (shorter in tests).
    hello_timeout: Duration,
    scratch: Vec<u8>,
    /// Our plain hello frame, written first on every outbound connection
    /// when no control key is set.
    hello: Vec<u8>,
    /// The control key: signs our hellos, checks the peers'.
    auth: ControlAuth,
    verifier: HelloVerifier,
    rng: ring::rand::SystemRandom,
    /// Accepted connections closed for a hello the control key refused.
    auth_failures: u64,
    /// See [`HelloCheck::warned_at`].
    hello_warned_at: [Option<Instant>; 2],
    /// Accepting paused until then (fd exhaustion, connection cap): the
    /// listener stays readable and would otherwise spin poll(2).
    accept_paused_until: Option<Instant>,
}

impl std::fmt::Debug for TcpControlChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpControlChannel")
            .field("own_name", &self.own_name)
            .field("endpoint", &self.endpoint)
            .field("peers", &self.routes.len())
            .field("connections", &self.conns.len())
            .finish_non_exhaustive()
    }
}

fn transport(what: &str, e: std::io::Error) -> ControlError {
    ControlError::Transport(format!("{what}: {e}"))
}

/// Parses a validated `tcp://IP:PORT` endpoint into a socket address; host
/// names are rejected (no blocking resolution on the IO thread).
fn parse_addr(peer: &str, endpoint: &str) -> Result<SocketAddr, ControlError> {
    let rest = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
    rest.parse::<SocketAddr>()
        .map_err(|_| ControlError::InvalidEndpoint {
            peer: peer.to_string(),
            endpoint: endpoint.to_string(),
            reason: "expected tcp://IP:PORT with an IP literal (IPv6 in brackets) and a port"
                .into(),
        })
        .and_then(|a| {
            if a.port() == 0 || a.ip().is_unspecified() || a.ip().is_multicast() {
                Err(ControlError::InvalidEndpoint {
                    peer: peer.to_string(),
                    endpoint: endpoint.to_string(),
                    reason: "expected a unicast IP and a non-zero port".into(),
                })
            } else {
                Ok(a)
            }
        })
}

/// `d` as poll(2)'s timeout: whole milliseconds, rounded up (a wait never
/// ends before its deadline), at most `i32::MAX`.
fn poll_ms(d: Duration) -> i32 {
    d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(4 + payload.len());
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

/// A non-blocking connect (the handshake completes in the background;
/// writes see `WouldBlock` until it does, or the connect error).
fn connect_nonblocking(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let domain = match addr.ip() {
        IpAddr::V4(_) => libc::AF_INET,
        IpAddr::V6(_) => libc::AF_INET6,
    };
    // SAFETY: plain socket(2); the fd is owned by the TcpStream below.
    let fd = unsafe {
        libc::socket(
            domain,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket we own.
    let stream = unsafe { <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let user_timeout_ms = UNACKED_TIMEOUT.as_millis() as libc::c_uint;
    // SAFETY: setsockopt(2) with a c_uint option value of its size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            (&user_timeout_ms as *const libc::c_uint).cast(),
            std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
        )
    };
    if r != 0 {
        // Best effort: a kernel without it keeps its own retransmits.
        tracing::debug!(error = %std::io::Error::last_os_error(), "TCP_USER_TIMEOUT not set on a control connection");
    }
    let (storage, len) = sockaddr(addr);
    // SAFETY: storage holds a valid sockaddr of `len` bytes.
    let r = unsafe { libc::connect(fd, (&storage as *const libc::sockaddr_storage).cast(), len) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
    }
    stream.set_nodelay(true)?;
    Ok(stream)
}

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// What checks an accepted connection's hello (borrowed from the channel
/// while a connection is read).
struct HelloCheck<'a> {
    verifier: &'a mut HelloVerifier,
    own: &'a str,
    /// Our advertised endpoint (signed hellos are bound to it).
    endpoint: &'a str,
    failures: &'a mut u64,
    /// When a malformed hello, and one the key refused, was last logged at
    /// warn level (each at most once a second: an agent with another key
    /// retries every 100 ms, and junk must not hide a key mismatch).
    warned_at: &'a mut [Option<Instant>; 2],
}

/// Unix time in ms (0 before the epoch: such a clock fails every check).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `own`'s signed hello frame for a connection to `peer` at `addr`, when
/// `auth` has a key (`Ok(None)` without). The endpoint signed is `addr` in
/// the form a channel advertises its own (`tcp_endpoint` of the
/// listener's address), whatever text the route's endpoint was written in.
fn signed_hello(
    auth: &ControlAuth,
    rng: &ring::rand::SystemRandom,
    own: &str,
    peer: &str,
    addr: SocketAddr,
) -> Result<Option<Vec<u8>>, ring::error::Unspecified> {
    if auth.mode() == AuthMode::Off {
        return Ok(None);
    }
    let mut nonce = [0u8; 16];
    ring::rand::SecureRandom::fill(rng, &mut nonce)?;
    let endpoint = tcp_endpoint(addr.ip(), &addr.port().to_string());
    Ok(auth
        .hello(own, peer, &endpoint, unix_ms(), nonce)
        .map(|p| frame(&p)))
}

impl TcpControlChannel {
    /// Listens at `bind` on a kernel-chosen port. `own_name` is what peers'
    /// [`ControlChannel::recv`] report for our messages (sent in each
    /// connection's hello): 1..=[`MAX_NAME_LEN`] bytes.
    ///
    /// # Errors
    /// [`ControlError::Transport`] for a bad name, an unresolvable bind
    /// address ([`BindAddr::resolve`]) or a socket / bind failure.
    pub fn bind(own_name: &str, bind: BindAddr) -> Result<Self, ControlError> {
        Self::bind_with_auth(own_name, bind, ControlAuth::off())
    }

    /// [`Self::bind`] with the fabric's control key (`controlAuth`): with a
    /// key, hellos are signed, and checked as its mode says
    /// ([`AuthMode`]).
    ///
    /// # Errors
    /// As [`Self::bind`].
    pub fn bind_with_auth(
        own_name: &str,
        bind: BindAddr,
        auth: ControlAuth,
    ) -> Result<Self, ControlError> {
        if own_name.is_empty() || own_name.len() > MAX_NAME_LEN {
            return Err(ControlError::Transport(format!(
                "control channel name {own_name:?} must be 1..={MAX_NAME_LEN} bytes"
            )));
        }
        let ip = bind.resolve()?;
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| transport(&format!("bind control listener on {ip}"), e))?;
        let mut c = Self::on_listener(own_name, listener)?;
        c.verifier = HelloVerifier::new(auth.clone());
        c.auth = auth;
        Ok(c)
    }

    /// The channel over an already bound `listener` (made non-blocking
    /// here); the endpoint is the listener's address.
    fn on_listener(own_name: &str, listener: TcpListener) -> Result<Self, ControlError> {
        listener
            .set_nonblocking(true)
            .map_err(|e| transport("set listener non-blocking", e))?;
        let local = listener
            .local_addr()
            .map_err(|e| transport("read listener address", e))?;
        let endpoint = tcp_endpoint(local.ip(), &local.port().to_string());
        tracing::debug!(name = own_name, %endpoint, "TCP control channel bound");
        Ok(Self {
            own_name: own_name.to_string(),
            listener,
            endpoint,
            routes: HashMap::new(),
            conns: Vec::new(),
            inbox: VecDeque::new(),
            waker: None,
            dropped: 0,
            connect_timeouts: 0,
            hello_timeouts: 0,
            cap_evictions: 0,
            max_connections: MAX_CONNECTIONS,
            max_partial_bytes: MAX_PARTIAL_BYTES,
            partial_evictions: 0,
            hello_timeout: HELLO_TIMEOUT,
            scratch: vec![0; 256 << 10],
            hello: Self::hello_frame(own_name),
            auth: ControlAuth::off(),
            verifier: HelloVerifier::default(),
            rng: ring::rand::SystemRandom::new(),
            auth_failures: 0,
            hello_warned_at: [None; 2],
            accept_paused_until: None,
        })
    }

    /// Our endpoint, `tcp://IP:PORT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Messages dropped so far (full queues, frames cut by broken
    /// connections).
    pub fn dropped_messages(&self) -> u64 {
        self.dropped
    }

    /// Connects abandoned so far for taking longer than [`CONNECT_TIMEOUT`].
    pub fn connect_timeouts(&self) -> u64 {
        self.connect_timeouts
    }

    /// Accepted connections closed so far for sending no hello within
    /// [`HELLO_TIMEOUT`] (or evicted for it at the connection cap).
    pub fn hello_timeouts(&self) -> u64 {
        self.hello_timeouts
    }

    /// Accepted connections that had sent their hello closed so far at
    /// the connection cap ([`MAX_CONNECTIONS`]: a name's newer duplicate,
    /// or a name without a route).
    pub fn cap_evictions(&self) -> u64 {
        self.cap_evictions
    }

    /// Accepted connections closed so far for holding the most bytes of
    /// unfinished frames when all connections together held more than
    /// [`MAX_PARTIAL_BYTES`].
    pub fn partial_evictions(&self) -> u64 {
        self.partial_evictions
    }

    fn hello_frame(own_name: &str) -> Vec<u8> {
        let mut p = HELLO_MAGIC.to_vec();
        p.extend_from_slice(own_name.as_bytes());
        frame(&p)
    }

    /// Writes what the sockets take now; (re)connects routes with queued
    /// frames whose backoff has passed.
    fn flush(&mut self) {
        let (hello, auth, own, rng) = (&self.hello, &self.auth, &self.own_name, &self.rng);
        let now = Instant::now();
        for (peer, r) in &mut self.routes {
            if r.frames.is_empty() && r.stream.is_none() {
                continue;
            }
            if r.stream.is_none() {
                if r.retry_at.is_some_and(|t| now < t) {
                    continue;
                }
                // With a key, each connection's hello is signed afresh
                // (its own time and nonce, bound to this peer).
                let signed = match signed_hello(auth, rng, own, peer, r.addr) {
                    Ok(h) => h,
                    Err(e) => {
                        tracing::warn!(peer, error = %e, "no randomness for a signed control hello; retrying");
                        r.retry_at = Some(now + RECONNECT_BACKOFF);
                        continue;
                    }
                };
                match connect_nonblocking(r.addr) {
                    Ok(s) => {
                        r.stream = Some(s);
                        r.hello = signed.unwrap_or_else(|| hello.clone());
                        r.retry_at = None;
                        r.connect_started = Some(now);
                    }
                    Err(e) => {
                        tracing::debug!(peer, endpoint = %r.endpoint, error = %e, "control connect failed; retrying");
                        r.retry_at = Some(now + RECONNECT_BACKOFF);
                        continue;
                    }
                }
            }
            let Some(stream) = r.stream.as_mut() else {
                continue;
            };
            let connect_expired = r
                .connect_started
                .is_some_and(|t| now.saturating_duration_since(t) >= CONNECT_TIMEOUT);
            let broken = loop {
                let (buf, is_hello): (&[u8], bool) = if !r.hello.is_empty() {
                    (&r.hello, true)
                } else if let Some(f) = r.frames.front() {
                    (&f[r.head_written..], false)
                } else {
                    break None;
                };
                match stream.write(buf) {
                    Ok(0) => break Some(std::io::Error::from(ErrorKind::WriteZero)),
                    Ok(n) if is_hello => {
                        r.hello.drain(..n);
                        if r.hello.is_empty() {
                            r.connect_started = None;
                        }
                    }
                    Ok(n) => {
                        r.head_written += n;
                        if r.head_written == r.frames[0].len() {
                            let f = r.frames.pop_front().expect("front exists");
                            r.queued_bytes -= f.len();
                            r.head_written = 0;
                        }
                    }
                    // The hello not taken yet: still connecting. Abandoned
                    // at the deadline (checked only here, after a write
                    // attempt, so a connection that completed while
                    // nothing pumped is not cut).
                    Err(e) if e.kind() == ErrorKind::WouldBlock && is_hello && connect_expired => {
                        self.connect_timeouts += 1;
                        break Some(std::io::Error::from(ErrorKind::TimedOut));
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break None,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => break Some(e),
                }
            };
            if let Some(e) = broken {
                tracing::debug!(peer, endpoint = %r.endpoint, error = %e, "control connection lost; reconnecting");
                r.stream = None;
                r.hello.clear();
                r.connect_started = None;
                r.retry_at = Some(now + RECONNECT_BACKOFF);
                if r.head_written > 0 {
                    // The receiver discards the cut frame with the connection.
                    if let Some(f) = r.frames.pop_front() {
                        r.queued_bytes -= f.len();
                    }
                    r.head_written = 0;
                    self.dropped += 1;
                }
            }
        }
    }

    /// The connection to close at the cap ([`MAX_CONNECTIONS`]) and
    /// whether it is hello-less: the oldest hello-less one, else the
    /// newest of a name with several, else the oldest of a name without a
    /// route; `None` when every connection is a routed peer's only one.
    fn cap_eviction(&self) -> Option<(usize, bool)> {
        if let Some(k) = self.conns.iter().position(|c| c.peer.is_none()) {
            return Some((k, true));
        }
        let mut per_name: HashMap<&str, usize> = HashMap::new();
        for c in &self.conns {
            if let Some(p) = &c.peer {
                *per_name.entry(p.as_str()).or_default() += 1;
            }
        }
        // `conns` is in accept order: the newest duplicate is the last.
        let duplicate = self.conns.iter().rposition(|c| {
            c.peer
                .as_deref()
                .is_some_and(|p| per_name.get(p).is_some_and(|&n| n > 1))
        });
        duplicate
            .or_else(|| {
                self.conns.iter().position(|c| {
                    c.peer
                        .as_ref()
                        .is_some_and(|p| !self.routes.contains_key(p))
                })
            })
            .map(|k| (k, false))
    }

    fn accept(&mut self) {
        if self.accept_paused_until.is_some_and(|t| Instant::now() < t) {
            return;
        }
        self.accept_paused_until = None;
        loop {
            // At the cap, a connection that arrives takes the place of
            // another ([`MAX_CONNECTIONS`]); with none to close, accepting
            // pauses (arrivals wait in the listen backlog).
            let at_cap = self.conns.len() >= self.max_connections;
            let evict = if at_cap { self.cap_eviction() } else { None };
            if at_cap && evict.is_none() {
                tracing::warn!(
                    max = self.max_connections,
                    "too many control connections; accepting paused"
                );
                self.accept_paused_until = Some(Instant::now() + RECONNECT_BACKOFF);
                return;
            }
            match self.listener.accept() {
                Ok((s, _)) => {
                    match evict {
                        Some((k, true)) => {
                            self.conns.remove(k);
                            self.hello_timeouts += 1;
                            tracing::debug!(
                                "control connection cap reached; the oldest without a hello closed"
                            );
                        }
                        Some((k, false)) => {
                            let c = self.conns.remove(k);
                            self.cap_evictions += 1;
                            tracing::debug!(
                                peer = c.peer.as_deref().unwrap_or_default(),
                                "control connection cap reached; a duplicate or unrouted peer's connection closed"
                            );
                        }
                        None => {}
                    }
                    if s.set_nonblocking(true).is_ok() {
                        let _ = s.set_nodelay(true);
                        self.conns.push(Conn {
                            stream: s,
                            accepted: Instant::now(),
                            peer: None,
                            buf: Vec::new(),
                        });
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    // EMFILE / ENFILE / ENOBUFS: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a control connection failed; paused");
                    self.accept_paused_until = Some(Instant::now() + RECONNECT_BACKOFF);
                    return;
                }
            }
        }
    }

    /// Reads every connection; complete frames go to the inbox.
    fn read_all(&mut self) {
        let now = Instant::now();
        let mut k = 0;
        while k < self.conns.len() {
            let mut check = HelloCheck {
                verifier: &mut self.verifier,
                own: &self.own_name,
                endpoint: &self.endpoint,
                failures: &mut self.auth_failures,
                warned_at: &mut self.hello_warned_at,
            };
            let mut keep = Self::read_conn(
                &mut self.conns[k],
                &mut self.scratch,
                &mut self.inbox,
                &mut check,
            );
            let c = &self.conns[k];
            if keep
                && c.peer.is_none()
                && now.saturating_duration_since(c.accepted) >= self.hello_timeout
            {
                tracing::debug!(timeout = ?self.hello_timeout, "control connection sent no hello; closed");
                self.hello_timeouts += 1;
                keep = false;
            }
            if keep {
                k += 1;
            } else {
                // Order kept: an older connection of a peer is read first.
                self.conns.remove(k);
            }
        }
        self.cap_partial_bytes();
    }

    /// While the connections' unfinished frames (their buffers: complete
    /// frames were moved to the inbox) hold more than the cap together,
    /// closes the one holding the most.
    fn cap_partial_bytes(&mut self) {
        let mut total: usize = self.conns.iter().map(|c| c.buf.len()).sum();
        while total > self.max_partial_bytes {
            let Some((k, held)) = self
                .conns
                .iter()
                .enumerate()
                .map(|(k, c)| (k, c.buf.len()))
                .max_by_key(|&(_, held)| held)
            else {
                return;
            };
            let c = self.conns.remove(k);
            tracing::warn!(
                peer = ?c.peer,
                held,
                total,
                cap = self.max_partial_bytes,
                "unfinished control frames over the cap; the connection holding the most closed"
            );
            self.partial_evictions += 1;
            total -= held;
        }
    }

    /// Reads one connection until it would block or
    /// [`READ_BUDGET_BYTES`] were read, handing complete frames to the
    /// inbox; `false` when it is closed (EOF, error or a protocol
    /// violation: a frame over [`MAX_FRAME_BYTES`], or a first frame that
    /// is not a valid hello — checked from its length prefix, before its
    /// body is buffered).
    fn read_conn(
        c: &mut Conn,
        scratch: &mut [u8],
        inbox: &mut VecDeque<Inbound>,
        check: &mut HelloCheck<'_>,
    ) -> bool {
        let mut budget = READ_BUDGET_BYTES;
        let mut open = true;
        while budget > 0 {
            let want = scratch.len().min(budget);
            match c.stream.read(&mut scratch[..want]) {
                Ok(0) => {
                    open = false;
                    break;
                }
                Ok(n) => {
                    budget -= n;
                    c.buf.extend_from_slice(&scratch[..n]);
                    if !Self::parse_frames(c, inbox, check) {
                        return false;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        if c.buf.is_empty() && c.buf.capacity() > (1 << 20) {
            c.buf = Vec::new();
        }
        open
    }

    /// Moves the complete frames at the front of `c.buf` to the inbox;
    /// `false` on a protocol violation.
    fn parse_frames(
        c: &mut Conn,
        inbox: &mut VecDeque<Inbound>,
        check: &mut HelloCheck<'_>,
    ) -> bool {
        let mut at = 0;
        while c.buf.len() - at >= 4 {
            let mut len = [0u8; 4];
            len.copy_from_slice(&c.buf[at..at + 4]);
            let len = u32::from_le_bytes(len) as usize;
            let max = if c.peer.is_some() {
                MAX_FRAME_BYTES
            } else {
                AUTH_HELLO_HEADER + MAX_NAME_LEN
            };
            if len > max {
                tracing::warn!(peer = ?c.peer, bytes = len, max, "control frame too large; connection closed");
                return false;
            }
            if c.buf.len() - at - 4 < len {
                if at == 0 {
                    // Waiting for the rest of a large frame: make room once.
                    c.buf.reserve(len + 4 - c.buf.len());
                }
                break;
            }
            let payload = &c.buf[at + 4..at + 4 + len];
            match &c.peer {
                Some(p) => inbox.push_back((p.clone(), payload.to_vec())),
                None => {
                    let now = Instant::now();
                    match check.verifier.check(
                        payload,
                        check.own,
                        check.endpoint,
                        unix_ms(),
                        now,
                        HELLO_MAGIC,
                    ) {
                        Ok(n) => c.peer = Some(n.to_string()),
                        Err(why) => {
                            if why.by_key {
                                *check.failures += 1;
                            }
                            let slot = &mut check.warned_at[usize::from(why.by_key)];
                            if slot.is_none_or(|t| {
                                now.saturating_duration_since(t) >= Duration::from_secs(1)
                            }) {
                                *slot = Some(now);
                                tracing::warn!(reason = %why, refused = *check.failures, "control connection without a valid hello; closed (logged at most once a second)");
                            } else {
                                tracing::debug!(reason = %why, "control connection without a valid hello; closed");
                            }
                            return false;
                        }
                    }
                }
            }
            at += 4 + len;
        }
        c.buf.drain(..at);
        true
    }

    fn pump(&mut self) {
        self.flush();
        self.accept();
        self.read_all();
    }

    /// Waits in poll(2) for input, writable queued sockets or the waker,
    /// at most `timeout`. Returns whether the waker fired.
    fn wait(&mut self, timeout: Duration) -> bool {
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(2 + self.conns.len());
        let pfd = |fd: i32, events: i16| libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        let accepting = self.accept_paused_until.is_none_or(|t| Instant::now() >= t);
        // While accepting is paused the listener stays readable: leave it
        // out (the paused time bounds the wait below).
        fds.push(pfd(
            self.listener.as_raw_fd(),
            if accepting { libc::POLLIN } else { 0 },
        ));
        for c in &self.conns {
            fds.push(pfd(c.stream.as_raw_fd(), libc::POLLIN));
        }
        for r in self.routes.values() {
            if let Some(s) = &r.stream {
                if !r.frames.is_empty() || !r.hello.is_empty() {
                    fds.push(pfd(s.as_raw_fd(), libc::POLLOUT));
                }
            }
        }
        let waker_at = self.waker.as_ref().map(|w| {
            fds.push(pfd(w.fd(), libc::POLLIN));
            fds.len() - 1
        });
        // Whole milliseconds, rounded up; a route waiting to reconnect
        // bounds the wait by its backoff.
        let mut ms = poll_ms(timeout);
        // (A route with nothing queued is not retried: see `flush`.)
        if !accepting
            || self
                .routes
                .values()
                .any(|r| r.retry_at.is_some() && !r.frames.is_empty())
        {
            ms = ms.min(RECONNECT_BACKOFF.as_millis() as i32);
        }
        // A connect still in progress is abandoned at its deadline, an
        // accepted connection without a hello closed at its.
        let now = Instant::now();
        let connects = self
            .routes
            .values()
            .filter(|r| r.stream.is_some())
            .filter_map(|r| r.connect_started)
            .map(|t| t + CONNECT_TIMEOUT);
        let hello_timeout = self.hello_timeout;
        let hellos = self
            .conns
            .iter()
            .filter(|c| c.peer.is_none())
            .map(move |c| c.accepted + hello_timeout);
        if let Some(left) = connects
            .chain(hellos)
            .map(|at| at.saturating_duration_since(now))
            .min()
        {
            ms = ms.min(poll_ms(left));
        }
        // SAFETY: fds is a valid array of fds.len() pollfd entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        match (n > 0, waker_at) {
            (true, Some(i)) if fds[i].revents & libc::POLLIN != 0 => {
                if let Some(w) = &self.waker {
                    w.drain();
                }
                true
            }
            _ => false,
        }
    }
}

impl ControlChannel for TcpControlChannel {
    fn local_endpoint(&self) -> Vec<u8> {
        self.endpoint.as_bytes().to_vec()
    }

    /// Validates the endpoint (as ZMQ's, plus: an IP literal), records the
    /// route and starts a non-blocking connect to it (the hello goes out
    /// once it completes, whenever the channel is pumped). A connect that
    /// fails at once is left to the first send, which retries it. The same
    /// endpoint again is a no-op; a new one replaces the route (and drops
    /// what was queued for the old one).
    fn add_peer(&mut self, peer: &str, endpoint: &[u8]) -> Result<(), ControlError> {
        let endpoint = validate_endpoint(peer, endpoint)?;
        let addr = parse_addr(peer, &endpoint)?;
        if self
            .routes
            .get(peer)
            .is_some_and(|r| r.endpoint == endpoint)
        {
            return Ok(());
        }
        tracing::debug!(peer, %endpoint, "TCP control route added");
        let signed = signed_hello(&self.auth, &self.rng, &self.own_name, peer, addr);
        let (stream, hello, connect_started) = match signed.map(|h| (h, connect_nonblocking(addr)))
        {
            Ok((h, Ok(s))) => (
                Some(s),
                h.unwrap_or_else(|| self.hello.clone()),
                Some(Instant::now()),
            ),
            // No randomness for the nonce: the first send retries.
            Err(_) => (None, Vec::new(), None),
            Ok((_, Err(e))) => {
                tracing::debug!(peer, %endpoint, error = %e, "control connect failed; the first send retries it");
                (None, Vec::new(), None)
            }
        };
        self.routes.insert(
            peer.to_string(),
            Route {
                endpoint,
                addr,
                stream,
                hello,
                frames: VecDeque::new(),
                head_written: 0,
                queued_bytes: 0,
                retry_at: None,
                connect_started,
                drop_streak: 0,
            },
        );
        Ok(())
    }

    fn refused_hellos(&self) -> u64 {
        self.auth_failures
    }

    fn unsigned_hellos(&self) -> u64 {
        self.verifier.unsigned_accepted()
    }

    /// Drops the route after one last non-blocking flush (what the socket
    /// does not take now — e.g. cancels queued just before — is dropped).
    fn remove_peer(&mut self, peer: &str) {
        if self.routes.contains_key(peer) {
            self.flush();
            if let Some(r) = self.routes.remove(peer) {
                self.dropped += r.frames.len() as u64;
                tracing::debug!(peer, unsent = r.frames.len(), "TCP control route removed");
            }
        }
    }

    fn has_peer(&self, peer: &str) -> bool {
        self.routes.contains_key(peer)
    }

    /// Queues `msg` and writes what the socket takes now (never blocks).
    fn send_to(&mut self, peer: &str, msg: &[u8]) -> Result<(), ControlError> {
        if msg.len() > MAX_FRAME_BYTES {
            return Err(ControlError::Transport(format!(
                "control message of {} bytes to {peer:?} exceeds {MAX_FRAME_BYTES}",
                msg.len()
            )));
        }
        let r = self
            .routes
            .get_mut(peer)
            .ok_or_else(|| ControlError::UnknownPeer(peer.to_string()))?;
        if r.queued_bytes + msg.len() + 4 > SEND_QUEUE_BYTES {
            r.drop_streak += 1;
            self.dropped += 1;
            if r.drop_streak % 1024 == 1 {
                tracing::warn!(peer, endpoint = %r.endpoint, bytes = msg.len(), streak = r.drop_streak,
                    "control send queue full ({SEND_QUEUE_BYTES} bytes); message dropped");
            }
            return Err(ControlError::Dropped(peer.to_string()));
        }
        r.drop_streak = 0;
        if r.frames.is_empty() {
            // An idle connection may have died (the peer restarted): the
            // peer never writes on it, so EOF or any data means it is gone.
            // Reconnect now rather than lose this message to a reset.
            if let Some(stream) = &r.stream {
                let mut b = [0u8; 1];
                let dead =
                    !matches!(stream.peek(&mut b), Err(e) if e.kind() == ErrorKind::WouldBlock);
                if dead {
                    tracing::debug!(peer, endpoint = %r.endpoint, "idle control connection closed by the peer; reconnecting");
                    r.stream = None;
                    r.hello.clear();
                    r.connect_started = None;
                    r.retry_at = None;
                }
            }
        }
        let f = frame(msg);
        r.queued_bytes += f.len();
        r.frames.push_back(f);
        self.flush();
        Ok(())
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<Inbound>, ControlError> {
        if let Some(m) = self.inbox.pop_front() {
            return Ok(Some(m));
        }
        self.pump();
        if let Some(m) = self.inbox.pop_front() {
            return Ok(Some(m));
        }
        let deadline = Instant::now() + timeout;
        while !timeout.is_zero() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let woken = self.wait(left);
            self.pump();
            if let Some(m) = self.inbox.pop_front() {
                return Ok(Some(m));
            }
            if woken {
                break;
            }
        }
        Ok(None)
    }

    fn set_waker(&mut self, waker: Arc<Waker>) {
        self.waker = Some(waker);
    }
}

/// A listening socket on 127.0.0.1 whose accept queue is full, so the
/// kernel drops further SYNs and a connect to it hangs. Returns the
/// listener's fd (closed on drop of the guard), its port and the
/// parked clients filling the queue. (Tests of this channel and of the
/// ZMQ one.)
#[cfg(test)]
pub(crate) fn syn_dropping_listener() -> (std::os::fd::OwnedFd, u16, Vec<TcpStream>) {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a fresh fd we own.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    assert!(fd >= 0);
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let (sa, len) = sockaddr("127.0.0.1:0".parse().unwrap());
    assert_eq!(
        unsafe { libc::bind(fd, (&sa as *const libc::sockaddr_storage).cast(), len) },
        0
    );
    assert_eq!(unsafe { libc::listen(fd, 0) }, 0);
    let mut got: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut got_len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    assert_eq!(
        unsafe {
            libc::getsockname(
                fd,
                (&mut got as *mut libc::sockaddr_in).cast(),
                &mut got_len,
            )
        },
        0
    );
    let port = u16::from_be(got.sin_port);
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    // A backlog of 0 holds one connection; fill it (and then some).
    let parked = (0..3)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok())
        .collect();
    (owned, port, parked)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (TcpControlChannel, TcpControlChannel) {
        let a = TcpControlChannel::bind("a", BindAddr::Loopback).unwrap();
        let b = TcpControlChannel::bind("b", BindAddr::Loopback).unwrap();
        (a, b)
    }

    /// A channel named `name` listening on 127.0.0.1:`port`.
    fn listening_as(name: &str, port: u16) -> TcpControlChannel {
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        TcpControlChannel::on_listener(name, listener).unwrap()
    }

    /// Runs `from`'s IO (connects, flushes) and `to`'s receive in turn
    /// until `to` has a message, for at most 5 s.
    fn relay(from: &mut TcpControlChannel, to: &mut TcpControlChannel) -> Option<Inbound> {
        let end = Instant::now() + Duration::from_secs(5);
        while Instant::now() < end {
            let _ = from.recv(Duration::from_millis(5)).unwrap();
            if let Some(m) = to.recv(Duration::from_millis(5)).unwrap() {
                return Some(m);
            }
        }
        None
    }

    fn recv_within(c: &mut TcpControlChannel, limit: Duration) -> Option<Inbound> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Some(m) = c.recv(Duration::from_millis(10)).unwrap() {
                return Some(m);
            }
        }
        None
    }

    const KEY: &[u8] = b"kvfabric-test-control-key-0123456789abcdef";

    fn keyed(name: &str, mode: AuthMode, key: &[u8]) -> TcpControlChannel {
        TcpControlChannel::bind_with_auth(
            name,
            BindAddr::Loopback,
            ControlAuth::new(mode, &[key]).unwrap(),
        )
        .unwrap()
    }

    /// Sends one frame (`hello` payload, then "msg") on a raw connection
    /// to `to` and reports whether `to` delivered "msg" within 2 s.
    fn raw_hello_then_message(to: &mut TcpControlChannel, hello: &[u8]) -> Option<Inbound> {
        let mut s = TcpStream::connect(to.endpoint().trim_start_matches("tcp://")).unwrap();
        s.write_all(&frame(hello)).unwrap();
        s.write_all(&frame(b"msg")).unwrap();
        recv_within(to, Duration::from_secs(2))
    }

    #[test]
    fn with_a_control_key_only_hellos_signed_with_it_get_through() {
        // Same key, both required: messages flow both ways, named.
        let mut a = keyed("a", AuthMode::Required, KEY);
        let mut b = keyed("b", AuthMode::Required, KEY);
        a.add_peer("b", b.endpoint().as_bytes()).unwrap();
        b.add_peer("a", a.endpoint().as_bytes()).unwrap();
        a.send_to("b", b"hi").unwrap();
        assert_eq!(relay(&mut a, &mut b), Some(("a".into(), b"hi".to_vec())));
        b.send_to("a", b"back").unwrap();
        assert_eq!(relay(&mut b, &mut a), Some(("b".into(), b"back".to_vec())));
        assert_eq!((a.refused_hellos(), b.refused_hellos()), (0, 0));

        // A plain hello claiming "a": refused, counted, nothing delivered.
        let mut plain = HELLO_MAGIC.to_vec();
        plain.extend_from_slice(b"a");
        assert_eq!(raw_hello_then_message(&mut b, &plain), None);
        assert_eq!(b.refused_hellos(), 1);

        // Another key's agent cannot reach b (its hello is refused).
        let mut rogue = keyed(
            "a",
            AuthMode::Required,
            b"another-key-0123456789abcdef0123456789",
        );
        rogue.add_peer("b", b.endpoint().as_bytes()).unwrap();
        rogue.send_to("b", b"forged").unwrap();
        assert_eq!(relay(&mut rogue, &mut b), None);
        assert!(b.refused_hellos() >= 2, "{}", b.refused_hellos());

        // A signed hello captured on its way to b and replayed: refused.
        let auth = ControlAuth::new(AuthMode::Required, &[KEY]).unwrap();
        let b_ep = b.endpoint().to_string();
        let hello = auth.hello("c", "b", &b_ep, unix_ms(), [42; 16]).unwrap();
        assert_eq!(
            raw_hello_then_message(&mut b, &hello),
            Some(("c".into(), b"msg".to_vec()))
        );
        let before = b.refused_hellos();
        assert_eq!(raw_hello_then_message(&mut b, &hello), None, "replay");
        assert_eq!(b.refused_hellos(), before + 1);
        // Signed for another agent: refused at b.
        let for_d = auth.hello("c", "d", &b_ep, unix_ms(), [43; 16]).unwrap();
        assert_eq!(raw_hello_then_message(&mut b, &for_d), None);
        // Signed for b at another endpoint (a stale or poisoned discovery
        // entry relayed to b): refused.
        let elsewhere = auth
            .hello("c", "b", "tcp://127.0.0.1:9", unix_ms(), [44; 16])
            .unwrap();
        assert_eq!(raw_hello_then_message(&mut b, &elsewhere), None);
    }

    #[test]
    fn auth_modes_let_a_fabric_turn_the_key_on_without_a_gap() {
        // Rollout: off → optional (signs; takes plain) → required. Each
        // step's agents reach the previous step's, both ways.
        let steps = [
            (AuthMode::Off, AuthMode::Optional),
            (AuthMode::Optional, AuthMode::Required),
        ];
        for (old, new) in steps {
            let mk = |name: &str, mode: AuthMode| match mode {
                AuthMode::Off => TcpControlChannel::bind(name, BindAddr::Loopback).unwrap(),
                m => keyed(name, m, KEY),
            };
            let mut a = mk("a", old);
            let mut b = mk("b", new);
            a.add_peer("b", b.endpoint().as_bytes()).unwrap();
            b.add_peer("a", a.endpoint().as_bytes()).unwrap();
            a.send_to("b", b"up").unwrap();
            assert_eq!(
                relay(&mut a, &mut b),
                Some(("a".into(), b"up".to_vec())),
                "{old:?} → {new:?}"
            );
            b.send_to("a", b"down").unwrap();
            assert_eq!(
                relay(&mut b, &mut a),
                Some(("b".into(), b"down".to_vec())),
                "{new:?} → {old:?}"
            );
            // An optional agent counts the unsigned hellos it took (the
            // off agent's): required would refuse them.
            let unsigned = |c: &TcpControlChannel| c.unsigned_hellos();
            match (old, new) {
                (AuthMode::Off, _) => assert_eq!(unsigned(&b), 1),
                _ => assert_eq!((unsigned(&a), unsigned(&b)), (0, 0)),
            }
        }
        // Skipping a step leaves a gap: an off agent cannot reach a
        // required one.
        let mut a = TcpControlChannel::bind("a", BindAddr::Loopback).unwrap();
        let mut b = keyed("b", AuthMode::Required, KEY);
        a.add_peer("b", b.endpoint().as_bytes()).unwrap();
        a.send_to("b", b"x").unwrap();
        assert_eq!(relay(&mut a, &mut b), None);
        assert_eq!(b.refused_hellos(), 1);
    }

    #[test]
    fn messages_arrive_in_order_with_the_senders_name_both_ways() {
        let (mut a, mut b) = pair();
        a.add_peer("b", b.endpoint().as_bytes()).unwrap();
        b.add_peer("a", a.endpoint().as_bytes()).unwrap();
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        a.send_to("b", b"one").unwrap();
        a.send_to("b", &big).unwrap();
        a.send_to("b", b"").unwrap();
        for want in [b"one".to_vec(), big.clone(), Vec::new()] {
            // Both sides pump: `a` flushes what did not fit at once.
            let end = Instant::now() + Duration::from_secs(10);
            let got = loop {
                assert!(Instant::now() < end, "message lost");
                let _ = a.recv(Duration::ZERO).unwrap();
                if let Some(m) = recv_within(&mut b, Duration::from_millis(50)) {
                    break m;
                }
            };
            assert_eq!(got, ("a".to_string(), want));
        }
        b.send_to("a", b"back").unwrap();
        assert_eq!(
            recv_within(&mut a, Duration::from_secs(5)),
            Some(("b".to_string(), b"back".to_vec()))
        );
    }

    /// Issue 18: the connection (and its hello) is made when the route is
    /// added, before any message — the first message does not pay it.
    #[test]
    fn adding_a_route_connects_before_the_first_message() {
        let (mut a, mut b) = pair();
        a.add_peer("b", b.endpoint().as_bytes()).unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while !b.conns.iter().any(|c| c.peer.as_deref() == Some("a")) {
            assert!(Instant::now() < end, "no connection from a within 5 s");
            // `a` writes its hello once the connect completes; `b` accepts
            // and reads it. No message is sent.
            assert_eq!(a.recv(Duration::from_millis(5)).unwrap(), None);
            assert_eq!(b.recv(Duration::from_millis(5)).unwrap(), None);
        }
        assert!(a.routes["b"].hello.is_empty(), "hello written");
        assert!(a.routes["b"].frames.is_empty());
        // The first message goes out on that connection.
        a.send_to("b", b"first").unwrap();
        assert_eq!(
            recv_within(&mut b, Duration::from_secs(5)),
            Some(("a".to_string(), b"first".to_vec()))
        );
        assert_eq!(b.conns.len(), 1, "no second connection");
    }

    /// A connect that does not complete (the peer's address drops SYNs)
    /// is abandoned after CONNECT_TIMEOUT and retried, instead of holding
    /// the route for the kernel's ≈2 min of SYN retries; the queued
    /// message reaches the peer once it listens there.
    #[test]
    fn a_connect_that_hangs_is_abandoned_at_its_deadline_and_retried() {
        let (listener_fd, port, parked) = syn_dropping_listener();
        let mut a = TcpControlChannel::bind("a", BindAddr::Loopback).unwrap();
        a.add_peer("b", format!("tcp://127.0.0.1:{port}").as_bytes())
            .unwrap();
        a.send_to("b", b"queued while unreachable").unwrap();
        let start = Instant::now();
        while a.connect_timeouts() == 0 && start.elapsed() < CONNECT_TIMEOUT * 3 {
            let _ = a.recv(Duration::from_millis(50)).unwrap();
        }
        let waited = start.elapsed();
        assert_eq!(
            a.connect_timeouts(),
            1,
            "the hung connect was not abandoned"
        );
        assert!(
            waited < CONNECT_TIMEOUT + Duration::from_secs(1),
            "abandoned after {waited:?}, deadline {CONNECT_TIMEOUT:?}"
        );
        // The peer comes up properly on that port: the retry delivers.
        drop(parked);
        drop(listener_fd);
        let mut b = listening_as("b", port);
        let m = relay(&mut a, &mut b).expect("the queued message after the retry");
        assert_eq!(m, ("a".to_string(), b"queued while unreachable".to_vec()));
    }

    /// A peer that connects and sends nothing is closed after
    /// HELLO_TIMEOUT, so idle connections cannot pile up to the cap.
    #[test]
    fn a_connection_that_sends_no_hello_is_closed_at_its_deadline() {
        let mut b = TcpControlChannel::bind("b", BindAddr::Loopback).unwrap();
        let deadline = Duration::from_secs(2); // HELLO_TIMEOUT, shortened
        b.hello_timeout = deadline;
        let addr = b.listener.local_addr().unwrap();
        let mut raw = TcpStream::connect(addr).unwrap();
        let start = Instant::now();
        while b.hello_timeouts() == 0 && start.elapsed() < deadline * 3 {
            let _ = b.recv(Duration::from_millis(50)).unwrap();
        }
        let waited = start.elapsed();
        assert_eq!(b.hello_timeouts(), 1, "the silent connection was kept");
        assert!(
            waited < deadline + Duration::from_secs(1),
            "closed after {waited:?}, deadline {deadline:?}"
        );
        assert!(b.conns.is_empty());
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut one = [0u8; 1];
        assert!(
            matches!(raw.read(&mut one), Ok(0) | Err(_)),
            "the peer's side was not closed"
        );
    }

    /// At the connection cap, connections that never said who they are
    /// make room for a real peer instead of pausing accepts.
    #[test]
    fn at_the_connection_cap_silent_connections_make_room_for_a_peer() {
        let (mut a, mut b) = pair();
        b.max_connections = 2;
        let addr = b.listener.local_addr().unwrap();
        let silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let end = Instant::now() + Duration::from_secs(5);
        while b.conns.len() < 2 {
            assert!(Instant::now() < end, "silent connections not accepted");
            let _ = b.recv(Duration::from_millis(10)).unwrap();
        }
        // The peer gets in well before the silent ones' hello deadline
        // would have freed their places.
        let start = Instant::now();
        a.add_peer("b", b.endpoint().as_bytes()).unwrap();
        a.send_to("b", b"through the cap").unwrap();
        let m = loop {
            assert!(
                start.elapsed() < HELLO_TIMEOUT / 2,
                "the peer waited for the silent connections' hello timeout"
            );
            let _ = a.recv(Duration::from_millis(5)).unwrap();
            if let Some(m) = b.recv(Duration::from_millis(5)).unwrap() {
                break m;
            }
        };
        assert_eq!(m, ("a".to_string(), b"through the cap".to_vec()));
        assert!(b.hello_timeouts() >= 1, "no silent connection evicted");
        assert!(b.conns.len() <= 2);
        drop(silent);
    }

    /// At the connection cap, connections whose hello named a peer without
    /// a route (names anyone can make up), or that repeat a name already
    /// connected (a routed name claimed again), make room for a peer this
    /// channel routes to; the first connection of a routed peer is never
    /// the one closed.
    #[test]
    fn at_the_connection_cap_made_up_names_make_room_for_a_routed_peer() {
        for strangers_named in [["x1", "x2"], ["c", "c"]] {
            let (mut a, mut b) = pair();
            let mut c = TcpControlChannel::bind("c", BindAddr::Loopback).unwrap();
            b.max_connections = 3;
            // b routes to a and c (discovery loaded them); c is connected.
            b.add_peer("a", a.endpoint().as_bytes()).unwrap();
            b.add_peer("c", c.endpoint().as_bytes()).unwrap();
            c.add_peer("b", b.endpoint().as_bytes()).unwrap();
            c.send_to("b", b"from c").unwrap();
            assert_eq!(
                relay(&mut c, &mut b),
                Some(("c".to_string(), b"from c".to_vec()))
            );
            let addr = b.listener.local_addr().unwrap();
            let strangers: Vec<TcpStream> = strangers_named
                .iter()
                .map(|n| {
                    let mut s = TcpStream::connect(addr).unwrap();
                    s.write_all(&TcpControlChannel::hello_frame(n)).unwrap();
                    s.write_all(&frame(b"noise")).unwrap();
                    s
                })
                .collect();
            let end = Instant::now() + Duration::from_secs(5);
            let mut noise = 0;
            while noise < 2 {
                assert!(Instant::now() < end, "the strangers' frames did not arrive");
                if b.recv(Duration::from_millis(10)).unwrap().is_some() {
                    noise += 1;
                }
            }
            assert_eq!(b.conns.len(), 3, "c and the two strangers");
            let c_conn = b.conns[0].stream.peer_addr().unwrap();
            let start = Instant::now();
            a.add_peer("b", b.endpoint().as_bytes()).unwrap();
            a.send_to("b", b"through the cap").unwrap();
            let m = loop {
                assert!(
                    start.elapsed() < Duration::from_secs(3),
                    "{strangers_named:?}: the routed peer was kept out"
                );
                let _ = a.recv(Duration::from_millis(5)).unwrap();
                if let Some(m) = b.recv(Duration::from_millis(5)).unwrap() {
                    break m;
                }
            };
            assert_eq!(m, ("a".to_string(), b"through the cap".to_vec()));
            assert_eq!(b.cap_evictions(), 1, "{strangers_named:?}");
            assert!(
                b.conns
                    .iter()
                    .any(|k| k.stream.peer_addr().ok() == Some(c_conn)),
                "{strangers_named:?}: c's connection was closed"
            );
            assert!(b.conns.iter().any(|k| k.peer.as_deref() == Some("a")));
            drop(strangers);
        }
    }

    /// Connections that each hold part of a large frame cannot buffer more
    /// than the cap together: past it the one holding the most is closed
    /// (counted), the others keep their bytes and a peer's complete
    /// frames still arrive.
    #[test]
    fn unfinished_frames_over_the_cap_close_the_largest_holder() {
        let (mut a, mut b) = pair();
        b.max_partial_bytes = 96 << 10;
        let addr = b.listener.local_addr().unwrap();
        // Three connections announce 1 MiB frames and send 30, 10 and
        // 70 KiB of them: 110 KiB together. The total passes the cap only
        // once the third holds more than 56 KiB: it is then the largest.
        let mut holders: Vec<TcpStream> = [30usize, 10, 70]
            .iter()
            .enumerate()
            .map(|(i, &kib)| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(&TcpControlChannel::hello_frame(&format!("h{i}")))
                    .unwrap();
                s.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
                s.write_all(&vec![7u8; kib << 10]).unwrap();
                s
            })
            .collect();
        let end = Instant::now() + Duration::from_secs(5);
        while b.partial_evictions() == 0 {
            assert!(Instant::now() < end, "no connection closed over the cap");
            let _ = b.recv(Duration::from_millis(10)).unwrap();
        }
        // Let every byte sent be read: the total stays under the cap.
        for _ in 0..20 {
            let _ = b.recv(Duration::from_millis(10)).unwrap();
        }
        assert_eq!(b.partial_evictions(), 1);
        let held: Vec<usize> = b.conns.iter().map(|c| c.buf.len()).collect();
        // Each holds its length prefix too.
        assert_eq!(held.iter().sum::<usize>(), (40 << 10) + 8, "{held:?}");
        assert!(
            !b.conns.iter().any(|c| c.peer.as_deref() == Some("h2")),
            "the largest holder stayed"
        );
        // h2's side sees the close; a real peer still gets through.
        holders[2]
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut one = [0u8; 1];
        assert!(matches!(holders[2].read(&mut one), Ok(0) | Err(_)));
        a.add_peer("b", b.endpoint().as_bytes()).unwrap();
        a.send_to("b", b"still through").unwrap();
        assert_eq!(
            relay(&mut a, &mut b),
            Some(("a".to_string(), b"still through".to_vec()))
        );
        drop(holders);
    }

    /// A connect that completed while nothing pumped the channel is not
    /// cut when it is first pumped past CONNECT_TIMEOUT (the deadline
    /// counts only while the hello cannot be written).
    #[test]
    fn a_connection_first_pumped_after_the_connect_deadline_is_kept() {
        let (mut a, mut b) = pair();
        a.add_peer("b", b.endpoint().as_bytes()).unwrap();
        std::thread::sleep(CONNECT_TIMEOUT + Duration::from_millis(500));
        a.send_to("b", b"late but connected").unwrap();
        let m = relay(&mut a, &mut b).expect("the message on the first connection");
        assert_eq!(m, ("a".to_string(), b"late but connected".to_vec()));
        assert_eq!(a.connect_timeouts(), 0, "a completed connect was cut");
    }

    /// Outbound control connections fail after UNACKED_TIMEOUT of
    /// unacknowledged data (the kernel's option is set on the socket).
    #[test]
    fn outbound_connections_carry_the_unacked_timeout() {
        let b = TcpControlChannel::bind("b", BindAddr::Loopback).unwrap();
        let s = connect_nonblocking(b.listener.local_addr().unwrap()).unwrap();
        let mut v: libc::c_uint = 0;
        let mut len = std::mem::size_of::<libc::c_uint>() as libc::socklen_t;
        // SAFETY: getsockopt(2) into a c_uint of `len` bytes.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_USER_TIMEOUT,
                (&mut v as *mut libc::c_uint).cast(),
                &mut len,
            )
        };
        assert_eq!(r, 0);
        assert_eq!(u128::from(v), UNACKED_TIMEOUT.as_millis());
    }

    #[test]
    fn endpoints_must_be_ip_literals_with_a_port() {
        let (mut a, _b) = pair();
        for bad in [
            &b"tcp://localhost:5555"[..],
            b"tcp://10.0.0.1",
            b"tcp://0.0.0.0:5555",
            b"udp://10.0.0.1:5",
            b"",
        ] {
            let e = a.add_peer("x", bad).unwrap_err();
            assert!(
                matches!(e, ControlError::InvalidEndpoint { .. }),
                "{:?}: {e}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(!a.has_peer("x"));
        a.add_peer("v6", b"tcp://[::1]:5555").unwrap();
        assert!(a.has_peer("v6"));
    }

    #[test]
    fn a_peer_that_comes_up_late_gets_the_queued_messages_and_a_restart_reconnects() {
        let mut a = TcpControlChannel::bind("a", BindAddr::Loopback).unwrap();
        // Reserve a port, close it: nothing listens there yet.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        a.add_peer("b", format!("tcp://127.0.0.1:{port}").as_bytes())
            .unwrap();
        a.send_to("b", b"early").unwrap();
        let _ = a.recv(Duration::from_millis(20)).unwrap(); // refused, backoff
        let mut b = listening_as("b", port);
        assert_eq!(
            relay(&mut a, &mut b),
            Some(("a".to_string(), b"early".to_vec()))
        );
        // The receiver restarts on the same port: the next send reconnects.
        drop(b);
        let mut b2 = listening_as("b", port);
        // One message: the idle connection to the old receiver is found
        // closed before the write, so it goes out on a new connection.
        std::thread::sleep(Duration::from_millis(50)); // let the FIN arrive
        a.send_to("b", b"again").unwrap();
        assert_eq!(
            relay(&mut a, &mut b2),
            Some(("a".to_string(), b"again".to_vec()))
        );
        assert_eq!(a.dropped_messages(), 0);
    }

    #[test]
    fn a_connection_without_hello_or_with_a_huge_frame_is_closed() {
        let (mut a, _b) = pair();
        let addr = parse_addr("a", a.endpoint()).unwrap();
        let mut raw = TcpStream::connect(addr).unwrap();
        raw.write_all(&frame(b"no hello")).unwrap();
        let mut raw2 = TcpStream::connect(addr).unwrap();
        raw2.write_all(&u32::MAX.to_le_bytes()).unwrap();
        // A first frame longer than any hello: closed from its length
        // prefix, its body never buffered.
        let mut raw3 = TcpStream::connect(addr).unwrap();
        raw3.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
        let end = Instant::now() + Duration::from_secs(2);
        while Instant::now() < end {
            assert_eq!(a.recv(Duration::from_millis(10)).unwrap(), None);
        }
        assert!(a.conns.is_empty(), "both connections closed");
    }

    #[test]
    fn the_waker_ends_a_blocking_receive() {
        let (mut a, _b) = pair();
        let w = Arc::new(Waker::new().unwrap());
        a.set_waker(w.clone());
        w.wake();
        let t = Instant::now();
        assert_eq!(a.recv(Duration::from_secs(5)).unwrap(), None);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        // Without a wake-up or a message, the wait lasts its timeout.
        let t = Instant::now();
        assert_eq!(a.recv(Duration::from_millis(60)).unwrap(), None);
        assert!(
            t.elapsed() >= Duration::from_millis(55),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_full_queue_drops_instead_of_blocking() {
        let (mut a, _b) = pair();
        // Nothing listens at this route: everything stays queued.
        a.add_peer("gone", b"tcp://127.0.0.1:9").unwrap();
        let msg = vec![0u8; 16 << 20];
        let mut dropped = 0;
        for _ in 0..10 {
            if matches!(a.send_to("gone", &msg), Err(ControlError::Dropped(_))) {
                dropped += 1;
            }
        }
        assert!(dropped >= 3, "queue bound {SEND_QUEUE_BYTES} enforced");
        assert_eq!(a.dropped_messages(), dropped);
        assert!(matches!(
            a.send_to("nobody", b"x"),
            Err(ControlError::UnknownPeer(_))
        ));
    }
}
