"""Speculative decoding on the engine core's side: the scheduler's settings, and which requests may
speculate.

A request speculates when its sampling is a function of the logits row alone (temperature, top-k, top-p,
min-p, a seed), possibly limited by a grammar (each row masked by the state after the drafts before it,
`worker/spec_verify.py`): the verifier then accepts exactly what the target distribution allows.
Penalties, logit_bias, min_tokens, LoRA adapters and pooling keep per-token state (or a hook) the
verifier does not model: those requests decode one token a step, next to speculating ones. Logprobs
come from each emitted token's verification row (`worker/spec_verify.py`).
"""

from __future__ import annotations

from typing import Any

from pagedrs.config import EngineConfig
from pagedrs.sampling_params import SamplingParams

__all__ = ["can_speculate", "spec_scheduler_args"]

# Speculation pauses above this many running sequences when the config names no disable_by_batch_size:
# past it a step's extra verification rows cost more than the accepted tokens save. Measured on the
# 2-core CPU with the default model (bench/spec_decode.py, 4 drafts, README): n-gram gave 1.56x / 1.34x /
# 1.25-1.39x / 1.33x / 1.22x at batch 1 / 2 / 4 / 8 / 16 on answers that repeat their prompt, and 1.21x /
# 1.17x / 0.95x at batch 4 / 8 / 16 on answers continued past their end (`--ignore-eos`, mostly invented
# text): on at up to 8. Self-draft by early exit did not pay at any batch size there. A draft model was
# not measured (no smaller model shares the default model's tokenizer here): batch 1 only. Below these
# sizes the scheduler's governor (`adaptive`, rust/pagedrs-core/src/spec_governor.rs) still pauses
# speculation that measures slower than decoding without it.
DEFAULT_DISABLE_BY_BATCH_SIZE = {"ngram": 8, "self_draft": 1, "draft_model": 1}


def spec_scheduler_args(config: EngineConfig) -> dict[str, Any]:
    """The `_core.Scheduler` keyword arguments of the engine's speculative config (none when off)."""
    spec = config.speculative
    if spec is None:
        return {}
    disable = spec.disable_by_batch_size
    if disable is None:
        disable = DEFAULT_DISABLE_BY_BATCH_SIZE[spec.method]
    return {
        "num_speculative_tokens": min(
            spec.num_speculative_tokens, config.scheduler.max_num_batched_tokens - 1
        ),
        "spec_method": "ngram" if spec.method == "ngram" else "runner",
        "prompt_lookup_min": spec.prompt_lookup_min,
        "prompt_lookup_max": spec.prompt_lookup_max,
        "spec_disable_batch_size": disable,
        "spec_adaptive": spec.adaptive,
    }


def can_speculate(params: SamplingParams, has_hooks: bool) -> bool:
    """Whether a request with these sampling parameters may speculate (`has_hooks`: an adapter or
    pooling)."""
    return not (has_hooks or params.needs_penalties or params.logit_bias or params.min_tokens > 0)
