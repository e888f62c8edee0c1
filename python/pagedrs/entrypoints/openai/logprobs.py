"""Engine logprobs -> OpenAI's completions and chat logprobs objects.

The engine gives, per generated token, a mapping token id -> logprob (a float or an object
with ``.logprob``), holding the sampled token and the top-k alternatives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def _value(lp: Any) -> float:
    v = float(getattr(lp, "logprob", lp))
    return v if math.isfinite(v) else -9999.0  # JSON has no -inf


def _rank(lp: Any) -> int:
    r = getattr(lp, "rank", None)
    return int(r) if r is not None else 1 << 30


def _entries(token_id: int, step: Any, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(sampled token's logprob, top-k [(id, logprob)] best first) of one position."""
    if step is None:
        return 0.0, []
    pairs = list(step.items()) if isinstance(step, dict) else list(step)
    items = [(int(t), _value(v), _rank(v)) for t, v in pairs]
    sampled = next((v for t, v, _ in items if t == token_id), None)
    items.sort(key=lambda x: (-x[1], x[2]))
    return (sampled if sampled is not None else 0.0), [(t, v) for t, v, _ in items[:k]]


class TokenText:
    """Decodes single token ids (cached) for logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            if len(self._cache) < 200_000:
                self._cache[token_id] = s
        return s


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Any] | None, k: int, text_of: TokenText, text_offset: int
) -> dict[str, Any]:
    """OpenAI completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    pos = text_offset
    steps = list(logprobs) if logprobs is not None else []
    for i, tid in enumerate(token_ids):
        step = steps[i] if i < len(steps) else None
        lp, best = _entries(tid, step, k)
        s = text_of(tid)
        tokens.append(s)
        token_logprobs.append(lp)
        top.append({text_of(t): v for t, v in best} if k > 0 else None)
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Any] | None, k: int, text_of: TokenText
) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    steps = list(logprobs) if logprobs is not None else []
    for i, tid in enumerate(token_ids):
        step = steps[i] if i < len(steps) else None
        lp, best = _entries(tid, step, k)
        s = text_of(tid)
        content.append(
            {
                "token": s,
                "logprob": lp,
                "bytes": list(s.encode("utf-8", "replace")),
                "top_logprobs": [
                    {"token": text_of(t), "logprob": v, "bytes": list(text_of(t).encode("utf-8", "replace"))}
                    for t, v in best
                ],
            }
        )
    return {"content": content}
