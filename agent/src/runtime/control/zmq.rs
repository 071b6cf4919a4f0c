//! [`ZmqControlChannel`]: the default control channel (seed §4
//! `ControlChannel` row, seed §5 "Endpoints are routable IPs").
//!
//! One ROUTER socket receives from every peer; one DEALER per peer sends,
//! with its routing id set to our own name, so the ROUTER on the far side
//! learns who sent each message without any framing of ours. Sends never
//! block the IO thread: a full queue ([`SEND_HWM`] messages) drops the
//! message with a warning and [`ControlError::Dropped`] (seed §9 "Control
//! message can't be sent"); the affected request then fails through the
//! request timeout.
//!
//! Addressing (seed §5):
//! - production binds the local *routable* IP ([`BindAddr::Routable`]):
//!   `$KVFABRIC_INTERFACE` names the NIC, else the egress-route address,
//!   else an address of the hostname; never 127.0.0.1, which is unreachable
//!   from other nodes. Tests bind [`BindAddr::Loopback`].
//! - an IPv6 address is bracketed (`tcp://[ip]:*`) and the ROUTER sets
//!   `ZMQ_IPV6`; every DEALER sets `ZMQ_IPV6` unconditionally (harmless for
//!   IPv4).
//! - the ROUTER sets `ZMQ_ROUTER_HANDOVER`, so a peer that was removed (its
//!   DEALER dropped) and reconnects with the same routing id is accepted at
//!   once instead of having its messages dropped while the stale connection
//!   is reaped.
//! - [`ControlChannel::add_peer`] validates the endpoint ([`validate_endpoint`])
//!   before connecting; a malformed endpoint is reported, never panics.
//!
//! Liveness (as the TCP channel's, [`super::tcp`]): every DEALER abandons a
//! connect that has not completed within [`CONNECT_TIMEOUT`]
//! (`ZMQ_CONNECT_TIMEOUT`; libzmq then retries after its reconnect
//! interval) instead of waiting out the kernel's SYN retries, and a
//! connection that goes dead — a partition, a peer whose host vanished
//! without a reset, a middlebox that dropped the flow — is closed and
//! reconnected after [`UNACKED_TIMEOUT`], so after a partition heals the
//! route is live again within ≈ [`CONNECT_TIMEOUT`] instead of sitting on
//! a dead connection until the kernel's retransmissions give up
//! (≈ 15 min). Two mechanisms, because each misses a case:
//! - `ZMQ_TCP_MAXRT` (the kernel's `TCP_USER_TIMEOUT`, as the TCP
//!   channel sets it): data written and not acknowledged for that long,
//!   or a receive window kept closed that long, fails the connection. It
//!   covers a connection with data waiting, where libzmq cannot send a
//!   heartbeat (a PING is only encoded into an empty output buffer).
//! - ZMTP heartbeats: a PING every [`HEARTBEAT_IVL`], and a connection
//!   with nothing back for [`UNACKED_TIMEOUT`] after one is closed
//!   (`ZMQ_HEARTBEAT_TIMEOUT`); the PING asks the far ROUTER to drop the
//!   connection after the same silence (`ZMQ_HEARTBEAT_TTL`). It covers
//!   an idle connection, where the kernel has nothing to retransmit.
//!
//! Unlike the TCP channel's, the heartbeat is answered by the peer
//! process, not its kernel: a peer stopped (SIGSTOP) for longer than
//! [`UNACKED_TIMEOUT`] loses its connections, and what reached it during
//! the stop may be dropped when its timers fire first on resume (those
//! requests have timed out by then; the routes reconnect). Messages
//! written into a connection that then dies are lost, as on any broken
//! connection (their requests fail through the request timeout); those
//! still queued go out on the next connection.

use std::collections::HashMap;
use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, ToSocketAddrs, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::tcp::{CONNECT_TIMEOUT, UNACKED_TIMEOUT};
use super::{ControlChannel, ControlError, Inbound};
use crate::runtime::waker::Waker;

/// Send high-water mark per peer DEALER, in messages (seed §4 `kSendHwm`).
/// Beyond it [`ControlChannel::send_to`] drops the message.
pub const SEND_HWM: i32 = 1024;

/// Receive high-water mark of the ROUTER, in messages per connected peer.
/// A peer that fills it is back-pressured (its own DEALER then drops).
pub const RECV_HWM: i32 = 4096;

/// Largest inbound message the ROUTER accepts, in bytes (64 MiB). A peer
/// that sends more is disconnected by libzmq. DATA messages are at most a
/// few hundred KiB, so this only guards against garbage.
pub const MAX_MSG_BYTES: i64 = 64 << 20;

/// How often a DEALER sends a ZMTP heartbeat PING on an idle connection
/// (`ZMQ_HEARTBEAT_IVL`); a connection without any reply for
/// [`UNACKED_TIMEOUT`] is closed and reconnected (module docs).
pub const HEARTBEAT_IVL: Duration = Duration::from_secs(1);

