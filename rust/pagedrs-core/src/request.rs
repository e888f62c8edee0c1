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

/// Stop conditions of one request, stored inline in each sequence (checked every step, so no
/// pointer is followed unless a request has more than `INLINE_IDS` eos + stop ids).
#[derive(Debug, Clone, Default)]
pub struct StopParams {
    pub max_tokens: u32,
    pub min_tokens: u32,
    pub ignore_eos: bool,
    n_eos: u8,
    n_stop: u8,
    inline: [u32; INLINE_IDS],
    /// (eos ids, stop ids) when they do not fit inline.
    overflow: Option<Arc<(Vec<u32>, Vec<u32>)>>,
}

const INLINE_IDS: usize = 4;

impl StopParams {
    pub fn new(
        max_tokens: usize,
        min_tokens: usize,
        eos: Vec<u32>,
        stop: Vec<u32>,
        ignore_eos: bool,
    ) -> Self {
        let mut p = Self {
            max_tokens: max_tokens.min(u32::MAX as usize) as u32,
            min_tokens: min_tokens.min(u32::MAX as usize) as u32,
            ignore_eos,
            ..Self::default()
        };
        if eos.len() + stop.len() <= INLINE_IDS {
            p.n_eos = eos.len() as u8;
            p.n_stop = stop.len() as u8;
            for (d, &t) in p.inline.iter_mut().zip(eos.iter().chain(&stop)) {
                *d = t;
            }
        } else {
            p.overflow = Some(Arc::new((eos, stop)));
        }
        p
    }

    fn is_eos(&self, token: u32) -> bool {
        match &self.overflow {
            None => self.inline[..self.n_eos as usize].contains(&token),
            Some(o) => o.0.contains(&token),
        }
    }

    fn is_stop(&self, token: u32) -> bool {
        match &self.overflow {
            None => self.inline[self.n_eos as usize..(self.n_eos + self.n_stop) as usize]
                .contains(&token),
            Some(o) => o.1.contains(&token),
        }
    }

