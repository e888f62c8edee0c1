"""Smoke test of an installed pagedrs wheel (run by .ci/wheel in a fresh virtualenv, cargo not on
PATH): the package and its Rust extension come from the wheel, the CPU kernels chosen at run time for
this CPU, and a greedy generation on the default model. WHEEL_SMOKE_IMPORTS (comma-separated module names)
are imported first: modules only the calling environment has, to prove the virtualenv sees it."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path


def main() -> None:
    for name in filter(None, os.environ.get("WHEEL_SMOKE_IMPORTS", "").split(",")):
        importlib.import_module(name)
    import pagedrs
    from pagedrs import LLM, SamplingParams, _core

    package = Path(pagedrs.__file__).resolve().parent
    print(f"pagedrs from {package}, extension {Path(_core.__file__).name}")
    if not package.is_relative_to(Path(sys.prefix).resolve()):
        sys.exit(f"pagedrs was imported from {package}, not from the virtualenv {sys.prefix}")
    if shutil.which("cargo"):
        sys.exit("cargo is on PATH: the wheel must work without a Rust toolchain")
    print(f"CPU kernels: {_core.quant_isa()} ({_core.cpu_pool_workers()} pool workers)")
    llm = LLM(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=12)
    first, again = (llm.generate(["The capital of France is"], params, use_tqdm=False)[0] for _ in range(2))
    ids = first.outputs[0].token_ids
    print(f"greedy: {first.outputs[0].text!r}")
    if not ids or list(ids) != list(again.outputs[0].token_ids):
        sys.exit("greedy generation produced no tokens or differed between two runs")


if __name__ == "__main__":
    main()
