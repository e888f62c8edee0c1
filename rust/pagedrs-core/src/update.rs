//! After the forward pass: append sampled tokens, stop checks, free finished sequences, cache
//! newly full blocks.

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
        match self.pending {
            Some(s) if s == step_id => {}
            // A plan without rows needs no update; accept one anyway.
            None if step_id + 1 == self.step && sampled.is_empty() => {
                return Ok(std::mem::take(&mut self.pending_finished));
            }
            other => {
                return Err(Error::PlanMismatch {
                    given: step_id,
                    pending: other.map_or_else(|| "none".to_string(), |s| s.to_string()),
                })
            }
        }
        if sampled.len() != self.samples.len() {
            return Err(Error::SampledLength {
                got: sampled.len(),
                expected: self.samples.len(),
            });
        }
        let limit = self.cfg.vocab_size.map_or(1u64 << 32, |v| v as u64);
        if let Some(&t) = sampled.iter().find(|&&t| t < 0 || t as u64 >= limit) {
            return Err(Error::TokenOutOfRange { token_id: t, limit });
        }
        self.pending = None;
        if self.cfg.enable_prefix_caching {
            for i in 0..self.rows.len() {
                let (slot, gen) = self.rows[i];
                if self.seqs[slot as usize].alive && self.seqs[slot as usize].gen == gen {
                    self.cache_full_blocks(slot);
                }
            }
        }
        let mut finished = std::mem::take(&mut self.pending_finished);
        let mut any_finished = false;
        let max_model_len = self.cfg.max_model_len;
        for (i, &token) in sampled.iter().enumerate() {
            let (slot, gen) = self.samples[i];
            let seq = &mut self.seqs[slot as usize];
            if !seq.alive || seq.gen != gen {
                continue;
            }
            let token = token as u32;
            seq.tokens.push(token);
            seq.last_token = token;
            if let Some(mut f) = seq.stop.check(token, seq.num_output(), seq.num_tokens(), max_model_len) {
                f.seq_id = seq.seq_id;
                finished.push(f);
                self.num_running_seqs -= 1;
                self.release_slot(slot);
                any_finished = true;
            }
        }
        if any_finished {
            let seqs = &self.seqs;
            self.running.retain(|&s| seqs[s as usize].alive);
        }
        Ok(finished)
    }

    /// Offers the sequence's newly computed full blocks to the prefix cache.
    fn cache_full_blocks(&mut self, slot: u32) {
        let shift = self.cfg.block_size.trailing_zeros();
        let bs = self.cfg.block_size;
        let seq = &mut self.seqs[slot as usize];
        let full = seq.num_computed >> shift;
        while seq.num_cached_blocks < full {
            let i = seq.num_cached_blocks;
            let parent = if i == 0 { root_hash(seq.extra_key) } else { seq.last_hash };
            let tokens = &seq.tokens[i * bs..(i + 1) * bs];
            let h = block_hash(parent, tokens);
            self.pool.cache_block(BlockId(seq.block_table[i]), h, parent, tokens);
            seq.last_hash = h;
            seq.num_cached_blocks += 1;
        }
    }
}
