use super::*;

fn sched() -> Scheduler {
    Scheduler::new(Config {
        num_blocks: 4,
        block_size: 4,
        max_model_len: 32,
        ..Config::default()
    })
    .unwrap()
}

fn req(ids: &[i64], len: usize) -> NewRequest {
    NewRequest {
        seq_ids: ids.to_vec(),
        prompt_token_ids: (1..=len as i64).collect(),
        max_tokens: 4,
        ..Default::default()
    }
}

#[test]
fn rejections_leave_no_trace() {
    let mut s = sched();
    let e = s.add_request(req(&[1], 32)).unwrap_err();
    assert!(
        e.to_string().contains("33") && e.to_string().contains("32"),
        "{e}"
    );
    let e = s.add_request(req(&[1], 17)).unwrap_err();
    assert!(
        e.to_string().contains("5 blocks") && e.to_string().contains("only 4"),
        "{e}"
    );
    assert!(matches!(
        s.add_request(req(&[1, 1], 3)),
        Err(Error::DuplicateSeqId { seq_id: 1 })
    ));
    assert!(matches!(
        s.add_request(req(&[1], 0)),
        Err(Error::EmptyPrompt { .. })
    ));
    assert!(!s.has_unfinished());
    s.check_invariants().unwrap();
}

#[test]
fn max_tokens_is_clipped_to_max_model_len() {
    let cfg = Config {
        num_blocks: 16,
        block_size: 4,
        max_model_len: 32,
        ..Config::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(NewRequest {
        max_tokens: 1000,
        ..req(&[1], 30)
    })
    .unwrap();
    let slot = s.ids[&1].slot as usize;
    assert_eq!(s.seqs[slot].stop.max_tokens, 2);
}

#[test]
fn aborting_a_parent_promotes_its_first_child() {
    let mut s = sched();
    s.add_request(req(&[1, 2, 3], 3)).unwrap();
    assert_eq!(s.num_unfinished(), 3);
    s.abort(&[1]);
    assert_eq!(s.status(2).unwrap(), Status::Waiting);
    assert_eq!(s.stats().num_waiting, 2);
    s.abort(&[3, 99]);
    s.check_invariants().unwrap();
    let p = s.schedule().unwrap();
    assert_eq!(p.req_ids, vec![2]);
    assert_eq!(p.sampled_seq_ids, vec![2]);
    s.abort(&[2]);
    assert!(!s.has_unfinished());
    assert_eq!(s.pool().num_free(), 4);
}

#[test]
fn output_token_ids_include_the_newest_tokens_across_tail_flushes() {
    let mut s = Scheduler::new(Config {
        num_blocks: 16,
        block_size: 4,
        max_model_len: 64,
        ..Config::default()
    })
    .unwrap();
    s.add_request(NewRequest {
        max_tokens: 40,
        ..req(&[7, 8], 3)
    })
    .unwrap();
    let mut want: Vec<u32> = Vec::new();
    for step in 0..37u32 {
        let p = s.schedule().unwrap();
        let sampled: Vec<i64> = (0..p.sampled_seq_ids.len())
            .map(|i| i64::from(100 + step * 2 + i as u32))
            .collect();
        let row = p.sampled_seq_ids.iter().position(|&id| id == 7).unwrap();
        want.push(sampled[row] as u32);
        s.update(p.step_id, &sampled).unwrap();
        assert_eq!(s.output_token_ids(7).unwrap(), want, "step {step}");
        assert_eq!(s.num_output_tokens(7).unwrap(), want.len());
        let mut all = vec![1, 2, 3];
        all.extend(&want);
        assert_eq!(s.token_ids(7).unwrap(), all);
    }
    assert!(matches!(
        s.output_token_ids(99),
        Err(Error::UnknownSeqId { seq_id: 99 })
    ));
}

#[test]
fn token_ids_and_cached_tokens_queries() {
    let mut s = sched();
    s.add_request(req(&[1, 2], 3)).unwrap();
    assert_eq!(s.token_ids(2).unwrap(), vec![1, 2, 3]);
    assert_eq!(s.output_token_ids(2).unwrap(), Vec::<u32>::new());
    assert_eq!(s.num_output_tokens(2).unwrap(), 0);
    assert_eq!(s.num_cached_tokens(1).unwrap(), 0);
    assert!(matches!(
        s.num_cached_tokens(5),
        Err(Error::UnknownSeqId { seq_id: 5 })
    ));
}
