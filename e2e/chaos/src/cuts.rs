//! The nftables rule sets of the network faults, for either topology
//! (pure: rule text out, one `(namespace, table body)` per table; made and
//! healed by [`crate::nft::Tables`]).
//!
//! - **Network namespaces** ([`crate::netns`]): every agent has an address
//!   of its own, so a fault's rules sit in the namespaces of the agents it
//!   acts on and select packets by address and port. A namespace sees its
//!   agent's packets on the way out (output hook) and the packets for it on
//!   the way in (input hook).
//! - **Loopback**: all agents share the root namespace and 127.0.0.1; a
//!   packet between two agents passes this namespace's output hook once and
//!   its input hook once. Agents are singled out by their sockets' group id
//!   (`meta skgid`, known on output only) marking the connection (`ct
//!   mark`), dropped on input (see [`crate::nft`]).
//!
//! Every drop rule carries a counter and a `comment` the suite reads back
//! with [`crate::nft::Table::counter`]: `to_victim`, `from_victim`, `probe`
//! (the suite's own connection attempt to the victim's control port),
//! `seen` and `dropped` (control loss).

use std::net::{Ipv4Addr, SocketAddr};

use crate::netns::Slot;

/// One table: the namespace it goes in (None: the suite's) and its body.
pub type Spec = (Option<String>, String);

/// Where the agents are.
pub struct Agents {
    /// Each agent's control-channel port, by slot.
    pub ports: Vec<u16>,
    /// Each agent's socket group id, by slot (loopback rules).
    pub gids: Vec<u32>,
    /// Each agent's namespace, by slot, and the bridge (host) address;
    /// None on loopback.
    pub netns: Option<(Vec<Slot>, Ipv4Addr)>,
}

fn set<T: ToString>(xs: impl IntoIterator<Item = T>) -> String {
    xs.into_iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Cuts agent `k`'s control path (its control connections to and from
/// every peer) and nothing else (etcd and its HTTP API stay reachable).
/// Also the address the suite connects to to check that the cut holds: a
/// SYN there must time out (counted as `probe`).
///
/// On loopback the probe goes to 127.0.0.2 (no agent binds it: unblocked
/// it would be refused at once); `mark` is the conntrack mark to use.
pub fn partition_agent(a: &Agents, k: usize, mark: u32) -> (Vec<Spec>, SocketAddr) {
    let mine = a.ports[k];
    if let Some((slots, host)) = &a.netns {
        let me = &slots[k];
        let peers = set(slots
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != k)
            .map(|(_, s)| s.ip));
        let body = format!(
            "chain in {{ type filter hook input priority 0; policy accept;\n\
               ip saddr {host} tcp dport {mine} counter drop comment \"probe\"\n\
               ip saddr {{ {peers} }} counter drop comment \"to_victim\"\n\
             }}\n\
             chain out {{ type filter hook output priority 0; policy accept;\n\
               ip daddr {{ {peers} }} counter drop comment \"from_victim\"\n\
             }}"
        );
        return (vec![(Some(me.ns.clone()), body)], (me.ip, mine).into());
    }
    let gid = a.gids[k];
    let peers = set(a
        .ports
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != k)
        .map(|(_, p)| p));
    // Output: mark the victim's control connections — anything to its
    // port, and what its own sockets (its gid) send from its port or to the
    // peers' ports. Input: drop every packet of a marked connection,
    // counted by which way it goes.
    let body = format!(
        "chain out {{ type filter hook output priority 0; policy accept;\n\
           tcp dport {mine} ct mark set {mark:#x}\n\
           meta skgid {gid} tcp sport {mine} ct mark set {mark:#x}\n\
           meta skgid {gid} tcp dport {{ {peers} }} ct mark set {mark:#x}\n\
         }}\n\
         chain in {{ type filter hook input priority 0; policy accept;\n\
           ct mark {mark:#x} ip daddr 127.0.0.2 counter drop comment \"probe\"\n\
           ct mark {mark:#x} tcp dport {mine} counter drop comment \"to_victim\"\n\
           ct mark {mark:#x} tcp sport {{ {peers} }} counter drop comment \"to_victim\"\n\
           ct mark {mark:#x} tcp sport {mine} counter drop comment \"from_victim\"\n\
           ct mark {mark:#x} tcp dport {{ {peers} }} counter drop comment \"from_victim\"\n\
           ct mark {mark:#x} counter drop comment \"other\"\n\
         }}"
    );
    (vec![(None, body)], ([127, 0, 0, 2], mine).into())
}

/// Drops `pct`% of every agent's control packets (to or from any agent's
/// control port), each direction, at random; counts all of them (`seen`).
pub fn control_loss(a: &Agents, pct: u32) -> Vec<Spec> {
    let ports = set(a.ports.iter());
    let chain = |only: &str| {
        format!(
            "chain out {{ type filter hook output priority 0; policy accept;\n\
               {only}tcp dport {{ {ports} }} counter comment \"seen\"\n\
               {only}tcp sport {{ {ports} }} counter comment \"seen\"\n\
               {only}tcp dport {{ {ports} }} numgen random mod 100 < {pct} counter drop comment \"dropped\"\n\
               {only}tcp sport {{ {ports} }} numgen random mod 100 < {pct} counter drop comment \"dropped\"\n\
             }}"
        )
    };
    match &a.netns {
        // In each agent's namespace, what it sends to another agent.
        Some((slots, _)) => {
            let all = set(slots.iter().map(|s| s.ip));
            let only = format!("ip daddr {{ {all} }} ");
            slots
                .iter()
                .map(|s| (Some(s.ns.clone()), chain(&only)))
                .collect()
        }
        None => vec![(None, chain(""))],
    }
}

