"""CupyAttentionBackend (kernels run by the CPU emulator) against the torch reference backend: one layer's
forward on random batches, then a tiny model stepping through chunked prefill and decodes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedrs.kernels._loader import CTYPES, attention_names, cache_names
from pagedrs.layers.attention.cupy import CupyAttentionBackend
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend
from pagedrs.loader import load_model
from tests.helpers import make_tiny_llama
from tests.kernels.emu.emulator import host_kernels, needs_emulator
from tests.kernels.paged_case import assert_close, make_case
from tests.models.paged_harness import assert_steps_close, run_mixed_steps

pytestmark = needs_emulator


@pytest.fixture(scope="module", autouse=True)
def emulator() -> Iterator[None]:
    names = list(cache_names())
    for ctype in CTYPES.values():
        names += attention_names(ctype, 16)
    with host_kernels(names):
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_backend_matches_torch_reference(dtype: torch.dtype, window: int | None) -> None:
    q_lens = [1, 7, 1, 12, 1]
    ctx = [9, 7, 30, 20, 1]
    case = make_case(
        q_lens, ctx, num_heads=4, num_kv_heads=2, head_size=16, block_size=8, dtype=dtype, seed=4
    )
    meta = case.meta()
    ref_cache, our_cache = case.kv_cache.clone(), case.kv_cache.clone()
    ref = TorchAttentionBackend().forward(
        case.q, case.k, case.v, ref_cache, meta, scale=0.25, sliding_window=window
    )
    ours = CupyAttentionBackend().forward(
        case.q, case.k, case.v, our_cache, meta, scale=0.25, sliding_window=window
    )
    assert torch.equal(our_cache, ref_cache)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    assert_close(ours, ref.float(), dtype, "cupy vs torch backend")


@pytest.mark.parametrize("arch", ["llama", "mistral", "smollm2"])
def test_tiny_model_steps_match_torch_backend(arch: str, tmp_path: Path) -> None:
    """Chunked prefill over two steps, a prefix-only request, then decodes: every step's logits match."""
    overrides = {"sliding_window": 5} if arch == "mistral" else {}
    model = load_model(str(make_tiny_llama(tmp_path, arch, **overrides))).model
    assert_steps_close(
        run_mixed_steps(model, TorchAttentionBackend()), run_mixed_steps(model, CupyAttentionBackend())
    )
