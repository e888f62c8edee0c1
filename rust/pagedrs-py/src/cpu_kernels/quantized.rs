//! The GGUF-quantized matmuls and row lookups (`quant_*`), and which kernels run them.

use numpy::{PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use pagedrs_cpu::quant::{self, Isa, MatmulDims, QuantType};

use super::{array, isa_named, quant_type, shape_error};

/// The GGML type ids (`gguf.GGMLQuantizationType` values) the quantized kernels take.
#[pyfunction]
pub fn quant_type_ids() -> Vec<u32> {
    QuantType::ALL.iter().map(|t| t.ggml_id()).collect()
}

/// Which kernels `quant_matmul` runs (`Isa::chosen()`: the best this CPU has, or `PAGEDRS_CPU_ISA`).
#[pyfunction]
pub fn quant_isa() -> &'static str {
    Isa::chosen().name()
}

/// out[:, col0:col0 + N] = x @ W^T with W in a GGUF block layout. x float32 [M, K]; weight uint8
/// [N, row_bytes] (each row its GGUF blocks, or with `packed` the 8-row interleaved layout of
/// `quant_pack_x8`); out float32 [M, ldo]. `isa` names the kernels (`quant_isa()`'s names; default the
/// chosen ones); kernels this CPU lacks give way to the nearest ones below that it runs.
#[pyfunction]
#[pyo3(signature = (x, weight, ggml_type, out, col0=0, num_threads=1, packed=false, isa=None))]
#[allow(clippy::too_many_arguments)]
pub fn quant_matmul(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    ggml_type: u32,
    out: &Bound<'_, PyAny>,
    col0: usize,
    num_threads: usize,
    packed: bool,
    isa: Option<&str>,
) -> PyResult<()> {
    let qt = quant_type(ggml_type)?;
    let isa = isa_named(isa)?;
    let x = array::<f32>(x, "x", 2, "float32")?;
    let w = array::<u8>(weight, "weight", 2, "uint8")?;
    let out = array::<f32>(out, "out", 2, "float32")?;
    let (xs, ws, os) = (x.shape().to_vec(), w.shape().to_vec(), out.shape().to_vec());
    let k = xs[1];
    if k % qt.block_len() != 0 || ws[1] != qt.row_bytes(k) || os[0] != xs[0] {
        return Err(shape_error(
            "quant_matmul needs x [M, K], weight [N, row_bytes(K)], out [M, ldo]",
            format!(
                "got x {xs:?}, weight {ws:?} ({} rows of {} take {} bytes), out {os:?}",
                qt.name(),
                k,
                qt.row_bytes(k)
            ),
        ));
    }
    let dims = MatmulDims {
        m: xs[0],
        k,
        n: ws[0],
        ldo: os[1],
        col0,
    };
    let (x, w) = (x.readonly(), w.readonly());
    let mut out = out
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out cannot be written: {e}")))?;
    let (x, w, out) = (x.as_slice()?, w.as_slice()?, out.as_slice_mut()?);
    py.detach(|| {
        if packed {
            quant::quant_matmul_x8_with(isa, qt, w, x, out, &dims, num_threads)
        } else {
            quant::quant_matmul_with(isa, qt, w, x, out, &dims, num_threads)
        }
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// W (uint8 [N, row_bytes], GGUF blocks of `ggml_type`) repacked 8 rows at a time for
/// `quant_matmul(..., packed=True)`: a new array of the same shape. ValueError unless the type is Q4_0,
/// Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K and N a multiple of 8.
#[pyfunction]
pub fn quant_pack_x8<'py>(
    py: Python<'py>,
    weight: &Bound<'py, PyAny>,
    ggml_type: u32,
) -> PyResult<Bound<'py, PyArray2<u8>>> {
    let qt = quant_type(ggml_type)?;
    let w = array::<u8>(weight, "weight", 2, "uint8")?;
    let (n, rb) = (w.shape()[0], w.shape()[1]);
    if rb % qt.block_bytes() != 0 {
        return Err(shape_error(
            "quant_pack_x8 needs weight [N, row_bytes]",
            format!("rows of {rb} bytes are not whole {} blocks", qt.name()),
        ));
    }
    let k = rb / qt.block_bytes() * qt.block_len();
    let w = w.readonly();
    let w = w.as_slice()?;
    let packed = py
        .detach(|| quant::x8::pack(qt, w, n, k))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    numpy::PyArray1::from_vec(py, packed).reshape([n, rb])
}

/// out[i] = dequantized row ids[i] of W (an embedding lookup). weight uint8 [N, row_bytes] (with
/// `packed`, the layout of `quant_pack_x8`); ids int64 [T]; out float32 [T, K].
#[pyfunction]
#[pyo3(signature = (weight, ggml_type, ids, out, packed=false))]
pub fn quant_get_rows(
    py: Python<'_>,
    weight: &Bound<'_, PyAny>,
    ggml_type: u32,
    ids: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    packed: bool,
) -> PyResult<()> {
    let qt = quant_type(ggml_type)?;
    let w = array::<u8>(weight, "weight", 2, "uint8")?;
    let ids = array::<i64>(ids, "ids", 1, "int64")?;
    let out = array::<f32>(out, "out", 2, "float32")?;
    let (n, k) = (w.shape()[0], out.shape()[1]);
    let (w, ids) = (w.readonly(), ids.readonly());
    let mut out = out
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out cannot be written: {e}")))?;
    let (w, ids, out) = (w.as_slice()?, ids.as_slice()?, out.as_slice_mut()?);
    py.detach(|| {
        if packed {
            quant::quant_get_rows_x8(qt, w, n, k, ids, out)
        } else {
            quant::quant_get_rows(qt, w, n, k, ids, out)
        }
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}
