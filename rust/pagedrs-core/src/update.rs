//! After the forward pass: append sampled tokens, stop checks, free finished sequences, cache
//! newly full blocks.

use crate::block_pool::CacheItem;
use crate::error::{Error, Result};
use crate::prefix_cache::{block_hash, root_hash};
use crate::request::Finished;
use crate::scheduler::Scheduler;
use crate::BlockId;

impl Scheduler {
    /// Applies the sampled tokens of plan `step_id` (row `i` of `sampled` belongs to the plan's
    /// `sampled_seq_ids[i]`). Returns the sequences that finished, including any the pool could
    /// never hold. Sequences aborted since `schedule()` are skipped.
    pub fn update(&mut self, step_id: u64, sampled: &[i64]) -> Result<Vec<Finished>> {
        self.apply(step_id, sampled, None).map(|(f, _)| f)
    }

    /// [`Self::update`] for a plan with drafts: sampled sequence `i` emitted `counts[i]` tokens
    /// (its accepted drafts, then one more), flattened in `tokens`. Returns the finished sequences
    /// and how many of each sequence's tokens count (fewer than emitted when a stop condition ends
    /// it early; 0 for a sequence aborted since `schedule()`).
    pub fn update_spec(
        &mut self,
        step_id: u64,
        tokens: &[i64],
        counts: &[i32],
    ) -> Result<(Vec<Finished>, Vec<i32>)> {
        self.apply(step_id, tokens, Some(counts))
    }

    fn apply(
        &mut self,
        step_id: u64,
        tokens: &[i64],
        counts: Option<&[i32]>,
    ) -> Result<(Vec<Finished>, Vec<i32>)> {
        match self.pending {
            Some(s) if s == step_id => {}
            // A plan without rows needs no update; accept one anyway.
            None if step_id + 1 == self.step && tokens.is_empty() => {
                let n = counts.map_or(0, <[i32]>::len);
                return Ok((std::mem::take(&mut self.pending_finished), vec![0; n]));
            }
            other => {
                return Err(Error::PlanMismatch {
                    given: step_id,
                    pending: other.map_or_else(|| "none".to_string(), |s| s.to_string()),
                })
            }
        }
        self.check_sampled(tokens, counts)?;
        self.pending = None;
        if let Some(shape) = self.step_shape.as_mut() {
            shape.emitted = tokens.len();
        }
        if self.cfg.enable_prefix_caching {
            self.cache_full_blocks();
        }
        let mut finished = std::mem::take(&mut self.pending_finished);
        let mut kept = Vec::with_capacity(if counts.is_some() {
            self.samples.len()
        } else {
            0
        });
        let mut any_finished = false;
        let max_model_len = self.cfg.max_model_len;
        let mut at = 0usize;
        for i in 0..self.samples.len() {
            let c = counts.map_or(1, |c| c[i] as usize);
            let row = &tokens[at..at + c];
            at += c;
            let (slot, gen) = self.samples[i];
            let seq = &mut self.seqs[slot as usize];
            if !seq.alive || seq.gen != gen {
                if counts.is_some() {
                    kept.push(0);
                }
                continue;
            }
            let mut used = c;
            let mut done = None;
            for (j, &token) in row.iter().enumerate() {
                let token = token as u32;
                seq.push_token(token);
                if let Some(mut f) =
                    seq.stop
                        .check(token, seq.num_output(), seq.num_tokens(), max_model_len)
                {
                    f.seq_id = seq.seq_id;
                    done = Some(f);
                    used = j + 1;
                    break;
                }
            }
            if counts.is_some() {
                kept.push(used as i32);
            }
            match done {
                Some(f) => {
                    if !seq.drafts.is_empty() {
                        let d = seq.drafts.len() as u64;
                        self.spec_counts[0] += 1;
                        self.spec_counts[1] += d;
                        self.spec_counts[2] += (c - 1) as u64;
                    }
                    finished.push(f);
                    self.num_running_seqs -= 1;
                    self.release_slot(slot);
                    any_finished = true;
                }
                None if !seq.drafts.is_empty() => self.settle_drafts(slot, c),
                None => {}
            }
        }
        if any_finished {
            let seqs = &self.seqs;
            self.running.retain(|&s| seqs[s as usize].alive);
        }
        self.groups_release();
        Ok((finished, kept))
    }

