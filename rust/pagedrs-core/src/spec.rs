//! Speculative decoding in the scheduler: how many lookahead slots a decoding sequence reserves, the
//! n-gram (prompt lookup) proposer, and the rollback of rejected drafts after `update_spec()`.
//!
//! A speculating sequence is scheduled as `1 + s` query tokens: its last token, then `s` drafts. The
//! plan asks for the logits of all `1 + s` rows; the verifier emits `1 + a` tokens (`a` accepted
//! drafts, then one more), and the KV of the `a` accepted drafts stays: `num_computed` grows by `a`,
//! the blocks past the new last token are freed (their slots held rejected drafts).

use crate::config::SpecProposer;
use crate::scheduler::Scheduler;
use crate::BlockId;

/// The tokens that followed the latest earlier occurrence of `tokens`' last `n` tokens, for the
/// largest `n` in `min_n..=max_n` that occurs; at most `k` of them (empty when nothing matches).
pub fn ngram_propose(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> &[u32] {
    let len = tokens.len();
    if k == 0 || min_n == 0 {
        return &[];
    }
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let pattern = &tokens[len - n..];
        // Latest start first; the match must end before the pattern itself (i + n < len).
        for i in (0..len - n).rev() {
            if &tokens[i..i + n] == pattern {
                let start = i + n;
                return &tokens[start..start.saturating_add(k).min(len)];
            }
        }
    }
    &[]
}

impl Scheduler {
    /// Whether sequences may speculate this step (on, the batch not above the disable size, and no
    /// engine-wide pause of the governor, which is fed only with `spec_adaptive`).
    pub(crate) fn spec_active(&self) -> bool {
        self.cfg.num_speculative_tokens > 0
            && self
                .cfg
                .spec_disable_batch_size
                .is_none_or(|b| self.num_running_seqs <= b)
            && !self.spec_governor.paused()
    }

    /// The wall time of the step last updated (schedule, forward and update), for the governor that
    /// pauses speculation measured slower than plain decoding (`spec_governor`). Ignored unless
    /// speculation is on with `spec_adaptive`, or when no step was updated since the last call.
    pub fn observe_step_time(&mut self, secs: f64) {
        if let Some(shape) = self.step_shape.take() {
            if self.cfg.num_speculative_tokens > 0 && self.cfg.spec_adaptive {
                self.spec_governor.observe(shape, secs);
            }
        }
    }

    /// Steps left in the governor's current pause of speculation (0: not paused).
    pub fn spec_pause_left(&self) -> u32 {
        self.spec_governor.pause_left()
    }

    /// Fills `drafts` of the decoding sequence `slot` with at most `room` draft tokens and returns
    /// how many: bounded by `num_speculative_tokens`, what `max_tokens` and `max_model_len` leave
    /// after the token the step emits anyway, and (n-gram) what the lookup finds.
    pub(crate) fn propose(&mut self, slot: u32, room: usize) -> usize {
        let cfg = &self.cfg;
        let seq = &mut self.seqs[slot as usize];
        seq.drafts.clear();
        if !seq.speculate || seq.num_computed < seq.prompt_len || !seq.children.is_empty() {
            return 0;
        }
        if seq.spec_skip > 0 {
            seq.spec_skip -= 1;
            return 0;
        }
        let n_tok = seq.num_tokens();
        let left_out = (seq.stop.max_tokens as usize).saturating_sub(seq.num_output() + 1);
        let left_len = cfg.max_model_len.saturating_sub(n_tok + 1);
        let adaptive = if seq.spec_len == 0 {
            usize::MAX
        } else {
            usize::from(seq.spec_len)
        };
        let k = cfg
            .num_speculative_tokens
            .min(adaptive)
            .min(room)
            .min(left_out)
            .min(left_len);
        if k == 0 {
            return 0;
        }
        match cfg.spec_proposer {
            SpecProposer::Ngram { min, max } => {
                seq.flush();
                let found = ngram_propose(&seq.tokens, min, max, k);
                seq.drafts.extend_from_slice(found);
            }
            // Placeholders: the runner's drafter writes the real drafts into the step's inputs.
            SpecProposer::Runner => seq.drafts.resize(k, seq.last_token),
        }
        seq.drafts.len()
    }

