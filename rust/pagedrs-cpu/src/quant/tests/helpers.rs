//! The test data and the references the quant tests share.

use crate::quant::*;

/// xorshift64*, deterministic.
pub(super) struct Rng(pub(super) u64);
impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub(super) fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// f32 -> f16 bits for normal values (mantissa truncated): enough to write block scales.
pub(super) fn f16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    assert!((1..31).contains(&exp), "{v} is not a normal f16");
    sign | ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16
}

/// Byte offsets of the f16 fields of a block (scales and mins).
pub(super) fn half_fields(qt: QuantType) -> &'static [usize] {
    match qt {
        QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => &[0],
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
        QuantType::Q6_K => &[208],
        QuantType::Q2_K => &[80, 82],
        QuantType::Q3_K => &[108],
        QuantType::IQ4_NL | QuantType::IQ4_XS => &[0],
        QuantType::MXFP4 => &[],
    }
}

/// Byte offsets of a block's one-byte scales (MXFP4's e8m0 exponent).
pub(super) fn byte_fields(qt: QuantType) -> &'static [usize] {
    if qt == QuantType::MXFP4 {
        &[0]
    } else {
        &[]
    }
}

/// `n` rows of `k` weights: random bytes with finite, moderate f16 scales written over the scale fields.
pub(super) fn random_weights(qt: QuantType, n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let mut w: Vec<u8> = (0..n * qt.row_bytes(k)).map(|_| rng.next() as u8).collect();
    for block in w.chunks_exact_mut(qt.block_bytes()) {
        for &at in half_fields(qt) {
            let v =
                (0.002 + 0.05 * rng.uniform().abs()) * if rng.next() % 2 == 0 { 1.0 } else { -1.0 };
            block[at..at + 2].copy_from_slice(&f16_bits(v).to_le_bytes());
        }
        for &at in byte_fields(qt) {
            block[at] = 118 + (rng.next() % 12) as u8; // 2^-10 .. 2^1, halved
        }
    }
    w
}

pub(super) fn h(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// ggml's dequantization, loop for loop.
pub(super) fn reference_dequantize(qt: QuantType, row: &[u8], k: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; k];
    for (blk, x) in row.chunks_exact(qt.block_bytes()).enumerate() {
        let y = &mut y[blk * qt.block_len()..][..qt.block_len()];
        match qt {
            QuantType::Q4_0 | QuantType::Q4_1 => reference_q4(qt, x, y),
            QuantType::Q5_0 | QuantType::Q5_1 => reference_q5(qt, x, y),
            QuantType::Q8_0 => reference_q8_0(x, y),
            QuantType::Q4_K | QuantType::Q5_K => reference_q45_k(qt, x, y),
            QuantType::Q6_K => reference_q6_k(x, y),
            QuantType::Q2_K => reference_q2_k(x, y),
            QuantType::Q3_K => reference_q3_k(x, y),
            QuantType::IQ4_NL | QuantType::IQ4_XS => reference_iq4(qt, x, y),
            QuantType::MXFP4 => reference_mxfp4(x, y),
        }
    }
    y
}

/// ggml's `dequantize_row_q4_0` / `dequantize_row_q4_1`, one block.
fn reference_q4(qt: QuantType, x: &[u8], y: &mut [f32]) {
    let (d, m, qs) = if qt == QuantType::Q4_0 {
        (h(x, 0), 0.0, &x[2..18])
    } else {
        (h(x, 0), h(x, 2), &x[4..20])
    };
    let bias = if qt == QuantType::Q4_0 { 8 } else { 0 };
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0f) as i32 - bias) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) as i32 - bias) as f32 * d + m;
    }
}

/// ggml's `dequantize_row_q5_0` / `dequantize_row_q5_1`, one block.
fn reference_q5(qt: QuantType, x: &[u8], y: &mut [f32]) {
    let (d, m, at) = if qt == QuantType::Q5_0 {
        (h(x, 0), 0.0, 2)
    } else {
        (h(x, 0), h(x, 2), 4)
    };
    let qh = u32::from_le_bytes(x[at..at + 4].try_into().unwrap());
    let qs = &x[at + 4..at + 20];
    let bias = if qt == QuantType::Q5_0 { 16 } else { 0 };
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((u32::from(qs[j] & 0x0f) | xh0) as i32 - bias) as f32 * d + m;
        y[j + 16] = ((u32::from(qs[j] >> 4) | xh1) as i32 - bias) as f32 * d + m;
    }
}

