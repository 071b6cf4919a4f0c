//! [`NixlNotifControlChannel`]: control messages as NIXL notifications
//! (seed §4 `ControlChannel` row: "no TCP sockets; 'endpoint' is serialized
//! NIXL metadata"; seed §5 last paragraph of "Endpoints are routable IPs").
//!
//! The endpoint is the engine's serialized agent metadata; adding a peer
//! loads the peer's metadata into the shared [`TransferEngine`], so the
//! reverse path (seed §5 reverse-path bootstrap) works as with ZMQ: a WANT
//! carries the sender's metadata and the receiver `add_peer`s it.
//!
//! Receiving drains [`TransferEngine::progress`], which returns *every*
//! notification the agent received. This channel must therefore be the only
//! consumer of `progress()` notifications on its engine; an owner that calls
//! `progress()` itself (e.g. to keep NIXL moving while polling writes) hands
//! the notifications it got to [`NixlNotifControlChannel::deliver`].

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{ControlChannel, ControlError, Inbound};
use crate::runtime::engine::TransferEngine;
use crate::runtime::waker::Waker;

/// Sleep between [`TransferEngine::progress`] calls while
/// [`ControlChannel::recv`] waits (50 µs): short enough to add little
/// latency, long enough not to monopolise the engine mutex.
pub const RECV_POLL_INTERVAL: Duration = Duration::from_micros(50);

/// A [`ControlChannel`] over NIXL notifications of one shared
/// [`TransferEngine`]. Owned by one IO thread (`Send`, not `Sync`).
pub struct NixlNotifControlChannel {
    engine: Arc<dyn TransferEngine>,
    /// Peer name → the metadata it was added with.
    peers: HashMap<String, Vec<u8>>,
    inbox: VecDeque<Inbound>,
    waker: Option<Arc<Waker>>,
}

impl std::fmt::Debug for NixlNotifControlChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlNotifControlChannel")
            .field("agent", &self.engine.agent_name())
            .field("peers", &self.peers.keys().collect::<Vec<_>>())
            .field("queued", &self.inbox.len())
            .finish()
    }
}

impl NixlNotifControlChannel {
    /// Wraps `engine`; the channel's name is the engine's agent name.
    pub fn new(engine: Arc<dyn TransferEngine>) -> Self {
        Self {
            engine,
            peers: HashMap::new(),
            inbox: VecDeque::new(),
            waker: None,
        }
    }

    /// The engine this channel sends and receives through.
    pub fn engine(&self) -> &Arc<dyn TransferEngine> {
        &self.engine
    }

    /// Queues notifications the owner drained from the engine itself
    /// (`(peer agent name, message)`, in arrival order); [`ControlChannel::recv`]
    /// returns them before anything newer.
    pub fn deliver(&mut self, msgs: impl IntoIterator<Item = Inbound>) {
        self.inbox.extend(msgs);
    }

    /// Messages received but not yet returned by [`ControlChannel::recv`].
    pub fn queued(&self) -> usize {
        self.inbox.len()
    }

    fn pump(&mut self) -> Result<(), ControlError> {
        let got = self
            .engine
            .progress()
            .map_err(|e| ControlError::Transport(e.to_string()))?;
        self.inbox.extend(got);
        Ok(())
    }
}

impl ControlChannel for NixlNotifControlChannel {
    /// `recv` progresses the shared engine and owns its notifications.
    fn progresses_engine(&self) -> bool {
        true
    }

    /// The engine's current serialized NIXL metadata (it grows as regions
    /// are registered, so it is read fresh on every call). Empty when the
    /// engine cannot produce it (logged): an agent without a usable endpoint
    /// advertises no handshake (seed §5).
    fn local_endpoint(&self) -> Vec<u8> {
        match self.engine.local_metadata() {
            Ok(md) => md,
            Err(e) => {
                tracing::warn!(agent = self.engine.agent_name(), error = %e,
                    "cannot read local NIXL metadata; no control endpoint");
                Vec::new()
            }
        }
    }

