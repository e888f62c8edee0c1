//! A window group inside the scheduler: freed mid-request, hits across the window, its tables in
//! the plan, random workloads with forks, aborts and preemption.
use crate::sliding_window::{max_live_blocks, NULL_BLOCK};
use crate::{Config, NewRequest, Scheduler};

fn sched(num_blocks: usize, window_blocks: usize, budget: usize) -> Scheduler {
    sched_swap(num_blocks, window_blocks, budget, 0)
}

fn sched_swap(num_blocks: usize, window_blocks: usize, budget: usize, swap: usize) -> Scheduler {
    let mut s = Scheduler::new(Config {
        num_blocks,
        block_size: 4,
        max_model_len: 256,
        max_num_batched_tokens: budget,
        watermark: 0.0,
        num_swap_blocks: swap,
        ..Config::default()
    })
    .unwrap();
    s.add_window_group(8, window_blocks).unwrap();
    s
}

fn req(id: i64, prompt: Vec<i64>, max_tokens: i64) -> NewRequest {
    NewRequest {
        seq_ids: vec![id],
        prompt_token_ids: prompt,
        max_tokens,
        ..Default::default()
    }
}

fn window_used(s: &Scheduler) -> usize {
    let st = &s.kv_group_stats()[0];
    st.num_blocks - st.num_free_blocks
}

/// Runs to completion, checking invariants each step; returns the most window blocks in use.
fn drain(s: &mut Scheduler) -> usize {
    let mut most = 0;
    let mut step = 0i64;
    while s.has_unfinished() {
        let p = s.schedule().unwrap();
        s.check_invariants().unwrap();
        most = most.max(window_used(s));
        let st = s.stats();
        let usage: Vec<f64> = s.kv_group_stats().iter().map(|g| g.kv_usage).collect();
        assert_eq!(st.group_kv_usage, usage);
        assert_eq!(
            st.kv_usage,
            usage.iter().fold(s.pool().usage(), |a, &b| a.max(b))
        );
        let sampled: Vec<i64> = (0..p.sampled_seq_ids.len() as i64)
            .map(|i| 1 + (step * 7 + i) % 50)
            .collect();
        s.update(p.step_id, &sampled).unwrap();
        s.check_invariants().unwrap();
        step += 1;
    }
    most
}

#[test]
fn refuses_a_pool_smaller_than_one_sequence() {
    let mut s = Scheduler::new(Config::default()).unwrap();
    let e = s.add_window_group(4, 2).unwrap_err().to_string();
    assert!(e.contains("2 blocks") && e.contains("live blocks"), "{e}");
}

#[test]
fn window_blocks_are_freed_mid_request() {
    // A 100-token prompt in chunks of 8, then 20 decode steps: the full group ends holding 30
    // blocks, the window group never more than the window's live blocks.
    let mut s = sched(64, 16, 8);
    s.add_request(req(1, (1..=100).collect(), 20)).unwrap();
    let most = drain(&mut s);
    assert!(most <= max_live_blocks(8, 4, 8), "{most}");
    s.add_request(req(2, (1..=30).collect(), 2)).unwrap();
    let p = s.schedule().unwrap();
    let (slots, tables) = (&p.group_slot_mapping, &p.group_block_tables);
    assert_eq!(p.num_groups(), 1);
    assert_eq!(tables.len(), p.num_reqs() * p.max_blocks);
    let t = s.group_blocks_of(0, 2).unwrap();
    assert_eq!(slots.len(), p.positions.len());
    for (&slot, &pos) in slots.iter().zip(&p.positions) {
        assert_eq!(slot, i64::from(t[pos as usize / 4]) * 4 + pos % 4);
    }
    let want: Vec<i32> = t
        .iter()
        .map(|&b| if b == NULL_BLOCK { 0 } else { b as i32 })
        .collect();
    assert_eq!(tables[..t.len()], want[..]);
    s.update(p.step_id, &vec![3; p.sampled_seq_ids.len()])
        .unwrap();
    drain(&mut s);
    assert!(s.kv_group_stats()[0].num_free_blocks == 16);
    assert_eq!(s.pool().num_free(), 64);
}

