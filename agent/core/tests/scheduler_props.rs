//! Property and scenario tests of `CreditScheduler` (seed §5, §8, §9;
//! issue 2 "Must show": worked example, conservation over ≥ 10,000 random
//! operation sequences incl. reclaim and orphan paths, fairness, starvation
//! freedom, erase of finished flows).

use kvfabric_core::buddy::BuddyAllocator;
use kvfabric_core::scheduler::{
    CreditScheduler, Grant, GrantPolicy, SchedulerError, BYPASS_ROUNDS, DEFAULT_SIZE_WEIGHT,
};
use kvfabric_core::FlowKey;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet, VecDeque};

const G: u64 = 64;

/// Every [`GrantPolicy`], for properties that must hold under each.
const POLICIES: [GrantPolicy; 3] = [
    GrantPolicy::RoundRobin,
    GrantPolicy::OldestFirst,
    GrantPolicy::ShortestFirst,
];

/// Tiny deterministic PRNG for the simulation tests (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

// ------------------------------------------------------------ worked example

/// Seed §5 example, step by step: W=2, arena fits exactly 4 regions, flow A
/// has c1/c2/c3, flow B has d1/d2, cursor at A.
#[test]
fn seed_worked_example_step_by_step() {
    let chunk = 1 << 20;
    let mut s = CreditScheduler::new(4 * chunk, chunk, 2).unwrap();
    let a = FlowKey::new("peerA", 1);
    let b = FlowKey::new("peerB", 1);
    s.on_want(a.clone(), &[chunk; 3]).unwrap();
    s.on_want(b.clone(), &[chunk; 2]).unwrap();
    assert_eq!(s.cursor_flow(), Some(&a), "cursor starts at A");

    let grants = s.schedule();
    let expect = [
        // (step, cursor before, granted flow, A.held, B.held)
        (1, &a, &a, 1, 0),
        (2, &b, &b, 1, 1),
        (3, &a, &a, 2, 1),
        (4, &b, &b, 2, 2),
    ];
    assert_eq!(grants.len(), 4);
    let (mut ah, mut bh) = (0, 0);
    for ((step, _cursor, flow, a_held, b_held), g) in expect.iter().zip(&grants) {
        assert_eq!(&&g.flow, flow, "step {step}");
        assert_eq!(g.len, chunk);
        if g.flow == a {
            ah += 1
        } else {
            bh += 1
        }
        assert_eq!((ah, bh), (*a_held, *b_held), "step {step}");
    }
    // Step 5: A at cap, B at cap (and the arena is full) -> no progress.
    assert!(s.schedule().is_empty());
    assert_eq!(s.free_bytes(), 0);
    assert_eq!(s.pending_count(&a), 1, "c3 stays pending");
    // A region of B completing frees space but A is still at its cap.
    s.begin_scatter(&b, grants[1].region_offset).unwrap();
    assert_eq!(
        s.scatter_done(grants[1].region_offset).unwrap(),
        Some(b.clone())
    );
    assert!(
        s.schedule().is_empty(),
        "no progress until one of A's regions is ACKed"
    );
    // ACK of A/c1 -> the next schedule() grants A/c3.
    s.begin_scatter(&a, grants[0].region_offset).unwrap();
    assert_eq!(
        s.scatter_done(grants[0].region_offset).unwrap(),
        Some(a.clone())
    );
    let next = s.schedule();
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].flow, a);
    assert_eq!(s.pending_count(&a), 0);
    s.check_conservation().unwrap();
}

// ------------------------------------------------------- random op sequences

#[derive(Clone, Debug)]
enum Op {
    Want { peer: u8, rid: u8, chunks: Vec<u64> },
    Schedule,
    BeginScatter { pick: usize },
    ScatterDone { pick: usize },
    BogusScatterDone { offset: u64 },
    LateData { pick: usize },
    ReclaimFlow { peer: u8, rid: u8 },
    ReclaimPeer { peer: u8 },
    AcquireLocal { bytes: u64, eager: bool },
    PromoteLocal { pick: usize },
    ReleaseLocal { pick: usize },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u8..4, prop::collection::vec(0u64..5000, 0..6))
            .prop_map(|(peer, rid, chunks)| Op::Want { peer, rid, chunks }),
        5 => Just(Op::Schedule),
        4 => any::<usize>().prop_map(|pick| Op::BeginScatter { pick }),
        4 => any::<usize>().prop_map(|pick| Op::ScatterDone { pick }),
        1 => (0u64..4096).prop_map(|offset| Op::BogusScatterDone { offset }),
        1 => any::<usize>().prop_map(|pick| Op::LateData { pick }),
        1 => (0u8..3, 0u8..4).prop_map(|(peer, rid)| Op::ReclaimFlow { peer, rid }),
        1 => (0u8..3).prop_map(|peer| Op::ReclaimPeer { peer }),
        2 => (0u64..3000, any::<bool>()).prop_map(|(bytes, eager)| Op::AcquireLocal { bytes, eager }),
        1 => any::<usize>().prop_map(|pick| Op::PromoteLocal { pick }),
        2 => any::<usize>().prop_map(|pick| Op::ReleaseLocal { pick }),
    ]
}

