"""The incremental parser every tool-call format builds on.

A parser holds the text it cannot decide on yet in a buffer and consumes it only when the decision
is fixed by what it has seen (a marker that may still be completing, a JSON key still open): so it
emits the same events however the text is cut into deltas. Nothing is lost: each character ends up
as content, as a call's argument text, or in the markup of a call that parsed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from pagedrs.entrypoints.openai.tool_parsers.events import (
    ContentDelta,
    Event,
    IdFactory,
    ToolArgsDelta,
    ToolCallStart,
    new_call_id,
)

_WS = " \t\r\n"


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker` (text a parser
    must hold back because the marker may be completing)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser(ABC):
    """Feed text deltas with `feed`, end with `finish`; both return the events for what was decided.

    Whitespace next to a call is not content: a message of only calls has no content, and a reply
    with no call keeps its text exactly.
    """

    name: ClassVar[str]

    def __init__(self, new_id: IdFactory | None = None, max_calls: int | None = None) -> None:
        self._new_id = new_id or new_call_id
        self._max_calls = max_calls
        self._buf = ""
        self._out: list[Event] = []
        self._pending_ws = ""
        self.num_calls = 0  # calls parsed, emitted or not (beyond max_calls they are dropped)
        self._finished = False
        self._after_call = False

    # ------------------------------------------------------------ driving
    def feed(self, text: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("feed after finish")
        self._buf += text
        while self._buf and self._advance(final=False):
            pass
        return self._take()

    def finish(self) -> list[Event]:
        if not self._finished:
            self._finished = True
            while self._advance(final=True):
                pass
            if self._buf:
                self._content(self._buf)
                self._buf = ""
            if self._pending_ws and self.num_calls == 0:
                self._out.append(ContentDelta(self._pending_ws))
            self._pending_ws = ""
        return self._take()

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    @abstractmethod
    def _advance(self, final: bool) -> bool:
        """Consume a decided part of `self._buf`; False when nothing more can be decided now (at
        `final`, all the text is there: decide everything)."""

    # ------------------------------------------------------------ emitting
    def _content(self, text: str) -> None:
        if self._after_call:  # whitespace right after a call is not content either
            text = text.lstrip(_WS)
            self._after_call = not text
        if not text:
            return
        body = text.rstrip(_WS)
        if body:
            self._out.append(ContentDelta(self._pending_ws + body))
            self._pending_ws = ""
        self._pending_ws += text[len(body) :]

    def _start_call(self, name: str) -> None:
        self._pending_ws = ""
        self._after_call = True
        index = self.num_calls
        self.num_calls += 1
        if self._emits(index):
            self._out.append(ToolCallStart(index, self._new_id(), name))

    def _args(self, text: str) -> None:
        index = self.num_calls - 1
        if text and self._emits(index):
            self._out.append(ToolArgsDelta(index, text))

    def _emits(self, index: int) -> bool:
        return self._max_calls is None or index < self._max_calls

    def _consume(self, n: int) -> str:
        head, self._buf = self._buf[:n], self._buf[n:]
        return head