#[test]
fn prefix_hit_across_the_window_maps_only_cached_window_blocks() {
    let prompt: Vec<i64> = (1..=41).collect();
    let mut s = sched(64, 16, 8);
    s.add_request(req(1, prompt.clone(), 1)).unwrap();
    drain(&mut s);
    // The same prompt again: all 10 full blocks hit; the window group holds blocks 8 and 9.
    s.add_request(req(2, prompt.clone(), 3)).unwrap();
    let p = s.schedule().unwrap();
    assert_eq!(s.num_cached_tokens(2).unwrap(), 40);
    let t = s.group_blocks_of(0, 2).unwrap();
    assert!(t[..8].iter().all(|&b| b == NULL_BLOCK), "{t:?}");
    assert!(t[8..].iter().all(|&b| b != NULL_BLOCK), "{t:?}");
    s.check_invariants().unwrap();
    s.update(p.step_id, &[5]).unwrap();
    drain(&mut s);
    // Another prompt evicts the window group's cache (16 blocks); the full group keeps its
    // blocks, but a hit must not bring back evicted window blocks: it shrinks to what the
    // window group still holds (nothing here).
    s.add_request(req(3, (100..164).collect(), 1)).unwrap();
    drain(&mut s);
    s.add_request(req(4, prompt, 1)).unwrap();
    s.schedule().unwrap();
    s.check_invariants().unwrap();
    // (check_invariants: every live window entry is a block cached with this prompt's hash.)
    let hit = s.num_cached_tokens(4).unwrap();
    assert!(hit < 40, "{hit}");
    assert_eq!(s.stats().prefix_cache_hits, 40 + hit as u64);
}

#[test]
fn random_workloads_keep_every_group_consistent() {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let (mut preempted, mut hits, mut copies, mut swaps) = (0, 0, 0, [0, 0]);
    for round in 0..30 {
        let window_blocks = 8 + next(16) as usize;
        // Every third round swaps on preemption where the swap pools have room.
        let swap = if round % 3 == 2 {
            8 + next(40) as usize
        } else {
            0
        };
        let (blocks, budget) = (24 + next(40) as usize, 4 + next(12) as usize);
        let mut s = sched_swap(blocks, window_blocks, budget, swap);
        if round % 2 == 1 {
            // A second window size: one group each, the hit the longest both serve.
            s.add_window_group(16, window_blocks + 8).unwrap();
        }
        let mut id = 0;
        for _ in 0..60 {
            if next(3) == 0 && s.num_unfinished() < 8 {
                let base = next(3) as i64 * 1000;
                let len = 1 + next(60) as i64;
                let prompt = (0..len).map(|t| base + t + 1).collect();
                let n = if next(4) == 0 { 2 } else { 1 };
                let r = NewRequest {
                    seq_ids: (id..id + n).collect(),
                    ..req(id, prompt, 1 + next(20) as i64)
                };
                s.add_request(r).unwrap();
                id += n;
            }
            if !s.has_unfinished() {
                continue;
            }
            let p = s.schedule().unwrap();
            s.check_invariants().unwrap();
            copies += p.group_copies.len();
            swaps[0] += p.group_swap_out.len() / 3;
            swaps[1] += p.group_swap_in.len() / 3;
            let sampled: Vec<i64> = (0..p.sampled_seq_ids.len())
                .map(|_| 1 + next(3) as i64)
                .collect();
            s.update(p.step_id, &sampled).unwrap();
            s.check_invariants().unwrap();
            if next(10) == 0 {
                if let Some(&seq_id) = p.req_ids.first() {
                    s.abort(&[seq_id]);
                    s.check_invariants().unwrap();
                }
            }
        }
        drain(&mut s);
        let st = s.stats();
        preempted += st.num_preemptions;
        hits += st.prefix_cache_hits;
        assert_eq!(st.num_free_blocks, st.num_blocks, "round {round}");
        assert_eq!(st.num_free_swap_blocks, st.num_swap_blocks, "round {round}");
        for g in s.kv_group_stats() {
            assert_eq!(g.num_free_blocks, g.num_blocks, "round {round}: {}", g.name);
        }
    }
    assert!(
        preempted > 0 && hits > 0 && copies > 0 && swaps[0] > 0 && swaps[1] > 0,
        "{preempted} preemptions, {hits} hit tokens, {copies} copy-on-write ids, {swaps:?} \
         group blocks swapped out and in"
    );
}

