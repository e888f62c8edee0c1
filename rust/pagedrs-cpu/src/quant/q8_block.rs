//! One block of 32 activations quantized to 8 bits (a block of `QuantizedActs`, as llama.cpp's
//! `quantize_row_q8_1` per block): the portable quantizer, and its AVX2 and NEON copies with its bits.

use super::formats::SUB;

/// Round to nearest (ties to even, as `_mm256_round_ps` and NEON's `fcvtns` do); returns (d, d * sum(q)).
#[inline]
pub(super) fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32) {
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
pub(super) unsafe fn quantize_block_avx2(x: &[f32], q: &mut [i8]) -> (f32, f32) {
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

/// The portable activation quantizer of one block of 32 (`quantize_block`) in NEON, with its bits:
/// the same scalar scale and inverse, the same products, `fcvtns` (round to nearest, ties to even; NaN to
/// 0, as the portable `as i8` does), the same clamp, an exact integer sum. The max ignores NaN as
/// `f32::max` does (`fmaxnm`).
#[cfg(target_arch = "aarch64")]
#[allow(unsafe_code)]
pub(super) unsafe fn quantize_block_neon(x: &[f32], q: &mut [i8]) -> (f32, f32) {
    use std::arch::aarch64::*;
    debug_assert!(x.len() == SUB && q.len() == SUB);
    let v: [float32x4_t; 8] = std::array::from_fn(|i| vld1q_f32(x.as_ptr().add(4 * i)));
    let mut m = vdupq_n_f32(0.0);
    for vi in v {
        m = vmaxnmq_f32(m, vabsq_f32(vi));
    }
    let amax = vmaxnmvq_f32(m);
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let (lo, hi) = (vdupq_n_s32(-127), vdupq_n_s32(127));
    let qi: [int32x4_t; 8] = std::array::from_fn(|i| {
        vminq_s32(vmaxq_s32(vcvtnq_s32_f32(vmulq_n_f32(v[i], id)), lo), hi)
    });
    let sum = qi.iter().fold(vdupq_n_s32(0), |s, &v| vaddq_s32(s, v));
    // |q| <= 127: the narrowing moves are exact
    let h: [int16x8_t; 4] =
        std::array::from_fn(|i| vcombine_s16(vmovn_s32(qi[2 * i]), vmovn_s32(qi[2 * i + 1])));
    vst1q_s8(
        q.as_mut_ptr(),
        vcombine_s8(vmovn_s16(h[0]), vmovn_s16(h[1])),
    );
    vst1q_s8(
        q.as_mut_ptr().add(16),
        vcombine_s8(vmovn_s16(h[2]), vmovn_s16(h[3])),
    );
    (d, d * vaddvq_s32(sum) as f32)
}
