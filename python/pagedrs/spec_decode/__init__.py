"""Speculative decoding (as vLLM keeps `vllm/v1/spec_decode/`): the drafters behind one `Drafter`
protocol (`interface.py`; n-gram lookup in the scheduler, `self_draft.py`, `draft_model.py`), named by
method in `registry.py`; the verifier (`verifier.py`) and its rejection sampler; the engine core's
policy (`policy.py`)."""

from pagedrs.spec_decode.interface import Drafter, DrafterContext, Proposal, StepContext
from pagedrs.spec_decode.registry import DRAFTERS, build_drafter

__all__ = ["DRAFTERS", "Drafter", "DrafterContext", "Proposal", "StepContext", "build_drafter"]
