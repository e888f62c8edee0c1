//! The decode kernel against a float64 reference, on every kernel set this CPU runs.

use super::*;

/// Small deterministic generator (xorshift), values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        ((self.next() + 1.0) * 0.5 * n as f32) as usize % n
    }
}

struct Case {
    d: DecodeDims,
    q: Vec<f32>,
    kv: Vec<f32>,
    bt: Vec<i32>,
    lens: Vec<i32>,
}

/// Random cache; each sequence gets distinct random blocks (shuffled), padding entries are 0.
fn case(seed: u64, lens: &[i32], heads: usize, kv_heads: usize, hd: usize, bs: usize) -> Case {
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
fn naive(c: &Case, scale: f32, window: Option<usize>) -> Vec<f32> {
    naive_with(c, &params(scale, window, None))
}

/// `naive` with every parameter (the soft cap and the sinks applied in f64 too).
fn naive_with(c: &Case, p: &DecodeParams<'_>) -> Vec<f32> {
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

fn params(scale: f32, window: Option<usize>, cap: Option<f32>) -> DecodeParams<'static> {
    DecodeParams {
        sliding_window: window,
        logits_soft_cap: cap,
        ..DecodeParams::new(scale)
    }
}

fn run(c: &Case, scale: f32, window: Option<usize>, threads: usize) -> Vec<f32> {
    run_with(c, &params(scale, window, None), threads)
}

fn run_with(c: &Case, p: &DecodeParams<'_>, threads: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; c.q.len()];
    paged_decode_f32(&c.q, &c.kv, &c.bt, &c.lens, &mut out, &c.d, p, threads).unwrap();
    out
}

/// A case whose sequences `runs[i]` tokens at a time are the query tokens of one request: the same
/// blocks (the run's last token's), lengths growing by one.
fn verification_case(seed: u64, starts: &[i32], runs: &[usize], hd: usize, bs: usize) -> Case {
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

#[test]
fn a_verifications_tokens_together_equal_each_token_alone() {
    let scale = 0.3;
    // Runs of 9 and 3 tokens (one cut in two for the threads), single tokens, a run of 17 (more
    // than MAX_RUN), contexts crossing RUN_BLOCK and ending mid-chunk of 4; soft-capped or not.
    let sinks = [0.5, -1.0, 2.0, 3.5, -0.25, 1.0];
    for (hd, bs, cap, sinks) in [
        (64, 16, None, None),
        (32, 4, None, Some(&sinks[..])),
        (128, 8, None, None),
        (256, 16, Some(1.5), None),
        (64, 8, Some(0.7), Some(&sinks[..])),
        (64, 16, None, Some(&sinks[..])),
    ] {
        let p = DecodeParams {
            sinks,
            ..params(scale, None, cap)
        };
        let c = verification_case(5, &[150, 7, 1, 66, 200], &[9, 3, 1, 1, 17], hd, bs);
        let all = run_with(&c, &p, 2);
        let want = naive_with(&c, &p);
        let per_tok = c.d.num_heads * hd;
        for s in 0..c.d.num_seqs {
            let one = Case {
                d: DecodeDims { num_seqs: 1, ..c.d },
                q: c.q[s * per_tok..][..per_tok].to_vec(),
                kv: c.kv.clone(),
                bt: c.bt[s * c.d.max_blocks_per_seq..][..c.d.max_blocks_per_seq].to_vec(),
                lens: vec![c.lens[s]],
            };
            for threads in [1, 2] {
                let alone = run_with(&one, &p, threads);
                let together = &all[s * per_tok..][..per_tok];
                assert!(
                    alone
                        .iter()
                        .zip(together)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "hd {hd} bs {bs} token {s} (len {}) t{threads}",
                    c.lens[s]
                );
            }
        }
        assert_close(&all, &want);
        assert!(
            query_runs(
                &Ctx {
                    q: &c.q,
                    k: &c.kv,
                    v: &c.kv,
                    block_tables: &c.bt,
                    seq_lens: &c.lens,
                    d: c.d,
                    group: 3,
                    scale,
                    sliding_window: None,
                    soft_cap: cap,
                    sinks,
                    avx2: false,
                },
                1
            )
            .contains(&(0, 9)),
            "the first 9 tokens are one run"
        );
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vector_exp_is_within_a_few_ulp() {
    if !uses_avx2(Isa::detect()) {
        return;
    }
    let mut rng = Rng(3);
    let mut xs: Vec<f32> = (0..4003)
        .map(|_| -87.0 * (rng.next() + 1.0) / 2.0)
        .collect();
    xs.extend([0.0, -1e-30, -0.5, -1.0, -20.0, -87.0]);
    let mut got = xs.clone();
    // SAFETY: AVX2 and FMA detected above.
    #[allow(unsafe_code)]
    let sum = unsafe { avx2::exp_shifted(&mut got, 0.0) };
    let mut want_sum = 0.0f64;
    for (&x, &g) in xs.iter().zip(&got) {
        let want = f64::from(x).exp();
        want_sum += want;
        assert!(
            ((f64::from(g) - want) / want).abs() < 4e-7,
            "exp({x}) = {g}, want {want}"
        );
    }
    assert!((f64::from(sum) - want_sum).abs() <= 1e-6 * want_sum);
}

fn assert_close(a: &[f32], b: &[f32]) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5, "element {i}: {x} vs {y}");
    }
}

#[test]
fn matches_naive_ragged_gqa() {
    let lens = [1, 15, 16, 17, 32, 33, 100, 7];
    for (heads, kv_heads) in [(4, 4), (9, 3), (8, 2), (4, 1)] {
        for hd in [64, 128, 24, 5] {
            let c = case(7 + hd as u64, &lens, heads, kv_heads, hd, 16);
            let scale = 1.0 / (hd as f32).sqrt();
            assert_close(&run(&c, scale, None, 1), &naive(&c, scale, None));
        }
    }
}

#[test]
fn portable_copy_matches_naive() {
    let lens = [1, 15, 16, 17, 100, 7];
    for (heads, kv_heads, hd) in [(9, 3, 64), (8, 2, 128), (4, 4, 24), (4, 1, 5)] {
        let c = case(5, &lens, heads, kv_heads, hd, 16);
        for window in [None, Some(9)] {
            let p = DecodeParams {
                isa: Isa::Portable,
                ..params(0.1, window, None)
            };
            assert_close(&run_with(&c, &p, 2), &naive(&c, 0.1, window));
        }
    }
}

/// Every kernel set this CPU runs, at head sizes 64, 128, 256 (the compiled-in sizes) and one read at
/// run time, with and without a soft cap that bites (scores up to ~10 against caps of 2 and 30), a
/// window and sinks (some below the scores, some above every score), against the f64 reference.
#[test]
fn every_isa_head_size_soft_cap_window_and_sinks_match_f64() {
    let lens = [1, 15, 16, 17, 100, 7, 250];
    let sinks = [-2.0, 0.0, 1.5, 12.0, -30.0, 3.0, 0.7, 6.0];
    for isa in Isa::supported() {
        for hd in [64, 128, 256, 40] {
            let c = case(hd as u64, &lens, 8, 2, hd, 16);
            for cap in [None, Some(2.0), Some(30.0)] {
                for window in [None, Some(9)] {
                    for sinks in [None, Some(&sinks[..])] {
                        let p = DecodeParams {
                            isa,
                            sinks,
                            ..params(0.5, window, cap)
                        };
                        let got = run_with(&c, &p, 2);
                        let want = naive_with(&c, &p);
                        for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                (x - y).abs() <= 1e-5,
                                "{isa:?} hd {hd} cap {cap:?} window {window:?} sinks {} element {i}: {x} vs {y}",
                                sinks.is_some()
                            );
                        }
                    }
                }
            }
        }
    }
}

