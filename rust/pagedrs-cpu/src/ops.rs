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
    for (xr, or) in x.chunks_exact(2 * d).zip(out.chunks_exact_mut(d.max(1))) {
        let (gate, up) = xr.split_at(d);
        for ((o, &g), &u) in or.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
    Ok(())
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
