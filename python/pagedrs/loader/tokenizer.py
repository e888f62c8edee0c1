"""A model's tokenizer (and chat template): from its folder, a GGUF file, or a tokenizer given apart."""

from __future__ import annotations

from pathlib import Path

import transformers

from pagedrs.loader.options import LoadOptions
from pagedrs.loader.paths import model_folder, resolve_model_path

__all__ = ["load_tokenizer", "tokenizer_from"]


def tokenizer_from(source: str, opts: LoadOptions | None = None) -> transformers.PreTrainedTokenizerBase:
    opts = opts or LoadOptions()
    kw: dict = {"use_fast": opts.tokenizer_mode != "slow", "trust_remote_code": opts.trust_remote_code}
    try:
        if source.lower().endswith(".gguf"):
            p = Path(source)
            return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, **kw)
        return transformers.AutoTokenizer.from_pretrained(source, **kw)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {source!r}: {e}") from e


def load_tokenizer(
    model: str | None, tokenizer: str | None = None, opts: LoadOptions | None = None
) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer `load_model` would load (for a frontend whose engine core loads the model)."""
    opts = opts or LoadOptions()
    if tokenizer is not None:
        return tokenizer_from(
            resolve_model_path(
                tokenizer, opts.tokenizer_revision, opts.download_dir, opts=opts, weights=False
            ),
            opts,
        )
    return tokenizer_from(
        model_folder(resolve_model_path(model, opts.revision, opts.download_dir, opts=opts)), opts
    )
