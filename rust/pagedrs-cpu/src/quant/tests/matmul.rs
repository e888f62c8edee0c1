//! `quant_matmul` and `quant_get_rows` against the references, on every kernel set this CPU runs.

use super::helpers::*;
use crate::quant::*;

#[test]
fn the_detected_isa_is_the_best_supported_one() {
    let all = Isa::supported();
    assert_eq!(all[0], Isa::Portable);
    assert_eq!(all.last(), Some(&Isa::detect()));
    for isa in all {
        assert!(isa.is_supported(), "{}", isa.name());
    }
    for isa in Isa::supported() {
        assert_eq!(Isa::by_name(isa.name()), Some(isa));
    }
    assert_eq!(Isa::by_name("avx1024"), None);
    // Kernels this CPU lacks give way to the nearest ones below.
    let best = Isa::detect();
    for name in ["avx512-vnni", "avx2", "neon-dotprod", "neon"] {
        if let Some(isa) = Isa::by_name(name) {
            let got = isa.or_supported();
            assert!(got.is_supported());
            assert_eq!(got == isa, isa.is_supported(), "{name}");
        }
    }
    assert_eq!(best.or_supported(), best);
    assert_eq!(Isa::Portable.or_supported(), Isa::Portable);
    // `.ci/aarch64` names the kernels each emulated CPU must select
    if let Ok(want) = std::env::var("PAGEDRS_EXPECT_ISA") {
        assert_eq!(Isa::detect().name(), want);
    }
}

