"""The runner's sampling side (rank 0): a step's logits to sampled tokens, logprobs and prompt logprobs.

The sampling metadata comes from parameters kept per sequence (`sampling_state.py`); drafts of speculative
decoding are verified here (`spec_decode/verifier.py`). `SampleStepMixin` is a part of `ModelRunner`
(`model_runner.py`), which sets every attribute declared here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pagedrs._core import StepPlan
from pagedrs.config import EngineConfig
from pagedrs.layers.sampler import LogprobsTensors, Sampler, SamplingMetadata, SamplingRow
from pagedrs.runner.outputs import Forward, RunnerOutput
from pagedrs.runner.prompt_logprobs import PromptLogprobsPlan, compute_prompt_logprobs, plan_prompt_logprobs
from pagedrs.runner.sampling_state import SamplingState
from pagedrs.spec_decode.verifier import first_rows, greedy_with_drafts, sample_with_drafts

__all__ = ["SampleStepMixin"]


class SampleStepMixin:
    """`ModelRunner`'s sampling of a step's logits, and which rows give its prompt logprobs."""

    config: EngineConfig
    device: torch.device
    eos_token_ids: list[int]
    sampler: Sampler
    generator: torch.Generator
    sampling_state: SamplingState | None
    last_drafts: np.ndarray | None
    last_draft_probs: Tensor | None

    def _sampling_metadata(self, plan: StepPlan, rows: Sequence[SamplingRow], vocab: int) -> SamplingMetadata:
        """From the per-sequence state (the one builder of a step's sampling metadata), keyed by the plan's
        sampled seq ids."""
        seq_ids = plan.sampled_seq_ids
        if len(seq_ids) != len(rows):
            raise ValueError(f"{len(rows)} sampling rows for a plan that samples {len(seq_ids)} sequences")
        state = self.sampling_state
        if state is None or state.vocab_size != vocab:
            state = self.sampling_state = SamplingState(
                vocab_size=vocab,
                device=self.device,
                eos_token_ids=self.eos_token_ids,
                capacity=2 * self.config.scheduler.max_num_seqs,
            )
        return state.metadata(seq_ids, rows, default_generator=self.generator)

    @torch.inference_mode()
    def sample(
        self,
        plan: StepPlan,
        rows: Sequence[SamplingRow],
        fwd: Forward,
        token_bitmask: Any = None,
    ) -> RunnerOutput:
        """Rank 0 only: prompt logprobs from the rows after the sampled ones, then the grammar masks
        (structured outputs), then the sampler (logprobs are reported after masking, as vLLM does)."""
        logits, plp = fwd.logits, fwd.prompt_logprobs
        out = RunnerOutput(np.zeros(0, dtype=np.int64), None, {}, hidden=fwd.hidden)
        if logits is None:
            return out
        num_rows = len(plan.logits_indices)
        if plp is not None:
            out.prompt_logprobs = compute_prompt_logprobs(logits[num_rows:], plp)
        if hasattr(token_bitmask, "result"):  # built in a helper thread while the forward ran
            token_bitmask = token_bitmask.result()
        main = logits[:num_rows]
        sampling = self._sampling_metadata(plan, rows, logits.shape[-1]) if num_rows else None
        if (
            sampling is not None
            and plan.has_drafts
            and token_bitmask is None
            and sampling.is_plain_greedy
            and sampling.max_num_logprobs is None
        ):
            drafts = self.last_drafts if self.last_drafts is not None else plan.draft_token_ids
            greedy_with_drafts(out, plan, main, drafts)
            return out
        if num_rows and plan.has_drafts:  # one row per sequence for the sampler: each one's first
            main = logits.index_select(
                0, torch.as_tensor(first_rows(plan.num_draft_tokens), device=logits.device)
            )
        if num_rows and token_bitmask is not None:
            import xgrammar as xgr

            mask, indices = token_bitmask
            xgr.apply_token_bitmask_inplace(
                main, mask.to(logits.device), vocab_size=logits.shape[-1], indices=indices
            )
        if sampling is not None:
            sampled = self.sampler(main, sampling)
            # Every copy to the host is queued, then one wait.
            ids = sampled.sampled_token_ids.to("cpu", non_blocking=True)
            token_lps = None
            if sampled.sampled_logprobs is not None:
                token_lps = sampled.sampled_logprobs.to("cpu", non_blocking=True)
            lp = sampled.logprobs
            if lp is not None:
                lp = LogprobsTensors(
                    *(t.to("cpu", non_blocking=True) for t in (lp.token_ids, lp.logprobs, lp.ranks))
                )
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            out.sampled_token_ids = ids.numpy().astype(np.int64, copy=False)
            out.sampled_logprobs = token_lps.numpy() if token_lps is not None else None
            out.logprobs = lp
            if plan.has_drafts:
                drafts = self.last_drafts if self.last_drafts is not None else plan.draft_token_ids
                sample_with_drafts(
                    out, plan, rows, logits[:num_rows], drafts, self.generator, self.last_draft_probs
                )
        return out

    def prompt_logprobs_plan(
        self, plan: StepPlan, wanted: dict[int, tuple[int, Sequence[int]]] | None
    ) -> PromptLogprobsPlan | None:
        """Which hidden rows give this step's prompt logprobs: position p's logits predict token p + 1."""
        return plan_prompt_logprobs(plan, wanted)
