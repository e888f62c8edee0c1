"""Command-line flags shared by ``pagedrs serve|generate|chat`` and the API server module."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, fields
from typing import Any

from pagedrs.config import ObservabilityConfig
from pagedrs.engine.arg_fields import add_field_flags, config_default, flag_field
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
    """The serve flags (``pagedrs serve``) that are not engine settings, typed, with their defaults. A field
    with help is also a flag (`add_server_args`), declared once as `EngineArgs`' are (`flag_field`)."""

    host: str = flag_field("127.0.0.1", "address to bind (default 127.0.0.1)")
    port: int = flag_field(8000, "port (default 8000)")
    api_key: str | None = flag_field(  # None: $PAGEDRS_API_KEY (`resolve_server_args`)
        None, "require `Authorization: Bearer KEY` on /v1 routes (default: $PAGEDRS_API_KEY if set)"
    )
    served_model_name: tuple[str, ...] = flag_field(  # None (none given) becomes ()
        None, "model name(s) the API answers to (default: the model path)"
    )
    data_dir: str | None = flag_field(  # None: $XDG_DATA_HOME/pagedrs (`resolve_server_args`)
        None,
        "where files and batch jobs are kept (default: $XDG_DATA_HOME/pagedrs, else ~/.local/share/pagedrs)",
    )
    max_body_bytes: int = flag_field(DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413 (default 64 MiB)")
    max_batch_concurrency: int = flag_field(64, "batch lines in flight at once")
    shutdown_grace: float = flag_field(30.0, "seconds in-flight requests get to finish after SIGTERM")
    # The engine's stats_log_interval under the server's name (`engine_kwargs`; 0: disable_log_stats).
    log_stats_interval: float = flag_field(
        config_default(ObservabilityConfig, "stats_log_interval"),
        "seconds between engine stats lines (0: off)",
    )
    engine_stall_timeout: float = flag_field(
        20.0,
        "seconds an engine core with requests in flight may go without finishing a step before /health "
        "answers 503 and the log names it (0: never)",
    )
    engine_stall_restart_timeout: float = flag_field(
        120.0,
        "seconds an engine core process with requests in flight may go without finishing a step before "
        "it is killed and restarted as a dead one (its requests fail with a clear error; 0: never)",
    )
    max_engine_restarts: int = flag_field(
        3, "times the engine core process is restarted after it dies (then /health stays 503)"
    )
    api_server_count: int = flag_field(
        1,
        "API server processes sharing the port and the engine core(s) (default 1): HTTP, tokenization "
        "and streaming scale past one process's CPU; with -dp M each routes its requests over all M cores "
        "(not with --data-parallel-backend ray)",
        aliases=("-asc",),
    )
    log_level: str = flag_field(
        "info", "the server's log level", choices=("debug", "info", "warning", "error")
    )
    access_log: bool = flag_field(True, "no access log line per request", negative_only=True)
    # The flags of chat requests: template, tool calls, LoRA adapters by name, reasoning.
    chat_template: str | None = flag_field(  # a file or the text (openai/chat/serving.py)
        None,
        "the chat template for chat requests: a Jinja file or the template text (as vLLM's flag; "
        "default: the tokenizer's own)",
    )
    tool_call_parser: str | None = flag_field(  # see openai/chat/output.py
        None,
        "the model's tool call format, read into tool_calls (as vLLM's flag)",
        choices=("hermes", "llama3_json", "mistral", "pythonic", "llama4_pythonic"),
    )
    enable_auto_tool_choice: bool = flag_field(
        False, 'accepted as vLLM\'s flag (needs --tool-call-parser); tool_choice "auto" works without it'
    )
    lora_modules: tuple[LoRAModulePath, ...] = flag_field(  # None (none given) becomes ()
        None,
        'LoRA adapters served by name (needs --enable-lora): name=path, or JSON {"name": ..., '
        '"path": ..., "base_model_name": ...}, as vLLM\'s flag',
        parse=parse_lora_module,
    )
    allow_runtime_lora_updating: bool = flag_field(  # or $PAGEDRS_ALLOW_RUNTIME_LORA_UPDATING
        False,
        f"serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also ${RUNTIME_LORA_ENV}=1)",
    )
    reasoning_parser: str | None = flag_field(
        None,
        "split <think>...</think> into reasoning_content (as vLLM's flag)",
        choices=("deepseek_r1", "qwen3"),
    )
    api_server_index: int = 0  # which of several API server processes this is (0 runs batch jobs)
    model: str | None = None  # --model as given (SGLang's get_model_info reports it)
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        names: Any = self.served_model_name or ()
        object.__setattr__(self, "served_model_name", (names,) if isinstance(names, str) else tuple(names))
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))

    @property
    def runtime_lora_updating(self) -> bool:
        """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served."""
        env = os.environ.get(RUNTIME_LORA_ENV, "").strip().lower()
        return self.allow_runtime_lora_updating or env in ("1", "true", "yes")

    def error(self, enable_lora: bool) -> str | None:
        """What is wrong with this combination of flags (vLLM rejects the same ones), or None."""
        if not self.engine_stall_timeout >= 0:
            return f"--engine-stall-timeout must be >= 0, got {self.engine_stall_timeout}"
        if not self.engine_stall_restart_timeout >= 0:
            return f"--engine-stall-restart-timeout must be >= 0, got {self.engine_stall_restart_timeout}"
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


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server flags, one per `ServerArgs` field with help, in the fields' order (as --help shows them)."""
    add_field_flags(parser.add_argument_group("server"), ServerArgs)


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
