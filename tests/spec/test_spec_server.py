"""Speculative decoding behind the OpenAI server over a tiny random Llama: in this process (n-gram),
completions, streamed and not, equal `LLM.generate` without speculation and /metrics counts the drafts;
as `pagedrs serve -tp 2` with a draft model, the same holds across processes."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedrs import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedrs.entrypoints.cli_args import ServerArgs
from pagedrs.entrypoints.openai.server.app import build_app
from tests.entrypoints.conftest import API_KEY, SubprocessServer, ThreadedServer, metric_value, wait_until
from tests.helpers import child_pids, cmdline, make_tiny_llama, process_gone

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
    args = ServerArgs(
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_serve_tp2_with_a_draft_model_equals_the_plain_engine(tmp_path: Path) -> None:
    """`pagedrs serve -tp 2 --speculative-config '{"method": "draft_model", ...}'` in its own process: the
    flag reaches the engine core, the draft runs on rank 0 and its drafts reach the other rank, so the
    openai client's greedy completions (plain and streamed chat) equal `LLM.generate` without speculation
    in one process; /metrics counts the accepted drafts (the target is its own draft, so most are); and
    SIGTERM leaves no engine core or worker behind."""
    path = make_tiny_llama(tmp_path / "tiny", arch="llama", seed=1)
    plain = LLM(str(path), **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].text for o in plain.generate(BASE, greedy, use_tqdm=False)]
    chat_want = plain.chat([{"role": "user", "content": "hi"}], greedy, use_tqdm=False)[0].outputs[0].text
    plain.shutdown()
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    server = SubprocessServer(
        tmp_path / "data",
        ["--model", str(path), "-tp", "2", "--seed", "0", "--speculative-config", json.dumps(spec)],
        api_key=None,
    )
    server.start()
    assert server.proc is not None
    procs: list[int] = []
    try:
        for core in child_pids(server.proc.pid):
            procs += [core, *child_pids(core)]
        assert any("pagedrs.executor.rank_main" in cmdline(p) for p in procs), [cmdline(p) for p in procs]
        client = server.client()
        name = client.models.list().data[0].id
        for prompt, text in zip(BASE, want, strict=True):
            r = client.completions.create(
                model=name, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
            )
            assert r.choices[0].text == text
        stream = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat_want
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        drafted = metric_value(metrics, "pagedrs:spec_decode_num_draft_tokens_total")
        accepted = metric_value(metrics, "pagedrs:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= drafted and accepted >= 0.5 * drafted, (accepted, drafted)
        assert server.terminate() == 0
        wait_until(lambda: all(process_gone(p) for p in procs), timeout=60)
    finally:
        server.kill()