fn key(peer: u8, rid: u8) -> FlowKey {
    FlowKey::new(format!("p{peer}"), u64::from(rid))
}

/// Reference model of what the scheduler should hold.
#[derive(Default)]
struct Model {
    pending: HashMap<FlowKey, VecDeque<u64>>,
    /// offset -> (flow, len, scattering)
    held: HashMap<u64, (FlowKey, u64, bool)>,
    orphans: HashSet<u64>,
    /// offset -> eager
    local: HashMap<u64, bool>,
    /// (flow, offset) pairs that were once held and no longer are.
    history: Vec<(FlowKey, u64)>,
}

impl Model {
    fn held_count(&self, f: &FlowKey) -> usize {
        self.held.values().filter(|(k, _, _)| k == f).count()
    }
    fn live_flows(&self) -> HashSet<FlowKey> {
        let mut s: HashSet<FlowKey> = self
            .pending
            .iter()
            .filter(|(_, p)| !p.is_empty())
            .map(|(k, _)| k.clone())
            .collect();
        s.extend(self.held.values().map(|(k, _, _)| k.clone()));
        s
    }
    fn drop_flow(&mut self, f: &FlowKey) {
        self.pending.remove(f);
        let offs: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, (k, _, _))| k == f)
            .map(|(&o, _)| o)
            .collect();
        for o in offs {
            let (k, _, scattering) = self.held.remove(&o).unwrap();
            if scattering {
                self.orphans.insert(o);
            }
            self.history.push((k, o));
        }
    }
}

/// Sorted list helper (HashMap iteration order is random; picks must be
/// deterministic for shrinking).
fn sorted<T: Ord + Clone>(it: impl Iterator<Item = T>) -> Vec<T> {
    let mut v: Vec<T> = it.collect();
    v.sort();
    v
}

fn check_grants(s: &CreditScheduler, m: &mut Model, grants: &[Grant], w: usize) {
    for g in grants {
        let p = m
            .pending
            .get_mut(&g.flow)
            .expect("grant for a flow with pending");
        assert_eq!(p.pop_front(), Some(g.len), "grants follow the WANT order");
        assert!(m.held_count(&g.flow) < w, "W cap respected");
        assert!(!m.held.contains_key(&g.region_offset));
        assert!(!m.orphans.contains(&g.region_offset), "orphan re-granted");
        assert!(!m.local.contains_key(&g.region_offset));
        let block = s.arena().allocated_block(g.region_offset).unwrap();
        assert!(block >= g.len && block < 2 * g.len.max(G));
        m.held
            .insert(g.region_offset, (g.flow.clone(), g.len, false));
    }
    // Maximality: after schedule() no eligible flow's head fits (unless
    // drain mode holds everything back for the drain flow).
    if s.in_drain_mode() {
        let d = s.drain_flow().unwrap();
        let head = m.pending[d][0];
        assert!(s.arena().largest_free_block() < s.arena().block_size(head).unwrap());
    } else {
        for (f, p) in &m.pending {
            if let Some(&head) = p.front() {
                if m.held_count(f) < w {
                    assert!(
                        s.arena().largest_free_block() < s.arena().block_size(head).unwrap(),
                        "eligible flow {f} left ungranted although its head fits"
                    );
                }
            }
        }
    }
}

fn check_model(s: &CreditScheduler, m: &Model) {
    if let Err(e) = s.check_conservation() {
        panic!("conservation violated: {e}");
    }
    let live = m.live_flows();
    assert_eq!(s.flow_count(), live.len(), "finished flows erased");
    for f in &live {
        assert!(s.contains_flow(f));
        assert_eq!(
            s.pending_count(f),
            m.pending.get(f).map_or(0, VecDeque::len)
        );
    }
    for (&o, (f, len, _)) in &m.held {
        assert!(s.held_by_flow(f, o));
        assert_eq!(s.region_len(o), Some(*len));
    }
    assert_eq!(s.orphan_count(), m.orphans.len());
    assert!(s.eager_held_bytes() <= s.capacity() / 2);
}

