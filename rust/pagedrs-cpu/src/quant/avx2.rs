//! AVX2 + FMA + F16C dot products of one weight row with `R` quantized activation rows (the weight
//! block is unpacked once for all `R`); the x8 kernels also in a variant with AVX-512 VNNI's `vpdpbusd`. Integer products as llama.cpp does them: `maddubs` of unsigned
//! weights (0..63) by signed 8-bit activations, `madd` by ones (or by 16-bit scales) to 32 bits, then one
//! float FMA per 32 weights with the product of the two block scales. Q4_0, Q4_1, Q8_0 and MXFP4 run the
//! block-group kernels below instead (8 integer dots reduced together, one FMA per 8); the others the
//! per-block ones.
//!
//! Every function here is `unsafe`: callers must have checked that the CPU has AVX2, FMA and F16C, and
//! that `w` points at `nb` whole blocks of the type and every `ActRow` holds the matching sub-blocks.

use std::arch::x86_64::*;

use super::act::{ActRow, RowGroup};
use super::formats::{e8m0_half, scale_min_k4, KVALUES_MXFP4};
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

/// Dot products of one weight row (`nb` blocks of `qt` at `w`) with each of `a`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_rows<const R: usize>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [f32; R] {
    match qt {
        QuantType::Q4_0 => q4_0(w, nb, a),
        QuantType::Q4_1 => q4_1(w, nb, a),
        QuantType::Q5_0 => q5_0(w, nb, a),
        QuantType::Q5_1 => q5_1(w, nb, a),
        QuantType::Q8_0 => q8_0(w, nb, a),
        QuantType::Q4_K => q4_k(w, nb, a),
        QuantType::Q5_K => q5_k(w, nb, a),
        QuantType::Q6_K => q6_k(w, nb, a),
        QuantType::MXFP4 => mxfp4(w, nb, a),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    two_chains!(nb, R, |b, acc, off| {
        let p = w.add(b * 18);
        let d = half(p);
        acc_unsigned(nibbles16(p.add(2)), a, b, d, acc);
        acc_offset(a, b, -8.0 * d, off);
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    two_chains!(nb, R, |b, acc, off| {
        let p = w.add(b * 20);
        acc_unsigned(nibbles16(p.add(4)), a, b, half(p), acc);
        acc_offset(a, b, half(p.add(2)), off);
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    two_chains!(nb, R, |b, acc, off| {
        let p = w.add(b * 22);
        let d = half(p);
        let qh = p.add(2).cast::<u32>().read_unaligned();
        let q = _mm256_or_si256(nibbles16(p.add(6)), high_bits(u32::from_le(qh)));
        acc_unsigned(q, a, b, d, acc);
        acc_offset(a, b, -16.0 * d, off);
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_1<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    two_chains!(nb, R, |b, acc, off| {
        let p = w.add(b * 24);
        let qh = p.add(4).cast::<u32>().read_unaligned();
        let q = _mm256_or_si256(nibbles16(p.add(8)), high_bits(u32::from_le(qh)));
        acc_unsigned(q, a, b, half(p), acc);
        acc_offset(a, b, half(p.add(2)), off);
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    let ones = _mm256_set1_epi16(1);
    two_chains!(nb, R, |b, acc, _off| {
        let p = w.add(b * 34);
        let d = half(p);
        let q = _mm256_loadu_si256(p.add(2).cast());
        // Signed x signed through maddubs: |w| times x with w's sign moved onto x.
        let aq = _mm256_sign_epi8(q, q);
        for r in 0..R {
            let x = _mm256_sign_epi8(load_x(&a[r], b), q);
            let s = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, x), ones);
            let scale = _mm256_set1_ps(d * *a[r].d.get_unchecked(b));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
        }
    })
}

/// MXFP4 as llama.cpp's `ggml_vec_dot_mxfp4_q8_0`: the nibbles looked up in the doubled e2m1 table
/// (`pshufb`) to signed bytes (|w| <= 12), their signed dot with the activations through `maddubs` (the
/// sign trick, as Q8_0), times the halved e8m0 scale and the activation block's scale.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mxfp4<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    let table = _mm_loadu_si128(KVALUES_MXFP4.as_ptr().cast());
    let m4 = _mm_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    two_chains!(nb, R, |b, acc, _off| {
        let p = w.add(b * 17);
        let d = e8m0_half(*p);
        let q = _mm_loadu_si128(p.add(1).cast());
        let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, m4));
        let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
        let v = _mm256_set_m128i(hi, lo);
        let av = _mm256_sign_epi8(v, v);
        for r in 0..R {
            let x = _mm256_sign_epi8(load_x(&a[r], b), v);
            let s = _mm256_madd_epi16(_mm256_maddubs_epi16(av, x), ones);
            let scale = _mm256_set1_ps(d * *a[r].d.get_unchecked(b));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
        }
    })
}

/// The 8 (scale, min) pairs of a Q4_K / Q5_K block, as floats times d and dmin.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_scales(p: *const u8) -> ([f32; 8], [f32; 8]) {
    let (d, dmin) = (half(p), half(p.add(2)));
    let packed = std::slice::from_raw_parts(p.add(4), 12);
    let (mut sc, mut mn) = ([0.0f32; 8], [0.0f32; 8]);
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, packed);
        sc[j] = d * f32::from(s);
        mn[j] = -(dmin * f32::from(m));
    }
    (sc, mn)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    // Two chains: even sub-blocks into set 0, odd ones into set 1.
    let (mut acc, mut off) = ([[_mm256_setzero_ps(); R]; 2], [[0.0f32; R]; 2]);
    let m4 = _mm256_set1_epi8(0x0f);
    for b in 0..nb {
        let p = w.add(b * 144);
        let (sc, mn) = k_scales(p);
        for j in 0..4 {
            let q = _mm256_loadu_si256(p.add(16 + 32 * j).cast());
            let (s0, s1) = (8 * b + 2 * j, 8 * b + 2 * j + 1);
            let (acc0, acc1) = acc.split_at_mut(1);
            let (off0, off1) = off.split_at_mut(1);
            acc_unsigned(_mm256_and_si256(q, m4), a, s0, sc[2 * j], &mut acc0[0]);
            acc_unsigned(
                _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                a,
                s1,
                sc[2 * j + 1],
                &mut acc1[0],
            );
            acc_offset(a, s0, mn[2 * j], &mut off0[0]);
            acc_offset(a, s1, mn[2 * j + 1], &mut off1[0]);
        }
    }
    finish(acc, off)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    // Two chains: even sub-blocks into set 0, odd ones into set 1.
    let (mut acc, mut off) = ([[_mm256_setzero_ps(); R]; 2], [[0.0f32; R]; 2]);
    let (m4, one) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
    for b in 0..nb {
        let p = w.add(b * 176);
        let (sc, mn) = k_scales(p);
        // Bit s of each qh byte is the fifth bit of sub-block s; shifted down one per sub-block.
        let mut qh = _mm256_loadu_si256(p.add(16).cast());
        for j in 0..4 {
            let q = _mm256_loadu_si256(p.add(48 + 32 * j).cast());
            let (s0, s1) = (8 * b + 2 * j, 8 * b + 2 * j + 1);
            let h0 = _mm256_slli_epi16(_mm256_and_si256(qh, one), 4);
            qh = _mm256_srli_epi16(qh, 1);
            let h1 = _mm256_slli_epi16(_mm256_and_si256(qh, one), 4);
            qh = _mm256_srli_epi16(qh, 1);
            let lo = _mm256_or_si256(_mm256_and_si256(q, m4), h0);
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), h1);
            let (acc0, acc1) = acc.split_at_mut(1);
            let (off0, off1) = off.split_at_mut(1);
            acc_unsigned(lo, a, s0, sc[2 * j], &mut acc0[0]);
            acc_unsigned(hi, a, s1, sc[2 * j + 1], &mut acc1[0]);
            acc_offset(a, s0, mn[2 * j], &mut off0[0]);
            acc_offset(a, s1, mn[2 * j + 1], &mut off1[0]);
        }
    }
    finish(acc, off)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    // Two chains: even quarters into set 0, odd ones into set 1.
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    let (m4, m3, m32) = (
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi8(3),
        _mm256_set1_epi8(32),
    );
    for b in 0..nb {
        let p = w.add(b * 210);
        let d = half(p.add(208));
        for h in 0..2 {
            let ql0 = _mm256_loadu_si256(p.add(64 * h).cast());
            let ql1 = _mm256_loadu_si256(p.add(64 * h + 32).cast());
            let qh = _mm256_loadu_si256(p.add(128 + 32 * h).cast());
            let sc = p.add(192 + 8 * h).cast::<i8>();
            let quarters = [
                (_mm256_and_si256(ql0, m4), qh),
                (_mm256_and_si256(ql1, m4), _mm256_srli_epi16(qh, 2)),
                (
                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                    _mm256_srli_epi16(qh, 4),
                ),
                (
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                    _mm256_srli_epi16(qh, 6),
                ),
            ];
            for (t, (lo, hi)) in quarters.into_iter().enumerate() {
                let q = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hi, m3), 4));
                let scales = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(*sc.add(2 * t + 1))),
                    _mm_set1_epi16(i16::from(*sc.add(2 * t))),
                );
                let sub = 8 * b + 4 * h + t;
                for r in 0..R {
                    let x = load_x(&a[r], sub);
                    // (q - 32) . x per 16 weights, times that half's scale.
                    let pq = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), scales);
                    let p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(m32, x), scales);
                    let s = _mm256_cvtepi32_ps(_mm256_sub_epi32(pq, p32));
                    let scale = _mm256_set1_ps(d * *a[r].d.get_unchecked(sub));
                    acc[t & 1][r] = _mm256_fmadd_ps(s, scale, acc[t & 1][r]);
                }
            }
        }
    }
    finish(acc, [[0.0; R]; 2])
}

