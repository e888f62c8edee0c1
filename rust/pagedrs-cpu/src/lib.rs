//! CPU kernels (pure Rust, no Python): the decode attention over the paged KV cache used by the torch
//! backend on CPU instead of its gather + batched matmul, and matmuls over GGUF-quantized weights
//! (`quant`), run on a warm thread pool (`pool`), small fused per-token ops (`ops`), and the decode step of
//! a Gated DeltaNet layer (`delta_rule`).
//!
//! KV cache layout (as everywhere in pagedrs): `[2, num_blocks, block_size, num_kv_heads, head_size]`,
//! index 0 = K, 1 = V.

mod decode;
pub mod delta_rule;
pub mod lora;
pub mod moe;
pub mod ops;
pub mod pool;
pub mod quant;

pub use decode::{paged_decode_f32, DecodeDims, DecodeParams};

/// Inconsistent arguments; every message names the numbers involved.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    #[error("{name} has {actual} elements, expected {expected}")]
    Length {
        name: &'static str,
        actual: usize,
        expected: usize,
    },
    #[error("num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")]
    Heads {
        num_heads: usize,
        num_kv_heads: usize,
    },
    #[error("{name} must be > 0")]
    Zero { name: &'static str },
    #[error("{name} = {value} must be a positive finite number")]
    NotPositive { name: &'static str, value: String },
    #[error("seq_lens[{seq}] = {len} is outside 0..={max} (block table width x block_size)")]
    SeqLen { seq: usize, len: i64, max: usize },
    #[error("block_tables[{seq}, {idx}] = {block} is outside 0..{num_blocks}")]
    Block {
        seq: usize,
        idx: usize,
        block: i64,
        num_blocks: usize,
    },
    #[error("K = {k} is not a positive multiple of the {qtype} block length {block}")]
    BlockLen {
        qtype: &'static str,
        k: usize,
        block: usize,
    },
    #[error("columns {col0}..{col0}+{n} do not fit in output rows of {ldo}")]
    Columns { col0: usize, n: usize, ldo: usize },
    #[error("cols[{row}] = {start}..{end} is not a column range within 0..{width}")]
    RankColumns {
        row: usize,
        start: i64,
        end: i64,
        width: usize,
    },
    #[error("ids[{index}] = {id} is outside 0..{n}")]
    Row { index: usize, id: i64, n: usize },
    #[error("{qtype} weights of {n} rows have no 8-row interleaved layout (Q4_0, Q4_1 or Q8_0, rows a multiple of 8)")]
    Packing { qtype: &'static str, n: usize },
}

impl KernelError {
    /// `Err(Length)` unless `actual == expected`: the one length check every kernel's arguments use.
    pub(crate) fn check_len(
        name: &'static str,
        actual: usize,
        expected: usize,
    ) -> Result<(), Self> {
        if actual != expected {
            return Err(Self::Length {
                name,
                actual,
                expected,
            });
        }
        Ok(())
    }
}
