//! Typed results of the scheduler: a finish-reason enum and a stats class (no strings, no dicts).

use pyo3::prelude::*;

use pagedrs_core::{FinishReason, Stats};

/// Why a sequence finished in the scheduler: an end-of-sequence or stop token, or a length limit.
#[pyclass(
    module = "pagedrs._core",
    name = "FinishReason",
    frozen,
    eq,
    eq_int,
    hash
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum PyFinishReason {
    #[pyo3(name = "STOP")]
    Stop,
    #[pyo3(name = "LENGTH")]
    Length,
}

impl From<FinishReason> for PyFinishReason {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Stop => Self::Stop,
            FinishReason::Length => Self::Length,
        }
    }
}

#[pymethods]
impl PyFinishReason {
    /// OpenAI's and vLLM's name: "stop" or "length".
    #[getter]
    fn value(&self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }

    fn __str__(&self) -> &'static str {
        self.value()
    }
}

/// A snapshot of the scheduler's queues, pool and counters.
#[pyclass(module = "pagedrs._core", name = "SchedulerStats", frozen, get_all)]
pub struct PySchedulerStats {
    num_running: usize,
    num_waiting: usize,
    num_swapped: usize,
    num_blocks: usize,
    num_free_blocks: usize,
    kv_usage: f64,
    group_kv_usage: Vec<f64>,
    num_swap_blocks: usize,
    num_free_swap_blocks: usize,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    num_preemptions: u64,
    spec_num_drafts: u64,
    spec_num_draft_tokens: u64,
    spec_num_accepted_tokens: u64,
    spec_num_pauses: u64,
    num_tier_blocks: usize,
    num_used_tier_blocks: usize,
    tier_queried_blocks: u64,
    tier_hit_blocks: u64,
    tier_stored_blocks: u64,
    tier_loaded_blocks: u64,
    tier_evicted_blocks: u64,
}

impl From<Stats> for PySchedulerStats {
    fn from(s: Stats) -> Self {
        Self {
            num_running: s.num_running,
            num_waiting: s.num_waiting,
            num_swapped: s.num_swapped,
            num_blocks: s.num_blocks,
            num_free_blocks: s.num_free_blocks,
            kv_usage: s.kv_usage,
            group_kv_usage: s.group_kv_usage,
            num_swap_blocks: s.num_swap_blocks,
            num_free_swap_blocks: s.num_free_swap_blocks,
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
            num_preemptions: s.num_preemptions,
            spec_num_drafts: s.spec_num_drafts,
            spec_num_draft_tokens: s.spec_num_draft_tokens,
            spec_num_accepted_tokens: s.spec_num_accepted_tokens,
            spec_num_pauses: s.spec_num_pauses,
            num_tier_blocks: s.num_tier_blocks,
            num_used_tier_blocks: s.num_used_tier_blocks,
            tier_queried_blocks: s.tier.queried_blocks,
            tier_hit_blocks: s.tier.hit_blocks,
            tier_stored_blocks: s.tier.stored_blocks,
            tier_loaded_blocks: s.tier.loaded_blocks,
            tier_evicted_blocks: s.tier.evicted_blocks,
        }
    }
}

#[pymethods]
impl PySchedulerStats {
    fn __repr__(&self) -> String {
        format!(
            "SchedulerStats(num_running={}, num_waiting={}, num_swapped={}, num_blocks={}, num_free_blocks={}, \
             kv_usage={:.4}, num_swap_blocks={}, num_free_swap_blocks={}, prefix_cache_queries={}, \
             prefix_cache_hits={}, num_preemptions={})",
            self.num_running,
            self.num_waiting,
            self.num_swapped,
            self.num_blocks,
            self.num_free_blocks,
            self.kv_usage,
            self.num_swap_blocks,
            self.num_free_swap_blocks,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.num_preemptions
        )
    }
}
