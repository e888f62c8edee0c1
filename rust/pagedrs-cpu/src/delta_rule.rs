//! The decode step of a Gated DeltaNet layer (Qwen3.5's linear attention) after its input projections: one
//! token per row, each row's state in a slot of the layer's state pools, updated in place.
//!
//! Per row, as HF transformers' torch fallbacks (`causal_conv1d_update`, `torch_recurrent_gated_delta_rule`):
//! the causal depthwise conv1d over the slot's last `kernel - 1` inputs and the new one (then SiLU; the
//! window rolls by one), split into q, k (key heads) and v (value heads); per value head (sharing key head
//! `h / (value heads / key heads)`), q and k L2-normalised (`x * rsqrt(sum x^2 + 1e-6)`), q scaled by
//! `head_k^-0.5`, `g = -exp(a_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`, and with the state
//! S [head_k, head_v]: `S *= exp(g); S += k (beta (v - S^T k))^T; out = S^T q`. In f32, up to summation order.

use crate::quant::Isa;
use crate::KernelError;

/// The shapes of one Gated DeltaNet layer (one rank's share of its heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaDims {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub head_k: usize,
    pub head_v: usize,
    /// The conv1d's kernel length (its state keeps `kernel - 1` inputs per channel).
    pub kernel: usize,
}

impl DeltaDims {
    fn key_dim(&self) -> usize {
        self.num_k_heads * self.head_k
    }

    fn value_dim(&self) -> usize {
        self.num_v_heads * self.head_v
    }

    /// q, k and v channels: the conv's width.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    fn check(&self) -> Result<(), KernelError> {
        for (name, v) in [
            ("num_k_heads", self.num_k_heads),
            ("num_v_heads", self.num_v_heads),
            ("head_k", self.head_k),
            ("head_v", self.head_v),
            ("kernel", self.kernel),
        ] {
            if v == 0 {
                return Err(KernelError::Zero { name });
            }
        }
        if self.num_v_heads % self.num_k_heads != 0 {
            return Err(KernelError::Heads {
                num_heads: self.num_v_heads,
                num_kv_heads: self.num_k_heads,
            });
        }
        Ok(())
    }
}

/// A layer's parameters: conv weight [conv_dim, kernel], a_log and dt_bias [value heads].
pub struct DeltaParams<'a> {
    pub conv_weight: &'a [f32],
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
}

/// One step's rows: the projections' outputs `qkv` [B, conv_dim], `a` and `b` [B, value heads], each row's
/// state `slots` [B] in the pools.
pub struct DeltaRows<'a> {
    pub qkv: &'a [f32],
    pub a: &'a [f32],
    pub b: &'a [f32],
    pub slots: &'a [i64],
}

/// The layer's state pools, updated in place: `conv` [slots, conv_dim, kernel - 1], `ssm` [slots, value
/// heads, head_k, head_v].
pub struct DeltaState<'a> {
    pub conv: &'a mut [f32],
    pub ssm: &'a mut [f32],
}