// ---- Block-group kernels for Q4_0, Q4_1, Q8_0 and MXFP4 --------------------------------------------------
//
// One "unit" is (weight block, activation row): the integer dot of 32 weights with 32 activations, times
// the two block scales. Instead of reducing each unit's `maddubs` products on its own (a `madd`, a
// convert and an FMA per unit, with a broadcast scale), 8 units at a time -- 8 / R consecutive blocks of
// the weight row times the group's R activation rows -- are summed into the 8 lanes of one vector by an
// add / unpack tree, and then converted and scaled by one FMA with 8 different scales. Lane u holds
// block b + u / R and activation row u % R, matching the interleaved scales of `RowGroup`. Each row's
// output is the sum of its lanes once at the end (no per-block horizontal sum). The 4-bit types sum in
// 16 bits until the last step: a `maddubs` lane is at most 2 * 15 * 127 = 3810, so 8 of them fit. Q8_0's
// lanes (up to 2 * 128 * 127) go to 32 bits by `madd` first; MXFP4's signed weights (|w| <= 12, the sign
// moved onto x) make lanes of at most 2 * 12 * 127 = 3048, summed in 16 bits as the 4-bit types. (Q5_0 /
// Q5_1 stay on the per-block kernels: their fifth bits and signs made the one-row case slower here than
// there, measured, and a row's arithmetic must not change with the batch, so one kernel serves every row
// count.)

