//! aarch64 Advanced SIMD dot products of one weight row with `R` quantized activation rows (the weight
//! block is unpacked once for all `R`), as llama.cpp's `ggml_vec_dot_*_q8_*` do on NEON: the weights
//! unpacked to signed bytes (Q4_0 and Q5_0 with their bias subtracted, Q8_0 as stored; Q4_1, Q5_1 and the
//! K-quants unsigned, their min times the activation block's sum added apart), the integer dot of 16 bytes
//! at a time into 4 i32 lanes, then one float FMA per 32 weights with the product of the two block scales,
//! and a horizontal sum per row at the end.
//!
//! Two ways to form the integer dot, chosen at run time (`Isa::Neon`, `Isa::NeonDot`):
//! - `Mull`: baseline Armv8 (`smull` to 16-bit products, `sadalp` pairwise into 32 bits);
//! - `Sdot`: the Armv8.2 `dotprod` extension's `sdot` (4 products summed into each 32-bit lane), as
//!   inline assembly: its intrinsics (`vdotq_s32`) are unstable in Rust 1.95.
//!
//! The two put different products in each lane, so their float sums may differ in the last bits; each
//! gives a row the same bits whatever the row group (every row's arithmetic is its own, in block order).
//! The x8 kernels (see `x8`) give `x8::group_portable`'s bits with either.
//!
//! The kernels are `#[inline(always)]` generics over `Dot`, inlined into one entry point per (kernel, R,
//! Dot): the `Sdot` ones carry `#[target_feature(enable = "dotprod")]`.
//!
//! Every function here is `unsafe`: callers must have checked that the CPU has the `dotprod` extension
//! before an `*_sdot` entry point, and that `w` points at `nb` whole blocks of the type and every `ActRow`
//! holds the matching sub-blocks (and a `RowGroup`'s interleaved sums 4 floats past any block's).

use std::arch::aarch64::*;
use std::arch::asm;

use super::act::{ActRow, RowGroup};
use super::formats::{e8m0_half, scale_min_k4, KVALUES_MXFP4, SUB};
use super::QuantType;

/// The integer dot of signed bytes, in 4 i32 lanes.
trait Dot {
    /// The accumulator of `quad_dot`: the 4 lanes' sums, in some split.
    type Quad: Copy;
    /// `acc` plus the 16 products `w[i] * x[i]`, spread over the 4 lanes (which product goes to which lane
    /// is the implementation's own: only the sum of the lanes is defined).
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t;
    unsafe fn quad_zero() -> Self::Quad;
    /// Lane j of `acc` plus `sum_i w[4j + i] * x[4L + i]` (i in 0..4): 4 weight rows' dots with the same
    /// 4 activations.
    unsafe fn quad_dot<const L: i32>(acc: Self::Quad, w: int8x16_t, x: int8x16_t) -> Self::Quad;
    /// The 4 lanes' sums.
    unsafe fn quad_sum(acc: Self::Quad) -> int32x4_t;
}

/// Baseline Armv8: 16-bit products (at most 128 * 127 in magnitude, exact), summed in pairs into 32 bits.
struct Mull;

impl Dot for Mull {
    /// Two i32 vectors: lanes 0..4 of the first hold rows 0 and 1 (two pairs each), of the second rows
    /// 2 and 3.
    type Quad = (int32x4_t, int32x4_t);

    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        let lo = vmull_s8(vget_low_s8(w), vget_low_s8(x));
        vpadalq_s16(vpadalq_s16(acc, lo), vmull_high_s8(w, x))
    }

    #[inline(always)]
    unsafe fn quad_zero() -> Self::Quad {
        (vdupq_n_s32(0), vdupq_n_s32(0))
    }

    #[inline(always)]
    unsafe fn quad_dot<const L: i32>(acc: Self::Quad, w: int8x16_t, x: int8x16_t) -> Self::Quad {
        let xb = vreinterpretq_s8_s32(vdupq_laneq_s32::<L>(vreinterpretq_s32_s8(x)));
        (
            vpadalq_s16(acc.0, vmull_s8(vget_low_s8(w), vget_low_s8(xb))),
            vpadalq_s16(acc.1, vmull_high_s8(w, xb)),
        )
    }

    #[inline(always)]
    unsafe fn quad_sum(acc: Self::Quad) -> int32x4_t {
        vpaddq_s32(acc.0, acc.1)
    }
}

/// Armv8.2 `dotprod`: `sdot` sums 4 products into each 32-bit lane. Only inside `dotprod` functions.
struct Sdot;

