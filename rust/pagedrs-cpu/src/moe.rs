//! The fused experts step of a mixture-of-experts layer (vLLM's `fused_moe`, llama.cpp's `mul_mat_id`):
//! `out[t] = sum_s weights[t, s] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` over each token's `top_k`
//! experts `e = ids[t, s]`, the sum taken in slot order.
//!
//! The step's (token, slot) pairs are sorted by expert once (a stable counting sort); each active
//! expert's rows are gathered into one contiguous block, and its weights are multiplied against all of
//! them in one pass: tasks on the warm thread pool are (expert, run of weight rows), so every weight row
//! of an active expert is read once per step and an expert no token chose is never read. Experts are
//! float32 (`ExpertWeights::F32`) or GGUF-quantized rows of the types the dense kernels take
//! (`ExpertWeights::Quant`, activations quantized per expert as `quant::quant_matmul` does), or Q4_0 /
//! Q4_1 / Q8_0 rows repacked 8 at a time at load (`ExpertWeights::QuantX8`, the dense x8 kernels); the
//! kernels are chosen at run time (`Isa`).
//!
//! Layouts: `x` `[T, H]`; `ids`, `weights` `[T, k]`; gate_up `[E, 2I, H]` (each expert's gate rows
//! then its up rows); down `[E, H, I]`; `out` `[T, H]`. Biases and gpt-oss's clamped SwiGLU: `epilogue`.

mod epilogue;
#[cfg(target_arch = "x86_64")]
mod f32_panel;
mod f32_tile;
mod quant_x8;
pub use epilogue::{ExpertAct, ExpertEpilogue};
use f32_tile::{f32_tile, f32_wide};

use crate::ops::silu_and_mul;
use crate::pool::{parallel_for, SharedOut};
use crate::quant::{row_groups, Isa, MatmulDims, QuantType, QuantizedActs, Tile};
use crate::KernelError;

/// Sizes of one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub tokens: usize,
    pub top_k: usize,
    pub hidden: usize,
    /// The experts' intermediate size (this rank's share under tensor parallelism).
    pub inter: usize,
    pub experts: usize,
}

/// One stacked expert weight: `E` matrices of `[rows, cols]`.
#[derive(Clone, Copy, Debug)]
pub enum ExpertWeights<'a> {
    F32(&'a [f32]),
    /// GGUF blocks, each matrix row `qt.row_bytes(cols)` bytes.
    Quant(QuantType, &'a [u8]),
    /// The same blocks with each matrix in the 8-row interleaved layout (`quant::x8::pack` of the
    /// stacked `[E * rows, row_bytes]`; a type `x8::packs`, rows a multiple of 8).
    QuantX8(QuantType, &'a [u8]),
}

impl ExpertWeights<'_> {
    fn check(
        &self,
        name: &'static str,
        e: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        match *self {
            ExpertWeights::F32(w) => KernelError::check_len(name, w.len(), e * rows * cols),
            ExpertWeights::QuantX8(qt, w) => {
                if !crate::quant::x8::packs(qt) || rows % crate::quant::x8::ROWS != 0 {
                    return Err(KernelError::Packing {
                        qtype: qt.name(),
                        n: rows,
                    });
                }
                ExpertWeights::Quant(qt, w).check(name, e, rows, cols)
            }
            ExpertWeights::Quant(qt, w) => {
                if cols == 0 || cols % qt.block_len() != 0 {
                    return Err(KernelError::BlockLen {
                        qtype: qt.name(),
                        k: cols,
                        block: qt.block_len(),
                    });
                }
                KernelError::check_len(name, w.len(), e * rows * qt.row_bytes(cols))
            }
        }
    }
}

/// Tasks per thread of one pass (as the dense kernels: a slowed-down thread leaves its tail to others).
const TASKS_PER_THREAD: usize = 4;
/// The fewest weight rows per task.
const MIN_ROWS_PER_TASK: usize = 16;

/// The fused experts step on the kernels `Isa::chosen()` picks.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    gate_up: ExpertWeights<'_>,
    down: ExpertWeights<'_>,
    x: &[f32],
    ids: &[i64],
    weights: &[f32],
    out: &mut [f32],
    d: &MoeDims,
    num_threads: usize,
) -> Result<(), KernelError> {
    moe_experts_with(
        Isa::chosen(),
        gate_up,
        down,
        x,
        ids,
        weights,
        out,
        d,
        num_threads,
    )
}

/// `moe_experts` on the kernels chosen by the caller (the nearest ones this CPU runs).
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_with(
    isa: Isa,
    gate_up: ExpertWeights<'_>,
    down: ExpertWeights<'_>,
    x: &[f32],
    ids: &[i64],
    weights: &[f32],
    out: &mut [f32],
    d: &MoeDims,
    num_threads: usize,
) -> Result<(), KernelError> {
    let plain = ExpertEpilogue::default();
    moe_experts_epilogue(
        isa,
        gate_up,
        down,
        &plain,
        x,
        ids,
        weights,
        out,
        d,
        num_threads,
    )
}

