//! The CPU kernels for Python: numpy arrays checked and converted, then `pagedrs_cpu` with the GIL
//! released. `attention` (`paged_decode_attention`), `quantized` (the GGUF-quantized matmuls, `quant_*`),
//! `ops` (the fused per-token ops), `delta_rule` (`cpu_gated_delta_decode`), `lora` (`cpu_lora_add`), `experts` (`moe_experts`); here the
//! argument checks they share.

mod attention;
mod delta_rule;
mod experts;
mod lora;
mod ops;
mod quantized;

use numpy::{
    dtype, Element, PyArrayDescrMethods, PyArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use pagedrs_cpu::quant::{Isa, QuantType};

pub use attention::paged_decode_attention;
pub use delta_rule::cpu_gated_delta_decode;
pub use experts::moe_experts;
pub use lora::cpu_lora_add;
pub use ops::{
    cpu_argmax_logsumexp, cpu_fused_add_rms_norm, cpu_pool_workers, cpu_rms_norm, cpu_rope_neox,
    cpu_silu_and_mul,
};
pub use quantized::{quant_get_rows, quant_isa, quant_matmul, quant_pack_x8, quant_type_ids};

/// `obj` as a C-contiguous numpy array of `T` with `ndim` dimensions, else a ValueError naming it.
fn array<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    ndim: usize,
    dtype_name: &str,
) -> PyResult<Bound<'py, PyArrayDyn<T>>> {
    let py = obj.py();
    let untyped = obj.cast::<PyUntypedArray>().map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must be a numpy array (use tensor.numpy() for a CPU tensor)"
        ))
    })?;
    if !untyped.dtype().is_equiv_to(&dtype::<T>(py)) {
        return Err(PyValueError::new_err(format!(
            "{name} must be {dtype_name}, got {}",
            untyped.dtype()
        )));
    }
    if untyped.ndim() != ndim {
        return Err(PyValueError::new_err(format!(
            "{name} must have {ndim} dimensions, got shape {:?}",
            untyped.shape()
        )));
    }
    if !untyped.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{name} (shape {:?}) must be C-contiguous",
            untyped.shape()
        )));
    }
    Ok(untyped.cast::<PyArrayDyn<T>>()?.clone())
}

fn shape_error(what: &str, detail: String) -> PyErr {
    PyValueError::new_err(format!("{what}: {detail}"))
}

/// The kernel set `name` (`quant_isa()`'s names), or `Isa::chosen()` for None.
fn isa_named(name: Option<&str>) -> PyResult<Isa> {
    match name {
        None => Ok(Isa::chosen()),
        Some(name) => Isa::by_name(name).ok_or_else(|| {
            PyValueError::new_err(format!(
                "isa {name:?}: not a kernel set of this architecture"
            ))
        }),
    }
}

fn quant_type(ggml_type: u32) -> PyResult<QuantType> {
    QuantType::from_ggml_id(ggml_type).ok_or_else(|| {
        let known: Vec<u32> = QuantType::ALL.iter().map(|t| t.ggml_id()).collect();
        PyValueError::new_err(format!(
            "GGML type {ggml_type} has no quantized CPU kernel; supported: {known:?}"
        ))
    })
}
