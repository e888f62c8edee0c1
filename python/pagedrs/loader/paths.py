"""Where a model is: a local HF folder or GGUF file, a Hugging Face Hub name (fetched into the HF cache by
`hub.py`, only the files loading reads), or None for the default model; and the HF-style folder it is
read from (a GGUF file's cache folder)."""

from __future__ import annotations

import os
from pathlib import Path

from pagedrs.loader.default_model import default_model_path
from pagedrs.loader.gguf import convert_gguf
from pagedrs.loader.options import LoadOptions

__all__ = ["gguf_file", "model_folder", "resolve_model_path", "resolve_paths"]


def resolve_model_path(
    model: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
    *,
    opts: LoadOptions | None = None,
    weights: bool = True,
) -> str:
    """Absolute path of a local model folder or GGUF file; None -> the default model's GGUF file.

    A name like "org/model" (or "gpt2", or "org/model:Q4_K_M" for one GGUF file) that is not a local path
    is fetched from the Hugging Face Hub (`pagedrs.loader.hub`), only the files loading reads; `weights=False`
    fetches a tokenizer's files only. `opts` supplies gguf_file, the token, load_format and
    trust_remote_code. ValueError naming the path or repo when nothing is found."""
    import pagedrs.loader.hub as hub

    opts = opts or LoadOptions()
    if model is None:
        return str(default_model_path())
    path = Path(model).expanduser()
    if path.exists():
        if opts.gguf_file is not None and path.is_dir():
            path = path / opts.gguf_file
            if not path.is_file():
                raise ValueError(f"gguf_file {opts.gguf_file!r} is not in the model folder {model!r}")
        # absolute, symlinks kept: a Hub snapshot's file is a link to a blob named by its hash, and the
        # link's name (its .gguf suffix) is what says what the file is
        return os.path.abspath(path)
    if hub.is_hub_name(model):
        return hub.fetch(
            model,
            revision=revision,
            download_dir=download_dir,
            token=opts.token,
            gguf_file=opts.gguf_file if weights else None,
            load_format=opts.load_format,
            weights=weights,
            trust_remote_code=opts.trust_remote_code,
        )
    raise ValueError(
        f"model {model!r} not found: pass a local HF model folder (config.json + weights), a .gguf file, "
        "a Hugging Face Hub name (org/name), or nothing for the default model"
    )


def resolve_paths(model: str | None, tokenizer: str | None, opts: LoadOptions) -> tuple[str, str | None]:
    """(model path, tokenizer path or None) with Hub names fetched: what the engine's first process does
    once, so that the core process and the tensor-parallel ranks only ever see local paths."""
    path = resolve_model_path(model, opts.revision, opts.download_dir, opts=opts)
    tok = None
    if tokenizer is not None:
        tok = resolve_model_path(
            tokenizer, opts.tokenizer_revision, opts.download_dir, opts=opts, weights=False
        )
    return path, tok


def model_folder(path: str) -> str:
    """The HF-style folder for a resolved path: the folder itself, or the GGUF cache folder."""
    p = Path(path)
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path!r} is not a .gguf file; pass the model folder instead")
        return str(convert_gguf(p))
    if not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(convert_gguf(ggufs[0]))
        raise ValueError(f"model folder {path!r} has no config.json")
    return str(p)


def gguf_file(path: str) -> Path | None:
    """The GGUF file a resolved model path stands for (the file, or the only .gguf of a folder without
    config.json), else None."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None
