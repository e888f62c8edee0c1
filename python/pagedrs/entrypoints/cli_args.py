"""Command-line flags shared by ``pagedrs serve|generate|chat`` and the API server module."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, fields
from typing import Any

from pagedrs.engine.arg_utils import EngineArgs

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags: one per `EngineArgs` field with help, with the field's type and default."""
    EngineArgs.add_cli_args(parser)


RUNTIME_LORA_ENV = "PAGEDRS_ALLOW_RUNTIME_LORA_UPDATING"  # as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One --lora-modules entry: the adapter's served name, its PEFT folder, the base model it names
    as its parent in /v1/models (default: the served model name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON for --lora-modules: {exc}") from None
        if not isinstance(spec, dict) or not spec.get("name") or not spec.get("path"):
            raise argparse.ArgumentTypeError(f'--lora-modules JSON needs "name" and "path", got {text!r}')
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(f"--lora-modules JSON: unknown keys {unknown}")
        base = spec.get("base_model_name")
        return LoRAModulePath(str(spec["name"]), str(spec["path"]), str(base) if base else None)
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path or JSON, got {text!r}")
    return LoRAModulePath(name, path)


@dataclass(frozen=True)
class ServerArgs:
    """The serve flags (``pagedrs serve``) that are not engine settings, typed, with their defaults
    (the flags take theirs from here)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: $PAGEDRS_API_KEY (`resolve_server_args`)
    served_model_name: tuple[str, ...] = ()
    data_dir: str | None = None  # None: $XDG_DATA_HOME/pagedrs (`resolve_server_args`)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_batch_concurrency: int = 64
    shutdown_grace: float = 30.0
    max_engine_restarts: int = 3
    api_server_count: int = 1
    api_server_index: int = 0  # which of several API server processes this is (0 runs batch jobs)
    log_level: str = "info"
    access_log: bool = True
    model: str | None = None  # --model as given (SGLang's get_model_info reports it)
    tokenizer: str | None = None
    chat_template: str | None = None  # --chat-template: a file or the text (openai/chat/serving.py)
    tool_call_parser: str | None = None  # --tool-call-parser, --enable-auto-tool-choice,
    enable_auto_tool_choice: bool = False  # --reasoning-parser: see openai/chat/output.py
    reasoning_parser: str | None = None
    lora_modules: tuple[LoRAModulePath, ...] = ()  # --lora-modules
    allow_runtime_lora_updating: bool = False  # or $PAGEDRS_ALLOW_RUNTIME_LORA_UPDATING

    def __post_init__(self) -> None:
        names: Any = self.served_model_name
        object.__setattr__(self, "served_model_name", (names,) if isinstance(names, str) else tuple(names))
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))

    @property
    def runtime_lora_updating(self) -> bool:
        """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served."""
        env = os.environ.get(RUNTIME_LORA_ENV, "").strip().lower()
        return self.allow_runtime_lora_updating or env in ("1", "true", "yes")

    def error(self, enable_lora: bool) -> str | None:
        """What is wrong with this combination of flags (vLLM rejects the same ones), or None."""
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            return "--enable-auto-tool-choice requires --tool-call-parser to be set"
        if self.lora_modules and not enable_lora:
            return "--lora-modules requires --enable-lora"
        return None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        """The parsed flags' server part; flags the parser lacks or left None keep the defaults."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = getattr(ns, f.name, None)
            if value is not None:
                values[f.name] = value
        return cls(**values)


_SERVER = ServerArgs()  # the server flags' defaults


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server flags, one add_argument per flag, in the order --help shows them."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=_SERVER.host, help=f"address to bind (default {_SERVER.host})")
    g.add_argument("--port", type=int, default=_SERVER.port, help=f"port (default {_SERVER.port})")
    g.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes (default: $PAGEDRS_API_KEY if set)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) the API answers to (default: the model path)",
    )
    g.add_argument(
        "--data-dir",
        default=None,
        help="where files and batch jobs are kept (default: $XDG_DATA_HOME/pagedrs, "
        "else ~/.local/share/pagedrs)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=_SERVER.max_body_bytes,
        help="larger request bodies get 413 (default 64 MiB)",
    )
    g.add_argument(
        "--max-batch-concurrency",
        type=int,
        default=_SERVER.max_batch_concurrency,
        help="batch lines in flight at once",
    )
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=_SERVER.shutdown_grace,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    g.add_argument(
        "--log-stats-interval",
        type=float,
        default=EngineArgs.stats_log_interval,
        help="seconds between engine stats lines (0: off)",
    )
    g.add_argument(
        "--max-engine-restarts",
        type=int,
        default=_SERVER.max_engine_restarts,
        help="times the engine core process is restarted after it dies (then /health stays 503)",
    )
    g.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=_SERVER.api_server_count,
        help="API server processes sharing the port and the engine core(s) (default 1): HTTP, tokenization "
        "and streaming scale past one process's CPU; with -dp M each routes its requests over all M cores "
        "(not with --data-parallel-backend ray)",
    )
    g.add_argument("--log-level", default=_SERVER.log_level, choices=["debug", "info", "warning", "error"])
    g.add_argument(
        "--no-access-log", dest="access_log", action="store_false", help="no access log line per request"
    )
    _add_chat_args(g)


