//! Sliding-window KV-cache groups: the blocks of layers that attend only to the last `window`
//! tokens, kept in their own pool and freed once every token in them fell out of the window (as
//! vLLM V1's `SlidingWindowManager` and llama.cpp's SWA cache).
//!
//! Window convention (HF transformers, and the torch reference attention): a query at position
//! `q` attends to a key at position `k` iff `0 <= q - k < window`, so the current token counts.
//! A sequence whose next query is at position `num_computed` never again reads keys below
//! `num_computed + 1 - window`; a block is dead once all its tokens are below that.
//!
//! A group's table keeps one entry per block of the context, like a full-attention table, so a
//! position's block is still `table[pos / block_size]`. Dead entries hold [`NULL_BLOCK`]; a runner
//! maps them to any valid block id (the kernel masks those positions out by the window anyway).
//!
//! INVARIANTS (checked by [`SlidingTable::check`]):
//! - entries `0..num_dead` are [`NULL_BLOCK`], entries `num_dead..` are blocks the table holds one
//!   reference to;
//! - `num_dead <= num_dead_blocks(committed, window, block_size)` for the committed position the
//!   table was last released at: a block is freed only when no future query can read it, and
//!   [`SlidingTable::release_dead`] is only called with committed positions (never counting
//!   speculative tokens), so a rollback never needs a freed block;
//! - a prefix-cache hit maps only blocks the group's own cache still holds: entries below
//!   `hit - needed_blocks` are [`NULL_BLOCK`] and no freed or evicted block comes back
//!   ([`longest_hit`]).

use crate::block_pool::BlockPool;
use crate::BlockId;

/// Table entry of a block freed because it fell out of the window.
pub const NULL_BLOCK: u32 = u32::MAX;

/// First position a query at `num_computed` or later may still attend to.
pub fn first_live_token(num_computed: usize, window: usize) -> usize {
    debug_assert!(window >= 1);
    (num_computed + 1).saturating_sub(window)
}

/// Leading blocks no query at `num_computed` or later reads.
pub fn num_dead_blocks(num_computed: usize, window: usize, block_size: usize) -> usize {
    first_live_token(num_computed, window) / block_size
}

/// Blocks before a prefix-cache hit point that the first query after it reads: the hit needs
/// the cached blocks covering the last `window - 1` tokens before it.
pub fn needed_blocks(window: usize, block_size: usize) -> usize {
    (window - 1).div_ceil(block_size)
}

/// Most blocks one sequence holds in the group while it computes `step_tokens` tokens per step:
/// those of the window behind its oldest query, plus those the step writes, plus one for
/// misalignment at each end.
pub fn max_live_blocks(window: usize, block_size: usize, step_tokens: usize) -> usize {
    (window - 1 + step_tokens).div_ceil(block_size) + 1
}

/// The longest prefix-cache hit, in blocks, that a sliding group can serve within the first
/// `max_blocks` blocks: the largest `n <= max_blocks` whose blocks `n - needed..n` are all cached
/// (`cached(i)` answers for block `i`, and is asked for each block at most once). Returns `n` and
/// the group's table for it (dead entries [`NULL_BLOCK`]). A hybrid model's hit is this with
/// `max_blocks` set to the full-attention groups' hit, whose hits are prefix-closed.
pub fn longest_hit(
    max_blocks: usize,
    window: usize,
    block_size: usize,
    mut cached: impl FnMut(usize) -> Option<BlockId>,
) -> (usize, Vec<u32>) {
    let need = needed_blocks(window, block_size);
    if need == 0 {
        return (max_blocks, vec![NULL_BLOCK; max_blocks]);
    }
    let mut found: Vec<u32> = Vec::with_capacity(need.min(max_blocks));
    // Scan from the right for `need` cached blocks in a row, or a cached run from block 0.
    let mut i = max_blocks;
    while i > 0 {
        i -= 1;
        match cached(i) {
            Some(b) => {
                found.push(b.0);
                if found.len() == need || i == 0 {
                    let n = i + found.len();
                    let mut table = vec![NULL_BLOCK; i];
                    table.extend(found.iter().rev());
                    return (n, table);
                }
            }
            None => found.clear(),
        }
    }
    (0, Vec::new())
}

