//! Activations quantized to 8 bits per block of 32 (as llama.cpp's `block_q8_1`, with f32 scales):
//! `x[i] ~ d[b] * qs[i]`, and `s[b] = d[b] * sum(qs of block b)` for the offset terms of the weight types
//! that carry one (Q4_1, Q5_1, the K-quants' mins).

use super::formats::SUB;

/// `rows` activation rows of `k` values each (`k` a multiple of 32), quantized.
pub struct QuantizedActs {
    pub k: usize,
    pub rows: usize,
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
}

/// One quantized row, borrowed.
#[derive(Clone, Copy)]
pub struct ActRow<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub s: &'a [f32],
}

impl QuantizedActs {
    /// Quantizes `x` (`rows * k` values, row-major) with the kernel `Isa::chosen()` names.
    pub fn new(x: &[f32], rows: usize, k: usize) -> Self {
        Self::new_with(super::Isa::chosen(), x, rows, k)
    }

    /// `new` on the kernel chosen by the caller: the AVX2 and NEON ones give the portable one's bits (the
    /// same scalar scale, the same products, round-half-to-even in all).
    pub fn new_with(isa: super::Isa, x: &[f32], rows: usize, k: usize) -> Self {
        debug_assert_eq!(x.len(), rows * k);
        debug_assert_eq!(k % SUB, 0);
        let nb = rows * k / SUB;
        let mut qs = vec![0i8; rows * k];
        let (mut d, mut s) = (vec![0.0f32; nb], vec![0.0f32; nb]);
        let blocks = x
            .chunks_exact(SUB)
            .zip(qs.chunks_exact_mut(SUB))
            .zip(d.iter_mut())
            .zip(s.iter_mut());
        #[cfg(target_arch = "x86_64")]
        if isa.is_x86() && isa.is_supported() {
            for (((x, q), d), s) in blocks {
                // SAFETY: AVX2 detected; `x` and `q` are whole blocks of 32.
                #[allow(unsafe_code)]
                unsafe {
                    (*d, *s) = quantize_block_avx2(x, q);
                }
            }
            return QuantizedActs { k, rows, qs, d, s };
        }
        #[cfg(target_arch = "aarch64")]
        if matches!(isa, super::Isa::Neon | super::Isa::NeonDot) && isa.is_supported() {
            for (((x, q), d), s) in blocks {
                // SAFETY: NEON supported; `x` and `q` are whole blocks of 32.
                #[allow(unsafe_code)]
                unsafe {
                    (*d, *s) = super::neon::quantize_block(x, q);
                }
            }
            return QuantizedActs { k, rows, qs, d, s };
        }
        let _ = isa;
        for (((x, q), d), s) in blocks {
            (*d, *s) = quantize_block(x, q);
        }
        QuantizedActs { k, rows, qs, d, s }
    }

    pub fn row(&self, r: usize) -> ActRow<'_> {
        let nb = self.k / SUB;
        ActRow {
            qs: &self.qs[r * self.k..][..self.k],
            d: &self.d[r * nb..][..nb],
            s: &self.s[r * nb..][..nb],
        }
    }
}

/// `R` activation rows `i..i + R` with their block scales interleaved for the block-group kernels:
/// `d[b * R + r]` is row `i + r`'s scale of block `b` (and `s` likewise), zero-padded so that 8 floats
/// can be read from any `b * R` with `b < nb`.
pub struct Interleaved {
    pub i: usize,
    pub r: usize,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
}

impl Interleaved {
    pub fn new(acts: &QuantizedActs, i: usize, r: usize) -> Self {
        let nb = acts.k / SUB;
        let len = nb * r + 8;
        let (mut d, mut s) = (vec![0.0f32; len], vec![0.0f32; len]);
        for rr in 0..r {
            let row = acts.row(i + rr);
            for b in 0..nb {
                d[b * r + rr] = row.d[b];
                s[b * r + rr] = row.s[b];
            }
        }
        Interleaved { i, r, d, s }
    }

