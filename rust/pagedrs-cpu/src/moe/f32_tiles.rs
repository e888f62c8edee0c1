//! The float32 experts' matmul at many rows per expert, on AVX2 + FMA: register tiles of up to 4
//! activation rows x 3 weight rows (12 accumulators, 3 weight vectors and one activation vector: the 16
//! ymm registers), 8 floats a step, so each weight load serves 4 rows and each activation load 3 weight
//! rows (0.58 loads per FMA, against 1.25 for the one-weight-row kernel). A whole expert's rows pass each
//! block of weight rows while it sits in L2, as a blocked GEMM does.

use crate::pool::SharedOut;
use std::arch::x86_64::*;

/// Weight rows per block: 16 rows of a 768-wide expert (48 KB) stay in L2 while every row passes.
const W_BLOCK: usize = 16;

/// Weight rows `rows` of `w` (`[n, kdim]`) against the `m` rows of `a`, into `out` rows `s0..s0 + m`
/// (width `n`). Safety: the CPU has AVX2 and FMA; `out` holds rows `s0..s0 + m` of `n` floats, and only
/// this call writes their columns `rows`.
#[target_feature(enable = "avx2,fma")]
#[allow(unsafe_code)]
pub(super) unsafe fn tile(
    w: &[f32],
    a: &[f32],
    kdim: usize,
    out: SharedOut,
    s0: usize,
    n: usize,
    rows: std::ops::Range<usize>,
) {
    let m = a.len() / kdim.max(1);
    let mut j0 = rows.start;
    while j0 < rows.end {
        let jend = (j0 + W_BLOCK).min(rows.end);
        let mut i = 0;
        while i < m {
            let r = (m - i).min(4);
            let mut j = j0;
            while j < jend {
                let c = (jend - j).min(3);
                let o = out.at((s0 + i) * n + j);
                let t = Tile {
                    w,
                    a,
                    i,
                    j,
                    kdim,
                    o,
                    n,
                };
                match (r, c) {
                    (4, 3) => t.run::<4, 3>(),
                    (4, 2) => t.run::<4, 2>(),
                    (4, _) => t.run::<4, 1>(),
                    (3, 3) => t.run::<3, 3>(),
                    (3, 2) => t.run::<3, 2>(),
                    (3, _) => t.run::<3, 1>(),
                    (2, 3) => t.run::<2, 3>(),
                    (2, 2) => t.run::<2, 2>(),
                    (2, _) => t.run::<2, 1>(),
                    (_, 3) => t.run::<1, 3>(),
                    (_, 2) => t.run::<1, 2>(),
                    _ => t.run::<1, 1>(),
                }
                j += c;
            }
            i += r;
        }
        j0 = jend;
    }
}

/// One tile: activation rows `i..`, weight rows `j..`, output cells from `o` (row stride `n`).
struct Tile<'a> {
    w: &'a [f32],
    a: &'a [f32],
    i: usize,
    j: usize,
    kdim: usize,
    o: *mut f32,
    n: usize,
}

impl Tile<'_> {
    /// The R x C dots. Safety: AVX2 + FMA; rows `i..i + R` of `a` and `j..j + C` of `w` exist; `o` points
    /// at this tile's cells of an output only this call writes.
    #[target_feature(enable = "avx2,fma")]
    #[allow(unsafe_code)]
    #[inline]
    unsafe fn run<const R: usize, const C: usize>(&self) {
        let k = self.kdim;
        let ar: [&[f32]; R] = std::array::from_fn(|r| &self.a[(self.i + r) * k..][..k]);
        let wr: [&[f32]; C] = std::array::from_fn(|c| &self.w[(self.j + c) * k..][..k]);
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let whole = k / 8 * 8;
        let mut p = 0;
        while p < whole {
            // SAFETY: p + 8 <= k, the length of every row.
            let wv: [__m256; C] = std::array::from_fn(|c| _mm256_loadu_ps(wr[c].as_ptr().add(p)));
            for r in 0..R {
                let av = _mm256_loadu_ps(ar[r].as_ptr().add(p));
                for c in 0..C {
                    acc[r][c] = _mm256_fmadd_ps(av, wv[c], acc[r][c]);
                }
            }
            p += 8;
        }
        for r in 0..R {
            for c in 0..C {
                let mut s = hsum(acc[r][c]);
                for q in whole..k {
                    s += ar[r][q] * wr[c][q];
                }
                *self.o.add(r * self.n + c) = s;
            }
        }
    }
}

#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2)))
}
