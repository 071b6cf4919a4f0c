//! The deterministic protocol simulator (issue 17; docs/protocol.md).
//!
//! * `ci_seeds_*`: seeds `0..KVFABRIC_SIM_SEEDS` (default 10,000), split in
//!   two tests so both cores work; `KVFABRIC_SIM_START` shifts the range.
//!   The long run: `KVFABRIC_SIM_SEEDS=1000000 cargo test --release -p
//!   kvfabric-core --test protocol_sim ci_seeds -- --nocapture`.
//! * `replay`: `KVFABRIC_SIM_REPLAY=<seed> [KVFABRIC_SIM_BUDGET=<n>]
//!   [KVFABRIC_SIM_MUTATION=<name>]` replays one run and prints its event
//!   list if it fails (always with `KVFABRIC_SIM_PRINT=1`).
//! * `mutation_*`: each guard switched off in turn must be caught within the
//!   CI seed budget.
//! * Every run is in the scoped world (engine pools, scoped requests,
//!   engine detaches) unless `KVFABRIC_SIM_WORLD=legacy` (`replay`, `hunt`):
//!   the world before engine scopes, run for run, where the regression
//!   seeds of bugs 1–5 live.

mod sim;

use kvfabric_core::protocol::Mutations;
use sim::{run_seed, run_seed_in, Sim};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// Seeds of the CI run.
const CI_SEEDS: u64 = 10_000;

fn seeds_part(part: u64, parts: u64) {
    let n = env_u64("KVFABRIC_SIM_SEEDS", CI_SEEDS);
    let start = env_u64("KVFABRIC_SIM_START", 0);
    let t0 = std::time::Instant::now();
    let (mut steps, mut ok, mut failed, mut crashes) = (0u64, 0u64, 0u64, 0u64);
    let (mut uniform, mut blocks) = (0u64, 0u64);
    let mut c = kvfabric_core::protocol::Counters::default();
    let mut seed = start + part;
    while seed < start + n {
        match run_seed(seed, Mutations::default()) {
            Ok(s) => {
                steps += s.steps_total();
                ok += s.succeeded;
                failed += s.failed;
                crashes += s.crashes;
                uniform += s.uniform_scatters;
                blocks += s.block_scatters;
                sim::add_counters(&mut c, &s.counters);
            }
            Err(f) => panic!("{f}"),
        }
        seed += parts;
    }
    eprintln!(
        "protocol_sim part {part}/{parts}: {} seeds from {start}, {steps} steps, {ok} requests succeeded, {failed} failed, {crashes} crashes, {uniform} uniform scatters, {blocks} block scatters, {:.1} s",
        n.div_ceil(parts),
        t0.elapsed().as_secs_f64()
    );
    eprintln!("protocol_sim part {part}/{parts} machine counters: {c:?}");
    // Half the seeds send DATA_UNIFORM: the run must have scattered some.
    assert!(
        n < 100 || uniform > 0,
        "no DATA_UNIFORM was scattered in {n} seeds"
    );
    assert!(
        n < 100 || blocks > 0,
        "no DATA_BLOCKS was scattered in {n} seeds"
    );
}

#[test]
fn ci_seeds_0() {
    seeds_part(0, 2);
}

#[test]
fn ci_seeds_1() {
    seeds_part(1, 2);
}

fn mutation_named(name: &str) -> Mutations {
    let mut m = Mutations::default();
    match name {
        "" | "none" => {}
        "orphan_deferral" => m.no_orphan_deferral = true,
        "held_by_flow" => m.no_held_by_flow_validation = true,
        "cancel_deferral" => m.no_cancel_deferral = true,
        "bidirectional_reserve" => m.no_bidirectional_reserve = true,
        "unkeyed_credits" => m.unkeyed_credits = true,
        "unchecked_data_chunk" => m.unchecked_data_chunk = true,
        "legacy_eager_reserve" => m.legacy_eager_reserve = true,
        "legacy_flow_silence" => m.legacy_flow_silence = true,
        "legacy_credit_expiry" => m.legacy_credit_expiry = true,
        "no_flow_tombstones" => m.no_flow_tombstones = true,
        "legacy_silence_sweep" => m.legacy_silence_sweep = true,
        "reclaim_on_forget_scope" => m.reclaim_on_forget_scope = true,
        "unscoped_data_validation" => m.unscoped_data_validation = true,
        "legacy_forget_scope_queue" => m.legacy_forget_scope_queue = true,
        "unchecked_uniform_dsts" => m.unchecked_uniform_dsts = true,
        other => panic!("unknown mutation {other:?}"),
    }
    m
}

/// `KVFABRIC_SIM_WORLD=legacy`: the world before engine scopes.
fn scoped_world() -> bool {
    std::env::var("KVFABRIC_SIM_WORLD").map_or(true, |w| w != "legacy")
}

