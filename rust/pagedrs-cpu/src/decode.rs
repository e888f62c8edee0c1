//! Paged decode attention on CPU: one query token per sequence attends to its cached context, read in
//! place through the block table (no gather copy).
//!
//! Work item = (sequence, KV head). An item reads each of its key rows once for all the query heads of
//! its group (GQA), computes the scores, a softmax in f32, then accumulates the value rows. Items are
//! handed to the warm pool's threads one at a time; each writes its own slice of `out` (the heads of a
//! group are adjacent: head = kv_head * group + g). Consecutive sequences that are one request's query
//! tokens (a speculative verification) go together per KV head instead (`query_runs`, `attend_run`),
//! each token with the arithmetic it gets alone.
//! Inner loops are written over fixed-width lane arrays so they auto-vectorize; on x86-64 a copy compiled
//! for AVX2 + FMA is chosen at run time when the CPU has them (the wheel targets baseline x86-64), as
//! `Isa::chosen()` says (`PAGEDRS_CPU_ISA` caps it) or as the caller asks (`DecodeParams::isa`).
//! Head sizes 64, 128 and 256 get copies with the size known at compile time; any other size runs the
//! same code with the size read at run time.
//! Scores are `scale * q.k`, optionally soft-capped (`cap * tanh(s / cap)`, as HF's Gemma 2 does to its
//! attention logits) before the softmax. Optional attention sinks (a learned logit per query head, as
//! HF's GptOssAttention and vLLM's `sinks`) join each softmax: the max includes the head's sink and the
//! denominator adds `exp(sink - max)`; the sink contributes no value row.
//!
//! The pieces: `items` (one (sequence, KV head) at a time), `runs` (a verification's query tokens
//! together), `vector` (the inner loops, portable and AVX2 + FMA), `avx2` (their intrinsics).

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(crate) mod avx2;
mod items;
mod runs;
#[cfg(test)]
mod tests;
mod vector;

use std::ops::Range;

use crate::quant::Isa;
use crate::KernelError;

use items::run_items;
use runs::{query_runs, run_task};

/// Shapes: q and out `[num_seqs, num_heads, head_size]`, kv_cache
/// `[2, num_blocks, block_size, num_kv_heads, head_size]`, block_tables `[num_seqs, max_blocks_per_seq]`,
/// seq_lens `[num_seqs]` (context length including the query token).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeDims {
    pub num_seqs: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_size: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
}

/// What a decode computes besides its shapes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeParams<'a> {
    /// Multiplies `q.k` (the score before the softmax).
    pub scale: f32,
    /// A query at position `p` sees keys `p - w + 1 ..= p` (all of them when `None`).
    pub sliding_window: Option<usize>,
    /// Scores become `cap * tanh(s / cap)` before the softmax (HF's `attn_logit_softcapping`); `None`:
    /// unchanged.
    pub logits_soft_cap: Option<f32>,
    /// One logit per query head (`[num_heads]`) in every softmax's denominator (gpt-oss); `None`: no sink.
    pub sinks: Option<&'a [f32]>,
    /// The kernels to run; ones this CPU lacks give way to the nearest ones below that it runs.
    pub isa: Isa,
}

impl DecodeParams<'_> {
    /// `scale`, no window, no soft cap, no sinks, the kernels `Isa::chosen()` names.
    pub fn new(scale: f32) -> Self {
        Self {
            scale,
            sliding_window: None,
            logits_soft_cap: None,
            sinks: None,
            isa: Isa::chosen(),
        }
    }
}

/// Everything a work item reads, validated once.
struct Ctx<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    block_tables: &'a [i32],
    seq_lens: &'a [i32],
    d: DecodeDims,
    group: usize,
    scale: f32,
    sliding_window: Option<usize>,
    soft_cap: Option<f32>,
    /// Per query head (`[num_heads]`, checked).
    sinks: Option<&'a [f32]>,
    /// Run the AVX2 + FMA copy (the CPU has both).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    avx2: bool,
}

impl Ctx<'_> {
    /// Positions `start..len` a sequence attends to (its window), as a range.
    fn context(&self, seq: usize) -> Range<usize> {
        let len = self.seq_lens[seq] as usize;
        let start = self.sliding_window.map_or(0, |w| len.saturating_sub(w));
        start..len
    }
}

