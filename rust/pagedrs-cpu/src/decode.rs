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

use std::ops::Range;

use crate::quant::Isa;
use crate::KernelError;

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

/// Width of the accumulator arrays of the inner loops (two AVX2 registers, four SSE2 ones).
const LANES: usize = 16;

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

/// Most query tokens one task takes together.
const MAX_RUN: usize = 16;
/// Rows per block of a run's passes: a multiple of 4 (`scores_64` takes rows 4 at a time from the first),
/// small enough that a block's key and value rows stay in the L1 cache across the run's tokens.
const RUN_BLOCK: usize = 64;

/// The step's sequences as runs `(first, count)` to attend together: consecutive sequences with the same
/// blocks and lengths growing by one are the query tokens of one request (a speculative verification, as
/// the engine hands them over, one "sequence" per token). Empty when no run is longer than one (or under a
/// sliding window, whose per-token ranges start at different rows): the item path then runs as before.
/// With few runs, a run is cut in two so that the threads share the work.
fn query_runs(ctx: &Ctx<'_>, num_threads: usize) -> Vec<(usize, usize)> {
    let d = &ctx.d;
    if ctx.sliding_window.is_some() || d.num_seqs < 2 {
        return Vec::new();
    }
    let used = |s: usize| {
        let n = (ctx.seq_lens[s] as usize).div_ceil(d.block_size);
        &ctx.block_tables[s * d.max_blocks_per_seq..][..n]
    };
    let mut runs: Vec<(usize, usize)> = Vec::new();
    let mut any = false;
    for s in 0..d.num_seqs {
        if let Some((first, count)) = runs.last_mut() {
            let prev = *first + *count - 1;
            let longer = used(s);
            if *count < MAX_RUN
                && ctx.seq_lens[prev] >= 1
                && ctx.seq_lens[s] == ctx.seq_lens[prev] + 1
                && longer.starts_with(used(prev))
                && longer.len() <= used(prev).len() + 1
            {
                *count += 1;
                any = true;
                continue;
            }
        }
        runs.push((s, 1));
    }
    if !any {
        return Vec::new();
    }
    if runs.len() * d.num_kv_heads < 2 * num_threads {
        runs = runs
            .into_iter()
            .flat_map(|(first, count)| {
                let half = count.div_ceil(2);
                [(first, half), (first + half, count - half)]
            })
            .filter(|&(_, count)| count > 0)
            .collect();
    }
    runs
}

/// One task of the run path: the run's tokens for one KV head (a run of one: the item path).
fn run_task(
    ctx: &Ctx<'_>,
    first: usize,
    count: usize,
    kv_head: usize,
    out: crate::pool::SharedOut,
) {
    #[cfg(target_arch = "x86_64")]
    if ctx.avx2 {
        // SAFETY: `ctx.avx2` is set only when the CPU has the features `run_task_avx2` is compiled for.
        #[allow(unsafe_code)]
        unsafe {
            run_task_avx2(ctx, first, count, kv_head, out)
        };
        return;
    }
    run_task_generic::<Portable>(ctx, first, count, kv_head, out);
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_task_avx2(
    ctx: &Ctx<'_>,
    first: usize,
    count: usize,
    kv_head: usize,
    out: crate::pool::SharedOut,
) {
    run_task_generic::<Avx2>(ctx, first, count, kv_head, out);
}

#[inline(always)]
fn run_task_generic<V: Vector>(
    ctx: &Ctx<'_>,
    first: usize,
    count: usize,
    kv_head: usize,
    out: crate::pool::SharedOut,
) {
    let mut scratch = Scratch::default();
    let hd = ctx.d.head_size;
    let item_len = ctx.group * hd;
    // The output of (token `t`, the group's head `h`): its own `hd` floats.
    let head_out = |t: usize, h: usize| {
        let at = ((first + t) * ctx.d.num_heads + kv_head * ctx.group + h) * hd;
        // SAFETY: in bounds (`validate`); (token, head) pairs are disjoint between tasks and within one.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts_mut(out.at(at), hd)
        }
    };
    if count == 1 {
        let item = first * ctx.d.num_kv_heads + kv_head;
        // SAFETY: as `head_out`: the item's `group` heads are adjacent.
        #[allow(unsafe_code)]
        let mine = unsafe { std::slice::from_raw_parts_mut(out.at(item * item_len), item_len) };
        match hd {
            64 => attend::<V, 64>(ctx, item, mine, &mut scratch),
            128 => attend::<V, 128>(ctx, item, mine, &mut scratch),
            256 => attend::<V, 256>(ctx, item, mine, &mut scratch),
            _ => attend::<V, 0>(ctx, item, mine, &mut scratch),
        }
        return;
    }
    match hd {
        64 => attend_run::<V, 64>(ctx, first, count, kv_head, &head_out, &mut scratch),
        128 => attend_run::<V, 128>(ctx, first, count, kv_head, &head_out, &mut scratch),
        256 => attend_run::<V, 256>(ctx, first, count, kv_head, &head_out, &mut scratch),
        _ => attend_run::<V, 0>(ctx, first, count, kv_head, &head_out, &mut scratch),
    }
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

/// The two inner loops: a portable version (auto-vectorized for the build target) and, on x86-64, one
/// written with AVX2 + FMA intrinsics, used only after run-time feature detection.
trait Vector {
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `y += alpha * x`.
    fn axpy(alpha: f32, x: &[f32], y: &mut [f32]);
    /// `out[i] = scale * dot(q, rows[i])`; `HD` is `q.len()` when known at compile time, else 0.
    #[inline(always)]
    fn scores<'a, const HD: usize>(
        q: &[f32],
        rows: impl Iterator<Item = &'a [f32]>,
        scale: f32,
        out: &mut [f32],
    ) {
        for (o, row) in out.iter_mut().zip(rows) {
            *o = Self::dot(q, row) * scale;
        }
    }
    /// `out += sum_i p[i] * rows[i]`, row after row; `HD` is `out.len()` when known at compile time,
    /// else 0.
    #[inline(always)]
    fn weighted_sum<'a, const HD: usize>(
        p: &[f32],
        rows: impl Iterator<Item = &'a [f32]>,
        out: &mut [f32],
    ) {
        for (&w, row) in p.iter().zip(rows) {
            Self::axpy(w, row, out);
        }
    }
    /// `s[i] = cap * tanh(s[i] / cap)` for every element, each independently of the others (a token's
    /// scores get the same bits in a run as alone).
    #[inline(always)]
    fn soft_cap(s: &mut [f32], cap: f32) {
        for x in s.iter_mut() {
            *x = cap * (*x / cap).tanh();
        }
    }
    /// `s[i] = exp(s[i] - max)` for every element (each <= max); returns their sum.
    #[inline(always)]
    fn exp_shifted(s: &mut [f32], max: f32) -> f32 {
        let mut sum = 0.0f32;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        sum
    }
}

