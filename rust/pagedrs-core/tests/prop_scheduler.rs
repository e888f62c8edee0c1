//! Property tests: random add / schedule / update / abort / resize sequences, with every
//! invariant and the simulated KV memory checked after each step.

mod common;

use common::Sim;
use pagedrs_core::{Config, SpecProposer};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add {
        template: u8,
        shared: u8,
        tail: u8,
        n: u8,
        max_tokens: u8,
        priority: i8,
        salt: Option<u8>,
        skip: bool,
    },
    Step,
    Steps(u8),
    AbortOne(u16),
    AbortMidStep(u16),
    Resize(u8),
    ResizeMidStep(u8),
    ResetCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u8..40, 0u8..12, 1u8..4, 1u8..12, -1i8..2, prop::option::weighted(0.2, 0u8..2), prop::bool::weighted(0.1))
            .prop_map(|(template, shared, tail, n, max_tokens, priority, salt, skip)| Op::Add {
                template, shared, tail, n, max_tokens, priority, salt, skip
            }),
        6 => Just(Op::Step),
        2 => (1u8..6).prop_map(Op::Steps),
        1 => any::<u16>().prop_map(Op::AbortOne),
        1 => any::<u16>().prop_map(Op::AbortMidStep),
        1 => (1u8..48).prop_map(Op::Resize),
        1 => (1u8..48).prop_map(Op::ResizeMidStep),
        1 => Just(Op::ResetCache),
    ]
}

fn config() -> impl Strategy<Value = Config> {
    config_with(2..28)
}

fn config_with(pool: std::ops::Range<usize>) -> impl Strategy<Value = Config> {
    (
        (
            pool,
            prop::sample::select(vec![1usize, 2, 4, 8]),
            1usize..48,
            1usize..8,
            8usize..96,
        ),
        (
            any::<bool>(),
            any::<bool>(),
            prop::sample::select(vec![0usize, 0, 4, 24]),
            prop::sample::select(vec![0.0, 0.05, 0.2]),
            prop::sample::select(vec![0usize, 0, 3, 16]),
        ),
        (
            prop::sample::select(vec![0usize, 0, 1, 3, 5]),
            prop::sample::select(vec![
                SpecProposer::Runner,
                SpecProposer::Ngram { min: 1, max: 3 },
                SpecProposer::Ngram { min: 2, max: 2 },
            ]),
            prop::option::weighted(0.3, 1usize..4),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                (num_blocks, block_size, budget, max_num_seqs, max_model_len),
                (caching, chunked, swap, watermark, tier),
                (spec, proposer, disable, adaptive),
            )| Config {
                num_blocks,
                block_size,
                max_num_batched_tokens: budget,
                max_num_seqs,
                max_model_len,
                enable_prefix_caching: caching,
                enable_chunked_prefill: chunked,
                num_swap_blocks: swap,
                num_tier_blocks: tier,
                watermark,
                vocab_size: None,
                num_speculative_tokens: spec.min(budget - 1),
                spec_proposer: proposer,
                spec_disable_batch_size: disable,
                spec_adaptive: adaptive,
            },
        )
}

/// Prompts share prefixes (three templates) so prefix hits are frequent.
fn prompt(template: u8, shared: u8, tail: u8, salt: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..u32::from(shared))
        .map(|k| 2 + (u32::from(template) * 7 + k * 13) % 6)
        .collect();
    let mut x = salt | 1;
    for _ in 0..tail {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p.push(2 + (x % 6) as u32);
    }
    if p.is_empty() {
        p.push(2);
    }
    p
}

fn run(cfg: Config, ops: Vec<Op>, seed: u64) -> Sim {
    let mut sim = Sim::new(cfg, seed);
    for (k, op) in ops.into_iter().enumerate() {
        match op {
            Op::Add {
                template,
                shared,
                tail,
                n,
                max_tokens,
                priority,
                salt,
                skip,
            } => {
                let p = prompt(template, shared, tail, seed ^ k as u64);
                let _ = sim.add(
                    &p,
                    n as usize,
                    max_tokens as usize,
                    i64::from(priority),
                    salt.map(|s| s.to_string()),
                    skip,
                );
            }
            Op::Step => {
                sim.step();
            }
            Op::Steps(n) => {
                for _ in 0..n {
                    sim.step();
                }
            }
            Op::AbortOne(i) => {
                if let Some(&id) = sim.live.keys().nth(i as usize % sim.live.len().max(1)) {
                    sim.abort(&[id]);
                }
            }
            Op::AbortMidStep(i) => {
                let p = sim.schedule_and_run();
                if let Some(&id) = sim.live.keys().nth(i as usize % sim.live.len().max(1)) {
                    sim.abort(&[id]);
                }
                sim.update(&p);
            }
            Op::Resize(n) => sim.resize(n as usize),
            Op::ResizeMidStep(n) => {
                let p = sim.schedule_and_run();
                sim.resize(n as usize);
                sim.update(&p);
            }
            Op::ResetCache => {
                let used = sim.s.pool().num_used();
                assert_eq!(sim.s.reset_prefix_cache(), used == 0);
            }
        }
        sim.s.check_invariants().unwrap();
        // Only schedule() writes the block table: a runner's copy that applied every plan's
        // changed rows equals it after any operation.
        sim.check_mirror();
    }
    // Liveness: everything finishes, and then every block is free.
    sim.drain(2000);
    sim
}

