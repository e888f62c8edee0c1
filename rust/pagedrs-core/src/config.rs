//! Scheduler configuration and the arguments of one request, validated once at the edge.

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    pub enable_chunked_prefill: bool,
    pub num_swap_blocks: usize,
    /// Blocks of the host KV tier (`kv_tier`): full blocks kept outside the device pool; 0: none.
    pub num_tier_blocks: usize,
    /// Fraction of the pool kept free when admitting new work, in [0, 1).
    pub watermark: f64,
    /// When set, token ids must be below it.
    pub vocab_size: Option<usize>,
    /// Speculative decoding: draft tokens verified per decoding sequence and step (0: off).
    pub num_speculative_tokens: usize,
    /// Where drafts come from: n-gram lookup over the sequence's own tokens, here, or the runner's
    /// drafter (the plan then carries placeholder draft tokens the runner replaces).
    pub spec_proposer: SpecProposer,
    /// Speculation pauses for a step while more sequences than this run (vLLM's
    /// `disable_by_batch_size`); None: never.
    pub spec_disable_batch_size: Option<usize>,
    /// Shorten (and pause) a sequence's proposals after rejections (`spec::adapt`), and pause all of them
    /// while the measured step times say speculation is slower (`spec_governor`); off: every decoding
    /// step proposes the most drafts the limits allow.
    pub spec_adaptive: bool,
}

/// Who proposes the draft tokens of speculative decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecProposer {
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last
    /// `n` tokens, for the largest `n` in `min..=max` that occurs (vLLM's `prompt_lookup_min/max`).
    Ngram { min: usize, max: usize },
    /// A draft model in the runner proposes; the scheduler only reserves the lookahead slots.
    Runner,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            num_blocks: 1024,
            block_size: 16,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: 2048,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            num_swap_blocks: 0,
            num_tier_blocks: 0,
            watermark: 0.01,
            vocab_size: None,
            num_speculative_tokens: 0,
            spec_proposer: SpecProposer::Runner,
            spec_disable_batch_size: None,
            spec_adaptive: true,
        }
    }
}

impl Config {
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("num_blocks", self.num_blocks),
            ("block_size", self.block_size),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_num_seqs", self.max_num_seqs),
            ("max_model_len", self.max_model_len),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(Error::InvalidConfig(format!("{name} must be > 0, got 0")));
            }
        }
        if !self.block_size.is_power_of_two() {
            return Err(Error::InvalidConfig(format!(
                "block_size must be a power of two, got {}",
                self.block_size
            )));
        }
        if !(self.watermark >= 0.0 && self.watermark < 1.0) {
            return Err(Error::InvalidConfig(format!(
                "watermark must be in [0, 1), got {}",
                self.watermark
            )));
        }
        if let SpecProposer::Ngram { min, max } = self.spec_proposer {
            if min == 0 || min > max {
                return Err(Error::InvalidConfig(format!(
                    "prompt_lookup_min must be in [1, prompt_lookup_max={max}], got {min}"
                )));
            }
        }
        if self.num_speculative_tokens >= self.max_num_batched_tokens {
            return Err(Error::InvalidConfig(format!(
                "num_speculative_tokens must be < max_num_batched_tokens={}, got {}",
                self.max_num_batched_tokens, self.num_speculative_tokens
            )));
        }
        if self.vocab_size == Some(0) {
            return Err(Error::InvalidConfig("vocab_size must be > 0, got 0".into()));
        }
        let limit = u32::MAX as usize;
        for (name, v) in [
            ("num_blocks", self.num_blocks),
            ("num_swap_blocks", self.num_swap_blocks),
            ("num_tier_blocks", self.num_tier_blocks),
            ("max_model_len", self.max_model_len),
        ] {
            if v >= limit {
                return Err(Error::InvalidConfig(format!(
                    "{name} must be < {limit}, got {v}"
                )));
            }
        }
        Ok(())
    }

    /// Blocks kept free when admitting new work.
    pub fn watermark_blocks(&self, num_blocks: usize) -> usize {
        (self.watermark * num_blocks as f64) as usize
    }
}

/// One `add_request` call: `seq_ids[0]` prefills, the others fork from it.
#[derive(Debug, Clone, Default)]
pub struct NewRequest {
    pub seq_ids: Vec<i64>,
    pub prompt_token_ids: Vec<i64>,
    pub max_tokens: i64,
    pub min_tokens: i64,
    pub eos_token_ids: Vec<i64>,
    pub stop_token_ids: Vec<i64>,
    pub ignore_eos: bool,
    pub priority: i64,
    pub cache_salt: Option<String>,
    pub skip_prefix_cache: bool,
    /// The request may speculate (its sampling has no per-token state the verifier does not model).
    pub speculate: bool,
}

/// Checks token ids against `[0, vocab_size)` (or the u32 range) and narrows them.
pub fn to_token_ids(ids: &[i64], vocab_size: Option<usize>) -> Result<Vec<u32>> {
    let limit = vocab_size.map_or(1u64 << 32, |v| v as u64);
    ids.iter()
        .map(|&t| {
            if t < 0 || t as u64 >= limit {
                Err(Error::TokenOutOfRange { token_id: t, limit })
            } else {
                Ok(t as u32)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_value() {
        assert!(Config::default().validate().is_ok());
        let e = Config {
            block_size: 12,
            ..Config::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("12"), "{e}");
        let e = Config {
            watermark: 1.0,
            ..Config::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("watermark"), "{e}");
        let e = Config {
            num_blocks: 0,
            ..Config::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("num_blocks"), "{e}");
        assert!(Config {
            watermark: f64::NAN,
            ..Config::default()
        }
        .validate()
        .is_err());
        assert!(Config {
            vocab_size: Some(0),
            ..Config::default()
        }
        .validate()
        .is_err());
    }

    #[test]
    fn token_ids_are_range_checked() {
        assert_eq!(to_token_ids(&[0, 5], Some(6)).unwrap(), vec![0, 5]);
        let e = to_token_ids(&[1, -3], None).unwrap_err();
        assert!(e.to_string().contains("-3"), "{e}");
        let e = to_token_ids(&[6], Some(6)).unwrap_err();
        assert!(e.to_string().contains('6'), "{e}");
        assert!(to_token_ids(&[1 << 32], None).is_err());
    }
}
