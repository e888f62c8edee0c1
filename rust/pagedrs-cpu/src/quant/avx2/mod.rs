//! AVX2 + FMA + F16C dot products of one weight row with `R` quantized activation rows (the weight
//! block is unpacked once for all `R`); the x8 kernels also in a variant with AVX-512 VNNI's `vpdpbusd`. Integer products as llama.cpp does them: `maddubs` of unsigned
//! weights (0..63) by signed 8-bit activations, `madd` by ones (or by 16-bit scales) to 32 bits, then one
//! float FMA per 32 weights with the product of the two block scales. Q4_0, Q4_1, Q8_0 and MXFP4 run the
//! block-group kernels (`block_group`) instead (8 integer dots reduced together, one FMA per 8); the
//! others the per-block ones (`per_block`).
//!
//! Every function here is `unsafe`: callers must have checked that the CPU has AVX2, FMA and F16C, and
//! that `w` points at `nb` whole blocks of the type and every `ActRow` holds the matching sub-blocks.
//!
//! The kernels: `per_block` (every type), `block_group` (Q4_0, Q4_1, Q8_0 and MXFP4), `x8_group` (the
//! 8-row interleaved layout) and `x8k_group` (its Q5_0 / Q5_1 / K-quant layouts).

use std::arch::x86_64::*;

use super::act::{ActRow, RowGroup};
use super::formats::{
    e8m0_half, scale_iq4_xs, scale_min_k4, scales_q3_k, KVALUES_IQ4NL, KVALUES_MXFP4,
};
use super::QuantType;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half(p: *const u8) -> f32 {
    let bits = p.cast::<u16>().read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_x(a: &ActRow<'_>, sub: usize) -> __m256i {
    _mm256_loadu_si256(a.qs.as_ptr().add(sub * 32).cast())
}

/// 16 bytes of nibble pairs -> 32 bytes: low nibbles first (weights 0..16), then the high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles16(p: *const u8) -> __m256i {
    let q = _mm_loadu_si128(p.cast());
    let m = _mm_set1_epi8(0x0f);
    _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m))
}

/// Bit `i` of `qh` -> 0x10 in byte `i` (the fifth bit of the Q5_0 / Q5_1 weights).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn high_bits(qh: u32) -> __m256i {
    let v = _mm256_set1_epi32(qh as i32);
    let shuf = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bytes = _mm256_shuffle_epi8(v, shuf);
    let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, sel), sel);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// `acc[r] += (w . x_r of sub-block sub) * dw * d_r[sub]` for unsigned weights `w`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn acc_unsigned<const R: usize>(
    w: __m256i,
    a: &[ActRow<'_>; R],
    sub: usize,
    dw: f32,
    acc: &mut [__m256; R],
) {
    let ones = _mm256_set1_epi16(1);
    for r in 0..R {
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, load_x(&a[r], sub)), ones);
        let scale = _mm256_set1_ps(dw * *a[r].d.get_unchecked(sub));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]);
    }
}

/// `off[r] += c * s_r[sub]` (the weight offset times the activation block's sum).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn acc_offset<const R: usize>(a: &[ActRow<'_>; R], sub: usize, c: f32, off: &mut [f32; R]) {
    for r in 0..R {
        off[r] += c * *a[r].s.get_unchecked(sub);
    }
}

/// Two sets of accumulators summed and reduced: `hsum(acc0 + acc1) + off0 + off1` per row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn finish<const R: usize>(acc: [[__m256; R]; 2], off: [[f32; R]; 2]) -> [f32; R] {
    let mut out = [0.0f32; R];
    for r in 0..R {
        out[r] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + (off[0][r] + off[1][r]);
    }
    out
}

/// Runs `$body` for blocks `0..$nb` with `$acc` / `$off` alternating between two sets of accumulators
/// (two independent FMA chains: one chain per block would leave the loop bound by the FMA latency),
/// then reduces them.
macro_rules! two_chains {
    ($nb:expr, $r:ident, |$b:ident, $acc:ident, $off:ident| $body:block) => {{
        let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); $r], [_mm256_setzero_ps(); $r]);
        let (mut off0, mut off1) = ([0.0f32; $r], [0.0f32; $r]);
        let nb: usize = $nb;
        let mut next = 0;
        while next + 1 < nb {
            {
                let ($b, $acc, $off) = (next, &mut acc0, &mut off0);
                $body
            }
            {
                let ($b, $acc, $off) = (next + 1, &mut acc1, &mut off1);
                $body
            }
            next += 2;
        }
        if next < nb {
            let ($b, $acc, $off) = (next, &mut acc0, &mut off0);
            $body
        }
        finish([acc0, acc1], [off0, off1])
    }};
}

mod block_group;
mod per_block;
mod x8_group;
mod x8k_group;
pub(super) use block_group::group_rows;
pub(super) use x8_group::{x8_group, x8_group_q8};
pub(super) use x8k_group::{x8_group_k45, x8_group_q5, x8_group_q6k};
