//! Thin PyO3 layer over pagedrs-core: type conversion and delegation only.
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

mod cpu_kernels;
mod errors;
mod plan;
mod prefix;
mod scheduler;
mod shared;
mod types;

/// Kernel sources (and the header they include, by file name) embedded at build time, so a wheel
/// carries exactly the kernels it was built with.
const KERNELS: &[(&str, &str)] = &[
    (
        "cache_kernels",
        include_str!("../../../cuda/cache_kernels.cu"),
    ),
    (
        "paged_attention",
        include_str!("../../../cuda/paged_attention.cu"),
    ),
    ("layer_ops", include_str!("../../../cuda/layer_ops.cu")),
    ("quant_ops", include_str!("../../../cuda/quant_ops.cu")),
    ("lora_ops", include_str!("../../../cuda/lora_ops.cu")),
    ("moe_ops", include_str!("../../../cuda/moe_ops.cu")),
    ("delta_rule", include_str!("../../../cuda/delta_rule.cu")),
    ("common.cuh", include_str!("../../../cuda/common.cuh")),
];

#[pyfunction]
fn kernel_source(name: &str) -> PyResult<&'static str> {
    KERNELS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, src)| *src)
        .ok_or_else(|| {
            let known: Vec<&str> = KERNELS.iter().map(|(n, _)| *n).collect();
            PyValueError::new_err(format!("unknown kernel {name:?}; known: {known:?}"))
        })
}

#[pyfunction]
fn kernel_names() -> Vec<&'static str> {
    KERNELS.iter().map(|(n, _)| *n).collect()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(kernel_source, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_names, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::quant_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::moe_experts, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::quant_get_rows, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::quant_pack_x8, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::quant_type_ids, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::quant_isa, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_pool_workers, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_fused_add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_silu_and_mul, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_argmax_logsumexp, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_lora_add, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_rope_neox, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_gated_delta_decode, m)?)?;
    m.add_function(wrap_pyfunction!(prefix::prefix_extra_key, m)?)?;
    m.add_function(wrap_pyfunction!(prefix::prefix_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(prefix::prefix_root_hash, m)?)?;
    m.add("STEP_WIRE_HEADER_LEN", pagedrs_core::WIRE_HEADER_LEN)?;
    errors::register(m)?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<plan::PyStepPlan>()?;
    m.add_class::<types::PyFinishReason>()?;
    m.add_class::<types::PySchedulerStats>()?;
    m.add_class::<prefix::PyKVEvents>()?;
    Ok(())
}