/// The random runs do reach the interesting paths (a guard against a vacuous property test).
#[test]
fn random_runs_cover_preemption_swap_cow_hits_and_moves() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = prop_oneof![
        (config(), prop::collection::vec(op(), 1..60), any::<u64>()),
        (
            config_with(3..10),
            prop::collection::vec(pressure_op(), 1..50),
            any::<u64>()
        ),
    ];
    let (mut preempt, mut swaps, mut copies, mut hits, mut moves, mut steps, mut rows) =
        (0, 0, 0, 0u64, 0, 0, 0);
    let (mut drafts, mut accepted, mut rolled_back) = (0u64, 0u64, 0usize);
    let mut tier_loads = 0;
    for _ in 0..300 {
        let (cfg, ops, seed) = strategy.new_tree(&mut runner).unwrap().current();
        let sim = run(cfg, ops, seed);
        rows += sim.rows_changed_seen;
        preempt += sim.preemptions_seen;
        swaps += sim.swaps_seen;
        copies += sim.copies_seen;
        hits += sim.s.stats().prefix_cache_hits;
        moves += sim.moves_seen;
        steps += sim.steps;
        drafts += sim.s.stats().spec_num_draft_tokens;
        accepted += sim.s.stats().spec_num_accepted_tokens;
        rolled_back += sim.rollbacks_seen;
        tier_loads += sim.tier_loads_seen;
    }
    eprintln!("blocks loaded from the host tier {tier_loads}");
    assert!(tier_loads > 20);
    eprintln!("draft tokens {drafts} accepted {accepted} rows rolled back {rolled_back}");
    assert!(drafts > 500 && accepted > 100 && accepted < drafts && rolled_back > 100);
    eprintln!("steps {steps} preemptions {preempt} swap-outs {swaps} copies {copies} hit tokens {hits} block moves {moves} changed rows {rows}");
    assert!(preempt > 50 && swaps > 20 && copies > 20 && hits > 100 && moves > 20);
    assert!(rows > 1000, "changed rows {rows}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, max_shrink_iters: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_invariants(cfg in config(), ops in prop::collection::vec(op(), 1..60), seed in any::<u64>()) {
        run(cfg, ops, seed);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// Tiny pools and long outputs: preemption (recompute and swap) on most steps.
    #[test]
    fn memory_pressure_keeps_invariants(cfg in config_with(3..10), ops in prop::collection::vec(pressure_op(), 1..50), seed in any::<u64>()) {
        run(cfg, ops, seed);
    }
}

fn pressure_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 0u8..12, 0u8..6, 1u8..3, 8u8..40, -1i8..2).prop_map(|(template, shared, tail, n, max_tokens, priority)| Op::Add {
            template, shared, tail, n, max_tokens, priority, salt: None, skip: false
        }),
        5 => (1u8..4).prop_map(Op::Steps),
        1 => any::<u16>().prop_map(Op::AbortMidStep),
        1 => (3u8..12).prop_map(Op::ResizeMidStep),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Aborting everything at any point frees every block.
    #[test]
    fn abort_all_frees_everything(cfg in config(), ops in prop::collection::vec(op(), 1..40), seed in any::<u64>()) {
        let mut sim = Sim::new(cfg, seed);
        for (k, op) in ops.into_iter().enumerate() {
            match op {
                Op::Add { template, shared, tail, n, max_tokens, priority, salt, skip } => {
                    let p = prompt(template, shared, tail, seed ^ k as u64);
                    let _ = sim.add(&p, n as usize, max_tokens as usize, i64::from(priority), salt.map(|s| s.to_string()), skip);
                }
                Op::Resize(n) => sim.resize(n as usize),
                _ => { sim.step(); }
            }
        }
        let ids: Vec<i64> = sim.live.keys().copied().collect();
        sim.abort(&ids);
        // Sequences the pool could never hold are reported by the next update.
        if sim.s.has_unfinished() {
            let p = sim.s.schedule().unwrap();
            assert_eq!(p.num_tokens, 0);
            sim.s.update(p.step_id, &[]).unwrap();
        }
        sim.assert_all_free();
    }
}
