//! Paged KV in a group's own pool: the [`KvGroup`] of sliding-window layers (blocks freed once they
//! fell out of the window, prefix hits capped to the window blocks the group still holds, as vLLM
//! V1's `SlidingWindowManager` and llama.cpp's SWA cache), and of full-attention layers beside
//! the primary pool (no window: nothing is freed early, a hit is the group's cached run from
//! block 0, as vLLM V1's `FullAttentionManager`).
//!
//! One [`SlidingTable`] per sequence slot; a full-attention table is one whose window never ends.

use crate::block_pool::{BlockPool, CacheItem};
use crate::error::{Error, Result};
use crate::kv_groups::KvGroup;
use crate::prefix_cache::{block_hash, root_hash};
use crate::request::{Seq, Status};
use crate::sliding_window::{longest_hit, max_live_blocks, SlidingTable, NULL_BLOCK};
use crate::swap_pool::SwapPool;
use crate::BlockId;

#[derive(Debug)]
pub struct PagedGroup {
    /// None: full attention.
    window: Option<usize>,
    pool: BlockPool,
    /// Indexed by sequence slot; empty for slots holding nothing.
    tables: Vec<SlidingTable>,
    /// Copy-on-write pairs (src, dst) not yet handed to a plan, flattened.
    pending_copies: Vec<i64>,
    /// The host blocks of swapped-out sequences (the group's layers' own part of the swap space).
    swap: SwapPool,
    /// Indexed by sequence slot: a swapped-out sequence's table, its live entries swap blocks.
    swapped: Vec<SlidingTable>,
    /// Resize moves (src, dst) not yet handed to a plan, flattened.
    pending_moves: Vec<i64>,
    /// The pool's size at start (resizes scale it with the primary pool's).
    base_blocks: usize,
    /// The fewest blocks the pool may have: one sequence's live blocks at the largest step.
    least: usize,
}

impl PagedGroup {
    /// The group of layers attending to the last `window` tokens, with `num_blocks` blocks. The
    /// pool must hold one sequence's live blocks at a step of `step_tokens` tokens.
    pub fn sliding_window(
        window: usize,
        num_blocks: usize,
        block_size: usize,
        max_model_len: usize,
        step_tokens: usize,
    ) -> Result<Self> {
        if window == 0 || window >= max_model_len {
            return Err(Error::InvalidRequest(format!(
                "window {window} must be in [1, max_model_len={max_model_len})"
            )));
        }
        let least = max_live_blocks(window, block_size, step_tokens);
        if num_blocks < least {
            return Err(Error::InvalidRequest(format!(
                "window group of {num_blocks} blocks cannot hold one sequence's {least} live blocks \
                 (window {window}, block size {block_size}, step {step_tokens} tokens)"
            )));
        }
        let mut g = Self::new(Some(window), num_blocks, block_size);
        g.least = least;
        Ok(g)
    }

    /// A group of full-attention layers with a pool of its own of `num_blocks` blocks.
    pub fn full_attention(num_blocks: usize, block_size: usize) -> Self {
        Self::new(None, num_blocks, block_size)
    }

    fn new(window: Option<usize>, num_blocks: usize, block_size: usize) -> Self {
        Self {
            window,
            pool: BlockPool::new(num_blocks, block_size),
            tables: Vec::new(),
            pending_copies: Vec::new(),
            swap: SwapPool::new(0),
            swapped: Vec::new(),
            pending_moves: Vec::new(),
            base_blocks: num_blocks,
            least: 1,
        }
    }

    /// The group with a swap pool of `num_blocks` host blocks (0: preemption recomputes).
    pub fn with_swap(mut self, num_blocks: usize) -> Self {
        self.swap = SwapPool::new(num_blocks);
        self
    }

    /// The window as the table helpers take it (full attention: one that never ends).
    fn span(&self) -> usize {
        self.window.unwrap_or(usize::MAX)
    }

    /// The table of `slot` (dead entries [`NULL_BLOCK`]).
    pub fn table(&self, slot: u32) -> &[u32] {
        self.tables.get(slot as usize).map_or(&[], |t| t.blocks())
    }

