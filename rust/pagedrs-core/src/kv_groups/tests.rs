//! The coordinator over groups: the hit is the longest prefix every group serves (asked again
//! after one caps it), admission and growth need every group, freeing releases every group, and a
//! group that allocates nothing takes part without a pool.

use super::*;
use crate::paged_group::PagedGroup;
use crate::prefix_cache::{block_hash, root_hash};
use crate::request::Status;
use crate::sliding_window::NULL_BLOCK;
use crate::{Config, NewRequest, Scheduler};

const BS: usize = 4;

/// A running sequence of `len` tokens (1, 2, ..), `num_computed` of them computed.
fn seq(len: usize, num_computed: usize) -> Seq {
    let mut s = Scheduler::new(Config {
        num_blocks: 64,
        block_size: BS,
        max_model_len: 256,
        ..Config::default()
    })
    .unwrap();
    s.add_request(NewRequest {
        seq_ids: vec![1],
        prompt_token_ids: (1..=len as i64).collect(),
        max_tokens: 1,
        ..Default::default()
    })
    .unwrap();
    let mut q = s.seqs[0].clone();
    q.flush();
    q.num_computed = num_computed;
    q.status = Status::Running;
    q
}

fn chain(tokens: &[u32], blocks: usize) -> Vec<u64> {
    let mut c = vec![root_hash(0)];
    for i in 0..blocks {
        c.push(block_hash(c[i], &tokens[i * BS..(i + 1) * BS]));
    }
    c
}

/// Admits `q` into `g` as slot 0, caches its full blocks `cached`, then frees it: those blocks
/// stay in the group's prefix cache.
fn cache_blocks(g: &mut PagedGroup, q: &Seq, cached: &[usize]) {
    let c = chain(&q.tokens, q.num_computed / BS);
    g.admit(0, Vec::new(), q.num_computed);
    let items: Vec<CacheItem> = cached
        .iter()
        .map(|&i| CacheItem {
            block: crate::BlockId(0), // the group maps its own block
            hash: c[i + 1],
            parent: c[i],
            extra_key: 0,
            slot: 0,
            idx: i as u32,
        })
        .collect();
    g.cache(&items, std::slice::from_ref(q));
    g.free(0);
}

#[test]
fn the_hit_is_the_longest_prefix_every_group_serves() {
    let q = seq(40, 40);
    let c = chain(&q.tokens, 10);
    // Window 8 needs the 2 blocks before the hit point: it serves 10 blocks (8, 9 cached), then
    // 4 once the full group caps the hit at 6 (blocks 4, 5 are not cached, 2 and 3 are).
    let mut window = PagedGroup::sliding_window(8, 32, BS, 256, 8).unwrap();
    cache_blocks(&mut window, &q, &[0, 1, 2, 3, 7, 8, 9]);
    let mut full = PagedGroup::full_attention(32, BS);
    cache_blocks(&mut full, &q, &[0, 1, 2, 3, 4, 5, 7, 8, 9]);
    assert_eq!(window.longest_hit(10, &c, &q.tokens).0, 10);
    assert_eq!(full.longest_hit(10, &c, &q.tokens).0, 6);
    let mut groups = KvGroups::default();
    groups.push(Box::new(window));
    groups.push(Box::new(full));
    let (n, tables) = groups.cap_hit(10, &c, &q.tokens);
    assert_eq!(n, 4);
    assert_eq!(tables.len(), 2);
    assert_eq!(tables[0].len(), 4);
    assert_eq!(&tables[0][..2], &[NULL_BLOCK, NULL_BLOCK]);
    assert!(tables[0][2..].iter().all(|&b| b != NULL_BLOCK));
    assert_eq!(tables[1].len(), 4);
    assert!(tables[1].iter().all(|&b| b != NULL_BLOCK));
    // The primary pool's own hit caps them all.
    assert_eq!(groups.cap_hit(1, &c, &q.tokens).0, 1);
    assert_eq!(groups.cap_hit(0, &c, &q.tokens), (0, vec![vec![], vec![]]));
}

