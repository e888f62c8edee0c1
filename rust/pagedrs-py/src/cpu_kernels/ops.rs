//! The fused per-token ops (norms, activation, rotary embedding, argmax / logsumexp) and the pool size.

use numpy::{
    dtype, PyArray2, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::{array, shape_error};

/// Worker threads of the kernels' pool (the calling thread is one more).
#[pyfunction]
pub fn cpu_pool_workers() -> usize {
    pagedrs_cpu::pool::num_workers()
}

/// `out = rms_norm(x) * weight` per row. x/out float32 [T, H]; weight float32 [H].
#[pyfunction]
pub fn cpu_rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (x, w) = (
        array::<f32>(x, "x", 2, "float32")?,
        array::<f32>(weight, "weight", 1, "float32")?,
    );
    let out = array::<f32>(out, "out", 2, "float32")?;
    let (x, w) = (x.readonly(), w.readonly());
    let mut out = out
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out cannot be written: {e}")))?;
    let (x, w, out) = (x.as_slice()?, w.as_slice()?, out.as_slice_mut()?);
    py.detach(|| pagedrs_cpu::ops::rms_norm(x, w, eps, out))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// In place per row: `residual += x; x = rms_norm(residual) * weight`. x/residual float32 [T, H].
#[pyfunction]
pub fn cpu_fused_add_rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    residual: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
) -> PyResult<()> {
    let x = array::<f32>(x, "x", 2, "float32")?;
    let r = array::<f32>(residual, "residual", 2, "float32")?;
    let w = array::<f32>(weight, "weight", 1, "float32")?;
    let w = w.readonly();
    let mut x = x
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("x cannot be written: {e}")))?;
    let mut r = r
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("residual cannot be written: {e}")))?;
    let (x, r, w) = (x.as_slice_mut()?, r.as_slice_mut()?, w.as_slice()?);
    py.detach(|| pagedrs_cpu::ops::fused_add_rms_norm(x, r, w, eps))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `out = silu(x[:, :d]) * x[:, d:]`. x float32 [T, 2d]; out float32 [T, d].
#[pyfunction]
pub fn cpu_silu_and_mul(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let x = array::<f32>(x, "x", 2, "float32")?;
    let out = array::<f32>(out, "out", 2, "float32")?;
    let d = out.shape()[1];
    let x = x.readonly();
    let mut out = out
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out cannot be written: {e}")))?;
    let (x, out) = (x.as_slice()?, out.as_slice_mut()?);
    py.detach(|| pagedrs_cpu::ops::silu_and_mul(x, d, out))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Rotary embedding (neox) in place on q [T, Hq*D] and k [T, Hk*D] float32, whose rows may be spaced
/// (column slices of the fused qkv output; the last dim contiguous); positions int64 [T]; cos_sin float32
/// [P, rotary_dim] (cos | sin).
#[pyfunction]
pub fn cpu_rope_neox(
    py: Python<'_>,
    positions: &Bound<'_, PyAny>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    cos_sin: &Bound<'_, PyAny>,
    head_size: usize,
    rotary_dim: usize,
) -> PyResult<()> {
    let pos = array::<i64>(positions, "positions", 1, "int64")?;
    let cs = array::<f32>(cos_sin, "cos_sin", 2, "float32")?;
    if rotary_dim == 0
        || rotary_dim % 2 != 0
        || rotary_dim > head_size
        || cs.shape()[1] != rotary_dim
    {
        return Err(shape_error(
            "rotary_dim must be even, <= head_size and cos_sin's width",
            format!(
                "got rotary_dim {rotary_dim}, head_size {head_size}, cos_sin {:?}",
                cs.shape()
            ),
        ));
    }
    let num_positions = cs.shape()[0];
    let (pos, cs) = (pos.readonly(), cs.readonly());
    let (pos, cs) = (pos.as_slice()?, cs.as_slice()?);
    if let Some((t, &p)) = pos
        .iter()
        .enumerate()
        .find(|(_, &p)| p < 0 || p as usize >= num_positions)
    {
        return Err(PyValueError::new_err(format!(
            "positions[{t}] = {p} is outside 0..{num_positions}"
        )));
    }
    let half = rotary_dim / 2;
    // q, then k: one mutable view at a time (they share the qkv buffer).
    for (obj, name) in [(q, "q"), (k, "k")] {
        let untyped = obj
            .cast::<PyUntypedArray>()
            .map_err(|_| PyValueError::new_err(format!("{name} must be a numpy array")))?;
        if !untyped.dtype().is_equiv_to(&dtype::<f32>(py)) || untyped.ndim() != 2 {
            return Err(PyValueError::new_err(format!(
                "{name} must be a 2-D float32 array, got {} {:?}",
                untyped.dtype(),
                untyped.shape()
            )));
        }
        let arr = untyped.cast::<PyArray2<f32>>()?;
        let (rows, width) = (arr.shape()[0], arr.shape()[1]);
        if rows != pos.len() || width % head_size != 0 {
            return Err(shape_error(
                "q/k must be [T, heads * head_size] with T = len(positions)",
                format!(
                    "got {name} {:?}, {} positions, head_size {head_size}",
                    arr.shape(),
                    pos.len()
                ),
            ));
        }
        let mut rw = arr
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("{name} cannot be written: {e}")))?;
        let mut view = rw.as_array_mut();
        py.detach(|| {
            for (mut row, &p) in view.rows_mut().into_iter().zip(pos) {
                let (cos, sin) = cs[p as usize * rotary_dim..][..rotary_dim].split_at(half);
                match row.as_slice_mut() {
                    Some(row) => pagedrs_cpu::ops::rope_neox_row(row, head_size, cos, sin),
                    None => {
                        return Err(PyValueError::new_err(format!(
                            "{name} must have a contiguous last dimension"
                        )))
                    }
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Per row of `x` (float32 [R, V]): the index of its first largest value into `ids` (int64 [R]) and its
/// logsumexp into `lse` (float32 [R]); rows split over `num_threads`.
#[pyfunction]
#[pyo3(signature = (x, ids, lse, num_threads=1))]
pub fn cpu_argmax_logsumexp(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    ids: &Bound<'_, PyAny>,
    lse: &Bound<'_, PyAny>,
    num_threads: usize,
) -> PyResult<()> {
    let x = array::<f32>(x, "x", 2, "float32")?;
    let ids = array::<i64>(ids, "ids", 1, "int64")?;
    let lse = array::<f32>(lse, "lse", 1, "float32")?;
    let v = x.shape()[1];
    let x = x.readonly();
    let mut ids = ids
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("ids cannot be written: {e}")))?;
    let mut lse = lse
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("lse cannot be written: {e}")))?;
    let (x, ids, lse) = (x.as_slice()?, ids.as_slice_mut()?, lse.as_slice_mut()?);
    py.detach(|| pagedrs_cpu::ops::argmax_logsumexp(x, v, ids, lse, num_threads))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}
