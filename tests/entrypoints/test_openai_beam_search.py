"""`use_beam_search` on /v1/completions and /v1/chat/completions (vLLM's fields: n beams, or best_of when
larger, the best n returned; length_penalty), served over a tiny random model in this process: the
choices are HF transformers' beams (see tests/engine/helpers_beam_search.py for why with no EOS)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import API_KEY, ThreadedServer

from pagedrs import EngineArgs, LLMEngine
from pagedrs.entrypoints.cli_args import ServerArgs
from pagedrs.entrypoints.openai.server.app import build_app
from tests.engine.helpers_beam_search import hf_beam_search
from tests.helpers import load_hf_model, make_tiny_llama, make_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [(7 * i + 3) % 250 for i in range(20)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThreadedServer, Path]]:
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny"), arch="llama", seed=4)
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(path), device="cpu", disable_log_stats=True, num_kv_blocks=128)
    )
    args = ServerArgs(
        api_key=API_KEY, data_dir=str(tmp_path_factory.mktemp("data")), served_model_name=["tiny"]
    )
    with ThreadedServer(build_app(engine, args)) as s:
        yield s, path


def _post(server: ThreadedServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{route}", json=body, headers=AUTH, timeout=120)


def test_completions_beams_equal_hf(server: tuple[ThreadedServer, Path]) -> None:
    srv, path = server
    second = PROMPT[:9]
    body = {
        "prompt": [PROMPT, second],
        "use_beam_search": True,
        "n": 2,
        "best_of": 3,  # 3 beams, the best 2 returned
        "max_tokens": 8,
        "ignore_eos": True,
        "logprobs": 1,
    }
    r = _post(srv, "completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    hf, tok = load_hf_model(path), make_tokenizer()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # prompt-major: prompt p, beam b -> p * n + b
    for p_idx, prompt in enumerate([PROMPT, second]):
        expected = hf_beam_search(hf, prompt, 3, 8)[:2]
        for (ids, cum), choice in zip(expected, choices[2 * p_idx : 2 * p_idx + 2], strict=True):
            assert choice["text"] == tok.decode(ids, skip_special_tokens=True)
            assert choice["finish_reason"] == "length"
            assert sum(choice["logprobs"]["token_logprobs"]) == pytest.approx(cum, abs=1e-3)
    assert out["usage"]["completion_tokens"] == 4 * 8
    assert out["usage"]["prompt_tokens"] == len(PROMPT) + len(second)


def test_chat_beams(server: tuple[ThreadedServer, Path]) -> None:
    srv, _ = server
    body = {
        "messages": [{"role": "user", "content": "hi there"}],
        "use_beam_search": True,
        "n": 3,
        "max_tokens": 5,
        "ignore_eos": True,
        "logprobs": True,
    }
    r = _post(srv, "chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    cums = [sum(t["logprob"] for t in c["logprobs"]["content"]) for c in out["choices"]]
    assert cums == sorted(cums, reverse=True)  # best first, all the same length
    assert out["usage"]["completion_tokens"] == 3 * 5


@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_beam_search_sends_the_whole_choices(
    server: tuple[ThreadedServer, Path], include_usage: bool
) -> None:
    """As vLLM: a streamed beam search gives each choice whole once the search is done, in the chunk
    shapes of a token-by-token stream; the official client reads it, and the pieces equal the
    non-streamed response."""
    srv, _ = server
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY)
    extra = {"use_beam_search": True, "ignore_eos": True}
    opts = {"stream_options": {"include_usage": True}} if include_usage else {}
    whole = client.completions.create(
        model="tiny", prompt=PROMPT, n=2, max_tokens=6, logprobs=1, extra_body=extra
    )
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, n=2, max_tokens=6, logprobs=1, stream=True, extra_body=extra, **opts
        )
    )
    got = sorted((c for ch in chunks for c in ch.choices), key=lambda c: c.index)
    assert [c.text for c in got] == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert [c.finish_reason for c in got] == ["length", "length"]
    for c, w in zip(got, sorted(whole.choices, key=lambda c: c.index), strict=True):
        # two runs of the search: the same beams, logprobs equal up to float32 batch-order rounding
        assert c.logprobs.token_logprobs == pytest.approx(w.logprobs.token_logprobs, abs=1e-4)
    assert (chunks[-1].usage is not None) == include_usage
    if include_usage:
        # the counts; the cached-token count may differ (the second run finds the first's blocks)
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 2 * 6

    messages = [{"role": "user", "content": "hi there"}]
    whole_chat = client.chat.completions.create(
        model="tiny", messages=messages, n=3, max_tokens=5, logprobs=True, extra_body=extra
    )
    chat_chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            n=3,
            max_tokens=5,
            logprobs=True,
            stream=True,
            extra_body=extra,
            **opts,
        )
    )
    deltas = sorted((c for ch in chat_chunks for c in ch.choices), key=lambda c: c.index)
    assert [d.index for d in deltas] == [0, 1, 2]
    for d, w in zip(deltas, whole_chat.choices, strict=True):
        assert d.delta.role == "assistant" and d.delta.content == w.message.content
        assert d.finish_reason == w.finish_reason
        assert [t.logprob for t in d.logprobs.content] == pytest.approx(
            [t.logprob for t in w.logprobs.content], abs=1e-4
        )
    assert all(ch.object == "chat.completion.chunk" for ch in chat_chunks)
    if include_usage:
        assert chat_chunks[-1].usage.completion_tokens == whole_chat.usage.completion_tokens == 3 * 5
        assert chat_chunks[-1].usage.prompt_tokens == whole_chat.usage.prompt_tokens


@pytest.mark.parametrize(
    "route,extra,param,message",
    [
        ("completions", {"n": 0}, "n", None),
        ("completions", {"n": 2, "best_of": 1}, "best_of", "best_of (1) must be at least n (2)"),
        ("completions", {"n": 11}, "n", "beam_width must be at most 10"),
        ("completions", {"best_of": 11}, "best_of", "beam_width must be at most 10"),
        ("completions", {"max_tokens": 0}, "max_tokens", None),
        ("completions", {"max_tokens": 5000}, "max_tokens", "maximum context length"),
        ("completions", {"stop": ["a"]}, "stop", "stop is not supported with use_beam_search"),
        ("chat/completions", {"n": 11}, "n", "beam_width must be at most 10"),
        # the engine's context check, named as each endpoint spells the field
        ("chat/completions", {"max_tokens": 5000}, "max_tokens", "maximum context length"),
        (
            "chat/completions",
            {"max_completion_tokens": 5000},
            "max_completion_tokens",
            "maximum context length",
        ),
        ("completions", {"prompt": ["hi", "x " * 5000]}, "prompt[1]", "maximum context length"),
        ("chat/completions", {"guided_regex": "a+"}, "guided_regex", "not supported with use_beam_search"),
    ],
)
def test_bad_beam_search_requests_are_400(
    server: tuple[ThreadedServer, Path], route: str, extra: dict, param: str, message: str | None
) -> None:
    srv, _ = server
    body: dict[str, Any] = {"use_beam_search": True, "max_tokens": 2, **extra}
    if route == "completions":
        body.setdefault("prompt", PROMPT)
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = _post(srv, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if message is not None:
        assert message in err["message"]
