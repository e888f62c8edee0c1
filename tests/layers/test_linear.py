"""Tensor-parallel-aware linear layers: fused shard loading, per-rank splits (simulated, no process group)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedrs.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


def load(layer, name: str, tensor: torch.Tensor, shard=None) -> None:
    param = getattr(layer, name)
    if shard is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard)


def test_column_split_across_ranks():
    w, b, x = torch.randn(12, 8), torch.randn(12), torch.randn(3, 8)
    outs = []
    for rank in range(2):
        layer = ColumnParallelLinear(8, 12, bias=True, tp_rank=rank, tp_size=2)
        load(layer, "weight", w)
        load(layer, "bias", b)
        assert layer.weight.shape == (6, 8)
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, -1), F.linear(x, w, b))


def test_row_split_partial_sums():
    w, b, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    total = torch.zeros(3, 5)
    for rank in range(2):
        layer = RowParallelLinear(8, 5, bias=True, reduce_results=False, tp_rank=rank, tp_size=2)
        load(layer, "weight", w)
        load(layer, "bias", b)
        assert layer.weight.shape == (5, 4)
        total += F.linear(x[:, rank * 4 : (rank + 1) * 4], layer.weight)
    torch.testing.assert_close(total + b, F.linear(x, w, b))
    single = RowParallelLinear(8, 5, bias=True)
    load(single, "weight", w)
    load(single, "bias", b)
    torch.testing.assert_close(single(x), F.linear(x, w, b))


def test_merged_shards_and_fused_checkpoint():
    gate, up, x = torch.randn(6, 4), torch.randn(6, 4), torch.randn(2, 4)
    a = MergedColumnParallelLinear(4, [6, 6])
    load(a, "weight", gate, 0)
    load(a, "weight", up, 1)
    b = MergedColumnParallelLinear(4, [6, 6])
    load(b, "weight", torch.cat([gate, up]))  # e.g. Phi-3's gate_up_proj
    torch.testing.assert_close(a(x), torch.cat([x @ gate.T, x @ up.T], -1))
    torch.testing.assert_close(a.weight, b.weight)
    assert a.shard_ids == (0, 1)
    with pytest.raises(ValueError, match="shape mismatch"):
        load(a, "weight", torch.randn(5, 4), 0)
    with pytest.raises(ValueError, match="unknown shard"):
        load(a, "weight", gate, 2)


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 2, 1), (4, 2, 2), (4, 1, 2), (4, 4, 4)])
def test_qkv_split(heads, kv_heads, tp):
    d, hidden = 3, 8
    q, k, v = (
        torch.randn(heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
    )
    qb, kb, vb = torch.randn(heads * d), torch.randn(kv_heads * d), torch.randn(kv_heads * d)
    x = torch.randn(2, hidden)
    qs, ks, vs = [], [], []
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, bias=True, tp_rank=rank, tp_size=tp)
        for shard, t, tb in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            load(layer, "weight", t, shard)
            load(layer, "bias", tb, shard)
        fused = QKVParallelLinear(hidden, d, heads, kv_heads, bias=False, tp_rank=rank, tp_size=tp)
        load(fused, "weight", torch.cat([q, k, v]))  # e.g. Phi-3's qkv_proj
        torch.testing.assert_close(fused.weight, layer.weight)
        a, b, c = layer.split_qkv(layer(x))
        qs.append(a)
        if rank % layer.kv_replicas == 0:
            ks.append(b)
            vs.append(c)
    torch.testing.assert_close(torch.cat(qs, -1), F.linear(x, q, qb))
    torch.testing.assert_close(torch.cat(ks, -1), F.linear(x, k, kb))
    torch.testing.assert_close(torch.cat(vs, -1), F.linear(x, v, vb))


def test_vocab_split_and_lm_head():
    w = torch.randn(11, 4)
    ids = torch.tensor([0, 5, 10])
    emb = VocabParallelEmbedding(11, 4)
    load(emb, "weight", w)
    torch.testing.assert_close(emb(ids), w[ids])
    head = ParallelLMHead(11, 4, dtype=torch.bfloat16)
    load(head, "weight", w)
    logits = head.compute_logits(torch.randn(2, 4, dtype=torch.bfloat16))
    assert logits.shape == (2, 11) and logits.dtype == torch.float32
    shard = VocabParallelEmbedding(11, 4, tp_rank=1, tp_size=2)  # rows 6..10 + one padding row
    load(shard, "weight", w)
    torch.testing.assert_close(shard.weight[:5], w[6:])
    assert shard.weight[5].abs().sum() == 0
    with pytest.raises(ValueError, match="shape mismatch"):
        load(emb, "weight", torch.randn(10, 4))


def test_indivisible_split_rejected():
    with pytest.raises(ValueError, match="not divisible"):
        ColumnParallelLinear(4, 7, tp_rank=0, tp_size=2)
