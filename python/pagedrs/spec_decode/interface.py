"""The seam between the model runner and a drafter of speculative decoding (vLLM keeps its proposers
behind one `propose` in `vllm/v1/spec_decode/`): what the runner hands a drafter when it builds it
(`DrafterContext`) and before each step's forward (`StepContext`), what the drafter answers
(`Proposal`), and the `Drafter` protocol every drafter meets. The runner knows drafters through these
alone, and a drafter knows nothing else of the runner: the runner's buffers and pools reach it through
the context's factories, typed here by what a drafter uses of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from pagedrs._core import StepPlan
    from pagedrs.config import EngineConfig
    from pagedrs.distributed.group import TPGroup
    from pagedrs.layers.attention import AttentionBackend, AttentionMetadata
    from pagedrs.layers.sampler import SamplingRow
    from pagedrs.models.interface import CausalLM

__all__ = [
    "Drafter",
    "DrafterContext",
    "KVPool",
    "MetadataBuilder",
    "Proposal",
    "StepContext",
    "StepPacker",
    "StepTensors",
]


class StepTensors(Protocol):
    """What a drafter reads of a step's packed device inputs (the runner's `StepInputs`)."""

    @property
    def input_ids(self) -> Tensor: ...

    @property
    def positions(self) -> Tensor: ...


class StepPacker(Protocol):
    """Step buffers of the runner's kind (`StepBuffers`): a plan, or a plan-shaped sub-step, packed and
    copied to the device in one transfer."""

    def pack(self, plan: Any, *, mirror_rows: np.ndarray | None = None) -> StepTensors: ...


class KVPool(Protocol):
    """A paged KV pool of the runner's kind (`KVCachePool`), with the target's block ids."""

    @property
    def kv_caches(self) -> list[Tensor]: ...

    def apply_plan_ops(self, plan: StepPlan) -> None: ...

    def apply_plan_shrink(self, plan: StepPlan) -> None: ...


@dataclass(frozen=True, slots=True)
class DrafterContext:
    """What a drafter may use of its runner, fixed for the runner's life (liquid scaling, which swaps
    the runner's model, runs n-gram lookup only)."""

    config: EngineConfig
    target: CausalLM  # the model that verifies the drafts
    draft_model: CausalLM | None  # the loaded draft of the "draft_model" method (rank 0), else None
    tp: TPGroup
    device: torch.device
    block_size: int
    max_blocks_per_seq: int
    backend: AttentionBackend
    generator: torch.Generator  # the runner's default generator (sampled drafts of unseeded sequences)
    # step buffers for decode-shaped sub-steps (at most one row per running sequence)
    new_substep_buffers: Callable[[], StepPacker]
    # (model, num_blocks, num_swap_blocks, dtype): a KV pool for `model` over the target's block ids
    new_kv_pool: Callable[[torch.nn.Module, int, int, torch.dtype], KVPool]
    kv_block_bytes: Callable[[torch.nn.Module, torch.dtype], int]  # one block's KV bytes for a model


class MetadataBuilder(Protocol):
    """The runner's attention-metadata builder: for a `StepPlan`, or any plan-shaped sub-step over some of
    its rows, packed into `inputs`."""

    def __call__(
        self, plan: Any, inputs: Any, max_query_len: int, max_seq_len: int, *, groups: bool = True
    ) -> AttentionMetadata:
        """`inputs`: what the runner's buffers packed `plan` into. `groups`: with the metadata of the
        plan's KV-cache groups (False: every layer reads the full-attention tables)."""
        ...


@dataclass(frozen=True, slots=True)
class StepContext:
    """One step as a drafter sees it, handed over before the step's forward."""

    plan: StepPlan
    inputs: StepTensors  # the step's device inputs; a drafter writes its drafts into input_ids
    attn_metadata: AttentionMetadata  # the whole step's (the target's forward reuses it)
    build_attn_metadata: MetadataBuilder  # for sub-steps over some of the step's rows
    kv_caches: list[Tensor]  # the target's KV pool
    block_table_view: np.ndarray | None  # the scheduler's persistent block table (host), once attached
    block_table_mirrored: bool  # the view has a device mirror; a plan then names rows of it
    rows: Sequence[SamplingRow] | None  # the sampled sequences' sampling rows (rank 0), when known

    @property
    def mirror_rows(self) -> np.ndarray | None:
        """The host view of the mirrored block table (None without a mirror: plans carry dense tables)."""
        return self.block_table_view if self.block_table_mirrored else None


@dataclass(frozen=True, slots=True)
class Proposal:
    """A step's drafts."""

    token_ids: np.ndarray  # int64: every speculating sequence's drafts, flattened in sampled order
    # [drafts, draft vocab]: the distribution each sampled draft was drawn from, for the verifier's q
    # (rows of deterministic drafts unused); None: every draft deterministic.
    probs: Tensor | None = None


class Drafter(Protocol):
    """Proposes the drafts of speculative decoding. Built by the runner from its `DrafterContext`
    (`spec_decode.registry.DRAFTERS` names the class of each method)."""

    # What the Rust scheduler does for this method: "ngram", it proposes by prompt lookup itself (the
    # drafts come in the plan); "runner", it reserves the draft slots and the drafter fills them.
    scheduler_method: ClassVar[str]
    # Speculation pauses while more sequences than this run, unless the config names a size.
    default_disable_by_batch_size: ClassVar[int]

    def __init__(self, context: DrafterContext) -> None: ...

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of KV cache the drafter keeps per block of the target's pool (0: none of its own)."""
        ...

    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        """Allocate the drafter's own KV cache, if any, with as many blocks as the target's pool."""
        ...

    def apply_plan_ops(self, plan: StepPlan) -> None:
        """The plan's block ops (copies, swaps, moves) on the drafter's own KV cache, if any."""
        ...

    def apply_plan_shrink(self, plan: StepPlan) -> None:
        """The plan's shrink of the pool, after the step, on the drafter's own KV cache, if any."""
        ...

    def runs(self, plan: StepPlan) -> bool:
        """Whether `propose` sees this step (a step with tokens; the runner checks that)."""
        ...

    def propose(self, step: StepContext) -> Proposal:
        """The drafts of every speculating sequence of `step.plan` (the layout of
        `plan.draft_token_ids`), also written into `step.inputs.input_ids` at their positions."""
        ...
