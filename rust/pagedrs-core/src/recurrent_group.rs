//! Recurrent state as a KV-cache group: the per-sequence state of linear-attention layers (Gated
//! DeltaNet's conv window and delta-rule state), one live state slot per sequence from a pool of
//! slots, as vLLM V1's `MambaManager`, and snapshots of the state at block boundaries for exact
//! prefix caching.
//!
//! A sequence takes a live slot at admission and keeps it until it finishes or is preempted (a
//! preempted sequence recomputes from its prefix hit, or from position 0 with a zeroed state). An
//! `n > 1` fork gives the child a slot of its own and a copy pair (parent, child), which the runner
//! applies after the forward of the plan that forks (that step computes the parent's last prompt
//! chunk).
//!
//! Snapshots: before a step, every block boundary the sequence's step crosses gets a snapshot slot
//! from a pool of its own (the least recently used cached snapshot is evicted when none is free;
//! with none at all, that boundary keeps no snapshot). The plan writes it as the slot of the
//! block's last token (-1 elsewhere): the runner copies the state there once that token is
//! computed. When the primary pool offers the full block to the prefix cache, the snapshot is
//! cached under the same block hash (unused snapshots are freed at the step's release). A prefix
//! hit is the last block boundary, at most the primary pool's hit, holding a snapshot; the
//! admitted sequence's first plan names it (the row's second table entry, plus 1; 0: none) and
//! the runner restores the live slot from it before the forward.
//!
//! Slot ids in the plan: live slots `0..num_live`, snapshot `s` is `num_live + s`.

use crate::block_pool::{BlockPool, CacheItem};
use crate::kv_groups::KvGroup;
use crate::request::{Seq, Status};
use crate::BlockId;

#[derive(Debug)]
pub struct RecurrentGroup {
    /// One entry per live state slot.
    live: BlockPool,
    /// Snapshot slots, cached by the hash of the block they end.
    snaps: BlockPool,
    block_size: usize,
    /// Per sequence slot: its live slot.
    held: Vec<Option<u32>>,
    /// Per sequence slot: (block index, snapshot) taken for the step, until cached or released.
    pending: Vec<Vec<(u32, u32)>>,
    /// Per sequence slot: the snapshot its next plan restores (a reference held).
    restore: Vec<Option<u32>>,
    /// Per sequence slot: the snapshot a plan restores (a reference held until the release).
    restoring: Vec<Option<u32>>,
    /// Copy pairs (src, dst) not yet handed to a plan, flattened.
    pending_copies: Vec<i64>,
}

fn at<T: Default + Clone>(v: &mut Vec<T>, i: u32) -> &mut T {
    let i = i as usize;
    if v.len() <= i {
        v.resize(i + 1, T::default());
    }
    &mut v[i]
}

impl RecurrentGroup {
    /// A group of `num_live` live slots (at least the scheduler's `max_num_seqs`, so a fork always
    /// finds one) and `num_snapshots` snapshot slots (0: no prefix caching of the state).
    pub fn new(num_live: usize, num_snapshots: usize, block_size: usize) -> Self {
        Self {
            live: BlockPool::new(num_live, 1),
            snaps: BlockPool::new(num_snapshots, block_size),
            block_size,
            held: Vec::new(),
            pending: Vec::new(),
            restore: Vec::new(),
            restoring: Vec::new(),
            pending_copies: Vec::new(),
        }
    }

    /// The live slot `slot` holds.
    pub fn state_slot(&self, slot: u32) -> Option<u32> {
        self.held.get(slot as usize).copied().flatten()
    }

    /// The snapshot pool (for inspection).
    pub fn snapshots(&self) -> &BlockPool {
        &self.snaps
    }

    fn take(&mut self, slot: u32) -> u32 {
        if let Some(s) = self.state_slot(slot) {
            return s;
        }
        let s = self
            .live
            .allocate()
            .expect("state slots checked before admission")
            .0;
        *at(&mut self.held, slot) = Some(s);
        s
    }

    /// Snapshot slots for the block boundaries in `(from, to]` tokens not yet given one.
    fn take_snapshots(&mut self, slot: u32, from: usize, to: usize) {
        let bs = self.block_size;
        for b in (from / bs + 1)..=(to / bs) {
            let idx = (b - 1) as u32;
            if at(&mut self.pending, slot).iter().any(|&(i, _)| i == idx) {
                continue;
            }
            let Some(s) = self.snaps.allocate() else {
                return;
            };
            self.pending[slot as usize].push((idx, s.0));
        }
    }

    fn drop_refs(&mut self, slot: u32, all: bool) {
        if let Some(s) = self.restoring.get_mut(slot as usize).and_then(Option::take) {
            self.snaps.free(BlockId(s));
        }
        if all {
            if let Some(s) = self.restore.get_mut(slot as usize).and_then(Option::take) {
                self.snaps.free(BlockId(s));
            }
        }
        if let Some(p) = self.pending.get_mut(slot as usize) {
            for (_, s) in p.drain(..) {
                self.snaps.free(BlockId(s));
            }
        }
    }
}

impl KvGroup for RecurrentGroup {
    fn name(&self) -> String {
        "recurrent".to_string()
    }

    fn pool(&self) -> Option<&BlockPool> {
        Some(&self.live)
    }

    /// The snapshot pool: the one whose prefix cache the group keeps (its events are the group's).
    fn pool_mut(&mut self) -> Option<&mut BlockPool> {
        Some(&mut self.snaps)
    }