    fn table_mut(&mut self, slot: u32) -> &mut SlidingTable {
        let i = slot as usize;
        if self.tables.len() <= i {
            self.tables.resize_with(i + 1, SlidingTable::default);
        }
        &mut self.tables[i]
    }

    /// Blocks `slot` must newly allocate to cover `num_tokens` tokens.
    fn new_blocks(&self, slot: u32, num_tokens: usize) -> usize {
        num_tokens
            .div_ceil(self.pool.block_size())
            .saturating_sub(self.table(slot).len())
    }

    /// The index of the block `slot` writes first when it is shared with a forked sibling (its
    /// partial last prompt block): copied before the write, as the primary pool's.
    fn cow(&self, slot: u32, seq: &Seq) -> Option<usize> {
        let bs = self.pool.block_size();
        if !seq.shared_tail || seq.num_computed % bs == 0 {
            return None;
        }
        let idx = seq.num_computed / bs;
        let b = *self.table(slot).get(idx)?;
        (b != NULL_BLOCK && self.pool.ref_count(BlockId(b)) > 1).then_some(idx)
    }

    fn check_table(
        &self,
        t: &SlidingTable,
        seq: &Seq,
        refs: &mut [u32],
    ) -> std::result::Result<(), String> {
        let bs = self.pool.block_size();
        t.check(seq.num_computed, self.span(), bs)
            .map_err(|e| format!("seq {}: {e}", seq.seq_id))?;
        let mut parent = root_hash(seq.extra_key);
        for (i, &b) in t.blocks().iter().enumerate() {
            let full = (i + 1) * bs <= seq.num_computed;
            let h = if full {
                let toks: Vec<u32> = (i * bs..(i + 1) * bs).map(|j| seq.token(j)).collect();
                block_hash(parent, &toks)
            } else {
                0
            };
            if b != NULL_BLOCK {
                refs[b as usize] += 1;
                if full
                    && self.pool.is_cached(BlockId(b))
                    && self.pool.cache().hash_of(BlockId(b)) != h
                {
                    return Err(format!(
                        "seq {} maps block {b} at {i} holding other tokens",
                        seq.seq_id
                    ));
                }
            }
            parent = h;
        }
        Ok(())
    }
}

impl KvGroup for PagedGroup {
    fn name(&self) -> String {
        self.window
            .map_or_else(|| "full".to_string(), |w| format!("window:{w}"))
    }

    fn window(&self) -> Option<usize> {
        self.window
    }

    fn pool(&self) -> Option<&BlockPool> {
        Some(&self.pool)
    }

    fn pool_mut(&mut self) -> Option<&mut BlockPool> {
        Some(&mut self.pool)
    }

    fn longest_hit(&self, max_blocks: usize, chain: &[u64], tokens: &[u32]) -> (usize, Vec<u32>) {
        let bs = self.pool.block_size();
        longest_hit(max_blocks, self.span(), bs, |i| {
            self.pool
                .lookup(chain[i + 1], chain[i], &tokens[i * bs..(i + 1) * bs])
        })
    }

    fn admit_cost(&self, hit: &[u32], num_tokens: usize) -> usize {
        let evictable = hit
            .iter()
            .filter(|&&b| b != NULL_BLOCK && self.pool.ref_count(BlockId(b)) == 0)
            .count();
        num_tokens.div_ceil(self.pool.block_size()) - hit.len() + evictable
    }

    fn admit(&mut self, slot: u32, hit: Vec<u32>, num_tokens: usize) {
        let mut t = SlidingTable::from_hit(&mut self.pool, hit);
        let grown = t.grow(&mut self.pool, num_tokens);
        assert!(grown, "group blocks checked before admission");
        *self.table_mut(slot) = t;
    }

    fn grow_cost(&self, slot: u32, seq: &Seq, num_tokens: usize) -> usize {
        self.new_blocks(slot, num_tokens) + usize::from(self.cow(slot, seq).is_some())
    }

