//! Property test of the prefix-cache events: after random workloads (shared prefixes, salts, forks,
//! eviction under small pools, preemption by recompute and swap, aborts, pool resizes, cache
//! resets), the events drained after each operation, replayed in order or applied as net changes,
//! give exactly the prefix cache's hash set.

mod common;

use std::collections::{HashMap, HashSet};

use common::Sim;
use pagedrs_core::kv_events::{KvEventKind, KvEvents};
use pagedrs_core::prefix_cache::{block_hash, extra_key_of, root_hash};
use pagedrs_core::Config;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add {
        template: u8,
        shared: u8,
        tail: u8,
        n: u8,
        max_tokens: u8,
        salt: Option<u8>,
    },
    Steps(u8),
    AbortOne(u16),
    Resize(u8),
    ResetCache,
    Toggle,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u8..40, 0u8..12, 1u8..3, 1u8..12, prop::option::weighted(0.3, 0u8..2))
            .prop_map(|(template, shared, tail, n, max_tokens, salt)| Op::Add {
                template, shared, tail, n, max_tokens, salt
            }),
        6 => (1u8..6).prop_map(Op::Steps),
        1 => any::<u16>().prop_map(Op::AbortOne),
        1 => (2u8..40).prop_map(Op::Resize),
        1 => Just(Op::ResetCache),
        1 => Just(Op::Toggle),
    ]
}

fn config() -> impl Strategy<Value = Config> {
    (
        3usize..24,
        prop::sample::select(vec![1usize, 2, 4]),
        4usize..48,
        1usize..6,
        prop::sample::select(vec![0usize, 0, 8]),
    )
        .prop_map(
            |(num_blocks, block_size, budget, max_num_seqs, swap)| Config {
                num_blocks,
                block_size,
                max_num_batched_tokens: budget,
                max_num_seqs,
                max_model_len: 64,
                num_swap_blocks: swap,
                ..Config::default()
            },
        )
}

fn prompt(template: u8, shared: u8, tail: u8, seed: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..u32::from(shared))
        .map(|k| 2 + (u32::from(template) * 7 + k * 13) % 6)
        .collect();
    let mut x = seed | 1;
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

/// A consumer of the events: the replayed set, the set built from net changes, and every stored
/// hash's extra key (to check that a block's extra key is its parent's).
#[derive(Default)]
struct Consumer {
    replayed: HashSet<u64>,
    netted: HashSet<u64>,
    key_of: HashMap<u64, u64>,
    /// Recording was off for a while: parents cached then have no known key.
    was_off: bool,
    /// What the run went through: preempted sequences, swapped-out blocks, blocks moved by a shrink.
    preempted: usize,
    swapped: usize,
    moved: usize,
    stored: usize,
    removed: usize,
    cleared: usize,
}

impl Consumer {
    fn take(&mut self, ev: &KvEvents, block_size: usize) {
        assert_eq!(ev.block_size, block_size);
        let mut k = 0;
        for i in 0..ev.len() {
            match ev.kinds[i] {
                KvEventKind::Stored => {
                    let toks = &ev.tokens[k * block_size..(k + 1) * block_size];
                    k += 1;
                    let (h, parent, key) = (ev.hashes[i], ev.parents[i], ev.extra_keys[i]);
                    assert_eq!(h, block_hash(parent, toks), "stored hash is its block's");
                    let parent_key = self.key_of.get(&parent).copied();
                    assert!(
                        parent == root_hash(key)
                            || parent_key == Some(key)
                            || (parent_key.is_none() && self.was_off),
                        "block {h:#x}: extra key {key:#x}, parent {parent:#x} of key {parent_key:?}"
                    );
                    self.key_of.insert(h, key);
                    self.stored += 1;
                }
                KvEventKind::Removed => self.removed += 1,
                KvEventKind::Cleared => self.cleared += 1,
            }
        }
        assert_eq!(k * block_size, ev.tokens.len());
        ev.apply(&mut self.replayed);
        let net = ev.net();
        if net.cleared {
            self.netted.clear();
        }
        for h in &net.removed {
            assert!(self.netted.remove(h), "net removal of {h:#x}, not cached");
        }
        for &h in &net.stored {
            assert!(self.netted.insert(h), "net store of {h:#x}, already cached");
        }
    }
}