fn run_ops(arena: u64, w: usize, ops: &[Op], natural_finish: bool, policy: GrantPolicy) {
    let mut s = CreditScheduler::new(arena, G, w)
        .unwrap()
        .with_policy(policy);
    let fresh = BuddyAllocator::new(arena, G).unwrap();
    let max = s.max_allocation();
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Want { peer, rid, chunks } => {
                // Map raw values to sizes; 0 and > max exercise rejection.
                let sizes: Vec<u64> = chunks
                    .iter()
                    .map(|&c| {
                        if c == 0 || c > 4990 {
                            c.saturating_mul(max)
                        } else {
                            1 + c % max
                        }
                    })
                    .collect();
                let f = key(*peer, *rid);
                let res = s.on_want(f.clone(), &sizes);
                if sizes.iter().all(|&c| c >= 1 && c <= max) {
                    res.unwrap();
                    m.pending.entry(f).or_default().extend(sizes);
                } else {
                    assert!(matches!(
                        res,
                        Err(SchedulerError::ZeroChunk { .. } | SchedulerError::ChunkTooLarge { .. })
                    ));
                }
            }
            Op::Schedule => {
                let g = s.schedule();
                check_grants(&s, &mut m, &g, w);
            }
            Op::BeginScatter { pick } => {
                let cands = sorted(m.held.iter().filter(|(_, v)| !v.2).map(|(&o, _)| o));
                if cands.is_empty() {
                    continue;
                }
                let o = cands[pick % cands.len()];
                let e = m.held.get_mut(&o).unwrap();
                assert_eq!(s.begin_scatter(&e.0, o).unwrap(), e.1);
                e.2 = true;
                assert!(matches!(
                    s.begin_scatter(&e.0, o),
                    Err(SchedulerError::AlreadyScattering { .. })
                ));
            }
            Op::ScatterDone { pick } => {
                let mut cands = sorted(m.held.iter().filter(|(_, v)| v.2).map(|(&o, _)| o));
                cands.extend(sorted(m.orphans.iter().copied()));
                if cands.is_empty() {
                    continue;
                }
                let o = cands[pick % cands.len()];
                let res = s.scatter_done(o).unwrap();
                if m.orphans.remove(&o) {
                    assert_eq!(res, None);
                } else {
                    let (f, _, _) = m.held.remove(&o).unwrap();
                    assert_eq!(res, Some(f.clone()));
                    m.history.push((f, o));
                }
            }
            Op::BogusScatterDone { offset } => {
                let scattering = m.held.get(offset).is_some_and(|v| v.2);
                if !scattering && !m.orphans.contains(offset) {
                    assert!(s.scatter_done(*offset).is_err());
                }
            }
            Op::LateData { pick } => {
                if m.history.is_empty() {
                    continue;
                }
                let (f, o) = m.history[pick % m.history.len()].clone();
                let held_now = m.held.get(&o).is_some_and(|v| v.0 == f);
                if !held_now {
                    assert!(matches!(
                        s.begin_scatter(&f, o),
                        Err(SchedulerError::NotHeldByFlow { .. })
                    ));
                    assert!(!s.held_by_flow(&f, o));
                }
            }
            Op::ReclaimFlow { peer, rid } => {
                let f = key(*peer, *rid);
                let r = s.reclaim_flow(&f);
                assert_eq!(r.flows.len(), usize::from(m.live_flows().contains(&f)));
                m.drop_flow(&f);
            }
            Op::ReclaimPeer { peer } => {
                let name = format!("p{peer}");
                let r = s.reclaim_by_prefix(&name);
                let victims: Vec<FlowKey> = m
                    .live_flows()
                    .into_iter()
                    .filter(|f| f.peer == name)
                    .collect();
                assert_eq!(r.flows.len(), victims.len());
                for f in victims {
                    m.drop_flow(&f);
                }
            }
            Op::AcquireLocal { bytes, eager } => {
                let before_eager = s.eager_held_bytes();
                match s.acquire_local(*bytes, *eager) {
                    Some(o) => {
                        assert!(*bytes >= 1 && *bytes <= max);
                        assert!(!m.held.contains_key(&o) && !m.orphans.contains(&o));
                        assert!(m.local.insert(o, *eager).is_none());
                    }
                    None => {
                        // Refused only for a good reason.
                        let ok_size = *bytes >= 1 && *bytes <= max;
                        if ok_size {
                            let block = s.arena().block_size(*bytes).unwrap();
                            let over_budget = *eager && before_eager + block > s.capacity() / 2;
                            assert!(over_budget || s.arena().largest_free_block() < block);
                        }
                    }
                }
            }
            Op::PromoteLocal { pick } => {
                let cands = sorted(m.local.keys().copied());
                if cands.is_empty() {
                    assert!(s.promote_local(0).is_err() || m.local.contains_key(&0));
                    continue;
                }
                let o = cands[pick % cands.len()];
                s.promote_local(o).unwrap();
                m.local.insert(o, false);
            }
            Op::ReleaseLocal { pick } => {
                let cands = sorted(m.local.keys().copied());
                if cands.is_empty() {
                    continue;
                }
                let o = cands[pick % cands.len()];
                s.release_local(o).unwrap();
                m.local.remove(&o);
                assert!(s.release_local(o).is_err());
            }
        }
        check_model(&s, &m);
    }

    // Release everything.
    for o in sorted(m.local.keys().copied()) {
        s.release_local(o).unwrap();
    }
    m.local.clear();
    if natural_finish {
        // Let every flow run to completion through the normal path.
        let mut rounds = 0;
        while s.flow_count() > 0 || !m.orphans.is_empty() {
            rounds += 1;
            assert!(rounds < 10_000, "flows failed to complete");
            let g = s.schedule();
            check_grants(&s, &mut m, &g, w);
            for o in sorted(m.held.keys().copied()) {
                let (f, _, scattering) = m.held[&o].clone();
                if !scattering {
                    s.begin_scatter(&f, o).unwrap();
                }
                assert_eq!(s.scatter_done(o).unwrap(), Some(f));
                m.held.remove(&o);
            }
            for o in sorted(m.orphans.drain()) {
                assert_eq!(s.scatter_done(o).unwrap(), None);
            }
            m.pending.retain(|_, p| !p.is_empty());
            check_model(&s, &m);
        }
    } else {
        for p in 0..3 {
            s.reclaim_by_prefix(&format!("p{p}"));
        }
        for o in sorted(m.held.iter().filter(|(_, v)| v.2).map(|(&o, _)| o)) {
            assert_eq!(
                s.scatter_done(o).unwrap(),
                None,
                "reclaimed scatter is an orphan"
            );
        }
        for o in sorted(m.orphans.drain()) {
            assert_eq!(s.scatter_done(o).unwrap(), None);
        }
        m = Model::default();
        check_model(&s, &m);
    }
    assert_eq!(s.flow_count(), 0);
    assert_eq!(s.orphan_count(), 0);
    assert_eq!(s.free_bytes(), s.capacity());
    assert_eq!(
        s.local_held_bytes() + s.held_bytes() + s.orphaned_bytes(),
        0
    );
    assert_eq!(*s.arena(), fresh, "fully released arena equals a fresh one");
    assert!(!s.in_drain_mode());
}

