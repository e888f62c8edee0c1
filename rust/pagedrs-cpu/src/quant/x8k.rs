//! The x8 layouts of Q5_0 / Q5_1 and the K-quants (Q4_K, Q5_K, Q6_K): 8 rows interleaved as `x8` does
//! for Q4_0 / Q4_1 / Q8_0 (llama.cpp's CPU repacking, ik_llama.cpp's row-interleaved R8 types), each
//! packed block the 8 rows' blocks of that index in the same bytes (`8 * block_bytes`), with the scales
//! and high bits recoded so that one vector operation decodes them for the 8 rows at once. `qs` runs are
//! laid out as `x8`'s: at `q + 32u + 4r`, bytes `4u..4u + 4` of row `r`'s 32-byte chunk, so that one
//! 32-byte load holds 4 weights of each row, met by 4 activations broadcast to every lane.
//!
//! ```text
//! Q5_0 (176 bytes)   d[8] | H[32]                    | qs[4 u][8 r][4]        (Q5_1: d[8] m[8] H qs)
//!   H: bit k of byte 4r + j is the fifth bit of row r's weight 4k + j.
//! Q4_K (1152 bytes)  d[8] | dmin[8] | lo[8 j][8 r] | hi[4 j][8 r] | qs[4 c][8 u][8 r][4]
//! Q5_K (1408 bytes)  the same head (128 bytes) | qh[8 u][8 r][4] | qs[4 c][8 u][8 r][4]
//!   lo: scale & 15 | (min & 15) << 4 of sub-block j; hi: the top 2 bits of scale j, min j, scale
//!   j + 4, min j + 4 (2 bits each, in that order from bit 0).
//! Q6_K (1680 bytes)  d[8] | scales[16 i][8 r] | ql[4 c][8 u][8 r][4] | qh[2 h][8 u][8 r][4]
//! ```
//!
//! Arithmetic of one output, the same in the AVX2 and portable kernels for any number of activation
//! rows, per 32 weights in order (`isum` the exact integer dot of the weights' integers with the
//! activations; `sx` the activation block's `d * sum(q)`):
//! - Q5_0 / Q5_1: `acc = fma(isum, dw * dx, acc)`, `acc = fma(mw, sx, acc)` (`mw = -16 * dw` or the min);
//! - Q4_K / Q5_K: `acc = fma(isum * scale, dw * dx, acc)`, `acc = fma(-(dmin * min), sx, acc)`;
//! - Q6_K: `acc = fma(scale0 * isum0 + scale1 * isum1, dw * dx, acc)` over its two halves of 16
//!   (weights `q - 32`).

use super::act::ActRow;
use super::formats::{f16_to_f32, scale_min_k4, QuantType};

/// Rows per interleaved group, for these layouts and the Q4_0 / Q4_1 / Q8_0 ones (`x8::ROWS`).
pub const ROWS: usize = 8;

/// Whether the type's x8 layout is one of these.
pub(super) fn packs(qt: QuantType) -> bool {
    matches!(
        qt,
        QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K | QuantType::Q6_K
    )
}

/// Where a Q5_0 / Q5_1 packed block's high-bit vector starts (its quants 32 bytes later).
pub(super) fn q5_head(qt: QuantType) -> usize {
    if qt == QuantType::Q5_1 {
        32
    } else {
        16
    }
}

/// Copies `len` bytes of each row's block from offset `from` into `dst` at `to`, 4 bytes of each row
/// at a time (`unruns`: row `r`'s back).
fn runs(src: &[&[u8]; ROWS], dst: &mut [u8], from: usize, to: usize, len: usize) {
    for (r, s) in src.iter().enumerate() {
        for u in 0..len / 4 {
            dst[to + 32 * u + 4 * r..][..4].copy_from_slice(&s[from + 4 * u..][..4]);
        }
    }
}

fn unruns(p: &[u8], r: usize, out: &mut [u8], from: usize, to: usize, len: usize) {
    for u in 0..len / 4 {
        out[to + 4 * u..][..4].copy_from_slice(&p[from + 32 * u + 4 * r..][..4]);
    }
}