/// ggml's `dequantize_row_q8_0`, one block.
fn reference_q8_0(x: &[u8], y: &mut [f32]) {
    let d = h(x, 0);
    for j in 0..32 {
        y[j] = f32::from(x[2 + j] as i8) * d;
    }
}

/// ggml's `dequantize_row_q4_K` / `dequantize_row_q5_K`, one block.
fn reference_q45_k(qt: QuantType, x: &[u8], y: &mut [f32]) {
    let (d, min) = (h(x, 0), h(x, 2));
    let scales = &x[4..16];
    let (qh, mut ql) = if qt == QuantType::Q5_K {
        (&x[16..48], &x[48..176])
    } else {
        (&x[0..0], &x[16..144])
    };
    let (mut u1, mut u2) = (1u8, 2u8);
    for (c, y) in y.chunks_exact_mut(64).enumerate() {
        let (sc1, m1) = formats::scale_min_k4(2 * c, scales);
        let (sc2, m2) = formats::scale_min_k4(2 * c + 1, scales);
        let (d1, mm1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, mm2) = (d * f32::from(sc2), min * f32::from(m2));
        for l in 0..32 {
            let (h1, h2) = if qt == QuantType::Q5_K {
                (
                    if qh[l] & u1 != 0 { 16.0 } else { 0.0 },
                    if qh[l] & u2 != 0 { 16.0 } else { 0.0 },
                )
            } else {
                (0.0, 0.0)
            };
            y[l] = d1 * (f32::from(ql[l] & 0x0f) + h1) - mm1;
            y[l + 32] = d2 * (f32::from(ql[l] >> 4) + h2) - mm2;
        }
        ql = &ql[32..];
        u1 <<= 2;
        u2 <<= 2;
    }
}

/// ggml's `dequantize_row_q6_K`, one block.
fn reference_q6_k(x: &[u8], y: &mut [f32]) {
    let d = h(x, 208);
    for half in 0..2 {
        let ql = &x[64 * half..];
        let qh = &x[128 + 32 * half..];
        let sc = &x[192 + 8 * half..];
        let y = &mut y[128 * half..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |i: usize| d * f32::from(sc[i] as i8);
            y[l] = s(is) * q1 as f32;
            y[l + 32] = s(is + 2) * q2 as f32;
            y[l + 64] = s(is + 4) * q3 as f32;
            y[l + 96] = s(is + 6) * q4 as f32;
        }
    }
}

/// ggml's `dequantize_row_q2_K`, one block.
fn reference_q2_k(x: &[u8], y: &mut [f32]) {
    let (d, min) = (h(x, 80), h(x, 82));
    let mut is = 0;
    let mut y = y.iter_mut();
    for n in 0..2 {
        let q = &x[16 + 32 * n..];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let sc = x[is];
                is += 1;
                let (dl, ml) = (d * f32::from(sc & 0xf), min * f32::from(sc >> 4));
                for l in 0..16 {
                    *y.next().unwrap() = dl * f32::from((q[l + 16 * half] >> shift) & 3) - ml;
                }
            }
        }
    }
}

