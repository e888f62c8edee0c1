//! The x8 layout: packing, and its matmul against the reference and the other kernels.

use super::helpers::*;
use crate::quant::*;

const X8_TYPES: [QuantType; 8] = [
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q8_0,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q4_K,
    QuantType::Q5_K,
    QuantType::Q6_K,
];

#[test]
fn x8_pack_round_trips_and_only_takes_what_it_can_lay_out() {
    let mut rng = Rng(23);
    for qt in X8_TYPES {
        let (n, k) = (24, 3 * 256);
        let w = random_weights(qt, n, k, &mut rng);
        let packed = x8::pack(qt, &w, n, k).unwrap();
        assert_eq!(packed.len(), w.len());
        assert_ne!(packed, w);
        let rb = qt.row_bytes(k);
        let mut row = vec![0u8; rb];
        for r in 0..n {
            x8::unpack_row(qt, &packed, k, r, &mut row);
            assert_eq!(row, w[r * rb..][..rb], "{} row {r}", qt.name());
        }
        // dequantized rows of the packed form are those of the GGUF form
        let ids: Vec<i64> = vec![0, 23, 7, 8, 7];
        let (mut a, mut b) = (vec![0.0f32; ids.len() * k], vec![0.0f32; ids.len() * k]);
        quant_get_rows(qt, &w, n, k, &ids, &mut a).unwrap();
        quant_get_rows_x8(qt, &packed, n, k, &ids, &mut b).unwrap();
        assert_eq!(a, b);
        assert!(matches!(
            quant_get_rows_x8(qt, &packed, n, k, &[24], &mut b[..k]),
            Err(KernelError::Row { id: 24, .. })
        ));
    }
    let w = random_weights(QuantType::Q4_1, 12, 32, &mut rng);
    assert_eq!(
        x8::pack(QuantType::Q4_1, &w, 12, 32),
        Err(KernelError::Packing {
            qtype: "Q4_1",
            n: 12
        })
    );
    let w = random_weights(QuantType::MXFP4, 8, 256, &mut rng);
    assert!(matches!(
        x8::pack(QuantType::MXFP4, &w, 8, 256),
        Err(KernelError::Packing { qtype: "MXFP4", .. })
    ));
}

#[test]
fn x8_matmul_matches_reference_and_is_the_same_bits_on_every_isa_and_batch() {
    let mut rng = Rng(29);
    for qt in X8_TYPES {
        for &(n, kb) in &[(8, 1), (16, 3), (40, 18), (64, 2)] {
            let (k, rows) = (kb * qt.block_len(), 9);
            let w = random_weights(qt, n, k, &mut rng);
            let packed = x8::pack(qt, &w, n, k).unwrap();
            let x: Vec<f32> = (0..rows * k).map(|_| 2.0 * rng.uniform()).collect();
            let (want, mag) = reference_matmul(qt, &w, &x, rows, k);
            let run = |isa: Isa, start: usize, m: usize, threads: usize| {
                // columns 3..3+n of wider rows; the others must stay untouched
                let ldo = n + 5;
                let mut out = vec![f32::NAN; m * ldo];
                let dims = MatmulDims {
                    m,
                    k,
                    n,
                    ldo,
                    col0: 3,
                };
                let xs = &x[start * k..(start + m) * k];
                quant_matmul_x8_with(isa, qt, &packed, xs, &mut out, &dims, threads).unwrap();
                for i in 0..m {
                    for c in (0..3).chain(3 + n..ldo) {
                        assert!(out[i * ldo + c].is_nan(), "{} wrote column {c}", qt.name());
                    }
                }
                (0..m)
                    .flat_map(|i| out[i * ldo + 3..][..n].to_vec())
                    .collect::<Vec<f32>>()
            };
            let full = run(Isa::Portable, 0, rows, 1);
            for (at, (&got, (&e, &s))) in full.iter().zip(want.iter().zip(&mag)).enumerate() {
                assert!(
                    (f64::from(got) - e).abs() <= 1e-5 * s + 1e-6,
                    "{} n{n} k{k} [{}, {}]: {got} vs {e}",
                    qt.name(),
                    at / n,
                    at % n
                );
            }
            for isa in isas() {
                for threads in [1, 2, 3] {
                    for (start, m) in [
                        (0, rows),
                        (0, 1),
                        (4, 1),
                        (2, 2),
                        (5, 3),
                        (2, 4),
                        (1, 5),
                        (3, 6),
                    ] {
                        let part = run(isa, start, m, threads);
                        let same = part
                            .iter()
                            .zip(&full[start * n..])
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{} {isa:?} n{n} k{k} t{threads} rows {start}+{m}",
                            qt.name()
                        );
                    }
                }
            }
        }
    }
}
