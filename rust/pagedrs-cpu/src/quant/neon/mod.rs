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
//!
//! The kernels: `per_block` (every type, one weight row against R activation rows) and `x8_group` (the
//! 8-row interleaved layout).

use std::arch::aarch64::*;
use std::arch::asm;

use super::act::{ActRow, RowGroup};
use super::formats::{
    e8m0_half, scale_iq4_xs, scale_min_k4, scales_q3_k, KVALUES_IQ4NL, KVALUES_MXFP4, SUB,
};
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

mod per_block;
mod x8_group;
pub(super) use per_block::{group_rows, group_rows_sdot};
pub(super) use x8_group::{x8_group, x8_group_sdot};
