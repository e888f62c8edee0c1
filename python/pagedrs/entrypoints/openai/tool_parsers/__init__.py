"""Tool-call parsers by `--tool-call-parser` name (vLLM's names)."""

from __future__ import annotations

from pagedrs.entrypoints.openai.tool_parsers.base import ToolParser
from pagedrs.entrypoints.openai.tool_parsers.detect import template_tool_format
from pagedrs.entrypoints.openai.tool_parsers.events import (
    ContentDelta,
    Event,
    IdFactory,
    ParsedMessage,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCall,
    ToolCallStart,
    chat_deltas,
    new_call_id,
)
from pagedrs.entrypoints.openai.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from pagedrs.entrypoints.openai.tool_parsers.generic import GenericToolParser
from pagedrs.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedrs.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedrs.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedrs.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

# vLLM's names (Qwen2.5 and Hermes models use hermes; Llama 4 the pythonic format in its tags).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,
}
# `tool_choice` auto for a template that names no format: the grammar-held JSON of llama.cpp's generic
GENERIC = "generic"

__all__ = [
    "TOOL_PARSERS",
    "GENERIC",
    "ContentDelta",
    "Event",
    "GenericToolParser",
    "HermesToolParser",
    "IdFactory",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedCallParser",
    "ParsedMessage",
    "PythonicToolParser",
    "ReasoningDelta",
    "RequiredCallsParser",
    "ToolArgsDelta",
    "ToolCall",
    "ToolCallStart",
    "ToolParser",
    "chat_deltas",
    "new_call_id",
    "template_tool_format",
]
