"""A model whose tokenizer has no chat template: chat requests are a 400 naming ``--chat-template`` (as
vLLM), streamed or not and through /v1/responses, while /v1/completions still serves; with the flag
(a file or the template text) chat works."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import API_KEY, ThreadedServer
from fake_engine import FakeEngine
from helpers_tools import server_args

from pagedrs.entrypoints.cli_args import ServerArgs, make_serve_parser
from pagedrs.entrypoints.openai.chat.serving import load_chat_template
from pagedrs.entrypoints.openai.server.app import build_app
from tests.helpers import make_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def no_template_engine() -> FakeEngine:
    tok = make_tokenizer()
    tok.chat_template = None
    engine = FakeEngine(max_model_len=256)
    engine.tokenizer = tok
    engine.vocab_size = len(tok)
    engine.get_tokenizer = lambda: tok  # type: ignore[method-assign]
    return engine


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    def start(**kw: Any) -> ThreadedServer:
        return ThreadedServer(build_app(no_template_engine(), server_args(tmp_path, **kw)))

    yield start


def test_chat_without_template_is_a_400_naming_the_flag(serve: Any) -> None:
    with serve() as s, httpx.Client(base_url=s.base_url, headers=AUTH, timeout=30) as http:
        for path, body in [
            ("/v1/chat/completions", CHAT),
            ("/v1/chat/completions", {**CHAT, "stream": True}),
            ("/v1/responses", {"model": "fake", "input": "hi", "max_output_tokens": 4}),
        ]:
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert "--chat-template" in err["message"] and err["type"] == "invalid_request_error"
        r = http.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("as_file", [False, True])
def test_chat_template_flag(serve: Any, tmp_path: Path, as_file: bool) -> None:
    value = TEMPLATE
    if as_file:
        (tmp_path / "t.jinja").write_text(TEMPLATE)
        value = str(tmp_path / "t.jinja")
    with serve(chat_template=value) as s:
        r = httpx.post(f"{s.base_url}/v1/chat/completions", json=CHAT, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(make_tokenizer().encode("<user>hi\n<assistant>"))


def test_chat_template_flag_parsing() -> None:
    ns = make_serve_parser().parse_args(["--chat-template", TEMPLATE])
    assert ServerArgs.from_namespace(ns).chat_template == TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="no/such/file"):
        load_chat_template("no/such/file.jinja")
