//! Resizing the device pool while serving, and with it every KV-cache group's pool by its own rule
//! ([`crate::kv_groups::KvGroup::resize_target`]: a paged group in proportion to the primary pool,
//! a recurrent group's state slots and a group without a pool not at all).

use crate::error::{Error, Result};
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Grows the pool, or shrinks it by moving in-use blocks above `num_blocks` into free low
    /// blocks; the moves ride on the next plan (`block_moves`, applied before its forward). Each
    /// KV-cache group's pool is resized with it, its moves on the same plan (`group_block_moves`);
    /// an error, and nothing resized, when the blocks in use of any pool do not fit.
    pub fn resize(&mut self, num_blocks: usize) -> Result<()> {
        let old = self.pool.num_blocks();
        if num_blocks == 0 || num_blocks >= u32::MAX as usize {
            return Err(Error::Resize(format!(
                "num_blocks must be in [1, {}), got {num_blocks}",
                u32::MAX
            )));
        }
        // Every pool is checked before any changes: a refused resize leaves them all as they were.
        let in_use = self.pool.num_used();
        if in_use > num_blocks {
            return Err(Error::ResizeTooSmall {
                requested: num_blocks,
                in_use,
            });
        }
        let targets = self.kv.resize_targets(self.cfg.num_blocks, num_blocks);
        self.kv
            .check_resize(&targets)
            .map_err(|e| Error::Resize(format!("{e} (the primary pool to {num_blocks} blocks)")))?;
        self.kv.resize(&targets);
        if num_blocks >= old {
            self.pool.grow(num_blocks);
        } else {
            let moves = self.pool.shrink(num_blocks).ok_or(Error::ResizeTooSmall {
                requested: num_blocks,
                in_use,
            })?;
            compose_moves(&mut self.pending_moves, &moves, num_blocks);
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
}

/// Folds a shrink's moves into the moves not yet handed to a plan (`pending`, flattened pairs), so
/// that every source names a block as the runner last saw it and every destination appears once. A
/// runner may apply them all at once by gather-then-scatter (`cache[:, dst] = cache[:, src]`).
pub(crate) fn compose_moves(
    pending: &mut Vec<i64>,
    moves: &[(crate::BlockId, crate::BlockId)],
    num_blocks: usize,
) {
    let mut pm: Vec<(i64, i64)> = pending.chunks_exact(2).map(|m| (m[0], m[1])).collect();
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
    *pending = pm.into_iter().flat_map(|(s, d)| [s, d]).collect();
}

#[cfg(test)]
mod tests {
    use crate::sliding_window::NULL_BLOCK;
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

    fn windowed(num_blocks: usize, window_blocks: usize) -> Scheduler {
        let mut s = Scheduler::new(Config {
            num_blocks,
            block_size: 4,
            max_model_len: 256,
            max_num_batched_tokens: 8,
            max_num_seqs: 4,
            watermark: 0.0,
            ..Config::default()
        })
        .unwrap();
        s.add_window_group(8, window_blocks).unwrap();
        s.add_recurrent_group(4, 0).unwrap();
        s
    }

    fn add(s: &mut Scheduler, id: i64, len: i64) {
        let req = NewRequest {
            seq_ids: vec![id],
            prompt_token_ids: (1..=len).collect(),
            max_tokens: 30,
            ..Default::default()
        };
        s.add_request(req).unwrap();
    }

    fn step(s: &mut Scheduler) -> crate::StepPlan {
        let p = s.schedule().unwrap();
        s.check_invariants().unwrap();
        let sampled = vec![7; p.sampled_seq_ids.len()];
        s.update(p.step_id, &sampled).unwrap();
        s.check_invariants().unwrap();
        p
    }

    fn group_sizes(s: &Scheduler) -> Vec<usize> {
        s.kv_group_stats().iter().map(|g| g.num_blocks).collect()
    }

    #[test]
    fn groups_grow_and_shrink_with_moves_in_proportion() {
        let mut s = windowed(64, 16);
        s.resize(128).unwrap(); // the window pool doubles, its new blocks 16..32 used first
        assert_eq!(group_sizes(&s), vec![32, 4]); // recurrent state slots stay
        add(&mut s, 1, 20);
        for _ in 0..4 {
            step(&mut s);
        }
        let before = s.group_blocks_of(0, 1).unwrap();
        let live: Vec<u32> = before
            .iter()
            .copied()
            .filter(|&b| b != NULL_BLOCK)
            .collect();
        assert!(
            !live.is_empty() && live.iter().all(|&b| b >= 16),
            "{before:?}"
        );
        s.resize(32).unwrap(); // in proportion: 16 * 32 / 64 = 8 window blocks
        assert_eq!(group_sizes(&s), vec![8, 4]);
        let p = step(&mut s);
        assert_eq!(p.group_num_blocks, vec![8, 4]);
        let moves: Vec<(i64, i64, i64)> = p
            .group_block_moves
            .chunks(3)
            .map(|m| (m[0], m[1], m[2]))
            .collect();
        assert!(!moves.is_empty());
        // Every live block the sequence kept was moved below 8 by a move of group 0 in the plan.
        let after = s.group_blocks_of(0, 1).unwrap();
        for (i, &b) in before.iter().enumerate() {
            let now = after.get(i).copied().unwrap_or(NULL_BLOCK);
            if b == NULL_BLOCK || now == NULL_BLOCK {
                continue;
            }
            assert!(now < 8, "{after:?}");
            if b != now {
                assert!(
                    moves.contains(&(0, i64::from(b), i64::from(now))),
                    "{moves:?}"
                );
            }
        }
        while s.has_unfinished() {
            step(&mut s);
        }
        // The next plan carries no stale moves; growing back restores the start sizes.
        s.resize(64).unwrap();
        assert_eq!(group_sizes(&s), vec![16, 4]);
        assert!(step(&mut s).group_block_moves.is_empty());
    }

    #[test]
    fn a_group_whose_blocks_do_not_fit_refuses_with_the_numbers() {
        let mut s = windowed(64, 16);
        for id in 1..=3 {
            add(&mut s, id, 24);
        }
        for _ in 0..12 {
            step(&mut s);
        }
        let used = {
            let g = &s.kv_group_stats()[0];
            g.num_blocks - g.num_free_blocks
        };
        assert!(used > 8, "{used}");
        let e = s.resize(32).unwrap_err().to_string();
        assert!(
            e.contains("window:8")
                && e.contains("from 16 to 8 blocks")
                && e.contains(&format!("{used} are in use")),
            "{e}"
        );
        assert_eq!((s.pool().num_blocks(), group_sizes(&s)), (64, vec![16, 4]));
        // Never below one sequence's live blocks, however small the primary pool.
        s.abort(&[1, 2, 3]);
        s.resize(4).unwrap();
        assert_eq!(
            group_sizes(&s)[0],
            crate::sliding_window::max_live_blocks(8, 4, 8)
        );
        s.check_invariants().unwrap();
    }
}
