//! Every type against a reference written straight from ggml's `dequantize_row_*` loops (test-only code,
//! independent of the sub-block decoder), on random blocks, odd shapes and tails.

use super::*;

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
}

/// f32 -> f16 bits for normal values (mantissa truncated): enough to write block scales.
fn f16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    assert!((1..31).contains(&exp), "{v} is not a normal f16");
    sign | ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16
}

/// Byte offsets of the f16 fields of a block (scales and mins).
fn half_fields(qt: QuantType) -> &'static [usize] {
    match qt {
        QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => &[0],
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
        QuantType::Q6_K => &[208],
        QuantType::MXFP4 => &[],
    }
}

/// Byte offsets of a block's one-byte scales (MXFP4's e8m0 exponent).
fn byte_fields(qt: QuantType) -> &'static [usize] {
    if qt == QuantType::MXFP4 {
        &[0]
    } else {
        &[]
    }
}

/// `n` rows of `k` weights: random bytes with finite, moderate f16 scales written over the scale fields.
fn random_weights(qt: QuantType, n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
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

fn h(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// ggml's dequantization, loop for loop.
fn reference_dequantize(qt: QuantType, row: &[u8], k: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; k];
    for (blk, x) in row.chunks_exact(qt.block_bytes()).enumerate() {
        let y = &mut y[blk * qt.block_len()..][..qt.block_len()];
        match qt {
            QuantType::Q4_0 | QuantType::Q4_1 => {
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
            QuantType::Q5_0 | QuantType::Q5_1 => {
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
            QuantType::Q8_0 => {
                let d = h(x, 0);
                for j in 0..32 {
                    y[j] = f32::from(x[2 + j] as i8) * d;
                }
            }
            QuantType::Q4_K | QuantType::Q5_K => {
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
            QuantType::Q6_K => {
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
            QuantType::MXFP4 => {
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
        }
    }
    y
}

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
    for unsupported in [0, 1, 9, 10, 11, 15, 16, 30] {
        assert_eq!(QuantType::from_ggml_id(unsupported), None);
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

#[test]
fn activation_blocks_round_trip() {
    let mut rng = Rng(3);
    let x: Vec<f32> = (0..96).map(|_| 4.0 * rng.uniform()).collect();
    let acts = QuantizedActs::new(&x, 1, 96);
    for b in 0..3 {
        let block = &x[32 * b..][..32];
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!((acts.d[b] - amax / 127.0).abs() <= 1e-7);
        let sum: i32 = acts.qs[32 * b..][..32].iter().map(|&q| i32::from(q)).sum();
        assert!((acts.s[b] - acts.d[b] * sum as f32).abs() <= 1e-5);
        for (i, &v) in block.iter().enumerate() {
            let back = acts.d[b] * f32::from(acts.qs[32 * b + i]);
            assert!((back - v).abs() <= acts.d[b] * 0.5 + 1e-6);
        }
    }
}

#[test]
fn activation_quantizers_agree_bit_for_bit() {
    let mut rng = Rng(11);
    let k = 32 * 24;
    let mut x: Vec<f32> = (0..3 * k).map(|_| 6.0 * rng.uniform() - 3.0).collect();
    // ties: a block whose scale is exactly 1 (max 127), values halfway between integers, both signs
    for (i, v) in x[..32].iter_mut().enumerate() {
        *v = if i == 0 { 127.0 } else { i as f32 - 15.5 };
    }
    x[32..64].fill(0.0); // an all-zero block: scale 0
    x[64..96].iter_mut().for_each(|v| *v *= 1e-30); // tiny values
    let portable = QuantizedActs::new_with(Isa::Portable, &x, 3, k);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for isa in isas() {
        let got = QuantizedActs::new_with(isa, &x, 3, k);
        assert_eq!(portable.qs, got.qs, "{isa:?}");
        assert_eq!(bits(&portable.d), bits(&got.d), "{isa:?}");
        assert_eq!(bits(&portable.s), bits(&got.s), "{isa:?}");
    }
    assert_eq!(portable.qs[1], -14); // -14.5 rounds to the even -14
    assert_eq!(portable.qs[2], -14); // -13.5 too
    assert!(portable.qs[32..64].iter().all(|&q| q == 0) && portable.d[1] == 0.0);
}

/// f64 `x_q @ W^T` with x_q the dequantized 8-bit activations and W from the reference dequantizer:
/// what the integer kernels compute up to f32 rounding. Also returns sum |x_q| |W| per output (the
/// scale of the rounding error).
fn reference_matmul(
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
fn isas() -> Vec<Isa> {
    Isa::supported()
}

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

// ---- The x8 layout --------------------------------------------------------------------------------------

const X8_TYPES: [QuantType; 3] = [QuantType::Q4_0, QuantType::Q4_1, QuantType::Q8_0];

#[test]
fn x8_pack_round_trips_and_only_takes_what_it_can_lay_out() {
    let mut rng = Rng(23);
    for qt in X8_TYPES {
        let (n, k) = (24, 5 * 32);
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
    let w = random_weights(QuantType::Q4_K, 8, 256, &mut rng);
    assert!(matches!(
        x8::pack(QuantType::Q4_K, &w, 8, 256),
        Err(KernelError::Packing { qtype: "Q4_K", .. })
    ));
}

#[test]
fn x8_matmul_matches_reference_and_is_the_same_bits_on_every_isa_and_batch() {
    let mut rng = Rng(29);
    for qt in X8_TYPES {
        for &(n, kb) in &[(8, 1), (16, 3), (40, 18), (64, 2)] {
            let (k, rows) = (kb * 32, 9);
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