/// Longest endpoint accepted by [`validate_endpoint`], in bytes
/// (`tcp://` + a 253-byte hostname + `:65535`, rounded up).
pub const MAX_ENDPOINT_LEN: usize = 272;

/// Longest own name (= ZMQ routing id), in bytes (a libzmq limit).
pub const MAX_NAME_LEN: usize = 255;

/// Environment variable naming the NIC whose address
/// [`BindAddr::Routable`] binds (seed §5: `TRTLLM_NIXL_INTERFACE`).
pub const INTERFACE_ENV: &str = "KVFABRIC_INTERFACE";

/// Where [`ZmqControlChannel::bind`] listens. The port is always chosen by
/// the kernel (`:*`); [`ControlChannel::local_endpoint`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BindAddr {
    /// `tcp://127.0.0.1:*` — single-node tests only (unreachable from other
    /// nodes).
    Loopback,
    /// The local routable IP, as [`local_routable_ip`] resolves it with
    /// `$KVFABRIC_INTERFACE` (seed §5; the production default).
    Routable,
    /// The first usable address of this network interface (e.g. `eth0`).
    Interface(String),
    /// This exact IP (must not be unspecified or multicast).
    Ip(IpAddr),
}

impl BindAddr {
    /// Resolves the IP to bind.
    ///
    /// # Errors
    /// [`ControlError::Transport`] when no routable address can be found, the
    /// interface does not exist or has no usable address, or the IP is
    /// unspecified / multicast.
    pub fn resolve(&self) -> Result<IpAddr, ControlError> {
        let ip = match self {
            BindAddr::Loopback => IpAddr::V4(Ipv4Addr::LOCALHOST),
            BindAddr::Routable => {
                let nic = std::env::var(INTERFACE_ENV)
                    .ok()
                    .filter(|s| !s.trim().is_empty());
                local_routable_ip(nic.as_deref().map(str::trim))?
            }
            BindAddr::Interface(nic) => interface_ip(nic)?,
            BindAddr::Ip(ip) => *ip,
        };
        if ip.is_unspecified() || ip.is_multicast() {
            return Err(ControlError::Transport(format!(
                "cannot bind the control channel to {ip}: not a unicast address peers can reach"
            )));
        }
        Ok(ip)
    }
}

/// Formats the ZMQ TCP endpoint for `ip` and `port` (`"*"` for any),
/// bracketing IPv6 addresses: `tcp://10.0.0.1:5555`, `tcp://[fd00::1]:*`.
pub fn tcp_endpoint(ip: IpAddr, port: &str) -> String {
    match ip {
        IpAddr::V4(v4) => format!("tcp://{v4}:{port}"),
        IpAddr::V6(v6) => format!("tcp://[{v6}]:{port}"),
    }
}

/// Resolves the local routable IP (seed §5 `getLocalIp`): the address of
/// NIC `interface` when given; else the source address of the egress route
/// (a UDP socket "connected" to a public address — no packet is sent),
/// IPv4 first, then IPv6; else a non-loopback address of the hostname.
///
/// # Errors
/// [`ControlError::Transport`] when the interface is missing or has no
/// usable address, or when no method yields a non-loopback address.
pub fn local_routable_ip(interface: Option<&str>) -> Result<IpAddr, ControlError> {
    if let Some(nic) = interface {
        return interface_ip(nic);
    }
    let probes: [(&str, &str); 2] = [
        ("0.0.0.0:0", "8.8.8.8:53"),
        ("[::]:0", "[2001:4860:4860::8888]:53"),
    ];
    for (local, remote) in probes {
        if let Some(ip) = egress_ip(local, remote) {
            return Ok(ip);
        }
    }
    if let Some(ip) = hostname_ip() {
        return Ok(ip);
    }
    Err(ControlError::Transport(format!(
        "no routable local IP: no egress route and the hostname resolves only to loopback; \
         set {INTERFACE_ENV} to a NIC name"
    )))
}

fn usable(ip: &IpAddr) -> bool {
    !ip.is_loopback() && !ip.is_unspecified() && !ip.is_multicast() && !is_link_local_v6(ip)
}

/// IPv6 link-local (fe80::/10) needs a scope id to be reachable; skip it.
fn is_link_local_v6(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80)
}

fn egress_ip(local: &str, remote: &str) -> Option<IpAddr> {
    let sock = UdpSocket::bind(local).ok()?;
    sock.connect(remote).ok()?;
    let ip = sock.local_addr().ok()?.ip();
    usable(&ip).then_some(ip)
}

fn hostname_ip() -> Option<IpAddr> {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its full length; gethostname
    // NUL-terminates on success when the name fits (we pass len - 1).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if rc != 0 {
        return None;
    }
    let name = CStr::from_bytes_until_nul(&buf).ok()?.to_str().ok()?;
    if name.is_empty() {
        return None;
    }
    let addrs: Vec<IpAddr> = (name, 0u16)
        .to_socket_addrs()
        .ok()?
        .map(|a| a.ip())
        .filter(usable)
        .collect();
    addrs
        .iter()
        .find(|ip| ip.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
}