proptest! {
    // XorShift: the default ChaCha RNG dominates the run time of an
    // unoptimised test build.
    #![proptest_config(ProptestConfig {
        cases: 10_000,
        rng_algorithm: proptest::test_runner::RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    })]

    /// ≥ 10,000 random operation sequences: conservation after every op,
    /// everything free once all is released (reclaim and orphan paths
    /// included).
    #[test]
    fn conservation_over_random_sequences(
        granules in 1u64..48,
        slack in 0u64..G,
        w in 1usize..5,
        ops in prop::collection::vec(op_strategy(), 1..60),
        natural_finish in any::<bool>(),
        policy in 0usize..3,
    ) {
        let policy = POLICIES[policy];
        run_ops(granules * G + slack, w, &ops, natural_finish, policy);
    }
}

// ------------------------------------------------------------------ fairness

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// With room for everything, within one schedule() no flow gets two
    /// grants ahead of any flow that is still eligible (has pending and is
    /// below W): strict round-robin.
    #[test]
    fn round_robin_fairness(
        chunks in prop::collection::vec(prop::collection::vec(1u64..4 * G, 1..10), 2..12),
        w in 1usize..6,
        completions in prop::collection::vec(any::<usize>(), 0..20),
    ) {
        let mut s = CreditScheduler::new(1 << 20, G, w).unwrap();
        let keys: Vec<FlowKey> = (0..chunks.len()).map(|i| FlowKey::new("p", i as u64)).collect();
        let mut pending: HashMap<FlowKey, usize> = HashMap::new();
        for (k, c) in keys.iter().zip(&chunks) {
            s.on_want(k.clone(), c).unwrap();
            pending.insert(k.clone(), c.len());
        }
        let mut held: HashMap<FlowKey, Vec<u64>> = HashMap::new();
        let mut round = 0;
        loop {
            let grants = s.schedule();
            let mut got: HashMap<&FlowKey, usize> = HashMap::new();
            for g in &grants {
                *got.entry(&g.flow).or_default() += 1;
                *pending.get_mut(&g.flow).unwrap() -= 1;
                held.entry(g.flow.clone()).or_default().push(g.region_offset);
                // Every flow still eligible after this grant has received at
                // most one grant fewer than the leader.
                let lead = *got.values().max().unwrap();
                for k in &keys {
                    let eligible = pending[k] > 0 && held.get(k).map_or(0, Vec::len) < w;
                    if eligible {
                        prop_assert!(got.get(k).copied().unwrap_or(0) + 1 >= lead,
                            "flow {} fell two grants behind", k);
                    }
                }
            }
            // Complete one region (random flow) and go again.
            let live: Vec<FlowKey> = sorted(held.iter().filter(|(_, v)| !v.is_empty()).map(|(k, _)| k.clone()));
            if live.is_empty() || round >= completions.len() {
                break;
            }
            let k = &live[completions[round] % live.len()];
            let o = held.get_mut(k).unwrap().remove(0);
            s.begin_scatter(k, o).unwrap();
            s.scatter_done(o).unwrap();
            round += 1;
        }
        s.check_conservation().unwrap();
    }
}