struct Portable;
impl Vector for Portable {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        let mut tail = 0.0f32;
        for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
            tail += x * y;
        }
        // LANES independent accumulators: vectorizable without reassociation.
        let mut acc = [0.0f32; LANES];
        for (x, y) in ca.zip(cb) {
            for l in 0..LANES {
                acc[l] += x[l] * y[l];
            }
        }
        let mut w = LANES;
        while w > 1 {
            w /= 2;
            for l in 0..w {
                acc[l] += acc[l + w];
            }
        }
        acc[0] + tail
    }

    #[inline(always)]
    fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        for (yi, &xi) in y.iter_mut().zip(x) {
            *yi += alpha * xi;
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
impl Vector for Avx2 {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: `Avx2` is only used inside `run_items_avx2`, reached after detecting AVX2 and FMA.
        unsafe { avx2::dot(a, b) }
    }

    #[inline(always)]
    fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        // SAFETY: as for `dot`.
        unsafe { avx2::axpy(alpha, x, y) }
    }

    #[inline(always)]
    fn scores<'a, const HD: usize>(
        q: &[f32],
        rows: impl Iterator<Item = &'a [f32]>,
        scale: f32,
        out: &mut [f32],
    ) {
        if HD == 64 {
            // SAFETY: as for `dot`.
            unsafe { avx2::scores_64(q, rows, scale, out) }
        } else {
            for (o, row) in out.iter_mut().zip(rows) {
                *o = Self::dot(q, row) * scale;
            }
        }
    }

    #[inline(always)]
    fn exp_shifted(s: &mut [f32], max: f32) -> f32 {
        // SAFETY: as for `dot`.
        unsafe { avx2::exp_shifted(s, max) }
    }

    #[inline(always)]
    fn soft_cap(s: &mut [f32], cap: f32) {
        // SAFETY: as for `dot`.
        unsafe { avx2::soft_cap(s, cap) }
    }

    #[inline(always)]
    fn weighted_sum<'a, const HD: usize>(
        p: &[f32],
        rows: impl Iterator<Item = &'a [f32]>,
        out: &mut [f32],
    ) {
        if HD == 64 {
            // SAFETY: as for `dot`.
            unsafe { avx2::weighted_sum_64(p, rows, out) }
        } else {
            for (&w, row) in p.iter().zip(rows) {
                Self::axpy(w, row, out);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// Two 8-wide FMA accumulators, then a horizontal sum; scalar FMA tail. Reads `min(len)` elements.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 8)),
                _mm256_loadu_ps(pb.add(i + 8)),
                acc1,
            );
            i += 16;
        }
        if i + 8 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            i += 8;
        }
        let acc = _mm256_add_ps(acc0, acc1);
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        let mut r = _mm_cvtss_f32(s);
        while i < n {
            r = (*pa.add(i)).mul_add(*pb.add(i), r);
            i += 1;
        }
        r
    }

    /// `out[i] = scale * dot(q[..64], rows[i][..64])`: q held in eight registers, rows taken four at a
    /// time into four accumulators reduced together.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores_64<'a>(
        q: &[f32],
        mut rows: impl Iterator<Item = &'a [f32]>,
        scale: f32,
        out: &mut [f32],
    ) {
        assert!(q.len() >= 64);
        let mut qv = [_mm256_setzero_ps(); 8];
        for (j, v) in qv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(q.as_ptr().add(8 * j));
        }
        let row_dot = |row: &[f32]| -> __m256 {
            assert!(row.len() >= 64);
            let p = row.as_ptr();
            let mut a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(p));
            let mut b = _mm256_mul_ps(qv[1], _mm256_loadu_ps(p.add(8)));
            for j in (2..8).step_by(2) {
                a = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(p.add(8 * j)), a);
                b = _mm256_fmadd_ps(qv[j + 1], _mm256_loadu_ps(p.add(8 * j + 8)), b);
            }
            _mm256_add_ps(a, b)
        };
        let vscale = _mm_set1_ps(scale);
        let mut chunks = out.chunks_exact_mut(4);
        for o in &mut chunks {
            let (Some(r0), Some(r1), Some(r2), Some(r3)) =
                (rows.next(), rows.next(), rows.next(), rows.next())
            else {
                return;
            };
            let (a0, a1, a2, a3) = (row_dot(r0), row_dot(r1), row_dot(r2), row_dot(r3));
            // Lane sums of a0..a3 -> one [4] vector.
            let h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(o.as_mut_ptr(), _mm_mul_ps(s, vscale));
        }
        for (o, row) in chunks.into_remainder().iter_mut().zip(rows) {
            let a = row_dot(row);
            let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            *o = _mm_cvtss_f32(s) * scale;
        }
    }

    /// `out[..64] += sum_i p[i] * rows[i][..64]` with the 64 sums held in eight registers.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_sum_64<'a>(
        p: &[f32],
        rows: impl Iterator<Item = &'a [f32]>,
        out: &mut [f32],
    ) {
        assert!(out.len() >= 64);
        let mut acc = [_mm256_setzero_ps(); 8];
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_loadu_ps(out.as_ptr().add(8 * j));
        }
        for (&w, row) in p.iter().zip(rows) {
            assert!(row.len() >= 64);
            let a = _mm256_set1_ps(w);
            for (j, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(a, _mm256_loadu_ps(row.as_ptr().add(8 * j)), *acc);
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * j), *acc);
        }
    }

    /// `exp(x)` of 8 lanes, x <= 0: Cephes' `expf` (range reduction by ln 2 in two parts, degree-5
    /// polynomial; within a few ulp of the correctly rounded value), lanes below -87.3 taken as -87.3
    /// (exp ~ 1e-38, the smallest normal range).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.3));
        let fx = _mm256_floor_ps(_mm256_fmadd_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
            _mm256_set1_ps(0.5),
        ));
        let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
        }
        let y = _mm256_fmadd_ps(
            y,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        // 2^fx with fx >= -126: the exponent field fx + 127 >= 1.
        let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)),
            23,
        ));
        _mm256_mul_ps(y, pow2)
    }

    /// `tanh(x)` of 8 lanes as Cephes' `tanhf`: `x + x^3 P(x^2)` (degree-4 polynomial) where
    /// `|x| < 0.625`, else `1 - 2 / (exp(2|x|) + 1)` with the sign of x, computed as `(1 - t) / (1 + t)`,
    /// `t = exp(-2|x|)` (no cancellation there: t < 0.29); within a few ulp.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn tanh8(x: __m256) -> __m256 {
        let sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0));
        let a = _mm256_andnot_ps(_mm256_set1_ps(-0.0), x);
        let z = _mm256_mul_ps(x, x);
        let mut p = _mm256_set1_ps(-5.704_988_7e-3);
        for c in [2.063_909e-2, -5.373_971_6e-2, 1.333_144_2e-1, -3.333_328e-1] {
            p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(c));
        }
        let small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
        let t = exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0)));
        let one = _mm256_set1_ps(1.0);
        let large = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
        let large = _mm256_or_ps(large, sign);
        let is_small = _mm256_cmp_ps(a, _mm256_set1_ps(0.625), _CMP_LT_OQ);
        _mm256_blendv_ps(large, small, is_small)
    }

    /// `s[i] = cap * tanh(s[i] / cap)` 8 at a time (the tail through a padded copy, the same arithmetic
    /// per element).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn soft_cap(s: &mut [f32], cap: f32) {
        let c = _mm256_set1_ps(cap);
        let capped = |v: __m256| _mm256_mul_ps(c, tanh8(_mm256_div_ps(v, c)));
        let mut chunks = s.chunks_exact_mut(8);
        for ch in &mut chunks {
            _mm256_storeu_ps(ch.as_mut_ptr(), capped(_mm256_loadu_ps(ch.as_ptr())));
        }
        let tail = chunks.into_remainder();
        let mut buf = [0.0f32; 8];
        buf[..tail.len()].copy_from_slice(tail);
        _mm256_storeu_ps(buf.as_mut_ptr(), capped(_mm256_loadu_ps(buf.as_ptr())));
        tail.copy_from_slice(&buf[..tail.len()]);
    }

    /// `s[i] = exp(s[i] - max)` (each `s[i] <= max`) 8 at a time (the tail through a padded copy);
    /// returns their sum.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_shifted(s: &mut [f32], max: f32) -> f32 {
        let m = _mm256_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        let mut chunks = s.chunks_exact_mut(8);
        for c in &mut chunks {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
        let tail = chunks.into_remainder();
        let mut buf = [max; 8];
        buf[..tail.len()].copy_from_slice(tail);
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), m));
        _mm256_storeu_ps(buf.as_mut_ptr(), e);
        tail.copy_from_slice(&buf[..tail.len()]);
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let body = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
            + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        body + tail.iter().sum::<f32>()
    }

    /// `y += alpha * x` over `min(len)` elements.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let a = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= n {
            let v = _mm256_fmadd_ps(a, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
            _mm256_storeu_ps(py.add(i), v);
            i += 8;
        }
        while i < n {
            *py.add(i) = alpha.mul_add(*px.add(i), *py.add(i));
            i += 1;
        }
    }
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