fn cached(sim: &Sim) -> HashSet<u64> {
    sim.s.pool().cache().hashes().collect()
}

/// Runs `ops`; after each, drains the events into the consumer and compares its sets with the
/// cache. While recording is toggled off the consumer resynchronizes from the cache (as a router
/// does on reconnect), and nothing is recorded.
fn run(cfg: Config, ops: Vec<Op>, seed: u64) -> Consumer {
    let bs = cfg.block_size;
    let mut sim = Sim::new(cfg, seed);
    sim.s.set_kv_events(true);
    let mut c = Consumer::default();
    let salt = |s: u8| s.to_string();
    for (k, op) in ops.into_iter().enumerate() {
        match op {
            Op::Add {
                template,
                shared,
                tail,
                n,
                max_tokens,
                salt: s,
            } => {
                let p = prompt(template, shared, tail, seed ^ k as u64);
                let _ = sim.add(&p, n as usize, max_tokens as usize, 0, s.map(salt), false);
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
            Op::Resize(n) => {
                sim.resize(n as usize);
                if sim.s.has_unfinished() {
                    sim.step(); // a shrink takes effect in the next plan
                }
            }
            Op::ResetCache => {
                sim.s.reset_prefix_cache();
            }
            Op::Toggle => {
                let on = !sim.s.kv_events_enabled();
                sim.s.set_kv_events(on);
                if on {
                    c.replayed = cached(&sim);
                    c.netted = c.replayed.clone();
                    c.was_off = true;
                }
            }
        }
        let ev = sim.s.take_kv_events();
        if !sim.s.kv_events_enabled() {
            assert!(ev.is_empty(), "events recorded while off");
            continue;
        }
        c.take(&ev, bs);
        let want = cached(&sim);
        assert_eq!(c.replayed, want, "replayed events after op {k}");
        assert_eq!(c.netted, want, "net changes after op {k}");
    }
    (c.preempted, c.swapped, c.moved) = (sim.preemptions_seen, sim.swaps_seen, sim.moves_seen);
    c
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn events_rebuild_the_cached_set(cfg in config(), ops in prop::collection::vec(op(), 1..60), seed in any::<u64>()) {
        run(cfg, ops, seed);
    }
}

/// The random runs do store, evict and clear, and go through preemption, swapping and pool moves (a
/// guard against a vacuous property test).
#[test]
fn random_runs_store_evict_and_clear() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (config(), prop::collection::vec(op(), 1..60), any::<u64>());
    let (mut stored, mut removed, mut cleared) = (0, 0, 0);
    let (mut preempted, mut swapped, mut moved) = (0, 0, 0);
    for _ in 0..200 {
        let (cfg, ops, seed) = strategy.new_tree(&mut runner).unwrap().current();
        let c = run(cfg, ops, seed);
        stored += c.stored;
        removed += c.removed;
        cleared += c.cleared;
        preempted += c.preempted;
        swapped += c.swapped;
        moved += c.moved;
    }
    assert!(
        stored > 2000 && removed > 500 && cleared > 50,
        "{stored} {removed} {cleared}"
    );
    assert!(
        preempted > 20 && swapped > 20 && moved > 20,
        "{preempted} {swapped} {moved}"
    );
}

#[test]
fn salted_blocks_carry_their_extra_key_and_recording_is_off_by_default() {
    let cfg = Config {
        num_blocks: 16,
        block_size: 2,
        ..Config::default()
    };
    let mut sim = Sim::new(cfg, 1);
    assert!(!sim.s.kv_events_enabled());
    sim.add(&[2, 3, 4, 5, 6], 1, 1, 0, None, false).unwrap();
    sim.step();
    assert!(sim.s.take_kv_events().is_empty());
    sim.s.set_kv_events(true);
    sim.add(&[2, 3, 4, 5, 6], 1, 1, 0, Some("t".into()), false)
        .unwrap();
    sim.step();
    let ev = sim.s.take_kv_events();
    assert_eq!(ev.kinds, vec![KvEventKind::Stored; 2]);
    assert_eq!(ev.extra_keys, vec![extra_key_of("t"); 2]);
    assert_eq!(ev.parents[0], root_hash(extra_key_of("t")));
    assert_eq!(ev.tokens, vec![2, 3, 4, 5]);
}
