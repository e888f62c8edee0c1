"""Reasoning parsers (`--reasoning-parser`): ``<think>...</think>`` becomes `reasoning_content`, the
rest `content` (vLLM's deepseek_r1 and qwen3 parsers). One incremental state machine feeds both the
streamed and the non-streamed response, as the tool-call parsers do.

- deepseek_r1: the reply reasons from its start (an opening ``<think>`` is optional, as DeepSeek-R1's
  template opens it in the prompt) until ``</think>``; a reply with no ``</think>`` is all reasoning.
- qwen3: the reply reasons only when it opens with ``<think>`` (or the prompt left one open); a
  truncated ``<think>`` block is reasoning.
When the rendered prompt already closed the block (Qwen3's ``enable_thinking=False``), the reply is
content.

A structured-output constraint (response_format, guided_*, a forced tool choice) applies after the
reasoning: `after_reasoning` puts a grammar for the ``<think>`` block in front of it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, ClassVar

from pagedrs.entrypoints.openai.tool_parsers.base import held_prefix
from pagedrs.entrypoints.openai.tool_parsers.events import ContentDelta, Event, ReasoningDelta
from pagedrs.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

START, END = "<think>", "</think>"
_WS = " \t\r\n"


def _not_containing(marker: str) -> str:
    """A regex for text that does not contain `marker` (whose first character occurs only once in
    it), from the marker's automaton: state k has matched k characters; the first character always
    leads to state 1, a character that breaks the match back to state 0."""
    first, rest = _esc(marker[0]), [_esc(c) for c in marker[1:]]
    exit_ = f"[^{first}{rest[-1]}]"  # from state k >= 1 back to 0: a break character
    partial = ""  # a proper prefix of the rest of the marker
    for j in range(len(rest) - 2, -1, -1):
        exit_ = f"[^{first}{rest[j]}]|{rest[j]}({exit_})"
        partial = f"({rest[j]}{partial})?"
    loop = f"{partial}{first}"  # state 1 back to state 1
    return f"([^{first}]|{first}({loop})*({exit_}))*({first}({loop})*{partial})?"


def _esc(ch: str) -> str:
    return "\\" + ch if ch in "\\^]-[/.()*+?|{}$" else ch


class ReasoningParser:
    name: ClassVar[str]
    reasons_without_tag: ClassVar[bool]

    def __init__(self, prompt_text: str = "") -> None:
        self._buf = ""
        self._out: list[Event] = []
        self._state = self.initial_state(prompt_text)

    @classmethod
    def initial_state(cls, prompt_text: str) -> str:
        """ "reasoning" when the prompt left a ``<think>`` open, "content" when it closed it, else
        "start" (the reply decides)."""
        opened = prompt_text.rfind(START)
        if opened < 0:
            return "start"
        if prompt_text.find(END, opened) >= 0:
            return "content" if not prompt_text[prompt_text.rfind(END) + len(END) :].strip(_WS) else "start"
        return "reasoning" if not prompt_text[opened + len(START) :].strip(_WS) else "start"

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._buf and self._advance(final=False):
            pass
        return self._take()

    def finish(self) -> list[Event]:
        while self._advance(final=True):
            pass
        return self._take()

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _advance(self, final: bool) -> bool:
        if self._state == "start":
            body = self._buf.lstrip(_WS)
            if body.startswith(START):
                self._buf = body[len(START) :]
                self._state = "reasoning"
            elif not final and START.startswith(body):
                return False
            else:
                self._state = "reasoning" if self.reasons_without_tag else "content"
            return True
        if self._state == "reasoning":
            i = self._buf.find(END)
            if i < 0:
                keep = 0 if final else held_prefix(self._buf, END)
                self._emit(ReasoningDelta, len(self._buf) - keep)
                return False
            self._emit(ReasoningDelta, i)
            self._buf = self._buf[len(END) :]
            self._state = "after"
            return True
        if self._state == "after":  # whitespace between the block and the answer is neither
            body = self._buf.lstrip(_WS)
            self._buf = body
            if not body:
                return False
            self._state = "content"
            return True
        self._emit(ContentDelta, len(self._buf))
        return False

    def _emit(self, kind: type[ReasoningDelta] | type[ContentDelta], n: int) -> None:
        if n > 0:
            self._out.append(kind(self._buf[:n]))
            self._buf = self._buf[n:]

    # ---------------------------------------------------------------- constraints
    def prefix_regex(self, prompt_text: str) -> str | None:
        """What the reply may hold before a constrained answer, as a regex (None: nothing)."""
        state = self.initial_state(prompt_text)
        block = _not_containing(END) + _esc_all(END) + "[ \\n]*"
        if state == "content":
            return None
        if state == "reasoning":
            return block
        if self.reasons_without_tag:
            return f"({_esc_all(START)})?" + block
        return f"({_esc_all(START)}{block})?"

    def after_reasoning(
        self, params: StructuredOutputsParams | None, prompt_text: str
    ) -> StructuredOutputsParams | None:
        """`params` with the reasoning block allowed before it (as one EBNF grammar)."""
        if params is None:
            return None
        prefix = self.prefix_regex(prompt_text)
        if prefix is None:
            return params
        import xgrammar as xgr

        return StructuredOutputsParams(
            grammar=str(xgr.Grammar.concat(xgr.Grammar.from_regex(prefix), _grammar_of(params)))
        )


def _esc_all(text: str) -> str:
    return "".join(_esc(c) for c in text)


def _grammar_of(params: StructuredOutputsParams) -> xgr.Grammar:
    """The xgrammar Grammar of a constraint (as the engine would compile it)."""
    import xgrammar as xgr

    kind, spec = params.key()
    if kind == "json":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in params.choice or []))
    return xgr.Grammar.from_ebnf(spec)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    reasons_without_tag = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    reasons_without_tag = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
