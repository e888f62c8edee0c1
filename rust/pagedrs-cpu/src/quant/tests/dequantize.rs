//! The GGUF formats: dequantization against ggml's loops, type ids, scales, f16.

use super::helpers::*;
use crate::quant::*;

#[test]
fn dequantize_matches_ggml_loops() {
    let mut rng = Rng(7);
    for qt in QuantType::ALL {
        let k = 3 * qt.block_len();
        let w = random_weights(qt, 5, k, &mut rng);
        let rb = qt.row_bytes(k);
        for row in w.chunks_exact(rb) {
            let mut got = vec![0.0f32; k];
            dequantize_row(qt, row, &mut got);
            let want = reference_dequantize(qt, row, k);
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - e).abs() <= 1e-6 * e.abs().max(1e-3),
                    "{} [{i}]: {g} vs {e}",
                    qt.name()
                );
            }
        }
    }
}

#[test]
fn type_ids_round_trip() {
    for qt in QuantType::ALL {
        assert_eq!(QuantType::from_ggml_id(qt.ggml_id()), Some(qt));
    }
    for unsupported in [0, 1, 9, 15, 16, 21, 22, 30] {
        assert_eq!(QuantType::from_ggml_id(unsupported), None);
    }
}

/// Q3_K scale `i` decoded bit by bit from the block's 12 scale bytes, minus 32.
fn scale_q3_k(i: usize, sc: &[u8]) -> i8 {
    let lo = if i < 8 { sc[i] & 0x0f } else { sc[i - 8] >> 4 };
    let hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
    (lo | (hi << 4)) as i8 - 32
}

#[test]
fn q3_k_scales_unpack_alike_one_by_one_and_by_kmask() {
    let mut rng = Rng(5);
    for _ in 0..64 {
        let sc: Vec<u8> = (0..12).map(|_| rng.next() as u8).collect();
        let all = formats::scales_q3_k(&sc);
        for (i, &s) in all.iter().enumerate() {
            assert_eq!(s, scale_q3_k(i, &sc), "{sc:?} [{i}]");
            assert!((-32..32).contains(&s));
        }
    }
}

#[test]
fn e8m0_scales_are_ggmls_halved_powers_of_two() {
    // ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128), the two smallest as subnormals, 255 not NaN
    for e in 0..=255u8 {
        let want = 2f64.powi(i32::from(e) - 128);
        assert_eq!(f64::from(formats::e8m0_half(e)), want, "e = {e}");
    }
    assert_eq!(formats::e8m0_half(127), 0.5);
    assert_eq!(formats::e8m0_half(0).to_bits(), 0x0020_0000);
}

#[test]
fn mxfp4_with_the_smallest_exponents_matches_reference() {
    // e8m0 bytes 0 and 1 are the subnormal scales 2^-128 and 2^-127 (with 2 and 3 beside them): large
    // activations keep the outputs normal, so the comparison is relative, on every row group and ISA.
    let qt = QuantType::MXFP4;
    let mut rng = Rng(23);
    let (n, k) = (5, 96);
    let mut w = random_weights(qt, n, k, &mut rng);
    for block in w.chunks_exact_mut(qt.block_bytes()) {
        block[0] = (rng.next() % 4) as u8;
    }
    for m in [1, 3, 9] {
        let x: Vec<f32> = (0..m * k).map(|_| 1e30 * rng.uniform()).collect();
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
            for ((&got, &e), &s) in out.iter().zip(&want).zip(&mag) {
                assert!(s > 1e-30, "{s}");
                assert!(
                    (f64::from(got) - e).abs() <= 1e-5 * s,
                    "{isa:?} m{m}: {got} vs {e} (scale {s})"
                );
            }
        }
    }
}

#[test]
fn f16_decoding() {
    for (bits, want) in [
        (0x3c00u16, 1.0f32),
        (0xc000, -2.0),
        (0x3555, 0.333_251_95),
        (0x0001, 5.960_464_5e-8),
        (0x7bff, 65504.0),
        (0x0000, 0.0),
    ] {
        assert_eq!(f16_to_f32(bits), want, "{bits:#06x}");
    }
    assert!(f16_to_f32(0x7c00).is_infinite());
    assert!(f16_to_f32(0x7e00).is_nan());
}