/// One sequence's table in a sliding group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingTable {
    blocks: Vec<u32>,
    num_dead: usize,
}

impl SlidingTable {
    /// A table from a prefix-cache hit of [`longest_hit`], taking a reference to its blocks.
    pub fn from_hit(pool: &mut BlockPool, table: Vec<u32>) -> Self {
        let num_dead = table.iter().take_while(|&&b| b == NULL_BLOCK).count();
        for &b in &table[num_dead..] {
            pool.incref(BlockId(b));
        }
        Self {
            blocks: table,
            num_dead,
        }
    }

    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    pub fn num_dead(&self) -> usize {
        self.num_dead
    }

    /// Blocks this table holds.
    pub fn num_live(&self) -> usize {
        self.blocks.len() - self.num_dead
    }

    /// Allocates blocks to cover `num_tokens` tokens; all or nothing (false: pool too small).
    pub fn grow(&mut self, pool: &mut BlockPool, num_tokens: usize) -> bool {
        let want = num_tokens.div_ceil(pool.block_size());
        let add = want.saturating_sub(self.blocks.len());
        if add > pool.num_free() {
            return false;
        }
        for _ in 0..add {
            let b = pool.allocate().expect("checked free blocks");
            self.blocks.push(b.0);
        }
        true
    }

    /// Points live entry `idx` at block `b` (a copy-on-write destination), returning the old block
    /// (the caller drops its reference).
    pub fn replace(&mut self, idx: usize, b: BlockId) -> BlockId {
        debug_assert!(idx >= self.num_dead && idx < self.blocks.len());
        BlockId(std::mem::replace(&mut self.blocks[idx], b.0))
    }

    /// Frees the blocks no query at committed position `num_computed` or later reads, latest
    /// first (so a cached run is evicted from its tail), and returns how many.
    pub fn release_dead(
        &mut self,
        pool: &mut BlockPool,
        num_computed: usize,
        window: usize,
    ) -> usize {
        let dead = num_dead_blocks(num_computed, window, pool.block_size()).min(self.blocks.len());
        if dead <= self.num_dead {
            return 0;
        }
        for i in (self.num_dead..dead).rev() {
            pool.free(BlockId(self.blocks[i]));
            self.blocks[i] = NULL_BLOCK;
        }
        let n = dead - self.num_dead;
        self.num_dead = dead;
        n
    }

    /// Drops blocks past `num_tokens` (a speculative rollback), latest first. Never below the
    /// dead prefix: the dead blocks were freed at a committed position.
    pub fn truncate(&mut self, pool: &mut BlockPool, num_tokens: usize) {
        let keep = num_tokens.div_ceil(pool.block_size()).max(self.num_dead);
        while self.blocks.len() > keep {
            let b = self.blocks.pop().expect("len > keep");
            pool.free(BlockId(b));
        }
    }

    /// The entries this table holds (past the dead prefix).
    pub fn live(&self) -> &[u32] {
        &self.blocks[self.num_dead..]
    }

    /// Points every live entry at `f(entry)`, latest first, keeping the dead prefix (a swap out to
    /// the host's blocks, or back in to the device's).
    pub fn remap(&mut self, mut f: impl FnMut(u32) -> u32) {
        for b in self.blocks[self.num_dead..].iter_mut().rev() {
            *b = f(*b);
        }
    }

    /// A copy sharing every live block (a fork of `n > 1` siblings).
    pub fn fork(&self, pool: &mut BlockPool) -> Self {
        for &b in &self.blocks[self.num_dead..] {
            pool.incref(BlockId(b));
        }
        self.clone()
    }

    /// Frees every live block, latest first (finish, abort, recompute preemption).
    pub fn free_all(&mut self, pool: &mut BlockPool) {
        for &b in self.blocks[self.num_dead..].iter().rev() {
            pool.free(BlockId(b));
        }
        self.blocks.clear();
        self.num_dead = 0;
    }

