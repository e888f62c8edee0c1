"""The official `openai` client against `python -m pagedrs.entrypoints.openai.api_server` with the
default model (SmolLM2-135M-Instruct GGUF): results equal LLM.generate's, streaming, n, stop,
logprobs, usage."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import SubprocessServer

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    from pagedrs import LLM

    # The same engine settings as the server (conftest.SERVER_ENGINE_FLAGS).
    yield LLM(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=256, max_num_seqs=32)


@pytest.fixture(scope="module")
def client(real_server: SubprocessServer) -> Any:
    return real_server.client()


def _greedy(**kw: Any) -> Any:
    from pagedrs import SamplingParams

    return SamplingParams(temperature=0.0, **kw)


def test_greedy_completions_equal_llm_generate(client: Any, llm: Any) -> None:
    ref = llm.generate(PROMPTS, _greedy(max_tokens=MAX_TOKENS), use_tqdm=False)
    r = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in ref]
    tok = llm.get_tokenizer()
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in ref)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # token-id prompts give the same text
    ids = tok.encode(PROMPTS[0])
    r2 = client.completions.create(model="smollm2", prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r2.choices[0].text == r.choices[0].text


def test_greedy_chat_equals_llm_chat(client: Any, llm: Any) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    ref = llm.chat(messages, _greedy(max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    r = client.chat.completions.create(
        model="default", messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(llm.llm_engine.apply_chat_template(messages))
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_stream_equals_non_stream(client: Any) -> None:
    kw: dict[str, Any] = dict(model="smollm2", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == full.usage.total_tokens

    msgs = [{"role": "user", "content": "Say hello."}]
    cfull = client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=MAX_TOKENS, temperature=0
    )
    stream = client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    ctext = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert ctext == cfull.choices[0].message.content


def test_n_2(client: Any) -> None:
    r = client.completions.create(
        model="smollm2", prompt=PROMPTS[0], max_tokens=6, n=2, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.text for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 12
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        n=2,
        temperature=1.0,
        seed=1,
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    streamed: dict[int, str] = {}
    for c in client.completions.create(
        model="smollm2", prompt=PROMPTS[0], max_tokens=4, n=2, stream=True, temperature=0
    ):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert sorted(streamed) == [0, 1] and streamed[0] == streamed[1]  # greedy: both the same


def test_stop(client: Any) -> None:
    full = client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    text = full.choices[0].text
    stop = text.strip()[2:5]  # a piece from inside the greedy output
    assert stop and stop in text
    r = client.completions.create(
        model="smollm2", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="smollm2", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=stop, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_logprobs(client: Any, llm: Any) -> None:
    r = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy picks the top token
    assert lp.text_offset[0] == 0
    c = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_echo_and_models(client: Any) -> None:
    r = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPTS[0])
    assert [m.id for m in client.models.list().data] == ["smollm2", "default"]
