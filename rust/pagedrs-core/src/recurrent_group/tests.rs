use super::*;
use crate::prefix_cache::{block_hash, root_hash};
use crate::{Config, NewRequest, Scheduler};

const BS: usize = 4;

/// A running sequence of `len` tokens (1, 2, ..), `num_computed` of them computed.
fn seq(len: usize, num_computed: usize) -> Seq {
    let mut s = Scheduler::new(Config {
        num_blocks: 64,
        block_size: BS,
        max_model_len: 256,
        ..Config::default()
    })
    .unwrap();
    s.add_request(NewRequest {
        seq_ids: vec![1],
        prompt_token_ids: (1..=len as i64).collect(),
        max_tokens: 1,
        ..Default::default()
    })
    .unwrap();
    let mut q = s.seqs[0].clone();
    q.flush();
    q.num_computed = num_computed;
    q.status = Status::Running;
    q
}

fn chain(tokens: &[u32], blocks: usize) -> Vec<u64> {
    let mut c = vec![root_hash(0)];
    for i in 0..blocks {
        c.push(block_hash(c[i], &tokens[i * BS..(i + 1) * BS]));
    }
    c
}

fn items(c: &[u64], idx: &[usize]) -> Vec<CacheItem> {
    idx.iter()
        .map(|&i| CacheItem {
            block: BlockId(0),
            hash: c[i + 1],
            parent: c[i],
            extra_key: 0,
            slot: 0,
            idx: i as u32,
        })
        .collect()
}

#[test]
fn slots_are_taken_forked_and_freed() {
    let mut g = RecurrentGroup::new(3, 0, BS);
    g.admit(0, Vec::new(), 10);
    let s0 = g.state_slot(0).unwrap();
    g.fork(0, 1);
    let s1 = g.state_slot(1).unwrap();
    assert_ne!(s0, s1);
    assert_eq!(g.take_copies(), vec![i64::from(s0), i64::from(s1)]);
    assert!(g.take_copies().is_empty(), "copies are handed over once");
    let (mut sm, mut t) = (Vec::new(), Vec::new());
    g.plan_row(1, 3, 5, 2, &mut sm, &mut t);
    assert_eq!(
        (sm, t),
        (vec![-1, -1], vec![s1 as i32, 0]),
        "no snapshot pool"
    );
    assert_eq!(g.pool().unwrap().num_free(), 1);
    g.free(0);
    g.free(0); // a second free is a no-op
    assert_eq!(g.pool().unwrap().num_free(), 2);
    assert_eq!(g.state_slot(0), None);
}

#[test]
fn snapshots_at_block_boundaries_serve_the_last_one_and_are_restored() {
    let q = seq(20, 0);
    let c = chain(&q.tokens, 5);
    let mut g = RecurrentGroup::new(2, 4, BS);
    assert_eq!(g.longest_hit(4, &c, &q.tokens), (0, Vec::new()));
    // A step of 10 tokens crosses boundaries 4 and 8: the plan names their snapshots at
    // positions 3 and 7 (slot ids after the 2 live slots).
    g.admit(0, Vec::new(), 10);
    let (mut sm, mut t) = (Vec::new(), Vec::new());
    g.plan_row(0, 0, 10, 3, &mut sm, &mut t);
    let snaps: Vec<i64> = sm.iter().copied().filter(|&s| s >= 0).collect();
    assert_eq!(snaps.len(), 2);
    assert!(sm[3] >= 2 && sm[7] >= 2 && sm.iter().filter(|&&s| s < 0).count() == 8);
    g.cache(&items(&c, &[0, 1]), std::slice::from_ref(&q));
    g.release(0, 10);
    g.check(std::slice::from_ref(&q)).unwrap();
    // The hit is the last boundary holding a snapshot, capped by `max_blocks`.
    let (n, hit) = g.longest_hit(4, &c, &q.tokens);
    assert_eq!(n, 2);
    assert_eq!(i64::from(hit[1]) + 2, sm[7]);
    assert_eq!(g.longest_hit(1, &c, &q.tokens).0, 1);
    g.free(0);
    // A sequence admitted with the hit restores its live slot from the snapshot in its first plan.
    g.admit(1, hit.clone(), 12);
    let (mut sm, mut t) = (Vec::new(), Vec::new());
    g.plan_row(1, 8, 12, 3, &mut sm, &mut t);
    assert_eq!(i64::from(t[1]) - 1, i64::from(hit[1]) + 2, "restore entry");
    assert!(sm[3] >= 2, "boundary 12 gets a snapshot");
    g.take_copies();
    let (mut sm2, mut t2) = (Vec::new(), Vec::new());
    g.plan_row(1, 12, 13, 3, &mut sm2, &mut t2);
    assert_eq!(t2[1], 0, "restored once");
    g.free(1);
    assert_eq!(
        g.snapshots().num_free(),
        4,
        "every snapshot is free (cached or not)"
    );
}

#[test]
fn a_full_snapshot_pool_evicts_the_least_recently_used_snapshot() {
    let q = seq(20, 0);
    let c = chain(&q.tokens, 5);
    let mut g = RecurrentGroup::new(1, 2, BS);
    g.admit(0, Vec::new(), 8);
    g.cache(&items(&c, &[0, 1]), std::slice::from_ref(&q));
    g.release(0, 8);
    assert_eq!(g.longest_hit(4, &c, &q.tokens).0, 2);
    // Boundaries 12 and 16 take the two cached snapshots (block 0's first, the older one).
    let mut q2 = q.clone();
    q2.num_computed = 8;
    g.grow(0, &q2, 16);
    assert_eq!(
        g.longest_hit(4, &c, &q.tokens).0,
        0,
        "both evicted for the new step"
    );
    g.cache(&items(&c, &[2, 3]), std::slice::from_ref(&q));
    g.release(0, 16);
    assert_eq!(g.longest_hit(4, &c, &q.tokens).0, 4);
    assert_eq!(g.longest_hit(3, &c, &q.tokens).0, 3);
    assert_eq!(
        g.longest_hit(2, &c, &q.tokens).0,
        0,
        "block 1's snapshot was evicted"
    );
    g.free(0);
    assert!(g.reset_prefix_cache());
    assert_eq!(g.longest_hit(4, &c, &q.tokens).0, 0);
}

#[test]
fn snapshots_cached_and_evicted_are_the_groups_kv_events() {
    use crate::kv_events::KvEventKind::{Removed, Stored};
    let q = seq(20, 0);
    let c = chain(&q.tokens, 5);
    let mut g = RecurrentGroup::new(1, 2, BS);
    g.pool_mut().unwrap().set_kv_events(true);
    g.admit(0, Vec::new(), 8);
    g.cache(&items(&c, &[0, 1]), std::slice::from_ref(&q));
    g.release(0, 8);
    let ev = g.pool_mut().unwrap().take_kv_events();
    assert_eq!(
        (ev.kinds, ev.hashes),
        (vec![Stored, Stored], vec![c[1], c[2]])
    );
    assert_eq!(ev.tokens, q.tokens[..2 * BS].to_vec());
    // The next step's boundaries reuse both cached snapshots: each eviction is an event.
    let mut q2 = q.clone();
    q2.num_computed = 8;
    g.grow(0, &q2, 16);
    let ev = g.pool_mut().unwrap().take_kv_events();
    assert_eq!(ev.kinds, vec![Removed, Removed]);
    let mut removed = ev.hashes.clone();
    removed.sort_unstable();
    let mut want = vec![c[1], c[2]];
    want.sort_unstable();
    assert_eq!(removed, want);
}
