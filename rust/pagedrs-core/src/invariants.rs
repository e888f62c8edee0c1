//! A full consistency check of the scheduler's state (tests and debugging; O(everything)).

use crate::error::{Error, Result};
use crate::request::{Seq, Status};
use crate::scheduler::Scheduler;
use crate::BlockId;

impl Scheduler {
    /// Checks every structural invariant; the error names the first violation found.
    pub fn check_invariants(&self) -> Result<()> {
        self.check().map_err(Error::Invariant)
    }

    fn check(&self) -> std::result::Result<(), String> {
        self.pool.check()?;
        self.swap.check()?;
        self.tier.check()?;
        self.tables.check(&self.seqs)?;
        self.kv.check(&self.seqs)?;
        let mut tally = Tally {
            refs: vec![0; self.pool.num_blocks()],
            swap_refs: vec![0; self.swap.num_blocks()],
            ..Tally::default()
        };
        for (slot, seq) in self.seqs.iter().enumerate().filter(|(_, s)| s.alive) {
            self.check_seq(slot, seq, &mut tally)?;
        }
        self.check_ref_counts(&tally)?;
        self.check_queues(&tally)
    }

    /// One live sequence: its blocks, status, queue, cached contents and id mapping (counted in `tally`).
    fn check_seq(
        &self,
        slot: usize,
        seq: &Seq,
        tally: &mut Tally,
    ) -> std::result::Result<(), String> {
        let (id, bs, n) = (seq.seq_id, self.cfg.block_size, self.pool.num_blocks());
        tally.ids += seq.width();
        for &b in &seq.block_table {
            if b as usize >= n {
                return Err(format!("seq {id} holds block {b} >= pool size {n}"));
            }
            tally.refs[b as usize] += 1;
        }
        for &s in &seq.swap_table {
            tally.swap_refs[s as usize] += 1;
        }
        if seq.row.is_some() != (seq.status == Status::Running) {
            return Err(format!(
                "seq {id} ({:?}) has block-table row {:?}",
                seq.status, seq.row
            ));
        }
        if seq.last_block != seq.block_table.last().copied().unwrap_or(0) {
            return Err(format!(
                "seq {id}: last_block {} is not its last block",
                seq.last_block
            ));
        }
        if !self.in_its_queue(slot, seq, tally)? {
            return Err(format!("seq {id} ({:?}) is not in its queue", seq.status));
        }
        if seq.status != Status::Swapped && !seq.swap_table.is_empty() {
            return Err(format!("seq {id} holds swap blocks while {:?}", seq.status));
        }
        // Cached blocks a sequence reads hold exactly its tokens (prefix hits included).
        for (i, &b) in seq
            .block_table
            .iter()
            .enumerate()
            .take(seq.num_computed / bs)
        {
            let b = BlockId(b);
            if self.pool.is_cached(b)
                && self.pool.cache().tokens_of(b) != &seq.tokens[i * bs..(i + 1) * bs]
            {
                return Err(format!(
                    "seq {id} block {i} (pool block {}) caches other tokens",
                    b.0
                ));
            }
        }
        match self.ids.get(&id) {
            Some(r) if r.slot as usize == slot && !r.child => {}
            _ => return Err(format!("seq {id} is not mapped to slot {slot}")),
        }
        for &(c, _) in &seq.children {
            match self.ids.get(&c) {
                Some(r) if r.slot as usize == slot && r.child => {}
                _ => return Err(format!("child {c} of seq {id} is not mapped")),
            }
        }
        Ok(())
    }

    /// Whether `seq` is in the queue of its status (its blocks checked against the status).
    fn in_its_queue(
        &self,
        slot: usize,
        seq: &Seq,
        tally: &mut Tally,
    ) -> std::result::Result<bool, String> {
        let (id, bs) = (seq.seq_id, self.cfg.block_size);
        Ok(match seq.status {
            Status::Running => {
                tally.running += 1;
                tally.width += seq.width();
                if seq.block_table.len() < seq.num_computed.div_ceil(bs) {
                    return Err(format!(
                        "running seq {id}: {} blocks cannot hold {} computed tokens",
                        seq.block_table.len(),
                        seq.num_computed
                    ));
                }
                self.running.contains(&(slot as u32))
            }
            Status::Waiting => {
                if !seq.block_table.is_empty() || seq.num_computed != 0 {
                    return Err(format!("waiting seq {id} holds blocks or computed tokens"));
                }
                self.waiting.contains(&(seq.key, slot as u32))
            }
            Status::Swapped => {
                if !seq.block_table.is_empty()
                    || seq.swap_table.len() < seq.num_computed.div_ceil(bs)
                {
                    return Err(format!("swapped seq {id} has a bad block table"));
                }
                self.swapped.contains(&(seq.key, slot as u32))
            }
        })
    }

    fn check_ref_counts(&self, tally: &Tally) -> std::result::Result<(), String> {
        for (b, (&want, got)) in tally.refs.iter().zip(0..).enumerate() {
            let have = self.pool.ref_count(BlockId(got));
            if want != have {
                return Err(format!(
                    "block {b}: ref count {have} but {want} block-table entries"
                ));
            }
        }
        for (s, &want) in tally.swap_refs.iter().enumerate() {
            let have = self.swap.ref_count(s as u32);
            if want != have {
                return Err(format!(
                    "swap block {s}: ref count {have} but {want} swap-table entries"
                ));
            }
        }
        Ok(())
    }

    fn check_queues(&self, tally: &Tally) -> std::result::Result<(), String> {
        if tally.running != self.running.len() || tally.width != self.num_running_seqs {
            return Err(format!(
                "running list has {} entries / {} seqs counted, found {} / {}",
                self.running.len(),
                self.num_running_seqs,
                tally.running,
                tally.width
            ));
        }
        if tally.ids != self.ids.len() {
            return Err(format!(
                "id map has {} entries, live sequences {}",
                self.ids.len(),
                tally.ids
            ));
        }
        let keys: Vec<_> = self
            .running
            .iter()
            .map(|&s| self.seqs[s as usize].key)
            .collect();
        if keys.windows(2).any(|w| w[0] >= w[1]) {
            return Err("running list is not sorted by (priority, arrival)".into());
        }
        if self.num_running_seqs > self.cfg.max_num_seqs {
            return Err(format!(
                "{} running sequences exceed max_num_seqs {}",
                self.num_running_seqs, self.cfg.max_num_seqs
            ));
        }
        Ok(())
    }
}

/// What the per-sequence checks count, compared with the pools and queues afterwards.
#[derive(Default)]
struct Tally {
    refs: Vec<u32>,
    swap_refs: Vec<u32>,
    running: usize,
    width: usize,
    ids: usize,
}

#[cfg(test)]
mod tests {
    use crate::{BlockId, Config, NewRequest, Scheduler};

    #[test]
    fn detects_a_leaked_reference() {
        let mut s = Scheduler::new(Config {
            num_blocks: 4,
            block_size: 2,
            ..Config::default()
        })
        .unwrap();
        let req = NewRequest {
            seq_ids: vec![1],
            prompt_token_ids: vec![3; 3],
            max_tokens: 2,
            ..Default::default()
        };
        s.add_request(req).unwrap();
        let p = s.schedule().unwrap();
        s.check_invariants().unwrap();
        s.pool
            .incref(BlockId(s.plan_block_tables(&p).unwrap()[0] as u32));
        let e = s.check_invariants().unwrap_err().to_string();
        assert!(e.contains("ref count 2 but 1"), "{e}");
    }
}