    /// Checks the invariants against the committed position it was last released at.
    pub fn check(
        &self,
        num_computed: usize,
        window: usize,
        block_size: usize,
    ) -> Result<(), String> {
        if self.num_dead > num_dead_blocks(num_computed, window, block_size) {
            return Err(format!(
                "{} dead blocks at position {num_computed} with window {window}",
                self.num_dead
            ));
        }
        if let Some(i) = self.blocks[..self.num_dead]
            .iter()
            .position(|&b| b != NULL_BLOCK)
        {
            return Err(format!("dead entry {i} holds block {}", self.blocks[i]));
        }
        if let Some(i) = self.blocks[self.num_dead..]
            .iter()
            .position(|&b| b == NULL_BLOCK)
        {
            return Err(format!("live entry {} is null", self.num_dead + i));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix_cache::{block_hash, root_hash};
    use proptest::prelude::*;

    /// The torch reference's rule, spelled out: key `k` is read by some query at `q >= pos`.
    /// `k <= pos`: the query at `q = pos` reads the oldest keys any later query reads.
    fn read_later(k: usize, pos: usize, window: usize) -> bool {
        pos - k < window
    }

    #[test]
    fn window_counts_the_current_token() {
        // Window 4, next query at 5 reads keys 2..=5: key 1 is dead, key 2 is not.
        assert_eq!(first_live_token(5, 4), 2);
        assert!(!read_later(1, 5, 4) && read_later(2, 5, 4));
        // Block size 2: block 0 (keys 0, 1) is dead, block 1 (keys 2, 3) is not.
        assert_eq!(num_dead_blocks(5, 4, 2), 1);
        assert_eq!(num_dead_blocks(3, 4, 2), 0);
        assert_eq!(needed_blocks(4, 2), 2);
        assert_eq!(needed_blocks(1, 2), 0);
    }

    #[test]
    fn blocks_freed_when_they_leave_the_window_are_reused() {
        let (bs, window) = (4, 8);
        let mut pool = BlockPool::new(4, bs);
        let mut t = SlidingTable::default();
        let mut pos = 0;
        // Decode 64 tokens one at a time in a 4-block pool: only reclamation makes it fit.
        while pos < 64 {
            assert!(t.grow(&mut pool, pos + 1), "ran out at {pos}");
            pos += 1;
            t.release_dead(&mut pool, pos, window);
            t.check(pos, window, bs).unwrap();
            assert!(t.num_live() <= max_live_blocks(window, bs, 1));
        }
        assert_eq!(t.blocks().len(), 16);
        assert_eq!(t.num_dead(), num_dead_blocks(64, window, bs));
        t.free_all(&mut pool);
        assert_eq!(pool.num_free(), 4);
        pool.check().unwrap();
    }

    #[test]
    fn hit_takes_only_the_window_before_it() {
        let (bs, window) = (2, 5); // needs 2 blocks before the hit point
        let cached = [true, false, true, true, true, false];
        let id = |i: usize| cached[i].then_some(BlockId(10 + i as u32));
        let (n, table) = longest_hit(6, window, bs, id);
        assert_eq!(n, 5);
        assert_eq!(table, vec![NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 13, 14]);
        // Capped by the full-attention hit of 3 blocks: blocks 1 and 2 are needed, 1 is gone.
        let (n, table) = longest_hit(3, window, bs, id);
        assert_eq!((n, table), (1, vec![10]));
    }

    fn decode_all(pool: &mut BlockPool, t: &mut SlidingTable, n: usize, window: usize) -> bool {
        for pos in 0..n {
            if !t.grow(pool, pos + 1) {
                return false;
            }
            t.release_dead(pool, pos + 1, window);
        }
        true
    }

    proptest! {
        /// Chunked steps with speculative rollbacks: live blocks always cover every key a later
        /// query reads, only dead keys are freed, and the pool balances.
        #[test]
        fn release_keeps_exactly_the_window(
            bs in 1usize..6,
            window in 1usize..20,
            steps in prop::collection::vec((1usize..9, 0usize..4), 1..40),
        ) {
            let mut pool = BlockPool::new(1000, bs);
            let mut t = SlidingTable::default();
            let mut pos = 0;
            for (chunk, rejected) in steps {
                prop_assert!(t.grow(&mut pool, pos + chunk + rejected));
                t.truncate(&mut pool, pos + chunk); // drafts rejected
                pos += chunk;
                t.release_dead(&mut pool, pos, window);
                t.check(pos, window, bs).map_err(TestCaseError::fail)?;
                prop_assert_eq!(t.num_dead(), num_dead_blocks(pos, window, bs));
                prop_assert!(t.num_live() <= max_live_blocks(window, bs, chunk));
                for k in 0..pos {
                    let live = t.blocks()[k / bs] != NULL_BLOCK;
                    prop_assert!(!read_later(k, pos, window) || live, "key {} freed at {}", k, pos);
                }
                prop_assert_eq!(pool.num_used(), t.num_live());
            }
            let f = t.fork(&mut pool);
            t.free_all(&mut pool);
            prop_assert_eq!(pool.num_used(), f.num_live());
            pool.check().map_err(TestCaseError::fail)?;
        }

        /// A prefix hit never resurrects a freed or evicted block: every block it maps is cached
        /// in the group's pool under the prompt's own hash chain, the blocks the first query after
        /// it reads are all mapped, and no longer hit has that property.
        #[test]
        fn hit_never_resurrects_a_freed_block(
            bs in 1usize..5,
            window in 1usize..16,
            len in 1usize..60,
            pool_blocks in 4usize..40,
            churn in 0usize..60,
        ) {
            let tokens: Vec<u32> = (0..len as u32).map(|t| t * 7 + 1).collect();
            let mut pool = BlockPool::new(pool_blocks, bs);
            let mut t = SlidingTable::default();
            // One sequence computes the prompt, caching each full block as it fills, then its
            // dead blocks go back to the pool; other traffic then evicts some.
            let mut hashes = Vec::new();
            let mut parent = root_hash(0);
            for pos in 0..len {
                if !t.grow(&mut pool, pos + 1) {
                    break;
                }
                if (pos + 1) % bs == 0 {
                    let i = pos / bs;
                    let blk = &tokens[i * bs..(i + 1) * bs];
                    let h = block_hash(parent, blk);
                    pool.cache_block(BlockId(t.blocks()[i]), h, parent, blk);
                    hashes.push((h, parent));
                    parent = h;
                }
                t.release_dead(&mut pool, pos + 1, window);
            }
            t.free_all(&mut pool);
            let mut other = SlidingTable::default();
            decode_all(&mut pool, &mut other, churn.min(pool_blocks * bs), usize::MAX / 2);
            other.free_all(&mut pool);
            let lookup = |i: usize| {
                let (h, p) = hashes[i];
                pool.lookup(h, p, &tokens[i * bs..(i + 1) * bs])
            };
            let (n, table) = longest_hit(hashes.len(), window, bs, lookup);
            let need = needed_blocks(window, bs);
            prop_assert_eq!(table.len(), n);
            for (i, &b) in table.iter().enumerate() {
                if i + need >= n {
                    prop_assert_eq!(Some(BlockId(b)), lookup(i), "block {} not cached", i);
                } else {
                    prop_assert_eq!(b, NULL_BLOCK);
                }
            }
            for m in n + 1..=hashes.len() {
                let servable = (m.saturating_sub(need)..m).all(|i| lookup(i).is_some());
                prop_assert!(!servable, "missed a hit of {} blocks", m);
            }
            let hit = SlidingTable::from_hit(&mut pool, table);
            hit.check(n * bs, window, bs).map_err(TestCaseError::fail)?;
            pool.check().map_err(TestCaseError::fail)?;
        }
    }
}
