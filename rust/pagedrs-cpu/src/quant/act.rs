//! Activations quantized to 8 bits per block of 32 (as llama.cpp's `block_q8_1`, with f32 scales):
//! `x[i] ~ d[b] * qs[i]`, and `s[b] = d[b] * sum(qs of block b)` for the offset terms of the weight types
//! that carry one (Q4_1, Q5_1, the K-quants' mins).

use super::formats::SUB;
use super::q8_block::quantize_block;
#[cfg(target_arch = "x86_64")]
use super::q8_block::quantize_block_avx2;
#[cfg(target_arch = "aarch64")]
use super::q8_block::quantize_block_neon;

/// `rows` activation rows of `k` values each (`k` a multiple of 32), quantized.
pub struct QuantizedActs {
    pub k: usize,
    pub rows: usize,
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
}

/// One quantized row, borrowed.
#[derive(Clone, Copy)]
pub struct ActRow<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub s: &'a [f32],
}

impl QuantizedActs {
    /// Quantizes `x` (`rows * k` values, row-major) with the kernel `Isa::chosen()` names.
    pub fn new(x: &[f32], rows: usize, k: usize) -> Self {
        Self::new_with(super::Isa::chosen(), x, rows, k)
    }

    /// `new` on the kernel chosen by the caller: the AVX2 and NEON ones give the portable one's bits (the
    /// same scalar scale, the same products, round-half-to-even in all).
    pub fn new_with(isa: super::Isa, x: &[f32], rows: usize, k: usize) -> Self {
        debug_assert_eq!(x.len(), rows * k);
        debug_assert_eq!(k % SUB, 0);
        let nb = rows * k / SUB;
        let mut qs = vec![0i8; rows * k];
        let (mut d, mut s) = (vec![0.0f32; nb], vec![0.0f32; nb]);
        let blocks = x
            .chunks_exact(SUB)
            .zip(qs.chunks_exact_mut(SUB))
            .zip(d.iter_mut())
            .zip(s.iter_mut());
        #[cfg(target_arch = "x86_64")]
        if isa.is_x86() && isa.is_supported() {
            for (((x, q), d), s) in blocks {
                // SAFETY: AVX2 detected; `x` and `q` are whole blocks of 32.
                #[allow(unsafe_code)]
                unsafe {
                    (*d, *s) = quantize_block_avx2(x, q);
                }
            }
            return QuantizedActs { k, rows, qs, d, s };
        }
        #[cfg(target_arch = "aarch64")]
        if matches!(isa, super::Isa::Neon | super::Isa::NeonDot) && isa.is_supported() {
            for (((x, q), d), s) in blocks {
                // SAFETY: NEON supported; `x` and `q` are whole blocks of 32.
                #[allow(unsafe_code)]
                unsafe {
                    (*d, *s) = quantize_block_neon(x, q);
                }
            }
            return QuantizedActs { k, rows, qs, d, s };
        }
        let _ = isa;
        for (((x, q), d), s) in blocks {
            (*d, *s) = quantize_block(x, q);
        }
        QuantizedActs { k, rows, qs, d, s }
    }

    pub fn row(&self, r: usize) -> ActRow<'_> {
        let nb = self.k / SUB;
        ActRow {
            qs: &self.qs[r * self.k..][..self.k],
            d: &self.d[r * nb..][..nb],
            s: &self.s[r * nb..][..nb],
        }
    }
}

/// `R` activation rows `i..i + R` with their block scales interleaved for the block-group kernels:
/// `d[b * R + r]` is row `i + r`'s scale of block `b` (and `s` likewise), zero-padded so that 8 floats
/// can be read from any `b * R` with `b < nb`.
pub struct Interleaved {
    pub i: usize,
    pub r: usize,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
}

impl Interleaved {
    pub fn new(acts: &QuantizedActs, i: usize, r: usize) -> Self {
        let nb = acts.k / SUB;
        let len = nb * r + 8;
        let (mut d, mut s) = (vec![0.0f32; len], vec![0.0f32; len]);
        for rr in 0..r {
            let row = acts.row(i + rr);
            for b in 0..nb {
                d[b * r + rr] = row.d[b];
                s[b * r + rr] = row.s[b];
            }
        }
        Interleaved { i, r, d, s }
    }

    /// The group borrowed, with its rows (`R` must be `self.r`).
    pub fn group<'a, const R: usize>(&'a self, acts: &'a QuantizedActs) -> RowGroup<'a, R> {
        debug_assert_eq!(R, self.r);
        RowGroup {
            rows: std::array::from_fn(|r| acts.row(self.i + r)),
            d: &self.d,
            s: &self.s,
        }
    }
}

/// `R` quantized rows and their interleaved block scales (see `Interleaved`).
pub struct RowGroup<'a, const R: usize> {
    pub rows: [ActRow<'a>; R],
    pub d: &'a [f32],
    pub s: &'a [f32],
}

/// `dot(dequantized weight row, dequantized activation row)` through the sub-block decoder, in plain
/// Rust: the fallback on CPUs without AVX2 or NEON (and the reference the SIMD kernels are tested against).
pub fn dot_portable(qt: super::QuantType, wrow: &[u8], a: ActRow<'_>) -> f32 {
    let (bb, subs) = (qt.block_bytes(), qt.block_len() / SUB);
    let mut vals = [0i8; SUB];
    let mut acc = 0.0f32;
    for (blk, block) in wrow.chunks_exact(bb).enumerate() {
        for sub in 0..subs {
            let (scale, offset) = super::formats::decode_sub(qt, block, sub, &mut vals);
            let ab = blk * subs + sub;
            let xq = &a.qs[ab * SUB..][..SUB];
            let (mut dot, mut sx) = ([0i32; 2], [0i32; 2]);
            for (i, (&w, &x)) in vals.iter().zip(xq).enumerate() {
                dot[i / 16] += i32::from(w) * i32::from(x);
                sx[i / 16] += i32::from(x);
            }
            acc += a.d[ab]
                * (scale[0] * dot[0] as f32
                    + scale[1] * dot[1] as f32
                    + offset[0] * sx[0] as f32
                    + offset[1] * sx[1] as f32);
        }
    }
    acc
}
