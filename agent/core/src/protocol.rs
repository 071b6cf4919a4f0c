//! The bounce transfer protocol as a sans-IO state machine (issue 17; seed
//! §5–§9): the sender role (request/chunk table, eager gathers, credit
//! attach, writes, send-side orphans, deferred cancels, no-progress
//! timeouts) and the receiver role (grants, region table, DATA validation,
//! scatter queue, reclaim on cancel / forget / flow silence) of **one
//! agent**, both over the one [`CreditScheduler`] of its arena.
//!
//! No threads, sockets, NIXL, CUDA or clocks: the caller (the reactor)
//! feeds [`Input`]s with the current time and performs the [`Action`]s the
//! machine queues ([`Machine::poll_action`]); [`Machine::next_deadline`]
//! says when to feed [`Input::Tick`] at the latest. Time is a plain `u64`
//! of **nanoseconds** ([`Nanos`]) from any origin the caller picks, never
//! decreasing (a smaller `now` is taken as the previous one). The
//! deterministic simulator in `agent/core/tests/protocol_sim.rs` drives
//! several machines through a faulty virtual network (docs/protocol.md).
//!
//! The runtime runs this machine: `Io` in `agent/src/runtime/transport.rs`
//! is a reactor that feeds it inputs and performs its actions (issue 17
//! step 2) and holds no protocol state of its own. The rules were first
//! ported from `Io`'s methods; where the simulator found a rule wrong the
//! machine deviates from that first form (listed under "Deviations" below,
//! each with a [`Mutations`] switch restoring the old rule for the
//! regression tests). [`Event`]s ([`Machine::poll`]) carry what the
//! reactor records but the protocol does not need: chunk stages of traced
//! requests ([`Machine::set_traced`]) and a hint that a flow's DATA will
//! follow. The runtime keeps tombstones only for flows that existed and at
//! most `MAX_TOMBSTONES` ([`Machine::set_tombstone_policy`]).
//!
//! # Which input / action replaced which method of the former `Io`
//!
//! | former `Io` (transport.rs) | machine |
//! |---|---|
//! | `on_submit` | [`Input::Submit`] (chunks already sized by `TransferPlan::chunk_bounds`); WANT as [`Action::Send`]; an unsendable WANT comes back as [`Input::SendFailed`] |
//! | `pump` | internal; runs after every input that can stage or post |
//! | `post_chunk` | [`Action::PostWrite`]; a synchronous post error is fed back as [`Input::PostFailed`] |
//! | `poll_writes` (SUCCESS / FAILED) | the reactor polls every write id it holds and feeds terminal ones as [`Input::WriteDone`]; DATA follows as [`Action::Send`] |
//! | `on_grant`, `on_ack`, `on_want`, `on_data` | [`Input::Message`] (the reactor decodes; WANT route bootstrap result in [`Route`]) |
//! | `fail_request`, `send_cancel`, `orphan_write_settled` | internal; [`Action::Resolve`], cancel as [`Action::Send`] of an empty WANT, [`Action::ReleaseStaging`] |
//! | `drain_orphan_writes` | [`Input::WriteDone`] for an orphaned write id; its overdue cancel on [`Input::Tick`] |
//! | `check_timeouts` (requests and flow silence) | [`Input::Tick`] at [`Machine::next_deadline`] |
//! | `reclaim_flow`, `forget_regions`, `schedule_and_send` (with the bidirectional reserve) | internal; GRANTs as [`Action::Send`] |
//! | `validate_scatter` (held-by-flow first, then bounds and allowed ranges) | internal, on DATA and DATA_UNIFORM |
//! | `drain_scatter_queue` | [`Action::StartScatter`] when a copy context is free |
//! | `drain_copies` | [`Input::GatherDone`], [`Input::ScatterDone`] |
//! | `answer_disallowed`, `Command::{AllowScatter, DisallowScatter, Quiesce}` | [`Input::AllowScatter`], [`Input::DisallowScatter`], [`Input::QuiesceScatter`] → [`Action::Quiesced`] |
//! | `Command::Cancel` | [`Input::Cancel`] ([`Machine::has_request`] answers "was it in flight") |
//! | `Command::AddPeer` (the `peers` table) | [`Input::PeerAdded`] (the channel route stays the reactor's) |
//! | `forget_peer` | [`Input::PeerForgotten`] → cancels, [`Action::ForgetRoute`] |
//! | `shutdown` | [`Input::Shutdown`], then [`Input::AbandonInFlight`] once the 5 s bounds pass ([`Action::ArenaInDoubt`]) |
//! | `snapshot`, `update_gauges` | [`Machine::snapshot`], [`Machine::counters`] |
//!
//! Left with the reactor (not protocol decisions): the engine, its handles
//! and `progress()`, the control channel and its routes (`has_peer`,
//! reverse-path `add_peer`; a cancel is sent only where a route is),
//! copy workers and their plans, completions and the timestamps of stage
//! timelines, transport probes / reports, `heard` times, notices, the
//! `FaultPlan` test hooks, wake-ups and the adaptive poll, and the 5 s
//! bounds of a shutdown.
//!
//! # Differences of form (same rules)
//!
//! * Copy contexts (`ExecPool`) are a counter here: a gather or a scatter
//!   takes one, its completion input returns it.
//! * The former `Io` retried every request on every loop tick once one
//!   had parked; the machine retries only the requests whose staging
//!   starved (no copy context, arena space or eager budget), oldest
//!   first, after an input that freed one of those (issue 18: with 128
//!   requests in flight the former rule cost 128 pumps per input).
//! * The former `Io::pump` polled writes between posts; here writes
//!   complete only through [`Input::WriteDone`] (the reactor polls its
//!   writes between two queued posts and feeds what landed at once).
//! * Collections are ordered (`BTreeMap`), so a run is a pure function of
//!   its inputs (the simulator replays seeds exactly).
//!
//! # Deviations (rules the simulator showed wrong; see docs/protocol.md)
//!
//! * **Credits are keyed by chunk index.** `Io::on_grant` appends every
//!   credit of a GRANT to a queue and attaches them in arrival order,
//!   ignoring `Credit::chunk_index`: a duplicated (or replayed) GRANT
//!   attaches chunk *i*'s region to chunk *i + 1*, whose write then lands in
//!   a region the receiver frees after chunk *i*'s scatter. Here a credit is
//!   taken only for the chunk it names, once; others are dropped
//!   ([`Mutations::unkeyed_credits`] restores the old rule).
//! * **DATA must name the chunk its region was granted for.** `Io::on_data`
//!   checks only that the flow holds the region; a duplicated DATA arriving
//!   after the region was re-granted to the same flow for a later chunk is
//!   scattered from a region that the later write is filling (and freed
//!   under it). Here the region remembers its chunk index
//!   ([`Mutations::unchecked_data_chunk`] restores the old rule).
//!
//! * **Eager staging leaves a grantable block beside the reserve.**
//!   `Io::pump` lets eager (credit-less) staging take every block but the
//!   bidirectional reserve. With an arena of two max-size blocks, two
//!   agents submitting to each other at once each stage one chunk eagerly,
//!   then each holds its last free block back as the reserve and grants
//!   nothing: both requests wait for a GRANT until their timeout (a
//!   liveness bug in a fault-free run). Here eager staging also leaves one
//!   max-size block free beside the reserve
//!   ([`Mutations::legacy_eager_reserve`] restores the old rule).
//! * **A GRANT or ACK sent restarts the flow's silence clock.** `Io`
//!   reclaims a receiver flow silent for twice the request timeout,
//!   counting only WANT and DATA received. But every GRANT restarts the
//!   sender's no-progress clock, so a sender may legitimately write a
//!   region more than 2 × timeout after its WANT (its first grant came
//!   late under backpressure): the receiver then frees that region under
//!   the landing write. Here the receiver's own GRANTs and ACKs count as
//!   activity ([`Mutations::legacy_flow_silence`] restores the old rule).
//!   The silent-flow sweep re-checks each flow before reclaiming it:
//!   reclaiming one silent flow frees regions that are granted at once,
//!   possibly to the next flow on the list, which `Io`'s sweep then
//!   reclaims right after its GRANT left ([`Mutations::legacy_silence_sweep`]).
//! * **A credit expires after the request timeout.** Even with the clock
//!   restarted by every GRANT and ACK, sender-local progress (a gather
//!   done, a write landed whose DATA was lost) keeps a request alive
//!   without the receiver hearing of it, so `Io` may post a write into a
//!   region more than 2 × timeout after its GRANT — after the receiver
//!   reclaimed the silent flow and re-granted the region. Here a chunk whose
//!   credit arrived more than one request timeout ago is not written: the
//!   request fails ([`Mutations::legacy_credit_expiry`] restores the old
//!   rule). With this, a write lands before the reclaim whenever one
//!   control message plus one write take less than the request timeout
//!   (the stated timing assumption, docs/protocol.md).
//!
//! * **A WANT for a live or recently ended flow is dropped.** `Io` hands
//!   every WANT to the scheduler, which appends to a live flow or creates
//!   the flow anew. A replayed WANT arriving after its flow was reclaimed
//!   (say the sender crashed and was forgotten) re-creates the flow and
//!   re-grants the same regions; a stale DATA of the dead sender still in
//!   the network then matches a fresh grant and is scattered — from a
//!   region another flow's data was written to. Here the receiver keeps
//!   ended flows (finished, cancelled — even before their WANT arrived —,
//!   reclaimed, forgotten) for 2 × the request timeout (memory: one key per
//!   flow ended in that window) and drops a WANT for one of them, or for a
//!   live flow ([`Mutations::no_flow_tombstones`] restores the old rule).
//!
//! The first two and the last cannot happen over today's channels (ZMQ and TCP deliver each
//! message once, in order, per peer); all three are cheap defence against a
//! peer or channel that replays.
//!
//! * **`ForgetScope` drops the scope's queued scatters** (engine scopes;
//!   over any channel). `Io::forget_scope` (and the machine as first
//!   written) closes the scope and REJECTs its flows but leaves their DATA
//!   already accepted and waiting for a copy context in the scatter queue: those scatters start after the detach,
//!   into the pool of an engine that is gone (the pool is only being
//!   drained; the engine may already use that memory again under a new
//!   session), and are ACKed. Here they are dropped at `ForgetScope` like
//!   failed scatters (region freed — its write is terminal —, no ACK);
//!   running scatters finish and the pool's quiesce waits for them
//!   ([`Mutations::legacy_forget_scope_queue`] restores the old rule).

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::plan::ChunkBound;
use crate::scheduler::{CreditScheduler, GrantPolicy};
use crate::wire::{
    Ack, Credit, Data, DataBlocks, DataUniform, Grant, Message, Reject, RejectReason, Want,
};
use crate::{FlowKey, ScatterList};

/// Virtual or real time in nanoseconds from an origin the caller picks.
pub type Nanos = u64;

/// Rules that can be switched off (or back to an older form) to prove the
/// simulator catches their absence (issue 17 "mutation check"). All `false`
/// in production: [`Mutations::default`]. Never set them outside tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mutations {
    /// Free the staging of a failed request's running gathers and in-flight
    /// writes at once instead of when the gather / write is terminal (seed
    /// §9 "in-flight write on the failure path", send-side orphans).
    pub no_orphan_deferral: bool,
    /// Scatter DATA even when its flow does not hold the region (seed §9
    /// late-DATA guard, `held_by_flow`).
    pub no_held_by_flow_validation: bool,
    /// Send a failed request's cancel at once even while its writes are in
    /// flight (the cancel/write race of issue 17).
    pub no_cancel_deferral: bool,
    /// Drop the bidirectional reserve: grant the whole arena to remote
    /// flows even while this agent has requests of its own to stage.
    pub no_bidirectional_reserve: bool,
    /// `Io::on_grant`'s rule: attach credits in arrival order, whatever
    /// chunk they name (see the module docs, "Deviations").
    pub unkeyed_credits: bool,
    /// `Io::on_data`'s rule: accept DATA for any region the flow holds,
    /// whatever chunk it names (see "Deviations").
    pub unchecked_data_chunk: bool,
    /// `Io::pump`'s eager rule: eager staging may take every block but the
    /// reserve (see "Deviations": two agents sending to each other over
    /// two-block arenas then wait on each other's grants forever).
    pub legacy_eager_reserve: bool,
    /// `Io`'s flow-silence clock: refreshed only by WANT and DATA received,
    /// not by the receiver's own GRANTs and ACKs (see "Deviations").
    pub legacy_flow_silence: bool,
    /// `Io`'s rule: a credit never expires (see "Deviations": the sender
    /// may write a region later than the receiver's silence reclaim).
    pub legacy_credit_expiry: bool,
    /// `Io`'s rule: a WANT for a flow that is live or just ended is
    /// accepted (appended, or the flow re-created; see "Deviations").
    pub no_flow_tombstones: bool,
    /// The silent-flow sweep as in `Io::check_timeouts`: the list is made
    /// once and every flow on it reclaimed, even one granted to while the
    /// sweep reclaimed the others (see "Deviations").
    pub legacy_silence_sweep: bool,
    /// `ForgetScope` reclaims the scope's flows at once (frees their
    /// regions) instead of leaving that to the sender's cancel: a write
    /// still in flight then lands in a freed, perhaps re-granted region.
    /// The unsafe form the engine-scope rules avoid; only the simulator's
    /// mutation check sets it.
    pub reclaim_on_forget_scope: bool,
    /// Validate every flow's DATA against the agent's own ranges and every
    /// open scope's (the union, wire version 1's rule) instead of the
    /// flow's own scope: a flow of one engine may scatter into another
    /// engine's pool (or one re-opened over a detached engine's range).
    pub unscoped_data_validation: bool,
    /// The rule of commit 8ae585e (and `Io::forget_scope` today):
    /// `ForgetScope` leaves the scope's queued, not started scatters in
    /// the queue, so they start after the scope closed — into the pool of
    /// an engine that detached — and are ACKed (see "Deviations").
    pub legacy_forget_scope_queue: bool,
    /// Check a DATA_UNIFORM's or DATA_BLOCKS' structure and region bounds
    /// but not each piece's destination (issue 18 step 3): a peer's pieces
    /// land anywhere. Only the simulator's mutation check sets it.
    pub unchecked_uniform_dsts: bool,
}

/// Settings of one machine (the subset of `BounceConfig` the protocol
/// uses, plus what the reactor knows of its arena).
#[derive(Clone, Debug)]
pub struct Config {
    /// Arena size (bytes).
    pub arena_bytes: u64,
    /// Buddy minimum block (bytes, a power of two).
    pub granularity_bytes: u64,
    /// Per-chunk cap (bytes, ≤ the arena's max allocation).
    pub max_chunk_size_bytes: u64,
    /// Per-flow in-flight cap W (chunks, ≥ 1).
    pub max_inflight_chunks: usize,
    /// Copy contexts: gathers and scatters running at once (≥ 1).
    pub copy_contexts: usize,
    /// No-progress timeout of a request (ns); a receiver flow silent for
    /// twice this long is reclaimed; an orphaned write this old has its
    /// deferred cancel sent anyway.
    pub request_timeout: Nanos,
    /// Stage gathers before a GRANT arrives (seed §2).
    pub eager_gather: bool,
    /// Stage eager gathers in the order the receiver will grant them
    /// (config `eagerGrantOrder`, issue 18; a kvfabric rule, not the
    /// seed's): the sender mirrors each peer's [`GrantPolicy`] — its own
    /// `grant_policy`, which the operator rolls out to every agent — over
    /// its own requests (round-robin: the next chunk of each request in
    /// ring order from the one granted last; oldest first: the oldest
    /// request's chunks first; shortest first: by the sender's estimate of
    /// each request's rank, lowest first), and stages no eager gather while a credited
    /// chunk waits for staging. Off: the seed's rule, each request stages
    /// eagerly up to its window at submit and whenever it is pumped, so with
    /// many requests in flight the eager budget holds chunks the receiver
    /// grants a whole round later. Only which chunks are staged early
    /// changes; never what is written where.
    pub eager_grant_order: bool,
    /// Free a chunk's staging region once its write completed (config
    /// `releaseStagingOnWrite`, issue 18; a kvfabric rule): a completed write
    /// has landed at the target (seed §6: the status poll includes the
    /// endpoint flush), and nothing reads the staging after it (the DATA
    /// carries the scatter list; there is no retransmission). Off: the
    /// seed's rule, staging is held until the chunk's ACK, i.e. also over
    /// the DATA hop, the receiver's scatter and the ACK hop.
    pub release_staging_on_write: bool,
    /// Which flow the receiver grants next ([`GrantPolicy`]).
    pub grant_policy: GrantPolicy,
    /// Weight of a request's bytes in its rank under
    /// [`GrantPolicy::ShortestFirst`] (config `grantSizeWeight`; ≥ 1, 0 is
    /// taken as 1): the receiver ranks by it, a sender estimates the
    /// receiver's order with its own value.
    pub grant_size_weight: u64,
    /// Take DATA_UNIFORM (config `uniformData`, advertised as
    /// [`crate::wire::CAP_UNIFORM_DATA`]); off, one is refused like a DATA
    /// with invalid runs (no scatter, REJECT `InvalidRuns`).
    pub uniform_data: bool,
    /// Take DATA_BLOCKS (config `blockData`, advertised as
    /// [`crate::wire::CAP_BLOCK_DATA`]); off, one is refused like a DATA
    /// with invalid runs.
    pub block_data: bool,
    /// Arena base address (credits carry `base + offset`).
    pub arena_base: u64,
    /// Device id put into credits.
    pub device_id: i32,
    /// This agent's control endpoint, carried by every WANT and cancel.
    pub endpoint: Vec<u8>,
    /// Test-only rule switches (all off by default).
    pub mutations: Mutations,
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every chunk was written, scattered and ACKed.
    Success,
    /// Failed; the text names the cause.
    Failure(String),
}

/// Whether the control channel can answer a WANT's sender (decided by the
/// reactor, which owns the channel's routes; seed §5 reverse-path
/// bootstrap).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// A route to the sender existed or was just added from the WANT's
    /// endpoint.
    Usable,
    /// No route, and the WANT's endpoint could not make one: the WANT is
    /// rejected (a cancel is still honoured, seed §9).
    Unusable,
}

