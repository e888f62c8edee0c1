//! Sequences: token ids, progress, block tables, status and stop checks on ids.

use std::sync::Arc;

/// Where a sequence is. Finished sequences are removed at once, so they have no status here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Waiting,
    Running,
    Swapped,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An eos token (`stop_token == None`) or one of `stop_token_ids`.
    Stop,
    /// max_tokens, max_model_len, or the pool cannot ever hold the sequence.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// A finished sequence, as `update()` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub seq_id: i64,
    pub reason: FinishReason,
    /// The stop token id that ended it; None for eos and for length.
    pub stop_token: Option<i64>,
}

/// Stop conditions shared by every sequence of one request.
#[derive(Debug, Clone, Default)]
pub struct StopParams {
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub eos_token_ids: Vec<u32>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub max_model_len: usize,
}

impl StopParams {
    /// The stop check after `token` was appended, with `num_output` output tokens and `num_tokens`
    /// tokens in all.
    pub fn check(&self, token: u32, num_output: usize, num_tokens: usize) -> Option<Finished> {
        let done = |reason, stop_token| Some(Finished { seq_id: 0, reason, stop_token });
        if num_output >= self.min_tokens {
            if !self.ignore_eos && self.eos_token_ids.contains(&token) {
                return done(FinishReason::Stop, None);
            }
            if self.stop_token_ids.contains(&token) {
                return done(FinishReason::Stop, Some(i64::from(token)));
            }
        }
        if num_output >= self.max_tokens || num_tokens >= self.max_model_len {
            return done(FinishReason::Length, None);
        }
        None
    }
}

/// Order of waiting and running sequences: priority (lower first), then arrival, then child index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqKey {
    pub priority: i64,
    pub arrival: u64,
    pub child: u32,
}

/// One sequence. Slots are reused; `gen` tells a reused slot from the sequence a plan named.
#[derive(Debug, Clone)]
pub struct Seq {
    pub seq_id: i64,
    pub gen: u32,
    pub alive: bool,
    pub status: Status,
    pub key: SeqKey,
    /// Prompt followed by the output tokens so far.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose KV is in the cache (or scheduled into it by the pending plan).
    pub num_computed: usize,
    /// Device blocks; covers at least `num_computed` tokens while running.
    pub block_table: Vec<u32>,
    /// Swap blocks while swapped out.
    pub swap_table: Vec<u32>,
    /// Chained hashes of the full blocks of `tokens` computed so far (a cache of pure values).
    pub block_hashes: Vec<u64>,
    /// Leading full blocks already offered to the prefix cache.
    pub num_cached_blocks: usize,
    pub extra_key: u64,
    pub skip_prefix_cache: bool,
    pub stop: Arc<StopParams>,
    /// Sibling ids (and child index) that fork from this one when its prompt is computed.
    pub children: Vec<(i64, u32)>,
    /// Prefix-cache hit tokens at first admission.
    pub num_cached_tokens: usize,
    pub admitted: bool,
}

impl Seq {
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Sequences this entry stands for (itself plus children not yet forked).
    pub fn width(&self) -> usize {
        1 + self.children.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> StopParams {
        StopParams {
            max_tokens: 5,
            min_tokens: 2,
            eos_token_ids: vec![2],
            stop_token_ids: vec![9],
            ignore_eos: false,
            max_model_len: 100,
        }
    }

    #[test]
    fn eos_and_stop_tokens_respect_min_tokens() {
        let p = params();
        assert_eq!(p.check(2, 1, 10), None);
        assert_eq!(p.check(9, 1, 10), None);
        let f = p.check(2, 2, 10).unwrap();
        assert_eq!((f.reason, f.stop_token), (FinishReason::Stop, None));
        let f = p.check(9, 3, 10).unwrap();
        assert_eq!((f.reason, f.stop_token), (FinishReason::Stop, Some(9)));
        assert_eq!(p.check(4, 3, 10), None);
    }

    #[test]
    fn length_limits() {
        let p = params();
        assert_eq!(p.check(4, 5, 10).unwrap().reason, FinishReason::Length);
        assert_eq!(p.check(4, 3, 100).unwrap().reason, FinishReason::Length);
        let p = StopParams { ignore_eos: true, ..params() };
        assert_eq!(p.check(2, 3, 10), None);
    }

    #[test]
    fn keys_order_by_priority_then_arrival() {
        let k = |priority, arrival, child| SeqKey { priority, arrival, child };
        let mut v = vec![k(1, 0, 0), k(0, 5, 1), k(0, 5, 0), k(-1, 9, 0)];
        v.sort();
        assert_eq!(v, vec![k(-1, 9, 0), k(0, 5, 0), k(0, 5, 1), k(1, 0, 0)]);
    }
}
