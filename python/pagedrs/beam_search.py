"""Beam search above the engine, as vLLM's `LLM.beam_search`.

Each round every live beam is one request for one token with 2 * beam_width logprobs. A prompt keeps its
beam_width most likely continuations (by cumulative logprob); a continuation that ends in EOS (unless
ignore_eos) is set aside as finished. After max_tokens rounds the finished and the live beams rank by
cum_logprob / len ** length_penalty (`get_beam_search_score`), and the best beam_width are the output.

Beams are prompts that extend one another, so the engine's prefix cache shares their full KV blocks: a
round recomputes only each beam's last, partial block. With prefix caching disabled every round
recomputes every beam whole (the result is the same, only slower).

`BeamSearch` holds the state and the rule; `LLM.beam_search` and the server's `use_beam_search` each
submit its rounds their own way (the offline engine, the async engine).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from pagedrs.outputs import Logprob, RequestOutput
from pagedrs.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = [
    "BeamSearch",
    "BeamSearchInstance",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "get_beam_search_score",
]


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's shape): `tokens` are the prompt and the generated token ids, `logprobs` the step
    logprobs each generated token was chosen from, `text` the generated text (set at the end, without
    the EOS that finished the beam)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop": ended in EOS; "length": max_tokens
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: Sequence[int], cumulative_logprob: float, eos_token_id: int | None, length_penalty: float = 1.0
) -> float:
    """vLLM's rank of a beam: cum_logprob / len ** length_penalty, where len counts the prompt and the
    generated tokens but not a final `eos_token_id`."""
    seq_len = len(tokens)
    if eos_token_id is not None and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


class BeamSearchInstance:
    """The beam search of one prompt: its live beams and the ones set aside as finished."""

    def __init__(self, prompt_token_ids: Sequence[int], max_tokens: int) -> None:
        self.prompt_len = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.beams: list[BeamSearchSequence] = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.num_cached_tokens: int | None = None  # the prompt's, from the first round


class BeamSearch:
    """Beam search over several prompts: `next_prompts()` gives a round's requests (none once the search
    is over), to be run with `step_params`; `update()` takes their outputs in the same order;
    `outputs()` ranks the beams of each prompt."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        params: BeamSearchParams,
        eos_token_ids: Collection[int],
        *,
        max_tokens: Sequence[int] | None = None,
        max_logprobs: int | None = None,
    ) -> None:
        """`max_tokens`: each prompt's limit (default params.max_tokens); `max_logprobs`: the engine's,
        which must allow the 2 * beam_width logprobs a round asks for."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if max_logprobs is not None and 2 * params.beam_width > max_logprobs:
            raise ValueError(
                f"beam_width must be at most {max_logprobs // 2} (each step reads 2 * beam_width logprobs "
                f"and the engine's max_logprobs is {max_logprobs}), got {params.beam_width}"
            )
        limits = list(max_tokens) if max_tokens is not None else [params.max_tokens] * len(prompts)
        if len(limits) != len(prompts):
            raise ValueError(f"max_tokens has {len(limits)} entries but there are {len(prompts)} prompts")
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.instances = [BeamSearchInstance(p, n) for p, n in zip(prompts, limits, strict=True)]
        # Greedy or not, the beams follow the logprobs; the sampled token is only one more candidate.
        self.step_params = SamplingParams(
            max_tokens=1,
            temperature=params.temperature,
            logprobs=2 * params.beam_width,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self._round: list[tuple[BeamSearchInstance, BeamSearchSequence]] = []

    def next_prompts(self) -> list[list[int]]:
        """The token ids of every live beam, each to be extended by one token; [] when the search is over."""
        self._round = [(inst, beam) for inst in self.instances for beam in inst.beams]
        return [beam.tokens for _, beam in self._round]

    def update(self, outputs: Sequence[RequestOutput]) -> None:
        """Extends the beams by the outputs of the round's requests (in `next_prompts` order)."""
        if len(outputs) != len(self._round):
            raise ValueError(f"expected {len(self._round)} outputs, got {len(outputs)}")
        candidates: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst, _ in self._round}
        for (inst, beam), out in zip(self._round, outputs, strict=True):
            if inst.num_cached_tokens is None:
                inst.num_cached_tokens = out.num_cached_tokens or 0
            step_logprobs = out.outputs[0].logprobs if out.outputs else None
            if not step_logprobs:
                raise RuntimeError(f"request {out.request_id} returned no logprobs for a beam search step")
            top = step_logprobs[0]
            for token_id, lp in top.items():
                new = BeamSearchSequence(
                    tokens=[*beam.tokens, token_id],
                    logprobs=[*beam.logprobs, top],
                    cum_logprob=beam.cum_logprob + lp.logprob,
                )
                if token_id in self.eos_token_ids:
                    new.finish_reason = "stop"
                    inst.completed.append(new)
                else:
                    candidates[id(inst)].append(new)
        width = self.params.beam_width
        for inst in {id(inst): inst for inst, _ in self._round}.values():
            # Live beams all have the same length: their scores rank as their cumulative logprobs.
            beams = sorted(candidates[id(inst)], key=lambda b: b.cum_logprob, reverse=True)[:width]
            if beams and len(beams[0].tokens) - inst.prompt_len >= inst.max_tokens:
                for b in beams:
                    b.finish_reason = "length"
                inst.completed.extend(beams)
                beams = []
            inst.beams = beams
        self._round = []

    def score(self, beam: BeamSearchSequence) -> float:
        eos = beam.tokens[-1] if beam.finish_reason == "stop" else None
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos, self.params.length_penalty)

    def outputs(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        """The best beam_width beams of each prompt, best first, their text from `decode` (generated ids
        without a final EOS) if given."""
        results: list[BeamSearchOutput] = []
        for inst in self.instances:
            for b in inst.beams:  # stopped before max_tokens (the caller ran fewer rounds)
                b.finish_reason = b.finish_reason or "length"
            ranked = sorted(inst.completed + inst.beams, key=self.score, reverse=True)
            ranked = ranked[: self.params.beam_width]
            if decode is not None:
                for b in ranked:
                    end = len(b.tokens) - (1 if b.finish_reason == "stop" else 0)
                    b.text = decode(b.tokens[inst.prompt_len : end])
            results.append(BeamSearchOutput(sequences=ranked))
        return results
