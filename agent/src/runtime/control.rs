//! Control channel (seed §4 `ControlChannel`): carries WANT / GRANT / DATA /
//! ACK between agents. Three implementations: [`zmq::ZmqControlChannel`]
//! (default; ROUTER to receive, one DEALER per peer to send),
//! [`notif::NixlNotifControlChannel`] (messages ride NIXL notifications) and
//! [`tcp::TcpControlChannel`] (frames on plain sockets written and read by
//! the IO threads themselves; lowest latency). [`control_transport`] picks
//! between ZMQ and TCP.
//! A channel is owned by one IO thread (`Send`, not `Sync`).

use std::sync::Arc;
use std::time::Duration;

use super::waker::Waker;

pub mod auth;
pub mod notif;
pub mod tcp;
pub mod zmq;

/// Errors of a control channel; each names the peer or endpoint involved.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The endpoint a peer advertised is malformed (seed §5: validated
    /// before connecting; the caller rejects the WANT, never panics).
    #[error("invalid control endpoint {endpoint:?} for peer {peer:?}: {reason}")]
    InvalidEndpoint {
        /// The peer.
        peer: String,
        /// The endpoint as received (lossy UTF-8).
        endpoint: String,
        /// What was expected.
        reason: String,
    },
    /// No route to this peer (never added, or removed).
    #[error("unknown control peer {0:?}")]
    UnknownPeer(String),
    /// The send queue to the peer is full; the message was dropped (seed §9:
    /// never block the IO thread; the request times out instead).
    #[error("send queue to peer {0:?} is full; message dropped")]
    Dropped(String),
    /// Transport-level failure (socket / NIXL error text).
    #[error("control transport error: {0}")]
    Transport(String),
}

/// One received control message: the sending peer's name and the bytes.
pub type Inbound = (String, Vec<u8>);

/// Checks a peer-chosen identity (a ZMQ routing id, a TCP hello name)
/// before it is used as a peer name or logged (issue 11, item 10): 1..=255
/// bytes of UTF-8 with no control characters, whitespace or `/` — the
/// rules of an agent name, which is what an honest peer sends.
///
/// # Errors
/// A message saying what is wrong, with the identity shown escaped and
/// bounded ([`kvfabric_core::text::LogSafe`]).
pub fn valid_peer_identity(id: &[u8]) -> Result<&str, String> {
    let shown = || kvfabric_core::text::log_safe_bytes(id);
    let s = std::str::from_utf8(id).map_err(|_| format!("identity {} is not UTF-8", shown()))?;
    if s.is_empty() || s.len() > 255 {
        return Err(format!("identity of {} bytes: want 1..=255 bytes", s.len()));
    }
    if s.chars()
        .any(|c| c == '/' || c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "identity {} holds whitespace, control characters or '/'",
            shown()
        ));
    }
    Ok(s)
}

/// The control channel seam (seed §4): `add_peer` / `remove_peer` /
/// `send_to` / `recv` / `local_endpoint`.
pub trait ControlChannel: Send {
    /// The endpoint peers use to reach us: `tcp://ip:port` for ZMQ, the
    /// serialized NIXL metadata for notifications. Advertised in the
    /// handshake and in every WANT (reverse-path bootstrap, seed §5).
    fn local_endpoint(&self) -> Vec<u8>;
    /// Registers a route to `peer` at `endpoint`. Idempotent for the same
    /// endpoint; a new endpoint replaces the old route.
    ///
    /// # Errors
    /// [`ControlError::InvalidEndpoint`] when the endpoint is malformed.
    fn add_peer(&mut self, peer: &str, endpoint: &[u8]) -> Result<(), ControlError>;
    /// Drops the route to `peer` (no-op if unknown).
    fn remove_peer(&mut self, peer: &str);
    /// Whether a route to `peer` exists.
    fn has_peer(&self, peer: &str) -> bool;
    /// Sends `msg` to `peer` without blocking.
    ///
    /// # Errors
    /// [`ControlError::UnknownPeer`], [`ControlError::Dropped`] on a full
    /// queue, [`ControlError::Transport`].
    fn send_to(&mut self, peer: &str, msg: &[u8]) -> Result<(), ControlError>;
    /// Receives one message, waiting at most `timeout` (0 = poll). With a
    /// waker set ([`ControlChannel::set_waker`]) the wait also ends, with
    /// `Ok(None)`, as soon as the waker is signalled (the signal is cleared).
    fn recv(&mut self, timeout: Duration) -> Result<Option<Inbound>, ControlError>;
    /// Gives the channel the IO thread's [`Waker`], so a blocking `recv`
    /// wakes early for copy completions and commands.
    fn set_waker(&mut self, waker: Arc<Waker>);
    /// Whether `recv` itself progresses the transfer engine (and owns its
    /// notifications). When false, the reactor calls
    /// `TransferEngine::progress` every tick.
    fn progresses_engine(&self) -> bool {
        false
    }
    /// Accepted connections closed so far because their hello did not pass
    /// the control key (TCP with `controlAuth`; 0 for the others).
    fn refused_hellos(&self) -> u64 {
        0
    }
    /// Unsigned hellos accepted in `controlAuth: optional` so far (0 for
    /// the others): while it grows, some peer does not sign yet.
    fn unsigned_hellos(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::valid_peer_identity;

    /// Issue 11, item 10: a peer identity that would forge log lines or
    /// flood them is refused, and the refusal shows it escaped.
    #[test]
    fn peer_identities_are_checked_before_use() {
        assert_eq!(
            valid_peer_identity(b"decode-0123abcd"),
            Ok("decode-0123abcd")
        );
        for bad in [
            &b"peer\nINFO forged line"[..],
            b"a b",
            b"a/b",
            b"\x1b[31mred",
            b"",
            b"\xff\xfe",
        ] {
            let e = valid_peer_identity(bad).unwrap_err();
            assert!(!e.contains('\n') && !e.contains('\x1b'), "{e:?}");
        }
        let long = vec![b'a'; 256];
        assert!(valid_peer_identity(&long)
            .unwrap_err()
            .contains("256 bytes"));
        assert!(valid_peer_identity(&long[..255]).is_ok());
    }
}
