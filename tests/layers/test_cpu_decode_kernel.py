"""The Rust CPU decode kernel (`pagedrs._core.paged_decode_attention`, used by the torch backend on CPU in
float32) against the pure-torch decode path of the same backend."""

from __future__ import annotations

import math

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
