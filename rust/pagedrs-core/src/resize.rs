//! Resizing the device pool while serving.

use crate::error::{Error, Result};
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Grows the pool, or shrinks it by moving in-use blocks above `num_blocks` into free low
    /// blocks; the moves ride on the next plan (`block_moves`, applied before its forward).
    pub fn resize(&mut self, num_blocks: usize) -> Result<()> {
        if !self.kv.is_empty() {
            return Err(Error::Resize(format!(
                "resizing the pool is not supported with KV-cache groups beside the full-attention \
                 pool ({})",
                self.kv.names()
            )));
        }
        let old = self.pool.num_blocks();
        if num_blocks == 0 || num_blocks >= u32::MAX as usize {
            return Err(Error::Resize(format!(
                "num_blocks must be in [1, {}), got {num_blocks}",
                u32::MAX
            )));
        }
        if num_blocks >= old {
            self.pool.grow(num_blocks);
        } else {
            let in_use = self.pool.num_used();
            let moves = self.pool.shrink(num_blocks).ok_or(Error::ResizeTooSmall {
                requested: num_blocks,
                in_use,
            })?;
            self.compose_moves(&moves, num_blocks);
            if !moves.is_empty() {
                let mut remap: Vec<u32> = (0..old as u32).collect();
                for &(src, dst) in &moves {
                    remap[src.0 as usize] = dst.0;
                }
                for seq in self.seqs.iter_mut().filter(|s| s.alive) {
                    let mut first = None;
                    for (i, b) in seq.block_table.iter_mut().enumerate() {
                        let to = remap[*b as usize];
                        if to != *b {
                            *b = to;
                            first.get_or_insert(i);
                        }
                    }
                    seq.sync_last_block();
                    // The row is rewritten by the next schedule(), whose plan carries the moves.
                    if let (Some(row), Some(i)) = (seq.row, first) {
                        self.tables.mark(row, i);
                    }
                }
            }
        }
        self.watermark_blocks = self.cfg.watermark_blocks(num_blocks);
        Ok(())
    }

    /// Folds a shrink's moves into the moves not yet handed to a plan, so that every source
    /// names a block as the runner last saw it and every destination appears once. A runner may
    /// apply them all at once by gather-then-scatter (`cache[:, dst] = cache[:, src]`).
    fn compose_moves(&mut self, moves: &[(crate::BlockId, crate::BlockId)], num_blocks: usize) {
        let mut pm: Vec<(i64, i64)> = self
            .pending_moves
            .chunks_exact(2)
            .map(|m| (m[0], m[1]))
            .collect();
        for &(src, dst) in moves {
            let (src, dst) = (i64::from(src.0), i64::from(dst.0));
            // `dst` was free: whatever moved into it earlier is dead.
            pm.retain(|m| m.1 != dst);
            match pm.iter_mut().find(|m| m.1 == src) {
                Some(m) => m.1 = dst,
                None => pm.push((src, dst)),
            }
        }
        // Moves into blocks now cut off (and not moved on) carried data nobody holds any more.
        pm.retain(|m| (m.1 as usize) < num_blocks && m.0 != m.1);
        self.pending_moves = pm.into_iter().flat_map(|(s, d)| [s, d]).collect();
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, NewRequest, Scheduler};

    #[test]
    fn shrink_moves_ride_on_the_next_plan_and_compose() {
        let mut s = Scheduler::new(Config {
            num_blocks: 4,
            block_size: 2,
            ..Config::default()
        })
        .unwrap();
        s.resize(12).unwrap(); // new blocks 4..12 are used first
        let req = NewRequest {
            seq_ids: vec![1],
            prompt_token_ids: vec![3; 5],
            max_tokens: 8,
            ..Default::default()
        };
        s.add_request(req).unwrap();
        let p = s.schedule().unwrap();
        let before: Vec<i32> = s.plan_block_tables(&p).unwrap();
        s.update(p.step_id, &[1]).unwrap();
        s.resize(8).unwrap();
        s.resize(3).unwrap(); // moves compose: each source is a block as the runner last saw it
        let p = s.schedule().unwrap();
        assert_eq!(p.num_blocks, 3);
        assert_eq!(p.changed_rows, vec![0]); // the remapped row is rewritten by this plan
        let tables = s.plan_block_tables(&p).unwrap();
        let moves: Vec<(i64, i64)> = p.block_moves.chunks(2).map(|m| (m[0], m[1])).collect();
        for (i, &b) in before.iter().enumerate() {
            let now = i64::from(tables[i]);
            assert!(now < 3);
            if i64::from(b) != now {
                assert!(moves.contains(&(i64::from(b), now)), "{moves:?}");
            }
        }
        assert!(s.resize(2).is_err());
        s.check_invariants().unwrap();
    }
}
