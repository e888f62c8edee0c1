//! Rows of a quantized W dequantized: an embedding lookup, in either layout.

use super::{check_k, dequantize_row, x8, QuantType};
use crate::KernelError;

/// `quant_get_rows` over W in the x8 layout.
pub fn quant_get_rows_x8(
    qt: QuantType,
    w: &[u8],
    n: usize,
    k: usize,
    ids: &[i64],
    out: &mut [f32],
) -> Result<(), KernelError> {
    x8::check(qt, w.len(), n, k)?;
    KernelError::check_len("out", out.len(), ids.len() * k)?;
    check_ids(ids, n)?;
    let mut row = vec![0u8; qt.row_bytes(k)];
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(k)) {
        x8::unpack_row(qt, w, k, id as usize, &mut row);
        dequantize_row(qt, &row, o);
    }
    Ok(())
}

fn check_ids(ids: &[i64], n: usize) -> Result<(), KernelError> {
    for (i, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= n {
            return Err(KernelError::Row { index: i, id, n });
        }
    }
    Ok(())
}

/// Dequantizes rows `ids` of W (`[n, k]`) into `out` (`[ids.len(), k]`): an embedding lookup.
pub fn quant_get_rows(
    qt: QuantType,
    w: &[u8],
    n: usize,
    k: usize,
    ids: &[i64],
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_k(qt, k)?;
    let rb = qt.row_bytes(k);
    KernelError::check_len("weight", w.len(), n * rb)?;
    KernelError::check_len("out", out.len(), ids.len() * k)?;
    check_ids(ids, n)?;
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(k.max(1))) {
        dequantize_row(qt, &w[id as usize * rb..][..rb], o);
    }
    Ok(())
}
