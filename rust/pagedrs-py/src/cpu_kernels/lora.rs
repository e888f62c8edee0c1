//! `cpu_lora_add`: the LoRA deltas of a batch mixing adapters.

use numpy::{PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::{array, shape_error};

/// LoRA deltas of a batch mixing adapters (punica's BGMV on the CPU): for each row i with
/// `slots[i] >= 0`, `out[i, col0:col0 + W] += (A[s] @ x[i]) @ bt[s]`. x float32 [T, K]; a float32
/// [S, R, K]; bt float32 [S, R, W] (B transposed, the scaling folded in); slots int64 [T] (-1: no
/// delta); out float32 [T, ldo]; cols int64 [R, 2] (optional): each rank row's output columns
/// [start, end) within 0..W.
#[pyfunction]
#[pyo3(signature = (x, a, bt, slots, out, col0=0, num_threads=1, cols=None))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_lora_add(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    a: &Bound<'_, PyAny>,
    bt: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    col0: usize,
    num_threads: usize,
    cols: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let cols = cols
        .map(|c| array::<i64>(c, "cols", 2, "int64"))
        .transpose()?;
    let cols = cols.as_ref().map(|c| c.readonly());
    let cols: &[i64] = match &cols {
        Some(c) => c.as_slice()?,
        None => &[],
    };
    let x = array::<f32>(x, "x", 2, "float32")?;
    let a = array::<f32>(a, "a", 3, "float32")?;
    let b = array::<f32>(bt, "bt", 3, "float32")?;
    let slots = array::<i64>(slots, "slots", 1, "int64")?;
    let out = array::<f32>(out, "out", 2, "float32")?;
    let (xs, as_, bs, os) = (
        x.shape().to_vec(),
        a.shape().to_vec(),
        b.shape().to_vec(),
        out.shape().to_vec(),
    );
    if as_[2] != xs[1] || bs[0] != as_[0] || bs[1] != as_[1] || os[0] != xs[0] {
        return Err(shape_error(
            "cpu_lora_add needs x [T, K], a [S, R, K], bt [S, R, W], out [T, ldo]",
            format!("got x {xs:?}, a {as_:?}, bt {bs:?}, out {os:?}"),
        ));
    }
    let dims = pagedrs_cpu::lora::LoraDims {
        m: xs[0],
        k: xs[1],
        rank: as_[1],
        width: bs[2],
        num_slots: as_[0],
        ldo: os[1],
        col0,
    };
    let (x, a, b, slots) = (x.readonly(), a.readonly(), b.readonly(), slots.readonly());
    let mut out = out
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out cannot be written: {e}")))?;
    let (x, a, b, slots, out) = (
        x.as_slice()?,
        a.as_slice()?,
        b.as_slice()?,
        slots.as_slice()?,
        out.as_slice_mut()?,
    );
    py.detach(|| pagedrs_cpu::lora::lora_add(x, a, b, slots, cols, out, &dims, num_threads))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}
