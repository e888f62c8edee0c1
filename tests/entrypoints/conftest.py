"""Servers for the entrypoint tests: in-process (uvicorn in a thread) and subprocess
(`python -m pagedrs.entrypoints.openai.api_server`), both on 127.0.0.1 and a free port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

API_KEY = "test-key"
# The real default model, small limits so CPU tests stay fast.
SERVER_ENGINE_FLAGS = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--num-kv-blocks",
    "256",
    "--max-num-seqs",
    "32",
    "--log-stats-interval",
    "5",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThreadedServer:
    """An ASGI app served by uvicorn in a background thread (lifespan included)."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_config=None,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class SubprocessServer:
    """`python -m pagedrs.entrypoints.openai.api_server` (or another server `module`) with the given flags."""

    def __init__(
        self,
        data_dir: Path,
        extra: list[str] | None = None,
        *,
        port: int | None = None,
        api_key: str | None = API_KEY,
        log_path: Path | None = None,
        module: str = "pagedrs.entrypoints.openai.api_server",
    ) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self.api_key = api_key
        self.log_path = log_path or data_dir / f"server-{self.port}.log"
        self.args = [
            sys.executable,
            "-m",
            module,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(data_dir),
            *SERVER_ENGINE_FLAGS,
            *(["--api-key", api_key] if api_key else []),
            *(extra or []),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 240.0) -> SubprocessServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def terminate(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if hasattr(self, "_log"):
            self._log.close()

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            timeout=kwargs.pop("timeout", 120),
            **kwargs,
        )

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=120)


@pytest.fixture(scope="session")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    """One server with the default model for the end-to-end modules."""
    pytest.importorskip("pagedrs._core")
    server = SubprocessServer(
        tmp_path_factory.mktemp("server-data"),
        [
            "--served-model-name",
            "smollm2",
            "default",
            "--max-body-bytes",
            "1000000",
            "--max-batch-concurrency",
            "4",
        ],
    )
    server.start()
    yield server
    server.kill()


def wait_until(predicate: Any, timeout: float = 60.0, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def metric_value(text: str, name: str) -> float:
    """The first sample of a metric family in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            rest = line[len(name) :]
            if rest[:1] in ("{", " "):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def stream_texts(
    server: SubprocessServer, prompts: list[str], max_tokens: int, *, connection_each: bool = False
) -> list[str]:
    """Each prompt as a greedy streaming completion, all at once; the text each stream put together.
    `connection_each`: a fresh connection per request (spread over several API server processes)."""
    import asyncio
    import json

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        text = ""
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    keep = 0 if connection_each else len(prompts)
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=keep)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=300, limits=limits) as c:
        return list(await asyncio.gather(*(one(c, p) for p in prompts)))


def offline_greedy_texts(prompts: list[str], max_tokens: int) -> list[str]:
    """The same prompts through `LLM.generate` with the servers' engine flags (greedy)."""
    from pagedrs import LLM, SamplingParams

    flags = {
        k.lstrip("-").replace("-", "_"): v
        for k, v in zip(SERVER_ENGINE_FLAGS[::2], SERVER_ENGINE_FLAGS[1::2], strict=True)
    }
    llm = LLM(
        device="cpu",
        dtype="float32",
        max_model_len=int(flags["max_model_len"]),
        num_kv_blocks=int(flags["num_kv_blocks"]),
        max_num_seqs=int(flags["max_num_seqs"]),
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
