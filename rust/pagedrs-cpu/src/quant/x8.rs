//! Q4_0 / Q4_1 / Q8_0 weights repacked once at load, 8 rows interleaved ("x8"), for a matmul whose
//! outputs come 8 at a time without any horizontal sum: llama.cpp's answer on AVX2 for its `Q4_0`
//! (`q4_0_8x8` repacking), here for both 4-bit types of the default model and the Q8_0 of its output
//! head (the costliest matmul of a step with a few rows: 49152 x 576).
//!
//! Layout: rows are taken in groups of 8 (the row count must be a multiple of 8); a group is `nb` packed
//! blocks, one per 32 weights, each the 8 rows' blocks of that index interleaved, with the same bytes in
//! all (`8 * block_bytes`):
//!
//! ```text
//! d[0..8]   f16 scales of rows 0..7
//! m[0..8]   f16 mins of rows 0..7                          (Q4_1 only)
//! qs[t][r]  for t in 0..Q/4, r in 0..8: bytes 4t..4t+4 of row r's Q quant bytes (16 nibble bytes for
//!           the 4-bit types, 32 signed bytes for Q8_0)
//! ```
//!
//! so one 32-byte load holds, in its low nibbles, weights 4t..4t+3 of each of the 8 rows (the high
//! nibbles: weights 16+4t..16+4t+3; for Q8_0 the bytes are weights 4t..4t+3 themselves), and a `maddubs`
//! against activations 4t..4t+3 broadcast to every lane gives the 8 rows' partial dots side by side
//! (Q8_0's signed weights through the sign trick: |w| times x with w's sign moved onto x).
//!
//! Arithmetic of one output (row of W, row of x), the same in the AVX2, NEON and portable kernels and for
//! any number of activation rows, so a row gets the same bits alone or in a batch: per block in order,
//! `acc = fma(isum, dw * dx, acc)` then `acc = fma(mw, sx, acc)` with `isum` the exact integer dot
//! (`mw` = the min for Q4_1, `-8 * dw` for Q4_0; `sx` = the activation block's `d * sum(q)`; Q8_0 has no
//! second FMA).
//!
//! Q5_0, Q5_1 and the K-quants (Q4_K, Q5_K, Q6_K) have x8 layouts too, with their own packed blocks and
//! arithmetic: `x8k`.

use super::act::ActRow;
use super::formats::{f16_to_f32, QuantType};
use super::x8k;
use crate::KernelError;

/// Rows per interleaved group (the K-quant layouts' module owns the figure; every x8 layout shares it).
pub use super::x8k::ROWS;

/// Whether the type has an x8 layout.
pub fn packs(qt: QuantType) -> bool {
    matches!(qt, QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0) || x8k::packs(qt)
}

/// Bytes of the f16 fields before the quants in a packed block (8 scales, and 8 mins for Q4_1).
fn head_bytes(qt: QuantType) -> usize {
    if qt == QuantType::Q4_1 {
        32
    } else {
        16
    }
}

/// Quant bytes of one row's block (after its f16 fields): 16 nibble bytes, or Q8_0's 32 bytes.
fn quant_bytes(qt: QuantType) -> usize {
    qt.block_bytes() - head_bytes(qt) / ROWS
}

/// `Err` unless `n` rows of `k` weights of `qt` have an x8 layout and `len` is their byte count.
pub(super) fn check(qt: QuantType, len: usize, n: usize, k: usize) -> Result<(), KernelError> {
    if !packs(qt) || n % ROWS != 0 {
        return Err(KernelError::Packing {
            qtype: qt.name(),
            n,
        });
    }
    super::check_k(qt, k)?;
    KernelError::check_len("weight", len, n * qt.row_bytes(k))
}

