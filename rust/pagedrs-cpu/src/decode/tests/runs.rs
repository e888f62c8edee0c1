//! The run path: a verification's query tokens together give each token's bits alone.

use super::helpers::*;
use crate::decode::*;

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