/// `moe_experts_with` with the experts' biases and activation given (`ExpertEpilogue`): `out[t] = sum_s
/// weights[t, s] * (down_e(act(gate_up_e(x[t]) + b_gu[e])) + b_down[e])`.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_epilogue(
    isa: Isa,
    gate_up: ExpertWeights<'_>,
    down: ExpertWeights<'_>,
    epi: &ExpertEpilogue<'_>,
    x: &[f32],
    ids: &[i64],
    weights: &[f32],
    out: &mut [f32],
    d: &MoeDims,
    num_threads: usize,
) -> Result<(), KernelError> {
    validate(&gate_up, &down, x, ids, weights, out, d)?;
    epi.check(d.experts, d.inter, d.hidden)?;
    let isa = isa.or_supported();
    let (h, inter, k) = (d.hidden, d.inter, d.top_k);
    let pairs = d.tokens * k;
    if pairs == 0 || h == 0 {
        return Ok(());
    }
    let sorted = SortedPairs::new(ids, d.experts);
    // the pairs' rows gathered in expert order: each expert's rows one contiguous block
    let mut xs = vec![0.0f32; pairs * h];
    for (row, &p) in xs.chunks_exact_mut(h).zip(&sorted.pair) {
        let t = p as usize / k;
        row.copy_from_slice(&x[t * h..][..h]);
    }
    let mut gu = vec![0.0f32; pairs * 2 * inter];
    let mut y = vec![0.0f32; pairs * h];
    if inter > 0 {
        grouped_matmul(
            isa,
            gate_up,
            &sorted,
            &xs,
            h,
            &mut gu,
            2 * inter,
            num_threads,
        );
        if let Some(b) = epi.gate_up_bias {
            epilogue::add_bias(&sorted, &mut gu, b, 2 * inter);
        }
        let mut act = vec![0.0f32; pairs * inter];
        match epi.act {
            ExpertAct::SiluMul => silu_and_mul(&gu, inter, &mut act)?,
            ExpertAct::ClampedSwiglu { alpha, limit } => {
                epilogue::clamped_swiglu(&gu, inter, alpha, limit, &mut act)
            }
        }
        grouped_matmul(isa, down, &sorted, &act, inter, &mut y, h, num_threads);
    }
    if let Some(b) = epi.down_bias {
        epilogue::add_bias(&sorted, &mut y, b, h);
    }
    combine(&sorted, &y, weights, out, d, num_threads);
    Ok(())
}

fn validate(
    gate_up: &ExpertWeights<'_>,
    down: &ExpertWeights<'_>,
    x: &[f32],
    ids: &[i64],
    weights: &[f32],
    out: &[f32],
    d: &MoeDims,
) -> Result<(), KernelError> {
    if d.experts == 0 {
        return Err(KernelError::Zero { name: "experts" });
    }
    if d.top_k == 0 {
        return Err(KernelError::Zero { name: "top_k" });
    }
    KernelError::check_len("x", x.len(), d.tokens * d.hidden)?;
    KernelError::check_len("ids", ids.len(), d.tokens * d.top_k)?;
    KernelError::check_len("weights", weights.len(), d.tokens * d.top_k)?;
    KernelError::check_len("out", out.len(), d.tokens * d.hidden)?;
    gate_up.check("gate_up", d.experts, 2 * d.inter, d.hidden)?;
    down.check("down", d.experts, d.hidden, d.inter)?;
    for (index, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= d.experts {
            return Err(KernelError::Row {
                index,
                id,
                n: d.experts,
            });
        }
    }
    Ok(())
}

/// The (token, slot) pairs sorted by expert, stably: `pair[s]` is the flat pair index (`t * k + slot`)
/// of sorted row `s`, `pos[p]` the sorted row of pair `p`, expert `e`'s rows `start[e]..start[e + 1]`.
struct SortedPairs {
    pair: Vec<u32>,
    pos: Vec<u32>,
    start: Vec<usize>,
}

impl SortedPairs {
    fn new(ids: &[i64], experts: usize) -> Self {
        let mut start = vec![0usize; experts + 1];
        for &e in ids {
            start[e as usize + 1] += 1;
        }
        for e in 0..experts {
            start[e + 1] += start[e];
        }
        let mut next = start.clone();
        let mut pair = vec![0u32; ids.len()];
        let mut pos = vec![0u32; ids.len()];
        for (p, &e) in ids.iter().enumerate() {
            let s = next[e as usize];
            next[e as usize] += 1;
            pair[s] = p as u32;
            pos[p] = s as u32;
        }
        SortedPairs { pair, pos, start }
    }

    /// (expert, first sorted row, rows) of every expert that has rows.
    fn active(&self) -> Vec<(usize, usize, usize)> {
        (0..self.start.len() - 1)
            .filter(|&e| self.start[e + 1] > self.start[e])
            .map(|e| (e, self.start[e], self.start[e + 1] - self.start[e]))
            .collect()
    }
}

