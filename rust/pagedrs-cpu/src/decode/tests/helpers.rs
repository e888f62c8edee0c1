//! The random cases, the float64 reference and the calls the decode tests share.

use crate::decode::*;

/// Small deterministic generator (xorshift), values in [-1, 1).
pub(super) struct Rng(pub(super) u64);
impl Rng {
    pub(super) fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub(super) fn below(&mut self, n: usize) -> usize {
        ((self.next() + 1.0) * 0.5 * n as f32) as usize % n
    }
}

pub(super) struct Case {
    pub(super) d: DecodeDims,
    pub(super) q: Vec<f32>,
    pub(super) kv: Vec<f32>,
    pub(super) bt: Vec<i32>,
    pub(super) lens: Vec<i32>,
}

/// Random cache; each sequence gets distinct random blocks (shuffled), padding entries are 0.
pub(super) fn case(
    seed: u64,
    lens: &[i32],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    bs: usize,
) -> Case {
    let mut rng = Rng(seed);
    let m = lens
        .iter()
        .map(|&l| (l as usize).div_ceil(bs))
        .max()
        .unwrap_or(0)
        + 1;
    let num_blocks = lens.len() * m + 3;
    let d = DecodeDims {
        num_seqs: lens.len(),
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_size: hd,
        num_blocks,
        block_size: bs,
        max_blocks_per_seq: m,
    };
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let mut bt = vec![0; lens.len() * m];
    let mut next = 0;
    for (s, &l) in lens.iter().enumerate() {
        for j in 0..(l as usize).div_ceil(bs) {
            bt[s * m + j] = ids[next];
            next += 1;
        }
    }
    let q = (0..lens.len() * heads * hd).map(|_| rng.next()).collect();
    let kv = (0..2 * num_blocks * bs * kv_heads * hd)
        .map(|_| rng.next())
        .collect();
    Case {
        d,
        q,
        kv,
        bt,
        lens: lens.to_vec(),
    }
}

/// Straightforward f64 attention per (sequence, head).
pub(super) fn naive(c: &Case, scale: f32, window: Option<usize>) -> Vec<f32> {
    naive_with(c, &params(scale, window, None))
}

/// `naive` with every parameter (the soft cap and the sinks applied in f64 too).
pub(super) fn naive_with(c: &Case, p: &DecodeParams<'_>) -> Vec<f32> {
    let (scale, window) = (p.scale, p.sliding_window);
    let cap = p.logits_soft_cap.map(f64::from);
    let d = &c.d;
    let (hd, g) = (d.head_size, d.num_heads / d.num_kv_heads);
    let half = c.kv.len() / 2;
    let mut out = vec![0.0f32; c.q.len()];
    for s in 0..d.num_seqs {
        let len = c.lens[s] as usize;
        let start = window.map_or(0, |w| len.saturating_sub(w));
        for h in 0..d.num_heads {
            let kvh = h / g;
            let q = &c.q[(s * d.num_heads + h) * hd..][..hd];
            let row = |p: usize| {
                let b = c.bt[s * d.max_blocks_per_seq + p / d.block_size] as usize;
                ((b * d.block_size + p % d.block_size) * d.num_kv_heads + kvh) * hd
            };
            let sc: Vec<f64> = (start..len)
                .map(|p| {
                    let k = &c.kv[row(p)..][..hd];
                    q.iter()
                        .zip(k)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .map(|x| cap.map_or(x, |cap| cap * (x / cap).tanh()))
                .collect();
            let sink = p.sinks.map(|sinks| f64::from(sinks[h]));
            let max = sc
                .iter()
                .copied()
                .fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
            let e: Vec<f64> = sc.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |x| (x - max).exp());
            let o = &mut out[(s * d.num_heads + h) * hd..][..hd];
            for (i, p) in (start..len).enumerate() {
                let v = &c.kv[half + row(p)..][..hd];
                for (oj, &vj) in o.iter_mut().zip(v) {
                    *oj += (e[i] / sum * vj as f64) as f32;
                }
            }
        }
    }
    out
}

pub(super) fn params(scale: f32, window: Option<usize>, cap: Option<f32>) -> DecodeParams<'static> {
    DecodeParams {
        sliding_window: window,
        logits_soft_cap: cap,
        ..DecodeParams::new(scale)
    }
}

pub(super) fn run(c: &Case, scale: f32, window: Option<usize>, threads: usize) -> Vec<f32> {
    run_with(c, &params(scale, window, None), threads)
}

pub(super) fn run_with(c: &Case, p: &DecodeParams<'_>, threads: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; c.q.len()];
    paged_decode_f32(&c.q, &c.kv, &c.bt, &c.lens, &mut out, &c.d, p, threads).unwrap();
    out
}

/// A case whose sequences `runs[i]` tokens at a time are the query tokens of one request: the same
/// blocks (the run's last token's), lengths growing by one.
pub(super) fn verification_case(
    seed: u64,
    starts: &[i32],
    runs: &[usize],
    hd: usize,
    bs: usize,
) -> Case {
    let last: Vec<i32> = starts
        .iter()
        .zip(runs)
        .map(|(&s, &r)| s + r as i32 - 1)
        .collect();
    let base = case(seed, &last, 6, 2, hd, bs);
    let (m, per_tok) = (base.d.max_blocks_per_seq, base.d.num_heads * hd);
    let mut rng = Rng(seed + 1);
    let (mut bt, mut lens, mut q) = (Vec::new(), Vec::new(), Vec::new());
    for (r, (&s, &n)) in starts.iter().zip(runs).enumerate() {
        for t in 0..n {
            bt.extend_from_slice(&base.bt[r * m..][..m]);
            lens.push(s + t as i32);
            q.extend((0..per_tok).map(|_| rng.next()));
        }
    }
    let d = DecodeDims {
        num_seqs: lens.len(),
        ..base.d
    };
    Case {
        d,
        q,
        kv: base.kv,
        bt,
        lens,
    }
}

pub(super) fn assert_close(a: &[f32], b: &[f32]) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5, "element {i}: {x} vs {y}");
    }
}