    /// After `update_spec()` appended `emitted` tokens to the speculating sequence `slot`: the
    /// accepted drafts' KV counts as computed, blocks past the new last token are freed.
    pub(crate) fn settle_drafts(&mut self, slot: u32, emitted: usize) {
        let bs = self.cfg.block_size;
        let seq = &mut self.seqs[slot as usize];
        let proposed = seq.drafts.len();
        seq.drafts.clear();
        self.spec_counts[0] += 1;
        self.spec_counts[1] += proposed as u64;
        self.spec_counts[2] += emitted.saturating_sub(1) as u64;
        if self.cfg.spec_adaptive {
            adapt(seq, proposed, emitted - 1, self.cfg.num_speculative_tokens);
        }
        seq.num_computed += emitted - 1;
        let num_tokens = seq.num_tokens();
        self.kv.truncate(slot, num_tokens);
        let seq = &mut self.seqs[slot as usize];
        let keep = seq.num_tokens().div_ceil(bs);
        if seq.block_table.len() > keep {
            for b in seq.block_table.drain(keep..) {
                self.pool.free(BlockId(b));
            }
            seq.sync_last_block();
            if let Some(row) = seq.row {
                self.tables.mark(row, keep);
            }
        }
    }
}

/// Longest pause between two proposals of a sequence whose drafts keep being rejected.
pub const MAX_SPEC_SKIP: u16 = 32;

