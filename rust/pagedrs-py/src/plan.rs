//! `StepPlan`: the core plan's arrays, turned into numpy arrays (owning the Rust buffers, no
//! copy) the first time each is read. `block_tables` is gathered from the scheduler's persistent
//! block table only when read.

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;

use pagedrs_core::StepPlan;

use crate::errors::to_py;
use crate::scheduler::PyScheduler;

enum Arr<T> {
    Raw(Vec<T>),
    Py(Py<PyAny>),
}

impl<T: numpy::Element> Arr<T> {
    /// `cols == 0`: 1-D; else 2-D `[len / cols, cols]`.
    fn get(&mut self, py: Python<'_>, cols: usize) -> Py<PyAny> {
        if let Arr::Raw(v) = self {
            let v = std::mem::take(v);
            let arr = if let Some(rows) = v.len().checked_div(cols) {
                let a = Array2::from_shape_vec((rows, cols), v).expect("plan array shape");
                PyArray2::from_owned_array(py, a).into_any().unbind()
            } else {
                v.into_pyarray(py).into_any().unbind()
            };
            *self = Arr::Py(arr);
        }
        match self {
            Arr::Py(a) => a.clone_ref(py),
            Arr::Raw(_) => unreachable!(),
        }
    }
}

/// One scheduler step as numpy arrays. Block ops run in this order before the forward:
/// grow pool, block_moves, swap_out, swap_in, copies; shrink after it.
#[pyclass(module = "pagedrs._core", name = "StepPlan")]
pub struct PyStepPlan {
    #[pyo3(get)]
    pub step_id: u64,
    req_ids: Arr<i64>,
    num_scheduled_tokens: Arr<i32>,
    num_computed_tokens: Arr<i32>,
    num_prompt_tokens: Arr<i32>,
    seq_lens: Arr<i32>,
    query_start_loc: Arr<i32>,
    input_ids: Arr<i64>,
    positions: Arr<i64>,
    slot_mapping: Arr<i64>,
    block_table_rows: Arr<i32>,
    changed_rows: Arr<i32>,
    /// Built from the persistent rows on first read.
    block_tables: Option<Py<PyAny>>,
    max_blocks: usize,
    sched: Py<PyScheduler>,
    logits_indices: Arr<i64>,
    sampled_seq_ids: Arr<i64>,
    swap_out: Arr<i64>,
    swap_in: Arr<i64>,
    copies: Arr<i64>,
    block_moves: Arr<i64>,
    preempted: Arr<i64>,
    #[pyo3(get)]
    num_blocks: usize,
    #[pyo3(get)]
    num_prefill_tokens: usize,
    #[pyo3(get)]
    num_decode_tokens: usize,
    #[pyo3(get)]
    num_tokens: usize,
    num_reqs: usize,
    num_sampled: usize,
}

impl PyStepPlan {
    pub fn new(p: StepPlan, sched: Py<PyScheduler>) -> Self {
        Self {
            step_id: p.step_id,
            num_reqs: p.req_ids.len(),
            num_sampled: p.sampled_seq_ids.len(),
            req_ids: Arr::Raw(p.req_ids),
            num_scheduled_tokens: Arr::Raw(p.num_scheduled_tokens),
            num_computed_tokens: Arr::Raw(p.num_computed_tokens),
            num_prompt_tokens: Arr::Raw(p.num_prompt_tokens),
            seq_lens: Arr::Raw(p.seq_lens),
            query_start_loc: Arr::Raw(p.query_start_loc),
            input_ids: Arr::Raw(p.input_ids),
            positions: Arr::Raw(p.positions),
            slot_mapping: Arr::Raw(p.slot_mapping),
            block_table_rows: Arr::Raw(p.block_table_rows),
            changed_rows: Arr::Raw(p.changed_rows),
            block_tables: None,
            max_blocks: p.max_blocks,
            sched,
            logits_indices: Arr::Raw(p.logits_indices),
            sampled_seq_ids: Arr::Raw(p.sampled_seq_ids),
            swap_out: Arr::Raw(p.swap_out),
            swap_in: Arr::Raw(p.swap_in),
            copies: Arr::Raw(p.copies),
            block_moves: Arr::Raw(p.block_moves),
            preempted: Arr::Raw(p.preempted),
            num_blocks: p.num_blocks,
            num_prefill_tokens: p.num_prefill_tokens,
            num_decode_tokens: p.num_decode_tokens,
            num_tokens: p.num_tokens,
        }
    }
}