/// The step of every row (in row order), its output [B, value heads * head_v] into `out`; `isa` picks the
/// state update's kernels (AVX2 + FMA where given and supported, else scalar).
pub fn gated_delta_decode(
    isa: Isa,
    dims: &DeltaDims,
    params: &DeltaParams<'_>,
    rows: &DeltaRows<'_>,
    state: &mut DeltaState<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    dims.check()?;
    let (c, kk, hv) = (dims.conv_dim(), dims.kernel - 1, dims.num_v_heads);
    let n = rows.slots.len();
    KernelError::check_len("conv_weight", params.conv_weight.len(), c * dims.kernel)?;
    KernelError::check_len("a_log", params.a_log.len(), hv)?;
    KernelError::check_len("dt_bias", params.dt_bias.len(), hv)?;
    KernelError::check_len("qkv", rows.qkv.len(), n * c)?;
    KernelError::check_len("a", rows.a.len(), n * hv)?;
    KernelError::check_len("b", rows.b.len(), n * hv)?;
    KernelError::check_len("out", out.len(), n * dims.value_dim())?;
    let conv_slot = c * kk;
    let ssm_slot = hv * dims.head_k * dims.head_v;
    let num_slots = state.ssm.len() / ssm_slot;
    KernelError::check_len("ssm", state.ssm.len(), num_slots * ssm_slot)?;
    KernelError::check_len("conv", state.conv.len(), num_slots * conv_slot)?;
    for (index, &id) in rows.slots.iter().enumerate() {
        if id < 0 || id as usize >= num_slots {
            return Err(KernelError::Row {
                index,
                id,
                n: num_slots,
            });
        }
    }
    let avx2 = use_avx2(isa);
    let mut mixed = vec![0.0f32; c];
    for (r, &slot) in rows.slots.iter().enumerate() {
        let slot = slot as usize;
        let window = &mut state.conv[slot * conv_slot..(slot + 1) * conv_slot];
        conv_step(
            &rows.qkv[r * c..(r + 1) * c],
            params.conv_weight,
            window,
            kk,
            &mut mixed,
        );
        let s = &mut state.ssm[slot * ssm_slot..(slot + 1) * ssm_slot];
        let o = &mut out[r * dims.value_dim()..(r + 1) * dims.value_dim()];
        let gates = (&rows.a[r * hv..(r + 1) * hv], &rows.b[r * hv..(r + 1) * hv]);
        heads_step(dims, params, gates, &mut mixed, s, o, avx2);
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
fn use_avx2(isa: Isa) -> bool {
    isa != Isa::Portable && Isa::Avx2.is_supported()
}

#[cfg(not(target_arch = "x86_64"))]
fn use_avx2(_isa: Isa) -> bool {
    false
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn softplus(x: f32) -> f32 {
    // torch's threshold: x above 20 is returned as is
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The conv1d over each channel's window (its last `kk` inputs, then x), SiLU, into `mixed`; the window
/// rolls by one.
fn conv_step(x: &[f32], weight: &[f32], window: &mut [f32], kk: usize, mixed: &mut [f32]) {
    let k = kk + 1;
    for (ch, (&xc, m)) in x.iter().zip(mixed.iter_mut()).enumerate() {
        let w = &weight[ch * k..(ch + 1) * k];
        let win = &mut window[ch * kk..(ch + 1) * kk];
        let mut acc = 0.0f32;
        for j in 0..kk {
            acc += win[j] * w[j];
        }
        acc += xc * w[kk];
        if kk > 0 {
            win.copy_within(1.., 0);
            win[kk - 1] = xc;
        }
        *m = silu(acc);
    }
}

fn l2_normalize(x: &mut [f32], scale: f32) {
    let sum: f32 = x.iter().map(|v| v * v).sum();
    let inv = scale / (sum + 1e-6).sqrt();
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Every value head's delta-rule step on the conv's output `mixed` ([q | k | v]; q and k normalised in
/// place), the head's state in `s`, output into `out`.
fn heads_step(
    dims: &DeltaDims,
    params: &DeltaParams<'_>,
    (a, b): (&[f32], &[f32]),
    mixed: &mut [f32],
    s: &mut [f32],
    out: &mut [f32],
    avx2: bool,
) {
    let (dk, dv, kd) = (dims.head_k, dims.head_v, dims.key_dim());
    let (q, rest) = mixed.split_at_mut(kd);
    let (k, v) = rest.split_at_mut(kd);
    let scale = (dk as f32).powf(-0.5);
    for (qh, kh) in q.chunks_exact_mut(dk).zip(k.chunks_exact_mut(dk)) {
        l2_normalize(qh, scale);
        l2_normalize(kh, 1.0);
    }
    let ratio = dims.num_v_heads / dims.num_k_heads;
    let mut delta = vec![0.0f32; dv];
    for h in 0..dims.num_v_heads {
        let key = h / ratio;
        let (qh, kh) = (&q[key * dk..(key + 1) * dk], &k[key * dk..(key + 1) * dk]);
        let g = -params.a_log[h].exp() * softplus(a[h] + params.dt_bias[h]);
        let beta = 1.0 / (1.0 + (-b[h]).exp());
        let sh = &mut s[h * dk * dv..(h + 1) * dk * dv];
        let oh = &mut out[h * dv..(h + 1) * dv];
        let vh = &v[h * dv..(h + 1) * dv];
        head_step(sh, qh, kh, vh, g.exp(), beta, &mut delta, oh, avx2);
    }
}

/// One head: S *= decay; delta = beta (v - S^T k); S += k delta^T; out = S^T q.
#[allow(clippy::too_many_arguments)]
fn head_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    decay: f32,
    beta: f32,
    delta: &mut [f32],
    out: &mut [f32],
    avx2: bool,
) {
    let dv = v.len();
    delta.fill(0.0);
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        scale_axpy(row, decay, ki, delta, avx2);
    }
    for (d, &vi) in delta.iter_mut().zip(v) {
        *d = (vi - *d) * beta;
    }
    out.fill(0.0);
    for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(k).zip(q) {
        add_axpy(row, ki, delta, qi, out, avx2);
    }
}

/// row *= decay; acc += ki * row.
fn scale_axpy(row: &mut [f32], decay: f32, ki: f32, acc: &mut [f32], avx2: bool) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2 and FMA detected (`use_avx2`).
        #[allow(unsafe_code)]
        unsafe {
            avx2::scale_axpy(row, decay, ki, acc)
        };
        return;
    }
    let _ = avx2;
    for (r, a) in row.iter_mut().zip(acc.iter_mut()) {
        *r *= decay;
        *a += ki * *r;
    }
}

/// row += ki * delta; out += qi * row.
fn add_axpy(row: &mut [f32], ki: f32, delta: &[f32], qi: f32, out: &mut [f32], avx2: bool) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2 and FMA detected (`use_avx2`).
        #[allow(unsafe_code)]
        unsafe {
            avx2::add_axpy(row, ki, delta, qi, out)
        };
        return;
    }
    let _ = avx2;
    for ((r, &d), o) in row.iter_mut().zip(delta).zip(out.iter_mut()) {
        *r += ki * d;
        *o += qi * *r;
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scale_axpy(row: &mut [f32], decay: f32, ki: f32, acc: &mut [f32]) {
        let n = row.len().min(acc.len());
        let (vd, vk) = (_mm256_set1_ps(decay), _mm256_set1_ps(ki));
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, both slices at least n long.
            let r = _mm256_mul_ps(_mm256_loadu_ps(row.as_ptr().add(i)), vd);
            _mm256_storeu_ps(row.as_mut_ptr().add(i), r);
            let a = _mm256_fmadd_ps(vk, r, _mm256_loadu_ps(acc.as_ptr().add(i)));
            _mm256_storeu_ps(acc.as_mut_ptr().add(i), a);
            i += 8;
        }
        for j in i..n {
            row[j] *= decay;
            acc[j] += ki * row[j];
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn add_axpy(
        row: &mut [f32],
        ki: f32,
        delta: &[f32],
        qi: f32,
        out: &mut [f32],
    ) {
        let n = row.len().min(delta.len()).min(out.len());
        let (vk, vq) = (_mm256_set1_ps(ki), _mm256_set1_ps(qi));
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, every slice at least n long.
            let d = _mm256_loadu_ps(delta.as_ptr().add(i));
            let r = _mm256_fmadd_ps(vk, d, _mm256_loadu_ps(row.as_ptr().add(i)));
            _mm256_storeu_ps(row.as_mut_ptr().add(i), r);
            let o = _mm256_fmadd_ps(vq, r, _mm256_loadu_ps(out.as_ptr().add(i)));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), o);
            i += 8;
        }
        for j in i..n {
            row[j] += ki * delta[j];
            out[j] += qi * row[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(seed: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// Every supported ISA gives the portable kernels' outputs and states, within 1e-5, over odd shapes,
    /// three steps, rows in slots 2 and 0 of three.
    #[test]
    fn every_isa_matches_portable() {
        let dims = DeltaDims {
            num_k_heads: 1,
            num_v_heads: 3,
            head_k: 5,
            head_v: 11,
            kernel: 4,
        };
        let mut seed = 7;
        let c = dims.conv_dim();
        let w = rand(&mut seed, c * 4);
        let (a_log, dt) = (rand(&mut seed, 3), rand(&mut seed, 3));
        let params = DeltaParams {
            conv_weight: &w,
            a_log: &a_log,
            dt_bias: &dt,
        };
        let slots = [2i64, 0];
        let steps: Vec<_> = (0..3)
            .map(|_| {
                (
                    rand(&mut seed, 2 * c),
                    rand(&mut seed, 6),
                    rand(&mut seed, 6),
                )
            })
            .collect();
        let run = |isa: Isa| {
            let mut conv = vec![0.1f32; 3 * c * 3];
            let mut ssm = vec![0.05f32; 3 * 3 * 5 * 11];
            let mut outs = Vec::new();
            for (qkv, a, b) in &steps {
                let rows = DeltaRows {
                    qkv,
                    a,
                    b,
                    slots: &slots,
                };
                let mut out = vec![0.0f32; 2 * 33];
                let mut st = DeltaState {
                    conv: &mut conv,
                    ssm: &mut ssm,
                };
                gated_delta_decode(isa, &dims, &params, &rows, &mut st, &mut out).unwrap();
                outs.extend(out);
            }
            (outs, conv, ssm)
        };
        let want = run(Isa::Portable);
        assert!(want.0.iter().any(|v| v.abs() > 1e-3));
        for isa in Isa::supported() {
            let got = run(isa);
            for (x, y) in [(&got.0, &want.0), (&got.1, &want.1), (&got.2, &want.2)] {
                assert!(
                    x.iter().zip(y).all(|(a, b)| (a - b).abs() <= 1e-5),
                    "{isa:?}"
                );
            }
        }
    }

    #[test]
    fn bad_slot_and_heads_are_errors() {
        let mut dims = DeltaDims {
            num_k_heads: 1,
            num_v_heads: 1,
            head_k: 2,
            head_v: 2,
            kernel: 2,
        };
        let c = dims.conv_dim();
        let w = vec![0.0; c * 2];
        let one = [0.0f32];
        let params = DeltaParams {
            conv_weight: &w,
            a_log: &one,
            dt_bias: &one,
        };
        let qkv = vec![0.0; c];
        let rows = DeltaRows {
            qkv: &qkv,
            a: &one,
            b: &one,
            slots: &[1],
        };
        let (mut conv, mut ssm, mut out) = (vec![0.0; c], vec![0.0; 4], vec![0.0; 2]);
        let mut st = DeltaState {
            conv: &mut conv,
            ssm: &mut ssm,
        };
        let err = gated_delta_decode(Isa::Portable, &dims, &params, &rows, &mut st, &mut out);
        assert_eq!(
            err,
            Err(KernelError::Row {
                index: 0,
                id: 1,
                n: 1
            })
        );
        dims.num_k_heads = 2;
        let err = gated_delta_decode(Isa::Portable, &dims, &params, &rows, &mut st, &mut out);
        assert!(matches!(err, Err(KernelError::Heads { .. })));
    }
}
