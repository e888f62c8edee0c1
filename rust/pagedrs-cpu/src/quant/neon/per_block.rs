//! The per-block kernels: one weight row against R activation rows, every type.

use super::*;

/// Dot products of one weight row (`nb` blocks of `qt` at `w`) with each row of `g`.
#[inline(always)]
unsafe fn rows<const R: usize, D: Dot>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    g: &RowGroup<'_, R>,
) -> [f32; R] {
    let a = &g.rows;
    match qt {
        QuantType::Q4_0 => two_chains!(nb, R, |b, acc, _off| {
            let p = w.add(b * 18);
            acc_sub::<R, D>(minus(nibbles(p.add(2)), 8), a, b, half(p), acc);
        }),
        QuantType::Q4_1 => two_chains!(nb, R, |b, acc, off| {
            let p = w.add(b * 20);
            acc_sub::<R, D>(signed(nibbles(p.add(4))), a, b, half(p), acc);
            off.add(g, b, half(p.add(2)));
        }),
        QuantType::Q5_0 => two_chains!(nb, R, |b, acc, _off| {
            let p = w.add(b * 22);
            let q = five_bits(p.add(6), p.add(2));
            acc_sub::<R, D>(minus(q, 16), a, b, half(p), acc);
        }),
        QuantType::Q5_1 => two_chains!(nb, R, |b, acc, off| {
            let p = w.add(b * 24);
            let q = five_bits(p.add(8), p.add(4));
            acc_sub::<R, D>(signed(q), a, b, half(p), acc);
            off.add(g, b, half(p.add(2)));
        }),
        QuantType::Q8_0 => two_chains!(nb, R, |b, acc, _off| {
            let p = w.add(b * 34).cast::<i8>();
            let q = [vld1q_s8(p.add(2)), vld1q_s8(p.add(18))];
            acc_sub::<R, D>(q, a, b, half(p.cast()), acc);
        }),
        QuantType::Q4_K => q4_k::<R, D>(w, nb, g),
        QuantType::Q5_K => q5_k::<R, D>(w, nb, g),
        QuantType::Q6_K => q6_k::<R, D>(w, nb, &g.rows),
        QuantType::Q2_K => q2_k::<R, D>(w, nb, &g.rows),
        QuantType::Q3_K => q3_k::<R, D>(w, nb, &g.rows),
        // the codes looked up in the IQ4_NL codebook (`tbl`) to signed bytes
        QuantType::IQ4_NL => two_chains!(nb, R, |b, acc, _off| {
            let p = w.add(b * 18);
            let table = vld1q_s8(KVALUES_IQ4NL.as_ptr());
            let q = nibbles(p.add(2)).map(|i| vqtbl1q_s8(table, i));
            acc_sub::<R, D>(q, a, b, half(p), acc);
        }),
        // the same codes, 8 sub-blocks per block with their 6-bit scales (alternating between the chains)
        QuantType::IQ4_XS => two_chains!(8 * nb, R, |s, acc, _off| {
            let p = w.add(s / 8 * 136);
            let table = vld1q_s8(KVALUES_IQ4NL.as_ptr());
            let ls = scale_iq4_xs(s % 8, std::slice::from_raw_parts(p, 8));
            let q = nibbles(p.add(8 + 16 * (s % 8))).map(|i| vqtbl1q_s8(table, i));
            acc_sub::<R, D>(q, a, s, half(p) * f32::from(ls), acc);
        }),
        // the nibbles looked up in the doubled e2m1 table (`tbl`) to signed bytes, times the halved scale
        QuantType::MXFP4 => two_chains!(nb, R, |b, acc, _off| {
            let p = w.add(b * 17);
            let table = vld1q_s8(KVALUES_MXFP4.as_ptr());
            let q = nibbles(p.add(1)).map(|i| vqtbl1q_s8(table, i));
            acc_sub::<R, D>(q, a, b, e8m0_half(*p), acc);
        }),
    }
}