    fn longest_hit(&self, max_blocks: usize, chain: &[u64], tokens: &[u32]) -> (usize, Vec<u32>) {
        let bs = self.block_size;
        for i in (1..=max_blocks).rev() {
            if let Some(b) =
                self.snaps
                    .lookup(chain[i], chain[i - 1], &tokens[(i - 1) * bs..i * bs])
            {
                return (i, vec![b.0; i]);
            }
        }
        (0, Vec::new())
    }

    fn admit_cost(&self, _hit: &[u32], _num_tokens: usize) -> usize {
        1
    }

    fn admit(&mut self, slot: u32, hit: Vec<u32>, num_tokens: usize) {
        self.take(slot);
        if let Some(&s) = hit.last() {
            self.snaps.incref(BlockId(s));
            *at(&mut self.restore, slot) = Some(s);
        }
        self.take_snapshots(slot, hit.len() * self.block_size, num_tokens);
    }

    fn grow_cost(&self, slot: u32, _seq: &Seq, _num_tokens: usize) -> usize {
        usize::from(self.state_slot(slot).is_none())
    }

    fn grow(&mut self, slot: u32, seq: &Seq, num_tokens: usize) {
        self.take(slot);
        self.take_snapshots(slot, seq.num_computed, num_tokens);
    }

    fn fork(&mut self, parent: u32, kid: u32) {
        let Some(src) = self.state_slot(parent) else {
            return;
        };
        let dst = self.take(kid);
        self.pending_copies.extend([i64::from(src), i64::from(dst)]);
    }

    fn cache(&mut self, items: &[CacheItem], seqs: &[Seq]) {
        let bs = self.block_size;
        for it in items {
            let Some(p) = self.pending.get_mut(it.slot as usize) else {
                continue;
            };
            let Some(k) = p.iter().position(|&(i, _)| i == it.idx) else {
                continue;
            };
            let (_, s) = p.swap_remove(k);
            let i = it.idx as usize * bs;
            let toks = &seqs[it.slot as usize].tokens[i..i + bs];
            // A hash already cached keeps its snapshot; this one is freed uncached.
            self.snaps.cache_block(BlockId(s), it.hash, it.parent, toks);
            self.snaps.free(BlockId(s));
        }
    }

    fn release(&mut self, slot: u32, _num_computed: usize) {
        self.drop_refs(slot, false);
    }

    fn truncate(&mut self, _slot: u32, _num_tokens: usize) {}

    fn free(&mut self, slot: u32) {
        self.drop_refs(slot, true);
        if let Some(s) = self.held.get_mut(slot as usize).and_then(Option::take) {
            self.live.free(BlockId(s));
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
        let s = self
            .state_slot(slot)
            .unwrap_or_else(|| panic!("slot {slot} is planned without a state slot"));
        let num_live = self.live.num_blocks() as i64;
        let at = tables.len();
        tables.resize(at + max_blocks, 0);
        if max_blocks > 0 {
            tables[at] = s as i32;
        }
        // A hit needs a full block before the last token, so a one-block context never restores.
        if let (Some(r), true) = (
            self.restore.get(slot as usize).copied().flatten(),
            max_blocks > 1,
        ) {
            tables[at + 1] = (num_live + i64::from(r) + 1) as i32;
        }
        let pending = self.pending.get(slot as usize);
        let bs = self.block_size;
        slot_mapping.extend((start..end).map(|p| {
            if (p + 1) % bs != 0 {
                return -1;
            }
            let idx = ((p + 1) / bs - 1) as u32;
            pending
                .and_then(|v| v.iter().find(|&&(i, _)| i == idx))
                .map_or(-1, |&(_, snap)| num_live + i64::from(snap))
        }));
    }

    fn take_copies(&mut self) -> Vec<i64> {
        for i in 0..self.restore.len() {
            if let Some(s) = self.restore[i].take() {
                *at(&mut self.restoring, i as u32) = Some(s);
            }
        }
        std::mem::take(&mut self.pending_copies)
    }

    fn reset_prefix_cache(&mut self) -> bool {
        self.snaps.reset_prefix_cache()
    }

    fn blocks_of(&self, slot: u32) -> Vec<u32> {
        self.state_slot(slot).into_iter().collect()
    }

    fn check(&self, seqs: &[Seq]) -> std::result::Result<(), String> {
        self.live.check()?;
        self.snaps.check()?;
        let mut refs = vec![0u32; self.live.num_blocks()];
        for (slot, s) in self.held.iter().enumerate() {
            let running = seqs
                .get(slot)
                .is_some_and(|q| q.alive && q.status == Status::Running);
            match (s, running) {
                (Some(s), true) => refs[*s as usize] += 1,
                (Some(_), false) => {
                    return Err(format!("slot {slot} not running holds a state slot"))
                }
                (None, true) => return Err(format!("running slot {slot} holds no state slot")),
                (None, false) => {}
            }
        }
        for (b, &r) in refs.iter().enumerate() {
            let got = self.live.ref_count(BlockId(b as u32));
            if got != r {
                return Err(format!(
                    "state slot {b} has ref count {got} but {r} holders"
                ));
            }
        }
        let mut snap_refs = vec![0u32; self.snaps.num_blocks()];
        let held = self.pending.iter().flatten().map(|&(_, s)| s);
        let restores = self
            .restore
            .iter()
            .chain(&self.restoring)
            .flatten()
            .copied();
        for s in held.chain(restores) {
            snap_refs[s as usize] += 1;
        }
        for (b, &r) in snap_refs.iter().enumerate() {
            let got = self.snaps.ref_count(BlockId(b as u32));
            if got != r {
                return Err(format!("snapshot {b} has ref count {got} but {r} holders"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
