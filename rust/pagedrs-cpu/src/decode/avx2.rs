//! The AVX2 + FMA intrinsics of the decode inner loops (`vector::Avx2`), and `exp8` / `tanh8`, which the
//! fused ops use too. Every function needs a CPU with AVX2 and FMA.

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