    fn grow(&mut self, slot: u32, seq: &Seq, num_tokens: usize) {
        if let Some(idx) = self.cow(slot, seq) {
            let dst = self
                .pool
                .allocate()
                .expect("group blocks checked before growing");
            let src = self.tables[slot as usize].replace(idx, dst);
            self.pool.free(src);
            self.pending_copies
                .extend([i64::from(src.0), i64::from(dst.0)]);
        }
        let mut t = std::mem::take(self.table_mut(slot));
        let grown = t.grow(&mut self.pool, num_tokens);
        self.tables[slot as usize] = t;
        assert!(grown, "group blocks checked before growing");
    }

    fn fork(&mut self, parent: u32, kid: u32) {
        let t = self
            .tables
            .get(parent as usize)
            .cloned()
            .unwrap_or_default();
        let t = t.fork(&mut self.pool);
        *self.table_mut(kid) = t;
    }

    fn cache(&mut self, items: &[CacheItem], seqs: &[Seq]) {
        let mut own: Vec<CacheItem> = items
            .iter()
            .filter_map(|it| {
                let b = *self
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
        let bs = self.pool.block_size();
        self.pool.cache_blocks(&mut own, |it| {
            let i = it.idx as usize * bs;
            &seqs[it.slot as usize].tokens[i..i + bs]
        });
    }

    fn release(&mut self, slot: u32, num_computed: usize) {
        let span = self.span();
        if let Some(t) = self.tables.get_mut(slot as usize) {
            t.release_dead(&mut self.pool, num_computed, span);
        }
    }

    fn truncate(&mut self, slot: u32, num_tokens: usize) {
        if let Some(t) = self.tables.get_mut(slot as usize) {
            t.truncate(&mut self.pool, num_tokens);
        }
    }

    fn free(&mut self, slot: u32) {
        if let Some(t) = self.tables.get_mut(slot as usize) {
            t.free_all(&mut self.pool);
        }
        if let Some(t) = self.swapped.get_mut(slot as usize) {
            for &s in t.live() {
                self.swap.free(s);
            }
            *t = SlidingTable::default();
        }
    }

    fn plan_row(
        &self,
        slot: u32,
        start: usize,
        end: usize,
        max_blocks: usize,
        slot_mapping: &mut Vec<i64>,
        tables: &mut Vec<i32>,
    ) {
        // Dead entries and padding are block 0: the kernels mask those positions by the window.
        let bs = self.pool.block_size();
        let t = self.table(slot);
        let at = tables.len();
        tables.resize(at + max_blocks, 0);
        for (dst, &b) in tables[at..].iter_mut().zip(t) {
            *dst = if b == NULL_BLOCK { 0 } else { b as i32 };
        }
        slot_mapping.extend((start..end).map(|pos| {
            let b = t.get(pos / bs).copied().unwrap_or(NULL_BLOCK);
            assert!(
                b != NULL_BLOCK,
                "slot {slot} writes position {pos} outside its live blocks"
            );
            i64::from(b) * bs as i64 + (pos % bs) as i64
        }));
    }

    fn blocks_of(&self, slot: u32) -> Vec<u32> {
        self.table(slot).to_vec()
    }

    fn can_swap_out(&self, slot: u32) -> bool {
        let live = self.tables.get(slot as usize).map_or(0, |t| t.live().len());
        self.swap.num_free() >= live
    }

    fn swap_out(&mut self, slot: u32, pairs: &mut Vec<i64>) {
        let mut t = std::mem::take(self.table_mut(slot));
        let (pool, swap) = (&mut self.pool, &mut self.swap);
        t.remap(|b| {
            let s = swap
                .allocate()
                .expect("swap blocks checked before swapping out");
            pool.free(BlockId(b));
            pairs.extend([i64::from(b), i64::from(s)]);
            s
        });
        if self.swapped.len() <= slot as usize {
            self.swapped
                .resize_with(slot as usize + 1, SlidingTable::default);
        }
        self.swapped[slot as usize] = t;
    }

    fn swap_in_cost(&self, slot: u32, num_tokens: usize) -> usize {
        let (len, live) = self
            .swapped
            .get(slot as usize)
            .map_or((0, 0), |t| (t.blocks().len(), t.live().len()));
        live + num_tokens
            .div_ceil(self.pool.block_size())
            .saturating_sub(len)
    }

    fn swap_in(&mut self, slot: u32, num_tokens: usize, pairs: &mut Vec<i64>) {
        let mut t = self
            .swapped
            .get_mut(slot as usize)
            .map(std::mem::take)
            .unwrap_or_default();
        let (pool, swap) = (&mut self.pool, &mut self.swap);
        t.remap(|s| {
            let d = pool
                .allocate()
                .expect("group blocks checked before swapping in");
            swap.free(s);
            pairs.extend([i64::from(s), i64::from(d.0)]);
            d.0
        });
        let grown = t.grow(&mut self.pool, num_tokens);
        assert!(grown, "group blocks checked before swapping in");
        *self.table_mut(slot) = t;
    }

    fn take_copies(&mut self) -> Vec<i64> {
        std::mem::take(&mut self.pending_copies)
    }

    /// In proportion to the primary pool (rounded up), never below one sequence's live blocks.
    fn resize_target(&self, base: usize, num_blocks: usize) -> Option<usize> {
        let scaled = (self.base_blocks * num_blocks).div_ceil(base.max(1));
        Some(scaled.max(self.least))
    }

    fn resize(&mut self, num_blocks: usize) {
        let old = self.pool.num_blocks();
        if num_blocks >= old {
            self.pool.grow(num_blocks);
            return;
        }
        let moves = self
            .pool
            .shrink(num_blocks)
            .expect("group blocks in use checked before shrinking");
        crate::resize::compose_moves(&mut self.pending_moves, &moves, num_blocks);
        if moves.is_empty() {
            return;
        }
        let mut remap: Vec<u32> = (0..old as u32).collect();
        for &(src, dst) in &moves {
            remap[src.0 as usize] = dst.0;
        }
        // Swapped-out tables hold swap blocks, which a resize leaves alone.
        for t in &mut self.tables {
            t.remap(|b| remap[b as usize]);
        }
    }

    fn take_moves(&mut self) -> Vec<i64> {
        std::mem::take(&mut self.pending_moves)
    }

    fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    fn check(&self, seqs: &[Seq]) -> std::result::Result<(), String> {
        self.pool.check()?;
        let mut refs = vec![0u32; self.pool.num_blocks()];
        for (slot, t) in self.tables.iter().enumerate() {
            match seqs.get(slot) {
                Some(seq) if seq.alive && seq.status == Status::Running => {
                    self.check_table(t, seq, &mut refs)?;
                }
                _ if !t.blocks().is_empty() => {
                    return Err(format!("slot {slot} not running holds blocks"));
                }
                _ => {}
            }
        }
        for (b, &r) in refs.iter().enumerate() {
            let got = self.pool.ref_count(BlockId(b as u32));
            if got != r {
                return Err(format!("block {b} has ref count {got} but {r} holders"));
            }
        }
        if self.pending_copies.len() % 2 != 0 {
            return Err("an odd number of copy-on-write ids".into());
        }
        self.check_swapped(seqs)
    }
}

impl PagedGroup {
    /// Only swapped-out sequences hold swap blocks, each one reference, and hold no device block.
    fn check_swapped(&self, seqs: &[Seq]) -> std::result::Result<(), String> {
        self.swap.check()?;
        let mut refs = vec![0u32; self.swap.num_blocks()];
        for (slot, t) in self.swapped.iter().enumerate() {
            if t.blocks().is_empty() {
                continue;
            }
            let seq = seqs
                .get(slot)
                .filter(|s| s.alive && s.status == Status::Swapped);
            if seq.is_none() {
                return Err(format!("slot {slot} not swapped out holds swap blocks"));
            }
            if !self.table(slot as u32).is_empty() {
                return Err(format!("slot {slot} swapped out holds device blocks"));
            }
            for &s in t.live() {
                refs[s as usize] += 1;
            }
        }
        match (0..refs.len()).find(|&s| self.swap.ref_count(s as u32) != refs[s]) {
            Some(s) => Err(format!("swap block {s} has {} holders", refs[s])),
            None => Ok(()),
        }
    }
}
