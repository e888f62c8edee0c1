//! `StepPlan`: the core plan's arrays, turned into numpy arrays (owning the Rust buffers, no
//! copy) the first time each is read. `block_tables` is gathered from the scheduler's persistent
//! block table only when read.

use numpy::ndarray::{Array2, ArrayD, IxDyn};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayDyn, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;

use pagedrs_core::StepPlan;

use crate::errors::to_py;
use crate::shared::SharedScheduler;

enum Arr<T> {
    Raw(Vec<T>),
    Py(Py<PyAny>),
}

impl<T: numpy::Element + Clone> Arr<T> {
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

    /// As [`Self::get`], with the array in `shape` (whose product is the length).
    fn get_shaped(&mut self, py: Python<'_>, shape: &[usize]) -> Py<PyAny> {
        if let Arr::Raw(v) = self {
            let v = std::mem::take(v);
            let a = ArrayD::from_shape_vec(IxDyn(shape), v).expect("plan array shape");
            *self = Arr::Py(PyArrayDyn::from_owned_array(py, a).into_any().unbind());
        }
        match self {
            Arr::Py(a) => a.clone_ref(py),
            Arr::Raw(_) => unreachable!(),
        }
    }

    /// The values, wherever they live now (a numpy array Python has read, or the Rust buffer).
    fn to_vec(&self, py: Python<'_>) -> PyResult<Vec<T>> {
        match self {
            Arr::Raw(v) => Ok(v.clone()),
            Arr::Py(a) => Ok(a.bind(py).cast::<PyArrayDyn<T>>()?.to_vec()?),
        }
    }
}

