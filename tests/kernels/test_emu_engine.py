"""The whole engine on the CUDA code path, run on the CPU: the model runner with the "cupy" backend (which
also switches every layer onto the fused kernels of cuda/layer_ops.cu), every kernel executed by the
emulator. Greedy ids in float32 equal HF transformers' with preemption and chunked prefill forced, and a
prefix shared between requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedrs.kernels._loader import attention_names, cache_names, layer_op_names
from pagedrs.layers.attention import get_attention_backend
from pagedrs.layers.attention.cupy import CupyAttentionBackend
from pagedrs.runner import model_runner
from tests.engine import conftest as engine_tests
from tests.helpers import load_hf_model, make_tiny_llama
from tests.kernels.emu.emulator import needs_emulator, recording_kernels

pytestmark = needs_emulator


@pytest.fixture
def cuda_path_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """attention_backend="cupy" builds the CUDA backend on the CPU; kernels run on the emulator. Yields the
    names of the kernels launched."""

    def backend(name: str, device: torch.device | str, *, batch_invariant: bool = False) -> object:
        if name == "cupy":
            return CupyAttentionBackend()
        return get_attention_backend(name, device, batch_invariant=batch_invariant)

    monkeypatch.setattr(model_runner, "get_attention_backend", backend)
    with recording_kernels([*cache_names(), *attention_names("float", 16), *layer_op_names("float")]) as seen:
        yield seen


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_on_cuda_kernels_gives_hf_greedy_ids(
    arch: str, tmp_path: Path, cuda_path_on_cpu: list[str]
) -> None:
    path = make_tiny_llama(tmp_path, arch)
    prompts = engine_tests.random_prompts([3, 20, 45], seed=5)
    prompts.append(prompts[2][:36] + [7, 8])  # shares 9 blocks of 4 with prompt 2
    max_tokens = [12, 10, 8, 6]
    engine = engine_tests.make_engine(
        path,
        attention_backend="cupy",
        block_size=4,
        num_kv_blocks=18,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        enforce_eager=True,
    )
    spy = engine_tests.PlanSpy().attach(engine)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(str(i), prompt, engine_tests.greedy(n))
    outs = engine_tests.run_all(engine)
    ref = engine_tests.HFReference(load_hf_model(path))
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert outs[str(i)].outputs[0].token_ids == ref(prompt, n), f"request {i}"
    assert spy.preemptions > 0 and spy.chunked_prefills > 0
    assert {
        "paged_attention_decode",
        "rms_norm",
        "fused_add_rms_norm",
        "rotary_embedding",
        "act_and_mul",
    } <= {name.split("<")[0].removeprefix("pagedrs::") for name in cuda_path_on_cpu}
    engine_tests.assert_pool_free(engine)