/// A sink of -inf is no sink; a sink far above every score draws the weight off every key (output
/// toward 0); a sinks array of another length than the heads is refused.
#[test]
fn sinks_take_part_in_the_softmax_and_are_checked() {
    let c = case(12, &[40, 3, 17], 4, 2, 64, 16);
    let with = |sinks: &[f32]| {
        let p = DecodeParams {
            sinks: Some(sinks),
            ..params(0.3, None, None)
        };
        run_with(&c, &p, 2)
    };
    assert_eq!(with(&[f32::NEG_INFINITY; 4]), run(&c, 0.3, None, 2));
    assert!(with(&[40.0; 4]).iter().all(|x| x.abs() < 1e-6));
    let some = with(&[0.0, 1.0, -1.0, 2.0]);
    assert_ne!(some, run(&c, 0.3, None, 2));
    let mut out = vec![0.0; c.q.len()];
    let p = DecodeParams {
        sinks: Some(&[0.0; 3]),
        ..params(0.3, None, None)
    };
    assert_eq!(
        paged_decode_f32(&c.q, &c.kv, &c.bt, &c.lens, &mut out, &c.d, &p, 1),
        Err(KernelError::Length {
            name: "sinks",
            actual: 3,
            expected: 4
        })
    );
}

#[test]
fn soft_cap_changes_the_output_and_is_checked() {
    let c = case(9, &[40, 3], 4, 2, 64, 16);
    assert_ne!(
        run_with(&c, &params(1.0, None, Some(1.0)), 1),
        run(&c, 1.0, None, 1)
    );
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let mut out = vec![0.0; c.q.len()];
        let p = params(1.0, None, Some(bad));
        let err = paged_decode_f32(&c.q, &c.kv, &c.bt, &c.lens, &mut out, &c.d, &p, 1);
        assert!(
            matches!(
                err,
                Err(KernelError::NotPositive {
                    name: "logits_soft_cap",
                    ..
                })
            ),
            "{bad}: {err:?}"
        );
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vector_tanh_is_within_a_few_ulp() {
    if !uses_avx2(Isa::detect()) {
        return;
    }
    let mut rng = Rng(4);
    let mut xs: Vec<f32> = (0..4003).map(|_| 12.0 * rng.next()).collect();
    xs.extend((0..2000).map(|_| 0.7 * rng.next()));
    xs.extend([
        0.0, -0.0, 1e-30, -1e-8, 0.625, -0.625, 0.6249, 9.0, -9.0, 100.0, -1e30,
    ]);
    let mut got = xs.clone();
    // SAFETY: AVX2 and FMA detected above.
    #[allow(unsafe_code)]
    unsafe {
        avx2::soft_cap(&mut got, 1.0)
    };
    for (&x, &g) in xs.iter().zip(&got) {
        let want = f64::from(x).tanh();
        let tol = 4.0 * f64::from(f32::EPSILON) * want.abs().max(f64::from(f32::MIN_POSITIVE));
        assert!(
            (f64::from(g) - want).abs() <= tol,
            "tanh({x}) = {g}, want {want}"
        );
    }
}

#[test]
fn sliding_window() {
    let lens = [1, 8, 9, 40, 64, 65];
    for window in [1, 8, 20, 1000] {
        let c = case(3, &lens, 6, 2, 32, 8);
        assert_close(
            &run(&c, 0.2, Some(window), 1),
            &naive(&c, 0.2, Some(window)),
        );
    }
}

#[test]
fn threads_give_identical_results() {
    let lens: Vec<i32> = (0..37).map(|i| 1 + (i * 29) % 300).collect();
    let c = case(11, &lens, 9, 3, 64, 16);
    let one = run(&c, 0.125, None, 1);
    assert_close(&one, &naive(&c, 0.125, None));
    for t in [2, 3, 8, 500] {
        assert_eq!(one, run(&c, 0.125, None, t));
    }
}

#[test]
fn empty_sequence_gives_zeros() {
    let c = case(5, &[0, 3], 2, 1, 8, 4);
    let out = run(&c, 1.0, None, 2);
    assert!(out[..16].iter().all(|&x| x == 0.0));
    assert_close(&out, &naive(&c, 1.0, None));
}

#[test]
fn rejects_bad_arguments() {
    let c = case(1, &[5, 9], 4, 2, 8, 4);
    let mut out = vec![0.0; c.q.len()];
    let call = |q: &[f32], bt: &[i32], lens: &[i32], out: &mut [f32], d: &DecodeDims| {
        paged_decode_f32(q, &c.kv, bt, lens, out, d, &DecodeParams::new(1.0), 1)
    };
    assert_eq!(
        call(&c.q[1..], &c.bt, &c.lens, &mut out, &c.d),
        Err(KernelError::Length {
            name: "q",
            actual: c.q.len() - 1,
            expected: c.q.len()
        })
    );
    let max = c.d.max_blocks_per_seq * 4;
    let err = call(&c.q, &c.bt, &[5, max as i32 + 1], &mut out, &c.d);
    assert!(matches!(err, Err(KernelError::SeqLen { seq: 1, .. })));
    let mut bt = c.bt.clone();
    bt[1] = c.d.num_blocks as i32;
    let err = call(&c.q, &bt, &c.lens, &mut out, &c.d);
    assert!(matches!(
        err,
        Err(KernelError::Block { seq: 0, idx: 1, .. })
    ));
    let d = DecodeDims {
        num_heads: 3,
        ..c.d
    };
    let err = call(&c.q, &c.bt, &c.lens, &mut out, &d);
    assert!(matches!(err, Err(KernelError::Heads { .. })));
}