/// The address of interface `nic`: its first IPv4 address, else its first
/// non-link-local IPv6 address (loopback allowed when `nic` is loopback).
fn interface_ip(nic: &str) -> Result<IpAddr, ControlError> {
    let mut found_nic = false;
    let mut v4: Option<IpAddr> = None;
    let mut v6: Option<IpAddr> = None;
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(ControlError::Transport(format!(
            "getifaddrs failed: {}",
            std::io::Error::last_os_error()
        )));
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive
        // until freeifaddrs; its name is a NUL-terminated C string and its
        // addr, when non-null, points to a sockaddr of the family it names.
        unsafe {
            let ifa = &*cur;
            cur = ifa.ifa_next;
            if ifa.ifa_name.is_null() || CStr::from_ptr(ifa.ifa_name).to_bytes() != nic.as_bytes() {
                continue;
            }
            found_nic = true;
            if ifa.ifa_addr.is_null() {
                continue;
            }
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET if v4.is_none() => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    v4 = Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                        sin.sin_addr.s_addr,
                    ))));
                }
                libc::AF_INET6 if v6.is_none() => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    let ip = IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr));
                    if !is_link_local_v6(&ip) {
                        v6 = Some(ip);
                    }
                }
                _ => {}
            }
        }
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    match v4.or(v6) {
        Some(ip) => Ok(ip),
        None if found_nic => Err(ControlError::Transport(format!(
            "network interface {nic:?} ({INTERFACE_ENV}) has no usable IPv4/IPv6 address"
        ))),
        None => Err(ControlError::Transport(format!(
            "network interface {nic:?} ({INTERFACE_ENV}) does not exist"
        ))),
    }
}

fn invalid(peer: &str, endpoint: &[u8], reason: impl Into<String>) -> ControlError {
    ControlError::InvalidEndpoint {
        peer: peer.to_string(),
        endpoint: String::from_utf8_lossy(endpoint).into_owned(),
        reason: reason.into(),
    }
}

/// Whether `host` is a valid RFC 1123 hostname that cannot be mistaken for
/// a malformed IPv4 address (its last label is not all digits).
fn valid_hostname(host: &str) -> bool {
    if host.is_empty() || host.len() > 253 {
        return false;
    }
    let host = host.strip_suffix('.').unwrap_or(host);
    let labels: Vec<&str> = host.split('.').collect();
    let label_ok = |l: &&str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    labels.iter().all(label_ok)
        && !labels
            .last()
            .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()))
}

/// Validates a peer's advertised control endpoint before connecting (seed
/// §5 "addPeer validates the endpoint before connecting"; seed §9 malformed
/// endpoint in a WANT). Accepted: UTF-8 `tcp://HOST:PORT`, at most
/// [`MAX_ENDPOINT_LEN`] bytes, where HOST is a unicast IPv4 address, a
/// bracketed unicast IPv6 address (optionally with a `%zone`), or an RFC 1123
/// hostname, and PORT is decimal 1..=65535. Wildcards (`*`), ZMQ's
/// `source;dest` form, unspecified (`0.0.0.0`, `::`) and multicast addresses
/// are rejected. Returns the endpoint as a string.
///
/// # Errors
/// [`ControlError::InvalidEndpoint`] naming `peer` and what was wrong.
pub fn validate_endpoint(peer: &str, endpoint: &[u8]) -> Result<String, ControlError> {
    if endpoint.is_empty() {
        return Err(invalid(peer, endpoint, "empty endpoint"));
    }
    if endpoint.len() > MAX_ENDPOINT_LEN {
        return Err(invalid(
            peer,
            endpoint,
            format!(
                "endpoint is {} bytes, more than {MAX_ENDPOINT_LEN}",
                endpoint.len()
            ),
        ));
    }
    let s = std::str::from_utf8(endpoint)
        .map_err(|_| invalid(peer, endpoint, "endpoint is not UTF-8"))?;
    let rest = s
        .strip_prefix("tcp://")
        .ok_or_else(|| invalid(peer, endpoint, "expected tcp://HOST:PORT"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| invalid(peer, endpoint, "missing :PORT"))?;
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid(
            peer,
            endpoint,
            format!("port {port:?} is not a decimal number 1..=65535"),
        ));
    }
    match port.parse::<u32>() {
        Ok(p) if (1..=65535).contains(&p) => {}
        _ => {
            return Err(invalid(
                peer,
                endpoint,
                format!("port {port} is outside 1..=65535"),
            ))
        }
    }
    let ip: Option<IpAddr> = if let Some(inner) = host.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .ok_or_else(|| invalid(peer, endpoint, "unterminated [IPv6] host"))?;
        let (addr, zone) = match inner.split_once('%') {
            Some((a, z)) => (a, Some(z)),
            None => (inner, None),
        };
        if let Some(z) = zone {
            let zone_ok = !z.is_empty()
                && z.len() <= 16
                && z.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
            if !zone_ok {
                return Err(invalid(peer, endpoint, format!("bad IPv6 zone {z:?}")));
            }
        }
        let v6 = addr
            .parse::<Ipv6Addr>()
            .map_err(|_| invalid(peer, endpoint, format!("{addr:?} is not an IPv6 address")))?;
        Some(IpAddr::V6(v6))
    } else if host.contains(':') {
        return Err(invalid(
            peer,
            endpoint,
            "an IPv6 host must be bracketed: tcp://[ADDR]:PORT",
        ));
    } else if host == "*" || host.contains('*') {
        return Err(invalid(peer, endpoint, "wildcard host is not connectable"));
    } else if let Ok(v4) = host.parse::<Ipv4Addr>() {
        Some(IpAddr::V4(v4))
    } else if valid_hostname(host) {
        None
    } else {
        return Err(invalid(
            peer,
            endpoint,
            format!("{host:?} is neither an IP address nor a valid hostname"),
        ));
    };
    if let Some(ip) = ip {
        if ip.is_unspecified() || ip.is_multicast() || ip == IpAddr::V4(Ipv4Addr::BROADCAST) {
            return Err(invalid(
                peer,
                endpoint,
                format!("{ip} is not a unicast address"),
            ));
        }
    }
    Ok(s.to_string())
}