/// The 32 unsigned 5-bit weights of a Q5_0 / Q5_1 block: nibbles at `qs`, fifth bits at `qh`.
#[inline(always)]
unsafe fn five_bits(qs: *const u8, qh: *const u8) -> [uint8x16_t; 2] {
    let [lo, hi] = nibbles(qs);
    let [h0, h1] = high_bits(u32::from_le(qh.cast::<u32>().read_unaligned()));
    [vorrq_u8(lo, h0), vorrq_u8(hi, h1)]
}

/// The 8 (scale, min) pairs of a Q4_K / Q5_K block, as floats times d and dmin.
#[inline(always)]
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

/// Q4_K / Q5_K: the two sub-blocks `2j` (low nibbles, in chain 0) and `2j + 1` (high ones, chain 1) of
/// block `b`, from their 32 quant bytes and fifth bits (zero for Q4_K).
#[inline(always)]
#[allow(clippy::too_many_arguments)] // the kernel's state, passed whole to keep it in registers
unsafe fn k_pair<const R: usize, D: Dot>(
    q: [uint8x16_t; 2],
    h: [[uint8x16_t; 2]; 2],
    g: &RowGroup<'_, R>,
    b: usize,
    j: usize,
    (sc, mn): (&[f32; 8], &[f32; 8]),
    acc: &mut [[float32x4_t; R]; 2],
    off: &mut Offsets<R>,
) {
    let m4 = vdupq_n_u8(0x0f);
    let lo = [0, 1].map(|i| vorrq_u8(vandq_u8(q[i], m4), h[0][i]));
    let hi = [0, 1].map(|i| vorrq_u8(vshrq_n_u8::<4>(q[i]), h[1][i]));
    let (s0, s1) = (8 * b + 2 * j, 8 * b + 2 * j + 1);
    acc_sub::<R, D>(signed(lo), &g.rows, s0, sc[2 * j], &mut acc[0]);
    acc_sub::<R, D>(signed(hi), &g.rows, s1, sc[2 * j + 1], &mut acc[1]);
    off.add(g, s0, mn[2 * j]);
    off.add(g, s1, mn[2 * j + 1]);
}

#[inline(always)]
unsafe fn q4_k<const R: usize, D: Dot>(w: *const u8, nb: usize, g: &RowGroup<'_, R>) -> [f32; R] {
    // Two chains: even sub-blocks into set 0, odd ones into set 1.
    let (mut acc, mut off) = ([[vdupq_n_f32(0.0); R]; 2], Offsets::<R>::new());
    let zero = [[vdupq_n_u8(0); 2]; 2];
    for b in 0..nb {
        let p = w.add(b * 144);
        let (sc, mn) = k_scales(p);
        for j in 0..4 {
            let q = [vld1q_u8(p.add(16 + 32 * j)), vld1q_u8(p.add(32 + 32 * j))];
            k_pair::<R, D>(q, zero, g, b, j, (&sc, &mn), &mut acc, &mut off);
        }
    }
    finish(acc, &off)
}

#[inline(always)]
unsafe fn q5_k<const R: usize, D: Dot>(w: *const u8, nb: usize, g: &RowGroup<'_, R>) -> [f32; R] {
    // Two chains: even sub-blocks into set 0, odd ones into set 1.
    let (mut acc, mut off) = ([[vdupq_n_f32(0.0); R]; 2], Offsets::<R>::new());
    let one = vdupq_n_u8(1);
    for b in 0..nb {
        let p = w.add(b * 176);
        let (sc, mn) = k_scales(p);
        // Bit s of each qh byte is the fifth bit of sub-block s; shifted down one per sub-block.
        let mut qh = [vld1q_u8(p.add(16)), vld1q_u8(p.add(32))];
        for j in 0..4 {
            let q = [vld1q_u8(p.add(48 + 32 * j)), vld1q_u8(p.add(64 + 32 * j))];
            let h0 = qh.map(|v| vshlq_n_u8::<4>(vandq_u8(v, one)));
            let h1 = qh.map(|v| vshlq_n_u8::<3>(vandq_u8(v, vdupq_n_u8(2))));
            qh = qh.map(|v| vshrq_n_u8::<2>(v));
            k_pair::<R, D>(q, [h0, h1], g, b, j, (&sc, &mn), &mut acc, &mut off);
        }
    }
    finish(acc, &off)
}

