//! The scheduler's read-only queries (per sequence and over the pool), its stats, and the switch of
//! its prefix-cache event log (`kv_events`).

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::kv_events::KvEvents;
use crate::request::{SeqKey, Status};
use crate::scheduler::{Scheduler, Stats};

impl Scheduler {
    pub fn has_unfinished(&self) -> bool {
        !self.ids.is_empty() || !self.pending_finished.is_empty()
    }

    /// Seq ids not finished (or finished but not yet reported by `update()`).
    pub fn num_unfinished(&self) -> usize {
        self.ids.len() + self.pending_finished.len()
    }

    /// Prefix-cache hit tokens at the first admission of `seq_id`'s request.
    pub fn num_cached_tokens(&self, seq_id: i64) -> Result<usize> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        Ok(self.seqs[r.slot as usize].num_cached_tokens)
    }

    /// Status of a live seq id (children not yet forked report their parent's).
    pub fn status(&self, seq_id: i64) -> Result<Status> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        Ok(self.seqs[r.slot as usize].status)
    }

    /// Token ids (prompt + output, the newest output tokens included) of a live seq id; a child
    /// not yet forked has its parent's prompt and no output.
    pub fn token_ids(&self, seq_id: i64) -> Result<Vec<u32>> {
        self.tokens_from(seq_id, 0)
    }

    /// Output token ids of a live seq id: the one copy the engine keeps (penalties, min_tokens and
    /// the batch picture read it from here).
    pub fn output_token_ids(&self, seq_id: i64) -> Result<Vec<u32>> {
        self.tokens_from(seq_id, usize::MAX)
    }

    /// `output_token_ids(seq_id).len()` without the copy.
    pub fn num_output_tokens(&self, seq_id: i64) -> Result<usize> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        Ok(if r.child {
            0
        } else {
            self.seqs[r.slot as usize].num_output()
        })
    }

    /// Tokens of a live seq id from position `start` (`usize::MAX`: from the end of the prompt).
    fn tokens_from(&self, seq_id: i64, start: usize) -> Result<Vec<u32>> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        let seq = &self.seqs[r.slot as usize];
        let start = start.min(seq.prompt_len);
        let end = if r.child {
            seq.prompt_len
        } else {
            seq.num_tokens()
        };
        Ok((start..end).map(|i| seq.token(i)).collect())
    }

    /// Device blocks of a live seq id (empty for a child not yet forked).
    pub fn block_table_of(&self, seq_id: i64) -> Result<&[u32]> {
        let r = self
            .ids
            .get(&seq_id)
            .ok_or(Error::UnknownSeqId { seq_id })?;
        Ok(if r.child {
            &[]
        } else {
            &self.seqs[r.slot as usize].block_table
        })
    }

    /// Drops every prefix-cache entry; false (nothing done) while blocks are in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.kv.is_idle() || !self.pool.reset_prefix_cache() {
            return false;
        }
        self.tier.on_cleared();
        self.kv.reset_prefix_cache()
    }

    pub fn stats(&self) -> Stats {
        let group_usage: Vec<f64> = self.kv.stats().iter().map(|g| g.kv_usage).collect();
        let width = |set: &BTreeSet<(SeqKey, u32)>| -> usize {
            set.iter()
                .map(|&(_, s)| self.seqs[s as usize].width())
                .sum()
        };
        Stats {
            num_running: self.num_running_seqs,
            num_waiting: width(&self.waiting),
            num_swapped: width(&self.swapped),
            num_blocks: self.pool.num_blocks(),
            num_free_blocks: self.pool.num_free(),
            kv_usage: group_usage.iter().fold(self.pool.usage(), |a, &b| a.max(b)),
            group_kv_usage: group_usage,
            num_swap_blocks: self.swap.num_blocks(),
            num_free_swap_blocks: self.swap.num_free(),
            prefix_cache_queries: self.prefix_queries,
            prefix_cache_hits: self.prefix_hits,
            num_preemptions: self.num_preemptions,
            num_tier_blocks: self.tier.num_slots(),
            num_used_tier_blocks: self.tier.len(),
            tier: *self.tier.counters(),
            spec_num_drafts: self.spec_counts[0],
            spec_num_draft_tokens: self.spec_counts[1],
            spec_num_accepted_tokens: self.spec_counts[2],
            spec_num_pauses: self.spec_governor.num_pauses(),
        }
    }

    /// Starts or stops recording prefix-cache events (off by default).
    pub fn set_kv_events(&mut self, on: bool) {
        self.pool.set_kv_events(on);
        self.kv.set_kv_events(on);
        self.tier.set_kv_events(on);
    }

    pub fn kv_events_enabled(&self) -> bool {
        self.pool.kv_events_enabled()
    }

    /// The prefix-cache events since the last call, in order; the engine drains them once per step.
    pub fn take_kv_events(&mut self) -> KvEvents {
        self.pool.take_kv_events()
    }

    /// Each KV-cache group's prefix-cache events since the last call, in group order.
    /// The host KV tier's events since the last call: blocks stored into it, evicted from it (as
    /// vLLM's CPU offloading tier's, medium "CPU"); empty without a tier or with events off.
    pub fn take_tier_kv_events(&mut self) -> KvEvents {
        self.tier.take_kv_events()
    }

    pub fn take_group_kv_events(&mut self) -> Vec<KvEvents> {
        self.kv.take_kv_events()
    }
}