const T_Q4_0: u8 = 0;
const T_Q4_1: u8 = 1;
const T_Q8_0: u8 = 2;
const T_MXFP4: u8 = 3;

const fn tree_block_bytes(t: u8) -> usize {
    match t {
        T_Q4_0 => 18,
        T_Q4_1 => 20,
        T_MXFP4 => 17,
        _ => 34,
    }
}

/// Sums of each of 8 vectors of 16 i16 lanes: lane u of the result (i32) is the sum of `p[u]`. Exact
/// when any 8 lanes of one vector sum within i16 (true for |lane| <= 4095).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sum8_i16(p: &[__m256i; 8]) -> __m256i {
    // Per 128-bit half: [u0 u1 u0 u1 ...], then [u0 u1 u2 u3 u0 u1 u2 u3], then [u0 .. u7].
    let l1 = |a: __m256i, b: __m256i| {
        _mm256_add_epi16(_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b))
    };
    let (a01, a23, a45, a67) = (
        l1(p[0], p[1]),
        l1(p[2], p[3]),
        l1(p[4], p[5]),
        l1(p[6], p[7]),
    );
    let l2 = |a: __m256i, b: __m256i| {
        _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
    };
    let (a03, a47) = (l2(a01, a23), l2(a45, a67));
    let a07 = _mm256_add_epi16(
        _mm256_unpacklo_epi64(a03, a47),
        _mm256_unpackhi_epi64(a03, a47),
    );
    // The two halves, widened to i32 before their sum (which may exceed i16).
    _mm256_add_epi32(
        _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a07)),
        _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a07, 1)),
    )
}

