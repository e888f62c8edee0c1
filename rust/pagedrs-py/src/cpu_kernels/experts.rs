//! `moe_experts`: the fused experts step of a mixture-of-experts layer.

use numpy::{PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use pagedrs_cpu::quant::QuantType;

use super::{array, isa_named, quant_type, shape_error};

/// One stacked expert weight as `moe_experts` reads it: float32 [E, rows, cols], or GGUF rows of a
/// quantized type, uint8 [E, rows, row_bytes(cols)].
enum ExpertArray<'py> {
    F32(numpy::PyReadonlyArrayDyn<'py, f32>),
    Quant(QuantType, numpy::PyReadonlyArrayDyn<'py, u8>),
}

impl<'py> ExpertArray<'py> {
    fn read(
        obj: &Bound<'py, PyAny>,
        name: &str,
        ggml_type: Option<u32>,
    ) -> PyResult<(Self, Vec<usize>)> {
        Ok(match ggml_type {
            None => {
                let a = array::<f32>(obj, name, 3, "float32")?;
                let shape = a.shape().to_vec();
                (ExpertArray::F32(a.readonly()), shape)
            }
            Some(t) => {
                let a = array::<u8>(obj, name, 3, "uint8")?;
                let shape = a.shape().to_vec();
                (ExpertArray::Quant(quant_type(t)?, a.readonly()), shape)
            }
        })
    }

    /// The width of a row in weights (`cols` as the kernels count them): bytes / bytes per weight.
    fn cols(&self, shape: &[usize]) -> Option<usize> {
        match self {
            ExpertArray::F32(_) => Some(shape[2]),
            ExpertArray::Quant(qt, _) => {
                let cols = shape[2] / qt.block_bytes() * qt.block_len();
                (qt.row_bytes(cols) == shape[2]).then_some(cols)
            }
        }
    }

    /// `packed`: GGUF rows in the 8-row interleaved layout (`quant_pack_x8`).
    fn weights(&self, packed: bool) -> PyResult<pagedrs_cpu::moe::ExpertWeights<'_>> {
        use pagedrs_cpu::moe::ExpertWeights;
        Ok(match self {
            ExpertArray::F32(a) => ExpertWeights::F32(a.as_slice()?),
            ExpertArray::Quant(qt, a) if packed => ExpertWeights::QuantX8(*qt, a.as_slice()?),
            ExpertArray::Quant(qt, a) => ExpertWeights::Quant(*qt, a.as_slice()?),
        })
    }
}

/// The fused experts step of a mixture-of-experts layer: out[t] = sum over s of topk_weights[t, s] *
/// down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, s] (slots summed in order). x float32 [T, H];
/// gate_up [E, 2I, H] (each expert's gate rows then its up rows) and down [E, H, I], float32, or GGUF
/// rows uint8 [E, rows, row_bytes] where `gate_up_type` / `down_type` name their GGML type; topk_ids int64
/// [T, k]; topk_weights float32 [T, k]; out float32 [T, H]. `isa`: the kernels (`quant_isa()`'s names).
/// `gate_up_bias` float32 [E, 2I] / `down_bias` [E, H]: the experts' biases; `swiglu` (alpha, limit):
/// gpt-oss's clamped SwiGLU instead of silu(gate) * up. `gate_up_packed` / `down_packed`: that GGUF
/// weight in the 8-row interleaved layout (`quant_pack_x8` of [E * rows, row_bytes]; the types it takes,
/// rows a multiple of 8).
#[pyfunction]
#[pyo3(signature = (x, gate_up, down, topk_ids, topk_weights, out, gate_up_type=None, down_type=None, num_threads=1, isa=None, gate_up_bias=None, down_bias=None, swiglu=None, gate_up_packed=false, down_packed=false))]
#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    gate_up: &Bound<'_, PyAny>,
    down: &Bound<'_, PyAny>,
    topk_ids: &Bound<'_, PyAny>,
    topk_weights: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    gate_up_type: Option<u32>,
    down_type: Option<u32>,
    num_threads: usize,
    isa: Option<&str>,
    gate_up_bias: Option<&Bound<'_, PyAny>>,
    down_bias: Option<&Bound<'_, PyAny>>,
    swiglu: Option<(f32, f32)>,
    gate_up_packed: bool,
    down_packed: bool,
) -> PyResult<()> {
    let isa = isa_named(isa)?;
    let b_gu = gate_up_bias
        .map(|b| array::<f32>(b, "gate_up_bias", 2, "float32"))
        .transpose()?;
    let b_dn = down_bias
        .map(|b| array::<f32>(b, "down_bias", 2, "float32"))
        .transpose()?;
    let x = array::<f32>(x, "x", 2, "float32")?;
    let ids = array::<i64>(topk_ids, "topk_ids", 2, "int64")?;
    let wts = array::<f32>(topk_weights, "topk_weights", 2, "float32")?;
    let out = array::<f32>(out, "out", 2, "float32")?;
    let (gu, gs) = ExpertArray::read(gate_up, "gate_up", gate_up_type)?;
    let (dn, ds) = ExpertArray::read(down, "down", down_type)?;
    let (xs, is, ws, os) = (
        x.shape().to_vec(),
        ids.shape().to_vec(),
        wts.shape().to_vec(),
        out.shape().to_vec(),
    );
    let (tokens, hidden) = (xs[0], xs[1]);
    let inter = gs[1] / 2;
    let ok = gs[1] % 2 == 0
        && gu.cols(&gs) == Some(hidden)
        && ds[0] == gs[0]
        && ds[1] == hidden
        && dn.cols(&ds) == Some(inter)
        && is[0] == tokens
        && ws == is
        && os == xs;
    if !ok {
        return Err(shape_error(
            "moe_experts needs x [T, H], gate_up [E, 2I, H], down [E, H, I] (GGUF rows: their bytes), \
             topk_ids and topk_weights [T, k], out [T, H]",
            format!("got x {xs:?}, gate_up {gs:?}, down {ds:?}, topk_ids {is:?}, topk_weights {ws:?}, out {os:?}"),
        ));
    }
    let dims = pagedrs_cpu::moe::MoeDims {
        tokens,
        top_k: is[1],
        hidden,
        inter,
        experts: gs[0],
    };
    let (x, ids, wts) = (x.readonly(), ids.readonly(), wts.readonly());
    let mut out = out
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out cannot be written: {e}")))?;
    let (x, ids, wts, out) = (
        x.as_slice()?,
        ids.as_slice()?,
        wts.as_slice()?,
        out.as_slice_mut()?,
    );
    let (gw, dw) = (gu.weights(gate_up_packed)?, dn.weights(down_packed)?);
    let (b_gu, b_dn) = (
        b_gu.as_ref().map(|b| b.readonly()),
        b_dn.as_ref().map(|b| b.readonly()),
    );
    let epi = pagedrs_cpu::moe::ExpertEpilogue {
        gate_up_bias: b_gu.as_ref().map(|b| b.as_slice()).transpose()?,
        down_bias: b_dn.as_ref().map(|b| b.as_slice()).transpose()?,
        act: match swiglu {
            None => pagedrs_cpu::moe::ExpertAct::SiluMul,
            Some((alpha, limit)) => pagedrs_cpu::moe::ExpertAct::ClampedSwiglu { alpha, limit },
        },
    };
    py.detach(|| {
        pagedrs_cpu::moe::moe_experts_epilogue(
            isa,
            gw,
            dw,
            &epi,
            x,
            ids,
            wts,
            out,
            &dims,
            num_threads,
        )
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}
