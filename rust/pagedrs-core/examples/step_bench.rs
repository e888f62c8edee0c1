//! Pure-Rust cost of one schedule() + update() round at N running decodes (no Python).
//! `cargo run --release --example step_bench -- 4096`

use std::time::Instant;

use pagedrs_core::{Config, NewRequest, Scheduler};

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map_or(1024, |a| a.parse().expect("N"));
    let rounds: usize = std::env::args()
        .nth(2)
        .map_or(300, |a| a.parse().expect("rounds"));
    let cfg = Config {
        num_blocks: n * 256 + 1024,
        block_size: 16,
        max_num_batched_tokens: 65536,
        max_num_seqs: n,
        max_model_len: 4096,
        watermark: 0.0,
        ..Config::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let mut x = 12345u64;
    for i in 0..n {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let len = 512 + (x >> 33) as usize % 1537;
        let prompt: Vec<i64> = (0..len)
            .map(|k| 100 + ((k as u64 * 7919 + x) % 30000) as i64)
            .collect();
        s.add_request(NewRequest {
            seq_ids: vec![i as i64],
            prompt_token_ids: prompt,
            max_tokens: 4096,
            ignore_eos: true,
            ..Default::default()
        })
        .unwrap();
    }
    loop {
        let p = s.schedule().unwrap();
        let sampled = vec![7i64; p.sampled_seq_ids.len()];
        s.update(p.step_id, &sampled).unwrap();
        if p.num_prefill_tokens == 0 && p.num_decode_tokens == n {
            break;
        }
    }
    let sampled = vec![7i64; n];
    let (mut ts, mut tu) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t0 = Instant::now();
        let p = s.schedule().unwrap();
        let t1 = Instant::now();
        s.update(p.step_id, &sampled).unwrap();
        let t2 = Instant::now();
        assert_eq!(p.num_decode_tokens, n);
        drop(p);
        ts.push((t1 - t0).as_secs_f64() * 1e6);
        tu.push((t2 - t1).as_secs_f64() * 1e6);
    }
    ts.sort_by(f64::total_cmp);
    tu.sort_by(f64::total_cmp);
    println!(
        "n={n}: schedule median {:.1} us (p90 {:.1}), update median {:.1} us (p90 {:.1})",
        ts[rounds / 2],
        ts[rounds * 9 / 10],
        tu[rounds / 2],
        tu[rounds * 9 / 10]
    );
}