/// Deterministic fairness check with many flows: grants come in rounds in
/// which every flow appears exactly once, in ring order.
#[test]
fn grants_rotate_through_all_flows() {
    let mut s = CreditScheduler::new(1 << 20, G, 3).unwrap();
    let keys: Vec<FlowKey> = (0..20)
        .map(|i| FlowKey::new(format!("p{}", i % 4), i))
        .collect();
    for k in &keys {
        s.on_want(k.clone(), &[G; 5]).unwrap();
    }
    let g = s.schedule();
    assert_eq!(g.len(), 60);
    for (i, grant) in g.iter().enumerate() {
        assert_eq!(grant.flow, keys[i % 20]);
    }
}

// ------------------------------------------------------ starvation freedom

/// One flow of maximum-size chunks among `n_small` flows of one-granule
/// chunks: with drain mode the big flow is granted after at most
/// (BYPASS_ROUNDS + 1) rounds of other grants, every time.
fn starvation_scenario(
    n_small: usize,
    w: usize,
    seed: u64,
    completions_per_tick: usize,
    policy: GrantPolicy,
) {
    let arena = 64 * G;
    let mut s = CreditScheduler::new(arena, G, w)
        .unwrap()
        .with_policy(policy);
    let max = s.max_allocation();
    assert_eq!(max, arena);
    let mut rng = Rng(seed);
    let smalls: Vec<FlowKey> = (0..n_small)
        .map(|i| FlowKey::new("small", i as u64))
        .collect();
    for k in &smalls {
        s.on_want(k.clone(), &[G; 8]).unwrap();
    }
    let big = FlowKey::new("big", 0);
    let big_chunks = 3;
    s.on_want(big.clone(), &vec![max; big_chunks]).unwrap();
    let ring = (n_small + 1) as u64;
    // Round-robin (seed §5 R3): every sweep passes the big flow, so it is
    // stamped within one ring and drained BYPASS_ROUNDS rounds later.
    // Oldest first serves in WANT arrival order: the chunks queued ahead of
    // the big flow when it arrived (8 per small flow) come first; from
    // then on it is at the front (appending flows move behind it) and the
    // same bound holds.
    // Shortest first ranks the big flow at DEFAULT_SIZE_WEIGHT × its size (192
    // granules; the clock is 0): the small flows pass it until the clock
    // reaches that (one-granule grants; an append ranks from the clock
    // once the clock has passed the flow's rank), plus what each had
    // queued then (at most 9: it appends 8 when fewer than 2 are left).
    let bound = (BYPASS_ROUNDS + 1) * ring
        + 1
        + match policy {
            GrantPolicy::RoundRobin => 0,
            GrantPolicy::OldestFirst => 8 * n_small as u64,
            GrantPolicy::ShortestFirst => {
                DEFAULT_SIZE_WEIGHT * big_chunks as u64 * max / G + 9 * n_small as u64
            }
        };

    let mut inflight: Vec<Grant> = Vec::new();
    let mut others_since_big = 0u64;
    let mut worst = 0u64;
    let mut big_grants = 0;
    for _tick in 0..100_000 {
        for g in s.schedule() {
            if g.flow == big {
                big_grants += 1;
                worst = worst.max(others_since_big);
                others_since_big = 0;
            } else {
                others_since_big += 1;
            }
            inflight.push(g);
        }
        assert!(
            others_since_big <= bound,
            "big flow bypassed by {others_since_big} grants (> {bound}) with {n_small} small flows"
        );
        if big_grants == big_chunks {
            break;
        }
        // Keep the small flows busy forever.
        for k in &smalls {
            if s.pending_count(k) < 2 {
                s.on_want(k.clone(), &[G; 8]).unwrap();
            }
        }
        // Random scatter completions.
        for _ in 0..completions_per_tick {
            if inflight.is_empty() {
                break;
            }
            let g = inflight.swap_remove(rng.below(inflight.len()));
            s.begin_scatter(&g.flow, g.region_offset).unwrap();
            s.scatter_done(g.region_offset).unwrap();
        }
        s.check_conservation().unwrap();
    }
    assert_eq!(big_grants, big_chunks, "big flow starved");
    assert!(worst <= bound);
}

