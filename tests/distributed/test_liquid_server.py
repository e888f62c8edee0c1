"""`pagedrs serve --liquid-gpu-range 0 1`: streams in flight while the model scales out to two ranks and
back come out identical to offline greedy; the admin endpoint takes the API key."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from pagedrs import LLM, SamplingParams
from tests.entrypoints.conftest import SubprocessServer
from tests.helpers import make_tiny_llama

API_KEY = "liquid-key"
PROMPTS = [f"request {i}: the liquid engine" for i in range(6)]
MAX_TOKENS = 160


def test_streams_survive_scale_out_and_in(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, num_attention_heads=8, num_key_value_heads=4)
    llm = LLM(str(folder), device="cpu", dtype="float32", disable_log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    server = SubprocessServer(
        tmp_path / "data",
        ["--model", str(folder), "--liquid-gpu-range", "0", "1", "--liquid-total-num-shards", "2"],
        api_key=API_KEY,
    )
    server.start()
    try:
        client = server.client()
        name = client.models.list().data[0].id
        texts: dict[int, str] = {}
        started = threading.Barrier(len(PROMPTS) + 1)

        def stream(i: int) -> None:
            s = client.completions.create(
                model=name,
                prompt=PROMPTS[i],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            parts = []
            for n, chunk in enumerate(s):
                if n == 1:
                    started.wait(60)
                parts.append(chunk.choices[0].text if chunk.choices else "")
            texts[i] = "".join(parts)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        started.wait(60)  # every stream has tokens: the moves happen mid-generation
        with server.http() as http:
            out = http.post("/v1/admin/liquid", json={"liquid_type": "LIQUID_1_2"})
            assert out.status_code == 200, out.text
            assert out.json()["degree"] == 2 and out.json()["events"][0]["kv_bytes"] > 0
            back = http.post("/v1/admin/liquid", json={"target": 1})
            assert back.status_code == 200, back.text
        for t in threads:
            t.join(120)
        assert [texts[i] for i in range(len(PROMPTS))] == expected
        anon = httpx.post(f"{server.base_url}/v1/admin/liquid", json={"target": 2}, timeout=30)
        assert anon.status_code == 401
        log = server.log()  # the liquid fork's event blocks: shard 1 of 2 goes out to rank 1 and back
        assert "---------Start 0'th liquid: Scale out from rank0 to rank1---------" in log
        assert "Successfully send kv cache shards: [1] to rank: 1" in log
        assert "---------Start 1'th liquid: Scale in from rank1 to rank0---------" in log
        assert "Finished liquid for 1 times, output: Completed! Move shard: [1] from [1] to [0];" in log
    finally:
        server.kill()