impl Dot for Sdot {
    type Quad = int32x4_t;

    #[inline(always)]
    unsafe fn dot(mut acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        asm!(
            "sdot {acc:v}.4s, {w:v}.16b, {x:v}.16b",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            x = in(vreg) x,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }

    #[inline(always)]
    unsafe fn quad_zero() -> Self::Quad {
        vdupq_n_s32(0)
    }

    #[inline(always)]
    unsafe fn quad_dot<const L: i32>(
        mut acc: Self::Quad,
        w: int8x16_t,
        x: int8x16_t,
    ) -> Self::Quad {
        asm!(
            "sdot {acc:v}.4s, {w:v}.16b, {x:v}.4b[{l}]",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            x = in(vreg) x,
            l = const L,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }

    #[inline(always)]
    unsafe fn quad_sum(acc: Self::Quad) -> int32x4_t {
        acc
    }
}

/// `quad_dot` with the activation lane `t % 4` chosen at run time (a constant once unrolled).
#[inline(always)]
unsafe fn quad_dot_at<D: Dot>(acc: D::Quad, w: int8x16_t, x: int8x16_t, t: usize) -> D::Quad {
    match t % 4 {
        0 => D::quad_dot::<0>(acc, w, x),
        1 => D::quad_dot::<1>(acc, w, x),
        2 => D::quad_dot::<2>(acc, w, x),
        _ => D::quad_dot::<3>(acc, w, x),
    }
}

/// The f16 at `p`, as f32 (exact): `fcvt`, baseline Armv8 (its intrinsic is newer than the MSRV).
#[inline(always)]
unsafe fn half(p: *const u8) -> f32 {
    let bits = p.cast::<u16>().read_unaligned();
    let out: f32;
    asm!(
        "fcvt {out:s}, {h:h}",
        out = lateout(vreg) out,
        h = in(vreg) bits,
        options(pure, nomem, nostack)
    );
    out
}

/// 4 f16 as f32 (exact): `fcvtl`.
#[inline(always)]
unsafe fn halves4(bits: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    asm!(
        "fcvtl {out:v}.4s, {h:v}.4h",
        out = lateout(vreg) out,
        h = in(vreg) bits,
        options(pure, nomem, nostack)
    );
    out
}

/// The 8 f16 at `p`, as two vectors of 4 f32.
#[inline(always)]
unsafe fn halves8(p: *const u8) -> [float32x4_t; 2] {
    let h = vld1q_u16(p.cast());
    [halves4(vget_low_u16(h)), halves4(vget_high_u16(h))]
}

/// The 32 activations of sub-block `sub` of `a`.
#[inline(always)]
unsafe fn load_x(a: &ActRow<'_>, sub: usize) -> [int8x16_t; 2] {
    let p = a.qs.as_ptr().add(sub * SUB);
    [vld1q_s8(p), vld1q_s8(p.add(16))]
}

/// 16 bytes of nibble pairs -> the low nibbles (weights 0..16) and the high ones (16..32).
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> [uint8x16_t; 2] {
    let q = vld1q_u8(p);
    [vandq_u8(q, vdupq_n_u8(0x0f)), vshrq_n_u8::<4>(q)]
}

/// Bit `i` of `qh` -> 0x10 in byte `i` of the 32 (the fifth bit of the Q5_0 / Q5_1 weights).
#[inline(always)]
unsafe fn high_bits(qh: u32) -> [uint8x16_t; 2] {
    const INDEX: [u8; 32] = [
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    ];
    const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let bytes = vreinterpretq_u8_u32(vdupq_n_u32(qh));
    let bit = vld1q_u8(BIT.as_ptr());
    let at = |i: usize| {
        let spread = vqtbl1q_u8(bytes, vld1q_u8(INDEX.as_ptr().add(16 * i)));
        vandq_u8(vtstq_u8(spread, bit), vdupq_n_u8(0x10))
    };
    [at(0), at(1)]
}

#[inline(always)]
unsafe fn signed(v: [uint8x16_t; 2]) -> [int8x16_t; 2] {
    v.map(|v| vreinterpretq_s8_u8(v))
}

/// `v - bias` as signed bytes.
#[inline(always)]
unsafe fn minus(v: [uint8x16_t; 2], bias: i8) -> [int8x16_t; 2] {
    v.map(|v| vsubq_s8(vreinterpretq_s8_u8(v), vdupq_n_s8(bias)))
}

/// `acc[r] += (w . x_r of sub-block sub) * dw * d_r[sub]`, in 4 lanes.
#[inline(always)]
unsafe fn acc_sub<const R: usize, D: Dot>(
    w: [int8x16_t; 2],
    a: &[ActRow<'_>; R],
    sub: usize,
    dw: f32,
    acc: &mut [float32x4_t; R],
) {
    for r in 0..R {
        let x = load_x(&a[r], sub);
        let i = D::dot(D::dot(vdupq_n_s32(0), w[0], x[0]), w[1], x[1]);
        let scale = dw * *a[r].d.get_unchecked(sub);
        acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(i), scale);
    }
}

/// Per row, the sum over blocks of the weight offset times the activation block's `d * sum(q)`, one
/// fused multiply-add per block in block order: 4 rows per vector from the group's interleaved sums when
/// R is a multiple of 4 (one load and one FMA for 4 rows), one by one otherwise; the same bits for a row
/// either way.
struct Offsets<const R: usize> {
    quads: [float32x4_t; 2],
    rows: [f32; R],
}

impl<const R: usize> Offsets<R> {
    #[inline(always)]
    unsafe fn new() -> Self {
        debug_assert!(R <= 8);
        Offsets {
            quads: [vdupq_n_f32(0.0); 2],
            rows: [0.0; R],
        }
    }

    /// Adds `c * s_r[sub]` to row r's sum.
    #[inline(always)]
    unsafe fn add(&mut self, g: &RowGroup<'_, R>, sub: usize, c: f32) {
        if R % 4 == 0 {
            for (q, acc) in self.quads.iter_mut().enumerate().take(R / 4) {
                let s = vld1q_f32(g.s.as_ptr().add(sub * R + 4 * q));
                *acc = vfmaq_n_f32(*acc, s, c);
            }
        } else {
            for (r, acc) in self.rows.iter_mut().enumerate() {
                *acc = c.mul_add(*g.rows[r].s.get_unchecked(sub), *acc);
            }
        }
    }

    #[inline(always)]
    unsafe fn sums(&self) -> [f32; R] {
        if R % 4 != 0 {
            return self.rows;
        }
        let mut lanes = [0.0f32; 8];
        vst1q_f32(lanes.as_mut_ptr(), self.quads[0]);
        vst1q_f32(lanes.as_mut_ptr().add(4), self.quads[1]);
        std::array::from_fn(|r| lanes[r])
    }
}

/// The two chains' accumulators summed and reduced, plus the offsets: `hsum(acc0 + acc1) + off` per row.
#[inline(always)]
unsafe fn finish<const R: usize>(acc: [[float32x4_t; R]; 2], off: &Offsets<R>) -> [f32; R] {
    let off = off.sums();
    std::array::from_fn(|r| vaddvq_f32(vaddq_f32(acc[0][r], acc[1][r])) + off[r])
}

/// Runs `$body` for blocks `0..$nb` with `$acc` alternating between two sets of accumulators (two
/// independent FMA chains: one would leave the loop bound by the FMA latency), `$off` the offsets; then
/// reduces them.
macro_rules! two_chains {
    ($nb:expr, $r:ident, |$b:ident, $acc:ident, $off:ident| $body:block) => {{
        let (mut acc0, mut acc1) = ([vdupq_n_f32(0.0); $r], [vdupq_n_f32(0.0); $r]);
        let mut off = Offsets::<$r>::new();
        let nb: usize = $nb;
        let mut next = 0;
        while next + 1 < nb {
            {
                let ($b, $acc, $off) = (next, &mut acc0, &mut off);
                $body
            }
            {
                let ($b, $acc, $off) = (next + 1, &mut acc1, &mut off);
                $body
            }
            next += 2;
        }
        if next < nb {
            let ($b, $acc, $off) = (next, &mut acc0, &mut off);
            $body
        }
        finish([acc0, acc1], &off)
    }};
}

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

/// Dot products of one weight row (`nb` blocks of `qt` at `w`) with each row of `g`, baseline NEON.
pub(super) unsafe fn group_rows<const R: usize>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    g: &RowGroup<'_, R>,
) -> [f32; R] {
    rows::<R, Mull>(qt, w, nb, g)
}

/// `group_rows` with `sdot`: the CPU must have the `dotprod` extension.
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn group_rows_sdot<const R: usize>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    g: &RowGroup<'_, R>,
) -> [f32; R] {
    rows::<R, Sdot>(qt, w, nb, g)
}

