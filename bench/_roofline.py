"""Roofline times of engine steps: the bytes a step must move over the device's HBM bandwidth and the FLOPs it
must do over the device's dense bf16 peak; a step can be no faster than the larger of the two.

A step's bytes: every weight a forward reads once (the layers and the LM head; the embedding rows it gathers
are not counted), the K/V of the context cached before the step (read by attention) and the K/V of the
step's own tokens (written). Its FLOPs: 2 x layer parameters per token, 2 x LM-head parameters per sampled
row, and attention: 4 x heads x head_dim per (query, key) pair under the causal mask (no sliding window),
per layer. Activations, norms and rotary embeddings are left out: they are small next to these at the
shapes measured. Pure functions of counts, so that tests can check them by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# (substring of torch.cuda.get_device_name(), HBM TB/s, dense bf16 TFLOP/s); the first match wins, so the
# more specific names come first. NVIDIA's data sheets.
DEVICE_SPECS: tuple[tuple[str, float, float], ...] = (
    ("H200 NVL", 4.8, 835.0),
    ("H200", 4.8, 989.0),
    ("H100 PCIe", 2.0, 756.0),
    ("H100 NVL", 3.9, 835.0),
    ("H100", 3.35, 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
)

STEP_KINDS = ("prefill", "decode", "mixed")
ROOFLINE_KEYS = ("memory_seconds", "compute_seconds", "roofline_seconds", "roofline_mean_ms", "vs_roofline")


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    hbm_tbps: float | None  # 1e12 bytes/s
    peak_tflops: float | None  # 1e12 FLOP/s, dense bf16

    @property
    def complete(self) -> bool:
        return self.hbm_tbps is not None and self.peak_tflops is not None


def device_spec(name: str, hbm_tbps: float | None = None, peak_tflops: float | None = None) -> DeviceSpec:
    """The data-sheet figures of the device called `name` (None where it is not in DEVICE_SPECS: a CPU, an
    unknown GPU); hbm_tbps / peak_tflops, when given, replace them."""
    for key, tbps, tflops in DEVICE_SPECS:
        if key in name:
            return DeviceSpec(
                name, tbps if hbm_tbps is None else hbm_tbps, tflops if peak_tflops is None else peak_tflops
            )
    return DeviceSpec(name, hbm_tbps, peak_tflops)


@dataclass(frozen=True, slots=True)
class ModelShape:
    body_params: int  # weights every token goes through: all but the embeddings and the LM head
    lm_head_params: int  # applied to sampled rows only
    weight_bytes: int  # read once per forward: the body and the LM head
    num_layers: int
    num_heads: int  # query heads
    head_dim: int
    kv_bytes_per_token: int  # K and V of one token over all layers, in the cache's dtype

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


def model_shape(net: Any, hf_config: Any, kv_bytes_per_token: int) -> ModelShape:
    """The shape of a torch model: its parameters (tied weights once), the LM head found as `net.lm_head`,
    embeddings as the parameters of modules whose class name ends in "Embedding"."""
    params = {id(p): p for p in net.parameters()}
    head = getattr(net, "lm_head", None)
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    embed_ids = {
        id(p)
        for m in net.modules()
        if type(m).__name__.endswith("Embedding")
        for p in m.parameters(recurse=False)
    } - head_ids
    body = [p for i, p in params.items() if i not in head_ids and i not in embed_ids]
    heads = [params[i] for i in head_ids if i in params]
    num_heads = int(hf_config.num_attention_heads)
    head_dim = getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // num_heads
    return ModelShape(
        body_params=sum(p.numel() for p in body),
        lm_head_params=sum(p.numel() for p in heads),
        weight_bytes=sum(p.numel() * p.element_size() for p in (*body, *heads)),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=num_heads,
        head_dim=int(head_dim),
        kv_bytes_per_token=int(kv_bytes_per_token),
    )


@dataclass(frozen=True, slots=True)
class StepLoad:
    """What one engine step computes, independent of the model."""

    kind: str  # prefill (no decode tokens), decode (only decode tokens) or mixed
    num_tokens: int  # tokens through the model (their K/V is written)
    num_sampled: int  # rows through the LM head
    kv_read_tokens: int  # context tokens cached before the step, read by attention
    attn_pairs: int  # (query, key) pairs under the causal mask, per layer and head


def step_load(
    num_computed: Sequence[int],
    num_scheduled: Sequence[int],
    num_sampled: int,
    num_prefill_tokens: int,
    num_decode_tokens: int,
) -> StepLoad:
    """A step from its plan: per sequence the tokens cached before it (c) and the tokens it runs (n). The
    token at position p attends to p + 1 keys, so a sequence has n * c + n * (n + 1) / 2 pairs."""
    if num_decode_tokens and num_prefill_tokens:
        kind = "mixed"
    elif num_decode_tokens:
        kind = "decode"
    else:
        kind = "prefill"
    pairs = sum(
        int(n) * int(c) + int(n) * (int(n) + 1) // 2 for c, n in zip(num_computed, num_scheduled, strict=True)
    )
    return StepLoad(
        kind=kind,
        num_tokens=int(sum(int(n) for n in num_scheduled)),
        num_sampled=int(num_sampled),
        kv_read_tokens=int(sum(int(c) for c in num_computed)),
        attn_pairs=pairs,
    )


def step_bytes(shape: ModelShape, load: StepLoad) -> int:
    """Weights + K/V read + K/V written."""
    return shape.weight_bytes + shape.kv_bytes_per_token * (load.kv_read_tokens + load.num_tokens)


def step_flops(shape: ModelShape, load: StepLoad) -> int:
    return (
        2 * shape.body_params * load.num_tokens
        + 2 * shape.lm_head_params * load.num_sampled
        + 4 * shape.num_layers * shape.num_heads * shape.head_dim * load.attn_pairs
    )


def roofline_seconds(shape: ModelShape, load: StepLoad, spec: DeviceSpec) -> tuple[float, float, float]:
    """(memory time, compute time, roofline time = the larger) of one step; spec must be complete."""
    if spec.hbm_tbps is None or spec.peak_tflops is None:
        raise ValueError(f"no HBM bandwidth or peak FLOP/s for {spec.name!r}")
    memory = step_bytes(shape, load) / (spec.hbm_tbps * 1e12)
    compute = step_flops(shape, load) / (spec.peak_tflops * 1e12)
    return memory, compute, max(memory, compute)


def summarize_steps(
    steps: Iterable[tuple[StepLoad, float]], shape: ModelShape | None, spec: DeviceSpec | None
) -> dict[str, dict[str, Any]]:
    """Per step kind: steps, tokens, measured seconds, bytes, FLOPs, achieved TB/s and TFLOP/s and, where
    the spec is complete, memory / compute / roofline seconds and measured / roofline (else those are None).
    A kind's roofline is the sum of its steps' rooflines, each the larger of its memory and compute times."""
    by_kind: dict[str, list[tuple[StepLoad, float]]] = {}
    for load, seconds in steps:
        by_kind.setdefault(load.kind, []).append((load, seconds))
    return {kind: _summarize(by_kind[kind], shape, spec) for kind in STEP_KINDS if kind in by_kind}


def _summarize(
    steps: list[tuple[StepLoad, float]], shape: ModelShape | None, spec: DeviceSpec | None
) -> dict[str, Any]:
    seconds = sum(s for _, s in steps)
    row: dict[str, Any] = {
        "steps": len(steps),
        "tokens": sum(load.num_tokens for load, _ in steps),
        "seconds": seconds,
        "mean_ms": 1e3 * seconds / len(steps),
    }
    if shape is None:
        return row
    nbytes = sum(step_bytes(shape, load) for load, _ in steps)
    flops = sum(step_flops(shape, load) for load, _ in steps)
    row |= {
        "bytes": nbytes,
        "flops": flops,
        "achieved_tbps": nbytes / seconds / 1e12 if seconds > 0 else None,
        "achieved_tflops": flops / seconds / 1e12 if seconds > 0 else None,
    }
    if spec is None or not spec.complete:
        return row | dict.fromkeys(ROOFLINE_KEYS)
    times = [roofline_seconds(shape, load, spec) for load, _ in steps]
    roof = sum(t[2] for t in times)
    return row | {
        "memory_seconds": sum(t[0] for t in times),
        "compute_seconds": sum(t[1] for t in times),
        "roofline_seconds": roof,
        "roofline_mean_ms": 1e3 * roof / len(steps),
        "vs_roofline": seconds / roof if roof > 0 else None,
    }


def pass_figures(
    tokens: int, seconds: float, steps: Iterable[tuple[StepLoad, float]], shape: ModelShape, spec: DeviceSpec
) -> dict[str, Any]:
    """One pass of a workload: its output tokens and seconds end to end, its steps by kind, and its time
    against its roofline (the sum of its steps' rooflines; None without a complete spec)."""
    by_kind = summarize_steps(steps, shape, spec)
    roof = sum(r["roofline_seconds"] for r in by_kind.values()) if spec.complete else None
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "steps": by_kind,
        "e2e_roofline_seconds": roof,
        "e2e_vs_roofline": seconds / roof if roof else None,
    }


