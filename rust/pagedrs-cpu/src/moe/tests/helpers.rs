//! The test data and the float64 references the experts tests share.

use crate::moe::*;
use crate::quant::{dequantize_row, quant_matmul_with};

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
    pub(super) fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

pub(super) fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// float64: sum over slots of weight * down(silu(gate x) * up x), weights given as float32 matrices.
pub(super) fn reference(
    gu: &[f32],
    dn: &[f32],
    x: &[f32],
    ids: &[i64],
    wts: &[f32],
    d: &MoeDims,
) -> Vec<f64> {
    let (h, i_, k) = (d.hidden, d.inter, d.top_k);
    let mut out = vec![0.0f64; d.tokens * h];
    for t in 0..d.tokens {
        let xr = &x[t * h..][..h];
        for s in 0..k {
            let e = ids[t * k + s] as usize;
            let act: Vec<f64> = (0..i_)
                .map(|j| {
                    let dot = |row: usize| -> f64 {
                        let w = &gu[(e * 2 * i_ + row) * h..][..h];
                        w.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum()
                    };
                    silu(dot(j)) * dot(i_ + j)
                })
                .collect();
            for c in 0..h {
                let w = &dn[(e * h + c) * i_..][..i_];
                let v: f64 = w.iter().zip(&act).map(|(&a, &b)| a as f64 * b).sum();
                out[t * h + c] += wts[t * k + s] as f64 * v;
            }
        }
    }
    out
}

pub(super) fn random_ids(rng: &mut Rng, tokens: usize, k: usize, experts: usize) -> Vec<i64> {
    let mut ids = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let mut chosen: Vec<i64> = Vec::new();
        while chosen.len() < k {
            let e = (rng.next() % experts as u64) as i64;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids.extend(chosen);
    }
    ids
}

pub(super) fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * scale,
            "{what}: out[{i}] = {g}, want {w} (scale {scale})"
        );
    }
}

/// (tokens, top_k, hidden, inter, experts); `ids` None: random distinct experts per token.
pub(super) fn run_f32(
    isa: Isa,
    shape: (usize, usize, usize, usize, usize),
    ids: Option<Vec<i64>>,
    threads: usize,
) {
    let (tokens, top_k, hidden, inter, experts) = shape;
    let d = MoeDims {
        tokens,
        top_k,
        hidden,
        inter,
        experts,
    };
    let mut rng = Rng(0x9e37_79b9 ^ (tokens * 31 + hidden * 7 + experts) as u64);
    let gu = rng.vec(experts * 2 * inter * hidden, 0.3);
    let dn = rng.vec(experts * hidden * inter, 0.3);
    let x = rng.vec(tokens * hidden, 1.0);
    let ids = ids.unwrap_or_else(|| random_ids(&mut rng, tokens, top_k, experts));
    let wts: Vec<f32> = (0..tokens * top_k).map(|_| rng.uniform().abs()).collect();
    let mut out = vec![f32::NAN; tokens * hidden];
    moe_experts_with(
        isa,
        ExpertWeights::F32(&gu),
        ExpertWeights::F32(&dn),
        &x,
        &ids,
        &wts,
        &mut out,
        &d,
        threads,
    )
    .unwrap();
    let want = reference(&gu, &dn, &x, &ids, &wts, &d);
    assert_close(&out, &want, 1e-5, &format!("{} {shape:?}", isa.name()));
}

/// Random GGUF rows with moderate f16 scales over the scale fields (as quant/tests/helpers.rs writes them).
pub(super) fn random_quant(qt: QuantType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut w: Vec<u8> = (0..rows * qt.row_bytes(cols))
        .map(|_| rng.next() as u8)
        .collect();
    let fields: &[usize] = match qt {
        QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => &[0],
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
        QuantType::Q6_K => &[208],
        QuantType::Q2_K => &[80, 82],
        QuantType::Q3_K => &[108],
        QuantType::IQ4_NL | QuantType::IQ4_XS => &[0],
        QuantType::MXFP4 => &[],
    };
    for block in w.chunks_exact_mut(qt.block_bytes()) {
        for &at in fields {
            // 0.0039 .. 0.0195 as f16 bits (exponent 8..12 - 15), either sign
            let bits: u16 = ((8 + rng.next() % 4) as u16) << 10 | (rng.next() % 1024) as u16;
            let sign: u16 = if rng.next() % 2 == 0 { 0 } else { 0x8000 };
            block[at..at + 2].copy_from_slice(&(bits | sign).to_le_bytes());
        }
        if qt == QuantType::MXFP4 {
            block[0] = 118 + (rng.next() % 4) as u8; // the e8m0 exponent: 2^-10 .. 2^-7
        }
    }
    w
}

