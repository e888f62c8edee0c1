//! The step plan: flat arrays the runner turns into tensors, built once per step.

use crate::error::{Error, Result};
use crate::scheduler::Scheduler;

/// Block operations and preemptions decided during one step. Pairs are flattened `[a0, b0, a1, ..]`.
#[derive(Debug, Default, Clone)]
pub struct PlanOps {
    pub swap_out: Vec<i64>,
    pub swap_in: Vec<i64>,
    pub copies: Vec<i64>,
    pub preempted: Vec<i64>,
    /// `(group, device, swap)` and `(group, swap, device)` triples of the KV-cache groups.
    pub group_swap_out: Vec<i64>,
    pub group_swap_in: Vec<i64>,
    pub tier_load: Vec<i64>,
}

/// One step. Row `b` of the batch is sequence `req_ids[b]`; tokens are flattened over rows.
/// Runner order: grow the pools, `tier_store`, `block_moves` (and `group_block_moves`),
/// `swap_out`, `swap_in`, `tier_load`, `copies`, forward, shrink.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StepPlan {
    pub step_id: u64,
    pub req_ids: Vec<i64>,
    pub num_scheduled_tokens: Vec<i32>,
    pub num_computed_tokens: Vec<i32>,
    pub num_prompt_tokens: Vec<i32>,
    pub seq_lens: Vec<i32>,
    /// `B + 1` entries.
    pub query_start_loc: Vec<i32>,
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub slot_mapping: Vec<i64>,
    /// Row of the persistent block table ([`Scheduler::block_table`]) of each batch entry.
    pub block_table_rows: Vec<i32>,
    /// Rows of the persistent block table written by this plan's `schedule()` (each once): a
    /// device copy of the table that applies these stays equal to it.
    pub changed_rows: Vec<i32>,
    /// Longest block table in the batch (the width of [`Scheduler::plan_block_tables`]).
    pub max_blocks: usize,
    /// Hidden rows whose logits are wanted: one per sampled sequence, `1 + d` consecutive rows for
    /// one that speculates with `d` drafts (row `j` predicts the token after draft `j`).
    pub logits_indices: Vec<i64>,
    pub sampled_seq_ids: Vec<i64>,
    /// Per sampled sequence: its draft tokens in this step (0: not speculating).
    pub num_draft_tokens: Vec<i32>,
    /// The draft tokens, flattened in `sampled_seq_ids` order (placeholders, the sequence's last
    /// token, when the runner's drafter proposes).
    pub draft_token_ids: Vec<i64>,
    /// `[k, 2]` pairs, flattened: (device, swap), (swap, device), (src, dst), (src, dst).
    pub swap_out: Vec<i64>,
    pub swap_in: Vec<i64>,
    pub copies: Vec<i64>,
    pub block_moves: Vec<i64>,
    pub preempted: Vec<i64>,
    /// Host KV tier pairs (`kv_tier`): (device block, tier slot) full blocks to copy out before
    /// anything else writes the pool, and (tier slot, device block) blocks to copy in.
    pub tier_store: Vec<i64>,
    pub tier_load: Vec<i64>,
    /// Every KV-cache group's slot mapping, `[G, T]` flattened (group order: `Scheduler::kv_groups`).
    pub group_slot_mapping: Vec<i64>,
    /// Every KV-cache group's block tables, `[G, B, max_blocks]` flattened, padded with 0 (as are
    /// entries a group no longer holds: the kernels mask them).
    pub group_block_tables: Vec<i32>,
    /// Copy-on-write pairs (src, dst) to apply to each group's blocks before the forward, flattened
    /// over groups in order; group `g` has `group_num_copies[g]` pairs.
    pub group_copies: Vec<i64>,
    /// `[G]`: copy-on-write pairs of each group (its length is the number of groups).
    pub group_num_copies: Vec<i32>,
    /// `[k, 3]` triples, flattened: (group, device block, swap block) to copy to the host before
    /// the forward, after `swap_out`, and (group, swap block, device block) back, after `swap_in`.
    pub group_swap_out: Vec<i64>,
    pub group_swap_in: Vec<i64>,
    /// `[k, 3]` triples, flattened: (group, src, dst) moves of a group's blocks by a pool resize,
    /// applied as `block_moves` are, on the group's layers.
    pub group_block_moves: Vec<i64>,
    /// `[G]`: each group's pool size after this plan (0 for a group without a pool).
    pub group_num_blocks: Vec<i64>,
    /// Pool size after this plan.
    pub num_blocks: usize,
    pub num_prefill_tokens: usize,
    pub num_decode_tokens: usize,
    pub num_tokens: usize,
}