fn zerr(what: &str) -> impl FnOnce(::zmq::Error) -> ControlError + '_ {
    move |e| ControlError::Transport(format!("zmq {what}: {e}"))
}

/// One route: the DEALER connected to `endpoint`, plus its drop streak.
struct Route {
    endpoint: String,
    dealer: ::zmq::Socket,
    /// Consecutive drops since the last successful send (for log
    /// rate-limiting).
    drop_streak: u64,
}

/// The ZMQ control channel (seed §4): a ROUTER bound at construction for
/// receiving, one DEALER per peer for sending. Owned by one IO thread
/// (`Send`, not `Sync`).
pub struct ZmqControlChannel {
    own_name: String,
    // Field order matters for drop: sockets before the context (each socket
    // also holds a context reference, so this is belt and braces).
    router: ::zmq::Socket,
    routes: HashMap<String, Route>,
    endpoint: String,
    dropped: u64,
    /// Messages discarded for an invalid sender identity.
    bad_identities: u64,
    waker: Option<Arc<Waker>>,
    /// [`CONNECT_TIMEOUT`], [`HEARTBEAT_IVL`] and [`UNACKED_TIMEOUT`] for
    /// routes added from now on (tests shorten them).
    liveness: Liveness,
    ctx: ::zmq::Context,
}

/// The DEALERs' connect deadline, heartbeat and unacknowledged-data
/// timeout (module docs).
#[derive(Debug, Clone, Copy)]
struct Liveness {
    connect_timeout: Duration,
    heartbeat_ivl: Duration,
    /// `ZMQ_HEARTBEAT_TIMEOUT`, `ZMQ_HEARTBEAT_TTL` and `ZMQ_TCP_MAXRT`.
    unacked_timeout: Duration,
}

impl Default for Liveness {
    fn default() -> Self {
        Self {
            connect_timeout: CONNECT_TIMEOUT,
            heartbeat_ivl: HEARTBEAT_IVL,
            unacked_timeout: UNACKED_TIMEOUT,
        }
    }
}

/// A duration as libzmq's `int` milliseconds (saturating).
fn zmq_ms(d: Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX)
}

impl std::fmt::Debug for ZmqControlChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZmqControlChannel")
            .field("own_name", &self.own_name)
            .field("endpoint", &self.endpoint)
            .field("peers", &self.routes.keys().collect::<Vec<_>>())
            .field("dropped", &self.dropped)
            .finish()
    }
}

