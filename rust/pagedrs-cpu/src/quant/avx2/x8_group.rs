//! The x8 kernels (Q4_0 / Q4_1 / Q8_0 repacked 8 rows at a time; see `x8`).
//!
//! Per block, the weights of the 8 rows are loaded 32 bytes at a time and each of the `R` activation rows'
//! integer sums kept in its own register (t outer, rows inner: R sums, R accumulators and the one weight
//! vector in flight fit the 16 registers at R <= 4). Integer sums are exact in any order, so a row gets the
//! same bits for any R (and from `x8::group_portable`).

use super::*;

/// `acc + (four-byte dot products of unsigned a by signed b)` per 32-bit lane: AVX-512 VNNI's `vpdpbusd`
/// on ymm registers (EVEX; the CPU must have AVX512VL and AVX512-VNNI). Inline assembly: the intrinsic
/// and the target feature need Rust 1.89, newer than the crate's minimum.
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

/// `dpbusd(acc, a, broadcast of the four bytes at x)`, the broadcast folded into the instruction
/// (EVEX embedded broadcast `{1to8}`: one load, no shuffle). Same CPU needs as `dpbusd`; `x` must be
/// readable for 4 bytes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn dpbusd_bcast(acc: __m256i, a: __m256i, x: *const i32) -> __m256i {
    let mut acc = acc;
    std::arch::asm!(
        "vpdpbusd {acc}, {a}, dword ptr [{x}]{{1to8}}",
        acc = inout(ymm_reg) acc,
        a = in(ymm_reg) a,
        x = in(reg) x,
        options(pure, readonly, nostack, preserves_flags),
    );
    acc
}

/// The 8 outputs of one packed group (`nb` blocks at `w`) for each of the `R` activation rows: lane `j` of
/// the result is weight row `j` of the group. `Q41`: the type is Q4_1 (else Q4_0). `VNNI` (the CPU must
/// have AVX512VL and AVX512-VNNI): each `maddubs` to 16 bits, its addition and the final `madd` become one
/// `vpdpbusd` into 32 bits; the integer sums are exact either way, so the bits are the same.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn x8_group<const R: usize, const Q41: bool, const VNNI: bool>(
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [__m256; R] {
    let (head, bb) = if Q41 { (32, 160) } else { (16, 144) };
    let m4 = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let p = w.add(b * bb);
        // i16 sums of 8 maddubs lanes (each |lane| <= 2 * 15 * 127): at most 30480, exact (VNNI: i32).
        let mut s = [_mm256_setzero_si256(); R];
        if VNNI {
            // Two chains of 4 per row (low and high nibbles) instead of one of 8: half the latency
            // between a block's first product and its sum; integer sums, so the same bits.
            let mut s_hi = [_mm256_setzero_si256(); R];
            for t in 0..4 {
                let v = _mm256_loadu_si256(p.add(head + 32 * t).cast());
                let lo = _mm256_and_si256(v, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                for r in 0..R {
                    let x = a[r].qs.as_ptr().add(32 * b).cast::<i32>();
                    s[r] = dpbusd_bcast(s[r], lo, x.add(t));
                    s_hi[r] = dpbusd_bcast(s_hi[r], hi, x.add(4 + t));
                }
            }
            for r in 0..R {
                s[r] = _mm256_add_epi32(s[r], s_hi[r]);
            }
        } else {
            for t in 0..4 {
                let v = _mm256_loadu_si256(p.add(head + 32 * t).cast());
                let lo = _mm256_and_si256(v, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                for r in 0..R {
                    // Activations 4t..4t+3 (low nibbles) and 16+4t.. (high ones), broadcast to the 8 rows.
                    let x = a[r].qs.as_ptr().add(32 * b).cast::<i32>();
                    let bx = |i: usize| _mm256_set1_epi32(x.add(i).read_unaligned());
                    s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, bx(t)));
                    s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, bx(4 + t)));
                }
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
        let mw = if Q41 {
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast()))
        } else {
            _mm256_mul_ps(dw, _mm256_set1_ps(-8.0))
        };
        for r in 0..R {
            let i32s = if VNNI {
                s[r]
            } else {
                _mm256_madd_epi16(s[r], ones)
            };
            let isum = _mm256_cvtepi32_ps(i32s);
            let dx = _mm256_set1_ps(*a[r].d.get_unchecked(b));
            acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, dx), acc[r]);
            acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*a[r].s.get_unchecked(b)), acc[r]);
        }
    }
    acc
}

/// `x8_group` for Q8_0: signed weights, each `maddubs` of |w| by x with w's sign (pairs up to
/// 2 * 128 * 127, so each goes to 32 bits by `madd` at once; `VNNI`: one `vpdpbusd`, the same sums).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn x8_group_q8<const R: usize, const VNNI: bool>(
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [__m256; R] {
    let ones = _mm256_set1_epi16(1);
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
                s[r] = if VNNI {
                    dpbusd(s[r], av, sx)
                } else {
                    _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(av, sx), ones))
                };
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