impl StepPlan {
    pub fn num_reqs(&self) -> usize {
        self.req_ids.len()
    }

    /// KV-cache groups whose tables this plan carries.
    pub fn num_groups(&self) -> usize {
        self.group_num_copies.len()
    }
}

impl Scheduler {
    /// The persistent block table. Only `schedule()` writes it: a plan's rows hold its batch's
    /// blocks until the next `schedule()`.
    pub fn block_table(&self) -> &crate::BlockTable {
        &self.tables
    }

    /// Plan `step_id`'s padded `[B, max_blocks]` block tables (row `b`: the blocks of batch entry
    /// `b`, then zeros), gathered from the persistent rows `rows`; an error once a later
    /// `schedule()` may have rewritten them.
    pub fn padded_block_tables(
        &self,
        step_id: u64,
        rows: &[i32],
        max_blocks: usize,
    ) -> Result<Vec<i32>> {
        if step_id + 1 != self.step {
            return Err(Error::StalePlan {
                step: step_id,
                latest: self.step.saturating_sub(1),
            });
        }
        let (num_rows, width) = (self.tables.num_rows(), self.tables.width());
        if max_blocks > width {
            return Err(Error::InvalidRequest(format!(
                "max_blocks {max_blocks} exceeds the block-table width {width}"
            )));
        }
        let mut out = Vec::with_capacity(rows.len() * max_blocks);
        for &r in rows {
            if r < 0 || r as usize >= num_rows {
                return Err(Error::InvalidRequest(format!(
                    "block-table row {r} is out of range [0, {num_rows})"
                )));
            }
            out.extend_from_slice(&self.tables.row(r as u32)[..max_blocks]);
        }
        Ok(out)
    }

    /// [`Self::padded_block_tables`] of plan `p`.
    pub fn plan_block_tables(&self, p: &StepPlan) -> Result<Vec<i32>> {
        self.padded_block_tables(p.step_id, &p.block_table_rows, p.max_blocks)
    }

