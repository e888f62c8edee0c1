"""The continuous-batching notebook's server cell with `vllm` -> `pagedrs`: its exact command line (the default model instead of
Phi-3, which is not on this machine) and its AsyncOpenAI client sending three chat messages at once."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import openai
from conftest import SubprocessServer, free_port

from tests.helpers import SEED_003_SERVER_FLAGS
from tests.helpers_vllm_logs import notebook_batches


def test_seed_003_server_and_async_client(tmp_path: Path) -> None:
    port = free_port()
    server = SubprocessServer(tmp_path, [], port=port, api_key=None)
    server.args = [
        sys.executable,
        "-m",
        "pagedrs.entrypoints.openai.api_server",
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path / "data"),
        *SEED_003_SERVER_FLAGS,
    ]
    server.start()
    try:
        client = openai.AsyncOpenAI(api_key="EMPTY", base_url=f"{server.base_url}/v1")

        async def process_message(message: str) -> str | None:
            model = (await client.models.list()).data[0].id
            response = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": message}], max_tokens=24, temperature=0.7
            )
            assert response.usage is not None and 0 < response.usage.completion_tokens <= 24
            return response.choices[0].message.content

        messages = [
            "Tell me a joke about programming.",
            "Explain quantum computing in simple terms.",
            "What are the main features of Python?",
        ]

        async def main() -> list[str | None]:
            return await asyncio.wait_for(asyncio.gather(*[process_message(m) for m in messages]), 300)

        responses = asyncio.run(main())
        assert all(isinstance(r, str) and r.strip() for r in responses), responses
        log = server.log_path.read_text(errors="replace")
        assert "disable_sliding_window=True" in log and "max_num_batched_tokens=12" in log
        # --enable-log-batch-visualization: the notebook's `print_batches` finds a picture per step in the
        # server log, each headed by the 12 batch slots (--max-num-seqs=12), the 3 requests side by side.
        batches = notebook_batches(server.log_path)
        assert len(batches) >= 24, len(batches)  # at least one step per token of a 24-token answer
        header = " ".join(f"Batch {i}" for i in range(1, 13))
        assert all(" ".join(b.split("\n")[0].split()) == header for b in batches), batches[0]
        assert max(line.count("┌") for b in batches for line in b.split("\n")) == 3
    finally:
        server.kill()
