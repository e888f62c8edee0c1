//! Matmuls over weights kept in llama.cpp's GGUF block layouts: `y[M, N] = x[M, K] @ W[N, K]^T`, with
//! each row of W stored as its GGUF blocks (the layout of the file's tensor data, unchanged).
//!
//! As llama.cpp does: the activations are quantized to 8 bits per block of 32 once per call, then each
//! output is a sum of integer dot products (32 weights at a time) times the two block scales. Weight
//! rows are split over the warm thread pool; each weight row is unpacked once per group of activation
//! rows (8, 4, 2 or 1 rows; see `row_groups`).
//! On x86-64 the AVX2 + FMA + F16C kernels are chosen at run time (with AVX-512 VNNI's `vpdpbusd` in
//! the x8 kernels where the CPU has it), on aarch64 the NEON ones (with the `dotprod` extension's `sdot`
//! where the CPU has it); elsewhere (or without them) the portable decoder runs.
//!
//! The pieces: `isa` (which kernels run), `act` (the quantized activations; `q8_block` quantizes one
//! block), `formats` (the GGUF blocks), `tile` (a task's weight rows against the activation row groups)
//! over the kernels (`avx2`, `neon`, `act::dot_portable`), `x8` and `matmul_x8` (the 8-row interleaved
//! layout), `get_rows` (embedding lookups).

mod act;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2;
mod formats;
mod get_rows;
mod isa;
mod matmul_x8;
#[cfg(target_arch = "aarch64")]
#[allow(unsafe_code)]
mod neon;
mod q8_block;
mod tile;
pub mod x8;
mod x8k;

pub use act::{dot_portable, ActRow, Interleaved, QuantizedActs, RowGroup};
pub use formats::{dequantize_row, f16_to_f32, QuantType};
pub use get_rows::{quant_get_rows, quant_get_rows_x8};
pub use isa::Isa;
pub use matmul_x8::quant_matmul_x8_with;
pub(crate) use matmul_x8::x8_group_rows;
pub(crate) use tile::{row_groups, Tile};

use crate::pool::{parallel_for, SharedOut};
use crate::KernelError;

/// Shapes of one call: x `[m, k]`, W `[n, k]` (as `n` rows of `qt.row_bytes(k)` bytes), and out rows of
/// `ldo` floats of which columns `col0..col0 + n` are written (so the pieces of a fused layer whose
/// weights have different types can write one output).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulDims {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub ldo: usize,
    pub col0: usize,
}

/// Tasks per thread of one call: each task is a contiguous run of weight rows, so that every thread
/// reads the weights as a few long sequential streams (the hardware prefetchers follow them; at batch 1
/// the matmuls stream ~100 MB of weights per step). Measured on the 2-core AVX2 CI machine, a batch-1
/// step's matmuls over the default model with 2 threads: 16-row tasks (about 100 per call) 12.6 ms,
/// 4 tasks per thread 9.7 ms. More than one task per thread leaves the tail to the others when a thread
/// is slowed down by another process.
const TASKS_PER_THREAD: usize = 4;
/// The fewest output rows per task: enough work to amortize the hand-out.
const MIN_ROWS_PER_TASK: usize = 16;

/// Output rows per task of a call producing `n` columns on `threads` threads.
fn rows_per_task(n: usize, threads: usize) -> usize {
    n.div_ceil(threads.max(1) * TASKS_PER_THREAD)
        .max(MIN_ROWS_PER_TASK)
}

/// `out[i, col0 + j] = sum_k x[i, k] * W[j, k]` for the dims given; the other columns are untouched.
pub fn quant_matmul(
    qt: QuantType,
    w: &[u8],
    x: &[f32],
    out: &mut [f32],
    dims: &MatmulDims,
    num_threads: usize,
) -> Result<(), KernelError> {
    quant_matmul_with(Isa::chosen(), qt, w, x, out, dims, num_threads)
}

/// `quant_matmul` with the kernels chosen by the caller (tests compare them). Kernels this CPU does not
/// run fall back to the nearest ones below that it runs (`Isa::or_supported`).
pub fn quant_matmul_with(
    isa: Isa,
    qt: QuantType,
    w: &[u8],
    x: &[f32],
    out: &mut [f32],
    dims: &MatmulDims,
    num_threads: usize,
) -> Result<(), KernelError> {
    let Some((isa, acts)) = begin(isa, qt, w, x, out, dims)? else {
        return Ok(());
    };
    let d = *dims;
    let groups = row_groups(isa, qt, &acts);
    let row_bytes = qt.row_bytes(d.k);
    let out = SharedOut::new(out);
    let per_task = rows_per_task(d.n, num_threads);
    let tasks = d.n.div_ceil(per_task);
    parallel_for(num_threads, tasks, &|task| {
        let rows = task * per_task..((task + 1) * per_task).min(d.n);
        let tile = Tile {
            isa,
            qt,
            w,
            row_bytes,
            acts: &acts,
            groups: &groups,
            out,
            d,
        };
        tile.run(rows);
    });
    Ok(())
}

/// What both layouts' matmuls do first: check the arguments, pick the kernels that run (`isa` where this
/// CPU has it, else the portable ones) and quantize the activations; None when there is nothing to compute.
fn begin(
    isa: Isa,
    qt: QuantType,
    w: &[u8],
    x: &[f32],
    out: &[f32],
    dims: &MatmulDims,
) -> Result<Option<(Isa, QuantizedActs)>, KernelError> {
    validate(qt, w, x, out, dims)?;
    if dims.m == 0 || dims.n == 0 {
        return Ok(None);
    }
    let isa = isa.or_supported();
    Ok(Some((isa, QuantizedActs::new_with(isa, x, dims.m, dims.k))))
}

fn check_k(qt: QuantType, k: usize) -> Result<(), KernelError> {
    if k == 0 || k % qt.block_len() != 0 {
        return Err(KernelError::BlockLen {
            qtype: qt.name(),
            k,
            block: qt.block_len(),
        });
    }
    Ok(())
}

fn validate(
    qt: QuantType,
    w: &[u8],
    x: &[f32],
    out: &[f32],
    d: &MatmulDims,
) -> Result<(), KernelError> {
    check_k(qt, d.k)?;
    KernelError::check_len("weight", w.len(), d.n * qt.row_bytes(d.k))?;
    KernelError::check_len("x", x.len(), d.m * d.k)?;
    if d.col0 + d.n > d.ldo {
        return Err(KernelError::Columns {
            col0: d.col0,
            n: d.n,
            ldo: d.ldo,
        });
    }
    KernelError::check_len("out", out.len(), d.m * d.ldo)
}

#[cfg(test)]
mod tests;
