//! In-process discovery: one [`EmbeddedRegistry`] shared by several agents
//! of one process (the default, etcd-free run). Publishing and revoking are
//! immediate; there is no lease, so dropping an [`EmbeddedDiscovery`]
//! withdraws its record like [`Discovery::revoke`].

use std::sync::{Arc, Mutex};

use crossbeam_channel::Receiver;

use super::{AgentRecord, Discovery, DiscoveryError, Hub, LeaseState, PeerEvent};

/// The shared in-process registry. Cheap to clone (an `Arc`).
#[derive(Clone, Default)]
pub struct EmbeddedRegistry {
    hub: Arc<Hub>,
}

impl EmbeddedRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A discovery handle for one agent on this registry.
    pub fn handle(&self) -> EmbeddedDiscovery {
        EmbeddedDiscovery {
            hub: self.hub.clone(),
            own: Mutex::new((None, LeaseState::Unpublished)),
        }
    }

    /// Every live record (all agents), sorted by name.
    pub fn peers(&self) -> Vec<AgentRecord> {
        self.hub.live()
    }
}

/// One agent's handle on an [`EmbeddedRegistry`].
pub struct EmbeddedDiscovery {
    hub: Arc<Hub>,
    own: Mutex<(Option<String>, LeaseState)>,
}

impl EmbeddedDiscovery {
    fn own(&self) -> std::sync::MutexGuard<'_, (Option<String>, LeaseState)> {
        self.own.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Discovery for EmbeddedDiscovery {
    /// Inserts the record at once (replacing this handle's previous one if
    /// the name changed).
    ///
    /// # Errors
    /// [`DiscoveryError::Record`] for an invalid record.
    fn publish(&self, record: AgentRecord) -> Result<(), DiscoveryError> {
        record.validate()?;
        let mut own = self.own();
        if let Some(prev) = own.0.take() {
            if prev != record.name {
                self.hub.remove(&prev);
            }
        }
        own.0 = Some(record.name.clone());
        own.1 = LeaseState::Ok;
        self.hub.upsert(record);
        Ok(())
    }

    fn events(&self) -> Receiver<PeerEvent> {
        self.hub.subscribe()
    }

    /// Removes the record at once. Never fails.
    fn revoke(&self) -> Result<(), DiscoveryError> {
        let mut own = self.own();
        if let Some(name) = own.0.take() {
            self.hub.remove(&name);
        }
        own.1 = LeaseState::Revoked;
        Ok(())
    }

    fn lease_state(&self) -> LeaseState {
        self.own().1
    }

    fn peers(&self) -> Vec<AgentRecord> {
        self.hub.live()
    }
}

impl Drop for EmbeddedDiscovery {
    fn drop(&mut self) {
        let _ = self.revoke();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::discovery::{Incarnation, RECORD_VERSION};

    fn rec(name: &str, logical: &str, started: u64) -> AgentRecord {
        AgentRecord {
            version: RECORD_VERSION,
            name: name.into(),
            logical_id: logical.into(),
            incarnation: Incarnation(1),
            node: String::new(),
            nixl_metadata: vec![1],
            handshake: None,
            buffers: vec![],
            http: String::new(),
            role: String::new(),
            config_generation: 0,
            draining: false,
            config_fingerprint: String::new(),
            config_error: String::new(),
            engines: Vec::new(),
            pod_uid: String::new(),
            started_at_ms: started,
            published_at_ms: started,
        }
    }

    #[test]
    fn agents_see_each_other_and_leave() {
        let reg = EmbeddedRegistry::new();
        let a = reg.handle();
        let b = reg.handle();
        let rx = b.events();
        a.publish(rec("a-1", "a", 1)).unwrap();
        assert!(matches!(rx.try_recv(), Ok(PeerEvent::Upsert(r)) if r.name == "a-1"));
        assert_eq!(a.lease_state(), LeaseState::Ok);
        a.publish(rec("a-2", "a", 2)).unwrap();
        assert_eq!(
            rx.try_recv().unwrap(),
            PeerEvent::Removed { name: "a-1".into() }
        );
        assert!(matches!(rx.try_recv(), Ok(PeerEvent::Upsert(r)) if r.name == "a-2"));
        drop(a);
        assert_eq!(
            rx.try_recv().unwrap(),
            PeerEvent::Removed { name: "a-2".into() }
        );
        assert!(reg.peers().is_empty());
    }
}