    /// The group borrowed, with its rows (`R` must be `self.r`).
    pub fn group<'a, const R: usize>(&'a self, acts: &'a QuantizedActs) -> RowGroup<'a, R> {
        debug_assert_eq!(R, self.r);
        RowGroup {
            rows: std::array::from_fn(|r| acts.row(self.i + r)),
            d: &self.d,
            s: &self.s,
        }
    }
}

/// `R` quantized rows and their interleaved block scales (see `Interleaved`).
pub struct RowGroup<'a, const R: usize> {
    pub rows: [ActRow<'a>; R],
    pub d: &'a [f32],
    pub s: &'a [f32],
}

/// Round to nearest (ties to even, as `_mm256_round_ps` and NEON's `fcvtns` do); returns (d, d * sum(q)).
#[inline]
fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        let r = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        *q = r;
        sum += i32::from(r);
    }
    (d, d * sum as f32)
}

/// `quantize_block` in AVX2 (a libm `rintf` call per value there, as x86-64's baseline has no vector
/// rounding: about a tenth of a speculative verification step's time went to it): the same scalar scale
/// and inverse, the same products, `_mm256_round_ps` to nearest with ties to even, an exact integer sum.
/// The max ignores NaN as `f32::max` does (`max_ps` returns its second operand, the running max, when
/// the first is NaN).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(x: &[f32], q: &mut [i8]) -> (f32, f32) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() == SUB && q.len() == SUB);
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i)));
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let mut m = _mm256_setzero_ps();
    for vi in v {
        m = _mm256_max_ps(_mm256_and_ps(vi, abs_mask), m);
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    let amax = lanes.iter().fold(0.0f32, |a, &b| a.max(b));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let (idv, lo, hi) = (
        _mm256_set1_ps(id),
        _mm256_set1_ps(-127.0),
        _mm256_set1_ps(127.0),
    );
    let qi: [__m256i; 4] = std::array::from_fn(|i| {
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(v[i], idv),
        );
        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
    });
    let sum = _mm256_add_epi32(
        _mm256_add_epi32(qi[0], qi[1]),
        _mm256_add_epi32(qi[2], qi[3]),
    );
    let mut sums = [0i32; 8];
    _mm256_storeu_si256(sums.as_mut_ptr().cast(), sum);
    // i32 -> i16 -> i8 packs work per 128-bit lane: the permute puts the 32 bytes back in order
    let packed = _mm256_packs_epi16(
        _mm256_packs_epi32(qi[0], qi[1]),
        _mm256_packs_epi32(qi[2], qi[3]),
    );
    let ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr().cast(), ordered);
    (d, d * sums.iter().sum::<i32>() as f32)
}

/// `dot(dequantized weight row, dequantized activation row)` through the sub-block decoder, in plain
/// Rust: the fallback on CPUs without AVX2 or NEON (and the reference the SIMD kernels are tested against).
pub fn dot_portable(qt: super::QuantType, wrow: &[u8], a: ActRow<'_>) -> f32 {
    let (bb, subs) = (qt.block_bytes(), qt.block_len() / SUB);
    let mut vals = [0i8; SUB];
    let mut acc = 0.0f32;
    for (blk, block) in wrow.chunks_exact(bb).enumerate() {
        for sub in 0..subs {
            let (scale, offset) = super::formats::decode_sub(qt, block, sub, &mut vals);
            let ab = blk * subs + sub;
            let xq = &a.qs[ab * SUB..][..SUB];
            let (mut dot, mut sx) = ([0i32; 2], [0i32; 2]);
            for (i, (&w, &x)) in vals.iter().zip(xq).enumerate() {
                dot[i / 16] += i32::from(w) * i32::from(x);
                sx[i / 16] += i32::from(x);
            }
            acc += a.d[ab]
                * (scale[0] * dot[0] as f32
                    + scale[1] * dot[1] as f32
                    + offset[0] * sx[0] as f32
                    + offset[1] * sx[1] as f32);
        }
    }
    acc
}