impl ZmqControlChannel {
    /// Binds a ROUTER at `bind` on a kernel-chosen port. `own_name` becomes
    /// the routing id of every DEALER this channel creates, i.e. the peer
    /// name the other side's [`ControlChannel::recv`] reports; it must be
    /// 1..=[`MAX_NAME_LEN`] bytes and not start with a NUL byte (libzmq
    /// reserves those ids).
    ///
    /// # Errors
    /// [`ControlError::Transport`] for a bad name, an unresolvable bind
    /// address ([`BindAddr::resolve`]), or a socket / bind failure.
    pub fn bind(own_name: &str, bind: BindAddr) -> Result<Self, ControlError> {
        if own_name.is_empty() || own_name.len() > MAX_NAME_LEN || own_name.starts_with('\0') {
            return Err(ControlError::Transport(format!(
                "control channel name {own_name:?} must be 1..={MAX_NAME_LEN} bytes and not start with NUL"
            )));
        }
        let ip = bind.resolve()?;
        let ctx = ::zmq::Context::new();
        let router = ctx.socket(::zmq::ROUTER).map_err(zerr("create ROUTER"))?;
        router.set_linger(0).map_err(zerr("set ROUTER linger"))?;
        router
            .set_router_handover(true)
            .map_err(zerr("set ZMQ_ROUTER_HANDOVER"))?;
        router
            .set_rcvhwm(RECV_HWM)
            .map_err(zerr("set ROUTER rcvhwm"))?;
        router
            .set_maxmsgsize(MAX_MSG_BYTES)
            .map_err(zerr("set ROUTER maxmsgsize"))?;
        if ip.is_ipv6() {
            router.set_ipv6(true).map_err(zerr("set ROUTER ZMQ_IPV6"))?;
        }
        let addr = tcp_endpoint(ip, "*");
        router
            .bind(&addr)
            .map_err(|e| ControlError::Transport(format!("zmq bind {addr}: {e}")))?;
        let endpoint = router
            .get_last_endpoint()
            .map_err(zerr("read ZMQ_LAST_ENDPOINT"))?
            .map_err(|_| ControlError::Transport("ZMQ_LAST_ENDPOINT is not UTF-8".into()))?;
        tracing::debug!(name = own_name, %endpoint, "control channel bound");
        Ok(Self {
            own_name: own_name.to_string(),
            router,
            routes: HashMap::new(),
            endpoint,
            dropped: 0,
            bad_identities: 0,
            waker: None,
            liveness: Liveness::default(),
            ctx,
        })
    }

    /// Our name (the routing id peers see).
    pub fn own_name(&self) -> &str {
        &self.own_name
    }

    /// The bound endpoint, `tcp://ip:port` (IPv6 bracketed), as a string.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Messages dropped on a full send queue since creation (all peers).
    pub fn dropped_messages(&self) -> u64 {
        self.dropped
    }

    fn connect(&self, endpoint: &str) -> Result<::zmq::Socket, ::zmq::Error> {
        let mut dealer = self.ctx.socket(::zmq::DEALER)?;
        dealer.set_identity(self.own_name.as_bytes())?;
        dealer.set_ipv6(true)?;
        dealer.set_sndhwm(SEND_HWM)?;
        dealer.set_linger(0)?;
        let l = self.liveness;
        dealer.set_connect_timeout(zmq_ms(l.connect_timeout))?;
        dealer.set_heartbeat_ivl(zmq_ms(l.heartbeat_ivl))?;
        dealer.set_heartbeat_timeout(zmq_ms(l.unacked_timeout))?;
        dealer.set_heartbeat_ttl(zmq_ms(l.unacked_timeout))?;
        // ZMQ_TCP_MAXRT has no setter in the zmq crate. Best effort, as
        // the TCP channel's TCP_USER_TIMEOUT: a kernel without it still
        // connects (the heartbeat still covers idle connections).
        let maxrt: std::os::raw::c_int = zmq_ms(l.unacked_timeout);
        // SAFETY: a live socket we own; an int option passed as a pointer
        // to an int of its size.
        let rc = unsafe {
            zmq_sys::zmq_setsockopt(
                dealer.as_mut_ptr(),
                zmq_sys::ZMQ_TCP_MAXRT as std::os::raw::c_int,
                (&maxrt as *const std::os::raw::c_int).cast(),
                std::mem::size_of::<std::os::raw::c_int>(),
            )
        };
        if rc != 0 {
            tracing::debug!(%endpoint, "ZMQ_TCP_MAXRT not set; dead connections with data waiting are found by the kernel's retransmission limit only");
        }
        dealer.connect(endpoint)?;
        Ok(dealer)
    }
}

impl ControlChannel for ZmqControlChannel {
    /// `tcp://ip:port` read from `ZMQ_LAST_ENDPOINT` at bind time.
    fn local_endpoint(&self) -> Vec<u8> {
        self.endpoint.as_bytes().to_vec()
    }

    /// Validates `endpoint` ([`validate_endpoint`]), then connects a DEALER
    /// (routing id = our name, `ZMQ_IPV6`, [`SEND_HWM`], linger 0, the
    /// connect deadline and heartbeat of the module docs). The
    /// same endpoint again is a no-op; a different one replaces the route.
    /// On error any existing route to `peer` is left as it was. The
    /// connection is made in the background: messages sent before it is up
    /// are queued (up to [`SEND_HWM`]).
    fn add_peer(&mut self, peer: &str, endpoint: &[u8]) -> Result<(), ControlError> {
        let endpoint = validate_endpoint(peer, endpoint)?;
        if self
            .routes
            .get(peer)
            .is_some_and(|r| r.endpoint == endpoint)
        {
            return Ok(());
        }
        let dealer = self.connect(&endpoint).map_err(|e| match e {
            ::zmq::Error::EINVAL | ::zmq::Error::EPROTONOSUPPORT => {
                invalid(peer, endpoint.as_bytes(), format!("zmq connect: {e}"))
            }
            e => ControlError::Transport(format!("zmq connect to {peer:?} at {endpoint}: {e}")),
        })?;
        tracing::debug!(peer, %endpoint, "control route added");
        self.routes.insert(
            peer.to_string(),
            Route {
                endpoint,
                dealer,
                drop_streak: 0,
            },
        );
        Ok(())
    }

