//! The quantized activations: round trip, and every quantizer's bits.

use super::helpers::*;
use crate::quant::*;

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
