//! The x8 kernels (Q4_0 / Q4_1 / Q8_0 repacked 8 rows at a time; see `x8`) with AVX-512 VNNI's
//! `vpdpbusd` on 256-bit vectors (AVX512VL): each instruction multiplies 32 unsigned weight bytes by 32
//! signed activation bytes and adds the sums of four products to eight 32-bit lanes, where AVX2 needs a
//! `maddubs` to 16 bits, then additions, then a `madd` by ones. Every other kernel is the AVX2 one.
//!
//! The integer sums are exact in both (AVX2's 16-bit partial sums never saturate, see `avx2`), and the
//! float steps are AVX2's in the same order, so every output has the AVX2 kernels' bits (tested).
//!
//! Every function here is `unsafe`: callers must have checked that the CPU has AVX2, FMA, F16C,
//! AVX512VL and AVX512-VNNI, and that `w` points at `nb` packed blocks and every `ActRow` holds the
//! matching sub-blocks.

use std::arch::x86_64::*;

use super::act::ActRow;

/// `acc + (four-byte dot products of unsigned a by signed b)` per 32-bit lane: `vpdpbusd` on ymm
/// registers (EVEX, AVX512VL + AVX512-VNNI). Inline assembly: the intrinsic and the target feature need
/// Rust 1.89, newer than the crate's minimum.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dpbusd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    let mut acc = acc;
    std::arch::asm!(
        "vpdpbusd {acc}, {a}, {b}",
        acc = inout(ymm_reg) acc,
        a = in(ymm_reg) a,
        b = in(ymm_reg) b,
        options(pure, nomem, nostack, preserves_flags),
    );
    acc
}

/// `avx2::x8_group` with `vpdpbusd`: lane `j` of row `r`'s result is weight row `j` of the group.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn x8_group<const R: usize, const Q41: bool>(
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [__m256; R] {
    let (head, bb) = if Q41 { (32, 160) } else { (16, 144) };
    let m4 = _mm256_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let p = w.add(b * bb);
        let mut s = [_mm256_setzero_si256(); R];
        for t in 0..4 {
            let v = _mm256_loadu_si256(p.add(head + 32 * t).cast());
            let lo = _mm256_and_si256(v, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            for r in 0..R {
                // Activations 4t..4t+3 (low nibbles) and 16+4t.. (high ones), broadcast to the 8 rows.
                let x = a[r].qs.as_ptr().add(32 * b).cast::<i32>();
                let bx = |i: usize| _mm256_set1_epi32(x.add(i).read_unaligned());
                s[r] = dpbusd(s[r], lo, bx(t));
                s[r] = dpbusd(s[r], hi, bx(4 + t));
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
        let mw = if Q41 {
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast()))
        } else {
            _mm256_mul_ps(dw, _mm256_set1_ps(-8.0))
        };
        for r in 0..R {
            let isum = _mm256_cvtepi32_ps(s[r]);
            let dx = _mm256_set1_ps(*a[r].d.get_unchecked(b));
            acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, dx), acc[r]);
            acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*a[r].s.get_unchecked(b)), acc[r]);
        }
    }
    acc
}

/// `avx2::x8_group_q8` with `vpdpbusd`: |w| (unsigned) by x with w's sign moved onto it.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn x8_group_q8<const R: usize>(
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [__m256; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let p = w.add(b * 272);
        let mut s = [_mm256_setzero_si256(); R];
        for t in 0..8 {
            let v = _mm256_loadu_si256(p.add(16 + 32 * t).cast());
            let av = _mm256_sign_epi8(v, v);
            for r in 0..R {
                let x = a[r].qs.as_ptr().add(32 * b + 4 * t).cast::<i32>();
                let sx = _mm256_sign_epi8(_mm256_set1_epi32(x.read_unaligned()), v);
                s[r] = dpbusd(s[r], av, sx);
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
        for r in 0..R {
            let dx = _mm256_set1_ps(*a[r].d.get_unchecked(b));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(dw, dx), acc[r]);
        }
    }
    acc
}