    /// Drops the peer's DEALER (linger 0: queued messages are discarded).
    fn remove_peer(&mut self, peer: &str) {
        if self.routes.remove(peer).is_some() {
            tracing::debug!(peer, "control route removed");
        }
    }

    fn has_peer(&self, peer: &str) -> bool {
        self.routes.contains_key(peer)
    }

    /// Queues `msg` on the peer's DEALER with `ZMQ_DONTWAIT`. A full queue
    /// (`EAGAIN`, [`SEND_HWM`] reached) drops the message and logs a warning
    /// (the first of a streak, then every 1024th).
    fn send_to(&mut self, peer: &str, msg: &[u8]) -> Result<(), ControlError> {
        let route = self
            .routes
            .get_mut(peer)
            .ok_or_else(|| ControlError::UnknownPeer(peer.to_string()))?;
        match route.dealer.send(msg, ::zmq::DONTWAIT) {
            Ok(()) => {
                route.drop_streak = 0;
                Ok(())
            }
            Err(::zmq::Error::EAGAIN) => {
                route.drop_streak += 1;
                self.dropped += 1;
                if route.drop_streak % 1024 == 1 {
                    tracing::warn!(
                        peer,
                        endpoint = %route.endpoint,
                        bytes = msg.len(),
                        streak = route.drop_streak,
                        total_dropped = self.dropped,
                        "control send queue full (SEND_HWM={SEND_HWM}); message dropped"
                    );
                }
                Err(ControlError::Dropped(peer.to_string()))
            }
            Err(e) => Err(ControlError::Transport(format!(
                "zmq send to {peer:?} at {}: {e}",
                route.endpoint
            ))),
        }
    }

    fn set_waker(&mut self, waker: Arc<Waker>) {
        self.waker = Some(waker);
    }

    /// Polls the ROUTER for up to `timeout` (rounded up to whole
    /// milliseconds; 0 = poll once) and returns one message as (sender's
    /// validated routing id, payload). Frames that are not
    /// `[routing id, payload]`, or whose id is not a valid peer name, are
    /// discarded with a rate-limited warning.
    fn recv(&mut self, timeout: Duration) -> Result<Option<Inbound>, ControlError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = left.as_micros().div_ceil(1000).min(i64::MAX as u128) as i64;
            let polled = match &self.waker {
                Some(w) => {
                    let mut items = [
                        self.router.as_poll_item(::zmq::POLLIN),
                        ::zmq::PollItem::from_fd(w.fd(), ::zmq::POLLIN),
                    ];
                    let r = ::zmq::poll(&mut items, ms);
                    let (msg, woken) = (items[0].is_readable(), items[1].is_readable());
                    if woken {
                        w.drain();
                    }
                    match r {
                        Ok(_) if msg => Ok(1),
                        Ok(_) => Ok(0),
                        Err(e) => Err(e),
                    }
                }
                None => self.router.poll(::zmq::POLLIN, ms),
            };
            match polled {
                Ok(0) => return Ok(None),
                Ok(_) => {}
                Err(::zmq::Error::EINTR) => continue,
                Err(e) => return Err(ControlError::Transport(format!("zmq poll: {e}"))),
            }
            let frames = match self.router.recv_multipart(::zmq::DONTWAIT) {
                Ok(f) => f,
                Err(::zmq::Error::EAGAIN) | Err(::zmq::Error::EINTR) => {
                    if left.is_zero() {
                        return Ok(None);
                    }
                    continue;
                }
                Err(e) => return Err(ControlError::Transport(format!("zmq recv: {e}"))),
            };
            let mut frames = frames.into_iter();
            match (frames.next(), frames.next(), frames.next()) {
                (Some(id), Some(payload), None) => match super::valid_peer_identity(&id) {
                    Ok(name) => return Ok(Some((name.to_string(), payload))),
                    Err(why) => {
                        self.bad_identities += 1;
                        if self.bad_identities % 1024 == 1 {
                            tracing::warn!(
                                reason = %why,
                                total = self.bad_identities,
                                "control message from an invalid peer identity discarded"
                            );
                        }
                        if Instant::now() >= deadline {
                            return Ok(None);
                        }
                    }
                },
                (id, _, _) => {
                    tracing::warn!(
                        from = %kvfabric_core::text::log_safe_bytes(&id.unwrap_or_default()),
                        "malformed control frame set discarded"
                    );
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// Receives on `b` until a message arrives or `limit` passes.
    fn recv_within(b: &mut ZmqControlChannel, limit: Duration) -> Option<Inbound> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Some(m) = b.recv(Duration::from_millis(20)).unwrap() {
                return Some(m);
            }
        }
        None
    }

