"""Per-request and per-sequence state kept by the frontend (the output processor): incremental
detokenization, stop strings, logprobs and the outputs built from them.

The scheduler (Rust, in the engine core) owns blocks and token counts; the frontend keeps what it needs to
build outputs: the sampled tokens, their logprobs, the text decoded so far and the finish reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedrs.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from pagedrs.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["IncrementalDetokenizer", "Request", "SampleState", "check_stop_strings"]


def check_stop_strings(
    text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """vLLM's stop-string check over the newly decoded tail of `text`.

    Returns (stop string, index to cut the text at; -1 for no cut) or None."""
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        # Only the text that could contain a match involving the new characters is searched.
        start = max(0, len(text) - new_char_count - len(stop_str) + 1)
        idx = text.find(stop_str, start)
        if idx == -1:
            continue
        if include_in_output:
            idx += len(stop_str)
            if idx >= len(text):
                return stop_str, -1
        return stop_str, idx
    return None


class IncrementalDetokenizer:
    """Text of a sequence's output tokens, decoded as they arrive.

    With a fast (Rust) tokenizer it uses `tokenizers.decoders.DecodeStream` primed with the end of the
    prompt (so a leading space or a multi-byte character split across the prompt boundary decodes the way
    a full decode would); otherwise it re-decodes the output behind a short prompt prefix."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        # Prime with the shortest prompt suffix (4..24 tokens) that decodes cleanly; none if there is none
        # (a prompt cut inside a multi-byte character would leak its bytes into the output text).
        prefix: list[int] = []
        for i in range(min(4, len(prompt_token_ids)), min(len(prompt_token_ids), 24) + 1):
            suffix = list(prompt_token_ids[-i:])
            if "\ufffd" not in tokenizer.decode(suffix, skip_special_tokens=skip_special_tokens):
                prefix = suffix
                break
        self._prefix = prefix
        rust_tok = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        if rust_tok is not None and type(rust_tok).__module__.startswith("tokenizers"):
            from tokenizers.decoders import DecodeStream

            self._rust = rust_tok
            self._stream = DecodeStream(ids=prefix, skip_special_tokens=skip_special_tokens)
        else:
            self._ids: list[int] = []
            self._prefix_text = tokenizer.decode(prefix, skip_special_tokens=skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> int:
        """Decode newly sampled tokens; returns how many characters were appended to `text`."""
        before = len(self.text)
        if self._stream is not None:
            for tid in token_ids:
                try:
                    chunk = self._stream.step(self._rust, tid)
                except Exception:  # an id the decoder cannot handle (out of vocab): skip it like vLLM
                    chunk = None
                if chunk:
                    self.text += chunk
        else:
            self._ids.extend(token_ids)
            full = self.tokenizer.decode(
                self._prefix + self._ids, skip_special_tokens=self.skip_special_tokens
            )
            new = full[len(self._prefix_text) :]
            if not new.endswith("\ufffd"):
                self.text = new
        return len(self.text) - before


class Request:
    """The frontend's view of one request: its prompt and its n sequences' text and logprobs."""

    __slots__ = (
        "request_id",
        "prompt",
        "prompt_token_ids",
        "params",
        "seqs",
        "metrics",
        "prompt_logprobs",
        "num_cached_tokens",
        "num_unfinished",
        "output_kind",
        "engine",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        tokenizer: Any,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_kind = params.output_kind
        self.metrics = RequestMetrics(arrival_time=arrival_time, last_token_time=arrival_time)
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None
        )
        self.num_cached_tokens: int | None = None
        self.seqs = [SampleState(i, self, params.child(i), tokenizer) for i in range(params.n)]
        self.num_unfinished = params.n
        self.engine: int | None = None  # the engine core (data-parallel replica) serving it, if known

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def to_output(self, changed: Sequence[SampleState] | None = None) -> RequestOutput:
        """Cumulative: every sequence, all so far. Delta: the `changed` sequences' news since their last
        output (each sequence remembers what it has given out)."""
        delta = self.output_kind == RequestOutputKind.DELTA
        seqs = self.seqs if not delta or changed is None else changed
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=[s.delta_output() if delta else s.to_output() for s in seqs],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )


class SampleState:
    """One of a request's n samples, as its output is built: tokens, text, logprobs, finish reason."""

    __slots__ = (
        "index",
        "request",
        "params",
        "output_token_ids",
        "logprobs",
        "cumulative_logprob",
        "detokenizer",
        "finish_reason",
        "stop_reason",
        "text_cut",
        "sent_chars",
        "sent_tokens",
    )

    def __init__(self, index: int, request: Request, params: SamplingParams, tokenizer: Any) -> None:
        self.index = index
        self.request = request
        self.params = params
        self.output_token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0  # None once a token came without its logprob
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens)
            if tokenizer is not None and params.detokenize
            else None
        )
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text_cut: int | None = None  # where a stop string cut the text
        self.sent_chars = 0  # delta outputs: text and tokens already given out
        self.sent_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        if self.detokenizer is None:
            return ""
        text = self.detokenizer.text
        if self.text_cut is not None:
            return text[: self.text_cut]
        if not self.finished:
            hold = self.params.output_text_buffer_length
            if hold:
                return text[: max(0, len(text) - hold)]
        return text

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def delta_output(self) -> CompletionOutput:
        """What is new since the previous delta (text held back for a possible stop string excluded)."""
        text = self.text
        start_tok = self.sent_tokens
        out = CompletionOutput(
            index=self.index,
            text=text[self.sent_chars :],
            token_ids=self.output_token_ids[start_tok:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[start_tok:] if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.sent_chars = max(self.sent_chars, len(text))
        self.sent_tokens = len(self.output_token_ids)
        return out

    def add_logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[float], rank: int, num: int, tokenizer: Any
    ) -> None:
        """Record the sampled token (first entry) and the top `num` alternatives at this position."""
        assert self.logprobs is not None
        self.logprobs.append(make_logprob_dict(token_ids, logprobs, rank, num, tokenizer))


def make_logprob_dict(
    token_ids: Sequence[int], logprobs: Sequence[float], rank: int, num: int, tokenizer: Any
) -> dict[int, Logprob]:
    """{token id: Logprob} for one position: the chosen token (rank `rank`), then the top `num` (ranks 1..)."""

    def text(t: int) -> str | None:
        return tokenizer.decode([t]) if tokenizer is not None else None

    out = {int(token_ids[0]): Logprob(float(logprobs[0]), int(rank), text(int(token_ids[0])))}
    for r in range(num):
        t = int(token_ids[1 + r])
        if t not in out:
            out[t] = Logprob(float(logprobs[1 + r]), r + 1, text(t))
    return out
