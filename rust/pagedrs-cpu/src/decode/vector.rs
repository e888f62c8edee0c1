//! The decode inner loops behind one trait: a portable version and, on x86-64, one over the AVX2 + FMA
//! intrinsics of `avx2`.

#[cfg(target_arch = "x86_64")]
use super::avx2;

/// Width of the accumulator arrays of the inner loops (two AVX2 registers, four SSE2 ones).
const LANES: usize = 16;

/// The two inner loops: a portable version (auto-vectorized for the build target) and, on x86-64, one
/// written with AVX2 + FMA intrinsics, used only after run-time feature detection.
pub(super) trait Vector {
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

pub(super) struct Portable;
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
pub(super) struct Avx2;
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
