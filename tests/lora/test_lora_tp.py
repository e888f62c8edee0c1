"""LoRA under tensor parallelism (2 CPU ranks over gloo): each rank holds its part of every resident
adapter, cut like the base layer (column-parallel: the rank's rows of B; row-parallel: the rank's columns
of A, the delta added before the all-reduce), and follows the driver's slot loads, evictions and per-step
rows over the step channel. Greedy ids equal HF transformers + PEFT and the same engine on one rank, token
for token, with adapters mixed in one batch and slots reused while serving, under forced preemption,
chunked prefill and prefix hits."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedrs import LoRARequest, SamplingParams
from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.outputs import RequestOutput
from tests.distributed.helpers_tp import MAX_TOKENS, MODELS, PROMPTS, check_forced, tp_engine
from tests.engine.conftest import PlanSpy
from tests.lora.helpers_lora import ATTN_MLP, PeftReference, make_peft_adapter

# The adapter modules of each architecture, as PEFT names them: separate q/k/v with 2 KV heads over 2
# ranks, one KV head replicated on both, Phi-3's fused qkv_proj / gate_up_proj (one adapter module over
# several pieces of a fused layer), GPT-2's fused Conv1D c_attn, Gemma 3's q/k/v over a 256-wide head.
TARGETS = {
    "llama-gqa": ATTN_MLP,
    "smollm2-kv1-tied": ATTN_MLP,
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt2-odd-vocab": ("c_attn", "c_proj", "c_fc"),
    "gemma3-kv1": ATTN_MLP,
}


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert isinstance(out, RequestOutput)
                final[out.request_id] = list(out.outputs[0].token_ids)
    return final


def _serve(folder: Path, tp: int, loras: list[LoRARequest | None], which: list[int]) -> dict[str, list[int]]:
    """PROMPTS[i] under loras[which[i]], all queued at once (adapters and the base model in one batch)."""
    engine = tp_engine(folder, tp, enable_lora=True, max_loras=2)
    try:
        spy = PlanSpy().attach(engine)
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i, (p, w) in enumerate(zip(PROMPTS, which, strict=True)):
            engine.add_request(str(i), {"prompt_token_ids": p}, greedy, lora_request=loras[w])
        out = _run(engine)
        check_forced(engine, spy)
        return out
    finally:
        engine.engine_core.shutdown()


@pytest.mark.parametrize("arch", list(TARGETS))
def test_tp2_with_adapters_equals_peft_and_tp1(arch: str, tmp_path: Path) -> None:
    """Three adapters (rank 8, rank 4 with rsLoRA, q/v-only or a rank-6 one) and the base model over
    max_loras=2 slots: the third adapter waits for a slot, which is evicted and reloaded on every rank."""
    base = MODELS[arch](tmp_path)
    targets = TARGETS[arch]
    adapters = [
        make_peft_adapter(base, tmp_path / "a", seed=1, r=8, target_modules=targets),
        make_peft_adapter(
            base, tmp_path / "b", seed=2, r=4, lora_alpha=8, use_rslora=True, target_modules=targets
        ),
        make_peft_adapter(base, tmp_path / "c", seed=3, r=6, target_modules=targets[:1] + targets[-1:]),
    ]
    loras: list[LoRARequest | None] = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(adapters)]
    loras.append(None)
    which = [0, 1, 2, 3, 0, 2]  # PROMPTS[i]'s adapter (3: the base model)
    two = _serve(base, 2, loras, which)
    one = _serve(base, 1, loras, which)
    refs = [PeftReference(base, p) for p in adapters] + [PeftReference(base, None)]
    for i, (p, w) in enumerate(zip(PROMPTS, which, strict=True)):
        want = refs[w](p, MAX_TOKENS)
        assert two[str(i)] == want, f"TP=2, request {i} (adapter {w})"
        assert one[str(i)] == want, f"TP=1, request {i} (adapter {w})"
    assert refs[0](PROMPTS[0], MAX_TOKENS) != refs[3](PROMPTS[0], MAX_TOKENS)  # the adapters matter


def test_lora_refuses_liquid_scaling() -> None:
    from pagedrs.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="liquid"):
        EngineArgs(enable_lora=True, liquid_gpu_range=[1, 2]).lora_config()
