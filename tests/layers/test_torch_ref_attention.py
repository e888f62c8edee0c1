"""The reference paged attention backend against a naive dense causal attention (float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedrs.layers.attention import Attention, AttentionBackend, ForwardContext, causal_attention
from pagedrs.layers.attention.selector import get_attention_backend
from pagedrs.layers.attention.torch_ref import (
    MAX_GROUPS,
    TorchAttentionBackend,
    _group_bounds,
    gather_kv,
    step_plan,
    write_kv_cache,
)
from tests.helpers import make_step_metadata
from tests.layers.helpers_attention import naive_attention


def run_case(
    seq_lens, query_lens, *, h=4, kvh=2, d=16, block_size=4, window=None, seed=0, soft_cap=None, backend=None
):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    meta, positions = make_step_metadata(
        seq_lens, query_lens, block_size=block_size, num_blocks=num_blocks, seed=seed
    )
    cache = torch.zeros(2, num_blocks, block_size, kvh, d)
    # Full context of every request; the prefix (not new this step) is already in the cache.
    ks = [torch.randn(s, kvh, d, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, kvh, d, generator=gen) for s in seq_lens]
    qs = [torch.randn(q, h, d, generator=gen) for q in query_lens]
    for b, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        table = meta.block_tables[b].long()
        prefix = torch.arange(s - q)
        slots = table[prefix // block_size] * block_size + prefix % block_size
        write_kv_cache(ks[b][: s - q], vs[b][: s - q], cache, slots)
    q_new = torch.cat(qs)
    k_new = torch.cat([k[s - q :] for k, s, q in zip(ks, seq_lens, query_lens, strict=True)])
    v_new = torch.cat([v[s - q :] for v, s, q in zip(vs, seq_lens, query_lens, strict=True)])
    scale = 1 / math.sqrt(d)
    out = (backend or TorchAttentionBackend()).forward(
        q_new, k_new, v_new, cache, meta, scale=scale, sliding_window=window, logits_soft_cap=soft_cap
    )
    start = 0
    for b, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        ref = naive_attention(qs[b], ks[b], vs[b], s - q, scale, window, soft_cap)
        torch.testing.assert_close(out[start : start + q].double(), ref, atol=1e-5, rtol=1e-5)
        kb, vb = gather_kv(cache, meta.block_tables[b], s)  # the whole context is in the cache now
        torch.testing.assert_close(kb, ks[b])
        torch.testing.assert_close(vb, vs[b])
        start += q
    return positions


def test_backend_satisfies_protocol():
    backend = get_attention_backend("torch", "cpu")
    assert isinstance(backend, AttentionBackend) and backend.name == "torch"
    assert get_attention_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        get_attention_backend("cupy", "cpu")


def test_single_prefill_no_cache():
    run_case([13], [13])


def test_ragged_mixed_batch():
    # decodes, a fresh prefill, chunked prefills over cached prefixes, in no particular order
    run_case([9, 1, 17, 30, 5, 8], [1, 1, 17, 7, 1, 3])


def test_decodes_only_with_padded_tables():
    run_case([1, 4, 5, 33, 16], [1, 1, 1, 1, 1], block_size=8)


@pytest.mark.parametrize("h,kvh", [(4, 4), (4, 2), (6, 1)])
def test_gqa_and_mqa(h, kvh):
    run_case([12, 20, 7], [12, 1, 3], h=h, kvh=kvh)


@pytest.mark.parametrize("window", [1, 3, 8, 64])
def test_sliding_window(window):
    run_case([20, 9, 25, 6], [20, 1, 5, 1], window=window)


def test_block_boundaries():
    # contexts ending exactly on a block boundary and chunks starting/ending on one
    run_case([8, 9, 16, 4, 12], [4, 1, 8, 4, 5], block_size=4)
    run_case([16, 17], [16, 1], block_size=16)


def test_reuses_plan_across_layers():
    meta, _ = make_step_metadata([5, 3], [1, 3], block_size=4, num_blocks=4)
    cache = torch.zeros(2, 4, 4, 1, 8)
    backend = TorchAttentionBackend()
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    a = backend.forward(q, k, k, cache, meta, scale=0.3, sliding_window=None)
    b = backend.forward(q, k, k, cache.clone(), meta, scale=0.3, sliding_window=None)
    torch.testing.assert_close(a, b)


def test_attention_module_no_cache_is_causal():
    torch.manual_seed(0)
    attn = Attention(num_heads=4, head_size=8, num_kv_heads=2, layer_idx=0, scale=0.25, sliding_window=3)
    q, k, v = torch.randn(10, 32), torch.randn(10, 16), torch.randn(10, 16)
    out = attn(q, k, v, ForwardContext(attn_metadata=None, kv_caches=[], backend=None))
    ref = naive_attention(q.view(10, 4, 8), k.view(10, 2, 8), v.view(10, 2, 8), 0, 0.25, 3)
    torch.testing.assert_close(out.view(10, 4, 8).double(), ref, atol=1e-5, rtol=1e-5)
    direct = causal_attention(
        q.view(10, 4, 8), k.view(10, 2, 8), v.view(10, 2, 8), scale=0.25, sliding_window=3
    )
    torch.testing.assert_close(out.view(10, 4, 8), direct)


def test_attention_module_uses_layer_cache():
    meta, _ = make_step_metadata([6], [6], block_size=4, num_blocks=3)
    caches = [torch.zeros(2, 3, 4, 2, 8) for _ in range(2)]
    attn = Attention(num_heads=2, head_size=8, num_kv_heads=2, layer_idx=1, scale=0.3)
    q = torch.randn(6, 16)
    attn(q, q, q, ForwardContext(meta, caches, TorchAttentionBackend()))
    assert caches[0].abs().sum() == 0 and caches[1].abs().sum() > 0


def test_decodes_grouped_by_length():
    lens = [1, 2, 5, 9, 17, 33, 65, 100, 130, 200, 3, 64, 64, 7]
    run_case(lens, [1] * len(lens), block_size=4, window=None)
    run_case(lens, [1] * len(lens), block_size=4, window=20)
    meta, _ = make_step_metadata(lens, [1] * len(lens), block_size=4, num_blocks=200)
    groups = step_plan(meta).decode_groups
    assert 1 < len(groups) <= MAX_GROUPS
    assert sorted(int(i) for g in groups for i in g.token_idx) == list(range(len(lens)))
    for g in groups:  # each group pads to its own longest context only
        assert g.num_blocks == max(-(-int(s) // 4) for s in g.seq_lens)


def test_group_bounds():
    assert _group_bounds(np.array([10, 9, 8, 7, 3, 2, 1])) == [(0, 3), (3, 4), (4, 7)]
    assert len(_group_bounds(np.arange(1000, 0, -1))) == MAX_GROUPS


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_short_queries_over_a_context_equal_decoding_token_by_token(cpu_kernels: bool) -> None:
    """A speculative verification (the last token and its drafts over a cached context) gives, bit for
    bit, what decoding its tokens one a step gives; next to a fresh prefill and a plain decode."""
    block_size, h, kvh, d = 4, 4, 2, 16
    seq_lens, query_lens = [23, 9, 7], [5, 1, 7]
    meta, _ = make_step_metadata(seq_lens, query_lens, block_size=block_size, num_blocks=16, seed=3)
    gen = torch.Generator().manual_seed(3)
    cache = torch.zeros(2, 16, block_size, kvh, d)
    ks = [torch.randn(s, kvh, d, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, kvh, d, generator=gen) for s in seq_lens]
    for b, s in enumerate(seq_lens):
        table = meta.block_tables[b].long()
        pos = torch.arange(s)
        write_kv_cache(ks[b], vs[b], cache, table[pos // block_size] * block_size + pos % block_size)
    q = torch.randn(sum(query_lens), h, d, generator=gen)
    backend = TorchAttentionBackend(use_cpu_kernels=cpu_kernels)
    plan = step_plan(meta)
    assert [p[0] for p in plan.prefills] == [2]  # only the fresh prefill runs as one query block
    q_new = [ks[b][s - n :] for b, (s, n) in enumerate(zip(seq_lens, query_lens, strict=True))]
    v_new = [vs[b][s - n :] for b, (s, n) in enumerate(zip(seq_lens, query_lens, strict=True))]
    out = backend.forward(q, torch.cat(q_new), torch.cat(v_new), cache, meta, scale=0.25, sliding_window=None)
    for j in range(5):  # request 0's token j alone, as the decode of a context of 19 + j tokens
        one, _ = make_step_metadata([19 + j], [1], block_size=block_size, num_blocks=16, seed=3)
        one.block_tables = meta.block_tables[:1].clone()
        one.slot_mapping = meta.slot_mapping[j : j + 1].clone()
        alone = backend.forward(
            q[j : j + 1],
            ks[0][18 + j : 19 + j],
            vs[0][18 + j : 19 + j],
            cache,
            one,
            scale=0.25,
            sliding_window=None,
        )
        assert torch.equal(alone[0], out[j]), f"token {j}"
    ref = naive_attention(q[:5], ks[0], vs[0], 18, 0.25, None)
    torch.testing.assert_close(out[:5].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cpu_kernels", [True, False])
@pytest.mark.parametrize("window", [None, 5])
def test_logits_soft_cap(cpu_kernels, window):
    """Gemma 2's capped scores, on decodes (grouped and through the CPU-kernel route), prefill chunks over
    a cached prefix and whole prompts; a cap of 0.5 changes the result (random scores exceed it)."""
    backend = TorchAttentionBackend(use_cpu_kernels=cpu_kernels)
    run_case([20, 9, 25, 6, 1], [20, 1, 5, 1, 1], window=window, soft_cap=0.5, backend=backend)
    q, k, v = (torch.randn(9, 2, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    capped = causal_attention(q, k, v, scale=0.125, sliding_window=window, logits_soft_cap=0.5)
    ref = naive_attention(q, k, v, 0, 0.125, window, 0.5)
    torch.testing.assert_close(capped.double(), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(capped, causal_attention(q, k, v, scale=0.125, sliding_window=window))


class _KernelBackend(TorchAttentionBackend):
    """Stands in for a kernel backend (named "cupy"): records which layers reached it."""

    name = "cupy"

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[int] = []

    def forward(self, q, k, v, kv_cache, meta, *, scale, sliding_window, logits_soft_cap=None):
        self.layers.append(q.shape[-1])
        return super().forward(
            q,
            k,
            v,
            kv_cache,
            meta,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )


def test_layers_a_kernel_lacks_run_on_the_reference():
    """A soft-capped layer, or a head size the CUDA kernels lack, goes to the torch reference (one shared
    instance); the other layers stay on the step's backend, and routes_to_reference says so."""
    from pagedrs.kernels import HEAD_SIZES
    from pagedrs.layers.attention.selector import kernel_takes, route_layer, routes_to_reference

    assert 64 in HEAD_SIZES and 24 not in HEAD_SIZES  # kernel_takes follows HEAD_SIZES
    kernel = _KernelBackend()
    plain = Attention(2, 64, 1, 0, scale=0.125)
    capped = Attention(2, 64, 1, 1, scale=0.125, logits_soft_cap=50.0)
    odd = Attention(2, 24, 1, 2, scale=0.2)
    meta, _ = make_step_metadata([6], [6], block_size=4, num_blocks=4)
    caches = [torch.zeros(2, 4, 4, 1, d) for d in (64, 64, 24)]
    ctx = ForwardContext(meta, caches, kernel)
    for layer in (plain, capped, odd):
        d = layer.head_size
        layer(torch.randn(6, 2 * d), torch.randn(6, d), torch.randn(6, d), ctx)
    cap_on_kernel = kernel_takes("cupy", head_size=64, logits_soft_cap=50.0)  # once the CUDA kernels cap
    assert kernel.layers == ([64, 64] if cap_on_kernel else [64])  # the odd head size never reached it
    ref = route_layer(kernel, 24, None)
    assert isinstance(ref, TorchAttentionBackend) and ref is not kernel
    assert route_layer(kernel, 64, 50.0) is (kernel if cap_on_kernel else ref)  # one shared reference
    assert route_layer(kernel, 64, None) is kernel
    assert kernel_takes("cpu_decode", head_size=256, logits_soft_cap=50.0)
    assert routes_to_reference(torch.nn.ModuleList([plain, odd]), kernel)
    assert not routes_to_reference(torch.nn.ModuleList([plain]), kernel)
    assert not routes_to_reference(torch.nn.ModuleList([plain, capped, odd]), TorchAttentionBackend())
    with pytest.raises(ValueError, match="logits_soft_cap must be positive"):
        Attention(2, 64, 1, 0, scale=1.0, logits_soft_cap=0.0)
