//! Decode attention against the float64 reference: shapes, windows, soft caps, sinks, threads, and the
//! argument checks.

use super::helpers::*;
use crate::decode::*;

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
