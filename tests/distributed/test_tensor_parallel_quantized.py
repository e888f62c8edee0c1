"""Quantized weights under tensor parallelism on CPU: each rank keeps its shard of a GGUF file's blocks
(column-parallel layers: whole rows; row-parallel: whole blocks of the input) and of a symmetric GPTQ
checkpoint kept as Q4_0 blocks, holds only that shard's bytes, and the TP=2 engine gives TP=1's greedy
ids on the quantized path under forced preemption, chunked prefill and prefix hits. A cut that would
split a block is refused naming the numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedrs.distributed.group import TPGroup
from pagedrs.layers.linear import RowParallelLinear
from pagedrs.loader import LoadedModel, load_model
from tests.distributed.helpers_tp import check_forced, run_workload, tp_engine
from tests.engine.conftest import assert_pool_free
from tests.helpers import make_tiny_gguf
from tests.layers.helpers_quant import Q, random_weight
from tests.loader.helpers_quant import make_quantized_pair


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF conversions into the test's folder, not the user's cache (the rank processes inherit it)."""
    monkeypatch.setenv("PAGEDRS_CACHE", str(tmp_path / "cache"))


LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _shard(path: Path, rank: int, size: int, dtype: str = "auto") -> LoadedModel:
    return load_model(str(path), dtype=dtype, tp=TPGroup(rank, size), with_tokenizer=False)


def _packed_bytes(loaded: LoadedModel) -> int:
    return sum(m.qweight.nbytes for m in loaded.model.modules() if getattr(m, "qweight", None) is not None)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_each_rank_keeps_its_shard_of_the_blocks(tmp_path: Path, qtype: str) -> None:
    """Rank r's packed weights dequantize to exactly rank r's shard of the dequantized (float32) model,
    and the ranks together hold the one-rank model's packed bytes."""
    path = make_tiny_gguf(tmp_path, "llama", qtype=qtype)
    whole = load_model(str(path), with_tokenizer=False)
    held = 0
    for rank in range(2):
        quant, dense = _shard(path, rank, 2), _shard(path, rank, 2, dtype="float32")
        for layer in range(len(quant.model.model.layers)):
            for name in LINEARS:
                q = quant.model.model.layers[layer].get_submodule(name)
                d = dense.model.model.layers[layer].get_submodule(name)
                assert q.qweight is not None and d.qweight is None, name
                assert tuple(q.weight.shape) == (0, d.weight.shape[1])  # no dense copy kept
                torch.testing.assert_close(q.qweight.dequantized(), d.weight.data, rtol=0, atol=0)
        held += _packed_bytes(quant)
    assert held == _packed_bytes(whole) > 0


def test_tp2_quantized_gguf_equals_tp1(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path, "llama", qtype="Q8_0")
    want, spy = run_workload(tp_engine(path, 1, dtype="auto"))
    engine = tp_engine(path, 2, dtype="auto")
    try:
        got, spy = run_workload(engine)
        check_forced(engine, spy)
        assert got == want
        assert_pool_free(engine)
    finally:
        engine.shutdown()


def test_tp2_packed_gptq_equals_tp1(tmp_path: Path) -> None:
    """Symmetric GPTQ with groups of 64 kept as Q4_0 blocks: TP=2 cuts the row-parallel layers' input
    inside a group (32 of a rank's columns from a 64-column group), which is exact because each 32-weight
    block carries its group's scale."""
    qdir, _ = make_quantized_pair(tmp_path, "gptq", bits=4, group_size=64, sym=True, desc_act=False)
    ranks = [_shard(qdir, r, 2) for r in range(2)]
    assert all(_packed_bytes(r) > 0 for r in ranks)
    assert sum(_packed_bytes(r) for r in ranks) == _packed_bytes(load_model(str(qdir), with_tokenizer=False))
    want, _ = run_workload(tp_engine(qdir, 1, dtype="auto"))
    engine = tp_engine(qdir, 2, dtype="auto")
    try:
        got, spy = run_workload(engine)
        check_forced(engine, spy)
        assert got == want
    finally:
        engine.shutdown()


def test_a_cut_inside_a_block_is_refused() -> None:
    """Q4_K's 256-weight blocks cannot be split between two ranks of 128 input columns each."""
    layer = RowParallelLinear(256, 8, tp_rank=1, tp_size=2)
    with pytest.raises(
        ValueError, match=r"each rank 128 of this Q4_K weight's 256 input columns.*256-weight"
    ):
        layer.weight_loader(layer.weight, random_weight(Q.Q4_K, 8, 256))
    ok = RowParallelLinear(512, 8, tp_rank=1, tp_size=2)
    w = random_weight(Q.Q4_K, 8, 512)
    ok.weight_loader(ok.weight, w)
    assert ok.qweight is not None
    torch.testing.assert_close(ok.qweight.dequantized(), w.materialize()[:, 256:], rtol=0, atol=1e-7)


def test_a_vocabulary_slice_keeps_its_rows_quantized(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last rank of an odd vocabulary (259 over 2: rows 130..258) keeps its 129 real rows packed: a
    lookup of another rank's id gives zeros (the all-reduce adds that rank's row), and its logits are
    padded to the partition's 130 columns for the gather, equal to the one-rank head's columns."""
    from pagedrs.layers.linear import ParallelLMHead

    w = random_weight(Q.Q8_0, 259, 64, seed=3)
    head = ParallelLMHead(259, 64, tp_rank=1, tp_size=2)
    head.weight_loader(head.weight, w)
    assert head.quant.weight is not None and head.quant.weight.out_features == 129
    monkeypatch.setattr(head.tp, "all_reduce", lambda t: t)
    monkeypatch.setattr(head.tp, "gather_last_dim", lambda t: t)
    dense = w.materialize()
    rows = super(ParallelLMHead, head).forward(torch.tensor([0, 130, 258, 129]))
    torch.testing.assert_close(rows[1:3], dense[[130, 258]], rtol=0, atol=0)
    assert not rows[0].any() and not rows[3].any()
    hidden = torch.randn(3, 64)
    logits = head.compute_logits(hidden)
    assert logits is not None and logits.shape == (3, 130) and not logits[:, 129].any()
    whole = ParallelLMHead(259, 64)  # one rank: the same kernel over the whole table
    whole.weight_loader(whole.weight, w)
    want = whole.compute_logits(hidden)
    assert want is not None
    torch.testing.assert_close(logits[:, :129], want[:, 130:], rtol=0, atol=0)


def test_liquid_scaling_of_quantized_weights_is_refused(tmp_path: Path) -> None:
    """Liquid scaling moves float tensors between ranks: a model kept quantized is refused at start-up,
    naming the way out, and no rank process is left behind."""
    import os

    from pagedrs.engine.arg_utils import EngineArgs
    from pagedrs.engine.llm_engine import LLMEngine
    from tests.helpers import child_pids, process_gone

    path = make_tiny_gguf(tmp_path, "llama", qtype="Q8_0")
    args = EngineArgs(
        model=str(path),
        device="cpu",
        liquid_gpu_range=[0, 1],
        liquid_total_num_shards=2,
        cpu_kv_cache_gb=0.01,
    )
    before = set(child_pids(os.getpid()))
    with pytest.raises(ValueError, match="kept quantized: pass dtype='float32'"):
        LLMEngine.from_engine_args(args)
    assert all(process_gone(pid) for pid in set(child_pids(os.getpid())) - before)
