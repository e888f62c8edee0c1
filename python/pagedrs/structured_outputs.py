"""Structured outputs: a JSON schema, a regex, a choice or a grammar enforced on the sampled tokens.

The grammar engine is xgrammar (vLLM's and SGLang's default): it compiles a constraint once against the
tokenizer's vocabulary, and a matcher per sequence gives the set of tokens allowed next as a bitmask
that is applied to the logits before sampling. Only requests that carry a constraint pay anything.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

__all__ = ["GuidedDecodingParams", "StructuredOutputManager", "StructuredOutputsParams"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, dict or str), `regex`, `choice` (the output is one of the
    strings), `grammar` (EBNF, xgrammar's dialect of GBNF), `json_object=True` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured outputs need exactly one of {', '.join(_KINDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        if self.choice is not None:
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string, got {v!r}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON schema (dict or string), got {type(self.json).__name__}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (the cache key)."""
        kind = self.kind
        if kind == "json":
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        elif kind == "choice":
            spec = json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return kind, str(spec)

    def validate(self) -> None:
        """Build the grammar (no tokenizer needed): ValueError naming the field when it is invalid."""
        import xgrammar as xgr

        kind, spec = self.key()
        try:
            if kind == "json":
                json.loads(spec)
                xgr.Grammar.from_json_schema(spec, any_whitespace=False)
            elif kind == "regex":
                xgr.Grammar.from_regex(spec)
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(spec)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(_choice_ebnf(self.choice or []))
        except (RuntimeError, ValueError) as exc:
            msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"invalid {kind}: {msg}") from None


class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name for `StructuredOutputsParams` (`SamplingParams(guided_decoding=...)`)."""


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class StructuredOutputManager:
    """Compiles constraints against one tokenizer (each distinct one once, in a background thread so a
    slow compile does not stall the step loop) and hands out matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        if tokenizer is None:
            raise ValueError(
                "structured outputs need a tokenizer (the engine was started with skip_tokenizer_init)"
            )
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: Any = None
        self._cache: dict[tuple[str, str], Future[Any]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def _get_compiler(self) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            self.vocab_size = info.vocab_size
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Future[Any]:
        key = params.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self._pool.submit(self._compile, key, params.choice)
                self._cache[key] = fut
            return fut

    def _compile(self, key: tuple[str, str], choice: list[str] | None) -> Any:
        compiler = self._get_compiler()
        kind, spec = key
        if kind == "json":
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(_choice_ebnf(choice or []))
        return compiler.compile_grammar(spec)

    @staticmethod
    def matcher(compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def bitmask_async(self, rows: list[Any]) -> Future[tuple[Any, list[int]] | None] | None:
        """`bitmask` in a helper thread (xgrammar releases the GIL), so it overlaps the forward."""
        if not any(m is not None for m in rows):
            return None
        return self._mask_pool.submit(self.bitmask, rows)

    def bitmask(self, rows: list[Any]) -> tuple[Any, list[int]] | None:
        """The next-token bitmask of every row with a matcher (row i of `rows`: a matcher or None), and
        which rows it applies to; None when no row is constrained."""
        import xgrammar as xgr

        indices = [i for i, m in enumerate(rows) if m is not None]
        if not indices:
            return None
        mask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i in indices:
            rows[i].fill_next_token_bitmask(mask, i)
        return mask, indices
