"""Responses output items from the chat reader's events: the streamed events (as a client folds
them) rebuild the same items as a whole reply, however the text is cut."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrs.entrypoints.openai.chat.output import ReplyReader
from pagedrs.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedrs.entrypoints.openai.responses.items import OutputItems
from pagedrs.entrypoints.openai.tool_parsers import TOOL_PARSERS

W = '{"city": "Paris"}'
REPLIES = [
    "Plain answer.",
    f'<think>Need weather.</think>Checking. <tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>',
    f'<tool_call>{{"name": "a", "arguments": {W}}}</tool_call> between <tool_call>{{"name": "b", "arguments": {{}}}}</tool_call>',
    "<think>cut off reasoning",
    '<tool_call>{"name": "f", "arguments": {"x": [1, 2',
]


def reader() -> ReplyReader:
    counter = itertools.count()
    return ReplyReader(
        REASONING_PARSERS["qwen3"](""), TOOL_PARSERS["hermes"](lambda: f"call_{next(counter)}")
    )


def fold(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a client builds from the events: items as added, text and arguments from the deltas,
    statuses from output_item.done."""
    items: dict[int, dict[str, Any]] = {}
    for ev in events:
        kind, index = ev["type"], ev.get("output_index")
        if kind == "response.output_item.added":
            assert index not in items
            items[index] = copy.deepcopy(ev["item"])
        elif kind == "response.content_part.added":
            items[index]["content"].append(copy.deepcopy(ev["part"]))
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[index]["content"][ev["content_index"]]["text"] += ev["delta"]
        elif kind == "response.function_call_arguments.delta":
            items[index]["arguments"] += ev["delta"]
        elif kind == "response.output_item.done":
            assert ev["item"]["id"] == items[index]["id"]
            items[index]["status"] = ev["item"]["status"]
            assert ev["item"] == items[index]  # the done item is what the deltas built
    return [items[i] for i in sorted(items)]


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


@settings(max_examples=150, deadline=None)
@given(reply=st.sampled_from(REPLIES), splits=st.lists(st.integers(0, 10_000), max_size=10))
def test_streamed_events_rebuild_the_whole_replys_items(reply: str, splits: list[int]) -> None:
    whole = OutputItems()
    r = reader()
    whole.add(r.feed(reply))
    whole.add(r.finish())
    whole.close()

    points = sorted({s % (len(reply) + 1) for s in splits})
    pieces = [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)], strict=True)]
    streamed, r, events = OutputItems(), reader(), []
    for piece in pieces:
        events += streamed.add(r.feed(piece))
    events += streamed.add(r.finish())
    events += streamed.close()
    assert without_ids(fold(events)) == without_ids(streamed.items) == without_ids(whole.items)
    assert all(item["status"] == "completed" for item in streamed.items)
