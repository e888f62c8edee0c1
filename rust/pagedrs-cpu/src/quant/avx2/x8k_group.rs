//! The x8 kernels of Q5_0 / Q5_1 and the K-quants (laid out by `x8k`): as `x8_group`, 32 bytes of the
//! packed weights (4 of each row) against 4 activations broadcast to every lane, `maddubs` to 16 bits for
//! at most 4 loads (no saturation: 4 * 2 * 31 * 127 < 2^15), then `madd` to 32 bits by ones or by the
//! rows' scales. Integer sums are exact in any order, so a row gets the same bits for any R (and from
//! `x8k::group_portable`).

use super::x8_group::dpbusd_bcast;
use super::*;

/// A 32-bit lane per row: `v` shifted right by `n` bits (`n` in 0..32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn srl32(v: __m256i, n: usize) -> __m256i {
    _mm256_srl_epi32(v, _mm_cvtsi32_si128(n as i32))
}

/// Bit `k` (0..8) of every byte of `h` moved to bit 4 (0x10 or 0), the rest cleared.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bit_to_4(h: __m256i, k: usize) -> __m256i {
    let moved = if k <= 4 {
        _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - k as i32))
    } else {
        _mm256_srl_epi16(h, _mm_cvtsi32_si128(k as i32 - 4))
    };
    _mm256_and_si256(moved, _mm256_set1_epi8(0x10))
}

/// The four activations `at..at + 4` of row `a` broadcast to every 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bx(a: &ActRow<'_>, at: usize) -> __m256i {
    _mm256_set1_epi32(a.qs.as_ptr().add(at).cast::<i32>().read_unaligned())
}

/// 8 unsigned bytes at `p` widened to the 8 32-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
}

/// Each 32-bit lane's low 16 bits copied to both halves (a per-row factor for `madd`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair16(v: __m256i) -> __m256i {
    _mm256_or_si256(
        _mm256_and_si256(v, _mm256_set1_epi32(0xffff)),
        _mm256_slli_epi32(v, 16),
    )
}

/// Q5_0 (`Q51` false) / Q5_1 packed groups: the 8 outputs for each of the `R` activation rows. `VNNI` (the
/// CPU must have AVX512VL and AVX512-VNNI): each `maddubs` pair and its `madd` become `vpdpbusd` into 32
/// bits with the activations broadcast from memory; the integer sums are exact either way, so the bits are
/// the same.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn x8_group_q5<const R: usize, const Q51: bool, const VNNI: bool>(
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [__m256; R] {
    let (head, bb) = if Q51 { (32, 192) } else { (16, 176) };
    let (m4, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi16(1));
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let p = w.add(b * bb);
        let h = _mm256_loadu_si256(p.add(head).cast());
        let mut s32 = [_mm256_setzero_si256(); R];
        for t2 in 0..2 {
            let mut s = [_mm256_setzero_si256(); R];
            for t in 2 * t2..2 * t2 + 2 {
                let v = _mm256_loadu_si256(p.add(head + 32 + 32 * t).cast());
                let lo = _mm256_or_si256(_mm256_and_si256(v, m4), bit_to_4(h, t));
                let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                let hi = _mm256_or_si256(hi, bit_to_4(h, 4 + t));
                for r in 0..R {
                    let x = 32 * b + 4 * t;
                    if VNNI {
                        let xp = a[r].qs.as_ptr().add(x);
                        s32[r] = dpbusd_bcast(s32[r], lo, xp.cast());
                        s32[r] = dpbusd_bcast(s32[r], hi, xp.add(16).cast());
                    } else {
                        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, bx(&a[r], x)));
                        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, bx(&a[r], x + 16)));
                    }
                }
            }
            if !VNNI {
                for r in 0..R {
                    s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(s[r], ones));
                }
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
        let mw = if Q51 {
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast()))
        } else {
            _mm256_mul_ps(dw, _mm256_set1_ps(-16.0))
        };
        for r in 0..R {
            let dx = _mm256_set1_ps(*a[r].d.get_unchecked(b));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(dw, dx), acc[r]);
            acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*a[r].s.get_unchecked(b)), acc[r]);
        }
    }
    acc
}

