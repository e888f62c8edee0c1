//! The item path: one (sequence, KV head) per task, its scores, softmax and value sum.

use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use super::vector::Avx2;
use super::vector::{Portable, Vector};
use super::{Ctx, DecodeDims};

pub(super) fn run_items(ctx: &Ctx<'_>, first: usize, out: &mut [f32]) {
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
pub(super) fn row_offsets(
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

/// Query head `head`'s scores `s` (non-empty) -> its attention weights, in place: soft-capped when asked,
/// then a softmax whose max and denominator include the head's sink (`exp(sink - max)`) when there are
/// sinks. Each token's weights depend only on its own scores (the run path gives the item path's bits).
#[inline(always)]
pub(super) fn softmax<V: Vector>(ctx: &Ctx<'_>, head: usize, s: &mut [f32]) {
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
pub(super) struct Scratch {
    pub(super) scores: Vec<f32>,
    pub(super) rows: Vec<usize>,
}

/// One (sequence, KV head): `out` is `[group, head_size]`, the outputs of the group's query heads.
/// `HD` is the head size when known at compile time, else 0.
#[inline(always)]
pub(super) fn attend<V: Vector, const HD: usize>(
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
