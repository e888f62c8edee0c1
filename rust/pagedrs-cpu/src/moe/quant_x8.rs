//! Quantized experts in the 8-row interleaved layout (`quant::x8`, each expert's matrix packed on its
//! own: `x8::pack` of the stacked `[E * rows, row_bytes]`, rows a multiple of 8): each expert's rows,
//! quantized once, against its packed groups of 8 weight rows, 8 outputs at a time without horizontal
//! sums, on the dense x8 kernels (`quant::x8_group_rows`), so a row gets the bits the dense packed matmul
//! gives it.

use crate::pool::{parallel_for, SharedOut};
use crate::quant::{x8, x8_group_rows, Isa, QuantType, QuantizedActs};

/// `out[s, :n] = a[s, :kdim] @ W_e^T` for the sorted rows `s` of each active expert `(e, s0, m)`, W packed
/// (`[E, n, kdim]` of `qt`, `n` a multiple of 8); tasks are (active expert, run of 8-row groups).
#[allow(clippy::too_many_arguments)]
pub(super) fn grouped_matmul_x8(
    isa: Isa,
    qt: QuantType,
    w: &[u8],
    active: &[(usize, usize, usize)],
    a: &[f32],
    kdim: usize,
    out: &mut [f32],
    n: usize,
    threads: usize,
    tasks_per_thread: usize,
) {
    let rb = qt.row_bytes(kdim);
    let nb = kdim / qt.block_len();
    let groups = n / x8::ROWS;
    let group_bytes = x8::ROWS * rb;
    let acts: Vec<QuantizedActs> = active
        .iter()
        .map(|&(_, s0, m)| QuantizedActs::new_with(isa, &a[s0 * kdim..][..m * kdim], m, kdim))
        .collect();
    // groups per task: `tasks_per_thread` tasks per thread over all the active experts' groups
    let per_task = (groups * active.len())
        .div_ceil(threads * tasks_per_thread)
        .max(2)
        .min(groups.max(1));
    let chunks = groups.div_ceil(per_task);
    let out = SharedOut::new(out);
    parallel_for(threads, active.len() * chunks, &|task| {
        let i = task / chunks;
        let (e, s0, m) = active[i];
        let we = &w[e * n * rb..][..n * rb];
        let g0 = task % chunks * per_task;
        for g in g0..(g0 + per_task).min(groups) {
            let store = |r: usize, v: [f32; x8::ROWS]| {
                // SAFETY: row `s0 + r` < pairs and columns `8g..8g + 8` <= n; only this task writes
                // them (tasks split an expert's groups, experts own disjoint rows).
                #[allow(unsafe_code)]
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        v.as_ptr(),
                        out.at((s0 + r) * n + g * x8::ROWS),
                        x8::ROWS,
                    );
                }
            };
            x8_group_rows(
                isa,
                qt,
                &we[g * group_bytes..][..group_bytes],
                nb,
                &acts[i],
                m,
                &store,
            );
        }
    });
}
