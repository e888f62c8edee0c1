"""MkDocs hook: the reference tables rendered from the code at build time, and the benchmark plots.

A page asks for a table with a marker line, replaced when the site is built:

- `<!-- generated: engine-args -->`: every `pagedrs.engine.arg_utils.EngineArgs` field (type, default,
  the `pagedrs serve` flag that sets it and its help text);
- `<!-- generated: server-flags -->`: the server group of `pagedrs serve` (the `ServerArgs` fields' flags);
- `<!-- generated: subcommands -->`: the `pagedrs` subcommands and their own flags;
- `<!-- generated: metrics -->`: every series the server's Prometheus registry exposes.

The PNG plots under bench/results/ are published as `img/bench/<name>.png`, so the benchmark page links
to the files the benchmarks wrote, not to copies.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
PLOTS = ROOT / "bench" / "results"
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)


def _cell(text: object) -> str:
    """Text for a table cell: pipes escaped, one line, `<...>` shown rather than read as HTML."""
    return str(text).replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def _code(text: object) -> str:
    """A code span for a table cell (a pipe inside a code span does not split the cell)."""
    return "`" + str(text).replace("\n", " ") + "`" if text not in ("", None) else ""


def _flags_by_dest(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    found: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            found.setdefault(action.dest, []).append(action)
    return found


def _subcommands() -> tuple[dict[str, argparse.ArgumentParser], dict[str, str]]:
    """The `pagedrs` console script's subcommand parsers and their one-line helps."""
    from pagedrs.entrypoints.cli import make_parser

    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices), {c.dest: c.help or "" for c in sub._choices_actions}


def _serve_parser() -> argparse.ArgumentParser:
    return _subcommands()[0]["serve"]


def _group(parser: argparse.ArgumentParser, title: str) -> list[argparse.Action]:
    """The actions of the parser's argument group `title` ("engine" or "server"); an error when it is
    gone, so a renamed group fails the strict build instead of leaving an empty table."""
    for group in parser._action_groups:
        if group.title == title:
            return [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS]
    raise ValueError(f"`pagedrs serve` has no {title!r} argument group")


def _field_comments(cls: type) -> dict[str, str]:
    """`name: type = default  # comment` lines of a dataclass's source: the comment by field name."""
    comments: dict[str, str] = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): .*?#\s*(.+)$", line)
        if m:
            comments[m.group(1)] = m.group(2).strip()
    return comments


def _type_name(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return text.replace("typing.", "")


def engine_args_table() -> str:
    from pagedrs import EngineArgs

    flags = _flags_by_dest(_serve_parser())
    comments = _field_comments(EngineArgs)
    rows = [
        "| `EngineArgs` / `LLM(...)` keyword | type | default | `pagedrs serve` flag | what it sets |",
        "|---|---|---|---|---|",
    ]
    for f in dataclasses.fields(EngineArgs):
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        actions = flags.get(f.name, [])
        if f.name == "model":
            flag = "positional `MODEL`, `--model`"
        elif actions:
            flag = _code(", ".join(s for a in actions for s in a.option_strings))
        else:
            flag = "(Python only)"
        helps = [a.help for a in actions if a.help and a.help != argparse.SUPPRESS]
        text = helps[0] if helps else (f.metadata.get("help") or comments.get(f.name, ""))
        type_name = _type_name(f.type)  # a string: the module uses PEP 563 annotations
        rows.append(
            f"| `{f.name}` | {_code(type_name)} | {_code(repr(default))} | {_cell(flag)} | {_cell(text)} |"
        )
    return "\n".join(rows)


def server_flags_table() -> str:
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for a in _group(_serve_parser(), "server"):
        default = "" if a.default in (None, argparse.SUPPRESS) else repr(a.default)
        flags = ", ".join(a.option_strings)
        rows.append(f"| `{_cell(flags)}` | {_code(default)} | {_cell(a.help or '')} |")
    return "\n".join(rows)


def subcommands_table() -> str:
    parsers, helps = _subcommands()
    shared = {a.dest for a in _group(parsers["serve"], "engine") + _group(parsers["serve"], "server")}
    out = []
    for name, p in parsers.items():
        own = [a for a in p._actions if a.dest != "help" and (a.dest not in shared or not a.option_strings)]
        if name == "serve":
            own = [a for a in own if not a.option_strings]
        args = ", ".join(
            f"`{'/'.join(a.option_strings) or a.dest}`" + (f" ({_cell(a.help)})" if a.help else "")
            for a in own
        )
        out.append(f"| `pagedrs {name}` | {_cell(helps.get(name, ''))} | {args} |")
    return "\n".join(["| command | what it does | its own arguments |", "|---|---|---|", *out])


def metrics_table() -> str:
    """Every metric family of a fresh server registry, with the series names Prometheus scrapes and,
    where the server also serves a family under vLLM's names, those names (or why there are none)."""
    from pagedrs.entrypoints.openai.server import metrics as server_metrics

    metrics = server_metrics.ServerMetrics("MODEL", lambda: None)
    vllm_names: dict[str, tuple[str, ...]] = getattr(server_metrics, "VLLM_NAMES", {})
    no_vllm_name: dict[str, str] = getattr(server_metrics, "NO_VLLM_NAME", {})
    labels_of: dict[str, tuple[str, ...]] = {}
    for collector in list(metrics.registry._collector_to_names):
        names = getattr(collector, "_labelnames", None)
        if names is not None:
            labels_of[collector._name] = tuple(names)
    head = "| series | type | labels | meaning |" + (" also served as (vLLM) |" if vllm_names else "")
    rows = [head, "|---|---|---|---|" + ("---|" if vllm_names else "")]
    suffix = {"counter": "_total", "histogram": "_bucket / _sum / _count"}
    for family in sorted(metrics.registry.collect(), key=lambda fam: fam.name):
        labels = labels_of.get(family.name) or tuple(
            sorted({k for s in family.samples for k in s.labels if k != "le"})
        )
        label_text = ", ".join(f"`{label}`" for label in labels)
        row = (
            f"| `{family.name}{suffix.get(family.type, '')}` | {family.type} | {label_text} | "
            f"{_cell(family.documentation)} |"
        )
        if vllm_names:
            twins = vllm_names.get(family.name, ())
            row += (
                " " + ", ".join(f"`{name}`" for name in twins) + " |"
                if twins
                else f" none: {_cell(no_vllm_name.get(family.name, ''))} |"
            )
        rows.append(row)
    intro = (
        "The families of the last column are served again under vLLM V1's names (with the same suffixes),"
        " with the same values and labels plus vLLM's `engine` label, so dashboards, autoscalers and"
        " routers written for vLLM read them unchanged.\n\n"
        if vllm_names
        else ""
    )
    return intro + "\n".join(rows)


GENERATORS = {
    "engine-args": engine_args_table,
    "server-flags": server_flags_table,
    "subcommands": subcommands_table,
    "metrics": metrics_table,
}


def render_markers(markdown: str) -> str:
    def replace(m: re.Match[str]) -> str:
        if m.group(1) not in GENERATORS:
            raise ValueError(f"unknown generated table {m.group(1)!r}; known: {sorted(GENERATORS)}")
        return GENERATORS[m.group(1)]()

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return render_markers(markdown)


def on_files(files: Files, config: Any) -> Files:
    for png in sorted(PLOTS.glob("*.png")):
        files.append(File.generated(config, f"img/bench/{png.name}", abs_src_path=str(png)))
    return files
