//! Prefix-cache hashing as the scheduler does it, for routers that predict cache hits.

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, ToPyArray};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use pagedrs_core::config::to_token_ids;
use pagedrs_core::kv_events::{self, KvEvents};
use pagedrs_core::prefix_cache::{extra_key_of, root_hash};

use crate::errors::{invalid, to_py};

/// The extra key the scheduler hashes into a request's first block: 0 without a cache salt.
#[pyfunction]
#[pyo3(signature = (cache_salt=None))]
pub fn prefix_extra_key(cache_salt: Option<&str>) -> u64 {
    cache_salt.map_or(0, extra_key_of)
}

/// The parent hash of a request's first block (its blocks chain from it) under `extra_key`.
#[pyfunction]
pub fn prefix_root_hash(extra_key: u64) -> u64 {
    root_hash(extra_key)
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

/// Prefix-cache events drained from the scheduler, in the order they happened: kinds (0 stored,
/// 1 removed, 2 cleared), hashes, and for stored blocks their parent hash, extra key and tokens.
#[pyclass(module = "pagedrs._core", name = "KVEvents", frozen)]
pub struct PyKVEvents {
    inner: KvEvents,
}

impl From<KvEvents> for PyKVEvents {
    fn from(inner: KvEvents) -> Self {
        Self { inner }
    }
}

#[pymethods]
impl PyKVEvents {
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }

    #[getter]
    fn kinds<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u8>> {
        let k: Vec<u8> = self.inner.kinds.iter().map(|&k| k as u8).collect();
        k.into_pyarray(py)
    }

    #[getter]
    fn hashes<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.hashes.to_pyarray(py)
    }

    #[getter]
    fn parents<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.parents.to_pyarray(py)
    }

    #[getter]
    fn extra_keys<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        self.inner.extra_keys.to_pyarray(py)
    }

    /// The stored blocks' tokens, one row per stored event: uint32 [num_stored, block_size].
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<u32>>> {
        let bs = self.inner.block_size.max(1);
        let rows = self.inner.tokens.len() / bs;
        let a = Array2::from_shape_vec((rows, bs), self.inner.tokens.clone())
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(a.into_pyarray(py))
    }

    /// (stored, removed, cleared): the net change, applied as clear, then remove, then store.
    fn net(&self) -> (Vec<u64>, Vec<u64>, bool) {
        let n = self.inner.net();
        (n.stored, n.removed, n.cleared)
    }
}
