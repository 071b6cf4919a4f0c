//! Deterministic simulator of the bounce protocol (issue 17, steps 3–4):
//! several [`Machine`]s, a virtual clock, one seeded PRNG, a faulty
//! network and faulty copy / write engines. See docs/protocol.md.
//!
//! A run is a pure function of `(seed, budget, mutations)`: every choice
//! comes from [`Rng`] streams split off the seed, every collection is
//! ordered. A violated invariant returns [`Failure`] with the step, the
//! virtual time and — when run with `trace` — the event list.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;

use kvfabric_core::plan::ChunkBound;
use kvfabric_core::protocol::{
    Action, Config, Counters, Input, Machine, Mutations, Nanos, Outcome, Route,
};
use kvfabric_core::wire::{
    Ack, Credit, Data, DataBlocks, DataUniform, Grant, Message, Reject, RejectReason, Want,
};
use kvfabric_core::{BlockScatter, FlowKey, ScatterList, ScatterRun, UniformScatter};

/// The simulator's generator ([`kvfabric_core::rng::SplitMix64`]).
pub type Rng = kvfabric_core::rng::SplitMix64;

const MS: Nanos = 1_000_000;
/// Request timeout of every machine (virtual).
pub const TIMEOUT: Nanos = 1_000 * MS;
/// Slack on "resolves within the timeout of its last progress": the
/// simulator feeds `Tick` exactly at `next_deadline`, so 0 would do; 1 ms
/// absorbs events sharing that instant.
pub const SLACK: Nanos = MS;
/// Slowest gather / write / scatter and slowest control message. The
/// timing assumption of the protocol (docs/protocol.md): one control
/// message plus one write take less than the request timeout.
const SLOW_MAX: Nanos = 550 * MS;
const NET_SLOW_MAX: Nanos = 400 * MS;
const _: () = assert!(SLOW_MAX + NET_SLOW_MAX < TIMEOUT);
const GRAN: u64 = 256;
const MAX_CHUNK: u64 = 1024;
/// Scatter destinations: two "tenant" halves of registered memory.
const DST_BASE: u64 = 0x1000_0000;
const DST_HALF: u64 = 0x0100_0000;
const ARENA_BASE: u64 = 0x7000_0000;
/// The name forged messages come from (never a real agent).
const ROGUE: &str = "rogue";
/// Engine pools (scoped world): `ENGINES` disjoint ranges per agent, the
/// first two attached at start (scopes 1 and 2), the third a spare range a
/// re-attached engine may map. Each chunk of a scoped request gets its own
/// `MAX_CHUNK` slot of the pool (a run-wide counter), so delivered bytes
/// can be checked in place.
const ENG_BASE: u64 = 0x4000_0000;
const ENG_LEN: u64 = 0x0100_0000;
const ENGINES: usize = 3;
const ENG_SLOTS: u64 = ENG_LEN / MAX_CHUNK;
/// Scope ids the scoped world never opens (requests naming one must fail).
const NEVER_SCOPE: u64 = 1_000_000;

/// Fault profile of one seed.
#[derive(Clone, Debug)]
struct Faults {
    calm: bool,
    drop: u64,
    dup: u64,
    reorder: bool,
    long_delay: u64,
    gather_fail: u64,
    scatter_fail: u64,
    write_fail: u64,
    slow_op: u64,
    crash: u64,
    shutdown: u64,
    cancel: u64,
    detach: u64,
    unroutable: u64,
    send_fail: u64,
    /// Spontaneous events that are forged messages from a peer named
    /// `rogue` (random fields: the machine must drop or survive them).
    rogue: u64,
    /// Spontaneous events that are bursts: every agent submits to every
    /// peer at once (calm seeds too).
    burst: u64,
    /// Some pairs learn of each other only later (WANTs then bootstrap
    /// the reverse route).
    late_register: bool,
    /// Scoped world: spontaneous events that detach an engine (per mille,
    /// drawn before the others: `ForgetScope` + quiesce of its pool, a new
    /// scope later, perhaps over the same range).
    engine_detach: u64,
    /// Scoped world: submits (per mille) that name a closed or never
    /// opened scope, or build their runs outside the scope's pool.
    bad_scope: u64,
}

/// Where an engine pool range of an agent stands (the simulator's own
/// notion, changed when the machine handles the input).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EngState {
    /// Attached: scope `.0` owns the range.
    Open(u64),
    /// `ForgetScope(.0)` handled; the pool waits for its quiesce.
    Closing(u64),
    /// Quiesced and unmapped; a new scope may map it.
    Unmapped,
}

/// A request's destination as the sender built it (scoped world).
#[derive(Clone, Debug)]
struct FlowMeta {
    scope: u64,
    /// Destination address and length per chunk (empty for scope 0).
    dst: Vec<(u64, u64)>,
    /// Named a closed or unknown scope, or runs outside its pool: must
    /// never succeed.
    expect_fail: bool,
}

#[derive(Clone, Debug)]
struct ScatterJob {
    region: u64,
    len: u64,
    flow: FlowKey,
    chunk: u32,
    tag: u64,
    /// Destination spans `[addr, end)` of the runs.
    dst: Vec<(u64, u64)>,
}

/// One simulated agent slot (incarnations replace each other).
struct Agent {
    slot: usize,
    inc: u32,
    name: String,
    m: Option<Machine>,
    routes: BTreeSet<String>,
    registered: BTreeSet<String>,
    next_rid: u64,
    /// Live requests of this incarnation: rid → tracking.
    reqs: BTreeMap<u64, ReqTrack>,
    /// Arena contents: offset → (len, tag).
    mem: BTreeMap<u64, (u64, u64)>,
    /// Destination memory (engine pools): addr → (len, tag).
    dmem: BTreeMap<u64, (u64, u64)>,
    /// Running gathers: job → (local, len, tag, destination address).
    gathers: BTreeMap<u64, (u64, u64, u64, Option<u64>)>,
    /// Sender side: write id → (peer, local, bytes, region, rid, chunk).
    writes_out: BTreeMap<u64, WriteOut>,
    scatters: BTreeMap<u64, ScatterJob>,
    /// Tenant halves currently unmapped (after their Quiesced).
    unmapped: [bool; 2],
    /// Quiesce id → half, waiting.
    detaching: BTreeMap<u64, usize>,
    /// Engine pool ranges (scoped world; empty otherwise).
    engines: Vec<EngState>,
    /// Scopes closed so far, with their pool index.
    closed_scopes: Vec<(u64, usize)>,
    next_scope: u64,
    /// Quiesce id → engine pool, waiting (a detach).
    eng_detaching: BTreeMap<u64, usize>,
    inputs: VecDeque<Input>,
    shutting: bool,
    down: bool,
}

#[derive(Clone, Debug)]
struct WriteOut {
    peer: String,
    local: u64,
    bytes: u64,
    region: u64,
    rid: u64,
    chunk: u32,
}

#[derive(Clone, Debug)]
struct ReqTrack {
    peer: String,
    submitted: Nanos,
    chunks: usize,
    /// Destination address per chunk (scoped requests; empty for scope 0).
    dst: Vec<u64>,
}

#[derive(Clone, Debug)]
enum Ev {
    Deliver {
        to: String,
        from: String,
        msg: Message,
    },
    Gather {
        slot: usize,
        inc: u32,
        job: u64,
        ok: bool,
    },
    Write {
        slot: usize,
        inc: u32,
        write: u64,
        ok: bool,
        scribble: bool,
    },
    Scatter {
        slot: usize,
        inc: u32,
        job: u64,
        ok: bool,
    },
    Restart {
        slot: usize,
    },
    Learn {
        slot: usize,
        inc: u32,
        peer: String,
        add: bool,
    },
    Abandon {
        slot: usize,
        inc: u32,
    },
    Reattach {
        slot: usize,
        inc: u32,
        half: usize,
    },
    /// An engine attaches over a free pool range (`engine` preferred:
    /// address reuse) under a new scope id.
    Reopen {
        slot: usize,
        inc: u32,
        engine: usize,
    },
}

/// Why a run failed.
#[derive(Debug, Clone)]
pub struct Failure {
    pub seed: u64,
    pub budget: usize,
    pub step: u64,
    pub now: Nanos,
    pub what: String,
    pub trace: Vec<String>,
    /// Run in the scoped world (`false`: `KVFABRIC_SIM_WORLD=legacy`).
    pub scoped: bool,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "seed {} (budget {}) failed at step {}, t = {:.3} ms: {}",
            self.seed,
            self.budget,
            self.step,
            self.now as f64 / MS as f64,
            self.what
        )?;
        if !self.trace.is_empty() {
            writeln!(
                f,
                "event list ({} lines; `n` = agent slot, indented = its actions):",
                self.trace.len()
            )?;
            for l in &self.trace {
                writeln!(f, "  {l}")?;
            }
            writeln!(f, "=> {}", self.what)?;
        }
        write!(
            f,
            "replay: KVFABRIC_SIM_REPLAY={} KVFABRIC_SIM_BUDGET={}{} cargo test -p kvfabric-core --test protocol_sim replay -- --nocapture",
            self.seed,
            self.budget,
            if self.scoped { "" } else { " KVFABRIC_SIM_WORLD=legacy" }
        )
    }
}