fn run_items(ctx: &Ctx<'_>, first: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if ctx.avx2 {
        // SAFETY: `ctx.avx2` is set only when the CPU has the features `run_items_avx2` is compiled for.
        #[allow(unsafe_code)]
        unsafe {
            run_items_avx2(ctx, first, out)
        };
        return;
    }
    run_items_generic::<Portable>(ctx, first, out);
}

/// The generic loop compiled for AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_items_avx2(ctx: &Ctx<'_>, first: usize, out: &mut [f32]) {
    run_items_generic::<Avx2>(ctx, first, out);
}

#[inline(always)]
fn run_items_generic<V: Vector>(ctx: &Ctx<'_>, first: usize, out: &mut [f32]) {
    let mut scratch = Scratch::default();
    let item_len = ctx.group * ctx.d.head_size;
    let items = out.chunks_exact_mut(item_len).enumerate();
    // Common head sizes get a copy with the size known at compile time (fully unrolled inner loops).
    match ctx.d.head_size {
        64 => items.for_each(|(j, o)| attend::<V, 64>(ctx, first + j, o, &mut scratch)),
        128 => items.for_each(|(j, o)| attend::<V, 128>(ctx, first + j, o, &mut scratch)),
        256 => items.for_each(|(j, o)| attend::<V, 256>(ctx, first + j, o, &mut scratch)),
        _ => items.for_each(|(j, o)| attend::<V, 0>(ctx, first + j, o, &mut scratch)),
    }
}