/// An event fed to [`Machine::handle`].
#[derive(Clone, Debug)]
pub enum Input {
    /// Submit request `rid` (unique per machine, never reused) to `peer`,
    /// its chunks already sized (`TransferPlan::chunk_bounds`). An empty
    /// list succeeds at once.
    Submit {
        /// Request id.
        rid: u64,
        /// Receiver peer name.
        peer: String,
        /// Destination scope carried in the WANT: the receiver-local id of
        /// the engine session written into, 0 for the receiver's own pool
        /// (issue 12, engine-scoped flows).
        scope: u64,
        /// The chunks, in order.
        chunks: Vec<ChunkBound>,
    },
    /// A decoded control message from `from` (untrusted: every field is
    /// validated, nothing in it can panic the machine).
    Message {
        /// Sending peer's name.
        from: String,
        /// The message.
        msg: Message,
        /// Route state for a WANT's sender (ignored for other messages).
        route: Route,
    },
    /// A sent message did not leave (unknown route, full queue). Only WANT
    /// and DATA failures matter (they fail their request, as in `Io`).
    SendFailed {
        /// Destination.
        to: String,
        /// The message that failed.
        msg: Message,
    },
    /// Gather job `job` finished: the chunk's scatter runs, or the error.
    GatherDone {
        /// Job id from [`Action::StartGather`].
        job: u64,
        /// The chunk's scatter as planned by the worker (runs, or the
        /// uniform form for a peer that takes it), or the failure.
        result: Result<ScatterList, String>,
    },
    /// Write `write` is terminal (engine SUCCESS, or FAILED / post error).
    WriteDone {
        /// Write id from [`Action::PostWrite`].
        write: u64,
        /// `Ok` on SUCCESS.
        result: Result<(), String>,
    },
    /// Write `write` could not be posted (the engine refused it
    /// synchronously): like a failed [`Input::WriteDone`], with `why` as
    /// the request's failure reason as it is.
    PostFailed {
        /// Write id from [`Action::PostWrite`].
        write: u64,
        /// The failure reason.
        why: String,
    },
    /// Scatter job `job` finished.
    ScatterDone {
        /// Job id from [`Action::StartScatter`].
        job: u64,
        /// `Ok` when every run was copied.
        result: Result<(), String>,
    },
    /// `peer` is a registered bounce receiver now (its route was added).
    PeerAdded {
        /// Peer name (incarnation included).
        peer: String,
    },
    /// Forget `peer` (seed §9 peer loss): fail requests to it, reclaim its
    /// flows, then [`Action::ForgetRoute`].
    PeerForgotten {
        /// Peer name.
        peer: String,
    },
    /// Scatters may write `[addr, addr + len)`.
    AllowScatter {
        /// Start address.
        addr: u64,
        /// Length (bytes).
        len: u64,
    },
    /// Open engine scope `scope` (≥ 1) with its pool `[addr, addr + len)`:
    /// WANTs naming it are served and their DATA scatters only there.
    AllowScope {
        /// Scope id (an engine session of this agent).
        scope: u64,
        /// Start address.
        addr: u64,
        /// Length (bytes).
        len: u64,
    },
    /// Close engine scope `scope` (its engine detached): its flows' DATA
    /// no longer scatters and their senders get a REJECT
    /// ([`crate::wire::RejectReason::ScopeDetached`]); the regions are
    /// freed by the sender's cancel. Later WANTs naming it are REJECTed.
    ForgetScope {
        /// Scope id.
        scope: u64,
    },
    /// Take `[addr, addr + len)` out of the allowed ranges; [`Action::Quiesced`]
    /// with `id` once no queued or running scatter writes into it.
    DisallowScatter {
        /// Caller's id for the answer.
        id: u64,
        /// Start address.
        addr: u64,
        /// Length (bytes).
        len: u64,
    },
    /// Like `DisallowScatter` without taking the range out.
    QuiesceScatter {
        /// Caller's id for the answer.
        id: u64,
        /// Start address.
        addr: u64,
        /// Length (bytes).
        len: u64,
    },
    /// Fail request `rid` with `why` (no-op when not in flight).
    Cancel {
        /// Request id.
        rid: u64,
        /// Reason.
        why: String,
    },
    /// Time passed: request timeouts, flow silence, overdue orphan writes.
    Tick,
    /// Stop: every request fails ("transport shut down"); messages and
    /// submits are refused from now on; copies and writes still complete.
    Shutdown,
    /// After a shutdown, the reactor stopped waiting for writes: the ones
    /// still in flight are given up ([`Action::ArenaInDoubt`]).
    AbandonInFlight,
}

/// What the machine asks the reactor to do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `msg` to `to` (best effort; report a failure of WANT / DATA as
    /// [`Input::SendFailed`]).
    Send {
        /// Destination peer.
        to: String,
        /// The message.
        msg: Message,
    },
    /// Gather chunk `chunk` of request `rid` into the staging region at
    /// arena offset `local` (`bound.packed_bytes` bytes); report
    /// [`Input::GatherDone`] with `job`.
    StartGather {
        /// Job id.
        job: u64,
        /// Request id.
        rid: u64,
        /// Chunk index.
        chunk: u32,
        /// Staging offset in the arena (bytes).
        local: u64,
        /// The chunk's bound (which descriptors).
        bound: ChunkBound,
    },
    /// Post an RDMA write of `bytes` bytes from staging offset `local` to
    /// `peer`'s region `credit` (`credit.addr`); poll it and report
    /// [`Input::WriteDone`] with `write` once terminal.
    PostWrite {
        /// Write id.
        write: u64,
        /// Destination peer.
        peer: String,
        /// Request id.
        rid: u64,
        /// Chunk index.
        chunk: u32,
        /// Staging offset (bytes).
        local: u64,
        /// Bytes to write (the chunk's packed size).
        bytes: u64,
        /// The receiver's credit.
        credit: Credit,
    },
    /// Scatter the region at arena offset `region` with `runs`; report
    /// [`Input::ScatterDone`] with `job`.
    StartScatter {
        /// Job id.
        job: u64,
        /// The flow whose chunk it is.
        flow: FlowKey,
        /// Region offset (bytes).
        region: u64,
        /// Chunk index.
        chunk: u32,
        /// The validated scatter (runs, or the uniform form).
        runs: ScatterList,
    },
    /// The staging region at `local` went back to the arena (informational:
    /// the reactor has nothing to free).
    ReleaseStaging {
        /// Staging offset (bytes).
        local: u64,
    },
    /// Resolve request `rid`'s handle.
    Resolve {
        /// Request id.
        rid: u64,
        /// How it ended.
        outcome: Outcome,
        /// Failed by the no-progress timeout.
        timed_out: bool,
    },
    /// Drop the control route and engine state of `peer`.
    ForgetRoute {
        /// Peer name.
        peer: String,
    },
    /// Answer to a disallow / quiesce request: no queued or running scatter
    /// writes into its range any more.
    Quiesced {
        /// The caller's id.
        id: u64,
    },
    /// Writes that read the arena were still in flight when given up: the
    /// arena's memory must not be freed or reused.
    ArenaInDoubt {
        /// Writes given up.
        writes: usize,
    },
}

/// A stage of a chunk of a traced request ([`Machine::set_traced`]): the
/// transitions the reactor records in a request's timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkStage {
    /// The chunk was gathered into its staging region.
    Gathered,
    /// Its write landed and its DATA is being sent.
    DataSent,
    /// Its ACK was accepted: the receiver scattered the chunk.
    Acked,
}

/// A note for the reactor that asks for nothing to be done for the
/// protocol's sake: timelines and wake-up hints. [`Machine::poll_action`]
/// skips them; [`Machine::poll`] returns them in order with the actions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// `stage` of chunk `chunk` of traced request `rid` happened now.
    Stage {
        /// Request id.
        rid: u64,
        /// Chunk index.
        chunk: u32,
        /// Which stage.
        stage: ChunkStage,
    },
    /// A receiver flow was accepted (its GRANTs are queued): DATA for up
    /// to `chunks` chunks may follow within a round trip (a hint to wake
    /// idle scatter workers early).
    FlowAccepted {
        /// Chunks of the flow that may scatter soon (≤ W).
        chunks: usize,
    },
}

/// One item of the machine's output queue ([`Machine::poll`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Perform this action.
    Action(Action),
    /// Take note (nothing to perform for the protocol).
    Event(Event),
}

/// Monotonic counters (the protocol-side subset of `TransportStats`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Requests resolved SUCCESS.
    pub succeeded: u64,
    /// Requests resolved FAILURE.
    pub failed: u64,
    /// Of which by the no-progress timeout.
    pub timeouts: u64,
    /// Payload bytes of successful requests.
    pub bytes_sent: u64,
    /// Writes that reached SUCCESS.
    pub chunks_written: u64,
    /// Credits sent in GRANTs.
    pub grants: u64,
    /// Chunks scattered and ACKed.
    pub chunks_scattered: u64,
    /// DATA dropped (late, invalid runs, duplicate).
    pub data_rejected: u64,
    /// WANTs rejected.
    pub wants_rejected: u64,
    /// Cancels received.
    pub cancels_received: u64,
    /// Credits dropped (unknown chunk, duplicate).
    pub credits_rejected: u64,
    /// Flows reclaimed for silence.
    pub silent_flows: u64,
    /// Orphaned writes whose cancel went out past the request timeout.
    pub overdue_orphans: u64,
    /// WANTs dropped as replays (flow live or recently ended).
    pub wants_stale: u64,
    /// REJECTs received for our requests.
    pub rejects_received: u64,
    /// REJECTs sent (unknown or detached scope, refused WANT).
    pub rejects_sent: u64,
    /// Ended flows forgotten early because the tombstone cap was reached
    /// ([`Machine::set_tombstone_policy`]).
    pub tombstones_evicted: u64,
    /// Sum over requests of the credit wait, submit → first GRANT (µs).
    pub credit_wait_us: u64,
}

/// A snapshot of the state sizes (for gauges, tests and the simulator's
/// quiesce check).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// Usable arena capacity (bytes).
    pub capacity: u64,
    /// Free arena bytes.
    pub free_bytes: u64,
    /// Live receiver flows.
    pub flows: usize,
    /// Sender requests in the table.
    pub requests: usize,
    /// Gather and scatter jobs running.
    pub jobs: usize,
    /// Writes in flight (live and orphaned).
    pub writes: usize,
    /// Orphaned writes and gathers of failed requests.
    pub send_orphans: usize,
    /// Receiver-side orphaned regions (reclaimed while scattering).
    pub recv_orphans: usize,
    /// Deferred cancels.
    pub deferred_cancels: usize,
    /// Granted region records.
    pub regions: usize,
    /// Queued scatters.
    pub scatter_queue: usize,
    /// Open disallow / quiesce requests.
    pub quiesce_waiting: usize,
    /// Requests waiting to retry their staging (starved).
    pub starved: usize,
    /// Requests in the peers' expected grant orders
    /// ([`Config::eager_grant_order`]).
    pub grant_order: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChunkState {
    Pending,
    Gathering(u64),
    Gathered,
    Writing(u64),
    DataSent,
    Acked,
}

#[derive(Debug)]
struct SendChunk {
    state: ChunkState,
    local: Option<u64>,
    eager: bool,
    credit: Option<Credit>,
    /// When the credit's GRANT arrived (ns).
    credit_at: Nanos,
    runs: ScatterList,
}

#[derive(Debug)]
struct SendRequest {
    peer: String,
    /// Destination scope named in the WANT.
    scope: u64,
    chunks: Vec<ChunkBound>,
    state: Vec<SendChunk>,
    /// Credits received and not attached: chunk index → credit (keyed), or
    /// arrival order under [`Mutations::unkeyed_credits`].
    credits: BTreeMap<u32, (Credit, Nanos)>,
    unkeyed: VecDeque<(Credit, Nanos)>,
    next_attach: usize,
    next_stage: usize,
    acked: usize,
    total_bytes: u64,
    last_progress: Nanos,
    /// When it was submitted (credit wait).
    submitted_at: Nanos,
    /// Whether a GRANT arrived yet (credit wait).
    first_grant: bool,
    /// Stage events are queued for it ([`Machine::set_traced`]).
    traced: bool,
    /// Its place in the peer's line under [`GrantPolicy::ShortestFirst`]
    /// as this sender estimates it: the bytes the peer granted this sender
    /// before the submit plus [`Config::grant_size_weight`] × the bytes
    /// the WANT asks for (0 under the other policies).
    grant_rank: u64,
}

/// What [`Machine::stage_next`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Staging {
    /// A gather was started.
    Started,
    /// No region, eager budget or copy context for the next chunk now.
    Starved,
    /// Nothing to stage: all staged, window full, or uncredited and not
    /// allowed eagerly.
    Stopped,
}

impl SendRequest {
    /// Chunks whose credit arrived (attached or not).
    fn granted(&self) -> usize {
        self.next_attach + self.credits.len() + self.unkeyed.len()
    }

    fn staged_unacked(&self) -> usize {
        self.state
            .iter()
            .filter(|c| {
                matches!(
                    c.state,
                    ChunkState::Gathering(_)
                        | ChunkState::Gathered
                        | ChunkState::Writing(_)
                        | ChunkState::DataSent
                )
            })
            .count()
    }
}

#[derive(Debug)]
enum Job {
    Gather {
        rid: u64,
        chunk: usize,
        local: u64,
    },
    OrphanGather {
        local: u64,
    },
    Scatter {
        flow: FlowKey,
        offset: u64,
        chunk: u32,
        dst: (u64, u64),
    },
}

#[derive(Debug)]
enum WriteRef {
    Live { rid: u64, chunk: usize },
    Orphan { local: u64, rid: u64, since: Nanos },
}

#[derive(Debug)]
struct RecvRegion {
    flow: FlowKey,
    len: u64,
    chunk: u32,
}

#[derive(Debug)]
struct PendingScatter {
    flow: FlowKey,
    offset: u64,
    chunk: u32,
    runs: ScatterList,
    dst: (u64, u64),
}

/// The header fields of a DATA or DATA_UNIFORM.
#[derive(Clone, Copy)]
struct DataRef {
    request_id: u64,
    chunk_index: u32,
    region_handle: u64,
}

/// One agent's protocol state (both roles). See the [module docs](self).
#[derive(Debug)]
pub struct Machine {
    cfg: Config,
    now: Nanos,
    scheduler: CreditScheduler,
    reserve_block: Option<u64>,
    exec_free: usize,
    peers: BTreeSet<String>,
    requests: BTreeMap<u64, SendRequest>,
    jobs: BTreeMap<u64, Job>,
    writes: BTreeMap<u64, WriteRef>,
    next_token: u64,
    regions: BTreeMap<u64, RecvRegion>,
    grant_index: BTreeMap<FlowKey, u32>,
    flow_seen: BTreeMap<FlowKey, Nanos>,
    /// Receiver flows that ended (finished, cancelled, reclaimed), kept
    /// for 2 × the request timeout: a replayed or late WANT must not bring
    /// one back (deviation, module docs).
    ended: BTreeSet<FlowKey>,
    ended_order: VecDeque<(Nanos, FlowKey)>,
    scatter_queue: VecDeque<PendingScatter>,
    deferred_cancels: BTreeMap<u64, (String, usize)>,
    allowed: Vec<(u64, u64)>,
    /// Engine scopes: scope → ranges its flows may scatter into.
    scopes: BTreeMap<u64, Vec<(u64, u64)>>,
    /// Destination scope of each live receiver flow (from its WANT).
    flow_scope: BTreeMap<FlowKey, u64>,
    quiesce: Vec<(u64, u64, u64)>,
    /// Something may have freed copy contexts, arena space or eager
    /// budget: retry the starved requests at the end of this input.
    parked: bool,
    /// Requests whose staging stopped for want of a copy context, arena
    /// space or eager budget (not for their window or a missing credit):
    /// the only ones a freed resource can move, retried oldest first.
    starved: BTreeSet<u64>,
    /// Per peer, this sender's requests that still have chunks the peer
    /// has not granted, in the order the peer is expected to grant them
    /// next (front first; [`Config::eager_grant_order`]).
    grant_order: BTreeMap<String, VecDeque<u64>>,
    /// Per peer, bytes (WANT chunk sizes) of the credits it granted this
    /// sender while the peer has a grant order: this sender's view of the
    /// peer's byte clock under [`GrantPolicy::ShortestFirst`] (the peer's
    /// counts every sender's grants; only the order among this sender's
    /// requests is estimated). Dropped with the peer's grant order, so
    /// never more entries than `grant_order`.
    grant_clock: BTreeMap<String, u64>,
    shut_down: bool,
    actions: VecDeque<Step>,
    counters: Counters,
    /// Most tombstones kept (oldest evicted first); `usize::MAX`: no cap.
    max_tombstones: usize,
    /// Tombstone a cancel for a flow this machine never had (the default).
    tombstone_unknown: bool,
    /// Peer-name buffers handed back by the reactor ([`Machine::recycle`]),
    /// reused for the names actions carry.
    spare_names: Vec<String>,
    /// Name used in log lines.
    log_name: String,
}

/// A uniform or block scatter's region layout: the stride at least the
/// piece length, the last piece ending (`end`, `None` on overflow) inside
/// the granted `region_len` bytes. Pieces then do not overlap in the
/// region, so their total is below the region end too.
fn check_piece_layout(
    segment_len: u64,
    region_stride: u64,
    end: Option<u64>,
    region_len: u64,
) -> Result<(), String> {
    if region_stride < segment_len {
        return Err(format!(
            "uniform scatter stride {region_stride} is below its piece length {segment_len}"
        ));
    }
    let end = end.ok_or("uniform scatter overflows")?;
    if end > region_len {
        return Err(format!(
            "uniform scatter ends at region byte {end}, beyond the granted {region_len} bytes"
        ));
    }
    Ok(())
}

/// Whether one of `allowed` (start, len) holds `[lo, end)`.
fn in_one_range(allowed: &[(u64, u64)], lo: u64, end: u64) -> bool {
    allowed
        .iter()
        .any(|&(a, l)| lo >= a && end <= a.saturating_add(l))
}

/// Every piece `[dsts[k], dsts[k] + len)` inside one of `allowed`, else
/// the first outside named (`outside(what, start, end)`). Keeps the last
/// range that held a piece and tries it first.
fn check_pieces(
    allowed: &[(u64, u64)],
    dsts: &[u64],
    len: u64,
    outside: impl Fn(String, u64, u64) -> String,
) -> Result<(), String> {
    let mut last = 0usize;
    for (k, &a) in dsts.iter().enumerate() {
        let e = a
            .checked_add(len)
            .ok_or_else(|| format!("piece {k} destination overflows"))?;
        let fits = |&(lo, l): &(u64, u64)| a >= lo && e <= lo.saturating_add(l);
        if allowed.get(last).is_some_and(fits) {
            continue;
        }
        match allowed.iter().position(fits) {
            Some(p) => last = p,
            None => return Err(outside(format!("piece {k}"), a, e)),
        }
    }
    Ok(())
}

/// Destination bounds [start, end) of a scatter ((0, 0) for none).
fn scatter_bounds(list: &ScatterList) -> (u64, u64) {
    let mut lo = u64::MAX;
    let mut hi = 0u64;
    match list {
        ScatterList::Runs(runs) => {
            for r in runs {
                let end = u64::from(r.count.saturating_sub(1))
                    .saturating_mul(r.addr_stride)
                    .saturating_add(r.addr)
                    .saturating_add(r.segment_len);
                lo = lo.min(r.addr);
                hi = hi.max(end);
            }
        }
        ScatterList::Uniform(u) => {
            for &a in &u.dsts {
                lo = lo.min(a);
                hi = hi.max(a.saturating_add(u.segment_len));
            }
        }
        // Validated scatters have bounds (no overflow).
        ScatterList::Blocks(b) => (lo, hi) = b.dst_bounds().unwrap_or((0, 0)),
    }
    if list.is_empty() {
        (0, 0)
    } else {
        (lo, hi)
    }
}

impl Machine {
    /// Builds a machine over a fresh arena.
    ///
    /// # Errors
    /// A text naming the arena / scheduler problem, or a chunk cap above
    /// the arena's max allocation (as `BounceTransport::start`).
    pub fn new(cfg: Config) -> Result<Self, String> {
        let scheduler = CreditScheduler::new(
            cfg.arena_bytes,
            cfg.granularity_bytes,
            cfg.max_inflight_chunks,
        )
        .map_err(|e| format!("bounce arena of {} bytes: {e}", cfg.arena_bytes))?
        .with_policy(cfg.grant_policy)
        .with_size_weight(cfg.grant_size_weight);
        if cfg.max_chunk_size_bytes > scheduler.max_allocation() {
            return Err(format!(
                "max chunk size {} bytes exceeds the arena's max allocation {} bytes",
                cfg.max_chunk_size_bytes,
                scheduler.max_allocation()
            ));
        }
        // One max-size block kept back for credit-backed local staging while
        // this agent sends; only when the arena holds at least two.
        let reserve_block = if cfg.mutations.no_bidirectional_reserve {
            None
        } else {
            scheduler
                .arena()
                .block_size(cfg.max_chunk_size_bytes)
                .filter(|&b| scheduler.capacity() >= 2 * b)
        };
        Ok(Self {
            exec_free: cfg.copy_contexts.max(1),
            cfg,
            now: 0,
            scheduler,
            reserve_block,
            peers: BTreeSet::new(),
            requests: BTreeMap::new(),
            jobs: BTreeMap::new(),
            writes: BTreeMap::new(),
            next_token: 1,
            regions: BTreeMap::new(),
            grant_index: BTreeMap::new(),
            flow_seen: BTreeMap::new(),
            ended: BTreeSet::new(),
            ended_order: VecDeque::new(),
            scatter_queue: VecDeque::new(),
            deferred_cancels: BTreeMap::new(),
            allowed: Vec::new(),
            scopes: BTreeMap::new(),
            flow_scope: BTreeMap::new(),
            quiesce: Vec::new(),
            parked: false,
            starved: BTreeSet::new(),
            grant_order: BTreeMap::new(),
            grant_clock: BTreeMap::new(),
            shut_down: false,
            actions: VecDeque::new(),
            counters: Counters::default(),
            max_tombstones: usize::MAX,
            tombstone_unknown: true,
            spare_names: Vec::new(),
            log_name: String::new(),
        })
    }

