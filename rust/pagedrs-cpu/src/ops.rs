//! Small fused per-token ops of the CPU decode step, each one call instead of several torch ops:
//! RMSNorm (with the residual add fused in), SiLU(gate) * up, and rotary embedding (neox) in place. Rows are independent; the math is
//! the torch reference path's (`x * rsqrt(mean(x^2) + eps) * weight`, `gate * sigmoid(gate) * up`) in f32,
//! up to summation order.

use crate::KernelError;

fn rows_of(name: &'static str, len: usize, width: usize) -> Result<usize, KernelError> {
    if width == 0 {
        return Err(KernelError::Zero { name: "width" });
    }
    KernelError::check_len(name, len % width, 0)?;
    Ok(len / width)
}

/// 1 / sqrt(mean(x^2) + eps), the sum in 8 lanes (vectorizes without reassociation).
#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l] * c[l];
        }
    }
    let sum: f32 = acc.iter().sum::<f32>() + tail;
    1.0 / (sum / x.len() as f32 + eps).sqrt()
}

/// `out[t] = x[t] * inv_rms(x[t]) * weight` for every row `t` of width `weight.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), KernelError> {
    let h = weight.len();
    rows_of("x", x.len(), h)?;
    KernelError::check_len("out", out.len(), x.len())?;
    for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let inv = inv_rms(xr, eps);
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = w * (v * inv);
        }
    }
    Ok(())
}

/// In place, per row: `residual += x`, then `x = rms_norm(residual) * weight`.
pub fn fused_add_rms_norm(
    x: &mut [f32],
    residual: &mut [f32],
    weight: &[f32],
    eps: f32,
) -> Result<(), KernelError> {
    let h = weight.len();
    rows_of("x", x.len(), h)?;
    KernelError::check_len("residual", residual.len(), x.len())?;
    for (xr, rr) in x.chunks_exact_mut(h).zip(residual.chunks_exact_mut(h)) {
        for (r, &v) in rr.iter_mut().zip(xr.iter()) {
            *r += v;
        }
        let inv = inv_rms(rr, eps);
        for ((o, &v), &w) in xr.iter_mut().zip(rr.iter()).zip(weight) {
            *o = w * (v * inv);
        }
    }
    Ok(())
}

/// `out[t] = silu(x[t, :d]) * x[t, d:]` for rows of `x` of width `2 * d` (`d = out row width`).
pub fn silu_and_mul(x: &[f32], d: usize, out: &mut [f32]) -> Result<(), KernelError> {
    let rows = rows_of("x", x.len(), 2 * d)?;
    KernelError::check_len("out", out.len(), rows * d)?;
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    for (xr, or) in x.chunks_exact(2 * d).zip(out.chunks_exact_mut(d.max(1))) {
        let (gate, up) = xr.split_at(d);
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 and FMA detected.
            #[allow(unsafe_code)]
            unsafe {
                done = silu_and_mul_avx2(gate, up, or);
            }
        }
        for ((o, &g), &u) in or[done..].iter_mut().zip(&gate[done..]).zip(&up[done..]) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
    Ok(())
}

/// `silu_and_mul` of one row, 8 lanes at a time through the decode kernel's vector `exp` (within a few
/// ulp: libm's scalar `expf` per value was about 5% of a speculative verification step); returns how many
/// leading elements it wrote (the tail is left to the scalar loop). `silu(g) = g * sigmoid(g)`, the
/// sigmoid from `e = exp(-|g|) <= 1` (no overflow): `1 / (1 + e)` for `g >= 0`, `e / (1 + e)` below.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_and_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) -> usize {
    use std::arch::x86_64::*;
    let n = gate.len().min(up.len()).min(out.len()) / 8 * 8;
    let (one, sign) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
    for i in (0..n).step_by(8) {
        let g = _mm256_loadu_ps(gate.as_ptr().add(i));
        let e = crate::decode::avx2::exp8(_mm256_or_ps(g, sign)); // exp(-|g|)
        let denom = _mm256_add_ps(one, e);
        let negative = _mm256_cmp_ps::<_CMP_LT_OQ>(g, _mm256_setzero_ps());
        let sig = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), denom);
        let v = _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up.as_ptr().add(i)));
        _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
    }
    n
}