// ---- The x8 kernels (Q4_0 / Q4_1 / Q8_0 repacked 8 rows at a time; see `x8`) -----------------------------
//
// A 16-byte load of a packed block holds 4 bytes of each of 4 weight rows; the 4 activations they meet are
// one 32-bit lane of the activation block, so `quad_dot` gives the 4 rows' partial dots side by side (one
// `sdot` by element, or `smull` on the lane broadcast and `sadalp`). Integer sums are exact in any order,
// and the float steps are `x8::group_portable`'s, so a row gets its bits for any R and on either `Dot`.

/// The 8 outputs of one packed group (`nb` blocks of `qt` at `w`) for each of the `R` activation rows.
#[inline(always)]
unsafe fn x8_impl<const R: usize, D: Dot>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; 8]; R] {
    let mut acc = [[vdupq_n_f32(0.0); 2]; R];
    let m4 = vdupq_n_u8(0x0f);
    for b in 0..nb {
        let mut s = [[D::quad_zero(); 2]; R];
        let p = match qt {
            QuantType::Q8_0 => {
                let p = w.add(b * 272);
                for t in 0..8 {
                    let v = [0, 1].map(|h| vld1q_s8(p.add(16 + 32 * t + 16 * h).cast()));
                    for r in 0..R {
                        let x = vld1q_s8(a[r].qs.as_ptr().add(32 * b + 16 * (t / 4)));
                        for h in 0..2 {
                            s[r][h] = quad_dot_at::<D>(s[r][h], v[h], x, t);
                        }
                    }
                }
                p
            }
            _ => {
                let (head, bb) = if qt == QuantType::Q4_1 {
                    (32, 160)
                } else {
                    (16, 144)
                };
                let p = w.add(b * bb);
                for t in 0..4 {
                    let v = [0, 1].map(|h| vld1q_u8(p.add(head + 32 * t + 16 * h)));
                    let lo = v.map(|v| vreinterpretq_s8_u8(vandq_u8(v, m4)));
                    let hi = v.map(|v| vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)));
                    for r in 0..R {
                        // activations 4t..4t+3 (low nibbles) and 16+4t.. (high ones)
                        let x = load_x(&a[r], b);
                        for h in 0..2 {
                            s[r][h] = quad_dot_at::<D>(s[r][h], lo[h], x[0], t);
                            s[r][h] = quad_dot_at::<D>(s[r][h], hi[h], x[1], t);
                        }
                    }
                }
                p
            }
        };
        let dw = halves8(p);
        let mw = match qt {
            QuantType::Q4_1 => Some(halves8(p.add(16))),
            QuantType::Q4_0 => Some(dw.map(|v| vmulq_n_f32(v, -8.0))),
            _ => None,
        };
        for r in 0..R {
            let (dx, sx) = (*a[r].d.get_unchecked(b), *a[r].s.get_unchecked(b));
            for h in 0..2 {
                let isum = vcvtq_f32_s32(D::quad_sum(s[r][h]));
                acc[r][h] = vfmaq_f32(acc[r][h], isum, vmulq_n_f32(dw[h], dx));
                if let Some(mw) = mw {
                    acc[r][h] = vfmaq_n_f32(acc[r][h], mw[h], sx);
                }
            }
        }
    }
    acc.map(|[lo, hi]| {
        let mut v = [0.0f32; 8];
        vst1q_f32(v.as_mut_ptr(), lo);
        vst1q_f32(v.as_mut_ptr().add(4), hi);
        v
    })
}

/// The 8 outputs of one packed group for each of the `R` activation rows, baseline NEON: element `j` of a
/// row's result is weight row `j` of the group.
pub(super) unsafe fn x8_group<const R: usize>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; 8]; R] {
    x8_impl::<R, Mull>(qt, w, nb, a)
}

/// `x8_group` with `sdot`: the CPU must have the `dotprod` extension.
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn x8_group_sdot<const R: usize>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; 8]; R] {
    x8_impl::<R, Sdot>(qt, w, nb, a)
}

/// The portable activation quantizer of one block of 32 (`act::quantize_block`) in NEON, with its bits:
/// the same scalar scale and inverse, the same products, `fcvtns` (round to nearest, ties to even; NaN to
/// 0, as the portable `as i8` does), the same clamp, an exact integer sum. The max ignores NaN as
/// `f32::max` does (`fmaxnm`).
pub(super) unsafe fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32) {
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
