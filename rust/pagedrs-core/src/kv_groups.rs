//! KV-cache groups beside the primary pool: one manager per kind of layer state behind one trait,
//! [`KvGroup`], and a coordinator over them, [`KvGroups`] (as vLLM V1's `KVCacheCoordinator` over
//! its `SingleTypeKVCacheManager`s).
//!
//! The primary full-attention pool stays in the scheduler: it carries the persistent block table,
//! the size a pool resize names and the chained prefix hashes every group keys its cache by (each
//! group's pool records its own prefix-cache events, [`KvGroups::take_kv_events`]). Each group
//! here holds the state of some other layers in a pool of its own, with its own
//! per-sequence tables and its own prefix-cache rule. The scheduler calls the coordinator at each
//! point where it changes a sequence's primary table, and never learns which kinds exist:
//!
//! | scheduler point                        | coordinator call                          |
//! |----------------------------------------|-------------------------------------------|
//! | admission with a prefix hit            | `cap_hit`, `fits_admit`, `admit`          |
//! | growth before a step                   | `fits`, `grow` (else the scheduler preempts) |
//! | the plan                               | `plan_tables` (each group's `plan_row`s)  |
//! | `update()`                             | `cache` newly full blocks, `release` at the committed position |
//! | speculative rollback                   | `truncate`                                |
//! | finish, abort, recompute preemption    | `free`                                    |
//! | swap preemption, swap back in          | `can_swap_out`, `swap_out`; `fits_swap_in`, `swap_in` |
//! | `n > 1` fork                           | `fork`                                    |
//! | pool resize                            | `resize_targets`, `check_resize`, `resize` |
//!
//! A request's prefix hit is the longest prefix every group can serve: the primary pool's hit,
//! capped by each group in turn until none caps it further ([`KvGroups::cap_hit`]).
//!
//! # Adding a kind of layer state
//! Implement [`KvGroup`] and add it with `Scheduler::add_kv_group`; nothing in the scheduler
//! changes. Two kinds this trait is shaped for:
//! - **Recurrent state** (linear-attention or Mamba layers): one state slot per sequence from a
//!   pool of slots. `admit` takes a slot (or the snapshot slot of a hit), `grow_cost` is 0 once the
//!   sequence holds its slot, `plan_row` writes the slot as the row's only table entry and as
//!   every position's slot, `truncate` restores nothing (a rollback must keep a pre-draft copy:
//!   `take_copies` hands the copy pairs over), `release` is a no-op. For the prefix cache, `cache`
//!   keeps a snapshot slot of the state at each newly full block (keyed by the block's hash), and
//!   `longest_hit` returns the last block boundary `<= max_blocks` holding a snapshot.
//! - **Shared KV** (layers reading another layer's KV and owning nothing): `pool()` is `None`,
//!   every cost is 0, `longest_hit` returns `max_blocks`, `plan_row` writes nothing (the runner
//!   reads the owning group's tables).

use crate::block_pool::{BlockPool, CacheItem};
use crate::kv_events::KvEvents;
use crate::request::Seq;