/// Sums of each of 8 vectors of 8 i32 lanes: lane u of the result is the sum of `p[u]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sum8_i32(p: &[__m256i; 8]) -> __m256i {
    // Per 128-bit half: [u0 u1 u0 u1], then [u0 u1 u2 u3]; then the halves of the two sets combined.
    let l1 = |a: __m256i, b: __m256i| {
        _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
    };
    let (a01, a23, a45, a67) = (
        l1(p[0], p[1]),
        l1(p[2], p[3]),
        l1(p[4], p[5]),
        l1(p[6], p[7]),
    );
    let l2 = |a: __m256i, b: __m256i| {
        _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b))
    };
    let (a03, a47) = (l2(a01, a23), l2(a45, a67));
    // [a03.lo | a47.lo] + [a03.hi | a47.hi] (inserts and an extract: cheap on every AVX2 CPU).
    let lo = _mm256_inserti128_si256(a03, _mm256_castsi256_si128(a47), 1);
    let hi = _mm256_inserti128_si256(a47, _mm256_extracti128_si256(a03, 1), 0);
    _mm256_add_epi32(lo, hi)
}

/// The f16 bits at `p` (inside a block).
#[inline(always)]
unsafe fn half_bits(p: *const u8) -> u64 {
    u64::from(p.cast::<u16>().read_unaligned())
}

/// The f16 field at byte `at` of blocks `b..b + nblk` of the row, one per lane (lane u: block b + u / R),
/// as f32; lanes of blocks past `nblk` are 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_halves<const R: usize>(
    w: *const u8,
    bb: usize,
    b: usize,
    nblk: usize,
    at: usize,
) -> __m256 {
    let mut v = [0u64; 8];
    for (j, v) in v.iter_mut().enumerate().take(8 / R) {
        if j < nblk {
            *v = half_bits(w.add((b + j) * bb + at));
        }
    }
    let mut q = [0u64; 2];
    for u in 0..8 {
        q[u / 4] |= v[u / R] << (16 * (u % 4));
    }
    _mm256_cvtph_ps(_mm_set_epi64x(q[1] as i64, q[0] as i64))
}

/// The f16 fields at bytes 0 and 2 of blocks `b..b + 8` (the scale, and the min where the type has one),
/// as 8 f32 each: one 4-byte load per block instead of two 2-byte ones and the packing of each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn eight_block_halves(w: *const u8, bb: usize, b: usize) -> (__m256, __m256) {
    let ld = |j: usize| w.add((b + j) * bb).cast::<i32>().read_unaligned();
    let v = _mm256_setr_epi32(ld(0), ld(1), ld(2), ld(3), ld(4), ld(5), ld(6), ld(7));
    // [d0 m0 d1 m1 d2 m2 d3 m3] and [d4 m4 .. d7 m7]; the shuffles leave blocks in order 0 1 4 5 2 3 6 7.
    let lo = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
    let hi = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
    let order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    (
        _mm256_permutevar8x32_ps(_mm256_shuffle_ps(lo, hi, 0x88), order),
        _mm256_permutevar8x32_ps(_mm256_shuffle_ps(lo, hi, 0xdd), order),
    )
}

/// The 32 weights of the block at `p`: unsigned (0..15) for Q4_0 / Q4_1, signed bytes for Q8_0 and for
/// MXFP4 (its codes looked up in the doubled e2m1 table, |w| <= 12).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tree_weights<const T: u8>(p: *const u8) -> __m256i {
    match T {
        T_Q4_0 => nibbles16(p.add(2)),
        T_Q4_1 => nibbles16(p.add(4)),
        T_MXFP4 => {
            let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_MXFP4.as_ptr().cast()));
            _mm256_shuffle_epi8(table, nibbles16(p.add(1)))
        }
        _ => _mm256_loadu_si256(p.add(2).cast()),
    }
}