pub(super) fn dequantize(qt: QuantType, w: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let rb = qt.row_bytes(cols);
    let mut out = vec![0.0f32; rows * cols];
    for (r, o) in out.chunks_exact_mut(cols).enumerate() {
        dequantize_row(qt, &w[r * rb..][..rb], o);
    }
    out
}

/// Each (token, slot) pair through the dense quantized kernels alone (one row at a time).
#[allow(clippy::too_many_arguments)]
pub(super) fn pairwise(
    isa: Isa,
    qt: QuantType,
    gu: &[u8],
    dn: &[u8],
    x: &[f32],
    ids: &[i64],
    wts: &[f32],
    d: &MoeDims,
) -> Vec<f64> {
    let (h, i_, k) = (d.hidden, d.inter, d.top_k);
    let (rb_gu, rb_dn) = (qt.row_bytes(h), qt.row_bytes(i_));
    let mut out = vec![0.0f64; d.tokens * h];
    for t in 0..d.tokens {
        for s in 0..k {
            let e = ids[t * k + s] as usize;
            let mut g = vec![0.0f32; 2 * i_];
            let dims = MatmulDims {
                m: 1,
                k: h,
                n: 2 * i_,
                ldo: 2 * i_,
                col0: 0,
            };
            quant_matmul_with(
                isa,
                qt,
                &gu[e * 2 * i_ * rb_gu..][..2 * i_ * rb_gu],
                &x[t * h..][..h],
                &mut g,
                &dims,
                1,
            )
            .unwrap();
            let mut act = vec![0.0f32; i_];
            silu_and_mul(&g, i_, &mut act).unwrap();
            let mut y = vec![0.0f32; h];
            let dims = MatmulDims {
                m: 1,
                k: i_,
                n: h,
                ldo: h,
                col0: 0,
            };
            quant_matmul_with(
                isa,
                qt,
                &dn[e * h * rb_dn..][..h * rb_dn],
                &act,
                &mut y,
                &dims,
                1,
            )
            .unwrap();
            for c in 0..h {
                out[t * h + c] += (y[c] * wts[t * k + s]) as f64;
            }
        }
    }
    out
}

/// float64: as `reference`, with the experts' biases and gpt-oss's clamped SwiGLU (HF's GptOssExperts).
#[allow(clippy::too_many_arguments)]
pub(super) fn reference_swiglu(
    gu: &[f32],
    dn: &[f32],
    b_gu: &[f32],
    b_dn: &[f32],
    (alpha, limit): (f64, f64),
    x: &[f32],
    ids: &[i64],
    wts: &[f32],
    d: &MoeDims,
) -> Vec<f64> {
    let (h, i_, k) = (d.hidden, d.inter, d.top_k);
    let mut out = vec![0.0f64; d.tokens * h];
    for t in 0..d.tokens {
        let xr = &x[t * h..][..h];
        for s in 0..k {
            let e = ids[t * k + s] as usize;
            let act: Vec<f64> = (0..i_)
                .map(|j| {
                    let dot = |row: usize| -> f64 {
                        let w = &gu[(e * 2 * i_ + row) * h..][..h];
                        let v: f64 = w.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
                        v + b_gu[e * 2 * i_ + row] as f64
                    };
                    let g = dot(j).min(limit);
                    let u = dot(i_ + j).clamp(-limit, limit);
                    (u + 1.0) * g / (1.0 + (-alpha * g).exp())
                })
                .collect();
            for c in 0..h {
                let w = &dn[(e * h + c) * i_..][..i_];
                let v: f64 = w.iter().zip(&act).map(|(&a, &b)| a as f64 * b).sum();
                out[t * h + c] += wts[t * k + s] as f64 * (v + b_dn[e * h + c] as f64);
            }
        }
    }
    out
}