    /// Loads `endpoint` (the peer's serialized NIXL metadata) into the
    /// engine and checks that it names `peer`. The same metadata again is a
    /// no-op; different metadata is loaded again (NIXL updates the peer).
    ///
    /// # Errors
    /// [`ControlError::InvalidEndpoint`] when the metadata is empty, NIXL
    /// rejects it, or it names another agent.
    fn add_peer(&mut self, peer: &str, endpoint: &[u8]) -> Result<(), ControlError> {
        let invalid = |reason: String| ControlError::InvalidEndpoint {
            peer: peer.to_string(),
            endpoint: format!("<{} bytes of NIXL metadata>", endpoint.len()),
            reason,
        };
        if endpoint.is_empty() {
            return Err(invalid("empty NIXL metadata".into()));
        }
        if self.peers.get(peer).is_some_and(|md| md == endpoint) {
            return Ok(());
        }
        let name = self
            .engine
            .load_peer(endpoint)
            .map_err(|e| invalid(format!("NIXL rejected the metadata: {e}")))?;
        if name != peer {
            return Err(invalid(format!(
                "the metadata belongs to agent {name:?}, not {peer:?}"
            )));
        }
        self.peers.insert(name, endpoint.to_vec());
        Ok(())
    }

    /// Forgets the peer here and in the engine (NIXL `invalidateRemoteMD`;
    /// the engine is shared, so data-plane writes to the peer stop too —
    /// the seed's forgetPeer semantics). Errors are logged and ignored.
    fn remove_peer(&mut self, peer: &str) {
        if self.peers.remove(peer).is_some() {
            if let Err(e) = self.engine.forget_peer(peer) {
                tracing::warn!(peer, error = %e, "NIXL forget_peer failed (ignored)");
            }
        }
    }

    fn has_peer(&self, peer: &str) -> bool {
        self.peers.contains_key(peer)
    }

    /// Sends `msg` as one NIXL notification (NIXL queues it; it does not
    /// block on the peer). The first message after a peer is (re)loaded
    /// only leaves once this agent's engine has been progressed for the UCX
    /// connection set-up (tens of ms, many calls): the owner must keep
    /// calling [`ControlChannel::recv`] (its IO loop does every tick).
    ///
    /// # Errors
    /// [`ControlError::UnknownPeer`] when `peer` was not added;
    /// [`ControlError::Transport`] with NIXL's error otherwise.
    fn send_to(&mut self, peer: &str, msg: &[u8]) -> Result<(), ControlError> {
        if !self.peers.contains_key(peer) {
            return Err(ControlError::UnknownPeer(peer.to_string()));
        }
        self.engine
            .send_notification(peer, msg)
            .map_err(|e| ControlError::Transport(format!("notification to {peer:?}: {e}")))
    }

    /// Returns the oldest queued message, progressing the engine first when
    /// none is queued; with `timeout > 0` keeps progressing (every
    /// [`RECV_POLL_INTERVAL`]) until one arrives or `timeout` passes.
    /// Messages from agents never added are delivered too (a WANT is how the
    /// reverse path is bootstrapped).
    ///
    /// # Errors
    /// [`ControlError::Transport`] when progressing the engine fails.
    fn set_waker(&mut self, waker: Arc<Waker>) {
        self.waker = Some(waker);
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<Inbound>, ControlError> {
        if let Some(m) = self.inbox.pop_front() {
            return Ok(Some(m));
        }
        let deadline = Instant::now() + timeout;
        loop {
            self.pump()?;
            if let Some(m) = self.inbox.pop_front() {
                return Ok(Some(m));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let slice = RECV_POLL_INTERVAL.min(deadline - now);
            match &self.waker {
                // Woken: return so the IO thread handles its completion.
                Some(w) if w.wait(slice) => return Ok(None),
                Some(_) => {}
                None => std::thread::sleep(slice),
            }
        }
    }
}