    /// Turns the step's decisions into arrays, advances `num_computed`, forks children whose
    /// parent finishes its prompt, and records what `update()` must expect.
    pub(crate) fn build_plan(&mut self, sched: &[(u32, usize)], ops: PlanOps) -> StepPlan {
        let bs = self.cfg.block_size;
        let shift = bs.trailing_zeros();
        let b = sched.len();
        let t: usize = sched.iter().map(|&(_, n)| n).sum();
        let max_blocks = sched
            .iter()
            .map(|&(s, _)| self.seqs[s as usize].block_table.len())
            .max()
            .unwrap_or(0);

        let mut p = self.new_plan(b, t, max_blocks, ops);
        self.rows.clear();
        self.samples.clear();
        p.query_start_loc.push(0);
        let mut start = 0usize;
        let mut group_rows = Vec::with_capacity(if self.kv.is_empty() { 0 } else { b });
        for &(slot, n) in sched {
            let seq = &mut self.seqs[slot as usize];
            let nc = seq.num_computed;
            let end = nc + n;
            if !self.kv.is_empty() {
                group_rows.push((slot, nc, end));
            }
            let d = seq.drafts.len();
            let completes = end - d == seq.num_tokens();
            p.req_ids.push(seq.seq_id);
            p.num_scheduled_tokens.push(n as i32);
            p.num_computed_tokens.push(nc as i32);
            p.num_prompt_tokens.push(seq.prompt_len as i32);
            p.seq_lens.push(end as i32);
            p.query_start_loc.push((start + n) as i32);
            p.block_table_rows
                .push(seq.row.expect("a scheduled sequence has a block-table row") as i32);
            let table = &seq.block_table;
            if n == 1 && completes {
                p.input_ids.push(i64::from(seq.last_token));
            } else if d > 0 {
                p.input_ids.push(i64::from(seq.last_token));
                p.input_ids.extend(seq.drafts.iter().map(|&x| i64::from(x)));
                p.draft_token_ids
                    .extend(seq.drafts.iter().map(|&x| i64::from(x)));
            } else {
                seq.extend_tokens(nc, end, &mut p.input_ids);
            }
            p.positions.extend((nc..end).map(|x| x as i64));
            let last = table.len().wrapping_sub(1);
            p.slot_mapping.extend((nc..end).map(|pos| {
                let idx = pos >> shift;
                // A decode writes the last block: read it from the sequence, not its table.
                let block = if idx == last {
                    seq.last_block
                } else {
                    table[idx]
                };
                (i64::from(block) << shift) | (pos & (bs - 1)) as i64
            }));
            if (n == 1 || d > 0) && completes && nc >= seq.prompt_len {
                p.num_decode_tokens += n;
            } else {
                p.num_prefill_tokens += n;
            }
            // A speculating sequence computes its drafts' KV too, but only the accepted ones count
            // (`update_spec()` adds them).
            seq.num_computed = end - d;
            self.rows.push((slot, seq.gen));
            if completes {
                let row = (start + n - 1 - d) as i64;
                p.logits_indices.extend(row..=row + d as i64);
                p.sampled_seq_ids.push(seq.seq_id);
                p.num_draft_tokens.push(d as i32);
                self.samples.push((slot, seq.gen));
                // Only a first prompt completion can have children waiting to fork.
                if nc < seq.prompt_len && !seq.children.is_empty() {
                    self.fork_children(slot, row, &mut p);
                }
            }
            start += n;
        }
        let g = self.kv.plan_tables(&group_rows, max_blocks);
        (p.group_slot_mapping, p.group_block_tables) = (g.slot_mapping, g.block_tables);
        (p.group_copies, p.group_num_copies) = (g.copies, g.num_copies);
        (p.group_block_moves, p.group_num_blocks) = (g.moves, g.num_blocks);
        // Forked children got their rows above: they are written now, with everything else that
        // changed since the last plan.
        self.tables.flush(&self.seqs, &mut p.changed_rows);
        self.step_shape = Some(crate::spec_governor::StepShape {
            rows: p.sampled_seq_ids.len(),
            drafts: p.num_draft_tokens.iter().map(|&d| d as usize).sum(),
            emitted: 0, // set by update()
            prefill: p.num_prefill_tokens > 0,
        });
        self.step += 1;
        if !self.rows.is_empty() {
            self.pending = Some(p.step_id);
        }
        p
    }

    /// A plan of `b` rows and `t` tokens with the step's block operations, its arrays still empty.
    fn new_plan(&mut self, b: usize, t: usize, max_blocks: usize, ops: PlanOps) -> StepPlan {
        StepPlan {
            step_id: self.step,
            req_ids: Vec::with_capacity(b),
            num_scheduled_tokens: Vec::with_capacity(b),
            num_computed_tokens: Vec::with_capacity(b),
            num_prompt_tokens: Vec::with_capacity(b),
            seq_lens: Vec::with_capacity(b),
            query_start_loc: Vec::with_capacity(b + 1),
            input_ids: Vec::with_capacity(t),
            positions: Vec::with_capacity(t),
            slot_mapping: Vec::with_capacity(t),
            block_table_rows: Vec::with_capacity(b),
            changed_rows: Vec::new(),
            max_blocks,
            logits_indices: Vec::with_capacity(b),
            sampled_seq_ids: Vec::with_capacity(b),
            num_draft_tokens: Vec::with_capacity(b),
            draft_token_ids: Vec::new(),
            swap_out: ops.swap_out,
            swap_in: ops.swap_in,
            copies: ops.copies,
            block_moves: std::mem::take(&mut self.pending_moves),
            preempted: ops.preempted,
            tier_store: self.tier.take_transfers(),
            tier_load: ops.tier_load,
            group_slot_mapping: Vec::new(),
            group_block_tables: Vec::new(),
            group_copies: Vec::new(),
            group_num_copies: Vec::new(),
            group_swap_out: ops.group_swap_out,
            group_swap_in: ops.group_swap_in,
            group_block_moves: Vec::new(),
            group_num_blocks: Vec::new(),
            num_blocks: self.pool.num_blocks(),
            num_prefill_tokens: 0,
            num_decode_tokens: 0,
            num_tokens: t,
        }
    }

