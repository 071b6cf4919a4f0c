//! # kvfabric-chaos — the chaos suite of issue 16
//!
//! Starts the topology itself ([`topo`]): the control plane of
//! e2e/kube/up.sh (etcd, kube-apiserver, controller-manager, scheduler,
//! kwok fake GPU nodes), a fabric etcd of its own, the `kvfabric-operator`
//! binary watching a `KvFabric`, two prefill and two decode `kvfabric
//! agent` processes bound to agent pods (`--pod-uid`), each in a network
//! namespace of its own joined by veth to a bridge ([`netns`]; loopback
//! where the machine does not allow it), prefill engines as
//! separate processes (`kvfabric-chaos engine`, [`engine`]) bound to
//! prefill pods, and decode engines in this process bound to decode pods.
//! It then runs rounds ([`suite`]): trace-replay hand-offs (≥ 32
//! concurrent, sizes from the Mooncake trace) while one fault is injected,
//! then the invariants at quiesce; the [`report`] says what held.

pub mod cuts;
pub mod engine;
pub mod netns;
pub mod nft;
pub mod report;
pub mod suite;
pub mod topo;

pub use report::Report;
pub use suite::{run, schedule, FaultKind, Options, RunError};
