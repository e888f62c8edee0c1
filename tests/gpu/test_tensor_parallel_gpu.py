"""Tensor parallelism on GPUs: the NCCL group (all-reduce, logits gather) between two processes, and
TP=2 greedy ids equal to TP=1. Needs two or more CUDA devices (skipped on the single-GPU machines)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.distributed import free_port
from tests.helpers import make_tiny_llama

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

_RANK = textwrap.dedent(
    """
    import sys, torch
    from pagedrs.distributed import connect_tp_group, create_store
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    tp = connect_tp_group(create_store("127.0.0.1", port, rank, 2, 60), rank, 2, dev, host="127.0.0.1",
                          timeout_s=60)
    assert type(tp.device_pg).__name__ == "ProcessGroupNCCL", type(tp.device_pg)
    t = torch.full((4,), float(rank + 1), device=dev)
    tp.all_reduce(t)
    assert t.tolist() == [3.0] * 4, t
    g = tp.gather_last_dim(torch.full((2, 3), float(rank), device=dev))
    if rank == 0:
        assert g.shape == (2, 6) and g[:, 3:].eq(1).all() and g[:, :3].eq(0).all(), g
    else:
        assert g is None
    tp.abort()
    print("ok", rank)
    """
)


def test_nccl_group_all_reduce_and_gather() -> None:
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(port)], stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "ok 0" in outs[0] and "ok 1" in outs[1]


def test_tp2_on_two_gpus_equals_one(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["tensor parallel on GPUs", "abc"]
    kw = dict(device="cuda", dtype="float32", enforce_eager=True, disable_log_stats=True)
    one = [o.outputs[0].token_ids for o in LLM(str(folder), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(folder), tensor_parallel_size=2, **kw)
    try:
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert one == two