    /// Children of `slot` become running sequences sharing every block; each gets a logits row
    /// on the parent's last prompt token.
    fn fork_children(&mut self, slot: u32, row: i64, p: &mut StepPlan) {
        let children = std::mem::take(&mut self.seqs[slot as usize].children);
        for &(id, child) in &children {
            let c = self.new_slot();
            let (parent, kid) = if (c as usize) < slot as usize {
                let (a, b) = self.seqs.split_at_mut(slot as usize);
                (&b[0], &mut a[c as usize])
            } else {
                let (a, b) = self.seqs.split_at_mut(c as usize);
                (&a[slot as usize], &mut b[0])
            };
            kid.seq_id = id;
            kid.status = parent.status;
            kid.key = parent.key;
            kid.key.child = child;
            kid.tokens.extend_from_slice(&parent.tokens);
            kid.tail = parent.tail;
            kid.tail_len = parent.tail_len;
            kid.prompt_len = parent.prompt_len;
            kid.num_computed = parent.num_computed;
            kid.block_table.clear();
            kid.block_table.extend_from_slice(&parent.block_table);
            kid.last_block = parent.last_block;
            kid.last_hash = parent.last_hash;
            kid.num_cached_blocks = parent.num_cached_blocks;
            kid.extra_key = parent.extra_key;
            kid.skip_prefix_cache = parent.skip_prefix_cache;
            kid.stop = parent.stop.clone();
            kid.last_token = parent.last_token;
            // A partial last prompt block is shared: the first write to it copies it.
            kid.shared_tail = parent.num_computed % self.cfg.block_size != 0;
            kid.num_cached_tokens = parent.num_cached_tokens;
            kid.admitted = true;
            for &b in &kid.block_table {
                self.pool.incref(crate::BlockId(b));
            }
            self.kv.fork(slot, c);
            self.ids.insert(
                id,
                crate::scheduler::SeqRef {
                    slot: c,
                    child: false,
                },
            );
            self.insert_running(c);
            p.logits_indices.push(row);
            p.sampled_seq_ids.push(id);
            p.num_draft_tokens.push(0);
            self.samples.push((c, self.seqs[c as usize].gen));
        }
        let mut children = children;
        children.clear();
        let parent = &mut self.seqs[slot as usize];
        parent.children = children;
        parent.shared_tail = parent.num_computed % self.cfg.block_size != 0;
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, NewRequest, Scheduler};