/// Q4_K (`Q5` false) / Q5_K packed groups: the 8 outputs for each of the `R` activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn x8_group_k45<const R: usize, const Q5: bool>(
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [__m256; R] {
    let (qs_at, bb) = if Q5 { (384, 1408) } else { (128, 1152) };
    let (m4, m15, m3) = (
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi32(15),
        _mm256_set1_epi32(3),
    );
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let p = w.add(b * bb);
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast()));
        for j in 0..8 {
            // the 8 rows' 6-bit scale and min of sub-block j
            let lo = bytes8(p.add(32 + 8 * j));
            let hi = srl32(bytes8(p.add(96 + 8 * (j % 4))), 4 * (j / 4));
            let sc = _mm256_or_si256(
                _mm256_and_si256(lo, m15),
                _mm256_slli_epi32(_mm256_and_si256(hi, m3), 4),
            );
            let mn = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi32(lo, 4), m15),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 2), m3), 4),
            );
            let sc16 = pair16(sc);
            let sub = 8 * b + j;
            let q = p.add(qs_at + 256 * (j / 2));
            let shift = _mm_cvtsi32_si128(4 * (j & 1) as i32);
            let mut s32 = [_mm256_setzero_si256(); R];
            for u4 in 0..2 {
                let mut s = [_mm256_setzero_si256(); R];
                for u in 4 * u4..4 * u4 + 4 {
                    let v = _mm256_loadu_si256(q.add(32 * u).cast());
                    let mut wq = _mm256_and_si256(_mm256_srl_epi16(v, shift), m4);
                    if Q5 {
                        let h = _mm256_loadu_si256(p.add(128 + 32 * u).cast());
                        wq = _mm256_or_si256(wq, bit_to_4(h, j));
                    }
                    for r in 0..R {
                        let x = bx(&a[r], 32 * sub + 4 * u);
                        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(wq, x));
                    }
                }
                for r in 0..R {
                    s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(s[r], sc16));
                }
            }
            let mf = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn));
            for r in 0..R {
                let dx = _mm256_set1_ps(*a[r].d.get_unchecked(sub));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(dw, dx), acc[r]);
                acc[r] = _mm256_fnmadd_ps(mf, _mm256_set1_ps(*a[r].s.get_unchecked(sub)), acc[r]);
            }
        }
    }
    acc
}

/// Q6_K packed groups: the 8 outputs for each of the `R` activation rows. The weights `q - 32` are
/// signed: `maddubs` of |w| by x with w's sign moved onto x (as Q8_0). One activation row goes through
/// `q6k_one_row` (the same sums in the same order, so the same bits).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn x8_group_q6k<const R: usize>(
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [__m256; R] {
    if R == 1 {
        let mut acc = [_mm256_setzero_ps(); R];
        acc[0] = q6k_one_row(w, nb, &a[0]);
        return acc;
    }
    let (m4, m3, m32) = (
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi8(3),
        _mm256_set1_epi8(32),
    );
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let p = w.add(b * 1680);
        prefetch_after_next(p);
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
        for s8 in 0..8 {
            let (h, t) = (s8 / 4, s8 % 4);
            let ql = p.add(144 + 256 * (2 * h + (t & 1)));
            let qh = p.add(1168 + 256 * h);
            let (lo_shift, hi_shift) = (
                _mm_cvtsi32_si128(4 * (t >> 1) as i32),
                _mm_cvtsi32_si128(2 * t as i32),
            );
            let sub = 8 * b + s8;
            let mut s32 = [_mm256_setzero_si256(); R];
            for hh in 0..2 {
                let sc =
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(16 + 8 * (2 * s8 + hh)).cast()));
                let sc16 = pair16(sc);
                let mut s = [_mm256_setzero_si256(); R];
                for u in 4 * hh..4 * hh + 4 {
                    let l = _mm256_and_si256(
                        _mm256_srl_epi16(_mm256_loadu_si256(ql.add(32 * u).cast()), lo_shift),
                        m4,
                    );
                    let hb = _mm256_and_si256(
                        _mm256_srl_epi16(_mm256_loadu_si256(qh.add(32 * u).cast()), hi_shift),
                        m3,
                    );
                    let wq = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16(hb, 4)), m32);
                    let aw = _mm256_sign_epi8(wq, wq);
                    for r in 0..R {
                        let x = _mm256_sign_epi8(bx(&a[r], 32 * sub + 4 * u), wq);
                        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(aw, x));
                    }
                }
                for r in 0..R {
                    s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(s[r], sc16));
                }
            }
            for r in 0..R {
                let dx = _mm256_set1_ps(*a[r].d.get_unchecked(sub));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(dw, dx), acc[r]);
            }
        }
    }
    acc
}