/// Must-show: one flow of max-size chunks among 50 flows of small chunks.
#[test]
fn starvation_freedom_50_small_flows() {
    for seed in 0..5 {
        starvation_scenario(50, 4, seed, 3, GrantPolicy::RoundRobin);
        starvation_scenario(50, 4, seed, 3, GrantPolicy::OldestFirst);
        starvation_scenario(50, 4, seed, 3, GrantPolicy::ShortestFirst);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn starvation_freedom_random(
        n_small in 1usize..60,
        w in 1usize..6,
        seed in any::<u64>(),
        per_tick in 1usize..8,
        policy in 0usize..3,
    ) {
        let policy = POLICIES[policy];
        starvation_scenario(n_small, w, seed, per_tick, policy);
    }
}

// ------------------------------------------------------------------ erasure

/// Over a long run with flows constantly arriving and finishing, the flow
/// table tracks only live flows (finished ones are erased at once).
#[test]
fn finished_flows_do_not_accumulate() {
    finished_flows_do_not_accumulate_under(GrantPolicy::RoundRobin);
    finished_flows_do_not_accumulate_under(GrantPolicy::OldestFirst);
    finished_flows_do_not_accumulate_under(GrantPolicy::ShortestFirst);
}

fn finished_flows_do_not_accumulate_under(policy: GrantPolicy) {
    let mut s = CreditScheduler::new(256 * G, G, 4)
        .unwrap()
        .with_policy(policy);
    let mut rng = Rng(7);
    let mut inflight: Vec<Grant> = Vec::new();
    let mut live: HashSet<FlowKey> = HashSet::new();
    let mut next_rid = 0u64;
    let mut peak = 0;
    for _ in 0..20_000 {
        if live.len() < 40 && rng.below(2) == 0 {
            let k = FlowKey::new(format!("p{}", rng.below(5)), next_rid);
            next_rid += 1;
            let n = 1 + rng.below(6);
            let sizes: Vec<u64> = (0..n).map(|_| 1 + rng.next() % (8 * G)).collect();
            s.on_want(k.clone(), &sizes).unwrap();
            live.insert(k);
        }
        if rng.below(50) == 0 && !live.is_empty() {
            // Occasional cancel.
            let k = sorted(live.iter().cloned())[rng.below(live.len())].clone();
            s.reclaim_flow(&k);
            live.remove(&k);
            inflight.retain(|g| g.flow != k);
        }
        inflight.extend(s.schedule());
        for _ in 0..2 {
            if inflight.is_empty() {
                break;
            }
            let g = inflight.swap_remove(rng.below(inflight.len()));
            s.begin_scatter(&g.flow, g.region_offset).unwrap();
            s.scatter_done(g.region_offset).unwrap();
            if !s.contains_flow(&g.flow) {
                live.remove(&g.flow);
            }
        }
        assert_eq!(s.flow_count(), live.len());
        peak = peak.max(s.flow_count());
    }
    assert!(next_rid > 1_000, "the run must cycle many flows");
    assert!(peak <= 40);
    // Drain what is left.
    while !inflight.is_empty() || s.flow_count() > 0 {
        inflight.extend(s.schedule());
        let g = inflight.pop().expect("progress");
        s.begin_scatter(&g.flow, g.region_offset).unwrap();
        s.scatter_done(g.region_offset).unwrap();
    }
    assert_eq!(s.flow_count(), 0);
    assert_eq!(*s.arena(), BuddyAllocator::new(256 * G, G).unwrap());
}

// ------------------------------------------------------------ oldest first

/// Flows `i` with `chunks[i]` (all WANTed up front, in order, in an arena
/// with room for everything) under `policy`, regions completing in the
/// order `completions` picks: no grant goes to a flow while a flow of lower
/// `rank` is eligible (pending chunks, below `w`); the conservation
/// invariant holds after every `schedule()`.
fn grants_follow_rank(
    policy: GrantPolicy,
    chunks: &[Vec<u64>],
    w: usize,
    completions: &[usize],
    rank: &[(u64, usize)],
) -> Result<(), TestCaseError> {
    let mut s = CreditScheduler::new(1 << 20, G, w)
        .unwrap()
        .with_policy(policy);
    let keys: Vec<FlowKey> = (0..chunks.len())
        .map(|i| FlowKey::new("p", i as u64))
        .collect();
    let mut pending: Vec<usize> = chunks.iter().map(Vec::len).collect();
    for (k, c) in keys.iter().zip(chunks) {
        s.on_want(k.clone(), c).unwrap();
    }
    let mut held: Vec<Vec<u64>> = vec![Vec::new(); keys.len()];
    let mut round = 0;
    loop {
        for g in s.schedule() {
            let i = keys.iter().position(|k| *k == g.flow).unwrap();
            for j in 0..keys.len() {
                prop_assert!(
                    rank[j] >= rank[i] || pending[j] == 0 || held[j].len() >= w,
                    "flow {} (rank {:?}) granted while flow {} (rank {:?}) was eligible",
                    i,
                    rank[i],
                    j,
                    rank[j]
                );
            }
            pending[i] -= 1;
            held[i].push(g.region_offset);
        }
        s.check_conservation().unwrap();
        let live: Vec<usize> = (0..keys.len()).filter(|&i| !held[i].is_empty()).collect();
        if live.is_empty() || round >= completions.len() {
            break;
        }
        let i = live[completions[round] % live.len()];
        let o = held[i].remove(0);
        s.begin_scatter(&keys[i], o).unwrap();
        s.scatter_done(o).unwrap();
        round += 1;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// Oldest first with room for everything: no grant goes to a flow while
    /// an older flow is eligible (pending chunks, below W) — requests are
    /// served in arrival order up to W each.
    #[test]
    fn oldest_first_grants_in_arrival_order(
        chunks in prop::collection::vec(prop::collection::vec(1u64..4 * G, 1..10), 2..12),
        w in 1usize..6,
        completions in prop::collection::vec(any::<usize>(), 0..40),
    ) {
        // Arrival order: flow j ranks before flow i iff j < i.
        let rank: Vec<(u64, usize)> = (0..chunks.len()).map(|j| (j as u64, j)).collect();
        grants_follow_rank(GrantPolicy::OldestFirst, &chunks, w, &completions, &rank)?;
    }

    /// Oldest first in a tight arena (2-24 granules, chunks up to the max
    /// allocation): every flow is served to its last chunk as regions
    /// complete in random order (no starvation, no stall), and at the end
    /// no flow is left and every byte is free.
    #[test]
    fn oldest_first_serves_every_flow_in_a_tight_arena(
        chunks in prop::collection::vec(prop::collection::vec(1u64..8 * G, 1..8), 2..16),
        w in 1usize..6,
        granules in 2u64..24,
        picks in prop::collection::vec(any::<usize>(), 1..64),
    ) {
        let mut s = CreditScheduler::new(granules * G, G, w)
            .unwrap()
            .with_policy(GrantPolicy::OldestFirst);
        let max = s.max_allocation();
        let keys: Vec<FlowKey> = (0..chunks.len()).map(|i| FlowKey::new("p", i as u64)).collect();
        let mut pending: Vec<usize> = chunks.iter().map(Vec::len).collect();
        for (k, c) in keys.iter().zip(&chunks) {
            let c: Vec<u64> = c.iter().map(|&b| b.min(max)).collect();
            s.on_want(k.clone(), &c).unwrap();
        }
        let mut held: Vec<Vec<u64>> = vec![Vec::new(); keys.len()];
        for step in 0..10_000usize {
            for g in s.schedule() {
                let i = keys.iter().position(|k| *k == g.flow).unwrap();
                pending[i] -= 1;
                held[i].push(g.region_offset);
            }
            s.check_conservation().unwrap();
            let live: Vec<usize> = (0..keys.len()).filter(|&i| !held[i].is_empty()).collect();
            if live.is_empty() {
                break;
            }
            let i = live[picks[step % picks.len()] % live.len()];
            let o = held[i].remove(0);
            s.begin_scatter(&keys[i], o).unwrap();
            s.scatter_done(o).unwrap();
        }
        prop_assert!(pending.iter().all(|&p| p == 0), "a flow starved: {:?}", pending);
        prop_assert_eq!(s.flow_count(), 0);
        prop_assert_eq!(s.free_bytes(), s.capacity());
    }

    /// Shortest first with room for everything and every WANT before the
    /// first grant (the byte clock at 0, so a flow's rank is its bytes): no
    /// grant goes to a flow while a flow of lower rank (fewer bytes, or as
    /// many and earlier) is eligible.
    #[test]
    fn shortest_first_grants_in_rank_order(
        chunks in prop::collection::vec(prop::collection::vec(1u64..4 * G, 1..10), 2..12),
        w in 1usize..6,
        completions in prop::collection::vec(any::<usize>(), 0..40),
    ) {
        let rank: Vec<(u64, usize)> = chunks.iter().enumerate().map(|(i, c)| (c.iter().sum(), i)).collect();
        grants_follow_rank(GrantPolicy::ShortestFirst, &chunks, w, &completions, &rank)?;
    }

    /// Shortest first in a tight arena with WANTs arriving and appending
    /// between completions: every flow is served to its last chunk (no
    /// starvation, no stall) and at the end every byte is free.
    #[test]
    fn shortest_first_serves_every_flow_with_late_arrivals(
        chunks in prop::collection::vec(prop::collection::vec(1u64..8 * G, 1..8), 2..16),
        w in 1usize..6,
        granules in 2u64..24,
        picks in prop::collection::vec(any::<usize>(), 1..64),
    ) {
        let mut s = CreditScheduler::new(granules * G, G, w)
            .unwrap()
            .with_policy(GrantPolicy::ShortestFirst);
        let max = s.max_allocation();
        let keys: Vec<FlowKey> = (0..chunks.len()).map(|i| FlowKey::new("p", i as u64)).collect();
        let mut pending: Vec<usize> = vec![0; keys.len()];
        let mut held: Vec<Vec<u64>> = vec![Vec::new(); keys.len()];
        // Flow i's chunks arrive as two WANTs, the second after step i.
        let mut arrived = 0;
        for step in 0..10_000usize {
            if arrived < 2 * keys.len() && step >= arrived / 2 {
                let i = arrived / 2;
                let c: Vec<u64> = chunks[i].iter().map(|&b| b.min(max)).collect();
                let half = c.len() / 2;
                let part = if arrived % 2 == 0 { &c[..half] } else { &c[half..] };
                if !part.is_empty() {
                    s.on_want(keys[i].clone(), part).unwrap();
                    pending[i] += part.len();
                }
                arrived += 1;
            }
            for g in s.schedule() {
                let i = keys.iter().position(|k| *k == g.flow).unwrap();
                pending[i] -= 1;
                held[i].push(g.region_offset);
            }
            s.check_conservation().unwrap();
            let live: Vec<usize> = (0..keys.len()).filter(|&i| !held[i].is_empty()).collect();
            if live.is_empty() {
                if arrived == 2 * keys.len() {
                    break;
                }
                continue;
            }
            let i = live[picks[step % picks.len()] % live.len()];
            let o = held[i].remove(0);
            s.begin_scatter(&keys[i], o).unwrap();
            s.scatter_done(o).unwrap();
        }
        prop_assert_eq!(arrived, 2 * keys.len());
        prop_assert!(pending.iter().all(|&p| p == 0), "a flow starved: {:?}", pending);
        prop_assert_eq!(s.flow_count(), 0);
        prop_assert_eq!(s.free_bytes(), s.capacity());
    }
}
