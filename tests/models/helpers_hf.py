"""Model-level equivalence with HF transformers, shared by test_gpt2.py, test_opt.py and test_phi3.py:
logits equal HF (float32) through plain causal attention and through the paged path, and load errors name
the tensor or the architecture."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedrs.layers.attention import ForwardContext
from pagedrs.loader import load_model
from tests.helpers import load_hf_model
from tests.models.paged_harness import PagedHarness

ATOL = 1e-4


def random_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def _paged_logits(
    model: torch.nn.Module, seqs: Sequence[list[int]], prefill_lens: Sequence[int], chunk: int
) -> list[torch.Tensor]:
    """All requests in one batch per step: prompt i (its first prefill_lens[i] tokens) in chunks of at most
    `chunk` tokens, then its remaining tokens one decode at a time. Logits of every token, per request."""
    harness = PagedHarness(model, num_blocks=64, block_size=4)
    done = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        step: dict[int, list[int]] = {}
        for i, seq in enumerate(seqs):
            if done[i] < prefill_lens[i]:
                step[i] = seq[done[i] : min(done[i] + chunk, prefill_lens[i])]
            elif done[i] < len(seq):
                step[i] = seq[done[i] : done[i] + 1]
        for i, logits in harness.step(step).items():
            out[i].append(logits)
            done[i] += len(step[i])
    return [torch.cat(chunks) for chunks in out]


def assert_matches_hf(
    folder: Path, seqs: Sequence[list[int]], *, chunk: int = 5, num_decode: int = 4
) -> None:
    """pagedrs logits == HF logits for every token of every sequence, without a cache (one sequence at a
    time) and through the paged cache (the last `num_decode` tokens of each sequence as decodes)."""
    hf = load_hf_model(folder)
    model = load_model(str(folder), dtype="float32").model
    refs = []
    for seq in seqs:
        ids = torch.tensor(seq)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
            plain = model.compute_logits(model(ids, torch.arange(len(seq)), ForwardContext(None, [])))
        torch.testing.assert_close(plain, ref, atol=ATOL, rtol=0)
        refs.append(ref)
    paged = _paged_logits(model, seqs, [len(s) - num_decode for s in seqs], chunk)
    for got, ref in zip(paged, refs, strict=True):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def assert_load_errors(folder: Path, tensor: str, arch: str) -> None:
    """`folder` (safetensors): a missing tensor, a tensor of the wrong shape and an unknown architecture
    each fail in load_model with a ValueError naming it. The folder is restored afterwards."""
    path = folder / "model.safetensors"
    state = load_file(str(path))
    good = state[tensor]

    del state[tensor]
    save_file(state, str(path))
    with pytest.raises(ValueError, match=f"missing.*{tensor}"):
        load_model(str(folder), dtype="float32")

    state[tensor] = good[..., :-1].contiguous()
    save_file(state, str(path))
    with pytest.raises(ValueError, match=f"{tensor}.*shape"):
        load_model(str(folder), dtype="float32")

    state[tensor] = good
    save_file(state, str(path))
    config_path = folder / "config.json"
    original = config_path.read_text()
    config = json.loads(original)
    config["architectures"] = ["NoSuchForCausalLM"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"NoSuchForCausalLM.*{arch}"):
        load_model(str(folder), dtype="float32")
    config_path.write_text(original)
    load_model(str(folder), dtype="float32")  # restored: loads again