/// One kind of layer state: its pool, its per-sequence tables (indexed by sequence slot) and its
/// prefix-cache rule. Sizes are in tokens; `hit` tables are what [`KvGroup::longest_hit`] returned.
pub trait KvGroup: std::fmt::Debug + Send {
    /// A short name for logs and metrics, e.g. `window:4096`.
    fn name(&self) -> String;
    /// The sliding window of the group's layers (None: they attend to the whole context).
    fn window(&self) -> Option<usize> {
        None
    }
    /// The group's own pool (None for a group that allocates nothing).
    fn pool(&self) -> Option<&BlockPool>;
    /// The pool whose prefix cache the group keeps (its own pool, a recurrent group's snapshot
    /// pool), to record its prefix-cache events ([`KvGroups::set_kv_events`]).
    fn pool_mut(&mut self) -> Option<&mut BlockPool> {
        None
    }
    /// The longest prefix-cache hit, in blocks, at most `max_blocks`, this group can serve, and
    /// the group's table for it. `chain[i + 1]` is the hash of block `i` (chained from `chain[0]`),
    /// `tokens` the sequence's tokens (at least `max_blocks` full blocks).
    fn longest_hit(&self, max_blocks: usize, chain: &[u64], tokens: &[u32]) -> (usize, Vec<u32>);
    /// Free blocks that admitting a sequence with `hit` to `num_tokens` tokens takes (new blocks,
    /// and cached blocks of the hit that are free now).
    fn admit_cost(&self, hit: &[u32], num_tokens: usize) -> usize;
    /// Admits sequence `slot` with `hit`, grown to `num_tokens` tokens (checked with `admit_cost`).
    fn admit(&mut self, slot: u32, hit: Vec<u32>, num_tokens: usize);
    /// Free blocks sequence `slot` (in state `seq`) takes to reach `num_tokens` tokens, a
    /// copy-on-write of a block shared with a forked sibling included.
    fn grow_cost(&self, slot: u32, seq: &Seq, num_tokens: usize) -> usize;
    /// Grows `slot` to `num_tokens` tokens (checked with `grow_cost`); called before the primary
    /// pool's allocation, which clears `seq.shared_tail`.
    fn grow(&mut self, slot: u32, seq: &Seq, num_tokens: usize);
    /// A forked child `kid` shares the state of `parent`.
    fn fork(&mut self, parent: u32, kid: u32);
    /// Offers the group's blocks at the primary pool's newly full `items` to its prefix cache.
    fn cache(&mut self, items: &[CacheItem], seqs: &[Seq]);
    /// After `update()`: `slot` is committed at `num_computed` tokens (drafts excluded).
    fn release(&mut self, slot: u32, num_computed: usize);
    /// Drops what `slot` holds past `num_tokens` tokens (a speculative rollback).
    fn truncate(&mut self, slot: u32, num_tokens: usize);
    /// Frees everything `slot` holds (finish, abort, preemption).
    fn free(&mut self, slot: u32);
    /// Appends batch row `slot`'s table (`max_blocks` entries, padded with 0) to `tables` and the
    /// slots of positions `start..end` to `slot_mapping`.
    fn plan_row(
        &self,
        slot: u32,
        start: usize,
        end: usize,
        max_blocks: usize,
        slot_mapping: &mut Vec<i64>,
        tables: &mut Vec<i32>,
    );
    /// Whether the group's swap pool can take what `slot` holds (false: a preempted sequence is
    /// recomputed instead of swapped, as by default: a group swaps only if it implements it).
    fn can_swap_out(&self, _slot: u32) -> bool {
        false
    }
    /// Moves what `slot` holds to the group's swap pool (checked with `can_swap_out`), appending
    /// (device, swap) pairs; entries the group no longer held stay empty.
    fn swap_out(&mut self, _slot: u32, _pairs: &mut Vec<i64>) {}
    /// Free blocks that bringing `slot` back from the swap pool and growing it to `num_tokens`
    /// tokens takes.
    fn swap_in_cost(&self, _slot: u32, _num_tokens: usize) -> usize {
        0
    }
    /// Brings `slot` back from the swap pool (checked with `swap_in_cost`), appending (swap,
    /// device) pairs, and grows it to `num_tokens` tokens.
    fn swap_in(&mut self, _slot: u32, _num_tokens: usize, _pairs: &mut Vec<i64>) {}
    /// Copy pairs (src, dst), flattened, to apply to the group's blocks before the next forward;
    /// handed over once.
    fn take_copies(&mut self) -> Vec<i64>;
    /// The size of the group's pool once the primary pool, `base` blocks at start, is resized to
    /// `num_blocks` (None: the group keeps its size, as it does by default).
    fn resize_target(&self, _base: usize, _num_blocks: usize) -> Option<usize> {
        None
    }
    /// Resizes the group's pool to `num_blocks` (its blocks in use fit, checked by the caller),
    /// moving in-use blocks past the end into free low blocks and rewriting its tables; the moves
    /// ride on the next plan ([`KvGroup::take_moves`]), applied before any other block op.
    fn resize(&mut self, _num_blocks: usize) {}
    /// Block moves (src, dst) of resizes since the last plan, flattened; handed over once.
    fn take_moves(&mut self) -> Vec<i64> {
        Vec::new()
    }
    /// Drops the group's prefix cache; false (nothing done) while anything is in use.
    fn reset_prefix_cache(&mut self) -> bool;
    /// The group's entries for `slot` ([`crate::sliding_window::NULL_BLOCK`] where it holds
    /// nothing any more), for inspection; empty for a group without per-sequence blocks.
    fn blocks_of(&self, _slot: u32) -> Vec<u32> {
        Vec::new()
    }
    /// The group's invariants against the scheduler's sequences (indexed by slot).
    fn check(&self, seqs: &[Seq]) -> Result<(), String>;
}

/// Every group's arrays of one step plan (the plan's `group_*` fields).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GroupTables {
    /// `[G, T]` flattened.
    pub slot_mapping: Vec<i64>,
    /// `[G, B, max_blocks]` flattened, padded with 0.
    pub block_tables: Vec<i32>,
    /// Copy-on-write pairs, flattened over groups in order.
    pub copies: Vec<i64>,
    /// `[G]`: pairs of each group.
    pub num_copies: Vec<i32>,
    /// `(group, src, dst)` block moves of resizes, flattened.
    pub moves: Vec<i64>,
    /// `[G]`: each group's pool size (0 for a group without a pool).
    pub num_blocks: Vec<i64>,
}

