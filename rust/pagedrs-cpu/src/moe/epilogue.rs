//! What an expert does around its two matmuls besides them: the projections' biases and the activation
//! between them (SiLU-gated, or gpt-oss's clamped SwiGLU as HF's `GptOssExperts._apply_gate`).

use super::SortedPairs;
use crate::KernelError;

/// The activation between an expert's gate/up and down projections.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum ExpertAct {
    /// `silu(gate) * up` (Mixtral, Qwen).
    #[default]
    SiluMul,
    /// gpt-oss: gate clamped to at most `limit`, up to `[-limit, limit]`, then
    /// `(up + 1) * gate * sigmoid(alpha * gate)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

/// The experts' biases (`gate_up` `[E, 2I]`, gate then up; `down` `[E, H]`) and activation.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExpertEpilogue<'a> {
    pub gate_up_bias: Option<&'a [f32]>,
    pub down_bias: Option<&'a [f32]>,
    pub act: ExpertAct,
}

impl ExpertEpilogue<'_> {
    pub(super) fn check(
        &self,
        experts: usize,
        inter: usize,
        hidden: usize,
    ) -> Result<(), KernelError> {
        if let Some(b) = self.gate_up_bias {
            KernelError::check_len("gate_up_bias", b.len(), experts * 2 * inter)?;
        }
        if let Some(b) = self.down_bias {
            KernelError::check_len("down_bias", b.len(), experts * hidden)?;
        }
        Ok(())
    }
}

/// Adds expert `e`'s bias row (`bias` `[E, n]`) to each of its sorted rows of `y` (rows of `n`).
pub(super) fn add_bias(sorted: &SortedPairs, y: &mut [f32], bias: &[f32], n: usize) {
    for (e, s0, m) in sorted.active() {
        let b = &bias[e * n..][..n];
        for row in y[s0 * n..][..m * n].chunks_exact_mut(n) {
            for (v, &bb) in row.iter_mut().zip(b) {
                *v += bb;
            }
        }
    }
}

/// gpt-oss's clamped SwiGLU over rows of `gu` (`[rows, 2 * inter]`, gate then up) into `out`
/// (`[rows, inter]`), in HF's order of operations.
pub(super) fn clamped_swiglu(gu: &[f32], inter: usize, alpha: f32, limit: f32, out: &mut [f32]) {
    if inter == 0 {
        return;
    }
    for (o, g) in out.chunks_exact_mut(inter).zip(gu.chunks_exact(2 * inter)) {
        let (gate, up) = g.split_at(inter);
        for ((o, &gv), &uv) in o.iter_mut().zip(gate).zip(up) {
            let gv = gv.min(limit);
            let uv = uv.clamp(-limit, limit);
            let glu = gv * (1.0 / (1.0 + (-(gv * alpha)).exp()));
            *o = (uv + 1.0) * glu;
        }
    }
}
