"""/metrics serves every ``pagedrs:`` family again under the name vLLM V1 gives it (same type, same
samples and labels, plus vLLM's ``engine`` label), or the family is listed as having no vLLM
equivalent; the names dashboards and autoscalers written for vLLM read are there."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import API_KEY, ThreadedServer
from fake_engine import FakeEngine
from helpers_tools import server_args
from prometheus_client.parser import text_string_to_metric_families

from pagedrs.entrypoints.openai.server.app import build_app
from pagedrs.entrypoints.openai.server.metrics import NO_VLLM_NAME, VLLM_NAMES

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# What vLLM V1's /metrics has (vllm/v1/metrics/loggers.py), as sample names, written out here so a
# wrong entry in VLLM_NAMES fails.
VLLM_SAMPLES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    with ThreadedServer(build_app(FakeEngine(), server_args(tmp_path_factory.mktemp("m")))) as s:
        yield s


def scrape(server: ThreadedServer) -> dict[str, tuple[str, dict[tuple[str, tuple], float]]]:
    """family name -> (type, {(sample name, sorted labels): value})."""
    text = httpx.get(f"{server.base_url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        out[family.name] = (family.type, samples)
    return out


def test_every_pagedrs_family_has_its_vllm_twin(server: ThreadedServer) -> None:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as http:
        for i in range(3):
            body = {"model": "fake", "prompt": f"hello {i}", "max_tokens": 5 + i}
            assert http.post("/v1/completions", json=body).status_code == 200
        body = {
            "model": "fake",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
        }
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    families = scrape(server)  # the requests have finished: nothing moves between the two halves
    pagedrs = {name: fam for name, fam in families.items() if name.startswith("pagedrs:")}
    assert pagedrs.keys() == VLLM_NAMES.keys() | NO_VLLM_NAME.keys()  # each family placed, once
    assert not VLLM_NAMES.keys() & NO_VLLM_NAME.keys()
    for name, twins in VLLM_NAMES.items():
        kind, samples = pagedrs[name]
        assert samples, name
        for twin in twins:
            twin_kind, twin_samples = families[twin]
            expected = {
                (twin + sample[len(name) :], tuple(sorted((*labels, ("engine", "0"))))): value
                for (sample, labels), value in samples.items()
            }
            assert (twin_kind, twin_samples) == (kind, expected), twin
    # the requests show up: counts and sums equal on both names
    assert families["vllm:request_success"][1][
        (
            "vllm:request_success_total",
            (("engine", "0"), ("finished_reason", "length"), ("model_name", "fake")),
        )
    ] == pytest.approx(4)
    ttft = families["vllm:time_to_first_token_seconds"][1]
    assert ttft[("vllm:time_to_first_token_seconds_count", (("engine", "0"), ("model_name", "fake")))] == 4


def test_vllm_sample_names_are_served(server: ThreadedServer) -> None:
    text = httpx.get(f"{server.base_url}/metrics").text
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    assert [name for name in VLLM_SAMPLES if name not in served] == []
    assert 'finished_reason="stop"' in text and 'engine="0"' in text
