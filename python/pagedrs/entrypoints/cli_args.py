"""Command-line flags shared by ``pagedrs serve|generate|chat`` and the API server module."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024

# (flag, EngineArgs field, type, default, help). Defaults of None leave the engine's own default.
_ENGINE_FLAGS: list[tuple[str, str, Any, Any, str]] = [
    ("--tokenizer", "tokenizer", str, None, "tokenizer path (default: the model's)"),
    ("--dtype", "dtype", str, "auto", "auto, float32, float16 or bfloat16"),
    ("--device", "device", str, "auto", "auto, cpu, cuda or cuda:N"),
    ("--block-size", "block_size", int, 16, "KV-cache block size in tokens"),
    ("--num-kv-blocks", "num_kv_blocks", int, None, "KV-cache blocks (overrides memory sizing)"),
    (
        "--gpu-memory-utilization",
        "gpu_memory_utilization",
        float,
        0.9,
        "fraction of GPU memory for weights + KV cache",
    ),
    ("--cpu-kv-cache-gb", "cpu_kv_cache_gb", float, None, "KV-cache size on CPU in GiB"),
    (
        "--swap-space",
        "swap_space",
        float,
        None,
        "CPU swap space for preempted requests in GiB per rank (default: 4 on CUDA, 0 on CPU)",
    ),
    ("--max-model-len", "max_model_len", int, None, "context length (default: the model's)"),
    ("--max-num-seqs", "max_num_seqs", int, 256, "most requests in a batch"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, None, "token budget of a step"),
    ("--attention-backend", "attention_backend", str, "auto", "auto, torch or cupy"),
    ("--seed", "seed", int, 0, "random seed"),
    ("--tokenizer-mode", "tokenizer_mode", str, None, "auto (fast tokenizer) or slow"),
    ("--revision", "revision", str, None, "Hub revision of the model: branch, tag or commit"),
    ("--tokenizer-revision", "tokenizer_revision", str, None, "Hub revision of the tokenizer"),
    ("--download-dir", "download_dir", str, None, "HF cache folder to download Hub models into"),
    ("--gguf-file", "gguf_file", str, None, "the .gguf file of a Hub GGUF repo (or name it org/name:QUANT)"),
    ("--hf-token", "hf_token", str, None, "Hub token (default: HF_TOKEN or the saved login)"),
    ("--load-format", "load_format", str, None, "auto, safetensors, pt, gguf or dummy (random weights)"),
    ("--pipeline-parallel-size", "pipeline_parallel_size", int, None, "only 1 (use -tp)"),
    (
        "--quantization",
        "quantization",
        str,
        None,
        "the checkpoint's format (gptq, awq, fp8, compressed-tensors, gguf; default: what config.json says), "
        "or q8_0: a 16/32-bit checkpoint quantized at load to Q8_0 for the CPU kernels",
    ),
    (
        "--kv-cache-dtype",
        "kv_cache_dtype",
        str,
        None,
        "auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2",
    ),
    ("--rope-scaling", "rope_scaling", json.loads, None, "JSON dict overriding the config's rope scaling"),
    ("--rope-theta", "rope_theta", float, None, "override the config's rope theta"),
    ("--max-loras", "max_loras", int, None, "LoRA adapters resident at once, mixed in a batch (default 1)"),
    ("--max-lora-rank", "max_lora_rank", int, None, "largest LoRA rank an adapter may have (default 16)"),
    ("--max-cpu-loras", "max_cpu_loras", int, None, "LoRA adapters kept on the host (default: --max-loras)"),
    (
        "--speculative-config",
        "speculative_config",
        json.loads,
        None,
        'speculative decoding as JSON: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} '
        'or {"method": "self_draft", "num_speculative_tokens": 3, "draft_layers": 8} '
        'or {"model": "path/to/small-draft", "num_speculative_tokens": 4}',
    ),
    ("--task", "task", str, None, "auto (generation and embeddings), generate or embed"),
    ("--pooling-type", "pooling_type", str, None, "default embedding pooling: last, mean, cls or first"),
    (
        "--batch-visualization-style",
        "batch_visualization_style",
        str,
        None,
        "boxes (token boxes, the default) or bar (a line a step)",
    ),
]

# vLLM's boolean switches: (flag, EngineArgs field, help)
_ENGINE_SWITCHES: list[tuple[str, str, str]] = [
    (
        "--skip-tokenizer-init",
        "skip_tokenizer_init",
        "no tokenizer: prompts are token ids, outputs have no text",
    ),
    (
        "--trust-remote-code",
        "trust_remote_code",
        "passed to transformers (pagedrs runs only its own model code)",
    ),
    (
        "--disable-custom-all-reduce",
        "disable_custom_all_reduce",
        "accepted (all-reduces are torch.distributed)",
    ),
    ("--disable-sliding-window", "disable_sliding_window", "no sliding window: the context is capped at it"),
    ("--enable-log-batch-visualization", "enable_log_batch_visualization", "log a picture of every step"),
    ("--disable-log-stats", "disable_log_stats", "no periodic stats line"),
    ("--enable-lora", "enable_lora", "serve LoRA adapters (--lora-modules; the adapter name as `model`)"),
    (
        "--batch-invariant",
        "batch_invariant",
        "CPU: each token's arithmetic independent of its step (greedy outputs the same whatever the "
        "batching, chunking, prefix hits or preemption)",
    ),
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags. Long on purpose: one add_argument per flag that is not a plain table entry
    (switch pairs, lists, choices), in the order --help shows them."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model", default=None, help="model path or name (default: the embedded SmolLM2-135M-Instruct GGUF)"
    )
    for flag, dest, typ, default, help_text in _ENGINE_FLAGS:
        g.add_argument(flag, dest=dest, type=typ, default=default, help=help_text)
    g.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached prefixes",
    )
    g.add_argument(
        "--disable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="same as --no-enable-prefix-caching",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        dest="enable_chunked_prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts",
    )
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument(
        "--normalize",
        dest="normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalize embeddings by default (--no-normalize: raw pooled states)",
    )
    for flag, dest, help_text in _ENGINE_SWITCHES:
        g.add_argument(flag, dest=dest, action="store_true", default=None, help=help_text)
    g.add_argument(
        "-tp",
        "--tensor-parallel-size",
        dest="tensor_parallel_size",
        type=int,
        default=1,
        help="ranks (devices; worker processes on CPU) the model is split over",
    )
    g.add_argument(
        "--liquid-gpu-range",
        dest="liquid_gpu_range",
        type=int,
        nargs="+",
        default=None,
        help="liquid scaling: the devices (worker ranks on CPU) the model may spread over, e.g. 0 1 2 3",
    )
    g.add_argument(
        "--liquid-total-num-shards",
        dest="liquid_total_num_shards",
        type=int,
        default=None,
        help="liquid scaling: shards the model is cut into (default: the range's length)",
    )
    g.add_argument(
        "--liquid-auto",
        dest="liquid_auto",
        action="store_true",
        help="liquid scaling by the concurrent cache usage (out above 0.9, in under 0.7, over 16 samples)",
    )
    g.add_argument(
        "--distributed-executor-backend",
        dest="distributed_executor_backend",
        choices=["mp", "ray"],
        default=None,
        help="who starts the tensor-parallel workers: mp (local processes, default) or ray",
    )


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


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server flags. Long on purpose: one add_argument per flag, in the order --help shows them."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
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
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 (default 64 MiB)",
    )
    g.add_argument("--max-batch-concurrency", type=int, default=64, help="batch lines in flight at once")
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    g.add_argument(
        "--log-stats-interval", type=float, default=5.0, help="seconds between engine stats lines (0: off)"
    )
    g.add_argument(
        "--max-engine-restarts",
        type=int,
        default=3,
        help="times the engine core process is restarted after it dies (then /health stays 503)",
    )
    g.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        help="API server processes sharing the port and one engine core (default 1): HTTP, tokenization "
        "and streaming scale past one process's CPU",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument(
        "--no-access-log", dest="access_log", action="store_false", help="no access log line per request"
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
        help='allow tool_choice "auto" (needs --tool-call-parser)',
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


@dataclass(frozen=True)
class ServerArgs:
    """What the API app reads from the serve flags (``pagedrs serve``), once, with their defaults."""

    served_model_name: tuple[str, ...] = ()
    api_key: str | None = None
    data_dir: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_batch_concurrency: int = 64
    shutdown_grace: float = 30.0
    api_server_count: int = 1
    api_server_index: int = 0  # which of several API server processes this is (0 runs batch jobs)
    model: str | None = None  # as given on the command line (SGLang's get_model_info reports it)
    tokenizer: str | None = None
    tool_call_parser: str | None = None  # --tool-call-parser, --enable-auto-tool-choice,
    enable_auto_tool_choice: bool = False  # --reasoning-parser: see openai/chat_output.py
    reasoning_parser: str | None = None
    lora_modules: tuple[LoRAModulePath, ...] = ()  # --lora-modules
    allow_runtime_lora_updating: bool = False  # or $PAGEDRS_ALLOW_RUNTIME_LORA_UPDATING

    @property
    def runtime_lora_updating(self) -> bool:
        """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served."""
        env = os.environ.get(RUNTIME_LORA_ENV, "").strip().lower()
        return self.allow_runtime_lora_updating or env in ("1", "true", "yes")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace | SimpleNamespace | None) -> ServerArgs:
        """Parsed flags (or any namespace holding some of them); missing or None values keep the defaults."""
        if ns is None:
            return cls()
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = getattr(ns, f.name, None)
            if value is not None:
                values[f.name] = value
        names = values.get("served_model_name")
        if names is not None:
            values["served_model_name"] = (names,) if isinstance(names, str) else tuple(names)
        if "lora_modules" in values:
            values["lora_modules"] = tuple(values["lora_modules"])
        return cls(**values)


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
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        return "--enable-auto-tool-choice requires --tool-call-parser to be set"
    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", None):
        return "--lora-modules requires --enable-lora"
    return None


def check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits as argparse does (usage, one error line, status 2) on a bad combination of serve flags,
    before any model is loaded."""
    error = serve_args_error(args)
    if error is not None:
        parser.error(error)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs / LLM keyword arguments from parsed flags (None values left out)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model not in (None, tag):
        raise SystemExit(f"the model is named twice: {tag!r} and --model {args.model!r}")
    kwargs: dict[str, Any] = {"model": args.model or tag}
    for _, dest, _, _, _ in _ENGINE_FLAGS:
        value = getattr(args, dest, None)
        if value is not None:
            kwargs[dest] = value
    kwargs["enable_prefix_caching"] = args.enable_prefix_caching
    kwargs["enable_chunked_prefill"] = args.enable_chunked_prefill
    kwargs["enforce_eager"] = args.enforce_eager
    if getattr(args, "normalize", None) is not None:
        kwargs["normalize"] = args.normalize
    for _, dest, _ in _ENGINE_SWITCHES:
        if getattr(args, dest, None):
            kwargs[dest] = True
    kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if getattr(args, "liquid_auto", False):
        kwargs["liquid_auto"] = True
    for name in ("liquid_gpu_range", "liquid_total_num_shards"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if args.distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = args.distributed_executor_backend
    interval = getattr(args, "log_stats_interval", None)
    if interval is not None:
        if interval > 0:
            kwargs["stats_log_interval"] = interval
        else:
            kwargs["disable_log_stats"] = True
    return kwargs


def make_engine_args(args: argparse.Namespace) -> Any:
    """An ``EngineArgs`` from parsed flags; fields the engine does not know are dropped."""
    import dataclasses

    from pagedrs import EngineArgs

    kwargs = engine_kwargs(args)
    if dataclasses.is_dataclass(EngineArgs):
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise SystemExit(f"this engine does not take: {', '.join(unknown)}")
    return EngineArgs(**kwargs)
