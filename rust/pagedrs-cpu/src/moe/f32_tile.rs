//! The float32 experts' kernel of the portable and NEON sets (`f32_tile`); the x86 ones take `f32_panel`.

use crate::pool::SharedOut;
use crate::quant::Isa;

/// Whether the float32 experts take the register-tile kernels (`f32_panel`): the AVX2 kernel sets
/// (`PAGEDRS_CPU_ISA=portable` turns them off).
pub(super) fn f32_wide(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    if isa.is_x86() {
        return true;
    }
    let _ = isa;
    false
}

/// Weight rows `rows` of `w` (`[n, kdim]` float32) against the `m` rows of `a`, into `out` rows
/// `s0..s0 + m` (width `n`): 4 activation rows share each weight row's loads, then 2 and 1 (the kernel of
/// the portable and NEON sets; the x86 ones take `f32_panel`).
#[allow(clippy::too_many_arguments)]
pub(super) fn f32_tile(
    isa: Isa,
    w: &[f32],
    a: &[f32],
    kdim: usize,
    out: SharedOut,
    s0: usize,
    n: usize,
    rows: std::ops::Range<usize>,
) {
    let m = a.len() / kdim.max(1);
    // weight rows a block at a time (a few rows stay in L2 while every activation row passes them)
    let mut j0 = rows.start;
    while j0 < rows.end {
        let block = j0..(j0 + W_BLOCK).min(rows.end);
        let mut i = 0;
        while i < m {
            let r = if m - i >= 4 {
                4
            } else if m - i >= 2 {
                2
            } else {
                1
            };
            for j in block.clone() {
                let wr = &w[j * kdim..][..kdim];
                let store = |v: &[f32]| {
                    for (rr, &v) in v.iter().enumerate() {
                        // SAFETY: row `s0 + i + rr` < pairs, column `j` < n; only this task writes
                        // (row, j) (tasks split an expert's weight rows, experts own disjoint rows).
                        #[allow(unsafe_code)]
                        unsafe {
                            *out.at((s0 + i + rr) * n + j) = v;
                        }
                    }
                };
                match r {
                    4 => store(&dot_rows::<4>(isa, wr, a, i, kdim)),
                    2 => store(&dot_rows::<2>(isa, wr, a, i, kdim)),
                    _ => store(&dot_rows::<1>(isa, wr, a, i, kdim)),
                }
            }
            i += r;
        }
        j0 = block.end;
    }
}

/// Weight rows per block of `f32_tile`.
const W_BLOCK: usize = 16;

/// Dots of one weight row with activation rows `i..i + R` of `a` (rows of `kdim`).
#[inline]
fn dot_rows<const R: usize>(isa: Isa, w: &[f32], a: &[f32], i: usize, kdim: usize) -> [f32; R] {
    let xs: [&[f32]; R] = std::array::from_fn(|r| &a[(i + r) * kdim..][..kdim]);
    #[cfg(target_arch = "aarch64")]
    if matches!(isa, Isa::Neon | Isa::NeonDot) {
        return dot_rows_body::<R, true>(w, &xs); // fused multiply-add is baseline on aarch64
    }
    let _ = isa;
    dot_rows_body::<R, false>(w, &xs)
}

/// Each row's dot with `w` in turn (the weight row stays in L1 across the rows; a 2-D accumulator over
/// rows and lanes measured several times slower: the compiler left it scalar).
#[inline(always)]
fn dot_rows_body<const R: usize, const FMA: bool>(w: &[f32], xs: &[&[f32]; R]) -> [f32; R] {
    std::array::from_fn(|r| dot_body::<FMA>(w, xs[r]))
}

/// 16 lanes (two 8-float vectors where the compiler has them), lanes summed at the end.
#[inline(always)]
fn dot_body<const FMA: bool>(w: &[f32], x: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0.0f32; L];
    let (wc, xc) = (w.chunks_exact(L), x[..w.len()].chunks_exact(L));
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (a, b) in wc.zip(xc) {
        for l in 0..L {
            acc[l] = if FMA {
                a[l].mul_add(b[l], acc[l])
            } else {
                acc[l] + a[l] * b[l]
            };
        }
    }
    let mut s = 0.0f32;
    for l in 0..L / 2 {
        s += acc[l] + acc[l + L / 2];
    }
    for (a, b) in wt.iter().zip(xt) {
        s += a * b;
    }
    s
}