/// Per-run statistics (for the summary line).
#[derive(Default, Debug, Clone)]
pub struct Stats {
    pub steps: u64,
    pub submitted: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub crashes: u64,
    pub violations: u64,
    /// Scatters started from a DATA_UNIFORM (issue 18 step 3).
    pub uniform_scatters: u64,
    /// Scatters started from a DATA_BLOCKS (issue 18 step 3).
    pub block_scatters: u64,
    /// Machine counters summed over every incarnation.
    pub counters: Counters,
}

/// Adds `b` into `a`, field by field.
pub fn add_counters(a: &mut Counters, b: &Counters) {
    a.succeeded += b.succeeded;
    a.failed += b.failed;
    a.timeouts += b.timeouts;
    a.bytes_sent += b.bytes_sent;
    a.chunks_written += b.chunks_written;
    a.grants += b.grants;
    a.chunks_scattered += b.chunks_scattered;
    a.data_rejected += b.data_rejected;
    a.wants_rejected += b.wants_rejected;
    a.cancels_received += b.cancels_received;
    a.credits_rejected += b.credits_rejected;
    a.silent_flows += b.silent_flows;
    a.overdue_orphans += b.overdue_orphans;
    a.wants_stale += b.wants_stale;
    a.rejects_received += b.rejects_received;
    a.rejects_sent += b.rejects_sent;
    a.tombstones_evicted += b.tombstones_evicted;
    a.credit_wait_us += b.credit_wait_us;
}

impl Stats {
    /// Steps the run took.
    pub fn steps_total(&self) -> u64 {
        self.steps
    }
}