/// Fills `offsets` with the offset of the K (or V) row of each position of `range` for `kv_head`.
#[inline(always)]
fn row_offsets(
    d: &DecodeDims,
    table: &[i32],
    range: Range<usize>,
    kv_head: usize,
    offsets: &mut Vec<usize>,
) {
    offsets.clear();
    let (bs, hd) = (d.block_size, d.head_size);
    let stride = d.num_kv_heads * hd;
    let mut pos = range.start;
    while pos < range.end {
        let (idx, within) = (pos / bs, pos % bs);
        let take = (bs - within).min(range.end - pos);
        let base = (table[idx] as usize * bs + within) * stride + kv_head * hd;
        offsets.extend((0..take).map(|i| base + i * stride));
        pos += take;
    }
}

/// The query tokens `first..first + count` of one sequence (a run, see `query_runs`) for one KV head:
/// every token's scores, softmax and value sum are `attend`'s, in the same order (rows taken 4 at a time
/// from the first, value sums row after row), so each output has the bits `attend` gives that token
/// alone; the passes go over blocks of `RUN_BLOCK` rows, all tokens per block, so a block's rows are read
/// from memory once for the whole run instead of once per token.
#[inline(always)]
fn attend_run<'o, V: Vector, const HD: usize>(
    ctx: &Ctx<'_>,
    first: usize,
    count: usize,
    kv_head: usize,
    head_out: &impl Fn(usize, usize) -> &'o mut [f32],
    scratch: &mut Scratch,
) {
    let d = &ctx.d;
    let hd = if HD == 0 { d.head_size } else { HD };
    let g = ctx.group;
    let len = |t: usize| ctx.seq_lens[first + t] as usize;
    let n_max = len(count - 1);
    let table =
        &ctx.block_tables[(first + count - 1) * d.max_blocks_per_seq..][..d.max_blocks_per_seq];
    let Scratch {
        scores,
        rows: offsets,
    } = scratch;
    row_offsets(d, table, 0..n_max, kv_head, offsets);
    scores.clear();
    scores.resize(count * g * n_max, 0.0);
    for b0 in (0..n_max).step_by(RUN_BLOCK) {
        for t in (0..count).filter(|&t| b0 < len(t)) {
            let b1 = (b0 + RUN_BLOCK).min(len(t));
            let q = &ctx.q[((first + t) * d.num_heads + kv_head * g) * hd..][..g * hd];
            for (h, qh) in q.chunks_exact(hd).enumerate() {
                let s = &mut scores[(t * g + h) * n_max + b0..][..b1 - b0];
                let rows = offsets[b0..b1].iter().map(|&o| &ctx.k[o..][..hd]);
                V::scores::<HD>(qh, rows, ctx.scale, s);
            }
        }
    }
    for t in 0..count {
        for h in 0..g {
            let s = &mut scores[(t * g + h) * n_max..][..len(t)];
            softmax::<V>(ctx, kv_head * g + h, s);
            head_out(t, h).fill(0.0);
        }
    }
    for b0 in (0..n_max).step_by(RUN_BLOCK) {
        for t in (0..count).filter(|&t| b0 < len(t)) {
            let b1 = (b0 + RUN_BLOCK).min(len(t));
            for h in 0..g {
                let p = &scores[(t * g + h) * n_max + b0..][..b1 - b0];
                let rows = offsets[b0..b1].iter().map(|&o| &ctx.v[o..][..hd]);
                V::weighted_sum::<HD>(p, rows, head_out(t, h));
            }
        }
    }
}

