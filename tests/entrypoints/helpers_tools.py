"""Helpers for the tool-calling, reasoning and /v1/responses tests: a fake engine core whose replies
are scripted text, hand-made model outputs in each tool-call format, and the fold a client does of
streamed chat chunks."""

from __future__ import annotations

import json
import time
from typing import Any

from fake_engine import EOS, ByteTokenizer, FakeEngine

from pagedrs.engine.core.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from pagedrs.entrypoints.cli_args import ServerArgs


class ToolTokenizer(ByteTokenizer):
    """The fake byte tokenizer with a chat template that renders tools, assistant tool calls and tool
    results (so a test can see what reached the template)."""

    def apply_chat_template(  # type: ignore[override]  # adds transformers' `tools` keyword
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        text = ""
        if tools:
            text += "<tools>" + json.dumps([t["function"]["name"] for t in tools]) + "</tools>\n"
        for m in messages:
            text += f"<{m['role']}>{m['content']}"
            for call in m.get("tool_calls") or []:
                text += "<call>" + json.dumps(call["function"], sort_keys=True) + "</call>"
            if "tool_call_id" in m:
                text += f"<id>{m['tool_call_id']}</id>"
            text += "\n"
        return text + ("<assistant>" if add_generation_prompt else "")


class ScriptedEngine(FakeEngine):
    """Replies with the scripted text of the `scripts` key found last in the prompt (else the fake
    engine's letters), a few bytes per step (1, 2, 3, 1, 2, 3, ...: the stream is cut at many places),
    then stops as on EOS. `prompts` keeps each scripted request's prompt text."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tokenizer = ToolTokenizer()
        self.scripts: dict[str, str] = {}
        self.prompts: dict[str, str] = {}
        self._replies: dict[str, list[int]] = {}
        self._sent: dict[str, int] = {}

    def add_request(self, req: Any) -> None:
        super().add_request(req)
        prompt = self.tokenizer.decode(list(req.prompt_token_ids))
        found = [key for key in list(self.scripts) if key in prompt]
        if found:
            key = max(found, key=prompt.rfind)  # the latest turn's key
            self.prompts[key] = prompt
            self._replies[req.request_id] = list(self.scripts[key].encode("utf-8"))
            self._sent[req.request_id] = 0

    @property
    def generating(self) -> set[str]:
        """Request ids whose scripted reply is still being sent (not finished, not aborted)."""
        return set(self._replies)

    def abort(self, request_ids: Any, seqs: Any = ()) -> None:
        super().abort(request_ids, seqs)
        for rid in list(request_ids):
            self._replies.pop(rid, None)

    def step(self) -> EngineCoreOutputs:
        if self.fail_next_step is not None or self.die_next_step is not None:
            self._replies.clear()
            return super().step()  # fails every request, scripted or not
        scripted = {rid: self.requests.pop(rid) for rid in list(self.requests) if rid in self._replies}
        try:
            base = super().step()
        finally:
            self.requests.update(scripted)
        outs = list(base.outputs)
        for rid, req in scripted.items():
            reply, sent = self._replies[rid], self._sent[rid]
            if sent >= len(reply):  # the whole reply went out: EOS, which is not text
                out = EngineCoreOutput(rid, 0, [EOS], finish_reason=FinishReason.STOP)
            else:
                new = reply[sent : min(sent + 1 + (self.num_steps + sent) % 3, req.max_tokens)]
                self._sent[rid] = sent + len(new)
                out = EngineCoreOutput(rid, 0, new)
                if self._sent[rid] >= req.max_tokens:
                    out.finish_reason = FinishReason.LENGTH
            if out.finish_reason is not None:
                del self.requests[rid]
                del self._replies[rid]
            outs.append(out)
        return EngineCoreOutputs(outs, self.get_stats(), time.time())


def server_args(tmp_path: object, **kw: object) -> ServerArgs:
    base: dict[str, object] = dict(
        api_key="test-key",
        data_dir=str(tmp_path),
        served_model_name=["fake"],
        shutdown_grace=5.0,
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        reasoning_parser=None,
    )
    base.update(kw)
    return ServerArgs(**base)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}


def grammar_accepts(grammar: Any, text: str, tokenizer: Any = None) -> bool:
    """Whether the grammar (EBNF text or an xgrammar Grammar), compiled by xgrammar as the engine
    compiles it, accepts `text` whole, token by token (the tests' byte-level vocabulary unless a
    tokenizer is given)."""
    import xgrammar as xgr

    from tests.helpers import VOCAB_SIZE, make_tokenizer

    vocab_size = VOCAB_SIZE if tokenizer is None else len(tokenizer)
    tokenizer = tokenizer if tokenizer is not None else make_tokenizer()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    ok = all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return bool(ok and matcher.is_completed())


def fold_chat_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client puts together from chat.completion.chunk bodies (choice 0): content and
    reasoning concatenated, tool calls by index (id, name once, arguments concatenated)."""
    content: str | None = None
    reasoning: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("content"):
                content = (content or "") + delta["content"]
            if delta.get("reasoning_content"):
                reasoning = (reasoning or "") + delta["reasoning_content"]
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                if tc.get("id"):
                    assert call["id"] is None, "a call's id is sent once"
                    call["id"] = tc["id"]
                fn = tc.get("function") or {}
                if fn.get("name"):
                    assert call["name"] is None, "a call's name is sent once"
                    call["name"] = fn["name"]
                call["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": [(c["name"], c["arguments"]) for _, c in sorted(calls.items())],
        "finish_reason": finish,
    }


def message_summary(body: dict[str, Any]) -> dict[str, Any]:
    """The same summary of a non-streamed chat.completion (choice 0)."""
    choice = body["choices"][0]
    msg = choice["message"]
    return {
        "content": msg.get("content") or None,
        "reasoning_content": msg.get("reasoning_content"),
        "tool_calls": [
            (c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []
        ],
        "finish_reason": choice["finish_reason"],
    }


def sse_bodies(text: str) -> list[dict[str, Any]]:
    """The JSON bodies of a server-sent event stream (the [DONE] line left out)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out