/// ggml's `dequantize_row_q3_K`, one block (its `kmask` scale unpacking, word for word).
fn reference_q3_k(x: &[u8], y: &mut [f32]) {
    let (kmask1, kmask2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let d_all = h(x, 108);
    let (hm, qs) = (&x[..32], &x[32..96]);
    let mut aux = [0u32; 4];
    for (i, a) in aux.iter_mut().take(3).enumerate() {
        *a = u32::from_le_bytes(x[96 + 4 * i..100 + 4 * i].try_into().unwrap());
    }
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | ((tmp & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    let scales: Vec<i8> = aux
        .iter()
        .flat_map(|a| a.to_le_bytes())
        .map(|b| b as i8)
        .collect();
    let (mut is, mut m) = (0, 1u8);
    let mut y = y.iter_mut();
    for n in 0..2 {
        let q = &qs[32 * n..];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let dl = d_all * f32::from(scales[is] - 32);
                is += 1;
                for l in 16 * half..16 * half + 16 {
                    let v = ((q[l] >> shift) & 3) as i8 - if hm[l] & m != 0 { 0 } else { 4 };
                    *y.next().unwrap() = dl * f32::from(v);
                }
            }
            m <<= 1;
        }
    }
}

/// ggml's `dequantize_row_iq4_nl` / `dequantize_row_iq4_xs`, one block.
fn reference_iq4(qt: QuantType, x: &[u8], y: &mut [f32]) {
    const KV: [i8; 16] = [
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    ];
    let d = h(x, 0);
    for (ib, y) in y.chunks_exact_mut(32).enumerate() {
        let (dl, qs) = if qt == QuantType::IQ4_NL {
            (d, &x[2..18])
        } else {
            let scales_h = u16::from_le_bytes([x[2], x[3]]);
            let ls = ((x[4 + ib / 2] >> (4 * (ib % 2))) & 0xf) as i32
                | (((scales_h >> (2 * ib)) & 3) << 4) as i32;
            (d * (ls - 32) as f32, &x[8 + 16 * ib..24 + 16 * ib])
        };
        for j in 0..16 {
            y[j] = dl * f32::from(KV[usize::from(qs[j] & 0xf)]);
            y[j + 16] = dl * f32::from(KV[usize::from(qs[j] >> 4)]);
        }
    }
}

/// ggml's `dequantize_row_mxfp4`, one block.
fn reference_mxfp4(x: &[u8], y: &mut [f32]) {
    // OCP e2m1 (sign, 2 exponent bits with bias 1, 1 mantissa bit) times 2^(e - 127)
    let e2m1 = |c: u8| {
        let (exp, man) = (i32::from((c >> 1) & 3), f64::from(c & 1));
        let mag = if exp == 0 {
            man * 0.5
        } else {
            (1.0 + man * 0.5) * 2f64.powi(exp - 1)
        };
        if c & 8 != 0 {
            -mag
        } else {
            mag
        }
    };
    let scale = 2f64.powi(i32::from(x[0]) - 127);
    for j in 0..16 {
        y[j] = (e2m1(x[1 + j] & 0x0f) * scale) as f32;
        y[j + 16] = (e2m1(x[1 + j] >> 4) * scale) as f32;
    }
}

/// f64 `x_q @ W^T` with x_q the dequantized 8-bit activations and W from the reference dequantizer:
/// what the integer kernels compute up to f32 rounding. Also returns sum |x_q| |W| per output (the
/// scale of the rounding error).
pub(super) fn reference_matmul(
    qt: QuantType,
    w: &[u8],
    x: &[f32],
    m: usize,
    k: usize,
) -> (Vec<f64>, Vec<f64>) {
    let rb = qt.row_bytes(k);
    let n = w.len() / rb;
    let acts = QuantizedActs::new(x, m, k);
    let wf: Vec<Vec<f32>> = w
        .chunks_exact(rb)
        .map(|r| reference_dequantize(qt, r, k))
        .collect();
    let (mut y, mut mag) = (vec![0.0f64; m * n], vec![0.0f64; m * n]);
    for i in 0..m {
        let xq: Vec<f64> = (0..k)
            .map(|j| f64::from(acts.d[(i * k + j) / 32]) * f64::from(acts.qs[i * k + j]))
            .collect();
        for (jn, wr) in wf.iter().enumerate() {
            for (a, &b) in xq.iter().zip(wr) {
                y[i * n + jn] += a * f64::from(b);
                mag[i * n + jn] += (a * f64::from(b)).abs();
            }
        }
    }
    (y, mag)
}

/// Every kernel set this CPU runs (on aarch64 with `dotprod`: portable, NEON and NEON with `sdot`).
pub(super) fn isas() -> Vec<Isa> {
    Isa::supported()
}