/// `out[s, :n] = a[s, :kdim] @ W_e^T` for every sorted row `s` of expert `e` (W_e `[n, kdim]`), one task
/// per (active expert, run of weight rows).
#[allow(clippy::too_many_arguments)]
fn grouped_matmul(
    isa: Isa,
    w: ExpertWeights<'_>,
    sorted: &SortedPairs,
    a: &[f32],
    kdim: usize,
    out: &mut [f32],
    n: usize,
    num_threads: usize,
) {
    let active = sorted.active();
    let threads = num_threads.max(1);
    let per_task = (n * active.len())
        .div_ceil(threads * TASKS_PER_THREAD)
        .max(MIN_ROWS_PER_TASK)
        .min(n);
    let chunks = n.div_ceil(per_task);
    let tasks = active.len() * chunks;
    if let ExpertWeights::QuantX8(qt, w) = w {
        let t = TASKS_PER_THREAD;
        quant_x8::grouped_matmul_x8(isa, qt, w, &active, a, kdim, out, n, threads, t);
        return;
    }
    let out = SharedOut::new(out);
    match w {
        ExpertWeights::F32(w) => {
            let wide = f32_wide(isa);
            parallel_for(threads, tasks, &|task| {
                let (e, s0, m) = active[task / chunks];
                let j0 = task % chunks * per_task;
                let rows = j0..(j0 + per_task).min(n);
                let we = &w[e * n * kdim..][..n * kdim];
                let ae = &a[s0 * kdim..][..m * kdim];
                #[cfg(target_arch = "x86_64")]
                if wide {
                    // SAFETY: AVX2 and FMA are supported (`f32_wide`); this task alone writes columns `rows`
                    // of the expert's output rows `s0..s0 + m`.
                    #[allow(unsafe_code)]
                    unsafe {
                        f32_panel::panel(we, ae, kdim, out, s0, n, rows);
                    }
                    return;
                }
                let _ = wide;
                f32_tile(isa, we, ae, kdim, out, s0, n, rows);
            })
        }
        ExpertWeights::QuantX8(..) => unreachable!("taken above"),
        ExpertWeights::Quant(qt, w) => {
            let rb = qt.row_bytes(kdim);
            let mut acts: Vec<Option<(QuantizedActs, Vec<_>)>> =
                (0..active.len()).map(|_| None).collect();
            let slots = SharedOut::new(&mut acts);
            parallel_for(threads, active.len(), &|i| {
                let (_, s0, m) = active[i];
                let q = QuantizedActs::new_with(isa, &a[s0 * kdim..][..m * kdim], m, kdim);
                let groups = row_groups(isa, qt, &q);
                // SAFETY: task `i` alone writes slot `i`; `acts` outlives the call.
                #[allow(unsafe_code)]
                unsafe {
                    *slots.at(i) = Some((q, groups));
                }
            });
            parallel_for(threads, tasks, &|task| {
                let i = task / chunks;
                let (e, s0, m) = active[i];
                let Some((q, groups)) = &acts[i] else {
                    return;
                };
                let j0 = task % chunks * per_task;
                let tile = Tile {
                    isa,
                    qt,
                    w: &w[e * n * rb..][..n * rb],
                    row_bytes: rb,
                    acts: q,
                    groups,
                    out: out.offset(s0 * n),
                    d: MatmulDims {
                        m,
                        k: kdim,
                        n,
                        ldo: n,
                        col0: 0,
                    },
                };
                tile.run(j0..(j0 + per_task).min(n));
            });
        }
    }
}

/// `out[t] = sum_s weights[t, s] * y[pos[t * k + s]]`, slots in order; tokens split over the threads.
fn combine(
    sorted: &SortedPairs,
    y: &[f32],
    weights: &[f32],
    out: &mut [f32],
    d: &MoeDims,
    threads: usize,
) {
    let (h, k) = (d.hidden, d.top_k);
    let per_task = d.tokens.div_ceil(threads.max(1) * TASKS_PER_THREAD).max(8);
    let tasks = d.tokens.div_ceil(per_task);
    let out = SharedOut::new(out);
    parallel_for(threads, tasks, &|task| {
        for t in task * per_task..((task + 1) * per_task).min(d.tokens) {
            // SAFETY: token `t`'s row is written by this task only; `out` holds `tokens * h` floats.
            #[allow(unsafe_code)]
            let row = unsafe { std::slice::from_raw_parts_mut(out.at(t * h), h) };
            row.fill(0.0);
            for s in 0..k {
                let wt = weights[t * k + s];
                let yr = &y[sorted.pos[t * k + s] as usize * h..][..h];
                for (o, &v) in row.iter_mut().zip(yr) {
                    *o += v * wt;
                }
            }
        }
    });
}

#[cfg(test)]
mod tests;
