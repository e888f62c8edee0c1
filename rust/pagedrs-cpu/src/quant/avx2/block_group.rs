//! Block-group kernels for Q4_0, Q4_1, Q8_0 and MXFP4.
//!
//! One "unit" is (weight block, activation row): the integer dot of 32 weights with 32 activations, times
//! the two block scales. Instead of reducing each unit's `maddubs` products on its own (a `madd`, a
//! convert and an FMA per unit, with a broadcast scale), 8 units at a time -- 8 / R consecutive blocks of
//! the weight row times the group's R activation rows -- are summed into the 8 lanes of one vector by an
//! add / unpack tree, and then converted and scaled by one FMA with 8 different scales. Lane u holds
//! block b + u / R and activation row u % R, matching the interleaved scales of `RowGroup`. Each row's
//! output is the sum of its lanes once at the end (no per-block horizontal sum). The 4-bit types sum in
//! 16 bits until the last step: a `maddubs` lane is at most 2 * 15 * 127 = 3810, so 8 of them fit. Q8_0's
//! lanes (up to 2 * 128 * 127) go to 32 bits by `madd` first; MXFP4's signed weights (|w| <= 12, the sign
//! moved onto x) make lanes of at most 2 * 12 * 127 = 3048, summed in 16 bits as the 4-bit types. (Q5_0 /
//! Q5_1 stay on the per-block kernels: their fifth bits and signs made the one-row case slower here than
//! there, measured, and a row's arithmetic must not change with the batch, so one kernel serves every row
//! count.)

use super::per_block::dot_rows;
use super::*;

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
pub(in crate::quant) unsafe fn group_rows<const R: usize>(
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
