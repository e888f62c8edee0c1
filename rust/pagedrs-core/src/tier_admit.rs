//! The scheduler's use of the external KV tier, only through its connector (`kv_connector`; the
//! host KV tier): an admission continues its device-pool prefix hit in the tier (those blocks get
//! fresh device blocks and load pairs), and every block the prefix cache newly caches is offered to
//! the tier once (as vLLM's OffloadingConnector stores blocks as they complete).

use crate::block_pool::CacheItem;
use crate::error::{Error, Result};
use crate::plan::PlanOps;
use crate::prefix_cache::{block_hash, root_hash};
use crate::scheduler::Scheduler;

/// The tier's part of one admission: its slots, in chain order, and the blocks looked up.
#[derive(Debug, Default)]
pub(crate) struct TierHit {
    pub slots: Vec<u32>,
    pub queried: usize,
}

impl Scheduler {
    /// Tier slots holding the sequence's full blocks `first..`, following the chain from `parent`
    /// (the device pool's last hit), never the block holding its last token. Empty when there is no
    /// tier, or the sequence has KV-cache groups the tier does not hold.
    pub(crate) fn find_tier_prefix(&mut self, slot: u32, first: usize, parent: u64) -> TierHit {
        let mut hit = TierHit::default();
        if self.tier.num_slots() == 0 || !self.kv.is_empty() || self.tier.is_empty() {
            return hit;
        }
        let bs = self.cfg.block_size;
        let seq = &self.seqs[slot as usize];
        let max_blocks = (seq.num_tokens() - 1) / bs;
        let mut parent = parent;
        for i in first..max_blocks {
            hit.queried += 1;
            let tokens = &seq.tokens[i * bs..(i + 1) * bs];
            let h = block_hash(parent, tokens);
            match self.tier.lookup(h, parent, tokens) {
                Some(s) => hit.slots.push(s),
                None => break,
            }
            parent = h;
        }
        hit
    }

    /// Load pairs for an admitted sequence: its blocks `first..first + hit.slots.len()` (fresh
    /// device blocks) are filled from the tier before the forward.
    pub(crate) fn load_from_tier(
        &mut self,
        slot: u32,
        first: usize,
        hit: &TierHit,
        ops: &mut PlanOps,
    ) {
        let table = &self.seqs[slot as usize].block_table;
        for (i, &s) in hit.slots.iter().enumerate() {
            ops.tier_load
                .extend([i64::from(s), i64::from(table[first + i])]);
        }
        self.tier.on_loaded(hit.queried, hit.slots.len());
    }

    /// Store pairs for blocks the prefix cache just cached, each block the tier does not hold yet.
    pub(crate) fn offer_to_tier(&mut self, items: &[CacheItem]) {
        if self.tier.num_slots() == 0 || !self.kv.is_empty() {
            return;
        }
        let bs = self.cfg.block_size;
        for it in items {
            let i = it.idx as usize * bs;
            let tokens = &self.seqs[it.slot as usize].tokens[i..i + bs];
            // Stores run before the next plan's block moves: a block a resize since the last plan
            // moved is still at its source then.
            let b = i64::from(it.block.0);
            let src = self
                .pending_moves
                .chunks_exact(2)
                .find(|m| m[1] == b)
                .map_or(b, |m| m[0]);
            self.tier
                .on_stored(it.hash, it.parent, it.extra_key, tokens, src);
        }
    }