/// The 8 rows' blocks `src` of one index as one packed block `dst` (`8 * block_bytes`).
pub(super) fn pack_block(qt: QuantType, src: &[&[u8]; ROWS], dst: &mut [u8]) {
    match qt {
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let (head, fields) = (q5_head(qt), q5_head(qt) / 16);
            for (r, s) in src.iter().enumerate() {
                for f in 0..fields {
                    dst[16 * f + 2 * r..][..2].copy_from_slice(&s[2 * f..][..2]);
                }
                let qh = u32::from_le_bytes(s[2 * fields..][..4].try_into().unwrap());
                for j in 0..4 {
                    dst[head + 4 * r + j] =
                        (0..8).fold(0, |h, k| h | ((qh >> (4 * k + j)) & 1) << k) as u8;
                }
            }
            runs(src, dst, 2 * fields + 4, head + 32, 16);
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            for (r, s) in src.iter().enumerate() {
                dst[2 * r..][..2].copy_from_slice(&s[..2]);
                dst[16 + 2 * r..][..2].copy_from_slice(&s[2..4]);
                let sm: [(u8, u8); 8] = std::array::from_fn(|j| scale_min_k4(j, &s[4..16]));
                for (j, &(sc, m)) in sm.iter().enumerate() {
                    dst[32 + 8 * j + r] = (sc & 15) | (m & 15) << 4;
                }
                for j in 0..4 {
                    let (a, b) = (sm[j], sm[j + 4]);
                    dst[96 + 8 * j + r] =
                        a.0 >> 4 | (a.1 >> 4) << 2 | (b.0 >> 4) << 4 | (b.1 >> 4) << 6;
                }
            }
            let (qs_from, qs_to) = if qt == QuantType::Q5_K {
                runs(src, dst, 16, 128, 32);
                (48, 384)
            } else {
                (16, 128)
            };
            for c in 0..4 {
                runs(src, dst, qs_from + 32 * c, qs_to + 256 * c, 32);
            }
        }
        QuantType::Q6_K => {
            for (r, s) in src.iter().enumerate() {
                dst[2 * r..][..2].copy_from_slice(&s[208..210]);
                for i in 0..16 {
                    dst[16 + 8 * i + r] = s[192 + i];
                }
            }
            for c in 0..6 {
                runs(src, dst, 32 * c, 144 + 256 * c, 32);
            }
        }
        _ => unreachable!("{} has no x8 layout here", qt.name()),
    }
}

/// Row `r`'s block of the packed block `p`, in the GGUF layout (`out`: one block's bytes).
pub(super) fn unpack_block(qt: QuantType, p: &[u8], r: usize, out: &mut [u8]) {
    match qt {
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let (head, fields) = (q5_head(qt), q5_head(qt) / 16);
            for f in 0..fields {
                out[2 * f..][..2].copy_from_slice(&p[16 * f + 2 * r..][..2]);
            }
            let mut qh = 0u32;
            for j in 0..4 {
                for k in 0..8 {
                    qh |= u32::from((p[head + 4 * r + j] >> k) & 1) << (4 * k + j);
                }
            }
            out[2 * fields..][..4].copy_from_slice(&qh.to_le_bytes());
            unruns(p, r, out, head + 32, 2 * fields + 4, 16);
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            out[..2].copy_from_slice(&p[2 * r..][..2]);
            out[2..4].copy_from_slice(&p[16 + 2 * r..][..2]);
            let (sc, m) = k_scale_mins(p, r);
            for j in 0..4 {
                out[4 + j] = sc[j] | (sc[j + 4] >> 4) << 6;
                out[8 + j] = m[j] | (m[j + 4] >> 4) << 6;
                out[12 + j] = (sc[j + 4] & 15) | (m[j + 4] & 15) << 4;
            }
            let (qs_from, qs_to) = if qt == QuantType::Q5_K {
                unruns(p, r, out, 128, 16, 32);
                (384, 48)
            } else {
                (128, 16)
            };
            for c in 0..4 {
                unruns(p, r, out, qs_from + 256 * c, qs_to + 32 * c, 32);
            }
        }
        QuantType::Q6_K => {
            out[208..210].copy_from_slice(&p[2 * r..][..2]);
            for i in 0..16 {
                out[192 + i] = p[16 + 8 * i + r];
            }
            for c in 0..6 {
                unruns(p, r, out, 144 + 256 * c, 32 * c, 32);
            }
        }
        _ => unreachable!("{} has no x8 layout here", qt.name()),
    }
}

/// The 6-bit scales and mins of row `r`'s 8 sub-blocks in a packed Q4_K / Q5_K block.
fn k_scale_mins(p: &[u8], r: usize) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        let lo = p[32 + 8 * j + r];
        let hi = p[96 + 8 * (j % 4) + r] >> (4 * (j / 4));
        sc[j] = (lo & 15) | (hi & 3) << 4;
        m[j] = (lo >> 4) | ((hi >> 2) & 3) << 4;
    }
    (sc, m)
}

