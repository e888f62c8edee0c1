"""One step's `EngineCoreOutput`s: at most one per sequence with news (first scheduled, prompt logprobs,
a sampled token with its logprobs, a pooled vector, a finish reason), in the order they arose."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pagedrs.engine.core.messages import EngineCoreOutput, PromptLogprobsMsg, SampleLogprobsMsg
from pagedrs.engine.core.requests import CoreSeq
from pagedrs.runner.outputs import RunnerOutput

__all__ = ["StepOutputs"]


class StepOutputs:
    """Collects a step's outputs; `outputs` starts with those pending from before the step (rejects)."""

    def __init__(self, seqs: Mapping[int, CoreSeq], pending: list[EngineCoreOutput]) -> None:
        self._seqs = seqs
        self.outputs = pending
        self._by_seq: dict[int, EngineCoreOutput] = {}

    def for_seq(self, seq_id: int) -> EngineCoreOutput:
        o = self._by_seq.get(seq_id)
        if o is None:
            seq = self._seqs[seq_id]
            o = self._by_seq[seq_id] = EngineCoreOutput(seq.request_id, seq.index)
            self.outputs.append(o)
        return o

    def first_scheduled(self, seq: CoreSeq, num_cached_tokens: int, now: float) -> None:
        o = self.for_seq(seq.seq_id)
        o.num_cached_tokens = num_cached_tokens
        o.first_scheduled_time = now

    def prompt_logprobs(self, out: RunnerOutput) -> None:
        for sid, chunk in out.prompt_logprobs.items():
            self.for_seq(sid).prompt_logprobs = PromptLogprobsMsg(
                chunk.start, chunk.token_ids.tolist(), chunk.logprobs.tolist(), chunk.ranks.tolist()
            )

    def sampled(
        self,
        rows: list[CoreSeq],
        out: RunnerOutput,
        pooled: Mapping[int, list[float]],
        kept: np.ndarray | None = None,
    ) -> list[tuple[CoreSeq, list[int]]]:
        """Each row's new tokens (and logprobs), or its pooled vector (an embedding request's last prompt
        step: no token). A speculative step gives a row several tokens (`out.token_counts`), of which the
        scheduler kept `kept[i]` (a stop condition may cut the rest). Returns the rows that got tokens."""
        tokens = out.sampled_token_ids.tolist()
        token_lps = out.sampled_logprobs.tolist() if out.sampled_logprobs is not None else None
        counts = out.token_counts.tolist() if out.token_counts is not None else None
        keep = kept.tolist() if kept is not None else None
        lp = out.logprobs
        lp_ids = lp_vals = lp_ranks = None
        got: list[tuple[CoreSeq, list[int]]] = []
        at = 0
        for i, seq in enumerate(rows):
            c = 1 if counts is None else counts[i]
            n = c if keep is None else keep[i]
            o = self.for_seq(seq.seq_id)
            if seq.seq_id in pooled:
                o.embedding = pooled[seq.seq_id]
                at += c
                continue
            new = tokens[at : at + n]
            o.new_token_ids = new
            if token_lps is not None:
                o.new_token_logprobs = token_lps[at : at + n]
            if seq.num_logprobs is not None and lp is not None:
                if lp_ids is None:
                    lp_ids, lp_vals, lp_ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
                assert lp_vals is not None and lp_ranks is not None
                k = 1 + seq.num_logprobs
                # one logprobs row per token (a speculative step's rows follow its tokens)
                span = range(at, at + n)
                o.new_logprobs = SampleLogprobsMsg(
                    [lp_ids[j][:k] for j in span],
                    [lp_vals[j][:k] for j in span],
                    [int(lp_ranks[j]) for j in span],
                )
            at += c
            if new:
                got.append((seq, new))
        return got
