//! `paged_decode_attention` and the GGUF-quantized matmuls (`quant_*`): numpy arrays checked and
//! converted, then `pagedrs_cpu` with the GIL released.

use numpy::{
    dtype, Element, PyArray2, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use pagedrs_cpu::quant::{self, Isa, MatmulDims, QuantType};
use pagedrs_cpu::{paged_decode_f32, DecodeDims, DecodeParams};

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

/// Decode attention over the paged KV cache, one query token per sequence, written into `out`.
/// q/out float32 [B, H, D], kv_cache float32 [2, num_blocks, block_size, KVH, D], block_tables int32
/// [B, M], seq_lens int32 [B] (context length including the query token). `logits_soft_cap`: scores
/// become `cap * tanh(s / cap)` before the softmax; `isa`: the kernels (`quant_isa()`'s names);
/// `sinks` float32 [H]: a logit per query head in every softmax's denominator (gpt-oss's attention sinks).
#[pyfunction]
#[pyo3(signature = (q, kv_cache, block_tables, seq_lens, out, scale, sliding_window=None, num_threads=1, logits_soft_cap=None, isa=None, sinks=None))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    kv_cache: &Bound<'_, PyAny>,
    block_tables: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    scale: f32,
    sliding_window: Option<usize>,
    num_threads: usize,
    logits_soft_cap: Option<f32>,
    isa: Option<&str>,
    sinks: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let isa = isa_named(isa)?;
    let q = array::<f32>(q, "q", 3, "float32")?;
    let kv = array::<f32>(kv_cache, "kv_cache", 5, "float32")?;
    let bt = array::<i32>(block_tables, "block_tables", 2, "int32")?;
    let lens = array::<i32>(seq_lens, "seq_lens", 1, "int32")?;
    let out = array::<f32>(out, "out", 3, "float32")?;
    let (qs, ks, bs) = (q.shape().to_vec(), kv.shape().to_vec(), bt.shape().to_vec());
    if ks[0] != 2 || ks[4] != qs[2] {
        return Err(shape_error(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size]",
            format!("got {ks:?} for q {qs:?}"),
        ));
    }
    if bs[0] != qs[0] || lens.shape()[0] != qs[0] || out.shape() != qs.as_slice() {
        return Err(shape_error(
            "block_tables [B, M], seq_lens [B] and out must match q [B, H, D]",
            format!(
                "got q {qs:?}, block_tables {bs:?}, seq_lens {:?}, out {:?}",
                lens.shape(),
                out.shape()
            ),
        ));
    }
    let dims = DecodeDims {
        num_seqs: qs[0],
        num_heads: qs[1],
        num_kv_heads: ks[3],
        head_size: qs[2],
        num_blocks: ks[1],
        block_size: ks[2],
        max_blocks_per_seq: bs[1],
    };
    let sinks = sinks
        .map(|s| array::<f32>(s, "sinks", 1, "float32"))
        .transpose()?;
    if let Some(s) = &sinks {
        if s.shape()[0] != qs[1] {
            return Err(shape_error(
                "sinks must be [H], one per query head",
                format!("got {:?} for q {qs:?}", s.shape()),
            ));
        }
    }
    let (q, kv, bt, lens) = (q.readonly(), kv.readonly(), bt.readonly(), lens.readonly());
    let sinks = sinks.as_ref().map(|s| s.readonly());
    let mut out = out
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out cannot be written: {e}")))?;
    let (q, kv, bt, lens) = (
        q.as_slice()?,
        kv.as_slice()?,
        bt.as_slice()?,
        lens.as_slice()?,
    );
    let out = out.as_slice_mut()?;
    let params = DecodeParams {
        scale,
        sliding_window,
        logits_soft_cap,
        sinks: sinks.as_ref().map(|s| s.as_slice()).transpose()?,
        isa,
    };
    py.detach(|| paged_decode_f32(q, kv, bt, lens, out, &dims, &params, num_threads))
        .map_err(|e| PyValueError::new_err(e.to_string()))
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

/// Worker threads of the kernels' pool (the calling thread is one more).
#[pyfunction]
pub fn cpu_pool_workers() -> usize {
    pagedrs_cpu::pool::num_workers()
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
/// Q4_1 or Q8_0 and N a multiple of 8.
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
/// weight in the 8-row interleaved layout (`quant_pack_x8` of [E * rows, row_bytes]; Q4_0, Q4_1, Q8_0,
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