/// Decode attention for `dims.num_seqs` single-token queries; writes every element of `out`.
/// A sequence with length 0 gets zeros. Deterministic for any `num_threads` (each item is computed by
/// one thread in a fixed order).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_f32(
    q: &[f32],
    kv_cache: &[f32],
    block_tables: &[i32],
    seq_lens: &[i32],
    out: &mut [f32],
    dims: &DecodeDims,
    params: &DecodeParams<'_>,
    num_threads: usize,
) -> Result<(), KernelError> {
    let sliding_window = params.sliding_window;
    validate(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        dims,
        sliding_window,
    )?;
    if let Some(sinks) = params.sinks {
        KernelError::check_len("sinks", sinks.len(), dims.num_heads)?;
    }
    if let Some(cap) = params.logits_soft_cap {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(KernelError::NotPositive {
                name: "logits_soft_cap",
                value: cap.to_string(),
            });
        }
    }
    let d = *dims;
    let half = d.num_blocks * d.block_size * d.num_kv_heads * d.head_size;
    let (k, v) = kv_cache.split_at(half);
    let ctx = Ctx {
        q,
        k,
        v,
        block_tables,
        seq_lens,
        d,
        group: d.num_heads / d.num_kv_heads,
        scale: params.scale,
        sliding_window,
        soft_cap: params.logits_soft_cap,
        sinks: params.sinks,
        avx2: uses_avx2(params.isa),
    };
    let item_len = ctx.group * d.head_size;
    let num_items = d.num_seqs * d.num_kv_heads;
    let runs = query_runs(&ctx, num_threads);
    if runs.is_empty() {
        let threads = num_threads.clamp(1, num_items.max(1));
        if threads == 1 {
            run_items(&ctx, 0, out);
            return Ok(());
        }
        // One task per item on the warm pool (the tasks are handed out in order, so the long and the
        // short contexts even out); each item's output is its own slice.
        let out = crate::pool::SharedOut::new(out);
        crate::pool::parallel_for(threads, num_items, &|item| {
            // SAFETY: items are disjoint `item_len` runs of `out` (`num_items * item_len` elements,
            // checked in `validate`), and each task index is run exactly once.
            #[allow(unsafe_code)]
            let mine = unsafe { std::slice::from_raw_parts_mut(out.at(item * item_len), item_len) };
            run_items(&ctx, item, mine);
        });
        return Ok(());
    }
    // Runs of query tokens of one sequence: one task per (run, KV head), each reading the rows once for
    // all its tokens; each token's output is its own slice, written by one task.
    let num_tasks = runs.len() * d.num_kv_heads;
    let out = crate::pool::SharedOut::new(out);
    crate::pool::parallel_for(num_threads.clamp(1, num_tasks), num_tasks, &|task| {
        let (first, count) = runs[task / d.num_kv_heads];
        run_task(&ctx, first, count, task % d.num_kv_heads, out);
    });
    Ok(())
}

fn validate(
    q: &[f32],
    kv_cache: &[f32],
    block_tables: &[i32],
    seq_lens: &[i32],
    out: &[f32],
    d: &DecodeDims,
    sliding_window: Option<usize>,
) -> Result<(), KernelError> {
    for (name, v) in [
        ("num_kv_heads", d.num_kv_heads),
        ("head_size", d.head_size),
        ("block_size", d.block_size),
        ("sliding_window", sliding_window.unwrap_or(1)),
    ] {
        if v == 0 {
            return Err(KernelError::Zero { name });
        }
    }
    if d.num_heads % d.num_kv_heads != 0 {
        return Err(KernelError::Heads {
            num_heads: d.num_heads,
            num_kv_heads: d.num_kv_heads,
        });
    }
    let qo = d.num_seqs * d.num_heads * d.head_size;
    let kv = 2 * d.num_blocks * d.block_size * d.num_kv_heads * d.head_size;
    for (name, actual, expected) in [
        ("q", q.len(), qo),
        ("out", out.len(), qo),
        ("kv_cache", kv_cache.len(), kv),
        (
            "block_tables",
            block_tables.len(),
            d.num_seqs * d.max_blocks_per_seq,
        ),
        ("seq_lens", seq_lens.len(), d.num_seqs),
    ] {
        if actual != expected {
            return Err(KernelError::Length {
                name,
                actual,
                expected,
            });
        }
    }
    let max = d.max_blocks_per_seq * d.block_size;
    for (seq, &len) in seq_lens.iter().enumerate() {
        if len < 0 || len as usize > max {
            return Err(KernelError::SeqLen {
                seq,
                len: i64::from(len),
                max,
            });
        }
        let len = len as usize;
        let start = sliding_window.map_or(0, |w| len.saturating_sub(w));
        // Only the blocks this sequence reads must be valid (the rest of the row is padding).
        let row = &block_tables[seq * d.max_blocks_per_seq..][..d.max_blocks_per_seq];
        let used = start / d.block_size..len.div_ceil(d.block_size);
        for (idx, &block) in row.iter().enumerate().take(used.end).skip(used.start) {
            if block < 0 || block as usize >= d.num_blocks {
                return Err(KernelError::Block {
                    seq,
                    idx,
                    block: i64::from(block),
                    num_blocks: d.num_blocks,
                });
            }
        }
    }
    Ok(())
}

/// Whether `isa` (or the nearest kernels below it that this CPU runs) means the AVX2 + FMA copy; the
/// portable copy otherwise (on aarch64 it is compiled for baseline Armv8, NEON included).
fn uses_avx2(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(isa.or_supported(), Isa::Avx2 | Isa::Avx512Vnni)
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}