/// Per row of `x` (`ids.len()` rows of `v` values): the index of its first largest value (the first NaN,
/// where there is one, as torch's `argmax` takes NaN for the largest) into `ids`, and its logsumexp
/// `max + ln(sum(exp(x - max)))` into `lse` (NaN with a NaN; `max` itself when that is infinite, as
/// torch's `logsumexp`). One read of the row for the max, a second for the sum: a greedy sampler's
/// token and its logprob (`x[id] - lse`) in two passes instead of torch's four, and no torch parallel
/// region whose idle OpenMP threads would then hold the cores the next step's kernels need.
/// Rows are split over `num_threads`.
pub fn argmax_logsumexp(
    x: &[f32],
    v: usize,
    ids: &mut [i64],
    lse: &mut [f32],
    num_threads: usize,
) -> Result<(), KernelError> {
    if v == 0 {
        return Err(KernelError::Zero { name: "vocab" });
    }
    let rows = rows_of("x", x.len(), v)?;
    KernelError::check_len("ids", ids.len(), rows)?;
    KernelError::check_len("lse", lse.len(), rows)?;
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    let row = |r: usize| -> (i64, f32) {
        let xr = &x[r * v..][..v];
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 and FMA detected.
            #[allow(unsafe_code)]
            return unsafe { argmax_lse_avx2(xr) };
        }
        argmax_lse_portable(xr)
    };
    let (ids_out, lse_out) = (
        crate::pool::SharedOut::new(ids),
        crate::pool::SharedOut::new(lse),
    );
    crate::pool::parallel_for(num_threads, rows, &|r| {
        let (id, l) = row(r);
        // SAFETY: `r < rows` = both outputs' lengths (checked); only task `r` writes element `r`.
        #[allow(unsafe_code)]
        unsafe {
            *ids_out.at(r) = id;
            *lse_out.at(r) = l;
        }
    });
    Ok(())
}

/// `argmax_logsumexp` of one row once its max is known (`max` not NaN).
fn finish_row(x: &[f32], max: f32, sum_exp: impl FnOnce() -> f32) -> (i64, f32) {
    let id = x.iter().position(|&a| a == max).unwrap_or(0) as i64;
    if max.is_infinite() {
        return (id, max);
    }
    (id, max + sum_exp().ln())
}

fn argmax_lse_portable(x: &[f32]) -> (i64, f32) {
    if let Some(i) = x.iter().position(|a| a.is_nan()) {
        return (i as i64, f32::NAN);
    }
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    finish_row(x, max, || x.iter().map(|&a| (a - max).exp()).sum())
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn argmax_lse_avx2(x: &[f32]) -> (i64, f32) {
    use std::arch::x86_64::*;
    let n = x.len() / 8 * 8;
    let p = x.as_ptr();
    let (mut m, mut nan) = (_mm256_set1_ps(f32::NEG_INFINITY), _mm256_setzero_ps());
    for i in (0..n).step_by(8) {
        let a = _mm256_loadu_ps(p.add(i));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a));
        m = _mm256_max_ps(a, m);
    }
    if _mm256_movemask_ps(nan) != 0 || x[n..].iter().any(|a| a.is_nan()) {
        return argmax_lse_portable(x);
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    let max = lanes
        .iter()
        .chain(&x[n..])
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    finish_row(x, max, || {
        let mv = _mm256_set1_ps(max);
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut i = 0;
        while i + 16 <= n {
            for (j, a) in acc.iter_mut().enumerate() {
                let e =
                    crate::decode::avx2::exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i + 8 * j)), mv));
                *a = _mm256_add_ps(*a, e);
            }
            i += 16;
        }
        if i < n {
            acc[0] = _mm256_add_ps(
                acc[0],
                crate::decode::avx2::exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv)),
            );
        }
        _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(acc[0], acc[1]));
        lanes.iter().sum::<f32>() + x[n..].iter().map(|&a| (a - max).exp()).sum::<f32>()
    })
}

/// Rows of a 2-D float32 view whose rows may be spaced (a column slice of a wider buffer, as q and k are
/// of the fused qkv output): `rows` rows of `width` floats, row `t` starting at `t * row_stride`.
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    pub rows: usize,
    pub width: usize,
    pub row_stride: usize,
}

