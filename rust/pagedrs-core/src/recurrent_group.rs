//! Recurrent state as a KV-cache group: the per-sequence state of linear-attention layers (Gated
//! DeltaNet's conv window and delta-rule state), one state slot per sequence from a pool of slots,
//! as vLLM V1's `MambaManager`.
//!
//! A sequence takes a slot at admission and keeps it until it finishes or is preempted (a preempted
//! sequence recomputes from position 0, with a zeroed state). The plan writes the slot as the row's
//! only table entry and as the slot of every position it computes. An `n > 1` fork gives the child
//! a slot of its own and a copy pair (parent, child), which the runner applies after the forward of
//! the plan that forks (that step computes the parent's last prompt chunk). The group keeps no
//! snapshots, so it serves no prefix hit: `longest_hit` is 0 and a sequence always computes its
//! state from the first token.

use crate::block_pool::{BlockPool, CacheItem};
use crate::kv_groups::KvGroup;
use crate::request::{Seq, Status};
use crate::BlockId;

#[derive(Debug)]
pub struct RecurrentGroup {
    /// One pool entry per state slot (its block size is never read).
    pool: BlockPool,
    /// The state slot of each sequence slot (None: it holds none).
    held: Vec<Option<u32>>,
    /// Copy pairs (src, dst) not yet handed to a plan, flattened.
    pending_copies: Vec<i64>,
}

impl RecurrentGroup {
    /// A group of `num_slots` state slots (at least the scheduler's `max_num_seqs`, so a fork
    /// always finds one).
    pub fn new(num_slots: usize) -> Self {
        Self {
            pool: BlockPool::new(num_slots, 1),
            held: Vec::new(),
            pending_copies: Vec::new(),
        }
    }

    /// The state slot `slot` holds.
    pub fn state_slot(&self, slot: u32) -> Option<u32> {
        self.held.get(slot as usize).copied().flatten()
    }

    fn take(&mut self, slot: u32) -> u32 {
        let i = slot as usize;
        if self.held.len() <= i {
            self.held.resize(i + 1, None);
        }
        if let Some(s) = self.held[i] {
            return s;
        }
        let s = self
            .pool
            .allocate()
            .expect("state slots checked before admission")
            .0;
        self.held[i] = Some(s);
        s
    }
}

impl KvGroup for RecurrentGroup {
    fn name(&self) -> String {
        "recurrent".to_string()
    }

    fn pool(&self) -> Option<&BlockPool> {
        Some(&self.pool)
    }

    fn longest_hit(
        &self,
        _max_blocks: usize,
        _chain: &[u64],
        _tokens: &[u32],
    ) -> (usize, Vec<u32>) {
        (0, Vec::new())
    }

    fn admit_cost(&self, _hit: &[u32], _num_tokens: usize) -> usize {
        1
    }

    fn admit(&mut self, slot: u32, _hit: Vec<u32>, _num_tokens: usize) {
        self.take(slot);
    }

    fn grow_cost(&self, slot: u32, _seq: &Seq, _num_tokens: usize) -> usize {
        usize::from(self.state_slot(slot).is_none())
    }

    fn grow(&mut self, slot: u32, _seq: &Seq, _num_tokens: usize) {
        self.take(slot);
    }

    fn fork(&mut self, parent: u32, kid: u32) {
        let Some(src) = self.state_slot(parent) else {
            return;
        };
        let dst = self.take(kid);
        self.pending_copies.extend([i64::from(src), i64::from(dst)]);
    }

    fn cache(&mut self, _items: &[CacheItem], _seqs: &[Seq]) {}

    fn release(&mut self, _slot: u32, _num_computed: usize) {}

    fn truncate(&mut self, _slot: u32, _num_tokens: usize) {}

    fn free(&mut self, slot: u32) {
        if let Some(s) = self.held.get_mut(slot as usize).and_then(Option::take) {
            self.pool.free(BlockId(s));
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
        let at = tables.len();
        tables.resize(at + max_blocks, 0);
        if max_blocks > 0 {
            tables[at] = s as i32;
        }
        slot_mapping.extend((start..end).map(|_| i64::from(s)));
    }

    fn take_copies(&mut self) -> Vec<i64> {
        std::mem::take(&mut self.pending_copies)
    }

    fn reset_prefix_cache(&mut self) -> bool {
        true
    }

    fn blocks_of(&self, slot: u32) -> Vec<u32> {
        self.state_slot(slot).into_iter().collect()
    }

    fn check(&self, seqs: &[Seq]) -> std::result::Result<(), String> {
        self.pool.check()?;
        let mut refs = vec![0u32; self.pool.num_blocks()];
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
            let got = self.pool.ref_count(BlockId(b as u32));
            if got != r {
                return Err(format!(
                    "state slot {b} has ref count {got} but {r} holders"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_taken_forked_and_freed() {
        let mut g = RecurrentGroup::new(3);
        assert_eq!(g.longest_hit(4, &[0; 5], &[0; 16]), (0, Vec::new()));
        g.admit(0, Vec::new(), 10);
        let s0 = g.state_slot(0).unwrap();
        g.fork(0, 1);
        let s1 = g.state_slot(1).unwrap();
        assert_ne!(s0, s1);
        assert_eq!(g.take_copies(), vec![i64::from(s0), i64::from(s1)]);
        assert!(g.take_copies().is_empty(), "copies are handed over once");
        let (mut sm, mut t) = (Vec::new(), Vec::new());
        g.plan_row(1, 3, 5, 2, &mut sm, &mut t);
        assert_eq!((sm, t), (vec![i64::from(s1); 2], vec![s1 as i32, 0]));
        assert_eq!(g.pool().unwrap().num_free(), 1);
        g.free(0);
        g.free(0); // a second free is a no-op
        assert_eq!(g.pool().unwrap().num_free(), 2);
        assert_eq!(g.state_slot(0), None);
    }
}