/// Usage of one group's pool, as `Scheduler::kv_group_stats` reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupStats {
    pub name: String,
    pub window: Option<usize>,
    pub num_blocks: usize,
    pub num_free_blocks: usize,
    pub kv_usage: f64,
}

/// The coordinator: every group, in the order they were added (the plan's group index).
#[derive(Debug, Default)]
pub struct KvGroups {
    groups: Vec<Box<dyn KvGroup>>,
}

impl KvGroups {
    pub fn push(&mut self, group: Box<dyn KvGroup>) {
        self.groups.push(group);
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn get(&self, i: usize) -> Option<&dyn KvGroup> {
        self.groups.get(i).map(|g| g.as_ref())
    }

    pub fn iter(&self) -> impl Iterator<Item = &dyn KvGroup> {
        self.groups.iter().map(|g| g.as_ref())
    }

    pub fn stats(&self) -> Vec<GroupStats> {
        self.iter()
            .map(|g| {
                let (n, free, usage) = g
                    .pool()
                    .map_or((0, 0, 0.0), |p| (p.num_blocks(), p.num_free(), p.usage()));
                GroupStats {
                    name: g.name(),
                    window: g.window(),
                    num_blocks: n,
                    num_free_blocks: free,
                    kv_usage: usage,
                }
            })
            .collect()
    }

    /// The longest hit, in blocks, at most `max_blocks`, that every group can serve, and each
    /// group's table for it. A group may cap the hit below what another served; the others are
    /// asked again until no group caps it (the hit only shrinks, so this ends).
    pub fn cap_hit(
        &self,
        max_blocks: usize,
        chain: &[u64],
        tokens: &[u32],
    ) -> (usize, Vec<Vec<u32>>) {
        let mut n = max_blocks;
        'ask: loop {
            let mut tables = Vec::with_capacity(self.groups.len());
            for g in &self.groups {
                let (m, table) = g.longest_hit(n, chain, tokens);
                debug_assert!(m <= n, "{} served {m} blocks of {n}", g.name());
                if m < n {
                    n = m;
                    continue 'ask;
                }
                tables.push(table);
            }
            return (n, tables);
        }
    }

    /// Whether every group has the free blocks to admit a sequence with `hits` (one per group)
    /// to `num_tokens` tokens.
    pub fn fits_admit(&self, hits: &[Vec<u32>], num_tokens: usize) -> bool {
        self.groups.iter().enumerate().all(|(i, g)| {
            let hit = hits.get(i).map_or(&[][..], Vec::as_slice);
            let free = g.pool().map_or(usize::MAX, BlockPool::num_free);
            g.admit_cost(hit, num_tokens) <= free
        })
    }

    pub fn admit(&mut self, slot: u32, hits: Vec<Vec<u32>>, num_tokens: usize) {
        let mut hits = hits.into_iter();
        for g in &mut self.groups {
            g.admit(slot, hits.next().unwrap_or_default(), num_tokens);
        }
    }

    /// Whether every group has the free blocks for `slot` to reach `num_tokens` tokens.
    pub fn fits(&self, slot: u32, seq: &Seq, num_tokens: usize) -> bool {
        self.groups.iter().all(|g| {
            let free = g.pool().map_or(usize::MAX, BlockPool::num_free);
            g.grow_cost(slot, seq, num_tokens) <= free
        })
    }

    pub fn grow(&mut self, slot: u32, seq: &Seq, num_tokens: usize) {
        for g in &mut self.groups {
            g.grow(slot, seq, num_tokens);
        }
    }

    pub fn fork(&mut self, parent: u32, kid: u32) {
        for g in &mut self.groups {
            g.fork(parent, kid);
        }
    }

    pub fn cache(&mut self, items: &[CacheItem], seqs: &[Seq]) {
        for g in &mut self.groups {
            g.cache(items, seqs);
        }
    }

    pub fn release(&mut self, slot: u32, num_computed: usize) {
        for g in &mut self.groups {
            g.release(slot, num_computed);
        }
    }

    pub fn truncate(&mut self, slot: u32, num_tokens: usize) {
        for g in &mut self.groups {
            g.truncate(slot, num_tokens);
        }
    }

    pub fn free(&mut self, slot: u32) {
        for g in &mut self.groups {
            g.free(slot);
        }
    }

    /// Whether every group can swap `slot` out.
    pub fn can_swap_out(&self, slot: u32) -> bool {
        self.groups.iter().all(|g| g.can_swap_out(slot))
    }

    /// Swaps `slot` out of every group, appending (group, device block, swap block) triples.
    pub fn swap_out(&mut self, slot: u32, triples: &mut Vec<i64>) {
        for (i, g) in self.groups.iter_mut().enumerate() {
            let mut pairs = Vec::new();
            g.swap_out(slot, &mut pairs);
            triples.extend(pairs.chunks(2).flat_map(|p| [i as i64, p[0], p[1]]));
        }
    }