#[inline(always)]
unsafe fn q6_k<const R: usize, D: Dot>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    // Two chains: even quarters into set 0, odd ones into set 1.
    let mut acc = [[vdupq_n_f32(0.0); R]; 2];
    let (m4, m3) = (vdupq_n_u8(0x0f), vdupq_n_u8(3));
    for b in 0..nb {
        let p = w.add(b * 210);
        let d = half(p.add(208));
        for h in 0..2 {
            let ld = |at: usize| [vld1q_u8(p.add(at)), vld1q_u8(p.add(at + 16))];
            let (ql0, ql1, qh) = (ld(64 * h), ld(64 * h + 32), ld(128 + 32 * h));
            let sc = p.add(192 + 8 * h).cast::<i8>();
            for t in 0..4 {
                // quarter t: low nibbles of ql0 / ql1 (t = 0, 1) or their high ones (2, 3), with bits
                // 2t, 2t + 1 of qh on top; minus 32.
                let q: [int8x16_t; 2] = std::array::from_fn(|i| {
                    let l = if t & 1 == 0 { ql0[i] } else { ql1[i] };
                    let l = if t < 2 {
                        vandq_u8(l, m4)
                    } else {
                        vshrq_n_u8::<4>(l)
                    };
                    let hb = match t {
                        0 => vshlq_n_u8::<4>(vandq_u8(qh[i], m3)),
                        1 => vshlq_n_u8::<2>(vandq_u8(qh[i], vdupq_n_u8(0x0c))),
                        2 => vandq_u8(qh[i], vdupq_n_u8(0x30)),
                        _ => vshrq_n_u8::<2>(vandq_u8(qh[i], vdupq_n_u8(0xc0))),
                    };
                    vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(l, hb)), vdupq_n_s8(32))
                });
                let (s0, s1) = (i32::from(*sc.add(2 * t)), i32::from(*sc.add(2 * t + 1)));
                let sub = 8 * b + 4 * h + t;
                for r in 0..R {
                    let x = load_x(&a[r], sub);
                    // (q - 32) . x per 16 weights, times that half's scale (exact in i32).
                    let i0 = D::dot(vdupq_n_s32(0), q[0], x[0]);
                    let i1 = D::dot(vdupq_n_s32(0), q[1], x[1]);
                    let i = vmlaq_n_s32(vmulq_n_s32(i0, s0), i1, s1);
                    let scale = d * *a[r].d.get_unchecked(sub);
                    acc[t & 1][r] = vfmaq_n_f32(acc[t & 1][r], vcvtq_f32_s32(i), scale);
                }
            }
        }
    }
    finish(acc, &Offsets::new())
}

/// The 2-bit fields at `shift` (0, 2, 4 or 6) of the 32 bytes at `p`.
#[inline(always)]
unsafe fn two_bits(p: *const u8, shift: usize) -> [uint8x16_t; 2] {
    let sh = vdupq_n_s8(-(shift as i8));
    [0, 16].map(|at| vandq_u8(vshlq_u8(vld1q_u8(p.add(at)), sh), vdupq_n_u8(3)))
}

