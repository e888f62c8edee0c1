"""Speculative decoding behind the OpenAI server (in this process, over a tiny random Llama): completions,
streamed and not, equal `LLM.generate` without speculation, and /metrics counts the drafts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from pagedrs import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedrs.entrypoints.openai.app import build_app
from tests.entrypoints.conftest import API_KEY, ThreadedServer, metric_value
from tests.helpers import make_tiny_llama

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BASE = ["abcabcabcabcabc", "hello hello hello hello", "the cat sat on the mat, the cat"]
PROMPTS: list[str] = []
ENGINE = dict(device="cpu", dtype="float32", disable_log_stats=True, num_kv_blocks=256, seed=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThreadedServer, list[str]]]:
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny"), arch="llama", seed=1)
    plain = LLM(str(path), **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # Each prompt followed by the model's own continuation and the prompt again: prompt lookup then
    # proposes what the random model tends to say.
    first = [o.outputs[0].text for o in plain.generate(BASE, greedy, use_tqdm=False)]
    PROMPTS[:] = [b + t + b for b, t in zip(BASE, first, strict=True)]
    want = [o.outputs[0].text for o in plain.generate(PROMPTS, greedy, use_tqdm=False)]
    plain.shutdown()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "disable_by_batch_size": 16,
    }
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path), speculative_config=spec, **ENGINE))
    args = SimpleNamespace(
        api_key=API_KEY, data_dir=str(tmp_path_factory.mktemp("data")), served_model_name=["tiny"]
    )
    with ThreadedServer(build_app(engine, args)) as s:
        yield s, want


def test_completions_equal_the_plain_engine_and_metrics_count_drafts(
    served: tuple[ThreadedServer, list[str]],
) -> None:
    srv, want = served
    body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    got = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert got == want
    for prompt, text in zip(PROMPTS, want, strict=True):
        streamed = ""
        one = {**body, "prompt": prompt, "stream": True}
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=one, headers=AUTH, timeout=120) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        assert streamed == text
    metrics = httpx.get(f"{srv.base_url}/metrics", timeout=30).text
    drafted = metric_value(metrics, "pagedrs:spec_decode_num_draft_tokens_total")
    accepted = metric_value(metrics, "pagedrs:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted
    assert metric_value(metrics, "pagedrs:spec_decode_num_drafts_total") > 0