#[test]
fn swap_moves_the_window_blocks_and_brings_them_back() {
    // Two 40-token prompts decoding in a full pool of 24 blocks: the second is preempted and
    // swapped, its window group's live blocks with it (its dead entries stay empty), then swapped
    // back into fresh blocks at the same entries.
    let mut s = sched_swap(24, 16, 8, 32);
    s.add_request(req(1, (1..=40).collect(), 40)).unwrap();
    s.add_request(req(2, (101..=140).collect(), 40)).unwrap();
    let (mut before, mut out, mut back) = (Vec::new(), Vec::new(), false);
    let mut step = 0i64;
    while s.has_unfinished() {
        if s.stats().num_swapped == 0 {
            before = s.group_blocks_of(0, 2).unwrap_or_default();
        }
        let p = s.schedule().unwrap();
        s.check_invariants().unwrap();
        if !p.group_swap_out.is_empty() {
            out = p.group_swap_out.clone();
            let live: Vec<i64> = before
                .iter()
                .filter(|&&b| b != NULL_BLOCK)
                .map(|&b| i64::from(b))
                .collect();
            let moved: Vec<i64> = out.chunks(3).map(|t| t[1]).collect();
            assert_eq!(moved.iter().rev().copied().collect::<Vec<_>>(), live);
            assert!(out.chunks(3).all(|t| t[0] == 0));
            assert!(s.group_blocks_of(0, 2).unwrap().is_empty());
        }
        if !p.group_swap_in.is_empty() {
            back = true;
            let swapped: Vec<i64> = out.chunks(3).map(|t| t[2]).collect();
            let got: Vec<i64> = p.group_swap_in.chunks(3).map(|t| t[1]).collect();
            assert_eq!(got, swapped);
            let t = s.group_blocks_of(0, 2).unwrap();
            let dead = before.iter().take_while(|&&b| b == NULL_BLOCK).count();
            assert!(t[..dead].iter().all(|&b| b == NULL_BLOCK), "{t:?}");
            let placed: Vec<i64> = p.group_swap_in.chunks(3).map(|t| t[2]).collect();
            let live: Vec<i64> = t[dead..before.len()]
                .iter()
                .map(|&b| i64::from(b))
                .collect();
            assert_eq!(placed.iter().rev().copied().collect::<Vec<_>>(), live);
        }
        let sampled = vec![7; p.sampled_seq_ids.len()];
        s.update(p.step_id, &sampled).unwrap();
        s.check_invariants().unwrap();
        step += 1;
    }
    assert!(
        !out.is_empty() && back,
        "the second request was swapped out and back"
    );
    assert!(step > 40);
    let st = s.stats();
    assert_eq!(st.num_free_swap_blocks, st.num_swap_blocks);
}

#[test]
fn each_window_group_records_its_own_prefix_cache_events() {
    // Recording turned on after the group was added, and a group added while recording: both log
    // the blocks their pools cache (a subset of the full-attention pool's, the same hashes), and
    // nothing is recorded once recording is off.
    let mut s = sched(64, 16, 8);
    s.set_kv_events(true);
    s.add_window_group(16, 24).unwrap();
    s.add_request(req(1, (1..=41).collect(), 1)).unwrap();
    drain(&mut s);
    let full = s.take_kv_events();
    let groups = s.take_group_kv_events();
    assert_eq!(groups.len(), 2);
    let stored = |e: &crate::kv_events::KvEvents| -> Vec<u64> {
        e.kinds
            .iter()
            .zip(&e.hashes)
            .filter(|(&k, _)| k == crate::kv_events::KvEventKind::Stored)
            .map(|(_, &h)| h)
            .collect()
    };
    let all = stored(&full);
    assert_eq!(all.len(), 10);
    for g in &groups {
        let own = stored(g);
        assert!(
            !own.is_empty() && own.iter().all(|h| all.contains(h)),
            "{own:?}"
        );
        assert_eq!(g.block_size, 4);
    }
    s.set_kv_events(false);
    s.add_request(req(2, (100..=141).collect(), 1)).unwrap();
    drain(&mut s);
    assert!(s.take_group_kv_events().iter().all(|e| e.is_empty()));
}
