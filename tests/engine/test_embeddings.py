"""Embeddings through the paged engine equal HF transformers' pooled `AutoModel` hidden states (float32,
within 1e-5) for every architecture and pooling type, with chunked prefill forced (the prompt is longer
than the token budget), with a prefix-cache hit, mixed with generation in the same steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from pagedrs import LLM, PoolingParams, SamplingParams
from tests.engine.conftest import PlanSpy
from tests.helpers import make_tiny_llama, make_tiny_model
from tests.models.helpers_configs import gpt2_config, opt_config, phi3_config

MODELS: dict[str, Callable[[Path], Path]] = {
    "llama": lambda d: make_tiny_llama(d),
    "qwen2": lambda d: make_tiny_llama(d, arch="qwen2"),
    "mistral": lambda d: make_tiny_llama(d, arch="mistral", sliding_window=6),
    "gpt2": lambda d: make_tiny_model(d / "gpt2", gpt2_config()),
    "opt-proj": lambda d: make_tiny_model(
        d / "opt", opt_config(do_layer_norm_before=False, word_embed_proj_dim=32)
    ),
    "phi3": lambda d: make_tiny_model(d / "phi3", phi3_config()),
}
PROMPTS = [list(range(3, 33)), [5, 6, 7], list(range(3, 20)) + [99, 98]]  # 30 tokens > the 8-token budget


def hf_embedding(hf: torch.nn.Module, ids: list[int], kind: str) -> torch.Tensor:
    with torch.inference_mode():
        h = hf(torch.tensor([ids])).last_hidden_state[0].float()
    vec = {"last": h[-1], "mean": h.mean(0), "cls": h[0], "first": h[0]}[kind]
    return torch.nn.functional.normalize(vec, dim=0)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = MODELS[request.param](tmp_path_factory.mktemp(request.param))
    hf = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    return folder, hf


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_embeddings_match_hf_with_chunked_prefill(model: tuple[Path, object], kind: str) -> None:
    folder, hf = model
    llm = LLM(str(folder), device="cpu", dtype="float32", disable_log_stats=True, max_num_batched_tokens=8)
    spy = PlanSpy().attach(llm.llm_engine)
    outs = llm.embed(
        [{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(pooling_type=kind), use_tqdm=False
    )
    assert spy.chunked_prefills > 0
    for ids, out in zip(PROMPTS, outs, strict=True):
        got = torch.tensor(out.outputs.embedding)
        torch.testing.assert_close(got, hf_embedding(hf, ids, kind), atol=1e-5, rtol=1e-5)
        assert out.prompt_token_ids == ids and out.finished


def test_prefix_hit_and_mixed_batch(tmp_path: Path) -> None:
    """A second prompt sharing a 16-token prefix hits the cache (last pooling) and still matches HF;
    embedding and generation requests share steps; the pool is free afterwards."""
    folder = make_tiny_llama(tmp_path)
    hf = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = LLM(str(folder), device="cpu", dtype="float32", disable_log_stats=True, block_size=4)
    engine = llm.llm_engine
    prefix = list(range(40, 56))
    first = llm.embed({"prompt_token_ids": prefix + [1, 2]}, use_tqdm=False)[0]
    engine.add_request("gen", [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add_request("emb", {"prompt_token_ids": prefix + [3, 4, 5]}, PoolingParams())
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = out
    assert engine.get_stats().prefix_cache_hits >= 16
    torch.testing.assert_close(
        torch.tensor(got["emb"].outputs.embedding),
        hf_embedding(hf, prefix + [3, 4, 5], "last"),
        atol=1e-5,
        rtol=1e-5,
    )
    torch.testing.assert_close(
        torch.tensor(first.outputs.embedding), hf_embedding(hf, prefix + [1, 2], "last"), atol=1e-5, rtol=1e-5
    )
    assert len(got["gen"].outputs[0].token_ids) == 6
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0


def test_dimensions_normalize_and_errors(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path)
    llm = LLM(str(folder), device="cpu", dtype="float32", disable_log_stats=True, max_model_len=64)
    raw = llm.embed({"prompt_token_ids": [4, 5, 6]}, PoolingParams(normalize=False), use_tqdm=False)[0]
    full = torch.tensor(raw.outputs.embedding)
    assert len(full) == 64 and abs(full.norm().item() - 1.0) > 1e-3
    cut = llm.embed({"prompt_token_ids": [4, 5, 6]}, PoolingParams(dimensions=8), use_tqdm=False)[0]
    torch.testing.assert_close(
        torch.tensor(cut.outputs.embedding), torch.nn.functional.normalize(full[:8], dim=0)
    )
    with pytest.raises(
        ValueError, match="dimensions \\(65\\) is larger than the model's embedding size \\(64\\)"
    ):
        llm.embed("x", PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.embed({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.embed({"prompt_token_ids": list(range(64))}, use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams(pooling_type="max")
    gen_only = LLM(str(folder), device="cpu", dtype="float32", disable_log_stats=True, task="generate")
    with pytest.raises(ValueError, match="--task generate"):
        gen_only.embed("x", use_tqdm=False)
    embed_only = LLM(str(folder), device="cpu", dtype="float32", disable_log_stats=True, task="embed")
    with pytest.raises(ValueError, match="--task embed"):
        embed_only.generate("x", use_tqdm=False)
    assert len(embed_only.embed("still serving", use_tqdm=False)[0].outputs.embedding) == 64
