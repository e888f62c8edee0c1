"""Which tool-call format a chat template asks its model for, read from the template's text as
llama.cpp's server does (`common_chat_templates_apply`): the markers each format's templates write."""

from __future__ import annotations

# First match wins: a pythonic template may also mention ipython; a hermes one may quote JSON.
TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("pythonic", ("<|python_start|>", "[func_name1(")),  # Llama 4, Llama 3.2's pythonic prompt
    ("hermes", ("<tool_call>",)),  # Hermes, Qwen2.5, Qwen3
    ("llama3_json", ("<|start_header_id|>ipython<|end_header_id|>", "<|python_tag|>")),  # Llama 3.1+
)


def template_tool_format(template: str | None) -> str | None:
    """The `--tool-call-parser` name whose format `template` writes, or None (no known format)."""
    if not template:
        return None
    for name, markers in TEMPLATE_MARKERS:
        if any(m in template for m in markers):
            return name
    return None
