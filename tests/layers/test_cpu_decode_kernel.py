"""The Rust CPU decode kernel (`pagedrs._core.paged_decode_attention`, used by the torch backend on CPU in
float32) against the pure-torch decode path of the same backend."""

from __future__ import annotations

import math
import platform

import numpy as np
import pytest
import torch

from pagedrs import _core
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend
from tests.helpers import make_step_metadata

pytestmark = pytest.mark.skipif(
    not hasattr(_core, "paged_decode_attention"), reason="extension built without the CPU decode kernel"
)


def both_paths(seq_lens, query_lens, *, h, kvh, d=64, block_size=16, window=None, seed=0):
    """(kernel output, torch output) of one forward over a random cache."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 5
    meta, _ = make_step_metadata(
        seq_lens, query_lens, block_size=block_size, num_blocks=num_blocks, seed=seed
    )
    cache = torch.randn(2, num_blocks, block_size, kvh, d, generator=gen)
    t = sum(query_lens)
    q = torch.randn(t, h, d, generator=gen)
    k = torch.randn(t, kvh, d, generator=gen)
    v = torch.randn(t, kvh, d, generator=gen)
    outs = []
    for use in (True, False):
        backend = TorchAttentionBackend(use_cpu_kernels=use)
        assert backend.use_cpu_kernels is use
        outs.append(
            backend.forward(q, k, v, cache.clone(), meta, scale=1 / math.sqrt(d), sliding_window=window)
        )
    return outs


@pytest.mark.parametrize("h,kvh", [(4, 4), (9, 3), (8, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 1, 20, 100])
def test_decode_batch_matches_torch(h, kvh, window):
    gen = np.random.default_rng(h * 100 + kvh)
    seq_lens = [1, 15, 16, 17, 33, 300, 64, 5] + gen.integers(1, 400, 20).tolist()
    got, want = both_paths(seq_lens, [1] * len(seq_lens), h=h, kvh=kvh, window=window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 7])
def test_mixed_prefill_and_decode(window):
    # Decodes between prefills (not first, not contiguous): q is gathered and out scattered by token index.
    seq_lens = [40, 9, 1, 70, 23, 5]
    query_lens = [1, 9, 1, 12, 1, 3]
    got, want = both_paths(seq_lens, query_lens, h=6, kvh=2, d=32, block_size=8, window=window, seed=3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_threads_agree():
    rng = np.random.default_rng(0)
    b, h, kvh, d, bs, m = 13, 9, 3, 64, 16, 20
    q = rng.standard_normal((b, h, d), dtype=np.float32)
    cache = rng.standard_normal((2, b * m, bs, kvh, d), dtype=np.float32)
    tables = rng.permutation(b * m).astype(np.int32).reshape(b, m)
    lens = rng.integers(1, m * bs + 1, b).astype(np.int32)
    outs = []
    for threads in (1, 2, 5):
        out = np.empty_like(q)
        _core.paged_decode_attention(q, cache, tables, lens, out, 0.125, num_threads=threads)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_binding_rejects_bad_arrays():
    q = np.zeros((2, 4, 8), np.float32)
    cache = np.zeros((2, 3, 4, 2, 8), np.float32)
    tables = np.zeros((2, 2), np.int32)
    lens = np.ones(2, np.int32)
    out = np.zeros_like(q)
    call = _core.paged_decode_attention
    with pytest.raises(ValueError, match="q must be float32"):
        call(q.astype(np.float64), cache, tables, lens, out, 1.0)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        call(q, cache, tables.astype(np.int64), lens, out, 1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        call(q, cache, np.zeros((2, 4), np.int32)[:, ::2], lens, out, 1.0)
    with pytest.raises(ValueError, match=r"\[2, 3, 4, 2, 7\]"):
        call(q, np.zeros((2, 3, 4, 2, 7), np.float32), tables, lens, out, 1.0)
    with pytest.raises(ValueError, match=r"seq_lens \[3\]"):
        call(q, cache, tables, np.ones(3, np.int32), out, 1.0)
    with pytest.raises(ValueError, match="outside 0..3"):
        call(q, cache, np.full((2, 2), 3, np.int32), lens, out, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        call(q, cache, tables, np.array([1, 9], np.int32), out, 1.0)
    call(q, cache, tables, lens, out, 1.0)  # well-formed: no error


def test_env_forces_torch_path(monkeypatch):
    monkeypatch.setenv("PAGEDRS_CPU_KERNELS", "0")
    assert not TorchAttentionBackend().use_cpu_kernels
    monkeypatch.setenv("PAGEDRS_CPU_KERNELS", "1")
    assert TorchAttentionBackend().use_cpu_kernels


# The kernel sets of this architecture (`isa=`); ones this CPU lacks give way to the nearest below.
_ISAS = {"x86_64": ("portable", "avx2", "avx512-vnni"), "aarch64": ("portable", "neon", "neon-dotprod")}.get(
    platform.machine().lower(), ("portable",)
)


def torch_decode(q, cache, tables, lens, *, scale, window, cap):
    """float64 torch attention of each sequence's one query over its cached context, scores soft-capped as
    HF's eager Gemma 2 attention: ``cap * tanh(q.k * scale / cap)`` before the softmax."""
    q64, kv = torch.from_numpy(q).double(), torch.from_numpy(cache).double()
    bs, kvh = cache.shape[2], cache.shape[3]
    out = torch.zeros_like(q64)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        blocks = torch.from_numpy(tables[b]).long()[pos // bs]
        k = kv[0, blocks, pos % bs].repeat_interleave(q.shape[1] // kvh, dim=1)  # [L, H, D]
        v = kv[1, blocks, pos % bs].repeat_interleave(q.shape[1] // kvh, dim=1)
        scores = torch.einsum("hd,lhd->hl", q64[b], k) * scale
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out.numpy()


@pytest.mark.parametrize("isa", _ISAS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_head_sizes_soft_cap_and_window_match_torch_at_every_isa(isa, d):
    """Gemma 2's attention (soft cap 50 over scores scaled by query_pre_attn_scalar**-0.5; a cap of 2 that
    bites harder), windowed and not, GQA 8/2, at each head size compiled for and each kernel set."""
    rng = np.random.default_rng(d)
    b, h, kvh, bs, m = 7, 8, 2, 16, 20
    q = (3 * rng.standard_normal((b, h, d))).astype(np.float32)
    cache = rng.standard_normal((2, b * m, bs, kvh, d), dtype=np.float32)
    tables = rng.permutation(b * m).astype(np.int32).reshape(b, m)
    lens = np.array([1, 15, 16, 17, 100, 250, 320], np.int32)
    scale = 256**-0.5
    for cap in (None, 50.0, 2.0):
        for window in (None, 33):
            out = np.full_like(q, np.nan)
            _core.paged_decode_attention(q, cache, tables, lens, out, scale, window, 2, cap, isa)
            want = torch_decode(q, cache, tables, lens, scale=scale, window=window, cap=cap)
            np.testing.assert_allclose(out, want, atol=2e-5, rtol=0, err_msg=f"cap {cap} window {window}")
    capped = np.empty_like(q)
    _core.paged_decode_attention(q, cache, tables, lens, capped, scale, None, 1, logits_soft_cap=2.0, isa=isa)
    plain = np.empty_like(q)
    _core.paged_decode_attention(q, cache, tables, lens, plain, scale, None, 1, isa=isa)
    assert np.abs(capped - plain).max() > 1e-2  # the cap changes the output


def test_soft_cap_and_isa_are_checked():
    q = np.zeros((1, 2, 8), np.float32)
    cache = np.zeros((2, 1, 4, 1, 8), np.float32)
    tables, lens, out = np.zeros((1, 1), np.int32), np.ones(1, np.int32), np.zeros_like(q)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="logits_soft_cap"):
            _core.paged_decode_attention(q, cache, tables, lens, out, 1.0, logits_soft_cap=bad)
    with pytest.raises(ValueError, match="avx1024"):
        _core.paged_decode_attention(q, cache, tables, lens, out, 1.0, isa="avx1024")