fn half(p: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([p[at], p[at + 1]]))
}

/// The 8 outputs of one packed group (`nb` packed blocks at `w`) for one activation row, in plain Rust
/// with the AVX2 kernels' arithmetic (see the module docs).
pub(super) fn group_portable(qt: QuantType, w: &[u8], nb: usize, a: ActRow<'_>) -> [f32; ROWS] {
    let bb = qt.block_bytes() * ROWS;
    let mut acc = [0.0f32; ROWS];
    for b in 0..nb {
        let p = &w[b * bb..][..bb];
        match qt {
            QuantType::Q5_0 | QuantType::Q5_1 => q5_block(qt, p, b, a, &mut acc),
            QuantType::Q4_K | QuantType::Q5_K => k45_block(qt, p, b, a, &mut acc),
            _ => q6k_block(p, b, a, &mut acc),
        }
    }
    acc
}

fn q5_block(qt: QuantType, p: &[u8], b: usize, a: ActRow<'_>, acc: &mut [f32; ROWS]) {
    let head = q5_head(qt);
    let x = &a.qs[32 * b..][..32];
    for (r, acc) in acc.iter_mut().enumerate() {
        let dw = half(p, 2 * r);
        let mw = if qt == QuantType::Q5_1 {
            half(p, 16 + 2 * r)
        } else {
            -16.0 * dw
        };
        let mut isum = 0i32;
        for t in 0..4 {
            for j in 0..4 {
                let (q, h) = (p[head + 32 + 32 * t + 4 * r + j], p[head + 4 * r + j]);
                let lo = (q & 15) | ((h >> t) & 1) << 4;
                let hi = (q >> 4) | ((h >> (4 + t)) & 1) << 4;
                isum += i32::from(lo) * i32::from(x[4 * t + j]);
                isum += i32::from(hi) * i32::from(x[16 + 4 * t + j]);
            }
        }
        *acc = (isum as f32).mul_add(dw * a.d[b], *acc);
        *acc = mw.mul_add(a.s[b], *acc);
    }
}

fn k45_block(qt: QuantType, p: &[u8], b: usize, a: ActRow<'_>, acc: &mut [f32; ROWS]) {
    let q5 = qt == QuantType::Q5_K;
    let qs_at = if q5 { 384 } else { 128 };
    for (r, acc) in acc.iter_mut().enumerate() {
        let (dw, dmin) = (half(p, 2 * r), half(p, 16 + 2 * r));
        let (sc, m) = k_scale_mins(p, r);
        for j in 0..8 {
            let sub = 8 * b + j;
            let x = &a.qs[32 * sub..][..32];
            let mut isum = 0i32;
            for u in 0..8 {
                for e in 0..4 {
                    let mut q =
                        (p[qs_at + 256 * (j / 2) + 32 * u + 4 * r + e] >> (4 * (j & 1))) & 15;
                    if q5 {
                        q |= ((p[128 + 32 * u + 4 * r + e] >> j) & 1) << 4;
                    }
                    isum += i32::from(q) * i32::from(x[4 * u + e]);
                }
            }
            *acc = ((isum * i32::from(sc[j])) as f32).mul_add(dw * a.d[sub], *acc);
            *acc = (-(dmin * f32::from(m[j]))).mul_add(a.s[sub], *acc);
        }
    }
}

fn q6k_block(p: &[u8], b: usize, a: ActRow<'_>, acc: &mut [f32; ROWS]) {
    for (r, acc) in acc.iter_mut().enumerate() {
        let dw = half(p, 2 * r);
        for s in 0..8 {
            let (h, t) = (s / 4, s % 4);
            let sub = 8 * b + s;
            let x = &a.qs[32 * sub..][..32];
            let mut isum = 0i32;
            for hh in 0..2 {
                let mut dot = 0i32;
                for u in 4 * hh..4 * hh + 4 {
                    for e in 0..4 {
                        let lo =
                            p[144 + 256 * (2 * h + (t & 1)) + 32 * u + 4 * r + e] >> (4 * (t >> 1));
                        let hi = p[1168 + 256 * h + 32 * u + 4 * r + e] >> (2 * t);
                        let q = ((lo & 15) | (hi & 3) << 4) as i32 - 32;
                        dot += q * i32::from(x[4 * u + e]);
                    }
                }
                isum += i32::from(p[16 + 8 * (2 * s + hh) + r] as i8) * dot;
            }
            *acc = (isum as f32).mul_add(dw * a.d[sub], *acc);
        }
    }
}
