//! # kvfabric-core — the pure logic of the bounce-buffer engine
//!
//! Everything in this crate is sans-IO (the quinn-proto model): no sockets,
//! threads, clocks or GPU handles. State machines are fed events and return
//! actions; time comes in as an argument. The design source is the NIXL
//! bounce-buffer v2 design (`shared/seeds/000_526c8a524442fd2d.txt`, cited
//! below as "seed §N").
//!
//! | module | seed | what |
//! |---|---|---|
//! | [`config`] | §10 | `BounceConfig`: env / YAML / CRD, byte suffixes, validation |
//! | [`plan`] | §4, §6 | `TransferPlan`: bin-pack descriptors into chunks, scatter runs |
//! | [`wire`] | §5 | control-plane codec: WANT / GRANT / DATA / ACK / handshake |
//! | [`buddy`] | §4 | `BuddyAllocator` over arena byte offsets |
//! | [`scheduler`] | §5 | `CreditScheduler`: credits round-robin (the seed's) or oldest first, W cap, drain mode |
//! | [`types`] | §3 | shared vocabulary: flow keys, scatter runs, descriptors |
//! | [`layout`] | — | engine KV layouts: validation, fingerprint, TP head split, block → descriptors |
//! | [`text`] | — | peer-controlled strings escaped and bounded for logs |
//! | [`rollout`] | — | config rollout: etcd documents, fingerprint, pacing (issue 14) |

pub mod buddy;
pub mod config;
pub mod layout;
pub mod model;
pub mod plan;
pub mod protocol;
pub mod report;
pub mod rng;
pub mod rollout;
pub mod scheduler;
pub mod text;
pub mod types;
pub mod wire;

pub use types::{
    BlockScatter, ControlKind, Descriptor, FlowKey, ScatterList, ScatterRun, UniformScatter,
};