    /// Feeds one input at time `now` (ns); actions queue up for
    /// [`poll_action`](Self::poll_action).
    pub fn handle(&mut self, now: Nanos, input: Input) {
        self.now = self.now.max(now);
        let before = (
            self.exec_free,
            self.scheduler.free_bytes(),
            self.scheduler.eager_held_bytes(),
            self.scheduler.arena().largest_free_block(),
        );
        match input {
            Input::Submit {
                rid,
                peer,
                scope,
                chunks,
            } => self.on_submit(rid, peer, scope, chunks),
            Input::Message { from, msg, route } => {
                if !self.shut_down {
                    self.on_message(&from, msg, route);
                }
            }
            Input::SendFailed { to, msg } => self.on_send_failed(&to, &msg),
            Input::GatherDone { job, result } => self.on_gather_done(job, result),
            Input::WriteDone { write, result } => self.on_write_done(write, result, false),
            Input::PostFailed { write, why } => self.on_write_done(write, Err(why), true),
            Input::ScatterDone { job, result } => self.on_scatter_done(job, result),
            Input::PeerAdded { peer } => {
                self.peers.insert(peer);
            }
            Input::PeerForgotten { peer } => self.forget_peer(&peer),
            Input::AllowScatter { addr, len } => self.allowed.push((addr, len)),
            Input::AllowScope { scope, addr, len } => {
                if scope == 0 {
                    self.allowed.push((addr, len));
                } else {
                    self.scopes.entry(scope).or_default().push((addr, len));
                }
            }
            Input::ForgetScope { scope } => self.forget_scope(scope),
            Input::DisallowScatter { id, addr, len } => {
                let end = addr.saturating_add(len);
                let apart = |&(a, l): &(u64, u64)| a.saturating_add(l) <= addr || a >= end;
                self.allowed.retain(apart);
                for ranges in self.scopes.values_mut() {
                    ranges.retain(apart);
                }
                self.quiesce.push((id, addr, end));
            }
            Input::QuiesceScatter { id, addr, len } => {
                self.quiesce.push((id, addr, addr.saturating_add(len)));
            }
            Input::Cancel { rid, why } => self.fail_request(rid, why, false),
            Input::Tick => {
                self.check_timeouts();
                self.prune_tombstones();
            }
            Input::Shutdown => self.shutdown(),
            Input::AbandonInFlight => self.abandon_in_flight(),
        }
        // The end of an `Io` tick: queued scatters take freed contexts,
        // starved requests retry, quiesce requests are answered.
        self.drain_scatter_queue();
        // Totals are not enough: a free that merges buddies into a larger
        // block while an equal-sized one is taken elsewhere leaves the
        // free bytes unchanged, so the largest free block counts too.
        let freed = self.exec_free > before.0
            || self.scheduler.free_bytes() > before.1
            || self.scheduler.eager_held_bytes() < before.2
            || self.scheduler.arena().largest_free_block() > before.3;
        let retry = std::mem::take(&mut self.parked) || freed;
        if retry && !self.starved.is_empty() {
            self.retry_starved();
        }
        if retry && self.eager_by_grant_order() {
            self.stage_eager();
        }
        self.answer_quiesce();
    }

    /// The next queued action, oldest first ([`Event`]s are skipped).
    pub fn poll_action(&mut self) -> Option<Action> {
        loop {
            match self.actions.pop_front()? {
                Step::Action(a) => return Some(a),
                Step::Event(_) => {}
            }
        }
    }

    /// The next queued action or event, oldest first.
    pub fn poll(&mut self) -> Option<Step> {
        self.actions.pop_front()
    }

    /// Caps the receiver's tombstones at `max` (the oldest is forgotten
    /// first, counted in [`Counters::tombstones_evicted`]) and says whether
    /// a cancel naming a flow this machine never had leaves one. The
    /// default — no cap, unknown cancels tombstoned — guards against a
    /// cancel overtaking its WANT (the simulator's reordering network);
    /// the runtime, whose channels deliver in order per peer, keeps none
    /// for an unknown flow (any peer could make it hold memory) and caps
    /// them (`MAX_TOMBSTONES`).
    pub fn set_tombstone_policy(&mut self, max: usize, tombstone_unknown_cancels: bool) {
        self.max_tombstones = max.max(1);
        self.tombstone_unknown = tombstone_unknown_cancels;
    }

    /// Marks request `rid` traced: its chunks' [`ChunkStage`]s are queued
    /// as [`Event::Stage`].
    pub fn set_traced(&mut self, rid: u64) {
        if let Some(r) = self.requests.get_mut(&rid) {
            r.traced = true;
        }
    }

    /// The name put into this machine's log lines.
    pub fn set_log_name(&mut self, name: &str) {
        self.log_name = name.to_string();
    }

    /// Hands back a peer-name `String` taken from an action, so the next
    /// action's name reuses its buffer (no allocation per chunk).
    #[inline]
    pub fn recycle(&mut self, mut name: String) {
        if self.spare_names.len() < 64 {
            name.clear();
            self.spare_names.push(name);
        }
    }

    /// `name` as an owned `String`, in a recycled buffer when there is one.
    #[inline]
    fn owned_name(&mut self, name: &str) -> String {
        match self.spare_names.pop() {
            Some(mut b) => {
                b.push_str(name);
                b
            }
            None => name.to_string(),
        }
    }

    fn push(&mut self, action: Action) {
        self.actions.push_back(Step::Action(action));
    }

    fn stage(&mut self, rid: u64, chunk: usize, stage: ChunkStage) {
        self.actions.push_back(Step::Event(Event::Stage {
            rid,
            chunk: chunk as u32,
            stage,
        }));
    }

    /// Whether anything is in flight: requests, granted regions, copy jobs
    /// or queued scatters (the reactor's busy-poll condition).
    pub fn is_busy(&self) -> bool {
        !self.requests.is_empty()
            || !self.regions.is_empty()
            || !self.jobs.is_empty()
            || !self.scatter_queue.is_empty()
    }

    /// Sender requests in flight.
    pub fn request_count(&self) -> usize {
        self.requests.len()
    }

    /// Chunks of in-flight requests staged and not yet ACKed (gathering,
    /// gathered, writing or DATA sent).
    pub fn chunks_in_flight(&self) -> usize {
        self.requests
            .values()
            .map(|r| r.next_stage.saturating_sub(r.acked))
            .sum()
    }

    /// Peers with a live receiver flow here (WANT seen, last ACK not
    /// sent, not reclaimed): O(flows).
    pub fn flow_peers(&self) -> std::collections::HashSet<&str> {
        self.scheduler.flow_peers()
    }

    /// Live receiver flows of engine scope `scope` (those a
    /// [`Input::ForgetScope`] tells).
    pub fn flows_in_scope(&self, scope: u64) -> usize {
        self.flow_scope
            .iter()
            .filter(|(f, s)| **s == scope && self.scheduler.contains_flow(f))
            .count()
    }

    /// The bound of chunk `chunk` of in-flight request `rid`.
    pub fn chunk_bound(&self, rid: u64, chunk: u32) -> Option<&ChunkBound> {
        self.requests.get(&rid)?.chunks.get(chunk as usize)
    }

    /// The latest time (ns) at which [`Input::Tick`] must be fed: the
    /// earliest request timeout, flow silence or overdue orphan write
    /// (`None` when nothing waits on time). A timeout fires strictly after
    /// its bound, so this is bound + 1.
    ///
    /// O(requests + flows): a caller that must not scan after every input
    /// keeps [`Self::keepable_deadline`] instead.
    pub fn next_deadline(&self) -> Option<Nanos> {
        let t = self.cfg.request_timeout;
        let reqs = self.requests.values().map(|r| r.last_progress);
        let flows = self.flow_seen.values().map(|&s| s.saturating_add(t));
        let orphans = self.writes.values().filter_map(|w| match w {
            WriteRef::Orphan { rid, since, .. } if self.deferred_cancels.contains_key(rid) => {
                Some(*since)
            }
            _ => None,
        });
        reqs.chain(flows)
            .chain(orphans)
            .min()
            .map(|x| x.saturating_add(t).saturating_add(1))
    }

    /// A deadline the caller may keep until it passes, feeding `Tick`
    /// then (which may find nothing due yet) and asking again: the earlier
    /// of [`Self::next_deadline`] and one request timeout + 1 after the
    /// last input. Every clock an input starts or restarts is set to that
    /// input's time, and the shortest bound is one request timeout (flow
    /// silence is two), so no later input makes the machine's deadline
    /// earlier than this (the simulator checks it). Used by the runtime's
    /// reactor, which asked [`Self::next_deadline`] after every input
    /// before (issue 18: O(requests + flows) each, 128 requests in flight).
    pub fn keepable_deadline(&self) -> Option<Nanos> {
        let cap = self
            .now
            .saturating_add(self.cfg.request_timeout)
            .saturating_add(1);
        self.next_deadline().map(|d| d.min(cap))
    }

    /// Whether request `rid` is in flight (submitted, not resolved).
    pub fn has_request(&self, rid: u64) -> bool {
        self.requests.contains_key(&rid)
    }

    /// When request `rid` last progressed (ns), if in flight.
    pub fn last_progress(&self, rid: u64) -> Option<Nanos> {
        self.requests.get(&rid).map(|r| r.last_progress)
    }

    /// The credit scheduler (read-only: conservation checks, accounting).
    pub fn scheduler(&self) -> &CreditScheduler {
        &self.scheduler
    }

    /// Counters so far.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Whether [`Input::Shutdown`] was fed.
    pub fn is_shut_down(&self) -> bool {
        self.shut_down
    }