/// The packed Q6_K block after the next one (from block `p`) prefetched into L1: the hardware prefetchers
/// lose the interleaved streams of its `ql` and `qh` chunks (measured at one activation row, out of
/// cache: twice the file layout's time without it). Addresses past the weights are harmless (a prefetch
/// does not fault; the pointer is never read).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch_after_next(p: *const u8) {
    let ahead = p.wrapping_add(2 * 1680);
    for line in (0..1680).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
    }
}

/// Q6_K packed groups against one activation row, a half block (4 sub-blocks) at a time: each 32-byte
/// load of the two `ql` chunks and the `qh` chunk of a half serves its 4 sub-blocks (the 4 weights of
/// each of the 8 rows in those bytes), so every weight byte is loaded once; the 4 sub-blocks' integer
/// sums live in 8 registers (too many for more rows).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_one_row(w: *const u8, nb: usize, a: &ActRow<'_>) -> __m256 {
    let (m4, m30, m32) = (
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi8(0x30),
        _mm256_set1_epi8(32),
    );
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        let p = w.add(b * 1680);
        prefetch_after_next(p);
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
        for h in 0..2 {
            let (qa, qb, qh) = (
                p.add(144 + 512 * h),
                p.add(400 + 512 * h),
                p.add(1168 + 256 * h),
            );
            let x0 = 32 * (8 * b + 4 * h);
            let mut s32 = [_mm256_setzero_si256(); 4];
            for hh in 0..2 {
                let mut s = [_mm256_setzero_si256(); 4];
                for u in 4 * hh..4 * hh + 4 {
                    let la = _mm256_loadu_si256(qa.add(32 * u).cast());
                    let lb = _mm256_loadu_si256(qb.add(32 * u).cast());
                    let hb = _mm256_loadu_si256(qh.add(32 * u).cast());
                    // quarter t: low nibbles of chunk a / b (t = 0, 1) or high ones (2, 3); bits 2t, 2t + 1
                    // of qh as bits 4, 5
                    let q = [
                        _mm256_or_si256(
                            _mm256_and_si256(la, m4),
                            _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(lb, m4),
                            _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(la, 4), m4),
                            _mm256_and_si256(hb, m30),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(lb, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30),
                        ),
                    ];
                    for t in 0..4 {
                        let wq = _mm256_sub_epi8(q[t], m32);
                        let x = _mm256_sign_epi8(bx(a, x0 + 32 * t + 4 * u), wq);
                        let aw = _mm256_sign_epi8(wq, wq);
                        s[t] = _mm256_add_epi16(s[t], _mm256_maddubs_epi16(aw, x));
                    }
                }
                for t in 0..4 {
                    let at = 16 + 8 * (2 * (4 * h + t) + hh);
                    let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(at).cast()));
                    s32[t] = _mm256_add_epi32(s32[t], _mm256_madd_epi16(s[t], pair16(sc)));
                }
            }
            for (t, s) in s32.into_iter().enumerate() {
                let dx = _mm256_set1_ps(*a.d.get_unchecked(8 * b + 4 * h + t));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc);
            }
        }
    }
    acc
}
