"""Which drafter proposes for each `speculative_config` method, and how the runner gets its own."""

from __future__ import annotations

from pagedrs.spec_decode.draft_model import DraftModelDrafter
from pagedrs.spec_decode.from_driver import DriverDrafts
from pagedrs.spec_decode.interface import Drafter, DrafterContext
from pagedrs.spec_decode.ngram import NgramDrafter
from pagedrs.spec_decode.self_draft import SelfDrafter

__all__ = ["DRAFTERS", "build_drafter"]

# method name -> drafter class; `config.SPEC_METHODS` lists the same names (a test keeps them equal)
DRAFTERS: dict[str, type[Drafter]] = {
    "ngram": NgramDrafter,
    "self_draft": SelfDrafter,
    "draft_model": DraftModelDrafter,
}


def build_drafter(context: DrafterContext) -> Drafter | None:
    """The drafter of the engine's speculative config on this rank, None when speculation is off. Under
    tensor parallelism a drafter that runs in the runner runs on rank 0 only; the other ranks take its
    drafts by broadcast (`DriverDrafts`)."""
    spec = context.config.speculative
    if spec is None:
        return None
    cls = DRAFTERS[spec.method]
    if cls.scheduler_method == "runner" and not context.tp.is_driver:
        return DriverDrafts(context)
    return cls(context)
