"""Speculative decoding on the engine core's side: the scheduler's settings, and which requests may
speculate.

A request speculates when its sampling is a function of the logits row alone (temperature, top-k, top-p,
min-p, a seed), possibly limited by a grammar (each row masked by the state after the drafts before it,
`verifier.py`): the verifier then accepts exactly what the target distribution allows.
Penalties, logit_bias, min_tokens, LoRA adapters and pooling keep per-token state (or a hook) the
verifier does not model: those requests decode one token a step, next to speculating ones. Logprobs
come from each emitted token's verification row (`verifier.py`).
"""

from __future__ import annotations

from typing import Any

from pagedrs.config import EngineConfig
from pagedrs.sampling_params import SamplingParams
from pagedrs.spec_decode.registry import DRAFTERS

__all__ = ["can_speculate", "spec_scheduler_args"]


def spec_scheduler_args(config: EngineConfig) -> dict[str, Any]:
    """The `_core.Scheduler` keyword arguments of the engine's speculative config (none when off)."""
    spec = config.speculative
    if spec is None:
        return {}
    drafter = DRAFTERS[spec.method]
    # Past the method's default size a step's extra verification rows cost more than the accepted tokens
    # save (measured, each drafter says where); below it the scheduler's governor (`adaptive`,
    # rust/pagedrs-core/src/spec_governor.rs) still pauses speculation that measures slower than
    # decoding without it.
    disable = spec.disable_by_batch_size
    if disable is None:
        disable = drafter.default_disable_by_batch_size
    return {
        "num_speculative_tokens": min(
            spec.num_speculative_tokens, config.scheduler.max_num_batched_tokens - 1
        ),
        "spec_method": drafter.scheduler_method,
        "prompt_lookup_min": spec.prompt_lookup_min,
        "prompt_lookup_max": spec.prompt_lookup_max,
        "spec_disable_batch_size": disable,
        "spec_adaptive": spec.adaptive,
    }


def can_speculate(params: SamplingParams, has_hooks: bool) -> bool:
    """Whether a request with these sampling parameters may speculate (`has_hooks`: an adapter or
    pooling)."""
    return not (has_hooks or params.needs_penalties or params.logit_bias or params.min_tokens > 0)