/// Adapts a sequence's next proposal to how its last one fared (as speculation that stops paying should
/// stop costing): all accepted, one more draft next time (up to `k_max`); some accepted, as many as were
/// plus one; none accepted, one draft, after a pause that doubles with every miss in a row (1, 2, 4, ..
/// up to [`MAX_SPEC_SKIP`] decode steps without drafts), so a drafter that never agrees costs a
/// verification row only now and then.
pub(crate) fn adapt(seq: &mut crate::request::Seq, proposed: usize, accepted: usize, k_max: usize) {
    let k_max = k_max.min(usize::from(u8::MAX));
    if accepted == 0 {
        seq.spec_len = 1;
        seq.spec_misses = seq.spec_misses.saturating_add(1);
        let pause = 1u32 << u32::from(seq.spec_misses.min(6) - 1);
        seq.spec_skip = (pause as u16).min(MAX_SPEC_SKIP);
    } else {
        seq.spec_misses = 0;
        debug_assert!(accepted <= proposed);
        seq.spec_len = (accepted + 1).min(k_max).max(1) as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::ngram_propose;
    use crate::{Config, NewRequest, Scheduler, SpecProposer};

    #[test]
    fn ngram_takes_the_longest_latest_match() {
        let t = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3];
        // Suffix [2, 3]: the latest earlier [2, 3] is at 5 (followed by 7, 8, 5, 2).
        assert_eq!(ngram_propose(&t, 1, 2, 3), &[7, 8, 5]);
        // The longest n wins: suffix [5, 2, 3] never occurred before; [2, 3] did.
        assert_eq!(ngram_propose(&t, 2, 3, 9), &[7, 8, 5, 2, 3]);
        // The proposal stops at the end of the sequence.
        let t = [4, 5, 6, 4, 5];
        assert_eq!(ngram_propose(&t, 1, 3, 8), &[6, 4, 5]);
        assert_eq!(ngram_propose(&[1, 2, 3], 1, 3, 4), &[] as &[u32]);
        assert_eq!(ngram_propose(&[7], 1, 3, 4), &[] as &[u32]);
        assert_eq!(ngram_propose(&[7, 7], 1, 3, 0), &[] as &[u32]);
        // [7, 7]: the suffix [7] occurred at 0, followed by the last 7.
        assert_eq!(ngram_propose(&[7, 7], 1, 3, 4), &[7]);
    }

    /// A scheduler with runner-drafted speculation (`k` drafts) and one request whose prompt has run.
    fn one_speculating(k: usize, adaptive: bool, num_blocks: usize, max_tokens: i64) -> Scheduler {
        let mut s = Scheduler::new(Config {
            num_blocks,
            block_size: 4,
            num_speculative_tokens: k,
            spec_proposer: SpecProposer::Runner,
            spec_adaptive: adaptive,
            ..Config::default()
        })
        .unwrap();
        s.add_request(NewRequest {
            seq_ids: vec![1],
            prompt_token_ids: vec![3, 4, 5],
            max_tokens,
            speculate: true,
            ..Default::default()
        })
        .unwrap();
        let p = s.schedule().unwrap();
        s.update(p.step_id, &[7]).unwrap();
        s
    }

    #[test]
    fn proposals_adapt_to_acceptance() {
        let mut s = one_speculating(4, true, 64, 200);
        // (drafts the step proposes, drafts then accepted): all 4 accepted keeps 4 (the cap); 1 of 4
        // shrinks the next proposal to 2; none accepted pauses for 1, 2, 4, 8 steps, proposing 1 between.
        let mut seen = Vec::new();
        for accept in [4usize, 1, 2, 0, 0, 0, 0, 1, 2] {
            loop {
                let p = s.schedule().unwrap();
                let d = p.num_draft_tokens[0] as usize;
                let a = accept.min(d);
                let mut toks: Vec<i64> = p.draft_token_ids[..a].to_vec();
                toks.push(9);
                s.update_spec(p.step_id, &toks, &[a as i32 + 1]).unwrap();
                seen.push(d);
                if d > 0 {
                    break;
                }
            }
            s.check_invariants().unwrap();
        }
        let pause = |n: usize| std::iter::repeat_n(0, n);
        let mut want = vec![4, 4, 2, 3];
        for n in [1, 2, 4] {
            want.extend(pause(n));
            want.push(1);
        }
        want.extend(pause(8));
        want.extend([1, 2]);
        assert_eq!(seen, want);
        let st = s.stats();
        assert_eq!(st.spec_num_accepted_tokens, 4 + 1 + 2 + 1 + 2);
    }

    /// One decode step of the only sequence, its drafts all rejected; it takes 10 ms without drafts
    /// and 15 ms with (one token either way). Returns its number of drafts.
    fn reject_all(s: &mut Scheduler) -> usize {
        let p = s.schedule().unwrap();
        let d = p.num_draft_tokens[0] as usize;
        s.update_spec(p.step_id, &[9], &[1]).unwrap();
        s.observe_step_time(if d > 0 { 0.015 } else { 0.010 });
        d
    }

    #[test]
    fn speculation_measured_slower_pauses_engine_wide() {
        use crate::spec_governor::{MIN_PAUSE, WINDOW};
        for adaptive in [true, false] {
            let mut s = one_speculating(2, adaptive, 512, 1000);
            // The prompt's step gives no plain rate; the plain rate comes from the sequence's own pauses
            // after rejected drafts.
            s.observe_step_time(1.0);
            let mut drafting = 0;
            for _ in 0..200 {
                drafting += u32::from(reject_all(&mut s) > 0);
                if s.spec_pause_left() > 0 {
                    break;
                }
            }
            let st = s.stats();
            if adaptive {
                // The first drafting step had no plain rate to compare with.
                assert_eq!(drafting, WINDOW + 1, "{st:?}");
                assert_eq!(st.spec_num_pauses, 1, "{st:?}");
                assert_eq!(s.spec_pause_left(), MIN_PAUSE);
                let during: usize = (0..MIN_PAUSE).map(|_| reject_all(&mut s)).sum();
                assert_eq!(during, 0, "no drafts while paused");
                assert_eq!(s.spec_pause_left(), 0);
                s.seqs[0].spec_skip = 0;
                assert!(reject_all(&mut s) > 0, "drafts again after the pause");
            } else {
                assert_eq!(drafting, 200, "every step drafts without spec_adaptive");
                assert_eq!((st.spec_num_pauses, s.spec_pause_left()), (0, 0));
            }
            s.check_invariants().unwrap();
        }
    }
}