#[test]
fn matmul_matches_reference_on_odd_shapes() {
    let mut rng = Rng(11);
    for qt in QuantType::ALL {
        let bl = qt.block_len();
        for &(m, n, kb) in &[
            (1, 1, 1),
            (1, 37, 2),
            (3, 17, 3),
            (4, 33, 1),
            (5, 16, 2),
            (9, 5, 2),
        ] {
            let k = kb * bl;
            let w = random_weights(qt, n, k, &mut rng);
            let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
            let (want, mag) = reference_matmul(qt, &w, &x, m, k);
            for isa in isas() {
                for threads in [1, 2, 3] {
                    // Written into columns 2..2+n of wider rows; the others must stay untouched.
                    let ldo = n + 3;
                    let mut out = vec![f32::NAN; m * ldo];
                    let dims = MatmulDims {
                        m,
                        k,
                        n,
                        ldo,
                        col0: 2,
                    };
                    quant_matmul_with(isa, qt, &w, &x, &mut out, &dims, threads).unwrap();
                    for i in 0..m {
                        for c in 0..ldo {
                            let got = out[i * ldo + c];
                            if !(2..2 + n).contains(&c) {
                                assert!(got.is_nan(), "{} wrote column {c}", qt.name());
                                continue;
                            }
                            let (e, s) = (want[i * n + c - 2], mag[i * n + c - 2]);
                            assert!(
                                (f64::from(got) - e).abs() <= 1e-5 * s + 1e-6,
                                "{} {isa:?} m{m} n{n} k{k} t{threads} [{i},{c}]: {got} vs {e}",
                                qt.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn row_groups_and_block_tails_match_reference() {
    // Every activation row count splits into groups of 8 / 4 / 2 / 1 rows (m = 13 runs 8 + 4 + 1), and
    // every block count leaves a different tail of the 8 units the block-group kernels sum at once.
    let mut rng = Rng(13);
    for qt in QuantType::ALL {
        let bl = qt.block_len();
        for m in [1, 2, 3, 5, 6, 7, 8, 9, 13] {
            for kb in [1, 3, 5, 8, 18] {
                if bl > 32 && kb > 3 {
                    continue;
                }
                let (n, k) = (7, kb * bl);
                let w = random_weights(qt, n, k, &mut rng);
                let x: Vec<f32> = (0..m * k).map(|_| 2.0 * rng.uniform()).collect();
                let (want, mag) = reference_matmul(qt, &w, &x, m, k);
                for isa in isas() {
                    let mut out = vec![f32::NAN; m * n];
                    let dims = MatmulDims {
                        m,
                        k,
                        n,
                        ldo: n,
                        col0: 0,
                    };
                    quant_matmul_with(isa, qt, &w, &x, &mut out, &dims, 1).unwrap();
                    for (at, (&got, (&e, &s))) in out.iter().zip(want.iter().zip(&mag)).enumerate()
                    {
                        assert!(
                            (f64::from(got) - e).abs() <= 1e-5 * s + 1e-6,
                            "{} {isa:?} m{m} k{k} [{}, {}]: {got} vs {e}",
                            qt.name(),
                            at / n,
                            at % n
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn rows_are_bit_identical_whatever_the_batch() {
    // Greedy speculative decoding compares a sequence's verification rows with its one-row decode: a
    // row's outputs must not depend on the row group it lands in (8 / 4 / 2 / 1) or on its place.
    let mut rng = Rng(19);
    for qt in QuantType::ALL {
        for kb in [1, 3, 9, 18] {
            if qt.block_len() > 32 && kb > 3 {
                continue;
            }
            let (n, k, rows) = (5, kb * qt.block_len(), 13);
            let w = random_weights(qt, n, k, &mut rng);
            let x: Vec<f32> = (0..rows * k).map(|_| 2.0 * rng.uniform()).collect();
            for isa in isas() {
                let run = |start: usize, m: usize| {
                    let mut out = vec![0.0f32; m * n];
                    let dims = MatmulDims {
                        m,
                        k,
                        n,
                        ldo: n,
                        col0: 0,
                    };
                    let x = &x[start * k..(start + m) * k];
                    quant_matmul_with(isa, qt, &w, x, &mut out, &dims, 2).unwrap();
                    out
                };
                let full = run(0, rows);
                for m in 1..=rows {
                    for start in 0..=rows - m {
                        let part = run(start, m);
                        for (i, (a, b)) in part.iter().zip(&full[start * n..]).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{} {isa:?} k{k} m{m} start{start} [{i}]",
                                qt.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn extreme_weights_do_not_overflow_the_integer_sums() {
    // All-maximal weights and activations of one sign: the largest integer partial sums each kernel
    // forms (the 16-bit tree sums of the 4- and 5-bit types, Q8_0's -128 weights).
    for qt in QuantType::ALL {
        let (m, n, k) = (8, 8, 2 * qt.block_len());
        let mut w = random_weights(qt, n, k, &mut Rng(17));
        for block in w.chunks_exact_mut(qt.block_bytes()) {
            let fields = half_fields(qt);
            for (i, byte) in block.iter_mut().enumerate() {
                let field = fields.iter().any(|&at| i == at || i == at + 1);
                if !field && !byte_fields(qt).contains(&i) {
                    *byte = if qt == QuantType::Q8_0 { 0x80 } else { 0xff };
                }
            }
        }
        for sign in [1.0f32, -1.0] {
            let x = vec![sign; m * k];
            let (want, mag) = reference_matmul(qt, &w, &x, m, k);
            for isa in isas() {
                let mut out = vec![0.0f32; m * n];
                let dims = MatmulDims {
                    m,
                    k,
                    n,
                    ldo: n,
                    col0: 0,
                };
                quant_matmul_with(isa, qt, &w, &x, &mut out, &dims, 1).unwrap();
                let mut outs = vec![("file", out)];
                if x8::packs(qt) {
                    // the x8 kernel's 16-bit sums of 8 `maddubs` lanes
                    let packed = x8::pack(qt, &w, n, k).unwrap();
                    let mut out = vec![0.0f32; m * n];
                    quant_matmul_x8_with(isa, qt, &packed, &x, &mut out, &dims, 1).unwrap();
                    outs.push(("x8", out));
                }
                for (layout, out) in outs {
                    for ((&got, &e), &s) in out.iter().zip(&want).zip(&mag) {
                        assert!(
                            (f64::from(got) - e).abs() <= 1e-5 * s + 1e-6,
                            "{} {layout} {isa:?}: {got} vs {e}",
                            qt.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_is_close_to_float_activations() {
    // The 8-bit activations cost well under 1% against float32 x times the dequantized weights.
    let mut rng = Rng(5);
    for qt in QuantType::ALL {
        let (m, n, k) = (2, 8, 512);
        let w = random_weights(qt, n, k, &mut rng);
        let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
        let mut out = vec![0.0f32; m * n];
        let dims = MatmulDims {
            m,
            k,
            n,
            ldo: n,
            col0: 0,
        };
        quant_matmul(qt, &w, &x, &mut out, &dims, 2).unwrap();
        for i in 0..m {
            for j in 0..n {
                let wr = reference_dequantize(qt, &w[j * qt.row_bytes(k)..][..qt.row_bytes(k)], k);
                let (mut e, mut s) = (0.0f64, 0.0f64);
                for (a, b) in x[i * k..][..k].iter().zip(&wr) {
                    e += f64::from(*a) * f64::from(*b);
                    s += (f64::from(*a) * f64::from(*b)).abs();
                }
                let got = f64::from(out[i * n + j]);
                assert!(
                    (got - e).abs() <= 0.01 * s,
                    "{}: {got} vs {e} (scale {s})",
                    qt.name()
                );
            }
        }
    }
}

#[test]
fn get_rows_dequantizes_the_chosen_rows() {
    let mut rng = Rng(9);
    for qt in QuantType::ALL {
        let (n, k) = (6, 2 * qt.block_len());
        let w = random_weights(qt, n, k, &mut rng);
        let ids = [4i64, 0, 4, 5];
        let mut out = vec![0.0f32; ids.len() * k];
        quant_get_rows(qt, &w, n, k, &ids, &mut out).unwrap();
        let rb = qt.row_bytes(k);
        for (i, &id) in ids.iter().enumerate() {
            let want = reference_dequantize(qt, &w[id as usize * rb..][..rb], k);
            for (g, e) in out[i * k..][..k].iter().zip(&want) {
                assert!((g - e).abs() <= 1e-6 * e.abs().max(1e-3));
            }
        }
        let bad = quant_get_rows(qt, &w, n, k, &[6], &mut out[..k]);
        assert_eq!(bad, Err(KernelError::Row { index: 0, id: 6, n }));
    }
}

#[test]
fn bad_shapes_are_errors() {
    let qt = QuantType::Q4_1;
    let w = vec![0u8; 2 * qt.row_bytes(64)];
    let x = vec![0.0f32; 64];
    let mut out = vec![0.0f32; 2];
    let dims = |k, ldo, col0| MatmulDims {
        m: 1,
        k,
        n: 2,
        ldo,
        col0,
    };
    assert!(matches!(
        quant_matmul(qt, &w, &x, &mut out, &dims(48, 2, 0), 1),
        Err(KernelError::BlockLen { k: 48, .. })
    ));
    assert!(matches!(
        quant_matmul(qt, &w, &x, &mut out, &dims(64, 2, 1), 1),
        Err(KernelError::Columns { .. })
    ));
    assert!(matches!(
        quant_matmul(qt, &w[1..], &x, &mut out, &dims(64, 2, 0), 1),
        Err(KernelError::Length { name: "weight", .. })
    ));
    assert!(quant_matmul(qt, &w, &x, &mut out, &dims(64, 2, 0), 1).is_ok());
}
