"""Helpers of the data-parallel server tests: a tiny model served with `-dp 2` (1 thread per replica),
the per-replica routing counters from /metrics, the server's process tree, and a keep-alive connection
to a chosen one of several API server processes."""

from __future__ import annotations

import http.client
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import child_pids

DP_FLAGS = [
    "--data-parallel-size",
    "2",
    "--block-size",
    "4",
    "--max-num-batched-tokens",
    "16",
    "--max-model-len",
    "256",
    "--num-kv-blocks",
    "64",
    "--max-engine-restarts",
    "2",
    "--disable-log-stats",
]
SHARED = "The tenant's long system prompt, shared by every request it sends. "


def dp_flags(model: Path, *extra: str) -> list[str]:
    return ["--model", str(model), *DP_FLAGS, *extra]


def start_dp_server(server: Any) -> Any:
    """Starts a `SubprocessServer` with a 2-thread budget: each of the 2 replicas gets 1 thread."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "2")
        return server.start()


def routed(metrics_text: str) -> dict[str, float]:
    """`pagedrs:dp_routed_requests` per engine label."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = re.match(r'pagedrs:dp_routed_requests_total\{.*engine="(\d+)".*\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def per_engine(metrics_text: str) -> dict[str, dict[str, float]]:
    """sample name -> engine label -> value (summed over the other labels); a sample without the engine
    label is counted under "-"."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            by_engine = out.setdefault(s.name, {})
            key = s.labels.get("engine", "-")
            by_engine[key] = by_engine.get(key, 0.0) + s.value
    return out


def tree(pid: int) -> list[int]:
    """Every descendant of `pid`."""
    out: list[int] = []
    todo = [pid]
    while todo:
        try:
            kids = child_pids(todo.pop())
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def api_server_of(log_path: Path, port: int, timeout: float = 10.0) -> int:
    """Which API server process answered the connection from local `port` (its access log line)."""
    pattern = re.compile(rf"\[api-server (\d+)\] .*127\.0\.0\.1:{port} \"")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pattern.findall(log_path.read_text(errors="replace"))
        if found:
            return int(found[-1])  # the latest: a port may have served an earlier connection
        time.sleep(0.05)
    raise AssertionError(f"no access log line for local port {port}")


class ApiConnection:
    """A keep-alive HTTP connection, so every request on it reaches one API server process (`index`)."""

    def __init__(self, port: int, api_key: str, log_path: Path) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.conn.connect()
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        assert self.get("/health")[0] == 200
        self.index = api_server_of(log_path, self.conn.sock.getsockname()[1])

    def get(self, path: str) -> tuple[int, bytes]:
        self.conn.request("GET", path, headers=self.headers)
        r = self.conn.getresponse()
        return r.status, r.read()

    def complete(self, prompt: str, max_tokens: int) -> tuple[int, dict[str, Any]]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        self.conn.request("POST", "/v1/completions", json.dumps(body), self.headers)
        r = self.conn.getresponse()
        return r.status, json.loads(r.read())

    def close(self) -> None:
        self.conn.close()


def connect_to(server: Any, index: int, tries: int = 64) -> ApiConnection:
    """A connection that API server `index` accepted (the kernel spreads new connections over them)."""
    for _ in range(tries):
        c = ApiConnection(server.port, server.api_key, server.log_path)
        if c.index == index:
            return c
        c.close()
    raise AssertionError(f"API server {index} accepted none of {tries} connections")