/// `acc[r] += (sc0 * (w . x_r)[0..16] + sc1 * (w . x_r)[16..32]) * dw * d_r[sub]`: a sub-block whose two
/// halves have their own integer scales (exact in i32), plus with `mins` the activation sums of the
/// halves times `(m0, m1)` and `dmin` (Q2_K's offsets).
#[inline(always)]
#[allow(clippy::too_many_arguments)] // the kernel's state, passed whole to keep it in registers
unsafe fn acc_halves<const R: usize, D: Dot>(
    q: [int8x16_t; 2],
    a: &[ActRow<'_>; R],
    sub: usize,
    (sc0, sc1): (i32, i32),
    dw: f32,
    mins: Option<((i32, i32), f32)>,
    acc: &mut [float32x4_t; R],
) {
    let ones = vdupq_n_s8(1);
    for r in 0..R {
        let x = load_x(&a[r], sub);
        let i0 = D::dot(vdupq_n_s32(0), q[0], x[0]);
        let i1 = D::dot(vdupq_n_s32(0), q[1], x[1]);
        let i = vmlaq_n_s32(vmulq_n_s32(i0, sc0), i1, sc1);
        let ad = *a[r].d.get_unchecked(sub);
        acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(i), dw * ad);
        if let Some(((m0, m1), dmin)) = mins {
            let x0 = D::dot(vdupq_n_s32(0), ones, x[0]);
            let x1 = D::dot(vdupq_n_s32(0), ones, x[1]);
            let m = vmlaq_n_s32(vmulq_n_s32(x0, m0), x1, m1);
            acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(m), -(dmin * ad));
        }
    }
}

/// Q2_K: the 2-bit weights (0..3) times the 4-bit scales of each half, minus the 4-bit mins times the
/// activation sums of each half (sub-blocks alternate between the two chains).
#[inline(always)]
unsafe fn q2_k<const R: usize, D: Dot>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    two_chains!(8 * nb, R, |s, acc, _off| {
        let p = w.add(s / 8 * 84);
        let (n, j) = (s % 8 / 4, s % 4);
        let q = signed(two_bits(p.add(16 + 32 * n), 2 * j));
        let (s0, s1) = (*p.add(8 * n + 2 * j), *p.add(8 * n + 2 * j + 1));
        let sc = (i32::from(s0 & 0x0f), i32::from(s1 & 0x0f));
        let mins = ((i32::from(s0 >> 4), i32::from(s1 >> 4)), half(p.add(82)));
        acc_halves::<R, D>(q, a, s, sc, half(p.add(80)), Some(mins), acc);
    })
}

/// Q3_K: the 2 low bits, minus 4 where the `hmask` bit is clear (-4..3), times the signed 6-bit scales
/// of each half (sub-blocks alternate between the two chains).
#[inline(always)]
unsafe fn q3_k<const R: usize, D: Dot>(w: *const u8, nb: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    two_chains!(8 * nb, R, |s, acc, _off| {
        let p = w.add(s / 8 * 110);
        let (n, j) = (s % 8 / 4, s % 4);
        let low = two_bits(p.add(32 + 32 * n), 2 * j);
        let bit = vdupq_n_u8(1 << (4 * n + j));
        let q: [int8x16_t; 2] = std::array::from_fn(|i| {
            // 0xff where the bit is clear: minus 4 there
            let clear = vceqq_u8(vandq_u8(vld1q_u8(p.add(16 * i)), bit), vdupq_n_u8(0));
            let v = vsubq_u8(low[i], vandq_u8(clear, vdupq_n_u8(4)));
            vreinterpretq_s8_u8(v)
        });
        let sc = scales_q3_k(std::slice::from_raw_parts(p.add(96), 12));
        let g = 8 * n + 2 * j;
        let scales = (i32::from(sc[g]), i32::from(sc[g + 1]));
        acc_halves::<R, D>(q, a, s, scales, half(p.add(108)), None, acc);
    })
}

/// Dot products of one weight row (`nb` blocks of `qt` at `w`) with each row of `g`, baseline NEON.
pub(in crate::quant) unsafe fn group_rows<const R: usize>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    g: &RowGroup<'_, R>,
) -> [f32; R] {
    rows::<R, Mull>(qt, w, nb, g)
}

/// `group_rows` with `sdot`: the CPU must have the `dotprod` extension.
#[target_feature(enable = "dotprod")]
pub(in crate::quant) unsafe fn group_rows_sdot<const R: usize>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    g: &RowGroup<'_, R>,
) -> [f32; R] {
    rows::<R, Sdot>(qt, w, nb, g)
}
