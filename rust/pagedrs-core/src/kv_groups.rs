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

/// A plan's slot mapping and padded block tables in the window group, and the copy-on-write pairs
/// to apply to the group's blocks before its forward (handed over once).
pub type WindowTables = (Vec<i64>, Vec<i32>, Vec<i64>);

/// The blocks of the layers with one window size shorter than the context.
#[derive(Debug)]
pub struct WindowGroup {
    pub window: usize,
    pub pool: BlockPool,
    /// Indexed by sequence slot; empty for slots holding nothing.
    pub(crate) tables: Vec<SlidingTable>,
    /// Copy-on-write pairs (src, dst) of the group's blocks not yet handed to the runner, flattened.
    pub(crate) pending_copies: Vec<i64>,
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
            pending_copies: Vec::new(),
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

    /// Plan `p`'s slot mapping `[T]` and padded block tables `[B, max_blocks]` in the window group
    /// (dead entries and padding 0: the kernels mask those positions by the window); valid until
    /// the next `schedule()`, as [`Self::plan_block_tables`].
    pub fn plan_window_tables(&mut self, p: &crate::StepPlan) -> Result<WindowTables> {
        self.window_tables(
            p.step_id,
            &p.req_ids,
            &p.query_start_loc,
            &p.positions,
            p.max_blocks,
        )
    }

    /// [`Self::plan_window_tables`] from the plan's arrays.
    pub fn window_tables(
        &mut self,
        step_id: u64,
        req_ids: &[i64],
        query_start_loc: &[i32],
        positions: &[i64],
        max_blocks: usize,
    ) -> Result<WindowTables> {
        let w = self
            .window
            .as_ref()
            .ok_or_else(|| Error::InvalidRequest("the scheduler has no window group".into()))?;
        if step_id + 1 != self.step {
            return Err(Error::StalePlan {
                step: step_id,
                latest: self.step.saturating_sub(1),
            });
        }
        if query_start_loc.len() != req_ids.len() + 1
            || query_start_loc.last().map_or(0, |&x| x as usize) != positions.len()
        {
            return Err(Error::InvalidRequest(
                "query_start_loc does not match req_ids and positions".into(),
            ));
        }
        let bs = self.cfg.block_size;
        let mut slots = Vec::with_capacity(positions.len());
        let mut tables = vec![0i32; req_ids.len() * max_blocks];
        for (b, &id) in req_ids.iter().enumerate() {
            let r = self
                .ids
                .get(&id)
                .ok_or(Error::UnknownSeqId { seq_id: id })?;
            let t = w.table(r.slot);
            for (dst, &blk) in tables[b * max_blocks..(b + 1) * max_blocks]
                .iter_mut()
                .zip(t)
            {
                *dst = if blk == NULL_BLOCK { 0 } else { blk as i32 };
            }
            let (a, z) = (query_start_loc[b] as usize, query_start_loc[b + 1] as usize);
            for &pos in &positions[a..z] {
                let pos = pos as usize;
                let blk = t.get(pos / bs).copied().unwrap_or(NULL_BLOCK);
                if blk == NULL_BLOCK {
                    return Err(Error::Invariant(format!(
                        "seq {id} writes position {pos} outside its live window blocks"
                    )));
                }
                slots.push(i64::from(blk) * bs as i64 + (pos % bs) as i64);
            }
        }
        let copies = std::mem::take(&mut self.window.as_mut().expect("checked").pending_copies);
        Ok((slots, tables, copies))
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
        self.window.as_ref().is_none_or(|w| {
            let cow = usize::from(self.window_cow(slot).is_some());
            w.new_blocks(slot, num_tokens) + extra + cow <= w.pool.num_free()
        })
    }

    /// The index of the window block `slot` writes first when that block is shared with a forked
    /// sibling (its partial last prompt block): copied before the write, as the full group's.
    fn window_cow(&self, slot: u32) -> Option<usize> {
        let w = self.window.as_ref()?;
        let seq = &self.seqs[slot as usize];
        let bs = self.cfg.block_size;
        let idx = seq.num_computed / bs;
        if !seq.shared_tail || seq.num_computed % bs == 0 {
            return None;
        }
        let b = *w.table(slot).get(idx)?;
        (b != NULL_BLOCK && w.pool.ref_count(BlockId(b)) > 1).then_some(idx)
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

    /// Grows `slot`'s window table; call before the full group's `allocate` (which clears
    /// `shared_tail`).
    pub(crate) fn window_grow(&mut self, slot: u32, num_tokens: usize) {
        let cow = self.window_cow(slot);
        if let Some(w) = self.window.as_mut() {
            if let Some(idx) = cow {
                let dst = w
                    .pool
                    .allocate()
                    .expect("window blocks checked before growing");
                let src = w.tables[slot as usize].replace(idx, dst);
                w.pool.free(src);
                w.pending_copies
                    .extend([i64::from(src.0), i64::from(dst.0)]);
            }
            let t = w.table_mut(slot);
            let mut t = std::mem::take(t);
            let grown = t.grow(&mut w.pool, num_tokens);
            w.tables[slot as usize] = t;
            assert!(grown, "window blocks checked before growing");
        }
    }

    /// A forked child `kid` shares every live window block of `parent`.
    pub(crate) fn window_fork(&mut self, parent: u32, kid: u32) {
        if let Some(w) = self.window.as_mut() {
            let t = w.tables.get(parent as usize).cloned().unwrap_or_default();
            let t = t.fork(&mut w.pool);
            *w.table_mut(kid) = t;
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
mod tests;