/// Rotary embedding in place, neox layout (dim `j` paired with `j + rot / 2` in each head, the first
/// `rot` dims rotated), as the torch path computes it: `x1 * cos + (-x2) * sin`, `x2 * cos + x1 * sin`.
/// `cos_sin` is `[num_positions, rot]` (cos in the first half, sin in the second); `x` holds the rows
/// described by `r` (only their elements are touched).
pub fn rope_neox(
    x: &mut [f32],
    r: Rows,
    head_size: usize,
    rot: usize,
    positions: &[i64],
    cos_sin: &[f32],
) -> Result<(), KernelError> {
    if head_size == 0 || rot == 0 || rot % 2 != 0 || rot > head_size {
        return Err(KernelError::Zero {
            name: "rotary_dim (even, <= head_size)",
        });
    }
    rows_of("row width", r.width, head_size)?;
    KernelError::check_len("positions", positions.len(), r.rows)?;
    if r.rows > 0 {
        KernelError::check_len("x", x.len(), (r.rows - 1) * r.row_stride + r.width)?;
        if r.row_stride < r.width {
            return Err(KernelError::Length {
                name: "row stride",
                actual: r.row_stride,
                expected: r.width,
            });
        }
    }
    let num_positions = rows_of("cos_sin", cos_sin.len(), rot)?;
    let half = rot / 2;
    for (t, &pos) in positions.iter().enumerate() {
        if pos < 0 || pos as usize >= num_positions {
            return Err(KernelError::Row {
                index: t,
                id: pos,
                n: num_positions,
            });
        }
        let (cos, sin) = cos_sin[pos as usize * rot..][..rot].split_at(half);
        rope_neox_row(&mut x[t * r.row_stride..][..r.width], head_size, cos, sin);
    }
    Ok(())
}

