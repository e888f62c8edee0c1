//! Prefix-cache hashing as the scheduler does it, for routers that predict cache hits.

use pyo3::prelude::*;

use pagedrs_core::config::to_token_ids;
use pagedrs_core::kv_events;
use pagedrs_core::prefix_cache::extra_key_of;

use crate::errors::{invalid, to_py};

/// The extra key the scheduler hashes into a request's first block: 0 without a cache salt.
#[pyfunction]
#[pyo3(signature = (cache_salt=None))]
pub fn prefix_extra_key(cache_salt: Option<&str>) -> u64 {
    cache_salt.map_or(0, extra_key_of)
}

/// The chained hashes of the full blocks of `tokens` (u64), as the scheduler caches them.
#[pyfunction]
#[pyo3(signature = (tokens, block_size, extra_key=0))]
pub fn prefix_block_hashes(
    py: Python<'_>,
    tokens: Vec<i64>,
    block_size: i64,
    extra_key: u64,
) -> PyResult<Vec<u64>> {
    if block_size <= 0 {
        return Err(invalid(format!(
            "block_size must be >= 1, got {block_size}"
        )));
    }
    let toks = to_token_ids(&tokens, None).map_err(to_py)?;
    Ok(py.detach(|| kv_events::prefix_block_hashes(&toks, block_size as usize, extra_key)))
}
