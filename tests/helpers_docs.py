"""The documentation's Python snippets (README.md and docs/pages/), and a `pagedrs serve` to run the
server snippets against.

A ```python block runs as written (in order with the page's other blocks, in one namespace per page)
unless the nearest non-blank line before its fence is a marker:

- `<!-- test: server -->`: it talks to a server on http://127.0.0.1:8000 (the docs' command,
  `pagedrs serve --port 8000 --api-key secret`); the test starts one and points the snippet at it;
- `<!-- not-tested: REASON -->`: not run (a GPU, the Hub, a checkpoint this machine lacks, ...).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = DOCS / "pages"
DOCS_BASE_URL = "http://127.0.0.1:8000"
DOCS_API_KEY = "secret"

_FENCE = re.compile(r"^(\s*)```python\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(test|not-tested):\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    mode: str  # "run", "server" or "skip"
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{_shown(self.path)}:{self.line}"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(PAGES.rglob("*.md"))]


def _mode(marker_line: str | None, where: str) -> tuple[str, str]:
    m = _MARKER.match(marker_line or "")
    if m is None:
        return "run", ""
    kind, value = m.groups()
    if kind == "not-tested":
        if not value:
            raise ValueError(f"{where}: <!-- not-tested: ... --> needs a reason")
        return "skip", value
    if value != "server":
        raise ValueError(f"{where}: unknown marker <!-- test: {value} --> (known: server)")
    return "server", ""


def snippets(path: Path) -> list[Snippet]:
    """The ```python blocks of one Markdown file, with what each asks of the test."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent = m.group(1)
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{_shown(path)}:{start + 1}: unclosed ```python block")
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), None)
        where = f"{_shown(path)}:{start + 1}"
        mode, reason = _mode(before, where)
        found.append(Snippet(path, start + 1, "\n".join(body) + "\n", mode, reason))
        i += 1
    return found


def all_snippets() -> list[Snippet]:
    return [s for path in doc_files() for s in snippets(path)]


def point_at(code: str, base_url: str) -> str:
    """A server snippet aimed at the test's server instead of the docs' port 8000."""
    if DOCS_BASE_URL not in code:
        raise ValueError(f"a server snippet must use {DOCS_BASE_URL}")
    return code.replace(DOCS_BASE_URL, base_url)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DocsServer:
    """`pagedrs serve --api-key secret` on a free port, the default model with small limits."""

    def __init__(self, data_dir: Path) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = data_dir / "server.log"
        self.args = [
            sys.executable,
            "-m",
            "pagedrs.entrypoints.cli",
            "serve",
            "--port",
            str(self.port),
            "--api-key",
            DOCS_API_KEY,
            "--data-dir",
            str(data_dir),
            "--device",
            "cpu",
            "--max-model-len",
            "1024",
            "--num-kv-blocks",
            "256",
            "--max-num-seqs",
            "16",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300.0) -> DocsServer:
        with open(self.log_path, "ab") as log:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagedrs serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"pagedrs serve did not become healthy:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