    /// A connect that does not complete (the peer's address drops SYNs)
    /// is abandoned at CONNECT_TIMEOUT and retried (libzmq's
    /// CONNECT_RETRIED event), and the queued message reaches a peer that
    /// then listens there — instead of the DEALER waiting out the kernel's
    /// ≈ 2 min of SYN retries.
    #[test]
    fn a_connect_that_hangs_is_abandoned_at_its_deadline_and_retried() {
        let (listener_fd, port, parked) = super::super::tcp::syn_dropping_listener();
        let mut a = ZmqControlChannel::bind("a", BindAddr::Loopback).unwrap();
        a.add_peer("b", format!("tcp://127.0.0.1:{port}").as_bytes())
            .unwrap();
        let start = Instant::now();
        let dealer = &a.routes["b"].dealer;
        dealer
            .monitor(
                "inproc://kvf-connect-deadline",
                ::zmq::SocketEvent::CONNECT_RETRIED as i32,
            )
            .unwrap();
        let events = a.ctx.socket(::zmq::PAIR).unwrap();
        events.connect("inproc://kvf-connect-deadline").unwrap();
        events
            .set_rcvtimeo(zmq_ms(CONNECT_TIMEOUT + Duration::from_secs(2)))
            .unwrap();
        a.send_to("b", b"queued while unreachable").unwrap();
        let event = events.recv_multipart(0).expect("no connect retry");
        let waited = start.elapsed();
        let kind = u16::from_ne_bytes([event[0][0], event[0][1]]);
        assert_eq!(kind, ::zmq::SocketEvent::CONNECT_RETRIED as u16);
        assert!(
            waited >= CONNECT_TIMEOUT - Duration::from_millis(200)
                && waited < CONNECT_TIMEOUT + Duration::from_secs(1),
            "abandoned after {waited:?}, deadline {CONNECT_TIMEOUT:?}"
        );
        // A peer comes up on that port: the retry delivers.
        drop(parked);
        drop(listener_fd);
        let router = a.ctx.socket(::zmq::ROUTER).unwrap();
        router.set_rcvtimeo(5_000).unwrap();
        router.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
        let frames = router.recv_multipart(0).expect("the queued message");
        assert_eq!(
            frames,
            vec![b"a".to_vec(), b"queued while unreachable".to_vec()]
        );
    }

    /// What a relayed connection does with the bytes it reads.
    const RELAY: u8 = 0;
    /// Reads and discards both ways (a partition, a middlebox that lost
    /// the flow): no reset, no end of stream passed on.
    const HOLE: u8 = 1;
    /// Stops reading from the DEALER's side (its window closes, its data
    /// waits), nothing passed on either way.
    const STALL: u8 = 2;

    /// A TCP relay in front of a peer whose existing connections can be
    /// turned into black holes or stalled; connections accepted later
    /// relay normally.
    struct Relay {
        port: u16,
        accepted: Arc<AtomicUsize>,
        modes: Arc<Mutex<Vec<Arc<AtomicU8>>>>,
        stop: Arc<AtomicBool>,
    }

