//! Times the float32 fused experts step per rows-per-expert (24 active experts of 32, each given `m` rows,
//! Mixtral-like shape hidden 768, inter 384) and prints the weight bytes read per second (best of N, the thread's CPU time; one thread only):
//! `cargo run --release -p pagedrs-cpu --example moe_bench [threads] [isa]`.
use pagedrs_cpu::moe::{moe_experts_with, ExpertWeights, MoeDims};
use pagedrs_cpu::quant::Isa;

/// CPU time of the calling thread (seconds): other processes on the machine do not count.
#[allow(unsafe_code)]
fn thread_time() -> f64 {
    extern "C" {
        fn clock_gettime(clock: i32, ts: *mut [i64; 2]) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = [0i64; 2];
    // SAFETY: `ts` is a timespec (two 64-bit fields on the 64-bit targets this runs on).
    unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts[0] as f64 + ts[1] as f64 * 1e-9
}

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let isa = args
        .next()
        .and_then(|s| Isa::by_name(&s))
        .unwrap_or_else(Isa::chosen);
    let (experts, hidden, inter, active) = (32usize, 768usize, 384usize, 24usize);
    let mut seed = 1u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let gu: Vec<f32> = (0..experts * 2 * inter * hidden).map(|_| next()).collect();
    let dn: Vec<f32> = (0..experts * hidden * inter).map(|_| next()).collect();
    let bytes = (active * 3 * inter * hidden * 4) as f64;
    for m in [1usize, 2, 3, 4, 5, 6, 8, 12, 16, 32] {
        let tokens = active * m;
        let ids: Vec<i64> = (0..tokens).map(|t| (t / m) as i64).collect();
        let wts = vec![1.0f32; tokens];
        let x: Vec<f32> = (0..tokens * hidden).map(|_| next()).collect();
        let mut out = vec![0.0f32; tokens * hidden];
        let d = MoeDims {
            tokens,
            top_k: 1,
            hidden,
            inter,
            experts,
        };
        let mut best = f64::MAX;
        for _ in 0..12 {
            let t0 = thread_time();
            moe_experts_with(
                isa,
                ExpertWeights::F32(&gu),
                ExpertWeights::F32(&dn),
                &x,
                &ids,
                &wts,
                &mut out,
                &d,
                threads,
            )
            .unwrap();
            best = best.min(thread_time() - t0);
        }
        let flops = (2 * tokens * 3 * inter * hidden) as f64;
        println!(
            "{} m={m:2}: {:.3} ms  {:.1} GB/s  {:.1} GFLOP/s",
            isa.name(),
            best * 1e3,
            bytes / best / 1e9,
            flops / best / 1e9
        );
    }
}
