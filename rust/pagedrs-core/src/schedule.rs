//! The per-step decisions: one token budget over running, then swapped, then waiting sequences;
//! block allocation with copy-on-write, preemption by recompute or swap, the watermark.

use crate::error::{Error, Result};
use crate::plan::{PlanOps, StepPlan};
use crate::prefix_cache::{block_hash, root_hash};
use crate::request::{FinishReason, Finished, Status};
use crate::scheduler::Scheduler;
use crate::BlockId;

/// Outcome of trying to admit the first waiting (or swapped) sequence.
enum Admit {
    Yes,
    No,
    /// The pool can never hold it: finished with "length", try the next one.
    Dropped,
}

impl Scheduler {
    /// Decides this step and returns its plan. `update()` must follow before the next call
    /// (unless the plan has no logits rows).
    pub fn schedule(&mut self) -> Result<StepPlan> {
        if let Some(step) = self.pending {
            return Err(Error::PlanPending { step });
        }
        let mut ops = PlanOps::default();
        let mut sched = std::mem::take(&mut self.sched);
        sched.clear();
        let mut budget = self.cfg.max_num_batched_tokens;
        self.encoder.start_step();

        self.schedule_running(&mut sched, &mut budget, &mut ops);
        if ops.preempted.is_empty() {
            while budget > 0 {
                let Some(&(_, slot)) = self.swapped.first() else {
                    break;
                };
                match self.try_swap_in(slot, &mut sched, &mut budget, &mut ops) {
                    Admit::Yes => {}
                    Admit::No => break,
                    Admit::Dropped => continue,
                }
            }
            if self.swapped.is_empty() {
                while budget > 0 {
                    let Some(&(_, slot)) = self.waiting.first() else {
                        break;
                    };
                    match self.try_admit(slot, &mut sched, &mut budget, &mut ops) {
                        Admit::Yes => {}
                        Admit::No => break,
                        Admit::Dropped => continue,
                    }
                }
            }
        }
        // Copy-on-write sources were kept referenced while deciding, so none of them could be
        // reused as a destination in the same step.
        for i in (0..ops.copies.len()).step_by(2) {
            self.pool.free(BlockId(ops.copies[i] as u32));
        }
        let plan = self.build_plan(&sched, ops);
        self.sched = sched;
        self.spec_governor.tick(); // after this step's spec_active()
        Ok(plan)
    }