    impl Relay {
        fn to(upstream_port: u16) -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            listener.set_nonblocking(true).unwrap();
            let port = listener.local_addr().unwrap().port();
            let accepted = Arc::new(AtomicUsize::new(0));
            let modes: Arc<Mutex<Vec<Arc<AtomicU8>>>> = Arc::default();
            let stop = Arc::new(AtomicBool::new(false));
            let (acc, ms, st) = (accepted.clone(), modes.clone(), stop.clone());
            std::thread::spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    let Ok((down, _)) = listener.accept() else {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    };
                    down.set_nonblocking(false).unwrap();
                    let up = TcpStream::connect(("127.0.0.1", upstream_port)).unwrap();
                    acc.fetch_add(1, Ordering::Relaxed);
                    let mode = Arc::new(AtomicU8::new(RELAY));
                    ms.lock().unwrap().push(mode.clone());
                    for (from, to, from_dealer) in [
                        (down.try_clone().unwrap(), up.try_clone().unwrap(), true),
                        (up, down, false),
                    ] {
                        let (mode, st) = (mode.clone(), st.clone());
                        std::thread::spawn(move || pump(from, to, from_dealer, &mode, &st));
                    }
                }
            });
            Self {
                port,
                accepted,
                modes,
                stop,
            }
        }

        /// Sets every connection accepted so far to `mode`.
        fn set_existing(&self, mode: u8) {
            for m in self.modes.lock().unwrap().iter() {
                m.store(mode, Ordering::Relaxed);
            }
        }
    }

    impl Drop for Relay {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
        }
    }

    fn pump(
        mut from: TcpStream,
        mut to: TcpStream,
        from_dealer: bool,
        mode: &AtomicU8,
        stop: &AtomicBool,
    ) {
        from.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let mut buf = [0u8; 16 << 10];
        while !stop.load(Ordering::Relaxed) {
            if from_dealer && mode.load(Ordering::Relaxed) == STALL {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            match from.read(&mut buf) {
                Ok(0) => break,
                // The mode as the bytes arrive, not as the read began.
                Ok(n) if mode.load(Ordering::Relaxed) == RELAY => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                Ok(_) => {} // swallowed
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => break,
            }
        }
        // A cut connection passes no end of stream on: the DEALER must
        // find it dead by itself.
        while mode.load(Ordering::Relaxed) != RELAY && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = to.shutdown(Shutdown::Both);
    }

    /// Sends `msg` from `a` every 100 ms until `b` receives `msg` (other
    /// messages are skipped) or `limit` passes; returns it.
    fn resend_until_received(
        a: &mut ZmqControlChannel,
        b: &mut ZmqControlChannel,
        msg: &[u8],
        limit: Duration,
    ) -> Option<Inbound> {
        let start = Instant::now();
        while start.elapsed() < limit {
            let _ = a.send_to("b", msg);
            if let Some(m) = recv_within(b, Duration::from_millis(100)).filter(|m| m.1 == msg) {
                return Some(m);
            }
        }
        None
    }

    /// `a` with its liveness shortened (`unacked` for the timeouts),
    /// routed to `b` through a fresh relay, one message relayed.
    fn relayed_pair(unacked: Duration) -> (ZmqControlChannel, ZmqControlChannel, Relay) {
        let mut b = ZmqControlChannel::bind("b", BindAddr::Loopback).unwrap();
        let b_port: u16 = b.endpoint().rsplit(':').next().unwrap().parse().unwrap();
        let relay = Relay::to(b_port);
        let mut a = ZmqControlChannel::bind("a", BindAddr::Loopback).unwrap();
        a.liveness.heartbeat_ivl = Duration::from_millis(100);
        a.liveness.unacked_timeout = unacked;
        a.add_peer("b", format!("tcp://127.0.0.1:{}", relay.port).as_bytes())
            .unwrap();
        a.send_to("b", b"before").unwrap();
        assert_eq!(
            recv_within(&mut b, Duration::from_secs(5)),
            Some(("a".to_string(), b"before".to_vec()))
        );
        (a, b, relay)
    }

    /// An idle connection that goes silent without a reset (a partition)
    /// is found dead by the heartbeat and remade: messages sent after the
    /// timeout reach the peer over a new connection. Without the heartbeat
    /// the DEALER keeps writing into the dead one and nothing arrives.
    #[test]
    fn a_silent_connection_is_remade_after_the_heartbeat_timeout() {
        let timeout = Duration::from_secs(2); // UNACKED_TIMEOUT, shortened
        let (mut a, mut b, relay) = relayed_pair(timeout);
        let before = relay.accepted.load(Ordering::Relaxed);
        relay.set_existing(HOLE);
        let limit = timeout + Duration::from_secs(5);
        let got = resend_until_received(&mut a, &mut b, b"after", limit);
        assert_eq!(
            got,
            Some(("a".to_string(), b"after".to_vec())),
            "nothing arrived {limit:?} after the connection went silent (timeout {timeout:?})"
        );
        assert!(
            relay.accepted.load(Ordering::Relaxed) > before,
            "no new connection was made"
        );
    }

    /// A connection whose peer stops reading while a large message waits
    /// (no heartbeat can be sent behind it) is failed by the kernel's
    /// TCP_USER_TIMEOUT (`ZMQ_TCP_MAXRT`) and remade; without it nothing
    /// arrives until the kernel's retransmissions give up.
    #[test]
    fn a_stalled_connection_with_data_waiting_is_remade() {
        let timeout = Duration::from_secs(2); // UNACKED_TIMEOUT, shortened
        let (mut a, mut b, relay) = relayed_pair(timeout);
        let before = relay.accepted.load(Ordering::Relaxed);
        relay.set_existing(STALL);
        // More than the loopback socket buffers hold: the rest waits in
        // libzmq's output buffer, so no PING can be encoded behind it.
        a.send_to("b", &vec![7u8; 32 << 20]).unwrap();
        let limit = timeout + Duration::from_secs(8);
        let got = resend_until_received(&mut a, &mut b, b"after", limit);
        assert_eq!(
            got,
            Some(("a".to_string(), b"after".to_vec())),
            "nothing arrived {limit:?} after the peer stopped reading (timeout {timeout:?})"
        );
        assert!(
            relay.accepted.load(Ordering::Relaxed) > before,
            "no new connection was made"
        );
    }
}