/// The halved e8m0 scales (`e8m0_half`) of blocks `b..b + nblk` of an MXFP4 row, one per lane (lane u:
/// block b + u / R), as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_e8m0<const R: usize>(w: *const u8, b: usize, nblk: usize) -> __m256 {
    let mut e = [0i32; 8];
    for (u, e) in e.iter_mut().enumerate() {
        if u / R < nblk {
            *e = i32::from(*w.add((b + u / R) * 17));
        }
    }
    let e = _mm256_loadu_si256(e.as_ptr().cast());
    // 2^(e - 128): exponent field e - 1, or the subnormals 2^-128, 2^-127 (0x200000 << e) for e < 2
    let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
    let subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    // (lanes past nblk hold 2^-128: their integer sums and activation scales are 0)
    _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small))
}

/// Integer products of the 8 units of the blocks `b..b + nblk` (nblk <= 8 / R) into `p` (the units of
/// missing blocks stay 0): i16 pairs for the 4-bit types, i32 quads for Q8_0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tree_products<const R: usize, const T: u8>(
    w: *const u8,
    g: &RowGroup<'_, R>,
    b: usize,
    nblk: usize,
) -> [__m256i; 8] {
    let bb = tree_block_bytes(T);
    let ones = _mm256_set1_epi16(1);
    let mut p = [_mm256_setzero_si256(); 8];
    for j in 0..8 / R {
        if j >= nblk {
            break;
        }
        let q = tree_weights::<T>(w.add((b + j) * bb));
        if T == T_Q4_0 || T == T_Q4_1 {
            for r in 0..R {
                p[j * R + r] = _mm256_maddubs_epi16(q, load_x(&g.rows[r], b + j));
            }
        } else if T == T_MXFP4 {
            // |w| times x with w's sign moved onto x: pairs up to 2 * 12 * 127, 8 of them fit i16
            let aq = _mm256_sign_epi8(q, q);
            for r in 0..R {
                let x = _mm256_sign_epi8(load_x(&g.rows[r], b + j), q);
                p[j * R + r] = _mm256_maddubs_epi16(aq, x);
            }
        } else {
            // Signed x signed through maddubs: |w| times x with w's sign moved onto x.
            let aq = _mm256_sign_epi8(q, q);
            for r in 0..R {
                let x = _mm256_sign_epi8(load_x(&g.rows[r], b + j), q);
                p[j * R + r] = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, x), ones);
            }
        }
    }
    p
}

/// Blocks `b..b + nblk` (nblk <= 8 / R) of the row against the group: `acc += sums * dw * dx`, then
/// `acc += offset_w * sx`, per lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tree_step<const R: usize, const T: u8, const FULL: bool, const SITE: u8>(
    w: *const u8,
    g: &RowGroup<'_, R>,
    b: usize,
    nblk: usize,
    acc: &mut __m256,
) {
    let nblk = if FULL { 8 / R } else { nblk };
    let bb = tree_block_bytes(T);
    let p = tree_products::<R, T>(w, g, b, nblk);
    let sums = if T == T_Q8_0 {
        sum8_i32(&p)
    } else {
        sum8_i16(&p)
    };
    let with_min = T == T_Q4_1;
    let (dw, min) = if T == T_MXFP4 {
        (lane_e8m0::<R>(w, b, nblk), _mm256_setzero_ps())
    } else if R == 1 && FULL {
        eight_block_halves(w, bb, b)
    } else {
        let min = if with_min {
            lane_halves::<R>(w, bb, b, nblk, 2)
        } else {
            _mm256_setzero_ps()
        };
        (lane_halves::<R>(w, bb, b, nblk, 0), min)
    };
    let dx = _mm256_loadu_ps(g.d.as_ptr().add(b * R));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, dx), *acc);
    // The weight offset per lane, times the activation block's d * sum(q).
    let mw = match T {
        T_Q4_0 => _mm256_mul_ps(dw, _mm256_set1_ps(-8.0)),
        T_Q4_1 => min,
        _ => return,
    };
    *acc = _mm256_fmadd_ps(mw, _mm256_loadu_ps(g.s.as_ptr().add(b * R)), *acc);
}

