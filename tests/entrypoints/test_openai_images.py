"""Images through the OpenAI server, with the `openai` client: chat `image_url` parts (data: URLs) and the
Responses API's `input_image` on a tiny random Gemma 3 with its processor, equal to the same conversation
run offline (`LLM.chat`'s path, itself checked against HF transformers in tests/multimodal); streamed equal
to whole; every bad image (undecodable, too many bytes, more encoder tokens than a step's encoder budget)
a 400 in OpenAI's error shape naming the problem, the server serving on; a model that takes no images
refuses an image part with a 400."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import API_KEY, ThreadedServer
from helpers_tools import ScriptedEngine, server_args

from pagedrs import SamplingParams
from pagedrs.engine.llm_engine import LLMEngine
from pagedrs.entrypoints.openai.server.app import build_app
from pagedrs.multimodal import media
from pagedrs.multimodal.inputs import chat_prompt
from tests.engine.conftest import make_engine, run_all
from tests.multimodal.helpers_vision import data_url, make_gemma3_vision, random_image

MAX_TOKENS = 6
IMG = random_image(30, 40, seed=3)


def _messages(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look "},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": " here"},
            ],
        }
    ]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    folder = make_gemma3_vision(tmp_path_factory.mktemp("gemma3v-server") / "m")
    return make_engine(
        folder,
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_model_len=128,
        limit_mm_per_prompt={"image": 2},
    )


@pytest.fixture(scope="module")
def offline(engine: LLMEngine) -> str:
    """The reply text of the conversation run offline, before the server takes the engine."""
    prompt = chat_prompt(engine.input_processor.mm_processor, _messages(data_url(IMG)))
    engine.add_request(
        "offline", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    return run_all(engine)["offline"].outputs[0].text


@pytest.fixture(scope="module")
def server(
    engine: LLMEngine, offline: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThreadedServer]:
    args = server_args(tmp_path_factory.mktemp("images"), served_model_name=["gemma3v"])
    with ThreadedServer(build_app(engine, args)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(
        model="gemma3v",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        **kw,  # type: ignore[arg-type]
    )


def test_chat_and_responses_images_equal_offline(client: openai.OpenAI, offline: str) -> None:
    url = data_url(IMG)
    reply = _chat(client, _messages(url), extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == offline
    assert reply.usage is not None and reply.usage.prompt_tokens > 4  # the image's placeholder tokens counted
    stream = _chat(client, _messages(url), stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == offline
    resp = client.responses.create(
        model="gemma3v",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look "},
                    {"type": "input_image", "image_url": url},
                    {"type": "input_text", "text": " here"},
                ],
            }
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert resp.output_text == offline


@pytest.mark.parametrize(
    ("url", "count", "match"),
    [
        ("data:image/png;base64,@@", 1, "base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), 1, "decod"),
        ("file:///etc/hosts", 1, "allowed-local-media-path"),
        ("ftp://example.com/a.png", 1, "data:, http"),
        (None, 3, "at most 2"),
    ],
)
def test_bad_images_are_400s(client: openai.OpenAI, url: str | None, count: int, match: str) -> None:
    content: list[dict[str, Any]] = [{"type": "text", "text": "see"}]
    content += [{"type": "image_url", "image_url": {"url": url or data_url(IMG)}}] * count
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, [{"role": "user", "content": content}])
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == "messages" and match in body["message"], body
    assert (
        _chat(client, [{"role": "user", "content": "still serving"}]).choices[0].message.content is not None
    )


@pytest.mark.parametrize(
    ("setting", "value", "param", "match"),
    [
        ("budget", 3, "multi_modal_data", "4 encoder tokens does not fit max_num_encoder_input_tokens=3"),
        ("bytes", 100, "messages", "larger than 100 bytes"),
    ],
)
def test_too_large_images_are_400s(
    server: ThreadedServer,
    client: openai.OpenAI,
    monkeypatch: pytest.MonkeyPatch,
    setting: str,
    value: int,
    param: str,
    match: str,
) -> None:
    """An image of more encoder tokens than a step's encoder budget (`max_num_encoder_input_tokens`; each
    image here is 4) or of more bytes than the server takes: a 400 in OpenAI's error shape naming the
    problem, and the next request with an image is served."""
    if setting == "budget":
        inputs = server.server.config.app.state.server.engine.input_processor
        monkeypatch.setattr(inputs, "max_num_encoder_input_tokens", value)
    else:
        monkeypatch.setattr(media, "MAX_IMAGE_BYTES", value)
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, _messages(data_url(IMG)))
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == param and match in body["message"], body
    assert body.get("type") == "invalid_request_error", body
    monkeypatch.undo()
    assert _chat(client, _messages(data_url(IMG))).choices[0].message.content is not None


def test_text_model_refuses_an_image(tmp_path: Path) -> None:
    args = server_args(tmp_path)
    with ThreadedServer(build_app(ScriptedEngine(max_model_len=4096), args)) as s:
        c = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            c.chat.completions.create(
                model="fake",
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMG)}}]}
                ],
                max_tokens=2,
            )


def test_server_process_reads_the_processor(engine: LLMEngine, tmp_path: Path) -> None:
    """A server process (which loads no weights) builds its image processor from the checkpoint folder's
    config alone; a text-only folder gets none."""
    from pagedrs.engine.arg_utils import EngineArgs
    from pagedrs.engine.frontend.image_inputs import image_settings
    from tests.helpers import make_tiny_llama

    args = EngineArgs(
        model=engine.model_path, limit_mm_per_prompt='{"image": 3}', allowed_local_media_path="/d"
    )
    got = image_settings(args.launch_config())
    assert got["mm_processor"] is not None and got["limit_mm_per_prompt"] == {"image": 3}
    assert got["allowed_local_media_path"] == "/d"
    text_only = EngineArgs(model=str(make_tiny_llama(tmp_path / "llama")), device="cpu").launch_config()
    assert image_settings(text_only)["mm_processor"] is None
