//! Times `quant_matmul` on random weights of the shapes of SmolLM2-135M (best of N, one thread and all):
//! `cargo run --release -p pagedrs-cpu --example quant_bench`.
use pagedrs_cpu::quant::{quant_matmul, MatmulDims, QuantType};
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let mut seed = 1u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for (qt, n, k) in [
        (QuantType::Q4_1, 1536, 576),
        (QuantType::Q4_1, 576, 1536),
        (QuantType::Q8_0, 49152, 576),
        (QuantType::Q4_K, 1536, 1536),
        (QuantType::Q6_K, 1536, 1536),
        (QuantType::Q4_0, 1536, 1536),
        (QuantType::MXFP4, 1536, 1536),
    ] {
        let mut w: Vec<u8> = (0..n * qt.row_bytes(k)).map(|_| next() as u8).collect();
        // small finite f16 scales (0x2000 ~ 0.0078) over every 2-byte field: values stay finite
        if qt == QuantType::MXFP4 {
            // e8m0 exponents near 2^-7: normal, finite products
            for b in w.chunks_exact_mut(qt.block_bytes()) {
                b[0] = 120 + (b[0] & 7);
            }
        } else {
            for c in w.chunks_exact_mut(2) {
                if c[1] & 0x7c == 0x7c {
                    c[1] = 0x20;
                }
            }
        }
        for m in [1usize, 4, 16] {
            let x: Vec<f32> = (0..m * k)
                .map(|_| (next() % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let mut out = vec![0.0f32; m * n];
            let dims = MatmulDims {
                m,
                k,
                n,
                ldo: n,
                col0: 0,
            };
            let reps = if n * k * m > 10_000_000 { 5 } else { 200 };
            let mut best = f64::MAX;
            for _ in 0..reps {
                let t = Instant::now();
                quant_matmul(qt, &w, &x, &mut out, &dims, threads).unwrap();
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "{:?} n={n} k={k} m={m} threads={threads}: {:.1} us, {:.2} GB/s of weights, {:.2} G MAC/s",
                qt,
                best * 1e6,
                w.len() as f64 / best / 1e9,
                (n * k * m) as f64 / best / 1e9
            );
        }
    }
}
