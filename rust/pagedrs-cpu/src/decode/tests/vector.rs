//! The AVX2 exp and tanh (x86-64 only) against f64.

use super::helpers::*;
use crate::decode::*;

#[cfg(target_arch = "x86_64")]
#[test]
fn vector_exp_is_within_a_few_ulp() {
    if !uses_avx2(Isa::detect()) {
        return;
    }
    let mut rng = Rng(3);
    let mut xs: Vec<f32> = (0..4003)
        .map(|_| -87.0 * (rng.next() + 1.0) / 2.0)
        .collect();
    xs.extend([0.0, -1e-30, -0.5, -1.0, -20.0, -87.0]);
    let mut got = xs.clone();
    // SAFETY: AVX2 and FMA detected above.
    #[allow(unsafe_code)]
    let sum = unsafe { avx2::exp_shifted(&mut got, 0.0) };
    let mut want_sum = 0.0f64;
    for (&x, &g) in xs.iter().zip(&got) {
        let want = f64::from(x).exp();
        want_sum += want;
        assert!(
            ((f64::from(g) - want) / want).abs() < 4e-7,
            "exp({x}) = {g}, want {want}"
        );
    }
    assert!((f64::from(sum) - want_sum).abs() <= 1e-6 * want_sum);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vector_tanh_is_within_a_few_ulp() {
    if !uses_avx2(Isa::detect()) {
        return;
    }
    let mut rng = Rng(4);
    let mut xs: Vec<f32> = (0..4003).map(|_| 12.0 * rng.next()).collect();
    xs.extend((0..2000).map(|_| 0.7 * rng.next()));
    xs.extend([
        0.0, -0.0, 1e-30, -1e-8, 0.625, -0.625, 0.6249, 9.0, -9.0, 100.0, -1e30,
    ]);
    let mut got = xs.clone();
    // SAFETY: AVX2 and FMA detected above.
    #[allow(unsafe_code)]
    unsafe {
        avx2::soft_cap(&mut got, 1.0)
    };
    for (&x, &g) in xs.iter().zip(&got) {
        let want = f64::from(x).tanh();
        let tol = 4.0 * f64::from(f32::EPSILON) * want.abs().max(f64::from(f32::MIN_POSITIVE));
        assert!(
            (f64::from(g) - want).abs() <= tol,
            "tanh({x}) = {g}, want {want}"
        );
    }
}
