//! `paged_decode_attention`: decode attention over the paged KV cache.

use numpy::{PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use pagedrs_cpu::{paged_decode_f32, DecodeDims, DecodeParams};

use super::{array, isa_named, shape_error};

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