/// One scheduler step as numpy arrays. Block ops run in this order before the forward:
/// grow pool, tier_store, block_moves, swap_out, swap_in, tier_load, copies; shrink after it.
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
    /// The scheduler whose persistent table `block_tables` is gathered from; None for a plan
    /// received over the step wire (its dense tables came with it).
    sched: Option<SharedScheduler>,
    logits_indices: Arr<i64>,
    sampled_seq_ids: Arr<i64>,
    num_draft_tokens: Arr<i32>,
    draft_token_ids: Arr<i64>,
    /// Whether any sampled sequence speculates in this step.
    #[pyo3(get)]
    has_drafts: bool,
    swap_out: Arr<i64>,
    swap_in: Arr<i64>,
    copies: Arr<i64>,
    block_moves: Arr<i64>,
    preempted: Arr<i64>,
    tier_store: Arr<i64>,
    tier_load: Arr<i64>,
    group_slot_mapping: Arr<i64>,
    group_block_tables: Arr<i32>,
    group_copies: Arr<i64>,
    group_num_copies: Arr<i32>,
    group_swap_out: Arr<i64>,
    group_swap_in: Arr<i64>,
    group_block_moves: Arr<i64>,
    group_num_blocks: Arr<i64>,
    #[pyo3(get)]
    num_groups: usize,
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
    pub fn new(p: StepPlan, sched: SharedScheduler) -> Self {
        Self::build(p, Some(sched))
    }

    fn build(p: StepPlan, sched: Option<SharedScheduler>) -> Self {
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
            has_drafts: !p.draft_token_ids.is_empty(),
            num_draft_tokens: Arr::Raw(p.num_draft_tokens),
            draft_token_ids: Arr::Raw(p.draft_token_ids),
            swap_out: Arr::Raw(p.swap_out),
            swap_in: Arr::Raw(p.swap_in),
            copies: Arr::Raw(p.copies),
            block_moves: Arr::Raw(p.block_moves),
            preempted: Arr::Raw(p.preempted),
            tier_store: Arr::Raw(p.tier_store),
            tier_load: Arr::Raw(p.tier_load),
            num_groups: p.group_num_copies.len(),
            group_slot_mapping: Arr::Raw(p.group_slot_mapping),
            group_block_tables: Arr::Raw(p.group_block_tables),
            group_copies: Arr::Raw(p.group_copies),
            group_num_copies: Arr::Raw(p.group_num_copies),
            group_swap_out: Arr::Raw(p.group_swap_out),
            group_swap_in: Arr::Raw(p.group_swap_in),
            group_block_moves: Arr::Raw(p.group_block_moves),
            group_num_blocks: Arr::Raw(p.group_num_blocks),
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
        let Some(sched) = &self.sched else {
            unreachable!("a plan from the step wire carries its block tables")
        };
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
            sched
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
    fn num_draft_tokens(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.num_draft_tokens.get(py, 0)
    }

    #[getter]
    fn draft_token_ids(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.draft_token_ids.get(py, 0)
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
    /// int64 [k, 2]: (device block, tier slot) pairs to copy into the host KV tier first.
    #[getter]
    fn tier_store(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.tier_store.get(py, 2)
    }
    /// int64 [k, 2]: (tier slot, device block) pairs to copy from the host KV tier.
    #[getter]
    fn tier_load(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.tier_load.get(py, 2)
    }
    /// int64 [G, T]: each KV-cache group's slot of every token.
    #[getter]
    fn group_slot_mapping(&mut self, py: Python<'_>) -> Py<PyAny> {
        let t = self.num_tokens;
        self.group_slot_mapping
            .get_shaped(py, &[self.num_groups, t])
    }
    /// int32 [G, B, max_blocks]: each KV-cache group's block tables, padded with 0.
    #[getter]
    fn group_block_tables(&mut self, py: Python<'_>) -> Py<PyAny> {
        let shape = [self.num_groups, self.num_reqs, self.max_blocks];
        self.group_block_tables.get_shaped(py, &shape)
    }
    /// int64 [k, 2]: copy-on-write pairs (src, dst) of every group, in group order.
    #[getter]
    fn group_copies(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.group_copies.get(py, 2)
    }
    /// int32 [G]: copy-on-write pairs of each group in `group_copies`.
    #[getter]
    fn group_num_copies(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.group_num_copies.get(py, 0)
    }
    /// int64 [k, 3]: (group, device block, swap block) of every group's blocks to swap out.
    #[getter]
    fn group_swap_out(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.group_swap_out.get(py, 3)
    }
    /// int64 [k, 3]: (group, swap block, device block) of every group's blocks to swap in.
    #[getter]
    fn group_swap_in(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.group_swap_in.get(py, 3)
    }
    /// int64 [k, 3]: (group, src, dst) moves of every group's blocks by a pool resize.
    #[getter]
    fn group_block_moves(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.group_block_moves.get(py, 3)
    }
    /// int64 [G]: each group's pool size after this plan (0 for a group without a pool).
    #[getter]
    fn group_num_blocks(&mut self, py: Python<'_>) -> Py<PyAny> {
        self.group_num_blocks.get(py, 0)
    }

    /// `(header, payload)`: this plan, its dense block tables and `extra_logits_indices` as two
    /// int64 arrays for the tensor-parallel step broadcast (`StepPlan.from_wire` reads them).
    #[pyo3(name = "to_wire", signature = (extra_logits_indices=None))]
    fn pack_wire(
        &mut self,
        py: Python<'_>,
        extra_logits_indices: Option<PyReadonlyArray1<'_, i64>>,
    ) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
        let tables = self.block_tables(py)?;
        let tables: Vec<i32> = tables.bind(py).cast::<PyArrayDyn<i32>>()?.to_vec()?;
        let extra = match &extra_logits_indices {
            Some(a) => a.as_slice()?.to_vec(),
            None => Vec::new(),
        };
        let plan = StepPlan {
            step_id: self.step_id,
            req_ids: self.req_ids.to_vec(py)?,
            num_scheduled_tokens: self.num_scheduled_tokens.to_vec(py)?,
            num_computed_tokens: self.num_computed_tokens.to_vec(py)?,
            num_prompt_tokens: self.num_prompt_tokens.to_vec(py)?,
            seq_lens: self.seq_lens.to_vec(py)?,
            query_start_loc: self.query_start_loc.to_vec(py)?,
            input_ids: self.input_ids.to_vec(py)?,
            positions: self.positions.to_vec(py)?,
            slot_mapping: self.slot_mapping.to_vec(py)?,
            block_table_rows: self.block_table_rows.to_vec(py)?,
            changed_rows: self.changed_rows.to_vec(py)?,
            max_blocks: self.max_blocks,
            logits_indices: self.logits_indices.to_vec(py)?,
            sampled_seq_ids: self.sampled_seq_ids.to_vec(py)?,
            num_draft_tokens: self.num_draft_tokens.to_vec(py)?,
            draft_token_ids: self.draft_token_ids.to_vec(py)?,
            swap_out: self.swap_out.to_vec(py)?,
            swap_in: self.swap_in.to_vec(py)?,
            copies: self.copies.to_vec(py)?,
            block_moves: self.block_moves.to_vec(py)?,
            preempted: self.preempted.to_vec(py)?,
            tier_store: self.tier_store.to_vec(py)?,
            tier_load: self.tier_load.to_vec(py)?,
            group_slot_mapping: self.group_slot_mapping.to_vec(py)?,
            group_block_tables: self.group_block_tables.to_vec(py)?,
            group_copies: self.group_copies.to_vec(py)?,
            group_num_copies: self.group_num_copies.to_vec(py)?,
            group_swap_out: self.group_swap_out.to_vec(py)?,
            group_swap_in: self.group_swap_in.to_vec(py)?,
            group_block_moves: self.group_block_moves.to_vec(py)?,
            group_num_blocks: self.group_num_blocks.to_vec(py)?,
            num_blocks: self.num_blocks,
            num_prefill_tokens: self.num_prefill_tokens,
            num_decode_tokens: self.num_decode_tokens,
            num_tokens: self.num_tokens,
        };
        let (header, payload) = plan.to_wire(&tables, &extra);
        Ok((
            header.into_pyarray(py).into_any().unbind(),
            payload.into_pyarray(py).into_any().unbind(),
        ))
    }

    /// `(plan, extra_logits_indices)` from a `to_wire` message; ValueError if it does not add up.
    #[staticmethod]
    fn from_wire(
        py: Python<'_>,
        header: PyReadonlyArray1<'_, i64>,
        payload: PyReadonlyArray1<'_, i64>,
    ) -> PyResult<(PyStepPlan, Py<PyAny>)> {
        let wire = StepPlan::from_wire(header.as_slice()?, payload.as_slice()?).map_err(to_py)?;
        let (rows, cols) = (wire.plan.num_reqs(), wire.plan.max_blocks);
        let tables =
            Array2::from_shape_vec((rows, cols), wire.block_tables).expect("checked shape");
        let mut plan = PyStepPlan::build(wire.plan, None);
        plan.block_tables = Some(PyArray2::from_owned_array(py, tables).into_any().unbind());
        let extra = wire
            .extra_logits_indices
            .into_pyarray(py)
            .into_any()
            .unbind();
        Ok((plan, extra))
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