#[test]
fn replay() {
    let Ok(seed) = std::env::var("KVFABRIC_SIM_REPLAY") else {
        return;
    };
    let seed: u64 = seed.parse().expect("KVFABRIC_SIM_REPLAY is a seed number");
    let budget = std::env::var("KVFABRIC_SIM_BUDGET")
        .ok()
        .map(|b| b.parse().expect("budget"));
    let m = mutation_named(&std::env::var("KVFABRIC_SIM_MUTATION").unwrap_or_default());
    let scoped = scoped_world();
    if std::env::var_os("KVFABRIC_SIM_PRINT").is_some() {
        for line in Sim::with_world(seed, budget, m, true, scoped).trace_of() {
            eprintln!("  {line}");
        }
    }
    match Sim::with_world(seed, budget, m, true, scoped).run() {
        Ok(s) => eprintln!("seed {seed}: all invariants held ({s:?})"),
        Err(f) => panic!("{f}"),
    }
}

/// The first seed below the CI budget that `m` fails, with its report.
fn first_catch(name: &str) -> (u64, String) {
    let m = mutation_named(name);
    for seed in 0..CI_SEEDS {
        if let Err(f) = run_seed(seed, m) {
            return (seed, f.to_string());
        }
    }
    panic!("mutation {name}: no seed below {CI_SEEDS} caught it");
}

fn check_mutation(name: &str) {
    let (seed, report) = first_catch(name);
    let first = report.lines().next().unwrap_or_default().to_string();
    eprintln!("mutation {name}: caught by seed {seed}: {first}");
}

#[test]
fn mutation_orphan_deferral() {
    check_mutation("orphan_deferral");
}

#[test]
fn mutation_held_by_flow_validation() {
    check_mutation("held_by_flow");
}

#[test]
fn mutation_cancel_deferral() {
    check_mutation("cancel_deferral");
}

#[test]
fn mutation_bidirectional_reserve() {
    check_mutation("bidirectional_reserve");
}

/// Engine scopes: reclaiming a detached engine's flows at `ForgetScope`
/// frees regions under the senders' in-flight writes.
#[test]
fn mutation_reclaim_on_forget_scope() {
    check_mutation("reclaim_on_forget_scope");
}

/// Engine scopes: DATA validated against every scope's pool instead of
/// its flow's scatters into another engine's pool.
#[test]
fn mutation_unscoped_data_validation() {
    check_mutation("unscoped_data_validation");
}

/// DATA_UNIFORM (issue 18 step 3): pieces not checked against the
/// destination's memory land outside it.
#[test]
fn mutation_unchecked_uniform_dsts() {
    check_mutation("unchecked_uniform_dsts");
}

/// Bugs the simulator found in `Io`'s rules (docs/protocol.md): each seed
/// fails under the old rule and passes under the machine's. Bugs 1–5 were
/// found before engine scopes: their seeds run in that world
/// (`KVFABRIC_SIM_WORLD=legacy`), which the scoped simulator keeps run for
/// run.
#[test]
fn regression_seeds() {
    for (name, seed, scoped) in [
        ("unkeyed_credits", 127, false),
        ("unchecked_data_chunk", 337, false),
        ("legacy_eager_reserve", 205, false),
        ("legacy_flow_silence", 5363, false),
        ("legacy_credit_expiry", 2003298, false),
        ("legacy_forget_scope_queue", 1161, true),
    ] {
        assert!(
            run_seed_in(seed, mutation_named(name), scoped).is_err(),
            "seed {seed} no longer catches {name}"
        );
        if let Err(f) = run_seed_in(seed, Mutations::default(), scoped) {
            panic!("regression seed {seed} ({name}) fails: {f}");
        }
    }
}

/// The same seed makes the same run, event for event.
#[test]
fn a_seed_replays_exactly() {
    for seed in [7, 779, 4242] {
        let a = Sim::new(seed, None, Mutations::default(), true).trace_of();
        let b = Sim::new(seed, None, Mutations::default(), true).trace_of();
        assert!(a.len() > 20, "seed {seed}: only {} events", a.len());
        assert_eq!(a, b, "seed {seed} is not deterministic");
    }
}

/// Counts the seeds below `KVFABRIC_SIM_SEEDS` that `KVFABRIC_SIM_MUTATION`
/// fails and lists the first five (to pick regression seeds):
/// `KVFABRIC_SIM_MUTATION=legacy_credit_expiry KVFABRIC_SIM_SEEDS=100000
/// cargo test --release -p kvfabric-core --test protocol_sim hunt --
/// --ignored --nocapture`.
#[test]
#[ignore]
fn hunt() {
    let name = std::env::var("KVFABRIC_SIM_MUTATION").unwrap_or_default();
    let m = mutation_named(&name);
    let n = env_u64("KVFABRIC_SIM_SEEDS", CI_SEEDS);
    let start = env_u64("KVFABRIC_SIM_START", 0);
    let mut found = 0;
    let scoped = scoped_world();
    for seed in start..start + n {
        if let Err(f) = Sim::with_world(seed, None, m, false, scoped).run() {
            if found < 5 {
                eprintln!("{name}: seed {seed}: {}", f.what);
            }
            found += 1;
        }
    }
    eprintln!(
        "{name}: {found} of {n} seeds catch it ({start}..{})",
        start + n
    );
}
