"""SamplingParams: vLLM's field names, defaults and meanings; every bad value raises a ValueError that names
the field and the value."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field

from pagedrs.structured_outputs import StructuredOutputsParams

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "SamplingType"]

_SAMPLING_EPS = 1e-5
_MIN_TEMP = 1e-2  # vLLM clamps positive temperatures below this up to it (numerical stability)
# Token counts, token ids and seeds cross into the Rust core (and torch.Generator) as int64.
_INT64_MAX = 2**63 - 1


class RequestOutputKind(enum.IntEnum):
    """What each step's `RequestOutput` of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # every token and the whole text so far
    DELTA = 1  # only what is new since the previous output (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bad(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"{name} {why}, got {value!r}")


@dataclass
class SamplingParams:
    """How to sample the output of one request (vLLM's `SamplingParams`).

    temperature 0 is greedy; top_k 0 or -1 disables top-k; top_p 1 and min_p 0 disable theirs.
    Penalties follow vLLM (repetition over prompt + output; presence/frequency over output, OpenAI's way).
    `seed` gives a request its own random generator, so its tokens do not depend on the rest of the batch.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict | None = field(default=None, repr=False)
    # A JSON schema, regex, choice or grammar the output must follow (vLLM's current name, and its older
    # `guided_decoding`, which is folded into it).
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise _bad(
                    "guided_decoding", self.guided_decoding, "and structured_outputs cannot both be set"
                )
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise _bad("structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams")
        stop: list[str] = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop = stop
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the truncations cannot change an argmax, so they are turned off.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        elif self.temperature < _MIN_TEMP:
            self.temperature = _MIN_TEMP
        if self.logit_bias is not None:
            self.logit_bias = {int(k): max(-100.0, min(100.0, float(v))) for k, v in self.logit_bias.items()}

    def _verify(self) -> None:
        """Every field's rule, one `if` each, so each error names its field. Long on purpose."""
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "must be an int >= 1")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of != self.n):
            raise _bad(
                "best_of", self.best_of, f"must be None or equal to n ({self.n}); larger is not supported"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise _bad(name, v, "must be a number in [-2, 2]")
        if not _is_num(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise _bad("repetition_penalty", self.repetition_penalty, "must be a number > 0")
        if not _is_num(self.temperature) or not self.temperature >= 0:
            raise _bad("temperature", self.temperature, "must be a non-negative number")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _bad("top_k", self.top_k, "must be 0 or -1 (disabled), or at least 1")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and (
            not _is_int(self.seed) or not -_INT64_MAX - 1 <= self.seed <= _INT64_MAX
        ):
            raise _bad("seed", self.seed, "must be a 64-bit int or None")
        # __post_init__ made both lists
        stop: list[object] = list(self.stop) if isinstance(self.stop, list) else []
        stop_ids: list[object] = list(self.stop_token_ids or [])
        if not all(isinstance(s, str) for s in stop):
            raise _bad("stop", self.stop, "must be a string or a list of strings")
        if any(s == "" for s in stop):
            raise _bad("stop", self.stop, "cannot contain an empty string")
        if not all(isinstance(t, int) and _is_int(t) and 0 <= t <= _INT64_MAX for t in stop_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "must be a list of non-negative 64-bit ints")
        if self.max_tokens is not None and (
            not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= _INT64_MAX
        ):
            raise _bad("max_tokens", self.max_tokens, "must be an int >= 1 (64-bit) or None")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= _INT64_MAX:
            raise _bad("min_tokens", self.min_tokens, "must be an int >= 0 (64-bit)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise _bad("logprobs", self.logprobs, "must be an int >= 0 or None")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            raise _bad("prompt_logprobs", self.prompt_logprobs, "must be an int >= 0 or None")
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "must be a bool")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise _bad("output_kind", self.output_kind, "must be a RequestOutputKind") from None
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                _is_int(k) or (isinstance(k, str) and k.lstrip("-").isdigit()) for k in self.logit_bias
            ):
                raise _bad("logit_bias", self.logit_bias, "must map token ids to numbers")
            if not all(_is_num(v) for v in self.logit_bias.values()):
                raise _bad("logit_bias", self.logit_bias, "must map token ids to numbers")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def output_text_buffer_length(self) -> int:
        """Characters held back from unfinished outputs: they may be the start of a stop string."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def child(self, index: int) -> SamplingParams:
        """Params of the index-th of n parallel samples: a seeded request gives child i the seed + i."""
        if self.n == 1 and index == 0:
            return self
        params = copy.copy(self)
        params.n = 1
        params.best_of = None
        if self.seed is not None:
            params.seed = self.seed + index
        return params


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """How to run `LLM.beam_search` (vLLM's `BeamSearchParams`): keep the `beam_width` most likely
    sequences for up to `max_tokens` tokens; finished sequences rank by
    cum_logprob / len(tokens) ** length_penalty. `temperature` is passed to each step's sampler (the
    beams follow the raw logprobs either way, as in vLLM)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise _bad("beam_width", self.beam_width, "must be an int >= 1")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= _INT64_MAX:
            raise _bad("max_tokens", self.max_tokens, "must be an int >= 1 (64-bit)")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "must be a bool")
        if not _is_num(self.temperature) or not self.temperature >= 0:
            raise _bad("temperature", self.temperature, "must be a non-negative number")
        if not _is_num(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise _bad("length_penalty", self.length_penalty, "must be a finite number")