/// Cuts agent `k` off from the fabric etcd (`etcd_port` on the host) both
/// ways, its open connections as well as new ones; its control path stays.
///
/// On loopback: `open_ports` are the local ports of the victim's open etcd
/// connections (`meta skgid` alone misses packets the kernel sends outside
/// the process's context — measured: a lease keep-alive got through a
/// gid-only rule and renewed the lease mid-cut); new connections are caught
/// by the gid and marked with `mark`.
pub fn partition_etcd(
    a: &Agents,
    k: usize,
    etcd_port: u16,
    open_ports: &[u16],
    mark: u32,
) -> Vec<Spec> {
    if let Some((slots, host)) = &a.netns {
        let body = format!(
            "chain out {{ type filter hook output priority 0; policy accept;\n\
               ip daddr {host} tcp dport {etcd_port} counter drop comment \"from_victim\"\n\
             }}\n\
             chain in {{ type filter hook input priority 0; policy accept;\n\
               ip saddr {host} tcp sport {etcd_port} counter drop comment \"to_victim\"\n\
             }}"
        );
        return vec![(Some(slots[k].ns.clone()), body)];
    }
    let gid = a.gids[k];
    let by_port = if open_ports.is_empty() {
        String::new()
    } else {
        let ports = set(open_ports.iter());
        format!(
            "tcp sport {{ {ports} }} tcp dport {etcd_port} counter drop comment \"from_victim\"\n\
             tcp sport {etcd_port} tcp dport {{ {ports} }} counter drop comment \"to_victim\"\n"
        )
    };
    // Output: what the victim's sockets (its gid, or its open connections'
    // ports) send to etcd is dropped right there, new connections marked;
    // input: etcd's answers on them.
    let body = format!(
        "chain out {{ type filter hook output priority 0; policy accept;\n\
           meta skgid {gid} tcp dport {etcd_port} ct mark set {mark:#x}\n\
           meta skgid {gid} tcp dport {etcd_port} counter drop comment \"from_victim\"\n\
           {by_port}\
         }}\n\
         chain in {{ type filter hook input priority 0; policy accept;\n\
           ct mark {mark:#x} tcp sport {etcd_port} counter drop comment \"to_victim\"\n\
         }}"
    );
    vec![(None, body)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots() -> Vec<Slot> {
        (0..4)
            .map(|i| Slot {
                ns: format!("ns{i}"),
                ip: Ipv4Addr::new(10, 213, 7, 10 + i),
            })
            .collect()
    }

    #[test]
    fn netns_partition_sits_in_the_victims_namespace_and_spares_the_host() {
        let s = slots();
        let a = Agents {
            ports: vec![1000, 1001, 1002, 1003],
            gids: vec![1, 2, 3, 4],
            netns: Some((s, Ipv4Addr::new(10, 213, 7, 1))),
        };
        let (specs, probe) = partition_agent(&a, 2, 0x42);
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].0.as_deref(), Some("ns2"));
        assert_eq!(probe, "10.213.7.12:1002".parse().unwrap());
        let body = &specs[0].1;
        assert!(body.contains("ip saddr { 10.213.7.10, 10.213.7.11, 10.213.7.13 }"));
        assert!(
            !body.contains("10.213.7.12,"),
            "the victim is not its own peer"
        );
        // The host (etcd, the suite's HTTP reads) only loses the probe port.
        assert!(body.contains("ip saddr 10.213.7.1 tcp dport 1002"));
        let loss = control_loss(&a, 10);
        assert_eq!(loss.len(), 4, "one table per agent namespace");
        assert!(loss[0]
            .1
            .contains("ip daddr { 10.213.7.10, 10.213.7.11, 10.213.7.12, 10.213.7.13 }"));
        let etcd = partition_etcd(&a, 1, 2379, &[], 0x42);
        assert_eq!(etcd[0].0.as_deref(), Some("ns1"));
        assert!(etcd[0].1.contains("ip daddr 10.213.7.1 tcp dport 2379"));
    }

    #[test]
    fn loopback_rules_mark_by_gid_and_drop_open_etcd_connections_by_port() {
        let a = Agents {
            ports: vec![1000, 1001, 1002, 1003],
            gids: vec![11, 12, 13, 14],
            netns: None,
        };
        let (specs, probe) = partition_agent(&a, 0, 0x42);
        assert_eq!(specs[0].0, None);
        assert_eq!(probe, "127.0.0.2:1000".parse().unwrap());
        assert!(specs[0]
            .1
            .contains("meta skgid 11 tcp dport { 1001, 1002, 1003 } ct mark set 0x42"));
        let etcd = partition_etcd(&a, 3, 2379, &[40000, 40001], 0x43);
        assert!(etcd[0].1.contains("meta skgid 14 tcp dport 2379"));
        assert!(etcd[0]
            .1
            .contains("tcp sport { 40000, 40001 } tcp dport 2379"));
        assert_eq!(control_loss(&a, 5).len(), 1);
    }
}