fn tag(name: &str, rid: u64, chunk: u32) -> u64 {
    // FNV-1a of the chunk's identity: its "checksum".
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name
        .bytes()
        .chain(rid.to_le_bytes())
        .chain(chunk.to_le_bytes())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn mem_write(mem: &mut BTreeMap<u64, (u64, u64)>, off: u64, len: u64, t: u64) {
    let end = off + len;
    let hit: Vec<u64> = mem
        .range(..end)
        .filter(|(&o, &(l, _))| o + l > off)
        .map(|(&o, _)| o)
        .collect();
    for o in hit {
        mem.remove(&o);
    }
    mem.insert(off, (len, t));
}

fn mem_read(mem: &BTreeMap<u64, (u64, u64)>, off: u64, len: u64) -> Option<u64> {
    match mem.get(&off) {
        Some(&(l, t)) if l == len => Some(t),
        _ => None,
    }
}

/// The simulator.
pub struct Sim {
    seed: u64,
    budget: usize,
    now: Nanos,
    step: u64,
    seq: u64,
    rng: Rng,
    /// Separate stream for spontaneous events, so a smaller budget keeps
    /// the same early schedule (shrinking).
    spont: Rng,
    faults: Faults,
    mutations: Mutations,
    agents: Vec<Agent>,
    queue: BTreeMap<(Nanos, u64), Ev>,
    /// Last delivery time per (from, to): FIFO links.
    link_last: BTreeMap<(String, String), Nanos>,
    /// Incoming writes per receiver name: (sender, write) → (region, bytes, flow).
    writes_in: BTreeMap<(String, u64), (String, u64, u64, FlowKey)>,
    /// Chunks scattered per flow: (sender, rid) → chunk → tag.
    delivered: BTreeMap<(String, u64), BTreeMap<u32, u64>>,
    next_spont: Nanos,
    spont_done: usize,
    /// Senders describe uniform chunks as DATA_UNIFORM (issue 18 step 3):
    /// odd gather jobs report their chunk as two equal pieces, and odd
    /// rogue DATA go out in the uniform form. Half the seeds; drawn from a
    /// generator of its own so every other choice stays as it was.
    uniform_data: bool,
    next_qid: u64,
    trace: Option<Vec<String>>,
    pub stats: Stats,
    cfg_base: Config,
    /// Engine scopes in play (the default world); off: the world of the
    /// simulator before scopes, run for run (the old regression seeds).
    scoped: bool,
    /// Stream of every scoped-world choice (the other two streams draw
    /// exactly what they drew before scopes).
    eng: Rng,
    /// Destination of every request submitted: (sender, rid) → meta.
    flows_meta: BTreeMap<(String, u64), FlowMeta>,
    /// Per agent, the deadline a reactor would keep until it passes
    /// (`Machine::next_deadline`'s contract: no input makes it earlier).
    deadline_kept: BTreeMap<usize, Nanos>,
    /// Scope of each rogue flow: (receiver, rid) → scope of the WANT
    /// that created it.
    rogue_scope: BTreeMap<(String, u64), u64>,
    /// Run-wide counter of engine pool slots handed to chunks.
    next_dst: u64,
}

type R = Result<(), String>;

impl Sim {
    pub fn new(seed: u64, budget: Option<usize>, mutations: Mutations, trace: bool) -> Self {
        Self::with_world(seed, budget, mutations, trace, true)
    }

    /// `scoped: false` is the world before engine scopes (scope 0 only),
    /// identical run for run to the simulator that found bugs 1–7.
    pub fn with_world(
        seed: u64,
        budget: Option<usize>,
        mutations: Mutations,
        trace: bool,
        scoped: bool,
    ) -> Self {
        let mut eng = Rng::new(seed ^ 0xE61E_E61E_5C0F_E5C0);
        let mut rng = Rng::new(seed);
        let spont = Rng::new(seed ^ 0x5EED_5EED_5EED_5EED);
        let calm = rng.chance(300);
        let p = |rng: &mut Rng, max: u64| if calm { 0 } else { rng.below(max + 1) };
        let faults = Faults {
            calm,
            drop: p(&mut rng, 60),
            dup: p(&mut rng, 60),
            reorder: !calm && rng.chance(500),
            long_delay: p(&mut rng, 40),
            gather_fail: p(&mut rng, 40),
            scatter_fail: p(&mut rng, 40),
            write_fail: p(&mut rng, 40),
            slow_op: p(&mut rng, 80),
            crash: p(&mut rng, 80),
            shutdown: p(&mut rng, 50),
            cancel: p(&mut rng, 100),
            detach: p(&mut rng, 60),
            unroutable: p(&mut rng, 30),
            send_fail: p(&mut rng, 20),
            rogue: p(&mut rng, 150),
            burst: rng.below(101),
            late_register: !calm && rng.chance(300),
            engine_detach: if scoped && !calm { eng.below(81) } else { 0 },
            bad_scope: if scoped && !calm { eng.below(121) } else { 0 },
        };
        let n = rng.range(3, 4) as usize;
        let arena_blocks = [2u64, 3, 4, 6][rng.below(4) as usize];
        let cfg_base = Config {
            arena_bytes: arena_blocks * MAX_CHUNK,
            granularity_bytes: GRAN,
            max_chunk_size_bytes: MAX_CHUNK,
            max_inflight_chunks: rng.range(1, 3) as usize,
            copy_contexts: rng.range(1, 3) as usize,
            request_timeout: TIMEOUT,
            eager_gather: !rng.chance(200),
            // Issue 18's sender rules, each on in half the scoped worlds
            // (the legacy world keeps the seed's, run for run); drawn from
            // generators of their own so every seed's other choices stay
            // what they were.
            eager_grant_order: scoped && Rng::new(seed ^ 0x0E46_E500_0000_0000).chance(500),
            release_staging_on_write: scoped && Rng::new(seed ^ 0x5E1E_A5E0_0000_0000).chance(500),
            // Half the scoped worlds run a receiver grant policy other
            // than round-robin (oldest first or shortest first, half
            // each); drawn from generators of their own so every seed's
            // other choices (and the legacy world) stay what they were.
            grant_policy: if scoped && Rng::new(seed ^ 0x01D5_F125_7000_0000).chance(500) {
                if Rng::new(seed ^ 0x5F1E_57F1_0000_0000).chance(500) {
                    kvfabric_core::scheduler::GrantPolicy::ShortestFirst
                } else {
                    kvfabric_core::scheduler::GrantPolicy::OldestFirst
                }
            } else {
                kvfabric_core::scheduler::GrantPolicy::RoundRobin
            },
            // Shortest first's aging at its fastest (1) or the default,
            // half each (its own generator).
            grant_size_weight: if Rng::new(seed ^ 0x5153_E160_0000_0000).chance(500) {
                1
            } else {
                kvfabric_core::scheduler::DEFAULT_SIZE_WEIGHT
            },
            uniform_data: true,
            block_data: true,
            arena_base: ARENA_BASE,
            device_id: 0,
            endpoint: Vec::new(),
            mutations,
        };
        let default_budget = rng.range(8, 24) as usize;
        let budget = budget.unwrap_or(default_budget);
        let mut sim = Sim {
            seed,
            budget,
            now: 0,
            step: 0,
            seq: 0,
            rng,
            spont,
            faults,
            mutations,
            agents: Vec::new(),
            deadline_kept: BTreeMap::new(),
            queue: BTreeMap::new(),
            link_last: BTreeMap::new(),
            writes_in: BTreeMap::new(),
            uniform_data: Rng::new(seed ^ 0x0DA7_A0F1_F0E0_0000).chance(500),
            delivered: BTreeMap::new(),
            next_spont: 0,
            spont_done: 0,
            next_qid: 1,
            trace: trace.then(Vec::new),
            stats: Stats::default(),
            cfg_base,
            scoped,
            eng,
            flows_meta: BTreeMap::new(),
            rogue_scope: BTreeMap::new(),
            next_dst: 0,
        };
        for slot in 0..n {
            let a = sim.fresh_agent(slot, 0);
            sim.agents.push(a);
        }
        let names: Vec<String> = sim.agents.iter().map(|a| a.name.clone()).collect();
        for i in 0..n {
            for p in &names {
                if *p == sim.agents[i].name {
                    continue;
                }
                if sim.faults.late_register && sim.rng.chance(500) {
                    let t = sim.rng.range(0, 300 * MS);
                    let ev = Ev::Learn {
                        slot: i,
                        inc: 0,
                        peer: p.clone(),
                        add: true,
                    };
                    sim.at(t, ev);
                    continue;
                }
                let a = &mut sim.agents[i];
                a.routes.insert(p.clone());
                a.registered.insert(p.clone());
                a.inputs.push_back(Input::PeerAdded { peer: p.clone() });
            }
        }
        sim.next_spont = sim.spont.below(20 * MS);
        sim
    }

    fn fresh_agent(&self, slot: usize, inc: u32) -> Agent {
        let name = format!("a{slot}.{inc}");
        let mut cfg = self.cfg_base.clone();
        cfg.endpoint = name.as_bytes().to_vec();
        let mut m = Machine::new(cfg).expect("valid config");
        m.handle(
            self.now,
            Input::AllowScatter {
                addr: DST_BASE,
                len: DST_HALF,
            },
        );
        m.handle(
            self.now,
            Input::AllowScatter {
                addr: DST_BASE + DST_HALF,
                len: DST_HALF,
            },
        );
        let mut engines = Vec::new();
        if self.scoped {
            // Two engines attached from the start (scopes 1 and 2), a
            // spare range for engines attaching later.
            for k in 0..ENGINES {
                if k < 2 {
                    let scope = k as u64 + 1;
                    m.handle(
                        self.now,
                        Input::AllowScope {
                            scope,
                            addr: eng_base(k),
                            len: ENG_LEN,
                        },
                    );
                    engines.push(EngState::Open(scope));
                } else {
                    engines.push(EngState::Unmapped);
                }
            }
        }
        Agent {
            slot,
            inc,
            name,
            m: Some(m),
            routes: BTreeSet::new(),
            registered: BTreeSet::new(),
            next_rid: 1,
            reqs: BTreeMap::new(),
            mem: BTreeMap::new(),
            dmem: BTreeMap::new(),
            gathers: BTreeMap::new(),
            writes_out: BTreeMap::new(),
            scatters: BTreeMap::new(),
            unmapped: [false; 2],
            detaching: BTreeMap::new(),
            next_scope: engines.len().min(2) as u64 + 1,
            engines,
            closed_scopes: Vec::new(),
            eng_detaching: BTreeMap::new(),
            inputs: VecDeque::new(),
            shutting: false,
            down: false,
        }
    }

    /// Runs to the end and returns the event list (needs `trace`).
    pub fn trace_of(mut self) -> Vec<String> {
        let r = self.run_inner();
        let mut t = self.trace.take().unwrap_or_default();
        t.push(format!("end: {r:?}"));
        t
    }

    fn note(&mut self, f: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            let line = f();
            t.push(format!(
                "[{:>5}] {:>10.3} ms {line}",
                self.step,
                self.now as f64 / MS as f64
            ));
        }
    }

    fn at(&mut self, t: Nanos, ev: Ev) {
        self.seq += 1;
        self.queue.insert((t, self.seq), ev);
    }

    fn slot_of(&self, name: &str) -> Option<usize> {
        self.agents
            .iter()
            .position(|a| a.name == name && a.m.is_some() && !a.down)
    }

    fn op_delay(&mut self) -> Nanos {
        if self.rng.chance(self.faults.slow_op) {
            self.rng.range(50 * MS, SLOW_MAX)
        } else {
            self.rng.range(0, 2 * MS)
        }
    }

    fn net_delay(&mut self) -> Nanos {
        if self.rng.chance(self.faults.long_delay) {
            self.rng.range(20 * MS, NET_SLOW_MAX)
        } else {
            self.rng.range(0, 3 * MS)
        }
    }

    /// Runs to quiescence; `Err` on the first violated invariant.
    pub fn run(&mut self) -> Result<Stats, Failure> {
        match self.run_inner() {
            Ok(()) => {
                self.stats.steps = self.step;
                for a in &self.agents {
                    if let Some(m) = &a.m {
                        add_counters(&mut self.stats.counters, m.counters());
                    }
                }
                Ok(self.stats.clone())
            }
            Err(what) => Err(Failure {
                seed: self.seed,
                budget: self.budget,
                step: self.step,
                now: self.now,
                what,
                trace: self.trace.take().unwrap_or_default(),
                scoped: self.scoped,
            }),
        }
    }

    /// `Machine::keepable_deadline`: no input moves `next_deadline` before
    /// a kept deadline that has not passed, so the runtime's reactor keeps
    /// one until then instead of rescanning every request and flow after
    /// each input; a machine breaking that would be ticked late.
    fn check_deadlines_kept(&mut self) -> R {
        for (i, a) in self.agents.iter().enumerate() {
            let Some(m) = a.m.as_ref().filter(|_| !a.down) else {
                self.deadline_kept.remove(&i);
                continue;
            };
            let d = m.next_deadline();
            match (self.deadline_kept.get(&i), d) {
                (Some(&kept), Some(d)) if self.now < kept && d < kept => {
                    return Err(format!(
                        "agent {i}: next deadline {d} moved before the kept {kept} (now {})",
                        self.now
                    ));
                }
                (Some(&kept), _) if self.now < kept => {}
                _ => match m.keepable_deadline() {
                    Some(d) => {
                        self.deadline_kept.insert(i, d);
                    }
                    None => {
                        self.deadline_kept.remove(&i);
                    }
                },
            }
        }
        Ok(())
    }

    fn run_inner(&mut self) -> R {
        self.settle()?;
        loop {
            self.step += 1;
            if self.step > 200_000 {
                return Err("did not quiesce within 200,000 steps".into());
            }
            let active = self.spont_done < self.budget;
            self.check_deadlines_kept()?;
            let ev_t = self.queue.keys().next().map(|k| k.0);
            let dl = self
                .agents
                .iter()
                .enumerate()
                .filter_map(|(i, a)| {
                    a.m.as_ref()
                        .filter(|_| !a.down)
                        .and_then(|m| m.next_deadline())
                        .map(|d| (d, i))
                })
                .min();
            let sp_t = active.then_some(self.next_spont);
            let mut best: Option<(Nanos, u8)> = None;
            for (t, k) in [(ev_t, 0u8), (dl.map(|d| d.0), 1), (sp_t, 2)] {
                if let Some(t) = t {
                    if best.is_none_or(|b| t < b.0) {
                        best = Some((t, k));
                    }
                }
            }
            let Some((t, kind)) = best else { break };
            self.now = self.now.max(t);
            match kind {
                0 => {
                    let (_, ev) = self.queue.pop_first().expect("non-empty");
                    self.apply(ev)?;
                }
                1 => {
                    let i = dl.expect("deadline").1;
                    self.note(|| format!("{} Tick", i));
                    self.agents[i].inputs.push_back(Input::Tick);
                }
                _ => {
                    self.spont_done += 1;
                    self.spontaneous()?;
                    self.next_spont = self.now + self.spont.range(0, 150 * MS);
                }
            }
            self.settle()?;
        }
        self.final_checks()
    }

    // ------------------------------------------------------------ events

    fn spontaneous(&mut self) -> R {
        let n = self.agents.len();
        let i = self.spont.below(n as u64) as usize;
        let f = self.faults.clone();
        let roll = self.spont.below(1000);
        let a = &self.agents[i];
        if a.down || a.m.is_none() {
            return Ok(());
        }
        if self.scoped && self.eng.chance(f.engine_detach) {
            return self.detach_engine(i);
        }
        if roll < f.crash {
            return self.crash(i, "crash");
        }
        if roll < f.crash + f.shutdown && !a.shutting {
            self.note(|| format!("{i} Shutdown"));
            self.agents[i].shutting = true;
            self.agents[i].inputs.push_back(Input::Shutdown);
            let inc = self.agents[i].inc;
            let t = self.now + self.spont.range(0, 900 * MS);
            self.at(t, Ev::Abandon { slot: i, inc });
            return Ok(());
        }
        if roll < f.crash + f.shutdown + f.cancel {
            // A burst of cancels.
            let rids: Vec<u64> = self.agents[i].reqs.keys().copied().collect();
            for rid in rids {
                if self.spont.chance(600) {
                    self.note(|| format!("{i} Cancel rid {rid}"));
                    self.agents[i].inputs.push_back(Input::Cancel {
                        rid,
                        why: "cancelled".into(),
                    });
                }
            }
            return Ok(());
        }
        if roll >= 1000 - f.rogue {
            return self.rogue(i);
        }
        if roll >= 1000 - f.rogue - f.burst {
            return self.burst();
        }
        if roll < f.crash + f.shutdown + f.cancel + f.detach {
            let half = self.spont.below(2) as usize;
            if self.agents[i].unmapped[half]
                || self.agents[i].detaching.values().any(|&h| h == half)
            {
                return Ok(());
            }
            let id = self.next_qid;
            self.next_qid += 1;
            self.note(|| format!("{i} DisallowScatter half {half} (id {id})"));
            self.agents[i].detaching.insert(id, half);
            self.agents[i].inputs.push_back(Input::DisallowScatter {
                id,
                addr: DST_BASE + half as u64 * DST_HALF,
                len: DST_HALF,
            });
            return Ok(());
        }
        // Submit 1–5 chunks to a random peer.
        let peers: Vec<String> = self.agents[i].registered.iter().cloned().collect();
        let peer = if peers.is_empty() || (!f.calm && self.spont.chance(30)) {
            format!("a{}.99", self.spont.below(n as u64))
        } else {
            peers[self.spont.below(peers.len() as u64) as usize].clone()
        };
        let k = self.spont.range(1, 5);
        let sizes: Vec<u64> = (0..k)
            .map(|_| self.spont.range(1, MAX_CHUNK / 32) * 32)
            .collect();
        self.submit(i, peer, &sizes);
        Ok(())
    }

    /// Every live agent submits a request of 1–3 large chunks to every
    /// peer it knows, all at once (traffic both ways over small arenas).
    fn burst(&mut self) -> R {
        self.note(|| "burst".to_string());
        for i in 0..self.agents.len() {
            if self.agents[i].down || self.agents[i].shutting {
                continue;
            }
            let peers: Vec<String> = self.agents[i].registered.iter().cloned().collect();
            for peer in peers {
                let k = self.spont.range(1, 3);
                let sizes: Vec<u64> = (0..k)
                    .map(|_| self.spont.range(MAX_CHUNK / 64, MAX_CHUNK / 32) * 32)
                    .collect();
                self.submit(i, peer, &sizes);
            }
        }
        Ok(())
    }

    fn submit(&mut self, i: usize, peer: String, sizes: &[u64]) {
        let k = sizes.len();
        let chunks: Vec<ChunkBound> = sizes
            .iter()
            .enumerate()
            .map(|(c, &b)| ChunkBound {
                index: c as u32,
                first_desc: c,
                first_done: 0,
                packed_bytes: b,
                payload_bytes: b,
                pieces: 1,
            })
            .collect();
        let meta = if self.scoped {
            self.pick_destination(&peer, sizes)
        } else {
            FlowMeta {
                scope: 0,
                dst: Vec::new(),
                expect_fail: false,
            }
        };
        let scope = meta.scope;
        let a = &mut self.agents[i];
        let rid = a.next_rid;
        a.next_rid += 1;
        a.reqs.insert(
            rid,
            ReqTrack {
                peer: peer.clone(),
                submitted: self.now,
                chunks: k,
                dst: meta.dst.iter().map(|d| d.0).collect(),
            },
        );
        let name = a.name.clone();
        self.stats.submitted += 1;
        self.note(|| {
            format!(
                "{i} Submit rid {rid} → {peer} scope {scope}{} chunks {sizes:?}",
                if meta.expect_fail { " (bad)" } else { "" }
            )
        });
        if self.scoped {
            self.flows_meta.insert((name, rid), meta);
        }
        self.agents[i].inputs.push_back(Input::Submit {
            rid,
            peer,
            scope,
            chunks,
        });
    }

    /// The destination of a scoped-world request to `peer` (the sender's
    /// view of the receiver's engine records): the agent's own memory, an
    /// attached engine, or — a fault — a closed scope, one never opened,
    /// or runs built into another pool than the scope's (a stale record).
    fn pick_destination(&mut self, peer: &str, sizes: &[u64]) -> FlowMeta {
        let calm = self.faults.calm;
        let bad = self.faults.bad_scope;
        let e = &mut self.eng;
        let Some(j) = self
            .agents
            .iter()
            .position(|a| a.name == peer && a.m.is_some())
        else {
            // Unknown or dead receiver: the request fails anyway.
            let scope = e.below(3);
            let pool = e.below(ENGINES as u64) as usize;
            return self.meta(scope, pool, sizes, false);
        };
        let open: Vec<(u64, usize)> = self.agents[j]
            .engines
            .iter()
            .enumerate()
            .filter_map(|(k, st)| match st {
                EngState::Open(s) => Some((*s, k)),
                _ => None,
            })
            .collect();
        let closed = self.agents[j].closed_scopes.clone();
        let roll = e.below(1000);
        if roll < 300 || open.is_empty() && (calm || roll >= 300 + bad) {
            return FlowMeta {
                scope: 0,
                dst: Vec::new(),
                expect_fail: false,
            };
        }
        if !calm && roll < 300 + bad {
            match e.below(3) {
                0 if !closed.is_empty() => {
                    let (scope, pool) = closed[e.below(closed.len() as u64) as usize];
                    return self.meta(scope, pool, sizes, true);
                }
                1 if !open.is_empty() => {
                    // An attached scope, runs into another pool.
                    let (scope, pool) = open[e.below(open.len() as u64) as usize];
                    let other = (pool + 1 + e.below(ENGINES as u64 - 1) as usize) % ENGINES;
                    return self.meta(scope, other, sizes, true);
                }
                _ => {
                    let scope = NEVER_SCOPE + e.below(1000);
                    let pool = e.below(ENGINES as u64) as usize;
                    return self.meta(scope, pool, sizes, true);
                }
            }
        }
        let (scope, pool) = open[e.below(open.len() as u64) as usize];
        self.meta(scope, pool, sizes, false)
    }

    fn meta(&mut self, scope: u64, pool: usize, sizes: &[u64], expect_fail: bool) -> FlowMeta {
        let dst = if scope == 0 {
            Vec::new()
        } else {
            sizes
                .iter()
                .map(|&b| {
                    let slot = self.next_dst % ENG_SLOTS;
                    self.next_dst += 1;
                    (eng_base(pool) + slot * MAX_CHUNK, b)
                })
                .collect()
        };
        FlowMeta {
            scope,
            dst,
            expect_fail,
        }
    }

    /// Engine `k` of agent `i` detaches, as `EngineHub::detach` does it:
    /// `ForgetScope`, then the pool's quiesce (`DisallowScatter`); once
    /// `Quiesced` answers the range is unmapped and an engine may attach
    /// there again later under a new scope id.
    fn detach_engine(&mut self, i: usize) -> R {
        let open: Vec<(usize, u64)> = self.agents[i]
            .engines
            .iter()
            .enumerate()
            .filter_map(|(k, st)| match st {
                EngState::Open(s) => Some((k, *s)),
                _ => None,
            })
            .collect();
        if open.is_empty() {
            return Ok(());
        }
        let (k, scope) = open[self.eng.below(open.len() as u64) as usize];
        let id = self.next_qid;
        self.next_qid += 1;
        self.note(|| {
            format!("{i} engine {k} detaches: ForgetScope {scope}, DisallowScatter (id {id})")
        });
        let a = &mut self.agents[i];
        a.eng_detaching.insert(id, k);
        a.inputs.push_back(Input::ForgetScope { scope });
        a.inputs.push_back(Input::DisallowScatter {
            id,
            addr: eng_base(k),
            len: ENG_LEN,
        });
        Ok(())
    }

    /// A forged message from `rogue` to agent `i`: plausible-looking random
    /// fields (small rids, region-aligned handles, runs in and out of
    /// registered memory, zero and huge sizes).
    fn rogue(&mut self, i: usize) -> R {
        // Scoped world: the WANT names a scope (own memory, an attached or
        // closed one, a foreign one); runs may aim at engine pools; some
        // forged messages are REJECTs (drawn from the scoped stream).
        let (w_scope, eng_addr, reject) = if self.scoped {
            let e = &mut self.eng;
            (
                [0, 1, 2, 3, 4, NEVER_SCOPE][e.below(6) as usize],
                Some(eng_base(e.below(ENGINES as u64) as usize) + e.below(4) * MAX_CHUNK),
                e.chance(100),
            )
        } else {
            (0, None, false)
        };
        let r = &mut self.spont;
        let rid = r.range(1, 4);
        let pick = |r: &mut Rng, xs: &[u64]| xs[r.below(xs.len() as u64) as usize];
        let msg = match r.below(4) {
            _ if reject => Message::Reject(Reject {
                request_id: rid,
                reason: RejectReason::ScopeDetached,
            }),
            0 => Message::Want(Want {
                request_id: rid,
                scope: w_scope,
                chunk_bytes: (0..r.below(4))
                    .map(|_| pick(r, &[0, 32, 256, 1000, MAX_CHUNK, 8 * MAX_CHUNK, u64::MAX]))
                    .collect(),
                endpoint: b"rogue".to_vec(),
            }),
            1 => Message::Grant(Grant {
                request_id: rid,
                credits: (0..r.range(1, 3))
                    .map(|_| Credit {
                        chunk_index: r.below(6) as u32,
                        region_handle: r.below(24) * GRAN,
                        addr: ARENA_BASE + r.below(24) * GRAN,
                        len: pick(r, &[0, 32, MAX_CHUNK, u64::MAX]),
                        device_id: 0,
                    })
                    .collect(),
            }),
            2 => Message::Data(Data {
                request_id: rid,
                chunk_index: r.below(6) as u32,
                region_handle: r.below(24) * GRAN,
                runs: (0..r.below(3))
                    .map(|_| ScatterRun {
                        region_offset: pick(r, &[0, 32, 512, MAX_CHUNK, u64::MAX - 8]),
                        addr: match eng_addr {
                            Some(a) if r.chance(500) => a,
                            _ => pick(r, &[0, DST_BASE, DST_BASE + DST_HALF - 64, u64::MAX - 64]),
                        },
                        segment_len: pick(r, &[0, 1, 64, MAX_CHUNK, u64::MAX]),
                        region_stride: pick(r, &[0, 64, u64::MAX]),
                        addr_stride: pick(r, &[0, 64, u64::MAX]),
                        count: pick(r, &[0, 1, 2, u64::from(u32::MAX)]) as u32,
                    })
                    .collect(),
            }),
            _ => Message::Ack(Ack {
                request_id: rid,
                chunk_index: r.below(6) as u32,
                region_handle: r.below(24) * GRAN,
            }),
        };
        // Odd rogue DATA in the uniform form: its runs' first length (the
        // pieces back to back in the region), one destination a run; one
        // in two of those in the block form (the destinations as the
        // blocks of a plane, from a piece inside one and into the next
        // plane, one piece length further on).
        let msg = match msg {
            Message::Data(d)
                if self.uniform_data && d.request_id % 4 == 3 && !d.runs.is_empty() =>
            {
                Message::DataBlocks(DataBlocks {
                    request_id: d.request_id,
                    chunk_index: d.chunk_index,
                    region_handle: d.region_handle,
                    scatter: BlockScatter {
                        segment_len: d.runs[0].segment_len,
                        region_stride: d.runs[0].segment_len,
                        first: u64::from(d.chunk_index) % d.runs.len() as u64,
                        count: d.runs.len() as u32 + 1,
                        plane_stride: d.runs[0].segment_len,
                        offsets: d.runs.iter().map(|r| r.addr).collect(),
                    },
                })
            }
            Message::Data(d)
                if self.uniform_data && d.request_id % 2 == 1 && !d.runs.is_empty() =>
            {
                Message::DataUniform(DataUniform {
                    request_id: d.request_id,
                    chunk_index: d.chunk_index,
                    region_handle: d.region_handle,
                    scatter: UniformScatter {
                        segment_len: d.runs[0].segment_len,
                        region_stride: d.runs[0].segment_len,
                        dsts: d.runs.iter().map(|r| r.addr).collect(),
                    },
                })
            }
            other => other,
        };
        let to = self.agents[i].name.clone();
        let t = self.now + self.net_delay();
        self.at(
            t,
            Ev::Deliver {
                to,
                from: ROGUE.into(),
                msg,
            },
        );
        Ok(())
    }

    /// The incarnation in `slot` dies now (crash, or the end of a
    /// shutdown): its machine and in-flight work vanish; the others forget
    /// it after a delay (or never: flow silence cleans up); it restarts
    /// under a new name.
    fn crash(&mut self, i: usize, why: &str) -> R {
        let name = self.agents[i].name.clone();
        self.note(|| format!("{i} {why}: {name} goes down"));
        self.stats.crashes += 1;
        let a = &mut self.agents[i];
        a.down = true;
        if let Some(m) = a.m.take() {
            add_counters(&mut self.stats.counters, m.counters());
        }
        a.reqs.clear();
        a.inputs.clear();
        // Writes it posted die with it (stated assumption); writes into its
        // arena land nowhere.
        self.writes_in.retain(|(s, _), _| *s != name);
        self.writes_in.retain(|_, (r, ..)| *r != name);
        let t = self.now + self.rng.range(0, 2 * TIMEOUT);
        self.at(t, Ev::Restart { slot: i });
        for j in 0..self.agents.len() {
            if j != i && !self.rng.chance(150) {
                let inc = self.agents[j].inc;
                let t = self.now + self.rng.range(0, 2 * TIMEOUT);
                self.at(
                    t,
                    Ev::Learn {
                        slot: j,
                        inc,
                        peer: name.clone(),
                        add: false,
                    },
                );
            }
        }
        Ok(())
    }

    fn apply(&mut self, ev: Ev) -> R {
        match ev {
            Ev::Deliver { to, from, msg } => {
                let Some(i) = self.slot_of(&to) else {
                    return Ok(());
                };
                let route = if let Message::Want(w) = &msg {
                    if w.is_cancel() || self.agents[i].routes.contains(&from) {
                        Route::Usable
                    } else if self.rng.chance(self.faults.unroutable) {
                        Route::Unusable
                    } else {
                        self.agents[i].routes.insert(from.clone());
                        Route::Usable
                    }
                } else {
                    Route::Usable
                };
                self.note(|| format!("{i} ← {from}: {}", short(&msg)));
                self.agents[i]
                    .inputs
                    .push_back(Input::Message { from, msg, route });
            }
            Ev::Gather { slot, inc, job, ok } => {
                if !self.alive(slot, inc) {
                    return Ok(());
                }
                let a = &mut self.agents[slot];
                let Some((local, len, t, dst)) = a.gathers.remove(&job) else {
                    return Err(format!("gather {job} completed twice"));
                };
                if ok {
                    mem_write(&mut a.mem, local, len, t);
                } else {
                    mem_write(&mut a.mem, local, len, 0xBAD);
                }
                self.note(|| format!("{slot} GatherDone job {job} ok {ok}"));
                let result = if ok {
                    // One contiguous run into the tenant half the request
                    // targets (the sender planned it).
                    let run = match dst {
                        Some(addr) => ScatterRun {
                            region_offset: 0,
                            addr,
                            segment_len: len,
                            region_stride: 0,
                            addr_stride: 0,
                            count: 1,
                        },
                        None => run_for(t, len),
                    };
                    Ok(if self.uniform_data && job % 4 == 3 && len % 2 == 0 {
                        // The same bytes as two equal pieces in two
                        // planes of one block.
                        let h = len / 2;
                        ScatterList::Blocks(BlockScatter {
                            segment_len: h,
                            region_stride: h,
                            first: 0,
                            count: 2,
                            plane_stride: h,
                            offsets: vec![run.addr],
                        })
                    } else if self.uniform_data && job % 2 == 1 && len % 2 == 0 {
                        // The same bytes as two equal pieces.
                        let h = len / 2;
                        ScatterList::Uniform(UniformScatter {
                            segment_len: h,
                            region_stride: h,
                            dsts: vec![run.addr, run.addr + h],
                        })
                    } else {
                        ScatterList::Runs(vec![run])
                    })
                } else {
                    Err("injected gather failure".into())
                };
                self.agents[slot]
                    .inputs
                    .push_back(Input::GatherDone { job, result });
            }
            Ev::Write {
                slot,
                inc,
                write,
                ok,
                scribble,
            } => {
                if !self.alive(slot, inc) {
                    return Ok(());
                }
                let sender = self.agents[slot].name.clone();
                let Some(w) = self.agents[slot].writes_out.remove(&write) else {
                    return Err(format!("write {write} completed twice"));
                };
                let content = mem_read(&self.agents[slot].mem, w.local, w.bytes);
                if let Some((recv, region, bytes, flow)) =
                    self.writes_in.remove(&(sender.clone(), write))
                {
                    if let Some(j) = self.slot_of(&recv) {
                        if ok || scribble {
                            let m = self.agents[j].m.as_ref().expect("alive");
                            if !m.scheduler().held_by_flow(&flow, region) {
                                return Err(format!(
                                    "write {write} of {flow} landed in region {region} of {recv} after the receiver freed it"
                                ));
                            }
                            let t = if ok {
                                content.unwrap_or(0xC0FFEE)
                            } else {
                                0xBAD
                            };
                            mem_write(&mut self.agents[j].mem, region, bytes, t);
                        }
                    }
                }
                self.note(|| format!("{slot} WriteDone write {write} ok {ok}"));
                let result = if ok {
                    Ok(())
                } else {
                    Err("injected write failure".into())
                };
                self.agents[slot]
                    .inputs
                    .push_back(Input::WriteDone { write, result });
            }
            Ev::Scatter { slot, inc, job, ok } => {
                if !self.alive(slot, inc) {
                    return Ok(());
                }
                let a = &mut self.agents[slot];
                let Some(ScatterJob {
                    region,
                    len,
                    flow,
                    chunk,
                    tag: t0,
                    dst,
                }) = a.scatters.remove(&job)
                else {
                    return Err(format!("scatter {job} completed twice"));
                };
                let t1 = mem_read(&a.mem, region, len);
                if flow.peer != ROGUE {
                    // The bytes land in the destination (a failed scatter
                    // leaves garbage there).
                    for &(d0, d1) in &dst {
                        mem_write(
                            &mut a.dmem,
                            d0,
                            d1 - d0,
                            if ok { t1.unwrap_or(0xC0FFEE) } else { 0xBAD },
                        );
                    }
                }
                if ok && flow.peer != ROGUE {
                    if t1 != Some(t0) {
                        return Err(format!(
                            "region {region} of {} changed while scattering chunk {chunk} of {flow}",
                            a.name
                        ));
                    }
                    self.delivered
                        .entry((flow.peer.clone(), flow.rid))
                        .or_default()
                        .insert(chunk, t0);
                }
                self.note(|| format!("{slot} ScatterDone job {job} ok {ok}"));
                let result = if ok {
                    Ok(())
                } else {
                    Err("injected scatter failure".into())
                };
                self.agents[slot]
                    .inputs
                    .push_back(Input::ScatterDone { job, result });
            }
            Ev::Restart { slot } => {
                let inc = self.agents[slot].inc + 1;
                let mut a = self.fresh_agent(slot, inc);
                let name = a.name.clone();
                self.note(|| format!("{slot} restarts as {name}"));
                // It learns the live peers; they learn it, each after a delay.
                for j in 0..self.agents.len() {
                    if j == slot || self.agents[j].down {
                        continue;
                    }
                    let peer = self.agents[j].name.clone();
                    let t = self.now + self.rng.range(0, 50 * MS);
                    self.at(
                        t,
                        Ev::Learn {
                            slot,
                            inc,
                            peer,
                            add: true,
                        },
                    );
                    let jinc = self.agents[j].inc;
                    let t = self.now + self.rng.range(0, 50 * MS);
                    self.at(
                        t,
                        Ev::Learn {
                            slot: j,
                            inc: jinc,
                            peer: name.clone(),
                            add: true,
                        },
                    );
                }
                a.down = false;
                self.agents[slot] = a;
            }
            Ev::Learn {
                slot,
                inc,
                peer,
                add,
            } => {
                if !self.alive(slot, inc) {
                    return Ok(());
                }
                self.note(|| {
                    format!(
                        "{slot} {} {peer}",
                        if add { "PeerAdded" } else { "PeerForgotten" }
                    )
                });
                let a = &mut self.agents[slot];
                if add {
                    a.routes.insert(peer.clone());
                    a.registered.insert(peer.clone());
                    a.inputs.push_back(Input::PeerAdded { peer });
                } else {
                    a.registered.remove(&peer);
                    a.inputs.push_back(Input::PeerForgotten { peer });
                }
            }
            Ev::Abandon { slot, inc } => {
                if !self.alive(slot, inc) {
                    return Ok(());
                }
                self.note(|| format!("{slot} AbandonInFlight"));
                self.agents[slot].inputs.push_back(Input::AbandonInFlight);
                self.settle()?;
                return self.crash(slot, "shutdown complete");
            }
            Ev::Reopen { slot, inc, engine } => {
                if !self.alive(slot, inc) {
                    return Ok(());
                }
                // Mostly the range the detached engine had (address
                // reuse), else any unmapped range.
                let a = &self.agents[slot];
                let free: Vec<usize> = (0..a.engines.len())
                    .filter(|&k| a.engines[k] == EngState::Unmapped)
                    .collect();
                if free.is_empty() {
                    return Ok(());
                }
                let k = if free.contains(&engine) && self.eng.chance(700) {
                    engine
                } else {
                    free[self.eng.below(free.len() as u64) as usize]
                };
                let a = &mut self.agents[slot];
                let scope = a.next_scope;
                a.next_scope += 1;
                a.inputs.push_back(Input::AllowScope {
                    scope,
                    addr: eng_base(k),
                    len: ENG_LEN,
                });
                self.note(|| format!("{slot} engine attaches over pool {k}: AllowScope {scope}"));
            }
            Ev::Reattach { slot, inc, half } => {
                if !self.alive(slot, inc) {
                    return Ok(());
                }
                self.note(|| format!("{slot} AllowScatter half {half}"));
                self.agents[slot].unmapped[half] = false;
                self.agents[slot].inputs.push_back(Input::AllowScatter {
                    addr: DST_BASE + half as u64 * DST_HALF,
                    len: DST_HALF,
                });
            }
        }
        Ok(())
    }

    fn alive(&self, slot: usize, inc: u32) -> bool {
        let a = &self.agents[slot];
        a.inc == inc && !a.down && a.m.is_some()
    }

    /// Feeds queued inputs and performs the actions until every agent is
    /// idle, checking the invariants of each touched agent.
    fn settle(&mut self) -> R {
        loop {
            let mut any = false;
            for i in 0..self.agents.len() {
                if self.agents[i].down {
                    self.agents[i].inputs.clear();
                    continue;
                }
                while let Some(input) = self.agents[i].inputs.pop_front() {
                    any = true;
                    let now = self.now;
                    let rogue_want = self.observe(i, &input);
                    let m = self.agents[i].m.as_mut().expect("alive");
                    m.handle(now, input);
                    if let Some((flow, scope)) = rogue_want {
                        if m.scheduler().contains_flow(&flow) {
                            let key = (self.agents[i].name.clone(), flow.rid);
                            self.rogue_scope.insert(key, scope);
                        }
                    }
                    while let Some(act) = self.agents[i].m.as_mut().expect("alive").poll_action() {
                        self.perform(i, act)?;
                    }
                    self.check_agent(i)?;
                }
            }
            if !any {
                break;
            }
        }
        self.check_global()
    }

    /// The simulator's notion of scopes follows the inputs as the machine
    /// handles them. Returns a rogue WANT's flow and scope when it may
    /// create that flow.
    fn observe(&mut self, i: usize, input: &Input) -> Option<(FlowKey, u64)> {
        let a = &mut self.agents[i];
        match input {
            Input::ForgetScope { scope } => {
                for (k, st) in a.engines.iter_mut().enumerate() {
                    if *st == EngState::Open(*scope) {
                        *st = EngState::Closing(*scope);
                        a.closed_scopes.push((*scope, k));
                    }
                }
            }
            Input::AllowScope { scope, addr, .. } => {
                let k = ((addr - ENG_BASE) / ENG_LEN) as usize;
                a.engines[k] = EngState::Open(*scope);
            }
            Input::Message {
                from,
                msg: Message::Want(w),
                ..
            } if from == ROGUE && !w.is_cancel() => {
                let flow = FlowKey::new(ROGUE, w.request_id);
                let had =
                    a.m.as_ref()
                        .is_some_and(|m| m.scheduler().contains_flow(&flow));
                if !had {
                    return Some((flow, w.scope));
                }
            }
            _ => {}
        }
        None
    }

    fn perform(&mut self, i: usize, act: Action) -> R {
        if self.trace.is_some() && !matches!(act, Action::Resolve { .. }) {
            let line = match &act {
                Action::Send { to, msg } => format!("{i}   → {to}: {}", short(msg)),
                Action::StartGather { job, rid, chunk, local, bound } => format!(
                    "{i}   StartGather job {job} rid {rid} chunk {chunk} into {local}+{}",
                    bound.packed_bytes
                ),
                Action::PostWrite { write, peer, rid, chunk, local, bytes, credit } => format!(
                    "{i}   PostWrite {write} rid {rid} chunk {chunk} {local}+{bytes} → {peer} region {}",
                    credit.region_handle
                ),
                Action::StartScatter { job, flow, region, chunk, .. } => {
                    format!("{i}   StartScatter job {job} {flow} chunk {chunk} region {region}")
                }
                other => format!("{i}   {other:?}"),
            };
            self.note(|| line);
        }
        let f = self.faults.clone();
        let name = self.agents[i].name.clone();
        match act {
            Action::Send { to, msg } => {
                if !self.agents[i].routes.contains(&to) || self.rng.chance(f.send_fail) {
                    self.note(|| format!("{i} send to {to} failed: {}", short(&msg)));
                    self.agents[i]
                        .inputs
                        .push_back(Input::SendFailed { to, msg });
                    return Ok(());
                }
                let copies = if self.rng.chance(f.drop) {
                    0
                } else if self.rng.chance(f.dup) {
                    2
                } else {
                    1
                };
                for _ in 0..copies {
                    let mut t = self.now + self.net_delay();
                    let link = (name.clone(), to.clone());
                    if !f.reorder {
                        let last = self.link_last.get(&link).copied().unwrap_or(0);
                        t = t.max(last);
                        self.link_last.insert(link, t);
                    }
                    self.at(
                        t,
                        Ev::Deliver {
                            to: to.clone(),
                            from: name.clone(),
                            msg: msg.clone(),
                        },
                    );
                }
            }
            Action::StartGather {
                job,
                rid,
                chunk,
                local,
                bound,
            } => {
                let len = bound.packed_bytes;
                let dst = self.agents[i]
                    .reqs
                    .get(&rid)
                    .and_then(|r| r.dst.get(chunk as usize).copied());
                self.agents[i]
                    .gathers
                    .insert(job, (local, len, tag(&name, rid, chunk), dst));
                let inc = self.agents[i].inc;
                let ok = !self.rng.chance(f.gather_fail);
                let t = self.now + self.op_delay();
                self.at(
                    t,
                    Ev::Gather {
                        slot: i,
                        inc,
                        job,
                        ok,
                    },
                );
            }
            Action::PostWrite {
                write,
                peer,
                rid,
                chunk,
                local,
                bytes,
                credit,
            } => {
                let region = credit.region_handle;
                self.agents[i].writes_out.insert(
                    write,
                    WriteOut {
                        peer: peer.clone(),
                        local,
                        bytes,
                        region,
                        rid,
                        chunk,
                    },
                );
                if self.slot_of(&peer).is_some() {
                    self.writes_in.insert(
                        (name.clone(), write),
                        (peer.clone(), region, bytes, FlowKey::new(name.clone(), rid)),
                    );
                }
                let inc = self.agents[i].inc;
                let ok = !self.rng.chance(f.write_fail);
                let scribble = !ok && self.rng.chance(500);
                let t = self.now + self.op_delay();
                self.at(
                    t,
                    Ev::Write {
                        slot: i,
                        inc,
                        write,
                        ok,
                        scribble,
                    },
                );
            }
            Action::StartScatter {
                job,
                flow,
                region,
                chunk,
                runs,
            } => {
                // The memory model keeps whole writes: pieces adjacent in
                // the region and at the destination are one write.
                let runs = match runs {
                    ScatterList::Uniform(u) => {
                        self.stats.uniform_scatters += 1;
                        join_adjacent(u.to_runs())
                    }
                    ScatterList::Blocks(b) => {
                        self.stats.block_scatters += 1;
                        // Validated: destinations do not overflow.
                        join_adjacent(b.to_uniform().expect("validated block scatter").to_runs())
                    }
                    ScatterList::Runs(r) => r,
                };
                let m = self.agents[i].m.as_ref().expect("alive");
                if !m.scheduler().held_by_flow(&flow, region) {
                    return Err(format!(
                        "scatter of chunk {chunk} of {flow} from region {region} of {name}, which the flow does not hold"
                    ));
                }
                // (A rogue's empty run list still reads the region: count a byte.)
                let len = runs
                    .iter()
                    .map(ScatterRun::total_bytes)
                    .fold(0u64, u64::saturating_add)
                    .max(1);
                let content = mem_read(&self.agents[i].mem, region, len);
                let want = tag(&flow.peer, flow.rid, chunk);
                // A rogue's scatters carry no data of ours to check.
                if content != Some(want) && flow.peer != ROGUE {
                    return Err(format!(
                        "scatter of chunk {chunk} of {flow} from region {region} of {name}: the region holds {content:?}, not the chunk's data"
                    ));
                }
                let scope = if !self.scoped {
                    0
                } else if flow.peer == ROGUE {
                    self.rogue_scope
                        .get(&(name.clone(), flow.rid))
                        .copied()
                        .unwrap_or(0)
                } else {
                    self.flows_meta
                        .get(&(flow.peer.clone(), flow.rid))
                        .map_or(0, |m| m.scope)
                };
                let mut dst = Vec::with_capacity(runs.len());
                for r in &runs {
                    let end = u64::from(r.count.saturating_sub(1))
                        .saturating_mul(r.addr_stride)
                        .saturating_add(r.addr)
                        .saturating_add(r.segment_len);
                    dst.push((r.addr, end));
                    if self.scoped && r.addr >= ENG_BASE && r.addr < eng_base(ENGINES) {
                        // An engine pool: it must be the pool of the
                        // flow's scope, attached now.
                        let k = ((r.addr - ENG_BASE) / ENG_LEN) as usize;
                        let st = self.agents[i].engines[k];
                        if st != EngState::Open(scope) || end > eng_base(k) + ENG_LEN {
                            return Err(format!(
                                "scatter of chunk {chunk} of {flow} (scope {scope}) into [{:#x}, {end:#x}): engine pool {k} of {name} is {st:?}, not scope {scope}'s",
                                r.addr
                            ));
                        }
                        continue;
                    }
                    let half = (r.addr.saturating_sub(DST_BASE) / DST_HALF) as usize;
                    if r.addr < DST_BASE {
                        return Err(format!(
                            "scatter to {:#x}, outside registered memory",
                            r.addr
                        ));
                    }
                    if half > 1 || self.agents[i].unmapped[half] {
                        return Err(format!(
                            "scatter of chunk {chunk} of {flow} into unmapped tenant memory {:#x}",
                            r.addr
                        ));
                    }
                    if scope != 0 {
                        return Err(format!(
                            "scatter of chunk {chunk} of {flow} (scope {scope}) into {:#x}, the agent's own memory, not the engine's pool",
                            r.addr
                        ));
                    }
                }
                self.agents[i].scatters.insert(
                    job,
                    ScatterJob {
                        region,
                        len,
                        flow,
                        chunk,
                        tag: want,
                        dst,
                    },
                );
                let inc = self.agents[i].inc;
                let ok = !self.rng.chance(f.scatter_fail);
                let t = self.now + self.op_delay();
                self.at(
                    t,
                    Ev::Scatter {
                        slot: i,
                        inc,
                        job,
                        ok,
                    },
                );
            }
            Action::ReleaseStaging { .. } => {}
            Action::Resolve {
                rid,
                outcome,
                timed_out,
            } => {
                let Some(r) = self.agents[i].reqs.remove(&rid) else {
                    return Err(format!(
                        "request {rid} of {name} resolved twice (or never submitted)"
                    ));
                };
                self.note(|| format!("{i} Resolve rid {rid}: {outcome:?} timed_out {timed_out}"));
                match outcome {
                    Outcome::Success => {
                        self.stats.succeeded += 1;
                        if let Some(meta) = self.flows_meta.get(&(name.clone(), rid)) {
                            if meta.expect_fail {
                                return Err(format!(
                                    "request {rid} of {name} to {} succeeded, but it named scope {} closed, never opened, or with runs outside its pool",
                                    r.peer, meta.scope
                                ));
                            }
                            // The bytes are in the destination engine's
                            // pool, exactly (while the receiver lives).
                            if let Some(j) = self.slot_of(&r.peer) {
                                for (c, &(addr, len)) in meta.dst.iter().enumerate() {
                                    let want = tag(&name, rid, c as u32);
                                    let have = mem_read(&self.agents[j].dmem, addr, len);
                                    if have != Some(want) {
                                        return Err(format!(
                                            "request {rid} of {name} succeeded but {} holds {have:?} at {addr:#x}+{len} (chunk {c}, scope {}), not {want:#x}",
                                            r.peer, meta.scope
                                        ));
                                    }
                                }
                            }
                        }
                        let got = self.delivered.get(&(name.clone(), rid));
                        for c in 0..r.chunks as u32 {
                            let want = tag(&name, rid, c);
                            let have = got.and_then(|g| g.get(&c)).copied();
                            if have != Some(want) {
                                return Err(format!(
                                    "request {rid} of {name} succeeded but chunk {c} delivered {have:?}, sent {want:#x}"
                                ));
                            }
                        }
                    }
                    Outcome::Failure(why) => {
                        self.stats.failed += 1;
                        if self.faults.calm {
                            return Err(format!(
                                "request {rid} of {name} to {} failed in a fault-free run: {why}",
                                r.peer
                            ));
                        }
                    }
                }
                self.delivered.remove(&(name, rid));
            }
            Action::ForgetRoute { peer } => {
                self.agents[i].routes.remove(&peer);
            }
            Action::Quiesced { id } => {
                if let Some(k) = self.agents[i].eng_detaching.remove(&id) {
                    self.note(|| format!("{i} Quiesced engine pool {k}: unmapped"));
                    self.agents[i].engines[k] = EngState::Unmapped;
                    if self.eng.chance(850) {
                        let inc = self.agents[i].inc;
                        let t = self.now + self.eng.range(0, 600 * MS);
                        self.at(
                            t,
                            Ev::Reopen {
                                slot: i,
                                inc,
                                engine: k,
                            },
                        );
                    }
                }
                if let Some(half) = self.agents[i].detaching.remove(&id) {
                    self.note(|| format!("{i} Quiesced half {half}"));
                    self.agents[i].unmapped[half] = true;
                    let inc = self.agents[i].inc;
                    let t = self.now + self.rng.range(0, 300 * MS);
                    self.at(t, Ev::Reattach { slot: i, inc, half });
                }
            }
            Action::ArenaInDoubt { writes } => {
                self.note(|| format!("{i} ArenaInDoubt ({writes} writes)"));
            }
        }
        Ok(())
    }

    // -------------------------------------------------------- invariants

    fn check_agent(&self, i: usize) -> R {
        let a = &self.agents[i];
        let Some(m) = &a.m else { return Ok(()) };
        let s = m.scheduler();
        s.check_conservation()
            .map_err(|e| format!("{}: conservation: {e}", a.name))?;
        // Every physical use of the arena is on an allocated block, and no
        // two uses overlap (one owner per region).
        let arena = s.arena();
        let mut uses: Vec<(u64, u64, String)> = Vec::new();
        for (job, &(off, len, ..)) in &a.gathers {
            uses.push((off, len, format!("gather {job}")));
        }
        for (w, wo) in &a.writes_out {
            uses.push((wo.local, wo.bytes, format!("write {w} source")));
        }
        for (job, sj) in &a.scatters {
            uses.push((sj.region, sj.len, format!("scatter {job}")));
        }
        for ((sender, w), (recv, region, bytes, _)) in &self.writes_in {
            if *recv == a.name {
                uses.push((*region, *bytes, format!("incoming write {w} of {sender}")));
            }
        }
        let mut spans = Vec::with_capacity(uses.len());
        for (off, len, what) in &uses {
            let Some(block) = arena.allocated_block(*off) else {
                return Err(format!(
                    "{}: {what} uses arena offset {off}, which is free",
                    a.name
                ));
            };
            if arena.block_size(*len).is_none_or(|b| b > block) {
                return Err(format!(
                    "{}: {what} of {len} bytes overruns block {off}",
                    a.name
                ));
            }
            spans.push((*off, *off + block, what));
        }
        spans.sort();
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(format!(
                    "{}: {} and {} use overlapping arena bytes [{}, {}) / [{}, {})",
                    a.name, w[0].2, w[1].2, w[0].0, w[0].1, w[1].0, w[1].1
                ));
            }
        }
        // Every request resolves within the timeout of its last progress.
        for (rid, r) in &a.reqs {
            if !m.has_request(*rid) {
                continue; // resolved in this very input; checked by Resolve
            }
            let lp = m.last_progress(*rid).unwrap_or(r.submitted);
            if self.now > lp + TIMEOUT + SLACK {
                return Err(format!(
                    "{}: request {rid} unresolved {} ms after its last progress",
                    a.name,
                    (self.now - lp) / MS
                ));
            }
            let bound = (4 * r.chunks as u64 + 4) * (TIMEOUT + SLACK);
            if self.now - r.submitted > bound {
                return Err(format!(
                    "{}: request {rid} unresolved after {} ms (bound {} ms)",
                    a.name,
                    (self.now - r.submitted) / MS,
                    bound / MS
                ));
            }
        }
        Ok(())
    }

    fn check_global(&self) -> R {
        // Writes in flight target regions their flow still holds.
        for ((sender, w), (recv, region, _, flow)) in &self.writes_in {
            if let Some(j) = self.slot_of(recv) {
                let m = self.agents[j].m.as_ref().expect("alive");
                if !m.scheduler().held_by_flow(flow, *region) {
                    return Err(format!(
                        "write {w} of {sender} still in flight into region {region} of {recv}, which {flow} no longer holds (freed under the write)"
                    ));
                }
            }
        }
        Ok(())
    }

    fn final_checks(&self) -> R {
        for a in &self.agents {
            if !a.reqs.is_empty() {
                return Err(format!(
                    "{}: requests never resolved: {:?}",
                    a.name,
                    a.reqs.keys()
                ));
            }
            let Some(m) = &a.m else { continue };
            let s = m.snapshot();
            let busy = s.flows
                + s.requests
                + s.jobs
                + s.writes
                + s.send_orphans
                + s.recv_orphans
                + s.deferred_cancels
                + s.regions
                + s.scatter_queue
                + s.starved
                + s.grant_order;
            if busy != 0 || s.free_bytes != s.capacity {
                return Err(format!("{}: not idle at quiesce: {s:?}", a.name));
            }
            if !a.detaching.is_empty() || !a.eng_detaching.is_empty() {
                return Err(format!(
                    "{}: quiesce of detached memory never answered: halves {:?}, engine pools {:?}",
                    a.name, a.detaching, a.eng_detaching
                ));
            }
        }
        Ok(())
    }
}

