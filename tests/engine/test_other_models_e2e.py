"""GPT-2, OPT and Phi-3 end to end: greedy token ids through the engine equal HF `generate` (float32) with
preemption, chunked prefill and prefix caching each forced on (and checked to have fired), from
safetensors and .bin checkpoints; and the OpenAI server answers /v1/completions like `LLM.generate`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import transformers

from tests.engine.conftest import (
    HFReference,
    PlanSpy,
    assert_pool_free,
    greedy,
    make_engine,
    random_prompts,
    run_all,
)
from tests.helpers import load_hf_model, make_tiny_model
from tests.models.helpers_configs import gpt2_config, longrope_overrides, opt_config, phi3_config

MAX_TOKENS = 12
BLOCK_SIZE = 4

# Every sequence stays under 64 tokens. longrope-short: all within the original context (short factors,
# cos/sin scaled by the attention factor); longrope-long: every request is past it from its first chunk on
# (long factors). A request crossing the threshold mid-way is not HF-identical (see models/phi3.py).
VARIANTS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "gpt2": gpt2_config,
    "opt-pre-ln": lambda: opt_config(do_layer_norm_before=True),
    "opt-post-ln-proj": lambda: opt_config(do_layer_norm_before=False, word_embed_proj_dim=32),
    "phi3-rope": phi3_config,
    "phi3-sliding-window": lambda: phi3_config(sliding_window=5),
    "phi3-longrope-short": lambda: phi3_config(
        **{**longrope_overrides(), "original_max_position_embeddings": 64}
    ),
    "phi3-longrope-long": lambda: phi3_config(
        **{**longrope_overrides(), "original_max_position_embeddings": 2}
    ),
}
FOLDERS = [(v, f) for v in VARIANTS for f in ("safetensors", "bin")]


_HF_REFS: dict[str, HFReference] = {}


@pytest.fixture(scope="module", params=FOLDERS, ids=lambda p: f"{p[0]}-{p[1]}")
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, HFReference]:
    variant, weights_format = request.param
    root = tmp_path_factory.mktemp(variant)
    # Same seed, same weights: both formats of a variant share one HF reference (and its cache).
    folder = make_tiny_model(root / weights_format, VARIANTS[variant](), weights_format=weights_format)
    if variant not in _HF_REFS:
        hf = load_hf_model(folder)
        # HFReference passes eos_token_id=None, but generate() refills None fields from the model's own
        # generation config; clear it there too so HF never stops early (the engine runs with ignore_eos).
        hf.generation_config.eos_token_id = None
        _HF_REFS[variant] = HFReference(hf)
    return folder, _HF_REFS[variant]


def run_and_check(engine, prompts: list[list[int]], ref: HFReference) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(MAX_TOKENS))
    outs = run_all(engine)
    for i, prompt in enumerate(prompts):
        assert outs[str(i)].outputs[0].token_ids == ref(prompt, MAX_TOKENS), f"request {i}"


def test_preemption_matches_hf(model: tuple[Path, HFReference]) -> None:
    """4 requests needing up to 8 blocks each in a 12-block pool: some are preempted and recomputed."""
    folder, ref = model
    engine = make_engine(
        folder, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=12, enable_prefix_caching=False
    )
    spy = PlanSpy().attach(engine)
    run_and_check(engine, random_prompts([18, 11, 15, 20], seed=1), ref)
    assert engine.get_stats().num_preemptions > 0 and spy.preemptions > 0
    assert_pool_free(engine)


def test_chunked_prefill_matches_hf(model: tuple[Path, HFReference]) -> None:
    """A step budget of 8 tokens: the 30- and 23-token prompts are prefilled in several chunks."""
    folder, ref = model
    engine = make_engine(
        folder, dtype="float32", block_size=BLOCK_SIZE, max_num_batched_tokens=8, enable_prefix_caching=False
    )
    spy = PlanSpy().attach(engine)
    run_and_check(engine, random_prompts([30, 9, 23], seed=2), ref)
    assert spy.chunked_prefills >= 30 // 8
    assert max(sum(p.num_scheduled) for p in spy.plans) <= 8
    assert_pool_free(engine)


def test_prefix_caching_matches_hf(model: tuple[Path, HFReference]) -> None:
    """Requests sharing a 17-token prefix (4 full blocks) after a first one: their prefix is a cache hit."""
    folder, ref = model
    prefix = random_prompts([17], seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts([3, 6, 1], seed=4)]
    engine = make_engine(folder, dtype="float32", block_size=BLOCK_SIZE, enable_prefix_caching=True)
    run_and_check(engine, prompts[:1], ref)
    run_and_check(engine, prompts[1:], ref)  # request ids "0", "1": the engine forgot the first batch
    assert engine.get_stats().prefix_cache_hits >= 2 * 16  # both reuse at least the 4 full blocks
    assert_pool_free(engine)


def test_server_completions_match_llm(tmp_path: Path) -> None:
    """`python -m pagedrs.entrypoints.openai.server.api_server --model DIR` on a tiny GPT-2 folder answers
    /v1/completions (greedy) exactly as LLM.generate does."""
    from pagedrs import LLM
    from tests.entrypoints.conftest import SubprocessServer

    # vocab_size 259 = the byte tokenizer's size, so every generated token has text (or is special).
    folder = make_tiny_model(tmp_path / "gpt2", gpt2_config(vocab_size=259))
    prompts = ["Hello, paged world", "GPT-2 says"]
    llm = LLM(model=str(folder), device="cpu", dtype="float32", disable_log_stats=True)
    expected = [o.outputs[0].text for o in llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)]
    assert all(expected)
    server = SubprocessServer(tmp_path / "data", ["--model", str(folder), "--max-model-len", "128"])
    server.start()
    try:
        with server.http() as http:
            name = http.get("/v1/models").json()["data"][0]["id"]
            for prompt, want in zip(prompts, expected, strict=True):
                body = {
                    "model": name,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                resp = http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"] == want
                assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
    finally:
        server.kill()


def test_bad_checkpoint_fails_at_engine_start(tmp_path: Path) -> None:
    """The engine refuses a checkpoint missing a tensor when it is built, before any request."""
    from safetensors.torch import load_file, save_file

    from pagedrs import LLM

    folder = make_tiny_model(tmp_path / "opt", opt_config())
    state = load_file(str(folder / "model.safetensors"))
    del state["model.decoder.layers.1.fc2.bias"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="model.decoder.layers.1.fc2.bias"):
        LLM(model=str(folder), device="cpu", dtype="float32", disable_log_stats=True)
