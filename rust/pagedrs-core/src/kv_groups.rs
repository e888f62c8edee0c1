//! A second KV-cache group for sliding-window layers (vLLM V1's hybrid allocator, llama.cpp's SWA
//! cache): its own block pool and prefix cache, one [`SlidingTable`] per sequence slot, grown
//! with the full-attention group and released behind the window at each committed position.
//!
//! The scheduler calls these hooks at the points where it changes a sequence's full-attention
//! table: admission (the prefix hit is capped to what this group still holds, [`longest_hit`]),
//! growth before a step (a step runs only if every group has its blocks, else it preempts),
//! `update()` (cache newly full blocks, then release the dead ones at the committed position, never
//! counting drafts), speculative rollback (truncate), and every free (finish, abort, preemption).
//! Not supported with a window group: swap space, pool resize and `n > 1` forks (refused).

use crate::block_pool::{BlockPool, CacheItem};
use crate::error::{Error, Result};
use crate::prefix_cache::{block_hash, root_hash};
use crate::request::Status;
use crate::scheduler::Scheduler;
use crate::sliding_window::{longest_hit, max_live_blocks, SlidingTable, NULL_BLOCK};
use crate::BlockId;

/// The blocks of the layers with one window size shorter than the context.
#[derive(Debug)]
pub struct WindowGroup {
    pub window: usize,
    pub pool: BlockPool,
    /// Indexed by sequence slot; empty for slots holding nothing.
    pub(crate) tables: Vec<SlidingTable>,
}

impl WindowGroup {
    pub(crate) fn table_mut(&mut self, slot: u32) -> &mut SlidingTable {
        let i = slot as usize;
        if self.tables.len() <= i {
            self.tables.resize_with(i + 1, SlidingTable::default);
        }
        &mut self.tables[i]
    }

    pub fn table(&self, slot: u32) -> &[u32] {
        self.tables.get(slot as usize).map_or(&[], |t| t.blocks())
    }

    /// Blocks `slot` must newly allocate to cover `num_tokens` tokens.
    pub(crate) fn new_blocks(&self, slot: u32, num_tokens: usize) -> usize {
        num_tokens
            .div_ceil(self.pool.block_size())
            .saturating_sub(self.table(slot).len())
    }

    pub(crate) fn free_slot(&mut self, slot: u32) {
        if let Some(t) = self.tables.get_mut(slot as usize) {
            t.free_all(&mut self.pool);
        }
    }
}

impl Scheduler {
    /// Adds a KV-cache group for the layers attending to the last `window` tokens, with its own
    /// pool of `num_blocks` blocks. Only before any request, without swap space; the pool must
    /// hold one sequence's live blocks at the largest step.
    pub fn enable_window_group(&mut self, window: usize, num_blocks: usize) -> Result<()> {
        if !self.ids.is_empty() || self.window.is_some() {
            return Err(Error::InvalidRequest(
                "a window group is added once, before any request".into(),
            ));
        }
        if window == 0 || window >= self.cfg.max_model_len {
            return Err(Error::InvalidRequest(format!(
                "window {window} must be in [1, max_model_len={})",
                self.cfg.max_model_len
            )));
        }
        if self.cfg.num_swap_blocks > 0 {
            return Err(Error::InvalidRequest(format!(
                "swap space ({} blocks) is not supported with a sliding-window group; set it to 0",
                self.cfg.num_swap_blocks
            )));
        }
        let step = self.cfg.max_num_batched_tokens + self.cfg.num_speculative_tokens;
        let least = max_live_blocks(window, self.cfg.block_size, step);
        if num_blocks < least {
            return Err(Error::InvalidRequest(format!(
                "window group of {num_blocks} blocks cannot hold one sequence's {least} live blocks \
                 (window {window}, block size {}, step {step} tokens)",
                self.cfg.block_size
            )));
        }
        self.window = Some(WindowGroup {
            window,
            pool: BlockPool::new(num_blocks, self.cfg.block_size),
            tables: Vec::new(),
        });
        Ok(())
    }

    pub fn window_group(&self) -> Option<&WindowGroup> {
        self.window.as_ref()
    }

