//! The fused experts step against a float64 reference (float32 experts), and quantized experts against
//! the dense quantized matmul run one pair at a time (the same kernels, so the same bits per row up to
//! the final weighted sum) and a float64 reference over the dequantized weights.

use super::*;
use crate::quant::{dequantize_row, quant_matmul_with};

/// xorshift64*, deterministic.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// float64: sum over slots of weight * down(silu(gate x) * up x), weights given as float32 matrices.
fn reference(gu: &[f32], dn: &[f32], x: &[f32], ids: &[i64], wts: &[f32], d: &MoeDims) -> Vec<f64> {
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

fn random_ids(rng: &mut Rng, tokens: usize, k: usize, experts: usize) -> Vec<i64> {
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

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * scale,
            "{what}: out[{i}] = {g}, want {w} (scale {scale})"
        );
    }
}

/// (tokens, top_k, hidden, inter, experts); `ids` None: random distinct experts per token.
fn run_f32(
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

#[test]
fn f32_experts_match_the_float64_reference_on_random_shapes() {
    for isa in Isa::supported() {
        for &shape in &[
            (1, 1, 16, 8, 1),
            (1, 2, 64, 48, 8),
            (7, 2, 33, 17, 4),
            (16, 4, 96, 40, 16),
            (37, 3, 50, 70, 6),
            (5, 8, 32, 16, 8), // top_k == experts
        ] {
            for threads in [1, 3] {
                run_f32(isa, shape, None, threads);
            }
        }
    }
}

#[test]
fn f32_experts_with_many_rows_each_match_the_float64_reference() {
    // tens of rows per expert (the register tiles' whole 4 x 4 blocks and every row/column tail),
    // widths off the 16-float step; an expert with no rows, all rows to one expert, top_k == experts
    for isa in Isa::supported() {
        for &shape in &[(90, 2, 70, 45, 3), (41, 3, 48, 33, 5), (23, 4, 37, 19, 4)] {
            run_f32(isa, shape, None, 2);
        }
        let ids: Vec<i64> = (0..50).map(|t| [0i64, 2, 4][t % 3]).collect(); // experts 1 and 3 unused
        run_f32(isa, (50, 1, 40, 21, 5), Some(ids), 3);
        run_f32(isa, (29, 1, 35, 18, 3), Some(vec![1; 29]), 1);
        let all: Vec<i64> = (0..19 * 3).map(|p| [2i64, 0, 1][p % 3]).collect();
        run_f32(isa, (19, 3, 33, 20, 3), Some(all), 2);
    }
}

#[test]
fn f32_experts_with_one_to_nine_rows_each_match_the_float64_reference() {
    // expert e takes e rows (expert 0 none): every tile height of the panel kernel (1 and 2 rows one
    // weight row at a time, 3..9 in groups of at most 4), widths off the 8- and 16-float steps and output
    // widths off the tile and panel widths; 4 threads split one expert's weight rows into runs that start
    // inside a panel and end before the prefetch distance
    let ids: Vec<i64> = (0..10i64)
        .flat_map(|e| std::iter::repeat_n(e, e as usize))
        .collect();
    for isa in Isa::supported() {
        for &(hidden, inter) in &[(37, 13), (70, 45), (48, 33), (200, 100)] {
            for threads in [1, 4] {
                run_f32(isa, (45, 1, hidden, inter, 10), Some(ids.clone()), threads);
            }
        }
        for rows in 1..=9 {
            run_f32(isa, (rows, 1, 133, 98, 3), Some(vec![1; rows]), 4);
        }
    }
}

#[test]
fn f32_routing_edge_cases() {
    // every token to expert 2 (the others have no rows), and tokens naming the same experts in both orders
    run_f32(Isa::chosen(), (9, 1, 32, 24, 4), Some(vec![2; 9]), 2);
    run_f32(
        Isa::chosen(),
        (4, 2, 32, 24, 4),
        Some(vec![0, 3, 3, 0, 0, 3, 3, 0]),
        2,
    );
    // no tokens at all
    let d = MoeDims {
        tokens: 0,
        top_k: 2,
        hidden: 8,
        inter: 4,
        experts: 2,
    };
    let (gu, dn) = (vec![0.0; 2 * 8 * 8], vec![0.0; 2 * 8 * 4]);
    moe_experts(
        ExpertWeights::F32(&gu),
        ExpertWeights::F32(&dn),
        &[],
        &[],
        &[],
        &mut [],
        &d,
        2,
    )
    .unwrap();
}

#[test]
fn bad_arguments_are_errors() {
    let d = MoeDims {
        tokens: 2,
        top_k: 2,
        hidden: 8,
        inter: 4,
        experts: 3,
    };
    let (gu, dn) = (vec![0.0; 3 * 8 * 8], vec![0.0; 3 * 8 * 4]);
    let x = vec![0.0; 16];
    let mut out = vec![0.0; 16];
    let w = [0.5f32; 4];
    let run = |ids: &[i64], gu: &[f32], out: &mut [f32]| {
        moe_experts(
            ExpertWeights::F32(gu),
            ExpertWeights::F32(&dn),
            &x,
            ids,
            &w,
            out,
            &d,
            1,
        )
    };
    assert_eq!(
        run(&[0, 1, 2, 3], &gu, &mut out),
        Err(KernelError::Row {
            index: 3,
            id: 3,
            n: 3
        })
    );
    assert_eq!(
        run(&[0, 1, 2, -1], &gu, &mut out),
        Err(KernelError::Row {
            index: 3,
            id: -1,
            n: 3
        })
    );
    assert!(matches!(
        run(&[0, 1, 2], &gu, &mut out),
        Err(KernelError::Length { name: "ids", .. })
    ));
    assert!(matches!(
        run(&[0, 1, 2, 0], &gu[1..], &mut out),
        Err(KernelError::Length {
            name: "gate_up",
            ..
        })
    ));
    assert!(matches!(
        run(&[0, 1, 2, 0], &gu, &mut out[1..]),
        Err(KernelError::Length { name: "out", .. })
    ));
    let q = vec![0u8; 3 * 8 * QuantType::Q8_0.row_bytes(32)];
    let bad = moe_experts(
        ExpertWeights::Quant(QuantType::Q8_0, &q),
        ExpertWeights::F32(&dn),
        &x,
        &[0, 1, 2, 0],
        &w,
        &mut out,
        &d,
        1,
    );
    assert!(matches!(bad, Err(KernelError::BlockLen { k: 8, .. })));
}

/// Random GGUF rows with moderate f16 scales over the scale fields (see quant/tests.rs).
fn random_quant(qt: QuantType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut w: Vec<u8> = (0..rows * qt.row_bytes(cols))
        .map(|_| rng.next() as u8)
        .collect();
    let fields: &[usize] = match qt {
        QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => &[0],
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
        QuantType::Q6_K => &[208],
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

fn dequantize(qt: QuantType, w: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let rb = qt.row_bytes(cols);
    let mut out = vec![0.0f32; rows * cols];
    for (r, o) in out.chunks_exact_mut(cols).enumerate() {
        dequantize_row(qt, &w[r * rb..][..rb], o);
    }
    out
}

/// Each (token, slot) pair through the dense quantized kernels alone (one row at a time).
#[allow(clippy::too_many_arguments)]
fn pairwise(
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

#[test]
fn quantized_experts_match_the_dense_kernels_and_the_float64_reference() {
    for isa in Isa::supported() {
        for qt in [
            QuantType::Q8_0,
            QuantType::Q4_0,
            QuantType::Q4_K,
            QuantType::Q6_K,
            QuantType::MXFP4,
        ] {
            let bl = qt.block_len();
            for &(tokens, top_k, experts, threads) in &[(1, 2, 4, 1), (11, 2, 8, 3), (6, 4, 4, 2)] {
                let (hidden, inter) = (2 * bl, bl);
                let d = MoeDims {
                    tokens,
                    top_k,
                    hidden,
                    inter,
                    experts,
                };
                let mut rng = Rng(0x51ed ^ (tokens * 97 + bl) as u64);
                let gu = random_quant(qt, experts * 2 * inter, hidden, &mut rng);
                let dn = random_quant(qt, experts * hidden, inter, &mut rng);
                let x = rng.vec(tokens * hidden, 1.0);
                let ids = random_ids(&mut rng, tokens, top_k, experts);
                let wts: Vec<f32> = (0..tokens * top_k).map(|_| rng.uniform().abs()).collect();
                let mut out = vec![f32::NAN; tokens * hidden];
                moe_experts_with(
                    isa,
                    ExpertWeights::Quant(qt, &gu),
                    ExpertWeights::Quant(qt, &dn),
                    &x,
                    &ids,
                    &wts,
                    &mut out,
                    &d,
                    threads,
                )
                .unwrap();
                let what = format!("{} {} {tokens}x{top_k} of {experts}", isa.name(), qt.name());
                assert_close(
                    &out,
                    &pairwise(isa, qt, &gu, &dn, &x, &ids, &wts, &d),
                    1e-6,
                    &what,
                );
                let (gf, df) = (
                    dequantize(qt, &gu, experts * 2 * inter, hidden),
                    dequantize(qt, &dn, experts * hidden, inter),
                );
                // 8-bit activations, quantized twice: within a few percent of the largest output
                assert_close(&out, &reference(&gf, &df, &x, &ids, &wts, &d), 0.05, &what);
            }
        }
    }
}

#[test]
fn packed_quantized_experts_match_the_unpacked_ones_and_the_float64_reference() {
    // each expert's matrices in the x8 layout (packed as one stacked matrix); experts of 0..9 rows, 1 and
    // 3 threads (runs of groups split an expert)
    let ids: Vec<i64> = (0..10i64)
        .flat_map(|e| std::iter::repeat_n(e, e as usize))
        .collect();
    for isa in Isa::supported() {
        for qt in [QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_1] {
            for &(hidden, inter, threads) in &[(64, 32, 1), (96, 64, 3)] {
                let (tokens, experts) = (ids.len(), 10);
                let d = MoeDims {
                    tokens,
                    top_k: 1,
                    hidden,
                    inter,
                    experts,
                };
                let mut rng = Rng(0x7a3 ^ (hidden * 13 + inter) as u64);
                let gu = random_quant(qt, experts * 2 * inter, hidden, &mut rng);
                let dn = random_quant(qt, experts * hidden, inter, &mut rng);
                let x = rng.vec(tokens * hidden, 1.0);
                let wts: Vec<f32> = (0..tokens).map(|_| rng.uniform().abs()).collect();
                let gu8 = crate::quant::x8::pack(qt, &gu, experts * 2 * inter, hidden).unwrap();
                let dn8 = crate::quant::x8::pack(qt, &dn, experts * hidden, inter).unwrap();
                let run = |gw: ExpertWeights<'_>, dw: ExpertWeights<'_>| {
                    let mut out = vec![f32::NAN; tokens * hidden];
                    moe_experts_with(isa, gw, dw, &x, &ids, &wts, &mut out, &d, threads).unwrap();
                    out
                };
                let packed = run(
                    ExpertWeights::QuantX8(qt, &gu8),
                    ExpertWeights::QuantX8(qt, &dn8),
                );
                let plain = run(ExpertWeights::Quant(qt, &gu), ExpertWeights::Quant(qt, &dn));
                let what = format!("{} {} {hidden}x{inter}", isa.name(), qt.name());
                let plain64: Vec<f64> = plain.iter().map(|&v| v as f64).collect();
                // up to 9 rows per expert the unpacked kernels sum as the packed ones do
                assert_close(&packed, &plain64, 1e-5, &what);
                let (gf, df) = (
                    dequantize(qt, &gu, experts * 2 * inter, hidden),
                    dequantize(qt, &dn, experts * hidden, inter),
                );
                assert_close(
                    &packed,
                    &reference(&gf, &df, &x, &ids, &wts, &d),
                    0.05,
                    &what,
                );
            }
        }
    }
    // 40 rows of one expert (the 4-row steps over many groups) against the float64 reference
    for isa in Isa::supported() {
        let qt = QuantType::Q4_1;
        let (tokens, hidden, inter, experts) = (40, 64, 32, 3);
        let d = MoeDims {
            tokens,
            top_k: 1,
            hidden,
            inter,
            experts,
        };
        let mut rng = Rng(0x40);
        let gu = random_quant(qt, experts * 2 * inter, hidden, &mut rng);
        let dn = random_quant(qt, experts * hidden, inter, &mut rng);
        let x = rng.vec(tokens * hidden, 1.0);
        let wts = vec![1.0f32; tokens];
        let ids = vec![1i64; tokens];
        let gu8 = crate::quant::x8::pack(qt, &gu, experts * 2 * inter, hidden).unwrap();
        let dn8 = crate::quant::x8::pack(qt, &dn, experts * hidden, inter).unwrap();
        let mut out = vec![f32::NAN; tokens * hidden];
        let (gw, dw) = (
            ExpertWeights::QuantX8(qt, &gu8),
            ExpertWeights::QuantX8(qt, &dn8),
        );
        moe_experts_with(isa, gw, dw, &x, &ids, &wts, &mut out, &d, 2).unwrap();
        let (gf, df) = (
            dequantize(qt, &gu, experts * 2 * inter, hidden),
            dequantize(qt, &dn, experts * hidden, inter),
        );
        let want = reference(&gf, &df, &x, &ids, &wts, &d);
        assert_close(&out, &want, 0.05, &format!("{} 40 rows", isa.name()));
    }
    // a type without the layout, and rows off the 8-row groups, are errors
    let d = MoeDims {
        tokens: 1,
        top_k: 1,
        hidden: 256,
        inter: 256,
        experts: 1,
    };
    let q4k = vec![0u8; 2 * 256 * QuantType::Q4_K.row_bytes(256)];
    let (x, mut out) = (vec![0.0f32; 256], vec![0.0f32; 256]);
    let w = ExpertWeights::QuantX8(QuantType::Q4_K, &q4k);
    assert!(moe_experts(w, w, &x, &[0], &[1.0], &mut out, &d, 1).is_err());
    let d = MoeDims {
        inter: 4,
        hidden: 32,
        ..d
    };
    let gu = vec![0u8; 8 * QuantType::Q8_0.row_bytes(32)];
    let dn = [0u8; 32 * 4];
    let (x, mut out) = (vec![0.0f32; 32], vec![0.0f32; 32]);
    let r = moe_experts(
        ExpertWeights::QuantX8(QuantType::Q8_0, &gu),
        ExpertWeights::F32(&dn.iter().map(|&b| b as f32).collect::<Vec<_>>()),
        &x,
        &[0],
        &[1.0],
        &mut out,
        &d,
        1,
    );
    assert!(r.is_ok(), "8 gate/up rows pack: {r:?}");
    let d = MoeDims { inter: 3, ..d };
    let gu = vec![0u8; 6 * QuantType::Q8_0.row_bytes(32)];
    let dn = vec![0.0f32; 32 * 3];
    let r = moe_experts(
        ExpertWeights::QuantX8(QuantType::Q8_0, &gu),
        ExpertWeights::F32(&dn),
        &x,
        &[0],
        &[1.0],
        &mut out,
        &d,
        1,
    );
    assert!(r.is_err(), "6 gate/up rows are not 8-row groups");
}

/// float64: as `reference`, with the experts' biases and gpt-oss's clamped SwiGLU (HF's GptOssExperts).
#[allow(clippy::too_many_arguments)]
fn reference_swiglu(
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

#[test]
fn f32_experts_with_biases_and_clamped_swiglu_match_the_float64_reference() {
    for isa in Isa::supported() {
        for &(tokens, top_k, hidden, inter, experts) in
            &[(1, 1, 16, 8, 2), (7, 2, 33, 17, 4), (20, 4, 64, 32, 8)]
        {
            let d = MoeDims {
                tokens,
                top_k,
                hidden,
                inter,
                experts,
            };
            let mut rng = Rng(0x51ed ^ (tokens * 13 + hidden) as u64);
            let gu = rng.vec(experts * 2 * inter * hidden, 0.4);
            let dn = rng.vec(experts * hidden * inter, 0.3);
            let b_gu = rng.vec(experts * 2 * inter, 0.5);
            let b_dn = rng.vec(experts * hidden, 0.5);
            let x = rng.vec(tokens * hidden, 1.0);
            let ids = random_ids(&mut rng, tokens, top_k, experts);
            let wts: Vec<f32> = (0..tokens * top_k).map(|_| rng.uniform().abs()).collect();
            // a limit the gate/up values cross, so both clamps act
            let (alpha, limit) = (1.702f32, 0.8f32);
            let epi = ExpertEpilogue {
                gate_up_bias: Some(&b_gu),
                down_bias: Some(&b_dn),
                act: ExpertAct::ClampedSwiglu { alpha, limit },
            };
            for threads in [1, 3] {
                let mut out = vec![f32::NAN; tokens * hidden];
                let (g, w) = (ExpertWeights::F32(&gu), ExpertWeights::F32(&dn));
                moe_experts_epilogue(isa, g, w, &epi, &x, &ids, &wts, &mut out, &d, threads)
                    .unwrap();
                let lim = (alpha as f64, limit as f64);
                let want = reference_swiglu(&gu, &dn, &b_gu, &b_dn, lim, &x, &ids, &wts, &d);
                assert_close(&out, &want, 1e-5, &format!("{} swiglu {d:?}", isa.name()));
            }
        }
    }
    // a bias of the wrong length is refused, naming it
    let d = MoeDims {
        tokens: 1,
        top_k: 1,
        hidden: 4,
        inter: 2,
        experts: 1,
    };
    let (gu, dn, x) = (vec![0.0; 16], vec![0.0; 8], vec![0.0; 4]);
    let short = vec![0.0; 3];
    let epi = ExpertEpilogue {
        down_bias: Some(&short),
        ..ExpertEpilogue::default()
    };
    let (g, w) = (ExpertWeights::F32(&gu), ExpertWeights::F32(&dn));
    let mut out = vec![0.0; 4];
    let err = moe_experts_epilogue(Isa::chosen(), g, w, &epi, &x, &[0], &[1.0], &mut out, &d, 1);
    assert!(format!("{}", err.unwrap_err()).contains("down_bias"));
}