def _add_chat_args(g: argparse._ArgumentGroup) -> None:
    """The server flags of chat requests: template, tool calls, LoRA adapters by name, reasoning."""
    g.add_argument(
        "--chat-template",
        default=None,
        help="the chat template for chat requests: a Jinja file or the template text (as vLLM's flag; "
        "default: the tokenizer's own)",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json", "mistral", "pythonic", "llama4_pythonic"],
        help="the model's tool call format, read into tool_calls (as vLLM's flag)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='accepted as vLLM\'s flag (needs --tool-call-parser); tool_choice "auto" works without it',
    )
    g.add_argument(
        "--lora-modules",
        type=parse_lora_module,
        nargs="+",
        default=None,
        help='LoRA adapters served by name (needs --enable-lora): name=path, or JSON {"name": ..., '
        '"path": ..., "base_model_name": ...}, as vLLM\'s flag',
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=None,
        help=f"serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also ${RUNTIME_LORA_ENV}=1)",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["deepseek_r1", "qwen3"],
        help="split <think>...</think> into reasoning_content (as vLLM's flag)",
    )


# SGLang's launch_server flags -> the serve flags they mean here (SGLang's name: (ours, takes a value)).
SGLANG_FLAGS: dict[str, tuple[str, bool]] = {
    "--model-path": ("--model", True),
    "--tokenizer-path": ("--tokenizer", True),
    "--tp-size": ("--tensor-parallel-size", True),
    "--tp": ("--tensor-parallel-size", True),
    "--mem-fraction-static": ("--gpu-memory-utilization", True),
    "--context-length": ("--max-model-len", True),
    "--max-running-requests": ("--max-num-seqs", True),
    "--chunked-prefill-size": ("--max-num-batched-tokens", True),
    "--random-seed": ("--seed", True),
    "--disable-radix-cache": ("--no-enable-prefix-caching", False),
    "--disable-cuda-graph": ("--enforce-eager", False),
}
SGLANG_DEFAULT_PORT = 30000


def sglang_serve_argv(argv: list[str]) -> list[str]:
    """SGLang's ``launch_server`` command line as ``pagedrs serve`` flags: SGLang's names are renamed
    (``--flag value`` and ``--flag=value``), the others pass through; SGLang's default port 30000."""
    out: list[str] = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name in SGLANG_FLAGS:
            ours, takes_value = SGLANG_FLAGS[name]
            out.append(f"{ours}={value}" if eq and takes_value else ours)
        else:
            out.append(arg)
    if not any(a == "--port" or a.startswith("--port=") for a in out):
        out += ["--port", str(SGLANG_DEFAULT_PORT)]
    return out


def make_serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="pagedrs serve", description="OpenAI-compatible API server"
    )
    parser.add_argument(
        "model_tag", nargs="?", default=None, help="model path or Hub name, as `pagedrs serve org/name`"
    )
    add_server_args(parser)
    add_engine_args(parser)
    return parser


def serve_args_error(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of serve flags (vLLM rejects the same ones), or None."""
    return ServerArgs.from_namespace(args).error(enable_lora=bool(getattr(args, "enable_lora", False)))


def check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits as argparse does (usage, one error line, status 2) on a bad combination of serve flags,
    before any model is loaded."""
    error = serve_args_error(args)
    if error is not None:
        parser.error(error)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs / LLM keyword arguments from parsed flags: every engine flag's value, the model
    (``--model`` or the positional name) and the server's --log-stats-interval."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model not in (None, tag):
        raise SystemExit(f"the model is named twice: {tag!r} and --model {args.model!r}")
    kwargs = {name: getattr(args, name) for name in EngineArgs.cli_field_names() if hasattr(args, name)}
    kwargs["model"] = args.model or tag
    interval = getattr(args, "log_stats_interval", None)
    if interval is not None:
        if interval > 0:
            kwargs["stats_log_interval"] = interval
        else:
            kwargs["disable_log_stats"] = True
    return kwargs


def make_engine_args(args: argparse.Namespace) -> EngineArgs:
    """An ``EngineArgs`` from parsed flags."""
    return EngineArgs(**engine_kwargs(args))


def parse_serve_args(args: argparse.Namespace) -> tuple[EngineArgs, ServerArgs]:
    """The parsed serve flags as what they set: the engine's settings and the server's."""
    return make_engine_args(args), ServerArgs.from_namespace(args)
