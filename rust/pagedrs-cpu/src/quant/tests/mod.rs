//! Every type against a reference written straight from ggml's `dequantize_row_*` loops (test-only code,
//! independent of the sub-block decoder), on random blocks, odd shapes and tails.

mod acts;
mod dequantize;
mod helpers;
mod matmul;
mod packed_x8;