def headline(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of pass 1 (steps, end to end, decode steps vs roofline), every pass, and with more than
    one pass the steady state: first_pass_vs_steady = pass 1 seconds / the later passes' mean."""
    first, later = passes[0], passes[1:]
    steady_seconds = sum(p["seconds"] for p in later) / len(later) if later else None
    return {
        "steps": first["steps"],
        "e2e_seconds": first["seconds"],
        "e2e_roofline_seconds": first["e2e_roofline_seconds"],
        "e2e_vs_roofline": first["e2e_vs_roofline"],
        "decode_step_vs_roofline": first["steps"].get("decode", {}).get("vs_roofline"),
        "passes": passes,
        "pagedrs_steady_tok_s": sum(p["tokens"] for p in later) / sum(p["seconds"] for p in later)
        if later
        else None,
        "first_pass_vs_steady": first["seconds"] / steady_seconds if steady_seconds else None,
    }


def report_lines(passes: list[dict[str, Any]], spec: DeviceSpec, synchronized: bool) -> list[str]:
    """What a person reads: how steps were timed, pass 1 per step kind and end to end, first vs steady."""
    first = passes[0]
    lines = [
        "step times: wall time of each engine.step(), "
        + (
            "device synchronised at every step boundary (--step-timing: exact per step; the run is slower)"
            if synchronized
            else "device not synchronised at step boundaries (a step that only prefills may hand part of "
            "its device time to the next step; --step-timing synchronises)"
        )
    ]
    if not spec.complete:
        lines.append(
            f"roofline: no HBM bandwidth or peak FLOP/s known for {spec.name!r} (--hbm-tbps, --peak-tflops): "
            "roofline fields are null"
        )
    lines += format_steps(first["steps"])
    if first["e2e_vs_roofline"] is not None:
        lines.append(
            f"end to end: {first['seconds']:.4g} s (pagedrs) vs {first['e2e_roofline_seconds']:.4g} s "
            f"(roofline at {spec.hbm_tbps} TB/s, {spec.peak_tflops} TFLOP/s) = "
            f"{first['e2e_vs_roofline']:.2f} x"
        )
    if len(passes) > 1:
        later = sum(p["seconds"] for p in passes[1:]) / (len(passes) - 1)
        lines.append(
            f"first pass vs steady: {first['seconds']:.3g} s (pass 1) vs {later:.3g} s (mean of passes "
            f"2..{len(passes)}, new prompts) = {first['seconds'] / later:.2f} x"
        )
    return lines


def format_steps(summary: dict[str, dict[str, Any]]) -> list[str]:
    """One line per step kind of a summarize_steps result."""
    lines = []
    for kind, row in summary.items():
        text = (
            f"  {kind:7s}: {row['steps']:6d} steps, {row['tokens']:8d} tokens, mean {row['mean_ms']:9.3f} ms"
        )
        if row.get("vs_roofline") is not None:
            text += (
                f" vs roofline {row['roofline_mean_ms']:.3f} ms = {row['vs_roofline']:.2f} x "
                f"(roofline over the class: memory {row['memory_seconds']:.4g} s, "
                f"compute {row['compute_seconds']:.4g} s)"
            )
        lines.append(text)
    return lines
