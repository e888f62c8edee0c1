//! The decode step of a Gated DeltaNet layer (`pagedrs_cpu::delta_rule`) on numpy arrays.

use numpy::{PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use pagedrs_cpu::delta_rule::{gated_delta_decode, DeltaDims, DeltaParams, DeltaRows, DeltaState};

use super::{array, isa_named};

/// One token per row through a Gated DeltaNet layer's conv1d and gated delta rule, in place on the state
/// pools. qkv float32 [B, conv_dim] (the projection's [q | k | v]); a, b float32 [B, value heads]; slots
/// int64 [B] (each row's state slot); conv_weight float32 [conv_dim, kernel]; a_log, dt_bias float32 [value
/// heads]; conv_state float32 [slots, conv_dim, kernel - 1]; ssm_state float32 [slots, value heads, head_k,
/// head_v]; out float32 [B, value heads * head_v]. `isa`: `quant_isa()`'s names (default the chosen one).
#[pyfunction]
#[pyo3(signature = (qkv, a, b, slots, conv_weight, a_log, dt_bias, conv_state, ssm_state, out, num_k_heads, isa=None))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_gated_delta_decode(
    py: Python<'_>,
    qkv: &Bound<'_, PyAny>,
    a: &Bound<'_, PyAny>,
    b: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    conv_weight: &Bound<'_, PyAny>,
    a_log: &Bound<'_, PyAny>,
    dt_bias: &Bound<'_, PyAny>,
    conv_state: &Bound<'_, PyAny>,
    ssm_state: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    num_k_heads: usize,
    isa: Option<&str>,
) -> PyResult<()> {
    let isa = isa_named(isa)?;
    let (qkv, a, b) = (
        array::<f32>(qkv, "qkv", 2, "float32")?,
        array::<f32>(a, "a", 2, "float32")?,
        array::<f32>(b, "b", 2, "float32")?,
    );
    let slots = array::<i64>(slots, "slots", 1, "int64")?;
    let w = array::<f32>(conv_weight, "conv_weight", 2, "float32")?;
    let (a_log, dt_bias) = (
        array::<f32>(a_log, "a_log", 1, "float32")?,
        array::<f32>(dt_bias, "dt_bias", 1, "float32")?,
    );
    let conv = array::<f32>(conv_state, "conv_state", 3, "float32")?;
    let ssm = array::<f32>(ssm_state, "ssm_state", 4, "float32")?;
    let out = array::<f32>(out, "out", 2, "float32")?;
    let s = ssm.shape();
    let dims = DeltaDims {
        num_k_heads,
        num_v_heads: s[1],
        head_k: s[2],
        head_v: s[3],
        kernel: w.shape()[1],
    };
    if conv.shape()[0] != s[0] {
        return Err(PyValueError::new_err(format!(
            "conv_state has {} slots, ssm_state {}",
            conv.shape()[0],
            s[0]
        )));
    }
    let writable = |name: &str, e: &dyn std::fmt::Display| {
        PyValueError::new_err(format!("{name} cannot be written: {e}"))
    };
    let (qkv, a, b, slots, w) = (
        qkv.readonly(),
        a.readonly(),
        b.readonly(),
        slots.readonly(),
        w.readonly(),
    );
    let (a_log, dt_bias) = (a_log.readonly(), dt_bias.readonly());
    let mut conv = conv
        .try_readwrite()
        .map_err(|e| writable("conv_state", &e))?;
    let mut ssm = ssm.try_readwrite().map_err(|e| writable("ssm_state", &e))?;
    let mut out = out.try_readwrite().map_err(|e| writable("out", &e))?;
    let params = DeltaParams {
        conv_weight: w.as_slice()?,
        a_log: a_log.as_slice()?,
        dt_bias: dt_bias.as_slice()?,
    };
    let rows = DeltaRows {
        qkv: qkv.as_slice()?,
        a: a.as_slice()?,
        b: b.as_slice()?,
        slots: slots.as_slice()?,
    };
    let mut state = DeltaState {
        conv: conv.as_slice_mut()?,
        ssm: ssm.as_slice_mut()?,
    };
    let out = out.as_slice_mut()?;
    py.detach(|| gated_delta_decode(isa, &dims, &params, &rows, &mut state, out))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}
