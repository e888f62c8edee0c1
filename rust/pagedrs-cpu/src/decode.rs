//! Paged decode attention on CPU: one query token per sequence attends to its cached context, read in
//! place through the block table (no gather copy).
//!
//! Work item = (sequence, KV head). An item reads each of its key rows once for all the query heads of
//! its group (GQA), computes the scores, a softmax in f32, then accumulates the value rows. Items are
//! split over threads in contiguous ranges of about equal context length, so each thread writes one
//! contiguous slice of `out` (the heads of a group are adjacent: head = kv_head * group + g).
//! Inner loops are written over fixed-width lane arrays so they auto-vectorize; on x86-64 a copy compiled
//! for AVX2 + FMA is chosen at run time when the CPU has them (the wheel targets baseline x86-64).

use std::ops::Range;

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
    scale: f32,
    sliding_window: Option<usize>,
    num_threads: usize,
) -> Result<(), KernelError> {
    validate(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        dims,
        sliding_window,
    )?;
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
        scale,
        sliding_window,
    };
    let item_len = ctx.group * d.head_size;
    let num_items = d.num_seqs * d.num_kv_heads;
    let threads = num_threads.clamp(1, num_items.max(1));
    if threads == 1 {
        run_items(&ctx, 0, out);
        return Ok(());
    }
    // Contiguous item ranges of about equal cost (context length plus a constant per item).
    let cost = |item: usize| ctx.context(item / d.num_kv_heads).len() + 16;
    let total: usize = (0..num_items).map(cost).sum();
    std::thread::scope(|s| {
        let mut rest = out;
        let (mut first, mut acc) = (0, 0);
        for t in 0..threads {
            let target = total * (t + 1) / threads;
            let mut end = first;
            while end < num_items && (acc < target || t + 1 == threads) {
                acc += cost(end);
                end += 1;
            }
            let (mine, tail) = rest.split_at_mut((end - first) * item_len);
            rest = tail;
            let (ctx, start) = (&ctx, first);
            if !mine.is_empty() {
                s.spawn(move || run_items(ctx, start, mine));
            }
            first = end;
        }
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

/// `a * b + c`, fused or not: the fused form is only used inside code compiled with FMA enabled
/// (elsewhere `mul_add` would be a libm call).
trait MulAdd {
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

struct Plain;
impl MulAdd for Plain {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

#[cfg(target_arch = "x86_64")]
struct Fused;
#[cfg(target_arch = "x86_64")]
impl MulAdd for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

fn run_items(ctx: &Ctx<'_>, first: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports the features `run_items_avx2` is compiled for (checked just above).
        #[allow(unsafe_code)]
        unsafe {
            run_items_avx2(ctx, first, out)
        };
        return;
    }
    run_items_generic::<Plain>(ctx, first, out);
}

/// The generic loop compiled for AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_items_avx2(ctx: &Ctx<'_>, first: usize, out: &mut [f32]) {
    run_items_generic::<Fused>(ctx, first, out);
}

#[inline(always)]
fn run_items_generic<M: MulAdd>(ctx: &Ctx<'_>, first: usize, out: &mut [f32]) {
    let mut scores = Vec::new();
    let item_len = ctx.group * ctx.d.head_size;
    for (j, item_out) in out.chunks_exact_mut(item_len).enumerate() {
        attend::<M>(ctx, first + j, item_out, &mut scores);
    }
}

/// One (sequence, KV head): `out` is `[group, head_size]`, the outputs of the group's query heads.
#[inline(always)]
fn attend<M: MulAdd>(ctx: &Ctx<'_>, item: usize, out: &mut [f32], scores: &mut Vec<f32>) {
    let d = &ctx.d;
    let (hd, g) = (d.head_size, ctx.group);
    let (seq, kv_head) = (item / d.num_kv_heads, item % d.num_kv_heads);
    let range = ctx.context(seq);
    let n = range.len();
    out.fill(0.0);
    if n == 0 {
        return;
    }
    let q = &ctx.q[(seq * d.num_heads + kv_head * g) * hd..][..g * hd];
    let row = &ctx.block_tables[seq * d.max_blocks_per_seq..][..d.max_blocks_per_seq];
    // Offset of the K (or V) row of `pos` for this KV head.
    let offset = |pos: usize| {
        let block = row[pos / d.block_size] as usize;
        ((block * d.block_size + pos % d.block_size) * d.num_kv_heads + kv_head) * hd
    };
    scores.clear();
    scores.resize(g * n, 0.0);
    // Scores [g, n]: each key row is read once for the whole group.
    for (i, pos) in range.clone().enumerate() {
        let k = &ctx.k[offset(pos)..][..hd];
        for (h, qh) in q.chunks_exact(hd).enumerate() {
            scores[h * n + i] = dot::<M>(qh, k) * ctx.scale;
        }
    }
    // Softmax per head, normalized before the value sum (as torch's softmax then bmm).
    for s in scores.chunks_exact_mut(n) {
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        let inv = 1.0 / sum;
        for x in s.iter_mut() {
            *x *= inv;
        }
    }
    for (i, pos) in range.enumerate() {
        let v = &ctx.v[offset(pos)..][..hd];
        for (h, o) in out.chunks_exact_mut(hd).enumerate() {
            axpy::<M>(scores[h * n + i], v, o);
        }
    }
}

/// Dot product with LANES independent f32 accumulators (vectorizable without reassociation).
#[inline(always)]
fn dot<M: MulAdd>(a: &[f32], b: &[f32]) -> f32 {
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let mut tail = 0.0f32;
    for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
        tail = M::mul_add(x, y, tail);
    }
    let mut acc = [0.0f32; LANES];
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] = M::mul_add(x[l], y[l], acc[l]);
        }
    }
    // Pairwise reduction of the lanes.
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0] + tail
}

/// `y += a * x`.
#[inline(always)]
fn axpy<M: MulAdd>(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi = M::mul_add(a, xi, *yi);
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
                    .collect();
                let max = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
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

    fn run(c: &Case, scale: f32, window: Option<usize>, threads: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; c.q.len()];
        paged_decode_f32(
            &c.q, &c.kv, &c.bt, &c.lens, &mut out, &c.d, scale, window, threads,
        )
        .unwrap();
        out
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
            for hd in [64, 24, 5] {
                let c = case(7 + hd as u64, &lens, heads, kv_heads, hd, 16);
                let scale = 1.0 / (hd as f32).sqrt();
                assert_close(&run(&c, scale, None, 1), &naive(&c, scale, None));
            }
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
            paged_decode_f32(q, &c.kv, bt, lens, out, d, 1.0, None, 1)
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