/// W (`n` rows of `k` weights in the GGUF layout) in the x8 layout: the same number of bytes.
pub fn pack(qt: QuantType, w: &[u8], n: usize, k: usize) -> Result<Vec<u8>, KernelError> {
    check(qt, w.len(), n, k)?;
    let (bb, nb, rb) = (qt.block_bytes(), k / qt.block_len(), qt.row_bytes(k));
    let (head, fields) = (head_bytes(qt), head_bytes(qt) / 16);
    let mut out = vec![0u8; w.len()];
    for g in 0..n / ROWS {
        for b in 0..nb {
            let dst = &mut out[(g * nb + b) * ROWS * bb..][..ROWS * bb];
            if x8k::packs(qt) {
                let src = std::array::from_fn(|r| &w[(g * ROWS + r) * rb + b * bb..][..bb]);
                x8k::pack_block(qt, &src, dst);
                continue;
            }
            for r in 0..ROWS {
                let src = &w[(g * ROWS + r) * rb + b * bb..][..bb];
                for f in 0..fields {
                    dst[16 * f + 2 * r..][..2].copy_from_slice(&src[2 * f..][..2]);
                }
                for t in 0..quant_bytes(qt) / 4 {
                    dst[head + 32 * t + 4 * r..][..4]
                        .copy_from_slice(&src[head / 8 + 4 * t..][..4]);
                }
            }
        }
    }
    Ok(out)
}

/// Row `row` of a packed W back in the GGUF layout (`out`: one row's bytes).
pub fn unpack_row(qt: QuantType, packed: &[u8], k: usize, row: usize, out: &mut [u8]) {
    let (bb, nb) = (qt.block_bytes(), k / qt.block_len());
    let (head, fields) = (head_bytes(qt), head_bytes(qt) / 16);
    let (g, r) = (row / ROWS, row % ROWS);
    for b in 0..nb {
        let src = &packed[(g * nb + b) * ROWS * bb..][..ROWS * bb];
        let dst = &mut out[b * bb..][..bb];
        if x8k::packs(qt) {
            x8k::unpack_block(qt, src, r, dst);
            continue;
        }
        for f in 0..fields {
            dst[2 * f..][..2].copy_from_slice(&src[16 * f + 2 * r..][..2]);
        }
        for t in 0..quant_bytes(qt) / 4 {
            dst[head / 8 + 4 * t..][..4].copy_from_slice(&src[head + 32 * t + 4 * r..][..4]);
        }
    }
}

/// The 8 outputs of one packed group (`nb` blocks at `w`) for one activation row, in plain Rust with the
/// SIMD kernels' arithmetic (see the module docs).
pub fn group_portable(qt: QuantType, w: &[u8], nb: usize, a: ActRow<'_>) -> [f32; ROWS] {
    if x8k::packs(qt) {
        return x8k::group_portable(qt, w, nb, a);
    }
    let (bb, head) = (qt.block_bytes() * ROWS, head_bytes(qt));
    let mut acc = [0.0f32; ROWS];
    for b in 0..nb {
        let p = &w[b * bb..][..bb];
        let x = &a.qs[32 * b..][..32];
        for (r, acc) in acc.iter_mut().enumerate() {
            let dw = f16_to_f32(u16::from_le_bytes([p[2 * r], p[2 * r + 1]]));
            let mut isum = 0i32;
            if qt == QuantType::Q8_0 {
                for t in 0..8 {
                    for j in 0..4 {
                        let q = p[head + 32 * t + 4 * r + j] as i8;
                        isum += i32::from(q) * i32::from(x[4 * t + j]);
                    }
                }
                *acc = (isum as f32).mul_add(dw * a.d[b], *acc);
                continue;
            }
            let mw = if qt == QuantType::Q4_1 {
                f16_to_f32(u16::from_le_bytes([p[16 + 2 * r], p[17 + 2 * r]]))
            } else {
                -8.0 * dw
            };
            for t in 0..4 {
                for j in 0..4 {
                    let q = p[head + 32 * t + 4 * r + j];
                    isum += i32::from(q & 0x0f) * i32::from(x[4 * t + j]);
                    isum += i32::from(q >> 4) * i32::from(x[16 + 4 * t + j]);
                }
            }
            *acc = (isum as f32).mul_add(dw * a.d[b], *acc);
            *acc = mw.mul_add(a.s[b], *acc);
        }
    }
    acc
}