    /// Whether every group has the free blocks to swap `slot` in and grow it to `num_tokens`.
    pub fn fits_swap_in(&self, slot: u32, num_tokens: usize) -> bool {
        self.groups.iter().all(|g| {
            let free = g.pool().map_or(usize::MAX, BlockPool::num_free);
            g.swap_in_cost(slot, num_tokens) <= free
        })
    }

    /// Swaps `slot` into every group, grown to `num_tokens` tokens, appending (group, swap block,
    /// device block) triples.
    pub fn swap_in(&mut self, slot: u32, num_tokens: usize, triples: &mut Vec<i64>) {
        for (i, g) in self.groups.iter_mut().enumerate() {
            let mut pairs = Vec::new();
            g.swap_in(slot, num_tokens, &mut pairs);
            triples.extend(pairs.chunks(2).flat_map(|p| [i as i64, p[0], p[1]]));
        }
    }

    /// Every group's tables and slot mapping of a plan whose batch rows are `rows` (slot, first
    /// position, end position), each group's `[T]` slots then `[B, max_blocks]` tables, and each
    /// group's copy-on-write pairs (handed over once).
    pub fn plan_tables(&mut self, rows: &[(u32, usize, usize)], max_blocks: usize) -> GroupTables {
        let mut out = GroupTables {
            num_copies: Vec::with_capacity(self.groups.len()),
            num_blocks: Vec::with_capacity(self.groups.len()),
            ..Default::default()
        };
        for (i, g) in self.groups.iter_mut().enumerate() {
            let moves = g.take_moves();
            out.moves
                .extend(moves.chunks(2).flat_map(|m| [i as i64, m[0], m[1]]));
            out.num_blocks
                .push(g.pool().map_or(0, |p| p.num_blocks() as i64));
            for &(slot, start, end) in rows {
                g.plan_row(
                    slot,
                    start,
                    end,
                    max_blocks,
                    &mut out.slot_mapping,
                    &mut out.block_tables,
                );
            }
            let copies = g.take_copies();
            out.num_copies.push((copies.len() / 2) as i32);
            out.copies.extend(copies);
        }
        out
    }

    /// Each group's pool size once the primary pool, `base` blocks at start, is resized to
    /// `num_blocks` (None: unchanged).
    pub fn resize_targets(&self, base: usize, num_blocks: usize) -> Vec<Option<usize>> {
        self.iter()
            .map(|g| g.resize_target(base, num_blocks))
            .collect()
    }

    /// Whether each group's blocks in use fit its `targets` size; the error names the numbers.
    pub fn check_resize(&self, targets: &[Option<usize>]) -> Result<(), String> {
        for (g, t) in self.iter().zip(targets) {
            if let (Some(t), Some(p)) = (*t, g.pool()) {
                if p.num_used() > t {
                    return Err(format!(
                        "the {} group's pool cannot shrink from {} to {t} blocks: {} are in use",
                        g.name(),
                        p.num_blocks(),
                        p.num_used()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Resizes each group's pool to its target (checked with `check_resize`).
    pub fn resize(&mut self, targets: &[Option<usize>]) {
        for (g, t) in self.groups.iter_mut().zip(targets) {
            if let Some(t) = *t {
                g.resize(t);
            }
        }
    }

    /// Starts (an empty log) or stops recording every group pool's prefix-cache events.
    pub fn set_kv_events(&mut self, on: bool) {
        for p in self.groups.iter_mut().filter_map(|g| g.pool_mut()) {
            p.set_kv_events(on);
        }
    }

    /// Each group's prefix-cache events since the last call, in group order (empty for a group
    /// without a pool, or while recording is off).
    pub fn take_kv_events(&mut self) -> Vec<KvEvents> {
        self.groups
            .iter_mut()
            .map(|g| {
                g.pool_mut()
                    .map_or_else(KvEvents::default, BlockPool::take_kv_events)
            })
            .collect()
    }

    /// Whether no group holds anything in use.
    pub fn is_idle(&self) -> bool {
        self.iter()
            .all(|g| g.pool().is_none_or(|p| p.num_used() == 0))
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        self.groups.iter_mut().all(|g| g.reset_prefix_cache())
    }

    pub fn check(&self, seqs: &[Seq]) -> Result<(), String> {
        for g in &self.groups {
            g.check(seqs)
                .map_err(|e| format!("group {}: {e}", g.name()))?;
        }
        Ok(())
    }

    /// Names of every group, comma-separated (for messages).
    pub fn names(&self) -> String {
        self.iter().map(|g| g.name()).collect::<Vec<_>>().join(", ")
    }
}

#[cfg(test)]
mod tests;