#[pymethods]
impl PyStepPlan {
    #[getter]
    fn req_ids(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.req_ids.get(py, 0)
    }
    #[getter]
    fn num_scheduled_tokens(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.num_scheduled_tokens.get(py, 0)
    }
    #[getter]
    fn num_computed_tokens(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.num_computed_tokens.get(py, 0)
    }
    #[getter]
    fn num_prompt_tokens(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.num_prompt_tokens.get(py, 0)
    }
    #[getter]
    fn seq_lens(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.seq_lens.get(py, 0)
    }
    #[getter]
    fn query_start_loc(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.query_start_loc.get(py, 0)
    }
    #[getter]
    fn input_ids(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.input_ids.get(py, 0)
    }
    #[getter]
    fn positions(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.positions.get(py, 0)
    }
    #[getter]
    fn slot_mapping(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.slot_mapping.get(py, 0)
    }
    /// int32 [B, max_blocks], padded with 0: `block_table_view()[block_table_rows, :max_blocks]`,
    /// built on first read; readable until the next `schedule()`.
    #[getter]
    fn block_tables(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        if let Some(a) = &self.block_tables {
            return Ok(a.clone_ref(py));
        }
        let (step, max_blocks) = (self.step_id, self.max_blocks);
        let flat = {
            // Python may write to the rows array once it has it: copy it before the GIL goes.
            let owned;
            let rows: &[i32] = match &self.block_table_rows {
                Arr::Raw(v) => v,
                Arr::Py(a) => {
                    owned = a.bind(py).cast::<PyArray1<i32>>()?.to_vec()?;
                    &owned
                }
            };
            self.sched
                .get()
                .detached(py, |s| s.padded_block_tables(step, rows, max_blocks))?
                .map_err(to_py)?
        };
        let a =
            Array2::from_shape_vec((self.num_reqs, max_blocks), flat).expect("plan array shape");
        let a = PyArray2::from_owned_array(py, a).into_any().unbind();
        self.block_tables = Some(a.clone_ref(py));
        Ok(a)
    }
    /// int32 [B]: the row of `Scheduler.block_table_view()` holding each batch entry's blocks.
    #[getter]
    fn block_table_rows(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.block_table_rows.get(py, 0)
    }
    /// int32 [k]: rows of `Scheduler.block_table_view()` this plan's `schedule()` rewrote.
    #[getter]
    fn changed_rows(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.changed_rows.get(py, 0)
    }
    #[getter]
    fn logits_indices(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.logits_indices.get(py, 0)
    }
    #[getter]
    fn sampled_seq_ids(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.sampled_seq_ids.get(py, 0)
    }
    #[getter]
    fn swap_out(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.swap_out.get(py, 2)
    }
    #[getter]
    fn swap_in(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.swap_in.get(py, 2)
    }
    #[getter]
    fn copies(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.copies.get(py, 2)
    }
    #[getter]
    fn block_moves(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.block_moves.get(py, 2)
    }
    #[getter]
    fn preempted(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.preempted.get(py, 0)
    }

    fn __repr__(&self) -> String {
        format!(
            "StepPlan(step_id={}, num_reqs={}, num_tokens={}, num_prefill_tokens={}, num_decode_tokens={}, \
             num_sampled={}, num_blocks={})",
            self.step_id,
            self.num_reqs,
            self.num_tokens,
            self.num_prefill_tokens,
            self.num_decode_tokens,
            self.num_sampled,
            self.num_blocks
        )
    }
}
