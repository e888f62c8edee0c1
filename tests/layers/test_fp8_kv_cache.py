"""kv_cache_dtype="fp8" (e4m3) and "fp8_e5m2": the torch backend stores K/V in fp8 (saturating, per-tensor
scale 1.0) and reads them back into the model's dtype; the attention equals dense attention over the
fp8-rounded K/V; the pool holds 4x the float32 blocks in the same memory; an engine's greedy ids do not
depend on chunking, prefix hits or preemption. (The CUDA kernels' fp8 path: tests/kernels.)"""

from __future__ import annotations

import math

import pytest
import torch

from pagedrs import LLM, SamplingParams
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend, to_cache_dtype, write_kv_cache
from tests.helpers import FP8_SAME_CACHE_TOL, FP8_VS_F32_TOL, greedy_agreement, make_step_metadata
from tests.layers.helpers_attention import naive_attention

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize(("seq_lens", "query_lens"), [([9, 17, 5], [1, 1, 1]), ([12, 7, 20], [5, 7, 1])])
def test_attention_over_fp8_cache_equals_dense_over_rounded_kv(
    dtype: torch.dtype, seq_lens: list[int], query_lens: list[int]
) -> None:
    gen = torch.Generator().manual_seed(3)
    h, kvh, d, bs = 4, 2, 16, 4
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 2
    meta, _ = make_step_metadata(seq_lens, query_lens, block_size=bs, num_blocks=num_blocks, seed=1)
    cache = torch.zeros(2, num_blocks, bs, kvh, d, dtype=dtype)
    # 3x a unit normal, plus one value past e4m3's range: it saturates instead of becoming NaN
    ks = [3 * torch.randn(s, kvh, d, generator=gen) for s in seq_lens]
    vs = [3 * torch.randn(s, kvh, d, generator=gen) for s in seq_lens]
    ks[0][0, 0, 0] = 1000.0
    qs = [torch.randn(q, h, d, generator=gen) for q in query_lens]
    for b, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        table = meta.block_tables[b].long()
        prefix = torch.arange(s - q)
        write_kv_cache(ks[b][: s - q], vs[b][: s - q], cache, table[prefix // bs] * bs + prefix % bs)
    k_new = torch.cat([k[s - q :] for k, s, q in zip(ks, seq_lens, query_lens, strict=True)])
    v_new = torch.cat([v[s - q :] for v, s, q in zip(vs, seq_lens, query_lens, strict=True)])
    scale = 1 / math.sqrt(d)
    out = TorchAttentionBackend(use_cpu_kernels=True).forward(
        torch.cat(qs), k_new, v_new, cache, meta, scale=scale, sliding_window=None
    )
    assert cache.dtype == dtype and torch.isfinite(cache.float()).all()
    big = float(to_cache_dtype(torch.tensor(1000.0), dtype).float())
    assert float(cache.float().abs().max()) == big and (big == 448.0) == (dtype == torch.float8_e4m3fn)
    row = 0
    for b, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        kr = to_cache_dtype(ks[b], dtype).float()
        vr = to_cache_dtype(vs[b], dtype).float()
        ref = naive_attention(qs[b], kr, vr, s - q, scale, None)
        torch.testing.assert_close(out[row : row + q].double(), ref, atol=2e-5, rtol=2e-5)
        exact = naive_attention(qs[b], ks[b], vs[b], s - q, scale, None)
        assert (out[row : row + q].double() - exact).abs().max() > 1e-4  # it really was rounded
        row += q


def _llm(**kw: object) -> LLM:
    return LLM(device="cpu", dtype="float32", max_model_len=512, disable_log_stats=True, **kw)


def test_engine_with_fp8_cache() -> None:
    """The default model: 4x the blocks of a float32 cache in the same memory. With chunked prefill
    (32-token budget), prefix hits and preemption forced (a pool of 8 blocks) the greedy run agrees with
    the roomy one on any machine in what an fp8 cache can guarantee across batch shapes: the same tokens
    with logprobs within FP8_SAME_CACHE_TOL until a near tie flips; and both are that close (FP8_VS_F32_TOL)
    to a float32 cache. (Exact ids are not the guarantee: rounding to fp8 turns a last-bit difference of
    a float32 matmul over another batch shape into a different fp8 value near a rounding boundary.)"""
    intro = "You are a helpful assistant. Answer briefly and clearly, in plain English, without lists. "
    prompts = [
        intro + "The three primary colors are",
        intro + "The three primary colors are red, yellow and",
        intro + "Write one sentence about the ocean:",
        "Name a famous scientist and what they discovered:",
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)

    def run(llm: LLM) -> list[tuple[list[int], list]]:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs or []) for o in outs]

    llm = _llm(kv_cache_dtype="fp8", cpu_kv_cache_gb=0.02)
    runner = llm.llm_engine.runner
    try:
        assert runner.kv_dtype == torch.float8_e4m3fn and runner.backend.name == "torch"
        assert runner.kv_pool.kv_caches[0].dtype == torch.float8_e4m3fn
        fp8_blocks = runner.kv_pool.num_blocks
        plain = run(llm)
    finally:
        llm.shutdown()
    llm = _llm(cpu_kv_cache_gb=0.02)
    try:
        f32_blocks = llm.llm_engine.runner.kv_pool.num_blocks
        f32 = run(llm)
    finally:
        llm.shutdown()
    assert fp8_blocks == 4 * f32_blocks or abs(fp8_blocks - 4 * f32_blocks) < 4
    llm = _llm(kv_cache_dtype="fp8", num_kv_blocks=8, max_num_batched_tokens=32, max_num_seqs=4)
    try:
        forced = run(llm)
        stats = llm.llm_engine.engine_core.get_stats()
    finally:
        llm.shutdown()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    common = [greedy_agreement(p, f, FP8_SAME_CACHE_TOL) for p, f in zip(plain, forced, strict=True)]
    assert sum(common) >= len(prompts) * 24 // 2, common  # a flip is rare: most tokens precede it
    for p, f in zip(plain, f32, strict=True):
        greedy_agreement(p, f, FP8_VS_F32_TOL)


@pytest.mark.parametrize("dtype", FP8)
def test_to_cache_dtype_rounds_to_nearest_even_and_saturates(dtype: torch.dtype) -> None:
    """Against every finite value of the format (an independent table, not torch's cast): the nearest
    one, ties to the even code, beyond the largest finite value the largest (no NaN, no infinity)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = torch.isfinite(codes)
    values, order = codes[finite].double().sort()
    code_of = torch.arange(256)[finite][order]
    gen = torch.Generator().manual_seed(0)
    mids = (values[1:] + values[:-1]) / 2  # exact ties
    x = torch.cat(
        [mids, values, 3 * values.max() * (torch.rand(4096, generator=gen, dtype=torch.float64) - 0.5)]
    )
    x = x[torch.isfinite(x)].float()
    got = to_cache_dtype(x, dtype).view(torch.uint8).long()
    dist = (x.double()[:, None] - values[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    ties = dist <= best  # one or two candidates
    cand = torch.where(ties, code_of[None, :], torch.full_like(dist, 10**6, dtype=torch.long))
    even = torch.where(ties & (code_of[None, :] % 2 == 0), code_of[None, :], torch.full_like(cand, 10**6))
    want = torch.where(ties.sum(dim=1) > 1, even.min(dim=1).values, cand.min(dim=1).values)
    vals = codes.double()
    # +0 and -0 are both correct for a value that rounds to zero
    agree = (got == want) | ((vals[got] == 0) & (vals[want] == 0))
    assert agree.all(), (x[~agree][:5], got[~agree][:5], want[~agree][:5])