    #[test]
    fn fork_gives_each_child_a_logits_row_and_shares_blocks() {
        let mut s = Scheduler::new(Config {
            num_blocks: 8,
            block_size: 4,
            ..Config::default()
        })
        .unwrap();
        let req = NewRequest {
            seq_ids: vec![1, 2, 3],
            prompt_token_ids: vec![5; 6],
            max_tokens: 3,
            ..Default::default()
        };
        s.add_request(req).unwrap();
        let p = s.schedule().unwrap();
        assert_eq!(p.req_ids, vec![1]);
        assert_eq!(p.sampled_seq_ids, vec![1, 2, 3]);
        assert_eq!(p.logits_indices, vec![5, 5, 5]);
        assert_eq!(s.pool().num_free(), 6);
        let tables = s.plan_block_tables(&p).unwrap();
        assert_eq!(s.pool().ref_count(crate::BlockId(tables[0] as u32)), 3);
        // The children's rows are written by the plan that forks them.
        assert_eq!(p.block_table_rows, vec![0]);
        assert_eq!(p.changed_rows, vec![0, 1, 2]);
        for r in 1..3 {
            assert_eq!(s.block_table().row(r)[..2], tables[..2]);
        }
        s.update(p.step_id, &[7, 8, 9]).unwrap();
        let p = s.schedule().unwrap();
        assert_eq!(p.copies.len(), 4); // two (src, dst) pairs
        assert_eq!(p.input_ids, vec![7, 8, 9]);
        s.check_invariants().unwrap();
    }

    #[test]
    fn padded_block_tables_and_query_starts() {
        let mut s = Scheduler::new(Config {
            num_blocks: 8,
            block_size: 2,
            ..Config::default()
        })
        .unwrap();
        for (id, len) in [(1, 5), (2, 1)] {
            let req = NewRequest {
                seq_ids: vec![id],
                prompt_token_ids: vec![3; len],
                max_tokens: 2,
                ..Default::default()
            };
            s.add_request(req).unwrap();
        }
        let p = s.schedule().unwrap();
        assert_eq!(p.max_blocks, 3);
        assert_eq!(p.query_start_loc, vec![0, 5, 6]);
        let tables = s.plan_block_tables(&p).unwrap();
        assert_eq!(tables.len(), 6);
        assert_eq!(tables[4..], [0, 0]);
        assert_eq!(p.logits_indices, vec![4, 5]);
        assert_eq!(s.block_table().width(), 2048 / 2);
        assert_eq!(s.block_table().row(1)[..3], [tables[3], 0, 0]);
        s.update(p.step_id, &[1, 1]).unwrap();
        assert!(s.plan_block_tables(&p).is_ok()); // valid until the next schedule()
        let q = s.schedule().unwrap();
        assert!(matches!(
            s.plan_block_tables(&p),
            Err(crate::Error::StalePlan { step: 0, latest: 1 })
        ));
        // Decodes that stay within their last block change no row.
        assert!(q.changed_rows.is_empty());
        assert_eq!(q.block_table_rows, vec![0, 1]);
    }

    #[test]
    fn rows_are_recycled_and_rewritten_with_zeros() {
        let mut s = Scheduler::new(Config {
            num_blocks: 16,
            block_size: 2,
            max_num_seqs: 2,
            max_model_len: 16,
            ..Config::default()
        })
        .unwrap();
        for (id, len, max_tokens) in [(1, 7, 1), (2, 1, 4), (3, 2, 4)] {
            let req = NewRequest {
                seq_ids: vec![id],
                prompt_token_ids: vec![3; len],
                max_tokens,
                ..Default::default()
            };
            s.add_request(req).unwrap();
        }
        let p = s.schedule().unwrap();
        assert_eq!(
            (p.block_table_rows.clone(), p.changed_rows.clone()),
            (vec![0, 1], vec![0, 1])
        );
        let long = s.block_table().row(0)[..4].to_vec();
        s.update(p.step_id, &[1, 1]).unwrap(); // seq 1 finishes: row 0 is free
        assert_eq!(s.block_table().row(0)[..4], long[..]); // untouched until reused
        let p = s.schedule().unwrap();
        assert_eq!(p.req_ids, vec![2, 3]);
        assert_eq!(p.block_table_rows, vec![1, 0]);
        assert_eq!(p.changed_rows, vec![0]);
        let row = s.block_table().row(0);
        assert_eq!(row[1..], [0; 7]);
        assert_eq!(
            s.plan_block_tables(&p).unwrap(),
            vec![s.block_table().row(1)[0], row[0]]
        );
        s.check_invariants().unwrap();
    }
}