#[test]
fn admission_and_growth_need_every_group_and_freeing_releases_every_group() {
    let mut groups = KvGroups::default();
    groups.push(Box::new(
        PagedGroup::sliding_window(8, 6, BS, 256, 8).unwrap(),
    ));
    groups.push(Box::new(PagedGroup::full_attention(8, BS)));
    let none = vec![Vec::new(), Vec::new()];
    // 32 tokens: 8 blocks in each group; the window group has only 6.
    assert!(!groups.fits_admit(&none, 32));
    assert!(groups.fits_admit(&none, 24));
    groups.admit(3, none.clone(), 24);
    let q = seq(40, 24);
    assert!(
        !groups.fits(3, &q, 32),
        "the window group holds 6 blocks, 8 needed"
    );
    // Committed at 24: window 8 keeps blocks 4, 5 (tokens 17..24); 4 freed.
    groups.release(3, 24);
    assert!(groups.fits(3, &q, 32));
    groups.grow(3, &q, 32);
    let used: Vec<usize> = groups
        .stats()
        .iter()
        .map(|s| s.num_blocks - s.num_free_blocks)
        .collect();
    assert_eq!(used, vec![4, 8]);
    groups.free(3);
    assert!(groups.is_idle());
    let free: Vec<usize> = groups.stats().iter().map(|s| s.num_free_blocks).collect();
    assert_eq!(free, vec![6, 8]);
}

/// A group whose layers read another group's KV: it owns nothing and never caps a hit.
#[derive(Debug)]
struct SharedKv;

impl KvGroup for SharedKv {
    fn name(&self) -> String {
        "shared".into()
    }
    fn pool(&self) -> Option<&BlockPool> {
        None
    }
    fn longest_hit(&self, max_blocks: usize, _: &[u64], _: &[u32]) -> (usize, Vec<u32>) {
        (max_blocks, Vec::new())
    }
    fn admit_cost(&self, _: &[u32], _: usize) -> usize {
        0
    }
    fn admit(&mut self, _: u32, _: Vec<u32>, _: usize) {}
    fn grow_cost(&self, _: u32, _: &Seq, _: usize) -> usize {
        0
    }
    fn grow(&mut self, _: u32, _: &Seq, _: usize) {}
    fn fork(&mut self, _: u32, _: u32) {}
    fn cache(&mut self, _: &[CacheItem], _: &[Seq]) {}
    fn release(&mut self, _: u32, _: usize) {}
    fn truncate(&mut self, _: u32, _: usize) {}
    fn free(&mut self, _: u32) {}
    fn plan_row(&self, _: u32, _: usize, _: usize, _: usize, _: &mut Vec<i64>, _: &mut Vec<i32>) {}
    fn take_copies(&mut self) -> Vec<i64> {
        Vec::new()
    }
    fn reset_prefix_cache(&mut self) -> bool {
        true
    }
    fn check(&self, _: &[Seq]) -> std::result::Result<(), String> {
        Ok(())
    }
}

#[test]
fn a_group_that_owns_nothing_runs_in_the_scheduler_without_touching_it() {
    let mut s = Scheduler::new(Config {
        num_blocks: 32,
        block_size: BS,
        max_model_len: 128,
        max_num_batched_tokens: 16,
        ..Config::default()
    })
    .unwrap();
    assert_eq!(s.add_kv_group(Box::new(SharedKv)).unwrap(), 0);
    assert_eq!(s.add_window_group(8, 16).unwrap(), 1);
    let prompt: Vec<i64> = (1..=41).collect();
    for id in 0..2 {
        s.add_request(NewRequest {
            seq_ids: vec![id],
            prompt_token_ids: prompt.clone(),
            max_tokens: 12,
            ..Default::default()
        })
        .unwrap();
        while s.has_unfinished() {
            let p = s.schedule().unwrap();
            assert_eq!(p.num_groups(), 2);
            assert_eq!(p.group_slot_mapping.len(), p.positions.len()); // the shared group writes none
            s.check_invariants().unwrap();
            s.update(p.step_id, &vec![7; p.sampled_seq_ids.len()])
                .unwrap();
        }
    }
    let st = s.stats();
    assert_eq!(st.prefix_cache_hits, 40); // the second prompt hit all 10 full blocks
    assert_eq!(s.kv_group_stats()[0].num_blocks, 0);
    assert_eq!(s.kv_group_stats()[1].num_free_blocks, 16);
    assert!(s.kv_groups().is_idle());
}
