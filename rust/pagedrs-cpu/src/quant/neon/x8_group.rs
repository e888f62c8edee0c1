//! The x8 kernels (Q4_0 / Q4_1 / Q8_0 repacked 8 rows at a time; see `x8`).
//!
//! A 16-byte load of a packed block holds 4 bytes of each of 4 weight rows; the 4 activations they meet are
//! one 32-bit lane of the activation block, so `quad_dot` gives the 4 rows' partial dots side by side (one
//! `sdot` by element, or `smull` on the lane broadcast and `sadalp`). Integer sums are exact in any order,
//! and the float steps are `x8::group_portable`'s, so a row gets its bits for any R and on either `Dot`.

use super::*;

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
pub(in crate::quant) unsafe fn x8_group<const R: usize>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; 8]; R] {
    x8_impl::<R, Mull>(qt, w, nb, a)
}

/// `x8_group` with `sdot`: the CPU must have the `dotprod` extension.
#[target_feature(enable = "dotprod")]
pub(in crate::quant) unsafe fn x8_group_sdot<const R: usize>(
    qt: QuantType,
    w: *const u8,
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; 8]; R] {
    x8_impl::<R, Sdot>(qt, w, nb, a)
}
