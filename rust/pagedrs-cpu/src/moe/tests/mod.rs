//! The fused experts step against a float64 reference (float32 experts), and quantized experts against
//! the dense quantized matmul run one pair at a time (the same kernels, so the same bits per row up to
//! the final weighted sum) and a float64 reference over the dequantized weights.

mod f32_experts;
mod helpers;
mod quantized;
