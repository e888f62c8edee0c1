"""The forced tensor-parallel workload shared by test_tensor_parallel.py, test_tensor_parallel_ray.py and
test_tensor_parallel_swap.py: engine settings and prompts under which one run preempts, chunks a prefill,
hits the prefix cache and samples n=2, an engine builder for any TP size, and the check that each of those
mechanisms really fired."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedrs import SamplingParams
from pagedrs.engine.arg_utils import EngineArgs
from pagedrs.engine.llm_engine import LLMEngine
from tests.engine.conftest import PlanSpy, run_all
from tests.helpers import make_tiny_llama, make_tiny_model
from tests.models.helpers_configs import gpt2_config, opt_config, phi3_config
from tests.models.helpers_families import gemma3_config

# Tiny random models of every architecture, each with its quirk for tensor parallelism.
MODELS: dict[str, Callable[[Path], Path]] = {
    "llama-gqa": lambda d: make_tiny_llama(d, arch="llama"),  # 4 heads, 2 KV heads
    "qwen2-bias": lambda d: make_tiny_llama(d, arch="qwen2"),
    "mistral-window": lambda d: make_tiny_llama(d, arch="mistral", sliding_window=6),
    "smollm2-kv1-tied": lambda d: make_tiny_llama(d, arch="smollm2"),  # 1 KV head: replicated
    "gpt2-odd-vocab": lambda d: make_tiny_model(d / "gpt2", gpt2_config(vocab_size=259)),
    "opt-proj": lambda d: make_tiny_model(
        d / "opt", opt_config(do_layer_norm_before=False, word_embed_proj_dim=32)
    ),
    "phi3": lambda d: make_tiny_model(d / "phi3", phi3_config()),
    # head_dim 256, q/k norm, sliding and global layers on two RoPE bases; its 1 KV head replicated
    "gemma3-kv1": lambda d: make_tiny_model(d / "gemma3", gemma3_config()),
}

MAX_TOKENS = 10
# A pool of 20 blocks of 4 tokens cannot hold every request at once (preemption), a 16-token budget
# splits the 40-token prompt (chunked prefill), and four prompts share a 16-token prefix (cache hits).
ENGINE = dict(
    device="cpu",
    dtype="float32",
    block_size=4,
    num_kv_blocks=20,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    disable_log_stats=True,
    seed=0,
)
PREFIX = list(range(100, 116))
PROMPTS = [
    PREFIX + [1, 2, 3],
    PREFIX + [7, 8],
    list(range(10, 50)),  # longer than the token budget
    PREFIX + [40, 41, 42, 43, 44],
    [5, 6, 7],
    PREFIX + [60],
]


# Models whose every layer is windowed keep only the window's blocks (a window KV-cache group): a smaller
# budget forces the preemption there.
ENGINE_FOR: dict[str, dict[str, Any]] = {"mistral-window": {"num_kv_blocks": 10}}


def tp_engine(folder: Path, tp: int, **kw: Any) -> LLMEngine:
    """An engine over `folder` with `tp` ranks and the ENGINE settings (`kw` overrides them)."""
    return LLMEngine.from_engine_args(
        EngineArgs(model=str(folder), tensor_parallel_size=tp, **{**ENGINE, **kw})
    )


def run_workload(engine: LLMEngine) -> tuple[dict[str, list[list[int]]], PlanSpy]:
    """Greedy ids of every PROMPTS request (request "1" with n=2), and the spy that watched the plans."""
    spy = PlanSpy().attach(engine)
    outs = _run_prompts(engine, None)
    ids = {rid: [list(c.token_ids) for c in o.outputs] for rid, o in outs.items()}
    return ids, spy


def run_workload_logprobs(engine: LLMEngine, k: int = 5) -> dict[str, list[tuple[list[int], list[Any]]]]:
    """Greedy ids of every PROMPTS request with each token's top-`k` logprobs (`greedy_agreement`'s input)."""
    outs = _run_prompts(engine, k)
    return {rid: [(list(c.token_ids), c.logprobs or []) for c in o.outputs] for rid, o in outs.items()}


def _run_prompts(engine: LLMEngine, logprobs: int | None) -> dict[str, Any]:
    for i, prompt in enumerate(PROMPTS):
        n = 2 if i == 1 else 1
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n, logprobs=logprobs
        )
        engine.add_request(str(i), prompt, params)
    return run_all(engine)


def check_forced(engine: LLMEngine, spy: PlanSpy) -> None:
    assert spy.preemptions > 0, "the pool was meant to force a preemption"
    assert spy.chunked_prefills > 0, "the 40-token prompt was meant to be chunked"
    assert engine.get_stats().prefix_cache_hits > 0, "the shared prefix was meant to hit the cache"