    /// State sizes now.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            capacity: self.scheduler.capacity(),
            free_bytes: self.scheduler.free_bytes(),
            flows: self.scheduler.flow_count(),
            requests: self.requests.len(),
            jobs: self.jobs.len(),
            writes: self.writes.len(),
            send_orphans: self
                .writes
                .values()
                .filter(|w| matches!(w, WriteRef::Orphan { .. }))
                .count()
                + self
                    .jobs
                    .values()
                    .filter(|j| matches!(j, Job::OrphanGather { .. }))
                    .count(),
            recv_orphans: self.scheduler.orphan_count(),
            deferred_cancels: self.deferred_cancels.len(),
            regions: self.regions.len(),
            scatter_queue: self.scatter_queue.len(),
            quiesce_waiting: self.quiesce.len(),
            starved: self.starved.len(),
            grant_order: self.grant_order.values().map(VecDeque::len).sum(),
        }
    }

    fn token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    fn send(&mut self, to: &str, msg: Message) {
        let to = self.owned_name(to);
        self.push(Action::Send { to, msg });
    }

    fn release_local(&mut self, local: u64) {
        if self.scheduler.release_local(local).is_ok() {
            self.push(Action::ReleaseStaging { local });
        }
    }

    /// Drops request `rid` (just removed from `requests`, to `peer`) from
    /// the starved set and its peer's expected grant order.
    fn forget_request(&mut self, rid: u64, peer: &str) {
        self.starved.remove(&rid);
        if let Some(ring) = self.grant_order.get_mut(peer) {
            if let Some(p) = ring.iter().position(|&r| r == rid) {
                ring.remove(p);
            }
            if ring.is_empty() {
                self.grant_order.remove(peer);
                self.grant_clock.remove(peer);
            }
        }
    }

    fn resolve(&mut self, rid: u64, outcome: Outcome, timed_out: bool) {
        match outcome {
            Outcome::Success => self.counters.succeeded += 1,
            Outcome::Failure(_) => self.counters.failed += 1,
        }
        self.push(Action::Resolve {
            rid,
            outcome,
            timed_out,
        });
    }

    // ---------------------------------------------------------- sender role

    fn on_submit(&mut self, rid: u64, peer: String, scope: u64, chunks: Vec<ChunkBound>) {
        if self.shut_down || self.requests.contains_key(&rid) {
            let why = if self.shut_down {
                "transport shut down".to_string()
            } else {
                format!("request id {rid} is already in flight")
            };
            // A duplicate id must not touch the live request's state.
            return self.resolve(rid, Outcome::Failure(why), false);
        }
        if !self.peers.contains(&peer) {
            return self.resolve(
                rid,
                Outcome::Failure(format!("peer {peer:?} is not a registered bounce peer")),
                false,
            );
        }
        if chunks.is_empty() {
            return self.resolve(rid, Outcome::Success, false);
        }
        let total_bytes = chunks.iter().map(|c| c.payload_bytes).sum();
        let grant_rank = if self.cfg.grant_policy == GrantPolicy::ShortestFirst {
            let asked: u64 = chunks.iter().map(|c| c.packed_bytes).sum();
            let clock = self.grant_clock.get(&peer).copied().unwrap_or(0);
            clock.saturating_add(asked.saturating_mul(self.cfg.grant_size_weight.max(1)))
        } else {
            0
        };
        let want = Message::Want(Want {
            request_id: rid,
            scope,
            chunk_bytes: chunks.iter().map(|c| c.packed_bytes).collect(),
            endpoint: self.cfg.endpoint.clone(),
        });
        let to = peer.clone();
        let state = chunks
            .iter()
            .map(|_| SendChunk {
                state: ChunkState::Pending,
                local: None,
                eager: false,
                credit: None,
                credit_at: 0,
                runs: ScatterList::default(),
            })
            .collect();
        self.requests.insert(
            rid,
            SendRequest {
                peer,
                scope,
                chunks,
                state,
                credits: BTreeMap::new(),
                unkeyed: VecDeque::new(),
                next_attach: 0,
                next_stage: 0,
                acked: 0,
                total_bytes,
                last_progress: self.now,
                submitted_at: self.now,
                first_grant: false,
                traced: false,
                grant_rank,
            },
        );
        if self.eager_by_grant_order() {
            let ring = self.grant_order.entry(to.clone()).or_default();
            // Shortest first: after every request of lower or equal rank
            // (the peer's tie-break is arrival); else at the back.
            let at = if self.cfg.grant_policy == GrantPolicy::ShortestFirst {
                let requests = &self.requests;
                ring.iter()
                    .rposition(|r| requests.get(r).is_some_and(|q| q.grant_rank <= grant_rank))
                    .map_or(0, |p| p + 1)
            } else {
                ring.len()
            };
            ring.insert(at, rid);
        }
        // The eager gathers first, then the WANT: a control send can take
        // tens of µs (a loopback TCP write that wakes the receiver's IO
        // thread: 47 µs on the H200 host), and the gathers do not depend
        // on it (issue 18 step 3). Nothing the peer sends back can precede
        // the WANT.
        if self.eager_by_grant_order() {
            self.stage_eager();
        } else {
            self.pump(rid);
        }
        if self.requests.contains_key(&rid) {
            self.send(&to, want);
        }
    }

    /// Retries the starved requests, oldest first, while a copy context is
    /// free (staging needs one; a request that starves again goes back in
    /// the set). The former `Io` (and this machine until issue 18) re-pumped
    /// every request after every input once anything had parked: with 128
    /// requests in flight that was 128 pumps per input on the IO thread.
    ///
    /// A request whose next chunk could not get its staging region now
    /// (`CreditScheduler::can_acquire_local`) is skipped without a pump, so
    /// a retry costs O(1) per request still starved of arena space or
    /// eager budget.
    fn retry_starved(&mut self) {
        let rids: Vec<u64> = self.starved.iter().copied().collect();
        for rid in rids {
            if self.exec_free == 0 {
                break;
            }
            let Some(req) = self.requests.get(&rid) else {
                self.starved.remove(&rid);
                continue;
            };
            let i = req.next_stage;
            if i < req.chunks.len() {
                let credited = req.state[i].credit.is_some();
                if !self
                    .scheduler
                    .can_acquire_local(req.chunks[i].packed_bytes, !credited)
                {
                    continue;
                }
            }
            self.starved.remove(&rid);
            self.pump(rid);
        }
    }

    /// `Io::pump`: attach credits in chunk order, stage gathers within the
    /// window, post writes for gathered credited chunks.
    fn pump(&mut self, rid: u64) {
        let eager_ok = self.cfg.eager_gather;
        let unkeyed = self.cfg.mutations.unkeyed_credits;
        let by_grant_order = self.eager_by_grant_order();
        let Some(req) = self.requests.get_mut(&rid) else {
            return;
        };
        // 1. Attach credits (strict chunk order).
        while req.next_attach < req.chunks.len() {
            let credit = if unkeyed {
                req.unkeyed.pop_front()
            } else {
                req.credits.remove(&(req.next_attach as u32))
            };
            let Some((credit, at)) = credit else { break };
            let c = &mut req.state[req.next_attach];
            c.credit = Some(credit);
            c.credit_at = at;
            if c.eager {
                if let Some(off) = c.local {
                    let _ = self.scheduler.promote_local(off);
                }
                c.eager = false;
            }
            req.next_attach += 1;
        }
        // 2. Stage gathers within the window (eager ones too, unless
        // `stage_eager` orders them).
        let eager = eager_ok && !by_grant_order;
        let starved = loop {
            match self.stage_next(rid, eager) {
                Staging::Started => {}
                Staging::Starved => break true,
                Staging::Stopped => break false,
            }
        };
        if starved {
            self.starved.insert(rid);
        } else {
            self.starved.remove(&rid);
        }
        // 3. Post writes for gathered + credited chunks.
        let Some(req) = self.requests.get(&rid) else {
            return;
        };
        let ready: Vec<usize> = (0..req.next_attach)
            .filter(|&i| req.state[i].state == ChunkState::Gathered)
            .collect();
        for i in ready {
            if let Err(why) = self.post_chunk(rid, i) {
                self.fail_request(rid, why, false);
                return;
            }
        }
    }

    /// Starts the gather of request `rid`'s next unstaged chunk, if its
    /// window W allows and, for a chunk without a credit, `eager` is set
    /// (seed §5 `pump` step 2). Staging takes a local region — an
    /// uncredited one from the eager budget (≤ ½ arena), never the block
    /// kept for credited chunks nor the last block a remote flow could be
    /// granted beside it — and a copy context.
    ///
    /// Returns [`Staging::Started`], [`Staging::Starved`] (no region, eager
    /// budget or copy context now: a freed resource may change that) or
    /// [`Staging::Stopped`] (all staged, window full, uncredited and not
    /// `eager`, or no such request).
    fn stage_next(&mut self, rid: u64, eager: bool) -> Staging {
        let w = self.cfg.max_inflight_chunks;
        let legacy_eager = self.cfg.mutations.legacy_eager_reserve;
        let Some(req) = self.requests.get(&rid) else {
            return Staging::Stopped;
        };
        if req.next_stage >= req.chunks.len() || req.staged_unacked() >= w {
            return Staging::Stopped;
        }
        let i = req.next_stage;
        let credited = req.state[i].credit.is_some();
        if !credited && !eager {
            return Staging::Stopped;
        }
        let bound = req.chunks[i];
        let Some(local) = self.scheduler.acquire_local(bound.packed_bytes, !credited) else {
            return Staging::Starved;
        };
        if !credited {
            if let Some(b) = self.reserve_block {
                // Eager staging never takes the block kept for credited
                // chunks, nor (deviation, see the module docs) the last
                // block a remote flow could be granted beside it.
                let ok = if legacy_eager {
                    self.scheduler.arena().largest_free_block() >= b
                } else {
                    match self.scheduler.acquire_local(b, false) {
                        Some(hold) => {
                            let ok = self.scheduler.arena().largest_free_block() >= b;
                            let _ = self.scheduler.release_local(hold);
                            ok
                        }
                        None => false,
                    }
                };
                if !ok {
                    let _ = self.scheduler.release_local(local);
                    return Staging::Starved;
                }
            }
        }
        if self.exec_free == 0 {
            let _ = self.scheduler.release_local(local);
            return Staging::Starved;
        }
        self.exec_free -= 1;
        let job = self.next_token;
        self.next_token += 1;
        self.jobs.insert(
            job,
            Job::Gather {
                rid,
                chunk: i,
                local,
            },
        );
        let Some(req) = self.requests.get_mut(&rid) else {
            return Staging::Stopped;
        };
        let c = &mut req.state[i];
        c.state = ChunkState::Gathering(job);
        c.local = Some(local);
        c.eager = !credited;
        req.next_stage += 1;
        self.actions.push_back(Step::Action(Action::StartGather {
            job,
            rid,
            chunk: i as u32,
            local,
            bound,
        }));
        Staging::Started
    }

    /// Whether eager gathers are staged by [`Self::stage_eager`]
    /// ([`Config::eager_grant_order`]).
    fn eager_by_grant_order(&self) -> bool {
        self.cfg.eager_gather && self.cfg.eager_grant_order
    }

    /// Stages eager gathers in the order each peer is expected to grant
    /// them ([`Config::eager_grant_order`]), stopping at the first chunk
    /// that cannot be staged now, so the eager budget goes to the chunks
    /// granted soonest. Nothing is staged eagerly while a credited chunk
    /// waits for staging (`starved`): credited chunks come first.
    ///
    /// Round-robin (seed §5): the peer grants one region per flow per sweep
    /// and moves past the flow it granted, new flows joining just before
    /// that point, so the expected order is pass 0: the first ungranted
    /// chunk of each request in `grant_order` (front first), pass 1: the
    /// second, … Oldest first: every chunk of the front request, then the
    /// next request's. Peers are taken in name order and share the budget.
    /// O(requests looked at) per call; it returns at the first starved
    /// chunk.
    fn stage_eager(&mut self) {
        if !self.starved.is_empty() || self.grant_order.is_empty() {
            return;
        }
        // `stage_next` never touches the orders: walk them taken out.
        let orders = std::mem::take(&mut self.grant_order);
        for ring in orders.values() {
            if !self.stage_eager_in(ring) {
                break;
            }
        }
        self.grant_order = orders;
    }

    /// [`Self::stage_eager`] over one peer's expected grant order; false
    /// when a chunk starved (stop everywhere: the budget is shared).
    /// Round-robin: pass 0 walks the order from the front, later passes
    /// only the requests still in play (staged so far, window not full),
    /// so a call costs O(requests walked + passes × requests in play).
    fn stage_eager_in(&mut self, ring: &VecDeque<u64>) -> bool {
        if self.cfg.grant_policy != GrantPolicy::RoundRobin {
            for &rid in ring {
                loop {
                    match self.stage_next(rid, true) {
                        Staging::Started => {}
                        Staging::Starved => return false,
                        Staging::Stopped => break,
                    }
                }
            }
            return true;
        }
        let mut in_play: Vec<u64> = Vec::new();
        for &rid in ring {
            match self.eager_step(rid, 0) {
                Some(true) => in_play.push(rid),
                Some(false) => {}
                None => return false,
            }
        }
        let mut pass = 1;
        while !in_play.is_empty() {
            for rid in std::mem::take(&mut in_play) {
                match self.eager_step(rid, pass) {
                    Some(true) => in_play.push(rid),
                    Some(false) => {}
                    None => return false,
                }
            }
            pass += 1;
        }
        true
    }

    /// One request's turn in pass `pass` of a round-robin eager walk:
    /// stages its `pass + 1`-th ungranted chunk if that is its next one.
    /// `Some(true)`: staged or staged already, in play for the next pass;
    /// `Some(false)`: out (all chunks, or its window is full); `None`: a
    /// chunk starved.
    fn eager_step(&mut self, rid: u64, pass: usize) -> Option<bool> {
        let Some(req) = self.requests.get(&rid) else {
            return Some(false);
        };
        // Chunks staged once this pass's chunk is.
        let want = req.granted() + pass + 1;
        if want > req.chunks.len() || req.next_stage + 1 < want {
            // Done, or an earlier chunk is not staged (window full).
            return Some(false);
        }
        if req.next_stage + 1 == want {
            match self.stage_next(rid, true) {
                Staging::Started => {}
                Staging::Starved => return None,
                Staging::Stopped => return Some(false),
            }
        }
        Some(true)
    }

    fn post_chunk(&mut self, rid: u64, i: usize) -> Result<(), String> {
        let write = self.token();
        let Some(req) = self.requests.get_mut(&rid) else {
            return Ok(());
        };
        let c = &req.state[i];
        let (Some(credit), Some(local)) = (c.credit, c.local) else {
            return Ok(());
        };
        let bytes = req.chunks[i].packed_bytes;
        if credit.len < bytes {
            return Err(format!(
                "GRANT for chunk {i} is {} bytes, chunk needs {bytes}",
                credit.len
            ));
        }
        let age = self.now.saturating_sub(req.state[i].credit_at);
        if age > self.cfg.request_timeout && !self.cfg.mutations.legacy_credit_expiry {
            // The receiver may reclaim a region whose flow was silent for
            // 2 × timeout since this GRANT; a write posted later could land
            // after that (deviation, module docs).
            return Err(format!(
                "the GRANT for chunk {i} is {} ms old, past the request timeout",
                age / 1_000_000
            ));
        }
        req.state[i].state = ChunkState::Writing(write);
        self.writes.insert(write, WriteRef::Live { rid, chunk: i });
        let peer = match self.spare_names.pop() {
            Some(mut b) => {
                b.push_str(&req.peer);
                b
            }
            None => req.peer.clone(),
        };
        self.actions.push_back(Step::Action(Action::PostWrite {
            write,
            peer,
            rid,
            chunk: i as u32,
            local,
            bytes,
            credit,
        }));
        Ok(())
    }

    fn on_write_done(&mut self, write: u64, result: Result<(), String>, post_failed: bool) {
        match self.writes.remove(&write) {
            Some(WriteRef::Live { rid, chunk: i }) => {
                let Some(req) = self.requests.get_mut(&rid) else {
                    return;
                };
                if req.state[i].state != ChunkState::Writing(write) {
                    return;
                }
                match result {
                    Ok(()) => {
                        self.counters.chunks_written += 1;
                        req.state[i].state = ChunkState::DataSent;
                        req.last_progress = self.now;
                        let Some(credit) = req.state[i].credit else {
                            return;
                        };
                        // Landed at the target: nothing reads the staging
                        // any more (`release_staging_on_write`).
                        let staging = if self.cfg.release_staging_on_write {
                            req.state[i].local.take()
                        } else {
                            None
                        };
                        let data = match std::mem::take(&mut req.state[i].runs) {
                            ScatterList::Runs(runs) => Message::Data(Data {
                                request_id: rid,
                                chunk_index: i as u32,
                                region_handle: credit.region_handle,
                                runs,
                            }),
                            ScatterList::Uniform(scatter) => Message::DataUniform(DataUniform {
                                request_id: rid,
                                chunk_index: i as u32,
                                region_handle: credit.region_handle,
                                scatter,
                            }),
                            ScatterList::Blocks(scatter) => Message::DataBlocks(DataBlocks {
                                request_id: rid,
                                chunk_index: i as u32,
                                region_handle: credit.region_handle,
                                scatter,
                            }),
                        };
                        let traced = req.traced;
                        let to = match self.spare_names.pop() {
                            Some(mut b) => {
                                b.push_str(&req.peer);
                                b
                            }
                            None => req.peer.clone(),
                        };
                        if traced {
                            self.stage(rid, i, ChunkStage::DataSent);
                        }
                        self.push(Action::Send { to, msg: data });
                        if let Some(local) = staging {
                            self.release_local(local);
                            self.schedule_and_send();
                        }
                    }
                    Err(e) => {
                        // Terminal: the NIC no longer reads the staging.
                        req.state[i].state = ChunkState::Gathered;
                        let why = if post_failed {
                            e
                        } else {
                            format!("write of chunk {i} failed: {e}")
                        };
                        self.fail_request(rid, why, false);
                    }
                }
            }
            Some(WriteRef::Orphan { local, rid, .. }) => {
                self.release_local(local);
                self.orphan_write_settled(rid);
                self.parked = true;
                self.schedule_and_send();
            }
            None => {}
        }
    }

    fn on_send_failed(&mut self, to: &str, msg: &Message) {
        let (rid, what) = match msg {
            Message::Want(w) if !w.is_cancel() => (w.request_id, "could not send WANT".to_string()),
            Message::Data(d) => (
                d.request_id,
                format!("could not send DATA for chunk {}", d.chunk_index),
            ),
            Message::DataUniform(d) => (
                d.request_id,
                format!("could not send DATA for chunk {}", d.chunk_index),
            ),
            Message::DataBlocks(d) => (
                d.request_id,
                format!("could not send DATA for chunk {}", d.chunk_index),
            ),
            Message::Grant(g) => {
                // Count only credits that left: a GRANT that did not is
                // reclaimed with its flow by the silence timeout.
                self.counters.grants = self.counters.grants.saturating_sub(g.credits.len() as u64);
                return;
            }
            _ => return,
        };
        if self.requests.get(&rid).is_some_and(|r| r.peer == to) {
            self.fail_request(rid, what, false);
        }
    }

    fn on_grant(&mut self, peer: &str, g: Grant) {
        let unkeyed = self.cfg.mutations.unkeyed_credits;
        let Some(req) = self.requests.get_mut(&g.request_id) else {
            return; // late GRANT for a resolved request
        };
        if req.peer != peer {
            tracing::warn!(agent = %self.log_name, peer, rid = g.request_id, "GRANT from the wrong peer; ignored");
            return;
        }
        if !req.first_grant {
            req.first_grant = true;
            self.counters.credit_wait_us += self.now.saturating_sub(req.submitted_at) / 1_000;
        }
        req.last_progress = self.now;
        let n = req.chunks.len();
        let shortest_first = self.cfg.grant_policy == GrantPolicy::ShortestFirst;
        let mut granted_bytes = 0u64;
        for c in g.credits {
            if unkeyed {
                req.unkeyed.push_back((c, self.now));
                continue;
            }
            let i = c.chunk_index as usize;
            // A credit for a chunk already credited, or past the request,
            // is a replay or a forgery: never attach it to another chunk.
            if i >= n || i < req.next_attach || req.credits.contains_key(&c.chunk_index) {
                tracing::warn!(agent = %self.log_name, peer, rid = g.request_id, chunk = c.chunk_index, "duplicate or out-of-range credit; dropped");
                self.counters.credits_rejected += 1;
                continue;
            }
            if shortest_first {
                granted_bytes = granted_bytes.saturating_add(req.chunks[i].packed_bytes);
            }
            req.credits.insert(c.chunk_index, (c, self.now));
        }
        // Only while the peer has an expected grant order (its only
        // reader): the clock leaves with it, so it never outlives the
        // requests it orders (ranks are compared only among those).
        if granted_bytes > 0 && self.grant_order.contains_key(peer) {
            let clock = self.grant_clock.entry(peer.to_string()).or_default();
            *clock = clock.saturating_add(granted_bytes);
        }
        let done = req.granted() >= n;
        if self.eager_by_grant_order() {
            self.note_granted(peer, g.request_id, done);
        }
        self.pump(g.request_id);
    }

    /// Moves the expected grant order of `peer` past request `rid`, just
    /// granted ([`Config::eager_grant_order`]): round-robin, the peer
    /// grants the flow after it next; `done` (every chunk granted), it
    /// leaves the order.
    fn note_granted(&mut self, peer: &str, rid: u64, done: bool) {
        let round_robin = self.cfg.grant_policy == GrantPolicy::RoundRobin;
        let Some(ring) = self.grant_order.get_mut(peer) else {
            return;
        };
        let Some(p) = ring.iter().position(|&r| r == rid) else {
            return;
        };
        if round_robin {
            ring.rotate_left(p + 1);
            if done {
                ring.pop_back();
            }
        } else if done {
            ring.remove(p);
        }
    }

    fn on_ack(&mut self, peer: &str, a: Ack) {
        let rid = a.request_id;
        let Some(req) = self.requests.get_mut(&rid) else {
            return;
        };
        let i = a.chunk_index as usize;
        if req.peer != peer || i >= req.state.len() {
            return;
        }
        let c = &mut req.state[i];
        if c.state != ChunkState::DataSent
            || c.credit.map(|cr| cr.region_handle) != Some(a.region_handle)
        {
            return;
        }
        c.state = ChunkState::Acked;
        let local = c.local.take();
        req.acked += 1;
        req.last_progress = self.now;
        let done = req.acked == req.chunks.len();
        if req.traced {
            self.stage(rid, i, ChunkStage::Acked);
        }
        if let Some(local) = local {
            self.release_local(local);
        }
        if done {
            if let Some(req) = self.requests.remove(&rid) {
                self.counters.bytes_sent += req.total_bytes;
                self.forget_request(rid, &req.peer);
            }
            self.resolve(rid, Outcome::Success, false);
            self.parked = true;
        } else {
            self.pump(rid);
            // The ACK opened the request's window: with its staging gone
            // at the write (`release_staging_on_write`) nothing was freed,
            // so ask for the end-of-input retry that stages eagerly.
            self.parked |= self.eager_by_grant_order();
        }
        self.schedule_and_send();
    }

    /// `Io::fail_request`: resolve FAILURE now; cancel to the receiver,
    /// deferred while writes are in flight; staging freed at once where no
    /// gather / write uses it, else when they are terminal (seed §9).
    fn fail_request(&mut self, rid: u64, why: String, timed_out: bool) {
        let Some(req) = self.requests.remove(&rid) else {
            return;
        };
        self.forget_request(rid, &req.peer);
        tracing::warn!(agent = %self.log_name, peer = %req.peer, rid, reason = %why, "bounce request failed");
        let m = self.cfg.mutations;
        let in_flight = req
            .state
            .iter()
            .filter(|c| matches!(c.state, ChunkState::Writing(_)))
            .count();
        if in_flight == 0 || m.no_cancel_deferral {
            self.send_cancel(&req.peer, rid);
        } else {
            self.deferred_cancels
                .insert(rid, (req.peer.clone(), in_flight));
        }
        for c in &req.state {
            match c.state {
                ChunkState::Gathering(job) => {
                    if m.no_orphan_deferral {
                        self.jobs.insert(job, Job::OrphanGather { local: u64::MAX });
                        if let Some(local) = c.local {
                            self.release_local(local);
                        }
                    } else if let (Some(j), Some(local)) = (self.jobs.get_mut(&job), c.local) {
                        *j = Job::OrphanGather { local };
                    }
                }
                ChunkState::Writing(write) => {
                    let Some(local) = c.local else { continue };
                    if m.no_orphan_deferral {
                        self.release_local(local);
                        self.writes.insert(
                            write,
                            WriteRef::Orphan {
                                local: u64::MAX,
                                rid,
                                since: self.now,
                            },
                        );
                    } else {
                        self.writes.insert(
                            write,
                            WriteRef::Orphan {
                                local,
                                rid,
                                since: self.now,
                            },
                        );
                    }
                }
                ChunkState::Gathered | ChunkState::DataSent => {
                    if let Some(local) = c.local {
                        self.release_local(local);
                    }
                }
                ChunkState::Pending | ChunkState::Acked => {}
            }
        }
        if timed_out {
            self.counters.timeouts += 1;
        }
        self.resolve(rid, Outcome::Failure(why), timed_out);
        self.parked = true;
        self.schedule_and_send();
    }

    fn send_cancel(&mut self, peer: &str, rid: u64) {
        let cancel = Message::Want(Want {
            request_id: rid,
            scope: 0,
            chunk_bytes: Vec::new(),
            endpoint: self.cfg.endpoint.clone(),
        });
        self.send(peer, cancel);
    }

    fn orphan_write_settled(&mut self, rid: u64) {
        if let Some((peer, left)) = self.deferred_cancels.get_mut(&rid) {
            *left = left.saturating_sub(1);
            if *left == 0 {
                let peer = peer.clone();
                self.deferred_cancels.remove(&rid);
                self.send_cancel(&peer, rid);
            }
        }
    }

    fn on_gather_done(&mut self, job: u64, result: Result<ScatterList, String>) {
        let Some(j) = self.jobs.remove(&job) else {
            return;
        };
        self.exec_free += 1;
        match j {
            Job::Gather { rid, chunk, local } => {
                let live = self
                    .requests
                    .get(&rid)
                    .is_some_and(|r| r.state[chunk].state == ChunkState::Gathering(job));
                match result {
                    Ok(runs) if live => {
                        if let Some(req) = self.requests.get_mut(&rid) {
                            req.state[chunk].state = ChunkState::Gathered;
                            req.state[chunk].runs = runs;
                            req.last_progress = self.now;
                            if req.traced {
                                self.stage(rid, chunk, ChunkStage::Gathered);
                            }
                        }
                        self.pump(rid);
                    }
                    Ok(_) => self.release_local(local),
                    Err(e) => {
                        if live {
                            if let Some(req) = self.requests.get_mut(&rid) {
                                req.state[chunk].state = ChunkState::Gathered;
                            }
                            self.fail_request(rid, format!("gather of chunk {chunk}: {e}"), false);
                        } else {
                            self.release_local(local);
                        }
                    }
                }
            }
            Job::OrphanGather { local } => {
                if local != u64::MAX {
                    self.release_local(local);
                }
                self.parked = true;
                self.schedule_and_send();
            }
            Job::Scatter { .. } => {
                // A gather completion naming a scatter job: put it back
                // and take the context again (the reactor mixed ids up).
                self.jobs.insert(job, j);
                self.exec_free -= 1;
            }
        }
    }

    fn check_timeouts(&mut self) {
        let timeout = self.cfg.request_timeout;
        let now = self.now;
        let expired: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| now.saturating_sub(r.last_progress) > timeout)
            .map(|(rid, _)| *rid)
            .collect();
        for rid in expired {
            self.fail_request(
                rid,
                format!(
                    "no progress within the request timeout of {:?}",
                    std::time::Duration::from_nanos(timeout)
                ),
                true,
            );
        }
        // Orphaned writes still in flight past the timeout: cancel anyway
        // (staging stays held while the NIC may still read it).
        let overdue: Vec<u64> = self
            .writes
            .values()
            .filter_map(|w| match w {
                WriteRef::Orphan { rid, since, .. }
                    if now.saturating_sub(*since) > timeout
                        && self.deferred_cancels.contains_key(rid) =>
                {
                    Some(*rid)
                }
                _ => None,
            })
            .collect();
        for rid in overdue {
            if let Some((peer, _)) = self.deferred_cancels.remove(&rid) {
                tracing::warn!(agent = %self.log_name, rid, "orphaned write still in flight after the request timeout; cancelling anyway");
                self.counters.overdue_orphans += 1;
                self.send_cancel(&peer, rid);
            }
        }
        // Receiver side: drop records of finished flows, reclaim silent ones.
        let sched = &self.scheduler;
        self.flow_seen.retain(|f, _| sched.contains_flow(f));
        self.flow_scope.retain(|f, _| sched.contains_flow(f));
        let silent: Vec<FlowKey> = self
            .flow_seen
            .iter()
            .filter(|(_, t)| now.saturating_sub(**t) > timeout.saturating_mul(2))
            .map(|(f, _)| f.clone())
            .collect();
        let two_t = timeout.saturating_mul(2);
        for flow in silent {
            // Reclaiming one flow frees regions that the next sweep grants,
            // possibly to another flow of this list (restarting its clock):
            // re-check, or its fresh GRANT would point at a region freed
            // right after (deviation, module docs).
            let still = self
                .flow_seen
                .get(&flow)
                .is_some_and(|t| now.saturating_sub(*t) > two_t);
            if !still && !self.cfg.mutations.legacy_silence_sweep {
                continue;
            }
            tracing::warn!(agent = %self.log_name, flow = %flow, "flow silent for twice the request timeout; reclaiming its regions");
            self.counters.silent_flows += 1;
            self.flow_seen.remove(&flow);
            self.reclaim_flow(&flow);
        }
    }

    // -------------------------------------------------------- receiver role

    fn on_message(&mut self, from: &str, msg: Message, route: Route) {
        match msg {
            Message::Want(w) => self.on_want(from, w, route),
            Message::Grant(g) => self.on_grant(from, g),
            Message::Data(d) => self.on_data(
                from,
                d.request_id,
                d.chunk_index,
                d.region_handle,
                ScatterList::Runs(d.runs),
            ),
            Message::DataUniform(d) => self.on_data(
                from,
                d.request_id,
                d.chunk_index,
                d.region_handle,
                ScatterList::Uniform(d.scatter),
            ),
            Message::DataBlocks(d) => self.on_data(
                from,
                d.request_id,
                d.chunk_index,
                d.region_handle,
                ScatterList::Blocks(d.scatter),
            ),
            Message::Ack(a) => self.on_ack(from, a),
            Message::Reject(r) => self.on_reject(from, r),
            // Handshakes never travel here; notices are the reactor's.
            Message::Handshake(_) | Message::Notice(_) => {}
        }
    }

    fn on_want(&mut self, peer: &str, w: Want, route: Route) {
        let flow = FlowKey::new(peer, w.request_id);
        if w.is_cancel() {
            // Honoured even without a route (reclaims earlier state).
            self.counters.cancels_received += 1;
            self.reclaim_flow(&flow);
            return;
        }
        if route == Route::Unusable {
            tracing::warn!(agent = %self.log_name, peer, rid = w.request_id, "WANT with an unusable endpoint; rejected");
            self.counters.wants_rejected += 1;
            return;
        }
        if !self.cfg.mutations.no_flow_tombstones {
            self.prune_tombstones();
            // A sender sends one WANT per request: another one for a live
            // or recently ended flow is a replay.
            if self.ended.contains(&flow) || self.scheduler.contains_flow(&flow) {
                tracing::warn!(agent = %self.log_name, peer, rid = w.request_id, "WANT for a live or recently ended flow; dropped as a replay");
                self.counters.wants_stale += 1;
                return;
            }
        }
        if w.scope != 0 && !self.scopes.contains_key(&w.scope) {
            // The destination engine is not attached: refuse at once.
            tracing::warn!(agent = %self.log_name, peer, rid = w.request_id, scope = w.scope, "WANT for an engine scope that is not attached; rejected");
            self.counters.wants_rejected += 1;
            self.send_reject(peer, w.request_id, RejectReason::UnknownScope);
            return;
        }
        let live = self.scheduler.contains_flow(&flow);
        if let Err(e) = self.scheduler.on_want(flow.clone(), &w.chunk_bytes) {
            tracing::warn!(agent = %self.log_name, peer, rid = w.request_id, error = %e, "WANT rejected");
            self.counters.wants_rejected += 1;
            if !live {
                self.send_reject(peer, w.request_id, RejectReason::Refused);
            }
            return;
        }
        self.flow_seen.insert(flow.clone(), self.now);
        self.flow_scope.insert(flow, w.scope);
        self.schedule_and_send();
        // DATA for this flow follows within a control round trip.
        self.actions.push_back(Step::Event(Event::FlowAccepted {
            chunks: w.chunk_bytes.len().min(self.cfg.max_inflight_chunks),
        }));
    }

    fn send_reject(&mut self, peer: &str, rid: u64, reason: RejectReason) {
        self.counters.rejects_sent += 1;
        self.send(
            peer,
            Message::Reject(Reject {
                request_id: rid,
                reason,
            }),
        );
    }

    /// Closes `scope`: its flows' DATA stops scattering, their senders get
    /// a REJECT (the regions go with the sender's cancel).
    fn forget_scope(&mut self, scope: u64) {
        self.scopes.remove(&scope);
        let flows: Vec<FlowKey> = self
            .flow_scope
            .iter()
            .filter(|(f, s)| **s == scope && self.scheduler.contains_flow(f))
            .map(|(f, _)| f.clone())
            .collect();
        if !self.cfg.mutations.legacy_forget_scope_queue {
            // DATA accepted before the detach whose scatter has not started
            // must not start now: the pool is no longer that engine's (it
            // is being unmapped, and another engine may map the range
            // next). Drop it as a failed scatter would end: the region is
            // freed (its write is terminal: DATA follows the write), no
            // ACK (deviation, module docs). Running scatters finish; the
            // reactor's quiesce of the pool waits for them.
            let in_scope: BTreeSet<&FlowKey> = flows.iter().collect();
            let mut dropped = Vec::new();
            self.scatter_queue.retain(|s| {
                let keep = !in_scope.contains(&s.flow);
                if !keep {
                    dropped.push((s.flow.clone(), s.offset));
                }
                keep
            });
            for (flow, offset) in dropped {
                let _ = self.scheduler.scatter_done(offset);
                if self.regions.get(&offset).is_some_and(|r| r.flow == flow) {
                    self.regions.remove(&offset);
                }
                if !self.scheduler.contains_flow(&flow) {
                    self.grant_index.remove(&flow);
                    self.tombstone(flow);
                }
            }
        }
        if self.cfg.mutations.reclaim_on_forget_scope {
            for flow in &flows {
                self.reclaim_flow(flow);
            }
        }
        // Not reclaimed here: the sender may still write into the granted
        // regions; its cancel (sent once its writes are terminal) frees
        // them, or the silence timeout does. DATA no longer scatters.
        for flow in flows {
            self.send_reject(&flow.peer, flow.rid, RejectReason::ScopeDetached);
        }
        if !self.cfg.mutations.legacy_forget_scope_queue {
            self.schedule_and_send();
        }
    }

    /// The receiver refused our request `r.request_id`: fail it now (only
    /// a request of ours to `peer`).
    fn on_reject(&mut self, peer: &str, r: Reject) {
        let Some(scope) = self
            .requests
            .get(&r.request_id)
            .filter(|q| q.peer == peer)
            .map(|q| q.scope)
        else {
            return;
        };
        self.counters.rejects_received += 1;
        self.fail_request(
            r.request_id,
            format!(
                "receiver {peer:?} refused the request (destination scope {scope}): {}",
                r.reason
            ),
            false,
        );
    }

    /// Remembers that `flow` ended (see `ended`).
    fn tombstone(&mut self, flow: FlowKey) {
        if self.cfg.mutations.no_flow_tombstones {
            return;
        }
        self.prune_tombstones();
        if self.ended.insert(flow.clone()) {
            self.ended_order.push_back((self.now, flow));
        }
        while self.ended_order.len() > self.max_tombstones {
            if let Some((_, f)) = self.ended_order.pop_front() {
                self.ended.remove(&f);
                self.counters.tombstones_evicted += 1;
            }
        }
    }

    fn prune_tombstones(&mut self) {
        let keep = self.cfg.request_timeout.saturating_mul(2);
        while let Some((t, _)) = self.ended_order.front() {
            if self.now.saturating_sub(*t) <= keep {
                break;
            }
            if let Some((_, f)) = self.ended_order.pop_front() {
                self.ended.remove(&f);
            }
        }
    }

    fn reclaim_flow(&mut self, flow: &FlowKey) {
        self.flow_scope.remove(flow);
        // Under the runtime's policy only a flow that existed: a cancel
        // naming an unknown flow (any peer can send one) costs no memory.
        if self.tombstone_unknown || self.scheduler.contains_flow(flow) {
            self.tombstone(flow.clone());
        }
        self.scheduler.reclaim_flow(flow);
        if !self.scheduler.contains_flow(flow) {
            self.flow_seen.remove(flow);
        }
        self.forget_regions(|f| f == flow);
        self.grant_index.remove(flow);
        self.schedule_and_send();
    }

    /// Drops region records of matching flows no longer held; a queued (not
    /// started) scatter of a reclaimed flow never runs: free its orphan.
    fn forget_regions(&mut self, pred: impl Fn(&FlowKey) -> bool) {
        let sched = &self.scheduler;
        self.regions
            .retain(|off, r| !pred(&r.flow) || sched.held_by_flow(&r.flow, *off));
        let mut dropped = Vec::new();
        self.scatter_queue.retain(|s| {
            let keep = !pred(&s.flow) || sched.held_by_flow(&s.flow, s.offset);
            if !keep {
                dropped.push(s.offset);
            }
            keep
        });
        for offset in dropped {
            let _ = self.scheduler.scatter_done(offset);
        }
    }

    fn schedule_and_send(&mut self) {
        // Keep `reserve_block` out of the grants while we send; if it is not
        // free right now, grant nothing (every free reschedules).
        let hold = match self.reserve_block {
            Some(b) if !self.requests.is_empty() => match self.scheduler.acquire_local(b, false) {
                Some(off) => Some(off),
                None => return,
            },
            _ => None,
        };
        let grants = self.scheduler.schedule();
        if let Some(off) = hold {
            let _ = self.scheduler.release_local(off);
        }
        if grants.is_empty() {
            return;
        }
        let mut batches: Vec<(FlowKey, Vec<Credit>)> = Vec::new();
        for g in grants {
            let idx = self.grant_index.entry(g.flow.clone()).or_insert(0);
            let chunk = *idx;
            let credit = Credit {
                chunk_index: chunk,
                region_handle: g.region_offset,
                addr: self.cfg.arena_base.saturating_add(g.region_offset),
                len: g.len,
                device_id: self.cfg.device_id,
            };
            *idx = idx.saturating_add(1);
            if !self.cfg.mutations.legacy_flow_silence {
                // A GRANT restarts the sender's progress clock: restart
                // the flow's silence clock too (deviation, module docs).
                match self.flow_seen.get_mut(&g.flow) {
                    Some(t) => *t = self.now,
                    None => {
                        self.flow_seen.insert(g.flow.clone(), self.now);
                    }
                }
            }
            self.regions.insert(
                g.region_offset,
                RecvRegion {
                    flow: g.flow.clone(),
                    len: g.len,
                    chunk,
                },
            );
            // Batches go out in the order of each flow's last grant, so a
            // sender mirroring the round-robin cursor (`eager_grant_order`)
            // ends where this receiver's cursor is.
            match batches.iter().position(|(f, _)| *f == g.flow) {
                Some(p) => {
                    let (f, mut v) = batches.remove(p);
                    v.push(credit);
                    batches.push((f, v));
                }
                None => batches.push((g.flow, vec![credit])),
            }
        }
        for (flow, credits) in batches {
            self.counters.grants += credits.len() as u64;
            self.send(
                &flow.peer,
                Message::Grant(Grant {
                    request_id: flow.rid,
                    credits,
                }),
            );
        }
    }

    /// Restarts `flow`'s silence clock (no allocation when it has one).
    fn touch_flow(&mut self, flow: &FlowKey) {
        match self.flow_seen.get_mut(flow) {
            Some(t) => *t = self.now,
            None => {
                self.flow_seen.insert(flow.clone(), self.now);
            }
        }
    }

    /// Checks a DATA's scatter against the granted region (`region_len`
    /// bytes) and the memory the flow's scope may write (seed §9 "scatter
    /// input validation"; issue 12 scopes): every run or piece non-empty,
    /// inside the region and inside one allowed range; at most
    /// `region_len` bytes in all.
    fn validate_scatter(
        &self,
        scope: u64,
        region_len: u64,
        list: &ScatterList,
    ) -> Result<(), String> {
        let union: Vec<(u64, u64)>;
        let allowed: &[(u64, u64)] = if self.cfg.mutations.unscoped_data_validation {
            union = self
                .allowed
                .iter()
                .chain(self.scopes.values().flatten())
                .copied()
                .collect();
            &union
        } else if scope == 0 {
            &self.allowed
        } else {
            self.scopes.get(&scope).map_or(&[], Vec::as_slice)
        };
        let outside = |what: String, addr: u64, end: u64| {
            if scope == 0 {
                format!("{what} destination [{addr:#x}, {end:#x}) is outside registered memory")
            } else {
                format!(
                    "{what} destination [{addr:#x}, {end:#x}) is outside the pool of destination engine scope {scope}"
                )
            }
        };
        let runs = match list {
            ScatterList::Runs(runs) => runs,
            ScatterList::Uniform(_) if !self.cfg.uniform_data => {
                return Err(
                    "a DATA_UNIFORM, which this agent does not take (uniformData off)".into(),
                );
            }
            ScatterList::Uniform(u) => {
                if u.segment_len == 0 || u.dsts.is_empty() {
                    return Err("uniform scatter is empty".into());
                }
                check_piece_layout(u.segment_len, u.region_stride, u.region_end(), region_len)?;
                if self.cfg.mutations.unchecked_uniform_dsts {
                    return Ok(());
                }
                // Most pools are one range: when one allowed range holds
                // [lowest destination, highest + piece length), every
                // piece is inside it. One branch-free pass (min / max,
                // vectorised) instead of a range test per piece: 8,192
                // destinations a 32 MiB chunk, on the receiver's path
                // between a DATA and its scatter (issue 18).
                let (lo, hi) = u
                    .dsts
                    .iter()
                    .fold((u64::MAX, 0u64), |(lo, hi), &a| (lo.min(a), hi.max(a)));
                if let Some(end) = hi.checked_add(u.segment_len) {
                    if in_one_range(allowed, lo, end) {
                        return Ok(());
                    }
                }
                return check_pieces(allowed, &u.dsts, u.segment_len, outside);
            }
            ScatterList::Blocks(_) if !self.cfg.block_data => {
                return Err("a DATA_BLOCKS, which this agent does not take (blockData off)".into());
            }
            ScatterList::Blocks(b) => {
                if b.segment_len == 0 || b.count == 0 || b.offsets.is_empty() {
                    return Err("block scatter is empty".into());
                }
                check_piece_layout(b.segment_len, b.region_stride, b.region_end(), region_len)?;
                if self.cfg.mutations.unchecked_uniform_dsts {
                    return Ok(());
                }
                // [lowest, highest + piece length) from the first and last
                // planes and the offsets' extremes: one pass over a block's
                // entry, not a piece's (512, not 8,192, for a 32 MiB chunk
                // of a 512-block hand-off).
                if let Some((lo, end)) = b.dst_bounds() {
                    if in_one_range(allowed, lo, end) {
                        return Ok(());
                    }
                }
                // Several ranges, or a piece outside (named): piece by
                // piece, as DATA_UNIFORM.
                let u = b
                    .to_uniform()
                    .ok_or("block scatter destination overflows")?;
                return check_pieces(allowed, &u.dsts, u.segment_len, outside);
            }
        };
        let mut total: u64 = 0;
        for (k, r) in runs.iter().enumerate() {
            if r.segment_len == 0 || r.count == 0 {
                return Err(format!("run {k} is empty"));
            }
            let end = r.region_end().ok_or_else(|| format!("run {k} overflows"))?;
            if end > region_len {
                return Err(format!(
                    "run {k} ends at region byte {end}, beyond the granted {region_len} bytes"
                ));
            }
            let dst_end = u64::from(r.count - 1)
                .checked_mul(r.addr_stride)
                .and_then(|x| x.checked_add(r.addr))
                .and_then(|x| x.checked_add(r.segment_len))
                .ok_or_else(|| format!("run {k} destination overflows"))?;
            let inside = allowed
                .iter()
                .any(|&(a, l)| r.addr >= a && dst_end <= a.saturating_add(l));
            if !inside {
                return Err(outside(format!("run {k}"), r.addr, dst_end));
            }
            total = total.saturating_add(r.total_bytes());
        }
        if total > region_len {
            return Err(format!(
                "runs move {total} bytes, more than the granted {region_len}"
            ));
        }
        Ok(())
    }

    /// A DATA or DATA_UNIFORM: chunk `chunk_index` of `request_id` landed
    /// in region `region_handle`; scatter it with `list` once validated.
    fn on_data(
        &mut self,
        peer: &str,
        request_id: u64,
        chunk_index: u32,
        region_handle: u64,
        list: ScatterList,
    ) {
        let d = DataRef {
            request_id,
            chunk_index,
            region_handle,
        };
        let m = self.cfg.mutations;
        let flow = FlowKey::new(peer, d.request_id);
        let held = self.scheduler.held_by_flow(&flow, d.region_handle);
        if !held && !m.no_held_by_flow_validation {
            // Late DATA after a cancel / forget: never scatter (seed §9).
            tracing::warn!(agent = %self.log_name, peer, rid = d.request_id, region = d.region_handle, "DATA for a region the flow does not hold; dropped");
            self.counters.data_rejected += 1;
            return;
        }
        let region = self.regions.get(&d.region_handle);
        let len = region.map(|r| r.len).unwrap_or(0);
        let chunk_ok = region.is_some_and(|r| r.chunk == d.chunk_index);
        if held && !chunk_ok && !m.unchecked_data_chunk {
            // Replayed DATA for a region re-granted to a later chunk.
            tracing::warn!(agent = %self.log_name, peer, rid = d.request_id, chunk = d.chunk_index, "DATA names another chunk than its region was granted for; dropped");
            self.counters.data_rejected += 1;
            return;
        }
        let len = if held { len } else { u64::MAX };
        // A live flow always has its WANT's scope; none: fail closed.
        let scope = match self.flow_scope.get(&flow) {
            Some(&s) => s,
            None if held => u64::MAX,
            None => 0,
        };
        if held && scope != 0 && !self.scopes.contains_key(&scope) && !m.unscoped_data_validation {
            // The flow's engine detached (or its scope is unknown): not
            // scattered, and the sender is told why.
            tracing::debug!(agent = %self.log_name, peer, rid = d.request_id, scope, "DATA for a closed engine scope; not scattered");
            self.counters.data_rejected += 1;
            self.send_reject(peer, d.request_id, RejectReason::ScopeDetached);
            return;
        }
        if let Err(why) = self.validate_scatter(scope, len, &list) {
            tracing::warn!(agent = %self.log_name, peer, rid = d.request_id, reason = %why, "DATA with invalid scatter runs; no scatter, no ACK");
            self.counters.data_rejected += 1;
            if held {
                // The sender fails the request now; its cancel frees the
                // flow's regions once its writes are terminal.
                self.send_reject(peer, d.request_id, RejectReason::InvalidRuns);
            }
            return;
        }
        if held
            && self
                .scheduler
                .begin_scatter(&flow, d.region_handle)
                .is_err()
        {
            self.counters.data_rejected += 1;
            return;
        }
        self.touch_flow(&flow);
        let dst = scatter_bounds(&list);
        self.scatter_queue.push_back(PendingScatter {
            flow,
            offset: d.region_handle,
            chunk: d.chunk_index,
            runs: list,
            dst,
        });
        self.drain_scatter_queue();
    }

    fn drain_scatter_queue(&mut self) {
        while self.exec_free > 0 {
            let Some(s) = self.scatter_queue.pop_front() else {
                return;
            };
            self.exec_free -= 1;
            let job = self.token();
            let flow = FlowKey {
                peer: self.owned_name(&s.flow.peer),
                rid: s.flow.rid,
            };
            self.jobs.insert(
                job,
                Job::Scatter {
                    flow: s.flow,
                    offset: s.offset,
                    chunk: s.chunk,
                    dst: s.dst,
                },
            );
            self.push(Action::StartScatter {
                job,
                flow,
                region: s.offset,
                chunk: s.chunk,
                runs: s.runs,
            });
        }
    }

    fn answer_quiesce(&mut self) {
        if self.quiesce.is_empty() {
            return;
        }
        let busy = |a: u64, e: u64, (s0, s1): (u64, u64)| s0 < e && a < s1;
        let mut k = 0;
        while k < self.quiesce.len() {
            let (id, a, e) = self.quiesce[k];
            let in_use = self.scatter_queue.iter().any(|p| busy(a, e, p.dst))
                || self.jobs.values().any(|j| match j {
                    Job::Scatter { dst, .. } => busy(a, e, *dst),
                    _ => false,
                });
            if in_use {
                k += 1;
            } else {
                self.quiesce.remove(k);
                self.push(Action::Quiesced { id });
            }
        }
    }

    fn on_scatter_done(&mut self, job: u64, result: Result<(), String>) {
        let Some(j) = self.jobs.remove(&job) else {
            return;
        };
        let Job::Scatter {
            flow,
            offset,
            chunk,
            dst: _,
        } = j
        else {
            self.jobs.insert(job, j);
            return;
        };
        self.exec_free += 1;
        let live = self.scheduler.held_by_flow(&flow, offset);
        let _ = self.scheduler.scatter_done(offset);
        if self.regions.get(&offset).is_some_and(|r| r.flow == flow) {
            self.regions.remove(&offset);
        }
        if !self.scheduler.contains_flow(&flow) {
            self.grant_index.remove(&flow);
            // Its records go now, not at the next silence sweep: a busy
            // receiver ends flows faster than the sweep (fed by deadlines)
            // comes, and every record kept is rescanned by next_deadline.
            self.flow_seen.remove(&flow);
            self.flow_scope.remove(&flow);
            if live {
                self.tombstone(flow.clone());
            }
        }
        if live && result.is_ok() {
            self.counters.chunks_scattered += 1;
            if !self.cfg.mutations.legacy_flow_silence && self.scheduler.contains_flow(&flow) {
                self.touch_flow(&flow);
            }
            let rid = flow.rid;
            self.push(Action::Send {
                to: flow.peer,
                msg: Message::Ack(Ack {
                    request_id: rid,
                    chunk_index: chunk,
                    region_handle: offset,
                }),
            });
        } else if live {
            if let Err(e) = &result {
                tracing::warn!(agent = %self.log_name, flow = %flow, error = %e, "scatter failed; no ACK");
            }
        }
        // A failed scatter never ACKs (seed §9); an orphan has nobody to ACK.
        self.schedule_and_send();
    }

    // ------------------------------------------------------------ lifecycle

    fn forget_peer(&mut self, peer: &str) {
        // Fail our requests first, while the route still exists, so their
        // cancels reach a receiver that is alive.
        let rids: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| r.peer == peer)
            .map(|(rid, _)| *rid)
            .collect();
        for rid in rids {
            self.fail_request(rid, format!("peer {peer:?} was forgotten"), false);
        }
        self.push(Action::ForgetRoute {
            peer: peer.to_string(),
        });
        self.peers.remove(peer);
        for flow in self.scheduler.reclaim_by_prefix(peer).flows {
            self.tombstone(flow);
        }
        self.forget_regions(|f| f.peer == peer);
        self.grant_index.retain(|f, _| f.peer != peer);
        self.flow_seen.retain(|f, _| f.peer != peer);
        self.schedule_and_send();
    }

    fn shutdown(&mut self) {
        let rids: Vec<u64> = self.requests.keys().copied().collect();
        for rid in rids {
            self.fail_request(rid, "transport shut down".into(), false);
        }
        self.shut_down = true;
    }

    fn abandon_in_flight(&mut self) {
        let orphans: Vec<(u64, u64)> = self
            .writes
            .iter()
            .filter_map(|(w, r)| match r {
                WriteRef::Orphan { rid, .. } => Some((*w, *rid)),
                WriteRef::Live { .. } => None,
            })
            .collect();
        if orphans.is_empty() {
            return;
        }
        self.push(Action::ArenaInDoubt {
            writes: orphans.len(),
        });
        for (w, rid) in orphans {
            // Staging stays allocated: the NIC may still read it.
            self.writes.remove(&w);
            self.orphan_write_settled(rid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ScatterRun, UniformScatter};

    const T: Nanos = 1_000_000_000;

    fn machine(name: &str) -> Machine {
        machine_with(name, |_| {})
    }

    /// [`machine`] with its configuration changed by `f` first.
    fn machine_with(name: &str, f: impl FnOnce(&mut Config)) -> Machine {
        let mut cfg = Config {
            arena_bytes: 4096,
            granularity_bytes: 256,
            max_chunk_size_bytes: 1024,
            max_inflight_chunks: 2,
            copy_contexts: 2,
            request_timeout: T,
            eager_gather: true,
            eager_grant_order: true,
            release_staging_on_write: true,
            grant_policy: GrantPolicy::RoundRobin,
            grant_size_weight: crate::scheduler::DEFAULT_SIZE_WEIGHT,
            uniform_data: true,
            block_data: true,
            arena_base: 0x7000_0000,
            device_id: 0,
            endpoint: name.as_bytes().to_vec(),
            mutations: Mutations::default(),
        };
        f(&mut cfg);
        let mut m = Machine::new(cfg).unwrap();
        m.handle(
            0,
            Input::AllowScatter {
                addr: 0x1000,
                len: 1 << 20,
            },
        );
        m
    }

    fn chunks(sizes: &[u64]) -> Vec<ChunkBound> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &b)| ChunkBound {
                index: i as u32,
                first_desc: i,
                first_done: 0,
                packed_bytes: b,
                payload_bytes: b,
                pieces: 1,
            })
            .collect()
    }

    /// Submits request `rid` of chunks of `sizes` bytes from `m` to "b"
    /// (scope 0).
    fn submit_to_b(m: &mut Machine, now: Nanos, rid: u64, sizes: &[u64]) {
        m.handle(
            now,
            Input::Submit {
                rid,
                peer: "b".into(),
                scope: 0,
                chunks: chunks(sizes),
            },
        );
    }

    fn drain(m: &mut Machine) -> Vec<Action> {
        std::iter::from_fn(|| m.poll_action()).collect()
    }

    /// Completes gather `job` of a `len`-byte chunk (one run).
    fn gather_ok(m: &mut Machine, now: Nanos, job: u64, len: u64) {
        m.handle(
            now,
            Input::GatherDone {
                job,
                result: Ok(ScatterList::Runs(run(len))),
            },
        );
    }

    /// Completes write `write`.
    fn write_ok(m: &mut Machine, now: Nanos, write: u64) {
        m.handle(
            now,
            Input::WriteDone {
                write,
                result: Ok(()),
            },
        );
    }

    fn run(len: u64) -> Vec<ScatterRun> {
        vec![ScatterRun {
            region_offset: 0,
            addr: 0x1000,
            segment_len: len,
            region_stride: 0,
            addr_stride: 0,
            count: 1,
        }]
    }

    /// Delivers every message between `a` ("a") and `b` ("b") and completes
    /// every gather, write and scatter at once, until both are idle;
    /// returns the resolutions seen.
    fn settle(a: &mut Machine, b: &mut Machine, now: Nanos) -> Vec<(u64, Outcome)> {
        let mut out = Vec::new();
        loop {
            let mut acts: Vec<(bool, Action)> = drain(a).into_iter().map(|x| (true, x)).collect();
            acts.extend(drain(b).into_iter().map(|x| (false, x)));
            if acts.is_empty() {
                return out;
            }
            for (from_a, act) in acts {
                let (me, other, my_name) = if from_a {
                    (&mut *a, &mut *b, "a")
                } else {
                    (&mut *b, &mut *a, "b")
                };
                match act {
                    Action::Send { msg, .. } => other.handle(
                        now,
                        Input::Message {
                            from: my_name.into(),
                            msg,
                            route: Route::Usable,
                        },
                    ),
                    Action::StartGather { job, bound, .. } => {
                        gather_ok(me, now, job, bound.packed_bytes)
                    }
                    Action::PostWrite { write, .. } => write_ok(me, now, write),
                    Action::StartScatter { job, .. } => me.handle(
                        now,
                        Input::ScatterDone {
                            job,
                            result: Ok(()),
                        },
                    ),
                    Action::Resolve { rid, outcome, .. } => out.push((rid, outcome)),
                    _ => {}
                }
            }
        }
    }

    fn quiet(m: &Machine) {
        let s = m.snapshot();
        assert_eq!(
            (s.free_bytes, s.flows, s.requests, s.jobs),
            (s.capacity, 0, 0, 0),
            "{s:?}"
        );
        assert_eq!((s.starved, s.grant_order), (0, 0), "{s:?}");
        m.scheduler().check_conservation().unwrap();
    }

    /// Issue 18 step 3: a submit's eager gathers are asked for before its
    /// WANT (a control send can take tens of µs), and the WANT goes once.
    #[test]
    fn a_submit_starts_its_eager_gathers_before_its_want() {
        let mut a = machine("a");
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        submit_to_b(&mut a, 0, 1, &[1024, 512]);
        let mut order = Vec::new();
        while let Some(step) = a.poll() {
            match step {
                Step::Action(Action::StartGather { chunk, .. }) => {
                    order.push(format!("gather {chunk}"))
                }
                Step::Action(Action::Send {
                    msg: Message::Want(w),
                    ..
                }) => {
                    assert_eq!(w.chunk_bytes.len(), 2);
                    order.push("want".to_string());
                }
                _ => {}
            }
        }
        assert_eq!(order, ["gather 0", "gather 1", "want"]);
    }

    /// A GRANT from "b" for chunk `chunk` of `rid`, region at `offset`.
    fn grant_from_b(m: &mut Machine, now: Nanos, rid: u64, chunk: u32, offset: u64) {
        m.handle(
            now,
            Input::Message {
                from: "b".into(),
                msg: Message::Grant(Grant {
                    request_id: rid,
                    credits: vec![Credit {
                        chunk_index: chunk,
                        region_handle: offset,
                        addr: 0x7000_0000 + offset,
                        len: 1024,
                        device_id: 0,
                    }],
                }),
                route: Route::Usable,
            },
        );
    }

    /// Feeds sender "a" (arena of 8 blocks: an eager budget of 4 chunks;
    /// W = 8) `requests` requests of `chunks` 1 KiB chunks, then GRANTs in
    /// `order` (request, chunk), completing every gather and write at
    /// once; returns how many GRANTs found their chunk already staged.
    fn staged_at_grant(
        policy: GrantPolicy,
        grant_order: bool,
        requests: u64,
        chunks_each: usize,
        order: &[(u64, u32)],
    ) -> usize {
        let chunks = vec![chunks_each; requests as usize];
        staged_at_grant_of(policy, grant_order, &chunks, order)
    }

    /// [`staged_at_grant`] with request `i + 1` of `chunks[i]` chunks.
    fn staged_at_grant_of(
        policy: GrantPolicy,
        grant_order: bool,
        chunks: &[usize],
        order: &[(u64, u32)],
    ) -> usize {
        let mut a = machine_with("a", |c| {
            c.arena_bytes = 8192;
            c.max_inflight_chunks = 8;
            c.grant_policy = policy;
            c.eager_grant_order = grant_order;
        });
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        let mut staged = std::collections::BTreeSet::new();
        let settle_a = |a: &mut Machine, staged: &mut BTreeSet<(u64, u32)>, now| loop {
            let acts = drain(a);
            if acts.is_empty() {
                return;
            }
            for act in acts {
                match act {
                    Action::StartGather {
                        job,
                        rid,
                        chunk,
                        bound,
                        ..
                    } => {
                        staged.insert((rid, chunk));
                        gather_ok(a, now, job, bound.packed_bytes);
                    }
                    Action::PostWrite { write, .. } => write_ok(a, now, write),
                    _ => {}
                }
            }
        };
        for (rid, &n) in (1..).zip(chunks) {
            submit_to_b(&mut a, 0, rid, &vec![1024; n]);
        }
        settle_a(&mut a, &mut staged, 0);
        let mut hits = 0;
        for (t, &(rid, chunk)) in order.iter().enumerate() {
            hits += usize::from(staged.contains(&(rid, chunk)));
            grant_from_b(&mut a, t as u64 + 1, rid, chunk, 1024 * t as u64);
            settle_a(&mut a, &mut staged, t as u64 + 1);
        }
        assert_eq!(
            staged.len(),
            order.len(),
            "every granted chunk was gathered"
        );
        hits
    }

    /// Issue 18: eight requests of two chunks, an eager budget of four
    /// chunks. A round-robin receiver grants the first chunk of every
    /// request, then the second ones. In grant order every GRANT finds its
    /// chunk staged; under the seed's rule the budget holds the first
    /// requests' second chunks (granted a round later) and the later
    /// requests' first chunks are gathered only once granted.
    #[test]
    fn eager_gathers_follow_the_receivers_round_robin_order() {
        let order: Vec<(u64, u32)> = (0..2).flat_map(|c| (1..=8).map(move |r| (r, c))).collect();
        let rr = GrantPolicy::RoundRobin;
        assert_eq!(staged_at_grant(rr, true, 8, 2, &order), 16);
        let seed = staged_at_grant(rr, false, 8, 2, &order);
        assert_eq!(seed, 12, "seed rule: {seed} of 16 staged at their GRANT");
    }

    /// Issue 18: an oldest-first receiver grants the oldest request's
    /// chunks first (eight requests of three chunks, eager budget four).
    /// Mirrored as oldest first, every GRANT finds its chunk staged;
    /// mirrored as round-robin (the wrong policy), the budget goes to the
    /// first chunks of younger requests and the oldest one's next chunks
    /// are gathered only once granted.
    #[test]
    fn eager_gathers_follow_the_receivers_oldest_first_order() {
        let order: Vec<(u64, u32)> = (1..=8).flat_map(|r| (0..3).map(move |c| (r, c))).collect();
        let of = GrantPolicy::OldestFirst;
        assert_eq!(staged_at_grant(of, true, 8, 3, &order), 24);
        let wrong = staged_at_grant(GrantPolicy::RoundRobin, true, 8, 3, &order);
        assert!(wrong < 24, "round-robin mirror: {wrong} of 24");
    }

    /// Issue 18: a shortest-first receiver grants the smallest request's
    /// chunks first (six requests of 3, 1, 3, 2, 1, 2 chunks submitted
    /// together; eager budget four). The sender's estimate of the
    /// receiver's ranks (its clock + grant_size_weight × bytes) gives the same
    /// order, so every GRANT finds its chunk staged; mirrored as oldest
    /// first (the wrong policy), the budget goes to the first requests'
    /// chunks and the small ones are gathered only once granted.
    #[test]
    fn eager_gathers_follow_the_receivers_shortest_first_order() {
        let chunks = [3, 1, 3, 2, 1, 2];
        let order: Vec<(u64, u32)> = [2u64, 5, 4, 6, 1, 3]
            .iter()
            .flat_map(|&r| (0..chunks[r as usize - 1] as u32).map(move |c| (r, c)))
            .collect();
        let sf = GrantPolicy::ShortestFirst;
        assert_eq!(staged_at_grant_of(sf, true, &chunks, &order), 12);
        let wrong = staged_at_grant_of(GrantPolicy::OldestFirst, true, &chunks, &order);
        assert!(wrong < 12, "oldest-first mirror: {wrong} of 12");
    }

    /// Shortest first, sender side: the clock counts the bytes the peer
    /// granted, so a request submitted after two of r1's four chunks were
    /// granted ranks at clock + K × its bytes — r2 (3 chunks) ahead of r1,
    /// r3 (4 chunks) behind it; once every request has resolved, the
    /// grant order and its clock are gone.
    #[test]
    fn shortest_first_sender_ranks_by_the_bytes_the_peer_granted() {
        let mut a = machine_with("a", |c| {
            c.arena_bytes = 1 << 16;
            c.max_inflight_chunks = 8;
            c.grant_policy = GrantPolicy::ShortestFirst;
        });
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        submit_to_b(&mut a, 0, 1, &[1024; 4]);
        let packed = a.requests[&1].chunks[0].packed_bytes;
        grant_from_b(&mut a, 1, 1, 0, 0);
        grant_from_b(&mut a, 1, 1, 1, 1024);
        assert_eq!(a.grant_clock.get("b"), Some(&(2 * packed)));
        submit_to_b(&mut a, 2, 2, &[1024; 3]);
        submit_to_b(&mut a, 2, 3, &[1024; 4]);
        let k = a.cfg.grant_size_weight;
        assert_eq!(a.requests[&1].grant_rank, 4 * k * packed);
        assert_eq!(a.requests[&2].grant_rank, 2 * packed + 3 * k * packed);
        assert_eq!(
            a.grant_order["b"].iter().copied().collect::<Vec<_>>(),
            vec![2, 1, 3]
        );
        a.handle(3, Input::PeerForgotten { peer: "b".into() });
        assert!(a.requests.is_empty());
        assert!(a.grant_order.is_empty() && a.grant_clock.is_empty());
    }

    /// Review finding: with the staging freed at the write, the ACK that
    /// opens a request's window frees nothing, and must still let the
    /// next chunk be gathered eagerly.
    #[test]
    fn an_ack_that_opens_the_window_stages_the_next_chunk_eagerly() {
        let mut a = machine_with("a", |c| c.arena_bytes = 8192);
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        submit_to_b(&mut a, 0, 1, &[1024; 4]);
        let mut gathered = Vec::new();
        let mut write = None;
        let pump = |a: &mut Machine, gathered: &mut Vec<u32>, write: &mut Option<u64>| {
            for act in drain(a) {
                match act {
                    Action::StartGather {
                        job, chunk, bound, ..
                    } => {
                        gathered.push(chunk);
                        gather_ok(a, 1, job, bound.packed_bytes);
                    }
                    Action::PostWrite { write: w, .. } => *write = Some(w),
                    _ => {}
                }
            }
        };
        pump(&mut a, &mut gathered, &mut write);
        assert_eq!(gathered, [0, 1], "window W = 2");
        grant_from_b(&mut a, 1, 1, 0, 0);
        pump(&mut a, &mut gathered, &mut write);
        write_ok(&mut a, 2, write.expect("chunk 0 written"));
        pump(&mut a, &mut gathered, &mut write);
        assert_eq!(gathered, [0, 1], "DATA sent: chunk 0 still in the window");
        a.handle(
            3,
            Input::Message {
                from: "b".into(),
                msg: Message::Ack(Ack {
                    request_id: 1,
                    chunk_index: 0,
                    region_handle: 0,
                }),
                route: Route::Usable,
            },
        );
        pump(&mut a, &mut gathered, &mut write);
        assert_eq!(gathered, [0, 1, 2]);
    }

    /// Review finding: a duplicate submit fails alone; the live request
    /// keeps its place in the grant order (and stages eagerly).
    #[test]
    fn a_duplicate_submit_leaves_the_live_request_in_the_grant_order() {
        let mut a = machine_with("a", |c| c.arena_bytes = 8192);
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        for _ in 0..2 {
            submit_to_b(&mut a, 0, 1, &[1024; 2]);
        }
        let s = a.snapshot();
        assert_eq!((s.requests, s.grant_order), (1, 1), "{s:?}");
        let failed = drain(&mut a)
            .into_iter()
            .filter(|x| {
                matches!(
                    x,
                    Action::Resolve {
                        rid: 1,
                        outcome: Outcome::Failure(_),
                        ..
                    }
                )
            })
            .count();
        assert_eq!(failed, 1);
    }

    /// Issue 18: a chunk's staging is freed when its write completed
    /// (`release_staging_on_write`), not at its ACK; off, at the ACK (seed).
    #[test]
    fn staging_is_freed_when_its_write_completes() {
        for on_write in [true, false] {
            let (mut a, mut b) = (machine("a"), machine("b"));
            a.cfg.release_staging_on_write = on_write;
            a.handle(0, Input::PeerAdded { peer: "b".into() });
            submit_to_b(&mut a, 0, 1, &[1024]);
            // Gather, WANT → b, GRANT → a, write posted.
            let mut write = None;
            for _ in 0..4 {
                for act in drain(&mut a) {
                    match act {
                        Action::StartGather { job, bound, .. } => {
                            gather_ok(&mut a, 1, job, bound.packed_bytes)
                        }
                        Action::Send { msg, .. } => b.handle(
                            1,
                            Input::Message {
                                from: "a".into(),
                                msg,
                                route: Route::Usable,
                            },
                        ),
                        Action::PostWrite { write: w, .. } => write = Some(w),
                        _ => {}
                    }
                }
                for act in drain(&mut b) {
                    if let Action::Send { msg, .. } = act {
                        a.handle(
                            1,
                            Input::Message {
                                from: "b".into(),
                                msg,
                                route: Route::Usable,
                            },
                        );
                    }
                }
            }
            let write = write.expect("write posted");
            let cap = a.snapshot().capacity;
            assert!(a.snapshot().free_bytes < cap, "staging held while writing");
            write_ok(&mut a, 2, write);
            let free = a.snapshot().free_bytes;
            assert_eq!(free == cap, on_write, "free {free} of {cap}");
            a.scheduler().check_conservation().unwrap();
            // The DATA, the scatter and the ACK complete the request either way.
            assert_eq!(settle(&mut a, &mut b, 3), vec![(1, Outcome::Success)]);
            quiet(&a);
            quiet(&b);
        }
    }

    /// Issue 18: many requests between two agents complete, every region
    /// freed, under each combination of the sender rules and both policies.
    #[test]
    fn many_requests_complete_under_every_sender_rule() {
        for policy in [
            GrantPolicy::RoundRobin,
            GrantPolicy::OldestFirst,
            GrantPolicy::ShortestFirst,
        ] {
            for (grant_order, on_write) in
                [(false, false), (true, false), (false, true), (true, true)]
            {
                let (mut a, mut b) = (machine("a"), machine("b"));
                for m in [&mut a, &mut b] {
                    m.cfg.eager_grant_order = grant_order;
                    m.cfg.release_staging_on_write = on_write;
                    m.cfg.grant_policy = policy;
                }
                b.scheduler = CreditScheduler::new(4096, 256, 2)
                    .unwrap()
                    .with_policy(policy);
                a.handle(0, Input::PeerAdded { peer: "b".into() });
                for rid in 1..=12 {
                    submit_to_b(&mut a, 0, rid, &[1024, 1024, 512][..(rid as usize % 3) + 1]);
                }
                let mut out = settle(&mut a, &mut b, 1);
                out.sort_by_key(|(rid, _)| *rid);
                let want: Vec<(u64, Outcome)> = (1..=12).map(|r| (r, Outcome::Success)).collect();
                assert_eq!(out, want, "{policy:?} {grant_order} {on_write}");
                quiet(&a);
                quiet(&b);
            }
        }
    }

    #[test]
    fn a_want_for_a_scope_not_attached_fails_at_once_by_reject() {
        let (mut a, mut b) = (machine("a"), machine("b"));
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        a.handle(
            0,
            Input::Submit {
                rid: 1,
                peer: "b".into(),
                scope: 7,
                chunks: chunks(&[1024, 512]),
            },
        );
        let out = settle(&mut a, &mut b, 1);
        assert_eq!(out.len(), 1);
        match &out[0] {
            (1, Outcome::Failure(why)) => assert!(
                why.contains("destination scope 7") && why.contains("not attached"),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(b.counters().rejects_sent, 1);
        assert_eq!(b.counters().grants, 0);
        assert_eq!(a.counters().rejects_received, 1);
        quiet(&a);
        quiet(&b);
    }

    #[test]
    fn scoped_data_scatters_only_into_its_engines_pool() {
        // Scope 3's pool is elsewhere: the runs (into 0x1000, the agent's
        // own range and once perhaps another engine's pool) are refused.
        let (mut a, mut b) = (machine("a"), machine("b"));
        b.handle(
            0,
            Input::AllowScope {
                scope: 3,
                addr: 0x40_0000,
                len: 1 << 20,
            },
        );
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        a.handle(
            0,
            Input::Submit {
                rid: 1,
                peer: "b".into(),
                scope: 3,
                chunks: chunks(&[1024]),
            },
        );
        let out = settle(&mut a, &mut b, 1);
        match out.as_slice() {
            [(1, Outcome::Failure(why))] => assert!(why.contains("outside"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(b.counters().data_rejected, 1);
        assert_eq!(b.counters().chunks_scattered, 0);
        quiet(&a);
        quiet(&b);
    }

    #[test]
    fn forgetting_a_scope_fails_only_its_flows_at_once() {
        let (mut a, mut b) = (machine("a"), machine("b"));
        for scope in [3, 4] {
            b.handle(
                0,
                Input::AllowScope {
                    scope,
                    addr: 0x1000,
                    len: 1 << 20,
                },
            );
        }
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        for (rid, scope) in [(1, 3), (2, 4)] {
            a.handle(
                0,
                Input::Submit {
                    rid,
                    peer: "b".into(),
                    scope,
                    chunks: chunks(&[1024, 1024, 512]),
                },
            );
        }
        // The WANTs reach b and it grants; a's gathers stay pending.
        let mut held = Vec::new();
        for act in drain(&mut a) {
            match act {
                Action::Send { msg, .. } => b.handle(
                    1,
                    Input::Message {
                        from: "a".into(),
                        msg,
                        route: Route::Usable,
                    },
                ),
                other => held.push(other),
            }
        }
        assert_eq!(b.snapshot().flows, 2);
        b.handle(2, Input::ForgetScope { scope: 3 });
        // Both flows live on until the sender's cancel (its writes may be
        // in flight); only scope 3's sender was told.
        assert_eq!(b.snapshot().flows, 2);
        assert_eq!(b.counters().rejects_sent, 1);
        for act in held {
            if let Action::StartGather { job, bound, .. } = act {
                a.handle(
                    2,
                    Input::GatherDone {
                        job,
                        result: Ok(ScatterList::Runs(run(bound.packed_bytes))),
                    },
                );
            }
        }
        let mut out = settle(&mut a, &mut b, 2);
        out.sort_by_key(|(rid, _)| *rid);
        assert_eq!(out.len(), 2, "{out:?}");
        match &out[0] {
            (1, Outcome::Failure(why)) => assert!(why.contains("detached"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(out[1], (2, Outcome::Success));
        // Scope 3 stays closed.
        a.handle(
            3,
            Input::Submit {
                rid: 3,
                peer: "b".into(),
                scope: 3,
                chunks: chunks(&[100]),
            },
        );
        assert!(matches!(
            settle(&mut a, &mut b, 3).as_slice(),
            [(3, Outcome::Failure(_))]
        ));
        quiet(&a);
        quiet(&b);
    }

    /// Found by the simulator (scoped world, seed 1038 under
    /// `legacy_forget_scope_queue`): DATA accepted before `ForgetScope`
    /// whose scatter waited for a copy context started after the scope
    /// closed — into the detached engine's pool — and was ACKed.
    #[test]
    fn a_forgotten_scope_starts_none_of_its_queued_scatters() {
        for legacy in [false, true] {
            let mut a = machine("a");
            let mut b = Machine::new(Config {
                arena_bytes: 4096,
                granularity_bytes: 256,
                max_chunk_size_bytes: 1024,
                max_inflight_chunks: 2,
                copy_contexts: 1,
                request_timeout: T,
                eager_gather: true,
                eager_grant_order: true,
                release_staging_on_write: true,
                grant_policy: GrantPolicy::RoundRobin,
                grant_size_weight: crate::scheduler::DEFAULT_SIZE_WEIGHT,
                uniform_data: true,
                block_data: true,
                arena_base: 0x7000_0000,
                device_id: 0,
                endpoint: b"b".to_vec(),
                mutations: Mutations {
                    legacy_forget_scope_queue: legacy,
                    ..Mutations::default()
                },
            })
            .unwrap();
            b.handle(
                0,
                Input::AllowScope {
                    scope: 3,
                    addr: 0x1000,
                    len: 1 << 20,
                },
            );
            a.handle(0, Input::PeerAdded { peer: "b".into() });
            a.handle(
                0,
                Input::Submit {
                    rid: 1,
                    peer: "b".into(),
                    scope: 3,
                    chunks: chunks(&[1024, 1024]),
                },
            );
            // Everything completes at once except b's scatters: the first
            // DATA takes b's one copy context, the second waits in the queue.
            let mut scatters = Vec::new();
            let mut out = Vec::new();
            let mut pump = |a: &mut Machine, b: &mut Machine, scatters: &mut Vec<u64>| loop {
                let mut acts: Vec<(bool, Action)> =
                    drain(a).into_iter().map(|x| (true, x)).collect();
                acts.extend(drain(b).into_iter().map(|x| (false, x)));
                if acts.is_empty() {
                    return;
                }
                for (from_a, act) in acts {
                    let (me, other, my_name) = if from_a {
                        (&mut *a, &mut *b, "a")
                    } else {
                        (&mut *b, &mut *a, "b")
                    };
                    match act {
                        Action::Send { msg, .. } => other.handle(
                            1,
                            Input::Message {
                                from: my_name.into(),
                                msg,
                                route: Route::Usable,
                            },
                        ),
                        Action::StartGather { job, bound, .. } => {
                            gather_ok(me, 1, job, bound.packed_bytes)
                        }
                        Action::PostWrite { write, .. } => me.handle(
                            1,
                            Input::WriteDone {
                                write,
                                result: Ok(()),
                            },
                        ),
                        Action::StartScatter { job, .. } => scatters.push(job),
                        Action::Resolve { rid, outcome, .. } => out.push((rid, outcome)),
                        _ => {}
                    }
                }
            };
            pump(&mut a, &mut b, &mut scatters);
            assert_eq!(scatters.len(), 1);
            assert_eq!(b.snapshot().scatter_queue, 1);
            b.handle(2, Input::ForgetScope { scope: 3 });
            let running = scatters.pop().unwrap();
            b.handle(
                2,
                Input::ScatterDone {
                    job: running,
                    result: Ok(()),
                },
            );
            pump(&mut a, &mut b, &mut scatters);
            if legacy {
                // The old rule: the queued scatter starts after the detach.
                assert_eq!(scatters.len(), 1, "legacy rule");
                continue;
            }
            assert!(scatters.is_empty(), "a scatter started after ForgetScope");
            match out.as_slice() {
                [(1, Outcome::Failure(why))] => assert!(why.contains("detached"), "{why}"),
                other => panic!("{other:?}"),
            }
            quiet(&a);
            quiet(&b);
        }
    }

    #[test]
    fn a_request_completes_and_everything_is_freed() {
        let (mut a, mut b) = (machine("a"), machine("b"));
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        submit_to_b(&mut a, 0, 1, &[1024, 512, 100]);
        assert_eq!(settle(&mut a, &mut b, 1), vec![(1, Outcome::Success)]);
        for m in [&a, &b] {
            let s = m.snapshot();
            assert_eq!(
                (s.free_bytes, s.flows, s.requests, s.jobs),
                (s.capacity, 0, 0, 0)
            );
            m.scheduler().check_conservation().unwrap();
        }
        assert_eq!(a.next_deadline(), None);
        // The receiver forgets the finished flow's silence clock at once
        // (it lingered until a Tick came, and every input rescanned it).
        assert_eq!(b.next_deadline(), None);
        assert_eq!(b.counters().chunks_scattered, 3);
    }

    #[test]
    fn a_failed_request_cancels_only_once_its_write_is_terminal() {
        let mut a = machine("a");
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        submit_to_b(&mut a, 0, 1, &[512]);
        let gather = drain(&mut a)
            .into_iter()
            .find_map(|x| match x {
                Action::StartGather { job, .. } => Some(job),
                _ => None,
            })
            .unwrap();
        a.handle(
            1,
            Input::GatherDone {
                job: gather,
                result: Ok(ScatterList::Runs(run(512))),
            },
        );
        let credit = Credit {
            chunk_index: 0,
            region_handle: 0,
            addr: 0,
            len: 512,
            device_id: 0,
        };
        let grant = Message::Grant(Grant {
            request_id: 1,
            credits: vec![credit],
        });
        a.handle(
            2,
            Input::Message {
                from: "b".into(),
                msg: grant,
                route: Route::Usable,
            },
        );
        let write = drain(&mut a)
            .into_iter()
            .find_map(|x| match x {
                Action::PostWrite { write, .. } => Some(write),
                _ => None,
            })
            .unwrap();
        // Cancelled while the write is in flight: resolved now, no cancel
        // yet, staging still held.
        a.handle(
            3,
            Input::Cancel {
                rid: 1,
                why: "test".into(),
            },
        );
        let acts = drain(&mut a);
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::Resolve { rid: 1, .. })));
        assert!(!acts.iter().any(|x| matches!(x, Action::Send { .. })));
        assert!(a.scheduler().local_held_bytes() > 0);
        // The write fails (terminal): staging freed, the cancel goes out.
        a.handle(
            4,
            Input::WriteDone {
                write,
                result: Err("x".into()),
            },
        );
        let acts = drain(&mut a);
        assert!(acts.iter().any(|x| matches!(
            x,
            Action::Send { msg: Message::Want(w), .. } if w.is_cancel() && w.request_id == 1
        )));
        assert_eq!(a.scheduler().free_bytes(), a.scheduler().capacity());
    }

    #[test]
    fn late_data_after_a_cancel_is_dropped() {
        let mut b = machine("b");
        let want = Message::Want(Want {
            request_id: 7,
            scope: 0,
            chunk_bytes: vec![512],
            endpoint: b"a".to_vec(),
        });
        b.handle(
            0,
            Input::Message {
                from: "a".into(),
                msg: want,
                route: Route::Usable,
            },
        );
        let region = drain(&mut b)
            .into_iter()
            .find_map(|x| match x {
                Action::Send {
                    msg: Message::Grant(g),
                    ..
                } => Some(g.credits[0].region_handle),
                _ => None,
            })
            .unwrap();
        let cancel = Message::Want(Want {
            request_id: 7,
            scope: 0,
            chunk_bytes: vec![],
            endpoint: b"a".to_vec(),
        });
        b.handle(
            1,
            Input::Message {
                from: "a".into(),
                msg: cancel,
                route: Route::Usable,
            },
        );
        let data = Message::Data(Data {
            request_id: 7,
            chunk_index: 0,
            region_handle: region,
            runs: run(512),
        });
        b.handle(
            2,
            Input::Message {
                from: "a".into(),
                msg: data,
                route: Route::Usable,
            },
        );
        assert!(!drain(&mut b)
            .iter()
            .any(|x| matches!(x, Action::StartScatter { .. })));
        assert_eq!(b.counters().data_rejected, 1);
        assert_eq!(b.scheduler().free_bytes(), b.scheduler().capacity());
    }

    fn with(mutations: Mutations) -> Machine {
        let mut m = machine("b");
        m.cfg.mutations = mutations;
        m
    }

    fn from_a(m: &mut Machine, now: Nanos, msg: Message) -> Vec<Action> {
        m.handle(
            now,
            Input::Message {
                from: "a".into(),
                msg,
                route: Route::Usable,
            },
        );
        drain(m)
    }

    fn grants(acts: &[Action]) -> Vec<Credit> {
        acts.iter()
            .filter_map(|x| match x {
                Action::Send {
                    msg: Message::Grant(g),
                    ..
                } => Some(g.credits.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    /// Bug 6 (docs/protocol.md): a replayed WANT of a forgotten sender must
    /// not re-create its flow, or a stale DATA is scattered from a region
    /// the fresh grant handed out again.
    #[test]
    fn a_replayed_want_after_a_forget_does_not_revive_the_flow() {
        for old_rule in [false, true] {
            let mut b = with(Mutations {
                no_flow_tombstones: old_rule,
                ..Mutations::default()
            });
            let want = Message::Want(Want {
                request_id: 1,
                scope: 0,
                chunk_bytes: vec![512],
                endpoint: b"a".to_vec(),
            });
            let region = grants(&from_a(&mut b, 0, want.clone()))[0].region_handle;
            b.handle(1, Input::PeerForgotten { peer: "a".into() });
            drain(&mut b);
            let regrant = grants(&from_a(&mut b, 2, want));
            let data = Message::Data(Data {
                request_id: 1,
                chunk_index: 0,
                region_handle: region,
                runs: run(512),
            });
            let scattered = from_a(&mut b, 3, data)
                .iter()
                .any(|x| matches!(x, Action::StartScatter { .. }));
            assert_eq!(regrant.is_empty(), !old_rule, "old rule {old_rule}");
            assert_eq!(scattered, old_rule, "old rule {old_rule}");
        }
    }

    /// Bug 5: a chunk whose credit is older than the request timeout is
    /// not written (the receiver may have reclaimed the region).
    #[test]
    fn a_credit_older_than_the_timeout_is_not_written() {
        for old_rule in [false, true] {
            let mut a = machine("a");
            a.cfg.mutations.legacy_credit_expiry = old_rule;
            a.cfg.copy_contexts = 1;
            a.exec_free = 1;
            a.handle(0, Input::PeerAdded { peer: "b".into() });
            // Two chunks; one copy context: chunk 1 stages only after
            // chunk 0's gather, which takes (almost) a timeout each.
            submit_to_b(&mut a, 0, 1, &[512, 512]);
            let credits: Vec<Credit> = (0..2)
                .map(|i| Credit {
                    chunk_index: i,
                    region_handle: 1024 * u64::from(i),
                    addr: 0,
                    len: 512,
                    device_id: 0,
                })
                .collect();
            a.handle(
                1,
                Input::Message {
                    from: "b".into(),
                    msg: Message::Grant(Grant {
                        request_id: 1,
                        credits,
                    }),
                    route: Route::Usable,
                },
            );
            let job = |acts: &[Action]| {
                acts.iter().find_map(|x| match x {
                    Action::StartGather { job, .. } => Some(*job),
                    _ => None,
                })
            };
            let j0 = job(&drain(&mut a)).unwrap();
            a.handle(
                T,
                Input::GatherDone {
                    job: j0,
                    result: Ok(ScatterList::Runs(run(512))),
                },
            );
            let acts = drain(&mut a);
            let j1 = job(&acts).unwrap();
            a.handle(
                2 * T,
                Input::GatherDone {
                    job: j1,
                    result: Ok(ScatterList::Runs(run(512))),
                },
            );
            let acts = drain(&mut a);
            let posted = acts
                .iter()
                .any(|x| matches!(x, Action::PostWrite { chunk: 1, .. }));
            assert_eq!(posted, old_rule, "old rule {old_rule}: {acts:?}");
        }
    }

    /// The silent-flow sweep must not reclaim a flow that reclaiming an
    /// earlier one just granted to: its GRANT is on the way to the sender.
    #[test]
    fn the_silence_sweep_spares_a_flow_it_just_granted_to() {
        for old_rule in [false, true] {
            let mut b = with(Mutations {
                legacy_silence_sweep: old_rule,
                ..Mutations::default()
            });
            let want = |rid, chunk_bytes: Vec<u64>| {
                Message::Want(Want {
                    request_id: rid,
                    scope: 0,
                    chunk_bytes,
                    endpoint: b"a".to_vec(),
                })
            };
            // Flow 1 takes the whole arena; flow 2 waits for space.
            assert_eq!(
                grants(&from_a(&mut b, 0, want(1, vec![2048, 2048]))).len(),
                2
            );
            assert!(grants(&from_a(&mut b, 0, want(2, vec![1024]))).is_empty());
            // Both silent for 2 × timeout: flow 1 is reclaimed, its space
            // granted to flow 2 — which must then be left alone.
            b.handle(2 * T + 1, Input::Tick);
            let granted = grants(&drain(&mut b));
            assert_eq!(granted.len(), 1, "old rule {old_rule}");
            let f2 = FlowKey::new("a", 2);
            assert_eq!(
                b.scheduler().held_by_flow(&f2, granted[0].region_handle),
                !old_rule,
                "old rule {old_rule}"
            );
        }
    }

    #[test]
    fn a_request_without_progress_times_out_at_its_deadline() {
        let mut a = machine("a");
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        submit_to_b(&mut a, 5, 1, &[256]);
        let d = a.next_deadline().unwrap();
        assert_eq!(d, 5 + T + 1);
        drain(&mut a);
        a.handle(d - 1, Input::Tick);
        assert!(a.has_request(1));
        a.handle(d, Input::Tick);
        assert!(!a.has_request(1));
        assert!(drain(&mut a).iter().any(|x| matches!(
            x,
            Action::Resolve {
                rid: 1,
                timed_out: true,
                ..
            }
        )));
    }

    fn want(rid: u64, sizes: &[u64], scope: u64) -> Message {
        Message::Want(Want {
            request_id: rid,
            scope,
            chunk_bytes: sizes.to_vec(),
            endpoint: b"a".to_vec(),
        })
    }

    fn cancel(rid: u64) -> Message {
        want(rid, &[], 0)
    }

    fn rejects(acts: &[Action]) -> Vec<RejectReason> {
        acts.iter()
            .filter_map(|x| match x {
                Action::Send {
                    msg: Message::Reject(r),
                    ..
                } => Some(r.reason),
                _ => None,
            })
            .collect()
    }

    /// DATA_UNIFORM (issue 18 step 3) is checked like runs before anything
    /// is scattered: pieces past the granted region, a stride below the
    /// piece length, or one piece outside the destination's memory → no
    /// scatter, REJECT `InvalidRuns`; a valid one starts one scatter with
    /// the list as sent, and a quiesce of its destinations waits for it.
    #[test]
    fn uniform_data_is_validated_like_runs() {
        let uniform = |rid: u64, region: u64, len: u64, stride: u64, dsts: &[u64]| {
            Message::DataUniform(DataUniform {
                request_id: rid,
                chunk_index: 0,
                region_handle: region,
                scatter: UniformScatter {
                    segment_len: len,
                    region_stride: stride,
                    dsts: dsts.to_vec(),
                },
            })
        };
        let bad: [(&str, u64, u64, &[u64]); 5] = [
            (
                "past the region",
                256,
                256,
                &[0x1000, 0x2000, 0x3000, 0x4000, 0x5000],
            ),
            ("stride below length", 256, 128, &[0x1000, 0x2000]),
            (
                "outside memory",
                256,
                256,
                &[0x1000, 0x10_0000 + 0xF_FF00 + 0x200],
            ),
            ("empty", 0, 0, &[0x1000]),
            // Starts inside the agent's memory [0x1000, 0x101000), ends past it.
            ("ends past memory", 256, 256, &[0x1000, 0x10_1000 - 128]),
        ];
        for (k, (what, len, stride, dsts)) in bad.into_iter().enumerate() {
            let mut b = machine("b");
            let rid = 10 + k as u64;
            let g = grants(&from_a(&mut b, 1, want(rid, &[1024], 0)));
            assert_eq!(g.len(), 1, "{what}");
            let acts = from_a(
                &mut b,
                2,
                uniform(rid, g[0].region_handle, len, stride, dsts),
            );
            assert_eq!(rejects(&acts), [RejectReason::InvalidRuns], "{what}");
            assert!(
                !acts
                    .iter()
                    .any(|x| matches!(x, Action::StartScatter { .. })),
                "{what}"
            );
            assert_eq!(b.counters().data_rejected, 1, "{what}");
        }
        // Two registered ranges: pieces in both are valid (no one range
        // holds them all: checked piece by piece), a piece in the gap
        // between them and one whose end overflows are not.
        for (what, dsts, ok) in [
            ("both ranges", &[0x2000u64, 0x20_0000][..], true),
            ("in the gap", &[0x2000, 0x18_0000], false),
            // Lowest and highest each in a range, one between them not.
            (
                "ends in ranges, middle in the gap",
                &[0x2000, 0x18_0000, 0x20_0000],
                false,
            ),
            ("overflows", &[0x2000, u64::MAX - 16], false),
        ] {
            let mut b = machine("b");
            b.handle(
                1,
                Input::AllowScatter {
                    addr: 0x20_0000,
                    len: 0x1000,
                },
            );
            let g = grants(&from_a(&mut b, 1, want(1, &[1024], 0)));
            let acts = from_a(&mut b, 2, uniform(1, g[0].region_handle, 256, 256, dsts));
            let started = acts
                .iter()
                .any(|x| matches!(x, Action::StartScatter { .. }));
            assert_eq!(started, ok, "{what}: {acts:?}");
            let want_rejects: &[RejectReason] = if ok {
                &[]
            } else {
                &[RejectReason::InvalidRuns]
            };
            assert_eq!(rejects(&acts), want_rejects, "{what}");
        }
        // Valid: four 256-byte pieces, one per page, out of order.
        let mut b = machine("b");
        let g = grants(&from_a(&mut b, 1, want(1, &[1024], 0)));
        let dsts = [0x4000u64, 0x1000, 0x3000, 0x2000];
        let acts = from_a(&mut b, 2, uniform(1, g[0].region_handle, 256, 256, &dsts));
        let scatter = acts.iter().find_map(|x| match x {
            Action::StartScatter { job, runs, .. } => Some((*job, runs.clone())),
            _ => None,
        });
        let Some((job, ScatterList::Uniform(u))) = scatter else {
            panic!("{acts:?}")
        };
        assert_eq!(u.dsts, dsts);
        assert!(rejects(&acts).is_empty());
        // A quiesce of [0x3000, 0x3100) waits for the scatter.
        b.handle(
            3,
            Input::QuiesceScatter {
                id: 7,
                addr: 0x3000,
                len: 0x100,
            },
        );
        assert!(!drain(&mut b)
            .iter()
            .any(|x| matches!(x, Action::Quiesced { id: 7 })));
        b.handle(
            4,
            Input::ScatterDone {
                job,
                result: Ok(()),
            },
        );
        let acts = drain(&mut b);
        assert!(
            acts.iter().any(|x| matches!(x, Action::Quiesced { id: 7 })),
            "{acts:?}"
        );
        assert_eq!(b.counters().chunks_scattered, 1);

        // A scoped flow: pieces only into its engine's pool, not the
        // agent's own memory; and an agent with `uniformData` off refuses
        // even a valid list.
        for (what, scope, take, dsts, ok) in [
            (
                "own memory for scope 3",
                3,
                true,
                [0x40_0000u64, 0x1000],
                false,
            ),
            ("scope 3's pool", 3, true, [0x40_1000, 0x40_0000], true),
            ("uniformData off", 0, false, [0x1000, 0x2000], false),
        ] {
            let mut b = machine("b");
            b.cfg.uniform_data = take;
            b.handle(
                0,
                Input::AllowScope {
                    scope: 3,
                    addr: 0x40_0000,
                    len: 1 << 20,
                },
            );
            let g = grants(&from_a(&mut b, 1, want(1, &[1024], scope)));
            let acts = from_a(&mut b, 2, uniform(1, g[0].region_handle, 256, 256, &dsts));
            let started = acts
                .iter()
                .any(|x| matches!(x, Action::StartScatter { .. }));
            assert_eq!(started, ok, "{what}");
            let want_rejects: &[RejectReason] = if ok {
                &[]
            } else {
                &[RejectReason::InvalidRuns]
            };
            assert_eq!(rejects(&acts), want_rejects, "{what}");
        }
    }

    /// DATA_BLOCKS (issue 18 step 3): pieces named by block and plane are
    /// scattered as named when every derived destination is inside
    /// memory, across planes, from a first piece inside a plane and over
    /// two registered ranges; refused (REJECT `InvalidRuns`, no scatter)
    /// past the region, outside memory, in the gap between two ranges, on
    /// overflow, and by an agent with `blockData` off.
    #[test]
    fn block_data_is_validated_like_uniform_data() {
        let blocks = |region: u64, count: u32, first: u64, plane: u64, offsets: &[u64]| {
            Message::DataBlocks(DataBlocks {
                request_id: 1,
                chunk_index: 0,
                region_handle: region,
                scatter: crate::BlockScatter {
                    segment_len: 256,
                    region_stride: 256,
                    first,
                    count,
                    plane_stride: plane,
                    offsets: offsets.to_vec(),
                },
            })
        };
        // Memory: the agent's [0x1000, 0x101000) and [0x20_0000, +0x1000).
        // (what, blockData, count, first, plane stride, offsets, the
        // destinations scattered or None for a REJECT)
        type Case<'a> = (&'a str, bool, u32, u64, u64, &'a [u64], Option<&'a [u64]>);
        let cases: [Case<'_>; 8] = [
            (
                "two planes",
                true,
                4,
                0,
                0x1_0000,
                &[0x3000, 0x1000],
                Some(&[0x3000, 0x1000, 0x1_3000, 0x1_1000]),
            ),
            (
                "from inside a plane",
                true,
                4,
                1,
                0x1_0000,
                &[0x3000, 0x1000],
                Some(&[0x1000, 0x1_3000, 0x1_1000, 0x2_3000]),
            ),
            (
                "over two ranges",
                true,
                2,
                0,
                0x1F_E000,
                &[0x2000],
                Some(&[0x2000, 0x20_0000]),
            ),
            ("past the region", true, 5, 0, 0x1_0000, &[0x3000], None),
            (
                "plane outside memory",
                true,
                4,
                0,
                0x10_0000,
                &[0x3000, 0x1000],
                None,
            ),
            ("in the gap", true, 2, 0, 0x17_E000, &[0x2000], None),
            // Planes 1 and 2: 2 × (u64::MAX / 2) + 0x3000 wraps.
            (
                "overflows",
                true,
                4,
                2,
                u64::MAX / 2,
                &[0x3000, 0x1000],
                None,
            ),
            ("blockData off", false, 2, 0, 0x1000, &[0x3000], None),
        ];
        for (what, take, count, first, plane, offsets, expect) in cases {
            let mut b = machine("b");
            b.cfg.block_data = take;
            b.handle(
                1,
                Input::AllowScatter {
                    addr: 0x20_0000,
                    len: 0x1000,
                },
            );
            let g = grants(&from_a(&mut b, 1, want(1, &[1024], 0)));
            let acts = from_a(
                &mut b,
                2,
                blocks(g[0].region_handle, count, first, plane, offsets),
            );
            let scatter = acts.iter().find_map(|x| match x {
                Action::StartScatter { runs, .. } => Some(runs.clone()),
                _ => None,
            });
            match (expect, scatter) {
                (Some(dsts), Some(ScatterList::Blocks(s))) => {
                    assert_eq!(s.to_uniform().unwrap().dsts, dsts, "{what}");
                    assert!(rejects(&acts).is_empty(), "{what}");
                }
                (None, None) => {
                    assert_eq!(rejects(&acts), [RejectReason::InvalidRuns], "{what}");
                    assert_eq!(b.counters().data_rejected, 1, "{what}");
                }
                (expect, got) => panic!("{what}: wanted {expect:?}, got {got:?}"),
            }
        }
    }

    /// A DATA_UNIFORM that could not be sent fails its request at once,
    /// as a DATA does (review of issue 18 step 3: it used to wait for the
    /// timeout), and the uniform list a gather reports is what the DATA
    /// carries.
    #[test]
    fn a_uniform_data_that_did_not_leave_fails_its_request() {
        let (mut a, mut b) = (machine("a"), machine("b"));
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        submit_to_b(&mut a, 0, 1, &[512]);
        let list = UniformScatter {
            segment_len: 256,
            region_stride: 256,
            dsts: vec![0x2000, 0x1000],
        };
        let mut acts = drain(&mut a);
        let (mut resolved, mut sent_uniform) = (Vec::new(), 0);
        while let Some(act) = acts.pop() {
            match act {
                Action::Send {
                    msg: Message::DataUniform(d),
                    to,
                } => {
                    sent_uniform += 1;
                    assert_eq!(d.scatter, list);
                    a.handle(
                        2,
                        Input::SendFailed {
                            to,
                            msg: Message::DataUniform(d),
                        },
                    );
                    acts.extend(drain(&mut a));
                }
                Action::Send { msg, to } if to == "b" => acts.extend(from_a(&mut b, 1, msg)),
                Action::Send { msg, .. } => {
                    a.handle(
                        1,
                        Input::Message {
                            from: "b".into(),
                            msg,
                            route: Route::Usable,
                        },
                    );
                    acts.extend(drain(&mut a));
                }
                Action::StartGather { job, .. } => {
                    a.handle(
                        1,
                        Input::GatherDone {
                            job,
                            result: Ok(ScatterList::Uniform(list.clone())),
                        },
                    );
                    acts.extend(drain(&mut a));
                }
                Action::PostWrite { write, .. } => {
                    a.handle(
                        1,
                        Input::WriteDone {
                            write,
                            result: Ok(()),
                        },
                    );
                    acts.extend(drain(&mut a));
                }
                Action::Resolve { outcome, .. } => resolved.push(outcome),
                _ => {}
            }
        }
        assert_eq!(sent_uniform, 1);
        assert_eq!(
            resolved,
            vec![Outcome::Failure("could not send DATA for chunk 0".into())]
        );
    }

    /// The runtime's tombstone policy (transport.rs over in-order
    /// channels): no tombstone for a cancel naming a flow never seen, and
    /// at most `max` kept, the oldest evicted first and counted.
    #[test]
    fn the_runtime_tombstone_policy_skips_unknown_cancels_and_caps() {
        // Default (the simulator's): a cancel ahead of its WANT tombstones
        // the flow, so the late WANT is dropped.
        let mut b = machine("b");
        from_a(&mut b, 1, cancel(1));
        assert!(grants(&from_a(&mut b, 2, want(1, &[256], 0))).is_empty());
        assert_eq!(b.counters().wants_stale, 1);
        // The runtime's: the unknown cancel leaves nothing behind.
        let mut b = machine("b");
        b.set_tombstone_policy(2, false);
        from_a(&mut b, 1, cancel(1));
        assert_eq!(grants(&from_a(&mut b, 2, want(1, &[256], 0))).len(), 1);
        from_a(&mut b, 3, cancel(1));
        // Two more flows end: three tombstones, cap 2: flow 1 goes.
        for rid in [2, 3] {
            assert_eq!(grants(&from_a(&mut b, 4, want(rid, &[256], 0))).len(), 1);
            from_a(&mut b, 5, cancel(rid));
        }
        assert_eq!(b.counters().tombstones_evicted, 1);
        assert_eq!(grants(&from_a(&mut b, 6, want(1, &[256], 0))).len(), 1);
        assert!(grants(&from_a(&mut b, 6, want(3, &[256], 0))).is_empty());
        assert_eq!(b.counters().wants_stale, 1);
    }

    /// A GRANT that did not leave is not counted (its credits are
    /// reclaimed with the flow by the silence timeout).
    #[test]
    fn a_grant_that_did_not_leave_is_taken_back_from_the_counter() {
        let mut b = machine("b");
        let acts = from_a(&mut b, 1, want(1, &[256, 256], 0));
        assert_eq!(b.counters().grants, 2);
        for act in acts {
            if let Action::Send { to, msg } = act {
                b.handle(2, Input::SendFailed { to, msg });
            }
        }
        assert_eq!(b.counters().grants, 0);
    }

    /// A synchronous post error fails the request with its own reason, frees
    /// the staging at once (nothing reads it) and cancels at once.
    #[test]
    fn a_post_failure_fails_the_request_with_its_reason() {
        let (mut a, mut b) = (machine("a"), machine("b"));
        a.handle(0, Input::PeerAdded { peer: "b".into() });
        submit_to_b(&mut a, 0, 1, &[512]);
        let mut acts = drain(&mut a);
        let mut resolved = Vec::new();
        let mut cancels = 0;
        while let Some(act) = acts.pop() {
            match act {
                Action::Send { msg, .. } if matches!(&msg, Message::Want(w) if w.is_cancel()) => {
                    cancels += 1;
                    acts.extend(from_a(&mut b, 2, msg));
                }
                Action::Send { msg, to } if to == "b" => acts.extend(from_a(&mut b, 1, msg)),
                Action::Send { msg, .. } => {
                    a.handle(
                        1,
                        Input::Message {
                            from: "b".into(),
                            msg,
                            route: Route::Usable,
                        },
                    );
                    acts.extend(drain(&mut a));
                }
                Action::StartGather { job, .. } => {
                    a.handle(
                        1,
                        Input::GatherDone {
                            job,
                            result: Ok(ScatterList::Runs(run(512))),
                        },
                    );
                    acts.extend(drain(&mut a));
                }
                Action::PostWrite { write, .. } => {
                    a.handle(
                        1,
                        Input::PostFailed {
                            write,
                            why: "posting write of chunk 0: boom".into(),
                        },
                    );
                    acts.extend(drain(&mut a));
                }
                Action::Resolve { outcome, .. } => resolved.push(outcome),
                _ => {}
            }
        }
        assert_eq!(
            resolved,
            vec![Outcome::Failure("posting write of chunk 0: boom".into())]
        );
        assert_eq!(cancels, 1);
        quiet(&a);
        quiet(&b);
    }

    /// DATA of a flow whose engine scope closed is not scattered and its
    /// sender is told the scope detached (not that its runs were invalid).
    #[test]
    fn data_of_a_closed_scope_is_rejected_as_detached() {
        let mut b = machine("b");
        b.handle(
            0,
            Input::AllowScope {
                scope: 5,
                addr: 0x1000,
                len: 1 << 20,
            },
        );
        let g = grants(&from_a(&mut b, 1, want(1, &[256], 5)));
        assert_eq!(g.len(), 1);
        b.handle(2, Input::ForgetScope { scope: 5 });
        assert_eq!(rejects(&drain(&mut b)), vec![RejectReason::ScopeDetached]);
        let acts = from_a(
            &mut b,
            3,
            Message::Data(Data {
                request_id: 1,
                chunk_index: 0,
                region_handle: g[0].region_handle,
                runs: run(256),
            }),
        );
        assert_eq!(rejects(&acts), vec![RejectReason::ScopeDetached]);
        assert!(!acts
            .iter()
            .any(|x| matches!(x, Action::StartScatter { .. })));
        assert_eq!(b.counters().data_rejected, 1);
    }

    /// A traced request's chunks report their stages, in order, with the
    /// actions; an untraced one's report none. The first GRANT's wait is
    /// counted once.
    #[test]
    fn traced_requests_queue_their_chunk_stages() {
        for traced in [false, true] {
            let (mut a, mut b) = (machine("a"), machine("b"));
            a.handle(0, Input::PeerAdded { peer: "b".into() });
            submit_to_b(&mut a, 0, 1, &[512, 512]);
            if traced {
                a.set_traced(1);
            }
            let mut stages = Vec::new();
            let mut accepted = 0;
            let mut t = 1_000_000;
            loop {
                let mut steps: Vec<(bool, Step)> =
                    std::iter::from_fn(|| a.poll()).map(|x| (true, x)).collect();
                steps.extend(std::iter::from_fn(|| b.poll()).map(|x| (false, x)));
                if steps.is_empty() {
                    break;
                }
                t += 1_000_000;
                for (from_a, step) in steps {
                    let (me, other, my_name) = if from_a {
                        (&mut a, &mut b, "a")
                    } else {
                        (&mut b, &mut a, "b")
                    };
                    let act = match step {
                        Step::Event(Event::Stage { rid, chunk, stage }) => {
                            assert!(from_a);
                            stages.push((rid, chunk, stage));
                            continue;
                        }
                        Step::Event(Event::FlowAccepted { chunks }) => {
                            assert!(!from_a);
                            accepted += chunks;
                            continue;
                        }
                        Step::Action(act) => act,
                    };
                    match act {
                        Action::Send { msg, .. } => other.handle(
                            t,
                            Input::Message {
                                from: my_name.into(),
                                msg,
                                route: Route::Usable,
                            },
                        ),
                        Action::StartGather { job, bound, .. } => me.handle(
                            t,
                            Input::GatherDone {
                                job,
                                result: Ok(ScatterList::Runs(run(bound.packed_bytes))),
                            },
                        ),
                        Action::PostWrite { write, .. } => me.handle(
                            t,
                            Input::WriteDone {
                                write,
                                result: Ok(()),
                            },
                        ),
                        Action::StartScatter { job, .. } => me.handle(
                            t,
                            Input::ScatterDone {
                                job,
                                result: Ok(()),
                            },
                        ),
                        Action::Resolve { outcome, .. } => assert_eq!(outcome, Outcome::Success),
                        _ => {}
                    }
                }
            }
            use ChunkStage::*;
            if traced {
                let mut per_chunk: Vec<Vec<ChunkStage>> = vec![Vec::new(); 2];
                for (rid, chunk, stage) in stages {
                    assert_eq!(rid, 1);
                    per_chunk[chunk as usize].push(stage);
                }
                assert_eq!(per_chunk, vec![vec![Gathered, DataSent, Acked]; 2]);
            } else {
                assert!(stages.is_empty());
            }
            // The flow's two chunks, W = 2.
            assert_eq!(accepted, 2);
            // WANT at 0 (submit), its GRANT delivered in the third round.
            assert_eq!(a.counters().credit_wait_us, 3_000);
            assert_eq!(a.counters().succeeded, 1);
            quiet(&a);
            quiet(&b);
        }
    }
}
