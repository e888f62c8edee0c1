"""The vLLM engine arguments that pagedrs does not implement, refused at start with what to use instead."""

from __future__ import annotations

import os
from typing import Any, Protocol

__all__ = ["LOAD_FORMATS", "check_compat", "names_a_gguf"]

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")


class EngineArgs(Protocol):
    """The fields of `arg_utils.EngineArgs` these checks read."""

    model: str | None
    tokenizer_mode: str
    revision: str | None
    tokenizer_revision: str | None
    max_seq_len: int | None
    max_model_len: int | None
    load_format: str
    gguf_file: str | None
    pipeline_parallel_size: int
    quantization: str | None
    rope_scaling: dict[str, Any] | None
    rope_theta: float | None


def check_compat(args: EngineArgs) -> None:
    """The vLLM arguments pagedrs does not implement fail here, saying what to use instead."""
    if args.tokenizer_mode not in ("auto", "slow"):
        raise ValueError(
            f"tokenizer_mode={args.tokenizer_mode!r} is not supported; use 'auto' (fast) or 'slow'"
        )
    if args.load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format={args.load_format!r} is not supported; one of {', '.join(LOAD_FORMATS)}"
        )
    if not isinstance(args.pipeline_parallel_size, int) or args.pipeline_parallel_size != 1:
        raise ValueError(
            f"pipeline_parallel_size={args.pipeline_parallel_size!r} is not supported (pipeline parallelism "
            "is not implemented); use tensor_parallel_size to spread a model over devices"
        )
    q = args.quantization
    if q is not None:
        from pagedrs.quantization.config import QUANTIZATION_METHODS

        if q not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization={q!r} is not supported; one of {', '.join(QUANTIZATION_METHODS)} "
                "(or None: the checkpoint's own quantization_config decides)"
            )
        if q == "q8_0" and (args.model is None or names_a_gguf(args)):
            raise ValueError(
                f"quantization='q8_0' quantizes a 16/32-bit checkpoint at load; model={args.model!r} is a "
                "GGUF file (None: the default model's), already quantized (leave quantization unset)"
            )
        if q == "gguf" and not names_a_gguf(args):
            raise ValueError(
                f"quantization='gguf' needs a GGUF model, got model={args.model!r}: a .gguf file, a "
                "folder holding one, gguf_file=, or a Hub name with the file's type (org/name:Q4_K_M)"
            )
    if (
        (args.revision or args.tokenizer_revision)
        and args.model is not None
        and (args.model.startswith((".", "/", "~")) or os.path.exists(os.path.expanduser(args.model)))
    ):
        raise ValueError(
            f"revision={args.revision!r} / tokenizer_revision={args.tokenizer_revision!r} apply to hub "
            f"model names; {args.model!r} is a local path (check out the revision you want there)"
        )
    if (
        args.max_seq_len is not None
        and args.max_model_len is not None
        and args.max_seq_len != args.max_model_len
    ):
        raise ValueError(
            f"max_seq_len={args.max_seq_len} and max_model_len={args.max_model_len} disagree; give one"
        )
    if args.rope_scaling is not None and not isinstance(args.rope_scaling, dict):
        raise ValueError(f"rope_scaling must be a dict, got {args.rope_scaling!r}")
    if args.rope_theta is not None and not (
        isinstance(args.rope_theta, (int, float)) and args.rope_theta > 0
    ):
        raise ValueError(f"rope_theta must be a number > 0, got {args.rope_theta!r}")


def names_a_gguf(args: EngineArgs) -> bool:
    """The model is a GGUF file: a path to one, a local folder with one, gguf_file=, or a Hub
    name whose ":QUANT" suffix picks one (as `vllm serve org/name:Q4_K_M`)."""
    from pagedrs.loader.hub import split_quant

    model = os.path.expanduser(str(args.model or ""))
    if args.gguf_file is not None or model.lower().endswith(".gguf"):
        return True
    if os.path.isdir(model):
        return any(name.lower().endswith(".gguf") for name in os.listdir(model))
    return not os.path.exists(model) and split_quant(model)[1] is not None