/// Dot products of one weight row (`nb` blocks of a 32-weight type `T`) with the R rows of `g`.
///
/// Every row gets the same bits whatever R (and so whatever the batch around it: a sequence decoded
/// alone, verified with draft tokens, or batched): its blocks are accumulated in 8 classes (block index
/// mod 8), each a chain of FMAs in block order, and the 8 classes summed in a fixed order at the end.
/// With R rows a vector holds 8 / R classes of R rows, so R accumulators hold all 8 classes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tree_rows<const R: usize, const T: u8>(
    w: *const u8,
    nb: usize,
    g: &RowGroup<'_, R>,
) -> [f32; R] {
    let per = 8 / R;
    let mut acc = [_mm256_setzero_ps(); R];
    if R <= 2 {
        // Few rows: little work per byte of weights, so ask for the row 4 ahead (the next rows of this
        // task are contiguous; a prefetch past the end of the weights is harmless).
        let row = nb * tree_block_bytes(T);
        let ahead = w.wrapping_add(4 * row);
        let mut at = 0;
        while at < row {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(at).cast());
            at += 64;
        }
    }
    // Each instantiation of the step has one call site, so all are inlined (two sites of one would
    // leave the larger steps out of line), and whole steps have a constant block count. Step s (blocks s * per ..) holds classes
    // (s % R) * per ..; lane u of accumulator k: class k * per + u / R of row u % R.
    // Rounds of R steps (8 blocks) first, with a constant accumulator per step (kept in registers).
    let mut b = 0;
    while b + 8 <= nb {
        for (k, acc) in acc.iter_mut().enumerate() {
            tree_step::<R, T, true, 0>(w, g, b + k * per, per, acc);
        }
        b += 8;
    }
    while b + per <= nb {
        tree_step::<R, T, true, 1>(w, g, b, per, &mut acc[(b / per) % R]);
        b += per;
    }
    if b < nb {
        tree_step::<R, T, false, 0>(w, g, b, nb - b, &mut acc[(b / per) % R]);
    }
    let mut lanes = [[0.0f32; 8]; R];
    for (l, a) in lanes.iter_mut().zip(acc) {
        _mm256_storeu_ps(l.as_mut_ptr(), a);
    }
    std::array::from_fn(|r| {
        let c = |c: usize| lanes[c / per][(c % per) * R + r];
        ((c(0) + c(1)) + (c(2) + c(3))) + ((c(4) + c(5)) + (c(6) + c(7)))
    })
}

/// Dot products of one weight row (`nb` blocks of `qt`) with the rows of `g`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group_rows<const R: usize>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    g: &RowGroup<'_, R>,
) -> [f32; R] {
    match qt {
        QuantType::Q4_0 => tree_rows::<R, T_Q4_0>(w, nb, g),
        QuantType::Q4_1 => tree_rows::<R, T_Q4_1>(w, nb, g),
        QuantType::Q8_0 => tree_rows::<R, T_Q8_0>(w, nb, g),
        QuantType::MXFP4 => tree_rows::<R, T_MXFP4>(w, nb, g),
        _ => dot_rows(qt, w, nb, &g.rows),
    }
}

// ---- The x8 kernels (Q4_0 / Q4_1 / Q8_0 repacked 8 rows at a time; see `x8`) -----------------------------
//
// Per block, the weights of the 8 rows are loaded 32 bytes at a time and each of the `R` activation rows'
// integer sums kept in its own register (t outer, rows inner: R sums, R accumulators and the one weight
// vector in flight fit the 16 registers at R <= 4). Integer sums are exact in any order, so a row gets the
// same bits for any R (and from `x8::group_portable`).

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
unsafe fn dpbusd_bcast(acc: __m256i, a: __m256i, x: *const i32) -> __m256i {
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
pub(super) unsafe fn x8_group<const R: usize, const Q41: bool, const VNNI: bool>(
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
pub(super) unsafe fn x8_group_q8<const R: usize, const VNNI: bool>(
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