    /// The stop check after `token` was appended, with `num_output` output tokens and `num_tokens`
    /// tokens in all.
    pub fn check(
        &self,
        token: u32,
        num_output: usize,
        num_tokens: usize,
        max_model_len: usize,
    ) -> Option<Finished> {
        let done = |reason, stop_token| {
            Some(Finished {
                seq_id: 0,
                reason,
                stop_token,
            })
        };
        if num_output >= self.min_tokens as usize {
            if !self.ignore_eos && self.is_eos(token) {
                return done(FinishReason::Stop, None);
            }
            if self.is_stop(token) {
                return done(FinishReason::Stop, Some(i64::from(token)));
            }
        }
        if num_output >= self.max_tokens as usize || num_tokens >= max_model_len {
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
/// Fields read on every step come first (`repr(C)`), so a decode touches about two cache lines.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub struct Seq {
    /// Prompt followed by the output tokens so far, except the newest ones still in `tail`.
    pub tokens: Vec<u32>,
    /// Device blocks; covers at least `num_computed` tokens while running.
    pub block_table: Vec<u32>,
    pub seq_id: i64,
    /// Tokens whose KV is in the cache (or scheduled into it by the pending plan).
    pub num_computed: usize,
    /// Leading full blocks already offered to the prefix cache.
    pub num_cached_blocks: usize,
    /// Chained hash of block `num_cached_blocks - 1` (the parent of the next one to cache).
    pub last_hash: u64,
    pub prompt_len: usize,
    /// `tokens.last()`, kept here so a decode step does not read the token buffer.
    pub last_token: u32,
    pub gen: u32,
    /// `block_table.last()` (0 when empty), kept here so a decode reads no block table.
    pub last_block: u32,
    /// Row of the persistent block table while running.
    pub row: Option<u32>,
    pub alive: bool,
    pub status: Status,
    /// The block the next token goes into may be shared with a sibling (copy on write).
    pub shared_tail: bool,
    pub stop: StopParams,
    pub tail_len: u8,
    /// Newest output tokens, moved to `tokens` in batches: a decode step then writes this
    /// (already hot) line instead of a cache-cold spot in the token buffer.
    pub tail: [u32; TAIL],
    // Cold fields.
    pub key: SeqKey,
    /// Swap blocks while swapped out.
    pub swap_table: Vec<u32>,
    pub extra_key: u64,
    pub skip_prefix_cache: bool,
    /// Sibling ids (and child index) that fork from this one when its prompt is computed.
    pub children: Vec<(i64, u32)>,
    /// Prefix-cache hit tokens at first admission.
    pub num_cached_tokens: usize,
    pub admitted: bool,
    /// May speculate (set per request).
    pub speculate: bool,
    /// Draft tokens scheduled after `last_token` in the pending plan (empty when not speculating).
    pub drafts: Vec<u32>,
    /// Adaptive speculation: the most drafts the next proposal may have (0: the configured number),
    /// decode steps to skip before proposing again, and proposals in a row that had none accepted.
    pub spec_len: u8,
    pub spec_skip: u16,
    pub spec_misses: u8,
}

/// Output tokens buffered inline in a sequence before they are moved to its token buffer.
pub const TAIL: usize = 16;

impl Seq {
    pub fn num_tokens(&self) -> usize {
        self.tokens.len() + self.tail_len as usize
    }

    pub fn num_output(&self) -> usize {
        self.num_tokens() - self.prompt_len
    }

    pub fn push_token(&mut self, token: u32) {
        if self.tail_len as usize == TAIL {
            self.flush();
        }
        self.tail[self.tail_len as usize] = token;
        self.tail_len += 1;
        self.last_token = token;
    }

    /// Moves the buffered tokens to `tokens`, which then holds every token.
    pub fn flush(&mut self) {
        self.tokens
            .extend_from_slice(&self.tail[..self.tail_len as usize]);
        self.tail_len = 0;
    }

    /// Token `i` wherever it is buffered.
    pub fn token(&self, i: usize) -> u32 {
        match i.checked_sub(self.tokens.len()) {
            None => self.tokens[i],
            Some(j) => self.tail[j],
        }
    }

    /// Appends tokens `a..b` (as i64) to `out`.
    pub fn extend_tokens(&self, a: usize, b: usize, out: &mut Vec<i64>) {
        let split = self.tokens.len();
        if a < split {
            out.extend(self.tokens[a..b.min(split)].iter().map(|&x| i64::from(x)));
        }
        if b > split {
            out.extend(
                self.tail[a.max(split) - split..b - split]
                    .iter()
                    .map(|&x| i64::from(x)),
            );
        }
    }

    /// Every token, prompt first.
    pub fn all_tokens(&self) -> Vec<u32> {
        let mut v = self.tokens.clone();
        v.extend_from_slice(&self.tail[..self.tail_len as usize]);
        v
    }

    /// Refreshes `last_block` after `block_table` changed.
    pub(crate) fn sync_last_block(&mut self) {
        self.last_block = self.block_table.last().copied().unwrap_or(0);
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
        StopParams::new(5, 2, vec![2], vec![9], false)
    }

    #[test]
    fn eos_and_stop_tokens_respect_min_tokens() {
        let p = params();
        assert_eq!(p.check(2, 1, 10, 100), None);
        assert_eq!(p.check(9, 1, 10, 100), None);
        let f = p.check(2, 2, 10, 100).unwrap();
        assert_eq!((f.reason, f.stop_token), (FinishReason::Stop, None));
        let f = p.check(9, 3, 10, 100).unwrap();
        assert_eq!((f.reason, f.stop_token), (FinishReason::Stop, Some(9)));
        assert_eq!(p.check(4, 3, 10, 100), None);
    }

    #[test]
    fn length_limits() {
        let p = params();
        assert_eq!(p.check(4, 5, 10, 100).unwrap().reason, FinishReason::Length);
        assert_eq!(
            p.check(4, 3, 100, 100).unwrap().reason,
            FinishReason::Length
        );
        let p = StopParams {
            ignore_eos: true,
            ..params()
        };
        assert_eq!(p.check(2, 3, 10, 100), None);
    }

    #[test]
    fn many_ids_overflow_inline_storage() {
        let p = StopParams::new(9, 0, vec![1, 2, 3], vec![4, 5, 6], false);
        assert_eq!(p.check(3, 1, 2, 100).unwrap().stop_token, None);
        assert_eq!(p.check(6, 1, 2, 100).unwrap().stop_token, Some(6));
        assert_eq!(p.check(7, 1, 2, 100), None);
        let p = StopParams::new(9, 0, vec![], vec![4, 5, 6, 7], false);
        assert_eq!(p.check(7, 1, 2, 100).unwrap().stop_token, Some(7));
        assert_eq!(p.check(3, 1, 2, 100), None);
    }

    #[test]
    fn tail_buffer_is_transparent() {
        let mut s = crate::Scheduler::new(crate::Config::default()).unwrap();
        let slot = s.new_slot();
        let seq = &mut s.seqs[slot as usize];
        seq.tokens = vec![1, 2, 3];
        seq.prompt_len = 3;
        for t in 0..40 {
            seq.push_token(100 + t);
        }
        assert_eq!(seq.num_tokens(), 43);
        assert_eq!(seq.num_output(), 40);
        let all = seq.all_tokens();
        assert_eq!(all.len(), 43);
        assert_eq!(all[42], 139);
        assert_eq!((0..43).map(|i| seq.token(i)).collect::<Vec<_>>(), all);
        for (a, b) in [(0, 43), (2, 40), (35, 43), (40, 41), (0, 3)] {
            let mut out = Vec::new();
            seq.extend_tokens(a, b, &mut out);
            assert_eq!(
                out,
                all[a..b].iter().map(|&x| i64::from(x)).collect::<Vec<_>>()
            );
        }
        seq.flush();
        assert_eq!(seq.tokens, all);
        assert_eq!(seq.last_token, 139);
    }

    #[test]
    fn keys_order_by_priority_then_arrival() {
        let k = |priority, arrival, child| SeqKey {
            priority,
            arrival,
            child,
        };
        let mut v = vec![k(1, 0, 0), k(0, 5, 1), k(0, 5, 0), k(-1, 9, 0)];
        v.sort();
        assert_eq!(v, vec![k(-1, 9, 0), k(0, 5, 0), k(0, 5, 1), k(1, 0, 0)]);
    }
}