    fn schedule_running(
        &mut self,
        sched: &mut Vec<(u32, usize)>,
        budget: &mut usize,
        ops: &mut PlanOps,
    ) {
        let bs = self.cfg.block_size;
        let capacity = self.pool.num_blocks() * bs;
        let spec = self.spec_active();
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let slot = self.running[i];
            let seq = &self.seqs[slot as usize];
            let nc = seq.num_computed;
            let remaining = seq.num_tokens() - nc;
            debug_assert!(
                remaining > 0,
                "running seq {} has nothing to compute",
                seq.seq_id
            );
            if remaining > *budget
                && !self.cfg.enable_chunked_prefill
                && remaining <= self.cfg.max_num_batched_tokens
            {
                i += 1;
                continue;
            }
            if seq.num_tokens() > capacity {
                self.running.remove(i);
                self.num_running_seqs -= self.seqs[slot as usize].width();
                self.finish_unfittable(slot);
                continue;
            }
            let mut num_new = self.cut_chunk(seq.seq_id, nc, remaining.min(*budget));
            if num_new == 0 {
                i += 1; // its next chunk takes a span whole: a later step with more budget
                continue;
            }
            if spec && remaining == 1 && *budget > 1 {
                num_new += self.propose(slot, *budget - 1);
            }
            let scheduled = loop {
                let (new, cow) = self.blocks_needed(slot, num_new, ops);
                if new + usize::from(cow) <= self.pool.num_free()
                    && self.kv.fits(slot, &self.seqs[slot as usize], nc + num_new)
                {
                    self.kv.grow(slot, &self.seqs[slot as usize], nc + num_new);
                    self.allocate(slot, num_new, cow, ops);
                    break true;
                }
                if num_new > remaining {
                    // Drafts never preempt anyone: drop them first.
                    self.seqs[slot as usize].drafts.clear();
                    num_new = remaining;
                    continue;
                }
                let victim = self.preempt_last(ops);
                if victim == slot {
                    break false;
                }
            };
            if scheduled {
                self.encoder
                    .charge(self.seqs[slot as usize].seq_id, nc, num_new);
                sched.push((slot, num_new));
                *budget -= num_new;
                i += 1;
            }
        }
    }

    /// New blocks `slot` needs to compute `num_new` more tokens, and whether the block it writes
    /// first is shared (copy-on-write).
    fn blocks_needed(&self, slot: u32, num_new: usize, ops: &PlanOps) -> (usize, bool) {
        let bs = self.cfg.block_size;
        let seq = &self.seqs[slot as usize];
        let nc = seq.num_computed;
        let total = (nc + num_new).div_ceil(bs);
        let new = total.saturating_sub(seq.block_table.len());
        let idx = nc / bs;
        let cow = seq.shared_tail && nc % bs != 0 && idx < seq.block_table.len() && {
            let b = seq.block_table[idx];
            // Copies decided this step still hold their source; do not count those references.
            let deferred = ops
                .copies
                .chunks_exact(2)
                .filter(|c| c[0] == i64::from(b))
                .count();
            self.pool.ref_count(BlockId(b)) as usize - deferred > 1
        };
        (new, cow)
    }

    fn allocate(&mut self, slot: u32, num_new: usize, cow: bool, ops: &mut PlanOps) {
        let bs = self.cfg.block_size;
        let (new, _) = self.blocks_needed(slot, num_new, ops);
        let seq = &mut self.seqs[slot as usize];
        let row = seq.row.expect("a running sequence has a block-table row");
        // After this step the block written next is private: copied now, or never shared again.
        seq.shared_tail = false;
        if cow {
            let idx = seq.num_computed / bs;
            let src = seq.block_table[idx];
            let dst = self.pool.allocate().expect("checked free blocks");
            seq.block_table[idx] = dst.0;
            ops.copies.extend([i64::from(src), i64::from(dst.0)]);
            self.tables.mark(row, idx);
        }
        if new > 0 {
            self.tables.mark(row, seq.block_table.len());
        }
        for _ in 0..new {
            let b = self.pool.allocate().expect("checked free blocks");
            seq.block_table.push(b.0);
        }
        if cow || new > 0 {
            seq.sync_last_block();
        }
    }

    /// Preempts the last running sequence (lowest priority, latest arrival): swap it out when the
    /// swap pool can take all its blocks, else free them for recompute. Returns its slot.
    fn preempt_last(&mut self, ops: &mut PlanOps) -> u32 {
        let slot = self.running.pop().expect("a running sequence to preempt");
        let seq = &mut self.seqs[slot as usize];
        self.num_running_seqs -= seq.width();
        if let Some(row) = seq.row.take() {
            self.tables.release(row);
        }
        let n = seq.block_table.len();
        let swap = self.swap.num_blocks() > 0 && n > 0 && self.swap.num_free() >= n;
        if swap && self.kv.can_swap_out(slot) {
            self.kv.swap_out(slot, &mut ops.group_swap_out);
            for &b in &seq.block_table {
                let s = self.swap.allocate().expect("checked free swap blocks");
                seq.swap_table.push(s);
                ops.swap_out.extend([i64::from(b), i64::from(s)]);
            }
            self.pool.free_table(&seq.block_table);
            seq.block_table.clear();
            seq.status = Status::Swapped;
            self.swapped.insert((seq.key, slot));
        } else {
            self.kv.free(slot);
            self.pool.free_table(&seq.block_table);
            seq.block_table.clear();
            seq.num_computed = 0;
            self.encoder.restart(seq.seq_id);
            seq.num_cached_blocks = 0;
            seq.status = Status::Waiting;
            self.waiting.insert((seq.key, slot));
        }
        seq.shared_tail = false;
        seq.last_block = 0;
        seq.drafts.clear();
        ops.preempted.push(seq.seq_id);
        self.num_preemptions += 1;
        slot
    }

    /// Ends a sequence the pool can never hold (after a shrink, or grown past the whole pool).
    fn finish_unfittable(&mut self, slot: u32) {
        let seq = &mut self.seqs[slot as usize];
        let mut ids: Vec<i64> = seq.children.drain(..).map(|(id, _)| id).collect();
        ids.insert(0, seq.seq_id);
        for &id in &ids[1..] {
            self.ids.remove(&id);
        }
        for id in ids {
            self.pending_finished.push(Finished {
                seq_id: id,
                reason: FinishReason::Length,
                stop_token: None,
            });
        }
        self.release_slot(slot);
    }

    /// How many tokens a sequence about to (re)start may schedule, None if it must wait.
    /// The chunk never ends inside one of the sequence's atomic spans.
    fn chunk(&self, seq_id: i64, nc: usize, remaining: usize, budget: usize) -> Option<usize> {
        let n = if remaining <= budget {
            remaining
        } else if self.cfg.enable_chunked_prefill || remaining > self.cfg.max_num_batched_tokens {
            budget
        } else {
            return None;
        };
        Some(self.cut_chunk(seq_id, nc, n)).filter(|&n| n > 0)
    }

    fn try_swap_in(
        &mut self,
        slot: u32,
        sched: &mut Vec<(u32, usize)>,
        budget: &mut usize,
        ops: &mut PlanOps,
    ) -> Admit {
        let bs = self.cfg.block_size;
        let capacity = self.pool.num_blocks() * bs;
        let seq = &self.seqs[slot as usize];
        if self.num_running_seqs + seq.width() > self.cfg.max_num_seqs {
            return Admit::No;
        }
        let nc = seq.num_computed;
        if seq.num_tokens() > capacity {
            self.swapped.pop_first();
            self.finish_unfittable(slot);
            return Admit::Dropped;
        }
        let Some(num_new) = self.chunk(seq.seq_id, nc, seq.num_tokens() - nc, *budget) else {
            return Admit::No;
        };
        let total = (nc + num_new).div_ceil(bs).max(seq.swap_table.len());
        if self.pool.num_free() < total + self.admission_watermark()
            || !self.kv.fits_swap_in(slot, nc + num_new)
        {
            return Admit::No;
        }
        self.swapped.pop_first();
        self.kv.swap_in(slot, nc + num_new, &mut ops.group_swap_in);
        let seq = &mut self.seqs[slot as usize];
        for &s in &seq.swap_table {
            let d = self.pool.allocate().expect("checked free blocks");
            seq.block_table.push(d.0);
            ops.swap_in.extend([i64::from(s), i64::from(d.0)]);
            self.swap.free(s);
        }
        seq.swap_table.clear();
        while seq.block_table.len() < total {
            seq.block_table
                .push(self.pool.allocate().expect("checked free blocks").0);
        }
        seq.sync_last_block();
        seq.status = Status::Running;
        self.num_running_seqs += seq.width();
        self.insert_running(slot);
        self.encoder
            .charge(self.seqs[slot as usize].seq_id, nc, num_new);
        sched.push((slot, num_new));
        *budget -= num_new;
        Admit::Yes
    }

    fn admission_watermark(&self) -> usize {
        // With nothing running, admit anything that fits: the watermark must not starve the queue.
        if self.num_running_seqs > 0 {
            self.watermark_blocks
        } else {
            0
        }
    }

    fn try_admit(
        &mut self,
        slot: u32,
        sched: &mut Vec<(u32, usize)>,
        budget: &mut usize,
        ops: &mut PlanOps,
    ) -> Admit {
        let bs = self.cfg.block_size;
        let capacity = self.pool.num_blocks() * bs;
        let seq = &self.seqs[slot as usize];
        if self.num_running_seqs + seq.width() > self.cfg.max_num_seqs {
            return Admit::No;
        }
        if seq.num_tokens() > capacity {
            self.waiting.pop_first();
            self.finish_unfittable(slot);
            return Admit::Dropped;
        }
        let lookup = self.cfg.enable_prefix_caching && !seq.skip_prefix_cache;
        self.seqs[slot as usize].flush();
        let mut hits = std::mem::take(&mut self.hit_scratch);
        hits.clear();
        let mut last_hash = if lookup {
            self.find_cached_prefix(slot, &mut hits)
        } else {
            0
        };
        let mut group_hits = Vec::new();
        if lookup && !self.kv.is_empty() {
            (group_hits, last_hash) = self.groups_cap_hit(slot, &mut hits);
        }
        let tier = if lookup {
            self.find_tier_prefix(slot, hits.len(), last_hash)
        } else {
            Default::default()
        };
        let seq = &self.seqs[slot as usize];
        let nc = (hits.len() + tier.slots.len()) * bs;
        let Some(num_new) = self.chunk(seq.seq_id, nc, seq.num_tokens() - nc, *budget) else {
            self.hit_scratch = hits;
            return Admit::No;
        };
        let new_blocks = (nc + num_new).div_ceil(bs) - hits.len();
        let evictable = hits
            .iter()
            .filter(|&&b| self.pool.ref_count(BlockId(b)) == 0)
            .count();
        if self.pool.num_free() < new_blocks + evictable + self.admission_watermark()
            || !self.kv.fits_admit(&group_hits, nc + num_new)
        {
            self.hit_scratch = hits;
            return Admit::No;
        }
        self.waiting.pop_first();
        if lookup {
            self.prefix_queries += seq.num_tokens() as u64;
            self.prefix_hits += (hits.len() * bs) as u64;
        }
        let seq = &mut self.seqs[slot as usize];
        for &b in &hits {
            self.pool.incref(BlockId(b));
            seq.block_table.push(b);
        }
        for _ in 0..new_blocks {
            seq.block_table
                .push(self.pool.allocate().expect("checked free blocks").0);
        }
        seq.sync_last_block();
        seq.num_computed = nc;
        // Blocks loaded from the tier are cached by the next update(), as computed ones.
        seq.num_cached_blocks = hits.len();
        self.load_from_tier(slot, hits.len(), &tier, ops);
        self.kv.admit(slot, group_hits, nc + num_new);
        let seq = &mut self.seqs[slot as usize];
        seq.last_hash = last_hash;
        if !seq.admitted {
            seq.admitted = true;
            seq.num_cached_tokens = nc;
        }
        seq.status = Status::Running;
        self.num_running_seqs += seq.width();
        self.insert_running(slot);
        self.encoder
            .charge(self.seqs[slot as usize].seq_id, nc, num_new);
        sched.push((slot, num_new));
        *budget -= num_new;
        self.hit_scratch = hits;
        Admit::Yes
    }

    /// Cached blocks matching the sequence's leading full blocks, never the block holding its
    /// last token (that token must be computed to yield logits). Returns the last hit's hash.
    fn find_cached_prefix(&self, slot: u32, hits: &mut Vec<u32>) -> u64 {
        let bs = self.cfg.block_size;
        let seq = &self.seqs[slot as usize];
        let max_blocks = (seq.num_tokens() - 1) / bs;
        let mut parent = root_hash(seq.extra_key);
        for i in 0..max_blocks {
            let tokens = &seq.tokens[i * bs..(i + 1) * bs];
            let h = block_hash(parent, tokens);
            match self.pool.lookup(h, parent, tokens) {
                Some(b) => hits.push(b.0),
                None => break,
            }
            parent = h;
        }
        parent
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, FinishReason, NewRequest, Scheduler};

    fn sched(num_blocks: usize, block_size: usize) -> Scheduler {
        Scheduler::new(Config {
            num_blocks,
            block_size,
            watermark: 0.0,
            ..Config::default()
        })
        .unwrap()
    }

    fn req(ids: &[i64], prompt: &[i64], max_tokens: i64) -> NewRequest {
        NewRequest {
            seq_ids: ids.to_vec(),
            prompt_token_ids: prompt.to_vec(),
            max_tokens,
            ..Default::default()
        }
    }

    #[test]
    fn prefill_then_decode_then_length() {
        let mut s = sched(8, 4);
        s.add_request(req(&[7], &[1, 2, 3, 4, 5], 2)).unwrap();
        let p = s.schedule().unwrap();
        assert_eq!(p.req_ids, vec![7]);
        assert_eq!(p.input_ids, vec![1, 2, 3, 4, 5]);
        assert_eq!(p.positions, vec![0, 1, 2, 3, 4]);
        assert_eq!(p.query_start_loc, vec![0, 5]);
        assert_eq!(p.logits_indices, vec![4]);
        assert_eq!(p.max_blocks, 2);
        let b = s.plan_block_tables(&p).unwrap();
        assert_eq!(p.slot_mapping[4], i64::from(b[1]) * 4);
        assert_eq!((p.num_prefill_tokens, p.num_decode_tokens), (5, 0));
        assert!(s.update(p.step_id, &[9]).unwrap().is_empty());
        s.check_invariants().unwrap();
        let p = s.schedule().unwrap();
        assert_eq!(p.input_ids, vec![9]);
        assert_eq!(p.positions, vec![5]);
        assert_eq!(p.seq_lens, vec![6]);
        assert_eq!((p.num_prefill_tokens, p.num_decode_tokens), (0, 1));
        let f = s.update(p.step_id, &[10]).unwrap();
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].seq_id, f[0].reason), (7, FinishReason::Length));
        assert!(!s.has_unfinished());
        assert_eq!(s.pool().num_free(), 8);
        s.check_invariants().unwrap();
    }

    #[test]
    fn schedule_twice_without_update_fails() {
        let mut s = sched(8, 4);
        s.add_request(req(&[1], &[1, 2], 3)).unwrap();
        let p = s.schedule().unwrap();
        assert!(s.schedule().is_err());
        assert!(s.update(p.step_id + 1, &[1]).is_err());
        assert!(s.update(p.step_id, &[1, 2]).is_err());
        s.update(p.step_id, &[1]).unwrap();
        let p = s.schedule().unwrap();
        assert_eq!(p.num_tokens, 1);
    }
}