/// Query head `head`'s scores `s` (non-empty) -> its attention weights, in place: soft-capped when asked,
/// then a softmax whose max and denominator include the head's sink (`exp(sink - max)`) when there are
/// sinks. Each token's weights depend only on its own scores (the run path gives the item path's bits).
#[inline(always)]
fn softmax<V: Vector>(ctx: &Ctx<'_>, head: usize, s: &mut [f32]) {
    if let Some(cap) = ctx.soft_cap {
        V::soft_cap(s, cap);
    }
    let sink = ctx.sinks.map(|sinks| sinks[head]);
    let max = s
        .iter()
        .copied()
        .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
    let mut sum = V::exp_shifted(s, max);
    if let Some(sink) = sink {
        sum += (sink - max).exp();
    }
    let inv = 1.0 / sum;
    for x in s.iter_mut() {
        *x *= inv;
    }
}

/// An item's work space: its scores `[group, n]`, and the offset of each of its key (and value) rows.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    rows: Vec<usize>,
}

/// One (sequence, KV head): `out` is `[group, head_size]`, the outputs of the group's query heads.
/// `HD` is the head size when known at compile time, else 0.
#[inline(always)]
fn attend<V: Vector, const HD: usize>(
    ctx: &Ctx<'_>,
    item: usize,
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    let d = &ctx.d;
    let hd = if HD == 0 { d.head_size } else { HD };
    let g = ctx.group;
    let (seq, kv_head) = (item / d.num_kv_heads, item % d.num_kv_heads);
    let range = ctx.context(seq);
    let n = range.len();
    out.fill(0.0);
    if n == 0 {
        return;
    }
    let q = &ctx.q[(seq * d.num_heads + kv_head * g) * hd..][..g * hd];
    let table = &ctx.block_tables[seq * d.max_blocks_per_seq..][..d.max_blocks_per_seq];
    // The offset of the K (or V) row of every position for this KV head, found once per item, block by
    // block, for the 2 * group passes below: an integer division per row and pass had cost about 12% of
    // the kernel's time (bench/attention_cpu.py).
    let Scratch {
        scores,
        rows: offsets,
    } = scratch;
    row_offsets(d, table, range.clone(), kv_head, offsets);
    scores.clear();
    scores.resize(g * n, 0.0);
    // Scores [g, n], head by head (the item's key rows stay in cache between heads).
    for (qh, s) in q.chunks_exact(hd).zip(scores.chunks_exact_mut(n)) {
        let rows = offsets.iter().map(|&o| &ctx.k[o..][..hd]);
        V::scores::<HD>(qh, rows, ctx.scale, s);
    }
    // Softmax per head, normalized before the value sum (as torch's softmax then bmm).
    for (h, s) in scores.chunks_exact_mut(n).enumerate() {
        softmax::<V>(ctx, kv_head * g + h, s);
    }
    // Head by head, so one output row stays in registers while the value rows stream past.
    for (o, p) in out.chunks_exact_mut(hd).zip(scores.chunks_exact(n)) {
        let rows = offsets.iter().map(|&o| &ctx.v[o..][..hd]);
        V::weighted_sum::<HD>(p, rows, o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small deterministic generator (xorshift), values in [-1, 1).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn below(&mut self, n: usize) -> usize {
            ((self.next() + 1.0) * 0.5 * n as f32) as usize % n
        }
    }

    struct Case {
        d: DecodeDims,
        q: Vec<f32>,
        kv: Vec<f32>,
        bt: Vec<i32>,
        lens: Vec<i32>,
    }

    /// Random cache; each sequence gets distinct random blocks (shuffled), padding entries are 0.
    fn case(seed: u64, lens: &[i32], heads: usize, kv_heads: usize, hd: usize, bs: usize) -> Case {
        let mut rng = Rng(seed);
        let m = lens
            .iter()
            .map(|&l| (l as usize).div_ceil(bs))
            .max()
            .unwrap_or(0)
            + 1;
        let num_blocks = lens.len() * m + 3;
        let d = DecodeDims {
            num_seqs: lens.len(),
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_size: hd,
            num_blocks,
            block_size: bs,
            max_blocks_per_seq: m,
        };
        let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let mut bt = vec![0; lens.len() * m];
        let mut next = 0;
        for (s, &l) in lens.iter().enumerate() {
            for j in 0..(l as usize).div_ceil(bs) {
                bt[s * m + j] = ids[next];
                next += 1;
            }
        }
        let q = (0..lens.len() * heads * hd).map(|_| rng.next()).collect();
        let kv = (0..2 * num_blocks * bs * kv_heads * hd)
            .map(|_| rng.next())
            .collect();
        Case {
            d,
            q,
            kv,
            bt,
            lens: lens.to_vec(),
        }
    }

    /// Straightforward f64 attention per (sequence, head).
    fn naive(c: &Case, scale: f32, window: Option<usize>) -> Vec<f32> {
        naive_with(c, &params(scale, window, None))
    }

    /// `naive` with every parameter (the soft cap and the sinks applied in f64 too).
    fn naive_with(c: &Case, p: &DecodeParams<'_>) -> Vec<f32> {
        let (scale, window) = (p.scale, p.sliding_window);
        let cap = p.logits_soft_cap.map(f64::from);
        let d = &c.d;
        let (hd, g) = (d.head_size, d.num_heads / d.num_kv_heads);
        let half = c.kv.len() / 2;
        let mut out = vec![0.0f32; c.q.len()];
        for s in 0..d.num_seqs {
            let len = c.lens[s] as usize;
            let start = window.map_or(0, |w| len.saturating_sub(w));
            for h in 0..d.num_heads {
                let kvh = h / g;
                let q = &c.q[(s * d.num_heads + h) * hd..][..hd];
                let row = |p: usize| {
                    let b = c.bt[s * d.max_blocks_per_seq + p / d.block_size] as usize;
                    ((b * d.block_size + p % d.block_size) * d.num_kv_heads + kvh) * hd
                };
                let sc: Vec<f64> = (start..len)
                    .map(|p| {
                        let k = &c.kv[row(p)..][..hd];
                        q.iter()
                            .zip(k)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .map(|x| cap.map_or(x, |cap| cap * (x / cap).tanh()))
                    .collect();
                let sink = p.sinks.map(|sinks| f64::from(sinks[h]));
                let max = sc
                    .iter()
                    .copied()
                    .fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |x| (x - max).exp());
                let o = &mut out[(s * d.num_heads + h) * hd..][..hd];
                for (i, p) in (start..len).enumerate() {
                    let v = &c.kv[half + row(p)..][..hd];
                    for (oj, &vj) in o.iter_mut().zip(v) {
                        *oj += (e[i] / sum * vj as f64) as f32;
                    }
                }
            }
        }
        out
    }

    fn params(scale: f32, window: Option<usize>, cap: Option<f32>) -> DecodeParams<'static> {
        DecodeParams {
            sliding_window: window,
            logits_soft_cap: cap,
            ..DecodeParams::new(scale)
        }
    }

    fn run(c: &Case, scale: f32, window: Option<usize>, threads: usize) -> Vec<f32> {
        run_with(c, &params(scale, window, None), threads)
    }

    fn run_with(c: &Case, p: &DecodeParams<'_>, threads: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; c.q.len()];
        paged_decode_f32(&c.q, &c.kv, &c.bt, &c.lens, &mut out, &c.d, p, threads).unwrap();
        out
    }

    /// A case whose sequences `runs[i]` tokens at a time are the query tokens of one request: the same
    /// blocks (the run's last token's), lengths growing by one.
    fn verification_case(seed: u64, starts: &[i32], runs: &[usize], hd: usize, bs: usize) -> Case {
        let last: Vec<i32> = starts
            .iter()
            .zip(runs)
            .map(|(&s, &r)| s + r as i32 - 1)
            .collect();
        let base = case(seed, &last, 6, 2, hd, bs);
        let (m, per_tok) = (base.d.max_blocks_per_seq, base.d.num_heads * hd);
        let mut rng = Rng(seed + 1);
        let (mut bt, mut lens, mut q) = (Vec::new(), Vec::new(), Vec::new());
        for (r, (&s, &n)) in starts.iter().zip(runs).enumerate() {
            for t in 0..n {
                bt.extend_from_slice(&base.bt[r * m..][..m]);
                lens.push(s + t as i32);
                q.extend((0..per_tok).map(|_| rng.next()));
            }
        }
        let d = DecodeDims {
            num_seqs: lens.len(),
            ..base.d
        };
        Case {
            d,
            q,
            kv: base.kv,
            bt,
            lens,
        }
    }

    #[test]
    fn a_verifications_tokens_together_equal_each_token_alone() {
        let scale = 0.3;
        // Runs of 9 and 3 tokens (one cut in two for the threads), single tokens, a run of 17 (more
        // than MAX_RUN), contexts crossing RUN_BLOCK and ending mid-chunk of 4; soft-capped or not.
        let sinks = [0.5, -1.0, 2.0, 3.5, -0.25, 1.0];
        for (hd, bs, cap, sinks) in [
            (64, 16, None, None),
            (32, 4, None, Some(&sinks[..])),
            (128, 8, None, None),
            (256, 16, Some(1.5), None),
            (64, 8, Some(0.7), Some(&sinks[..])),
            (64, 16, None, Some(&sinks[..])),
        ] {
            let p = DecodeParams {
                sinks,
                ..params(scale, None, cap)
            };
            let c = verification_case(5, &[150, 7, 1, 66, 200], &[9, 3, 1, 1, 17], hd, bs);
            let all = run_with(&c, &p, 2);
            let want = naive_with(&c, &p);
            let per_tok = c.d.num_heads * hd;
            for s in 0..c.d.num_seqs {
                let one = Case {
                    d: DecodeDims { num_seqs: 1, ..c.d },
                    q: c.q[s * per_tok..][..per_tok].to_vec(),
                    kv: c.kv.clone(),
                    bt: c.bt[s * c.d.max_blocks_per_seq..][..c.d.max_blocks_per_seq].to_vec(),
                    lens: vec![c.lens[s]],
                };
                for threads in [1, 2] {
                    let alone = run_with(&one, &p, threads);
                    let together = &all[s * per_tok..][..per_tok];
                    assert!(
                        alone
                            .iter()
                            .zip(together)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "hd {hd} bs {bs} token {s} (len {}) t{threads}",
                        c.lens[s]
                    );
                }
            }
            assert_close(&all, &want);
            assert!(
                query_runs(
                    &Ctx {
                        q: &c.q,
                        k: &c.kv,
                        v: &c.kv,
                        block_tables: &c.bt,
                        seq_lens: &c.lens,
                        d: c.d,
                        group: 3,
                        scale,
                        sliding_window: None,
                        soft_cap: cap,
                        sinks,
                        avx2: false,
                    },
                    1
                )
                .contains(&(0, 9)),
                "the first 9 tokens are one run"
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exp_is_within_a_few_ulp() {
        if !uses_avx2(Isa::detect()) {
            return;
        }
        let mut rng = Rng(3);
        let mut xs: Vec<f32> = (0..4003)
            .map(|_| -87.0 * (rng.next() + 1.0) / 2.0)
            .collect();
        xs.extend([0.0, -1e-30, -0.5, -1.0, -20.0, -87.0]);
        let mut got = xs.clone();
        // SAFETY: AVX2 and FMA detected above.
        #[allow(unsafe_code)]
        let sum = unsafe { avx2::exp_shifted(&mut got, 0.0) };
        let mut want_sum = 0.0f64;
        for (&x, &g) in xs.iter().zip(&got) {
            let want = f64::from(x).exp();
            want_sum += want;
            assert!(
                ((f64::from(g) - want) / want).abs() < 4e-7,
                "exp({x}) = {g}, want {want}"
            );
        }
        assert!((f64::from(sum) - want_sum).abs() <= 1e-6 * want_sum);
    }

    fn assert_close(a: &[f32], b: &[f32]) {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-5, "element {i}: {x} vs {y}");
        }
    }

    #[test]
    fn matches_naive_ragged_gqa() {
        let lens = [1, 15, 16, 17, 32, 33, 100, 7];
        for (heads, kv_heads) in [(4, 4), (9, 3), (8, 2), (4, 1)] {
            for hd in [64, 128, 24, 5] {
                let c = case(7 + hd as u64, &lens, heads, kv_heads, hd, 16);
                let scale = 1.0 / (hd as f32).sqrt();
                assert_close(&run(&c, scale, None, 1), &naive(&c, scale, None));
            }
        }
    }

    #[test]
    fn portable_copy_matches_naive() {
        let lens = [1, 15, 16, 17, 100, 7];
        for (heads, kv_heads, hd) in [(9, 3, 64), (8, 2, 128), (4, 4, 24), (4, 1, 5)] {
            let c = case(5, &lens, heads, kv_heads, hd, 16);
            for window in [None, Some(9)] {
                let p = DecodeParams {
                    isa: Isa::Portable,
                    ..params(0.1, window, None)
                };
                assert_close(&run_with(&c, &p, 2), &naive(&c, 0.1, window));
            }
        }
    }

    /// Every kernel set this CPU runs, at head sizes 64, 128, 256 (the compiled-in sizes) and one read at
    /// run time, with and without a soft cap that bites (scores up to ~10 against caps of 2 and 30), a
    /// window and sinks (some below the scores, some above every score), against the f64 reference.
    #[test]
    fn every_isa_head_size_soft_cap_window_and_sinks_match_f64() {
        let lens = [1, 15, 16, 17, 100, 7, 250];
        let sinks = [-2.0, 0.0, 1.5, 12.0, -30.0, 3.0, 0.7, 6.0];
        for isa in Isa::supported() {
            for hd in [64, 128, 256, 40] {
                let c = case(hd as u64, &lens, 8, 2, hd, 16);
                for cap in [None, Some(2.0), Some(30.0)] {
                    for window in [None, Some(9)] {
                        for sinks in [None, Some(&sinks[..])] {
                            let p = DecodeParams {
                                isa,
                                sinks,
                                ..params(0.5, window, cap)
                            };
                            let got = run_with(&c, &p, 2);
                            let want = naive_with(&c, &p);
                            for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                                assert!(
                                    (x - y).abs() <= 1e-5,
                                    "{isa:?} hd {hd} cap {cap:?} window {window:?} sinks {} element {i}: {x} vs {y}",
                                    sinks.is_some()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A sink of -inf is no sink; a sink far above every score draws the weight off every key (output
    /// toward 0); a sinks array of another length than the heads is refused.
    #[test]
    fn sinks_take_part_in_the_softmax_and_are_checked() {
        let c = case(12, &[40, 3, 17], 4, 2, 64, 16);
        let with = |sinks: &[f32]| {
            let p = DecodeParams {
                sinks: Some(sinks),
                ..params(0.3, None, None)
            };
            run_with(&c, &p, 2)
        };
        assert_eq!(with(&[f32::NEG_INFINITY; 4]), run(&c, 0.3, None, 2));
        assert!(with(&[40.0; 4]).iter().all(|x| x.abs() < 1e-6));
        let some = with(&[0.0, 1.0, -1.0, 2.0]);
        assert_ne!(some, run(&c, 0.3, None, 2));
        let mut out = vec![0.0; c.q.len()];
        let p = DecodeParams {
            sinks: Some(&[0.0; 3]),
            ..params(0.3, None, None)
        };
        assert_eq!(
            paged_decode_f32(&c.q, &c.kv, &c.bt, &c.lens, &mut out, &c.d, &p, 1),
            Err(KernelError::Length {
                name: "sinks",
                actual: 3,
                expected: 4
            })
        );
    }

    #[test]
    fn soft_cap_changes_the_output_and_is_checked() {
        let c = case(9, &[40, 3], 4, 2, 64, 16);
        assert_ne!(
            run_with(&c, &params(1.0, None, Some(1.0)), 1),
            run(&c, 1.0, None, 1)
        );
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let mut out = vec![0.0; c.q.len()];
            let p = params(1.0, None, Some(bad));
            let err = paged_decode_f32(&c.q, &c.kv, &c.bt, &c.lens, &mut out, &c.d, &p, 1);
            assert!(
                matches!(
                    err,
                    Err(KernelError::NotPositive {
                        name: "logits_soft_cap",
                        ..
                    })
                ),
                "{bad}: {err:?}"
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_tanh_is_within_a_few_ulp() {
        if !uses_avx2(Isa::detect()) {
            return;
        }
        let mut rng = Rng(4);
        let mut xs: Vec<f32> = (0..4003).map(|_| 12.0 * rng.next()).collect();
        xs.extend((0..2000).map(|_| 0.7 * rng.next()));
        xs.extend([
            0.0, -0.0, 1e-30, -1e-8, 0.625, -0.625, 0.6249, 9.0, -9.0, 100.0, -1e30,
        ]);
        let mut got = xs.clone();
        // SAFETY: AVX2 and FMA detected above.
        #[allow(unsafe_code)]
        unsafe {
            avx2::soft_cap(&mut got, 1.0)
        };
        for (&x, &g) in xs.iter().zip(&got) {
            let want = f64::from(x).tanh();
            let tol = 4.0 * f64::from(f32::EPSILON) * want.abs().max(f64::from(f32::MIN_POSITIVE));
            assert!(
                (f64::from(g) - want).abs() <= tol,
                "tanh({x}) = {g}, want {want}"
            );
        }
    }

    #[test]
    fn sliding_window() {
        let lens = [1, 8, 9, 40, 64, 65];
        for window in [1, 8, 20, 1000] {
            let c = case(3, &lens, 6, 2, 32, 8);
            assert_close(
                &run(&c, 0.2, Some(window), 1),
                &naive(&c, 0.2, Some(window)),
            );
        }
    }

    #[test]
    fn threads_give_identical_results() {
        let lens: Vec<i32> = (0..37).map(|i| 1 + (i * 29) % 300).collect();
        let c = case(11, &lens, 9, 3, 64, 16);
        let one = run(&c, 0.125, None, 1);
        assert_close(&one, &naive(&c, 0.125, None));
        for t in [2, 3, 8, 500] {
            assert_eq!(one, run(&c, 0.125, None, t));
        }
    }

    #[test]
    fn empty_sequence_gives_zeros() {
        let c = case(5, &[0, 3], 2, 1, 8, 4);
        let out = run(&c, 1.0, None, 2);
        assert!(out[..16].iter().all(|&x| x == 0.0));
        assert_close(&out, &naive(&c, 1.0, None));
    }

    #[test]
    fn rejects_bad_arguments() {
        let c = case(1, &[5, 9], 4, 2, 8, 4);
        let mut out = vec![0.0; c.q.len()];
        let call = |q: &[f32], bt: &[i32], lens: &[i32], out: &mut [f32], d: &DecodeDims| {
            paged_decode_f32(q, &c.kv, bt, lens, out, d, &DecodeParams::new(1.0), 1)
        };
        assert_eq!(
            call(&c.q[1..], &c.bt, &c.lens, &mut out, &c.d),
            Err(KernelError::Length {
                name: "q",
                actual: c.q.len() - 1,
                expected: c.q.len()
            })
        );
        let max = c.d.max_blocks_per_seq * 4;
        let err = call(&c.q, &c.bt, &[5, max as i32 + 1], &mut out, &c.d);
        assert!(matches!(err, Err(KernelError::SeqLen { seq: 1, .. })));
        let mut bt = c.bt.clone();
        bt[1] = c.d.num_blocks as i32;
        let err = call(&c.q, &bt, &c.lens, &mut out, &c.d);
        assert!(matches!(
            err,
            Err(KernelError::Block { seq: 0, idx: 1, .. })
        ));
        let d = DecodeDims {
            num_heads: 3,
            ..c.d
        };
        let err = call(&c.q, &c.bt, &c.lens, &mut out, &d);
        assert!(matches!(err, Err(KernelError::Heads { .. })));
    }
}
