"""/v1/responses over a fake engine with scripted replies, through the official `openai` client:
create (text and message input, instructions), streaming events, stored responses (retrieve,
previous_response_id, delete, across a restart), function calls and their outputs, background
responses and cancel, and 4xx in OpenAI's shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import API_KEY, ThreadedServer, wait_until
from helpers_tools import WEATHER_TOOL, ScriptedEngine, server_args

from pagedrs.entrypoints.openai.responses.store import ResponsesStore
from pagedrs.entrypoints.openai.server.app import build_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
FN_TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat tool shape
W = '{"city": "Paris", "days": 3}'


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses")


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine(max_model_len=4096)


@pytest.fixture(scope="module")
def server(engine: ScriptedEngine, data_dir: Path) -> Iterator[ThreadedServer]:
    with ThreadedServer(build_app(engine, server_args(data_dir, reasoning_parser="qwen3"))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def script(engine: ScriptedEngine, reply: str) -> str:
    key = f"q-{uuid.uuid4().hex[:12]}"
    engine.scripts[key] = reply
    return key


def test_create_with_text_input(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    key = script(engine, "Paris is the capital of France.")
    r = client.responses.create(model="fake", input=key, instructions="Answer briefly.")
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == "Paris is the capital of France."
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens == len(b"Paris is the capital of France.") + 1  # and EOS
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert engine.prompts[key].startswith("<system>Answer briefly.\n<user>" + key)


def test_message_list_input_and_max_output_tokens(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    key = script(engine, "One two three four five six")
    r = client.responses.create(
        model="fake",
        input=[
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": [{"type": "input_text", "text": key}]},
        ],
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "One two" and r.temperature == 0.5 and r.top_p == 0.9
    assert "<system>Be terse.\n" in engine.prompts[key]


def test_stream_events(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    key = script(engine, "<think>Short answer.</think>Streaming works.")
    with client.responses.stream(model="fake", input=key) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Streaming works." == final.output_text
    message_events = [
        t for t in types if not t.startswith("response.reasoning") and t.startswith("response.")
    ]
    order = [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [t for t in message_events if t in order][-3:] == order[-3:]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == len(b"Short answer.")  # byte tokens
    assert final.output[0].content[0].text == "Short answer."
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.status == "completed"


def test_stored_conversation(engine: ScriptedEngine, client: openai.OpenAI, server: ThreadedServer) -> None:
    first_key = script(engine, "My name is Ada.")
    first = client.responses.create(model="fake", input=first_key)
    assert client.responses.retrieve(first.id).output_text == "My name is Ada."
    key = script(engine, "You said Ada.")
    second = client.responses.create(model="fake", input=key, previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == "You said Ada."
    assert f"<user>{first_key}\n<assistant>My name is Ada.\n<user>{key}" in engine.prompts[key]
    unstored = client.responses.create(model="fake", input=script(engine, "x"), store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.role) for i in listed.data] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert listed.data[1].content[0].text == "My name is Ada." and listed.data[2].content[0].text == key
    newest = client.responses.input_items.list(second.id, limit=1)
    assert newest.data[0].id == listed.data[-1].id and newest.has_more
    after = client.responses.input_items.list(second.id, limit=5, after=newest.data[0].id)
    assert [i.id for i in after.data] == [i.id for i in reversed(listed.data[:-1])] and not after.has_more
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    r = httpx.post(
        f"{server.base_url}/v1/responses",
        json={"model": "fake", "input": "hi", "previous_response_id": first.id},
        headers=AUTH,
    )
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_function_call_and_its_output(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    key = script(engine, f'<tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>')
    r = client.responses.create(model="fake", input=key, tools=[FN_TOOL])
    calls = [item for item in r.output if item.type == "function_call"]
    assert (
        len(calls) == 1
        and calls[0].name == "get_weather"
        and json.loads(calls[0].arguments)["city"] == "Paris"
    )
    answer = script(engine, "It is sunny.")
    r2 = client.responses.create(
        model="fake",
        previous_response_id=r.id,
        tools=[FN_TOOL],
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": f"sunny {answer}"}],
    )
    assert r2.output_text == "It is sunny."
    prompt = engine.prompts[answer]
    assert '<call>{"arguments": {"city": "Paris", "days": 3}, "name": "get_weather"}</call>' in prompt
    assert f"<tool>sunny {answer}<id>{calls[0].call_id}</id>" in prompt


def test_streamed_function_call(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    key = script(engine, f'Checking. <tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>')
    with client.responses.stream(model="fake", input=key, tools=[FN_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == W and len(done) == 1 and done[0].arguments == W
    assert [item.type for item in final.output] == ["message", "function_call"]
    non_streamed = client.responses.create(model="fake", input=key, tools=[FN_TOOL])
    assert [(i.type, getattr(i, "arguments", None)) for i in non_streamed.output] == [
        (i.type, getattr(i, "arguments", None)) for i in final.output
    ]
    assert non_streamed.output_text == final.output_text == "Checking."


def test_a_failure_mid_stream_is_a_failed_response(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    with client.responses.stream(model="fake", input=script(engine, "y" * 400)) as stream:
        events, injected = [], False
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and not injected:
                engine.fail_next_step = RuntimeError("injected step failure")
                injected = True
    assert events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None and failed.error.message
    assert client.responses.retrieve(failed.id).status == "failed"
    later = client.responses.create(model="fake", input=script(engine, "still serving"))
    assert later.output_text == "still serving"


def test_background_and_cancel(engine: ScriptedEngine, client: openai.OpenAI) -> None:
    quick = client.responses.create(
        model="fake", input=script(engine, "Done in the background."), background=True
    )
    assert quick.status in ("queued", "in_progress")
    finished = wait_until(
        lambda: (r := client.responses.retrieve(quick.id)).status == "completed" and r, timeout=30
    )
    assert finished.output_text == "Done in the background."
    slow = client.responses.create(model="fake", input=script(engine, "z" * 3000), background=True)
    cancelled = client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(slow.id).status == "cancelled"
    wait_until(lambda: not engine.generating, timeout=10)  # the engine request was aborted
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(model="fake", input=script(engine, "sync")).id)
    deleted = client.responses.create(model="fake", input=script(engine, "d" * 3000), background=True)
    client.responses.delete(deleted.id)
    wait_until(lambda: not engine.generating, timeout=10)  # deleting a running response aborts it
    with pytest.raises(openai.NotFoundError):  # and it does not come back when its task ends
        client.responses.retrieve(deleted.id)


def test_stored_responses_survive_a_restart(
    engine: ScriptedEngine, client: openai.OpenAI, data_dir: Path
) -> None:
    r = client.responses.create(model="fake", input=script(engine, "Remember me."))
    with ThreadedServer(build_app(ScriptedEngine(), server_args(data_dir))) as other:
        c = openai.OpenAI(base_url=f"{other.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
        assert c.responses.retrieve(r.id).output_text == "Remember me."


def test_unfinished_background_responses_fail_after_a_restart(tmp_path: Path) -> None:
    store = ResponsesStore(tmp_path)
    store.create({"id": "resp_left", "created_at": 1, "status": "in_progress", "background": True}, [])
    store.close()
    with ThreadedServer(build_app(ScriptedEngine(), server_args(tmp_path))) as s:
        r = httpx.get(f"{s.base_url}/v1/responses/resp_left", headers=AUTH)
        assert r.status_code == 200 and r.json()["status"] == "failed" and r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": []}, "input"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        (  # an image to a model that takes none
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0]",
        ),
        ({"input": "hi", "background": True, "store": False}, "background"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        (
            {"input": "hi", "tools": [FN_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
        ),
        # the engine's own checks, named as /v1/responses spells them, before anything is queued
        ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": 5000, "background": True}, "max_output_tokens"),
        ({"input": "x" * 5000, "background": True}, "input"),
    ],
)
def test_bad_requests_are_400(server: ThreadedServer, body: dict[str, object], param: str) -> None:
    r = httpx.post(f"{server.base_url}/v1/responses", json={"model": "fake", **body}, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_truncation_auto_drops_the_oldest_items(engine: ScriptedEngine, server: ThreadedServer) -> None:
    """A conversation longer than the context (4096 byte tokens here): "disabled" (the default) is a 400
    naming input; "auto" drops items from the front, a tool output whose call went with them too,
    and keeps the instructions and the newest turns."""
    key = script(engine, "Still here.")
    items = [
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": W},
        {"type": "function_call_output", "call_id": "call_1", "output": "b" * 2000},
        {"role": "user", "content": "c" * 1500},
        {"role": "assistant", "content": "d" * 800},
        {"role": "user", "content": key},
    ]
    body = {"model": "fake", "input": items, "instructions": "Be brief.", "max_output_tokens": 100}
    url = f"{server.base_url}/v1/responses"
    r = httpx.post(url, json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input" and "context length" in r.json()["error"]["message"]
    r = httpx.post(url, json={**body, "truncation": "auto"}, headers=AUTH)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["truncation"] == "auto" and out["output"][0]["content"][0]["text"] == "Still here."
    prompt = engine.prompts[key]
    assert "b" * 100 not in prompt and "get_weather" not in prompt  # the call went with its output
    assert "c" * 1500 in prompt and "d" * 800 in prompt and prompt.startswith("<system>Be brief.")
    assert out["usage"]["input_tokens"] + 100 <= 4096
    # The stored conversation is the whole one.
    listed = httpx.get(f"{url}/{out['id']}/input_items", params={"order": "asc"}, headers=AUTH).json()
    assert [x["type"] for x in listed["data"]][:2] == ["function_call", "function_call_output"]
    # Nothing left to drop: the newest item alone is too long, a 400 as with "disabled".
    r = httpx.post(url, json={**body, "input": "x" * 5000, "truncation": "auto"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_include_values(engine: ScriptedEngine, client: openai.OpenAI, server: ThreadedServer) -> None:
    """OpenAI's include values are accepted (only the logprobs add anything here); others are a 400."""
    key = script(engine, "ok")
    r = client.responses.create(
        model="fake", input=key, include=["reasoning.encrypted_content", "file_search_call.results"]
    )
    assert r.output_text == "ok" and r.output[0].content[0].logprobs == []
    bad = httpx.post(
        f"{server.base_url}/v1/responses",
        json={"model": "fake", "input": "hi", "include": ["message.everything"]},
        headers=AUTH,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("include")


def test_a_cancel_or_delete_through_another_api_server_aborts_the_owner(tmp_path: Path) -> None:
    """With several API server processes sharing the store (`--api-server-count`), a background
    response runs where it was created; cancelling or deleting it through another server stops the
    owner's generation too, not just the stored status."""
    owner_engine, other_engine = ScriptedEngine(max_model_len=4096), ScriptedEngine(max_model_len=4096)
    args = server_args(tmp_path, api_server_count=2)
    with (
        ThreadedServer(build_app(owner_engine, args)) as owner,
        ThreadedServer(build_app(other_engine, args)) as other,
    ):
        mine = openai.OpenAI(base_url=f"{owner.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
        theirs = openai.OpenAI(base_url=f"{other.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
        slow = mine.responses.create(model="fake", input=script(owner_engine, "z" * 20000), background=True)
        wait_until(lambda: owner_engine.generating, timeout=10)
        assert theirs.responses.cancel(slow.id).status == "cancelled"
        wait_until(lambda: not owner_engine.generating, timeout=5)  # the owner aborted it (else ~50 s)
        assert mine.responses.retrieve(slow.id).status == "cancelled"
        gone = mine.responses.create(model="fake", input=script(owner_engine, "y" * 20000), background=True)
        wait_until(lambda: owner_engine.generating, timeout=10)
        theirs.responses.delete(gone.id)
        wait_until(lambda: not owner_engine.generating, timeout=5)
        with pytest.raises(openai.NotFoundError):
            mine.responses.retrieve(gone.id)
        assert not other_engine.generating
