//! Float32 experts against the float64 reference, routing edge cases, biases and clamped SwiGLU, and
//! the argument checks.

use super::helpers::*;
use crate::moe::*;

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
