//! `Scheduler`: argument conversion and delegation to `pagedrs_core::Scheduler`.

use numpy::ndarray::ArrayView2;
use numpy::{IntoPyArray, PyArray2, PyReadonlyArray1};
use pyo3::prelude::*;

use pagedrs_core::{Config, NewRequest, Scheduler, SpecProposer};

use crate::errors::{invalid, to_py};
use crate::plan::PyStepPlan;
use crate::prefix::PyKVEvents;
use crate::shared::SharedScheduler;
use crate::types::{PyFinishReason, PySchedulerStats};

/// Continuous-batching scheduler over a paged KV-cache block pool. Thread-safe: calls from other
/// threads wait (with the GIL released) while `schedule()` / `update()` run.
#[pyclass(module = "pagedrs._core", name = "Scheduler", frozen)]
pub struct PyScheduler {
    inner: SharedScheduler,
}

impl PyScheduler {
    /// Runs `f` on the scheduler (see [`SharedScheduler::with`]).
    pub(crate) fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Scheduler) -> R + Send,
    ) -> PyResult<R> {
        self.inner.with(py, f)
    }

    /// Always releases the GIL: for work that grows with the batch.
    pub(crate) fn detached<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Scheduler) -> R + Send,
    ) -> PyResult<R> {
        self.inner.detached(py, f)
    }
}

fn size(name: &str, v: i64, min: i64) -> PyResult<usize> {
    if v < min {
        return Err(invalid(format!("{name} must be >= {min}, got {v}")));
    }
    Ok(v as usize)
}