    /// Shapes and ranges of what the runner sampled for the pending plan.
    fn check_sampled(&self, tokens: &[i64], counts: Option<&[i32]>) -> Result<()> {
        let rows = counts.map_or(tokens.len(), <[i32]>::len);
        if rows != self.samples.len() {
            return Err(Error::SampledLength {
                got: rows,
                expected: self.samples.len(),
            });
        }
        if let Some(counts) = counts {
            let mut total = 0usize;
            for (i, &c) in counts.iter().enumerate() {
                let (slot, gen) = self.samples[i];
                let seq = &self.seqs[slot as usize];
                let most = if seq.alive && seq.gen == gen {
                    1 + seq.drafts.len()
                } else {
                    usize::MAX
                };
                if c < 1 || c as usize > most {
                    return Err(Error::InvalidRequest(format!(
                        "sampled sequence {i} emitted {c} tokens; it can emit 1..={most}"
                    )));
                }
                total += c as usize;
            }
            if total != tokens.len() {
                return Err(Error::InvalidRequest(format!(
                    "counts sum to {total} but {} tokens were given",
                    tokens.len()
                )));
            }
        }
        let limit = self.cfg.vocab_size.map_or(1u64 << 32, |v| v as u64);
        if let Some(&t) = tokens.iter().find(|&&t| t < 0 || t as u64 >= limit) {
            return Err(Error::TokenOutOfRange { token_id: t, limit });
        }
        Ok(())
    }

    /// Offers the pending plan's newly full computed blocks to the prefix cache.
    fn cache_full_blocks(&mut self) {
        let mut items = std::mem::take(&mut self.cache_scratch);
        items.clear();
        for i in 0..self.rows.len() {
            let (slot, gen) = self.rows[i];
            if self.seqs[slot as usize].alive && self.seqs[slot as usize].gen == gen {
                self.collect_full_blocks(slot, &mut items);
            }
        }
        if !items.is_empty() {
            self.kv.cache(&items, &self.seqs);
            let bs = self.cfg.block_size;
            let seqs = &self.seqs;
            self.pool.cache_blocks(&mut items, |it| {
                let i = it.idx as usize * bs;
                &seqs[it.slot as usize].tokens[i..i + bs]
            });
            self.offer_to_tier(&items);
        }
        self.cache_scratch = items;
    }

    /// Hashes the sequence's newly computed full blocks into `items` (cached by the caller).
    fn collect_full_blocks(&mut self, slot: u32, items: &mut Vec<CacheItem>) {
        let shift = self.cfg.block_size.trailing_zeros();
        let bs = self.cfg.block_size;
        let seq = &mut self.seqs[slot as usize];
        let full = seq.num_computed >> shift;
        if seq.num_cached_blocks >= full {
            return;
        }
        seq.flush();
        while seq.num_cached_blocks < full {
            let i = seq.num_cached_blocks;
            let parent = if i == 0 {
                root_hash(seq.extra_key)
            } else {
                seq.last_hash
            };
            let hash = block_hash(parent, &seq.tokens[i * bs..(i + 1) * bs]);
            items.push(CacheItem {
                block: BlockId(seq.block_table[i]),
                hash,
                parent,
                extra_key: seq.extra_key,
                slot,
                idx: i as u32,
            });
            seq.last_hash = hash;
            seq.num_cached_blocks += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, FinishReason, NewRequest, Scheduler};

    #[test]
    fn full_blocks_are_cached_and_finished_seqs_freed() {
        let mut s = Scheduler::new(Config {
            num_blocks: 8,
            block_size: 2,
            ..Config::default()
        })
        .unwrap();
        let req = NewRequest {
            seq_ids: vec![1],
            prompt_token_ids: vec![4, 5, 6],
            max_tokens: 5,
            stop_token_ids: vec![9],
            ..Default::default()
        };
        s.add_request(req).unwrap();
        let p = s.schedule().unwrap();
        s.update(p.step_id, &[7]).unwrap();
        assert_eq!(s.pool().cache().len(), 1); // [4, 5]
        let p = s.schedule().unwrap();
        let f = s.update(p.step_id, &[9]).unwrap();
        assert_eq!(f[0].reason, FinishReason::Stop);
        assert_eq!(f[0].stop_token, Some(9));
        assert_eq!(s.pool().cache().len(), 2); // [4, 5], [6, 7]
        assert_eq!(s.pool().num_free(), 8);
        s.check_invariants().unwrap();
    }

    #[test]
    fn aborted_between_schedule_and_update_is_skipped() {
        let mut s = Scheduler::new(Config {
            num_blocks: 8,
            block_size: 2,
            ..Config::default()
        })
        .unwrap();
        for id in [1, 2] {
            let req = NewRequest {
                seq_ids: vec![id],
                prompt_token_ids: vec![4, 5],
                max_tokens: 1,
                ..Default::default()
            };
            s.add_request(req).unwrap();
        }
        let p = s.schedule().unwrap();
        s.abort(&[1]);
        let f = s.update(p.step_id, &[3, 3]).unwrap();
        assert_eq!(f.iter().map(|f| f.seq_id).collect::<Vec<_>>(), vec![2]);
        assert!(!s.has_unfinished());
    }
}
