//! The scheduler's side of its KV-cache groups ([`crate::kv_groups`]): adding a group, the prefix
//! hit over every group, the release after `update()`, and per-group queries.

use crate::error::{Error, Result};
use crate::kv_groups::{GroupStats, KvGroup};
use crate::paged_group::PagedGroup;
use crate::prefix_cache::{block_hash, root_hash};
use crate::recurrent_group::RecurrentGroup;
use crate::request::Status;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Adds a KV-cache group beside the primary pool; its index is its place in the plan's group
    /// arrays. Only before any request.
    pub fn add_kv_group(&mut self, mut group: Box<dyn KvGroup>) -> Result<usize> {
        if !self.ids.is_empty() {
            return Err(Error::InvalidRequest(
                "a KV-cache group is added before any request".into(),
            ));
        }
        if let Some(p) = group.pool_mut() {
            p.set_kv_events(self.pool.kv_events_enabled());
        }
        self.kv.push(group);
        Ok(self.kv.len() - 1)
    }

    /// Adds the group of the layers attending to the last `window` tokens, with its own pool of
    /// `num_blocks` blocks, which must hold one sequence's live blocks at the largest step, and a
    /// swap pool of its own as large as the primary one (its layers' part of the swap space).
    pub fn add_window_group(&mut self, window: usize, num_blocks: usize) -> Result<usize> {
        let step = self.cfg.max_num_batched_tokens + self.cfg.num_speculative_tokens;
        let g = PagedGroup::sliding_window(
            window,
            num_blocks,
            self.cfg.block_size,
            self.cfg.max_model_len,
            step,
        )?
        .with_swap(self.cfg.num_swap_blocks);
        self.add_kv_group(Box::new(g))
    }

    /// Adds the recurrent-state group of the linear-attention layers, with `num_slots` live state
    /// slots (at least `max_num_seqs`: every running sequence holds one, a forked child included)
    /// and `num_snapshots` snapshot slots for prefix caching (0: none).
    pub fn add_recurrent_group(&mut self, num_slots: usize, num_snapshots: usize) -> Result<usize> {
        if num_slots < self.cfg.max_num_seqs {
            return Err(Error::InvalidRequest(format!(
                "{num_slots} recurrent state slots cannot hold max_num_seqs={} sequences",
                self.cfg.max_num_seqs
            )));
        }
        if self.cfg.num_speculative_tokens > 0 {
            return Err(Error::InvalidRequest(
                "speculative decoding is not supported with recurrent state (a rejected draft \
                 cannot be taken back out of the state)"
                    .into(),
            ));
        }
        self.add_kv_group(Box::new(RecurrentGroup::new(
            num_slots,
            num_snapshots,
            self.cfg.block_size,
        )))
    }

    /// Every group's pool usage, in group order.
    pub fn kv_group_stats(&self) -> Vec<GroupStats> {
        self.kv.stats()
    }

    pub fn kv_groups(&self) -> &crate::kv_groups::KvGroups {
        &self.kv
    }

    /// Group `group`'s entries for a live seq id (empty for a child not yet forked).
    pub fn group_blocks_of(&self, group: usize, seq_id: i64) -> Result<Vec<u32>> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        let g = self.kv.get(group).ok_or_else(|| {
            Error::InvalidRequest(format!("no KV-cache group {group} of {}", self.kv.len()))
        })?;
        Ok(if r.child {
            Vec::new()
        } else {
            g.blocks_of(r.slot)
        })
    }

    /// Caps the primary pool's prefix hit `hits` of `slot` to what every group can serve; returns
    /// each group's table for it and the hash of the last hit block.
    pub(crate) fn groups_cap_hit(&self, slot: u32, hits: &mut Vec<u32>) -> (Vec<Vec<u32>>, u64) {
        let bs = self.cfg.block_size;
        let seq = &self.seqs[slot as usize];
        let mut chain = Vec::with_capacity(hits.len() + 1);
        chain.push(root_hash(seq.extra_key));
        for i in 0..hits.len() {
            chain.push(block_hash(chain[i], &seq.tokens[i * bs..(i + 1) * bs]));
        }
        let (n, tables) = self.kv.cap_hit(hits.len(), &chain, &seq.tokens);
        hits.truncate(n);
        (tables, chain[n])
    }

    /// After `update()`: every running sequence of the plan is committed at its position (drafts
    /// excluded), so the groups release what no later query reads.
    pub(crate) fn groups_release(&mut self) {
        if self.kv.is_empty() {
            return;
        }
        for &(slot, gen) in &self.rows {
            let seq = &self.seqs[slot as usize];
            if seq.alive && seq.gen == gen && seq.status == Status::Running {
                self.kv.release(slot, seq.num_computed);
            }
        }
    }
}

#[cfg(test)]
mod tests;
