"""The transformers baselines of bench/throughput.py, in a process of their own.

On a GPU the pagedrs engine keeps most of the device's memory for its KV pool, so transformers cannot run
beside it: bench/throughput.py starts `python bench/throughput.py <its own flags> --hf-only IN OUT` after it
has released its engine. IN holds the requests (JSON: token ids, output lengths, the pad id); the child
loads the model (the same file, or for --model-config random weights of the same shape: throughput does not
depend on their values), runs the baselines and writes their figures to OUT as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

Requests = list[tuple[list[int], int]]


def run_in_child(
    script: Path, argv: list[str], reqs: Requests, pad_id: int, timeout: float
) -> dict[str, Any]:
    """The baselines' figures from a child process running `script argv --hf-only IN OUT`; on failure
    those that finished and "error"."""
    with tempfile.TemporaryDirectory(prefix="pagedrs-hf-") as tmp:
        src, dst = Path(tmp, "requests.json"), Path(tmp, "result.json")
        src.write_text(json.dumps({"requests": reqs, "pad_id": pad_id}))
        cmd = [sys.executable, str(script), *argv, "--hf-only", str(src), str(dst)]
        try:
            rc = subprocess.run(cmd, timeout=timeout).returncode
            error = None if rc == 0 else f"the transformers process exited with {rc}"
        except subprocess.TimeoutExpired:
            error = f"the transformers process ran past --hf-timeout {timeout:.0f} s"
        done = json.loads(dst.read_text()) if dst.exists() else {}  # the baselines that finished
        return done | ({"error": error} if error else {})


def hf_only(args: Any, model_config: dict[str, Any] | None, src: str, dst: str) -> int:
    """The child: load transformers' model, run the baselines the flags ask for, write them to dst."""
    spec = json.loads(Path(src).read_text())
    reqs: Requests = [(list(ids), int(n)) for ids, n in spec["requests"]]
    pad_id = int(spec["pad_id"])
    default = "bfloat16" if args.device == "cuda" else "float32"
    dtype = getattr(torch, default if args.dtype in (None, "auto") else args.dtype)  # auto: pagedrs' choice
    hf = load_hf(args.model, model_config, dtype, torch.device(args.device), args.seed)
    out: dict[str, Any] = {"device": args.device, "threads": torch.get_num_threads()}

    def save(name: str, figures: dict[str, Any]) -> None:
        """After each baseline, whole (written aside, then renamed): a timeout keeps those done."""
        out[name] = figures
        part = Path(f"{dst}.part")
        part.write_text(json.dumps(out))
        part.replace(dst)

    bs = args.hf_batch_size or len(reqs)
    if args.task == "embed":
        run_embed_hf(hf, reqs[:2], pad_id, bs)  # warm-up
        save("embed", run_embed_hf(hf, reqs, pad_id, bs) | {"batch_size": bs})
        return 0
    hf_generate(hf, [reqs[0][0][:16]], 4, pad_id)  # warm-up
    if args.hf_cb:
        save("cb", run_hf_cb(hf, reqs, args.hf_cb_attn))
    save("static", run_hf_static(hf, reqs, pad_id, bs) | {"batch_size": bs})
    seq_reqs = reqs[: args.hf_sequential_limit] if args.hf_sequential_limit else reqs
    save("sequential", run_hf_sequential(hf, seq_reqs, pad_id) | {"requests": len(seq_reqs)})
    return 0


def load_hf(
    model: str | None,
    model_config: dict[str, Any] | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> Any:
    import transformers

    if model_config is not None:
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(**model_config, architectures=["LlamaForCausalLM"])
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    from pagedrs.loader import model_folder, resolve_model_path

    folder = model_folder(resolve_model_path(model))  # the GGUF default: its converted HF folder
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def hf_generate(hf: Any, batch: list[list[int]], max_new: int, pad_id: int) -> torch.Tensor:
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(batch):  # left padding
        ids[i, width - len(x) :] = torch.tensor(x)
        mask[i, width - len(x) :] = 1
    dev = next(hf.parameters()).device
    with torch.inference_mode():
        return hf.generate(
            ids.to(dev),
            attention_mask=mask.to(dev),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=[],
            pad_token_id=pad_id,
        )


def run_hf_sequential(hf: Any, reqs: Requests, pad_id: int) -> dict[str, float]:
    total, t0 = 0, time.perf_counter()
    for ids, n in reqs:
        out = hf_generate(hf, [ids], n, pad_id)
        total += out.shape[1] - len(ids)
    _sync(hf.device)
    elapsed = time.perf_counter() - t0
    return {"tokens": total, "seconds": elapsed, "tok_s": total / elapsed}


def run_hf_static(hf: Any, reqs: Requests, pad_id: int, batch_size: int) -> dict[str, float]:
    total, t0 = 0, time.perf_counter()
    for start in range(0, len(reqs), batch_size):
        chunk = reqs[start : start + batch_size]
        hf_generate(hf, [r[0] for r in chunk], max(r[1] for r in chunk), pad_id)
        total += sum(r[1] for r in chunk)  # the tokens asked for; the rest of each row is padding work
    _sync(hf.device)
    elapsed = time.perf_counter() - t0
    return {"tokens": total, "seconds": elapsed, "tok_s": total / elapsed}


def run_hf_cb(hf: Any, reqs: Requests, attn_implementation: str | None) -> dict[str, float]:
    """transformers' continuous batching manager, one request per prompt with its own max_new_tokens.
    attn_implementation: set on the model first (transformers 5.17 on CUDA needs "paged|sdpa")."""
    from transformers import GenerationConfig

    original = hf.config._attn_implementation
    if attn_implementation:
        hf.set_attn_implementation(attn_implementation)
    try:
        cfg = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in reqs), eos_token_id=[])
        mgr = hf.init_continuous_batching(generation_config=cfg)
        mgr.start()
        t0 = time.perf_counter()
        for i, (ids, n) in enumerate(reqs):
            mgr.add_request(ids, request_id=str(i), max_new_tokens=n)
        total = 0
        for _ in reqs:
            res = mgr.get_result(timeout=600)
            if res is None:
                raise RuntimeError("transformers' continuous batching returned no result within 600 s")
            total += len(res.generated_tokens)
        elapsed = time.perf_counter() - t0
        mgr.stop(block=True)
    finally:  # static batching and generate() run after this, with the model's own attention
        if attn_implementation:
            hf.set_attn_implementation(original)
    return {"tokens": total, "seconds": elapsed, "tok_s": total / elapsed}


def run_embed_hf(hf: Any, reqs: Requests, pad_id: int, batch_size: int) -> dict[str, float]:
    """HF's base model (AutoModel's layers) on right-padded batches, the last real token pooled."""
    base = hf.base_model
    dev = next(hf.parameters()).device
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(reqs), batch_size):
            chunk = [r[0] for r in reqs[start : start + batch_size]]
            width = max(len(x) for x in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, x in enumerate(chunk):
                ids[i, : len(x)] = torch.tensor(x)
                mask[i, : len(x)] = 1
            h = base(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state
            last = mask.sum(1).to(dev) - 1
            torch.nn.functional.normalize(h[torch.arange(len(chunk), device=dev), last].float(), dim=-1)
    _sync(dev)
    elapsed = time.perf_counter() - t0
    return {"prompts": len(reqs), "seconds": elapsed, "prompts_s": len(reqs) / elapsed}
