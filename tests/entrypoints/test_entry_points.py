"""Every command line users type to start pagedrs runs: vLLM's `python -m
pagedrs.entrypoints.openai.api_server`, `pagedrs serve` (the console script), `python -m
pagedrs.entrypoints.cli`, SGLang's `python -m pagedrs.launch_server`, and every `python -m pagedrs...`
module the docs name. Moving code never moves these; a move that does fails here."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import SubprocessServer

from tests.helpers_docs import ROOT, doc_files

# (command after `python`, the prog its usage line names). `pagedrs serve` is the console script,
# run below through the function pyproject.toml names for it.
HELP_COMMANDS = [
    (["-m", "pagedrs.entrypoints.openai.api_server"], "python -m pagedrs.entrypoints.openai.api_server"),
    (
        ["-m", "pagedrs.entrypoints.openai.server.api_server"],
        "python -m pagedrs.entrypoints.openai.server.api_server",
    ),
    (["-m", "pagedrs.entrypoints.cli", "serve"], "pagedrs serve"),
    (["-m", "pagedrs.launch_server"], "python -m pagedrs.launch_server"),
]
# What vLLM's and SGLang's docs have users type, which the docs here must keep naming.
VLLM_MODULES = {"pagedrs.entrypoints.openai.api_server", "pagedrs.launch_server"}
_DOCUMENTED = re.compile(r"python3?\s+-m\s+(pagedrs(?:\.\w+)*)")


def _console_script(name: str) -> str:
    """`module:function` of a [project.scripts] entry (read as text: tomllib is not in Python 3.10)."""
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    found = re.search(rf'^{name} = "([\w.]+:\w+)"$', scripts, re.M)
    assert found is not None, scripts
    return found.group(1)


def _help(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, timeout=300)


def _assert_serve_help(r: subprocess.CompletedProcess[str], prog: str) -> None:
    assert r.returncode == 0, r.stderr
    assert " ".join(r.stdout.split()).startswith(f"usage: {prog} [-h]"), r.stdout[:300]
    for flag in ("--model", "--port", "--api-key", "--max-model-len"):
        assert flag in r.stdout, flag


@pytest.mark.parametrize(
    ("argv", "prog"), HELP_COMMANDS, ids=lambda x: " ".join(x) if isinstance(x, list) else ""
)
def test_entry_point_help(argv: list[str], prog: str) -> None:
    _assert_serve_help(_help(argv), prog)


def test_pagedrs_serve_console_script_help() -> None:
    """`pagedrs serve --help` as the installed console script runs it: the [project.scripts] function with
    argv[0] `pagedrs`."""
    module, func = _console_script("pagedrs").split(":")
    code = f"import sys; sys.argv[0] = 'pagedrs'; from {module} import {func}; sys.exit({func}())"
    _assert_serve_help(_help(["-c", code, "serve"]), "pagedrs serve")


def test_cli_help_lists_the_subcommands() -> None:
    r = _help(["-m", "pagedrs.entrypoints.cli"])
    assert r.returncode == 0, r.stderr
    for command in ("serve", "generate", "chat", "bench"):
        assert command in r.stdout, command


def documented_modules() -> dict[str, list[str]]:
    """Every `python -m pagedrs...` module the README and the docs pages name -> the pages naming it."""
    found: dict[str, list[str]] = {}
    for path in doc_files():
        for name in _DOCUMENTED.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def _runs_as_main(name: str) -> bool:
    """`python -m name` runs something: a module with a `__main__` block, or a package with __main__.py."""
    spec = importlib.util.find_spec(name)
    assert spec is not None, name
    if spec.submodule_search_locations is not None:
        return importlib.util.find_spec(f"{name}.__main__") is not None
    assert spec.origin is not None
    return re.search(r"^if __name__ == ['\"]__main__['\"]:", Path(spec.origin).read_text(), re.M) is not None


def test_documented_modules_import_and_run_as_main() -> None:
    documented = documented_modules()
    assert VLLM_MODULES <= set(documented), sorted(documented)
    for name, pages in sorted(documented.items()):
        importlib.import_module(name)  # ImportError names the module; `pages` says where it is documented
        assert _runs_as_main(name), f"`python -m {name}` ({', '.join(pages)}) has no __main__ block"


def test_the_docs_scan_sees_a_moved_module(tmp_path: Path) -> None:
    """The scan reads `python -m` and `python3 -m`, also across a line break; a module that no longer
    exists is reported."""
    page = (
        "run `python3 -m pagedrs.entrypoints.openai.api_server --port 1`, or python -m\npagedrs.no_such_mod"
    )
    assert _DOCUMENTED.findall(page) == ["pagedrs.entrypoints.openai.api_server", "pagedrs.no_such_mod"]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pagedrs.no_such_mod")
    assert not _runs_as_main("pagedrs.entrypoints.openai.protocol")


def test_vllm_api_server_module_serves_the_default_model(tmp_path: Path) -> None:
    """`python -m pagedrs.entrypoints.openai.api_server` with no model: the default model, /v1/models lists
    it."""
    pytest.importorskip("pagedrs._core")
    server = SubprocessServer(tmp_path, [], api_key=None, module="pagedrs.entrypoints.openai.api_server")
    server.start()
    try:
        r = httpx.get(f"{server.base_url}/v1/models", timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and len(body["data"]) == 1
        assert body["data"][0]["object"] == "model" and body["data"][0]["id"]
        assert body["data"][0]["max_model_len"] == 512  # the flags reached the engine
    finally:
        assert server.terminate() == 0, server.log()
