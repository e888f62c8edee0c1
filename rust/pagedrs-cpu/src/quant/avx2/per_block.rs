//! The per-block kernels: one weight row against R activation rows, every type (a block at a time).

use super::*;

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
        QuantType::Q2_K => q2_k(w, nb, a),
        QuantType::Q3_K => q3_k(w, nb, a),
        QuantType::IQ4_NL => iq4_nl(w, nb, a),
        QuantType::IQ4_XS => iq4_xs(w, nb, a),
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

/// `acc[r] += (v . x_r of sub-block sub) * dw * d_r[sub]` for signed weights `v` (|v| <= 127): `maddubs`
/// of |v| by the activations with v's sign moved onto them (the sign trick, as Q8_0).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn acc_signed<const R: usize>(
    v: __m256i,
    a: &[ActRow<'_>; R],
    sub: usize,
    dw: f32,
    acc: &mut [__m256; R],
) {
    let ones = _mm256_set1_epi16(1);
    let av = _mm256_sign_epi8(v, v);
    for r in 0..R {
        let x = _mm256_sign_epi8(load_x(&a[r], sub), v);
        let s = _mm256_madd_epi16(_mm256_maddubs_epi16(av, x), ones);
        let scale = _mm256_set1_ps(dw * *a[r].d.get_unchecked(sub));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
    }
}

/// 16 bytes of 4-bit codes at `p` looked up in the 16-entry `table` (`pshufb`): weights 0..16 from the
/// low nibbles, 16..32 from the high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lookup16(table: __m128i, p: *const u8) -> __m256i {
    let m4 = _mm_set1_epi8(0x0f);
    let q = _mm_loadu_si128(p.cast());
    let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, m4));
    let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
    _mm256_set_m128i(hi, lo)
}

/// MXFP4 as llama.cpp's `ggml_vec_dot_mxfp4_q8_0`: the nibbles looked up in the doubled e2m1 table
/// to signed bytes (|w| <= 12), times the halved e8m0 scale and the activation block's scale.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mxfp4<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    let table = _mm_loadu_si128(KVALUES_MXFP4.as_ptr().cast());
    two_chains!(nb, R, |b, acc, _off| {
        let p = w.add(b * 17);
        acc_signed(lookup16(table, p.add(1)), a, b, e8m0_half(*p), acc);
    })
}

/// IQ4_NL as llama.cpp's `ggml_vec_dot_iq4_nl_q8_0`: the codes looked up in `KVALUES_IQ4NL`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_nl<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    let table = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast());
    two_chains!(nb, R, |b, acc, _off| {
        let p = w.add(b * 18);
        acc_signed(lookup16(table, p.add(2)), a, b, half(p), acc);
    })
}

/// IQ4_XS: IQ4_NL's codes, 8 sub-blocks of 32 per block with their 6-bit scales (sub-blocks alternate
/// between the two chains).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_xs<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    let table = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast());
    two_chains!(8 * nb, R, |s, acc, _off| {
        let p = w.add(s / 8 * 136);
        let ls = scale_iq4_xs(s % 8, std::slice::from_raw_parts(p, 8));
        let q = lookup16(table, p.add(8 + 16 * (s % 8)));
        acc_signed(q, a, s, half(p) * f32::from(ls), acc);
    })
}

/// Two 16-bit scales, one per 16 weights of a sub-block (the `madd` factors of its two halves).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_pair(s0: i16, s1: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0))
}

/// Q2_K as llama.cpp's `ggml_vec_dot_q2_K_q8_K`, 32 weights at a time: the 2-bit weights (0..3) by the
/// activations through `maddubs`, `madd` by the 4-bit scales of the two halves; the 4-bit mins by the
/// activation sums of each half the same way; the two times d and dmin (sub-blocks alternate between the
/// two chains).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q2_k<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    let (ones, m3) = (_mm256_set1_epi8(1), _mm256_set1_epi8(3));
    for b in 0..nb {
        let p = w.add(b * 84);
        let (d, dmin) = (half(p.add(80)), half(p.add(82)));
        for n in 0..2 {
            let mut qs = _mm256_loadu_si256(p.add(16 + 32 * n).cast());
            for j in 0..4 {
                let q = _mm256_and_si256(qs, m3);
                qs = _mm256_srli_epi16(qs, 2);
                let (s0, s1) = (*p.add(8 * n + 2 * j), *p.add(8 * n + 2 * j + 1));
                let scales = scale_pair(i16::from(s0 & 0x0f), i16::from(s1 & 0x0f));
                let mins = scale_pair(i16::from(s0 >> 4), i16::from(s1 >> 4));
                let s = 8 * b + 4 * n + j;
                let acc = &mut acc[j & 1];
                for r in 0..R {
                    let x = load_x(&a[r], s);
                    let iq = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), scales);
                    let im = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, x), mins);
                    let ad = *a[r].d.get_unchecked(s);
                    let (mf, df) = (_mm256_set1_ps(-(dmin * ad)), _mm256_set1_ps(d * ad));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), mf, acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iq), df, acc[r]);
                }
            }
        }
    }
    finish(acc, [[0.0; R]; 2])
}

/// Q3_K as llama.cpp's `ggml_vec_dot_q3_K_q8_K`, 32 weights at a time: the 2 low bits and the `hmask`
/// bit as 0..7 (the weight plus 4) by the activations through `maddubs`, minus 4 times the activations,
/// each `madd` by the signed 6-bit scales of the two halves (sub-blocks alternate between the chains).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q3_k<const R: usize>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    let (one, four, m3) = (
        _mm256_set1_epi8(1),
        _mm256_set1_epi8(4),
        _mm256_set1_epi8(3),
    );
    for b in 0..nb {
        let p = w.add(b * 110);
        let d = half(p.add(108));
        let sc = scales_q3_k(std::slice::from_raw_parts(p.add(96), 12));
        let mut hm = _mm256_loadu_si256(p.cast());
        for n in 0..2 {
            let mut qs = _mm256_loadu_si256(p.add(32 + 32 * n).cast());
            for j in 0..4 {
                let hbit = _mm256_slli_epi16(_mm256_and_si256(hm, one), 2);
                hm = _mm256_srli_epi16(hm, 1);
                let q = _mm256_or_si256(_mm256_and_si256(qs, m3), hbit);
                qs = _mm256_srli_epi16(qs, 2);
                let g = 8 * n + 2 * j;
                let scales = scale_pair(i16::from(sc[g]), i16::from(sc[g + 1]));
                let s = 8 * b + 4 * n + j;
                let acc = &mut acc[j & 1];
                for r in 0..R {
                    let x = load_x(&a[r], s);
                    let pq = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), scales);
                    let p4 = _mm256_madd_epi16(_mm256_maddubs_epi16(four, x), scales);
                    let i = _mm256_cvtepi32_ps(_mm256_sub_epi32(pq, p4));
                    let scale = _mm256_set1_ps(d * *a[r].d.get_unchecked(s));
                    acc[r] = _mm256_fmadd_ps(i, scale, acc[r]);
                }
            }
        }
    }
    finish(acc, [[0.0; R]; 2])
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
