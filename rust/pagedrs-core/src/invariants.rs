//! A full consistency check of the scheduler's state (tests and debugging; O(everything)).

use crate::error::{Error, Result};
use crate::request::Status;
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
        self.tables.check(&self.seqs)?;
        self.kv.check(&self.seqs)?;
        let bs = self.cfg.block_size;
        let n = self.pool.num_blocks();
        let mut refs = vec![0u32; n];
        let mut swap_refs = vec![0u32; self.swap.num_blocks()];
        let (mut running, mut width) = (0, 0);
        let mut ids = 0;
        for (slot, seq) in self.seqs.iter().enumerate().filter(|(_, s)| s.alive) {
            let id = seq.seq_id;
            ids += seq.width();
            for &b in &seq.block_table {
                if b as usize >= n {
                    return Err(format!("seq {id} holds block {b} >= pool size {n}"));
                }
                refs[b as usize] += 1;
            }
            for &s in &seq.swap_table {
                swap_refs[s as usize] += 1;
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
            let in_queue = match seq.status {
                Status::Running => {
                    running += 1;
                    width += seq.width();
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
            };
            if !in_queue {
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
        }
        for (b, (&want, got)) in refs.iter().zip(0..).enumerate() {
            let have = self.pool.ref_count(BlockId(got));
            if want != have {
                return Err(format!(
                    "block {b}: ref count {have} but {want} block-table entries"
                ));
            }
        }
        for (s, &want) in swap_refs.iter().enumerate() {
            let have = self.swap.ref_count(s as u32);
            if want != have {
                return Err(format!(
                    "swap block {s}: ref count {have} but {want} swap-table entries"
                ));
            }
        }
        if running != self.running.len() || width != self.num_running_seqs {
            return Err(format!(
                "running list has {} entries / {} seqs counted, found {running} / {width}",
                self.running.len(),
                self.num_running_seqs
            ));
        }
        if ids != self.ids.len() {
            return Err(format!(
                "id map has {} entries, live sequences {ids}",
                self.ids.len()
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
