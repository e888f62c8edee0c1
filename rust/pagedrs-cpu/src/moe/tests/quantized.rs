//! Quantized experts, plain and in the x8 layout, against the dense kernels and the float64 reference.

use super::helpers::*;
use crate::moe::*;

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
}

/// 40 rows of one expert (the 4-row steps over many groups) against the float64 reference.
#[test]
fn packed_experts_with_many_rows_of_one_expert_match_the_float64_reference() {
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
}

/// A type without the layout, and rows off the 8-row groups, are errors.
#[test]
fn packed_experts_of_other_types_or_rows_off_the_groups_are_errors() {
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