    /// The scheduler side of an external tier behind the host tier (a disk tier): the live
    /// sequence's full blocks that neither the device pool's prefix cache nor the host tier holds,
    /// as (hash, parent hash, block index) from the first one missing in both, never the block
    /// holding its last token. Empty without a host tier.
    pub fn tier_missing_chain(&self, seq_id: i64) -> Result<Vec<(u64, u64, usize)>> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        let mut out = Vec::new();
        if self.tier.num_slots() == 0 || !self.kv.is_empty() || !self.cfg.enable_prefix_caching {
            return Ok(out);
        }
        let bs = self.cfg.block_size;
        let seq = &self.seqs[r.slot as usize];
        let mut parent = root_hash(seq.extra_key);
        for i in 0..(seq.num_tokens() - 1) / bs {
            let tokens = &seq.tokens[i * bs..(i + 1) * bs];
            let h = block_hash(parent, tokens);
            let held =
                self.pool.lookup(h, parent, tokens).is_some() || self.tier.holds(h, parent, tokens);
            if !(held && out.is_empty()) {
                out.push((h, parent, i));
            }
            parent = h;
        }
        Ok(out)
    }

    /// Puts a block whose bytes the runner read from outside (a disk tier) into the host tier: its
    /// slot, or None when the tier holds it already or has no slot. The runner writes the slot's
    /// bytes before the next plan; a store the next plan carried to that slot is void.
    pub fn tier_insert(&mut self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        if tokens.len() != self.cfg.block_size || block_hash(parent, tokens) != hash {
            return None;
        }
        self.tier.insert_external(hash, parent, tokens)
    }

    /// The record (hash, parent hash, tokens) a host tier slot holds.
    pub fn tier_record(&self, slot: u32) -> Option<(u64, u64, Vec<u32>)> {
        self.tier.record_of(slot)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, NewRequest, Scheduler};

    fn sched(num_blocks: usize, num_tier_blocks: usize) -> Scheduler {
        Scheduler::new(Config {
            num_blocks,
            block_size: 4,
            watermark: 0.0,
            num_tier_blocks,
            ..Config::default()
        })
        .unwrap()
    }

    fn run(s: &mut Scheduler, id: i64, prompt: Vec<i64>) -> crate::StepPlan {
        let req = NewRequest {
            seq_ids: vec![id],
            prompt_token_ids: prompt,
            max_tokens: 1,
            ..Default::default()
        };
        s.add_request(req).unwrap();
        let p = s.schedule().unwrap();
        s.update(p.step_id, &vec![0; p.sampled_seq_ids.len()])
            .unwrap();
        s.check_invariants().unwrap();
        p
    }

    #[test]
    fn a_prefix_evicted_from_the_pool_is_loaded_from_the_tier() {
        let mut s = sched(4, 8);
        let first: Vec<i64> = (1..=9).collect();
        let p = run(&mut s, 1, first.clone());
        assert!(p.tier_store.is_empty()); // stores ride on the plan after the blocks are cached
        assert_eq!(s.stats().num_used_tier_blocks, 2);
        // Another prompt takes the whole pool: the cached blocks are evicted (and stored now).
        let p = run(&mut s, 2, (100..113).collect());
        assert_eq!(p.tier_store.len(), 4);
        assert!(p.tier_load.is_empty());
        assert_eq!(s.pool().cache().len(), 3); // the second prompt's full blocks only
                                               // The first prompt returns, longer: its two full blocks come back from the tier.
        let mut back = first.clone();
        back.extend([10, 11, 12]);
        let p = run(&mut s, 3, back.clone());
        assert_eq!(p.tier_load.len(), 4);
        assert_eq!(p.num_computed_tokens, vec![8]);
        assert_eq!(p.input_ids, back[8..].to_vec());
        let st = s.stats();
        // The second prompt's first block was looked up too (a miss).
        assert_eq!((st.tier.queried_blocks, st.tier.hit_blocks), (1 + 2, 2));
        assert_eq!(st.tier.loaded_blocks, 2);
        // 2 + 3 blocks before; the loaded blocks, cached again, are not stored twice: one new one.
        assert_eq!(st.tier.stored_blocks, 2 + 3 + 1);
    }

    #[test]
    fn blocks_read_from_outside_are_inserted_and_found_at_admission() {
        let mut s = sched(8, 8);
        let prompt: Vec<i64> = (1..=13).collect();
        let req = NewRequest {
            seq_ids: vec![7],
            prompt_token_ids: prompt.clone(),
            max_tokens: 1,
            ..Default::default()
        };
        s.add_request(req).unwrap();
        let chain = s.tier_missing_chain(7).unwrap();
        assert_eq!(chain.iter().map(|c| c.2).collect::<Vec<_>>(), vec![0, 1, 2]);
        let toks = |i: usize| -> Vec<u32> { (i * 4 + 1..=i * 4 + 4).map(|t| t as u32).collect() };
        assert_eq!(s.tier_insert(chain[0].0, chain[0].1, &toks(1)), None); // not its hash
        for &(h, p, i) in &chain[..2] {
            let slot = s.tier_insert(h, p, &toks(i)).unwrap();
            assert_eq!(s.tier_record(slot), Some((h, p, toks(i))));
        }
        // The first two blocks are held now: the chain starts at the third.
        assert_eq!(s.tier_missing_chain(7).unwrap()[0].2, 2);
        let p = s.schedule().unwrap();
        assert_eq!(p.tier_load.len(), 4);
        assert_eq!(p.num_computed_tokens, vec![8]);
        assert_eq!(s.stats().tier.stored_blocks, 0);
    }

    #[test]
    fn without_a_tier_or_prefix_caching_nothing_moves() {
        let mut s = sched(4, 0);
        run(&mut s, 1, (1..=9).collect());
        let p = run(&mut s, 2, (100..113).collect());
        assert!(p.tier_store.is_empty());
        let p = run(&mut s, 3, (1..=12).collect());
        assert!(p.tier_load.is_empty());
        assert_eq!(p.num_computed_tokens, vec![0]);
    }

    #[test]
    fn a_full_tier_drops_its_least_recently_used_block() {
        let mut s = sched(8, 2);
        run(&mut s, 1, (1..=9).collect()); // blocks [1..4], [5..8]
        run(&mut s, 2, (100..109).collect()); // two more: the first prompt's blocks make room
        let st = s.stats();
        assert_eq!((st.num_used_tier_blocks, st.tier.evicted_blocks), (2, 2));
        s.reset_prefix_cache();
        assert_eq!(s.stats().num_used_tier_blocks, 0);
    }
}