/// Token ids from a numpy integer array (no per-element Python objects) or any int sequence.
fn token_ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i64>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        if let Ok(s) = a.as_slice() {
            return Ok(s.to_vec());
        }
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        if let Ok(s) = a.as_slice() {
            return Ok(s.iter().map(|&x| i64::from(x)).collect());
        }
    }
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(invalid(format!(
            "{what} must be a sequence of ints, got a str"
        )));
    }
    obj.extract::<Vec<i64>>()
        .map_err(|e| invalid(format!("{what} must be a sequence of ints: {e}")))
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (*, num_blocks, block_size=16, max_num_batched_tokens=2048, max_num_seqs=256,
                        max_model_len=2048, enable_prefix_caching=true, enable_chunked_prefill=true,
                        num_swap_blocks=0, watermark=0.01, vocab_size=None, num_speculative_tokens=0,
                        spec_method=None, prompt_lookup_min=1, prompt_lookup_max=3,
                        spec_disable_batch_size=None, spec_adaptive=true, num_tier_blocks=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: i64,
        block_size: i64,
        max_num_batched_tokens: i64,
        max_num_seqs: i64,
        max_model_len: i64,
        enable_prefix_caching: bool,
        enable_chunked_prefill: bool,
        num_swap_blocks: i64,
        watermark: f64,
        vocab_size: Option<i64>,
        num_speculative_tokens: i64,
        spec_method: Option<&str>,
        prompt_lookup_min: i64,
        prompt_lookup_max: i64,
        spec_disable_batch_size: Option<i64>,
        spec_adaptive: bool,
        num_tier_blocks: i64,
    ) -> PyResult<Self> {
        let spec_proposer = match spec_method {
            Some("ngram") => SpecProposer::Ngram {
                min: size("prompt_lookup_min", prompt_lookup_min, 1)?,
                max: size("prompt_lookup_max", prompt_lookup_max, 1)?,
            },
            None | Some("runner") => SpecProposer::Runner,
            Some(other) => {
                return Err(invalid(format!(
                    "spec_method must be 'ngram', 'runner' or None, got {other:?}"
                )))
            }
        };
        let cfg = Config {
            num_blocks: size("num_blocks", num_blocks, 1)?,
            block_size: size("block_size", block_size, 1)?,
            max_num_batched_tokens: size("max_num_batched_tokens", max_num_batched_tokens, 1)?,
            max_num_seqs: size("max_num_seqs", max_num_seqs, 1)?,
            max_model_len: size("max_model_len", max_model_len, 1)?,
            enable_prefix_caching,
            enable_chunked_prefill,
            num_swap_blocks: size("num_swap_blocks", num_swap_blocks, 0)?,
            num_tier_blocks: size("num_tier_blocks", num_tier_blocks, 0)?,
            watermark,
            vocab_size: vocab_size.map(|v| size("vocab_size", v, 1)).transpose()?,
            num_speculative_tokens: size("num_speculative_tokens", num_speculative_tokens, 0)?,
            spec_proposer,
            spec_disable_batch_size: spec_disable_batch_size
                .map(|v| size("spec_disable_batch_size", v, 1))
                .transpose()?,
            spec_adaptive,
        };
        let inner = Scheduler::new(cfg).map_err(to_py)?;
        Ok(Self {
            inner: SharedScheduler::new(inner),
        })
    }

    #[pyo3(signature = (seq_ids, prompt_token_ids, *, max_tokens, min_tokens=0, eos_token_ids=Vec::new(),
                        stop_token_ids=Vec::new(), ignore_eos=false, priority=0, cache_salt=None,
                        skip_prefix_cache=false, speculate=false))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &self,
        py: Python<'_>,
        seq_ids: Vec<i64>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: i64,
        min_tokens: i64,
        eos_token_ids: Vec<i64>,
        stop_token_ids: Vec<i64>,
        ignore_eos: bool,
        priority: i64,
        cache_salt: Option<String>,
        skip_prefix_cache: bool,
        speculate: bool,
    ) -> PyResult<()> {
        let req = NewRequest {
            seq_ids,
            prompt_token_ids: token_ids(prompt_token_ids, "prompt_token_ids")?,
            max_tokens,
            min_tokens,
            eos_token_ids,
            stop_token_ids,
            ignore_eos,
            priority,
            cache_salt,
            skip_prefix_cache,
            speculate,
        };
        self.with(py, |s| s.add_request(req))?.map_err(to_py)
    }

    /// Prompt ranges (start, end) of `seq_id` a prefill chunk takes whole (never ends inside one).
    fn set_atomic_spans(
        &self,
        py: Python<'_>,
        seq_id: i64,
        spans: Vec<(usize, usize)>,
    ) -> PyResult<()> {
        self.with(py, |s| s.set_atomic_spans(seq_id, spans))
    }

    /// The encoder rows (image tokens) one step may reach first (`max_num_encoder_input_tokens`).
    fn set_encoder_budget(
        &self,
        py: Python<'_>,
        max_num_encoder_input_tokens: usize,
    ) -> PyResult<()> {
        self.with(py, |s| s.set_encoder_budget(max_num_encoder_input_tokens))
    }

    /// Image spans (start, end, image hash) of `seq_id`, charged to the step whose chunk reaches
    /// each first, unless its output is cached or the step charged its hash already.
    fn set_encoder_spans(
        &self,
        py: Python<'_>,
        seq_id: i64,
        spans: Vec<(usize, usize, String)>,
    ) -> PyResult<()> {
        self.with(py, |s| s.set_encoder_spans(seq_id, spans))
    }

    /// The runner's encoder cache changed: `added` image hashes are held now, `removed` ones not.
    fn update_encoder_cache(
        &self,
        py: Python<'_>,
        added: Vec<String>,
        removed: Vec<String>,
    ) -> PyResult<()> {
        self.with(py, |s| s.update_encoder_cache(added, removed))
    }

    /// Encoder rows the last scheduled step charged to its budget.
    fn encoder_rows_charged(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| s.encoder_rows_charged())
    }

    fn schedule(slf: &Bound<'_, Self>) -> PyResult<PyStepPlan> {
        let plan = slf
            .get()
            .detached(slf.py(), |s| s.schedule())?
            .map_err(to_py)?;
        Ok(PyStepPlan::new(plan, slf.get().inner.clone()))
    }

    /// Zero-copy read-only view of the persistent block table, int32 [max_num_seqs, width].
    #[allow(unsafe_code)]
    fn block_table_view<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let py = slf.py();
        let (addr, rows, width) = slf.get().with(py, |s| {
            let t = s.block_table();
            (t.as_slice().as_ptr() as usize, t.num_rows(), t.width())
        })?;
        // SAFETY: the table is one allocation of `rows * width` i32 made when the scheduler was
        // built and never reallocated or freed before the scheduler is (`BlockTable` has no
        // method that replaces it). The array's base object is this scheduler, so the memory
        // outlives the array. Only `schedule()` writes it, in place; the array is read-only.
        let arr = unsafe {
            let view = ArrayView2::from_shape_ptr((rows, width), addr as *const i32);
            PyArray2::borrow_from_array(&view, slf.clone().into_any())
        };
        arr.getattr("flags")?.setattr("writeable", false)?;
        Ok(arr)
    }

    /// Returns finished sequences: (seq_id, FinishReason, stop_token_id or None).
    fn update(
        &self,
        py: Python<'_>,
        plan: PyRef<'_, PyStepPlan>,
        sampled_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(i64, PyFinishReason, Option<i64>)>> {
        let step = plan.step_id;
        drop(plan);
        let arr = sampled_token_ids
            .extract::<PyReadonlyArray1<'_, i64>>()
            .ok();
        let owned;
        let ids: &[i64] = match arr.as_ref().and_then(|a| a.as_slice().ok()) {
            Some(s) => s,
            None => {
                owned = token_ids(sampled_token_ids, "sampled_token_ids")?;
                &owned
            }
        };
        let finished = self.detached(py, |s| s.update(step, ids))?.map_err(to_py)?;
        Ok(finished
            .into_iter()
            .map(|f| (f.seq_id, f.reason.into(), f.stop_token))
            .collect())
    }

    /// `update` for a plan with drafts: sampled sequence `i` emitted `counts[i]` tokens (accepted
    /// drafts, then one more), flattened in `token_ids`. Returns (finished, kept): `kept[i]` of
    /// sequence `i`'s tokens count (fewer when a stop condition ended it early).
    #[allow(clippy::type_complexity)]
    fn update_spec(
        &self,
        py: Python<'_>,
        plan: PyRef<'_, PyStepPlan>,
        token_ids: PyReadonlyArray1<'_, i64>,
        counts: PyReadonlyArray1<'_, i32>,
    ) -> PyResult<(Vec<(i64, PyFinishReason, Option<i64>)>, Py<PyAny>)> {
        let step = plan.step_id;
        drop(plan);
        let tokens = token_ids.as_slice()?;
        let counts = counts.as_slice()?;
        let (finished, kept) = self
            .detached(py, |s| s.update_spec(step, tokens, counts))?
            .map_err(to_py)?;
        let finished = finished
            .into_iter()
            .map(|f| (f.seq_id, f.reason.into(), f.stop_token))
            .collect();
        Ok((finished, kept.into_pyarray(py).into_any().unbind()))
    }

    /// The wall time in seconds of the step last updated, for the governor that pauses speculation
    /// measured slower than plain decoding (with `spec_adaptive`).
    fn observe_step_time(&self, py: Python<'_>, secs: f64) -> PyResult<()> {
        self.with(py, |s| s.observe_step_time(secs))
    }

    /// Steps left in the governor's current pause of speculation (0: not paused).
    #[getter]
    fn spec_pause_left(&self, py: Python<'_>) -> PyResult<u32> {
        self.with(py, |s| s.spec_pause_left())
    }

    fn abort(&self, py: Python<'_>, seq_ids: Vec<i64>) -> PyResult<()> {
        self.with(py, |s| s.abort(&seq_ids))
    }

    fn resize(&self, py: Python<'_>, num_blocks: i64) -> PyResult<()> {
        if num_blocks < 1 {
            return Err(to_py(pagedrs_core::Error::Resize(format!(
                "num_blocks must be >= 1, got {num_blocks}"
            ))));
        }
        self.with(py, |s| s.resize(num_blocks as usize))?
            .map_err(to_py)
    }

    /// Adds the KV-cache group of the layers attending to the last `window` tokens, with its own
    /// pool of `num_blocks` blocks and a swap pool as large as the primary one (before any
    /// request); returns its index in the plan's group arrays.
    fn add_window_group(&self, py: Python<'_>, window: i64, num_blocks: i64) -> PyResult<usize> {
        let (w, n) = (
            size("window", window, 1)?,
            size("num_blocks", num_blocks, 1)?,
        );
        self.with(py, |s| s.add_window_group(w, n))?.map_err(to_py)
    }

    /// Adds the recurrent-state group of the linear-attention layers with `num_slots` live state
    /// slots (at least max_num_seqs) and `num_snapshots` snapshot slots for prefix caching (0:
    /// none), before any request, without swap space; returns its index in the plan's group
    /// arrays.
    #[pyo3(signature = (num_slots, num_snapshots = 0))]
    fn add_recurrent_group(
        &self,
        py: Python<'_>,
        num_slots: i64,
        num_snapshots: i64,
    ) -> PyResult<usize> {
        let n = size("num_slots", num_slots, 1)?;
        let k = size("num_snapshots", num_snapshots, 0)?;
        self.with(py, |s| s.add_recurrent_group(n, k))?
            .map_err(to_py)
    }

    /// Per KV-cache group beside the full-attention pool, in group order: (name, window or None,
    /// num_blocks, num_free_blocks).
    #[allow(clippy::type_complexity)]
    fn kv_group_pools(
        &self,
        py: Python<'_>,
    ) -> PyResult<Vec<(String, Option<usize>, usize, usize)>> {
        self.with(py, |s| {
            s.kv_group_stats()
                .into_iter()
                .map(|g| (g.name, g.window, g.num_blocks, g.num_free_blocks))
                .collect()
        })
    }

    /// Group `group`'s block ids for a live seq id (-1 where it holds nothing any more).
    fn group_blocks_of(&self, py: Python<'_>, group: usize, seq_id: i64) -> PyResult<Vec<i64>> {
        let blocks = self
            .with(py, |s| s.group_blocks_of(group, seq_id))?
            .map_err(to_py)?;
        Ok(blocks
            .into_iter()
            .map(|b| if b == u32::MAX { -1 } else { i64::from(b) })
            .collect())
    }

    /// (hash, parent hash, block index) of a live seq id's full blocks from the first one neither
    /// the prefix cache nor the host KV tier holds (for a disk tier behind the host tier).
    fn tier_missing_chain(&self, py: Python<'_>, seq_id: i64) -> PyResult<Vec<(u64, u64, usize)>> {
        self.with(py, |s| s.tier_missing_chain(seq_id))?
            .map_err(to_py)
    }

    /// The host KV tier slot for a block read from outside the device pool (None: held, or no slot).
    fn tier_insert(
        &self,
        py: Python<'_>,
        hash: u64,
        parent: u64,
        tokens: Vec<u32>,
    ) -> PyResult<Option<u32>> {
        self.with(py, |s| s.tier_insert(hash, parent, &tokens))
    }

    /// The (hash, parent hash, tokens) a host KV tier slot holds (None: a free slot).
    fn tier_record(&self, py: Python<'_>, slot: u32) -> PyResult<Option<(u64, u64, Vec<u32>)>> {
        self.with(py, |s| s.tier_record(slot))
    }

    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |s| s.reset_prefix_cache())
    }

    fn has_unfinished(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |s| s.has_unfinished())
    }

    fn num_unfinished(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| s.num_unfinished())
    }

    fn stats(&self, py: Python<'_>) -> PyResult<PySchedulerStats> {
        Ok(self.with(py, |s| s.stats())?.into())
    }

    fn num_cached_tokens(&self, py: Python<'_>, seq_id: i64) -> PyResult<usize> {
        self.with(py, |s| s.num_cached_tokens(seq_id))?
            .map_err(to_py)
    }

    /// Output token ids of a live seq id (the newest included): the engine's one copy of them.
    fn output_token_ids(&self, py: Python<'_>, seq_id: i64) -> PyResult<Vec<u32>> {
        self.with(py, |s| s.output_token_ids(seq_id))?
            .map_err(to_py)
    }

    fn num_output_tokens(&self, py: Python<'_>, seq_id: i64) -> PyResult<usize> {
        self.with(py, |s| s.num_output_tokens(seq_id))?
            .map_err(to_py)
    }

    /// Raises PagedrsError naming the first broken invariant (debugging; O(pool + tokens)).
    /// Starts (with an empty log) or stops recording prefix-cache events; off by default.
    fn set_kv_events(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        self.with(py, |s| s.set_kv_events(on))
    }

    #[getter]
    fn kv_events_enabled(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |s| s.kv_events_enabled())
    }

    /// The prefix-cache events since the last call, in order (empty when recording is off).
    fn take_kv_events(&self, py: Python<'_>) -> PyResult<PyKVEvents> {
        self.with(py, |s| s.take_kv_events()).map(PyKVEvents::from)
    }

    /// The host KV tier's stored and evicted blocks since the last call (medium "CPU"), if recording.
    fn take_tier_kv_events(&self, py: Python<'_>) -> PyResult<PyKVEvents> {
        self.with(py, |s| s.take_tier_kv_events())
            .map(PyKVEvents::from)
    }

    /// Each KV-cache group's prefix-cache events since the last call, in group order.
    fn take_group_kv_events(&self, py: Python<'_>) -> PyResult<Vec<PyKVEvents>> {
        self.with(py, |s| s.take_group_kv_events())
            .map(|v| v.into_iter().map(PyKVEvents::from).collect())
    }

    /// The hashes of the blocks in the prefix cache now (sorted): what the KV events add up to.
    fn cached_block_hashes(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.with(py, |s| {
            let mut h: Vec<u64> = s.pool().cache().hashes().collect();
            h.sort_unstable();
            h
        })
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.detached(py, |s| s.check_invariants())?.map_err(to_py)
    }

    #[getter]
    fn block_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| s.block_size())
    }

    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| s.num_blocks())
    }

    #[getter]
    fn max_model_len(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| s.max_model_len())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |s| {
            let st = s.stats();
            format!(
                "Scheduler(num_blocks={}, block_size={}, running={}, waiting={}, swapped={}, free_blocks={})",
                st.num_blocks,
                s.block_size(),
                st.num_running,
                st.num_waiting,
                st.num_swapped,
                st.num_free_blocks
            )
        })
    }
}