    /// The window group's table of a live seq id (dead entries [`NULL_BLOCK`]).
    pub fn window_table_of(&self, seq_id: i64) -> Result<&[u32]> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        Ok(match (&self.window, r.child) {
            (Some(w), false) => w.table(r.slot),
            _ => &[],
        })
    }

    /// Caps a full-attention prefix hit `hits` of `slot` to what the window group can serve and
    /// returns the group's table for it and the last hit block's hash.
    pub(crate) fn window_cap_hit(&self, slot: u32, hits: &mut Vec<u32>) -> (Vec<u32>, u64) {
        let bs = self.cfg.block_size;
        let seq = &self.seqs[slot as usize];
        let mut chain = Vec::with_capacity(hits.len() + 1);
        chain.push(root_hash(seq.extra_key));
        for i in 0..hits.len() {
            let h = block_hash(chain[i], &seq.tokens[i * bs..(i + 1) * bs]);
            chain.push(h);
        }
        let Some(w) = &self.window else {
            return (Vec::new(), chain[hits.len()]);
        };
        let (n, table) = longest_hit(hits.len(), w.window, bs, |i| {
            w.pool
                .lookup(chain[i + 1], chain[i], &seq.tokens[i * bs..(i + 1) * bs])
        });
        hits.truncate(n);
        (table, chain[n])
    }

    /// Blocks of a window hit table that are cached but free (taking them uses free blocks).
    pub(crate) fn window_evictable(&self, table: &[u32]) -> usize {
        self.window.as_ref().map_or(0, |w| {
            table
                .iter()
                .filter(|&&b| b != NULL_BLOCK && w.pool.ref_count(BlockId(b)) == 0)
                .count()
        })
    }

    /// Whether the window group has the blocks for `slot` to reach `num_tokens` tokens (plus
    /// `extra` blocks taken by a hit still to be claimed).
    pub(crate) fn window_fits(&self, slot: u32, num_tokens: usize, extra: usize) -> bool {
        self.window
            .as_ref()
            .is_none_or(|w| w.new_blocks(slot, num_tokens) + extra <= w.pool.num_free())
    }

    /// [`Self::window_fits`] for a sequence not yet holding anything, admitted with the window hit
    /// `table` to reach `num_tokens` tokens.
    pub(crate) fn window_fits_hit(&self, table: &[u32], num_tokens: usize) -> bool {
        self.window.as_ref().is_none_or(|w| {
            let new = num_tokens.div_ceil(w.pool.block_size()) - table.len();
            new + self.window_evictable(table) <= w.pool.num_free()
        })
    }

    /// Admission of `slot` with the window hit `table` (from [`Self::window_cap_hit`]).
    pub(crate) fn window_admit(&mut self, slot: u32, table: Vec<u32>, num_tokens: usize) {
        if let Some(w) = self.window.as_mut() {
            let t = SlidingTable::from_hit(&mut w.pool, table);
            *w.table_mut(slot) = t;
            let grown = w.tables[slot as usize].grow(&mut w.pool, num_tokens);
            assert!(grown, "window blocks checked before admission");
        }
    }

    pub(crate) fn window_grow(&mut self, slot: u32, num_tokens: usize) {
        if let Some(w) = self.window.as_mut() {
            let t = w.table_mut(slot);
            let mut t = std::mem::take(t);
            let grown = t.grow(&mut w.pool, num_tokens);
            w.tables[slot as usize] = t;
            assert!(grown, "window blocks checked before growing");
        }
    }

    pub(crate) fn window_free(&mut self, slot: u32) {
        if let Some(w) = self.window.as_mut() {
            w.free_slot(slot);
        }
    }

    /// Drops the window blocks of `slot` past `num_tokens` (a speculative rollback).
    pub(crate) fn window_truncate(&mut self, slot: u32, num_tokens: usize) {
        if let Some(w) = self.window.as_mut() {
            if let Some(t) = w.tables.get_mut(slot as usize) {
                t.truncate(&mut w.pool, num_tokens);
            }
        }
    }

    /// Offers the window group's live blocks among the full-attention group's newly cached
    /// `items` to the window group's prefix cache.
    pub(crate) fn window_cache(&mut self, items: &[CacheItem]) {
        let Some(w) = self.window.as_mut() else {
            return;
        };
        let mut own: Vec<CacheItem> = items
            .iter()
            .filter_map(|it| {
                let b = *w
                    .tables
                    .get(it.slot as usize)?
                    .blocks()
                    .get(it.idx as usize)?;
                (b != NULL_BLOCK).then_some(CacheItem {
                    block: BlockId(b),
                    ..*it
                })
            })
            .collect();
        if own.is_empty() {
            return;
        }
        let bs = self.cfg.block_size;
        let seqs = &self.seqs;
        w.pool.cache_blocks(&mut own, |it| {
            let i = it.idx as usize * bs;
            &seqs[it.slot as usize].tokens[i..i + bs]
        });
    }

    /// After `update()`: every sequence of the plan frees the window blocks no query at its
    /// committed position (drafts excluded) or later reads.
    pub(crate) fn window_release(&mut self) {
        let Some(w) = self.window.as_mut() else {
            return;
        };
        for &(slot, gen) in &self.rows {
            let seq = &self.seqs[slot as usize];
            if seq.alive && seq.gen == gen && seq.status == Status::Running {
                if let Some(t) = w.tables.get_mut(slot as usize) {
                    t.release_dead(&mut w.pool, seq.num_computed, w.window);
                }
            }
        }
    }

    /// The window group's invariants: each running table against its committed position, cached
    /// blocks hold the sequence's own tokens, reference counts match the tables, others empty.
    pub(crate) fn check_window(&self) -> std::result::Result<(), String> {
        let Some(w) = &self.window else {
            return Ok(());
        };
        w.pool.check()?;
        let bs = self.cfg.block_size;
        let mut refs = vec![0u32; w.pool.num_blocks()];
        for (slot, t) in w.tables.iter().enumerate() {
            let seq = self.seqs.get(slot);
            let running = seq.is_some_and(|s| s.alive && s.status == Status::Running);
            if !running {
                if !t.blocks().is_empty() {
                    return Err(format!("slot {slot} not running holds window blocks"));
                }
                continue;
            }
            let seq = seq.expect("running");
            t.check(seq.num_computed, w.window, bs)
                .map_err(|e| format!("seq {}: {e}", seq.seq_id))?;
            let mut parent = root_hash(seq.extra_key);
            for (i, &b) in t.blocks().iter().enumerate() {
                let full = (i + 1) * bs <= seq.num_computed;
                let toks: Vec<u32> = if full {
                    (i * bs..(i + 1) * bs).map(|j| seq.token(j)).collect()
                } else {
                    Vec::new()
                };
                let h = if full { block_hash(parent, &toks) } else { 0 };
                if b != NULL_BLOCK {
                    refs[b as usize] += 1;
                    if full
                        && w.pool.is_cached(BlockId(b))
                        && w.pool.cache().hash_of(BlockId(b)) != h
                    {
                        return Err(format!(
                            "seq {} maps window block {b} at {i} holding other tokens",
                            seq.seq_id
                        ));
                    }
                }
                parent = h;
            }
        }
        for (b, &r) in refs.iter().enumerate() {
            let got = w.pool.ref_count(BlockId(b as u32));
            if got != r {
                return Err(format!(
                    "window block {b} has ref count {got} but {r} holders"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::sliding_window::{max_live_blocks, NULL_BLOCK};
    use crate::{Config, NewRequest, Scheduler};

    fn sched(num_blocks: usize, window_blocks: usize, budget: usize) -> Scheduler {
        let mut s = Scheduler::new(Config {
            num_blocks,
            block_size: 4,
            max_model_len: 256,
            max_num_batched_tokens: budget,
            watermark: 0.0,
            ..Config::default()
        })
        .unwrap();
        s.enable_window_group(8, window_blocks).unwrap();
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

    /// Runs to completion, checking invariants each step; returns the most window blocks in use.
    fn drain(s: &mut Scheduler) -> usize {
        let mut most = 0;
        let mut step = 0i64;
        while s.has_unfinished() {
            let p = s.schedule().unwrap();
            s.check_invariants().unwrap();
            most = most.max(s.window_group().unwrap().pool.num_used());
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
    fn refuses_what_it_does_not_support() {
        let mut s = Scheduler::new(Config {
            num_swap_blocks: 4,
            ..Config::default()
        })
        .unwrap();
        let e = s.enable_window_group(64, 1024).unwrap_err().to_string();
        assert!(e.contains("swap space"), "{e}");
        let mut s = sched(64, 16, 8);
        assert!(s.resize(32).unwrap_err().to_string().contains("window"));
        let e = NewRequest {
            seq_ids: vec![1, 2],
            ..req(1, vec![1, 2], 2)
        };
        assert!(s
            .add_request(e)
            .unwrap_err()
            .to_string()
            .contains("2 sequences"));
        let mut s = Scheduler::new(Config::default()).unwrap();
        let e = s.enable_window_group(4, 2).unwrap_err().to_string();
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
        assert!(s.window_group().unwrap().pool.num_free() == 16);
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
        let t = s.window_table_of(2).unwrap().to_vec();
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
        let (mut preempted, mut hits) = (0, 0);
        for round in 0..30 {
            let window_blocks = 8 + next(16) as usize;
            let mut s = sched(24 + next(40) as usize, window_blocks, 4 + next(12) as usize);
            let mut id = 0;
            for _ in 0..60 {
                if next(3) == 0 && s.num_unfinished() < 8 {
                    let base = next(3) as i64 * 1000;
                    let len = 1 + next(60) as i64;
                    let prompt = (0..len).map(|t| base + t + 1).collect();
                    s.add_request(req(id, prompt, 1 + next(20) as i64)).unwrap();
                    id += 1;
                }
                if !s.has_unfinished() {
                    continue;
                }
                let p = s.schedule().unwrap();
                s.check_invariants().unwrap();
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
            assert_eq!(s.window_group().unwrap().pool.num_free(), window_blocks);
        }
        assert!(
            preempted > 0 && hits > 0,
            "{preempted} preemptions, {hits} hit tokens"
        );
    }
}
