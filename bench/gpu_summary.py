"""Fold the JSON of bench/gpu_kernels.py and two bench/throughput.py runs (Llama-3-8B and Llama-3.2-1B shapes)
into bench/results/gpu-summary.json: the headline GPU figures in one small file.

How a GPU session produces it (../shared/GPU.md: no git and no Rust on the GPU machine). Here, with the
change committed: build the wheel, put the tree of HEAD, the wheel and the commit in `.gpu/` (ignored
through .git/info/exclude) and name `.gpu` in `carry`:

    maturin build --release -o /tmp/wheels
    mkdir -p .gpu/.whl && git archive HEAD | tar -x -C .gpu && cp /tmp/wheels/pagedrs-*.whl .gpu/.whl/
    git rev-parse HEAD > .gpu/COMMIT

On the GPU machine, one `run` call per benchmark (each under the 10-minute limit), each command starting
with the line that installs the wheel (the scripts import the installed package) and exports the commit.
First the correctness suite (kernels, fused layer ops, CUDA graphs, greedy ids against the torch path):

    <the first two lines of the gpu_kernels.py command below> cd .gpu && python -m pytest -q -x tests/gpu

then the benchmarks:

    [ -d /tmp/site/pagedrs ] || pip install -q --no-index --no-deps --target /tmp/site .gpu/.whl/*.whl; \
    export PYTHONPATH=/tmp/site PAGEDRS_COMMIT=$(cat .gpu/COMMIT); \
    python .gpu/bench/gpu_kernels.py --out $OUT/kernels.json

    <same first two lines> python .gpu/bench/throughput.py --device cuda --model-config llama-3-8b \
        --num-prompts 256 --input-len 64 1024 --output-len 64 512 --passes 2 --hf-cb \
        --hf-cb-attn "paged|sdpa" --hf-sequential-limit 4 --hf-timeout 360 --json $OUT/throughput-8b.json

    <same first two lines> python .gpu/bench/throughput.py --device cuda --model-config llama-3.2-1b \
        --num-prompts 256 --input-len 64 1024 --output-len 64 512 --passes 2 --hf-cb \
        --hf-cb-attn "paged|sdpa" --hf-sequential-limit 4 --hf-timeout 360 --json $OUT/throughput-1b.json

Back here, with the returned files copied into bench/results/:

    python bench/gpu_summary.py --kernels bench/results/kernels.json \
        --throughput-8b bench/results/throughput-8b.json --throughput-1b bench/results/throughput-1b.json

--hf-timeout keeps each call under the limit: transformers runs last, in its own process, and what it has
not finished by then is missing from the JSON (hf_error says so; the script then exits 1 after writing it).
`--step-timing` on a throughput run synchronises the device at every step boundary: exact per-step times
for a separate look, not the headline run.

Keys: device and commit; from gpu_kernels.py decode_tbps (the best paged decode attention bandwidth at context
>= 4k, TB/s), decode_bw_fraction (decode_tbps over the device's HBM data-sheet bandwidth: 3.35 TB/s H100
SXM, 4.8 TB/s H200) and prefill_time_vs_sdpa (paged prefill attention time / torch SDPA's, median over
lengths); from the 8B run throughput_vs_hf_cb (pagedrs output tok/s / transformers continuous batching's),
decode_step_vs_roofline (decode-only steps: measured time / roofline time) and first_pass_vs_steady (pass 1
time / the later passes' mean, new prompts each pass); from each run e2e_vs_roofline_8b / _1b (end-to-end
time / the sum of the per-step rooflines). A figure whose input is not given is null; `from` names the input
of each figure and `sources` each input's path and commit. The commit: --commit or $PAGEDRS_COMMIT, else
the one commit the inputs name, else this checkout's HEAD, else "unknown".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from _common import add_commit_arg, explicit_commit, resolve_commit, write_json

KEYS = (
    "device",
    "commit",
    "decode_bw_fraction",
    "decode_tbps",
    "prefill_time_vs_sdpa",
    "throughput_vs_hf_cb",
    "decode_step_vs_roofline",
    "e2e_vs_roofline_8b",
    "e2e_vs_roofline_1b",
    "first_pass_vs_steady",
)
INPUTS = ("kernels", "throughput-8b", "throughput-1b")

# summary key: (input, key in that input's JSON)
FIGURES: dict[str, tuple[str, str]] = {
    "decode_bw_fraction": ("kernels", "decode_bw_fraction"),
    "decode_tbps": ("kernels", "decode_tbps"),
    "prefill_time_vs_sdpa": ("kernels", "prefill_time_vs_sdpa"),
    "throughput_vs_hf_cb": ("throughput-8b", "throughput_vs_hf_cb"),
    "decode_step_vs_roofline": ("throughput-8b", "decode_step_vs_roofline"),
    "e2e_vs_roofline_8b": ("throughput-8b", "e2e_vs_roofline"),
    "e2e_vs_roofline_1b": ("throughput-1b", "e2e_vs_roofline"),
    "first_pass_vs_steady": ("throughput-8b", "first_pass_vs_steady"),
}


def summarize(inputs: dict[str, dict[str, Any]], commit: str | None = None) -> dict[str, Any]:
    """The summary of the inputs given (name in INPUTS -> its parsed JSON). commit: the explicit one, if
    any; else the one commit the inputs name; else resolve_commit()."""
    named = {d.get("commit") for d in inputs.values()} - {None, "unknown"}
    if not commit:
        commit = named.pop() if len(named) == 1 else resolve_commit()
    # gpu_kernels.py names the GPU in "device"; throughput.py in "device_name" ("device" is cuda / cpu there)
    devices = [d.get("device_name") or d.get("device") for _, d in sorted(inputs.items())]
    out: dict[str, Any] = dict.fromkeys(KEYS)
    out["device"] = next((d for d in devices if d), None)
    out["commit"] = commit
    out["from"] = {}
    for key, (name, field) in FIGURES.items():
        if inputs.get(name, {}).get(field) is not None:
            out[key] = inputs[name][field]
            out["from"][key] = name
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=Path, help="the JSON of bench/gpu_kernels.py --out")
    p.add_argument("--throughput-8b", type=Path, help="bench/throughput.py --model-config llama-3-8b --json")
    p.add_argument(
        "--throughput-1b", type=Path, help="bench/throughput.py --model-config llama-3.2-1b --json"
    )
    p.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gpu-summary.json"
    )
    add_commit_arg(p)
    args = p.parse_args(argv)
    paths = {name: getattr(args, name.replace("-", "_")) for name in INPUTS}
    paths = {name: path for name, path in paths.items() if path is not None}
    if not paths:
        p.error("give at least one of --kernels, --throughput-8b, --throughput-1b")
    inputs = {name: json.loads(path.read_text()) for name, path in paths.items()}
    summary = summarize(inputs, explicit_commit(args.commit))
    summary["sources"] = {
        name: {"path": str(paths[name]), "commit": d.get("commit")} for name, d in inputs.items()
    }
    others = sorted({str(s["commit"]) for s in summary["sources"].values()} - {summary["commit"]})
    if others:
        print(
            f"warning: inputs name other commits than {summary['commit']}: {', '.join(others)}",
            file=sys.stderr,
        )
    write_json(args.out, summary)
    print(json.dumps({k: summary[k] for k in KEYS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
