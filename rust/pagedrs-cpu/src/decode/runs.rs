//! The run path: the query tokens of one request (a speculative verification) attended together per
//! KV head, each token with the bits it gets alone on the item path.

use super::items::{attend, row_offsets, softmax, Scratch};
#[cfg(target_arch = "x86_64")]
use super::vector::Avx2;
use super::vector::{Portable, Vector};
use super::Ctx;

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
pub(super) fn query_runs(ctx: &Ctx<'_>, num_threads: usize) -> Vec<(usize, usize)> {
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
pub(super) fn run_task(
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