fn eng_base(k: usize) -> u64 {
    ENG_BASE + k as u64 * ENG_LEN
}

/// Joins consecutive one-segment runs that continue each other in the
/// region and at the destination.
fn join_adjacent(runs: Vec<ScatterRun>) -> Vec<ScatterRun> {
    let mut out: Vec<ScatterRun> = Vec::with_capacity(runs.len());
    for r in runs {
        if let Some(l) = out.last_mut() {
            if l.count == 1
                && r.count == 1
                && l.region_offset.checked_add(l.segment_len) == Some(r.region_offset)
                && l.addr.checked_add(l.segment_len) == Some(r.addr)
            {
                l.segment_len += r.segment_len;
                continue;
            }
        }
        out.push(r);
    }
    out
}

fn run_for(t: u64, len: u64) -> ScatterRun {
    let half = t & 1;
    ScatterRun {
        region_offset: 0,
        addr: DST_BASE + half * DST_HALF + (t >> 8) % (DST_HALF - MAX_CHUNK),
        segment_len: len,
        region_stride: 0,
        addr_stride: 0,
        count: 1,
    }
}

fn short(m: &Message) -> String {
    let mut s = String::new();
    match m {
        Message::Want(w) if w.is_cancel() => {
            let _ = write!(s, "CANCEL rid {}", w.request_id);
        }
        Message::Want(w) => {
            let _ = write!(s, "WANT rid {} chunks {:?}", w.request_id, w.chunk_bytes);
            if w.scope != 0 {
                let _ = write!(s, " scope {}", w.scope);
            }
        }
        Message::Grant(g) => {
            let _ = write!(s, "GRANT rid {} credits", g.request_id);
            for c in &g.credits {
                let _ = write!(s, " #{}@{}+{}", c.chunk_index, c.region_handle, c.len);
            }
        }
        Message::Data(d) => {
            let _ = write!(
                s,
                "DATA rid {} chunk {} region {}",
                d.request_id, d.chunk_index, d.region_handle
            );
        }
        Message::Ack(a) => {
            let _ = write!(
                s,
                "ACK rid {} chunk {} region {}",
                a.request_id, a.chunk_index, a.region_handle
            );
        }
        Message::Reject(r) => {
            let _ = write!(s, "REJECT rid {} ({:?})", r.request_id, r.reason);
        }
        other => {
            let _ = write!(s, "{:?}", other.message_type());
        }
    }
    s
}

/// Runs `seed`; on failure shrinks the budget (fewest spontaneous events
/// that still fail, same seed) and returns the traced failure.
pub fn run_seed(seed: u64, mutations: Mutations) -> Result<Stats, Box<Failure>> {
    run_seed_in(seed, mutations, true)
}

/// [`run_seed`] in the scoped world or (`scoped: false`) the world before
/// engine scopes.
pub fn run_seed_in(seed: u64, mutations: Mutations, scoped: bool) -> Result<Stats, Box<Failure>> {
    let sim = |b, t| Sim::with_world(seed, b, mutations, t, scoped);
    match sim(None, false).run() {
        Ok(s) => Ok(s),
        Err(f) => {
            for b in 1..=f.budget {
                if let Err(g) = sim(Some(b), true).run() {
                    return Err(Box::new(g));
                }
            }
            // Not reproducible with a smaller budget: trace the original.
            let g = sim(Some(f.budget), true).run().err().unwrap_or(f);
            Err(Box::new(g))
        }
    }
}