/// One row of `rope_neox` (whole heads of `head_size`; `cos`/`sin` of length rot / 2).
pub fn rope_neox_row(row: &mut [f32], head_size: usize, cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for head in row.chunks_exact_mut(head_size) {
        let (x1s, rest) = head.split_at_mut(half);
        for (((a, b), &c), &s) in x1s
            .iter_mut()
            .zip(rest[..half].iter_mut())
            .zip(cos)
            .zip(sin)
        {
            let (x1, x2) = (*a, *b);
            *a = x1 * c + (-x2) * s;
            *b = x2 * c + x1 * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-5 * b.abs().max(1.0)
    }

    #[test]
    fn rms_norm_matches_the_definition() {
        let (h, eps) = (13, 1e-5f32);
        let x: Vec<f32> = (0..3 * h)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0)
            .collect();
        let w: Vec<f32> = (0..h).map(|i| 0.5 + i as f32 / 10.0).collect();
        let mut out = vec![0.0; x.len()];
        rms_norm(&x, &w, eps, &mut out).unwrap();
        let mut res = vec![1.0f32; x.len()];
        let mut xf = x.clone();
        fused_add_rms_norm(&mut xf, &mut res, &w, eps).unwrap();
        for t in 0..3 {
            let row = &x[t * h..][..h];
            let ms = row.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / h as f64;
            let inv = 1.0 / (ms + f64::from(eps)).sqrt();
            let summed: Vec<f64> = row.iter().map(|v| f64::from(*v) + 1.0).collect();
            let ms2 = summed.iter().map(|v| v * v).sum::<f64>() / h as f64;
            let inv2 = 1.0 / (ms2 + f64::from(eps)).sqrt();
            for i in 0..h {
                let want = f64::from(w[i]) * f64::from(row[i]) * inv;
                assert!(close(out[t * h + i], want as f32));
                assert!(close(res[t * h + i], summed[i] as f32));
                assert!(close(
                    xf[t * h + i],
                    (f64::from(w[i]) * summed[i] * inv2) as f32
                ));
            }
        }
        assert!(rms_norm(&x[1..], &w, eps, &mut out[1..]).is_err());
    }

    #[test]
    fn rope_rotates_pairs_of_strided_rows() {
        // 2 rows of 2 heads of 4 dims (rot 4), spaced 11 floats apart; pos 1 rotates by (0.5, 0.25) rad.
        let (head, rot, stride) = (4, 4, 11);
        let angles = [0.5f32, 0.25];
        let mut cos_sin = vec![1.0, 1.0, 0.0, 0.0];
        cos_sin.extend([
            angles[0].cos(),
            angles[1].cos(),
            angles[0].sin(),
            angles[1].sin(),
        ]);
        let mut x: Vec<f32> = (0..stride + 8).map(|i| i as f32).collect();
        let before = x.clone();
        let r = Rows {
            rows: 2,
            width: 8,
            row_stride: stride,
        };
        rope_neox(&mut x, r, head, rot, &[0, 1], &cos_sin).unwrap();
        assert_eq!(x[..8], before[..8]); // position 0: identity
        assert_eq!(x[8..stride], before[8..stride]); // between rows: untouched
        for h in 0..2 {
            let b = stride + 4 * h;
            for j in 0..2 {
                let (x1, x2) = (before[b + j], before[b + j + 2]);
                let (c, s) = (angles[j].cos(), angles[j].sin());
                assert!(close(x[b + j], x1 * c - x2 * s));
                assert!(close(x[b + j + 2], x2 * c + x1 * s));
            }
        }
        assert!(rope_neox(&mut x, r, head, rot, &[0, 2], &cos_sin).is_err());
    }

    #[test]
    fn argmax_logsumexp_matches_the_definition() {
        let v = 8 * 300 + 3; // a tail past the vectors
        let mut x: Vec<f32> = (0..5 * v)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 30.0)
            .collect();
        x[v + 17] = 40.0; // row 1: a clear max, repeated later (the first one counts)
        x[v + 2000] = 40.0;
        x[2 * v + v - 1] = 50.0; // row 2: the max in the tail
        x[3 * v..4 * v].fill(f32::NEG_INFINITY); // row 3: every value masked
        x[3 * v + 9] = -1.0;
        x[4 * v + 5] = f32::NAN; // row 4: a NaN
        let (mut ids, mut lse) = (vec![0i64; 5], vec![0.0f32; 5]);
        argmax_logsumexp(&x, v, &mut ids, &mut lse, 2).unwrap();
        assert_eq!(&ids[1..5], &[17, v as i64 - 1, 9, 5]);
        assert!(lse[4].is_nan());
        for r in 0..4 {
            let row = &x[r * v..][..v];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(row[ids[r] as usize], max);
            assert!(row[..ids[r] as usize].iter().all(|&a| a < max));
            let want = f64::from(max)
                + row
                    .iter()
                    .map(|&a| (f64::from(a) - f64::from(max)).exp())
                    .sum::<f64>()
                    .ln();
            assert!(
                (f64::from(lse[r]) - want).abs() <= 1e-5 * want.abs().max(1.0),
                "row {r}"
            );
        }
        assert_eq!(lse[3], -1.0);
        let (mut one, mut l1) = (vec![0i64; 1], vec![0.0f32; 1]);
        assert!(argmax_logsumexp(&x[..v], v, &mut one, &mut l1, 1).is_ok());
        assert!(argmax_logsumexp(&x[..v + 1], v, &mut one, &mut l1, 1).is_err());
    }

    #[test]
    fn silu_and_mul_is_within_a_few_ulp_over_the_range() {
        // wide gates (saturated sigmoid both ways, exp(-|g|) at its lower clamp), odd width (a tail)
        let d = 8 * 37 + 5;
        let x: Vec<f32> = (0..2 * d)
            .map(|i| {
                if i < d {
                    (i as f32 - d as f32 / 2.0) * 0.7
                } else {
                    1.0 - (i - d) as f32 / d as f32
                }
            })
            .collect();
        let mut out = vec![0.0; d];
        silu_and_mul(&x, d, &mut out).unwrap();
        for i in 0..d {
            let (g, u) = (f64::from(x[i]), f64::from(x[d + i]));
            let want = g / (1.0 + (-g).exp()) * u;
            let got = f64::from(out[i]);
            assert!(
                (got - want).abs() <= 1e-6 * want.abs() + 1e-30,
                "silu({g}) * {u} = {got}, want {want}"
            );
        }
    }

    #[test]
    fn silu_and_mul_matches_the_definition() {
        let d = 5;
        let x: Vec<f32> = (0..2 * 2 * d).map(|i| i as f32 / 4.0 - 2.0).collect();
        let mut out = vec![0.0; 2 * d];
        silu_and_mul(&x, d, &mut out).unwrap();
        for t in 0..2 {
            for i in 0..d {
                let g = f64::from(x[t * 2 * d + i]);
                let u = f64::from(x[t * 2 * d + d + i]);
                assert!(close(out[t * d + i], (g / (1.0 + (-g).exp()) * u) as f32));
            }
        }
        assert!(silu_and_mul(&x, d, &mut out[1..]).is_err());
    }
}
